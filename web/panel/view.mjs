// ReuseKit panel: the DOM of the cache panel. Builds elements with textContent only (cache names and
// facts come from the server); numbers are formatted by format.mjs.
import {
  aggregate,
  CHART_WAITING,
  chartPath,
  chartWaiting,
  counterRows,
  formatBytes,
  formatCount,
  formatCounter,
  formatPercent,
  formatSeconds,
  formatValue,
  humanize,
  lastRule,
  lastRunRows,
  memoryRows,
  niceMax,
  offHow,
  offText,
  reasonRows,
  runFlag,
  stepRun,
  stepRuns,
  traceBars,
} from "./format.mjs";

const STYLE_ID = "reusekit-panel-style";
const BUDGET_KEY = "conditioning.budget_mib";
const CHART = { width: 300, height: 70 };
const TIER_COLORS = { total: "var(--p-primary-color, #4f9dff)", cpu: "#e0a83a", device: "#5ec27a" };
const RUN_CHART = { width: 1000, height: 36 };
// the heading over a card's top reasons, by kind
const REASONS_TITLE = {
  conditioning: "Why encodes ran uncached or unshared",
  pe: "Why PE tables were built uncached",
  step: "Why steps were computed or runs refused",
  graph: "Why forwards ran eagerly",
};

const CSS = `
.rk-panel { padding: 8px 10px 16px; font-size: 12px; color: var(--fg-color, #ddd); overflow-y: auto; height: 100%; box-sizing: border-box; }
.rk-panel h2 { font-size: 14px; margin: 0; }
.rk-panel h3 { font-size: 12px; margin: 12px 0 4px; text-transform: uppercase; letter-spacing: .04em; opacity: .75; }
.rk-head { display: flex; align-items: center; justify-content: space-between; gap: 6px; }
.rk-sub { opacity: .75; margin: 2px 0 6px; }
.rk-warn { color: #f0b400; margin: 4px 0; }
.rk-btn { background: var(--comfy-input-bg, #222); color: inherit; border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 2px 8px; cursor: pointer; font-size: 11px; }
.rk-btn:hover { filter: brightness(1.25); }
.rk-btn.rk-danger { border-color: #c0504d; }
.rk-kpis { display: grid; grid-template-columns: repeat(3, 1fr); gap: 6px; margin: 6px 0; }
.rk-kpi { background: var(--comfy-input-bg, #222); border-radius: 4px; padding: 4px 6px; }
.rk-kpi b { display: block; font-size: 14px; }
.rk-bar { display: grid; grid-template-columns: 1fr auto; gap: 2px 6px; margin: 3px 0; }
.rk-bar-track { grid-column: 1 / span 2; height: 6px; background: var(--comfy-input-bg, #222); border-radius: 3px; overflow: hidden; }
.rk-bar-fill { height: 100%; background: var(--p-primary-color, #4f9dff); }
.rk-bar-fill.rk-nobudget { opacity: .45; }
.rk-bar-fill.rk-over { background: #c0504d; }
.rk-chart svg { width: 100%; height: 70px; background: var(--comfy-input-bg, #222); border-radius: 4px; }
.rk-legend { display: flex; gap: 10px; opacity: .8; }
.rk-legend i { display: inline-block; width: 10px; height: 2px; vertical-align: middle; margin-right: 3px; }
.rk-card { border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 6px; margin: 6px 0; }
.rk-card-head { display: flex; justify-content: space-between; align-items: center; gap: 6px; }
.rk-card-head span { word-break: break-all; font-weight: 600; }
.rk-desc { opacity: .7; margin: 2px 0 4px; }
.rk-grid { display: grid; grid-template-columns: repeat(4, 1fr); gap: 2px 6px; margin: 4px 0; }
.rk-grid div { display: flex; flex-direction: column; min-width: 0; }
.rk-grid small { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.rk-grid small, .rk-rows small { opacity: .7; }
.rk-rows { display: grid; grid-template-columns: auto 1fr; gap: 1px 8px; margin-top: 4px; }
.rk-setting { display: grid; grid-template-columns: 1fr auto; gap: 2px 6px; align-items: center; margin: 4px 0; }
.rk-setting input, .rk-setting select { width: 90px; background: var(--comfy-input-bg, #222); color: inherit; border: 1px solid var(--border-color, #444); border-radius: 4px; padding: 1px 4px; }
.rk-setting .rk-error { grid-column: 1 / span 2; color: #e06c6c; }
.rk-empty { opacity: .75; margin: 8px 0; }
.rk-off { margin: 3px 0; opacity: .85; }
.rk-chart-wait { display: flex; align-items: center; justify-content: center; text-align: center; height: 70px; margin: 0; padding: 0 8px; background: var(--comfy-input-bg, #222); border-radius: 4px; }
.rk-run { border-left: 3px solid var(--border-color, #444); padding: 2px 0 4px 6px; margin: 6px 0; }
.rk-run.rk-run-warn { border-left-color: #f0b400; background: rgba(240, 180, 0, .07); }
.rk-run-head { display: flex; justify-content: space-between; gap: 6px; font-weight: 600; }
.rk-run-badge { color: #f0b400; font-weight: 600; white-space: nowrap; }
.rk-run-reasons { color: #f0b400; }
.rk-cond { display: grid; grid-template-columns: 52px 1fr; gap: 1px 6px; align-items: center; margin-top: 3px; }
.rk-cond small { opacity: .75; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-size: 10px; }
.rk-legend-run { opacity: .75; font-size: 11px; }
.rk-legend-run svg { vertical-align: middle; margin: 0 3px 0 6px; }
.rk-legend-run svg:first-child { margin-left: 0; }
.rk-strip { width: 100%; height: 8px; display: block; }
.rk-trace { width: 100%; height: 28px; display: block; background: var(--comfy-input-bg, #222); border-radius: 2px; }
.rk-panel rect.rk-C { fill: #6b7a99; }
.rk-panel rect.rk-S, .rk-panel rect.rk-mixed { fill: #5ec27a; }
.rk-trace line { stroke: #e06c6c; stroke-width: 1.5; stroke-dasharray: 4 3; }
.rk-run details { opacity: .85; margin-top: 3px; }
`;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

