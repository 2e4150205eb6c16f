"""Conditioning cache on every VAE class the host's VAE loaders build (Flux, Flux.2, SD, Wan 2.1/2.2, Hunyuan,
LTXV/LTX-2/LTX 2.4 video and audio, SeedVR2, CogVideoX, Stable Cascade, the TAE families, Stable Audio 1 and 3,
MiniMax H3 audio...) and every CLIP-vision model its CLIP-vision loader picks
(ViT-L, ViT-H, ViT-bigG, SigLIP, DINO), each built from the host's own classes at a test size
(tests/tinymodels/vaes.py). A repeat is a hit bit-identical to the pack being off, or a bypass counted with
its reason; other pixels miss; tiled encodes are keyed apart from plain ones."""

import copy
import functools
import importlib
import types

import pytest
import rkharness
import torch
from test_conditioning import cc, same, uncached  # noqa: F401  (fixtures)

pytestmark = pytest.mark.conditioning


def _vaes():
    return importlib.import_module(f"{rkharness.TINY.__name__}.vaes")


# Classes whose encode the cache cannot store, and the reason the stats give
BYPASSED = {
    "Stable Audio (Oobleck)": "random",  # its bottleneck samples: the noise must be drawn on every request
    "Stable Audio 48k (Oobleck)": "random",  # the same bottleneck
}


def _vae(name):
    v = _vaes()
    try:
        return v.build_vae(name)
    except NotImplementedError as exc:
        pytest.skip(f"{name}: {exc}")


@pytest.mark.parametrize("name", [p.name for p in _vaes().VAE_PROBES])
def test_every_vae_class_repeats_as_a_hit_equal_to_comfyui_or_names_why(cc, uncached, name):  # noqa: F811
    v = _vaes()
    vae = _vae(name)
    why = uncached(v.host_encode_fails, vae, name, "vae")
    if why is not None:  # 0.3.75's light TAEs
        pytest.skip(f"{name}: {why}")

    def encode(seed=0):
        torch.manual_seed(0)  # the same noise for an encode that samples
        return vae.encode(v.media(name, seed))

    reference = uncached(encode)
    first, second = encode(), encode()
    assert same(first, reference) and same(second, reference)
    if name in BYPASSED:
        assert [(r["kind"], r["reason"], r["count"]) for r in cc.CACHE.bypass_reasons()] == [("vae", BYPASSED[name], 2)]
        return
    assert cc.CACHE.bypass_reasons() == [], f"{name} bypassed the cache"
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1)
    other = encode(seed=1)
    assert cc.CACHE.count("misses") == 2
    assert same(other, uncached(encode, 1)) and not same(other, reference)


@pytest.mark.parametrize("name", ["Flux/SD3", "Wan 2.1/Qwen-Image", "Wan 2.2", "HunyuanVideo 1.5"])
def test_tiled_and_temporal_tiled_encodes_hit_and_are_keyed_apart_from_plain_ones(cc, uncached, name):  # noqa: F811
    v = _vaes()
    vae = _vae(name)
    pixels = v.media(name)
    video = v.probe(name).media == "video"
    options = {"tile_x": 32, "tile_y": 32, "overlap": 8, **({"tile_t": 9, "overlap_t": 4} if video else {})}

    def tiled():
        return vae.encode_tiled(pixels, **options)

    reference = uncached(tiled)
    assert same(tiled(), reference) and same(tiled(), reference)
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1)
    plain = vae.encode(pixels)
    assert cc.CACHE.count("misses") == 2 and same(plain, uncached(vae.encode, pixels))
    assert cc.CACHE.bypass_reasons() == []


@pytest.mark.parametrize("name", [p.name for p in _vaes().VISION_PROBES])
def test_every_clip_vision_model_repeats_as_a_hit_equal_to_comfyui(cc, uncached, name):  # noqa: F811
    v = _vaes()
    try:
        model = v.build_vision(name)
    except NotImplementedError as exc:
        pytest.skip(f"{name}: {exc}")
    why = uncached(v.host_encode_fails, model, name, "vision")
    if why is not None:
        pytest.skip(f"{name}: {why}")
    image = v.media_image()
    reference = uncached(model.encode_image, image)
    first, second = model.encode_image(image), model.encode_image(image.clone())
    assert cc.CACHE.bypass_reasons() == [], f"{name} bypassed the cache"
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1)
    assert same(first, reference) and same(second, reference)
    uncropped = model.encode_image(image, crop=False)
    other = model.encode_image(v.media_image(1))
    assert cc.CACHE.count("misses") == 3
    assert same(uncropped, uncached(model.encode_image, image, crop=False))
    assert same(other, uncached(model.encode_image, v.media_image(1))) and not same(other, reference)


