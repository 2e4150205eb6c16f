"""PECache and PECacheKey (caching/pe_cache.py): keys, hits, replacement, safety, stats."""

import gc

import pytest
import rkharness
import torch

pytestmark = pytest.mark.pe_cache


@pytest.fixture(scope="module")
def pc():
    return rkharness.pack("caching.pe_cache")


def build_counter(value_fn):
    calls = []

    def build():
        calls.append(1)
        return value_fn()
    return build, calls


BASE_FIELDS = [3, 2.5, True, "img", None, torch.float32, torch.device("cpu"), (1, 2), [3, 4],
               {"scale_x": 1.0}, torch.arange(6.0).reshape(2, 3)]


def key_with(pc, fields, name="model.image_pe"):
    k = pc.PECacheKey(name)
    for f in fields:
        k.add(f)
    return k.add_shape((1, 4, 1)).add_shapes([(1, 2), (3, 4)])


def test_equal_keys_compare_equal_and_keys_hold_no_caller_tensor(pc):
    ids = torch.arange(6.0).reshape(2, 3)
    frozen = key_with(pc, BASE_FIELDS[:-1] + [ids])
    assert frozen == key_with(pc, BASE_FIELDS[:-1] + [ids.clone()])
    ids.add_(1)  # the caller changes its tensor after the key was stored
    assert frozen != key_with(pc, BASE_FIELDS[:-1] + [ids])
    assert frozen == key_with(pc, BASE_FIELDS)


CHANGED = [4, 2.25, False, "txt", 0, torch.float16, torch.device("meta"), (1, 3), (3, 4),
           {"scale_x": 2.0}, torch.arange(6.0).reshape(3, 2)]


@pytest.mark.parametrize("index", range(len(BASE_FIELDS)))
def test_changing_any_single_field_misses(pc, index):
    fields = list(BASE_FIELDS)
    fields[index] = CHANGED[index]
    assert key_with(pc, BASE_FIELDS) != key_with(pc, fields)


def test_typed_fields_name_shapes_and_tensor_values_all_count(pc):
    k = lambda *fs: key_with(pc, fs)  # noqa: E731
    assert k(1) != k(1.0) and k(1) != k(True) and k(0.0) != k(-0.0)
    assert k(float("nan")) == k(float("nan"))
    assert pc.PECacheKey("a").add(1) != pc.PECacheKey("b").add(1)
    assert pc.PECacheKey("a").add_shape((2, 3)) != pc.PECacheKey("a").add_shape((2, 3, 1))  # trailing ones
    assert pc.PECacheKey("a").add_shapes([(1, 2), (3, 4)]) != pc.PECacheKey("a").add_shapes([(3, 4), (1, 2)])
    t = torch.zeros(4)
    assert pc.PECacheKey("a").add(t) != pc.PECacheKey("a").add(t.to(torch.float64))
    t2 = t.clone()
    t2[3] = 1e-30
    assert pc.PECacheKey("a").add(t) != pc.PECacheKey("a").add(t2)
    assert pc.PECacheKey("a").add(1).add(2) != pc.PECacheKey("a").add(2).add(1)
    zero = torch.zeros(3)
    assert pc.PECacheKey("a").add(zero) != pc.PECacheKey("a").add(-zero)  # compared bit for bit
    assert pc.PECacheKey("a").add(zero.half()) == pc.PECacheKey("a").add(torch.zeros(3).half())
    odd = torch.arange(12.0).reshape(3, 4).t()  # a non-contiguous view keys with its stride
    assert pc.PECacheKey("a").add(odd) != pc.PECacheKey("a").add(odd.contiguous())
    assert pc.PECacheKey("a").add(odd) == pc.PECacheKey("a").add(torch.arange(12.0).reshape(3, 4).t())
    with pytest.raises(TypeError):
        pc.PECacheKey("a").add(object())
    with pytest.raises(ValueError):
        pc.PECacheKey("")


def test_the_same_tensor_matches_until_it_is_mutated(pc):
    with torch.inference_mode(False):
        ids = torch.arange(8.0)
    stored = pc.PECacheKey("n").add(ids)
    assert stored == pc.PECacheKey("n").add(ids)
    ids.add_(1)  # the same object, new values
    assert stored != pc.PECacheKey("n").add(ids)


