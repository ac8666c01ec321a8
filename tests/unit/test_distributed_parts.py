"""The pieces of multi-rank training that need no process group: config checks, data split, FSDP units."""

import pytest
import torch

from opsd.config import ConfigError, DistributedConfig, load_config
from opsd.data.stream import SampleStream
from opsd.data.synthetic import generate_samples
from opsd.rollout.colocate import engine_kwargs
from opsd.trainer.distributed import Ranks, build_mesh
from opsd.trainer.fsdp import transformer_blocks
from tests.helpers.samples import SampleList


def test_bf16_fsdp_parameters_need_bf16_autocast():
    with pytest.raises(ConfigError, match="distributed.param_dtype=bfloat16 needs model.dtype=bfloat16"):
        load_config("configs/smoke.yaml", ["distributed.param_dtype=bfloat16"])
    cfg = load_config("configs/smoke.yaml", ["distributed.param_dtype=bfloat16", "model.dtype=bfloat16"])
    assert cfg.distributed.param_dtype == "bfloat16" and cfg.distributed.reduce_dtype == "float32"


def test_shard_size_must_divide_the_ranks():
    with pytest.raises(ValueError, match=r"distributed.shard_size \(3\) must divide the number of ranks \(8\)"):
        build_mesh(DistributedConfig(shard_size=3), torch.device("cpu"), 8)


def test_engine_arguments_follow_the_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert engine_kwargs(tensor_parallel_size=1) == {}
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size > 1 needs torchrun"):
        engine_kwargs(tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert engine_kwargs(tensor_parallel_size=2) == {
        "distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2,
    }
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size \(3\) must divide the number of ranks \(4\)"):
        engine_kwargs(tensor_parallel_size=3)


def test_ranks_take_distinct_blocks_of_the_global_batch():
    samples = generate_samples(10, seed=0, image_size=56)
    single = SampleStream([SampleList(samples)], seed=3)
    per_rank = [SampleStream([SampleList(samples)], seed=3) for _ in range(3)]
    for _ in range(4):  # crosses epoch boundaries: 4 steps x 3 ranks x 2 prompts > 10 samples
        expected = [s.id for s in single.take(6)]
        got = [s.id for rank, stream in enumerate(per_rank) for s in stream.take(2, rank=rank, world_size=3)]
        assert got == expected
    assert all(s.state_dict() == single.state_dict() for s in per_rank)


def test_single_process_collectives_return_their_input():
    ranks = Ranks()
    assert not ranks.enabled and ranks.is_main
    assert ranks.sum([1.0, 2.0]) == [1.0, 2.0] and ranks.max([3.0]) == [3.0] and ranks.gather(4.0) == [4.0]


def test_fsdp_units_are_the_vision_and_decoder_blocks(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    names = [type(b).__name__ for b in transformer_blocks(model)]
    assert names == ["Idefics3EncoderLayer"] * 2 + ["LlamaDecoderLayer"] * 2
