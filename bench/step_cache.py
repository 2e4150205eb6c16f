"""Step cache benchmark on the papers' protocol: ReuseKit TeaCache against ComfyUI core's EasyCache and LazyCache.

    .venv/bin/python bench/step_cache.py [--steps 20] [--size 32] [--quick]

Every method runs the same window (0-1 of the schedule), steps, sampler and scheduler (euler, simple,
CFG 3.5) through the real KSampler, on the trained Flux and the trained Wan 2.1 of
``nodes/demo_models/shapes.py`` at a ``size`` x ``size`` latent. Core's EasyCache/LazyCache are
also run at their own default window (0.15-0.95), the one they are designed for, labelled as such.
ReuseKit's coefficients are fitted by one ReuseKit TeaCache Calibrate run on a calibration prompt
that no evaluation uses; the evaluation is 8 prompts x 2 seeds per model.

Quality of each run against the uncached run of the same prompt and seed: PSNR and SSIM of the
decoded picture (``latent_to_picture`` is exact: the picture code has no VAE) by scikit-image, and
the final latent's relative L2. Cost: transformer calls, counted as the samples that passed through
the first block (cond and uncond count one each), and the process CPU time of the whole sampling
on one torch thread (the skip rule's own overhead counts; the tiny model's fixed per-step cost
weighs more than on a real one). All methods run interleaved per prompt, so each sees the same load.
The models were trained at an 8x8 latent: at 32x32 they draw a textured field of the caption's
colours rather than one shape, so the runs measure each cache against the same uncached trajectory,
not on the pictures the models were trained to make (``--size 8`` runs them at their own size,
where core's ``subsample_factor=8`` leaves one pixel per channel for its estimate).

The last line: ``RESULT default_speedup_min=<x> vs_best_baseline_min=<y>`` at the 30 dB floor (see
:func:`result`); the same at 35 dB is printed above it. Until the MagCache and First-Block rules
exist, the baselines are core EasyCache and LazyCache.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import rkharness  # noqa: E402

CALIBRATION = ("a white square on a black background", 101)  # never an evaluation prompt
EVAL_PROMPTS = ["a red circle on a black background", "a yellow square on a gray background",
                "a blue triangle on a white background", "a green cross on a white background",
                "a purple circle on a gray background", "a white triangle on a gray background",
                "a red cross on a gray background", "a blue square on a black background"]
SEEDS = (1, 2)
PSNR_CAP = 100.0  # dB for a picture equal to the reference (PSNR is infinite there)
FLOORS = (30.0, 35.0)
DEFAULT = ("reusekit default", "auto 0.4 extrapolate")  # the node's default inputs, no calibration made

REUSEKIT_THRESH = [0.1, 0.2, 0.3, 0.4, 0.6, 0.8]
CORE_THRESH = [0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3]
CORE_OWN_WINDOW_THRESH = [0.02, 0.05, 0.1, 0.2]


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
    psnr = PSNR_CAP if (a == b).all() else min(PSNR_CAP, float(peak_signal_noise_ratio(b, a, data_range=1.0)))
    ssim = float(structural_similarity(b, a, data_range=1.0, channel_axis=2))
    err = float((out - ref).norm() / ref.norm())
    return psnr, ssim, err


def configs(family: str, quick: bool) -> list[tuple[str, str, tuple]]:
    """Every (method, setting, builder args) the sweep runs, the uncached reference first."""
    pick = (lambda ts: ts[::2]) if quick else (lambda ts: ts)
    published = "flux" if family == "flux" else "wan2.1_t2v_1.3B_ret_mode"
    out = [("none", "uncached", ()), (*DEFAULT, ("default",))]
    for mode in ("reuse", "extrapolate"):
        for coeffs in ("published", "calibrated"):
            for th in pick(REUSEKIT_THRESH):
                model_type = published if coeffs == "published" else "calibrated"
                out.append((f"reusekit {mode}", f"{coeffs} {th:g}", ("reusekit", model_type, th, mode)))
    for node in ("easycache", "lazycache"):
        for th in pick(CORE_THRESH):
            out.append((f"core {node}", f"{th:g} w0-1", (node, th, 0.0, 1.0)))
        for th in pick(CORE_OWN_WINDOW_THRESH):
            out.append((f"core {node}", f"{th:g} w.15-.95", (node, th, 0.15, 0.95)))
    return out


def sweep(family: str, args) -> list[dict]:
    """One trained model: every configuration against its uncached run, per prompt and seed."""
    import comfy.utils
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    import nodes

    comfy.utils.PROGRESS_BAR_ENABLED = False
    trained = importlib.import_module(rkharness.TINY.__name__ + ".trained_flux")
    N = rkharness.pack("nodes.teacache")
    P = rkharness.pack("patches.teacache")
    stores = rkharness.pack("caching.teacache")
    empty, calibrated = stores.CalibrationStore(None), stores.CalibrationStore(None)  # never the user folder
    model, clip = trained.build(family=family), rkharness.TINY.tiny_clip(0)
    dm = model.model.diffusion_model
    first_block = dm.double_blocks[0] if family == "flux" else dm.blocks[0]
    shape = (1, 16, args.size, args.size) if family == "flux" else (1, 16, 1, args.size, args.size)
    samples = [0]

    def count(_module, a, kw):
        x = a[0] if a and torch.is_tensor(a[0]) else next(v for v in kw.values() if torch.is_tensor(v))
        samples[0] += x.shape[0]

    first_block.register_forward_pre_hook(count, with_kwargs=True)
    prompts = EVAL_PROMPTS[:2] if args.quick else EVAL_PROMPTS
    seeds = SEEDS[:1] if args.quick else SEEDS

    def make(spec):
        if spec == ():
            return model
        if spec == ("default",):
            return N.TeaCacheNode.execute(model, "auto", 0.4, 0.0, 1.0, 0, "device", "extrapolate").args[0]
        if spec[0] == "reusekit":
            _, model_type, th, mode = spec
            return N.TeaCacheNode.execute(model, model_type, th, 0.0, 1.0, 0, "device", mode).args[0]
        node, th, start, end = spec
        return (EasyCacheNode if node == "easycache" else LazyCacheNode).execute(model, th, start, end, False).args[0]

    with torch.inference_mode():
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")

        def run(m, pos, seed, store):
            P.STORE = store
            samples[0] = 0
            t0 = time.process_time()
            (out,) = nodes.common_ksampler(m, seed, args.steps, args.cfg, "euler", "simple", pos, neg,
                                           {"samples": torch.zeros(shape)})
            return out["samples"], samples[0], time.process_time() - t0

        (cal_pos,) = nodes.CLIPTextEncode().encode(clip, CALIBRATION[0])
        run(N.TeaCacheCalibrateNode.execute(model).args[0], cal_pos, CALIBRATION[1], calibrated)
        coeffs = P.stats().snapshot()["info"]["last_calibration"]["coefficients"]
        cfgs = configs(family, args.quick)
        built = [make(spec) for _, _, spec in cfgs]
        rows = [{"method": m, "setting": s, "calls": [], "cpu": [], "psnr": [], "ssim": [], "err": []}
                for m, s, _ in cfgs]
        run(model, cal_pos, CALIBRATION[1], empty)  # warm-up, not counted
        for text in prompts:
            (pos,) = nodes.CLIPTextEncode().encode(clip, text)
            for seed in seeds:
                ref, calls, t = run(model, pos, seed, empty)
                for row, m, (_, _, spec) in zip(rows[1:], built[1:], cfgs[1:], strict=True):
                    out, calls_c, t_c = run(m, pos, seed, empty if spec == ("default",) else calibrated)
                    psnr, ssim, err = picture_metrics(out, ref, trained.latent_to_picture)
                    for key, v in (("calls", calls_c), ("cpu", t_c), ("psnr", psnr), ("ssim", ssim), ("err", err)):
                        row[key].append(v)
                t = min(t, run(model, pos, seed, empty)[2])  # the uncached time: the better of before and after
                rows[0]["calls"].append(calls)
                rows[0]["cpu"].append(t)
                for key, v in (("psnr", PSNR_CAP), ("ssim", 1.0), ("err", 0.0)):
                    rows[0][key].append(v)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    base_calls, base_cpu = mean(rows[0]["calls"]), mean(rows[0]["cpu"])
    table = [{"method": r["method"], "setting": r["setting"], "calls": mean(r["calls"]),
              "call_x": base_calls / mean(r["calls"]), "cpu_x": base_cpu / mean(r["cpu"]),
              "psnr": mean(r["psnr"]), "psnr_min": min(r["psnr"]), "ssim": mean(r["ssim"]), "err": mean(r["err"])}
             for r in rows]
    print_table(family, table, coeffs, len(prompts) * len(seeds), args)
    return table


def pareto(table: list[dict]) -> set[int]:
    """Indices of the rows no other row beats on both calls (fewer) and mean PSNR (higher)."""
    return {i for i, r in enumerate(table)
            if not any(o["calls"] <= r["calls"] and o["psnr"] >= r["psnr"]
                       and (o["calls"] < r["calls"] or o["psnr"] > r["psnr"]) for o in table)}


def print_table(family: str, table: list[dict], coeffs, runs: int, args) -> None:
    front = pareto(table)
    print(f"\ntrained {family}: {args.size}x{args.size} latent, {args.steps} euler/simple steps, CFG {args.cfg}, "
          f"window 0-1 unless marked, {runs} runs (prompts x seeds); calibrated on {CALIBRATION[0]!r} seed "
          f"{CALIBRATION[1]}: {[round(c, 3) for c in coeffs]}")
    print(f"  {'method':<22}{'setting':<22}{'calls':>7}{'calls x':>9}{'cpu x':>7}{'PSNR':>7}{'min':>7}"
          f"{'SSIM':>7}{'latent err':>11}")
    for i in sorted(range(len(table)), key=lambda i: (-table[i]["call_x"], -table[i]["psnr"])):
        r = table[i]
        print(f"{'*' if i in front else ' '} {r['method']:<22}{r['setting']:<22}{r['calls']:>7.1f}{r['call_x']:>9.2f}"
              f"{r['cpu_x']:>7.2f}{r['psnr']:>7.1f}{r['psnr_min']:>7.1f}{r['ssim']:>7.3f}{r['err'] * 100:>10.2f}%")
    print(f"  (* Pareto front on calls and mean PSNR; PSNR capped at {PSNR_CAP:g} dB for an exact picture)")


def best(table: list[dict], prefix: str, floor: float) -> tuple[float, str]:
    """The highest call speedup of the rows whose method starts with ``prefix`` at mean PSNR >= floor
    (1.0, uncached, when none reaches it)."""
    got = [(r["call_x"], f"{r['method']} {r['setting']}") for r in table
           if r["method"].startswith(prefix) and r["psnr"] >= floor]
    return max(got, default=(1.0, "uncached"))


def result(tables: dict[str, list[dict]], floor: float) -> tuple[float, float]:
    """(x, y) at a PSNR floor: x the smallest over the models of the default setting's call speedup (0
    where its mean PSNR is under the floor); y the smallest of best ReuseKit / best baseline."""
    xs, ys = [], []
    for family, table in tables.items():
        d = next(r for r in table if (r["method"], r["setting"]) == DEFAULT)
        xs.append(d["call_x"] if d["psnr"] >= floor else 0.0)
        ours, ours_name = best(table, "reusekit", floor)
        core, core_name = best(table, "core", floor)
        ys.append(ours / core)
        print(f"{family} at >= {floor:g} dB: default {d['call_x']:.2f}x ({d['psnr']:.1f} dB); best ReuseKit "
              f"{ours:.2f}x ({ours_name}); best baseline {core:.2f}x ({core_name})")
    return min(xs), min(ys)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=3.5)
    ap.add_argument("--size", type=int, default=32, help="latent height and width")
    ap.add_argument("--quick", action="store_true", help="two prompts, one seed, every other threshold")
    args = ap.parse_args()

    rkharness.bootstrap()
    torch.set_num_threads(1)  # CPU time of one thread: steadier than wall time on a shared machine
    logging.getLogger("reusekit").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    t0 = time.perf_counter()
    tables = {family: sweep(family, args) for family in ("flux", "wan")}
    print("\nBaselines: core EasyCache and LazyCache (host nodes); MagCache and First-Block rules do not exist yet.")
    print(f"default = ReuseKit TeaCache's default inputs ({DEFAULT[1]}, window 0-1) with no calibration made: "
          "auto takes the published coefficients")
    lines = []
    for floor in FLOORS:
        x, y = result(tables, floor)
        lines.append(f"at >= {floor:g} dB: default_speedup_min={x:.2f} vs_best_baseline_min={y:.2f}")
    print("\n".join(lines[1:]))
    print(f"ran {time.perf_counter() - t0:.0f} s")
    print(f"RESULT {lines[0].split(': ', 1)[1]}")


if __name__ == "__main__":
    main()
