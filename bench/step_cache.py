"""Step cache benchmark on the papers' protocol, able to rank: ReuseKit's step cache against the
published skip rules (TeaCache, MagCache, First-Block-Cache) and ComfyUI core's EasyCache and LazyCache.

    .venv/bin/python bench/step_cache.py [--quick] [--png-dir docs] [--json FILE]
    .venv/bin/python bench/step_cache.py --write-tables     # the schedule rule's shipped tables
    .venv/bin/python bench/step_cache.py --pick-defaults    # each family's default, on the tuning prompts

Models: the stand-in Flux and Wan 2.1 of ``tests/tinymodels/standins.py`` (real ComfyUI classes,
trained at the 16x16 latent the bench runs), 20, 28 and 50 euler/simple steps, CFG 3.5, through the
real KSampler. One worker process per model (one torch thread each: the CPU time of a run is steady
on a shared machine).

Prompts. Calibrations (TeaCache's degree-4 polynomial, MagCache's ratios, the schedule rule's residual
table) come from one ReuseKit TeaCache Calibrate run on a calibration prompt at each step count; every
method's setting is picked on 4 tuning prompts (seed 7); the evaluation is 8 other prompts x 2 seeds.
No prompt is in two of these sets, and none was drawn for training.

Methods. Baselines are the published rules with their published residual reuse: TeaCache (published and
calibrated polynomials), MagCache (published and calibrated ratios), First-Block-Cache, run by
ReuseKit's node with ``residual_mode="reuse"``, and the host's EasyCache and LazyCache nodes.
ReuseKit's own: the ``schedule`` rule (a plan made at the run's start from the model's residual table,
with cond-only steps; calibrated, or with the table shipped for the family; reusing or extrapolating
residuals), and the node's defaults. The baseline rules pick their skip limit and window on the tuning
prompts from: none (K 0, window 0-1), TeaCache's published (at most 3 skips in a row, the last step
computed), MagCache's published (K and retention: Flux K5 R0.1, Wan K4 R0.2); core's nodes their
window 0-1 or their own 0.15-0.95. The schedule rule runs with none: it plans within any limits it is
given, so they could only restrict its plan (the node's inputs take them alike). The published
configurations are rows of their own: MagCache E0.24 K5 R0.1 (Flux) / E0.12 K4 R0.2 (Wan), and
ComfyUI-TeaCache's recommended thresholds (Flux 0.4, Wan 1.3B 0.08) with max_skip 3 and the last step
computed.

Protocol per method and step count. Its thresholds (a log grid, upwards to the first that misses the
floors, then refined where the tuning runs cross them) run on the tuning prompts; the fastest setting
(skip limit, window, threshold) whose tuning mean PSNR is >= 30 dB and worst run >= 25 dB is picked,
and then evaluated once, with the tuned thresholds next to it until the floors are bracketed (the next
one up where the pick keeps them, else down until one does), on the evaluation prompts. Each method's
speedup at equal quality is read off its evaluated Pareto curve (speedup against mean and worst PSNR)
by linear interpolation at 30 dB mean and 25 dB worst between measured points (1x, uncached, where none
keeps them).

Quality of each run against the uncached run of the same prompt and seed: PSNR and SSIM of the picture
(the stand-ins' latent is an exact picture code, no VAE) by scikit-image, and the final latent's
relative L2. Cost: model calls counted per branch from the blocks that ran (a cond-only step costs half
of a step under CFG; a call whose first block alone ran, as First-Block-Cache does on a skip, costs
1/blocks of a call), and the CPU time of the whole sampling.

The last line:
``RESULT default_speedup_min=<x> vs_best_baseline_min=<y> default_worst_psnr_min=<z> curve_match=<c>``:
x the node defaults' curve's speedup at the floors, y the best ReuseKit method's over the best
baseline's, both the minimum over both models at 28 and 50 steps; z the node defaults' worst
evaluation run there; c the stand-ins' magnitude-curve match (``curve_match``, lower is closer).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
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
STEP_COUNTS = (20, 28, 50)
RESULT_STEPS = (28, 50)
CFG = 3.5
MEAN_FLOOR, WORST_FLOOR = 30.0, 25.0
DEFAULT_FLOORS = (32.0, 27.0)  # what a family's default must keep on the tuning prompts (a margin over the goal)
CALIBRATION = ("a white square on a black background", 101)
TUNING_PROMPTS = ["a green circle on a black background", "a red triangle on a white background",
                  "a yellow cross on a black background", "a blue circle on a gray background"]
TUNING_SEED = 7
EVAL_PROMPTS = ["a red circle on a black background", "a yellow square on a gray background",
                "a blue triangle on a white background", "a green cross on a white background",
                "a purple circle on a gray background", "a white triangle on a gray background",
                "a red cross on a gray background", "a blue square on a black background"]
SEEDS = (1, 2)
DEEP_BLOCKS = {"flux": 57, "wan": 30}  # Flux.1-dev's 19 + 38 blocks, Wan 2.1 1.3B's 30
PUBLISHED = {"flux": "flux", "wan": "wan2.1_t2v_1.3B_ret_mode"}  # the variants whose tables they are held to
MAGCACHE_PUBLISHED = {"flux": (0.24, 5, 0.1), "wan": (0.12, 4, 0.2)}  # E, K, R
TEACACHE_PUBLISHED = {"flux": 0.4, "wan": 0.08}  # ComfyUI-TeaCache's recommended rel_l1_thresh (max_skip 3)
GRIDS = {"teacache": (0.05, 1.6), "magcache": (0.02, 1.0), "first_block": (0.02, 0.6), "schedule": (0.002, 0.3),
         "core": (0.02, 0.6)}
COARSE, REFINE = 7, 2  # grid points, then refinements at the floors' crossing (quick: 5, 1)
TABLE_STEPS = 50  # the step count the shipped schedule tables are measured at (finest grid)
SENSITIVITY_STEPS = 20  # ... and their sensitivity (coarsest: conservative near the end at finer counts)


# ---- methods and settings ------------------------------------------------------------------------------

def combos(family: str) -> dict[str, dict]:
    """The skip limits and windows every rule may pick from (both sides alike); ``last``: the last step computed."""
    _, k, r = MAGCACHE_PUBLISHED[family]
    return {"free": dict(K=0, start=0.0, last=False), "teacache K3 last": dict(K=3, start=0.0, last=True),
            f"magcache K{k} R{r:g}": dict(K=k, start=r, last=False)}


def methods(family: str) -> list[dict]:
    """Every method the bench ranks: name, kind, how to build it, the combos it may pick from."""
    pub = PUBLISHED[family]
    every = list(combos(family))
    out = []
    for rule, source in (("teacache", pub), ("teacache", "calibrated"), ("magcache", pub), ("magcache", "calibrated"),
                         ("first_block", "auto")):
        table = {"auto": "", "calibrated": " calibrated"}.get(source, " published")
        out.append(dict(name=f"{rule}{table} reuse", kind="baseline", rule=rule, model_type=source, mode="reuse",
                        combos=every, grid=rule))
    for node in ("easycache", "lazycache"):
        out.append(dict(name=f"core {node}", kind="baseline", core=node, combos=["0-1", ".15-.95"], grid="core"))
    # the schedule rule plans within whatever limits it is given (they can only restrict its plan): it runs free
    for source, label in (("calibrated", "calibrated"), ("auto", "shipped table")):
        for mode in ("reuse", "extrapolate"):
            out.append(dict(name=f"schedule {label} {mode}", kind="reusekit", rule="schedule", model_type=source,
                            mode=mode, combos=["free"], grid="schedule"))
    out.append(dict(name="node defaults", kind="reusekit", defaults=True, combos=["free"], grid=None))
    return out


def published_rows(family: str) -> list[dict]:
    """The published configurations, evaluated as published (no tuning)."""
    e, k, r = MAGCACHE_PUBLISHED[family]
    t = TEACACHE_PUBLISHED[family]
    return [dict(name=f"MagCache published E{e:g} K{k} R{r:g}", kind="baseline", rule="magcache", model_type="calibrated",
                 mode="reuse", combo=dict(K=k, start=r, last=False), threshold=e),
            dict(name=f"TeaCache published {t:g} max_skip 3, last step", kind="baseline", rule="teacache",
                 model_type=PUBLISHED[family], mode="reuse", combo=dict(K=3, start=0.0, last=True), threshold=t)]


# ---- one model ---------------------------------------------------------------------------------------

class Bench:
    """One stand-in model: builds settings, runs them through the real KSampler, counts what ran."""

    def __init__(self, family: str, quick: bool):
        import comfy.utils

        comfy.utils.PROGRESS_BAR_ENABLED = False
        self.family, self.quick = family, quick
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
        from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

        if setting.get("uncached"):
            return self.model
        if setting.get("defaults"):
            inputs = {i.id: i.default for i in self.N.TeaCacheNode.define_schema().inputs if i.id != "model"}
            if setting.get("threshold") is not None:
                inputs["threshold"] = setting["threshold"]
            return self.N.TeaCacheNode.execute(model=self.model, **inputs).args[0]
        combo = setting["combo"]
        if "core" in setting:
            node = EasyCacheNode if setting["core"] == "easycache" else LazyCacheNode
            start, end = (0.0, 1.0) if combo == "0-1" else (0.15, 0.95)
            return node.execute(self.model, setting["threshold"], start, end, False).args[0]
        end = self.end_for_last(steps) if combo["last"] else 1.0
        return self.N.TeaCacheNode.execute(
            model=self.model, rule=setting["rule"], threshold=setting["threshold"], model_type=setting["model_type"],
            start_percent=combo["start"], end_percent=end, max_consecutive_skips=combo["K"], cache_device="device",
            residual_mode=setting["mode"]).args[0]

    def run(self, model, prompt: str, seed: int, steps: int, store) -> tuple[torch.Tensor, float, float, float]:
        """(final latent, calls per branch, the same with a first-block call priced as on a full-size model,
        CPU seconds)."""
        import nodes

        self.P.STORE = store
        self.counts[:] = [0] * len(self.blocks)
        t0 = time.process_time()
        (out,) = nodes.common_ksampler(model, seed, steps, CFG, "euler", "simple", self.cond(prompt), self.cond(""),
                                       {"samples": self.S.empty_latent(self.family)})
        cpu = time.process_time() - t0
        calls = sum(self.counts) / len(self.blocks)
        deep = self.counts[-1] + (self.counts[0] - self.counts[-1]) / DEEP_BLOCKS[self.family]
        return out["samples"], calls, deep, cpu

    def calibrate(self, steps: int) -> dict:
        """One Calibrate run on the calibration prompt (its own store per step count); what it fitted."""
        store = self.stores[steps] = self.tc.CalibrationStore(None)
        self.run(self.N.TeaCacheCalibrateNode.execute(model=self.model).args[0], *CALIBRATION, steps, store)
        return self.P.stats().snapshot()["info"]["last_calibration"]

    def store_for(self, setting: dict, steps: int):
        return self.stores[steps] if setting.get("model_type") == "calibrated" else self.empty

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

def measure(bench: Bench, setting: dict, steps: int, runs: list[tuple[str, int]], refs: dict) -> dict:
    """A setting on ``runs`` (prompt, seed): the point (speedup per branch, mean and worst PSNR...)."""
    model = bench.build(setting, steps)
    store = bench.store_for(setting, steps)
    calls, deep, cpu, psnr, ssim, err = [], [], [], [], [], []
    for prompt, seed in runs:
        ref, ref_calls, ref_cpu = refs[(prompt, seed)]
        out, c, d, t = bench.run(model, prompt, seed, steps, store)
        p, s, e = bench.metrics(out, ref)
        calls.append(c)
        deep.append(d)
        cpu.append(t / ref_cpu)
        psnr.append(p)
        ssim.append(s)
        err.append(e)
    base = sum(refs[r][1] for r in runs) / len(runs)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"x": base / mean(calls), "deep_x": base / mean(deep), "cpu_x": 1.0 / mean(cpu), "psnr": mean(psnr),
            "worst": min(psnr), "ssim": mean(ssim), "err": mean(err), "threshold": setting.get("threshold")}


def references(bench: Bench, steps: int, runs: list[tuple[str, int]]) -> dict:
    refs = {}
    for prompt, seed in runs:
        out, calls, _, cpu = bench.run(bench.model, prompt, seed, steps, bench.empty)
        cpu = min(cpu, bench.run(bench.model, prompt, seed, steps, bench.empty)[3])  # the better of two
        refs[(prompt, seed)] = (out, calls, cpu)
    return refs


def tune(bench: Bench, method: dict, steps: int, tuning: list, refs: dict,
         floors: tuple[float, float] = (MEAN_FLOOR, WORST_FLOOR)) -> tuple[list[dict], dict | None]:
    """Every combo's thresholds on the tuning prompts (a log grid, refined at the ``floors``' crossing):
    the tuning points, and the pick (the fastest keeping the floors)."""
    points = []
    if method.get("defaults"):
        point = measure(bench, dict(method, threshold=None), steps, tuning, refs)
        return [dict(point, combo="free", threshold=-1.0)], dict(point, combo="free", threshold=-1.0)
    lo, hi = GRIDS[method["grid"]]
    coarse, refine = (5, 1) if bench.quick else (COARSE, REFINE)
    for combo_name in method["combos"][:1] if bench.quick else method["combos"]:
        combo = combo_name if "core" in method else combos(bench.family)[combo_name]
        mine = []
        tried: set[float] = set()
        todo = curves.log_grid(lo, hi, coarse)
        for _ in range(refine + 1):
            for th in todo:  # upwards; past the first threshold that misses the floors, higher ones miss them too
                tried.add(th)
                mine.append(dict(measure(bench, dict(method, combo=combo, threshold=th), steps, tuning, refs),
                                 combo=combo_name))
                if len(todo) > 1 and not (mine[-1]["psnr"] >= floors[0] and mine[-1]["worst"] >= floors[1]):
                    break
            nxt = curves.refine(mine, *floors, tried)
            if nxt is None:
                break
            todo = [nxt]
        points += mine
    return points, curves.pick(points, *floors)


def evaluate(bench: Bench, method: dict, steps: int, picked: dict | None, tune_points: list, evals: list,
             refs: dict) -> list[dict]:
    """The pick on the evaluation runs, then along its combo's tuned thresholds until the floors are
    bracketed: the next one up where the pick keeps them, else down until one does (or none is left).
    The method's evaluated curve (the pick marked)."""
    if method.get("defaults"):
        return [dict(measure(bench, dict(method, threshold=None), steps, evals, refs), combo="free", threshold=-1.0,
                     picked=True)]
    if picked is None:  # nothing kept the floors on tuning: its gentlest setting shows how far off it is
        picked = min(tune_points, key=lambda p: p["threshold"])
    same = sorted({p["threshold"] for p in tune_points if p["combo"] == picked["combo"]})
    combo = picked["combo"] if "core" in method else combos(bench.family)[picked["combo"]]

    def at(i):
        return dict(measure(bench, dict(method, combo=combo, threshold=same[i]), steps, evals, refs),
                    combo=picked["combo"], picked=same[i] == picked["threshold"])

    def keeps(point):
        return point["psnr"] >= MEAN_FLOOR and point["worst"] >= WORST_FLOOR

    i = same.index(picked["threshold"])
    out = [at(i)]
    step = 1 if keeps(out[0]) else -1
    j = i + step
    while 0 <= j < len(same):
        out.append(at(j))
        if keeps(out[-1]) != keeps(out[0]) or step == 1:
            break
        j += step
    return out


