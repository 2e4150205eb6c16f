"""Every host family that builds RoPE per call: tiny real models give bit-identical outputs with and
without the PE cache, hit after the first step, replace on a size change, recompute when sizes
alternate; each patched builder misses when any single input changes."""

import importlib
import inspect

import pytest
import rkharness
import torch

pytestmark = pytest.mark.pe_cache


@pytest.fixture(scope="module")
def rope():
    return rkharness.pack("patches.rope")


@pytest.fixture(scope="module")
def families():
    return importlib.import_module(rkharness.TINY.__name__ + ".families")


def cached_options(rope, **extra):
    """transformer_options that carry the node's APPLY_MODEL wrapper, as sampling does."""
    import comfy.patcher_extension as patcher_extension

    return {"wrappers": {patcher_extension.WrappersMP.APPLY_MODEL: {"test": [rope.ApplyModelWrapper()]}}, **extra}


def run(model, call, options):
    x, sigma, kwargs = call
    return model.model.apply_model(x, sigma, transformer_options=dict(options), **kwargs)


def compare(model, calls, options, rope):
    """Each call without and with the cache: outputs torch.equal; returns the model's cache."""
    for call in calls:
        plain = run(model, call, {k: v for k, v in options.items() if k != "wrappers"})
        assert torch.equal(plain, run(model, call, options))
    return rope.model_cache(model.model)


FAMILIES = ["flux", "wan", "chroma", "chroma_radiance", "hunyuan_video", "qwen_image", "lumina2", "z_image", "z_image_pixel",
            "hidream", "hunyuan_dit", "ltxv", "cosmos", "anima", "mochi", "omnigen2",
            "flux2", "flux2_klein", "qwen_image_edit", "hunyuan_video15", "ltx2", "wan22", "wan22_14b"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_bit_exact_hits_after_first_step_and_replaces_on_size_change(family, families, rope):
    spec = families.family_spec(family)
    model = spec.build(0)
    a, b = spec.inputs(spec.sizes[0], 1), spec.inputs(spec.sizes[1], 2)
    cache = compare(model, [a, a, a], cached_options(rope), rope)
    names = cache.names()
    assert names, f"{family}: no PE input went through the cache"
    held = {n: cache.entry(n)[1] for n in names}
    for n, stats in cache.name_stats().items():
        assert (stats.get("misses"), stats.get("hits")) == (1, 2), (n, stats)
    compare(model, [a], cached_options(rope), rope)
    assert all(cache.entry(n)[1] is held[n] for n in names)  # stable objects across steps
    compare(model, [b, b, a, b], cached_options(rope), rope)  # a new size replaces; alternating recomputes
    sized = {n for n in names if cache.entry(n)[1] is not held[n]}
    assert sized, f"{family}: no table followed the latent size"
    for n, stats in cache.name_stats().items():
        if n in sized:  # built from the latent's geometry
            assert stats.get("misses") == 4 and stats.get("replacements") == 3 and stats.get("hits") == 4, (n, stats)
        else:  # a table of the text alone (e.g. Lumina2's captions on ComfyUI >= 0.4): the size keeps it
            assert stats.get("misses") == 1 and stats.get("hits") == 7 and "replacements" not in stats, (n, stats)


NEWER_FAMILIES = {"z-image pixel space (geometry)": "NextDiTPixelSpace"}  # family: the class older hosts lack


def test_every_family_with_a_per_call_rope_builder_is_patched(rope):
    """Each family is covered on this host (a builder that moved between versions: in one of its places),
    and every builder the host has is patched."""
    by_family = {}
    for patch in rope.PATCHES:
        by_family.setdefault(patch.family, []).append(patch)
        if patch.available():
            assert patch.installed, f"{patch.family}: {patch.module}.{patch.attr} is not patched"
    for family, patches in by_family.items():
        if family in NEWER_FAMILIES and not hasattr(importlib.import_module(patches[0].module), NEWER_FAMILIES[family]):
            continue  # a family this older host does not have
        assert any(p.installed for p in patches), \
            f"{family}: none of {[f'{p.module}.{p.attr}' for p in patches]} is patched on this host"


@pytest.mark.parametrize("family", ["flux", "wan", "flux2", "wan22"])
def test_rope_options_are_part_of_the_key(family, families, rope):
    spec = families.family_spec(family)
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 3)
    shifted = {"scale_x": 1.5, "scale_y": 0.5, "shift_t": 1.0, "shift_y": 2.0, "shift_x": 0.0}
    compare(model, [call], cached_options(rope), rope)
    compare(model, [call], cached_options(rope, rope_options=shifted), rope)
    compare(model, [call], cached_options(rope, rope_options=dict(shifted, shift_x=0.5)), rope)
    stats = next(iter(rope.model_cache(model.model).name_stats().values()))
    assert stats["misses"] == 3 and stats.get("hits", 0) == 0


