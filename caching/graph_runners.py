"""The runners of graph reuse, in torch only: each holds static input buffers for one call
signature and replays the diffusion model's forward on them.

- :class:`StaticRunner` (``emulate``): the forward re-run on the buffers, no graph;
- :class:`TraceRunner` (``trace``): the forward traced once (``make_fx``) and the trace replayed,
  so a stale replay shows as a wrong output on any device;
- :class:`CudaGraphRunner` (``cuda``): a CUDA graph captured into the model's private pool.

patches/graph_capture.py picks one per call; nothing here imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import numbers
import os
import threading
import traceback
import weakref
from typing import Any

import torch

from . import protocol
from .graph_reuse import CallSpec, substitute

log = logging.getLogger("reusekit")


def step_hook(named: list[tuple[str, Any]]):
    """The step cache's per-call hook in a call's transformer_options (caching/protocol.py)."""
    to = dict(named).get(protocol.OPTIONS_NAME)
    return to.get(protocol.STEP_HOOK) if isinstance(to, dict) else None


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


def _fresh(v):
    """``v`` in new lists, tuples and dicts holding the same leaves: what a forward is handed, as it may
    empty a list it is given (ComfyUI's UNet pops each ControlNet residual from ``control`` as it adds it)."""
    if type(v) is list:
        return [_fresh(x) for x in v]
    if type(v) is tuple:
        return tuple(_fresh(x) for x in v)
    if type(v) is dict:
        return {k: _fresh(x) for k, x in v.items()}
    return v


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
    own reference when its key changes). Tensors made during the capture are not kept; with
    ``track_made`` each is remembered weakly (see :func:`_park`). ``own``: what the runner holds itself (its
    static inputs), not kept twice nor counted as kept alive."""

    def __init__(self, track_made: bool = False, own=()):
        super().__init__()
        self.made: set = set()  # keys (see _keep_key) of what the forward made
        self.own = {_keep_key(t) for t in own}
        self.kept: dict = {}  # key -> the storage (or wrapper tensor) kept alive
        self.made_refs: list | None = [] if track_made else None  # weak references to what it made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors_in(args):
            self._see(t)
        for t in _tensors_in(kwargs.values()):
            self._see(t)
        out = func(*args, **kwargs)
        for t in _tensors_in((out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (list, tuple)) else ()):
            self.made.add(_keep_key(t))
            if self.made_refs is not None:
                self.made_refs.append(weakref.ref(t))
        return out

    def _see(self, t: torch.Tensor) -> None:
        key = _keep_key(t)
        if key not in self.made and key not in self.kept and key not in self.own:
            # the memory itself (even where a .data is swapped later), or a wrapper subclass (a
            # quantized weight) whole, and so what it wraps
            self.kept[key] = t.untyped_storage() if isinstance(key, int) else t


class StaticRunner:
    """Static input buffers (allocated outside any graph pool), updated in place on every call.
    This base re-runs the forward eagerly on them (the ``emulate`` backend). ``shared``: state of
    one model's runners (a memory pool); ``raise_as_is``: exceptions a capture passes on instead
    of running the call eagerly (the host's cancel)."""

    def __init__(self, fn, named: list[tuple[str, Any]], n_pos: int, spec: CallSpec, device,
                 shared: dict | None = None, raise_as_is: tuple[type[BaseException], ...] = ()):
        self.fn = fn
        self.raise_as_is = raise_as_is
        self.device = torch.device(device)
        self.shared = {} if shared is None else shared
        self.n_pos = n_pos
        self.static = [torch.empty_like(t).copy_(t) for t in spec.tensors]
        self.args = substitute(named, self.static, self.device)
        self.hook = step_hook(self.args)
        self.nbytes = _nbytes(self.static)

    def _call(self):
        """The forward on the static buffers: its output, and with a step hook ``(output,
        tensors the hook's patches made)``."""
        pos = [_fresh(v) for _, v in self.args[:self.n_pos]]
        kw = {k: _fresh(v) for k, v in self.args[self.n_pos:]}
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
        with KeepExternal(own=self.static) as keep:
            out = self._call()
        self.kept = keep.kept
        return _clone_tree(out), ""

    def replay(self, tensors):
        self.copy_in(tensors)
        return _clone_tree(self._call())

    def release(self) -> None:
        self.static, self.args, self.fn, self.hook, self.kept = [], [], None, None, {}


def _host_data(v) -> bool:
    """Python numbers, numpy arrays and scalars, and lists or tuples of them: data a factory copies
    from host memory (not device tensors in a list, nor another library's device array)."""
    if isinstance(v, (list, tuple)):
        return all(_host_data(x) for x in v)
    return isinstance(v, numbers.Number) or type(v).__module__ == "numpy"


class ConstantUploads(torch.overrides.TorchFunctionMode):
    """Host data the forward copies to the device: a copy from pageable host memory syncs, and a
    sync cannot be captured (Wan's time embedding builds an ``arange`` on the CPU and moves it on
    every call; LTX builds ``torch.tensor(patch_size, device=...)`` from a Python list). The warm-up
    records each such upload in order (its CPU source and a copy of the result); the capture replays
    them as device copies of the recorded results, each checked once, at the capture, to equal its
    source (otherwise the capture fails and the call runs eagerly). Replays do not look again: like
    every Python branch of a captured forward, such a source may depend only on what the signature
    holds."""

    METHODS = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as})
    FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __init__(self):
        super().__init__()
        self.records: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # None: stayed on the CPU
        self.replaying = False
        self._next = 0

    @classmethod
    def _source(cls, func, args, kwargs) -> torch.Tensor | None:
        """The CPU tensor an upload copies from, None for any other op (the factories build it
        from their host data, on the CPU)."""
        src = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        if func in cls.METHODS:
            return src if isinstance(src, torch.Tensor) and src.device.type == "cpu" else None
        if func in cls.FACTORIES and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            if isinstance(src, torch.Tensor):
                return src if src.device.type == "cpu" else None
            return func(*args, **{**kwargs, "device": "cpu"}) if _host_data(src) else None
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = self._source(func, args, kwargs)
        if src is None:
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)  # this copy is the one a capture will not make
            self.records.append((src.clone(), out.clone()) if out.device.type != "cpu" else None)
            return out
        i, self._next = self._next, self._next + 1
        rec = self.records[i] if i < len(self.records) else ()
        if rec is None:
            return func(*args, **kwargs)
        if not rec or rec[0].shape != src.shape or rec[0].dtype != src.dtype or not torch.equal(rec[0], src):
            raise RuntimeError("the forward copies a CPU tensor to the device that differs from its warm-up's")
        return rec[1].clone()


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Active on the last warm-up call: notes the first op that makes the host wait for a device
    value (reads it into Python: ``.item()``, ``if tensor:``, ``int(tensor)``, printing it; copies it
    to the CPU without ``non_blocking``; sizes an output by the values: ``nonzero``, ``unique``,
    ``bincount``, a boolean mask index), with the model's line. Such a forward is not captured: the
    sync would fail the capture, and a failed capture costs more than a miss (under cudaMallocAsync
    it keeps what it made until the process ends). A sync not listed here, or made inside a torch
    function written in Python (the mode does not see into the ops it hands on), still fails its own
    capture. A mode sees only its own thread's ops, so another thread's sync (a VAE decode, a
    preview) is never taken for the forward's."""

    DEVICES = frozenset({"cuda"})
    READS = frozenset({
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
        torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__repr__, torch.Tensor.__format__,
        torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.is_nonzero, torch.is_nonzero,
        torch.Tensor.nonzero, torch.nonzero, torch.Tensor.argwhere, torch.argwhere,
        torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique,
        torch.Tensor.unique_consecutive, torch.unique_consecutive, torch.Tensor.bincount, torch.bincount,
        torch.Tensor.equal, torch.equal, torch.Tensor.allclose, torch.allclose,
    })
    MASKED = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})
    REPEATS = frozenset({torch.Tensor.repeat_interleave, torch.repeat_interleave})

    def __init__(self):
        super().__init__()
        self.found = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.found and self._syncs(func, args, kwargs):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            self.found = f"{_stack_where(traceback.extract_stack())} ({name}, in the warm-up)"
        return func(*args, **kwargs)

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type in self.DEVICES

    def _syncs(self, func, args, kwargs) -> bool:
        src = args[0] if args else None
        if func in self.READS:
            return self._on_device(src)
        if func is torch.Tensor.to:  # to the CPU, blocking
            to = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))), None))
            to = to.device if isinstance(to, torch.Tensor) else to
            non_blocking = kwargs.get("non_blocking", next((a for a in args[1:] if isinstance(a, bool)), False))
            return (self._on_device(src) and to is not None and torch.device(to).type == "cpu" != src.device.type
                    and not non_blocking)
        if func is torch.Tensor.copy_:  # into a CPU tensor from a device one, blocking
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return (len(args) > 1 and self._on_device(args[1]) and src.device.type == "cpu" != args[1].device.type
                    and blocking)
        if func in self.MASKED:  # a boolean mask: its count sizes the op
            index = args[1] if len(args) > 1 else None
            index = index if isinstance(index, tuple) else (index,)
            masked = any(self._on_device(i) and i.dtype == torch.bool for i in index)
            if masked and func is torch.Tensor.__setitem__ and sum(isinstance(i, torch.Tensor) for i in index) == 1:
                value = args[2] if len(args) > 2 else None  # one host value for all: a masked_fill, no sync
                return not (isinstance(value, numbers.Number) or isinstance(value, torch.Tensor)
                            and value.numel() == 1 and not self._on_device(value))
            return masked
        if func in self.REPEATS:  # repeats in a device tensor, the output's size not given
            alone = func is torch.repeat_interleave and len(args) == 1 and "repeats" not in kwargs
            repeats = src if alone else args[1] if len(args) > 1 else kwargs.get("repeats")
            return self._on_device(repeats) and kwargs.get("output_size") is None
        if func is torch.where:  # where(condition) alone is nonzero
            return len(args) + len(kwargs) == 1 and self._on_device(src if args else kwargs.get("condition"))
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def _why_not_captured(exc: BaseException, in_forward: bool) -> str:
    """A failed capture's reason for the log: for an error the capture raised inside the forward
    (a host sync, mostly), the line of the model that did it; otherwise the error's first line."""
    if in_forward and isinstance(exc, RuntimeError) and "captur" in str(exc).lower():
        return f"the forward syncs the host at {_where(exc)} ({_first_line(exc)})"
    return _first_line(exc)


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc`` outside torch and this module (whose torch function modes
    see every op of a capture): the line of the model that synced."""
    return _stack_where(traceback.extract_tb(exc.__traceback__))


def _stack_where(stack) -> str:
    frames = [f for f in stack if f"{os.sep}torch{os.sep}" not in f.filename and f.filename != __file__]
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


def _end_routing(device, pool) -> bool:
    """Route allocations back from a failed capture's pool; False where torch's ``capture_end``
    had done so before it raised (torches with pytorch#180395; earlier ones raised first)."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except Exception:  # "not currently recording to mempool_id" / "capture_underway is false"
        return False
    return True


_FAILED_CAPTURE: dict = {}
"""Per process: how this torch ends a capture that failed (see :func:`_failed_capture`)."""


def _failed_capture(device, side) -> tuple[bool | None, bool]:
    """How this torch ends a capture that failed: whether its ``reset`` leaves the pool's use count
    raised (``None``: could not be told) and whether its ``capture_end`` routed allocations back
    before it raised. Torch releases a graph's pool in ``reset`` only after a capture that ended, up
    to pytorch#190348, which also releases after one that failed; a pool whose count stays raised is
    never freed; and up to pytorch#180395 ``capture_end`` raised before routing back. Asked once per
    process of a capture failed on purpose into a pool whose users torch counts (a ``MemPool``), under
    the native allocator only (under cudaMallocAsync a pool is never released), and only where the
    failed capture had not ended (torch 2.11 ends it: on an H200 its ``reset`` alone gave the pool
    back and this was never asked)."""
    if "answer" in _FAILED_CAPTURE:
        return _FAILED_CAPTURE["answer"]
    keeps, routes_back = None, False
    try:
        probe = torch.cuda.MemPool()
        before = probe.use_count()
        graph = torch.cuda.CUDAGraph()
        failed = False
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=probe.id, capture_error_mode="thread_local")
                try:
                    side.synchronize()  # never permitted while capturing: fails the capture
                except Exception:
                    pass
                try:
                    graph.capture_end()
                except Exception:
                    failed = True
        finally:  # the probe's own pool is left as it was, however far it got
            graph.reset()
            routes_back = not _end_routing(device, probe.id)
            left = probe.use_count() - before
            if left > 0:
                torch._C._cuda_releasePool(device.index, probe.id)
        if failed:
            keeps = left > 0
        del graph, probe  # the MemPool's own reference goes with it, and its cache
    except Exception:  # a torch without MemPool's count: the pool is left to torch
        log.debug("ReuseKit graph: could not tell how a failed capture ends", exc_info=True)
    if keeps is None:
        log.warning("ReuseKit graph: this torch cannot say whether a failed capture gives its memory pool "
                    "back; such a pool may stay reserved until ComfyUI exits")
    _FAILED_CAPTURE["answer"] = keeps, routes_back
    return keeps, routes_back


