// ReuseKit front end: the cache panel (a sidebar tab, live over the websocket) and the Cache Stats
// node's text. Helpers live in web/panel/*.mjs (loaded from here only: ComfyUI loads every *.js).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const STATS_NODE = "ReuseKitCacheStats";
const TAB_ID = "reusekit-panel";
const SCHEMA = 1;

// ---- the Cache Stats node shows its text inside the node --------------------------------------

function showText(node, text) {
  let widget = node.widgets?.find((w) => w.name === "reusekit_stats");
  if (!widget) {
    widget = node.addWidget("text", "reusekit_stats", "", () => {}, { multiline: true, serialize: false });
    const el = widget.inputEl || widget.element;
    if (el) {
      el.readOnly = true;
      el.style.opacity = 0.85;
      el.style.fontFamily = "monospace";
    }
  }
  widget.value = text;
  node.setDirtyCanvas?.(true, true);
}

// ---- panel state: the last snapshot, the settings, memory history, mounted views --------------

const state = { snapshot: null, settings: null, error: null, history: null, views: new Map(), lib: null };

function forViews(fn) {
  for (const view of state.views.values()) {
    if (!view) continue; // still loading
    try {
      fn(view);
    } catch (exc) {
      console.warn("[reusekit] panel update failed", exc);
    }
  }
}

function onSnapshot(snapshot) {
  if (!snapshot || typeof snapshot !== "object" || !Array.isArray(snapshot.caches)) return;
  const names = snapshot.caches.map((c) => c.name).sort().join("\n");
  if (state.snapshot && names !== state.cacheNames) refreshSettings(); // a new cache may bring settings
  state.cacheNames = names;
  state.snapshot = snapshot;
  state.error = snapshot.schema > SCHEMA ? `The server sends stats schema ${snapshot.schema}; this panel knows ${SCHEMA}.` : null;
  state.history?.add(Date.now() / 1000, snapshot);
  forViews((v) => {
    v.setError(state.error);
    v.update(snapshot);
  });
}

function onSettings(payload) {
  if (!payload || typeof payload.settings !== "object") return;
  state.settings = payload.settings;
  forViews((v) => v.updateSettings(payload.settings));
}

