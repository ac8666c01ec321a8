"""Loading datasets through `datasets`: schemas, column mapping, bad rows, splits, hub cache, errors."""

import shutil
from collections import Counter

import datasets
import numpy as np
import pytest
from PIL import Image

from tests.helpers.datafiles import (
    PROJECT_DEFECTS, TEXT_DEFECTS, THINKMORPH_DEFECTS, huge_png, png, struct, thinkmorph_rows, write_parquet,
    write_project, write_text_jsonl, write_thinkmorph,
)
from opsd.config import ConfigError, config_from_dict
from opsd.data.arithmetic import make_problem
from opsd.data.dataset import split_samples, train_stream
from opsd.data.errors import BadSample, BadSampleError, DataConfigError
from opsd.data.images import ImageLimits, decode_image
from opsd.data.synthetic import load_samples


def make_cfg(*datasets_, privileged=("images",), **data):
    return config_from_dict({
        "model": {"path": "m"},
        "data": {"datasets": list(datasets_), **data},
        "prompts": {"privileged": list(privileged)},
        "eval": {"every": 1, "num_samples": 100},
    })


def eval_samples(cfg):
    return split_samples(cfg, cfg.eval.num_samples, split="eval")


def drain(stream, n_good):
    """All good samples of a one-epoch pass, and the skip counts."""
    samples = stream.take(n_good)
    return samples, Counter({k.removeprefix("data/skipped_"): v for k, v in stream.metrics().items() if "skipped" in k})


@pytest.mark.parametrize("spelling", ["resoning", "reasoning"])
def test_thinkmorph_rows_become_samples(tmp_path, spelling):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=4, defects=[], spelling=spelling)
    cfg = make_cfg({"path": str(path), "schema": "thinkmorph"}, privileged=["images", "text"], shuffle=False)
    samples = train_stream(cfg).take(4)
    reference = thinkmorph_rows(4, spelling=spelling)
    for sample, row in zip(samples, reference):
        assert sample.id == row["pid"] and sample.question == row["question"] and sample.answer == row["answer"]
        rounds = sum(k.startswith("reasoning_image_") for k in row)
        assert len(sample.images) == 1 and len(sample.privileged_images) == rounds
        assert all(im.mode == "RGB" for im in sample.images + sample.privileged_images)
        # Every round's thought, the one after the last image included, in order.
        assert sample.privileged_text.splitlines() == [row[f"{spelling}_thought_{r}"] for r in range(rounds + 1)]


def test_max_reference_rounds_caps_images_and_thoughts(tmp_path):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=6, defects=[])
    cfg = make_cfg({"path": str(path), "schema": "thinkmorph"}, privileged=["images", "text"], max_reference_rounds=1)
    for sample in train_stream(cfg).take(6):
        assert len(sample.privileged_images) == 1
        assert sample.privileged_text == "Round 0: follow the path." or sample.privileged_text.startswith("So the answer")


@pytest.mark.parametrize(
    "writer, schema, defects, n_good",
    [
        (write_thinkmorph, "thinkmorph", THINKMORPH_DEFECTS, 8),
        (write_project, "project", PROJECT_DEFECTS, 8),
    ],
    ids=["thinkmorph", "project"],
)
def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path, writer, schema, defects, n_good):
    path = writer(tmp_path / "data.parquet", n_good=n_good)
    cfg = make_cfg({"path": str(path), "schema": schema}, reject_image_pixels=4_000_000)
    stream = train_stream(cfg)
    samples, skipped = drain(stream, n_good)
    assert len({s.id for s in samples}) == n_good  # every good row, once, in one epoch
    assert skipped == Counter(reason for reason, _ in defects)
    assert all(im.mode == "RGB" for s in samples for im in s.images + s.privileged_images)
    if schema == "thinkmorph":
        assert stream.metrics()["data/images_converted_to_rgb"] >= 3  # the CMYK, L and RGBA rows


def test_text_schema_rows_and_bad_rows(tmp_path):
    def short_prompts_only(sample):  # stands in for the trainer's token-length check
        if len(sample.question) > 2000:
            raise BadSample("prompt_too_long")

    path = write_text_jsonl(tmp_path / "train.jsonl")
    cfg = make_cfg({"path": str(path), "schema": "text"}, privileged=["text"])
    samples, skipped = drain(train_stream(cfg, check=short_prompts_only), 8)
    assert skipped == Counter(reason for reason, _ in TEXT_DEFECTS)
    assert all(s.images == [] and s.privileged_images == [] and "The answer is" in s.privileged_text for s in samples)
    numeric = [s for s in samples if s.id == "arith-s0-00000"]  # its answer is a JSON number
    assert len(numeric) == 1 and numeric[0].answer == make_problem(0, 0)["answer"]


def test_on_bad_sample_error_names_dataset_file_and_row(tmp_path):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=3, defects=THINKMORPH_DEFECTS[:1])
    cfg = make_cfg({"path": str(path), "schema": "thinkmorph", "name": "tm-set"}, on_bad_sample="error", shuffle=False)
    stream = train_stream(cfg)
    stream.take(3)
    with pytest.raises(BadSampleError) as err:
        stream.take(1)
    message = str(err.value)
    assert "tm-set" in message and str(path) in message and "row 3" in message and "corrupt image" in message


