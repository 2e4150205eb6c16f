"""The signature tests on the ``trace`` backend: the forward is traced once at capture and the
trace replayed, so (unlike ``emulate``, which re-runs the Python forward) a replay that should not
have happened gives a wrong output."""

import importlib

import pytest
import rkharness
import torch
from graph_helpers import LATENTS, capture, conds_fixture, gc_fixture, last_run, sample  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph
DEFAULT_BACKEND = "trace"


def _half_img_in(model):
    import copy

    other = copy.deepcopy(model.model.diffusion_model.img_in)
    with torch.no_grad():
        other.weight.mul_(0.5)
    return other


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_replayed_traces_equal_the_plain_run_across_seeds(gc, tiny, conds, family):
    model = tiny.BUILDERS[family](1)
    captured = capture(model)
    for seed in (7, 11):
        out = sample(captured, conds, LATENTS[family], steps=4, seed=seed)
        assert torch.equal(out, sample(model, conds, LATENTS[family], steps=4, seed=seed))
    run = last_run(gc)
    assert run["backend"] == "trace" and (run["captures"], run["replays"], run["eager_steps"]) == (0, 4, 0), run


def test_a_replay_the_signature_should_have_refused_shows_as_a_wrong_output(gc, monkeypatch, tiny, conds):
    """Blind the signature to object patches (and the modules set anew by applying them): the trace replays the
    old module's weights."""
    model = tiny.tiny_flux(0)
    captured = capture(model)
    sample(captured, conds)
    patched = captured.clone()
    patched.add_object_patch("diffusion_model.img_in", _half_img_in(model))
    plain = model.clone()
    plain.add_object_patch("diffusion_model.img_in", patched.object_patches["diffusion_model.img_in"])
    expected = sample(plain, conds)
    fields = gc._state_fields
    blind = {"model.object_patches": (), "model.set_anew": 0}  # as when the graph was captured
    monkeypatch.setattr(gc, "_state_fields", lambda *a: tuple(
        f if f[0] not in blind else (*f[:2], blind[f[0]]) for f in fields(*a)))
    stale = sample(patched, conds)
    assert last_run(gc)["replays"] == 3 and not torch.equal(stale, expected)
    monkeypatch.setattr(gc, "_state_fields", fields)
    assert torch.equal(sample(patched, conds), expected) and last_run(gc)["rebuilds"] == {"object_patches": 1}


def test_resolution_batch_lora_and_object_patch_changes_rebuild_and_stay_correct(gc, tiny, conds):
    import comfy.sd
    from graph_helpers import tiny_lora

    model = tiny.tiny_flux(0)
    captured = capture(model, max_graphs=2)
    sample(captured, conds, (1, 16, 8, 8))
    assert torch.equal(sample(captured, conds, (1, 16, 12, 12)), sample(model, conds, (1, 16, 12, 12)))
    assert last_run(gc)["rebuilds"] == {"shape": 1}
    assert torch.equal(sample(captured, conds, cfg=1.0), sample(model, conds, cfg=1.0))
    assert last_run(gc)["rebuilds"] == {"cond_batch": 1}
    (lora, _) = comfy.sd.load_lora_for_models(captured, None, tiny_lora(), 1.0, 0)
    (plain_lora, _) = comfy.sd.load_lora_for_models(model, None, tiny_lora(), 1.0, 0)
    assert torch.equal(sample(lora, conds), sample(plain_lora, conds))
    assert torch.equal(sample(captured, conds), sample(model, conds))
    patched = captured.clone()
    patched.add_object_patch("diffusion_model.img_in", _half_img_in(model))
    plain = model.clone()
    plain.add_object_patch("diffusion_model.img_in", patched.object_patches["diffusion_model.img_in"])
    assert torch.equal(sample(patched, conds), sample(plain, conds))
    assert last_run(gc)["rebuilds"] == {"object_patches": 1}
    assert torch.equal(sample(captured, conds), sample(model, conds))


@pytest.mark.parametrize("where", ["model", "object patch", "module shared by two models", "submodule",
                                   "inside another model's load"])
