"""PE cache benchmark: the cost of a hit against building the position embeddings, per family.

Two tables, each measured side by side in one run (interleaved rounds, best round's median):

1. realistic geometries, the PE builder alone (no transformer): the host's builder (a miss) and the
   patched builder answering from a warm cache (a hit, including the key build and compare). How a
   row's hit is decided: ``geometry``, an EmbedND family's embedder called inside its forward's
   geometry seam (``patches/rope_seams.py``; the forward's arguments keyed by value and tensors by
   shape, at their real sizes; the ids are fresh each call, as the host makes them); ``args``, a
   builder whose arguments are host values; ``values``, a builder keyed by tensor values, which
   hits on the CPU only (on a GPU it computes). The ``by value`` column is the same EmbedND call
   outside its forward: the ids keyed by their bytes, as every EmbedND hit was before the seams.
2. the tiny test models: one whole ``apply_model`` forward without and with the cache, and the
   reads of tensor values the pack makes on a hit (``tests/host_reads.py``, every tensor taken as
   on a GPU: each would be a device-to-host copy and a wait).

Last line: ``RESULT pe_hit_over_miss=<worst hit/miss over the geometry and args rows>
pe_hit_host_copies=<pack reads over every family's hit> families=<families covered>``.
Run from the repository root: ``.venv/bin/python bench/pe_cache.py``.
"""

from __future__ import annotations

import importlib
import itertools
import statistics
import sys
import time

sys.path.insert(0, "tests")
import rkharness  # noqa: E402

rkharness.bootstrap()

import torch  # noqa: E402
from host_reads import HostReads  # noqa: E402

rope = rkharness.pack("patches.rope")
seams = rkharness.pack("patches.rope_seams")
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


def meta(*shape) -> torch.Tensor:
    """An argument of the forward at its real size: the geometry reads its shape, dtype and device only."""
    return torch.empty(shape, device="meta")


def geometry_case(family: str, seam: str, embedder: str, module: str, axes, theta, ids, args: tuple, kwargs: dict):
    """The family's tiny host model with its position embedder at the real axes and theta; miss: the
    host's table; hit: that embedder called inside the forward's geometry seam (as ``_forward`` does),
    and, for comparison, outside it (ids keyed by their values)."""
    mod = importlib.import_module(module)
    kw = {"dim": sum(axes)} if module.endswith("flux.layers") else {}
    model = families.FAMILY_SPECS[family].build(0).model.diffusion_model
    setattr(model, embedder, mod.EmbedND(theta=theta, axes_dim=list(axes), **kw))
    emb = getattr(model, embedder)
    seam = next(s for s in seams.SEAMS if s.family == seam)
    kwargs = dict(kwargs, transformer_options={"cond_or_uncond": [1, 0], "sigmas": torch.ones(1)})

    def in_forward(ids):
        with seam.opened(model, args, kwargs):
            return emb(ids)
    return {"geometry": fresh_inputs(in_forward, ids), "by value": fresh_inputs(emb, ids),
            "miss": fresh_inputs(emb, ids)}


def geometry_cases():
    t = meta(1)
    return {
        "flux 1024x1024 (+512 text)": geometry_case(
            "flux", "flux", "pe_embedder", "comfy.ldm.flux.layers", (16, 56, 56), 10000, flux_ids(64, 64, 512),
            (meta(1, 16, 128, 128), t, meta(1, 512, 4096)),
            {"y": meta(1, 768), "guidance": t, "control": None, "attention_mask": None}),
        "qwen-image 1328x1328 (+256 text)": geometry_case(
            "qwen_image", "qwen-image", "pe_embedder", "comfy.ldm.flux.layers", (16, 56, 56), 10000, flux_ids(83, 83, 256),
            (meta(1, 16, 1, 166, 166), t, meta(1, 256, 3584)), {"attention_mask": None, "control": None}),
        "z-image 1024x1024 (+512 text)": geometry_case(
            "z_image", "lumina2 / z-image", "rope_embedder", "comfy.ldm.flux.layers", (32, 48, 48), 256, flux_ids(64, 64, 512),
            (meta(1, 16, 128, 128), t, meta(1, 512, 2560), 512), {"attention_mask": None}),
        "hidream 1024x1024 (+128 text)": geometry_case(
            "hidream", "hidream", "pe_embedder", "comfy.ldm.hidream.model", (64, 32, 32), 10000, flux_ids(64, 64, 128),
            (meta(1, 16, 128, 128), t, meta(1, 2048), meta(1, 128, 4096), meta(1, 32, 128, 4096)), {}),
        "hunyuan video 544x960 x 61 f": geometry_case(
            "hunyuan_video", "hunyuan video", "pe_embedder", "comfy.ldm.flux.layers", (16, 56, 56), 256, video_ids(16, 34, 60, 256),
            (meta(1, 16, 16, 68, 120), t, meta(1, 256, 4096), meta(1, 768)), {"guidance": t, "control": None}),
    }


