"""What the garbage collector runs never takes a lock, nor calls the stats or ComfyUI: it only records
(docs/development.md, "Rules for contributors"). The collector runs finalizers on whatever thread allocates, at any
point, so it may run one on a thread that holds any lock of the pack: a finalizer that takes that lock
deadlocks the thread on itself (issue 21: a stats snapshot froze the prompt worker that way).

Every place the pack hands the collector a callback is found in its source (``weakref.finalize``, a
weakref with a callback, ``__del__``, ``gc.callbacks``) and has a scenario here; so has ComfyUI's own
``ModelPatcher.__del__``, which detaches the patcher through the pack's lifecycle listeners. Each
scenario's object dies inside ``gc.collect()`` (it sits in a reference cycle) on a thread that holds one
of the pack's locks: each in turn, every stats lock and every cache lock, as found in the loaded pack.
The thread must get through (a join with a timeout: a deadlock fails the test instead of hanging it,
and the lock is released to free the thread), nothing may have changed (the stats' version, the
cache's state), and the recorded work must be done at the next safe point (a cache call, a snapshot).
"""

import ast
import gc
import itertools
import os
import sys
import threading
import types

import pytest
import rkharness
import torch

pytestmark = pytest.mark.hardening

JOIN_S = 5.0
LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
SOURCES = ("caching", "patches", "nodes", "routes.py", "__init__.py")
_ids = itertools.count()


def pack(name):
    return rkharness.pack(name)


# ---- where the pack hands the collector a callback --------------------------------------------

def _is_call(node, module: str, name: str) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == name and isinstance(f.value, ast.Name)
            and f.value.id == module)


def gc_callback_sites() -> set[tuple[str, str]]:
    """(file, enclosing function) of every weakref.finalize, weakref with a callback, __del__ and
    gc.callbacks use in the pack's source."""
    sites = set()
    files = [p for s in SOURCES for p in ((rkharness.ROOT / s).rglob("*.py") if (rkharness.ROOT / s).is_dir()
                                          else [rkharness.ROOT / s])]
    for path in files:
        tree = ast.parse(path.read_text())
        rel = path.relative_to(rkharness.ROOT).as_posix()

        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
                if isinstance(child, ast.FunctionDef) and child.name == "__del__":
                    sites.add((rel, "__del__"))
                if isinstance(child, ast.Call) and (
                        _is_call(child, "weakref", "finalize")
                        or ((_is_call(child, "weakref", "ref") or _is_call(child, "weakref", "WeakMethod"))
                            and (len(child.args) > 1 or child.keywords))):
                    sites.add((rel, where))
                if isinstance(child, ast.Attribute) and child.attr == "callbacks" and \
                        isinstance(child.value, ast.Name) and child.value.id == "gc":
                    sites.add((rel, where))
                visit(child, inner)

        visit(tree, "<module>")
    return sites


# ---- the scenarios: an object whose death runs the callback --------------------------------------

class Owner:
    """A model stand-in in a reference cycle: only the collector frees it."""

    def __init__(self):
        self.cycle = self


class Scenario:
    """``make()`` -> (the object's only reference, in a list, a state, and the locks of the objects that
    die with it by name); ``untouched(state)`` right after the death, before any safe point;
    ``settle()`` a safe point; ``done(state)`` after it."""

    def make(self):
        raise NotImplementedError

    def untouched(self, state) -> bool:
        raise NotImplementedError

    def settle(self, state) -> None:
        pack("caching.stats").REGISTRY.snapshot()

    def done(self, state) -> bool:
        raise NotImplementedError


class GraphSets(Scenario):
    """patches/graph_release.py graph_set: the graph sets go with their model; the graph stats' memory
    says so at the next graph call or snapshot."""

    def make(self):
        gr, release = pack("caching.graph_reuse"), pack("patches.graph_release")
        model = Owner()
        gs = release.graph_set(model, 2)
        gs.add(gr.Entry(gr.Signature((("gc-test", next(_ids)),)), runner=None, nbytes=1000))
        release.publish_memory()
        return [model], self.held(), {"its GraphSet.lock": gs.lock}

    @staticmethod
    def held() -> int:
        return pack("patches.graph_release").STATS.handle.snapshot()["bytes"].get("device", 0)

    def untouched(self, state) -> bool:
        return self.held() == state

    def done(self, state) -> bool:
        return self.held() == state - 1000


