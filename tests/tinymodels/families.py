"""More tiny REAL diffusion families, for the PE cache tests (each builds RoPE per forward call).

``FAMILY_SPECS[name]`` gives ``build(seed)`` (a real ``ModelPatcher`` around ComfyUI's own model
class, weights filled from a seed) and ``inputs(size, seed)`` (the arguments of
``BaseModel.apply_model`` for a latent of that size: ``(x, sigma, kwargs)``). ``sizes`` lists two
latent sizes the family accepts. Nothing is faked: these are the host's classes at tiny widths.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import TEXT_DIM, _from_config, tiny_flux, tiny_wan, with_host_fields


def _sm():
    import comfy.supported_models

    return comfy.supported_models


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class FamilySpec:
    build: Callable[[int], Any]
    inputs: Callable[[tuple, int], tuple]
    sizes: tuple  # two latent shapes, without the batch dimension
    has_ref_latents: bool = False
    has_rope_options: bool = False
    requires: tuple = ()  # "module:Class" or "module:Class(param)" the family needs; older hosts lack some

    def missing(self) -> str | None:
        """The first required host class (or parameter of one) this ComfyUI lacks (``None``: none)."""
        for path in self.requires:
            module, _, name = path.partition(":")
            name, _, param = name.rstrip(")").partition("(")
            cls = getattr(importlib.import_module(module), name, None)
            if cls is None:
                return f"{module}.{name}"
            if param and param not in inspect.signature(cls).parameters:
                return f"{module}.{name}({param}=...)"
        return None


def _ctx(seed: int, tokens: int = 7, dim: int = TEXT_DIM, batch: int = 1):
    return torch.randn((batch, tokens, dim), generator=_gen(seed + 100))


def _x(shape, seed: int, batch: int = 1):
    return torch.randn((batch, *shape), generator=_gen(seed))


def _sigma(batch: int = 1):
    return torch.full((batch,), 0.7)


# ---- flux-like -------------------------------------------------------------------------------

def _flux_inputs(shape, seed, tokens=7):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed, tokens), "guidance": torch.tensor([3.5]),
                                       "y": torch.randn((1, TEXT_DIM), generator=_gen(seed + 1))}


def tiny_chroma(seed: int = 0, radiance: bool = False):
    cfg = dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=TEXT_DIM, hidden_size=64,
               mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000,
               patch_size=2, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=1)
    cls = _sm().Chroma
    if radiance:
        cfg.update(image_model="chroma_radiance", in_channels=3, out_channels=3, patch_size=16, nerf_hidden_size=16,
                   nerf_mlp_ratio=2, nerf_depth=1, nerf_max_freqs=4, nerf_tile_size=0,
                   nerf_final_head_type="linear", nerf_embedder_dtype=torch.float32)
        cls = _sm().ChromaRadiance
    params = "comfy.ldm.chroma_radiance.model:ChromaRadianceParams" if radiance else "comfy.ldm.chroma.model:ChromaParams"
    return _from_config(cls, with_host_fields(cfg, params), seed)


def _chroma_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed), "guidance": torch.tensor([0.0])}


def tiny_hunyuan_video(seed: int = 0):
    cfg = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, patch_size=[1, 2, 2],
               vec_in_dim=TEXT_DIM, context_in_dim=TEXT_DIM, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1,
               depth_single_blocks=1, axes_dim=[8, 12, 12], theta=256, qkv_bias=True, guidance_embed=True,
               byt5=False, meanflow=False, use_cond_type_embedding=False, vision_in_dim=None)
    return _from_config(_sm().HunyuanVideo, with_host_fields(cfg, "comfy.ldm.hunyuan_video.model:HunyuanVideoParams"),
                        seed)


def tiny_qwen_image(seed: int = 0, context_dim: int = TEXT_DIM):
    """Qwen-Image (hidden 64, 1 block); ``context_dim``: the text encoder's width (the tiny CLIP's, or the
    tests' Qwen2.5-VL's)."""
    cfg = dict(image_model="qwen_image", in_channels=64, out_channels=16, num_layers=1, attention_head_dim=32,
               num_attention_heads=2, joint_attention_dim=context_dim, axes_dims_rope=(8, 12, 12))
    return _from_config(_sm().QwenImage, cfg, seed)


def tiny_lumina2(seed: int = 0, z_image: bool = False, cap_feat_dim: int = TEXT_DIM, n_layers: int = 2,
                 pixel: bool = False):
    """Lumina 2 (or Z-Image) at a test size; ``cap_feat_dim``: the text encoder's width; ``pixel``: Z-Image
    Pixel Space (RGB patches of 16, a small MLP decoder in place of the final layer)."""
    cfg = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=64, cap_feat_dim=cap_feat_dim,
               n_layers=n_layers, n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True,
               axes_dims=[8, 12, 12], axes_lens=[300, 512, 512], rope_theta=10000.0, ffn_dim_multiplier=4.0, multiple_of=16)
    cls = _sm().Lumina2
    if z_image:
        cfg.update(dim=256, n_heads=2, n_kv_heads=2, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
                   rope_theta=256.0, ffn_dim_multiplier=1.0, z_image_modulation=True, time_scale=1000.0,
                   pad_tokens_multiple=32)
        cls = _sm().ZImage
    if pixel:
        cfg.update(in_channels=3, patch_size=16, decoder_hidden_size=32, decoder_num_res_blocks=1)
        cls = _sm().ZImagePixelSpace
    return _from_config(cls, cfg, seed)


def tiny_hidream(seed: int = 0):
    cfg = dict(image_model="hidream", patch_size=2, in_channels=16, out_channels=16, num_layers=1,
               num_single_layers=1, attention_head_dim=32, num_attention_heads=2,
               caption_channels=[TEXT_DIM, TEXT_DIM], text_emb_dim=TEXT_DIM, num_routed_experts=2,
               num_activated_experts=1, axes_dims_rope=[16, 8, 8], max_resolution=[128, 128],
               llama_layers=[0, 0, 0])
    return _from_config(_sm().HiDream, cfg, seed)


def tiny_hunyuan_dit(seed: int = 0):
    """HunyuanDiT at hidden 64, 2 blocks (its RoPE is ``calc_rope`` of the latent's size)."""
    cfg = dict(image_model="hydit", input_size=(16, 16), patch_size=2, in_channels=4, hidden_size=64, depth=2,
               num_heads=2, mlp_ratio=2.0, text_states_dim=TEXT_DIM, text_states_dim_t5=48, text_len=7, text_len_t5=9,
               learn_sigma=True, size_cond=False, use_style_cond=False)
    return _from_config(_sm().HunyuanDiT, cfg, seed)


def _hydit_inputs(shape, seed):
    t5 = torch.randn((1, 9, 48), generator=_gen(seed + 7))
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed), "text_embedding_mask": torch.ones(1, 7),
                                       "encoder_hidden_states_t5": t5, "text_embedding_mask_t5": torch.ones(1, 9)}


