"""The small Flux (and Wan) TRAINED on procedural pictures, for step-cache tests and benchmarks.

Random weights make every step-cache measurement meaningless (consecutive outputs barely change
and cond/uncond are almost equal), so the project trained the host's real ``Flux`` class at a small
size (``train_flux.py`` beside this file). The models, their weights and the picture code ship in
the pack as its demo models (``nodes/demo_models/shapes.py``): this module loads that file, so the
tests and the demo use the same copy, and adds the training initialisation.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

_SHAPES = Path(__file__).resolve().parents[2] / "nodes" / "demo_models" / "shapes.py"


def _load_shapes():
    """The pack's shapes.py by path (the test process and its servers load the pack under other names)."""
    name = "reusekit_demo_shapes"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _SHAPES)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


_shapes = _load_shapes()
WEIGHTS, WAN_WEIGHTS, CONFIG, WAN_CONFIG = _shapes.WEIGHTS, _shapes.WAN_WEIGHTS, _shapes.CONFIG, _shapes.WAN_CONFIG
COLORS, BACKGROUNDS, SHAPES, FAMILIES = _shapes.COLORS, _shapes.BACKGROUNDS, _shapes.SHAPES, _shapes.FAMILIES
captions, draw, build = _shapes.captions, _shapes.draw, _shapes.build
picture_to_latent, latent_to_picture, shape_color_error = (_shapes.picture_to_latent, _shapes.latent_to_picture,
                                                           _shapes.shape_color_error)


def init_weights(module: torch.nn.Module, seed: int) -> None:
    """Training init: small normal weights, zero biases, unit norm scales, zero output layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel()))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        for name, p in module.named_parameters():
            if name.startswith(("final_layer.linear", "final_layer.adaLN", "head.head")):
                p.zero_()
