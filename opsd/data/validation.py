"""Turn one dataset row into a `Sample`, or say why it cannot be one (`BadSample`).

Reasons, as counted in metrics.jsonl (`data/skipped_<reason>`):
`empty_question`, `empty_answer`, `missing_image`, `corrupt_image`, `image_too_large`,
`too_many_images`, `no_privileged_images`, `no_privileged_text`, and `prompt_too_long` (checked by
the trainer, which knows the tokenizer: the teacher prompt alone fills `max_forward_tokens`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from opsd.data.errors import BadSample
from opsd.data.images import ImageLimits, decode_image
from opsd.data.sample import Sample
from opsd.data.schemas import ColumnPlan, gather


@dataclass(frozen=True)
class SampleRules:
    limits: ImageLimits
    max_problem_images: int
    max_reference_rounds: int
    need_privileged_images: bool
    need_privileged_text: bool

    @classmethod
    def from_config(cls, data_cfg, plan: ColumnPlan) -> "SampleRules":
        """A privileged field the plan reads (the prompt uses it, the dataset has it) must be in every row."""
        return cls(
            limits=ImageLimits(data_cfg.max_image_pixels, data_cfg.reject_image_pixels),
            max_problem_images=data_cfg.max_problem_images,
            max_reference_rounds=data_cfg.max_reference_rounds,
            need_privileged_images=bool(plan.columns["privileged_images"]),
            need_privileged_text=bool(plan.columns["privileged_text"]),
        )


def _text(value) -> str:
    """Strings as they are; numbers (a jsonl answer of 42) as text; nothing else."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return ""


def build_sample(
    row: dict, plan: ColumnPlan, rules: SampleRules, *, default_id: str, base_dir: Path | None = None,
    stats: Counter | None = None,
) -> Sample:
    """A validated sample from a raw row (images still encoded); raises `BadSample`."""
    cols = plan.columns
    question = _text(row.get(cols["question"][0]))
    if not question:
        raise BadSample("empty_question", f"column {cols['question'][0]!r}")
    answer = _text(row.get(cols["answer"][0]))
    if not answer:
        raise BadSample("empty_answer", f"column {cols['answer'][0]!r}")

    raw_images = gather(row, cols["images"])
    if cols["images"] and not raw_images:
        raise BadSample("missing_image", f"no problem image in {', '.join(cols['images'])}")
    if len(raw_images) > rules.max_problem_images:
        raise BadSample("too_many_images", f"{len(raw_images)} problem images > data.max_problem_images={rules.max_problem_images}")
    raw_privileged = gather(row, cols["privileged_images"])[: rules.max_reference_rounds]
    if rules.need_privileged_images and not raw_privileged:
        raise BadSample("no_privileged_images", f"none in {', '.join(cols['privileged_images'])}")
    thoughts = [t for t in (_text(v) for v in gather(row, cols["privileged_text"])) if t]
    if rules.need_privileged_text and not thoughts:
        raise BadSample("no_privileged_text", f"none in {', '.join(cols['privileged_text'])}")

    def decode(values):
        return [decode_image(v, limits=rules.limits, base_dir=base_dir, stats=stats) for v in values]

    row_id = _text(row.get(cols["id"][0])) if cols["id"] else ""
    return Sample(
        id=row_id or default_id,
        question=question,
        images=decode(raw_images),
        privileged_images=decode(raw_privileged),
        privileged_text="\n".join(thoughts) or None,
        answer=answer,
    )