def test_a_weight_set_anew_between_runs_rebuilds_never_replays_the_old_one(gc, tiny, conds, where):
    """A node that sets a weight anew (``comfy.utils.set_attr_param``, as ComfyUI's loads do) outside the model's
    own load: on the model, on a module an object patch swapped in (also one swapped into two models), a
    submodule replaced whole, or a weight set while another model loads. No listener saw it and the graph
    replayed the old weight (3.2 and 4.7 off). Now the next call rebuilds and equals the plain run."""
    import copy

    import comfy.model_management
    import comfy.patcher_extension
    import comfy.utils

    model = tiny.tiny_flux(0)
    captured, plain = capture(model), model
    if where in ("object patch", "module shared by two models"):
        module = copy.deepcopy(model.model.diffusion_model.img_in)
        captured, plain = captured.clone(), model.clone()
        for patcher in (captured, plain):
            patcher.add_object_patch("diffusion_model.img_in", module)
        if where == "module shared by two models":  # captured last: the module is the other model's too
            other = capture(tiny.tiny_flux(1)).clone()
            other.add_object_patch("diffusion_model.img_in", module)
    sample(captured, conds)
    if where == "module shared by two models":
        sample(other, conds)
    assert last_run(gc)["replays"] > 0
    dm = model.model.diffusion_model
    if where == "submodule":
        swapped = copy.deepcopy(dm.img_in)
        with torch.no_grad():
            swapped.weight.mul_(1.5)
        dm.img_in = swapped
    elif where in ("object patch", "module shared by two models"):
        comfy.utils.set_attr_param(module, "weight", module.weight.detach() * 1.5)
    else:
        def edit(*args, **kwargs):
            comfy.utils.set_attr_param(model.model, "diffusion_model.img_in.weight", dm.img_in.weight.detach() * 1.5)

        loading = tiny.tiny_flux(2)
        if where == "inside another model's load":  # a node's callback on another model's load edits this one
            loading.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, edit)
            comfy.model_management.load_models_gpu([loading])
        else:
            edit()
    assert torch.equal(sample(captured, conds), sample(plain, conds))
    assert last_run(gc)["rebuilds"] == {"weights": 1}


def test_a_module_class_that_cannot_be_hashed_still_builds_while_graphs_follow_weights(gc):
    """The hook that sees weights set anew runs for every module in the process: one whose class defines
    ``__eq__`` alone (not hashable) failed to build once it was installed."""
    assert gc.graph_release.installed()

    class Compared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def __eq__(self, other):
            return isinstance(other, Compared)

    assert torch.equal(Compared().weight, torch.ones(2))


def test_weights_a_patchers_reload_sets_anew_are_counted_as_the_reload(gc, tiny, conds):
    """ComfyUI's unload and load set a LoRA'd model's weights anew themselves: the graphs are released for the
    reload, and the rebuild says so, not that a node set a weight (which a review saw after the hooks came)."""
    import comfy.model_management
    import comfy.sd
    from graph_helpers import tiny_lora

    model = tiny.tiny_flux(0)
    (lora, _) = comfy.sd.load_lora_for_models(capture(model), None, tiny_lora(), 1.0, 0)
    (plain, _) = comfy.sd.load_lora_for_models(model, None, tiny_lora(), 1.0, 0)
    sample(lora, conds)
    comfy.model_management.unload_all_models()
    assert torch.equal(sample(lora, conds), sample(plain, conds))
    comfy.model_management.unload_all_models()
    sample(lora, conds)
    assert last_run(gc)["rebuilds"] == {"unloaded": 1}


def test_a_clear_from_the_panel_while_a_capture_starts_never_fails_the_run(gc, tiny, conds):
    """The panel's clear runs on another thread. One landing while a capture read the kept graphs (a failed
    capture's entry among them) emptied them mid-read: the user's run died ("OrderedDict changed size during
    iteration"). Now the capture reads them under the set's lock; the clear waits, and the run equals eager."""
    import collections
    import threading

    registry = rkharness.pack("caching.stats").REGISTRY
    reuse = rkharness.pack("caching.graph_reuse")
    model = tiny.tiny_flux(0)
    captured = capture(model, max_graphs=4)
    sample(captured, conds, (1, 16, 8, 8))
    (gs,) = gc.graph_release._SETS[model.model].values()  # (other tests' models may still hold sets)
    clears = []

    class ClearedMidRead(collections.OrderedDict):
        def values(self):
            for i, value in enumerate(super().values()):
                yield value
                if i == 0 and not clears:  # the server thread's clear, given half a second to land
                    clears.append(threading.Thread(target=registry.clear, args=(gc.STATS.NAME,)))
                    clears[0].start()
                    clears[0].join(0.5)

    failed = reuse.Entry(reuse.Signature(("a failed capture",)), failed="kept after a fallback")
    with gs.lock:
        gs.entries = ClearedMidRead([(failed.signature, failed), *gs.entries.items()])
    out = sample(captured, conds, (1, 16, 12, 12))
    clears[0].join(30)
    assert torch.equal(out, sample(model, conds, (1, 16, 12, 12)))


