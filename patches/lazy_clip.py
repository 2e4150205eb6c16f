"""Lazy text encoders: a CLIP built from its files' headers, whose weights are read only when an encode
misses every tier of the conditioning cache (ReuseKit Lazy CLIP Loader, and ComfyUI's own CLIP loaders
with the setting ``conditioning.lazy_text_encoders``).

Building: ComfyUI's own ``comfy.sd.load_clip`` runs (its detection, conversions, tokenizer, CLIP and
ModelPatcher), with two of its calls answered differently while it does: ``comfy.utils.load_torch_file``
returns, for the files being built, a state dict read from the safetensors header (every tensor on the
``meta`` device with its name, shape and dtype, but for the small non-weight tensors a loader reads for
its own sake: tokenizer models, quantisation metadata, scalars, which are read for real), and
``model_management.text_encoder_initial_device`` says ``meta``, so the model is built without storage.
Only the header and those small tensors are read. The encoder is built this way only when it can use a
shared tier: a disk or Redis tier is on, the files' content hashes are known without reading them (the
file-hash memo, ``caching/file_hashes.py``), the loader's options can be keyed, and the files did not
change meanwhile; else ComfyUI loads it as usual (counted in ``eager_loads``).

Keys: the conditioning cache keys a lazy encoder exactly as the same encoder loaded by ComfyUI (its
files by content, the loader and its options, the weights' names, dtypes and shapes, its module
settings, the LoRA patches by content, versions), so a lazy encoder reads what an eager one wrote and
the other way round. A LoRA on a lazy CLIP is keyed by its patches' content and strength like any
other: the output is a function of the base file's content and the patches, both in the key; the
weights are needed only to compute it (on a miss, ComfyUI applies the patches at load as usual).

Loading (materialising), on the first encode that misses every tier or anything else that needs the
weights (``CLIP.load_model``, ``load_sd``, ``get_sd``, ``get_key_patches``, ``state_dict_for_saving``,
``generate``, a hook-scheduled encode: each before ComfyUI's code sets anything on the module; ComfyUI's
patcher loading the model by another way): ComfyUI's ``load_clip`` runs again with the same arguments, for
real (its model built on the offload device, as ComfyUI does when VRAM is short), its patcher is detached
(what ComfyUI does to unload it), and each module of the lazy encoder takes the state of the loaded one at
its path in place: every attribute (children, weights, settings) but the few its own patchers keep on it; the settings a node
set on its modules since it was built, and the object patches the loading patcher had put on it (it patches
before it loads), are put on again. Clones made
before (a LoraLoader's) share the module, so they see it. From then on it is an ordinary loaded encoder
(its weights fingerprinted as the reference of the edit checks). A file that changed since the build
is loaded as it is now; the encode that asked is then neither stored nor shared, and the encoder
leaves the shared tiers (a new weight generation), as a loaded encoder does when its file changes.
The files an encoder was built from are kept open until its weights are read (or it goes): one moved or
deleted since is read through the copy kept open, the very file stamped at the build, so the encode runs
as on an encoder ComfyUI loaded (which read its weights at load) instead of failing; counted
(``gone_files_read``). A move or a delete sets the file's ctime, so its stamp no longer vouches for its
content: that encode too is neither stored nor shared, and the encoder leaves the shared tiers.

Stats (``conditioning_lazy``): lazy encoders built, loads avoided (built and never loaded), weights
loaded, encodes answered without weights, eager loads (and why), bytes not read, header bytes read,
files read after they were moved or deleted.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import struct
import tempfile
import threading
import types
import warnings
import weakref
from collections import deque
from collections.abc import Callable

import torch

from ..caching.conditioning import CACHE
from ..caching.keys import Uncacheable
from ..caching.settings import SETTINGS
from ..caching.stats import REGISTRY
from ..caching.tiers import TIERS, FileHashes
from ..caching.weight_edits import SETTING as CHECK_SETTING
from . import encoder_weights, host, lifecycle

log = logging.getLogger("reusekit")

SETTING = "conditioning.lazy_text_encoders"
FEATURE = "lazy text encoders"
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not read
SMALL_NUMEL = 64  # tensors up to this many elements are read for real (scales, scalars)
BLOB_BYTES = 16 << 20  # 1-D byte tensors (tokenizer models, quantisation metadata) up to this size too
# attributes ComfyUI's patchers keep on the module they patch (its loading state, dynamic VRAM's pins and
# patcher set): the lazy encoder keeps its own when it takes a loaded module's state
PATCHER_STATE = frozenset({
    "device", "model_loaded_weight_memory", "current_weight_patches_uuid", "model_lowvram", "lowvram_patch_counter",
    "model_offload_buffer_memory", "dynamic_vbars", "dynamic_pins", "dynamic_patchers"})

_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("U16", "uint16"), ("U32", "uint32"),
    ("U64", "uint64"), ("BOOL", "bool"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E8M0", "float8_e8m0fnu"))  # (mxfp8's block scales; a dtype missing here loads the encoder eagerly)
    if isinstance(getattr(torch, attr, None), torch.dtype)}
# where the system names an open file by its descriptor, for ComfyUI's loader to read a kept file moved or
# deleted since (none on Windows, where a file held open cannot be deleted or renamed: its name still holds it)
FD_DIR = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)

STATS = REGISTRY.register(
    "conditioning_lazy", "conditioning",
    "Text encoders built from their files' headers: the weights are read only when an encode misses every "
    "tier (ReuseKit Lazy CLIP Loader).")
COUNTERS = ("lazy_encoders", "loads_avoided", "weights_loaded", "encodes_without_weights", "eager_loads",
            "not_read_bytes", "header_read_bytes", "gone_files_read")

# requested (depth), building ({path: (state dict, metadata)}), materialising, kept ({path: a name of its kept file})
_local = threading.local()


class _Pending:
    """A lazy encoder's record: how to load it, what it was built from, what it must still be."""

    __slots__ = ("load", "arguments", "paths", "stamps", "layout", "tensors", "nbytes", "header_bytes", "counted",
                 "lock", "refused", "fds", "close", "settings")

    def __init__(self, load, arguments, paths, stamps, tensors, header_bytes, fds, close, settings):
        self.load, self.arguments, self.paths, self.stamps = load, arguments, paths, stamps
        self.settings = settings  # its modules' settings as built (:func:`_settings_as_built`)
        self.fds, self.close = fds, close  # the files as built, kept open until the load; close: their finalizer
        self.tensors, self.header_bytes = tensors, header_bytes
        self.layout = _layout(tensors)
        self.nbytes = sum(st[1] for st in stamps)
        self.counted = False  # in the stats as a lazy encoder (its files recorded for the shared tiers)
        self.lock = threading.Lock()
        self.refused: str | None = None  # why an encode that began before the load must not be stored


