"""A model's weights as an identity that precision copies share and fine-tunes do not (pure torch).

A calibration made on one file must be found again for an fp8 or bf16 copy of the same weights, but
never for a fine-tune of them, even one that changed a single block. So the identity samples values
from every weight tensor (not a few), and two identities match when every sampled value agrees to
within the rounding steps (ulps) of the two dtypes it was stored in: an fp8 copy of a bf16
model rounds each value by under one fp8 ulp, a fine-tune moves some by more. Two tensors in the same dtype
match only when their samples are equal (so two fp8 files rounded through different paths may miss each
other: a miss means a new calibration, never a wrong one). Across dtypes, a fine-tune whose every sampled
change stays under one ulp of the coarser copy's precision is, at that precision, the same model.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

SAMPLES = 16  # values sampled per weight tensor, spread evenly over its elements


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLES values of ``t`` at fixed, evenly spread positions, as float32 where ``t`` lives
    (every float8/16/32 value is exact in float32)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    k = min(SAMPLES, n)
    idx = (torch.arange(k, dtype=torch.int64) * n) // k + n // (2 * k)
    idx = idx.clamp_max(n - 1).to(flat.device)
    if flat.element_size() == 1 and flat.is_floating_point():  # fp8: gather the bytes, then reinterpret
        picked = flat.view(torch.uint8)[idx].view(flat.dtype)
    else:
        picked = flat[idx]
    return picked.float()


def _sample_raw(t: torch.Tensor) -> list[int]:
    """The bytes of up to SAMPLES elements of an integer tensor at fixed, evenly spread positions (whole
    elements: bytes spread over a wide type's storage can all miss the low byte that holds its value)."""
    flat = t.reshape(-1) if t.dtype != torch.bool else t.reshape(-1).to(torch.uint8)
    n = flat.numel()
    k = min(SAMPLES, n)
    idx = ((torch.arange(k, dtype=torch.int64) * n) // k + n // (2 * k)).clamp_max(n - 1).to(flat.device)
    return flat[idx].contiguous().view(torch.uint8).cpu().tolist()


@dataclass(frozen=True)
class WeightsIdentity:
    """``structure``: a hash of the tensors' names and shapes (equal for precision copies); per tensor,
    its dtype and the sampled values."""

    structure: str
    dtypes: tuple[str, ...]
    counts: tuple[int, ...]
    samples: tuple[float, ...]

    def matches(self, other: WeightsIdentity) -> bool:
        """Same tensors, and every sampled value equal (same dtype) or within an ulp of each copy's dtype."""
        if self.structure != other.structure or self.counts != other.counts:
            return False
        a = torch.tensor(self.samples, dtype=torch.float64)
        b = torch.tensor(other.samples, dtype=torch.float64)
        tol = torch.empty_like(a)
        at = 0
        for mine, theirs, n in zip(self.dtypes, other.dtypes, self.counts, strict=True):
            span = slice(at, at + n)
            if mine == theirs:
                tol[span] = 0.0
            else:
                # each copy is within an ulp of the common original: the two ulps together bound their gap
                fa, fb = _finfo(mine), _finfo(theirs)
                tol[span] = ((fa.eps + fb.eps) * torch.maximum(a[span].abs(), b[span].abs())
                             + fa.smallest_normal * fa.eps + fb.smallest_normal * fb.eps)
            at += n
        return bool(((a - b).abs() <= tol).all())  # NaN never matches

    def to_json(self) -> dict[str, Any]:
        return {"structure": self.structure, "dtypes": list(self.dtypes), "counts": list(self.counts),
                "samples": list(self.samples)}

    @classmethod
    def from_json(cls, data: Any) -> WeightsIdentity | None:
        """The identity stored by :meth:`to_json`, or None for anything malformed."""
        try:
            ident = cls(str(data["structure"]), tuple(str(d) for d in data["dtypes"]),
                        tuple(int(c) for c in data["counts"]), tuple(float(s) for s in data["samples"]))
        except (KeyError, TypeError, ValueError, OverflowError):  # (a count of 1e400: int(inf))
            return None
        ok = (len(ident.dtypes) == len(ident.counts) and sum(ident.counts) == len(ident.samples)
              and all(_known(d) for d in ident.dtypes))
        return ident if ok else None


def _finfo(name: str) -> torch.finfo:
    return torch.finfo(getattr(torch, name))


def _known(name: str) -> bool:
    """A floating dtype whose precision ``matches`` can read (float4_e2m1fn_x2 is floating, and torch has no
    epsilon for it: a stored identity naming it matches nothing, never an error)."""
    dtype = getattr(torch, name, None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return False
    try:
        info = torch.finfo(dtype)
        return info.eps > 0 and info.smallest_normal > 0  # (read when the dtypes differ)
    except (TypeError, NotImplementedError, RuntimeError):
        return False


def plain_leaves(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A weight as the plain tensors that hold it: itself, or a tensor subclass's inner ones
    (``__tensor_flatten__``: a quantized layout's data and scales, ``<name>.<inner>``), whose bytes are read
    without dequantizing the whole weight (ComfyUI 0.33's comfy_quant layouts did so at every read)."""
    flatten = None if type(t) in (torch.Tensor, torch.nn.Parameter) else getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        yield name, t
        return
    found = [(inner, value) for inner in flatten()[0] if isinstance(value := getattr(t, inner, None), torch.Tensor)]
    if not found:  # inner tensors not kept as attributes of those names: the weight as a whole, as it reads
        yield name, t
    for inner, value in found:
        yield from plain_leaves(f"{name}.{inner}", value)


def identity(named_weights: Iterable[tuple[str, torch.Tensor]]) -> WeightsIdentity:
    """The identity of ``(name, tensor)`` pairs (a model's weights as loaded, in a fixed order). A weight in a
    quantized layout is identified by its data and scales (:func:`plain_leaves`); integer data (GGUF's blocks,
    NF4's packed values) by sampled raw values in the structure, which must then match exactly."""
    h = hashlib.sha256()
    dtypes, counts, picked = [], [], {}
    for name, t in ((n, leaf) for outer, weight in named_weights for n, leaf in plain_leaves(outer, weight)):
        if t.numel() == 0:
            continue
        if t.is_quantized:  # torch's own quantized tensors: their integers, and what maps them to values
            scheme = t.qscheme()
            per_tensor = scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric)
            h.update(f"{name}:{scheme}:{(t.q_scale(), t.q_zero_point()) if per_tensor else None};".encode())
            if not per_tensor:  # (per channel: along which axis, by which scales and zero points)
                h.update(f"axis {t.q_per_channel_axis()}:".encode())
                h.update(repr(_sample(t.q_per_channel_scales().float()).tolist()).encode())
                h.update(repr(_sample_raw(t.q_per_channel_zero_points())).encode())
            t = t.int_repr()
        if not t.is_floating_point():  # a fine-tune in the same quantization differs here alone
            raw = t.detach()
            raw = raw if type(raw) is torch.Tensor else raw.as_subclass(torch.Tensor)
            h.update(f"{name}:{type(t).__qualname__}:{t.dtype}:{tuple(t.shape)}:{_sample_raw(raw)};".encode())
            continue
        h.update(f"{name}:{tuple(t.shape)};".encode())
        values = _sample(t)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        counts.append(values.numel())
        picked.setdefault(values.device, []).append((len(counts) - 1, values))
    # one copy to the host per device (a model may be split over devices), then back into tensor order
    parts: list = [None] * len(counts)
    for pairs in picked.values():
        host = torch.cat([v for _, v in pairs]).cpu().split([v.numel() for _, v in pairs])
        for (i, _), values in zip(pairs, host, strict=True):
            parts[i] = values
    samples = torch.cat(parts).tolist() if parts else []
    return WeightsIdentity(h.hexdigest()[:32], tuple(dtypes), tuple(counts), tuple(samples))


_PATCH_DEPTH = 8  # how deep a patch's value is walked (ComfyUI's adapters nest a tuple or two; a hook's
# transformer options nest four dicts and lists above their functions)


def _patch_parts(value: Any, out: list, depth: int = 0) -> None:
    """What a weight patch's value is, in a stable form: its tensors by shape, dtype and sampled values,
    plain values by repr, functions and adapter classes by name (never by address)."""
    if depth > _PATCH_DEPTH:
        out.append(("deep",))
    elif isinstance(value, torch.Tensor):
        out.append(("t", tuple(value.shape), str(value.dtype),
                    tuple(_sample(value).cpu().tolist()) if value.is_floating_point() and value.numel() else ()))
    elif isinstance(value, (bool, int, float, str, bytes, type(None))):
        out.append(("v", repr(value)))
    elif isinstance(value, (tuple, list)):
        out.append(("[", len(value)))
        for v in value:
            _patch_parts(v, out, depth + 1)
    elif isinstance(value, dict):
        for k in sorted(value, key=repr):
            out.append(("k", repr(k)))
            _patch_parts(value[k], out, depth + 1)
    elif isinstance(value, (set, frozenset)):
        out.append(("s", tuple(sorted(map(repr, value)))))
    elif isinstance(value, functools.partial):  # (no qualname, and nothing in its __dict__)
        out.append(("partial",))
        _patch_parts((value.func, value.args, value.keywords), out, depth + 1)
    elif callable(value) and hasattr(value, "__qualname__"):
        out.append(("f", getattr(value, "__module__", None), value.__qualname__))
    else:  # an adapter (ComfyUI's LoRAAdapter...): its class and what it holds
        out.append(("o", type(value).__module__, type(value).__qualname__))
        _patch_parts(dict(getattr(value, "__dict__", {})), out, depth + 1)


def patches_digest(patches: dict) -> str | None:
    """A digest of the weight patches a model's clone carries (ComfyUI's ``ModelPatcher.patches``: a LoRA's
    keys, strengths, and SAMPLES values of every tensor), so another LoRA or another strength digests
    otherwise; None without patches."""
    if not patches:
        return None
    out: list = []
    for key in sorted(patches, key=repr):
        out.append(("key", repr(key)))
        _patch_parts(patches[key], out)
    return hashlib.sha256(repr(out).encode()).hexdigest()[:32]


_HOOK_SKIPPED = {"hook_keyframe", "hook_ref", "weights_clip", "_strength_clip"}
"""A hook's fields its digest leaves out: its keyframes (digested by what they set: a run writes its place in them
onto the group), its identity, and what reaches the text encoder alone; so do fields named with an underscore
(run state: a transformer options hook marks itself added), but the strength it gives the model."""


def hooks_digest(hooks: list, placement: Any = ()) -> str | None:
    """A digest of the hooks a run's conds carry (ComfyUI's ``comfy.hooks``: a LoRA through Create Hook LoRA, its
    model strength and keyframes, each hook by its class and what it holds), in their order, and of
    ``placement`` (which conds carry which, over which part of the run); None without hooks. They reach the
    model at sampling time, never its clone's ``patches``."""
    if not hooks:
        return None
    out: list = [("placed", repr(placement))]
    for hook in hooks:
        frames = getattr(getattr(hook, "hook_keyframe", None), "keyframes", None) or ()
        out.append(("hook", type(hook).__module__, type(hook).__qualname__,
                    tuple(tuple(repr(getattr(k, a, None)) for a in ("strength", "start_percent", "guarantee_steps"))
                          for k in frames)))
        _patch_parts({k: v for k, v in vars(hook).items()
                      if k not in _HOOK_SKIPPED and (not k.startswith("_") or k == "_strength_model")}, out)
    return hashlib.sha256(repr(out).encode()).hexdigest()[:32]
