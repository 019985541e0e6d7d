"""The trainer's side of CUDA-graph steps: when to capture, and reading losses late.

A mixin of `Trainer` (trainer.py), kept apart so the loop reads in a sitting. With
`train.cuda_graph` on, each optimizer step is one replay of a captured graph (see
`train_step.TrainStep.enable_cuda_graph` and `cuda_graph.py`), and the host must not wait for
the GPU after every step: the step's loss and gradient norm are copied into a pending list on
the device and read only at *sync steps* (those that log, evaluate, sample or checkpoint, and
the last), where the non-finite check runs. Under DDP the read is one all-reduce, at the same
steps on every rank, that also carries whether any rank was asked to stop.

Uses these attributes of the Trainer: config, device, dist, step, tokens_seen,
tokens_per_step, train_time_s, scheduler, step_runner, checkpoint_path,
last_checkpoint_step, _next_batch, _pending, _late_losses, _stop_requested, _stop_agreed.
"""

from __future__ import annotations

import math
import time

import torch

from triton_transformer.distributed import all_reduce_sum
from triton_transformer.train_step import NonFiniteLossError, lr_multiplier
from triton_transformer.utils import exists


class GraphedSteps:
    """CUDA-graph step handling for `Trainer` (a mixin: see the module docstring)."""

    def _resolve_cuda_graph(self) -> tuple[bool, str]:
        """Whether steps run as CUDA graph replays (train.cuda_graph), and a note saying why."""
        t = self.config.train
        mode = t.cuda_graph.lower()
        if mode in ("false", "0", "no", "off"):
            return False, "off (train.cuda_graph=false)"
        if self.device.type != "cuda":
            return False, f"off (CUDA graphs need a CUDA device, this run is on {self.device})"
        if self.dist.enabled and t.compile:
            # Dynamo's DDPOptimizer splits the compiled graph at bucket boundaries and runs
            # the all-reduces from Python hooks between the pieces; capturing that whole is
            # not a combination PyTorch supports, so these steps stay eager
            return False, "off (DDP with torch.compile: steps run eagerly)"
        if self.dist.enabled:
            # the NCCL all-reduces are captured with the rest of the step (DDP needs 11 eager
            # steps first, see TrainStep); 2 x H200, torch 2.11: 97% scaling, and the runs
            # exit cleanly since the graph is released before the process group
            return True, "on, DDP all-reduces captured"
        return True, "on"

    def _non_finite(self, step: int, loss: float, norm: float) -> NonFiniteLossError:
        where = (
            f"the last good checkpoint ({self.checkpoint_path}, step "
            f"{self.last_checkpoint_step}) is kept"
            if exists(self.last_checkpoint_step)
            else "no checkpoint was written yet"
        )
        return NonFiniteLossError(
            f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; stopping the "
            f"run, {where}. Try a lower train.lr, more train.warmup_steps or train.grad_clip."
        )

    def _graphed_train_step(self, sync: bool) -> dict:
        """A step as one CUDA graph replay; the host reads its loss only when `sync`."""
        t = self.config.train
        start = time.perf_counter()
        # the rate this step uses, as LambdaLR set it (the tensor itself stays on the device)
        lr = t.lr * lr_multiplier(self.scheduler.last_epoch, t.warmup_steps, t.max_steps,
                                  t.min_lr_ratio)  # fmt: skip
        loss, grad_norm = self.step_runner(self._next_batch)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        # the next replay overwrites the outputs: keep a copy (a tiny device-side kernel)
        self._pending.append((self.step, torch.stack([loss, grad_norm])))
        info = {"step": self.step, "loss": None, "losses": {}, "lr": lr, "grad_norm": None}
        if sync:
            values = self._read_pending()
            info.update(losses={s: v[0] for s, v in values.items()})
            info.update(loss=values[self.step][0], grad_norm=values[self.step][1])
        info["time_s"] = time.perf_counter() - start  # with the wait for the GPU when synced
        self.train_time_s += info["time_s"]
        return info

    def _read_pending(self) -> dict[int, tuple[float, float]]:
        """Read the unread steps' (loss, grad norm) on the host: step -> values.

        Raises NonFiniteLossError for the first non-finite one. With several ranks every rank
        calls this at the same steps: the losses are averaged over the ranks in one
        all-reduce, which also carries whether any rank saw Ctrl-C (`_stop_agreed`)."""
        if not self._pending:
            return {}
        self._late_losses.clear()
        steps = [s for s, _ in self._pending]
        stats = torch.stack([v for _, v in self._pending])  # (k, 2)
        self._pending.clear()
        if self.dist.enabled:
            flag = torch.full((1, 2), float(self._stop_requested), device=self.device)
            # every rank holds the same (all-reduced) gradient norm: the mean keeps it
            shared = all_reduce_sum(torch.cat([stats, flag])) / self.dist.world_size
            stats, self._stop_agreed = shared[:-1], bool(shared[-1, 0] > 0)
        values = dict(zip(steps, map(tuple, stats.tolist()), strict=True))
        for step, (loss, norm) in values.items():
            if not (math.isfinite(loss) and math.isfinite(norm)):
                raise self._non_finite(step, loss, norm)
        self._late_losses.update({step: loss for step, (loss, _) in values.items()})
        return values

    def _is_sync_step(self, step: int) -> bool:
        """Whether the host reads step `step`'s loss right after it (CUDA graphs read only
        at steps that log, evaluate, sample or checkpoint, and the last; the same steps on
        every rank, since reading all-reduces)."""
        if not self.step_runner.graphed:
            return True
        t, e, lg = self.config.train, self.config.eval, self.config.log
        every = [lg.log_every, e.eval_every, e.generate_every, lg.checkpoint_every]
        return (
            step >= t.max_steps
            or any(n > 0 and step % n == 0 for n in every)
            or (self._stop_requested and not self.dist.enabled)
        )
