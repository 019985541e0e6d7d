"""Probe: the attention backward's Gluon kernels for Hopper (`attention_hopper`; at d64 and
d128 also `attention_hopper_bwd_ws`, column "gluon ws") against the Triton kernels' backward, cuDNN
and FlashAttention-2 (SDPA backends), at the step presets' shapes, causal and not, dropout 0.
Kernel time per backward (`common.kernel_ms`, L2 flushed: every kernel the backward launches,
Δ and dQ's cast included), the single-pass kernel's registers and spills, and the largest
difference of its gradients from the Triton backward's (and of the warp-specialized one's
from it).

    python3 benchmarks/probe_attention_gluon.py --out DIR [--presets NAME ...]
        [--tiles M,N,WARPS[,NAME=VALUE ...] ...] [--causal both|yes|no]
        [--ws-tiles STAGES,CONSUMERS ...]

Every shape runs the Gluon kernels (the thresholds of both modules' `usable` lifted); the
table says which kernel an eager backward takes by default. --tiles times other tiles of the
single pass (BLOCK_M queries, BLOCK_N keys, warps; further `bwd_tiles` entries as NAME=VALUE,
e.g. LSE_TMA=1 or maxnreg=none to drop the register cap) besides the shipped ones.
Writes DIR/attention_gluon.json and attention_gluon.md.
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

import triton_transformer.attention_hopper as ah
import triton_transformer.attention_hopper_bwd_ws as ws
from triton_transformer.utils import clear_launch_plans

FLASH = SDPBackend.FLASH_ATTENTION

# b, n, h, d
SHAPES = {"train.py": (4, 512, 8, 64), "enwik8": (16, 512, 8, 64), "gpt2": (16, 1024, 12, 64),
          "large": (8, 2048, 16, 64), "d128": (4, 4096, 16, 128),
          "d32": (8, 2048, 16, 32), "d64-4096": (4, 4096, 16, 64),
          "d128-2048": (8, 2048, 16, 128), "d128-512": (32, 512, 16, 128),
          "d128-1024": (16, 1024, 16, 128), "d128-8192": (2, 8192, 16, 128)}  # fmt: skip


def _compiled() -> dict:
    return ah._attention_bwd_sm90_kernel.device_caches[torch.cuda.current_device()][0]


def kernel_stats(before: set) -> str:
    """Registers, spills and shared memory of the kernel compiled since `before` (the cache's
    keys then); "-" if the call compiled none (it reused a specialisation)."""
    new = [k for key, k in _compiled().items() if key not in before]
    if not new:
        return "-"
    k = new[-1]
    k._init_handles()
    return f"{k.n_regs} regs, {k.n_spills} spills, {k.metadata.shared // 1024} KiB"


def _tiles(text: str) -> tuple[str, dict]:
    """ "M,N,WARPS[,NAME=VALUE...]" -> (label, overrides of `bwd_tiles`; VALUE none drops it)."""
    m, n, w, *rest = text.split(",")
    tile = {"BLOCK_M": int(m), "BLOCK_N": int(n), "num_warps": int(w)}
    for item in rest:
        name, value = item.split("=")
        tile[name] = None if value == "none" else int(value)
    return text, tile


def default_kernel(q: torch.Tensor, d: int, causal: bool) -> str:
    """The kernel an eager backward of (b, h, n, d) q (plain attention) takes: "gluon ws",
    "gluon" (the single pass) or "triton"."""
    if ws.usable(q, q, causal, plain=True):
        return "gluon ws"
    return "gluon" if ah.usable(q, q, d, causal, no_key_mask=True) else "triton"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tiles", nargs="*", type=_tiles, default=[])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument(
        "--ws-tiles", nargs="*", default=[],
        type=lambda t: tuple(int(x) for x in t.split(",")),
        help="STAGES,CONSUMERS of attention_hopper_bwd_ws to time besides the shipped ones",
    )  # fmt: skip
    args = ap.parse_args()
    env = common.env_info()
    print(env, flush=True)
    rows = []
    shipped = ah.bwd_tiles
    # every shape takes the kernels here; "default" is the kernel an eager backward takes
    # under the gates' defaults
    lifted = {"MIN_QUERIES": 1, "MIN_QUERIES_D64": 1, "TAKEN_HEAD_DIMS": ah.HEAD_DIMS,
              "TAKEN_HEAD_DIMS_CAUSAL": ah.HEAD_DIMS}  # fmt: skip
    defaults = {name: getattr(ah, name) for name in lifted}
    ws_taken = ws._taken
    for preset in args.presets:
        b, n, h, d = SHAPES[preset]
        for causal in {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]:
            vars(ah).update(defaults)
            ws._taken = ws_taken
            clear_launch_plans()  # eager launches are bound per shape, not per gate
            q = torch.empty(b, h, n, d, device="cuda", dtype=torch.bfloat16)
            row = {"preset": preset, "causal": causal, "us": {},
                   "default": default_kernel(q, d, causal)}  # fmt: skip
            vars(ah).update(lifted)
            ws._taken = lambda d, n_q, causal: d in ws.HEAD_DIMS
            clear_launch_plans()
            torch.manual_seed(0)
            fn = packed_attention(b, n, h, 0.0, d, causal)[1]
            if d in ws.HEAD_DIMS:
                ws_grad = fn()[0].float()
                row["us"]["gluon ws"] = common.kernel_ms(fn) * 1e3
                for stages, consumers in args.ws_tiles:
                    shipped_ws = ws.bwd_tiles
                    ws.bwd_tiles = lambda _c, s=stages, c=consumers: {"STAGES": s, "CONSUMERS": c}
                    clear_launch_plans()  # nor per tile table
                    row["us"][f"gluon ws {stages},{consumers}"] = common.kernel_ms(fn) * 1e3
                    ws.bwd_tiles = shipped_ws
                    clear_launch_plans()
                ws.ENABLED = False
            before = set(_compiled())
            gluon_grad = fn()[0].float()
            row["us"]["gluon"] = common.kernel_ms(fn) * 1e3
            row["gluon stats"] = kernel_stats(before)
            for label, override in args.tiles:
                tile = {**shipped(d, causal), **override}
                tile = {k: v for k, v in tile.items() if v is not None}
                ah.bwd_tiles = lambda _d, _c, t=tile: t
                clear_launch_plans()
                before = set(_compiled())
                try:
                    tile_grad = fn()[0].float()
                    row["us"][f"gluon {label}"] = common.kernel_ms(fn) * 1e3
                    row[f"stats {label}"] = kernel_stats(before)
                    row[f"diff {label}"] = (
                        (tile_grad - gluon_grad).abs().max() / gluon_grad.abs().max()
                    ).item()
                except Exception as e:  # a tile that cannot compile: recorded, not fatal
                    row["us"][f"gluon {label}"] = float("nan")
                    row[f"stats {label}"] = f"{type(e).__name__}: {str(e)[:120]}"
                ah.bwd_tiles = shipped
                clear_launch_plans()
            if d in ws.HEAD_DIMS:
                row["max |gluon ws - gluon| / max |gluon|"] = (
                    (ws_grad - gluon_grad).abs().max() / gluon_grad.abs().max()
                ).item()
            ah.ENABLED = False
            triton_grad = fn()[0].float()
            row["us"]["triton"] = common.kernel_ms(fn) * 1e3
            ah.ENABLED = ws.ENABLED = True
            row["max |gluon - triton| / max |triton|"] = (
                (gluon_grad - triton_grad).abs().max() / triton_grad.abs().max()
            ).item()
            row["us"]["cuDNN"] = common.kernel_ms(cudnn_attention(b, n, h, 0.0, d, causal)[1]) * 1e3
            row["us"]["FA2"] = (
                common.kernel_ms(cudnn_attention(b, n, h, 0.0, d, causal, FLASH)[1]) * 1e3
            )
            flops = 4 * b * h * n * n * d * 2.5 / (2 if causal else 1)
            row["gluon TFLOP/s"] = flops / row["us"]["gluon"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_gluon.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    names = list(dict.fromkeys(k for r in rows for k in r["us"]))
    lines = [f"# Attention backward: the Gluon kernel for Hopper ({env})", ""]
    lines += [
        "µs per backward (kernel time, L2 flushed), packed qkv bf16 (SDPA: separate q, k, v),"
    ]
    lines += ["dropout 0; `triton`: the Triton kernels' backward (single pass causal, two programs"]
    lines += ["otherwise); gluon / cuDNN > 1 means slower.", ""]
    lines.append(
        "| preset | causal | default kernel | "
        + " | ".join(names)
        + " | gluon / cuDNN | gluon TFLOP/s | gluon kernel | max rel diff |"
    )
    lines.append("|---|---|---|" + "---|" * (len(names) + 4))
    for r in rows:
        cells = [f"{r['us'].get(k, float('nan')):.1f}" for k in names]
        lines.append(
            f"| {r['preset']} | {r['causal']} | {r['default']} | " + " | ".join(cells)
            + f" | {r['us']['gluon'] / r['us']['cuDNN']:.2f} | {r['gluon TFLOP/s']:.0f}"
            + f" | {r['gluon stats']} | {r['max |gluon - triton| / max |triton|']:.1e} |"
        )  # fmt: skip
    if args.tiles:
        lines += ["", "Other tiles: kernel, largest difference of d(qkv) from the shipped tiles' "
                  "(relative to its largest entry):", ""]  # fmt: skip
        for r in rows:
            for label, _ in args.tiles:
                lines.append(
                    f"- {r['preset']} causal={r['causal']} {label}: {r[f'stats {label}']}, "
                    f"diff {r.get(f'diff {label}', float('nan')):.1e}"
                )
    (out / "attention_gluon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