def _capture_ended(graph) -> bool:
    """Whether torch ended this graph's capture, so that its ``reset`` gives the pool back: also
    where ``capture_end`` raised after that (an instantiation out of memory), on torches whose
    ``pool()`` asks only that the capture ended (torch 2.6 asked for the instantiated graph)."""
    try:
        graph.pool()  # refused before a capture has ended
    except Exception:
        return False
    return True


def _drop_failed(graph, device, pool, side, began: bool = True) -> None:
    """Let go of a failed capture's graph and its share of the model's pool (``began``: whether
    ``capture_begin`` returned). This torch may or may not have routed allocations back, and its
    ``reset`` may or may not give the pool back: both are asked of torch, never assumed, since a
    share given back twice frees the pool under the model's live graphs. Never raises: the step
    runs eagerly either way, and what could not be given back is said in the log."""
    try:
        if _capture_ended(graph):
            graph.reset()
            return
        tracker = getattr(graph, "_tracker", None)  # torch's liveness check (debug) ends with the capture
        if tracker is not None:
            tracker.stop()
        graph.reset()  # first: a torch whose reset undoes a failed capture's routing itself finds it on
        routed_here = _end_routing(device, pool)
        if torch.cuda.get_allocator_backend() != "native":
            return
        if routed_here:  # torch raised before routing back: its reset gives back only an ended capture
            release = began or bool(_failed_capture(device, side)[0])
        else:
            keeps, routes_back = _failed_capture(device, side)
            # where capture_end raises before routing back (torch before pytorch#180395), routing off
            # here means the capture ended, instantiation failed, and reset gave the share back
            release = began and bool(keeps) and routes_back
        if release:
            torch._C._cuda_releasePool(device.index, pool)
    except Exception:
        log.warning("ReuseKit graph: could not give back the memory pool of a failed capture; it may stay "
                    "reserved until ComfyUI exits", exc_info=True)


