"""Conditioning cache benchmark: hit vs miss per kind under each value of
``conditioning.check_weight_edits`` (a CLIP-L-size and a 4x larger text encoder, a Flux-size VAE, a
tiny CLIP vision, ComfyUI's Z-Image Qwen3-4B encoder at its real width with 4 of its layers, and its
Qwen-Image Qwen2.5-VL encoder with an image in the prompt (its vision tower at real width, 4 of 32 layers); weights as ComfyUI's loaders
leave them: inference tensors), whether every text encoder this host's loaders build hits (built at a
test size, ``encoder_types_hit``; VAE and CLIP-vision classes, ``vae_types_hit``, ``vision_types_hit``), hits after ComfyUI
unloads and reloads an encoder, full fingerprints in a Prompt Batch of 16; then five workflow
scenarios through the real executor in each ComfyUI cache mode, with and without ReuseKit, counting
encoder forwards, and their wall time on a CLIP-L-size encoder (three passes, each scenario without and
then with ReuseKit; the total's ratio and the worst pass's); then the shared tiers: a whole
disk-tier and Redis hit (an entry another process wrote) against an encode (in rounds: the median
round's ratio and the worst round's, ``*_worst``), the delay from a miss to its entry on the disk tier
(``publish_delay_s``: its publication check runs in the background), and two ComfyUI server
processes sharing them (Redis rows need Debian's redis-server); then a lazy text encoder (a 1.39 GB
CLIP-G file; --quick: a 246 MB CLIP-L) on a restarted server against ComfyUI's CLIPLoader, and a lazy
Qwen2.5-VL-class encoder answering an image prompt it saw before (weight bytes read: ``lazy_*weight_bytes_read``).

    .venv/bin/python bench/conditioning.py [--quick]
    .venv/bin/python bench/conditioning.py --encoder-types   # only vae_types_hit and vision_types_hit

Ratios are measured side by side in this one run. The last line is the RESULT line.
The scenario definitions are also used by tests/test_conditioning_workflows.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEGATIVE = "blurry, low quality, watermark"
MODES = ("classic", "lru", "none")


# ---- scenarios (API-format prompts) ----------------------------------------------------------

def prompt(positives, negative=NEGATIVE, seed=1, lora=None, text="tiny", size=64, steps=2):
    """A tiny Flux text-to-image prompt. ``positives``: one text, or several combined."""
    positives = [positives] if isinstance(positives, str) else list(positives)
    clip = ["10", 1] if lora else ["1", 1]
    model = ["10", 0] if lora else ["1", 0]
    p = {"1": {"class_type": "RKTestSharedTinyCheckpoint", "inputs": {"family": "flux", "seed": 0, "text": text}},
         "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": negative}},
         "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}}}
    if lora:
        name, strength_model = lora
        p["10"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": name,
                                                          "strength_model": strength_model, "strength_clip": 1.0}}
    positive = None
    for i, text_i in enumerate(positives):
        node = str(20 + i)
        p[node] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": text_i}}
        if positive is None:
            positive = [node, 0]
        else:
            p[f"c{i}"] = {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": positive,
                                                                          "conditioning_2": [node, 0]}}
            positive = [f"c{i}", 0]
    p["5"] = {"class_type": "KSampler", "inputs": {"model": model, "positive": positive, "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "seed": seed, "steps": steps, "cfg": 2.0,
                                                   "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    p["7"] = {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["5", 0]}}
    return p


def scenarios(lora_name: str, text: str = "tiny") -> dict[str, tuple[int, list[dict]]]:
    """name -> (ideal encoder forward calls, prompts run in order on one executor)."""
    kw = {"text": text}
    return {
        "a. same workflow, new seed": (2, [prompt("a red square", seed=1, **kw), prompt("a red square", seed=2, **kw)]),
        "b. A, B, A, fixed negative": (3, [prompt("a red square", **kw), prompt("a blue circle", **kw),
                                           prompt("a red square", **kw)]),
        "c. shared negative, 2 workflows": (5, [prompt("a red square", **kw),
                                                prompt("a green tree", negative="dark", **kw),
                                                prompt("a yellow star", size=96, steps=1, **kw)]),
        "d. LoraLoader, strength_model only": (2, [prompt("a red square", lora=(lora_name, s), **kw)
                                                   for s in (1.0, 0.5, 0.25)]),
        "e. same text in two nodes": (2, [prompt(["a red square", "a red square"], **kw)]),
    }


@contextlib.contextmanager
def counting_encoder_forwards():
    """Counts real text-encoder forward calls: each runs ComfyUI's CLIP transformer (``CLIPEncoder``)
    once, which asks ``comfy.clip_model.optimized_attention_for_device`` once; counted there. (A function
    set on an encoder's class from this package would make ReuseKit refuse the encoder, one set on its
    modules would change their key.)"""
    import comfy.clip_model

    calls = [0]
    original = comfy.clip_model.optimized_attention_for_device

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    comfy.clip_model.optimized_attention_for_device = counted
    try:
        yield calls
    finally:
        comfy.clip_model.optimized_attention_for_device = original


def run_scenario(rkharness, prompts, mode: str, reusekit: bool) -> tuple[int, float]:
    """Encoder forward calls and wall seconds for ``prompts`` on a fresh executor."""
    from_pack = rkharness.pack
    settings = from_pack("caching.settings").SETTINGS
    cache = from_pack("caching.conditioning").CACHE
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", reusekit)
    cache.clear()
    try:
        executor = rkharness.Executor(cache=mode)
        with counting_encoder_forwards() as calls:
            start = time.perf_counter()
            for p in prompts:
                executor.run(p)
            seconds = time.perf_counter() - start
        return calls[0], seconds
    finally:
        settings.set("conditioning.enabled", before)
        cache.clear()


# ---- hit vs miss per kind -----------------------------------------------------------------------

def _median_time(fn, repeat, warmup=0):
    """The median of ``repeat`` timed calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rounds(parts, rounds):
    """Side by side: in each of ``rounds`` rounds, each of ``parts`` (name -> (prepare, fn, timed,
    warmup)) in turn: ``prepare()`` untimed, ``warmup`` untimed calls, then the median of ``timed``
    calls. Returns name -> the per-round medians. A ratio is taken within a round, between timings a
    second apart: this VM's speed drifts by up to 2x over seconds, more than separate medians absorb."""
    out = {name: [] for name in parts}
    for _ in range(rounds):
        for name, (prepare, fn, timed, warmup) in parts.items():
            prepare()
            out[name].append(_median_time(fn, timed, warmup))
    return out


