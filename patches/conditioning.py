"""Routes ComfyUI's encoders through the conditioning cache (caching/conditioning.py).

Patched (class attributes, one install and one uninstall, idempotent, each shape-checked at install):

- ``comfy.sd.CLIP.encode_from_tokens``: every text node (CLIPTextEncode, Flux, SDXL, SD3,
  Qwen-Image...) reaches the encoder through it, also via ``encode_from_tokens_scheduled``
  (whose hook-scheduled path calls the encoder directly: counted as a bypass);
- ``comfy.clip_vision.ClipVisionModel.encode_image``;
- ``comfy.sd.VAE.encode`` and ``encode_tiled`` (and its tile helpers, ``_encode_tiled_owned`` where
  the host has it, to see an out-of-memory fallback from a plain encode to tiles: that result is
  never stored);
- ``CLIP.load_sd`` / ``ClipVisionModel.load_sd`` (weights replaced in place: a new generation).

Entries are CPU copies (caching/conditioning.py): the cache makes no device copy of its own (weight
patches it pins stay where their patcher keeps them), so nothing here hooks ComfyUI's memory manager.

A call goes through the cache when global mode is on (setting ``conditioning.enabled``) or when the
encoder object was made by a ReuseKit Cached node (a marker in its patcher's ``model_options``,
which ComfyUI's clones copy). Plain-valued object patches (``manual_cast_dtype``...) and the encoder
modules' own settings (``enable_attention_masks``, ``zero_out_masked``...; a digest) are part of the
key; an in-place edit of a weight starts a new generation (seen by its version counter, or for
inference tensors, which have none, by a fingerprint of its bytes on every key, computed on the device that holds it). Patcher classes other
than ComfyUI's own are refused. Anything else the key cannot describe exactly (hooks, injections
such as bypass LoRA, object patches holding code or modules, weight wrappers, patcher callbacks and wrappers, autograd, unknown
input types) bypasses the cache and runs unchanged. Every patched method's shape is checked at
install (patches/host.py): on a host that reshaped one, the cache stays off with one warning.

Shared tiers (disk, Redis: ``caching/tiers.py``) key an encoder by the content of the files it was
loaded from, never by identity. ``comfy.sd.load_clip``, ``load_checkpoint_guess_config`` and
``comfy.clip_vision.load`` are wrapped to record each encoder's files and loader options
(:func:`register_source`, also for custom loaders); ComfyUI's ``cached_patcher_init`` (VAELoader on
0.2x+) is read for encoders without a record. An encoder with no record, with weights replaced or
edited since loading, or with a file not hashed yet stays in the process.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import inspect
import logging
import os
import re
import threading
import types
import weakref

import torch

from ..caching.conditioning import (
    CACHE,
    Key,
    checksums,
    identity,
    intern_weights,
    known_identity,
    register_container,
)
from ..caching.keys import Uncacheable, digest, encode
from ..caching.settings import SETTINGS
from ..caching.tiers import FORMAT, TIERS, SharedKey
from . import host

log = logging.getLogger("reusekit")

MARKER = "reusekit_conditioning"
_GENERATION = "_reusekit_generation"

_lock = threading.Lock()
_originals: dict[tuple[object, str], object] = {}     # (class, name) -> ComfyUI's method
_replacements: dict[tuple[object, str], object] = {}  # (class, name) -> ours, as installed
_active = False  # routing on (a replacement left wrapped by another pack passes through when off)


# ---- key parts ---------------------------------------------------------------------------------

def _routed(patcher) -> bool:
    """Whether an encoder's calls go through the cache: global mode, or a Cached node's marker."""
    return MARKER in getattr(patcher, "model_options", {}) or SETTINGS.get("conditioning.enabled")


def _patch_structure(value):
    """Weight patches as primitives and tensors (adapters opened up); Uncacheable otherwise."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (list, tuple)):
        return [_patch_structure(v) for v in value] if isinstance(value, list) else tuple(_patch_structure(v) for v in value)
    if isinstance(value, dict):
        return {k: _patch_structure(v) for k, v in value.items()}
    if isinstance(value, types.FunctionType) and value.__closure__ is None:
        return ("function", value.__module__, value.__qualname__)
    weights = getattr(value, "weights", None)
    if isinstance(weights, (list, tuple)) and hasattr(value, "loaded_keys"):  # comfy.weight_adapter
        return ("adapter", type(value).__module__, type(value).__qualname__,
                sorted(map(str, value.loaded_keys or ())), _patch_structure(tuple(weights)))
    raise Uncacheable(f"weight patch of type {type(value).__name__}")


