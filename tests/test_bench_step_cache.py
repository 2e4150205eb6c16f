"""The step cache benchmark's quality metric and summary helpers (bench/step_cache.py)."""

import importlib
import importlib.util
import math
from pathlib import Path

import pytest
import rkharness
import torch

pytestmark = pytest.mark.step_cache


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "step_cache.py"
    spec = importlib.util.spec_from_file_location("reusekit_bench_step_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def to_picture():
    return importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").latent_to_picture


def latent_of(pic):
    shapes = importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux")
    return shapes.picture_to_latent(pic)


def test_an_equal_picture_scores_the_cap_and_full_ssim(bench, to_picture):
    ref = latent_of(torch.rand(1, 4, 64, 64, generator=torch.Generator().manual_seed(0)))
    assert bench.picture_metrics(ref.clone(), ref, to_picture) == (bench.PSNR_CAP, pytest.approx(1.0), 0.0)


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
    from skimage.metrics import structural_similarity

    a = to_picture(out)[0, :3].permute(1, 2, 0).numpy()
    b = to_picture(ref)[0, :3].permute(1, 2, 0).numpy()
    assert flat[1] == pytest.approx(structural_similarity(b, a, data_range=1.0, channel_axis=2))


def test_the_pareto_front_keeps_only_rows_no_other_beats(bench):
    rows = [{"calls": 40, "psnr": 100.0}, {"calls": 20, "psnr": 35.0}, {"calls": 20, "psnr": 30.0},
            {"calls": 10, "psnr": 20.0}, {"calls": 25, "psnr": 33.0}]
    assert bench.pareto(rows) == {0, 1, 3}


def test_result_takes_the_worst_model_and_zeroes_a_default_under_the_floor(bench):
    def table(default_x, default_psnr, ours, base):
        return [{"method": "none", "setting": "uncached", "kind": "none", "call_x": 1.0, "psnr": 100.0},
                {"method": bench.DEFAULT[0], "setting": bench.DEFAULT[1], "kind": "reusekit", "call_x": default_x,
                 "psnr": default_psnr},
                {"method": "teacache extrapolate", "setting": "a", "kind": "reusekit", "call_x": ours, "psnr": 31.0},
                {"method": "teacache reuse", "setting": "b", "kind": "baseline", "call_x": base, "psnr": 31.0},
                {"method": "core lazycache", "setting": "c", "kind": "baseline", "call_x": 9.0, "psnr": 20.0}]

    x, y = bench.result({"flux": table(3.0, 36.0, 4.0, 2.0), "wan": table(2.6, 31.0, 3.0, 2.5)}, 30.0)
    assert (x, y) == (pytest.approx(2.6), pytest.approx(1.2))
    x, y = bench.result({"flux": table(3.0, 36.0, 4.0, 2.0), "wan": table(2.6, 31.0, 3.0, 2.5)}, 35.0)
    assert (x, y) == (0.0, pytest.approx(1.0))  # wan's default is under 35 dB; no row but the default reaches it


def test_baselines_are_the_published_rules_with_their_reuse_and_the_core_nodes(bench):
    rows = bench.configs("flux", quick=False)
    assert rows[0]["kind"] == "none" and rows[1]["spec"] == ("default",)
    for r in rows[2:]:
        spec = r["spec"]
        published_rule = spec[0] == "rk" and spec[4] == "reuse"
        assert (r["kind"] == "baseline") == (published_rule or spec[0] == "core"), r
    rules = {r["spec"][1] for r in rows if r["spec"][0] == "rk" and r["kind"] == "baseline"}
    assert rules == {"teacache", "magcache", "first_block"}


def test_the_default_is_picked_on_tuning_prompts_among_settings_that_need_no_calibration(bench):
    def row(model_type, tune_x, tune_psnr, limit=0, start=0.0):
        return {"spec": ("rk", "teacache", model_type, 0.4, "reuse", limit, start), "tune_x": tune_x,
                "tune_psnr": tune_psnr, "call_x": 0.0, "psnr": 0.0}

    table = [{"spec": ("none",), "tune_x": 1.0, "tune_psnr": 100.0}, row("calibrated", 9.0, 50.0),
             row("flux", 5.0, 32.0), row("flux", 3.0, 34.0), row("flux", 4.0, 40.0, limit=2),
             row("flux", 4.0, 40.0, start=0.2), row("flux", 2.0, 60.0)]
    assert bench.pick_default(table) is table[3]
    assert bench.pick_default(table[:3]) is None
