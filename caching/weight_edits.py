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
  check an encode pays: the same small bytes, the samples, and the rows this encode looks up (its
  tokens' ids and its positions, the caller's ``token_ids``), gathered on each device into one buffer and brought over in one small transfer (CPU
  weights: read where they lie, small ones whole and all samples in one gather). Its cost follows the
  number of tensors and tokens, never the weights' bytes. What it cannot see is an
  edit of a few values of a large non-embedding tensor away from the sampled positions: the full
  check sees those, and runs on every encode where a user asks for it.
- Version counters are not trusted: an edit through ``.data`` bypasses them, and inference tensors
  (every weight ComfyUI's loaders make) have none.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

SETTING = "conditioning.check_weight_edits"
MODES = ("events", "every_encode", "off")  # see patches/encoder_weights.py
CHUNK = 1 << 20  # words per multiplier block; a word's multiplier is MULT[p % CHUNK] * (2 * (p // CHUNK) + 1)
SMALL = 64 << 10  # bytes: a tensor up to this size is compared whole on every encode
SAMPLES = 32  # positions sampled from every larger tensor
MASK = (1 << 64) - 1

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
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


def _as_ints(t: torch.Tensor) -> tuple[torch.dtype, int]:
    """The integer dtype a tensor's elements are read as (its element size; bytes for other sizes) and
    how many of them it holds."""
    size = t.element_size()
    dtype = _INT.get(size, torch.uint8)
    return dtype, t.numel() * (1 if dtype is not torch.uint8 or size == 1 else size)


def _row_words(t: torch.Tensor) -> int | None:
    """32-bit words per row of a 2-D table, when rows are whole words (else rows are not checked)."""
    if t.dim() != 2 or not t.is_contiguous() or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None  # (a subclass's shape may not be its storage's: GGUF's blocks hold a row in more bytes)
    row_bytes = t.shape[1] * t.element_size()
    return row_bytes // 4 if row_bytes % 4 == 0 and t.numel() * t.element_size() % 4 == 0 else None


def _shares_of_rows(t: torch.Tensor, rows: list[int], width: int) -> np.ndarray:
    """The given rows' shares of a table's fingerprint (int64, NumPy): gathered where the table lives,
    on the CPU through NumPy (wrapping integer arithmetic, as torch's)."""
    index = np.asarray(rows, dtype=np.int64)
    pos = index[:, None] * width + np.arange(width, dtype=np.int64)
    mult = _multipliers_np()[pos % CHUNK] * (2 * (pos // CHUNK) + 1)
    if t.is_cpu:
        try:
            flat = (t.detach() if t.requires_grad else t).numpy().reshape(-1).view(np.int32)
        except TypeError:  # bfloat16, float8: through a torch view
            flat = _words(t).numpy()
        words = flat.reshape(-1, width)[index]
    else:
        picked = _words(t).view(-1, width).index_select(0, torch.from_numpy(index).to(t.device))
        words = picked.cpu().numpy()
    return (words.astype(np.int64) * mult).sum(axis=1)


_mult_np: list[np.ndarray] = []


def _multipliers_np() -> np.ndarray:
    if not _mult_np:
        _mult_np.append(multipliers(torch.device("cpu")).numpy())
    return _mult_np[0]


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
    """What one weight was at the last full check and how an encode checks it: ``ref`` is the bytes the
    check reads (the whole tensor when small, else the values at ``positions``)."""

    __slots__ = ("dtype", "shape", "fp", "nbytes", "small", "ints", "positions", "positions_np", "ref", "width",
                 "rows", "_on")

    def __init__(self, t: torch.Tensor, fp: int, embedding: bool, small: int = SMALL):
        self.dtype, self.shape, self.fp = t.dtype, t.shape, fp
        self.nbytes = t.numel() * t.element_size()
        self.small = self.nbytes <= small
        self.ints, count = _as_ints(t)
        self.positions = self.positions_np = self.width = self.rows = None
        self._on: dict[torch.device, torch.Tensor] = {}
        if not self.small:
            self.positions = _positions(count)
            self.positions_np = self.positions.numpy()
            if embedding:
                self.width = _row_words(t)
                if self.width is not None:
                    self.rows = _row_shares(t, self.width)
        self.ref = self.read(t)

    def read(self, t: torch.Tensor) -> bytes:
        """The bytes this plan checks, read from ``t`` (on the CPU through NumPy: a view, no tensor op,
        where NumPy has the dtype)."""
        if not t.is_cpu:
            return self.gather(t).cpu().numpy().tobytes()
        try:
            flat = t.numpy().reshape(-1).view(_NP_INT[t.element_size()])
        except (RuntimeError, TypeError, KeyError):  # needs grad; bfloat16, float8, 16-byte elements
            flat = self._ints(t.detach()).numpy().reshape(-1)
        return flat.tobytes() if self.small else flat[self.positions_np].tobytes()

    def _ints(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.ints) if t.element_size() == self.ints.itemsize else t.reshape(-1).view(torch.uint8)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """On a device: the checked elements as bytes, left there (the caller brings all over at once)."""
        flat = self._ints(t.detach()).reshape(-1)
        picked = flat if self.small else flat.index_select(0, self.positions_on(t.device))
        return picked.view(torch.uint8)

    def positions_on(self, device: torch.device) -> torch.Tensor:
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = self.positions.to(device)
        return found


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # types whose data_ptr() is their elements' memory


class _Memory:
    """The bytes the cheap check reads from the CPU weights, read straight from their memory: small
    tensors whole (one C call each), every large tensor's samples by one gather over the address range
    they span. Built for one list of (address, plan); valid only while the very tensors checked are at
    those addresses (the caller compares the addresses on every check, holding the tensors meanwhile,
    so every byte read lies inside a live tensor of the plan's shape). Never reads memory it does not
    find there: a changed address rebuilds it."""

    __slots__ = ("ptrs", "small", "arena", "index", "ref")

    def __init__(self, cpu: list[tuple[int, _Plan]]):
        self.ptrs = tuple(p for p, _ in cpu)
        self.small = [(p, plan.nbytes, plan.ref) for p, plan in cpu if plan.small and plan.nbytes]
        large = [(p, plan) for p, plan in cpu if not plan.small]
        self.arena = self.index = None
        self.ref = b"".join(plan.ref for _, plan in large)
        if large:
            base = min(p for p, _ in large)
            span = max(p + plan.nbytes for p, plan in large) - base
            self.arena = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base))
            parts = []
            for p, plan in large:
                size = plan.ints.itemsize  # the unit ``positions`` count in (see _as_ints)
                starts = (p - base) + plan.positions_np.astype(np.int64) * size
                parts.append((starts[:, None] + np.arange(size, dtype=np.int64)).reshape(-1))
            self.index = np.concatenate(parts)

    def differ(self) -> bool:
        for p, n, ref in self.small:
            if ctypes.string_at(p, n) != ref:
                return True
        return self.arena is not None and self.arena[self.index].tobytes() != self.ref


class WeightWatch:
    """An encoder's weights as of the last full check, and the cheap check of an encode against it.

    ``named`` maps weight names to the tensors an encode reads; ``patched`` names the weights the
    patcher has patched over right now (their base values are in its backup: not checked, but still
    part of the encoder's structure). ``small``: tensors of up to that many bytes are compared whole
    (0: every tensor by its samples, so the check reads no tensor's bytes). Not thread-safe: the caller
    serialises."""

    def __init__(self, small: int = SMALL) -> None:
        self._small = small
        self._plans: dict[str, _Plan] = {}
        self._names: frozenset[str] = frozenset()
        self._memory: _Memory | None = None  # the CPU weights' addresses at the last cheap check
        self.full_checks = 0
        self.quick_checks = 0
        self.last_full_bytes = 0  # bytes the last full check or refresh fingerprinted

    @property
    def ready(self) -> bool:
        return bool(self._names)

    def full(self, named: Mapping[str, torch.Tensor], patched: frozenset[str] = frozenset(),
             embeddings: frozenset[str] = frozenset(), values: list[int] | None = None) -> bool:
        """Fingerprint every weight in full and take the result as the new reference; True when the
        weights differ from the last full check's (an edit or a replaced weight; never a move).
        ``values``: their fingerprints, taken just now by the caller (then not taken again)."""
        self.full_checks += 1
        edited = bool(self._names) and self._names != frozenset(named) | patched
        edited = self._fingerprint(named, list(named), embeddings, values) or edited
        self._names = frozenset(named) | patched
        return edited

    def refresh(self, named: Mapping[str, torch.Tensor], patched: frozenset[str], written: Iterable[str],
                embeddings: frozenset[str] = frozenset()) -> bool:
        """After the patcher applied or removed weight patches: the weights it wrote (``written``, the
        names of its patches and backup) and any weight without a reference are fingerprinted in full
        and compared with their last reference (a restored weight with the one from before it was
        patched over); every other weight, which the patcher did not touch, gets the cheap check.
        True when an edit is seen. Counted as a full check."""
        if not self._names:
            return self.full(named, patched, embeddings)
        self.full_checks += 1
        written = set(written)  # (a quantized weight's leaves, ``<name>.<inner>``, by their weight's name)
        redo = [n for n in named if n in written or n not in self._plans or n.rpartition(".")[0] in written]
        if self._names != frozenset(named) | patched:
            return True
        if self._fingerprint(named, redo, embeddings):
            return True
        again = frozenset(redo)
        return self._differ({n: t for n, t in named.items() if n not in again}, patched | again)

    def _fingerprint(self, named: Mapping[str, torch.Tensor], names: list[str], embeddings: frozenset[str],
                     values: list[int] | None = None) -> bool:
        """Fingerprints ``names`` in full (or takes ``values``, theirs) as their new reference; True where
        one differs from its last reference."""
        if values is None:
            values = fingerprints(named[n] for n in names)
        edited = False
        self._memory = None  # new references
        self.last_full_bytes = 0
        for name, fp in zip(names, values, strict=True):
            t = named[name]
            self.last_full_bytes += t.numel() * t.element_size()
            old = self._plans.get(name)
            if old is not None and (old.fp != fp or old.dtype != t.dtype or old.shape != t.shape):
                edited = True
            self._plans[name] = _Plan(t, fp, name in embeddings, self._small)
        return edited

    def reference(self) -> tuple[frozenset[str], dict[str, tuple[int, torch.dtype, torch.Size]]]:
        """The last full check's names and each weight's (fingerprint, dtype, shape), for
        :func:`matches_reference` to compare with outside the caller's lock."""
        return self._names, {n: (p.fp, p.dtype, p.shape) for n, p in self._plans.items()}

    def quick(self, named: Mapping[str, torch.Tensor], patched: frozenset[str] = frozenset(),
              token_ids: Iterable[int] = (), rows_only: bool = False) -> bool:
        """The cheap check: True when the weights are seen to differ from the last full check (a
        weight added, removed or reshaped, a small tensor's bytes, a sampled value, or the row of a
        token this encode reads; ``rows_only``: the rows alone). Plain contiguous CPU weights are read
        straight from memory (see :class:`_Memory`), other CPU weights through NumPy;
        each device's are gathered there and brought over in one transfer."""
        self.quick_checks += 1
        if rows_only:
            plans = self._plans
            return self._rows_differ([(t, plans[n]) for n, t in named.items()
                                      if n in plans and plans[n].rows is not None], token_ids)
        return self._differ(named, patched, token_ids)

    def _differ(self, named: Mapping[str, torch.Tensor], patched: frozenset[str], token_ids: Iterable[int] = ()) -> bool:
        """The cheap check's comparison of every weight in ``named`` (see :meth:`quick`)."""
        plans = self._plans
        if frozenset(named) | patched != self._names:
            return True
        on_device: dict[torch.device, list[tuple[torch.Tensor, bytes]]] = {}
        embeddings = []
        cpu: list[tuple[int, _Plan]] = []  # plain contiguous CPU weights: read straight from memory
        for name, t in named.items():
            plan = plans.get(name)
            if plan is None or t.dtype is not plan.dtype or t.shape != plan.shape:
                return True
            if t.is_cpu:  # (``Parameter.device`` costs a dozen microseconds; ``is_cpu`` does not)
                if type(t) in _PLAIN and t.is_contiguous():
                    cpu.append((t.data_ptr(), plan))
                elif plan.read(t) != plan.ref:
                    return True
            else:
                on_device.setdefault(t.device, []).append((plan.gather(t), plan.ref))
            if plan.rows is not None:
                embeddings.append((t, plan))
        if cpu:
            memory = self._memory
            if memory is None or memory.ptrs != tuple(p for p, _ in cpu):
                memory = self._memory = _Memory(cpu)
            if memory.differ():
                return True
        for parts in on_device.values():  # one small transfer per device
            if torch.cat([p[0] for p in parts]).cpu().numpy().tobytes() != b"".join(p[1] for p in parts):
                return True
        return self._rows_differ(embeddings, token_ids)

    @staticmethod
    def _rows_differ(embeddings: list, token_ids: Iterable[int]) -> bool:
        if not embeddings:
            return False
        ids = sorted({int(i) for i in token_ids})
        for t, plan in embeddings:
            if t.dtype is not plan.dtype or t.shape != plan.shape:
                return True
            rows = [i for i in ids if 0 <= i < plan.shape[0]]
            if rows and not np.array_equal(_shares_of_rows(t, rows, plan.width), plan.rows.numpy()[rows]):
                return True
        return False


def matches_reference(named: Mapping[str, torch.Tensor], patched: frozenset[str],
                      reference: tuple[frozenset[str], dict[str, tuple[int, torch.dtype, torch.Size]]]) -> bool:
    """Whether the weights equal a :meth:`WeightWatch.reference` in full: the same names, and every weight
    the same dtype, shape and full fingerprint (every byte read)."""
    names, plans = reference
    if frozenset(named) | patched != names:
        return False
    for name, t in named.items():
        plan = plans.get(name)
        if plan is None or t.dtype != plan[1] or t.shape != plan[2]:
            return False
    return fingerprints(named.values()) == [plans[n][0] for n in named]
