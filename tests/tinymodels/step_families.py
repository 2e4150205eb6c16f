"""More tiny real model families for the step-cache tests (Qwen-Image), built like the others, and
the helpers that call a step-cached model directly (``rkharness`` is imported where used: this folder
is also loaded as a custom-node package outside pytest)."""

from __future__ import annotations

import torch

from .families import family_spec  # noqa: F401  (the step tests reach it here, with the helpers below)


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


def tiny_wan_vace(seed: int = 0, **overrides):
    """Wan 2.1 VACE at dim 64, 2 heads, 4 layers with a VACE block after layers 0 and 2 (as VACE 1.3B puts
    one after every other layer, never after the last), control input 96 channels (16 + 16 latent + 64 mask)."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    cfg = dict(image_model="wan2.1", model_type="vace", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=64,
               ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=16, num_heads=2, num_layers=4,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, vace_layers=2, vace_in_dim=96)
    cfg.update(overrides)
    return _from_config(comfy.supported_models.WAN21_Vace, cfg, seed)


def tiny_wan_causal(seed: int = 0, **overrides):
    """Causal-WAN (Self-Forcing / Causal Forcing: the ``ar_video`` sampler's model) at dim 64, 2 heads,
    2 layers; None on a host without it (before ComfyUI 0.33)."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    config = getattr(comfy.supported_models, "WAN21_CausalAR_T2V", None)
    if config is None:
        return None
    cfg = dict(image_model="wan2.1", model_type="t2v", causal_ar=True, patch_size=(1, 2, 2), text_len=512, in_dim=16,
               dim=64, ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=16, num_heads=2, num_layers=2,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    cfg.update(overrides)
    return _from_config(config, cfg, seed)


def causal_wan_case(conds, steps: int = 4):
    """(Causal-WAN at seed 0, a function that samples a model of it with ComfyUI's ``ar_video`` sampler: 3
    latent frames, a frame per block, fixed noise, CFG 1 as the distilled Self-Forcing models run, its KV
    caches holding one row). The calling test is skipped on a host without Causal-WAN."""
    import comfy.sample
    import comfy.samplers
    import pytest

    model = tiny_wan_causal(0)
    if model is None:
        pytest.skip("this ComfyUI has no Causal-WAN (comfy.supported_models.WAN21_CausalAR_T2V, ComfyUI 0.33)")
    latent = torch.zeros((1, 16, 3, 8, 8))
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))

    def sample(m):
        sampler = comfy.samplers.ksampler("ar_video", {"num_frame_per_block": 1})
        sigmas = comfy.samplers.calculate_sigmas(m.get_model_object("model_sampling"), "simple", steps)
        return comfy.sample.sample_custom(m, noise, 1.0, sampler, sigmas, *conds, latent, seed=5)

    return model, sample


