"""Fused residual add (+ optional dropout) + LayerNorm: the pre-norm block boundary in one kernel.

`residual_layernorm(h, branch, weight, bias, dropout_p=..., eps=..., stable=...)` returns

    h_new = h + dropout(branch, dropout_p, training)
    y     = layernorm(h_new, weight, bias, eps, stable)

`use_triton=False` runs exactly that in PyTorch (F.dropout, then `layernorm.layernorm`'s
reference) and defines the semantics. With `use_triton=True` one kernel reads h and branch
once and writes h_new and y (4 tensor passes instead of 7 for add + LayerNorm as two ops), and
one backward kernel reads h_new, dy and the downstream gradient of h_new and writes
dh = dh_new_total and d(branch) (the same tensor when there is no dropout and the dtypes
agree: no extra write), plus dweight/dbias through the deterministic partial-sum scheme of
`layernorm.py` (whose kernels this op shares).

Dropout draws its mask in the kernel from Philox, keyed by a seed that is a 0-dim device
tensor from torch's generator (`utils.draw_seed`) and by the (row, column) of the element: the
package's one scheme (`_jit_helpers.dropout_keep_tile`, the mask `dropout.dropout` draws for
the same (rows, N) tensor). The backward regenerates the mask from the saved seed (the mask is
never stored). So CUDA graph
replays draw fresh masks, `torch.manual_seed` reproduces them, and torch.compile sees no
`.item()`. The Triton mask is not the one `F.dropout` draws (different generators).

dtypes: h_new (and y) take torch's promoted dtype of (h, branch) (e.g. an fp32 residual
stream plus a bf16 branch under autocast gives fp32, as `h + branch` would); the gradients
take the dtypes of h and branch.

In a pre-norm transformer the add of one sub-layer and the norm of the next become one call,
with the existing LayerNorm modules' parameters (state dicts unchanged):

    y = blocks[0].attn.norm(h)
    for i, block in enumerate(blocks):
        a = block.attn.body(y)                        # everything after the attention's norm
        h, y = residual_layernorm(h, a, block.ff.norm.weight, block.ff.norm.bias, ...)
        f = block.ff.body(y)                          # everything after the FF's norm
        nxt = blocks[i + 1].attn.norm if i + 1 < len(blocks) else final_norm
        h, y = residual_layernorm(h, f, nxt.weight, nxt.bias, stable=nxt.stable, ...)
    logits = to_logits(y)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import triton_op

from triton_transformer.bmm import _grad_home, _traced_grad_acc, folded_grads, grad_targets
from triton_transformer.layernorm import (
    _layernorm_reference,
    bound_grads,
    check_layernorm_args,
    check_out_dtype,
    check_residual_branch,
    launch_layernorm_bwd,
    launch_layernorm_fwd,
    param_grads,
    plain_params,
)
from triton_transformer.utils import (
    LaunchPlans,
    accumulates_grads,
    as_rows,
    call_op,
    default,
    eager_apply,
    exists,
    first_order_only,
    has_rows_view,
    seed_or_draw,
    tensor_facts,
)


@triton_op("triton_transformer::residual_layernorm", mutates_args=())
def residual_layernorm_op(
    h: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stable: bool,
    p: float,
    seed: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    weight_acc: torch.Tensor | None = None,
    bias_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_new, y, stats) with h_new = h + dropout_p(branch) (mask from `seed`, a 0-dim int64
    device tensor; unused when p == 0), y = layernorm(h_new) in out_dtype (None: h_new's);
    both new contiguous tensors shaped like h. stats (2 or 3, rows) fp32 as in
    `layernorm_op`; weight_acc, bias_acc as there."""
    N = h.shape[-1]
    h2, br2 = as_rows(h), as_rows(branch)
    M = h2.shape[0]
    dtype = torch.promote_types(h.dtype, branch.dtype)
    h_new = torch.empty(size=h.shape, dtype=dtype, device=h.device)
    y = torch.empty(size=h.shape, dtype=out_dtype or dtype, device=h.device)
    stats = torch.empty(size=(3 if stable else 2, M), dtype=torch.float32, device=h.device)
    launch_layernorm_fwd(h_new.view(M, N), weight.contiguous(), bias, y.view(M, N), stats, eps,
                         stable, h2=h2, br2=br2, p=p, seed=seed)  # fmt: skip
    return h_new, y, stats


