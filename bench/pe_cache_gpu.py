"""PE cache on a GPU: one Flux and one Wan forward (``apply_model``) with the PE cache on against off.

    python3 bench/pe_cache_gpu.py              on a CUDA machine (scripts/gpu_check.sh runs it)
    .venv/bin/python bench/pe_cache_gpu.py --dry-run    anywhere: tiny sizes on the CPU, the same path,
                                                        no GPU figures

Models at their real head geometry with few blocks and random bf16 weights: Flux (hidden 3072, 24
heads of 128, 1 double + 2 single blocks) at 1024x1024 with 512 text tokens, Wan 2.1 (dim 1536, 12
heads of 128, 2 layers) at 832x480 with 33 frames. Rounds interleave off and on; a round is a run of
forwards between two synchronizations, so a forward that waits for the GPU (a copy to the host)
loses the launch overlap it would otherwise have. The synchronizing CUDA calls of one forward are
counted with ``torch.cuda.set_sync_debug_mode("warn")``, off and on (the host's own and the pack's).

Last line: ``RESULT pe_gpu_flux_on_over_off=<ratio> pe_gpu_wan_on_over_off=<ratio>
pe_gpu_syncs_on=<n> pe_gpu_syncs_off=<n> device=<name>``; with ``--dry-run``: ``RESULT pe_gpu_dry_run=ok``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

DRY = "--dry-run" in sys.argv
CUDA = torch.cuda.is_available() and not DRY
if CUDA:
    os.environ.setdefault("REUSEKIT_TEST_CUDA", "1")  # the harness then leaves the device alone
sys.path.insert(0, "tests")
import rkharness  # noqa: E402

rkharness.bootstrap()

import comfy.model_management as mm  # noqa: E402
import comfy.patcher_extension as patcher_extension  # noqa: E402
import comfy.supported_models as sm  # noqa: E402

rope = rkharness.pack("patches.rope")
tiny = rkharness.TINY
DTYPE = torch.bfloat16 if CUDA else torch.float32


def build(config_cls, cfg: dict):
    mc = config_cls(cfg)
    mc.set_inference_dtype(DTYPE, None)
    model = mc.get_model({})
    tiny.fill_weights(model.diffusion_model, 0)
    patcher = tiny._patcher(model)
    mm.load_models_gpu([patcher])
    return patcher


def flux():
    big = dict(hidden_size=3072, num_heads=24, depth=1, depth_single_blocks=2, axes_dim=[16, 56, 56])
    cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=tiny.TEXT_DIM,
               context_in_dim=tiny.TEXT_DIM, mlp_ratio=4.0, theta=10000, patch_size=2, qkv_bias=True,
               guidance_embed=True, **(big if CUDA else dict(hidden_size=64, num_heads=2, depth=1,
                                                             depth_single_blocks=1, axes_dim=[8, 12, 12])))
    model = build(sm.Flux, tiny.with_host_fields(cfg, "comfy.ldm.flux.model:FluxParams"))
    latent, tokens = ((1, 16, 128, 128), 512) if CUDA else ((1, 16, 16, 16), 16)
    return model, latent, {"c_crossattn": torch.randn(1, tokens, tiny.TEXT_DIM), "guidance": torch.tensor([3.5]),
                           "y": torch.randn(1, tiny.TEXT_DIM)}


def wan():
    big = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=2)
    cfg = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16,
               freq_dim=256, text_dim=tiny.TEXT_DIM, out_dim=16, window_size=(-1, -1), qk_norm=True,
               cross_attn_norm=True, eps=1e-6,
               **(big if CUDA else dict(dim=64, ffn_dim=128, num_heads=2, num_layers=1)))
    model = build(sm.WAN21_T2V, cfg)
    latent = (1, 16, 9, 60, 104) if CUDA else (1, 16, 3, 8, 8)
    return model, latent, {"c_crossattn": torch.randn(1, 64, tiny.TEXT_DIM)}


def forwards(model, latent, kwargs):
    """(off, on): one apply_model call each, on the model's device."""
    device = model.load_device if CUDA else torch.device("cpu")
    x = torch.randn(latent, device=device)
    sigma = torch.full((1,), 0.7, device=device)
    kw = {k: v.to(device) for k, v in kwargs.items()}
    on = {"wrappers": {patcher_extension.WrappersMP.APPLY_MODEL: {"bench": [rope.ApplyModelWrapper()]}}}

    def call(options):
        return lambda: model.model.apply_model(x, sigma, transformer_options=dict(options), **kw)
    return call({}), call(on)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def per_forward(fn, n: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def syncs_in(fn) -> int:
    """Synchronizing CUDA calls made by one forward (0 without CUDA: nothing to wait for)."""
    if not CUDA:
        fn()
        return 0
    sync()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def measure(name, make, rounds: int, n: int) -> dict:
    model, latent, kwargs = make()
    off, on = forwards(model, latent, kwargs)
    with torch.inference_mode():
        for fn in (off, on, on):  # warm: kernels chosen, the cache's one miss
            fn()
        syncs = (syncs_in(off), syncs_in(on))
        times = {"off": [], "on": []}
        for _ in range(rounds):
            times["off"].append(per_forward(off, n))
            times["on"].append(per_forward(on, n))
    off_ms, on_ms = (statistics.median(times[k]) * 1e3 for k in ("off", "on"))
    stats = rope.model_cache(model.model).stats.snapshot()["counters"]
    mm.unload_all_models()
    return {"name": name, "off_ms": off_ms, "on_ms": on_ms, "syncs": syncs, "hits": stats.get("hits", 0),
            "bypasses": stats.get("bypasses", 0)}


def main():
    rounds, n = (7, 5) if CUDA else (1, 1)
    rows = [measure("flux 1024x1024 (+512 text)" if CUDA else "flux (tiny, 16x16)", flux, rounds, n),
            measure("wan 832x480 x 33 f" if CUDA else "wan (tiny, 3 x 8x8)", wan, rounds, n)]
    device = torch.cuda.get_device_name(0) if CUDA else "cpu"
    print(f"\nOne apply_model forward, PE cache off / on ({device}, {DTYPE}, median of {rounds} rounds of {n})")
    print(f"{'model':28} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'syncs off/on':>13} {'hits':>5} {'uncached':>8}")
    for r in rows:
        print(f"{r['name']:28} {r['off_ms']:8.2f} {r['on_ms']:8.2f} {r['on_ms'] / r['off_ms']:7.3f} "
              f"{r['syncs'][0]:6d}/{r['syncs'][1]:<6d} {r['hits']:5d} {r['bypasses']:8d}")
    if not CUDA:
        print("dry run on the CPU: the path works; these are not GPU figures")
        print("RESULT pe_gpu_dry_run=ok")
        return
    flux_r, wan_r = (r["on_ms"] / r["off_ms"] for r in rows)
    print(f"RESULT pe_gpu_flux_on_over_off={flux_r:.3f} pe_gpu_wan_on_over_off={wan_r:.3f} "
          f"pe_gpu_syncs_on={sum(r['syncs'][1] for r in rows)} pe_gpu_syncs_off={sum(r['syncs'][0] for r in rows)} "
          f"device={device.replace(' ', '_')}")


if __name__ == "__main__":
    main()
