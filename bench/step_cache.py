"""Step cache benchmark on the papers' protocol: ReuseKit's step cache against the published skip rules
(TeaCache, MagCache, First-Block-Cache) and ComfyUI core's EasyCache and LazyCache.

    .venv/bin/python bench/step_cache.py [--steps 20] [--size 32] [--quick]

Every method runs the same window (0-1 of the schedule), steps, sampler and scheduler (euler, simple,
CFG 3.5) through the real KSampler, on the trained Flux and the trained Wan 2.1 of
``nodes/demo_models/shapes.py`` at a ``size`` x ``size`` latent. Core's EasyCache/LazyCache and MagCache
are also run in the window they were designed for (core 0.15-0.95, MagCache's first 20% computed),
labelled as such.

Who is who. The baselines are the published decision rules, each with its published residual reuse:
TeaCache (rescaled rel-L1 of the modulated input, published and calibrated polynomials), MagCache
(calibrated magnitude ratios, at most 4 skips in a row as published), First-Block-Cache (relative change
of the first block's residual), run by ReuseKit's step-cache node with ``residual_mode="reuse"``, and the
host's EasyCache and LazyCache nodes. ReuseKit's own settings are the same rules with its residual
forecasts (``extrapolate``: first order in sigma, ``taylor2``: second order), and its node's defaults.

Data. Calibrations (TeaCache's polynomial, MagCache's ratios) come from one ReuseKit TeaCache Calibrate
run on a calibration prompt; the node's default rule/threshold/mode per family is picked on 4 tuning
prompts (see :func:`pick_default`); the evaluation is 8 other prompts x 2 seeds per model. No prompt is
in two of these sets.

Quality of each run against the uncached run of the same prompt and seed: PSNR and SSIM of the
decoded picture (``latent_to_picture`` is exact: the picture code has no VAE) by scikit-image, and
the final latent's relative L2. Cost: transformer calls, counted from the blocks that ran (a call whose
first block alone ran, as First-Block-Cache does on a skip, costs 1/blocks of a call on this model;
the ``deep`` column prices that first block as on Flux.1-dev's 57 or Wan 1.3B's 30 blocks), cond and
uncond one each; and the process CPU time of the whole sampling on one torch thread (the rule's own
overhead counts; the tiny model's fixed per-step cost weighs more than on a real one). All methods run
interleaved per prompt, so each sees the same load. The models were trained at an 8x8 latent: at 32x32
they draw a textured field of the caption's colours rather than one shape, so the runs measure each
cache against the same uncached trajectory, not on the pictures the models were trained to make
(``--size 8`` runs them at their own size, where core's ``subsample_factor=8`` leaves one pixel per
channel for its estimate).

The last line: ``RESULT default_speedup_min=<x> vs_best_baseline_min=<y>`` at the 30 dB floor (see
:func:`result`); the same at 35 dB is printed above it.
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

CALIBRATION = ("a white square on a black background", 101)  # never a tuning or evaluation prompt
TUNING_PROMPTS = ["a green circle on a black background", "a red triangle on a white background",
                  "a yellow cross on a black background", "a blue circle on a gray background"]
TUNING_SEED = 7
EVAL_PROMPTS = ["a red circle on a black background", "a yellow square on a gray background",
                "a blue triangle on a white background", "a green cross on a white background",
                "a purple circle on a gray background", "a white triangle on a gray background",
                "a red cross on a gray background", "a blue square on a black background"]
SEEDS = (1, 2)
PSNR_CAP = 100.0  # dB for a picture equal to the reference (PSNR is infinite there)
FLOORS = (30.0, 35.0)
PICK_FLOOR = 33.0  # the tuning prompts' mean PSNR a default must keep (a margin over the 30 dB goal)
DEEP_BLOCKS = {"flux": 57, "wan": 30}  # Flux.1-dev's 19 + 38 blocks, Wan 2.1 1.3B's 30
DEFAULT = ("reusekit default", "node defaults")  # the node's default inputs, no calibration made

THRESHOLDS = {"teacache": [0.2, 0.3, 0.4, 0.6, 0.8], "magcache": [0.06, 0.12, 0.24, 0.4, 0.6],
              "first_block": [0.04, 0.08, 0.12, 0.2, 0.3]}
MODES = ("reuse", "extrapolate", "taylor2")  # reuse is the published rules' residual
MAGCACHE_K = 4  # MagCache's published limit of skips in a row
CORE_THRESH = [0.05, 0.1, 0.15, 0.2, 0.3]
OWN_WINDOW_THRESH = {"core": [0.1, 0.2], "magcache": [0.12, 0.24]}


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


def configs(family: str, quick: bool) -> list[dict]:
    """Every method and setting the sweep runs, the uncached reference first, then the node's defaults."""
    pick = (lambda ts: ts[::2]) if quick else (lambda ts: ts)
    published = "flux" if family == "flux" else "wan2.1_t2v_1.3B_ret_mode"
    out = [dict(method="none", setting="uncached", kind="none", spec=("none",)),
           dict(method=DEFAULT[0], setting=DEFAULT[1], kind="reusekit", spec=("default",))]
    for rule, ths in THRESHOLDS.items():
        sources = {"teacache": ("published", "calibrated"), "magcache": ("published", "calibrated"),
                   "first_block": ("-",)}[rule]
        for source in sources:
            model_type = {"published": published, "calibrated": "calibrated", "-": "auto"}[source]
            for mode in MODES:
                limit = MAGCACHE_K if rule == "magcache" and mode == "reuse" else 0
                for th in pick(ths):
                    setting = f"{source + ' ' if source != '-' else ''}{th:g}{f' K{limit}' if limit else ''}"
                    out.append(dict(method=f"{rule} {mode}", setting=setting,
                                    kind="baseline" if mode == "reuse" else "reusekit",
                                    spec=("rk", rule, model_type, th, mode, limit, 0.0)))
    for th in pick(OWN_WINDOW_THRESH["magcache"]):  # MagCache's own window: its first 20% always computed
        out.append(dict(method="magcache reuse", setting=f"calibrated {th:g} K{MAGCACHE_K} w.2-1", kind="baseline",
                        spec=("rk", "magcache", "calibrated", th, "reuse", MAGCACHE_K, 0.2)))
    for node in ("easycache", "lazycache"):
        for th in pick(CORE_THRESH):
            out.append(dict(method=f"core {node}", setting=f"{th:g} w0-1", kind="baseline",
                            spec=("core", node, th, 0.0, 1.0)))
        for th in pick(OWN_WINDOW_THRESH["core"]):
            out.append(dict(method=f"core {node}", setting=f"{th:g} w.15-.95", kind="baseline",
                            spec=("core", node, th, 0.15, 0.95)))
    return out


