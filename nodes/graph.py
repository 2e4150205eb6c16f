"""ReuseKit Graph Capture (a MODEL node) and ReuseKit Graph KSampler (KSampler with capture)."""

from __future__ import annotations

import numbers

import torch
from comfy_api.latest import io

import nodes as comfy_nodes

from ..caching.graph_reuse import DISABLE_ENV
from ..patches import graph_capture, host
from . import CATEGORY, SamplerInputs, brief, compat, ksampler_inputs, refusal

MAX_GRAPHS = 8
EXPERIMENTAL = "Experimental: never run on a GPU yet. "

ENABLE_TOOLTIP = (f"{EXPERIMENTAL}Capture the diffusion model's forward as a CUDA graph and replay it on the following "
                  f"steps. Off: the model runs as usual. The environment variable {DISABLE_ENV}=1 turns "
                  f"it off everywhere.")
KEEP_TOOLTIP = ("Keep the captured graphs after the run, for the next run of the same model (the default: "
                "a graph is most useful across runs). Off: they are released when the run ends. Either way they "
                "are released at once when ComfyUI needs the memory, and when the model is unloaded.")
MAX_GRAPHS_TOOLTIP = ("How many captured graphs to keep per model (e.g. cond-only and cond+uncond batches, "
                      "or two resolutions); the least recently used one is released beyond it.")


def switches(enable_name: str) -> list:
    """The inputs both nodes share: the on/off switch, how many graphs to keep and for how long."""
    return [io.Boolean.Input(enable_name, default=True, tooltip=ENABLE_TOOLTIP),
            io.Int.Input("max_graphs", default=2, min=1, max=MAX_GRAPHS, tooltip=MAX_GRAPHS_TOOLTIP),
            io.Boolean.Input("keep_graphs", default=True, optional=True, tooltip=KEEP_TOOLTIP)]


def _refused(node: str, what: str) -> ValueError:
    return refusal(graph_capture.STATS.handle, node, what)


def _check(node: str, enable_name: str, enable, max_graphs, keep_graphs=True) -> None:
    if not isinstance(enable, bool):
        raise _refused(node, f"{brief(enable_name)} must be true or false, got {brief(enable)}")
    if not isinstance(keep_graphs, bool):
        raise _refused(node, f"'keep_graphs' must be true or false, got {brief(keep_graphs)}")
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, numbers.Integral) or not 1 <= max_graphs <= MAX_GRAPHS:
        raise _refused(node, f"'max_graphs' must be a whole number from 1 to {MAX_GRAPHS}, got {brief(max_graphs)}")


def with_capture(node: str, enable_name: str, model, enable: bool, max_graphs: int, keep_graphs: bool = True):
    """``model`` cloned with graph capture on or off; ``enable_name``: the node's name for its switch."""
    _check(node, enable_name, enable, max_graphs, keep_graphs)
    if not hasattr(model, "clone") or getattr(getattr(model, "model", None), "diffusion_model", None) is None:
        # (a CLIP's or a VAE's patcher through an any-typed link failed deep in the sampler)
        raise _refused(node, f"'model' must be a MODEL (a diffusion model from a loader), got {type(model).__name__}")
    model = model.clone()
    if enable:
        if not torch.cuda.is_available():
            host.say_once("graph:nocuda", "ReuseKit graph: no CUDA device, the model runs eagerly "
                          "(the reuse decision still runs and is counted)")
        graph_capture.enable(model, max_graphs=int(max_graphs), keep=keep_graphs)
    else:
        graph_capture.disable(model)
    return model


class GraphCaptureNode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitGraphCapture",
            display_name="ReuseKit Graph Capture",
            category=f"{CATEGORY}/graph",
            is_experimental=True,
            description=f"{EXPERIMENTAL}Captures the diffusion model's forward once as a CUDA graph and replays it on every "
                        "following step while shapes, batch and weights stay the same; rebuilds (and says why) "
                        "when they change. Partially loaded (lowvram) models, models under dynamic VRAM, per-step "
                        "weight hooks and uncapturable inputs run eagerly with the same result. Without CUDA: "
                        "eager.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to capture (it is cloned, never changed)."),
                *switches("enable"),
            ],
            outputs=[io.Model.Output(tooltip="The model with graph capture.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, model, enable=True, max_graphs=2, keep_graphs=True, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            raise _refused("ReuseKit Graph Capture", extra)
        return io.NodeOutput(with_capture("ReuseKit Graph Capture", "enable", model, enable, max_graphs, keep_graphs))


class GraphKSamplerNode(SamplerInputs, io.ComfyNode):
    NODE = "ReuseKit Graph KSampler"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ReuseKitGraphKSampler",
            display_name="ReuseKit Graph KSampler",
            category=f"{CATEGORY}/graph",
            is_experimental=True,
            description=f"{EXPERIMENTAL}KSampler with CUDA graph capture of the diffusion model: the same result as KSampler, "
                        "with the per-step launch overhead removed on replayed steps.",
            inputs=[
                *ksampler_inputs(),
                *switches("enable_graphs"),
            ],
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=compat.hidden(),
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                denoise=1.0, enable_graphs=True, max_graphs=2, keep_graphs=True, **linked) -> io.NodeOutput:
        if (extra := compat.unknown(cls, linked)) is not None:
            raise _refused(cls.NODE, extra)
        cls.check_inputs(graph_capture.STATS.handle, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                         positive=positive, negative=negative, latent_image=latent_image, denoise=denoise)
        model = with_capture(cls.NODE, "enable_graphs", model, enable_graphs, max_graphs, keep_graphs)
        (latent,) = comfy_nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive,
                                                negative, latent_image, denoise=denoise)
        return io.NodeOutput(latent)


NODES = [GraphCaptureNode, GraphKSamplerNode]
