"""Synthetic grid-maze tasks with privileged visual thoughts, drawn with PIL.

Each task is an n x n grid (n in 4..6) with a green start cell, a red goal cell and dark wall
cells. Moves go one cell up, down, left or right. Two kinds of question:
- "steps": how many steps the shortest path takes (answer: a number, e.g. "5");
- "first_move": the direction of the first move (answer: "up", "down", "left" or "right"), asked
  only when every shortest path starts the same way.
The privileged visual thoughts are 1 to 4 copies of the problem image with one shortest path drawn
progressively (the last shows all of it); the privileged text walks the same path in words.
Everything is a pure function of `seed`; sample i does not depend on how many are generated.

Parquet schema written by `write_dataset` (train.parquet, eval.parquet):
    id                 string
    question           string
    answer             string
    images             list<Image>  one problem image; each item {"bytes": PNG, "path": null}
    privileged_images  list<Image>  visual thoughts, same encoding
    privileged_text    string
The `datasets` features live in the parquet metadata, so `datasets.load_dataset("parquet", ...)`
decodes the images to PIL; `load_samples` reads the file back into `Sample`s without `datasets`.
"""

from __future__ import annotations

import io
import pathlib
import random
from collections import deque
from dataclasses import dataclass

import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from opsd.data.sample import Sample

Cell = tuple[int, int]  # (row, column), 0-based from the top-left

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}  # BFS order too
BACKGROUND, GRID_LINE, WALL = (255, 255, 255), (190, 190, 190), (60, 60, 60)
START, GOAL, PATH = (0, 170, 0), (220, 0, 0), (30, 90, 255)
MARGIN = 4


@dataclass(frozen=True)
class GridTask:
    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell
    kind: str  # "steps" or "first_move"


