"""Tiny random models for tests and CPU demos, built locally in about a second.

`build_tiny_vlm` writes an Idefics3 (SmolVLM architecture) directory, `build_tiny_paddleocr_vl` a
PaddleOCR-VL one (NaViT vision tower, 3-D "mrope" positions; served by vLLM on CPU too),
`build_tiny_qwen25_vl` a Qwen2.5-VL one and `build_tiny_qwen3_vl` a Qwen3-VL one (3-D positions;
transformers only, vLLM's Qwen-VL needs torchvision) and `build_tiny_text_model` a Qwen2 one. All
five are ordinary Hugging Face directories (safetensors, config, generation config, tokenizer with a
ChatML chat template; processor config for the VLMs) that load in transformers and, the Qwen-VL ones
excepted, in vLLM. Nothing is downloaded: the byte-level BPE tokenizer is trained here on a small built-in
corpus, and the weights are random from `seed`.

Choices that matter downstream:
- The tokenizer adds no BOS/EOS; the chat template carries every special token, so the templated
  prompt text tokenizes to the same ids in transformers and vLLM.
- EOS is `<|im_end|>`, pad is `<|endoftext|>`.
- Idefics3 images are resized to 56x56 without splitting: each image becomes
  `<fake_token_around_image><global-img>` + 4 x `<image>` + `<fake_token_around_image>`.
- PaddleOCR-VL images keep their aspect ratio within 28x28 to 56x56 pixels (multiples of 28): each
  becomes `<|IMAGE_START|>` + 1 to 4 x `<|IMAGE_PLACEHOLDER|>` + `<|IMAGE_END|>`.
- Qwen2.5-VL images keep their aspect ratio within 28x28 to 56x56 pixels (multiples of 28), Qwen3-VL
  ones within 32x32 to 64x64 (multiples of 32: patch 16): each becomes `<|vision_start|>` + 1 to 4 x
  `<|image_pad|>` + `<|vision_end|>`.
- head_dim is 32, the smallest the vLLM CPU attention backend accepts.
- Embeddings are untied, so HF and vLLM never disagree about which weights are shared.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PaddleOCRVLConfig,
    PaddleOCRVLForConditionalGeneration,
    PaddleOCRVLProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import PaddleOCRVLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from opsd.vl_processor import image_only_processor

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IMAGE_SPECIALS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # expanded by the processor per image
EOS, PAD = "<|im_end|>", "<|endoftext|>"

IMAGE_SIZE, PATCH_SIZE, SCALE_FACTOR = 56, 14, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # <image> tokens per image: 4

# ChatML. Content is a string or a list of {"type": "image"} / {"type": "text", "text": ...} parts;
# an image part becomes the processor's "<image>" placeholder, expanded later by the processor.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN_VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("'<image>'", repr(QWEN_VL_IMAGE))
PADDLE_SPECIALS = {  # PaddleOCR-VL's processor reads the image token from the tokenizer by name
    "image_token": "<|IMAGE_PLACEHOLDER|>", "image_start_token": "<|IMAGE_START|>",
    "image_end_token": "<|IMAGE_END|>", "video_token": "<|video_pad|>",
}
PADDLE_IMAGE = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"  # expanded by the processor per image

# Built-in BPE corpus: the vocabulary of the synthetic tasks and the prompts, plus common English.
_CORPUS = """
You are a careful problem solver. Think step by step inside <think></think>, then give the final
answer inside <answer></answer>. You are a helpful assistant.
The following images are privileged visual references depicting intermediate visual thoughts on
the path to the correct answer. Use them silently; do not describe or echo them.
Now, using your own independent reasoning, answer the problem above. Think step by step.
Privileged reference solution (use it silently): Reference answer: 3
The grid shows a small maze. The green square is the start and the red square is the goal. Dark
cells are walls. Moving one cell at a time up, down, left or right and never entering a wall, how
many steps does the shortest path from the green square to the red square take?
Which direction is the first move of the shortest path? Answer with one word: up, down, left or right.
Move right to (1,2). Move down to (2,2). Move left to (2,1). Move up to (1,1). The path takes 5 steps.
The first move is right. The answer is 4. So the shortest path has 6 steps in total.
the a an and or of to in on at is are was be it this that with for from by as not no yes we you
I my our its if then so but all each every one two three four five six seven eight nine ten zero
up down left right step steps path maze grid cell cells square squares row rows column columns
start goal wall walls answer think first last next move moves shortest longest reach must only how
many which what where direction green red blue gray black white image images picture visual
thought thoughts reference problem question solution final reasoning count number total line lines
about after again also any back because before between both can could did do does each even find
get give go good had has have he her here him his into just know like look make more most much
need new now old other out over own part put said same see she should show some such take than
their them there these they thing think those through time too under until use used very want way
well were when while who why will would write year yes your correct wrong true false check again
"""


def _corpus() -> list[str]:
    lines = [line.strip() for line in _CORPUS.strip().splitlines()]
    lines += [" ".join(str(i) for i in range(j, j + 10)) for j in range(0, 100, 10)]
    lines += [" ".join(f"({r},{c})" for c in range(8)) for r in range(8)]
    lines += ["system", "user", "assistant"] * 4  # role names as they start a ChatML turn
    return lines


def build_tokenizer(
    *, extra_specials: tuple[str, ...] = (), vocab_size: int = 1024, template: str = CHAT_TEMPLATE,
    named_specials: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with ChatML specials on the built-in corpus (deterministic, ~10 ms).

    `named_specials` (e.g. `{"image_token": "<|IMAGE_PLACEHOLDER|>"}`, all among `extra_specials`)
    become tokenizer attributes, as some processors read them (`tokenizer.image_token`)."""
    tok = Tokenizer(models.BPE())
    # Qwen2's exact pipeline: AutoTokenizer rebuilds it for a qwen2 config whatever tokenizer.json
    # says, so any other pipeline would tokenize differently once saved and reloaded.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*CHAT_SPECIALS, *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    # No post-processor: nothing is added around the text, the chat template holds the specials.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=dict(named_specials) if named_specials else list(extra_specials),
        chat_template=template,
        model_max_length=4096,
    )


