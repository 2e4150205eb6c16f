"""Graph capture under faults and pressure: ComfyUI's interrupt in the middle of a run through the real
executor (``trace`` backend, so a stale replay would show as a wrong output) leaves no graph held and
the next run equal to a clean one; under a small simulated VRAM budget ComfyUI's ``free_memory``
frees the pack's graph pools before it unloads any model."""

import threading
import time

import pytest
import rkharness
import torch
from graph_helpers import capture, conds_fixture, counters, gc_fixture, last_run, sample  # noqa: F401  (the fixtures gc and conds)

pytestmark = [pytest.mark.hardening, pytest.mark.graph]
DEFAULT_BACKEND = "trace"
STEPS = 24  # the signature holds the run's sigmas: the run after the interrupt has as many steps


def _prompt(seed: int, steps: int, graph: bool, keep: bool = True) -> dict:
    model = ["6", 0] if graph else ["1", 0]
    prompt = {
        "1": {"class_type": "RKTestSharedTinyCheckpoint", "inputs": {"family": "flux", "seed": 0, "text": "tiny"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a red square"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "7": {"class_type": "KSampler",
              "inputs": {"model": model, "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                         "seed": seed, "steps": steps, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0}},
        "8": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["7", 0]}},
    }
    if graph:
        prompt["6"] = {"class_type": "ReuseKitGraphCapture",
                       "inputs": {"model": ["1", 0], "enable": True, "max_graphs": 2, "keep_graphs": keep}}
    return prompt


def _sets(gc):
    release = gc.graph_release
    with release._SETS_LOCK:
        return [gs for by_limit in release._SETS.values() for gs in by_limit.values()]


def _interrupt_after_replays(gc, n: int) -> threading.Thread:
    """ComfyUI's interrupt, from another thread (as the server's /interrupt), once ``n`` replays ran."""
    import comfy.model_management as mm

    start = gc.STATS.handle.snapshot()["counters"].get("replays", 0)

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if gc.STATS.handle.snapshot()["counters"].get("replays", 0) >= start + n:
                mm.interrupt_current_processing(True)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("keep", [False, True])
def test_an_interrupt_mid_run_leaves_no_graph_held_and_the_next_run_is_clean(gc, keep):
    protocol = rkharness.pack("caching.protocol")
    ex = rkharness.Executor()
    watcher = _interrupt_after_replays(gc, 3)
    prompt_id = "interrupted"
    import asyncio

    import execution

    long_run = _prompt(seed=5, steps=STEPS, graph=True, keep=keep)
    valid = asyncio.run(execution.validate_prompt(prompt_id, long_run, None))
    assert valid[0], valid
    ex.executor.execute(long_run, prompt_id, {"client_id": None}, valid[2])
    watcher.join(timeout=5)
    assert not ex.executor.success
    assert "execution_interrupted" in [m[0] for m in ex.executor.status_messages], ex.executor.status_messages
    run = last_run(gc)
    assert run["captures"] == 1 and run["replays"] >= 3 and run["steps"] < STEPS, run
    # every forward counted once: captured, replayed or eager (the one the interrupt stopped, at most, none)
    assert run["steps"] - (run["captures"] + run["replays"] + run["eager_steps"]) in (0, 1), run
    # no capture or forward left in progress, nothing waiting to be freed
    assert not protocol.capturing()
    assert all(gs.busy == 0 and not gs.doomed for gs in _sets(gc))
    held = gc.STATS.handle.snapshot()
    entries = [e for gs in _sets(gc) for e in gs.entries.values()]
    assert held["entries"] == len(entries) == (1 if keep else 0)
    assert held["bytes"]["device"] == sum(e.nbytes for e in entries) and (held["bytes"]["device"] > 0) == keep
    assert held["info"]["held"]["graphs"] == len(entries)
    if not keep:
        assert counters(gc)["releases.run_ended"] == 1

    after = ex.run(_prompt(seed=9, steps=STEPS, graph=True, keep=keep))
    assert "[graph] graph_reuse" in after["outputs"]["8"]["text"][0]
    got = ex.output("7")[0][0]["samples"]
    run = last_run(gc)
    assert (run["captures"], run["replays"]) == ((0, STEPS) if keep else (1, STEPS - 1)), run
    ex.run(_prompt(seed=9, steps=STEPS, graph=False))
    assert torch.equal(got, ex.output("7")[0][0]["samples"])


class LoadedModel:
    """What ComfyUI's ``free_memory`` reads of an entry of ``current_loaded_models``, for a model
    taking ``size`` bytes of the simulated device; records the pack's device bytes at its unload."""

    def __init__(self, patcher, device: torch.device, size: int, pack_bytes):
        self.model, self.device, self.size, self.pack_bytes = patcher, device, size, pack_bytes
        self.loaded, self.currently_used, self.unloads = True, True, []

    def is_dead(self) -> bool:
        return False

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory(self) -> int:
        return self.size

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        self.unloads.append(self.pack_bytes())
        self.loaded = False
        return True


@pytest.fixture
def device_budget(gc, tiny, conds):
    """A graph captured on a tiny Flux and counted as if on ``cuda:0``, a loaded model there, and
    ``get_free_memory`` answering from a budget the two share."""
    import comfy.model_management as mm

    gc.graph_release.install()
    model = tiny.tiny_flux(0)
    sample(capture(model), conds)
    cuda = torch.device("cuda", 0)
    for gs in _sets(gc):
        for entry in gs.entries.values():
            entry.runner.device = cuda  # the runner's buffers and kept weights stand for a device pool

    def pack_bytes() -> int:
        return gc.STATS.handle.snapshot()["bytes"]["device"]

    graphs = pack_bytes()
    assert graphs > 0
    loaded = LoadedModel(model, cuda, size=4 * graphs, pack_bytes=pack_bytes)
    budget = 10 * graphs

    def get_free_memory(dev=None, torch_free_too=False):
        free = budget - pack_bytes() - (loaded.size if loaded.loaded else 0)
        return (free, free) if torch_free_too else free

    host = (mm.get_free_memory, mm.current_loaded_models)

    def restore():
        mm.get_free_memory, mm.current_loaded_models = host

    mm.get_free_memory, mm.current_loaded_models = get_free_memory, [loaded]
    try:
        yield {"cuda": cuda, "graphs": graphs, "loaded": loaded, "free": get_free_memory, "pack_bytes": pack_bytes,
               "model": model, "restore": restore}
    finally:
        restore()


def test_under_a_small_vram_budget_graph_pools_go_before_any_model(gc, device_budget, conds):
    import comfy.model_management as mm

    b = device_budget
    free0 = b["free"]()
    mm.free_memory(free0 + b["graphs"] // 2, b["cuda"])  # the graphs alone make room
    assert b["pack_bytes"]() == 0 and b["loaded"].unloads == [] and b["loaded"].loaded
    assert gc.STATS.handle.snapshot()["info"]["held"]["graphs"] == 0 and counters(gc)["releases.memory"] == 1
    b["restore"]()  # ComfyUI's own loaded models and memory again: the next run captures anew
    assert torch.equal(sample(capture(b["model"]), conds), sample(b["model"], conds))
    assert last_run(gc)["rebuilds"] == {"memory": 1}


def test_when_graphs_are_not_enough_they_go_first_then_comfyui_unloads(gc, device_budget):
    import comfy.model_management as mm

    b = device_budget
    mm.free_memory(b["free"]() + b["graphs"] + b["loaded"].size // 2, b["cuda"])
    assert b["loaded"].unloads == [0]  # when ComfyUI unloaded the model, the pack held nothing there
    assert b["pack_bytes"]() == 0 and counters(gc)["releases.memory"] == 1
