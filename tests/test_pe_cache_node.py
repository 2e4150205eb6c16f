"""The ReuseKit PE Cache node, the server-wide default, install/uninstall, and the example workflow."""

import threading

import numpy as np
import pytest
import rkharness
import torch

pytestmark = pytest.mark.pe_cache


rope = rkharness.pack("patches.rope")  # conftest bootstrapped the host before this import
host = rkharness.pack("patches.host")
pc = rkharness.pack("caching.pe_cache")


@pytest.fixture
def default_on():
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set(pc.DEFAULT_ENABLED_KEY, True)
    try:
        yield
    finally:
        settings.set(pc.DEFAULT_ENABLED_KEY, False)


def node():
    import nodes

    return nodes.NODE_CLASS_MAPPINGS["ReuseKitPECache"]


def sample(model, tiny, shape=(1, 16, 8, 8), steps=3, cfg=2.0, negative="blurry"):
    import nodes

    clip = tiny.tiny_clip(0)
    (pos,) = nodes.CLIPTextEncode().encode(clip, "a red circle on a green square")
    (neg,) = nodes.CLIPTextEncode().encode(clip, negative)
    (out,) = nodes.common_ksampler(model, 7, steps, cfg, "euler", "simple", pos, neg,
                                   {"samples": torch.zeros(shape)})
    return out["samples"]


def counters(cache):
    return dict(cache.stats.snapshot()["counters"]) if cache is not None else {}


def test_ksampler_on_tiny_flux_with_the_node_equals_the_run_without(tiny):
    import comfy.patcher_extension as patcher_extension

    model = tiny.tiny_flux(0)
    plain = sample(model, tiny)
    assert rope.model_cache(model.model, create=False) is None  # a model without the node is untouched
    (cached_model,) = node().execute(model, True).result
    assert cached_model is not model and cached_model.model is model.model
    assert not model.wrappers.get(patcher_extension.WrappersMP.APPLY_MODEL)  # the input MODEL is not changed
    assert torch.equal(plain, sample(cached_model, tiny))
    cache = rope.model_cache(model.model)
    assert counters(cache) == {"misses": 1, "hits": 2}  # cond+uncond batched: one PE per step
    assert torch.equal(plain, sample(cached_model, tiny))  # the next run hits from its first step
    assert counters(cache) == {"misses": 1, "hits": 5}
    before = counters(cache)
    assert torch.equal(plain, sample(model, tiny))  # the original still runs without the cache
    assert counters(cache) == before
    sample(cached_model, tiny, shape=(1, 16, 12, 8), steps=2)  # a new size replaces the entry
    assert counters(cache) == {"misses": 2, "hits": 6, "replacements": 1}
    last = cache.stats.snapshot()["info"]["last_run"]
    assert (last["hits"], last["misses"], last["replacements"], last["shared"]) == (1, 1, 1, 0)


def test_a_model_whose_family_builds_no_table_the_cache_covers_is_said_on_its_card(tiny):
    """The node takes any MODEL: on SD1.5's UNet (no rotary tables) a run had 0 hits, 0 misses and no reason,
    so the card looked like a cache at work. The run is as without the node, and the card says why nothing was
    cached, once per run; a covered family's run says nothing of the kind."""
    model = tiny.tiny_sd15(0)
    plain = sample(model, tiny, shape=(1, 4, 8, 8))
    (cached_model,) = node().execute(model, True).result
    for _ in range(2):
        assert torch.equal(plain, sample(cached_model, tiny, shape=(1, 4, 8, 8)))
    cache = rope.model_cache(model.model)
    assert counters(cache) == {}
    (row,) = [r for r in cache.stats.reasons() if r["event"] == "bypass"]
    assert row["count"] == 2 and row["reason"].startswith("this run's UNetModel asked for no position table")
    import comfy.sample
    import comfy.samplers

    flux = tiny.tiny_flux(0)
    (cached_flux,) = node().execute(flux, True).result
    sample(cached_flux, tiny)
    latent = torch.zeros(1, 16, 8, 8)  # a run of one sigma (SplitSigmas' last part) calls no model: nothing said
    conds = [[torch.zeros(1, 4, 32), {"pooled_output": torch.zeros(1, 32)}]]
    comfy.sample.sample_custom(cached_flux, latent, 1.0, comfy.samplers.sampler_object("euler"), torch.zeros(1),
                               conds, conds, latent, seed=0)
    assert not rope.model_cache(flux.model).stats.reasons()


