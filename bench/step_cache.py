"""Step cache benchmark: an honest ranking of ReuseKit's step cache against the published methods, each
at its best, every setting fixed before it is scored.

    .venv/bin/python bench/step_cache.py [--quick] [--steps 20 28 50] [--jobs N] [--png-dir DIR] [--json FILE]
        [--methods NAME ...]    # only these rows, by name (the table alone: no RESULT line)
    .venv/bin/python bench/step_cache.py --pick-defaults    # each family's node default (no calibration)
    .venv/bin/python bench/step_cache.py --write-tables     # the schedule rule's shipped tables
    .venv/bin/python bench/step_cache.py --pick-calibrated  # each family's calibrated default (schedule rule)

Setups: the stand-in Flux at CFG 3.5 with an empty negative and at CFG 1 with none (FLUX.1-dev is
guidance-distilled and runs at CFG 1: no uncond branch), the stand-in Wan 2.1 at CFG 3.5; real ComfyUI
classes trained at the 16x16 latent the bench runs (``tests/tinymodels/standins.py``), euler/simple through
the real KSampler. Scored at 20, 28 and 50 steps; the RESULT line reads 28 and 50. The work is split by
setup and step count, each piece a worker process with one torch thread, ``--jobs`` at a time (one per
CPU), the costliest first.

Prompts, never shared between sets and none drawn for training: calibration (one prompt), tuning (4
prompts x seeds 7 and 8), evaluation (8 prompts x 4 seeds 1-4).

Protocol, the same for every method, ReuseKit's and the baselines alike:
- **Calibration.** Every calibrated method reads the same calibration: one ReuseKit TeaCache Calibrate run
  on the calibration prompt at a step count that is never scored (24 for 20 and 28 scored steps, 40 for
  50), which fits TeaCache's polynomial, MagCache's ratios and the schedule rule's residual table at once.
- **Tuning.** Each method sweeps its settings on the tuning prompts: every combination of skip limit and
  window (none; TeaCache's published "at most 3 in a row, last step computed"; MagCache's published K and
  retention) with its threshold grid (a log grid, walked upwards to the first that misses the floors, on
  past the grid's top while they keep them, then refined at the crossing; an interval's grid its integers 2
  to 12 below the step count, every one tried, as its quality is not monotone in N, then on past its top one
  by one), and ReuseKit's interval rule beside its fixed beat the same number of computed steps placed
  closer toward the end (``interval_power`` 1.3: END_DENSE) and toward the start (0.8: START_DENSE), each
  walked as a combo after the first; core
  EasyCache and LazyCache their threshold grid with their window 0-1 or 0.15-0.95. A skip limit or a
  window only adds computed steps, so a restricted combo's walk starts at the unrestricted combo's pick:
  below it, it is never faster (the placed beat computes as many steps as the fixed one at each N); under
  a skip limit K every interval above K runs the same beat, so an interval's walk there ends at the first;
  on the end-dense beat the intervals with the same ceil(steps / N) place the same steps: the first runs.
  The pick is the fastest setting whose tuning mean PSNR is at least 30 dB and whose worst run is at least 25 dB.
- **Scoring.** That one setting runs once on the evaluation prompts: its speedup (model calls per branch,
  uncached over cached; a cond-only step costs half a step under CFG) with a 95% bootstrap interval over
  the evaluation runs, its mean and worst PSNR. Nothing is interpolated, nothing decided on evaluation
  runs. A method whose tuning kept no setting scores 1.00x (it computes every step).

Methods:
- baselines, as their papers define them: TeaCache (the signed polynomial accumulated, calibrated),
  MagCache (calibrated), First-Block-Cache, cache-dit's DBCache at its default F8B0 (the first_block rule
  deciding after the same share of the stand-in's blocks: 2 of Flux's 12, 3 of Wan's 10), core EasyCache
  and LazyCache (each given an input it may
  modify: EasyCache adds its residual to the diffusion model's input in place, which on a float32 model is
  the sampler's own latent; on a real bf16 model it is a cast copy), FORA (a full step every N, its blocks'
  output reused between: the stack's residual as computed, ReuseKit's ``interval`` rule with ``reuse``),
  TaylorSeer of order 1 and 2 and FoCa (a full step every N, forecasts between; the ``interval`` rule with
  those residual modes);
- ReuseKit's rules at the same calibration: the schedule rule (its calibrated table alone: the node lends
  such a table the shipped table's sensitivity, measured with a budget no other method gets; the bench does
  not) and TeaCache with extrapolated residuals,
  TeaCache and the interval rule forecasting the whole model's output (``output``) rather than the blocks'
  residual, the adaptive rule forecasting it too (its beat set per run from the forecast's error); and the node defaults as set (no calibration, no tuning: what a
  user gets), scored once. The defaults are picked by ``--pick-defaults`` on the tuning prompts alone:
  each candidate with no calibration and no shipped table (DEFAULT_CANDIDATES) walks one threshold grid
  at every setup and scored step count; its value is its slowest speedup at the largest threshold keeping
  32 dB mean and 27 dB worst at all of them (a margin over the floors); the default is the candidate
  worth most;
- information, never ranked: the published configurations as published (TeaCache's recommended threshold
  and skip limit with its polynomial, MagCache's E/K/R with its ratios: constants fitted on the real
  models) and the schedule rule with its shipped table at the rule's default threshold (the table was
  measured with a larger budget, on the tuning prompts).

Quality of each run against the uncached run of the same prompt and seed: PSNR and SSIM of the picture
(the stand-ins' latent is an exact picture code, no VAE) by scikit-image, and the final latent's relative
L2.

The last line:
``RESULT default_speedup_min=<a> default_worst_psnr_min=<b> default_vs_best_baseline_min=<c>
vs_best_baseline_min=<d> baselines=<n>``, minima over the setups at 28 and 50 steps: a the node
defaults' evaluation speedup, b their worst evaluation run, c their speedup over the best baseline's, d
the best ReuseKit rule's over the best baseline's (each side's fastest on evaluation at its pick, both alike
whatever their evaluation quality, which the table prints beside it; the fastest of each side whose
evaluation runs kept the floors is printed too), n the number of baseline methods (TaylorSeer's two
orders one, First-Block and DBCache one: SAME_METHOD).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import rkharness  # noqa: E402
import step_cache_curves as curves  # noqa: E402

FAMILIES = ("flux", "wan")
SETUPS = {"flux": ("flux", 3.5), "flux-cfg1": ("flux", 1.0), "wan": ("wan", 3.5)}  # name: (stand-in, CFG)
STEP_COUNTS = (20, 28, 50)  # scored
CALIBRATION_STEPS = (24, 40)  # calibrated at, never scored
RESULT_STEPS = (28, 50)
CFG = 3.5  # the tables' and the defaults' CFG (--write-tables, --pick-defaults)
MEAN_FLOOR, WORST_FLOOR = 30.0, 25.0
DEFAULT_FLOORS = (32.0, 27.0)  # what a family's default must keep on the tuning prompts (a margin over the floors)
DEFAULT_CANDIDATES = [("teacache", m) for m in ("extrapolate", "taylor2", "taylorseer1", "taylorseer2", "foca", "output")
                      ] + [("adaptive", "output")]
"""The node defaults a user may get with no calibration: TeaCache with its published polynomials (no shipped
table; a threshold set by hand with rule auto keeps TeaCache's meaning), or the adaptive rule with the output
forecast (no table at all); the pick is the rule, its residual mode and its thresholds by step count. (The
adaptive rule's pick is also its threshold at -1, RULE_THRESHOLDS; it has not been a family's default:
docs/step_cache.md, "Rules".)"""
DEFAULT_GRID_POINTS = 10
COST = {"flux": 1.4, "wan": 1.0, "flux-cfg1": 0.75}  # a setup's relative cost per step: the workers' order
CALIBRATION = ("a white square on a black background", 101)
TUNING_PROMPTS = ["a green circle on a black background", "a red triangle on a white background",
                  "a yellow cross on a black background", "a blue circle on a gray background"]
TUNING_SEEDS = (7, 8)  # two pictures of each tuning prompt: a pick on one seed of 4 prompts missed the floors
# on the 32 evaluation runs for most methods (docs/step_cache.md, 2026-12-03)
EVAL_PROMPTS = ["a red circle on a black background", "a yellow square on a gray background",
                "a blue triangle on a white background", "a green cross on a white background",
                "a purple circle on a gray background", "a white triangle on a gray background",
                "a red cross on a gray background", "a blue square on a black background"]
SEEDS = (1, 2, 3, 4)
BOOTSTRAP = 2000  # resamples of the evaluation runs for a speedup's interval
DEEP_BLOCKS = {"flux": 57, "wan": 30}  # Flux.1-dev's 19 + 38 blocks, Wan 2.1 1.3B's 30
# cache-dit's DBCache at its default F8B0 (the first 8 blocks always run and decide, no trailing ones), as the
# same share of the stand-in's blocks (8 of FLUX.1's 57, of Wan 2.1 1.3B's 30): the first_block rule with
# first_blocks; priced on a full-size model as its 8 blocks
DBCACHE_FN = {"flux": 2, "wan": 3}
DBCACHE_DEEP_FN = 8
SAME_METHOD = {"TaylorSeer order 2": "TaylorSeer order 1", "DBCache (F8B0)": "First-Block"}
"""Baseline rows that run another row's method at another setting (TaylorSeer's order, the first_block rule's
depth): the RESULT's ``baselines`` counts them once."""
PUBLISHED = {"flux": "flux", "wan": "wan2.1_t2v_1.3B_ret_mode"}  # the variants whose tables they are held to
MAGCACHE_PUBLISHED = {"flux": (0.24, 5, 0.1), "wan": (0.12, 4, 0.2)}  # E, K, R
TEACACHE_PUBLISHED = {"flux": (0.4, 0.0), "wan": (0.15, 0.1)}  # ComfyUI-TeaCache's recommended rel_l1_thresh and
# start_percent (max_skip 3) for the PUBLISHED variant: Wan's is the ret-mode polynomial, whose own threshold is 0.15
# from 10% (0.08 is the other 1.3B polynomial's)
GRIDS = {"teacache": (0.05, 1.6), "magcache": (0.02, 1.0), "first_block": (0.02, 0.6), "schedule": (0.002, 0.3),
         "core": (0.02, 0.6), "adaptive": (0.00125, 0.08)}  # (adaptive: doubling, 0.01 a grid point)
