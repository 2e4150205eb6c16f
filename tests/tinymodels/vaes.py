"""Tiny VAEs and CLIP-vision encoders of every kind the host's loaders build, from the host's own classes.

Which classes: ComfyUI's own ``comfy.sd.VAE`` (behind VAELoader and the audio VAE loaders) picks its model
class from the state dict's keys, and ``comfy.clip_vision.load_clipvision_from_sd`` (behind
CLIPVisionLoader) picks a config file. :func:`ask_vae` and :func:`ask_vision` hand them probe files: per
model, the few keys and shapes detection reads (``meta`` tensors), plus the config a file carries in its
metadata (LTX-2's audio VAE needs one); what the host builds from them is recorded before any weight loads.

Building a VAE (:func:`build_vae`): while :func:`tiny_sizes` is held, ComfyUI's model classes take test-only
small widths and depths (latent channels, strides and layouts stay what the host chose); the model ComfyUI
made from the probe is filled from a seeded generator, and its state dict goes through ``comfy.sd.VAE``
again, which must detect the same class from it. A CLIP-vision encoder (:func:`build_vision`) is the host's
``ClipVisionModel`` of the config it picked, at a small width and depth, written as a json file at test time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os

import torch

from . import clip_vision_from_config, fill_weights, same_output

MAX_PARAMETERS = 20_000_000  # what a VAE may hold at the test size (its convolutions run on two CPUs)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclasses.dataclass(frozen=True)
class VAEProbe:
    """One VAE model as a file ComfyUI detects: the keys its detection reads, the config its file carries
    (``metadata``; ``ltxv``: the host's LTXV config of that version, as LTX-2 files carry theirs), what
    it encodes (``image``, ``video`` or ``audio``), and why ComfyUI's encode has nothing to do with it
    (``no_encode``: a decoder-only file, a model whose latents ComfyUI only decodes)."""

    name: str
    keys: dict
    media: str = "image"
    metadata: dict | None = None
    ltxv: int | None = None
    no_encode: str | None = None

    def sd(self) -> dict:
        return {k: _meta(*shape) for k, shape in self.keys.items()}

    def file_metadata(self) -> dict | None:
        """What the file carries beside its weights. LTXV's version is detected from a decoder width that a
        test size does not keep: its files at test sizes carry their version's config (as LTX-2's do)."""
        if self.ltxv is None:
            return self.metadata
        from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

        default = getattr(VideoVAE, "get_default_config", None) or VideoVAE.guess_config  # older hosts: guess_config
        return {"config": json.dumps({"vae": default(None, self.ltxv)})}


_KL = {"encoder.down.2.downsample.conv.weight": (128, 128, 3, 3)}  # an 8x AutoencoderKL (not SD's x4 upscaler)

VAE_PROBES = (
    VAEProbe("SD1.5/SDXL", {**_KL, "decoder.conv_in.weight": (512, 4, 3, 3), "post_quant_conv.weight": (4, 4, 1, 1)}),
    VAEProbe("Flux/SD3", {**_KL, "decoder.conv_in.weight": (512, 16, 3, 3)}),
    VAEProbe("Flux.2", {**_KL, "decoder.conv_in.weight": (512, 32, 3, 3), "post_quant_conv.weight": (32, 32, 1, 1),
                        "bn.running_mean": (128,)}),
    VAEProbe("HunyuanImage 2.1", {"decoder.conv_in.weight": (1024, 64, 3, 3)}),
    VAEProbe("HunyuanVideo 1.5", {"decoder.conv_in.weight": (1024, 32, 3, 3, 3)}, "video"),
    VAEProbe("HunyuanVideo 1.5 refiner", {"decoder.conv_in.conv.weight": (1024, 32, 3, 3, 3)}, "video"),
    VAEProbe("HunyuanVideo", {"decoder.conv_in.conv.weight": (512, 16, 3, 3, 3), "post_quant_conv.weight": (16, 16, 1, 1, 1)},
             "video"),
    VAEProbe("SVD (temporal decoder)", {**_KL, "decoder.mid.block_1.mix_factor": (1,)}),
    VAEProbe("TAESD", {"taesd_decoder.1.weight": (64, 4, 3, 3)}),
    VAEProbe("LTXV 0.9", {"decoder.up_blocks.0.res_blocks.0.conv1.conv.weight": (512, 512, 3, 3, 3)}, "video"),
    VAEProbe("LTXV 0.9.1-0.9.6", {"decoder.up_blocks.0.res_blocks.0.conv1.conv.weight": (1024, 1024, 3, 3, 3)}, "video",
             ltxv=1),
    VAEProbe("LTXV 0.9.7+/LTX-2 video", {"decoder.up_blocks.0.res_blocks.0.conv1.conv.weight": (1024, 1024, 3, 3, 3),
                                         "encoder.down_blocks.1.conv.conv.bias": (64,)}, "video", ltxv=2),
    VAEProbe("Wan 2.1/Qwen-Image", {"decoder.middle.0.residual.0.gamma": (384, 1, 1, 1), "decoder.head.0.gamma": (96, 1, 1, 1),
                                    "encoder.conv1.weight": (96, 3, 3, 3, 3), "decoder.head.2.weight": (3, 96, 3, 3, 3)}, "video"),
    VAEProbe("Wan 2.2", {"decoder.middle.0.residual.0.gamma": (1024, 1, 1, 1), "decoder.head.0.gamma": (256, 1, 1, 1),
                         "decoder.upsamples.0.upsamples.0.residual.2.weight": (1024, 1024, 3, 3, 3)}, "video"),
    VAEProbe("SeedVR2", {"decoder.up_blocks.2.upsamplers.0.upscale_conv.weight": (512, 128, 1, 1, 1)}, "video"),
    VAEProbe("Mochi", {"encoder.layers.4.layers.1.attn_block.attn.qkv.weight": (2304, 768),
                       "decoder.blocks.2.blocks.3.stack.5.weight": (256, 256, 3, 3, 3)}, "video"),
    VAEProbe("Cosmos", {"decoder.unpatcher3d.wavelets": (8,)}, "video"),
    VAEProbe("Stable Audio (Oobleck)", {"decoder.layers.1.layers.0.beta": (1, 2048, 1)}, "audio"),
    VAEProbe("LTX-2 audio", {"vocoder.resblocks.0.convs1.0.weight": (512, 512, 3)}, "audio",
             {"config": json.dumps({"audio_vae": {}, "vocoder": {}})}),  # the host's defaults (at test sizes)
    VAEProbe("SD x4 upscaler", {"decoder.conv_in.weight": (512, 4, 3, 3), "post_quant_conv.weight": (4, 4, 1, 1)}),
    VAEProbe("Stable Audio 48k (Oobleck)", {"decoder.layers.1.layers.0.beta": (1, 2048, 1),
                                            "decoder.layers.2.layers.1.weight_v": (1024, 2048, 12)}, "audio"),
    VAEProbe("MiniMax Music3 DAV", {"dec_in_proj.weight": (1, 1, 1), "decoder.model.0.weight_g": (1, 1, 1)}, "audio",
             no_encode="ComfyUI's VAE refuses to encode with it (a decoder: 'cannot encode audio')"),
    VAEProbe("Stable Cascade StageA", {"vquantizer.codebook.weight": (8192, 4)}),
    VAEProbe("Stable Cascade StageC effnet", {"backbone.1.0.block.0.1.num_batches_tracked": ()}),
    VAEProbe("Stable Cascade StageC previewer", {"blocks.11.num_batches_tracked": ()},
             no_encode="a previewer file holds only the decoder of Stage C's latents"),
    VAEProbe("Stable Cascade StageC (effnet+previewer)", {"encoder.backbone.1.0.block.0.1.num_batches_tracked": ()}),
    VAEProbe("Trellis2 shape", {"shape_dec.blocks.1.16.to_subdiv.weight": (1, 1)}),
    VAEProbe("Trellis2 texture", {"txt_dec.blocks.3.4.conv2.weight": (1, 1)}),
    VAEProbe("Mage-VAE", {"student.dconv_encoder.proj_out.weight": (1, 1)}),
    VAEProbe("LTX 2.4 (diffusion decoder)", {"decoder.conv_in_x_t.weight": (1, 1),
                                             "decoder.conv_in.weight": (2048, 128, 1, 1, 1)}, "video"),
    VAEProbe("CogVideoX", {"decoder.conv_in.conv.weight": (512, 16, 3, 3, 3), "encoder.conv_out.conv.weight": (32, 512, 3, 3, 3),
                           "decoder.mid_block.resnets.0.norm1.norm_layer.weight": (512,)}, "video"),
    VAEProbe("Hunyuan3D 2.0/2.1 ShapeVAE", {"geo_decoder.cross_attn_decoder.ln_1.bias": (1024,)},
             no_encode="ComfyUI only decodes its latents (its encode takes point clouds, no image or video)"),
    VAEProbe("ACE-Step MusicDCAE", {"vocoder.backbone.channel_layers.0.0.bias": (1,)}, "audio"),
    VAEProbe("pixel space", {"pixel_space_vae": ()}),
    VAEProbe("MMAudio", {"vocoder.activation_post.downsample.lowpass.filter": (1, 1, 12)}, "audio"),
    VAEProbe("LightTAE Wan 2.1 (taew)", {"decoder.22.bias": (3,), "decoder.1.weight": (64, 16, 3, 3)}, "video"),
    VAEProbe("TAE Wan 2.2/LTX-2", {"decoder.22.bias": (3,), "decoder.1.weight": (64, 48, 3, 3)}, "video"),
    VAEProbe("LightTAE HunyuanVideo 1.5", {"decoder.22.bias": (12,), "decoder.1.weight": (64, 32, 3, 3)}, "video"),
    VAEProbe("TAE MiniMax H3", {"decoder.22.bias": (12,), "decoder.1.weight": (64, 24, 3, 3)}, "video"),
    VAEProbe("Stable Audio 3", {"decoder.layers.3.transformers.0.pre_norm.alpha": (1,)}, "audio"),
    VAEProbe("Stable Audio 3 large", {"decoder.layers.3.transformers.0.pre_norm.alpha": (1,),
                                      "decoder.layers.3.transformers.11.self_attn.to_out.weight": (1, 1)}, "audio"),
    VAEProbe("MiniMax H3 video", {"decoder.transformer_blocks.0.scale1": (1,), "encoder.down.5.block.0.conv1.weight": (1, 1, 1, 1)},
             "video"),
    VAEProbe("MiniMax H3 audio", {"pre_block.attn.zero_k_bias": (1,)}, "audio"),
    VAEProbe("TripoSplat", {"gs.base_offset_scale": (1,), "octree.out_proj.weight": (1, 1)},
             no_encode="ComfyUI gives it no encode (its own decode node reads its gaussians)"),
)


# ---- test sizes -------------------------------------------------------------------------------------

def _hunyuan(a):
    """Hunyuan's VAEs at a 16th of their widths (32 at least; the widest stage keeps two latents' width,
    which their skip paths fold into the latent)."""
    widest = max(a["block_out_channels"])
    a["block_out_channels"] = [max(32, c // 16, 2 * a["z_channels"] if c == widest else 0) for c in a["block_out_channels"]]
    a["num_res_blocks"] = 1


def _fewer_blocks(blocks):
    """LTXV block lists with one layer per residual stage (the compressions stay)."""
    out = []
    for name, arg in blocks:
        if name.startswith("res_x") and isinstance(arg, int):
            arg = 1
        elif name.startswith("res_x") and isinstance(arg, dict) and "num_layers" in arg:
            arg = {**arg, "num_layers": 1}
        out.append([name, arg])
    return out


def _ltxv(a):
    model = a["self"]  # the host's defaults per version (get_default_config; guess_config on older hosts)
    default = getattr(model, "get_default_config", None) or model.guess_config
    config = dict(a["config"] or default(a["version"]))
    for key in ("encoder_blocks", "decoder_blocks", "blocks"):
        if key in config:
            config[key] = _fewer_blocks(config[key])
    a["config"] = config


def _ltx_audio(a):
    config = json.loads(json.dumps(a["config"] or a["self"].get_default_config()))
    params = config.setdefault("model", {}).setdefault("params", {})
    for key in ("ddconfig", "encoder", "decoder"):
        if key in params:
            params[key] = {**params[key], "ch": 16, "num_res_blocks": 1}
    a["config"] = config


def _vocoder(a):
    a["config"] = {**(a["config"] or {}), "upsample_initial_channel": 64}


def _ltx24(a):
    """LTX 2.4's VAE: one layer per encoder stage, its diffusion decoder at a 16th of its widths, one block a stage."""
    from comfy.ldm.lightricks.vae.na_diffusion_decoder import LTX_24_VAE_CONFIG

    config = json.loads(json.dumps(a["config"] or LTX_24_VAE_CONFIG))
    config["encoder"]["blocks"] = _fewer_blocks(config["encoder"]["blocks"])
    decoder = config["decoder"]
    decoder.update(head_dim=16, stage_channels=[c // 16 for c in decoder["stage_channels"]],
                   stage_depths=[1] * len(decoder["stage_depths"]), t_emb_dim=32)
    a["config"] = config


# (module, class, how its constructor's bound arguments shrink): ComfyUI's VAE model classes at test sizes
SIZES = (
    ("comfy.ldm.modules.diffusionmodules.model", "Encoder", lambda a: a.update(ch=32, num_res_blocks=1)),
    ("comfy.ldm.modules.diffusionmodules.model", "Decoder", lambda a: a.update(ch=32, num_res_blocks=1)),
    ("comfy.ldm.hunyuan_video.vae", "Encoder", _hunyuan),
    ("comfy.ldm.hunyuan_video.vae", "Decoder", _hunyuan),
    ("comfy.ldm.hunyuan_video.vae_refiner", "Encoder", _hunyuan),
    ("comfy.ldm.hunyuan_video.vae_refiner", "Decoder", _hunyuan),
    ("comfy.ldm.wan.vae", "WanVAE", lambda a: a.update(dim=8, num_res_blocks=1)),
    ("comfy.ldm.wan.vae2_2", "WanVAE", lambda a: a.update(dim=16, dec_dim=16, num_res_blocks=1)),
    ("comfy.ldm.lightricks.vae.causal_video_autoencoder", "VideoVAE", _ltxv),
    ("comfy.ldm.lightricks.vae.causal_video_autoencoder", "Encoder", lambda a: a.update(base_channels=16, norm_num_groups=8)),
    ("comfy.ldm.lightricks.vae.causal_video_autoencoder", "Decoder", lambda a: a.update(base_channels=16, norm_num_groups=8)),
    ("comfy.ldm.seedvr.vae", "VideoAutoencoderKL", lambda a: a.update(layers_per_block=1)),
    ("comfy.ldm.audio.autoencoder", "AudioOobleckVAE", lambda a: a.update(channels=16)),
    ("comfy.ldm.lightricks.vae.causal_audio_autoencoder", "CausalAudioAutoencoder", _ltx_audio),
    ("comfy.ldm.lightricks.vocoders.vocoder", "Vocoder", _vocoder),
    ("comfy.ldm.lightricks.vae.na_diffusion_decoder", "CausalDiffusionVAE", _ltx24),
    ("comfy.ldm.cascade.stage_a", "StageA", lambda a: a.update(c_hidden=32, bottleneck_blocks=1)),
    ("comfy.ldm.cascade.stage_c_coder", "Previewer", lambda a: a.update(c_hidden=32)),
    ("comfy.ldm.cogvideo.vae", "AutoencoderKLCogVideoX",
     lambda a: a.update(block_out_channels=(16, 32, 32, 64), layers_per_block=1, groups=8)),
    ("comfy.ldm.audio.vae_sa3", "SA3AudioVAE", lambda a: a.update(channels=32)),  # its depth tells its sizes apart
    ("comfy.ldm.minimax.audio_vae", "MiniMaxH3AudioVAE", lambda a: a.update(encoder_dim=8, latent_dim=64, decoder_dim=128)),
)
# Module constants a class reads while it builds, at test sizes
CONSTANTS = (("comfy.ldm.seedvr.vae", "BYTEDANCE_BLOCK_OUT_CHANNELS", (32, 32, 64, 64)),)


def _sized_init(init, shrink):
    @functools.wraps(init)
    def sized(self, *args, **kwargs):
        bound = inspect.signature(init).bind(self, *args, **kwargs)
        bound.apply_defaults()
        shrink(bound.arguments)
        return init(*bound.args, **bound.kwargs)
    return sized


@contextlib.contextmanager
def tiny_sizes():
    """While it is held, the VAE model classes of :data:`SIZES` build at test sizes (those this host has)."""
    import importlib

    restore = []
    try:
        for module, name, shrink in SIZES:
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):  # an older host
                continue
            restore.append((cls, "__init__", vars(cls)["__init__"]))
            cls.__init__ = _sized_init(vars(cls)["__init__"], shrink)
        for module, name, value in CONSTANTS:
            try:
                found = importlib.import_module(module)
            except ImportError:
                continue
            if hasattr(found, name):
                restore.append((found, name, getattr(found, name)))
                setattr(found, name, value)
        yield
    finally:
        for owner, name, value in reversed(restore):
            setattr(owner, name, value)


