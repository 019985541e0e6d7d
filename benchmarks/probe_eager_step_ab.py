"""Probe: the model's eager training step (no CUDA graphs of any kind), this checkout against
another copy of the package and against PyTorch ops, interleaved in one process.

`bench_eager_step.py` times each provider once, seconds apart, and this device's host moves
more than the differences sought (PyTorch's own step read 11-21 ms within one call). Here
the three sides are built side by side (the other copy imported as `probe_host_ab` does), and
each round times every side, alternating the order: the step of
`cuda_graph.capturable_train_step` (bf16 autocast; the package's AdamW for Triton ops,
torch's fused AdamW for PyTorch ops), `--steps` steps back to back, one synchronise. Triton
sides run with `cuda_graphs=False`, every kernel launched from Python. Reported per side and
thread (autograd's worker thread, PyTorch's default; the calling thread, what the trainer
uses): the median and the minimum over the rounds, in ms per step and against PyTorch's.

    git archive REV triton_transformer | tar -x -C OLD
    python3 benchmarks/probe_eager_step_ab.py --out DIR --other OLD [--preset small]
        [--block llama] [--rounds 7] [--steps 10]
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_step
import common
from probe_host_ab import PACKAGE, RENAMED, import_other


def step_of(package: str, p: dict, use_triton: bool, block: str = "classic"):
    """`package`'s eager training step of the preset's model with `block`'s options
    (`bench_step.BLOCKS`), a closure."""
    transformer = importlib.import_module(f"{package}.transformer")
    wrapper = importlib.import_module(f"{package}.autoregressive_wrapper")
    cuda_graph = importlib.import_module(f"{package}.cuda_graph")
    torch.manual_seed(0)
    net = transformer.Transformer(
        num_tokens=p["vocab"], dim=p["dim"], depth=p["depth"], heads=p["heads"],
        dim_head=p["dim_head"], max_seq_len=p["seq"], causal=True, use_triton=use_triton,
        check_token_ids=False, **bench_step.block_options(block, p),
    )  # fmt: skip
    net.cuda_graphs = False
    model = wrapper.AutoregressiveWrapper(net).cuda().train()
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = cuda_graph.capturable_train_step(model, batch, lr=3e-4)
    for _ in range(5):  # autotuning, bound launches, allocator warm-up
        step()
    return step


def main() -> None:
    def add_args(ap):
        ap.add_argument("--other", required=True, type=Path, help="a folder holding the "
                        "triton_transformer/ to compare against")  # fmt: skip
        ap.add_argument("--preset", default="small", choices=list(bench_step.PRESETS))
        ap.add_argument("--rounds", type=int, default=7)
        ap.add_argument("--steps", type=int, default=10)
        ap.add_argument("--block", choices=list(bench_step.BLOCKS), default="classic",
                        help="the model's block (llama: rope, RMSNorm, SwiGLU, GQA)")  # fmt: skip

    args, out = common.parse_out(__doc__, add_args)
    import_other(args.other)
    p = bench_step.PRESETS[args.preset]
    sides = {
        "this checkout": step_of(PACKAGE, p, True, args.block),
        str(args.other): step_of(RENAMED, p, True, args.block),
        "torch": step_of(PACKAGE, p, False, args.block),
    }
    times: dict = {thread: {side: [] for side in sides} for thread in ("worker", "calling")}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else reversed(sides):
            for thread in times:
                with torch.autograd.set_multithreading_enabled(thread == "worker"):
                    sides[side]()
                    times[thread][side].append(common.wall_us(sides[side], args.steps) / 1e3)
    lines = [
        f"# Eager {args.preset} ({args.block} block) training step without CUDA graphs, ms per "
        f"step, interleaved "
        f"({args.rounds} rounds of {args.steps} steps; {common.env_info()})",
        "",
        "| thread | side | median | min | torch / side (medians) |",
        "|---|---|---|---|---|",
    ]
    for thread, by_side in times.items():
        torch_ms = statistics.median(by_side["torch"])
        for side, ms in by_side.items():
            med = statistics.median(ms)
            lines.append(
                f"| {thread} | {side} | {med:.2f} | {min(ms):.2f} | {torch_ms / med:.3f}× |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    name = args.preset if args.block == "classic" else f"{args.preset}_{args.block}"
    (out / f"eager_step_ab_{name}.md").write_text(text)
    (out / f"eager_step_ab_{name}.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
