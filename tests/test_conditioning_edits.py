"""Conditioning cache: in-place weight edits are seen by events, never by reading every weight per
encode (patches/encoder_weights.py, caching/weight_edits.py). One fingerprint for every device, an
offload is never an edit, an edit between two node runs is seen, every_encode sees one inside a node,
a Prompt Batch shares one full check, and the setting's three values."""

import atexit
import os
import shutil
import tempfile
import types
from importlib import import_module

import numpy as np
import pytest
import rkharness
import torch

pytestmark = pytest.mark.conditioning


def _files():
    return import_module(rkharness.TINY.__name__ + ".conditioning")


@pytest.fixture
def cc():
    """Global mode on, the default edit checks, an empty cache; put back after."""
    mod = rkharness.pack("caching.conditioning")
    settings = rkharness.pack("caching.settings").SETTINGS
    saved = {k: settings.get(k) for k in ("conditioning.enabled", "conditioning.check_weight_edits")}
    settings.update({"conditioning.enabled": True, "conditioning.check_weight_edits": "events"})
    mod.CACHE.clear()
    mod.CACHE.reset_counts()
    yield mod
    settings.update(saved)
    mod.CACHE.clear()


@pytest.fixture
def we():
    return rkharness.pack("caching.weight_edits")


def checks(clip):
    return rkharness.pack("patches.encoder_weights").checks(clip.cond_stage_model)


def uncached(fn, *args):
    settings = rkharness.pack("caching.settings").SETTINGS
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", False)
    try:
        return fn(*args)
    finally:
        settings.set("conditioning.enabled", before)


def file_clip(seed=0):
    """A tiny CLIP loaded from its own new file (registered with the pack as a loader would)."""
    folder = tempfile.mkdtemp(prefix="rk_edits_")
    atexit.register(shutil.rmtree, folder, True)  # the file stays while the process may load it again
    return _files().load_tiny_clip_file(_files().write_tiny_clip_file(folder, seed))


# ---- the fingerprint ----------------------------------------------------------------------------

