"""Graph reuse on the CPU: the decision (signature, can_reuse, rebuild reasons, graphs kept per
model) with real tiny models through the real sampler, the eager fallback bit for bit, the
``emulate`` backend (static buffers updated in place, no graph), invalidation by LoRA and unload,
bypasses, the disable switches, the nodes and the stats."""

import importlib
import logging
import threading
import time

import pytest
import rkharness
import torch
from graph_helpers import LATENTS, capture, conds_fixture, counters, gc_fixture, last_run, sample, tiny_lora  # noqa: F401  (the fixtures gc and conds)

pytestmark = pytest.mark.graph
DEFAULT_BACKEND = "eager"  # decisions only, on any device (these tests also run on a GPU machine)
ON_CUDA = rkharness.USE_CUDA and torch.cuda.is_available()

# ---- the decision, on real call arguments -----------------------------------------------------

def call_args(x_shape=(2, 16, 8, 8), cond_or_uncond=(1, 0), **extra):
    opts = {"wrappers": {}, "callbacks": {}, "cond_or_uncond": list(cond_or_uncond),
            "uuids": [object(), object()], "sigmas": torch.ones(1), "sample_sigmas": torch.linspace(1, 0, 4)}
    opts.update(extra.pop("options", {}))
    args = [("x", torch.zeros(x_shape)), ("timestep", torch.ones(x_shape[0])),
            ("context", torch.zeros(x_shape[0], 77, 32)), ("transformer_options", opts)]
    args.extend(extra.items())
    return args


def reason(gr, a, b):
    sa, sb = gr.analyse_call(a).signature, gr.analyse_call(b).signature
    ok, why, detail = gr.can_reuse(sa, sb)
    return ok, why, detail


def test_same_shapes_reuse_and_each_change_names_its_reason():
    gr = rkharness.pack("caching.graph_reuse")
    base = call_args()
    assert reason(gr, base, call_args()) == (True, "", "")  # new values, uuids, holders: same graph
    ok, why, detail = reason(gr, base, call_args(x_shape=(2, 16, 16, 16)))
    assert (ok, why) == (False, "shape") and detail.startswith("x:")
    assert reason(gr, base, call_args(cond_or_uncond=(0, 1)))[1] == "cond_batch"
    assert reason(gr, base, call_args(options={"rope_options": {"scale_x": 2.0}}))[1] == "options"
    assert reason(gr, call_args(options={"rope_options": {"scale_x": 1.0}}),
                  call_args(options={"rope_options": {"scale_x": 2.0}}))[1] == "options"
    assert reason(gr, base, call_args(attention_mask=torch.ones(2, 77)))[1] == "mask"
    assert reason(gr, call_args(control=None), call_args(control={"input": [torch.zeros(2, 4)]}))[1] == "control"
    assert reason(gr, call_args(guidance=torch.ones(2)), call_args(guidance=torch.ones(2, dtype=torch.float64)))[1] == "dtype"
    assert reason(gr, call_args(guidance=torch.ones(2)), call_args(guidance=torch.ones(4)[::2]))[1] == "layout"
    assert reason(gr, call_args(num=3), call_args(num=4))[1] == "value"


def test_plain_values_and_small_foreign_tensors_key_by_type_and_bits():
    """A graph bakes its Python values in: ``1``, ``1.0`` and ``True`` (dtype promotion), ``0.0``
    and ``-0.0`` (the sign of a product) are different graphs; a NaN option still reuses its graph."""
    gr = rkharness.pack("caching.graph_reuse")
    for a, b in ((1, 1.0), (1, True), (0.0, -0.0)):
        ok, why, detail = reason(gr, call_args(num=a), call_args(num=b))
        assert (ok, why) == (False, "value") and detail == f"num: {a!r} -> {b!r}", detail
    assert reason(gr, call_args(num=float("nan")), call_args(num=float("nan")))[0] is True
    def foreign(shift):  # the model on another device: small tensors here count by value
        return gr.analyse_call([("x", torch.ones(2, 4)), ("transformer_options", {"shift": shift})], (),
                               torch.device("cuda", 0))

    zero = foreign(torch.zeros(3, dtype=torch.float64))
    assert zero.bypass is None and zero.tensors == []
    assert gr.can_reuse(zero.signature, foreign(torch.zeros(3, dtype=torch.float64)).signature)[0]
    assert gr.can_reuse(zero.signature, foreign(-torch.zeros(3, dtype=torch.float64)).signature)[:2] == (
        False, "options")


def test_python_side_objects_in_options_count_by_type_and_patches_bypass_unless_graph_safe():
    gr = rkharness.pack("caching.graph_reuse")

    class Holder:  # a step cache's state holder: a new instance per run must not rebuild
        pass

    a = gr.analyse_call(call_args(options={"stepcache": Holder()}))
    b = gr.analyse_call(call_args(options={"stepcache": Holder()}))
    assert a.bypass is None and a.signature == b.signature

    class Attention:  # anything the forward may call counts by identity: a bound method too
        def run(self, *args):
            return args

    one, two = Attention(), Attention()
    sig = {k: gr.analyse_call(call_args(options={"optimized_attention_override": v})).signature
           for k, v in (("one", one.run), ("two", two.run), ("one_again", one.run))}
    assert sig["one"] == sig["one_again"] and gr.can_reuse(sig["one"], sig["two"])[:2] == (False, "options")
    # a signature holds what it names: a new override never takes a freed one's address and graph
    kept = [gr.analyse_call(call_args(options={"optimized_attention_override": Attention().run})).signature
            for _ in range(20)]
    assert len(set(kept)) == 20
    assert gr.can_reuse(a.signature, gr.analyse_call(call_args()).signature)[0] is False
    patched = gr.analyse_call(call_args(options={"patches": {"attn1_patch": [print]}}))
    assert patched.bypass == "transformer_patches" and patched.signature is None
    assert gr.analyse_call(call_args(options={"patches": {}})).bypass is None

    def safe_patch():  # marked graph-safe (ReuseKit's TeaCache block patches): counted by identity
        def patch(args, extra):
            return extra["original_block"](args)

        setattr(patch, rkharness.pack("caching.protocol").GRAPH_SAFE, True)
        return {"patches_replace": {"dit": {("double_block", 0): patch}}}

    one, two = safe_patch(), safe_patch()
    a, b = (gr.analyse_call(call_args(options=o)) for o in (one, two))
    assert a.bypass is None and a.signature == gr.analyse_call(call_args(options=one)).signature
    assert gr.can_reuse(a.signature, b.signature)[:2] == (False, "options")
    mixed = {"patches_replace": {"dit": {**one["patches_replace"]["dit"], ("double_block", 1): print}}}
    assert gr.analyse_call(call_args(options=mixed)).bypass == "transformer_patches"
    odd = gr.analyse_call(call_args(extra_arg=object()))
    assert odd.bypass == "uncapturable_input" and "extra_arg" in odd.detail


def test_values_in_options_the_forward_may_branch_on_count_by_value_and_one_holding_a_tensor_runs_eagerly():
    """A set (LTX-2 STG's blocks), a dataclass, an enum or a dict with other keys in the options is a value
    the forward may branch on in Python: keyed by its type alone, a graph captured for one replayed for
    another. Each counts by value (an enum member by identity); one holding a tensor, which the walk cannot
    put in a buffer, runs eagerly; a state holder still counts by its type."""
    import dataclasses
    import enum

    gr = rkharness.pack("caching.graph_reuse")

    def sig(value):
        return gr.analyse_call(call_args(options={"thing": value})).signature

    @dataclasses.dataclass
    class Params:
        scale: float
        blocks: tuple

    class Mode(enum.Enum):
        A = object()
        B = object()

    for one, other in ((frozenset({5}), frozenset({0})), ({1: "a"}, {1: "b"}), (Params(1.0, (1,)), Params(2.0, (1,))),
                       (Mode.A, Mode.B)):
        assert sig(one) == sig(one) and gr.can_reuse(sig(one), sig(other))[:2] == (False, "options"), one
    assert sig(frozenset({5})) == sig(frozenset({5}))
    for holding in ({1: torch.ones(2)}, Params(1.0, (torch.ones(2),)), {torch.ones(1)}):
        call = gr.analyse_call(call_args(options={"thing": holding}))
        assert call.bypass == "uncapturable_input" and "holding a tensor" in call.detail, holding

    @dataclasses.dataclass
    class Node:  # one that holds itself, and one whose field was never set: eager, never a failed run
        name: str
        parent: object = None
        later: int = dataclasses.field(init=False)

    looped = Node("a")
    looped.parent, looped.later = looped, 1
    for unreadable in (looped, Node("b")):
        call = gr.analyse_call(call_args(options={"thing": unreadable}))
        assert call.bypass == "uncapturable_input" and "cannot read" in call.detail, call.detail

    class Holder:  # a state holder (a wrapper's): its contents change, the forward never reads it
        def __init__(self, n):
            self.n = n

    assert sig(Holder(1)) == sig(Holder(2))


