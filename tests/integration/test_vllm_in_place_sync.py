"""The vLLM engine's in-place weight update (opsd/rollout/vllm_reload.py) leaves no stale weight: after
large random updates of every weight, then of a part of them (one shard of each fused layer, the
embeddings a tied LM head shares), the engine's logprobs are the trainer's."""

import pytest
import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.synthetic import generate_samples
from opsd.modeling import load_model, load_processor
from opsd.prompts import placeholder_token_ids, student_prompt
from opsd.rollout.engine import SamplingSettings
from opsd.rollout.weight_sync import checkpoint_names, push_tensors, sync_student
from tests.helpers.logprobs import TOLERANCE, engine_logprobs, trainer_logprobs
from tests.helpers.samples import text_samples

PARTIAL = ("q_proj", "gate_proj", "embed_tokens")
"""The partial update: a third of each attention's fused qkv, half of each MLP's gate_up, the embeddings."""


def _updates_in_place(engine) -> bool:
    from opsd.rollout.vllm_reload import _updates_in_place

    return engine.llm.collective_rpc(lambda worker: _updates_in_place(worker.model_runner.get_model()))[0]


def _shake(params, scale: float = 0.1) -> None:
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * scale)


@pytest.mark.vllm
@pytest.mark.parametrize("model", ["tied-text", "vlm"])
def test_in_place_updates_leave_no_stale_weight(model, request):
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    model_dir = request.getfixturevalue({"tied-text": "tied_text_dir", "vlm": "tiny_vlm_dir"}[model])
    processor = load_processor(ModelConfig(path=str(model_dir)))
    trainer = load_model(ModelConfig(path=str(model_dir)), processor, torch.device("cpu"))
    samples = text_samples(3) if model == "tied-text" else generate_samples(3, seed=1)
    prompts = [student_prompt(s, processor, PromptConfig()) for s in samples]
    sampling = SamplingSettings(max_new_tokens=12, n=2, seed=7, banned_token_ids=placeholder_token_ids(processor))
    engine = VLLMEngine(VLLMOptions(str(model_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))

    def gap() -> float:
        completions = engine.generate(prompts, sampling)
        return (trainer_logprobs(trainer, processor, prompts, completions) - engine_logprobs(completions)).abs().max().item()

    try:
        assert _updates_in_place(engine)  # the path under test, not vLLM's layerwise reload
        named = dict(trainer.named_parameters())
        partial = [name for name in named if any(part in name for part in PARTIAL)]
        assert partial and len(partial) < len(named)
        for update in range(2):  # the first update stages the CPU layers' weights, the second reuses them
            _shake(named.values())
            assert gap() > 1e-2  # stale weights show
            sync_student(trainer, engine, bucket_mb=0.05)
            assert gap() < TOLERANCE, f"full update {update}"

            _shake(named[name] for name in partial)
            assert gap() > 1e-2
            push_tensors(((name, named[name].detach()) for name in partial), engine, bucket_mb=0.05,
                         names=checkpoint_names(trainer))
            assert gap() < TOLERANCE, f"partial update {update}"
    finally:
        engine.close()
