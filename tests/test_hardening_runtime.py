"""Hardening in process: a soak under a small conditioning budget, a node failing mid-run, every
ReuseKit node input given bad values through ComfyUI's real validation and executor, and ReuseKit
beside core EasyCache, TorchCompileModel, LoRA loaders and model merging."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import rkharness
import torch

pytestmark = pytest.mark.hardening


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared CPU run ~10x faster with one torch thread (no contention)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def settings():
    """The pack's settings, put back as they were after the test."""
    registry = rkharness.pack("caching.settings").SETTINGS
    saved = {k: registry.get(k) for k in registry.snapshot()}  # values, not as shown (a URL redacted)
    yield registry
    registry.update(saved, trusted=True)  # the environment-only ones too


@pytest.fixture
def cache():
    cache = rkharness.pack("caching.conditioning").CACHE
    cache.clear()
    yield cache
    cache.clear()


def _shared(family="flux", seed=0):
    import nodes

    return nodes.NODE_CLASS_MAPPINGS["RKTestSharedTinyCheckpoint"]().load(family, seed)


def _sample(model, clip, seed=3, steps=3, text="a red square", negative="blurry", size=8):
    import nodes

    (pos,) = nodes.CLIPTextEncode().encode(clip, text)
    (neg,) = nodes.CLIPTextEncode().encode(clip, negative)
    latent = {"samples": torch.zeros(1, 16, size, size)}
    return nodes.common_ksampler(model, seed, steps, 3.5, "euler", "simple", pos, neg, latent)[0]["samples"]


def _pe(model):
    return rkharness.pack("nodes.pe_cache").PECacheNode.execute(model, True).result[0]


def _tea(model, device="device", mode="extrapolate"):
    node = rkharness.pack("nodes.step_cache").TeaCacheNode
    return node.execute(model, "auto", 0.0, 0.0, 1.0, 0, device, mode).result[0]


# ---- soak ---------------------------------------------------------------------------------------

def test_soak_under_a_small_budget_stays_within_it_and_rss_stays_flat(settings, cache):
    """400 text and VAE encodes (a quarter repeats) under a 1 MiB budget: the cache never holds more
    than the budget, evicts (and counts it), every hit equals a fresh encode, and the process's RSS
    grows by less than 48 MiB after a warm-up of 100."""
    import random

    import psutil

    import nodes

    settings.update({"conditioning.enabled": True, "conditioning.budget_mib": 1, "conditioning.max_entries": 64})
    _, clip, vae = _shared()
    rng = random.Random(9)
    words = ["red", "fox", "snow", "pine", "blue", "cat", "moss", "storm", "glass", "river", "night"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(150)]
    images = [torch.rand(1, rng.choice([32, 48, 64]), 32, 3, generator=torch.Generator().manual_seed(i))
              for i in range(40)]
    process = psutil.Process()
    rss = []
    for i in range(400):
        if i % 4 == 3:
            image = images[rng.randrange(len(images))]
            got = nodes.VAEEncode().encode(vae, image)[0]["samples"]
            if i % 40 == 3:
                settings.set("conditioning.enabled", False)
                assert torch.equal(got, nodes.VAEEncode().encode(vae, image)[0]["samples"])
                settings.set("conditioning.enabled", True)
        else:
            text = texts[rng.randrange(len(texts))]
            got = nodes.CLIPTextEncode().encode(clip, text)[0]
            if i % 40 == 0:
                settings.set("conditioning.enabled", False)
                want = nodes.CLIPTextEncode().encode(clip, text)[0]
                settings.set("conditioning.enabled", True)
                assert torch.equal(got[0][0], want[0][0])
                assert torch.equal(got[0][1]["pooled_output"], want[0][1]["pooled_output"])
        assert cache.total_bytes() <= cache.budget_bytes, (i, cache.total_bytes())
        assert len(cache) <= 64
        if i in (100, 399):
            rss.append(process.memory_info().rss)
    assert cache.count("hits") > 0 and cache.count("evictions") > 100, (cache.count("hits"), cache.count("evictions"))
    assert rss[1] - rss[0] < 48 << 20, f"RSS grew by {(rss[1] - rss[0]) >> 20} MiB over 300 encodes"


