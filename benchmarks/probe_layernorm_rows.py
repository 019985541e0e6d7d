"""Probe behind LayerNorm's row-count key: the backward of 512-wide rows with the shipped
entry (tuned at the model's 2048-8192 rows) against the sweep's pick at 131,072 rows, and
torch.compile's fused backward (one dynamic-shape compile), at 4,096-131,072 rows (bf16, plain
and stable). Kernel time, L2 flushed (`common.kernel_ms`).

    python3 benchmarks/probe_layernorm_rows.py [--width 512]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from bench_layernorm import SweepProblem

from triton_transformer.layernorm import (
    _LAYERNORM_BWD_CONFIGS,
    BwdConfig,
    _layernorm_reference,
)

ROWS = (4096, 16384, 32768, 65536, 131072)
# the H100 sweep's best at 131,072 x 512 (layernorm_tune.json): 0.92x compile's time there
MANY_ROWS = BwdConfig("row", 8, 512, 8, 2, prefetch=True)


# The compiled backward is timed by repeated autograd.grad over one retained graph, which
# AOTAutograd's donated buffers forbid.
torch._functorch.config.donated_buffer = False
# one dynamic-shape compile per variant, shared by every row count
COMPILED = {
    stable: torch.compile(
        lambda x, w, b, stable=stable: _layernorm_reference(x, w, b, 1e-5, stable), dynamic=True
    )
    for stable in (False, True)
}


def compiled_bwd(p: SweepProblem, stable: bool):
    """torch.compile's backward of the reference, alone (a retained graph, autograd.grad)."""
    x = p.x.detach().requires_grad_()
    w, b = p.w.detach().requires_grad_(), p.b.detach().requires_grad_()
    y = COMPILED[stable](x, w, b)
    return lambda: torch.autograd.grad(y, (x, w, b), p.dy, retain_graph=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    shipped = _LAYERNORM_BWD_CONFIGS[args.width]
    head = ("rows", "stable", "shipped µs", "many-rows µs", "compile µs", "shipped / compile",
            "many-rows / compile")  # fmt: skip
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for M in ROWS:
        p = SweepProblem(M, args.width)
        for stable in (False, True):
            t = [
                common.kernel_ms(f) * 1e3
                for f in (p.bwd(shipped, stable), p.bwd(MANY_ROWS, stable), compiled_bwd(p, stable))
            ]
            print(
                f"| {M} | {stable} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | "
                f"{t[0] / t[2]:.2f} | {t[1] / t[2]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
