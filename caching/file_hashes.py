"""Weight files by content: BLAKE2b-256 digests of whole files, remembered by the file's stamp, in this
process and (with a memo file) across restarts.

Pure standard library. The conditioning cache's shared tiers name an encoder by the content of the files
it was loaded from (``caching/tiers.py``); a lazily loaded text encoder (``patches/lazy_clip.py``) needs
that content's digest without reading the file, hence the memo.

- A file's stamp is (real path, size, mtime_ns, inode, ctime_ns): a file rewritten, replaced or renamed
  over has another (the kernel sets the ctime on every change, and no call can set it back). A digest is
  used only for the very stamp it was made for. A caller that stamped a file when it read it (a loader)
  asks by that stamp (``for_stamp``), never by the path: a file replaced since is another file, and its
  digest must never name what was read before.
- Files up to ``inline_bytes`` are hashed at once, larger ones on a background thread (``get`` is None
  meanwhile). A file is read only when the one opened has the stamp asked for, and a file that changed
  while it was read is not remembered.
- The memo (``memo``: a JSON file, ComfyUI's user directory + ``reusekit/file_hashes.json``) holds stamp
  -> digest, written to a temporary file and renamed into place (a reader never sees half of it), at
  most ``MEMO_ENTRIES`` entries, the newest stamp per path. With ``secret`` set (``REUSEKIT_CACHE_SECRET``)
  it is signed (HMAC-SHA256); an unsigned, wrongly signed, malformed or oversized memo is ignored.
- A timestamp has a granularity (a few ms on Linux, 2 s on FAT): a file changed twice within one tick,
  keeping its size, keeps its stamp. So a digest goes into the memo only when the file's mtime and
  ctime were at least ``SETTLE_NS`` older than the start of its reading; a file hashed sooner (just
  written or downloaded) is hashed again once that window has passed, and the memo takes it then, if
  both reads agree (else the stamp is not trusted at all).
- The memo's path is opened as the disk tier opens its entries: never through a link, never blocking (a
  FIFO there would hang every loader holding the memo's lock), read only when it is a regular file; a
  new memo replaces whatever is at the path (a link itself, never its target).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import queue
import stat
import threading
import time
import uuid

log = logging.getLogger("reusekit")

MIB = 1 << 20
FORMAT = "reusekit-file-hashes-1"


class FileHashes:
    """BLAKE2b-256 of whole files by :meth:`stamp`; see the module docstring."""

    SETTLE_NS = 2_000_000_000
    MEMO_ENTRIES = 4096
    MEMO_MAX_BYTES = 8 * MIB

    def __init__(self, inline_bytes: int = 16 * MIB):
        self.inline_bytes = inline_bytes
        self.memo: str | None = None  # the memo file (patches/conditioning.py sets it); None: this process only
        self.secret: bytes | None = None
        self.problem = None  # called with what went wrong with the memo (the tiers count it where the panel shows it)
        self.hashed_bytes = 0  # bytes read to hash files, in all (the tests and the bench read it)
        self._known: dict[tuple, str] = {}
        self._unsettled: set[tuple] = set()  # known, hashed too soon after a change for the memo
        self._pending: set[tuple] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._memo_lock = threading.Lock()
        self._memo_entries: dict[tuple, str] = {}
        self._memo_seen: tuple | None = None  # (memo path, secret, the memo file's stamp) last read

    @staticmethod
    def stamp(path: str) -> tuple | None:
        """(real path, size, mtime_ns, inode, ctime_ns) of a file, or None when it cannot be read."""
        try:
            real = os.path.realpath(path)
            st = os.stat(real)
        except OSError:
            return None
        return (real, *_fields(st))

    @staticmethod
    def stamp_fd(fd: int, real: str) -> tuple:
        """The stamp of the open file ``fd`` under the name ``real`` (whatever that name holds now)."""
        return (real, *_fields(os.fstat(fd)))

    def get(self, path: str) -> str | None:
        """The digest of the file now at ``path`` if known (in this process or the memo, or small enough to
        hash now); else None and hashing is queued."""
        stamp = self.stamp(path)
        return None if stamp is None else self._digest(stamp)

    def for_stamp(self, stamp: tuple | None) -> str | None:
        """The digest of the file that had ``stamp`` (:meth:`stamp`, taken when it was read) as :meth:`get`
        answers, but None when the file no longer has exactly that stamp (replaced, changed, gone)."""
        if stamp is None or self.stamp(stamp[0]) != stamp:
            return None
        return self._digest(stamp)

    def _digest(self, stamp: tuple) -> str | None:
        """The digest for a stamp just taken: known, remembered, hashed now, or None and queued."""
        with self._lock:
            found = self._known.get(stamp)
            if found is not None and stamp in self._unsettled and self._settled(stamp, time.time_ns()):
                self._unsettled.discard(stamp)
                self._queue_hash(stamp)  # once more for the memo, now that a change would show
            if found is not None or stamp in self._pending:
                return found
        found = self._remembered(stamp)
        if found is not None:
            with self._lock:
                self._known.setdefault(stamp, found)
            return found
        with self._lock:
            if stamp in self._pending:
                return None
            if stamp[1] > self.inline_bytes:
                self._queue_hash(stamp)
                return None
        return self._hash(stamp)

    def wait(self, timeout: float = 60.0) -> bool:
        """Wait until no file is waiting to be hashed (tests, the bench); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def _queue_hash(self, stamp: tuple) -> None:
        """Hash ``stamp``'s file on the background thread (under ``_lock``)."""
        self._pending.add(stamp)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="reusekit-file-hash", daemon=True)
            self._thread.start()
        self._queue.put(stamp)

    def _work(self) -> None:
        while True:
            stamp = self._queue.get()
            try:
                self._hash(stamp)
            except Exception as exc:  # an unreadable file: never known, the shared tiers stay off for it
                log.debug("ReuseKit: hashing %s failed: %s", stamp[0], exc)
            finally:
                with self._lock:
                    self._pending.discard(stamp)

    def _settled(self, stamp: tuple, started_ns: int) -> bool:
        """Whether the file's last change (mtime, ctime) is old enough that any later one shows in its stamp."""
        return max(stamp[2], stamp[4]) <= started_ns - self.SETTLE_NS

    def _hash(self, stamp: tuple) -> str | None:
        """The digest of ``stamp``'s file, read only when the file opened has that stamp and remembered only
        when it still has it after the read (None otherwise)."""
        started = time.time_ns()
        h = hashlib.blake2b(digest_size=32)
        buf = bytearray(8 * MIB)
        view = memoryview(buf)
        try:
            with open(stamp[0], "rb") as f:
                if self.stamp_fd(f.fileno(), stamp[0]) != stamp:  # another file by now: not read
                    return None
                while n := f.readinto(buf):
                    h.update(view[:n])
                    self.hashed_bytes += n
        except OSError:
            return None
        if self.stamp(stamp[0]) != stamp:  # changed while we read it: not remembered
            return None
        digest = h.hexdigest()
        settled = self._settled(stamp, started)
        with self._lock:
            before = self._known.get(stamp)
            if before is not None and before != digest:  # two contents under one stamp: trust neither
                del self._known[stamp]
                self._unsettled.discard(stamp)
                log.warning("ReuseKit: %s changed without changing its size or times; it stays out of the "
                            "shared tiers until it changes again", stamp[0])
                return None
            self._known[stamp] = digest
            if not settled:
                self._unsettled.add(stamp)
        if settled:
            self._remember(stamp, digest)
        return digest

    # ---- the memo file -------------------------------------------------------------------------

    def _signature(self, entries: list) -> str | None:
        if not self.secret:
            return None
        text = json.dumps(entries, separators=(",", ":")).encode()
        return hmac.new(self.secret, text, hashlib.sha256).hexdigest()

    def _read_memo(self, fresh: bool = False) -> dict[tuple, str]:
        """The memo's entries (under ``_memo_lock``), read again only when the file changed, or ``fresh``: a
        stamp can miss another process's rewrite (its inode reused, the same size, within one tick of the
        file system's clock), which a merge must never drop."""
        path = self.memo
        if not path:
            return {}
        seen = (path, self.secret, _memo_stamp(path))
        if seen == self._memo_seen and not fresh:
            return self._memo_entries
        entries: dict[tuple, str] = {}
        try:
            data = _read_memo_file(path, self.MEMO_MAX_BYTES + 1)
            if len(data) > self.MEMO_MAX_BYTES:
                raise ValueError("oversized")
            memo = json.loads(data)
            rows = memo["entries"]
            if memo.get("format") != FORMAT or not isinstance(rows, list):
                raise ValueError(f"format {memo.get('format')!r}")
            signature = self._signature(rows)
            if signature is not None and not hmac.compare_digest(signature, str(memo.get("hmac"))):
                raise ValueError("unsigned or wrongly signed")
            for row in rows:
                real, size, mtime, inode, ctime, digest = row
                if not (isinstance(real, str) and isinstance(digest, str) and len(digest) == 64
                        and all(type(v) is int for v in (size, mtime, inode, ctime))):
                    raise ValueError(f"entry {row!r}")
                entries[(real, size, mtime, inode, ctime)] = digest
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # a memo that cannot be trusted: none
            log.debug("ReuseKit: file-hash memo %s ignored (%s)", path, exc)
            entries = {}
            if self.problem is not None and seen != self._memo_seen:  # (once per change of the file: the stamp
                # is remembered below)
                self.problem(f"the file-hash memo {path} cannot be trusted and is passed over "
                             f"({type(exc).__name__}: {str(exc)[:160]}): its files are hashed again")
        self._memo_entries, self._memo_seen = entries, seen
        return entries

    def _remembered(self, stamp: tuple) -> str | None:
        with self._memo_lock:
            return self._read_memo().get(stamp)

    def _remember(self, stamp: tuple, digest: str) -> None:
        """Add an entry to the memo: read it again (other processes write it too), merge, keep the newest
        stamp per path and at most ``MEMO_ENTRIES``, write a temporary file and rename it into place."""
        path = self.memo
        if not path:
            return
        with self._memo_lock:
            folder = os.path.dirname(path) or "."
            tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
            try:
                os.makedirs(folder, exist_ok=True)
                with file_lock(path):  # another process merging its own meanwhile would drop ours, or we its
                    entries = {k: v for k, v in self._read_memo(fresh=True).items() if k[0] != stamp[0]}
                    entries[stamp] = digest
                    rows = [[*k, v] for k, v in list(entries.items())[-self.MEMO_ENTRIES:]]
                    memo = {"format": FORMAT, "entries": rows}
                    signature = self._signature(rows)
                    if signature is not None:
                        memo["hmac"] = signature
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                                 | getattr(os, "O_BINARY", 0), 0o600)
                    with open(fd, "w", encoding="utf-8") as f:
                        json.dump(memo, f, separators=(",", ":"))
                    os.replace(tmp, path)  # whatever is at the path (a FIFO, a link) is replaced, never followed
            except OSError as exc:  # a read-only user directory: the memo stays as it was
                log.debug("ReuseKit: file-hash memo %s not written (%s)", path, exc)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if self.problem is not None:
                    self.problem(f"the file-hash memo {path} cannot be written ({type(exc).__name__}: "
                                 f"{exc.strerror or exc}): a file hashed in the background is hashed again at each start")
                return
            self._memo_entries = {tuple(r[:5]): r[5] for r in rows}
            self._memo_seen = (path, self.secret, _memo_stamp(path))
            sweep_temporaries(folder, f".{os.path.basename(path)}.", ".tmp")


