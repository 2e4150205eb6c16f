"""Conditioning cache end to end: real workflows through the real executor, counting real encoder
forward calls, with ComfyUI's own cache alone and with ReuseKit."""

import importlib.util

import numpy as np
import pytest
import rkharness
import torch

pytestmark = [pytest.mark.conditioning, pytest.mark.workflows]


def _bench():
    spec = importlib.util.spec_from_file_location("rk_bench_conditioning", rkharness.ROOT / "bench" / "conditioning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


@pytest.fixture(scope="module")
def lora_name(tiny):
    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    return loras.write_lora("rk_test_scenarios.safetensors", seed=3)


@pytest.fixture(scope="module")
def table(lora_name):
    return BENCH.scenarios(lora_name)


@pytest.mark.parametrize("name,mode", [
    ("b. A, B, A, fixed negative", "classic"),
    ("c. shared negative, 2 workflows", "classic"),
    ("d. LoraLoader, strength_model only", "classic"),
    ("d. LoraLoader, strength_model only", "none"),  # LoRA file read again each run: matched by content
])
def test_reusekit_hits_where_comfyui_recomputes(table, name, mode):
    ideal, prompts = table[name]
    core, _ = BENCH.run_scenario(rkharness, prompts, mode, reusekit=False)
    with_cache, _ = BENCH.run_scenario(rkharness, prompts, mode, reusekit=True)
    assert core > ideal and with_cache == ideal, (core, with_cache)


def test_a_workflow_with_the_cached_node_encodes_once(table, tmp_path):
    """Global mode off: only the Cached CLIP node routes; a rerun (new seed, no ComfyUI cache) hits, and
    its conditioning is the one the plain encoder gives. The prompt still passes the removed ``device_hot``
    input, as prompts saved before do: ComfyUI validates and runs it, dropping the input."""
    from safetensors.torch import load_file

    import nodes

    settings = rkharness.pack("caching.settings").SETTINGS
    cache = rkharness.pack("caching.conditioning").CACHE
    prompts = []
    for seed in (1, 2):
        p = BENCH.prompt("a red square", seed=seed)
        p["30"] = {"class_type": "ReuseKitCachedCLIP", "inputs": {"clip": ["1", 1], "device_hot": True}}
        p["3"]["inputs"]["clip"] = ["30", 0]
        p["20"]["inputs"]["clip"] = ["30", 0]
        p["40"] = {"class_type": "RKTestSaveConditioning",
                   "inputs": {"conditioning": ["20", 0], "path": str(tmp_path / f"{seed}.safetensors")}}
        prompts.append(p)
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", False)
    cache.clear()
    try:
        executor = rkharness.Executor(cache="none")
        with BENCH.counting_encoder_forwards() as calls:
            for p in prompts:
                executor.run(p)
        assert calls[0] == 2 and cache.count("hits.text") >= 2
        clip = nodes.NODE_CLASS_MAPPINGS["RKTestSharedTinyCheckpoint"]().load("flux", 0)[1]
        ((plain, extra),) = nodes.CLIPTextEncode().encode(clip, "a red square")[0]  # global mode off: uncached
        for seed in (1, 2):
            saved = load_file(str(tmp_path / f"{seed}.safetensors"))
            assert torch.equal(saved["cond"], plain) and torch.equal(saved["pooled"], extra["pooled_output"])
    finally:
        settings.set("conditioning.enabled", before)
        cache.clear()


def test_sampled_latents_are_identical_with_and_without_the_cache(table):
    import nodes

    settings = rkharness.pack("caching.settings").SETTINGS
    loader = nodes.NODE_CLASS_MAPPINGS["RKTestSharedTinyCheckpoint"]()
    model, clip, _ = loader.load("flux", 0)
    latent = {"samples": torch.zeros(1, 16, 8, 8)}

    def run():
        (pos,) = nodes.CLIPTextEncode().encode(clip, "a (red:1.2) square")
        (neg,) = nodes.CLIPTextEncode().encode(clip, "blurry")
        return nodes.common_ksampler(model, 5, 2, 2.0, "euler", "simple", pos, neg, latent)[0]["samples"]

    before = settings.get("conditioning.enabled")
    try:
        settings.set("conditioning.enabled", False)
        reference = run()
        settings.set("conditioning.enabled", True)
        assert torch.equal(reference, run()) and torch.equal(reference, run())  # miss, then hit
    finally:
        settings.set("conditioning.enabled", before)


def test_example_workflow_runs_on_tiny_models_and_reuses_across_prompt_edits():
    workflow = rkharness.load_workflow("conditioning_prompt_variations.json")
    notes = [n for n in workflow["nodes"] if n["type"] == "Note"]
    assert notes and "expect" in notes[0]["widgets_values"][0].lower()
    small = {"6": {"width": 64, "height": 64}, "7": {"steps": 2}}
    texts = ["a red fox sitting in fresh snow", "a red fox in a pine forest", "a red fox sitting in fresh snow"]
    cache = rkharness.pack("caching.conditioning").CACHE
    cache.clear()
    executor = rkharness.Executor()
    images = []
    with BENCH.counting_encoder_forwards() as calls:
        for i, text in enumerate(texts):
            overrides = {**small, "4": {"text": text}, "7": {"steps": 2, "seed": i % 2}}
            result = executor.run(rkharness.workflow_to_prompt(workflow, overrides=overrides))
            images.append(rkharness.output_pixels(result["outputs"]["9"]))
    assert calls[0] == 3  # A, the negative, B; the third run encodes nothing
    assert np.array_equal(images[2], images[0]) and not np.array_equal(images[1], images[0])  # A's hits give A's
    (text,) = result["outputs"]["10"]["text"]
    assert "[conditioning] conditioning" in text and "hits=" in text
    cache.clear()



@pytest.fixture
def settings_restored():
    """The conditioning settings and cache, put back as they were after the test."""
    settings = rkharness.pack("caching.settings").SETTINGS
    cache = rkharness.pack("caching.conditioning").CACHE
    keys = ("conditioning.enabled", "conditioning.budget_mib", "conditioning.max_entries")
    saved = {k: settings.get(k) for k in keys}
    try:
        yield settings, cache
    finally:
        settings.update(saved)
        cache.clear()


def settings_prompt(budget_mib: int, max_entries: int, **old_inputs) -> dict:
    return {"1": {"class_type": "ReuseKitConditioningCacheSettings",
                  "inputs": {"global_mode": True, "budget_mib": budget_mib, "max_entries": max_entries,
                             "clear": True, **old_inputs}}}


def test_settings_node_applies_settings_through_the_executor(settings_restored):
    settings, cache = settings_restored
    # saved before device_hot_negatives was removed: ComfyUI drops the unknown input
    result = rkharness.Executor().run(settings_prompt(64, 7, device_hot_negatives=False))
    assert settings.get("conditioning.budget_mib") == 64 and settings.get("conditioning.max_entries") == 7
    assert cache.budget_bytes == 64 << 20 and cache.max_entries == 7 and len(cache) == 0
    (text,) = result["outputs"]["1"]["text"]
    assert "conditioning" in text and "64.0 MiB" in text


def test_settings_node_applies_once_per_change_through_the_executor(tiny, settings_restored):
    """Re-queued unchanged, the node neither rewrites settings changed since (panel) nor clears again."""
    settings, cache = settings_restored
    prompt = settings_prompt(48, 9)
    clip = tiny.tiny_clip(0)
    executor = rkharness.Executor()
    executor.run(prompt)
    assert settings.get("conditioning.budget_mib") == 48 and len(cache) == 0
    settings.set("conditioning.budget_mib", 96)  # the panel changes it afterwards
    with torch.inference_mode():
        clip.encode_from_tokens(clip.tokenize("kept across a re-queue"))
    for run in (executor.run, rkharness.Executor(cache="none").run):
        run(prompt)
        assert settings.get("conditioning.budget_mib") == 96 and len(cache) == 1
    prompt["1"]["inputs"]["budget_mib"] = 40  # a changed input applies (and clears) once
    executor.run(prompt)
    assert settings.get("conditioning.budget_mib") == 40 and len(cache) == 0
