"""`python -m opsd.train` that also records, on every rank, what the weight sync pushed into its engine.

Run as `python tests/helpers/recording_train.py --config ...` or under `torchrun`. After every sync, rank R
writes `<output_dir>/pushed_rank{R}.safetensors` (the full tensors it pushed) and
`<output_dir>/engine_rank{R}.json` (the engine's own parameter digests, when it has them); the last
step's files remain. A LoRA run with adapter sync records the adapter's tensors (PEFT file keys). Used by tests/integration/test_distributed_train.py.

`OPSD_TEST_SIGNAL=<stage>@<step>[:parent]` sends a SIGTERM at that point (tests/helpers/signals.py).
Each rank writes its exit status to `<output_dir>/exit_rank{R}` and its pid to `<output_dir>/pid_rank{R}`.
"""

import json
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

import opsd.train
from opsd.config import load_config
from tests.helpers import signals
from opsd.rollout.weight_sync import sync_student


class Recorder:
    """Forwards a weight-sync session to the engine and keeps a copy of every tensor."""

    def __init__(self, engine):
        self.engine, self.tensors = engine, {}
        self.capabilities = engine.capabilities  # the engine's weight dtype, adapters, ... kept

    def begin_weight_update(self):
        self.engine.begin_weight_update()

    def receive_weights(self, bucket):
        self.tensors.update((name, t.detach().clone()) for name, t in bucket)
        self.engine.receive_weights(bucket)

    def end_weight_update(self):
        self.engine.end_weight_update()

    def receive_adapter(self, update):  # LoRA, rollout.lora_sync=adapter
        self.tensors.update((name, t.detach().clone()) for name, t in update.tensors.items())
        self.engine.receive_adapter(update)


def main(argv):
    config_at = argv.index("--config")
    cfg = load_config(argv[config_at + 1], argv[:config_at] + argv[config_at + 2 :])
    out, rank = Path(cfg.logging.output_dir), int(os.environ.get("RANK", "0"))

    def recording_sync(model, engine, **kwargs):
        recorder = Recorder(engine)
        stats = sync_student(model, recorder, **kwargs)
        save_file(recorder.tensors, out / f"pushed_rank{rank}.safetensors")
        if hasattr(engine, "weight_checksums"):
            (out / f"engine_rank{rank}.json").write_text(json.dumps(engine.weight_checksums()))
        return stats

    opsd.train.sync_student = recording_sync
    if patch := signals.from_env(os.environ.get("OPSD_TEST_SIGNAL")):
        setattr(opsd.train, *patch)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid_rank{rank}").write_text(str(os.getpid()))
    status = opsd.train.main(argv)
    (out / f"exit_rank{rank}").write_text(str(status))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
