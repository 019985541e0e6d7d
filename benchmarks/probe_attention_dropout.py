"""Probe: the attention backward through dropout, Hopper's Gluon kernel (`attention_hopper`)
against the Triton kernels' backward and FlashAttention-2 (SDPA's flash backend), dropout 0.1
and 0, causal and not, at the step presets' head shapes and d32 / d128.

Kernel time per backward (`common.kernel_ms`, L2 flushed: the Δ kernel, the main kernel and
dQ's cast), bf16, packed qkv as the model calls it. The Gluon kernel's thresholds are lifted so
it runs at every shape; the Triton column is the same call with `attention_hopper.ENABLED` off.

    python3 benchmarks/probe_attention_dropout.py --out DIR

Writes DIR/attention_dropout.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.attention_hopper as ah
from triton_transformer.attention import attention_packed

# (b, n, h, d): GPT-2's and the large preset's heads, enwik8's, d128 and d32
SHAPES = [(16, 1024, 12, 64), (8, 2048, 16, 64), (16, 512, 8, 64), (4, 4096, 16, 128),
          (8, 2048, 16, 32)]  # fmt: skip


def backward_us(qkv: torch.Tensor, h: int, causal: bool, p: float) -> float:
    """Kernel µs of one backward of `attention_packed` (its forward run once, outside)."""
    torch.manual_seed(0)
    out = attention_packed(qkv, h, causal=causal, dropout_p=p, use_triton=True)
    dout = torch.randn_like(out)
    return (
        common.kernel_ms(lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True), iters=10)
        * 1e3
    )


def flash_us(qkv: torch.Tensor, h: int, causal: bool, p: float) -> float:
    b, n, _ = qkv.shape
    q, k, v = (t.transpose(1, 2).detach().requires_grad_()
               for t in qkv.view(b, n, 3, h, -1).unbind(2))  # fmt: skip
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
        dout = torch.randn_like(out)
        return (
            common.kernel_ms(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), iters=10
            )
            * 1e3
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ah.MIN_QUERIES = ah.MIN_QUERIES_D64 = ah.MIN_QUERIES_DROPOUT = 1
    ah.TAKEN_HEAD_DIMS = ah.TAKEN_HEAD_DIMS_CAUSAL = ah.HEAD_DIMS
    rows = [
        "| shape (b, n, h, d) | causal | p | Gluon µs | Triton µs | Triton / Gluon | FA2 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, n, h, d in SHAPES:
        for causal in (True, False):
            for p in (0.1, 0.0):
                qkv = (0.2 + torch.randn(b, n, 3 * h * d, device="cuda")).to(torch.bfloat16)
                qkv.requires_grad_()
                times = {}
                for enabled in (True, False):
                    ah.ENABLED = enabled
                    times[enabled] = backward_us(qkv, h, causal, p)
                ah.ENABLED = True
                rows.append(
                    f"| {(b, n, h, d)} | {causal} | {p} | {times[True]:.1f} | "
                    f"{times[False]:.1f} | {times[False] / times[True]:.3f} | "
                    f"{flash_us(qkv, h, causal, p):.1f} |"
                )
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_dropout.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