def test_one_fingerprint_sees_every_one_element_edit_and_moves_are_not_edits(we):
    """Every dtype's one-element edit changes its tensor's fingerprint and no other; a swap of two
    values is an edit; equal bytes give equal values however they are laid out; the rows' shares of an
    embedding table add up to the table's fingerprint (one function, the same on every device: the
    gpu test compares it on CUDA)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1200, 1200, generator=gen), torch.randn(16, generator=gen).half(),
               torch.randint(0, 255, (7,), generator=gen, dtype=torch.uint8), torch.randn(33, generator=gen).double(),
               torch.randn(600, 600, generator=gen)]
    before = we.fingerprints(weights)
    assert before == we.fingerprints([w.clone() for w in weights]) and len(set(before)) == len(weights)
    assert we.fingerprint(weights[0]) == we.fingerprint(weights[0].t().contiguous().t().contiguous())
    for i, w in enumerate(weights):
        for pos in (0, w.numel() // 2, -1):
            edited = [v.clone() for v in weights]
            flat = edited[i].view(-1)
            flat[pos] = flat[pos] + 1
            after = we.fingerprints(edited)
            assert after[i] != before[i] and [a for j, a in enumerate(after) if j != i] == [b for j, b in enumerate(before) if j != i]
    swapped = weights[0].clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert we.fingerprint(swapped) != before[0]
    table = torch.randn(3000, 768, generator=gen).half()
    assert int(we._row_shares(table, 384).sum()) & we.MASK == we.fingerprint(table)


def test_the_cheap_check_sees_small_tensors_samples_and_the_rows_a_prompt_reads(we):
    gen = torch.Generator().manual_seed(1)
    named = {"emb": torch.randn(5000, 64, generator=gen), "norm": torch.randn(64, generator=gen),
             "mlp": torch.randn(512, 256, generator=gen)}
    watch = we.WeightWatch()
    assert not watch.full(named, embeddings=frozenset({"emb"}))
    ids = [0, 17, 4999]
    assert not watch.quick(named, token_ids=ids)
    moved = {k: v.clone() for k, v in named.items()}  # new storage, same bytes: what a device move makes
    assert not watch.quick(moved, token_ids=ids)
    for name, at in (("emb", (17, 3)), ("norm", (5,)), ("mlp", None)):
        edited = {k: v.clone() for k, v in named.items()}
        if at is None:
            edited[name].mul_(1.001)
        else:
            edited[name][at] += 1
        assert watch.quick(edited, token_ids=ids), name
    row = {k: v.clone() for k, v in named.items()}
    row["emb"][1234, 0] += 1
    assert not watch.quick(row, token_ids=ids) and watch.quick(row, token_ids=[1234])  # only rows that are read
    assert watch.quick({**named, "extra": torch.zeros(3)}) and watch.quick({"emb": named["emb"]})
    assert watch.quick({**named, "norm": named["norm"].double()})
    assert watch.full(row, embeddings=frozenset({"emb"})) and not watch.quick(row, token_ids=[1234])


def test_the_cheap_check_reads_weights_where_they_are_and_follows_them_when_they_move(we):
    """The cheap check reads plain contiguous CPU weights straight from memory: a one-element edit at a
    sampled position is seen in every dtype, in place (same addresses) and after a move; a new full
    check's references replace the old at the same addresses; a non-contiguous weight and a Parameter
    are read too."""
    gen = torch.Generator().manual_seed(2)
    named = {"f32": torch.randn(300, 200, generator=gen), "bf16": torch.randn(300, 200, generator=gen).bfloat16(),
             "f8": torch.randn(200, 200, generator=gen).to(torch.float8_e4m3fn), "c128": torch.randn(90, 90, generator=gen).to(torch.complex128),
             "norm": torch.randn(64, generator=gen).half(), "t": torch.randn(256, 128, generator=gen).t(),
             "param": torch.nn.Parameter(torch.randn(256, 256, generator=gen), requires_grad=False)}
    watch = we.WeightWatch()
    assert not watch.full(named) and not watch.quick(named) and not watch.quick(named)

    def flip(t, plan, at):  # one bit of the value the check reads at ``at`` (in its reading order)
        data = t.data
        if plan.small:
            data.view(-1).view(torch.uint8)[at] ^= 1
        else:
            ints = data.view(plan.ints)
            ints[tuple(int(i) for i in np.unravel_index(at, ints.shape))] ^= 1

    for name, t in named.items():
        plan = watch._plans[name]
        at = int(plan.positions[len(plan.positions) // 2]) if not plan.small else plan.nbytes - 1
        flip(t, plan, at)  # in place: the addresses the check last read
        assert watch.quick(named), name
        flip(t, plan, at)
        assert not watch.quick(named), name
        moved = {k: v.clone() for k, v in named.items()}  # new addresses, the same bytes
        assert not watch.quick(moved), name
        flip(moved[name], plan, at)
        assert watch.quick(moved), name
    edited = {k: v.clone() for k, v in named.items()}
    edited["f32"].view(-1)[int(watch._plans["f32"].positions[0])] += 1
    assert watch.quick(edited) and watch.full(edited) and not watch.quick(edited)  # its new reference
    assert watch.quick(named)  # the old bytes are an edit now


# ---- events --------------------------------------------------------------------------------------

def test_hits_take_no_full_fingerprint_and_an_offload_cycle_still_hits(cc):
    """A hit takes only the cheap check. ComfyUI unloading the encoder and the weights landing in new
    storage (what a move to the CPU and back makes) is not an edit: the next encode hits, bit-exact,
    and the encoder keeps its shared identity."""
    import comfy.model_management

    clip = file_clip(0)
    tokens = clip.tokenize("an offloaded prompt")
    first = clip.encode_from_tokens(tokens, return_pooled=True)
    full = checks(clip)[0]
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(clip.encode_from_tokens(tokens, return_pooled=True), first))
    assert checks(clip)[0] == full and cc.CACHE.count("hits.text") == 5
    for _ in range(3):
        comfy.model_management.unload_all_models()
        with torch.inference_mode():
            clip.cond_stage_model._apply(lambda t: t.clone())
        again = clip.encode_from_tokens(tokens, return_pooled=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert cc.CACHE.count("hits.text") == 8 and cc.CACHE.count("encodes") == 1
    key = rkharness.pack("patches.conditioning").text_key(clip, tokens, True, False)
    assert rkharness.pack("patches.conditioning").shared_key(key, clip.cond_stage_model, clip.patcher) is not None


def test_weight_patches_applied_and_removed_take_one_full_check_and_still_hit(cc):
    """A CLIP LoRA: ComfyUI applies the patches when it loads the encoder and removes them when it
    unloads it; each time the next encode fingerprints in full (an event), finds the base weights
    unchanged, and hits."""
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    base = file_clip(0)
    lora = comfy.utils.load_torch_file(os.path.join(_files().lora_dir(), _files().write_lora("edits.safetensors", flux=False)))
    _, clip = comfy.sd.load_lora_for_models(None, base, lora, 0.0, 1.0)
    tokens = clip.tokenize("a patched prompt")
    first = clip.encode_from_tokens(tokens)
    assert torch.equal(first, uncached(clip.encode_from_tokens, tokens))
    for _ in range(2):
        full = checks(clip)[0]
        comfy.model_management.unload_all_models()
        assert torch.equal(clip.encode_from_tokens(tokens), first)
        assert checks(clip)[0] <= full + 1
    assert cc.CACHE.count("encodes") == 1


def test_a_removed_patch_reads_again_only_what_the_patcher_wrote_and_sees_its_base_edited(cc, we):
    """A patch on a large weight: when ComfyUI removes it, the next encode fingerprints in full the
    weight the patcher put back, and no other: unchanged, a hit; its base edited while patched over
    (one value away from the sampled positions), the encode is the edited weights' own."""
    import comfy.model_management

    name = "clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
    clip = _files().clip_l_sized(3, _files().CLIP_MID).clone()
    diff = torch.randn(512, 128, generator=torch.Generator().manual_seed(1)) * 0.01
    clip.add_patches({name: ("diff", (diff,))}, 1.0)
    tokens = clip.tokenize("a patched prompt")
    first = clip.encode_from_tokens(tokens)  # ComfyUI loads the encoder: the patch is applied
    module = clip.cond_stage_model
    watch = rkharness.pack("patches.encoder_weights")._encoders[module].watch
    total = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    comfy.model_management.unload_all_models()  # the patch removed
    assert torch.equal(clip.encode_from_tokens(tokens), first) and cc.CACHE.count("hits.text") == 1
    assert watch.last_full_bytes == diff.numel() * 4 < total / 4

    comfy.model_management.load_model_gpu(clip.patcher)  # applied again: the base weight in the backup
    base = clip.patcher.backup[name].weight
    sampled = set(we._positions(base.numel()).tolist())
    at = next(i for i in range(1000, base.numel()) if i not in sampled)
    with torch.no_grad():
        base.view(-1)[at] += 1.0
    comfy.model_management.unload_all_models()  # puts the edited base back
    out = clip.encode_from_tokens(tokens)
    assert not torch.equal(out, first) and torch.equal(out, uncached(clip.encode_from_tokens, tokens))


