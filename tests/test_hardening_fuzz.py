"""Hardening through the real server: a seeded fuzz of 200 prompts with every cache on against the
same prompts on a second server with the pack's caches off (bit for bit), interrupts and a failing
node mid-run, and the panel's routes hammered from threads while prompts run."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
import rkharness
import torch

pytestmark = pytest.mark.hardening

WORDS = ["red", "fox", "snow", "pine", "forest", "a", "blue", "square", "(bright:1.3)", "night", "river",
         "tiny", "castle", "[old]", "sunset", "cat", "embedding", "glass", "storm", "moss"]
NEGATIVES = ["", "blurry", "low quality, blurry", "(watermark:1.2)", "text"]
LORAS = {"rk_fuzz_a.safetensors": 11, "rk_fuzz_b.safetensors": 12}
IMAGES = ("rk_fuzz_0.png", "rk_fuzz_1.png", "rk_fuzz_2.png")
FUZZ_PROMPTS = 200


def _write_lora(path: Path, seed: int) -> None:
    """A LoRA for the tiny CLIP's attention and the tiny Flux's first image qkv (see tinymodels)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            base = f"text_encoders.clip_l.transformer.text_model.encoder.layers.{layer}.self_attn.{proj}"
            sd[f"{base}.lora_up.weight"] = torch.randn(32, 4, generator=gen) * 0.1
            sd[f"{base}.lora_down.weight"] = torch.randn(4, 32, generator=gen) * 0.1
    base = "diffusion_model.double_blocks.0.img_attn.qkv"
    sd[f"{base}.lora_up.weight"] = torch.randn(192, 4, generator=gen) * 0.1
    sd[f"{base}.lora_down.weight"] = torch.randn(4, 64, generator=gen) * 0.1
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def _write_image(path: Path, seed: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def _provision(server) -> None:
    """LoRA files and input images in the server's own model and input folders."""
    for name, seed in LORAS.items():
        _write_lora(server.base / "models" / "loras" / name, seed)
    for i, name in enumerate(IMAGES):
        _write_image(server.base / "input" / name, seed=i, size=(64, 64, 48)[i])


@contextlib.contextmanager
def server_with(**env: str):
    """A real server started with ``env`` added to its environment (one torch thread: tiny models on a
    shared CPU run ~10x faster without thread contention)."""
    env = {"OMP_NUM_THREADS": "1", **env}
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        context = rkharness.running_server()
        server = context.__enter__()
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    try:
        _provision(server)
        yield server
    finally:
        context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def servers():
    """(on, off): a server with every ReuseKit cache on, and one with global mode off
    (REUSEKIT_CONDITIONING=0) whose prompts use no ReuseKit node."""
    with server_with() as on, server_with(REUSEKIT_CONDITIONING="0") as off:
        yield on, off


def fuzz_case(rng: random.Random) -> dict:
    """One random workflow description (kept small: 2-3 steps at 64 px or less)."""
    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))

    return {"positive": text(), "negative": rng.choice(NEGATIVES), "seed": rng.choice([0, 1, 7, rng.randrange(1 << 40)]),
            "steps": rng.choice([2, 3]), "cfg": rng.choice([1.0, 3.5]),
            "lora": rng.choice([None, *LORAS]), "strength_model": rng.choice([0.0, 0.5, 1.0, -0.7]),
            "strength_clip": rng.choice([0.0, 0.5, 1.0, 1.5]),
            "image": rng.choice([None, None, *IMAGES]), "denoise": rng.choice([0.6, 1.0]),
            "size": rng.choice([(64, 64), (32, 48)]),
            "pe": rng.random() < 0.5, "tea": rng.random() < 0.5, "tea_device": rng.choice(["device", "cpu"]),
            "tea_mode": rng.choice(["extrapolate", "reuse"]), "settings": rng.random() < 0.05}


