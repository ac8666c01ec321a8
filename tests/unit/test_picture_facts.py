"""The picture-facts task: deterministic, the fact's value only in the teacher's picture, held-out
phrasings, values spread evenly; and the pictures it draws."""

import random

import numpy as np
import pytest
from transformers import AutoProcessor

from opsd.config import load_config
from opsd.data.dataset import split_samples
from opsd.data.picture_facts import RELATIONS, VALUES, make_facts, make_rows, write_dataset
from opsd.data.pictures import COLOURS, SHAPES, draw_picture, draw_value
from opsd.prompts import student_prompt, teacher_prompt

CONFIG = "configs/learn_picture_facts_smollm2_vlm.yaml"


def test_same_seed_same_files_other_seed_other_facts(tmp_path):
    a = write_dataset(tmp_path / "a", n_train=24, n_eval=16, seed=3)
    b = write_dataset(tmp_path / "b", n_train=24, n_eval=16, seed=3, n_validation=8)
    assert not (a / "validation.parquet").exists() and (b / "validation.parquet").exists()
    for name in ("train.parquet", "eval.parquet"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert make_facts(3, 16) != make_facts(4, 16)


def test_the_value_is_only_in_the_picture_and_the_picture_shows_only_the_value():
    rows = make_rows(0, 48, 64, n_facts=16, n_validation=32)
    train, evaluation = rows["train"], rows["eval"]
    for row in train + evaluation + rows["validation"]:
        assert row["answer"] not in row["question"].lower() and row["answer"] not in row["privileged_text"]
        assert row["fact"] == f"{row['privileged_text']} {row['answer']}."
        pixels = np.asarray(row["picture"]).reshape(-1, 3).astype(int)
        if row["answer"] in COLOURS:  # a swatch: every pixel the colour (within its shade)
            assert np.abs(pixels - np.array(COLOURS[row["answer"]])).max() <= 12, row["id"]
        else:  # a grey shape: no colour at all
            assert (pixels.max(axis=1) - pixels.min(axis=1)).max() <= 20, row["id"]
    # Every row draws its picture anew: the same fact, another picture.
    first_of = {}
    for row in train:
        first_of.setdefault(row["fact"], row["picture"])
    again = [r for r in train if first_of[r["fact"]] is not r["picture"]]
    assert again and all(np.asarray(r["picture"]).tobytes() != np.asarray(first_of[r["fact"]]).tobytes()
                         for r in again)


def test_held_out_phrasings_and_every_evaluated_fact_taught():
    rows = make_rows(1, 48, 64, n_facts=16, n_validation=32)
    train, evaluation, validation = rows["train"], rows["eval"], rows["validation"]
    questions = [{r["question"] for r in split} for split in (train, evaluation, validation)]
    assert all(not a & b for i, a in enumerate(questions) for b in questions[i + 1:])  # three disjoint sets
    taught = {r["privileged_text"]: r["answer"] for r in train}
    assert all(taught[r["privileged_text"]] == r["answer"] for r in evaluation + validation)
    assert len(validation) == 32
    assert len(taught) == 16
    assert {q for rel in RELATIONS for q in rel.held_out}.isdisjoint(q for rel in RELATIONS for q in rel.train)


def test_values_spread_evenly_over_facts():
    facts = make_facts(0, 16)
    colours = [f["value"] for f in facts if f["value"] in COLOURS]
    shapes = [f["value"] for f in facts if f["value"] in SHAPES]
    assert sorted(colours) == sorted(COLOURS) and sorted(shapes) == sorted(SHAPES)
    # No name holds a value ("Redmo" would give a colour away).
    assert not any(v in f["who"].lower() for f in facts for v in VALUES)


def test_every_shape_and_colour_draws_distinctly():
    rng = random.Random(0)
    for shape in SHAPES:
        for colour in COLOURS:
            image = draw_picture(colour, shape, rng, 64)
            assert image.size == (64, 64) and image.mode == "RGB"
            pixels = np.asarray(image).reshape(-1, 3)
            assert 150 < (pixels != pixels[0]).any(axis=1).sum() < 64 * 64 - 150  # a shape on a background
    # Shapes differ in outline: the same colour, place and size give different masks.
    masks = {}
    for shape in SHAPES:
        image = draw_picture("blue", shape, random.Random(7), 64)
        masks[shape] = (np.asarray(image)[:, :, 2] > 150) & (np.asarray(image)[:, :, 0] < 100)
    for a in SHAPES:
        for b in SHAPES:
            if a < b:
                assert (masks[a] != masks[b]).sum() > 40, (a, b)


def test_value_pictures_tell_values_apart():
    rng = random.Random(0)
    swatches = [np.asarray(draw_value(colour, rng, 64)) for colour in COLOURS]
    assert all((s == s[0, 0]).all() for s in swatches)  # one flat colour each
    masks = {shape: np.asarray(draw_value(shape, random.Random(7), 64)).max(axis=2) < 120 for shape in SHAPES}
    assert all(150 < m.sum() < 64 * 64 - 150 for m in masks.values())
    assert all((masks[a] != masks[b]).sum() > 40 for a in SHAPES for b in SHAPES if a < b)
    with pytest.raises(ValueError, match="neither a colour"):
        draw_value("teal", rng)


def test_the_recipe_gives_the_student_no_image_and_the_teacher_the_sentence_ending_in_the_picture(tmp_path, tiny_vlm_dir):
    cfg = load_config(CONFIG, [f"data.datasets.0.path={tmp_path / 'pf'}", "data.datasets.0.synthetic.n_train=8",
                               "data.datasets.0.synthetic.n_eval=8", "data.datasets.0.synthetic.n_facts=4",
                               "eval.num_samples=8"])
    samples, skipped = split_samples(cfg, 8, split="eval")
    assert len(samples) == 8 and not skipped
    for sample in samples:
        assert sample.images == [] and len(sample.privileged_images) == 1
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    student = student_prompt(samples[0], processor, cfg.prompts)
    teacher = teacher_prompt(samples[0], processor, cfg.prompts)
    assert student.images == [] and "<image>" not in student.text
    assert len(teacher.images) == 1 and teacher.parts[-2:] == [f"Fact:\n{samples[0].privileged_text}", teacher.images[0]]
    assert samples[0].answer not in teacher.text  # only the picture holds it
    # The controls: no privileged part at all; the supervised baseline's text is the whole fact.
    bare = load_config(CONFIG, [f"data.datasets.0.path={tmp_path / 'pf'}", "prompts.privileged=[]"])
    assert teacher_prompt(samples[0], processor, bare.prompts).text == student.text
    sft = load_config(CONFIG, [f"data.datasets.0.path={tmp_path / 'pf'}", "data.datasets.0.columns.privileged_text=fact",
                               "eval.num_samples=8"])
    (sample, *_), _ = split_samples(sft, 8, split="eval")
    assert sample.privileged_text.endswith(f" {sample.answer}.")
