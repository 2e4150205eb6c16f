"""Conditioning cache, shared tiers: the disk tier and the Redis tier, in process and across real
ComfyUI server processes; faults (corrupt, truncated, foreign, unsigned entries, Redis down, racing
writers) are counted misses, never wrong results."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from importlib import import_module
from pathlib import Path

import pytest
import rkharness
import torch
from safetensors.torch import load_file, save

pytestmark = pytest.mark.conditioning

TEXT = "a red circle on a blue square"


def _tiny_files():
    return import_module(rkharness.TINY.__name__ + ".conditioning")


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Global mode on, an empty LRU, the disk tier on in a fresh folder; everything put back after."""
    cc = rkharness.pack("caching.conditioning")
    tiers = rkharness.pack("caching.tiers")
    settings = rkharness.pack("caching.settings").SETTINGS
    rkharness.pack("patches.conditioning").install()
    keys = ("conditioning.enabled", "conditioning.disk.enabled", "conditioning.disk.folder",
            "conditioning.redis.enabled", "conditioning.redis.url")
    saved = {k: settings.get(k) for k in keys}
    monkeypatch.delenv("REUSEKIT_CACHE_SECRET", raising=False)
    settings.update({"conditioning.enabled": True, "conditioning.disk.enabled": True,
                     "conditioning.disk.folder": str(tmp_path / "disk"), "conditioning.redis.enabled": False},
                    trusted=True)
    cc.CACHE.clear()
    cc.CACHE.reset_counts()
    for stats in tiers.TIERS.stats.values():
        stats.reset_counters()
    yield type("Shared", (), {"cc": cc, "tiers": tiers, "settings": settings, "folder": tmp_path / "disk",
                              "files": tmp_path})
    published()  # nothing of this test is written into the next one's folder
    monkeypatch.delenv("REUSEKIT_CACHE_SECRET", raising=False)
    settings.update(saved, trusted=True)
    tiers.TIERS.configure(settings)
    cc.CACHE.clear()


def counter(tiers, tier, name):
    return tiers.TIERS.stats[tier].counter(name)


def published():
    """Wait until every miss's entry passed its publication check (a background full fingerprint) and
    was written to the shared tiers, or dropped: what another worker would see from then on."""
    assert rkharness.pack("patches.encoder_weights").wait_published(60)


def encode(clip, text=TEXT):
    """Encode, and wait for the publication of what missed."""
    out = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
    published()
    return out


def reference(seed=0, text=TEXT):
    """The same encode by a plain tiny CLIP with the cache off: what every hit must equal."""
    settings = rkharness.pack("caching.settings").SETTINGS
    before = settings.get("conditioning.enabled")
    settings.set("conditioning.enabled", False)
    try:
        return encode(rkharness.TINY.tiny_clip(seed), text)
    finally:
        settings.set("conditioning.enabled", before)


def equal(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def entry_files(folder: Path):
    published()
    return sorted(folder.rglob("*.rkcond"))


# ---- disk tier, in process --------------------------------------------------------------------

def test_disk_tier_hit_after_the_lru_is_emptied_equals_encoding(shared):
    path = _tiny_files().write_tiny_clip_file(str(shared.files), 0)
    clip = _tiny_files().load_tiny_clip_file(path)
    first = encode(clip)
    assert shared.cc.CACHE.count("encodes") == 1 and len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()
    again = encode(clip)
    assert shared.cc.CACHE.count("encodes") == 1  # the encoder did not run again
    assert counter(shared.tiers, "disk", "hits") == 1
    assert equal(first, again) and equal(again, reference(0))
    assert len(shared.cc.CACHE) == 1  # promoted into the LRU: the next call is an in-process hit
    encode(clip)
    assert counter(shared.tiers, "disk", "hits") == 1


@pytest.mark.hardening
def test_a_disk_tier_folder_that_cannot_be_listed_keeps_the_pack_and_its_writes_and_says_so(shared, monkeypatch):
    """Another user's 0700 folder, say: its listing raised through the tiers' set-up, so the pack failed to load
    with its encoders already patched, and a write that took was counted as failed. Entries are read and
    written; what cannot be counted or evicted is said once on the tier's card."""
    import pathlib

    folder = shared.folder
    folder.mkdir(parents=True, exist_ok=True)
    iterdir = pathlib.Path.iterdir

    def denied(self):
        if self == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return iterdir(self)

    is_dir = pathlib.Path.is_dir

    def not_entered(self, *args, **kwargs):  # a folder listed but not entered (read, no search bit)
        if self.parent == folder:
            raise PermissionError(13, "Permission denied", str(self))
        return is_dir(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "iterdir", denied)
        shared.tiers.TIERS.configure(shared.settings)  # (raised here)
        clip = _tiny_files().load_tiny_clip_file(_tiny_files().write_tiny_clip_file(str(shared.files), 0))
        encode(clip)
        disk = shared.tiers.TIERS.stats["disk"]
        assert disk.counter("written") == 1 and not [r for r in disk.reasons() if r["event"] == "refused"]
        shared.cc.CACHE.clear()
        assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 1
        rows = [r for r in disk.reasons() if r["source"] == "disk tier"]
        assert [(r["event"], r["count"]) for r in rows] == [("fallback", 1)], rows
        assert "cannot be listed" in rows[0]["reason"]
    assert len(entry_files(folder)) == 1
    with monkeypatch.context() as m:  # its entries' folders looked at, not entered
        m.setattr(pathlib.Path, "is_dir", not_entered)
        assert shared.tiers.TIERS.disk.usage(fresh=True) == (0, 0) and "Permission denied" in shared.tiers.TIERS.disk.unlisted


@pytest.mark.hardening
def test_a_file_hash_memo_that_cannot_be_trusted_or_written_is_counted_where_the_panel_shows_it(shared, monkeypatch):
    """Passed over (its files are hashed again), or not written (a read-only user directory: each start hashes
    large files again), and said on the tier's card, no longer in a debug log alone."""
    hashes = shared.tiers.TIERS.hashes
    memo = shared.files / "memo.json"
    memo.write_text("[" * 100_000 + "]" * 100_000)
    monkeypatch.setattr(hashes, "memo", str(memo))
    weights = shared.files / "w.bin"
    weights.write_bytes(b"\0" * 64)
    hashes.for_stamp(hashes.stamp(str(weights)))
    hashes.for_stamp(hashes.stamp(str(weights)))  # (the same file read once: counted once)
    rows = [r for r in shared.tiers.TIERS.stats["disk"].reasons() if r["source"] == "file hashes"]
    assert [(r["event"], r["count"]) for r in rows] == [("fallback", 1)], rows
    assert str(memo) in rows[0]["reason"] and "RecursionError" in rows[0]["reason"]
    assert hashes.wait(10)
    blocked = shared.files / "a file" / "memo.json"  # (its folder is a file: the write fails as a read-only one)
    (shared.files / "a file").write_bytes(b"")
    monkeypatch.setattr(hashes, "memo", str(blocked))
    monkeypatch.setattr(type(hashes), "SETTLE_NS", 0)
    other = shared.files / "w2.bin"
    other.write_bytes(b"\1" * 64)
    assert hashes.for_stamp(hashes.stamp(str(other))) is not None and hashes.wait(10)
    rows = [r for r in shared.tiers.TIERS.stats["disk"].reasons() if "cannot be written" in r["reason"]]
    assert [(r["event"], r["source"]) for r in rows] == [("fallback", "file hashes")], rows


@pytest.mark.hardening
def test_an_entry_an_older_revision_of_the_keys_wrote_is_never_read(shared, monkeypatch):
    """A fix that changes what an encode stores under an unchanged key raises ``KEY_REVISION``: what an older
    ReuseKit shared under that key (a wrong value, in the case that made it) is never read after the upgrade."""
    conditioning = rkharness.pack("patches.conditioning")
    clip = _tiny_files().load_tiny_clip_file(_tiny_files().write_tiny_clip_file(str(shared.files), 0))
    with monkeypatch.context() as m:
        m.setattr(conditioning, "KEY_REVISION", conditioning.KEY_REVISION - 1)
        encode(clip)  # the older ReuseKit's entry
    assert len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()
    assert equal(encode(clip), reference(0))
    assert shared.cc.CACHE.count("encodes") == 2 and counter(shared.tiers, "disk", "hits") == 0
    assert len(entry_files(shared.folder)) == 2  # the older entry is left to the budget's eviction
    shared.cc.CACHE.clear()
    encode(clip)
    assert shared.cc.CACHE.count("encodes") == 2 and counter(shared.tiers, "disk", "hits") == 1


def test_a_shared_hit_read_while_the_cache_is_cleared_is_returned_not_kept(shared, monkeypatch):
    """A clear (the panel's, or a check_weight_edits switch) while a disk-tier entry is read: the entry is
    returned, not promoted into the emptied LRU, and counted with what ran meanwhile (no encode did)."""
    path = _tiny_files().write_tiny_clip_file(str(shared.files), 0)
    clip = _tiny_files().load_tiny_clip_file(path)
    first = encode(clip)
    shared.cc.CACHE.clear()
    read = shared.tiers.TIERS.get

    def cleared_meanwhile(*args, **kwargs):
        shared.cc.CACHE.clear()
        return read(*args, **kwargs)

    monkeypatch.setattr(shared.tiers.TIERS, "get", cleared_meanwhile)
    again = encode(clip)
    assert equal(first, again) and equal(again, reference(0))
    assert shared.cc.CACHE.count("encodes") == 1 and counter(shared.tiers, "disk", "hits") == 1
    assert len(shared.cc.CACHE) == 0
    reasons = [r["reason"] for r in shared.cc.CACHE.stats.reasons() if r["event"] == "bypass"]
    assert any("while its result was read from the shared tiers" in r for r in reasons), reasons


def test_an_encode_that_ran_while_the_cache_was_turned_off_is_neither_kept_nor_shared(shared):
    """The budget set to 0 (the panel's setting) while an encode ran: its result was dropped with no reason
    counted, and still written to the shared tiers. Now it is returned, counted, and neither kept nor shared."""
    cc = shared.cc
    cache = cc.ConditioningCache()

    def fetch(name, compute):
        key = cc.Key("text", (cc.encode(name),), owners=(1,))
        return cache.fetch(key, compute, shared=lambda: shared.tiers.SharedKey.of_text(f"a test entry: {name}"))

    assert torch.equal(fetch("kept", lambda: torch.ones(3)), torch.ones(3))  # as usual: kept, and on disk
    assert len(cache) == 1 and len(entry_files(shared.folder)) == 1

    def turned_off_meanwhile():
        cache.configure(budget_bytes=0)
        return torch.ones(3) * 2

    assert torch.equal(fetch("turned off", turned_off_meanwhile), torch.ones(3) * 2)
    assert len(entry_files(shared.folder)) == 1 and cache.count("bypasses.text") == 1
    assert any("budget_mib or max_entries was set to 0 while this encode ran" in r["reason"]
               for r in cache.stats.reasons() if r["event"] == "bypass")


@pytest.mark.parametrize("why", ["too large", "write failed"])
def test_an_entry_no_tier_takes_is_counted_not_shared_not_published(shared, monkeypatch, why):
    """An entry over the disk tier's size limit was skipped with no row and counted "published"; a failed write
    too. Now the tier's stats say why, the encode counts as not shared, and the result is the encoder's."""
    path = _tiny_files().write_tiny_clip_file(str(shared.files), 0)
    clip = _tiny_files().load_tiny_clip_file(path)
    if why == "too large":
        monkeypatch.setattr(shared.tiers.TIERS.disk, "max_bytes", 1000)
    else:
        def full(name, data):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(shared.tiers.TIERS.disk, "write", full)
    assert equal(encode(clip), reference(0))
    assert entry_files(shared.folder) == []
    assert shared.cc.CACHE.count("published") == 0 and shared.cc.CACHE.count("not_shared") == 1
    tier_rows = [r["reason"] for r in shared.tiers.TIERS.stats["disk"].reasons()]
    assert any(("larger than this tier's limit" if why == "too large" else "No space left") in r for r in tier_rows)
    assert any("no shared tier took its entry" in r["reason"] for r in shared.cc.CACHE.bypass_reasons())


def test_a_new_encoder_from_a_copy_of_the_file_hits_and_other_weights_miss(shared):
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    first = encode(files.load_tiny_clip_file(path))
    copy_dir = shared.files / "elsewhere"
    copy_dir.mkdir()
    copied = str(shutil.copy(path, copy_dir / "renamed.safetensors"))
    other = files.load_tiny_clip_file(copied)  # another object, another path, the same bytes
    assert equal(encode(other), first) and counter(shared.tiers, "disk", "hits") == 1
    assert shared.cc.CACHE.count("encodes") == 1
    seed1 = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 1))
    out = encode(seed1)
    assert shared.cc.CACHE.count("encodes") == 2 and equal(out, reference(1))
    assert not equal(out, first)


