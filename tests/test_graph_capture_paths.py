"""The CUDA backend's control flow on any machine: the paths a GPU cannot be asked to take on
purpose (a sync that fails the capture, a capture that cannot end, a cancel inside the capture) run
here with torch's CUDA entry points replaced by a recorder, around a real tiny Flux forward on the
CPU. What the recorder stands for is checked on a GPU by tests/test_graph_cuda.py; this file checks
that each path ends the capture, releases the pool, joins the warm-up stream, gives the caller's
stream back and returns the eager result or raises the cancel."""

import contextlib
import os
import sys
import threading

import pytest
import rkharness
import torch
from graph_helpers import conds_fixture, gc_fixture  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph

SYNC_ERROR = "called a synchronizing CUDA operation"  # torch's process-wide sync debug mode
CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"


class FakeCuda:
    """torch.cuda as the backend uses it, recording every call and counting each pool's users as
    torch's native allocator does. ``torch_kind`` is how this torch treats a capture whose
    ``capture_end`` raises: ``"old"`` raises before routing allocations back (before pytorch#180395),
    ``"2.12"`` routes them back first but its ``reset`` keeps the pool's count (before #190348; the
    H200 runs' torch 2.14.1 leaked so), ``"190348"`` gives it back in ``reset`` too."""

    def __init__(self, monkeypatch, end_fails=False, torch_kind="2.12", backend="native"):
        self.calls: list = []
        self.end_fails = end_fails
        self.torch_kind = torch_kind
        self.backend = backend
        self.begin_fails = ""  # "before routing" / "after routing" / "live" (a hook raised, the capture on)
        self.instantiate_fails = False
        self.sync_mode = 0
        self.current = "main"
        self.pools = 0
        self.side_streams = 0
        self.capturing = None  # the thread capturing (thread_local mode: only its syncs fail)
        self.invalidated = False
        self.uses: dict = {}  # pool -> its users (graphs, a MemPool), as torch counts them
        self.routing: set = set()  # pools that allocations are routed to
        self.mempools: list = []
        self.over_released = 0  # releases below zero: torch's "uc >= 0" assert
        fake = self

        class Stream:
            name = "side"

            def __init__(self, device=None):
                fake.side_streams += self.name == "side"

            def wait_stream(self, other):
                fake.calls.append(("wait", self.name, other.name))

            def synchronize(self):
                fake.sync()

        class Tracker:  # torch's liveness check (a debug mode entered by capture_begin)
            def stop(self):
                fake.calls.append(("tracker_stop",))

        class Graph:
            def __init__(self):
                self._tracker = Tracker()
                self.pool_id = None
                self.ended = self.instantiated = False

            def capture_begin(self, pool=None, **kwargs):
                when, fake.begin_fails = fake.begin_fails, ""  # the model's capture fails, not the probe's
                if when == "before routing":
                    raise RuntimeError("CUDA error: out of memory")
                self.pool_id = pool
                fake.uses[pool] = fake.uses.get(pool, 0) + 1
                fake.routing.add(pool)
                if when == "after routing":  # cudaStreamBeginCapture failed
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
                if when == "live":
                    fake.capturing = threading.get_ident()
                    raise RuntimeError("CUDA error: a capture-start hook failed")
                fake.calls.append(("begin", pool, fake.current, kwargs.get("capture_error_mode")))
                fake.capturing = threading.get_ident()

            def capture_end(self):
                fake.calls.append(("end",))
                fake.capturing = None
                invalidated, fake.invalidated = fake.invalidated, False
                if (fake.end_fails or invalidated) and fake.torch_kind == "old":
                    raise RuntimeError(CAPTURE_ERROR)
                fake.routing.discard(self.pool_id)
                if fake.end_fails:
                    raise RuntimeError(CAPTURE_ERROR)
                if invalidated:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                self.ended = True
                if fake.instantiate_fails:  # after the capture ended (torch's Python capture_end)
                    raise torch.OutOfMemoryError("CUDA out of memory (cudaGraphInstantiate)")
                self.instantiated = True

            def pool(self):  # torch 2.6 asked for the instantiated graph, later ones for the ended capture
                if not self.ended or fake.torch_kind == "old" and not self.instantiated:
                    raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
                return self.pool_id

            def replay(self):
                fake.calls.append(("replay",))

            def reset(self):
                fake.calls.append(("reset",))
                if self.pool_id is not None and (self.ended or fake.torch_kind == "190348"):
                    fake.release(self.pool_id)
                self.pool_id, self.ended = None, False

        class MemPool:
            def __init__(self):
                self.id = pool_handle()
                fake.uses[self.id] = 1
                fake.mempools.append(self.id)

            def use_count(self):
                return fake.uses[self.id]

        @contextlib.contextmanager
        def stream(s):
            prev, self.current = self.current, getattr(s, "name", s)
            try:
                yield
            finally:
                self.current = prev

        def pool_handle():
            self.pools += 1
            return (0, self.pools)

        def set_mode(mode):
            self.sync_mode = mode

        def end_routing(dev, pool):
            self.calls.append(("end_pool", pool))
            if pool not in self.routing:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            self.routing.discard(pool)

        def release_pool(dev, pool):
            self.calls.append(("release_pool", pool))
            if self.backend == "native":
                self.release(pool)

        class MainStream(Stream):
            name = "main"

        cuda = torch.cuda
        for name, value in {
            "Stream": Stream, "CUDAGraph": Graph, "MemPool": MemPool, "stream": stream,
            "graph_pool_handle": pool_handle,
            "current_stream": lambda device=None: MainStream(), "device": lambda d: contextlib.nullcontext(),
            "synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "get_allocator_backend": lambda: self.backend,
            "memory_reserved": lambda device=None: 1000 + 10 * len(self.calls),
            "mem_get_info": lambda device=None: (10**9 - 10 * len(self.calls), 10**9),
            "is_initialized": lambda: True, "get_sync_debug_mode": lambda: self.sync_mode,
            "is_current_stream_capturing": lambda: self.capturing == threading.get_ident(),
            "set_sync_debug_mode": set_mode,
        }.items():
            monkeypatch.setattr(cuda, name, value)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_routing, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", release_pool, raising=False)

    def release(self, pool):
        if self.uses.get(pool, 0) <= 0:
            self.over_released += 1
        self.uses[pool] = self.uses.get(pool, 0) - 1

    def graph_pools(self):
        """The pools the model's captures used (not the failed-capture probe's)."""
        return [c[1] for c in self.calls if c[0] == "begin" and c[1] not in self.mempools]

    def kinds(self):
        return [c[0] for c in self.calls]

    def sync(self):
        """A host sync (``.item()``) on the calling thread, as torch and CUDA treat it."""
        if self.sync_mode == "error":
            raise RuntimeError(SYNC_ERROR)
        if self.capturing == threading.get_ident():
            self.invalidated = True
            raise RuntimeError(CAPTURE_ERROR)


