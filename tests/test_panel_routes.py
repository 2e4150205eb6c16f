"""The panel's routes and websocket push, against the real server (main.py) with the pack loaded.

The server process holds real caches: the test-only probes of tests/tinymodels/panelprobe.py
(a VAE-decode memo of kind "conditioning", a step counter of kind "step") report to the pack's
real stats registry when a workflow runs through them.
"""

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import rkharness

pytestmark = pytest.mark.panel

MEMO, STEP = "rktest.decode_memo", "rktest.step_probe"


def probe_prompt(**kw):
    return rkharness.TINY.panelprobe.probe_prompt(**kw)


def run(server, **kw) -> dict:
    entry = server.wait_for_prompt(server.queue(probe_prompt(**kw)))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    return entry


def post_status(server, path, payload=None, raw: bytes | None = None):
    """(status, json body) of a POST, error statuses included."""
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def cache(snapshot, name):
    found = [c for c in snapshot["caches"] if c["name"] == name]
    assert found, f"no cache {name!r} in {[c['name'] for c in snapshot['caches']]}"
    return found[0]


@pytest.fixture(scope="module")
def server(comfy_server):
    run(comfy_server, seed=11)  # the probes register on first use
    return comfy_server


def test_stats_snapshot_has_the_schema_and_every_registered_cache(server):
    schema = rkharness.pack("caching.stats").SCHEMA_VERSION
    for path in ("/reusekit/stats", "/api/reusekit/stats"):
        snap = server.get(path)
        assert snap["schema"] == schema and isinstance(snap["version"], int)
        assert {"bytes", "bytes_by_tier", "bytes_by_kind", "time_saved_s"} <= set(snap["totals"])
        memo, step = cache(snap, MEMO), cache(snap, STEP)
        assert memo["kind"] == "conditioning" and step["kind"] == "step"
        assert memo["clearable"] and memo["budgets"]["cpu"] > 0 and memo["bytes"]["cpu"] > 0
        assert step["info"]["last_run"]["steps_computed"] == 2 and step["bytes"]["device"] > 0


def test_a_repeated_latent_is_a_hit_and_the_numbers_move(server):
    before = cache(server.get("/reusekit/stats"), MEMO)
    run(server, seed=11)  # same sampler output: the memo node reruns and hits
    run(server, seed=12, steps=3)
    after = server.get("/reusekit/stats")
    memo = cache(after, MEMO)
    assert memo["counters"]["hits"] == before["counters"].get("hits", 0) + 1
    assert memo["counters"]["misses"] == before["counters"]["misses"] + 1
    assert memo["time_saved_s"] > before["time_saved_s"] and 0 < memo["hit_rate"] < 1
    assert cache(after, STEP)["info"]["last_run"]["steps_computed"] == 3
    assert after["totals"]["bytes"] == sum(sum(c["bytes"].values()) for c in after["caches"])


def test_clear_one_cache_then_all(server):
    run(server, seed=13)
    status, body = post_status(server, "/reusekit/clear", {"cache": MEMO})
    assert status == 200 and body["cleared"] == [MEMO]
    assert cache(body["stats"], MEMO)["bytes"]["cpu"] == 0 and cache(body["stats"], MEMO)["entries"] == 0
    assert cache(body["stats"], STEP)["bytes"]["device"] > 0  # the other cache is untouched
    status, body = post_status(server, "/api/reusekit/clear", {"all": True})
    assert status == 200 and {MEMO, STEP} <= set(body["cleared"])
    assert body["stats"]["totals"]["bytes_by_kind"].get("step", 0) == 0


@pytest.mark.hardening
@pytest.mark.parametrize("payload,status", [
    ({"cache": "no.such.cache"}, 404),
    ({}, 400),
    ({"cache": ""}, 400),
    ({"all": "yes"}, 400),
    ({"cache": MEMO, "all": True}, 400),
    ([MEMO], 400),
    ({"cache": MEMO, "extra": 1}, 400),  # it cleared, ignoring the field (the settings route refuses one)
])
def test_clear_rejects_bad_requests(server, payload, status):
    run(server, seed=15)
    held = cache(server.get("/reusekit/stats"), MEMO)["entries"]
    code, body = post_status(server, "/reusekit/clear", payload)
    assert code == status and body["error"]
    assert held and cache(server.get("/reusekit/stats"), MEMO)["entries"] == held  # nothing cleared


