"""Graph capture: the CUDA backend of graph reuse, hooked through ModelPatcher wrappers.

``enable(patcher, max_graphs)`` adds three keyed wrappers to a patcher (clone it first):

- OUTER_SAMPLE: one run summary per sampling run (``last_run`` in the stats, one log line);
- APPLY_MODEL: tells the inner wrapper which BaseModel (patcher, weights, lowvram state) it runs;
- DIFFUSION_MODEL: decides per call (caching/graph_reuse.py) and replays or captures.

Only the innermost original forward is captured: other DIFFUSION_MODEL wrappers (EasyCache,
LazyCache) keep running in Python around it, so a skipped step never replays and their decisions
stay outside the graph. A step cache that decides inside the forward (ReuseKit's TeaCache, in its
first block patch) does so through a step hook: an eager probe up to its decision, then a replay
of computed steps only (caching/graph_reuse.py, ``STEP_HOOK``). A call runs eagerly, with the
same result, when the model is partially loaded (lowvram), when hooks or weight wrappers change
weights per step, when transformer patches not marked graph-safe run Python inside the forward,
under torch.compile, or when an input cannot be captured.

Captured graphs are released when any patcher (subclasses included) loads or unloads the model's
weights (listeners on ``load / unpatch_model / partially_unload`` through patches/lifecycle.py;
:func:`install` and :func:`uninstall`). A model runs eagerly, with the reason counted, where the
host captures its blocks as graphs itself (``comfy/model_prefetch.py``) and under dynamic VRAM
(ComfyUI's ``ModelPatcherDynamic``: weights stream in during every forward, so a replay could read
evicted memory). Without CUDA the decision still runs (the stats show what would be reused) and
every forward runs eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
import sys
import threading
import traceback
import weakref
from typing import Any

import comfy.model_management
import comfy.patcher_extension as pe
import torch

from ..caching import graph_reuse as gr
from ..caching import protocol
from ..caching.settings import SETTINGS
from . import host, lifecycle, memory

log = logging.getLogger("reusekit")

KEY = gr.OPTIONS_KEY
FORCE_BACKEND: str | None = None
"""``None`` (auto: ``cuda`` on a CUDA model, decisions only elsewhere), ``"eager"`` (decisions
only), ``"emulate"`` (static buffers updated in place and the forward re-run on them, no graph:
checks the input plumbing on any device), ``"trace"`` (the forward traced once and the trace
replayed: a stale replay shows as a wrong output on any device) or ``"cuda"``."""

STATS = gr.GraphStats()
MEMORY_RELEASER = "graph capture"
_SETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # BaseModel -> GraphSet
_SETS_LOCK = threading.RLock()  # re-entered when a model is collected while it is held
# (weakref to the BaseModel, compiled) while its forward runs: weak, as a copy of the context (a
# callback scheduled from the sampling thread) may outlive the model
_MODEL = contextvars.ContextVar("reusekit_graph_model", default=None)
_RUN = contextvars.ContextVar("reusekit_graph_run", default=None)
_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> its parameters

if "graph_reuse.enabled" not in SETTINGS.snapshot():
    SETTINGS.define("graph_reuse.enabled", bool, True,
                    "Capture and replay CUDA graphs of the diffusion model (where a node asks for it).")


def env_disabled() -> bool:
    return os.environ.get(gr.DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def host_captures_graphs(diffusion_model) -> bool:
    """True where the host captures blocks of this diffusion model as CUDA graphs itself: one of
    its modules is in the registries of blocks ``comfy/model_prefetch.py`` warmed up or captured
    (ComfyUI 0.33 does so for text-encoder layers only). Never capture around them."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    marked = [s for s in (getattr(prefetch, "GRAPH_WARMED_MODULES", None), getattr(prefetch, "GRAPH_MODULES", None))
              if s]
    if not marked or not isinstance(diffusion_model, torch.nn.Module):
        return False
    return any(m in s for m in diffusion_model.modules() for s in marked)


