"""The relu² feed-forward, dropout(relu(x @ W_in.T)²) @ W_out.T, as one op whose backward
makes relu²'s gradient inside the product that needs it.

Shapes: x (M, D), W_in (H, D), W_out (D, H); h = dropout(relu(x @ W_in.T)²) (M, H); out (M, D).

Forward, as `linear(x, W_in, "relu_squared")` then `linear(h, W_out)`:
    h   = relu(x @ W_in.T)² · keep / (1 - p)     (relu² and the dropout in the matmul epilogue)
    out = h @ W_out.T                              (cuBLAS)

Backward, from dout (M, D); relu(pre) = sqrt(h · (1 - p)) where the mask kept it:
    dW_out = dout.T @ h                                        (cuBLAS)
    d(pre) = (dout @ W_out) · 2·relu(pre) · keep / (1 - p)    (our matmul, RELU2_GRAD epilogue)
    dx     = d(pre) @ W_in,  dW_in = d(pre).T @ x              (cuBLAS)

The two linears' backward wrote dh = dout @ W_out (M, H) and read it back with h in a pass of
its own to make d(pre): three M×H tensors of memory traffic per layer (about 300 MB at GPT-2's
16,384 tokens × 3,072) that the epilogue does not move. d(pre) is cuBLAS's product and that
pass, in place, where the pair measured faster (`matmul_plan.MATMUL_TABLE`, "+relu2grad":
"cublas+ew"), with a dropout mask unless the table says "fused" (the mask's draws slow the
epilogue more than the pass costs at two of the three presets' shapes), and while
torch.compile traces without the TMA kernel.

relu(pre) = sqrt(h (1 - p)) needs h not to underflow (see `bmm.py`'s "relu² backward"): bf16
and fp32 only. fp16 runs the two linears, whose relu² saves relu(pre) itself.

Eager calls of a layout seen before take that layout's `_EagerPlan` (the same products,
bound: `matmul_plan.BoundProducts`).

Ops (torch.library triton_ops, traced by torch.compile, captured by CUDA graphs):
- `triton_transformer::relu2_mlp(x, w_in, w_out, p, seed, w_in_lp, w_out_lp, w_in_acc,
  w_out_acc)`: (out, h).
- `triton_transformer::mm_relu2_grad(dy, w, s, from_square, p, seed)`: d(pre) = (dy @ w) ·
  2·relu(pre) [· mask / (1 - p)], relu(pre) = sqrt(s (1 - p)) if from_square else s.
"""

from __future__ import annotations

import math

import torch
from torch.library import triton_op

from triton_transformer import matmul_plan
from triton_transformer.bmm import (
    _check_epilogue_dropout,
    _check_pair,
    _drops,
    _grad_home,
    _traced_grad_acc,
    _weight_in,
    bmm_op,
    bound_weight_grad,
    linear,
    weight_grad,
)
from triton_transformer.matmul_plan import BoundProducts, _mm2d_into
from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    check_dropout_p,
    check_triton_tensor,
    eager_apply,
    first_order_only,
    has_rows_view,
    seed_or_draw,
    tensor_facts,
)


