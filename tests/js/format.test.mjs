// Unit tests of the panel's number formatting and aggregation (node --test; run by tests/test_panel_js.py).
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  aggregate,
  hitRate,
  chartPath,
  counterRows,
  formatBytes,
  formatCount,
  formatCounter,
  formatPercent,
  formatSeconds,
  formatValue,
  humanize,
  lastRunRows,
  memoryRows,
  MemoryHistory,
  niceMax,
  CHART_WAITING,
  chartWaiting,
  offHow,
  offText,
  reasonRows,
  reasonText,
  tierTotals,
} from "../../web/panel/format.mjs";

const MiB = 2 ** 20;

function cache(name, kind, extra = {}) {
  return { name, kind, description: "", clearable: true, entries: 0, counters: {}, hit_rate: null,
    bytes: {}, budgets: {}, time_saved_s: 0, info: {}, ...extra };
}

test("counters named ..._bytes show as bytes, the rest as counts", () => {
  assert.equal(formatCounter("not_read_bytes", 3 * 2 ** 30), "3.0 GiB");
  assert.equal(formatCounter("header_read_bytes", 5664), "5.5 KiB");
  assert.equal(formatCounter("weights_loaded", 1234567), "1,234,567");
  assert.equal(formatCounter("bytes", 2048), "2,048");  // not a ..._bytes counter
});

test("bytes use binary units like the Python side", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1023), "1023 B");
  assert.equal(formatBytes(1024), "1.0 KiB");
  assert.equal(formatBytes(1536), "1.5 KiB");
  assert.equal(formatBytes(512 * MiB), "512.0 MiB");
  assert.equal(formatBytes(3 * 2 ** 30), "3.0 GiB");
  assert.equal(formatBytes(5 * 2 ** 40), "5.0 TiB");
  assert.equal(formatBytes(null), "–");
  assert.equal(formatBytes(Number.NaN), "–");
});

test("percent, seconds and counts", () => {
  assert.equal(formatPercent(null), "–");
  assert.equal(formatPercent(0), "0%");
  assert.equal(formatPercent(1), "100%");
  assert.equal(formatPercent(0.5), "50%");
  assert.equal(formatPercent(0.0123), "1.2%");
  assert.equal(formatPercent(0.9995), "100.0%");
  assert.equal(formatPercent(0.756), "76%");
  assert.equal(formatSeconds(0), "0 ms");
  assert.equal(formatSeconds(0.0123), "12 ms");
  assert.equal(formatSeconds(1.234), "1.23 s");
  assert.equal(formatSeconds(125), "2 min 05 s");
  assert.equal(formatSeconds(3725), "1 h 02 min");
  assert.equal(formatSeconds(undefined), "–");
  assert.equal(formatCount(0), "0");
  assert.equal(formatCount(1234567), "1,234,567");
  assert.equal(formatCount(-1234), "-1,234");
  assert.equal(formatCount(999), "999");
});

test("info values and last-run rows read any JSON", () => {
  assert.equal(humanize("steps_computed"), "steps computed");
  assert.equal(humanize("rebuildReasons"), "rebuild reasons");
  assert.equal(formatValue(true), "yes");
  assert.equal(formatValue(0.123456), "0.1235");
  assert.equal(formatValue(1.5, "seconds"), "1.50 s");
  assert.equal(formatValue(40, "capture_ms"), "40 ms");
  assert.equal(formatValue(2048, "held_bytes"), "2.0 KiB");
  assert.equal(formatValue([]), "none");
  assert.deepEqual(lastRunRows(undefined), []);
  assert.deepEqual(lastRunRows({ steps_computed: 12, steps_skipped: 8, graphs_rebuilt: 2,
    rebuild_reasons: { shape: 1, dtype: 1 }, seconds: 0.5 }), [
    ["steps computed", "12"], ["steps skipped", "8"], ["graphs rebuilt", "2"],
    ["rebuild reasons", "shape 1, dtype 1"], ["seconds", "500 ms"]]);
  assert.deepEqual(lastRunRows("eager: no CUDA"), [["last run", "eager: no CUDA"]]);
});

test("counters: the usual four first, shown at zero, then the rest sorted", () => {
  assert.deepEqual(counterRows(cache("a", "pe", { counters: { replays: 3, hits: 2, bypasses: 1 } })),
    [["hits", 2], ["misses", 0], ["evictions", 0], ["bypasses", 1], ["replays", 3]]);
});

test("memory rows: against the budget, or against the largest unbudgeted row", () => {
  const rows = memoryRows([
    cache("cond", "conditioning", { bytes: { device: 64 * MiB, cpu: 256 * MiB }, budgets: { cpu: 512 * MiB, device: 32 * MiB } }),
    cache("pe", "pe", { bytes: { device: 10 } }),
    cache("graph", "graph", { bytes: { device: 40 } }),
  ]);
  assert.deepEqual(rows.map((r) => [r.cache, r.tier, r.fraction, r.over]), [
    ["cond", "cpu", 0.5, false], ["cond", "device", 1, true], ["pe", "device", 0.25, false], ["graph", "device", 1, false]]);
  const zeroBudget = memoryRows([cache("z", "step", { bytes: { cpu: 0 }, budgets: { cpu: 0 } })]);
  assert.equal(zeroBudget[0].fraction, 0);
});