def _ratio_by_round(num, den):
    """The median and the worst (highest) of the per-round ratios ``num[i] / den[i]``."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios), max(ratios)


WORKLOAD_PASSES = 3  # passes of the five-scenario wall-time workload (--quick: 1)
MODES_OF_CHECKS = ("events", "every_encode", "off")  # conditioning.check_weight_edits
BIG_CLIP = {"hidden_size": 1536, "intermediate_size": 6144, "num_attention_heads": 24,
            "num_hidden_layers": 12, "projection_dim": 768}  # CLIP-L's depth at twice its width: 4x its weights
TEXT = "a photograph of an astronaut riding a (horse:1.2) on the moon, detailed"
QWEN3_4B_WIDTH = {"hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "num_hidden_layers": 4}  # Qwen3-4B's width and heads, 4 of its 36 layers
# Qwen2.5-VL's vision tower at its real width and heads, 4 of its 32 layers (its LLM at the tests' width: the miss
# is understated, the ratio conservative)
QWEN25_VL_TOWER = {"hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "num_layers": 4}


def encoder_types_hit(rkharness) -> tuple[int, int]:
    """(hit, built): the text encoders this host's loaders build (tests/tinymodels/text_encoders.py), each
    built at a test size and encoded twice: a hit bit-identical to the pack being off counts."""
    te = __import__(f"{rkharness.TINY.__name__}.text_encoders", fromlist=["hit_status"])
    states = [te.hit_status(t) for t in te.loader_targets().values()]
    built = [s for s in states if not s.startswith("not built")]
    print(f"\n== text encoders of this host's loaders: {built.count('hit')} of {len(built)} built hit "
          f"({len(states) - len(built)} not built here) ==")
    return built.count("hit"), len(built)


def vae_vision_types_hit(rkharness) -> dict[str, tuple[int, int]]:
    """{"vae": (hit, built), "vision": (hit, built)}: the VAE classes this host's VAE loaders build and the
    CLIP-vision models its loader picks (tests/tinymodels/vaes.py), each built at a test size and encoded
    twice: a hit bit-identical to the pack being off counts; one not built or not encodable here is left out.
    VAEs count by the class ComfyUI builds (several files' kinds build one class: it hits when each does);
    CLIP-vision models by their config."""
    vaes = __import__(f"{rkharness.TINY.__name__}.vaes", fromlist=["hit_status"])
    out = {}
    made = {name: label for name, (label, _) in vaes.vae_classes().items()}
    for kind, names in (("vae", list(made)), ("vision", vaes.vision_classes())):
        states = {name: vaes.hit_status(kind, name) for name in names}
        built = {name: s for name, s in states.items() if not s.startswith(("not built", "not encodable", "no encode"))}
        groups: dict[str, list[str]] = {}
        for name, state in built.items():
            groups.setdefault(made[name] if kind == "vae" else name, []).append(state)
        hits = sum(all(s == "hit" for s in group) for group in groups.values())
        print(f"\n== {kind} {'classes' if kind == 'vae' else 'models'} of this host's loaders: {hits} of "
              f"{len(groups)} built hit ({len(built)} kinds of file built, {len(states) - len(built)} not built "
              f"or not encodable here) ==")
        for name, state in states.items():
            print(f"{name:28} {state}" + (f"   [{made[name]}]" if kind == "vae" else ""))
        out[kind] = (hits, len(groups))
    return out


def _weights(module) -> tuple[int, int]:
    """(tensors, bytes) of a module's weights."""
    tensors = [*module.parameters(), *module.buffers()]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _inference(module) -> bool:
    return all(t.is_inference() for t in module.parameters())


def kind_table(rkharness, quick: bool):
    """Hit against miss per kind under each value of ``conditioning.check_weight_edits``, with weights
    as ComfyUI's loaders leave them (inference tensors, built and loaded under inference mode)."""
    import torch

    tiny = rkharness.TINY
    files = __import__(f"{tiny.__name__}.conditioning", fromlist=["clip_l_sized"])
    cache = rkharness.pack("caching.conditioning").CACHE
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.enabled", True)
    repeat = 3 if quick else 7
    rows = []

    clip = files.clip_l_sized(0)
    big = files.clip_l_sized(1, BIG_CLIP)
    for name, encoder in (("text (CLIP-L size, 77 tokens)", clip), ("text (4x CLIP-L weights)", big)):
        tokens = encoder.tokenize(TEXT)
        rows.append((name, encoder.cond_stage_model,
                     lambda e=encoder, t=tokens: (cache.clear(), e.encode_from_tokens(t, return_pooled=True)),
                     lambda e=encoder, t=tokens: e.encode_from_tokens(t, return_pooled=True)))

    size = 256 if quick else 512
    vae = tiny.tiny_vae(0, ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2)
    image = torch.rand(1, size, size, 3, generator=torch.Generator().manual_seed(0))
    rows.append((f"VAE encode (Flux-size VAE, {size}x{size})", vae.first_stage_model,
                 lambda: (cache.clear(), vae.encode(image)), lambda: vae.encode(image)))

    vision = tiny.tiny_clip_vision(0)
    small = image[:, :224, :224]
    rows.append(("CLIP vision (tiny ViT)", vision.model,
                 lambda: (cache.clear(), vision.encode_image(small)), lambda: vision.encode_image(small)))

    # LLM encoders through ComfyUI's own classes: Z-Image's Qwen3-4B at its real width and heads (a few of
    # its 36 layers), and Qwen-Image's Qwen2.5-VL 7B class (test width) with an image in the prompt
    te = __import__(f"{tiny.__name__}.text_encoders", fromlist=["build"])
    targets = {t.name: t for t in te.loader_targets().values()}
    with te.tiny_sizes(llm=QWEN3_4B_WIDTH):
        qwen3 = te.build_sized(targets["z_image.ZImageTEModel_"], 0)
    tokens = qwen3.tokenize(TEXT)
    rows.append((f"LLM text (Qwen3-4B width, {QWEN3_4B_WIDTH['num_hidden_layers']} layers)", qwen3.cond_stage_model,
                 lambda: (cache.clear(), qwen3.encode_from_tokens(tokens)), lambda: qwen3.encode_from_tokens(tokens)))
    with te.tiny_sizes(vision=QWEN25_VL_TOWER):
        qwen_vl = te.build_sized(targets["qwen_image.QwenImageTEModel_"], 0)
    picture = image[:, :384, :384]  # TextEncodeQwenImageEdit(Plus) scales the vision input to 384x384 pixels
    vl_tokens = qwen_vl.tokenize("make the sky green", images=[picture])
    rows.append((f"LLM text+image (Qwen2.5-VL, {QWEN25_VL_TOWER['num_layers']}/32 ViT)", qwen_vl.cond_stage_model,
                 lambda: (cache.clear(), qwen_vl.encode_from_tokens(vl_tokens)), lambda: qwen_vl.encode_from_tokens(vl_tokens)))

    results = {}
    print(f"{'kind':38} {'tensors':>7} {'MiB':>7} {'inference':>9} {'miss ms':>9}"
          + "".join(f" {m + ' hit ms':>18} {'/miss':>7}" for m in MODES_OF_CHECKS))
    try:
        for name, module, miss, hit in rows:
            miss()  # warm up
            t_miss = _median_time(miss, repeat)
            line = (f"{name:38} {_weights(module)[0]:7d} {_weights(module)[1] / 2**20:7.0f} "
                    f"{str(_inference(module)):>9} {t_miss * 1e3:9.1f}")
            for mode in MODES_OF_CHECKS:
                settings.set("conditioning.check_weight_edits", mode)  # empties the cache
                miss()
                t_hit = _median_time(hit, repeat * 5)
                results[(name, mode)] = (t_hit, t_hit / t_miss)
                line += f" {t_hit * 1e3:18.3f} {t_hit / t_miss:7.4f}"
            print(line)
        # the 4x encoder's hit against CLIP-L's (default setting), side by side in rounds
        settings.set("conditioning.check_weight_edits", "events")
        small, big = rows[0][3], rows[1][3]
        times = _rounds({"small": (small, small, 5, repeat), "big": (big, big, 5, repeat)}, repeat)
        results["big_over_small"] = _ratio_by_round(times["big"], times["small"])
        print(f"4x CLIP-L hit / CLIP-L hit, {repeat} rounds side by side: {results['big_over_small'][0]:.2f} "
              f"(worst round {results['big_over_small'][1]:.2f})")
    finally:
        settings.set("conditioning.check_weight_edits", "events")
        cache.clear()
    return results


def depth_table(rkharness, rounds: int = 7) -> dict[str, tuple[float, float]]:
    """A text hit's cost against its encoder's size: CLIP-L, at twice its width (4x the weights, the same
    tensors) and at 4x its depth (4x the weights and the tensors), side by side in rounds, with the weight
    checks as set by default (``events``) and off. Returns "<encoder> <mode>" -> (median, worst) of its hit
    over CLIP-L's in the same mode."""
    files = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["clip_l_sized"])
    cache = rkharness.pack("caching.conditioning").CACHE
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.enabled", True)
    encoders = {"CLIP-L": files.clip_l_sized(0), "4x wide": files.clip_l_sized(1, BIG_CLIP),
                "4x deep": files.clip_l_sized(2, files.CLIP_L | {"num_hidden_layers": 48})}
    tokens = {name: clip.tokenize(TEXT) for name, clip in encoders.items()}
    print(f"{'encoder':10} {'tensors':>7} {'MiB':>7}")
    for name, clip in encoders.items():
        count, size = _weights(clip.cond_stage_model)
        print(f"{name:10} {count:7d} {size / 2**20:7.0f}")
    out = {}
    try:
        for mode in ("events", "off"):
            settings.set("conditioning.check_weight_edits", mode)  # empties the cache
            hits = {}
            for name, clip in encoders.items():
                clip.encode_from_tokens(tokens[name], return_pooled=True)  # the miss

                def hit(c=clip, t=tokens[name]):
                    return c.encode_from_tokens(t, return_pooled=True)
                hits[name] = (lambda: None, hit, 9, 3)
            times = _rounds(hits, rounds)
            for name in ("4x wide", "4x deep"):
                out[f"{name} {mode}"] = _ratio_by_round(times[name], times["CLIP-L"])
                print(f"{mode:6} {name} hit / CLIP-L hit, {rounds} rounds side by side: "
                      f"{out[f'{name} {mode}'][0]:.2f} (worst round {out[f'{name} {mode}'][1]:.2f}); CLIP-L hit "
                      f"{statistics.median(times['CLIP-L']) * 1e3:.2f} ms")
    finally:
        settings.set("conditioning.check_weight_edits", "events")
        cache.clear()
    return out