_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> _Pending, until loaded
_pending_lock = threading.Lock()
_changed: list[Callable] = []  # called with a module whose loaded weights are not what it was keyed as


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _layout(tensors) -> list[tuple]:
    return [(str(t.dtype), tuple(t.shape)) for t in tensors]


def when_changed(fn: Callable) -> None:
    """Call ``fn(module)`` when a lazy encoder's load finds its files or layout changed since it was built
    (patches/conditioning.py starts a new weight generation: its keys change, it leaves the shared tiers)."""
    if fn not in _changed:
        _changed.append(fn)


# ---- what the rest of the pack asks ----------------------------------------------------------------

@contextlib.contextmanager
def lazily():
    """Inside: ``comfy.sd.load_clip`` builds lazy encoders where it can (the Lazy CLIP Loader nodes)."""
    _local.requested = getattr(_local, "requested", 0) + 1
    try:
        yield
    finally:
        _local.requested -= 1


def wanted() -> bool:
    return _active and (getattr(_local, "requested", 0) > 0 or bool(SETTINGS.get(SETTING)))


def quiet() -> bool:
    """Whether weights loading now are a lazy build's (meta) or a lazy encoder's load: not fingerprinted
    by the loader hooks (the encoder is fingerprinted once, after it took the loaded state)."""
    return getattr(_local, "building", None) is not None or getattr(_local, "materialising", False)


def pending(module) -> bool:
    """Whether ``module`` is a lazy encoder whose weights were not read yet."""
    return module in _pending


