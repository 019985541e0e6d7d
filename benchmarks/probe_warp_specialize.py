"""Probe: does Triton's warp specialisation (`tl.range(..., warp_specialize=True)`) make an
attention forward faster on Hopper? A minimal FlashAttention forward with on-device TMA
descriptors (the form Triton's Hopper warp specialisation takes), causal (two loops: the
blocks left of the diagonal unmasked, the diagonal block masked) or not, d64 and d128, seq
4096, with and without warp specialisation, against ours, FA2 and cuDNN. Kernel time, L2
flushed. Prints the configurations that fail to compile or compute wrong results.

    python3 benchmarks/probe_warp_specialize.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

from triton_transformer import attention as A


@triton.jit
def _inner(
    acc,
    l_i,
    m_i,
    q,
    dk,
    dv,
    row_kv,
    lo,
    hi,
    offs_m,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    WS: tl.constexpr,
):
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = dk.load([row_kv + start, 0])
        qk = tl.dot(q, k.T)
        if MASK:
            offs_n = start + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([row_kv + start, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_probe(
    Q, K, V, Out, qk_scale, N, BH, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    rows = BH * N
    q_desc = tl.make_tensor_descriptor(Q, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    m0 = pid_m * BLOCK_M
    q = q_desc.load([bh * N + m0, 0])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row = bh * N
    if CAUSAL:
        acc, l_i, m_i = _inner(
            acc, l_i, m_i, q, k_desc, v_desc, row, 0, m0, offs_m, qk_scale, BLOCK_N, False, WS
        )
        acc, l_i, m_i = _inner(
            acc, l_i, m_i, q, k_desc, v_desc, row, m0, m0 + BLOCK_M, offs_m, qk_scale, BLOCK_N,
            True, WS,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _inner(
            acc, l_i, m_i, q, k_desc, v_desc, row, 0, N, offs_m, qk_scale, BLOCK_N, False, WS
        )
    acc = acc / l_i[:, None]
    o_desc.store([bh * N + m0, 0], acc.to(Out.dtype.element_ty))


CONFIGS = [(128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)]


def probe_case(d: int, causal: bool, n: int = 4096) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
    out = torch.empty_like(q)
    tag = f"d{d} causal={causal}"

    def sdpa(backend):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    res = {
        "ours": common.kernel_ms(lambda: A.attention(q, k, v, causal=causal, use_triton=True)),
        "fa2": common.kernel_ms(lambda: sdpa(SDPBackend.FLASH_ATTENTION)),
        "cudnn": common.kernel_ms(lambda: sdpa(SDPBackend.CUDNN_ATTENTION)),
    }
    for bm, bn, w, s in CONFIGS:
        if causal and bm != bn:
            continue
        for ws in (False, True):
            name = f"probe {bm}x{bn} w{w} s{s} ws={ws}"

            def launch(bm=bm, bn=bn, w=w, s=s, ws=ws):
                fwd_probe[(n // bm, b * h)](
                    q, k, v, out, d**-0.5 * 1.4426950408889634, n, b * h, HEAD_DIM=d,
                    BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, num_warps=w, num_stages=s,
                )  # fmt: skip

            try:
                out.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
            except Exception as e:  # a compiler failure is a result here
                print(f"{tag} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"{tag} {name}: WRONG, rel err {err:.1e}", flush=True)
                continue
            res[name] = common.kernel_ms(launch)
    for name, ms in res.items():
        tflops = flops / ms / 1e9
        print(f"{tag} {name:30} {ms * 1e3:8.1f} us {tflops:5.0f} TFLOP/s "
              f"{res['cudnn'] / ms:.2f}x cuDNN", flush=True)  # fmt: skip


def main() -> None:
    def alloc(size, align, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)  # scratch for the device-side descriptors
    torch.manual_seed(0)
    for d in (64, 128):
        for causal in (False, True):
            probe_case(d, causal)


if __name__ == "__main__":
    main()
