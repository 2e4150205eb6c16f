"""Lazy text encoders (patches/lazy_clip.py, ReuseKit Lazy CLIP Loader): built from the file's header by
ComfyUI's own load_clip, keyed as an eager load, the weights read only on an encode that misses every tier;
the file-hash memo that lets a restarted process know a file's content without reading it."""

import json
import os
import threading
import time
import types
from importlib import import_module
from pathlib import Path

import pytest
import rkharness
import torch
from safetensors.torch import load_file
from test_conditioning_tiers import published

pytestmark = pytest.mark.conditioning

TEXT = "a red circle on a blue square"


def files():
    return import_module(rkharness.TINY.__name__ + ".lazy_clip")


def loras():
    return import_module(rkharness.TINY.__name__ + ".conditioning")


@pytest.fixture
def lazy(tmp_path, monkeypatch):
    """Global mode on, an empty LRU, the disk tier on in a fresh folder, the file-hash memo in a fresh
    user directory, zeroed lazy-encoder counters; everything put back after."""
    cc = rkharness.pack("caching.conditioning")
    tiers = rkharness.pack("caching.tiers")
    lc = rkharness.pack("patches.lazy_clip")
    settings = rkharness.pack("caching.settings").SETTINGS
    rkharness.pack("patches.conditioning").install()
    keys = ("conditioning.enabled", "conditioning.disk.enabled", "conditioning.disk.folder",
            "conditioning.redis.enabled", "conditioning.redis.url", lc.SETTING)
    saved = {k: settings.get(k) for k in keys}
    monkeypatch.setattr(tiers.TIERS.hashes, "memo", str(tmp_path / "user" / "reusekit" / "file_hashes.json"))
    settings.update({"conditioning.enabled": True, "conditioning.disk.enabled": True,
                     "conditioning.disk.folder": str(tmp_path / "disk"), "conditioning.redis.enabled": False,
                     lc.SETTING: False}, trusted=True)
    cc.CACHE.clear()
    cc.CACHE.reset_counts()
    lc.STATS.reset_counters()
    for stats in tiers.TIERS.stats.values():
        stats.reset_counters()
    yield type("Lazy", (), {"cc": cc, "tiers": tiers, "lc": lc, "settings": settings, "folder": tmp_path / "disk",
                            "files": tmp_path})
    settings.update(saved, trusted=True)
    tiers.TIERS.configure(settings)
    cc.CACHE.clear()


def encode(clip, text=TEXT):
    """Encode, and wait for the publication of what missed."""
    out = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
    published()
    return out


def equal(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def count(lazy, name):
    return lazy.lc.STATS.counter(name)


def entries(folder: Path):
    published()
    return sorted(folder.rglob("*.rkcond"))


# ---- the file-hash memo ----------------------------------------------------------------------------

def _hashes(tmp_path, **kw):
    made = rkharness.pack("caching.file_hashes").FileHashes(**kw)
    made.memo = str(tmp_path / "memo" / "file_hashes.json")
    return made


def _settled_file(tmp_path, name="w.bin", data=None) -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(4096) if data is None else data)
    return str(path)


def test_the_memo_gives_a_restarted_process_the_digest_without_reading_the_file(tmp_path, monkeypatch):
    fh = rkharness.pack("caching.file_hashes")
    monkeypatch.setattr(fh.FileHashes, "SETTLE_NS", 0)
    path = _settled_file(tmp_path)
    first = _hashes(tmp_path)
    digest = first.get(path)
    assert digest is not None and first.hashed_bytes == 4096
    again = _hashes(tmp_path, inline_bytes=0)  # another process: every file would go to the background thread
    assert again.get(path) == digest and again.hashed_bytes == 0
    memo = json.loads(Path(first.memo).read_text())
    assert memo["format"] == fh.FORMAT and [row[0] for row in memo["entries"]] == [os.path.realpath(path)]
    assert not [p for p in Path(first.memo).parent.iterdir() if p.name.endswith(".tmp")]  # renamed into place


WINDOWS_LOCKS = """import fcntl, sys, types
def locking(fd, mode, n):  # Windows' msvcrt.locking, as a byte lock here: LK_NBLCK raises where it is held
    fcntl.lockf(fd, fcntl.LOCK_UN if mode == 0 else fcntl.LOCK_EX | fcntl.LOCK_NB, n, 0, 1)
sys.modules["msvcrt"] = types.SimpleNamespace(locking=locking, LK_UNLCK=0, LK_NBLCK=2)
sys.modules["fcntl"] = None  # as on Windows: no flock
"""