def test_a_namedtuple_among_the_inputs_is_rebuilt_and_another_sequence_type_runs_eagerly():
    """A custom node's namedtuple in the options is keyed and rebuilt on the buffers (it once crashed the
    sampling run when the runner was built); a sequence subclass the walk cannot rebuild is refused."""
    import collections

    gr, runners = rkharness.pack("caching.graph_reuse"), rkharness.pack("caching.graph_runners")
    pair = collections.namedtuple("Pair", "a b")

    def forward(x, transformer_options):
        return x + transformer_options["extra"].a * transformer_options["extra"].b

    named = [("x", torch.zeros(2)), ("transformer_options", {"extra": pair(torch.ones(2), 2.0)})]
    spec = gr.analyse_call(named, (), torch.device("cpu"))
    runner = runners.StaticRunner(forward, named, 1, spec, "cpu")
    out, failure = runner.capture(1)
    assert failure == "" and torch.equal(out, torch.full((2,), 2.0))
    other = [("x", torch.zeros(2)), ("transformer_options", {"extra": pair(torch.full((2,), 3.0), 2.0)})]
    assert gr.can_reuse(spec.signature, gr.analyse_call(other, (), torch.device("cpu")).signature)[0]
    assert torch.equal(runner.replay(gr.analyse_call(other, (), torch.device("cpu")).tensors), torch.full((2,), 6.0))

    class Row(list):
        pass

    odd = gr.analyse_call([("x", torch.zeros(2)), ("transformer_options", {"rows": Row([torch.ones(2)])})])
    assert odd.bypass == "uncapturable_input" and "transformer_options.rows is a" in odd.detail


def test_tensors_off_the_model_device_are_compared_by_value_not_buffered():
    gr = rkharness.pack("caching.graph_reuse")
    meta = torch.device("meta")  # stands for the model's device: every CPU tensor here is "foreign"

    def args(sigma):
        return [("x", torch.zeros(2, 4, device=meta)),
                ("transformer_options", {"sigmas": torch.full((1,), sigma), "cond_or_uncond": [1, 0]})]

    a = gr.analyse_call(args(1.0), device=meta)
    assert a.bypass is None and len(a.tensors) == 1  # only x goes into a static buffer
    assert gr.analyse_call(args(1.0), device=meta).signature == a.signature
    b = gr.analyse_call(args(0.5), device=meta)
    assert gr.can_reuse(a.signature, b.signature)[:2] == (False, "options")
    big = [("x", torch.zeros(gr.SMALL_FOREIGN_TENSOR + 1))]
    assert gr.analyse_call(big, device=meta).bypass == "uncapturable_input"


def test_substitute_puts_static_buffers_where_the_tensors_were():
    gr = rkharness.pack("caching.graph_reuse")
    args = call_args(control={"input": [torch.zeros(2, 4), None]}, ref=[torch.ones(3)])
    spec = gr.analyse_call(args)
    static = [t.clone() for t in spec.tensors]
    out = dict(gr.substitute(args, static))
    assert out["x"] is static[0] and out["timestep"] is static[1]
    assert any(out["transformer_options"]["sigmas"] is s for s in static)
    assert out["control"]["input"][0] is static[-2] and out["control"]["input"][1] is None
    assert out["ref"][0] is static[-1]
    assert out["transformer_options"]["cond_or_uncond"] == [1, 0]
    assert gr.analyse_call(list(out.items())).signature == spec.signature


def test_graph_set_keeps_a_few_graphs_lru_and_release_names_the_reason():
    gr = rkharness.pack("caching.graph_reuse")
    s1, s2, s3 = (gr.analyse_call(call_args(x_shape=(2, 16, n, n))).signature for n in (8, 16, 24))
    gs = gr.GraphSet(max_graphs=2)
    assert gs.decide(s1).reason == "first"
    gs.add(gr.Entry(s1))
    d = gs.decide(s2)
    assert not d.hit and d.reason == "shape"
    assert gs.add(gr.Entry(s2)) == []
    assert gs.decide(s1).hit and gs.decide(s2).hit  # two resolutions alternate without rebuilds
    evicted = gs.add(gr.Entry(s3))
    assert [e.signature for e in evicted] == [s1]  # least recently used goes
    assert not gs.decide(s1).hit and gs.decide(s3).hit
    assert len(gs.release("unloaded")) == 2
    d = gs.decide(s3)
    assert not d.hit and d.reason == "unloaded"
    assert gs.decide(s1).reason == "shape"  # a real difference is named before the release


def test_failed_captures_are_kept_apart_from_the_graphs_and_bounded():
    """A failed capture's verdict holds no graph: it takes no max_graphs place, and the verdicts are bounded by
    themselves (the oldest goes, as no graph does); a release drops both."""
    gr = rkharness.pack("caching.graph_reuse")
    good, *failing = (gr.analyse_call(call_args(x_shape=(2, 16, 8, n))).signature
                      for n in range(8, 8 + 2 * (gr.FAILED_KEPT + 3), 2))
    gs = gr.GraphSet(max_graphs=1)
    gs.add(gr.Entry(good))
    dropped = [e for sig in failing for e in gs.add(gr.Entry(sig, failed="a host sync"))]
    assert [e.signature for e in dropped] == failing[:2] and all(e.failed for e in dropped)
    assert list(gs.entries) == [good] and list(gs.failures) == failing[2:]
    assert gs.decide(good).hit and gs.decide(failing[-1]).entry.failed and not gs.decide(failing[0]).hit
    assert len(gs.release("unloaded")) == 1 + gr.FAILED_KEPT and not gs.entries and not gs.failures


# ---- real tiny models through the real sampler -------------------------------------------------

@pytest.mark.parametrize("family", ["flux", "wan"])
def test_eager_fallback_equals_the_plain_run_bit_for_bit_and_counts_reuse(gc, tiny, conds, family):
    model = tiny.BUILDERS[family](0)
    plain = sample(model, conds, LATENTS[family], steps=4)
    out = sample(capture(model), conds, LATENTS[family], steps=4)
    assert torch.equal(out, plain)
    run = last_run(gc)
    assert run["backend"] == "eager" and run["steps"] == 4 and run["eager_steps"] == 4
    assert run["hits"] == 3 and run["captures"] == 0 and run["rebuilds"] == {}
    assert counters(gc)["misses"] == 1
    again = sample(capture(model), conds, LATENTS[family], steps=4)
    assert torch.equal(again, plain) and last_run(gc)["hits"] == 4  # kept across runs


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_emulated_static_buffers_updated_in_place_equal_the_plain_run(gc, monkeypatch, tiny, conds, family):
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.BUILDERS[family](1)
    plain = sample(model, conds, LATENTS[family], steps=4)
    captured = capture(model)
    out = sample(captured, conds, LATENTS[family], steps=4)
    assert torch.equal(out, plain)
    run = last_run(gc)
    assert (run["captures"], run["replays"], run["eager_steps"]) == (1, 3, 0)
    # a different seed: new noise flows through the same static buffers
    assert torch.equal(sample(captured, conds, LATENTS[family], steps=4, seed=11),
                       sample(model, conds, LATENTS[family], steps=4, seed=11))
    assert last_run(gc)["replays"] == 4 and last_run(gc)["captures"] == 0