# ---- failures mid-run ---------------------------------------------------------------------------

class _FailAt:
    """A DIFFUSION_MODEL wrapper that raises on its ``n``-th call (a node failing mid-sampling)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, executor, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("rk test: failing mid-run")
        return executor(*args, **kwargs)


def test_a_failure_mid_sampling_leaves_no_stale_step_state(settings):
    """PE cache + TeaCache (threshold 0, both residual modes, both cache devices): sampling that fails
    on its third model call propagates that error, and the next run on the same cached model equals a
    run of the plain model with the pack's caches off."""
    import comfy.patcher_extension

    tiny = rkharness.TINY
    for device, mode in (("device", "extrapolate"), ("cpu", "reuse")):
        model = tiny.tiny_flux(4)
        clip = tiny.tiny_clip(4)
        settings.set("conditioning.enabled", False)
        want = _sample(model.clone(), clip)
        settings.set("conditioning.enabled", True)
        cached = _tea(_pe(model), device, mode)
        failing = cached.clone()
        failing.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "rk_test_fail", _FailAt(3))
        with pytest.raises(RuntimeError, match="rk test: failing mid-run"):
            _sample(failing, clip)
        assert torch.equal(_sample(cached, clip), want)
        assert torch.equal(_sample(cached, clip), want)


def test_an_encode_failing_midway_stores_nothing_and_the_retry_is_exact(settings, cache, monkeypatch):
    """A text encode that raises inside the encoder leaves no entry; the next encode is a miss whose
    output equals the uncached encode, and the one after it hits."""
    import comfy.sd1_clip

    import nodes

    settings.set("conditioning.enabled", True)
    clip = rkharness.TINY.tiny_clip(6)
    original = comfy.sd1_clip.SDClipModel.forward

    def broken(self, *args, **kwargs):
        raise RuntimeError("rk test: encoder failed")

    monkeypatch.setattr(comfy.sd1_clip.SDClipModel, "forward", broken)
    with pytest.raises(RuntimeError, match="encoder failed"):
        nodes.CLIPTextEncode().encode(clip, "a failing encode")
    assert len(cache) == 0
    monkeypatch.setattr(comfy.sd1_clip.SDClipModel, "forward", original)
    first = nodes.CLIPTextEncode().encode(clip, "a failing encode")[0]
    second = nodes.CLIPTextEncode().encode(clip, "a failing encode")[0]
    settings.set("conditioning.enabled", False)
    plain = nodes.CLIPTextEncode().encode(clip, "a failing encode")[0]
    assert torch.equal(first[0][0], plain[0][0]) and torch.equal(second[0][0], plain[0][0])
    assert cache.count("hits") >= 1


# ---- bad input through the real validation and executor ----------------------------------------

NAN, INF = float("nan"), float("inf")
BAD = {
    "INT": ["seven", 1.5, -1, 10 ** 400, NAN, INF, None, "", [], {}],
    "FLOAT": ["x", NAN, INF, -INF, -1.0, 1e308, None, "", []],
    "BOOLEAN": ["yes", 2, None, "", NAN, []],
    "COMBO": ["no such option", 3, "", None, "x" * 100_000],
}
SOURCES = {"MODEL": ["1", 0], "CLIP": ["1", 1], "VAE": ["1", 2], "CLIP_VISION": ["2", 0],
           "CONDITIONING": ["3", 0], "LATENT": ["4", 0]}
WRONG_LINK = {"MODEL": ["1", 1], "CLIP": ["1", 0], "VAE": ["1", 0], "CLIP_VISION": ["1", 2],
              "CONDITIONING": ["1", 0], "LATENT": ["1", 2]}