@pytest.mark.hardening
def test_a_key_given_twice_gets_400_and_changes_nothing(server):
    """JSON keeps a repeated key's last value silently: a budget of -1 then 512 applied 512, no error."""
    before = server.get("/reusekit/settings")["settings"]
    for path, raw in (("/reusekit/settings", b'{"rktest.memo_budget_mib": -1, "rktest.memo_budget_mib": 32}'),
                      ("/reusekit/clear", b'{"cache": "no.such.cache", "cache": "%s"}' % MEMO.encode())):
        status, body = post_status(server, path, raw=raw)
        assert status == 400 and "is given twice" in body["error"], body
    assert server.get("/reusekit/settings")["settings"] == before


def test_settings_are_listed_and_a_valid_change_applies_at_once(server):
    run(server, seed=14)
    settings = server.get("/reusekit/settings")["settings"]
    budget = settings["rktest.memo_budget_mib"]
    assert budget["type"] == "int" and budget["min"] == 0 and budget["value"] == 64
    status, body = post_status(server, "/reusekit/settings", {"rktest.memo_budget_mib": 0})
    try:
        assert status == 200 and body["applied"] == {"rktest.memo_budget_mib": 0}
        assert body["settings"]["rktest.memo_budget_mib"]["value"] == 0
        memo = cache(server.get("/reusekit/stats"), MEMO)  # a zero budget evicts everything, no restart
        assert memo["budgets"]["cpu"] == 0 and memo["bytes"]["cpu"] == 0 and memo["counters"]["evictions"] >= 1
    finally:
        assert post_status(server, "/reusekit/settings", {"rktest.memo_budget_mib": 64})[0] == 200


@pytest.mark.hardening
@pytest.mark.parametrize("payload,needle", [
    ({"rktest.memo_budget_mib": 32, "rktest.memo_max_entries": 0}, "at least"),
    ({"rktest.memo_budget_mib": 32, "rktest.memo_max_entries": "4"}, "must be a number"),
    ({"rktest.memo_budget_mib": 32, "no.such.setting": 1}, "unknown setting"),
    ({"rktest.memo_budget_mib": 1.5}, "whole number"),
    ({"rktest.memo_budget_mib": True}, "must be a number"),
    ({}, "no settings"),
    ([1], "JSON object"),
])
def test_bad_settings_get_400_with_the_message_and_change_nothing(server, payload, needle):
    before = server.get("/reusekit/settings")["settings"]
    status, body = post_status(server, "/reusekit/settings", payload)
    assert status == 400 and needle in body["error"], body
    assert server.get("/reusekit/settings")["settings"] == before


def test_a_shared_tier_that_is_off_says_so_with_the_line_that_turns_it_on(server):
    """No folder or server in this environment: both tiers are off; the panel's switch turns the disk
    tier on (a folder under the user directory), and off again."""
    disk_how = ('turn on "conditioning disk enabled" in the panel\'s settings, or start ComfyUI with '
                "REUSEKIT_DISK_CACHE=<folder>")
    snap = server.get("/reusekit/stats")
    assert cache(snap, "conditioning_disk")["off"] == disk_how
    assert cache(snap, "conditioning_redis")["off"] == "start ComfyUI with REUSEKIT_REDIS_URL=redis://<host>:<port>/<db>"
    assert cache(snap, MEMO)["off"] is None  # a cache without a switch is never off
    assert post_status(server, "/reusekit/settings", {"conditioning.disk.enabled": True})[0] == 200
    try:
        disk = cache(server.get("/reusekit/stats"), "conditioning_disk")
        assert disk["off"] is None and disk["info"]["folder"] and disk["budgets"]["disk"] > 0
    finally:
        assert post_status(server, "/reusekit/settings", {"conditioning.disk.enabled": False})[0] == 200
    assert cache(server.get("/reusekit/stats"), "conditioning_disk")["off"] == disk_how


