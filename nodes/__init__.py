"""The pack's V3 nodes, gathered into one ComfyExtension.

Each module in NODE_MODULES lists its node classes in ``NODES``. A module that cannot load on this
host (a missing ComfyUI feature), or a node whose schema cannot be built on it (a host loader whose inputs
changed shape), is skipped with one warning; the rest still load.
"""

from __future__ import annotations

import importlib
import logging

from comfy_api.latest import ComfyExtension, io

CATEGORY = "ReuseKit"


def refusal(stats, node: str, what: str) -> ValueError:
    """A node's bad input (``what``: the input and why), counted in its cache's ``stats`` as a refusal from
    ``node``, so the panel shows it beside the error; the ValueError the node raises."""
    stats.count_reason("refused", what, source=node)
    return ValueError(f"{node}: {what}")
NODE_MODULES = ("stats", "conditioning", "lazy_clip", "pe_cache", "step_cache", "graph", "demo")

log = logging.getLogger("reusekit")


def load_node_classes() -> list[type[io.ComfyNode]]:
    classes: list[type[io.ComfyNode]] = []
    for name in NODE_MODULES:
        try:
            module = importlib.import_module(f".{name}", __name__)
        except Exception as exc:  # one missing host feature must not hide the whole pack
            log.warning("ReuseKit: the %s nodes are unavailable on this ComfyUI (%s: %s)",
                        name, type(exc).__name__, exc)
            continue
        for cls in module.NODES:
            try:
                cls.GET_SCHEMA()  # ComfyUI registers a pack's nodes in one pass: one that raises ends it
            except Exception as exc:
                log.warning("ReuseKit: the node %s is unavailable on this ComfyUI (%s: %s)",
                            cls.__name__, type(exc).__name__, exc)
                continue
            classes.append(cls)
    return classes


def ksampler_inputs(cfg: float = 8.0, sampler: str | None = None, scheduler: str | None = None) -> list:
    """KSampler's own inputs, in its order, for the pack's sampler nodes (a KSampler's widget values
    carry over when a user swaps nodes)."""
    import comfy.samplers

    return [
        io.Model.Input("model", tooltip="The diffusion model (cloned, never changed)."),
        io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                     tooltip="The random seed used for creating the noise."),
        io.Int.Input("steps", default=20, min=1, max=10000, tooltip="The number of denoising steps."),
        io.Float.Input("cfg", default=cfg, min=0.0, max=100.0, step=0.1, round=0.01,
                       tooltip="Classifier-free guidance scale."),
        io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS, default=sampler,
                       tooltip="The sampling algorithm."),
        io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default=scheduler,
                       tooltip="How the noise levels are spaced."),
        io.Conditioning.Input("positive", tooltip="What to include in the image."),
        io.Conditioning.Input("negative", tooltip="What to exclude from the image."),
        io.Latent.Input("latent_image", tooltip="The latent image to denoise."),
        io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                       tooltip="How much of the latent to replace (1.0: all)."),
    ]


