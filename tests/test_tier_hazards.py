"""Conditioning cache, shared tiers: hazards found in review, each reproduced with real parts (a real
redis-server on loopback, behind a throttling TCP proxy where a slow link is the point, the pack's own
tiers and settings): a password shown in any URL form, a malformed entry that escapes the counters, a
large entry over a slow link that broke the tier for every other call, a settings change that left a read
without its deadline, and entry files readable by every user of the host."""

import contextlib
import json
import logging
import os
import socket
import stat
import struct
import threading
import time

import pytest
import rkharness
import test_conditioning_tiers
import torch
from safetensors.torch import load, save
from test_conditioning_tiers import _use_redis, counter, redis_server

pytestmark = [pytest.mark.conditioning, pytest.mark.hardening]

shared = test_conditioning_tiers.shared  # the fixture: global mode on, the disk tier in a fresh folder

MIB = 1 << 20
SECRET = "s3cret-pass"
CPU = torch.device("cpu")


def _entry(tiers, text: str, nbytes: int, secret: bytes | None = None):
    """(key, tensor, entry bytes) of a stored value holding one tensor of ``nbytes`` random bytes."""
    key = tiers.SharedKey.of_text(text)
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    return key, value, tiers.pack(key, ("T", value, CPU), 1.5, secret, {})


def _read(tiers, key):
    """The shared tiers' read as an encode makes it: the stored tensor, or None."""
    got = tiers.TIERS.get(key, {}, None)
    return None if got is None else got[0][1]


def _port(server) -> int:
    return server.client.connection_pool.connection_kwargs["port"]


@contextlib.contextmanager
def slow_link(port: int, rate: float, latency: float = 0.0):
    """A loopback TCP proxy in front of 127.0.0.1:``port``; yields its ``redis://`` URL. What the server
    sends reaches the client at ``rate`` bytes/s, each chunk at least ``latency`` s after the server sent
    it; what the client sends passes at once."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    socks: list[socket.socket] = []

    def pipe(src, dst, paced):
        size = max(1024, int(rate) // 32) if paced else 1 << 16
        due = time.monotonic()
        with contextlib.suppress(OSError):
            while not stop.is_set():
                data = src.recv(size)
                if not data:
                    break
                if paced:
                    due = max(due, time.monotonic() + latency)
                    if stop.wait(max(0.0, due - time.monotonic())):
                        break
                    due += len(data) / rate
                dst.sendall(data)
        for s in (src, dst):  # one side gone: the other direction ends too
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept():
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", port))
            socks.extend((client, upstream))
            threading.Thread(target=pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client, True), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@contextlib.contextmanager
def setting(settings, key, value):
    before = settings.get(key)
    settings.set(key, value)
    try:
        yield
    finally:
        settings.set(key, before)


# ---- R6: a password is never shown, in any form a URL can carry it -----------------------------

URL_FORMS = {
    "query": "redis://127.0.0.1:{port}/0?password={pw}",
    "query, percent-encoded name and value": "redis://127.0.0.1:{port}/0?db=0&pass%77ord=s3cret%2Dpass",
    "user and password": "redis://default:{pw}@127.0.0.1:{port}/0",
    "password only": "redis://:{pw}@127.0.0.1:{port}/0",
}


@pytest.mark.parametrize("form", list(URL_FORMS))
def test_a_redis_password_in_any_url_form_is_used_and_never_shown(shared, caplog, form):
    """The server requires the password, so a hit proves the tier used it; then neither GET
    /reusekit/settings's payload, nor the stats, nor the log line of a failure shows it."""
    routes = rkharness.pack("routes")
    with redis_server() as server:
        server.client.config_set("requirepass", SECRET)
        _use_redis(shared, URL_FORMS[form].format(port=_port(server), pw=SECRET))
        key, value, data = _entry(shared.tiers, "password", 1024)
        assert shared.tiers.TIERS.redis.write(key.name, data) and shared.tiers.TIERS.redis.flush()
        assert torch.equal(_read(shared.tiers, key), value)
        shared.tiers.TIERS.publish()
        shown = json.dumps(routes.settings_payload()) + json.dumps(routes.snapshot())
        assert f"127.0.0.1:{_port(server)}" in shown  # the URL is there, its password is not
        os.killpg(server.proc.pid, 9)
        server.proc.wait(10)
        with caplog.at_level(logging.WARNING, logger="reusekit"):
            assert _read(shared.tiers, shared.tiers.SharedKey.of_text("other")) is None
        assert counter(shared.tiers, "redis", "errors") == 1 and "Redis tier at" in caplog.text
        shown += caplog.text + json.dumps(routes.snapshot())
    assert "s3cret" not in shown