_weight_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_weight_memo_lock = threading.Lock()

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _has_entries(table) -> bool:
    """Whether a patcher's ``{type: {key: [callables]}}`` or ``{key: [items]}`` table holds anything."""
    return any(_has_entries(v) if isinstance(v, dict) else bool(v) for v in (table or {}).values())


def _known_patchers() -> tuple[type, ...]:
    """ComfyUI's own patcher classes (``ModelPatcherDynamic`` on hosts with dynamic VRAM)."""
    import comfy.model_patcher as mp

    return tuple(c for c in (getattr(mp, "ModelPatcher", None), getattr(mp, "ModelPatcherDynamic", None)) if c)


def _patcher_fields(patcher) -> tuple:
    """What else on the patcher decides the encoder's output, as key fields: its class, weight
    casting and plain-valued object patches by name and value. Uncacheable for what a key cannot
    describe: hooks, injections (bypass LoRA), weight wrappers, callbacks and wrappers (code that
    may run at load or in the forward), object patches holding code, modules or objects.
    Attachments (LoRA metadata...) are data that only callbacks and wrappers read: not keyed.
    Patcher classes other than ComfyUI's own (GGUF forks...) may keep weights or LoRA elsewhere: refused."""
    if type(patcher) not in _known_patchers():
        raise Uncacheable(f"patcher class {type(patcher).__qualname__} may keep weights outside its patches")
    if patcher.weight_wrapper_patches:
        raise Uncacheable("weight wrappers on the encoder")
    if _has_entries(getattr(patcher, "injections", None)):
        raise Uncacheable("injections on the encoder (bypass LoRA...)")
    if patcher.hook_patches or patcher.forced_hooks is not None or getattr(patcher, "current_hooks", None):
        raise Uncacheable("hooks on the encoder")
    if _has_entries(getattr(patcher, "callbacks", None)) or _has_entries(getattr(patcher, "wrappers", None)):
        raise Uncacheable("callbacks or wrappers on the encoder")
    objects = []
    for name, value in sorted(patcher.object_patches.items()):
        if type(value) not in _PLAIN:
            raise Uncacheable(f"object patch {name!r} holds a {type(value).__name__}")
        objects.append((name, encode(value)))
    return (type(patcher).__module__, type(patcher).__qualname__,
            encode(getattr(patcher, "force_cast_weights", None)), tuple(objects))


def _weights(patcher):
    """The interned weight set of a patcher's patches (memoised per patcher and patches_uuid)."""
    if not patcher.patches:
        return None
    stamp = (patcher.patches_uuid, len(patcher.patches))
    with _weight_memo_lock:
        memo = _weight_memo.get(patcher)
    if memo is not None and memo[0] == stamp:
        return memo[1]
    structure = {key: _patch_structure(patches) for key, patches in patcher.patches.items()}
    made = intern_weights(structure)
    with _weight_memo_lock:
        _weight_memo[patcher] = (stamp, made)
    return made


def _precision() -> tuple:
    if torch.is_grad_enabled():
        raise Uncacheable("autograd is enabled")
    fields = []
    for device_type in ("cpu", "cuda"):
        try:
            on = torch.is_autocast_enabled(device_type)
            fields.append((device_type, on, str(torch.get_autocast_dtype(device_type)) if on else None))
        except (AttributeError, TypeError, RuntimeError):
            fields.append((device_type, None, None))
    return tuple(fields)


def _config(obj, skip: tuple[str, ...]) -> tuple:
    """The encoder wrapper's own settings (numbers, strings, dtypes, code by where it is defined), by
    name; its closures (VAE memory estimators) by their code."""
    return tuple((name, _setting(name, value, closures=True)) for name, value in sorted(vars(obj).items())
                 if name not in skip and not name.startswith("_") and not isinstance(value, (torch.Tensor, torch.nn.Module)))


