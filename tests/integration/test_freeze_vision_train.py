"""`model.freeze_vision=true` on the demo (tiny Idefics3, colocated vLLM engine), 10 steps: the sync
leaves the vision tower and connector out, the engine keeps its image encodings and still agrees
with the trainer, and the frozen weights and their (absent) optimizer state are as they began."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import opsd.rollout.vllm_engine
from opsd.config import ModelConfig, load_config
from opsd.modeling import load_model, load_processor, vision_parameter_names
from opsd.train import train


@pytest.mark.vllm
@pytest.mark.slow
def test_ten_frozen_vision_steps_sync_less_keep_encodings_and_leave_the_tower_untouched(
    tmp_path, tiny_vlm_dir, grid_data_dir, monkeypatch
):
    resets = []
    reset_caches = opsd.rollout.vllm_engine.reset_caches

    def recording_reset(llm, **kwargs):
        resets.append(kwargs.get("keep_image_encodings", False))
        reset_caches(llm, **kwargs)

    monkeypatch.setattr(opsd.rollout.vllm_engine, "reset_caches", recording_reset)
    cfg = load_config("configs/smoke.yaml", [
        f"model.path={tiny_vlm_dir}", f"data.path={grid_data_dir}", f"logging.output_dir={tmp_path / 'run'}",
        "model.freeze_vision=true", "train.max_steps=10", "train.prompts_per_micro_step=1", "train.grad_accum_steps=1",
        "rollout.max_new_tokens=12",
        "eval.every=0", "checkpoint.save_every=0", "checkpoint.resume_from=null", "logging.progress_bar=false",
    ])
    out = train(cfg)

    initial = load_model(ModelConfig(path=str(tiny_vlm_dir)), load_processor(cfg.model), torch.device("cpu"))
    params = dict(initial.named_parameters())
    vision = set(vision_parameter_names(initial))
    nbytes = lambda names: sum(params[n].numel() * params[n].element_size() for n in names)  # noqa: E731
    expected = nbytes(params) - nbytes(vision)  # what an unfrozen step sends, less the tower and connector
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    for r in records:
        assert r["weight_sync_bytes"] == expected and nbytes(vision) > 0
        assert r["logprob_mismatch_max"] < 1e-4  # the engine kept its encodings, and they still hold
    assert resets == [False] + [True] * 10  # the start-up sync resets them, the step syncs keep them

    checkpoint = out / "checkpoint-10"
    saved = load_file(checkpoint / "model" / "model.safetensors")
    assert all(torch.equal(saved[n], params[n]) for n in vision)  # bit-identical to the initial weights
    assert any(not torch.equal(saved[n], params[n]) for n in params.keys() - vision)  # the rest trained
    state_keys = FileSystemReader(str(checkpoint / "train_state")).read_metadata().state_dict_metadata
    optimizer_params = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in state_keys if k.startswith("optimizer.state.")}
    assert optimizer_params == params.keys() - vision


@pytest.mark.vllm
def test_the_engine_keeps_image_encodings_across_syncs_that_leave_the_tower_alone(tiny_vlm_dir):
    """The same image after a text-only sync is served from the kept encodings and still agrees with
    the trainer; had the tower changed, the kept encodings would be stale (which shows they are kept)."""
    from opsd.config import PromptConfig
    from opsd.data.synthetic import generate_samples
    from opsd.prompts import placeholder_token_ids, student_prompt
    from opsd.rollout.engine import SamplingSettings
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine
    from opsd.rollout.weight_sync import sync_student
    from tests.helpers.logprobs import TOLERANCE, engine_logprobs, trainer_logprobs

    cfg = ModelConfig(path=str(tiny_vlm_dir), freeze_vision=True)
    processor = load_processor(cfg)
    trainer = load_model(cfg, processor, torch.device("cpu"))
    vision = frozenset(vision_parameter_names(trainer))
    prompts = [student_prompt(s, processor, PromptConfig()) for s in generate_samples(2, seed=4)]
    sampling = SamplingSettings(max_new_tokens=8, seed=1, banned_token_ids=placeholder_token_ids(processor))
    engine = VLLMEngine(VLLMOptions(str(tiny_vlm_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64,
                                    enforce_eager=True, frozen_vision=True))

    def gap():
        completions = engine.generate(prompts, sampling)  # the same images every time
        return (trainer_logprobs(trainer, processor, prompts, completions) - engine_logprobs(completions)).abs().max()

    def nudge(names):
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                if name in names:
                    p.add_(torch.randn_like(p) * 0.05)

    try:
        sync_student(trainer, engine)  # the start-up sync: everything, encodings reset
        assert gap() < TOLERANCE
        nudge({n for n, _ in trainer.named_parameters()} - vision)
        sync_student(trainer, engine, exclude=vision)
        assert gap() < TOLERANCE  # kept encodings, still right: the tower did not change
        nudge(vision)
        sync_student(trainer, engine)  # the tower changed behind a frozen-vision engine's back
        assert gap() > 1e-3  # the kept encodings are stale: they were not recomputed
    finally:
        engine.close()