@pytest.mark.parametrize("url, expected", [
    ("redis://h:6379/0?password=pw&db=1", "redis://h:6379/0?password=***&db=1"),
    ("rediss://h:6380/0?ssl_password=pw&ssl_certfile=/c.pem", "rediss://h:6380/0?ssl_password=***&ssl_certfile=/c.pem"),
    ("redis://h/0?PASSWORD=pw", "redis://h/0?PASSWORD=***"),
    ("redis://h/0?pass%77ord=pw", "redis://h/0?pass%77ord=***"),
    ("redis://user:pw@h:6379/0", "redis://***@h:6379/0"),
    ("redis://:p?w@h:6379/0", "redis://***@h:6379/0"),  # an unescaped '?' in the password: all before '@' goes
    ("unix://:pw@/run/redis.sock?db=0", "unix://***@/run/redis.sock?db=0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
], ids=["query", "ssl_password", "upper case", "percent-encoded name", "user:pw@", "? in the password", "unix",
        "no password"])
def test_redacted_hides_every_form_of_a_password_and_keeps_the_rest(url, expected):
    assert rkharness.pack("caching.tiers")._redacted(url) == expected


# ---- R7: any malformed entry is a counted rejection and a miss ---------------------------------

def _malformed(tiers, how: str):
    """(key, bytes) of an entry that passes the format and key checks and then breaks a later one."""
    key, _, data = _entry(tiers, f"malformed {how}", 64, tiers.TIERS.secret)
    if how == "nested header":  # deeper than json's recursion limit
        return key, struct.pack("<Q", 200_000) + b"[" * 200_000
    tensors = load(data)
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8:8 + n])["__metadata__"]
    meta["hmac" if how == "non-ASCII signature" else "checksum"] = "\u00e9" * 8
    return key, save(tensors, metadata=meta)


@pytest.mark.parametrize("how", ["non-ASCII checksum", "non-ASCII signature", "nested header"])
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_malformed_entry_is_a_counted_rejection_and_a_miss(shared, monkeypatch, tier, how):
    monkeypatch.setenv("REUSEKIT_CACHE_SECRET", "sign")
    shared.tiers.TIERS.configure(shared.settings)
    key, data = _malformed(shared.tiers, how)
    with contextlib.ExitStack() as stack:
        if tier == "redis":
            server = stack.enter_context(redis_server())
            _use_redis(shared, server.url)
            server.client.set(shared.tiers.RedisTier.PREFIX + key.name, data)
        else:
            path = shared.tiers.TIERS.disk.path(key.name)
            path.parent.mkdir(parents=True)
            path.write_bytes(data)
        assert _read(shared.tiers, key) is None
    assert counter(shared.tiers, tier, "rejected") == 1 and counter(shared.tiers, tier, "rejected.malformed") == 1
    assert counter(shared.tiers, tier, "misses") == 1 and counter(shared.tiers, tier, "errors") == 0


# ---- R8a: a large entry over a slow link ----------------------------------------------------------

def test_an_entry_larger_than_the_base_deadline_allows_is_read_over_a_link_above_the_floor_rate(shared):
    """8 MiB at 4 MiB/s takes 2 s, twice the base deadline (four 250 ms timeouts); the deadline grows
    with the entry's size (a second per MiB, RedisTier.MIN_RATE), so the read is a hit."""
    with redis_server() as server, slow_link(_port(server), 4 * MIB) as url:
        key, value, data = _entry(shared.tiers, "eight MiB", 8 * MIB)
        server.client.set(shared.tiers.RedisTier.PREFIX + key.name, data)
        _use_redis(shared, url)
        assert torch.equal(_read(shared.tiers, key), value)
        assert counter(shared.tiers, "redis", "hits") == 1 and counter(shared.tiers, "redis", "errors") == 0