def _base_prompt() -> dict:
    return {"1": {"class_type": "RKTestSharedTinyCheckpoint", "inputs": {"family": "flux", "seed": 0, "text": "tiny"}},
            "2": {"class_type": "RKTestTinyCLIPVision", "inputs": {"seed": 0}},
            "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "bad input"}},
            "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}


def _reusekit_nodes() -> dict[str, dict]:
    """Each ReuseKit node type -> {input name: (type, options)}."""
    import nodes

    out = {}
    for name, cls in sorted(nodes.NODE_CLASS_MAPPINGS.items()):
        if name.startswith("ReuseKit"):
            spec = cls.INPUT_TYPES()
            # plain str types: 0.3.75's V3 type strings compare unequal to nothing (``!=`` is always False)
            out[name] = {k: (v[0] if isinstance(v[0], list) else str(v[0]), v[1] if len(v) > 1 else {})
                         for section in ("required", "optional") for k, v in spec.get(section, {}).items()}
    return out


def _valid(kind, options):
    """A good value for an input: its default, the first option, or a link of its type. A file list
    with no file here (a loader's) gets a name that is not one: the bad input's refusal is checked."""
    if isinstance(kind, list):
        return options.get("default", kind[0] if kind else "(no file here)")
    if kind == "COMBO":
        return options.get("default") or (options.get("options") or ["(no file here)"])[0]
    if kind in SOURCES:
        return SOURCES[kind]
    return options.get("default", {"INT": 1, "FLOAT": 0.0, "BOOLEAN": False}.get(kind))


def _node_prompt(class_type: str, inputs: dict, bad_name: str | None = None, bad_value=None) -> dict:
    """A prompt running ``class_type`` (node "9", read by a stats node) with good inputs but one (none:
    ``bad_name`` None)."""
    prompt = _base_prompt()
    values = {name: 2 if name == "steps" else _valid(kind, options)
              for name, (kind, options) in inputs.items() if kind != "*"}
    if bad_name is not None:
        values[bad_name] = bad_value
    prompt["9"] = {"class_type": class_type, "inputs": values}
    if class_type not in ("ReuseKitCacheStats", "ReuseKitConditioningCacheSettings"):  # not output nodes
        prompt["10"] = {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["9", 0]}}
    return prompt


def _cases():
    for class_type, inputs in _reusekit_nodes().items():
        for name, (kind, options) in inputs.items():
            if isinstance(kind, list):
                values = BAD["COMBO"]
            elif kind in BAD:  # a negative number is bad only under the input's minimum (-1: "auto")
                values = [v for v in BAD[kind] if not (isinstance(v, (int, float)) and v < 0
                                                        and (options or {}).get("min", 0) <= v)]
            elif kind in WRONG_LINK:
                values = [WRONG_LINK[kind], 5, "text", None]
            else:
                continue
            for value in values:
                yield class_type, name, value


def _run_bad(executor, prompt: dict):
    """(None, None) when the prompt ran; else where it was refused and the message."""
    import asyncio

    import execution

    prompt_id = str(uuid.uuid4())
    valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    if not valid[0]:
        return "validation", valid
    executor.executor.execute(prompt, prompt_id, {"client_id": None}, valid[2])
    if executor.executor.success:
        return None, None
    errors = [m for m in executor.executor.status_messages if m[0] == "execution_error"]
    return "execution", errors


def _state(settings, cache):
    return {k: v["value"] for k, v in settings.snapshot().items()}, len(cache), cache.total_bytes()


def _ksampler_inputs() -> set[str]:
    import nodes

    return set(nodes.KSampler.INPUT_TYPES()["required"]) - {"model"}