def _generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )


LARGE = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3, num_attention_heads=6)
"""The decoder of the `-large` builds (a teacher of another depth and width, the same tokenizer)."""


def _text_kwargs(tokenizer, large: bool = False, extra_vocab_rows: int = 0) -> dict:
    """Shape shared by both text decoders: hidden 128, 2 layers, 4 heads of 32, 2 KV heads (`large`:
    hidden 192, 3 layers, 6 heads of 32); `extra_vocab_rows` pads the embeddings and LM head beyond
    the tokenizer's vocabulary, as hub models pad theirs."""
    return dict(
        vocab_size=len(tokenizer) + extra_vocab_rows,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        # 5x the usual 0.02: logits get std ~1 (entropy ~6.1 of 6.7 nats), so outputs depend on the
        # prompt and images instead of being near-uniform noise, yet sampling stays varied.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ) | (LARGE if large else {})


def _prepare(out_dir, marker: dict, overwrite: bool) -> tuple[pathlib.Path, bool]:
    """Return (dir, reuse): reuse an identical earlier build, refuse to clobber anything else."""
    out = pathlib.Path(out_dir)
    marker_path = out / "tiny_model.json"
    if out.exists() and any(out.iterdir()):
        if overwrite:
            shutil.rmtree(out)
        elif marker_path.exists() and json.loads(marker_path.read_text()) == marker:
            return out, True
        else:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
    out.mkdir(parents=True, exist_ok=True)
    return out, False


def _save_random_model(model_class, config, tokenizer, seed: int, out: pathlib.Path) -> None:
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out)


