"""Tiny text encoders of every kind the host's text-encoder loaders build, from the host's own classes.

Which classes: ComfyUI's own ``comfy.sd.load_text_encoder_state_dicts`` (behind CLIPLoader,
DualCLIPLoader, TripleCLIPLoader and QuadrupleCLIPLoader) picks them. :func:`loader_targets` calls it
for each loader type with probe files: per text-encoder model, the few keys and shapes its detection
reads (``meta`` tensors, so nothing is allocated). ``comfy.sd.CLIP`` is answered, while it runs, by
recording the target, tokenizer data and options it was asked to build, so nothing loads.

Building (:func:`build`): ``comfy.sd.CLIP(target)`` with the host's tokenizers, while ``SDClipModel``
is given test-only small sizes for the architecture it builds (CLIP, T5, the LLMs' config dataclasses,
with enough layers for the layers it reads) and the vision towers inside LLMs (Qwen2-VL's, Gemma 3's SigLIP) a small width and depth. Every
weight is then filled from a seeded generator. A tokenizer that ComfyUI reads from inside the checkpoint
(Gemma's and UMT5's sentencepiece models) is a tiny sentencepiece model trained here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools

import torch

from . import _SHAPES, fill_weights, same_output
from .lazy_clip import T5_CONFIG, RKTestLazyCLIPFile, load

TINY_LLM = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1}
TINY_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_layers": 2}  # Qwen2-VL's tower
TINY_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}  # Gemma 3's
TINY_QWEN35_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "depth": 2}  # Qwen3.5's and Qwen3-VL's


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _llm(width: int, layers: int = 1, q_norm: bool = False, k_bias: int | None = None, kv: int = 1024,
         gemma: bool = False) -> dict:
    """What detection reads of a Llama-style checkpoint: the norms' width, the layer count, q_norm, biases."""
    sd = {"model.layers.0.self_attn.k_proj.weight": _meta(kv, width),
          f"model.layers.{layers - 1}.post_attention_layernorm.weight": _meta(width),
          "model.layers.0.post_attention_layernorm.weight": _meta(width)}
    if q_norm:
        sd[f"model.layers.{layers - 1}.self_attn.q_norm.weight"] = _meta(128)
        sd["model.layers.0.self_attn.q_norm.weight"] = _meta(128)
    if k_bias is not None:
        sd["model.layers.0.self_attn.k_proj.bias"] = _meta(k_bias)
    if gemma:
        sd["model.layers.0.post_feedforward_layernorm.weight"] = _meta(width)
    return sd


# The text-encoder models whose files the loaders detect, by ComfyUI's TEModel name: what detection reads
PROBES = {
    "CLIP_L": lambda: {"text_model.encoder.layers.0.mlp.fc1.weight": _meta(3072, 768)},
    "CLIP_G": lambda: {"text_model.encoder.layers.30.mlp.fc1.weight": _meta(5120, 1280),
                       "text_model.encoder.layers.0.mlp.fc1.weight": _meta(5120, 1280)},
    "T5_XXL": lambda: {"encoder.block.23.layer.1.DenseReluDense.wi_1.weight": _meta(10240, 4096),
                       "encoder.block.0.layer.0.SelfAttention.k.weight": _meta(4096, 4096)},
    "QWEN25_7B": lambda: _llm(3584, k_bias=512, kv=512),
    "QWEN25_3B": lambda: _llm(2048, k_bias=256, kv=256),
    "QWEN3_06B": lambda: _llm(1024, q_norm=True),
    "QWEN3_4B": lambda: _llm(2560, layers=36, q_norm=True),
    "QWEN3_8B": lambda: _llm(4096, layers=36, q_norm=True),
    "LLAMA3_8": lambda: _llm(4096, layers=32),
    "MISTRAL3_24B": lambda: _llm(5120, layers=40),
    "GEMMA_2_2B": lambda: _llm(2304, layers=26, gemma=True),
    "GEMMA_3_4B": lambda: _llm(2560, layers=34, q_norm=True, gemma=True),
    "GEMMA_3_12B": lambda: {**_llm(3840, layers=48, q_norm=True, gemma=True),
                            "model.layers.5.self_attn.v_proj.weight": _meta(2048, 3840)},  # not Gemma 4's shared K/V
    "GEMMA_4_E2B": lambda: _llm(1536, layers=35, q_norm=True, gemma=True),
    "GEMMA_4_E4B": lambda: _llm(2560, layers=42, q_norm=True, gemma=True),
    "QWEN3VL_4B": lambda: {**_llm(2560, layers=36, q_norm=True), "model.visual.deepstack_merger_list.0.norm.weight": _meta(4096),
                           "model.visual.merger.linear_fc2.weight": _meta(2560, 4096)},
    "QWEN3VL_8B": lambda: {**_llm(4096, layers=36, q_norm=True), "model.visual.deepstack_merger_list.0.norm.weight": _meta(4608),
                           "model.visual.merger.linear_fc2.weight": _meta(4096, 4608)},
    "QWEN35_2B": lambda: {"model.language_model.layers.0.linear_attn.A_log": _meta(16),
                          "model.language_model.layers.0.input_layernorm.weight": _meta(2048)},
    "QWEN35_4B": lambda: {"model.language_model.layers.0.linear_attn.A_log": _meta(32),
                          "model.language_model.layers.0.input_layernorm.weight": _meta(2560)},
    "QWEN35_9B": lambda: {"model.language_model.layers.0.linear_attn.A_log": _meta(32),
                          "model.language_model.layers.0.input_layernorm.weight": _meta(4096)},
    "BYT5_SMALL_GLYPH": lambda: {"encoder.block.0.layer.0.SelfAttention.k.weight": _meta(384, 1472)},
    "T5_BASE": lambda: {"encoder.block.0.layer.0.SelfAttention.k.weight": _meta(768, 768)},
}

