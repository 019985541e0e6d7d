"""Cross entropy over a vocabulary: a fused Triton kernel and the PyTorch reference.

`cross_entropy(logits, labels)` is the mean negative log-likelihood of `labels` under
softmax(logits), over the positions whose label is not `ignore_index`.

Triton path (one program per row, looping over the vocabulary in blocks so V = 50k is fine):
- forward: online logsumexp (running max + rescaled running sum, one exp per logit), then
  loss_row = lse - x[label]. Only lse (fp32, one per row) is saved for backward.
- backward: dlogits = (softmax(x) - onehot(label)) * dloss / n_valid, recomputing softmax from
  the saved logits and lse, written in the logits' dtype.
- the mean over rows is a torch `sum` of the per-row losses and valid flags (deterministic,
  no atomics), divided on the device: no host sync anywhere.

Why recompute in backward rather than Liger-Kernel's trick (write the gradient into the logits
buffer during forward)? The trick saves one (rows, V) buffer and one read, but it overwrites
the caller's logits and needs the upstream gradient to be 1 (or a second pass). Recomputing
keeps the op pure and its memory the same as `F.cross_entropy`, which also keeps a (rows, V)
tensor (its log-softmax) for backward.

Conventions shared by both branches:
- All positions ignored (or no positions at all): the loss is 0 and its gradient is 0
  (torch's mean reduction would give NaN = 0/0).
- A label outside [0, V) that is not `ignore_index` is an error. The PyTorch branch always
  checks (one host sync on CUDA). The Triton branch does not sync: the kernel makes that row's
  loss and gradient NaN, so the mean is NaN. Turn on the debug path,
  `torch.autograd.set_detect_anomaly(True)`, and the Triton branch checks on the host too and
  raises a ValueError naming the bad label.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_transformer.utils import as_rows, calc_num_warps, check_triton_tensor, row_block_size

# Largest vocabulary block a program holds at once; longer rows loop over blocks. Measured on an
# H200 at (4096, 50257): forward best with 4096 and 4 warps (fp32 at ~4 TB/s), backward with
# 8192 and 16 warps (4096 with 16 warps was 25% slower in fp32).
FWD_MAX_BLOCK = 4096
BWD_MAX_BLOCK = 8192


@triton.jit
def _cross_entropy_fwd_kernel(
    Logits,
    Labels,
    Out,  # (2, n_rows) fp32: row 0 per-row loss (0 if ignored), row 1 valid flag (1.0 / 0.0)
    Lse,  # (n_rows,) fp32 logsumexp, NaN for a bad label
    n_rows,
    V,
    stride_row,
    stride_label,
    ignore_index,
    HAS_IGNORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = Logits + row * stride_row
    label = tl.load(Labels + row * stride_label)
    cols = tl.arange(0, BLOCK)

    # Online logsumexp: m is the running max, s the sum of exp(x - m).
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        x = tl.load(x_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A block of only -inf logits (so far) would give exp(-inf - -inf) = NaN: shift by 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    lse = tl.where(m == float("-inf"), 0.0, m) + tl.log(s)

    in_range = (label >= 0) & (label < V)
    x_label = tl.load(x_ptr + label, mask=in_range, other=0.0).to(tl.float32)
    bad = ~in_range
    valid = 1.0
    if HAS_IGNORE:
        ignored = label == ignore_index
        bad = bad & ~ignored
        valid = tl.where(ignored, 0.0, 1.0)
    # A bad label poisons its row (loss and, through lse, gradient) with NaN.
    lse = tl.where(bad, float("nan"), lse)
    loss = lse - x_label
    if HAS_IGNORE:
        loss = tl.where(ignored, 0.0, loss)
    tl.store(Out + row, loss)
    tl.store(Out + n_rows + row, valid)
    tl.store(Lse + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    Logits,
    Labels,
    Lse,
    Totals,  # (2,) fp32: [sum of losses, number of valid rows]
    DLoss,  # 0-d upstream gradient
    DLogits,
    V,
    stride_row,
    stride_label,
    stride_drow,
    ignore_index,
    HAS_IGNORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_ptr = Logits + row * stride_row
    dx_ptr = DLogits + row * stride_drow
    label = tl.load(Labels + row * stride_label)
    lse = tl.load(Lse + row)
    # d(mean)/d(loss_row) = 1 / max(n_valid, 1); the max makes the all-ignored case 0, not NaN.
    scale = tl.load(DLoss).to(tl.float32) / tl.maximum(tl.load(Totals + 1), 1.0)
    if HAS_IGNORE:
        scale = tl.where(label == ignore_index, 0.0, scale)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        dx = (p - tl.where(offs == label, 1.0, 0.0)) * scale
        tl.store(dx_ptr + offs, dx.to(DLogits.dtype.element_ty), mask=mask)


@functools.cache
def _fwd_launch_params(V: int) -> tuple[int, int]:
    return row_block_size(V, FWD_MAX_BLOCK), 4


@functools.cache
def _bwd_launch_params(V: int) -> tuple[int, int]:
    block = row_block_size(V, BWD_MAX_BLOCK)
    return block, calc_num_warps(block)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int | None):
        # logits (rows, V) with unit stride over V; labels (rows,) int64.
        n_rows, V = logits.shape
        block, num_warps = _fwd_launch_params(V)
        has_ignore = ignore_index is not None
        ignore = ignore_index if has_ignore else 0
        out = torch.empty((2, n_rows), dtype=torch.float32, device=logits.device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        _cross_entropy_fwd_kernel[(n_rows,)](
            logits, labels, out, lse, n_rows, V, logits.stride(0), labels.stride(0), ignore,
            HAS_IGNORE=has_ignore, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        totals = out.sum(dim=1)  # [loss sum, n_valid]; deterministic tree reduction
        ctx.save_for_backward(logits, labels, lse, totals)
        ctx.ignore = ignore
        ctx.has_ignore = has_ignore
        return totals[0] / totals[1].clamp(min=1.0)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits, labels, lse, totals = ctx.saved_tensors
        n_rows, V = logits.shape
        block, num_warps = _bwd_launch_params(V)
        dlogits = torch.empty((n_rows, V), dtype=logits.dtype, device=logits.device)
        _cross_entropy_bwd_kernel[(n_rows,)](
            logits, labels, lse, totals, dloss, dlogits, V,
            logits.stride(0), labels.stride(0), dlogits.stride(0), ctx.ignore,
            HAS_IGNORE=ctx.has_ignore, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        return dlogits, None, None


def _check_labels_in_range(labels: torch.Tensor, V: int, ignore_index: int | None) -> None:
    """Raise ValueError if a non-ignored label is outside [0, V). Syncs with a CUDA device."""
    bad = (labels < 0) | (labels >= V)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bad.any():
        first = labels[bad][0].item()
        raise ValueError(
            f"labels must lie in [0, {V}) (the vocabulary size) or equal ignore_index="
            f"{ignore_index}; found label {first}"
        )


def _cross_entropy_torch(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int | None
) -> torch.Tensor:
    V = logits.shape[-1]
    _check_labels_in_range(labels, V, ignore_index)
    # Compute in at least fp32 (fp64 stays fp64, for float64 references).
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.reshape(-1, V).to(dtype)
    flat = labels.reshape(-1)
    if ignore_index is None:
        nll = F.cross_entropy(rows, flat, reduction="none")
        return nll.sum() / max(flat.numel(), 1)
    valid = flat != ignore_index
    # Ignored rows get a harmless label 0 and are then masked out, so they add 0 (and 0 grad).
    nll = F.cross_entropy(rows, torch.where(valid, flat, 0), reduction="none")
    return torch.where(valid, nll, 0.0).sum() / valid.sum().clamp(min=1)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """Mean cross entropy of `labels` under softmax(`logits`) over the last dim.

    Args:
        logits: (..., V) float tensor (fp32/fp16/bf16; the PyTorch branch also takes fp64).
        labels: (...) int64 tensor, same leading shape as `logits`, values in [0, V) or
            `ignore_index`.
        ignore_index: label value whose positions are left out of the mean; None ignores
            nothing.
        use_triton: run the fused Triton kernels instead of the PyTorch reference.

    Returns:
        0-d tensor: the mean loss over non-ignored positions, float32 (float64 for float64
        logits). 0, with zero gradient, when every position is ignored.

    Raises:
        TypeError: non-tensor inputs, non-floating logits, labels not int64, or a
            non-integer ignore_index.
        ValueError: mismatched shapes or devices, V == 0 with positions present, or (PyTorch
            branch; Triton branch in anomaly-detection mode) a label outside [0, V) that is
            not ignore_index. The Triton branch otherwise returns NaN for such labels.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch.Tensors")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64 class indices, got {labels.dtype}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without its last "
            f"(vocabulary) dim; logits shape is {tuple(logits.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if logits.shape[-1] == 0 and labels.numel() > 0:
        raise ValueError("logits has an empty vocabulary dim (V == 0)")

    # No positions: the reference already gives 0 connected to the graph; nothing to launch.
    if not use_triton or labels.numel() == 0:
        return _cross_entropy_torch(logits, labels, ignore_index)

    check_triton_tensor(logits, "logits")
    if torch.is_anomaly_enabled():  # debug path: pay a host sync for a clear error
        _check_labels_in_range(labels, logits.shape[-1], ignore_index)
    return _CrossEntropy.apply(as_rows(logits), labels.reshape(-1), ignore_index)
