"""Step cache: the families it hooks (Chroma, Chroma Radiance, LTXV beside Flux, Wan, HunyuanVideo,
Qwen-Image), the ones it refuses with a reason, and the published variant ``auto`` reads from a model
and its run's conds.

Each hooked family on its tiny real model: the same input twice, cond and uncond batched, the skipped
second call gives the computed first one's output; and a run through the real KSampler: calibrate,
then skip, a finite latent, cond and uncond reported.
"""

import importlib

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache


def P():
    return rkharness.pack("patches.step_cache")


def SF():
    return rkharness.pack("patches.step_families")


def N():
    return rkharness.pack("nodes.step_cache")


def helpers():
    return importlib.import_module(f"{rkharness.TINY.__name__}.step_families")


@pytest.fixture(autouse=True)
def _fresh_reasons():
    """The step cache's reason rows are bounded (64 kinds, then one "other" row): each test starts from none,
    so a reason it looks for has its own row whatever ran before it in the session."""
    P().stats().reset_counters()


@pytest.fixture(autouse=True)
def _isolated_calibrations(monkeypatch, tmp_path):
    """Calibrations go to a temporary file, and none leaks between tests."""
    store = rkharness.pack("caching.step_cache").CalibrationStore(tmp_path / "teacache_calibration.json")
    monkeypatch.setattr(P(), "STORE", store)
    return store


def step_cache(model, model_type="auto", threshold=1.0, rule="teacache"):
    """ReuseKit Step Cache by keyword (the TeaCache rule by default: what the calibration fits), plain reuse."""
    (m,) = N().TeaCacheNode.execute(model, model_type=model_type, threshold=threshold, start_percent=0.0,
                                    end_percent=1.0, max_consecutive_skips=0, cache_device="device",
                                    residual_mode="reuse", rule=rule).args
    return m


def sample(model, conds, shape, steps=6, cfg=3.0, seed=3):
    import nodes

    pos, neg = conds
    (out,) = nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", pos, neg,
                                   {"samples": torch.zeros(shape)})
    return out["samples"]


def last_run():
    return P().stats().snapshot()["info"]["last_run"]


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# family (tests/tinymodels/families.py), the step cache's name for it, latent shape through the KSampler,
# whether its conds carry the text encoder's attention mask (LTXV's T5 gives one; ComfyUI 0.3 needs it)
HOOKED = {
    "chroma": ("chroma", (1, 16, 8, 8), False),
    "chroma_radiance": ("chroma_radiance", (1, 3, 32, 32), False),
    "ltxv": ("ltxv", (1, 128, 2, 2, 2), True),
    "mochi": ("mochi", (1, 12, 2, 8, 8), True),
    "lumina2": ("lumina2", (1, 16, 8, 8), False),
    "z_image": ("lumina2", (1, 16, 8, 8), False),
    "cosmos": ("cosmos_predict2", (1, 16, 1, 8, 8), False),
    "anima": ("cosmos_predict2", (1, 16, 1, 8, 8), False),
}


@pytest.mark.parametrize("rule,second", [(r, "S") for r in ("teacache", "magcache", "first_block", "schedule")]
                         + [("schedule", "H")])
@pytest.mark.parametrize("name", [*HOOKED, "ltx2"])
def test_a_skipped_step_on_the_same_input_returns_the_computed_output(name, rule, second):
    """Cond and uncond batched, each skip rule: the second call on the same input skips and gives the
    first one's output, so the residual is taken from and added to the image tokens (Chroma's single
    stream is text first; LTXV's blocks add into their input in place; LTX-2's carry video and audio
    together: both come back); the schedule rule's cond-only step (H) too, its uncond rebuilt from the
    cond's residual."""
    h = helpers()
    spec = h.family_spec(name)
    model = spec.build(0)
    x, sigma, kwargs = h.batched(*spec.inputs(spec.sizes[0], 0))
    cached = step_cache(model, rule=rule)
    settings = cached.model_options["transformer_options"][P().KEY]
    assert settings.family.name == (HOOKED[name][0] if name in HOOKED else name)
    if second == "H" and not settings.family.half:
        pytest.skip(f"{name}: no cond-only steps (its block inputs are not cut by rows)")
    first, again, run = h.two_calls(cached, x, sigma, kwargs, second=second)
    one_block = rule == "first_block" and len(settings.blocks) == 1  # the first block is the whole stack
    said = [r["reason"] for r in P().stats().snapshot()["reasons"] if "the only one of this" in r["reason"]]
    assert said == ([f"first_block decides after the first block, the only one of this {settings.family.name} model: "
                     "none is left to skip, every call is computed (rule teacache decides before it)"]
                    if one_block else []), said
    want = [["C", "C"], ["C", "S"]] if second == "H" else [["C", "C" if one_block else "S"]] * 2
    assert [s.pattern for s in run.conds.values()] == want
    assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)


@pytest.mark.parametrize("name", list(HOOKED))
def test_calibrates_then_skips_through_the_real_ksampler(conds, name):
    """Without published coefficients a clear error until calibrated; calibrating changes nothing; then
    skipped steps, a finite latent, cond and uncond reported."""
    family, shape, masked = HOOKED[name]
    model = helpers().family_spec(name).build(0)
    if masked:
        conds = tuple([[c, {**e, "attention_mask": torch.ones(c.shape[:2], dtype=torch.long)}] for c, e in cond] for cond in conds)
    ref = sample(model, conds, shape)
    if SF().detect_family(model).default_type == "calibrated":
        with pytest.raises(ValueError, match="ReuseKit Step Cache: model_type: no calibration"):
            sample(step_cache(model, threshold=0.0), conds, shape)
    else:  # published coefficients (LTXV, Mochi): runs before any calibration, exact at threshold 0
        assert torch.equal(sample(step_cache(model, threshold=0.0), conds, shape), ref)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    assert torch.equal(sample(cal, conds, shape), ref)
    assert last_run()["calibration"]["points"] >= 2
    out = sample(step_cache(model, threshold=3.0), conds, shape)
    run = last_run()
    assert run["family"] == family and run["model_type"] == "calibrated" and run["calls_skipped"] >= 1
    assert set(run["conds"]) == {"cond", "uncond"}
    assert out.shape == ref.shape and torch.isfinite(out).all()