def _hidream_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed),
                                       "y": torch.randn((1, TEXT_DIM), generator=_gen(seed + 1)),
                                       "encoder_hidden_states_llama3": torch.randn((1, 3, 5, TEXT_DIM),
                                                                                   generator=_gen(seed + 2))}


def tiny_ltxv(seed: int = 0):
    cfg = dict(image_model="ltxv", in_channels=128, cross_attention_dim=64, attention_head_dim=32,
               num_attention_heads=2, caption_channels=TEXT_DIM, num_layers=1)
    return _from_config(_sm().LTXV, cfg, seed)


def _ltxv_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed), "frame_rate": 25, "attention_mask": None}


def tiny_cosmos(seed: int = 0, anima: bool = False, **overrides):
    """Cosmos Predict2 at model channels 64, 2 blocks; ``anima``: as an Anima model (ComfyUI 0.33), whose text
    adapter keeps its fixed width (1024, 6 layers: 134M parameters; text passed as is skips it)."""
    cfg = dict(image_model="anima" if anima else "cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128,
               in_channels=16, out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=64, concat_padding_mask=True,
               crossattn_emb_channels=TEXT_DIM, pos_emb_cls="rope3d", pos_emb_learnable=True,
               pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=16,
               num_blocks=2, num_heads=2, extra_per_block_abs_pos_emb=False, rope_h_extrapolation_ratio=4.0,
               rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
               rope_enable_fps_modulation=False)
    cfg.update(overrides)
    return _from_config(_sm().Anima if anima else _sm().CosmosT2IPredict2, cfg, seed)