def offload_table(rkharness, quick: bool) -> tuple[int, int]:
    """A CLIP-L-size encoder ComfyUI unloads and loads back through its ModelPatcher between prompts:
    hits over repeats. On a machine without a GPU the encoder's load and offload devices are both the
    CPU, so the weights are also copied to new storage each time (what a move to another device and
    back makes: new addresses, the same bytes)."""
    import comfy.model_management
    import torch

    files = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["clip_l_sized"])
    cache = rkharness.pack("caching.conditioning").CACHE
    clip = files.clip_l_sized(2)
    tokens = clip.tokenize(TEXT)
    first = clip.encode_from_tokens(tokens, return_pooled=True)
    repeats, hits = (2 if quick else 4), 0
    for _ in range(repeats):
        comfy.model_management.unload_all_models()
        if clip.patcher.load_device == clip.patcher.offload_device:
            with torch.inference_mode():
                clip.cond_stage_model._apply(lambda t: t.clone())
        comfy.model_management.load_models_gpu([clip.patcher])
        before = cache.count("hits.text")
        again = clip.encode_from_tokens(tokens, return_pooled=True)
        hits += cache.count("hits.text") - before
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True)), "an offload changed an encode"
    print(f"\n== offload: {hits}/{repeats} encodes after ComfyUI unloaded and reloaded the encoder were hits ==")
    cache.clear()
    return hits, repeats


