"""The cache panel's server side: HTTP routes under ``/reusekit/`` and a throttled websocket push.

Routes (ComfyUI also serves each under ``/api``):

- ``GET  /reusekit/stats``     the stats registry's snapshot (``schema`` = ``caching.stats.SCHEMA_VERSION``)
- ``POST /reusekit/clear``     ``{"cache": name}`` clears one cache, ``{"all": true}`` every clearable one
- ``GET  /reusekit/settings``  every runtime setting with its type, range and value
- ``POST /reusekit/settings``  ``{key: value, ...}``, validated all or nothing: 400 with the message on
  a bad value, and then nothing changes

A POST must say ``Content-Type: application/json`` (415 otherwise): a page of another site can send a
form or a plain-text body without asking, but a JSON body only after a CORS preflight, which ComfyUI grants
only with ``--enable-cors-header``; without that flag a browser's cross-site request
(``Sec-Fetch-Site: cross-site``) is a 403 too. So no other site a user visits can change settings or clear
caches, whatever address ComfyUI listens on. A POST body is read up to :data:`MAX_BODY_BYTES` (413
beyond); a body that is not a JSON object, or is nested too deeply, is a 400; an error echoes at most
:data:`MAX_ECHO_CHARS` of what was sent.

Every change in the registry tells :class:`StatsPusher`, which sends one ``reusekit.stats`` event
(the snapshot) at most every :data:`PUSH_INTERVAL_S`, from the server's event loop: no polling
thread, no event per counter increment. Handlers run the registry's and the caches' code in a worker
thread, so the event loop never waits on a lock the sampling thread holds.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from .caching.settings import SETTINGS
from .caching.stats import REGISTRY, SCHEMA_VERSION

log = logging.getLogger("reusekit")

STATS_EVENT = "reusekit.stats"
SETTINGS_EVENT = "reusekit.settings"
PUSH_INTERVAL_S = 0.5
MAX_BODY_BYTES = 256 * 1024  # what a POST route reads at most
MAX_ECHO_CHARS = 200  # what an error message repeats of a request at most

_pusher: StatsPusher | None = None
_server = None  # the PromptServer the routes were added to


def json_ready(value: Any) -> Any:
    """``value`` with only strict-JSON parts: a cache's info may hold NaN, tuples or objects, and one
    unserialisable event would stop ComfyUI's websocket publish loop for every client."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_ready(v) for v in value]
    return str(value)


def snapshot() -> dict:
    return json_ready(REGISTRY.snapshot())


class StatsPusher:
    """Turns a burst of registry changes into at most one push per ``interval`` seconds.

    ``notify`` may be called from any thread (it is the registry's listener): it only sets a flag
    and, for the first change of a burst, schedules :meth:`_flush` on ``loop``. The flush runs on
    the loop, at least ``interval`` after the previous push, and takes one snapshot in a worker thread
    (a snapshot waits on the caches' and the settings' locks, which a sampling run or a settings change
    may hold for seconds: the loop never does); the loop sends it. One snapshot at a time: a change
    meanwhile is pushed after it, so the last state of a burst is always pushed, and in order.
    """

    def __init__(self, send: Callable[[str, Any], None], loop: asyncio.AbstractEventLoop,
                 interval: float = PUSH_INTERVAL_S, registry=REGISTRY):
        self._send = send
        self._loop = loop
        self._interval = interval
        self._registry = registry
        self._lock = threading.Lock()
        self._pending = False
        self._last_push = float("-inf")
        self._pushed_version = -1
        self._taking = False  # a snapshot is being taken (on the loop only)
        self.pushes = 0

    def notify(self) -> None:
        with self._lock:
            if self._pending:
                return
            self._pending = True
        try:  # in an empty context: a copy of the caller's would keep its context variables (a model) alive
            self._loop.call_soon_threadsafe(self._schedule, context=contextvars.Context())
        except RuntimeError:  # the loop is closed: the server is shutting down
            with self._lock:
                self._pending = False

    def _schedule(self) -> None:
        delay = self._last_push + self._interval - time.monotonic()
        if delay > 0:
            self._loop.call_later(delay, self._flush)
        else:
            self._flush()

    def _flush(self) -> None:
        if self._taking:  # the snapshot under way ends with another flush
            return
        with self._lock:
            self._pending = False
        self._last_push = time.monotonic()
        version = self._registry.version
        if version == self._pushed_version:
            return
        self._pushed_version = version
        self._taking = True
        try:
            taken = self._loop.run_in_executor(None, lambda: json_ready(self._registry.snapshot()))
        except RuntimeError:  # the loop is closing: the server is shutting down
            self._taking = False
            return
        taken.add_done_callback(self._taken)

    def _taken(self, taken: asyncio.Future) -> None:
        self._taking = False
        try:
            self._send(STATS_EVENT, taken.result())
            self.pushes += 1
        except Exception:  # a push must never break the registry's caller
            log.exception("ReuseKit: could not push the cache stats")
        if self._registry.version != self._pushed_version:
            self._schedule()  # what changed while the snapshot was taken

    def close(self) -> None:
        self._registry.remove_listener(self.notify)


# ---- handlers -------------------------------------------------------------------------------

def _error(status: int, message: str):
    from aiohttp import web

    if len(message) > MAX_ECHO_CHARS:
        message = message[:MAX_ECHO_CHARS] + f"... ({len(message)} characters)"
    return web.json_response({"error": message}, status=status)


