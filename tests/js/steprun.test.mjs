// Unit tests of the step cache's run view model: strip cells, distance bars, the "skipped nothing" flag.
import assert from "node:assert/strict";
import { test } from "node:test";

import { lastRule, runFlag, runThreshold, stepRun, stepRuns, stripCells, traceBars } from "../../web/panel/format.mjs";

// A summary as patches/step_cache.py's _finish reports it (H1's newer keys; older ones in the tests below).
function summary(extra = {}) {
  return {
    rule: "magcache", threshold: 0.25, residual_mode: "reuse", model_type: "flux", family: "flux",
    model: "flux 1a2b3c4d", outcome: "completed", calls_computed: 3, calls_skipped: 2, speedup_calls: 5 / 3,
    unhooked_calls: 0, time_saved_s: 0.5, start_percent: 0, end_percent: 1,
    conds: {
      cond: { computed: 3, skipped: 2, pattern: "CCSSC", trace: [0, 0.1, 0.15, 0.2, 0.3] },
      uncond: { computed: 3, skipped: 2, pattern: "CCSSC", trace: [0, 0.05, 0.1, 0.22, 0.31] },
    },
    ...extra,
  };
}

test("a short run's strip is one cell per call, in the run's order", () => {
  const cells = stripCells("CCSSC");
  assert.equal(cells.map((c) => c.state).join(""), "CCSSC");
  assert.deepEqual(cells.map((c) => [c.start, c.calls, c.skipped]), [[0, 1, 0], [1, 1, 0], [2, 1, 1], [3, 1, 1], [4, 1, 0]]);
  assert.deepEqual(cells.map((c) => c.x), [0, 0.2, 0.4, 0.6, 0.8]);
  assert.ok(cells.every((c) => c.w === 0.2));
  assert.deepEqual(stripCells(""), []);
  assert.deepEqual(stripCells(undefined), []);
});

test("a long run's strip stays one line: consecutive calls share a cell, nothing is lost", () => {
  const pattern = "C" + "S".repeat(9) + "CS".repeat(145); // 300 calls
  const cells = stripCells(pattern, 96);
  assert.equal(cells.length, 96);
  assert.equal(cells.reduce((s, c) => s + c.calls, 0), 300);
  assert.equal(cells.reduce((s, c) => s + c.skipped, 0), [...pattern].filter((k) => k === "S").length);
  for (let i = 1; i < cells.length; i += 1) assert.equal(cells[i].start, cells[i - 1].start + cells[i - 1].calls);
  assert.ok(Math.abs(cells.at(-1).x + cells.at(-1).w - 1) < 1e-12);
  assert.equal(cells[0].state, "mixed"); // "CSS" or "CSSS": computed and skipped calls in one cell
  assert.ok(cells.slice(1, 2).every((c) => c.state === "S"));
  assert.ok(cells.slice(4).every((c) => c.state === "mixed"));
  assert.equal(stripCells("CCCC", 96).length, 4); // never more cells than calls
});

test("distance bars: under the threshold line when skipped, the axis keeps the line in view", () => {
  const cells = stripCells("CCSSC");
  const chart = traceBars([0, 0.1, 0.15, 0.2, 0.3], cells, 0.25, { width: 100, height: 10 });
  assert.ok(Math.abs(chart.top - 0.33) < 1e-9); // the largest value, 10% headroom
  assert.equal(chart.thresholdY, Math.round((10 - (0.25 / chart.top) * 10) * 100) / 100);
  assert.deepEqual(chart.bars.map((b) => b.x), [0, 20, 40, 60, 80]);
  assert.deepEqual(chart.bars.map((b) => b.state).join(""), "CCSSC");
  for (const b of chart.bars) {
    assert.equal(b.y + b.h, 10);
    if (b.state === "S") assert.ok(b.y > chart.thresholdY, "a skipped call's bar ends under the line");
  }
  assert.ok(chart.bars[4].y < chart.thresholdY, "the computed call over the threshold rises above it");
  assert.equal(chart.bars[0].h, 0);
  assert.equal(chart.clipped, 0);
});

test("distance bars: a huge value is cut at 3x the threshold; a bin shows its largest; gaps and no threshold", () => {
  const tall = traceBars([0, 5, 0.1], stripCells("CCS"), 0.5, { width: 30, height: 10 });
  assert.equal(tall.top, 1.5);
  assert.equal(tall.clipped, 1);
  assert.equal(tall.bars[1].h, 10);
  assert.equal(tall.largest, 5);
  const binned = traceBars([0.1, 0.4, 0.2, 0.3], stripCells("CSCS", 2), 1, { width: 10, height: 10 });
  assert.deepEqual(binned.bars.map((b) => b.value), [0.4, 0.3]);
  const holes = traceBars([0, null, "x"], stripCells("CCC"), null, { width: 30, height: 10 });
  assert.equal(holes.bars.length, 1);
  assert.equal(holes.thresholdY, null);
  assert.equal(holes.top, 1);
  const never = traceBars([0, 0.2, 0.4], stripCells("CCC"), 0, { width: 30, height: 10 });
  assert.equal(never.thresholdY, 10); // threshold 0: the line on the floor, every bar above it
  assert.ok(Math.abs(never.top - 0.44) < 1e-9);
  assert.equal(never.clipped, 0);
});

