"""Samples in memory as a data `Source` (opsd.data.stream), for streams built without files."""

from opsd.data.sample import Sample


class SampleList:
    """Samples already in memory as a `Source`."""

    def __init__(self, samples: list[Sample], name: str = "samples"):
        self.samples, self.name = samples, name

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> Sample:
        return self.samples[index]

    def where(self, index: int) -> str:
        return f"item {index}"


def text_samples(n: int) -> list[Sample]:
    """`n` text-only questions (no images, nothing privileged)."""
    return [Sample(id=f"t{i}", question=f"What is {i} + {i + 3}?", images=[], privileged_images=[]) for i in range(n)]
