"""One optimizer step, eager or as one CUDA graph replay, behind one call that returns one
`StepOutcome`; and `LossCheck`, the reading of step losses that both paths share.

    outcome = optimizer_step.run(step, sync=...)   # micro-batches, clipping, AdamW, scheduler

Eager: `grad_accum_steps` micro-batches accumulate gradients (under DDP all-reduced in the
backward of the last one only), which are clipped; the loss is read at once, and a
non-finite one stops the run *before* the update, so the parameters stay good.

Graphed (`enable_cuda_graph`, CUDA only): the whole step, micro-batches, clipping and the
AdamW update, is one replay of a captured graph (`cuda_graph.GraphedStep`): the first
`warmup_steps` steps run eagerly (they are real steps), the next is captured, every later
one is a replay. The micro-batches are staged through pinned memory into a static device
buffer; the optimizer is capturable (fused AdamW whose learning rate is a device tensor the
scheduler fills before the next replay). The host does not wait for the GPU after every
step: the (loss, grad norm) device tensors wait in `LossCheck` and are read at *sync* steps
(those that log, evaluate, sample or checkpoint), where the non-finite check runs.

Either way the read is `LossCheck.read`: with several ranks one small all-reduce averages
the losses and carries whether any rank was asked to stop, so every rank logs the same loss,
takes the same non-finite decision and stops after the same step.

The step/phase protocol. A first Ctrl-C only sets a flag, read between micro-batches and
between steps; a second one raises KeyboardInterrupt wherever the host is (`interrupts.py`).
The trainer then saves a checkpoint only if the state is one step's: `OptimizerStep.phase`
says which (`Trainer._save_interrupted`):

    "idle"     between steps: parameters, optimizer, scheduler, RNG streams and data position
               are those of the caller's step counter. Saved as they are.
    "forward"  the step has drawn from the RNG streams (data position, dropout) and may hold
               gradients, but nothing else changed: `discard` its gradients and its unread
               loss, save the previous step with the streams rewound to `rng_at_start`.
    "update"   from the first change to the parameters, optimizer or scheduler until the
               caller has counted the step (`run`'s `count`): neither step's state, so
               nothing is saved and the last checkpoint is kept.

`run` sets every phase itself: "forward" only once `rng_at_start` is captured, "update" before
the first change, "idle" only after `count` returned. Eager: "forward" covers the
micro-batches, clipping and the loss read; "update" the AdamW step, zeroing the gradients and
the scheduler step. Graphed: "forward" covers staging the micro-batches (the host's draws
from the data stream; the static buffer is overwritten by every step); "update" the graph
call (an eager warm-up step, the capture or a replay, which also advances the CUDA RNG) and
the scheduler step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from triton_transformer.adamw import AdamW
from triton_transformer.bmm import accumulate_grads_in_place, reuse_weight_casts, trainable_casts
from triton_transformer.cuda_graph import GraphedStep, StaticInputs
from triton_transformer.training.config import TrainConfig
from triton_transformer.training.distributed import DistInfo, all_reduce_sum
from triton_transformer.training.interrupts import Interrupts
from triton_transformer.training.rng import RngStreams
from triton_transformer.training.schedule import lr_multiplier

__all__ = [
    "LossCheck",
    "NonFiniteLossError",
    "OptimizerStep",
    "StepInterrupted",
    "StepOutcome",
    "lr_to_device_tensors",
    "make_optimizer",
]

AutocastFactory = Callable[[], contextlib.AbstractContextManager]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became inf/nan; the last good checkpoint is kept."""


class StepInterrupted(KeyboardInterrupt):
    """A stop was requested between two micro-batches: the step is to be discarded."""


