"""The step cache's ``schedule`` rule: a per-step plan made before the run (pure torch + stdlib).

LeMiCa (Gao et al., 2025) showed that a schedule chosen offline, by bounding the error of every
stretch the cache spans, beats deciding step by step. FasterCache (Lv et al., 2025) showed that the
difference between the cond and uncond outputs changes slowly, so a step may compute the cond branch
alone and rebuild the uncond one from it and the last measured difference, at half the cost. This
module plans with both, for any run (step count, schedule, CFG scale, window, skip limit), from a
:class:`ResidualTable` measured by complete runs on a grid of sigmas: the inner products of the stack's
residuals (cond and uncond), and per step the gain from a residual's error to the model output's.

Each step of a run is planned as one of

- ``C``: every branch computed (the cond-minus-uncond difference is measured here);
- ``H``: the cond branch computed, the uncond one set to the cond's residual minus that difference;
- ``S``: no branch computed, each adds its residual forecast (``reuse`` / ``extrapolate``, the same
  formulas the run uses: :func:`forecast`).

Every residual a run would hold is a linear combination of the table's residuals (interpolated in
sigma), so the planner knows the exact error each choice makes in the guided residual
``cfg * cond + (1 - cfg) * uncond`` (its own run's CFG scale) on the table's trajectories. A skipped
step moves the latent by its sigma step times the output's error: a stretch (the steps between two
computed ones) adds those up, and its error is the norm of the sum. The plan is the cheapest (calls per
branch; then the least total squared error) whose every stretch stays within the threshold: LeMiCa's
bound on the worst stretch, found as a shortest path over the steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TABLES = Path(__file__).with_name("schedule_tables.json")  # per family, measured by bench/step_cache.py
SAMPLES = 16384  # values of each residual a calibration keeps (fixed positions): the inner products' estimate
EXTRAPOLATE_SPAN = 1.0  # how far (in units of the measured sigma gap) a residual is extrapolated
MAX_STRETCH = 16  # at most this many steps between two computed ones (bounds the planner's work)
VERIFY_MARGIN = 1.5  # a stretch whose forecast erred this much more than the table said tightens the rest


def sample(residual: torch.Tensor) -> torch.Tensor:
    """SAMPLES values of ``residual`` at fixed, evenly spread positions, as float32 where it lives, scaled
    so that their norm estimates the whole residual's."""
    flat = residual.detach().reshape(-1)
    n = flat.numel()
    k = min(SAMPLES, n)
    idx = ((torch.arange(k, dtype=torch.int64) * n) // k).to(flat.device)
    return flat[idx].float() * math.sqrt(n / k)


def forecast(history: list[tuple[float, Any]], sigma: float, mode: str) -> Any:
    """A branch's residual forecast at ``sigma`` from its stored residuals ``history`` ((sigma, residual),
    oldest first): the last one (``reuse``), or it continued along the last two's divided difference,
    never further than their gap (``extrapolate``). Residuals are anything with + and * by a number (the
    planner's coefficient vectors); the run's tensors follow the same formula
    (:meth:`caching.step_cache.RunState.residual`)."""
    s1, r1 = history[-1]
    if mode != "extrapolate" or len(history) < 2 or history[-2][0] == s1:
        return r1
    s0, r0 = history[-2]
    gap = s1 - s0
    step = max(-abs(gap) * EXTRAPOLATE_SPAN, min(abs(gap) * EXTRAPOLATE_SPAN, sigma - s1))
    return r1 + (r1 + r0 * -1.0) * (step / gap)


class Vec(dict):
    """A sparse linear combination of residuals: {index: coefficient}."""

    def __add__(self, other: Vec) -> Vec:
        out = Vec(self)
        for i, c in other.items():
            out[i] = out.get(i, 0.0) + c
        return out

    def __mul__(self, k: float) -> Vec:
        return Vec({i: c * k for i, c in self.items()})

    def __sub__(self, other: Vec) -> Vec:
        return self + other * -1.0


@dataclass(frozen=True)
class ResidualTable:
    """A model's stack residuals on a grid of sigmas (descending): ``gram[i][j]``, the inner products of
    vectors ``i = step * len(branches) + branch``, scaled so that their mean squared norm is 1; ``gains``,
    per step, how much a residual's error moves the model's output (measured with the last step's
    residual: output error over residual error)."""

    sigmas: tuple[float, ...]
    branches: tuple[str, ...]  # ("cond",) or ("cond", "uncond")
    gram: tuple[tuple[float, ...], ...]
    gains: tuple[float, ...]
    sensitivity: tuple[float, ...] | None = None  # per step: how much of a latent error there reaches the
    # result (the later steps correct part of it); None: all of it

    @classmethod
    def from_samples(cls, runs: list[tuple[list[float], dict[str, list[torch.Tensor]], list[float], float]]
                     ) -> ResidualTable:
        """The table of complete runs on the same sigmas: ``(sigmas, {branch: sampled residuals per step},
        gain per step (output error over residual error), the outputs' mean norm)``. Each run is scaled
        to residuals of mean squared norm 1 and its gains to errors relative to its mean output, so the
        planner's errors are relative to the output whatever the resolution; several runs (prompts) add
        up (the planner then bounds their mean error)."""
        sigmas = tuple(float(s) for s in runs[0][0])
        branches = tuple(b for b in ("cond", "uncond") if b in runs[0][1])
        total, gains = None, [0.0] * len(sigmas)
        for run_sigmas, per_branch, run_gains, out_norm in runs:
            if tuple(float(s) for s in run_sigmas) != sigmas or not all(b in per_branch for b in branches) \
                    or len(run_gains) != len(sigmas):
                raise ValueError("residual table: every run needs the same sigmas, branches and gains")
            # on the CPU first: Apple's MPS has no float64, and a calibration on a Mac was lost to the error
            vectors = torch.stack([per_branch[b][i].cpu().double() for i in range(len(sigmas)) for b in branches])
            gram = vectors @ vectors.T
            scale = float(gram.diagonal().mean().clamp_min(1e-300))
            total = gram / scale if total is None else total + gram / scale
            gains = [g + float(x) * math.sqrt(scale) / max(out_norm, 1e-12) / len(runs)
                     for g, x in zip(gains, run_gains, strict=True)]
        total = total / len(runs)
        return cls(sigmas, branches, tuple(tuple(float(v) for v in row) for row in total.tolist()), tuple(gains))

    def to_json(self) -> dict[str, Any]:
        return {"sigmas": list(self.sigmas), "branches": list(self.branches), "gains": list(self.gains),
                "sensitivity": None if self.sensitivity is None else list(self.sensitivity),
                "gram": [[float(f"{v:.7g}") for v in row] for row in self.gram]}

    @classmethod
    def from_json(cls, data: Any) -> ResidualTable | None:
        """The table stored by :meth:`to_json`, or None for anything malformed (a miss, never an error)."""
        if not isinstance(data, dict):
            return None
        sigmas, branches, gram, gains, sens = (data.get(k) for k in ("sigmas", "branches", "gram", "gains",
                                                                      "sensitivity"))
        ok = (isinstance(sigmas, list) and len(sigmas) >= 2 and all(map(finite_number, sigmas))
              and all(a > b for a, b in zip(sigmas, sigmas[1:], strict=False))
              and branches in (["cond"], ["cond", "uncond"]) and isinstance(gram, list)
              and len(gram) == len(sigmas) * len(branches)
              and all(isinstance(r, list) and len(r) == len(gram) and all(map(finite_number, r)) for r in gram)
              and isinstance(gains, list) and len(gains) == len(sigmas) and all(map(finite_number, gains))
              and all(g >= 0 for g in gains)
              and (sens is None or (isinstance(sens, list) and len(sens) == len(sigmas)
                                    and all(finite_number(v) and v >= 0 for v in sens))))
        if not ok:
            return None
        return cls(tuple(float(s) for s in sigmas), tuple(branches), tuple(tuple(float(v) for v in r) for r in gram),
                   tuple(float(g) for g in gains), None if sens is None else tuple(float(v) for v in sens))

    def with_sensitivity_of(self, other: ResidualTable | None) -> ResidualTable:
        """This table with ``other``'s sensitivity read at its sigmas (a calibration measures no
        sensitivity: it borrows the family's shipped one); itself where ``other`` has none."""
        if other is None or other.sensitivity is None:
            return self
        sens = tuple(sum(w * other.sensitivity[i] for i, w in other._weights(s)) for s in self.sigmas)
        return dataclasses.replace(self, sensitivity=sens)

    def _weights(self, sigma: float) -> tuple[tuple[int, float], ...]:
        """The grid steps (and weights) whose linear interpolation is the residual at ``sigma``."""
        grid = self.sigmas
        if sigma >= grid[0]:
            return ((0, 1.0),)
        if sigma <= grid[-1]:
            return ((len(grid) - 1, 1.0),)
        i = next(i for i in range(len(grid) - 1) if grid[i] >= sigma >= grid[i + 1])
        w = (grid[i] - sigma) / (grid[i] - grid[i + 1])
        return ((i, 1.0 - w), (i + 1, w))

    def on(self, sigmas: list[float]) -> tuple[list[list[float]], list[float]]:
        """The inner products of the residuals at ``sigmas`` (a run's steps; ``k * B + branch``) and the
        gain at each (times the sensitivity there), read by linear interpolation in sigma between the table's steps (the nearest end
        beyond the grid)."""
        nb = len(self.branches)
        weights = torch.zeros(len(sigmas) * nb, len(self.sigmas) * nb, dtype=torch.float64)
        gains = []
        sens = self.sensitivity or (1.0,) * len(self.sigmas)
        for k, s in enumerate(sigmas):
            pairs = self._weights(float(s))
            gains.append(sum(w * self.gains[i] * sens[i] for i, w in pairs))
            for i, w in pairs:
                for b in range(nb):
                    weights[k * nb + b, i * nb + b] += w
        gram = weights @ torch.tensor(self.gram, dtype=torch.float64) @ weights.T
        return gram.tolist(), gains


def finite_number(v) -> bool:
    """A JSON number a float holds finitely (an integer too large for one, 10**400, is not: no OverflowError)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Plan:
    """One run's schedule: an action per step; per step the error its stretch has reached there (0 at a
    computed step); and at each computed step that ends a stretch, the cond's forecast error the table
    predicts there, relative to its residual (what the run verifies: :data:`VERIFY_MARGIN`)."""

    actions: tuple[str, ...]
    errors: tuple[float, ...]
    checks: tuple[float, ...] = ()


@dataclass
class _Node:
    """The cheapest plan up to a computed (C) or half-computed (H) step, and what the run holds there."""

    cost: float
    sse: float
    back: tuple[int, str] | None  # the computed step before (its step and kind)
    errors: list  # the error of the stretch after each step from the one before to here
    history: list  # per branch, the last two stored residuals (sigma, Vec)
    delta: Vec | None  # the cond-minus-uncond difference of the last C
    run: int  # non-C steps in a row up to here


def plan(table: ResidualTable, sigmas: list[float], threshold: float, cfg: float = 1.0, two_branches: bool = False,
         mode: str = "reuse", max_consecutive: int = 0, allowed: list[bool] | None = None) -> Plan:
    """The schedule of a run whose steps start at ``sigmas`` (descending; the sampler's list with its
    final sigma, so ``len(sigmas) - 1`` steps): the fewest calls per branch (C costs 1, H half: only with
    ``two_branches``, a cond and an uncond batch under ``cfg`` and a table that measured both) whose every
    stretch errs at most ``threshold``, with at most ``max_consecutive`` (0: no limit) non-C steps in a
    row; steps where ``allowed`` is False (outside the window) are C. Threshold 0: every step C."""
    steps = len(sigmas) - 1
    if steps < 1 or threshold <= 0:
        return Plan(("C",) * max(steps, 0), (0.0,) * max(steps, 0))
    return _plan(table, tuple(float(s) for s in sigmas), float(threshold), float(cfg),
                 two_branches and table.branches == ("cond", "uncond"), mode, int(max_consecutive),
                 None if allowed is None else tuple(bool(a) for a in allowed))


class _Run:
    """A run's steps seen through a table: the residuals as unit vectors, the guided combination, the norm
    of any combination, and how much a step's output error moves the result."""

    def __init__(self, table: ResidualTable, sigmas: tuple[float, ...], cfg: float, half: bool):
        self.sigmas, self.cfg, self.half = sigmas, cfg, half
        self.nb = len(table.branches)
        self.steps = len(sigmas) - 1
        self.gram, self.gains = table.on(list(sigmas[:-1]))
        self.truth = [[Vec({k * self.nb + b: 1.0}) for b in range(self.nb)] for k in range(self.steps)]

    def guided(self, vs: list[Vec]) -> Vec:
        return vs[0] * self.cfg + vs[1] * (1.0 - self.cfg) if self.half else vs[0]

    def norm(self, v: Vec) -> float:
        items = list(v.items())
        squared = sum(ci * cj * self.gram[i][j] for i, ci in items for j, cj in items)
        if not math.isfinite(squared):  # a table of huge values overflows (inf - inf: NaN): no step is that safe
            return math.inf
        return math.sqrt(max(0.0, squared))

    def weight(self, k: int) -> float:
        """A step's output error moves the latent by its sigma step (times the gain, and the sensitivity)."""
        return abs(self.sigmas[k] - self.sigmas[k + 1]) * self.gains[k]

    def skip_error(self, history: list, k: int, mode: str) -> Vec:
        """The latent error of step k skipped: every branch's forecast from ``history`` against the truth."""
        guesses = [forecast(h, self.sigmas[k], mode) for h in history]
        return (self.guided(guesses) - self.guided(self.truth[k])) * self.weight(k)