def flux_call(tiny, patch=None, eager=True):
    """A tiny Flux's forward, real arguments (``patch``: a graph-safe block patch on block 0) and
    (``eager``) its eager output."""
    protocol = rkharness.pack("caching.protocol")
    dm = tiny.tiny_flux(0).model.diffusion_model
    gen = torch.Generator().manual_seed(0)
    opts = {}
    if patch is not None:
        setattr(patch, protocol.GRAPH_SAFE, True)
        opts["patches_replace"] = {"dit": {("double_block", 0): patch}}
    named = [("x", torch.randn(1, 16, 8, 8, generator=gen)), ("timestep", torch.rand(1, generator=gen)),
             ("context", torch.randn(1, 7, 32, generator=gen)), ("y", torch.randn(1, 32, generator=gen)),
             ("guidance", torch.full((1,), 3.5)), ("transformer_options", opts)]
    out = dm._forward(*[v for _, v in named[:N_POS]], transformer_options=opts) if eager else None
    return dm._forward, named, out


N_POS = 5  # x, timestep, context, y, guidance by position; transformer_options by name


@pytest.fixture(autouse=True)
def _fresh_process_state(gc, monkeypatch):
    """What the runners learn or keep once per process (the failed-reset probe, tensors kept under
    cudaMallocAsync) starts anew in each test."""
    monkeypatch.setattr(gc.graph_runners, "_FAILED_CAPTURE", {})
    monkeypatch.setattr(gc.graph_runners, "_PARKED", [])
    monkeypatch.setattr(gc.graph_runners, "_CAPTURES_OFF", set())
    monkeypatch.setattr(gc.graph_runners, "_SIDE_STREAMS", {})


def runner_for(gc, fn, named, shared=None):
    """A CUDA runner as graph_capture makes one: ComfyUI's cancel passes through a capture."""
    import comfy.model_management as mm

    spec = gc.gr.analyse_call(named, (), torch.device("cpu"))
    assert spec.bypass is None
    return gc.graph_runners.CudaGraphRunner(fn, named, N_POS, spec, torch.device("cpu"), shared,
                                            (mm.InterruptProcessingException,))