def test_hit_returns_the_same_object_and_builds_once(pc):
    cache = pc.PECache()
    build, calls = build_counter(lambda: torch.randn(4, 4))
    key = lambda: pc.PECacheKey("pe").add(64).add(torch.arange(3))  # noqa: E731
    first = cache.get_or_create(key(), build)
    for _ in range(3):
        assert cache.get_or_create(key(), build) is first
    assert len(calls) == 1
    assert cache.name_stats()["pe"]["hits"] == 3 and cache.name_stats()["pe"]["misses"] == 1


def test_new_key_replaces_and_alternating_recomputes_and_names_are_independent(pc):
    cache = pc.PECache()
    build, calls = build_counter(lambda: torch.ones(2) * len(calls))
    a = cache.get_or_create(pc.PECacheKey("img").add(1), build)
    other = cache.get_or_create(pc.PECacheKey("txt").add(1), build)
    a_values = a.clone()
    b = cache.get_or_create(pc.PECacheKey("img").add(2), build)
    assert torch.equal(a, a_values)  # the replaced tensor, still held by a step, is intact
    assert cache.get_or_create(pc.PECacheKey("img").add(1), build) is not a  # no LRU: recomputed
    assert len(calls) == 4 and b is not a
    assert cache.get_or_create(pc.PECacheKey("txt").add(1), build) is other  # untouched by "img"
    stats = cache.name_stats()
    assert stats["img"]["replacements"] == 2 and stats["img"]["misses"] == 3
    assert cache.names() == ["img", "txt"]


def test_a_caller_writing_into_a_returned_tensor_cannot_corrupt_the_next_hit(pc):
    cache = pc.PECache()
    build, calls = build_counter(lambda: torch.arange(6.0).reshape(2, 3))
    key = lambda: pc.PECacheKey("pe").add(1)  # noqa: E731
    with torch.inference_mode():  # as ComfyUI runs: results are still version-counted tensors
        first = cache.get_or_create(key(), build)
        assert not first.is_inference()
        first.movedim(0, 1)[0].mul_(100)  # in place, through a view
        again = cache.get_or_create(key(), build)
    assert torch.equal(again, torch.arange(6.0).reshape(2, 3)) and len(calls) == 2
    assert cache.name_stats()["pe"]["mutated"] == 1


def test_a_name_whose_key_another_name_holds_shares_its_tensors_instead_of_building(pc):
    cache = pc.PECache()
    build, calls = build_counter(lambda: torch.zeros(1000))
    key = lambda name, n, group="pe": pc.PECacheKey(name, group).add(n).add(torch.arange(4))  # noqa: E731
    cond = cache.get_or_create(key("pe|0", 64), build)
    uncond = cache.get_or_create(key("pe|1", 64), build)
    assert uncond is cond and len(calls) == 1
    assert cache.nbytes()["cpu"] < 2 * 4000  # counted once
    other = cache.get_or_create(key("pe|1", 65), build)
    assert other is not cond and len(calls) == 2
    assert cache.get_or_create(key("pe|0", 64), build) is cond
    assert cache.get_or_create(key("other", 64, group="another builder"), build) is not cond  # groups apart
    assert cache.get_or_create(key("ungrouped", 64, group=None), build) is not cond
    stats = cache.name_stats()
    assert stats["pe|1"]["shared"] == 1 and stats["pe|1"]["misses"] == 1 and stats["pe|0"]["hits"] == 1


def test_values_may_be_tuples_with_python_scalars_and_bytes_are_counted_per_tier(pc):
    cache = pc.PECache()
    cos, sin, flag, lengths = cache.get_or_create(
        pc.PECacheKey("cs").add(1), lambda: (torch.zeros(10), torch.ones(10), True, (3, 4)))
    again = cache.get_or_create(pc.PECacheKey("cs").add(1), lambda: None)
    assert again[0] is cos and again[2:] == (True, (3, 4))
    assert cache.nbytes()["cpu"] >= 80
    for mutable in ({"a": torch.zeros(1)}, object()):  # a value a caller could change in place
        with pytest.raises(TypeError):
            cache.get_or_create(pc.PECacheKey("bad").add(1), lambda v=mutable: v)