# ---- asking the host --------------------------------------------------------------------------------

class _Asked(Exception):
    def __init__(self, found):
        super().__init__("recorded")
        self.found = found


def _made(vae) -> str:
    """The model class a VAE holds, by ComfyUI module and name (an AutoencodingEngine by its encoder's too)."""
    model = vae.first_stage_model
    name = f"{type(model).__module__.removeprefix('comfy.')}.{type(model).__qualname__}"
    encoder = getattr(model, "encoder", None)
    if type(model).__qualname__ == "AutoencodingEngine" and encoder is not None:
        name += f"[{type(encoder).__module__.removeprefix('comfy.')}]"
    return name


def ask_vae(probe: VAEProbe, device=None):
    """The ``comfy.sd.VAE`` the host makes of ``probe`` at the sizes in force, stopped where it would load
    the weights (its model built on ``device``, ``meta`` by default: nothing allocated); None when the host
    detects no VAE in it."""
    import comfy.sd

    real = torch.nn.Module.load_state_dict

    def record(self, *args, **kwargs):
        raise _Asked(self)

    vae = comfy.sd.VAE.__new__(comfy.sd.VAE)
    torch.nn.Module.load_state_dict = record
    try:
        with torch.device(device or "meta"):
            comfy.sd.VAE.__init__(vae, sd=probe.sd(), metadata=probe.file_metadata())
    except _Asked:
        return vae
    finally:
        torch.nn.Module.load_state_dict = real
    return None


