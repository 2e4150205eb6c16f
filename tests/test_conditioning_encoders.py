"""Conditioning cache on every text encoder the host's loaders build (CLIPLoader, DualCLIPLoader,
TripleCLIPLoader, QuadrupleCLIPLoader): CLIP, T5 and the LLM encoders (Qwen2.5-VL, Qwen3, Llama, Gemma,
Mistral...), each built from the host's own classes at a test size (tests/tinymodels/text_encoders.py)
with the host's real tokenizers. A repeat is a hit bit-identical to the pack being off; what the output
depends on (text, template, images in the prompt, the encoder's config) makes a miss."""

import logging
import types

import pytest
import rkharness
from test_conditioning import image, same

pytestmark = pytest.mark.conditioning

TEXT = "a photo of a cat sitting on a red chair"


def _text_encoders():
    import importlib

    return importlib.import_module(f"{rkharness.TINY.__name__}.text_encoders")


def _targets():
    rkharness.load_extra_nodes()  # the loaders of every type (QuadrupleCLIPLoader is one of ComfyUI's extras)
    targets = list(_text_encoders().loader_targets().values())
    ids, seen = [], {}
    for t in targets:
        loader, clip_type, files = t.seen[0]
        name = f"{t.name}[{'+'.join(files)}]"
        seen[name] = seen.get(name, 0) + 1
        ids.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return targets, ids


TARGETS, IDS = _targets()


@pytest.fixture
def cc():
    mod = rkharness.pack("caching.conditioning")
    settings = rkharness.pack("caching.settings").SETTINGS
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", True)
    mod.CACHE.clear()
    mod.CACHE.reset_counts()
    yield mod
    settings.set("conditioning.enabled", before)
    mod.CACHE.clear()


def _off(fn):
    settings = rkharness.pack("caching.settings").SETTINGS
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", False)
    try:
        return fn()
    finally:
        settings.set("conditioning.enabled", before)


def _build(target):
    try:
        return _text_encoders().build(target)
    except NotImplementedError as exc:
        pytest.skip(f"{target.name}: {exc}")


def _takes_template(clip) -> bool:
    import inspect

    return "llama_template" in inspect.signature(clip.tokenizer.tokenize_with_weights).parameters


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_every_loader_encoder_hits_exactly_and_misses_on_what_its_output_depends_on(cc, target):
    clip = _build(target)
    options = _text_encoders().tokenize_options(target)

    def encode(text, **kw):
        return clip.encode_from_tokens_scheduled(clip.tokenize(text, **options, **kw))

    reference = _off(lambda: encode(TEXT))
    first, second = encode(TEXT), encode(TEXT)
    assert cc.CACHE.bypass_reasons() == [], f"{target.name} bypassed the cache"
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1)
    assert same(first, reference) and same(second, reference)

    other = encode("a dog running in the snow")
    assert cc.CACHE.count("misses") == 2
    assert same(other, _off(lambda: encode("a dog running in the snow")))
    template = "<|im_start|>system\nDraw exactly what is asked.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    try:  # the host's own encode with another template (some encoders refuse one without their prefix)
        expected = _off(lambda: encode(TEXT, llama_template=template)) if _takes_template(clip) else None
    except ValueError:
        expected = None
    if expected is not None:
        changed = clip.tokenize(TEXT, **options, llama_template=template) != clip.tokenize(TEXT, **options)
        templated = encode(TEXT, llama_template=template)
        assert cc.CACHE.count("misses") == (3 if changed else 2)  # a template the tokenizer ignores: the same tokens
        assert same(templated, expected)
    assert cc.CACHE.bypass_reasons() == []


def _one(name: str):
    for t in TARGETS:
        if t.name == name:
            return t
    pytest.skip(f"this host's loaders build no {name}")


