"""The families the step cache hooks: where each reads its modulated input, which blocks make up its
stack, which subclasses it refuses, the host seams it calls, and which published variant a model is.

Pure data and small readers over ComfyUI's model classes (resolved by name, so a host without a family
simply lacks it); the seams themselves are in patches/step_cache.py.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch


def _reference_tokens(args) -> int:
    """How many reference-image tokens (Kontext, Flux.2, Qwen-Image-Edit) end the image stream."""
    to = args.get("transformer_options") or {}
    return sum(to.get("reference_image_num_tokens") or ())


def _flux_modulated(dm, args):
    """Flux / HunyuanVideo: the first double block's image norm, modulated by its scale/shift the
    block's way: per token range where the block gets ``modulation_dims_img`` (HunyuanVideo I2V's
    guiding frame), and with the reference tokens on the timestep-zero row where the host doubled the
    modulation (Flux.2 ``index_timestep_zero``: its block patch is not handed those ranges)."""
    from comfy.ldm.flux.layers import apply_mod

    block = dm.double_blocks[0]
    vec, img = args["vec"], args["img"]
    mod1 = vec[0][0] if isinstance(vec, tuple) else block.img_mod(vec)[0]  # tuple: global modulation
    dims = args.get("modulation_dims_img")
    if dims is None and mod1.scale.ndim == 3 and mod1.scale.shape[1] == 2:  # doubled: timestep zero
        n = img.shape[1] - _reference_tokens(args)
        dims = [(0, n, 0), (n, img.shape[1], 1)]
    return apply_mod(block.img_norm1(img), 1 + mod1.scale, mod1.shift, dims)


def _qwen_modulated(dm, args):
    """Qwen-Image: the first block's image norm, modulated by the first half of its img_mod (the
    reference tokens by the timestep-zero half where the host doubled the batch of ``vec``:
    Qwen-Image-Edit-2511's ``index_timestep_zero``)."""
    block = dm.transformer_blocks[0]
    img, vec = args["img"], args["vec"]
    img_mod1 = block.img_mod(vec).chunk(2, dim=-1)[0]
    if vec.shape[0] == 2 * img.shape[0]:
        zero_from = img.shape[1] - _reference_tokens(args)
        return block._modulate(block.img_norm1(img), img_mod1, timestep_zero_index=zero_from)[0]
    return block._modulate(block.img_norm1(img), img_mod1)[0]


def _wan_modulated(dm, args):
    """Wan: the projected time embedding e0 (the published "ret mode" input)."""
    return args["vec"]


def _ltxv_modulated(dm, args):
    """LTXV: the first block's RMS-normed input, scaled and shifted by its self-attention modulation
    (its scale_shift_table plus the per-token timestep), as TeaCache4LTX-Video reads it."""
    block = dm.transformer_blocks[0]
    x, ts = args["img"], args["vec"]
    table = block.scale_shift_table
    ada = table[None, None, :2].to(x) + ts.reshape(x.shape[0], ts.shape[1], table.shape[0], -1)[:, :, :2]
    shift, scale = ada.unbind(dim=2)
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift


def _ltx2_modulated(dm, args):
    """LTX-2: the first block's RMS-normed video tokens, scaled and shifted by its self-attention
    modulation (the video stream decides for both streams: one decision per call)."""
    block = dm.transformer_blocks[0]
    vx = args["img"][0]
    shift, scale = block.get_ada_values(block.scale_shift_table, vx.shape[0], args["v_timestep"], slice(0, 2))
    return torch.nn.functional.rms_norm(vx, (vx.shape[-1],), eps=1e-6) * (1 + scale) + shift


def _lumina_modulated(dm, args):
    """Lumina 2 / Z-Image: the first layer's attention norm, modulated by its scale (the reference tokens
    by the timestep-zero half where the host doubled ``adaln_input``: Z-Image Omni's ``timestep_zero_index``)."""
    from comfy.ldm.lumina.model import modulate

    layer = dm.layers[0]
    scale = layer.adaLN_modulation(args["adaln_input"]).chunk(4, dim=1)[0]
    zero = args.get("timestep_zero_index")
    return modulate(layer.attention_norm1(args["img"]), scale, **({} if zero is None else
                                                                  {"timestep_zero_index": zero}))