@pytest.mark.parametrize("system", ["posix", "windows"])
def test_processes_hashing_at_once_keep_every_digest_in_the_shared_memo(tmp_path, system):
    """Two ComfyUI processes sharing a user directory hash their files at once: each read the memo, merged its
    digest and replaced the file with no lock between them, so the last writer dropped the other's (48 of 120
    lost, hashed again at the next start, a T5 loading eagerly until then). Each merge now holds the memo's
    lock, on Windows too (its msvcrt byte lock, imitated here over POSIX byte locks with fcntl's flock gone):
    every digest is kept, and a third process hashes nothing."""
    import subprocess
    import sys

    files = [_settled_file(tmp_path, f"w{i}.bin") for i in range(60)]
    memo = tmp_path / "memo" / "file_hashes.json"
    start = time.time() + 3  # both begin together, past their imports
    child = ((WINDOWS_LOCKS if system == "windows" else "")
             + "import sys, time; sys.path.insert(0, {links!r}); from reusekit.caching.file_hashes import FileHashes\n"
             "FileHashes.SETTLE_NS = 0; h = FileHashes(); h.memo = {memo!r}\n"
             "time.sleep(max(0.0, {start!r} - time.time()))\n"
             "assert all(h.get(f) is not None for f in {files!r})")
    procs = [subprocess.Popen([sys.executable, "-c", child.format(links=str(rkharness._package_links()), memo=str(memo),
                                                                  start=start, files=files[k::2])])
             for k in range(2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    kept = {row[0] for row in json.loads(memo.read_text())["entries"]}
    assert kept == {os.path.realpath(f) for f in files}
    third = _hashes(tmp_path, inline_bytes=0)  # the next start
    assert all(third.get(f) is not None for f in files) and third.hashed_bytes == 0


def test_a_changed_file_is_never_taken_for_the_old_one(tmp_path, monkeypatch):
    """The same size and even the same mtime (set back): the ctime and inode differ, so the memo's entry
    does not apply; the file is hashed again."""
    fh = rkharness.pack("caching.file_hashes")
    monkeypatch.setattr(fh.FileHashes, "SETTLE_NS", 0)
    path = _settled_file(tmp_path)
    old = _hashes(tmp_path).get(path)
    st = os.stat(path)
    time.sleep(0.01)
    with open(path, "r+b") as f:
        f.write(b"\x00" * 16)  # in place: same inode and size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    replaced = tmp_path / "new.bin"
    replaced.write_bytes(os.urandom(4096))
    fresh = _hashes(tmp_path, inline_bytes=0)
    assert fresh.get(path) is None and fresh.wait(10)  # not in the memo: hashed in the background
    assert fresh.get(path) not in (None, old)
    os.replace(replaced, path)  # replaced by another file: another inode
    later = _hashes(tmp_path, inline_bytes=0)
    assert later.get(path) is None


def test_a_file_hashed_right_after_a_change_enters_the_memo_only_after_a_second_read(tmp_path, monkeypatch):
    fh = rkharness.pack("caching.file_hashes")
    path = _settled_file(tmp_path)
    first = _hashes(tmp_path)
    digest = first.get(path)  # written just now: the stamp may not show a change within its tick yet
    assert digest is not None and not Path(first.memo).exists()
    monkeypatch.setattr(fh.FileHashes, "SETTLE_NS", 0)  # as if the window had passed
    assert first.get(path) == digest and first.wait(10)
    assert first.hashed_bytes == 2 * 4096 and Path(first.memo).exists()
    assert _hashes(tmp_path, inline_bytes=0).get(path) == digest


def test_a_memo_that_cannot_be_trusted_is_ignored(tmp_path, monkeypatch):
    fh = rkharness.pack("caching.file_hashes")
    monkeypatch.setattr(fh.FileHashes, "SETTLE_NS", 0)
    path = _settled_file(tmp_path)
    signed = _hashes(tmp_path)
    signed.secret = b"k1"
    digest = signed.get(path)
    memo = Path(signed.memo)
    good = memo.read_text()

    def read(text, secret):
        """What a fresh process with ``secret`` knows of the file from the memo ``text`` (a miss queues
        the file's hash, which writes the memo again: waited for, then the next case writes its own)."""
        memo.write_text(text)
        reader = _hashes(tmp_path, inline_bytes=0)
        reader.secret = secret
        found = reader.get(path)
        assert reader.wait(10)
        return found

    assert read(good, b"k1") == digest
    assert read(good, None) == digest  # a signed memo read without the secret is just a memo
    assert read(good, b"k2") is None  # the wrong key
    planted = json.loads(good)
    planted["entries"][0][5] = "0" * 64
    assert read(json.dumps(planted), b"k1") is None
    unsigned = json.loads(good)
    del unsigned["hmac"]
    assert read(json.dumps(unsigned), b"k1") is None
    for junk in ("{", json.dumps({"format": "other", "entries": []}), json.dumps({"format": fh.FORMAT, "entries": [[1]]}),
                 json.dumps({"format": fh.FORMAT, "entries": [[path, 1, 2, 3, 4, "x" * 64], "tail"]}),
                 "[" * 100_000 + "]" * 100_000):  # nested past the JSON parser's recursion: a RecursionError
        assert read(junk, None) is None


# ---- building from the header ------------------------------------------------------------------------

def test_the_header_state_dict_holds_no_weights(tmp_path):
    lc = rkharness.pack("patches.lazy_clip")
    path = files().write_tiny_clip_l(str(tmp_path), 0)
    full = load_file(path)
    sd, metadata, read = lc.read_header(path)
    assert sorted(sd) == sorted(full)
    assert all(sd[k].shape == full[k].shape and sd[k].dtype == full[k].dtype for k in full)
    small = {k for k, t in full.items() if t.numel() <= lc.SMALL_NUMEL}
    assert all(sd[k].is_meta for k in full if k not in small)
    assert all(torch.equal(sd[k], full[k]) for k in small)  # scalars and tiny vectors are read for real
    size = os.path.getsize(path)
    assert read < size / 50, (read, size)


def test_the_header_reads_every_float8_layout_comfyui_quantizes_with(tmp_path):
    """mxfp8 keeps its block scales as F8_E8M0: a header the lazy loader could not read loaded the encoder
    eagerly, every weight read at start-up."""
    from safetensors.torch import save_file
    lc = rkharness.pack("patches.lazy_clip")
    full = {f"w.{dtype}.{n}": torch.linspace(0.25, 8.0, n).to(dtype) for n in (8, 4096)
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)}
    path = str(tmp_path / "mx.safetensors")
    save_file(full, path)
    sd, _, _ = lc.read_header(path)
    assert sorted(sd) == sorted(full)
    for k, t in full.items():
        assert sd[k].dtype == t.dtype and sd[k].shape == t.shape, k
        assert sd[k].is_meta if t.numel() > lc.SMALL_NUMEL else torch.equal(sd[k].view(torch.uint8), t.view(torch.uint8))


def test_a_lazy_clip_answers_a_prompt_seen_before_without_its_weights(lazy):
    """An eager load wrote the entry; a lazy CLIP of the same file (a restarted process: the LRU is
    empty) answers from the disk tier, bit-identical, and holds no weights afterwards."""
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    ref = files().reference(path, TEXT)
    assert equal(encode(files().load(path, lazy=False)), ref)
    assert lazy.cc.CACHE.count("encodes") == 1 and len(entries(lazy.folder)) == 1
    lazy.cc.CACHE.clear()
    clip = files().load(path)
    before = files().probe(clip, path)
    assert before["pending"] and before["stored_bytes"] <= 64 and before["stored"] <= 2, before  # logit_scale
    out = encode(clip)
    after = files().probe(clip, path)
    before.pop("hashed_bytes"), after.pop("hashed_bytes")  # this process's, other tests' files included
    assert equal(out, ref) and after == before and not after["mapped"]
    assert lazy.cc.CACHE.count("encodes") == 1 and lazy.tiers.TIERS.stats["disk"].counter("hits") == 1
    size = os.path.getsize(path)
    assert count(lazy, "lazy_encoders") == 1 and count(lazy, "weights_loaded") == 0
    assert count(lazy, "encodes_without_weights") == 1 and count(lazy, "loads_avoided") == 1
    assert count(lazy, "not_read_bytes") == size and 0 < count(lazy, "header_read_bytes") < size / 50


def test_a_fleet_worker_answers_from_the_redis_tier_without_its_weights(lazy):
    """Redis only (another host's worker wrote the entry): a lazy CLIP answers without its weights."""
    from test_conditioning_tiers import redis_server

    path = files().write_tiny_clip_l(str(lazy.files), 0)
    with redis_server() as server:
        lazy.settings.update({"conditioning.disk.enabled": False, "conditioning.redis.enabled": True,
                              "conditioning.redis.url": server.url}, trusted=True)
        ref = files().reference(path, TEXT)
        assert equal(encode(files().load(path, lazy=False)), ref)
        assert lazy.tiers.TIERS.redis.flush(10) and server.client.keys("reusekit:cond:*")
        lazy.cc.CACHE.clear()
        clip = files().load(path)
        assert equal(encode(clip), ref) and lazy.lc.pending(clip.cond_stage_model)
        assert lazy.tiers.TIERS.stats["redis"].counter("hits") == 1 and count(lazy, "weights_loaded") == 0


def test_a_new_prompt_loads_the_weights_once_in_place_and_clones_see_them(lazy):
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    clip = files().load(path)
    clone = clip.clone()  # made before the load, as a LoraLoader's is
    out = encode(clip, "a new prompt")
    assert not lazy.lc.pending(clip.cond_stage_model) and count(lazy, "weights_loaded") == 1
    assert clone.cond_stage_model is clip.cond_stage_model
    assert equal(out, files().reference(path, "a new prompt"))
    out2 = encode(clone, "another new prompt")
    assert count(lazy, "weights_loaded") == 1 and lazy.cc.CACHE.count("encodes") == 2
    assert equal(out2, files().reference(path, "another new prompt"))
    eager = files().load(path, lazy=False).cond_stage_model.state_dict()
    mine = clip.cond_stage_model.state_dict()
    assert sorted(mine) == sorted(eager) and all(torch.equal(mine[k], eager[k]) for k in eager)
    assert not any(t.is_meta for t in mine.values())
    assert count(lazy, "loads_avoided") == 0 and count(lazy, "not_read_bytes") == 0


def test_a_dual_encoder_flux_clip_l_and_t5_is_lazy_too(lazy):
    """DualCLIPLoader's path with ComfyUI's Flux CLIP-L + T5-XXL classes (tiny sizes): both files' headers
    only; a prompt seen before is a hit without weights, a new one loads both, bit-identical."""
    paths = [files().write_tiny_clip_l(str(lazy.files), 0), files().write_tiny_t5(str(lazy.files), 3)]
    ref = files().reference(paths, TEXT, clip_type="flux")
    assert equal(encode(files().load(paths, lazy=False, clip_type="flux")), ref)
    lazy.cc.CACHE.clear()
    clip = files().load(paths, clip_type="flux")
    assert equal(encode(clip), ref) and lazy.lc.pending(clip.cond_stage_model)
    assert count(lazy, "not_read_bytes") == sum(os.path.getsize(p) for p in paths)
    new = encode(clip, "a new prompt")
    assert not lazy.lc.pending(clip.cond_stage_model) and count(lazy, "weights_loaded") == 1
    assert equal(new, files().reference(paths, "a new prompt", clip_type="flux"))


def test_an_llm_encoder_qwen_image_with_its_vision_tower_is_lazy_too(lazy):
    """CLIPLoader's qwen_image type on a Qwen2.5-VL 7B file (ComfyUI's own classes at a test width): a
    prompt seen before, with an image in it, is answered without reading one weight, bit-identical to
    ComfyUI's eager load; a new prompt loads the weights once."""
    te = import_module(rkharness.TINY.__name__ + ".text_encoders")
    from test_conditioning import image, same

    picture = image(2, size=56)

    def edit(clip, text=TEXT):
        return clip.encode_from_tokens(clip.tokenize(text, images=[picture]), return_pooled=True)

    with te.tiny_sizes(llm=te.QWEN25_7B_FILE):
        path = te.write_qwen25_7b(str(lazy.files / "qwen_2.5_vl_7b.safetensors"))
        lazy.tiers.TIERS.hashes.get(path)
        assert lazy.tiers.TIERS.hashes.wait() and lazy.tiers.TIERS.hashes.get(path) is not None
        eager = files().load(path, lazy=False, clip_type="qwen_image")
        ref = edit(eager)
        assert lazy.cc.CACHE.count("encodes") == 1 and len(entries(lazy.folder)) == 1
        lazy.cc.CACHE.clear()
        clip = files().load(path, clip_type="qwen_image")
        before = files().probe(clip, path)
        assert before["pending"] and before["stored_bytes"] <= 64, before
        out = edit(clip)
        after = files().probe(clip, path)
        assert same(out, ref) and after["stored_bytes"] == before["stored_bytes"] and not after["mapped"]
        assert lazy.cc.CACHE.count("encodes") == 1 and count(lazy, "weights_loaded") == 0
        assert count(lazy, "not_read_bytes") == os.path.getsize(path)
        new = edit(clip, "a new prompt")
        assert not lazy.lc.pending(clip.cond_stage_model) and count(lazy, "weights_loaded") == 1
        assert same(new, edit(eager, "a new prompt"))


def test_a_lora_on_a_lazy_clip_is_keyed_by_its_content(lazy):
    """The LoRA's tensors are not the CLIP's weights: the key holds them by content and strength, so a
    LoRA'd prompt seen before needs no weights either; another strength loads them, and ComfyUI applies
    the patches at load as usual."""
    import comfy.sd
    import comfy.utils

    path = files().write_tiny_clip_l(str(lazy.files), 0)
    name = loras().write_lora("rk_lazy_lora.safetensors", seed=4, width=rkharness.TINY.TEXT_DIM, flux=False)
    lora = comfy.utils.load_torch_file(os.path.join(loras().lora_dir(), name))

    def with_lora(clip, strength):
        return comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1]

    ref = files().reference(path, TEXT, lora, 1.0)
    assert not equal(ref, files().reference(path, TEXT))
    assert equal(encode(with_lora(files().load(path, lazy=False), 1.0)), ref)
    lazy.cc.CACHE.clear()
    base = files().load(path)
    assert equal(encode(with_lora(base, 1.0)), ref)
    assert lazy.lc.pending(base.cond_stage_model) and count(lazy, "encodes_without_weights") == 1
    half = encode(with_lora(base, 0.5))
    assert not lazy.lc.pending(base.cond_stage_model) and count(lazy, "weights_loaded") == 1
    assert equal(half, files().reference(path, TEXT, lora, 0.5))
    assert equal(encode(base, "plain"), files().reference(path, "plain"))  # the patches stay on the clone


