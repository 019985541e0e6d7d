"""Batched matmul and bias-free linear layer (optional relu² and residual epilogues) in Triton.

Ops (torch.library triton_ops, so torch.compile traces them and CUDA graphs capture them):
- `triton_transformer::bmm(a, b)`: a (..., M, K) @ b (..., K, N); any strides (a transposed
  view such as k.transpose(-1, -2) is read in place). Its backward uses the same op.
- `triton_transformer::linear(x, weight, residual, relu_squared, p, seed)`:
  dropout_p(act(x @ weight.T)) [+ residual] for 2-D x; and
  `triton_transformer::linear_relu2(x, weight, residual, p, seed)`, which also returns
  relu(x @ weight.T) for the backward (see "relu² backward" below). The dropout (relu² only)
  runs in the epilogue, its mask drawn from a device seed (`_jit_helpers.dropout_keep_tile`).
- `triton_transformer::relu2_grad(dy, s, from_square, p, seed)`: d(pre) = dy · keep / (1 - p)
  · 2·relu(pre), the mask regenerated from the forward's seed.
The backward of each is `utils.first_order_only` (create_graph=True raises) and calls these ops.

Kernels and paths (`_plan` picks one per shape, layout, dtype, epilogue and device; cached):
- "cublas": torch.mm; torch.addmm for a residual of the operands' dtype (cuBLAS's own C-input
  epilogue, beta = 1); torch.mm with out_dtype for an fp32 output of fp16/bf16 operands (the
  weight gradients under mixed precision: the fp32 accumulator written as is). Never relu².
- "cublas+ew": relu² without a residual: torch.mm into the output, then `_relu2_ew_kernel`, one
  elementwise pass in place computing relu(y)² [· dropout mask / (1 - p)] (the mask of the
  fused epilogue, so the backward regenerates it the same way) and writing relu(y) where the
  backward needs it (fp16), as the fused epilogue would. The backward is the fused path's.
- "tma": Hopper (sm_90/sm_100), fp16/bf16, 2-D problems whose operands TMA can describe (last
  or first stride 1, the other stride and the base 16-byte aligned; N·itemsize a multiple of
  16 for the output). `_mm_tma_kernel` is persistent (one program per SM looping over tiles
  in grouped order), loads tiles with device-side tensor descriptors
  (`tl.make_tensor_descriptor`; its scratch comes from `triton.set_allocator`) and is
  autotuned per (M, N, K, layout, epilogue, dtype) over `_tma_configs()`. A transposed
  operand (W read as (K, N) in the backward, dY^T for dW) is a descriptor of the untransposed
  storage whose tile is transposed in shared memory: no copies. Problems with few output
  tiles and a long K (the weight gradients, K = tokens) split K over programs
  (`_split_k`): fp32 partials in a workspace, summed in a fixed order by a second kernel, so
  results stay deterministic (no atomics).
- "ptr": `_mm_ptr_kernel`, the pointer-based (strided, batched) kernel: other GPUs, fp32,
  batched bmm under "triton", decode-sized problems (<= 16 rows, `_FEW_ROWS_PTR`), and
  layouts TMA cannot describe.
- "interp": the same pointer kernel with small tiles and fp32 products for bf16 (the
  interpreter has no bf16 arithmetic); picked when tensors are not on CUDA (CPU tests).

`matmul_impl` (module-level) chooses among them on CUDA:
- "auto" (default): every problem cuBLAS computes whole goes to cuBLAS (plain products 2-D
  and batched, residual adds of one dtype, fp32 weight gradients, also while torch.compile
  traces where this PyTorch has a meta kernel for mm's out_dtype), except where
  `MATMUL_TABLE` lists a Triton kernel ("tma"/"ptr") measured faster for this device and
  problem, and decode-sized products with a short K (`_plan_few_rows`). relu² runs fused in
  our epilogue (TMA kernel on Hopper, else the pointer kernel) unless the table says
  "cublas+ew" for the problem: the fused kernel has to beat cuBLAS plus the separate pass.
  A residual of another dtype (autocast's fp32 residual stream under a bf16 product) runs
  in our epilogue: addmm needs one dtype (addmm's out_dtype does not trace: pytorch#163880).
- "triton": never cuBLAS (benchmarks and tests of our kernels).
- "cublas": cuBLAS wherever it computes the whole problem, listed or not; relu² stays fused.

Why cuBLAS by default: every plain GEMM measured so far went to it. H200, triton 3.6, torch
2.11, benchmarks/bench_matmul.py (kernel times, L2 flushed), the enwik8 model's projections
(d512, ff 2048, vocab 256) at 2048 and 8192 tokens: our best kernel reached 0.59-0.91x of
torch.mm (weight gradients and 2048-token problems lose most: few output tiles, K = 512
leaves little to pipeline), and 0.40-0.79x of torch.addmm with the residual (our epilogue
reads it with plain loads in the accumulator layout); at GPT-2's shapes (d768, 16,384
tokens, vocab 50,304) the TMA kernel ran at 0.90x of cuBLAS (issue "Lead at GPT-2 scale").
The fused relu² forward won:
d512 -> 2048 at 8192 tokens 528 TFLOP/s with the TMA kernel, 0.90x a plain torch.mm of the
same shape and 1.9x PyTorch's mm + relu + square; at 2048 tokens the pointer kernel, 359
TFLOP/s, 0.79x of mm and 1.5x of mm + relu + square. Against cuBLAS + our single
elementwise pass ("cublas+ew"), and every projection of the GPT-2 and large presets (forward,
dX, dW): measured in the next GPU run (`bench_matmul.py --presets`), whose "table" column
gives the entries to add here.

relu² backward: d(pre) = dy · 2·relu(pre). For bf16 and fp32 the forward saves nothing extra:
relu(pre) = sqrt(y) is recovered from the output y (which the next layer keeps anyway), and
bf16's 8-bit exponent means y = relu(pre)² does not underflow for any relu(pre) > 1e-19. In
fp16, y underflows (to 0, or to subnormals with few bits) for relu(pre) < ~8e-3, so the
forward epilogue also writes relu(pre) (one extra M×N tensor, the memory PyTorch's own
relu-then-square keeps) and the backward uses it; likewise with a residual, where y no longer
determines relu(pre). With dropout, y = relu(pre)² / (1 - p) where kept and 0 where
dropped, where d(pre) is 0 anyway: relu(pre) = sqrt(y · (1 - p)). d(pre) is one elementwise
pass; then dX = d(pre) @ W and dW = d(pre)^T @ X are two plain GEMMs.

Notes: the first call of a shape autotunes (several kernel runs), so warm up before capturing
a CUDA graph. Later eager calls launch the tuned config directly (`_TUNED`). Under
torch.compile the Triton paths run the pointer kernel unless `COMPILE_TMA` is set.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from triton_transformer._jit_helpers import dropout_keep_tile
from triton_transformer.utils import (
    call_op,
    cdiv,
    check_dropout_p,
    check_triton_tensor,
    dropout_threshold,
    first_order_only,
    is_traced,
    launcher,
    next_power_of_2,
    seed_or_draw,
    sm_count,
)

ACTIVATIONS = (None, "relu_squared")

# Which GEMM runs a problem on CUDA: "auto" (cuBLAS for whatever it computes whole, relu²
# fused, `MATMUL_TABLE`'s exceptions), "triton" (never cuBLAS) or "cublas" (cuBLAS wherever it
# computes the whole problem, relu² fused). See the module docstring. Module-level, read once
# per call.
matmul_impl = "auto"

# The exceptions to "auto"'s rule, per device name and problem "MxNxK:AB[+relu2][+res]" (A/B:
# "n" row-major, "t" a transposed view, "s" other strides): "tma" / "ptr" where that Triton
# kernel measured faster than cuBLAS (for relu², the faster of our two fused kernels); for
# relu² without a residual, "fused" (our epilogue; the default) or "cublas+ew" (cuBLAS's
# product, then our elementwise relu² pass) where that measured faster than the fused kernel.
# benchmarks/bench_matmul.py --presets prints the entries for the enwik8, GPT-2 and large
# presets' projections. Kernel times, L2 flushed.
MATMUL_TABLE: dict[str, dict[str, str]] = {
    "NVIDIA H200": {
        # triton 3.6, torch 2.11, 2026-11-22: enwik8's proj_in at 2048 tokens (a micro-batch
        # of 4 x 512), fused: pointer kernel 359, TMA kernel 337 TFLOP/s
        "2048x2048x512:nt+relu2": "ptr",
    }
}

# Tests and benchmarks only: force a path where it is allowed: "tma" or "ptr" (our kernels,
# skipping cuBLAS and the table), or "cublas+ew" (relu² without a residual through cuBLAS and
# the elementwise pass, on any device: on the CPU torch.mm and the interpreter; other
# problems are planned as without a force).
_FORCE_PATH: str | None = None


def _mm_out_dtype_traceable() -> bool:
    """Whether torch.mm(a, b, out_dtype=float32) of bf16 operands runs on meta tensors, as
    torch.compile's fake tensors need (releases without a meta kernel for it failed to trace
    it: pytorch#159023). Then traced fp32 weight gradients can go to cuBLAS too."""
    try:
        a = torch.empty((16, 16), dtype=torch.bfloat16, device="meta")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except Exception:  # no out_dtype overload, or no meta kernel for it
        return False


