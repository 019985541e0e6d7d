"""Probe behind `mlp.relu2_mlp`: relu²'s gradient in the epilogue of dout @ W_out against
cuBLAS's product plus the separate pass, at the feed-forward shapes of the enwik8, GPT-2 and
large presets (bf16, tokens x dim -> hidden). Kernel time, L2 flushed (`common.kernel_ms`).

Per shape, d(pre) alone:
- fused: `mm_relu2_grad_op` as planned ("auto": the TMA kernel's RELU2_GRAD epilogue on Hopper);
- cublas+ew: torch.mm, then `_relu2_grad_kernel` in place (what the two linears ran);
- mm: torch.mm alone (the product's floor);
and the whole feed-forward, forward + backward: `relu2_mlp` against the two `linear`s it
replaces, dropout 0 and 0.1.

    python3 benchmarks/probe_relu2_mlp.py [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common

import triton_transformer.matmul_plan as plan
from triton_transformer.bmm import linear
from triton_transformer.mlp import mm_relu2_grad_op, relu2_mlp

SHAPES = {  # preset: (tokens, dim, hidden)
    "enwik8": (8192, 512, 2048),
    "gpt2": (16384, 768, 3072),
    "large": (16384, 1024, 4096),
}


def forced(path, fn):
    """fn run with the planner's forced path (None: as planned)."""

    def run():
        before = plan._FORCE_PATH
        plan._FORCE_PATH = path
        try:
            return fn()
        finally:
            plan._FORCE_PATH = before

    return run


def measure(name: str, M: int, D: int, H: int, ceil: dict) -> list[dict]:
    """One preset's rows: d(pre) three ways, then the feed-forward's fwd+bwd two ways."""
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
    dout = torch.randn(M, D, device=dev, dtype=bf16)
    w_out = torch.randn(D, H, device=dev, dtype=bf16) * H**-0.5
    h = torch.randn(M, H, device=dev, dtype=bf16).clamp(min=0) ** 2
    seed = torch.tensor(7, device=dev)

    def dpre():
        return mm_relu2_grad_op(dout, w_out, h, True)

    t = {
        "fused": common.kernel_ms(dpre),
        "cublas+ew": common.kernel_ms(forced("cublas+ew", dpre)),
        "mm": common.kernel_ms(lambda: torch.mm(dout, w_out)),
    }
    tflops = 2 * M * D * H / t["fused"] / 1e9
    rows.append(dict(preset=name, what="d(pre)", dropout=0.0, **t, fused_tflops=tflops))
    print(
        f"| {name} | d(pre) vs cuBLAS + pass | 0 | {t['fused']:.4f} | {t['cublas+ew']:.4f} "
        f"| {t['cublas+ew'] / t['fused']:.3f} |  (mm alone {t['mm']:.4f}; fused "
        f"{tflops:.0f} TFLOP/s of {ceil['bf16_tflops']:.0f})",
        flush=True,
    )
    x = torch.randn(M, D, device=dev, dtype=bf16, requires_grad=True)
    w_in = (torch.randn(H, D, device=dev) * D**-0.5).requires_grad_()
    w_o = (torch.randn(D, H, device=dev) * H**-0.5).requires_grad_()
    g = torch.randn(M, D, device=dev, dtype=bf16)
    for p in (0.0, 0.1):

        def fused(p=p):
            with torch.autocast("cuda", dtype=bf16):
                out = relu2_mlp(x, w_in, w_o, use_triton=True, dropout_p=p, seed=seed)
            torch.autograd.grad(out, (x, w_in, w_o), g)

        def two_linears(p=p):
            with torch.autocast("cuda", dtype=bf16):
                hh = linear(x, w_in, "relu_squared", use_triton=True, dropout_p=p, seed=seed)
                out = linear(hh, w_o, use_triton=True)
            torch.autograd.grad(out, (x, w_in, w_o), g)

        a, b = common.kernel_ms(fused), common.kernel_ms(two_linears)
        rows.append(dict(preset=name, what="fwd+bwd", dropout=p, fused=a, two_linears=b))
        print(f"| {name} | fwd+bwd vs two linears | {p} | {a:.4f} | {b:.4f} | {b / a:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceil = common.ceilings()
    rows = []
    print(f"{common.env_info()} {ceil}")
    print("| preset | what | dropout | ours ms | other ms | other / ours |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        rows += measure(name, *shape, ceil)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {**common.env_info(), **ceil}
        Path(args.out, "relu2_mlp.json").write_text(json.dumps({"env": meta, "rows": rows}))


if __name__ == "__main__":
    main()