def check_intact(module) -> None:
    """Uncacheable when a lazy encoder's tensors are no longer the ones it was built with (something
    replaced them before the weights were read: the key, made for the files, would not describe it)."""
    found = _pending.get(module)
    if found is None:
        return
    now = _tensors(module)
    if len(now) != len(found.tensors) or any(a is not b for a, b in zip(now, found.tensors, strict=True)):
        raise Uncacheable("a lazy encoder's weights were replaced before they were read")


def on_demand(clip, compute):
    """(compute, admit) for an encode of a lazy encoder: compute loads the weights first; admit refuses
    to store the result when the load found the files changed since the encoder was built."""
    found = _pending.get(clip.cond_stage_model)
    if found is None:
        return compute, None

    def run():
        materialise(clip.cond_stage_model, clip.patcher)
        return compute()

    return run, lambda: found.refused


def answered(module) -> None:
    """An encode returned: counted when it needed no weights."""
    if module in _pending:
        STATS.incr("encodes_without_weights")


# ---- building from the header ----------------------------------------------------------------------

def read_header(path: str) -> tuple[dict, dict | None, int]:
    """(state dict of meta tensors and small real ones, metadata, bytes read) of a safetensors file."""
    sd: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > HEADER_MAX:
            raise ValueError(f"a {n}-byte header")
        head = json.loads(f.read(n))
        read, base = 8 + n, 8 + n
        metadata = head.pop("__metadata__", None)
        for name, info in head.items():
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{name}: dtype {info['dtype']}")
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            blob = dtype in (torch.uint8, torch.int8, torch.bool) and len(shape) <= 1 and end - start <= BLOB_BYTES
            if numel <= SMALL_NUMEL or blob:
                f.seek(base + start)
                data = f.read(end - start)
                read += len(data)
                if len(data) != end - start:
                    raise ValueError(f"{name}: truncated")
                sd[name] = (torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)).reshape(shape)
            else:
                sd[name] = torch.empty(shape, dtype=dtype, device="meta")
    return sd, metadata, read


def _ineligible(arguments: dict, paths: list[str], stamps: tuple) -> str | None:
    """Why this load of the files with ``stamps`` cannot be lazy (None: it can)."""
    if not TIERS.active:
        return "no_shared_tier"
    if not CACHE.enabled or SETTINGS.get(CHECK_SETTING) == "off":
        return "cache_off"
    if "initial_device" in (arguments.get("model_options") or {}):
        return "options"
    if not paths or not all(p.lower().endswith((".safetensors", ".sft")) for p in paths):
        return "format"
    if any(TIERS.hashes.for_stamp(st) is None for st in stamps):  # queued: the next start knows it
        return "hash_unknown"
    return None


_EAGER_WHY = {  # what each eager load's reason means, as the panel's reasons show it
    "host_seams_differ": "this ComfyUI's loader seams differ from those lazy loading needs",
    "no_shared_tier": "no shared tier is on, so no encode could be answered without the weights",
    "cache_off": "the conditioning cache or its weight check is off",
    "options": "the loader was given an initial device",
    "format": "its files are not all safetensors",
    "hash_unknown": "its files' hashes are not known yet (the next start knows them)",
    "changed": "its files changed while they were read",
    "error": "its files' headers could not build it (the log says why, at debug level)",
}


def _eager(reason: str) -> None:
    STATS.incr("eager_loads")
    STATS.incr(f"eager.{reason}")
    STATS.count_reason("bypass", f"a text encoder loaded its weights at once: {_EAGER_WHY.get(reason, reason)}",
                       source="lazy loading")
    host.say_once(f"lazy-eager:{reason}", "ReuseKit: a text encoder loads its weights now (%s)", reason.replace("_", " "))


