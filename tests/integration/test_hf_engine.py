"""The HF engine samples from the rollout settings alone, whatever the checkpoint's generation_config says."""

import json
import shutil

import torch

from opsd.config import ModelConfig, PromptConfig
from opsd.data.sample import Sample
from opsd.loss import token_logprobs
from opsd.modeling import load_model, load_processor
from opsd.prompts import student_prompt
from opsd.rollout.engine import SamplingSettings
from opsd.rollout.hf_engine import HFEngine
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt


def test_model_generation_config_does_not_leak_into_sampling(tiny_text_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_text_dir, model_dir)
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.update(repetition_penalty=1.3, top_k=5, do_sample=True, temperature=0.5)
    config_path.write_text(json.dumps(config))

    cfg = ModelConfig(path=str(model_dir))
    processor = load_processor(cfg)
    trainer = load_model(cfg, processor, torch.device("cpu"))
    engine = HFEngine(load_model(cfg, processor, torch.device("cpu")), processor)
    samples = [Sample(id=f"t{i}", question=f"What is {i} + {i + 3}?", images=[], privileged_images=[]) for i in range(3)]
    prompts = [student_prompt(s, processor, PromptConfig()) for s in samples]

    def trainer_logits(completions):
        encoded = [encode_prompt(processor, prompts[c.prompt_index]) for c in completions]
        batch = collate(encoded, [c.token_ids for c in completions], processor.pad_token_id)
        with torch.no_grad():
            return completion_logits(trainer, batch), batch.completion_ids

    sampled = engine.generate(prompts, SamplingSettings(max_new_tokens=16, n=2, seed=3))
    logits, ids = trainer_logits(sampled)
    engine_lp = torch.tensor([lp for c in sampled for lp in c.logprobs])
    assert (token_logprobs(logits, ids) - engine_lp).abs().max() < 1e-4
    # The checkpoint's top_k=5 is not applied: most draws (T=1, no top-k) lie outside the top 5.
    rank = (logits > logits.gather(-1, ids[:, None])).sum(-1)
    assert (rank >= 5).float().mean() > 0.5

    # Greedy picks the argmax of the raw logits at every position: no repetition penalty.
    greedy = engine.generate(prompts, SamplingSettings(max_new_tokens=16, temperature=0.0))
    logits, ids = trainer_logits(greedy)
    assert torch.equal(logits.argmax(-1), ids)
    repeats = sum(len(c.token_ids) - len(set(c.token_ids)) for c in greedy)
    assert repeats > 0  # the penalty would have had tokens to act on
