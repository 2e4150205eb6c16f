"""Step cache (TeaCache): the math, and the nodes on real models through the real KSampler.

Quality-relevant tests use the small Flux trained on captioned shapes (tests/tinymodels/
trained_flux.py): on random weights consecutive steps barely differ and CFG does nothing.
"""

import dataclasses
import importlib
import json
import logging
import math
import os
import re
import time

import numpy as np
import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache

STEPS = 10


def tc():
    return rkharness.pack("caching.step_cache")


def P():
    return rkharness.pack("patches.step_cache")


def H():
    """The step-cache test helpers shared with test_step_families.py."""
    return tiny_module("step_families")


def SF():
    return rkharness.pack("patches.step_families")


def N():
    return rkharness.pack("nodes.step_cache")


def tiny_module(name):
    return importlib.import_module(f"{rkharness.TINY.__name__}.{name}")


@pytest.fixture(scope="module")
def flux():
    return tiny_module("trained_flux").build()


@pytest.fixture(autouse=True)
def _fresh_reasons():
    """The step cache's reason rows are bounded (64 kinds, then one "other" row): each test starts from none,
    so a reason it looks for has its own row whatever ran before it in the session."""
    P().stats().reset_counters()


@pytest.fixture(autouse=True)
def _isolated_calibrations(monkeypatch, tmp_path):
    """Calibrations go to a temporary file, and none leaks between tests."""
    store = tc().CalibrationStore(tmp_path / "teacache_calibration.json")
    monkeypatch.setattr(P(), "STORE", store)
    return store


def sample(model, conds, steps=STEPS, cfg=3.0, shape=(1, 16, 8, 8), seed=3, fill=0.0):
    """``fill``: a latent that is not empty, so the sampler keeps its channels as given."""
    import nodes

    pos, neg = conds
    (out,) = nodes.common_ksampler(model, seed, steps, cfg, "euler", "simple", pos, neg,
                                   {"samples": torch.full(shape, fill)})
    return out["samples"]


def teacache(model, thresh, model_type="flux", start=0.0, end=1.0, max_skips=0, device="device",
             mode="extrapolate", rule="teacache", power=1.0, first_blocks=1):
    (m,) = N().TeaCacheNode.execute(model=model, rule=rule, threshold=thresh, model_type=model_type,
                                    start_percent=start, end_percent=end, max_consecutive_skips=max_skips,
                                    cache_device=device, residual_mode=mode, interval_power=power,
                                    first_blocks=first_blocks).args
    return m


def last_run():
    return P().stats().snapshot()["info"]["last_run"]


FLAT = {"cond": [(1.0, 0.0), (0.0, 0.0)]}  # a magcache curve whose ratio is always 1


def call_state(to, action="S"):
    """A run state for calling the model directly: the node's config resolved, unit teacache
    polynomial, flat magcache curve, skipping allowed at every sigma; the schedule rule's plan: one step
    that every call falls in, planned ``action``."""
    settings = to[P().KEY]
    run = tc().RunState(P().resolved_config(settings.config, settings.family), (0, 0, 0, 1.0, 0), 1.0, 0.0, FLAT)
    plan_every_call(run, action)
    return run


def plan_every_call(run, action):
    run.set_plan(rkharness.pack("caching.step_schedule").Plan((action,), (0.0,)), [0.5, 0.0])


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# ---- the pure math --------------------------------------------------------------------------

def test_rel_l1_and_rescale_are_the_published_formulas():
    m = tc()
    prev, cur = torch.tensor([1.0, -2.0, 4.0]), torch.tensor([1.5, -2.0, 3.0])
    assert float(m.rel_l1(cur, prev)) == pytest.approx((0.5 + 0 + 1.0) / 3 / (7 / 3))
    x = torch.tensor(0.1)
    c = m.COEFFICIENTS["flux"]
    expected = abs(sum(ci * 0.1 ** (4 - i) for i, ci in enumerate(c)))
    assert float(m.rescale(c, x)) == pytest.approx(expected, rel=1e-5)
    assert float(m.rescale((0, 0, 0, -1.0, 0), x)) == pytest.approx(0.1)  # abs: never negative


def test_fit_polynomial_recovers_a_known_polynomial_and_rejects_too_few_points():
    m = tc()
    xs = [0.01 * i for i in range(1, 15)]
    ys = [3.0 * x * x + 0.5 * x + 0.02 for x in xs]
    coeffs = m.fit_polynomial(xs, ys, degree=2)
    assert len(coeffs) == 5 and coeffs[:2] == (0.0, 0.0)
    assert coeffs[2:] == pytest.approx((3.0, 0.5, 0.02), rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="at least 2"):
        m.fit_polynomial([0.1], [0.2])


def run_state(thresh=1.0, max_skips=0, coeffs=(0, 0, 0, 1.0, 0)):
    m = tc()
    cfg = m.StepCacheConfig(None, "test", thresh, max_consecutive_skips=max_skips)
    return m.RunState(cfg, coeffs, 1.0, 0.0)


def test_decide_keeps_cond_state_separate_and_skips_only_when_every_cond_agrees():
    rs = run_state(thresh=0.3)
    a0, b0 = torch.ones(1, 4, 8), torch.ones(1, 4, 8) * 2
    assert rs.decide(["a", "b"], ["cond", "uncond"], [a0, b0], True) is False  # nothing stored yet
    rs.store_residual("a", torch.zeros(1, 4, 8))
    rs.store_residual("b", torch.zeros(1, 4, 8))
    # a moves 10%, b 50%: b is over the threshold, so the call computes and both reset
    assert rs.decide(["a", "b"], ["cond", "uncond"], [a0 * 1.1, b0 * 1.5], True) is False
    assert rs.conds["a"].accumulated == 0.0 and rs.conds["b"].computed == 2
    # both move 10%: skip, each accumulating its own distance
    assert rs.decide(["a", "b"], ["cond", "uncond"], [a0 * 1.21, b0 * 1.65], True) is True
    assert float(rs.conds["a"].accumulated) == pytest.approx(0.1, rel=1e-4)
    assert float(rs.conds["b"].accumulated) == pytest.approx(0.1, rel=1e-4)
    assert rs.conds["a"].pattern == ["C", "C", "S"]
    # outside the window: never skip
    assert rs.decide(["a", "b"], ["cond", "uncond"], [a0 * 1.21, b0 * 1.65], False) is False


def test_extrapolated_residual_follows_the_last_slope_and_never_overshoots_its_span():
    m = tc()
    cfg = m.StepCacheConfig(None, "test", 1.0, residual_mode="extrapolate")
    rs = m.RunState(cfg, (0, 0, 0, 1.0, 0), 1.0, 0.0)
    rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True)
    rs.store_residual("a", torch.full((1, 2, 2), 1.0), sigma=1.0)
    like = torch.zeros(1, 2, 2)
    assert torch.equal(rs.residual("a", like, 0.9), torch.full((1, 2, 2), 1.0))  # one point: plain reuse
    rs.store_residual("a", torch.full((1, 2, 2), 2.0), sigma=0.8)  # +1 per -0.2 sigma
    assert torch.allclose(rs.residual("a", like, 0.7), torch.full((1, 2, 2), 2.5))
    assert torch.allclose(rs.residual("a", like, 0.1), torch.full((1, 2, 2), 3.0))  # capped at one span
    reuse = m.RunState(m.StepCacheConfig(None, "test", 1.0, residual_mode="reuse"), (0, 0, 0, 1.0, 0), 1.0, 0.0)
    reuse.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True)
    reuse.store_residual("a", torch.full((1, 2, 2), 1.0), sigma=1.0)
    reuse.store_residual("a", torch.full((1, 2, 2), 2.0), sigma=0.8)
    assert torch.equal(reuse.residual("a", like, 0.7), torch.full((1, 2, 2), 2.0))


@pytest.mark.hardening
@pytest.mark.parametrize("mode", ["extrapolate", "taylor2"])
def test_a_forecast_of_fp16_residuals_that_change_fast_over_a_small_gap_stays_finite(mode):
    """A change of 700 over a sigma gap of 0.01 is a slope of 70000, over fp16's largest number: kept as a
    slope in the model's dtype it was inf, and every skipped call of an fp16 model added inf (extrapolate) or
    NaN (taylor2) to a run that is finite uncached. The forecast is 2100, as in float32."""
    m = tc()
    rs = m.RunState(m.StepCacheConfig(None, "test", 1.0, residual_mode=mode), (0, 0, 0, 1.0, 0), 1.0, 0.0)
    rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True)
    for sigma, value in ((0.51, 0.0), (0.50, 700.0), (0.49, 1400.0)):
        rs.store_residual("a", torch.full((1, 2, 2), value, dtype=torch.float16), sigma=torch.tensor(sigma))
    out = rs.residual("a", torch.zeros(1, 2, 2, dtype=torch.float16), torch.tensor(0.48))
    assert out.dtype == torch.float16 and torch.allclose(out.float(), torch.full((1, 2, 2), 2100.0), rtol=2e-3)


def test_taylor2_forecasts_a_residual_quadratic_in_sigma_exactly():
    m = tc()

    def r(s):
        return torch.tensor([[[1.0 + 2.0 * s - 3.0 * s * s, -0.5 * s * s]]])

    got = {}
    for mode in ("taylor2", "extrapolate"):
        rs = m.RunState(m.StepCacheConfig(None, "test", 1.0, residual_mode=mode), (0, 0, 0, 1.0, 0), 1.0, 0.0)
        rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True)
        for s in (1.0, 0.8, 0.6):
            rs.store_residual("a", r(s), sigma=torch.tensor(s))
        got[mode] = rs.residual("a", torch.zeros(1, 1, 2), torch.tensor(0.45))
    assert torch.allclose(got["taylor2"], r(0.45), atol=1e-5)
    assert not torch.allclose(got["extrapolate"], r(0.45), atol=1e-3)  # first order misses the bend
    # clamped like extrapolate: never further than the last sigma gap
    far = rs.residual("a", torch.zeros(1, 1, 2), torch.tensor(0.0))
    assert torch.allclose(far, rs.residual("a", torch.zeros(1, 1, 2), torch.tensor(0.4)))


def drive(mode, values, pattern, interval=10.0, device="device"):
    """A run of the interval rule where ``pattern`` says which calls may skip ("S"; the rule skips them,
    its interval being longer) and which compute ("C", outside the window): each computed call stores
    ``values[i]`` (a number: a (1, 2, 2) tensor of it, or a tensor); returns each skipped call's
    forecast (its first element) and the run."""
    m = tc()
    cfg = m.StepCacheConfig(None, "test", interval, residual_mode=mode, rule="interval", cache_device=device)
    rs = m.RunState(cfg, None, 1.0, 0.0)
    got = []
    for value, want in zip(values, pattern, strict=True):
        skip = rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], want == "S")
        assert skip == (want == "S"), (pattern, len(got))
        if skip:
            got.append(float(rs.residual("a", torch.zeros(1, 2, 2)).flatten()[0]))
        else:
            rs.store_residual("a", value if torch.is_tensor(value) else torch.full((1, 2, 2), float(value)))
    return got, rs


def test_interval_computes_one_call_in_n_per_cond_within_the_window_and_skip_limit():
    m = tc()

    def pattern(n, calls=10, max_skips=0, window=None, keys=("a",)):
        rs = m.RunState(m.StepCacheConfig(None, "test", n, max_consecutive_skips=max_skips, rule="interval"),
                        None, 1.0, 0.0)
        for i in range(calls):
            skip = rs.decide(list(keys), ["cond", "uncond"][:len(keys)], [torch.ones(1, 2, 2)] * len(keys),
                             True if window is None else window[i])
            if not skip:
                for k in keys:
                    rs.store_residual(k, torch.zeros(1, 2, 2))
        return "".join(rs.conds[keys[0]].pattern), rs

    assert pattern(3.0)[0] == "CSSCSSCSSC"
    assert pattern(4.0)[0] == "CSSSCSSSCS"
    assert pattern(1.0)[0] == "C" * 10  # interval 1: every call computed
    assert pattern(3.0, max_skips=1)[0] == "CSCSCSCSCS"
    # outside the window every call computes; the beat starts again from the last computed call
    assert pattern(3.0, window=[False] * 4 + [True] * 6)[0] == "CCCCSSCSSC"
    got, rs = pattern(3.0, keys=("a", "b"))  # per cond, and every cond of the call agrees
    assert got == "CSSCSSCSSC" and "".join(rs.conds["b"].pattern) == got
    assert [float(v) for v in rs.conds["a"].trace[:4]] == [1.0, 1.0, 2.0, 3.0]  # the calls since the last computed
    rs.decide(["a"], ["cond"], [torch.ones(1, 3, 2)], True)  # another shape: starts clean, computes
    assert rs.resets == 1 and rs.conds["a"].pattern[-1] == "C"


def adaptive_run(values, threshold, mode="output", sigmas=None):
    """The adaptive rule over ``values`` (one per call), every call allowed to skip; each computed call
    stores its value (a (1, 2, 2) tensor of it) at ``sigmas[i]`` where given: the pattern and the run."""
    m = tc()
    rs = m.RunState(m.StepCacheConfig(None, "test", threshold, residual_mode=mode, rule="adaptive"), None, 1.0, 0.0)
    for i, value in enumerate(values):
        if not rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True):
            rs.store_residual("a", torch.full((1, 2, 2), float(value)),
                              sigma=None if sigmas is None else torch.tensor(sigmas[i]))
    return "".join(rs.conds["a"].pattern), rs


def test_the_adaptive_rule_grows_its_stretches_while_the_forecast_holds_and_shrinks_them_where_it_strays():
    m = tc()
    # a line: once two calls are computed the forecast is exact, so each check finds no error and the next
    # stretch is twice the last, up to ADAPTIVE_MAX. Every call computes until the first check, which waits for
    # a forecast that reads a slope (call 2, a stretch of one call), and the first check alone sets no longer
    # stretch: no skip comes before two checks agree
    pattern, rs = adaptive_run([2.0 + 0.5 * i for i in range(40)], 0.01)
    assert [i for i, p in enumerate(pattern) if p == "C"] == [0, 1, 2, 3, 5, 9, 17, 29]
    assert [(i, g, b) for i, g, _, b in rs.conds["a"].checks] == [(2, 1, 1.0), (3, 1, 2.0), (5, 2, 4.0), (9, 4, 8.0),
                                                                 (17, 8, 12.0), (29, 12, 12.0)]
    assert all(e == 0.0 for _, _, e, _ in rs.conds["a"].checks)
    # a kink: the line turns five times steeper at call 10, the check at 17 finds the forecast astray and
    # the next stretch is half of the last (its error times the span is far over the threshold)
    kink = [float(i) if i <= 10 else 10.0 + 5.0 * (i - 10) for i in range(30)]
    sigmas = [1.0 - i / 30 for i in range(30)]
    pattern, rs = adaptive_run(kink, 0.01, sigmas=sigmas)
    computed = [i for i, p in enumerate(pattern) if p == "C"]
    assert computed[:8] == [0, 1, 2, 3, 5, 9, 17, 21]
    index, stretch, error, beat = rs.conds["a"].checks[4]
    # the forecast a skip would have added at 17, by FoCa's update along the line's slope from 9: 17; computed 45
    assert (index, stretch) == (17, 8)
    assert error == pytest.approx(abs(17.0 - 45.0) / 45.0 * (sigmas[9] - sigmas[17]), rel=1e-5)
    assert beat == 4.0
    # each check's next stretch, by the rule: the stretch that would err the threshold at the worse of this
    # check's and the last one's error per call cubed, at most twice or half of this stretch, 1 to ADAPTIVE_MAX
    last = math.inf
    for _, g, e, b in rs.conds["a"].checks:
        rate, last = max(e / g ** 3, last), e / g ** 3
        fit = m.ADAPTIVE_MAX if rate == 0 else (0.01 / rate) ** (1 / 3)
        assert b == pytest.approx(min(m.ADAPTIVE_MAX, max(1.0, g / 2, min(2 * g, fit))))
    # a zigzag the forecast cannot follow holds the beat at 1 (every call computes, each one checked), and the
    # line after it (from call 8) lets the beat grow again, once two checks agree: the first exact check (10,
    # whose forecast reads the line's calls alone) comes right after one that strayed, and keeps the beat
    zigzag = [5.0 * (i % 2) for i in range(8)] + [3.0 + 0.5 * i for i in range(24)]
    pattern, rs = adaptive_run(zigzag, 0.01)
    checks = {i: (e, b) for i, _, e, b in rs.conds["a"].checks}
    assert pattern[:13] == "C" * 12 + "S" and all(checks[i][1] == 1.0 for i in range(2, 11))
    assert checks[10] == (0.0, 1.0) and checks[11] == (0.0, 2.0) and rs.conds["a"].checks[-1][3] >= 4.0
    # threshold 0 computes every call, and a shape change starts the beat over
    assert adaptive_run(kink, 0.0)[0] == "C" * 30
    rs.decide(["a"], ["cond"], [torch.ones(1, 3, 2)], True)
    assert rs.conds["a"].pattern[-1] == "C" and rs.conds["a"].beat == m.ADAPTIVE_START


def test_a_placed_beat_above_1_places_as_many_steps_as_the_fixed_beat_closer_toward_the_end():
    m = tc()
    assert m.placed_beat(50, 10, 1.0) == [0, 12, 24, 37, 49]  # even (24.5 rounds to even), first and last in
    assert m.placed_beat(50, 10, 1.3) == [0, 15, 29, 41, 49]
    assert m.placed_beat(10, 3, 2.0) == [0, 5, 8, 9]
    for steps, n, power in ((20, 2, 3.0), (7, 1, 4.0), (28, 3, 1.5), (5, 2, 4.0)):
        got = m.placed_beat(steps, n, power)
        assert len(got) == -(-steps // n) and got == sorted(set(got)), (steps, n, power, got)  # rounding kept apart
        assert got[0] == 0 and got[-1] == steps - 1
        gaps = [b - a for a, b in zip(got, got[1:], strict=False)]
        assert gaps == sorted(gaps, reverse=True), (steps, n, power, got)  # never wider toward the end
    assert m.placed_beat(7, 1, 4.0) == list(range(7))  # interval 1: every step
    assert m.placed_beat(10, 12, 1.3) == [0]  # an interval longer than the run: the first step only


def test_a_placed_beat_below_1_keeps_the_fixed_beats_span_and_places_its_steps_closer_toward_the_start():
    m = tc()
    assert m.placed_beat(28, 6, 0.8) == [0, 4, 10, 17, 24]  # the fixed beat's 0, 6, ..., 24: 24 (i/4)^1.25
    assert m.placed_beat(50, 9, 0.8) == [0, 6, 14, 24, 34, 45]
    for steps, n, power in ((20, 2, 0.5), (7, 1, 0.5), (28, 3, 0.8), (50, 12, 0.6), (5, 2, 0.5)):
        got = m.placed_beat(steps, n, power)
        k = -(-steps // n)
        assert len(got) == k and got == sorted(set(got)), (steps, n, power, got)  # rounding kept apart
        assert got[0] == 0 and got[-1] == n * (k - 1)  # the fixed beat's first and last computed steps
        gaps = [b - a for a, b in zip(got, got[1:], strict=False)]
        assert all(b >= a - 1 for a, b in zip(gaps, gaps[1:], strict=False)), (steps, n, power, got)  # rounding
        assert n == 1 or gaps[0] < gaps[-1], (steps, n, power, got)  # wider toward the end
    assert m.placed_beat(7, 1, 0.5) == list(range(7))  # interval 1: every step
    assert m.placed_beat(10, 12, 0.8) == [0]  # an interval longer than the run: the first step only


def test_a_placed_beat_computes_its_steps_per_cond_and_forecasts_across_its_uneven_gaps():
    """interval_power above 1: each call belongs to the step of the nearest sigma, and computes there only
    (per cond, cond and uncond alike); a first-order forecast of values linear in the call index is exact
    across gaps of 5, 3 and 1 calls, so the forecasts count the calls in between right."""
    m = tc()
    sigmas = [1.0 - i / 10 for i in range(11)]
    rs = m.RunState(m.StepCacheConfig(None, "test", 3.0, residual_mode="taylorseer1", rule="interval",
                                      interval_power=2.0), None, 1.0, 0.0)
    assert rs.set_beat(sigmas) == [0, 5, 8, 9]
    line = [2.0 + 0.5 * i for i in range(10)]
    got = []
    for i, sigma in enumerate(sigmas[:-1]):
        skip = rs.decide(["a", "b"], ["cond", "uncond"], [torch.ones(1, 2, 2)] * 2, True,
                         sigma=torch.tensor(sigma + 0.01))  # off the step's sigma: the nearest one counts
        if skip:
            got.append(float(rs.residual("a", torch.zeros(1, 2, 2)).flatten()[0]))
        else:
            for key in ("a", "b"):
                rs.store_residual(key, torch.full((1, 2, 2), line[i]))
    assert "".join(rs.conds["a"].pattern) == "".join(rs.conds["b"].pattern) == "CSSSSCSSCC"
    assert got[:4] == [2.0] * 4  # one computed value: reused
    assert got[4:] == pytest.approx([line[6], line[7]], abs=1e-6)
    assert rs.summary()["interval_power"] == 2.0


def test_taylorseer_is_a_taylor_series_in_steps_with_backward_difference_derivatives():
    # linear in the call index: order 1 (and order 2, whose D2 is then 0) forecast it exactly
    line = [2.0 + 0.5 * i for i in range(10)]
    for mode in ("taylorseer1", "taylorseer2"):
        got, _ = drive(mode, line, "CSSCSSCSSS")
        assert got[2:] == pytest.approx([line[i] for i in (4, 5, 7, 8, 9)], abs=1e-6)
        assert got[:2] == [2.0, 2.0]  # one computed call: reuse
    # F(i) = i^2 computed at calls 0, 3, 6: D1(3) = 9 / 3 = 3, D1(6) = 27 / 3 = 9, D2 = (9 - 3) / 3 = 2.
    # At 4, 5 only D1 exists: 9 + 3d. At 7, 8: 36 + 9d + 2 d^2 / 2 = 46, 58 (not 49, 64: the backward
    # D1 is the slope at 4.5, not 6; a Newton form through the three points would give those)
    square = [float(i * i) for i in range(9)]
    got, _ = drive("taylorseer2", square, "CSSCSSCSS", interval=3.0)
    assert got == pytest.approx([0.0, 0.0, 12.0, 15.0, 46.0, 58.0], abs=1e-5)
    got, _ = drive("taylorseer1", square, "CSSCSSCSS", interval=3.0)
    assert got == pytest.approx([0.0, 0.0, 12.0, 15.0, 45.0, 54.0], abs=1e-5)
    # computed one call apart (0, 1, 2): D1 = 3, D2 = 2; at 3: 4 + 3 + 1 = 8, at 4: 4 + 6 + 4 = 14
    got, _ = drive("taylorseer2", square[:5], "CCCSS")
    assert got == pytest.approx([8.0, 14.0], abs=1e-5)


@pytest.mark.parametrize("mode", ["foca", "output"])  # output: the same update on the model's output
def test_foca_predicts_from_the_two_newest_values_and_corrects_toward_the_computed_slope(mode):
    # linear, two computed calls in a row: every later forecast (and the rolling pair it feeds) is exact
    line = [2.0 + 0.5 * i for i in range(9)]
    got, _ = drive(mode, line, "CCSSSCSSS")
    assert got == pytest.approx([line[i] for i in (2, 3, 4, 6, 7, 8)], abs=1e-6)
    # by hand, computed at 0, 2, 5 (values 0, 4, 25): call 1 knows one value: reuse 0, the rolling pair
    # (0, 0). Call 2 computes 4: backward slope 4 - 0 = 4 per call, computed slope D1 = (4 - 0) / 2 = 2,
    # BDF2's predictor rate (4 + 2 * 2) / 3 = 8/3 (F'(k) = D1 at a computed call). Call 3: the Heun
    # rate (8/3 + 2) / 2 = 7/3, 4 + 7/3 = 19/3. Call 4: rate (7/3 + 2) / 2 = 13/6, 19/3 + 13/6 = 8.5.
    # Call 5 computes 25: backward slope 25 - 8.5 = 16.5, D1 = (25 - 4) / 3 = 7, predictor rate
    # (16.5 + 14) / 3 = 61/6. Call 6: rate (61/6 + 7) / 2 = 103/12, 25 + 103/12 = 403/12
    values = [0.0, None, 4.0, None, None, 25.0, None]
    got, rs = drive(mode, values, "CSCSSCS")
    assert got == pytest.approx([0.0, 19 / 3, 8.5, 403 / 12], abs=1e-5)
    state = rs.conds["a"]
    assert (state.step_index, state.rolling_index) == (5, 6)
    assert float(state.rolling_slope.flatten()[0]) == pytest.approx(103 / 12)
    # the error a stretch ends with reaches the next one's forecasts by at most a third: a line whose
    # first stretch is reused (the forecast at call 3 errs by 3) is forecast at calls 5-7 within 1 of it
    line = [float(i) for i in range(8)]
    got, _ = drive(mode, line, "CSSSCSSS")
    assert max(abs(g - v) for g, v in zip(got[3:], line[5:], strict=True)) <= 1.0 + 1e-6
    assert got[3:] != pytest.approx(line[5:])  # not exact: the reused stretch's error is still felt
    # the schedule rule's check at a computed call reads a forecast and moves nothing
    rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], False)
    before = (state.rolling_index, float(state.rolling.flatten()[0]))
    rs.residual("a", torch.zeros(1, 2, 2))
    assert (state.rolling_index, float(state.rolling.flatten()[0])) == before