test("the conditioning hit rate counts what its shared tiers answered, each lookup once", () => {
  // 20 encodes: 5 answered by the memory, 10 of its 15 misses by the disk tier, 1 of the 5 left by Redis
  const tiers = [
    cache("conditioning", "conditioning", { counters: { hits: 5, misses: 15 } }),
    cache("conditioning_disk", "conditioning", { counters: { hits: 10, misses: 5 }, info: { answers_misses_of: "conditioning" } }),
    cache("conditioning_redis", "conditioning", { counters: { hits: 1, misses: 4 }, info: { answers_misses_of: "conditioning" } }),
  ];
  assert.equal(hitRate(tiers), 16 / 20);
  const agg = aggregate({ caches: [...tiers, cache("pe", "pe", { counters: { hits: 30, misses: 10 } })] });
  assert.equal(agg.groups[0].hitRate, 16 / 20);
  assert.equal(agg.hitRate, 46 / 60);
  assert.equal(hitRate(tiers.slice(1)), 11 / 20); // a tier alone: its own lookups
  assert.equal(hitRate([]), null);
});

test("aggregate groups by kind in a fixed order, unknown kinds last, with totals", () => {
  const snap = { schema: 1, caches: [
    cache("wan.pe", "pe", { bytes: { device: 100 }, counters: { hits: 3, misses: 1 } }),
    cache("teacache", "step", { bytes: { device: 50 }, time_saved_s: 2 }),
    cache("cond", "conditioning", { bytes: { cpu: 1000, device: 10 }, budgets: { cpu: 4000 },
      counters: { hits: 1, misses: 3 }, time_saved_s: 0.5 }),
    cache("flux.pe", "pe", { bytes: { device: 20 } }),
    cache("x", "zzz_custom"),
    cache("graphs", "graph", { bytes: { device: 5 } }),
  ] };
  const agg = aggregate(snap);
  assert.deepEqual(agg.groups.map((g) => g.kind), ["conditioning", "pe", "step", "graph", "zzz_custom"]);
  assert.deepEqual(agg.groups[1].caches.map((c) => c.name), ["flux.pe", "wan.pe"]);
  assert.equal(agg.groups[1].bytes, 120);
  assert.equal(agg.groups[1].hitRate, 0.75);
  assert.equal(agg.groups[4].label, "zzz custom");
  assert.equal(agg.totalBytes, 1185);
  assert.equal(agg.timeSaved, 2.5);
  assert.equal(agg.hitRate, 0.5);
  assert.deepEqual(agg.tiers, [{ tier: "cpu", bytes: 1000, budget: 4000, off: null }, { tier: "device", bytes: 185, budget: null, off: null }]);
  assert.deepEqual(aggregate(undefined).groups, []);
  assert.equal(aggregate({ caches: "nope" }).count, 0);
  // the conditioning cache's shared tiers hold files and Redis values, not memory: shown, never summed in
  const shared = aggregate({ caches: [...snap.caches, cache("conditioning_disk", "conditioning", { bytes: { disk: 7000 } })] });
  assert.equal(shared.totalBytes, 1185);
  assert.equal(shared.groups[0].bytes, 1010);
  assert.deepEqual(shared.tiers.map((t) => t.tier), ["cpu", "device", "disk"]);
});

test("tier totals add the budgets that caches declare", () => {
  assert.deepEqual(tierTotals([
    cache("a", "conditioning", { bytes: { cpu: 1 }, budgets: { cpu: 10 } }),
    cache("b", "step", { bytes: { cpu: 2, vram2: 3 }, budgets: { cpu: 5 } }),
  ]), [{ tier: "cpu", bytes: 3, budget: 15, off: null }, { tier: "vram2", bytes: 3, budget: null, off: null }]);
});

test("a tier whose every cache is off is off, with the line that turns it on; one cache on keeps it on", () => {
  const how = 'turn on "conditioning disk enabled" in the panel\'s settings, or start ComfyUI with REUSEKIT_DISK_CACHE=<folder>';
  const disk = cache("conditioning_disk", "conditioning", { bytes: { disk: 0 }, budgets: { disk: 0 }, off: how });
  const redis = cache("conditioning_redis", "conditioning", { bytes: { redis: 0 }, off: "start ComfyUI with REUSEKIT_REDIS_URL=..." });
  const totals = tierTotals([disk, redis, cache("c", "conditioning", { bytes: { cpu: 5 } })]);
  assert.deepEqual(totals.map((t) => [t.tier, t.off]), [["cpu", null], ["disk", how], ["redis", "start ComfyUI with REUSEKIT_REDIS_URL=..."]]);
  const mixed = tierTotals([disk, cache("other", "conditioning", { bytes: { disk: 7 }, off: null })]);
  assert.deepEqual(mixed.map((t) => [t.tier, t.bytes, t.off]), [["disk", 7, null]]);
  assert.deepEqual(tierTotals([cache("x", "pe", { bytes: { disk: 1 }, off: "" })]).map((t) => t.off), [null]);
  assert.equal(offText("disk", how), `disk: off — ${how}`);
  assert.equal(offHow(disk), how);
  assert.equal(offHow(cache("y", "pe")), null);
  assert.equal(offHow(cache("z", "pe", { off: 3 })), null);
});

