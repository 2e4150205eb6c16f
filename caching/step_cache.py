"""Step cache math: pure torch + stdlib, no ComfyUI.

Three skip rules decide, per model call, whether the transformer stack may be skipped and the
residual (stack output minus stack input) of the last computed call added instead:

- ``teacache`` (Liu et al., CVPR 2025): the relative L1 change of the first block's
  timestep-modulated input, rescaled by a per-model polynomial and accumulated over calls.
- ``magcache`` (Ma et al., 2025): the calibrated ratio of consecutive residual magnitudes; the
  accumulated ``|1 - prod(ratios)|`` since the last computed call.
- ``first_block`` (First-Block-Cache, ParaAttention FBCache / cache-dit DBCache F1B0): the first block
  always runs; the relative L1 change of its residual against the last computed call's. A skip adds
  the stored residual of the remaining blocks to the first block's output.

A skip stays while the rule's distance is under ``threshold``; a computed call resets it.

A fourth rule, ``schedule``, decides nothing during the run: it follows a plan made at the run's start
from a table of the model's residuals (:mod:`.step_schedule`), which may also compute the cond branch
alone and rebuild the uncond one from the last measured cond-minus-uncond difference. A fifth,
``interval``, skips on a fixed beat: a computed call, then ``threshold - 1`` skipped ones, per cond (the
schedule TaylorSeer and FoCa are defined with); its distance is the count of calls since the last
computed one. With ``interval_power`` p other than 1 the run computes as many steps as that beat, placed
(:func:`placed_beat`) closer together toward the end (p above 1), where a forecast errs most, or toward
the start (p below 1), where a model's output changes fastest; the distance is then the threshold at a
placed step and 0 elsewhere. A sixth, ``adaptive``, sets each cond's beat as it goes, from the forecast's
own error: at every computed call it compares what a skip would have added there with what was computed
(:meth:`RunState._adapt`), and the next stretch grows or shrinks so that this error, relative, times the
stretch's span in sigma stays at ``threshold``, by the worse of the last two checks (no call skips before
two agree); a prompt the forecast follows badly gets more computed calls than one it follows well.

What a skip adds (``residual_mode``): the stored residual (``reuse``), or it continued in sigma to first
(``extrapolate``) or second (``taylor2``) order from the last computed residuals (Newton's divided
differences, clamped to the last sigma gap); or forecast in call index (steps) as the forecasting
caches define it:

- ``taylorseer1``/``taylorseer2`` (Liu et al., "From Reusing to Forecasting: Accelerating Diffusion
  Models with TaylorSeers", ICCV 2025): a Taylor series of order 1/2 around the last computed call k,
  ``F_k + D1 d + D2 d^2 / 2`` at d calls after it, with derivatives estimated by backward differences
  between successive computed calls: ``D1 = (F_k - F_prev) / gap``, ``D2 = (D1_k - D1_prev) / gap``
  (gap: the calls between them). Not clamped; a lower order until enough computed calls exist.
- ``foca`` (Zheng et al., "Forecast then Calibrate: Feature Caching as ODE for Efficient Diffusion
  Transformers", arXiv 2508.16211), one call at a time from the newest value F_k, computed or forecast
  (recursive): the paper's explicit BDF2 predictor (its eq. 7), ``P = 4/3 F_k - 1/3 F_k-1 + 2/3 F'(k)``,
  then its Heun corrector (eq. 8), ``F_k + (F'(full) + (P - F_k)) / 2``, with F'(full) the per-call slope
  D1 between the last two computed calls. F'(k), the slope at the newest value: at a forecast the rate
  that made it; at a computed call the only slope measured there, D1 (the backward difference to the
  last forecast, ``F_k - F_k-1``, carries that forecast's error: taken as F'(k), up to the whole of a
  stretch's final error passes into the next stretch's forecasts, and over long intervals the errors pile
  up; taken as D1, at most a third).

``output`` forecasts one level further out: the whole model's output (the block stack, the final layer and,
where the family's seam is ``apply_model``, the conversion to the denoised latent), as ``foca`` forecasts
the residual; a skipped call's blocks pass through and its output is replaced by the forecast. The final
layer is not linear (a modulated norm), so this is not the same forecast (docs/step_cache.md, "Rules").

Both papers forecast each module's output (attention, MLP) of every block. Here they forecast the
block stack's residual: in a pre-norm residual-stream transformer that residual is the sum of every
module's output, and finite differences, Taylor terms and the FoCa update are linear in the values,
so forecasting the sum equals summing the modules' forecasts.

This module holds the per-cond state (:class:`CondState`), the joint skip decision for one model
call (:meth:`RunState.decide`, :meth:`RunState.decide_scheduled`), the per-run report, the published
tables and the calibration fits.
The ComfyUI side (patches/step_cache.py) only finds the rule's inputs and the block stack's ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import step_schedule
from .file_hashes import file_lock, sweep_temporaries
from .step_schedule import ResidualTable
from .weights_identity import WeightsIdentity

log = logging.getLogger("reusekit")

# Published rescale polynomials (highest power first), from ali-vilab/TeaCache via the ComfyUI
# TeaCache pack: see docs/step_cache.md. Facts, not code.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "flux": (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01),
    "flux-kontext": (-1.04655119e+03, 3.12563399e+02, -1.69500694e+01, 4.10995971e-01, 3.74537863e-02),
    "hunyuan_video": (7.33226126e+02, -4.01131952e+02, 6.75869174e+01, -3.14987800e+00, 9.61237896e-02),
    "wan2.1_t2v_1.3B_ret_mode": (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02),
    "wan2.1_t2v_14B_ret_mode": (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01),
    "wan2.1_i2v_480p_14B_ret_mode": (2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01, 1.32517977e-01),
    "wan2.1_i2v_720p_14B_ret_mode": (8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01, -4.17769401e-02),
    # ali-vilab/TeaCache: TeaCache4LTX-Video and TeaCache4Mochi
    "ltxv": (2.14700694e+01, -1.28016453e+01, 2.31279151e+00, 7.92487521e-01, 9.69274326e-03),
    "mochi": (-3.51241319e+03, 8.11675948e+02, -6.09400215e+01, 2.42429681e+00, 3.05291719e-03),
}

# Published MagCache magnitude ratios (Zehong-Ma/ComfyUI-MagCache nodes.py ``SUPPORTED_MODELS_MAG_RATIOS``,
# from the MagCache paper's calibrations; read via its mirror wzgrx/ComfyUI-MagCache): per call of one
# published run, keyed by the COEFFICIENTS variant names. Facts, not code. (ratios, steps, shift): where a
# list interleaves cond and uncond (two calls per step) it has 2 * steps entries; ``shift`` is the flow
# shift of the schedule it was measured on (Flux.1 dev at 1024px: exp(1.15); Wan generate.py: 5), which
# places each call at its sigma (:func:`published_magnitudes`).
MAG_RATIOS: dict[str, tuple[tuple[float, ...], int, float]] = {
    "flux": ((1.0, 1.21094, 1.11719, 1.07812, 1.0625, 1.03906, 1.03125, 1.03906, 1.02344, 1.03125, 1.02344,
              0.98047, 1.01562, 1.00781, 1.0, 1.00781, 1.0, 1.00781, 1.0, 1.0, 0.99609, 0.99609, 0.98047,
              0.98828, 0.96484, 0.95703, 0.93359, 0.89062), 28, math.exp(1.15)),
    "flux-kontext": ((1.0, 1.21875, 1.0625, 1.03125, 1.03125, 1.0, 1.00781, 1.03906, 0.98047, 1.03125, 0.96875,
                      1.02344, 1.0, 0.99219, 1.02344, 0.98047, 0.95703, 0.98828, 0.98047, 0.88672), 20,
                     math.exp(1.15)),
    "hunyuan_video": ((1.0, 1.0754, 1.27807, 1.11596, 1.09504, 1.05188, 1.00844, 1.05779, 1.00657, 1.04142,
                       1.03101, 1.00679, 1.02556, 1.00908, 1.06949, 1.05438, 1.02214, 1.02321, 1.03019, 1.00779,
                       1.03381, 1.01886, 1.01161, 1.02968, 1.00544, 1.02822, 1.00689, 1.02119, 1.0105, 1.01044,
                       1.01572, 1.02972, 1.0094, 1.02368, 1.0226, 0.98965, 1.01588, 1.02146, 1.0018, 1.01687,
                       0.99436, 1.00283, 1.01139, 0.97122, 0.98251, 0.94513, 0.97656, 0.90943, 0.85703,
                       0.75456), 50, 7.0),
    "wan2.1_t2v_1.3B_ret_mode": ((1.0, 1.0, 1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762,
                                  0.99634, 0.99685, 0.99567, 0.99586, 0.99416, 0.99422, 0.99578, 0.99575, 0.9957,
                                  0.99563, 0.99511, 0.99506, 0.99535, 0.99531, 0.99552, 0.99549, 0.99541, 0.99539,
                                  0.9954, 0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481,
                                  0.99479, 0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386,
                                  0.99349, 0.99349, 0.99309, 0.99304, 0.9927, 0.9927, 0.99228, 0.99226, 0.99171,
                                  0.9917, 0.99137, 0.99135, 0.99068, 0.99063, 0.99005, 0.99003, 0.98944, 0.98942,
                                  0.98849, 0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836,
                                  0.98359, 0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411,
                                  0.97003, 0.97002, 0.96538, 0.96541, 0.9593, 0.95933, 0.95086, 0.95089, 0.94013,
                                  0.94019, 0.92402, 0.92414, 0.90241, 0.9026, 0.86821, 0.86868, 0.81838,
                                  0.81939), 50, 5.0),
    "wan2.1_t2v_14B_ret_mode": ((1.0, 1.0, 1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771,
                                 0.9966, 0.99658, 0.99482, 0.99476, 0.99467, 0.99451, 0.99664, 0.99656, 0.99434,
                                 0.99431, 0.99533, 0.99545, 0.99468, 0.99465, 0.99438, 0.99434, 0.99516, 0.99517,
                                 0.99384, 0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428,
                                 0.99426, 0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311,
                                 0.99215, 0.99215, 0.99218, 0.99215, 0.99216, 0.99217, 0.99163, 0.99161, 0.99138,
                                 0.99135, 0.98982, 0.9898, 0.98996, 0.98995, 0.9887, 0.98866, 0.98772, 0.9877,
                                 0.98767, 0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177,
                                 0.98173, 0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183,
                                 0.96711, 0.96708, 0.96349, 0.96345, 0.95629, 0.95625, 0.94926, 0.94929, 0.93964,
                                 0.93961, 0.92511, 0.92504, 0.90693, 0.90678, 0.8796, 0.87945, 0.86111,
                                 0.86189), 50, 5.0),
    "wan2.1_i2v_480p_14B_ret_mode": ((1.0, 1.0, 0.98783, 0.98993, 0.97559, 0.97593, 0.98311, 0.98319, 0.98202,
                                      0.98225, 0.9888, 0.98878, 0.98762, 0.98759, 0.98957, 0.98971, 0.99052, 0.99043,
                                      0.99383, 0.99384, 0.98857, 0.9886, 0.99065, 0.99068, 0.98845, 0.98847, 0.99057,
                                      0.99057, 0.98957, 0.98961, 0.98601, 0.9861, 0.98823, 0.98823, 0.98756, 0.98759,
                                      0.98808, 0.98814, 0.98721, 0.98724, 0.98571, 0.98572, 0.98543, 0.98544, 0.98157,
                                      0.98165, 0.98411, 0.98413, 0.97952, 0.97953, 0.98149, 0.9815, 0.9774, 0.97742,
                                      0.97825, 0.97826, 0.97355, 0.97361, 0.97085, 0.97087, 0.97056, 0.97055, 0.96588,
                                      0.96587, 0.96113, 0.96124, 0.9567, 0.95681, 0.94961, 0.94969, 0.93973, 0.93988,
                                      0.93217, 0.93224, 0.91878, 0.91896, 0.90955, 0.90954, 0.92617, 0.92616), 40, 3.0),
    "wan2.1_i2v_720p_14B_ret_mode": ((1.0, 1.0, 0.99428, 0.99498, 0.98588, 0.98621, 0.98273, 0.98281, 0.99018,
                                      0.99023, 0.98911, 0.98917, 0.98646, 0.98652, 0.99454, 0.99456, 0.9891, 0.98909,
                                      0.99124, 0.99127, 0.99102, 0.99103, 0.99215, 0.99212, 0.99515, 0.99515, 0.99576,
                                      0.99572, 0.99068, 0.99072, 0.99097, 0.99097, 0.99166, 0.99169, 0.99041, 0.99042,
                                      0.99201, 0.99198, 0.99101, 0.99101, 0.98599, 0.98603, 0.98845, 0.98844, 0.98848,
                                      0.98851, 0.98862, 0.98857, 0.98718, 0.98719, 0.98497, 0.98497, 0.98264, 0.98263,
                                      0.98389, 0.98393, 0.97938, 0.9794, 0.97535, 0.97536, 0.97498, 0.97499, 0.973,
                                      0.97301, 0.96827, 0.96828, 0.96261, 0.96263, 0.95335, 0.9534, 0.94649, 0.94655,
                                      0.93397, 0.93414, 0.91636, 0.9165, 0.89088, 0.89109, 0.8679, 0.86768), 40, 5.0),
}

# The defaults of rule="auto" / residual_mode="auto" / threshold=-1 per family: (rule, thresholds by step
# count, residual_mode), and each rule's own default threshold per family. Picked by bench/step_cache.py
# --pick-defaults on its tuning prompts (never the evaluation ones) on the stand-in models: TeaCache's
# threshold, the largest keeping 32 dB mean and 27 dB worst at every setup of the family at 20, 28 and 50
# steps (more steps bear a larger one: each skipped stretch is shorter in sigma), and the residual mode
# worth most at it. The schedule rule plans from a table
# of residuals measured on one model; the tables shipped in caching/schedule_tables.json were measured on
# the stand-ins (docs/step_cache.md, "Stand-in models for the benchmark"): a table is one model's, and on another one
# it can plan far more skips than that model bears, so auto uses them on no model: it runs TeaCache
# (published polynomials, fitted on the real models) with forecasts, and the
# rule of CALIBRATED_RULES at its threshold once the model has its own calibration of that rule (ReuseKit
# TeaCache Calibrate) and the threshold is left at -1. rule="schedule" picked by hand uses the shipped
# table. Wan 2.2 takes Wan's; every other family (modulated-input DiTs like Flux) takes Flux's.
_FLUX = ("teacache", ((20, 0.504), (28, 0.504), (50, 1.09)), "output")
_WAN = ("teacache", ((20, 0.343), (28, 0.343), (50, 0.504)), "extrapolate")
FAMILY_DEFAULTS: dict[str, tuple[str, tuple[tuple[int, float], ...], str]] = {"flux": _FLUX, "wan": _WAN,
                                                                             "wan22": _WAN}
FALLBACK_DEFAULTS: tuple[str, tuple[tuple[int, float], ...], str] = _FLUX


def default_threshold(anchors: tuple[tuple[int, float], ...], steps: int | None) -> float:
    """The default threshold of a run of ``steps``: linear between the ``anchors`` (step count, threshold),
    the nearest one's beyond them; the fewest steps' (the smallest) when the count is unknown."""
    if steps is None or steps <= anchors[0][0]:
        return anchors[0][1]
    for (n0, t0), (n1, t1) in zip(anchors, anchors[1:], strict=False):
        if steps <= n1:
            return round(t0 + (t1 - t0) * (steps - n0) / (n1 - n0), 4)
    return anchors[-1][1]


CALIBRATED_RULES: dict[str, tuple[str, str]] = {"flux": ("schedule", "extrapolate"), "wan": ("schedule", "extrapolate")}
"""(rule, residual mode) auto runs on a model with its own calibration (bench/step_cache.py --pick-calibrated)."""
TABLE_FIELDS = {"teacache": "coefficients", "magcache": "magnitudes", "schedule": "table"}
"""Where each rule's table lives in a stored calibration."""
# interval: 3 (one call computed in three), a round middle value, not tuned by the benchmark
# adaptive: its candidate's pick in bench/step_cache.py --pick-defaults with the output forecast, the largest
# threshold keeping 32 dB mean and 27 dB worst on the tuning runs at 20, 28 and 50 steps (Flux: at CFG 3.5 and 1)
_FLUX_THRESHOLDS = {"teacache": 0.4, "magcache": 0.06, "first_block": 0.2, "schedule": 0.0131, "interval": 3.0,
                    "adaptive": 0.0126}
