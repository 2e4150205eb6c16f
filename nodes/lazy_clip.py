"""Lazy CLIP loaders: ComfyUI's CLIPLoader, DualCLIPLoader and TripleCLIPLoader (their own inputs and
code), run so that the text encoder is built from its files' headers and reads its weights only when an
encode misses every tier of the conditioning cache (patches/lazy_clip.py)."""

from __future__ import annotations

import importlib
import inspect

import comfy.model_management
import torch
from comfy_api.latest import io

from ..patches.conditioning import install, mark
from ..patches.lazy_clip import STATS, lazily
from . import CATEGORY, brief, compat, refusal

AREA = f"{CATEGORY}/conditioning"

DESCRIPTION = (
    "Loads a text encoder like {host}, but reads only its file's header: the encoder's weights are read the "
    "first time an encode misses every tier of ReuseKit's conditioning cache. With the disk tier (one host, "
    "across restarts) or the Redis tier (a fleet) on, a prompt seen before is answered without ever loading "
    "the encoder. Outputs are bit-identical to {host}'s. Loads as usual when no shared tier is on or the "
    "file's content hash is not known yet (it is hashed in the background, once, for the next start).")


def _combo(name: str, options: list, optional: bool, tooltip: str, advanced: bool) -> io.Combo.Input:
    extra = {"advanced": True} if advanced and "advanced" in inspect.signature(io.Combo.Input).parameters else {}
    return io.Combo.Input(name, options=list(options), optional=optional, tooltip=tooltip, **extra)


TOOLTIPS = {"clip_name": "The text encoder file (models/text_encoders).", "type": "The model family it is for.",
            "device": "default: ComfyUI's text-encoder device; cpu: load and run it on the CPU."}


class _LazyLoader(io.ComfyNode):
    """One of ComfyUI's CLIP loader nodes, run lazily. Its inputs are the host node's, read from it."""

    HOST = HOST_MODULE = ""
    NODE_ID = DISPLAY = ""

    @classmethod
    def _host(cls):
        return getattr(importlib.import_module(cls.HOST_MODULE), cls.HOST)

    @classmethod
    def _spec(cls) -> list[tuple[str, list, bool, dict]]:
        """(name, options, optional, extra) of the host node's inputs, in its order: a classic node lists a
        combo's options first, a V3 node (TripleCLIPLoader) says ``"COMBO"`` and keeps them in ``options``."""
        spec = cls._host().INPUT_TYPES()
        out = []
        for section in ("required", "optional"):
            for name, entry in spec.get(section, {}).items():
                extra = entry[1] if len(entry) > 1 else {}
                options = extra.get("options") if entry[0] == "COMBO" else entry[0]
                if not isinstance(options, (list, tuple)):
                    raise TypeError(f"{cls.DISPLAY}: {cls.HOST}'s input {name!r} is not a list of choices "
                                    f"({entry[0]!r}); this ComfyUI's loader is not one ReuseKit knows")
                out.append((name, list(options), section == "optional", extra))
        return out

    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [_combo(name, options, optional, TOOLTIPS.get(name.rstrip("123"), ""), bool(extra.get("advanced")))
                  for name, options, optional, extra in cls._spec()]
        return io.Schema(
            node_id=cls.NODE_ID, display_name=cls.DISPLAY, category=AREA,
            description=DESCRIPTION.format(host=cls.HOST), inputs=inputs,
            outputs=[io.Clip.Output(display_name="CLIP", tooltip="The text encoder; its encodes go through the "
                                                                 "conditioning cache.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def validate_inputs(cls, **inputs):
        # a linked input reaches validation as None (0.3.75 and 0.33 alike): execute checks its value
        return cls._error({k: v for k, v in inputs.items() if v is not None})

    @classmethod
    def _error(cls, inputs: dict):
        spec = cls._spec()
        known = {name for name, _, _, _ in spec}
        if (extra := compat.unknown(cls, {k: v for k, v in inputs.items() if k not in known})) is not None:
            return f"{cls.DISPLAY}: {extra}"
        for name, options, _, _ in spec:
            value = inputs.get(name)
            if name in inputs and value not in options:  # ComfyUI 0.3.75 checks no V3 combo
                shown = brief(value)
                if not options:
                    return (f"{cls.DISPLAY}: {name}: {shown} is not there: its list is empty (no file in the models "
                            "folder it reads; add one and refresh)")
                return f"{cls.DISPLAY}: {name}: {shown} is not one of {', '.join(map(str, options[:8]))}" + (
                    ", ..." if len(options) > 8 else "")
        return True

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        error = cls._error(inputs)
        if error is not True:
            raise refusal(STATS, cls.DISPLAY, error.removeprefix(f"{cls.DISPLAY}: "))
        install()
        host = cls._host()
        try:
            with lazily():
                if hasattr(host, "GET_SCHEMA"):  # a V3 node (TripleCLIPLoader)
                    clip = host.execute(**inputs).args[0]
                else:
                    (clip,) = getattr(host(), host.FUNCTION)(**inputs)
        except (comfy.model_management.InterruptProcessingException, torch.OutOfMemoryError):
            raise  # ComfyUI's own handling: a cancel, or memory it frees and retries
        except Exception as exc:  # a file cut short, not safetensors, or no text encoder ComfyUI knows
            files = ", ".join(f"{k} {brief(v)}" for k, v in inputs.items() if k.startswith("clip_name"))
            raise refusal(STATS, cls.DISPLAY, f"{files}: could not be loaded ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from exc
        mark(clip.patcher)  # its encodes go through the cache even with global mode off
        return io.NodeOutput(clip)


class LazyCLIPLoader(_LazyLoader):
    HOST, HOST_MODULE, NODE_ID, DISPLAY = "CLIPLoader", "nodes", "ReuseKitLazyCLIPLoader", "ReuseKit Lazy CLIP Loader"


class LazyDualCLIPLoader(_LazyLoader):
    HOST, HOST_MODULE = "DualCLIPLoader", "nodes"
    NODE_ID, DISPLAY = "ReuseKitLazyDualCLIPLoader", "ReuseKit Lazy Dual CLIP Loader"


class LazyTripleCLIPLoader(_LazyLoader):
    HOST, HOST_MODULE = "TripleCLIPLoader", "comfy_extras.nodes_sd3"
    NODE_ID, DISPLAY = "ReuseKitLazyTripleCLIPLoader", "ReuseKit Lazy Triple CLIP Loader"


NODES = [LazyCLIPLoader, LazyDualCLIPLoader, LazyTripleCLIPLoader]