def test_every_reusekit_node_input_refuses_bad_values_clearly(settings, cache):
    """Wrong types, out of range, NaN/inf, huge and empty values and wrong links for every input of
    every ReuseKit node, through ComfyUI's real validation and executor: each of the pack's own inputs
    is refused with a message that names the node and the input, or is a value ComfyUI's validation
    coerces (a float for an INT, anything for a BOOLEAN); a sampler node's KSampler inputs fare as on
    core KSampler, but a value core KSampler runs on without an error (a NaN cfg) is refused, and so is a
    null one as the node runs (validation cannot tell it from a link). A node's own refusal is counted in the stats; it changes no setting, and a good
    prompt runs afterwards."""
    executor = rkharness.Executor(cache="none")
    nodes_spec = _reusekit_nodes()
    assert len(nodes_spec) >= 10, sorted(nodes_spec)
    import nodes

    ksampler_spec = {k: (v[0], v[1] if len(v) > 1 else {}) for k, v in nodes.KSampler.INPUT_TYPES()["required"].items()}
    shared = _ksampler_inputs()
    registry = rkharness.pack("caching.stats").REGISTRY

    def refusals():  # the refusals every cache counted, by the node that refused
        return sum(r["count"] for c in registry.snapshot()["caches"] for r in c.get("reasons") or []
                   if r["event"] == "refused")

    unclear, wrongly_accepted, unlike_core, uncounted, tried = [], [], [], [], 0
    for class_type, name, value in _cases():
        inputs = nodes_spec[class_type]
        before = _state(settings, cache)
        counted = refusals()
        where, detail = _run_bad(executor, _node_prompt(class_type, inputs, name, value))
        tried += 1
        shown = repr(value)[:40]
        if name in shared and "KSampler" in class_type:
            core_where, _ = _run_bad(executor, _node_prompt("KSampler", ksampler_spec, name, value))
            # what core KSampler runs on (a NaN cfg: a NaN latent) is refused by the node as it runs, as its own
            # inputs are; so is a null sampler_name, which reaches validation as a link does (None)
            later = (core_where is None or value is None) and where == "execution"
            if core_where != where and not later:
                unlike_core.append((class_type, name, shown, where, core_where))
            if not later:
                continue
        if where is None:
            kind = inputs[name][0]
            if not (kind == "BOOLEAN" or (kind == "INT" and isinstance(value, float) and math.isfinite(value))):
                wrongly_accepted.append((class_type, name, shown))
            continue
        if where == "validation":
            node_errors = detail[3]
            if "9" in node_errors:
                assert node_errors["9"]["class_type"] == class_type
                text = str(node_errors["9"]["errors"])
            else:  # refused as a prompt: must still name the input
                text = str(detail[1]) + str(node_errors)
        else:
            (message,) = detail
            text = f"{message[1].get('node_type')} {message[1].get('exception_message')}"
            if message[1].get("node_type") != class_type:
                unclear.append((class_type, name, shown, "failed in " + str(message[1].get("node_type"))))
                continue
            if refusals() == counted:  # refused by the node itself: in the stats beside the error
                uncounted.append((class_type, name, shown))
        if name not in text:
            unclear.append((class_type, name, shown, text[:300]))
        assert _state(settings, cache)[0] == before[0], (class_type, name, shown, "settings changed")
    assert tried > 150
    assert not unclear, f"{len(unclear)} of {tried} refusals do not name the input: {unclear}"
    assert not wrongly_accepted, f"accepted without a refusal: {wrongly_accepted}"
    assert not unlike_core, f"sampler inputs that fare unlike core KSampler: {unlike_core}"
    assert not uncounted, f"refused by the node but not counted in the stats: {uncounted}"
    prompt = _base_prompt() | {"9": {"class_type": "ReuseKitCacheStats", "inputs": {}}}
    assert _run_bad(executor, prompt) == (None, None)


SAMPLER_NODES = {"ReuseKitCachedKSampler": {}, "ReuseKitGraphKSampler": {"enable_graphs": True, "max_graphs": 2}}


def _sampler_prompt(class_type: str, **given) -> dict:
    """Node "9", a ReuseKit sampler node on the tiny Flux, its output read by a stats node; ``given``
    replaces inputs, ``("pass", value)`` handing ``value`` (or a link) on through a node of any type."""
    prompt = _base_prompt()
    inputs = {"model": ["1", 0], "seed": 3, "steps": 2, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["3", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0,
              **SAMPLER_NODES[class_type]}
    for i, (name, value) in enumerate(given.items()):
        if isinstance(value, tuple) and value[0] == "pass":
            prompt[str(20 + i)] = {"class_type": "RKTestPass", "inputs": {"value": value[1]}}
            value = [str(20 + i), 0]
        inputs[name] = value
    prompt["9"] = {"class_type": class_type, "inputs": inputs}
    prompt["10"] = {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["9", 0]}}
    return prompt


