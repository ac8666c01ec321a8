"""`--dry-run` memory plan: parameter counts from the config on the meta device, per-rank arithmetic."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from opsd.config import load_config
from opsd.train import main
from opsd.trainer.fsdp import transformer_blocks
from opsd.trainer.memory_plan import CONTEXT_GB, GB, HEADROOM, hf_config, model_shape, plan_memory


def tiny_config(model_dir, *overrides):
    return load_config("configs/smoke.yaml", [f"model.path={model_dir}", "data.path=unused", *overrides])


def rows(plan) -> dict[str, float]:
    return {item: gb for item, gb, _ in plan.rows}


@pytest.mark.parametrize("which", ["text", "vlm", "qwen", "qwen3"])
def test_meta_device_counts_equal_the_loaded_model(which, tiny_text_dir, tiny_vlm_dir, tiny_qwen_vl_dir, tiny_qwen3_vl_dir):
    model_dir = {"text": tiny_text_dir, "vlm": tiny_vlm_dir, "qwen": tiny_qwen_vl_dir, "qwen3": tiny_qwen3_vl_dir}[which]
    auto = AutoModelForCausalLM if which == "text" else AutoModelForImageTextToText
    loaded = auto.from_pretrained(model_dir, dtype=torch.float32)
    shape = model_shape(hf_config(tiny_config(model_dir).model)[0])
    assert shape.parameters == sum(p.numel() for p in loaded.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in transformer_blocks(loaded)]
    assert shape.root_parameters == shape.parameters - sum(blocks) and shape.largest_block == max(blocks)
    assert (shape.vision is None) == (which == "text")
    assert shape.hidden == 128 and shape.layers == 2


def test_per_rank_arithmetic_on_a_tiny_model(tiny_text_dir):
    cfg = tiny_config(tiny_text_dir, "teacher.mode=ema", "distributed.param_dtype=float32")
    plan = plan_memory(cfg, world_size=2, device_gb=80)
    P = plan.shape.parameters
    r = rows(plan)
    assert r["student weights"] == pytest.approx(4 * P / 2 / GB)
    assert r["gradients"] == pytest.approx(4 * P / 2 / GB)
    assert r["optimizer"] == pytest.approx(8 * P / 2 / GB)
    assert r["teacher (ema)"] == pytest.approx(4 * P / 2 / GB)
    # Two root units (student and teacher) and two blocks gathered in param_dtype (float32 here).
    gathered = (2 * plan.shape.root_parameters + 2 * plan.shape.largest_block) * 4 / GB
    assert r["gathered FSDP units"] == pytest.approx(gathered)
    static = sum(r[k] for k in ("student weights", "gradients", "optimizer", "teacher (ema)")) + CONTEXT_GB
    assert plan.rollout_gb == pytest.approx(static + r["engine, awake"])
    assert plan.fits

    single = rows(plan_memory(tiny_config(tiny_text_dir, "teacher.mode=self"), world_size=1, device_gb=80))
    assert single["student weights"] == pytest.approx(4 * P / GB) and single["teacher (self)"] == 0
    assert "gathered FSDP units" not in single  # one process: nothing is gathered
    # The KV cache is bounded in the demo config: 64 MiB plus bfloat16/float32 weights and runtime.
    assert single["engine, awake"] > 64 * 2**20 / GB

    tight = plan_memory(cfg, world_size=2, device_gb=1.0)
    assert tight.fits is False and "DOES NOT FIT" in tight.describe()
    assert plan_memory(cfg, world_size=2, device_gb=None).fits is None


def test_activation_checkpointing_and_more_ranks_shrink_the_plan(tiny_qwen_vl_dir):
    cfg = tiny_config(tiny_qwen_vl_dir, "train.max_forward_tokens=4096")
    plain = rows(plan_memory(cfg, world_size=2, device_gb=80))
    checkpointed = rows(plan_memory(tiny_config(tiny_qwen_vl_dir, "train.max_forward_tokens=4096",
                                                "distributed.activation_checkpointing=true"), world_size=2, device_gb=80))
    assert checkpointed["activations (estimate)"] < plain["activations (estimate)"]
    four = rows(plan_memory(cfg, world_size=4, device_gb=80))
    assert four["optimizer"] == pytest.approx(plain["optimizer"] / 2)


@pytest.mark.parametrize("recipe", ["configs/visual_opsd_qwen25vl_7b.yaml", "configs/visual_opsd_thinkmorph.yaml"])
def test_the_7b_recipes_fit_8_gpus_of_80_gb_and_not_one(recipe):
    cfg = load_config(recipe)
    plan = plan_memory(cfg, world_size=8, device_gb=80)
    assert plan.shape.parameters == 8_292_166_656  # Qwen2.5-VL-7B with its vision tower
    assert plan.fits, plan.describe()
    assert plan.peak_gb < HEADROOM * 80
    assert plan_memory(cfg, world_size=1, device_gb=80).fits is False


def test_the_qwen3vl_8b_recipes_fit_8_gpus_full_and_one_gpu_with_lora():
    full = plan_memory(load_config("configs/visual_opsd_qwen3vl_8b.yaml"), world_size=8, device_gb=80)
    # Qwen3-VL-8B-Instruct as published: 8.767B, of which the vision tower (with DeepStack mergers) 576.4M
    assert full.shape.parameters == 8_767_123_696
    assert full.fits, full.describe()
    lora = plan_memory(load_config("configs/visual_opsd_qwen3vl_8b_lora.yaml"), world_size=1, device_gb=80)
    # rank 64 on q/k/v/o/gate/up/down of 36 decoder layers (hidden 4096, kv 1024, MLP 12288); no vision layer
    assert lora.shape.lora_parameters == 36 * 64 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))
    assert lora.fits, lora.describe()


def test_dry_run_prints_the_memory_plan(capsys):
    assert main(["--config", "configs/visual_opsd_qwen25vl_7b.yaml", "--dry-run", "--world-size", "8", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "memory plan per rank: world size 8" in out and "fits: peak" in out
    assert main(["--config", "configs/visual_opsd_qwen25vl_7b.yaml", "--dry-run", "--world-size", "1", "--gpu-memory-gb", "80"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_the_qwen3_text_recipe_fits_one_gpu_of_80_gb():
    plan = plan_memory(load_config("configs/text_opsd_qwen3_1p7b.yaml"), world_size=1, device_gb=80)
    assert plan.shape.parameters == 1_720_574_976  # Qwen3-1.7B, tied embeddings
    assert plan.fits, plan.describe()


def test_lora_plan_counts_the_adapter_not_the_base_for_gradients_optimizer_and_teacher():
    cfg = load_config("configs/visual_opsd_qwen25vl_7b_lora.yaml")
    plan = plan_memory(cfg, world_size=1, device_gb=80)
    got = {item: gb for item, gb, _ in plan.rows}
    P, A = plan.shape.parameters, plan.shape.lora_parameters
    # rank 64 on q/k/v/o/gate/up/down of 28 decoder layers (hidden 3584, kv 512, MLP 18944); no vision layer
    per_layer = 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    assert A == 28 * per_layer
    assert got["student weights"] == pytest.approx((2 * P + 4 * A) / GB)
    assert got["gradients"] == pytest.approx(4 * A / GB)
    assert got["optimizer"] == pytest.approx(8 * A / GB)
    assert got["teacher (ema)"] == pytest.approx(4 * A / GB)
    assert plan.fits  # the recipe's promise: one 80 GB GPU
    base = plan_memory(load_config("configs/visual_opsd_qwen25vl_7b_lora.yaml", ["teacher.mode=base"]), 1, 80)
    assert {item: gb for item, gb, _ in base.rows}["teacher (base)"] == 0
