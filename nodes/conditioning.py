"""Conditioning cache nodes: cached CLIP, VAE and CLIP vision (clones), and the cache's settings."""

from __future__ import annotations

import threading
import time

from comfy_api.latest import io, ui

from ..caching.conditioning import CACHE
from ..caching.settings import SETTINGS
from ..caching.stats import REGISTRY, format_snapshot
from ..patches.conditioning import cached_copy, install, mark
from . import CATEGORY, _number_error, brief, compat, refusal

AREA = f"{CATEGORY}/conditioning"
# Inputs removed on 2026-11-30 (d91176a): the cache holds CPU copies returned on the encoder's device
DEVICE_HOT = "entries are CPU copies, returned on the encoder's device"


def _require(node: str, name: str, value, *attrs: str):
    if value is None or not all(hasattr(value, a) for a in attrs):
        raise refusal(CACHE.stats, node, f"input '{name}' is not a {name.upper().replace('_', ' ')} "
                                         f"(got {type(value).__name__})")


class CachedCLIP(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitCachedCLIP",
            display_name="ReuseKit Cached CLIP",
            category=AREA,
            description="Returns a copy of the CLIP whose text encodes go through ReuseKit's conditioning "
                        "cache, even with global mode off: the same tokens on the same encoder (and the "
                        "same LoRA at the same strength) reuse the stored output, bit for bit.",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder to cache; it is cloned, never changed."),
            ],
            outputs=[io.Clip.Output(display_name="CLIP", tooltip="A clone routed through the cache.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, clip, **linked_old) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked_old, ("device_hot",))) is not None:
            raise refusal(CACHE.stats, "ReuseKit Cached CLIP", extra)
        compat.say_removed(cls, "ReuseKit Cached CLIP", {"device_hot": DEVICE_HOT}, linked_old)
        _require("ReuseKit Cached CLIP", "clip", clip, "patcher", "clone")
        install()
        out = clip.clone()
        mark(out.patcher)
        return io.NodeOutput(out)


class _CachedCopy(io.ComfyNode):
    """A node that returns a copy of a VAE / CLIP vision object, routed through the cache."""

    NODE_ID = DISPLAY = DESCRIPTION = INPUT = ""
    KIND: type = io.Vae
    NEEDS: tuple[str, ...] = ()

    @classmethod
    def define_schema(cls) -> io.Schema:
        label = cls.INPUT.upper()
        return io.Schema(
            node_id=cls.NODE_ID, display_name=cls.DISPLAY, category=AREA, description=cls.DESCRIPTION,
            inputs=[cls.KIND.Input(cls.INPUT, tooltip=f"The {label} to cache; it is copied, never changed.")],
            outputs=[cls.KIND.Output(display_name=label, tooltip="A copy routed through the cache.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        if (extra := compat.unknown(cls, inputs, (cls.INPUT,))) is not None:
            raise refusal(CACHE.stats, cls.DISPLAY, extra)
        value = inputs.get(cls.INPUT)
        _require(cls.DISPLAY, cls.INPUT, value, "patcher", *cls.NEEDS)
        install()
        out = cached_copy(value)
        mark(out.patcher)
        return io.NodeOutput(out)


class CachedVAE(_CachedCopy):
    NODE_ID, DISPLAY, INPUT, KIND, NEEDS = "ReuseKitCachedVAE", "ReuseKit Cached VAE", "vae", io.Vae, ("first_stage_model",)
    DESCRIPTION = ("Returns a copy of the VAE whose encodes (plain and tiled) go through the conditioning cache: "
                   "the same pixels give the stored latent, bit for bit. Decoding is unchanged.")


class CachedCLIPVision(_CachedCopy):
    NODE_ID, DISPLAY, INPUT, KIND = "ReuseKitCachedCLIPVision", "ReuseKit Cached CLIP Vision", "clip_vision", io.ClipVision
    NEEDS = ("encode_image",)
    DESCRIPTION = ("Returns a copy of the CLIP vision model whose image encodes go through the conditioning "
                   "cache (the image by content, the crop option in the key).")


_applied: dict[str, tuple] = {}  # the inputs the settings node last applied (once per change)
LIMIT = 1 << 20  # budget_mib and max_entries at most, as their settings allow (caching/conditioning.py)
_applied_lock = threading.Lock()


class ConditioningCacheSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitConditioningCacheSettings",
            display_name="ReuseKit Conditioning Cache Settings",
            category=AREA,
            description="Sets the conditioning cache for this ComfyUI process (the panel changes the same "
                        "settings, the shared disk and Redis tiers' too) and shows what it and its tiers hold.",
            inputs=[
                io.Boolean.Input("global_mode", default=True,
                                 tooltip="Every text, CLIP-vision and VAE encode of every workflow goes through "
                                         "the cache, without extra nodes."),
                io.Int.Input("budget_mib", default=512, min=0, max=LIMIT,
                             tooltip="MiB the cache may hold (its CPU copies and the LoRA weights they pin); "
                                     "0 disables it."),
                io.Int.Input("max_entries", default=128, min=0, max=LIMIT,
                             tooltip="Entries the cache may hold; 0 disables it."),
                io.Boolean.Input("clear", default=False,
                                 tooltip="Drop every entry when this node applies its settings: when clear is "
                                         "switched on, or another input changes while it is on. Queuing the "
                                         "same inputs again clears nothing."),
            ],
            outputs=[io.String.Output(display_name="text", tooltip="The cache's stats after the change.")],
            is_output_node=True,
            hidden=compat.hidden(),
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs) -> float:
        return time.time()  # reports each run; the settings apply only when the inputs change

    @classmethod
    def execute(cls, global_mode=True, budget_mib=512, max_entries=128, clear=False, **linked_old) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked_old, ("device_hot_negatives",))) is not None:
            raise refusal(CACHE.stats, "ReuseKit Conditioning Cache Settings", extra)
        compat.say_removed(cls, "ReuseKit Conditioning Cache Settings", {"device_hot_negatives": DEVICE_HOT},
                           linked_old)
        for name, value in (("global_mode", global_mode), ("clear", clear)):  # (linked: anything)
            if not isinstance(value, bool):
                raise refusal(CACHE.stats, "ReuseKit Conditioning Cache Settings",
                              f"{name} must be true or false, got {brief(value)}")
        for name, value in (("budget_mib", budget_mib), ("max_entries", max_entries)):
            if (error := _number_error(name, value, 0, LIMIT, whole=True)) is not None:
                raise refusal(CACHE.stats, "ReuseKit Conditioning Cache Settings", error)
        budget_mib, max_entries = int(budget_mib), int(max_entries)  # (a NumPy integer, linked)
        inputs = (global_mode, budget_mib, max_entries, clear)
        with _applied_lock:
            if _applied.get("inputs") != inputs:  # the panel's later changes survive re-queues
                try:
                    SETTINGS.update({"conditioning.enabled": global_mode, "conditioning.budget_mib": budget_mib,
                                     "conditioning.max_entries": max_entries})
                except ValueError as exc:
                    raise refusal(CACHE.stats, "ReuseKit Conditioning Cache Settings", str(exc)) from None
                if clear:
                    CACHE.clear()
                _applied["inputs"] = inputs
        install()
        snap = REGISTRY.snapshot()
        snap["caches"] = [c for c in snap["caches"] if c["kind"] == "conditioning"]  # the LRU and its shared tiers
        text = format_snapshot(snap)
        return io.NodeOutput(text, ui=ui.PreviewText(text))


NODES = [CachedCLIP, CachedVAE, CachedCLIPVision, ConditioningCacheSettings]