@pytest.mark.parametrize("class_type", sorted(SAMPLER_NODES))
def test_a_sampler_nodes_linked_sampler_and_scheduler_run_as_written_ones(class_type):
    """A sampler_name or scheduler that comes through a link reaches validation as None: it is checked when
    the node runs, as core KSampler takes it (it was refused as "None is not one of"); the run gives the
    latent the same values written in the prompt give, and a linked name this ComfyUI lacks is refused there,
    naming the node and the input."""
    executor = rkharness.Executor(cache="classic")

    def latent(**given):
        executor.run(_sampler_prompt(class_type, **given))
        return executor.output("9")[0][0]["samples"]

    written = latent(sampler_name="heun", scheduler="karras")
    assert not torch.equal(written, latent())  # the two inputs matter here
    assert torch.equal(latent(sampler_name=("pass", "heun"), scheduler=("pass", "karras")), written)
    node = {"ReuseKitCachedKSampler": "ReuseKit Cached KSampler", "ReuseKitGraphKSampler": "ReuseKit Graph KSampler"}[
        class_type]
    for name in ("sampler_name", "scheduler"):
        where, detail = _run_bad(executor, _sampler_prompt(class_type, **{name: ("pass", "no_such_one")}))
        assert where == "execution", (name, where, detail)
        message = detail[0][1]
        assert message["node_type"] == class_type
        assert f"{node}: {name}: 'no_such_one' is not one of" in message["exception_message"]


@pytest.mark.parametrize("class_type", sorted(SAMPLER_NODES))
def test_a_sampler_nodes_wrong_conditioning_latent_or_nan_is_refused_naming_the_input(class_type):
    """What core KSampler fails on deep inside ComfyUI (a LATENT as ``positive``: "'str' object has no
    attribute 'copy'", a CONDITIONING as ``latent_image``), or runs on without an error (a NaN ``cfg`` gives
    a NaN latent), is refused by the node as it runs: the error names the node and the input, and the
    refusal is counted in the stats."""
    executor = rkharness.Executor(cache="classic")
    registry = rkharness.pack("caching.stats").REGISTRY

    def refusals():  # every refusal counted (past a cache's row limit a new reason joins its "other" row)
        return sum(r["count"] for c in registry.snapshot()["caches"] for r in c.get("reasons") or []
                   if r["event"] == "refused")

    cases = [("positive", ("pass", ["4", 0])), ("negative", ("pass", ["4", 0])), ("latent_image", ("pass", ["3", 0])),
             ("cfg", math.nan), ("denoise", math.nan),
             # linked values ComfyUI neither converts nor range-checks: core KSampler gives a NaN latent for an
             # infinite cfg, runs a denoise of 2 as 1 and a denoise of -1 as no sampling, and fails deep inside
             # on a string seed or a negative step count
             ("cfg", ("pass", math.inf)), ("denoise", ("pass", 2.0)), ("denoise", ("pass", -1.0)),
             ("steps", ("pass", -1)), ("steps", ("pass", 2.0)), ("seed", ("pass", "x")), ("seed", ("pass", True)),
             ("seed", ("pass", 2 ** 1100)),  # past a float's range: compared exactly, never converted
             ("latent_image", ("pass", {"samples": "x"}))]
    for name, value in cases:
        counted = refusals()
        where, detail = _run_bad(executor, _sampler_prompt(class_type, **{name: value}))
        assert where == "execution", (name, where, detail)
        message = detail[0][1]
        assert message["node_type"] == class_type, (name, message)
        assert f": {name} must be a" in message["exception_message"], (name, message["exception_message"])
        assert refusals() == counted + 1, name
    nan_core = _sampler_prompt(class_type, cfg=math.nan)
    nan_core["9"] = {"class_type": "KSampler", "inputs": {k: v for k, v in nan_core["9"]["inputs"].items()
                                                         if k not in SAMPLER_NODES[class_type]}}
    assert _run_bad(executor, nan_core) == (None, None)  # core KSampler: a NaN latent, no error
    assert torch.isnan(executor.output("9")[0][0]["samples"]).all()
    assert _run_bad(executor, _sampler_prompt(class_type)) == (None, None)  # and a good prompt runs


