"""Probe: the attention forward at short heads (512 queries, where it trailed cuDNN most in
`bench_attention.py`'s sweep): the eager default, the Gluon forward (`attention_hopper_fwd`,
its gate lifted), the Triton forward with each tile of a list, and cuDNN (SDPA). Kernel time
(`common.kernel_ms`, L2 flushed), bf16, median of 3 rounds in which the kernels alternate.

    python3 benchmarks/probe_attention_fwd_short.py --out DIR
Writes DIR/attention_fwd_short.json: {case: {kernel: µs}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.attention as A
import triton_transformer.attention_hopper_fwd as gluon_fwd
from triton_transformer.utils import clear_launch_plans

# (b, h, n, d, causal): the sweep's 512-query rows, enwik8's heads, a d128 control at 1024
CASES = [(32, 32, 512, 64, True), (16, 8, 512, 64, True), (32, 16, 512, 128, True),
         (32, 32, 512, 64, False), (16, 16, 1024, 128, True)]  # fmt: skip
# Triton forward tiles: BLOCK_M, BLOCK_N, warps, stages[, maxnreg]
TILES = {64: [(64, 64, 4, 3, 128), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
              (128, 128, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2, 128), (64, 128, 4, 3),
              (128, 32, 4, 3), (64, 64, 4, 4, 128), (32, 64, 4, 3)],
         128: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3),
               (128, 128, 8, 2), (64, 128, 4, 2)]}  # fmt: skip


def tile_config(tile: tuple) -> dict:
    names = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg")
    return dict(zip(names, tile, strict=False))


def kernels(b: int, h: int, n: int, d: int, causal: bool) -> dict[str, Callable]:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d**-0.5

    def default():
        return A.launch_attention_fwd(q, k, v, None, None, causal, scale, 0.0, True)

    def gluon():  # every head of the kernel's head dims (plans cleared: the gate is not keyed)
        taken, gluon_fwd._taken = gluon_fwd._taken, lambda hd, n_q, c: hd in gluon_fwd.HEAD_DIMS
        clear_launch_plans()
        try:
            return default()
        finally:
            gluon_fwd._taken = taken
            clear_launch_plans()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fns = {"default": default, "gluon": gluon, "cuDNN": cudnn}
    for tile in TILES[d]:
        cfg = tile_config(tile)
        fns[",".join(map(str, tile))] = lambda cfg=cfg: A.launch_attention_fwd(
            q, k, v, None, None, causal, scale, 0.0, True, config=cfg
        )
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(common.env_info(), flush=True)
    results = {}
    for case in CASES:
        runnable = {}
        for name, fn in kernels(*case).items():
            try:  # a tile that does not fit is reported, not fatal
                fn()
                torch.cuda.synchronize()
                runnable[name] = fn
            except Exception as e:
                print(case, name, f"{type(e).__name__}: {str(e)[:100]}", flush=True)
        samples = {name: [] for name in runnable}
        items = list(runnable.items())
        for r in range(3):
            for name, fn in items if r % 2 == 0 else items[::-1]:
                samples[name].append(common.kernel_ms(fn) * 1e3)
        med = dict(sorted(((k, statistics.median(v)) for k, v in samples.items()),
                          key=lambda kv: kv[1]))  # fmt: skip
        results[str(case)] = med
        print(case, "  ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_fwd_short.json").write_text(
        json.dumps({"env": common.env_info(), "us": results}, indent=1)
    )


if __name__ == "__main__":
    main()
