"""Under torchrun the weights are read once: rank 0 reads the safetensors files, every rank gets its shards.

Two gloo ranks load the tiny Qwen2.5-VL with `load_sharded`; rank 1's model directory has no weight
files at all (config, tokenizer and processor only), so any read there would fail. Both ranks must
end with exactly the weights of an ordinary `from_pretrained`, real rotary buffers (the mrope
positions of an image prompt score as in one process), and an EMA teacher copied shard by shard.
The weight sync's per-unit gather returns the same full tensors, in bfloat16 at half the bytes.
"""

import shutil

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from opsd.config import DistributedConfig, ModelConfig
from opsd.modeling import empty_model, load_model, load_processor
from opsd.prompts import Prompt
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt
from tests.helpers.spawn import run_two_ranks


def image_batch(processor):
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Count the cells."}]}],
        add_generation_prompt=True, tokenize=False,
    )
    prompt = Prompt(text, [Image.new("RGB", (112, 60), (0, 170, 0)), Image.new("RGB", (40, 90), (220, 0, 0))])
    completion = processor.tokenizer(" The answer is four.", add_special_tokens=False)["input_ids"]
    return collate([encode_prompt(processor, prompt)], [completion], processor.tokenizer.pad_token_id)


def _worker(rank, port, model_dirs, out_dir):
    from opsd.rollout.weight_sync import full_tensors
    from opsd.trainer.distributed import Ranks, build_mesh
    from opsd.trainer.fsdp import copy_of_shards, load_sharded

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu, dist_cfg = torch.device("cpu"), DistributedConfig()
    ranks = Ranks(rank, 2, rank, cpu, build_mesh(dist_cfg, cpu, 2))
    cfg = ModelConfig(path=model_dirs[rank])
    processor = load_processor(cfg)
    reads = []

    def read():
        reads.append(rank)
        return load_model(cfg, processor, cpu).state_dict()

    student = load_sharded(empty_model(cfg, processor), read, ranks, dist_cfg, trainable=True)
    teacher = copy_of_shards(empty_model(cfg, processor), student, ranks, dist_cfg)
    batch = image_batch(processor)
    with torch.no_grad():
        logits = completion_logits(student, batch), completion_logits(teacher, batch)
    student.reshard()  # a trainable root keeps its gathered weights until a backward, which never comes here
    f32, bf16 = [0], [0]
    full32 = {n: t.clone() for n, t in full_tensors(student, None, f32)}
    full16 = {n: t.clone() for n, t in full_tensors(student, torch.bfloat16, bf16)}
    dtensor = {n: p.detach().full_tensor() for n, p in student.named_parameters()}
    teacher_full = {n: p.detach().full_tensor() for n, p in teacher.named_parameters()}
    torch.save(dict(reads=reads, logits=logits, full32=full32, full16=full16, dtensor=dtensor, teacher=teacher_full,
                    gathered=(f32[0], bf16[0])), f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_only_rank_0_reads_the_weights_and_every_rank_gets_them(tmp_path, tiny_qwen_vl_dir):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_qwen_vl_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not list(no_weights.glob("*.safetensors"))
    run_two_ranks(_worker, [str(tiny_qwen_vl_dir), str(no_weights)], str(tmp_path))

    cfg = ModelConfig(path=str(tiny_qwen_vl_dir))
    processor = load_processor(cfg)
    reference = load_model(cfg, processor, torch.device("cpu")).eval()
    with torch.no_grad():
        expected_logits = completion_logits(reference, image_batch(processor))
    expected = dict(reference.named_parameters())
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["reads"] for r in results] == [[0], []]  # one read of the weight files, on rank 0
    for r in results:
        assert r["dtensor"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(r["dtensor"][name], value.detach()), name
            assert torch.equal(r["teacher"][name], value.detach()), name
            assert torch.equal(r["full32"][name], value.detach()), name  # the per-unit gather
            assert torch.equal(r["full16"][name], value.detach().to(torch.bfloat16)), name
        for logits in r["logits"]:  # student and teacher, with real rotary buffers
            torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
        f32, bf16 = r["gathered"]
        assert f32 > 0 and bf16 * 2 == f32  # bfloat16 weights gather half the bytes