def test_reasons_are_counted_in_one_form_bounded_and_reset_with_the_counters():
    stats = rkharness.pack("caching.stats")
    registry = stats.StatsRegistry()
    handle = registry.register("why", "graph")
    # True for a row's first count: a cache logs each reason once by it
    assert handle.count_reason("bypass", "weights are partially loaded", source="partial_load") is True
    assert handle.count_reason("fallback", "no CUDA device", n=5, source="eager") is True
    assert handle.count_reason("bypass", "weights are partially loaded", source="partial_load") is False
    assert handle.count_reason("refused", "x" * 500) is True
    (c,) = registry.snapshot()["caches"]
    assert handle.reasons() == c["reasons"]
    assert c["reasons"][:2] == [
        {"event": "fallback", "source": "eager", "reason": "no CUDA device", "count": 5},
        {"event": "bypass", "source": "partial_load", "reason": "weights are partially loaded", "count": 2}]
    assert len(c["reasons"][2]["reason"]) == stats.REASON_CHARS and c["reasons"][2]["reason"].endswith("…")
    for i in range(stats.MAX_REASONS):  # past the bound: the least frequent (the oldest first) go to a row of the rest
        handle.count_reason("bypass", f"reason {i}")
    rows = registry.snapshot()["caches"][0]["reasons"]
    assert len(rows) == stats.MAX_REASONS + 2  # one row of the rest per event
    assert {"event": "refused", "source": "", "reason": stats.OTHER_REASON, "count": 1} in rows
    assert {"event": "bypass", "source": "", "reason": stats.OTHER_REASON, "count": 2} in rows
    named = {r["reason"] for r in rows}
    assert "reason 1" not in named and "reason 2" in named and "no CUDA device" in named
    # a reason that becomes frequent late is still named (once the panel's whole list was full, it was not)
    assert handle.count_reason("bypass", "late and frequent", n=500) is False  # took a place: not logged again
    assert registry.snapshot()["caches"][0]["reasons"][0] == {
        "event": "bypass", "source": "", "reason": "late and frequent", "count": 500}
    assert sum(r["count"] for r in handle.reasons()) == 1 + 5 + 2 + stats.MAX_REASONS + 500  # nothing lost
    text = stats.format_snapshot(registry.snapshot())
    assert "    500x bypass: late and frequent\n    5x fallback (eager): no CUDA device" in text
    version = registry.version
    handle.set_off("start it")
    handle.set_off("start it")  # unchanged: no push
    assert registry.version == version + 1
    assert "- [graph] why: off — start it" in stats.format_snapshot(registry.snapshot())
    handle.reset_counters()
    assert registry.snapshot()["caches"][0]["reasons"] == []


def test_late_reasons_coming_in_turns_on_a_full_list_are_both_named_with_their_counts():
    """Past the bound a newcomer counted from 1 was the least frequent at once: two late reasons coming in turns
    each took the other's place, 400 counts went to the row of the rest and the panel named one of them, at 1.
    A newcomer now ranks from the rank of the row it replaced, and shows the counts since it came in."""
    stats = rkharness.pack("caching.stats")
    handle = stats.StatsRegistry().register("why", "conditioning")
    for i in range(stats.MAX_REASONS):
        handle.count_reason("bypass", f"early {i}", n=5)
    for _ in range(200):
        handle.count_reason("bypass", "late A")
        handle.count_reason("bypass", "late B")
    rows = handle.reasons()
    assert rows[:2] == [{"event": "bypass", "source": "", "reason": f"late {x}", "count": 200} for x in "AB"], rows[:3]
    assert len(rows) == stats.MAX_REASONS + 1
    assert sum(r["count"] for r in rows) == 5 * stats.MAX_REASONS + 400  # nothing lost: two early rows in the rest
    assert {"event": "bypass", "source": "", "reason": stats.OTHER_REASON, "count": 10} in rows
    handle.reset_counters()
    handle.count_reason("bypass", "after the reset")
    assert handle.reasons() == [{"event": "bypass", "source": "", "reason": "after the reset", "count": 1}]


@pytest.mark.hardening
def test_a_body_that_is_not_json_gets_400(server):
    for path in ("/reusekit/settings", "/reusekit/clear"):
        status, body = post_status(server, path, raw=b"{not json")
        assert status == 400 and "not valid JSON" in body["error"]


