"""The demo models shipped in the pack and the example workflows: every workflow is well formed and
runs through the real server, the demo with every layer on, compared with the pack off."""

import importlib
import importlib.util
import json
import math
import urllib.parse

import pytest
import rkharness
import torch

pytestmark = pytest.mark.workflows


def shapes():
    return rkharness.pack("nodes.demo_models.shapes")


def demo():
    return rkharness.pack("nodes.demo")


# ---- the demo models ------------------------------------------------------------------------

def test_the_tests_use_the_packs_demo_weights_one_copy():
    trained = importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux")
    pack_dir = rkharness.ROOT / "nodes" / "demo_models"
    assert trained.WEIGHTS == pack_dir / "flux_shapes.safetensors" == shapes().WEIGHTS
    assert trained.WAN_WEIGHTS == pack_dir / "wan_shapes.safetensors"
    found = sorted(p.relative_to(rkharness.ROOT) for p in rkharness.ROOT.rglob("*_shapes.safetensors")
                   if ".host" not in p.parts and not p.parts[0].startswith(".venv"))
    assert [str(p) for p in found] == ["nodes/demo_models/flux_shapes.safetensors",
                                      "nodes/demo_models/wan_shapes.safetensors"]


def test_the_demo_clip_is_the_clip_the_models_were_trained_with(tiny):
    import nodes

    ours, theirs = shapes().build_clip(), tiny.tiny_clip(0)
    for text in ("a red circle on a black background", ""):
        (a,) = nodes.CLIPTextEncode().encode(ours, text)
        (b,) = nodes.CLIPTextEncode().encode(theirs, text)
        assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1]["pooled_output"], b[0][1]["pooled_output"])


@pytest.mark.parametrize("family,shape", [("flux", (1, 16, 8, 8)), ("wan", (1, 16, 1, 8, 8))])
def test_the_demo_models_draw_their_captions(family, shape):
    """Through the demo nodes: the decoded picture has the caption's colours (a wrong caption does not)."""
    import nodes

    model, clip = (demo().DemoFlux if family == "flux" else demo().DemoWan).execute().args
    (neg,) = nodes.CLIPTextEncode().encode(clip, "")
    errors = {}
    for text, color, bg in (("a red circle on a black background", "red", "black"),
                            ("a blue square on a white background", "blue", "white")):
        (pos,) = nodes.CLIPTextEncode().encode(clip, text)
        (out,) = nodes.common_ksampler(model, 1, 20, 3.5, "euler", "simple", pos, neg,
                                       {"samples": torch.zeros(shape)})
        (image,) = demo().DemoDecode.execute(out, 1).args
        assert image.shape == (1, 16, 16, 3)
        pic = image.permute(0, 3, 1, 2)
        fg = torch.tensor(shapes().COLORS[color]).view(1, 3, 1, 1) / 255
        bgc = torch.tensor(shapes().BACKGROUNDS[bg]).view(1, 3, 1, 1) / 255
        near_fg = (pic - fg).abs().mean(1) < 0.25
        near_bg = (pic - bgc).abs().mean(1) < 0.25
        errors[text] = (float(near_fg.float().mean()), float(near_bg.float().mean()))
        assert near_fg.float().mean() > 0.15 and near_bg.float().mean() > 0.2, (family, text, errors)
        assert (near_fg | near_bg).float().mean() > 0.6, (family, text, errors)


def test_demo_decode_inverts_the_picture_code_for_both_families():
    """The decode node is the exact inverse of the picture code (Flux 4-D, Wan 5-D frames)."""
    import comfy.latent_formats

    gen = torch.Generator().manual_seed(0)
    pic = torch.rand(2, 4, 16, 16, generator=gen)
    latent = shapes().picture_to_latent(pic)
    (image,) = demo().DemoDecode.execute({"samples": latent}, 1).args
    assert torch.allclose(image.permute(0, 3, 1, 2), pic[:, :3], atol=1e-5)
    processed = torch.nn.functional.pixel_unshuffle(pic * 2 - 1, 2)
    video = comfy.latent_formats.Wan21().process_out(processed.unsqueeze(2).repeat(1, 1, 3, 1, 1))
    (frames,) = demo().DemoDecode.execute({"samples": video}, 2).args
    assert frames.shape == (6, 32, 32, 3)
    big = torch.nn.functional.interpolate(pic[:, :3], scale_factor=2, mode="nearest")
    assert torch.allclose(frames[::3].permute(0, 3, 1, 2), big, atol=1e-4)