function ensureStyle() {
  if (document.getElementById(STYLE_ID)) return;
  document.head.append(el("style", { id: STYLE_ID, text: CSS }));
}

function bar(label, bytes, budget, fraction, over, attrs = {}) {
  const value = budget === null || budget === undefined ? formatBytes(bytes) : `${formatBytes(bytes)} / ${formatBytes(budget)}`;
  const fill = el("div", {
    class: `rk-bar-fill${budget === null || budget === undefined ? " rk-nobudget" : ""}${over ? " rk-over" : ""}`,
  });
  fill.style.width = `${Math.round(fraction * 1000) / 10}%`;
  return el("div", { class: "rk-bar", "data-bytes": bytes, ...attrs },
    el("span", { text: label }), el("span", { text: value }), el("div", { class: "rk-bar-track" }, fill));
}

// A button that asks once more before acting: the first press arms it for a few seconds.
function confirmButton(label, confirmLabel, action, attrs = {}) {
  let timer = null;
  const button = el("button", { class: "rk-btn rk-danger", type: "button", text: label, ...attrs });
  button.addEventListener("click", async () => {
    if (!timer) {
      button.textContent = confirmLabel;
      button.dataset.armed = "true";
      timer = setTimeout(() => {
        timer = null;
        button.textContent = label;
        delete button.dataset.armed;
      }, 4000);
      return;
    }
    clearTimeout(timer);
    timer = null;
    button.textContent = label;
    delete button.dataset.armed;
    button.disabled = true;
    try {
      await action();
    } finally {
      button.disabled = false;
    }
  });
  return button;
}