def test_the_sampler_nodes_take_what_core_ksampler_takes():
    """The linked-value checks refuse nothing ComfyUI's sampler handles: a nested latent (LTX-2's audio and
    video), an audio latent of 3 dimensions, NumPy numbers, a denoise of 0, a seed of 2**64 - 1."""
    import comfy.nested_tensor

    check = rkharness.pack("nodes").SamplerInputs.check_inputs
    stats = rkharness.pack("caching.stats").REGISTRY.register("rk_test_sampler_inputs", "graph", "test")
    cond = [[torch.zeros(1, 4, 8), {}]]
    video_audio = comfy.nested_tensor.NestedTensor([torch.zeros(1, 4, 2, 8, 8), torch.zeros(1, 8, 16)])
    for latent, seed, steps, cfg, denoise in (({"samples": video_audio}, np.int64(5), np.int32(2), np.float32(3.5), 0.0),
                                              ({"samples": torch.zeros(1, 64, 32)}, 2 ** 64 - 1, 1, 0, 1)):
        check(stats, seed=seed, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple", positive=cond,
              negative=cond, latent_image=latent, denoise=denoise)


def test_the_settings_nodes_linked_inputs_are_checked_before_they_apply():
    """Linked values reach the settings node unconverted: a string "false" for ``clear`` cleared the cache
    silently, a LATENT linked twice failed with a bare tensor-comparison error the second time, and a linked
    ``True`` as ``budget_mib`` was applied or refused depending on the previous run. Each is now refused,
    naming the node and the input, and nothing is applied; a linked NumPy integer is a whole number, as for
    the sampler nodes."""
    settings = rkharness.pack("caching.settings").SETTINGS
    cache = rkharness.pack("caching.conditioning").CACHE
    saved = {k: settings.get(k) for k in ("conditioning.enabled", "conditioning.budget_mib", "conditioning.max_entries")}
    executor = rkharness.Executor(cache="none")

    def prompt(**given):
        inputs = {"global_mode": True, "budget_mib": 512, "max_entries": 128, "clear": False}
        p = _base_prompt()
        for i, (name, value) in enumerate(given.items()):
            p[str(20 + i)] = {"class_type": "RKTestPass", "inputs": {"value": value}}
            inputs[name] = [str(20 + i), 0]
        p["9"] = {"class_type": "ReuseKitConditioningCacheSettings", "inputs": inputs}
        return p

    try:
        assert _run_bad(executor, prompt()) == (None, None)
        rkharness.TINY.tiny_clip(0).encode_from_tokens(rkharness.TINY.tiny_clip(0).tokenize("kept"))
        held = len(cache)
        assert held >= 1
        for name, value in (("clear", "false"), ("clear", ["4", 0]), ("clear", ["4", 0]), ("global_mode", "no"),
                            ("budget_mib", True), ("max_entries", 2.5), ("budget_mib", -1)):
            where, detail = _run_bad(executor, prompt(**{name: value}))
            assert where == "execution", (name, value, where, detail)
            text = detail[0][1]["exception_message"]
            assert text.startswith(f"ReuseKit Conditioning Cache Settings: {name} must be"), text
            assert "tensor(" not in text and len(text) < 200, text
            assert len(cache) == held and settings.get("conditioning.budget_mib") == 512
        assert _run_bad(executor, prompt(budget_mib=np.int64(256))) == (None, None)  # a NumPy number is a number
        assert settings.get("conditioning.budget_mib") == 256
    finally:
        settings.update(saved)


UNKNOWN_CHECKED = ("ReuseKitCacheStats", "ReuseKitCachedCLIP", "ReuseKitCachedCLIPVision", "ReuseKitCachedKSampler",
                   "ReuseKitCachedVAE", "ReuseKitConditioningCacheSettings", "ReuseKitDemoDecode", "ReuseKitDemoFlux",
                   "ReuseKitDemoPromptBatch", "ReuseKitDemoWan", "ReuseKitGraphCapture", "ReuseKitGraphKSampler",
                   "ReuseKitPECache", "ReuseKitPromptBatch", "ReuseKitTeaCache", "ReuseKitTeaCacheCalibrate")