class PECaches(Scenario):
    """caching/pe_cache.py cache_for: a model's PE cache is closed (entries dropped, stats unregistered)
    after the model dies, at the next cache_for or snapshot."""

    def make(self):
        pe = pack("caching.pe_cache")
        model = Owner()
        cache = pe.cache_for(model, label="gc-test")
        cache.get_or_create(pe.PECacheKey("gc-test").add(1), lambda: torch.ones(4))
        return [model], cache.stats.name, {"its PECache._lock": cache._lock, "its stats lock": cache.stats._lock}

    def untouched(self, name) -> bool:
        return pack("caching.stats").REGISTRY.get(name) is not None

    def done(self, name) -> bool:
        return pack("caching.stats").REGISTRY.get(name) is None


class ConditioningOwners(Scenario):
    """caching/conditioning.py identity: an encoder's death forgets its serial and drops its cache
    entries at the next cache call (the serial table is never changed inside the collector)."""

    def make(self):
        cond = pack("caching.conditioning")
        encoder = Owner()
        serial = cond.identity(encoder)
        key = cond.Key("text", ("gc-test", next(_ids)), owners=(serial,))
        assert cond.CACHE.store(key, torch.ones(2), 0.1)
        return [encoder], (key, id(encoder)), {}

    def untouched(self, state) -> bool:
        cond = pack("caching.conditioning")
        key, oid = state
        return key in cond.CACHE.keys() and oid in cond._serials

    def settle(self, state) -> None:
        cond = pack("caching.conditioning")
        cond.CACHE.fetch(cond.Key("text", ("gc-test settle", next(_ids))), lambda: torch.zeros(1))
        cond.identity(Owner())  # the next serial handed out prunes the dead ones

    def done(self, state) -> bool:
        cond = pack("caching.conditioning")
        key, oid = state
        return key not in cond.CACHE.keys() and (oid not in cond._serials or cond._serials[oid][0]() is not None)


class PatcherDetach(Scenario):
    """ComfyUI's ModelPatcher.__del__ detaches the patcher: the pack's lifecycle listeners hear it at
    the next safe point (a lifecycle call, a graph call, a snapshot), given the model only."""

    def __init__(self):
        self.heard = []
        self.base = None

    def listen(self, patcher, *args, **kwargs):
        self.heard.append((patcher, args, kwargs))

    def make(self):
        if self.base is None:
            self.base = rkharness.TINY.tiny_flux(0)
        self.heard.clear()
        clone = self.base.clone()
        clone.gc_test_cycle = clone
        return [clone], self.base.model, {}

    def untouched(self, model) -> bool:
        return not self.heard

    def done(self, model) -> bool:
        return (len(self.heard) == 1 and self.heard[0][0].model is model
                and self.heard[0][2].get("unpatch_all", True) is False)


class LazyFiles(Scenario):
    """patches/lazy_clip.py _keep_open: a lazy encoder that dies before its weights were read leaves the
    files it kept open to be closed at the next build or snapshot."""

    def make(self):
        lazy = pack("patches.lazy_clip")
        encoder = Owner()
        fd = os.open(__file__, os.O_RDONLY)
        lazy._keep_open(encoder, (fd,))
        return [encoder], fd, {}

    @staticmethod
    def is_open(fd) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True

    def untouched(self, fd) -> bool:
        return self.is_open(fd)

    def done(self, fd) -> bool:
        return not self.is_open(fd)


SCENARIOS = {
    ("patches/lazy_clip.py", "_keep_open"): LazyFiles,
    ("patches/graph_release.py", "graph_set"): GraphSets,
    ("caching/pe_cache.py", "cache_for"): PECaches,
    ("caching/conditioning.py", "identity"): ConditioningOwners,
}


# ---- the locks ----------------------------------------------------------------------------------