def tiny_wan_subclass(config_name: str, seed: int = 0):
    """A Wan 2.1/2.2 variant by its ComfyUI model config (``WAN21_Camera``, ``WAN22_Animate``, ...) at dim 64, 2
    heads, 2 layers, its own input channels and model type; None on a host without that config."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    config = getattr(comfy.supported_models, config_name, None)
    if config is None:
        return None
    cfg = dict(image_model="wan2.1", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=64, ffn_dim=128, freq_dim=32,
               text_dim=TEXT_DIM, out_dim=16, num_heads=2, num_layers=2, window_size=(-1, -1), qk_norm=True,
               cross_attn_norm=True, eps=1e-6)
    cfg.update({k: v for k, v in config.unet_config.items() if k not in cfg or k == "in_dim"})
    return _from_config(config, cfg, seed)


def z_image_fun_controlnet(model, strength: float = 0.8):
    """``model`` (a tiny Z-Image) with ComfyUI's Z-Image Fun ControlNet patches (0.33's ZImageControlPatch, its
    control model at the model's width: 2 control layers), a picture through the tiny VAE as its control image;
    None on a host without them."""
    import comfy.model_patcher
    import comfy.ops

    from . import fill_weights, tiny_vae

    try:
        import comfy.ldm.lumina.controlnet as controlnet
        from comfy_extras.nodes_model_patch import ZImageControlPatch
    except ImportError:  # feature probe: ComfyUI before the Z-Image ControlNet
        return None
    dim = model.model.diffusion_model.dim
    control = fill_weights(controlnet.ZImage_Control(dim=dim, n_heads=2, n_kv_heads=2, multiple_of=16,
                                                     ffn_dim_multiplier=1.0, n_control_layers=2, control_in_dim=16,
                                                     operations=comfy.ops.disable_weight_init), 3)
    cpu = torch.device("cpu")
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(1))
    patch = ZImageControlPatch(comfy.model_patcher.ModelPatcher(control, load_device=cpu, offload_device=cpu),
                               tiny_vae(0), image, strength)
    m = model.clone()
    m.set_model_noise_refiner_patch(patch)
    m.set_model_double_block_patch(patch)
    return m


def tiny_wan_i2v(seed: int = 0, **overrides):
    """Wan 2.1 image-to-video (start-image latent and mask concatenated: 36 input channels) at dim 64."""
    import comfy.supported_models

    from . import TEXT_DIM, _from_config

    cfg = dict(image_model="wan2.1", model_type="i2v", patch_size=(1, 2, 2), text_len=512, in_dim=36, dim=64,
               ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=16, num_heads=2, num_layers=1,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    cfg.update(overrides)
    return _from_config(comfy.supported_models.WAN21_I2V, cfg, seed)


def meta_wan(model_config_name: str = "WAN21_T2V", **overrides):
    """A Wan 2.1 of real width (14B: dim 5120) on the meta device: its config and layout, no memory."""
    import comfy.model_patcher
    import comfy.supported_models

    cfg = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=5120,
               ffn_dim=13824, freq_dim=256, text_dim=4096, out_dim=16, num_heads=40, num_layers=1,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    cfg.update(overrides)
    model_config = getattr(comfy.supported_models, model_config_name)(cfg)
    model_config.set_inference_dtype(torch.float32, None)
    meta = torch.device("meta")
    return comfy.model_patcher.ModelPatcher(model_config.get_model({}, device=meta), load_device=meta,
                                            offload_device=meta)


def batched(x, sigma, kwargs):
    """One model call's inputs as cond and uncond batched together (the uncond's latent differs)."""
    def two(v):
        if isinstance(v, list):  # reference latents
            return [two(r) for r in v]
        return torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == 1 else v

    return torch.cat([x, x.flip(-1)]), two(sigma), {k: two(v) for k, v in kwargs.items()}


FLAT = {"cond": [(1.0, 0.0), (0.0, 0.0)]}  # a magcache curve whose ratio is always 1


def ready_to_skip(run) -> None:
    """The adaptive rule computes until a check has read its forecast (two or three computed calls): its conds
    as after a check that found the forecast exact, so the next call on the same input may skip."""
    for state in run.conds.values():
        state.beat = 2.0


def two_calls(model, x, sigma, kwargs, keys=("c", "u"), second="S"):
    """The same input twice through a step-cached model, as one sampling run's calls (the node's config
    resolved, unit teacache polynomial, flat magcache curve: an unchanged input skips; the schedule rule
    plans C, then ``second``: S skips, H computes the cond and rebuilds the uncond):
    (first output, second output, the run's state)."""
    import rkharness

    patch, math = rkharness.pack("patches.step_cache"), rkharness.pack("caching.step_cache")
    schedule = rkharness.pack("caching.step_schedule")
    to = model.model_options["transformer_options"].copy()
    settings = to[patch.KEY]
    config = patch.resolved_config(settings.config, settings.family)
    run = math.RunState(config, (0, 0, 0, 1.0, 0), 1.0, 0.0, FLAT)
    run.set_plan(schedule.Plan(("C",), (0.0,)), [float(sigma.flatten()[0]), 0.0])
    to.update({"wrappers": model.wrappers, "sigmas": sigma, "uuids": list(keys),
               "cond_or_uncond": [0, 1][:len(keys)], patch.RUN_KEY: run})
    model.patch_model(load_weights=False)  # its object patches on the model, as a sampling run has them
    try:
        with torch.inference_mode():
            first = model.model.apply_model(x, sigma, transformer_options=to, **kwargs)
            run.plan = schedule.Plan((second,), (0.0,))
            ready_to_skip(run)
            to["sigmas"] = sigma.clone()  # the next step: a timestep tensor of its own, as a sampler makes one
            second = model.model.apply_model(x, sigma, transformer_options=to, **kwargs)
    finally:
        model.unpatch_model(unpatch_weights=False)
    return first, second, run