@pytest.mark.parametrize("what", ["dense", "embedding_row", "small"])
def test_an_in_place_edit_between_two_node_runs_is_seen_under_events(cc, what, tmp_path):
    """Through the real executor: encode, a node edits the CLIP's weights in place, encode again: the
    second encode is the edited weights' own, never the stored one."""
    from safetensors.torch import load_file

    path = _files().write_tiny_clip_file(str(tmp_path), 0)
    text = "a yellow star"
    prompt = {"1": {"class_type": "RKTestFileCLIP", "inputs": {"path": path}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
              "3": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "path": str(tmp_path / "a.st")}},
              "4": {"class_type": "RKTestEditEncoder", "inputs": {"clip": ["1", 0], "what": what, "text": text,
                                                                  "after": ["2", 0]}},
              "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 0], "text": text}},
              "6": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["5", 0], "path": str(tmp_path / "b.st")}}}
    rkharness.Executor().run(prompt)
    a, b = load_file(str(tmp_path / "a.st")), load_file(str(tmp_path / "b.st"))
    fresh = _files().load_tiny_clip_file(path)
    _files().edit_weights(fresh, what, text)
    expected = uncached(fresh.encode_from_tokens, fresh.tokenize(text), True)
    assert not torch.equal(a["cond"], b["cond"])
    assert torch.equal(b["cond"], expected[0]) and torch.equal(b["pooled"], expected[1])
    assert cc.CACHE.count("hits.text") == 0


