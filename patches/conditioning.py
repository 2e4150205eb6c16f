"""Routes ComfyUI's encoders through the conditioning cache (caching/conditioning.py).

Patched (class attributes, one install and one uninstall, idempotent, each shape-checked at install):

- ``comfy.sd.CLIP.encode_from_tokens``: every text node (CLIPTextEncode, Flux, SDXL, SD3,
  Qwen-Image...) reaches the encoder through it, also via ``encode_from_tokens_scheduled``
  (whose hook-scheduled path calls the encoder directly: counted as a bypass);
- ``comfy.clip_vision.ClipVisionModel.encode_image``;
- ``comfy.sd.VAE.encode`` and ``encode_tiled`` (and its tile helpers, ``_encode_tiled_owned`` where
  the host has it, to see an out-of-memory fallback from a plain encode to tiles: that result is
  never stored);
- ``CLIP.load_sd`` / ``ClipVisionModel.load_sd`` (weights replaced in place: a new generation) and
  ``VAE.__init__``: the weights they load are fingerprinted as the reference of the edit checks.

A lazy text encoder (patches/lazy_clip.py: built from its files' headers, weights on the ``meta``
device) is keyed exactly as the same files loaded eagerly; its weights load in place on the first
encode that misses every tier.

Entries are CPU copies (caching/conditioning.py): the cache makes no device copy of its own (weight
patches it pins stay where their patcher keeps them), so nothing here hooks ComfyUI's memory manager.

A call goes through the cache when global mode is on (setting ``conditioning.enabled``) or when the
encoder object was made by a ReuseKit Cached node (a marker in its patcher's ``model_options``,
which ComfyUI's clones copy). Plain-valued object patches (``manual_cast_dtype``...), the encoder
modules' own settings (``enable_attention_masks``, ``zero_out_masked``...; a digest, memoised until
one of them changes) and what changes an encode's bits on one device (attention functions, ``--fast``,
TF32 flags) are part of the key. An in-place edit of a weight starts a new generation; it is seen
by events, not by reading every weight per encode (patches/encoder_weights.py). Patcher classes
other than ComfyUI's own are refused. Anything else the key cannot describe exactly (hooks,
injections such as bypass LoRA, object patches holding code or modules, weight wrappers, patcher
callbacks and wrappers, autograd, unknown input types) bypasses the cache and runs unchanged. Every
patched method's shape is checked at install (patches/host.py): on a host that reshaped one, the
cache stays off with one warning.

Shared tiers (disk, Redis: ``caching/tiers.py``) key an encoder by the content of the files it was
loaded from, never by identity. ``comfy.sd.load_clip``, ``load_checkpoint_guess_config`` and
``comfy.clip_vision.load`` are wrapped to record each encoder's files and loader options
(:func:`register_source`, also for custom loaders) with the files' stamps from before the load;
ComfyUI's ``cached_patcher_init`` (VAELoader on 0.2x+) is read for encoders without a record whose
files are older than the VAE's construction (``VAE.__init__`` fingerprints the weights it loads). An
encoder with no record, with weights replaced or edited since loading, a file changed on disk since
(its stamp), a file not hashed yet, or with edit checks off stays in the process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import operator
import os
import platform
import re
import sys
import threading
import time
import types
import weakref

import torch

from ..caching.conditioning import (
    CACHE,
    Key,
    LocalOnly,
    identity,
    intern_weights,
    known_identity,
    register_container,
)
from ..caching.keys import Uncacheable, digest, encode
from ..caching.settings import SETTINGS
from ..caching.tiers import (
    FORMAT,
    TIERS,
    FileHashes,
    SharedKey,
    device_model,
    is_indexed_device,
    portable_device,
)
from ..caching.weight_edits import SETTING as CHECK_SETTING
from ..caching.weight_edits import WeightWatch
from ..caching.weights_identity import plain_leaves
from . import encoder_weights, host, lazy_clip, module_tree

# What a shared key's value means: raised with every fix that changes what an encode stores under a key
# whose text stays the same (a wrong value an older ReuseKit shared), so after an upgrade no worker reads an
# entry an older one wrote (a lazy encoder that dropped its module settings stored a wrong encode under the
# key that held them: an upgraded worker read it as a hit, 0.76 from the encode). 1: the first revision;
# 2: an encode ComfyUI finished another way after running out of memory (sliced attention) is never stored.
KEY_REVISION = 2

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
    """Weight patches as primitives and tensors (adapters opened up); Uncacheable otherwise, and for another
    model's live weights: CLIPMergeSimple, CLIPAdd and CLIPSubtract patch with the other CLIP's own parameters,
    which ComfyUI's hooks (and any in-place edit) change under the patch unseen, so an entry would outlive
    them and a shared one reach other workers."""
    if isinstance(value, torch.nn.Parameter):
        raise Uncacheable("a weight patch holds another model's live weights (CLIPMergeSimple, CLIPAdd, "
                          "CLIPSubtract), which can change in place unseen")
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (list, tuple)):
        return [_patch_structure(v) for v in value] if isinstance(value, list) else tuple(_patch_structure(v) for v in value)
    if isinstance(value, dict):
        return {k: _patch_structure(v) for k, v in value.items()}
    if isinstance(value, types.FunctionType) and value.__closure__ is None:
        return ("function", value.__module__, value.__qualname__, _patch_structure(value.__defaults__),
                _patch_structure(value.__kwdefaults__))
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
    """The interned weight set of a patcher's patches (see :func:`_weights_and_tensors`)."""
    return _weights_and_tensors(patcher)[0]


class _PatchWatch:
    """A patcher's patch tensors as they were when its set was taken: the cheap check of an encode reads
    their sampled values (none whole: its cost follows the number of tensors, never their bytes)."""

    __slots__ = ("named", "watch", "lock")

    def __init__(self, tensors: list[torch.Tensor], prints: tuple[int, ...]):
        self.named = {str(i): t for i, t in enumerate(tensors)}
        self.watch = WeightWatch(small=0)
        self.watch.full(self.named, values=list(prints))
        self.lock = threading.Lock()  # (a WeightWatch is not thread-safe)

    def edited(self) -> bool:
        with self.lock:
            return self.watch.quick(self.named)


def _weights_and_tensors(patcher) -> tuple:
    """(the interned weight set of a patcher's patches, its own patch tensors in the set's order). A set is
    matched by its tensors' full fingerprints, never by the tensor objects, and means what ComfyUI computes
    with (:func:`_written`): while the patcher's patches are written into the weights, what the tensors held
    when they were written, whatever they hold now (a clone, which shares its patches, takes the set of the
    patcher it was cloned from); otherwise what they hold now, which ComfyUI writes at the patcher's next
    load (or, under the dynamic VRAM patcher, reads at every forward). So the set is memoised per patcher
    and patches_uuid, and taken again where it is not written and an encode's cheap check sees one of its
    tensors edited in place (a node editing a loaded LoRA; under ``check_weight_edits`` ``every_encode``,
    every byte). Partly written (some modules unloaded), an edit leaves no set to describe the weights: the
    encode runs uncached. Before a miss is published its tensors are fingerprinted in full again (see
    ``_route``)."""
    if not patcher.patches:
        return None, []
    stamp = (patcher.patches_uuid, len(patcher.patches))
    check = SETTINGS.get(CHECK_SETTING)
    written = _written(patcher)
    with _weight_memo_lock:
        memo = _weight_memo.get(patcher)
        if (memo is None or memo[0] != stamp) and written is not False:  # a clone of the patcher that wrote them
            memo = next((m for p, m in _weight_memo.items() if m[0] == stamp and p.model is patcher.model), memo)
            if memo is not None and memo[0] == stamp:
                _weight_memo[patcher] = memo
    if memo is not None and memo[0] == stamp:
        made, tensors, watch = memo[1:]
        if check == "off" or written is True or not (watch.edited() if check == "events" else not made.holds(tensors)):
            return made, tensors
        if written is None:
            raise Uncacheable("its LoRA's tensors were edited in place while ComfyUI holds them written into part "
                              "of the weights (partly unloaded)")
    structure = {key: _patch_structure(patches) for key, patches in patcher.patches.items()}
    made, tensors, prints = intern_weights(structure)
    with _weight_memo_lock:
        _weight_memo[patcher] = (stamp, made, tensors, _PatchWatch(tensors, prints))
    return made, tensors


def _written(patcher) -> bool | None:
    """Whether ComfyUI holds this patcher's patches written into the weights now (it writes them again only
    after another patcher's were written or the weights were unpatched): True, into all of them; None, into
    part of them (partly unloaded: the modules put back are patched again from the tensors at the next load,
    the others keep what was written); False, not written, or applied at every forward (the dynamic VRAM
    patcher)."""
    import comfy.model_patcher as mp

    model = patcher.model
    if type(patcher) is not mp.ModelPatcher or getattr(model, "current_weight_patches_uuid", None) != patcher.patches_uuid:
        return False
    return None if getattr(model, "model_lowvram", False) else True


def _patch_tensors(patcher, weights) -> list[torch.Tensor] | None:
    """The patcher's own patch tensors behind ``weights`` (its set, just taken), in the set's order; None
    where its set was taken again meanwhile (another thread's encode)."""
    if weights is None:
        return []
    with _weight_memo_lock:
        memo = _weight_memo.get(patcher)
    return memo[2] if memo is not None and memo[1] is weights else None


