"""The attention backward's single pass for Hopper GPUs, written in Gluon.

Why a second kernel: Triton (3.6) waits for each tile product right after issuing it, so in
`attention._attention_bwd_kernel` the tensor cores sit idle while the exponentials of P run,
and the reverse. Gluon states the schedule explicitly: the products are issued asynchronously
(`warpgroup_mma(..., is_async=True)`) and waited for only where their result is read, and the
next query block's q and dO arrive by TMA while this one computes.

The math is `attention`'s single pass, for one key block K_j, V_j (BLOCK_N keys) over the
query blocks i that see it (scores in log2 units, lse_i the forward's log-sum-exp in log2
units, Δ_i = Σ_d dO_i · O_i):

    Sᵀ  = K_j Q_iᵀ · scale·log2(e)        (BLOCK_N, BLOCK_M)
    Pᵀ  = exp2(Sᵀ - lse_i)                 (causal: 0 where key > query + n_k - n_q)
    dPᵀ = V_j dO_iᵀ
    dSᵀ = Pᵀ ∘ (dPᵀ - Δ_i)
    dV_j += Pᵀ dO_i,   dK_j += dSᵀ Q_i     (registers, summed over i)
    dQ_i += dS_i K_j                       (fp32, added to a (b·h, n_q, d) sum in L2;
                                            at d >= 64 computed as dQ_iᵀ = K_jᵀ dS_iᵀ)

With dropout (keep mask M, rate p) the forward multiplied P by M / (1 - p) before V, so dV
reads that product and dP passes back through it: dV_j += (Pᵀ ∘ Mᵀ / (1 - p)) dO_i and
dPᵀ = (V_j dO_iᵀ) ∘ Mᵀ / (1 - p), while dSᵀ keeps the undropped Pᵀ (Δ_i = Σ dO_i · O_i
already holds the dropped output). M is the package's mask of the (n_q, n_k) scores
(`_gluon.keep_tile`, drawn by rows of queries, transposed into Sᵀ's layout through shared
memory), regenerated from the forward's seed while Sᵀ and dPᵀ run.

dK is scaled by `scale` at the end, dQ by `attention._attention_bwd_dq_kernel`. Per query
block the schedule is: Sᵀ and dPᵀ issued together; exp2 while dPᵀ runs; dSᵀ written to shared
memory (dQ's product reads it from there); dQ, dV and dK issued together; dQ's tile
written to shared memory while dV and dK run, and added to the fp32 sum by one TMA bulk
reduction at the start of the next step (per-element atomics made the kernel 30% slower). The
next step's q and dO arrive by TMA during this one.

Not done yet: keeping the tensor cores busy between steps. Issuing the next block's Sᵀ and
dPᵀ before this block's dQ tile is stored made ptxas (12.8, 12.9) serialize the products
(warning C7514: accumulators carried across the loop's back edge; 15% slower); waiting for
the next Sᵀ within the step avoids the warning but needs more registers (spills; 5-10%
slower). What paid instead: causal heads step over 32 queries, which fits three programs per
SM (168 registers). The kernel reaches about 200 TFLOP/s at GPT-2's shape; producer /
consumer warpgroups, as cuDNN and FlashAttention-3 have, are the next step.

Scope: Hopper (sm_90), fp16 / bf16, head dims 32, 64 and 128 (row lengths TMA and the
products take without padding), with or without dropout, no key padding mask, multi-head
(not grouped) attention, tensors TMA can describe. `attention.launch_attention_bwd` takes it
where all of that holds, the caller allows the non-deterministic single pass and `usable` says
it measured faster; everything else runs the Triton kernel. Eager launches only:
torch.compile traces the Triton kernel.
"""

from __future__ import annotations

import functools

import torch

from triton_transformer import _gluon
from triton_transformer._gluon import HAVE_GLUON, gl, gluon, hopper, is_sm90, mbarrier, tma
from triton_transformer._jit_helpers import longest_first
from triton_transformer.utils import dropout_threshold, launcher

__all__ = ["HAVE_GLUON", "bwd_tiles", "launch_bwd_sm90"]

# head dims this kernel takes (rows of 64, 128 and 256 bytes in 16-bit types); eager launches
# take it at those of `TAKEN_HEAD_DIMS` only
HEAD_DIMS = (32, 64, 128)


