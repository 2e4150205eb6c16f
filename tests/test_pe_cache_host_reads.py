"""A PE cache hit never reads a tensor's values on the host (on a GPU: no device-to-host copy, no sync).

Every tensor is treated as if it were on a device: the rope patches' ``VALUE_KEYS_ON`` (the devices
whose tensors a key may read by value) is emptied, and :class:`host_reads.HostReads` records every
call that reads values into Python (``.cpu()``, ``.numpy()``, ``.item()``, ``bool()``...). The
cached forward that hits must make no read from the pack's code and no read the host's own forward
does not make, and still equal the uncached output."""

import functools
import importlib

import pytest
import rkharness
import torch
from host_reads import HostReads
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.pe_cache

FAMILIES = ["flux", "wan", "chroma", "chroma_radiance", "hunyuan_video", "qwen_image", "lumina2", "z_image", "z_image_pixel",
            "hidream", "hunyuan_dit", "ltxv", "cosmos", "anima", "mochi", "omnigen2",
            "flux2", "flux2_klein", "qwen_image_edit", "hunyuan_video15", "ltx2", "wan22", "wan22_14b"]
# families whose positions come from tensor values (LTXV's keyframe and mask grid): on a device they
# compute every call, and say why
NO_HOST_KEY = {"ltxv", "ltx2"}


@pytest.fixture(scope="module")
def rope():
    return rkharness.pack("patches.rope")


@pytest.fixture(scope="module")
def families():
    return importlib.import_module(rkharness.TINY.__name__ + ".families")


@pytest.fixture
def as_on_a_device(rope, monkeypatch):
    monkeypatch.setattr(rope, "VALUE_KEYS_ON", frozenset(), raising=False)


def cached_options(rope, **extra):
    import comfy.patcher_extension as patcher_extension

    return {"wrappers": {patcher_extension.WrappersMP.APPLY_MODEL: {"test": [rope.ApplyModelWrapper()]}}, **extra}


def run(model, call, options):
    x, sigma, kwargs = call
    return model.model.apply_model(x, sigma, transformer_options=dict(options), **kwargs)


