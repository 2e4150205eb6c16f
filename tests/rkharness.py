"""The test harness: a real ComfyUI host in process, the pack loaded the way ComfyUI loads it,
the real executor, and a real server on loopback.

``bootstrap()`` must run before anything imports ``comfy``: conftest.py calls it at start-up.
The pack's root never goes on ``sys.path`` (its ``nodes/`` and ``tests/`` would shadow ComfyUI's
top-level modules); ComfyUI's own loader imports it from a link named ``reusekit``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
ARTIFACTS = ROOT / "test-artifacts"
USE_CUDA = os.environ.get("REUSEKIT_TEST_CUDA") == "1"  # the gpu tests on a CUDA machine

PACK = None       # the pack's package module, as ComfyUI loaded it
TINY = None       # tests/tinymodels, loaded as a custom-node package too
_links_dir: Path | None = None


def host_dir() -> Path:
    path = Path(os.environ.get("COMFYUI_PATH") or ROOT / ".host" / "ComfyUI").resolve()
    if not (path / "main.py").is_file():
        raise RuntimeError(f"no ComfyUI at {path}: run `make test` (or scripts/setup.sh --test) first")
    return path


def _package_links() -> Path:
    """A folder with the pack as ``reusekit`` and the tiny-model nodes as ``rk_tinymodels``."""
    global _links_dir
    if _links_dir is None:
        _links_dir = Path(tempfile.mkdtemp(prefix="reusekit-links-"))
        (_links_dir / "reusekit").symlink_to(ROOT, target_is_directory=True)
        (_links_dir / "rk_tinymodels").symlink_to(TESTS / "tinymodels", target_is_directory=True)
        atexit.register(shutil.rmtree, _links_dir, True)
    return _links_dir


def bootstrap() -> None:
    """Put the host first on sys.path, force CPU, import ComfyUI the way main.py does, load the pack."""
    global PACK, TINY
    if PACK is not None:
        return
    host = str(host_dir())
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    sys.path.insert(0, host)

    import comfy.cli_args

    comfy.cli_args.args.cpu = not USE_CUDA
    import comfy.model_management  # noqa: F401, I001  (this order matters: device probe after args.cpu)
    import utils.extra_config  # noqa: F401  (before nodes, as main.py does)
    import server  # noqa: F401
    import nodes

    links = _package_links()
    loop = asyncio.new_event_loop()
    try:
        for name in ("reusekit", "rk_tinymodels"):
            if not loop.run_until_complete(nodes.load_custom_node(str(links / name))):
                raise RuntimeError(f"ComfyUI could not load {links / name}")
    finally:
        loop.close()
    PACK = sys.modules[str(links / "reusekit").replace(".", "_x_")]
    TINY = sys.modules[str(links / "rk_tinymodels").replace(".", "_x_")]


def pack(name: str):
    """A submodule of the pack, e.g. ``pack("caching.stats")``."""
    return importlib.import_module(f"{PACK.__name__}.{name}")


# ---- in-process execution ------------------------------------------------------------------

_extra_nodes_loaded = False


def load_extra_nodes() -> None:
    """ComfyUI's comfy_extras nodes (FluxGuidance, EasyCache, ...), once per process."""
    global _extra_nodes_loaded
    if not _extra_nodes_loaded:
        import nodes

        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        finally:
            loop.close()
        _extra_nodes_loaded = True


def forget_dropped_clones() -> None:
    """Drops ComfyUI's entries for loaded model clones that are gone while their base model lives on (kept
    by a module-level cache: the demo node's, the tests' shared checkpoints). ComfyUI keeps such entries
    for as long as the base lives: its leak check reports them, and ``loaded_models()`` lists them as
    None. For a test that checks either from a clean slate."""
    import comfy.model_management as mm

    mm.current_loaded_models[:] = [m for m in mm.current_loaded_models if not m.is_dead()]