@pytest.mark.parametrize("samples,scale,name", [
    ({"samples": torch.ones(1, 4, 8, 8)}, 1, "samples"), ("latent", 1, "samples"),
    ({"samples": torch.zeros(0, 16, 8, 8)}, 1, "samples"), ({"samples": torch.zeros(1, 16, 0, 8)}, 1, "samples"),
    ({"samples": torch.zeros(1, 0, 8, 8)}, 1, "samples"),
    pytest.param({"samples": torch.zeros(1, 16, 8, 8)}, 2 ** 1100, "scale", id="past-a-float"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, 0, "scale"), ({"samples": torch.zeros(1, 16, 8, 8)}, 2.5, "scale")])
def test_demo_decode_refuses_what_is_not_a_demo_latent(samples, scale, name):
    """Refused naming the input (an empty latent failed inside torch's interpolation, or made no image)."""
    with pytest.raises(ValueError, match=f"ReuseKit Demo Decode: {name} must be") as refused:
        demo().DemoDecode.execute(samples, scale)
    assert "got NoneType" not in str(refused.value)  # what was given, not what was read from it


def test_demo_decode_says_what_it_was_given_where_it_is_no_latent():
    for given, said in ((torch.zeros(1, 3, 8, 8), r"got a torch.float32 tensor of shape \(1, 3, 8, 8\)"),
                        ({"image": 1}, "got a dict whose 'samples' is None")):
        with pytest.raises(ValueError, match=said):
            demo().DemoDecode.execute(given, 1)


def test_demo_decode_takes_a_linked_numpy_scale():
    import numpy as np

    (image,) = demo().DemoDecode.execute({"samples": torch.zeros(1, 16, 4, 4)}, np.int64(3)).args
    assert image.shape == (1, 24, 24, 3)


def test_demo_decode_reads_an_empty_latent_of_any_channels_as_empty():
    (image,) = demo().DemoDecode.execute({"samples": torch.zeros(1, 4, 8, 8)}, 1).args
    (same,) = demo().DemoDecode.execute({"samples": torch.zeros(1, 16, 8, 8)}, 1).args
    assert image.shape == (1, 16, 16, 3) and torch.equal(image, same)


def test_the_prompt_batch_pairs_every_line_with_the_negative():
    out = demo().PromptBatch.execute("a\n\n b \n", "neg").args
    assert out == (["a", "b"], ["neg", "neg"])
    with pytest.raises(ValueError, match="ReuseKit Prompt Batch: prompts"):
        demo().PromptBatch.execute(" \n", "")


def test_demo_models_count_their_forward_calls_and_stay_cacheable():
    """The counters sit below the conditioning cache: a repeated encode hits and is not counted again."""
    import nodes

    cache = rkharness.pack("caching.conditioning").CACHE
    model, clip = demo().DemoFlux.execute().args
    stats = demo()._stats()
    before, hits = stats.counter("encoder_calls"), cache.count("hits")
    for _ in range(2):
        nodes.CLIPTextEncode().encode(clip, "a green cross on a gray background")
    assert stats.counter("encoder_calls") == before + 1 and cache.count("hits") == hits + 1


def test_the_demo_leaves_comfyui_no_model_whose_patcher_is_gone(caplog):
    """The demo's prompts (every cache's node clones the MODEL) through real executors without ComfyUI's
    cache (``make demo``) and with one that is then dropped: the demo keeps its weights, not its
    patchers, so each dropped MODEL goes with its clones. ComfyUI's loaded-model list keeps no dead
    entry, ``loaded_models()`` no None, and its leak check stays silent; what the dropped models' PE
    caches saved stays in the stats."""
    import gc

    import comfy.model_management as mm

    rkharness.forget_dropped_clones()  # earlier tests' (their models' leak reports are not this test's)
    prompts = demo_script().variants(rkharness, rkharness.load_workflow(demo_script().DEMO))
    registry = rkharness.pack("caching.stats").REGISTRY
    dropped = rkharness.pack("caching.pe_cache").DROPPED

    def pe_hits():
        return sum(c["counters"].get("hits", 0) for c in registry.snapshot()["caches"] if c["name"] == dropped)

    before = pe_hits()
    with caplog.at_level("INFO"):
        for name in ("full", "exact", "full"):
            rkharness.Executor(cache="none").run(prompts[name])
            rkharness.Executor().run(prompts[name])  # its cache dropped with it
            gc.collect()
            mm.cleanup_models_gc()
    assert not [m for m in mm.current_loaded_models if m.is_dead()]
    assert None not in mm.loaded_models()
    assert not [r.message for r in caplog.records if "memory leak" in r.message.lower()]
    assert pe_hits() - before >= 6 * 59