def _setting(name: str, value, closures: bool = False):
    """A setting as a key field: plain values whole, classes and functions by where they are defined;
    Uncacheable for objects and (unless ``closures``) for functions that capture values."""
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", getattr(value, "__module__", None), value.__qualname__)
    if isinstance(value, types.FunctionType) and (closures or value.__closure__ is None):
        code = value.__code__
        return ("function", value.__module__, value.__qualname__, code.co_filename, code.co_firstlineno)
    if type(value) in (list, tuple):
        return ("L" if type(value) is list else "U", tuple(_setting(name, v, closures) for v in value))
    try:
        return encode(value)
    except Uncacheable:
        raise Uncacheable(f"encoder setting {name!r} holds a {type(value).__name__}") from None


# What ComfyUI writes on an encoder's modules while it loads, casts and unloads weights (keyed through
# the patcher and load device instead), and the options an encode resets first (SD1ClipModel's
# reset_clip_options: their values at the call follow from options_default and the keyed layer_idx).
_LOAD_STATE = frozenset({
    "current_weight_patches_uuid", "model_loaded_weight_memory", "model_lowvram", "lowvram_patch_counter",
    "model_offload_buffer_memory", "weight_function", "bias_function", "comfy_cast_weights",
    "prev_comfy_cast_weights", "comfy_force_cast_weights", "comfy_patched_weights", "device", "execution_device"})