_WAN_THRESHOLDS = {"teacache": 0.3, "magcache": 0.06, "first_block": 0.2, "schedule": 0.0131, "interval": 3.0,
                   "adaptive": 0.005}
RULE_THRESHOLDS: dict[str, dict[str, float]] = {"flux": _FLUX_THRESHOLDS, "wan": _WAN_THRESHOLDS,
                                                "wan22": _WAN_THRESHOLDS}
FALLBACK_THRESHOLDS: dict[str, float] = _FLUX_THRESHOLDS

RULES = ("teacache", "magcache", "first_block", "schedule", "interval", "adaptive")
TABLELESS_RULES = ("first_block", "interval", "adaptive")
"""The rules that read no table (no calibration, no published one)."""
BEAT_RULES = ("interval", "adaptive")
"""The rules that decide by the count of calls since the last computed one (their input only tells a shape change)."""
ADAPTIVE_START = 1.0  # adaptive: the first stretches' length in calls: every call computes until two checks agree
ADAPTIVE_MAX = 12.0  # ... the longest (the bench's interval grid ends at 12)
ADAPTIVE_ORDER = 3.0  # ... how fast a forecast's error grows with the stretch: as its cube (a stretch's span in
# sigma grows with it, and the forecast's own error as its square), so a stretch of g calls that erred e is
# followed by one of g (threshold / e) ** (1 / 3) calls
ADAPTIVE_CHANGE = 2.0  # ... at most twice or half the last stretch at once
# (ADAPTIVE_ORDER and ADAPTIVE_CHANGE are the first prototype's; ORDER 2 or 4 and CHANGE 3, tried on the tuning
# runs, are better at no more than one family: docs/step_cache.md, "Rules")
RESIDUAL_MODES = ("reuse", "extrapolate", "taylor2", "taylorseer1", "taylorseer2", "foca", "output")
STEP_ORDERS = {"taylorseer1": 1, "taylorseer2": 2, "foca": 1, "output": 1}
"""The modes that forecast in call index, and how many backward-difference derivatives each keeps."""
FOCA_MODES = ("foca", "output")
"""The call-index modes that forecast with FoCa's predictor-corrector (the rest: a Taylor series)."""
OUTPUT_MODE = "output"
"""The mode whose stored and forecast value is the model's output, not the block stack's residual."""
REPLACED = "replaced"
"""A state key's marker, ``(key, REPLACED, blocks)``: a pass of a cond with some of the cache's blocks replaced."""
MIN_CALIBRATION_POINTS = 4  # a calibration run with fewer fitted points is discarded

