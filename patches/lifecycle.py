"""ModelPatcher's weight lifecycle, patched once for the caches that must follow every patcher.

Two caches hold things tied to a model's weights or device and shared by all clones of it:
graph capture (graphs bake in the weights' addresses, so any clone loading, unloading or
re-patching the shared weights, say a LoRA loader's, must release them) and the PE cache (its
device tables belong to the model under every patcher, the server-wide default included, and go
when any patcher detaches it). ComfyUI's per-patcher callbacks (``CallbacksMP.ON_LOAD`` /
``ON_DETACH``) fire only on the clone that carries them, never on such a sibling, hence this wrap.
The step cache needs none of it: its state lives for one run, inside its own patcher's wrappers.

Wrapping the same ModelPatcher methods once per cache would stack wrappers whose uninstall order
matters (an uninstall in the middle of the stack puts a stale wrapper back). So this module wraps
each method once and calls the listeners registered for it, before the host method runs, as
``fn(patcher, *args, **kwargs)``. A listener's exception is logged and never breaks ComfyUI's
memory management.

A call made while a patcher is being finalized (ComfyUI's ``ModelPatcher.__del__`` detaches it, and the
garbage collector may run that on any thread while any lock is held) only records the event: its
listeners run at the next safe point (:func:`settle`: the next lifecycle call, the next graph call, the
next stats snapshot) with a stand-in patcher that has the model (``.model``) only. Listeners must not
need more than that from such a call.

Events (the ModelPatcher methods): ``load``, ``unpatch_model``, ``partially_unload``, ``detach``.
Subclasses that override one (ComfyUI 0.16+'s ``ModelPatcherDynamic``, a custom node's patcher)
are wrapped too, also those defined later; a call fires its listeners once, with the outermost
method's arguments, even where the override calls ``super()``. A method whose parameters differ
from what the listeners expect stays unwrapped, with one warning (patches/host.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable

from ..caching.stats import REGISTRY
from . import host

log = logging.getLogger("reusekit")

EVENTS = ("load", "unpatch_model", "partially_unload", "detach")
PARAMS = {"load": ("self", "device_to"), "unpatch_model": ("self", "device_to", "unpatch_weights"),
          "partially_unload": ("self", "device_to", "memory_to_free"), "detach": ("self", "unpatch_all")}
"""The parameters (in order) the listeners rely on for each event."""
MARK = "__reusekit_lifecycle__"

_lock = threading.RLock()
_listeners: dict[str, list[Callable]] = {e: [] for e in EVENTS}
_originals: dict[tuple[type, str], Callable] = {}  # (class, event) -> the class's own method
_base: list[type] = []  # the ModelPatcher class, while installed
_active = threading.local()  # calls in progress on this thread: (event, id(patcher), id(model))
_deferred: deque = deque()  # (event, weakref to the model, args, kwargs) recorded inside finalizers
_FINALIZE_CALL = weakref.finalize.__call__.__code__


def _in_finalizer() -> bool:
    """True when a finalizer is on this thread's stack (``__del__``, ``weakref.finalize``): the
    garbage collector may have started it anywhere, with any lock held."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code is _FINALIZE_CALL:
            return True
        frame = frame.f_back
    return False