def test_resolution_and_cond_batch_changes_rebuild_with_the_right_reason(gc, monkeypatch, tiny, conds):
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model, max_graphs=2)
    sample(captured, conds, (1, 16, 8, 8))
    big = sample(captured, conds, (1, 16, 12, 12))
    assert last_run(gc)["rebuilds"] == {"shape": 1}
    assert torch.equal(big, sample(model, conds, (1, 16, 12, 12)))
    sample(captured, conds, (1, 16, 8, 8))  # both resolutions kept: no rebuild
    assert last_run(gc)["rebuilds"] == {} and last_run(gc)["captures"] == 0
    single = sample(captured, conds, (1, 16, 8, 8), cfg=1.0)  # cfg 1: the uncond is not computed
    assert last_run(gc)["rebuilds"] == {"cond_batch": 1}
    assert torch.equal(single, sample(model, conds, (1, 16, 8, 8), cfg=1.0))
    assert counters(gc)["evictions"] == 1
    assert counters(gc)["rebuilds.shape"] == 1 and counters(gc)["rebuilds.cond_batch"] == 1


def test_capture_keeps_alive_what_the_forward_reads_from_outside_and_nothing_it_made(gc, monkeypatch, tiny, conds):
    """A graph reads addresses: weights, buffers and tensors held by caches (a PE cache drops
    its reference when its key changes) stay alive with the graph; intermediates do not."""
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    sample(capture(model), conds, steps=2)
    (entry,) = gc.graph_release.graph_set(model.model, 2).entries.values()
    kept = set(entry.runner.kept)
    params = {p.untyped_storage().data_ptr() for p in model.model.diffusion_model.parameters()}
    static = {t.untyped_storage().data_ptr() for t in entry.runner.static}
    img_in = model.model.diffusion_model.img_in.weight.untyped_storage().data_ptr()
    assert img_in in kept and len(kept & params) > len(params) // 2
    assert kept <= params, "a tensor made during the capture, or a static input the runner holds, was kept"
    assert static and not kept & static
    # the memory itself: alive even where a parameter's .data is swapped for another tensor
    assert isinstance(entry.runner.kept[img_in], torch.UntypedStorage)


def test_interleaved_cond_and_uncond_calls_keep_one_graph_each(gc, monkeypatch, tiny, conds):
    """A negative set to an area cannot batch with the positive: every step makes two calls with
    different batches and shapes, which alternate between two kept graphs."""
    import nodes

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    pos, neg = conds
    (neg_area,) = nodes.ConditioningSetArea().append(neg, 32, 32, 0, 0, 1.0)
    model = tiny.tiny_flux(0)
    plain = sample(model, (pos, neg_area), steps=3)
    assert torch.equal(sample(capture(model, max_graphs=2), (pos, neg_area), steps=3), plain)
    run = last_run(gc)
    assert (run["steps"], run["captures"], run["replays"]) == (6, 2, 4)
    assert run["rebuilds"] == {"cond_batch": 1}
    out = sample(capture(model, max_graphs=1), (pos, neg_area), steps=4)
    run = last_run(gc)  # one graph only (a set of its own): rebuilt on every call, says why, stops capturing
    assert torch.equal(out, sample(model, (pos, neg_area), steps=4))
    assert run["steps"] == 8 and run["rebuilds"]["cond_batch"] >= 5
    assert run["captures"] == 4 and run["bypasses"]["unstable_inputs"] >= 2, run
    assert run["captures"] + run["replays"] + run["eager_steps"] == 8
    assert any("raise max_graphs" in n for n in run["notes"])


def test_a_lora_applied_in_between_invalidates_and_reapplying_the_base_rebuilds(gc, monkeypatch, tiny, conds):
    import comfy.sd

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model)
    first = sample(captured, conds)
    (lora_model, _) = comfy.sd.load_lora_for_models(captured, None, tiny_lora(), 1.0, 0)
    with_lora = sample(lora_model, conds)
    assert last_run(gc)["rebuilds"] == {"weights": 1}
    assert counters(gc).get("releases.unloaded", 0) + counters(gc).get("releases.reloaded", 0) >= 1
    (plain_lora, _) = comfy.sd.load_lora_for_models(model, None, tiny_lora(), 1.0, 0)
    assert torch.equal(with_lora, sample(plain_lora, conds))
    assert not torch.equal(with_lora, first)
    back = sample(captured, conds)
    assert last_run(gc)["rebuilds"] == {"weights": 1} and last_run(gc)["captures"] == 1
    assert torch.equal(back, first)


def test_an_object_patch_in_between_rebuilds(gc, monkeypatch, tiny, conds):
    """Object patches (a replaced submodule) keep patches_uuid: they are part of the signature."""
    import copy

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model)
    first = sample(captured, conds)
    other = copy.deepcopy(model.model.diffusion_model.img_in)
    with torch.no_grad():
        other.weight.mul_(0.5)
    patched = captured.clone()
    patched.add_object_patch("diffusion_model.img_in", other)
    out = sample(patched, conds)
    assert last_run(gc)["rebuilds"] == {"object_patches": 1} and not torch.equal(out, first)
    plain = model.clone()
    plain.add_object_patch("diffusion_model.img_in", other)
    assert torch.equal(out, sample(plain, conds))
    assert torch.equal(sample(captured, conds), first)


def test_a_freed_object_patch_and_a_new_one_at_its_address_never_share_a_key(gc, tiny):
    """The object-patch field holds each patch by identity (``Same``), weakly: a patch freed and a
    new one allocated at its address give different keys, and the key does not keep it alive."""
    import weakref

    model = tiny.tiny_flux(0)
    cpu = torch.device("cpu")

    def fields_with(patch):
        patcher = model.clone()
        patcher.add_object_patch("diffusion_model.img_in", patch)
        model.model.current_patcher = patcher
        try:
            return gc._state_fields(model.model, cpu, "emulate")
        finally:
            model.model.current_patcher = None

    old = torch.nn.Linear(64, 32)
    first, addr, gone = fields_with(old), id(old), weakref.ref(old)
    assert fields_with(old) == first
    del old
    assert gone() is None, "the key kept the object patch alive"
    new = [torch.nn.Linear(64, 32) for _ in range(200)]  # CPython hands a freed address out again
    reused = [p for p in new if id(p) == addr]
    for patch in reused or new[:1]:
        assert fields_with(patch) != first
    other = fields_with(new[0])
    assert gc.gr.can_reuse(gc.gr.Signature(first), gc.gr.Signature(other))[1] == "object_patches"


def test_unloading_the_model_releases_its_graphs(gc, monkeypatch, tiny, conds):
    import comfy.model_management as mm

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model)
    first = sample(captured, conds)
    assert gc.STATS.handle.snapshot()["entries"] == 1 and gc.STATS.handle.snapshot()["bytes"]["device"] > 0
    mm.unload_all_models()
    snap = gc.STATS.handle.snapshot()
    assert snap["entries"] == 0 and snap["bytes"]["device"] == 0 and snap["counters"]["releases.unloaded"] == 1
    assert torch.equal(sample(captured, conds), first)
    assert last_run(gc)["rebuilds"] == {"unloaded": 1}


def test_a_clear_from_another_thread_between_decision_and_replay_frees_the_graph_after_it(gc, monkeypatch, tiny,
                                                                                             conds):
    """The panel's clear runs on the server's thread: it never waits for the sampler, and the graph
    being replayed is freed when its replay ends (the next step rebuilds and says why)."""
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    plain = sample(model, conds, steps=4)
    replay, released, runners = gc.graph_runners.StaticRunner.replay, [], []

    def racing_replay(self, tensors):
        clear = threading.Thread(target=lambda: released.append(gc.graph_release.release_all("cleared")))
        clear.start()
        clear.join(10)
        assert not clear.is_alive()
        runners.append(self)
        return replay(self, tensors)

    monkeypatch.setattr(gc.graph_runners.StaticRunner, "replay", racing_replay)
    assert torch.equal(sample(capture(model), conds, steps=4), plain)
    run = last_run(gc)
    assert (run["captures"], run["replays"], run["rebuilds"]) == (2, 2, {"cleared": 1}), run
    assert released == [1, 1] and all(r.fn is None and r.static == [] for r in runners)
    assert gc.STATS.handle.snapshot()["entries"] == 0 and not gc.graph_release.graph_set(model.model, 2).doomed


