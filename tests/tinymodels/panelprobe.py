"""Test-only caches that report to ReuseKit's real stats registry, for the panel's tests.

They run in whatever process loads this folder (the test server included), so the panel shows real
numbers from real work before the pack's own caches exist:

- ``RKTestDecodeMemo`` (kind ``conditioning``): memoizes VAE decodes by latent content, in an LRU
  bounded by the settings ``rktest.memo_budget_mib`` and ``rktest.memo_max_entries`` (applied at
  once: shrinking evicts). Memory on tier ``cpu`` with its budget; hits, misses, evictions,
  bypasses, time saved.
- ``RKTestStepProbe`` (kind ``step``): counts the diffusion model's calls in each sampling run and
  keeps the last output (like a step cache's residual) on tier ``device``; ``info["last_run"]``.
- ``RKTestBlockReplace``: replaces one DiT block's patch with a pass-through, as other packs do.
- ``RKTestOddTheta``: object-patches the diffusion model's position embedder with a copy whose rotary
  base is an object no key can describe (as a custom node's scheduled theta would be): the PE cache
  runs it uncached and counts why.
- ``RKTestUndescribedEncode``: encodes a prompt with a fresh tiny CLIP holding an encoder setting no
  key can describe: the conditioning cache runs the encode uncached and counts why.

Both register lazily, on first use, in the pack that the loader imported (found by file path: this
folder is a separate package and must not import a second copy of the pack).
"""

from __future__ import annotations

import copy
import importlib
import sys
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

PACK_ROOT = Path(__file__).resolve().parents[2]
MEMO_CACHE = "rktest.decode_memo"
STEP_CACHE = "rktest.step_probe"
_lock = threading.Lock()
_instances: dict[type, object] = {}


