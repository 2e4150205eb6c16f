"""The stats registry every ReuseKit cache reports to.

Each cache gets its :class:`CacheStats` handle from ``REGISTRY.register(name, kind, description,
clear=...)`` under a unique name and a kind (``conditioning``, ``pe``, ``step``, ``graph``...);
the call is idempotent by name, so a cache calls it wherever it needs the handle. Through it the cache counts events (hits,
misses, evictions...), reports the bytes it holds per memory tier (``cpu``, ``device``...) with an
optional budget, adds time saved, and publishes small JSON-ready facts (the last run's summary).
:meth:`StatsRegistry.snapshot` returns one consistent, JSON-ready picture of every cache.

Why a cache did not serve a call as it usually does (it bypassed itself, refused a model or a value, fell
back to a slower way, or was disabled for a run) is counted by :meth:`CacheStats.count_reason` in one
form for every cache: the snapshot's ``reasons``, rows ``{"event", "reason", "source", "count"}``, most
frequent first. A cache that is off says so, with the one line that turns it on
(:meth:`CacheStats.set_off`, the snapshot's ``off``).

Listeners (the web panel's push) are told after each change; they must be cheap and must not
call back into the handle that notified them.

Code run by the garbage collector (a weakref callback, ``weakref.finalize``, ``__del__``, a GC callback)
never calls into the stats: the collector may run it on any thread while one of these locks is held,
by that very thread (docs/development.md, "Rules for contributors"). It records what happened (a deque append) and
the cache does the work at its next call; :meth:`StatsRegistry.add_settler` also runs that work before
every snapshot, outside every lock, so no snapshot shows what a dead model held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

SCHEMA_VERSION = 1
STORAGE_TIERS = frozenset({"disk", "redis"})  # bytes held outside this process: never in the memory total
REASON_CHARS = 200  # a reason is kept to this length (an exception's message may be long)
MAX_REASONS = 64  # distinct (event, source, reason) kept per cache; the least frequent go under OTHER_REASON
OTHER_REASON = f"other reasons (more than {MAX_REASONS} kinds seen)"

log = logging.getLogger("reusekit")


def clip_reason(text: str) -> str:
    """A reason as the stats keep it: at most REASON_CHARS characters."""
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


class CacheStats:
    """One cache's counters, memory and facts. All methods are thread-safe."""

    def __init__(self, registry: StatsRegistry, name: str, kind: str, description: str,
                 clear: Callable[[], None] | None):
        self.name = name
        self.kind = kind
        self.description = description
        self._registry = registry
        self._clear = clear
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._budgets: dict[str, int] = {}
        self._entries = 0
        self._time_saved_s = 0.0
        self._info: dict[str, Any] = {}
        self._reasons: dict[tuple[str, str, str], int] = {}  # (event, source, reason) -> count
        self._took: dict[tuple[str, str, str], int] = {}  # a row that took another's place -> that row's rank then
        self._off: str | None = None

    def incr(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._counters[counter] = self._counters.get(counter, 0) + n
        self._registry._changed()

    def set_memory(self, tier: str, nbytes: int, budget: int | None = None) -> None:
        """Bytes held in ``tier`` now (and its budget, when the cache has one)."""
        with self._lock:
            self._bytes[tier] = int(nbytes)
            if budget is not None:
                self._budgets[tier] = int(budget)
        self._registry._changed()

    def set_entries(self, n: int) -> None:
        with self._lock:
            self._entries = int(n)
        self._registry._changed()

    def add_time_saved(self, seconds: float) -> None:
        with self._lock:
            self._time_saved_s += max(0.0, float(seconds))
        self._registry._changed()

    def set_info(self, key: str, value: Any) -> None:
        """A JSON-ready fact about the cache (a dict, list, str or number), e.g. the last run."""
        with self._lock:
            self._info[key] = value
        self._registry._changed()

    def update_info(self, key: str, change: Callable[[Any], Any]) -> None:
        """Replace the fact ``key`` by ``change(its value or None)``, with no other change in between (two
        samplers finishing at once both keep theirs). ``change`` only computes: it never calls the stats."""
        with self._lock:
            self._info[key] = change(self._info.get(key))
        self._registry._changed()

    def count_reason(self, event: str, reason: str, n: int = 1, source: str = "") -> bool:
        """Count ``n`` calls (runs, models...) the cache did not serve as it usually does, and why: ``event``
        says what it did instead (``bypass``: ran them uncached or eagerly; ``refused``: would not take a
        model or a value; ``fallback``: served them another way; ``disabled``: computed a whole run),
        ``source`` where it happened (a model family, a check's name) when the reason does not say.
        Past MAX_REASONS rows a new one takes the place of the lowest ranked (the oldest of those), whose
        count goes to its event's OTHER_REASON row, and ranks from that row's rank on (Space-Saving, Metwally et
        al. 2005: a newcomer ranked from 1 was always the next one out, so two late reasons coming in turns
        took each other's place and neither was ever named); a row shows the count since it came in. So a
        reason that becomes frequent late is still named.
        True when this row is new since the counts were reset and took no other's place (a cache logs a
        reason once by it: at most MAX_REASONS lines)."""
        reason = clip_reason(reason)
        with self._lock:
            slot = (event, source, reason)
            new = slot not in self._reasons
            named = [s for s in self._reasons if s[2] != OTHER_REASON] if new else ()
            if len(named) >= MAX_REASONS:
                def rank(s):
                    return self._reasons[s] + self._took.get(s, 0)
                least = min(named, key=rank)  # (the first of equals: the oldest)
                self._took[slot] = rank(least)
                self._took.pop(least, None)
                other = (least[0], "", OTHER_REASON)
                self._reasons[other] = self._reasons.get(other, 0) + self._reasons.pop(least)
                new = False
            self._reasons[slot] = self._reasons.get(slot, 0) + int(n)
        self._registry._changed()
        return new

    def reasons(self) -> list[dict[str, Any]]:
        """The reason rows ``{"event", "source", "reason", "count"}``, most frequent first (the snapshot's)."""
        with self._lock:
            rows = [{"event": e, "source": src, "reason": r, "count": n} for (e, src, r), n in self._reasons.items()]
        rows.sort(key=lambda row: (-row["count"], row["event"], row["source"], row["reason"]))
        return rows

    def set_off(self, how: str | None) -> None:
        """The cache is off (``how``: the one line that turns it on), or on again (None)."""
        with self._lock:
            if how == self._off:
                return  # unchanged: no push
            self._off = how
        self._registry._changed()

    def counter(self, name: str) -> int:
        with self._lock:
            return self._counters.get(name, 0)

    def reset_counters(self) -> None:
        with self._lock:
            self._counters.clear()
            self._reasons.clear()
            self._took.clear()
            self._time_saved_s = 0.0
        self._registry._changed()

    def clear(self) -> bool:
        """Ask the cache to drop what it holds; False when it cannot be cleared."""
        if self._clear is None:
            return False
        self._clear()
        return True

    def snapshot(self) -> dict[str, Any]:
        reasons = self.reasons()
        with self._lock:
            counters = dict(self._counters)
            hits, misses = counters.get("hits", 0), counters.get("misses", 0)
            return {
                "name": self.name,
                "kind": self.kind,
                "description": self.description,
                "clearable": self._clear is not None,
                "entries": self._entries,
                "counters": counters,
                "hit_rate": hits / (hits + misses) if hits + misses else None,
                "bytes": dict(self._bytes),
                "budgets": dict(self._budgets),
                "time_saved_s": self._time_saved_s,
                "info": dict(self._info),
                "reasons": reasons,
                "off": self._off,
            }


class StatsRegistry:
    """All caches of the process, by unique name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[str, CacheStats] = {}
        self._listeners: list[Callable[[], None]] = []
        self._settlers: list[Callable[[], None]] = []
        self._version = 0

    def register(self, name: str, kind: str, description: str = "",
                 clear: Callable[[], None] | None = None) -> CacheStats:
        """The handle of ``name``, registered on the first call. A later call with the same kind
        returns the same handle (counters kept; ``description`` and ``clear`` replaced where given),
        so every cache registers the same way wherever it needs its handle; another kind is a KeyError."""
        if not name or not kind:
            raise ValueError("a cache registers with a non-empty name and kind")
        with self._lock:
            stats = self._caches.get(name)
            if stats is not None and stats.kind != kind:
                raise KeyError(f"a cache named {name!r} is already registered as {stats.kind!r}, not {kind!r}")
            if stats is None:
                stats = self._caches[name] = CacheStats(self, name, kind, description, clear)
            elif (description or stats.description) == stats.description and clear in (None, stats._clear):
                return stats  # nothing changes: no push
            else:
                stats.description = description or stats.description
                stats._clear = clear if clear is not None else stats._clear
        self._changed()
        return stats

    def unregister(self, name: str) -> None:
        with self._lock:
            removed = self._caches.pop(name, None)
        if removed is not None:
            self._changed()

    def get(self, name: str) -> CacheStats | None:
        with self._lock:
            return self._caches.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._caches)

    def clear(self, name: str | None = None) -> list[str]:
        """Clear one cache by name, or every clearable cache; returns the names cleared."""
        with self._lock:
            if name is not None and name not in self._caches:
                raise KeyError(f"no cache named {name!r}")
            targets = [self._caches[name]] if name is not None else list(self._caches.values())
        return [s.name for s in targets if s.clear()]

    @property
    def version(self) -> int:
        """Grows on every change: a cheap way to tell whether a new snapshot is worth taking."""
        return self._version

    def add_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def add_settler(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at the start of every :meth:`snapshot`, outside every lock: a cache's work
        recorded inside the garbage collector (an owner died) is done there at the latest."""
        with self._lock:
            if fn not in self._settlers:
                self._settlers.append(fn)

    def _changed(self) -> None:
        with self._lock:
            self._version += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def snapshot(self) -> dict[str, Any]:
        """Every cache's state, plus totals per tier and kind; JSON-ready."""
        with self._lock:
            settlers = list(self._settlers)
        for fn in settlers:
            try:
                fn()
            except Exception:  # a cache's late work never breaks the picture of the others
                log.exception("ReuseKit stats: settling %r failed (ignored)", fn)
        with self._lock:
            caches = list(self._caches.values())
            version = self._version
        entries = [c.snapshot() for c in caches]
        bytes_by_tier: dict[str, int] = {}
        bytes_by_kind: dict[str, int] = {}
        for e in entries:
            for tier, n in e["bytes"].items():
                bytes_by_tier[tier] = bytes_by_tier.get(tier, 0) + n
                bytes_by_kind[e["kind"]] = bytes_by_kind.get(e["kind"], 0) + n
        return {
            "schema": SCHEMA_VERSION,
            "version": version,
            "time": time.time(),
            "caches": entries,
            "totals": {
                "bytes": sum(n for tier, n in bytes_by_tier.items() if tier not in STORAGE_TIERS),
                "bytes_by_tier": bytes_by_tier,
                "bytes_by_kind": bytes_by_kind,
                "time_saved_s": sum(e["time_saved_s"] for e in entries),
            },
        }


REGISTRY = StatsRegistry()
"""The process-wide registry: every cache of the pack reports here."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


TOP_REASONS = 3  # the reasons a cache's text shows (the snapshot keeps every one)


def format_reason(row: dict[str, Any]) -> str:
    """A reason row as "event (source): reason" (the panel writes it the same way)."""
    source = f" ({row['source']})" if row["source"] else ""
    return f"{row['event']}{source}: {row['reason']}"


def format_snapshot(snap: dict[str, Any]) -> str:
    """The snapshot as a few readable lines (the Cache Stats node shows this)."""
    totals = snap["totals"]
    lines = [f"ReuseKit: {len(snap['caches'])} caches, {format_bytes(totals['bytes'])} held, "
             f"{totals['time_saved_s']:.2f} s saved"]
    for c in sorted(snap["caches"], key=lambda c: (c["kind"], c["name"])):
        if c.get("off"):
            lines.append(f"- [{c['kind']}] {c['name']}: off — {c['off']}")
            continue
        counters = c["counters"]
        parts = [f"{k}={v}" for k, v in sorted(counters.items())]
        if c["hit_rate"] is not None:
            parts.append(f"hit rate {c['hit_rate']:.0%}")
        mem = ", ".join(
            f"{tier} {format_bytes(n)}" + (f"/{format_bytes(c['budgets'][tier])}" if tier in c["budgets"] else "")
            for tier, n in sorted(c["bytes"].items()))
        lines.append(f"- [{c['kind']}] {c['name']}: {c['entries']} entries"
                     + (f", {mem}" if mem else "")
                     + (f"; {' '.join(parts)}" if parts else "")
                     + (f"; saved {c['time_saved_s']:.2f} s" if c["time_saved_s"] else ""))
        for row in c.get("reasons", [])[:TOP_REASONS]:
            lines.append(f"    {row['count']}x {format_reason(row)}")
        for key, value in sorted(c["info"].items()):
            lines.append(f"    {key}: {value}")
    return "\n".join(lines)
