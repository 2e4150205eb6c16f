"""What the panel's live push costs the thread that reports stats (the sampling thread).

Side by side in one run: stats changes with no listener, and with the panel's StatsPusher attached
(its event loop running in another thread, as ComfyUI's server loop does); how many websocket
events a burst of changes becomes; and how long one JSON-ready snapshot takes with 4 and 40 caches.

    .venv/bin/python bench/panel_push.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_pack():
    """The pack as a package named ``reusekit`` (routes and caching need no ComfyUI at import)."""
    spec = importlib.util.spec_from_file_location("reusekit", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["reusekit"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("reusekit.routes"), importlib.import_module("reusekit.caching.stats")


def changes(handle, n: int) -> float:
    """Seconds per change over n changes, as a cache reports them during sampling."""
    start = time.perf_counter()
    for i in range(n):
        if i % 3 == 0:
            handle.incr("hits")
        elif i % 3 == 1:
            handle.set_memory("device", i, 1 << 30)
        else:
            handle.set_entries(i)
    return (time.perf_counter() - start) / n


def main() -> None:
    routes, stats = load_pack()
    n, repeats = 60_000, 5

    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    sent = []

    def send(event, data):
        sent.append(len(json.dumps(data)))  # what send_sync's consumer would serialise

    plain_reg, pushed_reg = stats.StatsRegistry(), stats.StatsRegistry()
    plain = plain_reg.register("bench", "step")
    pushed = pushed_reg.register("bench", "step")
    pusher = routes.StatsPusher(send, loop, interval=routes.PUSH_INTERVAL_S, registry=pushed_reg)
    pushed_reg.add_listener(pusher.notify)

    without, with_push = [], []
    burst_start = time.monotonic()
    for _ in range(repeats):  # interleaved, so both see the same machine load
        without.append(changes(plain, n))
        with_push.append(changes(pushed, n))
    burst_s = time.monotonic() - burst_start
    time.sleep(routes.PUSH_INTERVAL_S * 2)  # the trailing push
    loop.call_soon_threadsafe(loop.stop)
    loop_thread.join(5)
    total_changes = n * repeats

    def snapshot_ms(caches: int) -> float:
        reg = stats.StatsRegistry()
        for i in range(caches):
            h = reg.register(f"cache{i}", ("conditioning", "pe", "step", "graph")[i % 4])
            h.incr("hits", 10)
            h.set_memory("cpu", 1 << 20, 1 << 29)
            h.set_info("last_run", {"steps_computed": 12, "steps_skipped": 8, "reasons": {"shape": 1}})
        times = []
        for _ in range(200):
            start = time.perf_counter()
            routes.json_ready(reg.snapshot())
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    t_plain, t_push = statistics.median(without), statistics.median(with_push)
    ratio = t_push / t_plain
    snap4, snap40 = snapshot_ms(4), snapshot_ms(40)
    print(f"{'measure':44} {'value':>12}")
    print(f"{'stats change, no listener (us)':44} {t_plain * 1e6:12.2f}")
    print(f"{'stats change, panel push attached (us)':44} {t_push * 1e6:12.2f}")
    print(f"{'ratio with/without push':44} {ratio:12.2f}")
    print(f"{'changes in the burst':44} {total_changes:12d}")
    print(f"{'burst duration (s)':44} {burst_s:12.2f}")
    print(f"{'websocket events sent for the burst':44} {len(sent):12d}")
    print(f"{'bytes per event':44} {(statistics.median(sent) if sent else 0):12.0f}")
    print(f"{'snapshot + json_ready, 4 caches (ms)':44} {snap4:12.3f}")
    print(f"{'snapshot + json_ready, 40 caches (ms)':44} {snap40:12.3f}")
    print(f"RESULT panel_push change_cost_ratio={ratio:.2f} events={len(sent)} changes={total_changes} "
          f"burst_s={burst_s:.1f} snapshot_ms_4={snap4:.3f} snapshot_ms_40={snap40:.3f}")


if __name__ == "__main__":
    main()
