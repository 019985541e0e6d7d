"""CUDA graphs of a model's residual blocks, for callers that run it eagerly.

At this model's size an eager step is host-bound: each Triton launch costs tens of µs of
Python, a block makes a dozen, and the GPU idles (the enwik8 preset's step: 4.3 GPU ms in
34 ms of wall time). `GraphedStep` removes that cost for our own trainer by capturing the whole
step; a library user keeps their own loop (their optimizer, their `loss.backward()`), so the
model does it for the part it owns, as NVIDIA's `make_graphed_callables` does for a layer:

- the blocks' forward, h (b, n, d) -> y (b, n, d), is captured once per input signature (shape,
  dtype, autocast, grad mode, training mode, deterministic algorithms, parameter storage) and
  replayed on later calls: inputs are copied into static buffers, the replay runs every kernel
  with one launch, and the output is returned as a fresh copy (a later replay never changes a
  tensor the caller holds);
- with autograd recording, the backward is captured too (same memory pool): an
  autograd.Function whose backward copies dy in, replays, and returns dh and the parameters'
  gradients as fresh tensors (one foreach kernel), which autograd accumulates into `.grad` as
  it would any gradient;
- a signature is captured on its second call (one-off shapes stay eager), after one warm-up
  on the capture stream; at most `max_graphs` are kept, least recently used dropped first.

A replayed forward's saved activations live in the graph's pool, so they are valid until its
next replay. Hence: a forward whose backward is still pending takes the eager path instead of
replaying (two forwards, then one backward of their sum, is correct); a second backward of the
same replay (retain_graph) raises, as does a differentiable backward (create_graph).

Never graphed: calls that torch.compile or export traces, calls made while a CUDA graph is
being captured or inside `suspended()` (the trainer's `GraphedStep` captures the blocks inside
its own graph), and tensors not on CUDA. Attribute changes other than those in the signature
(dropout rates are in it) are not seen by a captured graph: call `reset()` after them. (The
Transformer calls its blocks' methods, not the modules, so module hooks inside never ran.)
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from triton_transformer.bmm import fresh_weight_casts
from triton_transformer.utils import first_order_only, tracing

__all__ = ["BlockGraphs", "suspended"]

_suspended = 0  # > 0 inside `suspended()`


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No block graphs are captured or replayed inside: for callers that capture a whole step
    themselves (its warm-up calls would otherwise capture graphs it never replays)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


class _Token:
    """Held by the autograd node of one replayed forward: `done` once its backward ran; dead
    (weakly referenced) once the node is freed without one."""

    __slots__ = ("__weakref__", "done")

    def __init__(self) -> None:
        self.done = False


class _Captured:
    """The graphs of one signature: static inputs, the forward graph and its static output,
    and, when autograd records, the backward graph and its static gradients."""

    def __init__(
        self,
        blocks: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        modules: Sequence[nn.Module],
        h: torch.Tensor,
        mask: torch.Tensor | None,
        params: Sequence[torch.Tensor],
        record: bool,
        stream: torch.cuda.Stream,
    ) -> None:
        current = torch.cuda.current_stream(h.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # Fresh leaves, made and first used on the capture stream: autograd runs a leaf's
            # gradient on the stream its accumulator node was made on, and a parameter's
            # node from an eager call would make capture wait on the legacy stream (an
            # error). The aliases share the parameters' storage, so replays read live weights.
            self.h = h.detach().clone().requires_grad_(record and h.requires_grad)
            self.mask = None if mask is None else mask.clone()
            aliases = {id(p): p.detach().requires_grad_(record) for p in params}
            self.grad_inputs = ([self.h] if self.h.requires_grad else []) + list(aliases.values())
        self.generation = 0  # replays so far, forward and backward: a backward checks it
        self.pending: weakref.ref | None = None  # the token of the last replayed forward

        def run() -> torch.Tensor:
            # the blocks' own weight casts (never an outer context's copies, which the graph
            # would keep reading after they are freed), and autocast without its cast cache
            with (
                _parameters_replaced(modules, aliases),
                fresh_weight_casts(*modules),
                _autocast_without_cache(h.device),
            ):
                return blocks(self.h, self.mask)

        with torch.cuda.stream(stream):  # warm-up: cuBLAS handles and the like, on this stream
            y = run()
            if record:
                torch.autograd.grad(y, self.grad_inputs, torch.ones_like(y), allow_unused=True)
                self.dy = torch.empty_like(y)
            del y
        current.wait_stream(stream)

        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, stream=stream):
            y = run()
        self.backward_graph = None
        if record:
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                self.backward_graph, pool=self.forward_graph.pool(), stream=stream
            ):
                grads = torch.autograd.grad(y, self.grad_inputs, self.dy, allow_unused=True)
            self.grads = list(grads)
        self.y = y.detach()

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        self.h.detach().copy_(h)
        if mask is not None:
            self.mask.copy_(mask)
        self.forward_graph.replay()
        self.generation += 1
        return self.y.clone()

    def backward(self, dy: torch.Tensor) -> list[torch.Tensor | None]:
        self.dy.copy_(dy)
        self.backward_graph.replay()
        self.generation += 1
        present = [g for g in self.grads if g is not None]
        fresh = iter(torch._foreach_mul(present, 1.0))  # copies, in one kernel; x·1 is exact
        return [None if g is None else next(fresh) for g in self.grads]

    def backward_pending(self) -> bool:
        token = self.pending() if self.pending is not None else None
        return token is not None and not token.done


class _Replay(torch.autograd.Function):
    """Forward: replay the captured forward. Backward: replay the captured backward."""

    @staticmethod
    def forward(ctx: Any, captured: _Captured, h: torch.Tensor, mask, *params) -> torch.Tensor:
        y = captured.forward(h, mask)
        ctx.captured, ctx.generation, ctx.token = captured, captured.generation, _Token()
        captured.pending = weakref.ref(ctx.token)
        return y

    @staticmethod
    @first_order_only("graphed transformer blocks")
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        captured = ctx.captured
        if ctx.generation != captured.generation:
            raise RuntimeError(
                "a second backward through the Transformer's graphed blocks (retain_graph): "
                "their saved activations were overwritten. Run one backward per forward, or "
                "turn the graphs off (Transformer(cuda_graphs=False))"
            )
        grads = captured.backward(dy)
        ctx.token.done = True
        h_grad = grads.pop(0) if captured.h.requires_grad else None
        return (None, h_grad, None, *grads)


class BlockGraphs:
    """The captured graphs of one model's blocks (see the module docstring). Not copied with
    the model: a deep copy or an unpickled model starts with none."""

    def __init__(self, max_graphs: int = 4) -> None:
        self.max_graphs = max_graphs
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._seen: set[tuple] = set()  # signatures called once, eagerly

    def __len__(self) -> int:
        return len(self._captured)

    def reset(self) -> None:
        """Drop every captured graph (and its memory pool)."""
        self._captured.clear()
        self._seen.clear()

    def __deepcopy__(self, memo: dict) -> BlockGraphs:
        return BlockGraphs(self.max_graphs)

    def __getstate__(self) -> dict:
        return {"max_graphs": self.max_graphs}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["max_graphs"])

    def __call__(
        self,
        blocks: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
        modules: Sequence[nn.Module],
        h: torch.Tensor,
        mask: torch.Tensor | None,
        config: tuple,
    ) -> torch.Tensor | None:
        """y = blocks(h, mask) through a graph, or None where the call must run eagerly (the
        caller then calls `blocks` itself). h: (..., d) activations, mask: an optional tensor
        the blocks read (copied in like h); modules: those whose parameters `blocks` uses
        (their nn.Linear weights are cast in one kernel); config: whatever else the result
        depends on (hashable: training mode, dropout rates, ...)."""
        if not _may_graph(h):
            return None
        params = [p for m in modules for p in m.parameters()]
        grad_params = [p for p in params if p.requires_grad]
        record = torch.is_grad_enabled() and (h.requires_grad or bool(grad_params))
        key = (
            tuple(h.shape), h.dtype, h.device, h.requires_grad,
            None if mask is None else tuple(mask.shape),
            record, torch.is_inference_mode_enabled(), _autocast_state(h.device),
            torch.are_deterministic_algorithms_enabled(), config,
            tuple(p.data_ptr() for p in params), tuple(p.requires_grad for p in params),
        )  # fmt: skip
        captured = self._captured.get(key)
        if captured is None:
            if key not in self._seen:  # first call: eager (a one-off shape costs nothing)
                if len(self._seen) > 64:
                    self._seen.clear()
                self._seen.add(key)
                return None
            captured = _Captured(
                blocks, modules, h, mask, grad_params, record, _capture_stream(h.device)
            )
            self._captured[key] = captured
            while len(self._captured) > self.max_graphs:
                self._captured.popitem(last=False)
        self._captured.move_to_end(key)
        if not record:
            return captured.forward(h, mask)
        if captured.backward_pending():  # its activations are still needed: stay eager
            return None
        return _Replay.apply(captured, h, mask, *grad_params)


def _may_graph(h: torch.Tensor) -> bool:
    if _suspended or not h.is_cuda or tracing(h):
        return False
    return not torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def _parameters_replaced(modules: Sequence[nn.Module], aliases: dict[int, torch.Tensor]):
    """Inside, every parameter p of `modules` that `aliases` holds (by id) reads as
    aliases[id(p)]; restored on exit."""
    replaced = []
    for root in modules:
        for m in root.modules():
            for name, p in m._parameters.items():
                if p is not None and id(p) in aliases:
                    replaced.append((m, name, p))
    try:
        for m, name, p in replaced:
            m._parameters[name] = aliases[id(p)]
        yield
    finally:
        for m, name, p in replaced:
            m._parameters[name] = p


def _autocast_state(device: torch.device) -> tuple:
    if torch.is_autocast_enabled(device.type):
        return (True, torch.get_autocast_dtype(device.type))
    return (False,)


def _autocast_without_cache(device: torch.device) -> contextlib.AbstractContextManager:
    """The caller's autocast with its weight-cast cache off: a cached cast made before capture
    would be read by every replay after it is freed."""
    if not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device.type)
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    from triton_transformer.cuda_graph import capture_stream

    return capture_stream(device)
