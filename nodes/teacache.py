"""ReuseKit Step Cache, TeaCache Calibrate and Cached KSampler: the step cache as nodes."""

from __future__ import annotations

from comfy_api.latest import io

from ..caching.teacache import StepCacheConfig
from ..patches import teacache as patch
from . import CATEGORY, SamplerInputs, ksampler_inputs

AREA = f"{CATEGORY}/step cache"


def _cache_inputs() -> list:
    return [
        io.Combo.Input("rule", options=list(patch.RULES), default="auto",
                       tooltip="How a step is judged skippable. teacache: the change of the first block's "
                               "modulated input, rescaled by a per-model polynomial. magcache: the calibrated "
                               "ratio of consecutive residual magnitudes. first_block: the first block always "
                               "runs and the rest is skipped while its residual barely changes (no calibration). "
                               "auto: the family's benchmarked rule (first_block while that rule has no published or "
                               "calibrated table for this model)."),
        io.Float.Input("threshold", default=-1.0, min=-1.0, max=10.0, step=0.01,
                       tooltip="Skip while the rule's accumulated distance stays under this (teacache: rescaled "
                               "relative L1 of the modulated input; magcache: accumulated |1 - magnitude ratio|; "
                               "first_block: relative L1 change of the first block's residual). 0 computes every "
                               "step (exact); higher skips more. -1 takes the family's benchmarked default for "
                               "the rule."),
        io.Combo.Input("model_type", options=list(patch.MODEL_TYPES), default="auto",
                       tooltip="Which table the rule uses (teacache: rescale polynomial; magcache: magnitude "
                               "ratios; first_block needs none). auto: this model's calibration if one was made, "
                               "else the published one for its variant (Flux.1, Kontext, HunyuanVideo, Wan 2.1; "
                               "other families need a calibration). calibrated: only a calibration (see ReuseKit "
                               "TeaCache Calibrate)."),
        io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Never skip before this fraction of the schedule."),
        io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Never skip after this fraction of the schedule."),
        io.Int.Input("max_consecutive_skips", default=0, min=0, max=1000,
                     tooltip="At most this many skipped steps in a row (0: no limit; MagCache's K)."),
        io.Combo.Input("cache_device", options=["device", "cpu"], default="device",
                       tooltip="Where stored residuals live: the model's device (fastest) or the CPU "
                               "(saves VRAM, costs a copy per skipped step)."),
        io.Combo.Input("residual_mode", options=list(patch.RESIDUAL_MODES), default="auto",
                       tooltip="What a skipped step adds. reuse: the last residual (classic). extrapolate: the "
                               "last residual continued in sigma along its change between the last two computed "
                               "steps. taylor2: a second-order forecast in sigma from the last three. auto: the "
                               "family's benchmarked mode."),
    ]


def make_config(node: str, model_type: str, threshold: float, start_percent: float, end_percent: float,
                max_consecutive_skips: int, cache_device: str, residual_mode: str = "auto",
                calibrate: bool = False, rule: str = "auto") -> StepCacheConfig:
    def bad(name, why):
        return ValueError(f"{node}: {name} {why}")

    if rule not in patch.RULES:
        raise bad("rule", f"must be one of {', '.join(patch.RULES)}, got {rule!r}")
    if model_type not in patch.MODEL_TYPES:
        raise bad("model_type", f"must be one of {', '.join(patch.MODEL_TYPES)}, got {model_type!r}")
    if not (threshold >= 0.0 or threshold == -1.0) or threshold == float("inf"):
        raise bad("threshold", f"must be a finite number >= 0, or -1 for the family's default, got {threshold!r}")
    for name, v in (("start_percent", start_percent), ("end_percent", end_percent)):
        if not (0.0 <= v <= 1.0):
            raise bad(name, f"must be within 0..1, got {v!r}")
    if start_percent >= end_percent:
        raise bad("start_percent", f"must be below end_percent ({start_percent} >= {end_percent})")
    if isinstance(max_consecutive_skips, bool) or int(max_consecutive_skips) != max_consecutive_skips \
            or max_consecutive_skips < 0:
        raise bad("max_consecutive_skips", f"must be a whole number >= 0, got {max_consecutive_skips!r}")
    if cache_device not in ("device", "cpu"):
        raise bad("cache_device", f"must be 'device' or 'cpu', got {cache_device!r}")
    if residual_mode not in patch.RESIDUAL_MODES:
        raise bad("residual_mode", f"must be one of {', '.join(patch.RESIDUAL_MODES)}, got {residual_mode!r}")
    return StepCacheConfig(None, model_type, float(threshold), float(start_percent), float(end_percent),
                           int(max_consecutive_skips), cache_device, calibrate, residual_mode, rule)


def attach(node: str, model, config: StepCacheConfig):
    try:
        return patch.apply(model, config)
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
                        "instead (rules: TeaCache, MagCache, First-Block-Cache). Separate state per cond/uncond; "
                        "starts clean on every run and on any shape change. Works with any sampler; reports "
                        "computed and skipped steps in the log and the panel.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model (Flux, Flux Kontext, Flux.2, Chroma, "
                                                    "Chroma Radiance, HunyuanVideo, HunyuanVideo 1.5, Wan 2.1/2.2 "
                                                    "(S2V on ComfyUI 0.33+), Qwen-Image incl. Edit, LTXV, "
                                                    "Mochi).")]
            + _cache_inputs(),
            outputs=[io.Model.Output(tooltip="A copy of the model with the step cache attached.")],
        )

    @classmethod
    def execute(cls, model, model_type="auto", threshold=-1.0, start_percent=0.0, end_percent=1.0,
                max_consecutive_skips=0, cache_device="device", residual_mode="auto", rule="auto") -> io.NodeOutput:
        node = "ReuseKit TeaCache"
        config = make_config(node, model_type, threshold, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode, rule=rule)
        return io.NodeOutput(attach(node, model, config))


class TeaCacheCalibrateNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitTeaCacheCalibrate",
            display_name="ReuseKit TeaCache Calibrate",
            category=AREA,
            description="Run one full sampling with this model to measure what the calibrated rules need: the "
                        "TeaCache polynomial (modulated-input change -> residual change) and the MagCache "
                        "residual-magnitude ratios per cond against sigma. Nothing is skipped; only a complete "
                        "run of 5+ steps is saved, per model (user/reusekit/teacache_calibration.json), and later "
                        "step-cache runs with model_type auto or calibrated use it.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model to calibrate; sample with it once "
                                                    "(20+ steps give a better fit).")],
            outputs=[io.Model.Output(tooltip="A copy of the model that records the calibration while it samples.")],
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        node = "ReuseKit TeaCache Calibrate"
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
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                model_type="auto", threshold=-1.0, start_percent=0.0, end_percent=1.0, max_consecutive_skips=0,
                cache_device="device", residual_mode="auto", rule="auto") -> io.NodeOutput:
        import nodes

        node = cls.NODE
        cls.check_sampler(sampler_name, scheduler)
        config = make_config(node, model_type, threshold, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode, rule=rule)
        cached = attach(node, model, config)
        (latent,) = nodes.common_ksampler(cached, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                          latent_image, denoise=denoise)
        return io.NodeOutput(latent)


NODES = [TeaCacheNode, TeaCacheCalibrateNode, CachedKSamplerNode]
