"""Fused output projection + cross entropy: the (tokens x vocab) logits never exist whole.

`linear_cross_entropy(x, weight, labels)` is `cross_entropy(x @ weight.T, labels)`. With
x (M, K) rows, weight (V, K), labels y (M,) and z_i = x_i W^T the logits of row i:

    loss = 1/n_valid · Σ_{i valid} lse(z_i) - z_i[y_i]       (n_valid: rows not ignored)
    dz_i = (softmax(z_i) - onehot(y_i)) / n_valid             (0 on ignored rows)
    dx   = dz W          (M, K)
    dW   = dz^T x        (V, K)

Triton path (Liger-Kernel's FusedLinearCrossEntropy). The forward walks the rows in chunks of
`chunk_rows` (fixed Python-side boundaries: no host reads of device values, so a CUDA graph can
capture it). Per chunk: z_c = x_c W^T into one reusable (chunk_rows, V) buffer
(`matmul_plan._mm2d_into`: cuBLAS or a Triton GEMM), then cross entropy's in-place forward
kernel writes the rows' losses and overwrites z_c with dz_c, then dx_c = dz_c W into a
preallocated dx, and dW += dz_c^T x_c, accumulated in fp32. n_valid is counted over *all*
labels before the first chunk, since every chunk is normalised by the global count. The forward
thus also computes both gradients (for an upstream gradient of 1); backward only scales them in
place by dloss, a 0-d device tensor read in the kernel (a no-op when it is exactly 1, a plain
`loss.backward()`). One backward per forward; create_graph=True raises
(`utils.first_order_only`).

Memory: one chunk of logits (about `CHUNK_BYTES`), dx, and dW in fp32, instead of the full
logits. Under bf16 autocast an fp32 weight is read through a bf16 copy (`bmm._weight_in`) and
its gradient is accumulated and returned in fp32 (the model's case: the accumulator becomes
the weight's gradient). fp16 logits: as in `cross_entropy`, the chunks hold softmax - onehot
unnormalised (1/n_valid would underflow fp16 before a GradScaler's factor reaches it), and
backward applies dloss / n_valid to dx and dW in fp32. A bf16 or fp16 weight gets its fp32
gradient cast in backward.

A bf16 weight (no fp32 master) in one chunk gets dW from one product written in bf16 (fp32
accumulation inside it, as the unfused path's). Over several chunks its fp32 accumulator is
twice the weight's size and the cast adds the weight's size again, which at a large K·V
outweighs the logits saved; each chunk after the first also reads and writes the
accumulator. So where one chunk holds no more memory (`single_chunk_lighter`: about K >=
tokens / 2), the default takes one. Llama 3 8B's head (K = 4096, V = 128,256; H200,
2026-11-29): with 4096 tokens one chunk runs 18.4 ms and peaks at 2,036 MiB, against 20.5 ms
and 3,038 MiB in chunks of 2048 rows; with 8192 tokens 40.3 ms against 41.7, both at 3,070
MiB, as the unfused call. Liger-Kernel's fused loss accumulates dW in bf16 by default. At
8192 tokens it peaks at 1,129 MiB and runs 1.40x slower (`bench_linear_cross_entropy.py`).

Without autograd (evaluation under no_grad) the chunks only compute the loss: no gradient is
written and no dx/dW is allocated. Callers that need logits (generation) use `bmm.linear`.

Eager calls bind each chunk's kernels and products once per layout (`_Launches`), and a
repeat call of a layout skips the checks and the choice of chunks (`_PlannedCall`). The label
check (`check_labels`) takes the loss as its verdict, as `cross_entropy`'s does: the mean's
kernel writes a NaN loss into a slot of pinned memory and a later checked call raises
(`triton_transformer.checks`), without a sync.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import triton_op

from triton_transformer import checks, cross_entropy_hopper, matmul_plan
from triton_transformer.bmm import _check_pair, _weight_in
from triton_transformer.cross_entropy import (
    _cross_entropy_bwd_config,
    _cross_entropy_bwd_scale_kernel,
    check_labels_after,
    check_labels_before,
    cross_entropy,
    launch_cross_entropy_fwd,
    launch_cross_entropy_fwd_reduce,
)
from triton_transformer.cross_entropy import _switches as ce_switches
from triton_transformer.matmul_plan import BoundProducts, accumulate_mm
from triton_transformer.utils import (
    LaunchPlans,
    call_op,
    cdiv,
    check_triton_tensor,
    eager_apply,
    empty_scalar,
    first_order_only,
    is_traced,
    launcher,
    opaque_op,
    refuse_second_backward,
    tracing,
)

__all__ = ["CHUNK_BYTES", "default_chunk_rows", "linear_cross_entropy", "single_chunk_lighter"]

# Largest size of one chunk's logits; the rows are then split into equal chunks of a multiple
# of 128 rows (`default_chunk_rows`). Each chunk costs an fp32 (V, K) read and write for the dW
# accumulation, so fewer chunks are faster and more save memory. At the GPT-2 preset (16384
# tokens, V = 50304, bf16; H200, 2026-11-28, whole graphed step, `bench_step.py
# --loss-chunk-rows`): 4 chunks of 4096 rows save 1.23 GB of peak memory against the unfused
# loss at 0.98x its speed; 12 chunks of 1408 rows 1.50 GB at 0.95x. Module-level so
# benchmarks can sweep it.
CHUNK_BYTES = 2**29


def default_chunk_rows(M: int, V: int, itemsize: int) -> int:
    """Rows per chunk for M rows: as few equal chunks as keep each one's logits within
    `CHUNK_BYTES`, rounded up to a multiple of 128 rows (at least 128)."""
    cap = max(128, CHUNK_BYTES // max(1, V * itemsize) // 128 * 128)
    chunks = max(1, cdiv(M, cap))
    return max(128, cdiv(cdiv(M, chunks), 128) * 128)


def single_chunk_lighter(M: int, V: int, K: int, itemsize: int, rows: int) -> bool:
    """Whether one chunk of all M rows, with dW (V, K) written in the weight's 16-bit dtype by
    one product, holds at most the memory of chunks of `rows` rows with dW accumulated in fp32
    and cast at the end (e: bytes per element):

        one chunk:  M·V·e (the logits) + V·K·e (dW)
        chunks:     4·V·K (the accumulator) + max(rows·V·e (a chunk's logits), V·K·e (its cast))
    """
    one = (M + K) * V * itemsize
    return one <= 4 * V * K + max(rows, K) * V * itemsize


class _Launches:
    """The chunked forward's launches for one layout (`_forward_chunks`): its kernels by name,
    bound on their first call, and its products by slot (`matmul_plan.BoundProducts`). An
    eager call of a layout seen before reuses that layout's (`_EAGER_PLANS`); the registered
    op makes a fresh one per call."""

    __slots__ = ("kernels", "products")

    def __init__(self) -> None:
        self.kernels: dict[object, Callable[..., None]] = {}
        self.products = BoundProducts()

    def kernel(self, name: object, launch: Callable[..., Callable], *tensors) -> None:
        """Run the kernel bound as `name` on `tensors`; on its first call `launch(*tensors)`,
        which runs it and returns it bound (the launchers' `bind`)."""
        again = self.kernels.get(name)
        if again is not None:
            again(*tensors)
        else:
            self.kernels[name] = launch(*tensors)


def _forward_chunks(
    launches: _Launches,
    x,
    weight,
    labels,
    ignore_index,
    chunk_rows: int,
    grad_x: bool,
    grad_weight: bool,
    dw_in_x_dtype: bool,
    verdict: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_linear_cross_entropy_impl` through `launches`; a NaN loss also into `verdict` (a
    label check's zeroed slot, `checks.reserve`) where given."""  # fmt: skip
    M, K = (int(d) for d in x.shape)  # the chunk boundaries are Python ints
    V = int(weight.shape[0])
    if dw_in_x_dtype and grad_weight and chunk_rows < M:
        raise ValueError(f"dW in x's dtype takes one chunk: chunk_rows {chunk_rows} < {M} rows")
    device = x.device
    write_grad = grad_x or grad_weight
    normalize = x.dtype != torch.float16
    labels2 = labels[None]  # (1, M): the kernels' (outer, inner) row layout
    loss_rows = torch.empty(M, dtype=torch.float32, device=device)
    n_valid = empty_scalar(device)
    loss = empty_scalar(device)
    dx = torch.empty(size=(M, K) if grad_x else (0, 0), dtype=x.dtype, device=device)
    dw_dtype = x.dtype if dw_in_x_dtype else torch.float32
    dw = torch.empty(size=(V, K) if grad_weight else (0, 0), dtype=dw_dtype, device=device)
    # n_valid over all rows first: each chunk's gradient is divided by the global count.
    launches.kernel(
        "count",
        lambda rows, labels, count, out, _: launch_cross_entropy_fwd_reduce(
            rows, labels, ignore_index, count, out, False, True
        ),
        loss_rows, labels2, n_valid, loss, loss,
    )  # fmt: skip
    rows = max(1, min(chunk_rows, M))
    buf = torch.empty(size=(rows, V), dtype=x.dtype, device=device)  # one chunk's logits
    lse = loss_rows if write_grad else torch.empty(rows, dtype=torch.float32, device=device)
    w_t = weight.t()
    for chunk, start in enumerate(range(0, M, rows)):
        end = min(start + rows, M)
        if end - start == M:  # one chunk: the whole tensors (a view each costs host time)
            x_c, z, lse_c, labels_c, loss_c, dx_c = x, buf, lse, labels2, loss_rows, dx
        else:
            x_c, z = x[start:end], buf[: end - start]
            lse_c = lse[start:end] if write_grad else lse[: end - start]  # (unused with grads)
            labels_c, loss_c = labels2[:, start:end], loss_rows[start:end]
            dx_c = dx[start:end] if grad_x else dx
        launches.products.run(("z", chunk), x_c, w_t, z)  # logits of the chunk
        z3 = z[None]
        # counted: each chunk's gradient takes 1 / n_valid of all rows (counted above), not
        # of its own
        launches.kernel(
            ("ce", chunk),
            lambda z, labels, count, rows, lse: launch_cross_entropy_fwd(
                z, labels, ignore_index, count, rows, lse, write_grad, normalize, counted=True
            ),
            z3, labels_c, n_valid, loss_c, lse_c,
        )  # fmt: skip
        if grad_x:  # z now holds dz
            launches.products.run(("dx", chunk), z, weight, dx_c)
        if grad_weight:
            if start == 0:
                launches.products.run("dw", z.t(), x_c, dw)
            else:
                accumulate_mm(dw, z.t(), x_c)
    launches.kernel(
        "mean",
        lambda rows, labels, count, out, _: launch_cross_entropy_fwd_reduce(
            rows, labels, ignore_index, count, out, True, False, verdict
        ),
        loss_rows, labels2, n_valid, loss, loss if verdict is None else verdict,
    )  # fmt: skip
    return loss, dx, dw, n_valid


def _linear_cross_entropy_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: Optional[int],  # noqa: UP045 (torch 2.11's schema inference)
    chunk_rows: int,
    grad_x: bool,
    grad_weight: bool,
    dw_in_x_dtype: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked forward: x (M, K), weight (V, K) in x's dtype, labels (M,) int64, any strides.

    Returns (loss 0-d fp32, dx (M, K) in x's dtype, dW (V, K) fp32, n_valid 0-d fp32): the
    gradients for an upstream gradient of 1 (fp16: without the 1 / n_valid factor), or (0, 0)
    placeholders when not asked for (then no gradient is written at all). dw_in_x_dtype: dW
    in x's dtype instead (callers pass it for one chunk only: chunks would accumulate in it)."""
    return _forward_chunks(
        _Launches(), x, weight, labels, ignore_index, chunk_rows, grad_x, grad_weight,
        dw_in_x_dtype,
    )  # fmt: skip


linear_cross_entropy_op = triton_op("triton_transformer::linear_cross_entropy", mutates_args=())(
    _linear_cross_entropy_impl
)

# Traced code (torch.compile) cannot launch `cross_entropy_hopper`'s Gluon kernel, which eager
# calls take for the chunks' logits on Hopper: there it calls the op's implementation as an
# opaque op, which inductor calls as it is, with the strides it traced, and which launches
# what an eager call launches. (An opaque op of the kernel alone, writing into views of the
# chunk buffer inside the traced op, gave wrong gradients: torch 2.11, H200, 2026-11-27.)
# False: traced code runs the Triton kernels.
TRACED_OPAQUE = True
linear_cross_entropy_opaque_op = opaque_op("linear_cross_entropy", _linear_cross_entropy_impl)


@linear_cross_entropy_opaque_op.register_fake
def _(x, weight, labels, ignore_index, chunk_rows, grad_x, grad_weight, dw_in_x_dtype):
    M, K = x.shape
    loss, n_valid = x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.float32)
    dx = x.new_empty((M, K) if grad_x else (0, 0))
    dw_dtype = x.dtype if dw_in_x_dtype else torch.float32
    dw = x.new_empty((weight.shape[0], K) if grad_weight else (0, 0), dtype=dw_dtype)
    return loss, dx, dw, n_valid


def _forward_op(x: torch.Tensor, V: int, chunk_rows: int):
    """The opaque op where traced code would run chunks that eager calls give the Gluon
    kernel (`cross_entropy_hopper.takes_rows`), else the triton_op."""
    traced = tracing(x)
    rows = max(1, min(chunk_rows, x.shape[0]))
    if TRACED_OPAQUE and traced and cross_entropy_hopper.takes_rows(x.device, x.dtype, rows, V):
        return linear_cross_entropy_opaque_op
    return linear_cross_entropy_op


@triton_op("triton_transformer::linear_cross_entropy_scale", mutates_args={"dx", "dw"})
def linear_cross_entropy_scale_op(
    dx: torch.Tensor, dw: torch.Tensor, dloss: torch.Tensor, n_valid: torch.Tensor, divide: bool
) -> None:
    """dx *= f and dw *= f in place, f = dloss (/ max(n_valid, 1) if divide); the kernels
    return without writing when f is exactly 1. Empty tensors are skipped."""
    _scale_grads(_Launches(), dx, dw, dloss, n_valid, divide)


def _scale_grads(launches: _Launches, dx, dw, dloss, n_valid, divide: bool) -> None:
    """`linear_cross_entropy_scale_op` through `launches` (one bound kernel per gradient and
    kind of dloss: its dtype and alignment)."""
    kind = () if is_traced(dloss) else (dloss.dtype, not dloss.data_ptr() & 15)
    for name, g in (("scale dx", dx), ("scale dw", dw)):
        if g.numel() == 0:
            continue

        def bind(dloss, n_valid, g):
            n_rows, n_cols = g.shape
            block_m, block_n, _, num_warps = _cross_entropy_bwd_config(n_cols)
            return launcher(_cross_entropy_bwd_scale_kernel).bind(
                (cdiv(n_rows, block_m),), dloss, n_valid, g, 0, g.stride(0), n_rows, n_rows,
                n_cols, DIVIDE_BY_N_VALID=divide, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=num_warps,
            )  # fmt: skip

        launches.kernel((name, *kind), bind, dloss, n_valid, g)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd of the chunked forward: the gradients are computed there, saved, and scaled
    by the upstream gradient in backward (in place). Both methods call torch.library ops, so
    Dynamo traces it without a graph break (as `cross_entropy`'s in-place function)."""

    @staticmethod
    def forward(
        ctx, x, weight, weight_lp, labels, ignore_index, chunk_rows, grad_x, grad_weight,
        dw_in_x_dtype, launches, verdict,
    ):  # fmt: skip
        # weight_lp: the weight's copy in x's dtype, or None (Dynamo refuses a tensor passed
        # twice to apply); launches: an eager call's plan (`_eager_launches`), else None
        w = weight if weight_lp is None else weight_lp
        args = (x, w, labels, ignore_index, chunk_rows, grad_x, grad_weight, dw_in_x_dtype)
        if launches is not None:
            loss, dx, dw, n_valid = _forward_chunks(launches, *args, verdict)
        else:
            loss, dx, dw, n_valid = call_op(_forward_op(x, w.shape[0], chunk_rows), *args)
        ctx.save_for_backward(dx, dw, n_valid)
        ctx.grad_x, ctx.grad_weight, ctx.launches = grad_x, grad_weight, launches
        ctx.weight_dtype = weight.dtype
        ctx.divide = x.dtype == torch.float16  # unnormalised gradients (see the docstring)
        return loss

    @staticmethod
    @first_order_only("linear_cross_entropy")
    def backward(ctx, dloss):
        refuse_second_backward(
            ctx,
            "linear_cross_entropy scales its saved gradients in place, so it supports one "
            "backward per forward (no retain_graph reuse)",
        )
        dx, dw, n_valid = ctx.saved_tensors
        if ctx.launches is not None:
            _scale_grads(ctx.launches, dx, dw, dloss, n_valid, ctx.divide)
        else:
            call_op(linear_cross_entropy_scale_op, dx, dw, dloss, n_valid, ctx.divide)
        dweight = None
        if ctx.grad_weight:
            dweight = dw if dw.dtype == ctx.weight_dtype else dw.to(ctx.weight_dtype)
        return dx if ctx.grad_x else None, dweight, *(None,) * 9


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int | None = None,
    use_triton: bool = False,
    *,
    chunk_rows: int | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """Mean cross entropy of `labels` under softmax(x @ weight.T), without the full logits.

    Args:
        x: (..., K) float activations (under torch.autocast: cast to its dtype).
        weight: (V, K) projection, x's dtype (or wider under autocast: read through a copy
            in x's dtype, its gradient returned in its own dtype).
        labels: (...) int64, x's leading shape, values in [0, V) or `ignore_index`.
        ignore_index: label value left out of the mean; None ignores nothing.
        use_triton: the chunked Triton path; False: `F.linear` then `cross_entropy`'s PyTorch
            reference (the full logits).
        chunk_rows: rows per chunk (Triton); None: `default_chunk_rows`, or all rows in one
            chunk for a bf16 weight where that holds no more memory (`single_chunk_lighter`).
        check_labels: raise for a label out of range (refused during CUDA stream capture).
            An eager Triton call on a GPU raises from a later checked call, or from
            `triton_transformer.checks.raise_pending()`, without a sync (its loss is NaN
            meanwhile: `cross_entropy.check_labels_after`); the reference and
            anomaly-detection mode check first, with a sync. Pass False inside a training
            step (the Triton path then returns NaN for a bad label).

    Returns:
        0-d float32 loss (float64 for float64 inputs on the PyTorch path); 0, with zero
        gradients, when every position is ignored.

    Raises:
        TypeError: non-tensors, non-floating x or weight, mismatched dtypes outside autocast,
            labels not int64, a non-int ignore_index or chunk_rows.
        ValueError: mismatched shapes or devices, V == 0 with positions present, chunk_rows
            < 1, or (with check_labels) a label outside [0, V) that is not ignore_index.
    """
    records = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (x, weight)
    )
    key = None
    if use_triton:  # a layout seen before: its planned call (`_PlannedCall`)
        flags = tuple(records and getattr(t, "requires_grad", False) for t in (x, weight))
        key, planned = _PLANNED_CALLS.find(
            (x, weight, labels),
            (ignore_index, chunk_rows, check_labels, *flags, *_switches(chunk_rows)),
        )
        if planned is not None and not torch.is_autocast_enabled(x.device.type):
            return planned(x, weight, labels, check_labels)
    for t, name in ((x, "x"), (weight, "weight"), (labels, "labels")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for t, name in ((x, "x"), (weight, "weight")):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64 class indices, got {labels.dtype}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int):
            raise TypeError(f"chunk_rows must be an int or None, got {chunk_rows!r}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's second dim ({weight.shape[1]}): "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal x's shape without its last dim; "
            f"x shape is {tuple(x.shape)}"
        )
    if labels.device != x.device:
        raise ValueError(f"labels on {labels.device} but x on {x.device}")
    x, weight = _check_pair(x, weight, "x", "weight", cast_b=False)
    V = weight.shape[0]
    if V == 0 and labels.numel() > 0:
        raise ValueError("weight has an empty vocabulary dim (V == 0)")
    if use_triton:
        check_triton_tensor(x, "x")
        check_triton_tensor(weight, "weight")
    # an eager Triton call checks after its kernels (`cross_entropy.check_labels_after`); the
    # reference (F.cross_entropy would stop at a device-side assert) and traced calls first
    after_ok = use_triton and not is_traced(x)
    after = check_labels_before(check_labels, labels, V, ignore_index, after_ok)
    # No positions: the reference gives 0 connected to the graph; nothing to launch.
    if not use_triton or labels.numel() == 0:
        logits = F.linear(x, weight)
        return cross_entropy(logits, labels, ignore_index, use_triton=False, check_labels=False)

    M, K = labels.numel(), x.shape[-1]
    x2 = x.reshape(M, K)  # a view unless x's leading dims cannot merge
    labels1 = labels.reshape(M)
    weight_lp = _weight_in(weight, x.dtype)  # a copy in x's dtype, or None when weight is
    grad_x = x2.requires_grad
    grad_weight = weight.requires_grad
    # a bf16 weight's gradient straight from one product, where one chunk is not heavier
    # (without autograd no gradient is written: the chunks stay)
    bf16_dw = records and grad_weight and weight_lp is None and weight.dtype == torch.bfloat16
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(M, V, x.element_size())
        if bf16_dw and chunk_rows < M and single_chunk_lighter(M, V, K, 2, chunk_rows):
            chunk_rows = M
    dw_in_x_dtype = bf16_dw and chunk_rows >= M
    grads = (grad_x, grad_weight, dw_in_x_dtype) if records else (False, False, False)
    w = weight if weight_lp is None else weight_lp
    launches = _eager_launches(x2, w, labels1, ignore_index, chunk_rows, grads, after)
    if (
        key is not None and launches is not None and weight_lp is None
        and x2.data_ptr() == x.data_ptr() and not torch.is_autocast_enabled(x.device.type)
        and after == bool(check_labels)  # (anomaly mode checked first: no verdict bound)
    ):  # fmt: skip
        # (no autocast cast nor copy of x: a later call of this layout repeats this one)
        _PLANNED_CALLS.put(key, _PlannedCall(x2, V, ignore_index, chunk_rows, grads, launches))
    verdict, ticket = checks.reserve(x.device) if after and launches is not None else (None, None)
    if records:  # (autocast's cast of x keeps its requires_grad)
        loss = _LinearCrossEntropyFunction.apply(
            x2, weight, weight_lp, labels1, ignore_index, chunk_rows, *grads, launches, verdict
        )
    else:  # (no autograd recorded: the op's body runs directly, without custom-op dispatch)
        args = (x2, w, labels1, ignore_index, chunk_rows, *grads)
        if launches is not None:
            loss = _forward_chunks(launches, *args, verdict)[0]
        else:
            loss = call_op(linear_cross_entropy_op, *args)[0]
    if after:
        check_labels_after(loss, labels, V, ignore_index, ticket)
    return loss


# ----------------------------------------------------------------------------- eager calls
# An eager call (nothing traces) of a layout seen before runs `_forward_chunks` through that
# layout's `_Launches`: its kernels and products bound on its first call, as the other ops'
# eager plans bind theirs. The call's checks and its choice of chunks still run (they read
# the weight's dtype under autocast, the grad mode and the inputs' requires_grad); the key
# holds their results.
_EAGER_PLANS = LaunchPlans()


class _PlannedCall:
    """An eager call of a layout whose checks passed and whose chunks were chosen before
    (`_PLANNED_CALLS`, keyed by the arguments' layouts, the scalars and the gradients asked
    for; no autocast cast of x nor copy of the weight): the `_Launches` and the choices,
    called without the checks."""

    __slots__ = ("chunk_rows", "grads", "ignore_index", "launches", "rows", "vocab")

    def __init__(self, x2, vocab, ignore_index, chunk_rows, grads, launches) -> None:
        self.rows, self.vocab = tuple(x2.shape), vocab
        self.ignore_index, self.chunk_rows = ignore_index, chunk_rows
        self.grads, self.launches = grads, launches

    def __call__(self, x, weight, labels, check_labels: bool) -> torch.Tensor:
        ignore_index = self.ignore_index
        after = check_labels_before(check_labels, labels, self.vocab, ignore_index, True)
        verdict, ticket = checks.reserve(x.device) if after else (None, None)
        # (labels as the first call read them: a view, or a copy of strided labels; x and
        # labels of the rows' own rank as they are: a view costs host time)
        x2 = x if x.dim() == 2 else x.view(self.rows)
        labels1 = labels if labels.dim() == 1 else labels.reshape(self.rows[0])
        args = (x2, weight, labels1, ignore_index, self.chunk_rows, *self.grads)
        if self.grads[0] or self.grads[1]:
            loss = _apply_planned(*args[:2], None, *args[2:], self.launches, verdict)
        else:
            loss = _forward_chunks(self.launches, *args, verdict)[0]
        if after:
            check_labels_after(loss, labels, self.vocab, ignore_index, ticket)
        return loss


_PLANNED_CALLS = LaunchPlans()
_apply_planned = eager_apply(_LinearCrossEntropyFunction)


def _switches(chunk_rows) -> tuple:
    """The module settings the launches and the choice of chunks read."""
    return (
        matmul_plan.matmul_impl, matmul_plan._FORCE_PATH, cross_entropy_hopper.ENABLED,
        *ce_switches(), CHUNK_BYTES if chunk_rows is None else None,
    )  # fmt: skip


def _eager_launches(x2, w, labels1, ignore_index, chunk_rows, grads, check) -> _Launches | None:
    """The `_Launches` of this eager call's layout (x2 (M, K), w (V, K) as the products read
    them, labels1 (M,)), made on its first call; None where the op runs (traced)."""
    key, plan = _EAGER_PLANS.find(
        (x2, w, labels1), (ignore_index, chunk_rows, *grads, check, *_switches(chunk_rows))
    )
    if key is None or plan is not None:
        return plan
    return _EAGER_PLANS.put(key, _Launches())