// One cond of a step-cache run: its compute/skip strip and its accumulated distance against the threshold.
function condView(cond, threshold) {
  const { width, height } = RUN_CHART;
  const strip = svg("svg", { class: "rk-strip", viewBox: `0 0 ${width} 8`, preserveAspectRatio: "none",
    "data-rk": "strip", "data-calls": cond.pattern.length });
  const gap = cond.cells.length > 1 ? Math.min(2, (width / cond.cells.length) * 0.15) : 0;
  for (const c of cond.cells) {
    const cell = svg("rect", { class: `rk-${c.state}`, x: c.x * width, width: Math.max(0.5, c.w * width - gap), y: 0, height: 8,
      "data-start": c.start, "data-calls": c.calls, "data-skipped": c.skipped, "data-state": c.state });
    if (c.state === "mixed") cell.setAttribute("fill-opacity", String(0.3 + (0.7 * c.skipped) / c.calls));
    const tip = svg("title");
    tip.textContent = `calls ${c.start + 1}-${c.start + c.calls}: ${c.skipped} skipped`;
    cell.append(tip);
    strip.append(cell);
  }
  const row = el("div", { class: "rk-cond", "data-rk-cond": cond.label },
    el("small", { text: cond.label, title: `${cond.label}: ${cond.computed ?? "–"} computed, ${cond.skipped ?? "–"} skipped` }), strip);
  if (cond.trace.length) {
    const chart = traceBars(cond.trace, cond.cells, threshold, { width, height });
    const box = svg("svg", { class: "rk-trace", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
      "data-rk": "trace", "data-top": chart.top });
    for (const b of chart.bars) {
      box.append(svg("rect", { class: `rk-${b.state}`, x: b.x, width: Math.max(0.5, b.w - gap), y: b.y, height: b.h,
        "data-value": b.value }));
    }
    if (chart.thresholdY !== null) {
      box.append(svg("line", { x1: 0, x2: width, y1: chart.thresholdY, y2: chart.thresholdY,
        "vector-effect": "non-scaling-stroke", "data-rk": "threshold" }));
    }
    const note = `max ${formatValue(Number(chart.largest.toPrecision(3)))}${chart.clipped ? "+" : ""}`;
    const tip = svg("title");
    tip.textContent = `accumulated distance per call, largest ${formatValue(chart.largest)}` +
      (chart.clipped ? ` (${chart.clipped} bar${chart.clipped === 1 ? "" : "s"} cut at the top)` : "") +
      (threshold === null ? "" : `; dashed line: threshold ${formatValue(threshold)}`);
    box.append(tip);
    row.append(el("small", { text: note, title: tip.textContent }), box);
  }
  return row;
}

// What the strips and bars mean, once above the runs.
function runLegend() {
  const swatch = (cls) => {
    const box = svg("svg", { width: 9, height: 7 });
    box.append(svg("rect", { class: cls, width: 9, height: 7 }));
    return box;
  };
  return el("div", { class: "rk-legend-run rk-strip-legend" },
    swatch("rk-C"), document.createTextNode("computed"), swatch("rk-S"), document.createTextNode("skipped"),
    document.createTextNode(" · bars: accumulated distance, dashed: threshold"));
}

// A step-cache run: its settings, calls, the strip and distance per cond, and a warning when it skipped nothing.
function runView(summary) {
  const run = stepRun(summary);
  const head = el("div", { class: "rk-run-head" }, el("span", { text: run.model }));
  if (run.flag.warn) head.append(el("span", { class: "rk-run-badge", "data-rk": "run-flag", text: `⚠ ${run.flag.title}` }));
  const box = el("div", { class: `rk-run${run.flag.warn ? " rk-run-warn" : ""}`, "data-rk": "step-run",
    "data-rk-model": run.model, "data-warn": run.flag.warn ? "true" : "false" },
  head,
  el("div", { class: "rk-sub", "data-rk": "run-settings", text: [...run.settings, run.outcome].filter(Boolean).join(" · ") }),
  el("div", { "data-rk": "run-calls", text: run.calls_text }));
  if (run.flag.reasons.length) box.append(el("div", { class: "rk-run-reasons", "data-rk": "run-reasons", text: run.flag.reasons.join(" · ") }));
  for (const cond of run.conds) box.append(condView(cond, run.threshold));
  if (run.rest.length) {
    const rows = el("div", { class: "rk-rows" });
    for (const [k, v] of run.rest) rows.append(el("small", { text: k }), el("span", { text: v }));
    box.append(el("details", {}, el("summary", { text: "details" }), rows));
  }
  return box;
}

