"""Probe behind `matmul_plan._FEW_ROWS_PTR`: the decode step's products (M = batch = 1 or 16
rows) of the enwik8 model, through `linear`'s plan, cuBLAS (torch's mm + relu + square for
relu²) and the pointer kernel at narrow tiles. Kernel time, L2 flushed (`common.kernel_ms`).

    python3 benchmarks/probe_decode_gemm.py
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

from triton_transformer import bmm, matmul_plan

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of the pointer kernel
PTR_CONFIGS = [(16, 32, 128, 8, 4, 3), (16, 64, 64, 8, 4, 4), (16, 32, 256, 8, 4, 3),
               (16, 16, 256, 8, 4, 3), (16, 64, 128, 8, 4, 3), (16, 32, 64, 8, 4, 4)]  # fmt: skip
SHAPES = [
    (1536, 512, False),
    (512, 512, False),
    (2048, 512, True),
    (512, 2048, False),
    (256, 512, False),
]  # fmt: skip  (N, K, relu²): to_qkv, to_out, proj_in, proj_out, logits


def probe(M: int, N: int, K: int, relu2: bool) -> dict[str, float]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    act = "relu_squared" if relu2 else None
    ref = F.linear(x.float(), w.float())
    ref = F.relu(ref) ** 2 if relu2 else ref
    res = {"plan": common.kernel_ms(lambda: bmm.linear(x, w, act, use_triton=True))}
    if relu2:
        res["torch"] = common.kernel_ms(lambda: F.relu(F.linear(x, w)).square())
    else:
        res["cublas"] = common.kernel_ms(lambda: F.linear(x, w))
    out = torch.empty(1, M, N, device="cuda", dtype=torch.bfloat16)
    for cfg in PTR_CONFIGS:

        def launch(cfg=cfg):
            matmul_plan.launch_mm_ptr(x[None], w.t()[None], out, None, None, relu2, cfg, False)

        launch()
        err = ((out[0].float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (cfg, err)
        res[f"ptr {cfg[:3]} w{cfg[4]} s{cfg[5]}"] = common.kernel_ms(launch)
    return res


def main() -> None:
    for M in (1, 16):
        for N, K, relu2 in SHAPES:
            res = probe(M, N, K, relu2)
            cases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res.items())
            best = min(res, key=res.get)
            print(f"M {M:2d} {N}x{K}{' relu2' if relu2 else ''} (us): {cases} -> {best}")


if __name__ == "__main__":
    main()
