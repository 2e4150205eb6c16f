"""The conditioning cache: one shared, bounded LRU of encoder outputs (text, vision, VAE encode).

Pure logic (torch + stdlib). ``patches/conditioning.py`` builds keys from what an encoder actually
sees and routes ComfyUI's encode calls through :meth:`ConditioningCache.fetch`.

Exactness rules kept here:

- A :class:`Key` holds complete, typed fields (``caching/keys.py``: token ids and weights, shapes,
  dtypes, options; pixels by a digest of their bytes) and identity tokens for the encoder instance
  and its weight patches. Equality compares every field; the hash only picks the bucket. No data
  pointer or file path decides a hit.
- Encoder instances are named by a serial number that is never reused (``identity``), so a freed
  encoder's address cannot alias a new one; when the encoder dies its entries are dropped.
- Weight patches (LoRA...) are interned into :class:`WeightSet` objects: two patch sets with equal
  structure, strengths and tensor contents (their full fingerprints) become the same object, so a new
  ``LoraLoader`` clone with the same LoRA and strength hits. An entry pins its weight set; its
  bytes count once against the budget while any entry uses it. Sets are matched by those fingerprints,
  never by the tensor objects: a node that edits a loaded LoRA's tensors in place makes another set
  (``patches/conditioning.py`` decides when a patcher's set is taken again: what ComfyUI computes with).
- Stored values are private CPU copies (whatever device the encoder returned them on); every hit
  returns a fresh copy (containers and tensors, on the device they came from) of the same types (a ``torch.Size`` stays one; other subclasses of built-in containers are not
  stored), so no caller can change a stored entry.
- Bytes (values + key contents + pinned weights, which stay where their patcher keeps them: the
  ``device`` tier; a tensor counts once, however many weight sets hold it) and entries are bounded; an entry larger than the
  budget is not admitted; a budget or entry capacity of 0 disables the cache.
- Behind the LRU, the shared tiers (``caching/tiers.py``: disk, then Redis) are asked on a miss with
  a key that means the same in every process; a shared hit is promoted into the LRU, a computed
  result is written through to them. Their failures are misses, never a failed encode.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .keys import Uncacheable, encode, nbytes
from .settings import SETTINGS
from .stats import REGISTRY, StatsRegistry, clip_reason
from .tiers import TIERS, SharedKey
from .weight_edits import MODES, SETTING, fingerprints, legacy_mode

log = logging.getLogger("reusekit")

KINDS = ("text", "vision", "vae")
MIB = 1 << 20
ENV_SWITCH = "REUSEKIT_CONDITIONING"


# ---- identity: serial numbers that are never reused -----------------------------------------
# A weakref callback may run inside the garbage collector, on any thread, while any lock is held
# (this module's included): it only records the death (deque appends are atomic); the serial table
# is pruned and the cache's entries dropped at the next call (``_prune``, ``ConditioningCache.reap``).

_serial_lock = threading.Lock()
_serials: dict[int, tuple[weakref.ref, int]] = {}
_next_serial = [0]
_buried: deque[tuple[int, int]] = deque()  # (id, serial) of dead objects, pruned under the lock later
_death_listeners: list[Callable[[int], None]] = []  # record-only (they run inside the collector)


def _died(oid: int, serial: int) -> None:
    """Inside the collector: records only (no lock, no stats, no ComfyUI)."""
    _buried.append((oid, serial))
    for fn in _death_listeners:
        fn(serial)


def _prune() -> None:
    """Forget the serials of dead objects (under ``_serial_lock``): an id reused by a new object
    keeps the new object's serial."""
    while _buried:
        try:
            oid, serial = _buried.popleft()
        except IndexError:
            break
        current = _serials.get(oid)
        if current is not None and current[1] == serial:
            del _serials[oid]


def identity(obj: Any) -> int:
    """A serial number for ``obj``, stable while it lives and never given to another object."""
    with _serial_lock:
        _prune()
        found = _serials.get(id(obj))
        if found is not None and found[0]() is obj:
            return found[1]
        _next_serial[0] += 1
        serial = _next_serial[0]
        oid = id(obj)
        _serials[oid] = (weakref.ref(obj, lambda _ref, oid=oid, serial=serial: _died(oid, serial)), serial)
        return serial