def build(load, arguments: dict):
    """A lazy encoder from ``load`` (ComfyUI's ``comfy.sd.load_clip``) called with ``arguments``, or None
    when it cannot be lazy (the caller loads it as usual). Called by the loader wrapper of
    patches/conditioning.py, which then records the encoder's files like any other load."""
    if not wanted():
        if getattr(_local, "requested", 0) > 0 or SETTINGS.get(SETTING):  # asked for, on a host whose seams differ
            _eager("host_seams_differ")
        return None
    close_dead_files()
    try:
        paths = [os.path.realpath(os.fspath(p)) for p in arguments["ckpt_paths"]]
    except (KeyError, TypeError):
        return None
    stamps = tuple(FileHashes.stamp(p) for p in paths)
    reason = _ineligible(arguments, paths, stamps)
    if reason is not None:
        _eager(reason)
        return None
    fds = _keep(stamps)
    if fds is None:
        _eager("changed")
        return None
    try:
        headers, read = {}, 0
        for p in paths:
            sd, metadata, n = read_header(p)
            headers[p] = (sd, metadata)
            read += n
        _local.building = headers
        try:
            with warnings.catch_warnings():  # torch's note that copying into a meta tensor does nothing
                warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model")
                clip = load(**arguments)
        finally:
            _local.building = None
    except Exception as exc:  # a file or model this path cannot build from its header: loaded as usual
        log.debug("ReuseKit: no lazy encoder for %s: %s", paths, exc, exc_info=True)
        _close(fds)
        _eager("error")
        return None
    module = getattr(clip, "cond_stage_model", None)
    tensors = _tensors(module) if isinstance(module, torch.nn.Module) else []
    if tuple(FileHashes.stamp(p) for p in paths) != stamps:
        _close(fds)
        _eager("changed")
        return None
    if not any(t.is_meta for t in tensors):
        _close(fds)
        _eager("error")
        return None
    with _pending_lock:
        _pending[module] = _Pending(load, dict(arguments), paths, stamps, tensors, read, fds, _keep_open(module, fds),
                                    _settings_as_built(module))
    return clip


_dead_files: deque[tuple[int, ...]] = deque()  # files of lazy encoders that died unread (their finalizers append)


def _keep_open(module, fds) -> weakref.finalize:
    """Keep ``fds`` open while ``module`` lives unread: its finalizer, run by the garbage collector on any
    thread with any lock held, only records them; :func:`close_dead_files` closes them at the next build
    or stats snapshot."""
    return weakref.finalize(module, _dead_files.append, fds)


def close_dead_files() -> None:
    """Close the files of lazy encoders that died before their weights were read."""
    while _dead_files:
        try:
            fds = _dead_files.popleft()
        except IndexError:
            break
        _close(fds)


REGISTRY.add_settler(close_dead_files)


def _keep(stamps: tuple) -> tuple[int, ...] | None:
    """The stamped files opened, to be read even when moved or deleted before the weights are (None when
    one is no longer the file stamped)."""
    fds: list[int] = []
    for st in stamps:
        try:
            fds.append(os.open(st[0], os.O_RDONLY | getattr(os, "O_BINARY", 0)))
            same = FileHashes.stamp_fd(fds[-1], st[0]) == st
        except OSError:
            same = False
        if not same:
            _close(fds)
            return None
    return tuple(fds)


