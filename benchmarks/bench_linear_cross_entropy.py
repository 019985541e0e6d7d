"""GPU benchmark of the fused output projection + cross-entropy (`linear_cross_entropy`): time,
peak memory and accuracy of a training call (forward + backward to x and the weight), ours
against the unfused Triton path, PyTorch eager, torch.compile and Liger-Kernel's
FusedLinearCrossEntropy, in one run.

    python3 benchmarks/bench_linear_cross_entropy.py --out DIR [--quick]

Providers, for x (M, K), a weight (V, K) and labels (M,), all bf16 but the labels:
  ours          `linear_cross_entropy(x, w, y, use_triton=True)`: chunks of rows, each chunk's
                logits, loss and gradient in place, then dx and dW (fp32, accumulated); or,
                where that holds no more memory (`single_chunk_lighter`), one chunk whose dW
                one product writes in bf16
  ours-unfused  `bmm.linear` then `cross_entropy(..., inplace_backward=True)`: the full logits
  torch         F.cross_entropy(F.linear(x, w), y), eager
  compile       the same through torch.compile
  liger         `LigerFusedLinearCrossEntropyFunction` with its defaults (chunks of
                next_pow2(M / ceil(V / K)) rows; dW accumulated in the weight's dtype)
  liger-fp32    the same with accum_dtype=torch.float32 (dW accumulated in fp32, as ours)

Shapes (M, K, V): GPT-2's loss (16384, 768, 50304), Llama 3.2 1B's (8192, 2048, 128256) and
Llama 3 8B's (8192, 4096, 128256), the last also with 4096 tokens (where one chunk holds less
memory than several: `linear_cross_entropy.single_chunk_lighter`); --quick: the first two.

Columns: kernel ms (`common.kernel_ms`: kernels summed by torch.profiler, L2 flushed),
event ms (do_bench's median), wall µs per call in a synchronised loop, TFLOP/s over the three
products' 6·M·K·V FLOPs and its fraction of torch.mm's bf16 rate measured in the same run,
peak MiB allocated by the call above its inputs (gradients included), and errors against an
fp32 PyTorch reference: |loss - ref|, and ‖g - ref‖ / ‖ref‖ for dx and dW.

Writes `linear_cross_entropy.json` and `linear_cross_entropy.md` under --out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer.bmm import linear
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.linear_cross_entropy import linear_cross_entropy

SHAPES = ((16384, 768, 50304), (8192, 2048, 128256), (8192, 4096, 128256), (4096, 4096, 128256))


def providers() -> dict:
    """name -> f(x, w, y) giving the mean loss."""

    def torch_loss(x, w, y):
        return F.cross_entropy(F.linear(x, w), y)

    fns = {
        "ours": lambda x, w, y: linear_cross_entropy(x, w, y, use_triton=True, check_labels=False),
        "ours-unfused": lambda x, w, y: cross_entropy(
            linear(x, w, use_triton=True),
            y,
            use_triton=True,
            inplace_backward=True,
            check_labels=False,
        ),
        "torch": torch_loss,
        "compile": common.compiled(torch_loss),
    }
    if common.liger() is not None:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction as Liger,
        )

        fns["liger"] = lambda x, w, y: Liger.apply(x, w, y)[0]
        fns["liger-fp32"] = lambda x, w, y: Liger.apply(
            x, w, y, None, None, -100, 0.0, 0.0, "mean", None, False, torch.float32
        )[0]
    return fns


def _reference(x, w, y):
    """(loss, dx, dW) in fp32."""
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = F.cross_entropy(xf @ wf.t(), y)
    loss.backward()
    return loss.item(), xf.grad, wf.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def bench(shapes, mm_tflops: float) -> list[dict]:
    rows = []
    for M, K, V in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = (0.5 * torch.randn(M, K, device="cuda", generator=gen)).bfloat16().requires_grad_()
        w = (torch.randn(V, K, device="cuda", generator=gen) / K**0.5).bfloat16().requires_grad_()
        y = torch.randint(V, (M,), device="cuda", generator=gen)
        ref = _reference(x, w, y)
        torch.cuda.empty_cache()
        for name, f in providers().items():

            def step(f=f, x=x, w=w, y=y):
                x.grad = w.grad = None
                loss = f(x, w, y)
                loss.backward()
                return loss

            row = {"provider": name, "M": M, "K": K, "V": V}
            try:
                loss = step()
                row.update(
                    loss_err=abs(loss.item() - ref[0]), dx_err=_rel(x.grad, ref[1]),
                    dw_err=_rel(w.grad, ref[2]),
                )  # fmt: skip
                x.grad = w.grad = None
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                row["peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                row.update(common.time_op(step, wall_iters=20))
                row["tflops"] = 6 * M * K * V / (row["ms"] * 1e-3) / 1e12
                row["frac"] = row["tflops"] / mm_tflops
            except Exception as e:  # one provider failing must not end the run
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            x.grad = w.grad = None
            torch.cuda.empty_cache()
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        x = w = y = ref = None
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], env: dict, ceil: dict) -> str:
    lines = [f"# Fused linear + cross-entropy, forward + backward ({env})", ""]
    lines.append(f"bf16 mm ceiling {ceil['bf16_tflops']:.0f} TFLOP/s (torch.mm, this run)")
    for M, K, V in sorted({(r["M"], r["K"], r["V"]) for r in rows}, key=lambda s: s[2] * s[1]):
        mine = [r for r in rows if (r["M"], r["K"], r["V"]) == (M, K, V)]
        ours = next((r for r in mine if r["provider"] == "ours" and "ms" in r), None)
        lines += ["", f"## M {M}, K {K}, V {V}", ""]
        lines.append(
            "| provider | kernel ms | event ms | wall µs | TFLOP/s | of mm | peak MiB | "
            "its time / ours (kernel) | loss err | dx err | dW err |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in mine:
            if "ms" not in r:
                lines.append(f"| {r['provider']} | {r.get('error', '-')} |||||||||| ")
                continue
            ratio = f"{r['ms'] / ours['ms']:.2f}x" if ours else "-"
            lines.append(
                f"| {r['provider']} | {r['ms']:.3f} | {r['event_ms']:.3f} | {r['wall_us']:.0f} | "
                f"{r['tflops']:.0f} | {r['frac']:.2f} | {r['peak_MiB']:,.0f} | {ratio} | "
                f"{r['loss_err']:.1e} | {r['dx_err']:.1e} | {r['dw_err']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    args, out = common.parse_out(
        __doc__, lambda ap: ap.add_argument("--quick", action="store_true")
    )
    env = common.env_info()
    ceil = common.ceilings()
    rows = bench(SHAPES[:2] if args.quick else SHAPES, ceil["bf16_tflops"])
    (out / "linear_cross_entropy.json").write_text(
        json.dumps(dict(env=env, ceilings=ceil, rows=rows), indent=1)
    )
    text = table(rows, env, ceil)
    (out / "linear_cross_entropy.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
