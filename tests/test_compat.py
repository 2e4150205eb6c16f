"""Saved prompts keep working: a node's inputs are a public API (README "Compatibility").

The API prompts of tests/fixtures/compat were written for the inputs the step cache had before a7ea1af
renamed ``rel_l1_thresh`` to ``threshold`` and added ``rule`` (and, the oldest, before ``residual_mode``):
each validates and runs through ComfyUI's real validator and executor and gives exactly what the same
settings written in today's inputs give (the meaning they had then: the TeaCache rule, ``rel_l1_thresh``
as the threshold, a reused residual where no ``residual_mode`` was given). The README there says where each
prompt comes from and that the code of then gave the same outputs.
"""

import asyncio
import copy
import json
import logging
import uuid

import pytest
import rkharness
import torch

pytestmark = pytest.mark.workflows

FIXTURES = rkharness.TESTS / "fixtures" / "compat"
PROMPTS = json.loads((FIXTURES / "api_prompts_before_rename.json").read_text())
STEP_NODES = ("ReuseKitTeaCache", "ReuseKitCachedKSampler")
SAMPLERS = ("KSampler", "ReuseKitCachedKSampler")


def step_nodes(prompt: dict) -> list[dict]:
    return [n["inputs"] for n in prompt.values() if n["class_type"] in STEP_NODES]


def in_todays_inputs(prompt: dict) -> dict:
    """The same settings written in today's inputs, with the meaning the old ones had."""
    prompt = copy.deepcopy(prompt)
    for inputs in step_nodes(prompt):
        inputs["threshold"] = inputs.pop("rel_l1_thresh")
        inputs["rule"] = "teacache"
        inputs.setdefault("residual_mode", "reuse")
    for node in prompt.values():
        if node["class_type"] == "ReuseKitDemoPromptBatch":
            node["class_type"] = "ReuseKitPromptBatch"
    return prompt


def run(prompt: dict) -> tuple[list[torch.Tensor], dict]:
    """The samplers' latents (in node order) and the step cache's last run summary."""
    executor = rkharness.Executor(cache="classic")
    executor.run(copy.deepcopy(prompt))
    latents = []
    for node_id in sorted((k for k, n in prompt.items() if n["class_type"] in SAMPLERS), key=int):
        latents += [out["samples"].clone() for out in executor.output(node_id)[0]]
    stats = rkharness.pack("caching.stats").REGISTRY.snapshot()
    step = next(c for c in stats["caches"] if c["kind"] == "step")
    return latents, step["info"]["last_run"]


def validate(prompt: dict) -> tuple:
    import execution

    rkharness.load_extra_nodes()
    return asyncio.run(execution.validate_prompt(str(uuid.uuid4()), copy.deepcopy(prompt), None))


def test_the_fixtures_are_prompts_of_the_old_inputs():
    assert len(PROMPTS) >= 10
    for name, prompt in PROMPTS.items():
        nodes = step_nodes(prompt)
        assert nodes, name
        for inputs in nodes:
            assert "rel_l1_thresh" in inputs and "threshold" not in inputs and "rule" not in inputs, name
    assert any("residual_mode" not in i for p in PROMPTS.values() for i in step_nodes(p))
    assert any(n["class_type"] == "ReuseKitCachedKSampler" for p in PROMPTS.values() for n in p.values())
    assert any(n["class_type"] == "ReuseKitDemoPromptBatch" for p in PROMPTS.values() for n in p.values())


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_an_old_prompt_validates_runs_and_equals_its_settings_in_todays_inputs(name):
    prompt = PROMPTS[name]
    valid = validate(prompt)
    assert valid[0], (valid[1], valid[3])
    old, old_run = run(prompt)
    new, new_run = run(in_todays_inputs(prompt))
    assert old and len(old) == len(new)
    assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    assert old_run["rule"] == "teacache" and old_run["threshold"] == step_nodes(prompt)[-1]["rel_l1_thresh"]
    assert old_run["residual_mode"] == step_nodes(prompt)[-1].get("residual_mode", "reuse")
    assert {k: v["pattern"] for k, v in old_run["conds"].items()} == {k: v["pattern"] for k, v in new_run["conds"].items()}
    if step_nodes(prompt)[-1]["rel_l1_thresh"] > 0:
        assert old_run["calls_skipped"] > 0  # the cache skipped: the mapped settings had their effect