def test_a_changed_file_loads_and_encodes_as_today(lazy):
    """The file is replaced (same name, new weights) after the lazy CLIP was built: its encode of a prompt
    the old file answered is the new file's, nothing of it is stored or shared, and the encoder leaves
    the shared tiers; a CLIP built from the new file keys it by its new content."""
    folder = str(lazy.files)
    path = files().write_tiny_clip_l(folder, 0, name="te.safetensors")
    old = encode(files().load(path, lazy=False))
    lazy.cc.CACHE.clear()
    clip = files().load(path)
    time.sleep(0.01)
    files().write_tiny_clip_l(folder, 1, name="te.safetensors", overwrite=True)
    ref = files().reference(path, TEXT)
    written = len(entries(lazy.folder))
    out = encode(clip)
    assert equal(out, ref) and not equal(out, old)
    assert lazy.tiers.TIERS.stats["disk"].counter("hits") == 0 and len(entries(lazy.folder)) == written
    assert len(lazy.cc.CACHE) == 0 and count(lazy, "weights_loaded") == 1
    assert equal(encode(clip), ref)  # in this process only, from now on
    assert len(entries(lazy.folder)) == written
    lazy.cc.CACHE.clear()
    fresh = files().load(path)
    assert equal(encode(fresh), ref) and len(entries(lazy.folder)) == written + 1
    lazy.cc.CACHE.clear()
    again = files().load(path)
    assert equal(encode(again), ref) and lazy.lc.pending(again.cond_stage_model)