# Text-encoder files by name, as ComfyUI's templates name them, to the model they hold (the probes above)
FILE_MODELS = ((r"umt5|t5xxl", "T5_XXL"), (r"^clip_l", "CLIP_L"), (r"^clip_g", "CLIP_G"), (r"^qwen_2\.5_vl", "QWEN25_7B"),
               (r"^qwen_3_4b|^qwen_4b_ace15", "QWEN3_4B"), (r"^qwen_3_8b", "QWEN3_8B"),
               (r"^qwen_3_06b|^qwen_0\.6b", "QWEN3_06B"), (r"^gemma_3_12b", "GEMMA_3_12B"), (r"^gemma_3_4b", "GEMMA_3_4B"),
               (r"^gemma_2_2b", "GEMMA_2_2B"), (r"^mistral_3_small", "MISTRAL3_24B"),
               (r"^llama_3\.1_8b|^llava_llama3", "LLAMA3_8"), (r"^gemma4_e2b", "GEMMA_4_E2B"), (r"^gemma4_e4b", "GEMMA_4_E4B"),
               (r"^qwen3vl_4b", "QWEN3VL_4B"), (r"^qwen3vl_8b", "QWEN3VL_8B"), (r"^qwen3\.5_2b", "QWEN35_2B"),
               (r"^qwen3\.5_4b", "QWEN35_4B"), (r"^qwen3\.5_9b", "QWEN35_9B"), (r"^byt5_small_glyph", "BYT5_SMALL_GLYPH"),
               (r"^t5-base", "T5_BASE"))


def file_model(name: str) -> str | None:
    """The probe of the model a text-encoder file holds, by its name (None: a model the tests do not probe)."""
    import re

    return next((model for pattern, model in FILE_MODELS if re.search(pattern, name, re.IGNORECASE)), None)


def probes() -> dict[str, dict]:
    """The probes this host detects as the model they are named after (older hosts know fewer)."""
    import comfy.sd

    out = {}
    for name, make in PROBES.items():
        want = getattr(comfy.sd.TEModel, name, None)
        sd = make()
        if want is not None and comfy.sd.detect_te_model(sd) == want:
            out[name] = sd
    return out


class _Asked(Exception):
    def __init__(self, target, kwargs):
        super().__init__("recorded")
        self.target, self.kwargs = target, kwargs