def counters(rope, model):
    return dict(rope.model_cache(model.model).stats.snapshot()["counters"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_reads_no_tensor_value_on_the_host(family, families, rope, as_on_a_device):
    spec = families.family_spec(family)
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 1)
    with HostReads() as plain_reads:
        plain = run(model, call, {})
    first = run(model, call, cached_options(rope))  # the miss
    before = counters(rope, model)
    with HostReads() as reads:
        out = run(model, call, cached_options(rope))
    after = counters(rope, model)
    assert torch.equal(out, plain) and torch.equal(first, plain)
    assert reads.pack() == [], f"{family}: the PE cache read tensor values on the host: {reads.pack()}"
    extra = reads.names() - plain_reads.names()
    assert not extra, f"{family}: the cached forward reads more than the host's own: {extra}"
    hits = after.get("hits", 0) - before.get("hits", 0)
    assert after.get("misses", 0) == before.get("misses", 0), (family, before, after)
    if family in NO_HOST_KEY:
        assert hits == 0 and after.get("bypasses", 0) > before.get("bypasses", 0), (family, before, after)
        reasons = rope.model_cache(model.model).stats.snapshot()["reasons"]
        assert any(r["event"] == "bypass" and "device" in r["reason"] for r in reasons), reasons
    else:
        assert hits >= 1, f"{family}: no hit on the second forward: {before} -> {after}"


# ---- what a forward's geometry cannot see leaves it without one ---------------------------------

def test_an_ids_builder_replaced_after_install_is_never_answered_from_the_geometry(families, rope, monkeypatch):
    """A custom node that replaces ``Flux.process_img`` (here: positions moved by one row) makes ids
    the geometry key cannot see: the forward then has no geometry, and the ids are keyed by value."""
    import comfy.ldm.flux.model as flux

    model = families.FAMILY_SPECS["flux"].build(0)
    call = families.FAMILY_SPECS["flux"].inputs((16, 8, 8), 2)
    host_out = run(model, call, cached_options(rope))  # a miss with the host's process_img
    host_process_img = flux.Flux.process_img

    def moved(self, x, *args, **kwargs):
        img, ids = host_process_img(self, x, *args, **kwargs)
        return img, ids + torch.tensor([0.0, 1.0, 0.0])

    monkeypatch.setattr(flux.Flux, "process_img", moved)
    plain = run(model, call, {})
    assert not torch.equal(plain, host_out)
    assert torch.equal(run(model, call, cached_options(rope)), plain)
    monkeypatch.setattr(rope, "VALUE_KEYS_ON", frozenset())  # as on a device: computed, and why
    assert torch.equal(run(model, call, cached_options(rope)), plain)
    reasons = rope.model_cache(model.model).bypass_reasons()
    assert any("process_img" in r for r in reasons), reasons


@pytest.mark.parametrize("how", ["object patch", "embedder pre-hook", "global pre-hook"])
def test_ids_rewritten_on_the_model_itself_are_never_answered_from_the_geometry(families, rope, monkeypatch, how):
    """ComfyUI's object patch of ``diffusion_model.process_img`` (set on the instance, the class's stays the
    host's), a hook on the embedder, or torch's global module hook moves the positions: the forward then
    has no geometry, so every output equals ComfyUI's with the same patch, and the reason is counted."""
    import types

    import comfy.ldm.flux.model as flux

    model = families.FAMILY_SPECS["flux"].build(0)
    call = families.FAMILY_SPECS["flux"].inputs((16, 8, 8), 2)
    dm = model.model.diffusion_model
    host_out = run(model, call, cached_options(rope))  # a miss, then an entry of the host's geometry
    assert torch.equal(run(model, call, cached_options(rope)), host_out)
    undo = []
    if how == "object patch":
        def moved(self, x, *args, **kwargs):
            img, ids = flux.Flux.process_img(self, x, *args, **kwargs)
            return img, ids + torch.tensor([0.0, 1.0, 0.0])

        model.add_object_patch("diffusion_model.process_img", types.MethodType(moved, dm))
        model.patch_model()
        undo.append(model.unpatch_model)
    else:
        def shift(module, args):
            return (args[0] + 1.0,)

        if how == "embedder pre-hook":
            undo.append(dm.pe_embedder.register_forward_pre_hook(shift).remove)
        else:
            undo.append(torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: shift(module, args) if module is dm.pe_embedder else None).remove)
    try:
        plain = run(model, call, {})
        assert not torch.equal(plain, host_out)
        for _ in range(2):
            assert torch.equal(run(model, call, cached_options(rope)), plain)
        monkeypatch.setattr(rope, "VALUE_KEYS_ON", frozenset())  # as on a device: computed, and why
        assert torch.equal(run(model, call, cached_options(rope)), plain)
        reasons = rope.model_cache(model.model).bypass_reasons()
        assert any(("object patch" if how == "object patch" else "hook") in r for r in reasons), reasons
    finally:
        for u in undo:
            u()


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_a_post_input_patch_that_moves_the_ids_is_never_answered_from_the_geometry(family, families, rope,
                                                                                   monkeypatch):
    spec = families.FAMILY_SPECS[family]
    model = spec.build(0)
    call = spec.inputs(spec.sizes[0], 3)
    host_out = run(model, call, cached_options(rope))  # a miss without the patch

    def shift(args):
        return dict(args, img_ids=args["img_ids"] + 2)

    patched = {"patches": {"post_input": [shift]}}
    plain = run(model, call, patched)
    if family != "flux" and torch.equal(plain, host_out):
        pytest.skip(f"this ComfyUI's {family} runs no post_input patches")
    assert not torch.equal(plain, host_out)
    for _ in range(2):
        assert torch.equal(run(model, call, cached_options(rope, **patched)), plain)
    monkeypatch.setattr(rope, "VALUE_KEYS_ON", frozenset())
    assert torch.equal(run(model, call, cached_options(rope, **patched)), plain)
    reasons = rope.model_cache(model.model).bypass_reasons()
    assert any("post_input" in r for r in reasons), reasons