def _precision(device: torch.device | None) -> tuple:
    """Autocast (on the CPU, CUDA and the encode's own device: Apple's MPS, XPU...) and what else changes an
    encode's bits on the same device: ComfyUI's attention functions and their upcasting, its ``--fast`` options,
    TF32 and reduced-precision matmul flags, the scaled-dot-product backends, cuDNN's algorithm choice; for an
    encode on the CPU, torch's thread count, which splits its matrix products (a node may set it between two
    encodes)."""
    if torch.is_grad_enabled():
        raise Uncacheable("autograd is enabled")
    on_cpu = device is not None and device.type == "cpu"
    fields = []
    own = () if device is None or device.type in ("cpu", "cuda") else (device.type,)
    for device_type in ("cpu", "cuda", *own):
        try:
            on = torch.is_autocast_enabled(device_type)
            fields.append((device_type, on, str(torch.get_autocast_dtype(device_type)) if on else None))
        except (AttributeError, TypeError, RuntimeError):
            fields.append((device_type, None, None))
    return (*fields, torch.get_num_threads() if on_cpu else None, _numerics())


def _where_defined(fn) -> str | None:
    return None if fn is None else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


# Functions encoders call through their module at every call, which a node may replace for the whole process
# (a low-precision attention kernel put in F.scaled_dot_product_attention): torch's, by name, and the ComfyUI
# attention functions a VAE's blocks hold or call (AttnBlock keeps the one picked at its build).
_WATCHED_FUNCTIONS = (
    ("torch.nn.functional", ("scaled_dot_product_attention", "linear", "layer_norm", "group_norm", "rms_norm",
                             "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                             "silu", "gelu", "relu", "mish", "softmax", "sigmoid", "tanh", "softplus", "leaky_relu",
                             "embedding", "interpolate", "pad", "normalize", "dropout", "batch_norm", "instance_norm",
                             "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool2d", "adaptive_avg_pool2d", "unfold",
                             "glu", "elu", "hardswish")),
    ("torch", ("matmul", "bmm", "baddbmm", "einsum", "softmax", "layer_norm", "group_norm", "cat")),
    ("comfy.ops", ("scaled_dot_product_attention",)),
    ("comfy.ldm.modules.diffusionmodules.model", ("slice_attention", "normal_attention", "xformers_attention",
                                                  "pytorch_attention", "vae_attention")),
)
_verdicts: dict[tuple[str, str], tuple] = {}  # (module, name) -> (the object last seen there, its key field or None)


def _replaced_functions() -> tuple:
    """The watched functions (:data:`_WATCHED_FUNCTIONS`) that are not their library's own now: torch's by its
    files or builtins, ComfyUI's by its files (whenever another pack replaced one), each by name, where its
    replacement is defined, and which object it is (a node's closure made anew with other settings is another).
    One identity check per name on every encode; a replacement is judged once."""
    out = []
    for module_name, names in _WATCHED_FUNCTIONS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            value = getattr(module, name, None)
            seen = _verdicts.get((module_name, name))
            if seen is None or seen[0] is not value:
                seen = _verdicts[module_name, name] = (value, None if value is None or _native(value, module_name)
                                                       else (f"{module_name}.{name}", _where_defined(value)))
            if seen[1] is not None:
                out.append((*seen[1], id(value)))
    return tuple(out)


def _native(fn, module_name: str) -> bool:
    """Whether ``fn`` is its library's own: torch's builtins and the code in torch's files, or ComfyUI's code."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return isinstance(fn, types.BuiltinFunctionType) and (getattr(fn, "__module__", None) or "").startswith("torch")
    if module_name.startswith("comfy."):
        return host.file_origin(code.co_filename) == "host"
    return os.path.realpath(code.co_filename).startswith(os.path.dirname(os.path.realpath(torch.__file__)) + os.sep)


def _matmul_precision() -> tuple:
    """torch's float32 matmul precision: the old setting, and each backend's ``fp32_precision`` (torch 2.9 and
    newer), with which the old getter raises once one is set otherwise."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the new API: the backends' settings below say it
        legacy = None
    backends = torch.backends
    return (legacy, *(getattr(owner, "fp32_precision", None) for owner in (
        backends, getattr(backends.cuda, "matmul", None), getattr(backends.cudnn, "conv", None),
        getattr(backends.cudnn, "rnn", None), getattr(backends.mkldnn, "matmul", None),
        getattr(backends.mkldnn, "conv", None), getattr(backends.mkldnn, "rnn", None))))


def _numerics() -> tuple:
    import comfy.cli_args

    attention = sys.modules.get("comfy.ldm.modules.attention")
    mm = sys.modules.get("comfy.model_management")
    # the dtype ComfyUI hands a VAE's output in (0.33: float16 under --fp16-intermediates)
    intermediate = getattr(mm, "intermediate_dtype", None)
    # the attention text encoders run, picked at every encode (optimized_attention_for_device): pytorch's or the
    # basic one, whatever optimized_attention names (sage, flash or xformers beside --use-split-cross-attention)
    small = getattr(mm, "pytorch_attention_enabled", None)
    matmul, cudnn, cuda = torch.backends.cuda.matmul, torch.backends.cudnn, torch.backends.cuda
    fast = getattr(comfy.cli_args.args, "fast", None)
    flags = (_matmul_precision(), matmul.allow_tf32,
             getattr(matmul, "allow_fp16_reduced_precision_reduction", None),
             getattr(matmul, "allow_bf16_reduced_precision_reduction", None),
             getattr(matmul, "allow_fp16_accumulation", None),
             cudnn.enabled, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled(), torch.backends.mkldnn.enabled,
             *(getattr(cuda, f, lambda: None)() for f in ("flash_sdp_enabled", "mem_efficient_sdp_enabled",
                                                          "math_sdp_enabled", "cudnn_sdp_enabled")))
    return ("numerics", repr(flags),
            _where_defined(getattr(attention, "optimized_attention", None)),
            _where_defined(getattr(attention, "optimized_attention_masked", None)),
            None if small is None else bool(small()),
            None if fast is None else tuple(sorted(str(getattr(f, "value", f)) for f in fast)),
            None if intermediate is None else str(intermediate()),
            # the attention functions' softmax precision (--force-upcast-attention, --dont-upcast-attention)
            repr(getattr(attention, "FORCE_UPCAST_ATTENTION_DTYPE", None)),
            getattr(comfy.cli_args.args, "dont_upcast_attention", None),
            _replaced_functions())


def _config(obj, skip: tuple[str, ...]) -> tuple:
    """The encoder wrapper's own settings (numbers, strings, dtypes, code by where it is defined), by
    name; its closures (VAE memory estimators) by their code; methods of its own model (SeedVR2's
    ``format_encoded``) by where they are defined (the model is keyed by its weights and settings)."""
    own = tuple(getattr(obj, name, None) for name in skip)
    return tuple((name, _own_method(value) if _is_own_method(value, own) else _setting(name, value, closures=True))
                 for name, value in sorted(vars(obj).items())
                 if name not in skip and not name.startswith("_") and not isinstance(value, (torch.Tensor, torch.nn.Module)))


def _is_own_method(value, own: tuple) -> bool:
    return isinstance(value, types.MethodType) and any(value.__self__ is o for o in own if isinstance(o, torch.nn.Module))


def _own_method(value) -> tuple:
    code = value.__func__.__code__
    return ("method", value.__func__.__module__, value.__func__.__qualname__, code.co_filename, code.co_firstlineno)


def _bound_method(name: str, value: types.MethodType, closures: bool, modules: dict | None, depth: int) -> tuple:
    """A method bound to an instance and set on an encoder module (a node's monkeypatch of ``forward`` or
    ``encode_token_weights``): its function by where it is defined, the object it is bound to as a setting
    (a module of the encoder by its path). Uncacheable where its function captures values (unless
    ``closures``) or its object is one a key cannot describe."""
    if value.__func__.__closure__ is not None and not closures:
        raise Uncacheable(f"encoder setting {name!r} is a method whose function captures values")
    return (_function(name, value.__func__, closures, modules, depth),
            _setting(f"{name}.__self__", value.__self__, closures, modules, depth + 1))


def _instance_method(value: types.MethodType, name: str, path: str, modules: dict):
    """What a method set on the instance of the module at ``path`` stands for in its key: through ComfyUI's
    bypass LoRA hooks (another patcher's injection, ejected before this encode runs; a patcher's own make its
    encodes uncacheable first) the forward they wrap; None for the module's own class method bound to it
    (what the hook leaves after ejecting: as if unset)."""
    while isinstance(value, types.MethodType) and type(value.__self__).__module__ == "comfy.weight_adapter.bypass" \
            and hasattr(value.__self__, "original_forward"):
        value = value.__self__.original_forward
    if isinstance(value, types.MethodType) and getattr(type(value.__self__), name, None) is value.__func__ \
            and modules.get(id(value.__self__)) == path:
        return None
    return value


