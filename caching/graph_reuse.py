"""Graph reuse: the decision whether a captured graph of the diffusion model's forward may be
replayed for this call, independent of CUDA (pure torch + stdlib; the runners are in
caching/graph_runners.py, the wrappers in patches/graph_capture.py).

Like ik_llama.cpp's ``can_reuse_graph`` (seed 001): keep the last graphs, check every call,
update the changing inputs in place, and when the check fails rebuild and record why.

- :func:`analyse_call` turns one call (named arguments, ``transformer_options``, the model's
  state) into a :class:`CallSpec`: a :class:`Signature` of everything that makes a captured graph
  invalid, the tensors to copy in place into static buffers, and a bypass reason when the call
  cannot be captured at all. A signature holds complete fields (never a hash alone), so two
  different calls never share a graph. Plain values and small tensors on another device key by
  caching/keys.py's typed rules (``1``, ``1.0`` and ``True`` differ; floats and tensors by their
  bits); the dynamic inputs by shape, dtype, device and stride only (their values are copied in).
- :func:`can_reuse` compares two signatures and names the first difference (the rebuild reason).
- :class:`GraphSet` keeps a few graphs per model (LRU), counts hits, rebuilds by reason,
  evictions, and reports to the stats registry through :data:`STATS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import struct
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import keys
from .protocol import GRAPH_KEY, GRAPH_SAFE, OPTIONS_NAME
from .stats import REGISTRY, CacheStats

DISABLE_ENV = "REUSEKIT_DISABLE_CUDA_GRAPHS"
OPTIONS_KEY = "reusekit_graph"  # our own settings inside transformer_options
# transformer_options keys that never change what the captured forward computes: Python-side
# machinery (wrappers run outside the graph, callbacks are not called in the forward) and the
# per-run cond uuids (read only by patches; the graph-safe ones that may be captured do not).
IGNORED_OPTIONS = frozenset({"wrappers", "callbacks", "uuids", OPTIONS_KEY})
# transformer_options keys whose callables run inside the forward with Python-side state: a call
# carrying any of them runs eagerly, unless every one is marked GRAPH_SAFE.
PATCH_OPTIONS = ("patches", "patches_replace")
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
SMALL_FOREIGN_TENSOR = 4096  # elements: a tensor on another device is compared by value up to this
THRASH_LIMIT = 4  # misses in a row within one run after which it stops capturing (eager, same result)
FAILED_KEPT = 16  # failed signatures remembered per model (each runs eagerly, never retried, while kept)


def env_disabled() -> bool:
    """True where the environment variable :data:`DISABLE_ENV` turns graph capture off."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def node_options(transformer_options) -> dict:
    """A Graph node's settings in a call's ``transformer_options`` ({} where no node asked)."""
    value = transformer_options.get(OPTIONS_KEY) if isinstance(transformer_options, dict) else None
    return value if isinstance(value, dict) else {}


class Signature:
    """Everything that decides whether a captured graph is valid: an ordered tuple of
    ``(path, kind, value)`` fields. Equality compares every field."""

    __slots__ = ("fields", "_hash")

    def __init__(self, fields: tuple):
        self.fields = fields
        self._hash = hash(fields)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Signature) and self._hash == other._hash and self.fields == other.fields

    def __repr__(self) -> str:
        return f"Signature({len(self.fields)} fields)"


@dataclass
class CallSpec:
    signature: Signature | None
    tensors: list[torch.Tensor]         # the dynamic inputs, in walk order
    bypass: str | None = None           # why this call cannot be captured (runs eagerly)
    detail: str = ""


