"""A single-process checkpoint loads into 2 FSDP2 ranks, and their save loads back into one process.

The test starts `torchrun --nproc-per-node 2` on this very file (CPU, gloo); the ranks shard the
tiny text model with `fully_shard`, restore a checkpoint written by one plain process, check the
gathered weights, and write a checkpoint of their own with `save_checkpoint`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opsd.trainer.checkpoint import load_checkpoint, read_manifest, save_checkpoint

REPO = Path(__file__).parents[2]


def shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A CPU mesh: without one, fully_shard meshes the default device, CUDA where there is a GPU (where a
    # second rank on a one-GPU machine asks for a device that is not there).
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(model_dir, checkpoint, out_dir):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.helpers.parts import make_parts

    dist.init_process_group("gloo")
    parts = make_parts(model_dir, wrap=shard)
    load_checkpoint(checkpoint, parts)
    full = get_model_state_dict(parts.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        saved = load_file(Path(checkpoint) / "model" / "model.safetensors")
        assert all(torch.equal(full[name], tensor) for name, tensor in saved.items())
    save_checkpoint(Path(out_dir), 5, parts, {"step": 5})
    # As the recipe's end_run does: no rank tears the group down while the other may still be inside the
    # save's last collective (CI once saw rank 1 abort in C++, "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_checkpoint_moves_between_one_and_two_ranks(tmp_path, tiny_text_dir):
    from tests.helpers.parts import assert_same_tensors, make_parts, take_steps

    parts = make_parts(tiny_text_dir)
    take_steps(parts, 2)
    single = save_checkpoint(tmp_path / "single", 2, parts, {"step": 2})

    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        __file__, str(tiny_text_dir), str(single), str(tmp_path / "sharded"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    # A rank's own error comes first; torchrun's summary (after a native crash, faulthandler's list of
    # extension modules) fills the end, which alone once hid why a rank aborted in a loaded full run.
    assert proc.returncode == 0, proc.stderr[:4000] + "\n[...]\n" + proc.stderr[-2000:]

    sharded = tmp_path / "sharded" / "checkpoint-5"
    assert read_manifest(sharded)["world_size"] == 2
    assert sorted(p.name for p in (sharded / "rng").iterdir()) == ["rank-0.pt", "rank-1.pt"]
    # Rank 0 gathered the sharded weights into the Hugging Face directory.
    assert_same_tensors(load_file(sharded / "model" / "model.safetensors"), load_file(single / "model" / "model.safetensors"))
    back = make_parts(tiny_text_dir)
    load_checkpoint(sharded, back)
    assert_same_tensors(back.student.state_dict(), parts.student.state_dict())
    assert_same_tensors(back.teacher.module.state_dict(), parts.teacher.module.state_dict())
    for index, state in parts.optimizer.state_dict()["state"].items():
        assert_same_tensors(state, back.optimizer.state_dict()["state"][index])
    assert back.scheduler.state_dict() == parts.scheduler.state_dict()


if __name__ == "__main__":
    worker(*sys.argv[1:])