@triton_op(
    "triton_transformer::residual_layernorm_backward", mutates_args=("weight_acc", "bias_acc")
)
def residual_layernorm_backward_op(
    dy: torch.Tensor,
    dh_new: torch.Tensor | None,
    h_new: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    eps: float,
    stable: bool,
    p: float,
    seed: torch.Tensor,
    h_dtype: torch.dtype,
    branch_dtype: torch.dtype,
    weight_acc: torch.Tensor | None,
    bias_acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, dbranch, dweight, dbias): dh = layernorm's dx + dh_new (None: zero);
    dbranch = dropout-masked dh, or an empty (0,) tensor when it would equal dh (p == 0 and
    the same dtype: the caller reuses dh); dbias empty (0,) when bias is None. weight_acc,
    bias_acc as in `layernorm_backward_op`."""
    N = h_new.shape[-1]
    x2, dy2 = as_rows(h_new), as_rows(dy)
    M = x2.shape[0]
    dh = torch.empty(size=h_new.shape, dtype=h_dtype, device=h_new.device)
    separate = p > 0.0 or branch_dtype != h_dtype
    dbranch = torch.empty(size=h_new.shape if separate else (0,), dtype=branch_dtype,
                          device=h_new.device)  # fmt: skip
    dweight, dbias = param_grads(weight, bias, weight_acc, bias_acc)
    launch_layernorm_bwd(
        dy2, x2, weight.contiguous(), stats, dh.view(M, N), default(weight_acc, dweight),
        default(bias_acc, dbias) if exists(bias) else None, eps, stable,
        dhn2=as_rows(dh_new) if exists(dh_new) else None,
        dbr2=dbranch.view(M, N) if separate else None, p=p, seed=seed,
        acc_w=exists(weight_acc), acc_b=exists(bias_acc),
    )  # fmt: skip
    return dh, dbranch, dweight, dbias


def _residual_layernorm_setup_context(ctx, inputs, output) -> None:
    h, branch, weight, bias, ctx.eps, ctx.stable, ctx.p, seed, _, weight_acc, bias_acc = inputs
    h_new, _, stats = output
    ctx.mark_non_differentiable(stats)
    # unused outputs get no zero-filled gradient (stats never has one; h_new has none after
    # the last block): the backward takes None for them
    ctx.set_materialize_grads(False)
    ctx.has_bias = exists(bias)
    ctx.h_dtype, ctx.branch_dtype = h.dtype, branch.dtype
    ctx.grad_homes = (_grad_home(weight), _grad_home(bias) if exists(bias) else None)
    ctx.save_for_backward(h_new, weight, bias, stats, seed, weight_acc, bias_acc)


@first_order_only("residual_layernorm")
def _residual_layernorm_backward(ctx, dh_new, dy, _dstats):
    if dy is None and dh_new is None:
        return (None,) * 11
    h_new, weight, bias, stats, seed, *traced = ctx.saved_tensors
    if dy is None:  # y unused: only the residual sum passes a gradient (rare; kept simple)
        dy = torch.zeros_like(h_new)
    targets = grad_targets(ctx.grad_homes, traced, dy)
    dh, dbranch, dweight, dbias = call_op(residual_layernorm_backward_op,
        dy, dh_new, h_new, weight, bias, stats, ctx.eps, ctx.stable, ctx.p, seed,
        ctx.h_dtype, ctx.branch_dtype, *targets,
    )  # fmt: skip
    if ctx.p == 0.0 and ctx.branch_dtype == ctx.h_dtype:
        dbranch = dh  # d(h + branch)/d(branch) = 1: the same gradient, written once
    dweight, dbias = folded_grads((dweight, dbias if ctx.has_bias else None), targets, traced)
    return dh, dbranch, dweight, dbias, None, None, None, None, None, None, None


residual_layernorm_op.register_autograd(
    _residual_layernorm_backward, setup_context=_residual_layernorm_setup_context
)
accumulates_grads(residual_layernorm_backward_op)


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before takes that layout's `_EagerPlan`:
# one key of what the checks and the kernels read (`utils.eager_plan_key` of h, branch, the
# parameters, the scalars as given), one lookup, then the launches bound on its first call;
# as `layernorm._EagerPlan`, whose launchers it shares.


class _EagerPlan:
    """The launches of eager residual_layernorm calls of one layout: h and branch viewable
    as (M, N) rows of unit column stride, contiguous parameters (what `_eager_plan` admits).
    Forward per alignment of the seed; backward per dtype and alignment of the upstream
    gradients (dense ones) and of the seed, and per gradient target."""

    __slots__ = ("branch_dtype", "bwd", "device", "eps", "fwd", "h_dtype", "n_cols", "n_rows",
                 "out_dtype", "p", "shape", "stable", "stats_shape", "sum_dtype")  # fmt: skip

    def __init__(self, h, branch, eps: float, stable: bool, p: float, out_dtype) -> None:
        self.shape, self.device = h.shape, h.device
        self.h_dtype, self.branch_dtype = h.dtype, branch.dtype
        self.sum_dtype = torch.promote_types(h.dtype, branch.dtype)
        self.out_dtype = out_dtype or self.sum_dtype
        self.n_cols = h.shape[-1]
        self.n_rows = h.numel() // self.n_cols
        self.stats_shape = (3 if stable else 2, self.n_rows)
        self.eps, self.stable, self.p = eps, stable, p
        self.fwd: dict = {}
        self.bwd: dict = {}

    def forward(self, h, branch, weight, bias, seed) -> tuple:
        """(h_new, y, stats) as `residual_layernorm_op` returns them; seed None when p == 0."""
        h_new = torch.empty(size=self.shape, dtype=self.sum_dtype, device=self.device)
        y = torch.empty(size=self.shape, dtype=self.out_dtype, device=self.device)
        stats = torch.empty(size=self.stats_shape, dtype=torch.float32, device=self.device)
        key = None if seed is None else tensor_facts(seed)
        fwd = self.fwd.get(key)
        if fwd is not None:
            fwd(h_new, weight, weight if bias is None else bias, y, stats, h, branch,
                stats if seed is None else seed)  # fmt: skip
            return h_new, y, stats
        rows = (self.n_rows, self.n_cols)
        self.fwd[key] = launch_layernorm_fwd(
            h_new.view(rows), weight, bias, y.view(rows), stats, self.eps, self.stable,
            h2=h.view(rows), br2=branch.view(rows), p=self.p, seed=seed,
        )  # fmt: skip
        return h_new, y, stats

    def backward(self, dy, dh_new, h_new, weight, bias, stats, seed, acc_w, acc_b) -> tuple:
        """(dh, dbranch, dweight, dbias) for upstream gradients of any layout (dh_new None:
        zero): dbranch None where it equals dh (the caller then reuses dh), the parameters'
        as `layernorm.bound_grads` returns them."""
        dh = torch.empty(size=self.shape, dtype=self.h_dtype, device=self.device)
        dbranch = None
        if self.p > 0.0 or self.branch_dtype != self.h_dtype:
            dbranch = torch.empty(size=self.shape, dtype=self.branch_dtype, device=self.device)
        dweight, dbias = bound_grads(
            self, dy, h_new, weight, bias, stats, dh, acc_w, acc_b, dh_new=dh_new,
            dbranch=dbranch, seed=seed,
        )  # fmt: skip
        return dh, dbranch, dweight, dbias


_EAGER_PLANS = LaunchPlans()


def _eager_plan(h, branch, weight, bias, eps, stable, dropout_p, training, out_dtype):
    """The plan of this eager call's layout, made on its first call (after the checks); None
    where the generic path runs: traced, not tensors (the checks raise), or a layout the plan
    does not cover."""
    scalars = (eps, stable, dropout_p, training, out_dtype)
    key, plan = _EAGER_PLANS.find((h, branch, weight, bias), scalars)
    if key is None or plan is not None:
        return plan
    check_layernorm_args(h, weight, bias, True)
    check_out_dtype(out_dtype)
    p = check_residual_branch(h, branch, dropout_p, training, True)
    if h.numel() == 0 or not (plain_params(weight, bias) and has_rows_view(h)):
        return None
    if not has_rows_view(branch):
        return None
    return _EAGER_PLANS.put(key, _EagerPlan(h, branch, float(eps), bool(stable), p, out_dtype))


class _EagerResidualLayerNorm(torch.autograd.Function):
    """`residual_layernorm_op` and its registered backward for an eager call of a planned
    layout: returns (h_new, y)."""

    @staticmethod
    def forward(ctx, h, branch, weight, bias, seed, plan):
        h_new, y, stats = plan.forward(h, branch, weight, bias, seed)
        ctx.set_materialize_grads(False)  # as the op's: an unused output gets no zeros
        ctx.save_for_backward(h_new, weight, bias, stats, seed)
        ctx.plan = plan
        ctx.grad_homes = (_grad_home(weight), None if bias is None else _grad_home(bias))
        return h_new, y

    @staticmethod
    @first_order_only("residual_layernorm")
    def backward(ctx, dh_new, dy):
        if dy is None and dh_new is None:
            return (None,) * 6
        h_new, weight, bias, stats, seed = ctx.saved_tensors
        if dy is None:  # y unused: only the residual sum passes a gradient (rare)
            dy = torch.zeros_like(h_new)
        homes, plan = ctx.grad_homes, ctx.plan
        targets = (None, None)
        if homes[0] is not None or homes[1] is not None:
            targets = grad_targets(homes, (None, None), dy)
        dh, dbranch, dweight, dbias = plan.backward(
            dy, dh_new, h_new, weight, bias, stats, seed, *targets
        )
        if dbranch is None:
            dbranch = dh  # d(h + branch)/d(branch) = 1: the same gradient, written once
        if targets[0] is not None or targets[1] is not None:
            dweight, dbias = folded_grads((dweight, dbias), targets, (None, None))
        return dh, dbranch, dweight, dbias if bias is not None else None, None, None


_apply_eager_residual_layernorm = eager_apply(_EagerResidualLayerNorm)


def residual_layernorm(
    h: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    training: bool = True,
    eps: float = 1e-5,
    stable: bool = False,
    use_triton: bool = False,
    out_dtype: torch.dtype | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_new, y): h_new = h + dropout(branch), y = layernorm(h_new) over the last dim.

    Args:
        h: (..., N) residual stream, any strides.
        branch: the block's output, same shape as h (dtype may differ: h_new is promoted).
        weight, bias: (N,) LayerNorm scale and optional shift (see `layernorm.layernorm`).
        dropout_p: dropout probability on `branch`, in [0, 1); applied only when `training`.
        eps, stable: as in `layernorm.layernorm` (stable: PB-relax max-abs rescale).
        use_triton: one fused Triton kernel each way instead of the PyTorch reference.
        out_dtype: y's float dtype (None: h_new's), e.g. bf16 under autocast for the matmul
            that reads y, while h_new keeps the fp32 residual stream.
        seed: Triton only: the 0-dim int64 device tensor the dropout mask is drawn from (the
            package's one scheme, `dropout.dropout`'s); None draws one. F.dropout ignores it.

    Returns:
        (h_new, y), new tensors shaped like h; h_new in the promoted dtype of (h, branch).
    """
    if use_triton:
        plan = _eager_plan(h, branch, weight, bias, eps, stable, dropout_p, training, out_dtype)
        if plan is not None:
            seed = seed_or_draw(seed, h.device) if plan.p > 0.0 else None
            if torch.is_grad_enabled() and (
                h.requires_grad or branch.requires_grad or weight.requires_grad
                or (bias is not None and bias.requires_grad)
            ):  # fmt: skip
                return _apply_eager_residual_layernorm(h, branch, weight, bias, seed, plan)
            return plan.forward(h, branch, weight, bias, seed)[:2]
    check_layernorm_args(h, weight, bias, use_triton)
    check_out_dtype(out_dtype)
    p = check_residual_branch(h, branch, dropout_p, training, use_triton)
    if not use_triton:
        h_new = h + (F.dropout(branch, p) if p > 0.0 else branch)
        return h_new, _layernorm_reference(h_new, weight, bias, eps, stable, out_dtype)
    # The seed tensor is drawn only when there is dropout (no RNG advance, no launch otherwise);
    # the op needs a tensor argument either way, and weight stands in (never read).
    seed = seed_or_draw(seed, h.device) if p > 0.0 else weight
    accs = _traced_grad_acc(weight), _traced_grad_acc(bias) if exists(bias) else None
    h_new, y, _ = call_op(
        residual_layernorm_op, h, branch, weight, bias, float(eps), bool(stable), p, seed,
        out_dtype, *accs,
    )  # fmt: skip
    return h_new, y
