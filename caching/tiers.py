"""The conditioning cache's shared tiers: a disk tier (processes on one host) and a Redis tier (hosts).

Pure logic (torch, safetensors and the standard library; the ``redis`` client only when a URL is set).

- A :class:`SharedKey` is the exact text of a key that means the same in every process (the encoder by
  its weight files' content, never by object identity) and a BLAKE2b-256 name of it.
- An entry is a safetensors blob: the stored value's tensors as tensors, the rest of it and the full key
  text as JSON in the header, a CRC-32 checksum over all of it and, with a secret, an HMAC-SHA256 of all
  of it. A read checks the format, the signature's presence, the key (whole, field by field as text),
  the checksum and the signature before anything is used: a torn, corrupted, foreign, unsigned,
  forged or otherwise malformed entry is a counted rejection and a miss.
- Devices in a stored value are named by kind and model (``cuda[<name>]``), as in the key, and read back
  as this process's device of that kind and model.
- The disk tier writes atomically (a temporary file, then ``os.replace``), bounds its bytes and evicts
  the least recently used files (a hit touches the file's mtime, at most once a minute). It opens an entry without following
  links and without blocking, and reads only a regular file under the entry size cap. Its files end
  in ``.rkcond``, so a folder under ComfyUI's ``models/`` never shows them in a model list. Its files
  are 0600 and the folders it makes 0700: entries hold prompts' conditionings.
- The Redis tier has short socket timeouts, a total deadline per read that grows with the entry's size
  (a server sending a byte at a time cannot hold an encode; a large entry over a slow link is a counted
  ``too_slow`` rejection that cuts only its own connection), reads at most the entry size cap, and a
  circuit breaker (after a failure the tier is skipped for a while, one log line, an error counted);
  writes go through a background queue. Its URL is shown (settings, stats, log) without its password,
  in any form.
- Where the tiers are (the disk folder, the Redis URL) is set from the environment only: a client of
  ComfyUI's API can switch a tier on or off, never point it elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import json
import logging
import os
import platform
import queue
import re
import stat
import struct
import subprocess
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .file_hashes import STALE_TMP_S, FileHashes
from .settings import SETTINGS, label
from .stats import REGISTRY

log = logging.getLogger("reusekit")

# 2: devices in stored values by kind and model; 3: a SHA-256 checksum; 4: a CRC-32 checksum and, with a
# secret, an HMAC of the whole content (before: of the checksum). Against corruption a CRC-32 does what a
# SHA-256 did, without a secret nothing stops a forger either way, and it reads a 240 KB CLIP-L entry,
# which every shared hit checks, in 40 microseconds against 140.
FORMAT = "reusekit-conditioning-4"
MIB = 1 << 20
MAX_ENTRY_BYTES = 256 * MIB  # an entry larger than this is neither written nor read
MAX_HEADER_BYTES = 4 * MIB  # an entry's JSON header: its key and its value's structure, far less than this


class Rejected(Exception):
    """A stored entry that must not be used; ``reason`` names the counter it goes to."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class SharedKey:
    """A key for the shared tiers: ``text`` (exact, compared whole) and ``name`` (its 256-bit digest);
    ``local``: this process's devices by portable name, where a stored value's tensors go."""

    __slots__ = ("text", "name", "local")

    def __init__(self, tree: Any, local: dict[str, torch.device] | None = None):
        self._set(repr(tree), local)

    @classmethod
    def of_text(cls, text: str, local: dict[str, torch.device] | None = None) -> SharedKey:
        """The key whose tree's ``repr`` is ``text`` (a caller that already wrote it out)."""
        key = cls.__new__(cls)
        key._set(text, local)
        return key

    def _set(self, text: str, local: dict[str, torch.device] | None) -> None:
        self.text = text
        self.name = hashlib.blake2b(text.encode(), digest_size=32).hexdigest()
        self.local = local


# ---- devices by kind and model -----------------------------------------------------------------

_INDEXED = re.compile(r"^(cuda|xpu|mps|npu|mlu|hpu|xla|privateuseone|mtia):(\d+)$")
_portable_names: dict[str, str] = {}


@functools.cache
def cpu_model() -> str | None:
    """The CPU's model name, where the system says it: Linux's /proc/cpuinfo (x86's model name, Arm's implementer,
    variant and part), macOS's ``sysctl`` (Apple silicon's chip), Windows' processor string (family, model and
    stepping); None elsewhere. Within one instruction-set level MKL and oneDNN still pick kernels by vendor and
    model (AMX, VNNI)."""
    system = platform.system()
    if system == "Windows":
        return platform.processor() or None
    if system == "Darwin":
        try:
            done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n", 1)[0].splitlines() if ":" in line)
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if fields.get("model name"):
        return fields["model name"]
    arm = [fields.get(k) for k in ("CPU implementer", "CPU architecture", "CPU variant", "CPU part")]
    return "arm " + " ".join(arm) if all(arm) else None


def device_model(device: torch.device) -> str | None:
    """The model of the device an encode computes on, or None where this process cannot name it (an encode
    there is kept local): the CPU's (:func:`cpu_model`); Apple's MPS by its chip, the CPU's; a GPU (CUDA,
    XPU...) by the name its torch module gives."""
    if device.type in ("cpu", "mps"):
        return cpu_model()
    name = getattr(getattr(torch, device.type, None), "get_device_name", None)
    try:
        return str(name(device)) if name is not None else None
    except Exception:  # no such device here, or no driver: nameless
        return None