def build_prompt(case: dict, reusekit: bool, tag: str) -> dict:
    """The API prompt of ``case``; with ``reusekit`` the PE Cache / TeaCache nodes the case asks for."""
    p = {"1": {"class_type": "RKTestSharedTinyCheckpoint", "inputs": {"family": "flux", "seed": 0, "text": "tiny"}}}
    model, clip = ["1", 0], ["1", 1]
    if case["lora"]:
        p["2"] = {"class_type": "LoraLoader", "inputs": {"model": model, "clip": clip, "lora_name": case["lora"],
                                                          "strength_model": case["strength_model"],
                                                          "strength_clip": case["strength_clip"]}}
        model, clip = ["2", 0], ["2", 1]
    if reusekit and case["pe"]:
        p["3"] = {"class_type": "ReuseKitPECache", "inputs": {"model": model, "enabled": True}}
        model = ["3", 0]
    if reusekit and case["tea"]:
        p["4"] = {"class_type": "ReuseKitTeaCache",
                  "inputs": {"model": model, "rule": "auto", "threshold": 0.0, "model_type": "auto", "start_percent": 0.0,
                             "end_percent": 1.0, "max_consecutive_skips": 0, "cache_device": case["tea_device"],
                             "residual_mode": case["tea_mode"]}}
        model = ["4", 0]
    p["5"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": case["positive"]}}
    p["6"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": case["negative"]}}
    if case["image"]:
        p["10"] = {"class_type": "LoadImage", "inputs": {"image": case["image"]}}
        p["7"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["1", 2]}}
    else:
        w, h = case["size"]
        p["7"] = {"class_type": "EmptyLatentImage", "inputs": {"width": w, "height": h, "batch_size": 1}}
    p["8"] = {"class_type": "KSampler",
              "inputs": {"model": model, "seed": case["seed"], "steps": case["steps"], "cfg": case["cfg"],
                         "sampler_name": "euler", "scheduler": "simple", "positive": ["5", 0],
                         "negative": ["6", 0], "latent_image": ["7", 0],
                         "denoise": case["denoise"] if case["image"] else 1.0}}
    p["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": f"rk/{tag}"}}
    return p


def run_all(server, prompts: list[dict], timeout: float = 600) -> list[torch.Tensor]:
    """Queue every prompt at once, then collect each saved latent in order."""
    ids = [server.queue(p) for p in prompts]
    deadline = time.monotonic() + timeout
    return [server.saved_latent(server.wait_for_prompt(i, timeout=max(1.0, deadline - time.monotonic())), "9")
            for i in ids]


def test_seeded_fuzz_matches_the_uncached_server_bit_for_bit(servers):
    """200 random prompts (texts, negatives, seeds, LoRA strengths, VAE-encoded images, PE cache,
    TeaCache at threshold 0, cfg 1 and above): every latent equals the caches-off server's."""
    on, off = servers
    rng = random.Random(20261130)
    cases = [fuzz_case(rng) for _ in range(FUZZ_PROMPTS)]
    quarter = len(cases) // 5  # each feature in a good share of the prompts
    assert sum(c["lora"] is not None for c in cases) > quarter and sum(c["image"] is not None for c in cases) > quarter
    assert sum(c["pe"] for c in cases) > quarter and sum(c["tea"] for c in cases) > quarter
    got = run_all(on, [build_prompt(c, True, f"on{i:03d}") for i, c in enumerate(cases)])
    want = run_all(off, [build_prompt(c, False, f"off{i:03d}") for i, c in enumerate(cases)])
    mismatches = [(i, cases[i]) for i, (a, b) in enumerate(zip(got, want))
                  if a.shape != b.shape or not torch.equal(a, b)]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, first: {mismatches[:3]}"
    caches = {c["name"]: c for c in on.get("/reusekit/stats")["caches"]}
    assert caches["conditioning"]["counters"].get("hits", 0) > 0, caches["conditioning"]
    assert any(c["kind"] == "pe" and c["counters"].get("hits", 0) > 0 for c in caches.values()), caches
    tea = caches["teacache"]["counters"]
    assert tea["calls_computed"] > 0 and tea["calls_skipped"] == 0, tea  # threshold 0 computes every step