async function getJson(path) {
  const response = await api.fetchApi(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function postJson(path, body) {
  const response = await api.fetchApi(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  let payload = null;
  try {
    payload = await response.json();
  } catch {
    payload = null;
  }
  if (!response.ok) throw new Error(payload?.error ?? `${path}: HTTP ${response.status}`);
  return payload;
}

async function refreshSettings() {
  try {
    onSettings(await getJson("/reusekit/settings"));
  } catch {
    /* refresh() reports the routes missing */
  }
}

async function refresh() {
  try {
    const [snapshot, settings] = await Promise.all([getJson("/reusekit/stats"), getJson("/reusekit/settings")]);
    onSnapshot(snapshot);
    onSettings(settings);
  } catch (exc) {
    state.error = `ReuseKit's server routes did not answer (${exc.message}).`;
    forViews((v) => v.setError(state.error));
  }
}

function toast(severity, summary, detail) {
  try {
    app.extensionManager?.toast?.add?.({ severity, summary, detail, life: 3000 });
  } catch {
    /* no toasts in this front end: the panel shows the state anyway */
  }
}

const actions = {
  async clear(name) {
    try {
      const body = await postJson("/reusekit/clear", name ? { cache: name } : { all: true });
      onSnapshot(body.stats);
      toast("success", "ReuseKit", body.cleared.length ? `Cleared ${body.cleared.join(", ")}` : "Nothing to clear");
    } catch (exc) {
      toast("error", "ReuseKit: clear failed", exc.message);
    }
  },
  async setSetting(key, value) {
    onSettings(await postJson("/reusekit/settings", { [key]: value }));
  },
};

async function loadLib() {
  if (!state.lib) {
    const [format, view] = await Promise.all([import("./panel/format.mjs"), import("./panel/view.mjs")]);
    state.lib = { ...format, ...view };
    state.history = new format.MemoryHistory(chartMinutes() * 60);
    if (state.snapshot) state.history.add(Date.now() / 1000, state.snapshot);
  }
  return state.lib;
}

function chartMinutes() {
  const value = app.extensionManager?.setting?.get?.("reusekit.panel.chartMinutes");
  return typeof value === "number" && value > 0 ? value : 5;
}

async function mount(element) {
  if (state.views.has(element)) return; // the host may call render again for the same element
  state.views.set(element, null);
  try {
    const lib = await loadLib();
    const view = lib.createPanel(element, { actions, history: state.history });
    state.views.set(element, view);
    if (state.error) view.setError(state.error);
    if (state.settings) view.updateSettings(state.settings);
    if (state.snapshot) view.update(state.snapshot);
    refresh();
  } catch (exc) {
    state.views.delete(element);
    element.textContent = `ReuseKit panel failed to load: ${exc.message}`;
    console.warn("[reusekit] panel failed to load", exc);
  }
}

function unmountAll() {
  for (const [element, view] of state.views) {
    view?.destroy();
    state.views.delete(element);
  }
}

function togglePanel() {
  const manager = app.extensionManager;
  if (state.placement === "sidebar" && manager?.sidebarTab?.toggleSidebarTab) {
    manager.sidebarTab.toggleSidebarTab(TAB_ID);
  } else if (state.placement === "bottom" && manager?.bottomPanel?.toggleBottomPanelTab) {
    manager.bottomPanel.toggleBottomPanelTab(TAB_ID);
  } else {
    toast("warn", "ReuseKit", "This ComfyUI front end cannot show the cache panel.");
  }
}

async function clearAllCommand() {
  if (typeof window.confirm === "function" && !window.confirm("Clear every ReuseKit cache?")) return;
  await actions.clear(null);
}

const TAB = {
  id: TAB_ID,
  icon: "pi pi-database",
  title: "ReuseKit",
  label: "ReuseKit",
  tooltip: "ReuseKit caches: memory, hits, time saved",
  type: "custom",
  render: (element) => {
    mount(element);
  },
  destroy: unmountAll,
};

function placePanel() {
  const manager = app.extensionManager;
  if (typeof manager?.registerSidebarTab === "function") {
    manager.registerSidebarTab(TAB);
    state.placement = "sidebar";
    return;
  }
  if (manager?.bottomPanel) { // older front ends: a bottom-panel tab, registered through an extension
    app.registerExtension({ name: "reusekit.panel.bottom", bottomPanelTabs: [TAB] });
    state.placement = "bottom";
    return;
  }
  console.warn("[reusekit] this ComfyUI front end has no sidebar or bottom panel API: no cache panel");
}

// Listen before the first push can arrive (the host warns about event types nobody listens to).
api.addEventListener("reusekit.stats", (event) => onSnapshot(event.detail));
api.addEventListener("reusekit.settings", (event) => onSettings(event.detail));
api.addEventListener("reconnected", () => refresh());

app.registerExtension({
  name: "reusekit.panel",
  settings: [
    {
      id: "reusekit.panel.chartMinutes",
      category: ["ReuseKit", "Panel", "Chart window"],
      name: "Memory chart window (minutes)",
      tooltip: "How many minutes of memory history the ReuseKit panel's chart shows.",
      type: "number",
      attrs: { min: 1, max: 60, step: 1 },
      defaultValue: 5,
      onChange: (value) => {
        if (state.history && typeof value === "number" && value > 0) state.history.windowSeconds = value * 60;
      },
    },
  ],
  commands: [
    { id: "reusekit.panel.toggle", label: "ReuseKit: toggle the cache panel", icon: "pi pi-database", function: togglePanel },
    { id: "reusekit.cache.clearAll", label: "ReuseKit: clear all caches", icon: "pi pi-trash", function: clearAllCommand },
  ],
  async setup() {
    try {
      placePanel();
      await loadLib(); // start the memory history now, before the panel is first opened
    } catch (exc) {
      console.warn("[reusekit] could not add the cache panel", exc);
    }
    refresh();
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== STATS_NODE) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text;
      if (text) showText(this, Array.isArray(text) ? text.join("\n") : String(text));
    };
  },
});
