"""More tiny real model families for the step-cache tests (Qwen-Image), built like the others."""

from __future__ import annotations


def tiny_qwen_image(seed: int = 0, **overrides):
    """Qwen-Image at 2 heads of 32, 2 layers, text width 32 (the tiny CLIP's)."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    cfg = dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=2,
               attention_head_dim=32, num_attention_heads=2, joint_attention_dim=TEXT_DIM,
               pooled_projection_dim=TEXT_DIM, axes_dims_rope=(8, 12, 12))
    cfg.update(overrides)
    return _from_config(comfy.supported_models.QwenImage, cfg, seed)