def _setting(name: str, value, closures: bool = False, modules: dict | None = None, depth: int = 0):
    """A setting as a key field: plain values whole, classes and functions by where they are defined;
    with ``modules`` (the encoder's modules by id: their path), a plain object of ComfyUI's own code (the
    LTX-2 audio VAE's normalizer and preprocessor) by its class and attributes, a module it refers to by
    its path in the encoder (its weights are the encoder's). Uncacheable for other objects, for modules
    outside the encoder and (unless ``closures``) for functions that capture values."""
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", getattr(value, "__module__", None), value.__qualname__)
    if isinstance(value, types.FunctionType) and (closures or value.__closure__ is None):
        return _function(name, value, closures, modules, depth)
    if isinstance(value, types.MethodType) and isinstance(value.__func__, types.FunctionType):
        return _bound_method(name, value, closures, modules, depth)
    if type(value) in (list, tuple):
        return ("L" if type(value) is list else "U",
                tuple(_setting(name, v, closures, modules, depth + 1) for v in value))
    if modules is not None and depth < _OBJECT_DEPTH:
        if isinstance(value, torch.nn.Module) and id(value) in modules:
            return ("module", modules[id(value)])
        if _host_object(value):  # compared by value on every use: never a tensor, whose bytes that would read
            attrs = sorted(vars(value).items())
            if any(isinstance(v, torch.Tensor) for _, v in attrs):
                raise Uncacheable(f"encoder setting {name!r} holds a {type(value).__name__} holding a tensor")
            return ("object", type(value).__module__, type(value).__qualname__,
                    tuple((k, _setting(f"{name}.{k}", v, closures, modules, depth + 1)) for k, v in attrs))
    try:
        return encode(value)
    except Uncacheable:
        raise Uncacheable(f"encoder setting {name!r} holds a {type(value).__name__}") from None


_OBJECT_DEPTH = 4  # how deep plain objects are followed inside a setting


def _function(name: str, fn: types.FunctionType, closures: bool, modules: dict | None, depth: int) -> tuple:
    """A function as a key field: where it is defined, its defaults and, for code not ComfyUI's, what it
    captures (a node's ``lambda image, s=s: ...``, or one closing over ``s``, is another function for each
    ``s``). The host's own closures (a VAE's memory estimators) by where they are defined: they follow from
    its code."""
    if depth > _OBJECT_DEPTH:
        raise Uncacheable(f"encoder setting {name!r} nests functions too deep")
    code = fn.__code__
    defaults = None if fn.__defaults__ is None and not fn.__kwdefaults__ else _setting(
        f"{name} (its defaults)", (fn.__defaults__, tuple(sorted((fn.__kwdefaults__ or {}).items()))), closures,
        modules, depth + 1)
    cells = ()
    if fn.__closure__ and (_origin(fn.__module__) != "host" or host.file_origin(code.co_filename) != "host"):
        # (a wrapper made with functools.wraps takes the module name of what it wraps: told by its file)
        cells = tuple(_setting(f"{name} (its {var})", _contents(cell), closures, modules, depth + 1)
                      for var, cell in zip(code.co_freevars, fn.__closure__, strict=True))
    return ("function", fn.__module__, fn.__qualname__, code.co_filename, code.co_firstlineno, defaults, cells)


def _contents(cell) -> tuple:
    try:
        return ("cell", cell.cell_contents)
    except ValueError:  # a variable not yet assigned
        return ("empty cell",)


def _host_object(value) -> bool:
    """A plain instance of a class of ComfyUI's own code (``comfy.*``): data its modules hold beside them."""
    cls = type(value)
    return (cls.__module__.startswith("comfy.") and type(getattr(value, "__dict__", None)) is dict
            and not isinstance(value, (torch.nn.Module, torch.Tensor)) and not callable(value))


def _may_change(value) -> bool:
    """Whether a setting can change in place: a container, a dataclass, a host object, or a tuple holding one."""
    if type(value) is tuple:
        return any(map(_may_change, value))
    return isinstance(value, (list, dict, set)) or dataclasses.is_dataclass(value) or _host_object(value)


def _module_state(model: torch.nn.Module, patcher, wrapper) -> tuple:
    """Every plain-valued setting of the encoder's modules (``enable_attention_masks``,
    ``zero_out_masked``, special tokens, ``training``...) by module path and name, as they are without
    ComfyUI's object patches (patches/module_tree.py; a patcher's own object patches are keyed by
    ``_patcher_fields``), as a digest; a method a node set on a module's instance by where it is defined
    and what it is bound to, compared on every use (:func:`_instance_method`). Uncacheable
    for module hooks and for settings a key cannot describe. Kept with the module's tree while it is
    unchanged, the settings held in containers and dataclasses compared by value."""
    import torch.nn.modules.module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        raise Uncacheable("global module hooks")
    tree = module_tree.tree(model, patcher)
    if tree.hooked is not None:
        raise Uncacheable(f"hooks on encoder module {tree.hooked!r}")
    classes = _classes_state(tree, wrapper)
    found = tree.memo.get("settings")
    if found is not None and all(_setting(path, value, modules=found[2]) == field for path, value, field in found[1]):
        return found[0], classes
    modules = {id(m): path for path, m in model.named_modules()}
    out, mutables = [], []
    for path, name, value in tree.settings:
        method = isinstance(value, types.MethodType)
        if method and (value := _instance_method(value, name, path, modules)) is None:
            continue
        full = f"{path}.{name}" if path else name
        field = _setting(full, value, modules=modules)
        if method or isinstance(value, types.FunctionType) or _may_change(value):  # (a function: its defaults)
            mutables.append((full, value, field))  # may change in place: compared by value on every use
        out.append((path, name, field))
    found = tree.memo["settings"] = (digest(tuple(out)), mutables, modules)  # thousands of settings in a VAE: a digest
    return found[0], classes


_PACK = __name__.rsplit(".", 2)[0]  # this pack's package, as ComfyUI imported it
_origins: dict[str, str] = {}  # module name -> "host", "library" or "other"


def _origin(module: str | None) -> str:
    """Where a module's code comes from: "host" (ComfyUI outside its custom_nodes, or this pack), "library"
    (the standard library, torch, an installed package) or "other" (another custom node, a script)."""
    found = _origins.get(module)
    if found is None:
        path = getattr(sys.modules.get(module), "__file__", None)
        if module == _PACK or (module or "").startswith(_PACK + "."):
            found = "host"
        elif path is None:  # builtins, a frozen module; a module no longer imported
            found = "library" if module in sys.builtin_module_names or module in sys.modules else "other"
        else:
            found = host.file_origin(path)
        _origins[module] = found
    return found


def _compiled_from(fn, module: str | None) -> str | None:
    """The file a function's code was compiled from where that is not its module's source (a node's
    ``fn.__code__ = other.__code__``), else None; None too where it cannot be told (a module without a
    source file, code made by ``exec``)."""
    file = fn.__code__.co_filename
    source = getattr(sys.modules.get(module), "__file__", None)
    if not source or not source.endswith(".py") or not os.path.isabs(file) \
            or os.path.realpath(file) == os.path.realpath(source):
        return None
    return file


def _foreign(cls: type, module: str | None) -> bool:
    """Code of another custom node or script than the class's own package."""
    return (module or "").split(".")[0] != cls.__module__.split(".")[0] and _origin(module) == "other"


def _captured(cls: type, name: str, value, gaps: list, depth: int):
    """A value a library function captures (a decorator's function and arguments: ``torch.autocast``'s
    dtype), a method's object or a function's defaults, as far as a key can tell it; what it cannot is
    named in ``gaps``."""
    if type(value) in (bool, int, float, str, bytes, type(None)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, types.BuiltinFunctionType) and inspect.ismodule(getattr(value, "__self__", None)):
        return ("builtin", value.__module__, value.__qualname__)  # a module's (a method bound to an object: a gap)
    if isinstance(value, types.FunctionType):
        return _class_code(cls, name, value, gaps, depth + 1)
    if isinstance(value, types.MethodType):
        return ("method", _captured(cls, name, value.__func__, gaps, depth + 1),
                _captured(cls, name, value.__self__, gaps, depth + 1))
    if depth < 4 and type(value) in (tuple, list):
        return (type(value).__name__, tuple(_captured(cls, name, v, gaps, depth + 1) for v in value))
    if depth < 4 and type(value) is dict and all(type(k) is str for k in value):
        return ("dict", tuple((k, _captured(cls, name, value[k], gaps, depth + 1)) for k in sorted(value)))
    if depth < 4 and type(getattr(value, "__dict__", None)) is dict \
            and not isinstance(value, (torch.nn.Module, torch.Tensor)) and not _foreign(cls, type(value).__module__):
        return ("object", type(value).__module__, type(value).__qualname__,
                tuple((k, _captured(cls, name, v, gaps, depth + 1)) for k, v in sorted(vars(value).items())))
    gaps.append(f"{_what(cls, name)} holds a {type(value).__qualname__}")
    return ("?", type(value).__module__, type(value).__qualname__)


def _class_code(cls: type, name: str, fn, gaps: list, depth: int = 0) -> tuple:
    """A function a class holds by where it is defined (module and name) with its defaults, through the
    functions it wraps (``torch.no_grad``, ``functools.wraps``), a library function with what it captures.
    Uncacheable where its code comes from another custom node or script than the class's own package (a
    node's class-level monkeypatch, or code put into the host's function): what it reads is not in the key."""
    module = fn.__globals__.get("__name__")
    if _foreign(cls, module):
        raise Uncacheable(f"{_what(cls, name)} is code from {module}")
    elsewhere = _compiled_from(fn, module)
    if elsewhere is not None:
        if host.file_origin(elsewhere) == "other":
            raise Uncacheable(f"{_what(cls, name)} runs code from {elsewhere}")
        gaps.append(f"{_what(cls, name)} runs code compiled from another file")
    if depth > _DEPTH:
        gaps.append(f"{_what(cls, name)} wraps too deep")
        return ("f", module, fn.__qualname__)
    cells = None
    if fn.__closure__ and _origin(module) == "library":  # the host's own closures follow from its code and files
        cells = tuple(_captured(cls, name, c.cell_contents, gaps, depth) if v != "__class__" else None
                      for v, c in zip(fn.__code__.co_freevars, fn.__closure__, strict=True))
    defaults = tuple(_captured(cls, name, d, gaps, depth + 1) for d in (fn.__defaults__, fn.__kwdefaults__))
    inner = getattr(fn, "__wrapped__", None)
    return ("f", module, fn.__qualname__, _code_digest(fn.__code__), defaults, cells,
            _class_code(cls, name, inner, gaps, depth + 1) if isinstance(inner, types.FunctionType) else None)


