"""Every host family the tests build: its diffusion model's forward, as graph capture receives it,
through a graph runner. On the CPU the ``emulate`` runner: the call's signature takes every family
(no bypass) and the forward run on the buffers a capture keeps equals the eager call. On a GPU
(marker ``gpu``) a CUDA graph: replay equals eager, except HiDream, whose forward syncs the host (its
experts are routed by boolean masks) and is refused in the warm-up, naming its line."""

import importlib

import pytest
import rkharness
import torch
from graph_helpers import gc_fixture  # noqa: F401  (the fixture gc)

pytestmark = pytest.mark.graph

FAMILIES = importlib.import_module(rkharness.TINY.__name__ + ".families").FAMILY_SPECS
SYNCS = {"hidream": "hidream/model.py"}  # families whose forward syncs the host: never captured


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device) for x in v)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v


def forward_call(family: str, device: str):
    """The family's tiny model on ``device`` and its diffusion model's forward as apply_model calls
    it: (the forward, its positional and keyword arguments)."""
    spec = FAMILIES[family]
    missing = spec.missing()
    if missing:
        pytest.skip(f"{family}: this ComfyUI has no {missing}")
    model = spec.build(0)
    model.model.to(device)
    x, sigma, kwargs = _to(spec.inputs(spec.sizes[0], 1), device)
    dm = model.model.diffusion_model
    forward, seen = dm.forward, {}

    def spy(*args, **kw):
        seen.update(args=args, kwargs=kw)
        return forward(*args, **kw)

    dm.forward = spy
    try:
        with torch.inference_mode():
            model.model.apply_model(x, sigma, transformer_options={}, **kwargs)
    finally:
        del dm.forward
    return forward, seen["args"], seen["kwargs"]


def _assert_close(a, b, **tol):
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_close(x, y, **tol)
    else:
        torch.testing.assert_close(a, b, **tol)


def _through(gc, family: str, device: str, runner_cls, refuses_syncs: bool, **tol):
    fn, args, kwargs = forward_call(family, device)
    named = gc._bind(fn, args, kwargs)
    spec = gc.gr.analyse_call(named, (), torch.device(device))
    assert spec.bypass is None, f"{family}: {spec.detail}"
    with torch.inference_mode():
        eager = fn(*args, **kwargs)
        runner = runner_cls(fn, named, len(args), spec, torch.device(device), {})
        try:
            out, failure = runner.capture(1)
            if refuses_syncs and family in SYNCS:
                assert failure.startswith("the forward syncs the host at") and SYNCS[family] in failure, failure
                return
            assert failure == "", f"{family}: {failure}"
            _assert_close(out, eager, **tol)
            _assert_close(runner.replay(spec.tensors), eager, **tol)
        finally:
            runner.release()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_forward_on_the_buffers_a_capture_keeps_equals_eager(gc, family):
    _through(gc, family, "cpu", gc.graph_runners.StaticRunner, False, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_forward_replays_as_a_cuda_graph(gc, family):
    _through(gc, family, "cuda", gc.graph_runners.CudaGraphRunner, True, rtol=1e-4, atol=1e-4)
