"""The bench stand-ins (tests/tinymodels/standins.py): real classes with their trained weights, pictures of
their captions, and magnitude-ratio curves shaped like the published FLUX.1-dev and Wan 2.1 1.3B ones."""

import importlib
import math
import random

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache

FAMILIES = ("flux", "wan")


def tiny(name):
    return importlib.import_module(f"{rkharness.TINY.__name__}.{name}")


@pytest.fixture(scope="module")
def S():
    return tiny("standins")


@pytest.fixture(scope="module", params=FAMILIES)
def standin(request, S):
    return request.param, S.load_standin(request.param)


def test_the_loader_builds_the_real_class_at_its_depth_with_the_stored_weights_exactly(S, standin):
    import comfy.model_base
    import comfy.model_patcher
    from safetensors.torch import load_file

    family, model = standin
    assert isinstance(model, comfy.model_patcher.ModelPatcher)
    dm = model.model.diffusion_model
    if family == "flux":
        assert type(model.model) is comfy.model_base.Flux
        assert (len(dm.double_blocks), len(dm.single_blocks), dm.hidden_size) == (4, 8, 96)
    else:
        assert type(model.model) is comfy.model_base.WAN21
        assert (len(dm.blocks), dm.dim) == (10, 96)
    stored = load_file(str(S.weights_path(family)))
    own = dict(dm.named_parameters())
    assert len(own) == len(stored)
    # the file's names are the bundled host's; 0.33 renames `*_norm.scale` and loads them all the same
    for name, value in stored.items():
        mine = own.get(name, own.get(name.replace("_norm.scale", "_norm.weight")))
        assert mine is not None, name
        assert torch.equal(mine.detach(), value.float()), name


def test_an_unknown_family_names_the_loader_and_the_families(S):
    with pytest.raises(ValueError, match="stand-in family.*'sd3'.*flux, wan"):
        S.load_standin("sd3")