def test_ltx2_calibrates_through_the_real_ksampler_then_skips_on_its_table():
    """LTX-2's model returns its video and audio streams as a list: the calibration's gain is measured on the
    video (it read ``.shape`` of the list and every calibration run failed); calibrating changes nothing,
    and the calibrated table then skips."""
    import comfy.nested_tensor

    import nodes

    model = helpers().family_spec("ltx2").build(0)
    gen = torch.Generator().manual_seed(5)
    pos, neg = [[torch.randn((1, 7, 64), generator=gen), {}]], [[torch.randn((1, 7, 64), generator=gen), {}]]

    def run(m):
        latent = comfy.nested_tensor.NestedTensor([torch.zeros((1, 128, 2, 2, 2)), torch.zeros((1, 8, 4, 16))])
        (out,) = nodes.common_ksampler(m, 3, 8, 3.0, "euler", "simple", pos, neg, {"samples": latent})
        return torch.cat([t.flatten() for t in out["samples"].tensors])

    with torch.inference_mode():
        ref = run(model)
        assert torch.equal(run(N().TeaCacheCalibrateNode.execute(model).args[0]), ref)
        assert last_run()["calibration"]["points"] >= 2
        out = run(step_cache(model, model_type="calibrated", threshold=3.0))
    summary = last_run()
    assert summary["model_type"] == "calibrated" and summary["calls_skipped"] >= 1 and torch.isfinite(out).all()


def test_rule_auto_without_a_table_runs_first_block_until_calibrated(conds, caplog):
    """A family with no published table (Chroma): the node's defaults (rule auto) run First-Block, which
    needs none, exact at threshold 0, saying so once; after a calibration auto is TeaCache again. An
    explicit rule that lacks its table stays a clear error."""
    import logging

    family, shape, _ = HOOKED["chroma"]
    model = helpers().family_spec("chroma").build(0)
    ref = sample(model, conds, shape)
    defaults = {i.id: i.default for i in N().TeaCacheNode.define_schema().inputs if i.id != "model"}
    with caplog.at_level(logging.INFO, logger="reusekit"):
        (auto,) = N().TeaCacheNode.execute(model=model, **{**defaults, "threshold": 0.0}).args
        assert torch.equal(sample(auto, conds, shape), ref)
        assert last_run()["rule"] == "first_block" and last_run()["model_type"] == "none"
        (auto,) = N().TeaCacheNode.execute(model=model, **defaults).args
        default = sample(auto, conds, shape)
        assert last_run()["rule"] == "first_block" and not any("set by hand" in r["reason"]
                                                                for r in P().stats().reasons())
        # a threshold set by hand is TeaCache's: first_block's default runs, and the fallback says so (it was
        # replaced without a word until 2026-12-07)
        (auto,) = N().TeaCacheNode.execute(model=model, **{**defaults, "threshold": 5.0}).args
        assert torch.equal(sample(auto, conds, shape), default) and last_run()["rule"] == "first_block"
        (row,) = [r for r in P().stats().reasons() if "set by hand" in r["reason"]]
        assert row["event"] == "fallback" and "(none is published)" in row["reason"], row
    assert [r.getMessage() for r in caplog.records if "rule auto uses first_block" in r.getMessage()] == [
        "ReuseKit Step Cache: no teacache table for this chroma model yet (none is published); rule auto uses "
        "first_block until ReuseKit TeaCache Calibrate has run on it"]
    with pytest.raises(ValueError, match="no calibration"):
        sample(step_cache(model, threshold=0.0), conds, shape)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    sample(cal, conds, shape)
    (auto,) = N().TeaCacheNode.execute(model=model, **defaults).args
    sample(auto, conds, shape)
    assert last_run()["rule"] == "teacache" and last_run()["model_type"] == "calibrated"


def test_a_subclass_the_family_does_not_name_reads_no_published_table(conds, caplog):
    """A subclass of a family's model class that the pack does not name (ComfyUI 0.38's LTXVImageModel,
    an LTXVModel for images; here a subclass of the real LTXVModel, with the same weights) gets no table
    fitted on its base: rule auto runs First-Block on it, as on a model without a table, counted and said
    once, and gives exactly what First-Block gives; the base's table stays one pick away (model_type)."""
    import logging

    from comfy.ldm.lightricks.model import LTXVModel

    class LTXVImageModel(LTXVModel):
        pass

    family, shape, _ = HOOKED["ltxv"]
    conds = tuple([[c, {**e, "attention_mask": torch.ones(c.shape[:2], dtype=torch.long)}] for c, e in cond]
                  for cond in conds)
    model = helpers().family_spec("ltxv").build(0)
    assert SF().model_variant(SF().detect_family(model), model, {}) == "ltxv"  # the class itself: its table
    sample(step_cache(model, model_type="ltxv", threshold=0.05), conds, shape)
    base_run = last_run()
    model.model.diffusion_model.__class__ = LTXVImageModel
    assert SF().model_variant(SF().detect_family(model), model, {}) == "unknown class LTXVImageModel"
    defaults = {i.id: i.default for i in N().TeaCacheNode.define_schema().inputs if i.id != "model"}
    with caplog.at_level(logging.INFO, logger="reusekit"):
        (auto,) = N().TeaCacheNode.execute(model=model, **{**defaults, "threshold": 0.3}).args
        out = sample(auto, conds, shape)
    run = last_run()
    assert (run["rule"], run["model_type"], run["variant"]) == ("first_block", "none", "unknown class LTXVImageModel")
    assert torch.equal(out, sample(step_cache(model, threshold=0.3, rule="first_block"), conds, shape))
    assert [r.getMessage() for r in caplog.records if "rule auto uses first_block" in r.getMessage()] == [
        "ReuseKit Step Cache: no teacache table for this ltxv model yet (unknown class LTXVImageModel); rule auto "
        "uses first_block until ReuseKit TeaCache Calibrate has run on it"]
    reasons = P().stats().snapshot()["reasons"]
    assert any(r["event"] == "fallback" and "(unknown class LTXVImageModel)" in r["reason"] for r in reasons), reasons
    with pytest.raises(ValueError, match="no calibration for this ltxv model yet .unknown class LTXVImageModel"):
        sample(step_cache(model, threshold=0.05), conds, shape)  # TeaCache asked for by name: a clear error
    named = sample(step_cache(model, model_type="ltxv", threshold=0.05), conds, shape)  # the base's, picked
    assert torch.isfinite(named).all()
    assert (last_run()["model_type"], last_run()["conds"]) == ("ltxv", base_run["conds"])  # decides as the base