if HAVE_GLUON:

    @gluon.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
    def _attention_bwd_sm90_kernel(
        Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC, SEED, off_dk, off_dv,
        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
        sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
        BH, H, N_Q, N_K, qk_scale, sm_scale, threshold, drop_scale,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr, DROPOUT: gl.constexpr, KV_IN_REGS: gl.constexpr,
        DQ_T: gl.constexpr, LPT_BYTES: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """One program: dK, dV of BLOCK_N keys of one batch·head (grid (key blocks, b·h)),
        and their share of dQ added to DQ_ACC (fp32, (b·h, n_q, HEAD_DIM), zeroed before).
        DROPOUT: the forward dropped P with the package's mask of the (n_q, n_k) scores under
        the seed SEED + (b·h << 32), kept elements scaled by drop_scale = 1 / (1 - p)."""
        qk_scale = qk_scale.to(gl.float32)
        sm_scale = sm_scale.to(gl.float32)
        drop_scale = drop_scale.to(gl.float32)
        dtype: gl.constexpr = Q.dtype.element_ty
        pid = gl.program_id(0)
        bh = gl.program_id(1)
        if CAUSAL:  # each program streams its head's q and dO
            pid, bh = longest_first(pid, bh, BH, N_Q.to(gl.int64) * HEAD_DIM * 4, LPT_BYTES)
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        n0 = pid * BLOCK_N
        seed = 0
        if DROPOUT:  # one Philox key per batch·head, as the forward's
            seed = gl.load(SEED) + (bh.to(gl.int64) << 32)

        # Layouts. Each warpgroup (4 warps) owns 64 keys of Sᵀ, dPᵀ, dK and dV (and 64 rows
        # of dQᵀ); an untransposed dQ tile is split by rows, then by columns over them.
        WARPS_N: gl.constexpr = num_warps // 4
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
        )
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        if DQ_T:  # dQᵀ = Kᵀ dSᵀ, (HEAD_DIM, BLOCK_M): BLOCK_M may be 32 (a product's rows >= 64)
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
            )
            dq_zero = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout)
        else:  # dQ = dS K, (BLOCK_M, HEAD_DIM)
            dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, WARPS_N],
                instr_shape=[16, HEAD_DIM // WARPS_N, 16],
            )  # fmt: skip
            dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        # Pᵀ and dSᵀ feed dV's and dK's products from registers
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        key_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        dq_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [BLOCK_M, HEAD_DIM], gl.float32
        )

        # this head's tensors as TMA descriptors: rows past n_q / n_k read as zeros
        q_desc = tma.make_tensor_descriptor(
            Q + b * sqb + h * sqh, [N_Q, HEAD_DIM], [sqn, 1], [BLOCK_M, HEAD_DIM], row_layout
        )
        do_desc = tma.make_tensor_descriptor(
            DO + b * sdob + h * sdoh, [N_Q, HEAD_DIM], [sdon, 1], [BLOCK_M, HEAD_DIM], row_layout
        )
        k_desc = tma.make_tensor_descriptor(
            K + b * skb + h * skh, [N_K, HEAD_DIM], [skn, 1], [BLOCK_N, HEAD_DIM], key_layout
        )
        v_desc = tma.make_tensor_descriptor(
            V + b * svb + h * svh, [N_K, HEAD_DIM], [svn, 1], [BLOCK_N, HEAD_DIM], key_layout
        )

        dq_desc = tma.make_tensor_descriptor(
            DQ_ACC + bh.to(gl.int64) * N_Q * HEAD_DIM, [N_Q, HEAD_DIM], [HEAD_DIM, 1],
            [BLOCK_M, HEAD_DIM], dq_smem_layout,
        )  # fmt: skip

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], key_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], key_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], row_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], row_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_smem_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)

        # the query blocks that see this key block: causal, rows i >= n0 - (n_k - n_q)
        causal_off = N_K - N_Q  # query i sees keys j <= i + causal_off
        lo = 0
        if CAUSAL:
            lo = (gl.maximum(n0 - causal_off, 0) // BLOCK_M) * BLOCK_M
        # rows from here on see every key of the block: no mask
        full_lo = gl.maximum(n0 + BLOCK_N - 1 - causal_off, 0)
        n_steps = gl.cdiv(N_Q - lo, BLOCK_M)

        mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * 2)
        _gluon.tma_load(k_desc, [n0, 0], kv_bar, k_smem)
        _gluon.tma_load(v_desc, [n0, 0], kv_bar, v_smem)
        tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * 2
        if n_steps > 0:
            mbarrier.expect(ready.index(0), tile_bytes)
            _gluon.tma_load(q_desc, [lo, 0], ready.index(0), q_smem.index(0))
            _gluon.tma_load(do_desc, [lo, 0], ready.index(0), do_smem.index(0))
        mbarrier.wait(kv_bar, phase=0)

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        cols_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        lse_head = LSE + bh.to(gl.int64) * N_Q
        delta_head = DELTA + bh.to(gl.int64) * N_Q

        # KV_IN_REGS: K and V feed Sᵀ's and dPᵀ's products from registers, which halves those
        # two products' shared-memory reads (1-2% faster at d64; at d32 the registers cost a
        # program per SM: `attention_gluon_session17_variants.md`)
        k_a = k_smem
        v_a = v_smem
        if KV_IN_REGS:
            kv_a_layout: gl.constexpr = gl.DotOperandLayout(
                operand_index=0, parent=st_layout, k_width=2
            )
            k_a = k_smem.load(kv_a_layout)
            v_a = v_smem.load(kv_a_layout)
        for step in range(n_steps):
            start_m = lo + step * BLOCK_M
            stage = step % 2
            # every warp is past the previous step's products (its stage of q and dO may be
            # refilled) and has written its part of the previous step's dQ tile
            _gluon.cta_barrier()
            if step > 0:
                _gluon.tma_reduce_add(dq_desc, [start_m - BLOCK_M, 0], dq_smem.index(1 - stage))
            # the reduction of two steps back has read this step's dQ buffer (the other warps
            # pass the barrier below only after this one)
            tma.store_wait(1)
            if step + 1 < n_steps:
                nxt = 1 - stage
                mbarrier.expect(ready.index(nxt), tile_bytes)
                _gluon.tma_load(q_desc, [start_m + BLOCK_M, 0], ready.index(nxt), q_smem.index(nxt))
                _gluon.tma_load(
                    do_desc, [start_m + BLOCK_M, 0], ready.index(nxt), do_smem.index(nxt)
                )
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            offs_m = start_m + cols_m
            lse = gl.load(lse_head + offs_m, mask=offs_m < N_Q, other=float("inf"))
            delta = gl.load(delta_head + offs_m, mask=offs_m < N_Q, other=0.0)
            mbarrier.wait(ready.index(stage), phase=(step // 2) & 1)

            st = _gluon.mma(k_a, q_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dpt = _gluon.mma(v_a, do_s.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            if DROPOUT:  # the mask of this (queries, keys) tile, drawn while the products run
                keep = _gluon.keep_tile(
                    seed, start_m, n0, N_K, threshold, BLOCK_M, BLOCK_N, num_warps
                )  # fmt: skip
                keep_t = gl.convert_layout(gl.permute(keep.to(gl.int8), (1, 0)), st_layout) != 0
            if KV_IN_REGS:  # (register operands stay live until their products are done)
                st, k_a = _gluon.mma_wait(num_outstanding=1, deps=[st, k_a])
            else:
                st = _gluon.mma_wait(num_outstanding=1, deps=[st])
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if CAUSAL:  # noqa: SIM102
                if start_m < full_lo:  # the diagonal's blocks
                    pt = gl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, pt, 0.0)
            if KV_IN_REGS:
                dpt, v_a = _gluon.mma_wait(num_outstanding=0, deps=[dpt, v_a])
            else:
                dpt = _gluon.mma_wait(num_outstanding=0, deps=[dpt])
            if DROPOUT:  # dV reads the dropped P; dP flows back through the mask
                pt_v = gl.where(keep_t, pt * drop_scale, 0.0)
                dpt = gl.where(keep_t, dpt * drop_scale, 0.0)
            else:
                pt_v = pt
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            ds_smem.store(dst)
            hopper.fence_async_shared()
            _gluon.cta_barrier()  # all of dSᵀ written before any warpgroup reads it

            if DQ_T:
                dq = _gluon.mma(
                    k_smem.permute((1, 0)), ds_smem, dq_zero, use_acc=False, is_async=True
                )
            else:
                dq = _gluon.mma(
                    ds_smem.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True
                )
            pt_a = gl.convert_layout(pt_v.to(dtype), a_layout)
            dv = _gluon.mma(pt_a, do_s, dv, is_async=True)
            dst_a = gl.convert_layout(dst, a_layout)
            dk = _gluon.mma(dst_a, q_s, dk, is_async=True)
            dq = _gluon.mma_wait(num_outstanding=2, deps=[dq])
            # added by the next step's first thread
            if DQ_T:
                dq_smem.index(stage).permute((1, 0)).store(dq)
            else:
                dq_smem.index(stage).store(dq)
            # Pᵀ and dSᵀ stay live until their products are done
            dv, dk, pt_a, dst_a = _gluon.mma_wait(num_outstanding=0, deps=[dv, dk, pt_a, dst_a])
            # (a fence between the store and the wait above crashes ptxas 12.8 and 12.9)
            hopper.fence_async_shared()

        if n_steps > 0:
            _gluon.cta_barrier()
            _gluon.tma_reduce_add(
                dq_desc, [lo + (n_steps - 1) * BLOCK_M, 0], dq_smem.index((n_steps - 1) % 2)
            )
            tma.store_wait(0)
        mbarrier.invalidate(kv_bar)
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))
        dk = dk * sm_scale
        rows_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        keep = rows_n[:, None] < N_K
        rows_n = rows_n.to(gl.int64)
        dk_ptrs = DK + off_dk + b * sdkb + h * sdkh + rows_n[:, None] * sdkn + cols_d[None, :]
        gl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=keep)
        dv_ptrs = DV + off_dv + b * sdvb + h * sdvh + rows_n[:, None] * sdvn + cols_d[None, :]
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=keep)


