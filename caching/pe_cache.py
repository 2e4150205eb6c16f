"""The PE cache: rotary / positional embeddings computed once per geometry, bit-exact.

A :class:`PECache` belongs to one model and holds, for each named PE input, the most recent key and
the tensors built for it. A matching key returns the stored tensors themselves (the same objects,
so a captured graph sees stable inputs); another key replaces that name's entry; names are
independent. There is no LRU and no budget: one entry per name, released with the cache.

:class:`PECacheKey` lists, in order, every field that decides the embedding: geometry, text
length, theta and axes, reference offsets, rope options, dtype, device, encoded by the shared key
rules (``caching/keys.py``). Keys compare their complete encoded fields, never a hash alone. The
builders' keys (``patches/rope.py``) hold host values only (shapes, integers, options, dtype and
device): deciding a hit never reads a device tensor, so a hit neither copies to the host nor waits
for the GPU. Only tensors on the host may be keyed by their values (bytes, or a digest of them).

Safety:

- Stored tensors are never written in place; a replacement only drops the cache's reference, so a
  step that still holds the old tensor keeps valid data.
- Stored tensors are normal (version-counted) tensors. A hit checks that no caller has modified
  them in place since they were stored; if one was, the entry is rebuilt (counted as
  ``mutated``), so a caller cannot corrupt what the next step receives.
- A key holds no caller tensor: its fields are the values' bytes or their digest, so a caller
  changing its tensor after the call cannot change a stored key.

When a name misses but another name of its group holds an equal key (cond and uncond run as
separate batches build the same table), the new entry shares that name's tensors instead of building a second copy
(counted as ``shared``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .keys import encode, nbytes
from .settings import SETTINGS
from .stats import REGISTRY, StatsRegistry

DEFAULT_ENABLED_KEY = "pe_cache.default_enabled"
SETTINGS.define(DEFAULT_ENABLED_KEY, bool, False,
                "Cache rotary position embeddings for every model, also those without a ReuseKit PE Cache "
                "node (the node's own 'enabled' input still wins).")


def default_enabled() -> bool:
    return SETTINGS.get(DEFAULT_ENABLED_KEY)


# ---- keys ----------------------------------------------------------------------------------

class PECacheKey:
    """The full description of one named PE input: ``PECacheKey("flux.pe").add(h).add(w)...``."""

    __slots__ = ("name", "group", "fields")

    def __init__(self, name: str, group: str | None = None):
        """``group``: names of one group build the same tensors from equal fields (e.g. one
        builder's cond and uncond inputs), so they may share them; ``None``: never shared."""
        if not name:
            raise ValueError("a PECacheKey needs a name")
        self.name = name
        self.group = group
        self.fields: list[Any] = []

    def add(self, value: Any) -> PECacheKey:
        """One field, encoded by the shared key rules (``caching/keys.py``); order matters.
        Raises :class:`~.keys.Uncacheable` for a value those rules cannot key."""
        self.fields.append(encode(value))
        return self

    def add_encoded(self, tree: Any) -> PECacheKey:
        """One field already encoded by the key rules (e.g. :func:`~.keys.encode_geometry`), shared
        by several keys without encoding it again."""
        self.fields.append(tree)
        return self

    def add_shape(self, shape) -> PECacheKey:
        """Every dimension, trailing ones included."""
        return self.add(torch.Size(int(d) for d in shape))

    def add_shapes(self, shapes) -> PECacheKey:
        """An ordered list of shapes (e.g. reference latents)."""
        return self.add(tuple(torch.Size(int(d) for d in s) for s in shapes))

    def nbytes(self) -> int:
        return nbytes(tuple(self.fields))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PECacheKey):
            return NotImplemented
        return self.name == other.name and self.same_fields(other)

    def same_fields(self, other: PECacheKey) -> bool:
        """Equal fields, whatever the names (two PE inputs that would build the same tensors)."""
        return self.fields == other.fields

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PECacheKey({self.name!r}, {len(self.fields)} fields)"


# ---- the cache -----------------------------------------------------------------------------

def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


_SCALARS = (type(None), bool, int, float, str)


