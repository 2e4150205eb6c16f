"""When the conditioning cache checks an encoder's weights for in-place edits: the events.

``caching/weight_edits.py`` holds what a check reads and compares; this module decides when each
kind of check runs, per encoder module:

- a full fingerprint when the weights become what they are: at registration (a ComfyUI loader
  returned them, a VAE was built, a custom loader called ``register_source``), before any other node
  can touch them; after ComfyUI's patcher applied or removed weight patches (a listener on
  ``ModelPatcher.load / unpatch_model / partially_unload``, through patches/lifecycle.py, records the
  weights the patcher writes, its patches' and backup's names, and the next encode fingerprints
  those in full, each restored weight against its reference from before it was patched over, and
  gives the others, which the patcher did not touch, the cheap check), at most once per encoder per
  node execution (ComfyUI's executing-node context: other nodes' code runs only between node
  executions, so the encodes of one node, a Prompt Batch or SDXL's two encoders, share one check);
  and after a cheap check saw an edit (the edited weights become the reference of the new
  generation, in full);
- on every other encode, the cheap check (:meth:`caching.weight_edits.WeightWatch.quick`): its cost
  follows the number of tensors, never their bytes, and a move between devices is never an edit.
  Later encodes of the same run of one of ComfyUI's own nodes (a Prompt Batch's prompts through
  CLIPTextEncode) check only the embedding rows their tokens read: nothing else can have touched the
  weights since the first. A custom node's encodes each get the whole cheap check (it may edit between).
- before a miss's result goes to the shared tiers (:func:`vouch`): a full fingerprint taken after the
  encode, on a background thread, must equal the reference, so an edit the cheap check missed stays in
  its own process (the encoder's next check is then a full one, and starts a new generation).

The setting ``conditioning.check_weight_edits`` picks the policy: ``events`` (the default, above),
``every_encode`` (a full fingerprint on every encode, for nodes that edit a few values of a large
weight in place, which the cheap check may not sample; its misses are published at once) or ``off``
(no check; the shared tiers then neither read nor write, since nothing vouches that the weights are the
file's). The reference is taken at load in every mode, so checks switched on later compare with the
weights as loaded and never adopt an edit made while they were off.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from ..caching.conditioning import CACHE
from ..caching.settings import SETTINGS
from ..caching.weight_edits import SETTING, WeightWatch, matches_reference
from . import lifecycle
from .module_tree import weights as _base_weights


class _Encoder:
    __slots__ = ("watch", "lock", "dirty", "written", "epoch", "checked", "embeddings", "loaded_ns", "suspect",
                 "waiting", "__weakref__")

    def __init__(self, module: torch.nn.Module):
        self.watch = WeightWatch()
        self.lock = threading.Lock()
        self.dirty = False  # weight patches applied or removed since the last full check
        self.written: set[str] = set()  # the weights the patcher wrote since then (its patches' and backup's names)
        self.epoch = None  # the node execution of the last full check
        self.checked = None  # the node execution whose weights were last checked in all (full or cheap)
        self.embeddings = frozenset(f"{name}.weight" if name else "weight" for name, m in module.named_modules()
                                    if isinstance(m, torch.nn.Embedding))
        self.loaded_ns: int | None = None  # when its weights began loading, where known
        self.suspect = False  # a publication check saw the weights differ: the next check is a full one
        self.waiting: list = []  # (patcher, publish, drop) of encodes waiting for a publication check


log = logging.getLogger(__name__)

_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def _encoder(module: torch.nn.Module) -> _Encoder:
    found = _encoders.get(module)
    if found is None:
        with _encoders_lock:
            found = _encoders.get(module)
            if found is None:
                found = _encoders[module] = _Encoder(module)
    return found


def loaded_ns(module: torch.nn.Module) -> int | None:
    """When the module's weights began loading (a VAE's construction), or None where not seen."""
    found = _encoders.get(module)
    return None if found is None else found.loaded_ns


_context = []  # ComfyUI's get_executing_context, once found (empty: not looked up yet)


def node_execution():
    """The node execution running now (prompt, node), or None outside ComfyUI's executor. The items of
    a list input (a Prompt Batch) run inside one node execution: nothing else runs between them."""
    if not _context:
        try:
            from comfy_execution.utils import get_executing_context
        except ImportError:  # a host without it: every encode is its own execution (more full checks)
            get_executing_context = None
        _context.append(get_executing_context)
    get = _context[0]
    found = get() if get is not None else None
    return (found.prompt_id, found.node_id) if found is not None else None


def _full(enc: _Encoder, module, patcher) -> bool:
    named, patched = _base_weights(module, patcher)
    enc.dirty = False
    enc.written = set()
    enc.epoch = enc.checked = node_execution()
    return enc.watch.full(named, patched, enc.embeddings)


def _refresh(enc: _Encoder, module, patcher) -> bool:
    """The check after weight patches moved: what the patcher wrote in full, the rest cheaply; an edit
    seen makes the weights as they are now the reference, in full."""
    named, patched = _base_weights(module, patcher)
    written, enc.written, enc.dirty = enc.written, set(), False
    enc.epoch = enc.checked = node_execution()
    if enc.watch.refresh(named, patched, written, enc.embeddings):
        enc.watch.full(named, patched, enc.embeddings)
        return True
    return False


def register(module: torch.nn.Module, patcher) -> bool:
    """A loader returned these weights: take them as the reference, in full where no reference exists
    yet (in every mode: checks switched on later compare with the weights as loaded, never adopt an edit
    made while they were off). True when they differ from an earlier reference (an edit)."""
    enc = _encoder(module)
    with enc.lock:
        if enc.watch.ready:  # fingerprinted in full already (a VAE as it was built): a cheap look suffices
            named, patched = _base_weights(module, patcher)
            if not enc.watch.quick(named, patched):
                return False
        return _full(enc, module, patcher)


def reset(module: torch.nn.Module, patcher, started_ns: int | None = None) -> None:
    """New weights were loaded into ``module`` (the caller started a new generation): forget the old
    reference and fingerprint them in full as the new one (in every mode, as :func:`register`)."""
    enc = _encoder(module)
    with enc.lock:
        enc.watch = WeightWatch()
        enc.loaded_ns = started_ns
        _full(enc, module, patcher)


def check(module: torch.nn.Module, patcher, token_ids=()) -> bool:
    """The check of one encode (see the module docstring); True when an edit is seen. ``token_ids``:
    the token ids the encode looks up (their embedding rows are checked)."""
    mode = SETTINGS.get(SETTING)
    if mode == "off":
        return False
    enc = _encoder(module)
    with enc.lock:
        if not enc.watch.ready:  # first sight of an encoder no loader registered
            _full(enc, module, patcher)
            return False
        execution = node_execution()
        if mode == "every_encode" or enc.suspect:
            enc.suspect = False
            return _full(enc, module, patcher)
        if enc.dirty and (enc.epoch is None or execution != enc.epoch):
            return _refresh(enc, module, patcher)
        named, patched = _base_weights(module, patcher)
        # later encodes of one run of a ComfyUI node (a Prompt Batch's prompts through CLIPTextEncode) check
        # only the embedding rows they read: nothing but ComfyUI's own code ran since the first's check
        rows_only = execution is not None and execution == enc.checked and not enc.dirty and _core_node_running()
        if enc.watch.quick(named, patched, token_ids, rows_only=rows_only):
            _full(enc, module, patcher)  # the edited weights are the new generation's reference
            return True
        enc.checked = execution
        return False


def _core_node_running() -> bool:
    """Whether the node ComfyUI's executor is running now (the ``obj`` its ``process_inputs`` maps over
    the inputs) is one of ComfyUI's own (``nodes``, ``comfy_extras``): those encode, never edit weights.
    False when it cannot tell (another host's executor, an async node)."""
    frame = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "process_inputs" and code.co_filename.endswith("execution.py"):
            obj = frame.f_locals.get("obj")
            name = getattr(obj if isinstance(obj, type) else type(obj), "__module__", "")
            return name == "nodes" or name.startswith("comfy_extras.")
        frame = frame.f_back
    return False


# ---- publishing to the shared tiers ---------------------------------------------------------------

_queue: dict[int, tuple] = {}  # id(module): (module, patcher) with encodes waiting for a publication check
_queue_cond = threading.Condition()
_waiting = [0]  # encodes waiting, in all (the stats show it; tests and servers wait for 0)
_worker: list[threading.Thread] = []


def vouch(module: torch.nn.Module, patcher, publish: Callable[[], None], drop: Callable[..., None]) -> None:
    """An encode's result goes to the shared tiers only after a full fingerprint of the encoder's weights,
    taken after the encode, equals its reference: an edit the cheap check missed never reaches another
    worker. The check runs on a background thread (the encode and every hit do not wait), once for all the
    encodes that waited meanwhile: ``publish`` runs when the weights match, ``drop`` when they differ
    (the encoder's next check is then a full one, which starts a new generation). An encoder without a
    reference (never fingerprinted) drops at once."""
    enc = _encoders.get(module)
    if enc is None or not enc.watch.ready:
        drop("its encoder's weights have no full fingerprint to compare with yet")
        return
    with _queue_cond:
        enc.waiting.append((publish, drop))
        _waiting[0] += 1
        _queue[id(module)] = (module, patcher)
        if not _worker:
            _worker.append(threading.Thread(target=_publish_loop, name="reusekit-publish", daemon=True))
            _worker[0].start()
        _queue_cond.notify()
        count = _waiting[0]
    _report(count)


def _report(count: int) -> None:
    CACHE.stats.set_info("publish_waiting", count)  # the panel; servers in tests wait for 0


def wait_published(timeout: float = 60.0) -> bool:
    """Wait until no encode waits for its publication check (tests, the bench); False on timeout."""
    with _queue_cond:
        return _queue_cond.wait_for(lambda: _waiting[0] == 0, timeout)


def _publish_loop() -> None:
    while True:
        with _queue_cond:
            _queue_cond.wait_for(lambda: bool(_queue))
            module, patcher = _queue.pop(next(iter(_queue)))
        try:
            _publication_check(module, patcher)
        except Exception:  # never ends the thread: every later encode would wait for it forever
            log.exception("ReuseKit: a publication check failed")
        del module, patcher


def _publication_check(module, patcher) -> None:
    """One round for one encoder: the encodes waiting now (all finished before it began) are published
    when a full fingerprint taken now equals the reference, else dropped. The fingerprint runs outside
    the encoder's lock: its encodes and hits go on meanwhile."""
    enc = _encoders.get(module)
    if enc is None:
        return
    with _queue_cond:  # (each finished before it was queued: before the walk below)
        waited, enc.waiting = enc.waiting, []
    failed = None
    try:
        with enc.lock:
            named, patched = _base_weights(module, patcher)
            reference = enc.watch.reference()
        same = matches_reference(named, patched, reference)
    except Exception as exc:  # weights it cannot read or walk now (ComfyUI loading them): nothing vouches
        log.warning("ReuseKit: the publication check of an encoder failed: %s", exc)
        same, failed = False, f"the check of its encoder's weights after the encode failed: {type(exc).__name__}"
    if not same:
        enc.suspect = True  # the next encode checks in full: an edit starts a new generation there
    for publish, drop in waited:
        try:
            publish() if same else drop(failed) if failed else drop()
        except Exception as exc:  # a shared tier's write never fails anything
            log.debug("ReuseKit: publishing an entry failed: %s", exc)
    with _queue_cond:
        _waiting[0] -= len(waited)
        _queue_cond.notify_all()
        count = _waiting[0]
    _report(count)


def checks(module: torch.nn.Module) -> tuple[int, int]:
    """(full, cheap) checks the module's weights have had since their last load (the bench and the
    tests count them)."""
    found = _encoders.get(module)
    return (0, 0) if found is None else (found.watch.full_checks, found.watch.quick_checks)


def _patches_moved(patcher, *args, **kwargs) -> None:
    """A lifecycle listener (before ``load``, ``unpatch_model``, ``partially_unload``): when the
    patcher has weight patches to apply or to remove, the encoder's next check fingerprints the weights
    they name in full. Only records (it may run anywhere ComfyUI moves weights)."""
    enc = _encoders.get(patcher.model)
    if enc is None:
        return
    names = [*(getattr(patcher, "patches", None) or ()), *(getattr(patcher, "backup", None) or ())]
    if names:
        # rebound, never updated in place: a check taking the set meanwhile loses no name (at worst the
        # next one reads some again)
        enc.written = enc.written | set(names)
        enc.dirty = True


_EVENTS = ("load", "unpatch_model", "partially_unload")


def install() -> None:
    for event in _EVENTS:
        lifecycle.add_listener(event, _patches_moved)


def uninstall() -> None:
    for event in _EVENTS:
        lifecycle.remove_listener(event, _patches_moved)
