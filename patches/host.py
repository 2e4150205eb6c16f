"""What this ComfyUI offers the pack: its version, a shape check for every seam a patch relies on,
and the start-up line that says which layers are active and which are off, and why.

A patch calls :func:`check` at install with what it expects of its target (parameter names in
order, attributes). When the host differs (a newer ComfyUI renamed or reshaped it), the feature
stays off, one warning names the feature, the host version and what differs, and nothing is
patched: the host runs unchanged. Each layer reports itself with :func:`set_layer`;
:func:`startup_line` gathers them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("reusekit")

MARK = "__reusekit_patch__"  # on every replacement a Patch installs

_lock = threading.Lock()
_said: set[str] = set()
_layers: dict[str, tuple[str, str]] = {}  # layer -> (state, detail)
_off: dict[str, str] = {}                 # feature -> why it is off on this host


def comfyui_version() -> str:
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # a checkout without the version file
        return "unknown"


def say_once(key: str, msg: str, *args, level: int = logging.INFO) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, msg, *args)


_STDLIB = os.path.dirname(os.path.realpath(os.__file__)) + os.sep


@functools.lru_cache(maxsize=4096)
def file_origin(path: str) -> str:
    """Where a source file is: "host" (ComfyUI outside its custom_nodes), "library" (the standard library,
    torch, an installed package) or "other" (another custom node, a script). Code without a file (``<string>``:
    a dataclass's generated methods, ``exec``) reads as a library's: where it comes from cannot be told."""
    if not os.path.isabs(path):
        return "library"
    path = os.path.realpath(path)
    root = os.path.dirname(os.path.dirname(os.path.realpath(sys.modules["comfy.model_management"].__file__))) + os.sep
    if path.startswith(root) and not path[len(root):].startswith("custom_nodes" + os.sep):
        return "host"
    torch = os.path.dirname(os.path.realpath(sys.modules["torch"].__file__)) + os.sep
    if path.startswith(torch) or path.startswith(_STDLIB) or "-packages" + os.sep in path:
        return "library"
    return "other"


def foreign_code(fn) -> str | None:
    """The file of code in ``fn``, or in what it wraps (``__wrapped__``, through this pack's own patches), that
    is neither ComfyUI's nor a library's (torch's decorators): another pack's wrapper, which
    ``functools.wraps`` gives ComfyUI's module name; as it is shown (from custom_nodes on, else its name).
    None where there is none."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
            continue
        code = getattr(fn, "__code__", None)
        if code is not None and not getattr(fn, MARK, False) and file_origin(code.co_filename) == "other":
            path = code.co_filename.replace(os.sep, "/")
            return path[path.index("custom_nodes/"):] if "custom_nodes/" in path else os.path.basename(path)
        fn = getattr(fn, "__wrapped__", None)
    return None


def owner_if_not_host(fn) -> str | None:
    """Whose ``fn`` is where it is not ComfyUI's own (None where it is): its module where that is not
    ComfyUI's, else the file of another pack's wrapper that took ComfyUI's module name (:func:`foreign_code`)."""
    source = getattr(fn, "__module__", None) or ""
    if not source.startswith("comfy."):
        return source or "something"
    return foreign_code(fn)


def _parameter_names(target) -> list[str] | None:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [p.name for p in sig.parameters.values()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def differs(target, params: tuple[str, ...] = (), attrs: tuple[str, ...] = (), exact: bool = False) -> str | None:
    """What about ``target`` differs from what a patch expects (``None``: nothing).

    ``params``: parameter names that must appear in this order (others may stand between them, unless
    ``exact``: a replacement with a fixed signature needs exactly these); ``attrs``: attributes
    ``target`` must have."""
    if target is None:
        return "it is missing"
    if params:
        names = _parameter_names(target)
        if names is None:
            return "its signature cannot be read"
        it = iter(names)
        if (names != list(params)) if exact else any(p not in it for p in params):
            expected = "exactly" if exact else "in that order"
            return f"its parameters are ({', '.join(names)}), expected {', '.join(params)} {expected}"
    absent = [a for a in attrs if not hasattr(target, a)]
    if absent:
        return f"it has no {', '.join(absent)}"
    return None


_MISSING = object()


@functools.lru_cache(maxsize=4096)
def _chains(code) -> tuple[tuple[str, ...], ...]:
    """The names a code object (and the code it nests) reads from its module's globals, each with the
    attributes read off it in turn (``comfy.clip_model.clip_preprocess``): ``LOAD_GLOBAL`` then ``LOAD_ATTR``
    / ``LOAD_METHOD``."""
    import dis

    found: dict[tuple[str, ...], None] = {}
    codes = [code]
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if inspect.iscode(k)]  # lambdas, comprehensions, inner functions
        chain: list[str] = []
        for ins in dis.get_instructions(c):
            if ins.opname == "LOAD_GLOBAL":
                if chain:
                    found[tuple(chain)] = None
                chain = [ins.argval]
            elif chain and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                chain.append(ins.argval)
            elif chain:
                found[tuple(chain)] = None
                chain = []
        if chain:
            found[tuple(chain)] = None
    return tuple(found)


def globals_read(fn, through: Callable[[object], bool]) -> list[tuple[dict, str, object]]:
    """What a function's code reads by name from its module's globals, as ``(namespace, name, value)``, followed
    through the modules ``through`` accepts: ``qwen_vl.process_qwen2vl_images`` is read from ``qwen_vl``'s
    namespace. A name the namespace lacks has the value :data:`_MISSING`. Checking these values by identity
    later tells whether another node rebound one (a patch of a module function the code calls)."""
    found = []
    for chain in _chains(fn.__code__):
        holder, name = fn.__globals__, chain[0]
        value = holder.get(name, _MISSING)
        for attr in chain[1:]:
            if not (inspect.ismodule(value) and through(value)):
                break
            holder, name, value = vars(value), attr, vars(value).get(attr, _MISSING)
        found.append((holder, name, value))
    return found


def check(feature: str, where: str, target, params: tuple[str, ...] = (), attrs: tuple[str, ...] = (),
          exact: bool = False) -> bool:
    """True when ``target`` (found at ``where``) has the expected shape (see :func:`differs`);
    otherwise ``feature`` is off on this host: one warning says so, and :func:`off_features` lists it."""
    why = differs(target, params, attrs, exact)
    if why is None:
        return True
    reason = f"{where}: {why}"
    with _lock:
        _off[feature] = reason
    say_once(f"shape:{feature}", "ReuseKit: %s is off on ComfyUI %s (%s); ComfyUI runs it unchanged",
             feature, comfyui_version(), reason, level=logging.WARNING)
    return False


def off_features() -> dict[str, str]:
    with _lock:
        return dict(_off)


def set_layer(layer: str, state: str, detail: str = "") -> None:
    """Record a layer's state for the start-up line (``state``: "on", "off", ...)."""
    with _lock:
        _layers[layer] = (state, detail)


def layers() -> dict[str, tuple[str, str]]:
    with _lock:
        return dict(_layers)


ORDER = ("conditioning cache", "PE cache", "step cache", "graph capture", "panel")  # pipeline order


def startup_line(pack_version: str) -> str:
    ordered = sorted(layers().items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER))
    parts = [f"{name} {state}" + (f" ({detail})" if detail else "") for name, (state, detail) in ordered]
    return f"ReuseKit {pack_version} on ComfyUI {comfyui_version()}: " + "; ".join(parts)


class Patch:
    """One monkey-patch of ``module.<owner>.<attr>`` (or ``module.<attr>``) with install/uninstall.

    ``params``: the builder's parameter names, in order, that the replacement relies on (``exact``:
    all of them, for a replacement with a fixed signature); a host builder without them is left
    unpatched (:attr:`off` says why), and so is one another pack replaced before this one installs
    (``host_only``: its key would describe ComfyUI's builder, not theirs)."""

    def __init__(self, family: str, module: str, attr: str, make: Callable[[Callable], Callable],
                 params: tuple[str, ...] = (), exact: bool = False, host_only: bool = True, layer: str = "PE cache"):
        self.family, self.module, self.attr, self.make, self.params = family, module, attr, make, params
        self.exact, self.host_only, self.layer = exact, host_only, layer
        self._original = None
        self._replacement = None
        self.off: str | None = None  # why the host's function stays unpatched (its shape differs, another's)

    def _target(self):
        mod = importlib.import_module(self.module)
        *owner_path, leaf = self.attr.split(".")
        owner = mod
        for part in owner_path:
            owner = getattr(owner, part)
        return owner, leaf

    def available(self) -> bool:
        """The feature probe: the host has this builder, defined where we expect it."""
        try:
            owner, leaf = self._target()
        except (ImportError, AttributeError):
            return False
        fn = owner.__dict__.get(leaf) if inspect.isclass(owner) else getattr(owner, leaf, None)
        return callable(fn)

    @property
    def installed(self) -> bool:
        return self._original is not None

    @property
    def replacement(self) -> Callable | None:
        """What :meth:`install` put in place of the host's function (None: not installed)."""
        return self._replacement

    def original(self) -> Callable:
        if self._original is not None:
            return self._original
        owner, leaf = self._target()
        return owner.__dict__[leaf] if inspect.isclass(owner) else getattr(owner, leaf)

    def install(self) -> bool:
        if self.installed:
            return True
        if not self.available():
            # the start-up line lists the families covered (LTXV has one builder per host generation)
            log.debug("ReuseKit %s: %s.%s not found on this ComfyUI", self.layer, self.module, self.attr)
            return False
        owner, leaf = self._target()
        original = owner.__dict__[leaf] if inspect.isclass(owner) else getattr(owner, leaf)
        if getattr(original, MARK, False):  # another copy of the pack patched it: leave it
            return False
        where = f"{self.module}.{self.attr}"
        if not check(f"{self.layer} for {self.family}", where, original, self.params, exact=self.exact):
            self.off = differs(original, self.params, exact=self.exact)
            return False
        owner_name = owner_if_not_host(original) if self.host_only else None
        if owner_name:
            self.off = f"is {owner_name}'s, not ComfyUI's"
            say_once(f"replaced-{where}", "ReuseKit %s: %s %s; left unpatched", self.layer, where, self.off,
                     level=logging.WARNING)
            return False
        self.off = None
        replacement = functools.wraps(original)(self.make(original))
        setattr(replacement, MARK, True)
        setattr(owner, leaf, replacement)
        self._original, self._replacement = original, replacement
        return True

    def uninstall(self) -> None:
        if not self.installed:
            return
        owner, leaf = self._target()
        current = owner.__dict__.get(leaf) if inspect.isclass(owner) else getattr(owner, leaf, None)
        if current is self._replacement:
            setattr(owner, leaf, self._original)
        else:
            log.warning("ReuseKit %s: %s.%s was patched again by someone else; left as it is", self.layer,
                        self.module, self.attr)
        self._original = self._replacement = None
