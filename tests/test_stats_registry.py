"""The stats registry every cache reports to (pure logic, real threads)."""

import json
import threading

import pytest
import rkharness

pytestmark = pytest.mark.foundation


@pytest.fixture
def stats():
    return rkharness.pack("caching.stats")


def test_register_count_and_snapshot_is_json_ready(stats):
    reg = stats.StatsRegistry()
    cond = reg.register("conditioning", "conditioning", "text/vision/VAE encodes")
    pe = reg.register("pe:flux#1", "pe")
    cond.incr("hits", 3)
    cond.incr("misses")
    cond.set_memory("cpu", 1000, budget=4096)
    cond.set_memory("device", 24)
    cond.set_entries(2)
    cond.add_time_saved(0.5)
    cond.add_time_saved(-1)  # never negative
    pe.set_memory("cpu", 76)
    pe.set_info("last", {"key": "64x64", "hits": 7})

    snap = json.loads(json.dumps(reg.snapshot()))
    assert snap["schema"] == stats.SCHEMA_VERSION
    by_name = {c["name"]: c for c in snap["caches"]}
    c = by_name["conditioning"]
    assert c["counters"] == {"hits": 3, "misses": 1}
    assert c["hit_rate"] == 0.75
    assert c["bytes"] == {"cpu": 1000, "device": 24} and c["budgets"] == {"cpu": 4096}
    assert c["entries"] == 2 and c["time_saved_s"] == 0.5 and c["clearable"] is False
    assert by_name["pe:flux#1"]["info"]["last"] == {"key": "64x64", "hits": 7}
    assert by_name["pe:flux#1"]["hit_rate"] is None
    assert snap["totals"]["bytes"] == 1100
    assert snap["totals"]["bytes_by_tier"] == {"cpu": 1076, "device": 24}
    assert snap["totals"]["bytes_by_kind"] == {"conditioning": 1024, "pe": 76}
    assert snap["totals"]["time_saved_s"] == 0.5
    reg.register("conditioning_disk", "conditioning").set_memory("disk", 9000)  # files, not memory
    totals = reg.snapshot()["totals"]
    assert totals["bytes"] == 1100 and totals["bytes_by_tier"]["disk"] == 9000


def test_names_are_unique_and_unregister_frees_them(stats):
    reg = stats.StatsRegistry()
    first = reg.register("a", "pe")
    first.incr("hits")
    assert reg.register("a", "pe") is first and first.counter("hits") == 1  # idempotent by name
    with pytest.raises(KeyError):
        reg.register("a", "graph")  # one name, one kind
    with pytest.raises(ValueError):
        reg.register("", "pe")
    reg.unregister("a")
    assert reg.get("a") is None
    assert reg.register("a", "pe") is not first
    assert reg.names() == ["a"]


def test_registering_again_gives_the_handle_to_the_latest_owner_and_pushes_only_changes(stats):
    reg = stats.StatsRegistry()
    cleared = []
    reg.register("x", "step", "old", clear=lambda: cleared.append("old"))
    version = reg.version
    reg.register("x", "step")  # nothing given: nothing changes, nothing pushed
    assert reg.version == version
    reg.register("x", "step", "new", clear=lambda: cleared.append("new"))
    assert reg.clear("x") == ["x"] and cleared == ["new"]
    assert reg.snapshot()["caches"][0]["description"] == "new"


def test_caches_registering_from_several_threads_share_one_handle(stats):
    reg = stats.StatsRegistry()
    start, handles, errors = threading.Barrier(8), [], []

    def worker():
        start.wait()
        try:
            handles.append(reg.register("step", "step"))
        except Exception as exc:  # the old get() or register() pattern raised KeyError here
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len({id(h) for h in handles}) == 1 and reg.names() == ["step"]


def test_clear_calls_the_cache_and_reports_what_was_cleared(stats):
    reg = stats.StatsRegistry()
    cleared = []
    reg.register("x", "conditioning", clear=lambda: cleared.append("x"))
    reg.register("y", "pe")  # not clearable
    assert reg.clear() == ["x"]
    assert reg.clear("x") == ["x"] and cleared == ["x", "x"]
    assert reg.clear("y") == []
    with pytest.raises(KeyError):
        reg.clear("nope")


