"""Shared pieces of the graph tests (a module imports the fixtures ``gc_fixture`` and
``conds_fixture``, which pytest then offers as ``gc`` and ``conds``)."""

import pytest
import rkharness
import torch

LATENTS = {"flux": (1, 16, 8, 8), "wan": (1, 16, 3, 8, 8)}


@pytest.fixture(name="gc")
def gc_fixture(monkeypatch, request):
    """patches.graph_capture with clean graphs and counters; the backend is the test module's
    ``DEFAULT_BACKEND`` (None: auto, i.e. CUDA graphs on a CUDA model)."""
    mod = rkharness.pack("patches.graph_capture")
    monkeypatch.delenv("REUSEKIT_DISABLE_CUDA_GRAPHS", raising=False)
    monkeypatch.setattr(mod, "FORCE_BACKEND", getattr(request.module, "DEFAULT_BACKEND", None))
    mod.graph_release.release_all("test")
    mod.STATS.handle.reset_counters()
    yield mod
    mod.graph_release.release_all("test")


@pytest.fixture(name="conds", scope="module")
def conds_fixture(tiny):
    import nodes

    with torch.inference_mode():
        clip = tiny.tiny_clip(0)
        (pos,) = nodes.CLIPTextEncode().encode(clip, "a red circle")
        (neg,) = nodes.CLIPTextEncode().encode(clip, "blurry")
    return pos, neg


def capture(model, enable=True, max_graphs=2):
    graph = rkharness.pack("nodes.graph")
    return graph.GraphCaptureNode.execute(model, enable=enable, max_graphs=max_graphs).args[0]


def sample(model, conds, shape=(1, 16, 8, 8), cfg=2.0, steps=3, seed=7, callback=None):
    import comfy.sample

    import nodes

    pos, neg = conds
    latent = {"samples": torch.zeros(shape)}
    if callback is None:
        return nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", pos, neg, latent)[0]["samples"]
    noise = comfy.sample.prepare_noise(latent["samples"], seed)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", pos, neg, latent["samples"],
                               callback=callback, disable_pbar=True, seed=seed)


def counters(gc):
    return gc.STATS.handle.snapshot()["counters"]


def last_run(gc):
    return gc.STATS.handle.snapshot()["info"]["last_run"]


def tiny_lora(strength_seed=0):
    gen = torch.Generator().manual_seed(strength_seed)
    return {"diffusion_model.img_in.lora_up.weight": torch.randn(64, 4, generator=gen) * 0.5,
            "diffusion_model.img_in.lora_down.weight": torch.randn(4, 64, generator=gen) * 0.5}


def dynamic_patcher(model):
    """A real ComfyUI ``ModelPatcherDynamic`` (dynamic VRAM) over ``model``'s BaseModel. Its load
    device is named CUDA (on a CPU one ComfyUI returns a plain ModelPatcher instead); comfy-aimdo's
    host library is loaded first, as main.py does before ComfyUI binds it."""
    import importlib

    import comfy.model_patcher

    cls = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if cls is None:
        pytest.skip("this ComfyUI has no comfy.model_patcher.ModelPatcherDynamic (dynamic VRAM, v0.16+)")
    import comfy_aimdo.control
    import comfy_aimdo.host_buffer

    if comfy_aimdo.host_buffer.lib is None:
        if not comfy_aimdo.control.init():
            pytest.skip("comfy-aimdo's library does not load on this machine")
        importlib.reload(comfy_aimdo.host_buffer)  # it binds the library when imported
    patcher = cls(model.model, torch.device("cuda", 0), model.offload_device)
    assert type(patcher) is cls and patcher.is_dynamic()
    return patcher
