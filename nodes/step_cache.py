"""ReuseKit Step Cache, TeaCache Calibrate and Cached KSampler: the step cache as nodes."""

from __future__ import annotations

import numbers

from comfy_api.latest import io

from ..caching.step_cache import StepCacheConfig
from ..patches import host
from ..patches import step_cache as patch
from . import CATEGORY, SamplerInputs, brief, compat, ksampler_inputs, refusal

AREA = f"{CATEGORY}/step cache"

# Saved prompts keep working (nodes/compat.py). Until 2026-12-01 (a7ea1af) the threshold was called
# rel_l1_thresh and there was no rule input: the rule was TeaCache's. Until 2026-11-29 (95a72a3) there
# was no residual_mode either: a skipped step reused the residual. A prompt that names rel_l1_thresh
# was written for those inputs, and what it leaves out keeps the meaning it had then.
OLD_THRESHOLD = "rel_l1_thresh"
OLD_MEANING = {"rule": "teacache", "residual_mode": "reuse"}
DEFAULTS = {"threshold": -1.0, "rule": "auto", "residual_mode": "auto"}
"""What an absent input means in a prompt written for today's inputs (the widgets' defaults)."""
THRESHOLD_MAX = 100.0  # teacache & co. skip nearly everything long before; the interval rule's N up to 100
SKIPS_MAX = 1000
FIRST_BLOCKS_MAX = 1024
OLD_THRESHOLD_MAX = 10.0  # rel_l1_thresh's own range
LEFT_OUT = object()  # execute()'s default for those three: ComfyUI passes no argument for an absent input