def test_listeners_and_version_follow_changes(stats):
    reg = stats.StatsRegistry()
    calls = []
    listener = lambda: calls.append(reg.version)  # noqa: E731
    reg.add_listener(listener)
    s = reg.register("x", "step")
    v = reg.version
    s.incr("hits")
    assert reg.version == v + 1 and calls[-1] == reg.version
    reg.remove_listener(listener)
    n = len(calls)
    s.incr("hits")
    assert len(calls) == n


def test_concurrent_updates_and_snapshots_lose_nothing(stats):
    reg = stats.StatsRegistry()
    handles = [reg.register(f"c{i}", "conditioning") for i in range(4)]
    errors = []

    def writer(h):
        for i in range(2000):
            h.incr("hits")
            h.set_memory("cpu", i)
            h.add_time_saved(0.001)

    def reader():
        try:
            for _ in range(200):
                json.dumps(reg.snapshot())
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(h,)) for h in handles for _ in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    snap = reg.snapshot()
    assert all(c["counters"]["hits"] == 4000 for c in snap["caches"])
    assert snap["totals"]["time_saved_s"] == pytest.approx(16.0)


def test_format_snapshot_is_readable(stats):
    reg = stats.StatsRegistry()
    s = reg.register("conditioning", "conditioning")
    s.incr("hits", 9)
    s.incr("misses", 1)
    s.set_memory("cpu", 3 * 1024 * 1024, budget=512 * 1024 * 1024)
    text = stats.format_snapshot(reg.snapshot())
    assert "1 caches, 3.0 MiB held" in text
    assert "[conditioning] conditioning" in text and "hit rate 90%" in text
    assert "cpu 3.0 MiB/512.0 MiB" in text


