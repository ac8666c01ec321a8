"""`model.freeze_vision`: which weights freeze, and what follows from it without an engine (gradients,
optimizer state, the teacher, the weight sync, the memory plan, checkpoints)."""

import pytest
import torch

from opsd.config import ConfigError, LoraConfig, ModelConfig, TeacherConfig, load_config
from opsd.lora import add_lora
from opsd.modeling import load_model, load_processor, vision_parameter_names
from opsd.rollout.engine import EngineCapabilities
from opsd.rollout.weight_sync import push_weights, sync_student
from opsd.teacher import make_teacher
from opsd.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from opsd.trainer.memory_plan import GB, plan_memory
from opsd.trainer.optim import build_optimizer
from tests.helpers.parts import assert_same_tensors, make_parts, take_steps


def frozen_model(model_dir):
    cfg = ModelConfig(path=str(model_dir), freeze_vision=True)
    return load_model(cfg, load_processor(cfg), torch.device("cpu"))


@pytest.mark.parametrize("fixture, modules", [
    ("tiny_vlm_dir", {"model.vision_model", "model.connector"}),
    ("tiny_qwen_vl_dir", {"model.visual"}),
    ("tiny_qwen3_vl_dir", {"model.visual"}),  # its mergers, DeepStack's included
    ("tiny_paddleocr_vl_dir", {"model.visual", "model.projector"}),
])
def test_the_vision_tower_and_connector_freeze_and_nothing_else(request, fixture, modules):
    model = frozen_model(request.getfixturevalue(fixture))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == set(vision_parameter_names(model))
    assert {".".join(name.split(".")[:2]) for name in frozen} == modules
    assert all(p.requires_grad for name, p in model.named_parameters() if name not in frozen)
    assert "lm_head.weight" not in frozen
    optimizer = build_optimizer(load_config("configs/smoke.yaml", ["data.path=unused"]).optim, model)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for name, p in model.named_parameters() if name in frozen}


def test_a_text_model_or_vision_adapters_beside_a_frozen_tower_are_refused(tiny_text_dir):
    with pytest.raises(ConfigError, match="no vision tower"):
        frozen_model(tiny_text_dir)
    with pytest.raises(ConfigError, match="model.freeze_vision=true and model.lora.vision_target_modules"):
        load_config("configs/smoke.yaml", ["model.freeze_vision=true", "model.lora={vision_target_modules: [fc1]}",
                                          "rollout.lora_sync=merged"])


@pytest.mark.parametrize("mode", ["ema", "fixed"])
def test_the_teacher_shares_the_frozen_tower_and_its_ema_leaves_it(tiny_vlm_dir, mode):
    student = frozen_model(tiny_vlm_dir)
    teacher = make_teacher(TeacherConfig(mode=mode, ema_decay=0.5), student)
    s, t = dict(student.named_parameters()), dict(teacher.module.named_parameters())
    frozen = set(vision_parameter_names(student))
    assert all(t[name] is s[name] for name in frozen)  # shared, not copied
    assert all(t[name] is not s[name] for name in s if name not in frozen)
    with torch.no_grad():
        for name in s.keys() - frozen:
            s[name].add_(1.0)  # a student step
    before = {name: p.clone() for name, p in t.items()}
    teacher.update(student)
    moved = {name for name in t if not torch.equal(t[name], before[name])}
    assert moved == (s.keys() - frozen if mode == "ema" else set())


def test_the_sync_leaves_out_exactly_the_frozen_weights_in_full_and_merged_lora_syncs(tiny_vlm_dir):
    from tests.unit.test_weight_sync import Recorder

    student = frozen_model(tiny_vlm_dir)
    frozen = frozenset(vision_parameter_names(student))
    every, without = Recorder(), Recorder()
    full = push_weights(student, every)
    part = push_weights(student, without, exclude=frozen)
    sent = [name for event in without.events[1:-1] for name, _ in event]
    assert set(sent) == {n for n, _ in student.named_parameters()} - frozen
    vision_bytes = sum(p.numel() * p.element_size() for n, p in student.named_parameters() if n in frozen)
    assert vision_bytes > 0 and full.bytes - part.bytes == vision_bytes

    lora_student = add_lora(frozen_model(tiny_vlm_dir), LoraConfig(rank=4))
    merged = Recorder(EngineCapabilities())
    sync_student(lora_student, merged, lora_sync="merged", exclude=frozen)
    assert {name for event in merged.events[1:-1] for name, _ in event} == set(sent)

    # An engine that drops its weights while released (vLLM asleep at level 2) gets the tower too.
    dropping = Recorder(EngineCapabilities(discards_weights=True))
    assert sync_student(student, dropping, exclude=frozen).bytes == full.bytes


def test_the_memory_plan_counts_no_gradients_optimizer_state_or_teacher_copy_for_the_frozen_tower(tiny_vlm_dir):
    overrides = [f"model.path={tiny_vlm_dir}", "data.path=unused", "teacher.mode=ema"]
    plain = plan_memory(load_config("configs/smoke.yaml", overrides), world_size=1, device_gb=80)
    frozen = plan_memory(load_config("configs/smoke.yaml", [*overrides, "model.freeze_vision=true"]), world_size=1, device_gb=80)
    V = frozen.shape.vision_parameters
    assert V == sum(p.numel() for n, p in frozen_model(tiny_vlm_dir).named_parameters() if not p.requires_grad)
    rows = lambda plan: {item: gb for item, gb, _ in plan.rows}  # noqa: E731
    for item, per_param in (("gradients", 4), ("optimizer", 8), ("teacher (ema)", 4)):
        assert rows(plain)[item] - rows(frozen)[item] == pytest.approx(per_param * V / GB)
    assert rows(plain)["student weights"] == rows(frozen)["student weights"]


def test_a_frozen_vision_checkpoint_restores_exactly(tmp_path, tiny_vlm_dir):
    parts = make_parts(tiny_vlm_dir, freeze_vision=True)
    initial = {n: p.clone() for n, p in parts.student.named_parameters() if not p.requires_grad}
    take_steps(parts, 2)
    path = save_checkpoint(tmp_path / "run", 2, parts, {"step": 2})
    fresh = make_parts(tiny_vlm_dir, freeze_vision=True)
    take_steps(fresh, 1)
    load_checkpoint(path, fresh)
    assert_same_tensors(fresh.student.state_dict(), parts.student.state_dict())
    assert_same_tensors(fresh.teacher.module.state_dict(), parts.teacher.module.state_dict())
    saved, loaded = parts.optimizer.state_dict(), fresh.optimizer.state_dict()
    trainable = sum(p.requires_grad for p in parts.student.parameters())
    assert len(saved["state"]) == len(loaded["state"]) == trainable < len(list(parts.student.parameters()))
    for index, state in saved["state"].items():
        assert_same_tensors(state, loaded["state"][index])
    assert all(torch.equal(p, initial[n]) for n, p in fresh.student.named_parameters() if n in initial)

    # Resuming it unfrozen would need optimizer state it never had: refused, saying what to do.
    unfrozen = make_parts(tiny_vlm_dir)
    with pytest.raises(CheckpointError, match="model.freeze_vision=true"):
        load_checkpoint(path, unfrozen)
    load_checkpoint(path, unfrozen, weights_only=True)  # its weights are fine to start from
    assert_same_tensors(unfrozen.student.state_dict(), parts.student.state_dict())
