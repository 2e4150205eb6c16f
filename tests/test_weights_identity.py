"""The weights identity that keys step-cache calibrations: precision copies share it, fine-tunes do not."""

from __future__ import annotations

import importlib
import json

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache

DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def wi():
    return rkharness.pack("caching.weights_identity")


@pytest.fixture(scope="module")
def flux_weights():
    """The trained Flux's weights as loaded (fp32), name by name."""
    trained = importlib.import_module(rkharness.TINY.__name__ + ".trained_flux")
    dm = trained.build(family="flux").model.diffusion_model
    return [(n, p.detach().clone()) for n, p in dm.named_parameters()]


def copy(weights, dtype=None, change=None):
    """The weights cast to ``dtype`` (as an fp8/bf16 file holds them), after ``change(name, tensor)``."""
    out = []
    for name, t in weights:
        t = change(name, t) if change is not None else t
        out.append((name, t.to(dtype) if dtype is not None else t))
    return out


def test_precision_copies_of_one_model_share_its_identity(flux_weights):
    base = wi().identity(flux_weights)
    copies = {dtype: wi().identity(copy(flux_weights, dtype)) for dtype in DTYPES}
    assert len(base.samples) > 16 * 20  # values from every tensor, not a few
    for dtype, ident in copies.items():
        assert base.matches(ident) and ident.matches(base), dtype
    assert copies[torch.bfloat16].matches(copies[torch.float8_e4m3fn])
    assert copies[torch.float8_e5m2].matches(copies[torch.float8_e4m3fn])


def test_a_fine_tune_of_one_block_is_another_model_in_every_precision(flux_weights):
    gen = torch.Generator().manual_seed(0)

    def tune(name, t):  # one block trained a little: each weight moved by ~2% of itself
        if not name.startswith("single_blocks.0."):
            return t
        return t + 0.02 * t * torch.randn(t.shape, generator=gen)

    tuned = copy(flux_weights, change=tune)
    assert not wi().identity(flux_weights).matches(wi().identity(tuned))
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):  # both copies in one precision: equal or not at all
        assert not wi().identity(copy(flux_weights, dtype)).matches(wi().identity(copy(tuned, dtype))), dtype
    assert not wi().identity(copy(flux_weights, torch.bfloat16)).matches(wi().identity(tuned))


def test_another_shape_never_matches_and_the_identity_round_trips_through_json(flux_weights):
    ident = wi().identity(flux_weights)
    again = wi().WeightsIdentity.from_json(json.loads(json.dumps(ident.to_json())))
    assert again == ident and again.matches(ident)
    grown = [(n, torch.cat([t, t[:1]]) if n == flux_weights[-1][0] else t) for n, t in flux_weights]
    assert not ident.matches(wi().identity(grown))
    renamed = [(f"x.{n}", t) for n, t in flux_weights]
    assert not ident.matches(wi().identity(renamed))
    for bad in (None, {}, {"structure": "s", "dtypes": ["float32"], "counts": [2], "samples": [1.0]},
                {"structure": "s", "dtypes": ["int8"], "counts": [1], "samples": [1.0]}):
        assert wi().WeightsIdentity.from_json(bad) is None


def test_a_nan_weight_never_matches(flux_weights):
    poisoned = [(n, torch.full_like(t, float("nan")) if i == 0 else t) for i, (n, t) in enumerate(flux_weights)]
    ident = wi().identity(poisoned)
    assert not ident.matches(ident)


def test_a_hooks_digest_follows_what_reaches_the_model_and_not_its_run_state():
    """ComfyUI's own hook classes: a transformer options hook marks itself added during a run (its digest once
    changed after the first run, so its calibration was never found again); two partials of different functions
    digested alike; a hook's text encoder half (its CLIP weights and strength) reaches no diffusion model."""
    import functools
    import operator

    import comfy.hooks

    def options_hook(fn):
        return comfy.hooks.TransformerOptionsHook({"wrappers": {"outer_sample": {"test": [fn]}}})

    hook = options_hook(functools.partial(operator.mul, 2))
    before = wi().hooks_digest([hook])
    hook._skip_adding = True  # what a run leaves on it
    assert wi().hooks_digest([hook]) == before
    assert wi().hooks_digest([options_hook(functools.partial(operator.add, 2))]) != before
    weights = {"diffusion_model.w": torch.ones(4)}

    def lora(clip_strength, model_strength=1.0):
        return comfy.hooks.create_hook_model_as_lora(weights, {"clip_l.w": torch.ones(4)}, model_strength,
                                                     clip_strength).hooks

    assert wi().hooks_digest(lora(1.0)) == wi().hooks_digest(lora(0.0)) != wi().hooks_digest(lora(1.0, 0.5))
    assert wi().hooks_digest(lora(1.0), ("positive",)) != wi().hooks_digest(lora(1.0), ("negative",))