def test_comfyuis_own_clip_loader_records_the_file_and_a_second_load_hits(shared):
    """CLIPLoader's path (``comfy.sd.load_clip``) on a CLIP-L-sized file (the tiny CLIP cannot be
    detected): the file is hashed in the background, then a fresh load of it hits the disk tier."""
    import comfy.sd
    from safetensors.torch import save_file

    model = _tiny_files().clip_l_sized(0).cond_stage_model.clip_l.transformer
    path = str(shared.files / "clip_l.safetensors")
    save_file({k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}, path)
    del model
    first = comfy.sd.load_clip([path])
    assert shared.tiers.TIERS.hashes.wait(120)
    out = encode(first)
    assert shared.cc.CACHE.count("encodes") == 1 and len(entry_files(shared.folder)) == 1
    del first
    second = comfy.sd.load_clip([path])
    assert equal(encode(second), out)
    assert shared.cc.CACHE.count("encodes") == 1 and counter(shared.tiers, "disk", "hits") == 1


def test_the_settings_node_shows_the_shared_tiers(shared):
    files = _tiny_files()
    encode(files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0)))
    node = rkharness.pack("nodes.conditioning").ConditioningCacheSettings
    text = node.execute(True, 512, 128, False).args[0]
    shared.tiers.TIERS.configure(shared.settings)
    snap = {c["name"]: c for c in rkharness.pack("caching.stats").REGISTRY.snapshot()["caches"]}
    for tier in ("conditioning_disk", "conditioning_redis"):
        assert {"hits", "misses", "errors", "rejected"} <= set(snap[tier]["counters"])
        assert "time_saved_s" in snap[tier] and "entries" in snap[tier]
    assert "conditioning_disk: 1 entries" in text and "conditioning_redis: off — start ComfyUI with" in text
    assert "written=1" in text


def test_shared_keys_name_devices_by_kind_and_model_not_index_and_leave_text_alone():
    """Workers on different GPUs of one model share entries; a string that looks like a device stays."""
    pc = rkharness.pack("patches.conditioning")
    keys = rkharness.pack("caching.keys")
    names = rkharness.pack("caching.tiers")._portable_names
    names.update({"cuda:0": "cuda[Same GPU]", "cuda:1": "cuda[Same GPU]", "cuda:2": "cuda[Other GPU]"})
    try:
        def tree(index):
            return pc._portable(keys.encode((torch.device(f"cuda:{index}"), "cuda:1")))

        assert tree(0) == tree(1) != tree(2)
        assert tree(0)[1][1] == ("s", "cuda:1")
        assert pc._portable(("T", "torch.float32", (2,), "cuda:0")) == ("T", "torch.float32", (2,), "cuda[Same GPU]")
    finally:
        for name in ("cuda:0", "cuda:1", "cuda:2"):
            names.pop(name, None)


def test_a_cpu_encode_is_shared_only_with_cpus_of_its_instruction_set(shared, monkeypatch):
    """An encode on the CPU rounds as the kernels torch dispatches for that CPU do: a worker on another
    instruction set (AVX2 beside AVX-512) reads none of its entries, as a worker on another GPU model does."""
    path = _tiny_files().write_tiny_clip_file(str(shared.files), 0)
    clip = _tiny_files().load_tiny_clip_file(path)
    assert clip.patcher.load_device.type == "cpu"
    first = encode(clip)
    shared.cc.CACHE.clear()
    with monkeypatch.context() as other_machine:
        other_machine.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER")
        encode(clip)
    assert shared.cc.CACHE.count("encodes") == 2 and counter(shared.tiers, "disk", "hits") == 0
    assert len(entry_files(shared.folder)) == 2
    shared.cc.CACHE.clear()
    assert equal(encode(clip), first) and counter(shared.tiers, "disk", "hits") == 1
    # an encode on a GPU names the GPU's model only, whatever CPU holds its inputs and outputs
    pc = rkharness.pack("patches.conditioning")
    tokens = clip.tokenize(TEXT)

    def name(capability, device, threads=None):
        before = torch.get_num_threads()
        with monkeypatch.context() as machine:
            machine.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
            machine.setattr(clip.patcher, "load_device", torch.device(device))
            machine.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
            torch.set_num_threads(threads or before)
            try:
                return pc.shared_key(pc.text_key(clip, tokens, False, False), clip.cond_stage_model, clip.patcher).name
            finally:
                torch.set_num_threads(before)

    assert name("AVX2", "cpu") != name("AVX512", "cpu")
    assert name("AVX2", "cuda:0") == name("AVX512", "cuda:0") != name("AVX2", "cpu")
    # and its CPU threads, which split no GPU kernel (two GPU workers on machines of other core counts share)
    assert name("AVX2", "cuda:0", threads=1) == name("AVX2", "cuda:0", threads=2)
    assert name("AVX2", "cpu", threads=1) != name("AVX2", "cpu", threads=2)


@pytest.mark.parametrize("system", ["Windows", "Darwin", "Linux x86", "Linux Arm"])
def test_the_cpus_model_is_read_on_every_system_that_says_it(monkeypatch, system):
    """The CPU's model, which the shared key of a CPU encode names, on Windows (its processor string) and macOS
    (sysctl's chip) as on Linux, Arm's included: it was read from /proc/cpuinfo's model name alone, so Windows,
    macOS and Arm Linux workers of different CPUs shared one another's encodes."""
    import builtins
    import io
    import platform
    import subprocess

    tiers = rkharness.pack("caching.tiers")
    info = {"Linux x86": "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\n"
                         "processor\t: 1\nmodel name\t: AMD EPYC 7B13\n",
            "Linux Arm": "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
                         "CPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\nprocessor\t: 1\n"}
    real_open = builtins.open
    monkeypatch.setattr(platform, "system", lambda: system.split()[0])
    monkeypatch.setattr(platform, "processor", lambda: "Intel64 Family 6 Model 183 Stepping 1, GenuineIntel")
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: subprocess.CompletedProcess(args, 0, "Apple M2 Pro\n"))
    monkeypatch.setattr(builtins, "open", lambda path, *a, **kw: io.StringIO(info[system])
                        if path == "/proc/cpuinfo" else real_open(path, *a, **kw))
    tiers.cpu_model.cache_clear()
    try:
        assert tiers.cpu_model() == {"Windows": "Intel64 Family 6 Model 183 Stepping 1, GenuineIntel",
                                     "Darwin": "Apple M2 Pro", "Linux x86": "AMD EPYC 7B13",
                                     "Linux Arm": "arm 0x41 8 0x3 0xd0c"}[system]
        assert tiers.device_model(torch.device("mps")) == tiers.cpu_model()  # Apple's GPU: its chip's
    finally:
        tiers.cpu_model.cache_clear()