class Same:
    """Equal only to a ``Same`` of the very same living object. It holds the object weakly where
    it can (a signature never keeps a module or a model alive), and once that object is gone it
    equals no other ``Same``, so a new object at a freed one's address never matches its key."""

    __slots__ = ("_ref", "_hash", "_name", "__weakref__")

    def __init__(self, obj: Any):
        try:
            self._ref = weakref.ref(obj)
        except TypeError:  # not weakly referable (a builtin, a dict): held, so its address stays taken
            self._ref = lambda obj=obj: obj
        self._hash = id(obj)
        self._name = type(obj).__qualname__

    @property
    def obj(self) -> Any:
        """The object, or None once it was collected."""
        return self._ref()

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Same) or self._hash != other._hash:
            return False
        obj = self._ref()
        return obj is not None and other._ref() is obj

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<{self._name} at {self._hash:#x}{'' if self._ref() is not None else ', collected'}>"


def _holds_tensor(v: Any) -> bool:
    """Whether ``v`` holds a tensor among what keys.encode would read: its items, a dict's keys and values,
    a dataclass's attributes."""
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(_holds_tensor(k) or _holds_tensor(x) for k, x in v.items())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return any(_holds_tensor(getattr(v, name)) for name in keys.dataclass_attributes(v))
    return False


def _identity(fn: Any) -> Any:
    """What a callable is: itself, or for a bound method (made anew on every attribute access)
    its object and function."""
    if isinstance(fn, types.MethodType):
        return Same(fn.__self__), Same(fn.__func__)
    return Same(fn)


class _Walker:
    """Walks a call's arguments in a fixed order: records signature fields and dynamic tensors,
    or (``sub`` given) rebuilds the arguments with the static buffers substituted."""

    __slots__ = ("fields", "tensors", "bypass", "detail", "device", "sub")

    def __init__(self, device: torch.device | None, sub: Iterator[torch.Tensor] | None = None):
        self.fields: list[tuple] = []
        self.tensors: list[torch.Tensor] = []
        self.bypass: str | None = None
        self.detail = ""
        self.device = device
        self.sub = sub

    def fail(self, reason: str, detail: str) -> None:
        if self.bypass is None:
            self.bypass, self.detail = reason, detail

    def tensor(self, path: str, t: torch.Tensor, in_options: bool):
        dev = t.device
        if self.device is not None and dev != self.device:
            # Not a graph input (a graph reads device memory only): compare small ones by value.
            if t.numel() > SMALL_FOREIGN_TENSOR:
                self.fail("uncapturable_input", f"{path} is a large tensor on {dev}")
            elif self.sub is None:
                try:
                    self.fields.append((path, "foreign", keys.tensor_field(t)))
                except keys.Uncacheable as exc:
                    self.fail("uncapturable_input", f"{path}: {exc}")
            return t
        if t.layout is not torch.strided:
            self.fail("uncapturable_input", f"{path} is a {t.layout} tensor")
            return t
        if self.sub is not None:
            return next(self.sub)
        self.fields.append((path, "tensor", (t.shape, t.dtype, dev, t.stride())))
        self.tensors.append(t)
        return t

    def value(self, path: str, v: Any, in_options: bool):
        if isinstance(v, torch.Tensor):
            return self.tensor(path, v, in_options)
        if isinstance(v, PLAIN):
            if self.sub is None:
                self.fields.append((path, "value", keys.encode(v)))
            return v
        if isinstance(v, (list, tuple)):
            named = isinstance(v, tuple) and hasattr(type(v), "_make")  # a namedtuple: built from its fields
            if type(v) not in (list, tuple, torch.Size) and not named:  # a subclass the walk could not rebuild
                self.fail("uncapturable_input", f"{path} is a {type(v).__qualname__}")
                return v
            if self.sub is None:
                self.fields.append((path, "seq", (type(v).__qualname__ if named else type(v).__name__, len(v))))
            items = [self.value(f"{path}[{i}]", x, in_options) for i, x in enumerate(v)]
            if self.sub is None:
                return v
            return type(v)._make(items) if named else type(v)(items)
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            if self.sub is None:
                self.fields.append((path, "dict", tuple(v)))
            out = {k: self.value(f"{path}.{k}", x, in_options) for k, x in v.items()}
            return out if self.sub is not None else v
        if in_options:
            # Anything the forward may call (an attention override: a function, a bound method, a
            # callable object) or that decides what it does (GRAPH_KEY) counts by identity; a value
            # the forward may branch on (a set: LTX-2 STG's blocks, an enum, a dataclass, a dict with
            # other keys) by value, and one holding a tensor the walk cannot rebuild is refused; an
            # object of any other kind, a state holder of a wrapper (a step cache's run, EasyCache)
            # which the forward never reads and which is copied with every clone, by its type only.
            if callable(v) or getattr(v, GRAPH_KEY, False):
                key = (type(v).__qualname__, _identity(v))
            else:
                try:
                    if _holds_tensor(v):
                        self.fail("uncapturable_input", f"{path} is a {type(v).__qualname__} holding a tensor")
                        return v
                    key = (type(v).__qualname__, ("value", keys.encode(v)))
                except keys.Uncacheable:
                    key = (type(v).__qualname__, Same(v) if isinstance(v, enum.Enum) else None)
                except Exception as exc:  # a dataclass that holds itself, a field never set: not read, eager
                    self.fail("uncapturable_input", f"{path}: a {type(v).__qualname__} the walk cannot read "
                                                    f"({type(exc).__name__})")
                    return v
            if self.sub is None:
                self.fields.append((path, "object", key))
            return v
        self.fail("uncapturable_input", f"{path} is a {type(v).__qualname__}")
        return v

    def patches(self, path: str, v: Any) -> None:
        """Transformer patches (``{name: [fn, ...]}`` or ``{"dit": {(block, i): fn}}``): each
        counts by identity when marked :data:`GRAPH_SAFE`; any other makes the call eager."""
        if isinstance(v, dict):
            for k, x in v.items():
                self.patches(f"{path}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                self.patches(f"{path}[{i}]", x)
        elif getattr(v, GRAPH_SAFE, False):
            if self.sub is None:
                self.fields.append((path, "object", (type(v).__qualname__, Same(v))))
        else:
            self.fail("transformer_patches", f"{path} is {getattr(v, '__qualname__', type(v).__qualname__)}")

    def options(self, opts: dict):
        out = {} if self.sub is not None else None
        for key, v in opts.items():
            if key in IGNORED_OPTIONS:
                if out is not None:
                    out[key] = v
                continue
            path = f"{OPTIONS_NAME}.{key}"
            if key in PATCH_OPTIONS:
                if v:
                    self.patches(path, v)
                if out is not None:
                    out[key] = v
                continue
            if key == "cond_or_uncond":  # recorded first by analyse_call
                if out is not None:
                    out[key] = list(v)
                continue
            r = self.value(path, v, True)
            if out is not None:
                out[key] = r
        return out


def analyse_call(args: list[tuple[str, Any]], state: tuple = (), device: torch.device | None = None) -> CallSpec:
    """A signature of one forward call. ``args`` are (name, value) pairs in call order (the
    ``transformer_options`` dict among them by that name); ``state`` are extra ``(path, kind,
    value)`` fields of the model (weight-patch state, grad mode...); ``device`` is the model's
    device: tensors elsewhere are compared by value and not buffered."""
    w = _Walker(device)
    w.fields.extend(state)
    for name, v in args:  # the batch's cond/uncond composition first: it explains the shapes
        if name == OPTIONS_NAME and isinstance(v, dict) and "cond_or_uncond" in v:
            w.fields.append((f"{OPTIONS_NAME}.cond_or_uncond", "cond_batch", tuple(v["cond_or_uncond"])))
    for name, v in args:
        if name == OPTIONS_NAME and isinstance(v, dict):
            w.options(v)
        else:
            w.value(name, v, False)
    if w.bypass is not None:
        return CallSpec(None, [], w.bypass, w.detail)
    return CallSpec(Signature(tuple(w.fields)), w.tensors)


def substitute(args: list[tuple[str, Any]], static: list[torch.Tensor], device: torch.device | None = None
               ) -> list[tuple[str, Any]]:
    """The same arguments with every dynamic tensor replaced by its static buffer (same order as
    :func:`analyse_call`)."""
    it = iter(static)
    w = _Walker(device, it)
    out = []
    for name, v in args:
        if name == OPTIONS_NAME and isinstance(v, dict):
            out.append((name, w.options(v)))
        else:
            out.append((name, w.value(name, v, False)))
    if next(it, None) is not None:
        raise AssertionError("static buffers left over: the walk is not deterministic")
    return out


def _reason_for_path(path: str, default: str) -> str:
    low = path.lower()
    if "control" in low:
        return "control"
    if "mask" in low:
        return "mask"
    if path.startswith(OPTIONS_NAME):
        return "options"
    return default


def can_reuse(prev: Signature | None, new: Signature) -> tuple[bool, str, str]:
    """``(True, "", "")`` when a graph captured for ``prev`` is valid for ``new``; otherwise
    ``(False, reason, detail)`` naming the first field that differs."""
    if prev is None:
        return False, "first", "no graph yet"
    if prev == new:
        return True, "", ""
    a, b = prev.fields, new.fields
    for fa, fb in zip(a, b, strict=False):  # a length difference is named after the loop
        if fa == fb:
            continue
        (pa, ka, va), (pb, kb, vb) = fa, fb
        if pa != pb or ka != kb:
            why = _reason_for_path(pa, "inputs")
            return False, why if why != "inputs" else _reason_for_path(pb, "inputs"), f"{pa} ({ka}) -> {pb} ({kb})"
        if ka == "tensor":
            for i, part in enumerate(("shape", "dtype", "device", "layout")):
                if va[i] != vb[i]:
                    a_i, b_i = (tuple(v[i]) if i == 0 else v[i] for v in (va, vb))
                    return False, part, f"{pa}: {a_i} -> {b_i}"
        if ka in ("cond_batch", "weights", "object_patches", "mode"):
            return False, ka, f"{pa}: {va} -> {vb}"
        if ka in ("seq", "dict"):
            return False, _reason_for_path(pa, "inputs"), f"{pa}: {va} -> {vb}"
        if ka == "value":
            va, vb = _plain(va), _plain(vb)
        return False, _reason_for_path(pa, "value"), f"{pa}: {_short(va)} -> {_short(vb)}"
    longer = a if len(a) > len(b) else b
    extra = longer[min(len(a), len(b))]
    return False, _reason_for_path(extra[0], "inputs"), f"{extra[0]} {'removed' if longer is a else 'added'}"


def _plain(encoded: tuple) -> Any:
    """A plain value back from its key field (caching/keys.py), for a rebuild's detail."""
    tag = encoded[0]
    if tag == "f":
        return struct.unpack("<d", encoded[1])[0]
    return None if tag == "none" else encoded[1]


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ---- the graphs of one model ----------------------------------------------------------------

@dataclass
class Entry:
    """One kept graph: its signature and the backend's runner (``None`` for decisions only,
    e.g. on a machine without CUDA)."""

    signature: Signature
    runner: Any = None
    nbytes: int = 0
    failed: str = ""          # the capture failed: this signature runs eagerly, never retried (kept apart
    #                           from the graphs, up to FAILED_KEPT: it holds no memory, so takes no max_graphs slot)


def _free(entries: list[Entry]) -> None:
    for e in entries:
        if e.runner is not None:
            e.runner.release()
            e.runner = None


@dataclass
class Decision:
    hit: bool
    entry: Entry | None
    reason: str = ""          # why no kept graph fits (a rebuild), "" on a hit
    detail: str = ""


@dataclass
class GraphSet:
    """The kept graphs of one model, most recently used last, and the signatures whose capture failed.
    ``release`` drops them all (the model was unloaded or its weights changed)."""

    max_graphs: int = 2
    entries: OrderedDict = field(default_factory=OrderedDict)
    failures: OrderedDict = field(default_factory=OrderedDict)  # failed entries, most recently used last
    last: Signature | None = None
    pending_reason: tuple[str, str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    shared: dict = field(default_factory=dict)  # the backend's state for all of them (a memory pool)
    busy: int = 0             # forwards between their decision and the end of their replay or capture
    doomed: list = field(default_factory=list)  # entries dropped while busy: freed when the last ends
    generation: int = 0       # bumped by every release: a capture begun before one is not kept

    @contextlib.contextmanager
    def in_use(self):
        """Held by a forward from its decision through its replay or capture: entries dropped
        meanwhile (a clear or an unload from any thread) keep their runners until it ends."""
        with self.lock:
            self.busy += 1
        try:
            yield
        finally:
            with self.lock:
                self.busy -= 1
                doomed, self.doomed = (self.doomed, []) if not self.busy else ([], self.doomed)
            _free(doomed)

    def retire(self, entries: list[Entry]) -> None:
        """Free the runners of entries no longer kept: now, or once no forward is using the set."""
        with self.lock:
            if self.busy:
                self.doomed.extend(entries)
                return
        _free(entries)

    def decide(self, sig: Signature) -> Decision:
        with self.lock:
            kept = self.entries if sig in self.entries else self.failures
            entry = kept.get(sig)
            if entry is not None:
                kept.move_to_end(sig)
                self.last = sig
                return Decision(True, entry)
            same, reason, detail = can_reuse(self.last, sig)
            if same:  # the last graph fits but was released (unload, reload, clear)
                reason, detail = self.pending_reason or ("released", "")
            return Decision(False, None, reason, detail)

    def add(self, entry: Entry, generation: int | None = None) -> list[Entry]:
        """Keep ``entry`` (most recent); returns the entries evicted to stay within max_graphs, or
        ``[entry]`` itself where the set was released since ``generation`` (when its capture began)."""
        with self.lock:
            if generation is not None and generation != self.generation:
                return [entry]
            kept, limit = (self.failures, FAILED_KEPT) if entry.failed else (self.entries, max(1, self.max_graphs))
            kept[entry.signature] = entry
            kept.move_to_end(entry.signature)
            self.last = entry.signature
            self.pending_reason = None
            return self._trim(kept, limit)

    @staticmethod
    def _trim(kept: OrderedDict, limit: int) -> list[Entry]:
        evicted = []
        while len(kept) > limit:
            _, old = kept.popitem(last=False)
            evicted.append(old)
        return evicted

    def release(self, reason: str, detail: str = "") -> list[Entry]:
        """Drop every graph; ``last`` stays, so the next rebuild still names what changed (or,
        when nothing did, this reason)."""
        with self.lock:
            self.generation += 1
            dropped = [*self.entries.values(), *self.failures.values()]
            self.entries.clear()
            self.failures.clear()
            if dropped:
                self.pending_reason = (reason, detail)
            return dropped


# ---- stats ----------------------------------------------------------------------------------

class GraphStats:
    """The ``graph`` entry of the stats registry plus the per-run summary."""

    NAME = "graph_reuse"

    def __init__(self):
        self._handle: CacheStats | None = None
        self._clear: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @property
    def handle(self) -> CacheStats:
        with self._lock:
            if self._handle is None:
                self._handle = REGISTRY.register(
                    self.NAME, "graph", "CUDA graphs of the diffusion model's forward: captured once, "
                    "replayed while the inputs' shapes, batch and weights stay the same",
                    clear=self.clear)
            return self._handle

    def set_clear(self, fn: Callable[[], None]) -> None:
        self._clear = fn

    def clear(self) -> None:
        if self._clear is not None:
            self._clear()

    def incr(self, counter: str, n: int = 1) -> None:
        self.handle.incr(counter, n)

    def memory(self, nbytes: int, entries: int) -> None:
        self.handle.set_memory("device", nbytes)
        self.handle.set_entries(entries)

    def info(self, key: str, value: Any) -> None:
        self.handle.set_info(key, value)

    def reason(self, event: str, reason: str, source: str = "") -> None:
        """A forward that ran eagerly, and why (:meth:`CacheStats.count_reason`)."""
        self.handle.count_reason(event, reason, source=source)


@dataclass
class RunSummary:
    """What one sampling run did; published as ``last_run``."""

    backend: str = ""
    steps: int = 0
    replays: int = 0
    captures: int = 0
    hits: int = 0
    eager: int = 0
    step_skips: int = 0       # forwards a step cache's hook skipped (nothing replayed)
    rebuilds: dict = field(default_factory=dict)
    bypasses: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    misses_in_row: int = 0    # a run that misses THRASH_LIMIT times in a row stops capturing
    model_calls: int = 0      # apply_model calls (the forwards counted in ``steps`` are those that reached us)
    compiled: bool = False    # one of them ran under ComfyUI's torch.compile wrapper
    capture_stopped: bool = False

    def note(self, text: str) -> None:
        if len(self.notes) < 8 and text not in self.notes:
            self.notes.append(text)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "steps": self.steps, "hits": self.hits, "replays": self.replays,
                "captures": self.captures, "eager_steps": self.eager, "step_cache_skips": self.step_skips, "rebuilds": dict(self.rebuilds),
                "bypasses": dict(self.bypasses), "notes": list(self.notes)}