def test_a_worker_editing_its_encoder_in_place_never_hands_an_edit_to_another(tmp_path):
    """Two workers with every cache on share one disk tier; between prompts a node on worker A edits its
    encoder in place, often where the cheap check samples nothing (a head, one value). Worker B encodes
    each text right after A, from a clean load of the same file. Every output of A equals the pack-off
    server's under the same edits, every output of B equals its clean encoder's (never A's edited one),
    and B hit the disk tier for the texts A encoded before its first edit (but the first, encoded while
    A hashed the file in the background)."""
    from importlib import import_module

    from safetensors.torch import load_file

    files = import_module(rkharness.TINY.__name__ + ".conditioning")
    path = files.write_tiny_clip_file(str(tmp_path), 0, files.CLIP_HEADS)
    clean_path = str(tmp_path / "clean_copy.safetensors")
    Path(clean_path).write_bytes(Path(path).read_bytes())
    rng = random.Random(20261203)
    rounds = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))),
               None if i < 6 or rng.random() < 0.3 else rng.choice(["head", "sparse", "head", "dense"]))
              for i in range(18)]
    assert sum(edit in ("head", "sparse") for _, edit in rounds) >= 4

    def prompt(clip_path, text, edit, out):
        p = {"1": {"class_type": "RKTestFileCLIP", "inputs": {"path": clip_path, "heads": True}}}
        clip = ["1", 0]
        if edit:
            p["2"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": f"before {out}"}}
            p["3"] = {"class_type": "RKTestEditEncoder", "inputs": {"clip": clip, "what": edit, "text": text,
                                                                    "after": ["2", 0]}}
            clip = ["3", 0]
        p["4"] = {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": text}}
        p["5"] = {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["4", 0], "path": out}}
        return p

    def run(server, p):
        entry = server.wait_for_prompt(server.queue(p))
        assert entry["status"]["status_str"] == "success", (entry["status"], server.log_text()[-3000:])
        server.wait_published()

    disk = {"REUSEKIT_DISK_CACHE": str(tmp_path / "disk")}
    with server_with(**disk) as a, server_with(**disk) as b, server_with(REUSEKIT_CONDITIONING="0") as off:
        for i, (text, edit) in enumerate(rounds):
            run(a, prompt(path, text, edit, str(tmp_path / f"a{i}.st")))
            run(b, prompt(path, text, None, str(tmp_path / f"b{i}.st")))
            run(off, prompt(path, text, edit, str(tmp_path / f"off_a{i}.st")))
            run(off, prompt(clean_path, text, None, str(tmp_path / f"off_b{i}.st")))
        b_disk = {c["name"]: c for c in b.get("/reusekit/stats")["caches"]}["conditioning_disk"]["counters"]
        a_reasons = {c["name"]: c for c in a.get("/reusekit/stats")["caches"]}["conditioning"]["reasons"]

    def same(x, y):
        x, y = load_file(x), load_file(y)
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    wrong_a = [i for i in range(len(rounds)) if not same(tmp_path / f"a{i}.st", tmp_path / f"off_a{i}.st")]
    wrong_b = [i for i in range(len(rounds)) if not same(tmp_path / f"b{i}.st", tmp_path / f"off_b{i}.st")]
    assert not wrong_a and not wrong_b, (wrong_a, wrong_b, rounds)
    first_edit = next(i for i, (_, edit) in enumerate(rounds) if edit)
    edited = [i for i in range(first_edit, len(rounds)) if not same(tmp_path / f"a{i}.st", tmp_path / f"b{i}.st")]
    assert edited, "A's edits changed none of its outputs: the test edits nothing"
    hashing = sum(r["count"] for r in a_reasons if "being hashed" in r["reason"])  # A's first (50 MB file)
    assert hashing <= 1 and b_disk.get("hits", 0) >= len({t for t, _ in rounds[:first_edit]}) - hashing, b_disk
    assert any(r["event"] == "not shared" for r in a_reasons), a_reasons


def _wait_running(server, prompt_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(item[1] == prompt_id for item in server.get("/queue")["queue_running"]):
            return
        time.sleep(0.05)
    raise TimeoutError(f"prompt {prompt_id} never started")


def test_an_interrupted_run_leaves_nothing_behind(servers):
    """ComfyUI's interrupt (POST /interrupt) in the middle of a long TeaCache + PE cache sampling:
    the prompt ends interrupted, the server keeps running, and the next run on the same cached model
    equals a clean run on the caches-off server."""
    on, off = servers
    case = fuzz_case(random.Random(5)) | {"lora": "rk_fuzz_a.safetensors", "pe": True, "tea": True,
                                          "image": None, "size": (64, 64), "cfg": 3.5, "steps": 3}
    long_run = build_prompt(case | {"steps": 2000}, True, "interrupted")
    for _ in range(2):  # a second interrupt right after the first finds no stale state either
        prompt_id = on.queue(long_run)
        _wait_running(on, prompt_id)
        time.sleep(0.5)
        on.post("/interrupt", {})
        entry = on.wait_for_prompt(prompt_id)
        assert entry["status"]["status_str"] == "error", entry["status"]
        messages = [m[0] for m in entry["status"]["messages"]]
        assert "execution_interrupted" in messages, messages
        long_run["8"]["inputs"]["seed"] += 1  # not answered from ComfyUI's cache the second time
    (got,) = run_all(on, [build_prompt(case, True, "after_interrupt")])
    (want,) = run_all(off, [build_prompt(case, False, "clean")])
    assert torch.equal(got, want)


def test_routes_from_threads_while_prompts_run(servers):
    """Stats, settings and clear from four threads while 24 prompts run: every answer is a 200, nothing
    deadlocks, and every latent equals the caches-off server's."""
    on, off = servers
    rng = random.Random(77)
    cases = [fuzz_case(rng) for _ in range(24)]
    before = on.get("/reusekit/settings")["settings"]
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def hammer(worker: int) -> None:
        calls = [lambda: on.get("/reusekit/stats"),
                 lambda: on.get("/reusekit/settings"),
                 lambda: on.post("/reusekit/settings", {"conditioning.budget_mib": rng.choice([1, 8, 512])}),
                 lambda: on.post("/reusekit/settings", {"conditioning.enabled": rng.random() < 0.7}),
                 lambda: on.post("/reusekit/clear", {"all": True}),
                 lambda: on.post("/reusekit/clear", {"cache": "conditioning"})]
        n = 0
        while not stop.is_set():
            try:
                calls[(worker + n) % len(calls)]()
                answered[0] += 1
            except Exception as exc:  # an HTTP error status raises too
                errors.append(f"{type(exc).__name__}: {exc}")
            n += 1
            time.sleep(0.01)

    threads = [threading.Thread(target=hammer, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    try:
        got = run_all(on, [build_prompt(c, True, f"busy{i:02d}") for i, c in enumerate(cases)], timeout=300)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        on.post("/reusekit/settings", {k: before[k]["value"] for k in
                                       ("conditioning.budget_mib", "conditioning.enabled")})
    assert not any(t.is_alive() for t in threads), "a route call never returned"
    assert not errors, errors[:5]
    assert answered[0] >= 24, answered  # the routes really ran beside the prompts
    want = run_all(off, [build_prompt(c, False, f"quiet{i:02d}") for i, c in enumerate(cases)], timeout=300)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_soak_of_300_encode_prompts_under_a_small_budget(servers):
    """300 prompts of text and VAE encodes on the real server under a 1 MiB budget: after every 50 the
    conditioning cache holds no more than the budget, evictions are counted, and the server's RSS
    grows by less than 48 MiB from prompt 100 to prompt 300."""
    import psutil

    on, _ = servers
    before = on.get("/reusekit/settings")["settings"]
    on.post("/reusekit/settings", {"conditioning.enabled": True, "conditioning.budget_mib": 1})
    rng = random.Random(300)
    process = psutil.Process(on.proc.pid)
    rss = {}
    try:
        for batch in range(6):
            ids = []
            for _ in range(50):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))
                prompt = {"1": {"class_type": "RKTestSharedTinyCheckpoint",
                                "inputs": {"family": "flux", "seed": 0, "text": "tiny"}},
                          "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": text}},
                          "3": {"class_type": "LoadImage", "inputs": {"image": rng.choice(IMAGES)}},
                          "4": {"class_type": "ImageScaleBy", "inputs": {"image": ["3", 0], "upscale_method": "nearest-exact",
                                                                          "scale_by": rng.choice([0.5, 1.0, 1.5])}},
                          "5": {"class_type": "VAEEncode", "inputs": {"pixels": ["4", 0], "vae": ["1", 2]}},
                          "6": {"class_type": "ConditioningSetTimestepRange",
                                "inputs": {"conditioning": ["2", 0], "start": 0.0, "end": rng.random()}},
                          "7": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["6", 0]}},
                          "8": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["5", 0]}}}
                ids.append(on.queue(prompt))
            entry = on.wait_for_prompt(ids[-1], timeout=300)
            assert entry["status"]["status_str"] == "success", entry["status"]
            (conditioning,) = [c for c in on.get("/reusekit/stats")["caches"] if c["name"] == "conditioning"]
            held = sum(conditioning["bytes"].values())
            assert held <= 1 << 20, (batch, conditioning["bytes"])
            if batch in (1, 5):
                rss[batch] = process.memory_info().rss
        assert conditioning["counters"].get("evictions", 0) > 50, conditioning["counters"]
        assert rss[5] - rss[1] < 48 << 20, f"server RSS grew by {(rss[5] - rss[1]) >> 20} MiB"
    finally:
        on.post("/reusekit/settings", {k: before[k]["value"] for k in ("conditioning.budget_mib", "conditioning.enabled")})
