"""Forward sequences: a prompt's ids (with its vision inputs) followed by the sampled completion ids.

The completion ids are appended unchanged to the student's and the teacher's prompt: re-tokenising
the completion text could change the ids, and the two spans must match token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opsd.data.errors import BadSample
from opsd.data.sample import Sample
from opsd.prompts import Prompt, teacher_prompt, tokenizer_of


@dataclass
class EncodedPrompt:
    input_ids: list[int]
    """Fully expanded ids, as the model sees them (image placeholders expanded)."""
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    """Processor outputs about the images (pixel values, masks, `image_grid_thw`), batch dimension 1
    for per-image tensors, none for flat patch tensors (see `flat_patches`)."""
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other processor outputs with one value per id (Qwen-VL's `mm_token_type_ids`), 1-D."""


def encode_prompt(processor, prompt: Prompt) -> EncodedPrompt:
    """Ids and vision inputs; the prompt's `noise_last_images` get fresh noise from the torch RNG."""
    if prompt.images:
        out = processor(text=[prompt.text], images=[prompt.images], return_tensors="pt")
        ids = out["input_ids"][0]
        rest = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        # [1, prompt length] outputs follow the ids (and must be padded like them in a batch).
        per_token = {k: v[0] for k, v in rest.items() if v.dim() == 2 and v.shape == out["input_ids"].shape}
        vision = {k: v for k, v in rest.items() if k not in per_token}
        if prompt.noise_last_images:
            vision["pixel_values"] = noise_last_images(processor, vision["pixel_values"], prompt)
        return EncodedPrompt(ids.tolist(), vision, per_token)
    return EncodedPrompt(tokenizer_of(processor)(prompt.text, add_special_tokens=False)["input_ids"])


def noise_last_images(processor, pixel_values: torch.Tensor, prompt: Prompt) -> torch.Tensor:
    """`pixel_values` with the entries of the prompt's last `noise_last_images` images replaced by
    standard normal noise: the reference ablation, in the processor's normalised (model-input) space.

    Their entries are the trailing ones; how many (tiles, patches) the processor's own output for
    those images alone says.
    """
    noised = prompt.images[len(prompt.images) - prompt.noise_last_images :]
    out = processor.image_processor(images=[noised], return_tensors="pt")
    alone = out["pixel_values"]
    dim = 0 if flat_patches(out) else 1  # flat Qwen-VL patches; Idefics-style [1, n, C, H, W]
    count = alone.shape[dim]
    out = pixel_values.clone()
    target = out.narrow(dim, out.shape[dim] - count, count)
    target.copy_(torch.randn(target.shape, dtype=target.dtype))
    return out


def flat_patches(vision) -> bool:
    """Whether the images are flat patch tensors of all images one after the other (Qwen-VL,
    PaddleOCR-VL: `[patches, ...]` beside `image_grid_thw`), concatenated along dim 0 in a batch,
    rather than per-sequence tensors with a batch dimension (Idefics3: `[1, images, C, H, W]`)."""
    return "image_grid_thw" in vision


@dataclass
class ForwardBatch:
    inputs: dict[str, torch.Tensor]
    """Model inputs: right-padded `input_ids`, `attention_mask` (and `position_ids` for packed rows),
    and vision tensors."""
    completion_positions: torch.Tensor
    """[N] flat indices into the [B * L] positions: the one whose next-token logits predict each
    completion token (a packed prompt's last position predicts the first token of every completion)."""
    completion_ids: torch.Tensor
    """[N] the completion tokens, in the order of the examples given to `collate`."""

    @property
    def num_tokens(self) -> int:
        return self.completion_ids.numel()


