"""ReuseKit: a ComfyUI node pack that never computes the same thing twice.

ComfyUI imports this folder as a custom-node package and calls :func:`comfy_entrypoint` (the V3
node API). Importing it does no work: nodes, patches and routes load inside the entrypoint.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import ReuseKitExtension
    from .patches import rope
    from .patches.conditioning import install as install_conditioning_cache
    from .routes import register as register_routes

    install_conditioning_cache()  # global mode (on unless REUSEKIT_CONDITIONING=0) routes every encode
    rope.install()  # RoPE builders ask the PE cache; pass-through for models without it
    register_routes()  # the panel's /reusekit/ routes and stats push, where a server runs
    return ReuseKitExtension()
