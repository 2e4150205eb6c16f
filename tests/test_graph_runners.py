"""The graph runners (caching/graph_runners.py) in a process with torch only, no ComfyUI: the
``emulate`` runner re-runs the forward on its static buffers, the ``trace`` runner replays what it
froze at capture (a replay the signature should have refused shows as a wrong output)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.graph

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from reusekit.caching import graph_reuse, graph_runners

    state = {"scale": 2.0}  # Python state the forward reads and no signature holds

    def forward(x, t, transformer_options=None):
        return x * t[:, None] * state["scale"] + 1

    def named(seed):
        gen = torch.Generator().manual_seed(seed)
        return [("x", torch.randn(2, 3, generator=gen)), ("t", torch.rand(2, generator=gen)),
                ("transformer_options", {"cond_or_uncond": [1, 0]})]

    device = torch.device("cpu")
    first = named(0)
    spec = graph_reuse.analyse_call(first, (), device)
    runners = {name: cls(forward, first, 2, spec, device)
               for name, cls in (("emulate", graph_runners.StaticRunner), ("trace", graph_runners.TraceRunner))}
    for name, runner in runners.items():
        out, failure = runner.capture(1)
        assert failure == "" and torch.equal(out, forward(first[0][1], first[1][1])), name
    second = named(1)
    again = graph_reuse.analyse_call(second, (), device)
    assert again.signature == spec.signature  # new values, same graph
    want = forward(second[0][1], second[1][1])
    for runner in runners.values():
        assert torch.equal(runner.replay(again.tensors), want)
    state["scale"] = 3.0  # a change the signature cannot see: only the trace stays frozen
    want = forward(second[0][1], second[1][1])
    assert torch.equal(runners["emulate"].replay(again.tensors), want)
    assert not torch.equal(runners["trace"].replay(again.tensors), want)
    for runner in runners.values():
        runner.release()
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("comfy", "comfy_api", "nodes", "execution"))
    assert not loaded, loaded
    print("ok")
""")


def test_the_runners_need_torch_only_and_the_trace_replays_what_it_froze(tmp_path):
    (tmp_path / "reusekit").symlink_to(ROOT, target_is_directory=True)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