INTERVALS = tuple(range(2, 13))  # the interval rule's N (TaylorSeer, FoCa: a full step every N), every one tried: its
# quality is not monotone in N (where its last computed step falls matters), so a miss does not end the walk
END_POWER = 1.3  # ReuseKit's interval rule beside its fixed beat: interval_power 1.3,
# picked on the tuning prompts at Wan 50 steps (1.2, 1.3, 1.4 tried with the output forecast; docs/step_cache.md)
END_DENSE = f"end-dense p{END_POWER:g}"  # its combo's name
START_POWER = 0.8  # ... and interval_power 0.8, picked on the tuning prompts at Flux CFG 1, 28 steps (0.67, 0.77,
# 0.8 tried with the output forecast, and checked on held-out runs: docs/step_cache.md)
START_DENSE = f"start-dense p{START_POWER:g}"
PLACED = (END_DENSE, START_DENSE)  # the interval rule's placed beats: combos of that rule alone
COARSE, REFINE = 7, 1  # grid points, then refinements at the floors' crossing (quick: 5, 1)
BEYOND = 8  # settings past a grid's top while they keep the floors: no sweep is cut short by its grid
TABLE_STEPS = 50  # the step count the shipped schedule tables are measured at (finest grid)
SENSITIVITY_STEPS = 20  # ... and their sensitivity (coarsest: conservative near the end at finer counts)


def tuning_runs(quick: bool) -> list[tuple[str, int]]:
    """(prompt, seed) of every tuning run: each tuning prompt at each tuning seed."""
    prompts, seeds = (TUNING_PROMPTS[:2], TUNING_SEEDS[:1]) if quick else (TUNING_PROMPTS, TUNING_SEEDS)
    return [(p, s) for p in prompts for s in seeds]


def calibration_steps(steps: int) -> int:
    """The unscored step count whose calibration a scored step count reads (the nearest)."""
    return min(CALIBRATION_STEPS, key=lambda c: (abs(c - steps), c))


# ---- methods and settings ------------------------------------------------------------------------------

def combos(family: str) -> dict[str, dict]:
    """The skip limits and windows every rule may pick from (both sides alike); ``last``: the last step computed;
    and PLACED, the placed beats of ReuseKit's interval rule (``power``: its interval_power)."""
    _, k, r = MAGCACHE_PUBLISHED[family]
    return {"free": dict(K=0, start=0.0, last=False),
            END_DENSE: dict(K=0, start=0.0, last=False, power=END_POWER),
            START_DENSE: dict(K=0, start=0.0, last=False, power=START_POWER),
            "teacache K3 last": dict(K=3, start=0.0, last=True),
            f"magcache K{k} R{r:g}": dict(K=k, start=r, last=False)}


