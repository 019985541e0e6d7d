"""Probe: the host cost of eager op calls, this checkout against another copy of the package,
interleaved in one process.

`bench_overhead.py` run twice (once per checkout, in two processes) compares numbers taken
seconds apart, and this device's host moves more than the differences between calls (the
same code read 320 and 663 µs in two runs of one call). Here both packages live in one
process: the other copy of `triton_transformer/` is imported under another package name
(`tt_rev`, its `torch.library` namespace renamed with it, so both register their ops),
and each round times `--calls` calls of one package, then of the other, for every op and
mode, alternating which goes first. Reported: the median and the minimum over the rounds of
µs per call (the `bench_overhead.py` loop: calls back to back, one synchronise), and
PyTorch's own op in the same rounds.

    git archive REV triton_transformer | tar -x -C OLD   # the revision to compare against
    python3 benchmarks/probe_host_ab.py --out DIR --other OLD [--ops layernorm dropout]
        [--rounds 15] [--calls 200]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_overhead
import common

PACKAGE = "triton_transformer"
RENAMED = "tt_rev"


def import_other(other: Path) -> str:
    """Copy `other`/triton_transformer/ under the name RENAMED into a temporary folder put on
    sys.path; returns the folder."""
    folder = Path(tempfile.mkdtemp())
    shutil.copytree(other / PACKAGE, folder / RENAMED)
    for path in (folder / RENAMED).rglob("*.py"):
        path.write_text(path.read_text().replace(PACKAGE, RENAMED))
    sys.path.insert(0, str(folder))
    return str(folder)


def op_calls(package: str, use_triton: bool = True) -> dict:
    """The calls of `bench_overhead.cases` through `package`'s modules."""
    return bench_overhead.cases(bench_overhead.ops_of(package), use_triton=use_triton)


def main() -> None:
    def add_args(ap):
        ap.add_argument(
            "--other",
            required=True,
            type=Path,
            help="a folder holding the triton_transformer/ to compare against",
        )
        ap.add_argument("--ops", nargs="+", default=["layernorm", "dropout"])
        ap.add_argument("--rounds", type=int, default=15)
        ap.add_argument("--calls", type=int, default=200)

    args, out = common.parse_out(__doc__, add_args)
    import_other(args.other)
    other = f"{args.other}"
    sides = {
        "this checkout": op_calls(PACKAGE),
        other: op_calls(RENAMED),
        "torch": op_calls(PACKAGE, use_triton=False),
    }

    def modes(fwd):
        def fwd_bwd():
            bench_overhead.loss_of(fwd()).backward()

        def no_grad():
            with torch.no_grad():
                return fwd()

        return {"fwd": fwd, "fwd no grad": no_grad, "fwd+bwd": fwd_bwd}

    times: dict = {}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for op in args.ops:
            for side in order:
                for mode, fn in modes(sides[side][op]).items():
                    for thread in ("worker", "calling"):
                        if mode != "fwd+bwd" and thread == "calling":
                            continue
                        with torch.autograd.set_multithreading_enabled(thread == "worker"):
                            for _ in range(5):
                                fn()
                            us = common.wall_us(fn, args.calls)
                        name = mode if mode != "fwd+bwd" else f"fwd+bwd, {thread} thread"
                        times.setdefault(op, {}).setdefault(name, {}).setdefault(side, []).append(
                            us
                        )
    lines = [
        f"# Host µs per eager call, this checkout against {other}, interleaved "
        f"({args.rounds} rounds of {args.calls} calls; {common.env_info()})",
        "",
        "| op | mode | " + " | ".join(f"{s} median / min" for s in sides) + " |",
        "|---|---|" + "---|" * len(sides),
    ]
    for op, by_mode in times.items():
        for mode, by_side in by_mode.items():
            cells = [
                f"{statistics.median(v):.0f} / {min(v):.0f}" for v in (by_side[s] for s in sides)
            ]
            lines.append(f"| {op} | {mode} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "host_ab.md").write_text(text)
    (out / "host_ab.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
