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
