"""Step cache hot path: what a skipped step costs, at two model depths, beside the uncached step.

    .venv/bin/python bench/step_cache_skip_cost.py

ComfyUI's Flux (block patches) and Z-Image (its block class wrapped, no block seam) at a test width,
each at a shallow and an 8x deeper stack, sampled through the real sampler (cfg 2, cond and uncond
batched) without the step cache and with the interval rule computing one call in the run and skipping
the rest (residual_mode reuse). A call is one apply_model, timed; the median over a run's skipped calls
against the median over the uncached run's calls, side by side in one run, and the worst (largest) ratio
over three rounds. A skip passes every block through and adds the stored residual: its cost is the
embedding, the final layer and a Python call per block, so it should stay nearly flat while the
uncached step grows with the stack. Last line: RESULT skip_ms_deep_over_shallow_max=<x>
plain_ms_deep_over_shallow_min=<x> (over both families).
"""

from __future__ import annotations

import statistics
import sys

import torch

sys.path.insert(0, "tests")
import rkharness  # noqa: E402

rkharness.bootstrap()

import importlib  # noqa: E402

import comfy.sample  # noqa: E402
from timing import timed  # noqa: E402  (bench/, after the host is importable)

import nodes  # noqa: E402

tiny = rkharness.TINY
families = importlib.import_module(f"{tiny.__name__}.families")
step_nodes = rkharness.pack("nodes.step_cache")
step_patch = rkharness.pack("patches.step_cache")
STEPS = 12
ROUNDS = 3
DEPTHS = (2, 16)


def build(family: str, depth: int):
    if family == "flux":
        return tiny.tiny_flux(0, hidden_size=256, num_heads=4, axes_dim=[16, 24, 24], depth=depth // 2,
                              depth_single_blocks=depth // 2)
    return families.tiny_lumina2(0, z_image=True, n_layers=depth)


def sample(model, c, shape):
    pos, neg = c
    latent = torch.zeros(shape)
    noise = comfy.sample.prepare_noise(latent, 1)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, STEPS, 2.0, "euler", "simple", pos, neg, latent,
                                   disable_pbar=True, seed=1)


def call_ms(model, c, shape, cached: bool) -> float:
    """Median ms of the run's uncached calls, or (``cached``) of its skipped calls."""
    times: list[float] = []
    if cached:
        model = step_nodes.TeaCacheNode.execute(model, rule="interval", threshold=float(STEPS),
                                                residual_mode="reuse").args[0]
    m = timed(model, times)
    sample(m, c, shape)  # warm-up
    times.clear()
    sample(m, c, shape)
    if not cached:
        return statistics.median(times) * 1e3
    run = step_patch.stats().snapshot()["info"]["last_run"]
    pattern = next(iter(run["conds"].values()))["pattern"]
    assert run["calls_skipped"] == STEPS - 1 and len(pattern) == len(times), run
    return statistics.median(t for t, p in zip(times, pattern, strict=True) if p == "S") * 1e3


def main() -> None:
    torch.set_num_threads(1)
    clip = tiny.tiny_clip(0)
    c = tuple(nodes.CLIPTextEncode().encode(clip, text)[0] for text in ("a red square on a blue field", "blurry"))
    shape = (1, 16, 32, 32)
    skip_growth, plain_growth = [], []
    print(f"one apply_model call, ms (median over a run of {STEPS} steps; {ROUNDS} rounds), 1 CPU thread")
    for family in ("flux", "z_image"):
        models = {d: build(family, d) for d in DEPTHS}
        rounds = []
        for _ in range(ROUNDS):
            rounds.append({d: (call_ms(models[d], c, shape, False), call_ms(models[d], c, shape, True))
                           for d in DEPTHS})
        for d in DEPTHS:
            plain = statistics.median(r[d][0] for r in rounds)
            skip = statistics.median(r[d][1] for r in rounds)
            worst = max(r[d][1] / r[d][0] for r in rounds)
            blocks = len(step_patch.detect_family(models[d]).blocks(models[d].model.diffusion_model))
            params = sum(p.numel() for p in models[d].model.diffusion_model.parameters()) / 1e6
            print(f"  {family:8s} {blocks:3d} blocks ({params:6.1f}M parameters): uncached {plain:7.2f}  "
                  f"skipped {skip:6.2f}  skipped/uncached {skip / plain:.3f} (worst round {worst:.3f})")
        shallow, deep = DEPTHS
        skip_growth.append(max(r[deep][1] / r[shallow][1] for r in rounds))
        plain_growth.append(min(r[deep][0] / r[shallow][0] for r in rounds))
        print(f"  {family}: {deep // shallow}x the blocks: the skipped call x{skip_growth[-1]:.2f} (worst round), "
              f"the uncached call x{plain_growth[-1]:.2f} (least round)")
    print(f"RESULT skip_ms_deep_over_shallow_max={max(skip_growth):.2f} "
          f"plain_ms_deep_over_shallow_min={min(plain_growth):.2f}")


if __name__ == "__main__":
    main()