@pytest.mark.parametrize("device", ["cpu", "xpu:0"])
def test_an_encode_on_a_device_whose_model_cannot_be_read_is_kept_local_and_said(shared, monkeypatch, device):
    """Where the encoder's device model cannot be read (a CPU whose system does not say it, a GPU torch gives no
    name for), the shared key cannot tell its kernels from another worker's: the encode is the encoder's own,
    counted not shared with its reason, and nothing is written (such workers once shared one key)."""
    pc = rkharness.pack("patches.conditioning")
    path = _tiny_files().write_tiny_clip_file(str(shared.files), 0)
    clip = _tiny_files().load_tiny_clip_file(path)
    shared.settings.set("conditioning.enabled", False)
    own = clip.encode_from_tokens(clip.tokenize(TEXT), return_pooled=True)
    shared.settings.set("conditioning.enabled", True)
    kind = torch.device(device).type
    real = pc.device_model
    monkeypatch.setattr(pc, "device_model", lambda d: None if d.type == kind else real(d))
    if kind != "cpu":  # the key's device as the patcher names it; the encode itself stays on the CPU
        tokens = clip.tokenize(TEXT)
        monkeypatch.setattr(clip.patcher, "load_device", torch.device(device))
        with pytest.raises(shared.cc.LocalOnly, match="this xpu device's model cannot be read here"):
            pc.shared_key(pc.text_key(clip, tokens, False, False), clip.cond_stage_model, clip.patcher)
        return
    assert equal(encode(clip), own) and entry_files(shared.folder) == []
    (row,) = shared.cc.CACHE.bypass_reasons()
    assert row["reason"].startswith("not shared: this cpu device's model cannot be read here"), row
    assert shared.cc.CACHE.count("not_shared") == 1


@pytest.mark.parametrize("difference", ["pytorch attention", "threads", "cpu model"])
def test_a_worker_that_computes_an_encode_otherwise_reads_none_of_anothers_entries(shared, monkeypatch, difference):
    """What decides an encode's bits beyond its inputs and weights, as two workers sharing a tier may differ in
    it: whether ComfyUI runs pytorch attention in text encoders (optimized_attention_for_device picks it at
    every encode; off on a worker started with --use-split-cross-attention beside xformers or sage, whose
    optimized_attention the key named alike: 1.2e-6 from the worker's own encode), and on the CPU torch's
    thread count (its matrix products split by it: 1.3e-6 between 1 and 2 threads on a 768-wide CLIP) and the
    CPU's model (MKL and oneDNN pick kernels by it within one instruction set). Each is in the shared key: the
    second worker computes its own, bit for bit what it computes with the cache off."""
    import comfy.model_management as mm

    pc = rkharness.pack("patches.conditioning")
    clip = _tiny_files().load_tiny_clip_file(_tiny_files().write_tiny_clip_file(str(shared.files), 0))
    assert clip.patcher.load_device.type == "cpu"

    def worker(second: bool, patch):
        if difference == "pytorch attention":
            patch.setattr(mm, "ENABLE_PYTORCH_ATTENTION", not second)
        elif difference == "threads":
            patch.setattr(torch, "get_num_threads", lambda: 1 if second else 2)
        else:
            patch.setattr(pc, "device_model", lambda device: "another CPU" if second else "a CPU")

    with monkeypatch.context() as first:
        worker(False, first)
        encode(clip)
    assert len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()  # the second worker: its own memory, the same disk tier
    with monkeypatch.context() as second:
        worker(True, second)
        shared.settings.set("conditioning.enabled", False)
        own = clip.encode_from_tokens(clip.tokenize(TEXT), return_pooled=True)
        shared.settings.set("conditioning.enabled", True)
        got = encode(clip)
    assert counter(shared.tiers, "disk", "hits") == 0 and len(entry_files(shared.folder)) == 2
    assert equal(got, own)


def test_comfyuis_vae_loader_reaches_the_disk_tier_through_its_reload_factory(shared):
    """VAELoader (ComfyUI 0.2x+ records ``cached_patcher_init`` with the file) on a tiny Wan VAE file."""
    import folder_paths
    from safetensors.torch import save_file

    import nodes

    vae = _tiny_files().tiny_wan_vae(0)
    folder = shared.files / "vae"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in vae.first_stage_model.state_dict().items()}, str(folder / "rk_wan.safetensors"))
    folder_paths.add_model_folder_path("vae", str(folder))
    first = nodes.VAELoader().load_vae("rk_wan.safetensors")[0]
    if getattr(first.patcher, "cached_patcher_init", None) is None:
        pytest.skip("this ComfyUI's VAELoader records no file (no ModelPatcher.cached_patcher_init)")
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    out = first.encode(image)
    assert len(entry_files(shared.folder)) == 1
    second = nodes.VAELoader().load_vae("rk_wan.safetensors")[0]
    again = second.encode(image)
    assert torch.equal(again, out) and counter(shared.tiers, "disk", "hits") == 1
    assert shared.cc.CACHE.count("encodes") == 1


def test_a_worker_started_with_fp16_intermediates_never_reads_another_workers_vae_entries(shared, monkeypatch):
    """ComfyUI 0.33 hands a VAE's output in ``intermediate_dtype()`` (float16 under --fp16-intermediates): a
    worker started with it misses the entries a worker without it filed, and gets what it computes."""
    import comfy.cli_args
    import folder_paths
    from safetensors.torch import save_file

    import nodes

    if not hasattr(comfy.cli_args.args, "fp16_intermediates"):
        pytest.skip("this ComfyUI has no --fp16-intermediates")
    vae = _tiny_files().tiny_wan_vae(0)
    folder = shared.files / "vae"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in vae.first_stage_model.state_dict().items()}, str(folder / "rk_wan.safetensors"))
    folder_paths.add_model_folder_path("vae", str(folder))
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(comfy.cli_args.args, "fp16_intermediates", False)
    assert nodes.VAELoader().load_vae("rk_wan.safetensors")[0].encode(image).dtype == torch.float32
    published()
    assert len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()  # the other worker: its own memory, the same disk tier
    monkeypatch.setattr(comfy.cli_args.args, "fp16_intermediates", True)
    second = nodes.VAELoader().load_vae("rk_wan.safetensors")[0]
    shared.settings.set("conditioning.enabled", False)
    truth = second.encode(image)
    shared.settings.set("conditioning.enabled", True)
    got = second.encode(image)
    published()
    assert truth.dtype == torch.float16 and torch.equal(got, truth)
    assert counter(shared.tiers, "disk", "hits") == 0 and len(entry_files(shared.folder)) == 2


@pytest.mark.parametrize("flag", ["--force-upcast-attention", "--dont-upcast-attention"])
def test_a_worker_started_with_other_attention_upcasting_never_reads_another_workers_entries(shared, monkeypatch, flag):
    """Both flags set the softmax precision of ComfyUI's attention functions (the basic one, the CPU's
    sub-quadratic one, the split one) that text encoders call: a worker started with one misses the
    entries a worker without it filed, and gets what it computes."""
    import comfy.cli_args
    import comfy.ldm.modules.attention as attention

    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    encode(clip)
    assert len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()  # the other worker: its own memory, the same disk tier
    if flag == "--force-upcast-attention":
        monkeypatch.setattr(attention, "FORCE_UPCAST_ATTENTION_DTYPE", {torch.float16: torch.float32})
    else:
        monkeypatch.setattr(comfy.cli_args.args, "dont_upcast_attention", True)
    shared.settings.set("conditioning.enabled", False)
    truth = clip.encode_from_tokens(clip.tokenize(TEXT), return_pooled=True)
    shared.settings.set("conditioning.enabled", True)
    got = encode(clip)
    assert all(torch.equal(a, b) for a, b in zip(got, truth))
    assert counter(shared.tiers, "disk", "hits") == 0 and len(entry_files(shared.folder)) == 2


