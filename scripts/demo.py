"""`make demo`: the no-download demo workflow through a real ComfyUI server, with ReuseKit and without.

    .venv/bin/python scripts/demo.py [--out DIR]      (COMFYUI_PATH picks the host; default the bundled one)

Starts ``main.py --cpu --cache-none`` headless with the pack, runs "ReuseKit demo (no downloads)"
three ways: without ReuseKit (global conditioning off, a prompt without the ReuseKit nodes), with
only the exact layers (conditioning, PE cache, graph capture) and with every layer (plus TeaCache).
Prints a table per layer: encoder and transformer calls, wall time (the faster of two runs each) and how the outputs differ
(bit-identical for the exact layers, the final latent's error for TeaCache), and writes each
picture without / with ReuseKit side by side into the folder it names.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = "ReuseKit demo (no downloads).json"
EXACT_LAYERS = ("ReuseKitPECache", "ReuseKitGraphCapture")  # never change a result
APPROXIMATE = ("ReuseKitTeaCache",)
REPORTS = ("ReuseKitCacheStats",)
SAVE_LATENT = "90"


def _harness():
    sys.path.insert(0, str(ROOT / "tests"))
    import rkharness

    rkharness.bootstrap()
    return rkharness


def without(prompt: dict, class_types) -> dict:
    """``prompt`` without nodes of ``class_types``: each consumer of a removed node takes that node's
    first linked input instead (a MODEL node passes its model through); output nodes are dropped."""
    removed = {nid: node for nid, node in prompt.items() if node["class_type"] in class_types}

    def through(link):
        while isinstance(link, list) and link[0] in removed:
            link = next(v for v in removed[link[0]]["inputs"].values() if isinstance(v, list))
        return link

    return {nid: {**node, "inputs": {k: through(v) for k, v in node["inputs"].items()}}
            for nid, node in prompt.items() if nid not in removed}


def variants(rk, workflow: dict) -> dict[str, dict]:
    """The demo as three prompts, each saving its final latents: off, exact (no TeaCache), full."""
    full = rk.workflow_to_prompt(workflow)
    sampler = next(nid for nid, n in full.items() if n["class_type"] == "KSampler")
    out = {}
    for name, drop in (("off", {*EXACT_LAYERS, *APPROXIMATE, *REPORTS}), ("exact", set(APPROXIMATE)),
                       ("full", set())):
        prompt = without(full, drop)
        prompt[SAVE_LATENT] = {"class_type": "SaveLatent",
                               "inputs": {"samples": [sampler, 0], "filename_prefix": f"latents/demo_{name}"}}
        out[name] = prompt
    return out


def counters(snapshot: dict) -> dict:
    """Each cache's counters by name (``pe`` has one cache per model, dropped with it)."""
    return {cache["name"]: (cache["kind"], cache["counters"]) for cache in snapshot["caches"]}


def changes(before: dict, after: dict) -> dict:
    """What a run counted, summed by cache kind: ``"pe.hits"`` etc. (caches gone since are left out)."""
    out: dict[str, int] = {}
    for name, (kind, now) in after.items():
        then = before.get(name, (kind, {}))[1]
        for counter, n in now.items():
            key = f"{kind}.{counter}"
            out[key] = out.get(key, 0) + n - then.get(counter, 0)
    return out


def run(server, name: str, prompt: dict) -> dict:
    """Queue one variant on a cleared cache; its counters (deltas), wall time, latents and pictures."""
    import torch
    from safetensors.torch import load_file

    server.post("/reusekit/settings", {"conditioning.enabled": name != "off"})
    server.post("/reusekit/clear", {"all": True})
    before = counters(server.get("/reusekit/stats"))
    start = time.monotonic()
    history = server.wait_for_prompt(server.queue(prompt))
    wall = time.monotonic() - start
    if history["status"].get("status_str") != "success":
        raise RuntimeError(f"the demo ({name}) failed: {history['status']}\n{server.log_text()[-3000:]}")
    stats = server.get("/reusekit/stats")
    after = counters(stats)
    outputs = history["outputs"]
    latents = [load_file(str(server.base / "output" / f["subfolder"] / f["filename"]))["latent_tensor"]
               for f in outputs[SAVE_LATENT]["latents"]]
    images = [server.base / "output" / f["subfolder"] / f["filename"]
              for node in outputs.values() for f in node.get("images", [])]
    graph = next((c["info"] for c in stats["caches"] if c["kind"] == "graph"), {})
    return {"name": name, "wall_s": wall, "latents": torch.stack([t.float() for t in latents]),
            "images": images, "graph": graph,
            "counts": changes(before, after)}