def _what(cls: type, name: str) -> str:
    """What a class's description names: its attribute, or a module-level function its code calls."""
    if name.startswith(_READ):
        return f"{name[len(_READ):]} (a module function {cls.__qualname__}'s code calls)"
    return f"{cls.__qualname__}.{name} on the encoder's class"


def _code_digest(code: types.CodeType) -> str:
    """What a code object runs, without where it was compiled (file, lines): its bytecode, names and
    constants, the code it nests included (code put into a function from the same file, or from ``exec``)."""
    def const(c):
        if isinstance(c, types.CodeType):
            return ("code", _code_digest(c))
        if type(c) is tuple:
            return tuple(map(const, c))
        if type(c) is frozenset:  # its order follows the process's string hashes
            return ("frozenset", tuple(sorted(map(repr, c))))
        return repr(c)

    parts = (code.co_name, code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
             code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
             tuple(map(const, code.co_consts)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _class_value(cls: type, name: str, value, gaps: list):
    if isinstance(value, types.FunctionType):
        return _class_code(cls, name, value, gaps)
    if isinstance(value, (staticmethod, classmethod)):
        return (type(value).__name__, _class_value(cls, name, value.__func__, gaps))
    if isinstance(value, property):
        return ("property", *(None if f is None else _class_value(cls, name, f, gaps)
                              for f in (value.fget, value.fset, value.fdel)))
    if isinstance(value, (functools.partial, functools.partialmethod)):
        return ("partial", _class_value(cls, name, value.func, gaps), _captured(cls, name, value.args, gaps, 1),
                _captured(cls, name, value.keywords, gaps, 1))
    if isinstance(getattr(value, "__wrapped__", None), types.FunctionType):  # functools.lru_cache
        return (type(value).__qualname__, _class_code(cls, name, value.__wrapped__, gaps))
    if isinstance(value, types.MethodType):
        if _foreign(cls, getattr(value.__func__, "__module__", None)) or _foreign(cls, type(value.__self__).__module__):
            raise Uncacheable(f"{cls.__qualname__}.{name} on the encoder's class is a method of another node")
    return _captured(cls, name, value, gaps, 0)


# attributes Python itself sets or caches on a class (copy's __slotnames__, abc's registry), and code an
# encode never runs (what builds a module is seen in what it built: its settings and weights)
_NOT_CODE = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__",
                       "__firstlineno__", "__static_attributes__", "__abstractmethods__", "_abc_impl", "__slots__",
                       "__slotnames__", "__init__", "__new__", "__init_subclass__", "__set_name__", "__repr__",
                       "extra_repr"})
_classes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> [next number, [(bases, attributes, field)]]: weak
_classes_lock = threading.Lock()
_ROUTES: set = set()  # (class, name) of the methods ReuseKit routes (its own install changes them)


def _our_route(cls: type, name: str, value) -> bool:
    """Whether ``cls.name`` is still ReuseKit's own route (left out of the class's key: its install and
    uninstall never make another key); another node's code set over it is keyed as any other code."""
    return (cls, name) in _ROUTES and type(value) is types.FunctionType and value.__dict__.get("__reusekit__") is True


@dataclasses.dataclass(frozen=True)
class _Container:
    """A list, dict, set or bytearray a class holds: itself and a copy of what it held (changed in place
    or not, compared by value too)."""

    value: object
    held: object


@dataclasses.dataclass(frozen=True)
class _Function:
    """A function a class holds, weakly, with what can be set on it in place: its code and its defaults
    (``forward.__code__ = ...``, held as :func:`_weakly` holds anything), and the function it wraps
    (``__wrapped__``), the same way."""

    ref: weakref.ref
    code: weakref.ref
    defaults: object
    kwdefaults: object
    inner: object


@dataclasses.dataclass(frozen=True)
class _Wrapper:
    """A holder of functions (:func:`_parts`): its type and what it holds, each as :func:`_weakly` holds it."""

    kind: type
    parts: tuple


_DEPTH = 8  # how deep what a class holds is followed (a function that wraps itself ends there)


def _weakly(value, depth: int = 0):
    """What identifies a class attribute, and what can change inside it, without keeping anything alive
    that may reach the class (a property's function can capture a module of it: torch's parametrizations)."""
    if depth < _DEPTH:
        deeper = functools.partial(_weakly, depth=depth + 1)
        if isinstance(value, types.FunctionType):
            inner = getattr(value, "__wrapped__", None)
            return _Function(weakref.ref(value), weakref.ref(value.__code__), deeper(value.__defaults__),
                             deeper(value.__kwdefaults__), deeper(inner) if isinstance(inner, types.FunctionType) else None)
        parts = _parts(value)
        if parts is not None:
            return _Wrapper(type(value), tuple(map(deeper, parts)))
    if type(value) in _CONTAINERS:
        return _Container(value, _snapshot(value))
    return _reference(value)


def _reference(value):
    try:
        return weakref.ref(value)
    except TypeError:  # plain values as they are; anything else is never kept (it may reach the class): changed
        return value if _plain(value) else _UNKNOWN


_UNKNOWN = object()


def _parts(value) -> tuple | None:
    """What a holder of functions holds now, or None for anything else: a staticmethod's or classmethod's
    function, a property's accessors, a tuple's items, a partial's function, arguments and keywords, the
    function a cache (``functools.lru_cache``) wraps."""
    if isinstance(value, (staticmethod, classmethod)):
        return (value.__func__,)
    if isinstance(value, property):
        return (value.fget, value.fset, value.fdel)
    if type(value) is tuple:
        return value
    if isinstance(value, (functools.partial, functools.partialmethod)):
        return (value.func, value.args, value.keywords)
    if isinstance(value, types.FunctionType):
        return None
    try:
        inner = getattr(value, "__wrapped__", None)
    except Exception:  # an attribute that fails to read (a __getattr__ that raises): described as a gap
        return None
    return (inner,) if isinstance(inner, types.FunctionType) else None


_CONTAINERS = (list, dict, set, bytearray)


def _plain(value, depth: int = 0) -> bool:
    """Plain values, and containers of them: what holds no object."""
    if type(value) in (list, tuple, set, frozenset):
        return depth < 4 and all(_plain(x, depth + 1) for x in value)
    if type(value) is dict:
        return depth < 4 and all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in value.items())
    return type(value) in _PLAIN or type(value) in (bytes, bytearray)


def _snapshot(value):
    """A copy of a class-level container to compare it with later: deep where it holds only plain values
    and containers (a list inside a list changed in place), else shallow (never a copy of a tensor)."""
    return copy.deepcopy(value) if _plain(value) else copy.copy(value)


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # contents that do not compare (tensors): changed
        return False


def _same(held, value) -> bool:
    """Whether ``value`` is what :func:`_weakly` made ``held`` of, unchanged."""
    if isinstance(held, weakref.ref):
        found = held()
        return found is not None and found is value  # a dead reference: changed
    if isinstance(held, _Function):
        if held.ref() is not value or held.code() is not value.__code__:
            return False
        inner = getattr(value, "__wrapped__", None)
        return _same(held.defaults, value.__defaults__) and _same(held.kwdefaults, value.__kwdefaults__) \
            and _same(held.inner, inner if isinstance(inner, types.FunctionType) else None)
    if isinstance(held, _Container):
        return held.value is value and _equal(held.held, value)
    if isinstance(held, _Wrapper):
        now = _parts(value) if type(value) is held.kind else None
        return now is not None and len(now) == len(held.parts) and all(map(_same, held.parts, now))
    return held is value


def _watch(value, functions: list, containers: list, holders: list, depth: int = 0) -> None:
    """What can change inside a class attribute while the attribute stays the same object, as :func:`_same`
    compares it: the functions it holds (their code, defaults and what they wrap, by identity) into
    ``functions``, its containers (with a copy, compared by value) into ``containers``, what its holders of
    functions hold (:func:`_parts`, by identity) into ``holders``."""
    if depth >= _DEPTH:
        return
    deeper = functools.partial(_watch, functions=functions, containers=containers, holders=holders, depth=depth + 1)
    if isinstance(value, types.FunctionType):
        inner = getattr(value, "__wrapped__", None)
        functions.append((value, value.__code__, value.__defaults__, value.__kwdefaults__, inner))
        for v in (value.__defaults__, value.__kwdefaults__, inner if isinstance(inner, types.FunctionType) else None):
            deeper(v)
    elif type(value) in _CONTAINERS:
        containers.append((value, _snapshot(value)))
    elif (parts := _parts(value)) is not None:
        if type(value) is not tuple:  # a tuple's items never change
            holders.append((value, parts))
        for v in parts:
            deeper(v)


