"""Probe: the Hopper TMA matmul's tuning configurations on the feed-forward's fused products,
each configuration timed alone, against cuBLAS.

The relu² feed-forward runs two products with an epilogue in our persistent TMA kernel at every
preset: the forward h = relu(x @ W_inᵀ)² and the backward's d(pre) = (dy @ W_out) · 2·relu(pre)
(`mlp.py`). The autotuner keeps only its pick; this times every configuration of
`matmul_kernels._tma_configs()` on both products at the enwik8, GPT-2 and large presets' shapes
(kernel time, L2 flushed), checks each one's output against torch, and reports them next to
cuBLAS's product alone and cuBLAS's product plus our elementwise pass ("cublas+ew", the
planner's alternative).

    python3 benchmarks/probe_mm_epilogue_tiles.py --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer import matmul_kernels as kernels
from triton_transformer import matmul_plan as plan

SHAPES = {"enwik8": (8192, 512, 2048), "gpt2": (16384, 768, 3072), "large": (16384, 1024, 4096)}


def feed_forward_tensors(M: int, D: int, H: int) -> dict:
    """One feed-forward's operands (bf16) and its fp32 references: x, w_in (H, D), dy, w_out
    (D, H), h = relu(x @ w_inᵀ)² as the forward keeps it, and the two fused products' exact
    results "fwd" and "grad"."""
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w_in = torch.randn(H, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w_out = torch.randn(D, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
    pre = (x.float() @ w_in.float().t()).clamp_min(0)
    h = (pre * pre).to(torch.bfloat16)
    dpre = (dy.float() @ w_out.float()) * 2 * h.float().sqrt()
    return dict(x=x, w_in=w_in, dy=dy, w_out=w_out, h=h, fwd=pre * pre, grad=dpre)


def problems(M: int, D: int, H: int) -> dict:
    """name -> (call(c), reference): the two fused products of one feed-forward."""
    t = feed_forward_tensors(M, D, H)
    x, w_in, dy, w_out, h = t["x"], t["w_in"], t["dy"], t["w_out"], t["h"]
    return {
        "relu2 fwd": (lambda c: plan._mm2d_into(x, w_in.t(), c, relu_squared=True), t["fwd"]),
        "relu2 grad": (lambda c: plan._mm2d_into(dy, w_out, c, grad=(h, True)), t["grad"]),
        "_mm": (lambda: torch.mm(x, w_in.t()), None),
    }


def run_on(path: str | None, configs: list | None, call, c) -> None:
    """One call of `call` into c, on the given planner path and TMA configurations."""
    saved = plan._FORCE_PATH, kernels._mm_tma_tuned.configs
    plan._FORCE_PATH = path
    if configs is not None:
        kernels._mm_tma_tuned.configs = configs
        kernels._mm_tma_tuned.cache.clear()
        plan._TUNED.clear()
    try:
        call(c)
    finally:
        plan._FORCE_PATH, kernels._mm_tma_tuned.configs = saved


def measure(call, ref: torch.Tensor, c: torch.Tensor, path, configs) -> dict:
    try:
        run_on(path, configs, call, c)
        err = ((c.float() - ref).norm() / ref.norm()).item()
        ms = common.kernel_ms(lambda: run_on(path, None, call, c))
        return dict(us=ms * 1e3, rel_err=err, error=None)
    except Exception as e:  # a configuration that fails to compile or launch is reported
        return dict(us=None, rel_err=None, error=f"{type(e).__name__}: {str(e)[:160]}")


def main() -> None:
    _, out = common.parse_out(__doc__)
    env = common.env_info()
    configs = kernels._tma_configs()
    rows = []
    for preset, (M, D, H) in SHAPES.items():
        probs = problems(M, D, H)
        flops = 2 * M * D * H
        mm_us = common.kernel_ms(probs.pop("_mm")[0]) * 1e3
        for name, (call, ref) in probs.items():
            c = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
            base = dict(preset=preset, problem=name, M=M, K=D, N=H, cublas_mm_us=mm_us)
            r = measure(call, ref, c, "cublas+ew", None)
            rows.append(dict(base, config="cublas+ew", **r))
            for cfg in configs:
                r = measure(call, ref, c, "tma", [cfg])
                label = f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"
                rows.append(dict(base, config=label, **r))
            for r in rows[-len(configs) - 1 :]:
                r["tflops"] = flops / (r["us"] * 1e-6) / 1e12 if r["us"] else None
                print(r, flush=True)
    (out / "mm_epilogue_tiles.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# TMA matmul configurations on the fused feed-forward products ({env})", ""]
    lines += ["kernel µs (L2 flushed); cuBLAS mm: the plain product alone", ""]
    for preset in SHAPES:
        for name in ("relu2 fwd", "relu2 grad"):
            mine = [r for r in rows if (r["preset"], r["problem"]) == (preset, name)]
            ok = sorted((r for r in mine if r["us"]), key=lambda r: r["us"])
            lines += [f"## {preset} {name} (cuBLAS mm alone {mine[0]['cublas_mm_us']:.1f} µs)", ""]
            lines += ["| config | µs | TFLOP/s | rel err |", "|---|---|---|---|"]
            for r in ok:
                lines.append(
                    f"| {r['config']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['rel_err']:.1e} |"
                )
            bad = [(r["config"], r["error"]) for r in mine if not r["us"]]
            lines += ["", f"failed: {bad}", ""]
    (out / "mm_epilogue_tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
