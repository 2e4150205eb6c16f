"""The bench stand-ins' magnitude-ratio curves beside the published ones (what they were trained to match): a
table and docs/standin_curves.png; and one property they were not trained on, beside its published figures.

    .venv/bin/python bench/standin_curves.py [--png docs/standin_curves.png] [--no-check]

Each stand-in (``tests/tinymodels/standins.py``) samples the held-out calibration prompt once under
ReuseKit's TeaCache Calibrate node at the published table's step count (Flux 28, Wan 50; euler, simple,
CFG 3.5, 16x16 latent); its per-step ratios of consecutive residual norms (cond and uncond) are drawn
against the schedule fraction beside MagCache's published FLUX.1-dev and Wan 2.1 1.3B ratios. The last
line: ``RESULT curve_match_flux=<x> curve_match_wan=<y>`` (mean absolute ratio difference, lower is
closer; a flat curve of ratio 1 scores the ``flat`` figures printed above it).

The check on a property the training never saw (``--no-check`` leaves it out): how fast the first block's
modulated input changes from step to step, read through TeaCache with the family's published polynomial at
the published thresholds (the reference rule: signed polynomial accumulated, first and last step computed;
Wan's ret-mode setting from 10% with ComfyUI-TeaCache's max_skip 3), on the calibration prompt and the
bench's tuning runs at the published step count. The published figures are wall-time speedups on the real
models, at most the ratio of model calls (a skipped step still runs the first block's modulation), so a
stand-in whose input changes like the real model's reads a call ratio at or a little above them; the last
line adds ``teacache_x_over_published_<family>=<r>`` (the call ratio over the published speedup, the mean
over the thresholds).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import rkharness  # noqa: E402

FRACTIONS = (0.04, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9)  # the table's columns (nearest step)
TITLES = {"flux": "Flux stand-in vs FLUX.1-dev (28 steps)", "wan": "Wan stand-in vs Wan 2.1 1.3B (50 steps)"}
# Published TeaCache speedups (../shared/anchors/teacache.md): (threshold, start_percent, wall-time speedup). FLUX.1-dev:
# the TeaCache paper (A800, 28 steps, guidance-distilled: CFG 1); Wan 2.1 T2V 1.3B ret mode: ComfyUI-TeaCache's README
# (its max_skip_steps 3; Wan's 50 steps at CFG 5).
TEACACHE_SPEEDUPS = {"flux": ((0.25, 0.0, 1.5), (0.4, 0.0, 1.8), (0.6, 0.0, 2.0), (0.8, 0.0, 2.25)),
                     "wan": ((0.15, 0.1, 2.2),)}
TEACACHE_RUN = {"flux": (28, 1.0, 0), "wan": (50, 5.0, 3)}  # steps, CFG, max_skip (0: none)


def curves(S, family: str) -> dict[str, list[float]]:
    """{"published": ..., "cond": ..., "uncond": ...} per-step ratios at the published step count."""
    steps = S.PUBLISHED_STEPS[family]
    mags = S.calibrated_magnitudes(S.load_standin(family), family, steps)
    out = {"published": S.published_ratios(family)["cond"]}
    out.update({label: S.resampled_ratios(S.step_ratios(points), steps) for label, points in sorted(mags.items())})
    return out, S.curve_match(family, mags)


def teacache_check(family: str) -> list[dict]:
    """Per published threshold: the stand-in's ratio of model calls under TeaCache as published, with the
    mean and worst PSNR against the uncached runs, beside the published speedup."""
    import step_cache as bench

    steps, cfg, max_skip = TEACACHE_RUN[family]
    b = bench.Bench(family, False, cfg)
    runs = [bench.CALIBRATION] + bench.tuning_runs(False)
    out = []
    with torch.inference_mode():
        refs = bench.references(b, steps, runs)
        for threshold, start, published in TEACACHE_SPEEDUPS[family]:
            setting = dict(rule="teacache", model_type=bench.PUBLISHED[family], mode="reuse", signed=True,
                           threshold=threshold, combo=dict(K=max_skip, start=start, last=True))
            p = bench.measure(b, setting, steps, runs, refs)
            out.append(dict(threshold=threshold, start=start, published=published, x=p["x"], psnr=p["psnr"],
                            worst=p["worst"]))
    return out


def plot(all_curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    """Two panels, ratio against schedule fraction; drawn with PIL (no plotting dependency)."""
    from PIL import Image, ImageDraw

    w, h, pad = 560, 380, 56
    img = Image.new("RGB", (w * len(all_curves), h), "white")
    d = ImageDraw.Draw(img)
    colors = {"published": (0, 0, 0), "cond": (30, 100, 220), "uncond": (235, 120, 20)}
    lo, hi = 0.8, 1.25
    for k, (family, cs) in enumerate(all_curves.items()):
        x0, x1, y0, y1 = k * w + pad, (k + 1) * w - 16, h - pad + 10, 40

        def xy(f, r, x0=x0, x1=x1, y0=y0, y1=y1):
            return x0 + f * (x1 - x0), y0 + (min(max(r, lo), hi) - lo) / (hi - lo) * (y1 - y0)

        d.text((x0, 12), TITLES[family], fill="black")
        d.rectangle((x0, y1, x1, y0), outline=(120, 120, 120))
        for r in (0.8, 0.9, 1.0, 1.1, 1.2):
            _, y = xy(0, r)
            d.line((x0, y, x1, y), fill=(225, 225, 225) if r != 1.0 else (170, 170, 170))
            d.text((x0 - 30, y - 6), f"{r:.1f}", fill="black")
        for f in (0, 0.25, 0.5, 0.75, 1.0):
            x, _ = xy(f, lo)
            d.text((x - 8, y0 + 6), f"{f:g}", fill="black")
        d.text(((x0 + x1) / 2 - 60, h - 22), "schedule fraction (step / steps)", fill="black")
        for i, (label, rs) in enumerate(cs.items()):
            pts = [xy(j / len(rs), r) for j, r in enumerate(rs)]
            d.line(pts, fill=colors[label], width=3 if label == "published" else 2)
            for x, y in pts:
                d.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colors[label])
            d.line((x1 - 150, y1 + 14 + 16 * i, x1 - 125, y1 + 14 + 16 * i), fill=colors[label], width=3)
            d.text((x1 - 120, y1 + 8 + 16 * i), label if label != "published" else "published", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--png", default=str(ROOT / "docs" / "standin_curves.png"))
    ap.add_argument("--no-check", action="store_true", help="leave out the check on an untrained property")
    args = ap.parse_args()
    rkharness.bootstrap()
    torch.set_num_threads(2)
    S = importlib.import_module(rkharness.TINY.__name__ + ".standins")
    all_curves, matches = {}, {}
    print("| model | curve | " + " | ".join(f"{f:g}" for f in FRACTIONS) + " | curve_match (flat) |")
    print("|---|---|" + "---|" * len(FRACTIONS) + "---|")
    for family in ("flux", "wan"):
        cs, matches[family] = curves(S, family)
        all_curves[family] = cs
        for label, rs in cs.items():
            cells = " | ".join(f"{rs[round(f * len(rs))]:.3f}" for f in FRACTIONS)
            score = "" if label != "published" else f"{matches[family]:.4f} ({S.flat_match(family):.4f})"
            print(f"| {family} | {label} | {cells} | {score} |")
    plot(all_curves, Path(args.png))
    print(f"wrote {args.png}")
    result = f"RESULT curve_match_flux={matches['flux']:.4f} curve_match_wan={matches['wan']:.4f}"
    if not args.no_check:
        print("\nTeaCache as published (an untrained property: the first block's input change per step):")
        print("| model | steps, CFG | threshold | published speedup | stand-in call ratio | mean / worst dB |")
        print("|---|---|---|---|---|---|")
        for family in ("flux", "wan"):
            steps, cfg, _ = TEACACHE_RUN[family]
            rows = teacache_check(family)
            for r in rows:
                at = f"{r['threshold']:g}" + (f" from {r['start']:g}" if r["start"] else "")
                print(f"| {family} | {steps}, {cfg:g} | {at} | {r['published']:.2f}x | {r['x']:.2f}x | "
                      f"{r['psnr']:.1f} / {r['worst']:.1f} |")
            ratio = sum(r["x"] / r["published"] for r in rows) / len(rows)
            result += f" teacache_x_over_published_{family}={ratio:.2f}"
    print(result)


if __name__ == "__main__":
    main()
