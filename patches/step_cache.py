"""The step cache (TeaCache, MagCache, First-Block-Cache rules) on ComfyUI's seams: ModelPatcher
wrappers and the block-replace patches. No core forward is copied.

- OUTER_SAMPLE wrapper: one :class:`~..caching.step_cache.RunState` per sampling run (so a second
  run, a split sampler or a hires pass starts clean), the resolved rule, threshold, residual mode
  and tables, and at the end one log line, the stats and (when calibrating) the fitted tables.
- DIFFUSION_MODEL wrapper: one model call; knows the conds in the batch (``uuids``) and whether
  the current sigma is inside the start/end window.
- ``patches_replace["dit"]`` block patches on the first and every later block (a family whose forward
  has no such seam, Lumina 2 / Z-Image and Cosmos Predict2 / Anima: its block class's forward, wrapped
  once, reaching the blocks of the model a step-cached call runs and nothing else): the first block
  decides (teacache: from the modulated input, magcache: from sigma, interval and adaptive: from the count of
  calls, before it runs; first_block: from its own residual, after it runs); on a skip every later
  block passes its input through and the last one adds the stored residual (or its forecast); on a
  computed call the last one makes the new residual.

The per-family code is in :mod:`.step_families`: where the modulated input is and which blocks make
up the stack.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..caching import step_cache as tc
from ..caching import step_schedule, weights_identity
from ..caching.protocol import GRAPH_KEY, GRAPH_SAFE, STEP_HOOK, transformer_options
from ..caching.stats import REGISTRY
from ..caching.weights_identity import WeightsIdentity
from . import host, step_families
from .step_families import Family, _resolve, detect_family

log = logging.getLogger("reusekit")

KEY = "reusekit_teacache"          # wrapper key and transformer_options key of the node's settings
RUN_KEY = "reusekit_teacache_run"  # transformer_options key of the current run's state
# transformer_options key of what shapes a captured forward of the run (rule, mode, first blocks, calibrating):
# graph capture keys it by value, as the same settings may resolve otherwise from one run to the next
PLAN_KEY = "reusekit_teacache_plan"
CALL_KEY = STEP_HOOK            # the current call; graph capture drives it (a skip never replays)

PATCHER = (("comfy.model_patcher:ModelPatcher.set_model_patch_replace", ("patch", "name", "block_name", "number")),
           ("comfy.model_patcher:ModelPatcher.add_wrapper_with_key", ("wrapper_type", "key", "wrapper")),
           ("comfy.model_patcher:ModelPatcher.remove_wrappers_with_key", ("wrapper_type", "key")))
WRAPPERS = "comfy.patcher_extension:WrappersMP"  # the wrapper kinds apply() adds

TYPE_FAMILY = {"flux": "flux", "flux-kontext": "flux", "hunyuan_video": "hunyuan_video", "ltxv": "ltxv", "mochi": "mochi",
               **{k: "wan" for k in (*tc.COEFFICIENTS, *tc.MAG_RATIOS) if k.startswith("wan")}}
MODEL_TYPES = ("auto", "calibrated", *dict.fromkeys((*tc.COEFFICIENTS, *tc.MAG_RATIOS)))
RULES = ("auto", *tc.RULES)
RESIDUAL_MODES = ("auto", *tc.RESIDUAL_MODES)


# ---- stats and calibration storage -------------------------------------------------------

def stats():
    """The step cache's stats handle (registered by its first run)."""
    return REGISTRY.register("teacache", "step", "TeaCache: skips transformer steps by reusing the last residual")


def _default_store_path() -> Path | None:
    try:
        import folder_paths

        return Path(folder_paths.get_user_directory()) / "reusekit" / "teacache_calibration.json"
    except Exception:  # no user directory on this host: keep calibrations in memory
        return None


STORE = tc.CalibrationStore(_default_store_path())


def model_identity(model_patcher, family: Family) -> tuple[str, WeightsIdentity]:
    """(the calibration store's key: family and weight structure, the weights' identity), read from
    the weights as loaded, not as patched by the LoRA of whichever clone of this model sampled last."""
    backup = getattr(model_patcher, "backup", None) or {}
    named = ((n, getattr(backup.get(f"diffusion_model.{n}"), "weight", t))
             for n, t in model_patcher.model.diffusion_model.named_parameters())
    ident = weights_identity.identity(named)
    return f"{family.name}:{ident.structure}", ident


def calibration_keys(model_patcher, base_key: str, conds: dict | None = None) -> tuple[str, str | None]:
    """(the key this clone's calibration is kept under, the base model's key to read where it has none):
    a clone with weight patches (a LoRA), or a run whose conds carry hooks (a LoRA through Create Hook LoRA),
    keeps its own, under their digest, so calibrating it never replaces the base model's; (base_key, None)
    without either."""
    key = base_key
    patched = weights_identity.patches_digest(getattr(model_patcher, "patches", None) or {})
    if patched is not None:
        key += f":patches {patched}"
    hooked = weights_identity.hooks_digest(*_cond_hooks(conds))
    if hooked is not None:
        key += f":hooks {hooked}"
    return (base_key, None) if key == base_key else (key, base_key)


def _cond_hooks(conds: dict | None) -> tuple[list, tuple]:
    """The hooks the run's conds carry, each once, in the conds' order; and where: per cond (its name and
    place), the hooks it carries (by their place in that list) and the part of the run it covers. A hook on the
    positive alone computes otherwise than on both."""
    hooks, at, placement = [], {}, []
    for name in sorted(conds or {}):
        for i, cond in enumerate(conds[name] or ()):
            carried = getattr(cond.get("hooks") if isinstance(cond, dict) else None, "hooks", None) or ()
            for hook in carried:
                if id(hook) not in at:
                    at[id(hook)] = len(hooks)
                    hooks.append(hook)
            if carried:
                placement.append((name, i, tuple(at[id(h)] for h in carried),
                                  repr(cond.get("start_percent")), repr(cond.get("end_percent"))))
    return hooks, tuple(placement)


def model_fingerprint(model_patcher, family: Family) -> str:
    """A model's name in the stats and reports: a digest of its weights' identity."""
    return tc.identity_digest(model_identity(model_patcher, family)[1])


# ---- the settings the node attaches ------------------------------------------------------

class Settings:
    """The node's settings in transformer_options: the config, the family, the blocks the cache patched and
    the class of the diffusion model it patched them on. Immutable, so clones share it (deepcopy too); a
    graph's signature holds it by identity."""

    def __init__(self, config: tc.StepCacheConfig, family: Family, blocks: tuple[tuple[str, int], ...],
                 model_class: type):
        self.config, self.family, self.blocks, self.model_class = config, family, blocks, model_class

    def foreign(self, dm) -> str | None:
        """Why a call on ``dm`` is not one the cache may skip: another model run under these options (the Dual
        Model CFG Guider runs its negative model with the main model's), whose blocks are not the ones the
        patches were placed for (a deeper model would run its blocks past our last one on top of a reused
        residual). None where ``dm`` is of the patched class with the same blocks (a multi-GPU copy, say), or is
        such a model compiled (TorchCompileModel swaps in the OptimizedModule around it while a call runs)."""
        inner = getattr(dm, "_orig_mod", None)
        dm = inner if isinstance(inner, torch.nn.Module) else dm
        if type(dm) is self.model_class and tuple(self.family.blocks(dm)) == self.blocks:
            return None
        return (f"a call on another model ({type(dm).__name__}, its blocks not the {len(self.blocks)} the step cache "
                f"patched: the Dual Model CFG Guider's negative model, say) was computed")

    def __deepcopy__(self, memo):
        return self


setattr(Settings, GRAPH_KEY, True)


def _seams_fit(family: Family) -> bool:
    """The host's seams that ``family`` uses have the expected shape (else one warning says which)."""
    feature = f"TeaCache ({family.name})"
    layer = () if family.layer_forward is None else ((family.layer_forward[0], ("self", *family.layer_forward[1])),)
    return (host.check(feature, WRAPPERS, _resolve(WRAPPERS), attrs=("OUTER_SAMPLE", family.call_wrapper))
            and all(host.check(feature, where, _resolve(where), params)
                    for where, params in PATCHER + family.seams + layer))


def report_layer() -> None:
    """The step cache's part of the start-up line: the families this host has and can hook."""
    present = [f for f in step_families.FAMILIES if any(_resolve(c) is not None for c in f.classes)
               and (not f.bases or any(_resolve(b) is not None for b in f.bases))]
    hooked = [f.name for f in present if _seams_fit(f)]
    off = [f.name for f in present if f.name not in hooked]
    host.set_layer("step cache", "on" if hooked else "off",
                   ", ".join(hooked) + (f"; reshaped here: {', '.join(off)}" if off else ""))


def apply(model_patcher, config: tc.StepCacheConfig, node: str = ""):
    """A clone of ``model_patcher`` with the step cache attached (the input is not changed); a model or a
    setting it refuses is a ValueError, counted with its message as a refusal from ``node``."""
    try:
        return _attach(model_patcher, config, node)
    except ValueError as exc:
        stats().count_reason("refused", str(exc), source=node)
        raise


