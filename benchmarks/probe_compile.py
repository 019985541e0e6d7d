"""`train.py --use-triton --compile` against `--use-triton` (whole-step CUDA graphs on in both),
with the traced attention backward as the single pass or the two-program kernel
(`attention.TRACED_SINGLE_PASS`), the Hopper Gluon kernels taken by traced code through their
opaque ops or not (`TRACED_OPAQUE`), inductor's combo kernels (horizontal fusion of small
independent kernels) on or off, and the micro-batches' weight gradients accumulated in the
products (`bmm.accumulate_grads_in_place`; compiled: by the traced backward, traced=True) or
added by autograd ("triton-add-grads", "triton-compile-add-grads"). Each
variant trains the enwik8 config through `bench_train.run_mode` (tokens/s, GPU ms per step,
peak memory, the longest kernels).

Usage: python3 benchmarks/probe_compile.py --out DIR [--steps 100] [--variants NAME ...]
Writes DIR/compile_probe.json, compile_probe.md and compile_probe_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402
import common  # noqa: E402

from triton_transformer import attention, bmm, cross_entropy, matmul_plan  # noqa: E402

# name -> (bench_train mode, traced single pass, inductor combo kernels, micro-batches'
# weight gradients accumulated in place: `bmm.ACCUMULATE_IN_PLACE`, traced code takes the
# Hopper Gluon kernels through their opaque ops: the modules' `TRACED_OPAQUE`)
VARIANTS = {
    "triton": ("triton", True, False, True, True),
    "triton-add-grads": ("triton", True, False, False, True),
    "triton-compile-twoprog": ("triton-compile", False, False, True, True),
    "triton-compile": ("triton-compile", True, False, True, True),
    "triton-compile-no-opaque": ("triton-compile", True, False, True, False),
    "triton-compile-add-grads": ("triton-compile", True, False, False, True),
    "triton-compile-combo": ("triton-compile", True, True, True, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    args.set, args.config = [], str(ROOT / "configs" / "enwik8.toml")  # what run_mode reads
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the flag is read when the backward is traced: a cached graph would skip the trace
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    rows = []
    for name in args.variants:
        mode, single_pass, combo, in_place, traced_gluon = VARIANTS[name]
        attention.TRACED_SINGLE_PASS = single_pass
        for module in (attention, matmul_plan, cross_entropy):
            module.TRACED_OPAQUE = traced_gluon
        bmm.ACCUMULATE_IN_PLACE = in_place
        torch._inductor.config.combo_kernels = combo
        try:
            row = {**bench_train.run_mode(mode, args, out / "runs" / name), "mode": name}
        except Exception as e:  # one failing variant must not hide the others
            row = {"mode": name, "error": repr(e)[:400]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
        torch._dynamo.reset()
    (out / "compile_probe.json").write_text(json.dumps(rows, indent=1))
    (out / "compile_probe_kernels.md").write_text(common.kernel_tables(rows, 30))
    base = next((r["tokens/s"] for r in rows if r["mode"] == "triton" and "tokens/s" in r), None)
    lines = [
        f"# `--use-triton --compile` variants, enwik8, {args.steps} steps; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        "",
        "| variant | tokens/s | GPU ms/step | peak MiB | last val loss | / triton |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tokens/s" not in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens/s'] / base:.3f}" if base else ""
        lines.append(
            f"| {r['mode']} | {r['tokens/s']:,.0f} | {r['gpu ms/step']:.3f} | "
            f"{r['peak MiB']:,.0f} | {r['last val loss']:.4f} | {ratio} |"
        )
    (out / "compile_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