# ---- the demo through the real server --------------------------------------------------------

def demo_script():
    spec = importlib.util.spec_from_file_location("rk_scripts_demo", rkharness.ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_run():
    """The demo served as a template and run off / exact / full by scripts/demo.py (``make demo``)."""
    script = demo_script()
    with rkharness.running_server("--cache-none") as server:
        templates = server.get("/api/workflow_templates")
        served = server.get("/api/workflow_templates/reusekit/" + urllib.parse.quote(script.DEMO))
        results, diff = script.run_demo(rkharness, server)
        pictures = script.side_by_side(results, rkharness.ARTIFACTS / "demo")
        yield {"templates": templates, "served": served, "results": results, "diff": diff,
               "table": script.table(results, diff), "pictures": pictures}


def test_the_demo_is_listed_and_served_as_a_template(demo_run):
    assert "ReuseKit demo (no downloads)" in demo_run["templates"]["reusekit"]
    served = demo_run["served"]
    served = json.loads(served) if isinstance(served, str) else served
    assert served == rkharness.load_workflow(demo_script().DEMO)


def test_the_demo_shows_every_layer_working(demo_run):
    full = demo_run["results"]["full"]
    counts = full["counts"]
    print("\n" + demo_run["table"])
    assert counts["demo.encoder_calls"] == 3 and counts["conditioning.hits"] == 3  # A, B, A + a shared negative
    assert counts["pe.misses"] == 1 and counts["pe.hits"] == 59
    assert counts["step.calls_skipped"] >= 20 and counts["demo.transformer_calls"] <= 40
    assert full["graph"]["backend"].startswith("eager") and "no CUDA" in full["graph"]["backend"]
    assert len(full["images"]) == 3


def test_the_demo_without_reusekit_computes_everything_and_the_exact_layers_match_it(demo_run):
    off = demo_run["results"]["off"]["counts"]
    assert off["demo.encoder_calls"] == 6 and off["demo.transformer_calls"] == 60
    assert off.get("conditioning.hits", 0) == 0 and off.get("pe.hits", 0) == 0
    assert off.get("step.calls_skipped", 0) == 0
    assert demo_run["diff"]["exact_identical"]
    errors = demo_run["diff"]["teacache_errors"]
    print(f"TeaCache final-latent errors: {', '.join(f'{100 * e:.1f}%' for e in errors)}")
    assert len(errors) == 3 and 0 < max(errors) < 0.08
    assert len(demo_run["pictures"]) == 3 and all(p.is_file() for p in demo_run["pictures"])


# ---- every workflow: well formed ---------------------------------------------------------------

WORKFLOWS = sorted(p.name for p in (rkharness.ROOT / "workflows").glob("*.json"))
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
LOADERS = {"UNETLoader": (1, "diffusion_models"), "DualCLIPLoader": (2, "text_encoders"),
           "CLIPLoader": (1, "text_encoders"), "VAELoader": (1, "vae"), "CheckpointLoaderSimple": (1, "checkpoints"),
           "ReuseKitLazyCLIPLoader": (1, "text_encoders"), "ReuseKitLazyDualCLIPLoader": (2, "text_encoders"),
           "ReuseKitLazyTripleCLIPLoader": (3, "text_encoders")}


SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
FILES = (".safetensors", ".ckpt", ".pt", ".pth", ".gguf", ".png", ".jpg", ".jpeg", ".webp")
WIDGET_KINDS = {"INT": (int,), "FLOAT": (int, float), "BOOLEAN": (bool,), "STRING": (str,), "COMBO": (str, int, float)}


def _widgets(class_type: str) -> list[tuple[str, str, dict, list | None]]:
    """(name, kind, options, choices) of a node's widgets in the order the front end saves their values: a
    seed's control value after it, an image upload's after the image (ComfyUI's widgets_values)."""
    import nodes

    out = []
    for section in ("required", "optional"):
        for name, entry in nodes.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES().get(section, {}).items():
            kind, extra = entry[0], (entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {})
            choices = kind if isinstance(kind, list) else extra.get("options") if kind == "COMBO" else None
            kind = "COMBO" if choices is not None or kind == "COMBO" else kind
            if kind not in WIDGET_KINDS or extra.get("forceInput"):
                continue  # a socket
            out.append((name, kind, extra, choices))
            if extra.get("control_after_generate") or (kind == "INT" and name in ("seed", "noise_seed")):
                out.append((f"{name} control", "CONTROL", {}, sorted(SEED_CONTROLS)))
            if extra.get("image_upload"):
                out.append(("upload", "UPLOAD", {}, None))
    return out


def _widget_problem(name: str, kind: str, extra: dict, choices, value) -> str | None:
    if kind == "UPLOAD":
        return None
    if kind in ("CONTROL", "COMBO"):
        if value in (choices or ()) or (kind == "COMBO" and isinstance(value, str) and value.endswith(FILES)):
            return None  # a choice, or a model or picture file this machine has not
        return f"{name}: {value!r} is not one of its choices"
    if isinstance(value, bool) != (kind == "BOOLEAN") or not isinstance(value, WIDGET_KINDS[kind]):
        return f"{name}: {value!r} is not a {kind}"
    if kind in ("INT", "FLOAT") and not extra.get("min", -math.inf) <= value <= extra.get("max", math.inf):
        return f"{name}: {value!r} is outside {extra.get('min')}..{extra.get('max')}"
    return None


def test_there_are_the_demo_and_at_least_six_real_model_workflows():
    assert "ReuseKit demo (no downloads).json" in WORKFLOWS and len(WORKFLOWS) >= 7


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_workflow_is_well_formed(name):
    """Parses; every node type exists in the host plus the pack; links agree at both ends; a note and
    a .jpg thumbnail; every loader carries the front end's model metadata for its files."""
    import nodes

    rkharness.load_extra_nodes()
    wf = rkharness.load_workflow(name)
    by_id = {n["id"]: n for n in wf["nodes"]}
    assert len(by_id) == len(wf["nodes"]) and wf["last_node_id"] >= max(by_id)
    unknown = [n["type"] for n in wf["nodes"] if n["type"] not in nodes.NODE_CLASS_MAPPINGS | dict.fromkeys(FRONTEND_ONLY)]
    assert not unknown, unknown
    link_ids = set()
    for lid, src, slot, dst, idx, kind in wf["links"]:
        link_ids.add(lid)
        out, into = by_id[src]["outputs"][slot], by_id[dst]["inputs"][idx]
        assert lid in (out["links"] or []) and into["link"] == lid, (name, lid)
        assert kind == out["type"] and (into["type"] in (kind, "*") or "widget" in into or into["type"] == "*"), (name, lid)
    assert wf["last_link_id"] >= max(link_ids)
    for n in wf["nodes"]:
        assert all(i["link"] in link_ids for i in n.get("inputs", []) if i.get("link") is not None), (name, n["id"])
        assert all(lid in link_ids for o in n.get("outputs", []) for lid in (o.get("links") or [])), (name, n["id"])
    if "id" in wf:  # the front end validates a workflow's id as a GUID, and tells workflows apart by it
        import uuid

        assert str(uuid.UUID(wf["id"])) == wf["id"], (name, wf["id"])
        others = [rkharness.load_workflow(n).get("id") for n in WORKFLOWS if n != name]
        assert wf["id"] not in others, (name, wf["id"])
    notes = [n for n in wf["nodes"] if n["type"] in ("Note", "MarkdownNote") and n["widgets_values"][0].strip()]
    assert notes, f"{name}: no note node"
    thumb = rkharness.ROOT / "workflows" / (name[:-5] + ".jpg")
    assert thumb.is_file() and thumb.read_bytes()[:2] == b"\xff\xd8", f"{name}: no .jpg thumbnail"
    for n in wf["nodes"]:  # the saved values fill the widgets in order: one too few or too many shifts them
        values = n.get("widgets_values")
        if n["type"] in FRONTEND_ONLY or not isinstance(values, list):
            continue  # none saved (or by name): every widget keeps its default
        widgets = _widgets(n["type"])
        assert len(values) == len(widgets), (name, n["id"], n["type"], [w[0] for w in widgets], values)
        problems = [_widget_problem(*w, v) for w, v in zip(widgets, values, strict=True)]
        assert not any(problems), (name, n["id"], n["type"], [p for p in problems if p])
    for n in wf["nodes"]:
        if n["type"] in LOADERS:
            count, folder = LOADERS[n["type"]]
            files = n["widgets_values"][:count]
            models = n["properties"].get("models")
            assert [m["name"] for m in models or []] == files, (name, n["type"], models)
            for m in models:
                assert m["directory"] == folder and m["url"].startswith("https://huggingface.co/")
                assert m["url"].split("?")[0].endswith("/" + m["name"]), m


# ---- every real-model workflow: executed through the real server on tiny models ----------------

def _set(prompt: dict, class_type: str, **inputs) -> None:
    for node in prompt.values():
        if node["class_type"] == class_type:
            node["inputs"].update(inputs)


def _swap(prompt: dict, old: str, new: str, drop=()) -> None:
    for node in prompt.values():
        if node["class_type"] == old:
            node["class_type"] = new
            for name in drop:
                node["inputs"].pop(name, None)


def _picture(path, color) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), color).save(path)


