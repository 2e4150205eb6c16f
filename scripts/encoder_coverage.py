"""The conditioning cache's encoder coverage tables (text, VAE, vision), generated from a host (never kept by hand).

    COMFYUI_PATH=.host/ComfyUI-0.33.0 .venv-0.33/bin/python scripts/encoder_coverage.py --host 0.33 --write
    .venv/bin/python scripts/encoder_coverage.py --host 0.3.75 --write

Asks the host's own loaders (CLIPLoader, DualCLIPLoader, TripleCLIPLoader, QuadrupleCLIPLoader) which
text encoder each of their types builds from files of each text-encoder model (tests/tinymodels/
text_encoders.py), builds each at a test size from the host's classes with its real tokenizers, and
encodes a prompt twice with the cache on: "hit" when the repeat is a hit bit-identical to the pack being
off; otherwise why it bypassed, or why it could not be built here. Then the same for every VAE class the
host's VAE loaders build and every CLIP-vision model its loader picks (tests/tinymodels/vaes.py). Prints the
tables; ``--write`` puts them into docs/conditioning.md between the markers for that host.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "conditioning.md"


def _harness():
    sys.path.insert(0, str(ROOT / "tests"))
    import rkharness

    rkharness.bootstrap()
    rkharness.load_extra_nodes()
    return rkharness


def table(harness, host: str) -> str:
    """One row per loader type: the encoders it builds from the model files tried, and how each fares."""
    te = importlib.import_module(f"{harness.TINY.__name__}.text_encoders")
    targets = list(te.loader_targets().values())
    states = {id(t): te.hit_status(t) for t in targets}
    by_type: dict[tuple[str, str], dict[str, set]] = {}
    for t in targets:
        for loader, clip_type, files in t.seen:
            by_type.setdefault((loader, clip_type), {}).setdefault(t.name, set()).add((states[id(t)], "+".join(files)))
    rows = []
    for loader in te.LOADERS:
        for clip_type in te.loader_types(loader):
            encoders = by_type.get((loader, clip_type), {})
            hits = sorted(name for name, found in encoders.items() if all(s == "hit" for s, _ in found))
            others = []
            for name, found in sorted(encoders.items()):
                for state in sorted({state for state, _ in found}):
                    if state != "hit":
                        others.append(f"`{name}`: {state}")
            rows.append((f"{loader} `{clip_type}`" if clip_type else loader,
                         ", ".join(f"`{n}`" for n in hits) or "none", "; ".join(sorted(set(others))) or "none"))
    built = [t for t in targets if not states[id(t)].startswith("not built")]
    hit = sum(states[id(t)] == "hit" for t in built)
    out = [f"ComfyUI {host}: {len(rows)} loader types; {len(targets)} distinct text encoders built by them from the "
           f"model files tried ({', '.join(sorted(te.probes()))}); {hit} of the {len(built)} built here hit.",
           "", "| loader type | encoders that hit | otherwise |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out + ["", *templates(te, host), *vae_vision(harness, host)])


def vae_vision(harness, host: str) -> list[str]:
    """One row per VAE and CLIP-vision model whose files the host's loaders detect (tests/tinymodels/vaes.py):
    the class ComfyUI builds, and how a repeat of its encode fares at a test size."""
    vaes = importlib.import_module(f"{harness.TINY.__name__}.vaes")
    out = []
    for kind, title, found in (("vae", "VAE", {n: c for n, (c, _) in vaes.vae_classes().items()}),
                               ("vision", "CLIP-vision", vaes.vision_classes())):
        rows = [(name, made, vaes.hit_status(kind, name)) for name, made in found.items()]
        built = [state for _, _, state in rows if not state.startswith(("not built", "not encodable"))]
        out += ["", f"ComfyUI {host}: {len(rows)} {title} models its loaders detect from the files tried; "
                f"{built.count('hit')} of the {len(built)} built and encodable here hit.",
                "", f"| {title} model | what ComfyUI builds | here |", "|---|---|---|"]
        out += [f"| {name} | `{made}` | {state} |" for name, made, state in rows]
    return out


def templates(te, host: str) -> list[str]:
    """Every text-encoder load in ComfyUI's own templates, as this host would run it."""
    coverage = te.template_coverage()
    if coverage is None:
        return ["(ComfyUI's templates are not unpacked beside this venv: `scripts/setup.sh --test` does it.)"]
    loads = sorted(coverage["loads"].items(), key=lambda kv: (-kv[1][0], kv[0]))
    total = sum(count for _, (count, _) in loads)
    tested = sum(count for _, (count, verdict) in loads if verdict.startswith("tested"))
    lacking = sum(count for _, (count, verdict) in loads if "has no" in verdict)
    out = [f"ComfyUI {host} on the {total} text-encoder loads in ComfyUI's templates (comfyui-workflow-templates-json "
           f"{coverage['version']}): {tested} build an encoder tested above; {lacking} use a loader or type this host "
           f"lacks; {total - tested - lacking} load a model not built here (why, beside it).",
           "", "| loader type | model files | loads | here |", "|---|---|---|---|"]
    for (loader, clip_type, names), (count, verdict) in loads:
        out.append(f"| {loader}{f' `{clip_type}`' if clip_type else ''} | {', '.join(names)} | {count} | {verdict} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True, help="the host's name in the table (0.3.75, 0.33)")
    parser.add_argument("--write", action="store_true", help="write it into docs/conditioning.md")
    args = parser.parse_args()
    text = table(_harness(), args.host)
    print(text)
    if args.write:
        begin, end = f"<!-- encoder-coverage {args.host} -->", f"<!-- /encoder-coverage {args.host} -->"
        doc = DOC.read_text()
        block = f"{begin}\n{text}\n{end}"
        if begin in doc:
            doc = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
        else:
            doc = doc.rstrip("\n") + f"\n\n{block}\n"
        DOC.write_text(doc)


if __name__ == "__main__":
    main()
