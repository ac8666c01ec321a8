"""PaddleOCR-VL: why the tiny one has a 1x1 learned position grid (a measured disagreement of
transformers 5.19 and vLLM 0.32, pinned here so that a fix on either side shows up).

Both resample the vision tower's learned position grid to each image's patch grid bilinearly,
transformers with `align_corners=True`, vLLM with `align_corners=False`. Where the image's grid is
the learned one nothing is resampled and they agree; elsewhere the engine samples from other
distributions than the trainer scores. Real PaddleOCR-VL checkpoints (a 27x27 grid) resample for
almost every image, so they train with a logprob mismatch (`logprob_mismatch_*` shows it).
"""

import pytest
import torch
from PIL import Image

from opsd.config import ModelConfig
from opsd.modeling import load_model, load_processor
from opsd.prompts import Prompt
from opsd.rollout.engine import SamplingSettings
from opsd.tiny_models import build_tiny_paddleocr_vl
from tests.helpers.logprobs import engine_logprobs, trainer_logprobs
from tests.helpers.tiny_inputs import vlm_messages


@pytest.mark.vllm
@pytest.mark.slow
def test_a_learned_position_grid_is_resampled_differently_by_transformers_and_vllm(tmp_path):
    from opsd.rollout.vllm_args import VLLMOptions
    from opsd.rollout.vllm_engine import VLLMEngine

    model_dir = build_tiny_paddleocr_vl(tmp_path / "paddle-grid-4", position_grid=4)  # 56 x 56 pixels
    processor = load_processor(ModelConfig(path=str(model_dir)))
    trainer = load_model(ModelConfig(path=str(model_dir)), processor, torch.device("cpu"))
    text = processor.apply_chat_template(vlm_messages(1), add_generation_prompt=True, tokenize=False)
    same_grid, other_grid = Prompt(text, [Image.new("RGB", (56, 56), (0, 170, 0))]), Prompt(text, [Image.new("RGB", (112, 60), (0, 170, 0))])
    engine = VLLMEngine(VLLMOptions(str(model_dir), dtype="float32", max_model_len=1024, kv_cache_memory_mb=64, enforce_eager=True))
    try:
        gaps = []
        for prompt in (same_grid, other_grid):
            completions = engine.generate([prompt], SamplingSettings(max_new_tokens=8, seed=3))
            gaps.append((trainer_logprobs(trainer, processor, [prompt], completions) - engine_logprobs(completions)).abs().max().item())
    finally:
        engine.close()
    assert gaps[0] < 1e-4, gaps  # 56 x 56 pixels: a 4 x 4 patch grid, the learned one, nothing resampled
    assert gaps[1] > 1e-3, gaps  # 112 x 60 -> 56 x 28 pixels: a 4 x 2 grid, resampled two ways