def test_stats_register_per_owner_clear_and_release_with_the_owner(pc):
    registry = rkharness.pack("caching.stats").REGISTRY

    class Owner:
        pass

    owner = Owner()
    cache = pc.cache_for(owner, "Tiny")
    assert pc.cache_for(owner) is cache and pc.cache_for(Owner(), create=False) is None
    name = cache.stats.name
    assert name.startswith("pe:Tiny#") and registry.get(name).kind == "pe"
    cache.get_or_create(pc.PECacheKey("pe").add(1), lambda: torch.zeros(256))
    cache.get_or_create(pc.PECacheKey("pe").add(1), lambda: torch.zeros(256))
    snap = registry.get(name).snapshot()
    assert snap["counters"]["hits"] == 1 and snap["counters"]["misses"] == 1
    assert snap["bytes"]["cpu"] >= 1024 and snap["entries"] == 1
    assert snap["info"]["names"]["pe"]["bytes"] >= 1024
    assert registry.clear(name) == [name] and cache.names() == []
    assert registry.get(name).snapshot()["bytes"]["cpu"] == 0
    del owner, cache
    gc.collect()  # the owner's finalizer only records (docs/development.md, "Rules for contributors")...
    registry.snapshot()  # ...and the cache is closed at the next snapshot (or cache_for)
    assert registry.get(name) is None


def test_bypass_reasons_are_the_stats_rows_bounded_and_reset_with_the_counts(pc):
    """One list of reasons per cache, the stats' own: a cache the panel sees and one it does not read
    them alike, past MAX_REASONS kinds the least frequent count under one row, and a reset of the counts
    clears them."""
    st = rkharness.pack("caching.stats")
    registry = st.REGISTRY
    shown, own = pc.PECache("pe:reasons-test#1"), pc.PECache()
    try:
        for cache in (shown, own):
            cache.bypass("probe[0]", "inputs require grad")
            cache.bypass("probe[0]", "inputs require grad")
            cache.get_or_create(pc.PECacheKey("probe[0]").add(1), lambda: torch.zeros(4))  # a miss: no reason
            assert cache.bypass_reasons() == {"inputs require grad": 2}
            assert cache.name_stats()["probe[0]"]["bypasses"] == 2
        assert registry.get("pe:reasons-test#1").snapshot()["reasons"] == [
            {"event": "bypass", "source": "", "reason": "inputs require grad", "count": 2}]
        assert registry.get("pe") is None  # the unnamed cache's handle is its own, in no panel
        for i in range(st.MAX_REASONS + 5):
            own.bypass("probe[0]", f"probe: a value of kind {i} the key cannot describe")
        reasons = own.bypass_reasons()
        assert len(reasons) == st.MAX_REASONS + 1 and reasons[st.OTHER_REASON] == 6  # the kinds, then one row
        assert sum(reasons.values()) == st.MAX_REASONS + 5 + 2
        own.stats.reset_counters()
        assert own.bypass_reasons() == {}
    finally:
        shown.close()
        own.close()
    assert shown.bypass_reasons() == own.bypass_reasons() == {} and registry.get("pe:reasons-test#1") is None


def test_default_setting_is_defined_and_validated(pc):
    settings = rkharness.pack("caching.settings").SETTINGS
    assert settings.get(pc.DEFAULT_ENABLED_KEY) is False
    with pytest.raises(ValueError, match="pe_cache.default_enabled"):
        settings.set(pc.DEFAULT_ENABLED_KEY, "yes")


def test_the_builders_argument_binding_is_inspects_for_every_call_shape():
    """The PE keys bind a builder's arguments without ``inspect`` on a hit: the same names, values and
    order as ``Signature.bind`` with defaults, and the same refusal of a call that does not fit."""
    import inspect

    binder = rkharness.pack("patches.rope")._Binder

    def plain(self, a, b=2, *, c=3):
        pass

    def positional_only(a, /, b, c=5):
        pass

    def variadic(a, *args, **kw):
        pass

    calls = [(plain, (0, 1), {}), (plain, (0, 1, 5), {}), (plain, (0,), {"a": 1, "c": 9}), (plain, (0, 1), {"b": 4}),
             (plain, (0,), {}), (plain, (0, 1, 2, 3), {}), (plain, (0, 1), {"a": 2}), (plain, (0, 1), {"zz": 2}),
             (positional_only, (1, 2), {}), (positional_only, (1,), {"b": 3}), (positional_only, (), {"a": 1, "b": 2}),
             (variadic, (1, 2), {"k": 3}), (variadic, (), {"a": 1})]
    for fn, args, kwargs in calls:
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            want = list(bound.arguments.items())
        except TypeError:
            want = TypeError
        try:
            got = list(binder(fn)(args, kwargs).items())
        except TypeError:
            got = TypeError
        assert got == want, (fn.__name__, args, kwargs)