@triton_op("triton_transformer::mm_relu2_grad", mutates_args=())
def mm_relu2_grad_op(
    dy: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    from_square: bool,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(pre) = (dy @ w) · 2·relu(pre) [· keep / (1 - p)] (M, N), contiguous in dy's dtype, for
    dy (M, K), w (K, N) and s (M, N) (any strides): relu(pre) = sqrt(s (1 - p)) if from_square
    (s: relu²'s output, after its dropout) else s. The mask is the forward epilogue's,
    regenerated from `seed`."""
    _check_epilogue_dropout(p, seed, True)
    dpre = torch.empty(size=(dy.shape[0], w.shape[1]), device=dy.device, dtype=dy.dtype)
    drop = (p, seed) if p > 0.0 else None
    _mm2d_into(dy, w, dpre, drop=drop, grad=(s, from_square))
    return dpre


@triton_op("triton_transformer::relu2_mlp", mutates_args=())
def relu2_mlp_op(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    w_in_lp: torch.Tensor | None = None,
    w_out_lp: torch.Tensor | None = None,
    w_in_acc: torch.Tensor | None = None,
    w_out_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h @ W_out.T, h), h = dropout_p(relu(x @ W_in.T)²), for 2-D x (M, D) (bf16 or fp32), w_in
    (H, D), w_out (D, H); the dropout (p > 0) draws its mask from `seed`, a 0-dim int64 device
    tensor. w_in_lp / w_out_lp: the weights in x's dtype when they are wider (an fp32 weight
    under bf16 autocast), else None; the products read them, the weight gradients come back in
    the weights' own dtype. w_in_acc / w_out_acc: the weights' `.grad` in traced training
    steps, which the backward adds their gradients into (`bmm.linear_op`'s grad_acc), else
    None. h (M, H) is the output the backward reads."""
    _check_epilogue_dropout(p, seed, True)
    wi = w_in if w_in_lp is None else w_in_lp
    wo = w_out if w_out_lp is None else w_out_lp
    M = x.shape[0]
    h = torch.empty(size=(M, wi.shape[0]), device=x.device, dtype=x.dtype)
    _mm2d_into(x, wi.t(), h, True, None, None, (p, seed) if p > 0.0 else None)
    out = torch.empty(size=(M, wo.shape[0]), device=x.device, dtype=x.dtype)
    _mm2d_into(h, wo.t(), out)
    return out, h


def _relu2_mlp_setup_context(ctx, inputs, output) -> None:
    x, w_in, w_out, ctx.p, seed, w_in_lp, w_out_lp, w_in_acc, w_out_acc = inputs
    ctx.w_dtypes = (w_in.dtype, w_out.dtype)
    ctx.grad_homes = (_grad_home(w_in), _grad_home(w_out))  # see bmm.accumulate_grads_in_place
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # h gets no gradient: no M×H zero tensor for it
    ctx.save_for_backward(
        x, w_in if w_in_lp is None else w_in_lp, w_out if w_out_lp is None else w_out_lp,
        output[1], seed if ctx.p > 0.0 else None, w_in_acc, w_out_acc,
    )  # fmt: skip


@first_order_only("relu2_mlp")
def _relu2_mlp_backward(ctx, dout: torch.Tensor | None, _dh: torch.Tensor | None):
    if dout is None:  # grads are not materialised: the output was not used
        return (None,) * 9
    # the weights as the products read them; accs: see `bmm.accumulate_grads_in_place`
    x, w_in, w_out, h, seed, w_in_acc, w_out_acc = ctx.saved_tensors
    dout = dout.to(x.dtype)
    dx = dw_in = dw_out = dpre = None
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        dpre = call_op(mm_relu2_grad_op, dout, w_out, h, True, ctx.p, seed)
        if ctx.needs_input_grad[0]:  # dX = d(pre) @ W_in
            dx = call_op(bmm_op, dpre, w_in)
    # the weight gradients last: added in place into .grad (`bmm.accumulate_grads_in_place`),
    # nothing after them may fail and drop the running sums
    if ctx.needs_input_grad[1]:  # dW_in = d(pre)^T @ X
        dw_in = weight_grad(ctx.grad_homes[0], dpre.t(), x, ctx.w_dtypes[0], w_in_acc)
    if ctx.needs_input_grad[2]:  # dW_out = dout^T @ h, in W_out's own dtype
        dw_out = weight_grad(ctx.grad_homes[1], dout.t(), h, ctx.w_dtypes[1], w_out_acc)
    return dx, dw_in, dw_out, None, None, None, None, None, None


relu2_mlp_op.register_autograd(_relu2_mlp_backward, setup_context=_relu2_mlp_setup_context)


# ----------------------------------------------------------------------------- eager calls
# An eager bf16 / fp32 `relu2_mlp` call of a layout seen before takes that layout's
# `_EagerPlan`, as `bmm._EagerPlan`: one key of what the checks and the launches read, one
# lookup, then its four products bound on their first calls (`matmul_plan.BoundProducts`):
# h = relu(x @ W_in.T)², out = h @ W_out.T, and the backward's d(pre), dX, dW_in, dW_out.
# The kernels, the saved tensors and the gradients are `relu2_mlp_op`'s.


class _EagerPlan:
    """The launches of eager `relu2_mlp` calls of one layout: x viewable as (M, D) rows,
    contiguous weights (what `_eager_plan` admits). The backward's products that read dout
    are bound per layout of dout."""

    __slots__ = ("drop_p", "h_rows", "products", "rows", "x_shape")

    def __init__(self, x: torch.Tensor, wi: torch.Tensor, p: float) -> None:
        hidden, dim = wi.shape
        rows = x.numel() // dim
        self.x_shape = x.shape  # out's too: D -> H -> D
        self.rows = (rows, dim) if x.dim() != 2 else None  # None: x is 2-D already
        self.h_rows = (rows, hidden)
        self.drop_p = p
        self.products = BoundProducts()

    def forward(self, x, wi, wo, seed) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (..., D), h (M, H)) as `relu2_mlp_op` computes them."""
        x2 = x if self.rows is None else x.view(self.rows)
        h = torch.empty(size=self.h_rows, dtype=x.dtype, device=x.device)
        out = torch.empty(size=self.x_shape, dtype=x.dtype, device=x.device)
        drop = (self.drop_p, seed) if self.drop_p > 0.0 else None
        self.products.run("h", x2, wi.t(), h, True, drop)
        self.products.run("out", h, wo.t(), out if self.rows is None else out.view(self.rows))
        return out, h

    def backward(self, dout, x, wi, wo, h, seed, homes, w_dtypes, needs) -> tuple:
        """(dx, dw_in, dw_out) as `relu2_mlp_op`'s backward gives them."""
        dout = dout.to(x.dtype)
        dout2 = dout if self.rows is None else dout.reshape(self.rows)
        x2 = x if self.rows is None else x.view(self.rows)
        layout = (dout2.stride(), *tensor_facts(dout2))
        products = self.products
        dx = dw_in = dw_out = None
        if needs[0] or needs[1]:  # d(pre) = (dout @ W_out) · 2·relu(pre) [· mask / (1 - p)]
            dpre = torch.empty(size=self.h_rows, dtype=dout.dtype, device=dout.device)
            drop = (self.drop_p, seed) if self.drop_p > 0.0 else None
            products.run(("dpre", layout), dout2, wo, dpre, False, drop, (h, True))
            if needs[0]:  # dX = d(pre) @ W_in
                dx = torch.empty(size=self.x_shape, dtype=dpre.dtype, device=dpre.device)
                products.run("dx", dpre, wi, dx if self.rows is None else dx.view(self.rows))
        # the weight gradients last, as the op's backward (`bmm.accumulate_grads_in_place`)
        if needs[1]:  # dW_in = d(pre)^T @ X
            dw_in = bound_weight_grad(products, "dw_in", homes[0], dpre.t(), x2, w_dtypes[0])
        if needs[2]:  # dW_out = dout^T @ h
            dw_out = bound_weight_grad(
                products, ("dw_out", layout), homes[1], dout2.t(), h, w_dtypes[1]
            )
        return dx, dw_in, dw_out


_EAGER_PLANS = LaunchPlans()


def _eager_plan(x, w_in, w_out, wi, wo, dropout_p, seed) -> _EagerPlan | None:
    """The plan of this eager call's layout (wi, wo: the weights as the products read them,
    seed: the dropout's), made on its first call after the checks; None where the generic
    path runs: traced or empty tensors, fp16, or a layout the plan does not cover."""
    switches = (matmul_plan.matmul_impl, matmul_plan._FORCE_PATH)
    scalars = (dropout_p, w_in.dtype, w_out.dtype, *switches)
    key, plan = _EAGER_PLANS.find((x, wi, wo, seed), scalars)
    if key is None or plan is not None:
        return plan
    p = _check_mlp_args(x, w_in, w_out, dropout_p, True)
    if x.dtype not in (torch.float32, torch.bfloat16) or x.numel() == 0 or wi.numel() == 0:
        return None
    if not (wi.is_contiguous() and wo.is_contiguous() and has_rows_view(x)):
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(x, wi, p))