@functools.cache
def bwd_tiles(head_dim: int, causal: bool) -> dict:
    """Tiles of the kernel: BLOCK_M queries per step, BLOCK_N keys per program, warps, whether
    K and V are held in registers (KV_IN_REGS) and whether dQ is computed transposed (DQ_T).

    Measured (H200, 2026-11-27, `attention_gluon_session17_variants.md`, µs, d64, causal / not,
    (16, 1024, 12) and (8, 2048, 16)): (32, 64, 4 warps), K and V in shared memory, dQᵀ: 320 /
    487 and 621 / 1093, three programs per SM (168 registers); (64, 64, 4), K and V in
    registers, dQᵀ: 334 / 459 and 632 / 983; the same with dQ untransposed: 336 / 470 and 642 /
    1023. So causal heads step over 32 queries, the others over 64. (64, 128, 8 warps) measured
    10-15% slower (one program per SM), (128, 128, 8) slower still. At d32, dQᵀ would be a
    product of 32 rows (wgmma's are 64): dQ untransposed, K and V in shared memory (in registers
    they cost a program per SM). At d128 only the 32-query step fits the registers without
    spills (244 per thread; (64, 64) spills 400 bytes).

    Causal d64 caps the registers at 168 (maxnreg): the dropout mask's draws would take 204
    (Triton 3.6, ptxas 12.8) and with them a program per SM; capped, they compile without
    spills, as the kernel without dropout does. The other tiles hold two programs per SM
    with or without dropout (180-255 registers)."""
    if head_dim < 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": False, "DQ_T": False}
    if causal and head_dim == 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": False, "DQ_T": True,
                "maxnreg": 168}  # fmt: skip
    if causal or head_dim > 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": False, "DQ_T": True}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "KV_IN_REGS": True, "DQ_T": True}