def _clear_frames(exc: BaseException | None, seen: set | None = None) -> None:
    """Clear the locals of every frame ``exc`` passed through, and of the errors it chains."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    traceback.clear_frames(exc.__traceback__)
    _clear_frames(exc.__cause__, seen)
    _clear_frames(exc.__context__, seen)


_PARKED: list = []
"""Under cudaMallocAsync: storages made in captures that failed, kept for the life of the process.
One reference more than the module's, never given back: at interpreter exit, where the module's
globals are cleared, freeing them would abort the process as it ends."""
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_PARKED))


_SIDE_STREAMS: dict = {}
"""The warm-up and capture stream of each (device, thread), for the life of the process: torch keeps a
cuBLAS workspace (32 MiB on an H200) per stream that ran a matmul, and a new stream after every release
(a reload, a LoRA change, ``keep_graphs`` off) took a new one, up to torch's 32 pooled streams."""


def side_stream(device):
    """This thread's capture stream on ``device`` (each sampling thread its own: captures never share one)."""
    key = (device, threading.get_ident())
    side = _SIDE_STREAMS.get(key)
    if side is None:
        side = _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return side


_CAPTURES_OFF: set = set()
"""Devices where a capture failed under cudaMallocAsync: torch still tracks the addresses of what that
capture made and kept (parked here, or held where the pack cannot see, such as a C++ buffer), and CUDA
hands them to a new capture again: in an H200 run the next capture there failed inside torch ("address
returned by cudaMallocAsync already exists in ptr_info"). No capture begins there again."""
CAPTURES_OFF = ("a capture failed on this GPU under cudaMallocAsync (ComfyUI's default allocator), and torch "
                "cannot capture there again in this process: new graphs are not captured until ComfyUI "
                "restarts, kept ones still replay (--disable-cuda-malloc avoids this)")