@pytest.mark.parametrize("family", ["flux", "qwen_image", "flux2", "qwen_image_edit"])
def test_reference_latents_their_sizes_and_order_are_part_of_the_key(family, families, rope):
    spec = families.family_spec(family)
    model = spec.build(0)
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 4)
    ref_a, ref_b = torch.randn(x.shape), torch.randn((*x.shape[:-2], 4, 6))
    with_refs = lambda *refs, **kw: (x, sigma, dict(kwargs, ref_latents=list(refs), **kw))  # noqa: E731
    calls = [with_refs(ref_a), with_refs(ref_a), with_refs(ref_a, ref_b), with_refs(ref_b, ref_a)]
    if family.startswith("flux"):
        calls.append(with_refs(ref_a, ref_b, ref_latents_method="offset" if family == "flux2" else "index"))
    cache = compare(model, calls, cached_options(rope), rope)
    (stats,) = cache.name_stats().values()
    assert stats["hits"] == 1 and stats["misses"] == len(calls) - 1


OBJECT_PATCHES = [("flux2", "diffusion_model.params.ref_index_scale", 1.0),
                  ("flux2", "diffusion_model.params.txt_ids_dims", []),
                  ("qwen_image", "diffusion_model.default_ref_method", "negative_index"),
                  ("qwen_image_edit", "diffusion_model.default_ref_method", "negative_index"),
                  ("chroma_radiance", "diffusion_model.params.use_sequential_txt_ids", "flip")]


@pytest.mark.parametrize("family, attr, value", OBJECT_PATCHES)
def test_an_object_patch_on_a_setting_the_ids_read_never_gets_the_bases_table(family, attr, value, families, rope):
    """ComfyUI's object patch sets a model's setting on the shared model (FluxKVCache patches
    ``default_ref_method``; a custom node may patch any): keyed by the model's serial alone, the patched clone
    hit the table its base built (0.115 from the uncached output on Flux.2 with ``ref_index_scale``, 0.047 on
    Qwen-Image with ``default_ref_method``, 0.16 on Chroma Radiance). The settings are in the key: each model
    gives the uncached output, the base too once the patch is undone."""
    import comfy.model_management
    import comfy.utils

    spec = families.family_spec(family)
    base = spec.build(0)
    try:
        before = comfy.utils.get_attr(base.model, attr)
    except AttributeError:
        pytest.skip(f"{family}: this ComfyUI's model has no {attr}")
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 4)
    call = (x, sigma, dict(kwargs, ref_latents=[torch.randn((*x.shape[:-2], 4, 6),
                                                            generator=torch.Generator().manual_seed(11))]))
    patched = base.clone()
    patched.add_object_patch(attr, (not before) if value == "flip" else value)
    comfy.model_management.load_models_gpu([base])
    compare(base, [call, call], cached_options(rope), rope)
    base_out = run(base, call, cached_options(rope))
    comfy.model_management.load_models_gpu([patched])
    compare(patched, [call, call], cached_options(rope), rope)
    assert not torch.equal(run(patched, call, {}), base_out)  # the setting matters here
    comfy.model_management.load_models_gpu([base])
    compare(base, [call, call], cached_options(rope), rope)