def brief(value) -> str:
    """``value`` as an error message shows it: its repr cut to 60 characters; a tensor by its dtype and shape,
    a dict by its keys, a list or tuple by its length (a linked CONDITIONING or LATENT would otherwise print
    its tensors)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        text = f"a dict with keys {', '.join(map(repr, value))}"
    elif isinstance(value, (list, tuple)) and len(repr(value)) > 60:
        text = f"a {type(value).__name__} of {len(value)}"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def sampler_error(**given) -> str | None:
    """Why a given ``sampler_name`` / ``scheduler`` is not one this ComfyUI has (``None``: each given one
    is). ComfyUI 0.3.75 checks no V3 combo, and KSampler then silently samples with its first sampler: a
    wrong result, never an error."""
    import comfy.samplers

    for name, options in (("sampler_name", comfy.samplers.KSampler.SAMPLERS),
                          ("scheduler", comfy.samplers.KSampler.SCHEDULERS)):
        value = given.get(name, options[0])
        if not isinstance(value, str) or value not in options:
            return f"{name}: {brief(value)} is not one of this ComfyUI's ({', '.join(options[:6])}, ...)"
    return None


def _conditioning_error(name: str, value) -> str | None:
    """Why ``value`` is not a CONDITIONING: a list of [tensor (or None), dict] pairs."""
    import torch

    def shown(v):
        return type(v).__name__ if not isinstance(v, (list, tuple)) else f"a {type(v).__name__} of {len(v)}"

    if not isinstance(value, (list, tuple)):
        return f"{name} must be a CONDITIONING (a list of [tensor, dict] pairs), got {shown(value)}"
    for i, item in enumerate(value):
        if not (isinstance(item, (list, tuple)) and len(item) >= 2 and isinstance(item[1], dict)
                and (item[0] is None or isinstance(item[0], torch.Tensor))):
            return (f"{name} must be a CONDITIONING (a list of [tensor, dict] pairs); its item {i} is "
                    f"{shown(item)}")
    return None


class SamplerInputs:
    """Validation of KSampler's own inputs for the pack's sampler nodes: a V3 ``validate_inputs`` for the
    values written in the prompt, and :meth:`check_inputs` at run time for every value, linked ones
    included."""

    NODE = "ReuseKit sampler"

    @classmethod
    def validate_inputs(cls, sampler_name=None, scheduler=None):
        # a linked input reaches validation as None (0.3.75 and 0.33 alike): check_inputs sees its value
        given = {k: v for k, v in (("sampler_name", sampler_name), ("scheduler", scheduler)) if v is not None}
        error = sampler_error(**given)
        return f"{cls.NODE}: {error}" if error else True

    @classmethod
    def check_inputs(cls, stats, *, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                     denoise) -> None:
        """KSampler's inputs as the node runs: a bad one is refused naming it, counted in ``stats``, before
        ComfyUI's sampler fails deep inside (a LATENT as ``positive``: ``'str' object has no attribute
        'copy'``) or returns a wrong latent without an error: a NaN or infinite ``cfg`` (NaN passes ComfyUI's
        range check), and a linked value outside the widget's range, which ComfyUI checks only where the
        prompt writes the value (``denoise`` 2 runs as 1, -1 returns the latent untouched)."""
        error = (sampler_error(sampler_name=sampler_name, scheduler=scheduler)
                 or _number_error("seed", seed, 0, 0xffffffffffffffff, whole=True)
                 or _number_error("steps", steps, 1, 10000, whole=True)
                 or _number_error("cfg", cfg, 0.0, 100.0) or _number_error("denoise", denoise, 0.0, 1.0)
                 or _conditioning_error("positive", positive) or _conditioning_error("negative", negative)
                 or _latent_error(latent_image))
        if error is not None:
            raise refusal(stats, cls.NODE, error)


def _number_error(name: str, value, low, high, whole: bool = False) -> str | None:
    """Why ``value`` is not a number from ``low`` to ``high`` (``whole``: a whole one), None if it is (NumPy's
    numbers are numbers; a NaN is within no range, and an integer of any size is compared exactly)."""
    import numbers

    kind = numbers.Integral if whole else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        return f"{name} must be a {'whole ' if whole else ''}number from {low} to {high}, got {brief(value)}"
    return None


def _latent_error(value) -> str | None:
    """Why ``value`` is not a LATENT: a dict whose ``samples`` is a non-empty tensor of at least 3 dimensions
    (batch, channels, then length or height and width, or frames, height and width), or ComfyUI's nested
    tensor of several."""
    import torch

    samples = value.get("samples") if isinstance(value, dict) else None
    if getattr(samples, "is_nested", False) is True:  # comfy.nested_tensor (LTX-2's audio and video): ComfyUI's
        return None
    if not isinstance(samples, torch.Tensor) or samples.ndim < 3 or not samples.numel():
        got = (type(value).__name__ if not isinstance(value, dict) else "a dict without a tensor 'samples'"
               if not isinstance(samples, torch.Tensor) else f"samples of shape {tuple(samples.shape)}")
        return f"latent_image must be a LATENT (a dict with a non-empty 'samples' tensor), got {got}"
    return None


def pack_version() -> str:
    """The ``version`` of pyproject.toml's ``[project]`` table (tomllib needs Python 3.11)."""
    import re
    from pathlib import Path

    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    except OSError:
        return "(version unknown)"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return found.group(1) if found else "(version unknown)"


class OtherCopyExtension(ComfyExtension):
    """A second copy of the pack, loaded after ``first``: no nodes (theirs would replace the first copy's)."""

    def __init__(self, first: str, here: str):
        self.first, self.here = first, here

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        log.warning("ReuseKit: another copy is loaded already, from %s: this one, %s, registers no nodes and serves "
                    "no page; remove one of the two folders", self.first, self.here)
        return []


class ReuseKitExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        from ..patches import host

        classes = load_node_classes()
        log.info("%s", host.startup_line(pack_version()))  # which layers are on, and why the others are off
        return classes
