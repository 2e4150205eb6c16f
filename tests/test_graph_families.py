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

_FAMILIES = importlib.import_module(rkharness.TINY.__name__ + ".families")
FAMILIES = _FAMILIES.FAMILY_SPECS
SYNCS = {"hidream": "hidream/model.py"}  # families whose forward syncs the host: never captured


def _to(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(_to(x, device) for x in v)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v


def forward_calls(family: str, device: str):
    """The family's tiny model on ``device`` and its diffusion model's forward as apply_model calls
    it, twice, on inputs of the same shapes from two seeds: (the forward, [(positional, keyword
    arguments) of each call])."""
    spec = _FAMILIES.family_spec(family)
    model = spec.build(0)
    model.model.to(device)
    dm = model.model.diffusion_model
    forward, calls = dm.forward, []

    def spy(*args, **kw):
        calls.append((args, kw))
        return forward(*args, **kw)

    dm.forward = spy
    try:
        for seed in (1, 2):
            x, sigma, kwargs = _to(spec.inputs(spec.sizes[0], seed), device)
            with torch.inference_mode():
                model.model.apply_model(x, sigma * seed, transformer_options={}, **kwargs)
    finally:
        del dm.forward
    return forward, calls


def _first_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    for x in v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ():
        found = _first_tensor(x)
        if found is not None:
            return found
    return None


def _through(gc, family: str, device: str, runner_cls, refuses_syncs: bool, **tol):
    """Capture the first call, replay the second (another seed): each equals its eager call."""
    fn, calls = forward_calls(family, device)
    dev = _first_tensor(calls[0]).device  # with its index, as the capture sees it
    named = [gc._bind(fn, args, kwargs) for args, kwargs in calls]
    specs = [gc.gr.analyse_call(n, (), dev) for n in named]
    assert specs[0].bypass is None, f"{family}: {specs[0].detail}"
    assert gc.gr.can_reuse(specs[0].signature, specs[1].signature)[0], f"{family}: the second call needs another graph"
    with torch.inference_mode():
        eager = [fn(*args, **kwargs) for args, kwargs in calls]
    first = [_first_tensor(e) for e in eager]
    assert not torch.equal(*first), f"{family}: both calls give one output, a stale replay would pass"
    with torch.inference_mode():
        runner = runner_cls(fn, named[0], len(calls[0][0]), specs[0], dev, {})
        try:
            out, failure = runner.capture(1)
            if refuses_syncs and family in SYNCS:
                assert failure.startswith("the forward syncs the host at") and SYNCS[family] in failure, failure
                return
            assert failure == "", f"{family}: {failure}"
            torch.testing.assert_close(out, eager[0], **tol)
            torch.testing.assert_close(runner.replay(specs[1].tensors), eager[1], **tol)
        finally:
            runner.release()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_forward_on_the_buffers_a_capture_keeps_equals_eager(gc, family):
    _through(gc, family, "cpu", gc.graph_runners.StaticRunner, False, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_forward_replays_as_a_cuda_graph(gc, family):
    _through(gc, family, "cuda", gc.graph_runners.CudaGraphRunner, True, rtol=1e-4, atol=1e-4)