# Where eager backwards take this kernel: `ENABLED` (benchmarks turn it off to compare), head
# dims of `TAKEN_HEAD_DIMS` (causal: `TAKEN_HEAD_DIMS_CAUSAL`), heads of at least
# `MIN_QUERIES_CAUSAL` queries (causal, d64) or `MIN_QUERIES` (the rest). Measured against the
# Triton kernels' backward (H200, 2026-11-27, `attention_gluon_session17.md`, µs per backward,
# bf16, packed qkv, (b, n, h); causal / not): (16, 1024, 12) d64 318 / 460 against 339 / 446;
# (8, 2048, 16) d64 622 / 985 against 694 / 1072, d32 490 / 645 against 548 / 833, d128
# 1121 / 1909 against 1211 / 1856; (4, 4096, 16) d64 1030 / 1740 against 1179 / 2035, d128
# 1871 / 3474 against 2118 / 3493; (16, 512, 8) d64 85 / 110 against 82 / 99.
# Through dropout (p = 0.1) the Triton backward draws its mask per (key, query) tile as well,
# and loses at every shape measured: (H200, 2026-11-27, `attention_dropout_session20.md`,
# Gluon / Triton µs, causal; not) (16, 512, 8) d64 99.7 / 111.6; 134.3 / 228.5; (16, 1024,
# 12) d64 395.9 / 472.4; 608.6 / 1141.5; (8, 2048, 16) d64 833.3 / 1028.7; 1409.2 / 2881.3,
# d32 666.7 / 869.7; 1159.1 / 2024.1; (4, 4096, 16) d128 2320.0 / 3661.2; 4111.1 / 6779.8.
# So with dropout it takes every head dim of `HEAD_DIMS` from `MIN_QUERIES_DROPOUT` queries.
ENABLED = True
MIN_QUERIES_CAUSAL = 1024
MIN_QUERIES = 2048
MIN_QUERIES_DROPOUT = 512
TAKEN_HEAD_DIMS = (32, 64)
TAKEN_HEAD_DIMS_CAUSAL = (32, 64, 128)