def _described(cls: type, name: str, value, gaps: list, strict: bool):
    """:func:`_class_value`, with what fails to read as a gap; and without ``strict`` (ComfyUI's wrapper
    classes: most of their methods never run in an encode) another node's code as a gap too."""
    try:
        return _class_value(cls, name, value, gaps)
    except Uncacheable as exc:
        if strict:
            raise
        gaps.append(str(exc))
    except Exception as exc:  # an attribute that fails to read (a __getattr__ that raises)
        gaps.append(f"{cls.__qualname__}.{name} could not be read: {type(exc).__name__}")
    return ("?",)


def _functions_in(value) -> list:
    """The functions a class attribute runs (a method, a static or class method's, a property's accessors, a
    partial's), whose code may read module-level functions."""
    if isinstance(value, types.FunctionType):
        return [value]
    parts = _parts(value) if not isinstance(value, tuple) else None
    return [f for p in parts or () for f in _functions_in(p)]


# what these modules' functions decide (devices, memory, offloading) is keyed by the device, dtype and precision
# fields; multi-GPU packs wrap them, and the server sets callbacks there, which must not keep every encode out of
# the cache or the shared tiers
_KEYED_ELSEWHERE = frozenset({"comfy.model_management", "comfy.memory_management"})


def _host_module(module) -> bool:
    """Whether a module is ComfyUI's (its ``comfy`` package too, a namespace package with no file of its own)."""
    paths = [] if getattr(module, "__file__", None) else list(getattr(module, "__path__", ()))
    return _origin(module.__name__) == "host" or any(host.file_origin(os.path.join(p, "")) == "host" for p in paths)


_READ = "global "  # the label of a module-level function a class's code reads, before its module and name


def _reads(cls: type) -> list[tuple[str, dict, str, object]]:
    """The module-level functions (and partials) of ComfyUI modules that the class's own code reads by name
    (through a module, as ``qwen_vl.process_qwen2vl_images``), and that theirs read in turn, each as ``(label, the
    module's namespace, name, value)``: a node that rebinds one, or sets its defaults, changes what an encode
    computes as surely as one that patches the class. Where ReuseKit routes a method, the host's original is
    read; ReuseKit's own functions and those of ``_KEYED_ELSEWHERE`` are left out."""
    out: dict[str, tuple] = {}
    todo = [f for k, v in vars(cls).items() if k not in _NOT_CODE
            for f in _functions_in(_originals.get((cls, k)) if _our_route(cls, k, v) else v)]
    seen: set = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        inner = getattr(fn, "__wrapped__", None)  # (a decorator's wrapper: the host's code is inside)
        if isinstance(inner, types.FunctionType):
            todo.append(inner)
        for holder, name, value in host.globals_read(fn, through=_host_module):
            module = holder.get("__name__") or ""
            if (not isinstance(value, (types.FunctionType, functools.partial, types.BuiltinFunctionType))
                    or _origin(module) != "host" or module == _PACK or module.startswith(_PACK + ".")
                    or module in _KEYED_ELSEWHERE or getattr(value, "__dict__", {}).get("__reusekit__") is True):
                continue
            out.setdefault(f"{_READ}{module}.{name}", (holder, name, value))
            inner = value.func if isinstance(value, functools.partial) else value
            if isinstance(inner, types.FunctionType) and _origin(inner.__module__) == "host":
                todo.append(inner)
    return [(label, *found) for label, found in sorted(out.items())]


def _class_state(cls: type, strict: bool, reads: list) -> tuple:
    """A class as a key field, ``(where, description, gaps, state)``: where it is defined, what it holds
    (its bases, :func:`_described`), what the description cannot tell (``gaps``), and which of
    the states this process has seen it in it is (an attribute set, added or removed, new bases, a
    container changed in place make another; back as it was, the same), which tells apart what the
    description cannot. Compared with the states this process recorded of it (by identity, containers by
    value too); described again only in a new one. ``reads``: the class's :func:`_reads`."""
    items = [(k, v) for k, v in vars(cls).items() if k not in _NOT_CODE and not _our_route(cls, k, v)]
    items += [(label, value) for label, _, _, value in reads]  # (labels start with _READ)
    bases = cls.__mro__[1:]
    record = _classes.get(cls)
    for seen_bases, seen_items, field in reversed(record[1] if record is not None else ()):
        if len(seen_bases) == len(bases) and all(r() is c for r, c in zip(seen_bases, bases, strict=True)) \
                and len(seen_items) == len(items) \
                and all(k == h[0] and _same(h[1], v) for (k, v), h in zip(items, seen_items, strict=True)):
            return field
    gaps: list = []
    held = (tuple(f"{b.__module__}.{b.__qualname__}" for b in bases),  # (another node's function bound in a
            # module the code reads: told apart by its state number, kept in this process, never refused)
            tuple((k, _described(cls, k, v, gaps, strict and not k.startswith(_READ))) for k, v in items))
    with _classes_lock:  # one number per state: two states never share one
        record = _classes.setdefault(cls, [0, []])
        field = (f"{cls.__module__}.{cls.__qualname__}", held, tuple(gaps), record[0])
        record[0] += 1
        record[1] = [*record[1][-(_STATES - 1):], (tuple(map(weakref.ref, bases)),
                                                     tuple((k, _weakly(v)) for k, v in items), field)]
    return field


_STATES = 8  # the states of one class remembered (a node switching a patch on and off)


def _classes_state(tree, wrapper) -> tuple:
    """The classes of the encoder's modules (:func:`_class_state`, their bases followed as they are now)
    and of its ComfyUI wrapper (``CLIP``, ``VAE``: another node's code there only keeps the encode in the
    process), as ``(digest of the descriptions, state numbers where a description has gaps, why not
    shared or None)``. Per encode one identity pass over the classes' attributes and what can change inside
    them (:func:`_watch`: functions' code and defaults by identity, containers by value), kept with the
    tree; a difference, or a new tree, asks :func:`_class_state`."""
    wrappers = type(wrapper).__mro__[:-1]
    found = tree.memo.get("classes")
    if found is not None and found[2] == wrappers and all(holder.get(name, _UNKNOWN) is value
                                                          for holder, name, value in found[6]) and all(
            c.__mro__ is mro and tuple(vars(c)) == names and all(map(operator.is_, vars(c).values(), values))
            for c, names, values, mro in found[0]) and all(_equal(held, value) for value, held in found[3]) \
            and all(f.__code__ is code and f.__defaults__ is d and f.__kwdefaults__ is kw
                    and getattr(f, "__wrapped__", None) is inner for f, code, d, kw, inner in found[4]) \
            and all((now := _parts(v)) is not None and len(now) == len(parts) and all(map(operator.is_, now, parts))
                    for v, parts in found[5]):
        return found[1]
    own = tuple(dict.fromkeys(b for c in tree.classes for b in c.__mro__ if b is not torch.nn.Module and b is not object))
    classes = (*own, *wrappers)
    snapshot = [(c, tuple(vars(c)), tuple(vars(c).values()), c.__mro__) for c in classes]
    functions, containers, holders = [], [], []
    bindings = {}  # the module-level callables the classes' code reads (_reads): rebound, or changed inside
    reads = [_reads(c) for c in classes]
    for c, read in zip(classes, reads, strict=True):
        for k, v in vars(c).items():
            if k not in _NOT_CODE:
                _watch(v, functions, containers, holders)
        for _, holder, name, value in read:
            bindings[id(holder), name] = (holder, name, value)
    for _, _, value in bindings.values():
        _watch(value, functions, containers, holders)
    fields = tuple(_class_state(c, i < len(own), read) for i, (c, read) in enumerate(zip(classes, reads, strict=True)))
    gaps = [g for f in fields for g in f[2]]
    state = (digest(tuple(f[:3] for f in fields)), tuple(f[3] for f in fields if f[2]),
             gaps[0] if gaps else None)
    tree.memo["classes"] = (snapshot, state, wrappers, containers, functions, holders, tuple(bindings.values()))
    return state


def _weights_loaded(module, patcher, started_ns: int | None = None) -> None:
    """Weights just loaded into ``module`` (a VAE built, ``load_sd``): fingerprinted now, before any
    other node can touch them, as the reference of its edit checks (and of its shared identity)."""
    if not _active or not isinstance(module, torch.nn.Module) or patcher is None or lazy_clip.quiet():
        return  # a lazy encoder's weights are fingerprinted once, when they are read (patches/lazy_clip.py)
    try:
        encoder_weights.reset(module, patcher, started_ns)
    except Exception as exc:  # never break a load: the first encode takes the reference instead
        log.debug("ReuseKit: no weight reference at load: %s", exc)


def _new_generation(module) -> None:
    """Weights replaced or edited: the encoder's old entries are dropped and its keys change."""
    setattr(module, _GENERATION, getattr(module, _GENERATION, 0) + 1)
    serial = known_identity(module)
    if serial is not None:
        CACHE.drop_owner(serial)


def _owner(module, patcher, token_ids=()) -> tuple[int, int]:
    """The encoder's serial and weight generation, after checking its weights for in-place edits
    (patches/encoder_weights.py: an edit starts a new generation). A lazy encoder whose weights were not
    read yet has none to check: its tensors must still be the ones it was built with."""
    if lazy_clip.pending(module):
        lazy_clip.check_intact(module)
    elif encoder_weights.check(module, patcher, token_ids):
        _new_generation(module)
    return identity(module), getattr(module, _GENERATION, 0)


