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


def tiny_hunyuan_video(seed: int = 0, **overrides):
    """HunyuanVideo (5-D latents) at hidden 64, 2 heads, 1 double + 1 single block."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config, with_host_fields

    cfg = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=TEXT_DIM,
               context_in_dim=TEXT_DIM, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1,
               depth_single_blocks=1, axes_dim=[8, 12, 12], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
               guidance_embed=False, byt5=False, meanflow=False, use_cond_type_embedding=False,
               vision_in_dim=None)
    cfg.update(overrides)
    return _from_config(comfy.supported_models.HunyuanVideo,
                        with_host_fields(cfg, "comfy.ldm.hunyuan_video.model:HunyuanVideoParams"), seed)


def tiny_wan_s2v(seed: int = 0, **overrides):
    """Wan 2.2 S2V (audio injected between blocks) at dim 64, 2 heads, 2 layers, audio width 32."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    cfg = dict(image_model="wan2.1", model_type="s2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=64,
               ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=16, num_heads=2, num_layers=2,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, audio_dim=32,
               num_audio_token=4, enable_adain=True, cond_dim=16, audio_inject_layers=[0, 1])
    cfg.update(overrides)
    return _from_config(comfy.supported_models.WAN22_S2V, cfg, seed)