NO_SEAM = "no block-replace seam"


@pytest.mark.parametrize("name,cls,why", [
    ("hidream", "HiDreamImageTransformer2DModel", NO_SEAM),
    ("omnigen2", "OmniGen2Transformer2DModel", NO_SEAM),
])
def test_a_family_the_cache_cannot_hook_is_a_clear_error_that_says_why(name, cls, why):
    """The families whose forward has no block seam: both nodes refuse it naming themselves, the model
    class and the reason, never a run that silently skips nothing."""
    model = helpers().family_spec(name).build(0)
    with pytest.raises(ValueError, match=f"ReuseKit Step Cache: model: .*does not support {cls} models .*{why}"):
        step_cache(model)
    with pytest.raises(ValueError, match=f"ReuseKit TeaCache Calibrate: model: .*does not support {cls}"):
        N().TeaCacheCalibrateNode.execute(model)


def test_a_clip_or_a_vae_given_as_the_model_is_named_as_the_wrong_input(tiny):
    """Through an any-typed link a node may get a CLIP or a VAE as its model: the error says what it got, not
    that a "NoneType" model is unsupported."""
    for wrong, name in ((tiny.tiny_clip(0), "CLIP"), (tiny.tiny_vae(0), "VAE"), ("text", "str")):
        with pytest.raises(ValueError, match=f"ReuseKit Step Cache: model: expects a MODEL .*got a {name}$"):
            step_cache(wrong)
        with pytest.raises(ValueError, match=f"ReuseKit TeaCache Calibrate: model: expects a MODEL .*got a {name}$"):
            N().TeaCacheCalibrateNode.execute(wrong)


def test_ltx2_skips_add_both_streams_residuals_decided_once(conds):
    """LTX-2 on a changed input: the skipped call adds the computed call's video residual to the video
    stream and its audio residual to the audio stream (one decision for both): its output is what the
    host's own forward gives when its block returns exactly those sums."""
    h = helpers()
    spec = h.family_spec("ltx2")
    model = spec.build(0)
    x, sigma, kwargs = h.batched(*spec.inputs(spec.sizes[0], 0))
    seen = []

    def recorder(args, extra):
        before = tuple(t.clone() for t in args["img"])  # the block adds into its inputs in place
        out = extra["original_block"](args)
        seen.append((before, tuple(t.clone() for t in out["img"])))
        return out

    base = model.clone()
    base.set_model_patch_replace(recorder, "dit", "double_block", 0)
    cached = step_cache(base, rule="magcache")
    moved = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    to = cached.model_options["transformer_options"].copy()
    settings = to[P().KEY]
    run = rkharness.pack("caching.step_cache").RunState(P().resolved_config(settings.config, settings.family),
                                                      None, 1.0, 0.0, h.FLAT)
    to.update({"wrappers": cached.wrappers, "sigmas": sigma, "uuids": ["c", "u"], "cond_or_uncond": [0, 1],
               P().RUN_KEY: run})
    with torch.inference_mode():
        cached.model.apply_model(x, sigma, transformer_options=to, **kwargs)
        to["sigmas"] = sigma.clone()  # the next step: a timestep tensor of its own, as a sampler makes one
        skipped = cached.model.apply_model(moved, sigma, transformer_options=to, **kwargs)
    assert [s.pattern for s in run.conds.values()] == [["C", "S"]] * 2 and len(seen) == 1
    (vin, ain), (vout, aout) = seen[0]
    assert float((aout - ain).abs().max()) > 0 and float((vout - vin).abs().max()) > 0

    def ends_in_the_sums(args, extra):
        vx, ax = args["img"]
        return {"img": (vx + (vout - vin), ax + (aout - ain))}

    expected_model = model.clone()
    expected_model.set_model_patch_replace(ends_in_the_sums, "dit", "double_block", 0)
    with torch.inference_mode():
        expected = expected_model.model.apply_model(moved, sigma, transformer_options={
            "patches_replace": expected_model.model_options["transformer_options"]["patches_replace"]}, **kwargs)
    assert torch.allclose(skipped, expected, atol=1e-5), rel_err(skipped, expected)


# ---- the published variant of a model ------------------------------------------------------------

def run_variant(model, conds, shape):
    """The variant ``model_variant`` reads in a real KSampler run, from the guider's own conds in the
    OUTER_SAMPLE wrapper (where the step cache resolves its coefficients)."""
    import comfy.patcher_extension

    seen = []

    def wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        seen.append(SF().model_variant(SF().detect_family(guider.model_patcher), guider.model_patcher, guider.conds))
        return executor(*args, **kwargs)

    m = model.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "rk_test_variant", wrapper)
    sample(m, conds, shape, steps=1)
    (variant,) = seen
    return variant