def _finish(out: pathlib.Path, marker: dict) -> pathlib.Path:
    # Written last, so a half-written directory is never mistaken for a finished build.
    (out / "tiny_model.json").write_text(json.dumps(marker))
    return out


def build_tiny_text_model(out_dir, *, seed: int = 0, overwrite: bool = False, large: bool = False,
                          extra_vocab_rows: int = 0) -> pathlib.Path:
    """Write a tiny random Qwen2 causal LM (about 0.5M parameters) with its tokenizer; `large`: a
    deeper and wider one (about 1.2M) with the same tokenizer; `extra_vocab_rows`: padding rows in
    the embeddings and LM head."""
    marker = {"kind": "tiny-qwen2", "seed": seed, "version": 1}
    if large or extra_vocab_rows:
        marker |= {"large": large, "extra_vocab_rows": extra_vocab_rows}
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    tokenizer = build_tokenizer()
    config = Qwen2Config(**_text_kwargs(tokenizer, large, extra_vocab_rows), use_sliding_window=False)
    _save_random_model(Qwen2ForCausalLM, config, tokenizer, seed, out)
    tokenizer.save_pretrained(out)
    return _finish(out, marker)


def build_tiny_vlm(out_dir, *, seed: int = 0, overwrite: bool = False, large: bool = False) -> pathlib.Path:
    """Write a tiny random Idefics3 VLM (about 0.64M parameters) with its processor; `large`: a deeper
    and wider decoder (about 1.3M parameters) with the same tokenizer, vision tower shape and processor."""
    marker = {"kind": "tiny-idefics3", "seed": seed, "version": 1} | ({"large": True} if large else {})
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    tokenizer = build_tokenizer(extra_specials=IMAGE_SPECIALS)
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        text_config=dict(model_type="llama", **_text_kwargs(tokenizer, large)),
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    _save_random_model(Idefics3ForConditionalGeneration, config, tokenizer, seed, out)
    # Fixed 56x56 input, no tiling: every image costs the same small number of tokens.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(
        image_processor, tokenizer, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    return _finish(out, marker)


def _qwen_vl_token_ids(tokenizer) -> dict:
    token = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def _build_tiny_qwen_vl(out_dir, marker: dict, overwrite: bool, seed: int, *, config_class, model_class,
                        processor_class, rope: dict, vision: dict, patch_unit: int) -> pathlib.Path:
    """A tiny Qwen-VL of either generation: a text model of `_text_kwargs` with 3-D rotary positions
    (`rope`), the vision tower `vision`, and an image-only processor taking 1 to 4 image tokens per
    image: `patch_unit` (patch x merge) to 2 x `patch_unit` pixels a side, any aspect ratio."""
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    tokenizer = build_tokenizer(extra_specials=QWEN_VL_SPECIALS, template=QWEN_VL_CHAT_TEMPLATE)
    text = _text_kwargs(tokenizer)
    config = config_class(
        text_config=dict(**text, rope_parameters=rope),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"],
                           patch_size=patch_unit // 2, spatial_merge_size=2, temporal_patch_size=2, **vision),
        **_qwen_vl_token_ids(tokenizer),
    )
    _save_random_model(model_class, config, tokenizer, seed, out)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_unit // 2, merge_size=2, temporal_patch_size=2,
        min_pixels=patch_unit**2, max_pixels=(2 * patch_unit) ** 2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    image_only_processor(processor_class, image_processor, tokenizer).save_pretrained(out)
    return _finish(out, marker)