def test_workers_whose_classes_differ_only_in_a_decorators_arguments_never_share(shared):
    """Two workers whose nodes wrapped an encoder class's method in ``torch.autocast`` at start-up, one to
    bfloat16 and one to float16: the second misses the first one's entry and gets what it computes."""
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    cls = type(next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp")))
    conditioning = rkharness.pack("patches.conditioning")
    original = cls.forward
    try:
        cls.forward = torch.autocast("cpu", dtype=torch.bfloat16)(original)
        first = encode(clip)
        assert len(entry_files(shared.folder)) == 1
        shared.cc.CACHE.clear()  # the other worker: its own memory and its own record of the classes
        conditioning._classes.clear()
        cls.forward = torch.autocast("cpu", dtype=torch.float16)(original)
        shared.settings.set("conditioning.enabled", False)
        truth = clip.encode_from_tokens(clip.tokenize(TEXT), return_pooled=True)
        shared.settings.set("conditioning.enabled", True)
        got = encode(clip)
        assert not torch.equal(truth[0], first[0]) and all(torch.equal(a, b) for a, b in zip(got, truth))
        assert counter(shared.tiers, "disk", "hits") == 0 and len(entry_files(shared.folder)) == 2
    finally:
        cls.forward = original


_THROUGH = {}


def _loading_clip(self, *args, **kwargs):  # a node's code on ComfyUI's CLIP class
    return _THROUGH["load_model"](self, *args, **kwargs)


def test_another_nodes_code_on_comfyuis_clip_class_keeps_the_encode_in_the_process(shared):
    """Code another node set on ``comfy.sd.CLIP`` runs in every encode, and what it reads is not in the
    key: the encode still hits in this process but is never shared, with the reason counted."""
    import comfy.sd

    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    original = _THROUGH["load_model"] = comfy.sd.CLIP.load_model
    comfy.sd.CLIP.load_model = _loading_clip
    try:
        first = encode(clip)
        assert all(torch.equal(a, b) for a, b in zip(encode(clip), first))
        assert shared.cc.CACHE.count("hits.text") == 1 and entry_files(shared.folder) == []
        assert any("CLIP.load_model on the encoder's class is code from" in r["reason"]
                   for r in shared.cc.CACHE.bypass_reasons())
    finally:
        comfy.sd.CLIP.load_model = original
    encode(clip, "another prompt")
    assert len(entry_files(shared.folder)) == 1


class _ReadsAsAttributes(dict):  # a class attribute whose every attribute read raises
    __getattr__ = dict.__getitem__


def test_a_class_attribute_the_key_cannot_read_keeps_the_encode_in_the_process(shared):
    """A class attribute of an encoder module the key cannot read (its ``__getattr__`` raises) is no
    error: the encode is keyed and hits in this process, but is never shared, with the reason counted."""
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    mlp = next(m for n, m in clip.cond_stage_model.named_modules() if n.endswith("mlp"))
    original = type(mlp)
    mlp.__class__ = type("OddMLP", (original,), {"rk_odd": _ReadsAsAttributes()})
    try:
        first = encode(clip)
        assert all(torch.equal(a, b) for a, b in zip(encode(clip), first))
        assert shared.cc.CACHE.count("hits.text") == 1 and shared.cc.CACHE.count("bypasses") == 0
        assert entry_files(shared.folder) == []
        assert any("OddMLP.rk_odd could not be read" in r["reason"] for r in shared.cc.CACHE.bypass_reasons())
    finally:
        mlp.__class__ = original


def test_an_encoder_without_a_known_file_never_uses_the_shared_tiers(shared):
    encode(rkharness.TINY.tiny_clip(0))
    assert shared.cc.CACHE.count("encodes") == 1
    assert entry_files(shared.folder) == [] and counter(shared.tiers, "disk", "misses") == 0


def test_weights_replaced_or_edited_after_loading_leave_the_shared_tiers(shared):
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    clip = files.load_tiny_clip_file(path)
    encode(clip)
    assert len(entry_files(shared.folder)) == 1
    w = clip.cond_stage_model.clip_l.transformer.text_model.final_layer_norm.weight
    w.data[0] += 1.0  # an in-place edit of an inference tensor: seen by its fingerprint
    edited = encode(clip)
    assert shared.cc.CACHE.count("encodes") == 2 and len(entry_files(shared.folder)) == 1
    assert not equal(edited, reference(0))
    fresh = files.load_tiny_clip_file(path)  # the file is unchanged: a fresh load still hits
    assert equal(encode(fresh), reference(0)) and counter(shared.tiers, "disk", "hits") == 1


def test_weights_edited_between_loading_and_the_first_encode_never_hit_the_files_entries(shared):
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    encode(files.load_tiny_clip_file(path))  # the file's entry, from its true weights
    edited = files.load_tiny_clip_file(path)
    edited.cond_stage_model.clip_l.transformer.text_model.final_layer_norm.weight.data[0] += 1.0
    out = encode(edited)
    assert counter(shared.tiers, "disk", "hits") == 0 and shared.cc.CACHE.count("encodes") == 2
    assert not equal(out, reference(0)) and len(entry_files(shared.folder)) == 1


def test_lora_patch_sets_key_by_content_and_strength(shared):
    import comfy.sd
    import comfy.utils

    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    lora = comfy.utils.load_torch_file(os.path.join(files.lora_dir(), files.write_lora("tiers.safetensors", flux=False)))
    base = files.load_tiny_clip_file(path)
    _, strong = comfy.sd.load_lora_for_models(None, base, lora, 0.0, 1.0)
    _, weak = comfy.sd.load_lora_for_models(None, base, lora, 0.0, 0.5)
    a, b = encode(strong), encode(weak)
    assert not equal(a, b) and len(entry_files(shared.folder)) == 2
    shared.cc.CACHE.clear()
    again = files.load_tiny_clip_file(path)
    lora2 = comfy.utils.load_torch_file(os.path.join(files.lora_dir(), "tiers.safetensors"))
    _, strong2 = comfy.sd.load_lora_for_models(None, again, lora2, 0.0, 1.0)
    assert equal(encode(strong2), a) and counter(shared.tiers, "disk", "hits") == 1
    assert shared.cc.CACHE.count("encodes") == 2


@pytest.mark.parametrize("how", ["a new clone", "a twin load's clone"])
def test_a_lora_edited_in_place_never_reaches_another_worker_as_the_file(shared, how):
    """One worker edits its loaded LoRA's tensors in place, away from every value a cheap check samples, and
    encodes with a new clone of it, or with the clone of a second load of the file made before the edit
    (which shares the first load's patch set): what it publishes is never filed under the file's contents, so
    a worker with the file's LoRA never reads it (before, it was: the set was trusted by its tensor objects,
    or watched only the first load's)."""
    import comfy.sd
    import comfy.utils

    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    lora_path = os.path.join(files.lora_dir(), files.write_lora("tiers_inplace.safetensors", seed=9, rank=600,
                                                                flux=False))
    base = files.load_tiny_clip_file(path)
    lora, twin = comfy.utils.load_torch_file(lora_path), comfy.utils.load_torch_file(lora_path)
    encode(comfy.sd.load_lora_for_models(None, base, lora, 0.0, 1.0)[1], "first")
    _, twin_clip = comfy.sd.load_lora_for_models(None, base, twin, 0.0, 1.0)
    encode(twin_clip, "first")  # a hit: one set
    edited_dict = lora if how == "a new clone" else twin
    weight_edits = rkharness.pack("caching.weight_edits")
    t = edited_dict[next(k for k in edited_dict if k.endswith("q_proj.lora_up.weight"))]
    flat = t.view(-1)
    kept = set(torch.linspace(0, flat.numel() - 1, steps=8).long().tolist())
    kept |= set(weight_edits._positions(weight_edits._as_ints(t)[1]).tolist())
    flat[[i for i in range(flat.numel()) if i not in kept]] *= 3.0
    edited = encode(comfy.sd.load_lora_for_models(None, base, lora, 0.0, 1.0)[1] if how == "a new clone"
                    else twin_clip)
    shared.cc.CACHE.clear()  # another worker: its own LRU, encoder and LoRA, loaded from the files
    _, other = comfy.sd.load_lora_for_models(None, files.load_tiny_clip_file(path),
                                             comfy.utils.load_torch_file(lora_path), 0.0, 1.0)
    got = encode(other)
    settings = rkharness.pack("caching.settings").SETTINGS
    settings.set("conditioning.enabled", False)
    try:
        want = other.encode_from_tokens(other.tokenize(TEXT), return_pooled=True)
    finally:
        settings.set("conditioning.enabled", True)
    assert equal(got, want) and not equal(got, edited)
    assert counter(shared.tiers, "disk", "hits") == 0


def test_until_a_weight_file_is_hashed_the_shared_tiers_are_bypassed(shared):
    """Counted with the reason, never silently; the first encode after the hash is shared."""
    hashes = shared.tiers.TIERS.hashes
    saved = hashes.inline_bytes
    hashes.inline_bytes = 0  # every file on the background thread, as a large one would be
    gate = threading.Event()
    real = hashes._hash
    hashes._hash = lambda stamp: gate.wait(30) and real(stamp)  # a slow hash: the encode must not wait
    try:
        files = _tiny_files()
        path = files.write_tiny_clip_file(str(shared.files), 2)
        clip = files.load_tiny_clip_file(path)
        assert hashes.get(path) is None
        assert equal(encode(clip), reference(2))
        assert entry_files(shared.folder) == [] and shared.cc.CACHE.count("encodes") == 1
        (row,) = shared.cc.CACHE.bypass_reasons()  # not silent: counted, with its reason, for the panel
        assert row["count"] == 1 and row["reason"].startswith("not shared: a weight file is being hashed"), row
        (stat,) = shared.cc.CACHE.stats.snapshot()["reasons"]  # the panel's row: the event, where, why
        assert (stat["event"], stat["source"], stat["count"]) == ("not shared", f"text, {row['encoder']}", 1), stat
        assert stat["reason"].startswith("a weight file is being hashed"), stat  # the event beside it, not in it
        assert shared.cc.CACHE.count("not_shared.text") == 1 and shared.cc.CACHE.count("bypasses") == 0
        gate.set()
        assert hashes.wait(30) and hashes.get(path) is not None
        encode(clip, "another prompt")
        assert len(entry_files(shared.folder)) == 1 and shared.cc.CACHE.count("not_shared") == 1
    finally:
        del hashes._hash
        hashes.inline_bytes = saved


def test_the_disk_tier_evicts_least_recently_used_files_within_its_budget(shared):
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    encode(clip, "first")
    (first_path,) = entry_files(shared.folder)
    size = first_path.stat().st_size
    shared.settings.set("conditioning.disk.budget_mib", 1)
    disk = shared.tiers.TIERS.disk
    disk.budget_bytes = int(size * 2.5)  # room for two entries
    try:
        encode(clip, "second")
        first_name = {p.name for p in entry_files(shared.folder)}
        old = time.time() - 2 * disk.TOUCH_S  # written long ago ("first" before "second"): a hit touches them
        for path in entry_files(shared.folder):
            os.utime(path, (old - 10, old - 10) if path == first_path else (old, old))
        shared.cc.CACHE.clear()
        encode(clip, "first")  # a disk hit: now the most recently used
        encode(clip, "third")
        left = entry_files(shared.folder)
        assert len(left) <= 2 and sum(p.stat().st_size for p in left) <= disk.budget_bytes
        assert counter(shared.tiers, "disk", "hits") == 1
        shared.cc.CACHE.clear()
        assert equal(encode(clip, "first"), reference(0, "first"))
        assert counter(shared.tiers, "disk", "hits") == 2  # "first" survived, "second" went
        assert first_name - {p.name for p in entry_files(shared.folder)}
    finally:
        shared.settings.set("conditioning.disk.budget_mib", 4096)


def test_processes_sharing_a_disk_folder_keep_its_budget_between_them(tmp_path):
    """Each process judged the budget by its own writes and rescanned every 30 s: two writing at once filled the
    folder to 1.7 times its budget, each one's usage saying 0.86. Each now rescans after a sixteenth of the
    budget written, so together they stay within it, and what each says is what the folder holds."""
    tiers = rkharness.pack("caching.tiers")
    budget, size = 1 << 20, 100_000
    workers = [tiers.DiskTier(tmp_path, budget), tiers.DiskTier(tmp_path, budget)]  # two processes' tiers
    for i in range(9):
        for w, disk in enumerate(workers):
            disk.write(f"{i:02x}{w:02x}" + "0" * 60, bytes([i]) * size)
    held = sum(p.stat().st_size for p in tmp_path.rglob("*.rkcond"))
    assert held <= budget * (1 + 2 / 16) + size, held
    assert all(abs(disk.usage()[1] - held) <= 2 * size for disk in workers)


# ---- faults: every bad entry is a counted miss ---------------------------------------------------

def _stored_entry(shared, text=TEXT):
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    encode(clip, text)
    shared.cc.CACHE.clear()
    (path,) = entry_files(shared.folder)
    return clip, path


@pytest.mark.hardening
@pytest.mark.parametrize("damage", ["flip a value byte", "truncate", "empty", "garbage header"])
def test_a_corrupted_or_truncated_file_is_a_counted_miss(shared, damage):
    clip, path = _stored_entry(shared)
    data = bytearray(path.read_bytes())
    if damage == "flip a value byte":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data[8:20] = b"not json at!"
    path.write_bytes(bytes(data))
    out = encode(clip)
    assert equal(out, reference(0))
    assert shared.cc.CACHE.count("encodes") == 2 and counter(shared.tiers, "disk", "hits") == 0
    assert counter(shared.tiers, "disk", "rejected.corrupt") == 1
    shared.cc.CACHE.clear()
    assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 1  # rewritten


@pytest.mark.hardening
def test_a_corrupt_entry_is_removed_but_never_a_good_one_written_over_it_since(shared, tmp_path):
    """A reader that found an entry corrupt removes it; but another process may have replaced it with a good
    one between that read and the removal (a write is an os.replace): that one stays, whole, and nothing
    is left beside it."""
    disk = shared.tiers.DiskTier(tmp_path / "tier", 1 << 20)
    name = "ab" + "0" * 62
    good, corrupt = b"a good entry, written by another process", b"the bytes this reader found corrupt"
    disk.write(name, corrupt)
    disk.remove(name, corrupt)
    assert disk.read(name) is None
    disk.write(name, corrupt)
    disk.write(name, good)  # another process, after this reader read the corrupt bytes
    disk.remove(name, corrupt)
    assert disk.read(name) == good
    assert [p.name for p in disk.path(name).parent.iterdir()] == [disk.path(name).name]


@pytest.mark.hardening
def test_a_shared_write_or_read_that_fails_keeps_the_result_and_says_why(shared, monkeypatch):
    """A value the entry format cannot take, or a tier read failing in a way it does not count itself: the
    encode's result is the plain one, and the stats' reasons say the entry was not shared, and why."""
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))

    def cannot_pack(*args, **kwargs):
        raise TypeError("no container registered for this value")

    pack = shared.tiers.pack
    monkeypatch.setattr(shared.tiers, "pack", cannot_pack)
    assert equal(encode(clip), reference(0)) and not entry_files(shared.folder)
    monkeypatch.setattr(shared.tiers, "pack", pack)
    shared.cc.CACHE.clear()

    def fails(*args, **kwargs):
        raise RuntimeError("the tier's index is inconsistent")

    monkeypatch.setattr(shared.tiers.TIERS, "get", fails)
    assert equal(encode(clip), reference(0)) and shared.cc.CACHE.count("encodes") == 2
    reasons = [r["reason"] for r in shared.cc.CACHE.stats.reasons() if r["event"] == "not shared"]
    assert any(r.startswith("the shared write failed: TypeError: no container registered") for r in reasons)
    assert any(r.startswith("the shared read failed: RuntimeError: the tier's index") for r in reasons), reasons