_RESET_OPTIONS = frozenset({"layer", "layer_idx", "return_projected_pooled"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _module_state(model: torch.nn.Module, patcher) -> tuple:
    """Every plain-valued setting of the encoder's modules (``enable_attention_masks``,
    ``zero_out_masked``, special tokens, ``training``...) by module path and name, as they are without
    ComfyUI's object patches (their originals in ``object_patches_backup``; a patcher's own object
    patches are keyed by ``_patcher_fields``). Instance-level methods (injections) are left out.
    Uncacheable for module hooks and for settings a key cannot describe."""
    import torch.nn.modules.module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        raise Uncacheable("global module hooks")
    backup = getattr(patcher, "object_patches_backup", None) or {}
    out, seen = [], set()

    def walk(module, path):
        if id(module) in seen:
            return
        seen.add(id(module))
        if any(getattr(module, h, None) for h in _HOOKS):
            raise Uncacheable(f"hooks on encoder module {path or type(model).__name__!r}")
        reset = _RESET_OPTIONS if hasattr(module, "reset_clip_options") else ()
        for name, value in vars(module).items():
            full = f"{path}.{name}" if path else name
            value = backup.get(full, value)
            if (name.startswith("_") or name in _LOAD_STATE or name in reset
                    or isinstance(value, (torch.Tensor, torch.nn.Module, types.MethodType))):
                continue
            out.append((path, name, _setting(full, value)))
        for name, child in module._modules.items():
            full = f"{path}.{name}" if path else name
            child = backup.get(full, child)
            if isinstance(child, torch.nn.Module):
                walk(child, full)

    walk(model, "")
    return digest(tuple(out))  # thousands of settings in a large VAE: a digest, not kept whole


# per encoder module: tensor id -> (weak reference, _version when last seen) for version-counted
# weights, and weight name -> CRC-32 when last seen for inference tensors (no version counter)
_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_contents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_versions_lock = threading.Lock()


def _check_in_place_edits(model: torch.nn.Module, patcher) -> None:
    """An encoder weight (parameter or buffer) edited in place since the last key starts a new
    generation: the old entries are dropped and never hit. A version-counted weight shows an edit by
    its ``_version``; an inference tensor (every weight ComfyUI's loaders make, inside its executor)
    has none, so its bytes are fingerprinted where they live (:func:`checksums`, on every key: the price of seeing edits
    the version counter cannot). Weights ComfyUI has patched over right now (``patcher.backup``) are
    not base weights and are skipped. The setting ``conditioning.check_weight_edits`` off skips the
    fingerprints (and switching it empties the cache)."""
    patched = getattr(patcher, "backup", None) or {}
    fingerprint = SETTINGS.get("conditioning.check_weight_edits")
    edited = False
    untracked: list[tuple[str, torch.Tensor]] = []
    with _versions_lock:
        seen = _versions.get(model)
        if seen is None:
            seen = _versions[model] = {}
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if name in patched:
                continue
            if t.is_inference():
                if fingerprint:
                    untracked.append((name, t))
                continue
            version = t._version
            old = seen.get(id(t))
            if old is not None and old[0]() is t:
                if old[1] != version:
                    edited = True
                    seen[id(t)] = (old[0], version)
            else:
                seen[id(t)] = (weakref.ref(t), version)
    if untracked:
        sums = checksums([t for _, t in untracked])
        with _versions_lock:
            known = _contents.get(model)
            if known is None:
                known = _contents[model] = {}
            for (name, _), crc in zip(untracked, sums, strict=True):
                if known.get(name, crc) != crc:
                    edited = True
                known[name] = crc
    if edited:
        _new_generation(model)


def _new_generation(module) -> None:
    """Weights replaced or edited: the encoder's old entries are dropped and its keys change."""
    setattr(module, _GENERATION, getattr(module, _GENERATION, 0) + 1)
    serial = known_identity(module)
    if serial is not None:
        CACHE.drop_owner(serial)


def _owner(module, patcher) -> tuple[int, int]:
    """The encoder's serial and weight generation (after checking its weights for in-place edits)."""
    _check_in_place_edits(module, patcher)
    return identity(module), getattr(module, _GENERATION, 0)


def _options(extra: dict) -> tuple:
    """Keyword options a newer host added to an encode (e.g. VAE ``not_video``), in the key by name."""
    return encode(tuple(sorted(extra.items())))


# where each kind's key fields hold the in-process weight generation (left out of a shared key)
_GENERATION_AT = {"text": 3, "vision": 2, "vae": 2}


def text_key(clip, tokens, return_pooled, return_dict, extra: dict | None = None) -> Key:
    if clip.apply_hooks_to_conds:
        raise Uncacheable("hooks applied to the conditioning")
    model = clip.cond_stage_model
    serial, generation = _owner(model, clip.patcher)
    fields = ("encode_from_tokens", type(model).__module__, type(model).__qualname__, generation,
              encode(clip.patcher.load_device),  # where it runs: CPU and GPU results differ in bits
              encode(clip.layer_idx), encode(return_pooled), encode(return_dict),
              _options(extra or {}), _precision(), _patcher_fields(clip.patcher), _module_state(model, clip.patcher),
              encode(tokens))
    return Key("text", fields, owners=(serial,), weights=(_weights(clip.patcher),))


def vision_key(clip_vision, image, crop, extra: dict | None = None) -> Key:
    model = clip_vision.model
    serial, generation = _owner(model, clip_vision.patcher)
    fields = ("encode_image", type(model).__qualname__, generation, encode(crop), _options(extra or {}),
              _precision(), _config(clip_vision, ("patcher", "model")), _patcher_fields(clip_vision.patcher),
              _module_state(model, clip_vision.patcher), encode(image))
    return Key("vision", fields, owners=(serial,), weights=(_weights(clip_vision.patcher),))


def vae_key(vae, method: str, pixels, options: tuple, extra: dict | None = None) -> Key:
    model = vae.first_stage_model
    if model is None:
        raise Uncacheable("invalid VAE")
    serial, generation = _owner(model, vae.patcher)
    fields = (method, type(model).__qualname__, generation, encode(options), _options(extra or {}), _precision(),
              _config(vae, ("patcher", "first_stage_model")), _patcher_fields(vae.patcher), _module_state(model, vae.patcher),
              encode(pixels))
    return Key("vae", fields, owners=(serial,), weights=(_weights(vae.patcher),))


# ---- shared keys: the encoder by its weight files' content -------------------------------------

_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (generation, loader, files, options)
_sources_lock = threading.Lock()
_patch_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # WeightSet -> digest of its contents
_DEVICE = re.compile(r"^(cuda|xpu|mps|npu|mlu|hpu|xla|privateuseone|mtia):(\d+)$")
_device_names: dict[str, str] = {}


def _encoder_module(encoder):
    """The module holding an encoder's weights (CLIP, VAE, CLIP vision or the module itself)."""
    for name in ("cond_stage_model", "first_stage_model", "model"):
        module = getattr(encoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return encoder if isinstance(encoder, torch.nn.Module) else None


def register_source(encoder, paths, loader: str, options=None) -> bool:
    """Record that ``encoder``'s weights are exactly what ``loader`` made from the files ``paths`` with
    ``options``, so the shared tiers can key it by the files' content (for custom loaders too). It
    holds while the encoder's weights are not replaced or edited. False when it cannot be recorded
    (then the encoder never uses the shared tiers)."""
    module = _encoder_module(encoder)
    if module is None or not paths:
        return False
    try:
        keyed = encode(options)
    except Uncacheable:
        return False
    files = tuple(os.path.realpath(os.fspath(p)) for p in paths)
    patcher = getattr(encoder, "patcher", None)
    if patcher is not None and TIERS.active:
        _check_in_place_edits(module, patcher)  # the weights as loaded: an edit before the first encode shows
    with _sources_lock:
        _sources[module] = (getattr(module, _GENERATION, 0), str(loader), files, keyed)
    for f in files:
        TIERS.hashes.get(f)  # small files now, large ones on a background thread
    return True


def _portable_device(name: str) -> str:
    """``cuda:1`` as ``cuda[<device name>]``: the same kind of device in another process keys alike."""
    found = _device_names.get(name)
    if found is None:
        kind = _DEVICE.match(name).group(1)
        label = kind
        if kind == "cuda" and torch.cuda.is_available():
            label = f"cuda[{torch.cuda.get_device_name(torch.device(name))}]"
        found = _device_names[name] = label
    return found


def _portable(tree):
    """An encoded key tree with indexed device names replaced by :func:`_portable_device`: in device
    fields (``("device", name)``), tensor fields (``caching/keys.py``: device after the layout) and
    weight-patch skeletons (``("T", dtype, shape, device)``); other strings stay as they are."""
    if not isinstance(tree, tuple):
        return tree
    out = tuple(_portable(x) for x in tree)
    at = None
    if len(out) == 2 and out[0] == "device":
        at = 1
    elif out and out[0] == "T" and len(out) >= 6 and isinstance(out[4], str) and out[4].startswith("torch."):
        at = 5
    elif out and out[0] == "T" and len(out) == 4:
        at = 3
    if at is not None and isinstance(out[at], str) and _DEVICE.match(out[at]):
        out = (*out[:at], _portable_device(out[at]), *out[at + 1:])
    return out


def _patch_digest(weights) -> str:
    """A digest of a weight patch set's structure, strengths and tensor contents (memoised per set)."""
    found = _patch_digests.get(weights)
    if found is None:
        h = hashlib.blake2b(repr(_portable(weights.skeleton)).encode(), digest_size=32)
        for t in weights.tensors:
            h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(memoryview(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()))
        found = _patch_digests[weights] = h.hexdigest()
    return found


def _weight_layout(module) -> tuple:
    """Names, dtypes and shapes of the module's weights: the same file loaded in another precision differs."""
    return digest(tuple((name, str(t.dtype), tuple(t.shape))
                        for name, t in (*module.named_parameters(), *module.named_buffers())))


def _host_versions() -> tuple:
    return ("torch", torch.__version__, "comfyui", host.comfyui_version())


def _factory_source(module, patcher):
    """A source from ComfyUI's own record of how to reload a patcher (``cached_patcher_init``, ComfyUI
    0.2x+: VAELoader and custom loaders that follow core), taken only for weights never replaced or
    seen edited (generation 0): (fn, args[, index]), the files among the args by content."""
    init = getattr(patcher, "cached_patcher_init", None)
    if getattr(module, _GENERATION, 0) != 0 or not isinstance(init, tuple) or len(init) not in (2, 3):
        return None
    fn, args = init[0], init[1]
    if not callable(fn) or not isinstance(args, (tuple, list)):
        return None
    files, options = [], []
    for a in args:
        if isinstance(a, str) and os.path.isfile(a):
            files.append(a)
        elif isinstance(a, (list, tuple)) and a and all(isinstance(p, str) and os.path.isfile(p) for p in a):
            files.extend(a)
        else:
            options.append(_enums_by_name(a))
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}:{init[2] if len(init) == 3 else ''}"
    if not files or not register_source(module, files, name, options):
        return None
    with _sources_lock:
        return _sources.get(module)


def shared_key(key: Key, module, patcher=None) -> SharedKey | None:
    """The key of an encode for the shared tiers, or None while the encoder has no shared identity:
    no recorded source, weights replaced or edited since loading, or a weight file not hashed yet.
    It holds the in-process key's fields (devices by kind and name, not index; the generation left out),
    the weight files by content, the loader and its options, the weights' layout and the patch set by
    content, and the torch and ComfyUI versions."""
    with _sources_lock:
        source = _sources.get(module)
    if source is None and patcher is not None:
        source = _factory_source(module, patcher)
    if source is None or source[0] != getattr(module, _GENERATION, 0):
        return None
    hashes = tuple(TIERS.hashes.get(f) for f in source[2])
    if None in hashes:
        return None
    at = _GENERATION_AT[key.kind]
    fields = key.fields[:at] + key.fields[at + 1:]
    tree = (FORMAT, key.kind, _host_versions(), (source[1], hashes, source[3]), _weight_layout(module),
            tuple(_patch_digest(w) for w in key.weights), _portable(fields))
    return SharedKey(tree)


_local = threading.local()  # per thread: inside a plain VAE encode, and whether it fell back to tiles


def _plain_vae_encode(orig, vae, pixel_samples, extra: dict):
    _local.plain, _local.fell_back = True, False
    try:
        return orig(vae, pixel_samples, **extra)
    finally:
        _local.plain = False


def _tiled_fallback_reason():
    return "VAE encode fell back to tiles (out of memory)" if getattr(_local, "fell_back", False) else None


def _route(kind: str, patcher, module, make_key, compute, check_rng=False, admit=None):
    if not _routed(patcher) or not _active or not CACHE.enabled:
        return compute()
    try:
        key = make_key()
    except Uncacheable as exc:
        CACHE.bypass(kind, str(exc))
        return compute()
    except Exception as exc:  # an encoder object this key builder does not know: never break the encode
        CACHE.bypass(kind, f"unexpected {type(exc).__name__}: {exc}")
        return compute()
    return CACHE.fetch(key, compute, check_rng=check_rng, admit=admit, shared=lambda: shared_key(key, module, patcher))


# ---- the patched methods ----------------------------------------------------------------------

def _orig(owner, name):
    return _originals[(owner, name)]


def _make_methods():
    import comfy.clip_vision
    import comfy.sd

    CLIP, VAE = comfy.sd.CLIP, comfy.sd.VAE
    Vision = comfy.clip_vision.ClipVisionModel

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False, **extra):
        orig = _orig(CLIP, "encode_from_tokens")
        return _route("text", self.patcher, self.cond_stage_model,
                      lambda: text_key(self, tokens, return_pooled, return_dict, extra),
                      lambda: orig(self, tokens, return_pooled=return_pooled, return_dict=return_dict, **extra))

    def encode_from_tokens_scheduled(self, tokens, *args, **kwargs):
        if self.patcher.forced_hooks is not None and self.use_clip_schedule and _active and _routed(self.patcher):
            CACHE.bypass("text", "hook-scheduled encode")
        return _orig(CLIP, "encode_from_tokens_scheduled")(self, tokens, *args, **kwargs)

    # every replacement passes keyword options a newer host added on to it, and keys them
    def vae_encode(self, pixel_samples, **extra):
        orig = _orig(VAE, "encode")
        # ComfyUI retries a plain encode in tiles when it runs out of memory: that result is not
        # what a plain encode gives with room to spare, so it is returned but never stored
        return _route("vae", self.patcher, self.first_stage_model, lambda: vae_key(self, "encode", pixel_samples, (), extra),
                      lambda: _plain_vae_encode(orig, self, pixel_samples, extra), check_rng=True,
                      admit=_tiled_fallback_reason)

    def tiled_helper(name):
        def helper(self, *args, **kwargs):
            if getattr(_local, "plain", False):
                _local.fell_back = True
            return _orig(VAE, name)(self, *args, **kwargs)
        return helper

    def vae_encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None,
                         **extra):
        orig = _orig(VAE, "encode_tiled")
        options = (tile_x, tile_y, overlap, tile_t, overlap_t)
        return _route("vae", self.patcher, self.first_stage_model, lambda: vae_key(self, "encode_tiled", pixel_samples, options, extra),
                      lambda: orig(self, pixel_samples, tile_x=tile_x, tile_y=tile_y, overlap=overlap,
                                   tile_t=tile_t, overlap_t=overlap_t, **extra), check_rng=True)

    def encode_image(self, image, crop=True, **extra):
        orig = _orig(Vision, "encode_image")
        return _route("vision", self.patcher, self.model, lambda: vision_key(self, image, crop, extra),
                      lambda: orig(self, image, crop=crop, **extra))

    def clip_load_sd(self, sd, full_model=False):
        _new_generation(self.cond_stage_model)
        return _orig(CLIP, "load_sd")(self, sd, full_model)

    def vision_load_sd(self, sd):
        _new_generation(self.model)
        return _orig(Vision, "load_sd")(self, sd)

    # (owner, name, replacement, the parameters it relies on, whether the host must have it)
    return [
        (CLIP, "encode_from_tokens", encode_from_tokens, ("self", "tokens", "return_pooled", "return_dict"), True),
        (CLIP, "encode_from_tokens_scheduled", encode_from_tokens_scheduled, ("self", "tokens"), True),
        (CLIP, "load_sd", clip_load_sd, ("self", "sd", "full_model"), True),
        (VAE, "encode", vae_encode, ("self", "pixel_samples"), True),
        (VAE, "encode_tiled", vae_encode_tiled,
         ("self", "pixel_samples", "tile_x", "tile_y", "overlap", "tile_t", "overlap_t"), True),
        *[(VAE, name, tiled_helper(name), ("self",), True) for name in ("encode_tiled_", "encode_tiled_1d", "encode_tiled_3d")],
        (VAE, "_encode_tiled_owned", tiled_helper("_encode_tiled_owned"), ("self", "pixel_samples"), False),  # video VAEs that tile themselves (newer hosts)
        (Vision, "encode_image", encode_image, ("self", "image", "crop"), True),
        (Vision, "load_sd", vision_load_sd, ("self", "sd"), True),
    ]