STALE_TMP_S = 3600.0  # a temporary file this old belongs to no live write


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
    """Held around a read-merge-replace of the file at ``path`` (by a ``.lock`` file beside it): another
    process's doing the same waits (POSIX's flock, Windows' byte lock; elsewhere none). The lock file is opened
    as the memo is: never through a link, never blocking on a FIFO (which hung every loader), 0600, and only
    when it is a regular file. OSError where it cannot be made."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    try:
        import msvcrt
    except ImportError:
        msvcrt = None
    if fcntl is None and msvcrt is None:
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(f"{os.fspath(path)}.lock", flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", f"{os.fspath(path)}.lock")
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            while True:  # its first byte (a lock may lie past the end); Windows frees it when its process ends
                os.lseek(fd, 0, os.SEEK_SET)
                try:
                    msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    time.sleep(0.01)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)


def sweep_temporaries(folder: str, prefix: str, suffix: str) -> None:
    """Remove ``prefix*suffix`` files in ``folder`` older than an hour: what a writer killed between its
    temporary file and the rename left (never read: the names are not the file's)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith(prefix) and entry.name.endswith(suffix):
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)


def _fields(st: os.stat_result) -> tuple:
    """A stamp's fields after the path: (size, mtime_ns, inode, ctime_ns)."""
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _memo_stamp(path: str) -> tuple | None:
    """What is at the memo's path itself (a link is not followed), or None."""
    try:
        return _fields(os.lstat(path))
    except OSError:
        return None


def _read_memo_file(path: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of the memo, opened as the disk tier opens an entry: never through a link,
    never blocking (a FIFO), read only when it is a regular file (ValueError otherwise)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the memo should be
            raise ValueError("a link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return f.read(limit)
