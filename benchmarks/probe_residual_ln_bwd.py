"""Probe: the backward of the model's fused residual LayerNorm (`residual_layernorm`) over
"row" launch configurations, at the presets' shapes and dtypes.

The model's backward reads h_new (the fp32 residual stream), dy (bf16) and the downstream
gradient of h_new (fp32), and writes dh (fp32) and d(branch) (bf16): 20 bytes per element,
against the 6 of the plain bf16 LayerNorm the width tables were tuned on
(`_LAYERNORM_BWD_CONFIGS`; this probe's picks are `_LAYERNORM_BWD_RESIDUAL`). Each
configuration is timed as the op launches it (main kernel plus the column sum of the weight
gradient; kernel time, L2 flushed) and reported against the shipped one and the copy
ceiling.

    python3 benchmarks/probe_residual_ln_bwd.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer.layernorm import (
    MAX_BLOCK_N,
    BwdConfig,
    _layernorm_bwd_config,
    _many_rows,
    launch_layernorm_bwd,
)
from triton_transformer.residual_layernorm import residual_layernorm_op

SHAPES = {"enwik8": (8192, 512), "gpt2": (16384, 768), "large": (16384, 1024)}
BYTES_PER_ELEMENT = 4 + 2 + 4 + 4 + 2  # h_new, dy, dh_new read; dh, d(branch) written


def configs(width: int) -> list[BwdConfig]:
    block_n = 1 << (width - 1).bit_length()
    return [
        BwdConfig("row", m, block_n, w, s, prefetch=pf)
        for m, w, s, pf in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2, 4, 8), (False, True))
    ]


def sweep_shape(preset: str, M: int, N: int, ceil: dict) -> dict:
    """The shipped configuration and every `configs` entry at one (M, N): the best five."""
    torch.manual_seed(0)
    h = torch.randn(M, N, device="cuda") + 0.5
    branch = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(N, device="cuda") + 0.5
    seed = torch.zeros((), dtype=torch.int64, device="cuda")
    h_new, _, stats = residual_layernorm_op(
        h, branch, weight, None, 1e-5, False, 0.0, seed, torch.bfloat16
    )
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dh_new = torch.randn(M, N, device="cuda")
    dh, dbranch, dweight = torch.empty_like(h), torch.empty_like(branch), torch.empty_like(weight)
    shipped = _layernorm_bwd_config(N, MAX_BLOCK_N, _many_rows(M, N, False), True)

    def run(cfg):
        launch_layernorm_bwd(dy, h_new, weight, stats, dh, dweight, None, 1e-5, False,
                             dhn2=dh_new, dbr2=dbranch, cfg=cfg)  # fmt: skip

    results = []
    for cfg in [shipped, *configs(N)]:
        try:
            ms = common.kernel_ms(lambda cfg=cfg: run(cfg))
        except Exception as e:  # a configuration that does not fit
            print(f"{preset} {cfg}: {type(e).__name__}", flush=True)
            continue
        results.append((ms, cfg))
    shipped_ms = results[0][0]
    ranked = sorted(results[1:], key=lambda r: r[0])
    best_ms, best = ranked[0]
    gbps = M * N * BYTES_PER_ELEMENT / best_ms / 1e6
    return {
        "preset": preset, "shape": f"{M}x{N}", "shipped": str(shipped),
        "shipped µs": shipped_ms * 1e3, "best": str(best), "best µs": best_ms * 1e3,
        "best / shipped": best_ms / shipped_ms, "best GB/s": gbps,
        "best frac": gbps / ceil["copy_gbps"],
        "top5": [(ms * 1e3, str(c)) for ms, c in ranked[:5]],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args()
    ceil = common.ceilings()
    rows = []
    for preset, (M, N) in SHAPES.items():
        rows.append(sweep_shape(preset, M, N, ceil))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = common.env_info()
    (out / "residual_ln_bwd.json").write_text(
        json.dumps({"env": env, "ceilings": ceil, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
