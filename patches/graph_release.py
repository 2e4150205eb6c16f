"""The life of captured graphs: the graph sets of each model, what they hold (published in the
stats), and their release.

Graphs are released when any patcher (subclasses included) loads or unloads the model's weights
(listeners on ``load / unpatch_model / partially_unload`` through patches/lifecycle.py, not the
per-patcher ``CallbacksMP``: a clone without the Graph node, a LoRA's, changes the weights a graph
of the same BaseModel reads), when ComfyUI needs device memory (a releaser of patches/memory.py:
graph pools go before ComfyUI unloads a model), at the end of a run where the node's
``keep_graphs`` is off, and when cleared. A release from another thread (the panel's clear) never
frees a graph a forward is replaying: its entries are dropped at once and freed when that forward
ends (``GraphSet.in_use``).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import deque

import torch

from ..caching import graph_reuse as gr
from ..caching.stats import REGISTRY
from . import host, lifecycle, memory

STATS = gr.GraphStats()
MEMORY_RELEASER = "graph capture"
_SETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BaseModel -> {max_graphs: GraphSet}
_SETS_LOCK = threading.Lock()
_died: deque = deque()  # one item per model whose graph sets went with it (its finalizer only appends)
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a captured model's module -> its BaseModels, weakly
_SET_ANEW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BaseModel -> parameters, buffers, modules set
_hooks: list = []  # torch's global registration hooks, while installed


def _dynamic_vram_default() -> bool:
    """True where this ComfyUI made dynamic VRAM its default patcher at start-up."""
    host_memory = sys.modules.get("comfy.memory_management")
    return bool(getattr(host_memory, "aimdo_enabled", False))


def report_layer(followed: bool = True) -> None:
    """The graph layer's state for the start-up line (patches/host.py); ``followed``: False where
    weight changes cannot be followed."""
    notes = []
    if gr.env_disabled():
        state, notes = "off", [f"{gr.DISABLE_ENV} is set"]
    elif not torch.cuda.is_available():
        state = "eager: no CUDA"
    else:
        state = "on"
        if _dynamic_vram_default():
            notes.append("models under dynamic VRAM run eagerly")
    if not followed:
        notes.append("graphs are released only when cleared")
    host.set_layer("graph capture", state, "; ".join(notes))


def graph_set(base_model, max_graphs: int) -> gr.GraphSet:
    """The graphs of ``base_model`` kept under ``max_graphs``: one set per setting, so two Graph
    nodes with different limits on one model never evict each other's graphs."""
    settle()
    with _SETS_LOCK:
        sets = _SETS.get(base_model)
        if sets is None:
            # Its graphs go with the model; the stats say so at the next settle(). The finalizer may
            # run inside the garbage collector, on any thread, with any lock held (this module's,
            # the stats'): it only records (docs/development.md, "Rules for contributors").
            weakref.finalize(base_model, _died.append, True)
            sets = _SETS[base_model] = {}
        gs = sets.get(max_graphs)
        if gs is None:
            gs = sets[max_graphs] = gr.GraphSet(max_graphs=max_graphs)
        return gs


def follow_modules(base_model) -> None:
    """At a capture: the model's modules (object patches swapped in included, one module may be in several
    models), so a parameter, buffer or submodule set anew on one (``comfy.utils.set_attr_param`` by a node,
    ``module.weight = Parameter(...)``, ``block.attn = other``) outside the model's own load or unload, which
    no listener sees, changes the graphs' state (:func:`set_anew`): the next call rebuilds rather than replay
    the old tensor."""
    for module in base_model.modules():
        owners = _OWNERS.get(module)
        if owners is None:
            owners = _OWNERS[module] = weakref.WeakSet()
        owners.add(base_model)


def set_anew(base_model) -> int:
    """How many parameters, buffers and submodules were set on the modules of ``base_model`` since it was
    followed. (The hook may run inside a finalizer, a patcher's ``__del__`` unpatching: it takes no lock.)"""
    return _SET_ANEW.get(base_model, 0)


_RELEASING = ("load", "unpatch_model", "partially_unload")  # the events whose listeners release a model's graphs


def _registered(module, name, value) -> None:
    """torch's registration hook, on every parameter, buffer and submodule set on any module: one lookup. A
    model's own load or unload (which sets the weights it patches anew) releases its graphs: not counted."""
    try:
        owners = _OWNERS.get(module)
    except TypeError:  # a module class that cannot be hashed (one defining __eq__ alone): never a captured one
        return
    for base_model in list(owners or ()):
        if not lifecycle.in_progress(base_model, _RELEASING):
            _SET_ANEW[base_model] = _SET_ANEW.get(base_model, 0) + 1


def settle() -> None:
    """The work recorded inside the garbage collector: lifecycle events of finalized patchers (a
    release before the next replay), and the memory of models that died, published. At every graph
    call and before every stats snapshot."""
    lifecycle.settle()
    if not _died:
        return
    while _died:
        try:
            _died.popleft()
        except IndexError:
            break
    publish_memory()


def sets_of(base_model) -> list[gr.GraphSet]:
    with _SETS_LOCK:
        return list(_SETS.get(base_model, {}).values())