def captures_off(device) -> bool:
    """Whether no capture may begin on ``device`` (:data:`_CAPTURES_OFF`)."""
    return device in _CAPTURES_OFF


def _inner(t: torch.Tensor) -> list:
    """The plain tensors holding ``t``'s memory: itself, or a wrapper subclass's (a quantized
    weight) inner tensors, as it flattens them."""
    if _storage_ptr(t):
        return [t]
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        return []
    try:
        names = flatten()[0]
    except Exception:  # a wrapper that cannot say: nothing of it is kept
        return []
    return [x for n in names if isinstance(getattr(t, n, None), torch.Tensor) for x in _inner(getattr(t, n))]


def _park(keep: KeepExternal, device) -> None:
    """Under cudaMallocAsync a tensor made in a capture holds memory of the graph that capture was
    building; where the capture failed, CUDA dropped that graph and torch's free of that memory
    fails inside a destructor, which aborts the process (the H200 runs). Keeps the storage of every
    tensor on ``device`` the capture made that is still alive, whoever holds it (the failure's
    frames, its output, a patch's attribute), for the life of the process, said once in the log.
    Memory from before the capture (a weight, also under a view or a wrapper made in the capture)
    is never kept. Never raises: the step runs eagerly either way."""
    try:
        before = {k for k in (*keep.kept, *keep.own) if isinstance(k, int)}
        before.update(_storage_ptr(x) for k, w in keep.kept.items() if not isinstance(k, int) for x in _inner(w))
        found: dict = {}
        for ref in keep.made_refs or ():
            t = ref()
            for x in _inner(t) if t is not None else ():
                ptr = _storage_ptr(x)
                if ptr not in before and x.device == device:
                    found.setdefault(ptr, x.untyped_storage())
        if found and not _PARKED:
            log.warning("ReuseKit graph: under cudaMallocAsync the memory of a capture that failed cannot be "
                        "freed (freeing it aborts the process): it is kept until ComfyUI exits, %.1f MiB this "
                        "time (--disable-cuda-malloc frees it)", sum(st.nbytes() for st in found.values()) / 2**20)
        _PARKED.extend(found.values())
    except Exception:
        log.warning("ReuseKit graph: could not keep the memory of a failed capture", exc_info=True)


