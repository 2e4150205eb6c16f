"""Conditioning cache: exactness, isolation, no stale hits, budget, concurrency, memory hooks."""

import collections
import dataclasses
import functools
import threading
import types

import numpy as np
import pytest
import rkharness
import torch

pytestmark = pytest.mark.conditioning

MIB = 1 << 20


@pytest.fixture
def cc():
    """The cache module, with global mode on, default limits and an empty cache around each test."""
    mod = rkharness.pack("caching.conditioning")
    settings = rkharness.pack("caching.settings").SETTINGS
    keys = ("conditioning.enabled", "conditioning.budget_mib", "conditioning.max_entries")
    saved = {k: settings.get(k) for k in keys}
    settings.update({"conditioning.enabled": True, "conditioning.budget_mib": 512,
                     "conditioning.max_entries": 128})
    mod.CACHE.clear()
    mod.CACHE.reset_counts()
    yield mod
    settings.update(saved)
    mod.CACHE.configure(saved["conditioning.budget_mib"] * MIB, saved["conditioning.max_entries"])
    mod.CACHE.clear()


@pytest.fixture
def uncached():
    """Run a function with the cache's routing off (global mode off), as plain ComfyUI would."""
    settings = rkharness.pack("caching.settings").SETTINGS

    def run(fn, *args, **kwargs):
        before = settings.get("conditioning.enabled")
        settings.set("conditioning.enabled", False)
        try:
            return fn(*args, **kwargs)
        finally:
            settings.set("conditioning.enabled", before)

    return run


def same(a, b):
    """Bit-equal trees of tensors, containers and plain values (same types, same keys)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return same(vars(a), vars(b))
    return a == b


@pytest.fixture(scope="module")
def clip(tiny):
    return tiny.tiny_clip(0)


@pytest.fixture(scope="module")
def vae(tiny):
    return tiny.tiny_vae(0)


@pytest.fixture(scope="module")
def vision(tiny):
    return tiny.tiny_clip_vision(0)


def image(seed, size=64, dtype=torch.float32):
    return torch.rand(1, size, size, 3, generator=torch.Generator().manual_seed(seed)).to(dtype)


PROMPTS = ["a red square on a blue field", "a (red:1.3) square, (blue:0.8) field", "",
           "embedding-free text with a very long tail " * 12]


# ---- exactness ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", PROMPTS)
@pytest.mark.parametrize("options", [{}, {"return_pooled": True}, {"return_pooled": "unprojected"},
                                     {"return_pooled": True, "return_dict": True}])
def test_text_hit_equals_uncached_bit_for_bit(cc, uncached, clip, text, options):
    tokens = clip.tokenize(text)
    reference = uncached(clip.encode_from_tokens, tokens, **options)
    miss = clip.encode_from_tokens(tokens, **options)
    hit = clip.encode_from_tokens(tokens, **options)
    assert same(reference, miss) and same(reference, hit)
    assert cc.CACHE.count("misses.text") == 1 and cc.CACHE.count("hits.text") == 1


def _bf16_sdpa(inner):
    def sdpa(q, k, v, *args, **kwargs):  # a low-precision attention kernel, as sage-attention nodes put in
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kwargs = {**kwargs, "attn_mask": mask.bfloat16()}
        return inner(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args, **kwargs).to(q.dtype)
    return sdpa


def test_a_function_another_node_replaces_for_the_whole_process_makes_a_miss(cc, uncached, clip, vae, monkeypatch):
    """A node that swaps torch's attention (F.scaled_dot_product_attention) or layer norm for the whole process, or
    rebinds the ComfyUI attention function a VAE's blocks hold (comfy.ops.scaled_dot_product_attention): the next
    encode hit and returned what was computed before (1e-2 from the text encode, 1.4e-3 from the VAE's). Each now
    misses, equals ComfyUI's encode under the replacement, and stays out of the shared tiers; put back, it hits."""
    import comfy.model_management as mm
    import comfy.ops
    import torch.nn.functional as F

    patches = rkharness.pack("patches.conditioning")
    monkeypatch.setattr(mm, "ENABLE_PYTORCH_ATTENTION", True)  # (ComfyUI's default on an NVIDIA GPU)
    tokens = clip.tokenize("a red square on a blue field")
    img = image(9)

    def encodes():
        return clip.encode_from_tokens(tokens, return_pooled=True), vae.encode(img)

    before = encodes()
    layer_norm = F.layer_norm
    for owner, name, replacement in ((F, "scaled_dot_product_attention", _bf16_sdpa(F.scaled_dot_product_attention)),
                                     (F, "layer_norm", lambda x, shape, w=None, b=None, eps=1e-5: layer_norm(
                                         x, shape, w, b, 1e-3)),
                                     (comfy.ops, "scaled_dot_product_attention",
                                      _bf16_sdpa(comfy.ops.scaled_dot_product_attention))):
        with monkeypatch.context() as m:
            m.setattr(owner, name, replacement)
            truth = uncached(encodes)
            assert not all(map(same, truth, before))  # it changes what one of them computes
            assert all(map(same, encodes(), truth)) and all(map(same, encodes(), truth)), name
            with pytest.raises(patches.LocalOnly, match=f"{name} is replaced in this process"):
                patches.shared_key(patches.text_key(clip, tokens, True, False), clip.cond_stage_model, clip.patcher)
        hits = cc.CACHE.count("hits")
        assert all(map(same, encodes(), before)) and cc.CACHE.count("hits") == hits + 2


def test_the_new_float32_precision_settings_keep_the_cache_on_and_are_keyed(cc, uncached, vae):
    """torch's per-backend ``fp32_precision`` (torch 2.9 on): once one is set otherwise, the old getter the key read
    raises, and every encode ran uncached, said only as an unexpected error. The settings are keyed instead."""
    matmul = torch.backends.mkldnn.matmul
    img = image(10)
    was = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        first = vae.encode(img)
        assert same(vae.encode(img), first) and cc.CACHE.count("hits") == 1 and not cc.CACHE.bypass_reasons()
        matmul.fp32_precision = "none"
        assert same(vae.encode(img), uncached(vae.encode, img)) and cc.CACHE.count("misses") == 2
    finally:
        matmul.fp32_precision = was


def test_an_encode_after_the_thread_count_changed_misses(cc, uncached, clip, vae):
    """torch's CPU thread count splits an encode's matrix products (2.6e-6 apart between 1 and 2 threads on a
    CLIP-L-sized encoder): a node that sets it between two encodes got the other count's result. Now the
    encode misses and equals the uncached one at the new count; back at the first count, it hits."""
    tokens = clip.tokenize("a red square on a blue field")
    pixels = image(3)
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    first = (clip.encode_from_tokens(tokens), vae.encode(pixels))
    try:
        torch.set_num_threads(other)
        reference = (uncached(clip.encode_from_tokens, tokens), uncached(vae.encode, pixels))
        assert same(reference, (clip.encode_from_tokens(tokens), vae.encode(pixels)))
        assert cc.CACHE.count("hits") == 0
    finally:
        torch.set_num_threads(before)
    assert same(first, (clip.encode_from_tokens(tokens), vae.encode(pixels))) and cc.CACHE.count("hits") == 2


def test_text_nodes_and_scheduled_path_are_exact(cc, uncached, clip):
    import nodes

    reference = uncached(nodes.CLIPTextEncode().encode, clip, "a (red:1.3) cat")[0]
    first = nodes.CLIPTextEncode().encode(clip, "a (red:1.3) cat")[0]
    second = nodes.CLIPTextEncode().encode(clip, "a (red:1.3) cat")[0]
    assert same(reference, first) and same(reference, second)
    tokens = clip.tokenize("a (red:1.3) cat")
    sched = clip.encode_from_tokens_scheduled(tokens, add_dict={"guidance": 3.5})
    assert same(uncached(clip.encode_from_tokens_scheduled, tokens, add_dict={"guidance": 3.5}), sched)
    assert cc.CACHE.count("hits.text") >= 2


@pytest.mark.parametrize("crop", [True, False])
def test_vision_hit_equals_uncached_with_every_output(cc, uncached, vision, crop):
    img = image(1, size=48)
    reference = uncached(vision.encode_image, img, crop=crop)
    miss = vision.encode_image(img, crop=crop)
    hit = vision.encode_image(img, crop=crop)
    assert type(hit) is type(reference) and same(reference, miss) and same(reference, hit)
    assert set(vars(hit)) >= {"last_hidden_state", "image_embeds", "penultimate_hidden_states"}
    other_crop = vision.encode_image(img, crop=not crop)  # the crop option is part of the key
    assert cc.CACHE.count("misses.vision") == 2 and cc.CACHE.count("hits.vision") == 1
    assert same(uncached(vision.encode_image, img, crop=not crop), other_crop)


def test_vae_encode_and_tiled_encode_are_bit_exact(cc, uncached, vae):
    import nodes

    img = image(2, size=72)
    for call in (lambda: vae.encode(img),
                 lambda: vae.encode_tiled(img, tile_x=64, tile_y=64, overlap=16),
                 lambda: nodes.VAEEncode().encode(vae, img)[0]["samples"],
                 lambda: nodes.VAEEncodeTiled().encode(vae, img, 64, 16)[0]["samples"]):
        reference = uncached(call)
        assert same(reference, call()) and same(reference, call())
    tiled_other = vae.encode_tiled(img, tile_x=64, tile_y=64, overlap=8)  # tiling parameters in the key
    assert same(uncached(vae.encode_tiled, img, tile_x=64, tile_y=64, overlap=8), tiled_other)
    # VAEEncode reuses encode's entry; VAEEncodeTiled passes temporal options: its own key
    assert cc.CACHE.count("hits.vae") == 5 and cc.CACHE.count("misses.vae") == 4


# ---- isolation ----------------------------------------------------------------------------------

def test_mutating_returned_values_never_changes_the_next_hit(cc, uncached, clip, vae, vision):
    tokens = clip.tokenize("isolation test")
    reference = uncached(clip.encode_from_tokens, tokens, return_pooled=True, return_dict=True)
    for _ in range(3):
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        assert same(reference, out)
        out["cond"].add_(1.0)
        out["pooled_output"].mul_(0)
        out["extra"] = "changed"
    img = image(3)
    latent_ref = uncached(vae.encode, img)
    for _ in range(3):
        latent = vae.encode(img)
        assert same(latent_ref, latent)
        latent.fill_(7.0)
    vision_ref = uncached(vision.encode_image, img)
    for _ in range(3):
        out = vision.encode_image(img)
        assert same(vision_ref, out)
        out.image_embeds.zero_()
        out["last_hidden_state"] = None


def test_changing_the_input_after_a_miss_does_not_change_the_key(cc, vae):
    img = image(4)
    first = vae.encode(img)
    img.add_(0.5)  # the caller reuses its buffer for another image
    second = vae.encode(img)
    assert not torch.equal(first, second)
    assert cc.CACHE.count("misses.vae") == 2


# ---- no stale or foreign hits -------------------------------------------------------------------

def test_different_inputs_and_encoders_miss(cc, tiny, clip, vae):
    a = clip.encode_from_tokens(clip.tokenize("a red square"))
    b = clip.encode_from_tokens(clip.tokenize("a red circle"))
    assert not torch.equal(a, b) and cc.CACHE.count("misses.text") == 2
    other = tiny.tiny_clip(1)  # separately loaded encoder with other weights
    c = other.encode_from_tokens(other.tokenize("a red square"))
    assert not torch.equal(a, c) and cc.CACHE.count("misses.text") == 3
    clip.encode_from_tokens(clip.tokenize("a red square"), return_pooled=True)  # other call option
    assert cc.CACHE.count("misses.text") == 4
    vae.encode(image(5))
    vae.encode(image(6))  # a different image of the same size
    vae.encode(image(5, dtype=torch.float64))  # same pixels, another dtype
    assert cc.CACHE.count("misses.vae") == 3 and cc.CACHE.count("hits.vae") == 0


def test_the_device_the_encoder_runs_on_is_part_of_the_key(tiny):
    """The same encoder run on another device gives other bits: never a hit across devices."""
    route = rkharness.pack("patches.conditioning")
    clip = tiny.tiny_clip(0)
    elsewhere = clip.clone()
    elsewhere.patcher.load_device = torch.device("cpu", 1)
    tokens = clip.tokenize("a red square")
    assert route.text_key(clip, tokens, False, False) == route.text_key(clip.clone(), tokens, False, False)
    assert route.text_key(clip, tokens, False, False) != route.text_key(elsewhere, tokens, False, False)


def test_layer_and_weight_reload_change_the_key(cc, tiny):
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("clip skip")
    full = clip.encode_from_tokens(tokens)
    skipped = clip.clone()
    skipped.clip_layer(-2)
    assert not torch.equal(full, skipped.encode_from_tokens(tokens))
    assert cc.CACHE.count("misses.text") == 2
    sd = {k: v.clone() * 1.5 for k, v in clip.cond_stage_model.state_dict().items()}
    clip.load_sd(sd, full_model=True)  # weights replaced in place: a new generation, old entries dropped
    assert not torch.equal(full, clip.encode_from_tokens(tokens))
    assert cc.CACHE.count("misses.text") == 3


def test_lora_strength_changes_miss_and_same_lora_on_a_new_clone_hits(cc, uncached, tiny):
    import comfy.sd
    import comfy.utils
    import folder_paths

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    name = loras.write_lora("rk_test_strength.safetensors", seed=1, flux=False)
    path = folder_paths.get_full_path_or_raise("loras", name)
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a lora test")
    base = clip.encode_from_tokens(tokens)

    def with_lora(strength, reload=False):
        lora = comfy.utils.load_torch_file(path, safe_load=True) if reload else LORA
        return comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1]

    LORA = comfy.utils.load_torch_file(path, safe_load=True)
    one = with_lora(1.0)
    out_one = one.encode_from_tokens(tokens)
    assert not torch.equal(base, out_one)
    half = with_lora(0.5)
    out_half = half.encode_from_tokens(tokens)
    assert same(uncached(with_lora(0.5).encode_from_tokens, tokens), out_half)
    assert cc.CACHE.count("misses.text") == 3 and cc.CACHE.count("hits.text") == 0
    again = with_lora(1.0)  # new clone, new patches_uuid, same LoRA and strength
    assert again.patcher.patches_uuid != one.patcher.patches_uuid
    assert same(out_one, again.encode_from_tokens(tokens))
    reloaded = with_lora(1.0, reload=True)  # the file read again: new tensors, same contents
    assert same(out_one, reloaded.encode_from_tokens(tokens))
    assert cc.CACHE.count("hits.text") == 2
    assert same(base, clip.encode_from_tokens(tokens))  # the un-patched encoder still hits its own entry
    assert cc.CACHE.count("hits.text") == 3