def test_held_out_captions_are_never_drawn_for_training():
    scenes = tiny("standin_scenes")
    rng = random.Random(0)
    seen = {scenes.caption(scenes.scene(rng)) for _ in range(20000)}
    held = set(scenes.held_out_captions())
    assert len(held) == len(scenes.HELD_OUT) and not seen & held
    # the vocabulary is shared: each held-out caption's words appear in training captions
    words = {w for c in seen for w in c.split()}
    assert all(set(c.split()) <= words for c in held)
    assert any(" and " in c for c in seen) and any(" to " in c for c in seen)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_picture_code_decodes_a_training_target_exactly(S, family):
    import comfy.supported_models

    pic = torch.rand(2, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    fmt = getattr(comfy.supported_models, S.MODEL_CLASSES[family]).latent_format()
    x = S.picture_to_model_space(pic)
    latent = fmt.process_out(x.unsqueeze(2) if family == "wan" else x)  # Wan's latents are 5-D
    assert torch.allclose(S.latent_to_picture(latent, family), pic, atol=1e-5)


@pytest.mark.xfail(strict=True, reason="not met yet: trained 1,500 / 1,600 steps of 16 on a CPU, the stand-ins "
                   "draw one shape per held-out caption but not yet its colours closely (mean error 0.31 Flux, "
                   "0.47 Wan, against 0.2)")
def test_the_stand_ins_draw_the_held_out_captions_colours(S, standin):
    """Held-out prompts (never trained on) at CFG 4: the shape's pixels have the caption's colour and the
    rest its background's (on average: the pictures are grainy), far closer than another colour."""
    import nodes

    scenes = tiny("standin_scenes")
    family, model = standin
    clip = rkharness.TINY.tiny_clip(0)
    errors, wrong = [], []
    with torch.inference_mode():
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")
        for color, shape, bg in sorted(scenes.HELD_OUT)[:6]:
            text = scenes.caption({"bg": bg, "bg2": None, "shapes": [(color, shape)]})
            (pos,) = nodes.CLIPTextEncode().encode(clip, text)
            (out,) = nodes.common_ksampler(model, 3, 20, 4.0, "euler", "simple", pos, neg,
                                           {"samples": S.empty_latent(family)})
            pic = S.latent_to_picture(out["samples"], family)
            rgb, mask = pic[0, :3], pic[0, 3] > 0.5
            assert 0.03 < mask.float().mean() < 0.8, (color, shape, bg)  # one shape, not a field

            def dist(region, name, table):  # of the region's mean colour (the grain averages out)
                want = torch.tensor(table[name], dtype=torch.float32) / 255
                return float((rgb[:, region].mean(1) - want).abs().mean())

            errors.append(dist(mask, color, scenes.COLORS) + dist(~mask, bg, scenes.BACKGROUNDS))
            other = next(c for c in scenes.COLORS if c not in (color, bg))
            wrong.append(dist(mask, other, scenes.COLORS) + dist(~mask, bg, scenes.BACKGROUNDS))
    assert sum(errors) / len(errors) < 0.2 and sum(errors) < 0.5 * sum(wrong), (errors, wrong)


def test_curve_match_is_zero_on_the_published_curve_and_flat_match_on_a_flat_one(S):
    for family in FAMILIES:
        published = S.published_ratios(family)
        steps = len(published["cond"])
        mags = {}
        for label, ratios in published.items():
            cum = [sum(math.log(r) for r in ratios[: i + 1]) for i in range(steps)]
            mags[label] = [(1.0 - i / steps, c) for i, c in enumerate(cum)]
        assert S.curve_match(family, mags) == pytest.approx(0.0, abs=1e-12)
        flat = {label: [(1.0 - i / steps, 0.0) for i in range(steps)] for label in published}
        assert S.curve_match(family, flat) == pytest.approx(S.flat_match(family))
        assert S.flat_match(family) == pytest.approx(
            sum(abs(r - 1) for r in published["cond"][1:]) / (steps - 1)
            if len(published) == 1 else
            sum(sum(abs(r - 1) for r in rs[1:]) / (steps - 1) for rs in published.values()) / len(published))
    with pytest.raises(ValueError, match="curve_match"):
        S.curve_match("flux", {})


def test_a_curve_resampled_to_another_step_count_keeps_its_total_and_shape(S):
    fine = [1.0] + [1.0 + 0.1 * math.cos(math.pi * i / 56) for i in range(1, 56)]  # 56 steps, falling
    coarse = S.resampled_ratios(fine, 28)
    assert len(coarse) == 28 and coarse[0] == 1.0
    # the product over the same stretch of the schedule is kept: two fine steps make one coarse step
    for j in range(1, 27):
        assert coarse[j] == pytest.approx(fine[2 * j - 1] * fine[2 * j], rel=1e-9)
    assert S.resampled_ratios(fine, 56) == pytest.approx(fine)


@pytest.fixture(scope="module")
def calibrated(S):
    """Each stand-in's curve as the Calibrate node records it, at the published table's step count."""
    out = {}
    for family in FAMILIES:
        steps = S.PUBLISHED_STEPS[family]
        out[family] = S.calibrated_magnitudes(S.load_standin(family), family, steps)
        assert sorted(out[family]) == ["cond", "uncond"] and all(len(p) == steps for p in out[family].values())
    return out


def test_the_flux_stand_ins_residual_grows_over_its_early_steps_as_flux_dev_does(S, calibrated):
    """The demo Flux's ratios start at 0.98-1.0 (its early steps nearly alike); FLUX.1-dev's at 1.21, 1.12,
    1.08: the stand-in's grow its residual over the first six steps too (published: by 1.66x), then
    shrink it over the second half (published: to 0.75x)."""
    for points in calibrated["flux"].values():
        r = S.step_ratios(points)
        assert math.prod(r[1:7]) > 1.1 and min(r[1:4]) > 1.0, r
        assert math.prod(r[14:]) < 0.85, r


def test_the_wan_stand_ins_ratios_stay_near_one_over_the_first_half_as_wan_1_3b_does(S, calibrated):
    for points in calibrated["wan"].values():
        r = S.step_ratios(points)
        assert all(0.97 < x < 1.03 for x in r[1:25]), r


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stand_ins_calibrated_curves_are_far_closer_to_the_published_than_a_flat_one(S, calibrated, family):
    """The residual-profile term of their training holds the residual's norm against sigma to the
    published curve's: their ratios fall over the last steps as the real models' do."""
    assert S.curve_match(family, calibrated[family]) < 0.5 * S.flat_match(family)
    for points in calibrated[family].values():
        r = S.step_ratios(points)
        assert math.prod(r[-4:]) < 0.9, r  # falling at the end: the published curves 0.77 (Flux), 0.59 (Wan)
