"""The pictures the bench stand-ins learn (``standins.py``): captioned scenes of one to three shapes.

A scene is a background (plain, or a gradient between two colours in a direction the caption does not
say) with one to three coloured shapes of uncaptioned size and position, drawn with PIL at
``2 * latent`` pixels and coded into a latent by the demo models' invertible picture code
(``nodes/demo_models/shapes.py``: RGB and the shapes' mask, pixel-unshuffled by 2). What the caption
leaves open (positions, sizes, the gradient's direction, a little brightness) is decided by the noise,
early in a run, as in real pictures. Captions read "a red circle and a blue cross on a black to gray
background"; the single-shape, plain-background captions of :data:`HELD_OUT` are never drawn for
training (the bench evaluates on prompts like them).
"""

from __future__ import annotations

import random

import torch

COLORS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 230), "yellow": (240, 220, 40),
          "white": (245, 245, 245), "purple": (150, 50, 200), "orange": (245, 140, 30), "cyan": (40, 210, 220)}
BACKGROUNDS = {"black": (10, 10, 10), "gray": (128, 128, 128), "white": (245, 245, 245),
               "navy": (20, 30, 90), "brown": (110, 70, 40)}
SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond")

# "a <colour> <shape> on a <background> background" scenes kept out of training: the bench's calibration,
# tuning and evaluation prompts and a few more of the same kind
HELD_OUT = frozenset({
    ("white", "square", "black"), ("green", "circle", "black"), ("red", "triangle", "white"),
    ("yellow", "cross", "black"), ("blue", "circle", "gray"), ("red", "circle", "black"),
    ("yellow", "square", "gray"), ("blue", "triangle", "white"), ("green", "cross", "white"),
    ("purple", "circle", "gray"), ("white", "triangle", "gray"), ("red", "cross", "gray"),
    ("blue", "square", "black"), ("orange", "ring", "navy"), ("cyan", "diamond", "brown"),
    ("green", "square", "navy"),
})


def held_out_captions() -> list[str]:
    """The held-out single-shape captions, in a fixed order (prompts for evaluation)."""
    return [caption({"bg": b, "bg2": None, "shapes": [(c, s)]}) for c, s, b in sorted(HELD_OUT)]


def scene(rng: random.Random) -> dict:
    """A random scene description (never one of :data:`HELD_OUT`)."""
    while True:
        bg = rng.choice(list(BACKGROUNDS))
        bg2 = rng.choice([b for b in BACKGROUNDS if b != bg]) if rng.random() < 0.35 else None
        count = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        shapes = [(rng.choice([c for c in COLORS if c != bg]), rng.choice(SHAPES)) for _ in range(count)]
        if bg2 is None and count == 1 and (*shapes[0], bg) in HELD_OUT:
            continue
        return {"bg": bg, "bg2": bg2, "shapes": shapes, "direction": rng.randrange(4),
                "light": rng.uniform(0.92, 1.08)}


def caption(desc: dict) -> str:
    items = [f"{'an' if c[0] in 'aeiou' else 'a'} {c} {s}" for c, s in desc["shapes"]]
    things = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
    bg = desc["bg"] if desc["bg2"] is None else f"{desc['bg']} to {desc['bg2']}"
    return f"{things} on a {bg} background"


def _background(desc: dict, big: int) -> torch.Tensor:
    """(3, big, big) in [0, 255]: plain, or a linear gradient in one of four directions."""
    a = torch.tensor(BACKGROUNDS[desc["bg"]], dtype=torch.float32).view(3, 1, 1)
    if desc["bg2"] is None:
        return a.expand(3, big, big).clone()
    b = torch.tensor(BACKGROUNDS[desc["bg2"]], dtype=torch.float32).view(3, 1, 1)
    ramp = torch.linspace(0, 1, big)
    w = {0: ramp.view(1, big).expand(big, big), 1: ramp.view(big, 1).expand(big, big),
         2: (ramp.view(1, big) + ramp.view(big, 1)) / 2, 3: (ramp.flip(0).view(1, big) + ramp.view(big, 1)) / 2}
    return a + (b - a) * w[desc["direction"]]


def draw(desc: dict, size: int, rng: random.Random) -> torch.Tensor:
    """The scene as (4, size, size) in [0, 1]: RGB and the shapes' mask (size = 2 * latent size)."""
    from PIL import Image, ImageDraw

    scale = 4  # draw large, then downsample: smooth edges
    big = size * scale
    bg = (_background(desc, big) * desc["light"]).clamp(0, 255).round().to(torch.uint8)
    img = Image.frombytes("RGB", (big, big), bg.permute(1, 2, 0).contiguous().numpy().tobytes())
    mask = Image.new("L", (big, big), 0)
    n = len(desc["shapes"])
    for color, shape in desc["shapes"]:
        r = rng.uniform(0.16, 0.30 if n > 1 else 0.38) * big
        cx, cy = rng.uniform(r, big - r), rng.uniform(r, big - r)
        for canvas, fill in ((ImageDraw.Draw(img), COLORS[color]), (ImageDraw.Draw(mask), 255)):
            if shape == "circle":
                canvas.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
            elif shape == "ring":
                canvas.ellipse((cx - r, cy - r, cx + r, cy + r), outline=fill, width=max(2, int(r * 0.4)))
            elif shape == "square":
                canvas.rectangle((cx - r * 0.85, cy - r * 0.85, cx + r * 0.85, cy + r * 0.85), fill=fill)
            elif shape == "diamond":
                canvas.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
            elif shape == "triangle":
                canvas.polygon([(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)], fill=fill)
            else:
                w = r * 0.36
                canvas.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
                canvas.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    img, mask = img.resize((size, size), Image.BILINEAR), mask.resize((size, size), Image.BILINEAR)
    rgb = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
    m = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).view(1, size, size)
    return torch.cat([rgb, m]).float() / 255.0