def test_clears_from_another_thread_all_through_sampling_leave_the_result_unchanged(gc, monkeypatch, tiny, conds):
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(2)
    plain = sample(model, conds, steps=8)
    stop, errors = threading.Event(), []

    def clear_often():
        while not stop.is_set():
            try:
                gc.graph_release.release_all("cleared")
            except Exception as exc:  # noqa: BLE001  (reported below)
                errors.append(exc)
            time.sleep(0.001)

    clearer = threading.Thread(target=clear_often)
    clearer.start()
    try:
        outs = [sample(capture(model), conds, steps=8) for _ in range(3)]
    finally:
        stop.set()
        clearer.join(10)
    assert not errors and all(torch.equal(o, plain) for o in outs)
    gc.graph_release.release_all("test")
    assert not gc.graph_release.graph_set(model.model, 2).doomed and gc.graph_release.graph_set(model.model, 2).busy == 0


@pytest.mark.parametrize("warm", [False, True], ids=["capturing", "replaying"])
def test_interrupt_mid_run_leaves_graphs_usable(gc, monkeypatch, tiny, conds, warm):
    """A cancel mid-run leaves the graphs usable; in a run that replays, the cut-off step is no hit (it was
    counted one, its replay never run, until 2026-12-06)."""
    import comfy.model_management as mm

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model)
    if warm:
        sample(captured, conds, steps=4)

    def interrupt(step, *args):
        if step == 1:
            mm.interrupt_current_processing()

    hits = counters(gc).get("hits", 0)
    with pytest.raises(mm.InterruptProcessingException):
        sample(captured, conds, steps=4, callback=interrupt)
    run = last_run(gc)
    assert run["steps"] >= 2  # the summary is published on the way out
    assert run["hits"] == run["replays"] == (run["steps"] - 1 if warm else run["steps"] - 2), run
    assert counters(gc).get("hits", 0) - hits == run["hits"]
    assert torch.equal(sample(captured, conds, steps=4), sample(model, conds, steps=4))


def test_cancel_during_capture_keeps_nothing_half_built(gc, monkeypatch, tiny, conds):
    import comfy.model_management as mm
    import comfy.patcher_extension as patcher_extension

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    captured = capture(model)

    calls = []

    def cancel_first_forward(executor, *args, **kwargs):  # Python around the captured forward
        calls.append(1)
        if len(calls) == 1:
            mm.interrupt_current_processing()
        return executor(*args, **kwargs)

    captured.add_wrapper_with_key(patcher_extension.WrappersMP.DIFFUSION_MODEL, "test_cancel", cancel_first_forward)
    with pytest.raises(mm.InterruptProcessingException):
        sample(captured, conds, steps=3)
    snap = gc.STATS.handle.snapshot()
    assert snap["entries"] == 0 and snap["counters"].get("captures", 0) == 0
    assert torch.equal(sample(captured, conds, steps=3), sample(model, conds, steps=3))
    assert last_run(gc)["captures"] == 1


def test_step_cache_skips_do_not_replay_and_the_result_stays_the_same(gc, monkeypatch, tiny, conds):
    from comfy_extras.nodes_easycache import EasyCacheNode

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    easy = EasyCacheNode.execute(model, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0,
                                 verbose=False).args[0]
    plain = sample(easy, conds, steps=8)
    for outer in (capture(easy), EasyCacheNode.execute(capture(model), reuse_threshold=3.0, start_percent=0.0,
                                                       end_percent=1.0, verbose=False).args[0]):
        assert torch.equal(sample(outer, conds, steps=8), plain)
        run = last_run(gc)
        assert 1 <= run["steps"] < 8 and run["captures"] + run["replays"] == run["steps"]


@pytest.fixture(scope="module")
def trained_flux():
    import importlib

    return importlib.import_module(f"{rkharness.TINY.__name__}.trained_flux").build()


def teacache(model, thresh=0.4, rule="auto", mode="extrapolate", first_blocks=1):
    node = rkharness.pack("nodes.step_cache").TeaCacheNode
    return node.execute(model, "flux", thresh, 0.0, 1.0, 0, "device", mode, rule, 1.0, first_blocks).args[0]


def test_a_calibration_between_two_runs_of_one_captured_step_cache_rebuilds_its_graph(gc, monkeypatch, trained_flux,
                                                                                      conds, tmp_path):
    """The step cache's settings key a graph by identity, but the same settings resolve per run: with the
    defaults a Flux model runs TeaCache forecasting the output until it is calibrated, then the schedule rule
    with residuals. The graph kept from the first run replayed for the second, handing back the output where
    the run wanted residuals: the run failed ("not enough values to unpack"). The run's rule and mode key the
    graph too: it rebuilds, and the latent is the step cache's alone."""
    step = rkharness.pack("patches.step_cache")
    nodes_step = rkharness.pack("nodes.step_cache")
    monkeypatch.setattr(step, "STORE", rkharness.pack("caching.step_cache").CalibrationStore(tmp_path / "calib.json"))
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    cached = nodes_step.TeaCacheNode.execute(model=trained_flux).args[0]  # every input left at its default
    captured = capture(cached)
    assert torch.equal(sample(captured, conds, steps=10), sample(cached, conds, steps=10))
    assert step.stats().snapshot()["info"]["last_run"]["residual_mode"] == "output"
    sample(nodes_step.TeaCacheCalibrateNode.execute(trained_flux).args[0], conds, steps=20)
    alone = sample(cached, conds, steps=10)
    assert step.stats().snapshot()["info"]["last_run"]["rule"] == "schedule"
    assert torch.equal(sample(captured, conds, steps=10), alone)
    assert last_run(gc)["rebuilds"], last_run(gc)


@pytest.mark.parametrize("backend", ["emulate", "eager"])
@pytest.mark.parametrize("capture_first", [True, False])
@pytest.mark.parametrize("mode", ["extrapolate", "output"])
@pytest.mark.parametrize("rule,thresh", [("auto", 0.4), ("adaptive", 0.1)])
def test_teacache_decides_outside_the_graph_and_its_skips_never_replay(gc, monkeypatch, trained_flux, conds,
                                                                       backend, capture_first, mode, rule, thresh):
    """ReuseKit's TeaCache decides in a block patch, inside the forward: under capture it probes
    the forward eagerly up to that decision; a skip finishes there, a computed step replays and
    the graph hands back the residual the next skips add (output mode: the replay's output is what the
    next skips forecast from). Same latent as TeaCache alone. The adaptive rule alike: its checks read the
    replay's output."""
    stats = rkharness.pack("patches.step_cache").stats
    monkeypatch.setattr(gc, "FORCE_BACKEND", backend)
    both = (capture(teacache(trained_flux, thresh, rule, mode)) if capture_first
            else teacache(capture(trained_flux), thresh, rule, mode))
    for seed in (7, 11):  # the second run replays what the first one captured
        alone = sample(teacache(trained_flux, thresh, rule, mode), conds, steps=10, seed=seed)
        expected = stats().snapshot()["info"]["last_run"]
        assert torch.equal(sample(both, conds, steps=10, seed=seed), alone)
        tea, run = stats().snapshot()["info"]["last_run"], last_run(gc)
        assert (tea["calls_computed"], tea["calls_skipped"]) == (expected["calls_computed"], expected["calls_skipped"])
        assert run["bypasses"] == {} and run["step_cache_skips"] == tea["calls_skipped"] > 0
        computed = run["replays"] + run["captures"] + run["eager_steps"]
        assert computed == tea["calls_computed"] and run["steps"] == computed + run["step_cache_skips"]
        if backend == "emulate":  # an H step (the cond rows alone) runs eagerly, a whole call replays
            assert run["eager_steps"] == tea["calls_half"]
            assert run["captures"] == (1 if seed == 7 else 0)


