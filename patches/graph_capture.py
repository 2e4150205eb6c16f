"""Graph capture: the wrappers that take each diffusion-model forward through the graph decision.

``enable(patcher, max_graphs)`` adds three keyed wrappers to a patcher (clone it first):

- OUTER_SAMPLE: one run summary per sampling run (``last_run`` in the stats, one log line), and
  the end-of-run release where ``keep_graphs`` is off (patches/graph_release.py);
- APPLY_MODEL: tells the inner wrapper which BaseModel (patcher, weights, lowvram state) it runs;
- DIFFUSION_MODEL: decides per call (caching/graph_reuse.py) and replays or captures with a runner
  of caching/graph_runners.py.

Only the innermost original forward is captured: other DIFFUSION_MODEL wrappers (EasyCache,
LazyCache) keep running in Python around it, so a skipped step never replays and their decisions
stay outside the graph. A step cache that decides inside the forward (ReuseKit's TeaCache, in its
first block patch) does so through a step hook: an eager probe up to its decision, then a replay
of computed steps only (caching/protocol.py, ``STEP_HOOK``). A call runs eagerly, with the same
result and the reason counted, when the model is partially loaded (lowvram), when hooks or weight
wrappers change weights per step, when transformer patches not marked graph-safe run Python inside
the forward, under torch.compile, where the host captures the model's blocks as graphs itself
(``comfy/model_prefetch.py``), under dynamic VRAM (ComfyUI's ``ModelPatcherDynamic``: weights
stream in during every forward, so a replay could read evicted memory), or when an input cannot be
captured. Without CUDA the decision still runs (the stats show what would be reused) and every
forward runs eagerly.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import weakref
from typing import Any

import comfy.model_management
import comfy.patcher_extension as patcher_extension
import torch

from ..caching import graph_reuse as gr
from ..caching import graph_runners, protocol
from ..caching.settings import SETTINGS
from . import graph_release, host
from .graph_release import STATS, graph_set, publish_memory

log = logging.getLogger("reusekit")

KEY = gr.OPTIONS_KEY
FORCE_BACKEND: str | None = None
"""``None`` (auto: ``cuda`` on a CUDA model, decisions only elsewhere), ``"eager"`` (decisions
only), ``"emulate"`` (static buffers updated in place and the forward re-run on them, no graph:
checks the input plumbing on any device), ``"trace"`` (the forward traced once and the trace
replayed: a stale replay shows as a wrong output on any device) or ``"cuda"``."""
RUNNERS = {"emulate": graph_runners.StaticRunner, "trace": graph_runners.TraceRunner,
           "cuda": graph_runners.CudaGraphRunner}

# (weakref to the BaseModel, compiled) while its forward runs: weak, as a copy of the context (a
# callback scheduled from the sampling thread) may outlive the model
_MODEL = contextvars.ContextVar("reusekit_graph_model", default=None)
_RUN = contextvars.ContextVar("reusekit_graph_run", default=None)
_params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> its parameters

if "graph_reuse.enabled" not in SETTINGS.snapshot():
    SETTINGS.define("graph_reuse.enabled", bool, True,
                    "Capture and replay CUDA graphs of the diffusion model (where a node asks for it).")


_MODULE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # diffusion model -> its modules' ids


def host_captures_graphs(diffusion_model) -> bool:
    """True where the host captures blocks of this diffusion model as CUDA graphs itself: one of
    its modules is in the registries of blocks ``comfy/model_prefetch.py`` warmed up or captured
    (ComfyUI 0.33 does so for text-encoder layers only). Never capture around them.

    Asked on every forward: it walks the host's registries (a text encoder's layers), never the
    model's modules, whose ids are gathered once per model (a module tree is built at load)."""
    prefetch = sys.modules.get("comfy.model_prefetch")
    marked = [s for s in (getattr(prefetch, "GRAPH_WARMED_MODULES", None), getattr(prefetch, "GRAPH_MODULES", None))
              if s]
    if not marked or not isinstance(diffusion_model, torch.nn.Module):
        return False
    ids = _MODULE_IDS.get(diffusion_model)
    if ids is None:
        ids = _MODULE_IDS[diffusion_model] = frozenset(id(m) for m in diffusion_model.modules())
    return any(id(m) in ids for s in marked for m in list(s))