def test_flux2_reference_at_timestep_zero_is_bit_exact_and_keyed_by_its_method(families, rope):
    """``index_timestep_zero`` (ComfyUI >= 0.17) changes the modulation, not the positions: its
    output differs from ``index`` while the PE table of the same references has the same values.
    The hit is decided from the forward's arguments, the method among them, so the other method
    builds its (equal) table once instead of reading the ids to find it equal."""
    import comfy.ldm.flux.model as flux

    if not hasattr(flux, "invert_slices"):
        pytest.skip("this ComfyUI has no index_timestep_zero (comfy.ldm.flux.model.invert_slices)")
    spec = families.family_spec("flux2")
    model = spec.build(0)
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 9)
    ref = torch.randn((*x.shape[:-2], 4, 6), generator=torch.Generator().manual_seed(10))
    zero, index = ((x, sigma, dict(kwargs, ref_latents=[ref], ref_latents_method=m))
                   for m in ("index_timestep_zero", "index"))
    cache = compare(model, [zero, zero], cached_options(rope), rope)
    (name,) = cache.names()
    zero_table = cache.entry(name)[1]
    compare(model, [index, index], cached_options(rope), rope)
    assert torch.equal(cache.entry(name)[1], zero_table)
    stats = cache.name_stats()[name]
    assert stats["misses"] == 2 and stats["hits"] == 2
    assert not torch.equal(run(model, zero, cached_options(rope)), run(model, index, cached_options(rope)))


def test_cond_and_uncond_run_separately_keep_separate_entries(families, rope):
    spec = families.FAMILY_SPECS["flux"]
    model = spec.build(0)
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 5)
    short = (x, sigma, dict(kwargs, c_crossattn=kwargs["c_crossattn"][:, :3]))
    for _ in range(3):  # different text lengths: two apply_model calls per step
        compare(model, [(x, sigma, kwargs)], cached_options(rope, cond_or_uncond=[0]), rope)
        compare(model, [short], cached_options(rope, cond_or_uncond=[1]), rope)
    stats = rope.model_cache(model.model).name_stats()
    assert set(stats) == {"EmbedND[0]|0", "EmbedND[0]|1"}
    assert all(s["misses"] == 1 and s["hits"] == 2 for s in stats.values())


# ---- each patched builder, called directly: one changed input -> a miss, values equal ---------

def _embednd_case(module):
    mod = importlib.import_module(module)
    kw = {"dim": 32} if module.endswith("flux.layers") else {}
    ids = torch.arange(30.0).reshape(1, 10, 3)

    def call(theta=10000, axes=(8, 12, 12), ids=ids):
        return mod.EmbedND(theta=theta, axes_dim=list(axes), **kw)(ids)
    return call, [dict(theta=256), dict(axes=(12, 8, 12)), dict(ids=ids + 0.5), dict(ids=ids[:, :9]),
                  dict(ids=ids.double())]


def _wan_case():
    import comfy.ldm.wan.model as wan

    model = rkharness.TINY.tiny_wan(0).model.diffusion_model

    def call(t=3, h=8, w=8, t_start=0, steps_t=None, steps_h=None, steps_w=None, dtype=torch.float32, opts=None,
             **extra):
        to = {"rope_options": opts} if opts is not None else {}
        return wan.WanModel.rope_encode(model, t, h, w, t_start=t_start, steps_t=steps_t, steps_h=steps_h,
                                        steps_w=steps_w, device=torch.device("cpu"), dtype=dtype,
                                        transformer_options=to, **extra)
    changes = [dict(t=2), dict(h=6), dict(w=10), dict(t_start=-3), dict(steps_t=2), dict(steps_h=3),
               dict(steps_w=5), dict(dtype=torch.float64), dict(opts={"scale_t": 2.0}), dict(opts={"shift_y": 1.0})]
    if "source_id" in inspect.signature(wan.WanModel.rope_encode).parameters:  # in-context references (0.33)
        changes.append(dict(source_id=1))
    return call, changes


def _ltxv_case():
    import comfy.ldm.lightricks.model as ltxv

    if not hasattr(ltxv, "precompute_freqs_cis"):
        pytest.skip("ComfyUI >= 0.8 has no comfy.ldm.lightricks.model.precompute_freqs_cis (it is a method now)")
    grid = torch.rand(1, 3, 12, generator=torch.Generator().manual_seed(0))

    def call(grid=grid, dim=96, out_dtype=torch.float32, theta=10000.0, max_pos=(20, 2048, 2048)):
        return ltxv.precompute_freqs_cis(grid, dim=dim, out_dtype=out_dtype, theta=theta, max_pos=list(max_pos))
    return call, [dict(grid=grid * 2), dict(dim=102), dict(out_dtype=torch.float16), dict(theta=500.0),
                  dict(max_pos=(24, 2048, 2048))]