def test_error_names_the_file_and_row_within_a_multi_file_split(tmp_path):
    write_text_jsonl(tmp_path / "train-00000.jsonl", n_good=4, defects=[])
    write_text_jsonl(tmp_path / "train-00001.jsonl", n_good=2, defects=TEXT_DEFECTS[:1], seed=1)
    cfg = make_cfg({"path": str(tmp_path), "schema": "text"}, privileged=["text"], on_bad_sample="error", shuffle=False)
    stream = train_stream(cfg)
    stream.take(6)
    with pytest.raises(BadSampleError, match=r"train-00001\.jsonl, row 2: empty question"):
        stream.take(1)


def test_column_mapping_renames_user_columns(tmp_path):
    rows = [
        {"uid": f"u{i}", "prompt": f"What is {i} + 1?", "final": str(i + 1), "worked": f"{i} + 1 = {i + 1}."}
        for i in range(5)
    ]
    write_parquet(rows, tmp_path / "mine.parquet")
    columns = {"id": "uid", "question": "prompt", "answer": "final", "privileged_text": ["worked"]}
    cfg = make_cfg({"path": str(tmp_path / "mine.parquet"), "schema": "text", "columns": columns}, privileged=["text"], shuffle=False)
    sample = train_stream(cfg).take(1)[0]
    assert (sample.id, sample.question, sample.answer, sample.privileged_text) == ("u0", "What is 0 + 1?", "1", "0 + 1 = 1.")


@pytest.mark.parametrize(
    "dataset, privileged, named",
    [
        ({"schema": "thinkmorph", "columns": {"question": "prompt"}}, ["images"], "'prompt'"),
        ({"schema": "text"}, ["text"], "'problem'"),
        ({"schema": "thinkmorph"}, ["text"], "no column 'resoning_thought_0' for field privileged_text"),
        ({"schema": "project"}, ["images"], "'images'"),
    ],
)
def test_missing_column_is_a_config_error_naming_it(tmp_path, dataset, privileged, named):
    rows = thinkmorph_rows(2)
    for row in rows:
        for key in [k for k in row if "thought" in k]:
            del row[key]
    write_parquet(rows, tmp_path / "tm.parquet")
    cfg = make_cfg({"path": str(tmp_path / "tm.parquet"), **dataset}, privileged=privileged)
    with pytest.raises(DataConfigError, match=named) as err:
        train_stream(cfg)
    assert "data.datasets.0" in str(err.value) and "columns are: answer, pid, problem_image_0" in str(err.value)


def test_dataset_offering_none_of_the_privileged_channels_is_refused(tmp_path):
    path = write_text_jsonl(tmp_path / "train.jsonl", n_good=2, defects=[])
    with pytest.raises(DataConfigError, match="provides none of prompts.privileged"):
        train_stream(make_cfg({"path": str(path), "schema": "text"}, privileged=["images"]))
    # In a mixture, a dataset serves the channels it has: text rows with [images, text].
    assert train_stream(make_cfg({"path": str(path), "schema": "text"}, privileged=["images", "text"])).take(2)


def test_unknown_schema_and_unknown_field_are_config_errors():
    with pytest.raises(ConfigError, match=r"data\.datasets\.0\.schema"):
        make_cfg({"path": "x", "schema": "llava"})
    with pytest.raises(ConfigError, match=r"data\.datasets\.0\.columns\.prompt"):
        make_cfg({"path": "x", "columns": {"prompt": "q"}})
    with pytest.raises(ConfigError, match="either data.path"):
        config_from_dict({"model": {"path": "m"}, "data": {}})


def test_text_only_model_refuses_image_datasets(tmp_path):
    path = write_thinkmorph(tmp_path / "tm.parquet", n_good=2, defects=[])
    cfg = make_cfg({"path": str(path), "schema": "thinkmorph"})
    with pytest.raises(DataConfigError, match="text-only"):
        train_stream(cfg, multimodal=False)


def test_directory_splits_and_eval_alias(tmp_path, grid_data_dir):
    """train.parquet / eval.parquet in a directory: `eval` names the split datasets calls `test`."""
    cfg = make_cfg({"path": str(grid_data_dir), "eval_split": "eval"})
    samples, skipped = eval_samples(cfg)
    assert len(samples) == 8 and not skipped
    train_ids = {s.id for s in train_stream(cfg).take(24)}
    assert len(train_ids) == 24 and train_ids.isdisjoint(s.id for s in samples)
    with pytest.raises(DataConfigError, match="no split 'validation'; the splits are: train, test"):
        eval_samples(make_cfg({"path": str(grid_data_dir), "eval_split": "validation"}))


