"""Seed, capture and restore this process's random generators: python, numpy, torch CPU and CUDA.

The state is kept as plain lists, ints and tensors so that a checkpoint's RNG file loads with
`torch.load(weights_only=True)`: no pickled code runs when a checkpoint is read.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    py_version, py_internal, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    })
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # another device layout: the CUDA streams cannot be matched one to one
            warnings.warn(f"RNG state holds {len(cuda)} CUDA generators, this process sees "
                          f"{torch.cuda.device_count()} devices: CUDA generators left as seeded")