def _ltx_method_case():
    """LTXBaseModel._precompute_freqs_cis (ComfyUI >= 0.8): arguments, rope type and frequency grid."""
    import copy

    import comfy.ldm.lightricks.model as ltxv

    if not hasattr(ltxv, "LTXBaseModel"):
        pytest.skip("this ComfyUI has no comfy.ldm.lightricks.model.LTXBaseModel")
    families = importlib.import_module(rkharness.TINY.__name__ + ".families")
    model = families.tiny_ltxv(0).model.diffusion_model
    split, float64 = copy.copy(model), copy.copy(model)
    split.split_positional_embedding = ltxv.LTXRopeType.SPLIT
    float64.freq_grid_generator = ltxv.generate_freq_grid_np
    grid = torch.rand(1, 3, 12, generator=torch.Generator().manual_seed(0))

    def call(module=model, grid=grid, dim=96, out_dtype=torch.float32, theta=10000.0, max_pos=(20, 2048, 2048),
             middle=False, heads=2):
        return module._precompute_freqs_cis(grid, dim=dim, out_dtype=out_dtype, theta=theta, max_pos=list(max_pos),
                                            use_middle_indices_grid=middle, num_attention_heads=heads)
    return call, [dict(grid=grid * 2), dict(grid=grid[:, :, :10]), dict(dim=108), dict(out_dtype=torch.float16),
                  dict(theta=500.0), dict(max_pos=(24, 2048, 2048)),
                  dict(grid=torch.stack((grid, grid + 1), dim=-1), middle=True), dict(heads=3),
                  dict(module=split), dict(module=float64)]


def _cosmos_case():
    import comfy.ldm.cosmos.position_embedding as pos

    emb = pos.VideoRopePosition3DEmb(head_dim=48, len_h=16, len_w=16, len_t=8, h_extrapolation_ratio=2.0)
    emb2 = pos.VideoRopePosition3DEmb(head_dim=48, len_h=16, len_w=16, len_t=8, base_fps=30)

    def call(shape=(1, 2, 4, 6, 16), fps=None, h_ntk=None, module=emb):
        return module.generate_embeddings(torch.Size(shape), fps=fps, h_ntk_factor=h_ntk)
    return call, [dict(shape=(1, 3, 4, 6, 16)), dict(shape=(1, 2, 5, 6, 16)), dict(shape=(2, 2, 4, 6, 16)),
                  dict(fps=torch.tensor([24.0])), dict(h_ntk=3.0), dict(module=emb2, fps=torch.tensor([24.0]))]


def _mochi_case():
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi

    freqs = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(1))
    pos = torch.rand(24, 3, generator=torch.Generator().manual_seed(2))

    def call(freqs=freqs, pos=pos):
        return mochi.compute_mixed_rotation(freqs=freqs, pos=pos)
    return call, [dict(freqs=freqs * 1.01), dict(pos=pos[:20]), dict(pos=pos.flip(0))]


def _mochi_positions_case():
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi

    def call(T=2, pH=4, pW=6, dtype=torch.float32, target_area=36864):
        return mochi.create_position_matrix(T, pH=pH, pW=pW, device=torch.device("cpu"), dtype=dtype,
                                            target_area=target_area)
    return call, [dict(T=3), dict(pH=5), dict(pW=4), dict(target_area=1024)]  # (the host needs float32)


def _hydit_case(module):
    mod = importlib.import_module(module)

    def call(shape=(1, 4, 16, 24), dtype=torch.float32, patch=2, head=88):
        return mod.calc_rope(torch.zeros(shape, dtype=dtype), patch, head)
    return call, [dict(shape=(1, 4, 24, 16)), dict(shape=(1, 4, 16, 28)), dict(dtype=torch.float64),
                  dict(patch=4), dict(head=64)]


