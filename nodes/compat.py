"""Inputs a node had before: saved prompts keep working (README "Compatibility").

A node's inputs are a public API: a renamed input stays accepted under its old name and the node
maps it to the new one, and a removed one whose value no longer matters is accepted and ignored,
either with one log line. ComfyUI hands ``execute`` only the inputs the schema
declares, plus every linked one (``validate_prompt`` and the executor never refuse an input they
do not know, on 0.3.75 as on 0.33 and 0.38), so an old input written as a value is read here from
the prompt itself, and an unknown one is refused from there (:func:`unknown`): every node declares the
hidden PROMPT and DYNPROMPT inputs (:func:`hidden`; they leave ComfyUI's cache keys as they are, unlike
UNIQUE_ID) and :func:`old_inputs` finds the executing node's entry, a node made by another's expansion too.

UI workflows keep widget values by position, not by name: web/compat.js maps the old layouts when
the page loads a workflow.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io
from comfy_execution.graph_utils import is_link

from ..patches import host


def hidden() -> list:
    """The hidden inputs of a node with old inputs to read: a list of its own (ComfyUI adds an output
    node's extra_pnginfo to the list its schema holds). DYNPROMPT holds the nodes another node's expansion
    made, which PROMPT (the prompt as sent) lacks."""
    return [io.Hidden.prompt, io.Hidden.dynprompt]


def _executing_node() -> str | None:
    """The id of the node whose ``execute`` runs now (ComfyUI's executing context), if any."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:  # a host without the executing context: only linked old inputs are seen
        return None
    context = get_executing_context()
    return None if context is None else context.node_id


def _prompt_inputs(cls) -> dict | None:
    """The inputs this node's prompt entry gives (ComfyUI's executing node in the hidden DYNPROMPT, which holds
    the nodes an expansion made, else in PROMPT), if found."""
    node_id = _executing_node()
    if node_id is None:
        return None
    held = getattr(cls, "hidden", None)
    entry = None
    dynamic = getattr(held, "dynprompt", None)
    if dynamic is not None and dynamic.has_node(node_id):
        entry = dynamic.get_node(node_id)
    prompt = getattr(held, "prompt", None)
    if entry is None and isinstance(prompt, dict):
        entry = prompt.get(node_id)
    given = entry.get("inputs") if isinstance(entry, dict) else None
    return given if isinstance(given, dict) else None


def old_inputs(cls, names: tuple[str, ...], passed: dict[str, Any]) -> dict[str, Any]:
    """The inputs among ``names`` (old names) that this node's prompt entry gives: linked ones from
    ``passed`` (the keyword arguments ComfyUI passed beyond the schema's), values from the prompt."""
    found = {name: passed[name] for name in names if name in passed}
    given = _prompt_inputs(cls) or {}
    for name in names:
        if name not in found and name in given and not is_link(given[name]):
            found[name] = given[name]
    return found


def say_removed(cls, node: str, removed: dict[str, str], passed: dict[str, Any]) -> None:
    """One log line when this node's prompt gives an input that was removed (``removed``: its name ->
    why its value no longer matters); the node runs as it would without it."""
    for name, value in old_inputs(cls, tuple(removed), passed).items():
        host.say_once(f"compat:{node}:{name}", "%s: %s=%r is ignored: the input was removed (%s)", node, name,
                      value, removed[name])


def unknown(cls, passed: dict[str, Any], known_old: tuple[str, ...] = ()) -> str | None:
    """Why an input this node does not have is refused (None: there is none): a linked one (ComfyUI hands
    ``execute`` every linked input) or one written as a value in its prompt entry (ComfyUI drops those
    without a word), so a typo (``"thresold": 0``), or an input of a newer ReuseKit, is never ignored."""
    names = set(passed) - set(known_old)
    given = _prompt_inputs(cls)
    if given:
        declared = {name for section in ("required", "optional") for name in cls.INPUT_TYPES().get(section, {})}
        names |= set(given) - declared - set(known_old)
    if not names:
        return None
    names = sorted(names)
    return (f"{', '.join(map(repr, names))} {'is not an input' if len(names) == 1 else 'are not inputs'} of this "
            "node (a typo, or a workflow made with a newer ReuseKit?)")