def pack_locks() -> dict[str, object]:
    """Every lock of the loaded pack: module globals, the attributes of module-level objects (caches,
    stats, settings), every cache's stats handle (not this test's own)."""
    prefix = rkharness.PACK.__name__ + "."
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix):
            continue
        short = name[len(prefix):]
        for attr, value in list(vars(module).items()):
            if isinstance(value, LOCK_TYPES):
                found[f"{short}.{attr}"] = value
            elif not isinstance(value, (type, types.ModuleType, types.FunctionType)) and hasattr(value, "__dict__"):
                for inner, lock in list(vars(value).items()):
                    if isinstance(lock, LOCK_TYPES):
                        found[f"{short}.{attr}.{inner}"] = lock
    for stats in list(pack("caching.stats").REGISTRY._caches.values()):
        if "gc-test" not in stats.name:
            found[f"stats {stats.name}"] = stats._lock
    unique = {}
    for name, lock in found.items():
        if all(lock is not other for other in unique.values()):
            unique[name] = lock
    return unique


def die_holding(lock, scenario: Scenario, ref: list, state) -> str | None:
    """On a new thread holding ``lock``: drop the object's last reference and collect. None when it got
    through with nothing changed, else what went wrong."""
    registry = pack("caching.stats").REGISTRY
    out = {}

    def body():
        with lock:
            version = registry.version
            ref.clear()
            gc.collect()
            out["changed"] = registry.version != version
        out["untouched"] = scenario.untouched(state)  # after the release: the check may take that lock

    thread = threading.Thread(target=body, name="gc-under-lock", daemon=True)
    thread.start()
    thread.join(JOIN_S)
    if thread.is_alive():  # the finalizer waits for the lock its own thread holds: free it, then fail
        try:
            lock.release()
        except RuntimeError:
            pass
        thread.join(JOIN_S)
        return "deadlock: the callback waited for the lock its thread held"
    if out.get("changed"):
        return "the callback changed the stats"
    if not out.get("untouched"):
        return "the callback did the work itself (it must only record)"
    return None


@pytest.fixture
def frozen_heap():
    """Everything alive now moves out of the collector's sight, so each gc.collect() sees only the
    scenario's few objects (fast, and only their finalizers run)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_under_every_lock(scenario: Scenario) -> list[str]:
    """The scenario's object dies under each lock in turn (a new object each time); what went wrong."""
    failures = []
    locks = pack_locks()
    ref, state, own = scenario.make()  # for the names of its own locks
    names = [*locks, *own]
    ref.clear()
    gc.collect()
    scenario.settle(state)
    for name in names:
        ref, state, own = scenario.make()
        why = die_holding(own.get(name) or locks[name], scenario, ref, state)
        if why is None:
            scenario.settle(state)
            if not scenario.done(state):
                why = "the recorded work was not done at the next safe point"
        if why:
            failures.append(f"{name}: {why}")
    assert len(locks) >= 10, sorted(locks)  # the stats', the caches', the registry's, at the least
    return failures


# ---- the tests ----------------------------------------------------------------------------------

def test_every_place_the_pack_hands_the_collector_a_callback_has_a_scenario():
    assert gc_callback_sites() == set(SCENARIOS)


@pytest.mark.parametrize("site", sorted(SCENARIOS), ids=lambda s: f"{s[0]}:{s[1]}")
def test_a_finalizer_run_under_any_lock_of_the_pack_only_records(site, frozen_heap):
    failures = run_under_every_lock(SCENARIOS[site]())
    assert not failures, "\n".join(failures)


def test_a_patcher_finalized_under_any_lock_tells_the_lifecycle_listeners_later(frozen_heap):
    lifecycle = pack("patches.lifecycle")
    scenario = PatcherDetach()
    lifecycle.add_listener("detach", scenario.listen)
    try:
        failures = run_under_every_lock(scenario)
    finally:
        lifecycle.remove_listener("detach", scenario.listen)
    assert not failures, "\n".join(failures)


def test_a_lifecycle_call_outside_a_finalizer_is_heard_at_once():
    lifecycle = pack("patches.lifecycle")
    heard = []

    def listen(patcher, *args, **kwargs):
        heard.append(patcher)

    patcher = rkharness.TINY.tiny_flux(0)
    lifecycle.add_listener("detach", listen)
    try:
        patcher.detach(unpatch_all=False)
    finally:
        lifecycle.remove_listener("detach", listen)
    assert heard == [patcher]
