"""Test helpers for lazy text encoders: the tiny CLIP as a CLIP-L-format file (the keys of a real
``clip_l.safetensors``, so ComfyUI's own ``load_clip`` detects and loads it, sized by a ``model_config``
option), and test nodes that load it as ReuseKit Lazy CLIP Loader does, probe a lazy encoder and encode
a reference with the cache off."""

from __future__ import annotations

import functools
import json
import os
import tempfile

import torch

from . import conditioning

_pack_module = functools.cache(conditioning._pack_module)  # a walk of every loaded module: once per name

ENV_DIR = "RK_LAZY_CLIP_DIR"  # where RKTestLazyTinyCLIP keeps its files (shared by the servers of a test)


T5_CONFIG = {"d_ff": 64, "d_kv": 16, "d_model": 32, "num_heads": 2, "num_layers": 2}  # a tiny T5-XXL


def tiny_options() -> dict:
    """``model_options`` that size ComfyUI's CLIP-L to the tiny CLIP (through its long-CLIP detection) and
    its T5-XXL to :data:`T5_CONFIG`."""
    from . import _SHAPES

    return {"model_config": dict(_SHAPES.CLIP_CONFIG), "t5xxl_model_config": dict(T5_CONFIG)}


def write_tiny_t5(folder: str, seed: int = 0) -> str:
    """A tiny T5-XXL (ComfyUI's own T5XXLModel at :data:`T5_CONFIG`, seeded weights) as a t5xxl-format file."""
    import comfy.text_encoders.sd3_clip
    from safetensors.torch import save_file

    from . import fill_weights

    path = os.path.join(folder, f"tiny_t5xxl_{seed}.safetensors")
    if not os.path.exists(path):
        model = comfy.text_encoders.sd3_clip.T5XXLModel(device="cpu", dtype=torch.float32,
                                                        model_options={"t5xxl_model_config": dict(T5_CONFIG)})
        fill_weights(model, seed)
        save_file({k: v.detach().contiguous() for k, v in model.transformer.state_dict().items()}, path)
    return path


def write_tiny_clip_l(folder: str, seed: int = 0, name: str | None = None, overwrite: bool = False) -> str:
    """The tiny CLIP's text transformer at ``seed`` as a CLIP-L-format safetensors file in ``folder``."""
    from safetensors.torch import save_file

    from . import tiny_clip

    path = os.path.join(folder, name or f"tiny_clip_l_{seed}.safetensors")
    if overwrite or not os.path.exists(path):
        model = tiny_clip(seed).cond_stage_model.clip_l.transformer
        tmp = f"{path}.{os.getpid()}.tmp"
        save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, path)
    return path


def load(path, lazy: bool = True, clip_type: str = "stable_diffusion"):
    """Tiny encoder files (a path, or a list: Dual / Triple) through ComfyUI's ``comfy.sd.load_clip``,
    lazily as the Lazy CLIP Loader nodes do (and marked like their output), or as ComfyUI loads them."""
    import comfy.sd

    lazy_clip = _pack_module("patches.lazy_clip")
    conditioning = _pack_module("patches.conditioning")
    paths = [path] if isinstance(path, str) else list(path)
    kind = getattr(comfy.sd.CLIPType, clip_type.upper())
    if not lazy:
        return comfy.sd.load_clip(paths, clip_type=kind, model_options=tiny_options())
    conditioning.install()
    with lazy_clip.lazily():
        clip = comfy.sd.load_clip(paths, clip_type=kind, model_options=tiny_options())
    conditioning.mark(clip.patcher)
    return clip


class RKTestLazyCLIPFile:
    """A tiny CLIP-L file loaded lazily (or as ComfyUI loads it)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": ""}), "lazy": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "run"
    CATEGORY = "ReuseKit tests"

    def run(self, path, lazy=True):
        return (load(path, lazy),)


class RKTestLazyTinyCLIP:
    """Stands in for ReuseKit Lazy CLIP Loader in the example workflows: the tiny CLIP at ``seed`` as a
    CLIP-L file (in $RK_LAZY_CLIP_DIR, else a temporary folder), loaded lazily."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "run"
    CATEGORY = "ReuseKit tests"

    def run(self, seed):
        folder = os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), f"rk_lazy_clip_{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        return (load(write_tiny_clip_l(folder, seed)),)


def probe(clip, path: str) -> dict:
    """What a lazy encoder holds: whether it still waits for its weights, how many of its tensors have
    storage and how many bytes they hold, whether the file is mapped into this process, and how many
    bytes this process read to hash files. ``stored_weight_bytes``: of the stored bytes, those of tensors
    larger than the scalars a loader reads for its own sake."""
    lazy_clip = _pack_module("patches.lazy_clip")
    tiers = _pack_module("caching.tiers")
    module = clip.cond_stage_model
    weights = [*module.parameters(), *module.buffers()]
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            mapped = any(line.rstrip().endswith(real) for line in f)
    except OSError:
        mapped = None
    stored = [t for t in weights if not t.is_meta]
    return {"pending": lazy_clip.pending(module), "weights": len(weights), "stored": len(stored),
            "stored_bytes": sum(t.numel() * t.element_size() for t in stored),
            # weights read beyond the scalars a loader reads for its own sake (logit_scale...)
            "stored_weight_bytes": sum(t.numel() * t.element_size() for t in stored if t.numel() > lazy_clip.SMALL_NUMEL),
            "mapped": mapped,
            "hashed_bytes": tiers.TIERS.hashes.hashed_bytes}


class RKTestLazyProbe:
    """Writes :func:`probe` of a CLIP as JSON to ``out`` (after ``after`` ran)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP",), "after": ("CONDITIONING",), "path": ("STRING", {"default": ""}),
                             "out": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "ReuseKit tests"

    def run(self, clip, after, path, out):
        with open(out, "w") as f:
            json.dump(probe(clip, path), f)
        return {}


def reference(path, text: str, lora: dict | None = None, strength: float = 1.0, clip_type: str = "stable_diffusion"):
    """(cond, pooled) of ``text`` by the file(s) loaded as ComfyUI loads them, encoded with the cache off."""
    import comfy.sd

    settings = _pack_module("caching.settings").SETTINGS
    clip = load(path, lazy=False, clip_type=clip_type)
    if lora is not None:
        _, clip = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", False)
    try:
        with torch.inference_mode():
            return clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
    finally:
        settings.set("conditioning.enabled", before)


class RKTestEagerReference:
    """Saves :func:`reference` of ``text`` as a safetensors file (``cond``, ``pooled``) at ``out``."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": ""}), "text": ("STRING", {"default": ""}),
                             "out": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "ReuseKit tests"

    def run(self, path, text, out):
        from safetensors.torch import save_file

        cond, pooled = reference(path, text)
        save_file({"cond": cond.contiguous(), "pooled": pooled.contiguous()}, out)
        return {}


NODE_CLASS_MAPPINGS = {"RKTestLazyCLIPFile": RKTestLazyCLIPFile, "RKTestLazyTinyCLIP": RKTestLazyTinyCLIP,
                       "RKTestLazyProbe": RKTestLazyProbe, "RKTestEagerReference": RKTestEagerReference}