def tiny_mochi(seed: int = 0):
    cfg = dict(image_model="mochi_preview", depth=1, patch_size=2, num_heads=2, hidden_size_x=64,
               hidden_size_y=32, mlp_ratio_x=192.0, mlp_ratio_y=2.0, learn_sigma=False, in_channels=12,
               qk_norm=True, qkv_bias=False, out_bias=True, attn_drop=0.0, patch_embed_bias=True,
               posenc_preserve_area=True, timestep_mlp_bias=True, attend_to_padding=False,
               timestep_scale=1000.0, use_t5=True, t5_feat_dim=TEXT_DIM, t5_token_length=8, rope_theta=10000.0)
    return _from_config(_sm().GenmoMochi, cfg, seed)


def _mochi_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed, tokens=8),
                                       "attention_mask": torch.ones((1, 8), dtype=torch.bool)}


def tiny_omnigen2(seed: int = 0):
    cfg = dict(image_model="omnigen2", axes_dim_rope=[8, 12, 12], axes_lens=[1024, 1664, 1664],
               ffn_dim_multiplier=None, hidden_size=64, in_channels=16, multiple_of=16, norm_eps=1e-05,
               num_attention_heads=2, num_kv_heads=2, num_layers=1, num_refiner_layers=1, out_channels=None,
               patch_size=2, text_feat_dim=TEXT_DIM, timestep_scale=1000.0)
    return _from_config(_sm().Omnigen2, cfg, seed)


def _plain_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed)}


def _tokens_inputs(shape, seed):
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed), "num_tokens": 7}


# ---- families of the newer hosts (0.33: Flux.2, Qwen-Image-Edit-2511, HunyuanVideo 1.5, LTX-2, Wan 2.2) ----

def tiny_flux2(seed: int = 0, klein: bool = False):
    """Flux.2 (dev: guidance embed; Klein: none) at hidden 64, 2 heads, 1 double + 1 single block."""
    cfg = dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=TEXT_DIM,
               hidden_size=64, mlp_ratio=3.0, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 8, 8, 8],
               theta=2000, patch_size=1, qkv_bias=False, guidance_embed=not klein, global_modulation=True,
               mlp_silu_act=True, ops_bias=False, default_ref_method="index", ref_index_scale=10.0)
    if "txt_ids_dims" in importlib.import_module("comfy.ldm.flux.model").FluxParams.__dataclass_fields__:
        cfg["txt_ids_dims"] = [3]  # as 0.33's detection sets for Flux.2 (0.3.75 has no text positions)
    return _from_config(_sm().Flux2, cfg, seed)


def _flux2_inputs(shape, seed, klein=False):
    kwargs = {"c_crossattn": _ctx(seed)}
    if not klein:
        kwargs["guidance"] = torch.tensor([3.5])
    return _x(shape, seed), _sigma(), kwargs


def tiny_qwen_image_edit_2511(seed: int = 0):
    """Qwen-Image-Edit-2511: reference latents at timestep zero (``index_timestep_zero``)."""
    cfg = dict(image_model="qwen_image", in_channels=64, out_channels=16, num_layers=1, attention_head_dim=32,
               num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 12, 12),
               default_ref_method="index_timestep_zero")
    return _from_config(_sm().QwenImage, cfg, seed)


