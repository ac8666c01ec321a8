"""The train step on two gloo ranks with FSDP2 equals one process training on the union of their examples.

A rank may have fewer micro-batches than the other, or none at all (every completion empty or
skipped): it pads with weight-0 micro-steps and must neither hang nor change the result. The loss is
divided by the tokens of both ranks (global token normalisation), so the update equals the
single-process one, gradient clipping included. Plain SGD keeps round-off differences of the
gradients visible as such (Adam would scale them up to the learning rate).
"""

import pytest
import torch
import torch.distributed as dist

from opsd.config import DistributedConfig, JsdLossConfig, TeacherConfig
from opsd.loss_kinds import build_loss
from opsd.scoring import Scoring
from opsd.sequences import EncodedPrompt, Example, padding_example
from opsd.teacher import make_teacher
from opsd.trainer.distributed import Ranks
from opsd.trainer.step import TrainStep
from tests.helpers.spawn import run_two_ranks

TEACHER = TeacherConfig(mode="ema", ema_decay=0.5)
LOSS = JsdLossConfig(top_k=16, ce_weight=0.5)
# Per step: which of the step's examples each rank trains on (micro-batches of one example).
SPLITS = [([0, 1, 2], []), ([0], [1, 2]), ([0, 1], [2])]


BEGINNING = [5, 6, 7]
"""Every prompt opens with it, as with a system prompt: packed rows share it (`share_prompt_prefix`)."""


def make_examples(step: int, vocab: int) -> list[Example]:
    """Three examples; the first two are two samples of one prompt (they share its prompt objects)."""
    gen = torch.Generator().manual_seed(step)
    examples = []
    for i in range(3):
        prompt = torch.randint(3, vocab, (6 + i,), generator=gen).tolist()
        privileged = torch.randint(3, vocab, (4,), generator=gen).tolist()
        completion = torch.randint(3, vocab, (3 + 2 * i,), generator=gen).tolist()
        student, teacher = (examples[0].student, examples[0].teacher) if i == 1 else \
            (EncodedPrompt(BEGINNING + prompt), EncodedPrompt(BEGINNING + privileged + prompt))
        examples.append(Example(f"s{step}-{i}", student, teacher, completion, [0.0] * len(completion)))
    return examples


def load(model_dir):
    """The student and its EMA teacher (a frozen copy)."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return student, make_teacher(TEACHER, student)


def run_steps(student, teacher, rank_examples, ranks=Ranks(), scoring=None, per_step=lambda step: (None, None)):
    """The steps of one rank: `per_step(step)` gives the step's (total tokens, padding example)."""
    optimizer = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    scoring = scoring or Scoring(build_loss(LOSS), pad_id=0, micro_batch_size=1)
    train = TrainStep(student, teacher.scorer, optimizer, scoring, max_grad_norm=2.0, ranks=ranks)
    metrics = []
    for step, examples in enumerate(rank_examples):
        metrics.append(train(examples, *per_step(step)))
        teacher.update(student)
    return metrics


MODES = {"fsdp": DistributedConfig(), "hsdp+checkpointing": DistributedConfig(shard_size=1, activation_checkpointing=True)}
# The same FSDP runs with whole-share micro-batches whose two samples of one prompt share its forward
# (packed rows), against the reference's one sequence at a time.
PACKED = Scoring(build_loss(LOSS), pad_id=0, micro_batch_size=3, packed_row_tokens=64)
MODES |= {f"{mode}+packed": cfg for mode, cfg in MODES.items()}


def _worker(rank, port, model_dir, out_dir):
    from opsd.trainer.distributed import Ranks, build_mesh
    from opsd.modeling import enable_activation_checkpointing
    from opsd.trainer.fsdp import shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for mode, cfg in MODES.items():
        ranks = Ranks(rank, 2, rank, torch.device("cpu"), build_mesh(cfg, torch.device("cpu"), 2))
        student, teacher = load(model_dir)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(student)
        shard_model(student, ranks, cfg, trainable=True)
        shard_model(teacher.module, ranks, cfg, trainable=False)
        steps = [make_examples(step, student.config.vocab_size) for step in range(len(SPLITS))]
        mine = [[examples[i] for i in SPLITS[step][rank]] for step, examples in enumerate(steps)]

        def per_step(step):
            tokens = sum(len(steps[step][i].completion_ids) for i in SPLITS[step][0] + SPLITS[step][1])
            return tokens, padding_example(steps[step][0].student, steps[step][0].teacher, token_id=1)

        metrics = run_steps(student, teacher, mine, ranks, PACKED if mode.endswith("+packed") else None, per_step)
        full = {f"student.{n}": p.detach().full_tensor() for n, p in student.named_parameters()}
        full |= {f"teacher.{n}": p.detach().full_tensor() for n, p in teacher.module.named_parameters()}
        local = {n: p.detach().to_local().clone() for n, p in student.named_parameters()}
        torch.save((metrics, full, local), f"{out_dir}/{mode}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_uneven_and_empty_shares_match_one_process(tmp_path, tiny_text_dir):
    run_two_ranks(_worker, str(tiny_text_dir), str(tmp_path))

    student, teacher = load(tiny_text_dir)
    steps = [make_examples(step, student.config.vocab_size) for step in range(len(SPLITS))]
    reference = run_steps(student, teacher, steps)
    expected = {f"student.{n}": p.detach() for n, p in student.named_parameters()}
    expected |= {f"teacher.{n}": p for n, p in teacher.module.named_parameters()}

    for mode in MODES:
        got = [torch.load(tmp_path / f"{mode}-rank{r}.pt") for r in (0, 1)]
        for metrics, full, _ in got:
            for m, ref in zip(metrics, reference):
                for key in ("loss", "jsd", "ce", "grad_norm", "completion_tokens", "completion_len", "logprob_mismatch_mean"):
                    assert m[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), (mode, key)
            for name, value in expected.items():
                torch.testing.assert_close(full[name], value, atol=1e-6, rtol=1e-5, msg=f"{mode}: {name}")
    # Hybrid sharding with shards of one rank: each rank holds a replica, kept identical by the all-reduce.
    replicas = [torch.load(tmp_path / f"hsdp+checkpointing-rank{r}.pt")[2] for r in (0, 1)]
    for name, value in replicas[0].items():
        assert torch.equal(value, replicas[1][name]), name
