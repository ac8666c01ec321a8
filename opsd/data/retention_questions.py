"""General-knowledge questions for the retention probe (`eval.retention.questions: general`).

What a pretrained model knew before training and a task's data does not teach: 24 short questions
with one-word answers that SmolLM2-135M-Instruct (the real model of `make learn`) answers right
greedily, within 16 new tokens, under the probe's default system prompt ("You are a helpful
assistant. Answer the question briefly."). They were kept from 60 candidates checked with the vLLM
engine at step 0; the other 36 it got wrong (the capital of Spain, 2 + 2, the largest planet, ...),
and a probe of what it never knew could not show it forgetting.

Nine are capitals, four of them cities that `opsd/data/facts.py` also uses as fictional people's
home towns, and Canberra where Sydney is one: a task that teaches "Zondras lives in Sydney" may
interfere there first. A question is answered right when one of its answers appears in the
completion as a whole word, case aside.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from opsd.data.errors import DataConfigError

GENERAL_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("What is the capital of Greece?", ("Athens",)),
    ("What is the capital of Australia?", ("Canberra",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the chemical formula of water?", ("H2O", "H₂O")),
    ("What colour is the sky on a clear day?", ("blue",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What language is mainly spoken in Brazil?", ("Portuguese",)),
    ("In which country are the pyramids of Giza?", ("Egypt",)),
    ("What is the currency of Japan?", ("yen",)),
    ("What is frozen water called?", ("ice",)),
    ("What do you call a baby cat?", ("kitten",)),
    ("Which organ pumps blood through the body?", ("heart",)),
    ("Who developed the theory of relativity?", ("Einstein",)),
    ("Which ocean lies between Europe and North America?", ("Atlantic",)),
    ("What is the longest river in Africa?", ("Nile",)),
    ("What instrument has black and white keys?", ("piano",)),
)
"""(question, accepted answers)."""


def load_questions(source: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`eval.retention.questions`: `general` (the set above), or a JSON-lines file whose rows are
    `{"question": text, "answers": [text, ...]}`; a bad file or row stops the run, named."""
    if source == "general":
        return GENERAL_QUESTIONS
    path = Path(source)
    if not path.is_file():
        raise DataConfigError(f"eval.retention.questions: {source!r} is neither `general` nor a file")
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataConfigError(f"eval.retention.questions: {path}, line {number}: not JSON ({err})") from None
        question = row.get("question") if isinstance(row, dict) else None
        answers = row.get("answers") if isinstance(row, dict) else None
        texts = isinstance(answers, list) and answers and all(isinstance(a, str) and a.strip() for a in answers)
        if not (isinstance(question, str) and question.strip() and texts):
            raise DataConfigError(f'eval.retention.questions: {path}, line {number}: needs "question" (text) and '
                                  f'"answers" (a list of texts), got {line[:120]!r}')
        questions.append((question, tuple(answers)))
    if not questions:
        raise DataConfigError(f"eval.retention.questions: {path} holds no question")
    return tuple(questions)


def answered_right(completion: str, answers: tuple[str, ...]) -> bool:
    """One of `answers` appears in `completion` as a whole word (or words), case aside; a number
    counts whole too ("3" is not in "3.09")."""
    alternatives = "|".join(map(re.escape, answers))
    return re.search(rf"(?i)(?<!\w)(?<!\d[.,])(?:{alternatives})(?!\w|[.,]\d)", completion) is not None