@dataclasses.dataclass
class Target:
    """One encoder a loader builds: ComfyUI's target (text-encoder class, tokenizer, params), the tokenizer
    data and model options the loader passes, and where it was seen (loader, type, probe files)."""

    clip: type
    tokenizer: type
    params: dict
    tokenizer_data: dict
    model_options: dict
    seen: list = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.clip.__module__.rpartition('.')[2]}.{self.clip.__name__}"

    def signature(self) -> tuple:
        """What makes two targets the same encoder: classes by where they are defined, the values the
        class factories captured (dtypes, model types), params and tokenizer-data keys."""
        def captured(cls):
            init = vars(cls).get("__init__")
            cells = getattr(init, "__closure__", None) or ()
            return tuple(repr(c.cell_contents) for c in cells if not callable(c.cell_contents))

        return (self.clip.__module__, self.clip.__qualname__, captured(self.clip), self.tokenizer.__module__,
                self.tokenizer.__qualname__, repr(sorted(self.params.items())), tuple(sorted(self.tokenizer_data)))


LOADERS = {"CLIPLoader": 1, "DualCLIPLoader": 2, "TripleCLIPLoader": 3, "QuadrupleCLIPLoader": 4}


def loader_types(loader: str) -> list[str]:
    """The types a loader node offers on this host ([] when the host has no such loader, or it has no type)."""
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS.get(loader)
    if cls is None:
        return []
    required = cls.INPUT_TYPES()["required"]
    return list(required["type"][0]) if "type" in required else [""]


def ask(clip_type: str, files: list[dict]) -> Target | None:
    """What ComfyUI's loader builds from ``files`` as ``clip_type`` (None when it builds nothing)."""
    import comfy.sd

    kind = getattr(comfy.sd.CLIPType, clip_type.upper(), comfy.sd.CLIPType.STABLE_DIFFUSION) if clip_type else \
        comfy.sd.CLIPType.STABLE_DIFFUSION
    real = comfy.sd.CLIP

    def record(target=None, **kwargs):
        raise _Asked(target, kwargs)

    comfy.sd.CLIP = record
    try:
        comfy.sd.load_text_encoder_state_dicts([dict(f) for f in files], clip_type=kind, model_options={})
    except _Asked as asked:
        t, kw = asked.target, asked.kwargs
        if getattr(t, "clip", None) is None or getattr(t, "tokenizer", None) is None:
            return None
        return Target(t.clip, t.tokenizer, dict(getattr(t, "params", {}) or {}),
                      dict(kw.get("tokenizer_data") or {}),
                      dict(kw.get("model_options") or {}))
    except Exception:  # a combination the loader does not take (a key it needs is not in the probes)
        return None
    finally:
        comfy.sd.CLIP = real
    return None


@functools.cache
def loader_targets() -> dict[tuple, Target]:
    """Every encoder the host's text-encoder loaders build from the probe files, by :meth:`Target.signature`,
    each with the (loader, type, probes) that build it."""
    found: dict[tuple, Target] = {}
    files = probes()
    for loader, n in LOADERS.items():
        for clip_type in loader_types(loader):
            for combo in itertools.combinations(sorted(files), n):
                target = ask(clip_type, [files[name] for name in combo])
                if target is None:
                    continue
                target = found.setdefault(target.signature(), target)
                target.seen.append((loader, clip_type, combo))
    return found


# ---- building --------------------------------------------------------------------------------------

@functools.cache
def spiece_model() -> bytes:
    """A tiny sentencepiece model (what Gemma and UMT5 checkpoints carry inside as ``spiece_model``)."""
    import sentencepiece

    text = ["a photo of a cat sitting on a red chair", "a dog running in the snow under a blue sky",
            "<start_of_turn>user describe the image<end_of_turn> <start_of_turn>model",
            "You are an assistant designed to generate superior images with the superior degree of image-text alignment",
            "the quick brown fox jumps over the lazy dog", "make the sky green and add a small house"] * 8
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=out, vocab_size=120,
                                             model_type="bpe", character_coverage=1.0, pad_id=0, unk_id=3,
                                             bos_id=2, eos_id=1, minloglevel=2)
    return out.getvalue()


TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPECIAL = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                  "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]")


@functools.cache
def tekken_model() -> bytes:
    """A tiny Mistral tekken tokenizer JSON (what Mistral checkpoints carry inside as ``tekken_model``): the
    real file's layout and special tokens, every byte and a few merges as its vocabulary."""
    import base64
    import json

    words = [bytes([b]) for b in range(256)] + [b"th", b"the", b" a", b"ca", b"cat", b"at", b" c", b" the"]
    specials = [*TEKKEN_SPECIAL, *(f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIAL), 1000))]
    return json.dumps({
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": len(words) + len(specials),
                   "default_vocab_size": len(words) + len(specials), "default_num_special_tokens": len(specials),
                   "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(w).decode(), "token_str": None} for i, w in enumerate(words)],
        "special_tokens": [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(specials)],
    }).encode()