class CudaGraphRunner(StaticRunner):
    """Warm-up on a side stream, capture into the model's private pool, replay, return a clone of
    the static output (callers never see a buffer the next replay overwrites).

    A forward whose last warm-up call syncs the host (:class:`HostSyncs`) is not captured; a sync
    the watch does not know fails its own capture (``capture_error_mode="thread_local"``); a
    capture that fails ends with its share of the pool given back (:func:`_drop_failed`), what
    it made let go at once (under cudaMallocAsync kept instead, :func:`_park`, and that device
    captures no more, :func:`captures_off`) and the caller's stream current again, and the step
    runs eagerly. torch's sync debug mode is never set: it is process-wide, so while one thread
    warmed up, a sync on any other thread (a VAE decode, a preview) would raise there."""

    graph = None
    static_out = None
    pool_bytes = 0
    uploads = None

    def capture(self, warmup: int):
        device = self.static[0].device if self.static else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            return self._capture(device, warmup)

    def _warm_up(self, current, side, uploads: ConstantUploads, warmup: int):
        """The forward run ``warmup`` times on a side stream, its uploads recorded (the first call)
        and its host syncs looked for (the last); returns its output and where it synced ("" if
        nowhere). An error of the model's own is raised as is, after the streams are joined."""
        syncs = HostSyncs()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                for i in range(max(1, warmup)):
                    with uploads if i == 0 else contextlib.nullcontext(), \
                            syncs if i == max(1, warmup) - 1 else contextlib.nullcontext():
                        out = self._call()
                return out, syncs.found
        finally:
            current.wait_stream(side)  # also after an error: the buffers outlive nothing on `side`

    def _capture(self, device, warmup: int):
        current = torch.cuda.current_stream(device)
        # one side stream per device (and thread), kept: the caching allocator hands a block only to
        # the stream it was made on, so a capture on a new stream could not reuse the blocks an earlier
        # graph's intermediates left in the shared pool; and each stream costs a cuBLAS workspace
        side = side_stream(device)
        uploads = ConstantUploads()
        out, synced_at = self._warm_up(current, side, uploads, warmup)
        eager_out = _clone_tree(out)
        del out
        if synced_at:  # its capture would fail on the sync: not begun
            return eager_out, f"the forward syncs the host at {synced_at}"
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
        keep = KeepExternal(track_made=torch.cuda.get_allocator_backend() != "native", own=self.static)
        uploads.replaying = True
        failure = static_out = None
        forward_failed = False
        # on `side` (this device): torch's default capture stream is one per process, made on
        # whichever device captured first; a capture there leaves this device's kernels out. The
        # outer stream context restores the caller's stream even where capture_end raises.
        # CUDAGraph's own capture_begin/capture_end, not the ``torch.cuda.graph`` context manager:
        # where capture_end raises (a capture a sync invalidated) its __exit__ leaves the capture
        # stream current, and neither releases a failed capture's pool, which takes the allocator
        # calls of _drop_failed either way (torch's cudagraph trees make the same ones).
        with torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=pool, **_capture_kwargs())
            except Exception as exc:  # nothing captured
                began = torch.cuda.is_current_stream_capturing()
                if began:  # it raised once the capture was live (a capture-start hook): end it
                    try:
                        graph.capture_end()
                    except Exception:
                        log.debug("ReuseKit graph: ending a capture whose begin failed", exc_info=True)
                _drop_failed(graph, device, pool, side, began)
                if began and keep.made_refs is not None:  # a live capture failed under cudaMallocAsync
                    _CAPTURES_OFF.add(device)
                return eager_out, _first_line(exc)
            try:
                with keep, uploads:
                    static_out = self._call()
                if not _tensor_tree(static_out):
                    raise TypeError(f"the forward returned a {type(static_out).__name__}, not tensors")
            except BaseException as exc:  # the capture must end before anything else
                failure, forward_failed = exc, True
            try:
                graph.capture_end()
            except Exception as exc:  # the capture was invalidated (a sync, a CPU op...)
                failure = failure or exc
        if failure is not None:
            _drop_failed(graph, device, pool, side)
            if keep.made_refs is not None:  # cudaMallocAsync
                _park(keep, device)
                _CAPTURES_OFF.add(device)
            why = _why_not_captured(failure, forward_failed)
            # the forward's frames let go of what the capture made now, not once a cycle through
            # them is collected: a block of the pool still in use keeps the pool from being freed
            _clear_frames(failure)
            graph = keep = static_out = None
            try:
                if not isinstance(failure, Exception) or isinstance(failure, self.raise_as_is):
                    raise failure
                try:
                    torch.cuda.synchronize(device)
                except Exception:
                    log.debug("ReuseKit graph: synchronize after a failed capture", exc_info=True)
                return eager_out, why
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
        with KeepExternal(own=self.static) as keep:
            out = self._call()
        self.kept = keep.kept
        if self.hook is not None:  # its outputs come from patches that decide per call
            return _clone_tree(out), "a step cache's hook cannot be traced"

        def forward(*tensors):
            args = substitute(self.args, list(tensors), self.device)
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
