"""Probe: the causal attention kernels' register budget (Triton's `maxnreg` launch option) and
their tiles (with and without caps), at the step presets' shapes (packed qkv as the model passes
it, bf16, d 64). Capping registers per thread lets more programs share an SM (at 4 warps,
65,536 registers: 168 per thread fit 3 programs, 128 fit 4), at the price of spills; this
measures whether occupancy is what the single-pass backward (0.8x cuDNN's) and the forward
lack. Each variant's compiled registers, spills and shared memory are printed with its time.
Kernel time (`common.kernel_ms`, L2 flushed), cuDNN (SDPA) in the same run.

    python3 benchmarks/probe_attention_regs.py --out DIR [--presets NAME ...] [--no-tiles]
        [--no-loads] [--caps N ...] [--fwd-tiles M,N,W,S[,R] ...] [--bwd-tiles M1,N1,W,S[,R] ...]

The backward is also timed with pointer tile loads (`attention.TMA_LOADS = False`, what a
traced launch takes) against its TMA descriptor loads.
Writes DIR/attention_regs.json and attention_regs.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import cudnn_attention, packed_attention

import triton_transformer.attention as attn

# b, n, h, d
SHAPES = {"enwik8": (16, 512, 8, 64), "gpt2": (16, 1024, 12, 64), "large": (8, 2048, 16, 64),
          "d128": (4, 4096, 16, 128), "train.py": (4, 512, 8, 64)}  # fmt: skip
MAXNREG = (None, 128, 152, 168, 192)
# tiles besides the shipped entries: forward (BLOCK_M, BLOCK_N, warps, stages, maxnreg);
# backward (BLOCK_M1, BLOCK_N1, warps, stages, maxnreg): 32 queries per step hold half the
# per-step tiles in registers, which may let a cap fit 3 programs per SM without spills
FWD_TILES = ((128, 64, 8, 3, None), (128, 64, 8, 2, None), (128, 64, 8, 3, 128),
             (64, 64, 4, 2, 128))  # fmt: skip
BWD_TILES = ((32, 64, 4, 3, None), (32, 64, 4, 3, 168), (32, 64, 4, 3, 152),
             (32, 64, 4, 2, 168), (64, 64, 4, 2, None))  # fmt: skip


def _tile(text: str) -> tuple:
    """Parse "M,N,warps,stages[,maxnreg]" into (M, N, warps, stages, maxnreg or None)."""
    parts = [int(x) for x in text.split(",")]
    return (*parts, None) if len(parts) == 4 else tuple(parts)


def _cache(kernel) -> dict:
    return kernel.device_caches[torch.cuda.current_device()][0]


def timed(name: str, fn, kernel, before: int) -> dict:
    """Kernel µs of fn, and the registers, spills and shared memory of the kernel variant
    compiled since its cache held `before` entries ("as above" when none was: an earlier
    row's variant ran)."""
    try:
        us = common.kernel_ms(fn) * 1e3
    except Exception as e:  # a variant that cannot compile or run: recorded, not fatal
        print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {"us": float("nan"), "stats": type(e).__name__}
    compiled = list(_cache(kernel).values())[before:]
    if not compiled:
        return {"us": us, "stats": "as above"}
    k = compiled[-1]
    k._init_handles()
    return {"us": us, "stats": f"{k.n_regs} regs, {k.n_spills} spills, "
            f"{k.metadata.shared // 1024} KiB"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    # train.py: one micro-batch of configs/enwik8.toml
    ap.add_argument("--presets", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--no-tiles", action="store_true", help="register caps only")
    ap.add_argument("--no-loads", action="store_true", help="skip the pointer-loads backward")
    ap.add_argument("--caps", nargs="*", type=int, default=MAXNREG[1:], help="maxnreg values")
    ap.add_argument("--fwd-tiles", nargs="*", type=_tile, default=FWD_TILES,
                    help="forward tiles M,N,warps,stages[,maxnreg]")  # fmt: skip
    ap.add_argument("--bwd-tiles", nargs="*", type=_tile, default=BWD_TILES,
                    help="backward tiles M1,N1,warps,stages[,maxnreg] (any head dim)")  # fmt: skip
    args = ap.parse_args()
    env = common.env_info()
    print(env, flush=True)
    fwd_config = attn._attention_fwd_config
    kernels = (attn._attention_fwd_kernel, attn._attention_bwd_kernel)
    rows = []
    for preset in args.presets:
        b, n, h, d = SHAPES[preset]
        bwd_key = (d <= 64, False)
        shipped_bwd = attn._ATOMIC_BWD[bwd_key]
        for p in (0.0, 0.1):
            row = {"preset": preset, "dropout": p, "bwd": {}, "fwd": {}}
            # the shipped entry without its cap, if it has one: the caps below replace it
            shipped_fwd = dict(fwd_config(False, d, torch.bfloat16, True, p > 0))
            shipped_fwd.pop("maxnreg", None)
            for reg in (None, *args.caps):
                extra = {} if reg is None else {"maxnreg": reg}
                attn._ATOMIC_BWD[bwd_key] = {**shipped_bwd, **extra}
                attn._attention_bwd_config.cache_clear()
                attn._attention_fwd_config = lambda *a, e=extra, c=shipped_fwd: {**c, **e}
                seen = [len(_cache(k)) for k in kernels]
                fwd, bwd = packed_attention(b, n, h, p, d)
                name = f"maxnreg {reg}"
                row["bwd"][name] = timed(name, bwd, kernels[1], seen[1])
                row["fwd"][name] = timed(name, fwd, kernels[0], seen[0])
            attn._ATOMIC_BWD[bwd_key] = shipped_bwd
            attn._attention_bwd_config.cache_clear()
            if not args.no_loads:
                attn.TMA_LOADS = False
                seen = len(_cache(kernels[1]))
                bwd = packed_attention(b, n, h, p, d)[1]
                row["bwd"]["pointer loads"] = timed("pointer loads", bwd, kernels[1], seen)
                attn.TMA_LOADS = True
            for m, nb, warps, stages, reg in () if args.no_tiles else args.fwd_tiles:
                tile = {"BLOCK_M": m, "BLOCK_N": nb, "num_warps": warps, "num_stages": stages}
                tile.update({} if reg is None else {"maxnreg": reg})
                attn._attention_fwd_config = lambda *a, t=tile: t
                name = f"tile {(m, nb, warps, stages, reg)}"
                seen = len(_cache(kernels[0]))
                fwd = packed_attention(b, n, h, p, d)[0]
                row["fwd"][name] = timed(name, fwd, kernels[0], seen)
            attn._attention_fwd_config = fwd_config
            for m1, n1, warps, stages, reg in () if args.no_tiles else args.bwd_tiles:
                tile = attn._atomic_tiles(m1, n1, warps, stages)
                attn._ATOMIC_BWD[bwd_key] = {**tile, **({} if reg is None else {"maxnreg": reg})}
                attn._attention_bwd_config.cache_clear()
                name = f"tile {(m1, n1, warps, stages, reg)}"
                seen = len(_cache(kernels[1]))
                bwd = packed_attention(b, n, h, p, d)[1]
                row["bwd"][name] = timed(name, bwd, kernels[1], seen)
            attn._ATOMIC_BWD[bwd_key] = shipped_bwd
            attn._attention_bwd_config.cache_clear()
            cu_fwd, cu_bwd = cudnn_attention(b, n, h, p, d)
            row["cudnn fwd"] = common.kernel_ms(cu_fwd) * 1e3
            row["cudnn bwd"] = common.kernel_ms(cu_bwd) * 1e3
            row["shipped fwd"] = str(shipped_fwd)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_regs.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# Causal attention: register caps and forward tiles ({env})", ""]
    lines += ["µs per call (kernel time, L2 flushed), packed qkv, bf16, d64 unless named; the"]
    lines += ["registers per thread, spills and shared memory of the variant it compiled, in"]
    lines += ['brackets ("as above": a variant an earlier row compiled).', ""]
    for part in ("bwd", "fwd"):
        names = list(dict.fromkeys(k for r in rows for k in r[part]))
        lines += [f"## {part}", "", "| preset | dropout | " + " | ".join(names) + " | cuDNN |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for r in rows:
            cells = [
                f"{r[part][k]['us']:.1f} ({r[part][k]['stats']})" if k in r[part] else "-"
                for k in names
            ]
            cudnn = f"{r[f'cudnn {part}']:.1f}"
            lines.append(
                f"| {r['preset']} | {r['dropout']} | " + " | ".join(cells) + f" | {cudnn} |"
            )
        lines.append("")
    (out / "attention_regs.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
