"""RoPE builder patches: each family's position-embedding builder asks its model's PE cache.

Which cache: a *scope* (a context variable) names the PE cache of the model whose ``apply_model``
is running. The ReuseKit PE Cache node opens it with an APPLY_MODEL wrapper; the global
``BaseModel.apply_model`` patch opens it for every model when the server-wide default
``pe_cache.default_enabled`` is on, and otherwise closes it, so one model's scope never leaks into
another model's call. With no scope, every patched builder runs unchanged.

Names: each builder call inside one ``apply_model`` call gets ``<builder>[<n>]|<cond_or_uncond>``
(its n-th call there, for that cond/uncond batch), so PE inputs that coexist in a step (text and
image, cond and uncond run separately, Wan's reference frames) have independent entries; when two
names of one builder hold an equal key they share one table (see ``caching/pe_cache.py``).

Keys hold host values only, so deciding a hit never reads a device tensor (no copy to the host,
no wait for the GPU). Builders whose arguments are geometry (Wan's ``rope_encode``, OmniGen2's
position embedder, Mochi's position matrix, Cosmos, HunyuanDiT) key those arguments. The
``EmbedND`` families get their ids as a tensor, so each family's forward that makes the ids is a
*geometry seam* (:class:`ForwardSeam`): it keys its own arguments by value and its tensors by
shape, dtype and device, and a call of the model's own embedder inside it keys that geometry, the
call's order in the forward and the ids' shape, never the ids' values. Inputs that make ids from
tensor values or from code the key cannot see (a ``post_input`` patch, a replaced ids builder)
leave that forward without a geometry. A builder keyed by tensor values runs through the cache only
for tensors on :data:`VALUE_KEYS_ON` devices (the CPU); on a GPU it computes, and the cache counts
why (the stats' ``reasons``).

The builder runs unchanged (counted as a bypass, with its reason) when its inputs require grad, and
while a CUDA graph is being warmed up or captured (no host sync, no tensor from the graph's pool kept).

Listeners on ``ModelPatcher.detach`` and ``partially_unload`` (patches/lifecycle.py) drop a model's
device-held tables when ComfyUI unloads it from its device or frees part of its VRAM; one on ``load`` closes the caches of models that died first (a
model dropped while loaded is only detached as a clone's swap), so the model that loads gets their memory.

Each patch has one install and one uninstall (idempotent, guarded by a probe that the host has
the function and by a shape check of its parameters, :func:`patches.host.check`: a builder a newer
ComfyUI reshaped stays uncached, with one warning); ``install()`` / ``uninstall()`` apply them all.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..caching.graph_reuse import OPTIONS_KEY as GRAPH_KEY
from ..caching.keys import Uncacheable, tensor_meta, tensors_in
from ..caching.pe_cache import PECacheKey, cache_for, close_orphaned, default_enabled
from ..caching.protocol import capturing, transformer_options
from . import host, lifecycle, rope_seams
from .host import Patch

log = logging.getLogger("reusekit")

# devices whose tensors a key may read by value: reading a CPU tensor is no transfer and no wait
VALUE_KEYS_ON = frozenset({"cpu"})


class Uncached(Exception):
    """This call runs uncached; the message is the reason counted."""


# ---- the scope -----------------------------------------------------------------------------

class _Scope:
    __slots__ = ("cache", "suffix", "counts")

    def __init__(self, cache, transformer_options: dict | None):
        self.cache = cache
        cou = (transformer_options or {}).get("cond_or_uncond")
        self.suffix = "|" + ",".join(str(c) for c in cou) if cou else ""
        self.counts: dict[str, int] = {}

    def name(self, builder: str) -> str:
        n = self.counts.get(builder, 0)
        self.counts[builder] = n + 1
        return f"{builder}[{n}]{self.suffix}"


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("reusekit_pe_scope", default=None)


class scope:  # noqa: N801  (used as a function: ``with scope(cache, options):``)
    """Inside, patched builders use ``cache`` (``None``: they run unchanged). A class rather than a
    generator: it is entered on every model call."""

    __slots__ = ("_scope", "_token")

    def __init__(self, cache, transformer_options: dict | None = None):
        self._scope = _Scope(cache, transformer_options) if cache is not None else None

    def __enter__(self) -> None:
        self._token = _SCOPE.set(self._scope)

    def __exit__(self, *exc) -> None:
        _SCOPE.reset(self._token)


def _scope_open() -> bool:
    return _SCOPE.get() is not None


def model_cache(base_model, create: bool = True):
    """The PE cache owned by a ComfyUI model (``ModelPatcher.model``)."""
    label = type(getattr(base_model, "diffusion_model", base_model)).__name__
    return cache_for(base_model, label, create=create)


class ApplyModelWrapper:
    """The node's APPLY_MODEL wrapper: opens (or, disabled, closes) the model's PE scope."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.calls = 0  # model calls through it (the run summary's: a run of one sigma calls none)

    def __call__(self, executor, *args, **kwargs):
        self.calls += 1
        cache = model_cache(executor.class_obj) if self.enabled else None
        with scope(cache, transformer_options(args, kwargs, position=5)):
            return executor(*args, **kwargs)


