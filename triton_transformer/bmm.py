"""Batched matmul and bias-free linear layer (optional relu², SwiGLU and residual epilogues) in
Triton.

This module holds the public functions (`bmm`, `linear`), their ops and autograd, and the
weight-cast cache (`reuse_weight_casts`). How a product runs (cuBLAS or which Triton kernel,
the `matmul_impl` switch, also settable here as `bmm.matmul_impl`, and `MATMUL_TABLE`) is
`matmul_plan.py`; the kernels are `matmul_kernels.py`.

Ops (torch.library triton_ops, so torch.compile traces them and CUDA graphs capture them):
- `triton_transformer::bmm(a, b)`: a (..., M, K) @ b (..., K, N); any strides (a transposed
  view such as k.transpose(-1, -2) is read in place). Its backward uses the same op.
- `triton_transformer::linear(x, weight, residual, relu_squared, p, seed, weight_lp,
  grad_acc)`: dropout_p(act(x @ weight.T)) [+ residual] for 2-D x; and
  `triton_transformer::linear_relu2(x, weight, residual, p, seed, weight_lp, grad_acc)`, which
  also returns relu(x @ weight.T) for the backward (see "relu² backward" below). The dropout
  (relu² only) runs in the epilogue, its mask drawn from a device seed
  (`_jit_helpers.dropout_keep_tile`). weight_lp: the weight's cast copy under autocast;
  grad_acc: its `.grad` in traced training steps (see `accumulate_grads_in_place`).
- `triton_transformer::relu2_grad(dy, s, from_square, p, seed)`: d(pre) = dy · keep / (1 - p)
  · 2·relu(pre), the mask regenerated from the forward's seed.
- `triton_transformer::linear_swiglu(x, weight, weight_lp, grad_acc)`: (silu(x @ W_gate.T) *
  (x @ W_up.T), x @ weight.T) for a weight of 2·H rows [gate; up]: by default cuBLAS's product into
  the (M, 2·H) pre-activations, then `swiglu.py`'s gating pass; the gating fused into the
  matmul's epilogue (two accumulators per tile, `matmul_kernels.py`, also writing the
  pre-activations) where `MATMUL_TABLE` lists it or cuBLAS cannot compute the product;
  and `triton_transformer::linear_swiglu_backward(dy, pre)`: their
  gradient [d(gate) | d(up)], `swiglu.py`'s backward kernel writing both halves of one
  tensor, which dX and dW then read as one GEMM each. Saved: x, the weight (as the product
  read it) and the pre-activations, as the unfused projection + `swiglu` saved.
- `triton_transformer::accumulate_mm(c, a, b)`: c += a @ b in place, a traced backward's fold
  of a weight's gradient into its `.grad` (`accumulate_grads_in_place(traced=True)`).
The backward of each is `utils.first_order_only` (create_graph=True raises) and calls these ops.

Eager calls of `bmm` and of a plain `linear` (no activation, no wider weight, a residual
only of the product's dtype) whose three GEMMs the planner gives to cuBLAS run PyTorch's own
op instead (`_runs_natively`): the same cuBLAS products, with a C++ autograd node rather than
our Python one (and PyTorch's double backward). Eager relu² and SwiGLU calls of a layout seen
before take that layout's `_EagerPlan` (its products bound by `matmul_plan.bind_mm2d`).

relu² backward: d(pre) = dy · 2·relu(pre). For bf16 and fp32 the forward saves nothing extra:
relu(pre) = sqrt(y) is recovered from the output y (which the next layer keeps anyway), and
bf16's 8-bit exponent means y = relu(pre)² does not underflow for any relu(pre) > 1e-19. In
fp16, y underflows (to 0, or to subnormals with few bits) for relu(pre) < ~8e-3, so the
forward epilogue also writes relu(pre) (one extra M×N tensor, the memory PyTorch's own
relu-then-square keeps) and the backward uses it; likewise with a residual, where y no longer
determines relu(pre). With dropout, y = relu(pre)² / (1 - p) where kept and 0 where
dropped, where d(pre) is 0 anyway: relu(pre) = sqrt(y · (1 - p)). d(pre) is one elementwise
pass; then dX = d(pre) @ W and dW = d(pre)^T @ X are two plain GEMMs.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.library import triton_op

from triton_transformer import matmul_plan
from triton_transformer.matmul_plan import _bmm_into, _mm2d_into, accumulate_mm, launch_relu2_grad
from triton_transformer.swiglu import _swiglu_reference, launch_swiglu_bwd
from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    check_dropout_p,
    check_triton_tensor,
    eager_apply,
    first_order_only,
    has_rows_view,
    is_traced,
    seed_or_draw,
    tensor_facts,
    tracing,
)

ACTIVATIONS = (None, "relu_squared", "swiglu")


class _BmmModule(types.ModuleType):
    """`bmm.matmul_impl`, read or set, is the planner's switch `matmul_plan.matmul_impl`."""

    @property
    def matmul_impl(self) -> str:
        return matmul_plan.matmul_impl

    @matmul_impl.setter
    def matmul_impl(self, impl: str) -> None:
        matmul_plan.matmul_impl = impl


sys.modules[__name__].__class__ = _BmmModule


# ------------------------------------------------------------------------------------------
# Ops (torch.library), their autograd, and the public functions
# ------------------------------------------------------------------------------------------