@pytest.mark.hardening
def test_a_publication_check_that_fails_drops_its_entries_and_the_next_ones_publish(shared, monkeypatch):
    """The background check walks the encoder's modules while ComfyUI may be loading them (a dict changing
    size under it): a failed round drops what waited, counted, and the thread lives on; it once died,
    and every later encode waited for it forever."""
    ew = rkharness.pack("patches.encoder_weights")
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    walk = ew._base_weights

    def changing(*args, **kwargs):  # on the publication thread only: the encode's own checks go on
        if threading.current_thread().name == "reusekit-publish":
            raise RuntimeError("dictionary changed size during iteration")
        return walk(*args, **kwargs)

    monkeypatch.setattr(ew, "_base_weights", changing)
    assert equal(encode(clip), reference(0)) and entry_files(shared.folder) == []  # encode() waited for it
    (row,) = shared.cc.CACHE.bypass_reasons()
    assert row["reason"] == "not shared: the check of its encoder's weights after the encode failed: RuntimeError"
    monkeypatch.setattr(ew, "_base_weights", walk)
    assert equal(encode(clip, "another prompt"), reference(0, "another prompt"))
    assert len(entry_files(shared.folder)) == 1


@pytest.mark.hardening
def test_a_foreign_entry_under_the_same_name_is_a_counted_miss(shared):
    clip, path = _stored_entry(shared)
    encode(clip, "a different prompt")
    shared.cc.CACHE.clear()
    other = next(p for p in entry_files(shared.folder) if p != path)
    shutil.copy(other, path)  # a valid, checksummed entry of another key under this key's name
    assert equal(encode(clip), reference(0))
    assert counter(shared.tiers, "disk", "rejected.foreign") == 1 and counter(shared.tiers, "disk", "hits") == 0


@pytest.mark.hardening
def test_with_a_secret_unsigned_and_wrongly_signed_entries_are_counted_misses(shared, monkeypatch):
    clip, path = _stored_entry(shared)  # written without a secret: unsigned
    monkeypatch.setenv("REUSEKIT_CACHE_SECRET", "right")
    shared.tiers.TIERS.configure(shared.settings)
    assert equal(encode(clip), reference(0))
    assert counter(shared.tiers, "disk", "rejected.unsigned") == 1
    monkeypatch.setenv("REUSEKIT_CACHE_SECRET", "wrong")
    shared.tiers.TIERS.configure(shared.settings)
    shared.cc.CACHE.clear()
    encode(clip)  # the entry now on disk is signed with "right"
    assert counter(shared.tiers, "disk", "rejected.unsigned") == 2 and counter(shared.tiers, "disk", "hits") == 0
    monkeypatch.setenv("REUSEKIT_CACHE_SECRET", "right")
    shared.tiers.TIERS.configure(shared.settings)
    shared.cc.CACHE.clear()
    assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 0  # "wrong" rewrote it
    shared.cc.CACHE.clear()
    assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 1
    # a forgery: other values under the right key, with a checksum that matches them
    tiers, data = shared.tiers, path.read_bytes()
    rejected = counter(tiers, "disk", "rejected.unsigned")
    meta, tensors = tiers._header(data), load_file(str(path))
    tensors = {name: t + 1 for name, t in tensors.items()}
    meta["checksum"] = tiers._checksum(meta, tensors)
    path.write_bytes(save(tensors, metadata=meta))
    shared.cc.CACHE.clear()
    assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 1
    assert counter(tiers, "disk", "rejected.unsigned") == rejected + 1
    assert counter(tiers, "disk", "rejected.corrupt") == 0


_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    from reusekit.caching import tiers
    disk = tiers.DiskTier(sys.argv[2], 1 << 30)
    key = tiers.SharedKey(("race",))
    me = int(sys.argv[3])
    stored = ("L", [("T", torch.full((256, 64), float(me)), torch.device("cpu"))])
    data = tiers.pack(key, stored, 0.5, None, {})
    bad = 0
    deadline = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < deadline:
        disk.write(key.name, data)
        got = disk.read(key.name)
        if got is not None:
            value, _ = tiers.unpack(got, key, None, {})
            t = value[1][0][1]
            if not (torch.all(t == 0) or torch.all(t == 1)):
                bad += 1
    print("bad", bad)