def test_a_clean_capture_ends_replays_once_and_shares_the_models_pool(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)
    fn, named, eager = flux_call(tiny)
    shared = {}
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named, shared).capture(1)
        assert failure == "" and torch.equal(out, eager)
        assert fake.kinds() == ["wait", "wait", "begin", "end", "replay"]
        assert fake.calls[2][2:] == ("side", "thread_local") and fake.current == "main"
        runner_for(gc, fn, named, shared).capture(1)
    pools = [c[1] for c in fake.calls if c[0] == "begin"]
    assert pools[0] == pools[1] and fake.pools == 1  # one pool for the model's graphs
    # and one side stream: the allocator reuses a pool's free blocks only on the stream they were made on
    assert fake.side_streams == 1


def test_a_failed_captures_line_is_the_models_not_the_capture_modes(gc):
    """On a GPU a sync raises inside torch's C++ (``.item()``), below the torch function modes a
    capture runs in: the line named is the forward's own, not the mode's."""
    gr = gc.graph_runners
    with pytest.raises(RuntimeError) as info, gr.KeepExternal(), gr.ConstantUploads():
        line = sys._getframe().f_lineno + 1
        torch.ones(2) @ torch.ones(3)  # raises in C++, as a sync under capture does
    assert gr._where(info.value).endswith(f"{os.sep}test_graph_capture_paths.py:{line}")


TORCH_KINDS = ["old", "2.12", "190348"]


def assert_pools_given_back(fake, pools, live=0):
    """Every pool the captures used is held by ``live`` graphs only, routes nothing, and was never
    released below zero; the caller's stream is current again."""
    assert all(fake.uses.get(p, 0) == live for p in pools), fake.uses
    assert not fake.routing and fake.over_released == 0 and fake.current == "main"


@pytest.mark.parametrize("torch_kind", TORCH_KINDS)
def test_a_forward_that_syncs_fails_its_capture_and_runs_eagerly(gc, tiny, monkeypatch, torch_kind):
    """Whichever way this torch ends a failed capture, its pool's count goes back to what it was;
    whether reset gives it back is asked of torch once per process, only where capture_end routed
    allocations back itself."""
    fake = FakeCuda(monkeypatch, torch_kind=torch_kind)

    def syncs(args, extra):
        fake.sync()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, syncs)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
        again, _ = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and torch.equal(again, eager) and failure.startswith("the forward syncs the host at")
    assert "test_graph_capture_paths.py" in failure and CAPTURE_ERROR in failure
    assert_pools_given_back(fake, fake.graph_pools())
    assert len(fake.mempools) == (0 if torch_kind == "old" else 1)  # asked once, where it must be
    assert fake.kinds()[2:4] == ["begin", "end"] and "tracker_stop" in fake.kinds()


def test_a_torch_that_cannot_say_leaves_the_pool_and_says_so_once(gc, tiny, monkeypatch, caplog):
    """Without MemPool's count (an older torch), a pool given back twice could free it under live
    graphs: it is left to torch, and the log says once that it may stay reserved."""
    fake = FakeCuda(monkeypatch)
    monkeypatch.delattr(torch.cuda, "MemPool")

    def syncs(args, extra):
        fake.sync()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, syncs)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="reusekit"):
        for _ in range(2):
            assert runner_for(gc, fn, named).capture(1)[1].startswith("the forward syncs the host at")
    assert caplog.text.count("cannot say whether a failed capture gives its memory pool back") == 1
    assert all(fake.uses[p] == 1 for p in fake.graph_pools()) and fake.over_released == 0


@pytest.mark.parametrize("torch_kind", TORCH_KINDS)
def test_a_failed_capture_beside_a_live_graph_leaves_that_graphs_share(gc, tiny, monkeypatch, torch_kind):
    """A share of the model's pool given back twice would free the pool under its live graphs."""
    fake = FakeCuda(monkeypatch, torch_kind=torch_kind)
    calls = []

    def syncs_the_second_time(args, extra):
        if fake.capturing is not None:
            calls.append(1)
            if len(calls) > 1:
                fake.sync()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, syncs_the_second_time)
    shared = {}
    with torch.inference_mode():
        live = runner_for(gc, fn, named, shared)
        assert live.capture(1)[1] == ""
        out, failure = runner_for(gc, fn, named, shared).capture(1)
    assert torch.equal(out, eager) and failure.startswith("the forward syncs the host at")
    pools = fake.graph_pools()
    assert len(pools) == 2 and pools[0] == pools[1]
    assert_pools_given_back(fake, pools, live=1)
    live.release()
    assert_pools_given_back(fake, pools)


