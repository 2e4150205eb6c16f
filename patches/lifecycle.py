"""ModelPatcher's weight lifecycle, patched once for every cache that must follow it.

Several caches hold things tied to a model's weights or device: the conditioning cache's
device-hot entries, the PE cache's device tables, the captured CUDA graphs. Each must hear when
ComfyUI loads, unloads or re-patches a model. Wrapping the same ModelPatcher methods once per cache
would stack wrappers whose uninstall order matters (an uninstall in the middle of the stack puts a
stale wrapper back). So this module wraps each method once and calls the listeners registered for
it, before the host method runs, as ``fn(patcher, *args, **kwargs)``. A listener's exception is
logged and never breaks ComfyUI's memory management.

Events (the ModelPatcher methods): ``load``, ``unpatch_model``, ``partially_unload``, ``detach``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("reusekit")

EVENTS = ("load", "unpatch_model", "partially_unload", "detach")
MARK = "__reusekit_lifecycle__"

_lock = threading.Lock()
_listeners: dict[str, list[Callable]] = {e: [] for e in EVENTS}
_originals: dict[str, Callable] = {}


def _wrap(event: str, original: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        for fn in list(_listeners[event]):
            try:
                fn(self, *args, **kwargs)
            except Exception:
                log.exception("ReuseKit: a %s listener failed (ignored)", event)
        return original(self, *args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = original.__name__
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, MARK, True)
    return wrapper


def install() -> bool:
    """Wrap the lifecycle methods once (idempotent); False when the host lacks one (nothing changes)."""
    import comfy.model_patcher

    cls = comfy.model_patcher.ModelPatcher
    with _lock:
        if _originals:
            return True
        if not all(callable(cls.__dict__.get(e)) for e in EVENTS):
            log.warning("ReuseKit: this ComfyUI's ModelPatcher lacks one of %s; caches will not follow "
                        "model unloads (device entries stay until cleared)", ", ".join(EVENTS))
            return False
        for event in EVENTS:
            _originals[event] = cls.__dict__[event]
            setattr(cls, event, _wrap(event, _originals[event]))
        return True


def uninstall() -> None:
    """Put the host methods back (idempotent); listeners stay registered for a later install."""
    import comfy.model_patcher

    cls = comfy.model_patcher.ModelPatcher
    with _lock:
        for event, original in _originals.items():
            setattr(cls, event, original)
        _originals.clear()


def installed() -> bool:
    return bool(_originals)


def add_listener(event: str, fn: Callable) -> None:
    """Call ``fn(patcher, *args, **kwargs)`` before every ``ModelPatcher.<event>``; installs the wrap."""
    if event not in _listeners:
        raise ValueError(f"unknown ModelPatcher event {event!r} (known: {', '.join(EVENTS)})")
    with _lock:
        if fn not in _listeners[event]:
            _listeners[event].append(fn)
    install()


def remove_listener(event: str, fn: Callable) -> None:
    with _lock:
        if fn in _listeners.get(event, []):
            _listeners[event].remove(fn)


def listening(event: str, fn: Callable) -> bool:
    """True when ``fn`` hears ``event`` now (registered, and the wrap installed)."""
    with _lock:
        return bool(_originals) and fn in _listeners.get(event, [])