@triton_op("triton_transformer::bmm", mutates_args=())
def bmm_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a @ b for 2-D a (M, K), b (K, N) or 3-D a (B, M, K), b (B, K, N); any strides.

    out_dtype: the output's dtype (None: a's). The fp32 accumulator is rounded once, into
    it: fp32 weight gradients of bf16 products need no separate cast pass."""
    c = torch.empty(size=(*a.shape[:-1], b.shape[-1]), device=a.device, dtype=out_dtype or a.dtype)
    if a.dim() == 2:
        _mm2d_into(a, b, c)
    else:
        _bmm_into(a, b, c)
    return c


def _bmm_setup_context(ctx, inputs, output) -> None:
    a, b, _ = inputs
    ctx.save_for_backward(a, b)


@first_order_only("bmm")
def _bmm_backward(ctx, dc: torch.Tensor):
    a, b = ctx.saved_tensors
    dc = dc.to(a.dtype)  # a no-op unless out_dtype widened the output
    da = db = None
    if ctx.needs_input_grad[0]:  # dA = dC @ B^T, B^T a view
        da = call_op(bmm_op, dc, b.transpose(-1, -2))
    if ctx.needs_input_grad[1]:  # dB = A^T @ dC
        db = call_op(bmm_op, a.transpose(-1, -2), dc)
    return da, db, None


bmm_op.register_autograd(_bmm_backward, setup_context=_bmm_setup_context)


def _check_epilogue_dropout(p: float, seed: torch.Tensor | None, relu_squared: bool) -> None:
    """The ops' own check (`linear` checks its arguments first): a dropout needs relu² (the
    only epilogue that applies it, and the only backward that regenerates its mask) and a
    seed tensor."""
    if p > 0.0 and not relu_squared:
        raise ValueError("an epilogue dropout (p > 0) needs relu_squared")
    if p > 0.0 and seed is None:
        raise ValueError("an epilogue dropout (p > 0) needs a seed tensor")


def _linear_out(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return torch.empty(size=(x.shape[0], weight.shape[0]), device=x.device, dtype=dtype)


@triton_op("triton_transformer::linear", mutates_args=())
def linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    relu_squared: bool,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    weight_lp: torch.Tensor | None = None,
    grad_acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """dropout_p(act(x @ weight.T)) [+ residual] for 2-D x (M, K), weight (N, K), residual
    (M, N); dropout (p > 0, relu_squared only) from `seed`, a 0-dim int64 device tensor.

    weight_lp: the weight in x's dtype when `weight` is wider (mixed precision: an fp32
    weight under bf16 autocast), else None. The product uses it; the weight's gradient is
    written in the weight's own dtype by the dW GEMM, with no cast pass either way.

    grad_acc: the weight's `.grad` in traced code inside `accumulate_grads_in_place(traced=
    True)` (`_traced_grad_acc`), else None. The forward does not read it; the backward adds
    the weight's gradient into it in place and returns none for the weight.

    The output has x's dtype, promoted with the residual's. With relu_squared its backward
    recovers relu(pre) as sqrt(output · (1 - p)) where the mask kept it (where it dropped,
    d(pre) is 0 anyway), so it needs no residual and fp32/bf16 (see the module docstring);
    `linear_relu2_op` covers the other cases.
    """
    _check_epilogue_dropout(p, seed, relu_squared)
    w = weight if weight_lp is None else weight_lp
    y = _linear_out(x, w, residual)
    _mm2d_into(x, w.t(), y, relu_squared, residual, None, (p, seed) if p > 0.0 else None)
    return y


@triton_op("triton_transformer::linear_relu2", mutates_args=())
def linear_relu2_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    weight_lp: torch.Tensor | None = None,
    grad_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout_p(relu(x @ weight.T)²) [+ residual], relu(x @ weight.T)): the second output,
    written by the same epilogue, is what the backward needs (it does not underflow in fp16).
    The dropout (p > 0) draws its mask from `seed`, a 0-dim int64 device tensor; weight_lp
    and grad_acc as in `linear_op`."""
    _check_epilogue_dropout(p, seed, True)
    w = weight if weight_lp is None else weight_lp
    y = _linear_out(x, w, residual)
    r = torch.empty(size=(x.shape[0], w.shape[0]), device=x.device, dtype=x.dtype)
    _mm2d_into(x, w.t(), y, True, residual, r, (p, seed) if p > 0.0 else None)
    return y, r


@triton_op("triton_transformer::linear_swiglu", mutates_args=())
def linear_swiglu_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_lp: torch.Tensor | None = None,
    grad_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(x @ W_gate.T) * (x @ W_up.T), x @ weight.T) for 2-D x (M, K) and weight (2·H, K),
    its rows W_gate then W_up: the gating (M, H), and the (M, 2·H) pre-activations [gate | up]
    that the backward reads, written by the same epilogue (or by cuBLAS before the gating
    pass, "cublas+ew"). weight_lp and grad_acc as in `linear_op`."""
    w = weight if weight_lp is None else weight_lp
    if w.shape[0] % 2:
        raise ValueError(f"a swiglu weight needs an even row count (2·H), got {w.shape[0]}")
    M, H = x.shape[0], w.shape[0] // 2
    y = torch.empty(size=(M, H), device=x.device, dtype=x.dtype)
    pre = torch.empty(size=(M, 2 * H), device=x.device, dtype=x.dtype)
    _mm2d_into(x, w.t(), y, aux=pre, swiglu=True)
    return y, pre


@triton_op("triton_transformer::linear_swiglu_backward", mutates_args=())
def linear_swiglu_backward_op(dy: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d(pre) = [d(gate) | d(up)] (M, 2·H), contiguous in pre's dtype, from dy (M, H, any
    strides) and the forward's pre-activations pre (M, 2·H): `swiglu.py`'s backward kernel
    writing the two halves of one tensor. The rest of the backward is two GEMMs (`bmm_op`)."""
    M, H = pre.shape[0], pre.shape[1] // 2
    dpre = torch.empty(size=(M, 2 * H), device=pre.device, dtype=pre.dtype)
    dy2 = dy if dy.stride(-1) == 1 else dy.contiguous()  # e.g. sum()'s stride-0 gradient
    # dpre passed whole, with its halves' offsets: no view written (no copies under compile)
    launch_swiglu_bwd(dy2, pre[:, :H], pre[:, H:], dpre[:, :H], dpre[:, H:], dpre)
    return dpre


@triton_op("triton_transformer::relu2_grad", mutates_args=())
def relu2_grad_op(
    dy: torch.Tensor,
    s: torch.Tensor,
    from_square: bool,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """dy · 2·relu(pre) for 2-D dy and s (M, N), relu(pre) = sqrt(s) if from_square else s;
    with p > 0 also times the forward's dropout mask (from `seed`) / (1 - p).

    Any strides; returns a contiguous tensor in s's dtype.
    """
    _check_epilogue_dropout(p, seed, True)
    M, N = s.shape
    dp = torch.empty(size=(M, N), device=s.device, dtype=s.dtype)
    if dp.numel():
        drop = (p, seed) if p > 0.0 else None
        launch_relu2_grad(dy, s, dp, from_square, drop)
    return dp


# ---------------------------------------------------------------------------------------------
# Gradient accumulation in place
# ---------------------------------------------------------------------------------------------


class _InPlaceDepth(threading.local):
    """Per-thread depth of `accumulate_grads_in_place`, 0 on a thread that never opened one.
    A class-level default, not `getattr(local, "depth", 0)`: on a thread without the
    attribute that getattr raises and catches an AttributeError, 0.5 µs on every norm's and
    linear's eager forward (`_grad_home`), against 40 ns for a found attribute.

    Not for traced code to branch on: Dynamo takes the class default for a constant, without
    a guard (a later change would not recompile). Its one read under Dynamo, through
    `_plain_linear_natively`, gives False while compiling either way."""

    depth = 0


# The context's depth on this thread (its forwards record the choice); ACCUMULATE_IN_PLACE =
# False turns the context into a no-op (benchmarks compare).
_in_place = _InPlaceDepth()
ACCUMULATE_IN_PLACE = True
# How many open contexts asked for the fold in traced code too. A module global, not the
# thread-local depth: Dynamo guards on it (a change recompiles), and traced code cannot ask
# about this thread.
_traced_depth = 0


@contextlib.contextmanager
def accumulate_grads_in_place(traced: bool = False) -> Iterator[None]:
    """Inside, a linear's backward (and the relu² feed-forward's, `mlp.relu2_mlp`) adds its
    weight's gradient into the weight's `.grad`, when it has one, by the product itself:
    dW += d(pre)ᵀ X, cuBLAS with the fp32 gradient as its C input (beta = 1). It then hands
    that tensor to autograd and sets `.grad` to None, so that autograd stores it as the new
    `.grad` instead of adding a fresh dW to it. The norms (layernorm, residual_layernorm,
    rmsnorm, residual_rmsnorm) do the same for their weights and biases in the kernel that
    sums their gradients over rows (`grad_targets`). The embeddings and the fused loss head
    (`linear_cross_entropy`, whose gradient is scaled after the fact) do not.

    Why: a step of k micro-batches otherwise writes each weight's fp32 dW k times and adds
    it k - 1 times in separate kernels (read two, write one). At the enwik8 config (4
    micro-batches, H200) those adds took 406 µs of a 7.07 ms step (163 launches); in place,
    `train.py --use-triton` trains 1.04-1.05x faster (`benchmarks/RESULTS.md`, fourteenth
    session).

    For one thread's loop that accumulates with `loss.backward()` (the trainer's
    micro-batches): forwards run inside record the choice, on the thread that opened the
    context. A weight's gradient is computed as usual (and added by autograd) where:
    - the backward will not store into its `.grad` (`torch.autograd.grad`, or
      `backward(inputs=...)` without it);
    - something else references that `.grad` tensor (a tensor kept from `p.grad`, DDP's
      bucket views): autograd would store a copy, and the holder would stop seeing later
      micro-batches;
    - it has hooks of its own (`register_hook`), which must see one backward's dW;
    - the weight is not a leaf;
    - the forward is traced (torch.compile), unless `traced`.
    Hooks that run after accumulation (`register_post_accumulate_grad_hook`, DDP's) see what
    they always see. A backward that raises partway leaves the weights it had reached with
    `.grad` None (their running sums dropped): discard such a step, as the trainer does.

    traced=True: forwards that torch.compile traces inside the context fold too, where the
    checks above cannot run when the backward does. The traced forward passes each weight's
    `.grad` (when it has one) to its op, whose backward adds dW into that tensor in place
    (`accumulate_mm_op`; a holder of it sees the sum) and returns no gradient for the
    weight. Autograd then adds nothing: a hook on the weight is called with None, DDP's
    reducer would not see the gradient arrive, and `torch.autograd.grad` would get none. So
    only for a plain `loss.backward()` on weights without hooks: the trainer's micro-batches
    without DDP (`training.step`). Dynamo guards on whether each `.grad` exists: the first
    micro-batch (none yet) and the later ones compile one graph each."""
    global _traced_depth
    depth = _in_place.depth
    _in_place.depth = depth + 1
    _traced_depth += bool(traced)
    try:
        yield
    finally:
        _in_place.depth = depth
        _traced_depth -= bool(traced)


@torch.library.custom_op("triton_transformer::accumulate_mm", mutates_args=("c",))
def accumulate_mm_op(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in place (`matmul_plan.accumulate_mm`): a traced backward's fold of a
    weight's gradient into its `.grad`. An opaque op that declares its mutation, so inductor
    calls it on `.grad` itself, with no copy."""
    accumulate_mm(c, a, b)


@accumulate_mm_op.register_fake
def _(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


def _traced_grad_acc(weight: torch.Tensor) -> torch.Tensor | None:
    """In traced code inside `accumulate_grads_in_place(traced=True)`: weight's `.grad`, for
    its op's backward to add dW into (when it exists and matches the weight), else None."""
    # is_compiling first: eager calls stop there (only traced code reads the global)
    if not (torch.compiler.is_compiling() and _traced_depth and ACCUMULATE_IN_PLACE):
        return None
    if not (weight.is_leaf and weight.requires_grad):
        return None
    grad = weight.grad
    return grad if grad is not None and _takes_dw(grad, weight, weight.dtype) else None


def _takes_dw(grad: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a GEMM can add the weight's gradient (in `dtype`) into `grad` in place: the
    weight's shape, that dtype, dense and contiguous."""
    return (
        grad.dtype == dtype
        and grad.shape == weight.shape
        and grad.layout == torch.strided
        and grad.is_contiguous()
    )


def _grad_home(weight: torch.Tensor) -> torch.Tensor | None:
    """The leaf weight whose `.grad` this forward's backward may accumulate into (inside
    `accumulate_grads_in_place`), or None."""
    if not (_in_place.depth and ACCUMULATE_IN_PLACE) or is_traced(weight):
        return None
    return weight if weight.is_leaf and weight.requires_grad else None


def _grad_references(home: torch.Tensor) -> tuple[int, int]:
    """(Python references, C++ owners) of home.grad, counted in this frame (C++ owners as 0
    on a torch without `Tensor._use_count`)."""
    grad = home.grad
    refs = sys.getrefcount(grad)
    use_count = getattr(grad, "_use_count", None)
    return refs, use_count() if use_count is not None else 0


def _unshared_references() -> tuple[int, int]:
    """What `_grad_references` counts for a gradient nothing else holds."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.zeros(1)
    return _grad_references(probe)


_UNSHARED = _unshared_references()


def _stores_grad(weight: torch.Tensor) -> bool:
    """Whether the running backward will store a gradient into the leaf `weight`'s `.grad`
    (its AccumulateGrad node runs): not under `torch.autograd.grad` (where the engine refuses
    the question for leaves it returns gradients of), nor `backward(inputs=...)` without it."""
    try:
        node = torch.autograd.graph.get_gradient_edge(weight).node
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def _foldable(home: torch.Tensor | None, dtype: torch.dtype, a: torch.Tensor) -> bool:
    """Whether this backward may add the weight's gradient into home.grad in place (see
    `accumulate_grads_in_place` for when it may not)."""
    if home is None or home.grad is None or home._backward_hooks:
        return False
    if tracing(a):
        return False
    if _grad_references(home) != _UNSHARED:  # autograd would copy it rather than store it
        return False
    grad = home.grad
    return _takes_dw(grad, home, dtype) and grad.device == a.device and _stores_grad(home)


def weight_grad(
    home: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    dtype: torch.dtype,
    acc: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A weight's gradient a @ b (the transposed output gradient times the input) in the
    weight's dtype. `home`: what `_grad_home` gave the forward; where `_foldable`, the product
    is added into home.grad in place, which is returned as the gradient with `.grad` set to
    None (see `accumulate_grads_in_place`). `acc`: the `.grad` a traced forward passed
    (`_traced_grad_acc`); the product is added into it and None returned."""
    if acc is not None:
        accumulate_mm_op(acc, a, b)
        return None
    if _foldable(home, dtype, a):
        acc = home.grad
        accumulate_mm(acc, a, b)
        home.grad = None  # autograd now stores acc as the gradient, rather than adding to it
        return acc
    return call_op(bmm_op, a, b, dtype)


def grad_targets(
    homes: tuple[torch.Tensor | None, ...],
    traced_accs: tuple[torch.Tensor | None, ...],
    like: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """For a backward whose kernels write parameters' whole gradients (the norms' column sums
    of dweight and dbias): per parameter, the tensor to add its gradient into, or None to
    write a fresh one. A traced forward's `.grad` (`_traced_grad_acc`, saved as given), else,
    eagerly, home.grad where `_foldable` (with `.grad` set to None, as `weight_grad` does:
    autograd stores the returned sum back). `homes`: what `_grad_home` gave the forward."""
    targets = []
    for home, acc in zip(homes, traced_accs, strict=True):
        if acc is None and home is not None and _foldable(home, home.dtype, like):
            acc = home.grad
            home.grad = None
        targets.append(acc)
    return tuple(targets)


def folded_grads(
    grads: tuple[torch.Tensor | None, ...],
    targets: tuple[torch.Tensor | None, ...],
    traced_accs: tuple[torch.Tensor | None, ...],
) -> tuple[torch.Tensor | None, ...]:
    """What the backward returns for each parameter of `grad_targets`: None where a traced
    `.grad` took the gradient in place, the eager `.grad` that took it, else the fresh one."""
    return tuple(
        None if traced is not None else (grad if target is None else target)
        for grad, target, traced in zip(grads, targets, traced_accs, strict=True)
    )


def _linear_setup_context(ctx, inputs, output) -> None:
    x, weight, residual, relu_squared, ctx.p, seed, weight_lp, grad_acc = inputs
    ctx.swiglu = False
    ctx.relu_squared = relu_squared
    ctx.from_square = True
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.weight_dtype = weight.dtype
    ctx.grad_home = _grad_home(weight)
    # relu(pre) = sqrt(y) only holds without a residual; linear() never asks for that grad.
    ctx.can_grad = not (relu_squared and residual is not None)
    ctx.save_for_backward(
        x, weight if weight_lp is None else weight_lp,
        output if relu_squared and ctx.can_grad else None, seed if ctx.p else None, grad_acc,
    )  # fmt: skip


def _linear_relu2_setup_context(ctx, inputs, output) -> None:
    x, weight, residual, ctx.p, seed, weight_lp, grad_acc = inputs
    ctx.swiglu = False
    ctx.relu_squared = True
    ctx.from_square = False
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.weight_dtype = weight.dtype
    ctx.grad_home = _grad_home(weight)
    ctx.can_grad = True
    ctx.mark_non_differentiable(output[1])
    # relu(pre) gets no gradient: without this autograd would fill an M×N zero tensor for it
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(
        x, weight if weight_lp is None else weight_lp, output[1],
        seed if ctx.p > 0.0 else None, grad_acc,
    )  # fmt: skip


def _linear_swiglu_setup_context(ctx, inputs, output) -> None:
    x, weight, weight_lp, grad_acc = inputs
    ctx.swiglu, ctx.relu_squared, ctx.p = True, False, 0.0
    ctx.residual_dtype = None
    ctx.weight_dtype = weight.dtype
    ctx.grad_home = _grad_home(weight)
    ctx.can_grad = True
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # the pre-activations get no gradient (see relu2's)
    # what the unfused linear + swiglu saved: x, the weight as the product used it, and the
    # (M, 2·H) pre-activations (there: the projection, whose halves swiglu kept)
    ctx.save_for_backward(x, weight if weight_lp is None else weight_lp, output[1], None, grad_acc)


def _linear_grads(ctx, dy: torch.Tensor):
    if not ctx.can_grad:
        raise RuntimeError(
            "linear_op with relu_squared and a residual saves no relu(pre): use "
            "linear_relu2_op (as linear() does) when gradients are needed"
        )
    # w: the weight as the product used it; grad_acc: see `accumulate_grads_in_place`
    x, w, s, seed, grad_acc = ctx.saved_tensors
    # d(pre) = dy · keep / (1 - p) · 2·relu(pre), one elementwise pass; with swiglu the
    # gating's backward (M, 2·H); without an activation d(pre) = dy, cast only when a wider
    # residual promoted the output.
    if ctx.swiglu:
        dpre = call_op(linear_swiglu_backward_op, dy, s)
    elif ctx.relu_squared:
        dpre = call_op(relu2_grad_op, dy, s, ctx.from_square, ctx.p, seed)
    else:
        dpre = dy.to(x.dtype)
    dx = dw = dres = None
    if ctx.needs_input_grad[0]:  # dX = d(pre) @ W
        dx = call_op(bmm_op, dpre, w)
    if ctx.residual_dtype is not None and ctx.needs_input_grad[2]:
        dres = dy.to(ctx.residual_dtype)
    # dW last: added in place into .grad (`accumulate_grads_in_place`), nothing after it may
    # fail and drop the running sum
    if ctx.needs_input_grad[1]:  # dW = d(pre)^T @ X, the transpose a view, in W's own dtype
        dw = weight_grad(ctx.grad_home, dpre.t(), x, ctx.weight_dtype, grad_acc)
    return dx, dw, dres


@first_order_only("linear")
def _linear_backward(ctx, dy: torch.Tensor):
    return *_linear_grads(ctx, dy), None, None, None, None, None


@first_order_only("linear")
def _linear_relu2_backward(ctx, dy: torch.Tensor | None, dr: torch.Tensor | None):
    if dy is None:  # grads are not materialised: the output was not used
        return (None,) * 7
    return *_linear_grads(ctx, dy), None, None, None, None


@first_order_only("linear")
def _linear_swiglu_backward(ctx, dy: torch.Tensor | None, dpre: torch.Tensor | None):
    if dy is None:  # grads are not materialised: the output was not used
        return None, None, None, None
    return *_linear_grads(ctx, dy)[:2], None, None


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)
linear_relu2_op.register_autograd(_linear_relu2_backward, setup_context=_linear_relu2_setup_context)
linear_swiglu_op.register_autograd(
    _linear_swiglu_backward, setup_context=_linear_swiglu_setup_context
)


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    """View (..., R, C) as (B, R, C); a view whenever the leading dims can be merged."""
    # An explicit batch size rather than -1, which reshape rejects for zero-size tensors.
    return x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])


def _runs_natively(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight_grad: bool, residual: bool = False
) -> bool:
    """Whether an eager call of `bmm` or a plain `linear` (x: its input as given; a, b: the
    operands as our op would take them; residual: a residual of their dtype is added) runs
    PyTorch's own op instead of ours: where all three of its GEMMs would run cuBLAS anyway
    (`matmul_plan.plain_products_on_cublas`),
    PyTorch's op launches the same products, and its C++ autograd node replaces our Python
    one (on an H200 host our linear's forward + backward cost 638 µs of host time on
    autograd's worker thread against PyTorch's 407, bmm's 683 against 354 on the calling
    thread: `overhead_session27.json`). Traced code keeps our ops."""
    if torch.compiler.is_compiling() or is_traced(x):
        return False
    return matmul_plan.plain_products_on_cublas(a, b, weight_grad, residual)


def _plain_linear_natively(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`_runs_natively` for an eager `linear(x, weight)` without epilogue, dropout or
    residual, on its hot path: the checks it needs, and the planner asked without making
    x's 2-D view or weight.t() (`matmul_plan.plain_linear_on_cublas`). False for anything
    `linear`'s full path must look at: a bad shape (it raises there), a wider weight under
    autocast, a weight whose `.grad` takes dW in place. Those are ruled out before the
    tensors are checked: the full path checks them itself."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return False
    if weight.dtype != x.dtype or _grad_home(weight) is not None:
        return False
    if torch.compiler.is_compiling() or is_traced(x):
        return False
    check_triton_tensor(x, "x")
    check_triton_tensor(weight, "weight")
    return matmul_plan.plain_linear_on_cublas(x, weight)


def _check_pair(
    a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str, *, cast_b: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two matmul operands; under torch.autocast cast them to its dtype.

    Autocast does not reach inside a custom op, so without this the Triton path would run
    in fp32 under bf16 autocast (and mixed bf16 activations / fp32 weights would be
    refused). The cast is differentiable: fp32 weights still get fp32 grads. cast_b=False
    leaves b (a weight) as it is under autocast: `linear` casts it without autograd and
    has the GEMM write its gradient in its own dtype.
    """
    for t, name in ((a, name_a), (b, name_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device_type = a.device.type
    mixed = False  # an uncast b under autocast may be wider than a
    if a.is_floating_point() and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        a = a.to(dtype)
        if cast_b:
            b = b.to(dtype)
        mixed = not cast_b and b.is_floating_point()
    if a.dtype != b.dtype and not mixed:
        raise TypeError(f"{name_a} ({a.dtype}) and {name_b} ({b.dtype}) must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"{name_a} ({a.device}) and {name_b} ({b.device}) must share a device")
    return a, b


def bmm(a: torch.Tensor, b: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """Batched matrix product: a (..., M, K) @ b (..., K, N) -> (..., M, N).

    The leading (batch) dims of `a` and `b` must be equal (no broadcasting); plain 2-D
    matrices are fine too. Inputs may be strided views (e.g. k.transpose(-1, -2)): the
    Triton kernels read them in place. fp32 accumulation; the output has the input dtype.
    use_triton on CUDA: the product goes where `matmul_impl` sends it (cuBLAS under "auto").
    """
    a, b = _check_pair(a, b, "a", "b")
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"a and b need at least 2 dims, got a {a.shape} and b {b.shape}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} need equal batch dims")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"a's last dim ({a.shape[-1]}) must equal b's second-to-last ({b.shape[-2]}): "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if not use_triton:
        return torch.matmul(a, b)
    check_triton_tensor(a, "a")
    check_triton_tensor(b, "b")
    if a.dim() == 2:
        if _runs_natively(a, a, b, weight_grad=False):
            return torch.mm(a, b)
        return call_op(bmm_op, a, b)
    a3, b3 = _as_batched(a), _as_batched(b)
    if _runs_natively(a, a3, b3, weight_grad=False):
        return torch.matmul(a, b)
    c = call_op(bmm_op, a3, b3)
    return c.view(*a.shape[:-1], b.shape[-1])


class _WeightCasts:
    """The state of a `reuse_weight_casts` context: low-precision copies of wider weights,
    (id(weight), dtype) -> (weight, its version counter when cast, the copy); the module whose
    nn.Linear weights are cast together at the first cast to a dtype, and the dtypes done."""

    def __init__(self, *modules: nn.Module | None) -> None:
        self.copies: dict[tuple[int, torch.dtype], tuple] = {}
        self.modules = [m for m in modules if m is not None]
        self.batched: set[torch.dtype] = set()
        self.hung: list[torch.Tensor] = []  # weights carrying a copy for traced code
        self.hung_dtype: torch.dtype | None = None

    def hang_copies(self, dtype: torch.dtype) -> None:
        """Set each cast weight's TRACED_CAST attribute to its copy in dtype, for code that
        torch.compile traces inside the context (`_weight_in`)."""
        self.hung_dtype = dtype
        for weight, _, copy in self.copies.values():
            if copy.dtype == dtype:
                setattr(weight, TRACED_CAST, copy)
                self.hung.append(weight)

    def unhang_copies(self) -> None:
        for weight in self.hung:
            if hasattr(weight, TRACED_CAST):
                delattr(weight, TRACED_CAST)
        self.hung.clear()

    def cast_module(self, dtype: torch.dtype) -> None:
        """Cast every nn.Linear weight of the module that is not in dtype, all in one
        `torch._foreach_copy_` (one kernel for the lot, not one launch per weight)."""
        self.batched.add(dtype)
        todo = [w for w in cast_weights(*self.modules, dtype=dtype)
                if (id(w), dtype) not in self.copies]  # fmt: skip
        if not todo:
            return
        copies = [torch.empty_like(w, dtype=dtype) for w in todo]
        with torch.no_grad():
            torch._foreach_copy_(copies, [w.detach() for w in todo])
        for w, copy in zip(todo, copies, strict=True):
            self.copies[id(w), dtype] = (w, w._version, copy)


def cast_weights(*modules: nn.Module, dtype: torch.dtype) -> list[nn.Parameter]:
    """The weights `reuse_weight_casts(module, dtype)` casts: every nn.Linear weight of the
    modules that is a floating tensor of another dtype, each once."""
    weights = {id(m.weight): m.weight for root in modules for m in root.modules()
               if isinstance(m, nn.Linear)}  # fmt: skip
    return [w for w in weights.values() if w.dtype != dtype and w.is_floating_point()]


def trainable_casts(module: nn.Module, dtype: torch.dtype) -> list[nn.Parameter]:
    """`cast_weights` that require grad: those an optimizer can keep copies of
    (`adamw.AdamW.cast_copies`)."""
    return [w for w in cast_weights(module, dtype=dtype) if w.requires_grad]


# The outermost `reuse_weight_casts` context's state (nested ones share it); None outside any.
_weight_casts: _WeightCasts | None = None

# The attribute on a weight that holds its low-precision copy for traced code, while a
# `reuse_weight_casts(module, dtype)` context is open: torch.compile cannot consult the eager
# cache (a global object that changes every step would be a guard failing every step), but
# reads a tensor attribute of a parameter as one more graph input (a new tensor with the same
# metadata each step: no recompilation; a model called both inside and outside such contexts
# compiles one graph for each). Dynamo marks the copy a static input: under
# mode="reduce-overhead", whose CUDA graphs are recorded per static address, each step's new
# copies would make inductor re-record them; the default mode (the trainer's) is not affected.
TRACED_CAST = "_triton_transformer_cast"


@contextlib.contextmanager
def reuse_weight_casts(
    module: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    copies: Iterable[tuple[torch.Tensor, torch.Tensor]] = (),
) -> Iterator[None]:
    """Within this context `linear` casts each wider weight (fp32 under bf16 autocast) to the
    activations' dtype once and reuses that copy: the micro-batches of one optimizer step read
    one bf16 copy per weight instead of casting it again each (the enwik8 config on an H200:
    132 -> 33 cast launches, 379 -> 95 µs per step). A weight changed in place inside the
    context (its version counter moves) is cast again by eager code. Copies are dropped on
    exit; nested contexts share the outer one's (their own module and dtype are ignored).

    module: the first cast to a dtype inside the context casts every nn.Linear weight of
    `module` at once, one `torch._foreach_copy_` kernel instead of one cast kernel per weight
    (the training steps pass the model).
    dtype (with module): cast them at entry, and let code that torch.compile traces inside
    the context read those copies too (it cannot cast lazily: a compiled graph that casts
    does so on every call, once per micro-batch; see TRACED_CAST). Traced code does not see a
    weight changed in place inside the context: keep the weights fixed there, as a training
    step does.
    copies: (weight, copy) pairs of copies that hold their weights' current values, which the
    context takes as its casts instead of casting those weights (`adamw.AdamW.current_copies`:
    written by the last optimizer step). Ignored by a nested context, like module and dtype.
    """
    if dtype is not None and module is None:
        raise ValueError("reuse_weight_casts: a dtype needs the module whose weights to cast")
    global _weight_casts
    outer = _weight_casts
    state = _WeightCasts(module) if outer is None else outer
    if outer is None:
        for weight, copy in copies:
            state.copies[id(weight), copy.dtype] = (weight, weight._version, copy)
    _weight_casts = state
    try:
        if outer is None and dtype is not None:
            state.cast_module(dtype)
            state.hang_copies(dtype)
        yield
    finally:
        if outer is None:
            state.unhang_copies()
        _weight_casts = outer


@contextlib.contextmanager
def fresh_weight_casts(*modules: nn.Module) -> Iterator[None]:
    """`reuse_weight_casts(modules)` with a cache of its own, even inside another context: for
    code captured into a CUDA graph, whose replays must cast the weights themselves rather than
    read an outer context's copies (freed when that context ends). The outer context's copies
    for traced code come off the weights meanwhile, for the same reason."""
    global _weight_casts
    outer = _weight_casts
    hung_dtype = outer.hung_dtype if outer is not None and outer.hung else None
    if hung_dtype is not None:
        outer.unhang_copies()
    _weight_casts = _WeightCasts(*modules)
    try:
        yield
    finally:
        _weight_casts = outer
        if hung_dtype is not None:
            outer.hang_copies(hung_dtype)


def _weight_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """weight's copy in dtype made outside autograd (reused inside `reuse_weight_casts`), or
    None when weight is already in dtype."""
    if weight.dtype == dtype:
        return None
    # is_compiling first: Dynamo then never reads (and guards on) the module global
    if torch.compiler.is_compiling():
        copy = getattr(weight, TRACED_CAST, None)  # see TRACED_CAST
        if copy is not None and copy.dtype == dtype:
            return copy
        return weight.detach().to(dtype)
    if is_traced(weight) or _weight_casts is None:
        return weight.detach().to(dtype)
    casts = _weight_casts
    if casts.modules and dtype not in casts.batched:
        casts.cast_module(dtype)
    key = (id(weight), dtype)
    hit = casts.copies.get(key)
    if hit is not None and hit[0] is weight and hit[1] == weight._version:
        return hit[2]
    copy = weight.detach().to(dtype)
    casts.copies[key] = (weight, weight._version, copy)
    return copy


# ----------------------------------------------------------------------------- eager calls
# An eager `linear(x, weight, "relu_squared")` (no residual; bf16 or fp32, whose backward
# recovers relu(pre) from the output) or `linear(x, weight, "swiglu")` of a layout seen before
# takes that layout's `_EagerPlan`, as `layernorm._EagerPlan`: one key of what the checks and
# the launches read (`utils.eager_plan_key` of x, the weight as the product reads it and the
# seed, the scalars, the planner's switches), one lookup, then the products bound on the
# plan's first calls (`matmul_plan.bind_mm2d`): the forward's, the activation's gradient pass,
# dX's and dW's. The kernels, the saved tensors and the gradients are `linear_op`'s and
# `linear_swiglu_op`'s.


class _EagerPlan:
    """The launches of eager relu² or SwiGLU `linear` calls of one layout: x viewable as
    (M, K) rows, a contiguous weight (N, K) (what `_eager_plan` admits): the products ("fwd",
    "dx", "dw"), and the activation's gradient pass per layout of dy, each bound on the first
    call that can bind it."""

    __slots__ = ("drop_p", "grads", "products", "rows", "x_shape", "y_rows", "y_shape")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, p: float, swiglu: bool) -> None:
        n, k = weight.shape
        n = n // 2 if swiglu else n  # SwiGLU: y (..., H) of weight (2·H, K)
        self.x_shape, self.y_shape = x.shape, (*x.shape[:-1], n)
        self.rows = (x.numel() // k, k) if x.dim() != 2 else None  # None: x is 2-D already
        self.y_rows = (x.numel() // k, n)
        self.drop_p = p
        self.products = matmul_plan.BoundProducts()
        self.grads: dict[tuple, Callable | None] = {}

    def forward(self, x, w, seed) -> torch.Tensor:
        """dropout(relu(x @ w.T)²), shaped (..., N), as `linear_op` writes it."""
        y = torch.empty(size=self.y_shape, dtype=x.dtype, device=x.device)
        x2 = x if self.rows is None else x.view(self.rows)
        y2 = y if self.rows is None else y.view(self.y_rows)
        drop = (self.drop_p, seed) if self.drop_p > 0.0 else None
        self.products.run("fwd", x2, w.t(), y2, True, drop)
        return y

    def backward(self, dy, x, w, y, seed, home, weight_dtype, needs) -> tuple:
        """(dx, dweight) as `linear_op`'s backward gives them: d(pre) = dy · 2·relu(pre) [·
        mask / (1 - p)] (relu(pre) from y), dX = d(pre) @ W, dW = d(pre)^T @ X in the
        weight's dtype (added into home.grad where `bmm._foldable`)."""
        y2 = y if self.rows is None else y.view(self.y_rows)
        dy2 = dy if self.rows is None else dy.reshape(self.y_rows)
        dpre = torch.empty(size=self.y_rows, dtype=y.dtype, device=y.device)
        key = (dy2.stride(), *tensor_facts(dy2))
        grad = self.grads.get(key)
        if grad is not None:
            grad(dy2, y2, dpre, seed)
        else:
            drop = (self.drop_p, seed) if self.drop_p > 0.0 else None
            self.grads[key] = launch_relu2_grad(dy2, y2, dpre, True, drop, bind=True)
        return self.input_grads(dpre, x, w, home, weight_dtype, needs)

    def input_grads(self, dpre, x, w, home, weight_dtype, needs) -> tuple:
        """(dx, dweight): dX = d(pre) @ W, dW = d(pre)^T @ X in the weight's dtype (added
        into home.grad where `bmm._foldable`); None where `needs` says no."""
        dx = dw = None
        if needs[0]:
            dx = torch.empty(size=self.x_shape, dtype=dpre.dtype, device=dpre.device)
            self.products.run("dx", dpre, w, dx if self.rows is None else dx.view(self.rows))
        if needs[1]:
            x2 = x if self.rows is None else x.view(self.rows)
            dw = bound_weight_grad(self.products, "dw", home, dpre.t(), x2, weight_dtype)
        return dx, dw

    def swiglu_forward(self, x, w) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, pre) as `linear_swiglu_op` writes them: y = silu(x @ W_gate.T) * (x @ W_up.T)
        shaped (..., H), pre = x @ w.T (M, 2·H), [gate | up]."""
        M, H = self.y_rows
        y = torch.empty(size=self.y_shape, dtype=x.dtype, device=x.device)
        pre = torch.empty(size=(M, 2 * H), dtype=x.dtype, device=x.device)
        x2 = x if self.rows is None else x.view(self.rows)
        y2 = y if self.rows is None else y.view(self.y_rows)
        self.products.run("fwd", x2, w.t(), y2, swiglu_pre=pre)
        return y, pre

    def swiglu_backward(self, dy, x, w, pre, home, weight_dtype, needs) -> tuple:
        """(dx, dweight) as `linear_swiglu_op`'s backward gives them: d(pre) = [d(gate) |
        d(up)] (`linear_swiglu_backward_op`), then `input_grads`."""
        M, H = self.y_rows
        dy2 = dy if self.rows is None else dy.reshape(self.y_rows)
        dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()  # e.g. sum()'s stride 0
        dpre = torch.empty(size=(M, 2 * H), dtype=pre.dtype, device=pre.device)
        key = (dy2.stride(), *tensor_facts(dy2))
        grad = self.grads.get(key)
        if grad is not None:
            grad(dy2, pre[:, :H], pre[:, H:], dpre, dy2)
        else:
            self.grads[key] = launch_swiglu_bwd(
                dy2, pre[:, :H], pre[:, H:], dpre[:, :H], dpre[:, H:], dpre, bind=True
            )
        return self.input_grads(dpre, x, w, home, weight_dtype, needs)


def bound_weight_grad(products, slot, home, a, b, dtype) -> torch.Tensor:
    """A weight's gradient a @ b in its dtype for an eager plan's backward (`_EagerPlan`,
    `mlp._EagerPlan`): added into home.grad where `_foldable` (`weight_grad`), else a fresh
    tensor through the plan's bound product `slot` (`matmul_plan.BoundProducts`)."""
    if home is not None and _foldable(home, dtype, b):
        return weight_grad(home, a, b, dtype)
    dw = torch.empty(size=(a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
    products.run(slot, a, b, dw)
    return dw


_EAGER_PLANS = LaunchPlans()


def _drops(p: object) -> bool:
    """Whether `linear`'s dropout_p asks for a dropout (a number above 0; a bad one is
    refused by the checks)."""
    return type(p) in (float, int) and p > 0


def _eager_plan(x, weight, w, activation, residual, dropout_p, seed) -> _EagerPlan | None:
    """The plan of this eager `linear` call's layout (w: the weight as the product reads it,
    seed: the dropout's), made on its first call; None where the generic path runs: no
    activation, a residual, relu² in fp16 (relu(pre) is saved there), traced or empty
    tensors, or a layout the plan does not cover. The caller has checked x and weight
    (`_check_pair`)."""
    if activation not in ("relu_squared", "swiglu") or residual is not None:
        return None
    switches = (matmul_plan.matmul_impl, matmul_plan._FORCE_PATH)
    key, plan = _EAGER_PLANS.find((x, w, seed), (activation, dropout_p, weight.dtype, *switches))
    if key is None or plan is not None:
        return plan
    p = check_dropout_p(dropout_p)
    swiglu = activation == "swiglu"
    dtypes = (
        (torch.float32, torch.bfloat16, torch.float16)
        if swiglu
        else (torch.float32, torch.bfloat16)
    )
    if x.dtype not in dtypes or not w.is_contiguous() or (swiglu and p > 0.0):
        return None  # (a SwiGLU dropout: the generic path raises)
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1] or w.dtype != x.dtype:
        return None  # the generic path raises
    if swiglu and w.shape[0] % 2:
        return None
    check_triton_tensor(x, "x")
    check_triton_tensor(w, "weight")
    if x.numel() == 0 or w.numel() == 0 or not has_rows_view(x):
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(x, w, p, swiglu))


class _EagerLinear(torch.autograd.Function):
    """`linear_op` with relu² and its registered backward for an eager call of a planned
    layout: returns y (..., N)."""

    @staticmethod
    def forward(ctx, x, weight, w, seed, plan):
        y = plan.forward(x, w, seed)
        ctx.save_for_backward(x, w, y, seed)
        ctx.plan, ctx.weight_dtype, ctx.grad_home = plan, weight.dtype, _grad_home(weight)
        return y

    @staticmethod
    @first_order_only("linear")
    def backward(ctx, dy):
        x, w, y, seed = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw = ctx.plan.backward(dy, x, w, y, seed, ctx.grad_home, ctx.weight_dtype, needs)
        return dx, dw, None, None, None


_apply_eager_linear = eager_apply(_EagerLinear)


class _EagerSwigluLinear(torch.autograd.Function):
    """`linear_swiglu_op` and its registered backward for an eager call of a planned layout:
    returns y (..., H)."""

    @staticmethod
    def forward(ctx, x, weight, w, plan):
        y, pre = plan.swiglu_forward(x, w)
        ctx.save_for_backward(x, w, pre)
        ctx.plan, ctx.weight_dtype, ctx.grad_home = plan, weight.dtype, _grad_home(weight)
        return y

    @staticmethod
    @first_order_only("linear")
    def backward(ctx, dy):
        x, w, pre = ctx.saved_tensors
        needs = ctx.needs_input_grad
        plan = ctx.plan
        dx, dw = plan.swiglu_backward(dy, x, w, pre, ctx.grad_home, ctx.weight_dtype, needs)
        return dx, dw, None, None


_apply_eager_swiglu = eager_apply(_EagerSwigluLinear)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = None,
    use_triton: bool = False,
    residual: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """dropout(act(x @ weight.T)) [+ residual], like F.linear without bias: x (..., K),
    weight (N, K); returns (..., N), or (..., N / 2) with "swiglu".

    activation: None or "relu_squared" (relu(y)², fused into the matmul's epilogue, or a
        pass of its own after cuBLAS's product where `MATMUL_TABLE` says "cublas+ew"), or
        "swiglu": weight (2·H, K) holds the gate rows then the up rows (a Llama feed-forward's
        fused input projection) and the result (..., H) is silu(x @ W_gate.T) * (x @ W_up.T),
        as `swiglu.swiglu` of the two halves (fp32 arithmetic for fp16/bf16, one rounding).
        Triton: `swiglu.py`'s gating pass after cuBLAS's product into the (..., 2·H)
        pre-activations the backward reads (what the unfused projection + swiglu kept), or
        the gating in the matmul's epilogue (two accumulators per output tile, writing the
        pre-activations too) where `MATMUL_TABLE` lists it or cuBLAS cannot compute the
        product (the fused kernel measured no faster on an H200). No dropout nor residual
        with it (apply `dropout` after, as `FeedForward` does).
    dropout_p: dropout on the activation's output, in [0, 1) (relu_squared only; pass 0
        outside training). Triton: drawn in the same epilogue from `seed` (a 0-dim int64
        device tensor; None draws one, `utils.draw_seed`), and the backward's d(pre) pass
        regenerates the mask: no dropout kernels, no mask stored. PyTorch: F.dropout.
    residual: optional tensor shaped like the output (..., N), added last in the same
    epilogue (e.g. the model's `h + proj_out(...)`); the output dtype is x's
    promoted with the residual's. The weight gradient is reduced over all leading dims of x
    in one deterministic matmul (no atomics). Under torch.autocast x is cast to its dtype and
    a wider (fp32) weight is read through a copy in that dtype: the Triton path's dW GEMM
    writes the fp32 gradient directly, never rounded to bf16 nor cast in a separate pass.
    """
    x, weight = _check_pair(x, weight, "x", "weight", cast_b=False)
    cast = None  # the weight in x's dtype, once an eager relu² call below has made it
    # the common eager call first: no epilogue, dropout (a plain 0, not a bool: the full path
    # rejects those) or residual
    plain = activation is None and residual is None and type(dropout_p) in (float, int)
    if use_triton and plain and dropout_p == 0 and _plain_linear_natively(x, weight):
        return F.linear(x, weight)
    if use_triton and activation is not None:
        # fresh seed drawn before the key: its alignment is part of it
        drawn = seed_or_draw(seed, x.device) if _drops(dropout_p) else None
        w = weight if weight.dtype == x.dtype else _weight_in(weight, x.dtype)
        plan = _eager_plan(x, weight, w, activation, residual, dropout_p, drawn)
        if plan is not None:
            records = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            if activation == "swiglu":
                return (
                    _apply_eager_swiglu(x, weight, w, plan)
                    if records
                    else (plan.swiglu_forward(x, w)[0])
                )
            if records:
                return _apply_eager_linear(x, weight, w, drawn, plan)
            return plan.forward(x, w, drawn)
        seed, cast = (drawn if drawn is not None else seed), w
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    dropout_p = check_dropout_p(dropout_p)
    if dropout_p > 0.0 and activation != "relu_squared":
        raise ValueError("dropout_p > 0 needs activation='relu_squared'")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's second dim ({weight.shape[1]}): "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    swiglu = activation == "swiglu"
    if swiglu:
        if weight.shape[0] % 2:
            raise ValueError(
                "activation='swiglu' needs a weight of 2·H rows (gate, then up), got "
                f"{weight.shape[0]}"
            )
        if residual is not None:
            raise ValueError("activation='swiglu' takes no residual: add it after")
        if not use_triton:  # the reference: the projection, then swiglu's own reference
            gate, up = F.linear(x, weight).chunk(2, dim=-1)
            return _swiglu_reference(gate, up)
    out_shape = (*x.shape[:-1], weight.shape[0])
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if tuple(residual.shape) != out_shape:
            raise ValueError(
                f"residual must have the output's shape {out_shape}, got {tuple(residual.shape)}"
            )
    relu_squared = activation == "relu_squared"
    if not use_triton:
        y = F.linear(x, weight)
        if relu_squared:
            y = F.relu(y)
            y = y * y  # not y.square(): CUDA autocast would run pow in fp32
        if dropout_p > 0.0:
            y = F.dropout(y, dropout_p)
        return y if residual is None else y + residual
    check_triton_tensor(x, "x")
    check_triton_tensor(weight, "weight")
    two_d = x.dim() == 2  # the common case: no reshapes on the way in or out
    M = x.shape[0] if two_d else math.prod(x.shape[:-1])
    x2 = x if two_d else x.reshape(M, x.shape[-1])
    r2 = None
    if residual is not None:
        check_triton_tensor(residual, "residual")
        r2 = residual if two_d else residual.reshape(M, weight.shape[0])
    # The backward needs relu(pre) itself (fp16, or a residual: see the module docstring).
    save_relu = (
        relu_squared
        and (x.dtype == torch.float16 or r2 is not None)
        and torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (r2 is not None and r2.requires_grad))
    )
    seed = seed_or_draw(seed, x.device) if dropout_p > 0.0 else None
    # Mixed precision (autocast left an fp32 weight uncast): the product reads a copy in x's
    # dtype, made outside autograd (once per step in `reuse_weight_casts`); the op returns the
    # weight's gradient in fp32 directly.
    weight_lp = _weight_in(weight, x.dtype) if cast is None else (None if cast is weight else cast)
    # a residual of the product's dtype and no other epilogue: PyTorch's own op where cuBLAS
    # runs all three GEMMs anyway (without a residual, `_plain_linear_natively` asked above)
    plain = activation is None and weight_lp is None and r2 is not None and r2.dtype == x.dtype
    # (not while `.grad` takes dW in place)
    if plain and _grad_home(weight) is None and _runs_natively(x, x2, weight.t(), True, True):
        y2 = matmul_plan.residual_product(r2, x2, weight.t())  # as `_mm2d_into` would
        return y2 if two_d else y2.view(out_shape)
    grad_acc = _traced_grad_acc(weight)  # None outside traced training steps
    if swiglu:
        y2 = call_op(linear_swiglu_op, x2, weight, weight_lp, grad_acc)[0]
        return y2 if two_d else y2.view(*x.shape[:-1], weight.shape[0] // 2)
    if save_relu:
        y2 = call_op(linear_relu2_op, x2, weight, r2, dropout_p, seed, weight_lp, grad_acc)[0]
    else:
        y2 = call_op(linear_op, x2, weight, r2, relu_squared, dropout_p, seed, weight_lp, grad_acc)
    return y2 if two_d else y2.view(out_shape)