def builder_cases():
    import comfy.ldm.cosmos.position_embedding as cosmos_pos
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi
    import comfy.ldm.hydit.models as hydit
    import comfy.ldm.lightricks.model as ltxv
    import comfy.ldm.omnigen.omnigen2 as omnigen2
    import comfy.ldm.wan.model as wan

    wan_model = rkharness.TINY.tiny_wan(0, dim=256, ffn_dim=256, num_heads=2).model.diffusion_model  # head dim 128
    cosmos_emb = cosmos_pos.VideoRopePosition3DEmb(head_dim=128, len_h=240, len_w=240, len_t=128,
                                                   h_extrapolation_ratio=3.0, w_extrapolation_ratio=3.0)
    ltxv_grid = video_ids(13, 16, 24, 0)[0].T.unsqueeze(0) * torch.tensor([8.0, 32.0, 32.0])[None, :, None]
    freqs = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(0))
    hydit_latent = torch.zeros(1, 4, 128, 128)
    # a module function up to ComfyUI 0.8, then a method of the LTX model (LTX-2 too)
    ltxv_freqs = (getattr(ltxv, "precompute_freqs_cis", None)
                  or families.tiny_ltxv(0).model.diffusion_model._precompute_freqs_cis)
    omnigen = omnigen2.OmniGen2RotaryPosEmbed(theta=10000, axes_dim=(40, 40, 40), axes_lens=(1024, 1664, 1664))
    return {
        ("args", "wan 832x480 x 81 f (rope_encode)"): lambda: wan.WanModel.rope_encode(
            wan_model, 21, 60, 104, device=torch.device("cpu"), dtype=torch.float32),
        ("args", "omnigen2 1024x1024 (+256 text)"): lambda: omnigen(
            1, 256, [256], [[0]], [4096], [None], [(128, 128)], torch.device("cpu")),
        ("args", "cosmos 1280x704 x 93 f"): lambda: cosmos_emb.generate_embeddings(torch.Size((1, 24, 44, 80, 2048))),
        ("args", "hunyuan dit 1024x1024"): lambda: hydit.calc_rope(hydit_latent, 2, 88),
        ("values", "ltxv 768x512 x 97 f"): fresh_inputs(
            lambda grid: ltxv_freqs(grid, dim=2048, out_dtype=torch.float32), ltxv_grid),
        # the positions are keyed by their arguments, the rotation by the positions' and weights' values
        ("values", "mochi 848x480 x 163 f"): lambda: mochi.compute_mixed_rotation(
            freqs=freqs, pos=mochi.create_position_matrix(28, pH=30, pW=53, device=torch.device("cpu"),
                                                          dtype=torch.float32)),
    }


def warm_hit(call):
    """``call`` through a warm cache that keeps stats, as a model's cache does (a hit counts itself)."""
    cache = pc.PECache(f"pe:bench#{next(_serial)}")

    def hit():
        with rope.scope(cache):
            return call()
    hit()  # warm: the first call is the one miss
    return hit, cache


_serial = itertools.count()


def time_realistic():
    """Rows (kind, label, miss s, hit s, by-value hit s or None, bytes held)."""
    rows = []
    for label, case in geometry_cases().items():
        hit, cache = warm_hit(case["geometry"])
        by_value, _ = warm_hit(case["by value"])
        miss, hit_t = side_by_side(case["miss"], hit, rounds=3, repeats=3)
        _, value_t = side_by_side(case["miss"], by_value, rounds=1, repeats=3)
        rows.append(("geometry", label, miss, hit_t, value_t, sum(cache.nbytes().values())))
    for (kind, label), call in builder_cases().items():
        hit, cache = warm_hit(call)
        miss, hit_t = side_by_side(call, hit, rounds=3, repeats=3)
        rows.append((kind, label, miss, hit_t, None, sum(cache.nbytes().values())))
    return rows


def host_reads_on_hit(model, call) -> tuple[int, int]:
    """(reads of tensor values by the pack, hits) in one cached forward after a warm one, every tensor
    taken as on a GPU (value keys off, as for device tensors)."""
    saved = rope.VALUE_KEYS_ON
    rope.VALUE_KEYS_ON = frozenset()
    try:
        call()
        stats = rope.model_cache(model.model).stats
        before = stats.counter("hits")
        with HostReads() as reads:
            call()
        return len(reads.pack()), stats.counter("hits") - before
    finally:
        rope.VALUE_KEYS_ON = saved


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
        reads, hits = host_reads_on_hit(model, cached)
        off, on = side_by_side(plain, cached, rounds=4, repeats=3)
        rows.append((name, off, on, reads, hits))
    return rows


def main():
    with torch.inference_mode():
        real = time_realistic()
        tiny = time_tiny()
    print(f"\nPE builder alone, realistic geometries (CPU, float32, {torch.get_num_threads()} threads): "
          "miss = the host's builder, hit = patched builder with a warm cache")
    print(f"{'key':8} {'geometry':38} {'miss ms':>9} {'hit us':>8} {'hit/miss':>9} {'by value us':>12} {'held':>8}")
    for kind, label, miss, hit, by_value, nbytes in real:
        value = f"{by_value * 1e6:12.1f}" if by_value is not None else f"{'':12}"
        print(f"{kind:8} {label:38} {miss * 1e3:9.2f} {hit * 1e6:8.1f} {hit / miss:9.4f} {value} "
              f"{nbytes / 2**20:6.1f}Mi")
    print("\nTiny test models, one apply_model forward (ms): without / with the PE cache; the pack's reads of "
          "tensor values on a hit (each a device-to-host copy on a GPU)")
    print(f"{'family':18} {'off ms':>8} {'on ms':>8} {'on/off':>8} {'hits':>5} {'reads':>6}")
    for name, off, on, reads, hits in tiny:
        print(f"{name:18} {off * 1e3:8.2f} {on * 1e3:8.2f} {on / off:8.3f} {hits:5d} {reads:6d}")
    worst = max(hit / miss for kind, _, miss, hit, _, _ in real if kind != "values")
    copies = sum(reads for *_, reads, _ in tiny)
    print(f"RESULT pe_hit_over_miss={worst:.4f} pe_hit_host_copies={copies} families={len(COVERED)}")


if __name__ == "__main__":
    main()