BUILDER_CASES = {
    "flux.EmbedND": lambda: _embednd_case("comfy.ldm.flux.layers"),
    "hidream.EmbedND": lambda: _embednd_case("comfy.ldm.hidream.model"),
    "wan.rope_encode": _wan_case,
    "ltxv.precompute_freqs_cis": _ltxv_case,
    "ltxv.LTXBaseModel._precompute_freqs_cis": _ltx_method_case,
    "cosmos.generate_embeddings": _cosmos_case,
    "mochi.compute_mixed_rotation": _mochi_case,
    "mochi.create_position_matrix": _mochi_positions_case,
    "hydit.calc_rope": lambda: _hydit_case("comfy.ldm.hydit.models"),
    "hydit.controlnet.calc_rope": lambda: _hydit_case("comfy.ldm.hydit.controlnet"),
}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if not isinstance(a, (tuple, list)):
        return a == b  # e.g. LTX's split_mode
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", list(BUILDER_CASES))
def test_each_builder_misses_when_any_single_input_changes(case, rope):
    pc = rkharness.pack("caching.pe_cache")
    call, changes = BUILDER_CASES[case]()
    reference = [call(**c) for c in [{}, *changes]]  # no scope: the host's own builder
    cache = pc.PECache()
    order = [0, 0, *range(1, len(changes) + 1), 0]
    for i in order:
        with rope.scope(cache):
            got = call(**([{}, *changes][i]))
        assert _equal(got, reference[i]), (case, i)
    stats = cache.name_stats()
    assert sum(s.get("hits", 0) for s in stats.values()) == 1, stats
    assert sum(s.get("misses", 0) for s in stats.values()) == len(changes) + 2, stats


def test_cond_and_uncond_of_one_geometry_share_one_table(families, rope):
    spec = families.FAMILY_SPECS["wan"]
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 6)
    for _ in range(2):
        compare(model, [call], cached_options(rope, cond_or_uncond=[0]), rope)
        compare(model, [call], cached_options(rope, cond_or_uncond=[1]), rope)
    cache = rope.model_cache(model.model)
    stats = cache.name_stats()
    cond, uncond = "wan.rope_encode[0]|0", "wan.rope_encode[0]|1"
    assert stats[cond]["misses"] == 1 and stats[uncond]["shared"] == 1 and "misses" not in stats[uncond]
    assert cache.entry(cond)[1] is cache.entry(uncond)[1]


