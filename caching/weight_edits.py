"""Seeing in-place edits of an encoder's weights without reading every weight on every encode.

Pure torch. ``patches/conditioning.py`` decides *when* each check runs (the events); this module is
what a check reads and compares.

- :func:`fingerprint` / :func:`fingerprints` is the one full fingerprint: a multiply-sum of a tensor's
  32-bit words by fixed odd 64-bit multipliers that depend on the word's position, modulo 2**64. It
  is computed where the tensor lives (no copy to the host, one small transfer per device) and, being
  integer arithmetic, gives the same value for the same bytes on every device: a move between
  devices is never an edit. A one-word change always changes it (an odd multiplier is invertible
  modulo 2**64); any other edit except with a chance of about 2**-64.
- :class:`WeightWatch` keeps, per encoder, what the weights were at the last full check: each
  weight's fingerprint, dtype and shape, the whole bytes of small tensors, values at fixed sampled
  positions of large ones and, for large embedding tables (where sparse edits land: a textual
  inversion, a token merge), each row's share of the fingerprint. :meth:`WeightWatch.quick` is the
  check an encode pays: the same small bytes, the samples, and the rows of the tokens this encode
  looks up, gathered on each device into one buffer and brought over in one small transfer. Its
  cost follows the number of tensors and tokens, never the weights' bytes. What it cannot see is an
  edit of a few values of a large non-embedding tensor away from the sampled positions: the full
  check sees those, and runs on every encode where a user asks for it.
- Version counters are not trusted: an edit through ``.data`` bypasses them, and inference tensors
  (every weight ComfyUI's loaders make) have none.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

SETTING = "conditioning.check_weight_edits"
MODES = ("events", "every_encode", "off")  # see patches/encoder_weights.py
CHUNK = 1 << 20  # words per multiplier block; a word's multiplier is MULT[p % CHUNK] * (2 * (p // CHUNK) + 1)
SMALL = 64 << 10  # bytes: a tensor up to this size is compared whole on every encode
SAMPLES = 32  # positions sampled from every larger tensor
MASK = (1 << 64) - 1

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_mult_lock = threading.Lock()
_mult: dict[torch.device, torch.Tensor] = {}


def legacy_mode(value: Any) -> str | None:
    """The setting's older form, a bool: on (then a fingerprint on every encode) is now ``events``,
    off is ``off``; None for anything else."""
    if value is True:
        return "events"
    if value is False:
        return "off"
    return None


def multipliers(device: torch.device) -> torch.Tensor:
    """The fixed random odd 64-bit multipliers of one block, kept once per device."""
    found = _mult.get(device)
    if found is None:
        with _mult_lock:
            found = _mult.get(device)
            if found is None:
                gen = torch.Generator().manual_seed(0x5EED)
                found = (torch.randint(0, 1 << 62, (CHUNK,), generator=gen, dtype=torch.int64) * 2 + 1).to(device)
                _mult[device] = found
    return found


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit words (a byte count not divisible by 4: one word per byte)."""
    data = t.detach().reshape(-1)
    if not data.is_contiguous():
        data = data.contiguous()
    data = data.view(torch.uint8)
    return data.view(torch.int32) if data.numel() % 4 == 0 else data.to(torch.int32)