def batch_table(rkharness) -> dict[str, int]:
    """A LoRA'd CLIP-L-size encoder that ComfyUI unloaded (its patches removed: an event), then a
    ReuseKit Prompt Batch of 16 prompts through the real executor: full fingerprints per setting."""
    import comfy.model_management
    import comfy.sd
    import comfy.utils

    files = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["clip_l_sized"])
    weights = rkharness.pack("patches.encoder_weights")
    settings = rkharness.pack("caching.settings").SETTINGS
    lora = comfy.utils.load_torch_file(os.path.join(files.lora_dir(), files.write_lora(
        "rk_bench_batch.safetensors", seed=5, width=768, flux=False)))
    prompts = "\n".join(f"a photograph of object number {i}, detailed" for i in range(16))
    out = {}
    try:
        for mode in ("events", "every_encode"):
            settings.set("conditioning.check_weight_edits", mode)
            _, clip = comfy.sd.load_lora_for_models(None, files.clip_l_sized(3), lora, 0.0, 1.0)
            clip.encode_from_tokens(clip.tokenize("warm up"))
            comfy.model_management.unload_all_models()
            name = f"rk_bench_batch_{mode}"
            files._FILE_CLIPS[name] = clip
            before = weights.checks(clip.cond_stage_model)[0]
            rkharness.Executor().run({
                "1": {"class_type": "RKTestFileCLIP", "inputs": {"path": name}},
                "2": {"class_type": "ReuseKitPromptBatch", "inputs": {"prompts": prompts, "negative": ""}},
                "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": ["2", 0]}},
                "4": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["3", 0]}}})
            out[mode] = weights.checks(clip.cond_stage_model)[0] - before
            del files._FILE_CLIPS[name]
    finally:
        settings.set("conditioning.check_weight_edits", "events")
    print(f"\n== a Prompt Batch of 16 prompts after an unload of a LoRA'd encoder: full fingerprints "
          f"events {out['events']}, every_encode {out['every_encode']} ==")
    return out


def sampler_side_table(rkharness):
    """What a sampler's encode_model_conds (extra_conds per family) costs per run."""
    import comfy.samplers
    import torch

    tiny = rkharness.TINY
    clip = tiny.tiny_clip(0)
    (cond,) = __import__("nodes").CLIPTextEncode().encode(clip, "a red square")
    print(f"\n{'family':10} {'encode_model_conds ms':>22}")
    out = {}
    for family, shape in (("flux", (1, 16, 8, 8)), ("wan", (1, 16, 3, 8, 8))):
        patcher = tiny.BUILDERS[family](0)
        model = patcher.model
        noise = torch.zeros(shape)
        conds = [{"cross_attn": c[0], "model_conds": {}, **{k: v for k, v in c[1].items()}} for c in cond]

        def run(model=model, conds=conds, noise=noise):
            comfy.samplers.encode_model_conds(model.extra_conds, [dict(c) for c in conds], noise, "cpu", "positive",
                                              latent_image=noise, denoise_mask=None, seed=0)

        run()
        t = _median_time(run, 20)
        out[family] = t
        print(f"{family:10} {t * 1e3:22.3f}")
    return out


# ---- the shared tiers ---------------------------------------------------------------------------

@contextlib.contextmanager
def redis_server(rkharness):
    """A redis-server on a free loopback port (None where Debian's redis-server or the client is missing)."""
    exe = shutil.which("redis-server")
    try:
        import redis
    except ImportError:
        redis = None
    if exe is None or redis is None:
        yield None
        return
    port = rkharness.free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    client = redis.Redis(port=port)
    try:
        for _ in range(400):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _use_tiers(settings, folder, url):
    settings.update({"conditioning.disk.enabled": folder is not None, "conditioning.disk.folder": str(folder or ""),
                     "conditioning.redis.enabled": url is not None, "conditioning.redis.url": url or ""},
                    trusted=True)