def _small(prompt: dict, steps: int = 6) -> dict:
    """Tiny sizes and few steps; the stand-ins the tiny models need (see RUNS)."""
    for kind in ("EmptySD3LatentImage", "EmptyLatentImage"):
        _set(prompt, kind, width=64, height=64)
    _set(prompt, "EmptyHunyuanLatentVideo", width=64, height=64, length=1)
    _swap(prompt, "EmptyLatentImage", "EmptySD3LatentImage")  # the tiny VAE and models have 16 channels
    for node in prompt.values():
        if "steps" in node["inputs"]:
            node["inputs"]["steps"] = steps
    return prompt


def _text(prompt: dict, text: str) -> dict:
    first = min((nid for nid, n in prompt.items() if n["class_type"] == "CLIPTextEncode"), key=int)
    prompt[first]["inputs"]["text"] = text
    return prompt


def _image(prompt: dict, name: str) -> dict:
    _set(prompt, "LoadImage", image=name)
    return prompt


FLUX = "Flux text to image - prompt batch, PE cache, TeaCache.json"
SD15 = "SD1.5 text to image - conditioning cache, graph capture.json"
I2I = "SD1.5 image to image - VAE-encode cache.json"
KONTEXT = "Flux Kontext edit - reference encode and PE cache.json"
WAN = "Wan 2.1 text to video - PE cache, TeaCache.json"
BEFORE_AFTER = "Before and after - Flux with and without ReuseKit.json"
LAZY = "Lazy text encoder - prompts seen before never load it.json"
QWEN_EDIT = "Qwen-Image edit - image prompt and reference encode.json"
Z_IMAGE = "Z-Image text to image - step cache, PE cache.json"


