"""One optimizer step, as a unit of its own: micro-batch forward/backward, clipping, update.

`TrainStep` is what the loop (`trainer.py`) calls once per step. It is split in two phases so
that the loop can look at the step's loss before the parameters change:

    loss, grad_norm = step.forward_backward(next_batch)   # device tensors, no host sync
    ... the loop reads them (all-reduce, non-finite check) ...
    step.update()                                         # AdamW + LR scheduler, zero grads

Nothing in either phase reads a device value on the host: the loss and the gradient norm stay
on the device, so the two phases can be captured in a CUDA graph (with static input buffers
filled by `next_batch`). `__call__` runs both phases back to back.

`phase` says where an interrupt found the step: "forward" (gradients are being accumulated;
the step can be discarded and redone), "update" (parameters are changing; the state is not
consistent) or "idle".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

from triton_transformer.config import TrainConfig

__all__ = [
    "NonFiniteLossError",
    "StepInterrupted",
    "TrainStep",
    "lr_multiplier",
    "make_optimizer",
    "make_scheduler",
]

AutocastFactory = Callable[[], contextlib.AbstractContextManager]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became inf/nan; the last good checkpoint is kept."""


class StepInterrupted(KeyboardInterrupt):
    """A stop was requested between two micro-batches: the step is to be discarded."""


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR factor for optimizer step `step` (0-based): linear warmup to 1 over warmup_steps,
    then cosine decay to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW that decays matrices and embeddings, not norm weights (nanoGPT's split)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)


def make_scheduler(
    optimizer: torch.optim.Optimizer, t: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then cosine decay (`lr_multiplier`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, t.warmup_steps, t.max_steps, t.min_lr_ratio)
    )


class TrainStep:
    """Runs optimizer steps of `train_model` (the AutoregressiveWrapper, possibly in DDP).

    train_model: called on a batch (b, n + 1) of token ids, returns the mean loss.
    params_model: the unwrapped model whose parameters are clipped.
    grad_accum_steps: micro-batches per step; under DDP the gradients are all-reduced in the
        backward of the last one only (`no_sync` on the others).
    grad_clip: max global gradient norm (0: no clipping; the norm is still returned).
    autocast: returns the autocast context of the forward (a null context for fp32).
    """

    def __init__(
        self,
        train_model: nn.Module,
        params_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        grad_accum_steps: int,
        grad_clip: float,
        autocast: AutocastFactory,
        device: torch.device,
    ) -> None:
        self.train_model = train_model
        self.params_model = params_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_accum_steps = grad_accum_steps
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.autocast = autocast
        self.device = device
        self.phase = "idle"

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync (gradients accumulate locally, no all-reduce) when `skip`."""
        if skip and isinstance(self.train_model, nn.parallel.DistributedDataParallel):
            return self.train_model.no_sync()
        return contextlib.nullcontext()

    def forward_backward(
        self,
        next_batch: Callable[[], torch.Tensor],
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradients of `grad_accum_steps` micro-batches and clip them.

        next_batch: returns the next micro-batch (on any device; it is moved here).
        should_stop: asked before every micro-batch after the first; True raises
            `StepInterrupted` (a prompt Ctrl-C); the caller then `discard`s the step.
        Returns (mean loss over the micro-batches, global gradient norm before clipping),
        both 0-dim float32 tensors on the device.
        """
        self.phase = "forward"
        total = torch.zeros((), device=self.device)
        for i in range(self.grad_accum_steps):
            if i and should_stop is not None and should_stop():
                raise StepInterrupted  # phase stays "forward": the caller discards the step
            batch = next_batch().to(self.device, non_blocking=True)
            # DDP all-reduces the gradients in the backward of the last micro-batch only
            last = i == self.grad_accum_steps - 1
            with self._no_sync(not last):
                with self.autocast():
                    loss = self.train_model(batch)
                (loss / self.grad_accum_steps).backward()
            total += loss.detach().float()
        # the gradients are the mean over all ranks here, so the norm is the same everywhere
        grad_norm = nn.utils.clip_grad_norm_(self.params_model.parameters(), self.max_norm)
        return total / self.grad_accum_steps, grad_norm.float()

    def update(self) -> None:
        """Apply the accumulated gradients: optimizer step, zero grads, scheduler step."""
        self.phase = "update"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.phase = "idle"

    def discard(self) -> None:
        """Drop the gradients of a step that will not be applied."""
        self.optimizer.zero_grad(set_to_none=True)
        self.phase = "idle"

    def __call__(
        self,
        next_batch: Callable[[], torch.Tensor],
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole step without looking at the loss: (loss, grad_norm) device tensors."""
        loss, grad_norm = self.forward_backward(next_batch, should_stop)
        self.update()
        return loss, grad_norm