def test_a_fact_updated_from_several_threads_keeps_every_change(stats):
    """Samplers finishing at once each add their run to the same fact (the step cache's per-model reports):
    none is lost to another's read-modify-write."""
    cache = stats.StatsRegistry().register("step", "step_cache")
    barrier = threading.Barrier(4)

    def add_runs(who):
        barrier.wait()
        for i in range(300):
            cache.update_info("runs", lambda runs, item=(who, i): [*(runs or []), item])

    threads = [threading.Thread(target=add_runs, args=(who,)) for who in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    runs = cache.snapshot()["info"]["runs"]
    assert sorted(runs) == sorted((who, i) for who in range(4) for i in range(300))


def test_settings_validate_before_anything_changes():
    settings = rkharness.pack("caching.settings")
    reg = settings.SettingsRegistry()
    applied = []
    reg.define("conditioning.budget_mib", int, 512, "budget", minimum=0, maximum=65536, on_change=applied.append)
    reg.define("conditioning.enabled", bool, True)
    reg.define("step.mode", str, "auto", choices=("auto", "off"))
    assert reg.set("conditioning.budget_mib", 256) == 256 and applied == [256]
    for bad in (-1, 1e9, "12", 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="conditioning.budget_mib"):
            reg.set("conditioning.budget_mib", bad)
    with pytest.raises(ValueError, match="unknown setting"):
        reg.set("nope", 1)
    with pytest.raises(ValueError, match="step.mode"):
        reg.update({"conditioning.enabled": False, "step.mode": "sometimes"})
    assert reg.get("conditioning.enabled") is True  # all or nothing
    assert reg.snapshot()["conditioning.budget_mib"]["value"] == 256
    with pytest.raises(KeyError):
        reg.define("step.mode", str, "auto")


def test_a_failing_callback_undoes_the_whole_update_and_names_the_setting():
    """Whatever a cache's callback raises (a folder it cannot read), the update is a ValueError naming the
    setting, so the panel's route answers 400 with it; a callback that fails again while put back does not
    stop the others from being put back."""
    settings = rkharness.pack("caching.settings")
    reg = settings.SettingsRegistry()
    seen, fragile = [], []
    reg.define("a", int, 1, on_change=seen.append)

    def put_back_fails(value):
        fragile.append(value)
        if value == 1:
            raise OSError("the disk went away")

    def refuse(value):
        raise PermissionError("the cache cannot read its folder")

    reg.define("f", int, 1, on_change=put_back_fails)
    reg.define("b", int, 1, on_change=refuse)
    with pytest.raises(ValueError, match="setting 'b' could not be applied: PermissionError: the cache cannot"):
        reg.update({"a": 2, "f": 2, "b": 3})
    assert (reg.get("a"), reg.get("f"), reg.get("b")) == (1, 1, 1)
    assert seen == [2, 1] and fragile == [2, 1]


def test_a_slow_callback_never_holds_a_reader_nor_a_snapshot():
    """A callback that takes its time (the Redis tier reconnecting to a server that does not answer) runs
    while a sampling thread reads settings and the panel takes a snapshot: neither waits for it; a second
    update waits its turn."""
    settings = rkharness.pack("caching.settings")
    reg = settings.SettingsRegistry()
    entered, release = threading.Event(), threading.Event()
    reg.define("slow", int, 1, on_change=lambda _value: (entered.set(), release.wait(30)))
    reg.define("other", int, 5)
    updating = threading.Thread(target=reg.set, args=("slow", 2))
    updating.start()
    try:
        assert entered.wait(10)
        seen = {}
        reader = threading.Thread(target=lambda: seen.update(other=reg.get("other"), slow=reg.get("slow"),
                                                             shown=reg.snapshot()["slow"]["value"]))
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "a read waited for another setting's callback"
        assert seen == {"other": 5, "slow": 2, "shown": 2}
        second = threading.Thread(target=reg.set, args=("other", 6))
        second.start()
        second.join(0.2)
        assert second.is_alive() and reg.get("other") == 5  # updates are applied one at a time
    finally:
        release.set()
        updating.join(10)
    second.join(10)
    assert (reg.get("slow"), reg.get("other")) == (2, 6)


@pytest.mark.hardening
def test_a_setting_refuses_huge_numbers_with_a_short_message_and_changes_nothing():
    settings = rkharness.pack("caching.settings")
    reg = settings.SettingsRegistry()
    reg.define("t.ratio", float, 0.5, minimum=0.0)
    reg.define("t.count", int, 4, minimum=0, maximum=100)
    for key, raw in (("t.ratio", 10 ** 400), ("t.count", 10 ** 400), ("t.count", "9" * 100_000), ("t.count", 2.5)):
        with pytest.raises(ValueError) as err:
            reg.update({"t.count": 5, key: raw})
        assert key in str(err.value) and len(str(err.value)) < 200
        assert reg.get("t.ratio") == 0.5 and reg.get("t.count") == 4
    assert reg.set("t.count", 7.0) == 7 and reg.set("t.ratio", 10 ** 3) == 1000.0


@pytest.mark.parametrize("which", ["conditioning", "pe"])
def test_a_caches_figures_end_at_its_state_when_two_threads_publish_them(which):
    """A cache reads its figures under its lock and writes them to its stats after: a clear from the panel's
    thread while the worker's publish was between the two wrote 0 entries, then the worker's older reading
    over it (the panel showed 0 entries of 17 held, or an entry after the clear, until the next change)."""
    import torch

    if which == "conditioning":
        cc = rkharness.pack("caching.conditioning")
        cache = cc.ConditioningCache()
        cache.fetch(cc.Key("text", (cc.encode(1),), owners=(1,)), lambda: torch.ones(3))
        publish = cache._publish
    else:
        pc = rkharness.pack("caching.pe_cache")
        cache = pc.PECache()
        cache.get_or_create(pc.PECacheKey("n").add(1), lambda: torch.ones(3))
        publish = cache.publish
    assert cache.stats.snapshot()["entries"] == 1
    reading, go = threading.Event(), threading.Event()
    real = cache.stats.set_entries

    def set_entries(n):  # the worker's publish stops between its reading and its writing
        if threading.current_thread() is worker:
            reading.set()
            assert go.wait(10)
        real(n)

    cache.stats.set_entries = set_entries
    worker = threading.Thread(target=publish)
    worker.start()
    assert reading.wait(10)
    panel = threading.Thread(target=cache.clear)
    panel.start()
    panel.join(0.5)  # (a publish that waits for the worker's holds the clear's figures until it ends)
    go.set()
    worker.join(10)
    panel.join(10)
    snap = cache.stats.snapshot()
    assert snap["entries"] == 0 and not any(snap["bytes"].values()), snap
