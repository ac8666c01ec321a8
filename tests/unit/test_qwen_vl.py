"""Qwen2.5-VL and Qwen3-VL in the trainer: per-token processor outputs, 3-D (mrope) positions, DeepStack.

The processor returns `mm_token_type_ids` (one value per prompt id); the model derives its 3-D
rotary positions from it and `image_grid_thw`. Qwen3-VL also adds the outputs of early vision blocks
(DeepStack) to the image tokens' hidden states in the first text layers, matched to the image tokens
of the whole batch in order. Scoring a padded batch must give every row exactly what the model
computes for that row alone, unpadded, from the processor's own outputs.
"""

import pytest
import torch
from PIL import Image
from transformers.utils import is_torchvision_available

from opsd.config import ModelConfig
from opsd.modeling import load_model, load_processor
from opsd.prompts import Prompt
from opsd.scoring import completion_logits
from opsd.sequences import collate, encode_prompt
from opsd.tiny_models import QWEN_VL_IMAGE

# (image sizes, question, completion text): different prompt lengths, image counts and aspect ratios.
ROWS = [
    ([(112, 60), (40, 90)], "Which direction is the first move?", " The first move is right. <answer>right</answer>"),
    ([(56, 56)], "How many steps does the shortest path from the green square to the red square take?", " 4"),
    ([], "What is two plus three?", " The answer is 5. So the total is five."),
    ([(90, 30), (64, 64), (30, 100)], "Count the cells.", " six"),
]


# transformers' full processor needs torchvision for its video processor; without it (these CPU
# machines) opsd assembles an image-only one (opsd/vl_processor.py). The lent GPU machine has torchvision.
HAS_TORCHVISION = is_torchvision_available()

FAMILIES = {"qwen2.5-vl": ("tiny_qwen_vl_dir", "Qwen2_5_VLProcessor"), "qwen3-vl": ("tiny_qwen3_vl_dir", "Qwen3VLProcessor")}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    fixture, processor_class = FAMILIES[request.param]
    return request.param, request.getfixturevalue(fixture), processor_class


@pytest.fixture(scope="module")
def qwen(family):
    cfg = ModelConfig(path=str(family[1]))
    processor = load_processor(cfg)
    return processor, load_model(cfg, processor, torch.device("cpu")).eval()


def prompt_of(processor, sizes, question) -> Prompt:
    colors = [(0, 170, 0), (220, 0, 0), (30, 90, 255)]
    images = [Image.new("RGB", size, colors[i % 3]) for i, size in enumerate(sizes)]
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Think."}]}, {"role": "user", "content": content}]
    return Prompt(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), images)


