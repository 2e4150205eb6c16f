// ReuseKit front end: shows the Cache Stats node's text inside the node.
import { app } from "../../scripts/app.js";

const STATS_NODE = "ReuseKitCacheStats";

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

app.registerExtension({
  name: "reusekit.statsNode",
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
