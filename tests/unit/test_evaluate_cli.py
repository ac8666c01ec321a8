"""`python -m opsd.evaluate`: training's evaluation of a model or checkpoint, and the records every evaluation writes."""

import json

import yaml
from tests.helpers.datafiles import write_text_jsonl

from opsd.evaluate import main
from opsd.evaluation import eval_file

ENGINE = "tests.helpers.scripted_engine:AnswerEngine"


def write_config(tmp_path, model_dir) -> str:
    data = tmp_path / "data"
    data.mkdir()
    write_text_jsonl(data / "train.jsonl", n_good=4, defects=[])
    write_text_jsonl(data / "eval.jsonl", n_good=3, defects=[], seed=1)
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"datasets": [{"path": str(data), "schema": "text", "eval_split": "eval"}]},
        "prompts": {"privileged": ["answer"]},
        "rollout": {"engine": ENGINE},
        "eval": {"every": 5, "num_samples": 3, "with_teacher_prompt": True},
        "logging": {"output_dir": str(tmp_path / "unused")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_evaluate_prints_both_accuracies_and_writes_each_items_answer(tmp_path, tiny_text_dir, capsys):
    """The scripted engine answers right only from the teacher's prompt (it holds the reference answer):
    accuracy 0, teacher-prompt accuracy 1, and the records say why, item by item."""
    out = tmp_path / "eval-out"
    assert main(["--config", write_config(tmp_path, tiny_text_dir), "--model", str(tiny_text_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(step 0): eval on 3 items: accuracy 0.000 (answered 1.000); teacher prompt: accuracy 1.000" in printed
    records = [json.loads(line) for line in eval_file(out, 0).read_text().splitlines()]
    assert str(eval_file(out, 0)) in printed and eval_file(out, 0) == out / "eval" / "step_0.jsonl"
    assert [r["role"] for r in records] == ["student"] * 3 + ["teacher"] * 3
    student, teacher = records[0], records[3]
    assert student["id"] == teacher["id"] and student["answer"] == "unknown" and student["correct"] is False
    assert teacher["completion"] == f"<answer>{teacher['reference']}</answer>" and teacher["correct"] is True
    assert (out / "evaluate.log").is_file()


def test_evaluate_refuses_bad_input_with_one_line(tmp_path, tiny_text_dir, capsys):
    config = write_config(tmp_path, tiny_text_dir)
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --checkpoint") and len(err.splitlines()) == 1
    assert main(["--model", str(tiny_text_dir), "--out", str(tmp_path / "o")]) == 2
    assert "error: evaluate needs --config" in capsys.readouterr().err
    assert main(["--config", config, "--out", str(tmp_path / "o"), "eval.num_samples=0"]) == 2
    assert "eval.num_samples" in capsys.readouterr().err


def test_each_training_evaluation_writes_its_step_file(tmp_path, tiny_text_dir):
    """In a run, the evaluator files the records of every evaluation under logging.output_dir/eval/."""
    from opsd.config import load_config
    from opsd.evaluation import Evaluator
    from opsd.modeling import load_processor
    from tests.helpers.scripted_engine import AnswerEngine

    cfg = load_config(write_config(tmp_path, tiny_text_dir), ["train.max_steps=7"])
    processor = load_processor(cfg.model)
    evaluator = Evaluator(cfg, processor, multimodal=False)
    engine = AnswerEngine(cfg=cfg, model_path=None, processor=processor)
    assert evaluator.run_if_due(3, engine) == {} and not (tmp_path / "unused" / "eval").exists()
    for step in (0, 5, 7):
        assert evaluator.run_if_due(step, engine)["eval/teacher_accuracy"] == 1.0
    assert sorted(p.name for p in (tmp_path / "unused" / "eval").iterdir()) == ["step_0.jsonl", "step_5.jsonl", "step_7.jsonl"]
    assert eval_file(tmp_path, 5, rank=1).name == "step_5_rank_1.jsonl"