def _cosmos_modulated(dm, args):
    """Cosmos Predict2 (and Anima): the first block's self-attention norm, shifted and scaled by its
    modulation (plus the AdaLN-LoRA term where the model has one), the per-block position embedding
    added first, as the block does."""
    block = dm.blocks[0]
    x = args["img"]
    if args.get("extra_per_block_pos_emb") is not None:
        x = x + args["extra_per_block_pos_emb"]
    mod = block.adaln_modulation_self_attn(args["emb_B_T_D"])
    if block.use_adaln_lora:
        mod = mod + args["adaln_lora_B_T_3D"]
    shift, scale, _ = (m[:, :, None, None] for m in mod.chunk(3, dim=-1))
    return block.layer_norm_self_attn(x) * (1 + scale) + shift


def _mochi_modulated(dm, args):
    """Mochi: the first block's RMS-normed image tokens scaled by its self-attention modulation (what
    TeaCache4Mochi reads from norm1)."""
    x = args["img"]
    scale = dm.blocks[0].mod_x(torch.nn.functional.silu(args["vec"])).chunk(4, dim=1)[0]
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale.unsqueeze(1))


@dataclass(frozen=True)
class Family:
    name: str
    default_type: str  # model_type for "auto" when no calibration exists
    classes: tuple[str, ...]  # "module:Class" of the diffusion model
    modulated: Callable[[Any, dict], torch.Tensor]
    blocks: Callable[[Any], list[tuple[str, int]]]
    image_first: bool = False  # a single stream without ``img_slice`` is (image, text) (HunyuanVideo < 0.14)
    bases: tuple[str, ...] = ()  # "module:Class" of the BaseModel, where one diffusion class serves several
    seams: tuple[tuple[str, tuple[str, ...]], ...] = ()  # ("module:attr.path", parameter names) it calls,
    # besides the ModelPatcher methods every family uses (PATCHER)
    variant: Callable[[Any, dict], str] | None = None  # (model_patcher, the run's conds) -> published variant
    call_wrapper: str = "DIFFUSION_MODEL"  # the WrappersMP kind around one model call (APPLY_MODEL: Mochi's
    # forward runs no DIFFUSION_MODEL wrapper)
    half: bool = True  # its blocks' inputs can be cut to some rows (the schedule rule's cond-only steps)
    # forward inputs its block wrapper reads from the forward's scope, not from the block's args, so a
    # cond-only step cannot cut them (HuMo's audio, Qwen-Image's text mask): a call carrying one has none
    scoped: tuple[str, ...] = ()
    # (diffusion model) -> the attributes under it (dicts) whose ``.get(block index)`` names a block the
    # forward runs outside the seam whose output a skipped call discards (VACE's control blocks): on a
    # skipped call they name none
    side_maps: Callable[[Any], list[str]] | None = None
    # "module:Class" of the subclasses of ``classes`` the family's published tables are read for; any other
    # subclass (a newer host's, say) reads none (model_variant)
    known: tuple[str, ...] = ()
    # where the family's forward offers no block-replace seam: ("module:Class.forward" of its blocks, that
    # method's parameter names after self, the first being the stream the block adds to); the cache wraps
    # the method and reaches the blocks ``layers(dm)`` lists, in order (``blocks`` names them)
    layer_forward: tuple[str, tuple[str, ...]] | None = None
    layers: Callable[[Any], Any] | None = None


def _cond_values(conds: dict, key: str) -> list:
    """The values of ``key`` over every cond of a run (``guider.conds``: positive, negative... lists of dicts)."""
    return [c[key] for cs in (conds or {}).values() if isinstance(cs, (list, tuple))
            for c in cs if isinstance(c, dict) and c.get(key) is not None]


