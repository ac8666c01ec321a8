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
    image_token_id: int | None = None, share_prefix: bool = True, pair_cost: float = 0.0,
) -> ForwardBatch:
    """Right-pad `prompt + completion` sequences into one batch.

    `packed_row_tokens`: completions of one prompt (the same `EncodedPrompt` object, as
    `build_examples` pairs a prompt's samples) share rows of up to this many tokens, the prompt once
    in each, every completion attending to the prompt and to itself; with `share_prefix`, prompts
    that begin with the same text (system prompt, chat template) also share one copy of it per row
    (`collate_packed`). `image_token_id`: the model's image placeholder, where a shared text
    beginning ends at the latest (the pictures behind equal placeholders differ). `pair_cost`: what
    attention between two positions costs against a position's linear layers (`cheapest_rows`).
    """
    if packed_row_tokens and packable(prompts):
        prefix = shared_prefix_length(prompts, image_token_id) if share_prefix else 0
        if len({id(p) for p in prompts}) < len(prompts) or prefix:
            return collate_packed(prompts, completions, pad_id, packed_row_tokens, prefix, pair_cost)
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
    inputs.update(vision_inputs([p.vision for p in prompts]))
    return ForwardBatch(inputs, torch.tensor(positions, dtype=torch.long), _flat(completions))


