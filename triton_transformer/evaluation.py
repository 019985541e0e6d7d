"""Evaluation (loss and bits per byte over a split) and text sampling of a model.

Both run under a forked RNG state, so calling them during training never perturbs the
training streams: a resumed run reproduces an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.data import decode_tokens, eval_batches
from triton_transformer.distributed import DistInfo, all_reduce_sum

__all__ = ["evaluate_loss", "fork_rng", "sample_from_split"]

AutocastFactory = Callable[[], contextlib.AbstractContextManager]


def fork_rng(device: torch.device) -> contextlib.AbstractContextManager:
    """Everything inside sees (and leaves) the caller's RNG streams untouched."""
    devices = [device] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    data: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None,
    device: torch.device,
    autocast: AutocastFactory,
    dist: DistInfo,
) -> dict:
    """Mean loss (nats/byte) and bits per byte over the fixed validation windows.

    With several ranks, rank r scores batches r, r + N, r + 2N, ... and the summed losses
    and label counts are all-reduced: the same value as one process (up to the order of
    the float64 additions). Pass the unwrapped model: DDP would add collectives.
    """
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss * n, n
    try:
        with fork_rng(device):
            batches = eval_batches(data, batch_size, seq_len, max_batches=max_batches)
            for i, batch in enumerate(batches):
                if i % dist.world_size != dist.rank:
                    continue
                batch = batch.to(device, non_blocking=True)
                with autocast():
                    loss = model(batch)
                n = batch.shape[0] * (batch.shape[1] - 1)
                sums[0] += loss.double() * n
                sums[1] += n
    finally:
        model.train(was_training)
    total, count = all_reduce_sum(sums).tolist()
    val_loss = total / max(count, 1.0)
    return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2)}


@torch.no_grad()
def sample_from_split(
    wrapper: AutoregressiveWrapper,
    data: np.ndarray,
    *,
    seed: int,
    prime_len: int,
    length: int,
    temperature: float,
    filter_thres: float,
    device: torch.device,
    autocast: AutocastFactory,
) -> dict:
    """Generate `length` bytes after a prime of `prime_len` bytes of `data` chosen by `seed`
    (the same seed gives the same prime and the same text). Returns {"prime", "sample"}."""
    pick = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, len(data) - prime_len, (1,), generator=pick))
    prime = torch.from_numpy(np.array(data[start : start + prime_len]))
    prime = prime.long().to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with fork_rng(device), autocast():
        out = wrapper.generate(prime[None], length, temperature, filter_thres, generator=gen)
    return {"prime": decode_tokens(prime.cpu()), "sample": decode_tokens(out[0].cpu())}