def build_tiny_qwen25_vl(out_dir, *, seed: int = 0, overwrite: bool = False) -> pathlib.Path:
    """Write a tiny random Qwen2.5-VL (about 0.76M parameters) with its image-only processor.

    The shapes keep what makes the family different: 3-D rotary positions (mrope sections 4+6+6 =
    head_dim / 2), window attention in the vision tower with one full-attention block, 2x2 patch
    merging, and images of any aspect ratio as flat patch tensors with `image_grid_thw`.
    """
    return _build_tiny_qwen_vl(
        out_dir, {"kind": "tiny-qwen2.5-vl", "seed": seed, "version": 1}, overwrite, seed,
        config_class=Qwen2_5_VLConfig, model_class=Qwen2_5_VLForConditionalGeneration, processor_class=Qwen2_5_VLProcessor,
        rope={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        vision=dict(window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
        patch_unit=PATCH_SIZE * 2,
    )


def build_tiny_qwen3_vl(out_dir, *, seed: int = 0, overwrite: bool = False) -> pathlib.Path:
    """Write a tiny random Qwen3-VL (about 0.97M parameters) with its image-only processor.

    What Qwen3-VL adds to Qwen2.5-VL is kept: interleaved 3-D rotary sections (6+5+5 = head_dim / 2),
    patch 16 with a learned position grid (4x4 here) resampled to each image, and DeepStack: the
    outputs of vision blocks 0 and 1, each through its own merger, are added to the hidden states of
    the image tokens after text layers 0 and 1.
    """
    return _build_tiny_qwen_vl(
        out_dir, {"kind": "tiny-qwen3-vl", "seed": seed, "version": 1}, overwrite, seed,
        config_class=Qwen3VLConfig, model_class=Qwen3VLForConditionalGeneration, processor_class=Qwen3VLProcessor,
        rope={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        vision=dict(num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        patch_unit=32,
    )


def build_tiny_paddleocr_vl(out_dir, *, seed: int = 0, overwrite: bool = False, position_grid: int = 1) -> pathlib.Path:
    """Write a tiny random PaddleOCR-VL (about 0.7M parameters) with its processor.

    The family vLLM serves on CPU that is closest to Qwen-VL: a NaViT (SigLIP) vision tower on
    images of any aspect ratio as flat patches with `image_grid_thw`, 2-D rotary positions in the
    tower, a 2x2-merging projector, and an ERNIE-4.5 text model with 3-D "mrope" positions
    (sections 4+6+6 = head_dim / 2) from the processor's `mm_token_type_ids`.

    The learned position grid is `position_grid` x `position_grid` patches, 1 by default:
    transformers 5.19 resamples the grid to each image with `align_corners=True`, vLLM 0.32 with
    `align_corners=False`, so with a larger grid trainer and engine disagree on every image whose
    patch grid differs from it (measured in tests/integration/test_paddleocr_vl_vllm.py). A single
    position vector resamples to itself either way; positions still reach the tower through its
    rotary embeddings.
    """
    marker = {"kind": "tiny-paddleocr-vl", "seed": seed, "version": 1, "position_grid": position_grid}
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    template = CHAT_TEMPLATE.replace("'<image>'", repr(PADDLE_IMAGE))
    tokenizer = build_tokenizer(extra_specials=tuple(PADDLE_SPECIALS.values()), template=template, named_specials=PADDLE_SPECIALS)
    token = tokenizer.convert_tokens_to_ids
    text = _text_kwargs(tokenizer)
    config = PaddleOCRVLConfig(
        text_config=dict(**text, use_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 6, 6]}),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=PATCH_SIZE, image_size=position_grid * PATCH_SIZE, spatial_merge_size=2),
        image_token_id=token(PADDLE_SPECIALS["image_token"]),
        video_token_id=token(PADDLE_SPECIALS["video_token"]),
        vision_start_token_id=token(PADDLE_SPECIALS["image_start_token"]),
        vision_end_token_id=token(PADDLE_SPECIALS["image_end_token"]),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    _save_random_model(PaddleOCRVLForConditionalGeneration, config, tokenizer, seed, out)
    image_processor = PaddleOCRVLImageProcessorPil(
        min_pixels=(2 * PATCH_SIZE) ** 2, max_pixels=IMAGE_SIZE**2, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    PaddleOCRVLProcessor(image_processor, tokenizer, chat_template=template).save_pretrained(out)
    return _finish(out, marker)