def test_a_prompt_from_before_residual_mode_reuses_the_residual_as_it_did_then():
    """What a wrong mapping would give differs: the family's default residual mode (extrapolate on Flux)."""
    (name,) = [n for n in PROMPTS if n.startswith("api v1")]
    old, _ = run(PROMPTS[name])
    extrapolated = in_todays_inputs(PROMPTS[name])
    step_nodes(extrapolated)[0]["residual_mode"] = "extrapolate"
    other, run_summary = run(extrapolated)
    assert run_summary["calls_skipped"] > 0 and not torch.equal(old[0], other[0])


def _legacy(value) -> dict:
    prompt = copy.deepcopy(PROMPTS["api v2 rel=0.8 device reuse"])
    (inputs,) = step_nodes(prompt)
    inputs["rel_l1_thresh"] = value
    return prompt


def test_a_linked_rel_l1_thresh_is_read_like_a_written_one():
    linked = _legacy(["20", 0])
    linked["20"] = {"class_type": "PrimitiveFloat", "inputs": {"value": 0.8}}
    assert validate(linked)[0]
    assert torch.equal(run(linked)[0][0], run(_legacy(0.8))[0][0])


def _expanded(prompt: dict, monkeypatch) -> dict:
    """``prompt`` with its step cache node made at run time by another node's expansion (a group or loop pack's
    GraphBuilder), written with the same inputs: such a node is in ComfyUI's DYNPROMPT, not its PROMPT."""
    from comfy_execution.graph_utils import GraphBuilder

    import nodes

    prompt = copy.deepcopy(prompt)
    (node_id,) = [k for k, n in prompt.items() if n["class_type"] == "ReuseKitTeaCache"]
    written = {k: v for k, v in prompt[node_id]["inputs"].items() if k != "model"}

    class Expands:
        RETURN_TYPES, FUNCTION, CATEGORY = ("MODEL",), "run", "testing"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("MODEL",)}}

        def run(self, model):
            graph = GraphBuilder()
            made = graph.node("ReuseKitTeaCache", model=model, **written)
            return {"result": (made.out(0),), "expand": graph.finalize()}

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "ReuseKitTestExpands", Expands)
    prompt[node_id] = {"class_type": "ReuseKitTestExpands", "inputs": {"model": prompt[node_id]["inputs"]["model"]}}
    return prompt


def test_a_step_cache_node_made_by_an_expansion_reads_its_old_inputs_and_refuses_a_typo(monkeypatch):
    """A node another node's expansion made is not in the prompt as sent: its rel_l1_thresh was dropped without a
    word (7.5 from the same prompt written directly) and a typo ran the defaults. Both read as on any node."""
    assert torch.equal(run(_expanded(_legacy(0.8), monkeypatch))[0][0], run(_legacy(0.8))[0][0])
    typo = copy.deepcopy(PROMPTS["api v2 rel=0.8 device reuse"])
    step_nodes(typo)[0]["thresold"] = 0.3
    with pytest.raises(AssertionError, match="'thresold' is not an input of this node"):
        run(_expanded(typo, monkeypatch))


def test_rel_l1_thresh_is_mapped_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="reusekit")
    for _ in range(2):
        run(_legacy(0.77))
    said = [r.getMessage() for r in caplog.records if "rel_l1_thresh" in r.getMessage()]
    assert len(said) == 1 and "threshold=0.77" in said[0] and "rule=teacache" in said[0], said


def test_a_rel_l1_thresh_written_as_text_is_read_as_its_number():
    """ComfyUI converts a FLOAT input written as text ("0.4"), as it did rel_l1_thresh before the rename: the
    old name refused it until 2026-12-06, where ``threshold: "0.4"`` runs."""
    assert validate(_legacy("0.8"))[0]
    assert torch.equal(run(_legacy("0.8"))[0][0], run(_legacy(0.8))[0][0])