class RunSummary:
    """The node's OUTER_SAMPLE wrapper: after each sampling run, the run's hits, misses,
    replacements and shared tables go in the model cache's ``last_run`` info and one log line."""

    COUNTERS = ("hits", "misses", "replacements", "shared", "mutated", "bypasses")

    def __init__(self, applier: ApplyModelWrapper):
        self.applier = applier  # the node's APPLY_MODEL wrapper, which counts the run's model calls

    def __call__(self, executor, *args, **kwargs):
        patcher = getattr(executor.class_obj, "model_patcher", None)
        cache = model_cache(patcher.model) if patcher is not None else None
        stats = cache.stats if cache is not None else None
        if stats is None:
            return executor(*args, **kwargs)
        before = {c: stats.counter(c) for c in self.COUNTERS}
        saved_before = stats.snapshot()["time_saved_s"]
        calls_before = self.applier.calls
        finished = False
        try:
            out = executor(*args, **kwargs)
            finished = True
            return out
        finally:
            cache.publish()  # the per-name counts of the run's hits
            run = {c: stats.counter(c) - before[c] for c in self.COUNTERS}
            run["time_saved_s"] = round(stats.snapshot()["time_saved_s"] - saved_before, 6)
            stats.set_info("last_run", run)
            if finished and self.applier.calls > calls_before and not any(run[c] for c in self.COUNTERS) \
                    and not _replays_graphs(patcher) and not any(p.off for p in PATCHES):  # (a builder left
                # unpatched has its own row; a run of one sigma, SplitSigmas' last part, calls no model)
                model = type(getattr(patcher.model, "diffusion_model", patcher.model)).__name__
                stats.count_reason("bypass", f"this run's {model} asked for no position table: its family builds "
                                   "none that the PE cache covers (a UNet such as SD1.5's or SDXL's, SD3's learned "
                                   "positions), so nothing was cached", source=model)
            log.info("ReuseKit PE cache (%s): %d hits, %d misses, %d replacements, %d shared, %d uncached, "
                     "%.1f ms saved", stats.name, run["hits"], run["misses"], run["replacements"], run["shared"],
                     run["bypasses"], run["time_saved_s"] * 1e3)


def _replays_graphs(patcher) -> bool:
    """Whether ReuseKit Graph Capture is on the model: a run of replays asks its builders nothing."""
    return any(GRAPH_KEY in (patcher.wrappers.get(kind) or {}) for kind in (patcher.wrappers or {}))


def _requires_grad(args, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values()))


def cached(builder: str, make_key: Callable[[PECacheKey], Any], compute: Callable[[], Any],
           args: tuple = (), kwargs: dict | None = None):
    """Run ``compute`` through the current scope's cache under the next name for ``builder``.

    ``make_key`` fills the key (return ``False``, or raise :class:`Uncached` with a reason, or meet a
    value the key rules cannot describe: the call runs uncached, its reason counted). While ``compute``
    runs on a miss the scope is closed, so nested builders do not store a second copy."""
    sc = _SCOPE.get()
    if sc is None:
        return compute()
    name = sc.name(builder)
    # under capture: no host sync (key compares), no storing tensors from the warm-up stream or the
    # graph's private pool; the builder then runs inside the graph unchanged
    why = ("inputs require grad" if _requires_grad(args, kwargs or {})
           else "CUDA graph capture" if capturing() else None)
    key = PECacheKey(name, group=builder)  # one builder's names may share equal tables
    if why is None:
        try:
            if make_key(key) is False:
                why = f"{builder}: a module the key cannot describe"
        except Uncached as e:
            why = str(e)
        except Uncacheable as e:  # a value the key rules cannot describe (caching/keys.py)
            why = f"{builder}: {e}"
    if why is not None:
        sc.cache.bypass(name, why)
        return compute()

    def build():
        token = _SCOPE.set(None)
        try:
            return compute()
        finally:
            _SCOPE.reset(token)

    return sc.cache.get_or_create(key, build)