def test_a_file_whose_hash_is_not_known_yet_loads_as_today(lazy):
    hashes = lazy.tiers.TIERS.hashes
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    saved = hashes.inline_bytes
    hashes.inline_bytes = 0  # a large file: hashed on the background thread
    gate = threading.Event()
    real = hashes._hash
    hashes._hash = lambda stamp: gate.wait(30) and real(stamp)
    try:
        clip = files().load(path)
        assert not lazy.lc.pending(clip.cond_stage_model)
        assert count(lazy, "eager_loads") == 1 and count(lazy, "eager.hash_unknown") == 1
        assert equal(encode(clip), files().reference(path, TEXT))
        gate.set()
        assert hashes.wait(30)
        assert lazy.lc.pending(files().load(path).cond_stage_model)
    finally:
        gate.set()
        del hashes._hash
        hashes.inline_bytes = saved


def test_without_a_shared_tier_it_loads_as_today(lazy):
    lazy.settings.set("conditioning.disk.enabled", False)
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    clip = files().load(path)
    assert not lazy.lc.pending(clip.cond_stage_model) and count(lazy, "eager.no_shared_tier") == 1
    assert [(r["event"], r["reason"]) for r in lazy.lc.STATS.reasons()] == [
        ("bypass", "a text encoder loaded its weights at once: no shared tier is on, so no encode could be answered "
                   "without the weights")]  # where the panel shows it, not a counter alone
    assert equal(encode(clip), files().reference(path, TEXT))


def test_whatever_else_needs_the_weights_reads_them_first(lazy):
    """ComfyUI's CLIP methods that read weights (get_sd, get_key_patches) and its model manager loading
    the patcher (a hook-scheduled encode, a custom node's load_models_gpu) find them loaded."""
    import comfy.model_management

    path = files().write_tiny_clip_l(str(lazy.files), 0)
    eager = files().load(path, lazy=False).get_sd()
    for use in (lambda c: c.get_sd(), lambda c: c.get_key_patches(),
                lambda c: comfy.model_management.load_models_gpu([c.patcher])):
        clip = files().load(path)
        use(clip)
        assert not lazy.lc.pending(clip.cond_stage_model)
        sd = clip.get_sd()
        assert all(torch.equal(sd[k], eager[k]) for k in eager)
    assert count(lazy, "weights_loaded") == 3


@pytest.mark.parametrize("load", ["load_model", "load_models_gpu"])
def test_a_lazy_clip_loaded_by_the_model_manager_keeps_its_object_patches_and_unloads(lazy, load):
    """ComfyUI's model manager reads a lazy encoder's weights first (CLIPSave's ``load_model``, a node's
    ``load_models_gpu``, which patches the module before it loads): the object patches its patcher set stay
    in force, and unloading puts the module back as it was (ComfyUI 0.33 deletes an attribute that was
    unset, such as the ``manual_cast_dtype`` it patches onto every CLIP); its encodes before and after the
    unload are those of an eagerly loaded CLIP with the same patch."""
    import comfy.model_management

    path = files().write_tiny_clip_l(str(lazy.files), 0)

    def run(lazily):
        clip = files().load(path, lazy=lazily)
        clip.patcher.add_object_patch("clip_l.enable_attention_masks", True)
        clip.load_model() if load == "load_model" else comfy.model_management.load_models_gpu([clip.patcher])
        assert not lazy.lc.pending(clip.cond_stage_model)
        first = encode(clip, "a new prompt")
        comfy.model_management.unload_all_models()
        return first, encode(clip, "another new prompt")

    lazy_outputs = run(True)
    lazy.cc.CACHE.clear()
    lazy.settings.set("conditioning.disk.enabled", False)  # the eager CLIP computes too
    eager_outputs = run(False)
    assert all(equal(a, b) for a, b in zip(lazy_outputs, eager_outputs, strict=True))
    assert not equal(eager_outputs[0], files().reference(path, "a new prompt"))  # the patch is in force


def test_a_hook_scheduled_encode_of_a_lazy_clip_keeps_its_clip_skip(lazy):
    """CLIPSetLastLayer then SetClipHooks with the CLIP scheduled: ComfyUI encodes it itself, setting the
    clip skip on the module before it loads it; a lazy encoder reads its weights before that, so its
    encode is the eager one's."""
    import comfy.hooks
    import comfy.model_management
    import comfy.utils

    import nodes

    rkharness.load_extra_nodes()
    from comfy_extras.nodes_hooks import SetClipHooks

    path = files().write_tiny_clip_l(str(lazy.files), 0)
    name = loras().write_lora("rk_lazy_lora.safetensors", seed=4, width=rkharness.TINY.TEXT_DIM, flux=False)
    lora = comfy.utils.load_torch_file(os.path.join(loras().lora_dir(), name))

    def scheduled(clip, layer):
        (clip,) = nodes.CLIPSetLastLayer().set_last_layer(clip, layer)
        hooks = comfy.hooks.create_hook_lora(lora, strength_model=1.0, strength_clip=1.0)
        (clip,) = SetClipHooks().apply_hooks(clip, schedule_clip=True, apply_to_conds=False, hooks=hooks)
        out = nodes.CLIPTextEncode().encode(clip, TEXT)[0][0][0]
        comfy.model_management.unload_all_models()
        return out

    lazy_out = scheduled(files().load(path), -2)
    eager_out = scheduled(files().load(path, lazy=False), -2)
    assert torch.equal(lazy_out, eager_out)
    assert not torch.equal(eager_out, scheduled(files().load(path, lazy=False), -1))  # the clip skip is in force
    assert count(lazy, "weights_loaded") == 1