def node_defaults(node_cls) -> dict:
    """The node's inputs at their defaults (what a user who drops it in gets), by name."""
    return {i.id: i.default for i in node_cls.define_schema().inputs if i.id != "model"}


def sweep(family: str, args) -> tuple[list[dict], dict]:
    """One trained model: every configuration against its uncached run, on the tuning prompts and on the
    evaluation prompts x seeds. Returns the evaluation table and the tuning pick."""
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
    blocks = list(dm.double_blocks) + list(dm.single_blocks) if family == "flux" else list(dm.blocks)
    shape = (1, 16, args.size, args.size) if family == "flux" else (1, 16, 1, args.size, args.size)
    counts = [0] * len(blocks)

    def counter(i):
        def count(_module, a, kw):
            x = a[0] if a and torch.is_tensor(a[0]) else next(v for v in kw.values() if torch.is_tensor(v))
            counts[i] += x.shape[0]
        return count

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(counter(i), with_kwargs=True)
    prompts = EVAL_PROMPTS[:2] if args.quick else EVAL_PROMPTS
    seeds = SEEDS[:1] if args.quick else SEEDS
    tuning = TUNING_PROMPTS[:2] if args.quick else TUNING_PROMPTS
    defaults = node_defaults(N.TeaCacheNode)

    def make(spec):
        if spec[0] == "none":
            return model
        if spec[0] == "default":
            return N.TeaCacheNode.execute(model=model, **defaults).args[0]
        if spec[0] == "rk":
            _, rule, model_type, th, mode, limit, start = spec
            return N.TeaCacheNode.execute(model=model, rule=rule, threshold=th, model_type=model_type,
                                          start_percent=start, end_percent=1.0, max_consecutive_skips=limit,
                                          cache_device="device", residual_mode=mode).args[0]
        _, node, th, start, end = spec
        return (EasyCacheNode if node == "easycache" else LazyCacheNode).execute(model, th, start, end, False).args[0]

    with torch.inference_mode():
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")

        def run(m, pos, seed, store):
            P.STORE = store
            counts[:] = [0] * len(blocks)
            t0 = time.process_time()
            (out,) = nodes.common_ksampler(m, seed, args.steps, args.cfg, "euler", "simple", pos, neg,
                                           {"samples": torch.zeros(shape)})
            calls = sum(counts) / len(blocks)
            deep = counts[-1] + (counts[0] - counts[-1]) / DEEP_BLOCKS[family]
            return out["samples"], calls, deep, time.process_time() - t0

        (cal_pos,) = nodes.CLIPTextEncode().encode(clip, CALIBRATION[0])
        run(N.TeaCacheCalibrateNode.execute(model=model).args[0], cal_pos, CALIBRATION[1], calibrated)
        calibration = P.stats().snapshot()["info"]["last_calibration"]
        cfgs = configs(family, args.quick)
        built = [make(c["spec"]) for c in cfgs]
        keys = ("calls", "deep", "cpu", "psnr", "ssim", "err")
        rows = [{**c, **{k: [] for k in keys}, "tune_calls": [], "tune_psnr": []} for c in cfgs]
        run(model, cal_pos, CALIBRATION[1], empty)  # warm-up, not counted

        def compare(pos, seed, tune):
            ref, calls, deep, t = run(model, pos, seed, empty)
            for row, m in zip(rows[1:], built[1:], strict=True):
                out, calls_c, deep_c, t_c = run(m, pos, seed, empty if row["spec"] == ("default",) else calibrated)
                psnr, ssim, err = picture_metrics(out, ref, trained.latent_to_picture)
                if tune:
                    row["tune_calls"].append(calls_c)
                    row["tune_psnr"].append(psnr)
                    continue
                for key, v in zip(keys, (calls_c, deep_c, t_c, psnr, ssim, err), strict=True):
                    row[key].append(v)
            if tune:
                rows[0]["tune_calls"].append(calls)
                return
            t = min(t, run(model, pos, seed, empty)[3])  # the uncached time: the better of before and after
            for key, v in zip(keys, (calls, deep, t, PSNR_CAP, 1.0, 0.0), strict=True):
                rows[0][key].append(v)

        for text in tuning:
            compare(nodes.CLIPTextEncode().encode(clip, text)[0], TUNING_SEED, tune=True)
        for text in prompts:
            (pos,) = nodes.CLIPTextEncode().encode(clip, text)
            for seed in seeds:
                compare(pos, seed, tune=False)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    base_calls, base_cpu = mean(rows[0]["calls"]), mean(rows[0]["cpu"])
    table = [{"method": r["method"], "setting": r["setting"], "kind": r["kind"], "spec": r["spec"],
              "calls": mean(r["calls"]), "call_x": base_calls / mean(r["calls"]),
              "deep_x": base_calls / mean(r["deep"]), "cpu_x": base_cpu / mean(r["cpu"]),
              "psnr": mean(r["psnr"]), "psnr_min": min(r["psnr"]), "ssim": mean(r["ssim"]), "err": mean(r["err"]),
              "tune_x": mean(rows[0]["tune_calls"]) / mean(r["tune_calls"]) if r["tune_calls"] else 1.0,
              "tune_psnr": mean(r["tune_psnr"]) if r["tune_psnr"] else PSNR_CAP}
             for r in rows]
    picked = pick_default(table)
    print_table(family, table, calibration, len(prompts) * len(seeds), args)
    return table, picked


