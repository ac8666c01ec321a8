"""The run's datasets: open each configured split through `datasets`, serve its rows as samples.

    stream = train_stream(cfg, check=...)                          # mixture of training splits
    samples, skipped = split_samples(cfg, 8, split="eval")         # the first usable rows

Files are read with `datasets.load_dataset` one at a time (parquet, json lines, arrow, csv), so a
bad row can be named by file and row; a directory written by `save_to_disk` is read with
`load_from_disk`; a hub dataset name is read from the local cache only (offline). Rows stay in
Arrow until drawn: images are decoded (and checked) one sample at a time.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import itertools
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from opsd.config import SCHEMA_OF_SYNTHETIC, Config, DataConfig, DatasetConfig, SyntheticDataConfig
from opsd.data.errors import BadSample, BadSampleError, DataConfigError
from opsd.data.sample import Sample
from opsd.data.schemas import ColumnPlan, plan_columns
from opsd.data.stream import SampleStream, bad_sample_error, checked_sample
from opsd.data.validation import SampleRules, build_sample

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}


@dataclass
class RowSource:
    """One split of one dataset: row i -> a validated `Sample` (the stream's `Source`)."""

    name: str
    table: object  # datasets.Dataset in Arrow format: rows come back with images still encoded
    plan: ColumnPlan
    rules: SampleRules
    files: list[tuple[str, int]]
    """(file, number of rows) in row order; a hub or `save_to_disk` dataset is one labelled entry."""
    stats: Counter

    def __post_init__(self):
        self._ends = list(itertools.accumulate(rows for _, rows in self.files))

    def __len__(self) -> int:
        return len(self.table)

    def _locate(self, index: int) -> tuple[str, int]:
        k = bisect.bisect_right(self._ends, index)
        return self.files[k][0], index - (self._ends[k - 1] if k else 0)

    def where(self, index: int) -> str:
        file, row = self._locate(index)
        return f"file {file}, row {row}"

    def sample(self, index: int) -> Sample:
        row = self.table[index].to_pylist()[0]
        file = Path(self._locate(index)[0])
        return build_sample(
            row, self.plan, self.rules, default_id=f"{self.name}:{index}",
            base_dir=file.parent if file.is_file() else None,  # relative image paths
            stats=self.stats,
        )


def dataset_configs(cfg: DataConfig) -> list[tuple[str, DatasetConfig]]:
    """(config key, dataset) pairs; `data.path` is shorthand for one dataset."""
    if cfg.path is None:
        return [(f"data.datasets.{i}", d) for i, d in enumerate(cfg.datasets)]
    schema = SCHEMA_OF_SYNTHETIC[cfg.synthetic.kind] if cfg.synthetic else "project"
    return [("data.path", DatasetConfig(path=cfg.path, schema=schema, eval_split="eval", synthetic=cfg.synthetic))]


def describe_data(cfg: DataConfig) -> str:
    """One line for the run plan: each dataset with its schema, splits and mixture share."""
    pairs = dataset_configs(cfg)
    total = sum(d.weight for _, d in pairs)
    return ", ".join(
        f"{d.name or d.path} ({d.schema} schema, split {d.split}, eval split {d.eval_split}, {d.weight / total:.0%})"
        for _, d in pairs
    )


def prepare(dataset: DatasetConfig) -> None:
    """Generate the synthetic dataset into `path` when asked and not there yet."""
    path, s = Path(dataset.path), dataset.synthetic
    if s is None or (path.is_dir() and any(path.iterdir())):
        return
    # Written beside `path`, then renamed into place: a run started at the same time (two runs of a
    # benchmark) finds the whole dataset or none of it, never a split half written.
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        _write_synthetic(s, staging)
        with contextlib.suppress(OSError):  # another run got there first: keep its copy
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_synthetic(s: SyntheticDataConfig, path: Path) -> None:
    if s.kind == "grid-paths":
        from opsd.data.synthetic import write_dataset

        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed, image_size=s.image_size)
    elif s.kind == "facts":
        from opsd.data.facts import write_dataset

        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed, n_facts=s.n_facts,
                      n_validation=s.n_validation)
    elif s.kind == "digits":
        from opsd.data.digits import write_dataset

        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed, image_size=s.image_size,
                      n_validation=s.n_validation)
    elif s.kind == "picture-facts":
        from opsd.data.picture_facts import write_dataset

        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed, n_facts=s.n_facts, image_size=s.image_size,
                      n_validation=s.n_validation)
    else:
        from opsd.data.arithmetic import write_dataset

        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed)