@pytest.mark.parametrize("mode", ["taylorseer2", "foca", "output"])
def test_the_step_forecasts_keep_a_cpu_cache_bit_equal_and_report_their_bytes(mode):
    """cache_device cpu: the differences and foca's forecasts are made on the device and copied without
    waiting (a copy still in flight is never read); every tensor a forecast needs counts in
    residual_bytes, once."""
    values = [float(i * i) for i in range(9)]
    got = {}
    for device in ("device", "cpu"):
        with InFlightCopies():
            got[device] = drive(mode, values, "CSSCSSCSS", interval=3.0, device=device)
    assert got["cpu"][0] == got["device"][0] and all(v == v for v in got["cpu"][0])
    # taylorseer2: F, D1, D2; foca, output: F, D1, the newest forecast and its rolling slope ((1, 2, 2) floats)
    for _, rs in got.values():
        assert sum(rs.residual_bytes().values()) == (3 if mode == "taylorseer2" else 4) * 2 * 2 * 4


def magcache_state(thresh, ratios, sigmas, max_skips=0):
    m = tc()
    cfg = m.StepCacheConfig(None, "test", thresh, max_consecutive_skips=max_skips, rule="magcache")
    return m.RunState(cfg, None, 1.0, 0.0, {"cond": m.magnitude_curve(sigmas, ratios)})


def run_magcache(rs, sigmas):
    x = torch.ones(1, 4, 8)
    out = []
    for s in sigmas:
        skip = rs.decide(["a"], ["cond"], [x], True, sigma=torch.tensor(s))
        if not skip:
            rs.store_residual("a", torch.zeros(1, 4, 8), torch.tensor(s))
        out.append("S" if skip else "C")
    return "".join(out), [round(float(v), 4) for v in rs.conds["a"].trace]


def test_magcache_decides_as_worked_out_by_hand():
    """Calibrated ratios 0.9, 0.95, 1.0, 0.75, 1.0 after the first call, threshold 0.2: the ratio and
    the error |1 - ratio| accumulate since the last computed call, which resets both."""
    sigmas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    ratios = [1.0, 0.9, 0.95, 1.0, 0.75, 1.0]
    pattern, trace = run_magcache(magcache_state(0.2, ratios, sigmas), sigmas)
    # call 1: 0.1 < 0.2 skip; call 2: 0.1 + |1 - 0.9 * 0.95| = 0.245 compute; call 3: 0 skip;
    # call 4: 0 + |1 - 0.75| = 0.25 compute; call 5: 0 skip
    assert pattern == "CSCSCS"
    assert trace == pytest.approx([0.0, 0.1, 0.245, 0.0, 0.25, 0.0], abs=1e-4)
    # K (max_consecutive_skips) = 1 on ratios of exactly 1: every other call computes
    flat = [1.0] * 6
    assert run_magcache(magcache_state(0.2, flat, sigmas, max_skips=1), sigmas)[0] == "CSCSCS"
    # another schedule: a call two calibrated steps later reads their product (0.9 * 0.95), by sigma
    pattern, trace = run_magcache(magcache_state(0.2, ratios, sigmas), [1.0, 0.8, 0.75])
    assert pattern == "CSC" and trace == pytest.approx([0.0, 0.145, 0.29], abs=1e-4)
    # halfway between calibrated sigmas the log magnitude is interpolated (the square root of 0.75)
    pattern, trace = run_magcache(magcache_state(0.2, ratios, sigmas), [1.0, 0.65])
    assert pattern == "CC" and trace[1] == pytest.approx(abs(1 - 0.9 * 0.95 * 0.75 ** 0.5), abs=1e-4)


def test_published_magcache_ratios_are_placed_on_their_schedules_sigmas():
    m = tc()
    flux = m.published_magnitudes("flux")
    assert set(flux) == {"cond"} and len(flux["cond"]) == 28
    curve = m.MagnitudeCurve(flux["cond"])
    s0, s1 = flux["cond"][0][0], flux["cond"][1][0]
    assert s0 == pytest.approx(1.0) and 0 < s1 < s0
    assert float(curve.ratio(torch.tensor(s0), torch.tensor(s1))) == pytest.approx(1.21094, rel=1e-5)
    wan = m.published_magnitudes("wan2.1_t2v_1.3B_ret_mode")
    assert set(wan) == {"cond", "uncond"} and len(wan["cond"]) == 50
    assert m.published_magnitudes("flux2") is None
    assert set(m.MAG_RATIOS) <= set(m.COEFFICIENTS) | {"chroma", "qwen_image"}


def test_first_block_compares_against_the_last_computed_calls_residual():
    m = tc()
    rs = m.RunState(m.StepCacheConfig(None, "test", 0.15, rule="first_block"), None, 1.0, 0.0)
    r1 = torch.ones(1, 4, 8)
    got = []
    for scale in (1.0, 1.1, 1.2, 1.05):
        skip = rs.decide(["a"], ["cond"], [r1 * scale], True)
        if not skip:
            rs.store_residual("a", torch.zeros(1, 4, 8))
        got.append(skip)
    # 1.1 vs 1.0: 0.1 skip; 1.2 vs 1.0 (not 1.1): 0.2 compute; 1.05 vs 1.2: 0.125 skip; never accumulated
    assert got == [False, True, False, True]
    assert [round(float(v), 4) for v in rs.conds["a"].trace] == [0.0, 0.1, 0.2, 0.125]


class InFlightCopies(torch.overrides.TorchFunctionMode):
    """Emulates CUDA's copies to the CPU without waiting (on a CPU-only run the sampling device is the
    CPU too, so the offload is told apart as ``.to("cpu")`` by name): such a copy reads as NaN to any
    op until it lands, and only a further copy (queued on the same stream) sees its data."""

    def __init__(self):
        super().__init__()
        self.landed = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and id(args[0]) in self.landed:  # a copy queued after it: sees the data
            args = (self.landed[id(args[0])][1], *args[1:])
        out = func(*args, **kwargs)
        to_cpu = "cpu" in (*args[1:], kwargs.get("device"))
        if func is torch.Tensor.to and kwargs.get("non_blocking") and to_cpu:
            in_flight = torch.full_like(out, float("nan"))
            self.landed[id(in_flight)] = (in_flight, out.clone())
            return in_flight
        return out


@pytest.mark.parametrize("mode", ["extrapolate", "taylor2"])
def test_a_cpu_cache_never_reads_a_copy_still_in_flight(mode):
    """cache_device cpu with a forecast: the differences are made on the device before the residual
    leaves it, so a copy to the CPU that has not landed yet is never read there."""
    m = tc()
    got = {}
    for device in ("device", "cpu"):
        cfg = m.StepCacheConfig(None, "test", 1.0, cache_device=device, residual_mode=mode)
        rs = m.RunState(cfg, (0, 0, 0, 1.0, 0), 1.0, 0.0)
        rs.decide(["a"], ["cond"], [torch.ones(1, 2, 2)], True)
        with InFlightCopies():
            for sigma in (1.2, 1.0, 0.8):  # r(s) = 6 - 5s + (s - 1)^2
                rs.store_residual("a", torch.full((1, 2, 2), 6 - 5 * sigma + (sigma - 1) ** 2),
                                  sigma=torch.tensor(sigma))
            got[device] = rs.residual("a", torch.zeros(1, 2, 2), torch.tensor(0.7))
    # taylor2: r(0.7) exactly; extrapolate: along the last slope, (2.04 - 1) / -0.2, from r(0.8)
    expected = 6 - 3.5 + 0.09 if mode == "taylor2" else 2.04 + 5.2 * 0.1
    assert torch.allclose(got["device"], torch.full((1, 2, 2), expected), atol=1e-5), got["device"]
    assert torch.equal(got["cpu"], got["device"])


def test_decide_respects_max_consecutive_skips_and_resets_on_a_shape_change():
    rs = run_state(thresh=10.0, max_skips=2)
    x = torch.ones(1, 4, 8)
    rs.decide(["a"], ["cond"], [x], True)
    rs.store_residual("a", torch.zeros(1, 4, 8))
    got = [rs.decide(["a"], ["cond"], [x * (1 + 0.01 * i)], True) for i in range(1, 7)]
    assert got == [True, True, False, True, True, False]
    # another shape: the old state is dropped and the call computes
    assert rs.decide(["a"], ["cond"], [torch.ones(1, 9, 8)], True) is False
    assert rs.resets == 1 and rs.conds["a"].residual is None


def test_decide_never_skips_onto_a_residual_of_another_shape():
    rs = run_state(thresh=10.0)
    x = torch.ones(1, 4, 8)
    rs.decide(["a"], ["cond"], [x], True, (1, 4, 8))
    rs.store_residual("a", torch.zeros(1, 4, 8))
    assert rs.decide(["a"], ["cond"], [x], True, (1, 6, 8)) is False  # e.g. Wan: same e0, more tokens
    assert rs.decide(["a"], ["cond"], [x], True, (1, 4, 8)) is True


def test_calibration_store_round_trips_through_its_file(tmp_path):
    m = tc()
    path = tmp_path / "cal.json"
    ident = rkharness.pack("caching.weights_identity").identity
    a = ident([("w", torch.arange(8.0))])
    b = ident([("w", torch.arange(8.0) + 1)])  # same structure, other weights
    cal, other = (m.Calibration((0.0, 0.0, 1.0, 2.0, 3.0), {"cond": [(1.0, 0.0), (0.5, 0.1)]}),
                  m.Calibration(None, {"cond": [(1.0, 0.0)]}))
    m.CalibrationStore(path).put("flux:" + a.structure, a, cal, family="flux")
    m.CalibrationStore(path).put("flux:" + a.structure, b, other, family="flux")
    fresh = m.CalibrationStore(path)
    assert fresh.get("flux:" + a.structure, a) == cal and fresh.get("flux:" + a.structure, b) == other
    assert fresh.get("wan:" + a.structure, a) is None
    path.write_text("not json")
    assert m.CalibrationStore(path).get("flux:" + a.structure, a) is None  # a broken file is a miss, never an error


# ---- on the trained Flux through the real KSampler ------------------------------------------

RULES = ("teacache", "magcache", "first_block", "interval", "adaptive")
SAME_INPUT_RULES = (*RULES, "schedule")  # the schedule rule needs a table to plan with; these calls give it a plan
MODES = ("reuse", "extrapolate", "taylor2", "taylorseer1", "taylorseer2", "foca", "output")
STEP_MODES = ("taylorseer1", "taylorseer2", "foca", "output")  # forecast in call index, not sigma
SAME_INPUT = [(r, m) for r in SAME_INPUT_RULES for m in MODES if (r, m) != ("schedule", "output")]  # refused
EXACT = {"interval": 1.0}  # the threshold that computes every call: 0, the interval 1
SKIPPING = {"interval": 2.0}  # a threshold under which a call on the last one's input skips: 1, the interval 2


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", MODES)
def test_threshold_zero_gives_exactly_the_uncached_latent(flux, conds, rule, mode):
    """(interval: its exact setting, 1)"""
    exact = EXACT.get(rule, 0.0)
    ref = sample(flux, conds)
    out = sample(teacache(flux, exact, rule=rule, mode=mode), conds)
    assert torch.equal(out, ref)
    run = last_run()
    assert run["calls_skipped"] == 0 and run["calls_computed"] == STEPS
    assert (run["rule"], run["threshold"], run["residual_mode"]) == (rule, exact, mode)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", MODES)
def test_every_rule_and_mode_skips_the_trained_flux_close_to_the_uncached_latent(flux, conds, rule, mode):
    ref = sample(flux, conds)
    thresh = {"teacache": 0.4, "magcache": 0.05, "first_block": 0.2, "interval": 3.0, "adaptive": 0.02}[rule]
    out = sample(teacache(flux, thresh, rule=rule, mode=mode), conds)
    run = last_run()
    assert run["calls_skipped"] >= 2, run["conds"]
    assert run["model_type"] == ("none" if rule in ("first_block", "interval", "adaptive") else "flux")
    for c in run["conds"].values():  # the panel's strip and trace: one entry per call, C first
        assert len(c["pattern"]) == len(c["trace"]) == STEPS and c["pattern"][0] == "C"
        skipped = [t for t, p in zip(c["trace"], c["pattern"]) if p == "S"]
        assert all(t < thresh for t in skipped)
    # taylor2's parabola through three computed calls three apart overshoots here (0.58 measured); the
    # step-index forecasts made for that beat stay under 0.2
    assert rel_err(out, ref) < (0.7 if (rule, mode) == ("interval", "taylor2") else 0.3), rel_err(out, ref)


def _controlled(conds, start: float, end: float):
    """``conds`` with a tiny ControlNetFlux (shaped as the trained Flux, weights from a seed) applied by
    ControlNetApplyAdvanced over ``start``-``end`` of the run."""
    import comfy.controlnet
    import comfy.ldm.flux.controlnet
    import comfy.ops

    import nodes

    trained = tiny_module("trained_flux")
    config = rkharness.TINY.with_host_fields(trained.CONFIG, "comfy.ldm.flux.model:FluxParams")
    net = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init, dtype=torch.float32,
                                                   **config)
    trained.init_weights(net, 5)
    control = comfy.controlnet.ControlNet(net, load_device=torch.device("cpu"), extra_conds=["y", "guidance"])
    image = torch.linspace(0, 1, 64 * 64 * 3).reshape(1, 64, 64, 3)
    return nodes.ControlNetApplyAdvanced().apply_controlnet(*conds, control, image, 0.3, start, end)


def _keyframed(flux, conds, keyframes):
    """``conds`` with a scheduled LoRA (a hook of perturbed weights on the later blocks), its strength set by
    ``keyframes`` [(strength, start_percent)]."""
    import comfy.hooks

    g = torch.Generator().manual_seed(11)
    weights = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) for k, v in flux.model.state_dict().items()
               if k.startswith("diffusion_model.single_blocks.")}
    group = comfy.hooks.create_hook_model_as_lora(weights, None, 1.0, 0.0)
    frames = comfy.hooks.HookKeyframeGroup()
    for strength, start in keyframes:
        frames.add(comfy.hooks.HookKeyframe(strength=strength, start_percent=start))
    group.set_keyframes_on_hooks(frames)
    return [comfy.hooks.set_hooks_for_conditioning(c, group) for c in conds]


def test_a_controlnet_or_lora_switching_within_the_run_starts_each_cond_over(flux, conds):
    """A skipped call adds what earlier calls made: a ControlNet whose range fell on skipped steps was lost
    whole (the defaults' latent bit-identical to the run without it), one that ended was carried on, and a
    scheduled LoRA alike. Where a ControlNet's range or a hook's keyframe begins or ends, each cond starts over
    with a computed call (counted), the interval rule's beat going on in step; runs where nothing switches keep
    their pattern."""
    pattern = lambda: {"".join(c["pattern"]) for c in last_run()["conds"].values()}  # noqa: E731
    defaults = lambda: N().TeaCacheNode.execute(model=flux).args[0]  # noqa: E731
    reasons = lambda: sum(r["count"] for r in P().stats().snapshot()["reasons"]  # noqa: E731
                          if "a ControlNet's range or a hook's keyframe began or ended" in r["reason"])
    plain = sample(defaults(), conds)
    plain_pattern = pattern()
    assert plain_pattern == {"CSSCSSCSCS"}  # step 5 is skipped without the ControlNet
    counted = reasons()
    windowed = sample(defaults(), _controlled(conds, 0.45, 0.55))  # on at step 5 only
    assert {p[5:7] for p in pattern()} == {"CC"} and reasons() == counted + 2  # on at 5, off at 6: computed
    assert not torch.equal(windowed, plain)
    # starting on step 5's sigma, which ComfyUI's range check compares in float32 (in float64 it read "off")
    assert not torch.equal(sample(defaults(), _controlled(conds, 0.5, 0.55)), plain)
    assert {p[5:7] for p in pattern()} == {"CC"}
    sample(defaults(), _controlled(conds, 0.0, 1.0))  # on throughout: nothing switches
    assert pattern() == plain_pattern
    # the interval rule: ending at 0.65 (after step 6), step 7 computes and the beat keeps the last step
    interval = teacache(flux, 3, rule="interval", mode="reuse")
    base = rel_err(sample(interval, conds), sample(flux, conds))
    assert pattern() == {"CSSCSSCSSC"}
    controlled = _controlled(conds, 0.0, 0.65)
    ended = rel_err(sample(interval, controlled), sample(flux, controlled))
    assert pattern() == {"CSSCSSCCSC"} and ended < 1.2 * base, (ended, base)
    keyed = _keyframed(flux, conds, [(1.0, 0.0), (0.0, 0.65)])  # a LoRA off after step 6
    off = rel_err(sample(interval, keyed), sample(flux, keyed))
    assert pattern() == {"CSSCSSCCSC"} and off < 1.2 * base, (off, base)


def _denoised_per_step(model, conds, sampler, steps=STEPS, seed=3):
    """(the latent, the denoised picture the sampler was handed at each step) of a run of ``sampler`` (a name,
    or a sampler node's output, run as SamplerCustom runs it)."""
    import comfy.sample
    import comfy.samplers

    seen = []
    latent = torch.zeros((1, 16, 8, 8))
    noise = comfy.sample.prepare_noise(latent, seed)
    callback = lambda step, x0, x, total: seen.append(x0.clone())  # noqa: E731
    if isinstance(sampler, str):
        out = comfy.sample.sample(model, noise, steps, 3.0, sampler, "simple", *conds, latent, seed=seed,
                                  callback=callback)
    else:
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", steps)
        out = comfy.sample.sample_custom(model, noise, 3.0, sampler, sigmas, *conds, latent, seed=seed,
                                         callback=callback)
    return out, seen