def _token_ids(tokens) -> list[int]:
    """The embedding rows an encode reads: the integer token ids of a tokenized prompt (``{name: [[(token,
    weight, ...), ...], ...]}``), and the positions 0 to its longest sequence's length (a learned position
    table, CLIP's, is read by position). Anything else in it is keyed by value and checked otherwise."""
    ids, longest = [], 0
    if isinstance(tokens, dict):
        for batches in tokens.values():
            for batch in batches if isinstance(batches, list) else ():
                if isinstance(batch, list):
                    longest = max(longest, len(batch))
                for item in batch if isinstance(batch, list) else ():
                    token = item[0] if isinstance(item, tuple) and item else None
                    if type(token) is int:
                        ids.append(token)
    return [*ids, *range(longest)]


def _options(extra: dict) -> tuple:
    """Keyword options a newer host added to an encode (e.g. VAE ``not_video``), in the key by name."""
    return encode(tuple(sorted(extra.items())))


# where each kind's key fields hold the in-process weight generation (left out of a shared key)
_GENERATION_AT = {"text": 3, "vision": 2, "vae": 2}
_MODULE_STATE_AT = {"text": 11, "vision": 8, "vae": 8}  # _module_state's field: its class changes stay in the process


def text_key(clip, tokens, return_pooled, return_dict, extra: dict | None = None) -> Key:
    if clip.apply_hooks_to_conds:
        raise Uncacheable("hooks applied to the conditioning")
    model = clip.cond_stage_model
    serial, generation = _owner(model, clip.patcher, _token_ids(tokens))
    fields = ("encode_from_tokens", type(model).__module__, type(model).__qualname__, generation,
              encode(clip.patcher.load_device),  # where it runs: CPU and GPU results differ in bits
              encode(clip.layer_idx), encode(return_pooled), encode(return_dict),
              _options(extra or {}), _precision(_encode_device(model, clip.patcher)), _patcher_fields(clip.patcher),
              _module_state(model, clip.patcher, clip),
              encode(tokens))
    return Key("text", fields, owners=(serial,), weights=(_weights(clip.patcher),))


def vision_key(clip_vision, image, crop, extra: dict | None = None) -> Key:
    model = clip_vision.model
    serial, generation = _owner(model, clip_vision.patcher)
    fields = ("encode_image", type(model).__qualname__, generation, encode(crop), _options(extra or {}),
              _precision(_encode_device(model, clip_vision.patcher)), _config(clip_vision, ("patcher", "model")),
              _patcher_fields(clip_vision.patcher),
              _module_state(model, clip_vision.patcher, clip_vision), encode(image))
    return Key("vision", fields, owners=(serial,), weights=(_weights(clip_vision.patcher),))


def vae_key(vae, method: str, pixels, options: tuple, extra: dict | None = None) -> Key:
    model = vae.first_stage_model
    if model is None:
        raise Uncacheable("invalid VAE")
    serial, generation = _owner(model, vae.patcher)
    fields = (method, type(model).__qualname__, generation, encode(options), _options(extra or {}),
              _precision(_encode_device(model, vae.patcher)), _config(vae, ("patcher", "first_stage_model")),
              _patcher_fields(vae.patcher), _module_state(model, vae.patcher, vae),
              encode(pixels))
    return Key("vae", fields, owners=(serial,), weights=(_weights(vae.patcher),))


# ---- shared keys: the encoder by its weight files' content -------------------------------------

# module -> (generation, loader, files, options, the files' stamps as loaded)
_sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_sources_lock = threading.Lock()
_patch_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # WeightSet -> digest of its contents


def _encoder_module(encoder):
    """The module holding an encoder's weights (CLIP, VAE, CLIP vision or the module itself)."""
    for name in ("cond_stage_model", "first_stage_model", "model"):
        module = getattr(encoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return encoder if isinstance(encoder, torch.nn.Module) else None


def _stamps(files) -> tuple | None:
    """Each file's stamp (real path, size, mtime, inode, ctime), or None when one cannot be read."""
    stamps = tuple(FileHashes.stamp(f) for f in files)
    return None if None in stamps else stamps


def register_source(encoder, paths, loader: str, options=None, *, stamps=None, patcher=None) -> bool:
    """Record that ``encoder``'s weights are exactly what ``loader`` made from the files ``paths`` with
    ``options``, so the shared tiers can key it by the files' content (for custom loaders too: call it
    right after loading). ``stamps``: the files' :meth:`FileHashes.stamp` from before the load (else
    taken now). The weights are fingerprinted now, as loaded. The record holds while the files keep
    these stamps and the weights are not replaced or edited. False when it cannot be recorded (then
    the encoder never uses the shared tiers)."""
    module = _encoder_module(encoder)
    if module is None or not paths:
        return False
    try:
        keyed = encode(options)
    except Uncacheable:
        return False
    files = tuple(os.path.realpath(os.fspath(p)) for p in paths)
    stamps = _stamps(files) if stamps is None else tuple(stamps)
    if stamps is None or len(stamps) != len(files):
        return False
    patcher = patcher if patcher is not None else getattr(encoder, "patcher", None)
    if patcher is not None and not lazy_clip.pending(module) and encoder_weights.register(module, patcher):
        _new_generation(module)  # edited since an earlier reference: not what the files hold
    with _sources_lock:
        _sources[module] = (getattr(module, _GENERATION, 0), str(loader), files, keyed, stamps)
    for stamp in stamps if TIERS.active else ():  # only for a tier (one turned on later: its first encode asks)
        TIERS.hashes.for_stamp(stamp)  # small files now, large ones on a background thread
    return True


_INDEXED_TEXT = re.compile(r"'(cuda|xpu|mps|npu|mlu|hpu|xla|privateuseone|mtia):\d+'")  # caching/tiers.py's names


def _portable(tree):
    """An encoded key tree with indexed device names replaced by ``portable_device``: in device
    fields (``("device", name)``), tensor fields (``caching/keys.py``: device after the layout) and
    weight-patch skeletons (``("T", dtype, shape, device)``); other strings stay as they are. A tree
    whose text names no indexed device is returned as it is (one pass in C, not one call per field)."""
    if not isinstance(tree, tuple) or not _INDEXED_TEXT.search(repr(tree)):
        return tree
    return _portable_walk(tree)


def _portable_walk(tree):
    if not isinstance(tree, tuple):
        return tree
    out = tuple(_portable_walk(x) for x in tree)
    at = None
    if len(out) == 2 and out[0] == "device":
        at = 1
    elif out and out[0] == "T" and len(out) >= 6 and isinstance(out[4], str) and out[4].startswith("torch."):
        at = 5
    elif out and out[0] == "T" and len(out) == 4:
        at = 3
    if at is not None and isinstance(out[at], str) and is_indexed_device(out[at]):
        out = (*out[:at], portable_device(out[at]), *out[at + 1:])
    return out


def _patch_digest(weights) -> str:
    """A digest of a weight patch set's structure, strengths and tensor contents (memoised per set)."""
    found = _patch_digests.get(weights)
    if found is None:
        if not weights.holds(weights.tensors):
            raise LocalOnly("its weight patches (a LoRA's tensors) were changed in place since they were first seen")
        h = hashlib.blake2b(repr(_portable(weights.skeleton)).encode(), digest_size=32)
        for t in weights.tensors:
            h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(memoryview(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()))
        found = _patch_digests[weights] = h.hexdigest()
    return found


def _weight_layout(module, patcher) -> tuple:
    """Names, dtypes and shapes of the module's weights (as without weight patches: their originals
    are in the patcher's backup): the same file loaded in another precision differs. Kept with the
    module's tree for its generation and the patcher's backup: a weight replaced or cast shows in the
    tree or, through this encode's edit check, as a new generation."""
    backup = getattr(patcher, "backup", None) or {}
    token = (getattr(module, _GENERATION, 0), tuple((name, id(backup[name])) for name in sorted(backup)))
    memo = module_tree.tree(module, patcher).memo
    found = memo.get("layout")
    if found is not None and found[0] == token:
        return found[1]
    named, patched = module_tree.weights(module, patcher)
    for name, entry in backup.items():  # the patched weights' originals, by the names ``patched`` gives them
        base = getattr(entry, "weight", entry)
        if isinstance(base, torch.Tensor):
            named.update((n, t) for n, t in plain_leaves(name, base) if n in patched)
    layout = digest(tuple((name, str(t.dtype), tuple(t.shape)) for name, t in sorted(named.items())))
    memo["layout"] = (token, layout)
    return layout


def _host_versions() -> tuple:
    return ("torch", torch.__version__, "comfyui", host.comfyui_version())


def _factory_source(module, patcher):
    """A source from ComfyUI's own record of how to reload a patcher (``cached_patcher_init``, ComfyUI
    0.2x+: VAELoader and custom loaders that follow core), taken only for weights never replaced or
    seen edited (generation 0) whose files have not changed since the weights began loading (the
    VAE's construction, when they were fingerprinted): (fn, args[, index]), the files among the args
    by content."""
    init = getattr(patcher, "cached_patcher_init", None)
    started = encoder_weights.loaded_ns(module)
    if getattr(module, _GENERATION, 0) != 0 or started is None or not isinstance(init, tuple) or len(init) not in (2, 3):
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
    stamps = _stamps(files)
    if not files or stamps is None or any(st[2] >= started or st[4] >= started for st in stamps):
        return None  # a file written or replaced after the weights were read: not what they hold
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}:{init[2] if len(init) == 3 else ''}"
    if not register_source(module, files, name, options, stamps=stamps, patcher=patcher):
        return None
    with _sources_lock:
        return _sources.get(module)