def test_an_in_place_edit_of_a_position_row_is_seen(cc):
    """CLIP's learned position table is read by position, not by token id: a row of it no sample reads,
    edited in place between two encodes, once gave the first encode's output on a hit."""
    we = rkharness.pack("caching.weight_edits")
    clip = _files().clip_l_sized(0, _files().CLIP_HEADS)
    table = clip.cond_stage_model.clip_l.transformer.text_model.embeddings.position_embedding.weight
    assert table.numel() * table.element_size() > we.SMALL  # not read whole by the cheap check
    sampled = set((we._positions(table.numel()) // table.shape[1]).tolist())
    tokens = clip.tokenize("a photo of a cat")
    row = next(r for r in range(1, 8) if r not in sampled and r not in {t[0] for b in tokens["l"] for t in b})
    with torch.inference_mode():
        first = clip.encode_from_tokens(tokens)
        table[row] += 0.5
        edited = clip.encode_from_tokens(tokens)
    assert not torch.equal(edited, first) and torch.equal(edited, uncached(clip.encode_from_tokens, tokens))
    assert cc.CACHE.count("hits.text") == 0


@pytest.mark.parametrize("mode,edit", [("events", "dense"), ("every_encode", "sparse")])
def test_an_edit_between_two_encodes_of_one_custom_node_is_seen(cc, mode, edit):
    """A custom node encodes, edits the weights in place and encodes again, all in one node run; the second
    encode is the edited weights' own, not the first one's output. ``events``: a whole MLP weight scaled
    by 1.5, seen by the cheap check the second encode gets in full (only ComfyUI's own nodes, a Prompt
    Batch through CLIPTextEncode, check just the rows of later encodes); ``every_encode``: one value away
    from the sampled positions, seen by its full fingerprint."""
    rkharness.pack("caching.settings").SETTINGS.set("conditioning.check_weight_edits", mode)
    text = "a green tree"
    ex = rkharness.Executor()
    ex.run({"1": {"class_type": "RKTestSizedCLIP", "inputs": {"seed": 0, "name": f"{mode}_{edit}"}},
            "2": {"class_type": "RKTestEncodeEditEncode", "inputs": {"clip": ["1", 0], "text": text, "what": edit}},
            "3": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["2", 1]}}})
    (before,), (after,) = ex.output("2")
    fresh = _files().clip_l_sized(0, _files().CLIP_MID)
    _files().edit_weights(fresh, edit, text)
    expected = uncached(fresh.encode_from_tokens, fresh.tokenize(text))
    assert not torch.equal(before[0][0], after[0][0]) and torch.equal(after[0][0], expected)
    assert cc.CACHE.count("hits.text") == 0


