"""Routes ComfyUI's encoders through the conditioning cache (caching/conditioning.py).

Patched (class attributes, one install and one uninstall, idempotent, each shape-checked at install):

- ``comfy.sd.CLIP.encode_from_tokens``: every text node (CLIPTextEncode, Flux, SDXL, SD3,
  Qwen-Image...) reaches the encoder through it, also via ``encode_from_tokens_scheduled``
  (whose hook-scheduled path calls the encoder directly: counted as a bypass);
- ``comfy.clip_vision.ClipVisionModel.encode_image``;
- ``comfy.sd.VAE.encode`` and ``encode_tiled`` (and its tile helpers, ``_encode_tiled_owned`` where
  the host has it, to see an out-of-memory fallback from a plain encode to tiles: that result is
  never stored);
- ``CLIP.load_sd`` / ``ClipVisionModel.load_sd`` (weights replaced in place: a new generation);
- device entries are freed first when ComfyUI needs VRAM (a releaser in patches/memory.py);
- and a ``ModelPatcher.detach`` listener (patches/lifecycle.py): unloading an encoder drops its
  device entries.

A call goes through the cache when global mode is on (setting ``conditioning.enabled``) or when the
encoder object was made by a ReuseKit Cached node (a marker in its patcher's ``model_options``,
which ComfyUI's clones copy). Plain-valued object patches (``manual_cast_dtype``...) are part of the
key. Anything else the key cannot describe exactly (hooks, injections such as bypass LoRA, object
patches holding code or modules, weight wrappers, patcher callbacks and wrappers, autograd, unknown
input types) bypasses the cache and runs unchanged. Every patched method's shape is checked at
install (patches/host.py): on a host that reshaped one, the cache stays off with one warning.
"""

from __future__ import annotations

import copy
import logging
import threading
import types
import weakref

import torch

from ..caching.conditioning import (
    CACHE,
    Key,
    Uncacheable,
    encode_value,
    identity,
    intern_weights,
    known_identity,
    register_container,
)
from ..caching.settings import SETTINGS
from . import host, lifecycle, memory

log = logging.getLogger("reusekit")

MARKER = "reusekit_conditioning"
_GENERATION = "_reusekit_generation"

_lock = threading.Lock()
_originals: dict[tuple[object, str], object] = {}


# ---- key parts ---------------------------------------------------------------------------------

def _mode(patcher) -> tuple[bool, bool]:
    """(route through the cache, keep device tensors) for an encoder's patcher."""
    marker = getattr(patcher, "model_options", {}).get(MARKER)
    if marker is not None:
        return True, bool(marker.get("device_hot")) and SETTINGS.get("conditioning.device_hot_negatives")
    return SETTINGS.get("conditioning.enabled"), False


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


def _patcher_fields(patcher) -> tuple:
    """What else on the patcher decides the encoder's output, as key fields: its class, weight
    casting and plain-valued object patches by name and value. Uncacheable for what a key cannot
    describe: hooks, injections (bypass LoRA), weight wrappers, callbacks and wrappers (code that
    may run at load or in the forward), object patches holding code, modules or objects.
    Attachments (LoRA metadata...) are data that only callbacks and wrappers read: not keyed."""
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
        objects.append((name, encode_value(value)))
    return (type(patcher).__module__, type(patcher).__qualname__,
            encode_value(getattr(patcher, "force_cast_weights", None)), tuple(objects))


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
    """The encoder object's simple settings (numbers, strings, dtypes, devices...), by name."""
    out = []
    for name, value in sorted(vars(obj).items()):
        if name in skip or name.startswith("_") or isinstance(value, (torch.Tensor, torch.nn.Module)):
            continue
        try:
            out.append((name, encode_value(value)))
        except Uncacheable:
            continue  # code (lambdas) and objects: fixed per instance, which the key names already
    return tuple(out)


def _owner(module) -> tuple[int, int]:
    return identity(module), getattr(module, _GENERATION, 0)


