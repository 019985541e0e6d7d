"""End-to-end training steps: tokens/s, peak memory, GPU-busy fraction and MFU, side by side.

One optimizer step = forward + backward of a (batch, seq) batch of random bytes, global
grad-norm clipping and a fused AdamW update, under bf16 autocast. Providers:

- `torch` / `triton`: this project's Transformer with PyTorch ops / the Triton kernels, each
  - `eager`: a plain Python step;
  - `graph`: the same step captured whole in one CUDA graph (`triton_transformer.cuda_graph`);
  - `compile`: the model under `torch.compile` (default mode), step run eagerly;
  - `compile-ro`: the model under `torch.compile(mode="reduce-overhead")` (CUDA graphs by
    inductor's cudagraph trees);
  - `compile-graph`: the compiled model, whole step captured in one CUDA graph;
- `sdpa-gpt`: a minimal GPT of the same shape written with `F.scaled_dot_product_attention`
  and `nn.LayerNorm`/`nn.Linear` under `torch.compile(mode="reduce-overhead")`: the best
  PyTorch configuration we know.

GPU busy = GPU kernel time per step (torch.profiler, summed over kernels) / wall time per step.
MFU = model FLOPs per token x tokens/s / measured bf16 matmul rate (same run).

Usage: python3 benchmarks/bench_step.py --out DIR [--preset small|large] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer import AutoregressiveWrapper, Transformer
from triton_transformer.cuda_graph import GraphedStep

PRESETS = {
    # the model of issue #7/#9: d512, depth 8, seq 512, batch 16
    "small": dict(dim=512, depth=8, heads=8, dim_head=64, seq=512, batch=16),
    "large": dict(dim=1024, depth=12, heads=16, dim_head=64, seq=2048, batch=8),
}


class SdpaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.ff_in = nn.Linear(dim, 4 * dim, bias=False)
        self.ff_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        h = F.relu(self.ff_in(self.ln2(x)))
        return x + self.ff_out(F.dropout(h * h, p, self.training))


class SdpaGPT(nn.Module):
    """nanoGPT-style reference of the same shape (learned positions, pre-norm, relu²)."""

    def __init__(self, dim: int, depth: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(SdpaBlock(dim, heads, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(dim, bias=False)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1).float(), y.flatten())


def flops_per_token(p: dict) -> float:
    """6 x (non-embedding matmul params) + causal attention (6 * L * seq * d, half of 12)."""
    d, L, seq = p["dim"], p["depth"], p["seq"]
    matmul_params = L * (3 * d * d + d * d + 8 * d * d) + d * 256
    return 6 * matmul_params + 6 * L * seq * d


def build(provider: str, mode: str, p: dict, dropout: float) -> nn.Module:
    if provider == "sdpa-gpt":
        model = SdpaGPT(p["dim"], p["depth"], p["heads"], p["seq"], dropout)
    else:
        model = AutoregressiveWrapper(
            Transformer(
                num_tokens=256, dim=p["dim"], depth=p["depth"], heads=p["heads"],
                dim_head=p["dim_head"], max_seq_len=p["seq"], causal=True,
                attn_dropout=dropout, ff_dropout=dropout, use_triton=provider == "triton",
                check_token_ids=False,
            )
        )  # fmt: skip
    model = model.cuda().train()
    if mode.startswith("compile"):
        kwargs = {"mode": "reduce-overhead"} if mode == "compile-ro" else {}
        model = torch.compile(model, **kwargs)
    return model


def make_step(model: nn.Module, batch: torch.Tensor):
    params = [q for q in model.parameters() if q.requires_grad]
    lr = torch.tensor(3e-4, device="cuda")
    opt = torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        return loss.detach(), norm

    return step


def measure(provider: str, mode: str, p: dict, dropout: float, steps: int) -> dict:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(provider, mode, p, dropout)
    batch = torch.randint(0, 256, (p["batch"], p["seq"] + 1), device="cuda")
    step = make_step(model, batch)
    if mode in ("graph", "compile-graph"):
        step = GraphedStep(step, warmup_steps=3)
    for _ in range(5 if mode.startswith("compile") else 4):  # compile / capture / autotune
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss, _ = step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    gpu_ms, kernels = common.gpu_time_per_step(step)
    tokens = p["batch"] * p["seq"]
    tok_s = tokens / wall_ms * 1e3
    return {
        "provider": provider,
        "mode": mode,
        "dropout": dropout,
        "tokens/s": tok_s,
        "ms/step": wall_ms,
        "gpu ms/step": gpu_ms,
        "gpu busy": min(1.0, gpu_ms / wall_ms),
        "peak MiB": torch.cuda.max_memory_allocated() / 2**20,
        "MFU": flops_per_token(p) * tok_s / (common.ceilings()["bf16_tflops"] * 1e12),
        "loss": float(loss),
        "kernels": kernels,
    }


CASES = [
    ("torch", "eager"),
    ("torch", "graph"),
    ("torch", "compile"),
    ("torch", "compile-ro"),
    ("triton", "eager"),
    ("triton", "graph"),
    ("triton", "compile"),
    ("triton", "compile-ro"),
    ("triton", "compile-graph"),
    ("sdpa-gpt", "compile-ro"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--preset", choices=list(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--cases", nargs="*", help="provider:mode pairs (default: all)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per case")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    cases = [tuple(c.split(":")) for c in args.cases] if args.cases else CASES
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dropout in args.dropout:
        for provider, mode in cases:
            try:
                row = measure(provider, mode, p, dropout, args.steps)
            except Exception as e:  # one failing configuration must not hide the others
                row = {
                    "provider": provider,
                    "mode": mode,
                    "dropout": dropout,
                    "error": repr(e)[:300],
                }
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            torch._dynamo.reset()
    ceil = common.ceilings()
    (out / f"step_{args.preset}.json").write_text(
        json.dumps(
            {"env": common.env_info(), "preset": p, "ceilings": ceil, "rows": rows}, indent=1
        )
    )
    keys = ["provider", "mode", "dropout", "tokens/s", "ms/step", "gpu ms/step", "gpu busy",
            "peak MiB", "MFU", "loss"]  # fmt: skip
    env = common.env_info()
    lines = [
        f"# Training step, preset {args.preset}: {p}",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
        f"bf16 autocast, fused AdamW; measured bf16 peak {ceil['bf16_tflops']:.0f} TFLOP/s. "
        "ratio = tokens/s over sdpa-gpt (compile, reduce-overhead) at the same dropout.",
        "",
        "| " + " | ".join([*keys, "ratio"]) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for r in rows:
        ref = [q["tokens/s"] for q in rows if q["provider"] == "sdpa-gpt" and "tokens/s" in q
               and q["dropout"] == r["dropout"]]  # fmt: skip
        ratio = r["tokens/s"] / ref[0] if ref and "tokens/s" in r else math.nan
        cells = [common._fmt(r.get(k, r.get("error", ""))) for k in keys]
        lines.append("| " + " | ".join([*cells, f"{ratio:.2f}"]) + " |")
    md = "\n".join(lines) + "\n"
    (out / f"step_{args.preset}.md").write_text(md)
    print(md)
    (out / f"step_{args.preset}_kernels.md").write_text(common.kernel_tables(rows, args.top))


if __name__ == "__main__":
    main()