def _pick_split(requested: str, available: list[str], where: str) -> str:
    """`requested`, or the split `datasets` files its name under (`eval` -> `test`, `val` -> `validation`)."""
    from datasets.data_files import SPLIT_KEYWORDS

    if requested in available:
        return requested
    for split, keywords in SPLIT_KEYWORDS.items():
        if requested in keywords and str(split) in available:
            return str(split)
    raise DataConfigError(f"{where}: no split {requested!r}; the splits are: {', '.join(available)}")


@contextlib.contextmanager
def _quiet_and_offline():
    """No progress bars, and no network: hub names resolve from the local cache or fail.

    `datasets` reads HF_HUB_OFFLINE once, at import; flipping its config flag is the only way to
    go offline for a process that imported it already.
    """
    import datasets

    bars_were_off, was_offline = datasets.are_progress_bars_disabled(), datasets.config.HF_HUB_OFFLINE
    datasets.disable_progress_bars()
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline
        if not bars_were_off:
            datasets.enable_progress_bars()


def _split_files(path: Path, split: str, where: str) -> list[str]:
    if path.is_file():
        _pick_split(split, ["train"], f"{where} ({path} is one file, its split is train)")
        return [str(path)]
    if path.is_dir():
        from datasets.data_files import DataFilesDict, get_data_patterns

        try:
            found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
        except Exception as err:  # EmptyDatasetError, FileNotFoundError
            raise DataConfigError(f"{where}: no data files in {path} ({err})") from None
        # `datasets` scans the folder recursively and matches split names anywhere in a file's name:
        # images beside the data (`vis/img/train_0.png`) are no split's rows.
        data_files = {str(s): [f for f in fs if is_data_file(f)] for s, fs in found.items()}
        data_files = {s: fs for s, fs in data_files.items() if fs}
        if not data_files:
            others = sorted(Path(f).name for fs in found.values() for f in fs)
            raise DataConfigError(f"{where}: no data files ({', '.join(BUILDERS)}) in {path}, only "
                                  f"{', '.join(others[:3])}{' ...' if len(others) > 3 else ''}")
        return data_files[_pick_split(split, list(data_files), where)]
    files = sorted(glob.glob(str(path), recursive=True))
    if not files:
        raise DataConfigError(f"{where}: no file matches {path}")
    _pick_split(split, ["train"], f"{where} ({path} is a glob, its split is train)")
    return files


def is_data_file(file: str) -> bool:
    """A file whose rows a dataset folder holds (by suffix, `BUILDERS`): not an image beside them."""
    return Path(file).suffix.lower() in BUILDERS


def _load_file(file: str, where: str):
    from datasets import load_dataset

    builder = BUILDERS.get(Path(file).suffix.lower())
    if builder is None:
        raise DataConfigError(f"{where}: {file}: unsupported file type (supported: {', '.join(BUILDERS)})")
    try:
        return load_dataset(builder, data_files=[file], split="train")
    except Exception as err:  # DatasetGenerationError and friends: the file itself is unreadable
        cause = err.__cause__ or err
        raise DataConfigError(f"{where}: cannot read {file}: {type(cause).__name__}: {cause}") from None


def _load_table(dataset: DatasetConfig, split: str, where: str):
    """(datasets.Dataset, [(file, rows)]) for one split."""
    import datasets

    path = Path(dataset.path).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[_pick_split(split, list(loaded), where)]
        return loaded, [(f"{path} (split {split})", len(loaded))]
    is_hub_name = not path.exists() and not glob.has_magic(dataset.path) and dataset.path.count("/") <= 1
    if is_hub_name and not dataset.path.startswith((".", "/", "~")):
        try:
            table = datasets.load_dataset(dataset.path, split=split)
        except Exception as err:
            raise DataConfigError(
                f"{where}: {dataset.path!r} is not a local file or directory, and not a dataset in the local "
                f"Hugging Face cache (runs are offline: fetch it beforehand with "
                f"datasets.load_dataset({dataset.path!r}) where there is network, or point path at local files): {err}"
            ) from None
        return table, [(f"hub dataset {dataset.path} (split {split})", len(table))]
    if not path.exists() and not glob.has_magic(dataset.path):
        raise DataConfigError(f"{where}: no such file or directory: {path}")
    parts = [(file, _load_file(file, where)) for file in _split_files(path, split, where)]
    try:
        table = datasets.concatenate_datasets([t for _, t in parts]) if len(parts) > 1 else parts[0][1]
    except ValueError as err:
        raise DataConfigError(f"{where}: the files of split {split} have different columns: {err}") from None
    return table, [(file, len(t)) for file, t in parts]