def _options(extra: dict) -> tuple:
    """Keyword options a newer host added to an encode (e.g. VAE ``not_video``), in the key by name."""
    return encode_value(tuple(sorted(extra.items())))


def text_key(clip, tokens, return_pooled, return_dict, extra: dict | None = None) -> Key:
    if clip.apply_hooks_to_conds:
        raise Uncacheable("hooks applied to the conditioning")
    model = clip.cond_stage_model
    serial, generation = _owner(model)
    fields = ("encode_from_tokens", type(model).__module__, type(model).__qualname__, generation,
              encode_value(clip.patcher.load_device),  # where it runs: CPU and GPU results differ in bits
              encode_value(clip.layer_idx), encode_value(return_pooled), encode_value(return_dict),
              _options(extra or {}), _precision(), _patcher_fields(clip.patcher), encode_value(tokens))
    return Key("text", fields, owners=(serial,), weights=(_weights(clip.patcher),))


def _fits(pixels) -> None:
    """An input larger than the whole budget could never be stored: do not even copy it into a key."""
    if isinstance(pixels, torch.Tensor) and pixels.numel() * pixels.element_size() > CACHE.budget_bytes:
        raise Uncacheable("input larger than the budget")


def vision_key(clip_vision, image, crop, extra: dict | None = None) -> Key:
    _fits(image)
    model = clip_vision.model
    serial, generation = _owner(model)
    fields = ("encode_image", type(model).__qualname__, generation, encode_value(crop), _options(extra or {}),
              _precision(),
              _config(clip_vision, ("patcher", "model")), _patcher_fields(clip_vision.patcher), encode_value(image))
    return Key("vision", fields, owners=(serial,), weights=(_weights(clip_vision.patcher),))


def vae_key(vae, method: str, pixels, options: tuple, extra: dict | None = None) -> Key:
    _fits(pixels)
    model = vae.first_stage_model
    if model is None:
        raise Uncacheable("invalid VAE")
    serial, generation = _owner(model)
    fields = (method, type(model).__qualname__, generation, encode_value(options), _options(extra or {}), _precision(),
              _config(vae, ("patcher", "first_stage_model")), _patcher_fields(vae.patcher), encode_value(pixels))
    return Key("vae", fields, owners=(serial,), weights=(_weights(vae.patcher),))


_local = threading.local()  # per thread: inside a plain VAE encode, and whether it fell back to tiles


def _plain_vae_encode(orig, vae, pixel_samples, extra: dict):
    _local.plain, _local.fell_back = True, False
    try:
        return orig(vae, pixel_samples, **extra)
    finally:
        _local.plain = False


def _tiled_fallback_reason():
    return "VAE encode fell back to tiles (out of memory)" if getattr(_local, "fell_back", False) else None