def _local_devices(patcher) -> dict:
    """The devices an encode's outputs may be on here, by portable name (a stored value's tensors go
    to this process's device of the same kind and model)."""
    import comfy.model_management

    devices = (getattr(patcher, "load_device", None), getattr(patcher, "offload_device", None),
               comfy.model_management.intermediate_device())
    return {portable_device(str(d)): torch.device(d) for d in devices if d is not None}


def shared_key(key: Key, module, patcher=None) -> SharedKey:
    """The key of an encode for the shared tiers. It holds the in-process key's fields (devices by kind
    and name, not index; the generation left out), the weight files by content, the loader and its
    options, the weights' layout and the patch set by content, and the torch and ComfyUI versions.
    Raises :class:`LocalOnly` with the reason while the encoder has no shared identity: edit checks off,
    no recorded source, weights replaced or edited since loading, a file changed on disk since loading
    (its stamp), or a weight file not hashed yet."""
    if SETTINGS.get(CHECK_SETTING) == "off":
        raise LocalOnly("weight edit checks are off: nothing vouches that the weights are their files'")
    replaced = _replaced_functions()
    if replaced:
        raise LocalOnly(f"{replaced[0][0]} is replaced in this process (by {replaced[0][1]}): the key cannot tell "
                        "what it computes in another")
    with _sources_lock:
        source = _sources.get(module)
    if source is None and patcher is not None:
        source = _factory_source(module, patcher)
    if source is None:
        raise LocalOnly("not loaded from files by a loader ReuseKit follows (or edited before its first encode)")
    if source[0] != getattr(module, _GENERATION, 0):
        raise LocalOnly("weights replaced or edited since loading")
    if _stamps(source[2]) != source[4]:
        raise LocalOnly("a weight file changed on disk since loading")
    hashes = tuple(TIERS.hashes.for_stamp(st) for st in source[4])  # the files as loaded, not as now
    if None in hashes:
        raise LocalOnly("a weight file is being hashed (in the background, once per file; shared after) "
                        "or changed just now")
    settings, (classes, _, local) = key.fields[_MODULE_STATE_AT[key.kind]]
    if local is not None:
        raise LocalOnly(f"the key cannot tell this state of the encoder's classes in another process: {local}")
    fields = tuple((settings, classes) if i == _MODULE_STATE_AT[key.kind] else f
                   for i, f in enumerate(key.fields) if i != _GENERATION_AT[key.kind])
    tree = (FORMAT, KEY_REVISION, key.kind, _host_versions(), (source[1], hashes, source[3]),
            _weight_layout(module, patcher), tuple(_patch_digest(w) for w in key.weights), fields)
    text = repr(tree)  # written out once: the fields hold hundreds of token values
    if _INDEXED_TEXT.search(text):
        text = repr((*tree[:-1], _portable_walk(fields)))
    device = _encode_device(module, patcher)
    if device is not None:  # the kernels that ran follow the device's model (and the CPU's, how they split the work)
        model = device_model(device)
        if model is None:
            raise LocalOnly(f"this {device.type} device's model cannot be read here: the key cannot tell its "
                            "kernels from another model's")
        text += repr(("cpu", platform.machine(), torch.backends.cpu.get_cpu_capability(), model,
                      torch.get_num_threads()) if device.type == "cpu" else (device.type, model))
    return SharedKey.of_text(text, _local_devices(patcher))


def _encode_device(module, patcher) -> torch.device | None:
    """The device the encoder runs on: its patcher's load device, without a patcher its first weight's. A
    worker on AVX2 and one on AVX-512 round alike no more than two GPU models do; inputs and outputs held
    on the CPU beside a GPU encode say nothing of it."""
    device = getattr(patcher, "load_device", None)
    if device is None:
        device = next((p.device for p in module.parameters()), None)
    return None if device is None else torch.device(device)


_local = threading.local()  # per thread: inside a plain VAE encode, and whether it fell back to tiles


def _plain_vae_encode(orig, vae, pixel_samples, more: tuple, extra: dict):
    _local.plain, _local.fell_back = True, False
    try:
        return orig(vae, pixel_samples, *more, **extra)
    finally:
        _local.plain = False


def _tiled_fallback_reason():
    return "VAE encode fell back to tiles (out of memory)" if getattr(_local, "fell_back", False) else None


def _oom_marks(device) -> tuple[int, int]:
    """What counts the out-of-memory errors ComfyUI went on from: those its ``raise_non_oom`` let pass on this
    thread (ComfyUI 0.4 and newer: it then slices the attention, or tiles), and those the CUDA allocator met
    on the encoder's ``device`` (every host; one met on another thread meanwhile only makes a miss)."""
    cuda = 0
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):  # (an allocator without the count)
            cuda = torch.cuda.memory_stats(device).get("num_ooms", 0)
    return getattr(_local, "ooms", 0), cuda


def _route(kind: str, patcher, module, make_key, compute, admit=None):
    if not _routed(patcher) or not _active:
        return compute()
    encoder = encoder_name(module)
    if not CACHE.enabled:
        CACHE.bypass(kind, "the cache's budget_mib or max_entries is 0", encoder)
        return compute()
    look = module_tree.Look()  # the key and the shared key read the encoder's modules once between them
    try:
        with look:
            key = make_key()
    except Uncacheable as exc:
        CACHE.bypass(kind, str(exc), encoder)
        return compute()
    except Exception as exc:  # an encoder object this key builder does not know: never break the encode
        CACHE.bypass(kind, f"unexpected {type(exc).__name__}: {exc}", encoder)
        return compute()
    patches = key.weights[0] if key.weights else None
    patch_tensors = _patch_tensors(patcher, patches)

    def shared():  # asked by the lookup on a miss, before anything computes
        with look:
            return shared_key(key, module, patcher)

    def vouch(publish, drop):  # after a miss: see encoder_weights.vouch
        if SETTINGS.get(CHECK_SETTING) == "every_encode":
            publish()  # this encode's own check was a full one
            return
        generation = getattr(module, _GENERATION, 0)

        def same_generation():  # an edit seen since (the reference retaken from the edited weights): never
            if getattr(module, _GENERATION, 0) != generation:
                drop()
            elif patches is not None and (patch_tensors is None or not patches.holds(patch_tensors)):
                # (in full, on the publishing thread)
                drop("its weight patches (a LoRA's tensors) were changed in place since they were first seen")
            else:
                publish()

        encoder_weights.vouch(module, patcher, same_generation, drop)

    marks, device = [], getattr(patcher, "load_device", None)

    def watched():  # (a miss only)
        marks.append(_oom_marks(device))
        return compute()

    def admitted():  # ComfyUI went on from an out-of-memory error by another way: returned, never stored
        why = admit() if admit is not None else None
        if why is None and marks and _oom_marks(device) != marks[0]:
            why = ("an out-of-memory error inside it, from which ComfyUI went on another way (sliced attention, "
                   "tiles): not what it gives with room to spare")
        return why

    return CACHE.fetch(key, watched, check_rng=True, admit=admitted, shared=shared, encoder=encoder,
                       vouch=vouch)


def encoder_name(module) -> str:
    """An encoder's class as the stats name it: its module's last part and its name
    (``z_image.ZImageTEModel_``; ComfyUI makes many encoder classes inside functions)."""
    kind = type(module)
    return f"{kind.__module__.rpartition('.')[2]}.{kind.__name__}"


# ---- the patched methods ----------------------------------------------------------------------

def _orig(owner, name):
    return _originals[(owner, name)]


def _by_name(orig, head: tuple, more: tuple, extra: dict) -> dict:
    """The options of a call, for its key: ``extra`` with those a newer host added after a replacement's own
    parameters (``head``, self first) that the caller passed by position (``more``), named as the host's
    signature names them, so the call keys as its keyword form does (``VAE.encode(pixels, not_video)`` after
    0.33). The call itself passes them on as it got them. Uncacheable where the signature does not name
    them (a ``*args``); a call the host cannot take fails here and then in the host, with its own error."""
    if not more:
        return extra
    signature = inspect.signature(orig)
    bound = signature.bind(*head, *more, **extra)
    params = list(signature.parameters.values())[len(head):len(head) + len(more)]
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        raise Uncacheable(f"options passed by position that {orig.__qualname__}'s signature does not name")
    return {**extra, **{p.name: bound.arguments[p.name] for p in params}}


