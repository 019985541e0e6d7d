"""The attention forward for Hopper GPUs, written in Gluon and warp-specialized, as
FlashAttention-3's (Shah et al., 2024).

Math, for one block of query rows Q_i against key blocks K_j, V_j of BLOCK_N keys (scores in
log2 units, c = scale·log2(e) > 0):

    S_j = Q_i K_jᵀ                                      raw scores, (rows, BLOCK_N)
    m_j = max(m_{j-1}, c · rowmax(S_j))                 running row max
    P_j = exp2(c·S_j - m_j)                             masked scores are -inf: P = 0
    α_j = exp2(m_{j-1} - m_j)
    l_j = α_j · l_{j-1} + rowsum(P_j)
    O_j = α_j · O_{j-1} + P_j V_j
    out = O / l,   lse = m + log2(l)                    (zeros and +inf for rows that see no key)

The max is taken on the raw scores and scaled once per row (max commutes with a positive
scale), so each score costs one fused multiply-add before its exp2, as in
`attention._fwd_block`.

Why a second kernel: the Triton forward (`attention._attention_fwd_kernel`) waits for each
product right after issuing it, so the tensor cores idle while the exponentials run. Here the
work is split between warps (`gl.warp_specialize`):

- a loader warp brings a block of query rows, then K_j and V_j by TMA into a ring of STAGES
  buffers;
- one to three consumer warpgroups, each owning 64 of the query rows, walk the same key
  blocks. Per block a consumer issues S_j's product and then P_{j-1} V_{j-1}'s, waits for
  S_j only, and computes P_j while P_{j-1} V_{j-1} is still on the tensor cores; it waits for
  that product before rescaling O by α_j, and then hands the buffers of block j - 1 back to
  the loader (each consumer arrives once on the buffer's `empty` barrier). With PINGPONG the
  consumers take turns issuing their products (round robin), so that one's exponentials run
  while another's products do; with one consumer, several programs share an SM instead.

The grid is persistent: PER_SM programs per SM deal the units of work among them round
robin, and the ring runs on from one query block to the next, so the next block's first keys
load while the consumers finish the last one (a program per unit pays that ramp each time,
with a whole program's start and end: 1.06 / 1.08x the time at d128, 512 queries, causal /
not). Causal units are pairs of a head's query blocks, i and n_m - 1 - i, so that every unit
reads about the same number of key blocks (`_unit_count`): dealt one by one, the blocks (1 to
n_m key blocks each) left some programs with more work than others, and the kernel took 1.30x
the time at 4096 queries.

`fwd_tiles` says which shape each head dim takes, and what was measured: at d128 this kernel
is 1.23-1.38x the Triton forward from 512 queries (1.3-1.7x from 128 queries, causal heads
below 1024 queries on one consumer, two programs per SM) and at least cuDNN's speed from 4096
queries; at d64 heads without a causal mask from 512 queries gain (two consumers below 2048,
three in turns from there), and causal heads of 512 to 2048 queries (one consumer, three
programs per SM); the rest keep the Triton forward (`usable`).

The output leaves by TMA stores (rows past n_q are clipped) through shared memory that holds
nothing else by then: where the consumers' rows fit it (OUT_IN_V: BLOCK_N >= 64·CONSUMERS),
the V buffer of the block's last key block, once every consumer's last product has read it.
The query buffers are then handed back right after the block's last S_j, so the next block's
rows load while this one's last products and output run (at d128, 512 queries: 115.4 against
126.2 µs causal, 134.7 against 158.9 not). Otherwise (three consumers over 128 keys) the
output goes through the consumer's query buffer, handed back once the store has read it. The
log-sum-exp leaves through pointers.

Scope: Hopper (sm_90), fp16 / bf16, head dims of `HEAD_DIMS`, causal (bottom-right aligned,
as `attention`'s) or not, multi-head or grouped-query heads, no key padding mask, no dropout,
no KV cache length on the device, tensors TMA can describe. `attention.launch_attention_fwd`
takes it for eager launches where `usable` says so; traced code reaches it through
`attention`'s opaque forward op (torch.compile cannot trace a Gluon kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from triton_transformer import _gluon
from triton_transformer._gluon import (
    HAVE_GLUON,
    TensorDescriptor,
    gl,
    gluon,
    hopper,
    is_sm90,
    mbarrier,
    tma,
)
from triton_transformer.attention_hopper import _layouts, _load_head_rows
from triton_transformer.utils import launcher, sm_count

__all__ = ["HAVE_GLUON", "fwd_tiles", "launch_fwd_sm90", "usable"]

# head dims the kernel takes (rows of 64, 128 and 256 bytes in 16-bit types)
HEAD_DIMS = (32, 64, 128)
# query rows per consumer warpgroup (a warpgroup product's M); a program has CONSUMERS of them
ROWS = gl.constexpr(64) if HAVE_GLUON else 64

# registers per thread of the loader's warpgroup (`_launch`)
LOADER_REGS = 32


if HAVE_GLUON:

    @gluon.jit
    def _key_blocks(
        m0, N_Q, N_K, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr
    ):  # fmt: skip
        """(key blocks the query rows [m0, m0 + BLOCK_M) read, how many of the first of them
        every row sees whole, i.e. need no mask). Causal: query i sees keys j <= i + n_k - n_q.
        At least one block: a program whose rows see no key still writes their zeros."""
        BLOCK_M: gl.constexpr = CONSUMERS * ROWS
        if CAUSAL:
            causal_off = N_K - N_Q
            hi = gl.minimum(gl.maximum(m0 + BLOCK_M + causal_off, 0), N_K)
            whole = gl.minimum(gl.maximum(m0 + causal_off + 1, 0), N_K)
        else:
            hi = N_K
            whole = N_K
        return gl.maximum(gl.cdiv(hi, BLOCK_N), 1), whole // BLOCK_N

    @gluon.jit
    def _softmax_block(
        s, m_i, l_i, j, n_whole, offs_m, cols_n, N_K, causal_off, qk_scale,
        CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """P_j, α_j, m_j and l_j of the raw scores s of key block j (module docstring). Blocks
        from n_whole on are masked: keys past n_k and, causal, past each row's diagonal."""
        if j >= n_whole:
            offs_n = j * BLOCK_N + cols_n
            visible = offs_n[None, :] < N_K
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + causal_off)
            s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        # a row that has seen no visible key keeps m = -inf: subtract 0 instead, so that its
        # P and α are exp2(-inf) = 0, not NaN
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - m_sub[:, None])
        alpha = gl.exp2(m_i - m_sub)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _take_turn(turn, which: gl.constexpr, k, PINGPONG: gl.constexpr):
        """PINGPONG: wait until this consumer may issue its k-th group of products: the
        previous consumer (round robin) has issued its own k-th, or, for consumer 0, the last
        one its (k - 1)-th (consumer 0's first passes on the fresh barrier, which counts as
        having completed the phase before 0)."""
        if PINGPONG:
            mbarrier.wait(turn.index(which), (k & 1) ^ (1 if which == 0 else 0))

    @gluon.jit
    def _pass_turn(turn, which: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG: this consumer's products are issued: the next consumer's turn."""
        if PINGPONG:
            mbarrier.arrive(turn.index((which + 1) % turn.shape[0]))

    @gluon.jit
    def _unit_count(N_Q, BH, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """(units of work, query blocks per head). A unit is one query block of a head, or,
        causal, a pair of them: blocks i and n_m - 1 - i, whose key blocks add up to about
        n_m + 1 whatever i, so that units dealt round robin keep a persistent grid's programs
        equally busy (the blocks alone range from 1 to n_m key blocks)."""
        n_m = gl.cdiv(N_Q, BLOCK_M)
        if CAUSAL:
            return gl.cdiv(n_m, 2) * BH, n_m
        return n_m * BH, n_m

    @gluon.jit
    def _unit(unit, n_m, CAUSAL: gl.constexpr):
        """(b·h, i, query blocks in the unit: 1, or 2 for a causal pair but the middle block
        of an odd n_m). Units are numbered head-major, so the programs at work at one time
        read the key blocks of a few heads, from L2."""
        if CAUSAL:
            per_head = gl.cdiv(n_m, 2)
            i = unit % per_head
            return unit // per_head, i, gl.minimum(n_m - 2 * i, 2)
        return unit // n_m, unit % n_m, 1

    @gluon.jit
    def _tile(
        bh, i, member, n_m, H, GROUP, N_Q, N_K, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Query block `member` of unit (bh, i) (causal: the longer, n_m - 1 - i, first): (b,
        h, its key/value head, first query row, key blocks, whole key blocks)."""
        pid_m = i
        if CAUSAL:
            pid_m = i + (1 - member) * (n_m - 1 - 2 * i)
        h = bh % H
        m0 = pid_m * (CONSUMERS * ROWS)
        n_blocks, n_whole = _key_blocks(m0, N_Q, N_K, CAUSAL, BLOCK_N, CONSUMERS)
        return bh // H, h, h // GROUP, m0, n_blocks, n_whole

    @gluon.jit
    def _fwd_loader(args, meta: gl.constexpr):
        """The loader partition (one warp): for each of the program's query blocks, its rows
        once the consumers have stored the last block's output through their buffers, then
        every key block's K and V into the ring, each once every consumer has handed its
        buffer back. The ring runs on across query blocks: the next one's first key blocks
        load while the consumers finish this one."""
        (q_desc, k_desc, v_desc, _o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty,
         _turn, _v_done, _lse, BH, H, GROUP, N_Q, N_K, _qk_scale) = args  # fmt: skip
        HEAD_DIM: gl.constexpr = meta[0]
        BLOCK_N: gl.constexpr = meta[1]
        STAGES: gl.constexpr = meta[2]
        CAUSAL: gl.constexpr = meta[3]
        nbytes: gl.constexpr = HEAD_DIM * q_desc.dtype.primitive_bitwidth // 8
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        n_units, n_m = _unit_count(N_Q, BH, CONSUMERS * ROWS, CAUSAL)
        done = 0  # query blocks this program has loaded
        it = 0  # key blocks it has loaded: the ring position
        for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
            bh, i, count = _unit(unit, n_m, CAUSAL)
            for member in range(count):
                b, h, h_kv, m0, n_blocks, _n_whole = _tile(
                    bh, i, member, n_m, H, GROUP, N_Q, N_K, BLOCK_N, CONSUMERS, CAUSAL
                )  # fmt: skip
                # a fresh barrier counts as having completed the phase before 0
                mbarrier.wait(q_empty, ((done + member) & 1) ^ 1)
                mbarrier.expect(q_bar, CONSUMERS * ROWS * nbytes)
                for c in gl.static_range(CONSUMERS):
                    _load_head_rows(q_desc, b, h, m0 + c * ROWS, q_bar, q_smem.index(c))
                for j in range(n_blocks):
                    stage = it % STAGES
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    mbarrier.expect(bar, 2 * BLOCK_N * nbytes)
                    _load_head_rows(k_desc, b, h_kv, j * BLOCK_N, bar, k_smem.index(stage))
                    _load_head_rows(v_desc, b, h_kv, j * BLOCK_N, bar, v_smem.index(stage))
                    it += 1
            done += count

    @gluon.jit
    def _fwd_consume(args, meta: gl.constexpr, which: gl.constexpr):
        """Consumer `which` (one warpgroup): for each of the program's query blocks, its rows
        m0 + 64·which ... + 63 against every key block they see (module docstring), then
        their output, through its query buffer, which it then hands back to the loader, and
        their log-sum-exp."""
        (_q_desc, _k_desc, _v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty,
         turn, v_done, LSE, BH, H, GROUP, N_Q, N_K, qk_scale) = args  # fmt: skip
        HEAD_DIM: gl.constexpr = meta[0]
        BLOCK_N: gl.constexpr = meta[1]
        STAGES: gl.constexpr = meta[2]
        CAUSAL: gl.constexpr = meta[3]
        WRITE_LSE: gl.constexpr = meta[4]
        PINGPONG: gl.constexpr = meta[5]
        OUT_IN_V: gl.constexpr = meta[6]
        CONSUMERS: gl.constexpr = q_smem.shape[0]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        # P feeds P·V's product from registers, in the accumulator's rows
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_s = q_smem.index(which)
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        causal_off = N_K - N_Q
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        n_units, n_m = _unit_count(N_Q, BH, CONSUMERS * ROWS, CAUSAL)
        done = 0  # query blocks this program has computed
        it = 0  # key blocks it has read: the ring position
        turns = 0  # groups of products it has issued (PINGPONG)
        for unit in range(gl.program_id(0), n_units, gl.num_programs(0)):
            bh, i, count = _unit(unit, n_m, CAUSAL)
            for member in range(count):
                b, h, _h_kv, m0, n_blocks, n_whole = _tile(
                    bh, i, member, n_m, H, GROUP, N_Q, N_K, BLOCK_N, CONSUMERS, CAUSAL
                )  # fmt: skip
                row0 = m0 + which * ROWS
                offs_m = row0 + rows
                acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
                m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
                l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))

                mbarrier.wait(q_bar, (done + member) & 1)
                mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
                _take_turn(turn, which, turns, PINGPONG)
                s = _gluon.mma(
                    q_s, k_smem.index(it % STAGES).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                _pass_turn(turn, which, PINGPONG)
                s = _gluon.mma_wait(num_outstanding=0, deps=[s])
                if OUT_IN_V and n_blocks == 1:
                    mbarrier.arrive(q_empty)  # the query rows are read: the loader may refill
                p, _alpha, m_i, l_i = _softmax_block(
                    s, m_i, l_i, 0, n_whole, offs_m, cols_n, N_K, causal_off, qk_scale, CAUSAL,
                    BLOCK_N,
                )  # fmt: skip
                p_a = gl.convert_layout(p.to(dtype), p_layout)
                for j in range(1, n_blocks):
                    stage = (it + j) % STAGES
                    prev = (it + j - 1) % STAGES
                    mbarrier.wait(ready.index(stage), ((it + j) // STAGES) & 1)
                    _take_turn(turn, which, turns + j, PINGPONG)
                    s = _gluon.mma(
                        q_s, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                        is_async=True,
                    )  # fmt: skip
                    acc = _gluon.mma(p_a, v_smem.index(prev), acc, is_async=True)
                    _pass_turn(turn, which, PINGPONG)
                    s = _gluon.mma_wait(num_outstanding=1, deps=[s])  # P_{j-1} V_{j-1} still runs
                    if OUT_IN_V and j == n_blocks - 1:
                        mbarrier.arrive(q_empty)
                    p, alpha, m_i, l_i = _softmax_block(
                        s, m_i, l_i, j, n_whole, offs_m, cols_n, N_K, causal_off, qk_scale, CAUSAL,
                        BLOCK_N,
                    )  # fmt: skip
                    # (a register operand stays live until its product is done)
                    acc, p_a = _gluon.mma_wait(num_outstanding=0, deps=[acc, p_a])
                    mbarrier.arrive(empty.index(prev))  # block j - 1's K and V are read
                    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                    p_a = gl.convert_layout(p.to(dtype), p_layout)
                last = (it + n_blocks - 1) % STAGES
                _take_turn(turn, which, turns + n_blocks, PINGPONG)
                acc = _gluon.mma(p_a, v_smem.index(last), acc, is_async=True)
                _pass_turn(turn, which, PINGPONG)
                acc, p_a = _gluon.mma_wait(num_outstanding=0, deps=[acc, p_a])
                if not OUT_IN_V:
                    mbarrier.arrive(empty.index(last))
                it += n_blocks
                turns += n_blocks + 1

                seen = l_i > 0.0  # rows that saw no key output zeros
                inv_l = gl.where(seen, 1.0 / gl.where(seen, l_i, 1.0), 0.0)
                out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None]
                if OUT_IN_V:
                    # the output leaves through this consumer's rows of the last key block's
                    # V buffer, once every consumer's last product has read it; the loader
                    # refills that buffer after the store has read it
                    mbarrier.arrive(v_done)
                    mbarrier.wait(v_done, (done + member) & 1)
                    o_s = v_smem.index(last).slice(which * ROWS, ROWS, dim=0)
                else:  # through this consumer's query buffer, whose products are done
                    o_s = q_s
                o_s.store(out.to(dtype))
                hopper.fence_async_shared()
                _gluon.cta_barrier()  # every warp's rows written before the stores
                # by blocks of o_desc's columns: the V buffer's rows of a d128 head are two
                # swizzled 64-column pieces apart, a query buffer's one block
                COLS: gl.constexpr = o_desc.block_shape[3]
                for c in gl.static_range(HEAD_DIM // COLS):
                    part = o_s.slice(c * COLS, COLS, dim=1)
                    part = _gluon.reinterpret(part, dtype, o_desc.block_shape, o_desc.layout)
                    _gluon.tma_store(o_desc, [b, h, row0, c * COLS], part)
                tma.store_wait(0)
                if OUT_IN_V:
                    mbarrier.arrive(empty.index(last))
                else:
                    mbarrier.arrive(q_empty)
                if WRITE_LSE:  # +inf for rows that saw nothing: the backward's exp2(s - lse) is 0
                    lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("inf"))
                    gl.store(LSE + bh.to(gl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)
            done += count

    @gluon.jit
    def _fwd_consumer_1(args, meta: gl.constexpr):
        """The second consumer, as a worker partition (workers share one signature, the
        loader's: `which` cannot be passed)."""
        _fwd_consume(args, meta, 1)

    @gluon.jit
    def _fwd_consumer_2(args, meta: gl.constexpr):
        """The third consumer (CONSUMERS = 3)."""
        _fwd_consume(args, meta, 2)

    @gluon.jit(do_not_specialize=["BH", "H", "N_Q", "N_K"])
    def _attention_fwd_sm90_kernel(
        q_desc, k_desc, v_desc, o_desc, LSE, BH, H, N_Q, N_K, qk_scale, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
        CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr,
        WRITE_LSE: gl.constexpr, OUT_IN_V: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """A program computes blocks of BLOCK_M = 64·CONSUMERS query rows of one batch·head:
        units of work program_id, program_id + programs, ... (`_unit_count`, `_unit`), so that
        a grid of one program per unit runs each once, and a persistent grid (PER_SM programs
        per SM) overlaps one block's end with the next one's loads. q, k, v and the output
        come as host-made (b, h, n, HEAD_DIM) TMA descriptors (`_descriptors`); LSE: the
        (b·h, n_q) fp32 log-sum-exp in log2 units (WRITE_LSE). GROUP: query heads per
        key/value head. CONSUMER_REGS, LOADER_REGS: the partitions' registers per thread
        (`_launch`)."""
        qk_scale = qk_scale.to(gl.float32)
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(not OUT_IN_V or BLOCK_N >= CONSUMERS * ROWS, "the output fits V")
        row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
        key_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], row_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], key_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], key_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        v_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(v_done, count=CONSUMERS)
        mbarrier.init(q_empty, count=CONSUMERS)  # one arrival per consumer
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(turn.index(i), count=1)
        args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready,
                empty, turn, v_done, LSE, BH, H, GROUP, N_Q, N_K, qk_scale)  # fmt: skip
        # the partitions' compile-time parameters, in this order
        meta: gl.constexpr = (
            HEAD_DIM,
            BLOCK_N,
            STAGES,
            CAUSAL,
            WRITE_LSE,
            PINGPONG and CONSUMERS > 1,
            OUT_IN_V,
        )
        # consumer 0 is the default partition (num_warps = 4), and keeps the registers the
        # workers leave of the launch's cap (`_launch`)
        if CONSUMERS == 1:
            gl.warp_specialize(
                [(_fwd_consume, (args, meta, 0)), (_fwd_loader, (args, meta))],
                [1],
                [LOADER_REGS],
            )
        elif CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_fwd_consume, (args, meta, 0)),
                    (_fwd_consumer_1, (args, meta)),
                    (_fwd_loader, (args, meta)),
                ],
                [4, 1],
                [CONSUMER_REGS, LOADER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_fwd_consume, (args, meta, 0)),
                    (_fwd_consumer_1, (args, meta)),
                    (_fwd_consumer_2, (args, meta)),
                    (_fwd_loader, (args, meta)),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
            )