""")


@pytest.mark.hardening
def test_two_processes_writing_the_same_entries_at_once_never_read_a_torn_file(shared, tmp_path):
    links = Path(rkharness.PACK.__file__).resolve()  # the pack's folder, importable as `reusekit` via a link
    root = tmp_path / "import"
    root.mkdir()
    (root / "reusekit").symlink_to(links.parent, target_is_directory=True)
    folder = tmp_path / "race"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(folder), str(i), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.strip() == "bad 0"
    assert list(folder.rglob("*.tmp")) == []


@pytest.mark.hardening
def test_a_disk_tier_folder_pointed_at_other_files_never_counts_or_evicts_them(shared):
    clip, path = _stored_entry(shared)
    models = shared.folder / "checkpoints"
    models.mkdir(parents=True)
    precious = models / "model.safetensors"
    precious.write_bytes(b"x" * 100_000)
    stray = shared.folder / "ab" / "notes.safetensors"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"y" * 100_000)
    disk = shared.tiers.TIERS.disk
    disk.budget_bytes = 1  # every entry of ours must go, nothing else
    disk.evict()
    assert not path.exists() and precious.exists() and stray.exists()
    assert disk.usage(fresh=True) == (0, 0)


@pytest.mark.hardening
def test_a_temporary_file_left_by_a_dead_writer_is_never_read_and_is_swept(shared):
    clip, path = _stored_entry(shared)
    tmp = path.with_name(f".{path.name}.999.deadbeef.tmp")
    tmp.write_bytes(path.read_bytes()[:100])  # a half-written file of a writer that died
    old = time.time() - 2 * 3600
    os.utime(tmp, (old, old))
    assert equal(encode(clip), reference(0)) and counter(shared.tiers, "disk", "hits") == 1
    assert shared.tiers.TIERS.disk.usage(fresh=True) == (1, path.stat().st_size)
    assert not tmp.exists()


# ---- the Redis tier ----------------------------------------------------------------------------

@contextlib.contextmanager
def redis_server():
    """A real redis-server on a free loopback port, without persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("no redis-server (make test installs Debian's redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    port = rkharness.free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)
    try:
        yield type("Redis", (), {"url": f"redis://127.0.0.1:{port}/0", "proc": proc, "client": client})
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _use_redis(shared, url, disk=False):
    shared.settings.update({"conditioning.disk.enabled": disk, "conditioning.redis.enabled": True,
                            "conditioning.redis.url": url}, trusted=True)


def test_redis_tier_hit_equals_encoding_and_promotes_to_the_disk_tier(shared):
    with redis_server() as server:
        _use_redis(shared, server.url)
        files = _tiny_files()
        clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
        first = encode(clip)
        assert shared.tiers.TIERS.redis.flush()
        assert len(server.client.keys("reusekit:cond:*")) == 1
        ttl = server.client.ttl(server.client.keys("reusekit:cond:*")[0])
        assert 0 < ttl <= 168 * 3600
        shared.settings.set("conditioning.disk.enabled", True)  # a worker with an empty disk tier
        shared.cc.CACHE.clear()
        again = encode(clip)
        assert equal(again, first) and equal(again, reference(0))
        assert counter(shared.tiers, "redis", "hits") == 1 and shared.cc.CACHE.count("encodes") == 1
        assert len(entry_files(shared.folder)) == 1  # promoted
        shared.cc.CACHE.clear()
        encode(clip)
        assert counter(shared.tiers, "disk", "hits") == 1 and counter(shared.tiers, "redis", "hits") == 1


@pytest.mark.hardening
def test_redis_killed_mid_run_prompts_complete_identically_and_errors_are_counted(shared):
    with redis_server() as server:
        _use_redis(shared, server.url)
        shared.settings.set("conditioning.redis.timeout_ms", 200)
        try:
            files = _tiny_files()
            clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
            encode(clip)
            assert shared.tiers.TIERS.redis.flush()
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            shared.cc.CACHE.clear()
            start = time.perf_counter()
            outs = [encode(clip, t) for t in (TEXT, "second", "third")]
            assert time.perf_counter() - start < 5
            assert all(equal(o, reference(0, t)) for o, t in zip(outs, (TEXT, "second", "third")))
            assert counter(shared.tiers, "redis", "errors") >= 1
            assert counter(shared.tiers, "redis", "hits") == 0
        finally:
            shared.settings.set("conditioning.redis.timeout_ms", 250)


@pytest.mark.hardening
def test_a_truncated_redis_value_and_an_unsigned_one_are_counted_misses(shared, monkeypatch):
    with redis_server() as server:
        _use_redis(shared, server.url)
        files = _tiny_files()
        clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
        encode(clip)
        assert shared.tiers.TIERS.redis.flush()
        (name,) = server.client.keys("reusekit:cond:*")
        value = server.client.get(name)
        server.client.set(name, value[: len(value) - 7])
        shared.cc.CACHE.clear()
        assert equal(encode(clip), reference(0))
        assert counter(shared.tiers, "redis", "rejected.corrupt") == 1
        assert shared.tiers.TIERS.redis.flush()
        server.client.set(name, value)  # valid but unsigned
        monkeypatch.setenv("REUSEKIT_CACHE_SECRET", "s3cret")
        shared.tiers.TIERS.configure(shared.settings)
        shared.cc.CACHE.clear()
        assert equal(encode(clip), reference(0))
        assert counter(shared.tiers, "redis", "rejected.unsigned") == 1
        assert counter(shared.tiers, "redis", "hits") == 0


@pytest.mark.hardening
def test_a_bad_redis_url_is_a_value_error_naming_the_setting_and_changes_nothing(shared):
    with pytest.raises(ValueError, match="conditioning.redis.url"):
        _use_redis(shared, "not-a-url://x")
    assert shared.settings.get("conditioning.redis.url") == "" or not shared.settings.get("conditioning.redis.enabled")
    assert shared.tiers.TIERS.redis is None and shared.tiers.TIERS.disk is not None


def test_without_the_redis_client_the_pack_says_so_once_and_runs(shared, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if not installed
    shared.tiers.TIERS._warned.discard("redis-missing")
    with caplog.at_level("WARNING", logger="reusekit"):
        _use_redis(shared, "redis://127.0.0.1:1/0")
        shared.tiers.TIERS.configure(shared.settings)
    assert shared.tiers.TIERS.redis is None
    assert sum("redis` client is not installed" in r.getMessage() for r in caplog.records) == 1
    files = _tiny_files()
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    assert equal(encode(clip), reference(0))


# ---- two real ComfyUI servers ----------------------------------------------------------------

def _prompt(clip_path: str, out: str, text: str = TEXT) -> dict:
    return {
        "1": {"class_type": "RKTestFileCLIP", "inputs": {"path": clip_path}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
        "3": {"class_type": "RKTestSaveConditioning", "inputs": {"conditioning": ["2", 0], "path": out}},
    }


def _run(server, prompt) -> None:
    history = server.wait_for_prompt(server.queue(prompt))
    assert history["status"]["status_str"] == "success", history["status"]


def _stats(server) -> dict:
    snap = server.get("/reusekit/stats")
    return {c["name"]: c for c in snap["caches"]}


def _saved(path) -> tuple:
    data = load_file(path)
    return data["cond"], data["pooled"]


def test_a_second_server_hits_the_first_servers_encodes_through_the_disk_tier_and_after_a_restart(tmp_path):
    files = _tiny_files()
    clip_path = files.write_tiny_clip_file(str(tmp_path), 0)
    env = {"REUSEKIT_DISK_CACHE": str(tmp_path / "shared-disk")}
    ref = reference(0)
    with rkharness.running_server(env=env) as a:
        _run(a, _prompt(clip_path, str(tmp_path / "a.safetensors")))
        assert _stats(a)["conditioning"]["counters"].get("encodes") == 1
        a.wait_published()
        assert _stats(a)["conditioning"]["counters"].get("published") == 1
    for name in ("b", "c"):  # b: another process; c: the same folder after a restart
        with rkharness.running_server(env=env) as s:
            _run(s, _prompt(clip_path, str(tmp_path / f"{name}.safetensors")))
            stats = _stats(s)
            assert stats["conditioning"]["counters"].get("encodes", 0) == 0
            assert stats["conditioning_disk"]["counters"].get("hits") == 1
            assert stats["conditioning_disk"]["entries"] == 1 and stats["conditioning_disk"]["bytes"]["disk"] > 0
        assert equal(_saved(tmp_path / f"{name}.safetensors"), _saved(tmp_path / "a.safetensors"))
    assert equal(_saved(tmp_path / "a.safetensors"), (ref[0], ref[1]))


def test_a_second_server_hits_through_redis_and_survives_redis_being_killed(tmp_path):
    files = _tiny_files()
    clip_path = files.write_tiny_clip_file(str(tmp_path), 0)
    with redis_server() as redis:
        env = {"REUSEKIT_REDIS_URL": redis.url}
        with rkharness.running_server(env=env) as a:
            _run(a, _prompt(clip_path, str(tmp_path / "a.safetensors")))
            deadline = time.monotonic() + 20
            while not redis.client.keys("reusekit:cond:*") and time.monotonic() < deadline:
                time.sleep(0.1)  # the write-through is asynchronous
        with rkharness.running_server(env=env) as b:
            _run(b, _prompt(clip_path, str(tmp_path / "b.safetensors")))
            stats = _stats(b)
            assert stats["conditioning"]["counters"].get("encodes", 0) == 0
            assert stats["conditioning_redis"]["counters"].get("hits") == 1
            assert equal(_saved(tmp_path / "b.safetensors"), _saved(tmp_path / "a.safetensors"))
            os.killpg(redis.proc.pid, signal.SIGKILL)
            redis.proc.wait(10)
            for i, text in enumerate(("after the kill", "and again")):
                _run(b, _prompt(clip_path, str(tmp_path / f"k{i}.safetensors"), text))
                assert equal(_saved(tmp_path / f"k{i}.safetensors"), reference(0, text))
            stats = _stats(b)
            assert stats["conditioning_redis"]["counters"].get("errors", 0) >= 1
            assert stats["conditioning"]["counters"].get("encodes") == 2
    assert equal(_saved(tmp_path / "a.safetensors"), reference(0))


# ---- what never reaches a shared tier ----------------------------------------------------------

def test_an_edit_the_cheap_check_misses_never_reaches_another_worker(shared):
    """Worker A zeroes one attention head of its encoder in place, where the cheap check samples nothing;
    its encode is its edited weights' own, and the publication check (a full fingerprint after the
    encode) keeps it from the disk tier, counted with its reason. Worker B, a fresh load of the same
    file, gets ComfyUI's clean output; A's next check is a full one and starts a new generation."""
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0, files.CLIP_HEADS)
    a = files.load_tiny_clip_file(path, files.CLIP_HEADS)
    weight, rows = files.unsampled_head(a)
    with torch.inference_mode():
        weight[rows] = 0
    text = "one head less"
    edited = encode(a, text)
    assert entry_files(shared.folder) == [] and counter(shared.tiers, "disk", "misses") == 1
    (row,) = shared.cc.CACHE.bypass_reasons()
    assert "differed from their reference in full after the encode" in row["reason"], row
    b = files.load_tiny_clip_file(path, files.CLIP_HEADS)
    clean = encode(b, text)
    assert counter(shared.tiers, "disk", "hits") == 0 and len(entry_files(shared.folder)) == 1
    fresh = files.load_tiny_clip_file(path, files.CLIP_HEADS)
    settings = shared.settings
    settings.set("conditioning.enabled", False)
    try:
        expected = fresh.encode_from_tokens(fresh.tokenize(text), return_pooled=True)
        with torch.inference_mode():
            files.unsampled_head(fresh)[0][rows] = 0
        expected_edited = fresh.encode_from_tokens(fresh.tokenize(text), return_pooled=True)
    finally:
        settings.set("conditioning.enabled", True)
    assert equal(clean, expected) and equal(edited, expected_edited) and not equal(clean, edited)
    generation = getattr(a.cond_stage_model, "_reusekit_generation", 0)
    assert equal(encode(a, text), expected_edited)  # A's next check: in full, a new generation, no stale hit
    assert getattr(a.cond_stage_model, "_reusekit_generation", 0) == generation + 1
    assert len(entry_files(shared.folder)) == 1


def test_an_entry_waiting_for_publication_when_an_edit_is_seen_is_never_published(shared, monkeypatch):
    """An edit the cheap check misses (a head) and one it sees later (an embedding row only the second
    prompt reads): the second encode starts a new generation whose reference is the edited weights, so
    the first encode's entry, still waiting, would pass a publication check against that reference. It
    is dropped instead (its generation is gone); a fresh worker gets ComfyUI's clean output."""
    files = _tiny_files()
    weights = rkharness.pack("patches.encoder_weights")
    gate = threading.Event()
    real = weights._publication_check
    monkeypatch.setattr(weights, "_publication_check", lambda *a: gate.wait(30) and real(*a))
    path = files.write_tiny_clip_file(str(shared.files), 0, files.CLIP_HEADS)
    a = files.load_tiny_clip_file(path, files.CLIP_HEADS)
    files.edit_weights(a, "head")
    files.edit_weights(a, "embedding_row", "circle")
    first = a.encode_from_tokens(a.tokenize("a red square"), return_pooled=True)
    a.encode_from_tokens(a.tokenize("a blue circle"), return_pooled=True)  # sees the row: a new generation
    gate.set()
    published()
    assert entry_files(shared.folder) == []
    b = files.load_tiny_clip_file(path, files.CLIP_HEADS)
    clean = encode(b, "a red square")
    assert counter(shared.tiers, "disk", "hits") == 0 and not equal(clean, first)


@pytest.mark.parametrize("action", ["clear", "budget 0", "entries 0", "checks off", "budget 0 and back"])
def test_a_panel_action_while_an_entry_waits_for_publication_keeps_it_off_the_shared_tiers(shared, monkeypatch, action):
    """The publication check runs on its own thread, seconds after the encode on a large encoder. A clear, a
    budget or limit of 0, or the weight checks switched off ("the shared tiers neither read nor write") in that
    time kept nothing in this process but still wrote the entry to the disk tier. Now it is not written, and
    counted as not shared, even where the limit was set back before the check ended; the encode's own result is
    the encoder's."""
    files = _tiny_files()
    weights = rkharness.pack("patches.encoder_weights")
    gate = threading.Event()
    real = weights._publication_check
    monkeypatch.setattr(weights, "_publication_check", lambda *a: gate.wait(30) and real(*a))
    act, undo = {
        "clear": (lambda: rkharness.pack("caching.stats").REGISTRY.clear(None), lambda: None),
        "budget 0": (lambda: shared.settings.update({"conditioning.budget_mib": 0}),
                     lambda: shared.settings.update({"conditioning.budget_mib": 512})),
        "entries 0": (lambda: shared.settings.update({"conditioning.max_entries": 0}),
                      lambda: shared.settings.update({"conditioning.max_entries": 128})),
        "checks off": (lambda: shared.settings.update({"conditioning.check_weight_edits": "off"}),
                       lambda: shared.settings.update({"conditioning.check_weight_edits": "events"})),
        "budget 0 and back": (lambda: [shared.settings.update({"conditioning.budget_mib": b}) for b in (0, 512)],
                              lambda: None),
    }[action]
    clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
    try:
        out = clip.encode_from_tokens(clip.tokenize(TEXT), return_pooled=True)
        worker = threading.Thread(target=act)  # the panel's route, on the server's thread
        worker.start()
        worker.join(30)
        gate.set()
        assert entry_files(shared.folder) == [] and equal(out, reference(0))
        assert any("before its shared write" in r["reason"] for r in shared.cc.CACHE.bypass_reasons()), \
            shared.cc.CACHE.bypass_reasons()
    finally:
        gate.set()
        undo()
    encode(clip)  # the same encode with nothing done meanwhile is written
    assert len(entry_files(shared.folder)) == 1


def test_checks_switched_on_compare_with_the_weights_as_loaded(shared):
    """Loaded with the checks off, edited, then checks on: the first encode compares with the weights as
    loaded (taken in every mode), so the edit is an edit, never the reference: nothing reaches the disk
    tier, and a fresh load of the clean file encodes ComfyUI's output."""
    files = _tiny_files()
    shared.settings.set("conditioning.check_weight_edits", "off")
    try:
        path = files.write_tiny_clip_file(str(shared.files), 3)
        a = files.load_tiny_clip_file(path)
        with torch.inference_mode():
            a.cond_stage_model.clip_l.transformer.text_model.final_layer_norm.weight.mul_(1.5)
        shared.settings.set("conditioning.check_weight_edits", "events")
        edited = encode(a)
        assert entry_files(shared.folder) == []
        clean = encode(files.load_tiny_clip_file(path))
        assert counter(shared.tiers, "disk", "hits") == 0 and equal(clean, reference(3))
        assert not equal(edited, clean)
    finally:
        shared.settings.set("conditioning.check_weight_edits", "events")


def test_with_edit_checks_off_the_shared_tiers_neither_read_nor_write(shared):
    """A worker with ``conditioning.check_weight_edits`` off cannot vouch that its weights are the
    file's: its encodes of edited weights are never written under the file's key, nor read."""
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    encode(files.load_tiny_clip_file(path))  # the file's true entry
    read = counter(shared.tiers, "disk", "misses")
    shared.settings.set("conditioning.check_weight_edits", "off")
    try:
        clip = files.load_tiny_clip_file(path)
        files.edit_weights(clip, "small")
        out = encode(clip)
        assert not equal(out, reference(0)) and len(entry_files(shared.folder)) == 1
        assert counter(shared.tiers, "disk", "hits") == 0 and counter(shared.tiers, "disk", "misses") == read
    finally:
        shared.settings.set("conditioning.check_weight_edits", "events")
    assert equal(encode(files.load_tiny_clip_file(path)), reference(0)) and counter(shared.tiers, "disk", "hits") == 1


def test_a_file_replaced_while_its_old_weights_stay_loaded_never_files_them_under_the_new_content(shared):
    """A re-download or a trainer saving each epoch to one name: the weights loaded before keep their
    in-process entries, but never reach the shared tiers under the new file's content."""
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    old = files.load_tiny_clip_file(path)
    (shared.files / "next").mkdir()
    os.replace(files.write_tiny_clip_file(str(shared.files / "next"), 1), path)  # the same name now holds seed 1's weights
    out = encode(old)
    assert equal(out, reference(0)) and entry_files(shared.folder) == []
    assert equal(encode(old), out) and shared.cc.CACHE.count("hits") == 1  # still an in-process hit
    fresh = files.load_tiny_clip_file(path)
    assert equal(encode(fresh), reference(1)) and counter(shared.tiers, "disk", "hits") == 0
    assert len(entry_files(shared.folder)) == 1


def test_a_vae_edited_between_its_loader_and_its_first_encode_never_reaches_the_shared_tiers(shared):
    """VAELoader (found through ComfyUI's reload factory): the weights were fingerprinted as the loader
    built them, so an edit before the first encode is seen and the edited encodes stay in-process."""
    import folder_paths
    from safetensors.torch import save_file

    import nodes

    folder = shared.files / "vae"
    folder.mkdir()
    state = _tiny_files().tiny_wan_vae(0).first_stage_model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "rk_edit_wan.safetensors"))
    folder_paths.add_model_folder_path("vae", str(folder))
    edited = nodes.VAELoader().load_vae("rk_edit_wan.safetensors")[0]
    if getattr(edited.patcher, "cached_patcher_init", None) is None:
        pytest.skip("this ComfyUI's VAELoader records no file (no ModelPatcher.cached_patcher_init)")
    with torch.inference_mode():
        next(edited.first_stage_model.parameters()).mul_(1.5)
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(1))
    out = edited.encode(image)
    assert entry_files(shared.folder) == []
    clean = nodes.VAELoader().load_vae("rk_edit_wan.safetensors")[0]
    expected = clean.encode(image)
    assert not torch.equal(out, expected) and len(entry_files(shared.folder)) == 1
    shared.cc.CACHE.clear()
    again = nodes.VAELoader().load_vae("rk_edit_wan.safetensors")[0]
    assert torch.equal(again.encode(image), expected) and counter(shared.tiers, "disk", "hits") == 1


