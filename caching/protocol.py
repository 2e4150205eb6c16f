"""What the caches tell each other through a model call, in one place.

The step cache, the PE cache and graph capture meet inside one ``transformer_options`` dict and
one forward; these names and helpers are their whole contract, so no cache imports another.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

OPTIONS_NAME = "transformer_options"

STEP_HOOK = "reusekit_step_hook"
"""transformer_options key of a step cache's per-call object, which graph capture drives so that
the skip decision stays outside the graph (a skipped step never replays):

- ``hook.probe(forward)``: ``forward()`` runs the model eagerly; the hook decides inside it and
  either lets it finish (a skipped step: its output is returned and nothing is replayed) or stops
  it at the decision and returns ``None`` (a computed step: the graph replays or captures).
  Where nothing would replay (decisions only) the forward runs once without a probe and
  ``hook.skip`` says afterwards whether the hook skipped it.
- ``hook.graph_outputs()``: after a forward, the tensors the hook's patches made inside it (the
  step cache's new residual), which a replay must hand back too;
- ``hook.take_graph_outputs(tensors)``: copies of those tensors after a replay.
"""

GRAPH_SAFE = "reusekit_graph_safe"
"""Attribute marking a transformer patch that may run inside a captured forward: it launches the
same kernels on every call of one signature and reads no Python state that changes between calls
(its per-call state reaches it through :data:`STEP_HOOK`). Any other patch makes the call eager."""

GRAPH_KEY = "reusekit_graph_key"
"""Attribute marking an object in transformer_options that decides what a captured forward does (the
step cache's settings: where a family's blocks are reached through their class, no patch carries that
identity): a call's signature counts it by identity, so a graph captured under other settings never
replays. Any other object there (a wrapper's state holder) counts by its type only."""

_PREPARING = contextvars.ContextVar("reusekit_graph_preparing", default=False)


@contextlib.contextmanager
def preparing_capture() -> Iterator[None]:
    """Open while a backend warms up and captures a forward: caches the forward consults (the PE
    cache) must neither compare tensors on the device (a host sync cannot be captured) nor keep
    tensors made there (on the warm-up stream or in the graph's private pool)."""
    token = _PREPARING.set(True)
    try:
        yield
    finally:
        _PREPARING.reset(token)


def capturing() -> bool:
    """Whether this call is being warmed up or captured (by the pack, or by anyone's CUDA graph)."""
    return _PREPARING.get() or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def transformer_options(args: tuple, kwargs: dict, position: int | None = None) -> dict | None:
    """A call's ``transformer_options``: the keyword, else the argument at ``position`` (when the
    callee's signature is known), else the last dict among the arguments; None when absent."""
    found = kwargs.get(OPTIONS_NAME)
    if isinstance(found, dict):
        return found
    if position is not None:
        found = args[position] if len(args) > position else None
        return found if isinstance(found, dict) else None
    return next((a for a in reversed(args) if isinstance(a, dict)), None)
