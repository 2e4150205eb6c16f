"""The pack installed the ways users install it, each into a fresh host's custom_nodes/: the Registry
archive (what ComfyUI-Manager and `comfy node install reusekit` unpack), built by the real `comfy node pack`
of comfy-cli (scripts/setup.sh --test puts it in .venv-tools/), and a `git clone`. Each starts a real
server that says every layer is on and runs the demo to saved pictures with cache hits.

Both are made from a snapshot of this working tree: a temporary git repository of its tracked files and
the untracked ones git does not ignore, committed. So uncommitted work is what gets tested, and
`comfy node pack` reads `git ls-files` there as it does on a publishing checkout.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import urllib.parse
import zipfile
from pathlib import Path

import pytest
import rkharness

pytestmark = pytest.mark.foundation

COMFY = rkharness.ROOT / ".venv-tools" / "bin" / "comfy"
DEMO_MODELS = {"nodes/demo_models/flux_shapes.safetensors", "nodes/demo_models/wan_shapes.safetensors"}


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def ships(name: str) -> bool:
    """Whether a file of the repository belongs in the archive: what the pack reads at run time, the
    README, licence and the docs with their pictures; the demo models are the only weights."""
    if name.endswith(".safetensors"):
        return name in DEMO_MODELS
    top = name.split("/")[0]
    return (name in ("__init__.py", "routes.py", "pyproject.toml", "README.md", "LICENSE")
            or top in ("caching", "nodes", "patches", "web", "workflows")
            or (top == "docs" and name.endswith((".md", ".png"))))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("install")


@pytest.fixture(scope="module")
def snapshot(workdir):
    """This working tree as a committed git repository (a tracked file deleted in the tree is left out)."""
    repo = workdir / "reusekit"
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=rkharness.ROOT)
    for name in filter(None, listed.split("\0")):
        source = rkharness.ROOT / name
        if source.is_file() or source.is_symlink():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name, follow_symlinks=False)
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("-c", "user.name=ReuseKit tests", "-c", "user.email=tests@reusekit.invalid", "commit", "-q", "-m",
        "the working tree", cwd=repo)
    return repo


@pytest.fixture(scope="module")
def archive(snapshot, workdir):
    """node.zip as `comfy node pack` builds it, in the snapshot as a developer's tree is after a run of the
    pack (a __pycache__ beside the demo models, ignored by git)."""
    if not COMFY.is_file():
        raise RuntimeError(f"no comfy-cli at {COMFY}: run scripts/setup.sh --test")
    stray = snapshot / "nodes" / "demo_models" / "__pycache__" / "shapes.cpython-311.pyc"
    stray.parent.mkdir()
    stray.write_bytes(b"")
    home = workdir / "home"  # comfy-cli writes its config there, not in the user's home
    home.mkdir()
    done = subprocess.run([str(COMFY), "node", "pack"], cwd=snapshot, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home), "DO_NOT_TRACK": "1"})
    assert done.returncode == 0 and "Created zip file: node.zip" in done.stdout, done.stdout + done.stderr
    return snapshot / "node.zip"


def test_the_registry_archive_holds_the_pack_its_demo_and_nothing_else(snapshot, archive):
    with zipfile.ZipFile(archive) as z:
        names = set(z.namelist())
    tracked = git("ls-files", cwd=snapshot).splitlines()
    wanted = {n for n in tracked if ships(n)}
    assert names == wanted, {"not wanted": sorted(names - wanted), "missing": sorted(wanted - names)}
    workflows = {n for n in tracked if n.startswith("workflows/")}
    assert len(workflows) >= 14 and workflows <= names  # every workflow with its thumbnail
    assert {*DEMO_MODELS, "nodes/demo_models/shapes.py", "__init__.py", "web/reusekit.js", "pyproject.toml",
            "LICENSE"} <= names
    left_out = {n for n in tracked if n.split("/")[0] in ("tests", "bench", "scripts", ".ci") or n == "Makefile"}
    assert left_out and not left_out & names and not [n for n in names if n.endswith(".pyc")]
    pictures = {(doc, str(Path(doc).parent / link).removeprefix("./"))
                for doc in names if doc.endswith(".md")
                for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (snapshot / doc).read_text())
                if "://" not in link}
    assert {picture for _, picture in pictures} >= {"docs/panel.png", "docs/demo.png"}  # the README's
    assert not [(doc, picture) for doc, picture in pictures if picture not in names]  # a doc reads whole
    size = archive.stat().st_size
    print(f"\nnode.zip: {len(names)} files, {size / 1e6:.2f} MB")
    assert size < 3e6


def demo_script():
    spec = importlib.util.spec_from_file_location("rk_scripts_demo", rkharness.ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["registry archive", "git clone"])
def installed(request, workdir, snapshot):
    """A fresh host with the pack installed one way (as custom_nodes/reusekit, the Registry's id and the
    README's clone folder), its server, and the demo run on it as the template the server lists."""
    host = rkharness.fresh_host(workdir / request.param.replace(" ", "-") / "ComfyUI")
    target = host / "custom_nodes" / "reusekit"
    if request.param == "registry archive":
        # as comfy-cli's and ComfyUI-Manager's extract_package_as_zip unpack what the Registry serves
        with zipfile.ZipFile(request.getfixturevalue("archive")) as z:
            z.extractall(target)
    else:
        git("clone", "-q", str(snapshot), str(target), cwd=workdir)
    script = demo_script()
    with rkharness.host_server(host) as server:
        templates = server.get("/api/workflow_templates")
        workflow = server.get("/api/workflow_templates/reusekit/" + urllib.parse.quote(script.DEMO))
        workflow = json.loads(workflow) if isinstance(workflow, str) else workflow
        demo = script.run(server, "full", script.variants(rkharness, workflow)["full"])
        yield {"host": host, "target": target, "server": server, "templates": templates, "demo": demo}


def test_the_installed_pack_loads_with_every_layer_on(installed):
    import comfyui_version

    assert installed["target"].is_dir() and not installed["target"].is_symlink()
    log = installed["server"].log_text()
    assert "IMPORT FAILED" not in log, log[-5000:]
    loaded = f" seconds: {installed['target'].resolve()}"  # ComfyUI's import times; " (IMPORT FAILED)" if not
    assert any(line.endswith(loaded) for line in log.splitlines()), log[-5000:]
    lines = [line for line in log.splitlines() if re.search(r"ReuseKit \S+ on ComfyUI ", line)]
    assert len(lines) == 1, lines
    assert f"on ComfyUI {comfyui_version.__version__}:" in lines[0]
    for layer in ("conditioning cache on", "PE cache on", "step cache on", "graph capture ", "panel on"):
        assert layer in lines[0], lines[0]
    assert "registerExtension" in installed["server"].get("/extensions/reusekit/reusekit.js")


def test_the_installed_pack_runs_the_demo_to_saved_pictures_with_cache_hits(installed):
    from PIL import Image

    assert "ReuseKit demo (no downloads)" in installed["templates"]["reusekit"]
    demo = installed["demo"]
    assert len(demo["images"]) == 3
    for path in demo["images"]:
        assert path.is_relative_to(installed["host"] / "output")
        with Image.open(path) as image:
            assert image.width > 0 and image.height > 0
    counts = demo["counts"]
    assert counts["conditioning.hits"] > 0 and counts["pe.hits"] > 0, counts
    assert counts["step.calls_skipped"] > 0, counts
