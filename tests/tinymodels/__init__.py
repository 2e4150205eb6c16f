"""Tiny REAL ComfyUI models for the tests, and test-only loader nodes that serve them.

Everything here builds ComfyUI's own classes (``comfy.supported_models``, ``comfy.model_base``,
``comfy.sd.CLIP``, ``comfy.sd.VAE``, ``comfy.clip_vision``) from small configs and fills their
weights from a seeded generator (ComfyUI creates its layers uninitialised). Nothing is faked.

This folder is also a ComfyUI custom-node package: the test harness loads it in process and
links it into the test server's ``custom_nodes``, so workflows can use ``RKTestTinyCheckpoint``
in place of a checkpoint loader.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from .trained_flux import _load_shapes

FAMILIES = ("flux", "wan", "flux_trained", "wan_trained", "qwen_image", "z_image")

_SHAPES = _load_shapes()  # the pack's demo models: the tiny CLIP and its weight filling live there, once
TEXT_DIM = _SHAPES.TEXT_DIM  # width of the tiny CLIP; every tiny diffusion model takes this as context
fill_weights = _SHAPES.fill_weights


def _patcher(model):
    import comfy.model_management as mm
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


# Model parameters that newer hosts require and the bundled 0.3.75 does not know (each model class
# builds a params dataclass from its whole config): set only where the host's dataclass has them.
HOST_FIELDS = {
    "comfy.ldm.flux.model:FluxParams": {"txt_ids_dims": []},
    "comfy.ldm.chroma.model:ChromaParams": {"txt_ids_dims": [], "vec_in_dim": None},
    "comfy.ldm.chroma_radiance.model:ChromaRadianceParams": {"txt_ids_dims": [], "vec_in_dim": None,
                                                             "use_x0": False, "use_sequential_txt_ids": False},
    "comfy.ldm.hunyuan_video.model:HunyuanVideoParams": {"meanflow_sum": False},
}


def with_host_fields(cfg: dict, params: str) -> dict:
    """``cfg`` plus the fields of :data:`HOST_FIELDS` that this host's ``params`` dataclass has."""
    import importlib

    module, _, name = params.partition(":")
    fields = getattr(getattr(importlib.import_module(module), name), "__dataclass_fields__", {})
    return {**{k: v for k, v in HOST_FIELDS[params].items() if k in fields}, **cfg}


def _from_config(model_config_cls, unet_config: dict, seed: int):
    model_config = model_config_cls(unet_config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({})
    fill_weights(model.diffusion_model, seed)
    return _patcher(model)


def tiny_flux(seed: int = 0, **overrides):
    """Flux (dev-style, guidance embed) at hidden 64, 2 heads, 1 double + 1 single block."""
    import comfy.supported_models

    cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=TEXT_DIM,
               context_in_dim=TEXT_DIM, hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=1,
               depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
               qkv_bias=True, guidance_embed=True)
    cfg.update(overrides)
    return _from_config(comfy.supported_models.Flux, with_host_fields(cfg, "comfy.ldm.flux.model:FluxParams"), seed)


def tiny_wan(seed: int = 0, **overrides):
    """Wan 2.1 text-to-video at dim 64, 2 heads, 1 layer (5-D latents)."""
    import comfy.supported_models

    cfg = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512,
               in_dim=16, dim=64, ffn_dim=128, freq_dim=32, text_dim=TEXT_DIM, out_dim=16,
               num_heads=2, num_layers=1, window_size=(-1, -1), qk_norm=True,
               cross_attn_norm=True, eps=1e-6)
    cfg.update(overrides)
    return _from_config(comfy.supported_models.WAN21_T2V, cfg, seed)


SD15_UNET = dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True, legacy=False,
                 adm_in_channels=None, in_channels=4, model_channels=32, num_res_blocks=[1, 1],
                 transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1], channel_mult=[1, 2],
                 transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=TEXT_DIM, num_heads=2,
                 num_head_channels=-1)


def tiny_sd15(seed: int = 0):
    """SD1.5's UNet (ComfyUI's openaimodel) at 32 channels, two levels, cross-attention on the tiny CLIP."""
    import comfy.supported_models

    return _from_config(comfy.supported_models.SD15, dict(SD15_UNET), seed)