def _cache_inputs() -> list:
    """The step cache's inputs, all optional (a prompt may leave any out; see DEFAULTS and OLD_MEANING),
    in the order of the page's widgets (web/compat.js maps workflows saved with the old order)."""
    return [
        io.Combo.Input("rule", options=list(patch.RULES), default="auto", optional=True,
                       tooltip="How a step is judged skippable. teacache: the change of the first block's "
                               "modulated input, rescaled by a per-model polynomial. magcache: the calibrated "
                               "ratio of consecutive residual magnitudes. first_block: the first block always "
                               "runs and the rest is skipped while its residual barely changes (no calibration). "
                               "schedule: a plan made when sampling starts, from the model's residual table, that "
                               "keeps every skipped stretch's error under the threshold; under CFG some steps "
                               "compute the cond alone and rebuild the uncond from the last measured difference "
                               "(half the work). interval: a fixed beat, one call computed, then threshold - 1 "
                               "skipped, per cond (TaylorSeer's and FoCa's schedule; pair it with residual_mode "
                               "taylorseer1, taylorseer2, foca or output). adaptive: the interval's beat set per run from the "
                               "forecast's own error, checked at each computed step: a stretch grows while the "
                               "forecast held and shrinks where it strayed, and no step skips before two checks "
                               "agree (no table; pair it with a forecast, "
                               "output at best). auto: TeaCache with its published polynomial; "
                               "on a Flux or Wan model calibrated by ReuseKit TeaCache Calibrate, with threshold -1, "
                               "the schedule rule "
                               "(first_block while the rule has no published or calibrated table for this model). "
                               "Under a CFG++ sampler (euler_cfg_pp...) only adaptive skips: the others compute "
                               "every step, and the stats say why."),
        # round: the front end rounds a typed value to the step's decimals without it, and the defaults'
        # thresholds between their anchors have four (the run's log names them: README "Compatibility")
        io.Float.Input("threshold", default=-1.0, min=-1.0, max=THRESHOLD_MAX, step=0.01, round=0.0001, optional=True,
                       tooltip="Skip while the rule's accumulated distance stays under this (teacache: rescaled "
                               "relative L1 of the modulated input; magcache: accumulated |1 - magnitude ratio|; "
                               "first_block: relative L1 change of the first block's residual; schedule: each "
                               "skipped stretch's estimated error in the result, relative). 0 computes every "
                               "step (exact); higher skips more. interval: the interval N, a whole number >= 1 "
                               "(one call computed in N; 1 computes every step, exact). adaptive: the forecast's "
                               "error at a stretch's end, relative, times the stretch's span in sigma (times sigma "
                               "under a CFG++ sampler; 0.0126 at Flux, 0.005 at Wan by default). -1 takes the family's "
                               "default for the rule (auto's TeaCache: larger for more steps, e.g. Wan 0.343 at 20 "
                               "and 28 steps, 0.504 at 50; interval: 3). With rule auto a value set here is "
                               "TeaCache's: where auto runs first_block (no table yet), first_block's default runs."),
        io.Combo.Input("model_type", options=list(patch.MODEL_TYPES), default="auto", optional=True,
                       tooltip="Which table the rule uses (teacache: rescale polynomial; magcache: magnitude "
                               "ratios; schedule: residual table; first_block needs none). auto: this model's "
                               "calibration if one was made, else the published one for its variant (Flux.1, "
                               "Kontext, HunyuanVideo, Wan 2.1; schedule: the one ReuseKit measured for the family's "
                               "benchmark model, Flux and Wan; other families need a calibration). calibrated: "
                               "only a calibration (see ReuseKit TeaCache Calibrate)."),
        io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Never skip before this fraction of the schedule."),
        io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Never skip after this fraction of the schedule."),
        io.Int.Input("max_consecutive_skips", default=0, min=0, max=SKIPS_MAX, optional=True,
                     tooltip="At most this many skipped steps in a row (0: no limit; MagCache's K)."),
        io.Combo.Input("cache_device", options=["device", "cpu"], default="device", optional=True,
                       tooltip="Where stored residuals live: the model's device (fastest) or the CPU "
                               "(saves VRAM, costs a copy per skipped step)."),
        io.Combo.Input("residual_mode", options=list(patch.RESIDUAL_MODES), default="auto", optional=True,
                       tooltip="What a skipped step adds. reuse: the last residual (classic). extrapolate: the "
                               "last residual continued in sigma along its change between the last two computed "
                               "steps. taylor2: a second-order forecast in sigma from the last three. taylorseer1, "
                               "taylorseer2: TaylorSeer (ICCV 2025), a first/second-order Taylor series in steps "
                               "around the last computed step, derivatives from backward differences between "
                               "computed steps. foca: FoCa (arXiv 2508.16211), a forecast from the two newest values "
                               "(computed or forecast) corrected toward the slope of the last two computed steps. "
                               "output: the whole model's output, not the blocks' residual, forecast as "
                               "foca forecasts; not with rule schedule. "
                               "auto: the family's benchmarked mode."),
        io.Float.Input("interval_power", default=1.0, min=0.5, max=4.0, step=0.05, optional=True,
                       tooltip="Rule interval only. 1: the fixed beat (one step computed in N). Otherwise as many "
                               "computed steps as that beat, placed anew; the speed is the beat's. Above 1: first "
                               "and last step included, closer together toward the end of the run, where a "
                               "forecast errs most (step i of k at (steps - 1)(1 - (1 - i/(k - 1))^power)). Below "
                               "1: over the beat's own span, closer together toward the start, where a model's "
                               "output changes fastest (step i at N(k - 1)(i/(k - 1))^(1/power); 0.8 at Flux "
                               "without CFG) (docs/step_cache.md, \"Rules\")."),
        io.Int.Input("first_blocks", default=1, min=1, max=FIRST_BLOCKS_MAX, optional=True,
                     tooltip="Rule first_block only: the blocks that always run, the change of whose residual "
                             "decides whether the rest is skipped. 1: First-Block-Cache. More: cache-dit's "
                             "DBCache Fn (with no trailing blocks, Bn = 0): a surer decision, a smaller saving "
                             "(a skipped step still runs these). Fewer than the model's blocks."),
    ]


def refused(node: str, what: str) -> ValueError:
    """A bad input's error, counted in the step cache's stats beside its refusals of a model."""
    return refusal(patch.stats(), node, what)


