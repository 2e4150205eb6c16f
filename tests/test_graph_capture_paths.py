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
    """torch.cuda as the backend uses it, recording every call."""

    def __init__(self, monkeypatch, end_fails=False):
        self.calls: list = []
        self.end_fails = end_fails
        self.begin_fails = False
        self.sync_mode = 0
        self.current = "main"
        self.pools = 0
        self.side_streams = 0
        self.capturing = None  # the thread capturing (thread_local mode: only its syncs fail)
        self.invalidated = False
        fake = self

        class Stream:
            name = "side"

            def __init__(self, device=None):
                fake.side_streams += self.name == "side"

            def wait_stream(self, other):
                fake.calls.append(("wait", self.name, other.name))

        class Tracker:  # torch's liveness check (a debug mode entered by capture_begin)
            def stop(self):
                fake.calls.append(("tracker_stop",))

        class Graph:
            def __init__(self):
                self._tracker = Tracker()

            def capture_begin(self, pool=None, **kwargs):
                if fake.begin_fails:
                    raise RuntimeError("CUDA error: out of memory")
                fake.calls.append(("begin", pool, fake.current, kwargs.get("capture_error_mode")))
                fake.capturing = threading.get_ident()

            def capture_end(self):
                fake.calls.append(("end",))
                fake.capturing = None
                if fake.end_fails:
                    raise RuntimeError(CAPTURE_ERROR)
                if fake.invalidated:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self):
                fake.calls.append(("replay",))

            def reset(self):
                fake.calls.append(("reset",))

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

        class MainStream(Stream):
            name = "main"

        cuda = torch.cuda
        for name, value in {
            "Stream": Stream, "CUDAGraph": Graph, "stream": stream, "graph_pool_handle": pool_handle,
            "current_stream": lambda device=None: MainStream(), "device": lambda d: contextlib.nullcontext(),
            "synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "get_allocator_backend": lambda: "native", "memory_reserved": lambda device=None: 1000 + 10 * len(self.calls),
            "is_initialized": lambda: True, "get_sync_debug_mode": lambda: self.sync_mode,
            "set_sync_debug_mode": set_mode,
        }.items():
            monkeypatch.setattr(cuda, name, value)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: self.calls.append(("end_pool", pool)),
                            raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda dev, pool: self.calls.append(("release_pool", pool)),
                            raising=False)

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


def test_a_forward_that_syncs_fails_its_capture_and_runs_eagerly(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)

    def syncs(args, extra):
        fake.sync()
        return extra["original_block"](args)

    fn, named, eager = flux_call(tiny, syncs)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure.startswith("the forward syncs the host at")
    assert "test_graph_capture_paths.py" in failure and CAPTURE_ERROR in failure
    pool = fake.calls[2][1]
    assert fake.kinds()[2:] == ["begin", "end", "end_pool", "release_pool", "tracker_stop"]
    assert fake.calls[4:6] == [("end_pool", pool), ("release_pool", pool)] and fake.current == "main"


def test_another_threads_sync_never_raises_during_a_warm_up_or_capture(gc, tiny, monkeypatch):
    """torch's sync debug mode is process-wide: set during a warm-up, it made a sync on any other
    thread (a VAE decode, a preview) raise there."""
    fake = FakeCuda(monkeypatch)
    errors: list = []

    def sync_elsewhere(args, extra):
        def other():
            try:
                fake.sync()
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


def test_a_capture_that_cannot_end_releases_its_pool_and_the_stream(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch, end_fails=True)
    fn, named, eager = flux_call(tiny)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and "operation not permitted when stream is capturing" in failure
    pool = fake.calls[2][1]
    assert fake.kinds()[2:] == ["begin", "end", "end_pool", "release_pool", "tracker_stop"]
    assert fake.calls[4:6] == [("end_pool", pool), ("release_pool", pool)] and fake.current == "main"


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


def test_a_capture_that_cannot_begin_runs_eagerly_and_ends_nothing(gc, tiny, monkeypatch):
    fake = FakeCuda(monkeypatch)
    fake.begin_fails = True
    fn, named, eager = flux_call(tiny)
    with torch.inference_mode():
        out, failure = runner_for(gc, fn, named).capture(1)
    assert torch.equal(out, eager) and failure == "RuntimeError: CUDA error: out of memory"
    assert fake.kinds() == ["wait", "wait"] and fake.current == "main"


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
    pools = [c[1] for c in fake.calls if c[0] == "begin"]
    assert len(pools) == 3 and pools[0] != pools[1] == pools[2]
