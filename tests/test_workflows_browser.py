"""The demo in a real browser: Debian's Chromium, driven by Playwright, on the real server. The demo
opens from ComfyUI's template browser (the pack's workflows/ folder), runs from the page, and the
ReuseKit panel shows its hits. Saves test-artifacts/demo_panel.png."""

import time

import pytest
import rkharness

pytestmark = pytest.mark.workflows

DEMO = "ReuseKit demo (no downloads)"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def page():
    with rkharness.chromium() as browser, rkharness.running_server() as server:
        server.post("/settings", {"Comfy.TutorialCompleted": True})
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server.url + "/")
        page.wait_for_function("() => window.app && window.app.graph && window.app.extensionManager")
        try:
            yield page, server
        finally:
            rkharness.ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(rkharness.ARTIFACTS / "demo_browser_last.png"))


def test_the_demo_opens_from_the_template_browser_runs_and_the_panel_shows_hits(page):
    page, server = page
    page.keyboard.press("Escape")
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    card = page.get_by_text(DEMO, exact=True).first
    try:
        card.wait_for(timeout=5_000)
    except Exception:  # older front ends list an extension's templates under its folder name
        page.get_by_text("reusekit", exact=True).first.click()
        card.wait_for()
    card.click()
    page.wait_for_function("() => window.app.graph._nodes.some((n) => n.type === 'ReuseKitDemoFlux')")
    assert page.evaluate("() => window.app.graph._nodes.length") == len(rkharness.load_workflow(DEMO + ".json")["nodes"])
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.QueuePrompt')")
    deadline = time.monotonic() + 120
    while not server.get("/history") and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    (prompt_id,) = server.get("/history")
    entry = server.wait_for_prompt(prompt_id)
    assert entry["status"]["status_str"] == "success", entry["status"]
    images = [i for out in entry["outputs"].values() for i in out.get("images", [])]
    assert len(images) == 3
    button = page.locator('.reusekit-panel-tab-button, [data-testid="reusekit-panel-tab-button"]').first
    for _ in range(5):
        page.keyboard.press("Escape")
        try:
            button.click(timeout=3_000)
            break
        except Exception:
            continue
    page.locator("[data-rk=panel]").wait_for()
    hits = page.locator('[data-rk-cache="conditioning"] [data-rk-counter=hits] span').first
    hits.filter(has_text="3").wait_for()
    page.locator('[data-rk-kind="pe"] [data-rk-counter=hits]').first.wait_for()
    # the step cache's run: one strip cell per call for cond and uncond, some of them skipped
    run = page.locator('[data-rk-cache="teacache"] [data-rk=step-run]').first
    run.locator('[data-rk=strip] rect[data-state="S"]').first.wait_for()
    page.wait_for_timeout(500)
    rkharness.ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(rkharness.ARTIFACTS / "demo_panel.png"))