def vision_inputs(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batch's vision tensors, given each row's (`EncodedPrompt.vision`) in order."""
    inputs = {}
    with_images = [v for v in rows if v]
    if with_images:
        for key, first in with_images[0].items():
            if flat_patches(with_images[0]):
                # Flat patch tensors (Qwen-VL style) concatenate along dim 0; text rows add none.
                inputs[key] = torch.cat([v[key] for v in with_images])
            else:
                # Idefics-style [1, n_images, C, H, W] is padded per image with all-zero images,
                # which the model skips; a text-only row (a dataset mixture) holds only padding.
                empty = first.new_zeros((1, 0, *first.shape[2:]))
                inputs[key] = _pad_images([v.get(key, empty) for v in rows])
    return inputs


def packable(prompts: list[EncodedPrompt]) -> bool:
    """Whether prompts may share rows: text, or per-row images (Idefics-style), which a packed row
    holds in the order their placeholders come."""
    # per-token inputs and flat patches come with models that compute their own positions
    return not any(p.per_token or (p.vision and flat_patches(p.vision)) for p in prompts)


def shared_prefix_length(prompts: list[EncodedPrompt], image_token_id: int | None) -> int:
    """How many leading ids every distinct prompt shares, up to its first image placeholder and
    leaving each at least one id of its own; 0 for a single prompt. Unknown placeholders
    (`image_token_id` None) share nothing of prompts with images."""
    distinct = list({id(p): p.input_ids for p in prompts}.values())
    if len(distinct) < 2 or (image_token_id is None and any(p.vision for p in prompts)):
        return 0
    length = min(len(ids) for ids in distinct) - 1
    for n, column in enumerate(zip(*distinct)):
        if n == length or column[0] == image_token_id or any(t != column[0] for t in column):
            return n
    return length


def collate_packed(
    prompts: list[EncodedPrompt], completions: list[list[int]], pad_id: int, max_row_tokens: int, prefix: int = 0,
    pair_cost: float = 0.0,
) -> ForwardBatch:
    """Rows `[shared prefix] prompt_a + completion_a1 + completion_a2 + ... [prompt_b + ...]`, each
    completion at the positions it would have after its prompt alone and attending only to its
    prompt and to itself (a [B, 1, L, L] boolean mask), so its logits are those of its own
    `prompt + completion`.

    A prompt is computed once per row instead of once per sample: a chunk holds the completions of
    one prompt that fit in `max_row_tokens` with it (at least one). With `prefix` > 0, the first
    `prefix` ids, which every prompt shares (`shared_prefix_length`), stand once at the head of a
    row and the row holds several chunks, each after it with the rest of its prompt, as many rows
    as cost least (`cheapest_rows`), each within `max_row_tokens`: the budget that bounds a
    sequence's memory bounds a row's too. Without a prefix each chunk is a row. A row's images are
    its prompts', in order.
    """
    chunks: list[list[int]] = []  # example indices per chunk, in order of first appearance
    open_chunk: dict[int, int] = {}  # id(prompt) -> the chunk its next completion may join
    for i, p in enumerate(prompts):
        c = open_chunk.get(id(p))
        if c is None or len(p.input_ids) + sum(len(completions[j]) for j in chunks[c]) + len(completions[i]) > max_row_tokens:
            c = open_chunk[id(p)] = len(chunks)
            chunks.append([])
        chunks[c].append(i)
    sizes = [len(prompts[g[0]].input_ids) - prefix + sum(len(completions[i]) for i in g) for g in chunks]
    rows = [[c] for c in range(len(chunks))] if not prefix else cheapest_rows(sizes, prefix, max_row_tokens, pair_cost)
    lengths = [prefix + sum(sizes[c] for c in row) for row in rows]
    width = max(lengths)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    # Per token: its chunk in the row (0 the shared prefix, -1 padding) and its part of the chunk
    # (0 the prompt, k its k-th completion).
    chunk_of = torch.full((len(rows), width), -1, dtype=torch.long)
    part = torch.zeros((len(rows), width), dtype=torch.long)
    # Per example, flat positions: its prompt's last one (predicts its first token), where it begins.
    anchors: list[tuple[int, int]] = [(0, 0)] * len(prompts)
    for r, row in enumerate(rows):
        head = prompts[chunks[row[0]][0]].input_ids[:prefix]
        input_ids[r, :prefix] = torch.tensor(head, dtype=torch.long)
        position_ids[r, :prefix] = torch.arange(prefix)
        chunk_of[r, :prefix] = 0
        start = prefix
        for n, c in enumerate(row, start=1):
            prompt = prompts[chunks[c][0]].input_ids
            rest = prompt[prefix:]
            input_ids[r, start : start + len(rest)] = torch.tensor(rest, dtype=torch.long)
            position_ids[r, start : start + len(rest)] = torch.arange(prefix, len(prompt))
            chunk_of[r, start : start + len(rest)] = n
            prompt_last = r * width + start + len(rest) - 1
            start += len(rest)
            for k, i in enumerate(chunks[c], start=1):
                ids = completions[i]
                input_ids[r, start : start + len(ids)] = torch.tensor(ids, dtype=torch.long)
                position_ids[r, start : start + len(ids)] = torch.arange(len(prompt), len(prompt) + len(ids))
                chunk_of[r, start : start + len(ids)] = n
                part[r, start : start + len(ids)] = k
                anchors[i] = (prompt_last, r * width + start)
                start += len(ids)
    positions = []
    for (prompt_last, begin), c in zip(anchors, completions):
        positions.extend([prompt_last, *range(begin, begin + len(c) - 1)])
    query_chunk, key_chunk = chunk_of[:, :, None], chunk_of[:, None, :]
    query_part, key_part = part[:, :, None], part[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_sequence = (key_chunk == 0) | ((key_chunk == query_chunk) & ((key_part == 0) | (key_part == query_part)))
    allowed = causal & (query_chunk != -1) & (key_chunk != -1) & same_sequence
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no all-masked row (NaN)
    inputs = {"input_ids": input_ids, "attention_mask": allowed[:, None], "position_ids": position_ids}
    inputs.update(vision_inputs([row_vision([prompts[chunks[c][0]] for c in row]) for row in rows]))
    return ForwardBatch(inputs, torch.tensor(positions, dtype=torch.long), _flat(completions))


def balanced_rows(sizes: list[int], capacity: int, count: int) -> list[list[int]] | None:
    """Chunk indices in `count` rows of alike lengths within `capacity` (longest chunk first into
    the shortest row), None when they do not fit."""
    rows: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for c in sorted(range(len(sizes)), key=lambda c: (-sizes[c], c)):
        r = min(range(count), key=lambda r: (loads[r], r))
        if loads[r] + sizes[c] > capacity:
            return None
        rows[r].append(c)
        loads[r] += sizes[c]
    return [sorted(row) for row in rows]


def cheapest_rows(sizes: list[int], prefix: int, max_row_tokens: int, pair_cost: float) -> list[list[int]]:
    """The rows of chunks behind a shared `prefix` whose padded batch costs least: B rows of width
    W cost B * W * (1 + pair_cost * W), positions through the linear layers plus attention's query-key
    pairs (a padded row computes as much as a full one). Fewer rows share the prefix more; longer
    ones cost more attention, which with long chunks outweighs what the prefix saves. As many rows as
    chunks is a row each, nothing shared."""
    best: tuple[float, list[list[int]]] | None = None
    capacity = max_row_tokens - prefix
    for count in range(max(1, -(-sum(sizes) // capacity)), len(sizes) + 1):
        rows = balanced_rows(sizes, capacity, count)
        if rows is None:
            continue
        width = prefix + max(sum(sizes[c] for c in row) for row in rows)
        cost = count * width * (1 + pair_cost * width)
        if best is None or cost < best[0]:
            best = (cost, rows)
    return best[1]


def row_vision(row_prompts: list[EncodedPrompt]) -> dict[str, torch.Tensor]:
    """The vision tensors of one packed row: its prompts' per-row images, in order."""
    with_images = [p.vision for p in row_prompts if p.vision]
    if not with_images:
        return {}
    return {key: torch.cat([v[key] for v in with_images], dim=1) for key in with_images[0]}


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
