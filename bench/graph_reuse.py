"""Graph reuse benchmark: per-step time of the diffusion model eager vs replayed from a captured
CUDA graph, side by side in one run, and the cost of the reuse check per step.

    .venv/bin/python bench/graph_reuse.py

On CUDA: tiny Flux/Wan at two resolutions, a small realistic Flux (real width 3072, 1 double +
2 single blocks, bf16) at 256 and 512 px, and core TorchCompileModel(cudagraphs) on one config
where it runs (REUSEKIT_BENCH_COMPILE=0 skips it). Each config runs through the real sampler
(cfg 2, cond and uncond batched): a warm run (captures), then a timed run; a step is one
apply_model call timed between two synchronizations, the median over the timed run.
On CPU it measures the check (on a tiny Flux and on one of FLUX.1's depth), and (both) ReuseKit Step Cache
alone vs TeaCache + capture. Last line: RESULT step_replay_over_eager=<ratio|n/a> check_us=<µs>
check_deep_over_tiny=<ratio> host_check_deep_over_tiny=<ratio|n/a>.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if CUDA:
    os.environ.setdefault("REUSEKIT_TEST_CUDA", "1")  # the harness then leaves the device alone
sys.path.insert(0, "tests")
import rkharness  # noqa: E402

rkharness.bootstrap()

import comfy.patcher_extension as patcher_extension  # noqa: E402
import comfy.sample  # noqa: E402
from timing import timed  # noqa: E402  (bench/, after the host is importable)

import nodes  # noqa: E402

gc = rkharness.pack("patches.graph_capture")
gr = rkharness.pack("caching.graph_reuse")
graph_nodes = rkharness.pack("nodes.graph")
tiny = rkharness.TINY


def conds():
    clip = tiny.tiny_clip(0)
    (pos,) = nodes.CLIPTextEncode().encode(clip, "a red square on a blue field")
    (neg,) = nodes.CLIPTextEncode().encode(clip, "blurry")
    return pos, neg


def small_flux():
    """Real Flux width (3072, 24 heads of 128), 1 double + 2 single blocks, bf16 weights."""
    import comfy.supported_models

    cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=tiny.TEXT_DIM,
               context_in_dim=tiny.TEXT_DIM, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=1,
               depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
               guidance_embed=True)
    mc = comfy.supported_models.Flux(tiny.with_host_fields(cfg, "comfy.ldm.flux.model:FluxParams"))
    mc.set_inference_dtype(torch.bfloat16, None)
    model = mc.get_model({})
    tiny.fill_weights(model.diffusion_model, 0)
    return tiny._patcher(model)


def run(model, c, shape, steps, seed=1):
    pos, neg = c
    latent = torch.zeros(shape)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, 2.0, "euler", "simple", pos, neg, latent,
                               disable_pbar=True, seed=seed)


def step_ms(model, c, shape, steps):
    """Median ms per step of the second run (the first one captures / compiles)."""
    times: list[float] = []
    m = timed(model, times, torch.cuda.synchronize)
    run(m, c, shape, steps)
    times.clear()
    out = run(m, c, shape, steps, seed=2)
    return statistics.median(times) * 1e3, out


def check_cost(c, model) -> float:
    """µs per step for the decision alone (bind, signature, lookup) on a real Flux call of ``model``: the
    best of 5 x 2000 checks, in this thread's CPU time."""
    seen = {}

    def probe(executor, *args, **kwargs):
        seen.setdefault("call", (executor.original, args, kwargs))
        return executor(*args, **kwargs)

    m = model.clone()
    m.add_wrapper_with_key(patcher_extension.WrappersMP.DIFFUSION_MODEL, "bench_probe", probe)
    with torch.inference_mode():
        run(m, c, (1, 16, 8, 8), 1)
    original, args, kwargs = seen["call"]
    base = model.model
    device = args[0].device
    gs = gr.GraphSet(max_graphs=2)
    n, best = 2000, float("inf")
    with torch.inference_mode():
        spec = gr.analyse_call(gc._bind(original, args, kwargs), gc._state_fields(base, device, "eager"), device)
        gs.add(gr.Entry(spec.signature))
        for _ in range(5):  # thread CPU time: what the check costs, not the other processes on the machine
            t0 = time.thread_time()
            for _ in range(n):
                spec = gr.analyse_call(gc._bind(original, args, kwargs), gc._state_fields(base, device, "eager"),
                                       device)
                assert gs.decide(spec.signature).hit
            best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def host_check_cost() -> tuple[float, float] | None:
    """µs per forward for the check whether the host captures the model's blocks itself, while its
    registries (comfy/model_prefetch.py, ComfyUI 0.33+) hold a text encoder's layers: on the tiny Flux
    (1+1 blocks) and on one of FLUX.1's depth (19+38 blocks, tiny width); best of 5 x 2000, thread CPU
    time. None where the host has no such registries."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    if prefetch is None or not hasattr(prefetch, "GRAPH_WARMED_MODULES"):
        return None
    encoder = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(48)])  # a text encoder's layers
    for layer in encoder:
        prefetch.GRAPH_WARMED_MODULES.add(layer)
    costs = []
    try:
        for model in (tiny.tiny_flux(0), tiny.tiny_flux(0, depth=19, depth_single_blocks=38)):
            dm = model.model.diffusion_model
            assert not gc.host_captures_graphs(dm)
            n, best = 2000, float("inf")
            for _ in range(5):
                t0 = time.thread_time()
                for _ in range(n):
                    gc.host_captures_graphs(dm)
                best = min(best, (time.thread_time() - t0) / n)
            costs.append(best * 1e6)
    finally:
        prefetch.cleanup_prefetch_queues()
    return costs[0], costs[1]


def with_teacache(c) -> None:
    """ReuseKit Step Cache alone vs TeaCache + capture on the trained Flux (10 steps, threshold 0.4),
    whole runs interleaved, median of 5: on CUDA computed steps replay; on a CPU the capture runs
    decisions only, so the ratio is what the eager probe up to TeaCache's first block costs."""
    import importlib

    tea_node = rkharness.pack("nodes.step_cache").TeaCacheNode
    model = importlib.import_module(f"{tiny.__name__}.trained_flux").build()
    tea = tea_node.execute(model, "flux", 0.4, 0.0, 1.0, 0, "device", "extrapolate").args[0]
    both = graph_nodes.with_capture("bench", "enable", tea, True, 2)
    times: dict[str, list[float]] = {"teacache": [], "teacache+capture": []}
    outs = {}
    with torch.inference_mode():
        for _ in range(6):
            for name, m in (("teacache", tea), ("teacache+capture", both)):
                if CUDA:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs[name] = run(m, c, (1, 16, 8, 8), 10)
                if CUDA:
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    snap = gc.STATS.handle.snapshot()["info"].get("last_run", {})
    a, b = (statistics.median(t[1:]) * 1e3 for t in times.values())  # the first run captures
    diff = (outs["teacache+capture"].float() - outs["teacache"].float()).abs().max().item()
    print(f"TeaCache on the trained Flux, 10 steps: alone {a:.1f} ms, with capture {b:.1f} ms per run "
          f"(ratio {b / a:.2f}, max|diff| {diff:.1e}; last run: {snap.get('replays')} replays, "
          f"{snap.get('eager_steps')} eager, {snap.get('step_cache_skips')} skipped by TeaCache)")
    gc.graph_release.release_all("bench")


