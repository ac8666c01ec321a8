"""Answer matching, shared by evaluation and the rewards: the answer of a completion (the last match of
a pattern) and whether it equals a reference after normalisation. A leaf: it imports nothing of opsd.
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "is_correct", "normalise_answer"]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")
"""A whole answer that is one of these words compares as its numeral ("seven" = "7")."""


def extract_answer(text: str, pattern: str) -> str | None:
    """The last match of `pattern` in `text` (its first group when it has one), or None."""
    matches = list(re.finditer(pattern, text, flags=re.DOTALL))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def normalise_answer(answer: str) -> str:
    """Case, surrounding spaces/markup and final punctuation do not count; numbers compare by
    value ("1,000" = "1000", "12.0" = "12"), and a number word as its numeral ("seven" = "7")."""
    text = " ".join(answer.strip().casefold().split())
    text = text.strip("*$`\"' ").rstrip(".!").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", text)
    if boxed:
        text = boxed.group(1).strip()
    if text in NUMBER_WORDS:
        return str(NUMBER_WORDS.index(text))
    number = text.replace(",", "")
    if _NUMBER.fullmatch(number):
        value = float(number)
        return str(int(value)) if value.is_integer() else str(value)
    return text


def is_correct(completion: str, reference: str, pattern: str) -> bool:
    answer = extract_answer(completion, pattern)
    return answer is not None and normalise_answer(answer) == normalise_answer(reference)