@pytest.mark.parametrize("first_blocks", [1, 3])  # 3: into the single stream of the tiny Flux (2 + 2 blocks)
def test_first_block_decides_after_its_first_blocks_outside_the_graph(gc, monkeypatch, trained_flux, conds,
                                                                     first_blocks):
    """First-Block (and DBCache's Fn) decides after its first blocks: under capture the probe runs them
    eagerly up to the decision, a skip finishes there and a computed step replays the whole call. Same
    latent, same computed and skipped calls as alone."""
    stats = rkharness.pack("patches.step_cache").stats
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")

    def cached(model):
        return teacache(model, 0.3, "first_block", "reuse", first_blocks)

    both = capture(cached(trained_flux))
    for seed in (7, 11):
        alone = sample(cached(trained_flux), conds, steps=10, seed=seed)
        expected = stats().snapshot()["info"]["last_run"]
        assert torch.equal(sample(both, conds, steps=10, seed=seed), alone)
        tea, run = stats().snapshot()["info"]["last_run"], last_run(gc)
        assert (tea["calls_computed"], tea["calls_skipped"]) == (expected["calls_computed"], expected["calls_skipped"])
        assert tea["first_blocks"] == first_blocks and run["step_cache_skips"] == tea["calls_skipped"] > 0
        assert run["bypasses"] == {} and run["replays"] + run["captures"] == tea["calls_computed"]


@pytest.mark.parametrize("capture_first", [True, False])
def test_the_schedule_rules_cond_only_steps_run_eagerly_and_its_whole_steps_replay(gc, monkeypatch, trained_flux,
                                                                                  conds, capture_first):
    """The schedule rule's H steps run the blocks on the cond rows alone, which a graph of the whole call
    cannot replay: they run eagerly, the plan is the one it makes without capture, and so is the latent."""
    stats = rkharness.pack("patches.step_cache").stats
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    both = capture(teacache(trained_flux, 0.05, "schedule")) if capture_first \
        else teacache(capture(trained_flux), 0.05, "schedule")
    for seed in (7, 11):
        alone = sample(teacache(trained_flux, 0.05, "schedule"), conds, steps=10, seed=seed)
        expected = stats().snapshot()["info"]["last_run"]
        assert torch.equal(sample(both, conds, steps=10, seed=seed), alone)
        tea, run = stats().snapshot()["info"]["last_run"], last_run(gc)
        assert {c: tea["conds"][c]["pattern"] for c in tea["conds"]} == {
            c: expected["conds"][c]["pattern"] for c in expected["conds"]}
        assert tea["calls_half"] == expected["calls_half"] > 0 and run["eager_steps"] == tea["calls_half"]
        assert run["bypasses"] == {} and run["replays"] + run["captures"] == tea["calls_computed"] - tea["calls_half"]
    rows = [r for r in gc.STATS.handle.reasons() if r["source"] == "step_hook_half"]
    assert [(r["event"], r["count"]) for r in rows] == [("fallback", 2 * tea["calls_half"])]  # both seeds, counted


def test_teacache_over_another_nodes_block_patch_runs_eagerly(gc, monkeypatch, trained_flux, conds):
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    patched = trained_flux.clone()
    patched.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    alone = sample(teacache(patched), conds, steps=6)
    assert torch.equal(sample(capture(teacache(patched)), conds, steps=6), alone)
    run = last_run(gc)
    assert run["captures"] == 0 and set(run["bypasses"]) == {"transformer_patches"}


def test_a_partially_loaded_model_runs_eagerly_with_the_reason(gc, monkeypatch, tiny):
    """A real lowvram state (ComfyUI's partially_unload): weights move during the forward."""
    import comfy.model_management as mm
    import comfy.patcher_extension as patcher_extension

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = capture(tiny.tiny_flux(0))
    mm.load_models_gpu([model])
    try:
        model.partially_unload(model.offload_device, memory_to_free=model.model_size() // 2)
        assert model.model.model_lowvram
        options = patcher_extension.copy_nested_dicts(model.model_options["transformer_options"])
        options.update(wrappers=patcher_extension.copy_nested_dicts(model.wrappers), cond_or_uncond=[0])
        gen, dev = torch.Generator().manual_seed(0), model.load_device
        x, ctx, y = (torch.randn(*shape, generator=gen).to(dev) for shape in ((1, 16, 8, 8), (1, 77, 32), (1, 32)))
        t = torch.full((1,), 0.5, device=dev)
        kwargs = dict(c_crossattn=ctx, y=y, guidance=torch.full((1,), 3.5, device=dev))
        out = model.model.apply_model(x, t, transformer_options=options, **kwargs)
        assert counters(gc)["bypasses.partial_load"] == 1 and "captures" not in counters(gc)
        assert torch.equal(out, model.model.apply_model(x, t, transformer_options={}, **kwargs))
    finally:
        mm.unload_all_models()


@pytest.mark.parametrize("pe_first", [True, False])
def test_with_the_pe_cache_in_either_order_the_result_stays_the_same(gc, monkeypatch, tiny, conds, pe_first):
    PE = rkharness.pack("nodes.pe_cache").PECacheNode

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    plain = sample(model, conds, steps=4)
    both = capture(PE.execute(model).args[0]) if pe_first else PE.execute(capture(model)).args[0]
    assert torch.equal(sample(both, conds, steps=4), plain)
    run = last_run(gc)
    assert (run["captures"], run["replays"], run["bypasses"]) == (1, 3, {})
    # the PE cache steps aside while a forward is warmed up and captured: nothing made there is
    # kept (on CUDA: no host sync in its key compare, no table from the warm-up stream or the pool)
    pe_run = rkharness.pack("patches.rope").model_cache(model.model).stats.snapshot()["info"]["last_run"]
    assert pe_run["bypasses"] == 1 and pe_run["misses"] + pe_run["hits"] == 3


def test_constant_uploads_replay_wans_cpu_built_time_embedding_as_device_copies(gc):
    """Wan's time embedding moves a CPU ``arange`` to the device on every call, a host copy that
    a capture cannot hold: the warm-up records it, the capture gives a device copy of the record
    (here the "device" is ``meta``: the bookkeeping, without CUDA)."""
    from comfy.ldm.wan.model import sinusoidal_embedding_1d

    t = torch.rand(2, device="meta")
    uploads = gc.graph_runners.ConstantUploads()
    with uploads:  # the warm-up: real copies, recorded
        warm = sinusoidal_embedding_1d(16, t)
    assert len(uploads.records) == 1 and uploads.records[0][1].device.type == "meta"
    moved = uploads.records[0][1]
    uploads.replaying = True
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):  # below ConstantUploads: what reaches torch
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    with Spy(), uploads:
        again = sinusoidal_embedding_1d(16, t)
    assert again.shape == warm.shape and "to" not in seen and "clone" in seen  # no copy from the host
    assert uploads.records[0][1] is moved
    uploads._next = 0
    with uploads, pytest.raises(RuntimeError, match="differs from its warm-up"):
        sinusoidal_embedding_1d(32, t)  # another CPU source than recorded: not a constant
    mixed = gc.graph_runners.ConstantUploads()
    for replaying in (False, True):  # CPU -> CPU conversions run as they are, in their place
        mixed.replaying = replaying
        with mixed:
            assert torch.arange(3).to(torch.float32).dtype == torch.float32
            assert torch.arange(8).to(t).device.type == "meta"
    assert mixed.records[0] is None and len(mixed.records) == 2
    with mixed, pytest.raises(RuntimeError, match="differs from its warm-up"):
        torch.arange(8).to(t)  # one upload more than the warm-up made