def test_wan_with_a_rope_embedder_the_key_cannot_describe_runs_it_every_call(families, rope):
    """Custom nodes swap Wan's rope_embedder for their own module (KJNodes' RIFLEx: an object patch
    of ``diffusion_model.rope_embedder`` whose ``k`` and ``num_frames`` change the table). The
    geometry key does not know such a module's settings: a new ``k`` must not get the old table."""
    from comfy.ldm.flux.math import rope as host_rope

    class RifleXEmbedND(torch.nn.Module):  # as KJNodes' EmbedND_RifleX: the temporal frequency k-1 moved
        def __init__(self, theta, axes_dim, num_frames, k):
            super().__init__()
            self.theta, self.axes_dim, self.num_frames, self.k = theta, axes_dim, num_frames, k

        def forward(self, ids):
            parts = [host_rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(ids.shape[-1])]
            d = self.axes_dim[0]
            omega = 1.0 / (self.theta ** torch.linspace(0, (d - 2) / d, steps=d // 2, dtype=torch.float64))
            omega[self.k - 1] = 0.9 * 2 * torch.pi / self.num_frames
            out = torch.einsum("...n,d->...nd", ids[..., 0].to(torch.float32), omega)
            out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
            parts[0] = out.reshape(*out.shape[:-1], 2, 2).to(torch.float32)
            return torch.cat(parts, dim=-3).unsqueeze(1)

    spec = families.FAMILY_SPECS["wan"]
    model = spec.build(0)
    dm = model.model.diffusion_model
    host = dm.rope_embedder
    call = spec.inputs(spec.sizes[0], 8)
    for k in (4, 2, 4):
        dm.rope_embedder = RifleXEmbedND(host.theta, host.axes_dim, num_frames=3, k=k)
        compare(model, [call, call], cached_options(rope), rope)


def test_an_embedder_subclass_that_moves_the_ids_never_gets_an_old_table(families, rope):
    """A node's EmbedND subclass put on the model (an object patch) that moves the ids by a setting of its
    own, then calls EmbedND.forward: the forward's geometry does not hold that setting, so the subclass's
    tables are keyed by the ids themselves (on the CPU): a new setting never gets the old table."""
    import comfy.ldm.flux.layers as layers

    class ShiftedEmbedND(layers.EmbedND):
        def __init__(self, base, shift):
            super().__init__(base.dim, base.theta, list(base.axes_dim))
            self.shift = shift

        def forward(self, ids):
            ids = ids.clone()
            ids[..., 1] += self.shift
            return super().forward(ids)

    spec = families.family_spec("flux")
    model = spec.build(0)
    dm = model.model.diffusion_model
    host = dm.pe_embedder
    call = spec.inputs(spec.sizes[0], 1)
    outputs = []
    try:
        for shift in (0.0, 5.0, 0.0):
            dm._modules["pe_embedder"] = ShiftedEmbedND(host, shift)
            cache = compare(model, [call, call], cached_options(rope), rope)
            outputs.append(run(model, call, {}))
    finally:
        dm._modules["pe_embedder"] = host
    assert not torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    assert sum(s["hits"] for s in cache.name_stats().values()) >= 3  # keyed by the ids: still reused


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_a_rope_function_another_node_rebinds_is_never_read_from_an_old_table(family, families, rope, monkeypatch):
    """EmbedND.forward calls ``rope`` by name from its module: a pack that rebinds it (an fp32 rope, a
    scaled one) after a table was stored must not get that table back; such calls run uncached, counted."""
    import comfy.ldm.flux.layers as layers

    host_rope = layers.rope
    spec = families.family_spec(family)
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 1)
    cache = compare(model, [call, call], cached_options(rope), rope)  # tables stored with the host's rope
    plain = run(model, call, {})
    monkeypatch.setattr(layers, "rope", lambda pos, dim, theta: host_rope(pos, dim, theta * 2))
    compare(model, [call, call], cached_options(rope), rope)
    assert not torch.equal(run(model, call, {}), plain)  # the rebound rope changes the picture
    assert any("comfy.ldm.flux.layers.rope was replaced" in reason for reason in cache.bypass_reasons())


@pytest.mark.parametrize("family", ["wan", "omnigen2"])
@pytest.mark.parametrize("change", ["forward hook", "forward pre-hook", "forward replaced", "class forward replaced",
                                    "global hook"])
def test_an_embedder_hooked_inside_a_cached_builder_is_never_read_from_an_old_table(family, change, families, rope):
    """Wan's rope_encode and OmniGen2's position embedder call their EmbedND inside the cached builder: a
    hook on it, a forward set on the instance (an object patch) or on the class (another pack) or a hook on
    every module, added after a table was stored, got that table back (0.19 and 0.40 off). Such calls run
    uncached, counted."""
    spec = families.family_spec(family)
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 1)
    cache = compare(model, [call, call], cached_options(rope), rope)  # the tables stored
    before = run(model, call, {})
    embedder = next(m for m in model.model.diffusion_model.modules() if type(m).__name__ == "EmbedND")
    if change == "forward hook":
        undo = embedder.register_forward_hook(lambda m, args, out: out * 0.5).remove
    elif change == "forward pre-hook":
        undo = embedder.register_forward_pre_hook(lambda m, args: (args[0] * 1.5,)).remove
    elif change == "forward replaced":
        host_forward = embedder.forward
        embedder.forward = lambda ids: host_forward(ids * 2.0)
        undo = lambda: vars(embedder).pop("forward")  # noqa: E731
    elif change == "class forward replaced":  # another pack, after ReuseKit installed
        cls, installed = type(embedder), type(embedder).forward
        cls.forward = lambda self, ids: installed(self, ids * 2.0)
        undo = lambda: setattr(cls, "forward", installed)  # noqa: E731
    else:
        undo = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out * 0.5 if m is embedder else None).remove
    try:
        compare(model, [call], cached_options(rope), rope)
        assert not torch.equal(run(model, call, {}), before)  # the change changes the picture
    finally:
        undo()
    assert any("rope_embedder: " in r for r in cache.bypass_reasons()), cache.bypass_reasons()