@functools.cache
def vae_classes() -> dict[str, tuple[str, str | None]]:
    """Per probe this host detects as a VAE: the class it builds, and why it is not built here (None: built)."""
    out = {}
    for probe in VAE_PROBES:
        try:
            with tiny_sizes():
                vae = ask_vae(probe)
        except Exception as exc:  # a class that computes while it builds (no meta tensors), a key the probe lacks
            out[probe.name] = ("?", f"not askable on meta tensors: {type(exc).__name__}: {exc}")
            continue
        if vae is None:
            continue
        total = sum(p.numel() for p in vae.first_stage_model.parameters())
        why = None if total <= MAX_PARAMETERS else f"{total / 1e6:.0f}M parameters at the test size (no test size for it)"
        if probe.no_encode is not None:
            why = f"no encode: {probe.no_encode}"
        out[probe.name] = (_made(vae), why)
    return out


def probe(name: str) -> VAEProbe:
    return next(p for p in VAE_PROBES if p.name == name)


def build_vae(name: str, seed: int = 0):
    """The real ``comfy.sd.VAE`` of probe ``name`` at test sizes, weights from ``seed``: the model ComfyUI
    builds from the probe, filled, and loaded back through ``comfy.sd.VAE`` from its state dict (which
    must detect the same class). NotImplementedError with the reason when it cannot be built here."""
    import comfy.sd

    found = vae_classes().get(name)
    if found is None:
        raise NotImplementedError("this host detects no VAE in its files")
    if found[1] is not None:
        raise NotImplementedError(found[1])
    with tiny_sizes():
        asked = ask_vae(probe(name), device="cpu")
        model = fill_weights(asked.first_stage_model, seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # latent statistics, rotary frequencies, zeros: buffers ComfyUI makes empty (a file holds
            for key, buf in sorted(model.named_buffers()):  # them; MiniMax's zero_k_bias left as it was read 1.9e38)
                if not buf.is_floating_point():
                    continue
                if "per_channel_statistics." in key or key.endswith(".inv_freq"):
                    buf.copy_(1.0 + torch.randn(buf.shape, generator=gen) * 0.02)
                elif key.rsplit(".", 1)[-1].startswith("zero"):
                    buf.zero_()
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        vae = comfy.sd.VAE(sd=sd, metadata=probe(name).file_metadata())
    if _made(vae) != found[0]:
        raise NotImplementedError(f"its test-size state dict is detected as {_made(vae)}")
    loaded = vae.first_stage_model.state_dict()
    if loaded.keys() != sd.keys() or not all(torch.equal(loaded[k].to(sd[k].dtype), sd[k]) for k in sd):
        raise NotImplementedError("its test-size weights do not load back as built")
    return vae


def media(name: str, seed: int = 0) -> torch.Tensor:
    """What the VAE of probe ``name`` encodes, as ComfyUI's encode nodes hand it over: an image
    ``[1, H, W, 3]``, video frames ``[T, H, W, 3]`` or audio ``[B, samples, channels]``."""
    gen = torch.Generator().manual_seed(seed)
    kind = probe(name).media
    if kind == "audio":
        return torch.rand(1, 2, 8192, generator=gen).sub(0.5).movedim(1, -1)
    return torch.rand(9 if kind == "video" else 1, 64, 64, 3, generator=gen)


# ---- CLIP vision ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VisionProbe:
    name: str
    keys: dict

    def sd(self) -> dict:
        return {k: _meta(*shape) for k, shape in self.keys.items()}


def _vit(layers: int, width: int, positions: int, patch: tuple = (3, 14, 14), **extra) -> dict:
    return {**{f"vision_model.encoder.layers.{i}.layer_norm1.weight": (width,) for i in range(layers)},
            "vision_model.embeddings.position_embedding.weight": (positions, width),
            "vision_model.embeddings.patch_embedding.weight": (width, *patch), **extra}


VISION_PROBES = (
    VisionProbe("ViT-L/14", _vit(24, 1024, 257)),
    VisionProbe("ViT-L/14 336", _vit(24, 1024, 577)),
    VisionProbe("ViT-L/14 336 LLaVA", _vit(24, 1024, 577, **{"multi_modal_projector.linear_1.bias": (4096,)})),
    VisionProbe("ViT-H/14", _vit(32, 1280, 257)),
    VisionProbe("ViT-bigG/14", _vit(48, 1664, 257)),
    VisionProbe("SigLIP 384 patch14", _vit(27, 1152, 729)),
    VisionProbe("SigLIP 512 patch16", _vit(27, 1152, 1024, (3, 16, 16))),
    VisionProbe("SigLIP2 NaFlex", _vit(27, 1152, 256, (768,))),
    VisionProbe("DINOv2 large", {"encoder.layer.23.layer_scale2.lambda1": (1024,)}),
    VisionProbe("DINOv2 giant", {"encoder.layer.39.layer_scale2.lambda1": (1536,)}),
    VisionProbe("DINOv3 ViT-H/16+", {"layer.0.mlp.gate_proj.weight": (5120, 1280), "layer.31.norm1.weight": (1280,)}),
    VisionProbe("DINOv3 large", {"layer.23.attention.o_proj.bias": (1024,)}),
)

TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 3,
               "projection_dim": 32}