def make_config(node: str, model_type: str, threshold: float, start_percent: float, end_percent: float,
                max_consecutive_skips: int, cache_device: str, residual_mode: str = "auto",
                calibrate: bool = False, rule: str = "auto", interval_power: float = 1.0,
                first_blocks: int = 1) -> StepCacheConfig:
    def bad(name, why):
        return refused(node, f"{name} {why}")

    def choose(name, value, options):  # (linked: anything; an array compared with the options fails in numpy)
        if not isinstance(value, str) or value not in options:
            raise bad(name, f"must be one of {', '.join(options)}, got {brief(value)}")

    choose("rule", rule, patch.RULES)
    choose("model_type", model_type, patch.MODEL_TYPES)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
            or not (0.0 <= threshold <= THRESHOLD_MAX or threshold == -1.0):
        raise bad("threshold", f"must be a number from 0 to {THRESHOLD_MAX:g}, or -1 for the family's default, got "
                               f"{brief(threshold)}")
    if rule == "interval" and threshold != -1.0 and not (threshold >= 1 and float(threshold).is_integer()):
        raise bad("threshold", f"is the interval with rule interval: a whole number >= 1 (or -1), got {brief(threshold)}")
    for name, v in (("start_percent", start_percent), ("end_percent", end_percent)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (0.0 <= v <= 1.0):
            raise bad(name, f"must be a number within 0..1, got {brief(v)}")
    if start_percent >= end_percent:
        raise bad("start_percent", f"must be below end_percent ({start_percent} >= {end_percent})")
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, numbers.Real) \
            or not 0 <= max_consecutive_skips <= SKIPS_MAX or int(max_consecutive_skips) != max_consecutive_skips:
        raise bad("max_consecutive_skips", f"must be a whole number from 0 to {SKIPS_MAX}, got "
                                           f"{brief(max_consecutive_skips)}")
    choose("cache_device", cache_device, ("device", "cpu"))
    choose("residual_mode", residual_mode, patch.RESIDUAL_MODES)
    if isinstance(interval_power, bool) or not isinstance(interval_power, numbers.Real) \
            or not (0.5 <= interval_power <= 4.0):
        raise bad("interval_power", f"must be a number within 0.5..4, got {brief(interval_power)}")
    if interval_power != 1.0 and rule != "interval":
        raise bad("interval_power", f"places the steps of rule interval only (rule is {rule}): set it to 1, or "
                                    "pick rule interval")
    if isinstance(first_blocks, bool) or not isinstance(first_blocks, numbers.Real) \
            or not 1 <= first_blocks <= FIRST_BLOCKS_MAX or int(first_blocks) != first_blocks:
        raise bad("first_blocks", f"must be a whole number from 1 to {FIRST_BLOCKS_MAX}, got {brief(first_blocks)}")
    if first_blocks != 1 and rule != "first_block":
        raise bad("first_blocks", f"sets the blocks rule first_block runs before it decides (rule is {rule}): set it "
                                  "to 1, or pick rule first_block")
    return StepCacheConfig(None, model_type, float(threshold), float(start_percent), float(end_percent),
                           int(max_consecutive_skips), cache_device, calibrate, residual_mode, rule,
                           float(interval_power), int(first_blocks))


def given_inputs(cls, node: str, threshold, rule, residual_mode, passed: dict) -> tuple[float, str, str]:
    """(threshold, rule, residual_mode) as the node runs them: an absent one (LEFT_OUT) takes its default,
    or in a prompt written for the old inputs (rel_l1_thresh) the meaning it had then, said once."""
    old = compat.old_inputs(cls, (OLD_THRESHOLD,), passed)
    values = {"threshold": threshold, "rule": rule, "residual_mode": residual_mode}
    if OLD_THRESHOLD in old:
        rel = old[OLD_THRESHOLD]
        if isinstance(rel, str):  # a number written as text: ComfyUI converted the FLOAT input it was
            try:
                rel = float(rel)
            except ValueError:
                pass
        if isinstance(rel, bool) or not isinstance(rel, numbers.Real) or not (0.0 <= rel <= OLD_THRESHOLD_MAX):
            raise refused(node, f"{OLD_THRESHOLD} (now threshold) must be a number from 0 to {OLD_THRESHOLD_MAX:g}, "
                                f"got {brief(rel)}")
        if threshold is not LEFT_OUT and threshold != rel:
            raise refused(node, f"threshold ({brief(threshold)}) and its old name {OLD_THRESHOLD} ({brief(rel)}) disagree; "
                          "give threshold only")
        values["threshold"] = float(rel)
        values.update((k, v) for k, v in OLD_MEANING.items() if values[k] is LEFT_OUT)
        host.say_once(f"compat:{node}:{sorted(values.items())}", "%s: a prompt saved with %s (renamed threshold): "
                      "read as threshold=%s, rule=%s, residual_mode=%s, as it meant then; save the workflow again to "
                      "store the new inputs", node, OLD_THRESHOLD, values["threshold"], values["rule"],
                      values["residual_mode"])
    values.update((k, v) for k, v in DEFAULTS.items() if values[k] is LEFT_OUT)
    return values["threshold"], values["rule"], values["residual_mode"]


def attach(node: str, model, config: StepCacheConfig):
    try:
        return patch.apply(model, config, node)
    except ValueError as exc:
        raise ValueError(f"{node}: {exc}") from None


class TeaCacheNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitTeaCache",
            display_name="ReuseKit Step Cache (TeaCache, MagCache, First-Block)",
            category=AREA,
            description="Skips transformer steps whose output would barely change, adding the last residual "
                        "instead (rules: TeaCache, MagCache, First-Block-Cache, and a schedule planned from the "
                        "model's residuals with cond-only steps). Separate state per cond/uncond; starts clean on "
                        "every run and on any shape change. Works with any sampler; reports computed and skipped "
                        "steps in the log and the panel.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model (Flux, Flux Kontext, Flux.2, Chroma, "
                                                    "Chroma Radiance, HunyuanVideo, HunyuanVideo 1.5, Wan 2.1/2.2 "
                                                    "(S2V on ComfyUI 0.33+), Qwen-Image incl. Edit, LTXV, "
                                                    "LTX-2, Mochi, Lumina 2, Z-Image, Cosmos Predict2, Anima).")]
            + _cache_inputs(),
            outputs=[io.Model.Output(tooltip="A copy of the model with the step cache attached.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> str:
        # a calibration saved since the last run changes what auto and calibrated resolve to: ComfyUI's cache of
        # this node's output (and of the sampler after it) kept the picture from before. A published type or a
        # rule that needs no table never reads one (a linked input arrives as None: it may)
        if inputs.get("model_type") not in ("auto", "calibrated", None) or inputs.get("rule") in (
                "first_block", "interval"):
            return ""
        return patch.STORE.stamp()

    @classmethod
    def execute(cls, model, model_type="auto", threshold=LEFT_OUT, start_percent=0.0, end_percent=1.0,
                max_consecutive_skips=0, cache_device="device", residual_mode=LEFT_OUT, rule=LEFT_OUT,
                interval_power=1.0, first_blocks=1, **linked_old) -> io.NodeOutput:
        node = "ReuseKit Step Cache"
        if (extra := compat.unknown(cls, linked_old, (OLD_THRESHOLD,))) is not None:
            raise refused(node, extra)
        threshold, rule, residual_mode = given_inputs(cls, node, threshold, rule, residual_mode, linked_old)
        config = make_config(node, model_type, threshold, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode, rule=rule,
                             interval_power=interval_power, first_blocks=first_blocks)
        return io.NodeOutput(attach(node, model, config))


class TeaCacheCalibrateNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitTeaCacheCalibrate",
            display_name="ReuseKit TeaCache Calibrate",
            category=AREA,
            description="Run one full sampling with this model to measure what the calibrated rules need: the "
                        "TeaCache polynomial (modulated-input change -> residual change), the MagCache "
                        "residual-magnitude ratios per cond against sigma and the schedule rule's residual table "
                        "(with a cheap skipped pass per step: how much a residual's error moves the output). "
                        "Nothing is skipped in the result; only a complete "
                        "run of 5+ steps is saved, per model (user/reusekit/teacache_calibration.json), and later "
                        "step-cache runs with model_type auto or calibrated use it.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model to calibrate; sample with it once "
                                                    "(20+ steps give a better fit).")],
            outputs=[io.Model.Output(tooltip="A copy of the model that records the calibration while it samples.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, model, **linked) -> io.NodeOutput:
        node = "ReuseKit TeaCache Calibrate"
        if (extra := compat.unknown(cls, linked)) is not None:
            raise refused(node, extra)
        config = make_config(node, "auto", 0.0, 0.0, 1.0, 0, "device", "reuse", calibrate=True, rule="teacache")
        return io.NodeOutput(attach(node, model, config))


class CachedKSamplerNode(SamplerInputs, io.ComfyNode):
    NODE = "ReuseKit Cached KSampler"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitCachedKSampler",
            display_name="ReuseKit Cached KSampler",
            category=AREA,
            description="KSampler with the step cache (TeaCache, MagCache, First-Block) built in (one node instead "
                        "of two).",
            inputs=[
                *ksampler_inputs(cfg=3.5, sampler="euler", scheduler="simple"),
            ] + _cache_inputs(),
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> str:
        return TeaCacheNode.fingerprint_inputs(**inputs)

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                model_type="auto", threshold=LEFT_OUT, start_percent=0.0, end_percent=1.0, max_consecutive_skips=0,
                cache_device="device", residual_mode=LEFT_OUT, rule=LEFT_OUT, interval_power=1.0, first_blocks=1,
                **linked_old) -> io.NodeOutput:
        import nodes

        node = cls.NODE
        if (extra := compat.unknown(cls, linked_old, (OLD_THRESHOLD,))) is not None:
            raise refused(node, extra)
        cls.check_inputs(patch.stats(), seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                         positive=positive, negative=negative, latent_image=latent_image, denoise=denoise)
        threshold, rule, residual_mode = given_inputs(cls, node, threshold, rule, residual_mode, linked_old)
        config = make_config(node, model_type, threshold, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode, rule=rule,
                             interval_power=interval_power, first_blocks=first_blocks)
        cached = attach(node, model, config)
        (latent,) = nodes.common_ksampler(cached, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                          latent_image, denoise=denoise)
        return io.NodeOutput(latent)


NODES = [TeaCacheNode, TeaCacheCalibrateNode, CachedKSamplerNode]