def is_dynamic(patcher) -> bool:
    """True for a patcher under dynamic VRAM (ComfyUI's ``ModelPatcherDynamic``)."""
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def _param_names(fn) -> tuple[list[str], bool]:
    key = getattr(fn, "__func__", fn)
    try:
        found = _params.get(key)
    except TypeError:  # not weakly referable: not remembered
        key = found = None
    if found is None:
        names, var = [], False
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind == p.VAR_POSITIONAL:
                var = True
        found = (names, var)
        if key is not None:
            _params[key] = found
    return found


def _bind(fn, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    names, _ = _param_names(fn)
    named = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(args)]
    named.extend(kwargs.items())
    return named


def _backend(device: torch.device) -> str:
    if FORCE_BACKEND is not None:
        if FORCE_BACKEND == "cuda" and device.type != "cuda":
            return "eager"
        return FORCE_BACKEND
    return "cuda" if device.type == "cuda" and torch.cuda.is_available() else "eager"


_BACKEND_LABELS = {"cuda": "cuda (graphs captured and replayed)", "emulate": "emulate (static buffers, no graph)",
                   "trace": "trace (the forward traced at capture and replayed)", "eager": "eager: decisions only"}
_last_label: list[str] = [""]


def _say_backend(backend: str, device: torch.device) -> None:
    label = _BACKEND_LABELS.get(backend, backend)
    if backend == "eager":
        label += " (no CUDA)" if device.type != "cuda" else " (forced)"
    if label != _last_label[0]:
        _last_label[0] = label
        STATS.info("backend", label)


def _state_bypass(base_model, compiled: bool) -> tuple[str, str] | None:
    if compiled or torch.compiler.is_compiling():
        return "torch_compile", "the model runs through torch.compile"
    if host_captures_graphs(getattr(base_model, "diffusion_model", None)):
        return "host_graphs", "ComfyUI captures this model's blocks as CUDA graphs itself (comfy/model_prefetch.py)"
    patcher = getattr(base_model, "current_patcher", None)
    if is_dynamic(patcher):
        return "dynamic_vram", ("the model runs under dynamic VRAM: its weights stream in during every forward, "
                                "so a replay could read evicted memory")
    if getattr(base_model, "model_lowvram", False) or getattr(base_model, "lowvram_patch_counter", 0):
        return "partial_load", "weights are partially loaded (lowvram): they move during the forward"
    if patcher is not None:
        if getattr(patcher, "hook_patches", None) or getattr(patcher, "current_hooks", None) is not None:
            return "weight_hooks", "hooks change weights per step"
        if getattr(patcher, "weight_wrapper_patches", None):
            return "weight_wrappers", "weight wrappers run on every forward"
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return "autograd", "gradients are enabled"
    return None


def _state_fields(base_model, device: torch.device, backend: str) -> tuple:
    patcher = getattr(base_model, "current_patcher", None)
    weights = (getattr(patcher, "patches_uuid", None), getattr(base_model, "current_weight_patches_uuid", None))
    autocast = torch.is_autocast_enabled(device.type)
    mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), autocast,
            torch.get_autocast_dtype(device.type) if autocast else None)
    objects = getattr(patcher, "object_patches", None)
    objects = tuple((k, gr.Same(v)) for k, v in objects.items()) if objects else ()
    # (weights set anew after the object patches: applying those sets their modules, and a rebuild names the
    # first field that differs)
    return (("model.weights", "weights", weights), ("model.object_patches", "object_patches", objects),
            ("model.set_anew", "weights", graph_release.set_anew(base_model)), ("mode", "mode", mode + (backend,)))


_NOT_RUN = object()