def test_an_llm_config_changed_in_place_misses_and_gives_what_comfyui_gives(cc):
    target = _one("z_image.ZImageTEModel_")
    clip = _build(target)
    config = clip.cond_stage_model.qwen3_4b.transformer.model.config
    tokens = clip.tokenize(TEXT)
    before = clip.encode_from_tokens_scheduled(tokens)
    config.rms_norm_eps = 0.5
    after = clip.encode_from_tokens_scheduled(tokens)
    assert cc.CACHE.count("hits") == 0 and cc.CACHE.count("misses") == 2
    assert same(after, _off(lambda: clip.encode_from_tokens_scheduled(tokens)))
    assert same(before, _off(lambda: (setattr(config, "rms_norm_eps", 1e-6), clip.encode_from_tokens_scheduled(tokens))[1]))


_VISUAL_CALLS = []


def _counted_visual(self, *args, **kwargs):
    _VISUAL_CALLS.append(1)
    return type(self).forward(self, *args, **kwargs)


@pytest.mark.parametrize("name", ["qwen_image.QwenImageTEModel_"])
def test_images_in_the_prompt_are_keyed_by_content_and_the_vision_tower_runs_only_on_a_miss(cc, name):
    clip = _build(_one(name))
    visual = clip.cond_stage_model.qwen25_7b.transformer.visual
    calls = _VISUAL_CALLS  # counted by a method on the instance (a module hook would make the cache refuse it)
    calls.clear()
    visual.forward = types.MethodType(_counted_visual, visual)
    try:
        def encode(img, text="make the sky green"):
            return clip.encode_from_tokens_scheduled(clip.tokenize(text, images=[img]))

        picture = image(1, size=56)
        reference = _off(lambda: encode(picture))
        assert len(calls) == 1
        first, second = encode(picture), encode(picture.clone())
        assert len(calls) == 2, "the vision tower ran on a hit"
        assert same(first, reference) and same(second, reference)
        changed = picture.clone()
        changed[0, 10, 10, 0] += 0.25
        other = encode(changed)
        assert len(calls) == 3 and cc.CACHE.count("misses") == 2
        assert same(other, _off(lambda: encode(changed)))
        assert not same(other, reference)
    finally:
        del visual.forward
    assert cc.CACHE.bypass_reasons() == []


def test_a_bypass_is_counted_by_reason_and_encoder_and_logged_once(cc, tiny, caplog):
    clip = tiny.tiny_clip(3)
    clip.cond_stage_model.clip_l.transformer.reusekit_test_setting = object()  # a setting no key can describe
    tokens = clip.tokenize(TEXT)
    with caplog.at_level(logging.INFO, logger="reusekit"):
        out = [clip.encode_from_tokens_scheduled(tokens) for _ in range(3)]
    assert cc.CACHE.count("bypasses") == 3 and cc.CACHE.count("hits") == 0
    reason = "encoder setting 'clip_l.transformer.reusekit_test_setting' holds a object"
    assert cc.CACHE.bypass_reasons() == [{"kind": "text", "encoder": "sd1_clip.SD1ClipModel", "reason": reason, "count": 3}]
    stats = rkharness.pack("caching.stats").REGISTRY.snapshot()
    card = next(c for c in stats["caches"] if c["name"] == "conditioning")
    assert "bypass_reasons" not in card["info"]  # one list of reasons per cache, the stats' own
    assert card["reasons"] == [{"event": "bypass", "source": "text, sd1_clip.SD1ClipModel", "reason": reason, "count": 3}]
    assert [r.getMessage() for r in caplog.records if reason in r.getMessage()] == [
        f"ReuseKit conditioning: text encodes of sd1_clip.SD1ClipModel run uncached: {reason}"]
    assert all(same(o, _off(lambda: clip.encode_from_tokens_scheduled(tokens))) for o in out)
    cc.CACHE.reset_counts()
    assert cc.CACHE.bypass_reasons() == []