def test_wan_sampling_with_the_node_is_bit_exact(tiny):
    model = tiny.tiny_wan(0)
    plain = sample(model, tiny, shape=(1, 16, 3, 8, 8), steps=2)
    (cached_model,) = node().execute(model, True).result
    assert torch.equal(plain, sample(cached_model, tiny, shape=(1, 16, 3, 8, 8), steps=2))
    assert counters(rope.model_cache(model.model))["hits"] == 1


def test_server_wide_default_enables_models_without_the_node_and_the_node_can_opt_out(tiny, default_on):
    model = tiny.tiny_flux(0)
    plain_run = sample(model, tiny, steps=2)
    cache = rope.model_cache(model.model, create=False)
    assert cache is not None and counters(cache) == {"misses": 1, "hits": 1}
    (opted_out,) = node().execute(model, False).result
    assert torch.equal(plain_run, sample(opted_out, tiny, steps=2))
    assert counters(cache) == {"misses": 1, "hits": 1}


def test_uninstall_restores_the_host_functions_and_install_is_idempotent(tiny):
    import importlib

    def current(patch):
        owner, leaf = patch._target()
        return owner.__dict__[leaf] if isinstance(owner, type) else getattr(owner, leaf)

    patches = [p for p in (*rope.PATCHES, *rope.GLOBAL_PATCHES) if p.available()]  # what this host has
    assert rope.SCOPE_PATCH in patches and rope.PATCHES[0] in patches
    replacements = [current(p) for p in patches]
    originals = [p.original() for p in patches]
    assert all(getattr(r, host.MARK, False) for r in replacements)
    try:
        rope.uninstall()
        rope.uninstall()
        assert [current(p) for p in patches] == originals
        assert not any(getattr(current(p), host.MARK, False) for p in patches)
        assert importlib.import_module("comfy.ldm.flux.layers").EmbedND.forward is originals[0]
        model = tiny.tiny_flux(0)
        (cached_model,) = node().execute(model, True).result  # the node reinstalls what it needs
        assert rope.installed()
    finally:
        rope.install()
    rope.install()
    assert all(getattr(current(p), host.MARK, False) for p in patches)
    assert [p.original() for p in patches] == originals  # a second install wraps nothing twice


def test_a_builder_a_newer_comfyui_reshaped_stays_uncached_with_one_warning(monkeypatch, caplog):
    """A host whose calc_rope renamed a parameter (as a newer ComfyUI might): that builder runs
    unchanged, one warning names it and the host version, the start-up line lists it as off."""
    import importlib
    import logging

    hydit = importlib.import_module("comfy.ldm.hydit.models")
    patch = next(p for p in rope.PATCHES if p.module == "comfy.ldm.hydit.models")
    feature = f"PE cache for {patch.family}"
    rope.uninstall()
    host_calc_rope = hydit.calc_rope

    def calc_rope(x, patch_size, head_dim):  # reshaped: the head size has another name
        return host_calc_rope(x, patch_size, head_dim)

    monkeypatch.setattr(hydit, "calc_rope", calc_rope)
    try:
        with caplog.at_level(logging.WARNING, logger="reusekit"):
            rope.install()
            rope.install()
        assert hydit.calc_rope is calc_rope and not patch.installed
        warnings = [r.getMessage() for r in caplog.records if feature in r.getMessage()]
        assert len(warnings) == 1 and host.comfyui_version() in warnings[0] and "head_size" in warnings[0]
        assert feature in host.off_features()
        state, detail = host.layers()["PE cache"]
        covered = sum(p.installed for p in rope.PATCHES)
        assert state == "on" and detail.startswith(f"{covered} builders") and "hunyuan dit off" in detail
        cache = pc.PECache()
        x = torch.zeros((1, 4, 16, 24))
        with rope.scope(cache):
            assert torch.equal(hydit.calc_rope(x, 2, 88)[0], host_calc_rope(x, 2, 88)[0])
        assert cache.names() == []  # ran unchanged, outside the cache
    finally:
        rope.uninstall()
        monkeypatch.undo()
        host._off.pop(feature, None)
        host._said.discard(f"shape:{feature}")
        rope.install()
    assert patch.installed and patch.off is None
    assert "off" not in host.layers()["PE cache"][1]


