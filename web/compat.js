// ReuseKit: workflows saved with a node's old inputs load with their values on the right widgets (see
// web/compat/widgets.mjs). The saved values are mapped before the page's own loading puts them on widgets.
import { app } from "../../scripts/app.js";
import { OLD_LAYOUTS, keptPrecision, mapOldWidgets } from "./compat/widgets.mjs";

const KEEPS_DECIMALS = new Set(["threshold"]);  // the step cache's: its defaults have four decimals

app.registerExtension({
  name: "reusekit.compat",
  nodeCreated(node) {
    if (!String(node.comfyClass ?? "").startsWith("ReuseKit")) return;
    for (const widget of node.widgets ?? []) {
      const precision = KEEPS_DECIMALS.has(widget.name) ? keptPrecision(widget) : null;
      if (precision !== null) widget.options.precision = precision;
    }
  },
  beforeRegisterNodeDef(nodeType, nodeData) {
    const spec = OLD_LAYOUTS[nodeData.name];
    if (!spec) return;
    const configure = nodeType.prototype.configure;
    nodeType.prototype.configure = function (info) {
      const widgets = (this.widgets ?? []).map((w) => ({ name: w.name, type: w.type }));
      const mapped = mapOldWidgets(spec, widgets, info?.widgets_values);
      if (mapped) {
        console.info(`ReuseKit: ${nodeData.name} #${info.id} was saved with its old inputs; values mapped by name`,
          info.widgets_values, "->", mapped);
        info = { ...info, widgets_values: mapped };
      }
      return configure.call(this, info);
    };
  },
});