def _qwen_edit_inputs(shape, seed):
    x, sigma, kwargs = _plain_inputs(shape, seed)
    ref = torch.randn((1, *shape[:-2], 4, 6), generator=_gen(seed + 3))
    return x, sigma, dict(kwargs, ref_latents=[ref])


HV15_VISION_DIM = 16


def tiny_hunyuan_video15(seed: int = 0):
    """HunyuanVideo 1.5 (patch 1, image concat + mask, vision tokens, cond-type embedding) at hidden 64."""
    cfg = dict(image_model="hunyuan_video", in_channels=33, out_channels=16, patch_size=[1, 1, 1], vec_in_dim=None,
               context_in_dim=TEXT_DIM, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1,
               axes_dim=[8, 12, 12], theta=256, qkv_bias=True, guidance_embed=False, byt5=False, meanflow=False,
               use_cond_type_embedding=True, vision_in_dim=HV15_VISION_DIM)
    return _from_config(_sm().HunyuanVideo15,
                        with_host_fields(cfg, "comfy.ldm.hunyuan_video.model:HunyuanVideoParams"), seed)


def _hv15_inputs(shape, seed):
    concat = torch.randn((1, shape[0] + 1, *shape[1:]), generator=_gen(seed + 4))
    return _x(shape, seed), _sigma(), {"c_crossattn": _ctx(seed), "c_concat": concat,
                                       "clip_fea": torch.randn((1, 5, HV15_VISION_DIM), generator=_gen(seed + 5))}


def tiny_ltx2(seed: int = 0):
    """LTX-2 (audio + video) at 2 heads of 32 (video) and 2 of 16 (audio), 1 layer."""
    cfg = dict(image_model="ltxav", in_channels=128, audio_in_channels=128, cross_attention_dim=64,
               audio_cross_attention_dim=32, attention_head_dim=32, audio_attention_head_dim=16,
               num_attention_heads=2, audio_num_attention_heads=2, caption_channels=TEXT_DIM, num_layers=1,
               connector_attention_head_dim=16, connector_num_attention_heads=2, connector_num_layers=1)
    return _from_config(_sm().LTXAV, cfg, seed)


def _ltx2_inputs(shape, seed):
    """Video latent ``shape`` and an audio latent of twice its frames, packed as the sampler does."""
    import comfy.utils

    video = _x(shape, seed)
    audio = torch.randn((1, 8, 2 * shape[1], 16), generator=_gen(seed + 6))
    x, shapes = comfy.utils.pack_latents([video, audio])
    ctx = torch.randn((1, 7, 2 * TEXT_DIM), generator=_gen(seed + 100))  # video and audio text, processed
    return x, _sigma(), {"c_crossattn": ctx, "frame_rate": 25, "latent_shapes": shapes}


def tiny_wan22(seed: int = 0, expert_14b: bool = False):
    """Wan 2.2: the 5B text/image-to-video layout (48-channel latents), or a 14B expert (Wan 2.1 layout)."""
    if expert_14b:
        return tiny_wan(seed)
    cfg = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=48, dim=64,
               ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=48, num_heads=2, num_layers=1,
               window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
    return _from_config(_sm().WAN22_T2V, cfg, seed)


_SM = "comfy.supported_models:"

