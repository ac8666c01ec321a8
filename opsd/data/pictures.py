"""Pictures of one coloured shape, drawn with PIL: what the seeing SmolLM2 learns to read.

A picture is one of `SHAPES` filled with one of `COLOURS` on a light background, its size, place,
angle and shade a little random, so no two are alike; `draw_value` draws one word of either list
alone (a swatch of a colour, a shape in grey). `opsd.smollm2_vlm` teaches a vision tower to read
those as their words; `opsd.data.picture_facts` shows facts' values to a teacher as such pictures.
Everything is a pure function of the random generator passed in.
"""

from __future__ import annotations

import math
import random

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 30, 30),
    "orange": (255, 140, 0),
    "yellow": (235, 210, 0),
    "green": (20, 160, 40),
    "blue": (30, 70, 230),
    "purple": (130, 40, 170),
    "pink": (255, 120, 190),
    "brown": (120, 70, 20),
}
SHAPES = ("circle", "square", "triangle", "star", "heart", "cross", "diamond", "moon")
BACKGROUNDS = ((255, 255, 255), (245, 245, 235), (235, 240, 245), (225, 225, 225))


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape of radius `r` about (cx, cy), turned by `angle` radians."""
    if shape == "square":
        points = [(math.pi / 4 + k * math.pi / 2, r) for k in range(4)]
    elif shape == "diamond":  # a rhombus, taller than wide
        points = [(0, 0.6 * r), (math.pi / 2, r), (math.pi, 0.6 * r), (3 * math.pi / 2, r)]
    elif shape == "triangle":
        points = [(-math.pi / 2 + k * 2 * math.pi / 3, r) for k in range(3)]
    elif shape == "star":
        points = [(-math.pi / 2 + k * math.pi / 5, r if k % 2 == 0 else 0.42 * r) for k in range(10)]
    elif shape == "cross":  # a plus sign: 12 corners at two radii
        w = 0.34 * r
        corners = [(w, r), (w, w), (r, w), (r, -w), (w, -w), (w, -r), (-w, -r), (-w, -w), (-r, -w), (-r, w),
                   (-w, w), (-w, r)]
        points = [(math.atan2(y, x), math.hypot(x, y)) for x, y in corners]
    else:
        raise ValueError(f"{shape} is not a polygon")
    return [(cx + d * math.cos(a + angle), cy + d * math.sin(a + angle)) for a, d in points]


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, angle: float, fill,
               background) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "heart":  # two lobes over a point, upright whatever the angle (a turned heart is still one)
        lobe = 0.52 * r
        for dx in (-lobe, lobe):
            draw.ellipse((cx + dx - lobe, cy - 0.45 * r - lobe, cx + dx + lobe, cy - 0.45 * r + lobe), fill=fill)
        draw.polygon([(cx - 2 * lobe + 0.02 * r, cy - 0.3 * r), (cx + 2 * lobe - 0.02 * r, cy - 0.3 * r),
                      (cx, cy + r)], fill=fill)
    elif shape == "moon":  # a crescent: a disc with an offset disc of background cut out
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        ox, oy = 0.45 * r * math.cos(angle), 0.45 * r * math.sin(angle)
        draw.ellipse((cx + ox - 0.85 * r, cy + oy - 0.85 * r, cx + ox + 0.85 * r, cy + oy + 0.85 * r), fill=background)
    else:
        draw.polygon(_polygon(shape, cx, cy, r, angle), fill=fill)


def draw_picture(colour: str, shape: str, rng: random.Random, size: int = 64, *, grey: bool = False) -> Image.Image:
    """One `colour` `shape` (names from COLOURS and SHAPES), its place, size, angle, shade and
    background a little random; `grey`: the shape dark grey instead (`colour` is ignored)."""
    background = rng.choice(BACKGROUNDS)
    image = Image.new("RGB", (size, size), background)
    # Near the centre, large, hardly turned: a 64-pixel picture is 16 patches, and a small tower
    # learns these outlines in a few hundred pictures (all over the place, it takes thousands).
    r = size * rng.uniform(0.34, 0.42)
    cx = size / 2 + rng.uniform(-0.06, 0.06) * size
    cy = size / 2 + rng.uniform(-0.06, 0.06) * size
    angle = rng.uniform(-0.15, 0.15) if shape != "moon" else rng.uniform(0, 2 * math.pi)
    fill = (rng.randint(40, 80),) * 3 if grey else _shade(COLOURS[colour], rng)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, angle, fill, background)
    return image


def _shade(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-12, 12))) for c in rgb)


def draw_value(value: str, rng: random.Random, size: int = 64) -> Image.Image:
    """One word of COLOURS or SHAPES as a picture that shows only that: a colour as a swatch (the
    whole picture in it, the shade a little random), a shape in dark grey."""
    if value in COLOURS:
        return Image.new("RGB", (size, size), _shade(COLOURS[value], rng))
    if value in SHAPES:
        return draw_picture("", value, rng, size, grey=True)
    raise ValueError(f"{value!r} is neither a colour ({', '.join(COLOURS)}) nor a shape ({', '.join(SHAPES)})")
