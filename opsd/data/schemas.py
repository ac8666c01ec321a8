"""Schemas: which columns of a dataset hold each field a training sample needs.

Fields: `id`, `question`, `answer` (one column each), `images` (problem images),
`privileged_images` and `privileged_text` (teacher only; several columns allowed, one per round).

- `project`: what opsd's generators write: id, question, answer, images (list of images),
  privileged_images (list of images), privileged_text.
- `thinkmorph`: the Visual-OPSD / ThinkMorph interleaved parquet: pid, question, answer,
  problem_image_0 (a struct with `bytes`), and per reasoning round i a text thought
  `resoning_thought_{i}` (the published spelling) or `reasoning_thought_{i}`, and an image
  `reasoning_image_{i}`; rounds 0 .. max_reference_rounds - 1 that exist as columns.
- `text`: text OPSD: problem, solution (the privileged worked solution), answer; no images.

A dataset's `columns` mapping replaces a schema's columns for a field with the user's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from opsd.data.errors import DataConfigError

SINGLE_FIELDS = ("id", "question", "answer")
OPTIONAL_FIELDS = ("id",)
CHANNELS = {"images": "privileged_images", "text": "privileged_text"}  # prompts.privileged -> field


def _project(available: set[str], rounds: int) -> dict[str, list[str]]:
    return {
        "id": ["id"], "question": ["question"], "answer": ["answer"], "images": ["images"],
        "privileged_images": ["privileged_images"], "privileged_text": ["privileged_text"],
    }


def _thinkmorph(available: set[str], rounds: int) -> dict[str, list[str]]:
    problem_images = ["problem_image_0"]
    while f"problem_image_{len(problem_images)}" in available:
        problem_images.append(f"problem_image_{len(problem_images)}")
    thoughts, images = [], []
    for i in range(rounds):
        thoughts += [c for c in (f"resoning_thought_{i}", f"reasoning_thought_{i}") if c in available][:1]
        images += [c for c in (f"reasoning_image_{i}",) if c in available]
    return {
        "id": ["pid"], "question": ["question"], "answer": ["answer"], "images": problem_images,
        # The first round's names stand for "none found" in error messages.
        "privileged_images": images or ["reasoning_image_0"],
        "privileged_text": thoughts or ["resoning_thought_0"],
    }


def _text(available: set[str], rounds: int) -> dict[str, list[str]]:
    return {
        "id": ["id"], "question": ["problem"], "answer": ["answer"], "images": [],
        "privileged_images": [], "privileged_text": ["solution"],
    }


SCHEMAS = {"project": _project, "thinkmorph": _thinkmorph, "text": _text}


@dataclass(frozen=True)
class ColumnPlan:
    """Per field, the dataset columns holding it, in order. An empty tuple: the field is unused."""

    columns: dict[str, tuple[str, ...]]

    def all_columns(self) -> list[str]:
        """Each column once (two fields may read the same one)."""
        return list(dict.fromkeys(c for cols in self.columns.values() for c in cols))


def plan_columns(
    schema: str,
    available: list[str],
    *,
    overrides: dict[str, str | list[str]],
    max_reference_rounds: int,
    privileged: list[str],
    where: str,
) -> ColumnPlan:
    """Resolve each field to existing columns; a missing one is a `DataConfigError` naming it.

    Privileged fields the teacher prompt does not use (per `prompts.privileged`) are left out, so
    their images are never decoded; so are those the schema does not have (the text schema has no
    privileged images), as long as the dataset provides one of the configured channels: a mixture
    of image and text datasets can train with `privileged: [images, text]`.
    `where` names the dataset in messages (`data.datasets.0 (path)`).
    """
    if schema not in SCHEMAS:
        raise DataConfigError(f"{where}: unknown schema {schema!r} (known: {', '.join(SCHEMAS)})")
    present = set(available)
    defaults = SCHEMAS[schema](present, max_reference_rounds)
    used = {field: channel in privileged for channel, field in CHANNELS.items()}
    plan = {}
    for field, default in defaults.items():
        mapped = field in overrides
        columns = overrides[field] if mapped else default
        columns = [columns] if isinstance(columns, str) else list(columns)
        if not used.get(field, True) or (field in used and not columns and not mapped):
            plan[field] = ()
            continue
        missing = [c for c in columns if c not in present]
        if field in OPTIONAL_FIELDS and not mapped:
            columns = [c for c in columns if c in present]
        elif missing:
            need = f" (prompts.privileged has {field.removeprefix('privileged_')})" if field in used else ""
            raise DataConfigError(
                f"{where}: no column {missing[0]!r} for field {field}{need}; the columns are: "
                f"{', '.join(sorted(present))}. Map yours with columns.{field}"
            )
        if field in SINGLE_FIELDS and len(columns) > 1:
            raise DataConfigError(f"{where}: columns.{field} must name one column, got {columns}")
        if field in ("question", "answer") and not columns:
            raise DataConfigError(f"{where}: columns.{field} cannot be empty")
        plan[field] = tuple(columns)
    provided = {"answer"} | {channel for channel, field in CHANNELS.items() if plan[field]}
    if privileged and not provided & set(privileged):
        raise DataConfigError(
            f"{where}: the {schema} schema provides none of prompts.privileged ({', '.join(privileged)}): "
            "the teacher would see nothing the student does not; map columns.privileged_images / "
            "columns.privileged_text, or change prompts.privileged"
        )
    return ColumnPlan(plan)


def gather(row: dict, columns: tuple[str, ...]) -> list:
    """The values of a multi-column field in order: list columns are flattened, nulls dropped."""
    values = []
    for column in columns:
        value = row.get(column)
        if isinstance(value, (list, tuple)):
            values += [v for v in value if v is not None]
        elif value is not None:
            values.append(value)
    return values
