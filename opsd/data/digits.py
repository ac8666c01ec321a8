"""Handwritten digits: a skill learnt from real data, judged on images never trained on (project schema).

The images are the UCI handwritten digits (E. Alpaydin and C. Kaynak, "Optical Recognition of
Handwritten Digits", UCI Machine Learning Repository, 1998, CC BY 4.0: 1,797 scans of 8x8 pixels,
values 0-16, written by 43 people), in `uci_digits.csv.gz` beside this module: scikit-learn's copy of
the file behind `sklearn.datasets.load_digits`, byte for byte. It lives here rather than behind a
scikit-learn requirement because transformers imports `sklearn.metrics` (and scipy with it) whenever
scikit-learn is installed, about 2.3 s of CPU in every process that imports it.

Each scan is shown to the student as a 64-pixel picture (dark strokes on white, upscaled) with
"Which digit is this?"; the answer is the digit's English word ("seven", one SmolLM2 token after a
space). The teacher's prompt adds a printed rendering of the same digit (Pillow's built-in font,
dark grey on white) as its privileged picture, which the seeing SmolLM2's tower is taught to read
(`opsd.smollm2_vlm.build_digits`); the handwriting it reads badly. Train and eval rows are disjoint
images of one fixed shuffle of the 1,797 less the 100 set aside for the model build (`BUILD_SCANS`),
`seed`: evaluation is on handwriting never trained on.

Files written by `write_dataset` (parquet, project schema): train.parquet, eval.parquet
(validation.parquet when asked), columns id (`digits-<UCI index>`), question, answer, images (the
handwritten digit), privileged_images (the printed one), privileged_text (the answer in words, "7 is
seven.", for `loss.kind=sft`).
"""

from __future__ import annotations

import pathlib
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from opsd.answers import NUMBER_WORDS

WORDS = NUMBER_WORDS[:10]  # "zero" .. "nine": the answers, which answer matching also reads as numerals
QUESTION = "Which digit is written in this picture? Answer with one word."
INK = (40, 40, 40)
PRINTED_FONT_SIZE = 44


UCI_DIGITS_FILE = pathlib.Path(__file__).with_name("uci_digits.csv.gz")
"""One scan a row: 64 pixel values (row by row), then the digit; as `sklearn.datasets.load_digits` reads it."""


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 8, 8] of 0-16, labels [1797])."""
    table = np.loadtxt(UCI_DIGITS_FILE, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def draw_handwritten(pixels, size: int = 64) -> Image.Image:
    """An 8x8 scan (0 = paper, 16 = ink) as a `size`-pixel RGB picture, dark strokes on white."""
    grey = Image.new("L", (8, 8))
    grey.putdata([int(round(255 - (255 - INK[0]) * float(v) / 16)) for v in pixels.reshape(-1)])
    return grey.resize((size, size), Image.Resampling.BILINEAR).convert("RGB")


def draw_printed(digit: int, rng: random.Random, size: int = 64) -> Image.Image:
    """The numeral printed in Pillow's built-in font, dark grey on white, centred within +-1 pixel."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=PRINTED_FONT_SIZE * size // 64)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
    x = (size - (right - left)) / 2 - left + rng.randint(-1, 1)
    y = (size - (bottom - top)) / 2 - top + rng.randint(-1, 1)
    draw.text((x, y), str(digit), fill=INK, font=font)
    return image


BUILD_SCANS = 100
"""UCI scans set aside for the model build (`opsd.smollm2_vlm.build_digits` shows its tower a few of
them), whatever the seed: no split ever holds one, so no run trains or is judged on them."""


def build_indices(total: int) -> list[int]:
    """The `BUILD_SCANS` UCI indices of the model build, in a fixed order."""
    order = list(range(total))
    random.Random("opsd-digits:build").shuffle(order)
    return order[:BUILD_SCANS]


def unreserved_indices(total: int) -> list[int]:
    """The UCI indices the model build never sees, in UCI order: what the splits are drawn from."""
    reserved = set(build_indices(total))
    return [i for i in range(total) if i not in reserved]


def split_indices(seed: int, counts: dict[str, int], total: int) -> dict[str, list[int]]:
    """Disjoint UCI indices per split, from one fixed shuffle of the `total` images less the build's."""
    order = unreserved_indices(total)
    if sum(counts.values()) > len(order):
        raise ValueError(f"the splits ask for {sum(counts.values())} images; the digits data hold "
                         f"{len(order)} besides the {total - len(order)} of the model build")
    random.Random(f"opsd-digits:{seed}").shuffle(order)
    out, start = {}, 0
    for split, n in counts.items():
        out[split] = order[start : start + n]
        start += n
    return out


def make_rows(seed: int, n_train: int, n_eval: int, image_size: int = 64, n_validation: int = 0) -> dict[str, list[dict]]:
    """Rows by split as dicts with PIL `handwritten` and `printed` pictures."""
    images, labels = load_digits()
    splits = split_indices(seed, {"train": n_train, "eval": n_eval, "validation": n_validation}, len(labels))
    rows: dict[str, list[dict]] = {}
    for split, indices in splits.items():
        rows[split] = []
        for index in indices:
            digit = int(labels[index])
            rng = random.Random(f"opsd-digits-row:{seed}:{index}")
            rows[split].append({
                "id": f"digits-{index:04d}", "question": QUESTION, "answer": WORDS[digit],
                "handwritten": draw_handwritten(images[index], image_size), "printed": draw_printed(digit, rng, image_size),
                "privileged_text": f"{digit} is {WORDS[digit]}.",
            })
    return rows


def _features():
    from datasets import Features, Image as ImageFeature, Sequence, Value

    return Features(id=Value("string"), question=Value("string"), answer=Value("string"), images=Sequence(ImageFeature()),
                    privileged_images=Sequence(ImageFeature()), privileged_text=Value("string"))


def write_dataset(out_dir, *, n_train: int, n_eval: int, seed: int = 0, image_size: int = 64,
                  n_validation: int = 0) -> pathlib.Path:
    """Write train.parquet, eval.parquet (and validation.parquet when asked for rows) under out_dir."""
    from datasets import Dataset

    from opsd.data.synthetic import _png

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_rows(seed, n_train, n_eval, image_size, n_validation).items():
        if not rows and name == "validation":
            continue
        columns = {key: [r[key] for r in rows] for key in ("id", "question", "answer", "privileged_text")}
        columns["images"] = [[_png(r["handwritten"])] for r in rows]
        columns["privileged_images"] = [[_png(r["printed"])] for r in rows]
        Dataset.from_dict(columns, features=_features()).to_parquet(str(out / f"{name}.parquet"))
    return out