def test_ltxvs_guidance_pass_never_shares_the_conds_state_and_its_guidance_stays():
    """LTXV Spatio-Temporal Guidance calls the cond once more at each step with a block's self-attention left
    out: only its options differ. That pass was taken for the cond's next step and skipped, giving the cond's
    own output, so the guidance vanished (and, computed, its residual became the cond's). It is computed and
    leaves the cond's state alone, counted; the cond's own steps still skip."""
    import comfy.nested_tensor

    import nodes

    lt = pytest.importorskip("comfy_extras.nodes_lt")
    if not hasattr(lt, "LTXVSpatioTemporalGuidance"):
        pytest.skip("this ComfyUI has no LTXV Spatio-Temporal Guidance")
    model = helpers().family_spec("ltx2").build(0)
    gen = torch.Generator().manual_seed(5)
    pos, neg = [[torch.randn((1, 7, 64), generator=gen), {}]], [[torch.randn((1, 7, 64), generator=gen), {}]]
    latent = comfy.nested_tensor.NestedTensor([torch.zeros((1, 128, 2, 2, 2)), torch.zeros((1, 8, 4, 16))])

    def picture(m, scale):
        m = lt.LTXVSpatioTemporalGuidance.execute(m, scale, "0", 0.0, 1.0).args[0]
        (out,) = nodes.common_ksampler(m, 3, 10, 3.0, "euler", "simple", pos, neg, {"samples": latent})
        return torch.cat([t.flatten() for t in out["samples"].tensors])

    def cached():
        return N().TeaCacheNode.execute(model, model_type="auto", threshold=2.0, start_percent=0.0,
                                        end_percent=1.0, max_consecutive_skips=0, cache_device="device",
                                        residual_mode="reuse", rule="interval").args[0]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    with torch.inference_mode():
        plain = {scale: picture(model, scale) for scale in (0.0, 3.0)}
        skipping = {scale: picture(cached(), scale) for scale in (0.0, 3.0)}
    run = last_run()
    assert {c["skipped"] for c in run["conds"].values()} == {5}  # a step in 2 for cond and uncond alike
    guidance = rel(plain[3.0], plain[0.0])
    assert guidance > 0.05 and rel(skipping[3.0], skipping[0.0]) > 0.5 * guidance
    assert rel(skipping[3.0], plain[3.0]) < rel(skipping[3.0], plain[0.0])
    reasons = [r["reason"] for r in P().stats().reasons() if r["event"] == "bypass"]
    assert any(r.startswith("a second call of a cond at one step") for r in reasons), reasons


def test_flux_with_reference_latents_is_flux_kontext(tiny, conds):
    """Kontext is a Flux fed a reference image through ComfyUI's ReferenceLatent node."""
    import comfy_extras.nodes_edit_model

    flux = tiny.tiny_flux(0)
    ref = {"samples": torch.randn((1, 16, 4, 6), generator=torch.Generator().manual_seed(7))}
    (pos,) = comfy_extras.nodes_edit_model.ReferenceLatent.execute(conds[0], ref).args
    kontext = (pos, conds[1])
    assert run_variant(flux, conds, (1, 16, 8, 8)) == "flux"
    assert run_variant(flux, kontext, (1, 16, 8, 8)) == "flux-kontext"
    assert set(rkharness.pack("caching.step_cache").COEFFICIENTS) >= {"flux", "flux-kontext"}


def test_wan21_t2v_is_told_apart_by_width(tiny, conds):
    """dim 1536 is the 1.3B layout, 5120 the 14B one (the cut is at 4096; tiny models read as 1.3B)."""
    assert run_variant(tiny.tiny_wan(0), conds, (1, 16, 1, 8, 8)) == "wan2.1_t2v_1.3B_ret_mode"
    h = helpers()
    wan = SF().detect_family(h.meta_wan())
    assert SF().model_variant(wan, h.meta_wan(), {}) == "wan2.1_t2v_14B_ret_mode"
    assert SF().model_variant(wan, h.meta_wan(dim=1536, ffn_dim=8960, num_heads=12), {}) == "wan2.1_t2v_1.3B_ret_mode"


def wan_conds(latent_hw):
    """A run's conds (``guider.conds``) whose start image encodes to a latent of ``latent_hw``."""
    image = torch.zeros((1, 16, 1, *latent_hw))
    return {"positive": [{"concat_latent_image": image}], "negative": [{"concat_latent_image": image}]}


def test_wan21_i2v_picks_480p_or_720p_by_the_start_image_latent():
    """480x832 encodes to 60x104 latents, 720x1280 to 90x160; without a start image: 480p."""
    h = helpers()
    i2v = h.tiny_wan_i2v(0)
    wan = SF().detect_family(i2v)
    assert wan.name == "wan"
    assert SF().model_variant(wan, i2v, wan_conds((60, 104))) == "wan2.1_i2v_480p_14B_ret_mode"
    assert SF().model_variant(wan, i2v, wan_conds((104, 60))) == "wan2.1_i2v_480p_14B_ret_mode"
    assert SF().model_variant(wan, i2v, wan_conds((90, 160))) == "wan2.1_i2v_720p_14B_ret_mode"
    assert SF().model_variant(wan, i2v, {"positive": [{}], "negative": [{}]}) == "wan2.1_i2v_480p_14B_ret_mode"
    # Fun Control: an "i2v" config that is no image-to-video model (control video, not a start image)
    fun = h.meta_wan("WAN21_FunControl2V", model_type="i2v", in_dim=48)
    assert SF().model_variant(wan, fun, wan_conds((90, 160))) == "wan2.1_t2v_14B_ret_mode"


def test_wan21_i2v_reads_the_start_image_latent_of_a_real_run(conds):
    """The start-image latent set on the conds as WanImageToVideo sets it (node_helpers), read from the
    guider's conds of a real KSampler run: the i2v variant."""
    import node_helpers

    image = torch.zeros((1, 16, 1, 8, 8))
    values = {"concat_latent_image": image, "concat_mask": torch.ones((1, 1, 1, 8, 8))}
    i2v_conds = tuple(node_helpers.conditioning_set_values(c, values) for c in conds)
    assert run_variant(helpers().tiny_wan_i2v(0), i2v_conds, (1, 16, 1, 8, 8)) == "wan2.1_i2v_480p_14B_ret_mode"