/**
 * Mounts the panel in `root`. `actions`: { clear(name|null), setSetting(key, value) -> Promise that
 * rejects with an Error carrying the server's message }. `history` is a MemoryHistory.
 */
export function createPanel(root, { actions, history }) {
  ensureStyle();
  // settingErrors: the server's message per setting, kept until that setting applies (a push rebuilds rows)
  const state = { snapshot: null, settings: null, error: null, settingErrors: new Map() };
  const status = el("div", { class: "rk-sub", "data-rk": "status", text: "Loading…" });
  const kpis = el("div", { class: "rk-kpis" });
  const tiers = el("div", { "data-rk": "tiers" });
  const chartBox = el("div", { class: "rk-chart" });
  const settingsBox = el("div", { "data-rk": "settings" });
  const groups = el("div", { "data-rk": "groups" });
  const clearAll = confirmButton("Clear all", "Confirm: clear all", () => actions.clear(null), { "data-rk": "clear-all" });
  const panel = el("div", { class: "rk-panel", "data-rk": "panel" },
    el("div", { class: "rk-head" }, el("h2", { text: "ReuseKit caches" }), clearAll),
    status, kpis,
    el("h3", { text: "Memory" }), tiers,
    el("h3", { text: "Memory over time" }), chartBox,
    groups,
    settingsBox);
  root.replaceChildren(panel);
  // run views by their summary's JSON: a push that leaves a run unchanged reuses its elements
  let runViews = new Map();
  let nextRunViews = new Map();

  function cachedRun(summary) {
    const key = JSON.stringify(summary);
    const view = (!nextRunViews.has(key) && runViews.get(key)) || runView(summary);
    nextRunViews.set(key, view);
    return view;
  }

  function renderChart() {
    if (chartWaiting(history.points)) {
      chartBox.replaceChildren(el("div", { class: "rk-empty rk-chart-wait", "data-rk": "chart-waiting", text: CHART_WAITING }));
      return;
    }
    const now = Date.now() / 1000;
    // the x axis spans the history it has, up to the window: a fresh page's chart is not a sliver
    const first = history.points.length ? history.points[0].t : now;
    const windowSeconds = Math.min(history.windowSeconds, Math.max(10, now - first));
    const names = history.tierNames();
    const maxValue = niceMax(Math.max(0, ...history.points.map((p) => p.total)));
    const box = svg("svg", { viewBox: `0 0 ${CHART.width} ${CHART.height}`, preserveAspectRatio: "none", "data-rk": "chart" });
    for (const name of ["total", ...names]) {
      const points = history.points.map((p) => ({ t: p.t, v: name === "total" ? p.total : p.tiers[name] ?? 0 }));
      const d = chartPath(points, { now, windowSeconds, width: CHART.width, height: CHART.height, maxValue });
      if (d) {
        box.append(svg("path", {
          d, fill: "none", stroke: TIER_COLORS[name] ?? "#aaa", "stroke-width": name === "total" ? 2 : 1.2,
          "vector-effect": "non-scaling-stroke", "data-series": name,
        }));
      }
    }
    const legend = el("div", { class: "rk-legend" });
    for (const name of ["total", ...names]) {
      const swatch = el("i");
      swatch.style.background = TIER_COLORS[name] ?? "#aaa";
      legend.append(el("span", {}, swatch, document.createTextNode(name)));
    }
    const span = windowSeconds < 90 ? `${Math.round(windowSeconds)} s` : `${Math.round(windowSeconds / 60)} min`;
    legend.append(el("span", { text: `max ${formatBytes(maxValue)} · last ${span}` }));
    chartBox.replaceChildren(box, legend);
  }

  function renderSettings() {
    const settings = state.settings;
    if (!settings || !Object.keys(settings).length) {
      settingsBox.replaceChildren();
      return;
    }
    if (settingsBox.contains(document.activeElement)) return; // never overwrite what the user types
    const keys = Object.keys(settings).sort((a, b) => (a === BUDGET_KEY ? -1 : b === BUDGET_KEY ? 1 : a.localeCompare(b)));
    const rows = keys.map((key) => settingRow(key, settings[key]));
    settingsBox.replaceChildren(el("h3", { text: "Settings" }), ...rows);
  }

  function settingRow(key, s) {
    const label = key === BUDGET_KEY ? "Conditioning budget (MiB)" : humanize(key);
    const error = el("div", { class: "rk-error", "data-rk": "setting-error", text: state.settingErrors.get(key) ?? "" });
    let input;
    if (s.type === "bool") {
      input = el("input", { type: "checkbox" });
      input.checked = Boolean(s.value);
    } else if (Array.isArray(s.choices) && s.choices.length) {
      input = el("select", {}, ...s.choices.map((c) => el("option", { value: c, text: String(c) })));
      input.value = s.value;
    } else if (s.type === "int" || s.type === "float") {
      input = el("input", { type: "number", min: s.min, max: s.max, step: s.type === "int" ? 1 : "any" });
      input.value = String(s.value);
    } else {
      input = el("input", { type: "text" });
      input.value = s.value ?? "";
    }
    input.dataset.rkSetting = key;
    input.title = key;
    if (s.readonly) {
      // set from the environment only (a tier's location): shown, never sent
      input.disabled = true;
      input.title = `${key}: set by ${s.env} in the environment`;
    }
    const apply = async () => {
      let value;
      if (s.type === "bool") value = input.checked;
      else if (s.type === "int" || s.type === "float") value = input.value.trim() === "" ? null : Number(input.value);
      else value = input.value;
      // against the server's value now: a row kept while focused holds the value it was built with
      if (value === (state.settings?.[key] ?? s).value) return;
      error.textContent = "";
      state.settingErrors.delete(key);
      try {
        await actions.setSetting(key, value);
      } catch (exc) {
        error.textContent = exc?.message ?? String(exc);
        state.settingErrors.set(key, error.textContent);
        input.blur();
      }
    };
    input.addEventListener("change", apply);
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") input.blur();
    });
    return el("label", { class: "rk-setting", title: s.description ? `${key}: ${s.description}` : key },
      el("span", { text: label }), input, error);
  }

  function cacheCard(c) {
    const card = el("div", { class: "rk-card", "data-rk-cache": c.name });
    const head = el("div", { class: "rk-card-head" }, el("span", { text: c.name }));
    if (c.clearable) {
      head.append(el("button", {
        class: "rk-btn", type: "button", text: "Clear", "data-rk": "clear", title: `Clear ${c.name}`,
        onclick: () => actions.clear(c.name),
      }));
    }
    const runs = c.kind === "step" ? stepRuns(c.info) : [];
    const flagged = runs.filter((r) => runFlag(r).warn).length;
    if (flagged) {
      head.firstChild.after(el("span", { class: "rk-run-badge", "data-rk": "runs-flagged",
        text: `⚠ ${flagged} run${flagged === 1 ? "" : "s"} skipped nothing` }));
    }
    card.append(head);
    if (c.description) card.append(el("div", { class: "rk-desc", text: c.description }));
    const rule = c.kind === "step" ? lastRule(c.info) : null;
    if (rule) card.append(el("div", { class: "rk-sub", "data-rk": "step-rule", text: rule }));
    const off = offHow(c);
    const memory = memoryRows([c]);
    if (off) {
      for (const tier of memory.length ? memory.map((r) => r.tier) : [null]) {
        card.append(el("div", { class: "rk-off", "data-rk": "cache-off", "data-tier": tier,
          text: tier === null ? `off — ${off}` : offText(tier, off) }));
      }
    }
    for (const r of off ? [] : memory) {
      card.append(bar(`${r.tier}`, r.bytes, r.budget, r.fraction, r.over, { "data-rk": "cache-bytes", "data-tier": r.tier }));
    }
    const grid = el("div", { class: "rk-grid" });
    const cells = [["entries", formatCount(c.entries ?? 0)], ...counterRows(c).map(([k, v]) => [k, formatCounter(k, v)]),
      ["hit rate", formatPercent(c.hit_rate)], ["time saved", formatSeconds(c.time_saved_s ?? 0)]];
    for (const [k, v] of cells) {
      grid.append(el("div", { "data-rk-counter": k }, el("small", { text: k, title: k }), el("span", { text: v })));
    }
    card.append(grid);
    const reasons = reasonRows(c);
    if (reasons.length) {
      const rows = el("div", { class: "rk-rows", "data-rk": "bypass-reasons" });
      for (const [count, text] of reasons) rows.append(el("small", { text: count }), el("span", { text, title: text }));
      card.append(el("h3", { text: REASONS_TITLE[c.kind] ?? "Why it bypassed, refused or fell back" }), rows);
    }
    if (runs.length) {
      card.append(el("h3", { text: runs.length === 1 ? "Last run" : "Last run per model" }), runLegend(),
        el("div", { "data-rk": "step-runs" }, ...runs.map(cachedRun)));
      return card;
    }
    const lastRun = lastRunRows(c.info?.last_run);
    if (lastRun.length) {
      const rows = el("div", { class: "rk-rows", "data-rk": "last-run" });
      for (const [k, v] of lastRun) rows.append(el("small", { text: k }), el("span", { text: v }));
      card.append(el("h3", { text: "Last run" }), rows);
    }
    return card;
  }

  function render() { // the stats: a push never rebuilds the settings rows (updateSettings does)
    renderChart();
    if (state.error) {
      status.textContent = state.error;
      status.className = "rk-warn";
    }
    const snap = state.snapshot;
    if (!snap) return;
    const agg = aggregate(snap);
    if (!state.error) {
      status.className = "rk-sub";
      status.textContent = `${agg.count} cache${agg.count === 1 ? "" : "s"} · updated ${new Date((snap.time ?? Date.now() / 1000) * 1000).toLocaleTimeString()}`;
    }
    kpis.replaceChildren(
      el("div", { class: "rk-kpi", "data-rk": "total-bytes", "data-bytes": agg.totalBytes },
        el("small", { text: "memory held" }), el("b", { text: formatBytes(agg.totalBytes) })),
      el("div", { class: "rk-kpi", "data-rk": "hit-rate" }, el("small", { text: "hit rate" }), el("b", { text: formatPercent(agg.hitRate) })),
      el("div", { class: "rk-kpi", "data-rk": "time-saved" }, el("small", { text: "time saved" }), el("b", { text: formatSeconds(agg.timeSaved) })));
    const largest = Math.max(1, ...agg.tiers.filter((t) => t.budget === null).map((t) => t.bytes));
    tiers.replaceChildren(...agg.tiers.map((t) => {
      if (t.off) return el("div", { class: "rk-off", "data-rk": "tier-off", "data-tier": t.tier, text: offText(t.tier, t.off) });
      const scale = t.budget === null ? largest : t.budget;
      return bar(`${t.tier} total`, t.bytes, t.budget, scale > 0 ? Math.min(1, t.bytes / scale) : 0,
        t.budget !== null && t.bytes > t.budget, { "data-rk": "tier-bytes", "data-tier": t.tier });
    }));
    if (!agg.tiers.length) tiers.replaceChildren(el("div", { class: "rk-empty", text: "Nothing held." }));
    if (!agg.groups.length) {
      groups.replaceChildren(el("div", { class: "rk-empty", "data-rk": "empty",
        text: "No ReuseKit cache has registered yet: run a workflow that uses a ReuseKit node." }));
      return;
    }
    groups.replaceChildren(...agg.groups.map((g) => el("section", { "data-rk-kind": g.kind },
      el("h3", { text: `${g.label} · ${formatBytes(g.bytes)} · hit rate ${formatPercent(g.hitRate)} · saved ${formatSeconds(g.timeSaved)}` }),
      ...g.caches.map(cacheCard))));
    runViews = nextRunViews;
    nextRunViews = new Map();
  }

  const ticker = setInterval(renderChart, 5000);
  renderSettings();
  render();
  return {
    element: panel,
    update(snapshot) {
      state.snapshot = snapshot;
      render();
    },
    updateSettings(settings) {
      state.settings = settings;
      renderSettings();
    },
    setError(message) {
      state.error = message || null;
      render();
    },
    destroy() {
      clearInterval(ticker);
      panel.remove();
    },
  };
}