def is_dynamic(patcher) -> bool:
    """True for a patcher under dynamic VRAM (ComfyUI's ``ModelPatcherDynamic``)."""
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def _dynamic_vram_default() -> bool:
    """True where this ComfyUI made dynamic VRAM its default patcher at start-up."""
    memory = sys.modules.get("comfy.memory_management")
    return bool(getattr(memory, "aimdo_enabled", False))


def report_layer(followed: bool = True) -> None:
    """The graph layer's state for the start-up line (patches/host.py); ``followed``: False where
    weight changes cannot be followed."""
    notes = []
    if env_disabled():
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


# ---- weights change: release ----------------------------------------------------------------

def graph_set(base_model, max_graphs: int) -> gr.GraphSet:
    """The graphs of ``base_model`` kept under ``max_graphs``: one set per setting, so two Graph
    nodes with different limits on one model never evict each other's graphs."""
    with _SETS_LOCK:
        sets = _SETS.get(base_model)
        if sets is None:
            # its graphs go with the model: say so (registered first, so it runs after the
            # dictionary has dropped the entry)
            weakref.finalize(base_model, _publish_memory)
            sets = _SETS[base_model] = {}
        gs = sets.get(max_graphs)
        if gs is None:
            gs = sets[max_graphs] = gr.GraphSet(max_graphs=max_graphs)
        return gs


def sets_of(base_model) -> list[gr.GraphSet]:
    with _SETS_LOCK:
        return list(_SETS.get(base_model, {}).values())


def _kept_bytes(runner) -> int:
    """Bytes of the tensors outside the graph (weights, cached tensors) a runner keeps alive."""
    kept = getattr(runner, "kept", None) or {}
    return sum(v.nbytes() if isinstance(v, torch.UntypedStorage) else v.numel() * v.element_size()
               for v in kept.values())


def _publish_memory() -> None:
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
        _publish_memory()
    return n


def release_all(reason: str = "cleared") -> int:
    with _SETS_LOCK:
        models = list(_SETS.keys())
    n = sum(release_model(m, reason) for m in models)
    _publish_memory()
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
        _publish_memory()
    return freed


STATS.set_clear(release_all)
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
    memory.remove_releaser(MEMORY_RELEASER)
    release_all("uninstalled")


def installed() -> bool:
    return all(lifecycle.listening(event, fn) for event, fn in _LISTENERS)


report_layer()


# ---- runners --------------------------------------------------------------------------------

def _tensor_tree(out) -> bool:
    if isinstance(out, (list, tuple)):
        return all(_tensor_tree(o) for o in out)
    return isinstance(out, torch.Tensor)


def _clone_tree(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_clone_tree(o) for o in out)
    raise TypeError(f"the forward returned a {type(out).__name__}, not tensors")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (a subclass wrapper): nothing to keep
        return 0


def _keep_key(t: torch.Tensor):
    """A tensor's storage address, or for a wrapper subclass without storage its identity."""
    return _storage_ptr(t) or ("object", id(t))