def test_hunyuan_video_and_the_calibrated_families_read_their_default(tiny):
    h = helpers()
    for model, family, variant in ((h.tiny_hunyuan_video(0), "hunyuan_video", "hunyuan_video"),
                                   (tiny.tiny_flux(0), "flux", "flux"),
                                   (h.family_spec("ltxv").build(0), "ltxv", "ltxv")):
        fam = SF().detect_family(model)
        assert (fam.name, SF().model_variant(fam, model, {"positive": [{}]})) == (family, variant)
    for name, family in (("hunyuan_video15", "hunyuan_video15"), ("wan22", "wan22"), ("chroma", "chroma")):
        model = h.family_spec(name).build(0)
        fam = SF().detect_family(model)
        assert (fam.name, SF().model_variant(fam, model, {})) == (family, "calibrated")


def test_the_wan22_14b_experts_never_share_a_calibration(conds):
    """The high- and low-noise experts have one layout (Wan 2.1 14B) and one variant, but each its own
    weights: a calibration of one is never the other's."""
    h = helpers()
    spec = h.family_spec("wan22_14b")
    high, low = spec.build(0), spec.build(1)
    wan = SF().detect_family(high)
    assert SF().model_variant(wan, high, {}) == SF().model_variant(wan, low, {})
    shape = (1, 16, 1, 8, 8)
    (cal,) = N().TeaCacheCalibrateNode.execute(high).args
    sample(cal, conds, shape)
    sample(step_cache(high, model_type="calibrated", threshold=0.0), conds, shape)
    assert last_run()["model_type"] == "calibrated"
    with pytest.raises(ValueError, match="ReuseKit Step Cache: model_type: no calibration"):
        sample(step_cache(low, model_type="calibrated", threshold=0.0), conds, shape)
    assert P().model_fingerprint(high, wan) != P().model_fingerprint(low, wan)


def vace_inputs(frames=2):
    """A Wan VACE call: latent, text, one control video (96 channels per latent frame) at strength 0.8."""
    g = torch.Generator().manual_seed(0)
    kwargs = {"c_crossattn": torch.randn((1, 7, rkharness.TINY.TEXT_DIM), generator=g),
              "vace_context": torch.randn((1, 1, 96, frames, 8, 8), generator=g), "vace_strength": [0.8]}
    return torch.randn((1, 16, frames, 8, 8), generator=g), torch.full((1,), 0.7), kwargs


def control_block_runs(model) -> list:
    """A list that grows by one each time one of ``model``'s VACE control blocks runs its own forward."""
    runs = []
    for block in model.model.diffusion_model.vace_blocks:
        block.after_proj.register_forward_hook(lambda *_: runs.append(1))
    return runs


@pytest.mark.parametrize("rule", ["teacache", "magcache", "first_block"])
def test_wan_vace_skips_give_the_computed_output_and_leave_out_its_control_blocks(rule):
    """VACE adds its control blocks' hints to the stream between blocks, in place: a skip gives the
    computed output (the stored residual holds the hints) and runs none of its control blocks, whose hints
    it would discard; a VACE whose last block takes a hint runs them on every call."""
    h = helpers()
    model = h.tiny_wan_vace(0)
    assert type(model.model.diffusion_model).__name__ == "VaceWanModel"
    runs = control_block_runs(model)
    x, sigma, kwargs = h.batched(*vace_inputs())
    plain = model.model.apply_model(x, sigma, **kwargs)
    assert len(runs) == 2  # after layers 0 and 2 of 4
    first, second, run = h.two_calls(step_cache(model, rule=rule), x, sigma, kwargs)
    assert [s.pattern for s in run.conds.values()] == [["C", "S"], ["C", "S"]]
    assert torch.allclose(second, first, atol=1e-5, rtol=1e-5), rel_err(second, first)
    assert torch.allclose(first, plain, atol=1e-5, rtol=1e-5), rel_err(first, plain)
    assert len(runs) == 4  # the computed call's 2; the skipped call ran none
    every = h.tiny_wan_vace(0, vace_layers=4)  # a hint after every block, the last one's too
    runs = control_block_runs(every)
    first, second, run = h.two_calls(step_cache(every, rule=rule), x, sigma, kwargs)
    assert torch.allclose(second, first, atol=1e-5, rtol=1e-5), rel_err(second, first)
    assert len(runs) == 8 and SF().detect_family(every).side_maps(every.model.diffusion_model) == []


def test_wan_vace_reads_wan21s_table_and_skips_through_the_real_ksampler(conds):
    """A VACE model is a Wan 2.1 to rule auto (its published table, no fallback); through the KSampler with
    WAN21_Vace's own control inputs: nothing skipped at threshold 0 is ComfyUI's latent exactly, and a
    calibrated run skips to a finite latent."""
    model = helpers().tiny_wan_vace(0)
    shape = (1, 16, 2, 8, 8)
    assert run_variant(model, conds, shape) == "wan2.1_t2v_1.3B_ret_mode"
    ref = sample(model, conds, shape)
    assert torch.equal(sample(step_cache(model, threshold=0.0), conds, shape), ref)
    assert last_run()["model_type"] == "wan2.1_t2v_1.3B_ret_mode" and last_run()["rule"] == "teacache"
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    assert torch.equal(sample(cal, conds, shape), ref)
    runs = control_block_runs(model)
    out = sample(step_cache(model, model_type="calibrated", threshold=3.0), conds, shape)
    run = last_run()
    assert run["family"] == "wan" and run["calls_skipped"] >= 1 and set(run["conds"]) == {"cond", "uncond"}
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert len(runs) == 2 * run["calls_computed"]  # cond and uncond batched: each computed call runs both
    assert torch.equal(sample(model, conds, shape), ref)  # the plain model after it: its own blocks, unpatched
    assert type(model.model.diffusion_model.vace_layers_mapping) is dict