def test_weights_edited_before_the_tiers_are_switched_on_never_reach_them(shared):
    files = _tiny_files()
    path = files.write_tiny_clip_file(str(shared.files), 0)
    shared.settings.set("conditioning.disk.enabled", False)
    clip = files.load_tiny_clip_file(path)  # the reference is taken at load, tiers on or off
    files.edit_weights(clip, "embedding_row", TEXT)
    shared.settings.set("conditioning.disk.enabled", True)
    out = encode(clip)
    assert not equal(out, reference(0)) and entry_files(shared.folder) == []
    assert equal(encode(files.load_tiny_clip_file(path)), reference(0)) and len(entry_files(shared.folder)) == 1


def test_disk_tier_files_never_show_in_comfyuis_model_lists(shared):
    """A disk-tier folder under a models folder: its entries are not model files to ComfyUI."""
    import folder_paths

    models = shared.files / "checkpoints"
    models.mkdir()
    folder_paths.add_model_folder_path("checkpoints", str(models))
    shared.settings.set("conditioning.disk.folder", str(models / "reusekit"), trusted=True)
    files = _tiny_files()
    encode(files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0)))
    assert len(entry_files(models / "reusekit")) == 1
    assert not [f for f in folder_paths.get_filename_list("checkpoints") if f.startswith("reusekit")]


def _encode_into(done: list, clip) -> None:
    """An encode on a worker thread (as ComfyUI's executor runs it: under inference mode)."""
    with torch.inference_mode():
        done.append(encode(clip))