@pytest.mark.parametrize("cancel", [False, True])
def test_under_cuda_malloc_async_the_tensors_a_failed_capture_made_are_kept(gc, tiny, monkeypatch, cancel):
    """Under cudaMallocAsync, freeing memory made in a capture that failed aborts the process (the
    H200 runs, as the failed capture's traceback went): what is still alive is kept for the life of
    the process, whoever holds it (here an object's attribute, beside the forward's frames), with the
    cancel raised or the step run eagerly, and that device captures no more. Memory from before the
    capture (the model's weights, also under a view made in the capture; the runner's buffers; the
    eager output) is not kept."""
    import comfy.model_management as mm

    fake = FakeCuda(monkeypatch, backend="cudaMallocAsync")
    holder, weights = type("Holder", (), {})(), []

    def makes_then_fails(args, extra):
        if fake.capturing is not None:
            holder.made = args["img"] * 2
            view = weights[0].t()  # noqa: F841  (a view of a weight, in this frame when the capture fails)
            if cancel:
                raise mm.InterruptProcessingException()
            fake.sync()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, makes_then_fails)
    weights.append(next(p for p in fn.__self__.parameters() if p.dim() == 2))
    runner = runner_for(gc, fn, named)
    with torch.inference_mode():
        if cancel:
            with pytest.raises(mm.InterruptProcessingException):
                runner.capture(1)
        else:
            out, failure = runner.capture(1)
            assert torch.equal(out, eager) and failure.startswith("the forward syncs the host at")
    parked = {st.data_ptr() for st in gc.graph_runners._PARKED}
    assert holder.made.untyped_storage().data_ptr() in parked
    before = [*fn.__self__.parameters(), *runner.static] + ([] if cancel else [out])
    assert parked and not parked & {t.untyped_storage().data_ptr() for t in before}
    assert fake.over_released == 0 and not fake.routing and fake.mempools == []  # nothing to release there
    assert gc.graph_runners.captures_off(torch.device("cpu"))  # the device this fake captures on


def test_a_view_made_in_the_capture_of_a_wrapped_weight_keeps_nothing(gc, monkeypatch):
    """A wrapper subclass (a quantized weight) has no storage of its own: a view of it made in a
    failed capture wraps the weight's own memory, which is not kept; a new tensor's memory is."""
    from torch.testing._internal.two_tensor import TwoTensor

    gr = gc.graph_runners
    weight = TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    with gr.KeepExternal(track_made=True) as keep:
        view = weight.t()
        fresh = torch.randn(3) * 2
    gr._park(keep, torch.device("cpu"))
    parked = {st.data_ptr() for st in gr._PARKED}
    assert view.a.untyped_storage().data_ptr() == weight.a.untyped_storage().data_ptr()
    assert not parked & {weight.a.untyped_storage().data_ptr(), weight.b.untyped_storage().data_ptr()}
    assert fresh.untyped_storage().data_ptr() in parked


def _handled():
    raise ValueError("handled by the forward")


@pytest.mark.parametrize("held_in", ["the failing frame", "the frame of an error the forward handled"])
def test_what_a_failed_capture_made_goes_at_once_even_in_a_cycle_through_a_frame(gc, tiny, monkeypatch, held_in):
    """A block still in use keeps the model's pool from being freed: a tensor the capture made, in
    a forward frame that a cycle holds (the sync's, or one of an error the forward handled before it
    synced), goes when the step returns, not at the next collection."""
    import gc as pygc
    import weakref

    fake = FakeCuda(monkeypatch)
    made = []

    def makes_then(x, fail):
        t = x * 2
        made.append(weakref.ref(t))
        me = sys._getframe()  # noqa: F841  (the frame holds itself through its locals)
        fail()

    def fails(args, extra):
        if fake.capturing is not None:
            if held_in == "the failing frame":
                makes_then(args["img"], fake.sync)
            try:
                makes_then(args["img"], _handled)
            except ValueError:
                fake.sync()
        return extra["original_block"](args)

    fn, named, _ = flux_call(tiny, fails)
    pygc.disable()
    try:
        with torch.inference_mode():
            assert runner_for(gc, fn, named).capture(1)[1].startswith("the forward syncs the host at")
        assert made and made[0]() is None
    finally:
        pygc.enable()


