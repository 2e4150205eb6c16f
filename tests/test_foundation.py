"""The pack loads in a real ComfyUI; the harness runs real models, the executor and the server."""

import ast
import json
import subprocess
import sys

import pytest
import rkharness
import torch

pytestmark = pytest.mark.foundation


def reusekit_nodes():
    import nodes

    return {k: v for k, v in nodes.NODE_CLASS_MAPPINGS.items() if k.startswith("ReuseKit")}


def test_pack_is_a_v3_extension_with_a_web_directory():
    pack = rkharness.PACK
    assert callable(pack.comfy_entrypoint)
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS")  # it would make ComfyUI ignore the entrypoint
    assert pack.WEB_DIRECTORY == "./web" and (rkharness.ROOT / "web" / "reusekit.js").is_file()


def _copy_of_the_pack(folder):
    import shutil

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=rkharness.ROOT, capture_output=True, check=True)
    for name in filter(None, tracked.stdout.decode().split("\0")):
        if (rkharness.ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(rkharness.ROOT / name, folder / name)
    return folder


def test_a_copy_that_fails_to_start_leaves_the_place_to_the_next(tmp_path):
    """A broken copy ComfyUI loads first (a half-finished update) claimed the place and registered nothing: the
    working copy after it stood aside, leaving no ReuseKit node. A copy whose code fails to load (before it
    changed anything in ComfyUI) now gives the place up, and its page."""
    import asyncio

    import nodes

    broken = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-ReuseKit")
    (broken / "caching" / "settings.py").write_text("import reusekit_missing_dependency\n")
    marker = sys.modules["_reusekit_first_copy"]
    first = marker.__dict__.pop("path")
    try:
        before = dict(nodes.NODE_CLASS_MAPPINGS)
        assert not asyncio.run(nodes.load_custom_node(str(broken)))  # (ComfyUI logs the failure)
        assert nodes.NODE_CLASS_MAPPINGS == before and "path" not in marker.__dict__
        assert not [d for d in nodes.EXTENSION_WEB_DIRS.values() if str(broken) in d]
    finally:
        marker.path = first


def test_a_second_copy_in_another_folder_registers_nothing_and_says_where_both_are(tmp_path, caplog):
    """A clone beside a Manager install: the copy ComfyUI loaded second replaced every node of the first, whose
    panel routes and stats registry answered the page, so the panel showed none of what those nodes counted.
    It now serves no page, registers no node and names both folders; the first copy's nodes stay."""
    import asyncio
    import logging

    import nodes

    copy = _copy_of_the_pack(tmp_path / "custom_nodes" / "ComfyUI-ReuseKit")
    before = dict(nodes.NODE_CLASS_MAPPINGS)
    caplog.set_level(logging.WARNING, logger="reusekit")
    assert asyncio.run(nodes.load_custom_node(str(copy)))
    second = sys.modules[str(copy).replace(".", "_x_")]
    assert second.WEB_DIRECTORY is None and rkharness.PACK.WEB_DIRECTORY == "./web"
    assert nodes.NODE_CLASS_MAPPINGS == before
    assert not [d for d in nodes.EXTENSION_WEB_DIRS.values() if str(copy) in d]
    (said,) = [r.getMessage() for r in caplog.records if "another copy" in r.getMessage()]
    assert str(rkharness.ROOT.resolve()) in said and str(copy.resolve()) in said, said


def test_every_node_is_prefixed_and_in_the_reusekit_category():
    found = reusekit_nodes()
    assert "ReuseKitCacheStats" in found
    for node_id, cls in found.items():
        schema = cls.GET_SCHEMA()
        assert schema.node_id == node_id
        assert schema.category.split("/")[0] == "ReuseKit", node_id
        assert schema.display_name.startswith("ReuseKit "), node_id
        for inp in schema.inputs:
            assert inp.tooltip, f"{node_id}.{inp.id} has no tooltip"


def test_importing_the_pack_prints_nothing_and_does_no_heavy_work():
    """A fresh interpreter imports the package (no host on the path): no output, no torch import."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('reusekit', {str(rkharness.ROOT / '__init__.py')!r},"
        f" submodule_search_locations=[{str(rkharness.ROOT)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['reusekit'] = m; spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules and 'comfy' not in sys.modules, sorted(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""


def test_caching_package_never_imports_comfyui():
    """caching/ is pure logic (torch + stdlib): unit-testable without a host."""
    for path in (rkharness.ROOT / "caching").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top not in {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "nodes",
                                   "server", "execution", "folder_paths"}, f"{path.name} imports {name}"


def test_missing_host_feature_logs_one_warning_and_loads_the_rest(monkeypatch, caplog):
    nodes_pkg = rkharness.pack("nodes")
    monkeypatch.setattr(nodes_pkg, "NODE_MODULES", ("stats", "no_such_module"))
    with caplog.at_level("WARNING", logger="reusekit"):
        classes = nodes_pkg.load_node_classes()
    assert [c.GET_SCHEMA().node_id for c in classes] == ["ReuseKitCacheStats"]
    warnings = [r for r in caplog.records if r.name == "reusekit"]
    assert len(warnings) == 1 and "no_such_module" in warnings[0].getMessage()


def test_a_node_whose_schema_cannot_be_built_is_skipped_with_one_warning_and_the_rest_load(monkeypatch, caplog):
    """ComfyUI registers a pack's nodes in one pass: a node whose schema raises on this host (a host loader
    whose inputs changed shape) would hide every node after it."""
    nodes_pkg, lazy = rkharness.pack("nodes"), rkharness.pack("nodes.lazy_clip")

    def changed_shape(cls):
        raise TypeError("TripleCLIPLoader's input 'clip_name1' is not a list of choices")

    monkeypatch.setattr(nodes_pkg, "NODE_MODULES", ("lazy_clip", "stats"))
    monkeypatch.setattr(lazy.LazyDualCLIPLoader, "_spec", classmethod(changed_shape))
    with caplog.at_level("WARNING", logger="reusekit"):
        classes = nodes_pkg.load_node_classes()
    assert [c.GET_SCHEMA().node_id for c in classes] == ["ReuseKitLazyCLIPLoader", "ReuseKitLazyTripleCLIPLoader",
                                                         "ReuseKitCacheStats"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "reusekit"]
    assert len(warnings) == 1 and "LazyDualCLIPLoader" in warnings[0] and "not a list of choices" in warnings[0]


def test_every_node_declares_its_own_hidden_inputs():
    """ComfyUI adds extra_pnginfo to an output node's hidden inputs, in the list its schema holds: a list
    shared by several nodes would give it to all of them."""
    from comfy_api.latest import io

    classes = rkharness.pack("nodes").load_node_classes()
    for _ in range(2):  # every schema built after every other
        schemas = [c.GET_SCHEMA() for c in classes]
        for schema in schemas:
            if not schema.is_output_node:
                assert io.Hidden.extra_pnginfo not in (schema.hidden or []), schema.node_id
        lists = [id(schema.hidden) for schema in schemas if schema.hidden]
        assert len(lists) == len(set(lists))


def test_clip_text_encode_and_vae_round_trip_on_tiny_models(tiny):
    import nodes

    clip, vae = tiny.tiny_clip(0), tiny.tiny_vae(0)
    (cond,) = nodes.CLIPTextEncode().encode(clip, "a (red:1.3) square on a blue field")
    assert cond[0][0].shape == (1, 77, tiny.TEXT_DIM)
    assert cond[0][1]["pooled_output"].shape == (1, tiny.TEXT_DIM)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    (latent,) = nodes.VAEEncode().encode(vae, image)
    assert latent["samples"].shape == (1, 16, 8, 8)
    (decoded,) = nodes.VAEDecode().decode(vae, latent)
    assert decoded.shape == (1, 64, 64, 3) and torch.isfinite(decoded).all()


@pytest.mark.parametrize("family,latent_shape", [("flux", (1, 16, 8, 8)), ("wan", (1, 16, 3, 8, 8))])
def test_real_ksampler_runs_on_tiny_models(tiny, family, latent_shape):
    import nodes

    model, clip = tiny.BUILDERS[family](0), tiny.tiny_clip(0)
    (pos,) = nodes.CLIPTextEncode().encode(clip, "a red circle")
    (neg,) = nodes.CLIPTextEncode().encode(clip, "blurry")
    latent = {"samples": torch.zeros(latent_shape)}
    (out,) = nodes.common_ksampler(model, 7, 3, 2.0, "euler", "simple", pos, neg, latent)
    assert out["samples"].shape == latent_shape
    assert torch.isfinite(out["samples"]).all() and out["samples"].abs().sum() > 0
    (again,) = nodes.common_ksampler(model, 7, 3, 2.0, "euler", "simple", pos, neg, latent)
    assert torch.equal(out["samples"], again["samples"])  # deterministic under a seed


def tiny_flux_prompt(text="a red square", seed=1):
    return {
        "1": {"class_type": "RKTestTinyCheckpoint", "inputs": {"family": "flux", "seed": 0}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": text}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "seed": seed, "steps": 2, "cfg": 2.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["6", 0]}},
    }


def test_workflow_through_the_real_executor_shows_stats_text():
    result = rkharness.Executor().run(tiny_flux_prompt())
    (text,) = result["outputs"]["7"]["text"]
    assert text.startswith("ReuseKit: ") and "caches" in text


def test_server_lists_every_node_and_serves_the_web_entry(comfy_server):
    info = comfy_server.get("/object_info")
    expected = set(reusekit_nodes())
    assert expected <= set(info), expected - set(info)
    stats_node = info["ReuseKitCacheStats"]
    assert stats_node["output_node"] is True and stats_node["category"].startswith("ReuseKit")
    assert "/extensions/reusekit/reusekit.js" in comfy_server.get("/extensions")
    js = comfy_server.get("/extensions/reusekit/reusekit.js")
    assert "registerExtension" in js
    timing = [line for line in comfy_server.log_text().splitlines() if "custom_nodes/reusekit" in line]
    assert timing and not any("IMPORT FAILED" in line for line in timing), timing
    # the environment is complete (torchaudio too): no module of the host fails to import either
    failed = [line for line in comfy_server.log_text().splitlines() if "IMPORT FAILED" in line]
    assert not failed, failed


def test_server_runs_a_tiny_workflow_with_the_stats_node(comfy_server):
    prompt_id = comfy_server.queue(tiny_flux_prompt(seed=3))
    entry = comfy_server.wait_for_prompt(prompt_id)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[:2000]
    assert entry["outputs"]["7"]["text"][0].startswith("ReuseKit: ")


def ui_node(node_id, type_, inputs=(), outputs=(), widgets=None, mode=0):
    """One node as the ComfyUI page saves it (inputs: (name, type, link[, widget]))."""
    return {"id": node_id, "type": type_, "pos": [0, 0], "size": [200, 100], "flags": {}, "order": node_id,
            "mode": mode,
            "inputs": [{"name": n, "type": t, "link": link, **({"widget": {"name": n}} if w else {})}
                       for n, t, link, *w in inputs],
            "outputs": [{"name": n, "type": t, "links": links} for n, t, links in outputs],
            "properties": {"Node name for S&R": type_}, "widgets_values": widgets or []}


def flux_ui_workflow():
    """The shape of a standard Flux workflow saved by the page: separate loaders, a reroute, a
    note, a seed widget with its control value, and a steps widget converted to an input."""
    links = [[1, 1, 0, 8, 0, "MODEL"], [2, 2, 0, 4, 0, "CLIP"], [3, 2, 0, 5, 0, "CLIP"],
             [4, 4, 0, 6, 0, "CONDITIONING"], [5, 6, 0, 8, 1, "CONDITIONING"], [6, 5, 0, 8, 2, "CONDITIONING"],
             [7, 7, 0, 8, 3, "LATENT"], [8, 8, 0, 9, 0, "LATENT"], [9, 3, 0, 11, 0, "VAE"],
             [10, 11, 0, 9, 1, "VAE"], [11, 9, 0, 10, 0, "IMAGE"], [12, 13, 0, 8, 4, "INT"]]
    nodes = [
        ui_node(1, "UNETLoader", outputs=[("MODEL", "MODEL", [1])], widgets=["flux1-dev.safetensors", "default"]),
        ui_node(2, "DualCLIPLoader", outputs=[("CLIP", "CLIP", [2, 3])],
                widgets=["clip_l.safetensors", "t5xxl_fp16.safetensors", "flux", "default"]),
        ui_node(3, "VAELoader", outputs=[("VAE", "VAE", [9])], widgets=["ae.safetensors"]),
        ui_node(4, "CLIPTextEncode", [("clip", "CLIP", 2)], [("CONDITIONING", "CONDITIONING", [4])],
                ["a red square on a blue field"]),
        ui_node(5, "CLIPTextEncode", [("clip", "CLIP", 3)], [("CONDITIONING", "CONDITIONING", [6])], [""]),
        ui_node(6, "FluxGuidance", [("conditioning", "CONDITIONING", 4)], [("CONDITIONING", "CONDITIONING", [5])],
                [3.5]),
        ui_node(7, "EmptySD3LatentImage", outputs=[("LATENT", "LATENT", [7])], widgets=[1024, 1024, 1]),
        ui_node(8, "KSampler", [("model", "MODEL", 1), ("positive", "CONDITIONING", 5),
                                ("negative", "CONDITIONING", 6), ("latent_image", "LATENT", 7),
                                ("steps", "INT", 12, True)],
                [("LATENT", "LATENT", [8])], [42, "randomize", 20, 1.0, "euler", "simple", 1.0]),
        ui_node(9, "VAEDecode", [("samples", "LATENT", 8), ("vae", "VAE", 10)], [("IMAGE", "IMAGE", [11])]),
        ui_node(10, "ReuseKitCacheStats", [("after", "*", 11)], [("text", "STRING", [])]),
        ui_node(11, "Reroute", [("", "*", 9)], [("", "VAE", [10])]),
        ui_node(12, "Note", widgets=["Loaders are replaced by tiny models in the tests."]),
        ui_node(13, "PrimitiveNode", outputs=[("INT", "INT", [12])], widgets=[20, "fixed"]),
    ]
    return {"last_node_id": 13, "last_link_id": 12, "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {}, "version": 0.4}


def test_ui_workflow_converts_to_a_prompt_that_runs_on_tiny_models():
    workflow = flux_ui_workflow()
    prompt = rkharness.workflow_to_prompt(workflow, overrides={"7": {"width": 64, "height": 64}})
    assert prompt["1"] == {"class_type": "RKTestTinyCheckpoint", "inputs": {"seed": 0, "family": "flux"}}
    assert prompt["4"]["inputs"] == {"clip": ["2", 1], "text": "a red square on a blue field"}
    ks = prompt["8"]["inputs"]
    assert ks["seed"] == 42 and ks["cfg"] == 1.0 and ks["sampler_name"] == "euler"
    assert ks["steps"] == 20 and ks["model"] == ["1", 0]  # a converted widget takes its primitive's value
    assert prompt["9"]["inputs"]["vae"] == ["3", 2]  # through the reroute, to the tiny VAE slot
    assert "12" not in prompt and "11" not in prompt
    assert "13" not in prompt
    ks["steps"] = 2
    result = rkharness.Executor().run(prompt)
    assert result["outputs"]["10"]["text"][0].startswith("ReuseKit: ")


def test_the_code_passes_ruff_with_the_security_rules():
    """pyproject.toml's ruff settings (S102 exec, S307 eval among them) hold for the whole tree."""
    ruff = rkharness.ROOT / ".venv" / "bin" / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is installed by the test setup (scripts/setup.sh --test)")
    out = subprocess.run([str(ruff), "check", "--no-cache", str(rkharness.ROOT)], capture_output=True, text=True,
                         cwd=rkharness.ROOT, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]