def _halved_forward(self, *args, **kwargs):  # a node's wrapper of a child's forward
    return tuple(o * 0.5 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                 for o in type(self).forward(self, *args, **kwargs))


def test_settings_a_node_set_on_a_lazy_encoder_before_its_weights_are_read_stay_on_it(lazy):
    """A node's settings on the encoder's modules before the first encode (plain attributes set anew or added, a
    method bound to a child) are kept when the weights are read: the loaded state replaced them all,
    so the encode ran without them (0.76 off the eager encoder's) and was stored, and shared, under the key
    that holds them."""
    path = files().write_tiny_clip_l(str(lazy.files), 0)

    def set_on(clip):
        clip.clip_layer(-2)
        model = clip.cond_stage_model.clip_l
        model.layer_norm_hidden_state = False
        model.rk_note = "set by a node"
        model.options_default = (*model.options_default[:-1], False)
        transformer = model.transformer  # bound to the child: it must be the loaded one after the load
        transformer.forward = types.MethodType(_halved_forward, transformer)
        return model

    with torch.inference_mode():
        eager = files().load(path, lazy=False)
        set_on(eager)
        lazy.settings.set("conditioning.enabled", False)
        truth = eager.encode_from_tokens(eager.tokenize(TEXT), return_pooled=True)
        lazy.settings.set("conditioning.enabled", True)
        clip = files().load(path)
        model = set_on(clip)
        assert lazy.lc.pending(clip.cond_stage_model)
        assert equal(encode(clip), truth) and count(lazy, "weights_loaded") == 1
        assert model.layer_norm_hidden_state is False and model.rk_note == "set by a node"
        assert not equal(truth, files().reference(path, TEXT))  # the settings are in force
        lazy.cc.CACHE.clear()  # another worker's eager encoder with the same settings: the disk tier's entry
        other = files().load(path, lazy=False)
        set_on(other)
        assert equal(encode(other), truth) and lazy.tiers.TIERS.stats["disk"].counter("hits") == 1


def test_a_lazy_encoder_the_loader_cannot_record_loads_now_and_says_why(lazy, monkeypatch):
    """A file that changes right after the lazy build (before the loader records it), and a host whose
    seams the lazy loading does not fit: the encoder loads as CLIPLoader loads it, counted with the reason."""
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    build = lazy.lc.build

    def build_then_touch(*args, **kwargs):
        clip = build(*args, **kwargs)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        return clip

    monkeypatch.setattr(lazy.lc, "build", build_then_touch)
    clip = files().load(path)
    assert not lazy.lc.pending(clip.cond_stage_model)
    assert count(lazy, "eager.changed") == 1 and count(lazy, "lazy_encoders") == 0
    assert equal(encode(clip), files().reference(path, TEXT))
    monkeypatch.setattr(lazy.lc, "build", build)
    monkeypatch.setattr(lazy.lc, "_active", False)  # as when the host's functions are not the ones it wraps
    clip = files().load(path)
    assert not lazy.lc.pending(clip.cond_stage_model) and count(lazy, "eager.host_seams_differ") == 1
    assert count(lazy, "eager_loads") == 2
    lazy.settings.set(lazy.lc.SETTING, True)  # every CLIP loader asked to be lazy, not only the node
    try:
        clip = files().load(path, lazy=False)
    finally:
        lazy.settings.set(lazy.lc.SETTING, False)
    assert count(lazy, "eager.host_seams_differ") == 2 and equal(encode(clip), files().reference(path, TEXT))


def test_weights_replaced_before_they_were_read_are_refused_with_a_clear_error(lazy):
    path = files().write_tiny_clip_l(str(lazy.files), 0)
    clip = files().load(path)
    layer = clip.cond_stage_model.clip_l.transformer.text_model.final_layer_norm
    layer.weight = torch.nn.Parameter(torch.ones_like(layer.weight, device="cpu"))
    with pytest.raises(RuntimeError, match="ReuseKit Lazy CLIP Loader"):
        encode(clip)
    assert lazy.cc.CACHE.count("bypasses") >= 1


def test_the_stock_loaders_are_lazy_only_when_asked(lazy):
    import comfy.sd

    path = files().write_tiny_clip_l(str(lazy.files), 0)
    opts = files().tiny_options
    assert not lazy.lc.pending(comfy.sd.load_clip([path], model_options=opts()).cond_stage_model)
    lazy.settings.set(lazy.lc.SETTING, True)
    clip = comfy.sd.load_clip([path], model_options=opts())
    assert lazy.lc.pending(clip.cond_stage_model)
    assert equal(encode(clip), files().reference(path, TEXT))


