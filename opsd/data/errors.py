"""What can be wrong with data: a dataset that does not fit the config, and a bad row."""

from __future__ import annotations

from opsd.config import ConfigError


class DataConfigError(ConfigError):
    """A dataset does not fit its config (missing column, unknown split, not in the cache).
    Raised at start, before any model is loaded."""


class BadSample(Exception):
    """One row cannot become a training sample; `reason` is a short key (`corrupt_image`, ...)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason.replace('_', ' ')}: {detail}" if detail else reason.replace("_", " "))
        self.reason = reason
        self.detail = detail


class BadSampleError(ValueError):
    """A bad row with `data.on_bad_sample: error`; the message names the dataset, file and row."""
