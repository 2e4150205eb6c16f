"""Test helpers for the conditioning cache: tiny LoRA files for the tiny CLIP (and Flux), and a
loader node that keeps its models between prompts (as a model manager would), so that cache modes
that re-run loaders (ComfyUI's --cache-none) still hand the same encoder instance to the graph."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

_LORA_DIR: str | None = None


def lora_dir() -> str:
    """A temporary folder registered with ComfyUI as a "loras" folder."""
    global _LORA_DIR
    if _LORA_DIR is None:
        import folder_paths

        _LORA_DIR = tempfile.mkdtemp(prefix="rk_loras_")
        atexit.register(shutil.rmtree, _LORA_DIR, True)
        folder_paths.add_model_folder_path("loras", _LORA_DIR)
    return _LORA_DIR


def write_lora(name: str, seed: int = 0, rank: int = 4, layers: int = 2, width: int = 32,
               flux: bool = True) -> str:
    """Write a LoRA for the tiny CLIP's attention projections (and the tiny Flux's first img qkv);
    returns the file name LoraLoader takes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            base = f"text_encoders.clip_l.transformer.text_model.encoder.layers.{layer}.self_attn.{proj}"
            sd[f"{base}.lora_up.weight"] = torch.randn(width, rank, generator=gen) * 0.1
            sd[f"{base}.lora_down.weight"] = torch.randn(rank, width, generator=gen) * 0.1
    if flux:
        base = "diffusion_model.double_blocks.0.img_attn.qkv"
        sd[f"{base}.lora_up.weight"] = torch.randn(192, rank, generator=gen) * 0.1
        sd[f"{base}.lora_down.weight"] = torch.randn(rank, 64, generator=gen) * 0.1
    path = os.path.join(lora_dir(), name)
    save_file(sd, path)
    return name


def tiny_wan_vae(seed: int = 0):
    """A real ``comfy.sd.VAE`` around a small Wan 2.1 video VAE (width 8, 16 latent channels), loaded
    from its state dict as ComfyUI detects it."""
    import comfy.ldm.wan.vae
    import comfy.sd

    from . import fill_weights

    model = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                     temperal_downsample=[False, True, True], dropout=0.0)
    return comfy.sd.VAE(sd=fill_weights(model, seed).state_dict())


_SHARED: dict = {}

CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
          "num_hidden_layers": 12, "projection_dim": 768}


CLIP_MID = {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
            "num_hidden_layers": 2, "projection_dim": 128}  # its MLP weights are larger than the cheap check reads whole