def _storable(value: Any) -> Any:
    """The value with every inference tensor replaced by a normal (version-counted) copy. Python
    scalars (immutable) are stored as they are, so a builder's host-side results (a flag, lengths)
    need no tensor a caller would read back."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        if value.is_inference():
            with torch.inference_mode(False), torch.no_grad():
                return value.clone()
        return value
    if isinstance(value, tuple):
        return tuple(_storable(v) for v in value)
    if isinstance(value, list):
        return [_storable(v) for v in value]
    raise TypeError(f"the PE cache stores tensors, Python scalars and tuples of them, not {type(value).__name__}")


def _storage_bytes(tensors) -> dict[str, int]:
    seen: set[tuple[str, int]] = set()
    by_tier: dict[str, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ident = (str(t.device), storage.data_ptr())
        if ident in seen:
            continue
        seen.add(ident)
        tier = "cpu" if t.device.type == "cpu" else "device"
        by_tier[tier] = by_tier.get(tier, 0) + storage.nbytes()
    return by_tier


class _Entry:
    __slots__ = ("key", "value", "versions", "build_s", "tensors", "bytes")

    def __init__(self, key: PECacheKey, value: Any, build_s: float):
        self.key = key
        self.value = value
        values = _tensors(value)
        self.versions = [(t, t._version) for t in values]
        self.build_s = build_s
        self.tensors = values
        self.bytes = _storage_bytes(values)
        self.bytes["cpu"] = self.bytes.get("cpu", 0) + key.nbytes()

    def intact(self) -> bool:
        for t, v in self.versions:
            if t._version != v:
                return False
        return True


DROPPED = "pe:models since dropped"  # the stats of every closed model cache, summed (under --cache-none: each prompt's)


class PECache:
    """The last key and tensors per PE name, for one model. Thread-safe.

    ``stats_name``: register a stats handle (kind ``pe``) under this unique name; ``close()``
    (or the owner going away, see :func:`cache_for`) unregisters it. Without one the counts go to a
    handle of its own, seen by no panel (the bypass reasons are read from it all the same).
    """

    def __init__(self, stats_name: str | None = None, description: str = ""):
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # taken before _lock, never under it
        self._entries: dict[str, _Entry] = {}
        self._per_name: dict[str, dict[str, int]] = {}
        self._shared = bool(stats_name)  # in the registry the panel reads; close() folds it away
        registry = REGISTRY if self._shared else StatsRegistry()
        self.stats = registry.register(stats_name or "pe", "pe", description, clear=self.clear)

    # -- lookup --

    def get_or_create(self, key: PECacheKey, build: Callable[[], Any]) -> Any:
        """The stored value when ``key`` matches that name's entry, else ``build()``, stored.

        On a miss the returned value is the stored one (inference tensors are copied once into
        normal tensors), so a miss and the following hits return the same objects."""
        with self._lock:
            entry = self._entries.get(key.name)
        if entry is not None and entry.key == key:
            if entry.intact():
                self._count(key.name, "hits", saved=entry.build_s)
                return entry.value
            self._count(key.name, "mutated")
            stats = self.stats
            if stats is not None:
                stats.count_reason("fallback", "a stored table was changed in place since it was stored: built again")
        shared = self._find_equal(key)
        if shared is not None:  # another name holds these very tensors (e.g. cond and uncond run apart)
            new = _Entry(key, shared.value, shared.build_s)
        else:
            t0 = time.perf_counter()
            value = _storable(build())
            new = _Entry(key, value, time.perf_counter() - t0)
        with self._lock:
            replaced = key.name in self._entries
            self._entries[key.name] = new  # the old entry is dropped, never written
        if shared is not None:
            self._count(key.name, "shared", saved=shared.build_s)
        else:
            self._count(key.name, "misses")
        if replaced:
            self._count(key.name, "replacements")
        self.publish()
        return new.value

    def _find_equal(self, key: PECacheKey) -> _Entry | None:
        if key.group is None:
            return None
        with self._lock:
            others = [e for name, e in self._entries.items() if name != key.name]
        for e in others:
            if e.key.group == key.group and e.key.same_fields(key) and e.intact():
                return e
        return None

    def bypass(self, name: str, reason: str = "unspecified") -> None:
        """Count a call that could not use the cache (the builder ran unchanged) and why; the
        reasons are in the stats' ``reasons``."""
        stats = self.stats
        if stats is not None:
            stats.count_reason("bypass", reason)
        self._count(name, "bypasses")

    def bypass_reasons(self) -> dict[str, int]:
        """Why calls ran uncached since the counts were reset: reason -> calls, read from the stats' rows
        (empty once closed)."""
        stats = self.stats
        return {} if stats is None else {r["reason"]: r["count"] for r in stats.reasons() if r["event"] == "bypass"}

    # -- state --

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def entry(self, name: str) -> tuple[PECacheKey, Any] | None:
        with self._lock:
            e = self._entries.get(name)
        return None if e is None else (e.key, e.value)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per tier; storage shared by several names counts once."""
        with self._lock:
            entries = list(self._entries.values())
        by_tier = _storage_bytes(t for e in entries for t in e.tensors)
        keys = sum(e.key.nbytes() for e in entries)
        if keys:
            by_tier["cpu"] = by_tier.get("cpu", 0) + keys
        return by_tier

    def name_stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            out = {name: dict(c) for name, c in self._per_name.items()}
            for name, e in self._entries.items():
                out.setdefault(name, {})["bytes"] = sum(e.bytes.values())
        return out

    def clear(self) -> None:
        """Drop every entry (tensors still referenced by a running step stay valid)."""
        with self._lock:
            self._entries.clear()
        self.publish()

    def close(self) -> None:
        """Drop the entries and the stats handle; what it counted and saved goes on in :data:`DROPPED`."""
        self.clear()
        stats, self.stats = self.stats, None
        if stats is None or not self._shared:
            return
        counted = stats.snapshot()
        dropped = REGISTRY.register(DROPPED, "pe", "What the PE caches of models ComfyUI has since dropped "
                                                   "counted and saved (each model's own card goes with it).")
        for counter, n in counted["counters"].items():
            dropped.incr(counter, n)
        for row in counted["reasons"]:
            dropped.count_reason(row["event"], row["reason"], row["count"], row["source"])
        dropped.add_time_saved(counted["time_saved_s"])
        REGISTRY.unregister(stats.name)

    # -- stats --

    def _count(self, name: str, counter: str, saved: float = 0.0) -> None:
        with self._lock:
            per = self._per_name.setdefault(name, {})
            per[counter] = per.get(counter, 0) + 1
        stats = self.stats
        if stats is not None:
            stats.incr(counter)
            if saved:
                stats.add_time_saved(saved)
            if counter != "hits":  # a hit changes no entry: its per-name count goes out with the next
                with self._publishing:  # change and at the end of each run (publish)
                    stats.set_info("names", self.name_stats())

    def publish(self) -> None:
        """Put the memory held, the entries and the per-name counters into the stats."""
        stats = self.stats
        if stats is None:
            return
        with self._publishing:  # one at a time, so an older reading is never written over a newer one
            by_tier = self.nbytes()
            for tier in ("cpu", "device"):
                stats.set_memory(tier, by_tier.get(tier, 0))
            stats.set_entries(len(self.names()))
            stats.set_info("names", self.name_stats())


# ---- one cache per model -------------------------------------------------------------------

_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()
_serial = 0
_orphaned: deque[PECache] = deque()  # caches whose owner died (appended by the owner's finalizer)


def close_orphaned() -> None:
    """Close the caches whose owner died (at the next cache_for, before every stats snapshot and before
    ComfyUI loads a model: patches/rope.py)."""
    while _orphaned:
        try:
            cache = _orphaned.popleft()
        except IndexError:
            break
        cache.close()


def cache_for(owner: Any, label: str | None = None, create: bool = True) -> PECache | None:
    """The PE cache owned by ``owner`` (a model object), created on first use when ``create``.

    It is registered in the stats registry as ``pe:<label>#<n>`` and closed (entries dropped, stats
    unregistered) after the owner is garbage-collected, at the next call or stats snapshot."""
    global _serial
    close_orphaned()
    with _CACHES_LOCK:
        cache = _CACHES.get(owner)
        if cache is not None or not create:
            return cache
        _serial += 1
        label = label or type(owner).__name__
        cache = PECache(f"pe:{label}#{_serial}",
                        f"rotary position embeddings of a {label} model, one entry per PE input")
        _CACHES[owner] = cache
        # The finalizer may run inside the garbage collector, on any thread, with any lock held (this
        # cache's, the stats'): it only records (docs/development.md, "Rules for contributors").
        weakref.finalize(owner, _orphaned.append, cache)
        return cache


REGISTRY.add_settler(close_orphaned)
