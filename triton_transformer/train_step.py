"""One optimizer step, as a unit of its own: micro-batch forward/backward, clipping, update.

`TrainStep` is what the loop (`trainer.py`) calls once per step. It is split in two phases so
that the loop can look at the step's loss before the parameters change:

    loss, grad_norm = step.forward_backward(next_batch)   # device tensors, no host sync
    ... the loop reads them (all-reduce, non-finite check) ...
    step.update()                                         # AdamW + LR scheduler, zero grads

Nothing in either phase reads a device value on the host: the loss and the gradient norm stay
on the device, so the two phases can be captured in a CUDA graph (with static input buffers
filled by `next_batch`). `__call__` runs both phases back to back.

With `cuda_graph=True` (CUDA only) `__call__` runs the whole step, micro-batches, clipping and
the AdamW update, as one CUDA graph (`cuda_graph.GraphedStep`): the micro-batches are staged
through pinned memory into a static device buffer, the first `warmup_steps` steps run eagerly
(they are real steps), the next one is captured, and every later one is a single replay. The
optimizer must be capturable (fused AdamW whose learning rate is a device tensor: the scheduler
fills it after each step, before the next replay). The step's loss and gradient norm come back
as device tensors that the next replay overwrites: copy them before the next call.

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

from triton_transformer.bmm import reuse_weight_casts
from triton_transformer.config import TrainConfig
from triton_transformer.cuda_graph import GraphedStep, StaticInputs

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


def make_optimizer(
    model: nn.Module, t: TrainConfig, device: torch.device, capturable: bool = False
) -> torch.optim.AdamW:
    """AdamW that decays matrices and embeddings, not norm weights (nanoGPT's split).

    Fused on CUDA. `capturable` (for a CUDA-graph step) also keeps the learning rate in a
    device tensor, which the LR scheduler fills in place, so a replayed update reads the
    current rate instead of the one baked in at capture.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    lr = torch.tensor(t.lr, device=device) if capturable else t.lr
    return torch.optim.AdamW(
        groups, lr=lr, betas=(t.beta1, t.beta2), fused=fused, capturable=capturable
    )


def lr_to_device_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make every param group's lr a device tensor (loading a state dict saved by a run
    without graphs puts floats back, which a captured update would bake in)."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor) or group["lr"].device != device:
            group["lr"] = torch.tensor(float(group["lr"]), device=device)


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
        self._graphed: GraphedStep | None = None
        self._inputs: StaticInputs | None = None

    @property
    def graphed(self) -> bool:
        """True when steps run as CUDA graph replays (`enable_cuda_graph`)."""
        return self._graphed is not None

    def enable_cuda_graph(self, warmup_steps: int) -> None:
        """Run each later `__call__` as one CUDA graph: `warmup_steps` eager steps, then a
        capture, then replays. Needs a CUDA device and a capturable optimizer."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self._graphed = GraphedStep(self._graph_body, warmup_steps)

    def release_cuda_graph(self) -> None:
        """Drop the captured graph (its memory pool, and any NCCL work captured in it) after
        the device is done with it; steps run eagerly again. Called before the process group
        is destroyed, so no live graph still refers to its communicator."""
        if self._graphed is not None:
            torch.cuda.synchronize(self.device)
            self._graphed = None

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
        with reuse_weight_casts():  # the weights are fixed until the optimizer step
            for i in range(self.grad_accum_steps):
                if i and should_stop is not None and should_stop():
                    raise StepInterrupted  # phase stays "forward": the caller discards it
                batch = next_batch().to(self.device, non_blocking=True)
                total += self._micro_batch(batch, last=i == self.grad_accum_steps - 1)
        return total / self.grad_accum_steps, self._clip()

    def _micro_batch(self, batch: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss (fp32, detached)."""
        # DDP all-reduces the gradients in the backward of the last micro-batch only
        with self._no_sync(not last):
            with self.autocast():
                loss = self.train_model(batch)
            (loss / self.grad_accum_steps).backward()
        return loss.detach().float()

    def _clip(self) -> torch.Tensor:
        # the gradients are the mean over all ranks here, so the norm is the same everywhere;
        # clip_grad_norm_ never reads the norm on the host, so it can be captured
        return nn.utils.clip_grad_norm_(self.params_model.parameters(), self.max_norm).float()

    def _graph_body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: reads the micro-batches from the static input buffer."""
        self.optimizer.zero_grad(set_to_none=True)  # capture allocates them in its pool
        batches = self._inputs.device_buffer
        with reuse_weight_casts():
            total = sum(
                self._micro_batch(batches[i], last=i == self.grad_accum_steps - 1)
                for i in range(self.grad_accum_steps)
            )
        grad_norm = self._clip()
        self.optimizer.step()
        return total / self.grad_accum_steps, grad_norm

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
        if self._graphed is None:
            loss, grad_norm = self.forward_backward(next_batch, should_stop)
            self.update()
            return loss, grad_norm
        # the host draws this step's micro-batches (the same data stream as eager steps)
        batches = torch.stack([next_batch() for _ in range(self.grad_accum_steps)])
        if self._inputs is None:
            self._inputs = StaticInputs(tuple(batches.shape), batches.dtype, self.device)
        self._inputs.load(batches)
        loss, grad_norm = self._graphed()
        self.scheduler.step()  # fills the lr tensor the next replay reads
        return loss, grad_norm