def test_dataclasses_key_by_class_and_every_attribute():
    import dataclasses

    keys = rkharness.pack("caching.keys")

    @dataclasses.dataclass
    class Config:
        hidden_size: int = 64
        rope_scale: list | None = None

    @dataclasses.dataclass
    class Other:
        hidden_size: int = 64
        rope_scale: list | None = None

    a, b = Config(), Config()
    assert keys.encode(a) == keys.encode(b)
    assert keys.encode(Config(hidden_size=65)) != keys.encode(a)
    assert keys.encode(Config(rope_scale=[1.0])) != keys.encode(a)
    assert keys.encode(Other()) != keys.encode(a)
    b.extra = 1  # set on the instance besides its fields
    assert keys.encode(b) != keys.encode(a)
    with pytest.raises(keys.Uncacheable):
        keys.encode(Config(rope_scale=[object()]))


def test_qwen_image_edit_plus_node_hits_with_its_images_and_misses_on_another_image(cc):
    """ComfyUI's own TextEncodeQwenImageEditPlus (images through the vision tower, in its template)."""
    import comfy_extras.nodes_qwen as nodes_qwen

    clip = _build(_one("qwen_image.QwenImageTEModel_"))
    node = nodes_qwen.TextEncodeQwenImageEditPlus

    def run(*images):
        return node.execute(clip, "make the sky green", None, *images).result[0]

    first, second = image(4, size=64), image(5, size=48)
    reference = _off(lambda: run(first, second))
    assert same(run(first, second), reference) and same(run(first, second), reference)
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1)
    swapped = run(second, first)  # the same images in the other order: another prompt
    assert cc.CACHE.count("misses") == 2
    assert same(swapped, _off(lambda: run(second, first)))
    assert cc.CACHE.bypass_reasons() == []


@pytest.mark.parametrize("change", ["defaults set on it", "rebound in its module"])
def test_a_module_function_the_encoder_calls_changed_by_another_node_is_never_answered_from_the_cache(cc, monkeypatch,
                                                                                                      change):
    """Qwen2.5-VL's encoder calls ``qwen_vl.process_qwen2vl_images`` by name from its module: a node that lowers
    its pixel budget (its defaults, or the name rebound to a partial) got the conditioning from before, 212
    image tokens where ComfyUI now makes 17. Each is a miss giving ComfyUI's output; put back, the first
    entry hits again."""
    import functools

    import comfy_extras.nodes_qwen as nodes_qwen

    qwen_vl = pytest.importorskip("comfy.text_encoders.qwen_vl")
    clip = _build(_one("qwen_image.QwenImageTEModel_"))
    picture = image(4, size=112)

    def run():
        return nodes_qwen.TextEncodeQwenImageEditPlus.execute(clip, "make the sky green", None, picture).result[0]

    first = run()
    host = qwen_vl.process_qwen2vl_images
    if change == "defaults set on it":
        monkeypatch.setattr(host, "__defaults__", (3136, 3136, *host.__defaults__[2:]))
    else:
        monkeypatch.setattr(qwen_vl, "process_qwen2vl_images", functools.partial(host, max_pixels=3136))
    changed = run()
    assert same(changed, _off(run)) and changed[0][0].shape != first[0][0].shape
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (2, 0)
    monkeypatch.undo()
    assert same(run(), first) and cc.CACHE.count("hits") == 1


def test_every_text_encoder_load_in_comfyuis_templates_is_tested_here_or_says_why_not():
    """ComfyUI's own workflow templates (the comfyui-workflow-templates-json package): every text-encoder
    load whose loader and type this host has, of models the tests build, builds an encoder the per-type
    test above runs; every text-encode node they use on this host reaches the encoder through the seam the
    cache routes (CLIP.encode_from_tokens)."""
    import nodes

    coverage = _text_encoders().template_coverage()
    if coverage is None:
        pytest.skip("ComfyUI's templates are not unpacked beside the venv (scripts/setup.sh --test does it)")
    loads = coverage["loads"]
    assert sum(count for count, _ in loads.values()) > 200, "the templates package holds fewer loads than expected"
    wrong = {load: verdict for load, (_, verdict) in loads.items() if verdict == "not among the tested encoders"}
    assert not wrong, wrong
    tested = sum(count for count, verdict in loads.values() if verdict.startswith("tested"))
    assert tested >= 0.6 * sum(count for count, verdict in loads.values() if "has no" not in verdict)
    te = _text_encoders()
    unrouted = [kind for kind in coverage["encoders"] if not te.calls_the_encode_seam(nodes.NODE_CLASS_MAPPINGS[kind])]
    assert not unrouted, f"text-encode nodes that do not reach CLIP.encode_from_tokens: {unrouted}"