def clip_l_sized(seed: int = 0, config: dict = CLIP_L):
    """A real ``comfy.sd.CLIP`` at CLIP-L size (768 wide, 12 layers, ~123M parameters; or ``config``),
    random weights, float32 (fp16 matmuls on a CPU would make every number here meaningless)."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models_base

    from . import fill_weights

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = comfy.sd.CLIP(target=target, model_options={"clip_l_model_config": dict(config), "dtype": torch.float32})
    fill_weights(clip.cond_stage_model, seed)
    return clip


class RKTestSharedTinyCheckpoint:
    """Like RKTestTinyCheckpoint, but returns the same objects for the same family and seed."""

    @classmethod
    def INPUT_TYPES(cls):
        from . import FAMILIES

        return {"required": {"family": (list(FAMILIES),), "seed": ("INT", {"default": 0, "min": 0}),
                             "text": (["tiny", "clip_l"],)}}

    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, family, seed, text="tiny"):
        from . import BUILDERS, tiny_clip, tiny_vae

        key = (family, seed, text)
        if key not in _SHARED:
            if text == "clip_l":
                dims = {"flux": {"context_in_dim": 768, "vec_in_dim": 768}, "wan": {"text_dim": 768}}[family]
                _SHARED[key] = (BUILDERS[family](seed, **dims), clip_l_sized(seed), tiny_vae(seed))
            else:
                _SHARED[key] = (BUILDERS[family](seed), tiny_clip(seed), tiny_vae(seed))
        return _SHARED[key]


CLIP_HEADS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 16,
              "num_hidden_layers": 2, "projection_dim": 256}  # heads of 16: most miss every sampled position


def write_tiny_clip_file(folder: str, seed: int = 0, config: dict | None = None) -> str:
    """The tiny CLIP's weights at ``seed`` (or a CLIP-L-class one of ``config``) as a safetensors file in
    ``folder`` (its full state dict)."""
    from safetensors.torch import save_file

    from . import tiny_clip

    clip = tiny_clip(seed) if config is None else clip_l_sized(seed, config)
    path = os.path.join(folder, f"tiny_clip_{seed}{'' if config is None else '_' + str(config['hidden_size'])}.safetensors")
    sd = {k: v.detach().contiguous().clone() for k, v in clip.cond_stage_model.state_dict().items()}
    save_file(sd, path)
    return path


def _pack_module(name: str):
    """A module of the ReuseKit pack as this process loaded it (ComfyUI names it by its folder)."""
    root = Path(__file__).resolve().parents[2]
    target = root / Path(*name.split("."))
    for module in list(sys.modules.values()):
        found = getattr(module, "__file__", None)
        if found and Path(found).resolve() == target.with_suffix(".py"):
            return module
    raise RuntimeError(f"the ReuseKit pack's {name} is not loaded")


def load_tiny_clip_file(path: str, config: dict | None = None):
    """A real ``comfy.sd.CLIP`` at the tiny CLIP's shape (or ``config``'s, in float32) with its weights
    loaded from ``path`` through ``CLIP.load_sd`` (as ComfyUI's loaders do), recorded as coming from that
    file (a custom loader registering its source with ReuseKit)."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models_base
    import comfy.utils

    from . import _SHAPES

    shape = dict(_SHAPES.CLIP_CONFIG if config is None else config)
    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    options = {"clip_l_model_config": shape, **({} if config is None else {"dtype": torch.float32})}
    clip = comfy.sd.CLIP(target=target, model_options=options)
    missing, unexpected = clip.load_sd(comfy.utils.load_torch_file(path, safe_load=True), full_model=True)
    if missing or unexpected:
        raise RuntimeError(f"{path}: missing {missing}, unexpected {unexpected}")
    _pack_module("patches.conditioning").register_source(clip, [path], "rk_tinymodels.load_tiny_clip_file", shape)
    return clip


def unsampled_head(clip) -> tuple[torch.Tensor, slice]:
    """An attention projection of a CLIP-L-class encoder and one of its heads (rows) that holds none of
    the positions the cheap edit check samples (its rows): zeroing it is an edit only a full fingerprint
    sees."""
    weight_edits = _pack_module("caching.weight_edits")
    model = clip.cond_stage_model.clip_l.transformer.text_model
    heads = model.encoder.layers[0].self_attn.heads
    for layer in model.encoder.layers:
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w = getattr(layer.self_attn, proj).weight
            if w.numel() * w.element_size() <= weight_edits.SMALL:
                continue
            rows = w.shape[0] // heads
            hit = {int(p) // w.shape[1] // rows for p in weight_edits._positions(w.numel())}
            free = [h for h in range(heads) if h not in hit]
            if free:
                return w, slice(free[0] * rows, (free[0] + 1) * rows)
    raise RuntimeError("every head of every projection holds a sampled position")


_FILE_CLIPS: dict = {}


class RKTestFileCLIP:
    """The tiny CLIP loaded from a weights file (kept between prompts, as a model manager would); ``heads``:
    a file of :data:`CLIP_HEADS`'s shape."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"path": ("STRING", {"default": ""})}, "optional": {"heads": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, path, heads=False):
        if path not in _FILE_CLIPS:
            _FILE_CLIPS[path] = load_tiny_clip_file(path, CLIP_HEADS if heads else None)
        return (_FILE_CLIPS[path],)


class RKTestSaveConditioning:
    """Writes a conditioning's first tensor and pooled output (if any) to a safetensors file (bit-exact checks)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",), "path": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "ReuseKit tests"

    def save(self, conditioning, path):
        from safetensors.torch import save_file

        cond, extra = conditioning[0]
        pooled = extra.get("pooled_output")  # LLM encoders give none
        save_file({"cond": cond.contiguous(), **({} if pooled is None else {"pooled": pooled.contiguous()})}, path)
        return {}


EDITS = ("dense", "embedding_row", "small", "sparse", "head")


def edit_weights(clip, what: str, text: str = "") -> None:
    """Edit a CLIP's weights in place, as a custom node might (inference tensors, outside the patcher):
    ``dense``: scale the first large MLP weight (or the token embedding); ``embedding_row``: one row of
    the token embedding that ``text`` reads; ``small``: one value of the final layer norm; ``sparse``:
    one value of the first MLP weight away from the positions the cheap check samples; ``head``: halve
    one attention head that holds none of them (:func:`unsampled_head`, a :data:`CLIP_HEADS` encoder)."""
    weight_edits = _pack_module("caching.weight_edits")
    model = clip.cond_stage_model.clip_l.transformer.text_model
    mlp = model.encoder.layers[0].mlp.fc1.weight
    with torch.inference_mode():
        if what == "dense":
            target = mlp if mlp.numel() * mlp.element_size() > weight_edits.SMALL else model.embeddings.token_embedding.weight
            target.mul_(1.5)
        elif what == "embedding_row":
            row = clip.tokenize(text)["l"][0][1][0]  # the first word's token (after the start token)
            model.embeddings.token_embedding.weight[row, 0] += 1.0
        elif what == "small":
            model.final_layer_norm.weight[0] += 1.0
        elif what == "head":
            weight, rows = unsampled_head(clip)
            weight[rows] *= 0.5
        elif what == "sparse":
            sampled = set(weight_edits._positions(mlp.numel()).tolist())
            flat = mlp.view(-1)
            at = next(i for i in range(mlp.numel()) if i not in sampled)
            flat[at] += 1.0
        else:
            raise ValueError(f"unknown edit {what!r}")


class RKTestEditEncoder:
    """Edits a CLIP's weights in place after ``after`` ran (ordering) and passes the CLIP on."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP",), "what": (list(EDITS),), "text": ("STRING", {"default": ""}),
                             "after": ("CONDITIONING",)}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "edit"
    CATEGORY = "ReuseKit tests"

    def edit(self, clip, what, text, after):
        edit_weights(clip, what, text)
        return (clip,)


class RKTestEncodeEditEncode:
    """Inside one node: encode ``text``, edit the CLIP's weights in place, encode it again."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP",), "text": ("STRING", {"default": ""}), "what": (list(EDITS),)}}

    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    FUNCTION = "run"
    CATEGORY = "ReuseKit tests"

    def run(self, clip, text, what):
        import nodes

        (before,) = nodes.CLIPTextEncode().encode(clip, text)
        edit_weights(clip, what, text)
        (after,) = nodes.CLIPTextEncode().encode(clip, text)
        return (before, after)


_SIZED: dict = {}


class RKTestSizedCLIP:
    """A CLIP of the ``CLIP_MID`` shape (kept per seed and name, as a model manager would)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0}), "name": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, seed, name):
        key = (seed, name)
        if key not in _SIZED:
            _SIZED[key] = clip_l_sized(seed, CLIP_MID)
        return (_SIZED[key],)


NODE_CLASS_MAPPINGS = {"RKTestSharedTinyCheckpoint": RKTestSharedTinyCheckpoint, "RKTestFileCLIP": RKTestFileCLIP,
                       "RKTestSaveConditioning": RKTestSaveConditioning, "RKTestEditEncoder": RKTestEditEncoder,
                       "RKTestEncodeEditEncode": RKTestEncodeEditEncode, "RKTestSizedCLIP": RKTestSizedCLIP}