@pytest.mark.parametrize("mode,fulls", [("events", 1), ("every_encode", 16)])
def test_a_prompt_batch_of_16_takes_one_full_fingerprint_per_encoder(cc, mode, fulls):
    """A LoRA'd encoder ComfyUI unloaded (its patches removed: an event), then a Prompt Batch of 16
    prompts in one node run: under events one full fingerprint covers the batch; every_encode takes 16."""
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    rkharness.pack("caching.settings").SETTINGS.set("conditioning.check_weight_edits", mode)
    base = file_clip(1)
    lora = comfy.utils.load_torch_file(os.path.join(_files().lora_dir(), _files().write_lora("batch.safetensors", flux=False)))
    _, clip = comfy.sd.load_lora_for_models(None, base, lora, 0.0, 1.0)
    clip.encode_from_tokens(clip.tokenize("warm up"))
    comfy.model_management.unload_all_models()
    name = f"rk_batch_{mode}"
    _files()._FILE_CLIPS[name] = clip
    prompts = "\n".join(f"prompt number {i}" for i in range(16))
    full = checks(clip)[0]
    rkharness.Executor().run({
        "1": {"class_type": "RKTestFileCLIP", "inputs": {"path": name}},
        "2": {"class_type": "ReuseKitPromptBatch", "inputs": {"prompts": prompts, "negative": ""}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": ["2", 0]}},
        "4": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["3", 0]}}})
    assert checks(clip)[0] - full == fulls


# ---- the setting ---------------------------------------------------------------------------------

def test_off_checks_nothing_and_leaves_the_shared_tiers_and_switching_empties_the_cache(cc):
    settings = rkharness.pack("caching.settings").SETTINGS
    pc = rkharness.pack("patches.conditioning")
    clip = file_clip(2)
    tokens = clip.tokenize("a switched setting")
    clip.encode_from_tokens(tokens)
    assert len(cc.CACHE) == 1
    settings.set("conditioning.check_weight_edits", "off")
    assert len(cc.CACHE) == 0
    before = checks(clip)
    clip.encode_from_tokens(tokens)
    clip.encode_from_tokens(tokens)
    assert checks(clip) == before and cc.CACHE.count("hits.text") == 1
    key = pc.text_key(clip, tokens, False, False)
    with pytest.raises(cc.LocalOnly, match="weight edit checks are off"):
        pc.shared_key(key, clip.cond_stage_model, clip.patcher)
    settings.set("conditioning.check_weight_edits", "events")
    assert len(cc.CACHE) == 0 and pc.shared_key(pc.text_key(clip, tokens, False, False), clip.cond_stage_model,
                                                 clip.patcher) is not None


def test_the_setting_takes_its_older_true_false_form_and_names_itself_on_a_bad_value(cc, caplog):
    settings = rkharness.pack("caching.settings").SETTINGS
    with caplog.at_level("INFO", logger="reusekit"):
        assert settings.set("conditioning.check_weight_edits", False) == "off"
        assert settings.set("conditioning.check_weight_edits", True) == "events"
    assert "older form" in caplog.text
    with pytest.raises(ValueError, match="conditioning.check_weight_edits.*events, every_encode, off"):
        settings.set("conditioning.check_weight_edits", "sometimes")


def test_module_settings_are_memoised_but_never_stale(cc):
    """The module-settings part of the key is read once, then reused until a plain attribute set, an
    in-place change of a settings container or an object patch changes it: each is a miss whose
    output equals an uncached encode."""
    clip = rkharness.TINY.tiny_clip(0)
    tokens = clip.tokenize("a memo")
    plain = clip.encode_from_tokens(tokens)
    inner = clip.cond_stage_model.clip_l
    inner.special_tokens["pad"] = int(str(inner.special_tokens["pad"]))  # same value, new object: still a hit
    assert torch.equal(clip.encode_from_tokens(tokens), plain) and cc.CACHE.count("hits.text") == 1
    saved = inner.special_tokens["pad"]
    try:
        inner.special_tokens["pad"] = 0  # an in-place edit of a settings dict
        out = clip.encode_from_tokens(tokens)
        assert torch.equal(out, uncached(clip.encode_from_tokens, tokens)) and cc.CACHE.count("hits.text") == 1
    finally:
        inner.special_tokens["pad"] = saved
    patched = clip.clone()
    patched.patcher.add_object_patch("clip_l.layer_norm_hidden_state", not inner.layer_norm_hidden_state)
    out = patched.encode_from_tokens(tokens)
    assert torch.equal(out, uncached(patched.encode_from_tokens, tokens)) and cc.CACHE.count("hits.text") == 1
    assert torch.equal(clip.encode_from_tokens(tokens), plain) and cc.CACHE.count("hits.text") == 2


