"""Weight files and the file-hash memo under hazards: a FIFO or a link where the memo should be, a file
replaced between an encode's stamp check and its hash lookup, every shared tier off (nothing hashed), a
lazy encoder's file moved or deleted before its weights were read. Real ComfyUI loaders on the tiny CLIP
files of tests/test_lazy_clip.py."""

import gc
import os
import sys
import threading
from pathlib import Path

import pytest
import rkharness
import test_lazy_clip
from test_lazy_clip import TEXT, _hashes, _settled_file, count, encode, entries, equal, files

pytestmark = [pytest.mark.conditioning, pytest.mark.hardening]

lazy = test_lazy_clip.lazy  # its fixture: the disk tier on, the memo in a fresh user directory


def _held(st: os.stat_result) -> bool:
    """Whether this process holds the file ``st`` open (by its descriptors, whatever its name now)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.path.samestat(os.stat(f"/proc/self/fd/{fd}"), st):
                return True
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return False


def _load_beside_a_fifo(paths: list, fifo: Path) -> list:
    """The CLIPs of ``paths``, loaded eagerly in a thread that must not hang on ``fifo`` (a FIFO where the memo
    or its lock should be: its open() would wait for a writer that never comes)."""
    loaded = []
    worker = threading.Thread(target=lambda: loaded.extend(files().load(p, lazy=False) for p in paths), daemon=True)
    worker.start()
    worker.join(30)
    try:
        assert not worker.is_alive(), f"the loader hangs on the FIFO at {fifo}"
    finally:
        if worker.is_alive():  # a writer lets its open() return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(30)
    return loaded

# ---- R5: the memo's path holds a FIFO or a link ----------------------------------------------------


def test_a_fifo_at_the_memo_path_never_hangs_a_loader(lazy, monkeypatch):
    """Reading the memo would block in open() for a writer that never comes, holding the memo's lock:
    every loader of every file would hang. The FIFO is ignored as a memo, and the next memo written
    replaces it."""
    monkeypatch.setattr(rkharness.pack("caching.file_hashes").FileHashes, "SETTLE_NS", 0)  # the memo takes it now
    memo = Path(lazy.tiers.TIERS.hashes.memo)
    memo.parent.mkdir(parents=True)
    os.mkfifo(memo)
    path = files().write_tiny_clip_l(str(lazy.files), 0, name="fifo.safetensors")
    (clip,) = _load_beside_a_fifo([path], memo)
    assert equal(encode(clip), files().reference(path, TEXT))
    assert memo.is_file() and not memo.is_symlink()  # written over the FIFO, through no link
    reader = rkharness.pack("caching.file_hashes").FileHashes(inline_bytes=0)
    reader.memo = str(memo)
    assert reader.get(path) == lazy.tiers.TIERS.hashes.get(path) and reader.hashed_bytes == 0


@pytest.mark.parametrize("planted", ["fifo", "link"])
def test_a_fifo_or_a_link_at_the_memos_lock_path_never_hangs_a_loader_nor_is_followed(lazy, monkeypatch, tmp_path,
                                                                                    planted):
    """The memo's merge takes a lock file beside it: opened plainly, a FIFO there blocked the loader in open()
    while it held the memo's lock, so every later loader hung too, and a link there was followed (its target
    made). The lock is opened as the memo is: the loader goes on, its encode is right, the memo is not written
    and the tiers' cards say so; the link's target is never made."""
    monkeypatch.setattr(rkharness.pack("caching.file_hashes").FileHashes, "SETTLE_NS", 0)  # the memo takes it now
    memo = Path(lazy.tiers.TIERS.hashes.memo)
    memo.parent.mkdir(parents=True)
    lock, target = Path(f"{memo}.lock"), tmp_path / "elsewhere"
    os.mkfifo(lock) if planted == "fifo" else os.symlink(target, lock)
    paths = [files().write_tiny_clip_l(str(lazy.files), i, name=f"lock{i}.safetensors") for i in range(2)]
    for path, clip in zip(paths, _load_beside_a_fifo(paths, lock), strict=True):
        assert equal(encode(clip), files().reference(path, TEXT))
    assert not target.exists() and not memo.exists()
    said = [r["reason"] for r in lazy.tiers.TIERS.stats["disk"].reasons()]
    assert any(f"the file-hash memo {memo} cannot be written" in r for r in said), said


def test_a_link_at_the_memo_path_is_never_followed(tmp_path, monkeypatch):
    """A link where the memo should be is not read as the memo (a digest planted elsewhere never
    answers), and the memo written next replaces the link, leaving its target as it was."""
    monkeypatch.setattr(rkharness.pack("caching.file_hashes").FileHashes, "SETTLE_NS", 0)
    path = _settled_file(tmp_path)
    (tmp_path / "other").mkdir()
    elsewhere = _hashes(tmp_path / "other")
    digest = elsewhere.get(path)
    target = Path(elsewhere.memo)
    planted = target.read_text()
    reader = _hashes(tmp_path, inline_bytes=0)
    Path(reader.memo).parent.mkdir()
    os.symlink(target, reader.memo)
    assert reader.get(path) is None  # not taken from the link's target: hashed in the background
    assert reader.wait(10) and reader.get(path) == digest and reader.hashed_bytes == 4096
    assert not Path(reader.memo).is_symlink() and target.read_text() == planted
    assert _hashes(tmp_path, inline_bytes=0).get(path) == digest  # the memo written in the link's place


# ---- R10: a file replaced between the stamp check and the hash lookup ------------------------------

def test_a_file_replaced_between_the_stamp_check_and_the_hash_lookup_is_not_filed_under_its_key(lazy, monkeypatch):
    """The encoder holds the old file's weights; the file at its path is replaced right after the
    encode's stamp check. Looked up by the path, the new file's digest would key the old weights' output:
    a fresh load of the new file would then be answered with it. Looked up by the stamp recorded at load,
    the encode stays in this process."""
    pc = rkharness.pack("patches.conditioning")
    folder = str(lazy.files)
    path = files().write_tiny_clip_l(folder, 0, name="te.safetensors")
    new = files().write_tiny_clip_l(folder, 1, name="new.safetensors")
    old = files().reference(path, TEXT)
    clip = files().load(path, lazy=False)
    assert lazy.tiers.TIERS.hashes.get(path) is not None and lazy.tiers.TIERS.hashes.get(new) is not None
    real, armed = pc._stamps, [True]

    def stamps_then_replace(paths):
        found = real(paths)
        if armed and sys._getframe(1).f_code.co_name == "shared_key":  # its check passed: now another file
            armed.clear()
            os.replace(new, path)
        return found

    monkeypatch.setattr(pc, "_stamps", stamps_then_replace)
    out = encode(clip)
    assert not armed and equal(out, old)
    assert entries(lazy.folder) == []  # under neither file's key
    assert lazy.cc.CACHE.count("not_shared") == 1
    lazy.cc.CACHE.clear()
    fresh = files().load(path, lazy=False)
    replaced = encode(fresh)
    assert equal(replaced, files().reference(path, TEXT)) and not equal(replaced, old)
    assert lazy.tiers.TIERS.stats["disk"].counter("hits") == 0 and len(entries(lazy.folder)) == 1


# ---- R11: every shared tier off --------------------------------------------------------------------

def test_with_every_shared_tier_off_nothing_is_hashed_and_a_tier_turned_on_later_shares_after_the_hash(
        lazy, monkeypatch):
    """No tier would use a digest: a load reads no byte to hash its files. The first encode after a tier
    is turned on asks for the digest (queued: the encode stays in this process, counted); once the file
    is hashed, its encodes are shared."""
    monkeypatch.setattr(rkharness.pack("caching.file_hashes").FileHashes, "SETTLE_NS", 0)
    hashes = lazy.tiers.TIERS.hashes
    lazy.settings.set("conditioning.disk.enabled", False)
    assert not lazy.tiers.TIERS.active
    path = files().write_tiny_clip_l(str(lazy.files), 5)
    read = hashes.hashed_bytes
    clip = files().load(path, lazy=False)
    first = encode(clip)
    assert hashes.wait(10) and hashes.hashed_bytes == read  # not one byte read to hash it
    assert equal(first, files().reference(path, TEXT)) and hashes.hashed_bytes == read
    monkeypatch.setattr(hashes, "inline_bytes", 0)  # hashed in the background, as a checkpoint is
    lazy.settings.set("conditioning.disk.enabled", True)
    assert equal(encode(clip, "a new prompt"), files().reference(path, "a new prompt"))
    assert entries(lazy.folder) == [] and lazy.cc.CACHE.count("not_shared") == 1
    assert hashes.wait(30) and hashes.hashed_bytes == read + os.path.getsize(path)
    shared = encode(clip, "another prompt")
    assert len(entries(lazy.folder)) == 1
    lazy.cc.CACHE.clear()
    assert equal(encode(files().load(path, lazy=False), "another prompt"), shared)
    assert lazy.tiers.TIERS.stats["disk"].counter("hits") == 1 and hashes.hashed_bytes == read + os.path.getsize(path)


# ---- R9: a lazy encoder's file moved or deleted before its weights were read -----------------------

@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_lazy_encoders_file_moved_or_deleted_after_the_build_still_encodes_a_new_prompt(lazy, how):
    """ComfyUI's loader read the weights at load and still encodes; the lazy encoder kept the file it was
    built from open, and reads that very file: bit-identical to an eager encode of it. That encode is
    neither stored nor shared (the move or delete set the file's ctime: its stamp vouches for nothing),
    counted with the reason, and the file is closed once read."""
    path = files().write_tiny_clip_l(str(lazy.files), 0, name="te.safetensors")
    ref, other = files().reference(path, "a new prompt"), files().reference(path, "another prompt")
    st = os.stat(path)
    clip = files().load(path)
    assert lazy.lc.pending(clip.cond_stage_model)
    if how == "deleted":
        os.unlink(path)
    else:
        (lazy.files / "moved").mkdir()
        os.rename(path, lazy.files / "moved" / "te.safetensors")
    out = encode(clip, "a new prompt")
    assert equal(out, ref) and not lazy.lc.pending(clip.cond_stage_model)
    assert count(lazy, "weights_loaded") == 1 and count(lazy, "gone_files_read") == 1
    assert entries(lazy.folder) == [] and not _held(st)
    assert any("moved or deleted" in row["reason"] for row in lazy.cc.CACHE.bypass_reasons())
    assert equal(encode(clip, "a new prompt"), ref)
    assert equal(encode(clip, "another prompt"), other) and count(lazy, "weights_loaded") == 1


def test_a_lazy_encoder_dropped_before_its_weights_were_read_leaves_its_file_closed(lazy):
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    st = os.stat(path)
    clip = files().load(path)
    assert lazy.lc.pending(clip.cond_stage_model) and _held(st)
    del clip
    gc.collect()  # the finalizer only records the files (it may run under any lock)
    rkharness.pack("caching.stats").REGISTRY.snapshot()  # a safe point closes them
    assert not _held(st)