FAMILY_SPECS: dict[str, FamilySpec] = {
    "flux": FamilySpec(tiny_flux, _flux_inputs, ((16, 8, 8), (16, 12, 8)), has_ref_latents=True,
                       has_rope_options=True),
    "wan": FamilySpec(tiny_wan, _plain_inputs, ((16, 3, 8, 8), (16, 2, 6, 8)), has_rope_options=True),
    "chroma": FamilySpec(tiny_chroma, _chroma_inputs, ((16, 8, 8), (16, 12, 8))),
    "chroma_radiance": FamilySpec(lambda seed=0: tiny_chroma(seed, radiance=True), _chroma_inputs,
                                  ((3, 32, 32), (3, 48, 32))),
    "hunyuan_video": FamilySpec(tiny_hunyuan_video, _flux_inputs, ((16, 3, 8, 8), (16, 2, 6, 8))),
    "qwen_image": FamilySpec(tiny_qwen_image, _plain_inputs, ((16, 1, 8, 8), (16, 1, 12, 8)), has_ref_latents=True),
    "lumina2": FamilySpec(tiny_lumina2, _tokens_inputs, ((16, 8, 8), (16, 12, 8))),
    "z_image": FamilySpec(lambda seed=0: tiny_lumina2(seed, z_image=True), _tokens_inputs,
                          ((16, 8, 8), (16, 12, 8))),
    "z_image_pixel": FamilySpec(lambda seed=0: tiny_lumina2(seed, z_image=True, pixel=True), _tokens_inputs,
                                ((3, 64, 64), (3, 96, 64)), requires=(_SM + "ZImagePixelSpace",)),
    "hidream": FamilySpec(tiny_hidream, _hidream_inputs, ((16, 8, 8), (16, 12, 8))),
    "hunyuan_dit": FamilySpec(tiny_hunyuan_dit, _hydit_inputs, ((4, 16, 16), (4, 24, 16))),
    "ltxv": FamilySpec(tiny_ltxv, _ltxv_inputs, ((128, 2, 2, 2), (128, 3, 2, 3))),
    "cosmos": FamilySpec(tiny_cosmos, _plain_inputs, ((16, 1, 8, 8), (16, 2, 6, 8))),
    "anima": FamilySpec(lambda seed=0: tiny_cosmos(seed, anima=True), _plain_inputs, ((16, 1, 8, 8), (16, 2, 6, 8)),
                        requires=(_SM + "Anima",)),
    "mochi": FamilySpec(tiny_mochi, _mochi_inputs, ((12, 2, 8, 8), (12, 3, 6, 8))),
    "omnigen2": FamilySpec(tiny_omnigen2, _tokens_inputs, ((16, 8, 8), (16, 12, 8))),
    "flux2": FamilySpec(tiny_flux2, _flux2_inputs, ((128, 8, 8), (128, 12, 8)), has_ref_latents=True,
                        has_rope_options=True, requires=(_SM + "Flux2",)),
    "flux2_klein": FamilySpec(lambda seed=0: tiny_flux2(seed, klein=True),
                              lambda shape, seed: _flux2_inputs(shape, seed, klein=True),
                              ((128, 8, 8), (128, 12, 8)), has_ref_latents=True, has_rope_options=True,
                              requires=(_SM + "Flux2",)),
    "qwen_image_edit": FamilySpec(tiny_qwen_image_edit_2511, _qwen_edit_inputs, ((16, 1, 8, 8), (16, 1, 12, 8)),
                                  has_ref_latents=True,
                                  requires=("comfy.ldm.qwen_image.model:QwenImageTransformer2DModel"
                                            "(default_ref_method)",)),
    "hunyuan_video15": FamilySpec(tiny_hunyuan_video15, _hv15_inputs, ((16, 3, 8, 8), (16, 2, 6, 8)),
                                  requires=(_SM + "HunyuanVideo15",)),
    "ltx2": FamilySpec(tiny_ltx2, _ltx2_inputs, ((128, 2, 2, 2), (128, 3, 2, 3)), requires=(_SM + "LTXAV",)),
    "wan22": FamilySpec(tiny_wan22, _plain_inputs, ((48, 3, 8, 8), (48, 2, 6, 8)), has_rope_options=True,
                        requires=(_SM + "WAN22_T2V",)),
    "wan22_14b": FamilySpec(lambda seed=0: tiny_wan22(seed, expert_14b=True), _plain_inputs,
                            ((16, 3, 8, 8), (16, 2, 6, 8)), has_rope_options=True),
}


def family_spec(name: str) -> FamilySpec:
    """``FAMILY_SPECS[name]``, or a pytest skip naming the family and the class this host lacks."""
    import pytest

    spec = FAMILY_SPECS[name]
    missing = spec.missing()
    if missing:
        pytest.skip(f"{name}: this ComfyUI has no {missing}")
    return spec