def _tensors_in(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


class KeepExternal(torch.overrides.TorchFunctionMode):
    """Active while a forward is captured: every tensor the forward reads that existed before the
    capture (weights, buffers, a PE cache's stored tensors) is kept alive with the graph, so the
    memory a replay reads is never freed and reused while the graph lives (a cache may drop its
    own reference when its key changes). Tensors made during the capture are not kept."""

    def __init__(self):
        super().__init__()
        self.made: set = set()  # keys (see _keep_key) of what the forward made
        self.kept: dict = {}  # key -> the storage (or wrapper tensor) kept alive

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors_in(args):
            self._see(t)
        for t in _tensors_in(kwargs.values()):
            self._see(t)
        out = func(*args, **kwargs)
        for t in _tensors_in((out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ()):
            self.made.add(_keep_key(t))
        return out

    def _see(self, t: torch.Tensor) -> None:
        key = _keep_key(t)
        if key not in self.made and key not in self.kept:
            # the memory itself (even where a .data is swapped later), or a wrapper subclass (a
            # quantized weight) whole, and so what it wraps
            self.kept[key] = t.untyped_storage() if isinstance(key, int) else t


class StaticRunner:
    """Static input buffers (allocated outside any graph pool), updated in place on every call.
    This base re-runs the forward eagerly on them (the ``emulate`` backend)."""

    def __init__(self, fn, named: list[tuple[str, Any]], n_pos: int, spec: gr.CallSpec, device,
                 shared: dict | None = None):
        self.fn = fn
        self.device = torch.device(device)
        self.shared = {} if shared is None else shared  # state shared by one model's runners
        self.n_pos = n_pos
        self.static = [torch.empty_like(t).copy_(t) for t in spec.tensors]
        self.args = gr.substitute(named, self.static, device)
        self.hook = _step_hook(self.args)
        self.nbytes = _nbytes(self.static)

    def _call(self):
        """The forward on the static buffers: its output, and with a step hook ``(output,
        tensors the hook's patches made)``."""
        pos = [v for _, v in self.args[:self.n_pos]]
        kw = dict(self.args[self.n_pos:])
        out = self.fn(*pos, **kw)
        if self.hook is None:
            return out
        return out, tuple(self.hook.graph_outputs())

    def copy_in(self, tensors: list[torch.Tensor]) -> None:
        for s, t in zip(self.static, tensors, strict=True):
            if s.data_ptr() != t.data_ptr():
                s.copy_(t)

    kept: dict = {}

    def capture(self, warmup: int):
        """Returns (first output, failure text or "")."""
        with KeepExternal() as keep:
            out = self._call()
        self.kept = keep.kept
        return _clone_tree(out), ""

    def replay(self, tensors):
        self.copy_in(tensors)
        return _clone_tree(self._call())

    def release(self) -> None:
        self.static, self.args, self.fn, self.hook, self.kept = [], [], None, None, {}


class ConstantUploads(torch.overrides.TorchFunctionMode):
    """CPU tensors the forward copies to the device: a copy from pageable host memory syncs, and
    a sync cannot be captured (Wan's time embedding builds an ``arange`` on the CPU and moves it
    on every call). The warm-up records each such upload in order (its CPU source and a copy of
    the result); the capture replays them as device copies of the recorded results, each checked
    once, at the capture, to equal its source (otherwise the capture fails and the call runs
    eagerly). Replays do not look again: like every Python branch of a captured forward, such a
    source may depend only on what the signature holds."""

    METHODS = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as})

    def __init__(self):
        super().__init__()
        self.records: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # None: stayed on the CPU
        self.replaying = False
        self._next = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func not in self.METHODS or not isinstance(src, torch.Tensor) or src.device.type != "cpu":
            return func(*args, **kwargs)
        if not self.replaying:
            with _sync_debug(0):  # this copy is the one a capture will not make
                out = func(*args, **kwargs)
            self.records.append((src.clone(), out.clone()) if out.device.type != "cpu" else None)
            return out
        i, self._next = self._next, self._next + 1
        rec = self.records[i] if i < len(self.records) else ()
        if rec is None:
            return func(*args, **kwargs)
        if not rec or rec[0].shape != src.shape or rec[0].dtype != src.dtype or not torch.equal(rec[0], src):
            raise RuntimeError("the forward copies a CPU tensor to the device that differs from its warm-up's")
        return rec[1].clone()


@contextlib.contextmanager
def _sync_debug(mode):
    """torch's sync debug mode (``"error"``: an implicit host sync raises), restored after; a
    no-op where CUDA is not in use (nothing to sync with)."""
    if not torch.cuda.is_initialized():
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc`` outside torch: the line of the model that synced."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.join(*f.filename.split(os.sep)[-3:])}:{f.lineno}"