def test_the_lazy_clip_loader_node_on_a_clip_l_file(lazy, tmp_path):
    """The node runs ComfyUI's CLIPLoader: a CLIP-L-size fp16 file is hashed in the background at the
    first load (which loads as usual), then a new load is lazy: a prompt seen before is a disk hit without
    weights, a new one loads them, both bit-identical to CLIPLoader's."""
    import folder_paths
    from safetensors.torch import save_file

    import nodes

    folder = tmp_path / "text_encoders"
    folder.mkdir()
    model = loras().clip_l_sized(0).cond_stage_model.clip_l.transformer
    save_file({k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()},
              str(folder / "rk_clip_l.safetensors"))
    del model
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    node = rkharness.pack("nodes.lazy_clip").LazyCLIPLoader
    assert "ReuseKit Lazy CLIP Loader: clip_name" in node.validate_inputs(clip_name="nope.safetensors")
    with pytest.raises(ValueError, match="ReuseKit Lazy CLIP Loader: type"):
        node.execute(clip_name="rk_clip_l.safetensors", type="no_such_type")
    first = node.execute(clip_name="rk_clip_l.safetensors", type="stable_diffusion").args[0]
    assert not lazy.lc.pending(first.cond_stage_model) and count(lazy, "eager.hash_unknown") == 1
    assert lazy.tiers.TIERS.hashes.wait(120)  # hashed in the background; then its encodes are shared
    seen = encode(first)
    assert len(entries(lazy.folder)) == 1
    del first
    lazy.cc.CACHE.clear()
    clip = node.execute(clip_name="rk_clip_l.safetensors", type="stable_diffusion").args[0]
    assert lazy.lc.pending(clip.cond_stage_model)
    assert equal(encode(clip), seen) and lazy.lc.pending(clip.cond_stage_model)
    new = encode(clip, "a prompt never seen")
    assert not lazy.lc.pending(clip.cond_stage_model)
    lazy.settings.set("conditioning.enabled", False)
    (stock,) = nodes.CLIPLoader().load_clip("rk_clip_l.safetensors", "stable_diffusion")
    assert equal(encode(stock, "a prompt never seen"), new) and equal(encode(stock), seen)


@pytest.mark.parametrize("lazy_id, host_id", [("ReuseKitLazyCLIPLoader", "CLIPLoader"),
                                              ("ReuseKitLazyDualCLIPLoader", "DualCLIPLoader"),
                                              ("ReuseKitLazyTripleCLIPLoader", "TripleCLIPLoader")])
def test_each_lazy_loader_offers_its_host_loaders_choices_and_takes_the_same_prompt(tmp_path, lazy_id, host_id):
    """Each lazy loader lists the host loader's inputs with the same choices (the text encoder files, the
    types), whether the host node is a classic one or a V3 one (TripleCLIPLoader, whose inputs read
    ``"COMBO"``): ComfyUI's own validation takes the same prompt for both, and a file that is not there is
    refused naming the node and the input."""
    import asyncio
    import uuid

    import execution
    import folder_paths

    import nodes

    rkharness.load_extra_nodes()
    folder = tmp_path / "text_encoders"
    folder.mkdir()
    names = ["rk_a.safetensors", "rk_b.safetensors", "rk_c.safetensors"]
    for name in names:
        (folder / name).write_bytes(b"")
    folder_paths.add_model_folder_path("text_encoders", str(folder))
    lazy_node, host_node = nodes.NODE_CLASS_MAPPINGS[lazy_id], nodes.NODE_CLASS_MAPPINGS[host_id]
    host_inputs = {name: (entry[1]["options"] if entry[0] == "COMBO" else entry[0])
                   for section in host_node.INPUT_TYPES().values() for name, entry in section.items()}
    lazy_inputs = {name: list(entry[0]) if isinstance(entry[0], list) else entry[1]["options"]
                   for key, section in lazy_node.INPUT_TYPES().items() if key != "hidden"  # (its prompt: compat)
                   for name, entry in section.items()}
    assert lazy_inputs == {name: list(options) for name, options in host_inputs.items()}
    clip_names = [n for n in host_inputs if n.startswith("clip_name")]
    assert clip_names and all(set(names) <= set(host_inputs[n]) for n in clip_names)

    def prompt(class_type, passed=names[-1], **changed):  # "3" hands ``passed`` on through a link
        inputs = {n: names[i] for i, n in enumerate(clip_names)}
        inputs.update({n: options[0] for n, options in host_inputs.items() if n not in inputs}, **changed)
        return {"1": {"class_type": class_type, "inputs": inputs},
                "2": {"class_type": "ReuseKitCacheStats", "inputs": {"after": ["1", 0]}},
                "3": {"class_type": "RKTestPass", "inputs": {"value": passed}}}

    def validate(class_type, **changed):
        return asyncio.run(execution.validate_prompt(str(uuid.uuid4()), prompt(class_type, **changed), None))

    assert validate(host_id)[0] and validate(lazy_id)[0]
    refused = validate(lazy_id, **{clip_names[-1]: "rk_missing.safetensors"})
    assert not refused[0]
    details = [e.get("details", "") for n in refused[3].values() for e in n["errors"]]
    assert any(f"{lazy_node.DISPLAY}: {clip_names[-1]}: 'rk_missing.safetensors' is not one of" in d
               for d in details), details
    # a file name through a link reaches validation as None: taken as the host loader takes it (it was refused
    # as "None is not one of"), and checked when the node runs
    linked = {clip_names[-1]: ["3", 0]}
    assert validate(host_id, **linked)[0] and validate(lazy_id, **linked)[0]
    executor = rkharness.Executor(cache="none")
    with pytest.raises(AssertionError) as failed:
        executor.run(prompt(lazy_id, passed="rk_missing.safetensors", **linked))
    (message,) = [m[1] for m in executor.executor.status_messages if m[0] == "execution_error"]
    assert message["node_type"] == lazy_id, failed.value
    assert f"{lazy_node.DISPLAY}: {clip_names[-1]}: 'rk_missing.safetensors' is not one of" in message[
        "exception_message"]
    # an input the loader does not have, given through a link, is refused naming it (it failed with a TypeError
    # from the host loader), and so is one written as a value (ComfyUI dropped it without a word)
    for given in (["3", 0], 0.5):
        typo = prompt(lazy_id)
        typo["1"]["inputs"]["treshold"] = given
        executor = rkharness.Executor(cache="none")
        with pytest.raises(AssertionError):
            executor.run(typo)
        (message,) = [m[1] for m in executor.executor.status_messages if m[0] == "execution_error"]
        assert message["node_type"] == lazy_id
        assert f"{lazy_node.DISPLAY}: 'treshold' is not an input of this node" in message["exception_message"], \
            message
    # a file that holds no text encoder (empty here) is refused naming the node and its files: it failed with
    # safetensors' own "header too small", naming neither
    executor = rkharness.Executor(cache="none")
    with pytest.raises(AssertionError):
        executor.run(prompt(lazy_id))
    (message,) = [m[1] for m in executor.executor.status_messages if m[0] == "execution_error"]
    assert message["node_type"] == lazy_id
    assert message["exception_message"].startswith(f"{lazy_node.DISPLAY}: {clip_names[0]} 'rk_a.safetensors'")
    assert ": could not be loaded (" in message["exception_message"], message


