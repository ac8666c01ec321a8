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