def _add_value(key: PECacheKey, value, what: str) -> PECacheKey:
    """``value`` keyed by its values: tensors only where reading them is no transfer
    (:data:`VALUE_KEYS_ON`); a device tensor makes the call run uncached instead."""
    for t in tensors_in(value):
        if t.device.type not in VALUE_KEYS_ON:
            raise Uncached(f"{what} on the {t.device.type} device, keyed by value: not read, computed")
    return key.add(value)


_PLAIN = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class _Binder:
    """``sig.bind(*args, **kwargs)`` with defaults applied, as a dict in parameter order, without
    ``inspect`` for a signature of plain parameters (a few microseconds less on every PE hit); a
    signature with ``*args`` / ``**kwargs``, or a call that does not fit it, goes through ``inspect``
    (which raises as it would). Made once per patched builder."""

    def __init__(self, fn: Callable):
        self.sig = inspect.signature(fn)
        params = list(self.sig.parameters.values())
        self.plain = all(p.kind in _PLAIN for p in params)
        self.names = tuple(p.name for p in params)
        self.positional = tuple(p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY)
        self.by_name = frozenset(p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def __call__(self, args: tuple, kwargs: dict) -> dict:
        if self.plain and len(args) <= len(self.positional):
            out = dict(zip(self.positional, args, strict=False))  # fewer arguments: defaults
            if all(k in self.by_name and k not in out for k in kwargs):
                out.update(kwargs)
                defaults = self.defaults
                if all(n in out or n in defaults for n in self.names):
                    return {n: out[n] if n in out else defaults[n] for n in self.names}
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


def _add_bound(key: PECacheKey, bind: _Binder, args, kwargs, skip: tuple = (),
               builder: str = "") -> PECacheKey:
    """Every argument of a call, by parameter name and in order, defaults applied (tensors by value:
    host tensors only, see :func:`_add_value`)."""
    for pname, value in bind(args, kwargs).items():
        if pname in skip:
            continue
        _add_value(key.add(pname), value, f"{builder} {pname}".strip())
    return key


# ---- patch plumbing ------------------------------------------------------------------------

def _called_by_name(*where: tuple[str, str], calls: Callable | None = None) -> Callable[[], None]:
    """A check that the module-level functions a builder's host code calls by name (flux's ``rope``)
    are still the ones they were when the builder was patched: it raises :class:`Uncached` once one is
    not (another node rebound it, as packs do for an fp32 ``rope``; the key does not hold it). ``where``
    names them; ``calls``: the host function, whose ComfyUI functions called by name are found in its
    code, and theirs in turn (LTX's ``generate_freqs`` and the helpers it calls)."""
    recorded = []
    for module, name in where:
        namespace = vars(importlib.import_module(module))
        if name in namespace:
            recorded.append((namespace, module, name, namespace[name]))
    recorded += _functions_called(calls) if calls is not None else []

    def check() -> None:
        for namespace, module, name, fn in recorded:
            if namespace.get(name) is not fn:
                raise Uncached(f"{module}.{name} was replaced after the PE cache was installed")
    return check


def _functions_called(fn: Callable) -> list[tuple[dict, str, str, Callable]]:
    """(namespace, module, name, function) of each ComfyUI function ``fn`` reads by name, from its module's
    globals or through a ComfyUI module (``comfy.ldm.flux.math.rope``), and of those they read, transitively."""
    found: dict[tuple[int, str], tuple] = {}
    todo = [fn]
    while todo:
        f = inspect.unwrap(todo.pop())
        if getattr(f, "__code__", None) is None or getattr(f, "__globals__", None) is None:
            continue
        for namespace, name, target in host.globals_read(f, through=_comfy):
            if _comfy(target) and inspect.isfunction(target) and (id(namespace), name) not in found:
                found[id(namespace), name] = (namespace, namespace.get("__name__", "?"), name, target)
                todo.append(target)
    return list(found.values())


def _comfy(value) -> bool:
    """A module or function of ComfyUI's ``comfy`` packages."""
    return (getattr(value, "__name__" if inspect.ismodule(value) else "__module__", None) or "").startswith("comfy")


def _embedder_check(embednd: type, builder: str) -> Callable[[Any], None]:
    """A check for a builder that calls its ``EmbedND`` inside the cached computation (Wan, OmniGen2): it raises
    :class:`Uncached` where the call may not compute what it did when the builder was patched: hooks on the
    embedder or on every module, a forward set on the instance, or ``EmbedND.forward`` replaced on the class
    since (by another pack; ReuseKit's own patch of it comes first)."""
    forward = vars(embednd).get("forward")

    def check(embedder) -> None:
        why = rope_seams.hooked(embedder)
        if why is None and vars(embednd).get("forward") is not forward:
            why = f"{embednd.__qualname__}.forward was replaced after the PE cache was installed"
        if why is not None:
            raise Uncached(f"{builder}: rope_embedder: {why}")
    return check


# ---- the builders --------------------------------------------------------------------------

def _embednd(builder: str):
    """flux.layers.EmbedND / hidream.EmbedND ``forward(self, ids)``: keyed by theta and axes and,
    when the model's own embedder is called inside its family forward (``rope_seams``), by that
    forward's geometry, the call's order in it and the ids' shape, dtype and device (host values
    only), unless the embedder's class overrides ``forward`` (a node's subclass may change the ids
    before it calls this one, by settings of its own). Anywhere else the ids are keyed by value, on the
    CPU only (:func:`_add_value`)."""
    def make(original):
        rope_unchanged = _called_by_name((original.__module__, "rope"), calls=original)

        def forward(self, ids):
            def key(k):
                rope_unchanged()
                k.add(type(self).__qualname__).add(self.theta).add(list(self.axes_dim))
                geometry = rope_seams.current()
                if geometry is not None and geometry.owns(self):
                    why = geometry.why
                    if type(self).forward is not forward:
                        why = f"{builder}: {type(self).__qualname__} overrides its forward"
                    elif geometry.fields is not None:
                        k.add_encoded(geometry.fields).add(geometry.next_call()).add_encoded(tensor_meta(ids))
                        return
                    if ids.device.type not in VALUE_KEYS_ON:
                        raise Uncached(why)
                    _add_value(k, ids, f"{builder} ids")
                elif geometry is None:  # a model class whose forward has no seam (a custom node's, a ControlNet's)
                    _add_value(k, ids, f"{builder} ids outside a family forward with a geometry seam")
                else:  # another module's embedder called inside a family forward (a patch's own)
                    _add_value(k, ids, f"{builder} ids of an embedder not the running family forward's own")
            return cached(builder, key, lambda: original(self, ids), (ids,))
        return forward
    return make


def _rope_options(transformer_options) -> Any:
    opts = (transformer_options or {}).get("rope_options")
    return dict(opts) if opts is not None else None


def _wan_rope_encode(original):
    """WanModel.rope_encode(t, h, w, t_start, steps_*, device, dtype, transformer_options): keyed
    by the geometry, so a hit skips building the ids as well as the table. Only while the model's
    rope_embedder is the host's EmbedND (theta and axes decide it): a module a custom node put there
    (e.g. RIFLEx, with its own k and frame count) runs every call."""
    bind = _Binder(original)
    host_embednd = importlib.import_module("comfy.ldm.flux.layers").EmbedND
    rope_unchanged = _called_by_name(("comfy.ldm.flux.layers", "rope"), ("comfy.ldm.wan.model", "rope"), calls=original)
    embedder_unchanged = _embedder_check(host_embednd, "wan.rope_encode")

    def rope_encode(self, *args, **kwargs):
        def key(k):
            rope_unchanged()
            if type(self.rope_embedder) is not host_embednd:
                return False
            embedder_unchanged(self.rope_embedder)
            a = bind((self, *args), kwargs)
            a.pop("self")
            to = a.pop("transformer_options", None)
            for pname, value in a.items():
                _add_value(k.add(pname), value, f"wan.rope_encode {pname}")
            emb = self.rope_embedder
            _add_value(k.add(tuple(self.patch_size)), _rope_options(to), "wan.rope_encode rope_options")
            k.add(type(emb).__qualname__).add(getattr(emb, "theta", None)).add(list(getattr(emb, "axes_dim", ())))
        return cached("wan.rope_encode", key, lambda: original(self, *args, **kwargs))
    return rope_encode


def _function(builder: str):
    """A module-level builder whose every argument decides the result (tensors by value: cached on
    the CPU only, see :func:`_add_value`)."""
    def make(original):
        bind = _Binder(original)
        unchanged = _called_by_name(calls=original)

        def key(k, args, kwargs):
            unchanged()
            _add_bound(k, bind, args, kwargs, builder=builder)

        def fn(*args, **kwargs):
            return cached(builder, lambda k: key(k, args, kwargs), lambda: original(*args, **kwargs), args, kwargs)
        return fn
    return make


def _ltx_precompute_freqs_cis(original):
    """LTXBaseModel._precompute_freqs_cis (ComfyUI >= 0.8): every argument (positions by value: its
    grid is made from keyframe and mask values, so on a GPU it computes) and the model's rope type and
    frequency-grid generator, which decide the (matrix, split_mode)."""
    bind = _Binder(original)
    unchanged = _called_by_name(calls=original)  # generate_freqs, freqs_cis_matrix and their helpers

    def _precompute_freqs_cis(self, *args, **kwargs):
        def key(k):
            unchanged()
            _add_bound(k, bind, (self, *args), kwargs, skip=("self",), builder="ltxv.freqs_cis")
            gen = self.freq_grid_generator
            k.add(str(getattr(self.split_positional_embedding, "value", self.split_positional_embedding)))
            k.add(f"{getattr(gen, '__module__', '')}.{getattr(gen, '__qualname__', type(gen).__qualname__)}")

        def build():
            matrix, split_mode = original(self, *args, **kwargs)
            return matrix, bool(split_mode)

        return cached("ltxv.freqs_cis", key, build, args, kwargs)
    return _precompute_freqs_cis


def _cosmos_generate(original):
    """VideoRopePosition3DEmb.generate_embeddings: keyed by the full B,T,H,W,C size, fps, the ntk
    factors, dtype, device and the module's frequency ranges (by shape) and fps settings."""
    bind = _Binder(original)
    unchanged = _called_by_name(calls=original)

    def generate_embeddings(self, *args, **kwargs):
        def key(k):
            unchanged()
            _add_bound(k, bind, (self, *args), kwargs, skip=("self",), builder="cosmos.rope3d")
            k.add(self.base_fps).add(self.enable_fps_modulation)
            k.add(self.h_ntk_factor).add(self.w_ntk_factor).add(self.t_ntk_factor)
            # buffers made at init from the head dim (arange / dim): their shape, dtype and device decide
            # them, and reading their values would be a device read on every hit
            k.add_encoded(tensor_meta(self.dim_spatial_range)).add_encoded(tensor_meta(self.dim_temporal_range))
        return cached("cosmos.rope3d", key, lambda: original(self, *args, **kwargs), args, kwargs)
    return generate_embeddings


def _omnigen2_rope(original):
    """OmniGen2RotaryPosEmbed.forward(batch_size, encoder_seq_len, lengths, sizes..., device): every
    argument is a host value (integers, lists of sizes, the device), so a hit skips the ids, the
    table and its split; also keyed by the module's theta, axes, lengths, patch size and embedder."""
    bind = _Binder(original)
    host_embednd = importlib.import_module("comfy.ldm.flux.layers").EmbedND
    rope_unchanged = _called_by_name(("comfy.ldm.flux.layers", "rope"), calls=original)
    embedder_unchanged = _embedder_check(host_embednd, "omnigen2.rope")

    def forward(self, *args, **kwargs):
        def key(k):
            rope_unchanged()
            emb = self.rope_embedder
            if type(emb) is not host_embednd:
                return False
            embedder_unchanged(emb)
            _add_bound(k, bind, (self, *args), kwargs, skip=("self",), builder="omnigen2.rope")
            k.add(self.theta).add(list(self.axes_dim)).add(list(self.axes_lens)).add(self.patch_size)
            k.add(emb.theta).add(list(emb.axes_dim))

        def build():  # the lengths are lists: stored as tuples, a fresh list on every return
            *tables, cap_lengths, seq_lengths = original(self, *args, **kwargs)
            return (*tables, tuple(cap_lengths), tuple(seq_lengths))

        *tables, cap_lengths, seq_lengths = cached("omnigen2.rope", key, build, args, kwargs)
        return (*tables, list(cap_lengths), list(seq_lengths))
    return forward


def _hydit_calc_rope(original):
    """hydit calc_rope(x, patch_size, head_size): only x's height, width, dtype and device count."""
    unchanged = _called_by_name(calls=original)  # get_2d_rotary_pos_embed, get_fill_resize_and_crop...

    def calc_rope(x, patch_size, head_size):
        def key(k):
            unchanged()
            k.add_encoded((x.shape[2:4], x.dtype, x.device)).add(patch_size).add(head_size)
        return cached("hydit.rope", key, lambda: original(x, patch_size, head_size))
    return calc_rope


# Families whose builder moved between ComfyUI versions have one patch per place; a host has one.
# The geometry seams (patches/rope_seams.py) give the EmbedND families their host-value keys.
PATCHES: tuple[Patch, ...] = (
    Patch("flux, chroma, chroma radiance, hunyuan video, qwen-image, lumina2/z-image, wan",
          "comfy.ldm.flux.layers", "EmbedND.forward", _embednd("EmbedND"), ("self", "ids"), exact=True),
    Patch("hidream", "comfy.ldm.hidream.model", "EmbedND.forward", _embednd("hidream.EmbedND"), ("self", "ids"),
          exact=True),
    Patch("wan (geometry)", "comfy.ldm.wan.model", "WanModel.rope_encode", _wan_rope_encode,
          ("self", "t", "h", "w", "t_start", "steps_t", "steps_h", "steps_w", "device", "dtype",
           "transformer_options")),
    Patch("ltxv", "comfy.ldm.lightricks.model", "precompute_freqs_cis", _function("ltxv.freqs_cis"),
          ("indices_grid", "dim", "out_dtype", "theta", "max_pos")),  # ComfyUI < 0.8
    Patch("ltxv", "comfy.ldm.lightricks.model", "LTXBaseModel._precompute_freqs_cis", _ltx_precompute_freqs_cis,
          ("self", "indices_grid", "dim", "out_dtype", "theta", "max_pos")),  # ComfyUI >= 0.8, LTX-2
    Patch("cosmos", "comfy.ldm.cosmos.position_embedding", "VideoRopePosition3DEmb.generate_embeddings",
          _cosmos_generate, ("self", "B_T_H_W_C", "fps", "h_ntk_factor", "w_ntk_factor", "t_ntk_factor")),
    Patch("mochi (positions)", "comfy.ldm.genmo.joint_model.asymm_models_joint", "create_position_matrix",
          _function("mochi.positions"), ("T", "pH", "pW", "device", "dtype")),
    Patch("mochi", "comfy.ldm.genmo.joint_model.asymm_models_joint", "compute_mixed_rotation",
          _function("mochi.rotation"), ("freqs", "pos")),
    Patch("omnigen2", "comfy.ldm.omnigen.omnigen2", "OmniGen2RotaryPosEmbed.forward", _omnigen2_rope,
          ("self", "batch_size", "encoder_seq_len", "l_effective_cap_len", "l_effective_ref_img_len",
           "l_effective_img_len", "ref_img_sizes", "img_sizes", "device"), exact=True),
    *(Patch(f"{seam.family} (geometry)", seam.module, seam.attr, functools.partial(seam.make, active=_scope_open),
            seam.params) for seam in rope_seams.SEAMS),
    Patch("hunyuan dit", "comfy.ldm.hydit.models", "calc_rope", _hydit_calc_rope, ("x", "patch_size", "head_size"),
          exact=True),
    Patch("hunyuan dit controlnet", "comfy.ldm.hydit.controlnet", "calc_rope", _hydit_calc_rope,
          ("x", "patch_size", "head_size"), exact=True),
)


def _apply_model(original):
    """BaseModel.apply_model: every model call opens its own scope (the model's cache when the
    server-wide default is on, else none); the node's APPLY_MODEL wrapper runs inside and wins."""
    def apply_model(self, *args, **kwargs):
        cache = model_cache(self) if default_enabled() else None
        with scope(cache, transformer_options(args, kwargs, position=5)):
            return original(self, *args, **kwargs)
    return apply_model


SCOPE_PATCH = Patch("every model (scope)", "comfy.model_base", "BaseModel.apply_model", _apply_model,
                    ("self", "x", "t", "c_concat", "c_crossattn", "control", "transformer_options"),
                    host_only=False)  # it only opens a scope around whatever apply_model is


def release_device_tables(patcher, unpatch_all=True, *args, **kwargs) -> None:
    """Before ``ModelPatcher.detach`` (a lifecycle listener): when ComfyUI unloads a model from its
    device (``unpatch_all``), the tables its PE cache holds on that device go too, so an offloaded
    model keeps no VRAM through it (node or server-wide default alike); CPU tables stay (no VRAM,
    and they save the rebuild). ``detach(unpatch_all=False)`` only means another clone of the
    model took its place."""
    if unpatch_all:
        cache = model_cache(patcher.model, create=False)
        if cache is not None and cache.nbytes().get("device"):
            cache.clear()


def release_for_memory(patcher, device_to=None, memory_to_free=0, *args, **kwargs) -> None:
    """Before ``ModelPatcher.partially_unload`` (a lifecycle listener): ComfyUI frees part of a loaded model's
    VRAM for another model, which is how dynamic VRAM (ComfyUI 0.16 and newer, the default on NVIDIA)
    unloads a model and how any host makes room under pressure; the model's device-held tables go too."""
    if memory_to_free and memory_to_free > 0:
        release_device_tables(patcher, unpatch_all=True)


def _close_orphaned(patcher, *args, **kwargs) -> None:
    """Before ComfyUI loads a model (a lifecycle listener): the PE caches of models that died close now."""
    close_orphaned()


GLOBAL_PATCHES = (SCOPE_PATCH,)


def install() -> list[str]:
    """Install every builder patch the host supports (idempotent); returns the families covered
    and records the PE layer (builders cached, and those left off) for the start-up line."""
    for p in GLOBAL_PATCHES:
        p.install()
    lifecycle.add_listener("detach", release_device_tables)
    lifecycle.add_listener("partially_unload", release_for_memory)
    lifecycle.add_listener("load", _close_orphaned)
    covered = [p.family for p in PATCHES if p.install()]
    off = [f"{p.family} off: {p.module}.{p.attr} {p.off}" for p in (*GLOBAL_PATCHES, *PATCHES) if p.off]
    for seam in rope_seams.SEAMS:  # installed, but its embedder keeps the value rules (no hit on a GPU)
        if seam.off:
            host.say_once(f"pe-geometry-{seam.family}", "ReuseKit PE cache: %s geometry off (%s); on a GPU its "
                          "embedder computes every call", seam.family, seam.off, level=logging.WARNING)
            off.append(f"{seam.family} geometry off: {seam.off}")
    if not all(p.installed for p in GLOBAL_PATCHES):
        host.set_layer("PE cache", "off", "; ".join(off) or "BaseModel.apply_model is patched by another copy")
    else:
        host.set_layer("PE cache", "on", f"{len(covered)} builders" + "".join(f"; {o}" for o in off))
    return covered


def count_unpatched(stats) -> None:
    """Count in a model's PE cache stats each builder this ComfyUI left unpatched (another pack's code there, a
    reshaped seam): a model whose family builds its tables there runs uncached, and its card says why."""
    for p in PATCHES:
        if p.off:
            stats.count_reason("bypass", f"{p.module}.{p.attr} {p.off}: the tables it builds ({p.family}) are not "
                               "cached", source=p.family)


def uninstall() -> None:
    for p in (*PATCHES, *GLOBAL_PATCHES):
        p.uninstall()
    lifecycle.remove_listener("detach", release_device_tables)
    lifecycle.remove_listener("partially_unload", release_for_memory)
    lifecycle.remove_listener("load", _close_orphaned)


def installed() -> bool:
    return all(p.installed for p in GLOBAL_PATCHES) and any(p.installed for p in PATCHES)