def _flux_variant(model_patcher, conds: dict) -> str:
    """Flux Kontext: a Flux run whose conds carry reference latents (ReferenceLatent, the way ComfyUI
    feeds Kontext its image); else Flux."""
    return "flux-kontext" if _cond_values(conds, "reference_latents") else "flux"


WAN_14B_DIM = 4096  # Wan 2.1 1.3B is dim 1536, 14B dim 5120: from this width on, the 14B layout
# i2v 720p from this latent area (H x W after the VAE's 8x): midway between 480x832 (6240) and 720x1280 (14400)
WAN_720P_LATENT_AREA = (60 * 104 + 90 * 160) // 2


def _wan_variant(model_patcher, conds: dict) -> str:
    """Wan 2.1 (and the Wan 2.2 14B experts, the same layout): i2v (an image-to-video model,
    ``model_type`` "i2v") at 480p or 720p by the area of the run's start-image latent
    (``concat_latent_image``; 480p without one), else t2v at 1.3B or 14B by its width."""
    model = model_patcher.model
    cfg = model.model_config.unet_config
    if cfg.get("model_type") == "i2v" and getattr(model, "image_to_video", False):
        areas = [t.shape[-2] * t.shape[-1] for t in _cond_values(conds, "concat_latent_image")
                 if isinstance(t, torch.Tensor) and t.ndim >= 2]
        return f"wan2.1_i2v_{'720p' if areas and max(areas) >= WAN_720P_LATENT_AREA else '480p'}_14B_ret_mode"
    return f"wan2.1_t2v_{'14B' if int(cfg.get('dim', 0)) >= WAN_14B_DIM else '1.3B'}_ret_mode"


def model_variant(family: Family, model_patcher, conds: dict) -> str:
    """The published variant a model is (a key of the published tables, e.g. "flux-kontext"), or the
    family's ``default_type`` where it has no finer reader. A diffusion model of a subclass the family does
    not name (``classes``, ``known``) is "unknown class <name>", which no published table has: a table
    fitted on its base class may not fit it, so rule auto runs first_block on it until it is calibrated
    (LTXVImageModel, an LTXVModel for images in ComfyUI 0.38, would otherwise read LTX-Video's)."""
    dm = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    if type(dm) not in {cls for cls in map(_resolve, family.classes + family.known) if cls is not None}:
        return f"unknown class {type(dm).__name__}"
    return family.variant(model_patcher, conds) if family.variant is not None else family.default_type


def _double_single(dm):
    return ([("double_block", i) for i in range(len(dm.double_blocks))]
            + [("single_block", i) for i in range(len(getattr(dm, "single_blocks", ())))])


def _transformer_blocks(dm):
    return [("double_block", i) for i in range(len(dm.transformer_blocks))]


def _wan_blocks(dm):
    return [("double_block", i) for i in range(len(dm.blocks))]


def _lumina_layers(dm):
    return dm.layers


def _cosmos_layers(dm):
    return dm.blocks


def _layer_family(name: str, cls: str, modulated, layers: Callable[[Any], Any],
                  layer_forward: tuple[str, tuple[str, ...]], **kwargs) -> Family:
    """A family whose forward has no block-replace seam: the cache wraps ``layer_forward`` and reaches the
    blocks ``layers(dm)`` lists, named ("layer", index); no published table (``auto`` reads a calibration)."""
    def blocks(dm):
        return [("layer", i) for i in range(len(layers(dm)))]

    return Family(name, "calibrated", (cls,), modulated, blocks, layer_forward=layer_forward, layers=layers, **kwargs)


def _vace_maps(dm) -> list[str]:
    """Wan VACE: ``vace_layers_mapping``, which names the control block ComfyUI runs after a block (read
    with ``.get(block index)``, outside the seam); a skip never adds their hints (the stored residual holds
    them). No map where a hint lands after the last block (the output holds it, and each control block
    feeds the next)."""
    mapping = getattr(dm, "vace_layers_mapping", None)
    if not isinstance(mapping, dict) or not mapping or getattr(dm, "vace_blocks", None) is None:
        return []
    if not all(isinstance(i, int) for i in mapping) or max(mapping) >= len(dm.blocks) - 1:
        return []
    return ["vace_layers_mapping"]