def test_a_cleanup_that_fails_runs_the_step_eagerly_and_says_so(gc, tiny, monkeypatch, caplog):
    fake = FakeCuda(monkeypatch)

    def syncs(args, extra):
        fake.sync()
        return extra["original_block"](args)

    release = torch._C._cuda_releasePool

    def release_fails(dev, pool):  # for the model's pool (the probe's own goes through)
        if pool not in fake.mempools:
            raise RuntimeError("uc >= 0 INTERNAL ASSERT FAILED")
        release(dev, pool)

    monkeypatch.setattr(torch._C, "_cuda_releasePool", release_fails, raising=False)
    fn, named, eager = flux_call(tiny, syncs)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="reusekit"):
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure.startswith("the forward syncs the host at")
    assert "could not give back the memory pool of a failed capture" in caplog.text and fake.current == "main"


def test_host_data_is_numbers_and_numpy_not_device_tensors(gc):
    import numpy as np

    host = gc.graph_runners._host_data
    assert host([1, 2.0, (3, True)]) and host(np.arange(3)) and host(np.float32(1)) and host(7)
    assert not host([torch.ones(())]) and not host([1, torch.ones(())]) and not host("text")


def test_under_the_native_allocator_nothing_is_kept(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)

    def fails(args, extra):
        if fake.capturing is not None:
            fake.sync()
        return extra["original_block"](args)

    fn, named, _ = flux_call(tiny, fails)
    with torch.inference_mode():
        assert runner_for(gc, fn, named).capture(1)[1]
    assert gc.graph_runners._PARKED == []


def test_another_threads_sync_never_raises_during_a_warm_up_or_capture(gc, tiny, monkeypatch):
    """torch's sync debug mode is process-wide: set during a warm-up, it made a sync on any other
    thread (a VAE decode, a preview) raise there. Nor is another thread's sync taken for the
    forward's by the warm-up's watch (here the CPU stands for the device)."""
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(gc.graph_runners.HostSyncs, "DEVICES", frozenset({"cpu"}))
    errors: list = []

    def sync_elsewhere(args, extra):
        def other():
            try:
                fake.sync()
                torch.ones(2).sum().item()
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, sync_elsewhere)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert errors == [] and failure == "" and torch.equal(out, eager)
    assert fake.kinds() == ["wait", "wait", "begin", "end", "replay"]


SYNCS = {  # ops that make the host wait for a device value, each on a device tensor t
    "item": lambda t: t.sum().item(),
    "if tensor": lambda t: bool(t.sum() > 0),
    "int": lambda t: int(t.sum()),
    "tolist": lambda t: t.tolist(),
    "nonzero": lambda t: torch.nonzero(t),
    "mask index": lambda t: t[t > 0],
    "mask assign from the device": lambda t: t.clone().__setitem__(t > 0, t[0]),
    "repeat_interleave": lambda t: t.repeat_interleave(torch.ones(6, dtype=torch.long)),
    "bincount": lambda t: (t > 0).long().bincount(),
    "allclose": lambda t: torch.allclose(t, t),
    "f-string": lambda t: f"{t.sum()}",
    "where(condition)": lambda t: torch.where(t > 0),
    "unique": lambda t: t.unique(),
    "equal": lambda t: torch.equal(t, t),
}
NO_SYNCS = {
    "arithmetic": lambda t: t * 2 + 1,
    "where(c, a, b)": lambda t: torch.where(t > 0, t, -t),
    "int index": lambda t: t[0],
    "a shape": lambda t: torch.zeros(t.shape[0] * 2),
    "a mask kept on the device": lambda t: (t > 0).float() * t,
    "mask assign of a number": lambda t: t.clone().__setitem__(t > 0, 0.0),
    "mask assign of a number, beside a slice": lambda t: t.reshape(2, 3).clone().__setitem__((slice(None), t[:3] > 0), 0),
    "repeat_interleave by a number": lambda t: t.repeat_interleave(2),
    "repeat_interleave by a number, by name": lambda t: torch.repeat_interleave(t, repeats=2, dim=0),
}


@pytest.mark.parametrize("name", [*SYNCS, *NO_SYNCS])
def test_the_warm_up_watch_finds_the_ops_that_sync_and_names_their_line(gc, monkeypatch, name):
    """Here the CPU stands for the device: the watch judges ops by where their tensors live."""
    gr = gc.graph_runners
    monkeypatch.setattr(gr.HostSyncs, "DEVICES", frozenset({"cpu"}))
    op = {**SYNCS, **NO_SYNCS}[name]
    with gr.HostSyncs() as watch:
        op(torch.randn(6))
    if name in SYNCS:  # the op's own line
        assert f"{os.sep}test_graph_capture_paths.py:{op.__code__.co_firstlineno} (" in watch.found, watch.found
        assert watch.found.endswith(", in the warm-up)")
    else:
        assert watch.found == ""