def test_samplers_that_add_noise_without_a_noise_sampler_and_flow_models_of_other_maths(flux, conds):
    """SamplerLCMUpscale adds its own noise (it takes no noise sampler): its run kept the velocity forecast.
    Wan FlowRVS's model sampling is a CONST whose denoised picture is the output itself: read as the input
    less sigma times the output, a skip handed the sampler another picture. Both now follow the denoised
    picture as the sampler reads it: a skip where the forecast is the last computed value gives that call's."""
    import comfy.model_sampling
    from comfy_extras.nodes_advanced_samplers import SamplerLCMUpscale

    upscale = SamplerLCMUpscale.execute(1.0, -1, "nearest-exact").args[0]
    _, denoised = _denoised_per_step(teacache(flux, 3.0, rule="interval", mode="output"), conds, upscale, steps=20)
    assert rel_err(denoised[1], denoised[0]) < 1e-5 and rel_err(denoised[2], denoised[0]) < 1e-5
    other = getattr(comfy.model_sampling, "IMG_TO_IMG_FLOW", None)
    if other is None:
        pytest.skip("this ComfyUI has no IMG_TO_IMG_FLOW (Wan FlowRVS, ComfyUI 0.33)")
    sampling = type("FlowRVSSampling", (comfy.model_sampling.ModelSamplingFlux, other), {})(flux.model.model_config)
    sampling.set_parameters(shift=flux.get_model_object("model_sampling").shift)
    rvs = flux.clone()
    rvs.add_object_patch("model_sampling", sampling)
    _, denoised = _denoised_per_step(teacache(rvs, 3.0, rule="interval", mode="output"), conds, "euler_ancestral",
                                     steps=20)
    assert rel_err(denoised[1], denoised[0]) < 1e-5 and rel_err(denoised[2], denoised[0]) < 1e-5


@pytest.mark.parametrize("sampler", ["euler_ancestral", "dpmpp_2m_sde", "lcm"])
def test_under_a_sampler_that_adds_noise_the_output_forecast_holds_the_denoised_picture(flux, conds, sampler):
    """An ancestral or SDE sampler adds noise between calls. The output forecast carried the model's output
    over it, so a skipped call took the new noise for the picture: with the defaults, on this Flux at 20
    steps, 0.26 (euler ancestral), 0.32 (dpmpp_2m_sde) and 0.41 (lcm) from the uncached latent, 0.04 with
    euler. It now holds the denoised picture of the last computed call and hands the sampler the output that
    gives it from the call's own input, whatever noise the sampler added; a step in 3 of 20 lands nearer the
    uncached latent than before (ComfyUI 0.33: 0.11, 0.19 and 0.25 against 0.36, 0.95 and 1.90; 0.3.75, whose
    ancestral noise differs: 0.23, 0.19 and 0.32 against 0.41, 0.95 and 1.90)."""
    reference, _ = _denoised_per_step(flux, conds, sampler, steps=20)
    cached, denoised = _denoised_per_step(teacache(flux, 3.0, rule="interval", mode="output"), conds, sampler,
                                          steps=20)
    (pattern,) = {c["pattern"] for c in last_run()["conds"].values()}
    assert pattern == "CSSCSSCSSCSSCSSCSSCS"
    for step, kind in enumerate(pattern):
        computed = pattern.rindex("C", 0, step + 1)
        assert rel_err(denoised[step], denoised[computed]) < 1e-5 if kind == "S" else computed == step
    assert sum(last_run()["peak_residual_bytes"].values()) == 2 * cached[0].numel() * 4  # a picture per cond, no rates
    bound = {"euler_ancestral": 0.3, "dpmpp_2m_sde": 0.5, "lcm": 0.8}[sampler]  # between before and now, both hosts
    assert rel_err(cached, reference) < bound, rel_err(cached, reference)


@pytest.mark.parametrize("mode", ["extrapolate", "taylorseer1", "foca"])
def test_under_a_sampler_that_adds_noise_a_residual_forecast_holds_the_last_computed_residual(flux, conds, mode):
    """Between calls that add noise, the residuals' rates carry that noise: a forecast along them overshot (on
    the tiny trained Wan with its defaults, extrapolate, at 20 steps: 14.8 dB under lcm, 24.2 under euler
    ancestral, where holding the residual reads 21.1 and 29.0). Such a run holds the last computed residual,
    as ``reuse`` does, counted; under euler the forecast stays."""
    def run(sampler, residual_mode):
        out, _ = _denoised_per_step(teacache(flux, 3.0, rule="interval", mode=residual_mode), conds, sampler, steps=20)
        return out

    def held():
        return sum(r["count"] for r in P().stats().snapshot()["reasons"]
                   if r["reason"].startswith(f"the sampler adds noise between its calls: residual_mode {mode} held"))

    before = held()
    assert torch.equal(run("euler_ancestral", mode), run("euler_ancestral", "reuse"))
    assert held() == before + 1
    assert not torch.equal(run("euler", mode), run("euler", "reuse")) and held() == before + 1
    # res_multistep takes a noise sampler but calls its solver with eta 0: it was taken for one adding noise
    assert not torch.equal(run("res_multistep", mode), run("res_multistep", "reuse")) and held() == before + 1
    import comfy.samplers

    assert [P()._adds_noise(comfy.samplers.sampler_object(name)) for name in
            ("res_multistep", "res_multistep_cfg_pp", "res_multistep_ancestral")] == [False, False, True]


@pytest.mark.parametrize("cut_at", [4, 5])
def test_a_call_an_interrupt_cuts_off_counts_in_the_run_as_in_its_conds(flux, conds, monkeypatch, cut_at):
    """An interrupt inside a model call, after its conds counted it (computed or skipped): the run's count left
    it out, so the report's calls disagreed with its conds' by one."""
    import comfy.model_management

    final = flux.model.diffusion_model.final_layer
    seen = []

    def cut(x, *args, **kwargs):  # the final layer runs on computed and skipped calls alike
        seen.append(1)
        if len(seen) == cut_at:
            raise comfy.model_management.InterruptProcessingException()
        return type(final).forward(final, x, *args, **kwargs)

    monkeypatch.setattr(final, "forward", cut)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        sample(teacache(flux, 3.0, rule="interval", mode="reuse"), conds)
    run = last_run()
    (pattern,) = {c["pattern"] for c in run["conds"].values()}
    assert run["outcome"] == "interrupted" and len(pattern) == cut_at
    assert (run["calls_computed"], run["calls_skipped"]) == (pattern.count("C"), pattern.count("S"))


@pytest.mark.parametrize("batch", [1, 2])
def test_nag_keeps_the_whole_batch_where_the_schedule_rule_would_compute_the_cond_alone(flux, conds, batch):
    """NAG's attention patch reads the batch's conds by ``cond_or_uncond`` inside the blocks. A cond-only step
    cut the blocks' inputs to the cond's rows with ``cond_or_uncond`` still naming the uncond: NAG was left out
    (batch 1) or took the second picture's cond for the first's negative (batch 2); at a threshold where
    nothing is skipped the latent was 0.41 / 0.71 from NAG's own. Such a call computes whole, counted, and
    gives NAG's latent."""
    nag = pytest.importorskip("comfy_extras.nodes_nag", reason="this ComfyUI has no NAG")
    nagged = nag.NAGuidance.execute(flux, nag_scale=5.0, nag_alpha=0.5, nag_tau=2.5).args[0]
    shape = (batch, 16, 8, 8)
    counted = sum(r["count"] for r in P().stats().snapshot()["reasons"] if "patch (NAG's)" in r["reason"])
    want = sample(nagged, conds, cfg=1.0, shape=shape)
    got = sample(teacache(nagged, 1e-4, rule="schedule", mode="reuse"), conds, cfg=1.0, shape=shape)
    assert rel_err(got, want) < 1e-6, rel_err(got, want)
    assert sum(r["count"] for r in P().stats().snapshot()["reasons"] if "patch (NAG's)" in r["reason"]) > counted
    # the patches a model patch's ControlNet sets run on the whole batch outside the blocks: the step stays
    hints = {name: [print] for name in ("double_block", "post_input", "noise_refiner")}  # ZImageFunControlnet's
    assert P()._batch_patch({"patches": hints}) is None
    assert "'attn1_patch' patch: it runs inside" in P()._batch_patch({"patches": {**hints, "attn1_patch": [print]}})


def test_a_step_cache_applied_again_replaces_the_first_and_says_so(flux, conds, caplog):
    """Two Step Cache nodes in a chain (or a Cached KSampler after one): the later settings replace the
    earlier, never stack, which the stats did not say. The replacement is counted in one row whatever the
    settings (a Cached KSampler applies at every prompt: a row per threshold would fill the bounded table),
    the two settings logged once; a second node that is refused replaced nothing and is not counted. The run
    is the later node's alone."""
    again = lambda: [r["count"] for r in P().stats().snapshot()["reasons"]  # noqa: E731
                     if r["reason"].startswith("ReuseKit Step Cache on a model that had it")]
    with caplog.at_level(logging.INFO, logger="reusekit"):
        twice = teacache(teacache(flux, 0.4), 0.3, rule="first_block", mode="reuse")
    assert again() == [1]
    assert any("(first_block 0.3, reuse) replace the earlier (teacache 0.4, extrapolate)" in r.getMessage()
               for r in caplog.records)
    for threshold in (0.1, 0.2, 0.5):
        teacache(teacache(flux, 0.4), threshold)
    assert again() == [4]
    with pytest.raises(ValueError, match="first_blocks"):
        teacache(teacache(flux, 0.4), 0.3, rule="first_block", mode="reuse", first_blocks=1000)
    assert again() == [4]
    assert torch.equal(sample(twice, conds), sample(teacache(flux, 0.3, rule="first_block", mode="reuse"), conds))


def test_auto_takes_the_familys_rule_threshold_and_mode(flux, conds):
    (m,) = N().TeaCacheNode.execute(model=flux, rule="auto", threshold=-1.0, model_type="auto", start_percent=0.0,
                                    end_percent=1.0, max_consecutive_skips=0, cache_device="device",
                                    residual_mode="auto").args
    sample(m, conds)
    rule, anchors, mode = tc().FAMILY_DEFAULTS["flux"]
    run = last_run()
    assert (run["rule"], run["threshold"], run["residual_mode"]) == (rule, tc().default_threshold(anchors, STEPS), mode)
    sample(m, conds, steps=50)  # more steps bear a larger threshold: the run's own count picks it
    assert last_run()["threshold"] == anchors[-1][1] > run["threshold"]
    assert "rel_l1_thresh" not in run
    sample(teacache(flux, -1.0, rule="first_block", mode="auto"), conds)  # -1 with a rule: that rule's default
    run = last_run()
    assert run["threshold"] == tc().RULE_THRESHOLDS["flux"]["first_block"] and run["residual_mode"] == mode


@pytest.mark.parametrize("rule,thresh", [("interval", 3.0), ("first_block", 0.25)])
@pytest.mark.parametrize("model_type", ["calibrated", "flux"])
def test_a_model_type_the_rule_does_not_read_is_said_and_changes_nothing(flux, conds, rule, thresh, model_type):
    """First-Block and the interval rule read no table: a model_type set beside them (a calibration asked for,
    or published coefficients) runs as ``auto`` does, and the stats say it was not read, naming the node."""
    expected = sample(teacache(flux, thresh, model_type="auto", rule=rule, mode="reuse"), conds)
    P().stats().reset_counters()
    assert torch.equal(sample(teacache(flux, thresh, model_type=model_type, rule=rule, mode="reuse"), conds), expected)
    (row,) = P().stats().reasons()
    assert (row["event"], row["source"], row["count"]) == ("fallback", "ReuseKit Step Cache", 1), row
    assert f"model_type: '{model_type}' is not read by rule {rule}" in row["reason"], row


def test_the_rule_threshold_and_mode_the_log_names_give_the_defaults_picture(flux, conds, caplog):
    """The defaults mean the installed version's (README "Compatibility"): the run's log line names the rule,
    threshold and mode they resolved to, exactly, and a node set to them samples the same latent, so a
    workflow keeps its picture across an update. At 39 steps the threshold lies between two anchors."""
    import re

    (m,) = N().TeaCacheNode.execute(model=flux).args
    with caplog.at_level(logging.INFO, logger="reusekit"):
        auto = sample(m, conds, steps=39)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ReuseKit Step Cache (flux")]
    rule, threshold, mode = re.match(r"ReuseKit Step Cache \(flux, \w+, (\w+) (\S+), (\w+)\)", line).groups()
    assert float(threshold) == last_run()["threshold"] not in [t for _, t in tc().FAMILY_DEFAULTS["flux"][1]]
    # and the widget takes it as it is: the front end rounds a typed value to the input's round (else to its step's
    # decimals: 0.5839 became 0.58 and another picture)
    (widget,) = [i for i in N().TeaCacheNode.define_schema().inputs if i.id == "threshold"]
    assert widget.round is not None and float(threshold) == round(round(float(threshold) / widget.round) * widget.round, 10)
    for anchors in (a for _, a, _ in tc().FAMILY_DEFAULTS.values()):
        assert all(abs(t / widget.round - round(t / widget.round)) < 1e-6
                   for t in (tc().default_threshold(anchors, n) for n in range(1, 101)))
    assert torch.equal(sample(teacache(flux, float(threshold), rule=rule, mode=mode, model_type="auto"), conds,
                              steps=39), auto)


def test_the_default_threshold_follows_the_step_count_between_its_anchors():
    anchors = ((20, 0.3), (28, 0.5), (50, 0.7))
    got = [tc().default_threshold(anchors, n) for n in (None, 4, 20, 24, 28, 39, 50, 80)]
    assert got == [0.3, 0.3, 0.3, 0.4, 0.5, 0.6, 0.7, 0.7]
    for rule, family_anchors, mode in tc().FAMILY_DEFAULTS.values():  # ascending, never lower with more steps
        assert rule == "teacache" and mode in tc().RESIDUAL_MODES
        assert [n for n, _ in family_anchors] == sorted({n for n, _ in family_anchors})
        assert [t for _, t in family_anchors] == sorted(t for _, t in family_anchors)


def test_a_high_threshold_skips_steps_and_reports_them(flux, conds, caplog):
    ref = sample(flux, conds)
    with caplog.at_level(logging.INFO, logger="reusekit"):
        out = sample(teacache(flux, 0.8), conds)
    run = last_run()
    assert run["calls_skipped"] >= 3 and run["calls_computed"] + run["calls_skipped"] == STEPS
    assert set(run["conds"]) == {"cond", "uncond"}
    for c in run["conds"].values():
        assert c["skipped"] == run["calls_skipped"] and len(c["trace"]) == STEPS
        assert c["pattern"][0] == "C" and c["pattern"].count("S") == c["skipped"]
    lines = [r.getMessage() for r in caplog.records if "ReuseKit Step Cache (flux" in r.getMessage()]
    assert len(lines) == 1 and f"computed {run['calls_computed']} of {STEPS}" in lines[0]
    assert not torch.equal(out, ref) and rel_err(out, ref) < 0.5  # approximate, not broken
    snap = P().stats().snapshot()
    assert snap["kind"] == "step" and snap["counters"]["calls_skipped"] >= 3


def test_cond_and_uncond_keep_separate_distances_under_cfg(flux, conds):
    sample(teacache(flux, 0.4), conds, cfg=4.0)
    traces = {k: v["trace"] for k, v in last_run()["conds"].items()}
    assert set(traces) == {"cond", "uncond"}
    assert traces["cond"] != traces["uncond"]


def test_an_area_cond_and_the_uncond_core_makes_for_it_keep_separate_state(flux, conds):
    """For a cond with an area ComfyUI adds an uncond of that area carrying the cond's uuid, batched
    with it: one state for both would hand the uncond the cond's residual on a skip. The report lists each
    state (it showed the last of each label)."""
    import nodes

    (area,) = nodes.ConditioningSetArea().append(conds[0], 32, 32, 0, 0, 1.0)
    (pos,) = nodes.ConditioningCombine().combine(conds[0], area)
    sample(teacache(flux, 0.6), (pos, conds[1]))
    run = last_run()
    assert run["calls_skipped"] >= 1
    assert all(len(c["pattern"]) == STEPS for c in run["conds"].values()), run["conds"]
    assert set(run["conds"]) == {"cond", "uncond", "cond#2", "uncond#2"}  # the area's call is one of its own
    # such a batch twice on the same input: the skipped second call gives each half its own output
    m = teacache(flux, 1.0, mode="reuse")
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5, 0.5])
    context = torch.cat([conds[1][0][0], conds[0][0][0]])
    pooled = torch.cat([conds[1][0][1]["pooled_output"], conds[0][0][1]["pooled_output"]])
    to = m.model_options["transformer_options"].copy()
    to.update({"wrappers": m.wrappers, "sigmas": sigma, "uuids": ["u", "u"], "cond_or_uncond": [1, 0],
               P().RUN_KEY: call_state(to)})
    with torch.inference_mode():
        computed = m.model.apply_model(x, sigma, c_crossattn=context, y=pooled, transformer_options=to)
        to["sigmas"] = sigma.clone()  # the next step: a timestep tensor of its own, as a sampler makes one
        skipped = m.model.apply_model(x, sigma, c_crossattn=context, y=pooled, transformer_options=to)
    assert torch.allclose(skipped, computed, atol=1e-5), rel_err(skipped, computed)
    assert all(s.pattern == ["C", "S"] for s in to[P().RUN_KEY].conds.values())


def test_start_and_end_percent_bound_where_steps_may_be_skipped(flux, conds):
    import comfy.samplers

    ms = flux.get_model_object("model_sampling")
    sigmas = comfy.samplers.calculate_sigmas(ms, "simple", STEPS)[:-1].tolist()
    for start, end in ((0.4, 1.0), (0.0, 0.6)):
        sample(teacache(flux, 5.0, start=start, end=end), conds)
        pattern = last_run()["conds"]["cond"]["pattern"]
        lo, hi = ms.percent_to_sigma(end), ms.percent_to_sigma(start)
        allowed = [lo < s <= hi for s in sigmas]
        assert all(p == "C" for p, ok in zip(pattern, allowed) if not ok), (start, end, pattern)
        assert "S" in pattern and not all(allowed)


@pytest.mark.parametrize("mode", STEP_MODES)
def test_interval_computes_every_nth_step_per_cond_in_the_window_and_a_cpu_cache_agrees(flux, conds, mode):
    """Rule interval through the real KSampler, cond and uncond under CFG: threshold -1 is the interval 3;
    a start_percent computes every step before it, the beat starts from the last of them, and
    max_consecutive_skips caps it; cache_device cpu gives the same latent."""
    import comfy.samplers

    on_device = sample(teacache(flux, -1.0, rule="interval", mode=mode), conds)
    run = last_run()
    assert (run["rule"], run["threshold"], run["residual_mode"], run["model_type"]) == ("interval", 3.0, mode, "none")
    assert {lab: c["pattern"] for lab, c in run["conds"].items()} == {"cond": "CSSCSSCSSC", "uncond": "CSSCSSCSSC"}
    assert torch.equal(sample(teacache(flux, 3.0, rule="interval", mode=mode, device="cpu"), conds), on_device)
    ms = flux.get_model_object("model_sampling")
    sigmas = comfy.samplers.calculate_sigmas(ms, "simple", STEPS)[:-1].tolist()
    first = sum(s > ms.percent_to_sigma(0.3) for s in sigmas)  # steps before the window
    assert 0 < first < STEPS - 4
    sample(teacache(flux, 4.0, rule="interval", mode=mode, start=0.3), conds)
    assert last_run()["conds"]["cond"]["pattern"] == ("C" * first + "SSSC" * STEPS)[:STEPS]
    sample(teacache(flux, 4.0, rule="interval", mode=mode, max_skips=2), conds)
    assert last_run()["conds"]["cond"]["pattern"] == "CSSCSSCSSC"


@pytest.mark.parametrize("mode", ["output", "taylorseer1", "extrapolate"])
def test_the_adaptive_rule_through_the_sampler_computes_where_its_checks_say(flux, conds, mode):
    """Rule adaptive through the real KSampler, cond and uncond under CFG: it reads no table; no call skips
    before the first check, and from it on every computed call is checked (a stretch of one call too); the
    cond's next computed call comes after the beat a check set (or sooner, where the uncond's own beat ends
    first); a smaller threshold computes more and comes closer to the uncached latent; cache_device cpu gives
    the same latent."""
    sample(teacache(flux, -1.0, rule="adaptive", mode=mode), conds)  # -1: the family's default for the rule
    assert last_run()["threshold"] == tc().RULE_THRESHOLDS["flux"]["adaptive"]
    ref = sample(flux, conds, steps=20)
    errors, computed = {}, {}
    for threshold in (0.002, 0.05):
        out = sample(teacache(flux, threshold, rule="adaptive", mode=mode), conds, steps=20)
        run = last_run()
        assert (run["rule"], run["threshold"], run["residual_mode"], run["model_type"]) == (
            "adaptive", threshold, mode, "none")
        pattern, checks = run["conds"]["cond"]["pattern"], run["conds"]["cond"]["checks"]
        assert checks and run["conds"]["uncond"]["checks"]
        marks = [i for i, p in enumerate(pattern) if p == "C"]
        assert "S" not in pattern[:checks[0][0]] and [c[0] for c in checks] == [i for i in marks if i >= checks[0][0]]
        for index, stretch, error, beat in checks:
            assert pattern[index] == "C" and index - stretch in marks and stretch >= 1 and error >= 0
            later = [i for i in marks if i > index]
            if later:
                assert later[0] - index <= round(beat)
        assert run["conds"]["uncond"]["pattern"] == pattern  # a call skips every cond or none
        errors[threshold], computed[threshold] = rel_err(out, ref), len(marks)
        assert torch.equal(sample(teacache(flux, threshold, rule="adaptive", mode=mode, device="cpu"), conds,
                                  steps=20), out)
    assert computed[0.002] > computed[0.05] and errors[0.002] < errors[0.05] < 0.3, (computed, errors)


