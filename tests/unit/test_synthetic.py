"""Synthetic grid tasks: deterministic, correct for what is drawn, and round-trip through parquet."""

import re
from collections import deque

import numpy as np
import pytest

from opsd.data.synthetic import GOAL, START, WALL, cell_center, generate_samples, load_samples, write_dataset

IMAGE_SIZE = 112


def pixels(img):
    return np.asarray(img, dtype=np.uint8)


def read_grid(sample):
    """Recover (size, walls, start, goal) from the problem image's pixels alone."""
    size = int(re.search(r"(\d+)x\1 grid", sample.question).group(1))
    px = pixels(sample.images[0])
    walls, start, goal = set(), None, None
    for r in range(size):
        for c in range(size):
            x, y = cell_center(IMAGE_SIZE, size, (r, c))
            color = tuple(px[y, x])
            if color == WALL:
                walls.add((r, c))
            elif color == START:
                start = (r, c)
            elif color == GOAL:
                goal = (r, c)
    return size, walls, start, goal


def distances(size, walls, source):
    """BFS distances from source (written independently of the generator)."""
    dist, queue = {source: 0}, deque([source])
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in walls and (nr, nc) not in dist:
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return dist


def same(a, b):
    return (a.id, a.question, a.answer, a.privileged_text) == (b.id, b.question, b.answer, b.privileged_text) and all(
        np.array_equal(pixels(x), pixels(y))
        for x, y in zip(a.images + a.privileged_images, b.images + b.privileged_images, strict=True)
    )


@pytest.fixture(scope="module")
def samples():
    return generate_samples(60, seed=0)


def test_deterministic_and_prefix_stable(samples):
    again = generate_samples(60, seed=0)
    assert all(same(a, b) for a, b in zip(samples, again, strict=True))
    assert all(same(a, b) for a, b in zip(generate_samples(10, seed=0), samples[:10]))
    other = generate_samples(10, seed=1)
    assert not any(same(a, b) for a, b in zip(other, samples[:10]))
    assert len({s.id for s in samples}) == len(samples)


def test_answers_match_the_drawn_grid(samples):
    kinds = set()
    for s in samples:
        size, walls, start, goal = read_grid(s)
        assert start is not None and goal is not None
        from_goal = distances(size, walls, goal)
        steps = from_goal[start]
        if s.answer.isdigit():
            kinds.add("steps")
            assert int(s.answer) == steps
        else:
            kinds.add("first_move")
            moves = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
            best = [m for m, (dr, dc) in moves.items() if from_goal.get((start[0] + dr, start[1] + dc)) == steps - 1]
            assert best == [s.answer]  # the first move is unambiguous
        assert f"after {steps} steps" in s.privileged_text and s.privileged_text.count("Move ") == steps
    assert kinds == {"steps", "first_move"}


def test_visual_thoughts_draw_the_path_progressively(samples):
    counts = set()
    for s in samples:
        counts.add(len(s.privileged_images))
        assert 1 <= len(s.privileged_images) <= 4 and len(s.images) == 1
        for img in s.images + s.privileged_images:
            assert img.mode == "RGB" and img.size == (IMAGE_SIZE, IMAGE_SIZE)
        drawn = [(pixels(t) != pixels(s.images[0])).any(axis=-1).sum() for t in s.privileged_images]
        assert drawn[0] > 0 and all(a < b for a, b in zip(drawn, drawn[1:]))
    assert counts == {1, 2, 3, 4}


def test_a_smaller_set_is_the_start_of_a_larger_one():
    """Sample i depends only on (seed, i): growing n_train keeps the rows a run already saw."""
    few, many = generate_samples(5, seed=7), generate_samples(12, seed=7)
    assert all(same(a, b) for a, b in zip(few, many[:5], strict=True))
    assert len({s.id for s in many}) == 12


def test_parquet_round_trip(tmp_path):
    from datasets import load_dataset

    out = write_dataset(tmp_path / "data", n_train=6, n_eval=3, seed=5)
    expected = generate_samples(9, seed=5)
    train, evaluation = load_samples(out / "train.parquet"), load_samples(out / "eval.parquet")
    assert all(same(a, b) for a, b in zip(train + evaluation, expected, strict=True))
    assert not {s.id for s in train} & {s.id for s in evaluation}

    files = {"train": str(out / "train.parquet"), "eval": str(out / "eval.parquet")}
    ds = load_dataset("parquet", data_files=files, cache_dir=str(tmp_path / "hf_cache"))
    assert (ds["train"].num_rows, ds["eval"].num_rows) == (6, 3)
    assert set(ds["train"].column_names) == {"id", "question", "answer", "images", "privileged_images", "privileged_text"}
    row = ds["train"][0]
    assert row["id"] == train[0].id and row["answer"] == train[0].answer
    assert np.array_equal(pixels(row["images"][0].convert("RGB")), pixels(train[0].images[0]))
    assert len(row["privileged_images"]) == len(train[0].privileged_images)


def test_prepare_writes_the_dataset_whole_and_keeps_a_copy_another_run_wrote_first(tmp_path, monkeypatch):
    """`prepare` renames a finished staging directory into place: nothing half written is ever at
    `path`, and a run that loses the race to another keeps the winner's files and leaves no staging."""
    from opsd.config import DatasetConfig, SyntheticDataConfig
    from opsd.data import dataset as dataset_module

    path = tmp_path / "grid"
    config = DatasetConfig(path=str(path), schema="project", eval_split="eval",
                           synthetic=SyntheticDataConfig(n_train=3, n_eval=2, seed=5))
    dataset_module.prepare(config)
    assert sorted(p.name for p in path.iterdir()) == ["eval.parquet", "train.parquet"]
    assert [p.name for p in tmp_path.iterdir()] == ["grid"]
    assert len(load_samples(path / "train.parquet")) == 3

    other = tmp_path / "raced"
    config = DatasetConfig(path=str(other), schema="project", eval_split="eval",
                           synthetic=SyntheticDataConfig(n_train=3, n_eval=2, seed=5))
    write = dataset_module._write_synthetic

    def another_run_finishes_first(s, staging):
        assert not other.exists()  # the split being written is not where runs read
        write(s, staging)
        write_dataset(other, n_train=1, n_eval=1, seed=9)

    monkeypatch.setattr(dataset_module, "_write_synthetic", another_run_finishes_first)
    dataset_module.prepare(config)
    assert len(load_samples(other / "train.parquet")) == 1  # the first run's copy, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid", "raced"]