def _count(run: gr.RunSummary | None, group: str, reason: str, detail: str = "") -> None:
    """A rebuild or a bypass by its reason's name (the counter ``<group>.<reason>``); a bypass also with
    what it means (``detail``) in the stats' reasons."""
    STATS.incr(f"{group}.{reason}")
    if group == "bypasses":
        STATS.reason("bypass", detail, source=reason)
    if run is not None:
        d = run.rebuilds if group == "rebuilds" else run.bypasses
        d[reason] = d.get(reason, 0) + 1


class _Call:
    """One forward on its way through the decision: the call as made, and what was found for it."""

    __slots__ = ("original", "args", "kwargs", "opts", "run", "base_model", "device", "backend", "runner_cls",
                 "named", "spec", "hook", "done")

    def __init__(self, original, args: tuple, kwargs: dict, opts: dict, run: gr.RunSummary | None):
        self.original, self.args, self.kwargs, self.opts, self.run = original, args, kwargs, opts, run
        self.base_model = self.device = self.runner_cls = self.spec = self.hook = None
        self.backend = ""
        self.named: list[tuple[str, Any]] = []
        self.done = _NOT_RUN  # the forward's output where it already ran (a step hook's probe)

    def forward(self):
        return self.original(*self.args, **self.kwargs)

    def eager(self, done=_NOT_RUN):
        """The forward's output, run eagerly (or ``done``, where it already ran), counted as such."""
        STATS.incr("eager_steps")
        if self.run is not None:
            self.run.eager += 1
        done = self.done if done is _NOT_RUN else done
        return self.forward() if done is _NOT_RUN else done

    def note(self, text: str) -> None:
        if self.run is not None:
            self.run.note(text)


def graph_call(original, args: tuple, kwargs: dict, opts: dict, ctx):
    """One diffusion-model forward through the graph decision (``original`` is the innermost
    forward; ``ctx`` is (BaseModel, compiled) from the APPLY_MODEL wrapper or None)."""
    if torch.compiler.is_compiling():  # traced by torch.compile: stay out of its way
        return original(*args, **kwargs)
    call = _Call(original, args, kwargs, opts, _RUN.get())
    if call.run is not None:
        call.run.steps += 1
    why = _why_eager(call, ctx)
    if why is not None:
        _count(call.run, "bypasses", *why)
        return call.eager()
    gs = graph_set(call.base_model, int(opts.get("max_graphs", 2)))
    with gs.in_use():  # a release from another thread until the replay or capture ends frees nothing
        decision = gs.decide(call.spec.signature)
        if call.hook is not None and _step_hook_finished(call, probe=not _runs_eagerly(call, decision)):
            return call.done
        if decision.hit:
            return _replay(call, decision.entry)
        return _capture(gs, call, decision)