@pytest.mark.parametrize("backend", ["trace", "emulate"])
def test_a_controlnets_residuals_reach_every_replay_of_an_sd_unet(gc, monkeypatch, tiny, conds, backend):
    """SD1.5's UNet pops each ControlNet residual from the lists it is handed as it adds it: a capture's
    warm-up once emptied the buffers' lists, and every replay then ran without the control (25 apart on
    this tiny model; the trace backend failed its capture). Each call now gets lists of its own."""
    import nodes

    monkeypatch.setattr(gc, "FORCE_BACKEND", backend)
    model = tiny.tiny_sd15(0)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(5))
    controlled = nodes.ControlNetApplyAdvanced().apply_controlnet(*conds, tiny.tiny_controlnet(3), image, 1.0, 0.0,
                                                                  1.0)[:2]
    expected = sample(model, controlled, (1, 4, 8, 8), steps=3)
    assert not torch.equal(expected, sample(model, conds, (1, 4, 8, 8), steps=3))  # the control matters here
    for seed in (7, 11):  # the second run replays every step
        assert torch.equal(sample(capture(model), controlled, (1, 4, 8, 8), steps=3, seed=seed),
                           sample(model, controlled, (1, 4, 8, 8), steps=3, seed=seed))
    run = last_run(gc)
    assert (run["captures"], run["replays"], run["bypasses"]) == (0, 3, {}), run


def test_a_forward_no_capture_can_follow_runs_eagerly_and_each_of_its_steps_is_counted(gc, tiny, conds):
    """A block patch that reads a value on the host cannot be traced (nor captured on a GPU): the capture
    fails, its warm-up's output is the step's, and every step of the run is counted eager."""
    protocol = rkharness.pack("caching.protocol")

    def reads_the_host(args, extra):
        out = extra["original_block"](args)
        return {**out, "img": out["img"] * (1.0 + 0.0 * out["img"].abs().max().item())}

    setattr(reads_the_host, protocol.GRAPH_SAFE, True)
    model = tiny.tiny_flux(0)
    plain, captured = model.clone(), capture(model)
    for m in (plain, captured):
        m.set_model_patch_replace(reads_the_host, "dit", "double_block", 0)
    assert torch.equal(sample(captured, conds, steps=3), sample(plain, conds, steps=3))
    run = last_run(gc)
    assert (run["captures"], run["bypasses"], run["eager_steps"], run["steps"]) == (0, {"capture_failed": 2}, 3, 3)
    assert gc.STATS.handle.snapshot()["counters"]["capture_failures"] == 1


def test_a_failed_capture_takes_no_graphs_place(gc, tiny, conds):
    """A signature whose capture failed holds no graph, only the verdict: kept among the graphs, it took a
    max_graphs slot, so with one graph kept a failed 12x12 latent evicted the 8x8 graph and the next 8x8 run
    captured again. Kept apart, the 8x8 graph replays after it, to the plain run's latent."""
    protocol = rkharness.pack("caching.protocol")

    def reads_the_host_at_12(args, extra):
        out = extra["original_block"](args)
        if out["img"].shape[1] != 36:  # 12x12 latent, 2x2 patches
            return out
        return {**out, "img": out["img"] * (1.0 + 0.0 * out["img"].abs().max().item())}

    setattr(reads_the_host_at_12, protocol.GRAPH_SAFE, True)
    model = tiny.tiny_flux(0)
    plain, captured = model.clone(), capture(model, max_graphs=1)
    for m in (plain, captured):
        m.set_model_patch_replace(reads_the_host_at_12, "dit", "double_block", 0)
    for shape, captures, replays, failed in (((1, 16, 8, 8), 1, 2, 0), ((1, 16, 12, 12), 0, 0, 2),
                                             ((1, 16, 8, 8), 0, 3, 0), ((1, 16, 12, 12), 0, 0, 3)):
        assert torch.equal(sample(captured, conds, shape), sample(plain, conds, shape))
        run = last_run(gc)
        assert (run["captures"], run["replays"], run["bypasses"].get("capture_failed", 0)) == \
            (captures, replays, failed), (shape, run)
    assert gc.STATS.handle.snapshot()["counters"]["capture_failures"] == 1