def fwd_tiles(head_dim: int, causal: bool, n_q: int) -> dict:
    """The program's shape for heads of `n_q` queries (`_tiles`). Short heads differ: causal
    d128 heads below `D128_CAUSAL_LONG` queries take one consumer, two programs per SM and
    64-key blocks; d64 heads without a causal mask below `D64_LONG` queries take two
    consumers over 128-key blocks, as d128 heads do.

    Why (H200, 2026-11-28, `attention_fwd_gluon_session32*.md`, µs per forward, (b, n, h)):
    - causal d128: at 512 queries a two-consumer program of 128 query rows reads 1 to 4 key
      blocks of 128 keys, two of them on the diagonal (half masked), and has its SM to
      itself. One consumer of 64 rows over 64-key blocks wastes less on the diagonal, and a
      second program on the SM runs while the first one waits on its loads: (32, 512, 16)
      101.7 against 116.8, cuDNN 100.9; at (16, 1024, 16) 162.3 against 153.7.
    - d64 without a causal mask: three consumers in turns lose to the Triton forward below
      2048 queries; two consumers win: (32, 512, 32) 183.4 against three consumers' 227.2
      and the Triton forward's 201.2 (cuDNN 178.0), (16, 1024, 32) 323.2 against 337.4
      (315.5), GPT-2's (16, 1024, 12) 128.0 against 134.1 (124.3)."""
    if head_dim == 128:
        short = causal and n_q < D128_CAUSAL_LONG
    else:
        short = head_dim == 64 and not causal and n_q < D64_LONG
    return _tiles(head_dim, causal, short)


