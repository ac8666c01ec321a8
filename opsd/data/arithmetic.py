"""Synthetic arithmetic word problems with worked solutions, in the text schema (text OPSD).

Each problem is one or two arithmetic steps on small numbers ("Mia has 23 marbles and finds 17
more..."), the worked solution spells every step out ("23 + 17 = 40. The answer is 40."), the
answer is the integer. In text OPSD the teacher sees the worked solution: a small model mostly
echoes a bare answer hint (wrong or right), but can follow a worked solution.
Everything is a pure function of `seed`; problem i depends only on (seed, i).

Files written by `write_dataset` (JSON lines, the text schema):
    train.jsonl, eval.jsonl   {"id": str, "problem": str, "solution": str, "answer": str}
"""

from __future__ import annotations

import json
import pathlib
import random

NAMES = ("Mia", "Tom", "Ana", "Leo", "Sara", "Ben", "Nora", "Omar")
THINGS = ("apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cards")


def _add(rng: random.Random, who: str, what: str) -> tuple[str, list[str], int]:
    a, b = rng.randint(11, 59), rng.randint(11, 39)
    problem = f"{who} has {a} {what} and finds {b} more. How many {what} does {who} have now?"
    return problem, [f"{who} starts with {a} {what} and adds {b}: {a} + {b} = {a + b}."], a + b


def _subtract(rng: random.Random, who: str, what: str) -> tuple[str, list[str], int]:
    a = rng.randint(30, 90)
    b = rng.randint(11, a - 5)
    problem = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
    return problem, [f"{who} starts with {a} {what} and gives away {b}: {a} - {b} = {a - b}."], a - b


def _multiply(rng: random.Random, who: str, what: str) -> tuple[str, list[str], int]:
    boxes, per_box = rng.randint(3, 9), rng.randint(4, 12)
    problem = f"{who} has {boxes} boxes with {per_box} {what} in each box. How many {what} are there in total?"
    return problem, [f"{boxes} boxes of {per_box} {what} each: {boxes} x {per_box} = {boxes * per_box}."], boxes * per_box


def _two_steps(rng: random.Random, who: str, what: str) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(20, 60), rng.randint(11, 30), rng.randint(5, 15)
    problem = (
        f"{who} has {a} {what}, buys {b} more and then gives {c} to a friend. "
        f"How many {what} does {who} have at the end?"
    )
    steps = [
        f"After buying: {a} + {b} = {a + b}.",
        f"After giving {c} away: {a + b} - {c} = {a + b - c}.",
    ]
    return problem, steps, a + b - c


KINDS = (_add, _subtract, _multiply, _two_steps)


def make_problem(seed: int, index: int) -> dict:
    """Problem `index` of the set drawn from `seed`, as a text-schema row."""
    rng = random.Random(f"opsd-arithmetic:{seed}:{index}")
    kind = rng.choice(KINDS)
    problem, steps, answer = kind(rng, rng.choice(NAMES), rng.choice(THINGS))
    solution = " ".join([*steps, f"The answer is {answer}."])
    return {"id": f"arith-s{seed}-{index:05d}", "problem": problem, "solution": solution, "answer": str(answer)}


def write_dataset(out_dir, *, n_train: int, n_eval: int, seed: int = 0) -> pathlib.Path:
    """Write train.jsonl and eval.jsonl (disjoint problem indices) under out_dir; return out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, indices in (("train", range(n_train)), ("eval", range(n_train, n_train + n_eval))):
        lines = [json.dumps(make_problem(seed, i)) for i in indices]
        (out / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
    return out
