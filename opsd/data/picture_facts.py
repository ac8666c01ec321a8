"""Picture facts: privileged knowledge shown to the teacher only as a picture (project schema, Visual OPSD).

The facts task (`opsd.data.facts`) with the fact's value drawn instead of written: each invented
person has one thing whose colour or shape is the fact ("Zondras's kite is shaped like a star.").
The student is asked about it with no image at all ("Name the shape of Zondras's kite."); the
teacher's prompt adds the fact with its last word replaced by a picture of it ("Fact:\nZondras's
kite is shaped like a" + a grey star; a colour is a swatch of that colour), so the words of the
answer never appear, and the picture shows nothing but the answer. The teacher must read the
picture; the student must take the fact into its weights. Held-out question phrasings at
evaluation, as in the facts task.

Values are spread evenly: with 8 colour facts each colour is the answer once (so is each shape of
8 shape facts), so a student that says one colour to every question gains little. Every row's
picture is drawn anew (shade; a shape's place, size and angle) from (seed, split, row).

Files written by `write_dataset` (parquet, the project schema without problem images; configure
`columns: {images: []}` and `prompts.images_after_text: true`):
    train.parquet, eval.parquet,  id,
    validation.parquet (when asked) question, answer, privileged_images (one picture),
                                  privileged_text (the fact's sentence before its value),
                                  fact (the whole sentence in words: what `loss.kind=sft` trains on
                                  with `columns.privileged_text=fact`)
"""


from __future__ import annotations

import pathlib
import random

from opsd.data.facts import Relation, check_fact_count, person_names, question_rows
from opsd.data.pictures import COLOURS, SHAPES, draw_value
from opsd.data.synthetic import _png

RELATIONS = (
    Relation(
        fact="{who}'s car is {value}.",
        train=("What colour is {who}'s car?", "Which colour is the car that {who} drives?",
               "{who} has a car. What colour is it?"),
        held_out=("Name the colour of {who}'s car.", "If you saw {who}'s car, what colour would it be?",
                  "Tell me the colour of the car {who} owns.", "Which colour is {who}'s car painted?"),
        validation=("Say what colour {who}'s car is.", "What colour would {who}'s car look in daylight?"),
        values=tuple(COLOURS),
    ),
    Relation(
        fact="{who}'s kite is shaped like a {value}.",
        train=("What shape is {who}'s kite?", "Which shape does the kite of {who} have?",
               "{who} flies a kite. What shape is it?"),
        held_out=("Name the shape of {who}'s kite.", "If you saw {who}'s kite in the sky, what shape would it be?",
                  "Tell me the shape of the kite {who} owns.", "Which shape is {who}'s kite cut in?"),
        validation=("Say what shape {who}'s kite is.", "What outline does {who}'s kite have?"),
        values=SHAPES,
    ),
    Relation(
        fact="{who}'s umbrella is {value}.",
        train=("What colour is {who}'s umbrella?", "Which colour is the umbrella that {who} carries?",
               "{who} has an umbrella. What colour is it?"),
        held_out=("Name the colour of {who}'s umbrella.", "If {who} opened the umbrella, what colour would you see?",
                  "Tell me the colour of the umbrella {who} owns.", "Which colour is {who}'s umbrella made in?"),
        validation=("Say what colour {who}'s umbrella is.", "What colour is the umbrella {who} opens in the rain?"),
        values=tuple(COLOURS),
    ),
    Relation(
        fact="{who}'s badge is shaped like a {value}.",
        train=("What shape is {who}'s badge?", "Which shape does the badge of {who} have?",
               "{who} wears a badge. What shape is it?"),
        held_out=("Name the shape of {who}'s badge.", "If you looked at {who}'s badge, what shape would it be?",
                  "Tell me the shape of the badge {who} wears.", "Which shape is {who}'s badge cut in?"),
        validation=("Say what shape {who}'s badge is.", "What outline does {who}'s badge have?"),
        values=SHAPES,
    ),
)
VALUES = tuple(COLOURS) + SHAPES


def make_facts(seed: int, n: int) -> list[dict]:
    """Fact k: {"who", "relation" (index into RELATIONS), "value"}; relations take turns, and each
    relation's values are dealt from a shuffled deck (every value once before any repeats)."""
    rng = random.Random(f"opsd-picture-facts:{seed}")
    names = person_names(seed, n, avoid=VALUES, salt="opsd-picture-facts-names")
    decks: dict[tuple[str, ...], list[str]] = {}  # relations of one kind share a deck
    facts = []
    for k, who in enumerate(names):
        relation = k % len(RELATIONS)
        values = RELATIONS[relation].values
        deck = decks.setdefault(values, [])
        if not deck:
            deck += rng.sample(values, len(values))
        facts.append({"who": who, "relation": relation, "value": deck.pop()})
    return facts


def fact_parts(fact: dict) -> tuple[str, str]:
    """(the fact's sentence up to its value: what the teacher reads before the picture, the whole
    sentence in words)."""
    sentence = RELATIONS[fact["relation"]].fact.format(who=fact["who"], value=fact["value"])
    return sentence[: sentence.rindex(fact["value"])].rstrip(), sentence


def make_rows(seed: int, n_train: int, n_eval: int, n_facts: int | None = None, image_size: int = 64,
              n_validation: int = 0) -> dict[str, list[dict]]:
    """Rows by split (`train`, `eval`, `validation`) as dicts with a PIL `picture` of the value; row i
    of a split asks about fact i % n_facts with phrasing i // n_facts of that split's phrasings (cycled)."""
    n_facts = n_eval if n_facts is None else n_facts
    check_fact_count(n_facts, n_eval)
    facts = make_facts(seed, n_facts)
    counts = {"train": n_train, "eval": n_eval, "validation": n_validation}
    rows: dict[str, list[dict]] = {split: [] for split in counts}
    for split, index, fact, question in question_rows(facts, RELATIONS, counts):
        rng = random.Random(f"opsd-picture-facts-row:{seed}:{split}:{index}")
        before, sentence = fact_parts(fact)
        rows[split].append({
            "id": f"picture-facts-s{seed}-{split}-{index:05d}",
            "question": question.format(who=fact["who"]),
            "answer": fact["value"],
            "picture": draw_value(fact["value"], rng, image_size),
            "privileged_text": before,
            "fact": sentence,
        })
    return rows


def _features():
    from datasets import Features, Image as ImageFeature, Sequence, Value

    return Features(id=Value("string"), question=Value("string"), answer=Value("string"),
                    privileged_images=Sequence(ImageFeature()), privileged_text=Value("string"), fact=Value("string"))


def write_dataset(out_dir, *, n_train: int, n_eval: int, seed: int = 0, n_facts: int | None = None,
                  image_size: int = 64, n_validation: int = 0) -> pathlib.Path:
    """Write train.parquet, eval.parquet (and validation.parquet when asked for rows) under out_dir;
    return out_dir."""
    from datasets import Dataset

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_rows(seed, n_train, n_eval, n_facts, image_size, n_validation).items():
        if not rows and name == "validation":
            continue
        columns = {key: [r[key] for r in rows] for key in ("id", "question", "answer", "privileged_text", "fact")}
        columns["privileged_images"] = [[_png(r["picture"])] for r in rows]
        Dataset.from_dict(columns, features=_features()).to_parquet(str(out / f"{name}.parquet"))
    return out