def another_packs(fn, host_fn, how: str, module: str):
    """``fn`` as another pack sets it over ComfyUI's ``host_fn``: under its own module's name (``named``), or made
    with ``functools.wraps`` (``wrapped``), which gives it ComfyUI's."""
    import functools

    if how == "named":
        fn.__module__ = module
        return fn
    return functools.wraps(host_fn)(fn)


@pytest.mark.parametrize("how", ["named", "wrapped"])
def test_a_builder_left_unpatched_is_counted_on_the_nodes_model(tiny, how):
    """Another pack's code on Flux's EmbedND.forward when ReuseKit installs: that builder is left unpatched, and
    a model with the node sampled wholly uncached while its card showed nothing at all. Now the node counts it
    on the model's card, naming the builder and why; the picture is the host's. A wrapper made with
    ``functools.wraps`` carries ComfyUI's module name: until 2026-12-06 it was taken for ComfyUI's builder, and a
    setting of the other pack's that changed its tables (ids scaled by a factor) got the first table back."""
    import importlib

    layers = importlib.import_module("comfy.ldm.flux.layers")
    patch = next(p for p in rope.PATCHES if p.module == "comfy.ldm.flux.layers" and p.attr == "EmbedND.forward")
    model = tiny.tiny_flux(0)
    plain = sample(model, tiny)
    rope.uninstall()
    host_forward = layers.EmbedND.forward

    scale = [1.0]

    def forward(self, ids):  # another pack's wrapper (position interpolation by its node's factor, say)
        return host_forward(self, ids * scale[0])

    layers.EmbedND.forward = forward = another_packs(forward, host_forward, how, "some_other_pack.rope")
    try:
        rope.install()
        assert not patch.installed and patch.off
        (cached_model,) = node().execute(model, True).result
        assert torch.equal(sample(cached_model, tiny), plain)
        scale[0] = 0.5
        assert torch.equal(sample(cached_model, tiny), sample(model, tiny))
        cache = rope.model_cache(model.model)
        assert not any(counters(cache).values())  # nothing cached
        (row,) = cache.stats.reasons()
        assert row["event"] == "bypass" and "comfy.ldm.flux.layers.EmbedND.forward" in row["reason"]
        named = "some_other_pack.rope" if how == "named" else "test_pe_cache_node.py"
        assert named in row["reason"] and "not cached" in row["reason"], row
    finally:
        rope.uninstall()
        layers.EmbedND.forward = host_forward
        host._off.pop(f"PE cache for {patch.family}", None)
        rope.install()
    assert patch.installed
    (again,) = node().execute(tiny.tiny_flux(0), True).result
    assert rope.model_cache(again.model).stats.reasons() == []  # all patched: nothing to say


@pytest.mark.parametrize("how", ["named", "wrapped"])
def test_a_forward_helper_another_pack_wraps_turns_the_geometry_key_off(tiny, how):
    """Packs wrap Flux's ``forward_orig`` (step caches, position tricks), some with ``functools.wraps``, which gives
    the wrapper ComfyUI's module name. Such a wrapper may change the ids after the forward made them from the
    geometry (here: scaled by its node's factor), so the tables are keyed by the ids' values instead: the picture is
    the host's at each factor, and the start-up line says why, naming the helper and whose it is (on a GPU, where
ids are not read, each table computed is counted on the model's card)."""
    import importlib

    flux = importlib.import_module("comfy.ldm.flux.model")
    seam = next(s for s in rkharness.pack("patches.rope_seams").SEAMS if s.family == "flux")
    model = tiny.tiny_flux(0)
    rope.uninstall()
    host_forward_orig = flux.Flux.forward_orig
    scale = [1.0]

    def forward_orig(self, img, img_ids, *args, **kwargs):
        return host_forward_orig(self, img, img_ids * scale[0], *args, **kwargs)

    flux.Flux.forward_orig = another_packs(forward_orig, host_forward_orig, how, "some_other_pack.flux")
    try:
        rope.install()
        named = "some_other_pack.flux" if how == "named" else "test_pe_cache_node.py"
        assert seam.off is not None and "forward_orig" in seam.off and named in seam.off
        (cached_model,) = node().execute(model, True).result
        for factor in (1.0, 0.5):
            scale[0] = factor
            assert torch.equal(sample(cached_model, tiny), sample(model, tiny))
        assert counters(rope.model_cache(model.model))["hits"] > 0  # on the CPU the ids' values are read
        state, detail = host.layers()["PE cache"]
        assert state == "on" and "flux geometry off" in detail and named in detail, detail
    finally:
        rope.uninstall()
        flux.Flux.forward_orig = host_forward_orig
        rope.install()
    assert seam.off is None


