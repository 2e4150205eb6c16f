"""The bench stand-ins: a Flux and a Wan 2.1 deep enough for block-level step caching, trained at the
bench's 16x16 latent on captioned scenes (``standin_scenes.py``) by ``train_standins.py``.

    load_standin("flux")   # -> a real ModelPatcher of comfy.supported_models.Flux with the trained weights
    load_standin("wan")    # -> the same for WAN21_T2V (5-D latents, one frame)

Both are the host's real classes built from :data:`CONFIGS` (Flux: 4 double + 8 single blocks at width
96; Wan: 10 layers at width 96), with the weights of ``bench/models/`` (fp16 on disk, float32 in the
model; the host's own key conversion maps 0.33's ``*_norm.weight``). Prompts are encoded by the demo
models' tiny CLIP (``tiny_clip(0)``); :func:`latent_to_picture` decodes a latent exactly (no VAE).

How close they behave to the real models is measured on the magnitude-ratio curve that MagCache
calibrates (the ratio of consecutive residual norms per call): :func:`calibrated_magnitudes` runs ReuseKit's
TeaCache Calibrate node on a full sampling, :func:`curve_match` compares the result with the published
FLUX.1-dev / Wan 2.1 1.3B table (``caching/step_cache.py``) on the schedule fraction.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from . import with_host_fields
from .trained_flux import _load_shapes

MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"
LATENT = 16  # the latent size they were trained at (pictures are twice that)
CONFIGS = {
    "flux": dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32,
                 hidden_size=96, mlp_ratio=4.0, num_heads=3, depth=4, depth_single_blocks=8,
                 axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False),
    "wan": dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=96,
                ffn_dim=384, freq_dim=64, text_dim=32, out_dim=16, num_heads=3, num_layers=10,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6),
}
MODEL_CLASSES = {"flux": "Flux", "wan": "WAN21_T2V"}
PUBLISHED = {"flux": "flux", "wan": "wan2.1_t2v_1.3B_ret_mode"}  # the MagCache tables they are held to
PUBLISHED_STEPS = {"flux": 28, "wan": 50}
CALIBRATION = ("a white square on a black background", 101)  # a held-out caption (standin_scenes.HELD_OUT)


def weights_path(family: str) -> Path:
    return MODELS / f"{family}_standin.safetensors"


def _model_config(family: str, overrides: dict | None = None):
    import comfy.supported_models

    if family not in CONFIGS:
        raise ValueError(f"stand-in family: unknown {family!r} (one of {', '.join(CONFIGS)})")
    config = {**CONFIGS[family], **(overrides or {})}
    if family == "flux":
        config = with_host_fields(config, "comfy.ldm.flux.model:FluxParams")
    model_config = getattr(comfy.supported_models, MODEL_CLASSES[family])(config)
    model_config.set_inference_dtype(torch.float32, None)
    return model_config


def load_standin(family: str, weights: Path | str | None = None, load_weights: bool = True, **overrides):
    """The stand-in of ``family`` ("flux" or "wan") as a real ModelPatcher with its trained weights
    (``weights``: another file of the same shape; ``load_weights=False``: uninitialised, for training;
    ``overrides``: config fields, for training experiments)."""
    import comfy.model_management as mm
    import comfy.model_patcher

    model_config = _model_config(family, overrides)
    model = model_config.get_model({})
    if load_weights:
        from safetensors.torch import load_file

        sd = {k: v.float() for k, v in load_file(str(weights or weights_path(family))).items()}
        model.diffusion_model.load_state_dict(model_config.process_unet_state_dict(sd), strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def empty_latent(family: str, size: int = LATENT, batch: int = 1) -> torch.Tensor:
    return torch.zeros((batch, 16, size, size) if family == "flux" else (batch, 16, 1, size, size))


def latent_to_picture(latent: torch.Tensor, family: str) -> torch.Tensor:
    """A sampled latent (ComfyUI space, 4-D or one-frame 5-D) -> (B, 4, 2H, 2W) RGB + mask in [0, 1]."""
    import comfy.supported_models

    fmt = getattr(comfy.supported_models, MODEL_CLASSES[family]).latent_format()
    x = fmt.process_in(latent.float())
    if x.ndim == 5:
        x = x[:, :, 0]
    return _load_shapes().latent_to_picture(x, processed=True)


def picture_to_model_space(pic: torch.Tensor) -> torch.Tensor:
    """(B, 4, 2H, 2W) pictures -> what the diffusion model sees (after ``process_in``): the training target."""
    return torch.nn.functional.pixel_unshuffle(pic * 2.0 - 1.0, 2)


# ---- the magnitude-ratio curve ------------------------------------------------------------------

def calibrated_magnitudes(model, family: str, steps: int, cfg: float = 3.5, prompt: str = CALIBRATION[0],
                          seed: int = CALIBRATION[1], size: int = LATENT) -> dict[str, list[tuple[float, float]]]:
    """One full run of ReuseKit's TeaCache Calibrate node (euler, simple, the tiny CLIP's empty negative):
    what it stores for MagCache, per cond label: (sigma, cumulative log residual magnitude) per call."""
    import comfy.utils
    import rkharness

    import nodes

    from . import tiny_clip

    N, P = rkharness.pack("nodes.step_cache"), rkharness.pack("patches.step_cache")
    clip = tiny_clip(0)
    store, before = rkharness.pack("caching.step_cache").CalibrationStore(None), P.STORE
    progress, comfy.utils.PROGRESS_BAR_ENABLED = comfy.utils.PROGRESS_BAR_ENABLED, False
    P.STORE = store  # never the user's calibration file
    try:
        with torch.inference_mode():
            (pos,) = nodes.CLIPTextEncode().encode(clip, prompt)
            (neg,) = nodes.CLIPTextEncode().encode(clip, "")
            calibrating = N.TeaCacheCalibrateNode.execute(model=model).args[0]
            nodes.common_ksampler(calibrating, seed, steps, cfg, "euler", "simple", pos, neg,
                                  {"samples": empty_latent(family, size)})
    finally:
        P.STORE, comfy.utils.PROGRESS_BAR_ENABLED = before, progress
    key, ident = P.model_identity(model, P.detect_family(model))
    found = store.get(key, ident)
    if found is None or not found.magnitudes:
        raise RuntimeError(f"the calibration run of the {family} stand-in saved no magnitudes")
    return found.magnitudes


def step_ratios(points: list[tuple[float, float]]) -> list[float]:
    """Per call, its residual magnitude over the previous call's (the first call's is 1)."""
    return [1.0] + [math.exp(b[1] - a[1]) for a, b in zip(points, points[1:])]


def resampled_ratios(ratios: list[float], steps: int) -> list[float]:
    """A ratio curve of any step count as the ratios of a ``steps``-step run: the cumulative log
    magnitude against the schedule fraction (call i of n at i/n), linear between calls, read at j/steps."""
    cum, total = [], 0.0
    for r in ratios:
        total += math.log(r) if r > 0 else 0.0
        cum.append(total)
    n = len(ratios)

    def at(f: float) -> float:
        x = min(max(f * n, 0.0), n - 1.0)
        i = min(int(x), n - 2) if n > 1 else 0
        return cum[i] if n == 1 else cum[i] + (x - i) * (cum[i + 1] - cum[i])

    return [1.0] + [math.exp(at(j / steps) - at((j - 1) / steps)) for j in range(1, steps)]


def published_ratios(family: str) -> dict[str, list[float]]:
    """The published MagCache ratios the family's stand-in is held to, per cond label."""
    import rkharness

    ratios, steps, _shift = rkharness.pack("caching.step_cache").MAG_RATIOS[PUBLISHED[family]]
    per_step = len(ratios) // steps
    return {label: list(ratios[j::per_step]) for j, label in enumerate(("cond", "uncond")[:per_step])}