def test_first_rows_of_the_training_splits_in_turn(tmp_path, grid_data_dir):
    text = write_text_jsonl(tmp_path / "train.jsonl", n_good=3, defects=TEXT_DEFECTS[:1])
    cfg = make_cfg({"path": str(grid_data_dir)}, {"path": str(text), "schema": "text"}, privileged=["images", "text"])
    samples, skipped = split_samples(cfg, 6, split="train")
    grid = [s.id for s in load_samples(grid_data_dir / "train.parquet")[:3]]
    assert [s.id for s in samples] == [grid[0], "arith-s0-00000", grid[1], "arith-s0-00001", grid[2], "arith-s0-00002"]
    assert not skipped  # the bad text row comes after the three used


def test_data_path_shorthand_evaluates_eval_parquet(grid_data_dir):
    cfg = config_from_dict({"model": {"path": "m"}, "data": {"path": str(grid_data_dir)}, "eval": {"every": 5, "num_samples": 3}})
    samples, _ = eval_samples(cfg)
    assert [s.id for s in samples] == [s.id for s in load_samples(grid_data_dir / "eval.parquet")[:3]]


def test_arrow_files_and_save_to_disk_directories(tmp_path, grid_data_dir):
    table = datasets.load_dataset("parquet", data_files=str(grid_data_dir / "train.parquet"), split="train")
    table.save_to_disk(str(tmp_path / "saved"))
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "saved", arrow_file):
        stream = train_stream(make_cfg({"path": str(path)}, shuffle=False))
        assert stream.take(1)[0].id == "grid-s0-00000"


def test_hub_name_loads_from_the_local_cache_offline(tmp_path, grid_data_dir, monkeypatch):
    """A dataset fetched earlier with `load_dataset(name)` sits in HF_DATASETS_CACHE as
    `<owner>___<name>/<config>/<version>/<hash>`; build that layout without a network."""
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    files = DataFilesDict.from_patterns({"train": ["train.parquet"], "test": ["eval.parquet"]}, base_path=str(grid_data_dir))
    builder = Parquet(data_files=files, dataset_name="grid", hash="0123abcd", cache_dir=str(tmp_path / "build"))
    builder.download_and_prepare()
    target = cache / "opsd-test___grid" / "default" / "0.0.0" / "0123abcd"
    target.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, target)

    cfg = make_cfg({"path": "opsd-test/grid", "eval_split": "test"}, shuffle=False)
    assert train_stream(cfg).take(1)[0].id == "grid-s0-00000"
    assert len(eval_samples(cfg)[0]) == 8
    with pytest.raises(DataConfigError, match="not a dataset in the local Hugging Face cache"):
        train_stream(make_cfg({"path": "opsd-test/never-downloaded"}))


def test_decode_image_limits_and_modes():
    limits = ImageLimits(max_pixels=100 * 100, reject_pixels=2000 * 2000)
    stats = Counter()
    big = decode_image(struct(png(Image.new("RGB", (400, 100)))), limits=limits, stats=stats)
    assert big.size == (200, 50) and stats["images_downscaled"] == 1  # aspect ratio kept
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # fully transparent black
    assert np.asarray(decode_image(png(rgba), limits=limits)).min() == 255  # white, not black
    with pytest.raises(BadSample, match="image too large"):
        decode_image(huge_png(2500), limits=limits)
    with pytest.raises(BadSample, match="corrupt image"):
        noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
        decode_image(png(noise)[:4000], limits=limits)  # a valid header, truncated pixel data
    with pytest.raises(BadSample, match="missing image"):
        decode_image({"bytes": None, "path": "nowhere.png"}, limits=limits)


def test_relative_image_paths_resolve_next_to_the_data_file(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (32, 32), (0, 0, 255)).save(tmp_path / "img" / "a.png")
    rows = [{"question": "What colour?", "answer": "blue", "images": ["img/a.png"], "privileged_images": ["img/a.png"]}]
    write_parquet(rows, tmp_path / "paths.parquet")
    sample = train_stream(make_cfg({"path": str(tmp_path / "paths.parquet")})).take(1)[0]
    assert sample.images[0].getpixel((0, 0)) == (0, 0, 255)


def test_a_dataset_folder_with_images_in_a_subfolder_reads_only_its_data_files(tmp_path):
    """`datasets` scans a folder recursively and files `vis/img/train_0_h.png` under train: opsd reads
    the data files only, and the row's relative image path resolves next to its file."""
    (tmp_path / "vis" / "img").mkdir(parents=True)
    Image.new("RGB", (32, 32), (0, 255, 0)).save(tmp_path / "vis" / "img" / "train_0_h.png")
    rows = [{"question": "What colour?", "answer": "green", "images": ["vis/img/train_0_h.png"],
             "privileged_images": ["vis/img/train_0_h.png"]}]
    write_parquet(rows, tmp_path / "train.parquet")
    sample = train_stream(make_cfg({"path": str(tmp_path)})).take(1)[0]
    assert sample.images[0].getpixel((0, 0)) == (0, 255, 0)
    (tmp_path / "train.parquet").unlink()
    with pytest.raises(DataConfigError, match=r"no data files \(.parquet.*\) in .*, only train_0_h.png"):
        train_stream(make_cfg({"path": str(tmp_path)}))