LLM_ENCODERS = ["z_image.ZImageTEModel_", "qwen_image.QwenImageTEModel_", "hunyuan_video.HunyuanVideoClipModel_",
                "omnigen2.Omnigen2TEModel_", "lumina2.LuminaTEModel_"]


@pytest.mark.parametrize("name", LLM_ENCODERS)
def test_an_llm_encoders_layer_choice_and_weight_patches_make_a_miss_and_comfyuis_output(cc, name):
    """CLIPSetLastLayer's choice, and a weight patch (a LoRA's way in: ComfyUI's patcher), on an LLM encoder:
    each misses and gives ComfyUI's output; the same patch on a fresh clone hits."""
    import torch

    clip = _build(_one(name))
    tokens = clip.tokenize(TEXT)
    base = clip.encode_from_tokens_scheduled(tokens)
    layered = clip.clone()
    layered.clip_layer(-1)
    out = layered.encode_from_tokens_scheduled(tokens)
    assert cc.CACHE.count("misses") == 2 and cc.CACHE.count("hits") == 0
    assert same(out, _off(lambda: layered.encode_from_tokens_scheduled(tokens)))

    key = next(k for k in clip.get_key_patches() if k.endswith("layers.0.mlp.down_proj.weight"))
    weight = clip.get_key_patches()[key][0]
    weight = weight[0] if isinstance(weight, tuple) else weight
    delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * 0.05

    def patched():
        made = clip.clone()
        made.add_patches({key: (delta.clone(),)}, 1.0)
        return made

    first = patched()
    out = first.encode_from_tokens_scheduled(tokens)
    assert cc.CACHE.count("misses") == 3
    assert same(out, _off(lambda: first.encode_from_tokens_scheduled(tokens))) and not same(out, base)
    again = patched().encode_from_tokens_scheduled(tokens)
    assert cc.CACHE.count("hits") == 1 and same(again, out)
    assert cc.CACHE.bypass_reasons() == []


@pytest.mark.hardening
def test_an_encoder_that_draws_random_numbers_is_never_stored_and_leaves_the_stream_as_uncached(cc):
    """NewBie's Jina CLIP has dropout: left in train mode (by a training node, say), each encode draws from torch's
    generator. Its first encode was stored and every repeat got that draw (1.9 from its own), and a hit skipped the
    draws, so a later node's random numbers moved too (0.5). Every encode is its own, counted as random, and the
    stream goes on as with the cache off."""
    import torch

    target = _one("newbie.NewBieTEModel_")
    clip = _build(target)
    clip.cond_stage_model.train()
    tokens = clip.tokenize(TEXT, **_text_encoders().tokenize_options(target))

    def run():
        outs = []
        for seed in (1, 2, 1):
            torch.manual_seed(seed)
            outs.append((clip.encode_from_tokens(tokens, return_pooled=True), torch.rand(4)))
        return outs

    with torch.inference_mode():
        uncached = _off(run)
        cached = run()
    assert not same(uncached[0][0], uncached[1][0])  # the draws change the encode
    for (out, after), (own, own_after) in zip(cached, uncached, strict=True):
        assert same(out, own) and torch.equal(after, own_after)
    assert len(cc.CACHE) == 0 and cc.CACHE.count("hits") == 0
    assert [(r["reason"], r["count"]) for r in cc.CACHE.bypass_reasons()] == [("random", 3)]