def test_the_adaptive_rule_under_a_sampler_that_adds_noise_checks_the_held_picture_whole(flux, conds):
    """Under a sampler that adds noise the output forecast holds the denoised picture, which the sampler rebuilds
    the latent from with new noise: its error reaches the latent whole. Scaled by the stretch's span in sigma
    (about 0.07 a step here) it read 14 times smaller, and the rule skipped every other call under LCM: 0.65
    from the uncached latent here on ComfyUI 0.33. Read whole, the picture strays by more than the threshold at
    almost every check here, so the rule computes."""
    import nodes

    def run(model):
        (out,) = nodes.common_ksampler(model, 3, 28, 3.0, "lcm", "simple", *conds,
                                       {"samples": torch.zeros((1, 16, 8, 8))})
        return out["samples"]

    ref = run(flux)
    out = run(teacache(flux, 0.05, "auto", rule="adaptive", mode="output"))
    got = last_run()
    assert (got["rule"], got["residual_mode"]) == ("adaptive", "output")
    checks = got["conds"]["cond"]["checks"]
    assert sum(error > 0.05 for _, _, error, _ in checks) >= 20, checks
    assert rel_err(out, ref) < 0.1, (rel_err(out, ref), got["conds"]["cond"]["pattern"])


@pytest.mark.parametrize("seed", [23, 24])
def test_the_adaptive_rule_trusts_no_single_check(flux, conds, seed):
    """dpmpp_2s_ancestral calls the model twice a step and adds noise between steps: the denoised picture held
    from a step's first call matches its second one closely (the first check, 0.001), and the next step's call
    not at all (0.3). A stretch set by the one check skipped that call: 0.13 to 0.30 from the uncached latent
    on a Karras schedule at these seeds, on either host. Set by the worse of two checks, no call skips until
    they agree."""
    ref = _sampled(flux, conds, "dpmpp_2s_ancestral", "karras", seed)
    out = _sampled(teacache(flux, -1.0, "auto", rule="adaptive", mode="output"), conds, "dpmpp_2s_ancestral",
                   "karras", seed)
    got = last_run()["conds"]["cond"]
    assert got["checks"][0][3] == 1.0 and got["pattern"].index("S") > got["checks"][1][0]
    assert rel_err(out, ref) < 0.05, (rel_err(out, ref), got["pattern"])


@pytest.mark.parametrize("scheduler", ["simple", "karras"])
def test_the_adaptive_rule_does_not_check_a_call_at_the_last_computed_ones_sigma(flux, conds, scheduler):
    """heun's corrector call and the next step's first call share a sigma: a check there, scaled by a span of 0,
    read 0 whatever the forecast erred (3% here) and let the next real check alone lengthen the stretch. Such a
    call is not checked: every check reads the error over a span, and no call skips before two of them agree."""
    out = _sampled(teacache(flux, -1.0, "auto", rule="adaptive", mode="output"), conds, "heun", scheduler, 3, steps=16)
    got = last_run()["conds"]["cond"]
    checks = got["checks"]
    assert len(checks) >= 4 and all(error > 0 for _, _, error, _ in checks), checks
    assert "S" in got["pattern"] and got["pattern"].index("S") > checks[1][0], (got["pattern"], checks)
    assert torch.isfinite(out).all()


def _sampled(model, conds, sampler, scheduler, seed, steps=20):
    import nodes

    (out,) = nodes.common_ksampler(model, seed, steps, 3.0, sampler, scheduler, *conds,
                                   {"samples": torch.zeros((1, 16, 8, 8))})
    return out["samples"]


@pytest.mark.parametrize("sampler", ["euler_cfg_pp", "dpmpp_2m_cfg_pp"])
def test_a_cfg_pp_sampler_is_not_skipped_under_a_rule_that_does_not_measure_the_cost(flux, conds, sampler):
    """A CFG++ sampler builds each latent on the denoised picture itself: a skipped call's error reaches it times sigma,
    not times the step's span. With the node defaults the trained Flux landed 0.58 (euler_cfg_pp) and 0.49
    (dpmpp_2m_cfg_pp, extrapolated) from the uncached latent. A rule that does not measure what a skip costs under
    such a sampler (every rule but adaptive) computes every call there, and says why."""
    ref = _sampled(flux, conds, sampler, "simple", 21)
    for rule, mode in (("auto", "auto"), ("interval", "output")):
        out = _sampled(teacache(flux, -1.0, "auto", rule=rule, mode=mode), conds, sampler, "simple", 21)
        assert torch.equal(out, ref) and last_run()["calls_skipped"] == 0, (rule, rel_err(out, ref))
    rows = [r for r in P().stats().reasons() if r["event"] == "disabled"]
    assert len(rows) == 2 and all(sampler.removesuffix("_cfg_pp") in r["reason"] and "CFG++" in r["reason"]
                                  for r in rows), rows


def test_every_cfg_pp_sampler_of_comfyui_is_told_from_the_others():
    """ComfyUI's CFG++ samplers by name, SamplerEulerCFGpp's both versions and no other sampler of the host."""
    import comfy.samplers
    import comfy_extras.nodes_advanced_samplers as advanced

    told = {n for n in comfy.samplers.KSAMPLER_NAMES if P()._undamped(comfy.samplers.sampler_object(n))}
    assert told == {n for n in comfy.samplers.KSAMPLER_NAMES if n.endswith("_cfg_pp")} and "euler_cfg_pp" in told
    for version in ("regular", "alternative"):
        (sampler,) = advanced.SamplerEulerCFGpp.execute(version).args
        assert P()._undamped(sampler), version


@pytest.mark.parametrize("scheduler, threshold", [("simple", 0.05), ("karras", -1.0)])
def test_the_adaptive_rule_reads_a_cfg_pp_samplers_error_times_sigma(flux, conds, scheduler, threshold):
    """Under euler_cfg_pp an output's error reaches the next latent times sigma (the denoised picture is its base),
    not times the step's span: so checked, the adaptive rule at 0.05 on the simple schedule lands within 0.05 of
    the uncached latent (times the span: 0.51 at seed 21), and at its default on Karras,
    whose last steps are small in sigma, it still skips."""
    for seed in (21, 22):
        ref = _sampled(flux, conds, "euler_cfg_pp", scheduler, seed)
        out = _sampled(teacache(flux, threshold, "auto", rule="adaptive", mode="output"), conds, "euler_cfg_pp",
                       scheduler, seed)
        got, bound = last_run(), 0.05 if scheduler == "simple" else 0.005
        assert rel_err(out, ref) < bound, (rel_err(out, ref), got)
        assert scheduler == "simple" or got["calls_skipped"] >= 3, got["conds"]["cond"]["pattern"]


def test_first_blocks_through_the_sampler_report_and_decide_on_more_blocks(flux, conds):
    """first_blocks through the real KSampler: reported, exact at threshold 0, and its skips (on the same
    threshold as First-Block's) decided on the residual of the first blocks, not the first block's."""
    ref = sample(flux, conds)
    assert torch.equal(sample(teacache(flux, 0.0, rule="first_block", mode="reuse", first_blocks=3), conds), ref)
    assert last_run()["first_blocks"] == 3 and last_run()["calls_skipped"] == 0
    traces = {}
    for n in (1, 3):
        out = sample(teacache(flux, 0.3, rule="first_block", mode="reuse", first_blocks=n), conds)
        run = last_run()
        assert run["first_blocks"] == n and torch.isfinite(out).all()
        traces[n] = run["conds"]["cond"]["trace"]
    assert traces[1] != traces[3]


@pytest.mark.parametrize("mode", ["taylorseer1", "output"])
def test_interval_power_places_the_beat_on_the_runs_steps_through_the_sampler(flux, conds, mode):
    """interval_power through the real KSampler: a power that places the steps where the fixed beat computes
    (1.01 at 10 steps, interval 3: 0, 3, 6, 9) gives that beat's latent exactly, so the placed path forecasts
    as the fixed one does; power 2 computes steps 0, 5, 8 and 9, cond and uncond, and a CPU cache agrees;
    power 0.5 steps 0, 1, 4 and 9 (over the fixed beat's span, 0-9).
    At 20 steps, power 1.3 computes as many steps as the fixed beat (7) and lands nearer the uncached latent
    on the trained Flux."""
    fixed = sample(teacache(flux, 3.0, rule="interval", mode=mode), conds)
    placed = sample(teacache(flux, 3.0, rule="interval", mode=mode, power=1.01), conds)
    run = last_run()
    assert run["interval_power"] == 1.01 and run["conds"]["cond"]["pattern"] == "CSSCSSCSSC"
    assert torch.equal(placed, fixed)
    dense = sample(teacache(flux, 3.0, rule="interval", mode=mode, power=2.0), conds)
    run = last_run()
    assert {lab: c["pattern"] for lab, c in run["conds"].items()} == {"cond": "CSSSSCSSCC", "uncond": "CSSSSCSSCC"}
    assert run["calls_computed"] == 4 and not torch.equal(dense, fixed)
    assert torch.equal(sample(teacache(flux, 3.0, rule="interval", mode=mode, power=2.0, device="cpu"), conds), dense)
    early = sample(teacache(flux, 3.0, rule="interval", mode=mode, power=0.5), conds)  # over 0-9: 0, 1, 4, 9
    run = last_run()
    assert {lab: c["pattern"] for lab, c in run["conds"].items()} == {"cond": "CCSSCSSSSC", "uncond": "CCSSCSSSSC"}
    assert run["calls_computed"] == 4 and not torch.equal(early, fixed) and torch.isfinite(early).all()
    ref = sample(flux, conds, steps=20)
    err = {}
    for power in (1.0, 1.3):
        err[power] = rel_err(sample(teacache(flux, 3.0, rule="interval", mode=mode, power=power), conds, steps=20), ref)
        assert last_run()["conds"]["cond"]["pattern"].count("C") == 7
    assert err[1.3] < 0.8 * err[1.0], err


def test_output_mode_forecasts_the_models_own_output_whatever_the_skipped_calls_input(flux, conds):
    """residual_mode output: the model's output (Flux: the velocity, before the host makes it a denoised
    latent) forecast as FoCa forecasts, on inputs that change at every call. Computed at calls 0 and 2
    (velocities v0, v2), call 1 knows one value (reuse v0); at call 2 the backward slope to that reuse is
    v2 - v0, D1 = (v2 - v0) / 2, the predictor rate (back + 2 D1) / 3 = 2/3 (v2 - v0); call 3 takes the
    Heun rate (2/3 + 1/2) / 2 (v2 - v0): v2 + 7/12 (v2 - v0). TaylorSeer's residual forecast on the same
    calls gives another output (the final layer is not linear)."""
    xs = [torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    sigmas = (0.9, 0.7, 0.5, 0.3)
    got = {}
    for mode in ("output", "taylorseer1"):
        m = teacache(flux, 2.0, rule="interval", mode=mode)  # a call in 2 computed
        to = flux_options(m)
        run = to[P().RUN_KEY]
        got[mode] = [flux_call(m, x, to, conds, s) for x, s in zip(xs, sigmas, strict=True)]
        assert run.conds[("c", 0)].pattern == ["C", "S", "C", "S"]
    v = [(x - out) / s for x, out, s in zip(xs, got["output"], sigmas, strict=True)]  # denoised = x - s v
    assert torch.allclose(v[1], v[0], atol=1e-5), rel_err(v[1], v[0])
    want = v[2] + 7 / 12 * (v[2] - v[0])
    assert torch.allclose(v[3], want, atol=1e-4), rel_err(v[3], want)
    assert torch.equal(got["taylorseer1"][2], got["output"][2])  # the computed calls are the model's
    assert rel_err(got["taylorseer1"][3], got["output"][3]) > 1e-3


def test_output_mode_keeps_no_output_it_cannot_split_per_cond_and_says_why(flux, conds):
    """A computed call whose output is not one tensor splitting per cond keeps nothing and drops what the
    conds held: they compute again (no forecast from another layout), and the stats count why."""
    m = teacache(flux, 3.0, rule="interval", mode="output")
    to = flux_options(m)
    run = to[P().RUN_KEY]
    flux_call(m, torch.randn(1, 16, 8, 8), to, conds)
    state = run.conds[("c", 0)]
    assert state.residual is not None
    call = P()._Call(run, m.model_options["transformer_options"][P().KEY].family, None, [("c", 0)], ["cond"],
                     True, None)
    call.take_output((torch.zeros(1, 16, 8, 8),))  # a tuple, not a tensor
    assert call.residual is None and state.residual is None and state.derivatives == []
    reasons = P().stats().snapshot()["reasons"]
    assert any(r["event"] == "fallback" and "does not split per cond" in r["reason"] for r in reasons), reasons


def test_output_mode_is_refused_with_the_schedule_rule_by_name(flux):
    with pytest.raises(ValueError, match=r"ReuseKit.*residual_mode: output .*schedule rule"):
        teacache(flux, 0.01, rule="schedule", mode="output")


def test_max_consecutive_skips_is_respected(flux, conds):
    sample(teacache(flux, 5.0, max_skips=1), conds)
    pattern = last_run()["conds"]["cond"]["pattern"]
    assert "S" in pattern and "SS" not in pattern


def test_runs_start_clean_again_and_at_another_resolution(flux, conds):
    model = teacache(flux, 0.8)
    first = sample(model, conds)
    again = sample(model, conds)
    assert torch.equal(first, again)  # nothing carried over from the first run
    bigger = sample(model, conds, shape=(1, 16, 12, 12))  # the old pack's "size of tensor a" bug
    assert bigger.shape == (1, 16, 12, 12) and torch.isfinite(bigger).all()
    assert last_run()["conds"]["cond"]["pattern"][0] == "C" and last_run()["resets"] == 0


def test_split_sampler_passes_each_start_clean(flux, conds):
    import nodes

    pos, neg = conds
    model = teacache(flux, 0.8)
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    adv = nodes.KSamplerAdvanced()
    (half,) = adv.sample(model, "enable", 3, STEPS, 3.0, "euler", "simple", pos, neg, latent, 0, STEPS // 2,
                         "enable")
    first_half = last_run()
    (done,) = adv.sample(model, "disable", 3, STEPS, 3.0, "euler", "simple", pos, neg, half, STEPS // 2,
                         STEPS, "disable")
    second_half = last_run()
    assert torch.isfinite(done["samples"]).all()
    for run in (first_half, second_half):
        assert run["conds"]["cond"]["pattern"][0] == "C" and len(run["conds"]["cond"]["pattern"]) == STEPS // 2


def test_cpu_cache_device_gives_the_same_latent(flux, conds):
    on_device = sample(teacache(flux, 0.8), conds)
    on_cpu = sample(teacache(flux, 0.8, device="cpu"), conds)
    assert torch.equal(on_device, on_cpu)
    assert last_run()["cache_device"] == "cpu"


def test_cached_ksampler_equals_teacache_then_ksampler(flux, conds):
    pos, neg = conds
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    (out,) = N().CachedKSamplerNode.execute(flux, 3, STEPS, 3.0, "euler", "simple", pos, neg, latent, 1.0,
                                            rule="teacache", threshold=0.8, model_type="flux", start_percent=0.0,
                                            end_percent=1.0, max_consecutive_skips=0, cache_device="device",
                                            residual_mode="extrapolate").args
    assert torch.equal(out["samples"], sample(teacache(flux, 0.8), conds))


def test_the_node_clones_and_leaves_its_input_alone(flux):
    options_before = json.dumps(flux.model_options, default=str, sort_keys=True)
    wrappers_before = {k: dict(v) for k, v in flux.wrappers.items()}
    model = teacache(flux, 0.4)
    assert model is not flux
    assert json.dumps(flux.model_options, default=str, sort_keys=True) == options_before
    assert flux.wrappers == wrappers_before
    twice = teacache(model, 0.4)  # applying again replaces, never stacks
    assert len(twice.wrappers["outer_sample"][P().KEY]) == 1


def test_other_block_patches_are_chained_and_a_later_one_on_the_first_block_disables_skipping(flux, conds):
    seen = []

    def earlier(args, extra):  # a block patch from another node, installed before ours
        seen.append(1)
        return extra["original_block"](args)

    before = flux.clone()
    before.set_model_patch_replace(earlier, "dit", "double_block", 1)
    ref = sample(flux, conds)
    chained = teacache(before, 0.0)
    assert torch.equal(sample(chained, conds), ref) and len(seen) == STEPS
    after = teacache(flux, 5.0)
    after.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    assert torch.equal(sample(after, conds), ref)  # our decision point is gone: nothing skipped
    assert last_run()["calls_skipped"] == 0


@pytest.mark.parametrize("rule", SAME_INPUT_RULES)
def test_a_skipped_call_adds_controlnet_once_not_again_on_top_of_the_residual(flux, conds, rule):
    """ControlNet adds into the image stream between blocks; the stored residual already holds what it
    added at the last computed call, so a skip must not add this call's control on top of it. Two calls
    on the same input: the skipped second one must give exactly the computed first one's output."""
    import comfy.ldm.flux.controlnet
    import comfy.ops

    trained = tiny_module("trained_flux")
    config = rkharness.TINY.with_host_fields(trained.CONFIG, "comfy.ldm.flux.model:FluxParams")
    cn = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init,
                                                  dtype=torch.float32, **config)
    trained.init_weights(cn, 5)
    for block in cn.controlnet_single_blocks:  # only control inside the block stack
        torch.nn.init.zeros_(block.weight)
    m = teacache(flux, SKIPPING.get(rule, 1.0), mode="reuse", rule=rule)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.5])
    context, pooled = conds[0][0][0], conds[0][0][1]["pooled_output"]
    hint = torch.linspace(0, 1, 3 * 64 * 64).reshape(1, 3, 64, 64)
    control = cn(x, sigma, context, y=pooled, hint=hint)
    to = m.model_options["transformer_options"].copy()
    to.update({"wrappers": m.wrappers, "sigmas": sigma, "uuids": ["c"], "cond_or_uncond": [0],
               P().RUN_KEY: call_state(to)})
    with torch.inference_mode():
        computed = m.model.apply_model(x, sigma, c_crossattn=context, y=pooled, control=control,
                                       transformer_options=to)
        to["sigmas"] = sigma.clone()  # the next step
        H().ready_to_skip(to[P().RUN_KEY])
        skipped = m.model.apply_model(x, sigma, c_crossattn=context, y=pooled, control=control,
                                      transformer_options=to)
    assert [s.pattern for s in to[P().RUN_KEY].conds.values()] == [["C", "S"]]
    assert torch.allclose(skipped, computed, atol=1e-5), rel_err(skipped, computed)


@pytest.mark.hardening
@pytest.mark.parametrize("kwargs,needle", [
    ({"thresh": -0.1}, "threshold"),
    ({"thresh": float("nan")}, "threshold"),
    ({"rule": "fastest"}, "rule"),
    ({"rule": "magcache", "model_type": "wan2.1_t2v_14B_ret_mode"}, "model_type"),
    ({"start": 0.7, "end": 0.3}, "start_percent"),
    ({"start": "a"}, "start_percent"),  # an API prompt's string: named, not a TypeError from a comparison
    ({"end": None}, "end_percent"),
    ({"thresh": 100.5}, "threshold"),  # over the widget's range: a linked value is not checked by ComfyUI
    ({"thresh": float("inf")}, "threshold"),
    ({"max_skips": -1}, "max_consecutive_skips"),
    ({"max_skips": 10 ** 6}, "max_consecutive_skips"),
    ({"max_skips": 2.5}, "max_consecutive_skips"),
    ({"device": "gpu"}, "cache_device"),
    ({"mode": "guess"}, "residual_mode"),
    ({"rule": np.array(["auto", "teacache"])}, "rule"),  # linked arrays failed in numpy's truth test, unnamed
    ({"model_type": np.array(["flux", "wan2.1"])}, "model_type"),
    ({"device": torch.tensor([0, 1])}, "cache_device"),
    ({"mode": np.array(["reuse", "foca"])}, "residual_mode"),
    ({"rule": "interval", "thresh": 2.5}, "threshold"),
    ({"rule": "interval", "thresh": 0.0}, "threshold"),
    ({"rule": "interval", "thresh": 0.5}, "threshold"),
    ({"rule": "interval", "thresh": 3.0, "power": 0.45}, "interval_power"),
    ({"rule": "interval", "thresh": 3.0, "power": float("nan")}, "interval_power"),
    ({"rule": "interval", "thresh": 3.0, "power": "1.3"}, "interval_power"),
    ({"power": 1.3}, "interval_power"),  # the TeaCache rule has no beat to place
    ({"rule": "first_block", "first_blocks": 0}, "first_blocks"),
    ({"rule": "first_block", "first_blocks": 1.5}, "first_blocks"),
    ({"rule": "first_block", "first_blocks": float("nan")}, "first_blocks"),
    ({"rule": "first_block", "first_blocks": float("inf")}, "first_blocks"),
    ({"rule": "first_block", "first_blocks": 1025}, "first_blocks"),
    ({"rule": "first_block", "first_blocks": 4}, "first_blocks: 4 runs every block of this flux model .4."),
    ({"first_blocks": 2}, "first_blocks"),  # the TeaCache rule decides before the first block
    ({"model_type": "wan2.1_t2v_14B_ret_mode"}, "model_type"),
    ({"model_type": "nope"}, "model_type"),
])
def test_bad_inputs_raise_value_errors_naming_node_and_input(flux, kwargs, needle):
    """Named in the error, and counted in the stats as a refusal with the same words from the node (the panel
    shows it; a refusal of the model's, e.g. first_blocks over its blocks, came from no node until 2026-12-06)."""
    args = {"thresh": 0.4} | kwargs
    P().stats().reset_counters()  # the reason rows are bounded: start from none
    with pytest.raises(ValueError, match=f"ReuseKit Step Cache: {needle}") as err:
        teacache(flux, **args)
    refused = [r for r in P().stats().reasons() if r["event"] == "refused"]
    assert sum(r["count"] for r in refused) == 1
    said = str(err.value).removeprefix("ReuseKit Step Cache: ")
    assert any(r["reason"] == rkharness.pack("caching.stats").clip_reason(said) for r in refused)
    assert [r["source"] for r in refused] == ["ReuseKit Step Cache"], refused