def _graph_memory(device) -> int:
    """Device memory in use by the caching allocator, or (cudaMallocAsync, whose graph memory is
    outside its pool's counters) on the whole device."""
    if torch.cuda.get_allocator_backend() == "native":
        return torch.cuda.memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _abandon_pool(device, pool) -> None:
    """A capture that could not end leaves its pool open: route allocations back and release it
    (as torch's own ``use_mem_pool`` does on exit)."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
        torch._C._cuda_releasePool(device.index, pool)
    except Exception:  # a torch without these: the pool stays until the process ends
        log.warning("ReuseKit graph: could not release the memory pool of a failed capture", exc_info=True)


class CudaGraphRunner(StaticRunner):
    """Warm-up on a side stream, capture into the model's private pool, replay, return a clone of
    the static output (callers never see a buffer the next replay overwrites).

    A forward that syncs the host is found in the warm-up (torch's sync debug mode) and never
    captured; a capture that fails anyway ends with its pool released and the caller's stream
    current again."""

    graph = None
    static_out = None
    pool_bytes = 0
    uploads = None

    def capture(self, warmup: int):
        device = self.static[0].device if self.static else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            return self._capture(device, warmup)

    def _warm_up(self, current, side, uploads: ConstantUploads, warmup: int):
        """(output, sync error or None); an error of the model's own is raised as is."""
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                try:
                    with _sync_debug("error"), uploads:
                        out = self._call()
                except RuntimeError as exc:
                    if "synchronizing CUDA operation" not in str(exc):
                        raise
                    return None, exc
                for _ in range(warmup - 1):
                    out = self._call()
                return out, None
        finally:
            current.wait_stream(side)  # also after an error: the buffers outlive nothing on `side`

    def _capture(self, device, warmup: int):
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        uploads = ConstantUploads()
        out, sync = self._warm_up(current, side, uploads, warmup)
        if sync is not None:  # never captured: the step runs eagerly
            where, sync = _where(sync), None  # its traceback holds the warm-up's activations
            return _clone_tree(self._call()), f"the forward syncs the host at {where}"
        eager_out = _clone_tree(out)
        del out
        # one pool for all live graphs of this model on this device: replays run one at a time on
        # one stream and each output is copied at once, so one graph's intermediates may reuse
        # another's (torch's "sharing memory across captures"); their outputs stay apart
        graph = torch.cuda.CUDAGraph()
        pool = self.shared.get(("pool", device))
        if pool is None:
            pool = self.shared[("pool", device)] = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = _graph_memory(device)
        keep = KeepExternal()
        uploads.replaying = True
        failure = static_out = None
        # on `side` (this device): torch's default capture stream is one per process, made on
        # whichever device captured first; a capture there leaves this device's kernels out. The
        # outer stream context restores the caller's stream even where capture_end raises.
        with torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=pool, **_capture_kwargs())
            except Exception as exc:  # nothing began: nothing to end
                return eager_out, _first_line(exc)
            try:
                with keep, uploads:
                    static_out = self._call()
                if not _tensor_tree(static_out):
                    raise TypeError(f"the forward returned a {type(static_out).__name__}, not tensors")
            except BaseException as exc:  # the capture must end before anything else
                failure = exc
            try:
                graph.capture_end()
            except Exception as exc:  # the capture was invalidated (a sync, a CPU op...)
                _abandon_pool(device, pool)
                tracker = getattr(graph, "_tracker", None)  # torch's liveness check (debug) ends with the capture
                if tracker is not None:
                    tracker.stop()
                graph = None
                failure = failure or exc
        if failure is not None:
            if graph is not None:
                graph.reset()
            graph = keep = static_out = None
            try:
                if not isinstance(failure, Exception) or isinstance(failure, comfy.model_management.InterruptProcessingException):
                    raise failure
                try:
                    torch.cuda.synchronize(device)
                except Exception:
                    log.debug("ReuseKit graph: synchronize after a failed capture", exc_info=True)
                return eager_out, _first_line(failure)
            finally:
                failure = None  # no cycle through this frame: the capture's tensors go at once
        graph.replay()
        torch.cuda.synchronize(device)
        self.pool_bytes = max(0, _graph_memory(device) - before)
        self.graph, self.static_out, self.kept, self.uploads = graph, static_out, keep.kept, uploads.records
        self.nbytes = _nbytes(self.static) + self.pool_bytes
        self.args, self.fn, self.hook = [], None, None  # a replay needs only the buffers and the graph
        return _clone_tree(static_out), ""

    def replay(self, tensors):
        self.copy_in(tensors)
        self.graph.replay()
        return _clone_tree(self.static_out)

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.static_out = self.uploads = None
        super().release()