def _taken(head_dim: int, n_q: int, causal: bool, dropout: bool) -> bool:
    """The head dims and query counts above."""
    if dropout:
        return head_dim in HEAD_DIMS and n_q >= MIN_QUERIES_DROPOUT
    if head_dim not in (TAKEN_HEAD_DIMS_CAUSAL if causal else TAKEN_HEAD_DIMS):
        return False
    return n_q >= (MIN_QUERIES_CAUSAL if causal and head_dim == 64 else MIN_QUERIES)


def usable(
    q: torch.Tensor, k: torch.Tensor, head_dim: int, causal: bool, no_key_mask: bool,
    dropout: bool = False,
) -> bool:  # fmt: skip
    """Whether the kernel takes this backward (`dropout`: through the forward's dropout):
    Gluon present, `ENABLED`, a Hopper GPU, the head dims and query counts above, a 16-bit
    dtype, multi-head attention (k as many heads as q), at most 65535 batch·heads (grid dim
    1), and `no_key_mask` (no key padding mask). The caller has checked the rest: an eager
    launch, TMA-describable tensors (`attention._tma_loads`) and the non-deterministic single
    pass."""
    return (
        HAVE_GLUON
        and ENABLED
        and no_key_mask
        and is_sm90(q.device)
        and _taken(head_dim, q.shape[2], causal, dropout)
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[1] == k.shape[1]
        and q.shape[0] * q.shape[1] <= 65535
    )


def launch_bwd_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
    dk: torch.Tensor, dv: torch.Tensor, grads_base: torch.Tensor | None,
    grad_offsets: tuple[int, int], lse: torch.Tensor, delta: torch.Tensor, dq_acc: torch.Tensor,
    causal: bool, qk_scale: float, sm_scale: float, lpt_bytes: int,
    dropout_p: float = 0.0, seed: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Launch the kernel for (b, h, n, d) views q, k, v, dout (unit stride along d): fills
    the (b, h, n_k, d) views dk, dv (any strides; views of `grads_base` when given, at element
    offsets `grad_offsets` (`utils.offsets_in`), which the kernel then gets, as
    `attention.launch_attention_bwd` passes it; (0, 0) otherwise) and
    adds the unscaled dQ into dq_acc (fp32, (b·h, n_q, d), zeroed). lse, delta: (b·h, n_q)
    fp32, the forward's log-sum-exp in log2 units and Σ dO·O. dropout_p > 0: the forward's
    dropout of P, whose mask `seed` (0-dim int64 device tensor) regenerates. The caller sets
    Triton's allocator (device-side TMA descriptors)."""
    dropping = dropout_p > 0.0
    if dropping and seed is None:
        raise ValueError("a backward through dropout needs the forward's seed")
    dk_base, dv_base = (dk, dv) if grads_base is None else (grads_base, grads_base)
    off_dk, off_dv = grad_offsets
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    tiles = bwd_tiles(d, causal)
    grid = (-(-n_k // tiles["BLOCK_N"]), b * h, 1)
    launcher(_attention_bwd_sm90_kernel)[grid](
        q, k, v, dout, dk_base, dv_base, lse, delta, dq_acc, seed if dropping else lse,
        off_dk, off_dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        b * h, h, n_q, n_k, qk_scale, sm_scale, dropout_threshold(dropout_p),
        1.0 / (1.0 - dropout_p), HEAD_DIM=d, CAUSAL=causal, DROPOUT=dropping,
        LPT_BYTES=lpt_bytes, **tiles,
    )  # fmt: skip