def shared_table(rkharness, quick: bool, url):
    """A whole shared-tier hit (the LRU emptied first, so the entry comes from the tier; the default
    setting) against an encode of a CLIP-L-sized encoder loaded from a file by ComfyUI's CLIPLoader
    path, side by side in 9 rounds (--quick: 3): per round one encode with the tiers off after an
    untimed one, then the median of 5 whole hits after 7 untimed (--quick: 3); the ratio is the median
    of the rounds' ratios, printed beside the worst round's. Then the tiers' own read + verify + copy
    of a CLIP-L-size (1x77x768) and a T5-size (1x512x4096) output, each timed after 7 untimed runs of
    it. Untimed runs first, as in a server's steady state: CPython specialises a function's code after
    its first calls, and on this VM the first hits after a reconfiguration or an encode run slower."""
    import comfy.sd
    import torch
    from safetensors.torch import save_file

    tiny = rkharness.TINY
    cache = rkharness.pack("caching.conditioning").CACHE
    tiers = rkharness.pack("caching.tiers")
    settings = rkharness.pack("caching.settings").SETTINGS
    files = __import__(f"{tiny.__name__}.conditioning", fromlist=["clip_l_sized"])
    thaw = rkharness.pack("caching.conditioning").thaw
    weights = rkharness.pack("patches.encoder_weights")
    work = Path(tempfile.mkdtemp(prefix="rk_bench_tiers_"))
    repeat = 3 if quick else 7
    rounds = 3 if quick else 9
    try:
        model = files.clip_l_sized(0).cond_stage_model.clip_l.transformer
        path = str(work / "clip_l.safetensors")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
        del model
        # a file hashed within SETTLE_NS of its last change is hashed again once that window has passed
        # (a downloaded file, once); waiting it out here keeps that one re-read out of the timed hits
        time.sleep(tiers.TIERS.hashes.SETTLE_NS / 1e9 + 0.1)
        clip = comfy.sd.load_clip([path], model_options={"dtype": torch.float32})
        tiers.TIERS.hashes.wait(300)
        tokens = clip.tokenize(TEXT)
        settings.set("conditioning.enabled", True)

        def encode():
            cache.clear()
            clip.encode_from_tokens(tokens, return_pooled=True)

        ratios = {}
        t5 = ("L", [("T", torch.randn(1, 512, 4096), torch.device("cpu"))])
        cl = ("L", [("T", torch.randn(1, 77, 768), torch.device("cpu"))])
        header = False
        for tier, (folder, tier_url) in (("disk", (work / "disk", None)), ("redis", (None, url))):
            if tier == "redis" and url is None:
                print(f"{tier:8} (no redis-server or redis client here)")
                ratios[tier] = ratios[f"{tier}_worst"] = float("nan")
                continue

            def tiers_on(folder=folder, tier_url=tier_url):
                _use_tiers(settings, folder, tier_url)
                encode()  # written through in the first round (once its publication check passed), a hit after
                weights.wait_published(300)
                if tiers.TIERS.redis is not None:
                    tiers.TIERS.redis.flush()

            hits_before = tiers.TIERS.stats[tier].counter("hits")
            # a round: an encode with the tiers off (the miss), then whole hits from the tier (the LRU
            # emptied before each, so every one comes from the tier)
            times = _rounds({"miss": (lambda: _use_tiers(settings, None, None), encode, 1, 1),
                             "hit": (tiers_on, encode, 5, repeat)}, rounds)
            assert tiers.TIERS.stats[tier].counter("hits") > hits_before, f"no {tier} hits"
            ratio, worst = _ratio_by_round(times["hit"], times["miss"])
            ratios[tier], ratios[f"{tier}_worst"] = ratio, worst
            t_miss, t_hit = statistics.median(times["miss"]), statistics.median(times["hit"])
            if not header:
                print(f"\n== shared tiers: an entry another process wrote vs an encode (CLIP-L-size miss "
                      f"{t_miss * 1e3:.1f} ms; {rounds} rounds side by side) ==")
                print(f"{'tier':8} {'output':22} {'tier read+verify+copy ms':>25} {'/ CLIP-L miss':>14} "
                      f"{'whole hit ms':>13} {'/ miss':>8} {'worst round':>12}")
                header = True
            for label, stored in (("CLIP-L (1x77x768)", cl), ("T5 (1x512x4096)", t5)):
                key = tiers.SharedKey(("bench", tier, label))
                tiers.TIERS.put(key, stored, 1.0, {})
                if tiers.TIERS.redis is not None:
                    tiers.TIERS.redis.flush()
                t_tier = _median_time(lambda key=key: thaw(tiers.TIERS.get(key, {})[0]), repeat * 3, warmup=repeat)
                whole = f"{t_hit * 1e3:13.2f} {ratio:8.4f} {worst:12.4f}" if label.startswith("CLIP") else ""
                print(f"{tier:8} {label:22} {t_tier * 1e3:25.2f} {t_tier / t_miss:14.4f} {whole}")
            _use_tiers(settings, None, None)
        (ratios["publish_delay_s"], ratios["publish_delay_worst_s"],
         ratios["miss_overhead"]) = publish_delay(rkharness, clip, work / "disk", rounds)
        return ratios
    finally:
        _use_tiers(settings, None, None)
        cache.clear()
        shutil.rmtree(work, ignore_errors=True)


def publish_delay(rkharness, clip, folder: Path, rounds: int) -> tuple[float, float, float]:
    """Seconds from a miss's encode returning to its entry being on the disk tier, readable by a second
    worker (its publication check: a full fingerprint of the encoder on a background thread, then the
    write); median and worst over ``rounds`` new prompts, the CLIP-L-size encoder of :func:`shared_table`.
    Beside it, in the same rounds, a miss with the disk tier on against one with the tiers off (new
    prompts both): what a miss costs more, the previous publication done first."""
    settings = rkharness.pack("caching.settings").SETTINGS
    weights = rkharness.pack("patches.encoder_weights")
    delays, on, off = [], [], []
    try:
        for i in range(rounds):
            _use_tiers(settings, None, None)
            start = time.perf_counter()
            clip.encode_from_tokens(clip.tokenize(f"{TEXT} unshared {i}"), return_pooled=True)
            off.append(time.perf_counter() - start)
            _use_tiers(settings, folder, None)
            before = set(folder.rglob("*.rkcond"))
            start = time.perf_counter()
            clip.encode_from_tokens(clip.tokenize(f"{TEXT} number {i}"), return_pooled=True)
            on.append(time.perf_counter() - start)
            start = time.perf_counter()
            while not set(folder.rglob("*.rkcond")) - before:
                if time.perf_counter() - start > 60:
                    raise TimeoutError("a miss was never published")
                time.sleep(0.002)
            delays.append(time.perf_counter() - start)
            weights.wait_published(60)
    finally:
        _use_tiers(settings, None, None)
    overhead = _ratio_by_round(on, off)[0] - 1
    print(f"publication: a miss's entry on the disk tier {statistics.median(delays) * 1e3:.0f} ms after its encode "
          f"(median of {rounds}; worst {max(delays) * 1e3:.0f} ms); a miss with the disk tier on "
          f"{statistics.median(on) * 1e3:.1f} ms against {statistics.median(off) * 1e3:.1f} ms with it off "
          f"({overhead * 100:+.1f}%)")
    return statistics.median(delays), max(delays), overhead


