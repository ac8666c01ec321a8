"""An endless, epoch-shuffled stream of samples whose position can be saved and restored."""

from __future__ import annotations

import numpy as np

from opsd.data.sample import Sample


class SampleStream:
    def __init__(self, samples: list[Sample], *, seed: int = 0, shuffle: bool = True):
        if not samples:
            raise ValueError("the dataset holds no samples")
        self.samples = samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.samples))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.samples))

    def take(self, n: int, *, rank: int = 0, world_size: int = 1) -> list[Sample]:
        """The next `n` samples; with `world_size` ranks, this rank's block of the next `n * world_size`
        (every rank reads the same order and keeps a distinct slice)."""
        batch = []
        while len(batch) < n * world_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.samples[self._order[self.position]])
            self.position += 1
        return batch[rank * n : (rank + 1) * n]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.samples) or state["seed"] != self.seed:
            raise ValueError(
                f"data stream state is for {state['size']} samples with seed {state['seed']}, "
                f"this dataset has {len(self.samples)} samples with seed {self.seed}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