def _route(kind: str, patcher, make_key, compute, check_rng=False, admit=None):
    on, keep_device = _mode(patcher)
    if not on or not CACHE.enabled:
        return compute()
    try:
        key = make_key()
    except Uncacheable as exc:
        CACHE.bypass(kind, str(exc))
        return compute()
    except Exception as exc:  # an encoder object this key builder does not know: never break the encode
        CACHE.bypass(kind, f"unexpected {type(exc).__name__}: {exc}")
        return compute()
    return CACHE.fetch(key, compute, keep_device=keep_device, check_rng=check_rng, admit=admit)


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
        return _route("text", self.patcher,
                      lambda: text_key(self, tokens, return_pooled, return_dict, extra),
                      lambda: orig(self, tokens, return_pooled=return_pooled, return_dict=return_dict, **extra))

    def encode_from_tokens_scheduled(self, tokens, *args, **kwargs):
        if self.patcher.forced_hooks is not None and self.use_clip_schedule and _mode(self.patcher)[0]:
            CACHE.bypass("text", "hook-scheduled encode")
        return _orig(CLIP, "encode_from_tokens_scheduled")(self, tokens, *args, **kwargs)

    # every replacement passes keyword options a newer host added on to it, and keys them
    def vae_encode(self, pixel_samples, **extra):
        orig = _orig(VAE, "encode")
        # ComfyUI retries a plain encode in tiles when it runs out of memory: that result is not
        # what a plain encode gives with room to spare, so it is returned but never stored
        return _route("vae", self.patcher, lambda: vae_key(self, "encode", pixel_samples, (), extra),
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
        return _route("vae", self.patcher, lambda: vae_key(self, "encode_tiled", pixel_samples, options, extra),
                      lambda: orig(self, pixel_samples, tile_x=tile_x, tile_y=tile_y, overlap=overlap,
                                   tile_t=tile_t, overlap_t=overlap_t, **extra), check_rng=True)

    def encode_image(self, image, crop=True, **extra):
        orig = _orig(Vision, "encode_image")
        return _route("vision", self.patcher, lambda: vision_key(self, image, crop, extra),
                      lambda: orig(self, image, crop=crop, **extra))

    def _new_generation(module):
        setattr(module, _GENERATION, getattr(module, _GENERATION, 0) + 1)
        serial = known_identity(module)
        if serial is not None:
            CACHE.drop_owner(serial)

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


def release_device_entries(device: str, need_bytes: int) -> int:
    """When ComfyUI needs memory on ``device`` (patches/memory.py): least recently used device
    entries go first."""
    return CACHE.drop_device(device, need_bytes) if CACHE.device_bytes(device) else 0


def drop_device_entries(patcher, *args, **kwargs) -> None:
    """Before ``ModelPatcher.detach`` (a lifecycle listener): an encoder that ComfyUI unloads
    takes its device entries with it."""
    serial = known_identity(patcher.model)
    if serial is not None:
        CACHE.drop_owner(serial, device_only=True)


FEATURE = "conditioning cache"


def _current(owner, name):
    return vars(owner)[name] if name in vars(owner) else getattr(owner, name, None)


def _where(owner, name) -> str:
    """``comfy.sd.CLIP.encode_from_tokens`` for a class's method, ``comfy.model_management.free_memory``
    for a module's function."""
    prefix = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
    return f"{prefix}.{name}"


def install() -> bool:
    """Route the encoders through the cache. Idempotent; False (nothing changed, one warning) when a
    patched method is missing or shaped otherwise than expected."""
    import comfy.clip_vision

    register_container(comfy.clip_vision.Output)
    with _lock:
        if _originals:
            return True
        methods = [m for m in _make_methods() if m[4] or _current(m[0], m[1]) is not None]
        if not all(host.check(FEATURE, _where(owner, name), _current(owner, name), params)
                   for owner, name, _, params, _ in methods):
            return False
        for owner, name, fn, _, _ in methods:
            _originals[(owner, name)] = _current(owner, name)
            fn.__reusekit__ = True
            setattr(owner, name, fn)
        lifecycle.add_listener("detach", drop_device_entries)
        memory.add_releaser(FEATURE, release_device_entries)
        return True


def uninstall() -> None:
    """Restore every patched method. Idempotent."""
    with _lock:
        for (owner, name), original in _originals.items():
            setattr(owner, name, original)
        _originals.clear()
        lifecycle.remove_listener("detach", drop_device_entries)
        memory.remove_releaser(FEATURE)


def installed() -> bool:
    return bool(_originals)


# ---- helpers for the nodes ---------------------------------------------------------------------

def mark(patcher, device_hot: bool) -> None:
    """Mark an encoder's (cloned) patcher: its encodes go through the cache even in local mode."""
    patcher.model_options[MARKER] = {"device_hot": bool(device_hot)}


def cached_copy(obj):
    """A shallow copy of a VAE / CLIP-vision object with its own patcher clone (original untouched)."""
    new = copy.copy(obj)
    new.patcher = obj.patcher.clone()
    return new