test("a run that skipped nothing, or was disabled, is flagged with its reasons", () => {
  assert.deepEqual(runFlag(summary()), { warn: false, title: null, reasons: [] });
  const nothing = runFlag(summary({ calls_computed: 8, calls_skipped: 0, unhooked_calls: 8 }));
  assert.equal(nothing.warn, true);
  assert.equal(nothing.title, "skipped nothing");
  assert.deepEqual(nothing.reasons, ["8 calls not hooked"]);
  const disabled = runFlag(summary({ calls_skipped: 0, disabled_reason: "the last block's patch is not ours" }));
  assert.equal(disabled.title, "disabled");
  assert.deepEqual(disabled.reasons, ["disabled: the last block's patch is not ours"]);
  assert.equal(runFlag(summary({ calls_computed: 1, calls_skipped: 0 })).warn, false); // one call: nothing to skip
  assert.equal(runFlag(summary({ calls_computed: 0, calls_skipped: 0 })).warn, false);
  const interrupted = runFlag(summary({ outcome: "interrupted", unhooked_calls: 1 }));
  assert.deepEqual(interrupted, { warn: false, title: null, reasons: ["1 call not hooked", "run interrupted"] });
  assert.equal(runFlag(summary({ disabled_reason: null })).warn, false);
  assert.equal(runFlag(undefined).warn, false);
});

test("a run's view model: settings, calls, conds in order, the rest for details", () => {
  const run = stepRun(summary({ variant: "kontext" }));
  assert.equal(run.model, "flux 1a2b3c4d");
  assert.deepEqual(run.settings, ["rule magcache", "threshold 0.25", "reuse", "flux · kontext"]);
  assert.equal(run.calls_text, "3 of 5 calls computed (1.67x fewer)");
  assert.equal(run.threshold, 0.25);
  assert.deepEqual(run.conds.map((c) => [c.label, c.pattern, c.cells.length]), [["cond", "CCSSC", 5], ["uncond", "CCSSC", 5]]);
  assert.deepEqual(run.rest, [["time saved s", "500 ms"], ["start percent", "0"], ["end percent", "1"]]);
  assert.equal(run.outcome, "completed");
  assert.deepEqual(stepRun(summary({ variant: "flux" })).settings.at(-1), "flux"); // a variant named as its type: once
});

test("an older summary reads rel_l1_thresh as TeaCache's threshold; missing fields fall back", () => {
  const old = summary({ rule: undefined, threshold: undefined, rel_l1_thresh: 0.4 });
  delete old.rule;
  delete old.threshold;
  assert.equal(runThreshold(old), 0.4);
  const run = stepRun(old);
  assert.equal(run.rule, "teacache");
  assert.equal(run.settings[1], "threshold 0.4");
  assert.ok(!run.rest.some(([k]) => k === "rel l1 thresh"));
  assert.equal(runThreshold({ threshold: 0.1, rel_l1_thresh: 0.4 }), 0.1);
  const bare = stepRun({ conds: { cond: { pattern: "CS" } } });
  assert.equal(bare.rule, null);
  assert.deepEqual(bare.settings, ["rule –", "threshold –"]);
  assert.equal(bare.model, "model");
  assert.equal(bare.calls_text, "0 of 0 calls computed");
  assert.deepEqual(bare.conds[0].trace, []);
  assert.deepEqual(stepRun({ conds: "nope" }).conds, []);
});

test("the step card names the last run's rule and threshold (and its model); nothing without either", () => {
  assert.equal(lastRule({ last_run: summary() }), "Last run: rule magcache, threshold 0.25 (flux 1a2b3c4d)");
  assert.equal(lastRule({ last_run: { rel_l1_thresh: 0.4 } }), "Last run: rule teacache, threshold 0.4");
  assert.equal(lastRule({ last_run: { rule: "first_block" } }), "Last run: rule first_block, threshold –");
  assert.equal(lastRule({ last_run: { threshold: 0 } }), "Last run: rule –, threshold 0");
  assert.equal(lastRule({ last_run: { steps_computed: 3 } }), null); // the test-only probe's report
  assert.equal(lastRule({ last_run: "eager" }), null);
  assert.equal(lastRule(undefined), null);
});

test("the runs shown: one per model, most recent first; else the last run; nothing for other reports", () => {
  const a = summary({ model: "flux aaaaaaaa" });
  const b = summary({ model: "wan bbbbbbbb" });
  assert.deepEqual(stepRuns({ last_run: b, models: { [a.model]: a, [b.model]: b } }).map((s) => s.model), [b.model, a.model]);
  assert.deepEqual(stepRuns({ last_run: a }), [a]);
  assert.deepEqual(stepRuns({ last_run: { steps_computed: 3, steps_skipped: 0 } }), []);
  assert.deepEqual(stepRuns({ models: {}, last_run: "eager" }), []);
  assert.deepEqual(stepRuns(undefined), []);
});
