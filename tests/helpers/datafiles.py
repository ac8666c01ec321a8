"""Small dataset files in each schema, with planted bad rows, for the data tests.

Good rows reuse the synthetic grid tasks (real images the tiny VLM can take). Bad rows each carry
exactly one defect, so a test can count the skips per reason.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from opsd.data.arithmetic import make_problem
from opsd.data.synthetic import generate_samples


def png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def struct(data: bytes | None) -> dict:
    return {"bytes": data, "path": None}


def huge_png(pixels_per_side: int = 3000) -> bytes:
    return png(Image.new("L", (pixels_per_side, pixels_per_side), 255))


def thinkmorph_rows(n_good: int, *, spelling: str = "resoning", seed: int = 0) -> list[dict]:
    """ThinkMorph-style rows: problem_image_0, then per round a thought and an image; the last
    thought has no image after it, as in the published data."""
    rows = []
    for i, s in enumerate(generate_samples(n_good, seed=seed)):
        row = {"pid": f"tm-{seed}-{i}", "question": s.question, "answer": s.answer, "problem_image_0": struct(png(s.images[0]))}
        for r, image in enumerate(s.privileged_images):
            row[f"{spelling}_thought_{r}"] = f"Round {r}: follow the path."
            row[f"reasoning_image_{r}"] = struct(png(image))
        row[f"{spelling}_thought_{len(s.privileged_images)}"] = f"So the answer is {s.answer}."
        rows.append(row)
    return rows


# Planted defects: (reason counted when skipped, how to break a good row).
THINKMORPH_DEFECTS = [
    ("corrupt_image", lambda row: row.update(problem_image_0=struct(b"\x89PNG not really an image"))),
    ("missing_image", lambda row: row.update(problem_image_0=struct(None))),
    ("empty_question", lambda row: row.update(question="   ")),
    ("empty_answer", lambda row: row.update(answer="")),
    ("no_privileged_images", lambda row: row.update({k: None for k in list(row) if k.startswith("reasoning_image_")})),
    ("image_too_large", lambda row: row.update(problem_image_0=struct(huge_png()))),
]


def convert_modes(rows: list[dict]) -> None:
    """Re-encode problem images of the first rows as CMYK (JPEG), L and RGBA: valid, not RGB."""
    for row, (mode, fmt) in zip(rows, [("CMYK", "JPEG"), ("L", "PNG"), ("RGBA", "PNG")]):
        image = Image.open(io.BytesIO(row["problem_image_0"]["bytes"])).convert(mode)
        row["problem_image_0"] = struct(png(image, fmt))


def write_parquet(rows: list[dict], path) -> None:
    """Every key of every row becomes a column (missing values null), as in the published files."""
    columns = sorted({k for row in rows for k in row})
    pq.write_table(pa.Table.from_pylist([{c: row.get(c) for c in columns} for row in rows]), str(path))


def write_thinkmorph(path, *, n_good: int = 8, defects=THINKMORPH_DEFECTS, spelling: str = "resoning", seed: int = 0):
    """Good rows (3 of them in non-RGB modes) followed by one row per defect."""
    rows = thinkmorph_rows(n_good + len(defects), spelling=spelling, seed=seed)
    convert_modes(rows)
    for row, (_, breaks) in zip(rows[n_good:], defects):
        breaks(row)
    write_parquet(rows, path)
    return path


TEXT_DEFECTS = [
    ("empty_question", lambda row: row.update(problem="")),
    ("empty_answer", lambda row: row.update(answer=None)),
    ("no_privileged_text", lambda row: row.update(solution="  ")),
    ("prompt_too_long", lambda row: row.update(problem="How many apples? " * 400)),
]


def write_text_jsonl(path, *, n_good: int = 8, defects=TEXT_DEFECTS, seed: int = 0):
    rows = [make_problem(seed, i) for i in range(n_good + len(defects))]
    for row, (_, breaks) in zip(rows[n_good:], defects):
        breaks(row)
    rows[0]["answer"] = int(rows[0]["answer"])  # a number, as JSON often has it: still a valid answer
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def project_rows(n: int, seed: int = 0) -> list[dict]:
    return [
        {
            "id": s.id, "question": s.question, "answer": s.answer,
            "images": [struct(png(im)) for im in s.images],
            "privileged_images": [struct(png(im)) for im in s.privileged_images],
            "privileged_text": s.privileged_text,
        }
        for s in generate_samples(n, seed=seed)
    ]


PROJECT_DEFECTS = [
    ("corrupt_image", lambda row: row["privileged_images"].__setitem__(0, struct(b"GIF89a truncated"))),
    ("missing_image", lambda row: row.update(images=[])),
    ("no_privileged_images", lambda row: row.update(privileged_images=[])),
    ("too_many_images", lambda row: row.update(images=row["images"] * 5)),
]


def write_project(path, *, n_good: int = 8, defects=PROJECT_DEFECTS, seed: int = 0):
    rows = project_rows(n_good + len(defects), seed=seed)
    for row, (_, breaks) in zip(rows[n_good:], defects):
        breaks(row)
    write_parquet(rows, path)
    return path