def make_optimizer(
    model: nn.Module,
    t: TrainConfig,
    device: torch.device,
    capturable: bool = False,
    use_triton: bool = False,
) -> torch.optim.Optimizer:
    """AdamW that decays matrices and embeddings, not norm weights (nanoGPT's split).

    `use_triton`: the package's `adamw.AdamW` (one Triton launch per group, the grad-norm
    clip folded into it; its step counts and a tensor lr live on the device, so it is always
    capturable). Otherwise torch's, fused on CUDA. `capturable` (for a CUDA-graph step) keeps
    the learning rate in a device tensor, which the LR scheduler fills in place, so a
    replayed update reads the current rate instead of the one baked in at capture.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    lr = torch.tensor(t.lr, device=device) if capturable else t.lr
    if use_triton:
        return AdamW(groups, lr=lr, betas=(t.beta1, t.beta2), use_triton=True)
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=lr, betas=(t.beta1, t.beta2), fused=fused, capturable=capturable
    )


def lr_to_device_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make every param group's lr a device tensor (loading a state dict saved by a run
    without graphs puts floats back, which a captured update would bake in)."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor) or group["lr"].device != device:
            group["lr"] = torch.tensor(float(group["lr"]), device=device)


@dataclass
class StepOutcome:
    """What one optimizer step did. `losses` maps step -> loss for every step whose loss the
    host read now: this one for an eager step; with CUDA graphs, at a sync step, the steps
    since the previous one (elsewhere none: `loss` and `grad_norm` are then None)."""

    step: int
    lr: float
    time_s: float  # host time, including the wait for the GPU at a sync step
    losses: dict[int, float] = field(default_factory=dict)
    loss: float | None = None
    grad_norm: float | None = None

    def info(self) -> dict:
        """The dict handed to callbacks (and extended with validation results)."""
        return {
            "step": self.step,
            "loss": self.loss,
            "losses": dict(self.losses),
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "time_s": self.time_s,
        }


class LossCheck:
    """The (loss, grad norm) of steps not read on the host yet; `read` fetches them all at
    once, averages the losses over the ranks (with the stop flag, in one all-reduce) and
    raises NonFiniteLossError for the first non-finite one.

    kept_note: says which checkpoint a stop keeps, for the error message.
    """

    def __init__(self, dist: DistInfo, interrupts: Interrupts, kept_note: Callable[[], str]):
        self.dist = dist
        self.interrupts = interrupts
        self.kept_note = kept_note
        self._pending: list[tuple[int, torch.Tensor]] = []
        self.last_read: dict[int, float] = {}  # step -> loss of the last read

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        # a copy: a graph replay overwrites its outputs (a tiny device-side kernel)
        self._pending.append((step, torch.stack([loss, grad_norm])))

    def drop(self, step: int) -> None:
        """Forget the loss of `step`, a discarded step (read already or not)."""
        self._pending = [(s, v) for s, v in self._pending if s != step]
        self.last_read.pop(step, None)

    def read(self) -> dict[int, tuple[float, float]]:
        """step -> (loss, grad norm) of every pending step. With several ranks every rank
        must call this at the same steps (it all-reduces)."""
        if not self._pending:
            return {}
        steps = [s for s, _ in self._pending]
        stats = torch.stack([v for _, v in self._pending])  # (k, 2)
        self._pending.clear()
        losses, norms = stats[:, 0], stats[:, 1]
        parts = [losses, norms]
        if self.dist.enabled:
            # the gradients, and so their norm, are already the same on every rank
            flag = torch.full((1,), float(self.interrupts.requested), device=stats.device)
            shared = all_reduce_sum(torch.cat([losses, flag]))
            parts = [shared[:-1] / self.dist.world_size, norms, shared[-1:]]
        host = torch.cat(parts).tolist()  # the one wait for the GPU
        k = len(steps)
        self.interrupts.agreed = host[2 * k] > 0 if self.dist.enabled else self.interrupts.requested
        values = {s: (host[i], host[k + i]) for i, s in enumerate(steps)}
        for step, (loss, norm) in values.items():
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise NonFiniteLossError(
                    f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; "
                    f"stopping the run, {self.kept_note()}. Try a lower train.lr, more "
                    "train.warmup_steps or train.grad_clip."
                )
        self.last_read = {step: loss for step, (loss, _) in values.items()}
        return values


class OptimizerStep:
    """Runs optimizer steps of `train_model` (the AutoregressiveWrapper, possibly in DDP).

    params_model: the unwrapped model whose parameters are clipped.
    t: train.grad_accum_steps (micro-batches per step), grad_clip (0: no clipping; the norm
        is still returned) and the learning-rate schedule (to report the current rate).
    next_batch: returns the next micro-batch (b, n + 1) of token ids, on any device.
    should_stop: asked before every micro-batch after the first (a prompt Ctrl-C).
    cast_dtype: the autocast dtype the Triton path's weights are cast to, once per step
        (`bmm.reuse_weight_casts`; compiled code then reads those copies too), or None.
    rng: the streams an interrupted eager step rewinds to.
    """

    def __init__(
        self,
        train_model: nn.Module,
        params_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        t: TrainConfig,
        *,
        next_batch: Callable[[], torch.Tensor],
        should_stop: Callable[[], bool],
        checks: LossCheck,
        rng: RngStreams,
        autocast: AutocastFactory,
        device: torch.device,
        cast_dtype: torch.dtype | None = None,
    ) -> None:
        self.train_model = train_model
        self.params_model = params_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.t = t
        self.max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        self.next_batch = next_batch
        self.should_stop = should_stop
        self.checks = checks
        self.rng = rng
        self.autocast = autocast
        self.device = device
        self.cast_dtype = cast_dtype
        if cast_dtype is not None and isinstance(optimizer, AdamW) and optimizer.use_triton:
            # the update writes the weights' cast copies that the next step's forward reads
            optimizer.cast_copies(trainable_casts(params_model, cast_dtype), cast_dtype)
        self.phase = "idle"  # see the module docstring
        self.running: int | None = None  # the number of the step `run` was last asked for
        self.rng_at_start: dict | None = None  # the RNG streams before that step's draws
        self._graphed: GraphedStep | None = None
        self._inputs: StaticInputs | None = None

    @property
    def graphed(self) -> bool:
        """True when steps run as CUDA graph replays (`enable_cuda_graph`)."""
        return self._graphed is not None

    def enable_cuda_graph(self, warmup_steps: int) -> None:
        """Run each later step as one CUDA graph: `warmup_steps` eager steps, then a capture,
        then replays. Needs a CUDA device and a capturable optimizer."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        lr_to_device_tensors(self.optimizer, self.device)  # a loaded state brings floats
        self._graphed = GraphedStep(self._graph_body, warmup_steps)

    def release_cuda_graph(self) -> None:
        """Drop the captured graph (its memory pool, and any NCCL work captured in it) after
        the device is done with it. Called before the process group is destroyed, so no live
        graph still refers to its communicator."""
        if self._graphed is not None:
            torch.cuda.synchronize(self.device)
            self._graphed = None

    def run(
        self,
        step: int,
        *,
        sync: bool = True,
        count: Callable[[StepOutcome], None] | None = None,
    ) -> StepOutcome:
        """Optimizer step number `step`. `sync`: read its loss now (CUDA graphs; eager steps
        always do). `count(outcome)`: called once the step is applied, before the phase goes
        back to "idle": the caller advances its step counter there (an interrupt during it
        then saves nothing, never a step counted half). Raises NonFiniteLossError (eager:
        before the update) and StepInterrupted (a stop between micro-batches; the caller
        then `discard`s the step)."""
        lr = self._current_lr()
        start = time.perf_counter()
        self.running = step
        self.rng_at_start = self.rng.capture()
        self.phase = "forward"  # until the update, an interrupt rewinds to rng_at_start
        if self._graphed is None:
            loss, grad_norm = self._forward_backward()
            self.checks.add(step, loss, grad_norm)
            try:
                values = self.checks.read()
            except NonFiniteLossError:
                self.discard()
                raise
            self.phase = "update"
            self._update()
        else:
            self._stage()
            self.phase = "update"
            loss, grad_norm = self._replay()
            self.checks.add(step, loss, grad_norm)
            values = self.checks.read() if sync else {}
        outcome = StepOutcome(step, lr, 0.0, {s: v[0] for s, v in values.items()})
        if step in values:
            outcome.loss, outcome.grad_norm = values[step]
        outcome.time_s = time.perf_counter() - start
        if count is not None:
            count(outcome)
        self.phase = "idle"
        return outcome

    def discard(self) -> None:
        """Drop a step that will not be applied: its gradients and its loss if not read yet
        (an interrupt between `LossCheck.add` and `read`: a later read must not count it)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.running is not None:
            self.checks.drop(self.running)
        self.phase = "idle"

    def _current_lr(self) -> float:
        """The rate this step uses, as LambdaLR set it. A capturable optimizer keeps it in a
        device tensor, which is computed here rather than read (reading would wait)."""
        lr = self.optimizer.param_groups[0]["lr"]
        if not isinstance(lr, torch.Tensor):
            return lr
        t = self.t
        return t.lr * lr_multiplier(
            self.scheduler.last_epoch, t.warmup_steps, t.max_steps, t.min_lr_ratio
        )

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync (gradients accumulate locally, no all-reduce) when `skip`."""
        if skip and isinstance(self.train_model, nn.parallel.DistributedDataParallel):
            return self.train_model.no_sync()
        return contextlib.nullcontext()

    def _casts(self) -> contextlib.AbstractContextManager:
        """`bmm.reuse_weight_casts` for a step: the weights cast to cast_dtype once, or taken
        from the copies the package's AdamW wrote in the last update."""
        copies = self.optimizer.current_copies() if isinstance(self.optimizer, AdamW) else ()
        return reuse_weight_casts(self.params_model, self.cast_dtype, copies=copies)

    def _accumulating(self) -> contextlib.AbstractContextManager:
        """`bmm.accumulate_grads_in_place` around the micro-batches, in compiled forwards
        too (traced=True) unless under DDP, whose hooks must see every weight's gradient."""
        ddp = isinstance(self.train_model, nn.parallel.DistributedDataParallel)
        return accumulate_grads_in_place(traced=not ddp)

    def _forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate and clip the gradients of the step's micro-batches: (mean loss, global
        gradient norm before clipping), 0-dim float32 device tensors, no host sync."""
        n = self.t.grad_accum_steps
        total = torch.zeros((), device=self.device)
        # the weights are fixed until the optimizer step: one cast of them all, shared; the
        # micro-batches' weight gradients add up inside the weight-gradient products
        with self._casts(), self._accumulating():
            for i in range(n):
                if i and self.should_stop():
                    raise StepInterrupted  # phase stays "forward": the caller discards it
                batch = self.next_batch().to(self.device, non_blocking=True)
                total += self._micro_batch(batch, last=i == n - 1)
        return total / n, self._clip()

    def _micro_batch(self, batch: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss (fp32, detached)."""
        # DDP all-reduces the gradients in the backward of the last micro-batch only
        with self._no_sync(not last):
            with self.autocast():
                loss = self.train_model(batch)
            # The backward runs on this thread: handing it to autograd's device thread costs
            # host time at every Python backward node, which every Triton op has (eager
            # enwik8 step on an H100 host: 29.8 -> 22.1 ms; PyTorch means to make this its
            # default, pytorch/pytorch#192082).
            with torch.autograd.set_multithreading_enabled(False):
                (loss / self.t.grad_accum_steps).backward()
        return loss.detach().float()

    def _clip(self) -> torch.Tensor:
        # the gradients are the mean over all ranks here, so the norm is the same everywhere;
        # neither clip reads the norm on the host, so both can be captured. The package's
        # AdamW applies its clip while reading the gradients in `step`.
        if isinstance(self.optimizer, AdamW):
            return self.optimizer.clip_grad_norm(self.max_norm)
        return nn.utils.clip_grad_norm_(self.params_model.parameters(), self.max_norm).float()

    def _update(self) -> None:
        """Apply the accumulated gradients: optimizer step, zero grads, scheduler step."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _stage(self) -> None:
        """Draw the step's micro-batches on the host (the same data stream as eager steps)
        and copy them into the static input buffer the graph reads."""
        n = self.t.grad_accum_steps
        batches = torch.stack([self.next_batch() for _ in range(n)])
        if self._inputs is None:
            self._inputs = StaticInputs(tuple(batches.shape), batches.dtype, self.device)
        self._inputs.load(batches)

    def _replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole step as one graph call on the staged micro-batches: (loss, grad_norm)
        device tensors that the next replay overwrites."""
        loss, grad_norm = self._graphed()
        self.scheduler.step()  # fills the lr tensor the next replay reads
        return loss, grad_norm

    def _graph_body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: reads the micro-batches from the static input buffer."""
        self.optimizer.zero_grad(set_to_none=True)  # capture allocates them in its pool
        n = self.t.grad_accum_steps
        batches = self._inputs.device_buffer
        with self._casts(), self._accumulating():
            total = sum(self._micro_batch(batches[i], last=i == n - 1) for i in range(n))
        grad_norm = self._clip()
        self.optimizer.step()
        return total / n, grad_norm