def compare(results: dict) -> dict:
    """How the outputs differ from the run without ReuseKit."""
    off = results["off"]["latents"]
    exact = results["exact"]["latents"]
    full = results["full"]["latents"]
    errors = [float((f - o).norm() / o.norm()) for f, o in zip(full, off, strict=True)]
    return {"exact_identical": bool(exact.shape == off.shape and (exact == off).all()),
            "teacache_errors": errors}


def table(results: dict, diff: dict) -> str:
    off, exact, full = (results[k]["counts"] for k in ("off", "exact", "full"))
    same = "bit-identical" if diff["exact_identical"] else "DIFFERENT (a bug)"
    err = diff["teacache_errors"]
    rows = [
        ("layer", "without ReuseKit", "with ReuseKit", "output vs without"),
        ("conditioning cache", f"{off.get('demo.encoder_calls', 0)} encoder calls",
         f"{full.get('demo.encoder_calls', 0)} ({full.get('conditioning.hits', 0)} hits)", same),
        ("PE cache", f"{exact.get('pe.hits', 0) + exact.get('pe.misses', 0)} RoPE builds",
         f"{exact.get('pe.misses', 0)} ({exact.get('pe.hits', 0)} hits)", same),
        ("graph capture", "-", results["full"]["graph"].get("backend", "?"), same),
        ("TeaCache 0.4", f"{off.get('demo.transformer_calls', 0)} transformer calls",
         f"{full.get('demo.transformer_calls', 0)} ({full.get('step.calls_skipped', 0)} skipped)",
         f"final latent error {100 * sum(err) / len(err):.1f}% (max {100 * max(err):.1f}%)"),
        ("wall time", f"{results['off']['wall_s']:.2f} s",
         f"{results['full']['wall_s']:.2f} s (exact layers only: {results['exact']['wall_s']:.2f} s)", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def side_by_side(results: dict, out: Path) -> list[Path]:
    """Each picture without ReuseKit (left) and with it (right), one file per prompt."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (a, b) in enumerate(zip(results["off"]["images"], results["full"]["images"], strict=True)):
        left, right = Image.open(a).convert("RGB"), Image.open(b).convert("RGB")
        pair = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), "white")
        pair.paste(left, (0, 0))
        pair.paste(right, (left.width + 8, 0))
        written.append(out / f"demo_{i + 1}_without_vs_with.png")
        pair.save(written[-1])
    return written


def run_demo(rk, server) -> tuple[dict, dict]:
    import json

    prompts = variants(rk, json.loads((ROOT / "workflows" / DEMO).read_text()))
    run(server, "full", prompts["full"])  # warm-up: imports, first calls
    results = {}
    for _ in range(2):  # each variant twice, interleaved: the faster run of each (a shared CPU is noisy)
        for name in ("off", "exact", "full"):
            result = run(server, name, prompts[name])
            if name not in results or result["wall_s"] < results[name]["wall_s"]:
                results[name] = result
    server.post("/reusekit/settings", {"conditioning.enabled": True})
    return results, compare(results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "test-artifacts" / "demo"), help="where the pictures go")
    args = ap.parse_args()
    rk = _harness()
    print(f"ReuseKit demo: starting ComfyUI ({rk.host_dir()}) headless on the CPU ...", flush=True)
    with rk.running_server("--cache-none") as server:
        results, diff = run_demo(rk, server)
        written = side_by_side(results, Path(args.out))  # the server's output folder goes with it
    print(table(results, diff))
    print(f"pictures, without ReuseKit (left) and with it (right): {Path(args.out).resolve()} "
          f"({len(written)} files)")
    return 0 if diff["exact_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
