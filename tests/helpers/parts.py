"""Training parts of the tiny text model (student, EMA teacher, optimizer, schedule, data) that
have taken real optimizer steps: what a checkpoint holds, without an engine."""

import torch

from opsd.config import ModelConfig, OptimConfig, TeacherConfig, config_from_dict
from opsd.data.sample import Sample
from opsd.data.stream import SampleStream
from opsd.modeling import load_model, load_processor
from opsd.teacher import make_teacher
from opsd.trainer.checkpoint import TrainingParts
from tests.helpers.samples import SampleList
from opsd.trainer.optim import build_optimizer, build_scheduler


def make_parts(model_dir, teacher_mode="ema", wrap=lambda model: None, freeze_vision=False, optim_cfg=None, max_steps=10):
    """`wrap` (e.g. FSDP2 sharding) is applied to the student and its teacher's own model (if any)
    before the optimizer exists; the EMA moves half way each step. `optim_cfg`, `max_steps`: the
    optimizer and schedule (default: lr 1e-2 after 1 warm-up step, cosine to 0 over 10 steps)."""
    model_cfg = ModelConfig(path=str(model_dir), freeze_vision=freeze_vision)
    processor = load_processor(model_cfg)
    student = load_model(model_cfg, processor, torch.device("cpu"))
    teacher = make_teacher(TeacherConfig(mode=teacher_mode, ema_decay=0.5), student)
    for model in [student] + ([teacher.module] if teacher.module is not None else []):
        wrap(model)
    optim_cfg = optim_cfg or OptimConfig(lr=1e-2, min_lr=0.0, warmup_steps=1)
    optimizer = build_optimizer(optim_cfg, student)
    scheduler = build_scheduler(optim_cfg, optimizer, max_steps)
    samples = [Sample(id=f"s{i}", question=f"q{i}", images=[], privileged_images=[]) for i in range(5)]
    return TrainingParts(student, teacher, optimizer, scheduler, processor, SampleStream([SampleList(samples)], seed=3))


def take_steps(parts, n):
    """Real optimizer steps, so the optimizer, schedule and EMA teacher all hold state."""
    for _ in range(n):
        ids = torch.randint(0, 200, (2, 10))
        parts.student(input_ids=ids, labels=ids).loss.backward()
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        parts.scheduler.step()
        parts.teacher.update(parts.student)


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def run_config(output_dir, **checkpoint):
    """A minimal run config writing to `output_dir`, with these `checkpoint` settings."""
    return config_from_dict({
        "model": {"path": "m"}, "data": {"path": "d"},
        "logging": {"output_dir": str(output_dir)}, "checkpoint": checkpoint,
    })
