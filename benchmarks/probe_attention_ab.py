"""Probe: the Gluon attention backward (`attention_hopper`) against another revision of itself,
with its log-sum-exp and Δ loaded the other way (`bwd_tiles`' LSE_TMA flipped), and cuDNN's
backward, at the presets' shapes. Kernel time per backward (`common.kernel_ms`, L2 flushed:
every kernel the backward launches), packed qkv bf16, and the largest difference between the
revisions' d(qkv).

    git show REV:triton_transformer/attention_hopper.py > /tmp/attention_hopper_rev.py
    python3 benchmarks/probe_attention_ab.py --old /tmp/attention_hopper_rev.py [--out DIR]

Each revision runs under its own gate (`usable`): a row whose shape neither takes runs the
Triton kernel in every column. An older revision that makes its TMA descriptors in the kernel
gets Triton's scratch allocator set before each launch, as its caller did.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import cudnn_attention, packed_attention

import triton_transformer.attention as attn
import triton_transformer.attention_hopper as shipped
from triton_transformer.utils import tma_scratch

# name, (b, n, h, d), causal, dropout
CASES = [
    ("gpt2", (16, 1024, 12, 64), True, 0.0), ("gpt2", (16, 1024, 12, 64), True, 0.1),
    ("large", (8, 2048, 16, 64), True, 0.0), ("large", (8, 2048, 16, 64), False, 0.0),
    ("d128", (4, 4096, 16, 128), True, 0.0), ("d32", (8, 2048, 16, 32), True, 0.0),
    ("d64-4096", (4, 4096, 16, 64), True, 0.0), ("enwik8", (16, 512, 8, 64), True, 0.1),
    ("d128-2048", (8, 2048, 16, 128), True, 0.0), ("enwik8", (16, 512, 8, 64), True, 0.0),
    ("train.py", (4, 512, 8, 64), True, 0.1), ("large", (8, 2048, 16, 64), True, 0.1),
]  # fmt: skip


def load_revision(path: str):
    """The module at `path`, launching with Triton's scratch allocator set."""
    spec = importlib.util.spec_from_file_location("triton_transformer._attention_hopper_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launch = module.launch_bwd_sm90

    def launch_with_allocator(*args, **kwargs):
        triton.set_allocator(tma_scratch)
        return launch(*args, **kwargs)

    module.launch_bwd_sm90 = launch_with_allocator
    return module


def timed(module, b: int, n: int, h: int, d: int, causal: bool, p: float):
    """(µs per backward, d(qkv)) with `module` as the attention's Gluon backward."""
    attn.attention_hopper = module
    try:
        torch.manual_seed(0)
        backward = packed_attention(b, n, h, p, d, causal)[1]
        grad = backward()[0].float()
        return common.kernel_ms(backward) * 1e3, grad
    finally:
        attn.attention_hopper = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="another revision's attention_hopper.py")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    old = load_revision(args.old)
    print(common.env_info(), flush=True)
    print("| shape (b, n, h, d) | causal | p | other revision µs | shipped µs | other / shipped "
          "| LSE_TMA flipped µs | cuDNN µs | cuDNN / shipped | max rel diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    tiles = shipped.bwd_tiles
    for name, (b, n, h, d), causal, p in CASES:
        us = {}
        us["other"], g_old = timed(old, b, n, h, d, causal, p)
        us["shipped"], g_new = timed(shipped, b, n, h, d, causal, p)
        flipped = {**tiles(d, causal), "LSE_TMA": not tiles(d, causal)["LSE_TMA"]}
        shipped.bwd_tiles = lambda dd, cc, f=flipped, s=(d, causal): (
            f if (dd, cc) == s else tiles(dd, cc)
        )
        try:
            us["flipped"], _ = timed(shipped, b, n, h, d, causal, p)
        finally:
            shipped.bwd_tiles = tiles
        cudnn = "- | -"
        if p == 0.0:  # (SDPA's cuDNN backend has no dropout)
            us["cudnn"] = common.kernel_ms(cudnn_attention(b, n, h, p, d, causal)[1]) * 1e3
            cudnn = f"{us['cudnn']:.1f} | {us['cudnn'] / us['shipped']:.3f}"
        diff = ((g_old - g_new).abs().max() / g_old.abs().max()).item()
        print(f"| {name} {(b, n, h, d)} | {causal} | {p} | {us['other']:.1f} | "
              f"{us['shipped']:.1f} | {us['other'] / us['shipped']:.3f} | {us['flipped']:.1f} | "
              f"{cudnn} | {diff:.1e} |", flush=True)  # fmt: skip
        rows.append(dict(shape=name, bnhd=(b, n, h, d), causal=causal, p=p, us=us, diff=diff))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "attention_ab.json").write_text(
            json.dumps({"env": common.env_info(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
