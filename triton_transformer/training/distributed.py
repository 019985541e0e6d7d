"""Multi-process data parallelism under torchrun: process-group setup and the few collectives
the trainer needs. Gradients are averaged by PyTorch's own `DistributedDataParallel`; nothing
here communicates gradients.

    torchrun --nproc_per_node=2 train.py --use-triton --config configs/enwik8.toml

torchrun starts one process per GPU and gives each RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT. `init_distributed` reads them, binds the process to cuda:LOCAL_RANK and
creates the default process group (NCCL on GPU, gloo on CPU) with a timeout, so that a
collective waiting on a rank that hangs fails after `timeout_s` instead of blocking forever.
A rank that dies closes its connections and the others fail at their next collective; under
torchrun the agent also stops the whole group as soon as one worker exits non-zero.

Without those variables (a plain `python train.py`) everything here is a no-op for a single
process: rank 0 of a world of size 1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "DistributedError",
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "destroy_distributed",
    "env_info",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_comm_error",
    "is_distributed",
    "main_process_first",
]


class DistributedError(RuntimeError):
    """A collective failed: another rank crashed, or hung for longer than the timeout."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def env_info() -> DistInfo:
    """Rank, local rank and world size from torchrun's environment variables (or 0, 0, 1)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}")
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def is_distributed() -> bool:
    """True when a process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (RANK from torchrun before the group exists; 0 without torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_info().rank


def get_local_rank() -> int:
    """The rank within this machine: which GPU this process drives."""
    return env_info().local_rank


def get_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return env_info().world_size


def init_distributed(device: torch.device, timeout_s: float) -> bool:
    """Create the default process group from torchrun's environment, if there is one.

    device: where this process trains: a CUDA device gives NCCL (and becomes the current
        device), the CPU gives gloo.
    timeout_s: how long a collective (or the rendezvous) waits for the other ranks.

    Returns True if this call created the group (its caller then owns `destroy_distributed`),
    False when the group already existed or the job has a single process.
    """
    info = env_info()
    if not info.enabled or not dist.is_available() or dist.is_initialized():
        return False
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"WORLD_SIZE={info.world_size} but {name} is not set: start the job with "
                "torchrun --nproc_per_node=N train.py ..."
            )
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs.update(backend="nccl", device_id=device)  # binds the communicator to this GPU
    else:
        kwargs.update(backend="gloo")
    dist.init_process_group(init_method="env://", **kwargs)
    return True


def destroy_distributed() -> None:
    """Tear down the default process group (safe to call when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_process_first(local: bool = True) -> Iterator[None]:
    """The main process (of each machine when `local`, else of the job) runs the body first,
    the others after it finished: for downloads and caches that the others then just read."""
    if not is_distributed():
        yield
        return
    first = (get_local_rank() if local else get_rank()) == 0
    if not first:
        dist.barrier()
    yield
    if first:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the ranks, in place; returns it (unchanged for a single process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_COMM_MARKERS = ("gloo", "nccl", "c10d", "connection reset", "connection closed", "timed out")


def is_comm_error(exc: BaseException) -> bool:
    """Does `exc` look like a failed collective (a peer died or timed out)? Gloo reports these
    from DDP's backward as plain RuntimeErrors, so the message is all there is to go on."""
    if isinstance(exc, DistributedError):
        return False  # already explained
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COMM_MARKERS)
