"""The demo models: a small Flux (and Wan 2.1) TRAINED on procedural pictures, and their tiny CLIP.

The host's real ``Flux`` class at a small size, trained with rectified flow
(``tests/tinymodels/train_flux.py``) on pictures drawn with PIL: a coloured shape on a plain
background, captioned "a red circle on a black background", encoded by the tiny CLIP
(:func:`build_clip`, seeded weights). Captions were dropped 15% of the time, so CFG matters.

The latent is a fixed, invertible picture code (no VAE): a 4-channel picture (RGB + the shape's
mask) at twice the latent size, pixel-unshuffled by 2 into 16 channels. ``picture_to_latent`` and
``latent_to_picture`` convert both ways, in ComfyUI's latent space (before ``process_in``).
The tests use these same files (``tests/tinymodels/trained_flux.py`` loads this module).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

WEIGHTS = Path(__file__).resolve().parent / "flux_shapes.safetensors"

CONFIG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32,
              hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2,
              axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False)

COLORS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 230), "yellow": (240, 220, 40),
          "white": (245, 245, 245), "purple": (150, 50, 200)}
BACKGROUNDS = {"black": (10, 10, 10), "gray": (128, 128, 128), "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle", "cross")
# Flux's latent format: the sampler works on (latent - shift) * scale
_SCALE, _SHIFT = 0.3611, 0.1159


def captions() -> list[tuple[str, str, str, str]]:
    """Every (caption, colour, shape, background) the set uses (shape colour != background)."""
    out = []
    for color in COLORS:
        for shape in SHAPES:
            for bg in BACKGROUNDS:
                if color != bg:
                    out.append((f"a {color} {shape} on a {bg} background", color, shape, bg))
    return out


def draw(color: str, shape: str, bg: str, size: int, rng: random.Random) -> torch.Tensor:
    """One picture: (4, size, size) in [0, 1], RGB and the shape's mask."""
    from PIL import Image, ImageDraw

    scale = 8  # draw large, then downsample: smooth edges
    big = size * scale
    img = Image.new("RGB", (big, big), BACKGROUNDS[bg])
    mask = Image.new("L", (big, big), 0)
    r = rng.uniform(0.22, 0.36) * big
    cx, cy = rng.uniform(r, big - r), rng.uniform(r, big - r)
    for canvas, fill in ((ImageDraw.Draw(img), COLORS[color]), (ImageDraw.Draw(mask), 255)):
        if shape == "circle":
            canvas.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "square":
            canvas.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif shape == "triangle":
            canvas.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
        else:
            w = r * 0.38
            canvas.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
            canvas.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    img, mask = img.resize((size, size), Image.BILINEAR), mask.resize((size, size), Image.BILINEAR)
    rgb = torch.tensor(list(img.getdata()), dtype=torch.float32).view(size, size, 3).permute(2, 0, 1)
    m = torch.tensor(list(mask.getdata()), dtype=torch.float32).view(1, size, size)
    return torch.cat([rgb, m]) / 255.0


def picture_to_latent(pic: torch.Tensor) -> torch.Tensor:
    """(B, 4, 2H, 2W) pictures in [0, 1] -> (B, 16, H, W) latents (ComfyUI space, before process_in)."""
    x = torch.nn.functional.pixel_unshuffle(pic * 2.0 - 1.0, 2)
    return x / _SCALE + _SHIFT


def latent_to_picture(latent: torch.Tensor, processed: bool = False) -> torch.Tensor:
    """The inverse: (B, 16, H, W) latents (``processed``: after the model's process_in) ->
    (B, 4, 2H, 2W) pictures, clamped to [0, 1]."""
    x = latent if processed else (latent - _SHIFT) * _SCALE
    return (torch.nn.functional.pixel_shuffle(x, 2) + 1.0).mul(0.5).clamp(0, 1)


def shape_color_error(latent: torch.Tensor, color: str, bg: str, processed: bool = False) -> float:
    """How far a sample is from its caption: mean RGB distance of the masked region to ``color``
    plus of the rest to ``bg`` (0 = perfect, ~1 = wrong colours)."""
    pic = latent_to_picture(latent.float(), processed)
    rgb, mask = pic[:, :3], (pic[:, 3:4] > 0.5).float()
    want_fg = torch.tensor(COLORS[color]).view(1, 3, 1, 1) / 255.0
    want_bg = torch.tensor(BACKGROUNDS[bg]).view(1, 3, 1, 1) / 255.0
    area = mask.sum().clamp(min=1.0)
    fg = ((rgb - want_fg).abs().mean(1, keepdim=True) * mask).sum() / area
    bgerr = ((rgb - want_bg).abs().mean(1, keepdim=True) * (1 - mask)).sum() / (1 - mask).sum().clamp(min=1.0)
    if mask.sum() < 1:  # no shape drawn at all
        return 1.0 + float(bgerr)
    return float(fg + bgerr)


# The same pictures for a second family: Wan 2.1 t2v, one latent frame (5-D latents).
WAN_WEIGHTS = WEIGHTS.parent / "wan_shapes.safetensors"
WAN_CONFIG = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=64,
                  ffn_dim=256, freq_dim=64, text_dim=32, out_dim=16, num_heads=2, num_layers=3,
                  window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
FAMILIES = {"flux": ("Flux", CONFIG, WEIGHTS), "wan": ("WAN21_T2V", WAN_CONFIG, WAN_WEIGHTS)}


def _with_host_fields(config: dict) -> dict:
    """The Flux config plus ``txt_ids_dims`` where this host's FluxParams has it (ComfyUI 0.33)."""
    import comfy.ldm.flux.model

    fields = getattr(comfy.ldm.flux.model.FluxParams, "__dataclass_fields__", {})
    return {**({"txt_ids_dims": []} if "txt_ids_dims" in fields else {}), **config}


def build(load_weights: bool = True, family: str = "flux"):
    """The trained model as a real ModelPatcher (``comfy.supported_models.Flux`` or ``WAN21_T2V``)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    cls_name, config, weights = FAMILIES[family]
    if family == "flux":
        config = _with_host_fields(config)
    model_config = getattr(comfy.supported_models, cls_name)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({})
    if load_weights:
        from safetensors.torch import load_file

        sd = {k: v.float() for k, v in load_file(str(weights)).items()}
        # the host's own key conversion (0.33's torch RMSNorm names `*_norm.scale` `*_norm.weight`)
        model.diffusion_model.load_state_dict(model_config.process_unet_state_dict(sd), strict=True)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


# The tiny CLIP the models were trained with: ComfyUI's SD1 CLIP-L at width 32, seeded weights.
TEXT_DIM = 32
CLIP_CONFIG = {"hidden_size": TEXT_DIM, "intermediate_size": 64, "num_attention_heads": 2,
               "num_hidden_layers": 2, "projection_dim": TEXT_DIM}
CLIP_SEED = 0


def fill_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Deterministic, well-scaled weights for every parameter (ComfyUI leaves them uninitialised)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:  # norm scales and other vectors
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.02)
    return module


def build_clip(seed: int = CLIP_SEED):
    """The real ``comfy.sd.CLIP`` (SD1 CLIP-L with ComfyUI's own tokenizer files) at width 32."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = comfy.sd.CLIP(target=target, model_options={"clip_l_model_config": dict(CLIP_CONFIG)})
    fill_weights(clip.cond_stage_model, seed)
    return clip
