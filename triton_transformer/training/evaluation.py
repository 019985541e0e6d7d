"""Evaluation (loss per token and bits per byte over a split) and text sampling of a model.

Bits per byte = the total loss in nats / ln 2 / the UTF-8 bytes of the scored labels, so it
is comparable across tokenizers; with the byte tokenizer it is the loss / ln 2.

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
from tqdm.auto import tqdm

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.training.config import EvalConfig
from triton_transformer.training.data import eval_window_starts, windows_at
from triton_transformer.training.distributed import DistInfo, all_reduce_sum
from triton_transformer.training.tokenizer import ByteTokenizer, Tokenizer, bits_per_byte

__all__ = ["Evaluator", "evaluate_loss", "fork_rng", "generate_text", "sample_from_split"]

SINGLE_PROCESS = DistInfo()  # rank 0 of 1
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
    seq_len: int,
    max_bytes: int,
    batch_size: int,
    device: torch.device,
    autocast: AutocastFactory,
    dist: DistInfo = SINGLE_PROCESS,
    progress: bool = False,
    token_bytes: np.ndarray | None = None,
) -> dict:
    """Mean loss (nats/token), bits per byte and label count over the windows of `data`
    chosen by `eval_window_starts(len(data), seq_len, max_bytes)` (max_bytes 0: all; for
    token corpora max_bytes counts labels, i.e. tokens).

    token_bytes: the byte length of every token id (`Tokenizer.token_bytes()`); None: each
    token is one byte. Bits per byte is the summed loss / ln 2 / the labels' bytes.

    The set of windows depends on neither `batch_size` nor the number of ranks: rank r scores
    windows r, r + N, r + 2N, ... in batches of `batch_size`, and the summed losses and label
    counts are all-reduced, so the result is the same up to float rounding. Pass the unwrapped
    model: DDP would add collectives. Returns {"val_loss", "val_bpb", "tokens", "bytes"}.
    """
    starts = eval_window_starts(len(data), seq_len, max_bytes)[dist.rank :: dist.world_size]
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss * n, n, bytes
    bar = tqdm(
        total=len(starts) * seq_len,
        desc="eval",
        unit="B" if token_bytes is None else "tok",
        unit_scale=True,
        leave=False,
        disable=not progress,
    )
    try:
        with fork_rng(device), bar:
            for i in range(0, len(starts), batch_size):
                batch = windows_at(data, starts[i : i + batch_size], seq_len)
                n = batch.shape[0] * seq_len
                n_bytes = n if token_bytes is None else int(token_bytes[batch[:, 1:]].sum())
                batch = batch.to(device, non_blocking=True)
                with autocast():
                    loss = model(batch)
                sums[0] += loss.double() * n
                sums[1] += n
                sums[2] += n_bytes
                bar.update(n)
    finally:
        model.train(was_training)
    total, count, n_bytes = all_reduce_sum(sums).tolist()
    val_loss = total / max(count, 1.0)
    bpb = val_loss / math.log(2) if token_bytes is None else bits_per_byte(total, int(n_bytes))
    return {"val_loss": val_loss, "val_bpb": bpb, "tokens": int(count), "bytes": int(n_bytes)}


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
    tokenizer: Tokenizer | None = None,
) -> dict:
    """Generate `length` tokens after a prime of `prime_len` tokens of `data` chosen by
    `seed` (the same seed gives the same prime and the same text), decoded by `tokenizer`
    (default: bytes). Returns {"prime", "sample"}."""
    tokenizer = tokenizer or ByteTokenizer()
    pick = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, len(data) - prime_len, (1,), generator=pick))
    prime = torch.from_numpy(np.array(data[start : start + prime_len]))
    prime = prime.long().to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with fork_rng(device), autocast():
        out = wrapper.generate(prime[None], length, temperature, filter_thres, generator=gen)
    return {
        "prime": tokenizer.text(prime.cpu()),
        "sample": tokenizer.text(out[0].cpu()),
    }


class Evaluator:
    """Validation loss and text samples of the model being trained, per the eval.* settings.

    wrapper: the unwrapped AutoregressiveWrapper (DDP would add collectives).
    seq_len, batch_size: the run's windows (the validation set does not depend on the batch).
    seed: the run's seed; a sample's prime is chosen by (seed, step).
    progress: may show a progress bar (main rank, log.progress) for whole-split passes.
    tokenizer: what `valid` holds the ids of (default: bytes), for bits per byte and samples.
    """

    def __init__(
        self,
        wrapper: AutoregressiveWrapper,
        valid: np.ndarray,
        e: EvalConfig,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        autocast: AutocastFactory,
        dist: DistInfo = SINGLE_PROCESS,
        progress: bool = False,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.token_bytes = None if self.tokenizer.kind == "bytes" else self.tokenizer.token_bytes()
        self.wrapper, self.valid, self.e = wrapper, valid, e
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.device, self.autocast, self.dist, self.progress = device, autocast, dist, progress

    def loss(self, max_bytes: int | None = None) -> dict:
        """Mean loss (nats/token) and bits per byte over the validation windows: at most
        `max_bytes` (default eval.max_bytes; 0: the whole split) spread over the split, the
        same set at any batch size and number of ranks (sharded and all-reduced)."""
        return evaluate_loss(
            self.wrapper,
            self.valid,
            seq_len=self.seq_len,
            max_bytes=self.e.max_bytes if max_bytes is None else max_bytes,
            batch_size=self.batch_size,
            device=self.device,
            autocast=self.autocast,
            dist=self.dist,
            progress=self.progress and max_bytes == 0,
            token_bytes=self.token_bytes,
        )

    def whole_split(self, periodic: dict) -> dict:
        """The loss over the whole split; `periodic` (this step's `loss()`) already is when
        eval.max_bytes is 0."""
        return periodic if self.e.max_bytes == 0 else self.loss(max_bytes=0)

    def sample(self, step: int) -> dict:
        """Generate eval.generate_len tokens after a validation prime chosen by (seed, step)."""
        e = self.e
        out = sample_from_split(
            self.wrapper,
            self.valid,
            seed=(self.seed * 1_000_003 + step) % 2**63,
            prime_len=e.prime_len,
            length=e.generate_len,
            temperature=e.temperature,
            filter_thres=e.filter_thres,
            device=self.device,
            autocast=self.autocast,
            tokenizer=self.tokenizer,
        )
        return {"step": step, **out}


@torch.no_grad()
def generate_text(
    model: nn.Module,
    prompt: bytes,
    *,
    length: int,
    temperature: float,
    filter_thres: float,
    seed: int,
    device: torch.device,
    autocast: AutocastFactory,
    tokenizer: Tokenizer | None = None,
) -> str:
    """`length` tokens sampled after `prompt` (with the KV cache), decoded by `tokenizer`
    (default: bytes) as UTF-8 (bad bytes and control characters as U+FFFD). The same seed
    gives the same text on one machine."""
    tokenizer = tokenizer or ByteTokenizer()
    wrapper = model if isinstance(model, AutoregressiveWrapper) else AutoregressiveWrapper(model)
    ids = tokenizer.encode(prompt)
    if len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one byte")
    tokens = torch.from_numpy(ids).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with fork_rng(device), autocast():
        out = wrapper.generate(
            tokens[None], length, temperature, filter_thres, use_kv_cache=True, generator=gen
        )
    return tokenizer.text(out[0].cpu())
