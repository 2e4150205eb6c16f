"""Host reads of tensor values: what would be a device-to-host copy or a synchronisation on a GPU.

:class:`HostReads` is a ``TorchFunctionMode`` that records every call reading a tensor's values
into Python or host memory (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor, ``.numpy()``,
``.tolist()``, ``.item()``, ``bool()``/``int()``/``float()``/``index`` of a tensor, ``torch.equal``,
``nonzero`` and the other data-dependent shapes, printing), whatever the tensor's device: on a CPU
test machine it shows what the same code would transfer and wait for on a GPU. Each read is kept
with the file of the Python code that made it, so a test can tell the pack's reads from the host's.

Used by the PE cache tests and ``bench/pe_cache.py`` (``pe_hit_host_copies``).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACK_ROOT = Path(__file__).resolve().parents[1]
_TORCH = str(Path(torch.__file__).resolve().parent) + "/"

# reads whatever their arguments (each waits for the tensor's producer on a device)
READS = frozenset({
    "cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__array__", "__repr__", "__format__", "equal", "allclose", "nonzero", "argwhere", "unique",
    "unique_consecutive", "masked_select", "bincount", "repeat_interleave",
})


def _cpu_target(args, kwargs) -> bool:
    """``Tensor.to`` / ``Tensor.copy_`` that lands on the host."""
    for v in (*args[1:], kwargs.get("device")):
        if isinstance(v, (str, torch.device)) and torch.device(v).type == "cpu":
            return True
    return False


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else "?"


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``; then ``reads.ops`` (name, file) and ``reads.pack()``."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and _cpu_target(args, kwargs)) or (
                name == "copy_" and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"):
            self.ops.append((name, _caller()))
        return func(*args, **kwargs)

    def pack(self) -> list[tuple[str, str]]:
        """The reads made by the pack's own code (not its tests), wherever ComfyUI loaded it from
        (the harness loads it through a link)."""
        out = []
        for n, f in self.ops:
            real = Path(f).resolve()
            if real.is_relative_to(PACK_ROOT):
                top = real.relative_to(PACK_ROOT).parts[0]
                if top != "tests" and not top.startswith("."):  # not the hosts and venvs kept beside it
                    out.append((n, str(real)))
        return out

    def names(self) -> Counter:
        return Counter(n for n, _ in self.ops)
