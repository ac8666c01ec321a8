"""The fictional-facts task: deterministic, held-out phrasings never seen in training, and every
evaluated fact taught by the training split."""

import json

import pytest

from opsd.data.facts import RELATIONS, make_rows, write_dataset


def test_same_seed_same_rows_other_seed_other_facts(tmp_path):
    a = write_dataset(tmp_path / "a", n_train=96, n_eval=32, seed=3)
    b = write_dataset(tmp_path / "b", n_train=96, n_eval=32, seed=3)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert not (a / "validation.jsonl").exists()  # only when asked for
    other_eval = make_rows(4, 96, 32)["eval"]
    assert [r["solution"] for r in other_eval] != [json.loads(line)["solution"] for line in (a / "eval.jsonl").open()]


def test_training_held_out_and_validation_questions_share_no_phrasing():
    rows = make_rows(0, 192, 64, n_facts=16, n_validation=48)
    assert [len(rows[split]) for split in ("train", "eval", "validation")] == [192, 64, 48]
    # Strip the person's name: the question templates of the three splits are disjoint.
    def template(row):
        who = row["solution"].split("'")[0].split(" ")[0]
        return row["problem"].replace(who, "{who}")
    templates = {split: {template(r) for r in split_rows} for split, split_rows in rows.items()}
    assert not templates["train"] & templates["eval"]
    assert not templates["validation"] & (templates["train"] | templates["eval"])
    assert templates["eval"] <= {q for rel in RELATIONS for q in rel.held_out}
    assert templates["train"] <= {q for rel in RELATIONS for q in rel.train}
    assert templates["validation"] == {q for rel in RELATIONS for q in rel.validation}  # 16 facts x 3
    assert make_rows(0, 192, 64)["validation"] == []


def test_every_evaluated_fact_is_taught_in_training_and_answered_by_it():
    rows = make_rows(1, 128, 64, n_validation=64)
    train, evaluation = rows["train"], rows["eval"] + rows["validation"]
    assert len(evaluation) == 128 and len({r["solution"] for r in evaluation}) == 64
    taught = {r["solution"]: r["answer"] for r in train}
    for row in evaluation:
        assert taught[row["solution"]] == row["answer"]
        assert row["solution"].endswith(f"{row['answer']}.")  # the fact holds the answer
        assert row["answer"] not in row["problem"]  # the question does not
        assert row["answer"].lower() not in row["irrelevant"].lower()  # nor the noise text


def test_too_few_facts_is_refused():
    with pytest.raises(ValueError, match="n_eval"):
        make_rows(0, 10, 0)
    with pytest.raises(ValueError, match="n_facts"):
        make_rows(0, 10, 64, n_facts=0)
