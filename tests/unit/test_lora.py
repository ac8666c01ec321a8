"""LoRA pieces on the tiny models, without an engine: which layers train, the adapter teachers, the merged
weights, adapter directories, config checks."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from opsd import lora
from opsd.config import ConfigError, LoraConfig, TeacherConfig, load_config
from opsd.sequences import ForwardBatch
from opsd.scoring import completion_logits
from opsd.teacher import AdapterView, EmaAdapterTeacher, make_teacher


def text_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def randomise_adapter(model, adapter=lora.STUDENT_ADAPTER, seed=0):
    """A trained-looking adapter: B is zero at initialisation, which would hide every mistake."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora.adapter_parameters(model, adapter).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def batch(n=2, length=9, vocab=200):
    ids = torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length).expand(n, length)[:, 4:-1] + length * torch.arange(n)[:, None]
    return ForwardBatch(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                        completion_positions=positions.reshape(-1), completion_ids=ids[:, 5:].reshape(-1))


def test_only_the_language_models_adapter_trains(tiny_vlm_dir):
    model = lora.add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir), LoraConfig(rank=4))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name and ".default." in name for name in trainable)
    adapted = {name.rsplit(".lora_", 1)[0] for name in trainable}
    assert all(name.startswith("model.text_model.layers.") for name in adapted)
    assert {name.rsplit(".", 1)[1] for name in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

    with_tower = lora.add_lora(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir),
                               LoraConfig(rank=4, target_modules=["q_proj"], vision_target_modules=["fc1"]))
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in with_tower.named_parameters() if p.requires_grad}
    assert any(n.startswith("model.vision_model.") and n.endswith("fc1") for n in adapted)
    assert not any(n.startswith("model.vision_model.") and n.endswith("q_proj") for n in adapted)


def test_unknown_target_module_is_an_error(tiny_text_dir):
    with pytest.raises(ValueError, match="target_modules"):
        lora.add_lora(text_model(tiny_text_dir), LoraConfig(target_modules=["qkv_proj"]))


def test_base_teacher_scores_like_the_initial_model_and_ema_adapter_moves(tiny_text_dir):
    initial = text_model(tiny_text_dir)
    student = lora.add_lora(text_model(tiny_text_dir), LoraConfig(rank=4), ema=True)
    randomise_adapter(student)
    grads_before = {n: p.requires_grad for n, p in student.named_parameters()}
    data = batch()
    with torch.no_grad():
        want = completion_logits(initial, data)
        base = completion_logits(make_teacher(TeacherConfig(mode="base"), student).scorer, data)
        with_adapter = completion_logits(student, data)
    assert torch.equal(base, want)  # the adapter switched off is exactly the initial model
    assert (with_adapter - want).abs().max() > 1e-3
    assert {n: p.requires_grad for n, p in student.named_parameters()} == grads_before

    cfg = TeacherConfig(mode="ema", ema_decay=0.5)
    teacher = make_teacher(cfg, student)
    assert isinstance(teacher, EmaAdapterTeacher) and teacher.module is None
    assert isinstance(teacher.scorer, AdapterView) and teacher.scorer.student is student
    ema = lora.adapter_parameters(student, lora.EMA_ADAPTER)
    before = {n: p.clone() for n, p in ema.items()}
    teacher.update(student)
    target = lora.adapter_parameters(student)
    for name, param in ema.items():
        assert torch.allclose(param, 0.5 * before[name] + 0.5 * target[name])
        assert not param.requires_grad
    with torch.no_grad():
        ema_logits = completion_logits(teacher.scorer, data)
    assert (ema_logits - with_adapter).abs().max() > 1e-4 and (ema_logits - want).abs().max() > 1e-4


def test_merged_tensors_are_peft_merge_and_unload(tiny_text_dir, tmp_path):
    student = lora.add_lora(text_model(tiny_text_dir), LoraConfig(rank=4, alpha=8))
    randomise_adapter(student)
    merged = dict(lora.merged_tensors(student))
    plain = text_model(tiny_text_dir)
    assert merged.keys() == dict(plain.named_parameters()).keys()

    lora.save_adapter(student, tmp_path / "adapter")
    assert lora.is_adapter_dir(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).merge_and_unload()
    for name, tensor in reference.named_parameters():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name
    data = batch()
    with torch.no_grad():
        assert (completion_logits(reference, data) - completion_logits(student, data)).abs().max() < 1e-5


def test_vllm_rank_rounds_up():
    assert [lora.vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=hf"], "rollout.lora_sync=adapter needs rollout.engine=vllm"),
    (["model.lora.vision_target_modules=[fc1]"], "vision_target_modules"),
    (["model.lora.target_modules=[q_proj.weight]"], "not module names"),
    (["model.lora.rank=0"], "model.lora.rank"),
    (["model.lora.base_dtype=bfloat16"], "needs model.dtype=bfloat16"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/smoke.yaml", ["model.lora={rank: 8}", *overrides])


def test_merged_sync_goes_with_any_engine():
    cfg = load_config("configs/smoke.yaml", ["model.lora={rank: 8}", "rollout.engine=hf", "rollout.lora_sync=merged",
                                             "model.lora.vision_target_modules=[fc1]", "teacher.mode=base"])
    assert cfg.model.lora.vision_target_modules == ["fc1"] and cfg.teacher.mode == "base"


def test_bfloat16_base_keeps_a_float32_adapter(tiny_text_dir):
    student = lora.add_lora(text_model(tiny_text_dir), LoraConfig(rank=4, base_dtype="bfloat16"))
    dtypes = {".lora_" in n: p.dtype for n, p in student.named_parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    randomise_adapter(student)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = completion_logits(student, batch())
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora.adapter_parameters(student).values())
    merged = dict(lora.merged_tensors(student))
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_dumps_point_lora_checkpoints_to_export_merge(tmp_path, tiny_text_dir):
    from opsd.dumps.offline import resolve_model_dirs
    from opsd.trainer.checkpoint import save_checkpoint
    from tests.helpers.parts import make_parts, take_steps

    parts = make_parts(tiny_text_dir, teacher_mode="self", wrap=lambda model: lora.add_lora(model, LoraConfig(rank=4)))
    take_steps(parts, 1)
    path = save_checkpoint(tmp_path / "run", 1, parts, {"step": 1})
    assert lora.is_adapter_dir(path / "model") and not (path / "model" / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="LoRA adapter.*--merge"):
        resolve_model_dirs(path)


def test_engines_without_receive_adapter_are_refused_for_adapter_sync():
    from opsd.rollout import EngineCapabilities
    from opsd.rollout.weight_sync import check_adapter_receiver

    class FullWeightsOnly:
        capabilities = EngineCapabilities()

        def begin_weight_update(self): ...

    with pytest.raises(ConfigError, match="FullWeightsOnly has no receive_adapter.*lora_sync=merged"):
        check_adapter_receiver(FullWeightsOnly())