def _close(fds) -> None:
    """Close kept files."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def settle(clip, unrecorded: str | None) -> None:
    """After the loader wrapper recorded a lazy encoder's files (``unrecorded`` None): counted as lazy; or,
    without a shared identity (``unrecorded`` says why: options a key cannot hold, a file that changed
    while it was read...) it could never answer without its weights: loaded now."""
    module = getattr(clip, "cond_stage_model", None)
    found = _pending.get(module) if module is not None else None
    if found is None:
        return
    if unrecorded is not None:
        materialise(module, clip.patcher)
        _eager(unrecorded)
        return
    found.counted = True
    STATS.incr("lazy_encoders")
    STATS.incr("loads_avoided")
    STATS.incr("not_read_bytes", found.nbytes)
    STATS.incr("header_read_bytes", found.header_bytes)


# ---- loading the weights ----------------------------------------------------------------------------

def _adopt(module: torch.nn.Module, loaded: torch.nn.Module) -> None:
    """``module`` and each of its submodules take the state of ``loaded``'s at the same path in place (children,
    weights, settings), keeping what its own patchers and ReuseKit keep on them, so whatever refers to one of
    them (a method a node bound to a child, a closure) refers to a loaded module; a path ``module`` lacks, or
    holds another class at, takes the loaded module itself. ``loaded``'s modules are left empty (its patcher,
    when it goes, touches nothing)."""
    fresh = list(loaded.named_modules())  # (held: their ids key ``taker`` until the end)
    mine = dict(module.named_modules())
    taker = {id(f): mine[path] if path in mine and _class_name(mine[path]) == _class_name(f) else f
             for path, f in fresh}
    for _, f in fresh:
        ours = taker[id(f)]
        if ours is f:
            continue
        own = {k: v for k, v in vars(ours).items() if k in PATCHER_STATE or k.startswith("_reusekit")}
        state = dict(vars(f))
        for name, value in state.items():  # a method of a loaded module kept as an attribute: now its taker's
            if isinstance(value, types.MethodType) and id(value.__self__) in taker:
                state[name] = types.MethodType(value.__func__, taker[id(value.__self__)])
        d = vars(ours)
        d.clear()
        d.update(state)
        d.update(own)
        vars(f).update(_parameters={}, _buffers={}, _modules={})
    for ours in {id(t): t for t in taker.values()}.values():
        children = vars(ours).get("_modules") or {}
        for name, child in list(children.items()):
            if child is not None:
                children[name] = taker.get(id(child), child)


def _settings(module: torch.nn.Module) -> dict[tuple[str, str], object]:
    """Every plain attribute of the encoder's modules, by (module path, name)."""
    return {(path, name): value for path, m in module.named_modules() for name, value in vars(m).items()
            if not name.startswith("_") and name not in PATCHER_STATE
            and not isinstance(value, (torch.Tensor, torch.nn.Module))}


_UNCOPIED = object()


def _settings_as_built(module: torch.nn.Module) -> dict[tuple[str, str], tuple]:
    """{(path, name): (value, a copy of it)}: what a setting set or changed in place since reads against."""
    built = {}
    for where, value in _settings(module).items():
        try:
            built[where] = (value, copy.deepcopy(value))
        except Exception:  # a value that cannot be copied: only a new one is seen
            built[where] = (value, _UNCOPIED)
    return built


def _unchanged(value, built: tuple) -> bool:
    if value is not built[0]:
        return False
    try:
        return built[1] is _UNCOPIED or bool(built[1] == value)
    except Exception:
        return False


def _settings_set(module, patcher, found: _Pending) -> tuple[dict, list]:
    """What a node set on the lazy encoder's modules since it was built (``layer_norm_hidden_state = False``,
    a dict of special tokens changed in place), which the loaded state must keep: ({(path, name): value},
    [(path, name) deleted]); the loading patcher's object patches are put on again by themselves."""
    patched = set(getattr(patcher, "object_patches", None) or ()) if getattr(patcher, "model", None) is module \
        else set()
    now = _settings(module)
    set_ = {where: value for where, value in now.items()
            if ".".join(filter(None, where)) not in patched
            and (where not in found.settings or not _unchanged(value, found.settings[where]))}
    gone = [where for where in found.settings if where not in now and ".".join(filter(None, where)) not in patched]
    return set_, gone


def _set_again(module, set_: dict, gone: list) -> str | None:
    """Put ``_settings_set``'s findings on the adopted state; what could not be, if anything."""
    missing = []
    for (path, name), value in set_.items():
        try:
            setattr(module.get_submodule(path), name, value)
        except AttributeError:
            missing.append(f"{path}.{name}" if path else name)
    for path, name in gone:
        try:
            target = module.get_submodule(path)
        except AttributeError:
            continue
        vars(target).pop(name, None)
    return f"settings set on it before its weights were read have no module to go on ({', '.join(missing)})" \
        if missing else None


def _patch_again(module, patcher) -> None:
    """The object patches ``patcher`` had put on ``module`` before its weights were read (ComfyUI's
    ``patch_model`` sets them before it loads): put on the adopted state too, each one's backup now what that
    state held, which an unpatch puts back (ComfyUI 0.33 deletes an attribute that was unset)."""
    import comfy.utils

    backup, patches = getattr(patcher, "object_patches_backup", None), getattr(patcher, "object_patches", {})
    if getattr(patcher, "model", None) is not module or not backup:
        return
    for key in [k for k in backup if k in patches]:
        backup[key] = comfy.utils.set_attr(module, key, patches[key])