def ask_vision(probe: VisionProbe) -> dict | None:
    """The config ComfyUI's CLIP-vision loader picks for ``probe`` (None: it detects none), unread weights."""
    import comfy.clip_vision

    real = comfy.clip_vision.ClipVisionModel

    def record(json_config):
        raise _Asked(json_config)

    comfy.clip_vision.ClipVisionModel = record
    try:
        comfy.clip_vision.load_clipvision_from_sd(probe.sd())
    except _Asked as asked:
        found = asked.found
        if isinstance(found, dict):
            return dict(found)
        with open(found) as f:
            return {**json.load(f), "_file": os.path.basename(found)}
    except Exception:  # a model this host's detection does not know (0.3.75 on SigLIP2's NaFlex file)
        return None
    finally:
        comfy.clip_vision.ClipVisionModel = real
    return None


def vision_classes() -> dict[str, str]:
    """Per probe this host detects: the config it picks (its file, or its model type)."""
    out = {}
    for p in VISION_PROBES:
        config = ask_vision(p)
        if config is not None:
            out[p.name] = config.get("_file") or config.get("model_type", "?")
    return out


def build_vision(name: str, seed: int = 0):
    """The host's ``ClipVisionModel`` of the config its loader picks for probe ``name``, at :data:`TINY_VISION`
    sizes (the fields the config has), weights from ``seed``."""
    config = ask_vision(next(p for p in VISION_PROBES if p.name == name))
    if config is None:
        raise NotImplementedError("this host detects no CLIP-vision model in its files")
    config.pop("_file", None)
    config.update({k: v for k, v in TINY_VISION.items() if k != "projection_dim" or k in config})  # no projection added
    return clip_vision_from_config(config, seed)


