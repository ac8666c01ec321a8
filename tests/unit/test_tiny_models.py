"""The tiny local models load in transformers: chat template, processor, tokenizer, forward, builds."""

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from opsd.tiny_models import IMAGE_SEQ_LEN, build_tiny_text_model, build_tiny_vlm
from tests.helpers.tiny_inputs import SYSTEM, images, vlm_messages


@pytest.fixture(scope="module")
def vlm_dir(tiny_vlm_dir):
    return tiny_vlm_dir


@pytest.fixture(scope="module")
def text_dir(tiny_text_dir):
    return tiny_text_dir

def test_chat_template_is_chatml_with_image_placeholders(vlm_dir):
    processor = AutoProcessor.from_pretrained(vlm_dir)
    text = processor.apply_chat_template(vlm_messages(1), add_generation_prompt=True, tokenize=False)
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\n<image>How many steps?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = processor.tokenizer(text).input_ids
    assert processor.tokenizer.decode(ids) == text


def test_processor_expands_each_image(vlm_dir):
    processor = AutoProcessor.from_pretrained(vlm_dir)
    tok = processor.tokenizer
    for n in (1, 3):
        text = processor.apply_chat_template(vlm_messages(n), add_generation_prompt=True, tokenize=False)
        assert text.count("<image>") == n
        enc = processor(text=text, images=images(n), return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        assert ids.count(tok.convert_tokens_to_ids("<image>")) == n * IMAGE_SEQ_LEN == n * 4
        assert ids.count(tok.convert_tokens_to_ids("<fake_token_around_image>")) == 2 * n
        assert ids.count(tok.convert_tokens_to_ids("<global-img>")) == n
        assert list(enc["pixel_values"].shape[:2]) == [1, n]  # no splitting: one 56x56 tile per image


@pytest.mark.parametrize("which", ["vlm", "text"])
def test_tokenizer_adds_no_specials_and_matches_tokenizer_json(which, vlm_dir, text_dir):
    model_dir = vlm_dir if which == "vlm" else text_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "<|im_start|>user\nMove right to (1,2). The path takes 12 steps.<|im_end|>\n"
    ids = tok(text).input_ids
    assert ids == tok(text, add_special_tokens=False).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-2] == tok.eos_token_id
    # AutoTokenizer may rebuild the pipeline from the model type (qwen2 does); ids must not change.
    assert ids == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def test_vlm_forward_is_finite(vlm_dir):
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    text = processor.apply_chat_template(vlm_messages(2), add_generation_prompt=True, tokenize=False)
    enc = processor(text=text, images=images(2), return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


def test_text_model_forward_is_finite(text_dir):
    tok = AutoTokenizer.from_pretrained(text_dir)
    model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(**tok(text, return_tensors="pt")).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


@pytest.mark.parametrize("build", [build_tiny_vlm, build_tiny_text_model])
def test_build_is_deterministic_and_reusable(build, tmp_path):
    a = build(tmp_path / "a", seed=1)
    b = build(tmp_path / "b", seed=1)
    c = build(tmp_path / "c", seed=2)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert build(a, seed=1) == a  # same spec: reused as is
    with pytest.raises(FileExistsError):
        build(a, seed=2)
    build(a, seed=2, overwrite=True)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()


def test_transformers_warning_about_its_own_default_idefics3_config_is_dropped():
    """Every Idefics3 load (tiny VLM, SmolVLM; --dry-run too) made transformers warn about the default
    Idefics3Config it diffs against (pad_token_id 128002 > its 32000-token vocabulary); opsd drops that
    one message, the same warning about another config still shows."""
    import logging

    import opsd.modeling  # noqa: F401  (installs the filter)
    from opsd.modeling import DefaultConfigWarning

    logger = logging.getLogger("transformers.configuration_utils")
    def record(message):
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, message, (), None)

    assert not logger.filter(record(DefaultConfigWarning.MESSAGE + " This may result in unexpected behavior."))
    assert logger.filter(record(DefaultConfigWarning.MESSAGE.replace("got 128002", "got 900")))