class TraceRunner(StaticRunner):
    """A CPU stand-in for a graph (the ``trace`` backend, for tests): the forward is traced once at
    capture (torch's ``make_fx``) and the trace replayed on the static buffers, so the Python
    branches and the modules it read are frozen as in a CUDA graph, and a replay the signature
    should have refused gives a wrong output."""

    traced = None

    def capture(self, warmup: int):
        with KeepExternal() as keep:
            out = self._call()
        self.kept = keep.kept
        if self.hook is not None:  # its outputs come from patches that decide per call
            return _clone_tree(out), "a step cache's hook cannot be traced"

        def forward(*tensors):
            args = gr.substitute(self.args, list(tensors), self.device)
            return self.fn(*[v for _, v in args[:self.n_pos]], **dict(args[self.n_pos:]))

        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            self.traced = make_fx(forward)(*self.static)
        except Exception as exc:  # an op the tracer cannot follow: this signature runs eagerly
            return _clone_tree(out), _first_line(exc)
        return _clone_tree(out), ""

    def replay(self, tensors):
        self.copy_in(tensors)
        return _clone_tree(self.traced(*self.static))

    def release(self) -> None:
        self.traced = None
        super().release()


RUNNERS = {"emulate": StaticRunner, "trace": TraceRunner, "cuda": CudaGraphRunner}
CHECK_LIVENESS = os.environ.get("REUSEKIT_GRAPH_CHECK_LIVENESS") == "1"
"""Debug: ask torch (where it can) to raise when a tensor a graph reads was freed before a replay."""


def _capture_kwargs() -> dict:
    kwargs = {"capture_error_mode": "thread_local"}
    if CHECK_LIVENESS:
        try:
            if "check_input_liveness" in inspect.signature(torch.cuda.CUDAGraph.capture_begin).parameters:
                kwargs["check_input_liveness"] = True
        except (TypeError, ValueError):  # an older torch's bound C++ method: no such check there
            pass
    return kwargs


# ---- the wrappers ---------------------------------------------------------------------------

def _param_names(fn) -> tuple[list[str], bool]:
    key = getattr(fn, "__func__", fn)
    try:
        found = _params.get(key)
    except TypeError:  # not weakly referable: not remembered
        key = found = None
    if found is None:
        names, var = [], False
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind == p.VAR_POSITIONAL:
                var = True
        found = (names, var)
        if key is not None:
            _params[key] = found
    return found


def _bind(fn, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    names, _ = _param_names(fn)
    named = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(args)]
    named.extend(kwargs.items())
    return named


def _backend(device: torch.device) -> str:
    if FORCE_BACKEND is not None:
        if FORCE_BACKEND == "cuda" and device.type != "cuda":
            return "eager"
        return FORCE_BACKEND
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "eager"


_BACKEND_LABELS = {"cuda": "cuda (graphs captured and replayed)", "emulate": "emulate (static buffers, no graph)",
                   "trace": "trace (the forward traced at capture and replayed)", "eager": "eager: decisions only"}
_last_label: list[str] = [""]


def _say_backend(backend: str, device: torch.device) -> None:
    label = _BACKEND_LABELS.get(backend, backend)
    if backend == "eager":
        label += " (no CUDA)" if device.type != "cuda" else " (forced)"
    if label != _last_label[0]:
        _last_label[0] = label
        STATS.info("backend", label)


def _state_bypass(base_model, compiled: bool) -> tuple[str, str] | None:
    if compiled or torch.compiler.is_compiling():
        return "torch_compile", "the model runs through torch.compile"
    if host_captures_graphs(getattr(base_model, "diffusion_model", None)):
        return "host_graphs", "ComfyUI captures this model's blocks as CUDA graphs itself (comfy/model_prefetch.py)"
    patcher = getattr(base_model, "current_patcher", None)
    if is_dynamic(patcher):
        return "dynamic_vram", ("the model runs under dynamic VRAM: its weights stream in during every forward, "
                                "so a replay could read evicted memory")
    if getattr(base_model, "model_lowvram", False) or getattr(base_model, "lowvram_patch_counter", 0):
        return "partial_load", "weights are partially loaded (lowvram): they move during the forward"
    if patcher is not None:
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "current_hooks", None) is not None:
            return "weight_hooks", "hooks change weights per step"
        if getattr(patcher, "weight_wrapper_patches", None):
            return "weight_wrappers", "weight wrappers run on every forward"
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return "autograd", "gradients are enabled"
    return None


