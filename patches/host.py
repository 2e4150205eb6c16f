"""What this ComfyUI offers the pack: its version, a shape check for every seam a patch relies on,
and the start-up line that says which layers are active and which are off, and why.

A patch calls :func:`check` at install with what it expects of its target (parameter names in
order, attributes). When the host differs (a newer ComfyUI renamed or reshaped it), the feature
stays off, one warning names the feature, the host version and what differs, and nothing is
patched: the host runs unchanged. Each layer reports itself with :func:`set_layer`;
:func:`startup_line` gathers them.
"""

from __future__ import annotations

import inspect
import logging
import threading

log = logging.getLogger("reusekit")

_lock = threading.Lock()
_said: set[str] = set()
_layers: dict[str, tuple[str, str]] = {}  # layer -> (state, detail)
_off: dict[str, str] = {}                 # feature -> why it is off on this host


def comfyui_version() -> str:
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # a checkout without the version file
        return "unknown"


def say_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, msg, *args)


def _parameter_names(target) -> list[str] | None:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def differs(target, params: tuple[str, ...] = (), attrs: tuple[str, ...] = (), exact: bool = False) -> str | None:
    """What about ``target`` differs from what a patch expects (``None``: nothing).

    ``params``: parameter names that must appear in this order (others may stand between them, unless
    ``exact``: a replacement with a fixed signature needs exactly these); ``attrs``: attributes
    ``target`` must have."""
    if target is None:
        return "it is missing"
    if params:
        names = _parameter_names(target)
        if names is None:
            return "its signature cannot be read"
        it = iter(names)
        if (names != list(params)) if exact else any(p not in it for p in params):
            expected = "exactly" if exact else "in that order"
            return f"its parameters are ({', '.join(names)}), expected {', '.join(params)} {expected}"
    absent = [a for a in attrs if not hasattr(target, a)]
    if absent:
        return f"it has no {', '.join(absent)}"
    return None


def check(feature: str, where: str, target, params: tuple[str, ...] = (), attrs: tuple[str, ...] = (),
          exact: bool = False) -> bool:
    """True when ``target`` (found at ``where``) has the expected shape (see :func:`differs`);
    otherwise ``feature`` is off on this host: one warning says so, and :func:`off_features` lists it."""
    why = differs(target, params, attrs, exact)
    if why is None:
        return True
    reason = f"{where}: {why}"
    with _lock:
        _off[feature] = reason
    say_once(f"shape:{feature}", "ReuseKit: %s is off on ComfyUI %s (%s); ComfyUI runs it unchanged",
             feature, comfyui_version(), reason, level=logging.WARNING)
    return False


def off_features() -> dict[str, str]:
    with _lock:
        return dict(_off)


def set_layer(layer: str, state: str, detail: str = "") -> None:
    """Record a layer's state for the start-up line (``state``: "on", "off", ...)."""
    with _lock:
        _layers[layer] = (state, detail)


def layers() -> dict[str, tuple[str, str]]:
    with _lock:
        return dict(_layers)


ORDER = ("conditioning cache", "PE cache", "step cache", "graph capture", "panel")  # pipeline order


def startup_line(pack_version: str) -> str:
    ordered = sorted(layers().items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER))
    parts = [f"{name} {state}" + (f" ({detail})" if detail else "") for name, (state, detail) in ordered]
    return f"ReuseKit {pack_version} on ComfyUI {comfyui_version()}: " + "; ".join(parts)