def test_the_warm_up_watch_finds_copies_to_the_host(gc, monkeypatch):
    gr = gc.graph_runners
    monkeypatch.setattr(gr.HostSyncs, "DEVICES", frozenset({"meta"}))
    on_device, on_host = torch.empty(2, device="meta"), torch.empty(2)
    watch = gr.HostSyncs()
    assert watch._syncs(torch.Tensor.to, (on_device, "cpu"), {})
    assert watch._syncs(torch.Tensor.to, (on_device,), {"device": torch.device("cpu")})
    assert watch._syncs(torch.Tensor.to, (on_device, on_host), {})
    assert watch._syncs(torch.Tensor.cpu, (on_device,), {})
    assert watch._syncs(torch.Tensor.copy_, (on_host, on_device), {})
    assert not watch._syncs(torch.Tensor.to, (on_device, "cpu"), {"non_blocking": True})
    assert not watch._syncs(torch.Tensor.to, (on_device, "cpu", torch.float16, True), {})
    assert not watch._syncs(torch.Tensor.copy_, (on_host, on_device, True), {})
    assert not watch._syncs(torch.Tensor.__setitem__, (on_device, on_device > 0, torch.tensor(1.0)), {})
    assert watch._syncs(torch.Tensor.__setitem__, (on_device, on_device > 0, on_device[:1]), {})
    assert not watch._syncs(torch.Tensor.to, (on_device, torch.float16), {})
    assert not watch._syncs(torch.Tensor.to, (on_host, "meta"), {})  # an upload: ConstantUploads' part
    assert not watch._syncs(torch.Tensor.copy_, (on_device, on_host), {})


def test_no_host_family_syncs_in_its_forward_but_hidreams_expert_routing(gc, monkeypatch):
    """Every family of the host the tests build, one forward each under the watch (the CPU standing
    for the device): only HiDream's mixture of experts syncs (it routes tokens by a boolean mask), so
    its forward is never captured, and no other family's capture is refused by the watch."""
    import importlib

    families = importlib.import_module(rkharness.TINY.__name__ + ".families")
    gr = gc.graph_runners
    monkeypatch.setattr(gr.HostSyncs, "DEVICES", frozenset({"cpu"}))
    found, ran = {}, []
    for name, spec in families.FAMILY_SPECS.items():
        if spec.missing():
            continue
        model = spec.build(0)
        x, sigma, kwargs = spec.inputs(spec.sizes[0], 1)
        with torch.inference_mode(), gr.HostSyncs() as watch:
            model.model.apply_model(x, sigma, transformer_options={}, **kwargs)
        ran.append(name)
        if watch.found:
            found[name] = watch.found
    assert {"flux", "wan", "qwen_image", "hunyuan_video", "ltxv", "lumina2", "hidream"} <= set(ran)
    assert list(found) == ["hidream"] and f"ldm{os.sep}hidream{os.sep}model.py:" in found["hidream"], found


def test_a_forward_that_syncs_in_its_warm_up_is_never_captured(gc, tiny, monkeypatch):
    """The capture would fail on the sync (and under cudaMallocAsync keep what it made): it is not
    begun, the step runs eagerly and the reason names the model's line."""
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(gc.graph_runners.HostSyncs, "DEVICES", frozenset({"cpu"}))
    lines = []

    def syncs(args, extra):
        lines.append(sys._getframe().f_lineno + 1)
        args["img"].sum().item()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, syncs)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and fake.kinds() == ["wait", "wait"] and fake.current == "main"
    assert failure.startswith("the forward syncs the host at ") and f"test_graph_capture_paths.py:{lines[-1]} (" in failure
    assert "item, in the warm-up)" in failure


@pytest.mark.parametrize("torch_kind", TORCH_KINDS)
def test_a_capture_that_cannot_end_releases_its_pool_and_the_stream(gc, tiny, monkeypatch, torch_kind):
    fake = FakeCuda(monkeypatch, end_fails=True, torch_kind=torch_kind)
    fn, named, eager = flux_call(tiny)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and "operation not permitted when stream is capturing" in failure
    assert fake.kinds()[2:4] == ["begin", "end"] and "tracker_stop" in fake.kinds()
    assert_pools_given_back(fake, fake.graph_pools())