def materialise(module, patcher) -> None:
    """Read a lazy encoder's weights (see the module docstring); nothing for any other module."""
    found = _pending.get(module)
    if found is None:
        return
    with found.lock:
        if module not in _pending:
            return
        _require_intact(module)
        with tempfile.TemporaryDirectory(prefix="reusekit-kept-") if FD_DIR else contextlib.nullcontext() as folder:
            kept = _kept_names(found, folder)
            before = tuple(FileHashes.stamp(p) for p in found.paths)
            _local.materialising, _local.kept = True, kept
            try:
                loaded = found.load(**found.arguments)
            finally:
                _local.materialising, _local.kept = False, None
            after = tuple(FileHashes.stamp(p) for p in found.paths)
        fresh = loaded.cond_stage_model
        if _class_name(fresh) != _class_name(module):  # by name: some loaders make the class per call
            raise RuntimeError(f"ReuseKit Lazy CLIP Loader: {found.paths} now hold a {type(fresh).__name__}, "
                               f"not the {type(module).__name__} built from their header")
        loaded.patcher.detach()  # undo whatever ComfyUI's load did with its own patcher
        set_, gone = _settings_set(module, patcher, found)
        _adopt(module, fresh)
        unset = _set_again(module, set_, gone)
        _patch_again(module, patcher)
        problems = [unset] if unset else []
        if kept:  # the very files built from, but their ctime moved with their names: nothing vouches for them
            problems.append("its files were moved or deleted since it was built (read as kept open)")
        elif before != found.stamps or after != before:
            problems.append("its files changed since it was built")
        if _layout(_tensors(module)) != found.layout:
            problems.append("its weights' dtypes or shapes differ from the header's")
        with _pending_lock:
            _pending.pop(module, None)
        found.close.detach()
        _close(found.fds)
        if kept:
            STATS.incr("gone_files_read", len(kept))
        if found.counted:
            STATS.incr("weights_loaded")
            STATS.incr("loads_avoided", -1)
            STATS.incr("not_read_bytes", -found.nbytes)
        if problems:
            found.refused = "; ".join(problems)
            log.warning("ReuseKit: a lazy text encoder loaded %s, but %s: it stays out of the shared tiers",
                        found.paths, found.refused)
            for fn in list(_changed):
                fn(module)
        encoder_weights.register(module, patcher)  # the reference of its edit checks, as loaded


def _kept_names(found: _Pending, folder: str | None) -> dict[str, str]:
    """{file: a name of its kept copy in ``folder``} for each file whose path holds nothing now (moved or
    deleted since the build): ComfyUI's loader reads it there. A path that holds a file is read as usual
    (the same file, or another: replaced, loaded as it is now)."""
    kept = {}
    for i, (path, fd) in enumerate(zip(found.paths, found.fds, strict=True)):
        if folder is None or FileHashes.stamp(path) is not None:
            continue
        kept[path] = os.path.join(folder, f"{i}-{os.path.basename(path)}")  # the suffix: ComfyUI reads by it
        os.symlink(f"{FD_DIR}/{fd}", kept[path])
    return kept


def _class_name(obj) -> tuple[str, str]:
    return type(obj).__module__, type(obj).__qualname__


def _require_intact(module) -> None:
    try:
        check_intact(module)
    except Uncacheable:
        raise RuntimeError("ReuseKit Lazy CLIP Loader: something replaced the weights of a lazily loaded text "
                           "encoder before they were read; load it with CLIPLoader to edit its weights") from None


# ---- the seams ---------------------------------------------------------------------------------------

_originals: dict[tuple[object, str], object] = {}  # (owner, name) -> ComfyUI's, while ours is in place
_replacements: dict[tuple[object, str], object] = {}
_active = False  # building lazily is on (our functions pass straight through when off)
_install_lock = threading.Lock()