_FLIPPED = {}


def _flipping_forward(self, *args, **kwargs):  # the encoder's forward, then one of its settings set
    out = _FLIPPED["forward"](self, *args, **kwargs)
    self.enable_attention_masks = _FLIPPED["masks"]
    return out


def test_a_setting_an_encode_changes_while_it_runs_is_seen_by_the_next_encode(cc, monkeypatch):
    """One encode's key and shared key read the modules once between them; an encoder that sets one of
    its own settings while it computes makes the next encode a miss whose output equals an uncached
    encode (the first encode's reading of its modules is not kept past it)."""
    clip = rkharness.TINY.tiny_clip(0)
    tokens = clip.tokenize("a setting set inside")
    inner = clip.cond_stage_model.clip_l
    before = inner.enable_attention_masks
    first = clip.encode_from_tokens(tokens)
    monkeypatch.setitem(_FLIPPED, "forward", type(inner).forward)
    monkeypatch.setitem(_FLIPPED, "masks", not before)
    monkeypatch.setattr(inner, "forward", types.MethodType(_flipping_forward, inner), raising=False)
    try:
        inner.enable_attention_masks = before
        cc.CACHE.clear()
        assert torch.equal(clip.encode_from_tokens(tokens), first) and cc.CACHE.count("hits.text") == 0
        second = clip.encode_from_tokens(tokens)  # computed with the setting the first encode left
        assert cc.CACHE.count("hits.text") == 0 and cc.CACHE.count("bypasses") == 0 and not torch.equal(second, first)
        assert torch.equal(second, uncached(clip.encode_from_tokens, tokens))
    finally:
        inner.enable_attention_masks = before


def test_later_encodes_of_one_node_run_check_the_rows_they_read(cc, tmp_path):
    """A Prompt Batch checks the weights once per node run, then only the embedding rows each prompt
    reads: a row edited before the run that only the second prompt reads still makes it miss."""
    path = _files().write_tiny_clip_file(str(tmp_path), 0)
    prompt = {"1": {"class_type": "RKTestFileCLIP", "inputs": {"path": path}},
              "2": {"class_type": "ReuseKitPromptBatch", "inputs": {"prompts": "a red square\na blue circle",
                                                                    "negative": ""}},
              "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": ["2", 0]}},
              "4": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["3", 0]}}}
    ex = rkharness.Executor()
    ex.run(prompt)
    first = ex.output("3")[0]
    prompt["2"]["inputs"]["negative"] = "unused"  # so that ComfyUI runs the encode node again
    clip = _files()._FILE_CLIPS[path]
    _files().edit_weights(clip, "embedding_row", "circle")  # between two node runs, as another node would
    quick = checks(clip)[1]
    ex.run(prompt)
    second = ex.output("3")[0]
    assert torch.equal(second[0][0][0], first[0][0][0]) and cc.CACHE.count("hits.text") == 1  # "a red square"
    fresh = _files().load_tiny_clip_file(path)
    _files().edit_weights(fresh, "embedding_row", "circle")
    expected = uncached(fresh.encode_from_tokens, fresh.tokenize("a blue circle"))
    assert not torch.equal(second[1][0][0], first[1][0][0]) and torch.equal(second[1][0][0], expected)
    assert checks(clip)[1] - quick == 2  # one check of every weight, then the second prompt's rows


