"""The signature tests on the ``trace`` backend: the forward is traced once at capture and the
trace replayed, so (unlike ``emulate``, which re-runs the Python forward) a replay that should not
have happened gives a wrong output."""

import pytest
import torch
from graph_helpers import LATENTS, capture, conds_fixture, gc_fixture, last_run, sample  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph
DEFAULT_BACKEND = "trace"


def _half_img_in(model):
    import copy

    other = copy.deepcopy(model.model.diffusion_model.img_in)
    with torch.no_grad():
        other.weight.mul_(0.5)
    return other


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_replayed_traces_equal_the_plain_run_across_seeds(gc, tiny, conds, family):
    model = tiny.BUILDERS[family](1)
    captured = capture(model)
    for seed in (7, 11):
        out = sample(captured, conds, LATENTS[family], steps=4, seed=seed)
        assert torch.equal(out, sample(model, conds, LATENTS[family], steps=4, seed=seed))
    run = last_run(gc)
    assert run["backend"] == "trace" and (run["captures"], run["replays"], run["eager_steps"]) == (0, 4, 0), run


def test_a_replay_the_signature_should_have_refused_shows_as_a_wrong_output(gc, monkeypatch, tiny, conds):
    """Blind the signature to object patches: the trace replays the old module's weights."""
    model = tiny.tiny_flux(0)
    captured = capture(model)
    sample(captured, conds)
    patched = captured.clone()
    patched.add_object_patch("diffusion_model.img_in", _half_img_in(model))
    plain = model.clone()
    plain.add_object_patch("diffusion_model.img_in", patched.object_patches["diffusion_model.img_in"])
    expected = sample(plain, conds)
    fields = gc._state_fields
    monkeypatch.setattr(gc, "_state_fields", lambda *a: tuple(f if f[1] != "object_patches" else f[:2] + ((),)
                                                             for f in fields(*a)))
    stale = sample(patched, conds)
    assert last_run(gc)["replays"] == 3 and not torch.equal(stale, expected)
    monkeypatch.setattr(gc, "_state_fields", fields)
    assert torch.equal(sample(patched, conds), expected) and last_run(gc)["rebuilds"] == {"object_patches": 1}


def test_resolution_batch_lora_and_object_patch_changes_rebuild_and_stay_correct(gc, tiny, conds):
    import comfy.sd
    from graph_helpers import tiny_lora

    model = tiny.tiny_flux(0)
    captured = capture(model, max_graphs=2)
    sample(captured, conds, (1, 16, 8, 8))
    assert torch.equal(sample(captured, conds, (1, 16, 12, 12)), sample(model, conds, (1, 16, 12, 12)))
    assert last_run(gc)["rebuilds"] == {"shape": 1}
    assert torch.equal(sample(captured, conds, cfg=1.0), sample(model, conds, cfg=1.0))
    assert last_run(gc)["rebuilds"] == {"cond_batch": 1}
    (lora, _) = comfy.sd.load_lora_for_models(captured, None, tiny_lora(), 1.0, 0)
    (plain_lora, _) = comfy.sd.load_lora_for_models(model, None, tiny_lora(), 1.0, 0)
    assert torch.equal(sample(lora, conds), sample(plain_lora, conds))
    assert torch.equal(sample(captured, conds), sample(model, conds))
    patched = captured.clone()
    patched.add_object_patch("diffusion_model.img_in", _half_img_in(model))
    plain = model.clone()
    plain.add_object_patch("diffusion_model.img_in", patched.object_patches["diffusion_model.img_in"])
    assert torch.equal(sample(patched, conds), sample(plain, conds))
    assert last_run(gc)["rebuilds"] == {"object_patches": 1}
    assert torch.equal(sample(captured, conds), sample(model, conds))
