"""pytest set-up: bootstrap the real host before any test imports ComfyUI (see rkharness.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import rkharness` (tests/ only)
import rkharness  # noqa: E402

rkharness.bootstrap()


def pytest_configure(config):
    """One torch thread: the tiny models' ops are far faster without thread contention on shared
    CPUs (the servers the tests start get the same through OMP_NUM_THREADS)."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available() and rkharness.USE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with REUSEKIT_TEST_CUDA=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def harness():
    return rkharness


@pytest.fixture(scope="session")
def tiny():
    """tests/tinymodels: builders of tiny real ComfyUI models."""
    return rkharness.TINY


@pytest.fixture(scope="module")
def conds(tiny):
    """(positive, negative) of the tiny CLIP: a caption the trained models know and an empty negative."""
    import torch

    import nodes

    clip = tiny.tiny_clip(0)
    with torch.inference_mode():
        (pos,) = nodes.CLIPTextEncode().encode(clip, "a red circle on a black background")
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")
    return pos, neg


@pytest.fixture(scope="session")
def comfy_server():
    """One real ComfyUI server (main.py --cpu) with the pack, shared by the session's tests."""
    with rkharness.running_server() as server:
        yield server


@pytest.fixture(scope="session", autouse=True)
def _no_users_calibrations():
    """The step cache's calibrations kept in memory for the session: one saved in the host's user folder (by a
    developer's own run of the calibrate node) changed what model_type auto means in the tests."""
    step = rkharness.pack("patches.step_cache")
    before, step.STORE = step.STORE, rkharness.pack("caching.step_cache").CalibrationStore(None)
    yield
    step.STORE = before


@pytest.fixture(autouse=True)
def _inference_mode():
    """Run every test under inference mode, as ComfyUI's executor runs nodes."""
    import torch

    with torch.inference_mode():
        yield