@pytest.mark.hardening
def test_a_number_beyond_any_setting_gets_400_naming_the_setting(server):
    before = server.get("/reusekit/settings")["settings"]
    for raw in (b'{"rktest.memo_budget_mib": ' + b"9" * 400 + b"}",
                b'{"rktest.memo_budget_mib": 32, "rktest.memo_max_entries": -' + b"9" * 400 + b"}"):
        status, body = post_status(server, "/reusekit/settings", raw=raw)
        assert status == 400 and "rktest.memo_" in body["error"] and "out of range" in body["error"], body
        assert len(body["error"]) < 300
    assert server.get("/reusekit/settings")["settings"] == before


@pytest.mark.hardening
def test_json_nested_deeper_than_python_parses_gets_400_on_both_routes(server):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/reusekit/settings", "/reusekit/clear"):
        status, body = post_status(server, path, raw=b'{"cache": ' + deep + b"}")
        assert status == 400 and "nested too deeply" in body["error"], body
    assert server.get("/reusekit/stats")["schema"]  # still serving


@pytest.mark.hardening
def test_a_route_reads_and_echoes_a_bounded_amount(server):
    routes = rkharness.pack("routes")
    long_name = "x" * (routes.MAX_BODY_BYTES // 2)
    status, body = post_status(server, "/reusekit/clear", {"cache": long_name})
    assert status == 404 and len(body["error"]) < 300 and "characters" in body["error"]
    status, body = post_status(server, "/reusekit/clear", {"cache": "x" * 1_000_000})
    assert status == 413 and len(json.dumps(body)) < 300
    status, body = post_status(server, "/reusekit/settings", {"rktest.memo_budget_mib": "y" * 100_000})
    assert status == 400 and len(body["error"]) < 300
    assert server.get("/reusekit/stats")["schema"]


def test_stats_are_pushed_over_the_websocket_throttled(server):
    """A 12-step run changes the registry dozens of times: a few throttled events, the last one
    with the final state."""
    import websocket

    ws = websocket.create_connection(server.url.replace("http", "ws") + "/ws?clientId=rk-panel-test", timeout=30)
    events, stop = [], threading.Event()

    def listen():
        while not stop.is_set():
            try:
                message = ws.recv()
            except Exception:
                return
            if not message:
                return  # closed
            if isinstance(message, str):
                data = json.loads(message)
                if data["type"] == "reusekit.stats":
                    events.append((time.monotonic(), data["data"]))

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    try:
        version_before = server.get("/reusekit/stats")["version"]
        start = time.monotonic()
        run(server, seed=15, steps=12)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the trailing push of the burst
            if events and cache(events[-1][1], STEP)["info"]["last_run"]["steps_computed"] == 12:
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        ws.close()
        reader.join(5)
    version_after = server.get("/reusekit/stats")["version"]
    assert events, "no reusekit.stats event"
    last = events[-1][1]
    assert last["schema"] == rkharness.pack("caching.stats").SCHEMA_VERSION
    assert cache(last, STEP)["info"]["last_run"]["steps_computed"] == 12
    changes = version_after - version_before
    interval = rkharness.pack("routes").PUSH_INTERVAL_S
    assert changes >= 36  # 12 steps x (incr, set_memory, set_entries) at least
    assert len(events) <= elapsed / interval + 2, (len(events), changes, elapsed)


# ---- the throttle, in process ---------------------------------------------------------------

@pytest.mark.hardening
def test_a_burst_from_another_thread_gives_few_pushes_and_the_last_state():
    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").StatsRegistry()
    handle = registry.register("burst", "step")
    loop = asyncio.new_event_loop()
    sent = []
    pusher = routes.StatsPusher(lambda event, data: sent.append((event, data)), loop, interval=0.2,
                                registry=registry)
    registry.add_listener(pusher.notify)

    def burst():
        for _ in range(2000):
            handle.incr("hits")

    async def main():
        worker = threading.Thread(target=burst)
        worker.start()
        while worker.is_alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # longer than the interval: the trailing push happens

    try:
        loop.run_until_complete(main())
    finally:
        pusher.close()
        loop.close()
    assert 1 <= len(sent) <= 20, len(sent)
    event, last = sent[-1]
    assert event == "reusekit.stats" and last["caches"][0]["counters"]["hits"] == 2000
    handle.incr("hits")  # no listener any more after close
    assert len(sent) == pusher.pushes


async def until(done, timeout: float = 10.0) -> None:
    """Run the loop until ``done()`` (a push is sent from a worker thread's snapshot), at most ``timeout`` s."""
    end = time.monotonic() + timeout
    while not done() and time.monotonic() < end:
        await asyncio.sleep(0.01)


@pytest.mark.hardening
def test_a_snapshot_that_waits_on_a_lock_never_holds_the_event_loop():
    """A snapshot waits on the caches' and settings' locks, which a sampling run or a settings change (a
    Redis tier reconnecting) may hold for seconds: the push takes it in a worker thread, the loop goes on
    serving, and the state that changed meanwhile is pushed after it, last."""
    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").StatsRegistry()
    handle = registry.register("slow", "step")
    held = threading.Lock()
    taken = registry.snapshot

    def snapshot():
        with held:
            return taken()

    registry.snapshot = snapshot
    loop = asyncio.new_event_loop()
    sent = []
    pusher = routes.StatsPusher(lambda event, data: sent.append(data), loop, interval=0.0, registry=registry)
    registry.add_listener(pusher.notify)

    async def main():
        held.acquire()
        threading.Timer(1.0, held.release).start()  # the other holder lets go in 1 s
        handle.incr("hits")
        gaps, last = [], time.monotonic()
        while time.monotonic() - last < 2 and len(gaps) < 60:  # the loop's own ticks: a held loop shows here
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if len(gaps) == 10:
                handle.incr("hits")  # a change while the first snapshot waits
        await until(lambda: sent and sent[-1]["caches"][0]["counters"]["hits"] == 2)
        return max(gaps)

    try:
        longest = loop.run_until_complete(main())
    finally:
        pusher.close()
        loop.close()
    assert longest < 0.5, longest  # not the 1 s the snapshot waited
    assert sent[-1]["caches"][0]["counters"]["hits"] == 2 and len(sent) <= 2


@pytest.mark.hardening
def test_pushed_and_served_snapshots_are_strict_json_whatever_a_cache_puts_in_info():
    """One unserialisable event would stop ComfyUI's websocket publish loop for every client."""
    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").StatsRegistry()
    handle = registry.register("odd", "graph")
    handle.set_info("last_run", {"ratio": float("nan"), "inf": float("inf"), (1, 2): "tuple key",
                                 "reasons": ("shape", "dtype"), "device": torch_device()})
    with pytest.raises((TypeError, ValueError)):
        json.dumps(registry.snapshot(), allow_nan=False)
    loop = asyncio.new_event_loop()
    sent = []
    pusher = routes.StatsPusher(lambda event, data: sent.append(data), loop, interval=0.0, registry=registry)
    try:
        pusher.notify()
        loop.run_until_complete(until(lambda: sent))
    finally:
        loop.close()
    (data,) = sent
    text = json.dumps(data, allow_nan=False)
    info = json.loads(text)["caches"][0]["info"]["last_run"]
    assert info == {"ratio": None, "inf": None, "(1, 2)": "tuple key", "reasons": ["shape", "dtype"],
                    "device": "cpu"}


@pytest.mark.hardening
def test_a_push_is_scheduled_in_an_empty_context_never_a_copy_of_the_callers():
    """The sampling thread's context variables (a model, say) must not ride along into the event
    loop's callback, where they would live until it runs and be freed on the loop's thread."""
    import contextvars

    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").StatsRegistry()
    handle = registry.register("ctx", "step")
    held = contextvars.ContextVar("rktest_held")
    loop = asyncio.new_event_loop()
    seen = []
    pusher = routes.StatsPusher(lambda event, data: seen.append(held.get(None)), loop, interval=0.0,
                                registry=registry)
    registry.add_listener(pusher.notify)

    def sampling():
        held.set(object())
        handle.incr("calls")

    try:
        worker = threading.Thread(target=sampling)
        worker.start()
        worker.join()
        loop.run_until_complete(until(lambda: seen))
    finally:
        pusher.close()
        loop.close()
    assert seen == [None]


def torch_device():
    import torch

    return torch.device("cpu")


@pytest.mark.hardening
def test_register_where_no_server_runs_adds_nothing(monkeypatch):
    import server as comfy_server_module

    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").REGISTRY
    monkeypatch.setattr(comfy_server_module.PromptServer, "instance", None, raising=False)
    listeners = list(registry._listeners)
    assert routes.register() is False
    assert registry._listeners == listeners and routes._server is None


@pytest.mark.hardening
def test_a_server_without_the_seams_gets_one_warning_and_no_routes(caplog):
    class OldServer:  # a host whose PromptServer lacks routes / send_sync / loop
        pass

    routes = rkharness.pack("routes")
    with caplog.at_level("WARNING", logger="reusekit"):
        assert routes.register(OldServer()) is False
    (record,) = [r for r in caplog.records if r.name == "reusekit"]
    assert "routes, send_sync, loop" in record.getMessage() and routes._server is None


@pytest.mark.hardening
def test_a_post_from_another_site_or_not_sent_as_json_changes_nothing():
    """A page of another site can send a form or a plain-text body without a CORS preflight: the routes
    take only JSON bodies (which a browser sends cross-site only after a preflight ComfyUI answers only
    with --enable-cors-header) and refuse a browser's cross-site request."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    routes = rkharness.pack("routes")
    settings = rkharness.pack("caching.settings").SETTINGS
    app = web.Application()
    app.router.add_post("/reusekit/settings", routes.post_settings)
    app.router.add_post("/reusekit/clear", routes.post_clear)
    key, before = "conditioning.max_entries", settings.get("conditioning.max_entries")
    body = json.dumps({key: 3})

    async def main():
        async with TestClient(TestServer(app)) as client:
            answers = []
            for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                            {}, {"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site",
                                 "Origin": "http://elsewhere.example"}):
                response = await client.post("/reusekit/settings", data=body, headers=headers)
                answers.append((response.status, (await response.json())["error"], settings.get(key)))
            response = await client.post("/reusekit/clear", data=json.dumps({"all": True}),
                                         headers={"Content-Type": "text/plain"})
            answers.append((response.status, (await response.json())["error"], None))
            response = await client.post("/reusekit/settings", data=body,
                                         headers={"Content-Type": "application/json", "Sec-Fetch-Site": "same-origin"})
            return answers, response.status, settings.get(key)

    try:
        answers, status, after = asyncio.run(main())
    finally:
        settings.set(key, before)
    assert [a[0] for a in answers] == [415, 415, 415, 403, 415]
    assert all(a[2] in (before, None) for a in answers)
    assert "Content-Type: application/json" in answers[0][1] and "another site" in answers[3][1]
    assert status == 200 and after == 3


HOLD_S = 5.0  # how long the sampling run holds the cache's lock while a client asks to clear it


@pytest.mark.hardening
def test_a_clear_that_waits_on_the_sampling_thread_does_not_block_the_event_loop():
    """The cache's lock is held elsewhere (a sampling run) while a client asks to clear it: the clear
    waits in a worker thread and the stats route keeps answering at once."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    routes = rkharness.pack("routes")
    registry = rkharness.pack("caching.stats").REGISTRY
    sampling_lock = threading.Lock()

    def clear():
        with sampling_lock:
            pass

    registry.register("rktest.blocking", "step", clear=clear)
    app = web.Application()
    app.router.add_get("/reusekit/stats", routes.get_stats)
    app.router.add_post("/reusekit/clear", routes.post_clear)

    async def main():
        async with TestClient(TestServer(app)) as client:
            sampling_lock.acquire()
            threading.Timer(HOLD_S, sampling_lock.release).start()  # the sampling run ends then
            start = time.monotonic()  # the loop's own clock: a blocked loop shows here
            clearing = asyncio.ensure_future(client.post("/reusekit/clear", json={"cache": "rktest.blocking"}))
            await asyncio.sleep(0.1)
            response = await client.get("/reusekit/stats")
            answered_in = time.monotonic() - start
            assert response.status == 200
            cleared = await clearing
            return answered_in, cleared.status, await cleared.json()

    try:
        answered_in, status, body = asyncio.run(main())
    finally:
        registry.unregister("rktest.blocking")
    # 0.1 s of sleep, then the stats: blocked, they would wait out the hold; a loaded machine (the whole suite
    # beside it) has taken 0.8 s to answer, far from it
    assert answered_in < HOLD_S / 2, answered_in
    assert status == 200 and body["cleared"] == ["rktest.blocking"]
