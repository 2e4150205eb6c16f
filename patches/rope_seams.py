"""Geometry seams: the family forwards that make position ids, so a PE hit is decided from host values.

The ``EmbedND`` families (Flux and Kontext/Flux.2, Chroma, Chroma Radiance, HunyuanVideo,
Qwen-Image, Lumina 2 / Z-Image, HiDream) build their ids inside a forward and hand the embedder a
fresh device tensor every call; keying that tensor by value would copy it to the host and wait for
the GPU on every step. A :class:`ForwardSeam` wraps the forward that builds them (``_forward``,
behind the DIFFUSION_MODEL wrappers, so it sees the arguments the model really gets) and opens a
:class:`Geometry` for the call: what its ids are made from (the model, its arguments, the transformer
options the ids read), encoded. A call of the model's own embedder inside it is then keyed by the
geometry's fields (arguments by value, tensors by type, dtype, shape and device:
:func:`~..caching.keys.encode_geometry`), the call's order in the forward and the ids' shape, dtype
and device: host values only.

That is exact because the host makes those ids from nothing else, which holds only while the
forward and its ids builders are ComfyUI's own. So a forward has no geometry (its embedder calls
fall back to the value rules, which a device tensor never takes) when:

- a helper that makes ids (``process_img``, ``forward_orig``, ``img_ids``, ...) is not the host
  function recorded at install (replaced later by someone, or a subclass overrides it), or is replaced
  on the model itself (a ComfyUI object patch sets it on the instance);
- the embedder has hooks or a forward of its own on the instance, or torch's global module hooks are
  set (any of them may rewrite the ids or the table);
- a ``transformer_options["patches"]`` entry that may rewrite the ids is set (``post_input``);
- an argument cannot be keyed (:class:`~..caching.keys.Uncacheable`), or an option the ids read
  holds a tensor (its values would decide them).

The geometry is encoded when the forward starts, only while a PE cache scope is open (a model without
the cache pays one check). It holds host values only, never the model or a tensor: a context copied
during the forward (a callback scheduled from the sampling thread) keeps nothing alive.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..caching.keys import Uncacheable, encode, encode_geometry, tensor_meta, tensors_in
from . import host

_GEOMETRY: contextvars.ContextVar[Geometry | None] = contextvars.ContextVar("reusekit_pe_geometry", default=None)

_serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> serial (never reused)
_serials_lock = threading.Lock()
_next_serial = itertools.count(1)


def _serial(model) -> int:
    """A number for this model object: a new model never shares a key with a dead one."""
    n = _serials.get(model)
    if n is None:
        with _serials_lock:
            n = _serials.get(model)
            if n is None:
                n = _serials[model] = next(_next_serial)
    return n


def _module(model, attr: str):
    """``model.<attr>`` (a submodule straight from ``_modules``: no ``nn.Module.__getattr__``)."""
    found = getattr(model, "_modules", {}).get(attr)
    return found if found is not None else getattr(model, attr, None)


def current() -> Geometry | None:
    """The geometry of the family forward running now (``None``: none)."""
    return _GEOMETRY.get()


def _global_hooks() -> bool:
    """Whether torch calls module hooks set for every module (they may rewrite an embedder's ids)."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks)


def hooked(embedder) -> str | None:
    """Why calling ``embedder`` may not compute what its class's forward does (None: nothing): hooks on it
    or on every module, or a forward replaced on the instance (an object patch). Nothing in a key holds
    them, so a key that relies on the embedder computing as its class does checks this on every call."""
    if _global_hooks():
        return "global module hooks are set"
    if embedder._forward_pre_hooks or embedder._forward_hooks or "forward" in getattr(embedder, "__dict__", {}):
        return "it has hooks or a replaced forward"
    return None


class Geometry:
    """One forward call's geometry: what its position ids are made from, as host values.

    ``fields``: the encoded geometry, or ``None`` when this call has none (``why`` says why)."""

    __slots__ = ("fields", "why", "_embedders", "_calls")

    def __init__(self, fields: tuple | None, why: str | None, embedders: tuple[int, ...]):
        self.fields, self.why = fields, why
        self._embedders = embedders  # ids of the model's embedders, alive while its forward runs
        self._calls = 0

    def owns(self, embedder) -> bool:
        """Whether ``embedder`` is this forward's model's own position embedder."""
        return id(embedder) in self._embedders

    def next_call(self) -> int:
        """The order of an embedder call in this forward (a text table and an image table with
        equal shapes are different tables)."""
        self._calls += 1
        return self._calls


class _NoGeometry(Exception):
    pass


class _Opened:
    """The context of one forward call: its geometry is the current one inside."""

    __slots__ = ("geometry", "_token")

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    def __enter__(self) -> Geometry:
        self._token = _GEOMETRY.set(self.geometry)
        return self.geometry

    def __exit__(self, *exc) -> None:
        _GEOMETRY.reset(self._token)


class ForwardSeam:
    """One family forward that makes its ids from geometry (``module.Class.attr``).

    ``embedders``: attributes of the model holding its position embedder; ``helpers``: methods of
    the class (``module_helpers``: functions of the module) that make ids, checked on every call to
    be the host's functions seen at install; ``options``: ``transformer_options`` keys the ids read;
    ``blocking_patches``: ``transformer_options["patches"]`` entries that may rewrite the ids;
    ``ignored``: arguments that never reach the ids (left out of the key, so they cannot make misses);
    ``params``: the parameters the shape check expects, in order."""

    def __init__(self, family: str, module: str, attr: str, params: tuple[str, ...], embedders=("pe_embedder",),
                 helpers: tuple[str, ...] = (), module_helpers: tuple[str, ...] = (),
                 options: tuple[str, ...] = ("rope_options",), blocking_patches: tuple[str, ...] = (),
                 ignored: tuple[str, ...] = ("control",)):
        self.family, self.module, self.attr, self.params = family, module, attr, params
        self.embedders, self.helpers, self.module_helpers = embedders, helpers, module_helpers
        self.options, self.blocking_patches, self.ignored = options, blocking_patches, ignored
        self._names: tuple[str, ...] = ()
        self._host: list[tuple[bool, Any, str, Any]] = []  # (on the class, owner, name, function) at install
        self.off: str | None = None

    def _record_host(self) -> None:
        mod = importlib.import_module(self.module)
        cls = getattr(mod, self.attr.split(".")[0])
        self._host, self.off = [], None
        for owner, names in ((cls, self.helpers), (mod, self.module_helpers)):
            for name in names:
                fn = getattr(owner, name, None)
                if fn is None:  # a helper this ComfyUI does not have
                    continue
                owner_name = host.owner_if_not_host(fn)
                if owner_name:
                    self.off = f"{name} is not ComfyUI's own (from {owner_name})"
                self._host.append((owner is cls, owner, name, fn))

    def make(self, original: Callable, active: Callable[[], bool]) -> Callable:
        """The replacement forward (called by the patch's install); ``active``: whether a PE cache
        scope is open (else the forward runs as it is)."""
        sig = inspect.signature(original)
        self._names = tuple(p.name for p in list(sig.parameters.values())[1:]
                            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._record_host()
        seam = self

        @functools.wraps(original)
        def forward(model, *args, **kwargs):
            if not active():
                return original(model, *args, **kwargs)
            with seam.opened(model, args, kwargs):
                return original(model, *args, **kwargs)
        return forward

    def opened(self, model, args: tuple, kwargs: dict) -> _Opened:
        """``with seam.opened(model, args, kwargs):`` the model's embedder calls inside are keyed by
        this call's geometry."""
        try:
            fields, why = self.fields(model, args, kwargs), None
        except (Uncacheable, _NoGeometry) as e:
            fields, why = None, f"{self.family}: {e}"
        return _Opened(Geometry(fields, why, tuple(id(_module(model, a)) for a in self.embedders)))

    def fields(self, model, args: tuple, kwargs: dict) -> tuple:
        """The geometry of one call, encoded (raises :class:`_NoGeometry` or ``Uncacheable``)."""
        if self.off:
            raise _NoGeometry(self.off)
        cls = type(model)
        overrides = getattr(model, "__dict__", {})
        for on_class, owner, name, fn in self._host:
            if getattr(cls if on_class else owner, name, None) is not fn:
                raise _NoGeometry(f"{name} is not the host's {name}")
            if on_class and name in overrides:
                raise _NoGeometry(f"{name} is replaced on the model (an object patch)")
        if _global_hooks():
            raise _NoGeometry("global module hooks are set")
        for attr in self.embedders:
            embedder = _module(model, attr)
            if embedder is not None and (why := hooked(embedder)) is not None:
                raise _NoGeometry(f"{attr}: {why}")
        if len(args) > len(self._names):
            raise _NoGeometry("unexpected positional arguments")
        arguments = dict(zip(self._names, args, strict=False))  # fewer args: defaults
        arguments.update(kwargs)
        options = arguments.pop("transformer_options", None) or {}
        patches = options.get("patches") or {}
        for p in self.blocking_patches:
            if patches.get(p):
                raise _NoGeometry(f"a '{p}' patch may rewrite the ids")
        for name in self.ignored:
            arguments.pop(name, None)
        read = [(o, options.get(o)) for o in self.options]
        for o, value in read:
            if next(tensors_in(value), None) is not None:  # its values would decide the ids
                raise _NoGeometry(f"transformer_options['{o}'] holds a tensor")
        return (self.family, _serial(model), _settings(model),
                tuple((name, tensor_meta(value) if isinstance(value, torch.Tensor) else encode_geometry(value))
                      for name, value in sorted(arguments.items())),
                tuple((o, encode(value)) for o, value in read))


_SETTING_SCALARS = (type(None), bool, int, float, str, torch.dtype)


def _setting(value: Any) -> Any:
    """A model setting as a key field: plain values (as they are: the ids compute alike from equal ones, and a
    NaN, never equal, only misses), their lists and tuples, a dataclass of them (Flux's ``params``); ``...`` for
    anything else (a module, a tensor, an object: never read here, so a tensor is never copied or waited for).
    Not ``keys.encode``: it runs on every forward, and through it (a walk for tensors, then the encode) the tiny
    Flux's settings took 43-59 µs against this 9."""
    if isinstance(value, _SETTING_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return ("L" if isinstance(value, list) else "U", tuple(_setting(v) for v in value))
    fields = getattr(type(value), "__dataclass_fields__", None)
    if fields is not None and not isinstance(value, type):
        return (type(value).__qualname__, tuple(_setting(getattr(value, name)) for name in fields))
    return ...


def _settings(model) -> tuple:
    """The model's own settings, read on every call: its plain attributes and a dataclass of them (``patch_size``,
    Qwen-Image's ``default_ref_method``, Flux's ``params``). ComfyUI's object patches set them on the shared model
    (``diffusion_model.params.ref_index_scale``, ``default_ref_method``), and the ids read some of them: a model's
    serial alone would hand a patched clone the tables of its base. A few microseconds: no weights are read."""
    found = []
    for name, value in vars(model).items():
        field = ... if name.startswith("_") or name == "training" else _setting(value)
        if field is not ...:
            found.append((name, field))
    return tuple(found)


_FLUX = ("self", "x", "timestep", "context", "y", "guidance", "ref_latents", "control", "transformer_options")
_CHROMA = ("self", "x", "timestep", "context", "guidance", "control", "transformer_options")

# One per family forward; a host without one leaves that family's embedder on the value rules.
SEAMS: tuple[ForwardSeam, ...] = (
    ForwardSeam("flux", "comfy.ldm.flux.model", "Flux._forward", _FLUX,
                helpers=("process_img", "forward_orig"), blocking_patches=("post_input",)),
    ForwardSeam("chroma", "comfy.ldm.chroma.model", "Chroma._forward", _CHROMA, helpers=("forward_orig",)),
    ForwardSeam("chroma radiance", "comfy.ldm.chroma_radiance.model", "ChromaRadiance._forward", _CHROMA,
                helpers=("forward_orig", "radiance_get_override_params"),
                options=("rope_options", "chroma_radiance_options")),
    ForwardSeam("hunyuan video", "comfy.ldm.hunyuan_video.model", "HunyuanVideo._forward",
                ("self", "x", "timestep", "context", "y", "txt_byt5", "clip_fea", "guidance", "attention_mask",
                 "guiding_frame_index", "ref_latent", "disable_time_r", "control", "transformer_options"),
                helpers=("img_ids", "img_ids_2d", "forward_orig")),
    ForwardSeam("qwen-image", "comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel._forward",
                ("self", "x", "timesteps", "context", "attention_mask", "ref_latents", "transformer_options"),
                helpers=("process_img",), blocking_patches=("post_input",)),
    *(ForwardSeam(family, "comfy.ldm.lumina.model", f"{cls}._forward",
                  ("self", "x", "timesteps", "context", "num_tokens", "attention_mask"), embedders=("rope_embedder",),
                  helpers=("patchify_and_embed", "embed_all", "embed_cap"), module_helpers=("pos_ids_x",))
      for family, cls in (("lumina2 / z-image", "NextDiT"),
                          ("z-image pixel space", "NextDiTPixelSpace"))),  # its _forward is its own (ComfyUI 0.3x)
    ForwardSeam("hidream", "comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel._forward",
                ("self", "x", "t", "y", "context", "encoder_hidden_states_llama3", "image_cond", "control",
                 "transformer_options"), helpers=("patchify",)),
)