def two_workers(rkharness, url, quick: bool) -> dict[str, int]:
    """Two ComfyUI server processes run the same prompts (a shared negative, several positives) with
    one shared tier; encoder calls of each, from its /reusekit/stats."""
    files = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["write_tiny_clip_file"])
    work = Path(tempfile.mkdtemp(prefix="rk_bench_workers_"))
    texts = [NEGATIVE, "a red square", "a blue circle", "a green tree", "a yellow star", "a red square"]
    texts = texts[:3] if quick else texts
    clip_path = files.write_tiny_clip_file(str(work), 0)
    setups = {"disk": {"REUSEKIT_DISK_CACHE": str(work / "disk")}}
    if url is not None:
        setups["redis"] = {"REUSEKIT_REDIS_URL": url}
    out = {}
    print(f"\n== two workers (ComfyUI server processes), {len(texts)} encodes each, one shared tier ==")
    try:
        for tier, env in setups.items():
            counts = []
            for worker in (1, 2):
                with rkharness.running_server(env=env) as server:
                    for i, text in enumerate(texts):
                        prompt = {"1": {"class_type": "RKTestFileCLIP", "inputs": {"path": clip_path}},
                                  "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
                                  "3": {"class_type": "RKTestSaveConditioning",
                                        "inputs": {"conditioning": ["2", 0], "path": str(work / f"{tier}{worker}_{i}.st")}}}
                        server.wait_for_prompt(server.queue(prompt))
                    server.wait_published()
                    (stats,) = [c for c in server.get("/reusekit/stats")["caches"] if c["name"] == "conditioning"]
                    counts.append(stats["counters"].get("encodes", 0))
                    if tier == "redis":
                        time.sleep(1.0)  # the write-through is asynchronous
            out[tier] = counts[1]
            print(f"{tier:8} worker 1 encodes {counts[0]}   worker 2 encodes {counts[1]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _random_encoder_file(path: Path, big: bool) -> int:
    """A text-encoder file ComfyUI's CLIPLoader detects: CLIP-G (SDXL's, 694M parameters, fp16: 1.39 GB) or,
    with ``big`` false, CLIP-L (123M, 246 MB); seeded random weights. Returns its size."""
    import comfy.sd1_clip
    import comfy.sdxl_clip
    import torch
    from safetensors.torch import save_file

    make = comfy.sdxl_clip.SDXLClipG if big else comfy.sd1_clip.SDClipModel
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in make(device="meta", dtype=torch.float16).transformer.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    sd = {}
    for name, (shape, dtype) in shapes.items():
        if not dtype.is_floating_point:
            sd[name] = torch.arange(shape[-1], dtype=dtype).expand(shape).contiguous()
        elif len(shape) == 1 and "norm" in name and name.endswith("weight"):
            sd[name] = torch.ones(shape, dtype=torch.float16)
        else:
            sd[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.float16)
    save_file(sd, str(path))
    return path.stat().st_size


def _prompt_seconds(server, prompt) -> float:
    """From the start of a prompt's execution to its end, by ComfyUI's own timestamps (ms)."""
    history = server.wait_for_prompt(server.queue(prompt), timeout=1800)
    assert history["status"]["status_str"] == "success", (history["status"], server.log_text()[-3000:])
    stamps = {event: data["timestamp"] for event, data in history["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000


def lazy_table(rkharness, quick: bool) -> dict:
    """The time from prompt to conditioning on a restarted server for a text encoder of at least 1 GB
    (CLIP-G fp16, 1.39 GB; --quick: CLIP-L, 246 MB), three real ComfyUI server processes sharing a disk
    tier and a user directory: A loads it with ComfyUI's CLIPLoader and encodes (the entry is written);
    B, restarted, runs ReuseKit Lazy CLIP Loader on the same prompt (a disk hit: the weights are never
    read); C, restarted, loads with CLIPLoader again and hits the disk tier. The file's hash is in the
    memo (an earlier run hashed it). The file was just written: the page cache is warm, so the eager
    loads here are as fast as they get (a cold disk makes them slower). Bytes read from the file by B:
    its header (the lazy encoders' header_read_bytes) and any hashing (none)."""
    import torch
    from safetensors.torch import load_file

    hashes_mod = rkharness.pack("caching.file_hashes")
    work = Path(tempfile.mkdtemp(prefix="rk_bench_lazy_"))
    try:
        (work / "user").mkdir()
        clip_file = work / ("rk_clip_l_bench.safetensors" if quick else "rk_clip_g_bench.safetensors")
        size = _random_encoder_file(clip_file, big=not quick)
        time.sleep(2.1)  # settled: the memo takes it
        memo = hashes_mod.FileHashes(inline_bytes=1 << 62)
        memo.memo = str(work / "user" / "reusekit" / "file_hashes.json")
        assert memo.get(str(clip_file)) is not None and Path(memo.memo).is_file()
        env = {"REUSEKIT_DISK_CACHE": str(work / "disk")}
        args = ("--user-directory", str(work / "user"))
        text = "a lighthouse on a cliff at dusk, oil painting, warm light"

        def prompt(loader, out, probe=None):
            p = {"1": {"class_type": loader, "inputs": {"clip_name": clip_file.name, "type": "stable_diffusion"}},
                 "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
                 "3": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "path": str(out)}}}
            if probe:  # queued after the timed prompt: ComfyUI's cache answers the loader and the encode
                p["4"] = {"class_type": "RKTestLazyProbe", "inputs": {"clip": ["1", 0], "after": ["2", 0],
                                                                       "path": str(clip_file), "out": str(probe)}}
            return p

        def on(server):
            folder = server.base / "models" / "text_encoders"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / clip_file.name).symlink_to(clip_file)
            return server

        runs = {}
        for name, loader in (("eager", "CLIPLoader"), ("lazy", "ReuseKitLazyCLIPLoader"), ("eager_hit", "CLIPLoader")):
            with rkharness.running_server(*args, env=env) as server:
                on(server)
                probe = work / f"{name}.json" if name == "lazy" else None
                seconds = _prompt_seconds(server, prompt(loader, work / f"{name}.st"))
                server.wait_published(300)  # the entry passes its publication check before the server stops
                stats = {c["name"]: c for c in server.get("/reusekit/stats")["caches"]}
                if probe:
                    _prompt_seconds(server, prompt(loader, work / f"{name}.st", probe))
                runs[name] = (seconds, stats, json.loads(probe.read_text()) if probe else None)
        lazy_stats, lazy_probe = runs["lazy"][1], runs["lazy"][2]
        counters = lazy_stats["conditioning_lazy"]["counters"]
        assert counters["weights_loaded"] == 0 and counters["encodes_without_weights"] == 1, counters
        assert lazy_probe["pending"] and not lazy_probe["mapped"] and lazy_probe["hashed_bytes"] == 0, lazy_probe
        same = [load_file(work / f"{n}.st") for n in ("eager", "lazy", "eager_hit")]
        assert all(torch.equal(same[0][k], other[k]) for other in same[1:] for k in same[0]), "outputs differ"
        read = counters["header_read_bytes"] + lazy_probe["hashed_bytes"]
        label = "CLIP-G fp16" if not quick else "CLIP-L fp16 (--quick)"
        print(f"\n== a restarted server, prompt to conditioning, {label}, {size / 2**30:.2f} GiB file ==")
        print(f"{'run':44} {'seconds':>8}")
        print(f"{'A  CLIPLoader: load + encode':44} {runs['eager'][0]:8.2f}")
        print(f"{'B  Lazy CLIP Loader: disk hit, no weights':44} {runs['lazy'][0]:8.2f}")
        print(f"{'C  CLIPLoader: load + disk hit':44} {runs['eager_hit'][0]:8.2f}")
        print(f"B read {read} bytes of the file (its header), stored {lazy_probe['stored_bytes']} bytes of weights; "
              f"outputs bit-identical")
        return {"bytes_read": read, "weight_bytes_read": lazy_probe["stored_weight_bytes"], "lazy_s": runs["lazy"][0], "eager_s": runs["eager"][0],
                "eager_hit_s": runs["eager_hit"][0], "file_gib": size / 2**30}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def lazy_llm_row(rkharness) -> int:
    """Weight bytes a lazy LLM encoder holds after answering a prompt seen before, in this process: Qwen-Image's
    Qwen2.5-VL 7B (ComfyUI's classes at a test width, with its vision tower) as a file CLIPLoader's qwen_image
    type detects; ComfyUI's eager load writes the disk-tier entry, the lazy load answers an image prompt."""
    import torch

    te = __import__(f"{rkharness.TINY.__name__}.text_encoders", fromlist=["write_qwen25_7b"])
    files = __import__(f"{rkharness.TINY.__name__}.lazy_clip", fromlist=["load"])
    settings = rkharness.pack("caching.settings").SETTINGS
    tiers = rkharness.pack("caching.tiers").TIERS
    cache = rkharness.pack("caching.conditioning").CACHE
    work = Path(tempfile.mkdtemp(prefix="rk_bench_lazy_llm_"))
    keys = ("conditioning.disk.enabled", "conditioning.disk.folder", "conditioning.redis.enabled")
    saved = {k: settings.get(k) for k in keys}
    try:
        settings.update({"conditioning.disk.enabled": True, "conditioning.disk.folder": str(work / "disk"),
                         "conditioning.redis.enabled": False}, trusted=True)
        picture = torch.rand(1, 56, 56, 3, generator=torch.Generator().manual_seed(2))
        with te.tiny_sizes(llm=te.QWEN25_7B_FILE):
            path = te.write_qwen25_7b(str(work / "qwen_2.5_vl_7b.safetensors"))
            time.sleep(2.1)  # settled: hashed once
            tiers.hashes.get(path)
            tiers.hashes.wait()
            eager = files.load(path, lazy=False, clip_type="qwen_image")
            ref = eager.encode_from_tokens(eager.tokenize("make the sky green", images=[picture]))
            assert rkharness.pack("patches.encoder_weights").wait_published(300)
            cache.clear()
            lazy = files.load(path, clip_type="qwen_image")
            out = lazy.encode_from_tokens(lazy.tokenize("make the sky green", images=[picture]))
            probe = files.probe(lazy, path)
        assert torch.equal(out, ref) and probe["pending"], probe
        print(f"\n== a lazy Qwen2.5-VL 7B-class encoder (test width), image prompt seen before: "
              f"{probe['stored_weight_bytes']} weight bytes read of a {os.path.getsize(path) / 2**20:.0f} MiB file; "
              f"bit-identical ==")
        return probe["stored_weight_bytes"]
    finally:
        settings.update(saved, trusted=True)
        tiers.configure(settings)
        cache.clear()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    quick = "--quick" in sys.argv
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    import rkharness

    rkharness.bootstrap()
    rkharness.load_extra_nodes()  # the loaders of every text-encoder type (QuadrupleCLIPLoader...)
    import torch

    if "--encoder-types" in sys.argv:  # only the per-class rows (a minute, where the whole run takes twelve)
        with torch.inference_mode():
            types = vae_vision_types_hit(rkharness)
        print(f"RESULT vae_types_hit={types['vae'][0]}/{types['vae'][1]} "
              f"vision_types_hit={types['vision'][0]}/{types['vision'][1]}")
        return
    if "--depth" in sys.argv:  # only the hit's cost against its encoder's width and depth (a few minutes)
        with torch.inference_mode():
            depth = depth_table(rkharness)
        print(f"RESULT deep_hit_over_small_hit={depth['4x deep events'][0]:.2f} "
              f"deep_hit_over_small_hit_worst={depth['4x deep events'][1]:.2f} "
              f"wide_hit_over_small_hit={depth['4x wide events'][0]:.2f} "
              f"unchecked_deep_hit_over_small_hit={depth['4x deep off'][0]:.2f}")
        return

    loras = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["write_lora"])
    with torch.inference_mode():
        print("== hit vs miss, per kind and check_weight_edits (median of repeats) ==")
        ratios = kind_table(rkharness, quick)
        offload = offload_table(rkharness, quick)
        batch = batch_table(rkharness)
        sampler_side_table(rkharness)
        types_hit = encoder_types_hit(rkharness)
        types = vae_vision_types_hit(rkharness)

        lora_name = loras.write_lora("rk_bench_tiny.safetensors", seed=3, width=32)
        table = scenarios(lora_name, text="tiny")
        print("\n== scenarios through the real executor (tiny text encoder): encoder forward calls ==")
        print(f"{'scenario':36} {'ideal':>5}" + "".join(f" {m:>8} {m + '+RK':>9}" for m in MODES))
        totals = {(m, rk): 0 for m in MODES for rk in (False, True)}
        at_ideal = 0
        for name, (ideal, prompts) in table.items():
            row = f"{name:36} {ideal:5d}"
            for mode in MODES:
                for rk in (False, True):
                    calls, _ = run_scenario(rkharness, prompts, mode, rk)
                    totals[(mode, rk)] += calls
                    row += f" {calls:8d}" if not rk else f" {calls:9d}"
                    at_ideal += int(rk and calls == ideal)
            print(row)
        print(f"{'total':36} {sum(i for i, _ in table.values()):5d}"
              + "".join(f" {totals[(m, False)]:8d} {totals[(m, True)]:9d}" for m in MODES))

        # wall time on a CLIP-L-sized encoder (float32 on this CPU), ComfyUI's default cache mode
        text = "tiny" if quick else "clip_l"
        big = scenarios(loras.write_lora("rk_bench_clip_l.safetensors", seed=3, width=768 if text == "clip_l" else 32),
                        text=text)
        run_scenario(rkharness, big["a. same workflow, new seed"][1][:1], "classic", False)  # load + warm up
        # passes of the five scenarios, each scenario without and then with ReuseKit; the encoder stays
        # loaded, as in a ComfyUI session, so its one full fingerprint (first sight) falls in pass 1
        wall = {False: 0.0, True: 0.0}
        calls = {False: 0, True: 0}
        passes = []
        print(f"\n== the five scenarios, wall time, {text} text encoder, classic cache ==")
        for n_pass in range(1 if quick else WORKLOAD_PASSES):
            this = {False: 0.0, True: 0.0}
            for _, prompts in big.values():
                for rk in (False, True):
                    c, seconds = run_scenario(rkharness, prompts, "classic", rk)
                    this[rk] += seconds
                    calls[rk] += c
            passes.append(this[False] / this[True])
            for rk in (False, True):
                wall[rk] += this[rk]
            print(f"pass {n_pass + 1}: classic {this[False]:.2f} s   classic+ReuseKit {this[True]:.2f} s   "
                  f"speedup {passes[-1]:.2f}x")
        print(f"all passes: classic {wall[False]:.2f} s ({calls[False]} encodes)   classic+ReuseKit {wall[True]:.2f} s "
              f"({calls[True]} encodes)   speedup {wall[False] / wall[True]:.2f}x (worst pass {min(passes):.2f}x)")

        with redis_server(rkharness) as url:
            shared = shared_table(rkharness, quick, url)
            workers = two_workers(rkharness, url, quick)
        lazy = lazy_table(rkharness, quick)
        lazy_llm = lazy_llm_row(rkharness)

    n = len(table) * len(MODES)
    speedup, worst = wall[False] / wall[True], min(passes)

    def ratio(prefix, mode="events"):
        return next(v[1] for k, v in ratios.items() if isinstance(k, tuple) and k[0].startswith(prefix) and k[1] == mode)

    print(f"RESULT text_hit_over_miss={ratio('text (CLIP-L'):.4f} vae_hit_over_miss={ratio('VAE'):.4f} "
          f"workload_speedup={speedup:.2f} workload_speedup_worst={worst:.2f} scenarios_at_ideal={at_ideal}/{n} "
          f"big_hit_over_small_hit={ratios['big_over_small'][0]:.2f} offload_hits={offload[0]}/{offload[1]} "
          f"fingerprints_per_batch={batch['events']} "
          f"every_encode_text_hit_over_miss={ratio('text (CLIP-L', 'every_encode'):.4f} "
          f"unchecked_text_hit_over_miss={ratio('text (CLIP-L', 'off'):.4f} "
          f"unchecked_vae_hit_over_miss={ratio('VAE', 'off'):.4f} "
          f"disk_hit_over_miss={shared['disk']:.4f} redis_hit_over_miss={shared['redis']:.4f} "
          f"disk_hit_over_miss_worst={shared['disk_worst']:.4f} redis_hit_over_miss_worst={shared['redis_worst']:.4f} "
          f"second_worker_encodes={max(workers.values())} publish_delay_s={shared['publish_delay_s']:.3f} "
          f"publish_delay_worst_s={shared['publish_delay_worst_s']:.3f} shared_miss_overhead={shared['miss_overhead']:.3f} "
          f"lazy_hit_bytes_read={lazy['bytes_read']} lazy_hit_s={lazy['lazy_s']:.2f} "
          f"eager_load_encode_s={lazy['eager_s']:.2f} lazy_hit_over_eager={lazy['lazy_s'] / lazy['eager_s']:.4f} "
          f"lazy_file_gib={lazy['file_gib']:.2f} "
          f"llm_text_hit_over_miss={ratio('LLM text ('):.4f} llm_image_prompt_hit_over_miss={ratio('LLM text+image'):.4f} "
          f"encoder_types_hit={types_hit[0]}/{types_hit[1]} vae_types_hit={types['vae'][0]}/{types['vae'][1]} "
          f"vision_types_hit={types['vision'][0]}/{types['vision'][1]} lazy_weight_bytes_read={lazy['weight_bytes_read']} "
          f"lazy_llm_weight_bytes_read={lazy_llm}")


if __name__ == "__main__":
    main()
