"""ReuseKit TeaCache, TeaCache Calibrate and Cached KSampler: the step cache as nodes."""

from __future__ import annotations

from comfy_api.latest import io

from ..caching.teacache import StepCacheConfig
from ..patches import teacache as patch
from . import CATEGORY, SamplerInputs, ksampler_inputs

AREA = f"{CATEGORY}/step cache"


def _cache_inputs() -> list:
    return [
        io.Combo.Input("model_type", options=list(patch.MODEL_TYPES), default="auto",
                       tooltip="Which rescale polynomial to use. auto: this model's calibration if one was "
                               "made, else the published one for its family (Flux.1, HunyuanVideo, Wan 2.1; "
                               "Flux.2, Qwen-Image, HunyuanVideo 1.5 and Wan 2.2 5B need a calibration). "
                               "calibrated: only a calibration (see ReuseKit TeaCache Calibrate)."),
        io.Float.Input("rel_l1_thresh", default=0.4, min=0.0, max=10.0, step=0.01,
                       tooltip="Skip while the accumulated predicted change stays under this. 0 computes "
                               "every step (exact); higher skips more (Flux: 0.4 ~2x)."),
        io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Never skip before this fraction of the schedule."),
        io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                       tooltip="Never skip after this fraction of the schedule."),
        io.Int.Input("max_consecutive_skips", default=0, min=0, max=1000,
                     tooltip="At most this many skipped steps in a row (0: no limit)."),
        io.Combo.Input("cache_device", options=["device", "cpu"], default="device",
                       tooltip="Where stored residuals live: the model's device (fastest) or the CPU "
                               "(saves VRAM, costs a copy per skipped step)."),
        io.Combo.Input("residual_mode", options=["extrapolate", "reuse"], default="extrapolate",
                       tooltip="What a skipped step adds. reuse: the last residual (classic TeaCache). "
                               "extrapolate: the last residual continued along its change between the "
                               "last two computed steps (lower error at the same skips; see README)."),
    ]


def make_config(node: str, model_type: str, rel_l1_thresh: float, start_percent: float, end_percent: float,
                max_consecutive_skips: int, cache_device: str, residual_mode: str = "extrapolate",
                calibrate: bool = False) -> StepCacheConfig:
    def bad(name, why):
        return ValueError(f"{node}: {name} {why}")

    if model_type not in patch.MODEL_TYPES:
        raise bad("model_type", f"must be one of {', '.join(patch.MODEL_TYPES)}, got {model_type!r}")
    if not (rel_l1_thresh >= 0.0) or rel_l1_thresh == float("inf"):
        raise bad("rel_l1_thresh", f"must be a finite number >= 0, got {rel_l1_thresh!r}")
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
    if residual_mode not in ("extrapolate", "reuse"):
        raise bad("residual_mode", f"must be 'extrapolate' or 'reuse', got {residual_mode!r}")
    return StepCacheConfig(None, model_type, float(rel_l1_thresh), float(start_percent), float(end_percent),
                           int(max_consecutive_skips), cache_device, calibrate, residual_mode)


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
            display_name="ReuseKit TeaCache",
            category=AREA,
            description="Skips transformer steps whose output would barely change, reusing the last residual "
                        "(TeaCache). Separate state per cond/uncond; starts clean on every run and on any "
                        "shape change. Works with any sampler; reports skipped steps in the log and the panel.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model (Flux, Flux.2, HunyuanVideo, HunyuanVideo 1.5, "
                                                    "Wan 2.1/2.2, Qwen-Image incl. Edit).")]
            + _cache_inputs(),
            outputs=[io.Model.Output(tooltip="A copy of the model with the step cache attached.")],
        )

    @classmethod
    def execute(cls, model, model_type, rel_l1_thresh, start_percent, end_percent, max_consecutive_skips,
                cache_device, residual_mode="extrapolate") -> io.NodeOutput:
        node = "ReuseKit TeaCache"
        config = make_config(node, model_type, rel_l1_thresh, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode)
        return io.NodeOutput(attach(node, model, config))


class TeaCacheCalibrateNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitTeaCacheCalibrate",
            display_name="ReuseKit TeaCache Calibrate",
            category=AREA,
            description="Run one full sampling with this model to fit its TeaCache polynomial (modulated-input "
                        "change -> residual change). Nothing is skipped during calibration; the fit is saved "
                        "per model (user/reusekit/teacache_calibration.json) and later ReuseKit TeaCache runs "
                        "with model_type auto or calibrated use it.",
            inputs=[io.Model.Input("model", tooltip="The diffusion model to calibrate; sample with it once "
                                                    "(20+ steps give a better fit).")],
            outputs=[io.Model.Output(tooltip="A copy of the model that records the calibration while it samples.")],
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        node = "ReuseKit TeaCache Calibrate"
        config = make_config(node, "auto", 0.0, 0.0, 1.0, 0, "device", "reuse", calibrate=True)
        return io.NodeOutput(attach(node, model, config))


class CachedKSamplerNode(SamplerInputs, io.ComfyNode):
    NODE = "ReuseKit Cached KSampler"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitCachedKSampler",
            display_name="ReuseKit Cached KSampler",
            category=AREA,
            description="KSampler with the TeaCache step cache built in (one node instead of two).",
            inputs=[
                *ksampler_inputs(cfg=3.5, sampler="euler", scheduler="simple"),
            ] + _cache_inputs(),
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image, denoise,
                model_type, rel_l1_thresh, start_percent, end_percent, max_consecutive_skips,
                cache_device, residual_mode="extrapolate") -> io.NodeOutput:
        import nodes

        node = cls.NODE
        cls.check_sampler(sampler_name, scheduler)
        config = make_config(node, model_type, rel_l1_thresh, start_percent, end_percent,
                             max_consecutive_skips, cache_device, residual_mode)
        cached = attach(node, model, config)
        (latent,) = nodes.common_ksampler(cached, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                          latent_image, denoise=denoise)
        return io.NodeOutput(latent)


NODES = [TeaCacheNode, TeaCacheCalibrateNode, CachedKSamplerNode]