class Executor:
    """Runs API-format prompts through the real ``execution.PromptExecutor``.

    ``cache``: ComfyUI's cache mode, ``"classic"`` (default), ``"lru"``, ``"ram"`` or ``"none"``.
    """

    _server = None

    def __init__(self, cache: str = "classic", lru_size: int = 10):
        import execution
        import server

        if Executor._server is None:
            load_extra_nodes()
            loop = asyncio.new_event_loop()
            takes = inspect.signature(server.PromptServer).parameters
            if "asset_manager" in takes and takes["asset_manager"].default is inspect.Parameter.empty:
                from app.assets.manager import default_asset_manager  # ComfyUI 0.38+

                Executor._server = server.PromptServer(loop, default_asset_manager())
            else:
                Executor._server = server.PromptServer(loop)
        cache_args = {"classic": {"lru": 0, "ram": 0}, "lru": {"lru": lru_size, "ram": 0},
                      "ram": {"lru": 0, "ram": 4.0}, "none": {"lru": 0, "ram": 0}}[cache]
        cache_args["ram_inactive"] = 0  # read by ComfyUI 0.33's executor, ignored by 0.3.75's
        kwargs = {"cache_type": execution.CacheType.NONE} if cache == "none" else {}
        if cache == "lru":
            kwargs = {"cache_type": execution.CacheType.LRU}
        self.executor = execution.PromptExecutor(Executor._server, cache_args=cache_args, **kwargs)

    def run(self, prompt: dict) -> dict:
        """Validate and execute; returns the history result (``outputs`` holds each node's ui)."""
        import execution

        prompt_id = str(uuid.uuid4())
        valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
        if not valid[0]:
            raise AssertionError(f"invalid prompt: {valid[1]} {valid[3]}")
        self.executor.execute(prompt, prompt_id, {"client_id": None}, valid[2])
        if not self.executor.success:
            raise AssertionError(f"prompt failed: {self.executor.status_messages}")
        return self.executor.history_result

    def output(self, node_id: str) -> list:
        """A node's cached outputs after a run (the lookup is a coroutine on ComfyUI 0.33)."""
        import inspect

        entry = self.executor.caches.outputs.get(node_id)
        if inspect.iscoroutine(entry):
            entry = asyncio.run(entry)
        return entry.outputs


# ---- UI-format workflows -------------------------------------------------------------------

# Loaders of real checkpoints, and where their outputs come from on the tiny test models:
# node type -> (test node type, [output slot of the test node for each output slot of the loader]).
TINY_LOADERS = {
    "CheckpointLoaderSimple": ("RKTestTinyCheckpoint", [0, 1, 2]),
    "UNETLoader": ("RKTestTinyCheckpoint", [0]),
    "CLIPLoader": ("RKTestTinyCheckpoint", [1]),
    "DualCLIPLoader": ("RKTestTinyCheckpoint", [1]),
    "TripleCLIPLoader": ("RKTestTinyCheckpoint", [1]),
    "VAELoader": ("RKTestTinyCheckpoint", [2]),
    "CLIPVisionLoader": ("RKTestTinyCLIPVision", [0]),
    "ReuseKitLazyCLIPLoader": ("RKTestLazyTinyCLIP", [0]),  # the tiny CLIP as a CLIP-L file, loaded lazily
    "ReuseKitLazyDualCLIPLoader": ("RKTestLazyTinyCLIP", [0]),
    "ReuseKitLazyTripleCLIPLoader": ("RKTestLazyTinyCLIP", [0]),
}
_SKIPPED_TYPES = {"Note", "MarkdownNote", "PrimitiveNode"}
_SEED_CONTROLS = {"fixed", "increment", "decrement", "randomize"}
_WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def load_workflow(name: str) -> dict:
    return json.loads((ROOT / "workflows" / name).read_text())


def output_pixels(ui: dict):
    """The pixels (H, W, 3 uint8 array) of the one image a SaveImage or PreviewImage node wrote, from its ui."""
    import folder_paths
    import numpy as np
    from PIL import Image

    (image,) = ui["images"]
    path = Path(folder_paths.get_directory_by_type(image["type"])) / image["subfolder"] / image["filename"]
    with Image.open(path) as opened:
        return np.asarray(opened.convert("RGB"))


