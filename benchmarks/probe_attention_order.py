"""Probe: the order in which a causal attention launch runs its programs.

A causal head's blocks differ in work (the first key block of the backward, the last query
block of the forward, sees every row or key), and the GPU starts programs in grid order.
`attention._longest_first` deals them longest first across groups of heads whose streamed
tensors fit `attention.LONGEST_FIRST_BYTES`; 0 keeps head-major order (longest first within
each head only). This times the forward and the backward (packed qkv, as the model calls
them, with autograd recording, so that the forward writes its log-sum-exp; kernel time,
L2 flushed) for several budgets, against cuDNN's in the same run.

`--fwd-tiles` times instead the forward's tile configurations, in the shipped order, at the
same shapes (dropout 0).

    python3 benchmarks/probe_attention_order.py --out DIR [--fwd-tiles]
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import cudnn_attention, packed_attention

import triton_transformer.attention as attn

# preset: (b, n, h, d)
SHAPES = {
    "enwik8": (16, 512, 8, 64),
    "gpt2": (16, 1024, 12, 64),
    "large": (8, 2048, 16, 64),
    "d128 n4096": (4, 4096, 16, 128),
}
BUDGETS = {"head-major": 0, "4 MiB": 4 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20,
           "all heads": 1 << 40}  # fmt: skip


# (BLOCK_M, BLOCK_N, warps, stages); the first is the shipped d64 causal entry
FWD_TILES = ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3),
             (128, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4))  # fmt: skip


def fwd_tiles(out_dir: Path, env: dict) -> None:
    rows = []
    for preset, (b, n, h, d) in SHAPES.items():
        qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        row = dict(preset=preset, b=b, n=n, h=h, d=d)
        for m, nb, warps, stages in FWD_TILES:
            config = {"BLOCK_M": m, "BLOCK_N": nb, "num_warps": warps, "num_stages": stages}
            try:
                fwd = functools.partial(
                    attn.launch_attention_fwd, q, k, v, None, None, True, d**-0.5, 0.0, True,
                    config=config,
                )  # fmt: skip
                us = common.kernel_ms(fwd)
                row[str((m, nb, warps, stages))] = us * 1e3
            except Exception as exc:  # a tile that does not fit: recorded
                row[str((m, nb, warps, stages))] = float("nan")
                print(preset, config, type(exc).__name__, flush=True)
        row["cudnn"] = common.kernel_ms(cudnn_attention(b, n, h, 0.0, d)[0]) * 1e3
        rows.append(row)
        print(row, flush=True)
    names = [str(t) for t in FWD_TILES]
    lines = [f"# Causal attention forward tiles ({env})", ""]
    lines += ["µs per call, kernel time (L2 flushed), bf16, causal, with log-sum-exp; tiles as"]
    lines += ["(BLOCK_M, BLOCK_N, warps, stages), the first shipped", ""]
    lines += ["| preset | " + " | ".join(names) + " | cuDNN |", "|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        cells = [f"{r[k]:.1f}" for k in names]
        lines.append(f"| {r['preset']} | " + " | ".join(cells) + f" | {r['cudnn']:.1f} |")
    (out_dir / "attention_fwd_tiles.json").write_text(json.dumps(dict(env=env, rows=rows)))
    (out_dir / "attention_fwd_tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    args, out_dir = common.parse_out(
        __doc__, lambda p: p.add_argument("--fwd-tiles", action="store_true")
    )
    env = common.env_info()
    if args.fwd_tiles:
        fwd_tiles(out_dir, env)
        return
    rows = []
    shipped = attn.LONGEST_FIRST_BYTES
    for preset, (b, n, h, d) in SHAPES.items():
        for p in (0.0, 0.1):
            row = dict(preset=preset, b=b, n=n, h=h, d=d, dropout=p)
            fwd, bwd = cudnn_attention(b, n, h, p, d)
            row["cudnn fwd"] = common.kernel_ms(fwd) * 1e3
            row["cudnn bwd"] = common.kernel_ms(bwd) * 1e3
            for name, budget in BUDGETS.items():
                attn.LONGEST_FIRST_BYTES = budget
                fwd, bwd = packed_attention(b, n, h, p, d)
                row[f"{name} fwd"] = common.kernel_ms(fwd) * 1e3
                row[f"{name} bwd"] = common.kernel_ms(bwd) * 1e3
            attn.LONGEST_FIRST_BYTES = shipped
            rows.append(row)
            print(row, flush=True)
    lines = [f"# Causal attention program order ({env})", ""]
    lines += ["µs per call, kernel time (L2 flushed), packed qkv, bf16, causal; the budget is"]
    lines += ["`attention.LONGEST_FIRST_BYTES` (head-major: 0, the previous order)", ""]
    for part in ("fwd", "bwd"):
        names = list(BUDGETS)
        lines += [f"## {part}", ""]
        lines += ["| preset | dropout | " + " | ".join(names) + " | cuDNN | cuDNN / best |"]
        lines += ["|---|---|" + "---|" * (len(names) + 2)]
        for r in rows:
            best = min(r[f"{k} {part}"] for k in names)
            cells = [f"{r[f'{k} {part}']:.1f}" for k in names]
            lines.append(
                f"| {r['preset']} | {r['dropout']} | " + " | ".join(cells)
                + f" | {r[f'cudnn {part}']:.1f} | {r[f'cudnn {part}'] / best:.3f} |"
            )  # fmt: skip
        lines.append("")
    (out_dir / "attention_order.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    (out_dir / "attention_order.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