class _EagerMLP(torch.autograd.Function):
    """`relu2_mlp_op` and its registered backward for an eager call of a planned layout:
    returns out (..., D)."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, wi, wo, seed, plan):
        out, h = plan.forward(x, wi, wo, seed)
        ctx.save_for_backward(x, wi, wo, h, seed)
        ctx.plan, ctx.w_dtypes = plan, (w_in.dtype, w_out.dtype)
        ctx.grad_homes = (_grad_home(w_in), _grad_home(w_out))
        return out

    @staticmethod
    @first_order_only("relu2_mlp")
    def backward(ctx, dout):
        x, wi, wo, h, seed = ctx.saved_tensors
        grads = ctx.plan.backward(
            dout, x, wi, wo, h, seed, ctx.grad_homes, ctx.w_dtypes, ctx.needs_input_grad
        )  # fmt: skip
        return *grads, None, None, None, None


_apply_eager_mlp = eager_apply(_EagerMLP)


def _check_mlp_args(x, w_in, w_out, dropout_p, use_triton: bool) -> float:
    """`relu2_mlp`'s checks (x and w_in passed `bmm._check_pair`); returns dropout_p."""
    dropout_p = check_dropout_p(dropout_p)
    if w_in.dim() != 2 or not isinstance(w_out, torch.Tensor) or w_out.dim() != 2:
        shape = getattr(w_out, "shape", None)
        raise ValueError(f"w_in and w_out must be 2-D, got {tuple(w_in.shape)} and {shape}")
    if x.dim() < 1 or x.shape[-1] != w_in.shape[1] or tuple(w_out.shape) != w_in.shape[::-1]:
        raise ValueError(
            f"need x (..., D), w_in (H, D), w_out (D, H): x {tuple(x.shape)}, "
            f"w_in {tuple(w_in.shape)}, w_out {tuple(w_out.shape)}"
        )
    if w_out.device != x.device:
        raise ValueError(f"x ({x.device}) and w_out ({w_out.device}) must share a device")
    if w_out.dtype != w_in.dtype:
        raise TypeError(f"w_in ({w_in.dtype}) and w_out ({w_out.dtype}) must have one dtype")
    if use_triton and x.dtype != torch.float16:
        check_triton_tensor(x, "x")
        check_triton_tensor(w_in, "w_in")
        check_triton_tensor(w_out, "w_out")
    return dropout_p


