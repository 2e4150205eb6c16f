"""One walk of an encoder's module tree, reused until the tree changes.

Two parts of an encode's key read an encoder's modules: its settings (every plain attribute of every
module: patches/conditioning.py) and its weights (the edit checks: patches/encoder_weights.py). Both
take them from a :class:`ModuleTree`, the tree as it is without ComfyUI's object patches (their
originals are in the patcher's ``object_patches_backup``, which clones share; ComfyUI 0.33+ marks an
attribute a patch added as ``comfy.utils.ATTR_UNSET``).

A tree is walked once per module and reused while :meth:`ModuleTree.fresh` holds: the object-patch
backup has the same entries, every module's attribute dict the same size, every plain attribute and
child module the same object (modules and bound methods by weak reference, of the same class), every parameter and
buffer table the same size, and no hook table has an entry. A plain attribute set, a child swapped, a
weight added or removed, a hook or an object patch makes it stale: the next call walks again. The
check costs one pass over those references, nothing that grows with the weights' bytes. Within one
encode's key and lookup (a :class:`Look`: only ReuseKit's own code runs between its steps, on one
thread) a tree found fresh once is not checked again. Attributes
ComfyUI rewrites while it loads, casts and unloads weights (``LOAD_STATE``) are not settings and are
not followed.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref

import torch

from ..caching.weights_identity import plain_leaves

# What ComfyUI writes on an encoder's modules while it loads, casts and unloads weights (keyed through
# the patcher and load device instead), and the options an encode resets first (SD1ClipModel's
# reset_clip_options: their values at the call follow from options_default and the keyed layer_idx).
LOAD_STATE = frozenset({
    "current_weight_patches_uuid", "model_loaded_weight_memory", "model_lowvram", "lowvram_patch_counter",
    "model_offload_buffer_memory", "weight_function", "bias_function", "comfy_cast_weights",
    "prev_comfy_cast_weights", "comfy_force_cast_weights", "comfy_patched_weights", "device", "execution_device",
    # ComfyUI 0.16+: dynamic VRAM's pins, arenas and patchers, and the injection state of its patchers
    "dynamic_pins", "dynamic_vbars", "dynamic_patchers", "seed_key", "skip_injection", "current_patcher"})
RESET_OPTIONS = frozenset({"layer", "layer_idx", "return_projected_pooled"})
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_MISSING = object()


def _held(value):
    return weakref.ref(value) if isinstance(value, (torch.nn.Module, types.MethodType)) else value


class ModuleTree:
    """A module tree as walked: ``settings`` (module path, attribute name, value as without object
    patches), ``slots`` (parameter or buffer table, key, full name) of the weights, ``classes`` (the
    classes its modules are instances of and their bases short of ``torch.nn.Module``, each once), ``hooked`` (the
    path of a module with hooks, or None) and ``memo``, where readers keep what they derive from it."""

    __slots__ = ("settings", "slots", "classes", "hooked", "memo", "_root", "_refs", "_sizes", "_hooks", "_backup")

    def __init__(self) -> None:
        self.settings: list[tuple[str, str, object]] = []
        self.slots: list[tuple[dict, str, str]] = []
        self.classes: list[type] = []
        self.hooked: str | None = None
        self.memo: dict = {}
        self._root: tuple[weakref.ref, type] | None = None
        self._refs: list[tuple[dict, str, object, type | None]] = []
        self._sizes: list[tuple[dict, int]] = []
        self._hooks: list[dict] = []
        self._backup: list[tuple[str, object]] = []

    def fresh(self, backup: dict) -> bool:
        if len(backup) != len(self._backup) or any(backup.get(k, _MISSING) is not v for k, v in self._backup):
            return False
        if any(len(d) != n for d, n in self._sizes) or any(self._hooks):
            return False
        root, cls = self._root
        if type(root()) is not cls:
            return False
        for d, name, held, cls in self._refs:  # cls: a weakly held value's class (a module's swapped class changes it)
            if cls is None:
                if d.get(name, _MISSING) is not held:
                    return False
            elif (value := d.get(name, _MISSING)) is not held() or type(value) is not cls:
                return False
        return True

    def _walk(self, module: torch.nn.Module, backup: dict) -> None:
        unset = getattr(sys.modules.get("comfy.utils"), "ATTR_UNSET", _MISSING)  # an object patch's "was absent"
        seen_modules, seen_weights, classes = set(), set(), {}

        def remember(d, name, value):
            weak = isinstance(value, (torch.nn.Module, types.MethodType))
            self._refs.append((d, name, _held(value), type(value) if weak else None))

        def walk(m: torch.nn.Module, path: str) -> None:
            if id(m) in seen_modules:
                return
            seen_modules.add(id(m))
            for cls in type(m).__mro__:
                if cls is not torch.nn.Module and cls is not object:
                    classes.setdefault(cls, None)
            prefix = f"{path}." if path else ""
            d = vars(m)
            self._sizes.append((d, len(d)))
            for name in HOOKS:
                table = d.get(name)
                if isinstance(table, dict):
                    self._hooks.append(table)
                    if table and self.hooked is None:
                        self.hooked = path or type(m).__name__
            reset = RESET_OPTIONS if hasattr(m, "reset_clip_options") else ()
            for name, value in list(d.items()):  # ComfyUI may set or delete attributes meanwhile (a load)
                if name.startswith("_") or name in LOAD_STATE or name in reset:
                    continue
                remember(d, name, value)
                value = backup.get(prefix + name, value)
                if value is unset or isinstance(value, (torch.Tensor, torch.nn.Module)):
                    continue
                self.settings.append((path, name, value))
            for table_name in ("_parameters", "_buffers"):
                table = d.get(table_name) or {}
                self._sizes.append((table, len(table)))
                for key, t in list(table.items()):
                    full = prefix + key
                    t = backup.get(full, t)
                    if isinstance(t, torch.Tensor) and id(t) not in seen_weights:  # a tied weight once
                        seen_weights.add(id(t))
                        self.slots.append((table, key, full))
            children = d.get("_modules") or {}
            self._sizes.append((children, len(children)))
            for name, child in list(children.items()):
                remember(children, name, child)
                child = backup.get(prefix + name, child)
                if isinstance(child, torch.nn.Module):
                    walk(child, prefix + name)

        self._backup = list(backup.items())
        self._root = (weakref.ref(module), type(module))
        walk(module, "")
        self.classes = list(classes)


_trees: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_local = threading.local()  # the Look active on this thread, if any


class Look:
    """The trees found or made during one encode's key and lookup, reused within it: entered around
    each stretch (``with look:``) where only ReuseKit's own code runs, and never around an encode's
    computation (the encoder's code may set attributes)."""

    __slots__ = ("_seen", "_outer")

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.nn.Module, object, ModuleTree]] = {}  # id -> (module, patcher's backup, tree)

    def __enter__(self) -> Look:
        self._outer = getattr(_local, "look", None)
        _local.look = self
        return self

    def __exit__(self, *exc) -> None:
        _local.look = self._outer


