"""Where a step cache's computed steps go: fixed plans scored on the step-cache bench's tuning runs.

    .venv/bin/python bench/step_cache_plans.py [--setup flux] [--steps 50] [--mode taylorseer1] [--runs tuning]
        [PLAN ...]

A plan is one letter per step: C computes every branch, S adds each branch's forecast (``--mode``, as the
step cache's residual modes; ``output`` forecasts the model's output, as the interval rule's placed beat
runs it, with no H), H computes the cond branch and rebuilds the uncond one from the last measured
cond-minus-uncond difference (under CFG; costs half a step). Without plans it scores the ones behind the
findings in docs/step_cache.md ("Where the computed steps go"): TaylorSeer's even beat against the same
number of computed steps placed otherwise, and H steps in place of computed ones. Exploration on the tuning
runs (4 prompts x seeds 7 and 8), never on the evaluation ones: nothing here picks a setting. ``--runs
validation`` scores on 16 held-out runs instead, of prompts and seeds that are neither tuning nor evaluation
ones: whether what a search over plans found on the tuning runs holds on pictures it was not found on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_cache as B  # noqa: E402  (the bench: its stand-ins, runs, metrics and tuning prompts)

OUTPUT = "output"  # the residual mode that forecasts the model's output: the interval rule runs it


VALIDATION_PROMPTS = ["a purple square on a white background", "a yellow circle on a gray background",
                      "a green triangle on a black background", "a white cross on a black background",
                      "a red square on a white background", "a blue cross on a white background"]
VALIDATION_SEEDS = (21, 22, 23)


def validation_runs() -> list[tuple[str, int]]:
    """(prompt, seed) of the held-out runs: each validation prompt at the first two validation seeds, and
    each tuning prompt at the third (new pictures of known captions); none is a tuning or evaluation run."""
    return ([(p, s) for p in VALIDATION_PROMPTS for s in VALIDATION_SEEDS[:2]]
            + [(p, VALIDATION_SEEDS[2]) for p in B.TUNING_PROMPTS])


def beat(steps: int, computed: set[int], half: set[int] = frozenset()) -> str:
    return "".join("C" if i in computed else "H" if i in half else "S" for i in range(steps))


def score_plan(bench, plan: str, mode: str, runs: list[tuple[str, int]], refs: dict) -> dict:
    """``plan`` (one letter per step) on ``runs`` through the schedule rule's forced plan, skipped steps
    adding ``mode``'s forecasts (``output``: the interval rule's placed beat, forced to the plan's C
    steps): the bench's measure (speedup, mean and worst PSNR)."""
    if mode == OUTPUT:
        setting = dict(rule="interval", model_type="auto", mode=mode, threshold=float(len(plan)),
                       combo=dict(K=0, start=0.0, last=False, power=B.END_POWER))
        placed = [i for i, a in enumerate(plan) if a == "C"]
        with mock.patch.object(bench.tc, "placed_beat", lambda *a: placed):  # every placed beat is the plan's
            return B.measure(bench, setting, len(plan), runs, refs)
    setting = dict(rule="schedule", model_type="auto", mode=mode, threshold=0.01, combo=dict(K=0, start=0.0, last=False))
    with B.forced_plan(bench.schedule, list(plan)):
        return B.measure(bench, setting, len(plan), runs, refs)


def findings(steps: int) -> list[str]:
    """The plans behind the findings, at ``steps`` (50: TaylorSeer's pick at Flux CFG 3.5 is N=9)."""
    n = 9 if steps >= 40 else 5
    even = set(range(0, steps, n))
    return [
        beat(steps, even),  # TaylorSeer's beat
        beat(steps, set(range(0, steps, n + 1))),  # one step fewer apart
        beat(steps, even | set(range(n + 1))),  # the first stretch computed
        beat(steps, even | {1}),  # a second computed step at the start (a slope for the first stretch)
        beat(steps, even | {steps - 1}),  # the last step computed
        beat(steps, {i for i in even if (i // n) % 2 == 0}, {i for i in even if (i // n) % 2}),  # every other C an H
        beat(steps, even, set(range(n // 2, steps, n))),  # an H between computed steps
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", default="flux", choices=sorted(B.SETUPS))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--mode", default="taylorseer1", help="the residual mode the skipped steps add")
    ap.add_argument("--runs", default="tuning", choices=("tuning", "validation"),
                    help="the tuning runs, or held-out runs that are neither tuning nor evaluation ones")
    ap.add_argument("plans", nargs="*", help="plans of C/S/H, one letter per step (default: the findings' plans)")
    args = ap.parse_args()
    B.rkharness.bootstrap()
    import torch

    torch.set_num_threads(1)
    plans = args.plans or [p for p in findings(args.steps) if args.mode != OUTPUT or "H" not in p]
    if any(len(p) != args.steps or set(p) - set("CSH") for p in plans):
        ap.error(f"plans: one of C, S, H per step, {args.steps} letters each")
    if args.mode == OUTPUT and any("H" in p or not p.startswith("C") for p in plans):
        ap.error("plans: with --mode output, C and S only, the first step C (the interval rule's beat)")
    family, cfg = B.SETUPS[args.setup]
    bench = B.Bench(family, False, cfg)
    runs = B.tuning_runs(False) if args.runs == "tuning" else validation_runs()
    print(f"{args.setup} stand-in at CFG {cfg:g}, {args.steps} steps, residual mode {args.mode}, on the {len(runs)} "
          f"{args.runs} runs: speedup, mean / worst PSNR dB")
    with torch.inference_mode():
        refs = B.references(bench, args.steps, runs)
        for plan in plans:
            p = score_plan(bench, plan, args.mode, runs, refs)
            print(f"  {plan}  {p['x']:6.2f}x  {p['psnr']:5.1f} / {p['worst']:.1f}", flush=True)


if __name__ == "__main__":
    main()