def _widget_inputs(class_type: str) -> list[tuple[str, str, dict]]:
    """(name, type, options) of a node's widget inputs, in the order the front end lays them out."""
    import nodes

    load_extra_nodes()
    spec = nodes.NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    out = []
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            kind = entry[0]
            options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
            if isinstance(kind, list):
                kind = "COMBO"
            if kind in _WIDGET_TYPES and not options.get("forceInput"):
                out.append((name, kind, options))
    return out


def workflow_to_prompt(workflow: dict, family: str = "flux", seed: int = 0,
                       overrides: dict | None = None) -> dict:
    """A UI-format workflow (as saved by the ComfyUI page) as an API-format prompt.

    Checkpoint, UNet, CLIP, VAE and CLIP-vision loaders become the tiny test models of
    ``family`` (weights from ``seed``); ``overrides`` maps a node id to inputs to replace (e.g. a
    smaller size). Notes are dropped; reroutes are followed, primitives inlined; muted nodes are
    left out.
    """
    nodes_by_id = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}
    replaced = {n["id"]: TINY_LOADERS[n["type"]] for n in workflow["nodes"] if n["type"] in TINY_LOADERS}

    def source(link_id):
        _, node_id, slot = links[link_id][:3]
        node = nodes_by_id[node_id]
        if node["type"] == "PrimitiveNode":  # the page writes its value into the target widget
            return node["widgets_values"][0]
        if node["type"] == "Reroute":
            return source(node["inputs"][0]["link"])
        if node_id in replaced:
            slot = replaced[node_id][1][slot]
        return [str(node_id), slot]

    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in _SKIPPED_TYPES or node["type"] == "Reroute" or node.get("mode", 0) == 2:
            continue
        if node.get("mode", 0) == 4:
            raise ValueError(f"node {node['id']} ({node['type']}) is bypassed: not supported here")
        node_id = str(node["id"])
        if node["id"] in replaced:
            class_type = replaced[node["id"]][0]
            inputs = {"seed": seed} | ({"family": family} if class_type == "RKTestTinyCheckpoint" else {})
            prompt[node_id] = {"class_type": class_type, "inputs": inputs}
            continue
        linked = {i["name"]: i["link"] for i in node.get("inputs", []) if i.get("link") is not None}
        inputs = {name: source(link) for name, link in linked.items()}
        values = list(node.get("widgets_values") or [])
        if isinstance(node.get("widgets_values"), dict):  # some nodes save widgets by name
            values = [node["widgets_values"].get(name) for name, _, _ in _widget_inputs(node["type"])]
        for name, kind, options in _widget_inputs(node["type"]):
            if not values:
                break
            value = values.pop(0)
            if name not in linked:
                inputs[name] = value
            seed_like = options.get("control_after_generate") or name in ("seed", "noise_seed")
            if kind == "INT" and seed_like and values and values[0] in _SEED_CONTROLS:
                values.pop(0)
        inputs.update((overrides or {}).get(node_id, {}))
        prompt[node_id] = {"class_type": node["type"], "inputs": inputs}
    return prompt