def _fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on ``t``'s device (wrapping arithmetic: the same bits on every device)."""
    words = _words(t)
    mult = multipliers(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    buf = None
    for c, start in enumerate(range(0, words.numel(), CHUNK)):
        chunk = words[start:start + CHUNK]
        n = chunk.numel()
        if buf is None:
            buf = torch.empty(n, dtype=torch.int64, device=words.device)
        part = buf[:n]
        part.copy_(chunk)
        part.mul_(mult[:n])
        total += part.sum() * (2 * c + 1)
    return total


def fingerprints(tensors: Iterable[torch.Tensor]) -> list[int]:
    """:func:`fingerprint` of each tensor, computed where it lives; one transfer per device."""
    tensors = list(tensors)
    out: list[int] = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([_fingerprint_tensor(tensors[i]) for i in indices]).tolist()
        for i, v in zip(indices, values, strict=True):
            out[i] = v & MASK
    return out


def fingerprint(t: torch.Tensor) -> int:
    """The full fingerprint of one tensor's bytes: the same value for the same bytes on any device."""
    return fingerprints([t])[0]


def _positions(numel: int) -> torch.Tensor:
    """Fixed positions sampled from a tensor of ``numel`` elements: both ends and spread ones."""
    gen = torch.Generator().manual_seed(numel)
    idx = torch.randint(0, numel, (SAMPLES - 2,), generator=gen)
    return torch.cat([torch.tensor([0, numel - 1]), idx]).sort().values


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (exact bytes, any dtype)."""
    flat = t.detach().reshape(-1)
    return flat.view(_INT[flat.element_size()])


def _row_words(t: torch.Tensor) -> int | None:
    """32-bit words per row of a 2-D table, when rows are whole words (else rows are not checked)."""
    if t.dim() != 2 or not t.is_contiguous():
        return None
    row_bytes = t.shape[1] * t.element_size()
    return row_bytes // 4 if row_bytes % 4 == 0 and t.numel() * t.element_size() % 4 == 0 else None


def _row_multipliers(rows: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """Each word's multiplier for the given rows of a table ``width`` words wide: (rows, width) int64."""
    pos = rows.to(device=device, dtype=torch.int64)[:, None] * width + torch.arange(width, device=device)
    return multipliers(device)[pos % CHUNK] * (2 * torch.div(pos, CHUNK, rounding_mode="floor") + 1)


def _span_multipliers(start: int, stop: int, device: torch.device) -> torch.Tensor:
    """The multipliers of words ``start`` to ``stop`` (int64, on ``device``)."""
    mult = multipliers(device)
    pieces = []
    for c in range(start // CHUNK, (stop - 1) // CHUNK + 1):
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(stop, (c + 1) * CHUNK) - c * CHUNK
        pieces.append(mult[lo:hi] * (2 * c + 1))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _row_shares(t: torch.Tensor, width: int) -> torch.Tensor:
    """Every row's share of the table's fingerprint, as a CPU int64 tensor (the shares sum to it)."""
    words = _words(t)
    rows_total = words.numel() // width
    out = torch.empty(rows_total, dtype=torch.int64, device=words.device)
    step = max(1, CHUNK // width)
    for first in range(0, rows_total, step):
        last = min(rows_total, first + step)
        block = words[first * width:last * width].to(torch.int64)
        block.mul_(_span_multipliers(first * width, last * width, words.device))
        out[first:last] = block.view(-1, width).sum(1)
    return out.cpu()


class _Plan:
    """What one weight was at the last full check and how an encode checks it."""

    __slots__ = ("dtype", "shape", "fp", "small", "positions", "samples", "width", "rows", "_on")

    def __init__(self, t: torch.Tensor, fp: int, embedding: bool):
        self.dtype, self.shape, self.fp = t.dtype, tuple(t.shape), fp
        nbytes = t.numel() * t.element_size()
        self.small = self.positions = self.samples = self.rows = None
        self.width = None
        self._on: dict[torch.device, torch.Tensor] = {}
        if nbytes <= SMALL:
            self.small = t.detach().reshape(-1).contiguous().view(torch.uint8).to("cpu", copy=True)
            return
        self.positions = _positions(t.numel())
        self.samples = _elements(t).index_select(0, self.positions.to(t.device)).view(torch.uint8).cpu()
        if embedding:
            self.width = _row_words(t)
            if self.width is not None:
                self.rows = _row_shares(t, self.width)

    def positions_on(self, device: torch.device) -> torch.Tensor:
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = self.positions.to(device)
        return found


class WeightWatch:
    """An encoder's weights as of the last full check, and the cheap check of an encode against it.

    ``named`` maps weight names to the tensors an encode reads; ``patched`` names the weights the
    patcher has patched over right now (their base values are in its backup: not checked, but still
    part of the encoder's structure). Not thread-safe: the caller serialises."""

    def __init__(self) -> None:
        self._plans: dict[str, _Plan] = {}
        self._names: frozenset[str] = frozenset()
        self.full_checks = 0
        self.quick_checks = 0

    @property
    def ready(self) -> bool:
        return bool(self._names)

    def full(self, named: Mapping[str, torch.Tensor], patched: frozenset[str] = frozenset(),
             embeddings: frozenset[str] = frozenset()) -> bool:
        """Fingerprint every weight in full and take the result as the new reference; True when the
        weights differ from the last full check's (an edit or a replaced weight; never a move)."""
        self.full_checks += 1
        names = list(named)
        values = fingerprints(named[n] for n in names)
        edited = bool(self._names) and self._names != frozenset(names) | patched
        for name, fp in zip(names, values, strict=True):
            t = named[name]
            old = self._plans.get(name)
            if old is not None and (old.fp != fp or old.dtype != t.dtype or old.shape != tuple(t.shape)):
                edited = True
            self._plans[name] = _Plan(t, fp, name in embeddings)
        self._names = frozenset(names) | patched
        return edited

    def quick(self, named: Mapping[str, torch.Tensor], patched: frozenset[str] = frozenset(),
              token_ids: Iterable[int] = ()) -> bool:
        """The cheap check: True when the weights are seen to differ from the last full check (a
        weight added, removed or reshaped, a small tensor's bytes, a sampled value, or the row of a
        token this encode reads)."""
        self.quick_checks += 1
        if frozenset(named) | patched != self._names:
            return True
        ids = None
        per_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, t in named.items():
            plan = self._plans.get(name)
            if plan is None or plan.dtype != t.dtype or plan.shape != tuple(t.shape):
                return True
            parts = per_device.setdefault(t.device, [])
            if plan.small is not None:
                parts.append((t.detach().reshape(-1).contiguous().view(torch.uint8), plan.small))
                continue
            parts.append((_elements(t).index_select(0, plan.positions_on(t.device)).view(torch.uint8), plan.samples))
            if plan.rows is not None:
                if ids is None:
                    ids = sorted({int(i) for i in token_ids})
                rows = [i for i in ids if 0 <= i < plan.shape[0]]
                if rows:
                    index = torch.tensor(rows, dtype=torch.int64)
                    words = _words(t).view(-1, plan.width).index_select(0, index.to(t.device)).to(torch.int64)
                    shares = (words * _row_multipliers(index, plan.width, t.device)).sum(1)
                    parts.append((shares.view(torch.uint8), plan.rows.index_select(0, index).view(torch.uint8)))
        for parts in per_device.values():
            now = torch.cat([p[0] for p in parts]).cpu()  # one small transfer per device
            if not torch.equal(now, torch.cat([p[1] for p in parts])):
                return True
        return False
