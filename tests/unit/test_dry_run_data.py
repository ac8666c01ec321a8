"""`--dry-run` opens the data: files, splits and columns from the first rows, and the first sample's prompts."""

import json

from PIL import Image
from tests.helpers.datafiles import write_text_jsonl

from opsd.train import main

CONFIG = "configs/learn_facts_smollm2.yaml"  # a text recipe: one dataset, schema text, eval split eval


def text_dataset(tmp_path):
    data = tmp_path / "facts"
    data.mkdir()
    write_text_jsonl(data / "train.jsonl", n_good=3, defects=[])
    write_text_jsonl(data / "eval.jsonl", n_good=2, defects=[], seed=1)
    return data


def test_dry_run_shows_the_checked_splits_and_the_first_samples_prompts(tmp_path, capsys):
    data = text_dataset(tmp_path)
    assert main(["--config", CONFIG, "--dry-run", f"data.datasets.0.path={data}", "prompts.privileged_text_intro=Fact:"]) == 0
    out = capsys.readouterr().out
    first = json.loads((data / "train.jsonl").read_text().splitlines()[0])
    assert f"columns fit the text schema (first rows of {data / 'train.jsonl'})" in out
    assert f"(first rows of {data / 'eval.jsonl'})" in out
    assert "system:  You are a helpful assistant. Answer the question briefly." in out
    assert f"student: {first['problem'][:60]}" in out and "| Fact:\\n" in out  # the teacher's privileged part
    assert "answer pattern " in out


def test_dry_run_refuses_data_that_does_not_fit_with_one_line(tmp_path, capsys):
    """A text dataset declared `schema: project`, and a folder with only a PNG, stop the dry run (exit 2)
    as they would stop the run at start."""
    data = text_dataset(tmp_path)
    assert main(["--config", CONFIG, "--dry-run", f"data.datasets.0.path={data}", "data.datasets.0.schema=project",
                 "data.datasets.0.synthetic=null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.datasets.0") and "no column 'question'" in err and len(err.splitlines()) == 1
    pictures = tmp_path / "pictures"
    pictures.mkdir()
    Image.new("RGB", (8, 8)).save(pictures / "train_0.png")
    assert main(["--config", CONFIG, "--dry-run", f"data.datasets.0.path={pictures}", "data.datasets.0.synthetic=null"]) == 2
    assert "no data files (.parquet" in capsys.readouterr().err