def test_a_step_cached_call_whose_graph_cannot_replay_runs_its_forward_once(gc, tiny, conds, monkeypatch):
    """Where a signature's capture failed (tracing cannot follow a step cache's hook), a computed step ran the
    step cache's probe, its first block here, then the whole forward again: a block more per computed step. It
    runs once now, as the step cache alone does, to the same latent."""
    import comfy.ldm.flux.layers as layers

    calls = []
    forward = layers.DoubleStreamBlock.forward
    monkeypatch.setattr(layers.DoubleStreamBlock, "forward",
                        lambda self, *args, **kwargs: (calls.append(1), forward(self, *args, **kwargs))[1])
    model = importlib.import_module(f"{tiny.__name__}.trained_flux").build()
    step = rkharness.pack("nodes.step_cache").TeaCacheNode

    def cached():
        return step.execute(model=model, rule="first_block", threshold=0.3, model_type="flux", start_percent=0.0,
                            end_percent=1.0, max_consecutive_skips=0, cache_device="device", residual_mode="reuse",
                            interval_power=1.0, first_blocks=1).args[0]

    alone = sample(cached(), conds, cfg=3.5, steps=6)
    once = len(calls)
    stacked = capture(cached())
    sample(stacked, conds, cfg=3.5, steps=6)  # its capture fails
    calls.clear()
    assert torch.equal(sample(stacked, conds, cfg=3.5, steps=6), alone) and len(calls) == once
    run, steps = last_run(gc), rkharness.pack("patches.step_cache").stats().snapshot()["info"]["last_run"]
    assert steps["calls_skipped"] > 0 and run["bypasses"] == {"capture_failed": steps["calls_computed"]}


def test_ltx2_stgs_blocks_key_the_graph_across_runs_and_within_one(gc, tiny):
    """LTXVSpatioTemporalGuidance puts the blocks it perturbs in the options as a frozenset, and the LTX-2
    forward branches on it in Python: keyed by its type alone, a graph captured for blocks 5 replayed for
    blocks 0 in the next run (2.2 from the plain run's latent), and a second STG node's pass in the same run
    replayed the first's. Keyed by its value, each set gets a graph of its own and every run equals the
    plain one."""
    import comfy.nested_tensor
    import comfy_extras.nodes_lt as lt

    import nodes

    families = importlib.import_module(f"{tiny.__name__}.families")
    model = families.family_spec("ltx2").build(0)
    g = torch.Generator().manual_seed(0)
    pos, neg = ([[torch.randn(1, 7, 2 * families.TEXT_DIM, generator=g), {"frame_rate": 25}]] for _ in range(2))

    def run(m, *blocks):
        for scale, which in zip((2.0, 1.0), blocks, strict=False):
            m = lt.LTXVSpatioTemporalGuidance.execute(m, scale, which, 0.0, 1.0).args[0]
        latent = {"samples": comfy.nested_tensor.NestedTensor([torch.zeros(1, 128, 2, 2, 2), torch.zeros(1, 8, 4, 16)])}
        out = nodes.common_ksampler(m, 5, 3, 2.0, "euler", "simple", pos, neg, latent)[0]["samples"]
        return torch.cat([t.flatten() for t in out.unbind()])

    plain = {blocks: run(model, *blocks) for blocks in (("5",), ("0",), ("5", "0"))}
    assert not torch.equal(plain[("5",)], plain[("0",)])  # the blocks matter here
    captured = capture(model, max_graphs=3)
    for blocks in (("5",), ("0",)):  # graphs are kept across runs (the default)
        assert torch.equal(run(captured, *blocks), plain[blocks]), blocks
    assert last_run(gc)["replays"] > 0
    assert torch.equal(run(capture(model, max_graphs=3), "5", "0"), plain[("5", "0")])