@pytest.mark.parametrize("family,module,name", [
    ("ltxv", "comfy.ldm.lightricks.model", "get_fractional_positions"),  # (a helper of the builder's helpers)
    ("mochi", "comfy.ldm.genmo.joint_model.rope_mixed", "centers"),
    (None, "comfy.ldm.hydit.models", "get_2d_rotary_pos_embed"),
])
def test_a_helper_another_node_rebinds_is_never_read_from_an_old_table(family, module, name, families, rope,
                                                                       monkeypatch):
    """LTX, Mochi and HunyuanDiT's builders call ComfyUI helpers by name (and those call others): one that a
    pack rebinds after a table was stored got that table back (0.22, 0.68, 0.5 off). Such calls run
    uncached, counted, naming it."""
    import importlib

    namespace = importlib.import_module(module)
    host_fn = getattr(namespace, name)

    def doubled(*args, **kwargs):
        out = host_fn(*args, **kwargs)
        return tuple(t * 2.0 for t in out) if isinstance(out, tuple) else out * 2.0

    if family is None:  # HunyuanDiT (no tiny model of it here): its builder, called as the model calls it
        x = torch.randn(1, 4, 16, 16)
        pe_cache = rkharness.pack("caching.pe_cache").PECache()
        hydit = importlib.import_module("comfy.ldm.hydit.models")
        with rope.scope(pe_cache):
            hydit.calc_rope(x, 2, 8)
        monkeypatch.setattr(namespace, name, doubled)
        with rope.scope(pe_cache):
            got = hydit.calc_rope(x, 2, 8)
        want = hydit.calc_rope(x, 2, 8)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        reasons = pe_cache.bypass_reasons()
    else:
        spec = families.family_spec(family)
        model = spec.build(0)
        call = spec.inputs(spec.sizes[0], 1)
        cache = compare(model, [call, call], cached_options(rope), rope)
        before = run(model, call, {})
        monkeypatch.setattr(namespace, name, doubled)
        compare(model, [call], cached_options(rope), rope)
        assert not torch.equal(run(model, call, {}), before)
        reasons = cache.bypass_reasons()
    assert any(f"{module}.{name} was replaced" in r for r in reasons), reasons


def test_a_helper_called_through_its_module_is_checked_too(rope, monkeypatch):
    """A builder may call a ComfyUI helper through its module (``comfy.ldm.flux.math.rope(...)``) rather than
    by a name imported into its own: a pack that rebinds the helper there must make the check fail, naming
    it, as it does for a name read from the builder's module."""
    import comfy.ldm.flux.math as flux_math

    namespace = {"__name__": "comfy.ldm.flux.layers", "comfy": importlib.import_module("comfy")}
    exec("def builder(pos, dim, theta):\n    return comfy.ldm.flux.math.rope(pos, dim, theta)", namespace)  # noqa: S102
    check = rope._called_by_name(calls=namespace["builder"])
    check()  # nothing rebound yet
    host_rope = flux_math.rope
    monkeypatch.setattr(flux_math, "rope", lambda pos, dim, theta: host_rope(pos, dim, theta * 2))
    with pytest.raises(rope.Uncached, match="comfy.ldm.flux.math.rope was replaced"):
        check()


def test_a_dropped_models_tables_are_freed_before_the_next_model_loads(families, rope):
    """A model ComfyUI drops while it is still loaded is detached only as a clone's swap, and its PE cache
    goes through its finalizer, which only records: the tables are freed at the next safe point, at the
    latest before ComfyUI loads the next model (which needs that memory)."""
    import gc
    import weakref

    import comfy.model_management

    spec = families.family_spec("wan")
    model = spec.build(0)
    compare(model, [spec.inputs(spec.sizes[0], 1)], cached_options(rope), rope)
    cache = rope.model_cache(model.model)
    table = weakref.ref(cache.entry(cache.names()[0])[1])
    del cache, model
    gc.collect()
    assert table() is not None  # the finalizer only recorded its cache
    comfy.model_management.load_models_gpu([families.family_spec("flux").build(0)])
    gc.collect()
    assert table() is None