def known_identity(obj: Any) -> int | None:
    """The serial of ``obj`` if it has one (never creates one)."""
    with _serial_lock:
        found = _serials.get(id(obj))
        return found[1] if found is not None and found[0]() is obj else None


# ---- keys -------------------------------------------------------------------------------------

class LocalOnly(Exception):
    """An encode whose encoder has no shared identity (the reason): its result stays in this process."""


class WeightSet:
    """An interned set of weight patches; equal contents share one object (compared by identity).
    ``prints``: each tensor's full fingerprint when the set was made, what the set means."""

    __slots__ = ("skeleton", "tensors", "prints", "memory", "__weakref__")

    def __init__(self, skeleton: tuple, tensors: list[torch.Tensor], prints: tuple[int, ...]):
        self.skeleton = skeleton
        self.tensors = tensors
        self.prints = prints
        self.memory = {_where(t): (t.numel() * t.element_size(), "cpu" if t.device.type == "cpu" else "device")
                       for t in tensors}
        """The memory its tensors hold, ``{where: (bytes, tier)}``: a LoRA at two strengths makes two sets of the
        same tensors, whose bytes the cache counts once."""

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (a patcher's, in the set's order) are, every byte, what the set was made of."""
        return (len(tensors) == len(self.tensors)
                and all(t.dtype == s.dtype and t.shape == s.shape for t, s in zip(tensors, self.tensors, strict=True))
                and tuple(fingerprints(tensors)) == self.prints)


def _where(t: torch.Tensor) -> tuple:
    """Where a tensor's bytes are: the same for the same tensor in two weight sets."""
    return str(t.device), t.data_ptr(), t.numel() * t.element_size()


_weights_lock = threading.Lock()
_weight_sets: dict[tuple, weakref.ref] = {}


def intern_weights(structure: Any) -> tuple[WeightSet | None, list[torch.Tensor], tuple[int, ...]]:
    """The one :class:`WeightSet` for a patch structure (primitives and tensors), or None if empty; the
    structure's tensors in the set's order and their full fingerprints.

    The tensors are fingerprinted in full (one pass over them: once per patcher, not per encode): a live
    set made of the same skeleton (strengths, dtypes, shapes) and contents is returned, whichever tensor
    objects it was made of, and whatever they hold now; else a new set is registered.
    """
    if not structure:
        return None, [], ()
    tensors: list[torch.Tensor] = []

    def skel(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return ("T", str(v.dtype), tuple(v.shape), str(v.device))
        if isinstance(v, (list, tuple)):
            return ("L", tuple(skel(x) for x in v))
        if isinstance(v, dict):  # sorted before the walk: the tensors are collected in the skeleton's order
            items = sorted(((encode(k), x) for k, x in v.items()), key=lambda kv: repr(kv[0]))
            return ("D", tuple((k, skel(x)) for k, x in items))
        return encode(v)

    skeleton = skel(structure)
    prints = tuple(fingerprints(tensors))
    bucket = (skeleton, prints)
    with _weights_lock:
        found = _weight_sets.get(bucket)
        made = None if found is None else found()
        if made is None:
            made = WeightSet(skeleton, tensors, prints)
            _weight_sets[bucket] = weakref.ref(made)
            if len(_weight_sets) > 256:  # forget the sets that died
                for b in [b for b, r in _weight_sets.items() if r() is None]:
                    del _weight_sets[b]
        return made, tensors, prints


class Key:
    """A complete cache key. ``owners``: serials of the encoder instances it depends on."""

    __slots__ = ("kind", "fields", "owners", "weights", "_nbytes", "_hash")

    def __init__(self, kind: str, fields: tuple, owners: tuple[int, ...] = (),
                 weights: tuple[WeightSet, ...] = ()):
        if kind not in KINDS:
            raise ValueError(f"unknown conditioning kind {kind!r}")
        self.kind = kind
        self.fields = fields
        self.owners = tuple(owners)
        self.weights = tuple(w for w in weights if w is not None)
        self._nbytes = None
        self._hash = hash((kind, fields, self.owners, tuple(id(w) for w in self.weights)))

    @property
    def nbytes(self) -> int:
        """Approximate memory of the fields (computed when first stored, not on every lookup)."""
        if self._nbytes is None:
            self._nbytes = nbytes(self.fields)
        return self._nbytes

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Key):
            return NotImplemented
        return (self._hash == other._hash and self.kind == other.kind and self.owners == other.owners
                and len(self.weights) == len(other.weights)
                and all(a is b for a, b in zip(self.weights, other.weights, strict=True))
                and self.fields == other.fields)