def test_an_error_in_the_captured_forward_ends_the_capture_and_drops_the_graph(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)
    seen = []

    def fails_in_capture(args, extra):
        seen.append(fake.current)
        if any(c[0] == "begin" for c in fake.calls):
            raise TypeError("not capturable")
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, fails_in_capture)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure == "TypeError: not capturable"
    assert fake.kinds()[2:] == ["begin", "end", "reset"] and seen[-2:] == ["side", "side"]


def test_a_cancel_in_the_capture_ends_it_and_is_raised(gc, tiny, monkeypatch):
    import comfy.model_management as mm

    fake = FakeCuda(monkeypatch)

    def cancelled_in_capture(args, extra):
        if any(c[0] == "begin" for c in fake.calls):
            raise mm.InterruptProcessingException()
        return extra["original_block"](args)

    fn, named, _ = flux_call(tiny, cancelled_in_capture)
    with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
        runner_for(gc, fn, named).capture(1)
    assert fake.kinds()[2:] == ["begin", "end", "reset"] and fake.current == "main"


def test_a_model_error_in_the_warm_up_is_raised_after_joining_the_stream(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)

    def broken(args, extra):
        raise RuntimeError("the model's own error")  # a RuntimeError, but not a sync

    fn, named, _ = flux_call(tiny, broken, eager=False)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="the model's own error"):
        runner_for(gc, fn, named).capture(1)
    assert fake.kinds() == ["wait", "wait"] and fake.sync_mode == 0 and fake.current == "main"


@pytest.mark.parametrize("torch_kind", TORCH_KINDS)
@pytest.mark.parametrize("when", ["before routing", "after routing"])
def test_a_capture_that_cannot_begin_runs_eagerly_and_gives_back_what_it_took(gc, tiny, monkeypatch, torch_kind, when):
    """torch raises from capture_begin before it routes allocations to the pool (a check) or after
    (cudaStreamBeginCapture failed): the pool's count is raised only in the second case, and given
    back there, once."""
    fake = FakeCuda(monkeypatch, torch_kind=torch_kind)
    fake.begin_fails = when
    fn, named, eager = flux_call(tiny)
    shared = {}
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named, shared).capture(1)
    assert torch.equal(out, eager) and failure.startswith("RuntimeError: CUDA error: ")
    assert fake.graph_pools() == []  # the model's capture never began
    assert_pools_given_back(fake, [shared[("pool", torch.device("cpu"))]])


@pytest.mark.parametrize("torch_kind", TORCH_KINDS)
def test_a_capture_that_ended_before_capture_end_raised_is_given_back_by_reset_alone(gc, tiny, monkeypatch, torch_kind):
    """torch's capture_end can raise after the capture ended (its instantiation out of memory):
    reset gives the pool back then, on every torch, and nothing else may (torch 2.6's ``pool()``
    refuses a graph not instantiated, so there the pack tells it by the routing)."""
    fake = FakeCuda(monkeypatch, torch_kind=torch_kind)
    fake.instantiate_fails = True
    fn, named, eager = flux_call(tiny)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure.startswith("OutOfMemoryError: CUDA out of memory")
    assert_pools_given_back(fake, fake.graph_pools())
    assert (fake.mempools == []) == (torch_kind != "old")  # asked only where pool() cannot tell


def test_a_step_hooks_outputs_come_back_from_capture_and_replay(gc, tiny, monkeypatch):
    """A step cache's patch makes a tensor inside the graph (TeaCache: the residual); the runner
    returns it beside the output, and a replay returns copies of the same static tensors."""
    protocol = rkharness.pack("caching.protocol")
    fake = FakeCuda(monkeypatch)

    class Hook:
        made = None

        def graph_outputs(self):
            return [self.made]

    def makes(args, extra):
        args["transformer_options"][protocol.STEP_HOOK].made = args["img"] * 2
        return extra["original_block"](args)

    fn, named, _ = flux_call(tiny, makes, eager=False)
    hook = Hook()
    named[-1][1][protocol.STEP_HOOK] = hook
    with torch.inference_mode():
        runner = runner_for(gc, fn, named)
        out, made = runner.capture(1)[0]
        assert runner.hook is None and runner.fn is None  # nothing of the capture's call is kept
        assert torch.equal(made[0], hook.made) and made[0] is not hook.made
        static = runner.static_out[1][0]
        again, made_again = runner.replay(gc.gr.analyse_call(named, (), torch.device("cpu")).tensors)
        assert torch.equal(made_again[0], static) and made_again[0] is not static and torch.equal(again, out)
    assert fake.kinds().count("replay") == 2