# Probed once, at import: inside a trace, tensors made here would be traced ones.
_MM_OUT_DTYPE_TRACEABLE = _mm_out_dtype_traceable()

# Whether torch.compile traces the TMA kernel (True) or the pointer kernel (False) into its
# graphs. Off until verified on the GPU machine (tests/test_bmm.py's compile test runs both):
# inductor must then allocate the device-side descriptors' scratch itself.
COMPILE_TMA = False

# CUDA caps the 2nd grid dim (the batch here) at 65535; larger batches launch in chunks.
_MAX_GRID_BATCH = 65535


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile (pid_m, pid_n) of a tile index in grouped order: GROUP_M row-blocks are swept
    together, column by column, so their A tiles and the B tile of a column stay in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _round_bf16(x):
    """Interpreter only: round fp32 to the nearest bf16 (ties to even), as GPUs do when they
    cast; the interpreter truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _epilogue(
    acc,
    R,
    AUX,
    offs_m,
    offs_n,
    M,
    N,
    stride_rm,
    stride_rn,
    stride_xm,
    seed,
    threshold,
    drop_scale,
    start_n,
    RELU_SQUARED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_AUX: tl.constexpr,
    ROUND_AUX: tl.constexpr,
    DROPOUT: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """dropout(act(acc)) [+ R] for one fp32 tile at rows offs_m and columns offs_n (int64),
    offs_n = start_n + arange(TILE_N).

    RELU_SQUARED: act(y) = relu(y)²; STORE_AUX also writes relu(y) to AUX (row stride
    stride_xm, unit column stride). DROPOUT: the mask of `dropout_keep_tile` over the
    (M, N) output (the backward's `_relu2_grad_kernel` regenerates it). HAS_RESIDUAL adds R
    (any strides) last.
    """
    if RELU_SQUARED:
        acc = tl.maximum(acc, 0.0)
        if STORE_AUX:
            aux = acc
            if ROUND_AUX:
                aux = _round_bf16(aux)
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            aux_ptrs = AUX + offs_m[:, None] * stride_xm + offs_n[None, :]
            tl.store(aux_ptrs, aux.to(AUX.dtype.element_ty), mask=mask)
        acc = acc * acc
    if DROPOUT:
        keep = dropout_keep_tile(seed, offs_m, start_n, N, threshold, TILE_N, True)
        acc = tl.where(keep != 0, acc * drop_scale, 0.0)
    if HAS_RESIDUAL:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        r_ptrs = R + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        acc += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _mm_ptr_kernel(
    A,
    B,
    C,
    R,
    AUX,
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
    stride_rm,
    stride_rn,
    stride_xm,
    SEED,
    threshold,
    drop_scale,
    RELU_SQUARED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_AUX: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[b] = epilogue(A[b] @ B[b]) for A (M, K), B (K, N), C (M, N), all given by strides.

    One program per output tile (grid: tiles, batch). The pointer-based path: the
    interpreter, GPUs without TMA, fp32, batches, and layouts TMA cannot describe. The
    epilogue operands (R, AUX) are used with batch 1 only.
    """
    pid = tl.program_id(0)
    bid = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    # int64 row/column offsets: a single operand may exceed 2**31 elements.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + bid * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + bid * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # Masks cover the ragged edges, so M, N and K need not be multiples of the tiles.
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter only: no bf16 arithmetic there, so multiply in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    acc = _epilogue(
        acc, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed, threshold,
        tl.cast(drop_scale, tl.float32), pid_n * BLOCK_N, RELU_SQUARED, HAS_RESIDUAL, STORE_AUX,
        UPCAST, DROPOUT, BLOCK_N,
    )  # fmt: skip
    if UPCAST and C.dtype.element_ty == tl.bfloat16:
        acc = _round_bf16(acc)  # as a GPU's cast would (a wider C keeps the fp32 sum)
    c_ptrs = C + bid * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _mm_tma_kernel(
    A,
    B,
    C,
    R,
    AUX,
    WS,
    M,
    N,
    K,
    stride_a,
    stride_b,
    stride_c,
    stride_rm,
    stride_rn,
    stride_xm,
    split_k,
    SEED,
    threshold,
    drop_scale,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    RELU_SQUARED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_AUX: tl.constexpr,
    DROPOUT: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Persistent TMA matmul: C = epilogue(A @ B) for 2-D A (M, K), B (K, N), C (M, N).

    A_T: A is stored as (K, M) with row stride stride_a (a transposed view), else (M, K).
    B_T: B is stored as (N, K) (e.g. a weight read as W^T), else (K, N). Tiles of a
    transposed operand are loaded untransposed and transposed in shared memory.
    TMA pads out-of-bounds loads with zeros and clips stores, so ragged edges need no masks.
    SPLIT: the K loop is cut into split_k chunks (work item = tile x chunk) whose fp32
    partials go to WS (split_k, M, N); `_splitk_reduce_kernel` sums them. No epilogue then.
    EPI_SUB = 2 stores the tile in two halves (less shared memory for the epilogue).
    FLATTEN: software-pipeline across tiles (the next tile's loads overlap this epilogue).
    """
    if A_T:
        a_desc = tl.make_tensor_descriptor(A, [K, M], [stride_a, 1], [BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(A, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(B, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, [K, N], [stride_b, 1], [BLOCK_K, BLOCK_N])
    SUB_N: tl.constexpr = BLOCK_N // EPI_SUB
    c_desc = tl.make_tensor_descriptor(C, [M, N], [stride_c, 1], [BLOCK_M, SUB_N])

    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT:
        k_chunk = tl.cdiv(k_tiles, split_k)
        num_work = num_pid_m * num_pid_n * split_k
    else:
        k_chunk = k_tiles
        num_work = num_pid_m * num_pid_n

    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    drop_scale = tl.cast(drop_scale, tl.float32)
    for work in tl.range(start_pid, num_work, NUM_SMS, flatten=FLATTEN):
        if SPLIT:
            tile_id = work // split_k
            k_lo = (work % split_k) * k_chunk
        else:
            tile_id = work
            k_lo = 0
        k_hi = min(k_lo + k_chunk, k_tiles)
        pid_m, pid_n = _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_lo, k_hi):
            off_k = ki * BLOCK_K
            if A_T:  # noqa: SIM108 (constexpr branches, resolved at compile time)
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:  # noqa: SIM108
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)

        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        if SPLIT:
            # fp32 partial of chunk (work % split_k); the reduce kernel adds them in order.
            offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
            ws_ptrs = WS + (work % split_k).to(tl.int64) * M * N
            ws_ptrs += offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        elif EPI_SUB == 2:
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            for h in tl.static_range(2):
                part = acc0 if h == 0 else acc1
                offs_n = off_n.to(tl.int64) + h * SUB_N + tl.arange(0, SUB_N)
                part = _epilogue(
                    part, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed,
                    threshold, drop_scale, off_n + h * SUB_N, RELU_SQUARED, HAS_RESIDUAL,
                    STORE_AUX, False, DROPOUT, SUB_N,
                )  # fmt: skip
                c_desc.store([off_m, off_n + h * SUB_N], part.to(C.dtype.element_ty))
        else:
            offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
            acc = _epilogue(
                acc, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed,
                threshold, drop_scale, off_n, RELU_SQUARED, HAS_RESIDUAL, STORE_AUX, False,
                DROPOUT, BLOCK_N,
            )  # fmt: skip
            c_desc.store([off_m, off_n], acc.to(C.dtype.element_ty))


def _tma_configs() -> list[triton.Config]:
    """Tile shapes / stages / warps the Hopper kernel is autotuned over (per shape).

    128x256 tiles (two warpgroups) for large outputs, 128x128 in two pipeline depths, and
    narrower tiles for problems with few output tiles. Shared memory per config
    (stages x (BM + BN) x BK x 2 bytes, plus the epilogue tile) stays under 227 KiB.
    """
    cfg = []
    for bm, bn, bk, stages, warps, sub, flat in (
        (128, 256, 64, 3, 8, 2, True),
        (128, 256, 64, 3, 8, 2, False),
        (128, 256, 64, 4, 8, 2, True),
        (256, 128, 64, 3, 8, 1, True),
        (128, 128, 64, 4, 4, 1, True),
        (128, 128, 64, 4, 4, 1, False),
        (128, 128, 64, 4, 8, 1, True),
        (128, 128, 128, 3, 8, 1, True),
        (64, 128, 64, 4, 4, 1, True),
        (128, 64, 64, 4, 4, 1, True),
    ):
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPI_SUB": sub}
        meta["FLATTEN"] = flat
        cfg.append(triton.Config(meta, num_stages=stages, num_warps=warps))
    return cfg


_TMA_KEY = ["M", "N", "K", "split_k", "A_T", "B_T", "RELU_SQUARED", "HAS_RESIDUAL"]
_TMA_KEY += ["STORE_AUX", "DROPOUT", "NUM_SMS"]  # NUM_SMS: a different GPU model tunes anew
# The autotuner's key also holds every tensor argument's dtype.
_mm_tma_tuned = triton.autotune(configs=_tma_configs(), key=_TMA_KEY)(_mm_tma_kernel)


@triton.jit
def _splitk_reduce_kernel(WS, C, MN, split_k, BLOCK: tl.constexpr):
    """C (contiguous) = sum over s of WS[s], in order s = 0, 1, ...: deterministic."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(WS + s * MN + offs, mask=mask, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_grad_kernel(
    DY,
    S,
    DP,
    M,
    N,
    stride_dym,
    stride_dyn,
    stride_sm,
    stride_sn,
    SEED,
    threshold,
    drop_scale,
    FROM_SQUARE: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """DP (contiguous) = DY * 2·relu(pre), with relu(pre) = sqrt(S) if FROM_SQUARE else S;
    DROPOUT: times the forward epilogue's keep mask · drop_scale (regenerated, same seed)."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = tl.program_id(1).to(tl.int64) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    dy = tl.load(DY + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn, mask=mask)
    s = tl.load(S + offs_m[:, None] * stride_sm + offs_n[None, :] * stride_sn, mask=mask)
    s = s.to(tl.float32)
    if FROM_SQUARE:
        if DROPOUT:  # S = relu(pre)² · drop_scale where kept (0 where dropped: d(pre) = 0)
            s = s / tl.cast(drop_scale, tl.float32)
        s = tl.sqrt(s)
    dp = dy.to(tl.float32) * (2.0 * s)
    if DROPOUT:
        keep = dropout_keep_tile(tl.load(SEED), offs_m, start_n, N, threshold, BLOCK_N, True)
        dp = tl.where(keep != 0, dp * tl.cast(drop_scale, tl.float32), 0.0)
    tl.store(DP + offs_m[:, None] * N + offs_n[None, :], dp.to(DP.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_ew_kernel(
    Y,
    AUX,
    M,
    N,
    SEED,
    threshold,
    drop_scale,
    STORE_AUX: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The relu² epilogue as a pass of its own, after cuBLAS wrote pre = x @ W^T into Y (M, N,
    contiguous): Y = relu(pre)² in place; DROPOUT: times the keep mask of the fused epilogue
    (same (seed, row, column) draws, which `_relu2_grad_kernel` regenerates) · drop_scale;
    STORE_AUX: also AUX (contiguous) = relu(pre), for the backward."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = tl.program_id(1).to(tl.int64) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m[:, None] * N + offs_n[None, :]
    r = tl.maximum(tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    if STORE_AUX:
        tl.store(AUX + offs, r.to(AUX.dtype.element_ty), mask=mask)
    y = r * r
    if DROPOUT:
        keep = dropout_keep_tile(tl.load(SEED), offs_m, start_n, N, threshold, BLOCK_N, True)
        y = tl.where(keep != 0, y * tl.cast(drop_scale, tl.float32), 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------
# Host side: plans (cached per shape), launches
# ------------------------------------------------------------------------------------------


def _pow2(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi]."""
    return max(lo, min(hi, next_power_of_2(n)))


@functools.cache
def _ptr_config(
    M: int, N: int, K: int, batch: int, dtype: torch.dtype, interpret: bool
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of the pointer kernel.

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
    # fp16/bf16 on tensor cores: 128x128x64 tiles, 8 warps, 3 stages (96 KiB of shared
    # memory, fits any GPU since Ampere) for large problems; for small ones narrow N, then M,
    # to 64 so that there are enough programs for the SMs (an H100 has 132).
    block_m, block_n = _pow2(M, 16, 128), _pow2(N, 16, 128)
    if batch * cdiv(M, block_m) * cdiv(N, block_n) < 128:
        block_n = min(block_n, 64)
    if batch * cdiv(M, block_m) * cdiv(N, block_n) < 128:
        block_m = min(block_m, 64)
    big = block_m * block_n >= 128 * 128
    return block_m, block_n, _pow2(K, 16, 64), 8, 8 if big else 4, 3 if big else 4


def _device_info(index: int) -> tuple[int, int, str]:
    """(compute capability major, SM count, name) of CUDA device `index`: what `_plan` decides
    by (TMA or not, the persistent grid, the table). Tests replace it to plan for other GPUs."""
    major = torch.cuda.get_device_capability(index)[0]
    return major, sm_count(torch.device("cuda", index)), torch.cuda.get_device_name(index)


def _split_k(M: int, N: int, K: int, num_sms: int) -> int:
    """K chunks for the TMA kernel when 128x128 output tiles would leave SMs idle and K is
    long (weight gradients: K = tokens). From the split sweep of bench_matmul.py on an H200:
    >= 32 tiles want K chunks of ~2048 within two waves; fewer tiles want chunks of ~512
    within one wave."""
    tiles = cdiv(M, 128) * cdiv(N, 128)
    if tiles >= num_sms:
        return 1
    if tiles >= 32:
        split, cap = K // 2048, 2 * num_sms // tiles
    else:
        split, cap = K // 512, num_sms // tiles
    return max(1, min(split, cap, 16))


def _layout(x: torch.Tensor) -> tuple[int, int] | None:
    """(transposed, row stride) for a TMA descriptor of 2-D `x`, or None if TMA can't read it.

    Row-major (last stride 1) or a transposed view (first stride 1); the other stride and
    the start address must be 16-byte aligned. The start is judged by the storage offset
    (PyTorch's allocators align storages to >= 256 bytes), so fake tensors work too.
    """
    s0, s1 = x.stride()
    es = x.element_size()
    if (x.storage_offset() * es) % 16:
        return None
    if s1 == 1 and s0 > 0 and (s0 * es) % 16 == 0:
        return 0, int(s0)
    if s0 == 1 and s1 > 0 and (s1 * es) % 16 == 0:
        return 1, int(s1)
    return None


@functools.cache
def _plan(
    device_type: str,
    index: int,
    dtype: torch.dtype,
    M: int,
    N: int,
    K: int,
    a_t: int,
    b_t: int,
    epi: str,
    cublas_ok: bool,
    out_size: int,
    impl: str,
    force: str | None,
    tracing: bool = False,
) -> tuple:
    """How one 2-D problem runs: ("cublas",), ("cublas+ew",), ("tma", split_k, num_sms) or
    ("ptr", config). The rule is the module docstring's.

    a_t / b_t: the operands' TMA layouts (0 row-major, 1 transposed, -1 not describable).
    epi: "", "+relu2", "+res" or "+relu2+res". cublas_ok: torch.mm / torch.addmm computes the
    product and its residual into the output (one dtype throughout, or an fp32 output of
    fp16/bf16 operands without a residual); relu² is then our separate pass ("cublas+ew").
    out_size: the output's element size in bytes. tracing: torch.compile is tracing the op;
    the TMA kernel is used there only if `COMPILE_TMA` (inductor must then provide the
    descriptors' scratch allocator).
    """
    relu2 = "+relu2" in epi
    plain = cublas_ok and not relu2  # cuBLAS computes the whole problem
    ew = cublas_ok and epi == "+relu2"  # cuBLAS's product, then relu² in place
    if force == "cublas+ew":
        if ew:
            return ("cublas+ew",)
        force = None  # forces nothing else
    if device_type != "cuda":
        return ("ptr", _ptr_config(M, N, K, 1, dtype, True))
    major, num_sms, name = _device_info(index)
    half = dtype in (torch.float16, torch.bfloat16)
    choice = None
    if impl == "auto" and force is None:
        lay = ("nt"[a_t] if a_t >= 0 else "s") + ("nt"[b_t] if b_t >= 0 else "s")
        choice = MATMUL_TABLE.get(name, {}).get(f"{M}x{N}x{K}:{lay}{epi}")
    if force is None:
        if plain and impl == "cublas":
            return ("cublas",)
        if ew and choice == "cublas+ew":
            return ("cublas+ew",)
        if M <= 16 and half:
            return _plan_few_rows(K, impl, plain)
        if plain and impl == "auto" and choice not in ("tma", "ptr"):
            return ("cublas",)
    tma = major in (9, 10) and half and a_t >= 0 and b_t >= 0 and (N * out_size) % 16 == 0
    if force == "ptr" or not tma or choice == "ptr" or (tracing and not COMPILE_TMA):
        return ("ptr", _ptr_config(M, N, K, 1, dtype, False))
    return ("tma", _split_k(M, N, K, num_sms) if epi == "" else 1, num_sms)


# Decode-sized products (M <= 16 rows: a token per sequence) stream the weight once, so they
# are latency- and bandwidth-bound: many narrow programs, each walking a long K step. H200,
# enwik8 decode shapes, kernel time (benchmarks/probe_decode_gemm.py, 2026-11-22): this config
# 2.7-3.7 us at K = 512 (cuBLAS 3.0-3.7, the TMA kernel 6.5-8.2, torch's mm + relu + square
# 5.7); at K = 2048 cuBLAS wins (5.4 vs 6.2 us), so plain products with a long K go there under
# "auto".
_FEW_ROWS_PTR = (16, 16, 256, 8, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages


def _plan_few_rows(K: int, impl: str, cublas_ok: bool) -> tuple:
    """The plan of a decode-sized fp16/bf16 problem (cublas_ok: cuBLAS computes it whole)."""
    if cublas_ok and impl == "auto" and K >= 2048:
        return ("cublas",)
    return ("ptr", _FEW_ROWS_PTR)


_EPI = {  # (relu², residual) -> the table's key suffix
    (False, False): "",
    (True, False): "+relu2",
    (False, True): "+res",
    (True, True): "+relu2+res",
}


def _tma_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (triton.set_allocator)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


# Eager launches after the first: (grid, tuned config kwargs) per problem, so that the
# autotuner's per-call work is skipped. Filled from the autotuner's pick.
_TUNED: dict[tuple, tuple] = {}


def _dropout_args(drop: tuple[float, torch.Tensor] | None, placeholder: torch.Tensor) -> tuple:
    """(SEED, threshold, drop_scale) kernel arguments of an epilogue dropout (p, seed)."""
    if drop is None:
        return placeholder, 0, 1.0
    p, seed = drop
    return seed, dropout_threshold(p), 1.0 / (1.0 - p)


def _launch_tma(a, b, c, r, aux, relu_squared, a_lay, b_lay, split, num_sms, drop) -> None:
    """Persistent TMA kernel (autotuned) for 2-D a (M, K), b (K, N) into c (M, N)."""
    M, K = a.shape
    N = b.shape[1]
    # A context variable in Triton: set it in whichever thread launches (autograd's too).
    triton.set_allocator(_tma_alloc)
    ws = c
    if split > 1:
        ws = torch.empty((split, M, N), device=c.device, dtype=torch.float32)
    rs = r.stride() if r is not None else (0, 0)
    args = (
        a, b, c, r if r is not None else c, aux if aux is not None else c, ws,
        M, N, K, a_lay[1], b_lay[1], N, rs[0], rs[1], N, split, *_dropout_args(drop, c),
    )  # fmt: skip
    flags = {
        "A_T": bool(a_lay[0]),
        "B_T": bool(b_lay[0]),
        "RELU_SQUARED": relu_squared,
        "HAS_RESIDUAL": r is not None,
        "STORE_AUX": aux is not None,
        "DROPOUT": drop is not None,
        "SPLIT": split > 1,
        "NUM_SMS": num_sms,
    }

    def grid(meta):
        bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
        return (min(num_sms, ((M + bm - 1) // bm) * ((N + bn - 1) // bn) * split),)

    if is_traced(a):  # torch.compile: inductor tunes and launches
        wrap_triton(_mm_tma_tuned)[grid](*args, **flags)
    else:
        key = (M, N, K, split, a_lay[0], b_lay[0], relu_squared, r is not None)
        key += (aux is not None, a.dtype, c.dtype, None if r is None else r.dtype, num_sms)
        key += (drop is not None,)
        tuned = _TUNED.get(key)
        if tuned is not None:
            launcher(_mm_tma_kernel)[tuned[0]](*args, **flags, **tuned[1])
        else:
            _mm_tma_tuned[grid](*args, **flags)
            best = getattr(_mm_tma_tuned, "best_config", None)
            if best is not None:
                _TUNED[key] = (grid(best.kwargs), best.all_kwargs())
    if split > 1:
        mn = M * N
        launcher(_splitk_reduce_kernel)[(cdiv(mn, 1024),)](ws, c, mn, split, BLOCK=1024)


def _launch_ptr(a, b, c, r, aux, relu_squared, cfg, interpret, drop=None) -> None:
    """Pointer kernel over 3-D views a (B, M, K), b (B, K, N), c (B, M, N)."""
    batch, M, K = a.shape
    N = b.shape[2]
    block_m, block_n, block_k, group_m, num_warps, num_stages = cfg
    # Interpreter only: it has no bf16 arithmetic, so bf16 tiles are multiplied in fp32.
    upcast = interpret and a.dtype == torch.bfloat16
    # ieee: exact fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16 operands
    # ignore the setting and always use tensor cores.
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    rs = r.stride()[-2:] if r is not None else (0, 0)
    grid_mn = cdiv(M, block_m) * cdiv(N, block_n)
    for start in range(0, batch, _MAX_GRID_BATCH):
        # Slice only when the batch needs several launches: views cost host time.
        end = min(batch, start + _MAX_GRID_BATCH)
        a_, b_, c_ = a, b, c
        if end - start < batch:
            a_, b_, c_ = a[start:end], b[start:end], c[start:end]
        launcher(_mm_ptr_kernel)[(grid_mn, end - start)](
            a_, b_, c_, r if r is not None else c_, aux if aux is not None else c_,
            M, N, K, *a_.stride(), *b_.stride(), *c_.stride(), rs[0], rs[1], N,
            *_dropout_args(drop, c_),
            RELU_SQUARED=relu_squared, HAS_RESIDUAL=r is not None, STORE_AUX=aux is not None,
            DROPOUT=drop is not None, DOT_PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip


def _mm2d_into(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    relu_squared: bool = False,
    residual: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    drop: tuple[float, torch.Tensor] | None = None,
) -> None:
    """c = dropout(act(a @ b)) [+ residual] for 2-D a (M, K), b (K, N) of any strides; c
    (M, N) fresh.

    aux (M, N, contiguous, a's dtype): with relu_squared, also receives relu(a @ b).
    drop: (p, seed) of a dropout after the activation (relu_squared only), or None.
    """
    M, K = a.shape
    N = b.shape[1]
    if c.numel() == 0:
        return
    if K == 0:  # an empty sum: act(0) = 0 for both activations
        if residual is None:
            c.zero_()
        else:
            c.copy_(residual)
        if aux is not None:
            aux.zero_()
        return  # act(0) = 0: nothing for a dropout to scale
    device = a.device
    M, N, K = int(M), int(N), int(K)  # symbolic sizes: specialise (plans are per shape)
    epi = _EPI[relu_squared, residual is not None]
    if device.type == "cuda":
        a_lay, b_lay = _layout(a), _layout(b)
        traced = is_traced(a)
        # cuBLAS computes the product in one dtype, addmm's residual in that dtype, and
        # fp16/bf16 products written in fp32 (the weight gradients of mixed precision; while
        # tracing only where mm's out_dtype has a meta kernel)
        widen = c.dtype == torch.float32 and residual is None
        widen = widen and (not traced or _MM_OUT_DTYPE_TRACEABLE)
        cublas_ok = c.dtype == a.dtype or widen
        if residual is not None:
            cublas_ok = cublas_ok and residual.dtype == a.dtype
        plan = _plan(
            "cuda", device.index, a.dtype, M, N, K,
            a_lay[0] if a_lay else -1, b_lay[0] if b_lay else -1,
            epi, cublas_ok, c.element_size(), matmul_impl, _FORCE_PATH, traced,
        )  # fmt: skip
        if plan[0] == "tma":
            _launch_tma(a, b, c, residual, aux, relu_squared, a_lay, b_lay, plan[1], plan[2], drop)
            return
    else:  # the interpreter; torch.mm where a test forces "cublas+ew"
        cublas_ok = c.dtype == a.dtype and residual is None
        plan = _plan(
            device.type, 0, a.dtype, M, N, K, -1, -1, epi, cublas_ok, c.element_size(),
            matmul_impl, _FORCE_PATH,
        )  # fmt: skip
    if plan[0] == "cublas" and residual is not None:
        torch.addmm(residual, a, b, out=c)  # the residual as cuBLAS's own C input (beta = 1)
    elif plan[0] in ("cublas", "cublas+ew"):
        if c.dtype != a.dtype:
            torch.mm(a, b, c.dtype, out=c)  # fp32 accumulator written as is, no cast pass
        else:
            torch.mm(a, b, out=c)
        if plan[0] == "cublas+ew":
            _relu2_in_place(c, aux, drop)
    else:
        interpret = device.type != "cuda"
        _launch_ptr(
            a[None], b[None], c[None], residual, aux, relu_squared, plan[1], interpret, drop
        )


def _relu2_in_place(
    c: torch.Tensor, aux: torch.Tensor | None, drop: tuple[float, torch.Tensor] | None
) -> None:
    """c (M, N, contiguous) = dropout(relu(c)²) in place, aux = relu(c) if given: the relu²
    epilogue after cuBLAS's product (`_relu2_ew_kernel`)."""
    M, N = c.shape
    # 16 x 256 tiles, 4 warps: the d(pre) pass's (`relu2_grad_op`), also one read and write
    launcher(_relu2_ew_kernel)[(cdiv(M, 16), cdiv(N, 256))](
        c, aux if aux is not None else c, M, N, *_dropout_args(drop, c),
        STORE_AUX=aux is not None, DROPOUT=drop is not None, BLOCK_M=16, BLOCK_N=256,
        num_warps=4,
    )  # fmt: skip


def _bmm_into(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """c[i] = a[i] @ b[i] for 3-D views of any strides: torch.bmm on CUDA (unless
    `matmul_impl` is "triton" or a path is forced), else the pointer kernel; batch 1 is 2-D."""
    batch, M, K = (int(d) for d in a.shape)  # symbolic sizes: specialise
    if batch == 1:
        _mm2d_into(a[0], b[0], c[0])
        return
    if c.numel() == 0:
        return
    if K == 0:
        c.zero_()
        return
    interpret = a.device.type != "cuda"
    # a plain product: cuBLAS's batched GEMM unless our kernel is asked for
    if not interpret and matmul_impl != "triton" and _FORCE_PATH is None and c.dtype == a.dtype:
        torch.bmm(a, b, out=c)
        return
    cfg = _ptr_config(M, int(b.shape[2]), K, batch, a.dtype, interpret)
    _launch_ptr(a, b, c, None, None, False, cfg, interpret)


# ------------------------------------------------------------------------------------------
# Ops (torch.library), their autograd, and the public functions
# ------------------------------------------------------------------------------------------


@triton_op("triton_transformer::bmm", mutates_args=())
def bmm_op(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a @ b for 2-D a (M, K), b (K, N) or 3-D a (B, M, K), b (B, K, N); any strides.

    out_dtype: the output's dtype (None: a's). The fp32 accumulator is rounded once, into
    it: fp32 weight gradients of bf16 products need no separate cast pass."""
    c = torch.empty((*a.shape[:-1], b.shape[-1]), device=a.device, dtype=out_dtype or a.dtype)
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
    return torch.empty((x.shape[0], weight.shape[0]), device=x.device, dtype=dtype)


@triton_op("triton_transformer::linear", mutates_args=())
def linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    relu_squared: bool,
    p: float = 0.0,
    seed: torch.Tensor | None = None,
    weight_lp: torch.Tensor | None = None,
) -> torch.Tensor:
    """dropout_p(act(x @ weight.T)) [+ residual] for 2-D x (M, K), weight (N, K), residual
    (M, N); dropout (p > 0, relu_squared only) from `seed`, a 0-dim int64 device tensor.

    weight_lp: the weight in x's dtype when `weight` is wider (mixed precision: an fp32
    weight under bf16 autocast), else None. The product uses it; the weight's gradient is
    written in the weight's own dtype by the dW GEMM, with no cast pass either way.

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dropout_p(relu(x @ weight.T)²) [+ residual], relu(x @ weight.T)): the second output,
    written by the same epilogue, is what the backward needs (it does not underflow in fp16).
    The dropout (p > 0) draws its mask from `seed`, a 0-dim int64 device tensor; weight_lp
    as in `linear_op`."""
    _check_epilogue_dropout(p, seed, True)
    w = weight if weight_lp is None else weight_lp
    y = _linear_out(x, w, residual)
    r = torch.empty((x.shape[0], w.shape[0]), device=x.device, dtype=x.dtype)
    _mm2d_into(x, w.t(), y, True, residual, r, (p, seed) if p > 0.0 else None)
    return y, r


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
    dp = torch.empty((M, N), device=s.device, dtype=s.dtype)
    if dp.numel():
        drop = (p, seed) if p > 0.0 else None
        launcher(_relu2_grad_kernel)[(cdiv(M, 16), cdiv(N, 256))](
            dy, s, dp, M, N, *dy.stride(), *s.stride(), *_dropout_args(drop, s),
            FROM_SQUARE=from_square, DROPOUT=drop is not None, BLOCK_M=16, BLOCK_N=256,
            num_warps=4,
        )  # fmt: skip
    return dp


def _linear_setup_context(ctx, inputs, output) -> None:
    x, weight, residual, relu_squared, ctx.p, seed, weight_lp = inputs
    ctx.relu_squared = relu_squared
    ctx.from_square = True
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.weight_dtype = weight.dtype
    # relu(pre) = sqrt(y) only holds without a residual; linear() never asks for that grad.
    ctx.can_grad = not (relu_squared and residual is not None)
    ctx.save_for_backward(
        x, weight if weight_lp is None else weight_lp,
        output if relu_squared and ctx.can_grad else None, seed if ctx.p else None,
    )  # fmt: skip


def _linear_relu2_setup_context(ctx, inputs, output) -> None:
    x, weight, residual, ctx.p, seed, weight_lp = inputs
    ctx.relu_squared = True
    ctx.from_square = False
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.weight_dtype = weight.dtype
    ctx.can_grad = True
    ctx.mark_non_differentiable(output[1])
    # relu(pre) gets no gradient: without this autograd would fill an M×N zero tensor for it
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(
        x, weight if weight_lp is None else weight_lp, output[1], seed if ctx.p > 0.0 else None
    )


def _linear_grads(ctx, dy: torch.Tensor):
    if not ctx.can_grad:
        raise RuntimeError(
            "linear_op with relu_squared and a residual saves no relu(pre): use "
            "linear_relu2_op (as linear() does) when gradients are needed"
        )
    x, w, s, seed = ctx.saved_tensors  # w: the weight as the product used it
    # d(pre) = dy · keep / (1 - p) · 2·relu(pre), one elementwise pass; without relu²
    # d(pre) = dy, cast only when a wider residual promoted the output.
    if ctx.relu_squared:
        dpre = call_op(relu2_grad_op, dy, s, ctx.from_square, ctx.p, seed)
    else:
        dpre = dy.to(x.dtype)
    dx = dw = dres = None
    if ctx.needs_input_grad[0]:  # dX = d(pre) @ W
        dx = call_op(bmm_op, dpre, w)
    if ctx.needs_input_grad[1]:  # dW = d(pre)^T @ X, the transpose a view, in W's own dtype
        dw = call_op(bmm_op, dpre.t(), x, ctx.weight_dtype)
    if ctx.needs_input_grad[2]:
        dres = dy.to(ctx.residual_dtype)
    return dx, dw, dres


@first_order_only("linear")
def _linear_backward(ctx, dy: torch.Tensor):
    return *_linear_grads(ctx, dy), None, None, None, None


@first_order_only("linear")
def _linear_relu2_backward(ctx, dy: torch.Tensor | None, dr: torch.Tensor | None):
    if dy is None:  # grads are not materialised: the output was not used
        return (None,) * 6
    return *_linear_grads(ctx, dy), None, None, None


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)
linear_relu2_op.register_autograd(_linear_relu2_backward, setup_context=_linear_relu2_setup_context)


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    """View (..., R, C) as (B, R, C); a view whenever the leading dims can be merged."""
    # An explicit batch size rather than -1, which reshape rejects for zero-size tensors.
    return x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])


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
        return call_op(bmm_op, a, b)
    c = call_op(bmm_op, _as_batched(a), _as_batched(b))
    return c.view(*a.shape[:-1], b.shape[-1])


# Low-precision copies of wider weights shared within a `reuse_weight_casts` context:
# (id(weight), dtype) -> (weight, its version counter when cast, the copy). None: no context.
_weight_casts: dict | None = None


@contextlib.contextmanager
def reuse_weight_casts() -> Iterator[None]:
    """Within this context `linear` casts each wider weight (fp32 under bf16 autocast) to the
    activations' dtype once and reuses that copy: the micro-batches of one optimizer step read
    one bf16 copy per weight instead of casting it again each (the enwik8 config on an H200:
    132 -> 33 cast launches, 379 -> 95 µs per step). A weight changed in place inside the
    context (its version counter moves) is cast again. Copies are dropped on exit; nested
    contexts share the outer one's. Not used while torch.compile traces (the compiled graph
    casts itself).
    """
    global _weight_casts
    outer = _weight_casts
    if outer is None:
        _weight_casts = {}
    try:
        yield
    finally:
        _weight_casts = outer


def _weight_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """weight's copy in dtype made outside autograd (reused inside `reuse_weight_casts`), or
    None when weight is already in dtype."""
    if weight.dtype == dtype:
        return None
    # is_compiling first: Dynamo then never reads (and guards on) the module global
    if torch.compiler.is_compiling() or is_traced(weight) or _weight_casts is None:
        return weight.detach().to(dtype)
    cache = _weight_casts
    key = (id(weight), dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is weight and hit[1] == weight._version:
        return hit[2]
    copy = weight.detach().to(dtype)
    cache[key] = (weight, weight._version, copy)
    return copy


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
    weight (N, K); returns (..., N).

    activation: None or "relu_squared" (relu(y)², fused into the matmul's epilogue, or a
        pass of its own after cuBLAS's product where `MATMUL_TABLE` says "cublas+ew").
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
    weight_lp = _weight_in(weight, x.dtype)
    if save_relu:
        y2 = call_op(linear_relu2_op, x2, weight, r2, dropout_p, seed, weight_lp)[0]
    else:
        y2 = call_op(linear_op, x2, weight, r2, relu_squared, dropout_p, seed, weight_lp)
    return y2 if two_d else y2.view(out_shape)