def _kept_bytes(runner) -> int:
    """Bytes of the tensors outside the graph (weights, cached tensors) a runner keeps alive."""
    kept = getattr(runner, "kept", None) or {}
    return sum(v.nbytes() if isinstance(v, torch.UntypedStorage) else v.numel() * v.element_size()
               for v in kept.values())


def publish_memory() -> None:
    with _SETS_LOCK:
        sets = [gs for by_limit in _SETS.values() for gs in by_limit.values()]
    entries = [e for gs in sets for e in list(gs.entries.values())]
    runners = [e.runner for e in entries if e.runner is not None]
    STATS.memory(sum(e.nbytes for e in entries), len(entries))
    STATS.info("held", {"graphs": len(runners), "buffers_and_pools_bytes": sum(e.nbytes for e in entries),
                        "weights_kept_alive_bytes": sum(_kept_bytes(r) for r in runners)})


def release_model(base_model, reason: str, detail: str = "", limit: int | None = None) -> int:
    """Drop every graph of ``base_model`` (or of its set kept under ``limit`` graphs): its weights
    moved or changed, or the memory is needed; returns how many."""
    n = 0
    for gs in sets_of(base_model):
        if limit is not None and gs.max_graphs != limit:
            continue
        dropped = gs.release(reason, detail)
        if dropped:
            gs.retire(dropped)  # a forward replaying one of them right now frees it when it ends
            STATS.incr(f"releases.{reason}", len(dropped))
            n += len(dropped)
    if n:
        publish_memory()
    return n


def release_all(reason: str = "cleared") -> int:
    with _SETS_LOCK:
        models = list(_SETS.keys())
    n = sum(release_model(m, reason) for m in models)
    publish_memory()
    return n


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def free_for_memory(device: str, need_bytes: int) -> int:
    """patches/memory.py's releaser: drops whole graph sets on ``device``, oldest model first, until
    ``need_bytes`` are freed (a set a forward is using right now is left to it); returns bytes freed."""
    want = torch.device(device)
    freed = 0
    with _SETS_LOCK:
        sets = [gs for by_limit in _SETS.values() for gs in by_limit.values()]
    for gs in sets:
        if freed >= need_bytes:
            break
        with gs.lock:
            busy = gs.busy
            on_device = [e for e in gs.entries.values()
                         if e.runner is not None and _same_device(getattr(e.runner, "device", want), want)]
        if busy or not on_device:
            continue
        dropped = gs.release("memory", f"ComfyUI needed memory on {device}")
        freed += sum(e.nbytes for e in dropped if e.runner is not None)
        STATS.incr("releases.memory", len(dropped))
        gs.retire(dropped)
    if freed:
        publish_memory()
    return freed


STATS.set_clear(release_all)
REGISTRY.add_settler(settle)
STATS.info("backend", "cuda (graphs captured and replayed)" if torch.cuda.is_available()
           else "eager: decisions only (no CUDA)")  # the panel lists the cache from the start


def _on_load(patcher, *args, **kwargs) -> None:
    release_model(patcher.model, "reloaded", "ModelPatcher.load")


def _on_unpatch(patcher, device_to=None, unpatch_weights=True, *args, **kwargs) -> None:
    if unpatch_weights:  # without it only object patches move; the weights stay where they are
        release_model(patcher.model, "unloaded", "ModelPatcher.unpatch_model")


def _on_partial_unload(patcher, *args, **kwargs) -> None:
    release_model(patcher.model, "unloaded", "ModelPatcher.partially_unload")


_LISTENERS = (("load", _on_load), ("unpatch_model", _on_unpatch), ("partially_unload", _on_partial_unload))


def install() -> bool:
    """Release graphs whenever any patcher loads, unloads or re-patches a model's weights
    (listeners on patches/lifecycle.py). Idempotent; False when the host lacks those methods."""
    for event, fn in _LISTENERS:
        lifecycle.add_listener(event, fn)
    if not _hooks:
        hooks = torch.nn.modules.module
        _hooks.extend((hooks.register_module_parameter_registration_hook(_registered),
                       hooks.register_module_buffer_registration_hook(_registered),
                       hooks.register_module_module_registration_hook(_registered)))
    memory.add_releaser(MEMORY_RELEASER, free_for_memory)
    report_layer(installed())
    if not installed():
        host.say_once("graph:probe", "ReuseKit graph: this ComfyUI's ModelPatcher cannot be followed; graphs "
                      "are only released when cleared", level=logging.WARNING)
        return False
    return True


def uninstall() -> None:
    """Stop following weight changes and drop every graph (idempotent)."""
    for event, fn in _LISTENERS:
        lifecycle.remove_listener(event, fn)
    while _hooks:
        _hooks.pop().remove()
    memory.remove_releaser(MEMORY_RELEASER)
    release_all("uninstalled")


def installed() -> bool:
    return all(lifecycle.listening(event, fn) for event, fn in _LISTENERS)



def release_unless_kept(guider) -> None:
    """At the end of a run, drop the graphs of a node whose ``keep_graphs`` is off."""
    patcher = getattr(guider, "model_patcher", None)
    opts = gr.node_options((getattr(guider, "model_options", None) or {}).get("transformer_options"))
    if patcher is not None and opts and not opts.get("keep", True):
        release_model(patcher.model, "run_ended", "keep_graphs is off", limit=int(opts.get("max_graphs", 2)))


report_layer()