def _state_fields(base_model, device: torch.device, backend: str) -> tuple:
    patcher = getattr(base_model, "current_patcher", None)
    weights = (getattr(patcher, "patches_uuid", None), getattr(base_model, "current_weight_patches_uuid", None))
    autocast = torch.is_autocast_enabled(device.type)
    mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), autocast,
            torch.get_autocast_dtype(device.type) if autocast else None)
    objects = getattr(patcher, "object_patches", None)
    objects = tuple((k, gr.Same(v)) for k, v in objects.items()) if objects else ()
    return (("model.weights", "weights", weights), ("model.object_patches", "object_patches", objects),
            ("mode", "mode", mode + (backend,)))


_NOT_RUN = object()


def _count(run: gr.RunSummary | None, group: str, reason: str) -> None:
    STATS.incr(f"{group}.{reason}")
    if run is not None:
        d = run.rebuilds if group == "rebuilds" else run.bypasses
        d[reason] = d.get(reason, 0) + 1


def _eager(run, fn, args, kwargs, done=_NOT_RUN):
    """The forward run eagerly (``done``: its output, where it already ran)."""
    STATS.incr("eager_steps")
    if run is not None:
        run.eager += 1
    return fn(*args, **kwargs) if done is _NOT_RUN else done


def graph_call(original, args: tuple, kwargs: dict, opts: dict, ctx):
    """One diffusion-model forward through the graph decision (``original`` is the innermost
    forward; ``ctx`` is (BaseModel, compiled) from the APPLY_MODEL wrapper or None)."""
    if torch.compiler.is_compiling():  # traced by torch.compile: stay out of its way
        return original(*args, **kwargs)
    run: gr.RunSummary | None = _RUN.get()
    if run is not None:
        run.steps += 1
    if env_disabled() or not opts.get("enabled", True) or not SETTINGS.get("graph_reuse.enabled"):
        why = f"{gr.DISABLE_ENV} is set" if env_disabled() else "disabled"
        if run is not None:
            run.backend = "disabled"
            run.note(f"graph capture disabled ({why})")
        _count(run, "bypasses", "disabled")
        return _eager(run, original, args, kwargs)
    if ctx is None:
        _count(run, "bypasses", "no_context")
        return _eager(run, original, args, kwargs)
    base_model, compiled = ctx
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None) or next(
        (v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    backend = _backend(device)
    if backend == "eager" and device.type != "cuda":
        host.say_once("graph:nocuda", "ReuseKit graph: no CUDA device, the model runs eagerly "
                      "(the reuse decision still runs and is counted)")
    _say_backend(backend, device)
    if run is not None:
        run.backend = backend
    bypass = _state_bypass(base_model, compiled)
    if bypass is not None:
        _count(run, "bypasses", bypass[0])
        host.say_once(f"graph:bypass:{bypass[0]}", "ReuseKit graph: running eagerly: %s", bypass[1])
        if run is not None:
            run.note(bypass[1])
        return _eager(run, original, args, kwargs)
    named = _bind(original, args, kwargs)
    spec = gr.analyse_call(named, _state_fields(base_model, device, backend), device)
    STATS.incr("checks")
    if spec.bypass is not None:
        _count(run, "bypasses", spec.bypass)
        host.say_once(f"graph:bypass:{spec.bypass}:{spec.detail}", "ReuseKit graph: running eagerly: %s",
                      spec.detail)
        if run is not None:
            run.note(spec.detail)
        return _eager(run, original, args, kwargs)
    runner_cls = RUNNERS.get(backend)
    hook = _step_hook(named)
    done = _NOT_RUN
    if hook is not None:
        # the forward may write into its options (Flux: block indices); buffers follow the signature
        named = [(k, dict(v) if k == protocol.OPTIONS_NAME and isinstance(v, dict) else v) for k, v in named]
        if runner_cls is None:  # decisions only: nothing replays, so no probe; one eager pass decides
            done = original(*args, **kwargs)
        else:
            probed = hook.probe(lambda: original(*args, **kwargs))
            if probed is not None and not hook.skip:  # finished without deciding: it ran eagerly
                _count(run, "bypasses", "step_hook_undecided")
                return _eager(run, original, args, kwargs, probed)
            if probed is not None:
                done = probed
        if hook.skip:  # the step cache skipped this step eagerly: nothing replays
            STATS.incr("step_cache_skips")
            if run is not None:
                run.step_skips += 1
            return done
    gs = graph_set(base_model, int(opts.get("max_graphs", 2)))
    with gs.in_use():  # a release from another thread until the replay or capture ends frees nothing
        return _reuse_or_capture(gs, run, original, args, kwargs, opts, named, spec, device, runner_cls, hook,
                                 done)


def _reuse_or_capture(gs: gr.GraphSet, run, original, args, kwargs, opts, named, spec, device, runner_cls, hook,
                      done):
    """The decision for one call and its replay, capture or eager run."""
    decision = gs.decide(spec.signature)
    if decision.hit:
        entry = decision.entry
        if entry.failed:
            _count(run, "bypasses", "capture_failed")
            return _eager(run, original, args, kwargs, done)
        STATS.incr("hits")
        if run is not None:
            run.hits += 1
            run.misses_in_row = 0
        if entry.runner is None:
            return _eager(run, original, args, kwargs, done)
        # ComfyUI checks for a cancel in every op of the forward; a replay runs none of them
        comfy.model_management.throw_exception_if_processing_interrupted()
        out = entry.runner.replay(spec.tensors)
        STATS.incr("replays")
        if run is not None:
            run.replays += 1
        return _hand_back(out, hook)
    STATS.incr("misses")
    if decision.reason != "first":
        _count(run, "rebuilds", decision.reason)
        log.debug("ReuseKit graph: rebuild (%s): %s", decision.reason, decision.detail)
        if run is not None:
            run.note(f"rebuild ({decision.reason}): {decision.detail}")
    if run is not None and runner_cls is not None:
        run.misses_in_row += 1
        if run.capture_stopped or run.misses_in_row > gr.THRASH_LIMIT:
            # every call needs a new graph (more batches or shapes than max_graphs, an option that
            # changes per step): a capture costs a few forwards, so this run captures no more
            # (kept graphs still replay)
            if not run.capture_stopped:
                run.capture_stopped = True
                run.note(f"{run.misses_in_row} rebuilds in a row: no more captures in this run "
                         f"(last: {decision.reason}; raise max_graphs?)")
            _count(run, "bypasses", "unstable_inputs")
            return _eager(run, original, args, kwargs, done)
    if runner_cls is None:  # decisions only
        gs.retire(gs.add(gr.Entry(spec.signature)))
        _publish_memory()
        return _eager(run, original, args, kwargs, done)
    if not any(e.runner is not None for e in gs.entries.values()):
        gs.shared.clear()  # no graph holds the backend's pool any more: the next one starts anew
    generation = gs.generation  # a release during the capture: the new graph is not kept
    runner = runner_cls(original, named, len(args), spec, device, gs.shared)
    try:
        with protocol.preparing_capture():
            out, failure = runner.capture(int(opts.get("warmup", 1)))
    except BaseException:
        runner.release()
        raise
    if failure:
        runner.release()
        STATS.incr("capture_failures")
        host.say_once(f"graph:fail:{failure}", "ReuseKit graph: could not capture this forward, it runs "
                      "eagerly: %s", failure, level=logging.WARNING)
        if run is not None:
            run.note(f"capture failed: {failure}")
        entry = gr.Entry(spec.signature, failed=failure)
    else:
        STATS.incr("captures")
        if run is not None:
            run.captures += 1
        entry = gr.Entry(spec.signature, runner, runner.nbytes)
    evicted = gs.add(entry, generation)
    if any(e is not entry for e in evicted):
        STATS.incr("evictions", sum(e is not entry for e in evicted))
    gs.retire(evicted)
    _publish_memory()
    return _hand_back(out, hook)


def _step_hook(named: list[tuple[str, Any]]):
    """The step cache's per-call hook in a call's transformer_options (caching/graph_reuse.py)."""
    to = dict(named).get(protocol.OPTIONS_NAME)
    return to.get(protocol.STEP_HOOK) if isinstance(to, dict) else None


def _hand_back(out, hook):
    """A runner's output; with a step hook, hands it the tensors its patches made in the graph."""
    if hook is None:
        return out
    out, made = out
    hook.take_graph_outputs(list(made))
    return out


def _options(transformer_options) -> dict:
    if isinstance(transformer_options, dict):
        value = transformer_options.get(KEY)
        if isinstance(value, dict):
            return value
    return {}


def diffusion_model_wrapper(executor, *args, **kwargs):
    original = executor.original
    to = kwargs.get("transformer_options")
    if to is None:
        names, _ = _param_names(original)
        if "transformer_options" in names and names.index("transformer_options") < len(args):
            to = args[names.index("transformer_options")]
    opts = _options(to)
    held = _MODEL.get()
    model = held[0]() if held is not None else None
    ctx = (model, held[1]) if model is not None else None

    def captured(*a, **k):
        return graph_call(original, a, k, opts, ctx)

    inner = executor.wrappers[executor.idx + 1:]
    if inner:  # other wrappers stay in Python around the captured original
        return pe.WrapperExecutor.new_class_executor(captured, executor.class_obj, inner).execute(*args, **kwargs)
    return captured(*args, **kwargs)


def apply_model_wrapper(executor, *args, **kwargs):
    to = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
    wrappers = to.get("wrappers", {}) if isinstance(to, dict) else {}
    compiled = "torch.compile" in wrappers.get("apply_model", {})
    token = _MODEL.set((weakref.ref(executor.class_obj), compiled))
    try:
        return executor(*args, **kwargs)
    finally:
        _MODEL.reset(token)


def outer_sample_wrapper(executor, *args, **kwargs):
    run = gr.RunSummary()
    token = _RUN.set(run)
    try:
        return executor(*args, **kwargs)
    finally:
        _RUN.reset(token)
        summary = run.as_dict()
        STATS.info("last_run", summary)
        if run.backend:
            STATS.info("backend_last_run", run.backend)
        rebuilds = ", ".join(f"{k}={v}" for k, v in run.rebuilds.items()) or "none"
        log.info("ReuseKit graph: %d forwards (%s): %d captured, %d replayed, %d eager; rebuilds: %s",
                 run.steps, run.backend or "-", run.captures, run.replays, run.eager, rebuilds)
        _release_unless_kept(executor.class_obj)


def _release_unless_kept(guider) -> None:
    """At the end of a run, drop the graphs of a node whose ``keep_graphs`` is off."""
    patcher = getattr(guider, "model_patcher", None)
    opts = _options((getattr(guider, "model_options", None) or {}).get("transformer_options"))
    if patcher is not None and opts and not opts.get("keep", True):
        release_model(patcher.model, "run_ended", "keep_graphs is off", limit=int(opts.get("max_graphs", 2)))


def enable(patcher, max_graphs: int = 2, warmup: int = 1, keep: bool = True) -> None:
    """Add graph capture to ``patcher`` (a clone: this mutates it); ``keep``: graphs outlive the
    sampling run (they are freed anyway when ComfyUI needs the memory)."""
    install()
    disable(patcher)
    patcher.model_options.setdefault("transformer_options", {})[KEY] = {
        "enabled": True, "max_graphs": int(max_graphs), "warmup": int(warmup), "keep": bool(keep)}
    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, outer_sample_wrapper)
    patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, apply_model_wrapper)
    patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, diffusion_model_wrapper)


def disable(patcher) -> None:
    """Remove graph capture from ``patcher`` (a clone)."""
    for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL, pe.WrappersMP.DIFFUSION_MODEL):
        patcher.remove_wrappers_with_key(kind, KEY)
    patcher.model_options.get("transformer_options", {}).pop(KEY, None)


def is_enabled(patcher) -> bool:
    return KEY in patcher.model_options.get("transformer_options", {})
