"""Timing one model call in a benchmark: a clone of a ModelPatcher whose apply_model calls record their
duration (outermost, so every wrapper of the call is inside the time)."""

from __future__ import annotations

import time
from collections.abc import Callable

import comfy.patcher_extension as patcher_extension

TIMER = "bench_timer"


def timed(model, times: list, sync: Callable[[], None] = lambda: None):
    """A clone whose apply_model calls append their duration to ``times``; ``sync`` runs before and after each
    (``torch.cuda.synchronize`` on a GPU, so the time is the device's)."""
    m = model.clone()

    def timer(executor, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = executor(*args, **kwargs)
        sync()
        times.append(time.perf_counter() - t0)
        return out

    m.add_wrapper_with_key(patcher_extension.WrappersMP.APPLY_MODEL, TIMER, timer)
    w = m.wrappers[patcher_extension.WrappersMP.APPLY_MODEL]
    m.wrappers[patcher_extension.WrappersMP.APPLY_MODEL] = dict(sorted(w.items(), key=lambda kv: kv[0] != TIMER))
    return m