def open_source(cfg: Config, key: str, dataset: DatasetConfig, split: str, stats: Counter) -> RowSource:
    """One split of `dataset` as a `RowSource`; every config/data mismatch is raised here, at start."""
    name = dataset.name or dataset.path
    where = f"{key} ({name})"
    prepare(dataset)
    with _quiet_and_offline():
        table, files = _load_table(dataset, split, where)
    return _row_source(cfg, dataset, split, where, table, files, stats)


def _row_source(cfg: Config, dataset: DatasetConfig, split: str, where: str, table, files, stats: Counter) -> RowSource:
    """The columns of `table` checked against the dataset's schema and mapping, as a `RowSource`."""
    plan = plan_columns(
        dataset.schema, list(table.column_names), overrides=dict(dataset.columns),
        max_reference_rounds=cfg.data.max_reference_rounds, privileged=list(cfg.prompts.privileged), where=where,
    )
    if len(table) == 0:
        raise DataConfigError(f"{where}: split {split} has no rows")
    table = table.select_columns(plan.all_columns()).with_format("arrow")
    rules = SampleRules.from_config(cfg.data, plan)
    return RowSource(name=f"{dataset.name or dataset.path}[{split}]", table=table, plan=plan, rules=rules, files=files,
                     stats=stats)


PEEK_ROWS = 8
"""Rows `peek_source` reads of a split's first file."""


def _peek_file(file: str, where: str):
    """The first `PEEK_ROWS` rows of one data file as a `datasets.Dataset`, without reading the rest."""
    import json

    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    suffix = Path(file).suffix.lower()
    if suffix not in BUILDERS:
        raise DataConfigError(f"{where}: {file}: unsupported file type (supported: {', '.join(BUILDERS)})")
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(file).iter_batches(batch_size=PEEK_ROWS), None)
            table = pa.Table.from_batches([batch]) if batch is not None else pq.read_schema(file).empty_table()
        elif suffix == ".csv":
            import pyarrow.csv

            reader = pyarrow.csv.open_csv(file)
            table = pa.Table.from_batches([reader.read_next_batch()]).slice(0, PEEK_ROWS)
        elif suffix == ".arrow":
            mapped = datasets.Dataset.from_file(file)  # memory-mapped
            return mapped.select(range(min(PEEK_ROWS, len(mapped))))
        else:  # json lines; a .json file that is one JSON document is read whole
            with open(file, encoding="utf-8") as f:
                lines = [line for line in itertools.islice(f, PEEK_ROWS * 4) if line.strip()][:PEEK_ROWS]
            try:
                table = pa.Table.from_pylist([json.loads(line) for line in lines])
            except ValueError:
                whole = _load_file(file, where)
                return whole.select(range(min(PEEK_ROWS, len(whole))))
    except DataConfigError:
        raise
    except Exception as err:  # a file that is not what its suffix says
        raise DataConfigError(f"{where}: cannot read {file}: {type(err).__name__}: {err}") from None
    return datasets.Dataset(InMemoryTable(table))


def peek_source(cfg: Config, key: str, dataset: DatasetConfig, split: str) -> RowSource | str:
    """`open_source` on the first rows of the split's first file (a hub or `save_to_disk` dataset:
    memory-mapped, as it is read anyway), for `--dry-run`: the files, the split and the columns are
    checked in seconds, whatever the dataset's size; the rows themselves are not. A dataset that is
    not here (a synthetic one the first run generates, a path or hub name absent on this machine:
    a plan made away from the data) is a line saying so; one that is here and does not fit raises."""
    name = dataset.name or dataset.path
    where = f"{key} ({name})"
    path = Path(dataset.path).expanduser()
    if dataset.synthetic is not None and not (path.is_dir() and any(path.iterdir())):
        return "synthetic, generated at the first run"
    if not path.exists() and (not glob.has_magic(dataset.path) or not glob.glob(str(path), recursive=True)):
        with _quiet_and_offline():
            try:
                table, files = _load_table(dataset, split, where)  # a hub name in the local cache
            except DataConfigError:
                return "WARNING: not found on this machine (no such path, nor a dataset in the local cache): not checked"
        table = table.select(range(min(PEEK_ROWS, len(table))))
    elif path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        table, files = _load_table(dataset, split, where)  # save_to_disk: memory-mapped
        table = table.select(range(min(PEEK_ROWS, len(table))))
    else:
        with _quiet_and_offline():
            found = _split_files(path, split, where)
            for file in found[1:]:
                if not is_data_file(file):
                    raise DataConfigError(f"{where}: {file}: unsupported file type (supported: {', '.join(BUILDERS)})")
            table = _peek_file(found[0], where)
            files = [(found[0], len(table))]
    return _row_source(cfg, dataset, split, where, table, files, Counter())