def test_every_node_is_checked_for_unknown_inputs():
    """Here, or the lazy loaders, which need files, in tests/test_lazy_clip.py."""
    lazy = {"ReuseKitLazyCLIPLoader", "ReuseKitLazyDualCLIPLoader", "ReuseKitLazyTripleCLIPLoader"}
    assert set(UNKNOWN_CHECKED) | lazy == set(_reusekit_nodes())


@pytest.mark.parametrize("linked", [True, False], ids=["linked", "written"])
@pytest.mark.parametrize("class_type", UNKNOWN_CHECKED)
def test_an_input_the_node_does_not_have_is_refused_naming_it(class_type, linked, settings):
    """ComfyUI hands the node every linked input: the step cache and conditioning nodes ignored a linked typo
    ('treshold') without a word, the others (the demo, prompt batch and stats nodes until 2026-12-06) failed
    with a TypeError naming their Python class. ComfyUI drops an unknown value written in the prompt: until
    2026-12-06 every node ran without it, a step cache given ``"thresold": 0`` skipping steps at its default
    threshold. Each refuses either naming the node and the input, counted in the stats; a good prompt runs."""
    executor = rkharness.Executor(cache="none")
    registry = rkharness.pack("caching.stats").REGISTRY

    def refusals():  # every refusal counted (past a cache's row limit a new reason joins its "other" row)
        return sum(r["count"] for c in registry.snapshot()["caches"] for r in c.get("reasons") or []
                   if r["event"] == "refused")

    prompt = _node_prompt(class_type, _reusekit_nodes()[class_type])
    assert _run_bad(executor, prompt) == (None, None)
    if linked:
        prompt["20"] = {"class_type": "RKTestPass", "inputs": {"value": 0.9}}
    prompt["9"]["inputs"]["treshold"] = ["20", 0] if linked else 0.9
    counted = refusals()
    where, detail = _run_bad(executor, prompt)
    assert where == "execution", detail
    message = detail[0][1]
    assert message["node_type"] == class_type, message
    assert ": 'treshold' is not an input of this node" in message["exception_message"], message["exception_message"]
    assert refusals() == counted + 1


# ---- coexistence --------------------------------------------------------------------------------

def _uncached(settings, fn):
    settings.set("conditioning.enabled", False)
    try:
        return fn()
    finally:
        settings.set("conditioning.enabled", True)


def test_lora_and_model_merging_under_every_cache_are_exact(settings, tmp_path):
    """LoraLoader, then ModelMergeSimple of two tiny Flux models, then PE cache and TeaCache at
    threshold 0, with the conditioning cache on: the same latent as the chain without ReuseKit."""
    import comfy.sd
    import comfy.utils
    import folder_paths
    from comfy_extras.nodes_model_merging import ModelMergeSimple

    loras = __import__(f"{rkharness.TINY.__name__}.conditioning", fromlist=["write_lora"])
    name = loras.write_lora("rk_hardening_merge.safetensors", seed=21)
    lora = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", name), safe_load=True)
    tiny = rkharness.TINY
    a, b, clip = tiny.tiny_flux(1), tiny.tiny_flux(2), tiny.tiny_clip(1)
    for strength in (0.0, 0.8, -1.3):
        model, lclip = comfy.sd.load_lora_for_models(a, clip, lora, strength, strength + 0.5)
        (merged,) = ModelMergeSimple().merge(model, b, 0.3)
        want = _uncached(settings, lambda: _sample(merged, lclip))
        settings.set("conditioning.enabled", True)
        got = _sample(_tea(_pe(merged)), lclip)
        again = _sample(_tea(_pe(merged)), lclip)
        assert torch.equal(got, want) and torch.equal(again, want), strength


def test_core_easycache_beside_reusekit_works_or_refuses_clearly(settings):
    """Core EasyCache stacked with ReuseKit PE cache and TeaCache (both orders): the run either
    finishes with the same latent as EasyCache alone, or fails with a message naming ReuseKit."""
    try:
        from comfy_extras.nodes_easycache import EasyCacheNode
    except ImportError:
        pytest.skip("this ComfyUI has no comfy_extras.nodes_easycache.EasyCacheNode")
    model, clip = rkharness.TINY.tiny_flux(3), rkharness.TINY.tiny_clip(3)

    def easy(m):
        return EasyCacheNode.execute(m, 0.2, 0.15, 0.95, False).result[0]

    want = _sample(easy(model), clip, steps=6)
    for chain in (lambda m: _tea(_pe(easy(m))), lambda m: easy(_tea(_pe(m)))):
        try:
            got = _sample(chain(model), clip, steps=6)
        except Exception as exc:  # a refusal must say who refused and why
            assert "ReuseKit" in str(exc), exc
            continue
        assert torch.equal(got, want)


