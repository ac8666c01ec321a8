"""The handwritten digits of the skill task (opsd/data/digits.py): the UCI file as scikit-learn ships
it, and disjoint splits that never hold a scan the model build saw, whatever the seed."""

import hashlib

import numpy as np
import pytest

from opsd.data.digits import BUILD_SCANS, UCI_DIGITS_FILE, WORDS, build_indices, load_digits, make_rows, split_indices

TOTAL = 1797


def test_the_uci_file_is_scikit_learns_copy_with_the_uci_class_counts():
    # sklearn/datasets/data/digits.csv.gz of scikit-learn 1.9.1, byte for byte.
    digest = hashlib.sha256(UCI_DIGITS_FILE.read_bytes()).hexdigest()
    assert digest == "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
    images, labels = load_digits()
    assert images.shape == (TOTAL, 8, 8) and labels.shape == (TOTAL,)
    assert images.min() == 0 and images.max() == 16 and np.array_equal(images, images.round())
    # The class counts UCI documents for the test set (optdigits.tes), which this file is.
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


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
