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

/** Hit rate of a set of caches (null when nothing was looked up). */
export function hitRate(caches) {
  let hits = 0;
  let misses = 0;
  for (const c of caches) {
    hits += c.counters?.hits ?? 0;
    misses += c.counters?.misses ?? 0;
  }
  return hits + misses ? hits / (hits + misses) : null;
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

/** Per-tier totals with the sum of the budgets that caches declare in that tier. */
export function tierTotals(caches) {
  const tiers = new Map();
  for (const c of caches) {
    for (const [tier, bytes] of Object.entries(c.bytes ?? {})) {
      const t = tiers.get(tier) ?? { tier, bytes: 0, budget: null };
      t.bytes += bytes;
      tiers.set(tier, t);
    }
    for (const [tier, budget] of Object.entries(c.budgets ?? {})) {
      const t = tiers.get(tier) ?? { tier, bytes: 0, budget: null };
      t.budget = (t.budget ?? 0) + budget;
      tiers.set(tier, t);
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
      bytes: list.reduce((s, c) => s + Object.values(c.bytes ?? {}).reduce((x, y) => x + y, 0), 0),
      hitRate: hitRate(list),
      timeSaved: list.reduce((s, c) => s + (c.time_saved_s ?? 0), 0),
    }));
  return {
    schema: snapshot?.schema ?? null,
    groups,
    tiers: tierTotals(caches),
    totalBytes: caches.reduce((s, c) => s + Object.values(c.bytes ?? {}).reduce((x, y) => x + y, 0), 0),
    timeSaved: caches.reduce((s, c) => s + (c.time_saved_s ?? 0), 0),
    hitRate: hitRate(caches),
    count: caches.length,
  };
}

/** Memory over time: points {t (s), total, tiers}, kept for the last `windowSeconds`. */
export class MemoryHistory {
  constructor(windowSeconds = 300, maxPoints = 2000) {
    this.windowSeconds = windowSeconds;
    this.maxPoints = maxPoints;
    this.points = [];
  }

  add(t, snapshot) {
    const agg = aggregate(snapshot);
    const tiers = Object.fromEntries(agg.tiers.map((x) => [x.tier, x.bytes]));
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