FLUX, HUNYUAN, WAN = ("comfy.ldm.flux.model:Flux",), ("comfy.ldm.hunyuan_video.model:HunyuanVideo",), \
    ("comfy.ldm.wan.model:WanModel",)
# the Wan subclasses of ComfyUI 0.3.75 and 0.33 (VACE, camera, HuMo, S2V, Animate, ...): Wan 2.1's tables
WAN_KNOWN = tuple(f"comfy.ldm.wan.{spec}" for spec in (
    "model:VaceWanModel", "model:CameraWanModel", "model:HumoWanModel", "model:WanModel_S2V", "model:SCAILWanModel",
    "model:SCAIL2WanModel", "model_animate:AnimateWanModel", "model_animate2:WanAnimate2Model",
    "model_wandancer:WanDancerModel", "ar_model:CausalWanModel"))
CHROMA, CHROMA_RADIANCE = ("comfy.ldm.chroma.model:Chroma",), ("comfy.ldm.chroma_radiance.model:ChromaRadiance",)
LTXV = ("comfy.ldm.lightricks.model:LTXVModel",)
LTX2 = ("comfy.ldm.lightricks.av_model:LTXAVModel",)
QWEN = ("comfy.ldm.qwen_image.model:QwenImageTransformer2DModel",)
APPLY_MOD = (("comfy.ldm.flux.layers:apply_mod", ("tensor", "m_mult", "m_add", "modulation_dims")),)
QWEN_MODULATE = (("comfy.ldm.qwen_image.model:QwenImageTransformerBlock._modulate", ("x", "mod_params")),)

# the first family whose classes (and BaseModel, where given) match is the model's
FAMILIES = (
    Family("flux2", "calibrated", FLUX, _flux_modulated, _double_single, bases=("comfy.model_base:Flux2",),
           seams=APPLY_MOD),
    Family("flux", "flux", FLUX, _flux_modulated, _double_single, seams=APPLY_MOD, variant=_flux_variant),
    Family("chroma_radiance", "calibrated", CHROMA_RADIANCE, _flux_modulated, _double_single, seams=APPLY_MOD),
    Family("chroma", "calibrated", CHROMA, _flux_modulated, _double_single, seams=APPLY_MOD),
    Family("hunyuan_video15", "calibrated", HUNYUAN, _flux_modulated, _double_single, image_first=True,
           bases=("comfy.model_base:HunyuanVideo15",), seams=APPLY_MOD),
    Family("hunyuan_video", "hunyuan_video", HUNYUAN, _flux_modulated, _double_single, image_first=True,
           seams=APPLY_MOD),
    Family("wan22", "calibrated", WAN, _wan_modulated, _wan_blocks, bases=("comfy.model_base:WAN22",),
           known=WAN_KNOWN, side_maps=_vace_maps),
    Family("wan", "wan2.1_t2v_1.3B_ret_mode", WAN, _wan_modulated, _wan_blocks, variant=_wan_variant,
           known=WAN_KNOWN, side_maps=_vace_maps, scoped=("audio_embed",)),
    Family("qwen_image", "calibrated", QWEN, _qwen_modulated, _transformer_blocks, seams=QWEN_MODULATE,
           scoped=("attention_mask",)),
    # LTX-2's blocks carry (video, audio): the cache keeps both residuals and decides once; its timestep
    # embeddings are packed objects the cache does not cut by rows, so no cond-only steps
    Family("ltx2", "calibrated", LTX2, _ltx2_modulated, _transformer_blocks, half=False,
           seams=(("comfy.ldm.lightricks.av_model:BasicAVTransformerBlock.get_ada_values",
                   ("scale_shift_table", "batch_size", "timestep", "indices")),)),
    Family("ltxv", "ltxv", LTXV, _ltxv_modulated, _transformer_blocks),
    Family("mochi", "mochi", ("comfy.ldm.genmo.joint_model.asymm_models_joint:AsymmDiTJoint",), _mochi_modulated,
           _wan_blocks, call_wrapper="APPLY_MODEL"),
    # Lumina 2 and Z-Image: one joint stream (caption, then image tokens) through ``layers``; their refiners
    # run before, on every call
    _layer_family("lumina2", "comfy.ldm.lumina.model:NextDiT", _lumina_modulated, _lumina_layers,
                  ("comfy.ldm.lumina.model:JointTransformerBlock.forward",
                   ("x", "x_mask", "freqs_cis", "adaln_input")),
                  seams=(("comfy.ldm.lumina.model:modulate", ("x", "scale")),)),
    # Cosmos Predict2 and Anima (a MiniTrainDIT with a text adapter): a (batch, frames, height, width, dim)
    # stream through ``blocks``
    _layer_family("cosmos_predict2", "comfy.ldm.cosmos.predict2:MiniTrainDIT", _cosmos_modulated, _cosmos_layers,
                  ("comfy.ldm.cosmos.predict2:Block.forward", ("x_B_T_H_W_D", "emb_B_T_D", "crossattn_emb"))),
)