def reference_logprobs(model, processor, prompt: Prompt, completion: str):
    """One unpadded `model(**inputs)` forward of prompt + completion, straight from the processor."""
    text = [prompt.text + completion]
    if prompt.images:
        inputs = processor(text=text, images=[prompt.images], return_tensors="pt")
    else:
        inputs = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")
    ids = inputs["input_ids"][0]
    n = len(processor.tokenizer(completion, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return ids[-n:].tolist(), logits[-n - 1 : -1].log_softmax(-1).gather(-1, ids[-n:, None])[:, 0]


def test_processor_is_image_only_and_returns_per_token_types(qwen):
    processor, _ = qwen
    assert (processor.video_processor is None) == (not HAS_TORCHVISION)
    encoded = encode_prompt(processor, prompt_of(processor, *ROWS[0][:2]))
    assert set(encoded.per_token) == {"mm_token_type_ids"}
    assert {"pixel_values", "image_grid_thw"} <= set(encoded.vision)
    types = encoded.per_token["mm_token_type_ids"]
    assert types.shape == (len(encoded.input_ids),)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert types.tolist() == [int(t == image_pad) for t in encoded.input_ids]
    assert QWEN_VL_IMAGE in prompt_of(processor, *ROWS[0][:2]).text


def test_collate_pads_per_token_outputs_to_the_batch(qwen):
    processor, _ = qwen
    prompts = [encode_prompt(processor, prompt_of(processor, sizes, q)) for sizes, q, _ in ROWS]
    completions = [[5] * (i + 1) for i in range(len(ROWS))]
    batch = collate(prompts, completions, pad_id=0)
    width = batch.inputs["input_ids"].shape[1]
    types = batch.inputs["mm_token_type_ids"]
    assert types.shape == (len(ROWS), width)
    for i, p in enumerate(prompts):
        expected = p.per_token["mm_token_type_ids"].tolist() if p.per_token else [0] * len(p.input_ids)
        assert types[i].tolist() == expected + [0] * (width - len(p.input_ids))
    # Flat patch tensors and the grids of all rows' images, in row order; the text row adds none.
    assert batch.inputs["image_grid_thw"].shape == (sum(len(sizes) for sizes, _, _ in ROWS), 3)
    assert batch.inputs["pixel_values"].shape[0] == sum(p.vision["pixel_values"].shape[0] for p in prompts if p.vision)


def test_padded_batch_scores_equal_one_unpadded_forward_per_row(qwen):
    processor, model = qwen
    tokenizer = processor.tokenizer
    prompts, completions, expected = [], [], []
    for sizes, question, completion in ROWS:
        prompt = prompt_of(processor, sizes, question)
        ids, logprobs = reference_logprobs(model, processor, prompt, completion)
        assert ids == tokenizer(completion, add_special_tokens=False)["input_ids"]  # same completion ids
        prompts.append(encode_prompt(processor, prompt))
        completions.append(ids)
        expected.append(logprobs)
    assert len({len(p.input_ids) for p in prompts}) == len(ROWS)  # every row pads differently
    batch = collate(prompts, completions, tokenizer.pad_token_id)
    text_inputs = _record_text_model_inputs(model)
    with torch.no_grad():
        logprobs = completion_logits(model, batch).log_softmax(-1).gather(-1, batch.completion_ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs, torch.cat(expected), atol=1e-5, rtol=0)
    if getattr(model.config.vision_config, "deepstack_visual_indexes", None):
        # DeepStack ran on every image token of the batch: one feature row per token, per merger.
        image_tokens = (batch.inputs["input_ids"] == model.config.image_token_id).sum().item()
        assert text_inputs["visual_pos_masks"].sum().item() == image_tokens
        deepstack = text_inputs["deepstack_visual_embeds"]
        assert len(deepstack) == len(model.config.vision_config.deepstack_visual_indexes) == 2
        assert all(d.shape[0] == image_tokens for d in deepstack)

    # The 3-D positions matter: with plain 1-D positions the scores differ.
    batch.inputs["position_ids"] = torch.arange(batch.inputs["input_ids"].shape[1]).expand_as(batch.inputs["input_ids"])
    with torch.no_grad():
        flat = completion_logits(model, batch).log_softmax(-1).gather(-1, batch.completion_ids[:, None])[:, 0]
    assert (flat - torch.cat(expected)).abs().max() > 1e-4


def _record_text_model_inputs(model) -> dict:
    """The keyword arguments of the language model's next forward (filled in when it runs)."""
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)
        handle.remove()

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_the_image_only_processor_saves_and_loads_back(qwen, family, tmp_path):
    import shutil

    _, model_dir, processor_class = family
    processor, _ = qwen
    processor.save_pretrained(tmp_path)  # what a checkpoint's model/ directory gets
    shutil.copy(model_dir / "config.json", tmp_path)
    again = load_processor(ModelConfig(path=str(tmp_path)))
    assert type(again).__name__ == processor_class and (again.video_processor is None) == (not HAS_TORCHVISION)
    prompt = prompt_of(processor, *ROWS[0][:2])
    assert prompt_of(again, *ROWS[0][:2]).text == prompt.text
    assert encode_prompt(again, prompt).input_ids == encode_prompt(processor, prompt).input_ids