def test_a_models_pool_starts_anew_once_no_graph_holds_it(gc, tiny, conds, monkeypatch):
    """torch frees a pool whose last graph went; asking for it again by its id would fail."""
    from graph_helpers import capture, sample

    fake = FakeCuda(monkeypatch, end_fails=True)
    monkeypatch.setattr(gc, "_backend", lambda device: "cuda")
    model = capture(tiny.tiny_flux(0), max_graphs=2)
    with torch.inference_mode():
        sample(model, conds, (1, 16, 8, 8), steps=1)  # fails: its pool is released
        fake.end_fails = False
        sample(model, conds, (1, 16, 12, 12), steps=1)  # a new pool
        sample(model, conds, (1, 16, 8, 12), steps=1)  # shares the live one
    pools = fake.graph_pools()
    assert len(pools) == 3 and pools[0] != pools[1] == pools[2]
    # one stream still, and for another model too: torch keeps a cuBLAS workspace per stream for good
    with torch.inference_mode():
        sample(capture(tiny.tiny_flux(1)), conds, (1, 16, 8, 8), steps=1)
    assert len(fake.graph_pools()) == 4 and fake.side_streams == 1


def test_after_a_failed_capture_under_cuda_malloc_async_that_gpu_captures_no_more(gc, tiny, conds, monkeypatch, caplog):
    """Under cudaMallocAsync CUDA hands a failed capture's addresses to the next capture while torch
    still tracks what it kept (an H200 run: "address returned by cudaMallocAsync already exists in
    ptr_info"), whether or not the pack could see what it kept: after one failed capture, that
    device begins none (every new shape runs eagerly, counted with the reason, said once; kept graphs
    stay); another device still captures."""
    from graph_helpers import capture, last_run, sample

    fake = FakeCuda(monkeypatch, backend="cudaMallocAsync")
    monkeypatch.setattr(gc, "_backend", lambda device: "cuda")
    monkeypatch.setattr(rkharness.pack("patches.host"), "_said", set())  # said once per process
    model = capture(tiny.tiny_flux(0), max_graphs=2)
    with torch.inference_mode():
        kept = sample(model, conds, (1, 16, 8, 12), steps=2)
        fake.end_fails = True
        sample(model, conds, (1, 16, 8, 8), steps=1)  # its capture_end fails
        assert gc.graph_runners.captures_off(torch.device("cpu"))
        fake.end_fails = False
        begins = fake.kinds().count("begin")
        with caplog.at_level("WARNING", logger="reusekit"):
            outs = [sample(model, conds, shape, steps=2) for shape in ((1, 16, 12, 12), (1, 16, 12, 8))]
        run = last_run(gc)
        again = sample(model, conds, (1, 16, 8, 12), steps=2)  # the graph kept before the failure replays
    assert fake.kinds().count("begin") == begins
    assert run["bypasses"] == {"captures_off": 2} and run["captures"] == 0, run
    assert caplog.text.count("ReuseKit graph: cpu: a capture failed on this GPU") == 1  # once, naming the device
    plain = tiny.tiny_flux(0)
    with torch.inference_mode():
        for out, shape in zip(outs, ((1, 16, 12, 12), (1, 16, 12, 8)), strict=True):
            torch.testing.assert_close(out, sample(plain, conds, shape, steps=2), rtol=0, atol=0)
    torch.testing.assert_close(again, kept, rtol=0, atol=0)
    assert last_run(gc)["replays"] == 2 and last_run(gc)["bypasses"] == {}
    monkeypatch.setattr(gc.graph_runners, "_CAPTURES_OFF", {torch.device("cuda", 1)})  # another GPU's failure
    assert not gc.graph_runners.captures_off(torch.device("cuda", 0))  # by device, not by kind
    with torch.inference_mode():
        sample(model, conds, (1, 16, 12, 12), steps=1)
    assert fake.kinds().count("begin") == begins + 1


@pytest.mark.parametrize("when", ["after routing", "live"])
def test_under_cuda_malloc_async_a_begin_that_failed_live_turns_that_gpu_off(gc, tiny, monkeypatch, when):
    """A capture_begin that raised once the capture was on (a capture-start hook) is a failed capture
    like any other under cudaMallocAsync: the device captures no more. One that raised before the
    capture began (cudaStreamBeginCapture refused) leaves it capturing."""
    fake = FakeCuda(monkeypatch, backend="cudaMallocAsync")
    fake.begin_fails = when
    fn, named, eager = flux_call(tiny)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure.startswith("RuntimeError: CUDA error: ") and fake.capturing is None
    assert gc.graph_runners.captures_off(torch.device("cpu")) == (when == "live")