def methods(family: str) -> list[dict]:
    """Every method the bench runs: name, kind (baseline, reusekit, information), how to build it, the
    combos and grid it sweeps."""
    every = [c for c in combos(family) if c not in PLACED]

    def rule(name, kind, rule, model_type, mode, grid=None, **extra):
        return dict(name=name, kind=kind, rule=rule, model_type=model_type, mode=mode, combos=every,
                    grid=grid or rule, **extra)

    return [
        rule("TeaCache", "baseline", "teacache", "calibrated", "reuse", signed=True),
        rule("MagCache", "baseline", "magcache", "calibrated", "reuse"),
        rule("First-Block", "baseline", "first_block", "auto", "reuse"),
        rule("DBCache (F8B0)", "baseline", "first_block", "auto", "reuse", first_blocks=DBCACHE_FN[family],
             deep_first=DBCACHE_DEEP_FN),
        dict(name="EasyCache (core)", kind="baseline", core="easycache", combos=["0-1", ".15-.95"], grid="core"),
        dict(name="LazyCache (core)", kind="baseline", core="lazycache", combos=["0-1", ".15-.95"], grid="core"),
        rule("FORA", "baseline", "interval", "auto", "reuse", grid="interval"),
        rule("TaylorSeer order 1", "baseline", "interval", "auto", "taylorseer1", grid="interval"),
        rule("TaylorSeer order 2", "baseline", "interval", "auto", "taylorseer2", grid="interval"),
        rule("FoCa", "baseline", "interval", "auto", "foca", grid="interval"),
        rule("ReuseKit schedule, extrapolate", "reusekit", "schedule", "calibrated", "extrapolate"),
        rule("ReuseKit TeaCache, extrapolate", "reusekit", "teacache", "calibrated", "extrapolate"),
        rule("ReuseKit TeaCache, output forecast", "reusekit", "teacache", "calibrated", "output"),
        dict(rule("ReuseKit interval, output forecast", "reusekit", "interval", "auto", "output", grid="interval"),
             combos=[every[0], *PLACED, *every[1:]]),
        rule("ReuseKit adaptive, output forecast", "reusekit", "adaptive", "auto", "output"),
        dict(name="ReuseKit node defaults", kind="reusekit", defaults=True, combos=["as set"], grid=None),
    ]


def published_rows(family: str) -> list[dict]:
    """The published configurations, scored as published (no tuning): information. With them the schedule
    rule with its shipped table at the rule's own default threshold (the table was measured on the tuning
    prompts with a larger budget than the common one)."""
    e, k, r = MAGCACHE_PUBLISHED[family]
    t, start = TEACACHE_PUBLISHED[family]
    shipped = rkharness.pack("caching.step_cache").RULE_THRESHOLDS[family]["schedule"]
    return [dict(name=f"ReuseKit schedule, shipped table {shipped:g}", kind="information", rule="schedule",
                 model_type="auto", mode="extrapolate", combo=dict(K=0, start=0.0, last=False), threshold=shipped),
            dict(name=f"MagCache published E{e:g} K{k} R{r:g}", kind="information", rule="magcache",
                 model_type=PUBLISHED[family], mode="reuse", combo=dict(K=k, start=r, last=False), threshold=e),
            dict(name=f"TeaCache published {t:g}{f' from {start:g}' if start else ''} max_skip 3, last step",
                 kind="information", rule="teacache", model_type=PUBLISHED[family], mode="reuse",
                 combo=dict(K=3, start=start, last=True), threshold=t,
                 signed=True)]


def grid(method: dict, quick: bool) -> list[float]:
    """The thresholds a method's sweep starts from: an interval's integers, else a log grid."""
    if method["grid"] == "interval":
        return [float(n) for n in (INTERVALS[::2] if quick else INTERVALS)]
    lo, hi = GRIDS[method["grid"]]
    return curves.log_grid(lo, hi, 5 if quick else COARSE)


def beyond(method: dict, th: float, steps: int, quick: bool) -> float | None:
    """The setting after ``th``, past the top of the method's grid: one grid step on (an interval's next
    integer, below the step count; None past it, or past the node's threshold range)."""
    if method["grid"] == "interval":
        return float(int(th) + 1) if int(th) + 1 < steps else None
    *_, below, top = grid(method, quick)
    nxt = float(f"{th * top / below:.3g}")
    return nxt if nxt <= rkharness.pack("nodes.step_cache").THRESHOLD_MAX else None  # the node's own range


def same_beat(method: dict, combo, th: float) -> bool:
    """Whether every interval above ``th`` runs what ``th`` runs: under a skip limit K an interval of K + 1 or
    more is a computed call then K skipped ones."""
    return method["grid"] == "interval" and isinstance(combo, dict) and 0 < combo["K"] < th