def test_constant_uploads_replay_ltxs_tensor_built_from_host_data_as_device_copies(gc):
    """LTX scales its patch coordinates by ``torch.tensor(scale_factors, device=...)`` on every
    call, a copy of a Python list to the device: recorded in the warm-up, replayed as a device copy
    of the record, refused where the data differ (``meta`` stands for the device)."""
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

    coords = torch.zeros(1, 3, 4, device="meta")
    uploads = gc.graph_runners.ConstantUploads()
    with uploads:  # the warm-up
        warm = latent_to_pixel_coords(coords, (8, 32, 32))
    assert len(uploads.records) == 1 and torch.equal(uploads.records[0][0], torch.tensor((8, 32, 32)))
    uploads.replaying = True
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):  # below ConstantUploads: what reaches torch
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            seen.append((getattr(func, "__name__", ""), str(kwargs.get("device"))))
            return func(*args, **kwargs)

    with Spy(), uploads:
        again = latent_to_pixel_coords(coords, (8, 32, 32))
    assert again.shape == warm.shape and ("tensor", "meta") not in seen and ("clone", "None") in seen
    uploads._next = 0
    with uploads, pytest.raises(RuntimeError, match="differs from its warm-up"):
        latent_to_pixel_coords(coords, (4, 16, 16))  # other host data than recorded: not a constant
    host = gc.graph_runners.ConstantUploads()
    with host:  # built on the CPU, or from a device tensor: not an upload, nothing recorded
        torch.tensor([1.0, 2.0])
        torch.as_tensor(torch.ones(2, device="meta"), device="meta")
    assert host.records == []
    with host:  # numpy data is host data
        torch.tensor(__import__("numpy").arange(3), device="meta")
    assert len(host.records) == 1


def test_weight_wrappers_and_transformer_patches_run_eagerly_with_a_reason(gc, monkeypatch, tiny, conds):
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    wrapped = capture(model)
    wrapped.add_weight_wrapper("diffusion_model.img_in.weight", lambda w: w * 1.0)
    assert torch.equal(sample(wrapped, conds), sample(model, conds))
    assert last_run(gc)["bypasses"] == {"weight_wrappers": 3} and last_run(gc)["captures"] == 0

    def identity_patch(h, *args, **kwargs):  # a transformer patch runs Python inside the forward
        return h

    patched = capture(model)
    patched.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    assert torch.equal(sample(patched, conds), sample(model, conds))
    assert last_run(gc)["bypasses"] == {"transformer_patches": 3}


def test_disable_switches_env_node_and_setting(gc, monkeypatch, tiny, conds, caplog):
    settings = rkharness.pack("caching.settings").SETTINGS
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    plain = sample(model, conds)
    monkeypatch.setenv("REUSEKIT_DISABLE_CUDA_GRAPHS", "1")
    assert torch.equal(sample(capture(model), conds), plain)
    run = last_run(gc)
    assert run["backend"] == "disabled" and run["bypasses"] == {"disabled": 3} and run["captures"] == 0
    assert "checks" not in counters(gc)
    assert any("REUSEKIT_DISABLE_CUDA_GRAPHS" in n for n in run["notes"])
    monkeypatch.delenv("REUSEKIT_DISABLE_CUDA_GRAPHS")

    off = capture(capture(model), enable=False)  # the node's switch removes capture entirely
    assert not rkharness.pack("patches.graph_capture").is_enabled(off)
    before = gc.STATS.handle.snapshot()["counters"]
    assert torch.equal(sample(off, conds), plain)
    assert gc.STATS.handle.snapshot()["counters"] == before

    settings.set("graph_reuse.enabled", False)
    try:
        assert torch.equal(sample(capture(model), conds), plain)
        assert last_run(gc)["backend"] == "disabled"
    finally:
        settings.set("graph_reuse.enabled", True)


@pytest.mark.skipif(ON_CUDA, reason="the models are on CUDA here")
def test_without_cuda_it_says_so_once_in_the_log_the_stats_and_the_start_up_line(gc, tiny, conds, caplog,
                                                                                 monkeypatch):
    host = rkharness.pack("patches.host")
    monkeypatch.setattr(gc, "FORCE_BACKEND", None)
    monkeypatch.setattr(host, "_said", set())
    model = tiny.tiny_flux(0)
    with caplog.at_level(logging.INFO, logger="reusekit"):
        sample(capture(model), conds)
        sample(capture(model), conds)
    said = [r.getMessage() for r in caplog.records if "no CUDA" in r.getMessage()]
    assert len(said) == 1
    assert "no CUDA" in gc.STATS.handle.snapshot()["info"]["backend"]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ReuseKit graph: 3 forwards")]
    assert len(summary) == 2
    assert host.layers()["graph capture"] == ("eager: no CUDA", "")
    assert "graph capture eager: no CUDA" in host.startup_line("test")


def cuda_decisions(gc, monkeypatch):
    """The CUDA backend's decisions on this CPU: its runner is the ``emulate`` one (static buffers)."""
    monkeypatch.setattr(gc, "_backend", lambda device: "cuda")
    monkeypatch.setitem(gc.RUNNERS, "cuda", gc.graph_runners.StaticRunner)


def test_the_host_captures_no_diffusion_model_block_so_reusekit_does(gc, monkeypatch, tiny, conds):
    """ComfyUI 0.33's comfy/model_prefetch.py captures text-encoder layers only (under dynamic
    VRAM): a DiT's forward is captured by ReuseKit on both hosts."""
    cuda_decisions(gc, monkeypatch)
    model = tiny.tiny_flux(0)
    assert gc.host_captures_graphs(model.model.diffusion_model) is False
    plain = sample(model, conds)
    assert torch.equal(sample(capture(model), conds), plain)
    run = last_run(gc)
    assert run["backend"] == "cuda" and run["captures"] == 1 and run["replays"] == 2 and run["bypasses"] == {}


def test_a_model_whose_blocks_the_host_captures_runs_eagerly_with_the_reason(gc, monkeypatch, tiny, conds):
    """Where ComfyUI warms up (then captures) a block of this very model, ReuseKit does not capture
    around it until ComfyUI's end-of-prompt cleanup drops its graphs."""
    try:
        import comfy.model_prefetch as prefetch
    except ImportError:
        pytest.skip("this ComfyUI has no comfy.model_prefetch (per-block graphs, v0.33+)")
    cuda_decisions(gc, monkeypatch)
    model = tiny.tiny_flux(0)
    plain = sample(model, conds)
    dm = model.model.diffusion_model
    prefetch.GRAPH_WARMED_MODULES.add(dm.double_blocks[0])  # what prefetch_queue_pop records
    try:
        assert gc.host_captures_graphs(dm) is True
        other = tiny.tiny_flux(1).model.diffusion_model
        walks = []
        monkeypatch.setattr(other, "modules", lambda: walks.append(1) or torch.nn.Module.modules(other))
        # one of its modules, captured since (0.33's registry of captured blocks; later hosts keep the graph on
        # the block, which stays in the warmed set until the cleanup)
        captured = getattr(prefetch, "GRAPH_MODULES", prefetch.GRAPH_WARMED_MODULES)
        captured.add(other.double_blocks[0].img_attn)
        assert [gc.host_captures_graphs(other) for _ in range(3)] == [True] * 3
        captured.discard(other.double_blocks[0].img_attn)
        assert gc.host_captures_graphs(other) is False  # another model
        assert len(walks) == 1  # its modules gathered once: a forward's check walks the host's registries only
        assert torch.equal(sample(capture(model), conds), plain)
        run = last_run(gc)
        assert run["captures"] == 0 and run["bypasses"] == {"host_graphs": 3}
    finally:
        prefetch.cleanup_prefetch_queues()  # ComfyUI's own cleanup after every prompt
    assert gc.host_captures_graphs(dm) is False
    assert torch.equal(sample(capture(model), conds), plain)
    assert last_run(gc)["captures"] == 1


def test_a_model_under_dynamic_vram_runs_eagerly_with_the_reason_said_once(gc, monkeypatch, tiny, caplog):
    """ComfyUI's real ModelPatcherDynamic streams weights in during the forward: no capture."""
    import comfy.patcher_extension as patcher_extension
    from graph_helpers import dynamic_patcher

    host = rkharness.pack("patches.host")
    monkeypatch.setattr(host, "_said", set())
    cuda_decisions(gc, monkeypatch)
    base = tiny.tiny_flux(0)
    model = capture(dynamic_patcher(base))
    assert model.is_dynamic()
    model.pre_run()  # as ComfyUI does before sampling: the model's current patcher
    try:
        options = patcher_extension.copy_nested_dicts(model.model_options["transformer_options"])
        options.update(wrappers=patcher_extension.copy_nested_dicts(model.wrappers), cond_or_uncond=[0])
        gen = torch.Generator().manual_seed(0)
        x, ctx, y = (torch.randn(*shape, generator=gen) for shape in ((1, 16, 8, 8), (1, 77, 32), (1, 32)))
        t = torch.full((1,), 0.5)
        kwargs = dict(c_crossattn=ctx, y=y, guidance=torch.full((1,), 3.5))
        with caplog.at_level(logging.INFO, logger="reusekit"):
            outs = [model.model.apply_model(x, t, transformer_options=options, **kwargs) for _ in range(2)]
        assert counters(gc)["bypasses.dynamic_vram"] == 2 and "captures" not in counters(gc)
        eager = model.model.apply_model(x, t, transformer_options={}, **kwargs)
        assert all(torch.equal(out, eager) for out in outs)
        said = [r.getMessage() for r in caplog.records if "dynamic VRAM" in r.getMessage()]
        assert len(said) == 1
    finally:
        model.cleanup()


