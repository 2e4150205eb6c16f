"""ComfyUI's memory manager, told about the device memory the pack's caches hold.

``comfy.model_management.free_memory(memory_required, device, ...)`` is how ComfyUI makes room
before it loads a model. It is wrapped once; before the host frees anything, each registered
*releaser* (``fn(device: str, need_bytes: int) -> int`` freed) gives back what it holds on that
device, in the order they were added, until the shortfall is covered. A releaser's exception is
logged and never breaks ComfyUI's memory management.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from . import host

log = logging.getLogger("reusekit")

FEATURE = "freeing cache memory when ComfyUI needs it"
WHERE = "comfy.model_management.free_memory"

_lock = threading.Lock()
_releasers: list[tuple[str, Callable[[str, int], int]]] = []
_original: Callable | None = None


def release(device, need_bytes: int) -> int:
    """Ask every releaser for device memory until ``need_bytes`` are freed; returns bytes freed."""
    freed = 0
    with _lock:
        releasers = list(_releasers)
    for name, fn in releasers:
        if freed >= need_bytes:
            break
        try:
            freed += int(fn(str(device), need_bytes - freed) or 0)
        except Exception:
            log.exception("ReuseKit: freeing the %s's device memory failed (ignored)", name)
    return freed


def _free_memory(memory_required, device, *args, **kwargs):
    import comfy.model_management as mm

    try:
        if getattr(device, "type", "cpu") != "cpu" and _releasers:
            short = memory_required - mm.get_free_memory(device)
            if short > 0 and release(device, short):
                mm.soft_empty_cache()
    except Exception:  # never let the caches break ComfyUI's memory management
        log.exception("ReuseKit: freeing cache memory failed (ignored)")
    return _original(memory_required, device, *args, **kwargs)


def add_releaser(name: str, fn: Callable[[str, int], int]) -> bool:
    """Register ``fn`` (idempotent by name) and install the wrap; False where the host's
    ``free_memory`` has another shape (the caches then hold their memory until cleared)."""
    with _lock:
        if all(n != name for n, _ in _releasers):
            _releasers.append((name, fn))
    return install()


def remove_releaser(name: str) -> None:
    with _lock:
        _releasers[:] = [(n, f) for n, f in _releasers if n != name]


def install() -> bool:
    global _original
    import comfy.model_management as mm

    with _lock:
        if _original is not None:
            return True
        current = getattr(mm, "free_memory", None)
        if not host.check(FEATURE, WHERE, current, ("memory_required", "device")):
            return False
        _original = current
        mm.free_memory = _free_memory
        return True


def uninstall() -> None:
    """Put the host's function back, unless another pack wrapped it after us (then leave it)."""
    global _original
    import comfy.model_management as mm

    with _lock:
        if _original is None:
            return
        if mm.free_memory is not _free_memory:  # its wrapper still calls ours, which needs the original
            log.warning("ReuseKit: %s was wrapped again by someone else; left as it is", WHERE)
            return
        mm.free_memory = _original
        _original = None


def installed() -> bool:
    return _original is not None