def portable_device(name: str) -> str:
    """``cuda:1`` as ``cuda[<device model>]`` (:func:`device_model`): the same kind and model of device in
    another process names alike. Names without an index (``cpu``, ``cuda``) stay as they are; a device whose
    model cannot be read names its kind alone (the shared key then keeps such an encode local)."""
    found = _portable_names.get(name)
    if found is None:
        match = _INDEXED.match(name)
        if match is None:
            return name
        model = device_model(torch.device(name))
        found = match.group(1) if model is None else f"{match.group(1)}[{model}]"
        _portable_names[name] = found
    return found


def is_indexed_device(name: str) -> bool:
    return _INDEXED.match(name) is not None


# ---- entries: stored values as safetensors -----------------------------------------------------

def _plain(v: Any) -> list:
    if v is None:
        return ["none"]
    if isinstance(v, bool):
        return ["b", v]
    if isinstance(v, int):
        return ["i", str(v)]
    if isinstance(v, float):
        return ["f", v.hex()]
    if isinstance(v, str):
        return ["s", v]
    if isinstance(v, bytes):
        return ["y", v.hex()]
    if isinstance(v, torch.dtype):
        return ["dtype", str(v).removeprefix("torch.")]
    if isinstance(v, torch.device):
        return ["device", portable_device(str(v))]
    if isinstance(v, torch.Size):
        return ["size", list(v)]
    raise TypeError(f"cannot share a {type(v).__name__}")


def _unplain(p: list) -> Any:
    tag = p[0]
    if tag == "none":
        return None
    if tag == "b":
        return bool(p[1])
    if tag == "i":
        return int(p[1])
    if tag == "f":
        return float.fromhex(p[1])
    if tag == "s":
        return str(p[1])
    if tag == "y":
        return bytes.fromhex(p[1])
    if tag == "dtype":
        dtype = getattr(torch, p[1], None)
        if not isinstance(dtype, torch.dtype):
            raise Rejected("malformed", f"dtype {p[1]!r}")
        return dtype
    if tag == "device":
        return _device(p[1])
    if tag == "size":
        return torch.Size(int(d) for d in p[1])
    raise Rejected("malformed", f"value tag {tag!r}")


def _device(name: str, local: dict[str, torch.device] | None = None) -> torch.device:
    """This process's device for a stored one: ``cpu``, or a device of the same kind and model named
    in ``local`` (the devices of the encode asking). An entry made for one it lacks cannot be used."""
    if not isinstance(name, str):
        raise Rejected("malformed", f"device {name!r}")
    if local and name in local:
        return local[name]
    if name == "cpu":
        return torch.device("cpu")
    if "[" in name:
        raise Rejected("device", f"no {name} here")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise Rejected("malformed", f"device {name!r}: {exc}") from None
    if device.index is not None:  # indexed names are never written: another process's numbering
        raise Rejected("malformed", f"device {name!r}")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise Rejected("device", str(exc)) from None
    return device


def _to_json(stored: Any, tensors: list, names: dict[type, str]) -> Any:
    tag = stored[0]
    if tag == "T":
        tensors.append(stored[1])
        return {"T": len(tensors) - 1, "on": portable_device(str(stored[2]))}
    if tag == "V":
        return {"V": _plain(stored[1])}
    if tag in ("L", "U"):
        return {tag: [_to_json(x, tensors, names) for x in stored[1]]}
    if tag == "D":
        return {"D": [[_plain(k), _to_json(x, tensors, names)] for k, x in stored[1]]}
    return {"C": names[stored[1]], "attrs": [[k, _to_json(x, tensors, names)] for k, x in stored[2]]}


def _from_json(node: Any, tensors: dict[str, torch.Tensor], classes: dict[str, type],
               local: dict[str, torch.device] | None = None) -> Any:
    if not isinstance(node, dict):
        raise Rejected("malformed", "value node")

    def go(x):
        return _from_json(x, tensors, classes, local)

    if "T" in node:
        t = tensors.get(f"t{int(node['T'])}")
        if t is None:
            raise Rejected("malformed", "missing tensor")
        return ("T", t, _device(node["on"], local))
    if "V" in node:
        return ("V", _unplain(node["V"]))
    if "L" in node:
        return ("L", [go(x) for x in node["L"]])
    if "U" in node:
        return ("U", tuple(go(x) for x in node["U"]))
    if "D" in node:
        return ("D", [(_unplain(k), go(x)) for k, x in node["D"]])
    cls = classes.get(node.get("C"))
    if cls is None:
        raise Rejected("malformed", f"container {node.get('C')!r}")
    return ("C", cls, [(str(k), go(x)) for k, x in node["attrs"]])


class _Crc32:
    """zlib's CRC-32 with a hash object's ``update``."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


def _fed(h, meta: dict[str, str], tensors: dict[str, torch.Tensor]):
    """``h`` fed the header fields (but the checksum and signature) and every tensor's name, dtype, shape
    and bytes."""
    h.update(json.dumps({k: v for k, v in meta.items() if k not in ("checksum", "hmac")}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()))
    return h


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """The entry's CRC-32, against corruption (a torn write, a flipped bit)."""
    return f"{_fed(_Crc32(), meta, tensors).value:08x}"


