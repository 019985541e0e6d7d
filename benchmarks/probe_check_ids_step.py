"""Probe: what `Transformer(check_token_ids=True)` costs an eager training step, against
check_token_ids=False, interleaved in one process.

The step is `cuda_graph.capturable_train_step`'s (bf16 autocast, the package's AdamW) run as
an ordinary eager loop: the model's defaults, block graphs on, backward on autograd's worker
thread. Each round times `--steps` steps of each side back to back, alternating the order;
ms per step, median and minimum over the rounds. Until the 43rd session the check read a
boolean back from the GPU in every forward (a sync); since then an eager Triton call leaves
it to its embedding's and loss's kernels (`triton_transformer.checks`).

    python3 benchmarks/probe_check_ids_step.py --out DIR [--presets small gpt2] [--rounds 7]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_step
import common

from triton_transformer import AutoregressiveWrapper, Transformer
from triton_transformer.cuda_graph import capturable_train_step


def step_of(p: dict, check: bool):
    """The preset's eager training step with check_token_ids=check, warmed up (block graphs
    captured), as a closure."""
    torch.manual_seed(0)
    net = Transformer(
        num_tokens=p["vocab"], dim=p["dim"], depth=p["depth"], heads=p["heads"],
        dim_head=p["dim_head"], max_seq_len=p["seq"], causal=True, use_triton=True,
        check_token_ids=check,
    )  # fmt: skip
    model = AutoregressiveWrapper(net).cuda().train()
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = capturable_train_step(model, batch, lr=3e-4)
    for _ in range(6):
        step()
    return step


def main() -> None:
    def add_args(ap):
        ap.add_argument("--presets", nargs="+", default=["small", "gpt2"],
                        choices=list(bench_step.PRESETS))  # fmt: skip
        ap.add_argument("--rounds", type=int, default=7)
        ap.add_argument("--steps", type=int, default=10)

    args, out = common.parse_out(__doc__, add_args)
    lines = [
        f"# Eager training step, check_token_ids on and off ({args.rounds} interleaved rounds "
        f"of {args.steps} steps; {common.env_info()})",
        "",
        "| preset | check_token_ids | ms per step, median | min | off / on (medians) |",
        "|---|---|---|---|---|",
    ]
    for preset in args.presets:
        p = bench_step.PRESETS[preset]
        sides = {check: step_of(p, check) for check in (True, False)}
        times: dict[bool, list[float]] = {check: [] for check in sides}
        for r in range(args.rounds):
            for check in (True, False) if r % 2 == 0 else (False, True):
                sides[check]()
                times[check].append(common.wall_us(sides[check], args.steps) / 1e3)
        med = {check: statistics.median(t) for check, t in times.items()}
        for check, t in times.items():
            lines.append(
                f"| {preset} | {check} | {med[check]:.3f} | {min(t):.3f} | "
                f"{med[False] / med[check]:.3f} |"
            )
        del sides
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "check_ids_step.md").write_text(text)


if __name__ == "__main__":
    main()
