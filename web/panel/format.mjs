// ReuseKit panel: number formatting and aggregation of the stats snapshot (pure, no DOM).
// Unit-tested with node's test runner (tests/js). The .mjs suffix keeps ComfyUI from loading this
// file as an extension of its own (it loads every *.js under web/, subfolders included).

export const KIND_ORDER = ["conditioning", "pe", "step", "graph"];
export const KIND_LABELS = {
  conditioning: "Conditioning cache",
  pe: "PE cache",
  step: "Step cache",
  graph: "Graph reuse",
};
export const TIER_ORDER = ["cpu", "device"];
/** Tiers that hold bytes outside this process's memory (the conditioning cache's shared tiers): shown per
 * cache, never added to the memory held. */
export const STORAGE_TIERS = new Set(["disk", "redis"]);

/** A cache's bytes in memory tiers (storage tiers left out). */
function memoryBytes(c) {
  return Object.entries(c.bytes ?? {}).reduce((s, [tier, n]) => s + (STORAGE_TIERS.has(tier) ? 0 : n), 0);
}
export const COUNTER_ORDER = ["hits", "misses", "evictions", "bypasses"];

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

/** Bytes as text in binary units: "0 B", "512 B", "1.5 KiB", "12.0 MiB". */
export function formatBytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${Math.round(value)} B` : `${value.toFixed(1)} ${UNITS[unit]}`;
}

/** A rate in [0, 1] as a percentage; null (nothing looked up yet) as a dash. */
export function formatPercent(rate) {
  if (typeof rate !== "number" || !Number.isFinite(rate)) return "–";
  const pct = rate * 100;
  if (pct === 0 || pct === 100) return `${pct}%`;
  return `${pct.toFixed(pct < 10 || pct > 99 ? 1 : 0)}%`;
}

/** Seconds as "0 ms", "12 ms", "1.25 s", "2 min 05 s", "1 h 02 min". */
export function formatSeconds(s) {
  if (typeof s !== "number" || !Number.isFinite(s)) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(2)} s`;
  const whole = Math.round(s);
  if (whole < 3600) return `${Math.floor(whole / 60)} min ${String(whole % 60).padStart(2, "0")} s`;
  return `${Math.floor(whole / 3600)} h ${String(Math.floor((whole % 3600) / 60)).padStart(2, "0")} min`;
}