@functools.cache
def _tiles(head_dim: int, causal: bool, short: bool) -> dict:
    """The program's shape: CONSUMERS consumer warpgroups of 64 query rows each, PER_SM
    programs per SM (the register cap follows, `_launch`), key blocks of BLOCK_N keys in a
    ring of STAGES buffers, whether the consumers take turns issuing their products
    (PINGPONG), whether a persistent grid deals the units of work (PERSISTENT) and whether the
    output leaves through the last V buffer (OUT_IN_V; module docstring). Shared memory per
    program: CONSUMERS · 64 query rows plus STAGES · 2 · BLOCK_N
    key rows of head_dim 16-bit elements (d128: 2 · 64 + 3 · 2 · 128 rows, 224 KiB of the
    H200's 227).

    Measured (H200, 2026-11-28, `attention_fwd_gluon_session25*.md`, µs per forward, causal /
    not, against the Triton forward):
    - d128, (4, 4096, 16): two consumers, 128-key blocks, three stages 455.5 / 807.3 (Triton
      606.2 / 1082.9, cuDNN 467.3 / 811.4); two stages 611.3 / 1170.9 (the ring runs dry);
      with turns 454.3 / 812.6 (no gain, none taken); 64-key blocks 511.5 / 932.8; three
      consumers 480-486 / 846-857.
    - d64, GPT-2's (16, 1024, 12): two consumers, 128-key blocks 110.7 / 148.3 (Triton 90.0 /
      134.4): with two warpgroups per SM the exponentials' latency shows. One consumer, three
      programs per SM (128 registers each), 64-key blocks: 86.8 / 132.9, at (8, 2048, 16)
      183.4 / 317.2 (Triton 184.8 / 316.1), at (4, 4096, 16) 326.0 / 608.7 (325.6 / 596.4):
      within 1-4% of the Triton forward. Three consumers, 128-key blocks, in turns: not
      causal (8, 2048, 16) 298.7, (4, 4096, 16) 545.2 (Triton 316.6, 595.7), but GPT-2's
      145.1 and causal 123.8 at GPT-2's shape.
    So d128 takes two consumers over three stages; d64 causal heads one consumer, three
    programs per SM (what an eager call takes by default: `usable`), d64 others three
    consumers in turns (below 2048 queries two consumers since the 32nd session:
    `fwd_tiles`). d32 was measured only with two consumers (0.76 / 0.90x the Triton forward
    at (8, 2048, 16)) and takes one consumer as d64 causal does.

    The persistent grid (`attention_fwd_gluon_session27*.md`, same units; a program per unit
    of work in brackets): d128 causal (32, 512, 16) 129.2 (136.6), (4, 4096, 16) 448.9
    (457.2), cuDNN 100.0 and 467.2; not causal 162.0 (174.9) and 816.6 (822.3). d64 one
    consumer, causal: GPT-2's 83.3 (84.4; Triton 88.5), (8, 2048, 16) 183.9 (186.5; 184.1),
    (4, 4096, 16) 337.1 (337.4; 323.3). Three consumers, not causal, (4, 4096, 16): 545.8
    (556.8; Triton 588.9).

    The output through the last V buffer (OUT_IN_V; `attention_fwd_gluon_session27_out_in_v.md`,
    another call; through the query buffer in brackets): d128 causal (32, 512, 16) 115.4
    (126.2), (16, 1024, 16) 154.4 (168.7), (4, 4096, 16) 432.8 (448.8), cuDNN 99.9, 153.9,
    467.3; not causal 134.7 (158.9), 228.0 (251.5), 802.0 (818.1); d64 causal at GPT-2's shape
    81.3 (83.7; Triton 89.4, cuDNN 83.0). Taken wherever the consumers' rows fit."""
    if short and head_dim > 64:  # short heads: `fwd_tiles`
        tiles = {"BLOCK_N": 64, "STAGES": 3, "PINGPONG": False, "CONSUMERS": 1, "PER_SM": 2}
    elif head_dim > 64 or short:
        tiles = {"BLOCK_N": 128, "STAGES": 3, "PINGPONG": False, "CONSUMERS": 2, "PER_SM": 1}
    elif head_dim == 64 and not causal:
        tiles = {"BLOCK_N": 128, "STAGES": 3, "PINGPONG": True, "CONSUMERS": 3, "PER_SM": 1}
    else:
        tiles = {"BLOCK_N": 64, "STAGES": 3, "PINGPONG": False, "CONSUMERS": 1, "PER_SM": 3}
    fits = tiles["BLOCK_N"] >= tiles["CONSUMERS"] * 64  # the output in the last V buffer
    return {**tiles, "PERSISTENT": True, "OUT_IN_V": fits}


