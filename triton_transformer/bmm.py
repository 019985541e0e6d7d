"""Batched matmul and bias-free linear layer (optionally fused with relu²) in Triton.

One tiled matmul kernel serves every case: it takes strides for both operands and the
output, so a transposed view (k.transpose(-1, -2), weight.t(), the operands of a backward
pass) is read in place, never copied. Tiles are visited in grouped order so that programs
running together share rows of A and columns of B in L2.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from triton_transformer.utils import check_triton_tensor, interpreter_enabled

ACTIVATIONS = (None, "relu_squared")

# CUDA caps the 2nd grid dim (the batch here) at 65535; larger batches launch in chunks.
_MAX_GRID_BATCH = 65535


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    s_ptr,
    M,
    N,
    K,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    stride_sb,
    stride_sm,
    stride_sk,
    RELU_SQUARED: tl.constexpr,
    A_TIMES_2SQRT_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[b] = act(A'[b] @ B[b]) for A (M, K), B (K, N), C (M, N), all given by strides.

    RELU_SQUARED: act(y) = relu(y)² in the epilogue, else identity.
    A_TIMES_2SQRT_S: A' = A * 2·sqrt(S) with S shaped like A (the relu² backward, where S
    is the forward output relu(pre)², so 2·sqrt(S) = 2·relu(pre)); else A' = A.
    """
    pid = tl.program_id(0)
    bid = tl.program_id(1).to(tl.int64)

    # Grouped ordering: GROUP_M row-blocks are swept together, column by column, so the
    # A tiles of a group and the B tile of a column stay hot in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # int64 row/column offsets: a single operand may exceed 2**31 elements.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    a_ptrs = a_ptr + bid * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + bid * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if A_TIMES_2SQRT_S:
        s_ptrs = s_ptr + bid * stride_sb + offs_m[:, None] * stride_sm + offs_k[None, :] * stride_sk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # Masks cover the ragged edges, so M, N and K need not be multiples of the tiles.
        k_left = K - k * BLOCK_K
        a_mask = mask_m[:, None] & (offs_k[None, :] < k_left)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if A_TIMES_2SQRT_S:
            s = tl.load(s_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            a = a.to(tl.float32) * (2.0 * tl.sqrt(s))
            s_ptrs += BLOCK_K * stride_sk
        if UPCAST:
            # Interpreter only: it has no bf16 arithmetic, so multiply in fp32.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(b.dtype)  # back to the storage dtype for the tensor cores; no-op if unscaled
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if RELU_SQUARED:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc

    if UPCAST:
        # The interpreter truncates fp32 -> bf16 where GPUs round to nearest even: round
        # the fp32 bits here so the cast below is exact and results match the GPU's.
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    c_ptrs = c_ptr + bid * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _pow2(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


@functools.cache
def _matmul_config(
    M: int, N: int, K: int, batch: int, dtype: torch.dtype, interpret: bool
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for one problem shape.

    A fixed heuristic rather than triton.autotune: no benchmarking on first call, and the
    same tiles (hence the same summation order) on every run.
    """
    if interpret:
        # Each program costs ~1 ms in the interpreter whatever its tile size, so use tiles
        # as large as the problem up to 32 (tl.dot needs >= 16 on GPUs; keep the same floor).
        return _pow2(M, 16, 32), _pow2(N, 16, 32), _pow2(K, 16, 32), 8, 4, 1
    if dtype == torch.float32:
        # ieee fp32 goes through FMA units, not tensor cores: 64x64 tiles with a 32-deep K
        # step keep the per-thread accumulator (32 fp32) and shared memory small.
        return _pow2(M, 16, 64), _pow2(N, 16, 64), _pow2(K, 16, 32), 8, 4, 3
    # fp16/bf16 on tensor cores: 128x128x64 tiles with 8 warps and 3 stages (96 KiB of
    # shared memory, fits any GPU since Ampere) for large problems. Too few programs leave
    # SMs idle (an H100 has 132), so for small problems narrow N, then M, to 64. Measured on
    # an H200 (triton 3.6) this is 75-100% of torch.matmul at the model's shapes; wider
    # 128x256 tiles gain ~15% only on 4096³ problems and need more shared memory.
    block_m, block_n = _pow2(M, 16, 128), _pow2(N, 16, 128)
    if batch * triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < 128:
        block_n = min(block_n, 64)
    if batch * triton.cdiv(M, block_m) * triton.cdiv(N, block_n) < 128:
        block_m = min(block_m, 64)
    big = block_m * block_n >= 128 * 128
    return block_m, block_n, _pow2(K, 16, 64), 8, 8 if big else 4, 3 if big else 4


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    relu_squared: bool = False,
    s: torch.Tensor | None = None,
) -> torch.Tensor:
    """c[i] = act(a'[i] @ b[i]) for 3-D views a (B, M, K), b (B, K, N), c (B, M, N).

    Any strides are fine (transposed views are read in place). `s` (shaped like `a`)
    switches on a' = a * 2·sqrt(s), the relu² backward.
    """
    batch, M, K = a.shape
    N = b.shape[2]
    if c.numel() == 0:
        return c
    if K == 0:  # an empty sum: act(0) = 0 for both activations
        return c.zero_()
    interpret = interpreter_enabled()
    block_m, block_n, block_k, group_m, num_warps, num_stages = _matmul_config(
        M, N, K, batch, a.dtype, interpret
    )
    # Interpreter only: it has no bf16 arithmetic, so bf16 tiles are multiplied in fp32.
    upcast = interpret and a.dtype == torch.bfloat16
    # ieee: exact fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16 operands
    # ignore the setting and always use tensor cores.
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    s_arg = s if s is not None else a  # placeholder pointer; unused when A_TIMES_2SQRT_S=False
    grid_mn = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    for start in range(0, batch, _MAX_GRID_BATCH):
        # Slice only when the batch needs several launches: views cost host time.
        end = min(batch, start + _MAX_GRID_BATCH)
        if end - start < batch:
            a_, b_, c_, s_ = a[start:end], b[start:end], c[start:end], s_arg[start:end]
        else:
            a_, b_, c_, s_ = a, b, c, s_arg
        _matmul_kernel[(grid_mn, end - start)](
            a_,
            b_,
            c_,
            s_,
            M,
            N,
            K,
            *a_.stride(),
            *b_.stride(),
            *c_.stride(),
            *s_.stride(),
            RELU_SQUARED=relu_squared,
            A_TIMES_2SQRT_S=s is not None,
            DOT_PRECISION=precision,
            UPCAST=upcast,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GROUP_M=group_m,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return c


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    """View (..., R, C) as (B, R, C); a view whenever the leading dims can be merged."""
    # An explicit batch size rather than -1, which reshape rejects for zero-size tensors.
    return x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View (..., C) as (R, C), keeping whatever strides allow (unlike utils.as_rows)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


class _BMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # Allocate the output in its final shape and hand the kernel a view: returning a
        # view from a custom Function would forbid in-place ops on the result.
        c = torch.empty((*a.shape[:-1], b.shape[-1]), device=a.device, dtype=a.dtype)
        _matmul(_as_batched(a), _as_batched(b), _as_batched(c))
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        a, b = ctx.saved_tensors
        a3, b3, dc3 = _as_batched(a), _as_batched(b), _as_batched(dc)
        da = db = None
        if ctx.needs_input_grad[0]:  # dA = dC @ B^T
            da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
            _matmul(dc3, b3.transpose(1, 2), _as_batched(da))
        if ctx.needs_input_grad[1]:  # dB = A^T @ dC
            db = torch.empty(b.shape, device=b.device, dtype=b.dtype)
            _matmul(a3.transpose(1, 2), dc3, _as_batched(db))
        return da, db


class _Linear(torch.autograd.Function):
    # relu² backward needs relu(pre); it is recomputed as sqrt(y) from the output y that
    # the forward saves anyway, so no pre-activation tensor is stored. The factor
    # 2·sqrt(y) is applied as dy tiles are loaded by both backward matmuls (no d(pre)
    # tensor either).
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, relu_squared: bool) -> torch.Tensor:
        y = torch.empty((*x.shape[:-1], weight.shape[0]), device=x.device, dtype=x.dtype)
        x2, y2 = _as_rows(x), _as_rows(y)
        _matmul(x2[None], weight.t()[None], y2[None], relu_squared=relu_squared)
        ctx.save_for_backward(x, weight, y if relu_squared else None)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, y = ctx.saved_tensors
        dy2 = _as_rows(dy)
        y2 = None if y is None else _as_rows(y)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX = d(pre) @ W
            dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            s = None if y2 is None else y2[None]
            _matmul(dy2[None], weight[None], _as_rows(dx)[None], s=s)
        if ctx.needs_input_grad[1]:  # dW = d(pre)^T @ X, summed over every leading dim
            x2 = _as_rows(x)
            dw = torch.empty(weight.shape, device=weight.device, dtype=weight.dtype)
            s = None if y2 is None else y2.t()[None]
            _matmul(dy2.t()[None], x2[None], dw[None], s=s)
        return dx, dw, None


def _check_pair(
    a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate two matmul operands; under torch.autocast cast both to its dtype.

    Autocast does not reach inside a custom autograd.Function, so without this the Triton
    path would run in fp32 under bf16 autocast (and mixed bf16 activations / fp32 weights
    would be refused). The cast is differentiable: fp32 weights still get fp32 grads.
    """
    for t, name in ((a, name_a), (b, name_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device_type = a.device.type
    if a.is_floating_point() and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        a, b = a.to(dtype), b.to(dtype)
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} ({a.dtype}) and {name_b} ({b.dtype}) must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"{name_a} ({a.device}) and {name_b} ({b.device}) must share a device")
    return a, b


def bmm(a: torch.Tensor, b: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """Batched matrix product: a (..., M, K) @ b (..., K, N) -> (..., M, N).

    The leading (batch) dims of `a` and `b` must be equal (no broadcasting); plain 2-D
    matrices are fine too. Inputs may be strided views (e.g. k.transpose(-1, -2)): the
    Triton kernel reads them in place. fp32 accumulation; the output has the input dtype.
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
    return _BMM.apply(a, b)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """act(x @ weight.T) like F.linear without bias: x (..., K), weight (N, K) -> (..., N).

    activation: None or "relu_squared" (relu(y)², fused into the matmul's epilogue in the
    Triton kernel). The weight gradient is reduced over all leading dims of x in one
    deterministic matmul (no atomics).
    """
    x, weight = _check_pair(x, weight, "x", "weight")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x's last dim must equal weight's second dim ({weight.shape[1]}): "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if not use_triton:
        y = F.linear(x, weight)
        if activation == "relu_squared":
            y = F.relu(y)
            y = y * y  # not y.square(): CUDA autocast would run pow in fp32
        return y
    check_triton_tensor(x, "x")
    check_triton_tensor(weight, "weight")
    return _Linear.apply(x, weight, activation == "relu_squared")