def test_the_seedvr2_vaes_own_method_is_keyed_by_where_it_is_defined(cc):  # noqa: F811
    """SeedVR2's VAE keeps a method of its own model (``format_encoded``): keyed, not a bypass; a method of
    another object still is one."""
    vae = _vae("SeedVR2")
    pixels = _vaes().media("SeedVR2")
    vae.encode(pixels)
    assert cc.CACHE.bypass_reasons() == []
    vae.format_encoded = torch.nn.Identity().forward  # a method of a module the key does not describe
    vae.encode(pixels)
    assert [r["reason"] for r in cc.CACHE.bypass_reasons()] == ["encoder setting 'format_encoded.__self__' holds a Identity"]


def _scaled_input(scale, how: str, host_function):
    """A node's ``process_input`` at a widget's value: one line of code, the value in a default or a closure
    (``wrapped``: a closure made with ``functools.wraps`` over the host's function, whose module name it takes)."""
    if how == "default":
        return lambda image, s=scale: image * s - 1.0
    if how == "wrapped":
        return functools.wraps(host_function)(lambda image: image * scale - 1.0)
    return lambda image: image * scale - 1.0


@pytest.mark.parametrize("how", ["default", "closure", "wrapped"])
def test_functions_a_node_sets_on_a_vae_are_keyed_by_their_defaults_and_what_they_capture(cc, uncached,  # noqa: F811
                                                                                          how):
    """Two functions from one line of a node's code that differ in a default or a captured value compute apart:
    the second encode is its own (it hit the first's latent, 1.9 off), on the VAE and on a module's forward. A
    closure wrapped over the host's function took ComfyUI's module name, and its captures were not keyed
    (until 2026-12-06): code is told by its file."""
    vae = rkharness.TINY.tiny_vae(0)
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(1))
    outs = []
    host_function = vae.process_input
    for scale in (2.0, 0.5, 2.0):
        vae.process_input = _scaled_input(scale, how, host_function)
        outs.append(vae.encode(image))
        assert same(outs[-1], uncached(vae.encode, image))
    assert not same(outs[0], outs[1]) and (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (2, 1)
    encoder = vae.first_stage_model.encoder
    forward = type(encoder).forward

    def scaled(s):
        def scaled_forward(x, s=s, module=encoder, forward=forward):  # the module: keyed by its path in the encoder
            return forward(module, x * s)
        return scaled_forward

    for scale in (1.0, 0.25):
        encoder.forward = scaled(scale)
        assert same(vae.encode(image), uncached(vae.encode, image))
    options = {"s": 2.0}  # a default that changes in place: compared on every encode
    encoder.forward = lambda x, options=options, module=encoder, forward=forward: forward(module, x * options["s"])
    assert same(vae.encode(image), uncached(vae.encode, image))
    options["s"] = 0.5
    assert same(vae.encode(image), uncached(vae.encode, image))
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (6, 1) and cc.CACHE.bypass_reasons() == []
    options = types.SimpleNamespace(scale=3.0)  # an object a key cannot describe: computed, counted
    vae.process_input = lambda image: image * options.scale - 1.0
    assert same(vae.encode(image), uncached(vae.encode, image))
    assert [r["reason"] for r in cc.CACHE.bypass_reasons()] == [
        "encoder setting 'process_input (its options)' holds a SimpleNamespace"]


def test_the_ltx2_audio_vaes_helper_objects_are_keyed_by_value_and_their_module_by_its_path(cc, uncached):  # noqa: F811
    """The LTX-2 audio VAE holds plain objects of ComfyUI's code beside its modules (its normalizer, holding
    a patchifier and the autoencoder's statistics module; its preprocessor): keyed by class and attributes,
    compared on every use, so one changed in place misses and gives ComfyUI's output; a module they hold
    from outside the encoder, whose weights the key does not see, is a bypass."""
    vae = _vae("LTX-2 audio")
    audio = _vaes().media("LTX-2 audio")
    model = vae.first_stage_model
    reference = uncached(vae.encode, audio)
    assert same(vae.encode(audio), reference) and same(vae.encode(audio), reference)
    assert (cc.CACHE.count("misses"), cc.CACHE.count("hits")) == (1, 1) and cc.CACHE.bypass_reasons() == []
    model.preprocessor.mel_hop_length = model.preprocessor.mel_hop_length // 2  # a setting changed in place
    changed = vae.encode(audio)
    assert cc.CACHE.count("misses") == 2 and same(changed, uncached(vae.encode, audio))
    assert not same(changed, reference)
    model.normalizer.statistics = copy.deepcopy(model.normalizer.statistics)  # the same values, outside the encoder
    assert same(vae.encode(audio), uncached(vae.encode, audio))
    assert [r["reason"] for r in cc.CACHE.bypass_reasons()] == [
        "encoder setting 'normalizer.statistics' holds a " + type(model.normalizer.statistics).__name__]