# ---- stored values: private copies ------------------------------------------------------------

_CONTAINERS: dict[type, str] = {}


def register_container(cls: type) -> None:
    """Allow an attribute-bag output class (e.g. CLIP vision's ``Output``) in stored values."""
    _CONTAINERS[cls] = cls.__qualname__


def freeze(value: Any) -> tuple[Any, int]:
    """A private CPU copy of ``value`` and its tensor bytes; tensors remember the device they came
    from. Raises Uncacheable for other types (subclasses of list and tuple included: a copy would
    lose their type)."""
    held = [0]

    def go(v):
        if isinstance(v, torch.Tensor):
            if v.requires_grad:
                raise Uncacheable("tensor requires grad")
            stored = v.detach().to("cpu", copy=True)
            held[0] += stored.numel() * stored.element_size()
            return ("T", stored, v.device)
        if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
            return ("V", v)  # immutable: stored and returned as the very object, type and all
        if type(v) is list:
            return ("L", [go(x) for x in v])
        if type(v) is tuple:
            return ("U", tuple(go(x) for x in v))
        if type(v) is dict:
            return ("D", [(k, go(x)) for k, x in v.items()])
        if type(v) in _CONTAINERS:
            return ("C", type(v), [(k, go(x)) for k, x in vars(v).items()])
        raise Uncacheable(f"cannot store a {type(v).__name__}")

    stored = go(value)
    return stored, held[0]


