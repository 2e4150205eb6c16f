// Workflows saved with a node's old inputs load with their values on the right widgets (README
// "Compatibility"). The page stores widget values by position (`widgets_values`), so a renamed, removed or
// inserted input shifts every value after it. OLD_LAYOUTS lists, per node id, the widget names a node had
// before, from `start` (today's first widget of the changed part; the widgets before it are unchanged):
// a saved list of exactly that length, whose values fit today's widgets' types, is put back by name.
// `renamed` maps an old name to today's; `meant` gives what an input the layout lacked meant then; `added`,
// the inputs added at the end since (a save from before one loads by position, the page giving it its
// default), what they mean for every old layout.
// Python keeps the same facts for API prompts (nodes/step_cache.py OLD_MEANING, nodes/compat.py).

const STEP_CACHE_V1 = ["model_type", "rel_l1_thresh", "start_percent", "end_percent", "max_consecutive_skips",
  "cache_device"];  // 97c43a2 (2026-11-29): the first step cache, TeaCache only, the residual reused
const STEP_CACHE = {
  start: "rule",
  renamed: { rel_l1_thresh: "threshold" },  // a7ea1af (2026-12-01) renamed it and put `rule` first
  // 2026-12-04: 1 is the fixed beat every earlier save ran; 1 is First-Block's one block (first_blocks)
  added: { interval_power: 1.0, first_blocks: 1 },
  layouts: [
    { names: STEP_CACHE_V1, meant: { rule: "teacache", residual_mode: "reuse" } },
    { names: [...STEP_CACHE_V1, "residual_mode"], meant: { rule: "teacache" } },  // 95a72a3..a7ea1af
  ],
};

export const OLD_LAYOUTS = {
  ReuseKitTeaCache: STEP_CACHE,
  ReuseKitCachedKSampler: STEP_CACHE,
  ReuseKitConditioningCacheSettings: {  // d91176a (2026-11-30) removed device_hot_negatives before `clear`
    start: "global_mode",
    renamed: {},
    layouts: [{ names: ["global_mode", "budget_mib", "max_entries", "device_hot_negatives", "clear"], meant: {} }],
  },
};

const TYPES = { number: "number", slider: "number", combo: "string", text: "string", string: "string",
  customtext: "string", toggle: "boolean", boolean: "boolean" };

function fits(widget, value) {
  const want = TYPES[widget.type];
  return want === undefined || typeof value === want;
}

// Today's widget values for a node saved with an old layout, or null when `saved` is not one (today's
// layout, or one this table does not know: the page's own loading stands). `widgets`: today's widgets in
// order, as {name, type}.
export function mapOldWidgets(spec, widgets, saved) {
  if (!spec || !Array.isArray(saved) || saved.length === widgets.length) return null;
  const start = widgets.findIndex((w) => w.name === spec.start);
  if (start < 0) return null;
  for (const layout of spec.layouts) {
    if (start + layout.names.length !== saved.length) continue;
    const byName = { ...spec.added, ...layout.meant };
    layout.names.forEach((name, i) => { byName[spec.renamed[name] ?? name] = saved[start + i]; });
    const mapped = widgets.map((w, i) => (i < start ? saved[i] : byName[w.name]));
    if (widgets.every((w, i) => i < start || (w.name in byName && fits(w, mapped[i])))) return mapped;
  }
  return null;
}

// A number widget whose input rounds finer than its step (the step cache's threshold: round 0.0001, step
// 0.01) keeps the round's decimals: the page rounds a typed value to `options.precision`, which it sets
// from the step, so 0.5839 (a default the run's log names, README "Compatibility") became 0.58. Returns
// the precision to set, or null to leave the widget as it is.
export function keptPrecision(widget) {
  const round = widget?.options?.round;
  if (widget?.type !== "number" || typeof round !== "number" || !(round > 0)) return null;
  const decimals = Math.max(0, Math.ceil(-Math.log10(round) - 1e-9));
  const precision = widget.options.precision;
  return typeof precision === "number" && precision >= decimals ? null : decimals;
}
