"""Run a whole training step as one CUDA graph: warm up eagerly, capture once, then replay.

At this model's size the host, not the GPU, sets the pace of an eager step: hundreds of kernel
launches, each paying Python, autograd and launcher overhead. A CUDA graph records the step's
kernels once and replays them with one launch, so the GPU runs back to back.

What a captured step may do (PyTorch's "whole network capture" rules):
- read its inputs from *static* tensors the caller refills before each call (`StaticInputs`);
- keep its outputs on the device (replays overwrite the same tensors; read them when needed);
- draw random numbers from torch's CUDA generator (replays draw fresh ones), never host values
  that change per step (a baked-in host value would replay stale);
- update an optimizer that is capturable (fused/capturable AdamW whose learning rate is a
  device tensor the scheduler fills before each replay).

`GraphedStep(step_fn, warmup_steps)` runs `step_fn` eagerly (on a side stream, as capture
requires) for the warm-up calls, which are real training steps, captures it on the next call and
replays it from then on; the call that captures also replays, so every call is one step.
`capture_graph(fn)` is the same recipe in one call (warm up, capture, return the graph and the
captured outputs), for tests and benchmarks that replay a graph themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from triton_transformer import block_graphs
from triton_transformer.adamw import AdamW
from triton_transformer.bmm import reuse_weight_casts, trainable_casts

T = TypeVar("T")

__all__ = [
    "GraphedStep",
    "StaticInputs",
    "capturable_train_step",
    "capture_graph",
    "capture_stream",
    "warm_up",
]


@functools.cache
def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The side stream on which warm-up and capture run (one per device).

    Whatever must be set up on the stream a graph is captured on uses it too: DDP, for one,
    is constructed under it, so that the gradient-accumulation nodes it keeps belong to the
    capture stream.
    """
    return torch.cuda.Stream(device)


def warm_up(fn: Callable[[], T], stream: torch.cuda.Stream | None = None) -> T:
    """Run `fn` once on a side stream (default `capture_stream`), ordered after the work
    already queued: lazily created handles (cuBLAS workspaces, NCCL communicators, autotuned
    kernels) then belong to a stream that capture can follow."""
    side = stream if stream is not None else capture_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


def capture_graph(
    fn: Callable[[], T], warmup_calls: int = 2, clear_grads: Sequence[torch.Tensor] = ()
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm `fn` up `warmup_calls` times, capture one call and return (graph, its outputs).

    Capture records the kernels without running them: `graph.replay()` runs them, refreshing
    the returned outputs in place. clear_grads: tensors whose `.grad` is set to None before
    capture, so the captured backward allocates them in the graph's memory pool (and
    overwrites, rather than accumulates into, them on every replay).
    """
    with block_graphs.suspended():  # the whole call is captured: no graphs of a model's own
        for _ in range(warmup_calls):
            warm_up(fn)
        for tensor in clear_grads:
            tensor.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream(torch.cuda.current_device())):
            out = fn()
    return graph, out


def capturable_train_step(
    model: torch.nn.Module,
    batch: torch.Tensor,
    lr: float = 1e-3,
    max_norm: float = 1.0,
    triton_optimizer: bool | None = None,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A whole training step that obeys the rules above, as a closure for `GraphedStep`: bf16
    autocast forward of `model(batch)` (a loss; the Triton path's bf16 weight copies made by
    one foreach copy, `bmm.reuse_weight_casts(model)`), backward, global-norm clipping and a
    capturable AdamW update whose learning rate lives on the device. `triton_optimizer`: the
    package's `adamw.AdamW` (clip folded into its launch) instead of torch's fused AdamW and
    `clip_grad_norm_`; None: the package's when the model or a module inside it (a
    wrapped `Transformer`) has `use_triton` set. Returns (loss, grad norm) device tensors.
    The trainer's own step is `training.step.OptimizerStep`; this minimal one is what the
    CUDA-graph tests and `benchmarks/bench_step.py` time."""
    uses_triton = any(getattr(m, "use_triton", False) is True for m in model.modules())
    if triton_optimizer is None:
        triton_optimizer = uses_triton
    params = [p for p in model.parameters() if p.requires_grad]
    lr_tensor = torch.tensor(lr, device="cuda")
    if triton_optimizer:
        opt = AdamW(params, lr=lr_tensor, use_triton=True)
        if uses_triton:  # the update writes the bf16 weight copies the next forward reads
            opt.cast_copies(trainable_casts(model, torch.bfloat16), torch.bfloat16)
    else:
        opt = torch.optim.AdamW(params, lr=lr_tensor, fused=True, capturable=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)  # capture then allocates the grads in its pool
        # the Triton path's bf16 weight copies: the optimizer's, or one foreach cast of them all
        # at entry (which compiled code reads too: it cannot cast lazily)
        copies = opt.current_copies() if isinstance(opt, AdamW) else ()
        cast_dtype = torch.bfloat16 if uses_triton else None
        with (
            reuse_weight_casts(model, cast_dtype, copies=copies),
            torch.autocast("cuda", dtype=torch.bfloat16),
        ):
            loss = model(batch)
        loss.backward()
        if triton_optimizer:
            norm = opt.clip_grad_norm(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        opt.step()
        return loss.detach(), norm

    return step


class GraphedStep(Generic[T]):
    """Call `step_fn` eagerly `warmup_steps` times, then capture it and replay the graph.

    `step_fn()` takes no arguments (it reads static input buffers) and returns device tensors
    (or a structure of them); after capture every call returns the same captured outputs,
    refreshed by the replay. Gradients should be set to None by `step_fn` before its first
    backward, so that capture allocates them inside the graph's memory pool.
    """

    def __init__(self, step_fn: Callable[[], T], warmup_steps: int = 3) -> None:
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (cuBLAS and autotuning warm up), got {warmup_steps}"
            )
        self.step_fn = step_fn
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._outputs: T | None = None
        self._side = capture_stream(torch.cuda.current_device())

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> T:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self._outputs  # type: ignore[return-value]
        # the whole step is captured: no graphs of a model's own blocks (`block_graphs`)
        with block_graphs.suspended():
            if self.calls <= self.warmup_steps:
                return warm_up(self.step_fn, self._side)  # real steps, on the capture stream
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._side):
                self._outputs = self.step_fn()
        self.graph = graph
        graph.replay()  # capture records the kernels without running them: run this step
        return self._outputs


class StaticInputs:
    """A device buffer that a captured step reads, refilled from pinned host memory.

    `load(cpu_tensor)` copies into one of two pinned staging buffers (alternating), then into the
    device buffer with `non_blocking=True`: the host never waits for the GPU, except to reuse a
    staging buffer whose previous copy has not finished (an event per buffer guards that).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.device_buffer = torch.empty(size=shape, dtype=dtype, device=device)
        self._staging = [torch.empty(size=shape, dtype=dtype, pin_memory=True) for _ in range(2)]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._next = 0

    def load(self, host: torch.Tensor) -> torch.Tensor:
        """Stage `host` (same shape) and enqueue its copy to the device; returns the buffer."""
        i = self._next
        self._next = 1 - i
        self._copied[i].synchronize()  # the copy that last used this staging buffer is done
        self._staging[i].copy_(host)
        self.device_buffer.copy_(self._staging[i], non_blocking=True)
        self._copied[i].record()
        return self.device_buffer