@pytest.mark.hardening
@pytest.mark.parametrize("rule,thresh", [("teacache", 0.25), ("interval", 3), ("first_block", 0.25)])
def test_linked_numpy_numbers_set_the_same_step_cache_as_python_ones(rule, thresh):
    """A custom node's NumPy number, linked, is a number (as for the sampler nodes): it was refused by name."""
    kwargs = dict(start_percent=0.25, end_percent=0.75, max_consecutive_skips=2, cache_device="cpu",
                  residual_mode="extrapolate", rule=rule, interval_power=1.5 if rule == "interval" else 1.0,
                  first_blocks=2 if rule == "first_block" else 1)
    plain = N().make_config("ReuseKit Step Cache", "flux", thresh, **kwargs)
    numpy = {k: np.float32(v) if isinstance(v, float) else np.int64(v) if isinstance(v, int) else v
             for k, v in kwargs.items()}
    assert N().make_config("ReuseKit Step Cache", "flux", np.float32(thresh), **numpy) == plain  # (exact in fp32)


# ---- calibration -----------------------------------------------------------------------

def test_calibration_fits_a_polynomial_that_the_next_run_uses(flux, conds, _isolated_calibrations):
    with pytest.raises(ValueError, match="ReuseKit Step Cache: model_type: no calibration"):
        sample(teacache(flux, 0.2, model_type="calibrated"), conds)
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    ref = sample(cal, conds)
    run = last_run()
    assert run["calls_skipped"] == 0 and run["calibration"]["points"] == STEPS - 1
    assert torch.equal(ref, sample(flux, conds))  # calibrating changes nothing
    assert _isolated_calibrations.path.is_file()
    out = sample(teacache(flux, 0.3, model_type="auto"), conds)
    run = last_run()
    assert run["model_type"] == "calibrated" and run["calls_skipped"] >= 2
    assert rel_err(out, ref) < 0.3


def test_a_skip_layer_guidance_pass_keeps_a_state_of_its_own_and_never_mixes_with_the_conds(flux, conds):
    """SkipLayerGuidanceDiT calls the model a second time for the cond in each step, with one block
    patched away: that pass is a state of its own, skipped and forecast from its own calls only, so its
    guidance stays in the picture (it once read the cond's own output, and the guidance term fell to
    nothing). Skipped in step with the cond, it lands nearer the uncached picture than when it was computed
    every step (0.58 off, 15 calls computed) or than the picture without the guidance."""
    import comfy_extras.nodes_slg as slg

    def with_slg(m):
        return slg.SkipLayerGuidanceDiT.execute(m, 3.0, 0.0, 1.0, double_layers="1", single_layers="").args[0]

    reference, plain = sample(with_slg(flux), conds), sample(flux, conds)
    assert torch.equal(sample(with_slg(teacache(flux, 0.0, model_type="auto")), conds), reference)
    before = P().stats().counter("calls_computed")
    out = sample(with_slg(teacache(flux, 0.3, model_type="auto", mode="reuse")), conds)
    run = last_run()
    assert set(run["conds"]) == {"cond", "uncond", "cond [1 block replaced]"}
    assert all(len(c["pattern"]) == STEPS and "S" in c["pattern"] for c in run["conds"].values())
    assert P().stats().counter("calls_computed") - before == run["calls_computed"]
    assert run["calls_computed"] + run["calls_skipped"] == 2 * STEPS  # (cond, uncond) and the pass, each step
    assert rel_err(out, reference) < 0.45 and rel_err(out, reference) < rel_err(out, plain) / 2


def _skip_block(args, extra):
    return args  # SkipLayerGuidance's replacement: the block passes its input through


@pytest.mark.parametrize("where,rule,own", [(("double_block", 1), "teacache", True),
                                            (("single_block", 0), "teacache", True),
                                            (("double_block", 0), "teacache", False),
                                            (("single_block", 1), "teacache", False),
                                            (("double_block", 1), "first_block", False)])
def test_a_call_with_some_blocks_replaced_skips_only_onto_its_own_state(flux, conds, where, rule, own):
    """SkipLayerGuidanceDiTSimple replaces blocks on the uncond's pass inside its window only: a state keyed by
    the uncond alone handed that pass the usual uncond's residual at the window's start (0.90 from what the
    pass computes, on its own input) and the usual uncond the pass's after the window. A middle block
    replaced: the pass skips onto its own calls only, giving what it computes on the same input. A block
    the decision runs through (the first; first_block with 2 first blocks: the second too) or the last (which
    adds the residual) replaced: the pass is computed, counted. Either way the usual uncond, which sat out the
    window, computes its next call (what it holds is from before the window), then skips onto that."""
    import comfy.model_patcher

    m = teacache(flux, 0.0, mode="reuse", rule=rule, first_blocks=2 if rule == "first_block" else 1)
    to = flux_options(m)
    to["uuids"], to["cond_or_uncond"] = ["u"], [1]
    plan_every_call(to[P().RUN_KEY], "C")
    slg = comfy.model_patcher.set_model_options_patch_replace({"transformer_options": to}, _skip_block, "dit",
                                                              *where)["transformer_options"]
    alone = comfy.model_patcher.set_model_options_patch_replace({"transformer_options": {}}, _skip_block, "dit",
                                                                *where)["transformer_options"]
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    for s in (0.9, 0.7, 0.5):
        flux_call(m, x * s, to, conds, s)
    run = to[P().RUN_KEY]
    run.config = dataclasses.replace(run.config, threshold=1e9)
    truth = flux_call(flux, x, alone, conds, 0.5)
    first = flux_call(m, x, slg, conds, 0.5)  # the window's first pass: computed, nothing of its own yet
    again = flux_call(m, x, slg, conds, 0.5)
    assert torch.equal(first, truth) and torch.allclose(again, truth, atol=1e-5), rel_err(again, truth)
    if own:
        (key,) = (k for k in run.conds if k != ("u", 1))
        assert run.conds[key].pattern == ["C", "S"] and run.conds[key].label == "uncond [1 block replaced]"
    else:
        assert list(run.conds) == [("u", 1)] and run.unhooked == 0
        reasons = [r["reason"] for r in P().stats().snapshot()["reasons"]]
        assert any(f"patch of {where[0]} {where[1]} (a block it decides with or the last one" in r for r in reasons)
    after = [flux_call(m, x * 0.5, to, conds, 0.5) for _ in range(2)]
    assert run.conds[("u", 1)].pattern == ["C", "C", "C", "C", "S"]
    assert torch.allclose(after[1], after[0], atol=1e-5) and torch.equal(after[0], flux_call(m, x * 0.5, {}, conds, 0.5))


@pytest.mark.parametrize("mode", ["reuse", "taylorseer2", "foca"])
def test_an_uncond_a_guider_drops_for_some_steps_starts_over_when_it_comes_back(flux, conds, mode):
    """A guider whose cfg is 1 for some steps (a scheduled-CFG node): ComfyUI drops the uncond there. When it
    came back, the interval rule counted its calls, not the steps, and skipped onto a residual five steps old
    (taylorseer2: 0.54 from the uncached picture, against 0.09 with the uncond at every step). It now computes
    its first call back, counted, and the picture is as near as with the uncond at every step."""
    import comfy.sample
    import comfy.samplers

    class Scheduled(comfy.samplers.CFGGuider):
        def predict_noise(self, x, timestep, model_options={}, seed=None):  # noqa: B006 (the host's signature)
            step = int(torch.argmin((self.sigmas - timestep.max()).abs()))
            self.cfg = 1.0 if step in self.dip else 3.0
            return super().predict_noise(x, timestep, model_options, seed)

    def run(model, dipping=True):
        guider = Scheduled(model)
        guider.set_conds(*conds)
        guider.sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", STEPS)
        guider.dip = range(3, 7) if dipping else ()
        latent = torch.zeros(1, 16, 8, 8)
        return guider.sample(comfy.sample.prepare_noise(latent, 3), latent, comfy.samplers.sampler_object("euler"),
                             guider.sigmas, seed=3)

    errors = {}
    for dipping in (True, False):
        out = run(teacache(flux, 2.0, rule="interval", mode=mode), dipping)
        errors[dipping] = rel_err(out, run(flux, dipping))
        if dipping:
            patterns = {k: v["pattern"] for k, v in last_run()["conds"].items()}
            assert patterns["uncond"] == "CSC" + "CSC", patterns  # steps 0-2, then 7-9: its first call back computed
            assert any("started over with a computed call" in r["reason"] for r in P().stats().reasons()
                       if r["event"] == "fallback")
    assert errors[True] < 1.5 * errors[False], errors


def test_planned_cond_only_steps_in_a_run_of_three_branches_are_computed_whole_and_counted(flux, conds):
    """PerpNegGuider runs three branches (the prompt, the negative, the empty prompt). The schedule rule plans
    cond-only steps from the guider's cfg and negative, and a run that is not one cond and one uncond cannot
    rebuild its uncond: those steps were computed whole with nothing said. Each is now counted, naming the
    branches, and the picture is as near PerpNeg's own as CFGGuider's skipped run is to CFG's."""
    import comfy.sample
    import comfy.samplers
    from comfy_extras import nodes_perpneg

    pos, neg = conds

    def run(model, perpneg):
        guider = nodes_perpneg.Guider_PerpNeg(model) if perpneg else comfy.samplers.CFGGuider(model)
        guider.set_conds(pos, neg, neg) if perpneg else guider.set_conds(pos, neg)
        guider.set_cfg(3.0, 1.0) if perpneg else guider.set_cfg(3.0)
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", STEPS)
        latent = torch.zeros(1, 16, 8, 8)
        return guider.sample(comfy.sample.prepare_noise(latent, 3), latent, comfy.samplers.sampler_object("euler"),
                             sigmas, seed=3)

    planned = []
    real = P()._plan_schedule

    def plan(run_state, *args):
        real(run_state, *args)
        planned.append(run_state.plan.actions.count("H"))

    m = teacache(flux, 0.03, model_type="flux", rule="schedule", mode="reuse")
    errors, halves = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P(), "_plan_schedule", plan)
        for perpneg in (False, True):
            P().stats().reset_counters()
            errors[perpneg] = rel_err(run(m, perpneg), run(flux, perpneg))
            halves[perpneg] = last_run()["calls_half"]
            fallbacks = [r for r in P().stats().reasons() if "not one cond and one uncond" in r["reason"]]
            if perpneg:
                (row,) = fallbacks
                assert "(1 cond, 1 cond2, 1 uncond)" in row["reason"] and row["count"] == planned[-1] > 0, (row, planned)
            else:
                assert fallbacks == [] and halves[perpneg] > 0
    assert halves[True] == 0 and errors[True] < 1.5 * errors[False], (errors, halves)


def test_skip_layer_guidance_simple_through_the_sampler_is_exact_unskipped(flux, conds):
    """SkipLayerGuidanceDiTSimple from 30% on: with nothing skipped the picture is the uncached one, and
    skipping keeps its pass in a state of its own."""
    import comfy_extras.nodes_slg as slg

    def with_slg(m):
        return slg.SkipLayerGuidanceDiTSimple.execute(m, 0.3, 1.0, double_layers="1", single_layers="").args[0]

    reference = sample(with_slg(flux), conds)
    assert torch.equal(sample(with_slg(teacache(flux, 0.0, model_type="auto")), conds), reference)
    sample(with_slg(teacache(flux, 2.0, rule="interval", mode="reuse")), conds)
    run = last_run()
    assert set(run["conds"]) == {"cond", "uncond", "uncond [1 block replaced]"}
    assert len(run["conds"]["cond"]["pattern"]) == STEPS
    assert len(run["conds"]["uncond"]["pattern"]) + len(run["conds"]["uncond [1 block replaced]"]["pattern"]) == STEPS


def test_a_pass_with_blocks_replaced_leaves_the_schedule_rules_cond_uncond_pair():
    """The schedule rule's cond-only steps rebuild the uncond from its cond: a SkipLayerGuidance pass beside
    them (a state of its own) is neither, so the pair stays and the cond-only steps go on."""
    tc = rkharness.pack("caching.step_cache")
    run = tc.RunState(tc.StepCacheConfig(None, "auto", 0.3, rule="schedule"), None, 1.0, 0.0)
    run.cond(("c", 0), "cond")
    run.cond(("u", 1), "uncond")
    run.cond((("c", 0), tc.REPLACED, (("double_block", 1),)), "cond [1 block replaced]")
    assert run.pair() == (("c", 0), ("u", 1))
    run.cond(("c2", 0), "cond#2")  # another cond of its own: no pair
    assert run.pair() is None


def test_a_second_call_of_a_cond_at_one_step_is_told_from_the_conds_next_step():
    """ComfyUI hands every call of one step the same timestep tensor (a guidance pass after the cfg: LTXV's
    STG, modality guidance) and makes a new one for each model evaluation: by identity, no sync."""
    tc = rkharness.pack("caching.step_cache")
    run = tc.RunState(tc.StepCacheConfig(None, "auto", 0.3), None, 1.0, 0.0)
    step = torch.tensor([0.5])
    assert not run.again_this_step([("c", 0), ("c", 1)], step)  # the step's own batch
    assert run.again_this_step([("c", 0)], step)  # the cond once more at this step: a guidance pass
    assert not run.again_this_step([("c", 0), ("c", 1)], step.clone())  # the next step, the same sigma value
    assert not run.again_this_step([("c", 0)], None)  # no timestep: never told apart


def test_a_context_windows_uncond_reads_the_unconds_magnitude_curve():
    """A window's calls are labelled with its frames ("uncond [0-1]"): the uncond's curve, not the cond's."""
    tc = rkharness.pack("caching.step_cache")
    run = tc.RunState(tc.StepCacheConfig(None, "auto", 0.3, rule="magcache"), None, 1.0, 0.0,
                      {"cond": [(1.0, 0.0), (0.5, -0.1)], "uncond": [(1.0, 0.0), (0.5, -0.3)]})
    curves = run.curves
    assert run._curve("uncond [0-1]") is curves["uncond"] and run._curve("uncond#2 [4-7]") is curves["uncond"]
    assert run._curve("cond [0-1]") is curves["cond"] and run._curve("cond1") is curves["cond"]