def _shown(value: Any) -> str:
    """``repr(value)``, cut to a length an error message may echo."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS // 2 else f"{text[:MAX_ECHO_CHARS // 2]}... ({len(text)} characters)"


class _Twice(ValueError):
    """A JSON body that gives one key twice."""


class _Refused(Exception):
    """A request refused before its body is read as settings: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _cors_allowed() -> bool:
    """Whether ComfyUI was started to answer other sites (``--enable-cors-header``)."""
    try:
        from comfy.cli_args import args
    except ImportError:
        return False
    return bool(getattr(args, "enable_cors_header", None))


async def _body(request) -> bytes:
    """The request body, read up to :data:`MAX_BODY_BYTES`; refused (413) beyond."""
    too_large = _Refused(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise too_large
    data = bytearray()
    async for chunk in request.content.iter_any():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise too_large
    return bytes(data)


async def _json_object(request) -> dict:
    """The request's JSON body, which must be an object; refused (a browser's request from another site,
    a body not sent as JSON, too large), or ValueError with a message."""
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site" and not _cors_allowed():
        raise _Refused(403, "a request from another site may not change ReuseKit")
    if request.content_type != "application/json":
        raise _Refused(415, "send the body as JSON, with Content-Type: application/json")
    raw = await _body(request)

    def once(pairs: list) -> dict:  # a key given twice: which one meant? (json keeps the last, silently)
        body = {}
        for key, value in pairs:
            if key in body:
                raise _Twice(f"{_shown(key)} is given twice in the body")
            body[key] = value
        return body

    try:
        body = json.loads(raw, object_pairs_hook=once)
    except _Twice:
        raise
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ValueError(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


def _out_of_range(body: dict) -> str | None:
    """The first setting given a number no setting can hold (beyond a float's range), named."""
    for key, value in body.items():
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1023:
            return f"setting {_shown(key)} is out of range (a number of {value.bit_length()} bits)"
    return None


def settings_payload() -> dict:
    return {"schema": SCHEMA_VERSION, "settings": json_ready(SETTINGS.snapshot())}


async def get_stats(request):
    from aiohttp import web

    return web.json_response(await asyncio.to_thread(snapshot))


async def post_clear(request):
    from aiohttp import web

    try:
        body = await _json_object(request)
        if unknown := sorted(set(body) - {"cache", "all"}):
            raise ValueError(f"unknown field {_shown(unknown[0])}: send {{\"cache\": \"<name>\"}} to clear one cache "
                             'or {"all": true} to clear all')
        name = body.get("cache")
        if body.get("all") is True and name is None:
            target = None
        elif isinstance(name, str) and name and "all" not in body:
            target = name
        else:
            raise ValueError('send {"cache": "<name>"} to clear one cache or {"all": true} to clear all')
    except _Refused as exc:
        return _error(exc.status, str(exc))
    except ValueError as exc:
        return _error(400, str(exc))
    try:
        cleared = await asyncio.to_thread(REGISTRY.clear, target)
    except KeyError:
        return _error(404, f"no cache named {_shown(target)}")
    if target is not None and not cleared:
        return _error(409, f"the cache {_shown(target)} cannot be cleared")
    log.info("ReuseKit: cleared %s", ", ".join(cleared) or "nothing")
    return web.json_response({"cleared": cleared, "stats": await asyncio.to_thread(snapshot)})


async def get_settings(request):
    from aiohttp import web

    return web.json_response(await asyncio.to_thread(settings_payload))


async def post_settings(request):
    from aiohttp import web

    try:
        body = await _json_object(request)
        if not body:
            raise ValueError("no settings given")
        out_of_range = _out_of_range(body)
        if out_of_range:
            raise ValueError(out_of_range)
        applied = await asyncio.to_thread(SETTINGS.update, body)
    except _Refused as exc:
        return _error(exc.status, str(exc))
    except ValueError as exc:
        return _error(400, str(exc))
    payload = {**await asyncio.to_thread(settings_payload), "applied": applied}
    if _server is not None:
        _server.send_sync(SETTINGS_EVENT, payload)
    return web.json_response(payload)


def register(prompt_server=None) -> bool:
    """Add the routes and the stats push to ComfyUI's server; False where no server exists.

    Idempotent. Called from ``comfy_entrypoint``, before the server builds its app.
    """
    global _pusher, _server
    if prompt_server is None:
        try:
            from server import PromptServer
        except ImportError:
            return False
        prompt_server = getattr(PromptServer, "instance", None)
    if prompt_server is None:
        return False
    if _server is prompt_server:
        return True
    if _server is not None:
        log.warning("ReuseKit: the routes are already on another server; not adding them again")
        return False
    missing = [a for a in ("routes", "send_sync", "loop") if not hasattr(prompt_server, a)]
    if missing:  # a host without these seams: the nodes still load, the panel has no data
        log.warning("ReuseKit: this ComfyUI server has no %s; the cache panel is unavailable", ", ".join(missing))
        return False
    routes = prompt_server.routes
    routes.get("/reusekit/stats")(get_stats)
    routes.post("/reusekit/clear")(post_clear)
    routes.get("/reusekit/settings")(get_settings)
    routes.post("/reusekit/settings")(post_settings)
    _pusher = StatsPusher(prompt_server.send_sync, prompt_server.loop)
    REGISTRY.add_listener(_pusher.notify)
    _server = prompt_server
    return True