def test_torch_compile_model_constructs_beside_reusekit():
    """TorchCompileModel (constructed, not compiled: compiling takes minutes on a CPU) accepts a model
    carrying the PE cache and TeaCache, and ReuseKit accepts its output."""
    try:
        from comfy_extras.nodes_torch_compile import TorchCompileModel
    except ImportError:
        pytest.skip("this ComfyUI has no comfy_extras.nodes_torch_compile.TorchCompileModel")
    model = rkharness.TINY.tiny_flux(5)
    node = TorchCompileModel()
    patch = getattr(node, "patch", None) or getattr(TorchCompileModel, "execute")
    out = patch(_tea(_pe(model)), "inductor")
    compiled = out[0] if isinstance(out, tuple) else out.result[0]
    assert compiled is not model and _tea(_pe(compiled)) is not compiled
    assert math.isfinite(float(model.model.diffusion_model.img_in.weight.sum()))


def _tiny_flux_controlnet(seed: int):
    """A real ``comfy.controlnet.ControlNet`` around a tiny ``ControlNetFlux`` (InstantX-style latent
    input), shaped like the tiny Flux, weights from ``seed``."""
    import comfy.controlnet
    import comfy.latent_formats
    import comfy.ldm.flux.controlnet
    import comfy.model_management as mm
    import comfy.ops

    cfg = dict(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64, mlp_ratio=4.0,
               num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[8, 12, 12], theta=10000, patch_size=2,
               qkv_bias=True, guidance_embed=True)
    cfg = rkharness.TINY.with_host_fields(cfg, "comfy.ldm.flux.model:FluxParams")
    model = comfy.ldm.flux.controlnet.ControlNetFlux(latent_input=True, control_latent_channels=16,
                                                     operations=comfy.ops.disable_weight_init,
                                                     device="cpu", dtype=torch.float32, **cfg)
    rkharness.TINY.fill_weights(model, seed)
    return comfy.controlnet.ControlNet(model, compression_ratio=1, latent_format=comfy.latent_formats.Flux(),
                                      load_device=mm.get_torch_device(), manual_cast_dtype=None,
                                      extra_conds=["y", "guidance"])


def test_controlnet_beside_every_cache_is_exact(settings):
    """A tiny Flux ControlNet (hint VAE-encoded) applied with ControlNetApplyAdvanced, sampling a model
    with PE cache and TeaCache at threshold 0 and the conditioning cache on: the same latent as the
    plain model with the pack's caches off."""
    import nodes

    rkharness.forget_dropped_clones()  # ControlNet's VAE hint reloads loaded_models(), which lists them as None
    tiny = rkharness.TINY
    model, clip, vae = tiny.tiny_flux(8), tiny.tiny_clip(8), tiny.tiny_vae(8)
    control = _tiny_flux_controlnet(9)
    hint = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(2))
    latent = {"samples": torch.zeros(1, 16, 8, 8)}

    def run(m):
        (pos,) = nodes.CLIPTextEncode().encode(clip, "a controlled square")
        (neg,) = nodes.CLIPTextEncode().encode(clip, "")
        pos, neg = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control, hint, 0.8, 0.0, 1.0, vae=vae)
        return nodes.common_ksampler(m, 11, 3, 3.5, "euler", "simple", pos, neg, latent)[0]["samples"]

    want = _uncached(settings, lambda: run(model))
    plain_wo_control = _uncached(settings, lambda: _sample(model, clip, seed=11, text="a controlled square", negative=""))
    assert not torch.equal(want, plain_wo_control)  # the ControlNet really changed the result
    assert torch.equal(run(_tea(_pe(model))), want)
    assert torch.equal(run(_tea(_pe(model))), want)
