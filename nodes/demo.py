"""The demo models as nodes: a tiny Flux and Wan trained on captioned shapes, shipped with the pack
(no download), and the picture code that stands in for their VAE; their encoder and transformer
forwards are counted under "demo models" in the stats. Also ReuseKit Prompt Batch: a prompt per
line, each paired with one shared negative.
"""

from __future__ import annotations

import threading
import types

import torch
from comfy_api.latest import io

from ..caching.conditioning import CACHE
from ..caching.stats import REGISTRY
from . import CATEGORY, _number_error, brief, compat, refusal

AREA = f"{CATEGORY}/demo"
STATS_NAME = "demo models"
TRAINED_ON = ("Trained on pictures of one coloured shape on a plain background, captioned like "
              "'a red circle on a black background' (colours: red, green, blue, yellow, white, purple; "
              "shapes: circle, square, triangle, cross; backgrounds: black, gray, white). Pictures are "
              "16x16 (a 64x64 empty latent); decode them with ReuseKit Demo Decode, not a VAE.")
CLIP_TOOLTIP = ("The tiny CLIP the model was trained with: ComfyUI's CLIP-L at width 32 with seeded weights "
                "(no file), using ComfyUI's own tokenizer.")


def _stats():
    """The demo models' call counters, registered when a demo model is first built."""
    return REGISTRY.register(
        STATS_NAME, "demo", "Forward calls of the demo models' text encoder and transformer blocks (what the "
                            "caches save shows up as fewer calls).")


def _counted(self, *args, **kwargs):
    """A counted module's forward: its class's, counted under the module's ``_reusekit_counter``."""
    _stats().incr(self._reusekit_counter)
    return type(self).forward(self, *args, **kwargs)


def _count(module: torch.nn.Module, counter: str) -> None:
    """Count ``module``'s forward calls through an instance method (a module hook would make the
    conditioning cache refuse the encoder: hooks can change outputs), a function of this module's that
    captures nothing, so the conditioning key can name it."""
    module._reusekit_counter = counter
    module.forward = types.MethodType(_counted, module)


_LOADED: dict[str, tuple] = {}
_LOCK = threading.Lock()


def load_demo(family: str):
    """(MODEL, CLIP) of a demo family. The trained weights are read once per process and kept, as a model
    manager keeps loaded weights; each call wraps them in a new diffusion model and patcher (sharing the
    tensors, no copy), so when the prompt drops its MODEL and the clones the caches made of it, the model
    goes with them: ComfyUI's loaded-model list keeps no entry whose patcher is gone (under
    --cache-none such entries made leak warnings and None in ``loaded_models()``). The CLIP is kept whole:
    its encodes stay one encoder for the conditioning cache across prompts, even under --cache-none.
    Their forwards are counted: encoder_calls, transformer_calls."""
    from .demo_models import shapes

    with _LOCK:
        if family not in _LOADED:
            model, clip = shapes.build(family=family), shapes.build_clip()
            _count(clip.cond_stage_model.clip_l, "encoder_calls")
            _LOADED[family] = (dict(model.model.diffusion_model.state_dict(keep_vars=True)), clip)
            del model
        weights, clip = _LOADED[family]
    model = shapes.build(load_weights=False, family=family)
    dm = model.model.diffusion_model
    dm.load_state_dict(weights, strict=True, assign=True)
    _count((dm.double_blocks if family == "flux" else dm.blocks)[0], "transformer_calls")
    return model, clip


class DemoFlux(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitDemoFlux",
            display_name="ReuseKit Demo Flux (no download)",
            category=AREA,
            description="A tiny Flux (ComfyUI's real Flux class, hidden 64, 2+2 blocks, 1 MB of weights shipped "
                        f"with ReuseKit) and its tiny CLIP, for trying the caches without downloads. {TRAINED_ON}",
            inputs=[],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The tiny Flux trained on captioned shapes "
                                                                   "(use cfg 3-4, euler, 20 steps)."),
                     io.Clip.Output(display_name="CLIP", tooltip=CLIP_TOOLTIP)],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            raise refusal(_stats(), "ReuseKit Demo Flux", extra)
        return io.NodeOutput(*load_demo("flux"))