def _copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor with a stored tensor's values on ``device``. To the CPU: one memcpy on this thread.
    (torch's copy of a tensor over 32K elements runs on its intra-op pool, whose idle threads then spin
    for milliseconds: a 1x77x768 hit would keep a core busy long after its 20 microsecond copy.)"""
    if device.type != "cpu" or type(t) is not torch.Tensor or not t.is_contiguous():
        return t.to(device, copy=True)
    out = torch.empty(t.shape, dtype=t.dtype)
    np.copyto(out.reshape(-1).view(torch.uint8).numpy(), t.reshape(-1).view(torch.uint8).numpy())
    return out


def thaw(stored: Any) -> Any:
    """A fresh copy of a stored value: new containers, new tensors on the devices they came from."""
    tag = stored[0]
    if tag == "T":
        return _copy(stored[1], stored[2])
    if tag == "V":
        return stored[1]
    if tag == "L":
        return [thaw(x) for x in stored[1]]
    if tag == "U":
        return tuple(thaw(x) for x in stored[1])
    if tag == "D":
        return {k: thaw(x) for k, x in stored[1]}
    obj = stored[1].__new__(stored[1])
    for k, x in stored[2]:
        setattr(obj, k, thaw(x))
    return obj


# ---- the LRU ----------------------------------------------------------------------------------

class Entry:
    __slots__ = ("key", "stored", "own_bytes", "seconds", "hits")

    def __init__(self, key: Key, stored: Any, value_bytes: int, seconds: float):
        self.key = key
        self.stored = stored
        self.own_bytes = value_bytes + key.nbytes  # on the CPU
        self.seconds = seconds
        self.hits = 0


_MISS = object()


class ConditioningCache:
    """A thread-safe LRU of CPU copies bounded by bytes (its entries and the weight patches they pin)
    and by entries. Its bypass reasons live in its stats handle (``stats``; a cache made without one keeps a
    handle of its own, outside the registry)."""

    def __init__(self, budget_bytes: int = 512 * MIB, max_entries: int = 128, stats=None):
        self._lock = threading.RLock()
        self._publishing = threading.Lock()  # around the stats' writes alone (only their locks inside)
        self._readings = self._written = 0  # the figures read for the stats, and the newest of them written
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self._pinned: dict[int, list] = {}  # id(WeightSet) -> [weight set, refcount]
        self._held: dict[tuple, list] = {}  # a pinned tensor's where -> [pinned sets holding it, bytes, tier, kind]
        self._bytes = {"cpu": 0, "device": 0}
        self._kind_bytes = dict.fromkeys(KINDS, 0)
        self.budget_bytes = int(budget_bytes)
        self.max_entries = int(max_entries)
        self.stats = stats if stats is not None else StatsRegistry().register("conditioning", "conditioning")
        self._counts: dict[str, int] = {}
        self._dead: deque[int] = deque()  # serials of dead encoders, dropped at the next call
        self._clears = 0  # clear() calls so far: what was computed before one is never kept after it

    def owner_died(self, serial: int) -> None:
        """Called from a weakref callback (maybe inside GC, maybe under our lock): only queue."""
        self._dead.append(serial)

    def reap(self) -> None:
        """Drop the entries of encoders that died since the last call."""
        while self._dead:
            try:
                serial = self._dead.popleft()
            except IndexError:
                break
            self.drop_owner(serial)

    # -- configuration and state
    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 and self.max_entries > 0

    def configure(self, budget_bytes: int | None = None, max_entries: int | None = None) -> None:
        with self._lock:
            was = self.enabled
            if budget_bytes is not None:
                self.budget_bytes = int(budget_bytes)
            if max_entries is not None:
                self.max_entries = int(max_entries)
            if was and not self.enabled:  # as a clear: what an encode began before is neither kept nor shared,
                self._clears += 1         # even where a limit is set back before it ends
            self._shrink(0, 0)
        self._publish()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes["cpu"] + self._bytes["device"]

    def bytes_by_tier(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def keys(self) -> list[Key]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def count(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    # -- the one entry point for encoders
    def fetch(self, key: Key, compute: Callable[[], Any], *, check_rng: bool = False, admit: Callable[[], str | None] | None = None,
              shared: Callable[[], SharedKey] | None = None, encoder: str = "",
              vouch: Callable[[Callable[[], None], Callable[..., None]], None] | None = None) -> Any:
        """The cached result for ``key`` (a private copy), or ``compute()`` stored on a miss.

        ``check_rng``: when the computation moves torch's global random state, its result depends
        on randomness and is not stored (the randomness then runs on every request).
        ``admit``: asked after a miss's computation; a returned reason means "do not store".
        ``shared``: the key for the shared tiers (raising :class:`LocalOnly` with the reason when this
        encode cannot use them), asked on a miss: a shared hit is promoted into this LRU; a computed result
        is written through to them, when ``vouch`` (given the write and what to do instead) lets it.
        ``encoder``: the encoder's class name, beside the reason of a bypass."""
        if not self.enabled:
            return compute()
        self.reap()
        since = self._clears  # (an int read: atomic; before the lookup, so a clear after it is never missed)
        found = self.lookup(key)
        if found is not _MISS:
            return found
        skey = self._shared_key(shared, key.kind, encoder)
        if skey is not None:
            got = self._shared_get(skey, key.kind, encoder)
            if got is not None:
                stored, seconds = got
                self._admit(Entry(key, stored, _held_bytes(stored), seconds), since, encoder,
                            during="its result was read from the shared tiers")
                return thaw(stored)
        rng = _rng_state() if check_rng else None
        start = time.perf_counter()
        result = compute()
        seconds = time.perf_counter() - start
        with self._lock:
            self._count("encodes", key.kind)
        if rng is not None and not _rng_equal(rng, _rng_state()):
            self.bypass(key.kind, "random", encoder)
            return result
        refused = admit() if admit is not None else None
        if refused:
            self.bypass(key.kind, refused, encoder)
            return result
        stored = self._store(key, result, seconds, encoder=encoder, since=since)
        if stored is not None and skey is not None:
            kind = key.kind

            def publish() -> None:
                with self._lock:  # (on the publishing thread, maybe seconds later: the panel may have acted)
                    gone = self._clears != since or not self.enabled
                if gone:
                    self.kept_local(kind, "the cache was cleared, turned off or switched to another weight check "
                                    "before its shared write", encoder)
                    return
                try:
                    taken = TIERS.put(skey, stored, seconds, _CONTAINERS)
                except Exception as exc:  # a shared tier never fails an encode: counted, the result kept here
                    self.kept_local(kind, f"the shared write failed: {type(exc).__name__}: {exc}", encoder)
                    return
                if not taken:
                    self.kept_local(kind, "no shared tier took its entry (its size, a failed disk write, a Redis "
                                    "write dropped: the tiers' rows say which)", encoder)
                    return
                with self._lock:
                    self._count("published", kind)

            def drop(why: str = "its encoder's weights differed from their reference in full after the encode "
                                "(an edit the cheap check missed)") -> None:
                self.kept_local(kind, why, encoder)

            try:
                publish() if vouch is None else vouch(publish, drop)
            except Exception as exc:  # (publish counts its own failures) a check that could not start
                drop(f"its publication check could not start: {type(exc).__name__}: {exc}")
        return result

    def lookup(self, key: Key) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._count("misses", key.kind)
                return _MISS
            self._entries.move_to_end(key)
            entry.hits += 1
            stored, seconds = entry.stored, entry.seconds
            self._count("hits", key.kind)
        value = thaw(stored)  # outside the lock: copies may be large; stored tensors are never mutated
        self.stats.add_time_saved(seconds)
        self._publish()
        return value

    def store(self, key: Key, value: Any, seconds: float) -> bool:
        """Store a private copy of ``value``; False when not admitted (oversized or uncacheable)."""
        return self._store(key, value, seconds, admitted_only=True) is not None

    def _store(self, key: Key, value: Any, seconds: float, admitted_only: bool = False, encoder: str = "",
               since: int | None = None) -> Any:
        """Freeze ``value`` and admit it; the frozen copy (None when uncacheable, computed before a clear after
        ``since``, or not admitted with ``admitted_only``)."""
        try:
            stored, value_bytes = freeze(value)
        except Uncacheable as exc:
            self.bypass(key.kind, str(exc), encoder)
            return None
        except (RuntimeError, MemoryError) as exc:  # no room for the copy: the caller keeps its result
            self.bypass(key.kind, f"copy failed: {exc}", encoder)
            return None
        admitted = self._admit(Entry(key, stored, value_bytes, seconds), since, encoder)
        return stored if admitted or (admitted is False and not admitted_only) else None

    def _admit(self, entry: Entry, since: int | None = None, encoder: str = "",
               during: str = "this encode ran") -> bool | None:
        """Whether ``entry`` is kept; None where the cache was cleared after ``since`` (its clear count when the
        entry's computation, or its read from the shared tiers, began: ``during`` says which) or turned off
        (its budget or entries set to 0) meanwhile: neither kept nor shared, counted."""
        key = entry.key
        with self._lock:
            if since is not None and not self.enabled:
                admitted, why = None, f"the cache's budget_mib or max_entries was set to 0 while {during}"
            elif since is not None and since != self._clears:
                admitted, why = None, (f"the cache was cleared (or set to a limit of 0, or its check_weight_edits mode "
                                       f"switched) while {during}")
            elif not self.enabled:  # (store(): nothing ran under the cache)
                return False
            else:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._remove(old)
                # its weight sets count whole, pinned by others or not: making room may evict those others
                need = entry.own_bytes + sum(n for n, _ in {k: v for w in key.weights for k, v in w.memory.items()}
                                             .values())
                budget = self.budget_bytes
                admitted = need <= budget
                if not admitted:
                    self._count("rejected", key.kind)
                else:
                    self._add(entry)  # counted, its weights pinned, first: evicting another user of them keeps them
                    self._shrink(0, 1)
                    self._entries[key] = entry
        if admitted is None:
            self.bypass(key.kind, f"{why}: its result is not kept", encoder)
            return None
        if not admitted:
            self.stats.count_reason("refused", f"an entry (with its weight sets) is larger than the whole budget "
                                    f"({budget / MIB:.1f} MiB): not kept; raise the budget",
                                    source=key.kind)
        self._publish()
        return admitted

    def bypass(self, kind: str, reason: str, encoder: str = "") -> None:
        """An encode that ran uncached, counted by kind and by (kind, encoder class, reason), here and in the
        stats' ``reasons`` (event ``bypass``, source kind and encoder class); the first of each reason is
        logged at info level, so a user whose cache never hits sees why."""
        self._reason("bypasses", "bypass", kind, reason, encoder, "run uncached")

    def kept_local(self, kind: str, reason: str, encoder: str = "") -> None:
        """A miss that the shared tiers (on) neither answered nor will receive, counted as a bypass is, its
        reason marked as theirs (event ``not shared``)."""
        self._reason("not_shared", "not shared", kind, reason, encoder, "not shared with other workers")

    def _reason(self, counter: str, event: str, kind: str, reason: str, encoder: str, what: str) -> None:
        with self._lock:
            self._count(counter, kind)
        if self.stats.count_reason(event, reason, source=f"{kind}, {encoder}" if encoder else kind):
            log.info("ReuseKit conditioning: %s encodes%s %s: %s", kind, f" of {encoder}" if encoder else "", what,
                     clip_reason(reason if event == "bypass" else f"{event}: {reason}"))
        self._publish()

    def _shared_key(self, shared: Callable[[], SharedKey] | None, kind: str, encoder: str) -> SharedKey | None:
        """The shared tiers' key of an encode, or None: tiers off, or the encoder has no shared identity
        (counted with its reason)."""
        if shared is None or not TIERS.active:
            return None
        try:
            return shared()
        except LocalOnly as exc:
            self.kept_local(kind, str(exc), encoder)
        except Exception as exc:  # a key the shared tiers cannot build: this encode stays in the process
            self.kept_local(kind, f"no shared key: {type(exc).__name__}: {exc}", encoder)
        return None

    def _shared_get(self, key: SharedKey, kind: str, encoder: str) -> tuple[Any, float] | None:
        """A shared tiers' entry (frozen value, compute seconds), or None; a failure the tiers did not count
        themselves is a miss counted here with its reason."""
        try:
            return TIERS.get(key, {name: cls for cls, name in _CONTAINERS.items()}, key.local)
        except Exception as exc:  # a shared tier never fails an encode
            self.kept_local(kind, f"the shared read failed: {type(exc).__name__}: {exc}", encoder)
            return None

    def bypass_reasons(self) -> list[dict]:
        """Every bypass and not-shared reason seen since the counts were reset, most frequent first, read from
        the stats' rows: ``{"kind", "encoder", "reason", "count"}``, a not-shared one's reason so marked."""
        rows = []
        for row in self.stats.reasons():
            if row["event"] in ("bypass", "not shared"):
                kind, _, encoder = row["source"].partition(", ")
                reason = row["reason"] if row["event"] == "bypass" else f"{row['event']}: {row['reason']}"
                rows.append({"kind": kind, "encoder": encoder, "reason": reason, "count": row["count"]})
        return rows

    # -- dropping
    def clear(self) -> None:
        with self._lock:
            self._clears += 1
            for entry in list(self._entries.values()):
                self._remove(entry)
            self._entries.clear()
        self._publish()

    def drop_owner(self, serial: int) -> int:
        """Drop the entries of a dead encoder or one whose weights changed."""
        with self._lock:
            doomed = [e for e in self._entries.values()
                      if serial in e.key.owners]
            for e in doomed:
                del self._entries[e.key]
                self._remove(e)
        if doomed:
            self._publish()
        return len(doomed)

    # -- internals (under the lock)
    def _count(self, event: str, kind: str) -> None:
        for name in (event, f"{event}.{kind}"):
            self._counts[name] = self._counts.get(name, 0) + 1
        self.stats.incr(event)

    def _shrink(self, extra_bytes: int, extra_entries: int) -> None:
        while self._entries and (len(self._entries) + extra_entries > self.max_entries
                                 or self._bytes["cpu"] + self._bytes["device"] + extra_bytes > self.budget_bytes):
            _, victim = self._entries.popitem(last=False)
            self._remove(victim)
            self._count("evictions", victim.key.kind)

    def _add(self, entry: Entry) -> None:
        self._bytes["cpu"] += entry.own_bytes
        self._kind_bytes[entry.key.kind] += entry.own_bytes
        for w in entry.key.weights:
            pin = self._pinned.get(id(w))
            if pin is not None:
                pin[1] += 1
                continue
            self._pinned[id(w)] = [w, 1]
            for where, (size, tier) in w.memory.items():
                held = self._held.get(where)
                if held is not None:
                    held[0] += 1
                    continue
                self._held[where] = [1, size, tier, entry.key.kind]
                self._bytes[tier] += size
                self._kind_bytes[entry.key.kind] += size

    def _remove(self, entry: Entry) -> None:
        self._bytes["cpu"] -= entry.own_bytes
        self._kind_bytes[entry.key.kind] -= entry.own_bytes
        for w in entry.key.weights:
            pin = self._pinned[id(w)]
            pin[1] -= 1
            if pin[1]:
                continue
            del self._pinned[id(w)]
            for where in w.memory:
                held = self._held[where]
                held[0] -= 1
                if not held[0]:
                    del self._held[where]
                    _, size, tier, kind = held
                    self._bytes[tier] -= size
                    self._kind_bytes[kind] -= size

    def _publish(self) -> None:
        with self._lock:
            self._readings += 1
            reading = self._readings
            tiers = dict(self._bytes)
            n = len(self._entries)
            by_kind = {k: {"entries": 0, "bytes": self._kind_bytes[k],
                           "hits": self._counts.get(f"hits.{k}", 0),
                           "misses": self._counts.get(f"misses.{k}", 0)} for k in KINDS}
            for e in self._entries.values():
                by_kind[e.key.kind]["entries"] += 1
            budget, max_entries = self.budget_bytes, self.max_entries
        with self._publishing:  # a reading older than one written is dropped, never written over it
            if reading < self._written:
                return
            self._written = reading
            for tier, held in tiers.items():
                self.stats.set_memory(tier, held, budget)
            self.stats.set_entries(n)
            self.stats.set_info("by_kind", by_kind)
            self.stats.set_info("limits", {"budget_bytes": budget, "max_entries": max_entries})

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
        self.stats.reset_counters()
        self._publish()