def _launch(consumers: int, per_sm: int) -> dict:
    """Launch options of a program of `consumers` consumer warpgroups (the layouts assume 4
    warps each) and the loader, `per_sm` programs per SM (`_gluon.warp_specialized_launch`,
    the loader at `LOADER_REGS`). Two consumers, one program per SM: a cap of 168, 3 x 168 =
    232 + 240 + 32; three: 128, 4 x 128 = 3 x 160 + 32; one consumer, three programs per SM:
    80, 2 x 80 = 128 + 32."""
    return _gluon.warp_specialized_launch(consumers, per_sm, LOADER_REGS)


# Where eager forwards take this kernel: `ENABLED` (benchmarks turn it off to compare), d128
# heads of at least `MIN_QUERIES` queries, d64 heads without a causal mask of at least
# `MIN_QUERIES_D64`, and causal d64 heads of `D64_CAUSAL_QUERIES`: where it measured faster
# than the Triton forward (H200, 2026-11-28, µs per forward, `attention_fwd_gluon_session27`;
# causal / not: d128 at (32, 512, 16) 129.2 / 162.0 against 158.7 / 214.2; d64 causal at
# GPT-2's (16, 1024, 12) 83.3 against 88.5, at (8, 2048, 16) 183.9 against 184.1, at (4, 4096,
# 16) 337.1 against 323.3; session 25: d128 at 128 queries 19.8 against 17.6 causal). d64
# causal at 512 queries (31st session, `attention_fwd_short_session31.json`, (b, n, h)):
# the sweep's (32, 512, 32) 124.7 against 159.3 (cuDNN 129.8), enwik8's (16, 512, 8) 23.1
# against 24.0 (cuDNN 23.3). d128 heads of 128 and 256 queries (32nd session, with the
# short-head tiles where causal, `attention_fwd_gluon_session32_d128_128_256.md`): causal
# (16, 128, 16) 13.9 against 17.8 (cuDNN 14.6), (64, 256, 16) 77.4 against 127.3 (73.7); not
# causal 15.0 against 19.6 and 88.1 against 150.5. d64 heads without a causal mask of 512 and
# 1024 queries (two consumers, `fwd_tiles`): (32, 512, 32) 183.4 against 201.2, (16, 1024, 32)
# 323.2 against 337.4.
# Elsewhere the two are within a few per cent, or the Triton forward is faster, and it runs.
ENABLED = True
MIN_QUERIES = 128
MIN_QUERIES_D64 = 512
D64_CAUSAL_QUERIES = range(512, 2049)
# causal d128 heads of fewer queries, and d64 heads without a causal mask of fewer, take
# `fwd_tiles`' short-head programs
D128_CAUSAL_LONG = 1024
D64_LONG = 2048


