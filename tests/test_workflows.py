"""The demo models shipped in the pack and the example workflows: every workflow is well formed and
runs through the real server, the demo with every layer on, compared with the pack off."""

import importlib
import importlib.util
import json
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
    ({"samples": torch.zeros(1, 4, 8, 8)}, 1, "samples"), ("latent", 1, "samples"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, 0, "scale"), ({"samples": torch.zeros(1, 16, 8, 8)}, 2.5, "scale")])
def test_demo_decode_refuses_what_is_not_a_demo_latent(samples, scale, name):
    with pytest.raises(ValueError, match=f"ReuseKit Demo Decode: {name}"):
        demo().DemoDecode.execute(samples, scale)


def test_the_prompt_batch_pairs_every_line_with_the_negative():
    out = demo().DemoPromptBatch.execute("a\n\n b \n", "neg").args
    assert out == (["a", "b"], ["neg", "neg"])
    with pytest.raises(ValueError, match="ReuseKit Demo Prompt Batch: prompts"):
        demo().DemoPromptBatch.execute(" \n", "")


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
    assert len(full["images"]) == 3 and full["wall_s"] < 30


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