def test_one_lora_at_several_strengths_counts_its_tensors_once(cc, tiny):
    """A strength sweep makes a weight set per strength, all of the same loaded tensors: the budget and the panel
    count those bytes once (they counted once per strength, and the sweep evicted its own entries)."""
    import comfy.sd
    import comfy.utils
    import folder_paths

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    path = folder_paths.get_full_path_or_raise("loras", loras.write_lora("rk_test_sweep.safetensors", seed=3,
                                                                         flux=False))
    lora = comfy.utils.load_torch_file(path, safe_load=True)
    lora_bytes = sum(t.numel() * t.element_size() for t in lora.values())
    clip = tiny.tiny_clip(0)
    for strength in (1.0, 0.5, 0.25):
        comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1].encode_from_tokens(clip.tokenize("a sweep"))
    cache = cc.CACHE
    assert len(cache) == 3 and cache.count("evictions") == 0
    assert cache.total_bytes() == sum(e.own_bytes for e in cache._entries.values()) + lora_bytes
    cache.clear()  # the counts come back down with the entries
    assert cache.total_bytes() == 0 and not cache._held


def _edit_away_from_samples(t: torch.Tensor, samples: int = 8, checked: bool = True) -> None:
    """Triple in place every value of ``t`` but ``samples`` evenly spaced ones and (``checked``) the 32 fixed
    positions the cheap weight checks read."""
    flat = t.view(-1)
    n = flat.numel()
    weight_edits = rkharness.pack("caching.weight_edits")
    kept = set(torch.linspace(0, n - 1, steps=min(n, samples)).long().tolist())
    if checked:
        kept |= set(weight_edits._positions(weight_edits._as_ints(t)[1]).tolist())
    flat[[i for i in range(n) if i not in kept]] *= 3.0


def test_a_loaded_lora_edited_in_place_is_another_lora(cc, uncached, tiny):
    """A node that edits a loaded LoRA's tensors in place (LoraLoader keeps the loaded dict between runs) makes
    another LoRA: a new clone from the edited dict, and the clone made before it, encode as without the cache,
    never as the LoRA was (the edit kept the values the patch sets' buckets sample: a stale hit, before)."""
    import comfy.sd
    import comfy.utils
    import folder_paths

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    lora = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise(
        "loras", loras.write_lora("rk_test_inplace.safetensors", seed=7, flux=False)), safe_load=True)
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a lora edited in place")
    _, before = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    first = before.encode_from_tokens(tokens)
    _edit_away_from_samples(lora[next(k for k in lora if k.endswith("q_proj.lora_up.weight"))], checked=False)
    _, after = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    got = after.encode_from_tokens(tokens)
    want = uncached(after.encode_from_tokens, tokens)
    assert same(got, want) and not torch.equal(got, first)
    assert cc.CACHE.count("hits.text") == 0 and cc.CACHE.count("misses.text") == 2
    # its patch set is seen edited: never answered with its old entry (ComfyUI patches the edited values in)
    assert same(before.encode_from_tokens(tokens), uncached(before.encode_from_tokens, tokens))
    assert not torch.equal(before.encode_from_tokens(tokens), first)


def _a_written_lora(tiny, name: str) -> tuple:
    """(a LoRA's loaded dict, the tiny CLIP, its clone with the LoRA written into the weights by a first
    encode, a second prompt's tokens)."""
    import comfy.sd
    import comfy.utils
    import folder_paths

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    lora = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise(
        "loras", loras.write_lora(name, seed=7, flux=False)), safe_load=True)
    clip = tiny.tiny_clip(0)
    _, loaded = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    loaded.encode_from_tokens(loaded.tokenize("first prompt"))  # ComfyUI writes the LoRA into the weights
    return lora, clip, loaded, loaded.tokenize("second prompt")


@pytest.mark.parametrize("check", ["events", "every_encode"])
def test_a_lora_edited_under_a_loaded_patcher_keys_what_comfyui_computes_with(cc, uncached, tiny, check):
    """ComfyUI keeps a patcher's patches written into the weights until another patcher's are written: an
    in-place edit of the LoRA then changes nothing for that patcher, and everything for a new clone of the
    edited dict. The loaded patcher's next miss is keyed by the LoRA as it was written, so the new clone
    never hits it (it did when the set was taken again from the edited tensors)."""
    import comfy.sd

    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.check_weight_edits", check)
    try:
        lora, clip, loaded, second = _a_written_lora(tiny, "rk_test_written.safetensors")
        lora[next(k for k in lora if k.endswith("q_proj.lora_up.weight"))].mul_(3.0)
        old = loaded.encode_from_tokens(second)
        assert same(old, uncached(loaded.encode_from_tokens, second))
        _, fresh = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)
        got = fresh.encode_from_tokens(second)
        assert same(got, uncached(fresh.encode_from_tokens, second)) and not torch.equal(got, old)
    finally:
        settings.set("conditioning.check_weight_edits", "events")


@pytest.mark.parametrize("after_edit", ["a clone encodes", "partly unloaded"])
def test_a_lora_edited_while_written_never_keys_values_comfyui_did_not_write(cc, uncached, tiny, after_edit):
    """A LoRA written into the weights, then edited in place: a clone of that patcher (CLIPSetLastLayer's;
    it shares the patches) computes with what was written, and so does a partly unloaded model's part that
    stayed loaded. Neither encode may be filed under the edited tensors' set, where a new clone of the edited
    dict, which ComfyUI patches with the edited values, would find it."""
    import comfy.sd

    lora, clip, loaded, second = _a_written_lora(tiny, "rk_test_written_part.safetensors")
    for key in [k for k in lora if "lora_up" in k]:
        lora[key].mul_(3.0)
    if after_edit == "a clone encodes":
        other = loaded.clone()
    else:
        other = loaded
        patcher = loaded.patcher
        patcher.partially_unload(patcher.offload_device, 512)  # memory pressure: the rest stays loaded
    old = other.encode_from_tokens(second)
    assert same(old, uncached(other.encode_from_tokens, second))
    _, fresh = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)
    got = fresh.encode_from_tokens(second)
    assert same(got, uncached(fresh.encode_from_tokens, second)) and not torch.equal(got, old)


@pytest.mark.parametrize("edit,check", [("whole tensor", "events"), ("away from every sample", "every_encode")])
def test_two_loads_of_one_lora_edited_apart_each_encode_as_their_own(cc, uncached, tiny, edit, check):
    """Two LoraLoaders on one file share a patch set (equal contents); then one's loaded tensors are edited in
    place. Each clone then encodes as without the cache, and a miss through the edited one is never filed
    where the other finds it (before, the set watched only the first load's tensors). The cheap check of
    ``events`` reads sampled values; an edit away from all of them is seen under ``every_encode``."""
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.check_weight_edits", check)
    try:
        _two_loads_edited_apart(cc, uncached, tiny, edit)
    finally:
        settings.set("conditioning.check_weight_edits", "events")


def _two_loads_edited_apart(cc, uncached, tiny, edit):
    import comfy.sd
    import comfy.utils
    import folder_paths

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    path = folder_paths.get_full_path_or_raise("loras", loras.write_lora("rk_test_twin.safetensors", seed=7,
                                                                          rank=600, flux=False))  # 75 KiB tensors
    first, second = (comfy.utils.load_torch_file(path, safe_load=True) for _ in range(2))
    clip = tiny.tiny_clip(0)
    _, a = comfy.sd.load_lora_for_models(None, clip, first, 0.0, 1.0)
    _, b = comfy.sd.load_lora_for_models(None, clip, second, 0.0, 1.0)
    tokens, others = clip.tokenize("one prompt"), clip.tokenize("another prompt")
    before = a.encode_from_tokens(tokens)
    assert same(b.encode_from_tokens(tokens), before) and cc.CACHE.count("hits.text") == 1  # one set
    edited = second[next(k for k in second if k.endswith("q_proj.lora_up.weight"))]
    if edit == "whole tensor":
        edited.mul_(3.0)
    else:
        _edit_away_from_samples(edited, samples=48)
    for clone, text in ((b, tokens), (b, others), (a, others), (a, tokens)):
        got = clone.encode_from_tokens(text)
        assert same(got, uncached(clone.encode_from_tokens, text)), (clone is b, text is tokens)
    assert not same(b.encode_from_tokens(tokens), before)