def _held_bytes(stored: Any) -> int:
    """Tensor bytes of a frozen value."""
    tag = stored[0]
    if tag == "T":
        return stored[1].numel() * stored[1].element_size()
    if tag in ("L", "U"):
        return sum(_held_bytes(x) for x in stored[1])
    if tag == "D":
        return sum(_held_bytes(x) for _, x in stored[1])
    if tag == "C":
        return sum(_held_bytes(x) for _, x in stored[2])
    return 0


def _rng_state() -> tuple:
    """The global generators' states: the CPU's and each accelerator's in use (CUDA and XPU once initialised,
    Apple's MPS): a sampling encode on a Mac draws from the MPS generator alone."""
    states = [torch.get_rng_state()]
    for kind in ("cuda", "xpu"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available() and backend.is_initialized():
            states.extend(backend.get_rng_state_all())
    if torch.backends.mps.is_available():
        states.append(torch.mps.get_rng_state())
    return tuple(states)


def _rng_equal(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---- the process-wide cache, its settings and stats -------------------------------------------

def _env_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


CACHE = ConditioningCache()
CACHE.stats = REGISTRY.register(
    "conditioning", "conditioning",
    "Text-encoder, CLIP-vision and VAE-encode outputs keyed by what the encoder sees (exact).",
    clear=CACHE.clear)
_death_listeners.append(CACHE.owner_died)
REGISTRY.add_settler(CACHE.reap)  # a snapshot never shows a dead encoder's entries

SETTINGS.define("conditioning.enabled", bool, _env_enabled(),
                "Global mode: every text, CLIP-vision and VAE encode goes through the conditioning "
                f"cache (the Cached nodes work either way). Environment: {ENV_SWITCH}=0 turns it off.")
SETTINGS.define("conditioning.budget_mib", int, 512,
                "Bytes the conditioning cache may hold (0 disables it): its CPU copies and the weight patches they pin.",
                minimum=0, maximum=1 << 20, on_change=lambda v: CACHE.configure(budget_bytes=v * MIB))
SETTINGS.define("conditioning.max_entries", int, 128,
                "Entries the conditioning cache may hold (0 disables it).",
                minimum=0, maximum=1 << 20, on_change=lambda v: CACHE.configure(max_entries=v))
SETTINGS.define(SETTING, str, "events",
                "How in-place edits of an encoder's weights are seen. events: a full fingerprint when the weights "
                "load, when ComfyUI applies or removes weight patches (at most once per node run), and per encode "
                "a cheap check (small tensors whole, sampled values of large ones, the embedding rows the prompt "
                "reads) whose cost does not grow with the weights. every_encode: a full fingerprint on every "
                "encode (for nodes that edit a few values of a large weight in place). off: no check, and the "
                "disk and Redis tiers neither read nor write. Switching it empties the cache.",
                choices=MODES, legacy=legacy_mode, on_change=lambda _: CACHE.clear())
CACHE.configure(SETTINGS.get("conditioning.budget_mib") * MIB, SETTINGS.get("conditioning.max_entries"))
