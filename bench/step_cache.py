"""Step cache benchmark: ReuseKit TeaCache against ComfyUI core's EasyCache and LazyCache.

    .venv/bin/python bench/step_cache.py [--steps 20] [--quick]

On the small Flux trained on captioned shapes (tests/tinymodels/trained_flux.py), through the real
KSampler (euler, simple, CFG 3.5), for several thresholds of each method: how many times the
transformer block stack ran (counted by a hook on the first block), the wall time, and the final
latent's relative L2 error against the uncached run, averaged over a few prompts and seeds. All
methods run side by side in one process, interleaved per prompt.

Speedups in the RESULT line are transformer-call ratios (deterministic); CPU-time ratios (one
torch thread, process CPU time: steadier than wall time on a shared machine) are in the table; the
tiny model's fixed per-step cost (sampler, embedders, final layer) weighs more than on a real one. ReuseKit rows: published Flux coefficients ("flux") and this model's own calibration
("calibrated", fitted by one ReuseKit TeaCache Calibrate run first).
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

PROMPTS = [("a red circle on a black background", 11), ("a yellow square on a gray background", 12),
           ("a blue triangle on a white background", 13), ("a green cross on a white background", 14),
           ("a purple circle on a gray background", 15)]
THRESH = {  # method: model_type:residual_mode for ReuseKit
    "reusekit:flux:reuse": [0.1, 0.2, 0.3, 0.4, 0.6],
    "reusekit:flux:extrapolate": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
    "reusekit:calibrated:extrapolate": [0.05, 0.1, 0.15, 0.2, 0.3],
    "easycache": [0.01, 0.02, 0.05, 0.1, 0.2],
    "lazycache": [0.01, 0.02, 0.05, 0.1, 0.2, 0.4],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=3.5)
    ap.add_argument("--quick", action="store_true", help="one prompt, fewer thresholds (a smoke run)")
    args = ap.parse_args()

    rkharness.bootstrap()
    torch.set_num_threads(1)  # CPU time of one thread: steadier than wall time on a shared machine
    logging.getLogger("reusekit").setLevel(logging.WARNING)
    logging.getLogger().setLevel(logging.WARNING)
    import comfy.utils
    from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode

    import nodes

    comfy.utils.PROGRESS_BAR_ENABLED = False
    trained = importlib.import_module(rkharness.TINY.__name__ + ".trained_flux")
    N = rkharness.pack("nodes.teacache")
    P = rkharness.pack("patches.teacache")
    tc = rkharness.pack("caching.teacache")
    P.STORE = tc.CalibrationStore(None)  # keep the bench's calibration out of the user folder

    prompts = PROMPTS[:1] if args.quick else PROMPTS
    thresh = {k: v[1::2] for k, v in THRESH.items()} if args.quick else THRESH
    model, clip = trained.build(), rkharness.TINY.tiny_clip(0)
    block_runs = [0]
    model.model.diffusion_model.double_blocks[0].register_forward_pre_hook(
        lambda *a: block_runs.__setitem__(0, block_runs[0] + 1))

    with torch.inference_mode():
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")
        encoded = [(nodes.CLIPTextEncode().encode(clip, text)[0], seed) for text, seed in prompts]

        def run(m, pos, seed):
            block_runs[0] = 0
            t0 = time.process_time()
            (out,) = nodes.common_ksampler(m, seed, args.steps, args.cfg, "euler", "simple", pos, neg,
                                           {"samples": torch.zeros(1, 16, 8, 8)})
            return out["samples"], block_runs[0], time.process_time() - t0

        (cal,) = N.TeaCacheCalibrateNode.execute(model).args
        run(cal, *encoded[0])
        coeffs = P.stats().snapshot()["info"]["last_calibration"]["coefficients"]

        def make(method, th):
            if method == "none":
                return model
            if method.startswith("reusekit"):
                _, model_type, mode = method.split(":")
                return N.TeaCacheNode.execute(model, model_type, th, 0.0, 1.0, 0, "device", mode).args[0]
            node = EasyCacheNode if method == "easycache" else LazyCacheNode
            return node.execute(model, th, 0.15, 0.95, False).args[0]

        configs = [("none", 0.0)] + [(m, t) for m, ts in thresh.items() for t in ts]
        rows = {c: {"calls": 0, "time": 0.0, "err": 0.0} for c in configs}
        run(model, *encoded[0])  # warm-up, not counted
        for pos, seed in encoded:  # interleaved: every method sees the same machine load per prompt
            ref, calls, t = run(model, pos, seed)
            for cfgkey in configs[1:]:
                out, calls_c, t_c = run(make(*cfgkey), pos, seed)
                r = rows[cfgkey]
                r["calls"] += calls_c
                r["time"] += t_c
                r["err"] += float((out - ref).norm() / ref.norm())
            t = min(t, run(model, pos, seed)[2])  # the uncached time: the better of before and after
            rows[("none", 0.0)]["calls"] += calls
            rows[("none", 0.0)]["time"] += t
    n = len(encoded)
    base_calls, base_time = rows[("none", 0.0)]["calls"] / n, rows[("none", 0.0)]["time"] / n
    table = []
    for (method, th), r in rows.items():
        calls, t, err = r["calls"] / n, r["time"] / n, r["err"] / n
        table.append((method, th, calls, base_calls / calls, base_time / t, err))

    print(f"trained Flux, {args.steps} euler steps, CFG {args.cfg}, {n} prompt(s); calibrated poly "
          f"{[round(c, 3) for c in coeffs]}")
    print(f"{'method':<32}{'thresh':>7}{'blocks':>8}{'calls x':>9}{'cpu x':>8}{'latent err':>12}")
    for method, th, calls, sx, wx, err in table:
        print(f"{method:<32}{th:>7.3g}{calls:>8.1f}{sx:>9.2f}{wx:>8.2f}{err * 100:>11.2f}%")

    def best(prefix, budget, key=3):
        got = [row[key] for row in table if row[0].startswith(prefix) and row[5] <= budget]
        return max(got, default=1.0)

    print()
    cols = [("ReuseKit", "reusekit"), ("(reuse)", "reusekit:flux:reuse"), ("EasyCache", "easycache"),
            ("LazyCache", "lazycache")]
    print(f"{'error budget':<14}" + "".join(f"{c:>11}" for c, _ in cols) + "   (best transformer-call speedup)")
    for budget in (0.02, 0.05, 0.10):
        print(f"{budget * 100:>5.0f}%{'':<8}" + "".join(f"{best(p, budget):>11.2f}" for _, p in cols))
    print(f"{'5% (cpu time)':<14}" + "".join(f"{best(p, 0.05, 4):>11.2f}" for _, p in cols))
    ours = best("reusekit", 0.05)
    core = max(best("easycache", 0.05), best("lazycache", 0.05))
    print(f"RESULT speedup_at_matched_error={ours / core:.2f} max_speedup={ours:.2f}")


if __name__ == "__main__":
    main()
