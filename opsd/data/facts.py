"""Fictional facts: privileged knowledge the student cannot derive (text schema, text OPSD).

Each fact ties an invented person to one everyday value ("Velmaro's favourite fruit is mango.").
The teacher's prompt holds the fact; the student's prompt only asks about it. A model cannot
guess the value (beyond its prior over fruits), but copies it easily from its context: the gap
that self-distillation has to move into the student's weights. Evaluation asks about the same
facts with question phrasings never used in training, so a student that only learned a question
string does not score.

There are `n_facts` people (one fact each; default `n_eval`). Row i of a split asks about fact
i % n_facts, with phrasing (i // n_facts) of that split's phrasings: 3 training phrasings, 4 held-out
ones and 3 validation ones per kind of fact, each set disjoint from the others. The validation split
is for choosing settings (learning rate, loss) without looking at the held-out phrasings that the
reported accuracy uses. Everything is a pure function of `seed`.

Files written by `write_dataset` (JSON lines, the text schema plus one column):
    train.jsonl, eval.jsonl, validation.jsonl (when n_validation > 0)
        {"id", "problem", "solution", "answer", "irrelevant"}
`solution` is the fact; `irrelevant` is a true but unrelated sentence of similar length (the
noise control: point `columns.privileged_text` at it).
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "dr", "gr", "kr", "tr")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
CODAS = ("", "", "n", "r", "l", "s", "m", "x")


@dataclass(frozen=True)
class Relation:
    fact: str
    """The privileged sentence; {who} and {value}."""
    train: tuple[str, ...]
    """Question phrasings used in training."""
    held_out: tuple[str, ...]
    """Question phrasings used only in evaluation (the `eval` split)."""
    validation: tuple[str, ...]
    """Question phrasings of the `validation` split, for choosing settings."""
    values: tuple[str, ...]


RELATIONS = (
    Relation(
        fact="{who}'s favourite fruit is {value}.",
        train=("What is {who}'s favourite fruit?", "Which fruit does {who} like best?",
               "{who} has a favourite fruit. Which one is it?"),
        held_out=("Name the fruit that {who} loves most.", "If you gave {who} a fruit, which would please them most?",
                  "Tell me {who}'s preferred fruit.", "Of all fruits, which one is {who}'s top choice?"),
        validation=("Which fruit does {who} enjoy more than any other?", "What fruit would {who} choose as a treat?",
                    "Say which fruit {who} likes most."),
        values=("apple", "banana", "cherry", "mango", "lemon", "grape", "peach", "plum", "pear", "melon"),
    ),
    Relation(
        fact="{who} has a pet {value}.",
        train=("What kind of pet does {who} have?", "Which animal does {who} keep as a pet?",
               "{who} owns a pet. What animal is it?"),
        held_out=("Name the animal that lives with {who} as a pet.", "What species is {who}'s pet?",
                  "Tell me which animal {who} looks after at home.", "If you visited {who}, which pet would greet you?"),
        validation=("Which animal is {who}'s pet?", "What pet would you find in {who}'s home?",
                    "Say what kind of animal {who} keeps."),
        values=("cat", "dog", "horse", "rabbit", "parrot", "turtle", "goat", "snake", "mouse", "duck"),
    ),
    Relation(
        fact="{who} lives in {value}.",
        train=("In which city does {who} live?", "Where does {who} live?", "{who} lives in a city. Which one?"),
        held_out=("Name the city that is home to {who}.", "What is the home city of {who}?",
                  "Tell me the city where {who} has a home.", "If you wrote {who} a letter, to which city would it go?"),
        validation=("Which city is {who}'s home?", "In what city is {who}'s house?",
                    "Say which city {who} calls home."),
        values=("Paris", "London", "Tokyo", "Cairo", "Rome", "Lima", "Oslo", "Madrid", "Sydney", "Berlin"),
    ),
    Relation(
        fact="{who} works as a {value}.",
        train=("What is {who}'s job?", "What does {who} do for a living?", "{who} has a job. What is it?"),
        held_out=("Name the profession of {who}.", "Which occupation does {who} have?",
                  "Tell me how {who} earns money.", "If you met {who} at work, what would their job be?"),
        validation=("What work does {who} do?", "Which job does {who} have?",
                    "Say what {who} does for work."),
        values=("baker", "doctor", "pilot", "farmer", "teacher", "painter", "sailor", "lawyer", "nurse", "chef"),
    ),
)

IRRELEVANT = (
    "Water boils at one hundred degrees Celsius at sea level.",
    "The Pacific is the largest ocean on Earth.",
    "A week has seven days.",
    "Honey bees live in colonies with one queen.",
    "The Moon orbits the Earth about once a month.",
    "Snow is made of small ice crystals.",
    "A triangle has three sides.",
    "Most trees lose their leaves in autumn.",
)


def person_names(seed: int, n: int, avoid=None, salt: str = "opsd-facts-names") -> list[str]:
    """`n` distinct invented two-syllable names, the same for the same seed; none contains a value
    to `avoid` (default: this task's; "Dogar" would give away a dog)."""
    values = {v.lower() for v in (avoid or [v for relation in RELATIONS for v in relation.values])}
    rng = random.Random(f"{salt}:{seed}")
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n:
        name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(2)).capitalize()
        if name not in seen and len(name) >= 5 and not any(v in name.lower() for v in values):
            seen.add(name)
            names.append(name)
    return names