def _attach(model_patcher, config: tc.StepCacheConfig, node: str):
    family = detect_family(model_patcher)
    if not _seams_fit(family):  # this host reshaped what the family reads: it runs uncached
        stats().count_reason("bypass", "this ComfyUI reshaped a seam the family uses (the log names it): "
                             "the model runs without the step cache", source=family.name)
        return model_patcher.clone()
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type: unknown {config.model_type!r} (one of {', '.join(MODEL_TYPES)})")
    if config.rule not in RULES:
        raise ValueError(f"rule: unknown {config.rule!r} (one of {', '.join(RULES)})")
    if config.residual_mode not in RESIDUAL_MODES:
        raise ValueError(f"residual_mode: unknown {config.residual_mode!r} (one of {', '.join(RESIDUAL_MODES)})")
    if config.rule == "schedule" and config.residual_mode == tc.OUTPUT_MODE:
        raise ValueError("residual_mode: output forecasts the model's output and the schedule rule plans from "
                         "residuals; pick another rule, or another residual_mode")
    wanted = TYPE_FAMILY.get(config.model_type)
    if wanted is not None and wanted != family.name:
        raise ValueError(f"model_type: {config.model_type!r} is for {wanted} models, this is a {family.name} model")
    if config.model_type in tc.COEFFICIENTS or config.model_type in tc.MAG_RATIOS:
        rule = _rule(config, family)
        table = {"teacache": tc.COEFFICIENTS, "magcache": tc.MAG_RATIOS}.get(rule, {config.model_type: None})
        if config.model_type not in table:
            raise ValueError(f"model_type: {config.model_type!r} has no published {rule} table (use auto or "
                             "calibrated)")
    if config.model_type != "auto" and not config.calibrate and _rule(config, family) in tc.TABLELESS_RULES:
        stats().count_reason("fallback", f"model_type: {config.model_type!r} is not read by rule "
                             f"{_rule(config, family)}, which runs without a table", source=node)
    earlier: Settings | None = model_patcher.model_options.get("transformer_options", {}).get(KEY)
    if earlier is not None and earlier.config.calibrate and not config.calibrate:
        raise ValueError("model: it comes from ReuseKit TeaCache Calibrate, whose run would then skip steps and "
                         "calibrate nothing; sample the calibrating model without the step cache, then use the "
                         "step cache on the model itself")
    from comfy.patcher_extension import WrappersMP

    m = model_patcher.clone()
    blocks = family.blocks(m.model.diffusion_model)
    if config.rule == "first_block" and config.first_blocks > 1 and config.first_blocks >= len(blocks):
        raise ValueError(f"first_blocks: {config.first_blocks} runs every block of this {family.name} model "
                         f"({len(blocks)}), leaving none to skip; at most {max(1, len(blocks) - 1)}")
    if family.layer_forward is not None and not _layer_patch(family).install():
        why = _layer_patch(family).off or "is wrapped by another copy of ReuseKit"
        stats().count_reason("bypass", f"{family.layer_forward[0]} {why}: the model runs without the step cache",
                             source=family.name)
        return m
    if earlier is not None:  # applying twice replaces, never stacks: counted (one row), the settings logged once
        stats().count_reason("fallback", "ReuseKit Step Cache on a model that had it: the later settings replace the "
                             "earlier", source=family.name)
        host.say_once(f"teacache-again:{earlier.config}:{config}", "ReuseKit Step Cache on a model that had it: the "
                      "later settings (%s %g, %s) replace the earlier (%s %g, %s)", config.rule, config.threshold,
                      config.residual_mode, earlier.config.rule, earlier.config.threshold, earlier.config.residual_mode)
    m.model_options["transformer_options"][KEY] = Settings(config, family, tuple(blocks),
                                                           type(m.model.diffusion_model))
    call_kind = getattr(WrappersMP, family.call_wrapper)
    for kind, fn in ((WrappersMP.OUTER_SAMPLE, _outer_sample), (call_kind, _diffusion_model)):
        m.remove_wrappers_with_key(kind, KEY)  # applying twice replaces, never stacks
        m.add_wrapper_with_key(kind, KEY, fn)
    dit = m.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    for i, (name, index) in enumerate(() if family.layer_forward is not None else blocks):
        prior = dit.get((name, index))
        prior = getattr(prior, "_reusekit_prior", prior)  # ours from an earlier apply: unwrap
        m.set_model_patch_replace(_block_patch(i, i == len(blocks) - 1, prior), "dit", name, index)
    for path in family.side_maps(m.model.diffusion_model) if family.side_maps is not None else ():
        key = f"diffusion_model.{path}"
        current = m.get_model_object(key)
        if type(current) is dict or isinstance(current, _SideMap):  # the host's map or ours, never another node's
            m.add_object_patch(key, _SideMap(current))
    return m


_CALL: contextvars.ContextVar = contextvars.ContextVar("reusekit_step_call", default=None)  # the forward's _Call


@contextmanager
def _calling(to: dict, call: _Call):
    """While a forward runs: ``call`` is the current one, for the block patches (in ``to``, its
    transformer_options) and for the side maps (which see no options)."""
    to[CALL_KEY] = call
    token = _CALL.set(call)
    try:
        yield
    finally:
        to.pop(CALL_KEY, None)
        _CALL.reset(token)


class _SideMap(dict):
    """A map from block index to a block the model runs outside the seam (VACE's ``vace_layers_mapping``),
    as ComfyUI's object patch: on a call the step cache skips it names none (their output would be
    discarded); otherwise it is the map. It holds indices only, no module."""

    def get(self, key, default=None):
        call = _CALL.get()
        if call is not None and call.skip:
            return default
        return super().get(key, default)


# ---- the seams ---------------------------------------------------------------------------

_LAYER_PATCHES: dict[str, host.Patch] = {}  # "module:Class.forward" -> its patch, installed once


def _layer_patch(family: Family) -> host.Patch:
    where, names = family.layer_forward
    if where not in _LAYER_PATCHES:
        module, _, attr = where.partition(":")
        _LAYER_PATCHES[where] = host.Patch(family.name, module, attr, lambda original: _layer_forward(original, names),
                                           ("self", *names), layer="step cache")
    return _LAYER_PATCHES[where]


def _unreached_layer(family: Family, dm) -> str | None:
    """Why a call of this layer_forward family's model cannot go through the step cache, or None: a block
    of its stack runs another forward than the wrapped class's (an object patch of the block or of its
    forward, a compiled block, a subclass), so a skip would run that block on a passed-through stream."""
    replacement = _layer_patch(family).replacement
    for i, block in enumerate(family.layers(dm)):
        if type(block).forward is not replacement or "forward" in vars(block):
            return (f"layer {i} of this {type(dm).__name__} runs another forward than "
                    f"{family.layer_forward[0]} ({type(block).__name__}: another node or torch.compile wrapped "
                    "it): the call was computed")
    return None


def _layer_forward(original, names: tuple[str, ...]):
    """A block class's forward where the family's forward has no block-replace seam: a block of the model
    whose step-cached call is running (the call in the ``transformer_options`` it is handed, as a block
    patch reads it: a graph replay hands the captured call's) goes through that call as a block patch
    would, its arguments by name (``names``: the first is the stream); any other (another model, a
    refiner's block, a model without the step cache) runs the host's forward unchanged."""
    def forward(self, *args, **kwargs):
        call = (kwargs.get("transformer_options") or {}).get(CALL_KEY)  # as the block patches read it
        found = None if call is None else call.layer_index(self)
        if found is None or len(args) > len(names):  # more positions than it names: never reached (counted)
            return original(self, *args, **kwargs)
        named = {**dict(zip(names, args, strict=False)), **kwargs}
        named["img"] = named.pop(names[0])

        def run_block(a):
            a = dict(a)
            return {"img": original(self, a.pop("img"), **a)}

        return call.block(named, run_block, *found)["img"]
    return forward


def _block_patch(index: int, last: bool, prior):
    def patch(args, extra):
        call = (args.get("transformer_options") or {}).get(CALL_KEY)
        run_block = (lambda a: prior(a, extra)) if prior is not None else extra["original_block"]
        if call is None:
            return run_block(args)
        return call.block(args, run_block, index, last)

    patch._reusekit_prior = prior
    patch._reusekit_block = True
    # on a computed call it launches the same kernels every time (the decision is made before, in
    # _Call.probe), so graph capture may record it; another node's patch beneath it may not be
    setattr(patch, GRAPH_SAFE, prior is None)
    return patch


def _passthrough(args) -> dict:
    return {k: args[k] for k in ("img", "txt") if k in args}


def _pack(stream) -> torch.Tensor:
    """A block's image stream as one (batch, ...) tensor: a tensor as it is; a tuple of streams (LTX-2's
    video and audio) each flattened per row and joined, so both residuals are kept, forecast and added
    as one."""
    if isinstance(stream, torch.Tensor):
        return stream
    return torch.cat([s.reshape(s.shape[0], -1) for s in stream], dim=1)


def _unpack(packed: torch.Tensor, like):
    """``packed`` (from :func:`_pack`) back in the layout of ``like``."""
    if isinstance(like, torch.Tensor):
        return packed
    parts = packed.split([s[0].numel() for s in like], dim=1)
    return type(like)(p.reshape(s.shape) for p, s in zip(parts, like, strict=True))


