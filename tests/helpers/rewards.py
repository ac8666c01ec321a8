"""Reward functions for the tests, named in configs by import path (`tests.helpers.rewards:<name>`)."""

import math


def short(sample, text, token_ids):
    """More reward for shorter completions: the tiny random models' samples differ in it."""
    return 1.0 / (1 + len(token_ids))


def even_tokens(sample, text, token_ids):
    """The share of even token ids: differs between any two random completions."""
    return sum(t % 2 == 0 for t in token_ids) / max(1, len(token_ids))


def raises(sample, text, token_ids):
    raise KeyError("no such field\nsecond line")


def not_finite(sample, text, token_ids):
    return math.nan


def not_a_number(sample, text, token_ids):
    return "1.0"


NOT_CALLABLE = 3