def _make_methods():
    import comfy.clip_vision
    import comfy.model_management as mm
    import comfy.sd

    CLIP, VAE = comfy.sd.CLIP, comfy.sd.VAE
    Vision = comfy.clip_vision.ClipVisionModel

    # every replacement passes on the options a newer host added to its seam as it got them, and keys them
    # by name (passed by position: named by the host's signature, _by_name)
    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False, *more, **extra):
        orig = _orig(CLIP, "encode_from_tokens")
        compute, admit = lazy_clip.on_demand(  # a lazy encoder reads its weights on a miss
            self, lambda: orig(self, tokens, return_pooled, return_dict, *more, **extra))
        out = _route("text", self.patcher, self.cond_stage_model, lambda: text_key(
            self, tokens, return_pooled, return_dict, _by_name(orig, (self, tokens, return_pooled, return_dict),
                                                               more, extra)), compute, admit=admit)
        lazy_clip.answered(self.cond_stage_model)
        return out

    def encode_from_tokens_scheduled(self, tokens, *args, **kwargs):
        if self.patcher.forced_hooks is not None and self.use_clip_schedule:  # ComfyUI encodes it itself
            # a lazy encoder reads its weights before ComfyUI sets its options (clip skip) on the module
            lazy_clip.materialise(self.cond_stage_model, self.patcher)
            if _active and _routed(self.patcher):
                CACHE.bypass("text", "hook-scheduled encode", encoder_name(self.cond_stage_model))
        return _orig(CLIP, "encode_from_tokens_scheduled")(self, tokens, *args, **kwargs)

    def vae_encode(self, pixel_samples, *more, **extra):
        orig = _orig(VAE, "encode")
        # ComfyUI retries a plain encode in tiles when it runs out of memory: that result is not
        # what a plain encode gives with room to spare, so it is returned but never stored
        return _route("vae", self.patcher, self.first_stage_model, lambda: vae_key(
            self, "encode", pixel_samples, (), _by_name(orig, (self, pixel_samples), more, extra)),
            lambda: _plain_vae_encode(orig, self, pixel_samples, more, extra),
            admit=_tiled_fallback_reason)

    def tiled_helper(name):
        def helper(self, *args, **kwargs):
            if getattr(_local, "plain", False):
                _local.fell_back = True
            return _orig(VAE, name)(self, *args, **kwargs)
        return helper

    def vae_encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None,
                         *more, **extra):
        orig = _orig(VAE, "encode_tiled")
        options = (tile_x, tile_y, overlap, tile_t, overlap_t)
        return _route("vae", self.patcher, self.first_stage_model, lambda: vae_key(
            self, "encode_tiled", pixel_samples, options, _by_name(orig, (self, pixel_samples, *options), more, extra)),
            lambda: orig(self, pixel_samples, *options, *more, **extra))

    def encode_image(self, image, crop=True, *more, **extra):
        orig = _orig(Vision, "encode_image")
        return _route("vision", self.patcher, self.model,
                      lambda: vision_key(self, image, crop, _by_name(orig, (self, image, crop), more, extra)),
                      lambda: orig(self, image, crop, *more, **extra))

    def clip_load_sd(self, sd, full_model=False):
        lazy_clip.materialise(self.cond_stage_model, self.patcher)
        _new_generation(self.cond_stage_model)
        try:
            return _orig(CLIP, "load_sd")(self, sd, full_model)
        finally:
            _weights_loaded(self.cond_stage_model, self.patcher)

    def vision_load_sd(self, sd):
        _new_generation(self.model)
        try:
            return _orig(Vision, "load_sd")(self, sd)
        finally:
            _weights_loaded(self.model, self.patcher)

    def vae_init(self, *args, **kwargs):
        started = time.time_ns()
        _orig(VAE, "__init__")(self, *args, **kwargs)
        _weights_loaded(getattr(self, "first_stage_model", None), getattr(self, "patcher", None), started)

    def raise_non_oom(*args, **kwargs):
        _orig(mm, "raise_non_oom")(*args, **kwargs)  # raises what is not an out-of-memory error
        _local.ooms = getattr(_local, "ooms", 0) + 1  # ComfyUI goes on another way: an encode it was in is not stored

    # (owner, name, replacement, the parameters it relies on, whether the host must have it); the replacements
    # that pass every argument through rely on none (another pack's plain wrapper, ``(*args, **kwargs)``, under
    # them once turned the whole cache off)
    return [
        (mm, "raise_non_oom", raise_non_oom, (), False),  # ComfyUI 0.4 and newer
        (VAE, "__init__", vae_init, ("self", "sd", "device", "config", "dtype"), True),
        (CLIP, "encode_from_tokens", encode_from_tokens, ("self", "tokens", "return_pooled", "return_dict"), True),
        (CLIP, "encode_from_tokens_scheduled", encode_from_tokens_scheduled, ("self", "tokens"), True),
        (CLIP, "load_sd", clip_load_sd, ("self", "sd", "full_model"), True),
        (VAE, "encode", vae_encode, ("self", "pixel_samples"), True),
        (VAE, "encode_tiled", vae_encode_tiled,
         ("self", "pixel_samples", "tile_x", "tile_y", "overlap", "tile_t", "overlap_t"), True),
        *[(VAE, name, tiled_helper(name), (), True) for name in ("encode_tiled_", "encode_tiled_1d", "encode_tiled_3d")],
        (VAE, "_encode_tiled_owned", tiled_helper("_encode_tiled_owned"), (), False),  # video VAEs that tile themselves (newer hosts)
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


def _loader(owner, name: str, parts, paths, lazy=False):
    """A wrapper of one of ComfyUI's loader functions that records where each encoder it returns came
    from (:func:`register_source`). ``parts(arguments, result)`` lists (encoder, files, role);
    ``paths(arguments)`` the files it reads, stamped before the load and again after it (a file that
    changed meanwhile is not recorded). ``lazy``: the text encoder it returns may be built from the
    files' headers (patches/lazy_clip.py), recorded the same way."""
    def load(*args, **kwargs):
        orig = _orig(owner, name)
        try:
            bound = inspect.signature(orig).bind(*args, **kwargs)
            bound.apply_defaults()
            before = {f: FileHashes.stamp(f) for f in paths(bound.arguments)}
        except Exception as exc:  # never break a load: the encoder only misses the shared tiers
            log.debug("ReuseKit: no source recorded for %s: %s", name, exc)
            return orig(*args, **kwargs)
        result = (lazy_clip.build(orig, bound.arguments) if lazy else None) or orig(*args, **kwargs)
        recorded, unrecorded = False, "options"
        try:
            options = {k: _enums_by_name(v) for k, v in bound.arguments.items() if k not in _NOT_OPTIONS}
            if any(FileHashes.stamp(f) != st for f, st in before.items()):
                log.info("ReuseKit: a file changed while %s read it; its encoders stay out of the shared tiers", name)
                unrecorded = "changed"
            else:
                for encoder, files, role in parts(bound.arguments, result):
                    if encoder is not None:
                        recorded = register_source(encoder, files, f"{owner.__name__}.{name}:{role}", options,
                                                   stamps=[before[f] for f in files])
        except Exception as exc:  # never break a load: the encoder only misses the shared tiers
            log.debug("ReuseKit: no source recorded for %s: %s", name, exc)
            unrecorded = "error"
        if lazy:
            lazy_clip.settle(result, None if recorded else unrecorded)
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

    def one(a):
        return [a["ckpt_path"]]

    return [
        (comfy.sd, "load_clip", _loader(comfy.sd, "load_clip", lambda a, out: [(out, list(a["ckpt_paths"]), "clip")],
                                        lambda a: list(a["ckpt_paths"]), lazy=True), ("ckpt_paths",)),
        (comfy.sd, "load_checkpoint_guess_config",
         _loader(comfy.sd, "load_checkpoint_guess_config", checkpoint_parts, one), ("ckpt_path",)),
        (comfy.clip_vision, "load",
         _loader(comfy.clip_vision, "load", lambda a, out: [(out, [a["ckpt_path"]], "clip_vision")], one),
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
            how = (f"{host.off_features().get(FEATURE)} (another pack's code is there, or this ComfyUI reshaped it): "
                   "nothing is cached, and lazy text encoders load eagerly; load ReuseKit before that pack, or "
                   "update it, and restart ComfyUI")
            CACHE.stats.set_off(how)  # (the cards say so, not only the log: the Cached nodes still run)
            lazy_clip.STATS.set_off(how)
            return False
        CACHE.stats.set_off(None)
        lazy_clip.STATS.set_off(None)
        loaders = [m for m in _loader_methods() if (m[0], m[1]) not in _originals]
        loaders = [m for m in loaders if host.check(SHARED_FEATURE, _where(m[0], m[1]), _current(m[0], m[1]), m[3])]
        _ROUTES.update((owner, name) for owner, name, *_ in (*methods, *loaders))
        for owner, name, fn, *_ in (*methods, *loaders):
            _originals[(owner, name)] = _current(owner, name)
            fn.__reusekit__ = True
            setattr(owner, name, fn)
            _replacements[(owner, name)] = fn
        _active = True
    encoder_weights.install()
    if lazy_clip.install():
        lazy_clip.when_changed(_new_generation)
        _ROUTES.update(lazy_clip.routed())
    _configure_tiers()
    return True


def _configure_tiers() -> None:
    """The shared tiers' default folder (under ComfyUI's user directory), then the tiers themselves."""
    import folder_paths

    TIERS.default_folder = os.path.join(folder_paths.get_user_directory(), "reusekit", "conditioning")
    TIERS.hashes.memo = os.path.join(folder_paths.get_user_directory(), "reusekit", "file_hashes.json")
    try:
        TIERS.configure(SETTINGS)
    except ValueError as exc:  # a bad REUSEKIT_REDIS_URL: the pack still loads, the Redis tier stays off
        host.say_once("tiers-config", "ReuseKit: the conditioning cache's Redis tier is off: %s", exc,
                      level=logging.WARNING)
    except OSError as exc:  # a folder the tiers cannot read: the pack still loads (its panel says the rest)
        host.say_once("tiers-config-os", "ReuseKit: the conditioning cache's shared tiers could not be read: %s", exc,
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
    encoder_weights.uninstall()
    lazy_clip.uninstall()


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
