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

from triton_transformer.bmm import (
    _check_epilogue_dropout,
    _check_pair,
    _grad_home,
    _traced_grad_acc,
    _weight_in,
    bmm_op,
    linear,
    weight_grad,
)
from triton_transformer.matmul_plan import _mm2d_into
from triton_transformer.utils import (
    call_op,
    check_dropout_p,
    check_triton_tensor,
    first_order_only,
    seed_or_draw,
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
    dpre = torch.empty((dy.shape[0], w.shape[1]), device=dy.device, dtype=dy.dtype)
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
    h = torch.empty((M, wi.shape[0]), device=x.device, dtype=x.dtype)
    _mm2d_into(x, wi.t(), h, True, None, None, (p, seed) if p > 0.0 else None)
    out = torch.empty((M, wo.shape[0]), device=x.device, dtype=x.dtype)
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
    if not use_triton or x.dtype == torch.float16:
        h = linear(
            x, w_in, "relu_squared", use_triton=use_triton, dropout_p=dropout_p, seed=seed
        )  # fmt: skip
        return linear(h, w_out, use_triton=use_triton)
    check_triton_tensor(x, "x")
    check_triton_tensor(w_in, "w_in")
    check_triton_tensor(w_out, "w_out")
    two_d = x.dim() == 2
    x2 = x if two_d else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    seed = seed_or_draw(seed, x.device) if dropout_p > 0.0 else None
    w_in_lp, w_out_lp = _weight_in(w_in, x.dtype), _weight_in(w_out, x.dtype)
    accs = _traced_grad_acc(w_in), _traced_grad_acc(w_out)  # None outside traced steps
    out = call_op(relu2_mlp_op, x2, w_in, w_out, dropout_p, seed, w_in_lp, w_out_lp, *accs)[0]
    return out if two_d else out.view(*x.shape[:-1], w_out.shape[0])