def _taken(head_dim: int, n_q: int, causal: bool) -> bool:
    """The head dims and query counts above."""
    if head_dim == 128:
        return n_q >= MIN_QUERIES
    if head_dim != 64:
        return False
    return n_q in D64_CAUSAL_QUERIES if causal else n_q >= MIN_QUERIES_D64


def usable(
    q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, plain: bool
) -> bool:  # fmt: skip
    """Whether the kernel takes this forward of (b, h, n, d) views q and k: Gluon present,
    `ENABLED`, a Hopper GPU, the head dims and query counts above, a 16-bit dtype, a positive
    scale, whole groups of query heads per key/value head, at least one key, and `plain`: no
    key padding mask, dropout or device-side KV length. The caller has checked the rest:
    TMA-describable q, k, v (`attention._tma_layouts`)."""
    _b, h, n_q, d = q.shape
    return (
        HAVE_GLUON
        and ENABLED
        and plain
        and is_sm90(q.device)
        and _taken(d, n_q, causal)
        and k.shape[2] > 0
        and scale > 0
        and q.dtype in (torch.float16, torch.bfloat16)
        and h % k.shape[1] == 0
    )


def _descriptors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, block_n: int,
    out_cols: int,
) -> tuple:  # fmt: skip
    """The kernel's TMA descriptors, made on the host: (b, h, n, d) views q, k, v and the
    output, by blocks of one head's 64 query rows or block_n key rows (the output's of
    out_cols columns)."""
    d = q.shape[3]
    rows, keys = _layouts(d, int(ROWS), block_n)[:2]

    def heads(t: torch.Tensor, block: int, cols: int, layout) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block, cols], layout)

    return (
        heads(q, int(ROWS), d, rows), heads(k, block_n, d, keys), heads(v, block_n, d, keys),
        heads(out, int(ROWS), out_cols, _layouts(out_cols, int(ROWS), block_n)[0]),
    )  # fmt: skip