def test_two_tables_of_one_forward_with_equal_shapes_are_two_entries(families, rope):
    """Lumina's text and image ids can have equal shapes within one forward: the call's order is in
    the key, so the second table is never answered with the first."""
    pc = rkharness.pack("caching.pe_cache")
    seam = next(s for s in rkharness.pack("patches.rope_seams").SEAMS if s.family == "flux")
    dm = families.FAMILY_SPECS["flux"].build(0).model.diffusion_model
    x, sigma, kwargs = families.FAMILY_SPECS["flux"].inputs((16, 8, 8), 4)
    ids_a = torch.arange(69.0).reshape(1, 23, 3)
    ids_b = ids_a.flip(1)
    expected = dm.pe_embedder(ids_a), dm.pe_embedder(ids_b)
    cache = pc.PECache()
    for _ in range(2):
        with rope.scope(cache), seam.opened(dm, (x, sigma, kwargs["c_crossattn"]), {}):
            got = dm.pe_embedder(ids_a), dm.pe_embedder(ids_b)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert {n: (s.get("misses"), s.get("hits")) for n, s in cache.name_stats().items()} == \
        {"EmbedND[0]": (1, 1), "EmbedND[1]": (1, 1)}


# ---- real device tensors (fake CUDA: metadata only, any copy to the host is seen) ---------------

class DeviceSyncs(TorchDispatchMode):
    """Records the ops that copy a non-CPU tensor to the host or wait for its values."""

    SYNCS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero", "_assert_async")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        on_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        to_host = (name == "_to_copy" and kwargs.get("device") is not None
                   and torch.device(kwargs["device"]).type == "cpu") or (
            name in ("copy_", "_copy_from") and args[0].device.type == "cpu")
        if on_device and (to_host or name in self.SYNCS):
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_on_a_gpu_a_hit_copies_nothing_and_value_keyed_builders_compute(families, rope):
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi
    from torch._subclasses.fake_tensor import FakeTensorMode

    pc = rkharness.pack("caching.pe_cache")
    seam = next(s for s in rkharness.pack("patches.rope_seams").SEAMS if s.family == "flux")
    dm = families.FAMILY_SPECS["flux"].build(0).model.diffusion_model
    cache = pc.PECache()
    with FakeTensorMode():
        x, sigma, ctx = (torch.zeros(s, device="cuda") for s in ((1, 16, 8, 8), (1,), (1, 7, 32)))
        ids = torch.zeros(1, 23, 3, device="cuda")
        for _ in range(2):
            with DeviceSyncs() as syncs, rope.scope(cache), seam.opened(dm, (x, sigma, ctx), {}):
                table = dm.pe_embedder(ids)
            assert syncs.seen == [] and table.device.type == "cuda"
        assert cache.name_stats()["EmbedND[0]"] == {"misses": 1, "hits": 1, "bytes": pytest.approx(9718, rel=1)}
        with DeviceSyncs() as syncs, rope.scope(cache):  # no geometry: ids keyed by value, on the device
            dm.pe_embedder(ids)
            mochi.compute_mixed_rotation(freqs=torch.zeros(3, 2, 16, device="cuda"),
                                         pos=torch.zeros(24, 3, device="cuda"))
        assert syncs.seen == []
        own = dm.pe_embedder
        other = type(own)(dim=own.dim, theta=own.theta, axes_dim=own.axes_dim)  # a patch's own embedder
        with DeviceSyncs() as syncs, rope.scope(cache), seam.opened(dm, (x, sigma, ctx), {}):
            other(ids)
        assert syncs.seen == []
    reasons = cache.bypass_reasons()
    assert set(reasons) == {"EmbedND ids outside a family forward with a geometry seam on the cuda device, keyed by value: "
                            "not read, computed",
                            "EmbedND ids of an embedder not the running family forward's own on the cuda device, keyed "
                            "by value: not read, computed",
                            "mochi.rotation freqs on the cuda device, keyed by value: not read, computed"}, reasons


def test_a_forward_another_pack_replaced_before_install_is_left_alone(rope):
    """A forward another pack replaced before ReuseKit installs may make ids from anything: its
    geometry seam is not installed (one warning), so its embedder keeps the value rules."""
    import comfy.ldm.flux.model as flux

    patch = next(p for p in rope.PATCHES if p.attr == "Flux._forward")
    patch.uninstall()
    host_forward = flux.Flux.__dict__["_forward"]

    @functools.wraps(host_forward)  # the same parameters: only where it comes from differs
    def foreign(self, *args, **kwargs):
        return host_forward(self, *args, **kwargs)

    foreign.__module__ = "another_pack.flux"
    flux.Flux._forward = foreign
    try:
        assert patch.install() is False and "another_pack.flux" in patch.off
        assert flux.Flux.__dict__["_forward"] is foreign
    finally:
        flux.Flux._forward = host_forward
        assert patch.install() and patch.off is None