EXTRAPOLATE_SPAN = step_schedule.EXTRAPOLATE_SPAN


def placed_beat(steps: int, interval: int, power: float) -> list[int]:
    """The steps an interval run of ``steps`` computes with ``interval_power`` ``power``: as many as the fixed
    beat of ``interval`` computes (``ceil(steps / interval)``), rounded, and moved apart by one where rounding
    puts two on one step. Power 1 or above: the first and the last step among them, step i of k at
    ``(steps - 1) (1 - (1 - i / (k - 1)) ** power)``: 1 spreads them evenly, above it the gaps shrink toward
    the end. Below 1: over the fixed beat's span (its first and last computed step, ``interval (k - 1)``),
    step i at ``interval (k - 1) (i / (k - 1)) ** (1 / power)``: the gaps grow toward its end."""
    k = math.ceil(steps / interval)  # at most steps: interval >= 1
    if k <= 1:
        return [0][:steps]
    if power >= 1:
        at = [round((steps - 1) * (1 - (1 - i / (k - 1)) ** power)) for i in range(k)]
    else:
        at = [round(interval * (k - 1) * (i / (k - 1)) ** (1 / power)) for i in range(k)]
    for i in range(1, k):  # distinct and within the run: k <= steps leaves room for every one
        at[i] = max(at[i], at[i - 1] + 1)
    at[-1] = min(at[-1], steps - 1)
    for i in range(k - 2, -1, -1):
        at[i] = min(at[i], at[i + 1] - 1)
    return at


def rel_l1(cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Relative L1 change ``mean|cur - prev| / mean|prev|`` as a 0-d tensor on their device
    (no host sync)."""
    cur, prev = cur.float(), prev.float()
    return (cur - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12)


def polynomial(coefficients: tuple[float, ...] | list[float], x: torch.Tensor) -> torch.Tensor:
    """``poly(x)`` by Horner's rule (highest power first), signed; stays on x's device."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for c in coefficients:
        out = out * x + float(c)
    return out


def rescale(coefficients: tuple[float, ...] | list[float], x: torch.Tensor) -> torch.Tensor:
    """``|poly(x)|``: ReuseKit's TeaCache accumulates the polynomial's size (the reference accumulates it
    signed, so a negative value there lowers the sum; bench/step_cache.py runs that form as the baseline)."""
    return polynomial(coefficients, x).abs()


def fit_polynomial(xs: list[float], ys: list[float], degree: int = 4) -> tuple[float, ...]:
    """Least-squares fit ``y = poly(x)``, returned as 5 coefficients, highest power first (leading
    zeros pad lower degrees, so calibrated and published polynomials share one format)."""
    if len(xs) != len(ys):
        raise ValueError("calibration needs as many outputs as inputs")
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x == x and y == y and abs(x) != float("inf")]
    if len(pts) < 2:
        raise ValueError(f"calibration needs at least 2 steps with a previous step, got {len(pts)}")
    if min(p[0] for p in pts) == max(p[0] for p in pts):  # a constant would skip by the step count alone
        raise ValueError(f"the rule's input changed by {pts[0][0]:g} at every step: nothing to fit (the input it reads "
                         "is held still: LTX-2's video under a noise mask of 0, say; rule first_block reads the "
                         "output)")
    degree = max(1, min(degree, len(pts) - 1, 4))
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    vander = torch.stack([x ** k for k in range(degree, -1, -1)], dim=1)
    sol = torch.linalg.lstsq(vander, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    coeffs = [0.0] * (4 - degree) + [float(c) for c in sol]
    return tuple(coeffs)


def published_magnitudes(variant: str) -> dict[str, list[tuple[float, float]]] | None:
    """A published MagCache table as curves per cond ("cond", and "uncond" where the list interleaves
    them): (sigma, cumulative log magnitude) per call, each call placed at the sigma of the schedule it
    was measured on (flow sigmas ``1 - i/steps`` under the table's shift)."""
    entry = MAG_RATIOS.get(variant)
    if entry is None:
        return None
    ratios, steps, shift = entry
    per_step = len(ratios) // steps
    labels = ("cond", "uncond")[:per_step]
    out = {}
    for j, label in enumerate(labels):
        points, log_mag = [], 0.0
        for i, ratio in enumerate(ratios[j::per_step]):
            t = 1.0 - i / steps
            log_mag += math.log(ratio)
            points.append((shift * t / (1 + (shift - 1) * t), log_mag))
        out[label] = points
    return out


def magnitude_curve(sigmas: list[float], ratios: list[float]) -> list[tuple[float, float]]:
    """Calibrated ratios (each against the call before; the first call's is 1) as (sigma, cumulative
    log magnitude) points."""
    points, log_mag = [], 0.0
    for sigma, ratio in zip(sigmas, ratios, strict=True):
        if ratio > 0 and math.isfinite(ratio):
            log_mag += math.log(ratio)
        points.append((float(sigma), log_mag))
    return points


class MagnitudeCurve:
    """log ||residual|| against sigma, linear between calibrated points and flat beyond them.

    The ratio between two calls is read as ``exp(L(sigma_now) - L(sigma_before))``. Interpolating in
    sigma (not by step index, as MagCache's code does) keeps a calibration valid for other step counts
    and schedules: a larger step simply spans more of the curve."""

    def __init__(self, points: list[tuple[float, float]]):
        pts = sorted((float(s), float(v)) for s, v in points)
        self.sigmas = torch.tensor([p[0] for p in pts], dtype=torch.float32)
        self.values = torch.tensor([p[1] for p in pts], dtype=torch.float32)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, sigma: torch.Tensor) -> torch.Tensor:
        """L(sigma) as a 0-d tensor on sigma's device (no host sync)."""
        xs, ys = self._on.get(sigma.device) or self._on.setdefault(
            sigma.device, (self.sigmas.to(sigma.device), self.values.to(sigma.device)))
        if len(xs) == 1:
            return ys[0]
        x = sigma.float().reshape(1).clamp(xs[0], xs[-1])
        i = torch.searchsorted(xs, x).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return (y0 + (x - x0) / (x1 - x0).clamp_min(1e-12) * (y1 - y0)).reshape(())

    def ratio(self, before: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.at(now) - self.at(before.to(now.device)))


@dataclass(frozen=True)
class StepCacheConfig:
    """What a user sets on the node (validated there); rule, threshold and residual_mode resolved."""

    coefficients: tuple[float, ...] | None  # None: resolve per run (calibration, then published)
    model_type: str
    threshold: float
    start_percent: float = 0.0
    end_percent: float = 1.0
    max_consecutive_skips: int = 0  # 0: no limit
    cache_device: str = "device"  # "device" (the model's) or "cpu"
    calibrate: bool = False
    residual_mode: str = "reuse"  # one of RESIDUAL_MODES
    rule: str = "teacache"  # one of RULES
    interval_power: float = 1.0  # rule interval: 1 the fixed beat, above / below 1 denser toward the end / start (placed_beat)
    first_blocks: int = 1  # rule first_block: the blocks run before it decides (cache-dit's DBCache Fn; Bn = 0)


