"""PE cache benchmark: the cost of a hit against building the position embeddings, per family.

Two tables, each measured side by side in one run (interleaved rounds, best round's median):

1. realistic geometries, the PE builder alone (no transformer): the host's builder (a miss) and the
   patched builder answering from a warm cache (a hit, including the key build and compare; the
   ids tensors are fresh each call, as the host makes them);
2. the tiny test models: one whole ``apply_model`` forward without and with the cache.

Last line: ``RESULT pe_hit_over_miss=<worst hit/miss ratio over table 1> families=<families covered>``.
Run from the repository root: ``.venv/bin/python bench/pe_cache.py``.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time

sys.path.insert(0, "tests")
import rkharness  # noqa: E402

rkharness.bootstrap()

import torch  # noqa: E402

rope = rkharness.pack("patches.rope")
pc = rkharness.pack("caching.pe_cache")
families = importlib.import_module(rkharness.TINY.__name__ + ".families")

# the host families whose RoPE goes through a patched builder (tests/test_pe_cache_families.py)
COVERED = ["flux", "chroma", "chroma_radiance", "hunyuan_video", "wan", "qwen_image", "lumina2", "z_image",
           "omnigen2", "hidream", "ltxv", "cosmos", "mochi", "hunyuan_dit"]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def side_by_side(miss_fn, hit_fn, rounds: int = 5, repeats: int = 5) -> tuple[float, float]:
    """The best of the rounds' medians, rounds interleaved, so load from other processes on a
    shared machine inflates neither side more than the other."""
    misses, hits = [], []
    for _ in range(rounds):
        misses.append(median_time(miss_fn, repeats))
        hits.append(median_time(hit_fn, repeats * 4))
    return min(misses), min(hits)


def flux_ids(h_tokens: int, w_tokens: int, txt: int) -> torch.Tensor:
    img = torch.zeros(h_tokens, w_tokens, 3)
    img[..., 1] = torch.arange(h_tokens, dtype=torch.float32)[:, None]
    img[..., 2] = torch.arange(w_tokens, dtype=torch.float32)[None, :]
    return torch.cat([torch.zeros(1, txt, 3), img.reshape(1, -1, 3)], dim=1)


def video_ids(t: int, h: int, w: int, txt: int) -> torch.Tensor:
    img = torch.zeros(t, h, w, 3)
    img[..., 0] = torch.arange(t, dtype=torch.float32)[:, None, None]
    img[..., 1] = torch.arange(h, dtype=torch.float32)[None, :, None]
    img[..., 2] = torch.arange(w, dtype=torch.float32)[None, None, :]
    return torch.cat([img.reshape(1, -1, 3), torch.zeros(1, txt, 3)], dim=1)


def fresh_inputs(fn, tensor: torch.Tensor):
    """``fn`` called on a new copy of ``tensor`` each time (the host rebuilds its ids every call),
    copies made ahead so the copying is timed on neither side."""
    fresh = [tensor.clone() for _ in range(8)]
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(fresh[state["i"] % len(fresh)])
    return call


def embednd_case(module: str, axes, theta, ids):
    mod = importlib.import_module(module)
    kw = {"dim": sum(axes)} if module.endswith("flux.layers") else {}
    return fresh_inputs(mod.EmbedND(theta=theta, axes_dim=list(axes), **kw), ids)


def realistic_cases():
    import comfy.ldm.cosmos.position_embedding as cosmos_pos
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi
    import comfy.ldm.hydit.models as hydit
    import comfy.ldm.lightricks.model as ltxv
    import comfy.ldm.wan.model as wan

    wan_model = rkharness.TINY.tiny_wan(0, dim=256, ffn_dim=256, num_heads=2).model.diffusion_model  # head dim 128
    cosmos_emb = cosmos_pos.VideoRopePosition3DEmb(head_dim=128, len_h=240, len_w=240, len_t=128,
                                                   h_extrapolation_ratio=3.0, w_extrapolation_ratio=3.0)
    ltxv_grid = video_ids(13, 16, 24, 0)[0].T.unsqueeze(0) * torch.tensor([8.0, 32.0, 32.0])[None, :, None]
    freqs = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(0))
    hydit_latent = torch.zeros(1, 4, 128, 128)
    # a module function up to ComfyUI 0.8, then a method of the LTX model (LTX-2 too)
    families = importlib.import_module(f"{rkharness.TINY.__name__}.families")
    ltxv_freqs = (getattr(ltxv, "precompute_freqs_cis", None)
                  or families.tiny_ltxv(0).model.diffusion_model._precompute_freqs_cis)
    return {
        "flux 1024x1024 (+512 text)": embednd_case("comfy.ldm.flux.layers", (16, 56, 56), 10000,
                                                   flux_ids(64, 64, 512)),
        "qwen-image 1328x1328 (+256 text)": embednd_case("comfy.ldm.flux.layers", (16, 56, 56), 10000,
                                                         flux_ids(83, 83, 256)),
        "z-image 1024x1024 (+512 text)": embednd_case("comfy.ldm.flux.layers", (32, 48, 48), 256,
                                                      flux_ids(64, 64, 512)),
        "hidream 1024x1024 (+128 text)": embednd_case("comfy.ldm.hidream.model", (64, 32, 32), 10000,
                                                      flux_ids(64, 64, 128)),
        "hunyuan video 544x960 x 61 f": embednd_case("comfy.ldm.flux.layers", (16, 56, 56), 256,
                                                     video_ids(16, 34, 60, 256)),
        "wan 832x480 x 81 f (rope_encode)": lambda: wan.WanModel.rope_encode(
            wan_model, 21, 60, 104, device=torch.device("cpu"), dtype=torch.float32),
        "ltxv 768x512 x 97 f": fresh_inputs(lambda grid: ltxv_freqs(grid, dim=2048, out_dtype=torch.float32),
                                           ltxv_grid),
        "cosmos 1280x704 x 93 f": lambda: cosmos_emb.generate_embeddings(torch.Size((1, 24, 44, 80, 2048))),
        "mochi 848x480 x 163 f": lambda: mochi.compute_mixed_rotation(
            freqs=freqs, pos=mochi.create_position_matrix(28, pH=30, pW=53, device=torch.device("cpu"),
                                                          dtype=torch.float32)),
        "hunyuan dit 1024x1024": lambda: hydit.calc_rope(hydit_latent, 2, 88),
    }


def time_realistic():
    rows = []
    for label, call in realistic_cases().items():
        cache = pc.PECache()

        def hit(call=call, cache=cache):
            with rope.scope(cache):
                return call()
        hit()  # warm: the first call is the one miss
        miss, hit_t = side_by_side(call, hit, rounds=3, repeats=3)
        rows.append((label, miss, hit_t, sum(cache.nbytes().values())))
    return rows


def time_tiny():
    import comfy.patcher_extension as patcher_extension

    rows = []
    opts = {"wrappers": {patcher_extension.WrappersMP.APPLY_MODEL: {"bench": [rope.ApplyModelWrapper()]}}}
    for name, spec in families.FAMILY_SPECS.items():
        if spec.missing():  # a family this host does not have (e.g. Qwen-Image-Edit 2511 on 0.3.75)
            continue
        model = spec.build(0)
        x, sigma, kwargs = spec.inputs(spec.sizes[0], 0)

        def plain(model=model, x=x, sigma=sigma, kwargs=kwargs):
            model.model.apply_model(x, sigma, transformer_options={}, **kwargs)

        def cached(model=model, x=x, sigma=sigma, kwargs=kwargs):
            model.model.apply_model(x, sigma, transformer_options=dict(opts), **kwargs)
        cached()
        off, on = side_by_side(plain, cached, rounds=4, repeats=3)
        rows.append((name, off, on))
    return rows


def main():
    with torch.inference_mode():
        real = time_realistic()
        tiny = time_tiny()
    print("\nPE builder alone, realistic geometries (CPU, float32): miss = the host's builder, "
          "hit = patched builder with a warm cache")
    print(f"{'geometry':36} {'miss ms':>9} {'hit us':>9} {'hit/miss':>9} {'held':>9}")
    for label, miss, hit, nbytes in real:
        print(f"{label:36} {miss * 1e3:9.2f} {hit * 1e6:9.1f} {hit / miss:9.4f} {nbytes / 2**20:7.1f}Mi")
    print("\nTiny test models, one apply_model forward (ms): without / with the PE cache")
    print(f"{'family':18} {'off ms':>8} {'on ms':>8} {'on/off':>8}")
    for name, off, on in tiny:
        print(f"{name:18} {off * 1e3:8.2f} {on * 1e3:8.2f} {on / off:8.3f}")
    worst = max(hit / miss for _, miss, hit, _ in real)
    print(f"RESULT pe_hit_over_miss={worst:.4f} families={len(COVERED)}")


if __name__ == "__main__":
    main()