def shortest_path(size: int, walls, start: Cell, goal: Cell) -> list[Cell] | None:
    """One shortest path start..goal (BFS, neighbours in MOVES order), or None if unreachable."""
    parent: dict[Cell, Cell | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path = [cell]
            while parent[path[-1]] is not None:
                path.append(parent[path[-1]])
            return path[::-1]
        for dr, dc in MOVES.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls and nxt not in parent:
                parent[nxt] = cell
                queue.append(nxt)
    return None


def first_moves(size: int, walls, start: Cell, goal: Cell) -> set[str]:
    """Directions from start that begin some shortest path."""
    best = len(shortest_path(size, walls, start, goal)) - 1
    moves = set()
    for name, (dr, dc) in MOVES.items():
        nxt = (start[0] + dr, start[1] + dc)
        if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls:
            rest = shortest_path(size, walls, nxt, goal)
            if rest is not None and len(rest) == best:
                moves.add(name)
    return moves


def _direction(a: Cell, b: Cell) -> str:
    return next(name for name, d in MOVES.items() if (b[0] - a[0], b[1] - a[1]) == d)


def random_task(rng: random.Random) -> GridTask:
    """Draw a solvable task whose shortest path has at least 2 steps."""
    while True:
        size = rng.randint(4, 6)
        cells = [(r, c) for r in range(size) for c in range(size)]
        start, goal = rng.sample(cells, 2)
        free = [cell for cell in cells if cell not in (start, goal)]
        walls = frozenset(rng.sample(free, int(len(cells) * rng.uniform(0.1, 0.3))))
        path = shortest_path(size, walls, start, goal)
        if path is None or len(path) < 3:
            continue
        kind = rng.choice(["steps", "first_move"])
        if kind == "first_move" and len(first_moves(size, walls, start, goal)) != 1:
            kind = "steps"  # ambiguous first move: ask for the length instead
        return GridTask(size, walls, start, goal, kind)


def cell_box(image_size: int, size: int, cell: Cell) -> tuple[int, int, int, int]:
    """Pixel box (x0, y0, x1, y1), inclusive, of a grid cell."""
    step = (image_size - 2 * MARGIN) // size
    x0, y0 = MARGIN + cell[1] * step, MARGIN + cell[0] * step
    return x0, y0, x0 + step, y0 + step


def cell_center(image_size: int, size: int, cell: Cell) -> tuple[int, int]:
    x0, y0, x1, y1 = cell_box(image_size, size, cell)
    return (x0 + x1) // 2, (y0 + y1) // 2


def draw_task(task: GridTask, image_size: int, path: list[Cell] | None = None) -> Image.Image:
    """The problem image; with `path`, that path drawn on top as a visual thought."""
    img = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for r in range(task.size):
        for c in range(task.size):
            fill = WALL if (r, c) in task.walls else None
            draw.rectangle(cell_box(image_size, task.size, (r, c)), fill=fill, outline=GRID_LINE)
    for cell, color in ((task.start, START), (task.goal, GOAL)):
        x0, y0, x1, y1 = cell_box(image_size, task.size, cell)
        draw.rectangle((x0 + 2, y0 + 2, x1 - 2, y1 - 2), fill=color)
    if path:
        points = [cell_center(image_size, task.size, cell) for cell in path]
        width = max(2, image_size // (8 * task.size))
        if len(points) > 1:
            draw.line(points, fill=PATH, width=width)
        for x, y in points[1:]:
            draw.ellipse((x - width, y - width, x + width, y + width), fill=PATH)
    return img


def _question(task: GridTask) -> str:
    intro = (
        f"The image shows a {task.size}x{task.size} grid maze. The green square is the start and the "
        "red square is the goal; dark cells are walls. You move one cell at a time up, down, left or "
        "right and never enter a wall."
    )
    if task.kind == "steps":
        return intro + " How many steps does the shortest path from the green square to the red square take?"
    return (
        intro + " Which direction is the first move of the shortest path from the green square to "
        "the red square? Answer with one word: up, down, left or right."
    )


def make_sample(task: GridTask, sample_id: str, rng: random.Random, image_size: int = 112) -> Sample:
    path = shortest_path(task.size, task.walls, task.start, task.goal)
    steps = len(path) - 1
    n_thoughts = rng.randint(1, min(4, steps))
    # Prefix lengths grow evenly and the last thought shows the whole path.
    ends = [-(-steps * (i + 1) // n_thoughts) for i in range(n_thoughts)]
    thoughts = [draw_task(task, image_size, path[: end + 1]) for end in ends]
    answer = str(steps) if task.kind == "steps" else _direction(path[0], path[1])
    lines = [f"Start at ({task.start[0]},{task.start[1]}), written as (row,column) from the top-left."]
    lines += [f"Move {_direction(a, b)} to ({b[0]},{b[1]})." for a, b in zip(path, path[1:])]
    lines.append(f"The goal is reached after {steps} steps. So the answer is {answer}.")
    return Sample(
        id=sample_id,
        question=_question(task),
        images=[draw_task(task, image_size)],
        privileged_images=thoughts,
        privileged_text=" ".join(lines),
        answer=answer,
    )


def _iter_samples(seed: int, image_size: int):
    """Endless stream of distinct samples; sample i depends only on (seed, i)."""
    seen = set()
    i = 0
    while True:
        rng = random.Random(f"opsd-grid:{seed}:{i}")
        task = random_task(rng)
        key = (task.size, tuple(sorted(task.walls)), task.start, task.goal, task.kind)
        if key not in seen:
            seen.add(key)
            yield make_sample(task, f"grid-s{seed}-{i:05d}", rng, image_size)
        i += 1


def generate_samples(n: int, *, seed: int = 0, image_size: int = 112) -> list[Sample]:
    stream = _iter_samples(seed, image_size)
    return [next(stream) for _ in range(n)]


def _features():
    from datasets import Features, Image as ImageFeature, Sequence, Value

    return Features(
        id=Value("string"),
        question=Value("string"),
        answer=Value("string"),
        images=Sequence(ImageFeature()),
        privileged_images=Sequence(ImageFeature()),
        privileged_text=Value("string"),
    )


def _png(img: Image.Image) -> dict:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def write_dataset(out_dir, *, n_train: int, n_eval: int, seed: int = 0, image_size: int = 112) -> pathlib.Path:
    """Write train.parquet and eval.parquet (disjoint tasks) under out_dir; return out_dir."""
    from datasets import Dataset

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = generate_samples(n_train + n_eval, seed=seed, image_size=image_size)
    for name, part in (("train", samples[:n_train]), ("eval", samples[n_train:])):
        columns = {
            "id": [s.id for s in part],
            "question": [s.question for s in part],
            "answer": [s.answer for s in part],
            "images": [[_png(im) for im in s.images] for s in part],
            "privileged_images": [[_png(im) for im in s.privileged_images] for s in part],
            "privileged_text": [s.privileged_text for s in part],
        }
        Dataset.from_dict(columns, features=_features()).to_parquet(str(out / f"{name}.parquet"))
    return out


def _decode(item: dict) -> Image.Image:
    return Image.open(io.BytesIO(item["bytes"])).convert("RGB")


def load_samples(parquet_path) -> list[Sample]:
    """Read a parquet file in the schema above back into Samples (RGB PIL images)."""
    rows = pq.read_table(str(parquet_path)).to_pylist()
    return [
        Sample(
            id=row["id"],
            question=row["question"],
            images=[_decode(item) for item in row["images"]],
            privileged_images=[_decode(item) for item in row["privileged_images"]],
            privileged_text=row.get("privileged_text"),
            answer=row.get("answer"),
        )
        for row in rows
    ]
