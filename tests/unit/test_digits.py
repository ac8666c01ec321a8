"""The handwritten digits of the skill task (opsd/data/digits.py): disjoint splits that never hold a
scan the model build saw, whatever the seed."""

import pytest

from opsd.data.digits import BUILD_SCANS, WORDS, build_indices, make_rows, split_indices

TOTAL = 1797


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_splits_are_disjoint_and_never_hold_the_builds_scans(seed):
    splits = split_indices(seed, {"train": 320, "eval": 100, "validation": 50}, TOTAL)
    taken = [i for indices in splits.values() for i in indices]
    assert len(taken) == len(set(taken)) == 470
    assert not set(taken) & set(build_indices(TOTAL))
    assert len(set(build_indices(TOTAL))) == BUILD_SCANS


def test_the_splits_cannot_ask_for_the_builds_scans():
    with pytest.raises(ValueError, match="besides the 100 of the model build"):
        split_indices(0, {"train": TOTAL - BUILD_SCANS + 1}, TOTAL)


def test_rows_name_the_scan_and_answer_with_its_word():
    rows = make_rows(0, 4, 3)
    assert [len(rows[s]) for s in ("train", "eval")] == [4, 3]
    for row in rows["train"] + rows["eval"]:
        assert row["id"].startswith("digits-") and row["answer"] in WORDS
        assert row["handwritten"].size == row["printed"].size == (64, 64)
        assert row["privileged_text"] == f"{WORDS.index(row['answer'])} is {row['answer']}."
