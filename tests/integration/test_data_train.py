"""Short trainings on files in each schema, bad rows included: skips are counted in metrics.jsonl,
evaluation is logged, `on_bad_sample: error` and data/config mismatches stop with a clear message."""

import json
import math
from collections import Counter

import pytest
import yaml

from tests.helpers.datafiles import PROJECT_DEFECTS, TEXT_DEFECTS, THINKMORPH_DEFECTS, write_project, write_text_jsonl, write_thinkmorph
from opsd.config import load_config
from opsd.train import main, train


def read_metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def skipped(record, prefix="data/skipped_"):
    return Counter({k.removeprefix(prefix): v for k, v in record.items() if k.startswith(prefix)})


def run_config(tmp_path, model_dir, datasets, *overrides):
    """configs/smoke.yaml on the given datasets: 2 steps of 4 prompts, short completions, eval at the end."""
    data = yaml.safe_dump(datasets, default_flow_style=True, width=10_000).strip()
    return load_config("configs/smoke.yaml", [
        f"model.path={model_dir}", "data.path=null", "data.synthetic=null", f"data.datasets={data}",
        f"logging.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "train.max_steps=2",
        "rollout.max_new_tokens=12", "eval.max_new_tokens=8", "eval.num_samples=4", "rollout.engine=hf",
        *overrides,
    ])


def test_thinkmorph_parquet_with_bad_rows_trains(tmp_path, tiny_vlm_dir):
    data = tmp_path / "thinkmorph"
    data.mkdir()
    # 4 good rows + 6 bad ones: 8 draws of 2 steps cross every row; the eval split has its own bad rows.
    write_thinkmorph(data / "train.parquet", n_good=4)
    write_thinkmorph(data / "test.parquet", n_good=4, defects=THINKMORPH_DEFECTS[:2], seed=1)
    cfg = run_config(
        tmp_path, tiny_vlm_dir, [{"path": str(data), "schema": "thinkmorph", "eval_split": "test"}],
        "prompts.privileged=[images,text]", "data.reject_image_pixels=4000000", "eval.num_samples=10",
    )
    records = read_metrics(train(cfg))
    assert [r["step"] for r in records] == [0, 1, 2]  # 0: the baseline evaluation
    assert all(math.isfinite(r["loss"]) and r["logprob_mismatch_max"] < 1e-3 for r in records[1:])
    assert skipped(records[-1]) == Counter(reason for reason, _ in THINKMORPH_DEFECTS)
    assert records[-1]["data/images_converted_to_rgb"] >= 3
    assert {"eval/accuracy", "eval/teacher_accuracy"} <= records[-1].keys()
    assert records[-1]["eval/num_samples"] == 4  # every usable eval row, fewer than asked for
    assert skipped(records[-1], "data/eval_skipped_") == Counter(reason for reason, _ in THINKMORPH_DEFECTS[:2])


def test_text_jsonl_with_bad_rows_trains_a_text_model(tmp_path, tiny_text_dir, capsys):
    data = tmp_path / "text"
    data.mkdir()
    write_text_jsonl(data / "train.jsonl", n_good=4)
    write_text_jsonl(data / "eval.jsonl", n_good=4, defects=[], seed=1)
    cfg = run_config(
        tmp_path, tiny_text_dir, [{"path": str(data), "schema": "text", "eval_split": "eval"}],
        "prompts.privileged=[text]", "train.max_forward_tokens=512",
    )
    output_dir = train(cfg)
    records = read_metrics(output_dir)[1:]  # after the step-0 evaluation
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    # The over-long problem is caught by the tokenizer-aware check before any generation.
    assert skipped(records[-1]) == Counter(reason for reason, _ in TEXT_DEFECTS)
    # ... and the console and the summary say how many rows were skipped and why.
    reasons = ", ".join(f"{reason} 1" for reason in sorted(reason for reason, _ in TEXT_DEFECTS))
    out = capsys.readouterr().out
    assert f"data: bad rows skipped so far: 4 ({reasons})" in out
    assert f"  bad rows skipped: 4 ({reasons}) (data/skipped_* in metrics.jsonl)" in out
    assert json.loads((output_dir / "summary.json").read_text())["skipped_rows"] == dict(skipped(records[-1]))
    assert all(r["prompt_too_long"] == 0 for r in records)
    assert "eval/teacher_accuracy" in records[-1]


@pytest.mark.vllm
def test_mixture_of_image_and_text_datasets_trains_with_vllm(tmp_path, tiny_vlm_dir):
    """A VLM on a project-schema image set (with bad rows) mixed 1:1 with a text set: micro-batches
    mix prompts with and without images; evaluation with the teacher's prompt needs the engine to
    accept the privileged images too. Evaluation every step: logged at each of the steps."""
    write_project(tmp_path / "grid.parquet", n_good=6)
    (tmp_path / "text").mkdir()
    write_text_jsonl(tmp_path / "text" / "train.jsonl", n_good=6, defects=[])
    write_text_jsonl(tmp_path / "text" / "test.jsonl", n_good=2, defects=[], seed=1)
    datasets = [
        {"path": str(tmp_path / "grid.parquet"), "schema": "project", "name": "grid"},
        {"path": str(tmp_path / "text"), "schema": "text", "eval_split": "test", "name": "arith"},
    ]
    cfg = run_config(
        tmp_path, tiny_vlm_dir, datasets, "rollout.engine=vllm", "prompts.privileged=[images,text]",
        "eval.every=1", "train.max_steps=3",
    )
    records = read_metrics(train(cfg))
    assert all(r["logprob_mismatch_max"] < 1e-3 and math.isfinite(r["loss"]) for r in records[1:])
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all("eval/accuracy" in r and "eval/teacher_accuracy" in r for r in records)
    assert set(skipped(records[-1])) <= {reason for reason, _ in PROJECT_DEFECTS}


def test_on_bad_sample_error_stops_naming_dataset_file_and_row(tmp_path, tiny_vlm_dir, capsys):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=1, defects=THINKMORPH_DEFECTS[2:3])
    datasets = yaml.safe_dump([{"path": str(path), "schema": "thinkmorph", "name": "tm"}], default_flow_style=True).strip()
    args = [
        "--config", "configs/smoke.yaml", f"model.path={tiny_vlm_dir}", "data.path=null", "data.synthetic=null",
        f"data.datasets={datasets}", "data.on_bad_sample=error", "data.shuffle=false", "eval.every=0",
        f"logging.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "rollout.engine=hf", "train.max_steps=1",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"dataset tm[train], file {path}, row 1: empty question" in err


def test_missing_column_stops_at_start(tmp_path, tiny_vlm_dir, capsys):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=2, defects=[])
    datasets = yaml.safe_dump([{"path": str(path), "schema": "thinkmorph", "columns": {"answer": "solution"}}], default_flow_style=True).strip()
    args = [
        "--config", "configs/smoke.yaml", f"model.path={tiny_vlm_dir}", "data.path=null", "data.synthetic=null",
        f"data.datasets={datasets}", f"logging.output_dir={tmp_path / 'run'}", "rollout.engine=hf",
    ]
    assert main(args) == 2
    assert "data.datasets.0" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before the first step