def test_what_comfyuis_patchers_keep_on_a_module_is_not_an_encoder_setting(cc):
    """Dynamic VRAM (ComfyUI 0.16+ on NVIDIA) keeps its pins, arenas and patchers on the module it
    loads, as objects a key cannot describe: they are load state, so encodes still hit."""
    clip = rkharness.TINY.tiny_clip(5)
    tokens = clip.tokenize("a dynamic load")
    first = clip.encode_from_tokens(tokens)
    module = clip.cond_stage_model
    module.dynamic_pins, module.dynamic_vbars, module.dynamic_patchers = object(), {}, [object()]
    try:
        assert torch.equal(clip.encode_from_tokens(tokens), first)
        assert cc.CACHE.count("hits.text") == 1 and cc.CACHE.count("bypasses.text") == 0
    finally:
        del module.dynamic_pins, module.dynamic_vbars, module.dynamic_patchers


def test_a_merged_clip_never_caches_what_its_second_clips_live_weights_decide(cc, tiny):
    """CLIPMergeSimple (CLIPAdd, CLIPSubtract) patches the first CLIP with the second's own parameters, which
    ComfyUI's hooks write in place (SetClipHooks on the second CLIP) as any in-place edit does: a hit then
    gave the merge of the weights as they were (0.46 from the encode, cache off, under a hook LoRA), and a
    shared entry carried it to other workers. Such an encode is computed every time, counted."""
    import comfy_extras.nodes_model_merging as merging

    import nodes

    a, b = tiny.tiny_clip(0), tiny.tiny_clip(1)
    (m,) = merging.CLIPMergeSimple().merge(a, b, 0.5)

    def encode(clip):
        return nodes.CLIPTextEncode().encode(clip, "a red circle")[0][0]

    first = encode(m)
    assert torch.equal(first[0], uncached(encode, m)[0])
    weight = b.cond_stage_model.state_dict(keep_vars=True)["clip_l.transformer.text_model.final_layer_norm.weight"]
    weight.data.mul_(1.5)  # as a hook writes (ComfyUI's copy_to_param): no version bump, no event
    uncached(encode, a)  # the first CLIP's own weights back in its module: the merge patches them anew next
    again = encode(m)
    assert not torch.equal(again[0], first[0]) and torch.equal(again[0], uncached(encode, m)[0])
    assert len(cc.CACHE) == 0
    reasons = rkharness.pack("caching.conditioning").CACHE.stats.snapshot()["reasons"]
    assert any("another model's live weights" in r["reason"] for r in reasons)
    before = len(cc.CACHE)
    encode(a)  # the first CLIP alone still caches
    assert len(cc.CACHE) == before + 1


def _quantized_clip(folder: str, name: str, scale: float = 1.0):
    """A tiny CLIP-L saved with fp8 weights in ComfyUI's mixed-precision layout (``comfy_quant`` and a
    weight_scale per layer, as quantized checkpoints ship) and loaded by ComfyUI: its linears hold
    QuantizedTensor weights. ``scale`` multiplies every stored scale (a file that differs in them alone)."""
    import json

    import comfy.sd
    import comfy.sd1_clip
    import comfy.supported_models_base
    import comfy.utils
    from safetensors.torch import save_file

    config = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
              "projection_dim": 64}
    source = _files().clip_l_sized(0, config).cond_stage_model.state_dict()
    sd = {k.removeprefix("clip_l.transformer."): v.detach().contiguous().clone() for k, v in source.items()}
    out = {k: v for k, v in sd.items() if not k.startswith("clip_l.")}
    for k, v in list(out.items()):
        if k.endswith(".weight") and v.dim() == 2 and ".layers." in k and ("mlp" in k or "proj" in k):
            layer, s = k.removesuffix(".weight"), v.abs().amax() / 448.0
            out[k] = (v / s).to(torch.float8_e4m3fn)
            out[layer + ".weight_scale"] = (s * scale).float().reshape(())
            out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                       dtype=torch.uint8)
    path = os.path.join(folder, f"{name}.safetensors")
    save_file(out, path)
    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    with torch.inference_mode():  # as ComfyUI's executor loads
        clip = comfy.sd.CLIP(target=target, state_dict=[comfy.utils.load_torch_file(path, safe_load=True)],
                             model_options={"clip_l_model_config": dict(config), "dtype": torch.float32,
                                            "quantization_metadata": {"mixed_ops": True}})
    rkharness.pack("patches.conditioning").register_source(clip, [path], "rk_tinymodels.load_tiny_clip_file", config)
    return clip


