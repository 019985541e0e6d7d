"""Every RNG stream of a training process, captured and restored: what makes resume exact.

A process draws from torch's CPU generator, python's `random`, numpy, the data sampler's own
generator and (on a GPU) its CUDA device's generator. `RngStreams` captures all of them into
a checkpoint and puts them back; `rank_rng_state` picks this rank's states out of a
checkpoint written by any number of ranks.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch

from triton_transformer.training.distributed import DistInfo

__all__ = [
    "RngStreams",
    "capture_rng_state",
    "rank_rng_state",
    "restore_rng_state",
    "seed_everything",
]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) alike."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RngStreams:
    """This process's RNG streams (see the module docstring); `data_gen` is the sampler's."""

    def __init__(self, device: torch.device, data_gen: torch.Generator, distributed: bool) -> None:
        self.device = device
        self.data_gen = data_gen
        self.distributed = distributed

    def capture(self) -> dict:
        return capture_rng_state(self.device, self.data_gen)

    def restore(self, state: dict) -> None:
        restore_rng_state(state, self.device, self.data_gen, distributed=self.distributed)


def capture_rng_state(device: torch.device, data_gen: torch.Generator) -> dict:
    """Every RNG stream this process draws from: torch CPU, python, numpy, the data
    sampler's generator and (on GPU) this process's CUDA device."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "data": data_gen.get_state(),
    }
    if device.type == "cuda":
        # this process's GPU only: touching the others would create a CUDA context on
        # every GPU in every rank
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(
    state: dict, device: torch.device, data_gen: torch.Generator, *, distributed: bool
) -> None:
    """Put back what `capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    npst = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    data_gen.set_state(state["data"])
    if "cuda_device" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_device"], device)
    elif "cuda" in state and torch.cuda.is_available() and not distributed:
        # checkpoints of the first version: every visible GPU's state
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                "checkpoint's CUDA RNG states do not match this machine's GPUs", stacklevel=2
            )


def rank_rng_state(
    ckpt: dict, dist: DistInfo, *, seed: int, step: int, shared_data_stream: bool
) -> dict:
    """This rank's RNG states from a checkpoint. Every rank gets its own back when the
    world size is unchanged; otherwise (a checkpoint of another world size) rank 0 gets
    the saved rank 0 states and every new rank fresh streams seeded from (seed, rank,
    step), so no two ranks draw the same windows: a correct but not bitwise continuation.
    shared_data_stream: all ranks draw one global batch (data.shard_global_batch).
    """
    saved = ckpt.get("rng_ranks") or [ckpt["rng"]]
    rank, world = dist.rank, dist.world_size
    if len(saved) == world:
        return saved[rank]
    if dist.is_main:
        warnings.warn(
            f"the checkpoint was written by {len(saved)} process(es), resuming with "
            f"{world}: the random streams of the other ranks restart from fresh seeds, so "
            "the data order differs from an uninterrupted run",
            stacklevel=4,
        )
    if rank < len(saved):
        state = dict(saved[rank])
    else:
        fresh = seed + 1_000_003 * rank + 7919 * step
        state = dict(saved[0], torch=torch.Generator().manual_seed(fresh).get_state())
        state["data"] = torch.Generator().manual_seed(fresh + 1).get_state()
        state.pop("cuda_device", None)
    if shared_data_stream:
        state["data"] = saved[0]["data"]  # one shared global stream: keep its position
    return state
