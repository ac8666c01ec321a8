"""Training and evaluation samples for a run, from the configured data directory."""

from __future__ import annotations

from pathlib import Path

from opsd.config import DataConfig
from opsd.data.sample import Sample


def prepare_data_dir(cfg: DataConfig) -> Path:
    path = Path(cfg.path)
    if cfg.synthetic is not None and not (path / "train.parquet").exists():
        from opsd.data.synthetic import write_dataset

        s = cfg.synthetic
        write_dataset(path, n_train=s.n_train, n_eval=s.n_eval, seed=s.seed, image_size=s.image_size)
    if not (path / "train.parquet").exists():
        raise FileNotFoundError(f"data.path: no train.parquet in {path}")
    return path


def load_train_samples(cfg: DataConfig) -> list[Sample]:
    from opsd.data.synthetic import load_samples

    return load_samples(prepare_data_dir(cfg) / "train.parquet")