def test_bad_inputs_name_the_node_and_the_input():
    with pytest.raises(ValueError, match="ReuseKit PE Cache.*'model'"):
        node().execute("not a model", True)
    with pytest.raises(ValueError, match="ReuseKit PE Cache.*'enabled'"):
        node().execute(rkharness.TINY.tiny_flux(0), "yes")


def test_applying_the_node_twice_keeps_one_wrapper(tiny):
    import comfy.patcher_extension as patcher_extension

    (once,) = node().execute(tiny.tiny_flux(0), True).result
    (twice,) = node().execute(once, False).result
    (wrapper,) = twice.wrappers[patcher_extension.WrappersMP.APPLY_MODEL]["reusekit_pe_cache"]
    assert wrapper.enabled is False and "reusekit_pe_cache" not in twice.wrappers.get(patcher_extension.WrappersMP.OUTER_SAMPLE, {})
    assert once.wrappers[patcher_extension.WrappersMP.APPLY_MODEL]["reusekit_pe_cache"][0].enabled is True


@pytest.mark.parametrize("with_node", [True, False])
def test_unloading_the_model_from_its_device_drops_device_tables_only(tiny, with_node):
    model = tiny.tiny_flux(0)
    if with_node:
        (model,) = node().execute(model, True).result
    cache = rope.model_cache(model.model)  # (without the node: as the server-wide default makes it)
    cache.get_or_create(pc.PECacheKey("cpu table").add(1), lambda: torch.zeros(8))
    model.detach(unpatch_all=True)
    assert cache.names() == ["cpu table"]  # CPU tables cost no VRAM: kept
    cache.get_or_create(pc.PECacheKey("device table").add(1), lambda: torch.zeros(8, device="meta"))
    model.detach(unpatch_all=False)  # another clone of the model took its place: nothing unloaded
    assert cache.nbytes()["device"] > 0
    model.detach(unpatch_all=True)
    assert cache.names() == [] and cache.nbytes() == {}
    assert rkharness.pack("patches.lifecycle").listening("detach", rope.release_device_tables)


def test_freeing_part_of_a_models_vram_drops_its_device_tables(tiny):
    """Dynamic VRAM (ComfyUI 0.16+) and any host under pressure free a loaded model's VRAM by
    ``partially_unload``, never ``detach``: the PE cache's device tables go with it."""
    model = tiny.tiny_flux(0)
    cache = rope.model_cache(model.model)
    cache.get_or_create(pc.PECacheKey("device table").add(1), lambda: torch.zeros(8, device="meta"))
    model.partially_unload(model.offload_device, 0)  # nothing asked for: kept
    assert cache.names() == ["device table"]
    model.partially_unload(model.offload_device, 1 << 20)
    assert cache.names() == [] and cache.nbytes() == {}
    assert rkharness.pack("patches.lifecycle").listening("partially_unload", rope.release_for_memory)


@pytest.mark.hardening
def test_grad_requiring_inputs_bypass_the_cache():
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi

    cache = pc.PECache()
    with torch.inference_mode(False), torch.enable_grad():
        freqs = torch.randn(3, 2, 4, requires_grad=True)
        with rope.scope(cache):
            cos, _ = mochi.compute_mixed_rotation(freqs=freqs, pos=torch.rand(5, 3))
    assert cos.grad_fn is not None and cache.names() == []
    assert cache.name_stats()["mochi.rotation[0]"]["bypasses"] == 1


