"""Short training runs of the demo config on the tiny models, and their metrics."""

import json

from opsd.config import load_config


def demo_config(tmp_path, tiny_vlm_dir, grid_data_dir, *overrides):
    return load_config("configs/demo.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
        "logging.progress_bar=false", "train.max_steps=3", "rollout.max_new_tokens=16", *overrides,
    ])


def read_metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