def default_curve(bench: Bench, steps: int, evals: list, refs: dict, threshold: float) -> list[dict]:
    """The node defaults' curve on the evaluation runs: its threshold scaled around the family default."""
    return [dict(measure(bench, {"defaults": True, "threshold": threshold * f}, steps, evals, refs), combo="free")
            for f in (0.5, 0.75, 1.5, 2.0)]


def sweep(family: str, quick: bool) -> dict:
    """One model, every step count: calibration, references, tuning, evaluation."""
    bench = Bench(family, quick)
    tuning = [(p, TUNING_SEED) for p in (TUNING_PROMPTS[:2] if quick else TUNING_PROMPTS)]
    evals = [(p, s) for p in (EVAL_PROMPTS[:2] if quick else EVAL_PROMPTS) for s in (SEEDS[:1] if quick else SEEDS)]
    out = {"family": family, "steps": {}}
    t0, cpu0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        mags = bench.S.calibrated_magnitudes(bench.model, family, bench.S.PUBLISHED_STEPS[family])
        out["curve_match"] = bench.S.curve_match(family, mags)
        for steps in ((28,) if quick else STEP_COUNTS):
            calibration = bench.calibrate(steps)
            refs = references(bench, steps, tuning + evals)
            rows = []
            for method in methods(family):
                if method.get("model_type") == "auto" and method.get("rule") == "schedule" \
                        and bench.schedule.shipped_table(family) is None:
                    print(f"[{family} {steps}] {method['name']}: no shipped table yet (--write-tables)", flush=True)
                    continue
                tune_points, picked = tune(bench, method, steps, tuning, refs)
                evaluated = evaluate(bench, method, steps, picked, tune_points, evals, refs)
                if method.get("defaults"):
                    config = bench.tc.StepCacheConfig(None, "auto", -1.0, rule="auto", residual_mode="auto")
                    threshold = bench.P.resolved_config(config, bench.P.detect_family(bench.model)).threshold
                    evaluated += default_curve(bench, steps, evals, refs, threshold)
                rows.append({"name": method["name"], "kind": method["kind"], "tune": tune_points, "eval": evaluated,
                             "picked": picked})
                print(f"[{family} {steps}] {method['name']}: tuned {len(tune_points)} settings, picked "
                      f"{_said(picked)}; evaluated {len(evaluated)} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for row in published_rows(family):
                point = measure(bench, row, steps, evals, refs)
                rows.append({"name": row["name"], "kind": "baseline", "tune": [], "picked": None,
                             "eval": [dict(point, combo="published", picked=True)]})
            out["steps"][steps] = {"rows": rows, "calibration": {k: calibration.get(k) for k in ("coefficients", "points")},
                                   "uncached_cpu_s": sum(r[2] for r in refs.values()) / len(refs)}
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - cpu0
    return out


def _said(p: dict | None) -> str:
    if p is None:
        return "none (no setting kept the floors)"
    return f"{p['combo']} {p['threshold']:g}: {p['x']:.2f}x at {p['psnr']:.1f} dB (worst {p['worst']:.1f})"


def pick_defaults(family: str) -> dict:
    """The family's default for the node, on the tuning prompts only: the schedule rule with the shipped
    table (no calibration), each residual mode's fastest threshold keeping DEFAULT_FLOORS at every step
    count; the default is the mode whose slowest step count is fastest, at the smallest of its picks."""
    bench = Bench(family, quick=False)
    tuning = [(p, TUNING_SEED) for p in TUNING_PROMPTS]
    picks: dict[str, dict[int, dict | None]] = {}
    with torch.inference_mode():
        for steps in STEP_COUNTS:
            refs = references(bench, steps, tuning)
            for method in methods(family):
                if method.get("rule") == "schedule" and method["model_type"] == "auto":
                    _, picked = tune(bench, method, steps, tuning, refs, DEFAULT_FLOORS)
                    picks.setdefault(method["mode"], {})[steps] = picked
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
            bench.run(bench.N.TeaCacheCalibrateNode.execute(model=bench.model).args[0], prompt, TUNING_SEED,
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
            ref = bench.run(bench.model, prompt, TUNING_SEED, steps, bench.empty)[0]
            for k in range(1, steps):
                actions = ["C"] * steps
                actions[k] = "S"
                with forced_plan(sched, actions):
                    out = bench.run(model, prompt, TUNING_SEED, steps, store)[0]
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
    """Per model and step count: each method's speedup at the floors, the bests, the defaults."""
    out = {}
    for family, res in results.items():
        for steps, data in res["steps"].items():
            steps = int(steps)
            best = {"baseline": (1.0, "uncached"), "reusekit": (1.0, "uncached")}
            per = {}
            for row in data["rows"]:
                x = curves.speedup_at(row["eval"], MEAN_FLOOR, WORST_FLOOR)
                per[row["name"]] = x
                kind = row["kind"]
                if x > best[kind][0]:
                    best[kind] = (x, row["name"])
            defaults = next(r for r in data["rows"] if r["name"] == "node defaults")
            own = next(p for p in defaults["eval"] if p.get("picked"))
            out[(family, steps)] = {"per": per, "best": best, "default_x": per["node defaults"],
                                    "default_point": own, "rows": data["rows"]}
    return out


def report(results: dict[str, dict], args) -> str:
    summary = summarize(results)
    lines = []
    for (family, steps), s in sorted(summary.items()):
        lines.append(f"\n{family} stand-in, {steps} steps (evaluation: {'2x1' if args.quick else '8x2'} runs); "
                     f"speedup at >= {MEAN_FLOOR:g} dB mean and >= {WORST_FLOOR:g} dB worst, read off the curve:")
        lines.append(f"  {'method':<42}{'kind':<10}{'at floor':>9}  {'pick (tuning)':<34}{'pick on eval':>30}")
        for row in sorted(s["rows"], key=lambda r: -s["per"][r["name"]]):
            own = next((p for p in row["eval"] if p.get("picked")), None)
            ev = "" if own is None else f"{own['x']:.2f}x {own['psnr']:.1f}/{own['worst']:.1f} dB"
            lines.append(f"  {row['name']:<42}{row['kind']:<10}{s['per'][row['name']]:>8.2f}x  "
                         f"{_said(row['picked'])[:34]:<34}{ev:>30}")
        (bx, bn), (rx, rn) = s["best"]["baseline"], s["best"]["reusekit"]
        dp = s["default_point"]
        lines.append(f"  best baseline {bx:.2f}x ({bn}); best ReuseKit {rx:.2f}x ({rn}): {rx / bx:.2f}; node defaults "
                     f"{s['default_x']:.2f}x on their curve, their own setting {dp['x']:.2f}x at {dp['psnr']:.1f} dB "
                     f"(worst {dp['worst']:.1f})")
    at = [s for (f, steps), s in summary.items() if steps in RESULT_STEPS] or list(summary.values())
    x = min(s["default_x"] for s in at)
    y = min(s["best"]["reusekit"][0] / s["best"]["baseline"][0] for s in at)
    z = min(s["default_point"]["worst"] for s in at)
    c = max(r["curve_match"] for r in results.values())
    lines.append(f"\nran {max(r['seconds'] for r in results.values()):.0f} s (the slower model's worker; its CPU time "
                 f"{max(r.get('cpu_seconds', 0.0) for r in results.values()):.0f} s: the wall time on two idle cores)")
    lines.append(f"RESULT default_speedup_min={x:.2f} vs_best_baseline_min={y:.2f} default_worst_psnr_min={z:.1f} "
                 f"curve_match={c:.4f}")
    return "\n".join(lines)


COLORS = {"teacache published reuse": (120, 120, 120), "teacache calibrated reuse": (60, 60, 60),
          "magcache published reuse": (170, 140, 90), "magcache calibrated reuse": (130, 90, 30),
          "first_block reuse": (150, 90, 160), "core easycache": (90, 160, 160), "core lazycache": (40, 120, 120),
          "schedule calibrated reuse": (40, 160, 60), "schedule calibrated extrapolate": (0, 110, 20),
          "schedule shipped table reuse": (220, 80, 80), "schedule shipped table extrapolate": (170, 0, 0),
          "node defaults": (20, 40, 220)}


def plots(results: dict[str, dict], png_dir: Path) -> list[Path]:
    """One picture per model: a panel per step count, speedup against mean PSNR on the evaluation runs."""
    paths = []
    for family, res in results.items():
        panels = []
        for steps, data in sorted(res["steps"].items(), key=lambda kv: int(kv[0])):
            panels.append((f"{family} stand-in, {steps} steps: mean PSNR (dB) of each evaluated setting",
                           {r["name"]: r["eval"] for r in data["rows"] if r["name"] in COLORS}))
        path = png_dir / f"step_cache_{family}.png"
        curves.plot(panels, path, COLORS)
        paths.append(path)
    return paths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="28 steps only, 2 tuning and 2 evaluation runs, a coarse grid")
    ap.add_argument("--family", choices=FAMILIES, help="(worker) one model, results to --out")
    ap.add_argument("--out")
    ap.add_argument("--png-dir", help="write docs-style plots step_cache_<model>.png here")
    ap.add_argument("--json", help="keep every measured point here")
    ap.add_argument("--write-tables", action="store_true", help="measure the schedule rule's shipped tables")
    ap.add_argument("--pick-defaults", action="store_true", help="pick each family's default on the tuning prompts")
    args = ap.parse_args()
    if args.family:  # a worker
        rkharness.bootstrap()
        torch.set_num_threads(1)
        logging.getLogger("reusekit").setLevel(logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)
        data = (write_tables(args.family) if args.write_tables else pick_defaults(args.family) if args.pick_defaults
                else sweep(args.family, args.quick))
        Path(args.out).write_text(json.dumps(data))
        return
    tmp = Path(tempfile.mkdtemp(prefix="rk-step-bench-"))
    procs = {}
    for family in FAMILIES:  # one worker per model, side by side (the machine's two cores)
        cmd = [sys.executable, __file__, "--family", family, "--out", str(tmp / f"{family}.json")]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--write-tables"] if args.write_tables else []
        cmd += ["--pick-defaults"] if args.pick_defaults else []
        procs[family] = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    failed = [f for f, p in procs.items() if p.wait() != 0]
    if failed:
        raise SystemExit(f"the {', '.join(failed)} worker failed")
    results = {f: json.loads((tmp / f"{f}.json").read_text()) for f in FAMILIES}
    if args.write_tables:
        target = rkharness.ROOT / "caching" / "schedule_tables.json"
        target.write_text(json.dumps({
            "about": "The schedule rule's residual tables per family, measured by bench/step_cache.py --write-tables "
                     "on its tuning prompts with the family's stand-in model (tests/tinymodels/standins.py).",
            "tables": results}, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {target}")
        return
    if args.pick_defaults:
        for family, res in results.items():
            d = res["default"]
            print(f"{family}: default " + ("none keeps the floors" if d is None else
                                           f"schedule {d['mode']} threshold {d['threshold']:g}"))
        return
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    if args.png_dir:
        for path in plots(results, Path(args.png_dir)):
            print(f"wrote {path}")
    print(report(results, args))


if __name__ == "__main__":
    main()