@pytest.mark.parametrize("value", [-0.1, float("nan"), "nan", "0.4x", True, 10.5,  # 10: its old maximum
                                   [0.3, 1]])  # a list, not a link (ComfyUI's links start with a node id string)
def test_a_bad_rel_l1_thresh_is_an_error_naming_it(value):
    with pytest.raises(AssertionError, match=r"ReuseKit Step Cache: rel_l1_thresh \(now threshold\) must be"):
        run(_legacy(value))


def test_rel_l1_thresh_and_a_different_threshold_are_an_error_naming_both():
    prompt = _legacy(0.8)
    step_nodes(prompt)[0]["threshold"] = 0.3
    with pytest.raises(AssertionError, match="threshold .* and its old name rel_l1_thresh .* disagree"):
        run(prompt)


def test_a_prompt_in_todays_inputs_may_leave_every_cache_input_out():
    """Absent inputs take the widgets' defaults (rule auto, threshold -1: the family's benchmarked choice)."""
    prompt = copy.deepcopy(PROMPTS["api v2 rel=0.8 device reuse"])
    (inputs,) = step_nodes(prompt)
    bare = {"model": inputs["model"]}
    prompt["4"]["inputs"] = bare
    assert validate(prompt)[0]
    _, summary = run(prompt)
    tc = rkharness.pack("caching.step_cache")
    rule, anchors, mode = tc.FAMILY_DEFAULTS["flux"]
    assert (summary["rule"], summary["residual_mode"]) == (rule, mode)
    assert summary["threshold"] == tc.default_threshold(anchors, summary["steps"])


def test_removed_inputs_of_the_conditioning_nodes_are_ignored_with_one_log_line(caplog):
    """device_hot (ReuseKit Cached CLIP) and device_hot_negatives (the settings node) went on 2026-11-30:
    a prompt that still gives them validates, runs as without them, and says so once."""
    settings = rkharness.pack("caching.settings").SETTINGS
    current = {"global_mode": settings.get("conditioning.enabled"),
               "budget_mib": settings.get("conditioning.budget_mib"),
               "max_entries": settings.get("conditioning.max_entries"), "clear": False}
    prompt = {"1": {"class_type": "RKTestSharedTinyCheckpoint", "inputs": {"family": "flux", "seed": 0, "text": "tiny"}},
              "2": {"class_type": "ReuseKitCachedCLIP", "inputs": {"clip": ["1", 1], "device_hot": True}},
              "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": "a removed input"}},
              "4": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["3", 0]}},
              "5": {"class_type": "ReuseKitConditioningCacheSettings",
                    "inputs": {**current, "device_hot_negatives": True}}}
    caplog.set_level(logging.INFO, logger="reusekit")
    assert validate(prompt)[0]
    for _ in range(2):
        rkharness.Executor(cache="none").run(prompt)
    said = [r.getMessage() for r in caplog.records if "is ignored: the input was removed" in r.getMessage()]
    assert sorted(m.split(":")[0] for m in said) == ["ReuseKit Cached CLIP", "ReuseKit Conditioning Cache Settings"]
    assert "device_hot=True" in said[0] + said[1] and "device_hot_negatives=True" in said[0] + said[1]
    assert settings.get("conditioning.budget_mib") == current["budget_mib"]


def test_the_old_prompt_batch_id_names_itself_in_its_errors():
    """ReuseKitDemoPromptBatch ran ReuseKit Prompt Batch's code under that node's name: its refusal named a node
    the user's workflow does not have, in the error and in the stats (until 2026-12-06)."""
    import nodes

    stats = rkharness.pack("caching.conditioning").CACHE.stats
    old = nodes.NODE_CLASS_MAPPINGS["ReuseKitDemoPromptBatch"]
    name = old.GET_SCHEMA().display_name
    with pytest.raises(ValueError, match=r"^ReuseKit Demo Prompt Batch \(old name of ReuseKit Prompt Batch\): prompts has"):
        old.execute(prompts=" \n")
    assert any(r["source"] == name and r["event"] == "refused" for r in stats.reasons()), stats.reasons()