class DemoWan(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitDemoWan",
            display_name="ReuseKit Demo Wan (no download)",
            category=AREA,
            description="A tiny Wan 2.1 text-to-video model (ComfyUI's real WanModel, dim 64, 3 layers, 0.5 MB "
                        f"shipped with ReuseKit) and its tiny CLIP. {TRAINED_ON} One latent frame "
                        "(video length 1).",
            inputs=[],
            outputs=[io.Model.Output(display_name="MODEL", tooltip="The tiny Wan 2.1 trained on captioned shapes "
                                                                   "(one frame; cfg 3-4, euler, 20 steps)."),
                     io.Clip.Output(display_name="CLIP", tooltip=CLIP_TOOLTIP)],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            raise refusal(_stats(), "ReuseKit Demo Wan", extra)
        return io.NodeOutput(*load_demo("wan"))


class DemoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitDemoDecode",
            display_name="ReuseKit Demo Decode (picture code)",
            category=AREA,
            description="Turns a demo model's latent into its picture. The demo models use a fixed, invertible "
                        "picture code instead of a VAE: 16 latent channels are the picture's RGB and shape mask "
                        "at twice the latent size, pixel-unshuffled by 2.",
            inputs=[io.Latent.Input("samples", tooltip="A latent from a demo Flux (4-D) or demo Wan (5-D: every "
                                                       "frame becomes an image)."),
                    io.Int.Input("scale", default=16, min=1, max=64,
                                 tooltip="Enlarge the small picture this many times (nearest neighbour).")],
            outputs=[io.Image.Output(tooltip="The picture (RGB).")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, samples, scale=16, **linked) -> io.NodeOutput:
        import comfy.latent_formats

        from .demo_models import shapes

        node = "ReuseKit Demo Decode"
        if (extra := compat.unknown(cls, linked)) is not None:
            raise refusal(_stats(), node, extra)
        latent = samples.get("samples") if isinstance(samples, dict) else None
        if isinstance(latent, torch.Tensor) and latent.ndim in (4, 5) and latent.shape[1] != 16 \
                and latent.numel() and not latent.any():  # an empty latent of other channels: empty, as ComfyUI's samplers read it
            latent = latent.new_zeros((latent.shape[0], 16, *latent.shape[2:]))
        if not isinstance(latent, torch.Tensor) or latent.ndim not in (4, 5) or latent.shape[1] != 16 \
                or latent.numel() == 0:
            got = (tuple(latent.shape) if isinstance(latent, torch.Tensor) else
                   f"a dict whose 'samples' is {brief(latent)}" if isinstance(samples, dict) else brief(samples))
            raise refusal(_stats(), node, f"samples must be a demo model's non-empty 16-channel latent, got {got}")
        if (error := _number_error("scale", scale, 1, 64, whole=True)) is not None:
            raise refusal(_stats(), node, error)
        scale = int(scale)
        if latent.ndim == 5:  # Wan: (B, C, T, H, W), its own latent statistics; frames become images
            x = comfy.latent_formats.Wan21().process_in(latent.float())
            x = x.permute(0, 2, 1, 3, 4).reshape(-1, 16, *latent.shape[-2:])
        else:
            x = comfy.latent_formats.Flux().process_in(latent.float())
        pic = shapes.latent_to_picture(x, processed=True)[:, :3]
        pic = torch.nn.functional.interpolate(pic, scale_factor=scale, mode="nearest")
        return io.NodeOutput(pic.permute(0, 2, 3, 1).contiguous().cpu())


class PromptBatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitPromptBatch",
            display_name="ReuseKit Prompt Batch",
            category=CATEGORY,
            description="A batch of prompts, one per line, each paired with the same negative: connected nodes "
                        "run once per line (ComfyUI's list outputs), the way a queue of prompts would.",
            inputs=[io.String.Input("prompts", multiline=True,
                                    default="a red circle on a black background\n"
                                            "a blue square on a white background\n"
                                            "a red circle on a black background",
                                    tooltip="One prompt per line; empty lines are left out."),
                    io.String.Input("negative", default="", tooltip="The negative every prompt shares.")],
            outputs=[io.String.Output(display_name="positive", is_output_list=True,
                                      tooltip="The prompts, one item per line."),
                     io.String.Output(display_name="negative", is_output_list=True,
                                      tooltip="The negative, once per prompt.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, prompts, negative="", **linked) -> io.NodeOutput:
        return _prompt_batch(cls, "ReuseKit Prompt Batch", prompts, negative, linked)


def _prompt_batch(cls, node: str, prompts, negative, linked: dict) -> io.NodeOutput:
    """A prompt batch node's work, refused under ``node``: the name of the node the user has."""
    if (extra := compat.unknown(cls, linked)) is not None:
        raise refusal(CACHE.stats, node, extra)
    if not isinstance(prompts, str) or not isinstance(negative, str):
        raise refusal(CACHE.stats, node, "prompts and negative must be text")  # its prompts feed the encodes
    lines = [line.strip() for line in prompts.splitlines() if line.strip()]
    if not lines:
        raise refusal(CACHE.stats, node, "prompts has no prompt (one per line)")
    return io.NodeOutput(lines, [negative] * len(lines))


class OldPromptBatch(io.ComfyNode):
    """ReuseKit Prompt Batch under the id the first demo saved it with (ReuseKitDemoPromptBatch, renamed on
    2026-11-30 in d3ec191), so a workflow saved then still loads and runs; deprecated: the page leaves it out
    of the node search. Its own class: ComfyUI caches a schema's fields on the class, a subclass would inherit
    them."""

    DISPLAY = "ReuseKit Demo Prompt Batch (old name of ReuseKit Prompt Batch)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        schema = PromptBatch.define_schema()
        schema.node_id, schema.is_deprecated, schema.display_name = "ReuseKitDemoPromptBatch", True, cls.DISPLAY
        return schema

    @classmethod
    def execute(cls, prompts, negative="", **linked) -> io.NodeOutput:
        return _prompt_batch(cls, cls.DISPLAY, prompts, negative, linked)


NODES = [DemoFlux, DemoWan, DemoDecode, PromptBatch, OldPromptBatch]