_NOT_OPTIONS = frozenset({"ckpt_path", "ckpt_paths", "embedding_directory", "disable_dynamic"})


def _enums_by_name(value):
    """Loader options with enums (``CLIPType``) as (class, member name): a key field like any other."""
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__module__, type(value).__qualname__, value.name)
    if type(value) is dict:
        return {k: _enums_by_name(v) for k, v in value.items()}
    return value


def _loader(owner, name: str, parts):
    """A wrapper of one of ComfyUI's loader functions that records where each encoder it returns came
    from (:func:`register_source`). ``parts(arguments, result)`` lists (encoder, files, role)."""
    def load(*args, **kwargs):
        orig = _orig(owner, name)
        result = orig(*args, **kwargs)
        try:
            bound = inspect.signature(orig).bind(*args, **kwargs)
            bound.apply_defaults()
            options = {k: _enums_by_name(v) for k, v in bound.arguments.items() if k not in _NOT_OPTIONS}
            for encoder, files, role in parts(bound.arguments, result):
                if encoder is not None:
                    register_source(encoder, files, f"{owner.__name__}.{name}:{role}", options)
        except Exception as exc:  # never break a load: the encoder only misses the shared tiers
            log.debug("ReuseKit: no source recorded for %s: %s", name, exc)
        return result
    return load


