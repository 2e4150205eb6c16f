"""Step cache (TeaCache) math: pure torch + stdlib, no ComfyUI.

TeaCache (Liu et al., CVPR 2025) predicts how much a DiT's output will change from how much the
timestep-modulated input of its first block changed: ``x = mean|m_t - m_prev| / mean|m_prev|``,
rescaled by a per-model polynomial and accumulated over steps. While the sum stays under
``rel_l1_thresh`` the transformer stack is skipped and the residual (stack output minus stack
input) stored at the last computed step is added instead; a computed step resets the sum.

This module holds the per-cond state (:class:`CondState`), the joint skip decision for one model
call (:class:`RunState.decide`), the per-run report, the published coefficients and the
calibration fit. The ComfyUI side (patches/teacache.py) only finds the modulated input and the
block stack's ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Published rescale polynomials (highest power first), from ali-vilab/TeaCache via the ComfyUI
# TeaCache pack: see README "Step cache". Facts, not code.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "flux": (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01),
    "flux-kontext": (-1.04655119e+03, 3.12563399e+02, -1.69500694e+01, 4.10995971e-01, 3.74537863e-02),
    "hunyuan_video": (7.33226126e+02, -4.01131952e+02, 6.75869174e+01, -3.14987800e+00, 9.61237896e-02),
    "wan2.1_t2v_1.3B_ret_mode": (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02),
    "wan2.1_t2v_14B_ret_mode": (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01),
    "wan2.1_i2v_480p_14B_ret_mode": (2.57151496e+05, -3.54229917e+04, 1.40286849e+03, -1.35890334e+01, 1.32517977e-01),
    "wan2.1_i2v_720p_14B_ret_mode": (8.10705460e+03, 2.13393892e+03, -3.72934672e+02, 1.66203073e+01, -4.17769401e-02),
}

EXTRAPOLATE_SPAN = 1.0  # how far (in units of the measured sigma gap) a residual is extrapolated


def rel_l1(cur: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Relative L1 change ``mean|cur - prev| / mean|prev|`` as a 0-d tensor on their device
    (no host sync)."""
    cur, prev = cur.float(), prev.float()
    return (cur - prev).abs().mean() / prev.abs().mean().clamp_min(1e-12)


def rescale(coefficients: tuple[float, ...] | list[float], x: torch.Tensor) -> torch.Tensor:
    """``|poly(x)|`` by Horner's rule (highest power first); stays on x's device."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for c in coefficients:
        out = out * x + float(c)
    return out.abs()


def fit_polynomial(xs: list[float], ys: list[float], degree: int = 2) -> tuple[float, ...]:
    """Least-squares fit ``y = poly(x)``, returned as 5 coefficients, highest power first (leading
    zeros pad lower degrees, so calibrated and published polynomials share one format)."""
    if len(xs) != len(ys):
        raise ValueError("calibration needs as many outputs as inputs")
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x == x and y == y and abs(x) != float("inf")]
    if len(pts) < 2:
        raise ValueError(f"calibration needs at least 2 steps with a previous step, got {len(pts)}")
    degree = max(1, min(degree, len(pts) - 1, 4))
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    vander = torch.stack([x ** k for k in range(degree, -1, -1)], dim=1)
    sol = torch.linalg.lstsq(vander, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    coeffs = [0.0] * (4 - degree) + [float(c) for c in sol]
    return tuple(coeffs)


@dataclass(frozen=True)
class StepCacheConfig:
    """What a user sets on the node (validated there)."""

    coefficients: tuple[float, ...] | None  # None: resolve per run (calibration, then published)
    model_type: str
    rel_l1_thresh: float
    start_percent: float = 0.0
    end_percent: float = 1.0
    max_consecutive_skips: int = 0  # 0: no limit
    cache_device: str = "device"  # "device" (the model's) or "cpu"
    calibrate: bool = False
    residual_mode: str = "reuse"  # "reuse" (TeaCache) or "extrapolate" (first order in sigma)


@dataclass
class CondState:
    """One conditioning's cache state within a run (keyed by its uuid)."""

    label: str
    prev_modulated: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    residual_sigma: torch.Tensor | None = None  # 0-d, on the sampler's device
    slope: torch.Tensor | None = None  # d residual / d sigma between the last two computed calls
    slope_span: torch.Tensor | None = None
    accumulated: torch.Tensor | float = 0.0
    consecutive: int = 0
    computed: int = 0
    skipped: int = 0
    trace: list = field(default_factory=list)  # accumulated distance per call (tensors until the end)
    pattern: list = field(default_factory=list)  # "C" computed / "S" skipped, per call
    meta: tuple | None = None  # (shape, dtype, device) of the modulated input
    # calibration
    prev_residual: torch.Tensor | None = None
    calib_x: list = field(default_factory=list)
    calib_y: list = field(default_factory=list)

    def clear(self) -> None:
        self.prev_modulated = self.residual = self.prev_residual = self.slope = None
        self.residual_sigma = self.slope_span = None
        self.accumulated, self.consecutive, self.meta = 0.0, 0, None


