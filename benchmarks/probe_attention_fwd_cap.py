"""Probe: the causal d64 forward with and without its register cap (`maxnreg` in
`attention._attention_fwd_config`), in one run, at `bench_attention.py`'s shapes (b = 16K
tokens / seq, 32 heads, separate q, k, v) and at packed-qkv step shapes. Kernel time
(`common.kernel_ms`, L2 flushed), µs per call; dropout 0.

    python3 benchmarks/probe_attention_fwd_cap.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import packed_attention

import triton_transformer.attention as attn

SHIPPED = attn._attention_fwd_config


def uncapped(*args):
    return {k: v for k, v in SHIPPED(*args).items() if k != "maxnreg"}


def both(make_fwd) -> str:
    """Capped / uncapped µs of the forward `make_fwd()` returns, made under each config."""
    times = []
    for config in (SHIPPED, uncapped):
        attn._attention_fwd_config = config
        times.append(common.kernel_ms(make_fwd(), iters=20) * 1e3)
    attn._attention_fwd_config = SHIPPED
    return f"capped {times[0]:.1f}, uncapped {times[1]:.1f} ({times[1] / times[0]:.2f}x)"


def main() -> None:
    print(common.env_info())
    for n in (512, 1024, 2048, 4096, 8192):
        b, h, d = max(1, 16384 // n), 32, 64
        q, k, v = (
            torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )

        def make(q=q, k=k, v=v):
            return lambda: attn.attention(q, k, v, causal=True, use_triton=True)

        print(f"separate q, k, v (b {b}, h {h}, n {n}): {both(make)}", flush=True)
    for b, n, h in ((16, 512, 8), (16, 1024, 12), (8, 2048, 16), (32, 512, 32), (16, 1024, 32)):
        times = both(lambda b=b, n=n, h=h: packed_attention(b, n, h, 0.0)[0])
        print(f"packed qkv (b {b}, h {h}, n {n}): {times}", flush=True)


if __name__ == "__main__":
    main()
