"""Probe: the attention forward's warp-specialized Gluon kernel for Hopper
(`attention_hopper_fwd`) against the Triton forward, cuDNN and FlashAttention-2 (SDPA
backends), at the step presets' shapes and longer heads, causal and not, dropout 0. Kernel time
per forward (`common.kernel_ms`, L2 flushed), with the log-sum-exp written (autograd
recording, as in training), and the largest difference of its output from the Triton
forward's.

    python3 benchmarks/probe_attention_fwd_gluon.py --out DIR [--presets NAME ...]
        [--tiles BLOCK_N,STAGES[,PINGPONG[,CONSUMERS[,PER_SM[,PERSISTENT[,OUT_IN_V]]]]] ...]
        [--causal both|yes|no]

Every shape runs the Gluon kernel (the thresholds of `attention_hopper_fwd.usable` lifted);
the table says which an eager forward takes by default. --tiles times other key blocks, ring
depths, (PINGPONG 0) consumers issuing their products at once, one to three consumer
warpgroups, programs per SM (the register cap follows), (PERSISTENT 0) one program per
unit of work instead of a persistent grid and (OUT_IN_V 0) the output through the query
buffer instead of the last V buffer, besides the shipped tiles.
Writes DIR/attention_fwd_gluon.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import cudnn_attention, packed_attention
from probe_attention_gluon import SHAPES as BWD_SHAPES

import triton_transformer.attention_hopper_fwd as af
from triton_transformer.utils import clear_launch_plans

FLASH = SDPBackend.FLASH_ATTENTION

# b, n, h, d: the backward probe's shapes (d128 at every length from 512), and six more
SHAPES = {**BWD_SHAPES, "d64-8192": (2, 8192, 16, 64), "d128-128": (16, 128, 16, 128),
          "d128-256": (64, 256, 16, 128), "d128-768": (21, 768, 16, 128),
          "d64-512": (32, 512, 32, 64), "d64-1024": (16, 1024, 32, 64)}  # fmt: skip


def _tiles(text: str) -> tuple[str, dict]:
    """ "BLOCK_N,STAGES[,PINGPONG[,CONSUMERS[,PER_SM[,PERSISTENT[,OUT_IN_V]]]]]" -> (label,
    `fwd_tiles` entries; PINGPONG 1 or 0, default 1; CONSUMERS 1 to 3, default 2; PER_SM
    programs per SM, default 1; PERSISTENT 1 or 0, default 1; OUT_IN_V 1 or 0, default 1
    where the output fits the V buffer)."""
    fields = text.split(",")
    n, stages, pingpong, consumers, per_sm, persistent, out_in_v = (
        fields + ["1", "2", "1", "1", "-"][len(fields) - 2 :]
    )
    fits = int(n) >= int(consumers) * 64
    return text, {"BLOCK_N": int(n), "STAGES": int(stages), "PINGPONG": pingpong == "1",
                  "CONSUMERS": int(consumers), "PER_SM": int(per_sm),
                  "PERSISTENT": persistent == "1",
                  "OUT_IN_V": fits if out_in_v == "-" else out_in_v == "1"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tiles", nargs="*", type=_tiles, default=[])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    args = ap.parse_args()
    env = common.env_info()
    print(env, flush=True)
    rows = []
    shipped = af.fwd_tiles
    lifted = {"_taken": lambda d, n_q, causal: d in af.HEAD_DIMS}
    defaults = {name: getattr(af, name) for name in lifted}
    for preset in args.presets:
        b, n, h, d = SHAPES[preset]
        for causal in {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]:
            vars(af).update(defaults)
            clear_launch_plans()  # eager launches are bound per shape, not per gate
            q = torch.empty(b, h, n, d, device="cuda", dtype=torch.bfloat16)
            row = {"preset": preset, "causal": causal, "us": {},
                   "default": af.usable(q, q, causal, d**-0.5, plain=True)}  # fmt: skip
            vars(af).update(lifted)
            clear_launch_plans()
            torch.manual_seed(0)
            fn = packed_attention(b, n, h, 0.0, d, causal)[0]
            gluon_out = fn().float()
            row["us"]["gluon"] = common.kernel_ms(fn) * 1e3
            for label, tile in args.tiles:
                af.fwd_tiles = lambda *_, t=tile: t
                clear_launch_plans()  # nor per tile table
                try:
                    tile_out = fn().float()
                    row["us"][f"gluon {label}"] = common.kernel_ms(fn) * 1e3
                    row[f"diff {label}"] = (
                        (tile_out - gluon_out).abs().max() / gluon_out.abs().max()
                    ).item()
                except Exception as e:  # a tile that cannot compile: recorded, not fatal
                    row["us"][f"gluon {label}"] = float("nan")
                    row[f"diff {label}"] = f"{type(e).__name__}: {str(e)[:120]}"
                af.fwd_tiles = shipped
                clear_launch_plans()
            af.ENABLED = False
            triton_out = fn().float()
            row["us"]["triton"] = common.kernel_ms(fn) * 1e3
            af.ENABLED = True
            row["max |gluon - triton| / max |triton|"] = (
                (gluon_out - triton_out).abs().max() / triton_out.abs().max()
            ).item()
            row["us"]["cuDNN"] = common.kernel_ms(cudnn_attention(b, n, h, 0.0, d, causal)[0]) * 1e3
            row["us"]["FA2"] = (
                common.kernel_ms(cudnn_attention(b, n, h, 0.0, d, causal, FLASH)[0]) * 1e3
            )
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            row["TFLOP/s"] = {k: flops / v / 1e6 for k, v in row["us"].items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    vars(af).update(defaults)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_fwd_gluon.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    lines = [f"# Attention forward: the Gluon kernel for Hopper ({env})", ""]
    lines += ["µs per forward (kernel time, L2 flushed; the log-sum-exp written), packed qkv bf16"]
    lines += ["(SDPA: separate q, k, v), dropout 0; `triton`: the Triton forward; ratios > 1:"]
    lines += ["gluon faster. TFLOP/s: 4·b·h·n²·d (halved when causal) over the gluon time.", ""]
    lines.append(
        "| preset | causal | taken by default | " + " | ".join(names)
        + " | triton / gluon | cuDNN / gluon | FA2 / gluon | gluon TFLOP/s | max rel diff |"
    )  # fmt: skip
    lines.append("|---|---|---|" + "---|" * (len(names) + 5))
    for r in rows:
        us = r["us"]
        cells = [f"{us.get(k, float('nan')):.1f}" for k in names]
        lines.append(
            f"| {r['preset']} | {r['causal']} | {r['default']} | " + " | ".join(cells)
            + f" | {us['triton'] / us['gluon']:.3f} | {us['cuDNN'] / us['gluon']:.3f}"
            + f" | {us['FA2'] / us['gluon']:.3f} | {r['TFLOP/s']['gluon']:.0f}"
            + f" | {r['max |gluon - triton| / max |triton|']:.1e} |"
        )  # fmt: skip
    if args.tiles:
        lines += ["", "Other tiles: largest difference of the output from the shipped tiles' "
                  "(relative to its largest entry):", ""]  # fmt: skip
        for r in rows:
            for label, _ in args.tiles:
                diff = r[f"diff {label}"]
                diff = f"{diff:.1e}" if isinstance(diff, float) else diff
                lines.append(f"- {r['preset']} causal={r['causal']} {label}: {diff}")
    (out / "attention_fwd_gluon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