class RunState:
    """Everything one sampling run holds. Created at the start of each run, dropped at its end."""

    def __init__(self, config: StepCacheConfig, coefficients: tuple[float, ...],
                 start_sigma: float, end_sigma: float):
        self.config = config
        self.coefficients = coefficients
        self.start_sigma, self.end_sigma = start_sigma, end_sigma
        self.conds: dict[Any, CondState] = {}
        self.calls_computed = 0
        self.calls_skipped = 0
        self.unhooked = 0  # calls computed without the cache seeing them (the model never reached its blocks)
        self.time_computed = 0.0
        self.time_skipped = 0.0
        self.resets = 0
        self.started = time.perf_counter()

    def in_window(self, sigma: torch.Tensor) -> torch.Tensor:
        """Whether skipping is allowed at ``sigma``, as a tensor on its device (no host sync)."""
        return (sigma > self.end_sigma) & (sigma <= self.start_sigma)

    def cond(self, key: Any, label: str) -> CondState:
        state = self.conds.get(key)
        if state is None:
            state = self.conds[key] = CondState(label)
        return state

    def decide(self, keys: list[Any], labels: list[str], modulated: list[torch.Tensor],
               may_skip: bool | torch.Tensor, residual_shape: tuple | None = None) -> bool:
        """Update each cond's distance from its modulated input; True when the whole call skips.

        A call skips only when every cond in it has a residual for the same shape, stays under the
        threshold and under ``max_consecutive_skips``, inside the window (``may_skip``, a bool or a
        0-d bool tensor) and with a stored residual of ``residual_shape`` (when given: a residual of
        another shape is never added). Reading the decision is the only host sync, and only when a
        skip is possible at all.
        """
        cfg = self.config
        states = [self.cond(k, lab) for k, lab in zip(keys, labels, strict=True)]
        candidates = []
        possible = may_skip is not False and not cfg.calibrate
        for state, mod in zip(states, modulated, strict=True):
            meta = (tuple(mod.shape), mod.dtype, mod.device)
            if state.meta is not None and state.meta != meta:  # shape/dtype/device change: start clean
                state.clear()
                self.resets += 1
            state.meta = meta
            if state.prev_modulated is None:
                candidates.append(None)
                possible = False
                continue
            dist = rel_l1(mod, state.prev_modulated)
            if cfg.calibrate:
                state.calib_x.append(dist)
            candidates.append(state.accumulated + rescale(self.coefficients, dist))
            if state.residual is None or (cfg.max_consecutive_skips and state.consecutive >= cfg.max_consecutive_skips):
                possible = False
            elif residual_shape is not None and tuple(state.residual.shape) != tuple(residual_shape):
                possible = False
        skip = False
        if possible:
            worst = torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in candidates]).max()
            ok = torch.logical_and(worst < cfg.rel_l1_thresh, torch.as_tensor(may_skip, device=worst.device))
            skip = bool(ok)  # the one sync per call
        for state, mod, cand in zip(states, modulated, candidates, strict=True):
            state.prev_modulated = mod
            if skip:
                state.accumulated = cand
                state.consecutive += 1
                state.skipped += 1
            else:
                state.accumulated = 0.0
                state.consecutive = 0
                state.computed += 1
            state.trace.append(cand if cand is not None else 0.0)
            state.pattern.append("S" if skip else "C")
        return skip

    def store_residual(self, key: Any, residual: torch.Tensor, sigma: torch.Tensor | float | None = None) -> None:
        """Keep a computed call's residual (and, to extrapolate, its slope in sigma). No host sync.

        Every computation runs on the residual's device; with ``cache_device`` "cpu" the results are
        then copied to the CPU without waiting, so a CPU-held tensor is never read on the CPU: it only
        goes back to the device by a copy queued on the same stream (:meth:`residual`, the slope here)."""
        state = self.conds[key]
        extrapolate = self.config.residual_mode == "extrapolate"
        prev = (state.residual.to(residual.device, non_blocking=True)
                if state.residual is not None and (extrapolate or self.config.calibrate) else None)
        if self.config.calibrate and prev is not None:
            state.calib_y.append(rel_l1(residual, prev))
        sigma = None if sigma is None else torch.as_tensor(sigma, dtype=torch.float32)
        slope = span = None
        if (extrapolate and sigma is not None and prev is not None
                and state.residual_sigma is not None and prev.shape == residual.shape):
            gap = (sigma - state.residual_sigma).to(residual.device)
            safe = torch.where(gap == 0, torch.ones_like(gap), gap)
            slope = torch.where(gap == 0, 0.0, 1.0) * (residual - prev) / safe
            span = (sigma - state.residual_sigma).abs() * EXTRAPOLATE_SPAN
        if self.config.cache_device == "cpu":
            residual = residual.to("cpu", non_blocking=True)
            slope = None if slope is None else slope.to("cpu", non_blocking=True)
        state.residual, state.residual_sigma, state.slope, state.slope_span = residual, sigma, slope, span

    def residual(self, key: Any, like: torch.Tensor, sigma: torch.Tensor | float | None = None) -> torch.Tensor:
        """The residual to add on a skipped call: the stored one, or (``extrapolate``) continued
        along its last slope to ``sigma``, computed on ``like``'s device (no host sync)."""
        state = self.conds[key]
        res = state.residual.to(like.device, like.dtype, non_blocking=True)
        if state.slope is not None and sigma is not None:
            # never further than the span the slope was measured over: a longer line overshoots
            span = state.slope_span.to(like.device)
            step = torch.as_tensor(sigma, dtype=torch.float32).to(like.device) - state.residual_sigma.to(like.device)
            step = torch.minimum(torch.maximum(step, -span), span)
            res = res + state.slope.to(like.device, like.dtype, non_blocking=True) * step.to(like.dtype)
        return res

    def release(self) -> None:
        """Drop every tensor kept between calls (the counts and traces stay for the report)."""
        for state in self.conds.values():
            state.clear()

    def residual_bytes(self) -> dict[str, int]:
        out = {"cpu": 0, "device": 0}
        for state in self.conds.values():
            for t in (state.residual, state.slope, state.prev_modulated):
                if t is not None:
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

    def summary(self, total_steps: int | None = None) -> dict[str, Any]:
        """The run's report, JSON-ready (converts the traces: one sync, at the end of the run)."""
        calls = self.calls_computed + self.calls_skipped
        per_call = self.time_computed / self.calls_computed if self.calls_computed else 0.0
        per_skip = self.time_skipped / self.calls_skipped if self.calls_skipped else 0.0
        saved = max(0.0, per_call - per_skip) * self.calls_skipped
        conds = {}
        for state in self.conds.values():
            conds[state.label] = {
                "computed": state.computed, "skipped": state.skipped, "pattern": "".join(state.pattern),
                "trace": [round(float(v), 5) for v in state.trace],
            }
        return {
            "model_type": self.config.model_type,
            "rel_l1_thresh": self.config.rel_l1_thresh,
            "start_percent": self.config.start_percent,
            "end_percent": self.config.end_percent,
            "max_consecutive_skips": self.config.max_consecutive_skips,
            "cache_device": self.config.cache_device,
            "residual_mode": self.config.residual_mode,
            "steps": total_steps,
            "calls_computed": self.calls_computed,
            "calls_skipped": self.calls_skipped,
            "speedup_calls": calls / self.calls_computed if self.calls_computed else 1.0,
            "time_saved_s": round(saved, 4),
            "resets": self.resets,
            "unhooked_calls": self.unhooked,
            "conds": conds,
        }