# ---- a real browser ------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextlib.contextmanager
def chromium():
    """Debian's chromium, headless, through Playwright; skips the test where either is missing."""
    import pytest

    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium at /usr/bin/chromium (make test installs Debian's package)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


# ---- a real server on loopback -------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, base: Path, log: Path, proc: subprocess.Popen):
        self.url, self.base, self.log, self.proc = url, base, log, proc

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if "json" in r.headers.get("Content-Type", "") else body.decode()

    def post(self, path: str, payload, timeout: float = 30):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            return json.loads(body) if body and "json" in r.headers.get("Content-Type", "") else body.decode()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_prompt(self, prompt_id: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                return history[prompt_id]
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s\n{self.log_text()[-3000:]}")

    def queue(self, prompt: dict) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": "reusekit-tests"})["prompt_id"]

    def wait_published(self, timeout: float = 60) -> None:
        """Wait until the conditioning misses of finished prompts passed their publication check and
        reached the shared tiers (or were dropped): what a restarted or second server finds from then on."""
        deadline = time.monotonic() + timeout
        while True:
            caches = {c["name"]: c for c in self.get("/reusekit/stats")["caches"]}
            if not caches["conditioning"].get("info", {}).get("publish_waiting", 0):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"conditioning entries still wait to be published after {timeout} s")
            time.sleep(0.1)

    def saved_latent(self, entry: dict, node: str):
        """The latent that node ``node`` (a SaveLatent) of a finished prompt (its history ``entry``) wrote."""
        from safetensors.torch import load_file

        status = entry.get("status", {})
        assert status.get("status_str") == "success", (status, self.log_text()[-3000:])
        (saved,) = entry["outputs"][node]["latents"]
        return load_file(str(self.base / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


@contextlib.contextmanager
def _served(cmd: list[str], cwd: Path, base: Path, log: Path, env: dict, timeout: float):
    """Run ``cmd`` (a ComfyUI ``main.py`` on a loopback port) until it answers, yield its :class:`Server`,
    and stop it however the block ends."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={"OMP_NUM_THREADS": "1", **os.environ, **env, "PYTHONUNBUFFERED": "1"})
    port = cmd[cmd.index("--port") + 1]
    server = Server(f"http://127.0.0.1:{port}", base, log, proc)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {proc.returncode}:\n{server.log_text()[-5000:]}")
            try:
                server.get("/system_stats", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ComfyUI not ready in {timeout} s:\n{server.log_text()[-5000:]}") from None
                time.sleep(0.25)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@contextlib.contextmanager
def running_server(*extra_args: str, timeout: float = 120, env: dict | None = None):
    """Start ``main.py --cpu`` on a free loopback port with the pack and the tiny-model nodes;
    ``env``: extra environment variables (e.g. a shared cache's folder or server) for this one."""
    base = Path(tempfile.mkdtemp(prefix="reusekit-server-"))
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "reusekit").symlink_to(ROOT, target_is_directory=True)
    (base / "custom_nodes" / "rk_tinymodels").symlink_to(TESTS / "tinymodels", target_is_directory=True)
    cmd = [sys.executable, str(host_dir() / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(free_port()),
           "--base-directory", str(base), "--database-url", "sqlite:///:memory:", "--disable-auto-launch",
           *extra_args]
    try:
        with _served(cmd, host_dir(), base, base / "server.log", env or {}, timeout) as server:
            yield server
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- a fresh host, as users install the pack into it ---------------------------------------

def fresh_host(dest: Path) -> Path:
    """A copy of the test host's ComfyUI at ``dest`` as it is before any pack is installed: ComfyUI's own
    files (its compiled modules too: a quicker start), ``custom_nodes/`` with only ComfyUI's example files
    (no pack linked in), ``models/`` folders without files (a checkout's may hold gigabytes), and neither
    ``.git`` nor what runs leave (``user/``, ``input/``, ``output/``, ``temp/``: ComfyUI makes them)."""
    host = host_dir()

    def leave_out(folder: str, names: list[str]) -> list[str]:
        folder = Path(folder)
        if folder == host:
            return [n for n in names if n in (".git", "user", "input", "output", "temp")]
        if folder == host / "custom_nodes":
            return [n for n in names if (folder / n).is_symlink() or not (folder / n).is_file()]
        if folder.is_relative_to(host / "models"):
            return [n for n in names if not (folder / n).is_dir()]
        return []

    shutil.copytree(host, dest, symlinks=True, ignore=leave_out)
    return dest


@contextlib.contextmanager
def host_server(host: Path, timeout: float = 120):
    """Start ``host``'s own ``main.py --cpu`` on a free loopback port as a user starts their ComfyUI: what
    its ``custom_nodes/`` holds, its own ``models/``, ``user/`` and ``output/``; the log beside ``host``."""
    cmd = [sys.executable, str(host / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(free_port()),
           "--disable-auto-launch"]
    with _served(cmd, host, host, host.parent / f"{host.name}-server.log", {}, timeout) as server:
        yield server