def test_causal_wan_under_the_ar_video_sampler_keys_each_frame_blocks_rope_by_its_start(rope, conds):
    """Causal-WAN's ar_video sampler builds RoPE per frame block from its start frame: through the PE
    cache two whole runs are ComfyUI's latent bit for bit, each block's steps hit its own table and a new
    block's start replaces it (never the last block's table answered for the next)."""
    model, ar_video = importlib.import_module(rkharness.TINY.__name__ + ".step_families").causal_wan_case(conds)
    ref = ar_video(model)
    cached = rkharness.pack("nodes.pe_cache").PECacheNode.execute(model).args[0]
    assert torch.equal(ar_video(cached), ref)
    assert torch.equal(ar_video(cached), ref)
    run = rope.model_cache(model.model).stats.snapshot()["info"]["last_run"]
    # 3 frame blocks x (4 steps + the cache-filling call at sigma 0): a miss per block, the rest hits
    assert (run["misses"], run["hits"], run["bypasses"]) == (3, 12, 0)


def _variant_calls(family, spec):
    """Calls of one model whose positions differ only by a family's extra inputs: Wan's frames concatenated in
    time and its in-context latents (``source_id``), Z-Image Omni's reference latents and contexts, HunyuanVideo's
    reference latent and guiding frame. A host without an input ignores it (the call repeats another)."""
    g = torch.Generator().manual_seed(5)
    r = lambda *shape: torch.randn(shape, generator=g)  # noqa: E731
    x, sigma, kw = spec.inputs(spec.sizes[0], 1)
    x2, _, _ = spec.inputs(spec.sizes[1], 2)
    extras = {
        "wan": [{}, {"time_dim_concat": r(1, 16, 1, 8, 8)}, {"time_dim_concat": r(1, 16, 2, 8, 8)},
                {"context_latents": [r(1, 16, 1, 8, 8)]}, {"context_latents": [r(1, 16, 1, 6, 8), r(1, 16, 1, 8, 8)]},
                {"context_latents": [r(1, 16, 1, 8, 8), r(1, 16, 1, 6, 8)]}],
        "z_image": [{}, {"ref_latents": [r(1, 16, 8, 8)]}, {"ref_latents": [r(1, 16, 12, 8)]},
                    {"ref_latents": [r(1, 16, 8, 8), r(1, 16, 12, 8)]}, {"ref_latents": [r(1, 16, 12, 8), r(1, 16, 8, 8)]},
                    {"ref_latents": [r(1, 16, 8, 8)], "ref_contexts": [r(1, 5, kw["c_crossattn"].shape[-1])]}],
        "hunyuan_video": [{}, {"ref_latent": r(1, 16, 1, 8, 8)}, {"ref_latent": r(1, 16, 1, 6, 8)},
                          {"guiding_frame_index": torch.tensor([0.0])}, {"guiding_frame_index": torch.tensor([2.0])}],
    }[family]
    return [(x, sigma, dict(kw, **e)) for e in extras] + [(x2, sigma, dict(kw))]


@pytest.mark.parametrize("device", ["cpu", "as on a device"])
@pytest.mark.parametrize("family", ["wan", "z_image", "hunyuan_video"])
def test_a_familys_extra_position_inputs_interleaved_in_one_model_never_share_a_table(family, device, families, rope,
                                                                                      monkeypatch):
    """Each extra input that moves the positions makes its own table: every call, in a shuffled order with
    repeats, equals the uncached forward, and repeats hit (on a device too, where the ids are never read)."""
    import random

    if device != "cpu":
        monkeypatch.setattr(rope, "VALUE_KEYS_ON", frozenset())
    spec = families.family_spec(family)
    model = spec.build(0)
    calls = _variant_calls(family, spec)
    plain = [run(model, call, {}) for call in calls]
    order = [i for _ in range(2) for i in range(len(calls))]
    random.Random(1).shuffle(order)
    for i in order:
        assert torch.equal(run(model, calls[i], cached_options(rope)), plain[i]), (family, i)
    counted = rope.model_cache(model.model).stats.snapshot()["counters"]
    assert counted.get("hits", 0) >= 1 and not counted.get("bypasses"), counted