class _Finalized:
    """The stand-in a deferred call's listeners get: the finalized patcher's model only."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model


def _notify(event: str, patcher, args: tuple, kwargs: dict) -> None:
    for fn in list(_listeners[event]):
        try:
            fn(patcher, *args, **kwargs)
        except Exception:
            log.exception("ReuseKit: a %s listener failed (ignored)", event)


def settle() -> None:
    """Run the listeners of the calls recorded inside finalizers (never from one)."""
    while _deferred:
        try:
            event, model_ref, args, kwargs = _deferred.popleft()
        except IndexError:
            break
        model = model_ref()
        if model is not None:  # a model that died took what the listeners would release with it
            _notify(event, _Finalized(model), args, kwargs)


def in_progress(model, events: tuple[str, ...]) -> bool:
    """Whether one of ``events`` runs on this thread for a patcher of ``model`` (ComfyUI sets its weights anew
    in a load or an unload)."""
    return any(e in events and m == id(model) for e, _, m in getattr(_active, "calls", ()))


def _wrap(event: str, original: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        calls = _active.__dict__.setdefault("calls", [])
        if any(e == event and p == id(self) for e, p, _ in calls):  # an override's super() call: its listeners ran
            return original(self, *args, **kwargs)
        if _in_finalizer():  # record only (docs/development.md, "Rules for contributors"); settle() notifies
            model = getattr(self, "model", None)
            if model is not None and _listeners[event]:
                try:
                    model_ref = weakref.ref(model)
                except TypeError:  # not weakly referable: held until settle()
                    model_ref = (lambda m: lambda: m)(model)
                _deferred.append((event, model_ref, args, kwargs))
        else:
            settle()
            _notify(event, self, args, kwargs)
        call = (event, id(self), id(getattr(self, "model", None)))
        calls.append(call)
        try:
            return original(self, *args, **kwargs)
        finally:
            calls.remove(call)

    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = getattr(original, "__qualname__", original.__name__)
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    setattr(wrapper, MARK, True)
    return wrapper


def _wrap_class(cls: type) -> None:
    """Wrap the lifecycle methods ``cls`` defines itself (not inherited), once each."""
    for event in EVENTS:
        method = cls.__dict__.get(event)
        if not callable(method) or getattr(method, MARK, False) or (cls, event) in _originals:
            continue
        where = f"{cls.__module__}.{cls.__qualname__}.{event}"
        if not host.check(f"cache release on {cls.__qualname__}.{event}", where, method, PARAMS[event]):
            continue
        _originals[(cls, event)] = method
        setattr(cls, event, _wrap(event, method))


def _subclasses(cls: type) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo.extend(sub.__subclasses__())
    return found


def _is_hook(attr) -> bool:
    return getattr(attr, "__func__", None) is _init_subclass


def _init_subclass(cls, **kwargs) -> None:
    """Installed as ``ModelPatcher.__init_subclass__``: a subclass defined later is wrapped too."""
    hooked = next(b for b in cls.__mro__[1:] if _is_hook(b.__dict__.get("__init_subclass__")))
    super(hooked, cls).__init_subclass__(**kwargs)
    with _lock:
        if _base:
            _wrap_class(cls)


def install() -> bool:
    """Wrap the lifecycle methods of ModelPatcher and its subclasses (idempotent); False when
    ModelPatcher cannot be followed at all (nothing changes)."""
    import comfy.model_patcher

    cls = comfy.model_patcher.ModelPatcher
    with _lock:
        if _base:
            return True
        if "__init_subclass__" in cls.__dict__:  # a host that hooks its own subclasses: stay out of it
            log.warning("ReuseKit: this ComfyUI's ModelPatcher defines __init_subclass__; patchers defined "
                        "after start-up will not be followed")
        else:
            cls.__init_subclass__ = classmethod(_init_subclass)
        _base.append(cls)
        for c in (cls, *_subclasses(cls)):
            _wrap_class(c)
        REGISTRY.add_settler(settle)
        return any((cls, e) in _originals for e in EVENTS)


def uninstall() -> None:
    """Put the host methods back (idempotent); listeners stay registered for a later install."""
    with _lock:
        if not _base:
            return
        cls = _base.pop()
        if _is_hook(cls.__dict__.get("__init_subclass__")):
            del cls.__init_subclass__
        for (owner, event), original in _originals.items():
            current = owner.__dict__.get(event)
            if getattr(current, "__wrapped__", None) is original and getattr(current, MARK, False):
                setattr(owner, event, original)
            else:
                log.warning("ReuseKit: %s.%s was replaced by someone else; left as it is",
                            owner.__qualname__, event)
        _originals.clear()


def installed() -> bool:
    return bool(_base)


def wrapped(cls: type, event: str) -> bool:
    """True when ``cls``'s own ``event`` method fires the listeners."""
    with _lock:
        return (cls, event) in _originals


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
    """True when ``fn`` hears ``event`` now (registered, and ModelPatcher's method wrapped)."""
    with _lock:
        return bool(_base) and (_base[0], event) in _originals and fn in _listeners.get(event, [])