def test_a_patch_set_means_its_tensors_as_they_were_when_first_seen(cc):
    """A set is matched by its tensors' full fingerprints, whatever tensor objects hold them: a twin load of
    the same file joins it, an edit anywhere makes another set, and a set whose tensors were edited since it
    was made gives no shared key (its digest would describe the edited bytes)."""
    conditioning = rkharness.pack("patches.conditioning")
    big = torch.randn(256, 128)  # 128 KiB
    made, tensors, _ = cc.intern_weights({"w": ("lora", big, 1.0)})
    assert tensors == [big] and made.holds([big])
    twin, twin_tensors, _ = cc.intern_weights({"w": ("lora", big.clone(), 1.0)})
    assert twin is made and twin_tensors[0] is not big
    twin_tensors[0].view(-1)[12345] += 1.0  # one value, away from any sample
    assert made.holds([big]) and not made.holds(twin_tensors)
    edited, _, _ = cc.intern_weights({"w": ("lora", twin_tensors[0], 1.0)})
    assert edited is not made
    big.view(-1)[777] += 1.0
    with pytest.raises(cc.LocalOnly, match="changed in place"):
        conditioning._patch_digest(made)


def test_the_same_tensors_patched_onto_swapped_weights_miss_whatever_the_order_they_were_added_in(cc, uncached,
                                                                                                     tiny):
    """Two patch sets with the same tensors on swapped weights, added in opposite orders, are two encoders: the
    second's encode is its own, not the first's (the patch set's key follows its sorted names)."""
    clip = tiny.tiny_clip(0)
    sd = clip.cond_stage_model.state_dict()
    q = next(k for k in sd if k.endswith("layers.0.self_attn.q_proj.weight"))
    k = next(k for k in sd if k.endswith("layers.0.self_attn.k_proj.weight"))
    g = torch.Generator().manual_seed(0)
    d1, d2 = (torch.randn(sd[q].shape, generator=g) * 0.5 for _ in range(2))
    a, b = clip.clone(), clip.clone()
    a.add_patches({q: ("diff", (d1,)), k: ("diff", (d2,))})
    b.add_patches({k: ("diff", (d1,)), q: ("diff", (d2,))})
    tokens = clip.tokenize("a red square on a blue field")
    out_a = a.encode_from_tokens(tokens)
    truth_b = uncached(b.encode_from_tokens, tokens)
    assert not torch.equal(out_a, truth_b)
    assert same(truth_b, b.encode_from_tokens(tokens))
    assert cc.CACHE.count("hits.text") == 0


def _zeroed_mlp(self, x):  # a method a node sets on one module's instance: the MLP's output zeroed
    return type(self).forward(self, x) * 0.0


@dataclasses.dataclass
class _InputScale:  # a node's object whose method replaces a module's forward: the module's input, scaled
    scale: float

    def forward(self, x):
        return x * self.scale


