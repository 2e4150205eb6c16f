// Unit tests of the old-layout mapping of saved workflows (node --test; run by tests/test_panel_js.py).
import assert from "node:assert/strict";
import { test } from "node:test";

import { OLD_LAYOUTS, keptPrecision, mapOldWidgets } from "../../web/compat/widgets.mjs";

const STEP = [["rule", "combo"], ["threshold", "number"], ["model_type", "combo"], ["start_percent", "number"],
  ["end_percent", "number"], ["max_consecutive_skips", "number"], ["cache_device", "combo"],
  ["residual_mode", "combo"], ["interval_power", "number"], ["first_blocks", "number"]].map(([name, type]) => ({ name, type }));
const KSAMPLER = [["seed", "number"], ["control_after_generate", "combo"], ["steps", "number"], ["cfg", "number"],
  ["sampler_name", "combo"], ["scheduler", "combo"], ["denoise", "number"]].map(([name, type]) => ({ name, type }));

test("a step cache saved before the rename gets rule teacache and its rel_l1_thresh as threshold", () => {
  const saved = ["auto", 0.4, 0.0, 1.0, 0, "device", "extrapolate"];  // e4abf85's step_cache_flux.json
  assert.deepEqual(mapOldWidgets(OLD_LAYOUTS.ReuseKitTeaCache, STEP, saved),
    ["teacache", 0.4, "auto", 0.0, 1.0, 0, "device", "extrapolate", 1.0, 1]);
});

test("a step cache saved before residual_mode reused the residual", () => {
  const saved = ["flux", 0.25, 0.1, 0.9, 2, "cpu"];
  assert.deepEqual(mapOldWidgets(OLD_LAYOUTS.ReuseKitTeaCache, STEP, saved),
    ["teacache", 0.25, "flux", 0.1, 0.9, 2, "cpu", "reuse", 1.0, 1]);
});

test("the Cached KSampler's own widgets stay, its cache widgets are mapped", () => {
  const saved = [7, "fixed", 20, 3.5, "euler", "simple", 1.0, "auto", 0.6, 0.0, 1.0, 0, "device", "reuse"];
  assert.deepEqual(mapOldWidgets(OLD_LAYOUTS.ReuseKitCachedKSampler, [...KSAMPLER, ...STEP], saved),
    [7, "fixed", 20, 3.5, "euler", "simple", 1.0, "teacache", 0.6, "auto", 0.0, 1.0, 0, "device", "reuse", 1.0, 1]);
});

test("today's layout, the ones before interval_power and first_blocks and unknown layouts are left to the page", () => {
  const spec = OLD_LAYOUTS.ReuseKitTeaCache;
  assert.equal(mapOldWidgets(spec, STEP, ["first_block", 0.2, "auto", 0.0, 1.0, 0, "device", "reuse", 1.0, 3]), null);
  // saved before interval_power or first_blocks was appended: the page puts them in order, with defaults
  assert.equal(mapOldWidgets(spec, STEP, ["auto", 0.4, "auto", 0.0, 1.0, 0, "device", "extrapolate", 1.3]), null);
  assert.equal(mapOldWidgets(spec, STEP, ["auto", 0.4, "auto", 0.0, 1.0, 0, "device", "extrapolate"]), null);
  assert.equal(mapOldWidgets(spec, STEP, ["auto", 0.4, 0.0]), null);
  assert.equal(mapOldWidgets(spec, STEP, [0.4, "auto", 0.0, 1.0, 0, "device", "reuse"]), null);  // types do not fit
  assert.equal(mapOldWidgets(spec, STEP, undefined), null);
  assert.equal(mapOldWidgets(undefined, STEP, [1]), null);
});

test("the conditioning settings saved with device_hot_negatives drop it instead of shifting it onto clear", () => {
  const widgets = [["global_mode", "toggle"], ["budget_mib", "number"], ["max_entries", "number"], ["clear", "toggle"]]
    .map(([name, type]) => ({ name, type }));
  assert.deepEqual(mapOldWidgets(OLD_LAYOUTS.ReuseKitConditioningCacheSettings, widgets, [true, 256, 64, true, false]),
    [true, 256, 64, false]);
});

test("a number widget rounding finer than its step keeps the round's decimals", () => {
  const threshold = { type: "number", options: { round: 0.0001, step2: 0.01, precision: 2 } };
  assert.equal(keptPrecision(threshold), 4);
  assert.equal(keptPrecision({ type: "number", options: { round: 0.0001, precision: 4 } }), null);
  assert.equal(keptPrecision({ type: "number", options: { step2: 0.01, precision: 2 } }), null);  // no round
  assert.equal(keptPrecision({ type: "combo", options: { round: 0.01 } }), null);
  assert.equal(keptPrecision({ type: "number", options: { round: 0.01 } }), 2);
});