@dataclass
class CondState:
    """One conditioning's cache state within a run (keyed by its uuid)."""

    label: str
    prev_signal: torch.Tensor | None = None  # the rule's input at the call it compares against
    sigma: torch.Tensor | None = None  # of the previous call (magcache)
    residual: torch.Tensor | None = None
    residual_sigma: torch.Tensor | None = None  # 0-d, on the sampler's device
    # extrapolate, taylor2: the residual's change between the last two computed calls and their signed sigma
    # gap, kept apart (a slope, their quotient, overflows fp16 where a gap is small and the change is not)
    difference: torch.Tensor | None = None
    gap: torch.Tensor | None = None
    older_difference: torch.Tensor | None = None  # taylor2: the change before it, over ``older_gap``
    older_gap: torch.Tensor | None = None
    step_index: int | None = None  # the call index (per cond) of ``residual`` (taylorseer, foca)
    derivatives: list = field(default_factory=list)  # taylorseer, foca: D1 (, D2) per call at ``residual``
    rolling: torch.Tensor | None = None  # foca: the newest value when it is a forecast (else ``residual``)
    rolling_index: int | None = None  # foca: the call index of ``rolling``
    rolling_slope: torch.Tensor | None = None  # foca: per call, from the value before the newest to it
    accumulated: torch.Tensor | float = 0.0
    ratio: torch.Tensor | float = 1.0  # magcache: the magnitude ratio since the last computed call
    consecutive: int = 0
    computed: int = 0
    skipped: int = 0
    trace: list = field(default_factory=list)  # the rule's accumulated distance per call (tensors until the end)
    pattern: list = field(default_factory=list)  # "C" computed / "S" skipped, per call
    meta: tuple | None = None  # (shape, dtype, device) of the rule's input, and the switching effects on
    beat: float = ADAPTIVE_START  # adaptive: the next stretch's length in calls (computed one included)
    checks: list = field(default_factory=list)  # adaptive: (call index, stretch, its error times span, next beat)
    error_rate: float = math.inf  # adaptive: the last check's error over its stretch cubed (none yet: unbounded)
    residual_step: int | None = None  # schedule: the planned step whose call stored ``residual``
    estimated: bool = False  # schedule: ``residual`` was rebuilt from the cond's (an H step), not computed
    # calibration
    calib_x: list = field(default_factory=list)
    calib_y: list = field(default_factory=list)
    calib_sigma: list = field(default_factory=list)
    calib_ratio: list = field(default_factory=list)
    calib_samples: list = field(default_factory=list)  # schedule: sampled residuals (step_schedule.sample)
    calib_gain: list = field(default_factory=list)  # schedule: (output error / residual error, output norm) or None

    def clear(self) -> None:
        self.prev_signal = self.residual = self.difference = self.sigma = None
        self.residual_sigma = self.gap = self.older_difference = self.older_gap = None
        self.step_index = self.rolling = self.rolling_index = self.rolling_slope = None
        self.derivatives = []
        self.accumulated, self.ratio, self.consecutive, self.meta = 0.0, 1.0, 0, None
        self.residual_step, self.estimated = None, False
        self.beat, self.error_rate = ADAPTIVE_START, math.inf


