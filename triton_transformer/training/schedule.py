"""When things happen in a run: the learning-rate schedule, and which steps evaluate, log,
sample, checkpoint and read their loss on the host."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from triton_transformer.training.config import EvalConfig, LogConfig, TrainConfig

__all__ = ["Schedule", "lr_multiplier", "make_scheduler"]


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR factor for optimizer step `step` (0-based): linear warmup to 1 over warmup_steps,
    then cosine decay to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, t: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay (`lr_multiplier`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, t.warmup_steps, t.max_steps, t.min_lr_ratio)
    )


@dataclass(frozen=True)
class Schedule:
    """Which optimizer steps (1-based, as logged) do what. An interval of 0 turns it off."""

    max_steps: int
    eval_every: int
    full_eval_at_end: bool
    log_every: int
    generate_every: int
    checkpoint_every: int

    @classmethod
    def of(cls, t: TrainConfig, e: EvalConfig, lg: LogConfig) -> Schedule:
        return cls(
            t.max_steps, e.eval_every, e.full_at_end, lg.log_every, e.generate_every,
            lg.checkpoint_every,
        )  # fmt: skip

    def last(self, step: int) -> bool:
        return step >= self.max_steps

    def evaluates(self, step: int) -> bool:
        return self.eval_every > 0 and (step % self.eval_every == 0 or self.last(step))

    def evaluates_whole_split(self, step: int) -> bool:
        return self.full_eval_at_end and self.last(step) and self.evaluates(step)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or self.evaluates(step) or self.last(step)

    def samples(self, step: int) -> bool:
        return self.generate_every > 0 and step % self.generate_every == 0

    def checkpoints(self, step: int) -> bool:
        return bool(self.checkpoint_every and step % self.checkpoint_every == 0) or self.last(step)

    def reads_loss(self, step: int) -> bool:
        """Whether a CUDA-graph step's loss is read on the host right after it: at the steps
        that log, evaluate, sample or checkpoint (the same steps on every rank, since the read
        is an all-reduce). Eager steps always read theirs."""
        return self.logs(step) or self.samples(step) or self.checkpoints(step)