def _out_cols(head_dim: int, out_in_v: bool) -> int:
    """Columns per TMA store of the output: from a V buffer, rows of at most 128 bytes (one
    swizzled piece of the key block's rows); from a query buffer, whole rows."""
    return min(head_dim, 64) if out_in_v else head_dim


def launch_fwd_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, qk_scale: float, need_lse: bool, tiles: dict | None = None,
) -> Callable[..., None]:  # fmt: skip
    """Launch the kernel for (b, h, n, d) views q, k, v (unit stride along d, TMA-describable;
    k and v with h or a divisor of h heads): fills `out`, a (b, h, n_q, d) view (the
    (b, n_q, h, d) output transposed), and, need_lse, the (b·h, n_q) fp32 lse with the
    log-sum-exp in log2 units. qk_scale: the softmax scale times log2(e). tiles: `fwd_tiles`
    unless given (benchmarks). PERSISTENT: PER_SM programs per SM deal the units of work
    (`_unit_count`) among them; otherwise one program per unit.

    Returns the launch bound for tensors of the same layouts and facts: again(q, k, v, out,
    lse) (`utils.KernelLauncher.bind`: each descriptor encoded once per address)."""
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    tiles = dict(tiles or fwd_tiles(d, causal, n_q))
    per_sm, persistent = tiles.pop("PER_SM"), tiles.pop("PERSISTENT")
    blocks = -(-n_q // (tiles["CONSUMERS"] * int(ROWS)))
    units = (-(-blocks // 2) if causal else blocks) * b * h
    programs = min(units, per_sm * sm_count(q.device)) if persistent else units
    descs = _descriptors(q, k, v, out, tiles["BLOCK_N"], _out_cols(d, tiles["OUT_IN_V"]))
    bound = launcher(_attention_fwd_sm90_kernel).bind(
        (programs,), *descs, lse if need_lse else q, b * h, h, n_q,
        n_k, qk_scale, HEAD_DIM=d, CAUSAL=causal, GROUP=h // k.shape[1], WRITE_LSE=need_lse,
        **tiles, **_launch(tiles["CONSUMERS"], per_sm),
    )  # fmt: skip

    def again(q, k, v, out, lse) -> None:
        bound(q, k, v, out, lse if need_lse else q)

    return again
