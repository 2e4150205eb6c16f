"""ReuseKit: a ComfyUI node pack that never computes the same thing twice.

ComfyUI imports this folder as a custom-node package and calls :func:`comfy_entrypoint` (the V3
node API). Importing it does no work: nodes, patches and routes load inside the entrypoint. A second
copy in another folder (a clone beside a Manager install) serves no page and registers nothing: its
nodes would replace the first copy's and count into stats no panel shows; it says where both are.
"""

import os
import sys
import types

_HERE = os.path.dirname(os.path.realpath(__file__))
_FIRST = sys.modules.setdefault("_reusekit_first_copy", types.ModuleType("_reusekit_first_copy")).__dict__.setdefault(
    "path", _HERE)  # the folder of the copy ComfyUI loaded first, for the whole process

WEB_DIRECTORY = "./web" if _FIRST == _HERE else None


def _step_aside() -> None:
    """This copy failed to load its code, before it changed anything in ComfyUI: a copy ComfyUI loads after it
    may take its place, page included."""
    marker = sys.modules.get("_reusekit_first_copy")
    if marker is not None and marker.__dict__.get("path") == _HERE:
        del marker.path
    web = sys.modules.get("nodes")
    folders = getattr(web, "EXTENSION_WEB_DIRS", None)
    if isinstance(folders, dict):
        for name in [k for k, v in folders.items() if os.path.realpath(v) == os.path.join(_HERE, "web")]:
            del folders[name]


async def comfy_entrypoint():
    if sys.modules["_reusekit_first_copy"].__dict__.setdefault("path", _HERE) != _HERE:
        from .nodes import OtherCopyExtension

        return OtherCopyExtension(sys.modules["_reusekit_first_copy"].path, _HERE)
    try:
        from .caching.settings import SETTINGS
        from .nodes import ReuseKitExtension
        from .patches import graph_release, host, rope, step_cache
        from .patches.conditioning import install as install_conditioning_cache
        from .routes import register as register_routes
    except BaseException:  # (past here ComfyUI holds this copy's patches: it keeps its place)
        _step_aside()
        raise

    # global mode (on unless REUSEKIT_CONDITIONING=0) routes every encode
    if not install_conditioning_cache():
        host.set_layer("conditioning cache", "off", "; ".join(host.off_features().values()) or "see the warning")
    elif SETTINGS.get("conditioning.enabled"):
        host.set_layer("conditioning cache", "on", "every text encode (CLIP, T5 and LLM encoders: Qwen2.5-VL with "
                       "images, Qwen3, Llama, Gemma, Mistral), CLIP-vision and VAE encode; "
                       "REUSEKIT_CONDITIONING=0 turns global mode off")
    else:
        host.set_layer("conditioning cache", "on for ReuseKit Cached nodes only", "global mode is off")
    rope.install()  # RoPE builders ask the PE cache; pass-through for models without it
    step_cache.report_layer()  # the step cache hooks each model through its node: nothing to install
    graph_release.install()  # graphs are released whenever ComfyUI loads or unloads a model's weights
    if register_routes():  # the panel's /reusekit/ routes and stats push, where a server runs
        host.set_layer("panel", "on")
    else:
        host.set_layer("panel", "off", "no ComfyUI server in this process")
    return ReuseKitExtension()
