"""The one typed key encoder of the caches: values and tensors as hashable, exactly comparable fields.

:func:`encode` turns what decides a cached result into a tree of tuples, strings, ints and bytes.
Two trees are equal only when the values are, by these rules:

- ``None``, bools, ints, floats, strings and bytes carry a type tag: ``1``, ``1.0`` and ``True`` are
  three different fields. Integers of any integral type (NumPy's too) key as the Python int.
- Floats key by their IEEE-754 bits: ``-0.0`` differs from ``0.0``; a NaN equals only a NaN with the
  same bits (Python's ``float("nan")`` always has the same bits). Other NumPy scalars key by their
  dtype and value.
- ``torch.dtype``, ``torch.device`` (type and index) and ``torch.Size`` key by name and value.
- Tuples and lists (tagged apart, in order), dicts (by encoded key, order ignored) and sets key by
  their elements. A subclass of a built-in (a namedtuple, an enum) keys with its class name. A list of
  tuples of one shape of plain ints and floats (a prompt's ``(token, weight)`` pairs) keys column by
  column, each packed into one bytes field (ints as 64-bit words where they fit, floats by their bits):
  a few fields where element by element it would take hundreds.
- Dataclass instances (an LLM text encoder's config) key by their class and every attribute they hold,
  by name: their fields and anything set on the instance besides. Their values key by these rules.
- Tensors key by metadata and content: dtype, shape, stride, layout and device, then their logical
  values' bytes (a view keys by the elements it shows, its stride beside them, so a non-contiguous
  view never shares a key with its contiguous copy). Up to :data:`SMALL_TENSOR` bytes the bytes are
  kept whole; above, a 256-bit BLAKE2b digest of them is kept instead, so a key never holds or
  compares megabytes. Bitwise: ``-0.0`` and ``0.0`` elements differ, NaNs match by their bits.
  Sparse, quantized, meta tensors and tensor subclasses cannot be keyed.
- Anything else raises :class:`Uncacheable`: the caller misses (computes) instead of guessing.

:func:`encode_geometry` is the same encoding with every tensor keyed by its type, dtype, shape and
device only: it never reads a tensor, so on a GPU it neither copies nor waits. It is for keys whose
tensors' values follow from the rest of the key (a model's position ids made from a latent's shape).
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import struct
import sys
from typing import Any

import torch

SMALL_TENSOR = 1024  # bytes: a tensor up to this size is keyed by its bytes, a larger one by their digest


class Uncacheable(TypeError):
    """A value the encoder cannot key exactly: the call runs uncached."""


def _float(value: float) -> tuple:
    return ("f", struct.pack("<d", value))


_SCALARS = {
    type(None): lambda v: ("none",),
    bool: lambda v: ("b", v),
    int: lambda v: ("i", v),
    float: _float,
    str: lambda v: ("s", v),
    bytes: lambda v: ("y", v),
    torch.dtype: lambda v: ("dtype", str(v)),
    torch.device: lambda v: ("device", str(v)),
}

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def tensor_field(t: torch.Tensor) -> tuple:
    """A tensor by dtype, shape, stride, layout, device and its logical values' bytes (whole up to
    :data:`SMALL_TENSOR`, else their 256-bit BLAKE2b digest). No pointer."""
    if type(t) not in _PLAIN_TENSORS:
        raise Uncacheable(f"cannot key a tensor of type {type(t).__name__}")
    if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
        raise Uncacheable(f"cannot key a {t.layout} {'quantized ' if t.is_quantized else ''}tensor on {t.device}")
    head = ("T", str(t.dtype), tuple(t.shape), tuple(t.stride()), str(t.layout), str(t.device))
    data = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    if data.nbytes <= SMALL_TENSOR:
        return (*head, data.tobytes())
    return (*head, "blake2b-256", hashlib.blake2b(memoryview(data), digest_size=32).digest())


def _rows(value: list) -> tuple | None:
    """A list of tuples of one shape of plain ints and floats as ``("R", <column codes>, *columns)``:
    ``d`` a float column (IEEE-754 bits), ``q`` an int column in 64-bit words, ``i`` an int column
    beyond them (the ints as they are). None for any other list."""
    first = value[0]
    shape = tuple(map(type, first)) if type(first) is tuple else ()
    if not shape or any(t is not int and t is not float for t in shape):
        return None
    for row in value:
        if type(row) is not tuple or tuple(map(type, row)) != shape:
            return None
    n, codes, columns = len(value), [], []
    for t, column in zip(shape, zip(*value, strict=True), strict=True):
        if t is float:
            codes.append("d")
            columns.append(struct.pack(f"<{n}d", *column))
            continue
        try:
            columns.append(struct.pack(f"<{n}q", *column))
            codes.append("q")
        except struct.error:  # an int beyond 64 bits
            columns.append(column)
            codes.append("i")
    return ("R", "".join(codes), *columns)


def _sorted(pairs) -> tuple:
    return tuple(sorted(pairs, key=lambda kv: repr(kv[0])))


def encode(value: Any) -> Any:
    """``value`` as a hashable, typed tree, equal only for equal values (rules: module docstring)."""
    kind = type(value)
    scalar = _SCALARS.get(kind)
    if scalar is not None:  # the common cases first (token ids, weights, geometry)
        return scalar(value)
    if kind is list and value:
        rows = _rows(value)
        if rows is not None:
            return rows
    if kind is tuple or kind is list:
        return ("U" if kind is tuple else "L", tuple(encode(v) for v in value))
    if kind is dict:
        return ("D", _sorted((encode(k), encode(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return tensor_field(value)
    if kind is torch.Size:
        return ("Z", tuple(int(d) for d in value))
    if kind is set or kind is frozenset:
        return ("S", tuple(sorted((encode(v) for v in value), key=repr)))
    if _numpy_scalar(value):
        if isinstance(value, numbers.Integral):
            return ("i", int(value))  # NumPy integers (token ids)
        return ("np", str(value.dtype), encode(value.item()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("dc", f"{kind.__module__}.{kind.__qualname__}", tuple(
            (name, encode(getattr(value, name))) for name in dataclass_attributes(value)))
    for base in (bool, int, float, str, bytes, tuple, list, dict):
        if isinstance(value, base):  # enums, namedtuples, ordered dicts...: the class is part of the key
            return ("sub", f"{kind.__module__}.{kind.__qualname__}", encode(base(value)))
    raise Uncacheable(f"cannot key a {kind.__name__}")


def dataclass_attributes(value: Any) -> list[str]:
    """The attributes a dataclass instance holds: its fields, then what was set on the instance besides."""
    names = [f.name for f in dataclasses.fields(value)]
    extra = getattr(value, "__dict__", None)
    if extra:
        names += [name for name in extra if name not in names]
    return names


def _numpy_scalar(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def tensor_meta(t: torch.Tensor) -> tuple:
    """A tensor by its class, dtype, shape and device (kept as those objects: they compare by value and
    hold no tensor): host values only, no read of its data."""
    return ("TM", type(t), t.dtype, t.shape, t.device)


def tensors_in(value: Any):
    """The tensors inside ``value`` (tuples, lists and dict values, at any depth)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def encode_geometry(value: Any) -> Any:
    """``value`` as :func:`encode` does, but tensors (at any depth) by :func:`tensor_meta` only."""
    if isinstance(value, torch.Tensor):
        return tensor_meta(value)
    kind = type(value)
    if kind is tuple or kind is list:
        return ("U" if kind is tuple else "L", tuple(encode_geometry(v) for v in value))
    if kind is dict:
        return ("D", _sorted((encode(k), encode_geometry(v)) for k, v in value.items()))
    return encode(value)


def digest(tree: Any) -> tuple:
    """A large encoded tree (thousands of fields) as a 256-bit BLAKE2b digest of its exact text."""
    return ("blake2b-256", hashlib.blake2b(repr(tree).encode(), digest_size=32).digest())


def nbytes(tree: Any) -> int:
    """Memory of an encoded tree: every object counted by ``sys.getsizeof`` (shared ones as often as
    used). A loop over a stack, not a call per field: a text key has hundreds of fields, and a shared
    tiers' hit pays this when its entry joins the LRU."""
    size, stack, getsizeof = 0, [tree], sys.getsizeof
    pop, push = stack.pop, stack.extend
    while stack:
        x = pop()
        size += getsizeof(x)
        if isinstance(x, tuple):
            push(x)
    return size
