"""Probe behind `swiglu.py`'s TILE / MAX_BLOCK_N / NUM_WARPS: the gating kernels at Llama
feed-forward shapes (bf16), each tile setting against torch.compile's and Liger-Kernel's
kernels in the same run. Kernel time, L2 flushed (`common.kernel_ms`); GB/s counts 3 elements
per output element forward (gate, up read; y written) and 5 backward.

Two layouts: "separate" (gate and up their own contiguous tensors: the kernels sweep them flat)
and "halves" (the two halves of one (M, 2·N) projection, as the model's feed-forward passes
them: strided rows, 2-D tiles).

    python3 benchmarks/probe_swiglu_tiles.py [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.swiglu as sw

SHAPES = ((8192, 2048), (8192, 5632), (16384, 3072))
# (TILE, MAX_BLOCK_N, NUM_WARPS); the first is the shipped setting
SETTINGS = ((2048, 1024, 4), (4096, 1024, 4), (4096, 2048, 8), (8192, 2048, 8), (1024, 1024, 4))


def inputs(M: int, N: int, layout: str):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if layout == "separate":
        return torch.randn(M, N, **bf16), torch.randn(M, N, **bf16)
    both = torch.randn(M, 2 * N, **bf16)
    return both[:, :N], both[:, N:]


def fwd_bwd(fn, g, u):
    """(forward, backward) timed calls of fn(gate, up): the backward alone, over a kept graph."""
    gl, ul = g.detach().requires_grad_(), u.detach().requires_grad_()
    y = fn(gl, ul)
    dy = torch.randn_like(y)

    def fwd():
        with torch.no_grad():
            fn(g, u)

    return fwd, lambda: torch.autograd.grad(y, (gl, ul), dy, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch._functorch.config.donated_buffer = False  # backward timed over a retained graph
    copy = common.ceilings()["copy_gbps"]
    print(f"{common.env_info()} copy {copy:.0f} GB/s")
    lg = common.liger()
    others = {"compile": common.compiled(lambda g, u: sw._swiglu_reference(g, u))}
    if lg is not None:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        others["liger"] = LigerSiLUMulFunction.apply
    rows = []
    print("| shape | layout | pass | " + " | ".join(f"{s}" for s in SETTINGS) + " | "
          + " | ".join(others) + " | best ours / best other |")  # fmt: skip
    for M, N in SHAPES:
        for layout in ("separate", "halves"):
            g, u = inputs(M, N, layout)
            t = {}
            for setting in SETTINGS:
                sw.TILE, sw.MAX_BLOCK_N, sw.NUM_WARPS = setting
                fwd, bwd = fwd_bwd(lambda a, b: sw.swiglu(a, b, use_triton=True), g, u)
                t[setting] = (common.kernel_ms(fwd), common.kernel_ms(bwd))
            sw.TILE, sw.MAX_BLOCK_N, sw.NUM_WARPS = SETTINGS[0]
            for name, fn in others.items():
                fwd, bwd = fwd_bwd(fn, g, u)
                t[name] = (common.kernel_ms(fwd), common.kernel_ms(bwd))
            for i, (pass_, elems) in enumerate((("fwd", 3), ("bwd", 5))):
                ours = min(t[s][i] for s in SETTINGS)
                best = min(t[o][i] for o in others)
                cells = [f"{t[k][i] * 1e3:.1f}" for k in (*SETTINGS, *others)]
                print(f"| {M}x{N} | {layout} | {pass_} | " + " | ".join(cells)
                      + f" | {best / ours:.3f} |", flush=True)  # fmt: skip
                gbps = {str(k): elems * M * N * 2 / (t[k][i] * 1e6) for k in t}
                rows.append(dict(shape=[M, N], layout=layout, pass_=pass_,
                                 us={str(k): t[k][i] * 1e3 for k in t}, gbps=gbps))  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {**common.env_info(), "copy_gbps": copy}
        Path(args.out, "swiglu_tiles.json").write_text(json.dumps({"env": meta, "rows": rows}))


if __name__ == "__main__":
    main()