test("the memory chart waits for its first entry until some point holds a byte", () => {
  assert.equal(chartWaiting([]), true);
  assert.equal(chartWaiting([{ t: 1, total: 0, tiers: { cpu: 0, disk: 0 } }]), true);
  assert.equal(chartWaiting([{ t: 1, total: 0, tiers: { disk: 4 } }]), false); // only a storage tier holds
  assert.equal(chartWaiting([{ t: 1, total: 0, tiers: {} }, { t: 2, total: 9, tiers: { cpu: 9 } }, { t: 3, total: 0, tiers: {} }]), false);
  assert.match(CHART_WAITING, /^Waiting for the first entry/);
});

test("memory history keeps the window (plus the point before it) and ignores time going back", () => {
  const h = new MemoryHistory(60);
  const snap = (n) => ({ caches: [cache("c", "conditioning", { bytes: { cpu: n, device: 1 } })] });
  h.add(0, snap(10));
  h.add(30, snap(20));
  h.add(30, snap(25)); // same time: replaces
  h.add(20, snap(99)); // earlier: ignored
  h.add(100, snap(30));
  assert.deepEqual(h.points.map((p) => [p.t, p.total]), [[30, 26], [100, 31]]);
  assert.deepEqual(h.points[1].tiers, { cpu: 30, device: 1 });
  assert.deepEqual(h.tierNames(), ["cpu", "device"]);
  const off = "set REUSEKIT_DISK_DIR=...";
  const withOff = new MemoryHistory(60);
  withOff.add(0, { caches: [cache("c", "conditioning", { bytes: { cpu: 5 } }),
    cache("d", "conditioning", { bytes: { disk: 0 }, off }), cache("e", "conditioning", { bytes: { redis: 2 }, off })] });
  assert.deepEqual(withOff.tierNames(), ["cpu", "redis"]); // an off tier with nothing in it is no series
  assert.deepEqual(withOff.points[0].tiers, { cpu: 5, redis: 2 }); // what an off tier still holds stays drawn
  const capped = new MemoryHistory(1e9, 3);
  for (let t = 0; t < 10; t += 1) capped.add(t, snap(t));
  assert.deepEqual(capped.points.map((p) => p.t), [7, 8, 9]);
});

test("chart path is a step line scaled into the box, extended to now", () => {
  const opts = { now: 100, windowSeconds: 100, width: 200, height: 50, maxValue: 10 };
  assert.equal(chartPath([], opts), "");
  assert.equal(chartPath([{ t: 0, v: 0 }, { t: 50, v: 10 }], opts), "M 0 50 L 100 50 L 100 0 L 200 0");
  assert.equal(chartPath([{ t: -50, v: 20 }], opts), "M 0 0 L 200 0"); // clamped to the box
  assert.equal(niceMax(0), 1024);
  assert.equal(niceMax(3), 5);
  assert.equal(niceMax(1000), 1000);
  assert.equal(niceMax(1200), 2 * 1024);
  assert.equal(niceMax(56 * 1024), 100 * 1024);
  assert.equal(niceMax(5e6), 5 * MiB);
  assert.equal(niceMax(512 * MiB), 1000 * MiB);
});

test("reasonRows: the top reasons (event, source, reason) with their counts, most first; none without any", () => {
  const c = {
    reasons: [
      { event: "bypass", source: "partial_load", reason: "weights are partially loaded (lowvram)", count: 5 },
      { event: "bypass", source: "text, z_image.ZImageTEModel_", reason: "hooks on encoder module 'x'", count: 1200 },
      { event: "disabled", source: "flux", reason: "another node replaced the patch", count: 2 },
      { event: "refused", source: "", reason: "model: the step cache does not support X models", count: 1 },
    ],
  };
  assert.deepEqual(reasonRows(c), [
    ["1,200×", "bypass (text, z_image.ZImageTEModel_): hooks on encoder module 'x'"],
    ["5×", "bypass (partial_load): weights are partially loaded (lowvram)"],
    ["2×", "disabled (flux): another node replaced the patch"],
  ]);
  assert.deepEqual(reasonRows(c, 1).length, 1);
  assert.deepEqual(reasonRows({}), []);
  assert.deepEqual(reasonRows(undefined), []);
  assert.deepEqual(reasonRows(c, 5).at(-1), ["1×", "refused: model: the step cache does not support X models"]);
  assert.equal(reasonText({ reason: "r" }), ": r");
  assert.equal(reasonText({ event: "fallback", reason: "no CUDA device" }), "fallback: no CUDA device");
  assert.deepEqual(reasonRows({ reasons: [{ event: "bypass", reason: "x" }] }), [["0×", "bypass: x"]]); // no count: 0
});
