"""End-to-end training steps: tokens/s, peak memory, GPU-busy fraction and MFU, side by side.

One optimizer step = forward + backward of a (batch, seq) batch of random bytes, global
grad-norm clipping and an AdamW update (torch's fused one; the package's `adamw.AdamW` for
the Triton model, see --optimizer), under bf16 autocast. Providers:

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
MFU = model FLOPs per token x tokens/s / measured bf16 matmul rate (same run); FLOPs per token
as nanoGPT counts them (`flops_per_token`).

Presets (`PRESETS`): small (alias enwik8: d512, depth 8, seq 512, batch 16, bytes), gpt2
(GPT-2 small's shape: d768, depth 12, 12 heads, seq 1024, batch 16, vocab 50,304), large
(d1024, depth 12, seq 2048, batch 8, bytes) and large-d128 (the same with 8 heads of 128).
Random tokens from the preset's vocabulary.

`--optimizer auto|torch|both`: the Triton model's optimizer step, the package's AdamW (clip
folded into its launch; "auto", the default, as `capturable_train_step` picks by `use_triton`)
or torch's fused AdamW + `clip_grad_norm_` ("torch"); "both" measures each Triton case twice.
The other providers always run torch's.

`--fused-loss on|off|both` (where `Transformer` has `fused_loss`): the Triton model's loss as
the fused output projection + cross entropy in chunks, or logits then cross entropy; "both"
measures each Triton case twice. Default: the model's own default.

Besides the table of steps (step_<preset>.md) and each case's longest kernels
(step_<preset>_kernels.md), step_<preset>_breakdown.md groups each case's GPU time per step
by kind of kernel (`categorize`: matmul, attention forward / backward, layernorm forward /
backward, cross entropy, embedding, optimizer, elementwise and other) next to sdpa-gpt's.

Usage: python3 benchmarks/bench_step.py --out DIR [--preset small|enwik8|gpt2|large|large-d128]
           [--steps N] [--dropout P ...] [--cases provider:mode ...] [--fused-loss on|off|both]
e.g.   python3 benchmarks/bench_step.py --out DIR --preset gpt2 --dropout 0.0 \
           --cases triton:graph sdpa-gpt:compile-ro torch:compile-ro
"""

from __future__ import annotations

import argparse
import inspect
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
from triton_transformer.cuda_graph import GraphedStep, capturable_train_step

