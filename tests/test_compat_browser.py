"""Saved UI workflows load in the real front end with their values on the right widgets (Debian's
Chromium, driven by Playwright, on the real server; front end 1.32.9 on ComfyUI 0.3.75, 1.58.1 on 0.33).

The page restores widget values by position: the workflows saved before the step cache's rename
(tests/fixtures/compat/workflows) would put ``rel_l1_thresh`` on ``rule``, a number on ``model_type``...
web/compat.js maps them by name. Each is loaded the way a dropped file is (``app.loadGraphData``); every
ReuseKit node then holds, under each input's name, the value it was saved with (the old inputs' meaning
for the ones it lacked), and the page's own prompt for it carries them. Fails on any console error.
"""

import json

import pytest
import rkharness

pytestmark = pytest.mark.workflows

FIXTURES = rkharness.TESTS / "fixtures" / "compat" / "workflows"
WORKFLOWS = sorted(p.name for p in FIXTURES.glob("*.json"))
STEP_CACHE_OLD = ["model_type", "rel_l1_thresh", "start_percent", "end_percent", "max_consecutive_skips",
                  "cache_device", "residual_mode"]  # the widget order of e4abf85
SETTINGS_OLD = ["global_mode", "budget_mib", "max_entries", "device_hot_negatives", "clear"]  # 5cee1e8..d91176a
TIMEOUT_MS = 60_000

WIDGETS = """(id) => {
    const node = window.app.graph.getNodeById(id);
    return node ? Object.fromEntries((node.widgets ?? []).map((w) => [w.name, w.value])) : null;
}"""
PROMPT_INPUTS = """async (id) => (await window.app.graphToPrompt()).output[String(id)]?.inputs ?? null"""


@pytest.fixture(scope="module")
def page():
    with rkharness.chromium() as browser, rkharness.running_server() as server:
        server.post("/settings", {"Comfy.TutorialCompleted": True})
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "reusekit" in m.text.lower() else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_function("() => window.app && window.app.graph && window.app.extensionManager")
        page.keyboard.press("Escape")
        try:
            yield page, errors
        finally:
            rkharness.ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(rkharness.ARTIFACTS / "compat_browser_last.png"))


def load(page, workflow: dict) -> None:
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", workflow)


def expected_step_cache(saved: list) -> dict:
    old = dict(zip(STEP_CACHE_OLD, saved, strict=True))
    return {"rule": "teacache", "threshold": old.pop("rel_l1_thresh"), **old, "interval_power": 1.0, "first_blocks": 1}


@pytest.mark.parametrize("name", WORKFLOWS)
def test_a_workflow_saved_before_the_rename_loads_with_its_values_on_the_right_widgets(page, name):
    page, errors = page
    workflow = json.loads((FIXTURES / name).read_text())
    load(page, workflow)
    checked = 0
    for node in workflow["nodes"]:
        if not node["type"].startswith("ReuseKit"):
            continue
        shown = page.evaluate(WIDGETS, node["id"])
        assert shown is not None, f"{name}: node {node['id']} ({node['type']}) did not load"
        if node["type"] == "ReuseKitTeaCache":
            want = expected_step_cache(node["widgets_values"])
            assert shown == want, (name, node["widgets_values"], shown)
            sent = page.evaluate(PROMPT_INPUTS, node["id"])
            assert {k: v for k, v in sent.items() if k in want} == want, sent  # what the page queues
            checked += 1
        else:  # the other nodes' inputs kept their order: the saved values, in order
            values = [v for v in node.get("widgets_values") or []]
            assert list(shown.values())[:len(values)] == values, (name, node["type"], shown)
    assert checked >= 1
    assert not errors, errors


def test_a_cached_ksampler_and_the_settings_node_with_old_layouts_load_by_name(page):
    """No example saved these two with their old inputs: a workflow as the page of then saved them."""
    page, errors = page
    step_old = ["auto", 0.6, 0.1, 0.9, 2, "cpu", "reuse"]
    settings_old = [True, 256, 64, True, False]
    workflow = {"last_node_id": 2, "last_link_id": 0, "links": [], "groups": [], "config": {}, "version": 0.4,
                "extra": {}, "nodes": [
                    {"id": 1, "type": "ReuseKitCachedKSampler", "pos": [0, 0], "size": [300, 400], "flags": {},
                     "order": 0, "mode": 0, "properties": {},
                     "inputs": [{"name": n, "type": t, "link": None} for n, t in
                                (("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                                 ("latent_image", "LATENT"))],
                     "outputs": [{"name": "LATENT", "type": "LATENT", "links": None}],
                     "widgets_values": [7, "fixed", 20, 3.5, "euler", "simple", 1.0, *step_old]},
                    {"id": 2, "type": "ReuseKitConditioningCacheSettings", "pos": [400, 0], "size": [300, 200],
                     "flags": {}, "order": 1, "mode": 0, "properties": {}, "inputs": [], "outputs": [],
                     "widgets_values": settings_old}]}
    load(page, workflow)
    sampler = page.evaluate(WIDGETS, 1)
    assert {k: sampler[k] for k in ("seed", "steps", "cfg", "sampler_name", "scheduler", "denoise")} == {
        "seed": 7, "steps": 20, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
    assert {k: v for k, v in sampler.items() if k in expected_step_cache(step_old)} == expected_step_cache(step_old)
    settings = page.evaluate(WIDGETS, 2)
    old = dict(zip(SETTINGS_OLD, settings_old, strict=True))
    del old["device_hot_negatives"]
    assert settings == old  # clear stays off (by position it would have taken device_hot_negatives' True)
    assert not errors, errors


TYPE_THRESHOLD = """async ([type, value]) => {
    const node = LiteGraph.createNode(type);
    window.app.graph.add(node);
    const w = node.widgets.find((w) => w.name === "threshold");
    if (w.setValue) w.setValue(value, {node, canvas: window.app.canvas});
    else { w.value = value; w.callback?.call(w, value, window.app.canvas, node); }
    const inputs = (await window.app.graphToPrompt()).output[String(node.id)]?.inputs;
    window.app.graph.remove(node);
    return [w.value, inputs?.threshold];
}"""


@pytest.mark.parametrize("node_type", ["ReuseKitTeaCache", "ReuseKitCachedKSampler"])
def test_a_threshold_typed_with_four_decimals_reaches_the_prompt_as_typed(page, node_type):
    """The run's log names the defaults' threshold with up to four decimals (0.5839 at 31 steps on Flux), for a
    user to set it and keep the picture across updates (README "Compatibility"). The page rounded a typed value
    to the step's two decimals (0.58: another picture); the widget keeps four."""
    page, errors = page
    assert page.evaluate(TYPE_THRESHOLD, [node_type, 0.5839]) == [0.5839, 0.5839]
    assert page.evaluate(TYPE_THRESHOLD, [node_type, 0.58394]) == [0.5839, 0.5839]  # the input's round stays
    assert not errors, errors