def test_a_step_cached_vace_cloned_onto_a_fresh_model_runs_that_models_own_blocks(conds):
    """ComfyUI 0.33 builds a fresh model for some clones (``force_deepcopy``: torch.compile under dynamic VRAM,
    hooked conds, several GPUs) and copies the object patches onto it: the VACE patch holds no block, so the
    clone samples with its own control blocks, as the step cache applied to it directly does."""
    import inspect

    h = helpers()
    original = h.tiny_wan_vace(0)
    if "force_deepcopy" not in inspect.signature(original.clone).parameters:
        pytest.skip("this ComfyUI's clone() has no force_deepcopy (ComfyUI 0.33)")
    runs = control_block_runs(original)
    cached = step_cache(original, rule="first_block", threshold=0.6)
    cached.cached_patcher_init = (lambda *a, **k: h.tiny_wan_vace(1), ())
    fresh = cached.clone(force_deepcopy=True)
    assert fresh.model is not original.model
    shape = (1, 16, 2, 8, 8)
    want = sample(step_cache(h.tiny_wan_vace(1), rule="first_block", threshold=0.6), conds, shape)
    assert last_run()["calls_skipped"] >= 1
    assert torch.equal(sample(fresh, conds, shape), want) and runs == []


def attention_runs(model) -> dict[str, list]:
    """Per kind of Lumina block ("layers", "refiners"): a list that grows by one each time one of ``model``'s
    blocks of that kind runs its own attention (a block passed through runs none)."""
    dm = model.model.diffusion_model
    runs = {"layers": [], "refiners": []}
    kinds = {"layers": dm.layers, "refiners": [*dm.noise_refiner, *dm.context_refiner]}
    for kind, blocks in kinds.items():
        for block in blocks:
            block.attention.register_forward_hook(lambda *_, kind=kind: runs[kind].append(1))
    return runs


def first_block_reads(model):
    """One call of ``model`` (cond and uncond batched): (its family, its diffusion model, the named arguments its
    first block got, as the step cache's class wrapper names them, and what that block fed its self-attention)."""
    h = helpers()
    family = SF().detect_family(model)
    dm = model.model.diffusion_model
    block = family.layers(dm)[0]
    seen = {}

    def got_args(module, args, kwargs):
        named = {**dict(zip(family.layer_forward[1], args, strict=False)), **kwargs}
        named["img"] = named.pop(family.layer_forward[1][0])
        seen.setdefault("args", named)

    def fed(module, args):
        seen.setdefault("fed", args[0])

    block.register_forward_pre_hook(got_args, with_kwargs=True)
    getattr(block, {"lumina2": "attention", "cosmos_predict2": "self_attn"}[family.name]).register_forward_pre_hook(fed)
    spec = h.family_spec({"lumina2": "z_image", "cosmos_predict2": "cosmos"}[family.name])
    x, sigma, kwargs = h.batched(*spec.inputs(spec.sizes[0], 0))
    with torch.inference_mode():
        model.model.apply_model(x, sigma, transformer_options={}, **kwargs)
    return family, dm, seen["args"], seen["fed"]


@pytest.mark.parametrize("variant", ["z_image", "lumina2", "cosmos", "cosmos, per-block position embedding",
                                     "cosmos, no AdaLN-LoRA"])
def test_a_wrapped_familys_teacache_input_is_what_its_first_block_feeds_its_attention(variant):
    """The families reached through their block class read the TeaCache rule's input themselves: it equals what
    the host's first block feeds its self-attention (Cosmos: with the AdaLN-LoRA term and the per-block position
    embedding, each on and off)."""
    fam = importlib.import_module(f"{rkharness.TINY.__name__}.families")
    model = {"z_image": lambda: fam.tiny_lumina2(0, z_image=True), "lumina2": lambda: fam.tiny_lumina2(0),
             "cosmos": lambda: fam.tiny_cosmos(0),
             "cosmos, per-block position embedding": lambda: fam.tiny_cosmos(0, extra_per_block_abs_pos_emb=True),
             "cosmos, no AdaLN-LoRA": lambda: fam.tiny_cosmos(0, use_adaln_lora=False)}[variant]()
    family, dm, args, fed = first_block_reads(model)
    with torch.inference_mode():
        read = family.modulated(dm, args)
    assert torch.allclose(read.reshape(fed.shape), fed, atol=1e-6, rtol=1e-5), rel_err(read.reshape(fed.shape), fed)


@pytest.mark.parametrize("name", ["lumina2", "z_image"])
def test_lumina_skips_reach_only_the_step_cached_models_own_layers(conds, name):
    """Lumina 2 and Z-Image have no block-replace seam: the cache wraps their block class's forward. A
    skipped call passes the main layers through (their attention never runs) while the refiners, part of
    the embedding, run on every call; the same model without the step cache, and another model of the
    class, sample exactly as before, their layers untouched by the wrapper."""
    spec, (_, shape, _) = helpers().family_spec(name), HOOKED[name]
    model, other = spec.build(0), spec.build(1)
    ref, ref_other = sample(model, conds, shape), sample(other, conds, shape)
    runs = attention_runs(model)
    out = sample(step_cache(model, rule="first_block", threshold=5.0), conds, shape)
    run = last_run()
    assert run["calls_skipped"] >= 1 and torch.isfinite(out).all()
    n = len(model.model.diffusion_model.layers)
    # cond and uncond batched: one attention per block per call; a skipped call runs the first layer alone
    assert len(runs["layers"]) == n * run["calls_computed"] + run["calls_skipped"]
    assert len(runs["refiners"]) == 2 * (run["calls_computed"] + run["calls_skipped"])
    assert torch.equal(sample(model, conds, shape), ref) and torch.equal(sample(other, conds, shape), ref_other)