def pack_module(sub: str):
    """``sub`` (e.g. ``caching.stats``) of the ReuseKit package that ComfyUI loaded in this process."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve() == PACK_ROOT / "__init__.py":
            return importlib.import_module(f"{name}.{sub}")
    raise RuntimeError("the ReuseKit pack is not loaded in this process")


class DecodeMemo:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, float]] = OrderedDict()
        self._settings = settings = pack_module("caching.settings").SETTINGS
        self.stats = pack_module("caching.stats").REGISTRY.register(
            MEMO_CACHE, "conditioning", "test-only: VAE decodes memoized by latent content", clear=self.clear)
        settings.define("rktest.memo_budget_mib", int, 64, "test-only decode memo budget (MiB)",
                        minimum=0, maximum=1024, on_change=lambda _: self.trim())
        settings.define("rktest.memo_max_entries", int, 8, "test-only decode memo entries",
                        minimum=1, maximum=64, on_change=lambda _: self.trim())
        self.trim()

    def budget_bytes(self) -> int:
        return self._settings.get("rktest.memo_budget_mib") * 2**20

    def trim(self):
        """Evict the oldest entries until the memo fits its settings, then report (settings first:
        never take the settings lock while holding the memo's)."""
        budget, limit = self.budget_bytes(), self._settings.get("rktest.memo_max_entries")
        with self._lock:
            held = sum(t.numel() * t.element_size() for t, _ in self._entries.values())
            while self._entries and (held > budget or len(self._entries) > limit):
                _, (tensor, _) = self._entries.popitem(last=False)
                held -= tensor.numel() * tensor.element_size()
                self.stats.incr("evictions")
            self.stats.set_memory("cpu", held, budget)
            self.stats.set_entries(len(self._entries))

    def clear(self):
        with self._lock:
            self._entries.clear()
        self.trim()

    def decode(self, vae, samples: torch.Tensor) -> torch.Tensor:
        token = getattr(vae, "_rktest_token", None) or str(uuid.uuid4())
        vae._rktest_token = token
        flat = samples.detach().to("cpu").contiguous()
        key = (token, tuple(flat.shape), str(flat.dtype), flat.numpy().tobytes())
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
        if found is not None:
            self.stats.incr("hits")
            self.stats.add_time_saved(found[1])
            return found[0].clone()
        start = time.perf_counter()
        image = vae.decode(samples)
        seconds = time.perf_counter() - start
        self.stats.incr("misses")
        if image.numel() * image.element_size() > self.budget_bytes():
            self.stats.incr("bypasses")
            return image
        with self._lock:
            self._entries[key] = (image.clone(), seconds)
        self.trim()
        return image


class StepProbe:
    def __init__(self):
        self._lock = threading.Lock()
        self.residual: torch.Tensor | None = None
        self.calls = 0
        self.stats = pack_module("caching.stats").REGISTRY.register(
            STEP_CACHE, "step", "test-only: diffusion-model calls per sampling run", clear=self.clear)

    def clear(self):
        with self._lock:
            self.residual = None
        self.stats.set_memory("device", 0)
        self.stats.set_entries(0)

    def outer_sample(self, executor, *args, **kwargs):
        self.calls = 0
        start = time.perf_counter()
        try:
            return executor(*args, **kwargs)
        finally:
            self.stats.incr("runs")
            self.stats.set_info("last_run", {"steps_computed": self.calls, "steps_skipped": 0,
                                             "seconds": round(time.perf_counter() - start, 4)})

    def diffusion_model(self, executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        with self._lock:
            self.calls += 1
            self.residual = out.detach().clone()
            nbytes = self.residual.numel() * self.residual.element_size()
        self.stats.incr("misses")
        self.stats.set_memory("device", nbytes)
        self.stats.set_entries(1)
        return out


def _shared(cls):
    """One instance per process of a probe (it registers a named cache: once only)."""
    with _lock:
        if cls not in _instances:
            _instances[cls] = cls()
        return _instances[cls]


def memo() -> DecodeMemo:
    return _shared(DecodeMemo)


def step_probe() -> StepProbe:
    return _shared(StepProbe)


class RKTestDecodeMemo:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    CATEGORY = "ReuseKit tests"

    @classmethod
    def IS_CHANGED(cls, samples, vae):
        return time.time()  # run on every prompt, so a repeated latent is a memo hit

    def decode(self, samples, vae):
        return (memo().decode(vae, samples["samples"]),)


class _ModelPatch:
    """A test node taking a MODEL and returning its patched clone (``patch``)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "ReuseKit tests"


class RKTestStepProbe(_ModelPatch):
    def patch(self, model):
        import comfy.patcher_extension as patcher_extension

        probe = step_probe()
        model = model.clone()
        model.add_wrapper_with_key(patcher_extension.WrappersMP.OUTER_SAMPLE, "rktest_probe", probe.outer_sample)
        model.add_wrapper_with_key(patcher_extension.WrappersMP.DIFFUSION_MODEL, "rktest_probe", probe.diffusion_model)
        return (model,)


class RKTestBlockReplace:
    """Replaces one DiT block's patch with a pass-through to the original block, as packs that wrap
    blocks do: placed after the step cache, it takes that block's patch from the cache."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "block_name": ("STRING", {"default": "double_block"}),
                             "index": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "ReuseKit tests"

    def patch(self, model, block_name, index):
        def passthrough(args, extra):
            return extra["original_block"](args)

        model = model.clone()
        model.set_model_patch_replace(passthrough, "dit", block_name, index)
        return (model,)


class OddTheta:
    """A rotary base that computes as its value does (``theta ** scale``) but that no key can describe."""

    def __init__(self, value):
        self.value = value

    def __pow__(self, other):
        return self.value ** other


class RKTestOddTheta(_ModelPatch):
    def patch(self, model):
        embedder = copy.copy(model.model.diffusion_model.pe_embedder)  # the model itself stays as it is
        embedder.theta = OddTheta(embedder.theta)
        model = model.clone()
        model.add_object_patch("diffusion_model.pe_embedder", embedder)
        return (model,)


class RKTestUndescribedEncode:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"text": ("STRING", {"default": "a red square"}), "seed": ("INT", {"default": 0, "min": 0})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    OUTPUT_NODE = True
    CATEGORY = "ReuseKit tests"

    def encode(self, text, seed):
        from . import tiny_clip

        clip = tiny_clip(seed)  # its own encoder: no other workflow's encodes change
        clip.cond_stage_model.clip_l.transformer.reusekit_test_setting = object()
        return (clip.encode_from_tokens_scheduled(clip.tokenize(text)),)


NODE_CLASS_MAPPINGS = {"RKTestDecodeMemo": RKTestDecodeMemo, "RKTestStepProbe": RKTestStepProbe,
                       "RKTestBlockReplace": RKTestBlockReplace, "RKTestOddTheta": RKTestOddTheta,
                       "RKTestUndescribedEncode": RKTestUndescribedEncode}


def probe_prompt(seed: int = 1, steps: int = 2, text: str = "a red square") -> dict:
    """A tiny Flux workflow (API format) through both probes and the Cache Stats node."""
    return {
        "1": {"class_type": "RKTestTinyCheckpoint", "inputs": {"family": "flux", "seed": 0}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": text}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "blurry"}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "RKTestStepProbe", "inputs": {"model": ["1", 0]}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["8", 0], "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "seed": seed, "steps": steps,
                                                   "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                                                   "denoise": 1.0}},
        "6": {"class_type": "RKTestDecodeMemo", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["6", 0]}},
    }
