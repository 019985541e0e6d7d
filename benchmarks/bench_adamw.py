"""The optimizer step of a training step: global grad-norm clip + AdamW over a model's
parameters, ours against torch's fused AdamW (+ `clip_grad_norm_`) and torch.compile's.

The parameters are those of `Transformer` at a `bench_step.py` preset (fp32, nanoGPT's two
groups: matrices and embeddings decayed, norm weights not), with fixed random gradients.
Bytes per parameter: the clip reads the gradient (4), the update reads p, g, m, v (16) and
writes p, m, v (12): 32 in all, 28 without the clip; GB/s is against the copy ceiling
measured in the same run. Providers:

- `ours`: `adamw.AdamW.clip_grad_norm` + `step` (one norm launch and one update launch per
  group, the clip factor read on the device);
- `torch-fused`: `clip_grad_norm_(foreach=True)` + `torch.optim.AdamW(fused=True,
  capturable=True)`, what the trainer ran before;
- `compile`: the same clip and a foreach, capturable AdamW step under `torch.compile`
  (PyTorch's "compiling the optimizer" recipe).

Each also without the clip (`... no clip`). Times: GPU kernel time per step (torch.profiler,
L2 flushed) and the host's wall time per step in a synchronised loop. `--sweep` times our
update kernel over BLOCK x NUM_WARPS.

Usage: python3 benchmarks/bench_adamw.py --out DIR [--presets enwik8 gpt2 large]
           [--sweep] [--no-compile]
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
from bench_step import PRESETS

from triton_transformer import Transformer
from triton_transformer import adamw as adamw_module
from triton_transformer.adamw import AdamW


def preset_params(name: str) -> list[torch.nn.Parameter]:
    """The fp32 parameters of the preset's Transformer, each with a random gradient."""
    p = PRESETS[name]
    model = Transformer(
        num_tokens=p["vocab"], dim=p["dim"], depth=p["depth"], heads=p["heads"],
        dim_head=p["dim_head"], max_seq_len=p["seq"], causal=True,
    ).cuda()  # fmt: skip
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    return params


def groups(params):
    return [
        {"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
        {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0},
    ]


def providers(params, compile_too: bool) -> dict:
    """name -> step function (each with its own optimizer state)."""
    lr = lambda: torch.tensor(3e-4, device="cuda")
    ours = AdamW(groups(params), lr=lr(), betas=(0.9, 0.95), use_triton=True)
    fused = torch.optim.AdamW(groups(params), lr=lr(), betas=(0.9, 0.95), fused=True,
                              capturable=True)  # fmt: skip
    out = {
        "ours": lambda: (ours.clip_grad_norm(1.0), ours.step()),
        "ours no clip": ours.step,
        "torch-fused": lambda: (
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True),
            fused.step(),
        ),
        "torch-fused no clip": fused.step,
    }
    if compile_too:
        foreach = torch.optim.AdamW(groups(params), lr=lr(), betas=(0.9, 0.95), foreach=True,
                                    capturable=True)  # fmt: skip

        @torch.compile(fullgraph=False)
        def compiled_step():
            foreach.step()

        @torch.compile(fullgraph=False)
        def compiled_clip_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            foreach.step()

        out["compile"] = compiled_clip_step
        out["compile no clip"] = compiled_step
    return out


def bench(presets, compile_too: bool) -> list[dict]:
    ceil = common.ceilings()
    rows = []
    for name in presets:
        params = preset_params(name)
        n = sum(q.numel() for q in params)
        for provider, fn in providers(params, compile_too and name != "large").items():
            try:
                for _ in range(3):  # state creation, compilation
                    fn()
                ms = common.kernel_ms(fn)
                host = common.wall_us(fn)
            except Exception as e:  # one provider failing must not hide the others
                print(f"{name} {provider}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            nbytes = n * (28 if provider.endswith("no clip") else 32)
            gbps = nbytes / ms / 1e6
            row = {
                "preset": name, "params (M)": n / 1e6, "provider": provider, "ms": ms,
                "wall_us": host, "GB/s": gbps, "frac": gbps / ceil["copy_gbps"],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del params
        torch.cuda.empty_cache()
    return rows


def sweep(presets) -> list[dict]:
    """Our update kernel alone (no clip) over BLOCK x NUM_WARPS."""
    ceil = common.ceilings()
    rows = []
    saved = adamw_module.BLOCK, adamw_module.NUM_WARPS
    for name in presets:
        params = preset_params(name)
        n = sum(q.numel() for q in params)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                adamw_module.BLOCK, adamw_module.NUM_WARPS = block, warps
                opt = AdamW(groups(params), lr=torch.tensor(3e-4, device="cuda"),
                            use_triton=True)  # fmt: skip
                opt.step()
                ms = common.kernel_ms(opt.step)
                gbps = n * 28 / ms / 1e6
                row = {"preset": name, "BLOCK": block, "NUM_WARPS": warps, "ms": ms,
                       "GB/s": gbps, "frac": gbps / ceil["copy_gbps"]}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        del params
        torch.cuda.empty_cache()
    adamw_module.BLOCK, adamw_module.NUM_WARPS = saved
    return rows


def table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(common._fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--presets", nargs="+", default=["enwik8", "gpt2", "large"],
                    choices=list(PRESETS))  # fmt: skip
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env, ceil = common.env_info(), common.ceilings()
    head = (
        f"# Optimizer step (clip + AdamW), fp32 parameters of the presets\n\n{env['device']}, "
        f"torch {env['torch']}, triton {env['triton']}, {env['date']}; copy ceiling "
        f"{ceil['copy_gbps']:.0f} GB/s; ms = kernel time (L2 flushed), wall_us = host.\n\n"
    )
    rows = bench(args.presets, not args.no_compile)
    md = head + table(rows, ["preset", "params (M)", "provider", "ms", "wall_us", "GB/s", "frac"])
    result = {"env": env, "ceilings": ceil, "rows": rows}
    if args.sweep:
        sweep_rows = sweep(args.presets)
        md += "\n## Our update kernel (no clip) by BLOCK x NUM_WARPS\n\n" + table(
            sweep_rows, ["preset", "BLOCK", "NUM_WARPS", "ms", "GB/s", "frac"]
        )
        result["sweep"] = sweep_rows
    (out / "adamw.md").write_text(md)
    (out / "adamw.json").write_text(json.dumps(result, indent=1))
    print(md)


if __name__ == "__main__":
    main()
