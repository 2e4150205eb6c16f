"""The step cache benchmark's arithmetic (bench/step_cache.py, bench/step_cache_curves.py): the quality
metric, the Pareto curve and the speedup read off it by interpolation, the tuning pick, the methods it
ranks and the RESULT it prints."""

import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("reusekit_bench_step_cache", BENCH / "step_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def curves(bench):
    return bench.curves


@pytest.fixture(scope="module")
def to_picture():
    return importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").latent_to_picture


def latent_of(pic):
    shapes = importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux")
    return shapes.picture_to_latent(pic)


def pt(x, psnr, worst=None, **kw):
    return {"x": x, "psnr": psnr, "worst": psnr if worst is None else worst, **kw}


# ---- the metric --------------------------------------------------------------------------------------

def test_an_equal_picture_scores_the_cap_and_full_ssim(bench, curves, to_picture):
    ref = latent_of(torch.rand(1, 4, 64, 64, generator=torch.Generator().manual_seed(0)))
    assert bench.picture_metrics(ref.clone(), ref, to_picture) == (curves.PSNR_CAP, pytest.approx(1.0), 0.0)


def test_psnr_is_that_of_the_decoded_rgb_and_the_error_that_of_the_latent(bench, to_picture):
    gen = torch.Generator().manual_seed(1)
    pic = torch.rand(1, 4, 64, 64, generator=gen) * 0.8 + 0.1
    noisy = pic.clone()
    noisy[:, :3] += torch.randn(1, 3, 64, 64, generator=gen) * 0.05  # inside [0, 1]: no clamping
    noisy[:, 3] = 0.0  # the mask channel is not part of the picture
    ref, out = latent_of(pic), latent_of(noisy)
    psnr, ssim, err = bench.picture_metrics(out, ref, to_picture)
    mse = float(((to_picture(out)[:, :3] - to_picture(ref)[:, :3]) ** 2).mean())
    assert psnr == pytest.approx(10 * math.log10(1.0 / mse), abs=1e-3)
    assert 0.0 < ssim < 1.0
    assert err == pytest.approx(float((out - ref).norm() / ref.norm()))


def test_a_video_latent_scores_like_its_frames_side_by_side(bench, to_picture):
    """A 5-D (Wan) latent's one frame scores exactly as the same 4-D latent (SSIM sees the real layout)."""
    gen = torch.Generator().manual_seed(2)
    pic = torch.rand(1, 4, 64, 64, generator=gen)
    smooth = torch.nn.functional.avg_pool2d(pic, 9, 1, 4)  # structure, so a scrambled layout would differ
    ref, out = latent_of(smooth), latent_of(smooth * 0.9 + 0.05)
    flat = bench.picture_metrics(out, ref, to_picture)
    video = bench.picture_metrics(out.unsqueeze(2), ref.unsqueeze(2), to_picture)
    assert video == pytest.approx(flat)


# ---- curves ------------------------------------------------------------------------------------------

def test_the_front_keeps_only_points_no_other_beats_on_speed_mean_and_worst(curves):
    a, b, c, d = pt(2.0, 40.0, 35.0), pt(2.0, 38.0, 30.0), pt(3.0, 31.0, 20.0), pt(3.0, 30.0, 26.0)
    assert curves.front([a, b, c, d, pt(0.9, 60.0)]) == [a, c, d]  # b beaten by a; x < 1 dropped


def test_the_speedup_is_read_off_the_curve_by_interpolation_at_both_floors(curves):
    points = [pt(2.0, 40.0, 35.0), pt(4.0, 20.0, 15.0)]
    # mean falls 10 dB per 1x: 30 dB at 3.0x; worst falls 10 dB per 1x: 25 dB at 3.0x as well
    assert curves.speedup_at(points, 30.0, 25.0) == pytest.approx(3.0)
    assert curves.speedup_at(points, 30.0, 30.0) == pytest.approx(2.5)  # the worst run binds first
    assert curves.speedup_at(points, 35.0, 0.0) == pytest.approx(2.5)
    assert curves.speedup_at([pt(2.0, 40.0)], 30.0, 25.0) == 2.0  # never beyond the fastest measured point
    assert curves.speedup_at([pt(2.0, 20.0)], 30.0, 25.0) == 1.0  # never read between the uncached run and a point
    assert curves.speedup_at([], 30.0, 25.0) == 1.0


def test_a_point_whose_worst_run_misses_the_floor_does_not_lift_the_speedup(curves):
    points = [pt(2.0, 40.0, 35.0), pt(3.0, 36.0, 20.0), pt(3.5, 31.0, 26.0)]
    x = curves.speedup_at(points, 30.0, 25.0)
    assert x == pytest.approx(3.5)  # 3.0 is beaten by nothing but fails; 3.5 keeps both floors
    assert curves.speedup_at(points[:2], 30.0, 25.0) == pytest.approx(2.0 + (35 - 25) / 15)


def test_the_tuning_pick_is_the_fastest_setting_keeping_both_floors(curves):
    points = [pt(2.0, 40.0, 35.0, threshold=0.1), pt(3.0, 33.0, 24.0, threshold=0.2),
              pt(2.5, 31.0, 26.0, threshold=0.3), pt(4.0, 20.0, threshold=0.4)]
    assert curves.pick(points, 30.0, 25.0)["threshold"] == 0.3
    assert curves.pick(points[3:], 30.0, 25.0) is None


def test_refinement_halves_the_gap_at_the_crossing_in_log(curves):
    points = [pt(2.0, 40.0, threshold=0.1), pt(3.0, 35.0, threshold=0.2), pt(5.0, 20.0, threshold=0.4)]
    assert curves.refine(points, 30.0, 25.0, {0.1, 0.2, 0.4}) == pytest.approx(0.283)
    assert curves.refine(points, 30.0, 25.0, {0.1, 0.2, 0.4, 0.283}) is None
    assert curves.log_grid(0.01, 1.0, 3) == [0.01, 0.1, 1.0]


# ---- methods and the result -----------------------------------------------------------------------

def test_baselines_are_the_published_rules_with_their_reuse_and_pick_among_the_published_limits(bench):
    rows = bench.methods("flux")
    for r in rows:
        assert (r["kind"] == "baseline") == (r.get("core") is not None or r.get("rule") in (
            "teacache", "magcache", "first_block")), r
    rules = [r for r in rows if r.get("rule") and r["kind"] == "baseline"]
    assert {r["rule"] for r in rules} == {"teacache", "magcache", "first_block"} and {r["mode"] for r in rules} == {
        "reuse"}
    assert all(r["combos"] == list(bench.combos("flux")) for r in rules)  # none, TeaCache's and MagCache's limits
    assert [r["combos"] for r in rows if r["kind"] == "reusekit"] == [["free"]] * 5
    published = bench.published_rows("flux")
    assert [(p["threshold"], p["combo"]["K"], p["combo"]["start"]) for p in published][0] == (0.24, 5, 0.1)
    assert published[1]["combo"] == {"K": 3, "start": 0.0, "last": True}


def row(name, kind, points):
    return {"name": name, "kind": kind, "eval": points, "tune": [], "picked": None}


def results(flux_default, wan_default, ours, base):
    """Two models at 28 and 50 steps (and 20, not counted): defaults, one ReuseKit row, one baseline."""
    def steps(d, o, b):
        return {"rows": [row("node defaults", "reusekit", [pt(*d, picked=True)]), row("schedule x", "reusekit", [pt(*o)]),
                         row("teacache published reuse", "baseline", [pt(*b)])]}

    return {"flux": {"curve_match": 0.02, "seconds": 1.0,
                     "steps": {"20": steps((1.5, 35.0), (9.0, 35.0), (1.5, 31.0)),
                               "28": steps(flux_default, ours, base), "50": steps(flux_default, ours, base)}},
            "wan": {"curve_match": 0.05, "seconds": 1.0,
                    "steps": {"28": steps(wan_default, ours, base), "50": steps(wan_default, (3.0, 31.0), base)}}}


def test_the_result_is_the_minimum_over_both_models_at_28_and_50_steps(bench):
    class Args:
        quick = False

    text = bench.report(results((3.0, 40.0, 38.0), (2.6, 36.0, 26.0), (4.0, 35.0), (2.5, 31.0)), Args())
    last = text.splitlines()[-1]
    assert last.startswith("RESULT ")
    got = dict(kv.split("=") for kv in last.split()[1:])
    assert float(got["default_speedup_min"]) == pytest.approx(2.6)  # wan's defaults, on their own point
    assert float(got["vs_best_baseline_min"]) == pytest.approx(3.0 / 2.5, abs=0.01)  # wan at 50 steps
    assert float(got["default_worst_psnr_min"]) == pytest.approx(26.0)
    assert float(got["curve_match"]) == pytest.approx(0.05)  # the farther stand-in