PRESETS = {
    # the model of issue #7/#9 (enwik8, bytes): d512, depth 8, seq 512, batch 16
    "small": dict(dim=512, depth=8, heads=8, dim_head=64, seq=512, batch=16, vocab=256),
    # GPT-2 small's shape (nanoGPT's vocabulary, 50,257 padded to a multiple of 64)
    "gpt2": dict(dim=768, depth=12, heads=12, dim_head=64, seq=1024, batch=16, vocab=50304),
    "large": dict(dim=1024, depth=12, heads=16, dim_head=64, seq=2048, batch=8, vocab=256),
    # large with 128-wide heads (Llama's), where the attention kernels differ most from d64's
    "large-d128": dict(dim=1024, depth=12, heads=8, dim_head=128, seq=2048, batch=8, vocab=256),
}
PRESETS["enwik8"] = PRESETS["small"]  # the same model, by its data set's name


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

    def __init__(
        self, dim: int, depth: int, heads: int, seq: int, vocab: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(SdpaBlock(dim, heads, dropout) for _ in range(depth))
        self.ln = nn.LayerNorm(dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return F.cross_entropy(self.head(self.ln(h)).flatten(0, 1).float(), y.flatten())


def flops_per_token(p: dict) -> float:
    """Training FLOPs per token, as nanoGPT estimates them: 6 x the matmul parameters outside
    the embeddings (qkv, out, the feed-forward's two at 4x width, and the output projection
    d x vocab) + causal attention, 6 · depth · seq · (heads · dim_head): QK^T and AV are
    12 · depth · seq · inner forward and backward, half of it under the causal mask."""
    d, L, seq, vocab = p["dim"], p["depth"], p["seq"], p["vocab"]
    inner = p["heads"] * p["dim_head"]
    per_layer = 3 * d * inner + inner * d + 2 * 4 * d * d
    return 6 * (L * per_layer + d * vocab) + 6 * L * seq * inner


def has_fused_loss() -> bool:
    """Whether this checkout's `Transformer` takes `fused_loss` (the chunked output
    projection + cross entropy)."""
    return "fused_loss" in inspect.signature(Transformer.__init__).parameters


# Transformer options of each block (`--block`): today's classic block, or the Llama-style one
# (rotary positions, RMSNorm, SwiGLU, grouped-query attention with 4 query heads per k/v head).
BLOCKS = {
    "classic": {},
    "llama": dict(pos_emb="rope", norm="rmsnorm", ff_act="swiglu", kv_heads_divisor=4),
}


def block_options(block: str, p: dict) -> dict:
    """The Transformer's keyword arguments of `block` (`BLOCKS`) at preset `p`."""
    options = dict(BLOCKS[block])
    if "kv_heads_divisor" in options:
        options["kv_heads"] = p["heads"] // options.pop("kv_heads_divisor")
    return options


def build(
    provider: str,
    mode: str,
    p: dict,
    dropout: float,
    fused_loss: bool | None = None,
    block: str = "classic",
) -> nn.Module:
    """The model of a case, on the GPU in training mode, compiled for the compile modes.
    fused_loss: passed to `Transformer` when not None (see `has_fused_loss`). block: a key of
    `BLOCKS` (the SDPA GPT has the classic block only)."""
    if provider == "sdpa-gpt" and block != "classic":
        raise ValueError("the SDPA GPT has the classic block only")
    options = block_options(block, p)
    if provider == "sdpa-gpt":
        model = SdpaGPT(p["dim"], p["depth"], p["heads"], p["seq"], p["vocab"], dropout)
    else:
        extra = {} if fused_loss is None else {"fused_loss": fused_loss}
        model = AutoregressiveWrapper(
            Transformer(
                num_tokens=p["vocab"], dim=p["dim"], depth=p["depth"], heads=p["heads"],
                dim_head=p["dim_head"], max_seq_len=p["seq"], causal=True,
                attn_dropout=dropout, ff_dropout=dropout, use_triton=provider == "triton",
                check_token_ids=False, **extra, **options,
            )
        )  # fmt: skip
    model = model.cuda().train()
    if mode.startswith("compile"):
        kwargs = {"mode": "reduce-overhead"} if mode == "compile-ro" else {}
        model = torch.compile(model, **kwargs)
    return model


def measure(
    provider: str,
    mode: str,
    p: dict,
    dropout: float,
    steps: int,
    fused_loss: bool | None = None,
    block: str = "classic",
    torch_optimizer: bool = False,
) -> dict:
    """One case: tokens/s, wall and GPU time per step, peak memory, MFU, and its kernels.
    torch_optimizer: torch's fused AdamW even for the Triton model."""
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(provider, mode, p, dropout, fused_loss, block)
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = capturable_train_step(
        model, batch, lr=3e-4, triton_optimizer=provider == "triton" and not torch_optimizer
    )
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
        "fused loss": fused_loss_of(model, provider),
        "optimizer": optimizer_label(provider, torch_optimizer),
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


# Kinds of kernels, in the breakdown's order. `categorize` maps a profiler kernel name to one.
CATEGORIES = (
    "matmul",
    "attention fwd",
    "attention bwd",
    "layernorm fwd",
    "layernorm bwd",
    "cross-entropy",
    "embedding",
    "optimizer",
    "elementwise/other",
)
# (category, name fragments), tried in order on the lower-cased name; the first hit wins.
# Attention comes before matmul (cuDNN's and FlashAttention's names hold "sm90", "cutlass"),
# and the optimizer before layernorm (the grad-norm clip's "LpNorm" is not a layer norm).
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # fused AdamW and the foreach grad-norm clip: multi_tensor_apply kernels, lpnorm_cleanup;
    # ours: _adamw_kernel, _grad_sq_sum_kernel
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lpnorm", "_grad_sq_sum")),
    # ours (_attention_fwd/_bwd/_dq/_delta/_combine kernels); PyTorch's SDPA: FlashAttention
    # (flash_fwd/bwd), cuDNN (cudnn_generated_..._sdpa_..._fprop/bprop), mem-efficient (fmha)
    ("attention", ("_attn_", "flash", "fmha", "cudnn", "sdpa", "_attention")),
    # ours (_layernorm_fwd/_bwd/_rowsum/_cols/_colsum; older profiles _ln_*); PyTorch's
    # layer_norm kernels and inductor's
    # fused native_layer_norm(_backward) ones
    ("layernorm", ("_ln_", "_colsum", "layer_norm", "layernorm", "gammabeta", "rowwisemoments")),
    # ours (_cross_entropy_*, the Gluon _ce_inplace_sm90_kernel); PyTorch's log_softmax +
    # nll_loss (cunn_SoftMax*) and inductor's
    ("cross-entropy", ("cross_entropy", "_ce_inplace", "log_softmax", "nll_loss", "cunn_softmax")),
    # ours (_embedding_*); PyTorch's index_select forward and embedding_dense_backward (which
    # sorts the ids and sums segments)
    ("embedding", ("embedding", "index_select", "indexselect", "compute_grad_weight",
                   "sum_and_scatter", "partial_segment", "segment_offsets", "radixsort")),
    # ours (_mm_tma/_mm_ptr kernels and the split-K sum); inductor's mm templates; cuBLAS and
    # cuBLASLt kernels (sm90_xmma_gemm_*, nvjet_*, cutlass_*, gemv*, splitKreduce_kernel)
    ("matmul", ("_mm_tma", "_mm_ptr", "_splitk_reduce", "triton_tem_", "gemm", "gemv", "nvjet",
                "cutlass", "xmma", "sm90_", "sm80_", "splitkreduce", "cublas")),
)  # fmt: skip
_BACKWARD = ("bwd", "backward", "bprop", "grad", "cutlassb", "dot_do_o", "convert_dq",
             "gammabeta", "_colsum", "_rowsum", "_cols_")  # fmt: skip


def categorize(kernel: str) -> str:
    """The kind of a profiler kernel name, one of `CATEGORIES`: ours (Triton kernels keep their
    function names: _mm_tma_kernel, _attention_bwd_kernel, ...), PyTorch's and cuBLAS's, and
    inductor's (triton_poi_/triton_red_/triton_per_fused_<ops>, triton_tem_ for templates).
    Attention and layernorm split into forward and backward by the name."""
    k = kernel.lower()
    for category, fragments in _RULES:
        if any(f in k for f in fragments):
            if category in ("attention", "layernorm"):
                return f"{category} {'bwd' if any(b in k for b in _BACKWARD) else 'fwd'}"
            return category
    return "elementwise/other"  # casts, copies, fills, dropout, inductor's pointwise fusions


def breakdown(kernels: list[dict]) -> dict[str, float]:
    """GPU ms per step of each category (`categorize`) of a case's kernels."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    for k in kernels:
        ms[categorize(k["kernel"])] += k["us/step"] / 1e3
    return ms


def breakdown_tables(rows: list[dict]) -> str:
    """Markdown: per case, GPU ms per step by category next to sdpa-gpt's (same dropout)."""
    lines = [
        "# GPU time per step by kind of kernel (torch.profiler; `categorize`)",
        "",
        "ratio = ours / sdpa-gpt (> 1: ours takes longer).",
        "",
    ]
    for r in rows:
        if "kernels" not in r or r["provider"] == "sdpa-gpt":
            continue
        ref = next((q for q in rows if q["provider"] == "sdpa-gpt" and "kernels" in q
                    and q["dropout"] == r["dropout"]), None)  # fmt: skip
        ours = breakdown(r["kernels"])
        theirs = breakdown(ref["kernels"]) if ref else {}
        title = f"{r['provider']} {r['mode']}, dropout {r['dropout']}"
        if r.get("fused loss", "-") != "-":
            title += f", fused loss {r['fused loss']}"
        if r["provider"] == "triton":
            title += f", optimizer {r.get('optimizer', 'torch')}"
        other = f"sdpa-gpt {ref['mode']}" if ref else "sdpa-gpt (not measured)"
        lines += [f"## {title} vs {other}", "", "| category | ours ms | sdpa-gpt ms | ratio |",
                  "|---|---|---|---|"]  # fmt: skip
        for cat in (*CATEGORIES, "total"):
            a = sum(ours.values()) if cat == "total" else ours[cat]
            b = sum(theirs.values()) if cat == "total" and theirs else theirs.get(cat)
            if not a and not b:
                continue
            ratio = f"{a / b:.2f}" if b else "-"
            cells = [cat, f"{a:.3f}", "-" if b is None else f"{b:.3f}", ratio]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def fused_label(fused_loss: bool | None) -> str:
    """A row's "fused loss" cell: "on", "off", or "-" (not applicable, or unknown)."""
    return "-" if fused_loss is None else ("on" if fused_loss else "off")


def fused_loss_of(model: nn.Module, provider: str) -> str:
    """The "fused loss" cell of a built case: the Triton Transformer's `fused_loss` as it ran
    (its default when --fused-loss is not given), "-" for the others (the PyTorch path and
    sdpa-gpt materialise the logits) or a Transformer without the option."""
    net = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    net = getattr(net, "net", net)  # AutoregressiveWrapper's Transformer
    fused = getattr(net, "fused_loss", None)
    return fused_label(None if provider != "triton" else fused)


def optimizer_label(provider: str, torch_optimizer: bool) -> str:
    return "ours" if provider == "triton" and not torch_optimizer else "torch"


def optimizer_settings(arg: str, provider: str) -> list[bool]:
    """The torch_optimizer values to measure a provider with, for --optimizer."""
    if provider != "triton" or arg == "auto":
        return [False]
    return [True] if arg == "torch" else [False, True]


def fused_settings(arg: str | None, provider: str) -> list[bool | None]:
    """The fused_loss values a case runs with: `--fused-loss` applies to the Triton
    Transformer only (the PyTorch path never fuses the loss), and only where it exists."""
    if arg is None or provider != "triton" or not has_fused_loss():
        return [None]
    return {"on": [True], "off": [False], "both": [True, False]}[arg]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--preset", choices=list(PRESETS), default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--cases", nargs="*", help="provider:mode pairs (default: all)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per case")
    ap.add_argument("--fused-loss", choices=("on", "off", "both"), default=None,
                    help="the Triton model's fused_loss (default: the model's own)")  # fmt: skip
    ap.add_argument("--optimizer", choices=("auto", "torch", "both"), default="auto",
                    help="the Triton model's optimizer (auto: the package's AdamW)")  # fmt: skip
    ap.add_argument("--loss-chunk-rows", type=int, default=None,
                    help="rows per chunk of the fused loss (default: the module's)")  # fmt: skip
    ap.add_argument("--block", choices=list(BLOCKS), default="classic",
                    help="the Transformer's block (llama: rope, RMSNorm, SwiGLU, GQA)")  # fmt: skip
    args = ap.parse_args()
    if args.loss_chunk_rows:
        from triton_transformer import linear_cross_entropy

        linear_cross_entropy.CHUNK_BYTES = args.loss_chunk_rows * PRESETS[args.preset]["vocab"] * 2
    if args.fused_loss is not None and not has_fused_loss():
        print("--fused-loss ignored: this Transformer has no fused_loss", flush=True)
    p = PRESETS[args.preset]
    cases = [tuple(c.split(":")) for c in args.cases] if args.cases else CASES
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.preset if args.block == "classic" else f"{args.preset}_{args.block}"
    rows = []
    for dropout in args.dropout:
        for provider, mode in cases:
            for fused in fused_settings(args.fused_loss, provider):
                for torch_opt in optimizer_settings(args.optimizer, provider):
                    try:
                        row = measure(
                            provider, mode, p, dropout, args.steps, fused, args.block, torch_opt
                        )
                    except Exception as e:  # one failing configuration must not hide others
                        row = {
                            "provider": provider,
                            "mode": mode,
                            "dropout": dropout,
                            "fused loss": fused_label(fused),
                            "optimizer": optimizer_label(provider, torch_opt),
                            "error": repr(e)[:300],
                        }
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
                    torch._dynamo.reset()
    for r in rows:
        if "kernels" in r:
            r["breakdown ms"] = breakdown(r["kernels"])
    ceil = common.ceilings()
    (out / f"step_{name}.json").write_text(
        json.dumps(
            {"env": common.env_info(), "preset": p, "ceilings": ceil, "rows": rows}, indent=1
        )
    )
    keys = ["provider", "mode", "dropout", "fused loss", "optimizer", "tokens/s", "ms/step",
            "gpu ms/step", "gpu busy", "peak MiB", "MFU", "loss"]  # fmt: skip
    env = common.env_info()
    lines = [
        f"# Training step, preset {args.preset}, {args.block} block: {p}",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
        "bf16 autocast; optimizer: torch's fused AdamW or ours (column); "
        f"measured bf16 peak {ceil['bf16_tflops']:.0f} TFLOP/s; "
        f"{flops_per_token(p) / 1e9:.2f} GFLOP per token (`flops_per_token`). "
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
    (out / f"step_{name}.md").write_text(md)
    print(md)
    (out / f"step_{name}_kernels.md").write_text(common.kernel_tables(rows, args.top))
    tables = breakdown_tables(rows)
    (out / f"step_{name}_breakdown.md").write_text(tables)
    print(tables)


if __name__ == "__main__":
    main()