def main() -> None:
    torch.manual_seed(0)
    with torch.inference_mode():
        c = conds()
    check_us = check_cost(c, tiny.tiny_flux(0))
    check_deep = check_cost(c, tiny.tiny_flux(0, depth=19, depth_single_blocks=38)) / check_us
    print(f"reuse check (bind + signature + lookup) on a real Flux call: {check_us:.1f} us per step on Flux 1+1 "
          f"blocks; on 19+38 blocks (tiny width) {check_deep:.2f}x that")
    host = host_check_cost()
    host_ratio = "n/a" if host is None else f"{host[1] / host[0]:.2f}"
    print("host block-graph check with the host's registries in use: " + (
        "n/a (this ComfyUI has no comfy.model_prefetch)" if host is None else
        f"{host[0]:.1f} us per step on Flux 1+1 blocks, {host[1]:.1f} us on 19+38 (ratio {host_ratio})"))
    with_teacache(c)
    if not CUDA:
        print("no CUDA device: graphs are not captured here; the decision runs, the model runs eagerly")
        print(f"RESULT step_replay_over_eager=n/a check_us={check_us:.1f} check_deep_over_tiny={check_deep:.2f} "
              f"host_check_deep_over_tiny={host_ratio}")
        return

    configs = [
        ("tiny flux 64px", tiny.tiny_flux, (1, 16, 8, 8), 12),
        ("tiny flux 512px", tiny.tiny_flux, (1, 16, 64, 64), 12),
        ("tiny wan 3x128px", tiny.tiny_wan, (1, 16, 3, 16, 16), 12),
        ("flux w3072 1+2 bf16 256px", small_flux, (1, 16, 32, 32), 8),
        ("flux w3072 1+2 bf16 512px", small_flux, (1, 16, 64, 64), 8),
    ]
    compile_on = os.environ.get("REUSEKIT_BENCH_COMPILE", "1") != "0"
    headline = None
    print(f"{'config':28} {'eager ms':>9} {'replay ms':>10} {'ratio':>6} {'max|diff|':>10} "
          f"{'compile ms':>11} {'ratio':>6}")
    builders = {}
    for name, build, shape, steps in configs:
        try:
            with torch.inference_mode():
                if build not in builders:
                    builders.clear()  # one big model at a time
                    torch.cuda.empty_cache()
                    builders[build] = build()
                model = builders[build]
                eager, ref = step_ms(model, c, shape, steps)
                gc.graph_release.release_all("bench")
                replay, out = step_ms(graph_nodes.with_capture("bench", "enable", model, True, 2), c, shape, steps)
                snap = gc.STATS.handle.snapshot()["info"].get("last_run", {})
                diff = (out.float() - ref.float()).abs().max().item()
                comp, comp_ratio = "n/a", "-"
                if compile_on and name == "tiny flux 512px":
                    comp, comp_ratio = compiled_cudagraphs(model, c, shape, steps, eager)
        except Exception as exc:  # one config that cannot run here must not hide the others
            print(f"{name:28} failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        ratio = replay / eager
        if name == "flux w3072 1+2 bf16 256px":
            headline = ratio
        print(f"{name:28} {eager:9.3f} {replay:10.3f} {ratio:6.2f} {diff:10.2e} {comp:>11} {comp_ratio:>6}"
              f"   (captures {snap.get('captures')}, replays {snap.get('replays')}, eager {snap.get('eager_steps')})")
    gc.graph_release.release_all("bench")
    print("ratio: replay / eager per step (a step = one apply_model call, cond and uncond batched); "
          "headline: the w3072 Flux at 256 px")
    print(f"RESULT step_replay_over_eager={'n/a' if headline is None else f'{headline:.2f}'} check_us={check_us:.1f} "
          f"check_deep_over_tiny={check_deep:.2f} host_check_deep_over_tiny={host_ratio}")


def compiled_cudagraphs(model, c, shape, steps, eager_ms) -> tuple[str, str]:
    """Core TorchCompileModel(backend="cudagraphs") on the same config, where it runs."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    try:
        compiled = TorchCompileModel.execute(model, "cudagraphs").args[0]
        ms, _ = step_ms(compiled, c, shape, steps)
    except Exception as exc:  # the compile backend may not run on this host: say so
        return f"failed ({type(exc).__name__})", "-"
    return f"{ms:.3f}", f"{ms / eager_ms:.2f}"


if __name__ == "__main__":
    main()
