"""Tiny random models for tests and CPU demos, built locally in about a second.

`build_tiny_vlm` writes an Idefics3 (SmolVLM architecture) directory, `build_tiny_qwen25_vl` a
Qwen2.5-VL one (3-D "mrope" positions; transformers only, vLLM's Qwen-VL needs torchvision) and
`build_tiny_text_model` a Qwen2 one. All three are ordinary Hugging Face directories (safetensors,
config, generation config, tokenizer with a ChatML chat template; processor config for the VLMs)
that load in transformers and, the Qwen2.5-VL one excepted, in vLLM. Nothing is downloaded: the byte-level BPE tokenizer is trained here on a small built-in
corpus, and the weights are random from `seed`.

Choices that matter downstream:
- The tokenizer adds no BOS/EOS; the chat template carries every special token, so the templated
  prompt text tokenizes to the same ids in transformers and vLLM.
- EOS is `<|im_end|>`, pad is `<|endoftext|>`.
- Idefics3 images are resized to 56x56 without splitting: each image becomes
  `<fake_token_around_image><global-img>` + 4 x `<image>` + `<fake_token_around_image>`.
- Qwen2.5-VL images keep their aspect ratio within 28x28 to 56x56 pixels (multiples of 28): each
  becomes `<|vision_start|>` + 1 to 4 x `<|image_pad|>` + `<|vision_end|>`.
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
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2ForCausalLM,
)
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
    *, extra_specials: tuple[str, ...] = (), vocab_size: int = 1024, template: str = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with ChatML specials on the built-in corpus (deterministic, ~10 ms)."""
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
        extra_special_tokens=list(extra_specials),
        chat_template=template,
        model_max_length=4096,
    )


def _generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )


def _text_kwargs(tokenizer) -> dict:
    """Shape shared by both text decoders: hidden 128, 2 layers, 4 heads of 32, 2 KV heads."""
    return dict(
        vocab_size=len(tokenizer),
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
    )


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


def build_tiny_text_model(out_dir, *, seed: int = 0, overwrite: bool = False) -> pathlib.Path:
    """Write a tiny random Qwen2 causal LM (about 0.5M parameters) with its tokenizer."""
    marker = {"kind": "tiny-qwen2", "seed": seed, "version": 1}
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    tokenizer = build_tokenizer()
    config = Qwen2Config(**_text_kwargs(tokenizer), use_sliding_window=False)
    _save_random_model(Qwen2ForCausalLM, config, tokenizer, seed, out)
    tokenizer.save_pretrained(out)
    return _finish(out, marker)


def build_tiny_vlm(out_dir, *, seed: int = 0, overwrite: bool = False) -> pathlib.Path:
    """Write a tiny random Idefics3 VLM (about 0.64M parameters) with its processor."""
    marker = {"kind": "tiny-idefics3", "seed": seed, "version": 1}
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
        text_config=dict(model_type="llama", **_text_kwargs(tokenizer)),
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


def build_tiny_qwen25_vl(out_dir, *, seed: int = 0, overwrite: bool = False) -> pathlib.Path:
    """Write a tiny random Qwen2.5-VL (about 0.76M parameters) with its image-only processor.

    The shapes keep what makes the family different: 3-D rotary positions (mrope sections 4+6+6 =
    head_dim / 2), window attention in the vision tower with one full-attention block, 2x2 patch
    merging, and images of any aspect ratio as flat patch tensors with `image_grid_thw`.
    """
    marker = {"kind": "tiny-qwen2.5-vl", "seed": seed, "version": 1}
    out, reuse = _prepare(out_dir, marker, overwrite)
    if reuse:
        return out
    tokenizer = build_tokenizer(extra_specials=QWEN_VL_SPECIALS, template=QWEN_VL_CHAT_TEMPLATE)
    token = tokenizer.convert_tokens_to_ids
    text = _text_kwargs(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(**text, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
        vision_config=dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"],
            patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
            fullatt_block_indexes=[1], tokens_per_second=2,
        ),
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    _save_random_model(Qwen2_5_VLForConditionalGeneration, config, tokenizer, seed, out)
    # 28x28 to 56x56 pixels: 1 to 4 image tokens per image, varying with the aspect ratio.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=IMAGE_SIZE * IMAGE_SIZE, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    image_only_processor(Qwen2_5_VLProcessor, image_processor, tokenizer).save_pretrained(out)
    return _finish(out, marker)