def test_unloading_through_the_dynamic_vram_patcher_releases_the_models_graphs(gc, monkeypatch, tiny, conds):
    from graph_helpers import dynamic_patcher

    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    model = tiny.tiny_flux(0)
    first = sample(capture(model), conds)
    assert gc.STATS.handle.snapshot()["entries"] == 1
    dynamic = dynamic_patcher(model)
    dynamic.unpatch_model(model.offload_device)  # its own full unload (super() keeps the weights)
    snap = gc.STATS.handle.snapshot()
    assert snap["entries"] == 0 and snap["counters"]["releases.unloaded"] == 1
    assert torch.equal(sample(capture(model), conds), first)


def test_weight_listeners_install_once_and_uninstall_releases(gc, tiny, conds, monkeypatch):
    lifecycle = rkharness.pack("patches.lifecycle")
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    captured = capture(tiny.tiny_flux(0))  # the node installs the listeners
    gc.graph_release.install()
    assert gc.graph_release.installed() and all(lifecycle._listeners[e].count(fn) == 1 for e, fn in gc.graph_release._LISTENERS)
    sample(captured, conds)
    assert gc.STATS.handle.snapshot()["entries"] == 1
    gc.graph_release.uninstall()
    assert not gc.graph_release.installed() and gc.STATS.handle.snapshot()["entries"] == 0
    gc.graph_release.uninstall()  # idempotent
    gc.graph_release.install()
    assert gc.graph_release.installed()


def test_a_host_whose_unload_is_reshaped_keeps_running_and_says_graphs_wait_for_a_clear(gc, monkeypatch, caplog):
    """A newer ComfyUI that reshaped ModelPatcher.unpatch_model: that listener stays off, one warning."""
    import comfy.model_patcher

    host = rkharness.pack("patches.host")
    lifecycle = rkharness.pack("patches.lifecycle")
    cls = comfy.model_patcher.ModelPatcher
    original = cls.__dict__["unpatch_model"]

    def unpatch_model(self, unpatch_weights=True, device_to=None):  # its parameters swapped
        return original(self, device_to, unpatch_weights)

    monkeypatch.setattr(host, "_said", set())
    monkeypatch.setattr(host, "_off", {})
    lifecycle.uninstall()
    try:
        with pytest.MonkeyPatch.context() as reshaped:
            reshaped.setattr(cls, "unpatch_model", unpatch_model)
            with caplog.at_level(logging.WARNING, logger="reusekit"):
                assert gc.graph_release.install() is False
                gc.graph_release.install()
            assert not lifecycle.wrapped(cls, "unpatch_model") and lifecycle.wrapped(cls, "load")
            assert cls.unpatch_model is unpatch_model
            warned = [r.getMessage() for r in caplog.records if "ModelPatcher.unpatch_model" in r.getMessage()]
            assert len(warned) == 1 and "(self, unpatch_weights, device_to)" in warned[0]
            assert host.layers()["graph capture"][1].endswith("graphs are released only when cleared")
    finally:
        lifecycle.uninstall()
        lifecycle.install()
        gc.graph_release.install()
    assert gc.graph_release.installed() and cls.unpatch_model is not unpatch_model


# ---- the nodes ---------------------------------------------------------------------------------

@pytest.mark.hardening
def test_capture_node_clones_and_validates(gc, tiny):
    graph = rkharness.pack("nodes.graph")
    model = tiny.tiny_flux(0)
    out = capture(model)
    assert out is not model and gc.is_enabled(out) and not gc.is_enabled(model)
    assert all(gc.KEY not in by_key for by_key in model.wrappers.values())
    assert any(gc.KEY in by_key for by_key in out.wrappers.values())
    with pytest.raises(ValueError, match="ReuseKit Graph Capture.*max_graphs"):
        graph.GraphCaptureNode.execute(model, enable=True, max_graphs=0)
    for wrong in ("not a model", tiny.tiny_clip(0).patcher):  # a CLIP's patcher failed deep in the sampler
        with pytest.raises(ValueError, match="ReuseKit Graph Capture: 'model' must be a MODEL"):
            graph.GraphCaptureNode.execute(wrong, enable=True, max_graphs=2)
    with pytest.raises(ValueError, match="ReuseKit Graph KSampler.*enable"):
        graph.GraphKSamplerNode.execute(model, 0, 2, 2.0, "euler", "simple", [], [], {"samples": torch.zeros(LATENTS["flux"])},
                                        1.0, "yes", 2)


def test_both_nodes_are_marked_experimental_in_schema_description_and_tooltip():
    graph = rkharness.pack("nodes.graph")
    for node in graph.NODES:
        schema = node.define_schema()
        assert schema.is_experimental is True, node
        assert schema.description.startswith("Experimental: never run on a GPU yet."), node
        switch = next(i for i in schema.inputs if getattr(i, "id", "") in ("enable", "enable_graphs"))
        assert "never run on a GPU yet" in switch.tooltip
        info = node.GET_NODE_INFO_V1()  # what the server's /object_info sends the frontend
        assert info["experimental"] is True and "never run on a GPU yet" in info["description"]


def graph_ksampler_prompt(seed=3):
    return {
        "1": {"class_type": "RKTestTinyCheckpoint", "inputs": {"family": "flux", "seed": 0}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a red square"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "ReuseKitGraphKSampler",
              "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                         "seed": seed, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0, "enable_graphs": True, "max_graphs": 2}},
        "6": {"class_type": "KSampler",
              "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                         "seed": seed, "steps": 3, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                         "denoise": 1.0}},
        "7": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["5", 0]}},
        "8": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["6", 0]}},
    }


def test_graph_ksampler_workflow_through_the_real_executor(gc):
    ex = rkharness.Executor()
    result = ex.run(graph_ksampler_prompt())
    assert "[graph] graph_reuse" in result["outputs"]["7"]["text"][0]

    def latent(node_id):
        return ex.output(node_id)[0][0]["samples"]

    assert torch.equal(latent("5"), latent("6"))
    assert last_run(gc)["hits"] == 2


@pytest.mark.workflows
def test_example_workflow_runs_on_tiny_models_with_the_same_image(gc):
    workflow = rkharness.load_workflow("graph_capture_flux.json")
    notes = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "Note"]
    assert notes and "What to expect" in notes[0]
    prompt = rkharness.workflow_to_prompt(workflow, overrides={"7": {"width": 64, "height": 64}})
    del prompt["11"]  # SaveImage: the tests write no files
    assert prompt["4"] == {"class_type": "ReuseKitGraphCapture",
                           "inputs": {"model": ["1", 0], "enable": True, "max_graphs": 2, "keep_graphs": True}}
    assert prompt["8"]["inputs"]["model"] == ["4", 0] and prompt["8"]["inputs"]["steps"] == 4
    ex = rkharness.Executor()
    text = ex.run(prompt)["outputs"]["12"]["text"][0]
    assert "[graph] graph_reuse" in text and "last_run" in text
    run = last_run(gc)
    assert run["steps"] == 4 and run["hits"] == 3 and run["rebuilds"] == {}
    image = ex.output("10")[0][0]

    plain = {k: v for k, v in prompt.items() if k != "4"}
    plain["8"] = {**prompt["8"], "inputs": {**prompt["8"]["inputs"], "model": ["1", 0]}}
    ex2 = rkharness.Executor()
    ex2.run(plain)
    assert torch.equal(ex2.output("10")[0][0], image)