def _methods():
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    def load_torch_file(ckpt, *args, **kwargs):
        building = getattr(_local, "building", None)
        if building is not None and _active:
            found = building.get(os.path.realpath(os.fspath(ckpt)))
            if found is not None:
                sd, metadata = found
                return_metadata = kwargs.get("return_metadata", args[2] if len(args) > 2 else False)
                return (dict(sd), metadata) if return_metadata else dict(sd)
        kept = getattr(_local, "kept", None)
        if kept:  # a lazy encoder's file moved or deleted since its build: read as kept open
            ckpt = kept.get(os.path.realpath(os.fspath(ckpt)), ckpt)
        return _originals[(comfy.utils, "load_torch_file")](ckpt, *args, **kwargs)

    def text_encoder_initial_device(load_device, offload_device, *args, **kwargs):
        if getattr(_local, "building", None) is not None:
            return torch.device("meta")
        if getattr(_local, "materialising", False):
            return offload_device
        return _originals[(comfy.model_management, "text_encoder_initial_device")](
            load_device, offload_device, *args, **kwargs)

    def needs_weights(name):
        def method(self, *args, **kwargs):
            materialise(self.cond_stage_model, self.patcher)
            return _originals[(comfy.sd.CLIP, name)](self, *args, **kwargs)
        return method

    # (owner, name, replacement, parameters it relies on, whether the host must have it)
    return [
        (comfy.utils, "load_torch_file", load_torch_file, ("ckpt", "safe_load", "device", "return_metadata"), True),
        (comfy.model_management, "text_encoder_initial_device", text_encoder_initial_device,
         ("load_device", "offload_device"), True),
        # load_model: before ComfyUI's model manager patches the module (CLIPSave, a node's load); generate
        # (TextGenerate, newer hosts): before it sets its options on the module
        *[(comfy.sd.CLIP, name, needs_weights(name), ("self",), name not in ("state_dict_for_saving", "generate"))
          for name in ("get_sd", "get_key_patches", "state_dict_for_saving", "load_model", "generate")],
    ]


def _before_load(patcher, *args, **kwargs) -> None:
    """A lifecycle listener: ComfyUI is about to load a patcher's weights; a lazy encoder reads them first."""
    if patcher.model in _pending and hasattr(patcher, "patches"):
        materialise(patcher.model, patcher)


def routed() -> list[tuple[object, str]]:
    """(owner, name) of every method this module replaces while installed."""
    return [(owner, name) for owner, name, *_ in _methods()]


def install() -> bool:
    """Put the seams in place (idempotent); False when the host's differ (no lazy encoder is then built)."""
    global _active
    with _install_lock:
        if _active:
            return True
        # a function another pack wrapped over ours at an uninstall is still ours inside: only the rest
        methods = [m for m in _methods() if (m[0], m[1]) not in _originals and (m[4] or hasattr(m[0], m[1]))]
        if not all(host.check(FEATURE, f"{getattr(o, '__name__', o)}.{n}", getattr(o, n, None), p)
                   for o, n, _, p, _ in methods):
            return False
        for owner, name, fn, *_ in methods:
            _originals[(owner, name)] = getattr(owner, name)
            fn.__reusekit__ = True
            setattr(owner, name, fn)
            _replacements[(owner, name)] = fn
        _active = True
    lifecycle.add_listener("load", _before_load)
    for name in COUNTERS:  # shown from the start, zero or not
        STATS.incr(name, 0)
    return True


def installed() -> bool:
    return _active


def uninstall() -> None:
    """Put ComfyUI's functions back where ours are still in place (idempotent); one another pack wrapped
    later stays, ours inside it passing straight through. Lazy encoders built before cannot load their
    weights afterwards."""
    global _active
    lifecycle.remove_listener("load", _before_load)
    with _install_lock:
        for (owner, name), fn in list(_replacements.items()):
            if getattr(owner, name, None) is fn:
                setattr(owner, name, _originals.pop((owner, name)))
                del _replacements[(owner, name)]
        _active = False


SETTINGS.define(SETTING, bool, os.environ.get("REUSEKIT_LAZY_TEXT_ENCODERS", "").strip().lower() in ("1", "true", "on", "yes"),
                "ComfyUI's own CLIP loaders (CLIPLoader, DualCLIPLoader, TripleCLIPLoader: every comfy.sd.load_clip) "
                "build text encoders lazily, as ReuseKit Lazy CLIP Loader does: the weights are read only when an "
                "encode misses every tier. Off by default: a custom node that reads an encoder's weights without "
                "ComfyUI's CLIP and ModelPatcher methods would find none. Environment: REUSEKIT_LAZY_TEXT_ENCODERS=1.")