@pytest.mark.hardening
@pytest.mark.parametrize("what", ["fifo", "link to /dev/zero", "link to a valid entry", "oversized"])
def test_a_fifo_a_link_or_an_oversized_file_where_an_entry_should_be_is_a_counted_rejection(shared, what):
    """The disk tier opens entries without following links and without blocking, and reads only a
    regular file under its size cap: a FIFO (which hung an encode) or /dev/zero never holds one up."""
    clip, path = _stored_entry(shared)
    if what == "oversized":
        shared.tiers.TIERS.disk.max_bytes = path.stat().st_size - 1
    else:
        valid = path.with_name("valid")
        os.replace(path, valid)
        if what == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero" if what == "link to /dev/zero" else valid)
    done = []
    worker = threading.Thread(target=_encode_into, args=(done, clip), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "the encode hung on the disk tier"
    assert equal(done[0], reference(0)) and counter(shared.tiers, "disk", "hits") == 0
    reason = "oversize" if what == "oversized" else "not_a_file"
    assert counter(shared.tiers, "disk", f"rejected.{reason}") == 1


@pytest.mark.hardening
def test_an_entry_whose_header_is_over_the_cap_is_rejected_before_it_is_parsed(shared, monkeypatch):
    """A header is JSON parsed before any check (key, checksum, signature): a planted entry of a large one cost
    every reader many times its bytes in memory, even with a secret set. One over the cap is rejected unparsed,
    and an entry whose own header would be over it is never written."""
    import json
    import struct

    clip, path = _stored_entry(shared)
    tiers = shared.tiers
    n = tiers.MAX_HEADER_BYTES + 1
    header = b"[" + b"{}," * ((n - 4) // 3) + b"{}]"  # (what parses slowest: many times its bytes held)
    path.write_bytes(struct.pack("<Q", n) + header + b" " * (n - len(header)) + bytes(16))
    parsed = []
    real = json.loads
    monkeypatch.setattr(tiers.json, "loads", lambda text, *a, **k: parsed.append(len(text)) or real(text, *a, **k))
    assert equal(encode(clip), reference(0))
    assert counter(tiers, "disk", "rejected.corrupt") == 1 and counter(tiers, "disk", "hits") == 0
    assert not parsed or max(parsed) <= tiers.MAX_HEADER_BYTES, parsed
    monkeypatch.setattr(tiers, "MAX_HEADER_BYTES", 64)  # a reader would reject this entry: it is not written
    with pytest.raises(ValueError, match="header is over"):
        tiers.pack(tiers.SharedKey("x" * 100), shared.cc.freeze(torch.ones(2))[0], 0.0, None, {})


@pytest.mark.hardening
def test_an_entry_folder_someone_replaced_with_a_link_is_never_read_written_counted_or_swept(shared, tmp_path):
    """An entry's folder (``<2 hex>``) replaced by a link to a folder elsewhere: O_NOFOLLOW covers the file alone,
    so the tier read entries through it, wrote there, counted the files there and evicted them. Now a read is a
    counted rejection, a write a counted refusal, and the files elsewhere are neither counted nor removed."""
    clip, path = _stored_entry(shared)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.replace(path, elsewhere / path.name)  # a valid entry, reached only through the link
    other = elsewhere / (path.parent.name + "f" * 62 + path.suffix)
    other.write_bytes(b"another tier's file")
    path.parent.rmdir()
    path.parent.symlink_to(elsewhere, target_is_directory=True)
    assert equal(encode(clip), reference(0))
    assert counter(shared.tiers, "disk", "rejected.not_a_file") == 1 and counter(shared.tiers, "disk", "hits") == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([path.name, other.name])  # nothing written there
    assert any("could not be written" in r["reason"] for r in shared.tiers.TIERS.stats["disk"].reasons())
    disk = shared.tiers.TIERS.disk
    assert disk.usage(fresh=True) == (0, 0)
    disk.budget_bytes = 0
    disk.evict()
    disk.remove(path.stem, (elsewhere / path.name).read_bytes())
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([path.name, other.name])  # nothing swept there


@pytest.mark.hardening
def test_a_malformed_unsigned_entry_is_a_counted_rejection(shared):
    """An entry whose checksum is right but whose value names a device that is no device: rejected
    and counted as malformed, never an exception out of the tier and never a hit."""
    import json

    clip, path = _stored_entry(shared)
    tiers = shared.tiers
    data = path.read_bytes()
    meta = tiers._header(data)
    tensors = load_file(str(path))
    value = json.loads(meta["value"])
    first_tensor = value
    while "T" not in first_tensor:
        first_tensor = next(iter(first_tensor.values()))[0]
    first_tensor["on"] = "not a device at all"
    meta["value"] = json.dumps(value)
    meta.pop("checksum")
    meta["checksum"] = tiers._checksum(meta, tensors)
    path.write_bytes(save(tensors, metadata=meta))
    assert equal(encode(clip), reference(0))
    assert counter(shared.tiers, "disk", "rejected.malformed") == 1 and counter(shared.tiers, "disk", "hits") == 0


@pytest.mark.hardening
def test_read_deadlines_fire_once_each_only_for_the_reads_still_running():
    """The Redis tier's watchdog: a deadline that passes expires once and its read learns so; a read
    done in time is never cut, nor is one armed after another fired; close ends the thread."""
    tiers = rkharness.pack("caching.tiers")
    cut = []
    deadlines = tiers._Deadlines(lambda: cut.append(time.monotonic()))
    early, slow = deadlines.arm(30.0), deadlines.arm(0.05)
    time.sleep(0.3)
    assert len(cut) == 1 and deadlines.disarm(slow) and not deadlines.disarm(slow)
    later = deadlines.arm(0.2)  # armed while the thread waits for a later deadline (early's)
    assert not deadlines.disarm(early)
    time.sleep(0.5)
    assert len(cut) == 2 and deadlines.disarm(later)
    quick = deadlines.arm(0.1)
    assert not deadlines.disarm(quick)
    time.sleep(0.3)
    assert len(cut) == 2
    deadlines.close()
    deadlines._thread.join(2)
    assert not deadlines._thread.is_alive()


@pytest.mark.hardening
def test_a_redis_server_that_drips_one_byte_at_a_time_cannot_hold_an_encode(shared):
    """A server that answers every read with a large value a byte at a time: the read gives up at its
    total deadline (four socket timeouts), the tier's breaker opens, and the encode completes."""
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve(conn):
        with conn:
            conn.settimeout(0.2)
            while not stop.is_set():
                try:
                    got = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not got:
                    return
                if b"HELLO" in got.upper():  # the client's handshake (RESP3): a map holding the protocol
                    conn.sendall(b"%1\r\n+proto\r\n:3\r\n")
                    continue
                if b"GETRANGE" not in got.upper():
                    conn.sendall(b"+OK\r\n")
                    continue
                try:
                    conn.sendall(b"$250000\r\n")
                    while not stop.is_set():
                        conn.sendall(b"x")
                        time.sleep(0.05)
                except OSError:
                    return

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        _use_redis(shared, f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
        files = _tiny_files()
        clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
        done = []
        start = time.monotonic()
        worker = threading.Thread(target=_encode_into, args=(done, clip), daemon=True)
        worker.start()
        worker.join(30)
        assert done, "the encode hung on a dripping Redis server"
        assert time.monotonic() - start < 25  # the drip alone would take over 3 hours
        assert equal(done[0], reference(0)) and counter(shared.tiers, "redis", "errors") >= 1
        assert counter(shared.tiers, "redis", "hits") == 0
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()


@pytest.mark.hardening
def test_a_redis_value_over_the_size_cap_is_rejected_unread(shared):
    with redis_server() as server:
        _use_redis(shared, server.url)
        files = _tiny_files()
        clip = files.load_tiny_clip_file(files.write_tiny_clip_file(str(shared.files), 0))
        encode(clip)
        shared.tiers.TIERS.redis.flush()
        (stored,) = server.client.keys("reusekit:cond:*")
        size = server.client.strlen(stored)
        shared.tiers.TIERS.redis.max_bytes = size // 2
        shared.cc.CACHE.clear()
        assert equal(encode(clip), reference(0))
        assert counter(shared.tiers, "redis", "rejected.oversize") == 1 and counter(shared.tiers, "redis", "hits") == 0


def test_the_tier_locations_are_set_from_the_environment_only_and_the_url_is_shown_redacted(tmp_path):
    """Through a real server: GET /reusekit/settings shows the Redis URL without its password, and no
    client of ComfyUI's API can point the disk or Redis tier elsewhere (a 400 naming the variable)."""
    import urllib.error

    env = {"REUSEKIT_REDIS_URL": "redis://:s3cret-pass@127.0.0.1:9/0", "REUSEKIT_DISK_CACHE": str(tmp_path / "d")}
    with rkharness.running_server(env=env) as server:
        settings = server.get("/reusekit/settings")["settings"]
        url = settings["conditioning.redis.url"]
        assert "s3cret" not in repr(settings) and url["value"] == "redis://***@127.0.0.1:9/0" and url["readonly"]
        assert "s3cret" not in repr(server.get("/reusekit/stats"))
        for key, value, variable in (("conditioning.redis.url", "redis://127.0.0.1:6379/0", "REUSEKIT_REDIS_URL"),
                                     ("conditioning.disk.folder", "/tmp/elsewhere", "REUSEKIT_DISK_CACHE")):
            with pytest.raises(urllib.error.HTTPError) as err:
                server.post("/reusekit/settings", {key: value})
            assert err.value.code == 400 and variable in err.value.read().decode()
        assert server.get("/reusekit/settings")["settings"]["conditioning.disk.folder"]["value"] == str(tmp_path / "d")


@pytest.mark.hardening
def test_a_redis_url_set_at_start_that_is_not_one_is_said_on_the_tiers_card(tmp_path):
    """REUSEKIT_REDIS_URL=localhost:6379 (no scheme): the tier stays off and the pack loads, but the card told a
    user with the client installed to install it. It says what is wrong with the URL, quoting none of it: a
    password holding a slash is read by redis-py as the port, and its error quotes it."""
    for url, why in (("s3cret@localhost:6379", "it names no redis://"),
                     ("redis://default:s3cret/x@cache.internal:6379/0", "its port, database or options")):
        with rkharness.running_server(env={"REUSEKIT_REDIS_URL": url}) as server:
            (card,) = [c for c in server.get("/reusekit/stats")["caches"] if c["name"] == "conditioning_redis"]
        assert card["off"].startswith(f"REUSEKIT_REDIS_URL is not a Redis URL ({why}") and "s3cret" not in card["off"]


def test_the_cache_stats_node_says_how_to_turn_an_off_tier_on_without_the_server(shared):
    """The tiers publish their "off" line themselves (a settler of the stats registry): the Cache Stats
    node says it in a process without the panel's routes (an API worker, this test), and stops once the
    tier is on."""
    node = rkharness.pack("nodes.stats").CacheStatsNode
    text = node.execute().args[0]
    assert "conditioning_disk: off" not in text  # the fixture turned it on
    assert ("conditioning_redis: off — start ComfyUI with REUSEKIT_REDIS_URL=redis://<host>:<port>/<db>"
            in text), text
    shared.settings.update({"conditioning.disk.enabled": False}, trusted=True)
    text = node.execute().args[0]
    assert ('conditioning_disk: off — turn on "conditioning disk enabled" in the panel\'s settings, or start '
            "ComfyUI with REUSEKIT_DISK_CACHE=<folder>") in text, text