def test_quantized_weights_are_identified_by_their_data_and_scales_never_dequantized(monkeypatch):
    """Integer weights (GGUF's blocks, NF4's packed values) were left out of the identity, so a GGUF fine-tune
    read its base model's calibration; a weight in ComfyUI's mixed-precision layout was dequantized whole to
    sample 16 values (196 ms for one 3072x12288 weight on a CPU, at every sampling run)."""
    bias = torch.linspace(-1, 1, 8)
    blocks = torch.randint(0, 256, (64, 34), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    tuned = blocks.clone()
    tuned[32:] ^= 1  # a fine-tune: half the weight's quantized values moved (16 are sampled, as of a float weight)

    def ident(data):
        return wi().identity([("blocks.0.weight", data), ("blocks.0.bias", bias)])

    assert ident(blocks).matches(ident(blocks.clone())) and not ident(blocks).matches(ident(tuned))
    weight = torch.randn(40, 40, generator=torch.Generator().manual_seed(2))  # torch's own quantized tensors
    with pytest.warns(UserWarning):  # (deprecated in torch, still made: reading one's bytes crashed the process)
        per_tensor = [torch.quantize_per_tensor(weight, scale, 0, torch.qint8) for scale in (0.1, 0.1, 0.2)]
        per_channel = [torch.quantize_per_channel(weight, torch.full((40,), s), torch.zeros(40, dtype=torch.int64), 0,
                                                  torch.qint8) for s in (0.1, 0.2)]
    assert ident(per_tensor[0]).matches(ident(per_tensor[1])) and not ident(per_tensor[0]).matches(ident(per_tensor[2]))
    assert not ident(per_channel[0]).matches(ident(per_channel[1]))
    ints, scales = per_channel[0].int_repr(), per_channel[0].q_per_channel_scales()
    shifted = [torch._make_per_channel_quantized_tensor(ints, scales, torch.full((40,), z, dtype=torch.int64), axis)
               for z, axis in ((0, 0), (5, 0), (0, 1))]  # the same integers and scales, other values
    assert ident(shifted[0]).matches(ident(per_channel[0]))
    assert not ident(shifted[0]).matches(ident(shifted[1])) and not ident(shifted[0]).matches(ident(shifted[2]))
    try:
        import comfy.quant_ops as quant
    except ImportError:
        return
    layouts = [n for n in ("TensorCoreFP8E4M3Layout", "TensorCoreFP8Layout") if n in getattr(quant, "LAYOUTS", {})]
    if not layouts:
        return
    weight = torch.randn(32, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def quantized(scale_by=1.0):
        try:
            q = quant.QuantizedTensor.from_float(weight, layouts[0], scale="recalculate")
        except TypeError:  # (0.3.75's layout computes its scale when given none)
            q = quant.QuantizedTensor.from_float(weight, layouts[0])
        if scale_by != 1.0:
            (scale,) = [t for n, t in wi().plain_leaves("w", q) if "scale" in n]
            scale.mul_(scale_by)
        return q

    dequantized = []
    real = quant.QuantizedTensor.dequantize
    monkeypatch.setattr(quant.QuantizedTensor, "dequantize", lambda self: dequantized.append(1) or real(self))
    first = wi().identity([("w", quantized())])
    assert first.matches(wi().identity([("w", quantized())]))
    assert not first.matches(wi().identity([("w", quantized(2.0))]))
    assert dequantized == []


def test_a_tensor_subclass_whose_inner_tensors_are_not_its_attributes_is_read_whole():
    """A layout whose ``__tensor_flatten__`` names inner tensors kept elsewhere (a dict of its own) gave no leaf,
    and the weight was left out of the identity: two models differing there alone matched."""
    class Packed(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        def __tensor_flatten__(self):
            return ["_packed"], None  # held in self.store, not as an attribute ``_packed``

    def weight(scale):
        t = (torch.linspace(-1, 1, 64) * scale).as_subclass(Packed)
        t.store = {"_packed": t.as_subclass(torch.Tensor)}
        return t

    leaves = list(wi().plain_leaves("w", weight(1.0)))
    assert [n for n, _ in leaves] == ["w"]
    assert not wi().identity([("w", weight(1.0))]).matches(wi().identity([("w", weight(2.0))]))