def test_a_method_bound_to_an_object_that_changes_in_place_is_compared_on_every_encode(cc, uncached, tiny):
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    scaler = _InputScale(0.5)
    mlp.forward = scaler.forward
    try:
        half = clip.encode_from_tokens(tokens)
        assert same(uncached(clip.encode_from_tokens, tokens), half)
        scaler.scale = 0.25  # in place: the same method object on the module
        quarter = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(quarter, half)
        assert same(quarter, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 0
    finally:
        del mlp.forward
    first, second = (m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    plain = clip.encode_from_tokens(tokens)
    first.forward = second.forward  # ComfyUI's own code, another layer's weights
    try:
        swapped = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(swapped, plain) and same(swapped, clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("hits.text") == 0
    finally:
        del first.forward


def test_a_method_set_on_an_encoder_modules_instance_is_part_of_the_key(cc, uncached, tiny):
    """A node's monkeypatch of one instance's method (``types.MethodType``) changes what the encoder
    computes: the encode after it is its own (a miss, then hits), and one whose function captures values,
    which a key cannot describe, is computed and counted."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    mlp.forward = types.MethodType(_zeroed_mlp, mlp)
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(truth, before)
        assert same(truth, clip.encode_from_tokens(tokens)) and same(truth, clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("misses.text") == 2 and cc.CACHE.count("hits.text") == 1
    finally:
        del mlp.forward
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 2
    model = clip.cond_stage_model
    method = type(model).encode_token_weights

    def halved(self, pairs):  # captures ``method``
        cond, pooled, *rest = method(self, pairs)
        return (cond * 0.5, pooled, *rest)

    model.encode_token_weights = types.MethodType(halved, model)
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        bypasses = cc.CACHE.count("bypasses")
        assert same(truth, clip.encode_from_tokens(tokens)) and not torch.equal(truth, before)
        assert cc.CACHE.count("bypasses") == bypasses + 1 and cc.CACHE.count("hits.text") == 2
    finally:
        del model.encode_token_weights


def _scaled_by_setting(self, x):  # a node's method reading its scale from a setting it set on the module
    return type(self).forward(self, x) * self.rk_scale[0][0]


def test_a_setting_held_in_a_tuple_that_changes_in_place_is_compared_on_every_encode(cc, uncached, tiny):
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    mlp.rk_scale = ([0.5],)
    mlp.forward = types.MethodType(_scaled_by_setting, mlp)
    try:
        half = clip.encode_from_tokens(tokens)
        assert same(uncached(clip.encode_from_tokens, tokens), half)
        mlp.rk_scale[0][0] = 0.25  # in place: the same tuple on the module
        quarter = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(quarter, half)
        assert same(quarter, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 0
        assert same(quarter, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1
    finally:
        del mlp.forward, mlp.rk_scale


_THROUGH = {}  # what the class-level patch below calls through to


def _halved_mlp(self, x):  # a node's class-level patch: every MLP's output halved
    return _THROUGH["forward"](self, x) * 0.5


def _halved_by_subclass(self, x):  # a subclass a node swaps a module into
    return super(type(self), self).forward(x) * 0.5


def _mlp_class(clip):
    return type(next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp")))


def test_a_function_another_module_sets_on_an_encoder_modules_class_is_never_answered_from_the_cache(cc, uncached, tiny):
    """A node that replaces a method on the class of the encoder's modules (``CLIPMLP.forward = f``) with
    its own code changes what every encoder of that class computes, through values the key cannot see
    (what ``f`` reads): each encode is computed and counted with its reason. Undone, the class is as the
    first entry saw it: a hit."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    cls = _mlp_class(clip)
    original = _THROUGH["forward"] = cls.forward
    cls.forward = _halved_mlp
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(truth, before)
        assert same(truth, clip.encode_from_tokens(tokens)) and same(truth, clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("bypasses.text") == 2 and cc.CACHE.count("hits.text") == 0
        assert any("CLIPMLP.forward on the encoder's class is code from" in r["reason"] for r in cc.CACHE.bypass_reasons())
    finally:
        cls.forward = original
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1


def test_a_module_function_the_hosts_encode_calls_rebound_by_another_node_is_a_miss(cc, uncached, vision, monkeypatch):
    """ClipVisionModel.encode_image (routed by ReuseKit: the host's original is what is read) calls
    ``clip_preprocess`` by name: a node that rebinds it got the picture's old embedding. Now a miss giving
    ComfyUI's output, kept in this process (another node's code: not shared); put back, the first entry hits."""
    import comfy.clip_model
    import comfy.clip_vision

    picture = image(1, size=48)
    first = vision.encode_image(picture, crop=True)
    # (0.3.75's encode reads it by its bare name in clip_vision, 0.33's as comfy.clip_model's)
    for module in (comfy.clip_model, comfy.clip_vision):
        if "clip_preprocess" in vars(module):
            host = module.clip_preprocess
            monkeypatch.setattr(module, "clip_preprocess", lambda *a, host=host, **k: host(*a, **k) * 0.5)
    got = vision.encode_image(picture, crop=True)
    assert same(got, uncached(vision.encode_image, picture, True)) and not same(got, first)
    assert (cc.CACHE.count("misses.vision"), cc.CACHE.count("hits.vision")) == (2, 0)
    assert cc.CACHE.bypass_reasons() == []
    monkeypatch.undo()
    assert same(vision.encode_image(picture, crop=True), first) and cc.CACHE.count("hits.vision") == 1


def test_a_device_helper_another_node_wraps_keeps_text_encodes_cached(cc, clip, monkeypatch):
    """Multi-GPU packs wrap ComfyUI's device helpers (``get_torch_device``): what those decide is keyed by the
    device fields, so the encodes the encoder's code makes through them stay cached (not refused)."""
    import comfy.model_management

    host = comfy.model_management.get_torch_device
    tokens = clip.tokenize("a red square on a blue field")
    first = clip.encode_from_tokens(tokens)
    monkeypatch.setattr(comfy.model_management, "get_torch_device", lambda *a, **k: host(*a, **k))
    assert same(clip.encode_from_tokens(tokens), first) and same(clip.encode_from_tokens(tokens), first)
    assert (cc.CACHE.count("misses.text"), cc.CACHE.count("hits.text")) == (1, 2)
    assert cc.CACHE.bypass_reasons() == []


def test_library_code_set_on_an_encoder_modules_class_is_part_of_the_key(cc, uncached, tiny):
    """torch's own code set on the class (``CLIPMLP.forward = torch.nn.Identity.forward``), then the same
    forward under two autocast decorators that only their arguments tell apart: each state is its own
    (a miss equal to an uncached encode, then a hit); with the original back, the first entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    cls = _mlp_class(clip)
    original = cls.forward
    truths, hits = [], 0
    try:
        for replacement in (torch.nn.Identity.forward, torch.autocast("cpu", dtype=torch.bfloat16)(original),
                            torch.autocast("cpu", dtype=torch.float16)(original)):
            cls.forward = replacement
            truth = uncached(clip.encode_from_tokens, tokens)
            assert all(not torch.equal(truth, t) for t in (before, *truths))
            assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits
            assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits + 1
            truths.append(truth)
            hits += 1
    finally:
        cls.forward = original
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 4
    assert cc.CACHE.count("misses.text") == 4 and cc.CACHE.count("bypasses") == 0


def _a_miss_then_a_hit_then_back(cc, uncached, clip, tokens, before, change, undo):
    """After ``change``: a miss equal to an uncached encode that differs from ``before``, then a hit; after
    ``undo`` (run whatever happens): the entry from before hits."""
    hits = cc.CACHE.count("hits.text")
    change()
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(truth, before)
        assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits
        assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits + 1
    finally:
        undo()
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits + 2


def test_a_module_swapped_into_another_class_is_a_miss(cc, uncached, tiny):
    """A node that swaps one module's class (``module.__class__ = Subclass``) changes what it computes
    without setting any attribute: the next encode misses, equal to an uncached encode, then hits; swapped
    back, the first entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    original = type(mlp)
    _a_miss_then_a_hit_then_back(
        cc, uncached, clip, tokens, before,
        lambda: setattr(mlp, "__class__", type("HalvedMLP", (original,), {"forward": _halved_by_subclass})),
        lambda: setattr(mlp, "__class__", original))


def test_what_python_caches_on_a_class_is_not_a_change(cc, tiny):
    """``copy.copy`` of the VAE wrapper (what a Cached VAE node does) makes Python cache ``__slotnames__``
    on ``comfy.sd.VAE``: the entries from before still hit."""
    import copy

    import comfy.sd

    vae = tiny.tiny_vae(0)
    img = image(3)
    if "__slotnames__" in vars(comfy.sd.VAE):
        del comfy.sd.VAE.__slotnames__  # as a fresh process has it
    before = vae.encode(img)
    copy.copy(vae)
    assert "__slotnames__" in vars(comfy.sd.VAE)
    assert same(before, vae.encode(img)) and cc.CACHE.count("hits.vae") == 1


def test_classes_made_for_one_module_are_not_kept_alive(cc, tiny):
    """torch's parametrizations (weight norm: ComfyUI's audio VAEs) make a class per module whose property
    reaches that module: once the encoder is gone, so are both."""
    import gc
    import weakref

    def encoder():
        clip = tiny.tiny_clip(0)
        linear = next(m for m in clip.cond_stage_model.modules() if isinstance(m, torch.nn.Linear))
        torch.nn.utils.parametrizations.weight_norm(linear)
        tokens = clip.tokenize("a red square")
        assert same(clip.encode_from_tokens(tokens), clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("hits.text") == 1
        return weakref.ref(linear), weakref.ref(type(linear))

    module, cls = encoder()
    cc.CACHE.clear()
    gc.collect()
    assert module() is None and cls() is None


class _DoublingMixin:  # a node's mixin put into a host class's bases
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 2


def test_new_bases_of_an_encoder_modules_class_are_part_of_the_key(cc, uncached, tiny):
    """A node that puts a mixin into the bases of the class of the encoder's linear layers changes what
    they compute: the next encode misses, equal to an uncached encode; the bases put back, the first
    entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    cls = next(type(m) for m in clip.cond_stage_model.modules()
               if isinstance(m, torch.nn.Linear) and "forward" not in vars(type(m)))
    bases = cls.__bases__
    cls.__bases__ = (_DoublingMixin, *bases)
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(truth, before)
        assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 0
    finally:
        cls.__bases__ = bases
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1


def _scaled_by_class_lists(self, x):  # a forward reading lists its class holds
    out = super(type(self), self).forward(x)
    for scale in type(self).rk_scales:
        out = out * scale
    return out * type(self).rk_nested[0][0]


def test_lists_an_encoder_modules_class_holds_are_compared_on_every_encode(cc, uncached, tiny):
    """A class-level list changed in place, or a list inside one, changes what the class computes: the
    next encode misses, equal to an uncached encode, then hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    original = type(mlp)
    mlp.__class__ = type("ScaledMLP", (original,), {"forward": _scaled_by_class_lists, "rk_scales": [],
                                                    "rk_nested": [[1.0]]})
    try:
        before = clip.encode_from_tokens(tokens)
        assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1
        hits = 1
        for change in (lambda c: c.rk_scales.append(0.5), lambda c: c.rk_nested[0].__setitem__(0, 0.25)):
            change(type(mlp))  # in place: the same lists on the class
            truth = uncached(clip.encode_from_tokens, tokens)
            assert not torch.equal(truth, before)
            assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits
            assert same(truth, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == hits + 1
            before, hits = truth, hits + 1
        assert cc.CACHE.count("bypasses") == 0
    finally:
        mlp.__class__ = original


def _halved_forward(self, x):  # code a node compiles into the host's own function (its __code__ replaced)
    return self.fc2(self.activation(self.fc1(x))) * 0.5


def test_code_another_module_puts_into_an_encoder_classs_function_is_never_answered_from_the_cache(cc, uncached,
                                                                                                  tiny):
    """A node that replaces the code inside the host's function (``CLIPMLP.forward.__code__ = ...``) leaves
    the function object, its module and its name as they were: each encode is computed and counted with
    its reason. Put back, the first entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    forward = _mlp_class(clip).forward
    original = forward.__code__
    forward.__code__ = _halved_forward.__code__
    try:
        truth = uncached(clip.encode_from_tokens, tokens)
        assert not torch.equal(truth, before)
        assert same(truth, clip.encode_from_tokens(tokens)) and same(truth, clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("bypasses.text") == 2 and cc.CACHE.count("hits.text") == 0
        assert any("CLIPMLP.forward on the encoder's class runs code from" in r["reason"]
                   for r in cc.CACHE.bypass_reasons())
    finally:
        forward.__code__ = original
    assert same(before, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1


def _code_put_in(name):
    import comfy.clip_model

    if name == "torch's":  # a library file's code: kept in the process
        return torch.nn.Identity.forward.__code__
    # a source-rewriting node or a hot reloader: code that names the host's own file, told by what it runs
    return _halved_forward.__code__.replace(co_filename=comfy.clip_model.__file__, co_name="forward")


@pytest.mark.parametrize("name", ["torch's", "as if from the host's own file"])
def test_code_put_into_an_encoder_classs_function_from_a_library_or_the_host_is_part_of_the_key(cc, uncached, tiny,
                                                                                                name):
    """Code put into the host's function (``CLIPMLP.forward.__code__ = ...``), torch's or compiled as if from
    the host's own file: a miss equal to an uncached encode, then a hit; put back, the first entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    before = clip.encode_from_tokens(tokens)
    forward = _mlp_class(clip).forward
    original = forward.__code__
    _a_miss_then_a_hit_then_back(cc, uncached, clip, tokens, before,
                                 lambda: setattr(forward, "__code__", _code_put_in(name)),
                                 lambda: setattr(forward, "__code__", original))
    assert cc.CACHE.count("bypasses") == 0


def _scaled_by_default(self, x, scale=0.5):  # a forward whose scale is its default
    return super(type(self), self).forward(x) * scale


def _by_kwdefault(self, x, *, scale=0.5):  # a forward whose scale is a keyword-only default
    return super(type(self), self).forward(x) * scale


def _by_list_default(self, x, scale=[0.5]):  # noqa: B006  a forward reading a list it holds as a default
    return super(type(self), self).forward(x) * scale[0]


def _half(x):
    return x * 0.5


def _quarter(x):
    return x * 0.25


def _by_default_function(self, x, post=_half):  # a forward calling a function it holds as a default
    return post(super(type(self), self).forward(x))


def _by_argument(self, x, scale):  # a forward a partialmethod calls
    return super(type(self), self).forward(x) * scale


def _by_argument_squared(self, x, scale):
    return super(type(self), self).forward(x) * scale * scale


def _set_inside(name):
    """(class attributes, a change made inside what the class holds, its undoing) for each case below."""
    if name == "defaults set anew":
        return ({"forward": _scaled_by_default}, lambda: setattr(_scaled_by_default, "__defaults__", (0.25,)),
                lambda: setattr(_scaled_by_default, "__defaults__", (0.5,)))
    if name == "keyword default in place":
        return ({"forward": _by_kwdefault}, lambda: _by_kwdefault.__kwdefaults__.__setitem__("scale", 0.25),
                lambda: _by_kwdefault.__kwdefaults__.__setitem__("scale", 0.5))
    if name == "list default in place":
        return ({"forward": _by_list_default}, lambda: _by_list_default.__defaults__[0].__setitem__(0, 0.25),
                lambda: _by_list_default.__defaults__[0].__setitem__(0, 0.5))
    code = _half.__code__
    if name == "code of a function held as a default":
        return ({"forward": _by_default_function}, lambda: setattr(_half, "__code__", _quarter.__code__),
                lambda: setattr(_half, "__code__", code))
    partial = functools.partialmethod(_by_argument, scale=0.5)
    if name == "keywords of a partial in place":
        return ({"forward": partial}, lambda: partial.keywords.__setitem__("scale", 0.25),
                lambda: partial.keywords.__setitem__("scale", 0.5))
    if name == "function of a partial set anew":
        return ({"forward": partial}, lambda: setattr(partial, "func", _by_argument_squared),
                lambda: setattr(partial, "func", _by_argument))
    code = _by_argument.__code__
    return ({"forward": partial}, lambda: setattr(_by_argument, "__code__", _by_argument_squared.__code__),
            lambda: setattr(_by_argument, "__code__", code))


@pytest.mark.parametrize("name", ["defaults set anew", "keyword default in place", "list default in place",
                                  "code of a function held as a default", "keywords of a partial in place",
                                  "function of a partial set anew", "code of a function a partial calls"])
def test_what_changes_inside_a_function_an_encoder_modules_class_holds_is_part_of_the_key(cc, uncached, tiny, name):
    """A change made inside what the class holds, with every attribute the same object (defaults set anew or
    edited in place, a partial's keywords or function, the code of a function it calls through a default or a
    partial): a miss equal to an uncached encode, then a hit; undone, the first entry hits."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a red square on a blue field")
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    original = type(mlp)
    attributes, change, undo = _set_inside(name)
    mlp.__class__ = type("ChangedMLP", (original,), attributes)
    try:
        before = clip.encode_from_tokens(tokens)
        _a_miss_then_a_hit_then_back(cc, uncached, clip, tokens, before, change, undo)
        assert cc.CACHE.count("bypasses") == 0
    finally:
        mlp.__class__ = original


def _wraps_itself(self, x):
    return super(type(self), self).forward(x)


def test_a_class_that_holds_a_default_referring_to_it_or_a_function_wrapping_itself_is_no_error_nor_kept(cc, tiny):
    """A function whose defaults hold its class, or that names itself as what it wraps: encodes hit, and
    once the module is gone so is its class."""
    import gc
    import weakref

    def encoder():
        clip = tiny.tiny_clip(0)
        mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
        forward = types.FunctionType(_wraps_itself.__code__, _wraps_itself.__globals__, "forward", ((None,),))
        forward.__wrapped__ = forward
        cls = type("SelfishMLP", (type(mlp),), {"forward": forward})
        forward.__defaults__ = ((cls,),)
        mlp.__class__ = cls
        tokens = clip.tokenize("a red square")
        assert same(clip.encode_from_tokens(tokens), clip.encode_from_tokens(tokens))
        assert cc.CACHE.count("hits.text") == 1 and cc.CACHE.count("bypasses") == 0
        return weakref.ref(cls)

    cls = encoder()
    cc.CACHE.clear()
    gc.collect()
    assert cls() is None


def _halved_pixels(self, pixels):  # a node's replacement of the VAE wrapper's pixel preparation
    return _THROUGH["crop"](self, pixels) * 0.5


def test_a_method_set_on_the_vae_wrappers_class_at_run_time_is_a_miss(cc, uncached, tiny):
    """ComfyUI's VAE class is followed by its states alone: a method a node sets on it makes the next
    encode a miss equal to an uncached encode; set back, the first entry hits."""
    import comfy.sd

    vae = tiny.tiny_vae(0)
    img = image(3)
    before = vae.encode(img)
    original = _THROUGH["crop"] = comfy.sd.VAE.vae_encode_crop_pixels
    comfy.sd.VAE.vae_encode_crop_pixels = _halved_pixels
    try:
        truth = uncached(vae.encode, img)
        assert not torch.equal(truth, before)
        assert same(truth, vae.encode(img)) and cc.CACHE.count("hits.vae") == 0
    finally:
        comfy.sd.VAE.vae_encode_crop_pixels = original
    assert same(before, vae.encode(img)) and cc.CACHE.count("hits.vae") == 1  # as it was: the first entry


def test_a_vae_encode_that_uses_randomness_is_never_stored(cc, uncached, tiny):
    """A sampling posterior must draw on every request: same seeds, same outputs as without cache."""
    import comfy.ldm.models.autoencoder as ae

    vae = tiny.tiny_vae(0)
    vae.first_stage_model.regularization = ae.DiagonalGaussianRegularizer(sample=True)
    img = image(7)
    torch.manual_seed(11)
    expected = [uncached(vae.encode, img) for _ in range(2)]
    torch.manual_seed(11)
    got = [vae.encode(img) for _ in range(2)]
    assert same(expected, got) and not torch.equal(got[0], got[1])
    assert len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.vae") == 2


def test_a_plain_vae_encode_that_fell_back_to_tiles_is_not_stored(cc, tiny):
    import comfy.model_management as mm

    vae = tiny.tiny_vae(0)
    img = image(9)

    def out_of_memory(*args, **kwargs):
        raise mm.OOM_EXCEPTION("simulated")

    estimate, vae.memory_used_encode = vae.memory_used_encode, out_of_memory  # inside encode's try: tiles
    vae.encode(img)
    assert len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.vae") == 1
    vae.memory_used_encode = estimate
    plain = vae.encode(img)
    assert len(cc.CACHE) == 1 and same(plain, vae.encode(img)) and cc.CACHE.count("hits.vae") == 1


def _attention_out_of_memory_once(monkeypatch):
    """ComfyUI's attention as on a CUDA machine (before a model is built), which runs out of memory once at its
    next call after the list returned is emptied: (the real function, that list)."""
    import comfy.model_management as mm
    import comfy.ops

    monkeypatch.setattr(mm, "ENABLE_PYTORCH_ATTENTION", True)
    sdpa, failed = comfy.ops.scaled_dot_product_attention, [0]

    def out_of_memory_once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise mm.OOM_EXCEPTION("simulated")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", out_of_memory_once)
    return sdpa, failed


@pytest.mark.hardening
def test_an_encode_whose_attention_ran_out_of_memory_is_returned_never_stored(cc, uncached, tiny, monkeypatch):
    """ComfyUI's VAE attention that runs out of memory goes on with sliced attention (its ``raise_non_oom``
    lets the error pass), 6e-7 from the plain encode: that result was stored, and every later encode of the
    image with room to spare got it. It is returned, counted with its reason, never stored."""
    import comfy.model_management as mm
    import comfy.ops

    if not hasattr(mm, "raise_non_oom"):
        pytest.skip("this ComfyUI catches out-of-memory errors itself (no raise_non_oom): on a GPU the CUDA "
                    "allocator's count of them tells")
    sdpa, failed = _attention_out_of_memory_once(monkeypatch)
    vae, img = tiny.tiny_vae(0), image(9)
    plain = uncached(vae.encode, img)
    failed.clear()
    sliced = uncached(vae.encode, img)
    assert failed and not torch.equal(sliced, plain)  # what ComfyUI gives under the error
    failed.clear()
    assert torch.equal(vae.encode(img), sliced) and failed
    assert len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.vae") == 1
    assert any("out-of-memory error inside it" in r["reason"] for r in cc.CACHE.bypass_reasons())
    monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", sdpa)
    assert torch.equal(vae.encode(img), plain) and len(cc.CACHE) == 1
    assert torch.equal(vae.encode(img), plain) and cc.CACHE.count("hits.vae") == 1


@pytest.mark.hardening
def test_another_packs_plain_wrappers_under_the_pass_through_routes_keep_the_cache_on(cc, uncached, tiny, monkeypatch):
    """Another pack loaded first wraps ``raise_non_oom`` and a tiling helper with ``(*args, **kwargs)`` (no
    functools.wraps): ReuseKit's replacements there pass every argument through, so the cache installs, and an
    encode that ran out of memory under their wrapper is still returned, never stored (the shape check once
    refused them, and with them the whole conditioning cache)."""
    import comfy.model_management as mm
    import comfy.ops
    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    names = [n for n in ("raise_non_oom",) if hasattr(mm, n)]
    helpers = [n for n in ("encode_tiled_", "_encode_tiled_owned") if hasattr(comfy.sd.VAE, n)]
    patches.uninstall()
    try:
        for name in names:
            inner = getattr(mm, name)
            monkeypatch.setattr(mm, name, lambda *args, _inner=inner, **kwargs: _inner(*args, **kwargs))
        for name in helpers:
            inner = getattr(comfy.sd.VAE, name)
            monkeypatch.setattr(comfy.sd.VAE, name, lambda *args, _inner=inner, **kwargs: _inner(*args, **kwargs))
        assert patches.install() and getattr(comfy.sd.VAE.encode, "__reusekit__", False)
        assert not [f for f in rkharness.pack("patches.host").off_features() if f.startswith("conditioning cache")]
        if names:  # the out-of-memory watch works through their wrapper
            sdpa, failed = _attention_out_of_memory_once(monkeypatch)
            vae, img = tiny.tiny_vae(0), image(9)
            plain = uncached(vae.encode, img)
            failed.clear()
            sliced = vae.encode(img)
            assert failed and not torch.equal(sliced, plain) and len(cc.CACHE) == 0
            monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", sdpa)
            assert torch.equal(vae.encode(img), plain) and len(cc.CACHE) == 1
    finally:
        patches.uninstall()
        monkeypatch.undo()
        patches.install()
    assert getattr(comfy.sd.VAE.encode, "__reusekit__", False) and patches.installed()


def test_another_packs_wrapper_on_a_keyed_route_turns_the_cache_off_and_the_cards_say_so(cc, clip, monkeypatch):
    """A plain ``(*args, **kwargs)`` wrapper another pack put on ``CLIP.encode_from_tokens`` first: the key binds
    that method's parameters, so the cache stays off (ComfyUI runs the encodes itself). The warning was in the log
    alone: the conditioning card showed no counters and no reason, and a lazy CLIP loaded eagerly unsaid. Both
    cards now say it is off, naming the method and what fixes it; installed again, they are on."""
    import comfy.sd

    patches, host = rkharness.pack("patches.conditioning"), rkharness.pack("patches.host")
    lazy = rkharness.pack("patches.lazy_clip")
    monkeypatch.setattr(host, "_said", set())  # (its warning is said once per process: not this test's to use up)
    patches.uninstall()
    inner = comfy.sd.CLIP.encode_from_tokens
    try:
        monkeypatch.setattr(comfy.sd.CLIP, "encode_from_tokens", lambda *args, **kwargs: inner(*args, **kwargs))
        assert not patches.install()
        for stats in (cc.CACHE.stats, lazy.STATS):
            off = stats.snapshot()["off"]
            assert off.startswith("comfy.sd.CLIP.encode_from_tokens: ") and "load ReuseKit before that pack" in off
        tokens = clip.tokenize("an encode ComfyUI runs itself")
        clip.encode_from_tokens(tokens, return_pooled=True)
        clip.encode_from_tokens(tokens, return_pooled=True)
        assert len(cc.CACHE) == 0 and cc.CACHE.count("misses.text") == 0
    finally:
        patches.uninstall()
        monkeypatch.undo()
        host._off.pop(patches.FEATURE, None)
        assert patches.install()
    assert cc.CACHE.stats.snapshot()["off"] is None and lazy.STATS.snapshot()["off"] is None


def test_a_video_vae_fallback_to_its_own_tiling_is_not_stored(cc, uncached, tiny):
    """A video VAE that tiles itself (0.33's ``_encode_tiled_owned``) answers a plain encode that ran
    out of memory: that result is returned, never stored as the plain encode."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    if not hasattr(comfy.sd.VAE, "_encode_tiled_owned"):
        pytest.skip("this ComfyUI has no comfy.sd.VAE._encode_tiled_owned (video VAEs that tile themselves)")
    helpers = __import__(f"{tiny.__name__}.conditioning", fromlist=["tiny_wan_vae"])
    vae = helpers.tiny_wan_vae(0)
    model = vae.first_stage_model

    def encode_tiled(x, **kwargs):  # the model's own tiling, finer than the plain encode's single pass
        return comfy.utils.tiled_scale_multidim(
            x, model.encode, tile=(9999, 16, 16), overlap=(1, 8, 8), upscale_amount=vae.downscale_ratio,
            out_channels=vae.latent_channels, downscale=True, index_formulas=vae.downscale_index_formula,
            output_device=vae.output_device)

    def out_of_memory(*args, **kwargs):
        raise mm.OOM_EXCEPTION("simulated")

    # the model's own method, as a video VAE defines it (an instance attribute holding code is refused)
    model.__class__ = type("TilingWanVAE", (type(model),), {"encode_tiled": lambda self, x, **kw: encode_tiled(x, **kw)})
    vae.handles_tiling = True
    img = image(12, size=32)
    estimate, vae.memory_used_encode = vae.memory_used_encode, out_of_memory  # inside encode's try: tiles
    tiled = vae.encode(img)
    assert same(uncached(vae.encode, img), tiled)
    assert len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.vae") == 1
    vae.memory_used_encode = estimate
    plain = vae.encode(img)
    assert same(uncached(vae.encode, img), plain) and not torch.equal(plain, tiled)
    assert same(plain, vae.encode(img)) and cc.CACHE.count("hits.vae") == 1


def test_plain_object_patches_are_keyed_by_name_and_value(cc, uncached, tiny):
    """Every CLIP of ComfyUI 0.4+ carries ``manual_cast_dtype``: plain values key, never refuse."""
    route = rkharness.pack("patches.conditioning")
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("an object patch")

    def patched(**objects):
        new = clip.clone()
        for name, value in objects.items():
            new.patcher.add_object_patch(name, value)
        return new

    def key(c):
        return route.text_key(c, tokens, False, False)

    fp32, bf16 = patched(manual_cast_dtype=torch.float32), patched(manual_cast_dtype=torch.bfloat16)
    assert key(fp32) == key(patched(manual_cast_dtype=torch.float32)) and key(fp32) != key(bf16)
    assert key(patched(rk_scale=1)) != key(patched(rk_scale=1.0)) != key(patched(rk_scale="1"))
    assert key(patched(rk_scale=None)) != key(patched(rk_other=None))
    references = []
    for masks in (True, False):  # a plain object patch that changes the output, on every host
        c = patched(**{"clip_l.enable_attention_masks": masks})
        references.append(uncached(c.encode_from_tokens, tokens, return_pooled=True))
        assert same(references[-1], c.encode_from_tokens(tokens, return_pooled=True))
        assert same(references[-1], c.clone().encode_from_tokens(tokens, return_pooled=True))
    assert not same(*references)
    assert cc.CACHE.count("misses.text") == 2 and cc.CACHE.count("hits.text") == 2
    with pytest.raises(cc.Uncacheable, match="rk_fn"):
        key(patched(rk_fn=lambda x: x))  # code in an object patch: the key cannot see what it does


def test_code_on_the_patcher_refuses_the_key_for_every_encoder(cc, clip, vae, vision):
    """Injections, callbacks, wrappers and weight wrappers may change the forward: no key."""
    import comfy.patcher_extension as patcher_extension

    route = rkharness.pack("patches.conditioning")
    keys = {clip: lambda c: route.text_key(c, c.tokenize("code"), False, False),
            vae: lambda v: route.vae_key(v, "encode", image(1), ()),
            vision: lambda v: route.vision_key(v, image(1), True)}
    edits = {"injections": lambda p: p.set_injections("rk", [patcher_extension.PatcherInjection(lambda mp: None, lambda mp: None)]),
             "callbacks": lambda p: p.add_callback(patcher_extension.CallbacksMP.ON_LOAD, lambda *a: None),
             "wrappers": lambda p: p.add_wrapper(patcher_extension.WrappersMP.APPLY_MODEL, lambda *a: None),
             "weight wrappers": lambda p: p.add_weight_wrapper("rk.weight", lambda w: w)}
    for encoder, key in keys.items():
        key(encoder)  # the plain encoder keys
        empty = route.cached_copy(encoder) if encoder is not clip else clip.clone()
        empty.patcher.set_injections("rk", [])  # an empty list injects nothing
        assert key(empty) == key(encoder)
        for what, edit in edits.items():
            edited = route.cached_copy(encoder) if encoder is not clip else clip.clone()
            edit(edited.patcher)
            with pytest.raises(cc.Uncacheable, match=what):
                key(edited)


def test_a_bypass_lora_clip_is_never_answered_with_the_plain_encode(cc, uncached, tiny):
    """Bypass LoRA (0.11+) lives in the patcher's injections, not in its weight patches."""
    try:
        from comfy_extras.nodes_lora_debug import LoraLoaderBypass
    except ImportError:
        pytest.skip("this ComfyUI has no bypass LoRA (comfy_extras.nodes_lora_debug.LoraLoaderBypass)")
    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    name = loras.write_lora("rk_test_bypass.safetensors", seed=7, flux=False)
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a bypass lora prompt")
    plain = clip.encode_from_tokens(tokens, return_pooled=True)
    _, bypassed = LoraLoaderBypass().load_lora(None, clip, name, 0.0, 1.0)
    assert bypassed.patcher.injections and not bypassed.patcher.patches
    reference = uncached(bypassed.encode_from_tokens, tokens, return_pooled=True)
    assert not same(plain, reference)
    for _ in range(2):
        assert same(reference, bypassed.encode_from_tokens(tokens, return_pooled=True))
    assert same(plain, clip.encode_from_tokens(tokens, return_pooled=True))
    assert cc.CACHE.count("bypasses.text") == 2 and cc.CACHE.count("hits.text") == 1


def test_hits_keep_the_types_of_sizes_and_containers(cc):
    """CLIP vision's ``image_sizes`` (0.33) holds ``torch.Size`` objects: a hit gives them back as such."""
    import collections

    cache = cc.ConditioningCache()
    value = {"sizes": [torch.Size([3, 48, 48])], "pair": (1, torch.ones(2)), "list": [torch.Size([])]}
    cache.fetch(_key(cc, "types"), lambda: value)
    assert same(value, cache.fetch(_key(cc, "types"), lambda: pytest.fail("must hit")))
    Pair = collections.namedtuple("Pair", "a b")
    pair = Pair(torch.ones(1), 2)
    assert cache.fetch(_key(cc, "named"), lambda: pair) is pair  # a copy would lose its type: not stored
    assert cache.count("bypasses") == 1 and len(cache) == 1


def test_an_encode_that_was_running_when_the_cache_was_cleared_is_not_kept(cc):
    """A clear (the panel's, or a check_weight_edits switch, which empties the cache) while an encode runs: its
    result was stored after the clear, under the rules from before it. It is returned, not kept, counted."""
    cache = cc.ConditioningCache()

    def cleared_meanwhile():
        cache.clear()
        return torch.ones(3)

    assert torch.equal(cache.fetch(_key(cc, "running"), cleared_meanwhile), torch.ones(3))
    assert len(cache) == 0 and cache.count("bypasses.text") == 1
    assert any("cleared" in r["reason"] for r in cache.stats.reasons() if r["event"] == "bypass")
    assert torch.equal(cache.fetch(_key(cc, "running"), lambda: torch.ones(3)), torch.ones(3))
    assert len(cache) == 1 and cache.fetch(_key(cc, "running"), lambda: pytest.fail("must hit")) is not None


@pytest.mark.parametrize("inference", [False, True])
def test_hits_give_every_dtype_bit_for_bit_in_tensors_the_caller_owns(cc, inference):
    """A hit's CPU tensors are copied on the calling thread, byte for byte: each dtype, 0-d and empty
    tensors, a non-contiguous one; the copy is the caller's own (resizable, sharing no memory) and is
    an inference tensor exactly when torch's own copy would be."""
    cache = cc.ConditioningCache()
    base = torch.randn(4, 77, 24)
    value = [base.to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                    torch.int64, torch.float8_e4m3fn, torch.complex64)]
    value += [base > 0, torch.tensor(3.5), torch.empty(0, 5), base.transpose(0, 2)]
    with torch.inference_mode(inference):
        cache.fetch(_key(cc, "dtypes"), lambda: value)
        for _ in range(2):
            hit = cache.fetch(_key(cc, "dtypes"), lambda: pytest.fail("must hit"))
            assert len(hit) == len(value)
            for got, want in zip(hit, value, strict=True):
                expected = want.to("cpu", copy=True)
                assert (got.dtype, got.shape, got.stride(), got.is_inference()) == \
                    (want.dtype, want.shape, expected.stride(), expected.is_inference())
                assert got.contiguous().view(-1).view(torch.uint8).tolist() == \
                    want.contiguous().view(-1).view(torch.uint8).tolist()
                assert got.numel() == 0 or got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
            hit[0].resize_(2, 3).fill_(9)  # torch-owned memory, and the next hit is unchanged


@pytest.mark.parametrize("schedule_clip", [False, True])
def test_clip_with_lora_hooks_bypasses_and_stays_exact(cc, uncached, tiny, schedule_clip):
    import comfy_extras.nodes_hooks as hooks_nodes

    import nodes

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["write_lora"])
    name = loras.write_lora("rk_test_hooks.safetensors", seed=5, flux=False)
    clip = tiny.tiny_clip(0)
    (hooks,) = hooks_nodes.CreateHookLora().create_hook(name, 0.0, 1.0)
    (hooked,) = hooks_nodes.SetClipHooks().apply_hooks(clip, schedule_clip, False, hooks)
    encode = nodes.CLIPTextEncode().encode
    reference = uncached(encode, hooked, "a hooked prompt")[0]
    assert same(reference, encode(hooked, "a hooked prompt")[0])
    assert same(reference, encode(hooked, "a hooked prompt")[0])
    assert len(cc.CACHE) == 0 and cc.CACHE.count("bypasses.text") >= 2
    base = uncached(encode, clip, "a hooked prompt")[0]
    assert not same(base, reference) and same(base, encode(clip, "a hooked prompt")[0])


def test_hooks_and_autograd_bypass(cc, clip):
    tokens = clip.tokenize("bypass")
    base = clip.encode_from_tokens(tokens)
    patched = clip.clone()
    patched.patcher.add_object_patch("clip_l.transformer.text_model.final_layer_norm", torch.nn.Identity())
    assert not torch.equal(base, patched.encode_from_tokens(tokens))  # not keyed: runs, never stored
    assert torch.equal(base, clip.encode_from_tokens(tokens))
    with torch.inference_mode(False), torch.enable_grad():
        clip.encode_from_tokens(tokens)
    assert cc.CACHE.count("bypasses.text") == 2 and len(cc.CACHE) == 1 and cc.CACHE.count("hits.text") == 1


# ---- bounds and LRU order -------------------------------------------------------------------------

def _key(cc, i, kind="text", owners=(1,)):
    return cc.Key(kind, (cc.encode(i),), owners=owners)


def test_byte_and_entry_limits_hold_under_a_stream(cc):
    cache = cc.ConditioningCache(budget_bytes=10_000, max_entries=5)
    for i in range(50):
        value = torch.full((100 + 37 * (i % 7),), float(i))
        cache.fetch(_key(cc, i), lambda v=value: v)
        assert len(cache) <= 5 and cache.total_bytes() <= 10_000
    assert cache.count("evictions") >= 40
    cache.configure(max_entries=2)
    assert len(cache) == 2
    cache.configure(budget_bytes=500)
    assert cache.total_bytes() <= 500


def test_oversized_entries_are_not_admitted_and_capacity_zero_disables(cc):
    cache = cc.ConditioningCache(budget_bytes=1_000, max_entries=8)
    big = torch.zeros(1_000)
    assert cache.fetch(_key(cc, "big"), lambda: big) is big
    assert len(cache) == 0 and cache.count("rejected") == 1
    cache.configure(budget_bytes=0)
    calls = []
    for _ in range(2):
        cache.fetch(_key(cc, "small"), lambda: calls.append(1) or torch.ones(2))
    assert len(calls) == 2 and len(cache) == 0 and cache.count("hits") == 0


def test_pixels_are_keyed_by_a_digest_and_the_key_bytes_are_counted(cc, vae):
    """A large input is keyed by a 256-bit digest (shape, dtype, layout beside it): the key never holds
    the pixels, its bytes count in the budget, and one changed pixel misses."""
    patches = rkharness.pack("patches.conditioning")
    big = image(10, size=600)  # 4.3 MB of pixels
    key = patches.vae_key(vae, "encode", big, ())
    assert key.nbytes < 64 << 10 and key == patches.vae_key(vae, "encode", big.clone(), ())
    vae.encode(big)
    (entry,) = cc.CACHE._entries.values()
    assert entry.own_bytes >= key.nbytes + 16 * 75 * 75 * 4 and cc.CACHE.total_bytes() < 1 << 20
    other = big.clone()
    other[0, 599, 599, 2] += 0.25
    assert patches.vae_key(vae, "encode", other, ()) != key
    assert patches.vae_key(vae, "encode", big.double(), ()) != key
    assert patches.vae_key(vae, "encode", big.reshape(1, 300, 1200, 3), ()) != key


def test_encoder_module_settings_are_in_the_key(cc, uncached, tiny):
    """Settings on the encoder's own modules change the computation: each is part of the key."""
    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a masked prompt")
    plain = clip.encode_from_tokens(tokens)
    inner = clip.cond_stage_model.clip_l
    for name, value in (("enable_attention_masks", True), ("zero_out_masked", True)):
        before = getattr(inner, name)
        setattr(inner, name, value)
        try:
            out = clip.encode_from_tokens(tokens)
            assert same(uncached(clip.encode_from_tokens, tokens), out)
        finally:
            setattr(inner, name, before)
    assert cc.CACHE.count("misses.text") == 3 and same(plain, clip.encode_from_tokens(tokens))
    vae = tiny.tiny_vae(0)
    img = image(20)
    vae.encode(img)
    vae.first_stage_model.encoder.conv_in.padding = (0, 0)  # a setting of a module, not of the wrapper
    try:
        assert same(uncached(vae.encode, img), vae.encode(img)) and cc.CACHE.count("hits.vae") == 0
    finally:
        vae.first_stage_model.encoder.conv_in.padding = (1, 1)


def test_in_place_weight_edits_and_foreign_patchers_never_hit(cc, uncached, tiny):
    """A VAE edited in place (no load_sd) starts a new generation; a patcher subclass that keeps
    its own LoRA store is refused (the key cannot see what it applies)."""
    import comfy.model_patcher

    with torch.inference_mode(False):
        vae = tiny.tiny_vae(3)
    img = image(21)
    first = vae.encode(img)
    with torch.inference_mode(False), torch.no_grad():
        vae.first_stage_model.encoder.conv_in.weight.mul_(1.5)
    edited = vae.encode(img)
    assert not torch.equal(first, edited) and same(uncached(vae.encode, img), edited)

    class ForkPatcher(comfy.model_patcher.ModelPatcher):  # a GGUF-style fork: LoRA outside ``patches``
        own_strength = 0.0

    clip = tiny.tiny_clip(0)
    tokens = clip.tokenize("a fork patcher")
    fork = clip.clone()
    fork.patcher.__class__ = ForkPatcher
    fork.encode_from_tokens(tokens)
    assert cc.CACHE.count("bypasses.text") == 1 and cc.CACHE.count("misses.text") == 0


def test_in_place_edits_of_inference_weights_never_hit(cc, uncached, tiny):
    """Encoders built inside inference mode (as ComfyUI's loaders run) have weights that track no
    version: an in-place edit of one (a single element) is still seen by the content check."""
    with torch.inference_mode():
        clip = tiny.tiny_clip(4)
        weight = clip.cond_stage_model.clip_l.transformer.text_model.final_layer_norm.weight
        assert weight.is_inference()
        tokens = clip.tokenize("an inference-mode encoder")
        first = clip.encode_from_tokens(tokens)
        assert same(first, clip.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1  # still hits
        weight[0] = weight[0] * 2
        edited = clip.encode_from_tokens(tokens)
    assert not same(first, edited) and same(uncached(clip.encode_from_tokens, tokens), edited)
    assert cc.CACHE.count("hits.text") == 1


def test_real_loader_weights_are_inference_tensors_and_edits_are_seen(cc, uncached, tiny, tmp_path):
    """ComfyUI's VAELoader, through the real executor, leaves the weights as inference tensors; an
    in-place edit of them (as a custom node would make) misses."""
    import folder_paths
    from safetensors.torch import save_file

    loras = __import__(f"{tiny.__name__}.conditioning", fromlist=["tiny_wan_vae"])
    state = loras.tiny_wan_vae(5).first_stage_model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "rk_inference_vae.safetensors"))
    folder_paths.add_model_folder_path("vae", str(tmp_path))
    executor = rkharness.Executor()
    executor.run({"1": {"class_type": "VAELoader", "inputs": {"vae_name": "rk_inference_vae.safetensors"}},
                  "2": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["1", 0]}}})
    vae = executor.output("1")[0][0]
    weights = list(vae.first_stage_model.parameters())
    assert weights and all(w.is_inference() for w in weights)
    video = torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        first = vae.encode(video)
        assert torch.equal(vae.encode(video), first) and cc.CACHE.count("hits.vae") == 1
        weights[0].mul_(1.5)
        edited = vae.encode(video)
    assert not torch.equal(first, edited) and same(uncached(vae.encode, video), edited)


def test_uninstall_leaves_a_later_wrapper_in_place_and_working(cc, clip):
    """Another pack wrapped a patched method after us: uninstall keeps its wrapper, which still works
    (ours passes through); a new install routes again."""
    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    ours = comfy.sd.CLIP.encode_from_tokens
    calls = []

    def theirs(self, *args, **kwargs):
        calls.append(1)
        return ours(self, *args, **kwargs)

    comfy.sd.CLIP.encode_from_tokens = theirs
    tokens = clip.tokenize("another pack")
    try:
        patches.uninstall()
        assert comfy.sd.CLIP.encode_from_tokens is theirs and not patches.installed()
        assert not getattr(comfy.sd.VAE.encode, "__reusekit__", False)
        out = clip.encode_from_tokens(tokens)
        assert calls == [1] and len(cc.CACHE) == 0 and cc.CACHE.count("misses") == 0
        assert patches.install() and comfy.sd.CLIP.encode_from_tokens is theirs
        assert same(out, clip.encode_from_tokens(tokens)) and len(cc.CACHE) == 1
    finally:
        patches.uninstall()
        comfy.sd.CLIP.encode_from_tokens = ours
        patches.install()
    assert getattr(comfy.sd.CLIP.encode_from_tokens, "__reusekit__", False) and patches.installed()


def test_lru_order(cc):
    cache = cc.ConditioningCache(budget_bytes=1 << 20, max_entries=2)
    for name in ("A", "B"):
        cache.fetch(_key(cc, name), lambda: torch.ones(4))
    cache.fetch(_key(cc, "A"), lambda: pytest.fail("A must hit"))  # A becomes most recent
    cache.fetch(_key(cc, "C"), lambda: torch.ones(4))  # evicts B, the least recently used
    assert [k.fields[0] for k in cache.keys()] == [cc.encode("A"), cc.encode("C")]


def test_global_budget_setting_applies_at_once(cc, clip):
    settings = rkharness.pack("caching.settings").SETTINGS
    for i in range(6):
        clip.encode_from_tokens(clip.tokenize(f"prompt {i}"))
    assert len(cc.CACHE) == 6
    settings.set("conditioning.max_entries", 2)
    assert len(cc.CACHE) == 2
    settings.set("conditioning.budget_mib", 0)
    assert len(cc.CACHE) == 0
    before = cc.CACHE.count("bypasses.text")
    clip.encode_from_tokens(clip.tokenize("prompt 0"))
    assert len(cc.CACHE) == 0
    assert cc.CACHE.count("bypasses.text") == before + 1  # counted, with its reason, where the panel shows it
    assert any("budget_mib or max_entries is 0" in r["reason"] for r in cc.CACHE.bypass_reasons())
    with pytest.raises(ValueError, match="conditioning.max_entries"):
        settings.set("conditioning.max_entries", -1)


# ---- keys -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys():
    return rkharness.pack("caching.keys")


def test_key_encoder_types_plain_values_apart(keys, cc):
    ev = keys.encode
    assert len({ev(1), ev(1.0), ev(True), ev("1"), ev(b"1"), ev(None), ev((1,)), ev([1])}) == 8
    assert ev(0) != ev(False) and ev(0.0) != ev(-0.0) and ev(float("nan")) == ev(float("nan"))
    assert ev(5) == ev(np.int64(5)) and ev(np.float32(0.5)) != ev(0.5)  # NumPy floats key by dtype
    assert ev({"a": 1, "b": 2}) == ev({"b": 2, "a": 1}) and ev({"a": 1}) != ev({"a": 1.0})
    assert ev({1, 2}) == ev({2, 1}) and ev({1, 2}) != ev((1, 2)) and ev(torch.Size([2])) != ev((2,))
    assert ev(torch.float16) != ev(torch.bfloat16) and ev(torch.device("cpu")) != ev("cpu")
    assert ev(collections.OrderedDict(a=1)) != ev({"a": 1})  # a subclass keys with its class
    # a prompt's (token, weight) pairs key packed by column, as exactly as element by element
    pairs = [(49406, 1.0), (320, 1.1), (49407, 1.0)]
    assert ev(pairs) == ev([tuple(p) for p in pairs]) and ev(pairs)[0] == "R"
    alike = [pairs, [(49406, 1.0), (320, 1.1), (49407, -1.0)], [(49406, 1.0), (320, 1), (49407, 1.0)],
             [(49406, 1.0), (320, 1.1), (True, 1.0)], [(49406, 1.0), (320, 1.1), (49407, 1.0, 0)],
             [(49406, -0.0)], [(49406, 0.0)], [(2**70, 1.0)], [(2**70 + 1, 1.0)], tuple(pairs),
             [list(p) for p in pairs], [(1.0, 49406)], pairs[:2], [(49406, float("nan"))]]
    assert len({ev(v) for v in alike}) == len(alike)
    assert ev([(49406, float("nan"))]) == ev([(49406, float("nan"))])
    assert cc.Key("text", (ev(1),)) != cc.Key("vae", (ev(1),))
    for bad in (object(), torch.nn.Linear(1, 1), lambda: 0, torch.zeros(2, device="meta"),
                torch.zeros(2, 2).to_sparse()):
        with pytest.raises(keys.Uncacheable):
            ev(bad)


@pytest.mark.parametrize("numel", [4, 4096])  # small: kept by value; large: by a BLAKE2b digest
def test_key_encoder_tensors_by_metadata_and_content(keys, numel):
    ev = keys.encode
    a = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    assert ev(a) == ev(a.clone()) and hash(ev(a)) == hash(ev(a.clone()))
    one = a.clone()
    one[-1] = torch.nextafter(one[-1], torch.tensor(1e9))  # one element, one bit
    assert ev(one) != ev(a)
    assert ev(a) != ev(a.double()) and ev(a) != ev(a.view(torch.int32)) and ev(a) != ev(a.reshape(2, -1))
    zero = torch.zeros(numel)
    assert ev(zero) != ev(-zero) and ev(torch.full((numel,), float("nan"))) == ev(torch.full((numel,), float("nan")))
    square = a.reshape(2, -1)
    view = square[:, ::2]  # non-contiguous: keyed by the elements it shows and its stride
    assert ev(view) != ev(view.contiguous()) and ev(view) == ev(a.clone().reshape(2, -1)[:, ::2])
    assert ev(torch.zeros(2)) != ev(torch.zeros(2, dtype=torch.int32)) and ev(torch.zeros(0)) != ev(torch.zeros(0, 1))
    field = ev(a)
    assert len(field[-1]) == (a.numel() * 4 if a.numel() * 4 <= keys.SMALL_TENSOR else 32)  # never megabytes


def test_identity_serials_are_never_reused(cc):
    seen, ids = set(), set()
    for _ in range(50):
        module = torch.nn.Linear(2, 2)
        serial = cc.identity(module)
        assert serial not in seen and cc.identity(module) == serial
        seen.add(serial)
        ids.add(id(module))
        del module  # freed at once: the next module often gets the same address
    assert len(ids) < len(seen)  # addresses were reused, serials were not


def test_weight_sets_are_interned_by_content(cc):
    w = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    one = cc.intern_weights({"k": [(1.0, (w,), 1.0, None, None)]})[0]
    same_content = cc.intern_weights({"k": [(1.0, (w.clone(),), 1.0, None, None)]})[0]
    other_strength = cc.intern_weights({"k": [(0.5, (w,), 1.0, None, None)]})[0]
    changed = w.clone()
    changed[3, 3] += 1
    other_values = cc.intern_weights({"k": [(1.0, (changed,), 1.0, None, None)]})[0]
    assert one is same_content and one is not other_strength and one is not other_values
    assert cc.intern_weights({})[0] is None


def test_an_entry_whose_weights_another_entry_pinned_stays_within_the_budget(cc):
    """A LoRA'd encoder's weight set counts once, held by every entry made with it: evicting the other
    entry that held it, to make room for a new one with the same set, keeps the set and the budget."""
    cache = cc.ConditioningCache(budget_bytes=20000, max_entries=100)
    lora = cc.intern_weights({"k": [(1.0, (torch.arange(2000, dtype=torch.float32),), 1.0, None, None)]})[0]

    def key(i, weights):
        return cc.Key("text", (("i", i),), owners=(1,), weights=weights)

    assert cache.store(key(0, (lora,)), torch.zeros(1000), 0.1) and cache.store(key(1, ()), torch.zeros(1500), 0.1)
    assert cache.store(key(2, (lora,)), torch.zeros(2500), 0.1)
    assert cache.total_bytes() <= cache.budget_bytes
    assert torch.equal(cache.lookup(key(2, (lora,))), torch.zeros(2500))
    assert not cache.store(key(3, (lora,)), torch.zeros(3000), 0.1)  # with its weights, over the whole budget
    (refused,) = [r for r in cache.stats.reasons() if r["event"] == "refused"]
    assert refused["source"] == "text" and "larger than the whole budget" in refused["reason"]
    assert cache.total_bytes() == sum(e.own_bytes for e in cache._entries.values()) + 2000 * 4


def test_entries_over_the_budget_count_on_one_row_whatever_their_size(cc):
    """The refused row names no entry's size: a row per size would crowd the panel's reason list."""
    cache = cc.ConditioningCache(budget_bytes=cc.MIB // 4, max_entries=100)
    for i, mib in enumerate((1, 2, 3)):
        assert not cache.store(cc.Key("text", (("i", i),), owners=(1,)), torch.zeros(mib * cc.MIB // 4), 0.1)
    (refused,) = [r for r in cache.stats.reasons() if r["event"] == "refused"]
    assert refused["count"] == 3 and cache.total_bytes() == 0


def test_dead_encoders_drop_their_entries(cc, tiny):
    import gc

    clip = tiny.tiny_clip(2)
    clip.encode_from_tokens(clip.tokenize("short lived"))
    assert len(cc.CACHE) == 1
    del clip
    gc.collect()
    stats = rkharness.pack("caching.stats").REGISTRY.snapshot()  # settles what the collector recorded
    (entry,) = [c for c in stats["caches"] if c["name"] == "conditioning"]
    assert len(cc.CACHE) == 0 and entry["entries"] == 0


# ---- no device tier --------------------------------------------------------------------------------

def test_the_cache_holds_no_device_memory_and_asks_comfyui_for_none(cc):
    """Entries are CPU copies: no releaser in ComfyUI's free_memory, no device option left."""
    memory = rkharness.pack("patches.memory")
    nodes_mod = rkharness.pack("nodes.conditioning")
    patches = rkharness.pack("patches.conditioning")
    assert patches.installed() and patches.FEATURE not in [name for name, _ in memory._releasers]
    assert "conditioning.device_hot_negatives" not in rkharness.pack("caching.settings").SETTINGS.snapshot()
    for node in (nodes_mod.CachedCLIP, nodes_mod.ConditioningCacheSettings):
        assert not [i for i in node.define_schema().inputs if "device" in i.id]


# ---- concurrency ------------------------------------------------------------------------------------

@pytest.mark.hardening
def test_threads_encoding_and_reading_stats_never_corrupt_the_cache(cc, uncached, clip):
    registry = rkharness.pack("caching.stats").REGISTRY
    texts = [f"thread prompt {i % 5}" for i in range(40)]
    expected = {t: uncached(clip.encode_from_tokens, clip.tokenize(t), return_pooled=True) for t in set(texts)}
    cc.CACHE.configure(max_entries=3)  # force evictions while threads run
    errors = []

    def encoder(offset):
        try:
            with torch.inference_mode():
                for t in texts[offset:] + texts[:offset]:
                    assert same(expected[t], clip.encode_from_tokens(clip.tokenize(t), return_pooled=True))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    def reader():
        for _ in range(200):
            snap = registry.snapshot()
            assert any(c["name"] == "conditioning" for c in snap["caches"])

    threads = [threading.Thread(target=encoder, args=(i * 7,)) for i in range(4)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(cc.CACHE) <= 3
    entries = list(cc.CACHE._entries.values())
    assert cc.CACHE.total_bytes() == sum(e.own_bytes for e in entries)


# ---- stats, switches, patches ---------------------------------------------------------------------

def test_stats_report_tiers_budgets_counters_and_time_saved(cc, clip):
    registry = rkharness.pack("caching.stats").REGISTRY
    tokens = clip.tokenize("stats")
    clip.encode_from_tokens(tokens)
    clip.encode_from_tokens(tokens)
    (snap,) = [c for c in registry.snapshot()["caches"] if c["name"] == "conditioning"]
    assert snap["kind"] == "conditioning" and snap["clearable"] and snap["entries"] == 1
    assert snap["counters"]["hits"] == 1 and snap["counters"]["misses"] == 1
    assert snap["bytes"]["cpu"] > 0 and snap["bytes"]["device"] == 0
    assert snap["budgets"]["cpu"] == snap["budgets"]["device"] == 512 * MIB
    assert snap["time_saved_s"] > 0 and snap["info"]["by_kind"]["text"]["entries"] == 1
    assert registry.clear("conditioning") == ["conditioning"] and len(cc.CACHE) == 0


def test_global_mode_off_leaves_encoders_alone_but_the_cached_node_still_caches(cc, clip):
    nodes_mod = rkharness.pack("nodes.conditioning")
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.enabled", False)
    tokens = clip.tokenize("node path")
    clip.encode_from_tokens(tokens)
    assert len(cc.CACHE) == 0 and cc.CACHE.count("misses") == 0
    cached = nodes_mod.CachedCLIP.execute(clip).result[0]
    assert cached is not clip and "reusekit_conditioning" not in clip.patcher.model_options
    first = cached.encode_from_tokens(tokens)
    assert same(first, cached.encode_from_tokens(tokens)) and cc.CACHE.count("hits.text") == 1
    downstream = cached.clone()  # LoraLoader and friends clone: the mark travels with model_options
    downstream.encode_from_tokens(tokens)
    assert cc.CACHE.count("hits.text") == 2


def test_cached_vae_and_vision_nodes_copy_and_validate(cc, vae, vision):
    nodes_mod = rkharness.pack("nodes.conditioning")
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.enabled", False)
    new_vae = nodes_mod.CachedVAE.execute(vae=vae).result[0]
    new_vision = nodes_mod.CachedCLIPVision.execute(clip_vision=vision).result[0]
    assert new_vae is not vae and new_vae.patcher is not vae.patcher
    assert "reusekit_conditioning" not in vae.patcher.model_options
    img = image(8)
    assert same(new_vae.encode(img), new_vae.encode(img))
    assert same(new_vision.encode_image(img), new_vision.encode_image(img))
    vae.encode(img)  # the original is untouched: not routed
    assert cc.CACHE.count("hits.vae") == 1 and cc.CACHE.count("hits.vision") == 1 and cc.CACHE.count("misses.vae") == 1
    with pytest.raises(ValueError, match="ReuseKit Cached VAE.*'vae'"):
        nodes_mod.CachedVAE.execute(vae="not a vae")
    with pytest.raises(ValueError, match="ReuseKit Cached CLIP.*'clip'"):
        nodes_mod.CachedCLIP.execute(None)


def test_install_and_uninstall_are_idempotent(cc, clip):
    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    assert patches.installed() and getattr(comfy.sd.CLIP.encode_from_tokens, "__reusekit__", False)
    try:
        patches.uninstall()
        patches.uninstall()
        assert not patches.installed() and not hasattr(comfy.sd.CLIP.encode_from_tokens, "__reusekit__")
        clip.encode_from_tokens(clip.tokenize("unpatched"))
        assert cc.CACHE.count("misses") == 0
    finally:
        assert patches.install() and patches.install()
    assert getattr(comfy.sd.CLIP.encode_from_tokens, "__reusekit__", False)


def test_a_reshaped_seam_leaves_the_cache_off_with_one_warning(cc, clip, caplog):
    """A newer ComfyUI that reshaped a patched method: nothing is patched, ComfyUI runs unchanged."""
    import logging

    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    host = rkharness.pack("patches.host")
    patches.uninstall()
    original = comfy.sd.CLIP.__dict__["encode_from_tokens"]

    def reshaped(self, tokens, options=None):
        return original(self, tokens)

    comfy.sd.CLIP.encode_from_tokens = reshaped
    try:
        with caplog.at_level(logging.WARNING, logger="reusekit"):
            assert not patches.install() and not patches.install() and not patches.installed()
        warnings = [r for r in caplog.records if "conditioning cache is off" in r.getMessage()]
        assert len(warnings) == 1 and "comfy.sd.CLIP.encode_from_tokens" in warnings[0].getMessage()
        assert "CLIP.encode_from_tokens" in host.off_features()["conditioning cache"]
        assert comfy.sd.CLIP.encode_from_tokens is reshaped
        assert not getattr(comfy.sd.VAE.encode, "__reusekit__", False)
        clip.encode_from_tokens(clip.tokenize("a reshaped seam"))
        assert len(cc.CACHE) == 0 and cc.CACHE.count("misses") == 0
    finally:
        comfy.sd.CLIP.encode_from_tokens = original
        assert patches.install()


def test_an_option_a_newer_host_added_is_passed_on_and_keyed(cc, uncached, vae):
    """ComfyUI 0.38 gave VAE.encode a ``not_video`` option: the patched encode passes such an option on to
    the host's method and keys it, by name or by position, so an encode with it never hits one without."""
    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    patches.uninstall()
    original = comfy.sd.VAE.__dict__["encode"]

    def encode(self, pixel_samples, not_video=None):  # the 0.38 shape, over the real encode
        out = original(self, pixel_samples)
        return out * -1 if not_video else out

    comfy.sd.VAE.encode = encode
    try:
        assert patches.install()
        pixels = torch.rand((1, 64, 64, 3), generator=torch.Generator().manual_seed(7))
        plain = vae.encode(pixels)
        flagged = vae.encode(pixels, not_video=True)
        assert cc.CACHE.count("misses.vae") == 2
        assert same(flagged, uncached(vae.encode, pixels, not_video=True)) and not same(flagged, plain)
        assert same(vae.encode(pixels, not_video=True), flagged) and same(vae.encode(pixels), plain)
        assert cc.CACHE.count("hits.vae") == 2
        # by position, as the host's signature takes it: named by that signature, so the keyword call's entry
        assert same(vae.encode(pixels, True), flagged) and cc.CACHE.count("hits.vae") == 3
        assert same(vae.encode(pixels, False), plain) and cc.CACHE.count("misses.vae") == 3  # False is not None
        with pytest.raises(TypeError, match="takes from 2 to 3 positional arguments but 4"):  # the host's own
            vae.encode(pixels, True, 3)
        with pytest.raises(TypeError, match="multiple values for argument 'not_video'"):
            vae.encode(pixels, True, not_video=False)
    finally:
        patches.uninstall()
        comfy.sd.VAE.encode = original
        assert patches.install()


def test_options_a_seam_takes_as_args_run_uncached_counted(cc, uncached, vae):
    """A seam wrapped as (self, pixel_samples, *args) (another pack's wrapper, say): options passed to it by
    position have no names to key them by, so the encode runs uncached, counted with the reason, and gives
    what the host gives; passed by name they key as always."""
    import comfy.sd

    patches = rkharness.pack("patches.conditioning")
    patches.uninstall()
    original = comfy.sd.VAE.__dict__["encode"]

    def encode(self, pixel_samples, *args, **kwargs):
        out = original(self, pixel_samples)
        return out * -1 if (args and args[0]) or kwargs.get("flip") else out

    comfy.sd.VAE.encode = encode
    try:
        assert patches.install()
        pixels = torch.rand((1, 64, 64, 3), generator=torch.Generator().manual_seed(7))
        flipped = vae.encode(pixels, True)
        assert same(flipped, uncached(vae.encode, pixels, True)) and same(vae.encode(pixels, True), flipped)
        assert cc.CACHE.count("bypasses.vae") == 2 and cc.CACHE.count("misses.vae") == 0
        (row,) = cc.CACHE.bypass_reasons()
        assert row["reason"] == "options passed by position that test_options_a_seam_takes_as_args_run_uncached_" \
                                "counted.<locals>.encode's signature does not name", row
        assert same(vae.encode(pixels, flip=True), flipped) and cc.CACHE.count("misses.vae") == 1
    finally:
        patches.uninstall()
        comfy.sd.VAE.encode = original
        assert patches.install()


def test_environment_switch_values(monkeypatch, cc):
    for value, expected in (("0", False), ("off", False), ("false", False), ("1", True), ("", True)):
        monkeypatch.setenv("REUSEKIT_CONDITIONING", value)
        assert cc._env_enabled() is expected, value


def test_environment_switch_sets_the_global_mode_default():
    """A fresh interpreter imports caching/ alone (no ComfyUI): the setting follows REUSEKIT_CONDITIONING."""
    import os
    import subprocess
    import sys

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rkc', {str(rkharness.ROOT / 'caching' / '__init__.py')!r},"
        f" submodule_search_locations=[{str(rkharness.ROOT / 'caching')!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['rkc'] = m; spec.loader.exec_module(m)\n"
        "import rkc.conditioning as c\n"
        "assert 'comfy' not in sys.modules\n"
        "print(c.SETTINGS.get('conditioning.enabled'))\n"
    )
    env = {**os.environ, "REUSEKIT_CONDITIONING": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