def test_an_entry_too_slow_for_its_link_is_its_own_rejection_and_harms_no_other_call(shared):
    """1 MiB at 64 KiB/s (16 s) passes its deadline (4 s base, at 1000 ms timeouts, + 1 s for its size):
    a counted ``too_slow`` rejection. It cuts only its own connection: a writer whose SETs are in flight
    meanwhile (each answered 250 ms late) writes every one, and the next read is not skipped."""
    tiers = shared.tiers
    with redis_server() as server, slow_link(_port(server), 64 * 1024, latency=0.25) as url, \
            setting(shared.settings, "conditioning.redis.timeout_ms", 1000):
        key, _, data = _entry(tiers, "one MiB", MIB)
        small, value, small_data = _entry(tiers, "small", 1024)
        server.client.set(tiers.RedisTier.PREFIX + key.name, data)
        server.client.set(tiers.RedisTier.PREFIX + small.name, small_data)
        _use_redis(shared, url)
        writes = 32  # at 250 ms each, in flight for 8 s: past the read's deadline
        assert all(tiers.TIERS.redis.write(f"w{i}", b"x" * 100) for i in range(writes))
        start = time.monotonic()
        assert _read(tiers, key) is None
        assert time.monotonic() - start < 12  # the whole value would take 16 s
        assert counter(tiers, "redis", "rejected.too_slow") == 1 and counter(tiers, "redis", "misses") == 1
        assert tiers.TIERS.redis.flush(30)
        assert counter(tiers, "redis", "written") == writes and counter(tiers, "redis", "errors") == 0
        assert server.client.exists(*(f"{tiers.RedisTier.PREFIX}w{i}" for i in range(writes))) == writes
        assert torch.equal(_read(tiers, small), value) and counter(tiers, "redis", "hits") == 1


# ---- R8d: a settings change never strands a read past its deadline -------------------------------

def test_a_settings_change_during_a_read_never_strands_it_past_its_deadline(shared):
    """A read of 1 MiB at 64 KiB/s (16 s) with a deadline of 2 s; a tier setting changes while it runs
    (the tiers are rebuilt and the old Redis tier closed): the read still ends at its deadline."""
    tiers = shared.tiers
    with redis_server() as server, slow_link(_port(server), 64 * 1024) as url, \
            setting(shared.settings, "conditioning.redis.ttl_hours", 168):
        key, _, data = _entry(tiers, "one MiB", MIB)
        server.client.set(tiers.RedisTier.PREFIX + key.name, data)
        _use_redis(shared, url)
        done = []
        reader = threading.Thread(target=lambda: done.append(_read(tiers, key)), daemon=True)
        reader.start()
        time.sleep(0.3)
        shared.settings.set("conditioning.redis.ttl_hours", 24)
        reader.join(10)
        assert done == [None], "the read ran past its deadline after a settings change"
        assert counter(tiers, "redis", "rejected.too_slow") == 1


def test_a_closed_watchdog_still_cuts_the_calls_armed_before_and_after_closing():
    tiers = rkharness.pack("caching.tiers")
    cut = []
    deadlines = tiers._Deadlines(lambda: cut.append(1))

    def cuts(n):
        until = time.monotonic() + 5
        while len(cut) < n and time.monotonic() < until:
            time.sleep(0.01)
        return len(cut) == n

    before = deadlines.arm(0.2)
    deadlines.close()
    assert cuts(1) and deadlines.disarm(before)
    after = deadlines.arm(0.1)  # a read that took the tier just before the settings replaced it
    assert cuts(2) and deadlines.disarm(after)
    deadlines._thread.join(5)
    assert not deadlines._thread.is_alive()  # closed with nothing armed: the thread ends


# ---- R14: tier files are private to their user -----------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask 022", "umask 000"])
def test_disk_tier_files_and_the_folders_it_creates_are_private_whatever_the_umask(shared, umask):
    tiers = shared.tiers
    made = shared.files / "made"
    shared.settings.set("conditioning.disk.folder", str(made / "here"), trusted=True)
    key, value, _ = _entry(tiers, "private", 1024)
    mode_before = stat.S_IMODE(shared.files.stat().st_mode)
    old = os.umask(umask)
    try:
        tiers.TIERS.put(key, ("T", value, CPU), 1.0, {})
    finally:
        os.umask(old)
    path = tiers.TIERS.disk.path(key.name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (path.parent, made / "here", made):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(shared.files.stat().st_mode) == mode_before  # a folder it did not create is left alone
    assert torch.equal(_read(tiers, key), value)
