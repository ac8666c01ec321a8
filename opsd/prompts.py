"""Student and teacher prompts for one sample.

student: [system] [problem images] [question]
teacher: [system] [problem images] [question] [reference intro] [privileged images]
         [privileged text] [answer] [transition]
         (`prompts.images_after_text`: [privileged text] [reference intro] [privileged images];
         `prompts.privileged_before_question`: the privileged part before [question])

Both are rendered by the same chat template with the same settings (a different template setting
would shift the completion), and the sampled completion ids are later appended unchanged to both.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from opsd.config import PromptConfig
from opsd.data.sample import Sample


@dataclass
class Prompt:
    text: str
    """Chat-templated prompt, ending with the assistant turn's opening (generation prompt)."""
    images: list[Image.Image]
    """Images in the order their placeholders appear in `text`."""
    noise_last_images: int = 0
    """The last n images are privileged ones whose model inputs `encode_prompt` replaces with fresh
    standard normal noise (`prompts.noise: normal`); engines take `images` as they are."""
    system: str = ""
    """The system message `text` was rendered from."""
    parts: list[str | Image.Image] = field(default_factory=list)
    """The user turn `text` was rendered from: strings and images in order. An engine that changes a
    prompt (e.g. adds a suffix) renders the changed parts again with `render_prompt`."""


def is_multimodal(processor) -> bool:
    return hasattr(processor, "image_processor")


def tokenizer_of(processor):
    """The tokenizer of a model's processor; a text model's processor is its tokenizer."""
    return getattr(processor, "tokenizer", processor)


def placeholder_token_ids(processor) -> list[int]:
    """Ids of the special tokens that stand for images or videos (never to be sampled)."""
    tokenizer = tokenizer_of(processor)
    names = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    pattern = re.compile(r"image|img|vision|video", re.IGNORECASE)
    return sorted(tokenizer.convert_tokens_to_ids(n) for n in names if pattern.search(n))


def render_prompt(processor, system: str, parts: list[str | Image.Image]) -> Prompt:
    """Render a system message and a user turn (`parts`: strings and images in order) with the
    model's chat template, ending with the assistant turn's opening, as every opsd prompt is."""
    images = [p for p in parts if isinstance(p, Image.Image)]
    if is_multimodal(processor):
        # The template joins content parts as they are; a newline keeps text parts apart.
        content = [
            {"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": f"\n{p}" if i else p}
            for i, p in enumerate(parts)
        ]
        messages = [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": content},
        ]
    else:
        if images:
            raise ValueError("this model has no image processor, but the prompt holds images")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Prompt(text=text, images=images, system=system, parts=list(parts))


def student_prompt(sample: Sample, processor, cfg: PromptConfig) -> Prompt:
    return render_prompt(processor, cfg.system, [*sample.images, sample.question])


def teacher_prompt(sample: Sample, processor, cfg: PromptConfig) -> Prompt:
    parts, privileged_images = teacher_parts(sample, cfg)
    prompt = render_prompt(processor, cfg.system, parts)
    if cfg.noise == "normal":
        prompt.noise_last_images = len(privileged_images)
    return prompt


def teacher_parts(sample: Sample, cfg: PromptConfig) -> tuple[list[str | Image.Image], list[Image.Image]]:
    """The teacher's user turn (strings and images in order), and the privileged images in it."""
    privileged_images = sample.privileged_images if "images" in cfg.privileged else []
    if cfg.noise != "off":
        privileged_images = [noise_like(img, seed=f"{sample.id}/{i}") for i, img in enumerate(privileged_images)]
    image_parts = [cfg.reference_intro, *privileged_images] if privileged_images else []
    text_parts = [f"{cfg.privileged_text_intro}\n{sample.privileged_text}"] if (
        "text" in cfg.privileged and sample.privileged_text) else []
    if cfg.images_after_text:
        privileged = text_parts + image_parts
    else:
        privileged = image_parts + text_parts
    if "answer" in cfg.privileged and sample.answer:
        privileged += [f"Reference answer: {sample.answer}"]
    privileged = [p for p in privileged if p != ""]  # an empty intro adds no blank line
    if cfg.privileged_before_question:
        parts = [*sample.images, *privileged, sample.question]
    else:
        parts = [*sample.images, sample.question, *privileged]
    if cfg.transition:
        parts.append(cfg.transition)
    return parts, privileged_images


def describe_prompts(sample: Sample, cfg: PromptConfig, *, width: int = 72) -> str:
    """Both prompts of `sample` as the plan shows them: the system message (up to 3 x `width`
    characters: it sets the answer format) and each part of the user turn before the chat template,
    cut to `width` characters, images as `<image>` (privileged ones `<privileged image>`), parts
    separated by ` | `."""
    def clip(text: str, width: int = width) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    def outline(parts: list) -> str:
        problem = {id(image) for image in sample.images}
        return " | ".join(clip(p) if isinstance(p, str) else "<image>" if id(p) in problem else "<privileged image>"
                          for p in parts)

    return "\n".join([
        f"  first sample {sample.id!r}, before the chat template:",
        f"    system:  {clip(cfg.system, 3 * width)}",
        f"    student: {outline([*sample.images, sample.question])}",
        f"    teacher: {outline(teacher_parts(sample, cfg)[0])}",
    ])


def noise_like(image: Image.Image, *, seed: str) -> Image.Image:
    """Gaussian noise image of the same size and mode, deterministic per (sample, index): the
    `pixel` ablation, and what engines see under the `normal` one."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little"))
    shape = np.asarray(image).shape
    pixels = np.clip(rng.normal(127.5, 64.0, size=shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)