def pick_default(table: list[dict], rule: str | None = None, mode: str | None = None) -> dict | None:
    """The default a family should get, chosen on the tuning prompts only: among the node's settings that
    need no calibration (published coefficients, First-Block) and keep the node's default window and
    skip limit (of ``rule`` and ``mode`` where given), the most call savings whose tuning mean PSNR
    stays >= PICK_FLOOR."""
    usable = [r for r in table if r["spec"][0] == "rk" and r["spec"][2] != "calibrated"
              and r["spec"][5] == 0 and r["spec"][6] == 0.0 and r["tune_psnr"] >= PICK_FLOOR
              and rule in (None, r["spec"][1]) and mode in (None, r["spec"][4])]
    return max(usable, key=lambda r: (r["tune_x"], r["tune_psnr"]), default=None)


def pareto(table: list[dict]) -> set[int]:
    """Indices of the rows no other row beats on both calls (fewer) and mean PSNR (higher)."""
    return {i for i, r in enumerate(table)
            if not any(o["calls"] <= r["calls"] and o["psnr"] >= r["psnr"]
                       and (o["calls"] < r["calls"] or o["psnr"] > r["psnr"]) for o in table)}


def print_table(family: str, table: list[dict], calibration: dict, runs: int, args) -> None:
    front = pareto(table)
    print(f"\ntrained {family}: {args.size}x{args.size} latent, {args.steps} euler/simple steps, CFG {args.cfg}, "
          f"window 0-1 unless marked, {runs} runs (prompts x seeds); calibrated on {CALIBRATION[0]!r} seed "
          f"{CALIBRATION[1]}: TeaCache {[round(c, 3) for c in calibration.get('coefficients', [])]}")
    print(f"  {'method':<24}{'setting':<28}{'kind':<9}{'calls':>7}{'calls x':>9}{'deep x':>8}{'cpu x':>7}{'PSNR':>7}"
          f"{'min':>7}{'SSIM':>7}{'latent err':>11}")
    for i in sorted(range(len(table)), key=lambda i: (-table[i]["call_x"], -table[i]["psnr"])):
        r = table[i]
        print(f"{'*' if i in front else ' '} {r['method']:<24}{r['setting']:<28}{r['kind']:<9}{r['calls']:>7.1f}"
              f"{r['call_x']:>9.2f}{r['deep_x']:>8.2f}{r['cpu_x']:>7.2f}{r['psnr']:>7.1f}{r['psnr_min']:>7.1f}"
              f"{r['ssim']:>7.3f}{r['err'] * 100:>10.2f}%")
    print(f"  (* Pareto front on calls and mean PSNR; PSNR capped at {PSNR_CAP:g} dB for an exact picture; kind: "
          "baseline = a published rule as published or a core node, reusekit = ReuseKit's settings)")