def _skipping(prompt: dict) -> dict:
    """The step cache's rule for a model without a table (first_block) at a threshold the tiny random-weight
    model skips at: its first layer's residual changes far more from step to step than a trained model's, so
    the default threshold skips nothing on it."""
    _set(prompt, "ReuseKitTeaCache", rule="first_block", threshold=5.0)
    return prompt


def _instruction(prompt: dict, text: str) -> dict:
    """The edit instruction: the TextEncodeQwenImageEditPlus whose prompt is not empty (not the negative)."""
    for node in prompt.values():
        if node["class_type"] == "TextEncodeQwenImageEditPlus" and node["inputs"]["prompt"]:
            node["inputs"]["prompt"] = text
    return prompt

# workflow -> (tiny family, the prompts to queue in order (from the converted workflow), what the note promises)
RUNS = {
    FLUX: ("flux_trained", lambda p: [p], lambda c: c["conditioning.hits"] >= 3 and c["pe.hits"] > 0
           and c["step.calls_skipped"] > 0),
    SD15: ("flux_trained", lambda p: [_text(json.loads(json.dumps(p)), t) for t in ("a cat", "a dog", "a cat")],
           lambda c: c["conditioning.hits"] >= 1 and c["graph.checks"] > 0),
    I2I: ("flux_trained", lambda p: [_image(json.loads(json.dumps(p)), f) for f in ("a.png", "b.png", "a.png")],
          lambda c: c["vae.hits"] >= 1),
    KONTEXT: ("flux_trained", lambda p: [_text(json.loads(json.dumps(p)), t) for t in ("make it red", "make it blue",
                                                                                        "make it red")],
              lambda c: c["conditioning.hits"] >= 1 and c["pe.hits"] > 0),
    WAN: ("wan_trained", lambda p: [p], lambda c: c["pe.hits"] > 0 and c["step.runs"] >= 1),
    BEFORE_AFTER: ("flux_trained", lambda p: [p], lambda c: c["step.calls_skipped"] > 0 and c["pe.hits"] > 0),
    # no shared tier on this server: the lazy loader loads as usual (tests/test_lazy_clip.py runs it with one)
    LAZY: ("flux_trained", lambda p: [_text(json.loads(json.dumps(p)), t) for t in ("a cat", "a dog", "a cat")],
           lambda c: c["conditioning.hits"] >= 1),
    # ComfyUI's own Qwen-Image classes: the picture through Qwen2.5-VL's vision tower and the Wan VAE
    QWEN_EDIT: ("qwen_image", lambda p: [_instruction(json.loads(json.dumps(p)), t) for t in ("make it red", "make it blue",
                                                                                              "make it red")],
                lambda c: c["conditioning.hits"] >= 1 and c["vae.hits"] >= 1 and c["pe.hits"] > 0),
    # ComfyUI's own Z-Image class (Lumina 2's NextDiT), its layers reached by the step cache without a block seam
    Z_IMAGE: ("z_image", lambda p: [_skipping(p)], lambda c: c["step.calls_skipped"] > 0 and c["pe.hits"] > 0),
    "conditioning_prompt_variations.json": ("flux", lambda p: [_text(json.loads(json.dumps(p)), t) for t in
                                                               ("a red fox", "a blue fox", "a red fox")],
                                            lambda c: c["conditioning.hits"] >= 1),
    "graph_capture_flux.json": ("flux", lambda p: [p], lambda c: c["graph.checks"] > 0),
    "pe_cache_flux.json": ("flux", lambda p: [p], lambda c: c["pe.hits"] > 0),
    "step_cache_flux.json": ("flux_trained", lambda p: [p], lambda c: c["step.calls_skipped"] > 0),
}