@pytest.mark.hardening
def test_threads_sharing_one_model_cache_get_their_own_correct_tables():
    import comfy.ldm.flux.layers as layers

    emb = layers.EmbedND(dim=32, theta=10000, axes_dim=[8, 12, 12])
    cache = pc.PECache()
    sizes = [4, 9, 16]
    expected = {n: emb(torch.arange(n * 3.0).reshape(1, n, 3)) for n in sizes}
    errors = []

    def worker(n):
        with torch.inference_mode():
            for _ in range(20):
                with rope.scope(cache):
                    got = emb(torch.arange(n * 3.0).reshape(1, n, 3))
                if not torch.equal(got, expected[n]):
                    errors.append(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.workflows
def test_example_workflow_runs_on_tiny_flux_and_reports_pe_hits():
    workflow = rkharness.load_workflow("pe_cache_flux.json")
    types = {n["type"] for n in workflow["nodes"]}
    assert {"ReuseKitPECache", "UNETLoader", "DualCLIPLoader", "VAELoader", "Note"} <= types
    prompt = rkharness.workflow_to_prompt(workflow, overrides={"8": {"width": 64, "height": 64},
                                                               "9": {"steps": 3}})
    assert prompt["2"] == {"class_type": "ReuseKitPECache", "inputs": {"model": ["1", 0], "enabled": True}}
    registry = rkharness.pack("caching.stats").REGISTRY
    before = set(registry.names())
    result = rkharness.Executor().run(prompt)
    (name,) = [n for n in registry.names() if n not in before and n.startswith("pe:Flux#")]
    text = result["outputs"]["12"]["text"][0]
    (line,) = [line for line in text.splitlines() if f"[pe] {name}:" in line]
    assert "hits=2" in line and "misses=1" in line, text
    prompt["2"]["inputs"]["enabled"] = False  # the same picture, every table built anew
    plain = rkharness.Executor().run(prompt)
    assert np.array_equal(rkharness.output_pixels(result["outputs"]["11"]), rkharness.output_pixels(plain["outputs"]["11"]))


@pytest.mark.gpu
def test_on_cuda_tables_stay_on_the_device_and_sampling_is_bit_exact(tiny):
    model = tiny.tiny_flux(0)
    plain = sample(model, tiny)
    (cached_model,) = node().execute(model, True).result
    assert torch.equal(plain, sample(cached_model, tiny))
    cache = rope.model_cache(model.model)
    (name,) = cache.names()
    key, table = cache.entry(name)
    assert table.device.type == "cuda"
    snap = cache.stats.snapshot()
    # the table on the device; on the CPU only its key (what a hit compares)
    assert snap["bytes"]["device"] >= table.numel() * table.element_size() and snap["bytes"]["cpu"] == key.nbytes()
    assert snap["counters"]["hits"] == 2


@pytest.mark.gpu
def test_during_cuda_graph_capture_the_builder_runs_inside_the_graph():
    """A builder keyed by its ids' shape (as the geometry seams key a model's; ids on the device are
    never read for a key) stores its table outside a capture and runs unchanged inside one."""
    import comfy.ldm.flux.layers as layers

    emb = layers.EmbedND(dim=32, theta=10000, axes_dim=[8, 12, 12])
    ids = torch.arange(30.0, device="cuda").reshape(1, 10, 3)
    cache = pc.PECache()

    def build():
        return rope.cached("probe", lambda k: k.add(tuple(ids.shape)), lambda: emb(ids))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), rope.scope(cache):
        warm = build()  # a miss, stored outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), rope.scope(cache):
        captured = build()
    graph.replay()
    torch.cuda.synchronize()
    assert captured is not warm and torch.equal(captured, warm)
    assert cache.entry("probe[0]")[1] is warm  # the capture stored nothing
    stats = cache.name_stats()["probe[0]"]
    assert stats["misses"] == 1 and stats["bypasses"] == 1


def test_a_builder_input_the_key_rules_cannot_describe_runs_uncached():
    """A value the shared key encoder refuses (here an object) makes the builder run unchanged and
    counts a bypass; it never raises into the forward or stores a table."""
    cache = pc.PECache()
    with rope.scope(cache):
        out = rope.cached("probe", lambda k: k.add(object()), lambda: torch.ones(3))
        again = rope.cached("probe", lambda k: k.add(object()), lambda: torch.ones(3))
    assert torch.equal(out, torch.ones(3)) and again is not out
    assert cache.names() == [] and cache.name_stats()["probe[0]"]["bypasses"] == 1
