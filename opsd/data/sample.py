"""The trainer's one in-memory record of a task."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass
class Sample:
    """A problem the student sees (images + question) plus what only the teacher sees."""

    id: str
    question: str
    images: list[Image.Image]  # problem image(s), RGB
    privileged_images: list[Image.Image]  # visual thoughts, RGB; teacher prompt only
    privileged_text: str | None = None  # text thoughts / worked solution; teacher prompt only
    answer: str | None = None  # for evaluation; never part of the loss
