"""Probe behind the SwiGLU elementwise tiles and RMSNorm's forward entries: candidate launch
settings against the shipped ones, torch.compile's kernels and Liger-Kernel's (when
importable), bf16, kernel time with L2 flushed (`common.kernel_ms`), forward and fwd+bwd.

    python3 benchmarks/probe_modern_tiles.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

from triton_transformer import rmsnorm as rms
from triton_transformer import swiglu as sw

SWIGLU_SHAPES = [(8192, 2048), (8192, 5632)]
# (TILE elements per program, MAX_BLOCK_N, num_warps); the first is the shipped one
SWIGLU_TILES = [(2048, 1024, 4), (4096, 1024, 4), (4096, 1024, 8), (8192, 2048, 8),
                (8192, 1024, 8), (16384, 2048, 16)]  # fmt: skip
RMS_SHAPES = [(4096, 768), (4096, 2048), (8192, 4096)]
# forward entries (BLOCK_M, BLOCK_N, warps) of the width class; None: the shipped entry
RMS_FWD = [None, (1, None, 4), (1, None, 8), (2, None, 8), (4, None, 8), (2, None, 4)]


def fwd_bwd(fn, *inputs):
    """Closures timing fn's forward, and forward + backward with a fixed upstream gradient."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    dy = torch.randn_like(fn(*inputs))
    return (lambda: fn(*inputs)), (lambda: torch.autograd.grad(fn(*leaves), leaves, dy))


def row(name: str, fwd, both) -> None:
    print(f"| {name} | {common.kernel_ms(fwd) * 1e3:.1f} | {common.kernel_ms(both) * 1e3:.1f} |",
          flush=True)  # fmt: skip


def main() -> None:
    liger = common.liger()
    print("| case | fwd µs | fwd+bwd µs |\n|---|---|---|")
    shipped = (sw.TILE, sw.MAX_BLOCK_N, sw.NUM_WARPS)
    for M, N in SWIGLU_SHAPES:
        g, u = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for tile in SWIGLU_TILES:
            sw.TILE, sw.MAX_BLOCK_N, sw.NUM_WARPS = tile
            row(f"swiglu {M}x{N} ours {tile}", *fwd_bwd(lambda a, b: sw.swiglu(a, b, True), g, u))
        sw.TILE, sw.MAX_BLOCK_N, sw.NUM_WARPS = shipped
        ref = torch.compile(lambda a, b: F.silu(a.float()).mul(b.float()).to(a.dtype))
        row(f"swiglu {M}x{N} compile", *fwd_bwd(ref, g, u))
        if liger is not None:
            row(
                f"swiglu {M}x{N} liger", *fwd_bwd(liger.ops.swiglu.LigerSiLUMulFunction.apply, g, u)
            )
    table = dict(rms._RMSNORM_FWD_CONFIGS)
    for M, N in RMS_SHAPES:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(N, device="cuda", dtype=torch.bfloat16)
        width = rms.width_class(N)
        for entry in RMS_FWD:
            cfg = table[width] if entry is None else (entry[0], width, entry[2])
            rms._RMSNORM_FWD_CONFIGS = {**table, width: cfg}
            rms._clear_config_caches()
            row(
                f"rmsnorm {M}x{N} ours {cfg}",
                *fwd_bwd(lambda a, b: rms.rmsnorm(a, b, 1e-6, True), x, w),
            )
        rms._RMSNORM_FWD_CONFIGS = table
        rms._clear_config_caches()
        if liger is not None:
            lg = liger.ops.rms_norm.LigerRMSNormFunction.apply
            row(f"rmsnorm {M}x{N} liger", *fwd_bwd(lambda a, b, lg=lg: lg(a, b, 1e-6), x, w))


if __name__ == "__main__":
    main()