def single_skip_errors(table: ResidualTable, sigmas: list[float], cfg: float = 1.0, two_branches: bool = False,
                       mode: str = "reuse") -> list[float]:
    """Per step, the planner's error for skipping that step alone (every other step computed): what a
    table's sensitivity is measured against (0 for the first step, which is never skipped)."""
    run = _Run(table, tuple(float(s) for s in sigmas), float(cfg), two_branches and table.branches == ("cond", "uncond"))
    out = [0.0]
    for k in range(1, run.steps):
        history = [[(run.sigmas[j], run.truth[j][b]) for j in range(max(0, k - 2), k)] for b in range(run.nb)]
        out.append(run.norm(run.skip_error(history, k, mode)))
    return out


@functools.lru_cache(maxsize=256)
def _plan(table, sigmas, threshold, cfg, half, mode, max_consecutive, allowed) -> Plan:
    """A shortest path over the steps: a node per step that may be C or H, an edge per stretch of S
    steps between two of them (kept only while its error stays within the threshold), ordered by cost,
    then total squared error. Each node keeps what its cheapest path leaves the run holding."""
    geo = _Run(table, sigmas, cfg, half)
    steps, nb, truth, guided, norm, weight = geo.steps, geo.nb, geo.truth, geo.guided, geo.norm, geo.weight
    limit = min(MAX_STRETCH, max_consecutive or MAX_STRETCH)

    def may_skip(k):
        return allowed is None or allowed[k]

    def better(cand, old):
        return old is None or (cand.cost, cand.sse) < (old.cost, old.sse)

    best: dict[tuple[int, str], _Node] = {(0, "C"): _Node(
        1.0, 0.0, None, [0.0], [[(sigmas[0], truth[0][b])] for b in range(nb)],
        truth[0][0] - truth[0][1] if half else None, 0)}
    end: _Node | None = None
    for k in range(steps):
        for kind in ("C", "H"):
            node = best.get((k, kind))
            if node is None:
                continue
            drift, errors = Vec(), []  # the stretch's accumulated latent error, and its norm after each S step
            for j in range(k + 1, steps + 1):  # j: the next step computed (C or H), or the run's end
                run = node.run + (j - k - 1)
                if j == steps:
                    cand = _Node(node.cost, node.sse + (errors[-1] ** 2 if errors else 0.0), (k, kind), errors, [],
                                 None, run)
                    end = cand if better(cand, end) else end
                    break
                cand = _Node(node.cost + 1.0, node.sse + (errors[-1] ** 2 if errors else 0.0), (k, kind),
                             errors + [0.0], [(h + [(sigmas[j], truth[j][b])])[-2:] for b, h in enumerate(node.history)],
                             truth[j][0] - truth[j][1] if half else None, 0)
                best[(j, "C")] = cand if better(cand, best.get((j, "C"))) else best[(j, "C")]
                if half and may_skip(j) and (not max_consecutive or run + 1 <= max_consecutive):
                    rebuilt = truth[j][0] - node.delta  # the uncond from the cond computed at j
                    err = norm(drift + (guided([truth[j][0], rebuilt]) - guided(truth[j])) * weight(j))
                    if err <= threshold:
                        cand = _Node(node.cost + 1.0 / nb, node.sse + err * err, (k, kind), errors + [err],
                                     [(node.history[0] + [(sigmas[j], truth[j][0])])[-2:],
                                      (node.history[1] + [(sigmas[j], rebuilt)])[-2:]], node.delta, run + 1)
                        if better(cand, best.get((j, "H"))):
                            best[(j, "H")] = cand
                if not may_skip(j) or j - k > limit or (max_consecutive and run + 1 > max_consecutive):
                    break
                drift = drift + geo.skip_error(node.history, j, mode)
                errors = errors + [norm(drift)]
                if errors[-1] > threshold:
                    break
    actions, errors, checks = ["S"] * steps, [0.0] * steps, [0.0] * steps
    node, at = end, steps
    while node.back is not None:  # walk back: each node ends the stretch after its back step
        k, kind = node.back
        errors[k + 1:k + 1 + len(node.errors)] = node.errors
        actions[k] = kind
        before = best[node.back]
        if at < steps and at - k > 1 and actions[at] == "C":  # a stretch of skips ends in a computed step
            guess = forecast(before.history[0], sigmas[at], mode)
            checks[at] = norm(guess - truth[at][0]) / max(norm(truth[at][0]), 1e-12)
        node, at = before, k
    return Plan(tuple(actions), tuple(errors), tuple(checks))


@functools.lru_cache(maxsize=None)
def shipped_table(family: str) -> ResidualTable | None:
    """The table shipped for ``family`` (measured by ``bench/step_cache.py --write-tables`` on its tuning
    prompts with the family's stand-in model), or None."""
    try:
        data = json.loads(TABLES.read_text())
    except (OSError, ValueError):
        return None
    return ResidualTable.from_json((data.get("tables") or {}).get(family)) if isinstance(data, dict) else None
