"""Graph memory: freed when ComfyUI needs memory (patches/memory.py's releaser), released at the
end of a run unless ``keep_graphs``, counted in the stats; two Graph nodes with different
``max_graphs`` on one model keep their own graphs."""

import pytest
import rkharness
import torch
from graph_helpers import capture, conds_fixture, counters, gc_fixture, last_run, sample  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph
DEFAULT_BACKEND = "emulate"  # static buffers on the CPU: memory counted like a graph's


def held(gc):
    return gc.STATS.handle.snapshot()["info"]["held"]


def test_install_registers_a_releaser_that_frees_graphs_when_comfyui_needs_memory(gc, tiny, conds):
    memory = rkharness.pack("patches.memory")
    gc.graph_release.install()
    assert gc.graph_release.MEMORY_RELEASER in [name for name, _ in memory._releasers] and memory.installed()
    model = tiny.tiny_flux(0)
    first = sample(capture(model), conds)
    info = held(gc)
    assert info["graphs"] == 1 and info["buffers_and_pools_bytes"] > 0 and info["weights_kept_alive_bytes"] > 0
    assert gc.STATS.handle.snapshot()["bytes"]["device"] == info["buffers_and_pools_bytes"]
    assert memory.release("cuda:0", 1) == 0  # nothing of ours on another device
    freed = memory.release("cpu", 1)
    assert freed == info["buffers_and_pools_bytes"]
    assert held(gc)["graphs"] == 0 and gc.STATS.handle.snapshot()["bytes"]["device"] == 0
    assert counters(gc)["releases.memory"] == 1
    assert torch.equal(sample(capture(model), conds), first) and last_run(gc)["rebuilds"] == {"memory": 1}
    gc.graph_release.uninstall()
    assert gc.graph_release.MEMORY_RELEASER not in [name for name, _ in memory._releasers]
    gc.graph_release.install()


def test_a_set_in_use_by_a_forward_is_left_to_it(gc, tiny, conds):
    model = tiny.tiny_flux(0)
    sample(capture(model), conds)
    gs = gc.graph_release.graph_set(model.model, 2)
    with gs.in_use():
        assert gc.graph_release.free_for_memory("cpu", 1 << 40) == 0 and len(gs.entries) == 1
    assert gc.graph_release.free_for_memory("cpu", 1 << 40) > 0 and not gs.entries


@pytest.mark.parametrize("keep", [True, False])
def test_graphs_are_kept_across_runs_unless_keep_graphs_is_off(gc, tiny, conds, keep):
    graph = rkharness.pack("nodes.graph")
    model = tiny.tiny_flux(0)
    captured = graph.GraphCaptureNode.execute(model, enable=True, max_graphs=2, keep_graphs=keep).args[0]
    first = sample(captured, conds)
    assert held(gc)["graphs"] == (1 if keep else 0)
    assert torch.equal(sample(captured, conds), first)
    run = last_run(gc)
    assert (run["captures"], run["rebuilds"]) == ((0, {}) if keep else (1, {"run_ended": 1}))
    with pytest.raises(ValueError, match="ReuseKit Graph Capture.*keep_graphs"):
        graph.GraphCaptureNode.execute(model, enable=True, max_graphs=2, keep_graphs="no")


def test_two_nodes_with_different_max_graphs_on_one_model_keep_their_own_graphs(gc, tiny, conds):
    model = tiny.tiny_flux(0)
    one, three = capture(model, max_graphs=1), capture(model, max_graphs=3)
    shapes = [(1, 16, 8, 8), (1, 16, 12, 12), (1, 16, 16, 16)]
    for shape in shapes:
        sample(three, conds, shape)
    sample(one, conds, shapes[0])
    sample(one, conds, shapes[1])  # its one graph is replaced: the other node's three stay
    for shape in shapes:
        assert torch.equal(sample(three, conds, shape), sample(model, conds, shape))
        assert last_run(gc)["captures"] == 0 and last_run(gc)["rebuilds"] == {}
    assert torch.equal(sample(one, conds, shapes[1]), sample(model, conds, shapes[1]))
    assert last_run(gc)["captures"] == 0
