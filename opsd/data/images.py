"""Decode one image value from a dataset row into an RGB PIL image, within size limits.

A value is what a row holds for an image: `{"bytes": ..., "path": ...}` (the `datasets` Image
encoding, also the ThinkMorph struct), raw bytes, a file path, or a PIL image. Anything that cannot
become a sane RGB image raises `BadSample` with a reason the caller counts or reports.
"""

from __future__ import annotations

import io
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from opsd.data.errors import BadSample


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int | None
    """Downscale larger images to this many pixels (aspect ratio kept); None = never."""
    reject_pixels: int
    """Refuse to decode larger images at all (a decompression bomb or a mistake)."""


def _open(value, base_dir: Path | None) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is None and path:
            return _open(str(path), base_dir)
        value = data
    if isinstance(value, str):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = base_dir / path
        if not path.is_file():
            raise BadSample("missing_image", f"no image file at {value}")
        value = path.read_bytes()
    if not value:
        raise BadSample("missing_image", "no image bytes")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadSample("corrupt_image", f"not an image value: {type(value).__name__}")
    try:
        # Opening reads the header only: the size is known before any pixel is decoded.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(value))
    except Image.DecompressionBombError as err:
        raise BadSample("image_too_large", str(err)) from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BadSample("corrupt_image", str(err) or type(err).__name__) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white rather than whatever colour they hide."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_image(value, *, limits: ImageLimits, base_dir: Path | None = None, stats: Counter | None = None) -> Image.Image:
    """An RGB image from a row's image value; raises `BadSample` (missing, corrupt, too large)."""
    if value is None:
        raise BadSample("missing_image", "no image")
    image = _open(value, base_dir)
    width, height = image.size
    if width * height > limits.reject_pixels:
        raise BadSample("image_too_large", f"{width}x{height} pixels exceed data.reject_image_pixels={limits.reject_pixels}")
    if width == 0 or height == 0:
        raise BadSample("corrupt_image", f"empty image ({width}x{height})")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as err:  # truncated or malformed pixel data
        raise BadSample("corrupt_image", str(err) or type(err).__name__) from None
    if image.mode != "RGB":
        image = to_rgb(image)
        if stats is not None:
            stats["images_converted_to_rgb"] += 1
    if limits.max_pixels is not None and width * height > limits.max_pixels:
        scale = math.sqrt(limits.max_pixels / (width * height))
        size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
        if stats is not None:
            stats["images_downscaled"] += 1
    return image
