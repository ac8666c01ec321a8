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
    other_train, other_eval = make_rows(4, 96, 32)
    assert [r["solution"] for r in other_eval] != [json.loads(line)["solution"] for line in (a / "eval.jsonl").open()]


def test_held_out_questions_share_no_phrasing_with_training():
    train, evaluation = make_rows(0, 192, 64)
    train_questions = {r["problem"] for r in train}
    assert not train_questions & {r["problem"] for r in evaluation}
    # Strip the person's name: the question templates themselves are disjoint too.
    def template(row, who):
        return row["problem"].replace(who, "{who}")
    who_of = {r["solution"]: r["solution"].split("'")[0].split(" ")[0] for r in train + evaluation}
    train_templates = {template(r, who_of[r["solution"]]) for r in train}
    eval_templates = {template(r, who_of[r["solution"]]) for r in evaluation}
    assert not train_templates & eval_templates
    assert eval_templates <= {q for rel in RELATIONS for q in rel.held_out}
    assert train_templates <= {q for rel in RELATIONS for q in rel.train}


def test_every_evaluated_fact_is_taught_in_training_and_answered_by_it():
    train, evaluation = make_rows(1, 128, 64)
    assert len(evaluation) == 64 and len({r["solution"] for r in evaluation}) == 64
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