class RunState:
    """Everything one sampling run holds. Created at the start of each run, dropped at its end.

    ``magnitudes``: the magcache curves per cond label (a label without its own uses "cond")."""

    def __init__(self, config: StepCacheConfig, coefficients: tuple[float, ...] | None,
                 start_sigma: float, end_sigma: float,
                 magnitudes: dict[str, list[tuple[float, float]]] | None = None):
        self.config = config
        self.coefficients = coefficients
        self.curves = {k: MagnitudeCurve(v) for k, v in (magnitudes or {}).items() if v}
        self.start_sigma, self.end_sigma = start_sigma, end_sigma
        self.conds: dict[Any, CondState] = {}
        self.calls_computed = 0
        self.calls_skipped = 0
        self.calls_half = 0  # schedule: computed calls that ran the cond rows alone (H steps)
        self.unhooked = 0  # calls computed without the cache seeing them (the model never reached its blocks)
        self.time_computed = 0.0
        self.time_skipped = 0.0
        self.resets = 0
        self.windowed = False  # its calls ran in context windows (each window a state of its own)
        self.planned = "C"  # schedule: the plan's action for the last call decided (C, S or H)
        self._timestep: torch.Tensor | None = None  # the timestep tensor of the step being sampled (one per step)
        self._step_keys: set = set()  # the cond keys computed or skipped at that step
        self._evaluations = 0  # the model evaluations (timestep tensors) seen so far
        self._last_seen: dict[Any, int] = {}  # per cond key, the evaluation of its last call
        self.seen = 0  # the model calls that reached the cache, and that many when the sampler last ended a step
        self._seen_at_step = 0
        self._gap = False  # a step ended with none of its calls here (answered outside: LazyCache, say)
        self.gaps = 0
        self.returns = 0  # conds that came back after an evaluation without them and started over
        self.partial: str | None = None  # calibration: why the run does not cover the model's whole schedule
        self.disabled_reason: str | None = None  # why every step of this run is computed, if one is
        # what may switch on or off within the run (ControlNets with a partial range, keyframed hooks: set by
        # the wrapper), and the effects the last call had on
        self.switches: tuple[list, list] = ([], [])
        self.effects_seen: tuple | None = None
        # the sampler adds noise between calls (set by the wrapper; :meth:`held`); renoised (a flow model's): the
        # output mode keeps the denoised picture the output gives
        self.adds_noise = False
        self.renoised = False
        # the sampler builds the next latent on the denoised picture (CFG++: set by the wrapper), so a skipped
        # call's output error reaches the latent times sigma, not times the step's span (rule adaptive)
        self.undamped = False
        # the ControlNets' ranges as read, with the timestep dtype, and their ends rounded to it (read per call)
        self.switch_ends: tuple | None = None
        self.started = time.perf_counter()
        # schedule: the plan (made at the run's start), its steps' sigmas (CPU), and the cond-minus-uncond
        # residual difference of the last step that computed both, with that step
        self.plan: step_schedule.Plan | None = None
        self.plan_sigmas: torch.Tensor | None = None
        self.delta: torch.Tensor | None = None
        self.delta_step: int | None = None
        self._scheduled_step: int | None = None  # the planned step of the call being made
        self.replan: Any = None  # schedule: (from step, threshold) -> the plan of the rest of the run
        self.plan_threshold = config.threshold
        self.replans = 0
        # interval with interval_power: the run's step sigmas and which steps compute, per device
        self.beat: tuple[torch.Tensor, torch.Tensor] | None = None
        self._beat_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def step_done(self) -> None:
        """The sampler ended a step (its callback): where none of the step's model calls reached the cache, another
        node's wrapper answered them, and what each cond holds is older than the rules read."""
        self._gap = self._gap or self.seen == self._seen_at_step
        self._seen_at_step = self.seen

    def after_gap(self) -> bool:
        """At a call: where steps went by unseen, every cond starts over (True where one held something)."""
        if not self._gap:
            return False
        self._gap = False
        held = [s for s in self.conds.values() if s.residual is not None or s.prev_signal is not None]
        for state in held:
            state.clear()
        if held:
            self.resets += 1
            self.gaps += 1
            self.delta = self.delta_step = None
        return bool(held)

    def again_this_step(self, keys: list, timestep: torch.Tensor | None) -> bool:
        """Whether one of ``keys`` was already called at this step: a guidance pass after the step's own call
        (LTXV's STG and modality guidance, a reference-free pass: the same cond with
        other options), never the cond's next step. ComfyUI hands every call of one step the same timestep
        tensor and makes a new one for each model evaluation; told apart by identity, with no host sync."""
        if timestep is None:
            return False
        if self._timestep is not timestep:  # (held: no other tensor takes its address meanwhile)
            self._timestep, self._step_keys = timestep, set()
            self._evaluations += 1
        if any(k in self._step_keys for k in keys):
            return True
        self._step_keys.update(keys)
        for key in keys:  # a cond absent from the evaluation before (a guider that drops the uncond at some
            # steps): its state is older than the rules read (the interval's count, the forecasts' call index)
            last = self._last_seen.get(key)
            state = self.conds.get(key)
            if last is not None and last < self._evaluations - 1 and state is not None and (
                    state.residual is not None or state.prev_signal is not None):
                state.clear()
                self.resets += 1
                self.returns += 1
                self.delta = self.delta_step = None
            self._last_seen[key] = self._evaluations
        return False

    def sat_out(self, keys: list, timestep: torch.Tensor | None) -> None:
        """``keys``' usual calls gave way at this step to a pass with some blocks replaced
        (SkipLayerGuidanceDiTSimple's uncond, inside its window): where a key had no call of its own at this
        step, what its state holds is from before that, older than any rule reads, so it starts over."""
        for key in keys:
            state = self.conds.get(key)
            if state is not None and not (self._timestep is timestep and key in self._step_keys):
                state.clear()
                self.resets += 1
                self.delta = self.delta_step = None

    def in_window(self, sigma: torch.Tensor) -> torch.Tensor:
        """Whether skipping is allowed at ``sigma``, as a tensor on its device (no host sync)."""
        return (sigma > self.end_sigma) & (sigma <= self.start_sigma)

    def set_beat(self, sigmas: list[float]) -> list[int]:
        """The interval rule's placed steps for a run sampled at ``sigmas`` (:func:`placed_beat`); a call
        belongs to the step whose sigma is nearest its own. Returns the steps."""
        steps = len(sigmas) - 1
        placed = placed_beat(steps, int(self.config.threshold), self.config.interval_power)
        mask = torch.zeros(steps, dtype=torch.bool)
        mask[placed] = True
        self.beat = (torch.tensor(sigmas[:steps], dtype=torch.float32), mask)
        return placed

    def _beat_distance(self, sigma) -> torch.Tensor:
        """The interval rule's distance on a placed beat: the threshold at a placed step (computed), else 0;
        on sigma's device (no host sync)."""
        sigma = torch.as_tensor(sigma)
        sigmas, mask = self._beat_on.get(sigma.device) or self._beat_on.setdefault(
            sigma.device, tuple(t.to(sigma.device) for t in self.beat))
        near = (sigmas - sigma.float().reshape(())).abs()
        placed = (mask & (near <= near.min())).any()  # no tensor index: indexing by one would sync
        return torch.where(placed, float(self.config.threshold), 0.0)

    def cond(self, key: Any, label: str) -> CondState:
        state = self.conds.get(key)
        if state is None:
            state = self.conds[key] = CondState(label)
        return state

    def _curve(self, label: str) -> MagnitudeCurve | None:
        """The branch's curve: its label without a repeat's ``#n`` or a context window's `` [a-b]``."""
        return self.curves.get(label.split("#")[0].split(" [")[0]) or self.curves.get("cond")

    def _distance(self, state: CondState, signal: torch.Tensor, sigma) -> tuple[Any, Any]:
        """(the rule's accumulated distance if this call skips, the magcache ratio with it)."""
        rule = self.config.rule
        if rule == "interval":  # the calls since the last computed one, this one included; or the placed beat
            if self.beat is not None and sigma is not None:
                return self._beat_distance(sigma), None
            return float(state.consecutive + 1), None
        if rule == "adaptive":  # the threshold at the stretch's end (computed), below it inside
            return self.config.threshold * (state.consecutive + 1) / round(state.beat), None
        if rule == "magcache":
            curve = self._curve(state.label)
            if curve is None or sigma is None or state.sigma is None:
                return None, None
            ratio = state.ratio * curve.ratio(state.sigma, torch.as_tensor(sigma))
            return state.accumulated + (1 - ratio).abs(), ratio
        if state.prev_signal is None:
            return None, None
        dist = rel_l1(signal, state.prev_signal)
        if self.config.calibrate:
            state.calib_x.append(dist)
        if rule == "first_block":
            return dist, None
        return state.accumulated + rescale(self.coefficients, dist), None

    def decide(self, keys: list[Any], labels: list[str], signals: list[torch.Tensor],
               may_skip: bool | torch.Tensor, residual_shape: tuple | None = None,
               sigma: torch.Tensor | float | None = None, effects: tuple = ()) -> bool:
        """Update each cond's distance from the rule's input (teacache: the modulated input;
        first_block: the first block's residual; magcache: only its shape is read, the distance
        comes from ``sigma``; interval: only its shape is read, the distance is the count of calls
        since the last computed one); True when the whole call skips.

        A call skips only when every cond in it has a residual for the same shape, stays under the
        threshold and under ``max_consecutive_skips``, inside the window (``may_skip``, a bool or a
        0-d bool tensor) and with a stored residual of ``residual_shape`` (when given: a residual of
        another shape is never added). Reading the decision is the only host sync, and only when a
        skip is possible at all. ``effects``: what of the run's switching effects is on at this call (a
        ControlNet's range, a hook's keyframe strength); a change starts every cond over, as a shape change
        does.
        """
        cfg = self.config
        states = [self.cond(k, lab) for k, lab in zip(keys, labels, strict=True)]
        candidates = []
        possible = may_skip is not False and not cfg.calibrate
        beat: dict[int, int] = {}  # interval's fixed beat: where a cond computes for a switched effect, it goes on
        for state, sig in zip(states, signals, strict=True):
            meta = (tuple(sig.shape), sig.dtype, sig.device, effects)
            if state.meta is not None and state.meta != meta:  # shape/dtype/device/effects change: start clean
                if cfg.rule == "interval" and state.meta[:3] == meta[:3]:  # an extra computed call, in step
                    beat[id(state)] = 0 if state.consecutive + 1 >= cfg.threshold else state.consecutive + 1
                state.clear()
                self.resets += 1
            state.meta = meta
            cand = self._distance(state, sig, sigma)
            candidates.append(cand)
            if cand[0] is None or state.residual is None or (
                    cfg.max_consecutive_skips and state.consecutive >= cfg.max_consecutive_skips):
                possible = False
            elif residual_shape is not None and tuple(state.residual.shape) != tuple(residual_shape):
                possible = False
        skip = False
        if possible:
            worst = torch.stack([torch.as_tensor(c[0], dtype=torch.float32) for c in candidates]).max()
            ok = torch.logical_and(worst < cfg.threshold, torch.as_tensor(may_skip, device=worst.device))
            skip = bool(ok)  # the one sync per call
        for state, sig, (cand, ratio) in zip(states, signals, candidates, strict=True):
            if cfg.rule == "teacache" or not (skip or cfg.rule in BEAT_RULES):
                state.prev_signal = sig  # first_block compares against the last computed call; the beats read none
            state.sigma = None if sigma is None else torch.as_tensor(sigma)
            if skip:
                state.accumulated = cand
                state.ratio = 1.0 if ratio is None else ratio
                state.consecutive += 1
                state.skipped += 1
            else:
                state.accumulated, state.ratio = 0.0, 1.0
                state.consecutive = beat.get(id(state), 0)
                state.computed += 1
            state.trace.append(cand if cand is not None else 0.0)
            state.pattern.append("S" if skip else "C")
        return skip

    def set_plan(self, plan: step_schedule.Plan, sigmas: list[float], replan: Any = None) -> None:
        """The schedule rule's plan for steps starting at ``sigmas``; ``replan(step, threshold)`` plans the
        rest of the run from a computed step (the run's verification calls it)."""
        self.plan, self.replan = plan, replan
        self.plan_sigmas = torch.tensor([float(s) for s in sigmas[:len(plan.actions)]], dtype=torch.float32)

    def _verify(self, state: CondState, key: Any, residual: torch.Tensor, sigma) -> None:
        """The schedule rule's check at a computed step that ends a stretch: the cond's forecast there (what
        a skip would have added) against the residual it computed, over the table's prediction. Where it
        erred more than VERIFY_MARGIN times that, this prompt strays from the table: the rest of the run
        is planned again with the threshold divided by that ratio (one host sync per such step)."""
        step = self._scheduled_step
        checks = self.plan.checks if self.plan is not None else ()
        if (self.replan is None or step is None or step >= len(checks) or checks[step] <= 0 or state.label != "cond"
                or state.residual is None or tuple(state.residual.shape) != tuple(residual.shape)):
            return
        guess = self.residual(key, residual, sigma)
        ratio = float((guess - residual).float().norm() / residual.float().norm().clamp_min(1e-12)) / checks[step]
        if ratio > step_schedule.VERIFY_MARGIN:
            self.plan_threshold /= ratio
            rest = self.replan(step, self.plan_threshold)
            p = self.plan
            self.plan = step_schedule.Plan(p.actions[:step] + rest.actions, p.errors[:step] + rest.errors,
                                           p.checks[:step] + rest.checks)
            self.replans += 1

    def _adapt(self, state: CondState, key: Any, residual: torch.Tensor, sigma) -> None:
        """The adaptive rule at every computed call, one right after a computed call too (so a beat of 1 can
        grow again): what a skip would have added here (the forecast, or the held value) against what was
        computed, relative, times the stretch's span in sigma (where the sampler gives sigmas and adds no
        noise: a held value, the denoised picture, reaches the latent whole when the sampler rebuilds it
        with new noise; times sigma under a CFG++ sampler, which builds the next latent on the denoised
        picture), sets the next stretch's length (ADAPTIVE_ORDER, ADAPTIVE_CHANGE, 1 to ADAPTIVE_MAX
        calls), by the worse of this check and the last one. Only once the mode's forecast has the values it
        reads (a forecast made from one value is a reuse, whose error says nothing of the forecast's); until
        then every call computes. Not at a call at the last computed one's sigma (no span). One host sync."""
        index = len(state.pattern) - 1
        if state.residual is None or state.step_index is None or tuple(state.residual.shape) != tuple(residual.shape):
            return
        stretch = index - state.step_index
        mode, held = self.config.residual_mode, self.held()
        ready = held or mode == "reuse" or (state.derivatives if mode in STEP_ORDERS else state.difference is not None)
        if not ready:
            return
        guess = self.residual(key, residual, sigma)
        error = (guess - residual).float().norm() / residual.float().norm().clamp_min(1e-12)
        if sigma is not None and state.residual_sigma is not None and not held:
            now = torch.as_tensor(sigma, dtype=torch.float32).to(error.device)
            span = (now - state.residual_sigma.to(error.device)).abs().max()
            # CFG++: the denoised picture (the input less sigma times the output) is the next latent's base, so an
            # output's error reaches it times sigma, not times the step's span
            error, span = torch.stack([error * (now.abs().max() if self.undamped else span), span]).tolist()
            if span == 0:  # heun: its corrector's call and the next step's first share a sigma, no span to err
                return  # over; counted, such a check would read 0 and lengthen the next stretch on one check
        else:
            error = float(error)
        # the worse of this check and the last one, each per call cubed: a forecast that held over one stretch
        # and strayed over the one before (a step's two calls under dpmpp_2s_ancestral, the noise added between
        # steps) is not trusted further; the first check sets no longer stretch
        rate = error / stretch ** ADAPTIVE_ORDER
        worse, state.error_rate = max(rate, state.error_rate), rate
        fit = ADAPTIVE_MAX if worse <= 0 else (self.config.threshold / worse) ** (1 / ADAPTIVE_ORDER)
        state.beat = min(ADAPTIVE_MAX, max(1.0, stretch / ADAPTIVE_CHANGE, min(stretch * ADAPTIVE_CHANGE, fit)))
        state.checks.append((index, stretch, error, state.beat))

    def _step(self, sigma) -> int | None:
        """The planned step a call at ``sigma`` belongs to (the nearest step sigma; one host sync)."""
        if self.plan is None or sigma is None or not len(self.plan.actions):
            return None
        return int(torch.argmin((self.plan_sigmas - torch.as_tensor(sigma).float().cpu()).abs()))

    def decide_scheduled(self, keys: list[Any], labels: list[str], signals: list[torch.Tensor],
                         residual_shape: tuple | None, sigma: torch.Tensor | float | None,
                         half: bool = True, effects: tuple = (), may_skip: bool | torch.Tensor = True) -> list[str]:
        """The schedule rule's decision for one model call, per cond: "C" computed, "S" its forecast
        added, "E" rebuilt from the cond's residual at this step (:meth:`estimate`). The plan's S skips
        every cond, H (``half``) computes the cond branch and rebuilds the uncond one, C computes all; a
        step computes whatever the plan's action cannot serve (no residual of this shape yet, no
        difference measured, conds that are not one cond and one uncond). The plan keeps the window and
        the skip limit per step; a sampler that calls the model twice in a step (heun, dpm_2) is held to
        them per call: a call outside the window (``may_skip`` False), or one that would skip a cond past
        ``max_consecutive_skips`` calls in a row, computes."""
        states = [self.cond(k, lab) for k, lab in zip(keys, labels, strict=True)]
        for state, sig in zip(states, signals, strict=True):
            meta = (tuple(sig.shape), sig.dtype, sig.device, effects)
            if state.meta is not None and state.meta != meta:  # shape/dtype/device/effects change: start clean
                state.clear()
                self.resets += 1
                self.delta = self.delta_step = None
            state.meta = meta
        step = self._step(sigma)
        action = self.planned = "C" if step is None or self.config.calibrate else self.plan.actions[step]

        def fits(t):
            return t is not None and (residual_shape is None or tuple(t.shape) == tuple(residual_shape))

        out = ["C"] * len(keys)
        if action == "S" and all(fits(state.residual) for state in states):
            out = ["S"] * len(keys)
        elif action == "H" and half and fits(self.delta) and self.pair() is not None:
            cond_key = self.pair()[0]
            cond = self.conds[cond_key]
            for i, state in enumerate(states):
                # beside its cond in this call, or after the cond's own call at this step
                if state.label == "uncond" and (cond_key in keys or (cond.residual_step == step
                                                                     and not cond.estimated)):
                    out[i] = "E"
        limit = self.config.max_consecutive_skips
        if "C" not in out or "E" in out:
            if (limit and any(state.consecutive >= limit for state, got in zip(states, out, strict=True) if got != "C")
                    or not bool(may_skip)):  # (a host sync where it is a tensor: only where the plan skips)
                out = ["C"] * len(keys)
        for state, got in zip(states, out, strict=True):
            if got == "C":
                state.consecutive = 0
                state.computed += 1
            else:
                state.consecutive += 1
                state.skipped += 1
            state.trace.append(0.0 if step is None else self.plan.errors[step])
            state.pattern.append("C" if got == "C" else "S")
        self._scheduled_step = step
        return out

    def _branches(self) -> dict[str, list]:
        """The run's conds by label, but for passes with some blocks replaced (SkipLayerGuidance's): calls of
        their own beside the branches."""
        by_label: dict[str, list] = {}
        for key, state in self.conds.items():
            if not (isinstance(key, tuple) and len(key) == 3 and key[1] == REPLACED):
                by_label.setdefault(state.label, []).append(key)
        return by_label

    def pair(self) -> tuple[Any, Any] | None:
        """(cond key, uncond key) where the run has exactly one of each, else None (no H step)."""
        by_label = self._branches()
        if len(by_label.get("cond", ())) != 1 or len(by_label.get("uncond", ())) != 1 or len(by_label) != 2:
            return None
        return by_label["cond"][0], by_label["uncond"][0]

    def branches(self) -> str:
        """The run's branches as a reason names them: "2 cond, 1 uncond"."""
        return ", ".join(f"{len(keys)} {label}" for label, keys in sorted(self._branches().items()))

    def estimate(self, cond_residual: torch.Tensor) -> torch.Tensor:
        """An H step's uncond residual: the cond's residual at this step minus the difference measured at
        the last step that computed both (on the cond residual's device, no host sync)."""
        return cond_residual - self.delta.to(cond_residual.device, cond_residual.dtype, non_blocking=True)

    def cond_residual(self, key: Any) -> torch.Tensor:
        """The residual the cond paired with ``key`` stored at this step (an uncond call after its cond's)."""
        return self.conds[self.pair()[0]].residual

    def store_residual(self, key: Any, residual: torch.Tensor, sigma: torch.Tensor | float | None = None,
                       estimated: bool = False, gain: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep a computed call's residual (and, to forecast, its divided differences in sigma, or its
        backward differences in call index: :meth:`_step_differences`). No host sync. ``estimated``: an
        H step's uncond residual, rebuilt rather than computed (schedule); ``gain``: a calibration call's
        output error over residual error and its output's norm.

        Every computation runs on the residual's device; with ``cache_device`` "cpu" the results are
        then copied to the CPU without waiting, so a CPU-held tensor is never read on the CPU: it only
        goes back to the device by a copy queued on the same stream (:meth:`residual`, the difference here)."""
        state = self.conds[key]
        if self.config.rule == "schedule" and not estimated:
            self._verify(state, key, residual, sigma)
        if self.config.rule == "adaptive":
            self._adapt(state, key, residual, sigma)
        state.residual_step = self._scheduled_step
        state.estimated = estimated
        mode = self.config.residual_mode
        forecast = mode in ("extrapolate", "taylor2") and not self.held()
        dev = residual.device
        prev = (state.residual.to(dev, non_blocking=True) if state.residual is not None
                and (forecast or mode in STEP_ORDERS or self.config.calibrate) else None)
        if prev is not None and prev.shape != residual.shape:
            prev = None
        sigma = None if sigma is None else torch.as_tensor(sigma, dtype=torch.float32)
        if self.config.calibrate and prev is not None:
            state.calib_y.append(rel_l1(residual, prev))
        if self.config.calibrate and sigma is not None:  # magcache: mean over tokens of the per-token norm ratio
            ratio = torch.ones(())
            if prev is not None:
                ratio = (residual.float().norm(dim=-1) / prev.float().norm(dim=-1).clamp_min(1e-12)).mean()
            state.calib_sigma.append(sigma)
            state.calib_ratio.append(ratio)
            state.calib_samples.append(step_schedule.sample(residual))
            state.calib_gain.append(gain)
        difference = gap = older = older_gap = None
        if forecast and sigma is not None and prev is not None and state.residual_sigma is not None:
            gap = (sigma - state.residual_sigma).to(dev)
            difference = residual - prev
            if mode == "taylor2" and state.difference is not None and state.gap is not None:
                older, older_gap = state.difference, state.gap  # (kept where the cache keeps them already)
        index = len(state.pattern) - 1
        derivatives, rolling_slope = self._step_differences(state, residual, prev, index)
        keep = self._keep
        state.residual, state.residual_sigma, state.difference = keep(residual), sigma, keep(difference)
        state.gap, state.older_difference, state.older_gap = gap, older, older_gap
        state.step_index, state.derivatives = index, [keep(d) for d in derivatives]
        state.rolling = state.rolling_index = None  # the newest value is this computed one
        state.rolling_slope = keep(rolling_slope)
        self._measure_delta(key)

    def _keep(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` where the cache keeps it: as it is, or (``cache_device`` "cpu") a copy queued to the CPU."""
        return t.to("cpu", non_blocking=True) if t is not None and self.config.cache_device == "cpu" else t

    def _step_differences(self, state: CondState, residual: torch.Tensor, prev: torch.Tensor | None,
                          index: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The call-index modes at a computed call ``index``: the backward-difference derivatives per call
        at it (D1 from the last computed residual ``prev``; taylorseer2: D2 from D1's change, over the
        same gap) and (FOCA_MODES) the rolling slope, FoCa's BDF2 predictor's per-call rate here: a third
        of the backward difference from the newest value (the last forecast, else ``prev``) to this one
        plus two thirds of D1; ([], None) until two computed residuals of one shape exist. On the
        residual's device."""
        mode = self.config.residual_mode
        if mode not in STEP_ORDERS or prev is None or state.step_index is None or index <= state.step_index \
                or self.held():  # held over the skipped calls: no rates read
            return [], None
        dev = residual.device
        gap = index - state.step_index
        derivatives = [(residual - prev) / gap]
        if STEP_ORDERS[mode] > 1 and state.derivatives:
            derivatives.append((derivatives[0] - state.derivatives[0].to(dev, non_blocking=True)) / gap)
        if mode not in FOCA_MODES:
            return derivatives, None
        if state.rolling is None:
            return derivatives, derivatives[0]
        newest = state.rolling.to(dev, residual.dtype, non_blocking=True)
        back = (residual - newest) / (index - state.rolling_index)
        return derivatives, (back + 2 * derivatives[0]) / 3  # BDF2's predictor rate, F'(k) = D1 (module doc)

    def _measure_delta(self, key: Any) -> None:
        """After both of a cond/uncond pair stored computed residuals at the same step: their difference."""
        pair = self.pair() if self.config.rule == "schedule" else None
        if pair is None or key not in pair:
            return
        cond, uncond = (self.conds[k] for k in pair)
        if (cond.residual_step is not None and cond.residual_step == uncond.residual_step
                and not (cond.estimated or uncond.estimated)
                and cond.residual is not None and uncond.residual is not None
                and cond.residual.shape == uncond.residual.shape):
            self.delta, self.delta_step = cond.residual - uncond.residual, cond.residual_step

    def held(self) -> bool:
        """Whether a skipped call holds the last computed value rather than forecast it: between calls that add
        noise the rates carry that noise (the output mode's value: the denoised picture, where renoised)."""
        return self.renoised if self.config.residual_mode == OUTPUT_MODE else self.adds_noise

    def residual(self, key: Any, like: torch.Tensor, sigma: torch.Tensor | float | None = None) -> torch.Tensor:
        """The residual to add on a skipped call: the stored one, or (``extrapolate``/``taylor2``)
        its Newton forecast to ``sigma`` from the last two/three computed residuals, or (taylorseer,
        foca) its forecast at this call (:meth:`_step_forecast`), computed on ``like``'s device (no
        host sync)."""
        state = self.conds[key]
        res = state.residual.to(like.device, like.dtype, non_blocking=True)
        if self.held():
            return res
        if self.config.residual_mode in STEP_ORDERS:
            return self._step_forecast(state, res, like)
        if state.difference is not None and sigma is not None:
            # Newton's forecast in float32, its terms as changes times ratios of sigma gaps (a slope, a change
            # over a small gap, overflows fp16), never further than the gap it was measured over times
            # EXTRAPOLATE_SPAN: a longer line overshoots (step_schedule.forecast, the planner's, is the same)
            dev = like.device
            gap = state.gap.to(dev)
            step = torch.as_tensor(sigma, dtype=torch.float32).to(dev) - state.residual_sigma.to(dev)
            u = torch.where(gap == 0, 0.0, step / torch.where(gap == 0, 1.0, gap))
            u = u.clamp(-EXTRAPOLATE_SPAN, EXTRAPOLATE_SPAN)
            difference = state.difference.to(dev, non_blocking=True).float()
            out = res.float() + difference * u
            if state.older_difference is not None:
                # (d1/g1 - d0/g0) / (g1 + g0) * (s - s2)(s - s1), with s - s2 = u g1 and s - s1 = (u + 1) g1
                older_gap = state.older_gap.to(dev)
                whole = gap + older_gap
                bend = torch.where(whole == 0, 0.0, u * (u + 1) * gap / torch.where(whole == 0, 1.0, whole))
                older = torch.where(older_gap == 0, 0.0, gap / torch.where(older_gap == 0, 1.0, older_gap))
                out = out + (difference - state.older_difference.to(dev, non_blocking=True).float() * older) * bend
            res = out.to(like.dtype)
        return res

    def _step_forecast(self, state: CondState, res: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The call-index forecast at the cond's current call (the last of its ``pattern``), ``d`` calls
        after the value it starts from; ``res`` is the stored residual on ``like``'s device.

        taylorseer: ``F_k + D1 d + D2 d^2 / 2`` around the last computed call, with the derivatives it
        has (none: reuse). foca and output (FOCA_MODES): from the newest value ``F`` (the last forecast
        since the last computed call, else the computed one), ``F + d (R + (D1 - R) / 2)`` with ``R`` the
        predictor's per-call rate (the rolling slope) and D1 the slope between the last two computed calls
        (predictor ``F + d R``, corrector ``d (D1 - R) / 2``; only ``F`` known: reuse). On a call that
        skips this cond, the forecast becomes the newest value and its per-call rate the rolling slope,
        BDF2's rate at a forecast; the schedule rule's check at a computed call reads the forecast without
        moving anything."""
        index = len(state.pattern) - 1

        def on(t):
            return t.to(like.device, like.dtype, non_blocking=True)

        if self.config.residual_mode not in FOCA_MODES:
            d, term = index - state.step_index, 1.0
            for order, derivative in enumerate(state.derivatives, 1):
                term = term * d / order  # d^n / n!
                res = res + on(derivative) * term
            return res
        newest = res if state.rolling is None else on(state.rolling)
        d = index - (state.step_index if state.rolling is None else state.rolling_index)
        out, rate = newest, None
        if state.rolling_slope is not None:  # made with D1, at the second computed call
            slope = on(state.rolling_slope)
            rate = slope + 0.5 * (on(state.derivatives[0]) - slope)
            out = newest + rate * d
        if state.pattern[-1] == "S":
            # a forecast after only one known value stays it: its rolling slope stays unknown (zero)
            state.rolling, state.rolling_index, state.rolling_slope = self._keep(out), index, self._keep(rate)
        return out

    def release(self) -> None:
        """Drop every tensor kept between calls (the counts and traces stay for the report)."""
        for state in self.conds.values():
            state.clear()
            state.calib_samples.clear()
            state.calib_gain.clear()
        self.delta = None

    def residual_bytes(self) -> dict[str, int]:
        out = {"cpu": 0, "device": 0}
        held = [t for state in self.conds.values()
                for t in (state.residual, state.difference, state.older_difference, state.prev_signal, state.rolling,
                          state.rolling_slope, *state.derivatives)] + [self.delta]
        for t in {id(t): t for t in held if t is not None}.values():  # foca's newest value may be the residual
            out["cpu" if t.device.type == "cpu" else "device"] += t.numel() * t.element_size()
        return out

    def calibration_points(self) -> tuple[list[float], list[float]]:
        """(x, y) pairs of the first cond that has them: modulated-input change -> residual change."""
        for state in self.conds.values():
            n = min(len(state.calib_x), len(state.calib_y))
            if n:
                xs = [float(v) for v in state.calib_x[-n:]]
                ys = [float(v) for v in state.calib_y[-n:]]
                return xs, ys
        return [], []

    def calibration_magnitudes(self) -> dict[str, list[tuple[float, float]]]:
        """The magcache curve measured per cond label: (sigma, cumulative log magnitude) per call."""
        out = {}
        for state in self.conds.values():
            if state.calib_ratio and state.label not in out:
                sigmas = [float(s) for s in state.calib_sigma]
                ratios = [float(r) for r in state.calib_ratio]
                out[state.label] = magnitude_curve(sigmas, ratios)
        return out

    def residual_table(self) -> ResidualTable | None:
        """The schedule rule's table from this (calibration) run: the cond's and, where the run had one,
        the uncond's sampled residuals at the same sigmas, with the gains measured at each step; None
        where they do not line up."""
        by_label = {}
        for state in self.conds.values():
            if state.label in ("cond", "uncond") and state.calib_samples and state.label not in by_label:
                by_label[state.label] = state
        cond, uncond = by_label.get("cond"), by_label.get("uncond")
        if cond is None or len({tuple(t.shape) for t in cond.calib_samples}) != 1:
            return None
        sigmas = [float(s) for s in cond.calib_sigma]
        if len(sigmas) < 2 or any(a <= b for a, b in zip(sigmas, sigmas[1:], strict=False)):
            return None
        used = [cond]
        if uncond is not None and [float(s) for s in uncond.calib_sigma] == sigmas and \
                {tuple(t.shape) for t in uncond.calib_samples} == {tuple(cond.calib_samples[0].shape)}:
            used.append(uncond)
        measured = [[(float(g[0]), float(g[1])) for g in (s.calib_gain[i] for s in used) if g is not None]
                    for i in range(len(sigmas))]
        gains = [sum(g for g, _ in m) / len(m) if m else None for m in measured]
        norms = [n for m in measured for _, n in m]
        if not norms:
            return None
        known = [i for i, g in enumerate(gains) if g is not None]
        gains = [g if g is not None else gains[min(known, key=lambda j: abs(j - i))] for i, g in enumerate(gains)]
        return ResidualTable.from_samples([(sigmas, {s.label: s.calib_samples for s in used}, gains,
                                            sum(norms) / len(norms))])

    def summary(self, total_steps: int | None = None) -> dict[str, Any]:
        """The run's report, JSON-ready (converts the traces: one sync, at the end of the run)."""
        calls = self.calls_computed + self.calls_skipped
        branches = sum(s.computed + s.skipped for s in self.conds.values())
        branches_computed = sum(s.computed for s in self.conds.values())
        per_call = self.time_computed / self.calls_computed if self.calls_computed else 0.0
        per_skip = self.time_skipped / self.calls_skipped if self.calls_skipped else 0.0
        saved = max(0.0, per_call - per_skip) * self.calls_skipped
        conds = {}
        for state in self.conds.values():
            label, n = state.label, 1
            while label in conds:  # another cond of that label in a call of its own (an area cond, another model)
                n += 1
                label = f"{state.label}#{n}"
            conds[label] = {
                "computed": state.computed, "skipped": state.skipped, "pattern": "".join(state.pattern),
                "trace": [round(float(v), 5) for v in state.trace],
            }
            if self.config.rule == "adaptive":  # each check: call, stretch, its error times span, the next beat
                conds[label]["checks"] = [[i, g, round(e, 6), round(b, 3)] for i, g, e, b in state.checks]
        return {
            "rule": self.config.rule,
            "model_type": self.config.model_type,
            "threshold": self.config.threshold,
            "residual_mode": self.config.residual_mode,
            "start_percent": self.config.start_percent,
            "end_percent": self.config.end_percent,
            "max_consecutive_skips": self.config.max_consecutive_skips,
            "cache_device": self.config.cache_device,
            "interval_power": self.config.interval_power,
            "first_blocks": self.config.first_blocks,
            "steps": total_steps,
            "calls_computed": self.calls_computed,
            "calls_skipped": self.calls_skipped,
            "calls_half": self.calls_half,
            # per branch: an H step of the schedule rule computes the cond of a cond/uncond pair only
            "speedup_calls": branches / branches_computed if branches_computed else (
                calls / self.calls_computed if self.calls_computed else 1.0),
            "time_saved_s": round(saved, 4),
            "resets": self.resets,
            "replans": self.replans,
            "unhooked_calls": self.unhooked,
            "disabled_reason": self.disabled_reason,
            "conds": conds,
        }


@dataclass(frozen=True)
class Calibration:
    """What one calibration run measured for a model: the teacache polynomial, the magcache curves per
    cond label and the schedule rule's residual table (any may be missing)."""

    coefficients: tuple[float, ...] | None = None
    magnitudes: dict[str, list[tuple[float, float]]] | None = None
    table: ResidualTable | None = None

    def to_json(self) -> dict[str, Any]:
        return {"coefficients": None if self.coefficients is None else list(self.coefficients),
                "magnitudes": None if self.magnitudes is None else {k: [list(p) for p in v]
                                                                    for k, v in self.magnitudes.items()},
                "table": None if self.table is None else self.table.to_json()}

    @classmethod
    def from_json(cls, entry: Any) -> Calibration | None:
        """The calibration in a stored entry; None for anything malformed (a miss, never an error). A
        malformed or missing residual table alone leaves the rest (entries from before the schedule rule)."""
        if not isinstance(entry, dict):
            return None
        coeffs, mags = entry.get("coefficients"), entry.get("magnitudes")

        number = step_schedule.finite_number
        if coeffs is not None and not (isinstance(coeffs, list) and len(coeffs) == 5 and all(map(number, coeffs))):
            return None
        if mags is not None and not (isinstance(mags, dict) and all(
                isinstance(v, list) and v and all(isinstance(p, list) and len(p) == 2 and all(map(number, p))
                                                  for p in v) for v in mags.values())):
            return None
        table = ResidualTable.from_json(entry.get("table"))
        if coeffs is None and not mags and table is None:
            return None
        return cls(None if coeffs is None else tuple(float(c) for c in coeffs),
                   None if not mags else {str(k): [(float(a), float(b)) for a, b in v] for k, v in mags.items()},
                   table)


class _Unreadable(Exception):
    """The calibration file exists but cannot be read (its permissions) or is not a JSON object (cut short,
    edited by hand)."""


class CalibrationStore:
    """Calibrations per weight structure, each beside the identity of the weights it was made on, in
    memory and in a JSON file (when given a path). A lookup returns the calibration whose identity
    matches (:meth:`WeightsIdentity.matches`: precision copies do, fine-tunes do not), one made in the
    same dtypes first, in memory or in the file; each dtype keeps its own entry. Writes take a lock on a
    file beside it (POSIX and Windows), so two ComfyUI processes calibrating at once keep both; a file that cannot be
    read is moved aside (``.unreadable-<time>``), never overwritten."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._memory: dict[str, list[dict[str, Any]]] = {}
        self._saved = 0  # calibrations this process has put

    def stamp(self) -> str:
        """What changes where a calibration is saved: this process's saves and the file's modification time
        (another process's). The step cache nodes' fingerprint: a run after a calibration resolves otherwise."""
        try:
            mtime = self.path.stat().st_mtime_ns if self.path is not None else None
        except OSError:
            mtime = None
        return f"{self._saved}:{mtime}"

    def _read(self) -> dict[str, Any]:
        """The file's calibrations ({} without a file); _Unreadable where it cannot be read or holds no JSON
        object."""
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # (JSON nested deeper than the parser recurses)
            raise _Unreadable(f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)) from None
        if not isinstance(data, dict):
            raise _Unreadable(f"it holds a {type(data).__name__}, not an object")
        return data

    def _file_lock(self):
        """Held around a read-modify-replace of the file: another process's write waits."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return file_lock(self.path)

    @staticmethod
    def _find(entries: Any, ident: WeightsIdentity, same_dtypes: bool = False) -> int | None:
        """Index of the entry made on weights matching ``ident``: one made in the same dtypes first, then
        (unless ``same_dtypes``) one made on a copy in other dtypes."""
        found = []
        for i, entry in enumerate(entries if isinstance(entries, list) else ()):
            other = WeightsIdentity.from_json(entry.get("identity")) if isinstance(entry, dict) else None
            if other is not None and other.matches(ident):
                found.append((other.dtypes != ident.dtypes, i))
        found = [f for f in found if not (same_dtypes and f[0])]
        return min(found)[1] if found else None

    def get(self, key: str, ident: WeightsIdentity, unreadable: Callable[[str], None] | None = None
            ) -> Calibration | None:
        """The calibration made on these weights in their dtypes (this process's, else the file's), else
        one made on a copy of them in other dtypes. A file that cannot be read is passed over, what is
        wrong with it given to ``unreadable`` (after the store's lock is let go): the caller counts it where
        the user sees it. The next save moves such a file aside, never overwrites it."""
        problem = None
        with self._lock:
            try:
                stored = self._read().get(key)
            except _Unreadable as exc:
                stored, problem = None, f"the calibration file {self.path} cannot be read ({exc})"
            sources = (self._memory.get(key), stored)
            found = next((Calibration.from_json(entries[i]) for same_dtypes in (True, False) for entries in sources
                          if (i := self._find(entries, ident, same_dtypes=same_dtypes)) is not None), None)
        if problem is not None and unreadable is not None:
            unreadable(problem)
        return found

    def put(self, key: str, ident: WeightsIdentity, calibration: Calibration, **info: Any) -> None:
        """Keep a calibration in memory, then in the file, replacing only one made on matching weights in
        the same dtypes (a copy in other dtypes may read another's calibration, never overwrite it: an fp8
        copy of a light fine-tune can match its bf16 base); OSError when the file cannot be written (the
        calibration stays in memory for this process, the file is left as it was)."""
        entry = {**calibration.to_json(), "identity": ident.to_json(), "time": time.time(), **info}

        def add(entries: Any) -> list:
            entries = list(entries) if isinstance(entries, list) else []
            i = self._find(entries, ident, same_dtypes=True)
            if i is None:
                entries.append(entry)
            else:
                entries[i] = entry
            return entries

        with self._lock:
            self._memory[key] = add(self._memory.get(key))
            self._saved += 1
            if self.path is None:
                return
            with self._file_lock():
                try:
                    data = self._read()
                except _Unreadable as exc:  # keep what it holds for the user; start a new file
                    aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
                    os.replace(self.path, aside)
                    log.warning("ReuseKit: the calibration file %s could not be read (%s); it is kept as %s and a "
                                "new one is started", self.path, exc, aside)
                    data = {}
                data[key] = add(data.get(key))
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".teacache-", suffix=".json")
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(data, f, indent=1)
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                sweep_temporaries(str(self.path.parent), ".teacache-", ".json")


def identity_digest(ident: WeightsIdentity) -> str:
    """A short stable name for one model's weights (its structure and sampled values)."""
    h = hashlib.sha256(ident.structure.encode())
    h.update(json.dumps([ident.dtypes, ident.samples]).encode())
    return h.hexdigest()[:32]
