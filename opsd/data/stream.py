"""An endless stream of training samples drawn from a weighted mixture of datasets.

- Every draw first picks a dataset with probability proportional to its weight, then takes that
  dataset's next row in its epoch order. Both are pure functions of (seed, draw number, epoch), so
  the stream is reproducible and its position is a handful of integers (`state_dict`).
- Each dataset is reshuffled every epoch from (seed, dataset index, epoch).
- Data-parallel ranks: `take(n, rank=r, world_size=W)` draws the next n x W samples, the same on
  every rank, and returns rank r's block of n: the ranks get distinct parts of one sequence, and
  the stream's state (position, skip counts) is the same on every rank, so one saved state
  resumes them all. (Each rank decodes and checks all n x W samples: cheap beside generation.)
- A bad row (`BadSample`) is skipped and counted once per row (`stats`), or, with
  `on_bad_sample="error"`, stops the run naming the dataset, file and row. A row known to be bad
  is not decoded again in later epochs.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

import numpy as np

from opsd.data.errors import BadSample, BadSampleError
from opsd.data.sample import Sample

MIXTURE_STREAM = 0x6D6978  # separates the dataset-choice RNG stream from the shuffles


class Source(Protocol):
    """A dataset split: `sample(i)` is row i as a `Sample` (or raises `BadSample`)."""

    name: str

    def __len__(self) -> int: ...

    def sample(self, index: int) -> Sample: ...

    def where(self, index: int) -> str:
        """Where row `index` comes from, for messages: `file F, row R`."""


def checked_sample(source: Source, index: int, check: Callable[[Sample], None] | None) -> Sample:
    """Row `index` of `source` as a sample that passed `check`; raises `BadSample`."""
    sample = source.sample(index)
    if check is not None:
        check(sample)
    return sample


def bad_sample_error(source: Source, index: int, bad: BadSample) -> BadSampleError:
    return BadSampleError(f"dataset {source.name}, {source.where(index)}: {bad} (data.on_bad_sample is error)")


class SampleStream:
    def __init__(
        self,
        sources: list[Source],
        *,
        weights: list[float] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        on_bad_sample: str = "skip",
        check: Callable[[Sample], None] | None = None,
        stats: Counter | None = None,
    ):
        """`check(sample)` may raise `BadSample` for reasons only the trainer knows (prompt length);
        `stats` is the counter the sources add their notes to (converted images), if shared."""
        if not sources:
            raise ValueError("no datasets to draw from")
        weights = [1.0] * len(sources) if weights is None else list(weights)
        if len(weights) != len(sources) or min(weights) <= 0:
            raise ValueError("need one positive weight per dataset")
        self.sources = sources
        self.probabilities = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.seed, self.shuffle = seed, shuffle
        self.on_bad_sample = on_bad_sample
        self.check = check
        self.stats = Counter() if stats is None else stats
        self.draws = 0
        self.epochs = [0] * len(sources)
        self.positions = [0] * len(sources)
        self.bad: list[dict[int, str]] = [{} for _ in sources]
        self._orders = [self._epoch_order(k) for k in range(len(sources))]

    def _epoch_order(self, k: int) -> np.ndarray:
        """Row indices of dataset k in its current epoch's order."""
        n = len(self.sources[k])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, k, self.epochs[k]]).permutation(n)

    def _choose(self) -> int:
        if len(self.sources) == 1:
            return 0
        rng = np.random.default_rng([self.seed, MIXTURE_STREAM, self.draws])
        return int(rng.choice(len(self.sources), p=self.probabilities))

    def _next_index(self, k: int) -> int:
        if self.positions[k] == len(self._orders[k]):
            self.epochs[k], self.positions[k] = self.epochs[k] + 1, 0
            self._orders[k] = self._epoch_order(k)
        index = int(self._orders[k][self.positions[k]])
        self.positions[k] += 1
        return index

    def take(self, n: int, *, rank: int = 0, world_size: int = 1) -> list[Sample]:
        """The next `n` samples; with `world_size` ranks, rank `rank`'s block of the next `n * world_size`."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        batch = []
        misses = [0] * len(self.sources)  # consecutive bad draws per dataset
        while len(batch) < n * world_size:
            k = self._choose()
            self.draws += 1
            index = self._next_index(k)
            if index in self.bad[k]:
                sample = None
            else:
                try:
                    sample = checked_sample(self.sources[k], index, self.check)
                except BadSample as bad:
                    if self.on_bad_sample == "error":
                        raise bad_sample_error(self.sources[k], index, bad) from None
                    self.bad[k][index] = bad.reason
                    self.stats[f"skipped_{bad.reason}"] += 1
                    sample = None
            if sample is None:
                misses[k] += 1
                if misses[k] > len(self._orders[k]):
                    reasons = Counter(self.bad[k].values())
                    raise BadSampleError(
                        f"dataset {self.sources[k].name}: no usable row in a whole epoch; skipped: {dict(reasons)}"
                    )
                continue
            misses[k] = 0
            batch.append(sample)
        return batch[rank * n : (rank + 1) * n]

    def metrics(self) -> dict[str, int]:
        """Counts so far, keyed for metrics.jsonl: `data/skipped_<reason>`, `data/images_converted_to_rgb`, ..."""
        return {f"data/{key}": value for key, value in sorted(self.stats.items())}

    def state_dict(self) -> dict:
        """Plain ints and strings: everything a resumed run needs to continue with the next sample."""
        return {
            "seed": self.seed, "sizes": [len(s) for s in self.sources], "names": [s.name for s in self.sources],
            "draws": self.draws, "epochs": list(self.epochs), "positions": list(self.positions),
            "bad": [{str(i): reason for i, reason in b.items()} for b in self.bad],
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "sizes", "names"):
            if state[key] != mine[key]:
                raise ValueError(f"data stream state has {key}={state[key]}, this stream has {mine[key]}")
        self.draws = state["draws"]
        self.epochs, self.positions = list(state["epochs"]), list(state["positions"])
        self.bad = [{int(i): reason for i, reason in b.items()} for b in state["bad"]]
        self.stats.clear()
        self.stats.update(state["stats"])
        self._orders = [self._epoch_order(k) for k in range(len(self.sources))]
