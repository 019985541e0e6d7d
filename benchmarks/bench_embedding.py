"""Token + positional embedding benchmark: forward and backward, ours against eager and compile.

Problems (vocabulary, width, sequence, tokens): the byte-level model's 256 and 1024 at width
512, sequences of 512, 2048 and 8192 tokens (a micro-batch of the enwik8 config, and of the
d512/L8 step); the GPT-2 preset's 50,304 x 768, sequences of 1024, 16,384 tokens (the
backward's atomic scatter-add). Positional table: one row per position.

Providers: ours (`embedding(use_triton=True)`: one gather kernel; backward, the one-hot
product, or above 1024 rows the atomic scatter-add), torch (`F.embedding(ids, W) + P[:n]`) and
compile (`torch.compile` of it). Modes: fwd; bwd (`torch.autograd.grad` of a retained forward:
only the backward kernels run, fp32 tables and gradient as under autocast). GB/s counts each
provider alike: fwd reads T rows of W and P and writes T rows; bwd reads the T-row gradient and
writes dW and dP.

Usage: python3 benchmarks/bench_embedding.py --out DIR [--quick] [--no-compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F

from triton_transformer.embedding import embedding

# (vocab, dim, seq, tokens)
PROBLEMS = [(v, 512, 512, t) for v in (256, 1024) for t in (2048, 8192)]
GPT2 = (50304, 768, 1024, 16384)


def reference(ids: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Token rows plus the first n positional rows."""
    return F.embedding(ids, w) + p[: ids.shape[1]]


def providers(no_compile: bool) -> dict:
    fns = {
        # check_ids=False, as the model calls it: the kernels alone, no host sync
        "ours": lambda ids, w, p: embedding(ids, w, p, use_triton=True, check_ids=False),
        "torch": reference,
    }
    if not no_compile:
        fns["compile"] = common.compiled(reference)
    return fns


def bench(args) -> list[dict]:
    ceil = common.ceilings()
    rows = []
    problems = [(256, 512, 512, 8192)] if args.quick else PROBLEMS
    for vocab, dim, seq, tokens in [*problems, GPT2]:
        ids = torch.randint(0, vocab, (tokens // seq, seq), device="cuda")
        w = torch.randn(vocab, dim, device="cuda", requires_grad=True)
        p = torch.randn(seq, dim, device="cuda", requires_grad=True)
        g = torch.randn(tokens // seq, seq, dim, device="cuda")
        row_bytes = dim * 4
        nbytes = {
            "fwd": 3 * tokens * row_bytes,
            "bwd": (tokens + vocab + seq) * row_bytes,
        }
        for name, f in providers(args.no_compile).items():
            h = f(ids, w, p)
            calls = {
                "fwd": lambda f=f, ids=ids, w=w, p=p: f(ids, w, p),
                "bwd": lambda h=h, w=w, p=p, g=g: torch.autograd.grad(
                    h, (w, p), g, retain_graph=True
                ),
            }
            for mode, fn in calls.items():
                r = common.time_op(fn)
                gbps = nbytes[mode] / r["ms"] / 1e6
                rows.append({
                    "vocab": vocab, "tokens": tokens, "mode": mode, "provider": name,
                    "GB/s": gbps, "frac": gbps / ceil["copy_gbps"], "ms": r["ms"],
                    "wall_us": r["wall_us"],
                })  # fmt: skip
                print(f"{vocab} {tokens} {mode} {name} {r['ms'] * 1e3:.1f} us", flush=True)
    return rows


if __name__ == "__main__":
    common.run_main(
        "embedding", bench, sweep=bench, x="tokens", y="GB/s", group=("vocab", "mode"),
        title="token + positional embedding (fp32 tables; D = 512, GPT-2: 768)",
    )  # fmt: skip
