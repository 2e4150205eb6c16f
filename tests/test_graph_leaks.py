"""Nothing graph capture keeps (context variables, signatures, runners, stats) holds a model past
its patcher: tiny models built and dropped through the graph path are collected."""

import contextvars
import gc as pygc
import weakref

import pytest
import rkharness
import torch
from graph_helpers import capture, conds_fixture, gc_fixture, sample  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph


def _collected(refs) -> list:
    pygc.collect()
    return [r for r in refs if r() is not None]


@pytest.mark.parametrize("backend", ["eager", "emulate"])
def test_models_sampled_with_graph_capture_are_collected_once_dropped(gc, monkeypatch, tiny, conds, backend):
    import comfy.model_management as mm

    monkeypatch.setattr(gc, "FORCE_BACKEND", backend)
    refs = []
    for seed in range(4):
        model = tiny.tiny_flux(seed)
        captured = capture(model)
        assert torch.isfinite(sample(captured, conds, steps=2)).all()
        refs += [weakref.ref(model.model), weakref.ref(model.model.diffusion_model), weakref.ref(captured)]
        del model, captured
        mm.cleanup_models_gc()
    assert gc.STATS.handle.snapshot()["counters"].get("captures", 0) == (4 if backend == "emulate" else 0)
    assert _collected(refs) == [], "a model outlived its patcher"
    # its graphs went with it; the stats say so at the next snapshot (the model's finalizer only records)
    snapshot = rkharness.pack("caching.stats").REGISTRY.snapshot()
    assert next(c for c in snapshot["caches"] if c["name"] == gc.STATS.NAME)["entries"] == 0


def test_a_context_copied_during_sampling_holds_no_model(gc, monkeypatch, tiny, conds):
    """The panel's push schedules its callback from the sampling thread with a copy of its context
    (asyncio does so for every callback); a copy that outlives the run must not keep the model."""
    registry = rkharness.pack("caching.stats").REGISTRY
    copies = []

    def copy_like_a_push():
        copies.append(contextvars.copy_context())

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    registry.add_listener(copy_like_a_push)
    try:
        model = tiny.tiny_flux(5)
        sample(capture(model), conds, steps=2)
    finally:
        registry.remove_listener(copy_like_a_push)
    refs = [weakref.ref(model.model), weakref.ref(model)]
    del model
    assert copies and _collected(refs) == [], "a copied context kept the model"


def test_the_forwards_parameter_names_are_remembered_without_holding_the_forward(gc):
    class Forward:  # a callable object that carries a model, as a wrapping pack's forward may
        def __init__(self):
            self.model = torch.nn.Linear(2, 2)

        def __call__(self, x, timestep, context=None, transformer_options=None):
            return x

    forward = Forward()
    assert gc._param_names(forward) == (["x", "timestep", "context", "transformer_options"], False)
    assert gc._param_names(forward.__call__)[0] == ["x", "timestep", "context", "transformer_options"]
    refs = [weakref.ref(forward), weakref.ref(forward.model)]
    del forward
    assert _collected(refs) == []


def test_a_new_model_per_prompt_through_the_real_executor_leaves_no_model_behind(gc, monkeypatch, caplog):
    """The Graph KSampler with a new tiny checkpoint per prompt: each dropped model is collected,
    and ComfyUI's own leak check stays silent."""
    from test_graph import graph_ksampler_prompt

    rkharness.forget_dropped_clones()  # earlier tests' (their models' leak reports are not this test's)
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    ex = rkharness.Executor()
    refs = []
    with caplog.at_level("INFO"):
        for seed in range(5):
            prompt = graph_ksampler_prompt(seed=seed)
            prompt["1"]["inputs"]["seed"] = seed  # a new model every prompt
            ex.run(prompt)
            refs.append(weakref.ref(ex.output("1")[0][0].model))
    assert gc.STATS.handle.snapshot()["counters"]["captures"] >= 5
    assert _collected(refs[:-1]) == [], "a dropped model is still referenced"
    assert not [r.message for r in caplog.records if "memory leak" in r.message.lower()]