def relu2_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    use_triton: bool = False,
    *,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """dropout(relu(x @ w_in.T)²) @ w_out.T: x (..., D), w_in (H, D), w_out (D, H) -> (..., D).

    Exactly `linear(linear(x, w_in, "relu_squared", dropout_p=...), w_out)`, which the PyTorch
    branch runs (and the Triton branch for fp16); the Triton branch for bf16/fp32 is one op
    whose backward computes relu²'s gradient in the epilogue of the product dout @ w_out (see
    the module docstring). dropout_p / seed as in `bmm.linear`; autocast as there (x cast, wider
    weights read through copies in x's dtype, their gradients in their own dtype).
    """
    x, w_in = _check_pair(x, w_in, "x", "w_in", cast_b=False)
    casts = None  # the weights in x's dtype, once the eager path below has made them
    if use_triton and x.dtype != torch.float16 and isinstance(w_out, torch.Tensor):
        # a fresh seed drawn before the key: its alignment is part of it
        drawn = seed_or_draw(seed, x.device) if _drops(dropout_p) else None
        casts = (w_in if w_in.dtype == x.dtype else _weight_in(w_in, x.dtype),
                 w_out if w_out.dtype == x.dtype else _weight_in(w_out, x.dtype))  # fmt: skip
        plan = _eager_plan(x, w_in, w_out, *casts, dropout_p, drawn)
        if plan is not None:
            if torch.is_grad_enabled() and (
                x.requires_grad or w_in.requires_grad or w_out.requires_grad
            ):
                return _apply_eager_mlp(x, w_in, w_out, *casts, drawn, plan)
            return plan.forward(x, *casts, drawn)[0]
        seed = drawn if drawn is not None else seed
    dropout_p = _check_mlp_args(x, w_in, w_out, dropout_p, use_triton)
    if not use_triton or x.dtype == torch.float16:
        h = linear(
            x, w_in, "relu_squared", use_triton=use_triton, dropout_p=dropout_p, seed=seed
        )  # fmt: skip
        return linear(h, w_out, use_triton=use_triton)
    two_d = x.dim() == 2
    x2 = x if two_d else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    seed = seed_or_draw(seed, x.device) if dropout_p > 0.0 else None
    if casts is None:
        casts = (_weight_in(w_in, x.dtype), _weight_in(w_out, x.dtype))
    w_in_lp, w_out_lp = (None if c is w else c for c, w in zip(casts, (w_in, w_out), strict=True))
    accs = _traced_grad_acc(w_in), _traced_grad_acc(w_out)  # None outside traced steps
    out = call_op(relu2_mlp_op, x2, w_in, w_out, dropout_p, seed, w_in_lp, w_out_lp, *accs)[0]
    return out if two_d else out.view(*x.shape[:-1], w_out.shape[0])