def peek_data(cfg: Config, *, with_eval: bool) -> tuple[list[str], Sample | BadSample | None]:
    """What `--dry-run` says of the data: a line per split checked, and the first training row as a
    sample (a `BadSample` when it is not one; None when no dataset exists yet). A dataset that does
    not fit the config raises `DataConfigError`, as the run would at start."""
    lines, first = [], None
    for key, dataset in dataset_configs(cfg.data):
        splits = [dataset.split] + ([dataset.eval_split] if with_eval and dataset.eval_split else [])
        for split in splits:
            source = peek_source(cfg, key, dataset, split)
            if isinstance(source, str):
                lines.append(f"{key} ({dataset.name or dataset.path}): {source}")
                break
            shown = ", ".join(file for file, _ in source.files)
            lines.append(f"{key} ({source.name}): columns fit the {dataset.schema} schema (first rows of {shown})")
            if first is None:
                try:
                    first = source.sample(0)
                except BadSample as bad:
                    first = bad
    return lines, first


def check_fits_model(sources: list[RowSource], multimodal: bool, *, sharded: bool = False) -> None:
    """A text-only model cannot take images, and a sharded (FSDP) vision-language model cannot take
    rows without images: refuse at start rather than at the first prompt, or in a hang."""
    if multimodal:
        for source in sources:
            if sharded and not source.plan.columns["images"]:
                # A rank whose batch has no image skips the vision tower, whose FSDP all-gathers the
                # other ranks then wait for forever.
                raise DataConfigError(
                    f"dataset {source.name} has no problem-image column, so its rows are text-only; under "
                    "torchrun (FSDP) a vision-language model needs an image in every training row (every rank "
                    "must run the vision tower). Train this mixture in a single process, or without that dataset"
                )
        return
    for source in sources:
        image_columns = source.plan.columns["images"] + source.plan.columns["privileged_images"]
        if image_columns:
            raise DataConfigError(
                f"dataset {source.name} has image columns ({', '.join(image_columns)}) but the model is "
                "text-only; use a vision-language model, or turn them off with columns.images: [] "
                "(and prompts.privileged without images)"
            )


def train_stream(cfg: Config, *, check=None, multimodal: bool = True, sharded: bool = False) -> SampleStream:
    """The training mixture (`take(n, rank=, world_size=)` gives a data-parallel rank its share);
    `sharded`: trained under FSDP (see `check_fits_model`)."""
    stats = Counter()
    pairs = dataset_configs(cfg.data)
    sources = [open_source(cfg, key, d, d.split, stats) for key, d in pairs]
    check_fits_model(sources, multimodal, sharded=sharded)
    return SampleStream(
        sources, weights=[d.weight for _, d in pairs], seed=cfg.train.seed, shuffle=cfg.data.shuffle,
        on_bad_sample=cfg.data.on_bad_sample, check=check, stats=stats,
    )


def split_samples(
    cfg: Config, n: int, *, split: str = "eval", check=None, multimodal: bool = True
) -> tuple[list[Sample], Counter]:
    """The first `n` usable rows of each dataset's training (`split="train"`) or eval split, taken
    in turn from each dataset in file order (the same set every time), and the skip counts.

    The evaluation set is `split_samples(cfg, cfg.eval.num_samples)`.
    """
    stats = Counter()
    pairs = [(key, d, d.split if split == "train" else d.eval_split) for key, d in dataset_configs(cfg.data)]
    pairs = [p for p in pairs if p[2]]
    if not pairs:
        raise DataConfigError("evaluation needs a dataset with an eval_split (data.datasets.N.eval_split)")
    sources = [open_source(cfg, key, d, name, stats) for key, d, name in pairs]
    check_fits_model(sources, multimodal)
    samples, cursors = [], [0] * len(sources)
    while len(samples) < n and any(c < len(s) for c, s in zip(cursors, sources)):
        for k, source in enumerate(sources):
            if cursors[k] >= len(source) or len(samples) == n:
                continue
            index, cursors[k] = cursors[k], cursors[k] + 1
            try:
                samples.append(checked_sample(source, index, check))
            except BadSample as bad:
                if cfg.data.on_bad_sample == "error":
                    raise bad_sample_error(source, index, bad) from None
                stats[f"skipped_{bad.reason}"] += 1
    if not samples:
        raise BadSampleError(f"no usable sample in the {split} splits; skipped: {dict(stats)}")
    return samples, stats