def _pad_images(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack [1, n_i, ...] per-sequence image tensors to [B, max n, ...] with all-zero padding images."""
    most = max(t.shape[1] for t in tensors)
    out = tensors[0].new_zeros((len(tensors), most, *tensors[0].shape[2:]))
    for i, t in enumerate(tensors):
        out[i, : t.shape[1]] = t[0]
    return out


def collate(
    prompts: list[EncodedPrompt], completions: list[list[int]], pad_id: int, *, packed_row_tokens: int | None = None,
) -> ForwardBatch:
    """Right-pad `prompt + completion` sequences into one batch.

    `packed_row_tokens`: completions of one prompt (the same `EncodedPrompt` object, as
    `build_examples` pairs a prompt's samples) share rows of up to this many tokens, the prompt once
    in each, every completion attending to the prompt and to itself (`collate_shared_prompts`).
    """
    if packed_row_tokens and shares_a_prompt(prompts):
        return collate_shared_prompts(prompts, completions, pad_id, packed_row_tokens)
    rows = [p.input_ids + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = []
    for i, (row, p, c) in enumerate(zip(rows, prompts, completions)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        positions.extend(range(i * width + len(p.input_ids) - 1, i * width + len(row) - 1))
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    for key in dict.fromkeys(k for p in prompts for k in p.per_token):
        # Prompt values, then zeros (text) for the completion, the padding and rows without images.
        first = next(p.per_token[key] for p in prompts if key in p.per_token)
        inputs[key] = first.new_zeros((len(rows), width))
        for i, p in enumerate(prompts):
            if key in p.per_token:
                inputs[key][i, : len(p.input_ids)] = p.per_token[key]
    inputs.update(vision_inputs(prompts))
    return ForwardBatch(inputs, torch.tensor(positions, dtype=torch.long), _flat(completions))


def vision_inputs(row_prompts: list[EncodedPrompt]) -> dict[str, torch.Tensor]:
    """The batch's vision tensors, given the prompt of each row in order."""
    inputs = {}
    with_images = [p.vision for p in row_prompts if p.vision]
    if with_images:
        for key, first in with_images[0].items():
            if flat_patches(with_images[0]):
                # Flat patch tensors (Qwen-VL style) concatenate along dim 0; text rows add none.
                inputs[key] = torch.cat([v[key] for v in with_images])
            else:
                # Idefics-style [1, n_images, C, H, W] is padded per image with all-zero images,
                # which the model skips; a text-only row (a dataset mixture) holds only padding.
                empty = first.new_zeros((1, 0, *first.shape[2:]))
                inputs[key] = _pad_images([p.vision.get(key, empty) for p in row_prompts])
    return inputs


def shares_a_prompt(prompts: list[EncodedPrompt]) -> bool:
    """Whether packing applies and may save anything: one prompt holds several completions, and the
    prompts are text or hold per-row images (Idefics-style), whose image tokens a packed row holds
    once, as its prompt does."""
    if any(p.per_token or (p.vision and flat_patches(p.vision)) for p in prompts):
        return False  # per-token inputs and flat patches come with models that compute their own positions
    return len({id(p) for p in prompts}) < len(prompts)


def collate_shared_prompts(
    prompts: list[EncodedPrompt], completions: list[list[int]], pad_id: int, max_row_tokens: int,
) -> ForwardBatch:
    """Rows `prompt + completion_1 + completion_2 + ...`, each completion at the positions it would
    have after the prompt alone and attending only to the prompt and to itself (a [B, 1, L, L]
    boolean mask), so its logits are those of its own `prompt + completion`.

    The prompt is computed once per row instead of once per sample. A row holds the completions of
    one prompt that fit in `max_row_tokens` (at least one): attention is quadratic in a row's length,
    and the budget that bounds a sequence's memory bounds a packed row's too. A row's images are its
    prompt's (`shares_a_prompt`).
    """
    rows: list[list[int]] = []  # example indices per row, in order of first appearance
    open_row: dict[int, int] = {}  # id(prompt) -> the row its next completion may join
    for i, p in enumerate(prompts):
        r = open_row.get(id(p))
        if r is None or len(p.input_ids) + sum(len(completions[j]) for j in rows[r]) + len(completions[i]) > max_row_tokens:
            r = open_row[id(p)] = len(rows)
            rows.append([])
        rows[r].append(i)
    lengths = [len(prompts[g[0]].input_ids) + sum(len(completions[i]) for i in g) for g in rows]
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)  # 0 prompt, k completion k, -1 padding
    # Per example, flat positions: its prompt's last one (predicts its first token), where it begins.
    anchors: list[tuple[int, int]] = [(0, 0)] * len(prompts)
    for r, group in enumerate(rows):
        prompt = prompts[group[0]].input_ids
        input_ids[r, : len(prompt)] = torch.tensor(prompt)
        position_ids[r, : len(prompt)] = torch.arange(len(prompt))
        segment[r, : len(prompt)] = 0
        start = len(prompt)
        for k, i in enumerate(group, start=1):
            c = completions[i]
            input_ids[r, start : start + len(c)] = torch.tensor(c, dtype=torch.long)
            position_ids[r, start : start + len(c)] = torch.arange(len(prompt), len(prompt) + len(c))
            segment[r, start : start + len(c)] = k
            anchors[i] = (r * width + len(prompt) - 1, r * width + start)
            start += len(c)
    positions = []
    for (prompt_last, begin), c in zip(anchors, completions):
        positions.extend([prompt_last, *range(begin, begin + len(c) - 1)])
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (query != -1) & (key != -1) & ((key == 0) | (key == query))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no all-masked row (NaN)
    inputs = {"input_ids": input_ids, "attention_mask": allowed[:, None], "position_ids": position_ids}
    inputs.update(vision_inputs([prompts[group[0]] for group in rows]))
    return ForwardBatch(inputs, torch.tensor(positions, dtype=torch.long), _flat(completions))


def _flat(completions: list[list[int]]) -> torch.Tensor:
    return torch.tensor([t for c in completions for t in c], dtype=torch.long)


def prompt_length_check(processor, prompt_cfg, max_forward_tokens: int):
    """A check raising `BadSample("prompt_too_long")` when a sample's teacher prompt leaves no room
    for a completion within `max_forward_tokens` (the engine would refuse it, and there would be
    nothing to train on). The teacher prompt holds the student's and more, so it is the one measured.
    """

    def check(sample: Sample) -> None:
        length = len(encode_prompt(processor, teacher_prompt(sample, processor, prompt_cfg)).input_ids)
        if length >= max_forward_tokens:
            raise BadSample("prompt_too_long", f"teacher prompt of {length} tokens >= train.max_forward_tokens={max_forward_tokens}")

    return check


def completion_budget(student: EncodedPrompt, teacher: EncodedPrompt, max_forward_tokens: int) -> int:
    """How many completion tokens fit so that the longer of the two sequences stays in budget."""
    return max(0, max_forward_tokens - max(len(student.input_ids), len(teacher.input_ids)))


@dataclass
class Example:
    """One sampled completion with the student's and the teacher's prompt around it."""

    sample_id: str
    student: EncodedPrompt
    teacher: EncodedPrompt
    completion_ids: list[int]
    engine_logprobs: list[float]
    advantage: float = 0.0
    """The completion's group-relative reward advantage (opsd/rewards.py); 0 without rewards."""


def build_examples(
    student_prompts: list[EncodedPrompt],
    teacher_prompts: list[EncodedPrompt],
    sample_ids: list[str],
    completions: list,
    max_forward_tokens: int,
    advantages: list[float] | None = None,
) -> tuple[list[Example], dict[str, int]]:
    """Pair each completion with its prompts (and its advantage, `advantages[i]` for `completions[i]`);
    truncate it so the longer sequence fits.

    Returns the examples and counts of what was cut or dropped (nothing is dropped silently).
    """
    examples, counts = [], {"empty_completions": 0, "truncated_completions": 0, "prompt_too_long": 0}
    for i, c in enumerate(completions):
        student, teacher = student_prompts[c.prompt_index], teacher_prompts[c.prompt_index]
        budget = completion_budget(student, teacher, max_forward_tokens)
        if budget == 0:
            counts["prompt_too_long"] += 1
            continue
        if not c.token_ids:
            counts["empty_completions"] += 1
            continue
        if len(c.token_ids) > budget:
            counts["truncated_completions"] += 1
        examples.append(
            Example(sample_ids[c.prompt_index], student, teacher, c.token_ids[:budget], c.logprobs[:budget],
                    advantages[i] if advantages is not None else 0.0)
        )
    return examples, counts


def padding_example(student: EncodedPrompt, teacher: EncodedPrompt, token_id: int) -> Example:
    """A one-token stand-in for a rank left with nothing to train on: under FSDP it still has to run
    the same forwards and backwards as the other ranks (the trainer gives it loss weight 0)."""
    return Example("<padding>", student, teacher, [token_id], [0.0])
