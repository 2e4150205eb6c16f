"""ReuseKit PE Cache: rotary position embeddings built once per geometry and reused, bit-exact."""

from __future__ import annotations

import comfy.model_patcher
import comfy.patcher_extension
from comfy_api.latest import io

from ..caching.stats import REGISTRY
from ..patches import rope
from . import CATEGORY, brief, compat, refusal

WRAPPER_KEY = "reusekit_pe_cache"


def _refused(what: str) -> ValueError:
    """A bad input, counted where the panel shows it (a card of its own: the input has no model's PE cache)."""
    stats = REGISTRY.register("pe_cache_node", "pe", "Inputs the ReuseKit PE Cache node refused.")
    return refusal(stats, "ReuseKit PE Cache", what)


class PECacheNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitPECache",
            display_name="ReuseKit PE Cache",
            category=f"{CATEGORY}/pe_cache",
            description="Builds the model's rotary position embeddings once per geometry and reuses them on "
                        "every following step, cond and uncond, and run, while the size, text length, reference "
                        "images and rope options stay the same. The result is bit-identical.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model (Flux, Flux.2, Chroma, Wan 2.1/2.2, "
                                                "HunyuanVideo 1.0/1.5, Qwen-Image/Edit, Lumina2/Z-Image, HiDream, "
                                                "LTXV/LTX-2, Cosmos, Mochi, HunyuanDiT, OmniGen2)."),
                io.Boolean.Input("enabled", default=True,
                                 tooltip="Off: this model never uses the PE cache, even when the server-wide "
                                         "default 'pe_cache.default_enabled' is on."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model that reuses its position embeddings.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, model, enabled=True, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            raise _refused(extra)
        if not isinstance(model, comfy.model_patcher.ModelPatcher):
            raise _refused(f"input 'model' must be a MODEL, got {type(model).__name__}")
        if not isinstance(enabled, bool):
            raise _refused(f"input 'enabled' must be true or false, got {brief(enabled)}")
        rope.install()  # idempotent; the entrypoint normally did it already
        model = model.clone()
        wrappers = comfy.patcher_extension.WrappersMP
        for kind in (wrappers.APPLY_MODEL, wrappers.OUTER_SAMPLE):
            model.remove_wrappers_with_key(kind, WRAPPER_KEY)
        applier = rope.ApplyModelWrapper(enabled)
        model.add_wrapper_with_key(wrappers.APPLY_MODEL, WRAPPER_KEY, applier)
        if enabled:
            model.add_wrapper_with_key(wrappers.OUTER_SAMPLE, WRAPPER_KEY, rope.RunSummary(applier))
            rope.count_unpatched(rope.model_cache(model.model).stats)  # registered now: listed before the first step
        return io.NodeOutput(model)


NODES = [PECacheNode]
