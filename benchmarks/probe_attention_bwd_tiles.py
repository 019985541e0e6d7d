"""Probe behind `attention._ATOMIC_BWD`: the single-pass (atomic dQ) backward's tiles at the
step presets' attention shapes (packed qkv as the model passes it, bf16, causal, d 64), each
tile setting against cuDNN's backward (SDPA) in the same run, dropout 0 and 0.1. Kernel time of
the backward alone (autograd.grad over a retained graph), L2 flushed (`common.kernel_ms`).

    python3 benchmarks/probe_attention_bwd_tiles.py [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.attention as attn
from triton_transformer.utils import clear_launch_plans

SHAPES = {"enwik8": (16, 512, 8), "gpt2": (16, 1024, 12), "large": (8, 2048, 16)}  # b, n, h
D = 64
# (BLOCK_M1, BLOCK_N1, warps, stages); the first is the shipped entry
TILES = ((64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3),
         (128, 64, 8, 2), (32, 128, 4, 2), (128, 128, 8, 2))  # fmt: skip


def packed_attention(b: int, n: int, h: int, p: float, d: int = D, causal: bool = True):
    """(forward, backward) closures of our packed attention, as the model calls it (the
    forward with autograd recording, so that it writes its log-sum-exp; the backward over a
    retained graph)."""
    qkv = torch.randn(b, n, 3 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seed = torch.tensor(11, device="cuda")

    def fwd():
        return attn.attention_packed(qkv, h, causal=causal, dropout_p=p, use_triton=True, seed=seed)

    out = fwd()
    dout = torch.randn_like(out)
    return fwd, lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)


def cudnn_attention(
    b: int, n: int, h: int, p: float, d: int = D, causal: bool = True,
    backend: SDPBackend = SDPBackend.CUDNN_ATTENTION,
):  # fmt: skip
    """(forward, backward) closures of cuDNN's attention (SDPA; or another SDPA `backend`),
    as `packed_attention`."""
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)

    out = fwd()
    dout = torch.randn_like(out)
    return fwd, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(common.env_info())
    shipped = attn._ATOMIC_BWD[True, False]
    rows = []
    print("| preset | dropout | " + " | ".join(map(str, TILES)) + " | cuDNN | best / cuDNN |")
    for name, (b, n, h) in SHAPES.items():
        for p in (0.0, 0.1):
            t = {}
            for m1, n1, warps, stages in TILES:
                attn._ATOMIC_BWD[True, False] = attn._atomic_tiles(m1, n1, warps, stages)
                attn._attention_bwd_config.cache_clear()
                clear_launch_plans()  # eager launches are bound per shape
                try:
                    backward = packed_attention(b, n, h, p)[1]
                    t[(m1, n1, warps, stages)] = common.kernel_ms(backward) * 1e3
                except Exception as e:  # a tile that cannot compile: reported, not fatal
                    print(f"{name} {p} {(m1, n1, warps, stages)}: {repr(e)[:200]}", flush=True)
            attn._ATOMIC_BWD[True, False] = shipped
            attn._attention_bwd_config.cache_clear()
            clear_launch_plans()  # eager launches are bound per shape
            t["cudnn"] = common.kernel_ms(cudnn_attention(b, n, h, p)[1]) * 1e3
            best = min(v for k, v in t.items() if k != "cudnn")
            cells = [f"{t[k]:.1f}" if k in t else "-" for k in (*TILES, "cudnn")]
            print(f"| {name} | {p} | " + " | ".join(cells) + f" | {t['cudnn'] / best:.3f} |",
                  flush=True)  # fmt: skip
            rows.append(dict(preset=name, dropout=p, us={str(k): v for k, v in t.items()}))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "attention_bwd_tiles.json").write_text(
            json.dumps({"env": common.env_info(), "rows": rows})
        )


if __name__ == "__main__":
    main()