def tree(module: torch.nn.Module, patcher) -> ModuleTree:
    """The module's tree, walked again only when it changed (see the module docstring)."""
    held = getattr(patcher, "object_patches_backup", None)
    backup = held or {}
    look = getattr(_local, "look", None)
    if look is not None:
        seen = look._seen.get(id(module))
        if seen is not None and seen[0] is module and seen[1] is held:
            return seen[2]
    with _lock:
        found = _trees.get(module)
    if found is None or not found.fresh(backup):
        found = ModuleTree()
        found._walk(module, backup)
        with _lock:
            _trees[module] = found
    if look is not None:
        look._seen[id(module)] = (module, held, found)
    return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a weight that is its own leaf (no generator per weight per encode)


def weights(module: torch.nn.Module, patcher) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """The weights an encode reads as its base (by full name; a tensor subclass's by its inner tensors,
    ``<name>.<inner>``), and the names the patcher has patched over right now (their base values are in its
    weight backup)."""
    found = tree(module, patcher)
    weights_backup = getattr(patcher, "backup", None) or {}
    objects_backup = getattr(patcher, "object_patches_backup", None) or {}
    named: dict[str, torch.Tensor] = {}
    patched = []
    for table, key, full in found.slots:
        if full in weights_backup:  # (by the names its unpatched weight has: a quantized one's leaves)
            base = getattr(weights_backup[full], "weight", weights_backup[full])
            if isinstance(base, torch.Tensor):
                patched.extend(n for n, _ in plain_leaves(full, base))
            else:
                patched.append(full)
            continue
        t = objects_backup.get(full, _MISSING) if objects_backup else _MISSING
        t = table.get(key) if t is _MISSING else t
        if type(t) in _PLAIN:
            named[full] = t
        elif isinstance(t, torch.Tensor):
            named.update(plain_leaves(full, t))  # a quantized layout's data and scales, never dequantized
    return named, frozenset(patched)