@functools.cache
def tokenizer_json() -> bytes:
    """A tiny Hugging Face ``tokenizers`` JSON (what Gemma 4 and GPT-OSS checkpoints carry inside as
    ``tokenizer_json``): a byte-level BPE trained here, with Gemma's turn markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|turn>", "<turn|>",
                "<|image|>", "<|audio|>", "<image_soft_token>", "<audio_soft_token>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["a photo of a cat sitting on a red chair", "a dog running in the snow under a blue sky",
            "make the sky green and add a small house", "the quick brown fox jumps over the lazy dog"] * 8
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer.to_str().encode()


# Tokenizer files a checkpoint carries inside, and where the tests get a tiny one
CHECKPOINT_TOKENIZERS = {"spiece_model": spiece_model, "tekken_model": tekken_model, "tokenizer_json": tokenizer_json}


def _config_class(model_class):
    """The config dataclass ``model_class`` builds from its config dict (LLMs, Jina's XLM-RoBERTa), or None: a
    ``...Config`` its ``__init__`` (or a base class's) names, or one of a ``...CONFIGS`` table by its model_type."""
    import sys

    for cls in model_class.__mro__:
        init = vars(cls).get("__init__")
        module = sys.modules.get(cls.__module__)
        for name in getattr(getattr(init, "__code__", None), "co_names", ()):
            found = getattr(module, name, None)
            if name.endswith("CONFIGS") and isinstance(found, dict):
                found = found.get(getattr(model_class, "model_type", None))
            if name.endswith(("Config", "CONFIGS")) and dataclasses.is_dataclass(found):
                return found
        for cell in getattr(init, "__closure__", None) or ():  # a class made by a factory (Gemma 4's variants)
            if isinstance(cell.cell_contents, type) and dataclasses.is_dataclass(cell.cell_contents):
                return cell.cell_contents
    return None


def _llm_config(model_class, layers: int, llm: dict | None = None) -> dict:
    """:data:`TINY_LLM` for the config dataclass ``model_class`` builds (only the fields it has)."""
    config = _config_class(model_class)
    fields = {f.name for f in dataclasses.fields(config)}
    return {k: v for k, v in {**TINY_LLM, "num_hidden_layers": layers, **(llm or {})}.items() if k in fields}


def _layers_read(layer, layer_idx) -> int:
    """How many layers an encoder needs for the layers it reads (``layer_idx``, a list of layers)."""
    need = [3]
    if isinstance(layer, (list, tuple)):
        need += [abs(int(i)) + 1 for i in layer]
    if isinstance(layer_idx, int):
        need.append(abs(layer_idx) + 1)
    return max(need)


# Encoders that join T5's output to CLIP's at T5-XXL's full width (SD3, HiDream): their T5 keeps it
FULL_WIDTH_T5 = ("sd3_clip", "hidream")


def _tiny_size(model_class, layer, layer_idx, t5_width: int | None, llm: dict | None) -> dict:
    import comfy.clip_model

    module = getattr(model_class, "__module__", "")
    if model_class is comfy.clip_model.CLIPTextModel:
        return dict(_SHAPES.CLIP_CONFIG, num_hidden_layers=_layers_read(layer, layer_idx))
    if module == "comfy.text_encoders.t5":
        return dict(T5_CONFIG, **({"d_model": t5_width} if t5_width else {}))
    if _config_class(model_class) is not None:
        return _llm_config(model_class, _layers_read(layer, layer_idx), llm)
    raise NotImplementedError(f"no test size for {module}.{model_class.__qualname__}")


@contextlib.contextmanager
def tiny_sizes(t5_width: int | None = None, llm: dict | None = None, vision: dict | None = None):
    """While it is held, ComfyUI's ``SDClipModel`` builds its transformer at a test size (through its own
    ``<model_name>_model_config`` option; T5 at ``t5_width`` when given, an LLM at :data:`TINY_LLM` updated
    by ``llm``) and the vision towers inside LLMs (Qwen2-VL's: :data:`TINY_VISION` updated by ``vision``; Gemma 3's
    SigLIP) are small."""
    import comfy.clip_model
    import comfy.sd1_clip
    import comfy.text_encoders.qwen_vl as qwen_vl

    sd_init = comfy.sd1_clip.SDClipModel.__init__
    vision_init = qwen_vl.Qwen2VLVisionTransformer.__init__
    siglip_init = comfy.clip_model.CLIPVision.__init__
    try:
        import comfy.text_encoders.qwen35 as qwen35  # ComfyUI 0.2x+
    except ImportError:
        qwen35 = None
    qwen35_init = qwen35.Qwen35VisionModel.__init__ if qwen35 is not None else None

    @functools.wraps(sd_init)
    def sized(self, *args, **kwargs):
        import inspect

        bound = inspect.signature(sd_init).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["textmodel_json_config"] is None:  # ComfyUI's CLIP-L file config, named clip_l
            a["model_options"] = {**a["model_options"], "model_name": a["model_options"].get("model_name", "clip_l")}
        options = dict(a["model_options"])
        name = options.get("model_name", "")
        options[f"{name}_model_config"] = {**_tiny_size(a["model_class"], a["layer"], a["layer_idx"], t5_width, llm),
                                           **options.get(f"{name}_model_config", {})}
        a["model_options"] = options
        return sd_init(*bound.args, **bound.kwargs)

    @functools.wraps(vision_init)
    def small_vision(self, *args, **kwargs):
        return vision_init(self, *args, **{**kwargs, **TINY_VISION, **(vision or {})})

    @functools.wraps(siglip_init)
    def small_siglip(self, config_dict, *args, **kwargs):
        if config_dict.get("model_type") == "siglip_vision_model":  # an LLM's own tower (Gemma 3)
            config_dict = {**config_dict, **TINY_SIGLIP}
        return siglip_init(self, config_dict, *args, **kwargs)

    @functools.wraps(qwen35_init)
    def small_qwen35(self, config, *args, **kwargs):
        small = {**config, **TINY_QWEN35_VISION}
        if "deepstack_visual_indexes" in config:  # Qwen3-VL taps some of the tower's layers
            small["deepstack_visual_indexes"] = list(range(min(len(config["deepstack_visual_indexes"]), small["depth"])))
        return qwen35_init(self, small, *args, **kwargs)

    comfy.sd1_clip.SDClipModel.__init__ = sized
    qwen_vl.Qwen2VLVisionTransformer.__init__ = small_vision
    comfy.clip_model.CLIPVision.__init__ = small_siglip
    if qwen35 is not None:
        qwen35.Qwen35VisionModel.__init__ = small_qwen35
    try:
        yield
    finally:
        if qwen35 is not None:
            qwen35.Qwen35VisionModel.__init__ = qwen35_init
        comfy.sd1_clip.SDClipModel.__init__ = sd_init
        qwen_vl.Qwen2VLVisionTransformer.__init__ = vision_init
        comfy.clip_model.CLIPVision.__init__ = siglip_init


def tokenize_options(target: Target) -> dict:
    """Tokenizer options the tests pass: ACE 1.5 samples audio codes for every second asked (120 by default)."""
    return {"duration": 2} if target.clip.__module__.endswith("ace15") else {}


def build(target: Target, seed: int = 0):
    """The real ``comfy.sd.CLIP`` of ``target`` at test sizes, weights filled from ``seed``. Raises
    NotImplementedError (with the reason) for an encoder the tests cannot size or tokenize."""
    tokenizer_data = _prepare(target)
    with _sized_for(target):
        return build_sized(target, seed, tokenizer_data)


def not_built_because(target: Target) -> str | None:
    """Why :func:`build` would not build ``target`` here (None: it builds); nothing is allocated."""
    try:
        _prepare(target)
    except NotImplementedError as exc:
        return str(exc)
    return None


def _sized_for(target: Target):
    return tiny_sizes(4096 if target.clip.__module__.rpartition(".")[2] in FULL_WIDTH_T5 else None)


def _prepare(target: Target) -> dict:
    """The tokenizer data ``target`` needs (tiny stand-ins for tokenizers a checkpoint carries), after checking
    that its tokenizer builds and that it fits at the test sizes; NotImplementedError with the reason."""
    tokenizer_data = {}
    for key in target.tokenizer_data:
        make = next((fn for name, fn in CHECKPOINT_TOKENIZERS.items() if key.endswith(name)), None)
        if make is None:
            raise NotImplementedError(f"its tokenizer ({key}) comes from inside the checkpoint; no test tokenizer")
        tokenizer_data[key] = torch.frombuffer(bytearray(make()), dtype=torch.uint8)
    try:
        target.tokenizer(tokenizer_data=tokenizer_data)
    except Exception as exc:  # e.g. 0.3.75's Mistral tokenizer with today's transformers: ComfyUI fails alike
        raise NotImplementedError(f"the host's own tokenizer fails here: {type(exc).__name__}: {exc}") from exc
    with _sized_for(target):
        _fits(target)
    return tokenizer_data


MAX_PARAMETERS = 200_000_000  # what an encoder may hold at the test size (SD3's with T5 at full width: ~150M)


def _fits(target: Target) -> None:
    """Raises NotImplementedError when ``target`` at the sizes in force holds more than MAX_PARAMETERS (parts
    the tests cannot size keep their full width), naming the largest such part; built on ``meta``: no memory."""
    model = target.clip(device="meta", dtype=torch.float32, model_options=dict(target.model_options))
    total = sum(p.numel() for p in model.parameters())
    if total > MAX_PARAMETERS:
        parts = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules() if name.count(".") == 2]
        size, name = max(parts, default=(total, ""))
        raise NotImplementedError(f"{total / 1e6:.0f}M parameters at the test size ({name}: {size / 1e6:.0f}M keeps its full width)")


def build_sized(target: Target, seed: int = 0, tokenizer_data: dict | None = None):
    """``comfy.sd.CLIP`` of ``target`` at the sizes in force (:func:`tiny_sizes`), weights from ``seed``."""
    import comfy.sd

    clip_target = type("ClipTarget", (), {"clip": target.clip, "tokenizer": target.tokenizer,
                                           "params": dict(target.params)})()
    clip = comfy.sd.CLIP(target=clip_target, tokenizer_data=tokenizer_data or {}, model_options=dict(target.model_options))
    fill_weights(clip.cond_stage_model, seed)
    return clip


# ---- files: what a loader reads --------------------------------------------------------------------

# A Qwen2.5-VL 7B file as ComfyUI detects it (its k_proj bias is 4 heads of 128), at a test width
QWEN25_7B_FILE = {"num_attention_heads": 4, "num_key_value_heads": 4}
# A Qwen3-4B file as ComfyUI detects it: its norms are 2560 wide, so the embedding (151936 rows) is too, 0.8 GB
QWEN3_4B_FILE = {"hidden_size": 2560}


def _write_llm(path: str, target_name: str, llm: dict, seed: int, dtype=None) -> str:
    """The LLM inside ComfyUI's text encoder ``target_name`` at the sizes of :func:`tiny_sizes` (``llm``), as
    the file a loader reads (the weights in ``dtype`` when given), written once."""
    import os

    from safetensors.torch import save_file

    if not os.path.exists(path):
        target = next(t for t in loader_targets().values() if t.name == target_name)
        with tiny_sizes(llm=llm):
            clip = build_sized(target, seed)
        model = clip.cond_stage_model
        state = getattr(model, model.clip).transformer.state_dict()
        tmp = f"{path}.{os.getpid()}.tmp"
        save_file({k: v.detach().to(dtype or v.dtype).contiguous() for k, v in state.items()}, tmp)
        del clip, model, state
        os.replace(tmp, path)
    return path


def write_qwen25_7b(path: str, seed: int = 0) -> str:
    """ComfyUI's own Qwen-Image text encoder (Qwen2.5-VL 7B with its vision tower) at a test width, as a
    file CLIPLoader's ``qwen_image`` type detects and loads while :func:`tiny_sizes` (``llm=QWEN25_7B_FILE``)
    is held."""
    return _write_llm(path, "qwen_image.QwenImageTEModel_", QWEN25_7B_FILE, seed)


def write_qwen3_4b(path: str, seed: int = 0) -> str:
    """ComfyUI's own Z-Image text encoder (Qwen3-4B) at its real width and a few narrow layers, in bf16 as
    the released file is, as a file CLIPLoader's ``lumina2`` type detects as Z-Image's while
    :func:`tiny_sizes` (``llm=QWEN3_4B_FILE``) is held."""
    return _write_llm(path, "z_image.ZImageTEModel_", QWEN3_4B_FILE, seed, dtype=torch.bfloat16)


class RKTestQwenImageTEFile(RKTestLazyCLIPFile):
    """A Qwen2.5-VL 7B file (:func:`write_qwen25_7b`) through ComfyUI's ``load_clip`` as CLIPLoader's qwen_image
    type, at the file's test width; lazily as ReuseKit Lazy CLIP Loader does, or as ComfyUI loads it. (A lazy
    one's weights would load at ComfyUI's own sizes: for prompts seen before only.)"""

    def run(self, path, lazy=True):
        with tiny_sizes(llm=QWEN25_7B_FILE):
            return (load(write_qwen25_7b(path), lazy, clip_type="qwen_image"),)


class RKTestZImageTEFile(RKTestLazyCLIPFile):
    """A Qwen3-4B file (:func:`write_qwen3_4b`) through ComfyUI's ``load_clip`` as CLIPLoader's lumina2 type
    (Z-Image's text encoder), at the file's test sizes; lazily or as ComfyUI loads it."""

    def run(self, path, lazy=True):
        with tiny_sizes(llm=QWEN3_4B_FILE):
            return (load(write_qwen3_4b(path), lazy, clip_type="lumina2"),)


class RKTestTinyZImage:
    """ComfyUI's Z-Image diffusion model at a test size, reading the Qwen3-4B width the file encoder gives."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "ReuseKit tests"

    def load(self, seed):
        from .families import tiny_lumina2

        return (tiny_lumina2(seed, z_image=True, cap_feat_dim=QWEN3_4B_FILE["hidden_size"]),)


NODE_CLASS_MAPPINGS = {"RKTestQwenImageTEFile": RKTestQwenImageTEFile, "RKTestZImageTEFile": RKTestZImageTEFile,
                       "RKTestTinyZImage": RKTestTinyZImage}


# ---- coverage: does a repeat hit? ------------------------------------------------------------------

COVERAGE_TEXT = "a photo of a cat sitting on a red chair"


def hit_status(target: Target) -> str:
    """Builds ``target`` and encodes a prompt twice with the conditioning cache on (global mode; the
    cache emptied first): "hit" when the repeat is a hit bit-identical to encoding with the pack off;
    else why it bypassed, or why it was not built here (scripts/encoder_coverage.py, the bench)."""
    from .lazy_clip import _pack_module

    cache = _pack_module("caching.conditioning").CACHE
    settings = _pack_module("caching.settings").SETTINGS
    try:
        clip = build(target)
    except NotImplementedError as exc:
        return f"not built here: {exc}"
    options = tokenize_options(target)
    before = settings.get("conditioning.enabled")
    try:
        with torch.inference_mode():
            def encode():
                return clip.encode_from_tokens_scheduled(clip.tokenize(COVERAGE_TEXT, **options))

            settings.set("conditioning.enabled", False)
            reference = encode()
            settings.set("conditioning.enabled", True)
            cache.clear()
            cache.reset_counts()
            encode()
            second = encode()
    finally:
        settings.set("conditioning.enabled", before)
    reasons = cache.bypass_reasons()
    if reasons:
        return "bypass: " + "; ".join(r["reason"] for r in reasons)
    if cache.count("hits") == 1 and same_output(second, reference):
        return "hit"
    return f"no hit ({cache.count('hits')} hits, equal to ComfyUI: {same_output(second, reference)})"


# ---- ComfyUI's own workflow templates: what people run ----------------------------------------------

# Loader nodes that build a text encoder as one of the loaders above does (what they call, as which type)
LOADER_ALIASES = {"LTXAVTextEncoderLoader": ("DualCLIPLoader", "ltxv")}  # Gemma 3 + the LTX-2 checkpoint's projection


def _template_nodes(workflow):
    if isinstance(workflow, dict):
        yield from workflow.get("nodes") or []
        for subgraph in (workflow.get("definitions") or {}).get("subgraphs") or []:
            yield from subgraph.get("nodes") or []


def templates_folder():
    """ComfyUI's workflow templates as scripts/setup.sh --test unpacks them beside this Python's venv
    (``<venv>/templates/comfyui-workflow-templates-json==<version>``), or None."""
    import sys
    from pathlib import Path

    found = sorted((Path(sys.prefix) / "templates").glob("comfyui-workflow-templates-json==*"))
    return found[-1] if found else None


def template_uses() -> tuple[str, dict[tuple[str, str, tuple], int], dict[str, int]] | None:
    """From ComfyUI's templates (the ``comfyui-workflow-templates-json`` package, :func:`templates_folder`):
    its version, how many nodes load a text encoder as each (loader, type, files), and how many use each
    node type that takes a CLIP and returns a conditioning, in its workflows and their subgraphs. None when
    the templates are not there."""
    import collections
    import json

    import nodes

    folder = templates_folder()
    if folder is None:
        return None
    loaders, encoders = collections.Counter(), collections.Counter()
    for path in sorted(folder.rglob("*.json")):
        for node in _template_nodes(json.loads(path.read_text())):
            kind, values = node.get("type"), node.get("widgets_values")
            values = values if isinstance(values, list) else []
            if kind in LOADERS:
                n = LOADERS[kind]
                clip_type = values[n] if kind in ("CLIPLoader", "DualCLIPLoader") and len(values) > n else ""
                loaders[(kind, clip_type, tuple(values[:n]))] += 1
            elif kind in LOADER_ALIASES:
                loaders[(kind, "", tuple(values[:1]))] += 1
            cls = nodes.NODE_CLASS_MAPPINGS.get(kind)
            if cls is not None and _encodes_text(cls):
                encoders[kind] += 1
    return folder.name.partition("==")[2], dict(loaders), dict(encoders)


def _encodes_text(cls) -> bool:
    """Whether a node class takes a CLIP and returns a CONDITIONING (a text-encode node)."""
    try:
        spec = cls.INPUT_TYPES()
    except Exception:
        return False
    inputs = [v[0] for section in ("required", "optional") for v in (spec.get(section) or {}).values()
              if isinstance(v, tuple) and v]
    return "CLIP" in inputs and "CONDITIONING" in tuple(getattr(cls, "RETURN_TYPES", ()) or ())


def calls_the_encode_seam(cls) -> bool:
    """Whether a text-encode node reaches the encoder through ``CLIP.encode_from_tokens(_scheduled)``, the
    seam the conditioning cache routes (read from its source, and from the source of its module's functions
    that it calls)."""
    import inspect
    import re
    import sys
    import types

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    if "encode_from_tokens" in source:
        return True
    module = sys.modules.get(cls.__module__)
    for name in set(re.findall(r"\b(\w+)\(", source)):
        helper = getattr(module, name, None)
        if isinstance(helper, types.FunctionType) and "encode_from_tokens" in inspect.getsource(helper):
            return True
    return False


def template_coverage() -> dict | None:
    """Each text-encoder load in ComfyUI's templates, judged on this host: "tested" when ComfyUI's loader builds,
    from files of those models, an encoder of :func:`loader_targets` (so the per-type tests run it); else
    why not (the host lacks the loader or type, a model the tests do not probe). None without the package."""
    found = template_uses()
    if found is None:
        return None
    version, loads, encoders = found
    tested = {t.signature(): not_built_because(t) for t in loader_targets().values()}
    seen = {(loader, clip_type) for t in loader_targets().values() for loader, clip_type, _ in t.seen}
    verdicts = {}
    for (loader, clip_type, names), count in loads.items():
        if loader in LOADER_ALIASES:
            alias = LOADER_ALIASES[loader]
            verdict = "tested (as DualCLIPLoader ltxv)" if alias in seen else f"the host has no {alias[0]} {alias[1]}"
        elif clip_type not in loader_types(loader):
            verdict = f"this host's {loader} has no type {clip_type!r}" if loader_types(loader) else f"this host has no {loader}"
        elif None in (models := [file_model(n) for n in names]) or any(m not in probes() for m in models):
            verdict = "a model the tests do not build: " + ", ".join(n for n, m in zip(names, models, strict=True)
                                                                       if m is None or m not in probes())
        else:
            target = ask(clip_type, [probes()[m] for m in models])
            if target is None or target.signature() not in tested:
                verdict = "not among the tested encoders"
            else:
                why = tested[target.signature()]
                verdict = "tested" if why is None else f"`{target.name}`, not built here: {why}"
        verdicts[(loader, clip_type, names)] = (count, verdict)
    return {"version": version, "loads": verdicts, "encoders": encoders}