def _loader_methods():
    """ComfyUI's loaders of encoders from files (CLIPLoader, DualCLIPLoader, TripleCLIPLoader and
    the checkpoint and CLIP-vision loaders go through them)."""
    import comfy.clip_vision
    import comfy.sd

    def checkpoint_parts(a, out):
        return [(out[1], [a["ckpt_path"]], "clip"), (out[2], [a["ckpt_path"]], "vae"),
                (out[3] if len(out) > 3 else None, [a["ckpt_path"]], "clip_vision")]

    return [
        (comfy.sd, "load_clip", _loader(comfy.sd, "load_clip", lambda a, out: [(out, list(a["ckpt_paths"]), "clip")]),
         ("ckpt_paths",)),
        (comfy.sd, "load_checkpoint_guess_config", _loader(comfy.sd, "load_checkpoint_guess_config", checkpoint_parts),
         ("ckpt_path",)),
        (comfy.clip_vision, "load", _loader(comfy.clip_vision, "load", lambda a, out: [(out, [a["ckpt_path"]], "clip_vision")]),
         ("ckpt_path",)),
    ]


FEATURE = "conditioning cache"
SHARED_FEATURE = "conditioning cache shared tiers (encoder files)"


def _current(owner, name):
    return vars(owner)[name] if name in vars(owner) else getattr(owner, name, None)


