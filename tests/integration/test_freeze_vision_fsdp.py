"""`model.freeze_vision` under FSDP2 (2 gloo ranks, tiny Idefics3): the frozen tower takes no gradient
and no optimizer state through a step on image prompts, the EMA teacher's copy of it stays, and the
gathered weight sync leaves it out (its shards are never gathered)."""

import pytest
import torch
import torch.distributed as dist

from opsd.config import DistributedConfig, JsdLossConfig, ModelConfig, PromptConfig, TeacherConfig
from opsd.data.synthetic import generate_samples
from opsd.modeling import empty_model, load_model, load_processor, vision_parameter_names
from opsd.prompts import student_prompt, teacher_prompt
from opsd.sequences import Example, encode_prompt
from tests.helpers.spawn import run_two_ranks


def _worker(rank, port, model_dir, out_dir):
    from opsd.config import OptimConfig
    from opsd.loss_kinds import build_loss
    from opsd.rollout.weight_sync import full_tensors
    from opsd.scoring import Scoring
    from opsd.teacher import make_teacher
    from opsd.trainer.distributed import Ranks, build_mesh
    from opsd.trainer.fsdp import copy_of_shards, load_sharded
    from opsd.trainer.optim import build_optimizer
    from opsd.trainer.step import TrainStep

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu, dist_cfg = torch.device("cpu"), DistributedConfig()
    ranks = Ranks(rank, 2, rank, cpu, build_mesh(dist_cfg, cpu, 2))
    cfg = ModelConfig(path=model_dir, freeze_vision=True)
    processor = load_processor(cfg)
    read = lambda: load_model(cfg, processor, cpu).state_dict()  # noqa: E731
    student = load_sharded(empty_model(cfg, processor), read, ranks, dist_cfg, trainable=True)
    copy_shards = lambda s: copy_of_shards(empty_model(cfg, processor), s, ranks, dist_cfg)  # noqa: E731
    teacher = make_teacher(TeacherConfig(mode="ema", ema_decay=0.5), student, copy_shards)
    vision = frozenset(vision_parameter_names(student))
    before = {n: p.detach().full_tensor() for n, p in student.named_parameters()}
    teacher_before = {n: p.detach().full_tensor() for n, p in teacher.module.named_parameters()}

    sample = generate_samples(2, seed=rank)[rank]
    student_ids = encode_prompt(processor, student_prompt(sample, processor, PromptConfig()))
    teacher_ids = encode_prompt(processor, teacher_prompt(sample, processor, PromptConfig()))
    examples = [Example(f"r{rank}", student_ids, teacher_ids, [5, 6, 7, 8], [0.0] * 4)]
    optimizer = build_optimizer(OptimConfig(lr=1e-2), student)
    grads = set()  # the step zeroes gradients after it: see them just before the optimizer step
    optimizer.register_step_pre_hook(
        lambda *_: grads.update(n for n, p in student.named_parameters() if p.grad is not None))
    scoring = Scoring(build_loss(JsdLossConfig(top_k=16, ce_weight=1.0)), pad_id=processor.tokenizer.pad_token_id)
    TrainStep(student, teacher.scorer, optimizer, scoring, max_grad_norm=1.0, ranks=ranks)(examples, total_tokens=8)
    teacher.update(student)
    with_state = {n for n, p in student.named_parameters() if p in optimizer.state}
    after = {n: p.detach().full_tensor() for n, p in student.named_parameters()}
    teacher_after = {n: p.detach().full_tensor() for n, p in teacher.module.named_parameters()}
    every, without = [0], [0]
    names = [n for n, _ in full_tensors(student, None, every)]
    kept = [n for n, _ in full_tensors(student, None, without, exclude=vision)]
    torch.save(dict(vision=vision, grads=grads, with_state=with_state, before=before, after=after,
                    teacher_before=teacher_before, teacher_after=teacher_after, names=names, kept=kept,
                    gathered=(every[0], without[0])), f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_frozen_tower_under_fsdp_takes_no_gradient_no_state_no_ema_and_no_gather(tmp_path, tiny_vlm_dir):
    run_two_ranks(_worker, str(tiny_vlm_dir), str(tmp_path))
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        vision, everything = r["vision"], set(r["before"])
        assert vision and r["grads"] == r["with_state"] == everything - vision
        assert all(torch.equal(r["after"][n], r["before"][n]) for n in vision)
        assert any(not torch.equal(r["after"][n], r["before"][n]) for n in everything - vision)
        assert all(torch.equal(r["teacher_after"][n], r["teacher_before"][n]) for n in vision)
        assert any(not torch.equal(r["teacher_after"][n], r["teacher_before"][n]) for n in everything - vision)
        assert set(r["names"]) == everything and set(r["kept"]) == everything - vision
        vision_bytes = sum(r["before"][n].numel() * 4 for n in vision)
        assert r["gathered"][0] - r["gathered"][1] == vision_bytes  # its shards are not even gathered