def curve_match(family: str, magnitudes: dict[str, list[tuple[float, float]]]) -> float:
    """How far a calibrated magnitude-ratio curve is from the published one (lower is closer): the mean
    absolute difference of the per-step ratios, both on the published table's steps (the calibrated
    curve resampled on the schedule fraction, :func:`resampled_ratios`), the first step (always 1) left
    out, averaged over the calibrated cond labels (each against the published curve of its label, else
    the published cond). For scale, a flat curve (every ratio 1) scores :func:`flat_match`."""
    published = published_ratios(family)
    scores = []
    for label, points in sorted(magnitudes.items()):
        want = published.get(label, published["cond"])
        got = resampled_ratios(step_ratios(points), len(want))
        scores.append(sum(abs(a - b) for a, b in zip(got[1:], want[1:], strict=True)) / (len(want) - 1))
    if not scores:
        raise ValueError("curve_match: no calibrated curve")
    return sum(scores) / len(scores)


def flat_match(family: str) -> float:
    """curve_match of a curve with every ratio 1 (no change of magnitude at all): the scale to read it by."""
    steps = PUBLISHED_STEPS[family]
    flat = [(1.0 - i / steps, 0.0) for i in range(steps)]
    return curve_match(family, {label: flat for label in published_ratios(family)})