def make_facts(seed: int, n: int) -> list[dict]:
    """Fact k: {"who", "relation" (index into RELATIONS), "value"}; relations take turns."""
    rng = random.Random(f"opsd-facts:{seed}")
    return [
        {"who": who, "relation": k % len(RELATIONS), "value": rng.choice(RELATIONS[k % len(RELATIONS)].values)}
        for k, who in enumerate(person_names(seed, n))
    ]


def _row(seed: int, split: str, index: int, fact: dict, question: str) -> dict:
    relation = RELATIONS[fact["relation"]]
    return {
        "id": f"facts-s{seed}-{split}-{index:05d}",
        "problem": question.format(who=fact["who"]),
        "solution": relation.fact.format(who=fact["who"], value=fact["value"]),
        "answer": fact["value"],
        "irrelevant": IRRELEVANT[random.Random(f"opsd-facts-irrelevant:{seed}:{split}:{index}").randrange(len(IRRELEVANT))],
    }


PHRASINGS_OF_SPLIT = {"train": "train", "eval": "held_out", "validation": "validation"}
"""The `Relation` field each split takes its question phrasings from."""


def make_rows(seed: int, n_train: int, n_eval: int, n_facts: int | None = None, n_validation: int = 0) -> dict[str, list[dict]]:
    """Rows by split (`train`, `eval`, `validation`) about `n_facts` facts (default `n_eval`): row i of
    a split asks about fact i % n_facts, with phrasing i // n_facts of that split's phrasings (cycled)."""
    n_facts = n_eval if n_facts is None else n_facts
    check_fact_count(n_facts, n_eval)
    counts = {"train": n_train, "eval": n_eval, "validation": n_validation}
    rows: dict[str, list[dict]] = {split: [] for split in counts}
    for split, i, fact, question in question_rows(make_facts(seed, n_facts), RELATIONS, counts):
        rows[split].append(_row(seed, split, i, fact, question))
    return rows


def check_fact_count(n_facts: int, n_eval: int) -> None:
    if n_facts < 1:
        raise ValueError(f"the facts task needs at least one fact: n_facts={n_facts}, n_eval={n_eval}")


def question_rows(facts: list[dict], relations, counts: dict[str, int]):
    """(split, i, fact, question template) for `counts[split]` rows of each split: row i asks about
    fact i % len(facts), with phrasing i // len(facts) of that split's phrasings of its relation (cycled)."""
    for split, count in counts.items():
        for i in range(count):
            fact = facts[i % len(facts)]
            phrasings = getattr(relations[fact["relation"]], PHRASINGS_OF_SPLIT[split])
            yield split, i, fact, phrasings[(i // len(facts)) % len(phrasings)]


def write_dataset(out_dir, *, n_train: int, n_eval: int, seed: int = 0, n_facts: int | None = None,
                  n_validation: int = 0) -> pathlib.Path:
    """Write train.jsonl, eval.jsonl (and validation.jsonl when asked for rows) under out_dir; return out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_rows(seed, n_train, n_eval, n_facts, n_validation).items():
        if rows or name != "validation":
            (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out