def _no_block_options(cls) -> bool:
    """Whether ``cls.forward_orig`` hands its block patches no ``transformer_options`` (read from the host's
    source; where it cannot be read, assumed to hand them: a run then reports blocks it never reached)."""
    try:
        return '"transformer_options": transformer_options' not in inspect.getsource(cls.forward_orig)
    except (OSError, TypeError, AttributeError):
        return False


NO_BLOCK_SEAM = "its forward offers no block-replace seam (patches_replace \"dit\") to hook, and the cache " \
    "never copies a core forward"
# ("module:Class", why, when) of diffusion models the step cache refuses (when ``when(cls)`` holds, if given),
# subclasses of a family's among them; checked before the families
REFUSED = (
    ("comfy.ldm.wan.model:WanModel_S2V", "this ComfyUI hands its block patches no transformer_options, so the "
     "cache never sees a call (newer ones do)", _no_block_options),
    *((spec, NO_BLOCK_SEAM, None) for spec in ("comfy.ldm.cosmos.model:GeneralDIT",
                                               "comfy.ldm.hidream.model:HiDreamImageTransformer2DModel",
                                               "comfy.ldm.omnigen.omnigen2:OmniGen2Transformer2DModel")),
)


def _resolve(spec: str):
    """The object at "module:attr.path", or None where this host has no such thing."""
    import importlib

    module, _, path = spec.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError:  # feature probe: this host has no such model
        return None
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _matches(family: Family, model) -> bool:
    dm = getattr(model, "diffusion_model", None)
    if not any(isinstance(dm, cls) for cls in map(_resolve, family.classes) if cls is not None):
        return False
    return not family.bases or any(isinstance(model, cls) for cls in map(_resolve, family.bases) if cls is not None)


def detect_family(model_patcher) -> Family:
    """The family of a ModelPatcher's diffusion model; ValueError when TeaCache does not cover it."""
    model = getattr(model_patcher, "model", None)
    dm = getattr(model, "diffusion_model", None)
    if dm is None:  # not a diffusion model's patcher at all (a CLIP, a VAE, a latent through an any-typed link)
        raise ValueError(f"model: expects a MODEL (a diffusion model from a loader), got a "
                         f"{type(model_patcher).__name__}")
    for spec, why, when in REFUSED:
        cls = _resolve(spec)
        if cls is not None and isinstance(dm, cls) and (when is None or when(cls)):
            raise ValueError(f"model: the step cache does not support {type(dm).__name__} models ({why})")
    for family in FAMILIES:
        if _matches(family, model):
            return family
    supported = ", ".join(f.name for f in FAMILIES)
    raise ValueError(f"model: the step cache does not support {type(dm).__name__} models yet "
                     f"(supported: {supported})")