@pytest.mark.hardening
def test_a_quantized_encoders_hit_reads_its_data_and_scales_never_dequantizing_them(cc, monkeypatch, tmp_path):
    """ComfyUI's mixed-precision (comfy_quant) fp8 encoder: the cheap check of every hit read each weight through
    its full dequantization (twice: 64 ms at width 128, 309 ms at 1024, against 0.5 ms for a plain encoder). It
    reads the fp8 data and the scales themselves: a hit dequantizes nothing, and a file or an in-place edit
    that changes a scale alone still misses, each result ComfyUI's own."""
    from test_conditioning import same

    try:
        import comfy.quant_ops as quant
    except ImportError:
        pytest.skip("this ComfyUI has no quantized layouts (comfy.quant_ops)")
    import inspect

    import comfy.sd

    if "state_dict" not in inspect.signature(comfy.sd.CLIP.__init__).parameters:
        pytest.skip("this ComfyUI's CLIP loads no state dict itself (its mixed-precision layers come with 0.4)")
    folder = str(tmp_path)
    clip = _quantized_clip(folder, "a")
    weights = [p for p in clip.cond_stage_model.parameters() if isinstance(p, quant.QuantizedTensor)]
    if not weights:
        pytest.skip("this ComfyUI loads no QuantizedTensor weights from comfy_quant layers")

    def encode(c):
        with torch.inference_mode():
            return c.encode_from_tokens(c.tokenize("a red chair"), return_pooled=True)

    first = encode(clip)
    assert same(first, uncached(encode, clip))
    dequantized = []
    real = quant.QuantizedTensor.dequantize
    monkeypatch.setattr(quant.QuantizedTensor, "dequantize", lambda self: dequantized.append(1) or real(self))
    hits = cc.CACHE.count("hits.text")
    assert same(encode(clip), first) and cc.CACHE.count("hits.text") == hits + 1
    assert dequantized == []  # (the encode's own matmuls ran in the first call, not in the hit)
    monkeypatch.undo()
    other = _quantized_clip(folder, "b", scale=1.5)  # the same fp8 bytes, other scales
    theirs = encode(other)
    assert same(theirs, uncached(encode, other)) and not same(theirs, first)
    plain_leaves = rkharness.pack("caching.weights_identity").plain_leaves
    (scale,) = [t for n, t in plain_leaves("w", weights[0]) if "scale" in n]
    with torch.inference_mode():
        scale.mul_(2.0)  # in place, as a node editing the loaded model would
    edited = encode(clip)
    assert same(edited, uncached(encode, clip)) and not same(edited, first)
    # a LoRA on a quantized weight: its clone and the base take turns, each hitting after its first encode (the
    # patched weight's leaves named as its unpatched ones: the turns once read as edits, 12 encodes of 12)
    base = _quantized_clip(folder, "c")
    lora = base.clone()
    lora.add_patches({"clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight":
                      ("diff", (torch.randn(256, 64, generator=torch.Generator().manual_seed(1)) * 0.01,))}, 1.0)
    encodes = cc.CACHE.count("encodes")
    outs = {c: encode(c) for c in (base, lora)}
    for _ in range(3):
        for c in (base, lora):
            assert same(encode(c), outs[c])
    assert cc.CACHE.count("encodes") == encodes + 2 and not same(outs[base], outs[lora])
    assert same(outs[lora], uncached(encode, lora))