def _signature(secret: bytes, meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """HMAC-SHA256 of the entry's whole content under the secret, against forgery."""
    return _fed(hmac.new(secret, digestmod=hashlib.sha256), meta, tensors).hexdigest()


def pack(key: SharedKey, stored: Any, seconds: float, secret: bytes | None, names: dict[type, str]) -> bytes:
    """An entry's bytes: a frozen value (``caching.conditioning.freeze``) with its key, checksum, signature."""
    tensors: list[torch.Tensor] = []
    value = json.dumps(_to_json(stored, tensors, names), separators=(",", ":"))
    named = {f"t{i}": t.contiguous() for i, t in enumerate(tensors)}
    meta = {"format": FORMAT, "key": key.text, "value": value, "seconds": float(seconds).hex()}
    meta["checksum"] = _checksum(meta, named)
    if secret:
        meta["hmac"] = _signature(secret, meta, named)
    data = st_save(named, metadata=meta)
    if struct.unpack("<Q", data[:8])[0] > MAX_HEADER_BYTES:  # every reader would reject it
        raise ValueError(f"its header is over the {MAX_HEADER_BYTES // MIB} MiB a reader parses")
    return data


def _header(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise Rejected("corrupt", "shorter than a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise Rejected("corrupt", "truncated header")
    if n > MAX_HEADER_BYTES:  # parsed before any check: a planted one would cost every reader many times its bytes
        raise Rejected("corrupt", f"a header of {n} bytes, over {MAX_HEADER_BYTES}")
    try:
        meta = json.loads(data[8:8 + n]).get("__metadata__")
    except (ValueError, AttributeError) as exc:
        raise Rejected("corrupt", str(exc)) from None
    if not isinstance(meta, dict):
        raise Rejected("corrupt", "no metadata")
    return meta


def unpack(data: bytes, key: SharedKey, secret: bytes | None, classes: dict[str, type],
           local: dict[str, torch.device] | None = None) -> tuple[Any, float]:
    """The frozen value and compute seconds of an entry, after every check; Rejected otherwise.
    ``local``: this process's devices by portable name (:func:`portable_device`), for stored tensors.
    Whatever else an entry's bytes make a check raise (a non-ASCII checksum in ``hmac.compare_digest``,
    a header nested past json's recursion limit, a value node of the wrong type) is ``malformed``: every
    bad entry is a counted rejection and a miss, never an exception the tiers' counters miss."""
    try:
        return _unpack(data, key, secret, classes, local)
    except Rejected:
        raise
    except Exception as exc:
        raise Rejected("malformed", f"{type(exc).__name__}: {exc}") from None


def _unpack(data: bytes, key: SharedKey, secret: bytes | None, classes: dict[str, type],
            local: dict[str, torch.device] | None) -> tuple[Any, float]:
    meta = _header(data)
    if meta.get("format") != FORMAT:
        raise Rejected("corrupt", f"format {meta.get('format')!r}")
    if secret and "hmac" not in meta:
        raise Rejected("unsigned")
    if meta.get("key") != key.text:
        raise Rejected("foreign")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error type for a truncated or bad body
        raise Rejected("corrupt", str(exc)) from None
    if not hmac.compare_digest(_checksum(meta, tensors), str(meta.get("checksum"))):
        raise Rejected("corrupt", "checksum")
    if secret and not hmac.compare_digest(_signature(secret, meta, tensors), str(meta["hmac"])):
        raise Rejected("unsigned", "wrong signature")
    return _from_json(json.loads(meta["value"]), tensors, classes, local), float.fromhex(meta["seconds"])


# ---- the disk tier -----------------------------------------------------------------------------

_HEX2 = re.compile(r"^[0-9a-f]{2}$")
# an entry, or its temporary file (``.safetensors``: entries of ReuseKit 0.1, counted and evicted, never read)
_ENTRY = re.compile(r"^(\.)?([0-9a-f]{64})\.(?:rkcond|safetensors)(\.\d+\.[0-9a-f]{8}\.tmp)?$")


def _private_folders(folder: Path) -> None:
    """Make ``folder`` and its missing parents, each 0700 (``Path.mkdir(parents=True)`` makes the parents
    with the umask's mode). A folder that exists is left as it is: the user chose it."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(made, 0o700)


class DiskTier:
    """Entries as files ``<folder>/<2 hex>/<name>.safetensors``; bytes bounded, least recently used out."""

    SUFFIX = ".rkcond"  # not a model extension: ComfyUI never lists these files
    RESCAN_S = 30.0  # other processes' writes are seen by a rescan at least this often
    RESCAN_SHARE = 16  # and after this share of the budget written here (each of N processes sharing the folder
    # judged the budget by its own writes: N of them writing at once filled N times it)
    TOUCH_S = 60.0  # a hit sets the file's mtime when older than this (a hot entry writes no metadata per hit)

    def __init__(self, folder: str | os.PathLike, budget_bytes: int):
        self.folder = Path(folder)
        self.budget_bytes = int(budget_bytes)
        self.max_bytes = MAX_ENTRY_BYTES
        self._lock = threading.Lock()
        self._usage: tuple[int, int] | None = None  # (entries, bytes) at the last scan, plus our writes since
        self._written = 0  # bytes written here since the last scan
        self._scanned = 0.0
        self.unlisted: str | None = None  # why the last scan could not list the folder (its usage unknown)

    def path(self, name: str) -> Path:
        return self.folder / name[:2] / f"{name}{self.SUFFIX}"

    def read(self, name: str) -> bytes | None:
        """The entry's bytes, None when there is none. The file is opened without following a link
        and without blocking (a FIFO), and read only when it is a regular file under the size cap
        (Rejected otherwise)."""
        path = self.path(name)
        if path.parent.is_symlink():  # (O_NOFOLLOW covers the file alone)
            raise Rejected("not_a_file", f"{path.parent} is a link")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link where an entry should be
                raise Rejected("not_a_file", f"{path} is a link") from None
            raise
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Rejected("not_a_file", f"{path} is not a regular file")
            if st.st_size > self.max_bytes:
                raise Rejected("oversize", f"{st.st_size} bytes")
            buf = bytearray(st.st_size + 1)
            view, n = memoryview(buf), 0
            while n < len(buf) and (got := f.readinto(view[n:])):
                n += got
            if n <= st.st_size and time.time() - st.st_mtime > self.TOUCH_S:  # least recently used: a hit is a use
                with contextlib.suppress(OSError):
                    os.utime(fd if os.utime in os.supports_fd else path)  # the file read, not what a path holds now
        if n > st.st_size:
            raise Rejected("corrupt", "grew while read")
        return bytes(view[:n])

    def write(self, name: str, data: bytes) -> None:
        """Write atomically: a reader sees the old file, the new one or none, never a part. The file is
        0600 and every folder this makes 0700 (created so: a umask only takes bits away, so a permissive
        one cannot open them): an entry holds a prompt's conditioning."""
        path = self.path(name)
        _private_folders(path.parent)
        if path.parent.is_symlink():  # someone's link to files elsewhere: never written through
            raise NotADirectoryError(errno.ENOTDIR, "a link, not a folder of the tier's", str(path.parent))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
            with os.fdopen(os.open(tmp, flags, 0o600), "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        with self._lock:
            if self._usage is not None:
                self._usage = (self._usage[0] + 1, self._usage[1] + len(data))
            self._written += len(data)
            rescan = self._written > self.budget_bytes / self.RESCAN_SHARE
        if self.usage(fresh=rescan)[1] > self.budget_bytes:
            self.evict()

    def remove(self, name: str, read: bytes) -> None:
        """Remove the entry if it still holds ``read`` (the bytes found corrupt): another process may have
        replaced it with a good one since, which stays. The file is moved aside first (atomically: what a
        writer replaces afterwards is not touched), compared there, and put back where it is another."""
        path = self.path(name)
        if path.parent.is_symlink():
            return
        aside = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # swept if left
        try:
            os.rename(path, aside)
        except OSError:
            return
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            with os.fdopen(os.open(aside, flags), "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                same = stat.S_ISREG(st.st_mode) and st.st_size == len(read) and f.read(len(read) + 1) == read
        except OSError:
            same = False
        if not same:
            with contextlib.suppress(OSError):  # back, unless a newer entry came meanwhile (that one stays)
                os.link(aside, path)
        with contextlib.suppress(OSError):
            aside.unlink()

    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of our entries. Only names this tier writes count (``<2 hex>/<64 hex>``
        + suffix): a folder pointed at other files never has them counted, evicted or swept."""
        out, unlisted = [], None
        try:
            subs = list(self.folder.iterdir()) if self.folder.is_dir() else []
        except OSError as exc:  # a folder of another user's (made 0700), say: entries may still be read and written
            subs, unlisted = [], f"{type(exc).__name__}: {exc.strerror or exc}"
        for sub in subs:
            try:
                if not (_HEX2.match(sub.name) and sub.is_dir() and not sub.is_symlink()):
                    continue
                entries = list(os.scandir(sub))
            except OSError as exc:  # (a folder that can be listed but not entered: its entries cannot be looked at)
                unlisted = f"{type(exc).__name__}: {exc.strerror or exc}"
                continue
            for entry in entries:
                ours = _ENTRY.match(entry.name)
                if ours is None or not ours.group(2).startswith(sub.name):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if ours.group(1) is None and ours.group(3) is None:
                    out.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif ours.group(1) and ours.group(3) and time.time() - st.st_mtime > STALE_TMP_S:
                    with contextlib.suppress(OSError):  # left by a writer that died mid-write
                        os.unlink(entry.path)
        self.unlisted = unlisted
        return out

    def usage(self, fresh: bool = False) -> tuple[int, int]:
        """(entries, bytes) in the folder: from a scan at most RESCAN_S old unless ``fresh``."""
        with self._lock:
            if not fresh and self._usage is not None and time.monotonic() - self._scanned < self.RESCAN_S:
                return self._usage
        files = self._files()
        usage = (len(files), sum(f[1] for f in files))
        with self._lock:
            self._usage, self._scanned, self._written = usage, time.monotonic(), 0
        return usage

    def evict(self) -> int:
        """Remove the least recently used files until the folder is within 90% of its budget."""
        files = sorted(self._files())
        total = sum(f[1] for f in files)
        removed = 0
        for _, size, path in files:
            if total <= self.budget_bytes * 0.9:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            removed += 1
        self.usage(fresh=True)
        return removed


# ---- the Redis tier ----------------------------------------------------------------------------

class Unavailable(Exception):
    """The Redis tier is skipped right now (breaker open, or the client failed)."""


class _Late(Exception):
    """A Redis call cut at its deadline."""


class _Deadlines:
    """Deadlines of calls running on their callers' threads, and one daemon thread that cuts a call
    when its deadline passes: ``cut()`` given to ``arm`` (what closes that call's own connection), else
    ``expire()``. Arming a deadline wakes the thread only when it is idle or waits for a later one:
    reads a second apart wake it about once a second, not once a read. ``close`` never strands a call:
    the thread ends once closed with nothing armed, and a call armed after that (a read that took the
    tier just before a settings change replaced it) starts it again."""

    def __init__(self, expire=None):
        self._expire = expire
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, Any]] = {}  # token -> (monotonic deadline, cut)
        self._fired: set[int] = set()
        self._tokens = iter(range(1 << 62))
        self._until: float | None = None  # what the thread waits for (None: nothing, or not started)
        self._thread: threading.Thread | None = None
        self._running = False  # the thread runs (False once it has decided to end)
        self._closed = False

    def arm(self, seconds: float, cut=None) -> int:
        with self._cond:
            token, deadline = next(self._tokens), time.monotonic() + seconds
            self._armed[token] = (deadline, cut or self._expire)
            if not self._running:
                self._running = True
                self._thread = threading.Thread(target=self._run, name="reusekit-redis-deadline", daemon=True)
                self._thread.start()
            elif self._until is None or deadline < self._until:
                self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Forget a deadline; True when it had passed (its call was cut)."""
        with self._cond:
            self._armed.pop(token, None)
            fired = token in self._fired
            self._fired.discard(token)
            return fired

    def close(self) -> None:
        """End the thread once no call is armed (the calls armed still get their deadlines)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed and not self._armed:
                    self._running = False
                    return
                now = time.monotonic()
                late = [(t, cut) for t, (d, cut) in self._armed.items() if d <= now]
                for t, _ in late:
                    del self._armed[t]
                    self._fired.add(t)
                if not late:
                    self._until = min((d for d, _ in self._armed.values()), default=None)
                    self._cond.wait(None if self._until is None else self._until - now)
                    self._until = None
                    continue
            for _, cut in late:  # outside the lock: a cut closes sockets
                try:
                    cut()
                except Exception as exc:  # the watchdog outlives a cut that fails: later calls need it
                    log.debug("ReuseKit: cutting a Redis call failed: %s", exc)


class RedisTier:
    """Entries as Redis values with a TTL. A read runs on the caller's thread, on a connection of that
    thread's own: ``STRLEN`` within ``4 * timeout_s``, then (a value over ``max_bytes`` is rejected
    unread) ``GETRANGE`` of that many bytes within ``4 * timeout_s`` + size / ``MIN_RATE``, so a large
    entry over a link that is slow but above the floor rate still arrives. Past a deadline a watchdog
    thread closes that read's connection, and no other: the writer's SETs and other threads' reads go
    on. Writes go through a bounded background queue (a full queue drops the write). A failure opens
    the breaker: the tier is skipped for ``cooldown_s`` seconds, with one log line. An entry too slow
    for its deadline is no failure of the tier: a counted ``too_slow`` rejection, the breaker stays
    shut."""

    PREFIX = "reusekit:cond:1:"
    MIN_RATE = MIB  # bytes per second: the slowest link a read waits for (256 MiB: 256 s more)

    def __init__(self, url: str, ttl_s: int, timeout_s: float = 0.25, cooldown_s: float = 15.0,
                 on_error=None, on_written=None):
        import redis  # optional dependency: the caller checks it is installed

        self.url = url
        self.ttl_s = int(ttl_s)
        self.cooldown_s = cooldown_s
        self.deadline_s = 4 * timeout_s
        self.max_bytes = MAX_ENTRY_BYTES
        self._redis = redis
        self._options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry_on_timeout": False}
        self._client = redis.Redis.from_url(url, **self._options)  # the writer's and usage's
        self._readers = threading.local()  # each reading thread's client: a cut ends that read only
        self._down_until = 0.0
        self._on_error = on_error or (lambda exc: None)
        self._on_written = on_written or (lambda n: None)
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="reusekit-redis-writer", daemon=True)
        self._thread.start()
        self._deadlines = _Deadlines()

    def _fail(self, exc: Exception) -> None:
        first = time.monotonic() >= self._down_until
        self._down_until = time.monotonic() + self.cooldown_s
        if first:
            log.warning("ReuseKit: the Redis tier at %s failed (%s); skipped for %.0f s",
                        _redacted(self.url), exc, self.cooldown_s)
        self._on_error(exc)

    def _call(self, fn, *args, **kwargs):
        if time.monotonic() < self._down_until:
            raise Unavailable("breaker open")
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # the client's errors and a server answering nonsense alike
            self._fail(exc)
            raise Unavailable(str(exc)) from None

    def _reader(self):
        client = getattr(self._readers, "client", None)
        if client is None:
            client = self._readers.client = self._redis.Redis.from_url(self.url, **self._options)
        return client

    def _timed(self, reader, seconds: float, fn, *args):
        """``fn(*args)`` on ``reader``, cut (its connection closed) past ``seconds``: _Late then."""
        token = self._deadlines.arm(seconds, reader.connection_pool.disconnect)
        try:
            return fn(*args)
        except Exception:
            if self._deadlines.disarm(token):
                raise _Late(f"a call took over {seconds:.2f} s") from None
            raise
        finally:
            self._deadlines.disarm(token)  # (an answer that came whole as the deadline passed is whole)

    def read(self, name: str) -> bytes | None:
        if time.monotonic() < self._down_until:
            raise Unavailable("breaker open")
        key, reader = self.PREFIX + name, self._reader()
        try:
            size = self._timed(reader, self.deadline_s, reader.strlen, key)
            if not isinstance(size, int):
                raise TypeError(f"STRLEN answered {size!r}")
        except Exception as exc:  # the client's errors, a server answering nonsense or too slow to answer
            self._fail(exc)
            raise Unavailable(str(exc)) from None
        if not size:
            return None  # no such key
        if size > self.max_bytes:
            raise Rejected("oversize", f"{size} bytes, over {self.max_bytes}")
        seconds = self.deadline_s + size / self.MIN_RATE
        try:
            data = self._timed(reader, seconds, reader.getrange, key, 0, size)  # at most size + 1 bytes
        except _Late:  # this entry over this link, not the tier: the breaker stays shut
            raise Rejected("too_slow", f"{size} bytes in over {seconds:.2f} s") from None
        except Exception as exc:
            self._fail(exc)
            raise Unavailable(str(exc)) from None
        if not data:
            return None  # gone since the STRLEN (expired, evicted)
        if len(data) > size:
            raise Rejected("corrupt", "grew while read")
        return data

    def write(self, name: str, data: bytes) -> bool:
        """Queue a write; False when it was dropped (queue full or breaker open)."""
        if self._closed or time.monotonic() < self._down_until:
            return False
        try:
            self._queue.put_nowait((name, data))
            return True
        except queue.Full:
            return False

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, the bench)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) under our prefix, by one SCAN and pipelined STRLENs."""
        keys = self._call(lambda: list(self._client.scan_iter(match=self.PREFIX + "*", count=500)))
        if not keys:
            return (0, 0)
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        return (len(keys), sum(self._call(pipe.execute)))

    def close(self) -> None:
        """Stop taking writes; the writer thread ends after the write in hand (the rest are dropped)."""
        self._closed = True
        self._deadlines.close()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait((None, None))

    def _work(self) -> None:
        while True:
            name, data = self._queue.get()
            try:
                if name is None or self._closed:
                    return
                self._call(self._client.set, self.PREFIX + name, data, ex=max(1, self.ttl_s))
                self._on_written(len(data))
            except Unavailable:
                pass
            except Exception as exc:  # never let the writer thread die
                log.debug("ReuseKit: Redis write failed: %s", exc)
            finally:
                self._queue.task_done()


# query keys that carry a secret to the client (redis-py passes unknown keys on: ``password``, ``ssl_password``)
_SECRET_QUERY_KEY = re.compile(r"pass|secret|token|auth|cred", re.IGNORECASE)


def _redacted(url: str) -> str:
    """A Redis URL without its password in any form redis-py takes, as the settings, the stats and the
    log show it: everything before the last ``@`` (``user:pw@``, ``:pw@``, a password holding an
    unescaped ``?``) and the value of every query key that names a secret (``?password=``,
    ``ssl_password=``, a percent-encoded name alike) become ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = f"***@{rest.rpartition('@')[2]}"
    where, q, query = rest.partition("?")
    fields = []
    for field in query.split("&") if q else ():
        name, eq, _ = field.partition("=")
        fields.append(f"{name}=***" if eq and _SECRET_QUERY_KEY.search(unquote_plus(name)) else field)
    return f"{scheme}{sep}{where}{q}{'&'.join(fields)}"


# ---- the tiers together, their settings and stats ----------------------------------------------

ENV_DISK = "REUSEKIT_DISK_CACHE"
ENV_REDIS = "REUSEKIT_REDIS_URL"
ENV_SECRET = "REUSEKIT_CACHE_SECRET"


class SharedTiers:
    """The enabled shared tiers in order (disk, then Redis), each with its own stats handle."""

    def __init__(self, registry):
        self.hashes = FileHashes()
        self.hashes.problem = self._memo_problem
        self.disk: DiskTier | None = None
        self.redis: RedisTier | None = None
        self.redis_problem: str | None = None  # why the Redis URL set could not be used (its panel card says it)
        self.secret: bytes | None = None
        self.default_folder: str | None = None  # ComfyUI's user directory + reusekit/conditioning (patches set it)
        self._warned: set[str] = set()
        self._said_unlisted: str | None = None
        self._redis_scanned = 0.0
        self.stats = {
            "disk": registry.register(
                "conditioning_disk", "conditioning",
                "The conditioning cache's disk tier: entries shared by the ComfyUI processes of one host."),
            "redis": registry.register(
                "conditioning_redis", "conditioning",
                "The conditioning cache's Redis tier: entries shared across hosts."),
        }
        for stats in self.stats.values():  # asked only what the conditioning cache's memory missed
            stats.set_info("answers_misses_of", "conditioning")

    @property
    def active(self) -> bool:
        return self.disk is not None or self.redis is not None

    def _memo_problem(self, reason: str) -> None:
        for name, _ in self._tiers():
            self.stats[name].count_reason("fallback", reason, source="file hashes")

    def _say_once(self, tag: str, msg: str, *args) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning(msg, *args)

    def configure(self, settings) -> None:
        """(Re)build the tiers from the settings and the secret from the environment."""
        secret = os.environ.get(ENV_SECRET, "")
        self.secret = secret.encode() if secret else None
        self.hashes.secret = self.secret  # the file-hash memo is signed with it too
        folder = settings.get("conditioning.disk.folder") or self.default_folder
        disk = None
        if settings.get("conditioning.disk.enabled") and folder:
            disk = DiskTier(folder, settings.get("conditioning.disk.budget_mib") * MIB)
        self.disk = disk
        old, self.redis, self.redis_problem = self.redis, None, None
        if old is not None:
            old.close()
        url = settings.get("conditioning.redis.url")
        if settings.get("conditioning.redis.enabled") and url:
            try:
                import redis  # noqa: F401
            except ImportError:
                self._say_once("redis-missing", "ReuseKit: a Redis URL is set but the `redis` client is not "
                               "installed (pip install redis); the Redis tier stays off")
            else:
                stats = self.stats["redis"]
                try:
                    self.redis = RedisTier(url, settings.get("conditioning.redis.ttl_hours") * 3600,
                                           timeout_s=settings.get("conditioning.redis.timeout_ms") / 1000,
                                           on_error=lambda exc: stats.incr("errors"),
                                           on_written=self._redis_written)
                except ValueError:  # redis-py's parse of the URL, whose message may quote a part of it (a password)
                    self.redis_problem = _url_problem(url)
                    raise ValueError(f"setting 'conditioning.redis.url': {self.redis_problem}") from None
        for stats in self.stats.values():  # the panel shows these counters from the start, zero or not
            for name in ("hits", "misses", "errors", "rejected"):
                stats.incr(name, 0)
        self.publish()

    def _tiers(self):
        return [(n, t) for n, t in (("disk", self.disk), ("redis", self.redis)) if t is not None]

    def get(self, key: SharedKey, classes: dict[str, type],
            local: dict[str, torch.device] | None = None) -> tuple[Any, float] | None:
        """The frozen value and compute seconds from the first tier that has a valid entry; a hit
        in Redis is promoted to the disk tier. Every miss, error and rejection is counted.
        ``local``: the devices of the encode asking, by portable name (stored tensors go there)."""
        for name, tier in self._tiers():
            stats = self.stats[name]
            data = None
            try:
                data = tier.read(key.name)
                stored, seconds = (None, 0.0) if data is None else unpack(data, key, self.secret, classes, local)
            except Unavailable:
                data = None
            except OSError as exc:
                stats.incr("errors")
                log.debug("ReuseKit: %s tier read failed: %s", name, exc)
                data = None
            except Rejected as exc:
                stats.incr("rejected")
                stats.incr(f"rejected.{exc.reason}")
                stats.incr("misses")
                log.debug("ReuseKit: %s tier entry %s rejected (%s)", name, key.name, exc)
                if name == "disk" and exc.reason == "corrupt" and data is not None:  # (not one that grew while read)
                    tier.remove(key.name, data)
                continue
            if data is None:
                stats.incr("misses")
                continue
            stats.incr("hits")
            stats.add_time_saved(seconds)
            disk = self.disk
            if name == "redis" and disk is not None:
                self._write_disk(disk, key.name, data)
            self.publish(redis=False)
            return stored, seconds
        return None

    def put(self, key: SharedKey, stored: Any, seconds: float, names: dict[type, str]) -> bool:
        """Write an entry through to every enabled tier (Redis in the background: queued is taken, a write
        that fails later counts in its ``errors``); False where none took it (too large, a failed disk write, a
        Redis write dropped unqueued: counted in each tier's stats): the caller counts it, not shared. A value
        the entry format cannot hold (a container not registered...) raises: the caller counts it, not
        shared."""
        data = pack(key, stored, seconds, self.secret, names)
        disk, redis = self.disk, self.redis  # the settings may rebuild the tiers meanwhile
        taken = False
        for name, tier in (("disk", disk), ("redis", redis)):
            if tier is None:
                continue
            if len(data) > tier.max_bytes:
                self.stats[name].count_reason("refused", f"an entry is larger than this tier's limit "
                                              f"({tier.max_bytes / MIB:.1f} MiB): not written")
                continue
            if tier is disk:
                taken = self._write_disk(disk, key.name, data) or taken
            elif redis.write(key.name, data):
                taken = True
            else:
                self.stats["redis"].incr("dropped")
                self.stats["redis"].count_reason("refused", "an entry was dropped: the write queue was full or the "
                                                 "server is down")
        self.publish(redis=False)
        return taken

    def _write_disk(self, disk: DiskTier, name: str, data: bytes) -> bool:
        try:
            disk.write(name, data)
            self.stats["disk"].incr("written")
            return True
        except OSError as exc:
            self.stats["disk"].incr("errors")
            self.stats["disk"].count_reason("refused", f"an entry could not be written to {disk.folder} "
                                            f"({type(exc).__name__}: {exc.strerror or exc})")
            self._say_once("disk-write", "ReuseKit: the disk tier cannot write to %s (%s)", disk.folder, exc)
            return False

    def _redis_written(self, n: int) -> None:
        self.stats["redis"].incr("written")
        if time.monotonic() - self._redis_scanned > 30.0:  # a SCAN of every entry: not after every write
            self.publish(disk=False)

    def publish(self, disk: bool = True, redis: bool = True) -> None:
        """Entries and bytes of each tier into its stats (Redis's by a throttled scan)."""
        tier_disk, tier_redis = self.disk, self.redis
        if disk:
            stats = self.stats["disk"]
            entries, held = tier_disk.usage() if tier_disk is not None else (0, 0)
            unlisted = tier_disk.unlisted if tier_disk is not None else None
            if unlisted is not None and unlisted != self._said_unlisted:  # (once per cause)
                stats.incr("errors")
                stats.count_reason("fallback", f"the folder {tier_disk.folder} cannot be listed ({unlisted}): its "
                                   "entries are not counted or evicted, so its budget is not kept", source="disk tier")
                self._say_once(f"unlisted:{unlisted}", "ReuseKit: the disk tier cannot list %s (%s); its budget is "
                               "not kept", tier_disk.folder, unlisted)
            self._said_unlisted = unlisted
            stats.set_entries(entries)
            stats.set_memory("disk", held, tier_disk.budget_bytes if tier_disk is not None else 0)
            stats.set_info("folder", str(tier_disk.folder) if tier_disk is not None else None)
        if redis:
            stats = self.stats["redis"]
            entries, held = 0, 0
            if tier_redis is not None:
                self._redis_scanned = time.monotonic()
                try:
                    entries, held = tier_redis.usage()
                except Unavailable:
                    entries, held = 0, 0
            stats.set_entries(entries)
            stats.set_memory("redis", held)
            stats.set_info("url", _redacted(tier_redis.url) if tier_redis is not None else None)


TIERS = SharedTiers(REGISTRY)


def _url_problem(url: str) -> str:
    """What is wrong with a Redis URL that redis-py refused, in words that quote none of it."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        return "it names no redis://, rediss:// or unix:// scheme"
    return ("its port, database or options cannot be read (a password holding / # @ : or ? must be "
            "percent-encoded)")


def switch(name: str) -> str | None:
    """Why the shared tier ``name`` (``disk``, ``redis``) is off, as the one line that turns it on; None
    while it is on. The folder and the URL come from the environment only; the switches from the settings."""
    enabled = SETTINGS.get(f"conditioning.{name}.enabled")
    in_panel = f'turn on "{label(f"conditioning.{name}.enabled")}" in the panel\'s settings'
    if name == "disk":
        if TIERS.disk is not None:
            return None
        start = f"start ComfyUI with {ENV_DISK}=<folder>"
        return start if enabled else f"{in_panel}, or {start}"
    if TIERS.redis is not None:
        return None
    if not SETTINGS.get("conditioning.redis.url"):
        return f"start ComfyUI with {ENV_REDIS}=redis://<host>:<port>/<db>"
    if enabled and TIERS.redis_problem:
        return (f"{ENV_REDIS} is not a Redis URL ({TIERS.redis_problem}): set it to redis://<host>:<port>/<db> and "
                "restart ComfyUI")
    return "install the redis client (pip install redis) and restart ComfyUI" if enabled else in_panel


def publish_switches() -> None:
    """Mark each shared tier that is off in its stats (``off``: the line that turns it on); a settler of the
    registry, so every snapshot (the panel's, the Cache Stats node's, with or without the server) says it."""
    for name, stats in TIERS.stats.items():
        stats.set_off(switch(name))


def _reconfigure(_value=None) -> None:
    TIERS.configure(SETTINGS)


SETTINGS.define("conditioning.disk.enabled", bool, bool(os.environ.get(ENV_DISK)),
                "The conditioning cache's disk tier: entries shared by every ComfyUI process of this host, "
                f"kept across restarts. Environment: {ENV_DISK}=<folder> turns it on there.",
                on_change=_reconfigure)
SETTINGS.define("conditioning.disk.folder", str, os.environ.get(ENV_DISK, ""),
                "The disk tier's folder; empty: reusekit/conditioning under ComfyUI's user directory.",
                on_change=_reconfigure, env_only=ENV_DISK)
SETTINGS.define("conditioning.disk.budget_mib", int, 4096,
                "MiB the disk tier may hold; the least recently used files go first.",
                minimum=1, maximum=1 << 24, on_change=_reconfigure)
SETTINGS.define("conditioning.redis.enabled", bool, bool(os.environ.get(ENV_REDIS)),
                f"The conditioning cache's Redis tier, shared across hosts. Environment: {ENV_REDIS}=redis://... "
                "turns it on with that server.", on_change=_reconfigure)
SETTINGS.define("conditioning.redis.url", str, os.environ.get(ENV_REDIS, ""),
                "The Redis server of the Redis tier (redis://host:port/db).", on_change=_reconfigure,
                env_only=ENV_REDIS, shown=_redacted)
SETTINGS.define("conditioning.redis.ttl_hours", int, 168,
                "Hours a Redis entry lives (Redis's own maxmemory policy evicts before that).",
                minimum=1, maximum=1 << 20, on_change=_reconfigure)
SETTINGS.define("conditioning.redis.timeout_ms", int, 250,
                "Socket timeout of a Redis call (a whole read gets four times this, plus a second per MiB of "
                "the entry); a failure skips the tier for a while.",
                minimum=10, maximum=60_000, on_change=_reconfigure)
REGISTRY.add_settler(publish_switches)  # after the settings it reads are defined