def _why_eager(call: _Call, ctx) -> tuple[str, str] | None:
    """Why this call cannot replay or capture (the bypass reason's name and what it means, noted in the
    run), or None; on None the call's backend, arguments by name, signature and step hook are filled in."""
    if gr.env_disabled() or not call.opts.get("enabled", True) or not SETTINGS.get("graph_reuse.enabled"):
        why = (f"{gr.DISABLE_ENV} is set" if gr.env_disabled()
               else "the node's enable is off" if not call.opts.get("enabled", True)
               else "the setting graph_reuse.enabled is off")
        if call.run is not None:
            call.run.backend = "disabled"
        call.note(f"graph capture disabled ({why})")
        return "disabled", f"graph capture disabled ({why})"
    if ctx is None:
        return "no_context", "the model's APPLY_MODEL wrapper did not run around this forward"
    call.base_model, compiled = ctx
    call.device = next((a.device for a in call.args if isinstance(a, torch.Tensor)), None) or next(
        (v.device for v in call.kwargs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    call.backend = _backend(call.device)
    if call.backend == "eager" and call.device.type != "cuda":
        host.say_once("graph:nocuda", "ReuseKit graph: no CUDA device, the model runs eagerly "
                      "(the reuse decision still runs and is counted)")
    _say_backend(call.backend, call.device)
    if call.run is not None:
        call.run.backend = call.backend
    bypass = _state_bypass(call.base_model, compiled)
    if bypass is not None:
        host.say_once(f"graph:bypass:{bypass[0]}", "ReuseKit graph: running eagerly: %s", bypass[1])
        call.note(bypass[1])
        return bypass
    call.named = _bind(call.original, call.args, call.kwargs)
    call.spec = gr.analyse_call(call.named, _state_fields(call.base_model, call.device, call.backend), call.device)
    STATS.incr("checks")
    if call.spec.bypass is not None:
        host.say_once(f"graph:bypass:{call.spec.bypass}:{call.spec.detail}", "ReuseKit graph: running eagerly: %s",
                      call.spec.detail)
        call.note(call.spec.detail)
        return call.spec.bypass, call.spec.detail
    call.runner_cls = RUNNERS.get(call.backend)
    call.hook = graph_runners.step_hook(call.named)
    return None


def _runs_eagerly(call: _Call, decision: gr.Decision) -> bool:
    """Whether the call runs eagerly whatever the step cache decides: its signature's capture failed, or it
    needs a capture where none may be made now (this run stopped capturing, captures are off on the device)."""
    if decision.hit:
        return bool(decision.entry.failed)
    return (call.run is not None and call.run.capture_stopped) or (
        call.backend == "cuda" and graph_runners.captures_off(call.device))


def _step_hook_finished(call: _Call, probe: bool = True) -> bool:
    """The step cache's decision, made eagerly outside the graph: True where it finished the call
    (a skipped step, or a forward that ended without deciding), with its output in ``call.done``. Without
    ``probe`` (nothing will replay) one eager pass decides and computes."""
    hook = call.hook
    # the forward may write into its options (Flux: block indices); buffers follow the signature
    call.named = [(k, dict(v) if k == protocol.OPTIONS_NAME and isinstance(v, dict) else v) for k, v in call.named]
    if call.runner_cls is None or not probe:  # nothing replays: one eager pass decides (and computes)
        call.done = call.forward()
    else:
        probed = hook.probe(call.forward)
        if probed is not None and getattr(hook, "half", False):  # a step on some conds' rows: it ran eagerly
            STATS.reason("fallback", "a step cache cond-only step (schedule rule) runs the blocks on some conds' rows, "
                         "which a graph of the whole call cannot replay: it ran eagerly", source="step_hook_half")
            call.done = call.eager(probed)
            return True
        if probed is not None and not hook.skip:  # finished without deciding: it ran eagerly
            _count(call.run, "bypasses", "step_hook_undecided", "the step cache did not decide in its probe: the "
                   "forward ran eagerly")
            call.done = call.eager(probed)
            return True
        if probed is not None:
            call.done = probed
    if hook.skip:  # the step cache skipped this step eagerly: nothing replays
        STATS.incr("step_cache_skips")
        if call.run is not None:
            call.run.step_skips += 1
        return True
    return False


def _replay(call: _Call, entry: gr.Entry):
    """A kept graph fits: replay it (eager where its capture failed or nothing was captured)."""
    run = call.run
    if entry.failed:
        _count(run, "bypasses", "capture_failed", f"this signature's capture failed: {entry.failed}")
        return call.eager()
    if entry.runner is not None:
        # ComfyUI checks for a cancel in every op of the forward; a replay runs none of them (before the
        # counts: a cancelled step is no hit)
        comfy.model_management.throw_exception_if_processing_interrupted()
    STATS.incr("hits")
    if run is not None:
        run.hits += 1
        run.misses_in_row = 0
    if entry.runner is None:
        return _decisions_only(call)
    out = entry.runner.replay(call.spec.tensors)
    STATS.incr("replays")
    if run is not None:
        run.replays += 1
    return _hand_back(out, call.hook)


def _capture(gs: gr.GraphSet, call: _Call, decision: gr.Decision):
    """No kept graph fits: capture one for this signature and keep it (or, where captures keep
    failing to be reused in this run or nothing replays here, run eagerly)."""
    run = call.run
    if call.backend == "cuda" and graph_runners.captures_off(call.device):
        host.say_once(f"graph:captures_off:{call.device}", "ReuseKit graph: %s: %s", call.device,
                      graph_runners.CAPTURES_OFF, level=logging.WARNING)
        _count(run, "bypasses", "captures_off", graph_runners.CAPTURES_OFF)
        return call.eager()
    STATS.incr("misses")
    if decision.reason != "first":
        _count(run, "rebuilds", decision.reason)
        log.debug("ReuseKit graph: rebuild (%s): %s", decision.reason, decision.detail)
        call.note(f"rebuild ({decision.reason}): {decision.detail}")
    if run is not None and call.runner_cls is not None:
        run.misses_in_row += 1
        if run.capture_stopped or run.misses_in_row > gr.THRASH_LIMIT:
            # every call needs a new graph (more batches or shapes than max_graphs, an option that
            # changes per step): a capture costs a few forwards, so this run captures no more
            # (kept graphs still replay)
            if not run.capture_stopped:
                run.capture_stopped = True
                run.note(f"{run.misses_in_row} rebuilds in a row: no more captures in this run "
                         f"(last: {decision.reason}; raise max_graphs?)")
            _count(run, "bypasses", "unstable_inputs", f"more than {gr.THRASH_LIMIT} rebuilds in a row: no more "
                   "captures in this run (raise max_graphs?)")
            return call.eager()
    if call.runner_cls is None:  # decisions only
        gs.retire(gs.add(gr.Entry(call.spec.signature)))
        publish_memory()
        return _decisions_only(call)
    graph_release.follow_modules(call.base_model)  # (nothing replays in decisions only)
    with gs.lock:  # (a release from another thread, the panel's clear, empties the entries meanwhile)
        if not any(e.runner is not None for e in gs.entries.values()):
            gs.shared.clear()  # no graph holds the backend's pool any more: the next one starts anew
        generation = gs.generation  # a release during the capture: the new graph is not kept
    runner = call.runner_cls(call.original, call.named, len(call.args), call.spec, call.device, gs.shared,
                             (comfy.model_management.InterruptProcessingException,))
    try:
        with protocol.preparing_capture():
            out, failure = runner.capture(int(call.opts.get("warmup", 1)))
    except BaseException:
        runner.release()
        raise
    if failure:
        runner.release()
        STATS.incr("capture_failures")
        STATS.reason("fallback", f"could not capture this forward, it ran eagerly: {failure}", source="capture")
        host.say_once(f"graph:fail:{failure}", "ReuseKit graph: could not capture this forward, it runs "
                      "eagerly: %s", failure, level=logging.WARNING)
        call.note(f"capture failed: {failure}")
        out = call.eager(out)  # the capture's warm-up ran the forward eagerly: counted as such
        entry = gr.Entry(call.spec.signature, failed=failure)
    else:
        STATS.incr("captures")
        if run is not None:
            run.captures += 1
        entry = gr.Entry(call.spec.signature, runner, runner.nbytes)
    evicted = gs.add(entry, generation)
    if graphs := sum(e is not entry and not e.failed for e in evicted):  # (an old failure's verdict is no graph)
        STATS.incr("evictions", graphs)
    gs.retire(evicted)
    publish_memory()
    return _hand_back(out, call.hook)


def _decisions_only(call: _Call):
    """The forward run eagerly where nothing replays on this backend (the decision was made and counted)."""
    why = "no CUDA device" if call.device.type != "cuda" else f"backend {call.backend} forced"
    STATS.reason("fallback", f"{why}: graphs are decided, not captured; the forward ran eagerly",
                 source=call.backend)
    return call.eager()


def _hand_back(out, hook):
    """A runner's output; with a step hook, hands it the tensors its patches made in the graph."""
    if hook is None:
        return out
    out, made = out
    hook.take_graph_outputs(list(made))
    return out


# ---- the wrappers ---------------------------------------------------------------------------

def diffusion_model_wrapper(executor, *args, **kwargs):
    original = executor.original
    names, _ = _param_names(original)
    position = names.index(protocol.OPTIONS_NAME) if protocol.OPTIONS_NAME in names else len(args)
    opts = gr.node_options(protocol.transformer_options(args, kwargs, position=position))
    held = _MODEL.get()
    model = held[0]() if held is not None else None
    ctx = (model, held[1]) if model is not None else None

    def captured(*a, **k):
        return graph_call(original, a, k, opts, ctx)

    inner = executor.wrappers[executor.idx + 1:]
    if inner:  # other wrappers stay in Python around the captured original
        return patcher_extension.WrapperExecutor.new_class_executor(captured, executor.class_obj, inner).execute(
            *args, **kwargs)
    return captured(*args, **kwargs)


def apply_model_wrapper(executor, *args, **kwargs):
    to = protocol.transformer_options(args, kwargs, position=5) or {}  # apply_model(x, t, ..., transformer_options)
    wrappers = to.get("wrappers", {})
    compiled = "torch.compile" in wrappers.get("apply_model", {})
    run = _RUN.get()
    if run is not None:
        run.model_calls += 1
        run.compiled = run.compiled or compiled
    token = _MODEL.set((weakref.ref(executor.class_obj), compiled))
    try:
        return executor(*args, **kwargs)
    finally:
        _MODEL.reset(token)


UNREACHED = {  # (name, what it means) of a run whose model calls never reached the decision, by compiled
    True: ("torch_compile", "the model ran under torch.compile, which graph capture leaves alone: nothing was "
                            "captured or replayed"),
    False: ("unreached", "no forward went through ComfyUI's diffusion-model wrapper (a model without one, as Mochi; "
                         "a sampler that calls it outside one, as ar_video): nothing was captured or replayed")}


def outer_sample_wrapper(executor, *args, **kwargs):
    run = gr.RunSummary()
    token = _RUN.set(run)
    try:
        out = executor(*args, **kwargs)
        if run.model_calls and not run.steps:  # the model ran, and never through the decision
            _count(run, "bypasses", *UNREACHED[run.compiled])
        return out
    finally:
        _RUN.reset(token)
        summary = run.as_dict()
        STATS.info("last_run", summary)
        if run.backend:
            STATS.info("backend_last_run", run.backend)
        rebuilds = ", ".join(f"{k}={v}" for k, v in run.rebuilds.items()) or "none"
        log.info("ReuseKit graph: %d forwards (%s): %d captured, %d replayed, %d eager; rebuilds: %s",
                 run.steps, run.backend or "-", run.captures, run.replays, run.eager, rebuilds)
        graph_release.release_unless_kept(executor.class_obj)


def enable(patcher, max_graphs: int = 2, warmup: int = 1, keep: bool = True) -> None:
    """Add graph capture to ``patcher`` (a clone: this mutates it); ``keep``: graphs outlive the
    sampling run (they are freed anyway when ComfyUI needs the memory)."""
    graph_release.install()
    disable(patcher)
    patcher.model_options.setdefault(protocol.OPTIONS_NAME, {})[KEY] = {
        "enabled": True, "max_graphs": int(max_graphs), "warmup": int(warmup), "keep": bool(keep)}
    patcher.add_wrapper_with_key(patcher_extension.WrappersMP.OUTER_SAMPLE, KEY, outer_sample_wrapper)
    patcher.add_wrapper_with_key(patcher_extension.WrappersMP.APPLY_MODEL, KEY, apply_model_wrapper)
    patcher.add_wrapper_with_key(patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY, diffusion_model_wrapper)


def disable(patcher) -> None:
    """Remove graph capture from ``patcher`` (a clone)."""
    for kind in (patcher_extension.WrappersMP.OUTER_SAMPLE, patcher_extension.WrappersMP.APPLY_MODEL,
                 patcher_extension.WrappersMP.DIFFUSION_MODEL):
        patcher.remove_wrappers_with_key(kind, KEY)
    patcher.model_options.get(protocol.OPTIONS_NAME, {}).pop(KEY, None)


def is_enabled(patcher) -> bool:
    return KEY in patcher.model_options.get(protocol.OPTIONS_NAME, {})