@pytest.mark.workflows
def test_real_server_runs_graph_capture_and_the_panel_routes_show_and_switch_it(comfy_server):
    def graph_stats():
        (entry,) = [c for c in comfy_server.get("/reusekit/stats")["caches"] if c["name"] == "graph_reuse"]
        return entry

    assert graph_stats()["kind"] == "graph"  # listed before any run
    entry = comfy_server.wait_for_prompt(comfy_server.queue(graph_ksampler_prompt(seed=5)))
    assert entry["status"]["status_str"] == "success", entry["status"]
    stats = graph_stats()
    assert stats["info"]["last_run"]["steps"] == 3 and stats["counters"]["hits"] >= 2
    assert "no CUDA" in stats["info"]["backend"] or stats["info"]["last_run"]["backend"] == "cuda"
    comfy_server.post("/reusekit/settings", {"graph_reuse.enabled": False})
    try:
        entry = comfy_server.wait_for_prompt(comfy_server.queue(graph_ksampler_prompt(seed=6)))
        assert entry["status"]["status_str"] == "success"
        assert graph_stats()["info"]["last_run"]["backend"] == "disabled"
    finally:
        comfy_server.post("/reusekit/settings", {"graph_reuse.enabled": True})
    assert comfy_server.post("/reusekit/clear", {"cache": "graph_reuse"})["cleared"] == ["graph_reuse"]
    assert graph_stats()["entries"] == 0


def test_a_run_whose_sampler_calls_no_forward_through_the_seam_is_counted_unreached(gc, conds):
    """Causal-WAN's ar_video sampler calls the model outside ComfyUI's diffusion-model wrapper: nothing is
    captured or replayed, the run is ComfyUI's latent exactly, and it says why; its plain Wan forward under
    another sampler reaches the decision."""
    model, ar_video = importlib.import_module(f"{rkharness.TINY.__name__}.step_families").causal_wan_case(conds)
    assert torch.equal(ar_video(capture(model)), ar_video(model))
    run = last_run(gc)
    assert run["steps"] == 0 and run["bypasses"] == {"unreached": 1}
    assert counters(gc)["bypasses.unreached"] == 1
    (row,) = [r for r in gc.STATS.handle.snapshot()["reasons"] if r["source"] == "unreached"]
    assert row["event"] == "bypass" and "ar_video" in row["reason"] and row["count"] == 1
    plain = sample(model, conds, shape=(1, 16, 2, 8, 8))
    assert torch.equal(sample(capture(model), conds, shape=(1, 16, 2, 8, 8)), plain)
    assert last_run(gc)["steps"] > 0 and last_run(gc)["bypasses"] == {}


def test_mochi_and_a_torch_compiled_model_run_as_comfyui_runs_them_and_say_why(gc, conds, tiny):
    """Mochi's forward runs no DIFFUSION_MODEL wrapper, and a model under ComfyUI's torch.compile wrapper is
    left to it: no forward reaches the decision, the latent is ComfyUI's, and each run names why."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    families = importlib.import_module(f"{rkharness.TINY.__name__}.families")
    mochi = families.tiny_mochi(0)
    masked = tuple([[c, {**e, "attention_mask": torch.ones(c.shape[:2], dtype=torch.long)}] for c, e in cond]
                   for cond in conds)
    shape = (1, 12, 2, 8, 8)
    assert torch.equal(sample(capture(mochi), masked, shape=shape), sample(mochi, masked, shape=shape))
    assert last_run(gc)["steps"] == 0 and last_run(gc)["bypasses"] == {"unreached": 1}
    compiled = tiny.tiny_flux(0).clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    sample(capture(compiled), conds)
    assert last_run(gc)["steps"] == 0 and last_run(gc)["bypasses"] == {"torch_compile": 1}
    reasons = {r["source"]: r["reason"] for r in gc.STATS.handle.snapshot()["reasons"]}
    assert "as Mochi" in reasons["unreached"] and "torch.compile" in reasons["torch_compile"]


def test_a_step_cached_vace_under_capture_gives_the_step_caches_latent(gc, monkeypatch, conds):
    """Wan VACE with the step cache under graph capture: the probe finishes a skip without its control
    blocks, a computed call replays with them (the emulate runner), and the latent is the step cache's
    alone, bit for bit, run after run."""
    h = importlib.import_module(f"{rkharness.TINY.__name__}.step_families")
    node = rkharness.pack("nodes.step_cache").TeaCacheNode
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    cached = node.execute(h.tiny_wan_vace(0), rule="first_block", threshold=0.6, residual_mode="reuse").args[0]
    shape = (1, 16, 2, 8, 8)
    alone = sample(cached, conds, shape=shape, steps=6)
    skipped = rkharness.pack("patches.step_cache").stats().snapshot()["info"]["last_run"]["calls_skipped"]
    both = capture(cached)
    for _ in range(2):  # the second run replays what the first one captured
        assert torch.equal(sample(both, conds, shape=shape, steps=6), alone)
        run = last_run(gc)
        assert run["bypasses"] == {} and run["step_cache_skips"] == skipped > 0
    assert run["replays"] >= 1


@pytest.mark.parametrize("mode", ["reuse", "output"])
def test_a_step_cached_z_image_under_capture_gives_the_step_caches_latent(gc, monkeypatch, conds, mode):
    """Z-Image, whose blocks the step cache reaches through their class's forward (no block-replace seam):
    under graph capture the probe decides eagerly, a skip finishes there, a computed call replays (the
    emulate runner), and the latent is the step cache's alone, bit for bit, run after run."""
    spec = importlib.import_module(f"{rkharness.TINY.__name__}.families").family_spec("z_image")
    node = rkharness.pack("nodes.step_cache").TeaCacheNode
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    cached = node.execute(spec.build(0), rule="first_block", threshold=5.0, residual_mode=mode).args[0]
    alone = sample(cached, conds, steps=6)
    skipped = rkharness.pack("patches.step_cache").stats().snapshot()["info"]["last_run"]["calls_skipped"]
    both = capture(cached)
    for _ in range(2):  # the second run replays what the first one captured
        assert torch.equal(sample(both, conds, steps=6), alone)
        run = last_run(gc)
        assert run["bypasses"] == {} and run["step_cache_skips"] == skipped > 0
    assert run["replays"] >= 1


def test_two_step_caches_of_one_z_image_never_share_a_graph(gc, monkeypatch, conds):
    """Two step caches on one Z-Image model with other settings (the node run again after a change of its
    residual_mode): no block patch tells their calls apart, so their settings do; the second never replays
    the first one's graph (whose outputs are laid out for the first one's mode) and gives its own latent."""
    spec = importlib.import_module(f"{rkharness.TINY.__name__}.families").family_spec("z_image")
    node = rkharness.pack("nodes.step_cache").TeaCacheNode
    monkeypatch.setattr(gc, "FORCE_BACKEND", "emulate")
    base = spec.build(0)
    first, second = (node.execute(base, rule="first_block", threshold=5.0, residual_mode=mode).args[0]
                     for mode in ("reuse", "output"))
    alone = sample(second, conds, steps=6)
    sample(capture(first), conds, steps=6)
    assert torch.equal(sample(capture(second), conds, steps=6), alone)
    assert last_run(gc)["bypasses"] == {}



def test_the_graph_bench_runs_here_as_the_gpu_check_runs_it():
    """bench/graph_reuse.py is half of the GPU check (scripts/gpu_check.sh): a call into the pack that no longer
    fits it (with_capture's arguments changed on 2026-12-05 and the bench failed) fails here, not on a lent
    device. On the CPU its TeaCache run with capture gives TeaCache's latent exactly."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(rkharness.ROOT / "bench" / "graph_reuse.py")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max|diff| 0.0e+00" in done.stdout, done.stdout
    (result,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    fields = dict(field.split("=") for field in result.split()[1:])
    assert set(fields) == {"step_replay_over_eager", "check_us", "check_deep_over_tiny", "host_check_deep_over_tiny"}