/** A count with thousands separators: 1234567 -> "1,234,567". */
export function formatCount(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  const sign = n < 0 ? "-" : "";
  const digits = String(Math.round(Math.abs(n)));
  return sign + digits.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

/** A counter's value as text: bytes for a counter named "..._bytes" (the lazy encoders' not_read_bytes), else a count. */
export function formatCounter(name, value) {
  return /_bytes$/.test(String(name)) ? formatBytes(value) : formatCount(value);
}

/** "steps_computed" -> "steps computed"; "rebuildReasons" -> "rebuild reasons". */
export function humanize(key) {
  return String(key)
    .replace(/([a-z0-9])([A-Z])/g, "$1 $2")
    .replace(/[_.]+/g, " ")
    .trim()
    .toLowerCase();
}

/** A JSON value from a cache's info as short text. */
export function formatValue(value, key = "") {
  if (value === null || value === undefined) return "–";
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (typeof value === "number") {
    if (/(seconds|_s)$/.test(key)) return formatSeconds(value);
    if (/_ms$/.test(key)) return formatSeconds(value / 1000);
    if (/bytes$/.test(key)) return formatBytes(value);
    return Number.isInteger(value) ? formatCount(value) : String(Number(value.toPrecision(4)));
  }
  if (typeof value === "string") return value;
  if (Array.isArray(value)) return value.length ? value.map((v) => formatValue(v)).join(", ") : "none";
  const entries = Object.entries(value);
  if (!entries.length) return "none";
  return entries.map(([k, v]) => `${humanize(k)} ${formatValue(v, k)}`).join(", ");
}

/** Rows [label, text] for a cache's info.last_run (any JSON object; nested objects on one line). */
export function lastRunRows(lastRun) {
  if (lastRun === null || lastRun === undefined) return [];
  if (typeof lastRun !== "object" || Array.isArray(lastRun)) return [["last run", formatValue(lastRun)]];
  return Object.entries(lastRun).map(([k, v]) => [humanize(k), formatValue(v, k)]);
}

/** A reason row ({event, source, reason, count}, the stats' form for every cache) as "event (source): reason". */
export function reasonText(r) {
  const where = r?.source ?? "";
  return `${r?.event ?? ""}${where ? ` (${where})` : ""}: ${r?.reason ?? "?"}`;
}

/** A cache's top `n` reasons (why it bypassed, refused, fell back or was disabled), most frequent first, as
 * rows [count, text]. */
export function reasonRows(cache, n = 3) {
  const rows = Array.isArray(cache?.reasons) ? cache.reasons : [];
  return rows
    .map((r, i) => ({ r, i, count: finite(r?.count) ? r.count : 0 }))
    .sort((a, b) => b.count - a.count || a.i - b.i)
    .slice(0, n)
    .map(({ r, count }) => [`${formatCount(count)}×`, reasonText(r)]);
}

/** What a tier or cache that is off shows: "disk: off — <the line that turns it on>". */
export function offText(label, how) {
  return `${label}: off — ${how}`;
}

/** The line that turns a cache on, where it is off (its `off`); null while it is on. */
export function offHow(cache) {
  return typeof cache?.off === "string" && cache.off ? cache.off : null;
}

function rank(order, value) {
  const i = order.indexOf(value);
  return i === -1 ? order.length : i;
}

/** A cache's counters in display order: the usual four first (shown even at 0), then the rest. */
export function counterRows(cache) {
  const counters = cache?.counters ?? {};
  const rest = Object.keys(counters).filter((k) => !COUNTER_ORDER.includes(k)).sort();
  return [...COUNTER_ORDER, ...rest].map((k) => [k, counters[k] ?? 0]);
}

/**
 * Hit rate of a set of caches (null when nothing was looked up): what they answered over what was asked.
 * A cache asked only what another of the set missed (`info.answers_misses_of`: the conditioning cache's
 * disk and Redis tiers, behind its memory) adds its hits to what was answered but asks nothing new: its
 * lookups are that cache's misses.
 */
export function hitRate(caches) {
  const names = new Set(caches.map((c) => c.name));
  let answered = 0;
  let asked = 0;
  for (const c of caches) {
    const hits = c.counters?.hits ?? 0;
    answered += hits;
    if (!names.has(c.info?.answers_misses_of)) asked += hits + (c.counters?.misses ?? 0);
  }
  return asked ? Math.min(1, answered / asked) : null;
}

/** Memory bars: one per (cache, tier), fraction of the budget (or of the largest bar without one). */
export function memoryRows(caches) {
  const rows = [];
  for (const c of caches) {
    const tiers = new Set([...Object.keys(c.bytes ?? {}), ...Object.keys(c.budgets ?? {})]);
    for (const tier of [...tiers].sort((a, b) => rank(TIER_ORDER, a) - rank(TIER_ORDER, b) || a.localeCompare(b))) {
      const bytes = c.bytes?.[tier] ?? 0;
      const budget = c.budgets?.[tier] ?? null;
      rows.push({ cache: c.name, kind: c.kind, tier, bytes, budget });
    }
  }
  const largest = Math.max(1, ...rows.filter((r) => r.budget === null).map((r) => r.bytes));
  for (const r of rows) {
    const scale = r.budget === null ? largest : r.budget;
    r.fraction = scale > 0 ? Math.min(1, r.bytes / scale) : r.bytes > 0 ? 1 : 0;
    r.over = r.budget !== null && r.bytes > r.budget;
  }
  return rows;
}

/**
 * Per-tier totals with the sum of the budgets that caches declare in that tier, and `off`: where every
 * cache in the tier is off, the line that turns the first on (else null).
 */
export function tierTotals(caches) {
  const tiers = new Map();
  const tier = (name, c) => {
    const t = tiers.get(name) ?? { tier: name, bytes: 0, budget: null, off: undefined };
    const how = offHow(c);
    if (t.off === undefined || (t.off !== null && how === null)) t.off = how;
    tiers.set(name, t);
    return t;
  };
  for (const c of caches) {
    for (const [name, bytes] of Object.entries(c.bytes ?? {})) tier(name, c).bytes += bytes;
    for (const [name, budget] of Object.entries(c.budgets ?? {})) {
      const t = tier(name, c);
      t.budget = (t.budget ?? 0) + budget;
    }
  }
  return [...tiers.values()].sort((a, b) => rank(TIER_ORDER, a.tier) - rank(TIER_ORDER, b.tier) || a.tier.localeCompare(b.tier));
}

/** The snapshot grouped for display: kinds in a fixed order (unknown kinds after), totals. */
export function aggregate(snapshot) {
  const caches = Array.isArray(snapshot?.caches) ? snapshot.caches : [];
  const kinds = new Map();
  for (const c of caches) {
    if (!kinds.has(c.kind)) kinds.set(c.kind, []);
    kinds.get(c.kind).push(c);
  }
  const groups = [...kinds.entries()]
    .sort(([a], [b]) => rank(KIND_ORDER, a) - rank(KIND_ORDER, b) || a.localeCompare(b))
    .map(([kind, list]) => ({
      kind,
      label: KIND_LABELS[kind] ?? humanize(kind),
      caches: [...list].sort((a, b) => a.name.localeCompare(b.name)),
      bytes: list.reduce((s, c) => s + memoryBytes(c), 0),
      hitRate: hitRate(list),
      timeSaved: list.reduce((s, c) => s + (c.time_saved_s ?? 0), 0),
    }));
  return {
    schema: snapshot?.schema ?? null,
    groups,
    tiers: tierTotals(caches),
    totalBytes: caches.reduce((s, c) => s + memoryBytes(c), 0),
    timeSaved: caches.reduce((s, c) => s + (c.time_saved_s ?? 0), 0),
    hitRate: hitRate(caches),
    count: caches.length,
  };
}

/** Memory over time: points {t (s), total, tiers}, kept for the last `windowSeconds`. A tier that is off and
 * holds nothing (disk, Redis not configured) is no series: the settings card says how to turn it on. */
export class MemoryHistory {
  constructor(windowSeconds = 300, maxPoints = 2000) {
    this.windowSeconds = windowSeconds;
    this.maxPoints = maxPoints;
    this.points = [];
  }

  add(t, snapshot) {
    const agg = aggregate(snapshot);
    const tiers = Object.fromEntries(agg.tiers.filter((x) => !x.off || x.bytes > 0).map((x) => [x.tier, x.bytes]));
    const last = this.points[this.points.length - 1];
    if (last && t < last.t) return; // out of order: ignore
    if (last && t === last.t) this.points.pop();
    this.points.push({ t, total: agg.totalBytes, tiers });
    this.trim(t);
  }

  trim(now) {
    const start = now - this.windowSeconds;
    // keep one point before the window so the line reaches its left edge
    let cut = 0;
    while (cut + 1 < this.points.length && this.points[cut + 1].t <= start) cut += 1;
    if (cut) this.points.splice(0, cut);
    if (this.points.length > this.maxPoints) this.points.splice(0, this.points.length - this.maxPoints);
  }

  tierNames() {
    const names = new Set();
    for (const p of this.points) for (const k of Object.keys(p.tiers)) names.add(k);
    return [...names].sort((a, b) => rank(TIER_ORDER, a) - rank(TIER_ORDER, b) || a.localeCompare(b));
  }
}

export const CHART_WAITING = "Waiting for the first entry: the chart starts when a cache holds memory.";

/** True while no point of the memory history holds a byte in any tier: the chart has nothing to draw yet. */
export function chartWaiting(points) {
  return !points.some((p) => p.total > 0 || Object.values(p.tiers ?? {}).some((v) => v > 0));
}

/**
 * An SVG path ("M x y L x y ...") of a step line through points {t, v} over [now - window, now],
 * scaled to width x height with `maxValue` at the top. Empty string without points.
 */
export function chartPath(points, { now, windowSeconds, width, height, maxValue }) {
  if (!points.length) return "";
  const top = maxValue > 0 ? maxValue : 1;
  const x = (t) => Math.max(0, Math.min(width, ((t - (now - windowSeconds)) / windowSeconds) * width));
  const y = (v) => height - Math.max(0, Math.min(1, v / top)) * height;
  const r = (n) => Math.round(n * 10) / 10;
  let d = `M ${r(x(points[0].t))} ${r(y(points[0].v))}`;
  for (let i = 1; i < points.length; i += 1) {
    d += ` L ${r(x(points[i].t))} ${r(y(points[i - 1].v))} L ${r(x(points[i].t))} ${r(y(points[i].v))}`;
  }
  d += ` L ${r(width)} ${r(y(points[points.length - 1].v))}`;
  return d;
}

/** A round axis maximum at or above v bytes: 1, 2 or 5 times a power of ten, in B, KiB, MiB... */
export function niceMax(v) {
  if (!(v > 0)) return 1024;
  const unit = 1024 ** Math.max(0, Math.min(4, Math.floor(Math.log(v) / Math.log(1024))));
  const scaled = v / unit;
  const exp = Math.floor(Math.log10(scaled));
  for (const m of [1, 2, 5, 10]) {
    if (m * 10 ** exp >= scaled) return m * 10 ** exp * unit;
  }
  return 10 ** (exp + 1) * unit;
}

// ---- the step cache's runs: per-cond compute/skip strip and accumulated distance -------------

export const STRIP_MAX_CELLS = 96;
const RUN_SHOWN = new Set(["rule", "threshold", "rel_l1_thresh", "residual_mode", "model_type", "variant", "family",
  "model", "outcome", "calls_computed", "calls_skipped", "speedup_calls", "unhooked_calls", "disabled_reason", "conds"]);

const finite = (v) => typeof v === "number" && Number.isFinite(v);

/** A step-cache summary's threshold: `threshold`, else the older `rel_l1_thresh`; null without either. */
export function runThreshold(summary) {
  if (finite(summary?.threshold)) return summary.threshold;
  return finite(summary?.rel_l1_thresh) ? summary.rel_l1_thresh : null;
}

/**
 * A "CCSSC..." pattern in at most `maxCells` cells, each spanning consecutive calls: {start, calls,
 * skipped, state} with state "C" (all computed), "S" (all skipped) or "mixed"; x and w in [0, 1].
 */
export function stripCells(pattern, maxCells = STRIP_MAX_CELLS) {
  const calls = typeof pattern === "string" ? pattern : "";
  const n = calls.length;
  const count = Math.min(n, Math.max(1, maxCells));
  const cells = [];
  for (let i = 0; i < count; i += 1) {
    const start = Math.floor((i * n) / count);
    const end = Math.floor(((i + 1) * n) / count);
    let skipped = 0;
    for (let j = start; j < end; j += 1) if (calls[j] === "S") skipped += 1;
    const span = end - start;
    cells.push({ start, calls: span, skipped, state: skipped === 0 ? "C" : skipped === span ? "S" : "mixed",
      x: start / n, w: span / n });
  }
  return cells;
}

/**
 * Bars of the accumulated distance per cell (the largest of the cell's calls), scaled to
 * width x height, and the threshold's y (null without one). The axis tops at the largest value or the
 * threshold, but at most 3x the threshold so its line stays readable (taller bars are cut: `clipped`
 * counts them); a threshold of 0 (never skip) lies on the floor.
 */
export function traceBars(trace, cells, threshold, { width, height }) {
  const values = cells.map((c) => {
    let v = null;
    for (let j = c.start; j < c.start + c.calls; j += 1) {
      const t = Array.isArray(trace) ? trace[j] : undefined;
      if (finite(t) && (v === null || t > v)) v = t;
    }
    return v;
  });
  const largest = Math.max(0, ...values.filter((v) => v !== null));
  const hasLine = finite(threshold) && threshold >= 0;
  const top = hasLine && threshold > 0 ? Math.min(Math.max(largest, threshold) * 1.1, threshold * 3)
    : largest > 0 ? largest * 1.1 : 1;
  const r = (n) => Math.round(n * 100) / 100;
  const bars = [];
  let clipped = 0;
  values.forEach((v, i) => {
    if (v === null) return;
    if (v > top) clipped += 1;
    const h = Math.max(0, Math.min(1, v / top)) * height;
    const c = cells[i];
    bars.push({ x: r(c.x * width), w: r(c.w * width), y: r(height - h), h: r(h), value: v, state: c.state });
  });
  return { bars, top, clipped, largest, thresholdY: hasLine ? r(height - (threshold / top) * height) : null };
}

/** Why a run deserves a look: `warn` when it skipped nothing (or was disabled), with the reasons. */
export function runFlag(summary) {
  const computed = finite(summary?.calls_computed) ? summary.calls_computed : 0;
  const skipped = finite(summary?.calls_skipped) ? summary.calls_skipped : 0;
  const reasons = [];
  const disabled = summary?.disabled_reason;
  const hasDisabled = disabled !== undefined && disabled !== null && disabled !== "" && disabled !== false;
  if (hasDisabled) reasons.push(`disabled: ${formatValue(disabled, "disabled_reason")}`);
  if (finite(summary?.unhooked_calls) && summary.unhooked_calls > 0) {
    reasons.push(`${formatCount(summary.unhooked_calls)} call${summary.unhooked_calls === 1 ? "" : "s"} not hooked`);
  }
  if (typeof summary?.outcome === "string" && summary.outcome !== "completed") reasons.push(`run ${summary.outcome}`);
  const nothing = skipped === 0 && computed + skipped > 1;
  return { warn: nothing || hasDisabled, title: hasDisabled ? "disabled" : nothing ? "skipped nothing" : null, reasons };
}

/** A step-cache run summary as the panel shows it (any missing field falls back to a dash or nothing). */
export function stepRun(summary, maxCells = STRIP_MAX_CELLS) {
  const threshold = runThreshold(summary);
  const computed = finite(summary?.calls_computed) ? summary.calls_computed : 0;
  const skipped = finite(summary?.calls_skipped) ? summary.calls_skipped : 0;
  // summaries from before the rule input had one rule only: TeaCache's, thresholded by rel_l1_thresh
  const rule = typeof summary?.rule === "string" ? summary.rule : finite(summary?.rel_l1_thresh) ? "teacache" : null;
  const conds = Object.entries(summary?.conds && typeof summary.conds === "object" ? summary.conds : {})
    .map(([label, c]) => {
      const pattern = typeof c?.pattern === "string" ? c.pattern : "";
      const cells = stripCells(pattern, maxCells);
      return { label, pattern, cells, computed: finite(c?.computed) ? c.computed : null,
        skipped: finite(c?.skipped) ? c.skipped : null, trace: Array.isArray(c?.trace) ? c.trace : [] };
    });
  const settings = [
    `rule ${rule ?? "–"}`,
    `threshold ${threshold === null ? "–" : formatValue(threshold)}`,
    summary?.residual_mode,
    [...new Set([summary?.model_type, summary?.variant])].filter((v) => typeof v === "string" && v).join(" · ") || null,
  ].filter(Boolean).map(String);
  const speedup = finite(summary?.speedup_calls) ? summary.speedup_calls : null;
  const rest = summary && typeof summary === "object" && !Array.isArray(summary)
    ? Object.entries(summary).filter(([k]) => !RUN_SHOWN.has(k)).map(([k, v]) => [humanize(k), formatValue(v, k)]) : [];
  return {
    model: typeof summary?.model === "string" ? summary.model : typeof summary?.family === "string" ? summary.family : "model",
    outcome: typeof summary?.outcome === "string" ? summary.outcome : null,
    rule, threshold, settings,
    calls_text: `${formatCount(computed)} of ${formatCount(computed + skipped)} calls computed` +
      (speedup === null ? "" : ` (${speedup.toFixed(2)}x fewer)`),
    flag: runFlag(summary), conds, rest,
  };
}

/** The rule and threshold of a step cache's last run (info.last_run) as one line; null without either. */
export function lastRule(info) {
  const last = info?.last_run;
  if (!last || typeof last !== "object" || Array.isArray(last)) return null;
  const run = stepRun(last);
  if (run.rule === null && run.threshold === null) return null;
  return `Last run: rule ${run.rule ?? "–"}, threshold ${run.threshold === null ? "–" : formatValue(run.threshold)}` +
    (typeof last.model === "string" ? ` (${last.model})` : "");
}

/** The step cache's runs to show, most recent first: its per-model reports, else its last run. */
export function stepRuns(info) {
  const models = info?.models;
  if (models && typeof models === "object" && !Array.isArray(models)) {
    const list = Object.values(models).filter((s) => s && typeof s === "object" && s.conds);
    if (list.length) return list.reverse();
  }
  const last = info?.last_run;
  return last && typeof last === "object" && last.conds && typeof last.conds === "object" ? [last] : [];
}