# ---- coverage: does a repeat hit? ------------------------------------------------------------------

def _encode_vae(vae, name: str):
    torch.manual_seed(0)  # an encode that samples (Stable Audio's bottleneck) draws the same noise each time
    return vae.encode(media(name))


def _encode_vision(model, name: str):
    return model.encode_image(media_image())


def media_image(seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(seed))


def host_encode_fails(model, name: str, kind: str) -> str | None:
    """Why ComfyUI's own encode of this model fails (run with the pack's routing as it is), or None.
    (ComfyUI 0.33's ``ClipVisionModel.encode_image`` reads a penultimate layer DINOv3 does not give.)"""
    try:
        (_encode_vae if kind == "vae" else _encode_vision)(model, name)
    except Exception as exc:
        return f"ComfyUI's own encode fails: {type(exc).__name__}: {exc}"
    return None


def hit_status(kind: str, name: str) -> str:
    """Builds the ``kind`` ("vae" or "vision") of probe ``name`` and encodes twice with the conditioning
    cache on (global mode; the cache emptied first): "hit" when the repeat is a hit bit-identical to
    encoding with the pack off; else why it bypassed, or why it was not built here."""
    from .lazy_clip import _pack_module

    cache = _pack_module("caching.conditioning").CACHE
    settings = _pack_module("caching.settings").SETTINGS
    try:
        model = build_vae(name) if kind == "vae" else build_vision(name)
    except NotImplementedError as exc:
        return f"not built here: {exc}"
    encode = _encode_vae if kind == "vae" else _encode_vision
    before = settings.get("conditioning.enabled")
    try:
        with torch.inference_mode():
            settings.set("conditioning.enabled", False)
            why = host_encode_fails(model, name, kind)
            if why is not None:
                return f"not encodable here: {why}"
            reference = encode(model, name)
            settings.set("conditioning.enabled", True)
            cache.clear()
            cache.reset_counts()
            encode(model, name)
            second = encode(model, name)
    finally:
        settings.set("conditioning.enabled", before)
    reasons = cache.bypass_reasons()
    if reasons:
        return "bypass: " + "; ".join(r["reason"] for r in reasons)
    if cache.count("hits") == 1 and same_output(second, reference):
        return "hit"
    return f"no hit ({cache.count('hits')} hits, equal to ComfyUI: {same_output(second, reference)})"
