"""ReuseKit Cache Stats: the stats registry as text, inside the node."""

from __future__ import annotations

import time

from comfy_api.latest import io, ui

from ..caching.stats import REGISTRY, format_snapshot
from . import CATEGORY, compat, refusal


class CacheStatsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitCacheStats",
            display_name="ReuseKit Cache Stats",
            category=f"{CATEGORY}/stats",
            description="Shows what every ReuseKit cache holds and saved, as text in this node. "
                        "Connect anything to 'after' to read the stats once that node has run.",
            inputs=[
                io.AnyType.Input("after", optional=True,
                                 tooltip="Optional: any output; the stats are read after it is computed."),
            ],
            outputs=[io.String.Output(display_name="text", tooltip="The same text, for other nodes.")],
            is_output_node=True,
            hidden=compat.hidden(),
        )

    @classmethod
    def fingerprint_inputs(cls, after=None, **linked) -> float:
        return time.time()  # stats change between runs: never answer from ComfyUI's cache

    @classmethod
    def execute(cls, after=None, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            stats = REGISTRY.register("stats_node", "stats", "Inputs the ReuseKit Cache Stats node refused.")
            raise refusal(stats, "ReuseKit Cache Stats", extra)
        text = format_snapshot(REGISTRY.snapshot())
        return io.NodeOutput(text, ui=ui.PreviewText(text))


NODES = [CacheStatsNode]