class CalibrationStore:
    """Fitted polynomials per model fingerprint, in memory and in a JSON file (when given a path)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._memory: dict[str, dict[str, Any]] = {}

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, fingerprint: str) -> tuple[float, ...] | None:
        with self._lock:
            entry = self._memory.get(fingerprint) or self._read().get(fingerprint)
        if not isinstance(entry, dict):
            return None
        coeffs = entry.get("coefficients")
        if not isinstance(coeffs, list) or len(coeffs) != 5 or not all(isinstance(c, (int, float)) for c in coeffs):
            return None
        return tuple(float(c) for c in coeffs)

    def put(self, fingerprint: str, coefficients: tuple[float, ...], **info: Any) -> None:
        """Keep a calibration in memory, then in the file; OSError when the file cannot be written
        (the calibration stays in memory for this process, the file is left as it was)."""
        entry = {"coefficients": list(coefficients), "time": time.time(), **info}
        with self._lock:
            self._memory[fingerprint] = entry
            if self.path is None:
                return
            data = self._read()
            data[fingerprint] = entry
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".teacache-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise


def fingerprint(family: str, config_repr: str, tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A model's identity for calibration: family, config and a sample of its weights' values."""
    h = hashlib.sha256(f"{family}|{config_repr}".encode())
    for name, t in tensors:
        flat = t.detach().reshape(-1)[:256].to("cpu", torch.float32)
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(flat.numpy().tobytes())
    return h.hexdigest()[:32]
