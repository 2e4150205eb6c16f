"""The pack's V3 nodes, gathered into one ComfyExtension.

Each module in NODE_MODULES lists its node classes in ``NODES``. A module that cannot load on this
host (a missing ComfyUI feature) is skipped with one warning; the rest still load.
"""

from __future__ import annotations

import importlib
import logging

from comfy_api.latest import ComfyExtension, io

CATEGORY = "ReuseKit"
NODE_MODULES = ("stats", "conditioning", "pe_cache", "teacache", "graph")

log = logging.getLogger("reusekit")


def load_node_classes() -> list[type[io.ComfyNode]]:
    classes: list[type[io.ComfyNode]] = []
    for name in NODE_MODULES:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except Exception as exc:  # one missing host feature must not hide the whole pack
            log.warning("ReuseKit: the %s nodes are unavailable on this ComfyUI (%s: %s)",
                        name, type(exc).__name__, exc)
            continue
        classes.extend(module.NODES)
    return classes


class ReuseKitExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return load_node_classes()