def _where(owner, name) -> str:
    """``comfy.sd.CLIP.encode_from_tokens`` for a patched method, ``comfy.sd.load_clip`` for a function."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def install() -> bool:
    """Route the encoders through the cache. Idempotent; False (nothing changed, one warning) when a
    patched method is missing or shaped otherwise than expected."""
    global _active
    import comfy.clip_vision

    register_container(comfy.clip_vision.Output)
    with _lock:
        if _active:
            return True
        # methods left wrapped by another pack at an uninstall are still in place: only the rest is patched
        methods = [m for m in _make_methods() if (m[0], m[1]) not in _originals and (m[4] or _current(m[0], m[1]) is not None)]
        if not all(host.check(FEATURE, _where(owner, name), _current(owner, name), params)
                   for owner, name, _, params, _ in methods):
            return False
        loaders = [m for m in _loader_methods() if (m[0], m[1]) not in _originals]
        loaders = [m for m in loaders if host.check(SHARED_FEATURE, _where(m[0], m[1]), _current(m[0], m[1]), m[3])]
        for owner, name, fn, *_ in (*methods, *loaders):
            _originals[(owner, name)] = _current(owner, name)
            fn.__reusekit__ = True
            setattr(owner, name, fn)
            _replacements[(owner, name)] = fn
        _active = True
    _configure_tiers()
    return True


def _configure_tiers() -> None:
    """The shared tiers' default folder (under ComfyUI's user directory), then the tiers themselves."""
    import folder_paths

    TIERS.default_folder = os.path.join(folder_paths.get_user_directory(), "reusekit", "conditioning")
    try:
        TIERS.configure(SETTINGS)
    except ValueError as exc:  # a bad REUSEKIT_REDIS_URL: the pack still loads, the Redis tier stays off
        host.say_once("tiers-config", "ReuseKit: the conditioning cache's Redis tier is off: %s", exc,
                      level=logging.WARNING)


def uninstall() -> None:
    """Restore every patched method, except where another pack wrapped ours later: that wrapper stays
    and still works (ours passes straight through to ComfyUI's). Idempotent."""
    global _active
    with _lock:
        for (owner, name), fn in list(_replacements.items()):
            if _current(owner, name) is fn:
                setattr(owner, name, _originals.pop((owner, name)))
                del _replacements[(owner, name)]
            else:
                host.say_once(f"wrapped:{_where(owner, name)}",
                              "ReuseKit: %s was wrapped again by another pack; left in place, passing through",
                              _where(owner, name), level=logging.WARNING)
        _active = False


def installed() -> bool:
    return _active


# ---- helpers for the nodes ---------------------------------------------------------------------

def mark(patcher) -> None:
    """Mark an encoder's (cloned) patcher: its encodes go through the cache even in local mode."""
    patcher.model_options[MARKER] = {}


def cached_copy(obj):
    """A shallow copy of a VAE / CLIP-vision object with its own patcher clone (original untouched)."""
    new = copy.copy(obj)
    new.patcher = obj.patcher.clone()
    return new