def test_a_choice_from_an_empty_list_says_the_list_is_empty(monkeypatch):
    """No file in the folder a loader reads: the error says so, not "is not one of" and nothing."""
    node = rkharness.pack("nodes.lazy_clip").LazyCLIPLoader
    monkeypatch.setattr(node, "_spec", classmethod(lambda cls: [("clip_name", [], False, {})]))
    said = node.validate_inputs(clip_name="t5xxl.safetensors")
    assert said == ("ReuseKit Lazy CLIP Loader: clip_name: 't5xxl.safetensors' is not there: its list is empty (no "
                    "file in the models folder it reads; add one and refresh)")


# ---- across restarts: real servers ---------------------------------------------------------------

def _run(server, prompt) -> None:
    """Run a prompt; return once its misses reached the shared tiers."""
    history = server.wait_for_prompt(server.queue(prompt))
    assert history["status"]["status_str"] == "success", (history["status"], server.log_text()[-3000:])
    server.wait_published()


def _stats(server) -> dict:
    return {c["name"]: c for c in server.get("/reusekit/stats")["caches"]}


def _saved(path) -> tuple:
    data = load_file(path)
    return data["cond"], data["pooled"]


def _encode_prompt(clip_path: str, text: str, out: str, probe: str | None = None) -> dict:
    prompt = {
        "1": {"class_type": "RKTestLazyCLIPFile", "inputs": {"path": clip_path, "lazy": True}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
        "3": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "path": out}},
    }
    if probe:
        prompt["4"] = {"class_type": "RKTestLazyProbe",
                       "inputs": {"clip": ["1", 0], "after": ["2", 0], "path": clip_path, "out": probe}}
    return prompt


def test_a_restarted_server_answers_a_prompt_seen_before_without_reading_the_encoder(tmp_path):
    """Server A encodes four prompts through the disk tier (the last two's entries are then removed); a
    restarted server B answers the first from the disk tier without reading the file (neither its weights
    nor, thanks to the memo, to hash it), then loads the weights once for the third and not again for the
    fourth, all bit-identical to A's and to an eager encode; server C, after the file was replaced under
    the same name, encodes the new file's weights."""
    clip_path = files().write_tiny_clip_l(str(tmp_path), 0, name="te.safetensors")
    user = tmp_path / "user"
    user.mkdir()
    env = {"REUSEKIT_DISK_CACHE": str(tmp_path / "disk")}
    texts = ["a red fox", "a blue fox", "a green fox", "a white fox"]
    with rkharness.running_server("--user-directory", str(user), env=env) as a:
        for i, text in enumerate(texts):
            kept = set(entries(tmp_path / "disk"))
            _run(a, _encode_prompt(clip_path, text, str(tmp_path / f"a{i}.st")))
            if i >= 2:  # prompts B has not seen
                for made in set(entries(tmp_path / "disk")) - kept:
                    made.unlink()
    assert (user / "reusekit" / "file_hashes.json").is_file()
    with rkharness.running_server("--user-directory", str(user), env=env) as b:
        _run(b, _encode_prompt(clip_path, texts[0], str(tmp_path / "b0.st"), probe=str(tmp_path / "p0.json")))
        probe = json.loads((tmp_path / "p0.json").read_text())
        stats = _stats(b)
        assert probe["pending"] and probe["stored_bytes"] <= 64 and not probe["mapped"], probe
        assert probe["hashed_bytes"] == 0, probe  # the memo: not even read to hash it
        assert stats["conditioning"]["counters"].get("encodes", 0) == 0
        assert stats["conditioning_lazy"]["counters"]["weights_loaded"] == 0
        assert stats["conditioning_lazy"]["counters"]["encodes_without_weights"] == 1
        assert stats["conditioning_lazy"]["counters"]["not_read_bytes"] == os.path.getsize(clip_path)
        for i in (2, 3):
            _run(b, _encode_prompt(clip_path, texts[i], str(tmp_path / f"b{i}.st")))
            assert _stats(b)["conditioning_lazy"]["counters"]["weights_loaded"] == 1
        assert _stats(b)["conditioning"]["counters"].get("encodes") == 2
    for i in (0, 2, 3):
        assert equal(_saved(tmp_path / f"b{i}.st"), _saved(tmp_path / f"a{i}.st"))
        assert equal(_saved(tmp_path / f"b{i}.st"), files().reference(clip_path, texts[i]))
    time.sleep(0.01)
    files().write_tiny_clip_l(str(tmp_path), 1, name="te.safetensors", overwrite=True)
    with rkharness.running_server("--user-directory", str(user), env=env) as c:
        _run(c, _encode_prompt(clip_path, texts[0], str(tmp_path / "c0.st")))
        assert _stats(c)["conditioning"]["counters"].get("encodes") == 1
    assert equal(_saved(tmp_path / "c0.st"), files().reference(clip_path, texts[0]))
    assert not equal(_saved(tmp_path / "c0.st"), _saved(tmp_path / "a0.st"))


def _hash_as_a_run_would(user: Path, path: str) -> None:
    """Leave ``path``'s digest in the file-hash memo of ``user``, as an earlier server run would have (one
    that ran longer than its background hash of a large file takes)."""
    time.sleep(2.1)  # settled: the memo takes the file's hash
    memo = rkharness.pack("caching.file_hashes").FileHashes(inline_bytes=1 << 62)
    memo.memo = str(user / "reusekit" / "file_hashes.json")
    assert memo.get(path) is not None