def test_z_image_fun_controlnet_skips_give_the_computed_output_and_threshold_0_is_exact(conds):
    """Z-Image's Fun ControlNet (ComfyUI 0.33) adds its hints after the layers it names, outside the wrapped
    forward: the same input twice, the skipped call gives the computed output (the hints a skip adds inside
    the stack are dropped, the stored residual holds them); through the KSampler threshold 0 is the controlled
    model's latent exactly, and a threshold that skips still samples under the control."""
    h = helpers()
    spec, (_, shape, _) = h.family_spec("z_image"), HOOKED["z_image"]
    model = spec.build(0)
    if h.z_image_fun_controlnet(model) is None:
        pytest.skip("this ComfyUI has no Z-Image Fun ControlNet (ComfyUI 0.33)")
    plain, ref = sample(model, conds, shape), sample(h.z_image_fun_controlnet(model), conds, shape)
    assert not torch.allclose(plain, ref)  # the control moves the latent
    exact = step_cache(model, rule="first_block", threshold=0.0)
    assert torch.equal(sample(h.z_image_fun_controlnet(exact), conds, shape), ref)
    x, sigma, kwargs = h.batched(*spec.inputs(spec.sizes[0], 0))
    controlled = h.z_image_fun_controlnet(step_cache(model, rule="first_block", threshold=5.0))
    first, again, run = h.two_calls(controlled, x, sigma, kwargs)
    assert [s.pattern for s in run.conds.values()] == [["C", "S"]] * 2
    assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)


class Wrapped(torch.nn.Module):
    """A block wrapped the way torch.compile's OptimizedModule wraps one: a module of another class that
    calls the block."""

    def __init__(self, block):
        super().__init__()
        self.inner = block

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_lumina_layer_another_node_wrapped_is_computed_every_call_and_counted(conds):
    """A layer of the stack wrapped by another node (an object patch, as a per-block torch.compile makes):
    a skip would run it on the passed-through stream, so every call is computed, the latent is what the
    wrapped model gives without the step cache, and the reason (naming the layer) is counted."""
    spec, (_, shape, _) = helpers().family_spec("z_image"), HOOKED["z_image"]
    model = spec.build(0)
    last = len(model.model.diffusion_model.layers) - 1
    wrapped = model.clone()
    wrapped.add_object_patch(f"diffusion_model.layers.{last}", Wrapped(model.model.diffusion_model.layers[last]))
    ref = sample(wrapped, conds, shape)
    P().stats().reset_counters()  # the reason rows are bounded: start from none
    out = sample(step_cache(wrapped, rule="first_block", threshold=5.0), conds, shape)
    run = last_run()
    assert torch.equal(out, ref)
    assert run["calls_skipped"] == 0 and run["unhooked_calls"] == run["calls_computed"] > 0
    reasons = [r["reason"] for r in P().stats().snapshot()["reasons"] if r["source"] == "lumina2"]
    assert any(f"layer {last} of this NextDiT" in r and "Wrapped" in r for r in reasons), reasons
    assert torch.isfinite(sample(step_cache(model, rule="first_block", threshold=5.0), conds, shape)).all()
    assert last_run()["calls_skipped"] >= 1  # the same model unwrapped skips


@pytest.mark.parametrize("rule,second", [("teacache", "S"), ("schedule", "H")])
def test_z_image_omni_reads_its_modulated_input_with_the_reference_tokens_timestep_zero(rule, second):
    """Z-Image Omni (reference latents; ComfyUI 0.33) doubles the modulation for the reference tokens'
    timestep zero: the TeaCache rule reads the first layer's modulated input the layer's way, and the
    skipped call gives the computed one's output; a cond-only step cuts the doubled modulation to the
    cond's rows of each half (the layers see 2 rows, not 4)."""
    import inspect

    h = helpers()
    spec = h.family_spec("z_image")
    model = spec.build(0)
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 0)
    if "ref_latents" not in inspect.signature(model.model.diffusion_model._forward).parameters:
        pytest.skip("this ComfyUI's Z-Image has no reference latents (ComfyUI 0.33)")
    kwargs["ref_latents"] = [torch.randn_like(x)]
    rows = []  # the batch of the first layer's modulation input: doubled for the timestep-zero tokens
    model.model.diffusion_model.layers[0].adaLN_modulation.register_forward_hook(lambda m, i, o: rows.append(len(i[0])))
    first, again, run = h.two_calls(step_cache(model, rule=rule), *h.batched(x, sigma, kwargs), second=second)
    assert [s.pattern for s in run.conds.values()] == ([["C", "C"], ["C", "S"]] if second == "H" else [["C", "S"]] * 2)
    assert rows[0] == 4 and set(rows) == ({4, 2} if second == "H" else {4})  # cond and uncond, each twice
    assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)


WAN_VARIANTS = ["WAN21_Camera", "WAN22_Camera", "WAN21_HuMo", "WAN22_Animate", "WAN_Animate2", "WAN21_SCAIL",
                "WAN21_SCAIL2", "WAN22_WanDancer"]


@pytest.mark.parametrize("rule", ["teacache", "first_block"])
@pytest.mark.parametrize("config", WAN_VARIANTS)
def test_wans_variants_skip_through_the_same_seam_and_read_wan21s_table(config, rule):
    """Camera, HuMo, Animate, SCAIL, Dancer (without their own conditioning: camera, audio, pose, face...):
    the same blocks through the same seam, so the skipped call gives the computed output; each reads Wan
    2.1's published table (a variant the pack names), never "unknown class"."""
    h = helpers()
    model = h.tiny_wan_subclass(config)
    if model is None:
        pytest.skip(f"this ComfyUI has no {config}")
    cfg = model.model.model_config.unet_config
    g = torch.Generator().manual_seed(0)
    kwargs = {"c_crossattn": torch.randn((1, 7, rkharness.TINY.TEXT_DIM), generator=g)}
    if cfg["in_dim"] > 16:  # the start image's latent and mask, as the node concatenates them
        kwargs["c_concat"] = torch.randn((1, cfg["in_dim"] - 16, 2, 8, 8), generator=g)
    x = torch.randn((1, 16, 2, 8, 8), generator=g)
    cached = step_cache(model, rule=rule)
    family = cached.model_options["transformer_options"][P().KEY].family
    assert family.name.startswith("wan") and SF().model_variant(family, model, {}).startswith("wan2.1_")
    first, again, run = h.two_calls(cached, *h.batched(x, torch.full((1,), 0.7), kwargs))
    assert [s.pattern for s in run.conds.values()] == [["C", "S"]] * 2
    assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)


