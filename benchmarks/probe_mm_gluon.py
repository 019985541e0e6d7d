"""Probe: the relu² feed-forward's fused products in Gluon (`matmul_hopper`) against the Triton
TMA kernel, cuBLAS's product plus our elementwise pass, and cuBLAS's product alone, at the
enwik8, GPT-2 and large presets' shapes. Kernel time (`common.kernel_ms`, L2 flushed), TFLOP/s,
and each output's error against an fp32 reference.

    python3 benchmarks/probe_mm_gluon.py --out DIR [--tiles BM,BN,BK,STAGES ...]

The products: the forward h = relu(x @ W_inᵀ)² ("relu2 fwd", W_in read transposed) and the
backward's d(pre) = (dy @ W_out) · 2·√h ("relu2 grad"). --tiles times Gluon tiles besides
`matmul_hopper.TILES`. Writes DIR/mm_gluon.json and mm_gluon.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_mm_epilogue_tiles import SHAPES, feed_forward_tensors

from triton_transformer import matmul_hopper as mh
from triton_transformer import matmul_plan as plan


def _tiles(text: str) -> dict:
    """BM,BN,BK,STAGES: the tiles of one consumer warpgroup and the ring's depth."""
    bm, bn, bk, stages = (int(v) for v in text.split(","))
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages)


def _planned(path: str, call):
    """call() on the planner's forced `path` ("tma": the Triton kernel, "cublas+ew"; a forced
    path never takes the Gluon kernel)."""

    def run():
        saved = plan._FORCE_PATH
        plan._FORCE_PATH = path
        try:
            call()
        finally:
            plan._FORCE_PATH = saved

    return run


def measure(preset: str, M: int, D: int, H: int, variants: list[dict]) -> list[dict]:
    """The rows of one preset's feed-forward: every case of both products."""
    t = feed_forward_tensors(M, D, H)
    x, w_in, dy, w_out, h = t["x"], t["w_in"], t["dy"], t["w_out"], t["h"]
    c = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    products = {  # name -> (Gluon call(tiles), the planner's call, fp32 reference)
        "relu2 fwd": (
            lambda tiles: mh.launch_mm_sm90(x, w_in, c, True, "relu2", tiles=tiles),
            lambda: plan._mm2d_into(x, w_in.t(), c, relu_squared=True),
            t["fwd"],
        ),
        "relu2 grad": (
            lambda tiles: mh.launch_mm_sm90(dy, w_out, c, False, "relu2grad_from_square", h,
                                            tiles=tiles),
            lambda: plan._mm2d_into(dy, w_out, c, grad=(h, True)),
            t["grad"],
        ),
    }  # fmt: skip
    mm_us = common.kernel_ms(lambda: torch.mm(x, w_in.t())) * 1e3
    rows = []
    for name, (gluon_call, planned_call, ref) in products.items():
        cases = {f"gluon {tuple(v.values())}": functools.partial(gluon_call, v) for v in variants}
        cases["triton tma"] = _planned("tma", planned_call)
        cases["cublas+ew"] = _planned("cublas+ew", planned_call)
        for case, fn in cases.items():
            row = dict(preset=preset, problem=name, case=case, M=M, K=D, N=H, cublas_mm_us=mm_us)
            try:
                c.fill_(float("nan"))
                fn()
                row["rel_err"] = ((c.float() - ref).norm() / ref.norm()).item()
                row["us"] = common.kernel_ms(fn) * 1e3
                row["tflops"] = 2 * M * D * H / (row["us"] * 1e-6) / 1e12
            except Exception as e:  # reported, the others still run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiles", type=_tiles, nargs="*", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = common.env_info()
    variants = [mh.TILES] + [t for t in args.tiles if t != mh.TILES]
    rows = []
    for preset, (M, D, H) in SHAPES.items():
        rows += measure(preset, M, D, H, variants)
    (args.out / "mm_gluon.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# relu² feed-forward products: Gluon against Triton and cuBLAS ({env})", ""]
    lines += ["Kernel µs (L2 flushed); ratio = the Triton TMA kernel's µs / this case's.", ""]
    for preset in SHAPES:
        for name in ("relu2 fwd", "relu2 grad"):
            mine = [r for r in rows if (r["preset"], r["problem"]) == (preset, name)]
            triton_us = next((r.get("us") for r in mine if r["case"] == "triton tma"), None)
            mm_us = mine[0]["cublas_mm_us"]
            lines += [f"## {preset} {name} (cuBLAS mm alone {mm_us:.1f} µs)", ""]
            lines += ["| case | µs | TFLOP/s | ratio | rel err |", "|---|---|---|---|---|"]
            for r in mine:
                if "us" not in r:
                    lines.append(f"| {r['case']} | failed: {r['error']} | | | |")
                    continue
                ratio = triton_us / r["us"] if triton_us else float("nan")
                lines.append(
                    f"| {r['case']} | {r['us']:.1f} | {r['tflops']:.0f} | {ratio:.3f} "
                    f"| {r['rel_err']:.1e} |"
                )
            lines.append("")
    (args.out / "mm_gluon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