def _vae_hits(snapshot: dict) -> int:
    cache = next(c for c in snapshot["caches"] if c["name"] == "conditioning")
    return cache["info"].get("by_kind", {}).get("vae", {}).get("hits", 0)


@pytest.fixture(scope="module")
def tiny_server():
    with rkharness.running_server() as server:
        for name, color in (("a.png", (200, 30, 30)), ("b.png", (30, 30, 200)), ("example.png", (30, 160, 60))):
            _picture(server.base / "input" / name, color)
        yield server


def test_every_workflow_but_the_demo_has_a_run():
    assert sorted(RUNS) == sorted(n for n in WORKFLOWS if n != demo_script().DEMO)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_real_model_workflow_runs_on_tiny_models_and_the_stats_show_its_promise(tiny_server, name):
    """Loaders become the tests' tiny models of the same classes (ComfyUI sizes CLIP-L, T5 and UMT5 from
    fixed configs and Flux/Wan heads from fixed head widths: no tiny file loads through the real loaders)."""
    script = demo_script()
    family, queue, promise = RUNS[name]
    prompt = _small(rkharness.workflow_to_prompt(rkharness.load_workflow(name), family=family))
    prompt = script.without(prompt, {"FluxKontextImageScale"})  # it would scale the picture to 1 megapixel
    if family == "wan_trained":  # the picture code stands in for the Wan VAE
        _swap(prompt, "VAEDecode", "ReuseKitDemoDecode", drop=("vae",))
        _set(prompt, "ReuseKitDemoDecode", scale=1)
    tiny_server.post("/reusekit/clear", {"all": True})
    first = tiny_server.get("/reusekit/stats")
    before, vae_before = script.counters(first), _vae_hits(first)
    for p in queue(prompt):
        history = tiny_server.wait_for_prompt(tiny_server.queue(p))
        assert history["status"]["status_str"] == "success", (name, history["status"], tiny_server.log_text()[-3000:])
    last = tiny_server.get("/reusekit/stats")
    counts = script.changes(before, script.counters(last))
    counts = {"conditioning.hits": 0, "pe.hits": 0, "step.calls_skipped": 0, "step.runs": 0, "graph.checks": 0,
              **counts, "vae.hits": _vae_hits(last) - vae_before}
    assert promise(counts), (name, counts)
