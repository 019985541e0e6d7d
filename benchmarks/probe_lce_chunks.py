"""Probe: where the fused loss's time and memory go, per chunk size (issue #19's target: the
fused step's peak at least 1.5 GB below the unfused step's, at equal or better speed).

1. Kernel time (L2 flushed) of each piece of one chunk at GPT-2's loss shape (K = 768, V =
   50,304, bf16), for chunks of 4096 down to 1024 rows: the logits' product, the in-place
   loss kernel, dx = dz W, dW's first product (fp32 out) and its accumulation (fp32 C read
   and written), each as the loss launches it, with other ways to do the last two; then the
   whole chunked op at M = 16,384 rows for each chunk size, and the unfused sequence.
2. Memory of one GPT-2 step (our AdamW, bf16 autocast), fused loss at each chunk size and
   unfused, graphed or eager (`--modes`): allocated bytes when the loss starts, the peak
   through the loss call, the step's peak (allocated and reserved), so the loss's own
   footprint is read off, not modelled.

    python3 benchmarks/probe_lce_chunks.py --out DIR [--rows 4096 2048 ...] [--no-step]
        [--no-pieces] [--modes graph eager eager-block-graphs]
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

import triton_transformer.linear_cross_entropy as lce
import triton_transformer.matmul_plan as plan
from triton_transformer.cross_entropy import (
    launch_cross_entropy_fwd,
    launch_cross_entropy_fwd_reduce,
)
from triton_transformer.utils import empty_scalar

M, K, V = 16384, 768, 50304


def _pieces(rows: int, x, w, labels) -> dict:
    """Kernel ms of each piece of one chunk of `rows` rows."""
    dev = x.device
    x_c = x[:rows]
    z = torch.empty(rows, V, dtype=x.dtype, device=dev)
    dx = torch.empty(rows, K, dtype=x.dtype, device=dev)
    dw = torch.empty(V, K, dtype=torch.float32, device=dev)
    loss_rows = torch.empty(M, dtype=torch.float32, device=dev)
    n_valid, loss = empty_scalar(dev), empty_scalar(dev)
    labels2 = labels[None]
    launch_cross_entropy_fwd_reduce(loss_rows, labels2, None, n_valid, loss, False, True)
    plan._mm2d_into(x_c, w.t(), z)

    def ce():
        launch_cross_entropy_fwd(
            z[None], labels2[:, :rows], None, n_valid, loss_rows[:rows], loss_rows[:rows],
            True, True, counted=True,
        )  # fmt: skip

    def ours(fn):
        def run():
            saved, plan.matmul_impl = plan.matmul_impl, "triton"
            try:
                fn()
            finally:
                plan.matmul_impl = saved

        return run

    out = {
        "logits": common.kernel_ms(lambda: plan._mm2d_into(x_c, w.t(), z)),
        "ce in place": common.kernel_ms(ce),
        "dx": common.kernel_ms(lambda: plan._mm2d_into(z, w, dx)),
        "dx, ours": common.kernel_ms(ours(lambda: plan._mm2d_into(z, w, dx))),
        "dW first": common.kernel_ms(lambda: plan._mm2d_into(z.t(), x_c, dw)),
        "dW accumulate": common.kernel_ms(lambda: plan.accumulate_mm(dw, z.t(), x_c)),
        "dW accumulate, ours": common.kernel_ms(ours(lambda: plan.accumulate_mm(dw, z.t(), x_c))),
    }
    # the fp32 C's read + write alone, at the copy rate: what accumulating costs at best
    out["dW rmw bytes GB"] = 2 * V * K * 4 / 1e9
    return out


def _whole(rows: int, x, w, labels) -> float:
    return common.kernel_ms(
        lambda: lce._linear_cross_entropy_impl(x, w, labels, None, rows, True, True, False), iters=5
    )


def _unfused(x, w, labels) -> float:
    import triton_transformer.cross_entropy as ce_mod

    z = torch.empty(M, V, dtype=x.dtype, device=x.device)
    dx = torch.empty(M, K, dtype=x.dtype, device=x.device)
    dw = torch.empty(V, K, dtype=torch.float32, device=x.device)

    def run():
        plan._mm2d_into(x, w.t(), z)
        ce_mod.cross_entropy_inplace_op(z.view(1, M, V), labels.view(1, M), None)
        plan._mm2d_into(z, w, dx)
        plan._mm2d_into(z.t(), x, dw)

    return common.kernel_ms(run, iters=5)


def _step_memory(rows: int | None, mode: str) -> dict:
    """One GPT-2 step's memory: at the loss's start, peak inside it, peak of the step. rows
    None: the unfused loss. mode: "eager" (no graphs of blocks either), "eager-block-graphs"
    (the model's block graphs on, the eager loop's default) or "graph" (the marks are read
    while the step is captured, as `bench_step.py` measures it). Also the step's peak of
    reserved memory, counted from the cache emptied: what the process holds, graph pools
    included, which `max_memory_allocated` need not count."""
    from bench_step import PRESETS, build

    import triton_transformer.transformer as tmod
    from triton_transformer import block_graphs
    from triton_transformer.cuda_graph import GraphedStep, capturable_train_step

    torch.cuda.empty_cache()
    p = PRESETS["gpt2"]
    saved_rows = lce.CHUNK_BYTES
    if rows is not None:
        lce.CHUNK_BYTES = rows * V * 2
    model = build("triton", "eager", p, 0.0, rows is not None)
    batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
    step = capturable_train_step(model, batch, lr=3e-4, triton_optimizer=True)
    if mode == "graph":
        step = GraphedStep(step, warmup_steps=3)
    marks = {}
    real = tmod.linear_cross_entropy
    real_linear = tmod.linear

    def at_loss(fn):
        def wrapped(*args, **kwargs):
            # allocator counters are host-side: no synchronisation (none is allowed in capture)
            marks["at loss MiB"] = torch.cuda.memory_allocated() / 2**20
            marks["peak before the loss MiB"] = torch.cuda.max_memory_allocated() / 2**20
            out = fn(*args, **kwargs)
            marks["peak through the loss MiB"] = torch.cuda.max_memory_allocated() / 2**20
            return out

        return wrapped

    if rows is None:  # the unfused loss: the logits' product marks where the loss starts
        tmod.linear = lambda y, wgt, **kw: (
            at_loss(real_linear)(y, wgt, **kw) if wgt.shape[0] == V else real_linear(y, wgt, **kw)
        )
    else:
        tmod.linear_cross_entropy = at_loss(real)
    suspend = block_graphs.suspended() if mode == "eager" else contextlib.nullcontext()
    try:
        with suspend:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
            base_reserved = torch.cuda.memory_reserved() / 2**20
            step()  # graph: the capture
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated() / 2**20
            step_peak_reserved = torch.cuda.max_memory_reserved() / 2**20
            after = torch.cuda.memory_allocated() / 2**20
    finally:
        tmod.linear_cross_entropy, tmod.linear = real, real_linear
        lce.CHUNK_BYTES = saved_rows
    del step, model
    return {
        "mode": mode,
        "rows": rows or "unfused",
        "before the step MiB": base,
        **marks,
        "step peak MiB": step_peak,
        "after the step MiB": after,
        "reserved before the step MiB": base_reserved,
        "step peak reserved MiB": step_peak_reserved,
    }


def main() -> None:
    args, out = common.parse_out(
        __doc__,
        lambda ap: (
            ap.add_argument("--rows", type=int, nargs="+", default=[4096, 2816, 2048, 1664, 1024]),
            ap.add_argument("--no-step", action="store_true"),
            ap.add_argument("--no-pieces", action="store_true"),
            ap.add_argument(
                "--modes",
                nargs="+",
                default=["graph", "eager"],
                choices=["graph", "eager", "eager-block-graphs"],
            ),
        ),
    )
    torch.manual_seed(0)
    x = (torch.randn(M, K, device="cuda") * 0.5 + 0.1).bfloat16()
    w = (torch.randn(V, K, device="cuda") * 0.02).bfloat16()
    labels = torch.randint(0, V, (M,), device="cuda")
    result = {"env": common.env_info(), "ceilings": common.ceilings(), "pieces": {}, "whole": {}}
    for rows in [] if args.no_pieces else args.rows:
        result["pieces"][rows] = _pieces(rows, x, w, labels)
        result["whole"][rows] = _whole(rows, x, w, labels)
        print(rows, result["pieces"][rows], "whole", result["whole"][rows], flush=True)
    if not args.no_pieces:
        result["whole"]["unfused"] = _unfused(x, w, labels)
        print("unfused", result["whole"]["unfused"], flush=True)
    del x, w, labels
    if not args.no_step:
        result["memory"] = [
            _step_memory(r, mode) for mode in args.modes for r in [None, *args.rows]
        ]
        for row in result["memory"]:
            print(row, flush=True)
    (out / "lce_chunks.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