def best(table: list[dict], kind: str, floor: float, cost: str = "call_x") -> tuple[float, str]:
    """The highest speedup (``cost``) of the rows of ``kind`` at mean PSNR >= floor (1.0, uncached, when
    none reaches it)."""
    got = [(r[cost], f"{r['method']} {r['setting']}") for r in table if r["kind"] == kind and r["psnr"] >= floor]
    return max(got, default=(1.0, "uncached"))


def result(tables: dict[str, list[dict]], floor: float, cost: str = "call_x") -> tuple[float, float]:
    """(x, y) at a PSNR floor: x the smallest over the models of the default setting's call speedup (0
    where its mean PSNR is under the floor); y the smallest of best ReuseKit / best baseline."""
    xs, ys = [], []
    for family, table in tables.items():
        d = next(r for r in table if (r["method"], r["setting"]) == DEFAULT)
        xs.append(d[cost] if d["psnr"] >= floor else 0.0)
        ours, ours_name = best(table, "reusekit", floor, cost)
        base, base_name = best(table, "baseline", floor, cost)
        ys.append(ours / base)
        print(f"{family} at >= {floor:g} dB ({cost}): default {d[cost]:.2f}x ({d['psnr']:.1f} dB); best ReuseKit "
              f"{ours:.2f}x ({ours_name}); best baseline {base:.2f}x ({base_name})")
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
    tables, picks = {}, {}
    for family in ("flux", "wan"):
        tables[family], picks[family] = sweep(family, args)
    print(f"\ndefault = the node's default inputs ({DEFAULT[1]}: rule, threshold and residual mode auto, i.e. the "
          "family's), no calibration made")
    for family, pick in picks.items():
        d = next(r for r in tables[family] if (r["method"], r["setting"]) == DEFAULT)
        said = "none reaches it" if pick is None else (
            f"{pick['method']} {pick['setting']} ({pick['tune_x']:.2f}x at {pick['tune_psnr']:.1f} dB on tuning; "
            f"{pick['call_x']:.2f}x at {pick['psnr']:.1f} dB on evaluation)")
        print(f"{family}: tuning prompts pick (>= {PICK_FLOOR:g} dB, no calibration): {said}; the node's default "
              f"gives {d['tune_x']:.2f}x at {d['tune_psnr']:.1f} dB on tuning")
        if pick is not None:  # each rule's threshold when picked with the family's residual mode
            per_rule = {rule: pick_default(tables[family], rule, pick["spec"][4]) for rule in THRESHOLDS}
            print(f"{family}: per-rule thresholds picked on tuning with {pick['spec'][4]}: " + ", ".join(
                f"{rule} {'none' if r is None else format(r['spec'][3], 'g')}" for rule, r in per_rule.items()))
    lines = []
    for floor in FLOORS:
        x, y = result(tables, floor)
        lines.append(f"at >= {floor:g} dB: default_speedup_min={x:.2f} vs_best_baseline_min={y:.2f}")
    print("\n".join(lines[1:]))
    _, y_deep = result(tables, FLOORS[0], "deep_x")
    print(f"at >= {FLOORS[0]:g} dB with the first block priced as on the full-size models: "
          f"vs_best_baseline_min={y_deep:.2f}")
    print(f"ran {time.perf_counter() - t0:.0f} s")
    print(f"RESULT {lines[0].split(': ', 1)[1]}")


if __name__ == "__main__":
    main()