def test_a_restarted_server_answers_a_qwen_image_edit_prompt_without_reading_the_llm(tmp_path):
    """ComfyUI's TextEncodeQwenImageEditPlus with a picture, on a Qwen2.5-VL 7B file (ComfyUI's classes at a
    test width) through the disk tier: server A loads it as CLIPLoader does and encodes, twice (the second
    from ComfyUI's own cache or the LRU); a restarted server B, loading it lazily, answers the same prompt
    without reading one byte of the LLM's weights, bit-identical to A."""
    from PIL import Image

    te = import_module(rkharness.TINY.__name__ + ".text_encoders")
    path = te.write_qwen25_7b(str(tmp_path / "qwen_2.5_vl_7b.safetensors"))
    user = tmp_path / "user"
    user.mkdir()
    env = {"REUSEKIT_DISK_CACHE": str(tmp_path / "disk")}

    def prompt(lazy, out, probe=None):
        p = {"1": {"class_type": "RKTestQwenImageTEFile", "inputs": {"path": path, "lazy": lazy}},
             "2": {"class_type": "LoadImage", "inputs": {"image": "edit.png"}},
             "3": {"class_type": "TextEncodeQwenImageEditPlus",
                   "inputs": {"clip": ["1", 0], "prompt": "make the sky green", "image1": ["2", 0]}},
             "4": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["3", 0], "path": out}}}
        if probe:
            p["5"] = {"class_type": "RKTestLazyProbe", "inputs": {"clip": ["1", 0], "after": ["3", 0], "path": path,
                                                                  "out": probe}}
        return p

    _hash_as_a_run_would(user, path)
    for name, lazy in (("a", False), ("b", True)):
        with rkharness.running_server("--user-directory", str(user), env=env) as server:
            (server.base / "input").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (56, 56), (30, 120, 200)).save(server.base / "input" / "edit.png")
            for i in range(2):
                _run(server, prompt(lazy, str(tmp_path / f"{name}{i}.st"),
                                    str(tmp_path / f"{name}{i}.json") if lazy else None))
            stats = _stats(server)
        if name == "a":
            assert stats["conditioning"]["counters"].get("encodes") == 1 and entries(tmp_path / "disk")
    probe = json.loads((tmp_path / "b0.json").read_text())
    assert probe["pending"] and probe["stored_weight_bytes"] == 0 and not probe["mapped"], probe
    assert probe["hashed_bytes"] == 0, probe  # the memo: not even read to hash it
    assert stats["conditioning"]["counters"].get("encodes", 0) == 0
    assert stats["conditioning_lazy"]["counters"]["weights_loaded"] == 0
    assert stats["conditioning_lazy"]["counters"]["not_read_bytes"] == os.path.getsize(path)
    a, b = load_file(tmp_path / "a0.st"), load_file(tmp_path / "b1.st")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_restarted_server_answers_a_z_image_prompt_without_reading_the_llm(tmp_path):
    """Z-Image text to image: a Qwen3-4B file at its real width (ComfyUI detects it by that width; a few
    narrow layers) through CLIPLoader's lumina2 type, ComfyUI's Z-Image model at a test size, through the disk
    tier. Server A loads the file as ComfyUI does and samples twice; a restarted server B, loading it lazily,
    samples the same two without reading one byte of the LLM's weights: its conditioning and latents are
    bit-identical to A's."""
    te = import_module(rkharness.TINY.__name__ + ".text_encoders")
    path = te.write_qwen3_4b(str(tmp_path / "qwen_3_4b.safetensors"))
    user = tmp_path / "user"
    user.mkdir()
    env = {"REUSEKIT_DISK_CACHE": str(tmp_path / "disk")}

    def prompt(lazy, seed, out, probe=None):
        p = {"1": {"class_type": "RKTestZImageTEFile", "inputs": {"path": path, "lazy": lazy}},
             "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": "a cat reading a newspaper"}},
             "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
             "4": {"class_type": "RKTestTinyZImage", "inputs": {"seed": 0}},
             "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
             "6": {"class_type": "KSampler",
                   "inputs": {"model": ["4", 0], "seed": seed, "steps": 3, "cfg": 1.0, "sampler_name": "euler",
                              "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0],
                              "latent_image": ["5", 0], "denoise": 1.0}},
             "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "rk/z"}},
             "8": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "path": out}}}
        if probe:
            p["9"] = {"class_type": "RKTestLazyProbe", "inputs": {"clip": ["1", 0], "after": ["2", 0], "path": path,
                                                                  "out": probe}}
        return p

    _hash_as_a_run_would(user, path)
    latents = {}
    for name, lazy in (("a", False), ("b", True)):
        with rkharness.running_server("--user-directory", str(user), env=env) as server:
            for seed in range(2):
                entry = server.wait_for_prompt(server.queue(prompt(
                    lazy, seed, str(tmp_path / f"{name}{seed}.st"), str(tmp_path / f"{name}{seed}.json") if lazy else None)))
                latents[name, seed] = server.saved_latent(entry, "7")
            server.wait_published()
            stats = _stats(server)
        if name == "a":
            assert stats["conditioning"]["counters"].get("encodes") == 1 and entries(tmp_path / "disk")
    probe = json.loads((tmp_path / "b0.json").read_text())
    assert probe["pending"] and probe["stored_weight_bytes"] == 0 and not probe["mapped"], probe
    assert probe["hashed_bytes"] == 0, probe
    assert stats["conditioning"]["counters"].get("encodes", 0) == 0
    assert stats["conditioning_lazy"]["counters"]["weights_loaded"] == 0
    assert stats["conditioning_lazy"]["counters"]["not_read_bytes"] == os.path.getsize(path)
    a, b = load_file(tmp_path / "a0.st"), load_file(tmp_path / "b1.st")
    assert a["cond"].shape[-1] == te.QWEN3_4B_FILE["hidden_size"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for seed in range(2):
        assert torch.equal(latents["a", seed], latents["b", seed])
    assert not torch.equal(latents["a", 0], latents["a", 1])


WORKFLOW = "Lazy text encoder - prompts seen before never load it.json"


def test_the_lazy_workflow_runs_twice_and_the_restart_never_loads_the_encoder(tmp_path):
    """The example workflow on the tiny models (the Lazy CLIP Loader stands in with the tiny CLIP-L file),
    with the disk tier: the first server encodes; a restarted one answers every prompt without the
    encoder's weights."""
    prompt = rkharness.workflow_to_prompt(rkharness.load_workflow(WORKFLOW), family="flux_trained")
    for node in prompt.values():
        if node["class_type"] in ("EmptySD3LatentImage", "EmptyLatentImage"):
            node["inputs"].update(width=64, height=64)
        if "steps" in node["inputs"]:
            node["inputs"]["steps"] = 4
    assert any(n["class_type"] == "RKTestLazyTinyCLIP" for n in prompt.values())
    files().write_tiny_clip_l(str(tmp_path), 0)
    env = {"REUSEKIT_DISK_CACHE": str(tmp_path / "disk"), files().ENV_DIR: str(tmp_path)}
    user = tmp_path / "user"
    user.mkdir()
    counts = []
    for _ in range(2):
        with rkharness.running_server("--user-directory", str(user), env=env) as server:
            _run(server, prompt)
            stats = _stats(server)
            counts.append((stats["conditioning"]["counters"].get("encodes", 0),
                           stats["conditioning_lazy"]["counters"]))
    assert counts[0][0] == 2  # the positive and the negative, once each
    assert counts[1][0] == 0 and counts[1][1]["weights_loaded"] == 0 and counts[1][1]["lazy_encoders"] == 1
    assert counts[1][1]["encodes_without_weights"] == 2