def test_wan_humos_audio_never_gets_a_cond_only_step_with_the_unconds_audio():
    """HuMo's blocks read the audio from its forward's scope, where a cond-only step cannot cut it to the
    cond's rows: the cond then attended to both rows' audio (15% off the computed output). With audio the
    planned cond-only step is computed whole, counted; without, it runs as planned."""
    h = helpers()
    model = h.tiny_wan_subclass("WAN21_HuMo")
    gen = torch.Generator().manual_seed(0)
    kwargs = {"c_crossattn": torch.randn((1, 7, rkharness.TINY.TEXT_DIM), generator=gen),
              "audio_embed": torch.randn((1, 2, 8, 5, 1280), generator=gen)}
    x = torch.randn((1, 16, 2, 8, 8), generator=gen)
    cached = step_cache(model, rule="schedule")
    for audio in (False, True):
        kw = kwargs if audio else {"c_crossattn": kwargs["c_crossattn"]}
        first, again, run = h.two_calls(cached, *h.batched(x, torch.full((1,), 0.7), kw), second="H")
        assert [s.pattern for s in run.conds.values()] == ([["C", "C"]] * 2 if audio else [["C", "C"], ["C", "S"]])
        assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)
    reasons = [r["reason"] for r in P().stats().reasons() if r["event"] == "fallback"]
    assert any(r.startswith("no cond-only step for a call with audio_embed") for r in reasons), reasons


def test_causal_wan_under_the_ar_video_sampler_computes_every_call_and_says_why(conds):
    """Causal-WAN's ``ar_video`` sampler calls the model outside ComfyUI's diffusion-model wrapper, with KV
    caches the model fills as it goes: the cache never sees a call, so the run is ComfyUI's latent exactly
    and is counted as a bypass with its reason; under another sampler its Wan forward skips as Wan's does."""
    model, ar_video = helpers().causal_wan_case(conds)
    assert type(model.model.diffusion_model).__name__ == "CausalWanModel"
    ref = ar_video(model)
    stats = P().stats()
    stats.reset_counters()
    assert torch.equal(ar_video(step_cache(model, rule="first_block", threshold=0.6)), ref)
    (row,) = [r for r in stats.reasons() if r["event"] == "bypass"]
    assert "no call of this wan model reached the step cache in a whole run" in row["reason"], row
    assert row["source"] == "wan" and row["count"] == 1  # one run
    assert last_run()["calls_computed"] == last_run()["calls_skipped"] == 0 and last_run()["outcome"] == "completed"
    sample(step_cache(model, rule="first_block", threshold=0.6), conds, (1, 16, 2, 8, 8))  # its plain Wan forward
    assert last_run()["calls_skipped"] >= 1 and [r["count"] for r in stats.reasons() if r["event"] == "bypass"] == [1]


def s2v_inputs(frames=2):
    """A Wan S2V call: latent, text and the audio features (wav2vec layers x width x 4 per latent frame)."""
    g = torch.Generator().manual_seed(0)
    kwargs = {"c_crossattn": torch.randn((1, 7, rkharness.TINY.TEXT_DIM), generator=g),
              "audio_embed": torch.randn((1, 25, 32, 4 * frames), generator=g)}
    return torch.randn((1, 16, frames, 8, 8), generator=g), torch.full((1,), 0.7), kwargs


def block_patch_gets_options(model) -> bool:
    """Whether this ComfyUI's forward of ``model`` hands a block-replace patch its transformer_options."""
    seen = []

    def patch(args, extra):
        seen.append("transformer_options" in args)
        return extra["original_block"](args)

    m = model.clone()
    m.set_model_patch_replace(patch, "dit", "double_block", 0)
    x, sigma, kwargs = s2v_inputs()
    with torch.inference_mode():
        m.model.apply_model(x, sigma, transformer_options=m.model_options["transformer_options"], **kwargs)
    return seen == [True]


def test_wan_s2v_skips_where_its_blocks_get_the_options_else_the_node_says_why(conds):
    """Wan S2V adds audio after its blocks, the last one's included: a skip gives the computed output
    (the residual is stored before the audio after the last block, which runs once either way). On a
    ComfyUI whose S2V hands its block patches no transformer_options (0.3) the cache could never see a
    call: the node refuses it saying so."""
    h = helpers()
    model = h.tiny_wan_s2v(0)
    if not block_patch_gets_options(model):
        with pytest.raises(ValueError, match="ReuseKit Step Cache: model: .*does not support WanModel_S2V models "
                                             ".*no transformer_options"):
            step_cache(model)
        return
    x, sigma, kwargs = h.batched(*s2v_inputs())
    for rule in ("teacache", "magcache", "first_block"):
        first, second, run = h.two_calls(step_cache(model, rule=rule), x, sigma, kwargs)
        assert [s.pattern for s in run.conds.values()] == [["C", "S"], ["C", "S"]], rule
        assert torch.allclose(second, first, atol=1e-5, rtol=1e-5), (rule, rel_err(second, first))
    import node_helpers

    audio = s2v_inputs(frames=2)[2]["audio_embed"]
    s2v_conds = tuple(node_helpers.conditioning_set_values(c, {"audio_embed": audio}) for c in conds)
    shape = (1, 16, 2, 8, 8)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    ref = sample(cal, s2v_conds, shape)
    out = sample(step_cache(model, threshold=3.0), s2v_conds, shape)
    run = last_run()
    assert run["family"] == "wan" and run["model_type"] == "calibrated" and run["calls_skipped"] >= 1
    assert set(run["conds"]) == {"cond", "uncond"} and torch.isfinite(out).all() and out.shape == ref.shape
