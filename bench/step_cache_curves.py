"""The step-cache benchmark's arithmetic: the setting picked on the tuning prompts, the threshold grid
and its refinement, and the plots (pure Python + PIL; bench/step_cache.py runs the models).

A point is a dict with ``x`` (speedup in calls per branch, uncached / cached), ``psnr`` (mean dB over the
runs), ``worst`` (the worst run's dB) and the ``threshold`` that gave it. Nothing here reads a speedup off
a curve: a method is scored only at the one setting its tuning points picked.
"""

from __future__ import annotations

import math
from pathlib import Path

PSNR_CAP = 100.0  # dB for a picture equal to the reference (PSNR is infinite there)


def pick(points: list[dict], mean_floor: float, worst_floor: float) -> dict | None:
    """Among measured settings (points with their ``setting``), the fastest whose mean and worst PSNR keep
    the floors (ties: the better mean); None when none does."""
    ok = [p for p in points if p["psnr"] >= mean_floor and p["worst"] >= worst_floor]
    return max(ok, key=lambda p: (p["x"], p["psnr"]), default=None)


def log_grid(lo: float, hi: float, n: int) -> list[float]:
    """``n`` thresholds spread evenly in log between ``lo`` and ``hi`` (3 significant digits)."""
    return [float(f"{lo * (hi / lo) ** (i / (n - 1)):.3g}") for i in range(n)]


def refine(points: list[dict], mean_floor: float, worst_floor: float, tried: set[float]) -> float | None:
    """The next threshold to try on the tuning prompts: the geometric middle of the largest threshold
    that keeps the floors and the smallest above it that does not (None when they are close or absent)."""
    ok = sorted(p["threshold"] for p in points if p["psnr"] >= mean_floor and p["worst"] >= worst_floor)
    bad = sorted(p["threshold"] for p in points if not (p["psnr"] >= mean_floor and p["worst"] >= worst_floor)
                 and (not ok or p["threshold"] > ok[-1]))
    if not ok or not bad or bad[0] / max(ok[-1], 1e-12) < 1.08:
        return None
    mid = float(f"{math.sqrt(ok[-1] * bad[0]):.3g}")
    return None if mid in tried else mid


X_TICKS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24)


def x_axis_end(xs: list[float]) -> float:
    """The plots' speedup axis ends at the first of 8x, 12x, 16x, 24x that holds every point (a faster one
    sits on the edge)."""
    top = max(xs, default=1.0)
    return next((t for t in X_TICKS if t >= 8 and t >= top), X_TICKS[-1])


def plot(panels: list[tuple[str, dict[str, list[dict]]]], path: Path, colors: dict[str, tuple]) -> None:
    """Panels of speedup (x) against mean PSNR (y), a line per method through its points (PIL only)."""
    from PIL import Image, ImageDraw

    w, h, pad = 520, 400, 58
    cols = 2 * len(panels)
    img = Image.new("RGB", (w * len(panels), h + 22 * math.ceil(len(colors) / cols)), "white")
    d = ImageDraw.Draw(img)
    x_lo, y_lo, y_hi = 1.0, 15.0, 60.0
    x_hi = x_axis_end([p["x"] for _, methods in panels for pts in methods.values() for p in pts])
    for k, (title, methods) in enumerate(panels):
        x0, x1, y0, y1 = k * w + pad, (k + 1) * w - 14, h - pad + 12, 34

        def xy(x, y, x0=x0, x1=x1, y0=y0, y1=y1):
            fx = (math.log(min(max(x, x_lo), x_hi)) - math.log(x_lo)) / (math.log(x_hi) - math.log(x_lo))
            return x0 + fx * (x1 - x0), y0 + (min(max(y, y_lo), y_hi) - y_lo) / (y_hi - y_lo) * (y1 - y0)

        d.text((x0, 10), title, fill="black")
        d.rectangle((x0, y1, x1, y0), outline=(120, 120, 120))
        for y in (20, 25, 30, 40, 50, 60):
            _, yy = xy(1, y)
            d.line((x0, yy, x1, yy), fill=(170, 170, 170) if y == 30 else (228, 228, 228))
            d.text((x0 - 26, yy - 6), f"{y}", fill="black")
        for x in (t for t in X_TICKS if t <= x_hi):
            xx, _ = xy(x, y_lo)
            d.text((xx - 8, y0 + 6), f"{x:g}x", fill="black")
        d.text(((x0 + x1) / 2 - 110, h - 26), "speedup (model calls per branch, uncached / cached)", fill="black")
        for name, pts in methods.items():
            pts = sorted(pts, key=lambda p: p["x"])
            xys = [xy(p["x"], p["psnr"]) for p in pts]
            if len(xys) > 1:
                d.line(xys, fill=colors[name], width=2)
            for x, y in xys:
                d.ellipse((x - 3, y - 3, x + 3, y + 3), fill=colors[name])
    for i, (name, color) in enumerate(colors.items()):
        x, y = 14 + (i % cols) * (img.width // cols), h + 6 + 22 * (i // cols)
        d.line((x, y + 7, x + 24, y + 7), fill=color, width=3)
        d.text((x + 30, y + 1), name, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