def _rows(value, rows: torch.Tensor, batch: int):
    """``value`` (a block's inputs) with every tensor of ``batch`` rows cut to ``rows`` (of twice that, the
    batch and its timestep-zero copy stacked, as Qwen-Image-Edit-2511 does, to those rows of each half),
    through dicts, tuples, lists and dataclasses (Flux.2's modulation); the transformer options stay."""
    if isinstance(value, torch.Tensor):
        if value.ndim and value.shape[0] == batch:
            return value[rows]
        if value.ndim and value.shape[0] == 2 * batch:
            return value[torch.cat([rows, rows + batch])]
        return value
    if isinstance(value, dict):
        return {k: v if k == "transformer_options" else _rows(v, rows, batch) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, rows, batch) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _rows(getattr(value, f.name), rows, batch)
                                             for f in dataclasses.fields(value) if f.init})
    return value


class _Computed(Exception):
    """Ends a probe at the decision: this call is computed (graph capture replays it)."""


class _Call:
    """One diffusion-model call: the conds in the batch, the skip decision and, on a computed
    call, the new residuals (stored by the wrapper after the forward).

    Alone it decides at the first block in one eager pass. Under graph capture the decision stays
    outside the graph: :meth:`probe` runs the forward eagerly up to the decision; a skip finishes
    there, a computed call stops and the graph replays it, its block patches making the residuals
    in the graph (:meth:`graph_outputs` / :meth:`take_graph_outputs`)."""

    def __init__(self, run: tc.RunState, family: Family, dm, keys: list, labels: list[str], may_skip: bool,
                 sigma: torch.Tensor | None, scoped: str | None = None, effects: tuple = ()):
        self.run, self.family, self.dm, self.sigma, self.effects = run, family, dm, sigma, effects
        # why this call has no cond-only step: a forward input the blocks read from the forward's scope
        # (Family.scoped), or a patch inside the blocks that reads the whole batch
        self.scoped = scoped
        self.keys, self.labels, self.may_skip = keys, labels, may_skip
        self.after_first = run.config.rule == "first_block"  # decides on the first blocks' output
        # the block whose output decides (first_block: the last of its first_blocks), and whose residual
        # from the stack input is ``first``
        self.decide_at = run.config.first_blocks - 1 if self.after_first else 0
        self.on_output = run.config.residual_mode == tc.OUTPUT_MODE  # stores and forecasts the model's output
        self.skip: bool | None = None
        self.roles: list[str] | None = None  # schedule: per cond "C" computed, "S" forecast, "E" rebuilt
        self.half = False  # schedule: some conds computed, the others rebuilt from them (an H step)
        self.rebuilt: list = []  # schedule: (key, residual) rebuilt on a skipped call, stored after it
        self.undecided = False  # the decision could not run: computed, and no residual is kept
        self.probing = False
        self.stack_in: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # the first blocks' residual (``decide_at``'s output minus the stack input)
        self.residual: torch.Tensor | None = None  # the whole stack's residual
        self._layers: dict[int, int] | None = None  # layer_forward families: id(block) -> its index
        # output mode under a sampler that adds noise: (the call's input, its rows' sigmas), the output kept and
        # forecast as the denoised picture it gives (set by the wrapper; None: the output itself)
        self.noisy: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer_index(self, module) -> tuple[int, bool] | None:
        """A layer_forward family's block: (its index in this call's model, whether it is the last), or None
        (not one of its blocks). The map is made once per call."""
        if self._layers is None:
            self._layers = {} if self.family.layers is None else {
                id(m): i for i, m in enumerate(self.family.layers(self.dm))}
        index = self._layers.get(id(module))
        return None if index is None else (index, index == len(self._layers) - 1)

    def probe(self, forward):
        self.probing = True
        try:
            return forward()  # finished: a skipped call (or our first block never ran)
        except _Computed:
            return None
        finally:
            self.probing = False

    def graph_outputs(self) -> list[torch.Tensor]:
        return [self.first] if self.on_output else [self.residual, self.first]  # output mode: the output is kept

    def take_graph_outputs(self, tensors: list[torch.Tensor]) -> None:
        if self.on_output:
            (self.first,) = tensors
        else:
            self.residual, self.first = tensors

    def _decide(self, args: dict) -> None:
        img = _pack(args["img"])
        if img.shape[0] % len(self.keys):  # a batch we cannot split per cond: treat as one
            stats().count_reason("fallback", f"a batch does not split across its "
                                 f"{len(self.keys)} conds (a wrapper changed the batch): they are decided as one",
                                 source=self.family.name)
            self.keys, self.labels = [tuple(self.keys)], ["batch"]
        rule = self.run.config.rule
        try:
            if rule == "first_block":
                signal = self.first
            elif rule in ("magcache", "schedule", *tc.BEAT_RULES):  # the stack input only tells a shape change
                signal = img
            else:
                signal = self.family.modulated(self.dm, args)
            signals = signal.chunk(len(self.keys))
        except (AttributeError, TypeError, IndexError, KeyError, RuntimeError, ValueError) as exc:
            # a variant we do not know: compute, never skip
            host.say_once(f"teacache-modulated:{self.family.name}", "ReuseKit Step Cache: cannot read the modulated "
                          "input of this %s model (%s: %s); computing every step", self.family.name,
                          type(exc).__name__, exc, level=logging.WARNING)
            stats().count_reason("bypass", f"cannot read the modulated input of this model ({type(exc).__name__}): "
                                 "the call was computed", source=self.family.name)
            self.skip, self.undecided = False, True
            return
        # the residual's shape per cond: the stack input's (first_block may decide in a joint stream, whose
        # input holds the text tokens too; the residual holds the image tokens)
        stack = img if self.stack_in is None else self.stack_in
        chunk = (stack.shape[0] // len(self.keys), *stack.shape[1:])
        if rule == "schedule":
            half = self.family.half and self.scoped is None
            self.roles = self.run.decide_scheduled(self.keys, self.labels, list(signals), chunk, self.sigma,
                                                   half=half, effects=self.effects, may_skip=self.may_skip)
            if self.family.half and self.run.planned == "H":
                if not half:
                    stats().count_reason("fallback", f"no cond-only step for a call with {self.scoped} (the planned "
                                         "cond-only step was computed whole)", source=self.family.name)
                elif self.run.pair() is None:  # PerpNeg's three branches, two prompts combined...
                    stats().count_reason("fallback", f"no cond-only step in a run whose branches are not one cond and "
                                         f"one uncond ({self.run.branches()}): the planned cond-only step was "
                                         "computed whole", source=self.family.name)
            self.skip = "C" not in self.roles
            self.half = not self.skip and "E" in self.roles
            return
        # output mode: the stored output's shape is not the stack's; a change of the input's shape (and so of
        # the output's) already clears the cond's state in decide
        self.skip = self.run.decide(self.keys, self.labels, list(signals), self.may_skip,
                                    None if self.on_output else chunk, self.sigma, self.effects)

    def block(self, args: dict, run_block, index: int, last: bool) -> dict:
        if index == 0:
            if self.skip is None and not self.after_first:
                self._decide(args)
            if self.undecided:  # runs to the end eagerly (graph capture: "undecided")
                return run_block(args)
            if self.probing and self.skip is False and not self.half:
                # computed whole: the graph replays it (an H step runs on here eagerly: a graph holds
                # whole calls, and the plan is the same with graph capture as without)
                raise _Computed
            # blocks (and ControlNet between them) add in place; a skip adds the residual to this copy,
            # which already holds what ControlNet added inside the stack at the last computed step
            self.stack_in = _pack(args["img"]).clone()
            if self.after_first or not self.skip:
                if index == self.decide_at:
                    return self._first_block(args, self._runner(run_block), last)
                return run_block(args)  # first_block's first blocks before the one that decides
        elif index <= self.decide_at:  # first_block: the rest of its first blocks, the last of them decides
            if self.stack_in is None:  # our first-block patch was replaced later: stay out
                return run_block(args)
            return self._first_block(args, run_block, last) if index == self.decide_at else run_block(args)
        elif self.skip is None:  # our first-block patch was replaced later: stay out
            return run_block(args)
        if self.skip:
            out = _passthrough(args)
            if last and self.on_output:  # the blocks pass through; the wrapper replaces the whole output
                self.stack_in = None
            elif last:
                img = _pack(out["img"])
                start, end = self._image_tokens(args, img.shape[1])
                base = self.stack_in + self.first if self.after_first else self.stack_in
                res = torch.cat([self._skipped_residual(i, k, img) for i, k in enumerate(self.keys)])
                out["img"] = _unpack(torch.cat([img[:, :start], base + res, img[:, end:]], 1), out["img"])
                self.stack_in = None
            return out
        out = self._runner(run_block)(args)
        if last:
            self._stack_residual(args, out)
        return out

    def _first_block(self, args: dict, run_block, last: bool) -> dict:
        """Runs the block at ``decide_at`` and keeps the residual of the blocks up to it (the first block's,
        or first_block's first_blocks'); first_block decides on it here."""
        out = run_block(args)
        img = _pack(out["img"])
        start, end = self._image_tokens(args, img.shape[1])
        self.first = img[:, start:end] - self.stack_in
        if self.skip is None:
            if last and self.may_skip:  # a stack of one block leaves nothing to skip (rule first_block, or auto's
                self.may_skip = False  # fallback to it); a call outside the window would not have skipped anyway
                stats().count_reason("bypass", "first_block decides after the first block, the only one of this "
                                     f"{self.family.name} model: none is left to skip, every call is computed (rule "
                                     "teacache decides before it)", source=self.family.name)
            self._decide(args)
            if self.undecided:
                return out
            if self.probing and not self.skip:
                raise _Computed
        if not self.skip and last:
            self._stack_residual(args, out)
        return out

    def _stack_residual(self, args: dict, out: dict) -> None:
        if self.on_output:  # the output is kept after the forward (take_output), not the stack's residual
            self.stack_in = None
        elif self.stack_in is not None:
            img = _pack(out["img"])
            start, end = self._image_tokens(args, img.shape[1])
            self.residual = img[:, start:end] - self.stack_in
            if self.half:  # the uncond rows never ran: their residual is rebuilt from the cond's made now
                parts = list(self.residual.chunk(len(self.keys)))
                cond = parts[self.keys.index(self.run.pair()[0])]
                parts = [self.run.estimate(cond) if role == "E" else part for part, role in zip(parts, self.roles,
                                                                                               strict=True)]
                self.residual = torch.cat(parts)
                out["img"] = _unpack(torch.cat([img[:, :start], self.stack_in + self.residual, img[:, end:]], 1),
                                     out["img"])
            self.stack_in = None

    def _runner(self, run_block):
        """``run_block``, or on an H step of the schedule rule, it run on the computed conds' rows only
        (every batched input sliced), the other rows passed through unchanged."""
        if not self.half:
            return run_block
        batch = self.stack_in.shape[0]
        n = batch // len(self.keys)
        rows = torch.cat([torch.arange(i * n, (i + 1) * n) for i, role in enumerate(self.roles) if role == "C"])

        def on_rows(args):
            out = run_block(_rows(args, rows.to(self.stack_in.device), batch))
            merged = dict(out)
            for name in ("img", "txt"):
                if name in out and name in args:
                    full = args[name].clone()
                    full[rows.to(full.device)] = out[name]
                    merged[name] = full
            return merged

        return on_rows

    def _skipped_residual(self, i: int, key, like: torch.Tensor) -> torch.Tensor:
        """What a skipped cond adds: its forecast, or (schedule, an uncond after its cond's call at this
        step) the cond's residual made now minus the measured difference, kept to be stored."""
        if self.roles is not None and self.roles[i] == "E":
            rebuilt = self.run.estimate(self.run.cond_residual(key).to(like.device, like.dtype, non_blocking=True))
            self.rebuilt.append((key, rebuilt))
            return rebuilt
        return self.run.residual(key, like, self.sigma)

    def _image_tokens(self, args: dict, total: int) -> tuple[int, int]:
        """Where the image tokens are in the last block's stream: the single stream's ``img_slice``
        where the host sets it (Flux, Chroma, HunyuanVideo from ComfyUI 0.14: text first), else the
        family's layout."""
        n = self.stack_in.shape[1]
        if "txt" not in args:  # a single (joint) stream
            sl = (args.get("transformer_options") or {}).get("img_slice")
            if isinstance(sl, (list, tuple)) and len(sl) == 2 and sl[1] - sl[0] == n and sl[1] <= total:
                return int(sl[0]), int(sl[1])
        if total == n or self.family.image_first:
            return 0, n
        return total - n, total

    def store_residual(self, probe: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """After a forward: keep its residual per cond (first_block: the residual of the blocks after the
        first, which a skip adds to the first block's new output; schedule: a rebuilt uncond's as
        rebuilt). ``probe``: (the skipped output, the computed one) of a calibration call, whose gain
        (output error over residual error, and the output's norm) goes with each residual."""
        for key, r in self.rebuilt:
            self.run.store_residual(key, r, self.sigma, estimated=True)
        self.rebuilt = []
        if self.residual is not None:
            residual = self.residual - self.first if (self.after_first and self.first is not None
                                                      and not self.on_output) else self.residual
            roles = self.roles or ["C"] * len(self.keys)
            n = len(self.keys)
            first, last = (None, None) if probe is None else map(_first_output, probe)
            outs = [None] * n if first is None or last is None or first.shape != last.shape else list(
                zip(first.chunk(n), last.chunk(n), strict=True))
            for key, r, role, pair in zip(self.keys, residual.chunk(n), roles, outs, strict=True):
                gain = None
                if pair is not None and self.run.conds[key].residual is not None:
                    before = self.run.conds[key].residual.to(r.device, non_blocking=True)
                    gain = ((pair[0] - pair[1]).float().norm() / (before - r).float().norm().clamp_min(1e-12),
                            pair[1].float().norm())
                self.run.store_residual(key, r, self.sigma, estimated=role == "E", gain=gain)
            self.residual = self.first = None

    def take_output(self, out) -> None:
        """Output mode, a computed call: its output is what store_residual keeps per cond. An output that is
        not one tensor splitting per cond is not kept, and the conds' earlier ones are dropped: they never
        skip (counted)."""
        if torch.is_tensor(out) and out.ndim and out.shape[0] % len(self.keys) == 0:
            if self.noisy is None:  # a copy of its own: a wrapper outside ours may change the output in place
                self.residual = out.clone()
                return
            x = self.noisy[0]
            if x.shape[0] == out.shape[0] and x.shape[2:] == out.shape[2:] and x.shape[1] >= out.shape[1]:
                self.residual = self._denoised(out)
                return
            why = "under a sampler that adds noise, this model's output is not laid out as its input"
        else:
            why = "this model's output does not split per cond"
        self.residual = None
        for key in self.keys:
            self.run.conds[key].clear()
        stats().count_reason("fallback", f"residual_mode output: {why}, so every call was computed",
                             source=self.family.name)

    def forecast_output(self, out: torch.Tensor) -> torch.Tensor:
        """Output mode, a skipped call: each cond's forecast output in place of ``out`` (what the blocks,
        passed through, gave); under a sampler that adds noise, the output that gives the forecast denoised
        picture from this call's input."""
        forecast = torch.cat([self.run.residual(key, part, self.sigma)
                              for key, part in zip(self.keys, out.chunk(len(self.keys)), strict=True)])
        if self.noisy is None:
            return forecast
        x, sigmas = self._noisy(out)
        return ((x - forecast.float()) / sigmas).to(out.dtype)

    def _noisy(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's noisy input (without the channels a model concatenates to it) and its rows' sigmas, in
        float32, laid out as ``out``."""
        x, sigmas = self.noisy
        return x[:, :out.shape[1]].float(), sigmas.float().reshape(-1, *[1] * (out.ndim - 1))

    def _denoised(self, out: torch.Tensor) -> torch.Tensor:
        """The denoised picture ``out`` gives at this call (a flow model's: the input less sigma times the
        output, as ComfyUI's model sampling reads it)."""
        x, sigmas = self._noisy(out)
        return (x - sigmas * out.float()).to(out.dtype)


def _first_output(out):
    """A model call's output as a tensor: itself, or the first stream of one that returns several (LTX-2's
    video and audio: the gain is measured on the video); None for anything else."""
    if isinstance(out, (list, tuple)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    return out if isinstance(out, torch.Tensor) else None


def _labels(to: dict, n: int, window: tuple | None = None) -> list[str]:
    names = {0: "cond", 1: "uncond"}
    raw = [names.get(c, f"cond{c}") for c in (to.get("cond_or_uncond") or [])]
    if len(raw) != n:
        raw = [f"cond{i}" for i in range(n)]
    seen: dict[str, int] = {}
    out = []
    for lab in raw:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
    if window:  # a context window's calls: frames first-last
        out = [f"{lab} [{window[0]}-{window[-1]}]" for lab in out]
    return out


def _window(to: dict) -> tuple | None:
    """The frames of the context window this call computes (ComfyUI's context windows call the model once
    per window at every step, each with the same conds), or None."""
    window = to.get("context_window")
    if window is None:
        return None
    return (getattr(window, "dim", None), *(getattr(window, "index_list", None) or ()))


def _replaced(to: dict, settings: Settings) -> tuple[tuple[str, int], ...]:
    """The blocks whose patch in these options is not the step cache's. One lookup per block: the model's
    depth, never its weights."""
    if settings.family.layer_forward is not None:  # its blocks are not block patches
        return ()
    dit = (to.get("patches_replace") or {}).get("dit") or {}
    return tuple(key for key in settings.blocks if not getattr(dit.get(key), "_reusekit_block", False))


def replaced_reason(to: dict, settings: Settings) -> str | None:
    """Why the cache must compute every step of this run, or None: a block patch it installed is no
    longer its own (a later node replaced it: a skip would then run that node's block on the stack
    input). Says so once."""
    replaced = _replaced(to, settings)
    if not replaced:
        return None
    reason = (f"another node replaced the patch of {replaced[0][0]} {replaced[0][1]} after ReuseKit Step Cache; "
              "computing every step (put ReuseKit Step Cache after that node to skip steps)")
    host.say_once(f"teacache-replaced:{settings.family.name}:{replaced[0]}", "ReuseKit Step Cache: %s", reason,
                  level=logging.WARNING)
    return reason


OTHER_STEP_CACHES = {"easycache": "EasyCache", "lazycache": "LazyCache"}  # ComfyUI's own nodes, by wrapper key


def _other_step_cache(patcher) -> str | None:
    """Why this run computes every call: ComfyUI's EasyCache or LazyCache is on the model too. Each would skip on
    the other's outputs: EasyCache inside ours kept a skipped call's stand-in output as the model's and handed it
    back (1.6 times the output off), LazyCache outside answered evaluations ours never saw and forecast across."""
    wrappers = getattr(patcher, "wrappers", None) or {}
    found = next((name for key, name in OTHER_STEP_CACHES.items()
                  if any(key in (by_key or {}) for by_key in wrappers.values())), None)
    if found is None:
        return None
    return (f"ComfyUI's {found} node is on this model too: two step caches skip on each other's outputs, so ReuseKit "
            f"Step Cache computes every call of this run ({found}'s skips stand; keep one of the two)")


BATCH_SAFE_PATCHES = ("double_block", "post_input", "noise_refiner")
"""``transformer_options["patches"]`` entries that run outside the blocks on the whole batch (a model patch's
ControlNet hints, added after each block, or in Lumina's noise refiner before them; the input's), which a
cond-only step leaves whole."""


def _batch_patch(to: dict) -> str | None:
    """Why a call cannot run a cond-only step for its patches: one inside the blocks (NAG's
    ``attn1_output_patch``) reads the batch's conds by ``cond_or_uncond``, which still names the uncond when
    the step cuts the blocks' inputs to the cond's rows (NAG left out, or another batch item taken for the
    negative). None where no such patch is set."""
    name = next((k for k, v in (to.get("patches") or {}).items() if v and k not in BATCH_SAFE_PATCHES), None)
    if name is None:
        return None
    whose = " (NAG's)" if name == "attn1_output_patch" else ""
    return f"a '{name}' patch{whose}: it runs inside the blocks on the batch, where a cond-only step leaves the cond's rows alone"


def _gain_probe(run: tc.RunState, settings: Settings, dm, keys: list, labels: list[str], sigma, executor, args,
                kwargs, to: dict):
    """Calibration only: the output this call would give skipped (the last computed residuals added, the
    blocks passed through: little work), so the table learns how much a residual's error moves the
    output at this step; None before every cond holds a residual, or where the skip cannot run."""
    if not all(key in run.conds and run.conds[key].residual is not None for key in keys):
        return None
    probe = _Call(run, settings.family, dm, keys, labels, False, sigma)
    probe.skip = True
    try:
        with _calling(to, probe):
            return executor(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError):  # residuals of another layout: no gain at this step
        stats().count_reason("fallback", "calibration: the residuals did not fit this call's layout, so no gain "
                             "was measured at this step", source=settings.family.name)
        return None


def _diffusion_model(executor, *args, **kwargs):
    to = transformer_options(args, kwargs) or {}
    run: tc.RunState | None = to.get(RUN_KEY)
    settings: Settings | None = to.get(KEY)
    if run is None or settings is None:  # called outside a sampling run: plain forward
        return executor(*args, **kwargs)
    sigmas = to.get("sigmas")
    sigma = sigmas.max().float() if sigmas is not None else None  # stays on its device: no sync here
    may_skip = False if sigma is None else run.in_window(sigma)
    keys = list(to.get("uuids") or []) or ["cond"]
    cond_or_uncond = list(to.get("cond_or_uncond") or [])
    if len(cond_or_uncond) == len(keys):  # core gives an area cond's made-up uncond the cond's uuid
        keys = list(zip(keys, cond_or_uncond, strict=True))
    if run.disabled_reason is not None:  # checked at the run's start: never skip
        out = executor(*args, **kwargs)
        run.calls_computed += 1
        return out
    run.seen += 1
    if run.after_gap():
        stats().count_reason("fallback", "a step of the run never reached the step cache (another node's wrapper "
                             "answered its model calls): each cond started over with a computed call",
                             source=settings.family.name)
    window = _window(to)
    if window is not None:  # each context window is a call of its own, with a state of its own
        keys = [(key, "window", window) for key in keys]
        run.windowed = True
    replaced = _replaced(to, settings)  # per call: SkipLayerGuidanceDiTSimple swaps blocks on its uncond pass only
    if replaced:
        run.sat_out(keys, sigmas)
        # the blocks up to the one that decides (first_block: its first_blocks) and the last, which adds the residual
        decides = settings.blocks[:run.config.first_blocks if run.config.rule == "first_block" else 1]
        lost = next((block for block in (*decides, settings.blocks[-1]) if block in replaced), None)
        if lost is not None:  # without one of them the call cannot skip: computed
            stats().count_reason("bypass", f"a call whose options replace the step cache's patch of {lost[0]} "
                                 f"{lost[1]} (a block it decides with or the last one: SkipLayerGuidanceDiTSimple's "
                                 "uncond pass, say) was computed", source=settings.family.name)
            run.calls_computed += 1
            return executor(*args, **kwargs)
        keys = [(key, tc.REPLACED, replaced) for key in keys]  # other blocks run: a state of its own
    returns = run.returns
    if run.again_this_step(keys, sigmas):  # another pass of a cond this step already had: neither skipped nor kept
        stats().count_reason("bypass", "a second call of a cond at one step (a guidance pass: LTXV's STG or "
                             "modality guidance, a reference-free pass) was computed and left the "
                             "cache's state as it was", source=settings.family.name)
        run.calls_computed += 1
        return executor(*args, **kwargs)
    if run.returns != returns:
        stats().count_reason("fallback", "a cond that had no call at the model evaluation before (a guider that "
                             "drops the uncond at some steps) started over with a computed call",
                             source=settings.family.name)
    dm = executor.class_obj
    dm = dm.diffusion_model if settings.family.call_wrapper == "APPLY_MODEL" else dm  # a BaseModel there
    foreign = settings.foreign(dm)
    if foreign is not None:
        stats().count_reason("bypass", foreign, source=settings.family.name)
        run.calls_computed += 1
        return executor(*args, **kwargs)
    unreached = None if settings.family.layer_forward is None else _unreached_layer(settings.family, dm)
    if unreached is not None:
        host.say_once(f"teacache-layer:{type(dm).__name__}", "ReuseKit Step Cache: %s", unreached, level=logging.WARNING)
        stats().count_reason("bypass", unreached, source=settings.family.name)
        run.calls_computed += 1
        run.unhooked += 1
        return executor(*args, **kwargs)
    labels = _labels(to, len(keys), window and window[1:])
    if replaced:
        labels = [f"{lab} [{len(replaced)} block{'s' if len(replaced) > 1 else ''} replaced]" for lab in labels]
    probe = _gain_probe(run, settings, dm, keys, labels, sigma, executor, args, kwargs, to) \
        if run.config.calibrate else None
    scoped = next((f"{name}: the blocks read it from the model's forward, where it cannot be cut to the cond's rows"
                   for name in settings.family.scoped if kwargs.get(name) is not None), None) or _batch_patch(to)
    effects = _effects(run, sigmas)
    if effects != run.effects_seen:
        if run.effects_seen is not None:
            stats().count_reason("fallback", "a ControlNet's range or a hook's keyframe began or ended within the run: "
                                 "each cond started over with a computed call", source=settings.family.name)
        run.effects_seen = effects
    call = _Call(run, settings.family, dm, keys, labels, may_skip, sigma, scoped, effects)
    if call.on_output and run.renoised:
        call.noisy = _noisy_input(settings.family, args, kwargs, sigmas)
    t0 = time.perf_counter()
    try:
        with _calling(to, call):
            out = executor(*args, **kwargs)
    except BaseException:  # cut off (an interrupt) after its conds counted it: the run counts it alike
        if call.skip:
            run.calls_skipped += 1
        elif call.skip is not None:
            run.calls_computed += 1
            run.calls_half += bool(call.half)
        raise
    dt = time.perf_counter() - t0
    if call.skip is None:  # our first block never saw this call: computed, and the run says so
        host.say_once(f"teacache-unreached:{type(executor.class_obj).__name__}", "ReuseKit Step Cache: the blocks of "
                      "this %s never reached the step cache (called without transformer_options or under other "
                      "names); computing every step",
                      type(executor.class_obj).__name__, level=logging.WARNING)
        stats().count_reason("bypass", f"the blocks of this {type(executor.class_obj).__name__} never reached the "
                             "step cache: the call was computed", source=settings.family.name)
        run.calls_computed += 1
        run.unhooked += 1
    if call.half:
        run.calls_half += 1
    if call.skip:
        run.calls_skipped += 1
        run.time_skipped += dt
        if call.on_output:
            out = call.forecast_output(out)
        call.store_residual()  # schedule: an uncond rebuilt from its cond's call at this step
    elif call.skip is not None:
        if call.on_output and not call.undecided:  # an undecided call keeps nothing, as in the other modes
            call.take_output(out)
        call.store_residual(None if probe is None else (probe, out))
        run.calls_computed += 1
        run.time_computed += dt
        mem = run.residual_bytes()
        s = stats()
        s.set_memory("device", mem["device"])
        s.set_memory("cpu", mem["cpu"])
    return out


_OWN_NOISE = ("sample_lcm_upscale",)  # samplers that add noise without taking a noise sampler
_NO_NOISE = ("sample_res_multistep", "sample_res_multistep_cfg_pp")  # take one, hand it on with eta 0


def _adds_noise(sampler) -> bool:
    """Whether the run's sampler adds noise between its model calls: a k-diffusion sampler taking a noise
    sampler (ancestral, SDE, LCM, DDPM...) whose ``eta`` and ``s_noise`` are not 0, but for the res_multistep
    pair, which call their solver with eta 0, or one that adds its own (SamplerLCMUpscale's)."""
    try:
        params = inspect.signature(sampler.sampler_function).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    name = getattr(sampler.sampler_function, "__name__", None)
    if "noise_sampler" not in params or name in _NO_NOISE:
        return name in _OWN_NOISE
    options = getattr(sampler, "extra_options", None) or {}

    def given(name: str):
        default = params[name].default if name in params else 1.0
        return options.get(name, 1.0 if default is inspect.Parameter.empty else default)

    return given("eta") != 0 and given("s_noise") != 0


def _undamped(sampler) -> str | None:
    """The sampler's name where it builds the next latent from the denoised picture itself rather than stepping
    along the model's output times the step's span in sigma: ComfyUI's CFG++ samplers (``*_cfg_pp``, the
    SamplerEulerCFGpp node's, gradient estimation with ``cfg_pp``), through which a skipped call's error
    reaches the latent times sigma (the denoised picture's share of it), not times the step's span."""
    fn = getattr(sampler, "sampler_function", None)
    name = getattr(fn, "__name__", "") or ""
    options = getattr(sampler, "extra_options", None) or {}
    if name.endswith("_cfg_pp") or name == "sample_euler_pp" or options.get("cfg_pp"):
        return name.removeprefix("sample_") or "a CFG++ sampler"
    return None


def _flow_denoised(ms) -> bool:
    """Whether the model sampling reads the denoised picture as a flow model does, the input less sigma times
    the output, and takes the input as it is: ComfyUI's CONST maths, not only its class (Wan FlowRVS's
    IMG_TO_IMG_FLOW is a CONST whose denoised picture is the output itself)."""
    import comfy.model_sampling

    const = comfy.model_sampling.CONST
    return isinstance(ms, const) and all(getattr(type(ms), name, None) is getattr(const, name)
                                         for name in ("calculate_denoised", "calculate_input"))


def _noisy_input(family: Family, args: tuple, kwargs: dict, sigmas) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the diffusion model's input, its rows' sigmas) where its output turns into the denoised picture as a
    flow model's does (ComfyUI's CONST model sampling: the input less sigma times the output), else None.
    Mochi's wrapper is around apply_model, whose output is the denoised picture already."""
    x = args[0] if args else kwargs.get("x")
    if family.call_wrapper != "DIFFUSION_MODEL" or not torch.is_tensor(x) or not torch.is_tensor(sigmas) \
            or sigmas.ndim != 1 or x.ndim < 2 or not sigmas.shape[0] or x.shape[0] % sigmas.shape[0]:
        return None
    return x, sigmas.repeat(x.shape[0] // sigmas.shape[0])  # the latent's sigmas, once per cond in the batch


def _schedule_steps(sigmas: torch.Tensor | None) -> int | None:
    """The steps of the schedule this run samples a part of: its own, or where its sigmas are a view into a
    longer schedule (KSamplerAdvanced's start and end steps, a SplitSigmas half, KSampler's denoise under 1,
    which samples the last steps of a longer schedule) that schedule's, so ``auto`` picks the threshold of the
    steps' density (two halves of a 50-step schedule skip as 50 steps do, not as two runs of 25)."""
    if sigmas is None:
        return None
    own = len(sigmas) - 1
    if sigmas.ndim != 1 or not sigmas.numel() or sigmas.stride(0) != 1:
        return own
    held = sigmas.untyped_storage().nbytes() // sigmas.element_size()
    if held <= sigmas.numel():
        return own
    # the storage must read as one schedule: falling, no 0 but at its end (Laplace's ends above 0), but for the
    # 0 KSampler writes at the view's end where it removes the rest of the noise at once (a view of another
    # tensor, a padded or stacked one, a table: the run's own steps). One small copy per run.
    values = sigmas.as_strided((held,), (1,), 0).detach().float().cpu()
    end = sigmas.storage_offset() + sigmas.numel() - 1
    if end < held - 1 and values[end] == 0:
        values = torch.cat([values[:end], values[end + 1:]])
    if values[-1] < 0 or not bool((values[:-1] > 0).all()) or not bool((values[1:] <= values[:-1]).all()):
        return own
    return held - 1


def _cut_short(sigmas: torch.Tensor, schedule_steps: int) -> bool:
    """Whether ``sigmas`` are the first part of a longer schedule (of ``schedule_steps``, from
    :func:`_schedule_steps`): ComfyUI's KSampler cuts its sigmas at an end step before the last as a view of them,
    and with the rest of the noise removed at once (KSamplerAdvanced without leftover noise) sets the last one to
    0, so only the view tells it from a whole run: the first part of a larger storage (a view's base is not kept
    under inference mode, where ComfyUI samples)."""
    return sigmas.ndim == 1 and sigmas.storage_offset() == 0 and schedule_steps > len(sigmas) - 1


def _switches(conds: dict | None) -> tuple[list, list]:
    """What may switch on or off within a run, from the guider's conds: the ControlNets (each one of a chain)
    whose start or end percent is inside the run, and the hooks whose keyframes change their strength (a
    scheduled LoRA). A skipped call adds a residual or forecast made at earlier calls: made with such an effect
    off, it would drop it where it turns on (a ControlNet whose range falls on skipped steps was lost whole),
    made with it on, carry it past its end."""
    controls, hooks, seen = [], [], set()
    for entries in (conds or {}).values():
        for cond in entries or ():
            if not isinstance(cond, dict):
                continue
            control = cond.get("control")
            while control is not None and id(control) not in seen:
                seen.add(id(control))
                if tuple(getattr(control, "timestep_percent_range", (0.0, 1.0))) != (0.0, 1.0):
                    controls.append(control)
                control = getattr(control, "previous_controlnet", None)
            for hook in getattr(cond.get("hooks"), "hooks", None) or ():
                if id(hook) not in seen and len(getattr(getattr(hook, "hook_keyframe", None), "keyframes", ())) > 1:
                    seen.add(id(hook))
                    hooks.append(hook)
    return controls, hooks


def _effects(run: tc.RunState, sigmas: torch.Tensor | None) -> tuple:
    """What of the run's switching effects is on at this call: each ControlNet inside its range or not (as
    ComfyUI decides it, from the range its ``pre_run`` set), each keyframed hook's current strength. () where
    nothing can switch; else one host sync for a ControlNet's range, where ComfyUI's own range check syncs at
    every call already."""
    controls, hooks = run.switches
    if not controls and not hooks:
        return ()
    on = ()
    if controls and sigmas is not None and sigmas.numel():
        # as ComfyUI's ControlBase.get_control compares: the call's first timestep against the range's ends,
        # which a tensor-against-float compare rounds to the timestep's dtype (in float64 a range ending on a
        # step's float32 sigma was read otherwise, and that step's ControlNet lost). ComfyUI's pre_run sets the
        # ranges after the run's start, so they are rounded at the first call and again only where they or the
        # dtype change.
        t = float(sigmas.reshape(-1)[0])
        read = (sigmas.dtype, tuple(getattr(c, "timestep_range", None) for c in controls))
        if run.switch_ends is None or run.switch_ends[0] != read:
            run.switch_ends = (read, tuple(None if r is None else (_as(r[0], sigmas.dtype), _as(r[1], sigmas.dtype))
                                           for r in read[1]))
        on = tuple(e is None or not (t > e[0] or t < e[1]) for e in run.switch_ends[1])
    return on + tuple(hook.hook_keyframe.strength for hook in hooks)


def _as(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (a host tensor: no device, no sync)."""
    return float(torch.tensor(value, dtype=dtype))


def _rule(config: tc.StepCacheConfig, family: Family) -> str:
    return tc.FAMILY_DEFAULTS.get(family.name, tc.FALLBACK_DEFAULTS)[0] if config.rule == "auto" else config.rule


def resolved_config(config: tc.StepCacheConfig, family: Family, steps: int | None = None) -> tc.StepCacheConfig:
    """``config`` with rule, threshold (-1) and residual mode "auto" replaced by the family's defaults for a
    run of ``steps`` (None: not known)."""
    rule0, anchors, mode0 = tc.FAMILY_DEFAULTS.get(family.name, tc.FALLBACK_DEFAULTS)
    threshold0 = tc.default_threshold(anchors, steps)
    rule = "teacache" if config.calibrate else _rule(config, family)
    threshold = config.threshold
    if threshold < 0:
        threshold = threshold0 if rule == rule0 else tc.RULE_THRESHOLDS.get(family.name, tc.FALLBACK_THRESHOLDS).get(
            rule, tc.FALLBACK_THRESHOLDS[rule])
    mode = mode0 if config.residual_mode == "auto" else config.residual_mode
    return dataclasses.replace(config, rule=rule, threshold=float(threshold), residual_mode=mode)


class Plan:
    """What one run uses: the resolved config, the rule's table and where it came from (``used_type``:
    "calibrated", a published variant, "none", "calibrating"), the model's variant and identity, and the
    calibration store's key where the run reads or writes a calibration (None elsewhere)."""

    def __init__(self, config: tc.StepCacheConfig, used_type: str, variant: str, key: str | None,
                 ident: WeightsIdentity, table=None):
        self.config, self.used_type, self.variant = config, used_type, variant
        self.key, self.ident, self.fp = key, ident, tc.identity_digest(ident)
        rule = config.rule
        self.coefficients = table if rule == "teacache" else None
        self.magnitudes = table if rule == "magcache" else None
        self.table = table if rule == "schedule" else None  # a ResidualTable


def resolve(settings: Settings, model_patcher, conds: dict | None = None, steps: int | None = None) -> Plan:
    """The rule, threshold, residual mode and table of a run of ``steps`` steps: the model's calibration, else
    the published one for its variant (read from the model and the run's ``conds``); ValueError where the
    rule needs a calibration it lacks."""
    family = settings.family
    cfg = resolved_config(settings.config, family, steps)
    base, ident = model_identity(model_patcher, family)
    variant = step_families.model_variant(family, model_patcher, conds or {})
    key = None  # the store's, made only where the run reads or writes a calibration (it digests LoRA weights)

    def plan(used_type, table=None):
        return Plan(cfg, used_type, variant, key, ident, table)

    if cfg.calibrate:
        key = calibration_keys(model_patcher, base, conds)[0]
        return plan("calibrating", tc.COEFFICIENTS.get(family.default_type, (0, 0, 0, 1.0, 0)))
    if cfg.rule in tc.TABLELESS_RULES:  # need no table
        return plan("none")

    def published(name):
        if cfg.rule == "schedule":  # measured on the benchmark's stand-in of the family, not per variant
            return step_schedule.shipped_table(family.name)
        return tc.COEFFICIENTS.get(name) if cfg.rule == "teacache" else tc.published_magnitudes(name)

    if cfg.model_type not in ("auto", "calibrated"):
        return plan(cfg.model_type, published(cfg.model_type))
    unread: list[str] = []  # the calibration file, where it cannot be read
    key, base_key = calibration_keys(model_patcher, base, conds)
    stored = STORE.get(key, ident, unread.append)
    borrowed = stored is None and base_key is not None  # a LoRA'd clone not calibrated itself: its base model's
    if borrowed:
        stored = STORE.get(base_key, ident, unread.append)
    upgrade, upgrade_mode = tc.CALIBRATED_RULES.get(family.name, (None, None))
    if (upgrade is not None and stored is not None and getattr(stored, tc.TABLE_FIELDS[upgrade]) is not None
            and settings.config.rule == "auto" and settings.config.threshold < 0 and cfg.model_type == "auto"
            and settings.config.residual_mode != tc.OUTPUT_MODE):  # set by hand: the schedule rule plans residuals
        # this model's own calibration holds the table the family's better rule plans from, in the mode it
        # was picked with (its planner models that mode's forecasts) unless one was set by hand
        mode = upgrade_mode if settings.config.residual_mode == "auto" else cfg.residual_mode
        cfg = dataclasses.replace(cfg, rule=upgrade, residual_mode=mode, threshold=float(
            tc.RULE_THRESHOLDS.get(family.name, tc.FALLBACK_THRESHOLDS)[upgrade]))
    table = None if stored is None else getattr(stored, tc.TABLE_FIELDS[cfg.rule], None)
    if cfg.rule == "schedule" and table is not None and table.sensitivity is None:
        table = table.with_sensitivity_of(step_schedule.shipped_table(family.name))
    if table is not None:
        if borrowed:
            stats().count_reason("fallback", f"this model's weight patches (a LoRA, or the conds' hooks) have no {cfg.rule} "
                                 "calibration of their own: its base model's is used (calibrate the patched model for "
                                 "its own)",
                                 source=family.name)
        return plan("calibrated", table)
    if unread and cfg.model_type != "calibrated":  # (a calibrated run is refused below, naming the file)
        stats().count_reason("fallback", f"{unread[0]}: this run did without the calibrations in it (the next "
                             "calibration saved moves the file aside)", source=family.name)
    table = None if cfg.model_type == "calibrated" else published(variant)
    if table is None and settings.config.rule == "auto" and cfg.model_type == "auto":
        # the family's rule has no table for this model yet: First-Block needs none, so "auto" still saves
        which = "none is published" if variant == "calibrated" else variant  # a family without published tables
        host.say_once(f"teacache-no-table:{family.name}:{cfg.rule}", "ReuseKit Step Cache: no %s table for this %s "
                      "model yet (%s); rule auto uses first_block until ReuseKit TeaCache Calibrate has run on it",
                      cfg.rule, family.name, which)
        by_hand = settings.config.threshold > 0  # TeaCache's: it has no meaning for first_block
        stats().count_reason("fallback", f"no {cfg.rule} table for this model yet ({which}): rule auto used first_block"
                             + (" at its own default threshold, not the one set by hand (which is TeaCache's; set rule "
                                "first_block to set first_block's)" if by_hand else "")
                             + " (run ReuseKit TeaCache Calibrate on it once)", source=family.name)
        threshold = 0.0 if settings.config.threshold == 0.0 else tc.RULE_THRESHOLDS.get(
            family.name, tc.FALLBACK_THRESHOLDS).get("first_block", tc.FALLBACK_THRESHOLDS["first_block"])
        cfg = dataclasses.replace(cfg, rule="first_block", threshold=float(threshold))
        return plan("none")
    if table is None:
        unreadable = f"; {unread[0]}" if unread else ""
        stats().count_reason("refused", f"no calibration of this model yet ({variant}, {cfg.rule}{unreadable}): run "
                             "it once through ReuseKit TeaCache Calibrate", source=family.name)
        raise ValueError(f"ReuseKit Step Cache: model_type: no calibration for this {family.name} model yet "
                         f"({variant}, {cfg.rule}{unreadable}); run it once through ReuseKit TeaCache Calibrate (or "
                         "pick published coefficients)")
    return plan(variant, table)


def _step_callback(run: tc.RunState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """outer_sample's arguments with its step callback (the sixth) wrapped: the run hears each step end
    (:meth:`RunState.step_done`), then the user's callback (the preview, the progress bar) runs as given."""
    given = args[5] if len(args) > 5 else kwargs.get("callback")

    def callback(*a, **k):
        run.step_done()
        return None if given is None else given(*a, **k)

    if len(args) > 5:
        return (*args[:5], callback, *args[6:]), kwargs
    return args, {**kwargs, "callback": callback}


def _outer_sample(executor, *args, **kwargs):
    import comfy.model_patcher
    import comfy.model_sampling

    guider = executor.class_obj
    orig = guider.model_options
    settings: Settings | None = orig.get("transformer_options", {}).get(KEY)
    if settings is None:
        return executor(*args, **kwargs)
    sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
    steps = len(sigmas) - 1 if sigmas is not None else None
    schedule_steps = _schedule_steps(sigmas)
    plan = resolve(settings, guider.model_patcher, getattr(guider, "conds", None), schedule_steps)
    cfg = plan.config
    ms = guider.model_patcher.get_model_object("model_sampling")  # with its object patches (ModelSamplingSD3...)
    run = tc.RunState(cfg, plan.coefficients, float(ms.percent_to_sigma(cfg.start_percent)),
                      float(ms.percent_to_sigma(cfg.end_percent)), plan.magnitudes)
    top = getattr(ms, "sigma_max", None)
    if cfg.calibrate and sigmas is not None and top is not None and float(sigmas[0]) < 0.99 * float(top):
        run.partial = f"it started at sigma {float(sigmas[0]):.3g}, below the model's {float(top):.3g} (denoise under 1)"
    elif cfg.calibrate and sigmas is not None and float(sigmas[-1]) > 0:
        run.partial = (f"it stopped at sigma {float(sigmas[-1]):.3g}, above 0 (an end step before the last, the "
                       "first part of split sigmas, or a schedule that never reaches 0, as Laplace's)")
    elif cfg.calibrate and sigmas is not None and _cut_short(sigmas, schedule_steps):
        run.partial = (f"it stopped after {len(sigmas) - 1} steps of a longer schedule (an end step before the last, "
                       "the rest of the noise removed at once)")
    run.switches = _switches(getattr(guider, "conds", None))
    sampler = args[2] if len(args) > 2 else kwargs.get("sampler")
    run.adds_noise = _adds_noise(sampler)
    run.renoised = run.adds_noise and _flow_denoised(ms)
    undamped = _undamped(sampler)
    run.undamped = undamped is not None
    run.disabled_reason = replaced_reason(orig.get("transformer_options", {}), settings) \
        or _other_step_cache(guider.model_patcher)
    if run.disabled_reason is None and undamped and cfg.rule != "adaptive" and not cfg.calibrate:
        run.disabled_reason = (f"the sampler ({undamped}) builds each latent from the denoised picture itself (CFG++): "
                               f"a skipped call's error would reach it undamped, which rule {cfg.rule} does not "
                               "measure; rule adaptive measures it at every computed call and may skip")
    if run.disabled_reason is not None:
        stats().count_reason("disabled", run.disabled_reason, source=settings.family.name)
    elif run.held() and cfg.residual_mode not in ("reuse", tc.OUTPUT_MODE) and cfg.threshold and not cfg.calibrate:
        stats().count_reason("fallback", f"the sampler adds noise between its calls: residual_mode "
                             f"{cfg.residual_mode} held the last computed residual over skipped calls (a forecast "
                             "along rates that carry the noise overshoots)", source=settings.family.name)
    guider.model_options = comfy.model_patcher.create_model_options_clone(orig)
    guider.model_options["transformer_options"][RUN_KEY] = run
    guider.model_options["transformer_options"][PLAN_KEY] = (cfg.rule, cfg.residual_mode, cfg.first_blocks,
                                                             cfg.calibrate)
    if plan.table is not None and sigmas is not None:
        _plan_schedule(run, plan.table, guider, [float(s) for s in sigmas])
    if cfg.rule == "interval" and cfg.interval_power != 1.0:
        if sigmas is not None and len(sigmas) > 1:
            run.set_beat([float(s) for s in sigmas])
        else:
            stats().count_reason("fallback", "interval_power: the sampler gave no sigmas to place the beat on; "
                                 "the fixed beat ran", source=settings.family.name)
    args, kwargs = _step_callback(run, args, kwargs)
    outcome = "failed"
    try:
        out = executor(*args, **kwargs)
        outcome = "completed"
        return out
    except BaseException as exc:  # interrupted or failed: reported as such, and the sampler's own error raised
        outcome = _outcome(exc)
        raise
    finally:
        guider.model_options = orig
        _report(run, settings, plan, steps, outcome)
        run.release()  # the residuals go now, even while a failure's traceback keeps this frame


def _plan_schedule(run: tc.RunState, table: step_schedule.ResidualTable, guider, sigmas: list[float]) -> None:
    """The schedule rule's plan for this run: its sigmas, window and skip limit, and the guider's CFG scale
    and branches (ComfyUI computes no uncond at CFG 1 unless a node asked it to)."""
    cfg = run.config
    scale = float(getattr(guider, "cfg", 1.0))
    negative = bool((getattr(guider, "conds", None) or {}).get("negative"))
    two = negative and not (math.isclose(scale, 1.0) and not guider.model_options.get("disable_cfg1_optimization"))
    allowed = run.in_window(torch.tensor(sigmas[:-1], dtype=torch.float32)).tolist()  # as each call is held to
    mode = "reuse" if cfg.residual_mode == "reuse" or run.held() else "extrapolate"

    def replan(step: int, threshold: float) -> step_schedule.Plan:
        return step_schedule.plan(table, sigmas[step:], threshold, scale, two, mode, cfg.max_consecutive_skips,
                                  allowed[step:])

    run.set_plan(step_schedule.plan(table, sigmas, cfg.threshold, scale, two, mode, cfg.max_consecutive_skips,
                                    allowed), sigmas, replan)


def _report(run, settings: Settings, *args) -> None:
    """:func:`_finish`, whose failure is logged and counted, and never replaces the sampler's result or error."""
    try:
        _finish(run, settings, *args)
    except Exception as exc:
        log.exception("ReuseKit Step Cache: could not report the run")
        stats().count_reason("fallback", f"the run could not be reported ({type(exc).__name__}: {exc}): its summary, "
                             "and a calibration run's table, were not kept (the log has the traceback)",
                             source=settings.family.name)


def _outcome(exc: BaseException) -> str:
    """"interrupted" for ComfyUI's interrupt (a BaseException from 0.33), else "failed"."""
    import comfy.model_management

    return "interrupted" if isinstance(exc, comfy.model_management.InterruptProcessingException) else "failed"


MODEL_REPORTS = 8  # the models whose last run the stats keep ("models"), the most recent last


def model_label(family: Family, fp: str) -> str:
    """A model's name in the stats: its family and the start of its calibration fingerprint."""
    return f"{family.name} {fp[:8]}"


def _finish(run: tc.RunState, settings: Settings, plan: Plan, total_steps: int | None, outcome: str) -> None:
    """Report the run (stats, log line); a completed calibration run also fits and saves its polynomial."""
    summary = run.summary(total_steps)
    summary["model_type"] = used_type = plan.used_type
    summary["variant"] = plan.variant
    summary["family"] = settings.family.name
    summary["model"] = model_label(settings.family, plan.fp)
    summary["outcome"] = outcome
    s = stats()
    s.incr("runs")
    if outcome != "completed":
        s.incr(f"runs_{outcome}")
    s.incr("calls_computed", run.calls_computed)
    s.incr("calls_skipped", run.calls_skipped)
    if outcome == "completed" and total_steps and not run.calls_computed + run.calls_skipped:
        reason = (f"no call of this {settings.family.name} model reached the step cache in a whole run (its sampler "
                  "calls it outside ComfyUI's diffusion-model wrapper, as ar_video does): nothing was skipped")
        if s.count_reason("bypass", reason, source=settings.family.name):
            log.warning("ReuseKit Step Cache: %s", reason)
    for lab, c in summary["conds"].items():
        s.incr(f"{lab}_computed", c["computed"])
        s.incr(f"{lab}_skipped", c["skipped"])
    s.add_time_saved(summary["time_saved_s"])
    summary["peak_residual_bytes"] = run.residual_bytes()
    s.set_memory("device", 0)
    s.set_memory("cpu", 0)
    per_cond = ", ".join(f"{lab} {c['computed']}/{c['computed'] + c['skipped']}" for lab, c in summary["conds"].items())
    if run.config.calibrate and outcome != "completed":
        _calibration_said(settings.family.name, "refused", f"the run did not complete ({outcome}); nothing is saved "
                          "(calibration comes from complete runs only)")
    elif run.config.calibrate and (run.windowed or run.partial):
        why = run.partial or "it sampled in context windows, each window a part of the picture"
        _calibration_said(settings.family.name, "refused", f"{why}; nothing is saved (calibrate with a whole run: "
                          "denoise 1 to the last step, no context windows)")
    elif run.config.calibrate:
        _save_calibration(run, settings, plan, summary)
    s.set_info("last_run", summary)

    def with_this_run(models: dict | None) -> dict:  # each model's last run, the most recent model last
        kept = {k: v for k, v in (models or {}).items() if k != summary["model"]}
        kept[summary["model"]] = summary
        return dict(list(kept.items())[-MODEL_REPORTS:])

    s.update_info("models", with_this_run)
    log.info("ReuseKit Step Cache (%s, %s, %s %r, %s)%s: computed %d of %d model calls (%.2fx fewer; per cond %s), "
             "~%.2f s saved", settings.family.name, used_type, run.config.rule, run.config.threshold,
             run.config.residual_mode,
             "" if outcome == "completed" else f", {outcome}", run.calls_computed,
             run.calls_computed + run.calls_skipped, summary["speedup_calls"], per_cond or "none",
             summary["time_saved_s"])


def _calibration_said(family: str, event: str, reason: str) -> None:
    """A calibration run that saved nothing, or kept it in memory only: counted where the panel shows it, and
    logged."""
    stats().count_reason(event, f"calibration: {reason}", source=family)
    log.warning("ReuseKit TeaCache Calibrate (%s): %s", family, reason)


def _save_calibration(run: tc.RunState, settings: Settings, plan: Plan, summary: dict) -> None:
    """Fit and keep what a complete calibration run measured: the teacache polynomial and the
    magcache curves; a run with fewer than MIN_CALIBRATION_POINTS fitted points is discarded."""
    family = settings.family.name
    xs, ys = run.calibration_points()
    if len(xs) < tc.MIN_CALIBRATION_POINTS:
        _calibration_said(family, "refused", f"only {len(xs)} fitted points (at least {tc.MIN_CALIBRATION_POINTS} "
                          "needed: sample more steps); nothing is saved")
        return
    try:
        coeffs = tc.fit_polynomial(xs, ys)
    except ValueError as exc:
        _calibration_said(family, "refused", f"no polynomial fitted ({exc}); nothing is saved")
        return
    calibration = tc.Calibration(coeffs, run.calibration_magnitudes() or None, run.residual_table())
    try:
        STORE.put(plan.key, plan.ident, calibration, family=family, points=len(xs))
    except OSError as exc:  # never lose the run for the file: it is kept in memory
        _calibration_said(family, "fallback", f"could not save the calibration to {STORE.path} ({exc}); it is used "
                          "until ComfyUI restarts")
    summary["calibration"] = {"coefficients": list(coeffs), "points": len(xs), "fingerprint": plan.fp,
                              "magnitudes": sorted(calibration.magnitudes or ())}
    stats().set_info("last_calibration", summary["calibration"])
    log.info("ReuseKit TeaCache Calibrate (%s): fitted %s and the magnitude curves of %s from %d steps; later "
             "runs of this model with model_type auto/calibrated use them", settings.family.name,
             [round(c, 4) for c in coeffs], ", ".join(sorted(calibration.magnitudes or ())) or "no cond", len(xs))