def tiny_controlnet(seed: int = 0):
    """A real ``comfy.controlnet.ControlNet`` over ComfyUI's cldm ControlNet, shaped for :func:`tiny_sd15`
    (its residuals are what the UNet adds per level)."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.model_management as mm

    cfg = {k: v for k, v in SD15_UNET.items() if k != "out_channels"}
    control = comfy.cldm.cldm.ControlNet(hint_channels=3, dtype=torch.float32, device="cpu", **cfg)
    fill_weights(control, seed)
    return comfy.controlnet.ControlNet(control, load_device=mm.get_torch_device(), manual_cast_dtype=None)


def tiny_clip(seed: int = 0):
    """A real ``comfy.sd.CLIP`` (SD1-style CLIP-L with ComfyUI's own tokenizer files), width 32: the
    demo models' text encoder at ``seed`` 0."""
    return _SHAPES.build_clip(seed)


def tiny_vae(seed: int = 0, latent_channels: int = 16, ch: int = 32, ch_mult=(1, 2, 2, 2), num_res_blocks: int = 1):
    """A real ``comfy.sd.VAE`` around a small AutoencoderKL (8x downscale, 16 latent channels); ``ch=128,
    ch_mult=(1, 2, 4, 4), num_res_blocks=2`` is the size of Flux's and SD3's VAE (84M parameters)."""
    import comfy.ldm.models.autoencoder
    import comfy.sd

    ddconfig = {"double_z": True, "z_channels": latent_channels, "resolution": 256, "in_channels": 3,
                "out_ch": 3, "ch": ch, "ch_mult": list(ch_mult), "num_res_blocks": num_res_blocks,
                "attn_resolutions": [], "dropout": 0.0}
    params = {"ddconfig": ddconfig, "embed_dim": latent_channels}
    sd = fill_weights(comfy.ldm.models.autoencoder.AutoencoderKL(**params), seed).state_dict()
    vae = comfy.sd.VAE(sd=sd, config={"params": params})
    vae.latent_channels = latent_channels  # the config path keeps SD's default of 4
    return vae


def clip_vision_from_config(config: dict, seed: int = 0):
    """A real ``comfy.clip_vision.ClipVisionModel`` built from ``config`` (the JSON its loader reads, written
    to a temporary file), weights filled from ``seed``."""
    import comfy.clip_vision

    fd, path = tempfile.mkstemp(suffix=".json", prefix="rk_clip_vision_")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    try:
        model = comfy.clip_vision.ClipVisionModel(path)
    finally:
        os.unlink(path)
    fill_weights(model.model, seed)
    return model


def tiny_clip_vision(seed: int = 0):
    """A real ``comfy.clip_vision.ClipVisionModel`` (ViT, 32 px, width 32, 2 layers)."""
    return clip_vision_from_config(
        {"attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "quick_gelu", "hidden_size": 32,
         "image_size": 32, "initializer_factor": 1.0, "initializer_range": 0.02,
         "intermediate_size": 64, "layer_norm_eps": 1e-05, "model_type": "clip_vision_model",
         "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 2, "patch_size": 8,
         "projection_dim": 32, "torch_dtype": "float32"}, seed)


def same_output(a, b) -> bool:
    """Whether two encoder outputs are equal bit for bit: tensors (and their dtypes), containers and
    output objects (CLIP vision's ``Output``) compared all the way down."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_output(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_output(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return same_output(vars(a), vars(b))
    return a == b


def trained_flux(seed: int = 0):
    """The small Flux trained on captioned shapes (trained_flux.py); ``seed`` is ignored."""
    from .trained_flux import build

    return build()


def trained_wan(seed: int = 0):
    """The small Wan 2.1 trained on the same captioned shapes; ``seed`` is ignored."""
    from .trained_flux import build

    return build(family="wan")


def tiny_z_image(seed: int = 0):
    """ComfyUI's Z-Image (Lumina 2's NextDiT) at a test size, taking the tiny CLIP's text."""
    from .families import tiny_lumina2

    return tiny_lumina2(seed, z_image=True)


BUILDERS = {"flux": tiny_flux, "wan": tiny_wan, "flux_trained": trained_flux, "wan_trained": trained_wan,
            "z_image": tiny_z_image}


class RKTestTinyCheckpoint:
    """Test-only loader: a tiny diffusion model of a family, the tiny CLIP and the tiny VAE."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"family": (list(FAMILIES),), "seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, family, seed):
        if family == "qwen_image":
            return tiny_qwen_image_checkpoint(seed)
        return BUILDERS[family](seed), tiny_clip(seed), tiny_vae(seed)


def tiny_qwen_image_checkpoint(seed: int = 0):
    """Qwen-Image's three parts from ComfyUI's own classes: the diffusion model, its Qwen2.5-VL text encoder
    (with the vision tower that reads an edit's images) and its Wan 2.1 VAE, at test sizes."""
    from .conditioning import tiny_wan_vae
    from .families import tiny_qwen_image
    from .text_encoders import TINY_LLM, build, loader_targets

    target = next(t for t in loader_targets().values() if t.name == "qwen_image.QwenImageTEModel_")
    return tiny_qwen_image(seed, context_dim=TINY_LLM["hidden_size"]), build(target, seed), tiny_wan_vae(seed)


class RKTestTinyCLIPVision:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("CLIP_VISION",)
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, seed):
        return (tiny_clip_vision(seed),)


class _AnyType(str):
    """A type every input takes: ComfyUI's type check compares with ``!=`` (custom nodes' switches use it)."""

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


class RKTestPass:
    """Hands on what it is given, as any type: a link into any input, a combo's included, as a custom switch
    or primitive node makes one (on both hosts; 0.3.75 has no core switch)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (_AnyType("*"), {})}}

    RETURN_TYPES = (_AnyType("*"),)
    FUNCTION = "run"
    CATEGORY = "ReuseKit tests"

    def run(self, value):
        return (value,)


NODE_CLASS_MAPPINGS = {"RKTestTinyCheckpoint": RKTestTinyCheckpoint, "RKTestTinyCLIPVision": RKTestTinyCLIPVision,
                       "RKTestPass": RKTestPass}
NODE_CLASS_MAPPINGS.update(__import__(f"{__name__}.panelprobe", fromlist=["x"]).NODE_CLASS_MAPPINGS)  # panel tests
NODE_CLASS_MAPPINGS.update(__import__(f"{__name__}.conditioning", fromlist=["x"]).NODE_CLASS_MAPPINGS)  # conditioning
NODE_CLASS_MAPPINGS.update(__import__(f"{__name__}.lazy_clip", fromlist=["x"]).NODE_CLASS_MAPPINGS)  # lazy encoders
NODE_CLASS_MAPPINGS.update(__import__(f"{__name__}.text_encoders", fromlist=["x"]).NODE_CLASS_MAPPINGS)  # LLM encoders