def same_placement(combo, a: float, b: float, steps: int) -> bool:
    """Whether intervals ``a`` and ``b`` run the same steps on an end-dense beat (``power`` above 1): it
    computes ceil(steps / N) steps, at places that depend only on how many (caching/step_cache.py
    placed_beat; a start-dense beat spans the fixed beat's N (k - 1), which depends on N as well)."""
    return isinstance(combo, dict) and combo.get("power", 1.0) > 1.0 and -(-steps // a) == -(-steps // b)


@contextmanager
def as_published(tc, setting: dict):
    """While a TeaCache reference row runs (``signed``): the rescale polynomial accumulated as the reference
    does, signed, in place of ReuseKit's absolute value (``tc``: caching.step_cache)."""
    if not setting.get("signed"):
        yield
        return
    own = tc.rescale
    tc.rescale = tc.polynomial
    try:
        yield
    finally:
        tc.rescale = own


def clone_input(executor, x, *args, **kwargs):
    """A DIFFUSION_MODEL wrapper outside the core nodes' own: the model gets a copy of its input, as a real
    bf16 model gets a cast copy, so EasyCache's in-place add never reaches the sampler's latent."""
    return executor(x.clone(), *args, **kwargs)


# ---- one setup ---------------------------------------------------------------------------------------

class Bench:
    """One stand-in model at one CFG: builds settings, runs them through the real KSampler, counts what ran."""

    def __init__(self, family: str, quick: bool, cfg: float = CFG):
        import comfy.utils

        comfy.utils.PROGRESS_BAR_ENABLED = False
        self.family, self.quick, self.cfg = family, quick, cfg
        self.S = importlib.import_module(rkharness.TINY.__name__ + ".standins")
        self.N = rkharness.pack("nodes.step_cache")
        self.P = rkharness.pack("patches.step_cache")
        self.tc = rkharness.pack("caching.step_cache")
        self.schedule = rkharness.pack("caching.step_schedule")
        self.model, self.clip = self.S.load_standin(family), rkharness.TINY.tiny_clip(0)
        dm = self.model.model.diffusion_model
        self.blocks = list(dm.double_blocks) + list(dm.single_blocks) if family == "flux" else list(dm.blocks)
        self.counts = [0] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(self._counter(i), with_kwargs=True)
        self.stores: dict[int, object] = {}
        self.empty = self.tc.CalibrationStore(None)  # never the user folder
        self._conds: dict[str, object] = {}

    def _counter(self, i):
        def count(_module, a, kw):
            x = a[0] if a and torch.is_tensor(a[0]) else next(v for v in kw.values() if torch.is_tensor(v))
            self.counts[i] += x.shape[0]
        return count

    def cond(self, text: str):
        import nodes

        if text not in self._conds:
            self._conds[text] = nodes.CLIPTextEncode().encode(self.clip, text)[0]
        return self._conds[text]

    def sigmas(self, steps: int) -> list[float]:
        import comfy.samplers

        return comfy.samplers.calculate_sigmas(self.model.model.model_sampling, "simple", steps).tolist()

    def end_for_last(self, steps: int) -> float:
        """The end_percent that leaves the last step of ``steps`` outside the window (it is computed)."""
        ms = self.model.model.model_sampling
        sig = self.sigmas(steps)
        target = (sig[-2] + sig[-3]) / 2  # between the last step's sigma and the one before
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if float(ms.percent_to_sigma(mid)) > target:
                lo = mid
            else:
                hi = mid
        return hi

    def build(self, setting: dict, steps: int):
        """The model a setting samples with: ``setting`` has the method's fields, ``combo`` and ``threshold``."""
        import comfy.patcher_extension
        from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

        if setting.get("uncached"):
            return self.model
        if setting.get("defaults"):
            inputs = {i.id: i.default for i in self.N.TeaCacheNode.define_schema().inputs if i.id != "model"}
            return self.N.TeaCacheNode.execute(model=self.model, **inputs).args[0]
        combo = setting["combo"]
        if "core" in setting:
            node = EasyCacheNode if setting["core"] == "easycache" else LazyCacheNode
            start, end = (0.0, 1.0) if combo == "0-1" else (0.15, 0.95)
            model = self.model.clone()
            model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "rk_bench_clone_input",
                                       clone_input)
            return node.execute(model, setting["threshold"], start, end, False).args[0]
        end = self.end_for_last(steps) if combo["last"] else 1.0
        return self.N.TeaCacheNode.execute(
            model=self.model, rule=setting["rule"], threshold=setting["threshold"], model_type=setting["model_type"],
            start_percent=combo["start"], end_percent=end, max_consecutive_skips=combo["K"], cache_device="device",
            residual_mode=setting["mode"], interval_power=combo.get("power", 1.0),
            first_blocks=setting.get("first_blocks", 1)).args[0]

    def run(self, model, prompt: str, seed: int, steps: int, store,
            deep_first: int = 1) -> tuple[torch.Tensor, float, float, float]:
        """(final latent, calls per branch, the same with a call that ran only the first blocks priced as
        ``deep_first`` blocks of a full-size model, CPU seconds)."""
        import nodes

        self.P.STORE = store
        self.counts[:] = [0] * len(self.blocks)
        t0 = time.process_time()
        with self.calibration_alone(store):
            (out,) = nodes.common_ksampler(model, seed, steps, self.cfg, "euler", "simple", self.cond(prompt),
                                           self.cond(""), {"samples": self.S.empty_latent(self.family)})
        cpu = time.process_time() - t0
        calls = sum(self.counts) / len(self.blocks)
        deep = self.counts[-1] + (self.counts[0] - self.counts[-1]) * deep_first / DEEP_BLOCKS[self.family]
        return out["samples"], calls, deep, cpu

    @contextmanager
    def calibration_alone(self, store):
        """A calibrated method's runs read its own calibration and nothing else. The node lends a calibrated
        schedule table, which measures no sensitivity, the shipped table's (measured with 38 single-skip runs on
        the tuning prompts at 20 steps, a budget no other calibrated method gets): here it has none, and
        weighs every step's error alike."""
        if store is self.empty:
            yield
            return
        shipped, self.schedule.shipped_table = self.schedule.shipped_table, lambda family: None
        try:
            yield
        finally:
            self.schedule.shipped_table = shipped

    def calibrate(self, steps: int) -> dict:
        """One Calibrate run on the calibration prompt at ``steps`` (never a scored count), its own store."""
        store = self.stores[steps] = self.tc.CalibrationStore(None)
        self.run(self.N.TeaCacheCalibrateNode.execute(model=self.model).args[0], *CALIBRATION, steps, store)
        return self.P.stats().snapshot()["info"]["last_calibration"]

    def store_for(self, setting: dict, steps: int):
        """A calibrated method's store: the calibration made at the unscored count nearest ``steps``."""
        return self.stores[calibration_steps(steps)] if setting.get("model_type") == "calibrated" else self.empty

    def metrics(self, out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
        return picture_metrics(out, ref, lambda x: self.S.latent_to_picture(x, self.family))


def picture_metrics(out: torch.Tensor, ref: torch.Tensor, to_picture) -> tuple[float, float, float]:
    """(PSNR dB capped at PSNR_CAP, SSIM, relative L2 of the latent) of ``out`` against ``ref``; pictures
    are the RGB of ``to_picture`` in [0, 1], frames of a 5-D latent stacked along the height."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    def rgb(latent):
        if latent.ndim == 5:  # (B, C, T, H, W) -> (B, C, T*H, W)
            latent = latent.movedim(2, 1).reshape(-1, latent.shape[1], *latent.shape[3:])
        pic = to_picture(latent.float())[:, :3].permute(0, 2, 3, 1)  # (N, H, W, 3)
        return pic.reshape(-1, pic.shape[2], 3).numpy()  # the N pictures one above the other

    a, b = rgb(out), rgb(ref)
    cap = curves.PSNR_CAP
    psnr = cap if (a == b).all() else min(cap, float(peak_signal_noise_ratio(b, a, data_range=1.0)))
    ssim = float(structural_similarity(b, a, data_range=1.0, channel_axis=2))
    err = float((out - ref).norm() / ref.norm())
    return psnr, ssim, err


# ---- the protocol ------------------------------------------------------------------------------------

def interval(base: float, calls: list[float], seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of the speedup ``base / mean(calls)`` over the runs (resampled with
    replacement, a fixed seed: the same runs give the same interval)."""
    rng = random.Random(seed)
    n = len(calls)
    xs = sorted(base / (sum(rng.choice(calls) for _ in range(n)) / n) for _ in range(BOOTSTRAP))
    return xs[int(0.025 * (BOOTSTRAP - 1))], xs[int(0.975 * (BOOTSTRAP - 1))]


def measure(bench: Bench, setting: dict, steps: int, runs: list[tuple[str, int]], refs: dict) -> dict:
    """A setting on ``runs`` (prompt, seed): speedup per branch with its interval, mean and worst PSNR..."""
    model = bench.build(setting, steps)
    store = bench.store_for(setting, steps)
    calls, deep, cpu, psnr, ssim, err = [], [], [], [], [], []
    with as_published(bench.tc, setting):
        for prompt, seed in runs:
            ref, ref_calls, ref_cpu = refs[(prompt, seed)]
            out, c, d, t = bench.run(model, prompt, seed, steps, store, setting.get("deep_first", 1))
            p, s, e = bench.metrics(out, ref)
            calls.append(c)
            deep.append(d)
            cpu.append(t / ref_cpu)
            psnr.append(p)
            ssim.append(s)
            err.append(e)
    base = sum(refs[r][1] for r in runs) / len(runs)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lo, hi = interval(base, calls)
    return {"x": base / mean(calls), "x_lo": lo, "x_hi": hi, "deep_x": base / mean(deep), "cpu_x": 1.0 / mean(cpu),
            "psnr": mean(psnr), "worst": min(psnr), "ssim": mean(ssim), "err": mean(err),
            "threshold": setting.get("threshold"),
            "runs": [[prompt, seed, round(p, 2)] for (prompt, seed), p in zip(runs, psnr, strict=True)]}


def references(bench: Bench, steps: int, runs: list[tuple[str, int]]) -> dict:
    refs = {}
    for prompt, seed in runs:
        out, calls, _, cpu = bench.run(bench.model, prompt, seed, steps, bench.empty)
        refs[(prompt, seed)] = (out, calls, cpu)
    return refs


def keeps(point: dict, floors: tuple[float, float] = (MEAN_FLOOR, WORST_FLOOR)) -> bool:
    return point["psnr"] >= floors[0] and point["worst"] >= floors[1]


def tune(bench: Bench, method: dict, steps: int, tuning: list, refs: dict,
         floors: tuple[float, float] = (MEAN_FLOOR, WORST_FLOOR)) -> tuple[list[dict], dict | None]:
    """Every combo's thresholds on the tuning runs (walked upwards to the first that misses the ``floors``,
    an interval's grid whole as its quality is not monotone in N; past the grid's top while they keep them,
    then refined at the crossing; a combo after the first, which
    restricts the first by a skip limit or a window, from the first combo's pick upwards: below it, it
    computes at least as much, so it is never faster; an interval under a skip limit up to the first that
    runs the limit's beat, as every larger one does): the tuning points, and the pick (the fastest keeping
    the floors), from these points alone. The defaults are not tuned: they are what a user gets."""
    if method.get("defaults"):
        return [], {"combo": "as set", "threshold": None}
    points = []
    free = None  # the first combo's pick: a restricted combo's walk starts there
    for combo_name in method["combos"][:1] if bench.quick else method["combos"]:
        combo = combo_name if "core" in method else combos(bench.family)[combo_name]
        mine = []
        tried: set[float] = set()
        todo = grid(method, bench.quick)
        if free is not None:  # below the free pick a skip limit or a window only computes more: never faster
            todo = [free["threshold"]] + [th for th in todo if th > free["threshold"]]
        todo = [th for i, th in enumerate(todo) if not (i and same_beat(method, combo, todo[i - 1]))
                and not (i and same_placement(combo, todo[i - 1], th, steps))
                and (method["grid"] != "interval" or th < steps)]

        def run(th, tried=tried, mine=mine, combo=combo, combo_name=combo_name):
            tried.add(th)
            mine.append(dict(measure(bench, dict(method, combo=combo, threshold=th), steps, tuning, refs),
                             combo=combo_name))

        for rnd in range(1 if method["grid"] == "interval" else (1 if bench.quick else REFINE) + 1):
            for th in todo:  # upwards; past the first threshold that misses the floors, higher ones miss them too
                run(th)  # (an interval's grid is walked in full: its quality is not monotone in N)
                if len(todo) > 1 and method["grid"] != "interval" and not keeps(mine[-1], floors):
                    break
            for _ in range(BEYOND if rnd == 0 else 0):  # the grid's top kept the floors: walk on past it
                th = mine[-1]["threshold"]
                nxt = beyond(method, th, steps, bench.quick) if keeps(mine[-1], floors) and not same_beat(
                    method, combo, th) else None
                while nxt is not None and same_placement(combo, th, nxt, steps):
                    nxt = beyond(method, nxt, steps, bench.quick)
                if nxt is None:
                    break
                run(nxt)
            nxt = curves.refine(mine, *floors, tried)
            if nxt is None:
                break
            todo = [nxt]
        points += mine
        if free is None and combo_name == method["combos"][0]:
            free = curves.pick(mine, *floors)
    picked = curves.pick(points, *floors)
    if picked and not any(p["combo"] == picked["combo"] and p["threshold"] > picked["threshold"] for p in points) \
            and not same_beat(method, None if "core" in method else combos(bench.family)[picked["combo"]],
                              picked["threshold"]):
        picked = dict(picked, end=True)  # nothing above it was tried (BEYOND spent, or an interval at the steps)
    return points, picked


def score(bench: Bench, method: dict, steps: int, picked: dict | None, evals: list, refs: dict) -> dict:
    """The pick, fixed on tuning, run once on the evaluation runs; 1.00x (every step computed) when tuning
    kept no setting."""
    if picked is None:
        return {"x": 1.0, "x_lo": 1.0, "x_hi": 1.0, "deep_x": 1.0, "cpu_x": 1.0, "psnr": curves.PSNR_CAP,
                "worst": curves.PSNR_CAP, "ssim": 1.0, "err": 0.0, "threshold": None, "combo": None}
    if method.get("defaults"):
        return dict(measure(bench, method, steps, evals, refs), combo="as set")
    combo = picked["combo"] if "core" in method else combos(bench.family)[picked["combo"]]
    setting = dict(method, combo=combo, threshold=picked["threshold"])
    return dict(measure(bench, setting, steps, evals, refs), combo=picked["combo"])


def chosen(family: str, names: list[str] | None) -> list[dict]:
    """The methods a run measures: every one, or those named (``--methods``)."""
    every = methods(family)
    if not names:
        return every
    unknown = sorted(set(names) - {m["name"] for m in every})
    if unknown:
        raise SystemExit(f"--methods: no row named {', '.join(map(repr, unknown))}; the rows: "
                         + ", ".join(repr(m["name"]) for m in every))
    return [m for m in every if m["name"] in names]


def sweep(setup: str, steps: int, quick: bool, names: list[str] | None = None) -> dict:
    """One setup at one scored step count: its calibration, references, every method (or those ``names``)
    tuned and scored; the published rows with the whole field only."""
    family, cfg = SETUPS[setup]
    bench = Bench(family, quick, cfg)
    tuning = tuning_runs(quick)
    evals = [(p, s) for p in (EVAL_PROMPTS[:2] if quick else EVAL_PROMPTS) for s in (SEEDS[:1] if quick else SEEDS)]
    out = {"setup": setup, "family": family, "cfg": cfg, "steps": {}, "calibrated_at": {}}
    t0, cpu0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        mags = bench.S.calibrated_magnitudes(bench.model, family, bench.S.PUBLISHED_STEPS[family])
        out["curve_match"] = bench.S.curve_match(family, mags)
        bench.calibrate(calibration_steps(steps))
        out["calibrated_at"][steps] = calibration_steps(steps)
        refs = references(bench, steps, tuning + evals)
        rows = []
        for method in chosen(family, names):
            tune_points, picked = tune(bench, method, steps, tuning, refs)
            scored_point = score(bench, method, steps, picked, evals, refs)
            rows.append({"name": method["name"], "kind": method["kind"], "tune": tune_points,
                         "picked": picked, "eval": scored_point})
            print(f"[{setup} {steps}] {method['name']}: tuned {len(tune_points)} settings, picked "
                  f"{_said(picked)}; scored {scored_point['x']:.2f}x at {scored_point['psnr']:.1f} dB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        for row in [] if names else published_rows(family):
            if row["rule"] == "schedule" and bench.schedule.shipped_table(family) is None:
                print(f"[{setup} {steps}] {row['name']}: no shipped table yet (--write-tables)", flush=True)
                continue
            point = measure(bench, row, steps, evals, refs)
            rows.append({"name": row["name"], "kind": row["kind"], "tune": [], "picked": None,
                         "eval": dict(point, combo="published")})
        out["steps"][steps] = {"rows": rows, "uncached_cpu_s": sum(r[2] for r in refs.values()) / len(refs)}
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - cpu0
    return out


def default_points(setup: str, steps: int) -> dict:
    """Each candidate default (DEFAULT_CANDIDATES: no calibration, no shipped table) on the tuning prompts at
    one setup and step count: its grid walked upwards to the first threshold that misses DEFAULT_FLOORS."""
    family, cfg = SETUPS[setup]
    bench = Bench(family, False, cfg)
    tuning = tuning_runs(False)
    out = {}
    with torch.inference_mode():
        refs = references(bench, steps, tuning)
        for rule, mode in DEFAULT_CANDIDATES:
            method = dict(name=f"{rule} {mode}", rule=rule, model_type="auto", mode=mode, grid=rule)
            points = []
            for th in default_grid(rule):
                points.append(measure(bench, dict(method, combo=combos(family)["free"], threshold=th), steps, tuning,
                                      refs))
                if not keeps(points[-1], DEFAULT_FLOORS):
                    break
            out[method["name"]] = points
            best = curves.pick(points, *DEFAULT_FLOORS)
            print(f"[{setup} {steps}] default candidate {method['name']}: {len(points)} thresholds, fastest keeping "
                  f"the floors " + (f"{best['threshold']:g}: {best['x']:.2f}x" if best else "none"), flush=True)
    return {"setup": setup, "family": family, "steps": steps, "points": out}


def default_grid(rule: str) -> list[float]:
    """The thresholds a candidate default (a threshold rule) walks: one grid for every setup and step count
    (so they compare at the same thresholds), finer than the tuning grid."""
    return curves.log_grid(*GRIDS[rule], DEFAULT_GRID_POINTS)


def pick_defaults(units: list[dict]) -> dict:
    """Each family's default from ``units`` (default_points of its setups and step counts). Per candidate
    and step count, the largest threshold that keeps DEFAULT_FLOORS at every setup of the family, lowered
    where a larger step count's is lower (more steps never get a lower threshold): the candidate's anchors,
    each worth its slowest speedup over the family's setups. A candidate is worth the least, over the step
    counts, of its speedup over the best candidate's there; the default is the candidate worth most (ties:
    the better worst run)."""
    out = {}
    for family in FAMILIES:
        mine = [u for u in units if u["family"] == family]
        counts = sorted({u["steps"] for u in mine})
        rows = []
        for name in mine[0]["points"]:
            per = {n: [{p["threshold"]: p for p in u["points"][name]} for u in mine if u["steps"] == n] for n in counts}
            picks = {}
            for n in counts:
                common = [th for th in per[n][0] if all(th in q and keeps(q[th], DEFAULT_FLOORS) for q in per[n])]
                picks[n] = max(common, default=None)
            if None in picks.values():
                continue
            anchors = [(n, min(picks[m] for m in counts if m >= n)) for n in counts]
            x = {n: min(q[th]["x"] for q in per[n]) for n, th in anchors}
            rows.append({"candidate": name, "anchors": anchors, "x": x,
                         "worst_min": min(q[th]["worst"] for n, th in anchors for q in per[n])})
        best = {n: max(r["x"][n] for r in rows) for n in counts} if rows else {}
        for r in rows:
            r["worth"] = min(r["x"][n] / best[n] for n in counts)
        rows.sort(key=lambda r: (-r["worth"], -r["worst_min"]))
        out[family] = {"ranked": rows, "default": rows[0] if rows else None,
                       "units": [f"{u['setup']} {u['steps']}" for u in mine]}
    return out


def _said(p: dict | None) -> str:
    if p is None:
        return "none (no setting kept the floors)"
    if p.get("threshold") is None:
        return str(p["combo"])
    return f"{_setting(p)}: {p['x']:.2f}x at {p['psnr']:.1f} dB (worst {p['worst']:.1f})"


def _setting(p: dict | None) -> str:
    if p is None:
        return "none kept the floors"
    if p.get("threshold") is None:
        return str(p["combo"])
    return f"{p['combo']} {p['threshold']:g}" + (" (sweep's end)" if p.get("end") else "")


def pick_calibrated(family: str) -> dict:
    """The family's calibrated default for the node, on the tuning prompts only: the schedule rule with the
    shipped table, each residual mode's fastest threshold keeping DEFAULT_FLOORS at every step count; the
    default is the mode whose slowest step count is fastest, at the smallest of its picks."""
    bench = Bench(family, quick=False)
    tuning = tuning_runs(False)
    picks: dict[str, dict[int, dict | None]] = {}
    with torch.inference_mode():
        for steps in STEP_COUNTS:
            refs = references(bench, steps, tuning)
            for mode in ("reuse", "extrapolate"):
                method = dict(name=f"schedule shipped table {mode}", kind="reusekit", rule="schedule",
                              model_type="auto", mode=mode, combos=["free"], grid="schedule")
                _, picked = tune(bench, method, steps, tuning, refs, DEFAULT_FLOORS)
                picks.setdefault(mode, {})[steps] = picked
                print(f"[{family} {steps}] {method['name']}: {_said(picked)}", flush=True)
    usable = {mode: p for mode, p in picks.items() if all(v is not None for v in p.values())}
    if not usable:
        return {"family": family, "picks": picks, "default": None}
    mode = max(usable, key=lambda m: min(v["x"] for v in usable[m].values()))
    return {"family": family, "picks": picks,
            "default": {"mode": mode, "threshold": min(v["threshold"] for v in usable[mode].values())}}


# ---- the shipped schedule tables --------------------------------------------------------------------

@contextmanager
def forced_plan(schedule, actions: list[str]):
    """Every schedule-rule run plans ``actions`` (for measuring a single skip's effect)."""
    real = schedule.plan
    schedule.plan = lambda *a, **k: schedule.Plan(tuple(actions), (0.0,) * len(actions))
    try:
        yield
    finally:
        schedule.plan = real


def write_tables(family: str) -> dict:
    """The family's schedule table from the tuning prompts: their residuals at TABLE_STEPS (Calibrate runs),
    and the sensitivity of the result to one skipped step, measured at SENSITIVITY_STEPS: the final
    latent's relative error over the planner's error for it (what later steps correct)."""
    bench = Bench(family, quick=False)
    sched = bench.schedule
    runs = []
    with torch.inference_mode():
        for prompt in TUNING_PROMPTS:
            store = bench.tc.CalibrationStore(None)
            bench.run(bench.N.TeaCacheCalibrateNode.execute(model=bench.model).args[0], prompt, TUNING_SEEDS[0],
                      TABLE_STEPS, store)
            (entries,) = store._memory.values()
            table = bench.tc.Calibration.from_json(entries[0]).table
            runs.append(table)
        sigmas = runs[0].sigmas
        merged = sched.ResidualTable(sigmas, runs[0].branches,
                                     tuple(tuple(sum(t.gram[i][j] for t in runs) / len(runs) for j in range(len(t0)))
                                           for i, t0 in enumerate(runs[0].gram)),
                                     tuple(sum(t.gains[i] for t in runs) / len(runs) for i in range(len(sigmas))))
        steps = SENSITIVITY_STEPS
        sig = bench.sigmas(steps)
        errors = sched.single_skip_errors(merged, sig, CFG, True)
        store = bench.tc.CalibrationStore(None)  # the merged table as this model's calibration, for this run only
        key, ident = bench.P.model_identity(bench.model, bench.P.detect_family(bench.model))
        store.put(key, ident, bench.tc.Calibration(table=merged))
        model = bench.build(dict(rule="schedule", model_type="calibrated", mode="reuse", threshold=1.0,
                                 combo=dict(K=0, start=0.0, last=False)), steps)
        measured = [0.0] * steps
        for prompt in TUNING_PROMPTS[:2]:
            ref = bench.run(bench.model, prompt, TUNING_SEEDS[0], steps, bench.empty)[0]
            for k in range(1, steps):
                actions = ["C"] * steps
                actions[k] = "S"
                with forced_plan(sched, actions):
                    out = bench.run(model, prompt, TUNING_SEEDS[0], steps, store)[0]
                measured[k] += float((out - ref).norm() / ref.norm()) / 2
        ratio = [measured[k] / max(errors[k], 1e-12) for k in range(1, steps)]
        ratio = [ratio[0]] + ratio
        # onto the table's grid by sigma (the step's sigma), nearest ends beyond
        grid = []
        for s in sigmas:
            if s >= sig[0]:
                grid.append(ratio[0])
            elif s <= sig[steps - 1]:
                grid.append(ratio[-1])
            else:
                i = next(i for i in range(steps - 1) if sig[i] >= s >= sig[i + 1])
                w = (sig[i] - s) / (sig[i] - sig[i + 1])
                grid.append(ratio[i] * (1 - w) + ratio[i + 1] * w)
    table = sched.ResidualTable(sigmas, merged.branches, merged.gram, merged.gains, tuple(grid))
    return table.to_json()


# ---- reporting ---------------------------------------------------------------------------------------

def summarize(results: dict[str, dict]) -> dict:
    """Per setup and scored step count: each method's scored point; the best baseline and the best ReuseKit
    rule, both sides alike: the fastest on evaluation at its pick (its evaluation quality beside it), and the
    fastest whose evaluation runs kept the floors (information); the defaults."""
    def fastest(rows):
        return max(rows, key=lambda r: r["eval"]["x"], default=None)

    out = {}
    for setup, res in results.items():
        for steps, data in res["steps"].items():
            rows = data["rows"]
            bases = [r for r in rows if r["kind"] == "baseline"]
            ours = [r for r in rows if r["kind"] == "reusekit" and r["name"] != "ReuseKit node defaults"]
            defaults = next((r for r in rows if r["name"] == "ReuseKit node defaults"), None)
            out[(setup, int(steps))] = {
                "rows": rows, "baseline": fastest(bases), "reusekit": fastest(ours), "defaults": defaults,
                "kept": {"baseline": fastest([r for r in bases if keeps(r["eval"])]),
                         "reusekit": fastest([r for r in ours if keeps(r["eval"])])},
                "baselines": len({SAME_METHOD.get(r["name"], r["name"]) for r in bases})}
    return out


def worst_runs(rows: list[dict]) -> list[tuple[tuple[str, int], int]]:
    """The evaluation runs that were some row's worst, each with how many rows, most often first (rows
    scored on per-run PSNRs; a row that computed every step has none)."""
    counts: dict[tuple[str, int], int] = {}
    for row in rows:
        runs = row["eval"].get("runs")
        if runs:
            prompt, seed, _ = min(runs, key=lambda r: r[2])
            counts[(prompt, seed)] = counts.get((prompt, seed), 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def report(results: dict[str, dict], args, wall: float | None = None) -> str:
    summary = summarize(results)
    lines = []
    for (setup, steps), s in sorted(summary.items()):
        n = "2x1" if args.quick else f"{len(EVAL_PROMPTS)}x{len(SEEDS)}"
        lines.append(f"\n{setup} stand-in, {steps} steps (calibrated at {calibration_steps(steps)}; scored on {n} "
                     f"evaluation runs at the setting picked on tuning):")
        lines.append(f"  {'method':<46}{'kind':<12}{'setting picked on tuning':<26}{'speedup [95% interval]':>24}"
                     f"{'mean / worst dB':>18}")
        for row in sorted(s["rows"], key=lambda r: (r["kind"] == "information", -r["eval"]["x"])):
            e = row["eval"]
            said = "as published" if e.get("combo") == "published" else _setting(row["picked"])
            lines.append(f"  {row['name']:<46}{row['kind']:<12}{said:<26}"
                         f"{e['x']:>6.2f}x [{e['x_lo']:.2f}, {e['x_hi']:.2f}]{'':>5}"
                         f"{e['psnr']:>9.1f} / {e['worst']:.1f}{'' if keeps(e) else ' (below the floors)'}")
        d = s["defaults"]["eval"] if s["defaults"] else None
        said = lambda r: (f"{r['eval']['x']:.2f}x ({r['name']}, {r['eval']['psnr']:.1f} / "  # noqa: E731
                          f"{r['eval']['worst']:.1f} dB)" if r else "none")
        lines.append(f"  best baseline {said(s['baseline'])}; best ReuseKit rule {said(s['reusekit'])}; node defaults "
                     + (f"{d['x']:.2f}x at {d['psnr']:.1f} / {d['worst']:.1f} dB" if d else "not run"))
        lines.append(f"  keeping the floors on evaluation: best baseline {said(s['kept']['baseline'])}; best ReuseKit "
                     f"rule {said(s['kept']['reusekit'])}")
        worst = worst_runs(s["rows"])
        if worst:
            (prompt, seed), n = worst[0]
            lines.append(f"  the evaluation run most often a row's worst: '{prompt}', seed {seed} (for {n} of "
                         f"{sum(k for _, k in worst)} rows)")
    if wall is not None:
        lines.append(f"\nran {wall:.0f} s ({args.jobs} workers; CPU time of all "
                     f"{sum(r.get('cpu_seconds', 0.0) for r in results.values()):.0f} s)")
    lines.append(f"stand-ins' magnitude curves against the published ones (their training target, not a validation): "
                 f"curve_match={max(r['curve_match'] for r in results.values()):.4f}")
    if args.methods:
        lines.append(f"no RESULT line: {len(args.methods)} of the field's rows ran (--methods)")
        return "\n".join(lines)
    at = [s for (_, steps), s in summary.items() if steps in RESULT_STEPS] or list(summary.values())
    a = min(s["defaults"]["eval"]["x"] for s in at)
    b = min(s["defaults"]["eval"]["worst"] for s in at)
    c = min(s["defaults"]["eval"]["x"] / s["baseline"]["eval"]["x"] for s in at)
    d = min(s["reusekit"]["eval"]["x"] / s["baseline"]["eval"]["x"] for s in at)
    n = min(s["baselines"] for s in at)
    lines.append(f"RESULT default_speedup_min={a:.2f} default_worst_psnr_min={b:.1f} default_vs_best_baseline_min={c:.2f} "
                 f"vs_best_baseline_min={d:.2f} baselines={n}")
    return "\n".join(lines)


def plots(results: dict[str, dict], png_dir: Path) -> list[Path]:
    """One picture per setup, a panel per step count: each ranked method's tuning points (speedup against
    mean PSNR; information only, the ranking is the scored table)."""
    paths = []
    names = [m["name"] for m in methods("flux") if m["kind"] != "information"]
    palette = [(120, 120, 120), (170, 140, 90), (150, 90, 160), (90, 160, 160), (40, 120, 120), (200, 120, 0),
               (140, 60, 0), (90, 90, 200), (40, 160, 60), (0, 110, 20), (220, 80, 80), (170, 0, 0), (20, 40, 220),
               (230, 0, 160), (0, 0, 0)]  # ... the interval rule's row, the adaptive rule's
    colors = dict(zip(names, palette, strict=False))
    for setup, res in results.items():
        panels = []
        for steps, data in sorted(res["steps"].items(), key=lambda kv: int(kv[0])):
            panels.append((f"{setup} stand-in, {steps} steps: tuning points, mean PSNR (dB)",
                           {r["name"]: r["tune"] or [r["eval"]] for r in data["rows"] if r["name"] in colors}))
        path = png_dir / f"step_cache_{setup}.png"
        curves.plot(panels, path, colors)
        paths.append(path)
    return paths


def units(steps: tuple[int, ...]) -> list[tuple[str, int]]:
    """(setup, step count) for every setup: the work the workers share, the costliest first."""
    return sorted(((setup, n) for setup in SETUPS for n in steps), key=lambda u: -COST[u[0]] * u[1])


def pool(jobs: list[tuple[str, list[str]]], n: int, tmp: Path) -> dict[str, dict]:
    """Run worker processes (name, extra args) at most ``n`` at a time, in order; their results by name."""
    todo, running, failed = list(jobs), {}, []
    while todo or running:
        while todo and len(running) < n:
            name, extra = todo.pop(0)
            cmd = [sys.executable, __file__, "--worker", name, "--out", str(tmp / f"{name}.json"), *extra]
            running[name] = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        time.sleep(0.5)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode != 0:
                    failed.append(name)
    if failed:
        raise SystemExit(f"the {', '.join(failed)} worker failed")
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name, _ in jobs}


def merge(parts: list[dict]) -> dict[str, dict]:
    """Per-unit results (sweep) merged per setup."""
    results: dict[str, dict] = {}
    for part in parts:
        res = results.setdefault(part["setup"], {**part, "steps": {}, "calibrated_at": {}, "seconds": 0.0,
                                                  "cpu_seconds": 0.0})
        res["steps"].update(part["steps"])
        res["calibrated_at"].update(part["calibrated_at"])
        res["seconds"] += part["seconds"]
        res["cpu_seconds"] += part["cpu_seconds"]
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="28 steps only, 2 tuning and 2 evaluation runs, a coarse grid")
    ap.add_argument("--steps", type=int, nargs="+", default=list(STEP_COUNTS), choices=STEP_COUNTS,
                    help="the step counts to score (default: all)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes at a time (default: one "
                                                                         "per CPU)")
    ap.add_argument("--worker", help="(internal) setup:steps, or with --write-tables / --pick-calibrated one family; "
                                     "results to --out")
    ap.add_argument("--out")
    ap.add_argument("--png-dir", help="write plots step_cache_<setup>.png here")
    ap.add_argument("--json", help="keep every measured point here")
    ap.add_argument("--write-tables", action="store_true", help="measure the schedule rule's shipped tables")
    ap.add_argument("--pick-defaults", action="store_true", help="pick each family's node default (no calibration) "
                                                                 "on the tuning prompts")
    ap.add_argument("--pick-calibrated", action="store_true", help="pick each family's calibrated default on the "
                                                                   "tuning prompts")
    ap.add_argument("--methods", nargs="+", metavar="NAME", help="only these rows, by name (no RESULT line)")
    args = ap.parse_args()
    if args.methods:
        chosen("flux", args.methods)  # an unknown name: said now, not by every worker
    if args.worker:
        rkharness.bootstrap()
        torch.set_num_threads(1)
        logging.getLogger("reusekit").setLevel(logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)
        if args.write_tables or args.pick_calibrated:
            data = write_tables(args.worker) if args.write_tables else pick_calibrated(args.worker)
        else:
            setup, steps = args.worker.split(":")
            data = default_points(setup, int(steps)) if args.pick_defaults else sweep(setup, int(steps), args.quick,
                                                                                       args.methods)
        Path(args.out).write_text(json.dumps(data))
        return
    tmp = Path(tempfile.mkdtemp(prefix="rk-step-bench-"))
    t0 = time.perf_counter()
    if args.write_tables or args.pick_calibrated:
        flag = ["--write-tables"] if args.write_tables else ["--pick-calibrated"]
        results = pool([(f, flag) for f in FAMILIES], args.jobs, tmp)
    else:
        flag = ["--pick-defaults"] if args.pick_defaults else ["--quick"] if args.quick else []
        flag += ["--methods", *args.methods] if args.methods else []
        work = units((28,) if args.quick else tuple(args.steps))
        results = pool([(f"{setup}:{n}", flag) for setup, n in work], args.jobs, tmp)
    if args.write_tables:
        target = rkharness.ROOT / "caching" / "schedule_tables.json"
        target.write_text(json.dumps({
            "about": "The schedule rule's residual tables per family, measured by bench/step_cache.py --write-tables "
                     "on its tuning prompts with the family's stand-in model (tests/tinymodels/standins.py).",
            "tables": results}, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {target}")
        return
    if args.pick_calibrated:
        for family, res in results.items():
            d = res["default"]
            print(f"{family}: calibrated default " + ("none keeps the floors" if d is None else
                                                      f"schedule {d['mode']} threshold {d['threshold']:g}"))
        return
    if args.pick_defaults:
        for family, res in pick_defaults(list(results.values())).items():
            print(f"\n{family} ({', '.join(res['units'])}; tuning prompts, floors {DEFAULT_FLOORS[0]:g} / "
                  f"{DEFAULT_FLOORS[1]:g} dB at every setup; threshold by step count):")
            for r in res["ranked"]:
                said = ", ".join(f"{n} steps {th:g} ({r['x'][n]:.2f}x)" for n, th in r["anchors"])
                print(f"  {r['candidate']:<22} {said}; worth {r['worth']:.2f}, worst {r['worst_min']:.1f} dB")
            d = res["default"]
            print(f"{family}: default " + ("none keeps the floors" if d is None else
                                           f"{d['candidate']} at {tuple(tuple(a) for a in d['anchors'])}"))
        print(f"ran {time.perf_counter() - t0:.0f} s")
        return
    results = merge(list(results.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    if args.png_dir:
        for path in plots(results, Path(args.png_dir)):
            print(f"wrote {path}")
    print(report(results, args, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
