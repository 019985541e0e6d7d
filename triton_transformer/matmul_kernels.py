"""The Triton kernels of the matmuls, their relu² passes and their SwiGLU epilogue (launched by
`matmul_plan.py`).

- `_mm_ptr_kernel`: the pointer-based (strided, batched) matmul, one program per output tile:
  other GPUs, fp32, batched products, decode-sized problems, layouts TMA cannot describe,
  and the interpreter (small tiles; `launch_mm_ptr` hands it bf16 operands and outputs as
  fp32 buffers, so the kernel carries no interpreter flag).
- `_mm_tma_kernel`: the persistent Hopper matmul, tiles loaded through device-side tensor
  descriptors, a transposed operand transposed in shared memory; `_mm_tma_tuned` is it
  autotuned over `_tma_configs()` per `_TMA_KEY`. With split K its fp32 partials are summed
  in a fixed order by `_splitk_reduce_kernel` (deterministic, no atomics).
- `_epilogue`, shared by both matmuls, on the fp32 accumulator: dropout(act(acc)) [+ residual]
  with act(y) = relu(y)² or none; it can also write relu(y) (what relu²'s backward needs where
  the output does not determine it: `bmm.py`'s "relu² backward"). The dropout mask is
  `_jit_helpers.dropout_keep_tile`'s, keyed by (seed, row, column) of the (M, N) output.
- SWIGLU, a constexpr of both matmuls (instead of the epilogues above): B holds the gate
  columns then the up columns (a Llama feed-forward's [gate; up] weight, transposed); each
  output tile accumulates both halves in two fp32 accumulators (two B tiles per K step, for
  the TMA kernel two loads of the one descriptor), stores them to AUX (M, 2·N) for the
  backward and writes silu(gate) * up (`swiglu.silu_mul`, the elementwise kernel's own
  arithmetic). The TMA kernel's SWIGLU variant is autotuned apart, `_mm_tma_swiglu_tuned`
  over `_tma_swiglu_configs()` (narrower tiles, fewer stages: two accumulators' registers).
- `_relu2_ew_kernel`: that relu² epilogue as a pass of its own, in place after cuBLAS's
  product ("cublas+ew"), with the same mask. (SwiGLU's "cublas+ew" pass is `swiglu.py`'s
  forward kernel.)
- RELU2_GRAD, a constexpr of both matmuls (instead of the epilogues above, no split): relu²'s
  backward in the epilogue of dY @ W, d(pre) = (dY @ W) · 2·relu(pre) [· mask / (1 - p)], with
  relu(pre) from what the forward kept (`_relu2_slope`): the feed-forward's backward without
  the pass below (`mlp.py`).
- `_relu2_grad_kernel`: relu²'s backward as a pass of its own, d(pre) = dy · keep / (1 - p) ·
  2·relu(pre), the mask regenerated from the forward's seed.

Which kernel runs a problem (or cuBLAS), with which tiles, and how it is launched:
`matmul_plan.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_transformer._jit_helpers import dropout_keep_tile
from triton_transformer.swiglu import silu_mul


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
def _relu2_slope(s, drop_scale, FROM_SQUARE: tl.constexpr, DROPOUT: tl.constexpr):
    """2·relu(pre) in fp32 from a tile s of what the forward kept: relu(pre) itself, or with
    FROM_SQUARE its output y = relu(pre)² (· drop_scale where the mask kept it; where it
    dropped, y = 0 and so is the slope, which the mask zeroes anyway)."""
    s = s.to(tl.float32)
    if FROM_SQUARE:
        if DROPOUT:
            s = s / drop_scale
        s = tl.sqrt(s)
    return 2.0 * s


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
def _swiglu_epilogue(g, u, AUX, offs_m, offs_n, M, N, stride_xm):
    """silu(g) * u of the fp32 gate and up tiles (rows offs_m, columns offs_n of the (M, N)
    output, int64), the pointer kernel's SWIGLU epilogue; also stores g and u to AUX (M, 2·N;
    row stride stride_xm, unit column stride) in the weight's [gate | up] layout: the
    pre-activations the backward needs."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    aux_ptrs = AUX + offs_m[:, None] * stride_xm + offs_n[None, :]
    tl.store(aux_ptrs, g.to(AUX.dtype.element_ty), mask=mask)
    tl.store(aux_ptrs + N, u.to(AUX.dtype.element_ty), mask=mask)
    return silu_mul(g, u)


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
    SWIGLU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    RELU2_GRAD: tl.constexpr = 0,
):
    """C[b] = epilogue(A[b] @ B[b]) for A (M, K), B (K, N), C (M, N), all given by strides.

    One program per output tile (grid: tiles, batch). The pointer-based path: the
    interpreter, GPUs without TMA, fp32, batches, and layouts TMA cannot describe. The
    epilogue operands (R, AUX) are used with batch 1 only.

    SWIGLU (batch 1, instead of the other epilogues): B is (K, 2·N), gate columns then up
    columns; each tile accumulates both halves (acc from B's columns [n, n + BLOCK_N), acc_u
    from [N + n, ...)), stores them to AUX (M, 2·N) and writes C = silu(gate) * up.

    RELU2_GRAD (batch 1; 1: R holds relu(pre), 2: R holds relu²'s output, see
    `_relu2_slope`): relu²'s backward in the epilogue, C = (A @ B) · 2·relu(pre) [· the
    forward's dropout mask · drop_scale], d(pre) straight from the product dY @ W.
    """
    tl.static_assert(not SWIGLU or not (RELU_SQUARED or HAS_RESIDUAL or DROPOUT))
    tl.static_assert(RELU2_GRAD == 0 or not (RELU_SQUARED or HAS_RESIDUAL or SWIGLU))
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
    if SWIGLU:  # the up half: B's columns N + offs_n
        bu_ptrs = B + bid * stride_bb + offs_k[:, None] * stride_bk
        bu_ptrs += (N + offs_n)[None, :] * stride_bn
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # Masks cover the ragged edges, so M, N and K need not be multiples of the tiles.
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            bu = tl.load(bu_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
            bu_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if SWIGLU:
        acc = _swiglu_epilogue(acc, acc_u, AUX, offs_m, offs_n, M, N, stride_xm)
    else:
        seed = 0
        if DROPOUT:
            seed = tl.load(SEED)
        if RELU2_GRAD != 0:
            s_ptrs = R + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
            s = tl.load(s_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            acc *= _relu2_slope(s, tl.cast(drop_scale, tl.float32), RELU2_GRAD == 2, DROPOUT)
        acc = _epilogue(
            acc, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed, threshold,
            tl.cast(drop_scale, tl.float32), pid_n * BLOCK_N, RELU_SQUARED, HAS_RESIDUAL,
            STORE_AUX, DROPOUT, BLOCK_N,
        )  # fmt: skip
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
    SWIGLU: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr,
    FLATTEN: tl.constexpr,
    RELU2_GRAD: tl.constexpr = 0,
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
    SWIGLU (instead of the other epilogues, no split): B is (K, 2·N), gate columns then up
    columns (the weight's [gate; up] rows when B_T); each K step loads two B tiles through
    the one descriptor, [n, n + BLOCK_N) and [N + n, ...), into two fp32 accumulators; the
    epilogue stores both to AUX (M, 2·N, row stride stride_xm, [gate | up]) and silu(gate) *
    up to C, all through descriptors. A gate tile past column N reads up columns: clipped by
    the (M, N) stores.
    RELU2_GRAD (no split) as in `_mm_ptr_kernel`: relu²'s backward, the tiles of R (M, N, row
    stride stride_rm, unit column stride) loaded through a descriptor.
    """
    tl.static_assert(not SWIGLU or not (RELU_SQUARED or HAS_RESIDUAL or DROPOUT or SPLIT))
    tl.static_assert(RELU2_GRAD == 0 or not (RELU_SQUARED or HAS_RESIDUAL or SWIGLU or SPLIT))
    n_b = 2 * N if SWIGLU else N  # B's columns: gate and up with SWIGLU
    if A_T:
        a_desc = tl.make_tensor_descriptor(A, [K, M], [stride_a, 1], [BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(A, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(B, [n_b, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, [K, n_b], [stride_b, 1], [BLOCK_K, BLOCK_N])
    SUB_N: tl.constexpr = BLOCK_N // EPI_SUB
    c_desc = tl.make_tensor_descriptor(C, [M, N], [stride_c, 1], [BLOCK_M, SUB_N])
    if SWIGLU:  # the gate and up halves of AUX, each (M, N): each clips its own stores
        g_desc = tl.make_tensor_descriptor(AUX, [M, N], [stride_xm, 1], [BLOCK_M, SUB_N])
        u_desc = tl.make_tensor_descriptor(AUX + N, [M, N], [stride_xm, 1], [BLOCK_M, SUB_N])
    if RELU2_GRAD != 0:  # what the forward kept, read tile by tile like C is written
        s_desc = tl.make_tensor_descriptor(R, [M, N], [stride_rm, 1], [BLOCK_M, SUB_N])

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
        if SWIGLU:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
            if SWIGLU:  # the up tile: same descriptor, N columns on
                if B_T:  # noqa: SIM108
                    bu = b_desc.load([N + off_n, off_k]).T
                else:
                    bu = b_desc.load([off_k, N + off_n])
                acc_u = tl.dot(a, bu, acc_u)

        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        if SPLIT:
            # fp32 partial of chunk (work % split_k); the reduce kernel adds them in order.
            offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
            ws_ptrs = WS + (work % split_k).to(tl.int64) * M * N
            ws_ptrs += offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        elif SWIGLU:
            if EPI_SUB == 2:
                g0, g1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1)))
                u0, u1 = tl.split(tl.permute(tl.reshape(acc_u, (BLOCK_M, 2, SUB_N)), (0, 2, 1)))
            else:
                g0, g1, u0, u1 = acc, acc, acc_u, acc_u
            for h in tl.static_range(EPI_SUB):
                g = g0 if h == 0 else g1
                u = u0 if h == 0 else u1
                col = off_n + h * SUB_N
                g_desc.store([off_m, col], g.to(AUX.dtype.element_ty))
                u_desc.store([off_m, col], u.to(AUX.dtype.element_ty))
                c_desc.store([off_m, col], silu_mul(g, u).to(C.dtype.element_ty))
        elif EPI_SUB == 2:
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, SUB_N)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            for h in tl.static_range(2):
                part = acc0 if h == 0 else acc1
                offs_n = off_n.to(tl.int64) + h * SUB_N + tl.arange(0, SUB_N)
                if RELU2_GRAD != 0:
                    s = s_desc.load([off_m, off_n + h * SUB_N])
                    part *= _relu2_slope(s, drop_scale, RELU2_GRAD == 2, DROPOUT)
                part = _epilogue(
                    part, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed,
                    threshold, drop_scale, off_n + h * SUB_N, RELU_SQUARED, HAS_RESIDUAL,
                    STORE_AUX, DROPOUT, SUB_N,
                )  # fmt: skip
                c_desc.store([off_m, off_n + h * SUB_N], part.to(C.dtype.element_ty))
        else:
            offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
            if RELU2_GRAD != 0:
                s = s_desc.load([off_m, off_n])
                acc *= _relu2_slope(s, drop_scale, RELU2_GRAD == 2, DROPOUT)
            acc = _epilogue(
                acc, R, AUX, offs_m, offs_n, M, N, stride_rm, stride_rn, stride_xm, seed,
                threshold, drop_scale, off_n, RELU_SQUARED, HAS_RESIDUAL, STORE_AUX, DROPOUT,
                BLOCK_N,
            )  # fmt: skip
            c_desc.store([off_m, off_n], acc.to(C.dtype.element_ty))


def _configs(rows: tuple) -> list[triton.Config]:
    """triton.Configs of (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, EPI_SUB, FLATTEN) rows."""
    cfg = []
    for bm, bn, bk, stages, warps, sub, flat in rows:
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPI_SUB": sub}
        meta["FLATTEN"] = flat
        cfg.append(triton.Config(meta, num_stages=stages, num_warps=warps))
    return cfg


def _tma_configs() -> list[triton.Config]:
    """Tile shapes / stages / warps the Hopper kernel is autotuned over (per shape).

    128x256 tiles (two warpgroups) for large outputs, 128x128 in two pipeline depths, and
    narrower tiles for problems with few output tiles. Shared memory per config
    (stages x (BM + BN) x BK x 2 bytes, plus the epilogue tile) stays under 227 KiB.
    """
    return _configs((
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
    ))  # fmt: skip


def _tma_swiglu_configs() -> list[triton.Config]:
    """The SWIGLU variant's configs (BLOCK_N per half): two fp32 accumulators and two B tiles
    per K step, so narrower tiles and fewer stages than `_tma_configs()`: 2·BM·BN / (32·warps)
    accumulator registers per thread, 128 at most (a 128x128 tile on 4 warps would hold 256
    and spills). Compiled for sm_90 with triton 3.9 (cuobjdump's resource usage): 98-179
    registers, no stack, 144-208 KiB of shared memory (stages x (BM + 2·BN) x BK x 2 bytes
    plus the three epilogue stores, y, gate and up) of the 227 available."""
    return _configs((
        (128, 128, 64, 3, 8, 2, True),
        (128, 128, 64, 3, 8, 2, False),
        (128, 128, 64, 4, 8, 2, True),
        (128, 128, 64, 3, 8, 1, True),
        (256, 64, 64, 3, 8, 2, True),
        (128, 64, 64, 4, 4, 1, True),
        (128, 64, 64, 4, 8, 1, True),
        (128, 64, 128, 3, 8, 1, True),
        (64, 128, 64, 4, 4, 2, True),
    ))  # fmt: skip


_TMA_KEY = ["M", "N", "K", "split_k", "A_T", "B_T", "RELU_SQUARED", "HAS_RESIDUAL"]
# NUM_SMS: a new GPU model tunes anew
_TMA_KEY += ["STORE_AUX", "DROPOUT", "SWIGLU", "RELU2_GRAD", "NUM_SMS"]
# The autotuner's key also holds every tensor argument's dtype.
_mm_tma_tuned = triton.autotune(configs=_tma_configs(), key=_TMA_KEY)(_mm_tma_kernel)
# The SWIGLU epilogue, tuned apart over its own configs (its own cache of picks).
_mm_tma_swiglu_tuned = triton.autotune(configs=_tma_swiglu_configs(), key=_TMA_KEY)(_mm_tma_kernel)


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
    dp = dy.to(tl.float32) * _relu2_slope(s, tl.cast(drop_scale, tl.float32), FROM_SQUARE, DROPOUT)
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