def test_each_context_window_keeps_a_state_of_its_own(conds):
    """ComfyUI's context windows call the model once per window at every step, with the same conds: each
    window is a call of its own, whose steps are computed and forecast on its own frames (the second
    window used to be handed the first one's residual at every step)."""
    import inspect

    import comfy_extras.nodes_context_windows as cw

    wan = rkharness.TINY.tiny_wan(0, num_layers=2)
    manual = cw.ContextWindowsManualNode.execute
    extra = {"freenoise": False} if "freenoise" in inspect.signature(manual).parameters else {}

    def windowed(m):
        return manual(m, 2, 0, "standard_static", 1, False, "flat", 2, **extra).args[0]

    shape = (1, 16, 4, 8, 8)
    reference = sample(windowed(wan), conds, shape=shape)
    assert torch.equal(sample(windowed(teacache(wan, 0.0, model_type="auto")), conds, shape=shape), reference)
    out = sample(windowed(teacache(wan, 2.0, model_type="auto", rule="interval", mode="reuse")), conds, shape=shape)
    run = last_run()
    if run["resets"]:
        pytest.skip("this ComfyUI's windows of this video differ in shape: each call starts clean anyway")
    assert {c["pattern"] for c in run["conds"].values()} == {"CS" * (STEPS // 2)}
    assert {label.split(" [")[1] for label in run["conds"]} == {"0-1]", "2-3]"}
    first, second = (rel_err(out[:, :, i:i + 2], reference[:, :, i:i + 2]) for i in (0, 2))
    assert 0 < first < 0.2 and 0 < second < 0.2


def test_a_calibration_from_a_partial_pass_is_not_saved(flux, conds, _isolated_calibrations):
    """A second pass at denoise under 1 (a hires pass) sees only the low sigmas, a run stopped early only the
    high ones: saved, later runs took the curve as flat beyond it and skipped there. Each is refused, counted,
    and nothing is written."""
    import nodes

    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    first = sample(flux, conds)
    empty = {"samples": torch.zeros((1, 16, 8, 8))}
    # a pass at denoise under 1; a run stopped before the end (KSamplerAdvanced's end_at_step, the first half of
    # split sigmas), which sees only the high sigmas (saved, a later default run skipped every low-sigma step,
    # 0.33 from the uncached latent against 0.009 after a whole calibration); stopped there with the rest of
    # the noise removed at once (KSamplerAdvanced without leftover noise), whose last sigma is 0 as a whole
    # run's, and which was saved alike
    partial = [({"samples": first.clone()}, {"denoise": 0.5}, "denoise under 1"),
               (empty, {"start_step": 0, "last_step": STEPS // 2, "force_full_denoise": False}, "it stopped at sigma"),
               (empty, {"start_step": 0, "last_step": STEPS // 2, "force_full_denoise": True},
                f"it stopped after {STEPS // 2} steps of a longer schedule")]
    for latent, how, why in partial:
        nodes.common_ksampler(cal, 3, STEPS, 3.0, "euler", "simple", *conds, latent, **how)
        assert last_run()["outcome"] == "completed" and "calibration" not in last_run()
        assert not _isolated_calibrations.path.exists()
        assert any(why in r["reason"] and r["event"] == "refused" for r in P().stats().snapshot()["reasons"]), why
    sample(cal, conds)  # a whole run calibrates
    assert "calibration" in last_run() and _isolated_calibrations.path.exists()


def test_a_run_that_is_part_of_its_schedule_takes_the_schedules_threshold(flux, conds):
    """auto's threshold is picked for the density of the steps. A run sampling part of a schedule (the two
    KSamplerAdvanced halves of a Wan 2.2 pair, KSampler's denoise under 1) took its own step count's: two
    halves of a 50-step schedule skipped as two 25-step runs (2.78x each against the whole run's 5.56x). They
    now take the whole schedule's, and land near it from their uncached latent."""
    import nodes

    defaults = N().TeaCacheNode.execute(model=flux).args[0]
    steps, seed = 50, 5

    def staged(model):
        adv = nodes.KSamplerAdvanced()
        (half,) = adv.sample(model, "enable", seed, steps, 3.0, "euler", "simple", *conds,
                             {"samples": torch.zeros((1, 16, 8, 8))}, 0, steps // 2, "enable")
        first = last_run()
        (done,) = adv.sample(model, "disable", seed, steps, 3.0, "euler", "simple", *conds, half, steps // 2, steps,
                             "disable")
        return done["samples"], first, last_run()

    whole = rel_err(sample(defaults, conds, steps=steps, seed=seed), sample(flux, conds, steps=steps, seed=seed))
    run = last_run()
    out, first, second = staged(defaults)
    assert first["threshold"] == second["threshold"] == run["threshold"]
    assert min(first["speedup_calls"], second["speedup_calls"]) > 0.85 * run["speedup_calls"]
    assert rel_err(out, staged(flux)[0]) < 2 * whole, (rel_err(out, staged(flux)[0]), whole)
    # sigmas that are a view of anything but their schedule (padded, stacked, every 5th of a table) are the
    # run's own steps: a padded one read as 59 steps
    import comfy.sample
    import comfy.samplers

    ms = flux.get_model_object("model_sampling")
    own = comfy.samplers.calculate_sigmas(ms, "simple", 10)
    views = [torch.cat([own, torch.zeros(49)])[:11], torch.stack([own] * 4)[1],
             comfy.samplers.calculate_sigmas(ms, "simple", 50)[::5]]
    thresholds = []
    for sigmas in [own.clone(), *views]:
        latent = torch.zeros((1, 16, 8, 8))
        comfy.sample.sample_custom(defaults, comfy.sample.prepare_noise(latent, seed), 3.0,
                                   comfy.samplers.sampler_object("euler"), sigmas, *conds, latent, seed=seed)
        thresholds.append(last_run()["threshold"])
    assert len(set(thresholds)) == 1, thresholds
    # a schedule that ends above 0 (Laplace's, at its sigma_min) is one schedule too: its halves read its steps
    import comfy.k_diffusion.sampling

    laplace = comfy.k_diffusion.sampling.get_sigmas_laplace(steps, float(ms.sigma_min), float(ms.sigma_max))
    thresholds = []
    for part in (laplace.clone(), laplace[:steps // 2 + 1], laplace[steps // 2:]):
        latent = torch.zeros((1, 16, 8, 8))
        comfy.sample.sample_custom(defaults, comfy.sample.prepare_noise(latent, seed), 3.0,
                                   comfy.samplers.sampler_object("euler"), part, *conds, latent, seed=seed)
        thresholds.append(last_run()["threshold"])
    assert len(set(thresholds)) == 1, thresholds  # a half as its own 25 steps: 0.504


def test_the_window_in_percent_reads_the_models_patched_sampling_on_its_first_run(conds):
    """ModelSamplingSD3 (an object patch) moves the sigmas; start_percent is read through it on the very
    first run, before ComfyUI loads the model: two identical runs give the same pattern and latent."""
    import comfy_extras.nodes_model_advanced as advanced

    wan = rkharness.TINY.tiny_wan(0, num_layers=2)
    shifted = advanced.ModelSamplingSD3().patch(teacache(wan, 2.0, model_type="auto", rule="interval",
                                                         mode="reuse", start=0.5), 1.0)[0]
    outs, patterns = [], []
    for _ in range(2):
        outs.append(sample(shifted, conds, shape=(1, 16, 2, 8, 8)))
        patterns.append(last_run()["conds"]["cond"]["pattern"])
    assert patterns[0] == patterns[1] and torch.equal(outs[0], outs[1])


def test_a_lora_clones_calibration_is_its_own_and_the_base_models_stays(flux, conds, _isolated_calibrations):
    """Calibrating a LoRA'd clone keeps its own entry (its patches' digest in the key); the base model keeps
    and reads its own; a LoRA clone never calibrated reads the base model's, counted as a fallback."""
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds)
    base = last_run()["calibration"]["coefficients"]
    lora = flux.clone()
    weight = flux.model.diffusion_model.img_in.weight
    lora.add_patches({"diffusion_model.img_in.weight": (torch.randn(weight.shape,
                                                                    generator=torch.Generator().manual_seed(1)) * 0.5,)},
                     1.0)
    (cal,) = N().TeaCacheCalibrateNode.execute(lora).args
    sample(cal, conds)
    own = last_run()["calibration"]["coefficients"]
    assert own != base and len(json.loads(_isolated_calibrations.path.read_text())) == 2
    family = SF().detect_family(flux)

    def coefficients(model):
        return P().resolve(teacache(model, 0.3, model_type="calibrated").model_options["transformer_options"][P().KEY],
                           model).coefficients

    assert list(coefficients(flux)) == base and list(coefficients(lora)) == own
    other = flux.clone()
    other.add_patches({"diffusion_model.img_in.weight": (torch.ones(weight.shape) * 0.01,)}, 1.0)
    assert not [r for r in P().stats().reasons() if r["event"] == "fallback"]
    assert list(coefficients(other)) == base
    (said,) = [r for r in P().stats().reasons() if r["event"] == "fallback"]  # the panel says so
    assert "no teacache calibration of their own: its base model's is used" in said["reason"]
    assert P().calibration_keys(other, P().model_identity(other, family)[0])[1] is not None


def test_a_hooked_runs_calibration_is_its_own_and_the_base_models_stays(flux, conds, _isolated_calibrations):
    """A LoRA set on the conds as a hook (Create Hook Model as LoRA) reaches the model at sampling time, never its
    clone's patches: its calibration is kept under the hooks' digest, and the plain model's stays its own (a
    hooked calibration once replaced it, and the plain model's cached run moved 5x further from its uncached
    one with nothing said). The same hooks in a later prompt read the hooked calibration back."""
    import comfy.hooks
    import comfy.sampler_helpers

    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds)
    base = last_run()["calibration"]["coefficients"]
    before = sample(teacache(flux, 0.3, model_type="calibrated"), conds)
    weight = flux.model.diffusion_model.img_in.weight

    def hooked():  # the graph's nodes run again in a new prompt: new hook objects, the same LoRA
        hooks = comfy.hooks.create_hook_model_as_lora(
            {"diffusion_model.img_in.weight": weight + torch.randn(weight.shape,
                                                                   generator=torch.Generator().manual_seed(1)) * 0.5},
            None, 1.0, 1.0)
        return tuple(comfy.hooks.set_hooks_for_conditioning(c, hooks) for c in conds)

    first = hooked()
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, first)
    own = last_run()["calibration"]["coefficients"]
    assert own != base and len(json.loads(_isolated_calibrations.path.read_text())) == 2

    def coefficients(model, run_conds):
        settings = teacache(model, 0.3, model_type="calibrated").model_options["transformer_options"][P().KEY]
        as_guider_holds = {k: comfy.sampler_helpers.convert_cond(c) for k, c in zip(("positive", "negative"), run_conds,
                                                                                     strict=True)}
        return list(P().resolve(settings, model, as_guider_holds).coefficients)

    assert coefficients(flux, conds) == base and coefficients(flux, hooked()) == own
    assert not [r for r in P().stats().reasons() if r["event"] == "fallback"]
    stronger = tuple(comfy.hooks.set_hooks_for_conditioning(
        c, comfy.hooks.create_hook_model_as_lora({"diffusion_model.img_in.weight": weight * 1.5}, None, 1.0, 1.0))
        for c in conds)
    assert coefficients(flux, stronger) == base  # hooks never calibrated: the base model's, said
    (said,) = [r for r in P().stats().reasons() if r["event"] == "fallback"]
    assert "(a LoRA, or the conds' hooks) have no teacache calibration of their own" in said["reason"]
    after = sample(teacache(flux, 0.3, model_type="calibrated"), conds)  # the plain model's run, as before
    assert last_run()["model_type"] == "calibrated" and torch.equal(after, before)
    # the same hook on the positive alone, or over part of the run, computes otherwise: not the calibration above
    one = hooked()
    elsewhere = [(one[0], conds[1]), (conds[0], one[1]),
                 tuple(comfy.sampler_helpers.convert_cond(c) for c in one)]
    for c in elsewhere[2]:
        c[0]["end_percent"] = 0.2
    family = SF().detect_family(flux)
    base_key = P().model_identity(flux, family)[0]
    keys = {P().calibration_keys(flux, base_key, {"positive": p, "negative": n})[0]
            for p, n in [tuple(comfy.sampler_helpers.convert_cond(c) for c in pair) for pair in elsewhere[:2]]
            + [elsewhere[2]]}
    assert len(keys) == 3 and P().calibration_keys(flux, base_key, {
        k: comfy.sampler_helpers.convert_cond(c) for k, c in zip(("positive", "negative"), hooked(), strict=True)
    })[0] not in keys


@pytest.mark.hardening
def test_a_run_that_cannot_be_reported_still_returns_its_latent_and_says_why(flux, conds, monkeypatch,
                                                                            _isolated_calibrations):
    """A calibration whose table cannot be fitted (on a Mac the sampled residuals were made float64 on the MPS
    device, which has none) returns the sampler's latent as computed, and the panel says the calibration was not
    kept: it was in the log alone, and the next calibrated run asked for the calibration just run."""
    schedule = rkharness.pack("caching.step_schedule")

    def no_float64(*args, **kwargs):
        raise TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64")

    monkeypatch.setattr(schedule.ResidualTable, "from_samples", no_float64)
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    assert torch.equal(sample(cal, conds), sample(flux, conds))
    assert not _isolated_calibrations.path.exists()
    (said,) = [r for r in P().stats().reasons() if r["event"] == "fallback"]
    assert said["reason"].startswith("the run could not be reported (TypeError: Cannot convert a MPS Tensor")
    assert "a calibration run's table, were not kept" in said["reason"]


@pytest.mark.parametrize("mode", ["output", "extrapolate"])
def test_a_wrapper_outside_the_step_cache_that_changes_the_output_in_place_never_changes_what_it_kept(flux, conds,
                                                                                                     mode):
    """Output mode kept the model's output tensor itself: another node's model wrapper, running outside the step
    cache's, that rescales the output in place (``out.mul_(k)``) rescaled the kept output too, so every skipped
    call forecast from a value scaled twice (0.059 from the same wrapper written out of place, at the same
    computed and skipped calls). What the step cache keeps is its own: both wrappers give one latent."""
    import comfy.patcher_extension as pe

    def scaled(in_place, cached):
        def wrapper(executor, *args, **kwargs):
            out = executor(*args, **kwargs)
            return out.mul_(0.8) if in_place else out * 0.8

        model = flux.clone()
        model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "another_pack", wrapper)
        return teacache(model, 0.6, mode=mode) if cached else model

    assert torch.equal(sample(scaled(True, False), conds), sample(scaled(False, False), conds))
    in_place = sample(scaled(True, True), conds)
    assert last_run()["calls_skipped"] > 0
    assert torch.equal(in_place, sample(scaled(False, True), conds))


@pytest.mark.parametrize("other", ["EasyCacheNode", "LazyCacheNode"])
@pytest.mark.parametrize("ours_first", [True, False])
def test_comfyuis_own_step_cache_on_the_same_model_makes_ours_compute_every_call_and_says_why(flux, conds, other,
                                                                                             ours_first):
    """ReuseKit's Step Cache, then EasyCache: EasyCache, inside ours, kept a skipped call's stand-in output (the
    blocks passed through) as the model's and handed it back, 1.6 times the output off; LazyCache, outside,
    answered evaluations ours never saw, and ours forecast across them. Either way, in either order, ours now
    computes every call (counted, naming the node): the picture is the other cache's alone."""
    import comfy_extras.nodes_easycache as core

    def other_cache(model):
        return getattr(core, other).execute(model, reuse_threshold=0.05, start_percent=0.0, end_percent=1.0,
                                            verbose=False).args[0]

    alone = sample(other_cache(flux.clone()), conds, steps=12)
    stacked = other_cache(teacache(flux, 0.6)) if ours_first else teacache(other_cache(flux.clone()), 0.6)
    assert torch.equal(sample(stacked, conds, steps=12), alone)
    assert last_run()["calls_skipped"] == 0
    name = other.removesuffix("Node")
    (row,) = [r for r in P().stats().reasons() if r["event"] == "disabled"]
    assert row["reason"].startswith(f"ComfyUI's {name} node is on this model too"), row


@pytest.mark.parametrize("mode", ["taylorseer1", "output"])
def test_steps_another_wrapper_answers_outside_the_step_cache_make_each_cond_start_over(flux, conds, mode):
    """A PREDICT_NOISE wrapper outside the step cache (LazyCache's seam) answers evaluations 2 and 3 of 10 itself:
    the step cache never saw them, and its first call back was forecast from before the gap as if one step had
    passed (0.16-0.20 from the model's output, against 0.04-0.09 for its usual forecasts), unsaid. The sampler's
    step callback tells it the steps went by: that call is computed, counted; the user's callback still runs."""
    import comfy.patcher_extension as pe
    import comfy.sample

    answered, seen = [], []

    def outer(executor, *args, **kwargs):
        answered.append(len(answered) in (2, 3) and seen)
        if answered[-1]:
            return seen[-1].clone()
        seen.append(executor(*args, **kwargs))
        return seen[-1]

    model = teacache(flux, 3, rule="interval", mode=mode)
    model.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, "another_pack", outer)
    steps = []
    pos, neg = conds
    latent = torch.zeros(1, 16, 8, 8)
    comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 3), 10, 1.0, "euler", "simple", pos, neg, latent,
                        callback=lambda i, *rest: steps.append(i), seed=3)
    assert steps == list(range(10)) and sum(map(bool, answered)) == 2
    assert last_run()["conds"]["cond"]["pattern"].startswith("CSCSS")  # the call after the gap computed
    (row,) = [r for r in P().stats().reasons()
              if r["event"] == "fallback" and r["reason"].startswith("a step of the run never reached the step cache")]
    assert row["count"] == 1


def test_no_sampler_of_the_host_makes_a_step_look_unseen(flux, conds):
    """Every sampler ComfyUI lists calls the model at least once between two step callbacks wherever a call
    follows (UniPC's last step calls none, and none follows it): none starts the conds over for nothing."""
    import comfy.samplers

    import nodes

    model = teacache(flux, 0.6, model_type="auto")
    pos, neg = conds
    for name in comfy.samplers.KSampler.SAMPLERS:
        nodes.common_ksampler(model, 3, 6, 3.0, name, "simple", pos, neg, {"samples": torch.zeros(1, 16, 8, 8)})
        assert not [r for r in P().stats().reasons() if "never reached the step cache" in r["reason"]], name


def test_a_calibration_whose_rule_input_never_moved_saves_nothing_and_says_why(_isolated_calibrations):
    """LTX-2 turning a video into sound: the video stream is held by a noise mask of 0, and the rule's input (the
    video's modulated input) never changes. The calibration fitted a constant and saved it: the calibrated rule
    then skipped by the step count alone (10 of 12 calls at 0.17 from the audio). Now nothing is saved, the
    refusal says why, and the run is the uncached one."""
    import comfy.nested_tensor

    import nodes

    model = tiny_module("step_families").family_spec("ltx2").build(0)
    gen = torch.Generator().manual_seed(5)
    pos, neg = ([[torch.randn((1, 7, 64), generator=gen), {}]] for _ in range(2))
    video = torch.randn((1, 128, 2, 2, 2), generator=gen)

    def run(m):
        latent = {"samples": comfy.nested_tensor.NestedTensor([video.clone(), torch.zeros((1, 8, 4, 16))]),
                  "noise_mask": comfy.nested_tensor.NestedTensor([torch.zeros((1, 1, 2, 2, 2)),
                                                                  torch.ones((1, 1, 4, 16))])}
        (out,) = nodes.common_ksampler(m, 3, 8, 3.0, "euler", "simple", pos, neg, latent)
        return out["samples"].tensors

    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    assert all(torch.equal(a, b) for a, b in zip(run(cal), run(model), strict=True))
    assert not _isolated_calibrations.path.exists()
    (row,) = [r for r in P().stats().reasons() if r["event"] == "refused"]
    assert "the rule's input changed by 0 at every step: nothing to fit" in row["reason"], row


def test_a_calibrating_model_given_to_the_step_cache_is_refused_by_name(flux):
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    with pytest.raises(ValueError, match="ReuseKit Step Cache: model: it comes from ReuseKit TeaCache Calibrate"):
        teacache(cal, 0.3, model_type="auto")


def test_the_calibration_store_reads_each_dtype_first_keeps_both_writers_and_never_overwrites_a_bad_file(tmp_path):
    """This process's bf16 calibration never hides the fp32 model's own on file; two stores writing one file
    (two ComfyUI processes) keep both; a file that cannot be read is moved aside, not replaced."""
    wi = rkharness.pack("caching.weights_identity")
    weights = [("w", torch.linspace(-1, 1, 64))]
    fp32, bf16 = wi.identity(weights), wi.identity([(n, t.to(torch.bfloat16)) for n, t in weights])
    path = tmp_path / "cal.json"
    a, b = tc().CalibrationStore(path), tc().CalibrationStore(path)

    def calibration(c):
        return tc().Calibration((c, 0.0, 0.0, 1.0, 0.0), None, None)

    b.put("flux:x", fp32, calibration(1.0))
    a.put("flux:x", bf16, calibration(2.0))
    assert a.get("flux:x", fp32).coefficients[0] == 1.0 and a.get("flux:x", bf16).coefficients[0] == 2.0
    a.put("flux:y", fp32, calibration(3.0))
    b.put("flux:z", fp32, calibration(4.0))
    assert sorted(json.loads(path.read_text())) == ["flux:x", "flux:y", "flux:z"]
    path.write_text('{"flux:x": [1, 2,]}')
    a.put("flux:w", fp32, calibration(5.0))
    aside = list(tmp_path.glob("cal.json.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_text() == '{"flux:x": [1, 2,]}'
    assert list(json.loads(path.read_text())) == ["flux:w"]


@pytest.mark.hardening
def test_temporary_files_a_killed_writer_left_are_swept_at_the_next_save(tmp_path, monkeypatch):
    """A process killed between its temporary file and the rename left it there for good (19 KB a calibration
    file, up to 8 MiB a file-hash memo): a save removes those over an hour old, never a live writer's."""
    fh = rkharness.pack("caching.file_hashes")
    wi = rkharness.pack("caching.weights_identity")
    ident = wi.identity([("w", torch.linspace(-1, 1, 64))])
    stale, live = tmp_path / ".teacache-dead.json", tmp_path / ".teacache-live.json"
    memo_stale = tmp_path / ".file_hashes.json.0123.tmp"
    for path in (stale, live, memo_stale):
        path.write_text("{")
    for path in (stale, memo_stale):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    tc().CalibrationStore(tmp_path / "cal.json").put("flux:x", ident, tc().Calibration((1.0, 0.0, 0.0, 1.0, 0.0),
                                                                                         None, None))
    assert not stale.exists() and live.exists() and memo_stale.exists()
    monkeypatch.setattr(fh.FileHashes, "SETTLE_NS", 0)  # (a file settled since its last change: into the memo)
    hashes = fh.FileHashes()
    hashes.memo = str(tmp_path / "file_hashes.json")
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\0" * 64)
    assert hashes.get(str(weights)) is not None and hashes.wait(10)
    assert (tmp_path / "file_hashes.json").exists() and not memo_stale.exists() and live.exists()


def test_a_calibration_file_the_store_cannot_read_is_moved_aside_never_replaced(tmp_path, monkeypatch):
    """A file whose read fails (its permissions, an I/O error) was taken for an empty one: the next save
    replaced it with a file holding only the new calibration, and every other was lost."""
    wi = rkharness.pack("caching.weights_identity")
    ident = wi.identity([("w", torch.linspace(-1, 1, 64))])
    path = tmp_path / "cal.json"
    store = tc().CalibrationStore(path)
    store.put("flux:x", ident, tc().Calibration((1.0, 0.0, 0.0, 1.0, 0.0), None, None))
    kept = path.read_text()
    read = type(path).read_text

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", denied)
    said = []
    assert tc().CalibrationStore(path).get("flux:x", ident, said.append) is None
    assert said and str(path) in said[0] and "Permission denied" in said[0]
    store.put("flux:y", ident, tc().Calibration((2.0, 0.0, 0.0, 1.0, 0.0), None, None))
    monkeypatch.undo()
    (aside,) = tmp_path.glob("cal.json.unreadable-*")
    assert aside.read_text() == kept and list(json.loads(path.read_text())) == ["flux:y"]


@pytest.mark.hardening
@pytest.mark.parametrize("damage", ["nested past the parser's recursion", "a count of 1e400", "a sample of 10**400",
                                    "a coefficient of 10**400", "a sigma of 10**400 in its table",
                                    "a dtype torch has no epsilon for"])
def test_a_damaged_calibration_file_is_passed_over_and_said_never_an_error(tmp_path, damage):
    """Deep nesting made the file's read raise a RecursionError, and a number too large for a float an
    OverflowError where an identity or a calibration is read, and a dtype torch has no epsilon for a
    NotImplementedError where identities are compared: every step-cached sampling run failed with it, naming
    nothing, and a calibration could not be saved. Each is now a file passed over (said, and moved
    aside at the next save) or an entry that matches nothing."""
    wi = rkharness.pack("caching.weights_identity")
    ident = wi.identity([("w", torch.linspace(-1, 1, 64))])
    path = tmp_path / "cal.json"
    tc().CalibrationStore(path).put("flux:x", ident, tc().Calibration((1.0, 0.0, 0.0, 1.0, 0.0), None, None))
    entry = json.loads(path.read_text())["flux:x"][0]
    if damage.startswith("nested"):
        text = "[" * 100_000 + "]" * 100_000
    else:
        if "dtype" in damage:  # (matches reads the epsilon of two dtypes that differ)
            entry["identity"]["dtypes"][0] = "float4_e2m1fn_x2"
        elif "count" in damage:
            entry["identity"]["counts"][0] = 1e400
        elif "sample" in damage:
            entry["identity"]["samples"][0] = 10**400
        elif "coefficient" in damage:
            entry["coefficients"][0] = 10**400
        else:
            entry["table"] = {"sigmas": [10**400, 0.5], "branches": ["cond"], "gram": [[1.0, 0.0], [0.0, 1.0]],
                              "gains": [1.0, 1.0]}
        text = json.dumps({"flux:x": [entry]}).replace("Infinity", "1e400")
    path.write_text(text)
    said = []
    found = tc().CalibrationStore(path).get("flux:x", ident, said.append)
    assert found is None or ("table" in damage and found.table is None and found.coefficients == (1.0, 0.0, 0.0, 1.0,
                                                                                                   0.0))
    assert bool(said) == damage.startswith("nested"), said
    tc().CalibrationStore(path).put("flux:y", ident, tc().Calibration((2.0, 0.0, 0.0, 1.0, 0.0), None, None))
    assert "flux:y" in json.loads(path.read_text())
    assert [p.read_text() for p in tmp_path.glob("cal.json.unreadable-*")] == ([text] if said else [])


def test_one_calibration_run_serves_teacache_and_magcache_per_cond(flux, conds, _isolated_calibrations):
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds)
    stored = _isolated_calibrations.get(*P().model_identity(flux, SF().detect_family(flux)))
    assert stored.coefficients is not None and set(stored.magnitudes) == {"cond", "uncond"}
    assert [len(v) for v in stored.magnitudes.values()] == [STEPS, STEPS]
    assert stored.magnitudes["cond"] != stored.magnitudes["uncond"]
    ref = sample(flux, conds)
    out = sample(teacache(flux, 0.1, model_type="calibrated", rule="magcache"), conds)
    run = last_run()
    assert run["model_type"] == "calibrated" and run["rule"] == "magcache" and run["calls_skipped"] >= 2
    assert rel_err(out, ref) < 0.3


def _calibration_said(event: str, words: str) -> bool:
    """Whether the stats hold one calibration reason row, counted once: this event, these words."""
    rows = [r for r in P().stats().reasons() if r["reason"].startswith("calibration: ")]
    return [(r["event"], words in r["reason"], r["count"]) for r in rows] == [(event, True, 1)]


@pytest.mark.hardening
def test_a_short_calibration_run_is_discarded_with_one_line(flux, conds, _isolated_calibrations, caplog):
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    with caplog.at_level(logging.INFO, logger="reusekit"):
        sample(cal, conds, steps=4)  # 3 fitted points
    assert "calibration" not in last_run() and not _isolated_calibrations.path.exists()
    assert len([r for r in caplog.records if "only 3 fitted points" in r.getMessage()]) == 1
    assert _calibration_said("refused", "only 3 fitted points")  # the panel shows it
    with pytest.raises(ValueError, match="no calibration"):
        sample(teacache(flux, 0.3, model_type="calibrated"), conds)
    sample(cal, conds, steps=5)  # 4 points: kept
    assert last_run()["calibration"]["points"] == 4


def weights_copy(change=None):
    """Another trained Flux (the same weights), changed in place by ``change(diffusion_model)``."""
    model = tiny_module("trained_flux").build()
    if change is not None:
        with torch.no_grad():
            change(model.model.diffusion_model)
    return model


def plan_of(model, rule="teacache", model_type="calibrated"):
    m = teacache(model, 0.3, rule=rule, model_type=model_type)
    return P().resolve(m.model_options["transformer_options"][P().KEY], m)


def test_a_block_only_fine_tune_gets_no_calibration_of_its_base(flux, conds, _isolated_calibrations):
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds)
    assert plan_of(weights_copy()).used_type == "calibrated"  # the same weights, another object

    def tune(dm):  # one block's weights moved by ~5%
        for p in dm.single_blocks[0].parameters():
            p.mul_(1.05)

    tuned = weights_copy(tune)
    for rule in ("teacache", "magcache"):
        with pytest.raises(ValueError, match="no calibration"):
            plan_of(tuned, rule)
    assert plan_of(tuned, model_type="auto").used_type == "flux"  # auto: the published polynomial instead


def cast(dtype, change=None):
    def changed(dm):
        if change is not None:
            change(dm)
        for p in dm.parameters():
            p.data = p.data.to(dtype)
    return weights_copy(changed)


def test_fp8_and_bf16_copies_of_one_model_read_each_others_calibration(flux, _isolated_calibrations):
    """A copy in another dtype reads the calibration made on the other, until it has its own."""
    bf16, fp8 = cast(torch.bfloat16), cast(torch.float8_e4m3fn)
    family = SF().detect_family(flux)
    cal = tc().Calibration((0, 0, 0, 2.0, 0), {"cond": [(1.0, 0.0), (0.5, 1.0)]})
    _isolated_calibrations.put(*P().model_identity(bf16, family), cal)
    for rule, field in (("teacache", "coefficients"), ("magcache", "magnitudes")):
        assert getattr(plan_of(fp8, rule), field) == getattr(cal, field)
        assert plan_of(fp8, rule).used_type == "calibrated"


def test_a_calibration_made_in_one_dtype_is_read_but_never_replaced_by_a_copy_in_another(
        flux, _isolated_calibrations):
    """Issue 20: an fp8 copy of a 1% fine-tune matches its bf16 base (fp8 rounds by more than the tune
    moved): it may read the base's calibration, and its own calibration is kept beside it, never over it;
    each then reads its own, also from the file in a new process."""
    def tune(dm):
        for p in dm.single_blocks[0].parameters():
            p.mul_(1.01)

    base, tuned_fp8 = cast(torch.bfloat16), cast(torch.float8_e4m3fn, tune)
    family = SF().detect_family(flux)
    base_key, base_ident = P().model_identity(base, family)
    fp8_key, fp8_ident = P().model_identity(tuned_fp8, family)
    assert base_key == fp8_key and fp8_ident.matches(base_ident)  # the situation of the issue
    made_on_base = tc().Calibration((0, 0, 0, 2.0, 0))
    _isolated_calibrations.put(base_key, base_ident, made_on_base)
    assert plan_of(tuned_fp8).coefficients == made_on_base.coefficients  # read across dtypes
    made_on_fp8 = tc().Calibration((0, 0, 0, 3.0, 0))
    _isolated_calibrations.put(fp8_key, fp8_ident, made_on_fp8)
    for store in (_isolated_calibrations, tc().CalibrationStore(_isolated_calibrations.path)):  # memory, file
        P().STORE = store
        assert plan_of(base).coefficients == made_on_base.coefficients
        assert plan_of(tuned_fp8).coefficients == made_on_fp8.coefficients
    stored = json.loads(_isolated_calibrations.path.read_text())
    assert [[e["identity"]["dtypes"][0] for e in entries] for entries in stored.values()] == [
        ["bfloat16", "float8_e4m3fn"]]
    again = tc().Calibration((0, 0, 0, 4.0, 0))  # the same dtype replaces its own entry
    _isolated_calibrations.put(base_key, base_ident, again)
    assert [len(entries) for entries in json.loads(_isolated_calibrations.path.read_text()).values()] == [2]


def test_auto_takes_the_published_table_of_the_models_variant(flux, conds, monkeypatch):
    """auto reads the variant from the model and the run's conds (step_families.model_variant): the run
    then decides exactly as with that variant's table named, and its report names the variant."""
    seen = []

    def kontext(family, model_patcher, conds):
        seen.append(sorted(conds))
        return "flux-kontext"

    runs = {}
    for rule in ("teacache", "magcache"):
        sample(teacache(flux, 0.3, rule=rule, model_type="flux-kontext"), conds)
        runs["named", rule] = last_run()
        with monkeypatch.context() as mp:
            mp.setattr(SF(), "model_variant", kontext)
            sample(teacache(flux, 0.3, rule=rule, model_type="auto"), conds)
        runs["auto", rule] = last_run()
        assert runs["auto", rule]["variant"] == runs["auto", rule]["model_type"] == "flux-kontext"
        assert runs["auto", rule]["conds"] == runs["named", rule]["conds"]
        sample(teacache(flux, 0.3, rule=rule, model_type="auto"), conds)
        assert last_run()["conds"] != runs["named", rule]["conds"]  # the plain Flux table decides otherwise
    assert seen and all(c == ["negative", "positive"] for c in seen)


def test_a_calibration_file_that_cannot_be_written_keeps_the_run_and_the_calibration(flux, conds, monkeypatch,
                                                                                     tmp_path, caplog):
    target = tmp_path / "reusekit" / "teacache_calibration.json"
    target.mkdir(parents=True)  # a folder where the file should be: the final rename fails
    monkeypatch.setattr(P(), "STORE", tc().CalibrationStore(target))
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    with caplog.at_level(logging.WARNING, logger="reusekit"):
        out = sample(cal, conds)
    assert torch.equal(out, sample(flux, conds))
    assert "could not save the calibration" in caplog.text and str(target) in caplog.text
    assert _calibration_said("fallback", f"could not save the calibration to {target}")
    assert last_run()["calibration"]["points"] == STEPS - 1
    sample(teacache(flux, 0.3, model_type="calibrated"), conds)  # kept in memory for this process
    assert last_run()["model_type"] == "calibrated"
    left = sorted(p.name for p in target.parent.iterdir())  # beside it only the writers' lock: no temporary file
    assert left == [target.name, f"{target.name}.lock"] and not any(target.iterdir())


def test_a_calibration_file_that_cannot_be_read_is_named_where_the_user_sees_it(flux, conds,
                                                                              _isolated_calibrations):
    """A calibration file broken by hand (a stray comma): every calibration in it was passed over as if none had
    been made, with no row naming the file, and a calibrated run was refused with "run it once". Now an auto
    run falls back to the published table, counted naming the file; a calibrated one is refused naming it."""
    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    sample(cal, conds)
    sample(teacache(flux, 0.3, model_type="calibrated"), conds)
    calibrated = sample(teacache(flux, 0.3, model_type="calibrated"), conds)
    path = _isolated_calibrations.path
    path.write_text(path.read_text().rstrip().rstrip("}") + ",}")
    P().STORE = tc().CalibrationStore(path)  # a new process: nothing in memory
    P().stats().reset_counters()
    auto = sample(teacache(flux, 0.3, model_type="auto"), conds)
    assert last_run()["model_type"] == "flux" and not torch.equal(auto, calibrated)
    assert torch.equal(auto, sample(teacache(flux, 0.3, model_type="flux"), conds))  # the published table's run
    rows = [r for r in P().stats().reasons() if str(path) in r["reason"]]
    assert [r["event"] for r in rows] == ["fallback"] and "cannot be read" in rows[0]["reason"], rows
    with pytest.raises(ValueError, match=f"model_type: no calibration .*{re.escape(str(path))} cannot be read"):
        sample(teacache(flux, 0.3, model_type="calibrated"), conds)
    assert [r["event"] for r in P().stats().reasons() if str(path) in r["reason"]] == ["fallback", "refused"]


def test_a_calibration_is_found_whichever_lora_clone_of_the_model_sampled_before(conds):
    """The calibration key is read before the run loads its weights, when they may still hold the
    patches of the clone that sampled last: the key must come from the weights as loaded."""
    model = tiny_module("trained_flux").build()
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    sample(cal, conds)
    lora = model.clone()  # a patch on a sampled weight (img_in), the way LoRA loaders add them
    weight = model.model.diffusion_model.img_in.weight
    lora.add_patches({"diffusion_model.img_in.weight": (torch.randn(weight.shape) * 0.1,)}, 1.0)
    sample(lora, conds)
    sample(teacache(model, 0.3, model_type="calibrated"), conds)
    assert last_run()["model_type"] == "calibrated"


def fail_at(model, call, interrupt=True):
    """A clone of ``model`` that stops sampling at its ``call``-th model call: through ComfyUI's own
    interrupt (a BaseException from 0.33), or with a RuntimeError of its own."""
    import comfy.model_management
    import comfy.patcher_extension

    calls = []

    def wrapper(executor, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            if not interrupt:
                raise RuntimeError("the sampler's own failure")
            comfy.model_management.interrupt_current_processing(True)
            comfy.model_management.throw_exception_if_processing_interrupted()
        return executor(*args, **kwargs)

    m = model.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test_fail_at", wrapper)
    return m


@pytest.mark.hardening
def test_an_interrupted_calibration_is_never_saved_nor_used(flux, conds, _isolated_calibrations, caplog):
    import comfy.model_management

    (cal,) = N().TeaCacheCalibrateNode.execute(flux).args
    with caplog.at_level(logging.INFO, logger="reusekit"), \
            pytest.raises(comfy.model_management.InterruptProcessingException):
        sample(fail_at(cal, 4), conds)
    run = last_run()
    assert run["outcome"] == "interrupted" and "calibration" not in run
    assert not _isolated_calibrations.path.exists()
    assert "nothing is saved" in caplog.text
    assert _calibration_said("refused", "the run did not complete (interrupted); nothing is saved")
    sample(teacache(flux, 0.3, model_type="auto"), conds)
    assert last_run()["model_type"] == "flux"  # the published polynomial, not 3 points of an interrupted run
    for rule in ("teacache", "magcache", "schedule"):  # no table of any rule from the interrupted run
        with pytest.raises(ValueError, match="no calibration"):
            sample(teacache(flux, 0.3, model_type="calibrated", rule=rule), conds)


@pytest.mark.hardening
def test_an_interrupted_run_is_reported_interrupted_and_the_next_run_is_clean(flux, conds, caplog):
    import comfy.model_management

    model = teacache(flux, 0.8)
    clean = sample(model, conds)
    with caplog.at_level(logging.INFO, logger="reusekit"), \
            pytest.raises(comfy.model_management.InterruptProcessingException):
        sample(fail_at(model, 5), conds)
    run = last_run()
    assert run["outcome"] == "interrupted" and run["calls_computed"] + run["calls_skipped"] == 4
    lines = [r.getMessage() for r in caplog.records if "ReuseKit Step Cache (flux" in r.getMessage()]
    assert len(lines) == 1 and ", interrupted:" in lines[0]
    assert torch.equal(sample(model, conds), clean)
    assert last_run()["outcome"] == "completed"


@pytest.mark.hardening
def test_a_failing_sampler_raises_its_own_error_even_when_the_report_fails(flux, conds, monkeypatch, caplog):
    def broken(self, total_steps=None):
        raise ValueError("the report broke")

    monkeypatch.setattr(tc().RunState, "summary", broken)
    with pytest.raises(RuntimeError, match="the sampler's own failure"):
        sample(fail_at(teacache(flux, 0.8), 3, interrupt=False), conds)
    with caplog.at_level(logging.ERROR, logger="reusekit"):  # a run that succeeds keeps its latent
        assert torch.equal(sample(teacache(flux, 0.0), conds), sample(flux, conds))
    assert "could not report the run" in caplog.text
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="the sampler's own failure"):
        sample(fail_at(teacache(flux, 0.8), 3, interrupt=False), conds)
    assert last_run()["outcome"] == "failed"


@pytest.mark.hardening
def test_a_failed_run_keeps_no_residuals_while_its_error_is_held(flux, conds):
    """ComfyUI keeps a node's exception (and its traceback's frames) while it reports it and frees
    memory after an OOM: the run those frames reach must hold no tensors by then."""
    import traceback

    with pytest.raises(RuntimeError, match="the sampler's own failure") as failure:
        sample(fail_at(teacache(flux, 0.0, device="cpu"), 4, interrupt=False), conds)
    runs = [v for frame, _ in traceback.walk_tb(failure.value.__traceback__)
            for v in frame.f_locals.values() if isinstance(v, tc().RunState)]
    assert runs and all(r.residual_bytes() == {"cpu": 0, "device": 0} for r in runs)
    assert last_run()["outcome"] == "failed" and sum(last_run()["peak_residual_bytes"].values()) > 0
    sample(teacache(flux, 0.0, device="cpu"), conds)  # a completed run still reports what it held
    assert last_run()["outcome"] == "completed" and last_run()["peak_residual_bytes"]["cpu"] > 0


def test_two_step_cached_models_in_one_workflow_keep_their_own_reports(conds):
    """Wan 2.2's two experts (or any two models) sampled one after the other: each run's report
    stays in the stats under its model, not overwritten by the other's."""
    spec = H().family_spec("wan22_14b")
    high, low = spec.build(0), spec.build(1)
    shape = (1, 16, 1, 8, 8)
    sample(teacache(high, 0.0, model_type="auto"), conds, steps=4, shape=shape)
    sample(teacache(low, 2.0, model_type="auto", rule="interval"), conds, steps=6, shape=shape)
    models = P().stats().snapshot()["info"]["models"]
    wan = next(f for f in SF().FAMILIES if f.name == "wan")
    first = models[P().model_label(wan, P().model_fingerprint(high, wan))]
    second = models[P().model_label(wan, P().model_fingerprint(low, wan))]
    assert first["steps"] == 4 and first["calls_skipped"] == 0
    assert second["steps"] == 6 and second["calls_skipped"] >= 1
    assert last_run()["model"] == second["model"] != first["model"]


def test_a_later_node_replacing_the_last_block_patch_never_skips(flux, conds, caplog):
    """A node applied after the cache that replaces its last block's patch would, on a skip, run
    that block on the stack input: the cache must compute instead, and say so once."""
    last = SF().FAMILIES[1].blocks(flux.model.diffusion_model)[-1]
    ref = sample(flux, conds)
    after = teacache(flux, 5.0)
    after.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", *last)
    with caplog.at_level(logging.WARNING, logger="reusekit"):
        out = sample(after, conds)
    assert torch.equal(out, ref)
    run = last_run()
    assert run["calls_skipped"] == 0 and run["calls_computed"] == STEPS
    assert "replaced the patch of single_block" in run["disabled_reason"]
    assert len([r for r in caplog.records if "replaced the patch of" in r.getMessage()]) <= 1
    sample(teacache(flux, 5.0), conds)  # its own patches: skips again, nothing disabled
    assert last_run()["disabled_reason"] is None and last_run()["calls_skipped"] >= 1


def test_a_model_whose_blocks_never_reach_the_cache_computes_and_says_so(flux, conds, monkeypatch, caplog):
    """A variant whose block calls never reach the cache's patches (no transformer_options, or other
    block names): every call computed, counted and reported, never "computed 0 of 0"."""
    import dataclasses

    families = tuple(dataclasses.replace(f, blocks=lambda dm: [("double_block", 99)]) if f.name == "flux" else f
                     for f in SF().FAMILIES)
    monkeypatch.setattr(SF(), "FAMILIES", families)
    ref = sample(flux, conds)
    with caplog.at_level(logging.WARNING, logger="reusekit"):
        out = sample(teacache(flux, 5.0), conds)
    assert torch.equal(out, ref)
    run = last_run()
    assert run["calls_computed"] == STEPS and run["unhooked_calls"] == STEPS and run["calls_skipped"] == 0
    assert "never reached the step cache" in caplog.text


# ---- other families ---------------------------------------------------------------------

PUBLISHED_DEFAULT = {"wan": "wan2.1_t2v_1.3B_ret_mode", "hunyuan_video": "hunyuan_video"}


@pytest.mark.parametrize("family,shape", [("wan", (1, 16, 3, 8, 8)), ("qwen_image", (1, 16, 1, 8, 8)),
                                          ("hunyuan_video", (1, 16, 2, 8, 8))])
def test_other_families_calibrate_and_skip_through_the_real_ksampler(tiny, conds, family, shape):
    builder = tiny.tiny_wan if family == "wan" else getattr(tiny_module("step_families"), f"tiny_{family}")
    model = builder(0)
    ref = sample(model, conds, steps=6, shape=shape)
    if family in PUBLISHED_DEFAULT:  # published coefficients by default (made for the real models)
        exact = sample(teacache(model, 0.0, model_type="auto"), conds, steps=6, shape=shape)
        assert torch.equal(exact, ref) and last_run()["model_type"] == PUBLISHED_DEFAULT[family]
    else:  # no published coefficients: a clear error until calibrated
        with pytest.raises(ValueError, match="ReuseKit Step Cache: model_type: no calibration"):
            sample(teacache(model, 0.0, model_type="auto"), conds, steps=6, shape=shape)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    sample(cal, conds, steps=6, shape=shape)
    out = sample(teacache(model, 3.0, model_type="auto"), conds, steps=6, shape=shape)
    run = last_run()
    assert run["family"] == family and run["model_type"] == "calibrated" and run["calls_skipped"] >= 1
    assert out.shape == ref.shape and torch.isfinite(out).all()


def test_hunyuan_video_with_a_guiding_frame_reads_its_per_frame_modulation_and_skips(tiny, conds):
    """HunyuanVideo I2V ("v2 (replace)") modulates the guiding frame and the rest with two vectors
    (modulation_dims); the modulated input must be read the block's way, or the family never skips."""
    model = tiny_module("step_families").tiny_hunyuan_video(0)
    guided = tuple([[c, {**extra, "guiding_frame_index": 0}] for c, extra in cond] for cond in conds)
    shape = (1, 16, 2, 8, 8)
    ref = sample(model, guided, steps=6, cfg=1.0, shape=shape)
    assert torch.equal(sample(teacache(model, 0.0, model_type="hunyuan_video"), guided, steps=6, cfg=1.0,
                                 shape=shape), ref)
    out = sample(teacache(model, 10.0, model_type="hunyuan_video"), guided, steps=6, cfg=1.0, shape=shape)
    assert last_run()["calls_skipped"] >= 1 and torch.isfinite(out).all()


def skip_without_timestep_zero(model):
    import inspect

    if "index_timestep_zero" not in inspect.getsource(type(model.model.diffusion_model)._forward):
        pytest.skip("this ComfyUI's Flux has no index_timestep_zero reference method")


def flux_call(model, x, to, conds, sigma=0.5):
    sigma = torch.tensor([sigma])
    to["sigmas"] = sigma
    with torch.inference_mode():
        return model.model.apply_model(x, sigma, c_crossattn=conds[0][0][0], y=conds[0][0][1]["pooled_output"],
                                       transformer_options=to)


def flux_options(model):
    to = model.model_options["transformer_options"].copy()
    to.update({"wrappers": model.wrappers, "uuids": ["c"], "cond_or_uncond": [0]})
    to[P().RUN_KEY] = call_state(to)
    return to


@pytest.mark.parametrize("rule,mode", SAME_INPUT)
def test_on_the_same_input_every_rule_and_mode_returns_the_computed_output(flux, conds, rule, mode):
    """After three computed calls (so every forecast holds its differences), a skip at the last computed
    call's sigma, on its input, gives its output. The modes that forecast in call index go on one call
    further, so for them the three computed calls are all on that input (their differences: zero)."""
    m = teacache(flux, EXACT.get(rule, 0.0), rule=rule, mode=mode)
    to = flux_options(m)
    plan_every_call(to[P().RUN_KEY], "C")
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    for s in (0.9, 0.7):
        flux_call(m, x if mode in STEP_MODES else x * s, to, conds, 0.5 if mode in STEP_MODES else s)
    computed = flux_call(m, x, to, conds, 0.5)
    to[P().RUN_KEY].config = dataclasses.replace(to[P().RUN_KEY].config, threshold=SKIPPING.get(rule, 1.0))
    plan_every_call(to[P().RUN_KEY], "S")
    H().ready_to_skip(to[P().RUN_KEY])
    skipped = flux_call(m, x, to, conds, 0.5)
    assert to[P().RUN_KEY].conds[("c", 0)].pattern == ["C", "C", "C", "S"]
    assert torch.allclose(skipped, computed, atol=1e-5), rel_err(skipped, computed)


@pytest.mark.parametrize("first_blocks", [1, 2, 3])  # the tiny Flux: 2 double blocks, then 2 single
def test_first_block_skips_add_the_rest_of_the_stack_to_the_recomputed_first_blocks(flux, conds, first_blocks):
    """On a changed input, first_block's skip runs its first blocks anew (1: First-Block; more: DBCache's Fn,
    here within the double stream and across into the single one) and adds the residual the blocks after
    them made at the computed call: the model's output is what the host's own forward gives when its stack
    ends in exactly that sum. The trace holds the first blocks' distance."""
    seen = {"first": [], "last": []}

    def recorder(name):
        def patch(args, extra):
            out = extra["original_block"](args)
            seen[name].append(out["img"].clone())
            return out
        return patch

    base = flux.clone()
    blocks = P().detect_family(flux).blocks(flux.model.diffusion_model)
    last = blocks[-1]
    base.set_model_patch_replace(recorder("first"), "dit", *blocks[first_blocks - 1])
    base.set_model_patch_replace(recorder("last"), "dit", *last)
    m = teacache(base, 10.0, rule="first_block", mode="reuse", first_blocks=first_blocks)
    to = flux_options(m)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    moved = x + 0.3 * torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    flux_call(m, x, to, conds)
    skipped = flux_call(m, moved, to, conds)
    state = to[P().RUN_KEY].conds[("c", 0)]
    assert state.pattern == ["C", "S"], state.trace
    assert len(seen["first"]) == 2 and len(seen["last"]) == 1
    assert 0 < float(state.trace[1]) < 10.0
    n = x.shape[-2] * x.shape[-1] // 4  # image tokens (2x2 patches): the end of the single stream (text first)
    stack_out = seen["first"][1][:, -n:] + (seen["last"][0][:, -n:] - seen["first"][0][:, -n:])

    def ends_in_that_sum(args, extra):
        out = extra["original_block"](args)
        return {**out, "img": torch.cat([out["img"][:, :-n], stack_out], 1)}

    expected_model = flux.clone()
    expected_model.set_model_patch_replace(ends_in_that_sum, "dit", *last)
    expected = flux_call(expected_model, moved, {"patches_replace": expected_model.model_options[
        "transformer_options"]["patches_replace"]}, conds)
    assert torch.allclose(skipped, expected, atol=1e-5), rel_err(skipped, expected)
    assert not torch.allclose(skipped, flux_call(flux, moved, {}, conds), atol=1e-3)  # it did skip work


# family (in tests/tinymodels/families.py), the step cache's name for it, extra call inputs
RESULT_FAMILIES = {
    "flux": ("flux", {}),
    "hunyuan_video": ("hunyuan_video", {}),
    "wan": ("wan", {}),
    "qwen_image": ("qwen_image", {}),
    "flux2": ("flux2", {}),
    "flux2_klein": ("flux2", {}),
    "flux2_index_timestep_zero": ("flux2", {"ref_latents_method": "index_timestep_zero"}),
    "qwen_image_edit": ("qwen_image", {}),
    "hunyuan_video15": ("hunyuan_video15", {}),
    "wan22": ("wan22", {}),
    "wan22_14b": ("wan", {}),
}


@pytest.mark.parametrize("rule,second,mode", [(r, "S", "reuse") for r in SAME_INPUT_RULES]
                         + [("schedule", "H", "reuse"), ("interval", "S", "output")])
@pytest.mark.parametrize("name", list(RESULT_FAMILIES))
def test_a_skipped_step_on_the_same_input_returns_the_computed_output(name, rule, second, mode):
    """Per family, cond and uncond batched: the second call on the same input skips and must give the
    first one's output, so the residual is taken from and added to the image tokens, wherever the
    host puts them (HunyuanVideo's single stream is text first from ComfyUI 0.14) and however the
    block is modulated (the doubled timestep-zero modulation of Flux.2 / Qwen-Image-Edit-2511). The
    schedule rule's cond-only step (H) too: the cond's rows run alone, the uncond's are rebuilt from
    them and the difference measured at the first call. The output mode too: the model's output kept per
    cond and given back in the batch's order."""
    spec_name = "flux2_klein" if name == "flux2_index_timestep_zero" else name  # the host doubles no guidance
    family, extra = RESULT_FAMILIES[name]
    spec = H().family_spec(spec_name)
    model = spec.build(0)
    x, sigma, kwargs = spec.inputs(spec.sizes[0], 0)
    if extra.get("ref_latents_method"):
        skip_without_timestep_zero(model)
        kwargs = dict(kwargs, ref_latents=[torch.randn((1, *spec.sizes[0][:-2], 4, 6),
                                                       generator=torch.Generator().manual_seed(7))], **extra)
    x, sigma, kwargs = H().batched(x, sigma, kwargs)
    cached = teacache(model, SKIPPING.get(rule, 1.0), model_type="auto", mode=mode, rule=rule)
    settings = cached.model_options["transformer_options"][P().KEY]
    assert settings.family.name == family
    first, again, run = H().two_calls(cached, x, sigma, kwargs, second=second)
    one_block = rule == "first_block" and len(settings.blocks) == 1  # the first block is the whole stack
    want = [["C", "C"], ["C", "S"]] if second == "H" else [["C", "C" if one_block else "S"]] * 2
    assert [s.pattern for s in run.conds.values()] == want
    assert torch.allclose(again, first, atol=1e-5, rtol=1e-5), rel_err(again, first)


# family (families.py), the step cache's name, latent shape, extra cond values, latent fill
NEW_FAMILIES = {
    "flux2": ("flux2", (1, 128, 8, 8), {}, 0.0),
    "flux2_klein_index_timestep_zero": ("flux2", (1, 128, 8, 8), {"reference_latents_method": "index_timestep_zero"},
                                        0.0),
    "qwen_image_edit": ("qwen_image", (1, 16, 1, 8, 8), {}, 0.0),
    "hunyuan_video15": ("hunyuan_video15", (1, 16, 2, 8, 8), {}, 0.1),  # tiny: 16 latent channels, not 32
    "wan22": ("wan22", (1, 48, 2, 8, 8), {}, 0.0),
}


@pytest.mark.parametrize("name", list(NEW_FAMILIES))
def test_families_of_the_current_host_calibrate_then_skip_through_the_real_ksampler(conds, name):
    """cond and uncond batched under CFG, reference latents where the family takes them (Flux.2
    Klein and Qwen-Image-Edit-2511 at timestep zero: these crashed the sampler): no published
    coefficients, so a clear error until calibrated, then skipped steps and a finite latent."""
    family, shape, extra, fill = NEW_FAMILIES[name]
    spec = H().family_spec(name.removesuffix("_index_timestep_zero"))
    model = spec.build(0)
    if "reference_latents_method" in extra:
        skip_without_timestep_zero(model)
    if spec.has_ref_latents:
        ref = torch.randn((1, *shape[1:-2], 4, 6), generator=torch.Generator().manual_seed(7))
        extra = {"reference_latents": [ref], **extra}
    conds = tuple([[c, {**e, **extra}] for c, e in cond] for cond in conds)
    ref_out = sample(model, conds, steps=6, shape=shape, fill=fill)
    with pytest.raises(ValueError, match="ReuseKit Step Cache: model_type: no calibration"):
        sample(teacache(model, 0.0, model_type="auto"), conds, steps=6, shape=shape, fill=fill)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    assert torch.equal(sample(cal, conds, steps=6, shape=shape, fill=fill), ref_out)
    assert last_run()["calibration"]["points"] >= 2
    out = sample(teacache(model, 3.0, model_type="auto"), conds, steps=6, shape=shape, fill=fill)
    run = last_run()
    assert run["family"] == family and run["model_type"] == "calibrated" and run["calls_skipped"] >= 1
    assert set(run["conds"]) == {"cond", "uncond"}
    assert out.shape == ref_out.shape and torch.isfinite(out).all()


def test_the_two_wan22_experts_keep_separate_state_and_calibrations(conds):
    """Wan 2.2 14B samples with a high-noise and a low-noise expert, one after the other: each has
    its own calibration and its own run state (the second starts clean, never reusing the first's
    residual)."""
    import nodes

    spec = H().family_spec("wan22_14b")
    high, low = spec.build(0), spec.build(1)
    shape = (1, 16, 1, 8, 8)
    latent = {"samples": torch.zeros(shape)}
    for expert in (high, low):
        (cal,) = N().TeaCacheCalibrateNode.execute(expert).args
        sample(cal, conds, steps=6, shape=shape)
    pos, neg = conds
    adv = nodes.KSamplerAdvanced()
    runs = []
    (half,) = adv.sample(teacache(high, 3.0, model_type="calibrated"), "enable", 3, 8, 3.0, "euler", "simple",
                         pos, neg, latent, 0, 4, "enable")
    runs.append(last_run())
    (done,) = adv.sample(teacache(low, 3.0, model_type="calibrated"), "disable", 3, 8, 3.0, "euler", "simple",
                         pos, neg, half, 4, 8, "disable")
    runs.append(last_run())
    assert torch.isfinite(done["samples"]).all()
    for run in runs:
        assert run["model_type"] == "calibrated" and run["family"] == "wan"
        assert all(c["pattern"][0] == "C" and len(c["pattern"]) == 4 for c in run["conds"].values())
    wan = next(f for f in SF().FAMILIES if f.name == "wan")
    assert P().STORE.get(*P().model_identity(high, wan)) != P().STORE.get(*P().model_identity(low, wan))


def test_a_call_on_another_model_under_the_cached_models_options_is_computed_as_that_model_computes_it(
        flux, tiny, conds):
    """The Dual Model CFG Guider (0.33) runs its negative model under the main model's options, so the step
    cache's wrappers and block patches reach it. On a deeper model a skip decided at our first block ran the
    blocks past our last one on top of the reused residual: on the call's own input 2.6% from what that model
    computes. Each call on a model whose blocks are not the patched ones is computed, counted, and its output
    is the model's own."""
    deeper = tiny.tiny_flux(1, depth=2, depth_single_blocks=3, vec_in_dim=32, context_in_dim=32)
    m = teacache(flux, 0.0, mode="reuse")
    to = flux_options(m)
    plan_every_call(to[P().RUN_KEY], "C")
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    for s in (0.9, 0.7, 0.5):
        flux_call(m, x * s, to, conds, s)
    to[P().RUN_KEY].config = dataclasses.replace(to[P().RUN_KEY].config, threshold=1e9)
    plan_every_call(to[P().RUN_KEY], "S")
    for s in (0.9, 0.5):
        assert torch.equal(flux_call(deeper, x * s, to, conds, s), flux_call(deeper, x * s, {}, conds, s))
    assert to[P().RUN_KEY].conds[("c", 0)].pattern == ["C", "C", "C"]  # the main model's state untouched
    assert to[P().RUN_KEY].calls_computed == 3 + 2
    assert any("a call on another model (Flux" in r["reason"] for r in P().stats().snapshot()["reasons"])
    assert flux_call(m, x * 0.5, to, conds, 0.5) is not None
    assert to[P().RUN_KEY].conds[("c", 0)].pattern == ["C", "C", "C", "S"]  # the main model still skips


def test_the_patched_model_compiled_or_copied_is_its_own_and_another_class_or_depth_is_not(flux, tiny):
    """TorchCompileModel swaps the OptimizedModule in for the diffusion model while a call runs (an
    APPLY_MODEL family's wrapper sees it); a multi-GPU copy is another object of the same class and blocks."""
    import copy

    settings = teacache(flux, 0.3).model_options["transformer_options"][P().KEY]
    dm = flux.model.diffusion_model
    assert settings.foreign(dm) is None and settings.foreign(copy.deepcopy(dm)) is None
    assert settings.foreign(torch.compile(dm, backend="eager")) is None
    deeper = tiny.tiny_flux(1, depth=2, depth_single_blocks=3, vec_in_dim=32, context_in_dim=32)
    assert "a call on another model (Flux" in settings.foreign(deeper.model.diffusion_model)
    assert "(WanModel" in settings.foreign(tiny.tiny_wan(0).model.diffusion_model)


def test_the_dual_model_guiders_negative_model_is_computed_and_its_positive_model_skips(flux, tiny, conds):
    """Through the real guider and sampler: the positive model's calls are cached, the negative model's
    computed (before, at this threshold, 3 of its 10 were skipped); with nothing skipped the picture is the
    uncached one."""
    ncs = pytest.importorskip("comfy_extras.nodes_custom_sampler")
    if not hasattr(ncs, "Guider_DualModel"):
        pytest.skip("this ComfyUI has no Dual Model CFG Guider")
    import comfy.sample
    import comfy.samplers

    deeper = tiny.tiny_flux(1, depth=2, depth_single_blocks=3, vec_in_dim=32, context_in_dim=32)

    def guided(model):
        guider = ncs.Guider_DualModel(model, deeper)
        guider.set_conds(*conds)
        guider.set_cfg(3.0)
        latent = torch.zeros((1, 16, 8, 8))
        sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", STEPS)
        return guider.sample(comfy.sample.prepare_noise(latent, 3), latent, comfy.samplers.sampler_object("euler"),
                             sigmas, seed=3)

    reference = guided(flux)
    assert torch.equal(guided(teacache(flux, 0.0, model_type="auto")), reference)
    guided(teacache(flux, 1.0, model_type="auto", mode="reuse"))
    run = last_run()
    (positive,) = run["conds"].values()  # the negative model's calls keep no state
    assert positive["skipped"] >= 3 and run["calls_skipped"] == positive["skipped"]
    assert run["calls_computed"] == STEPS + positive["computed"]  # every call of the negative model


@pytest.mark.parametrize("name,cls", [("omnigen2", "OmniGen2Transformer2DModel"),
                                      ("hidream", "HiDreamImageTransformer2DModel")])
def test_a_family_without_block_seams_is_a_clear_error_at_the_node(name, cls):
    """OmniGen2 and HiDream (no block-replace seam) cannot be hooked without copying a core forward: the
    node says so, naming itself and the input."""
    model = H().family_spec(name).build(0)
    for node in (N().TeaCacheNode, ):
        with pytest.raises(ValueError, match=f"ReuseKit Step Cache: model: .*does not support {cls}"):
            node.execute(model, "auto", 0.4, 0.0, 1.0, 0, "device", "reuse")
    with pytest.raises(ValueError, match=f"ReuseKit TeaCache Calibrate: model: .*does not support {cls}"):
        N().TeaCacheCalibrateNode.execute(model)


def test_a_host_that_reshaped_what_a_family_reads_runs_that_family_uncached(flux, conds, monkeypatch):
    """A ComfyUI whose ``apply_mod`` does not take what the Flux family calls it with (as a newer
    one might): the node passes the model through (the host's own latent), and the start-up report
    lists the step cache for Flux as off."""
    import dataclasses

    ref = sample(flux, conds)
    reshaped = (("comfy.ldm.flux.layers:apply_mod", ("tensor", "m_mult", "m_add", "modulation_slices")),)
    families = tuple(dataclasses.replace(f, seams=reshaped) if f.name == "flux" else f for f in SF().FAMILIES)
    monkeypatch.setattr(SF(), "FAMILIES", families)
    model = teacache(flux, 5.0)
    assert P().KEY not in model.model_options["transformer_options"]
    assert torch.equal(sample(model, conds), ref)
    assert "apply_mod" in rkharness.pack("patches.host").off_features()["TeaCache (flux)"]


def test_a_batch_a_wrapper_made_uneven_is_decided_as_one_counted(flux, conds):
    """A model function wrapper that adds a row to the batch (a reference row: 3 rows for 2 conds): the
    conds were decided as one with no row saying so. Now it is counted; nothing is skipped at threshold 0,
    so the picture is the wrapper's own."""
    def extra_row(apply_model, a):
        x, t, c = a["input"], a["timestep"], a["c"]
        grown = {k: torch.cat([v, v[:1]]) if torch.is_tensor(v) and v.ndim and v.shape[0] == x.shape[0] else v
                 for k, v in c.items()}
        return apply_model(torch.cat([x, x[:1]]), torch.cat([t, t[:1]]), **grown)[:x.shape[0]]

    model = flux.clone()
    model.set_model_unet_function_wrapper(extra_row)
    plain = sample(model, conds)
    assert torch.equal(sample(teacache(model, 0.0), conds), plain)
    assert list(last_run()["conds"]) == ["batch"]
    rows = [r for r in P().stats().reasons() if "does not split across its 2 conds" in r["reason"]]
    assert [r["event"] for r in rows] == ["fallback"] and rows[0]["count"] == STEPS


def test_a_host_without_the_wrapper_kinds_passes_the_model_through(flux, monkeypatch):
    """A ComfyUI whose WrappersMP lacks a kind the cache wraps: the node returns a plain clone and
    the host's report names it, never an AttributeError from the node."""
    import comfy.patcher_extension

    class Reshaped:
        OUTER_SAMPLE = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE

    monkeypatch.setattr(comfy.patcher_extension, "WrappersMP", Reshaped)
    model = teacache(flux, 0.4)
    assert model is not flux and P().KEY not in model.model_options["transformer_options"]
    assert "DIFFUSION_MODEL" in rkharness.pack("patches.host").off_features()["TeaCache (flux)"]


@pytest.mark.parametrize("mode", ["extrapolate", "output"])
def test_a_step_whose_decision_cannot_run_is_computed_and_never_crashes(flux, conds, monkeypatch, caplog, mode):
    """A model variant whose modulated input cannot be read: every step computed (the uncached
    latent exactly), no residual (nor output) kept for a decision that never ran, one warning."""
    import dataclasses

    def unreadable(dm, args):
        raise RuntimeError("a layout this pack does not know")

    families = tuple(dataclasses.replace(f, modulated=unreadable) if f.name == "flux" else f for f in SF().FAMILIES)
    monkeypatch.setattr(SF(), "FAMILIES", families)
    ref = sample(flux, conds)
    with caplog.at_level(logging.WARNING, logger="reusekit"):
        out = sample(teacache(flux, 5.0, mode=mode), conds)
        again = sample(teacache(flux, 5.0, mode=mode), conds)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    run = last_run()
    assert run["calls_skipped"] == 0 and run["calls_computed"] == STEPS
    assert run["peak_residual_bytes"] == {"device": 0, "cpu": 0}
    warnings = [r for r in caplog.records if "cannot read the modulated input" in r.getMessage()]
    assert len(warnings) <= 1


# ---- the example workflow ------------------------------------------------------------------

@pytest.mark.workflows
def test_example_workflow_runs_on_the_trained_flux(harness):
    wf = harness.load_workflow("step_cache_flux.json")
    assert any(n["type"] == "Note" for n in wf["nodes"])
    prompt = harness.workflow_to_prompt(wf, family="flux_trained", overrides={
        "8": {"width": 64, "height": 64}, "9": {"steps": STEPS}})
    assert prompt["4"]["class_type"] == "ReuseKitTeaCache" and prompt["4"]["inputs"]["threshold"] == 0.4
    result = harness.Executor(cache="none").run(prompt)
    run = last_run()
    assert run["family"] == "flux" and run["calls_skipped"] >= 1
    assert "teacache" in result["outputs"]["12"]["text"][0]
    prompt["9"]["inputs"]["model"] = prompt["4"]["inputs"]["model"]  # the same prompt without the step cache
    plain = harness.Executor(cache="none").run(prompt)
    cached, reference = (harness.output_pixels(r["outputs"]["11"]).astype(np.float64) for r in (result, plain))
    psnr = 10 * np.log10(255.0 ** 2 / max(np.mean((cached - reference) ** 2), 1e-12))
    print(f"example workflow: {run['calls_computed']} of {run['calls_computed'] + run['calls_skipped']} calls, "
          f"{psnr:.1f} dB against the uncached picture")
    assert psnr > 30


@pytest.mark.workflows
@pytest.mark.parametrize("cache", ["classic", "lru"])
def test_a_calibration_saved_between_prompts_reaches_the_next_run_of_a_cached_graph(harness, cache):
    """ComfyUI keeps a node's outputs while its inputs stand; a calibration saved since (another prompt, another
    process) changes what the step cache's auto resolves to. The step cache graph queued again kept the
    uncalibrated picture, where a new server gives the calibrated one; it now runs again, and only then."""
    import copy

    wf = harness.load_workflow("step_cache_flux.json")
    prompt = harness.workflow_to_prompt(wf, family="flux_trained", overrides={
        "8": {"width": 64, "height": 64}, "9": {"steps": STEPS}})
    prompt["4"]["inputs"]["threshold"] = -1.0  # auto: the calibrated schedule once there is a calibration
    calibrate = copy.deepcopy(prompt)
    calibrate["4"] = {"class_type": "ReuseKitTeaCacheCalibrate", "inputs": {"model": prompt["4"]["inputs"]["model"]}}
    executor = harness.Executor(cache=cache)

    def run(p, on=executor):  # a new copy each time, as the server parses each prompt anew
        on.run(copy.deepcopy(p))
        return on.output("9")[0][0]["samples"].clone(), last_run()

    before, first = run(prompt)
    assert first["model_type"] != "calibrated"
    again, second = run(prompt)
    assert second == first and torch.equal(again, before)  # nothing saved: ComfyUI's cache answers
    node = N().TeaCacheNode  # a published type or a rule with no table never reads one: its stamp stands
    unread = [node.fingerprint_inputs(model_type="flux"), node.fingerprint_inputs(model_type="auto", rule="interval")]
    run(calibrate)
    assert [node.fingerprint_inputs(model_type="flux"),
            node.fingerprint_inputs(model_type="auto", rule="interval")] == unread
    after, third = run(prompt)
    assert third["model_type"] == "calibrated", third
    fresh, _ = run(prompt, harness.Executor(cache="classic"))
    assert torch.equal(after, fresh) and not torch.equal(after, before)


@pytest.mark.gpu
def test_on_cuda_residuals_live_where_cache_device_says_and_the_latents_agree(flux, conds):
    on_device = sample(teacache(flux, 0.8), conds)
    peak_device = last_run()["peak_residual_bytes"]
    on_cpu = sample(teacache(flux, 0.8, device="cpu"), conds)
    peak_cpu = last_run()["peak_residual_bytes"]
    assert peak_device["device"] > 0 and peak_device["cpu"] == 0
    assert peak_cpu["cpu"] > 0 and peak_cpu["device"] < peak_device["device"]
    assert torch.allclose(on_device, on_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule,thresh", [("teacache", 0.15), ("magcache", 0.1), ("first_block", 0.2)])
def test_trained_wan_calibrates_then_skips_close_to_the_uncached_latent(tiny, conds, rule, thresh):
    model = tiny.BUILDERS["wan_trained"](0)
    shape = (1, 16, 1, 8, 8)
    ref = sample(model, conds, shape=shape)
    (cal,) = N().TeaCacheCalibrateNode.execute(model).args
    sample(cal, conds, shape=shape)
    out = sample(teacache(model, thresh, model_type="auto", rule=rule), conds, shape=shape)
    run = last_run()
    assert run["family"] == "wan" and run["calls_skipped"] >= 3
    assert run["model_type"] == ("none" if rule == "first_block" else "calibrated")
    assert rel_err(out, ref) < 0.25, rel_err(out, ref)

