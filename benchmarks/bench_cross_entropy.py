"""Cross-entropy benchmark: time, graph-replay time and peak memory, bf16 logits.

Providers: ours (`inplace_backward=True`, as the model's loss path calls it), ours-pure (the
default mode: a separate gradient buffer), torch (`F.cross_entropy`), compile
(`torch.compile` of it) and liger (`LigerCrossEntropyFunction`, if installed). 10% of the rows
are ignored (ignore_index=-100), as padding would be.

Modes: fwd (forward with logits requiring grad: ours and liger write the gradient here) and
fwd+bwd (`loss.backward()`, upstream gradient 1). Bytes counted: the logits read once (fwd);
read once and the gradient written once (fwd+bwd); the same for every provider, so GB/s is an
effective rate (~1 / time). Extra columns: `graph_ms` (the fwd+bwd step captured in a CUDA
graph and replayed: what a graph-captured training step pays; liger syncs on the host and
cannot be captured) and `peak_MiB` (peak memory of one fwd+bwd above what the logits and
labels already hold).

Usage: python3 benchmarks/bench_cross_entropy.py --out DIR [--quick] [--sweep] [--no-compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch
import torch.nn.functional as F
import triton

import triton_transformer.cross_entropy as ce_mod
from triton_transformer.cross_entropy import cross_entropy
from triton_transformer.cuda_graph import capture_graph

IGNORE = -100


def make_inputs(n_rows: int, V: int, dtype=torch.bfloat16):
    logits = (-1.0 + 2.0 * torch.randn(n_rows, V, device="cuda")).to(dtype)
    labels = torch.randint(V, (n_rows,), device="cuda")
    labels[torch.rand(n_rows, device="cuda") < 0.1] = IGNORE
    return logits.requires_grad_(), labels


def providers(no_compile: bool) -> dict:
    fns = {
        "ours": lambda x, t: cross_entropy(
            x, t, IGNORE, use_triton=True, check_labels=False, inplace_backward=True
        ),
        "ours-pure": lambda x, t: cross_entropy(x, t, IGNORE, use_triton=True, check_labels=False),
        "torch": lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE),
    }
    if not no_compile:
        fns["compile"] = common.compiled(lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE))
    lk = common.liger()
    if lk is not None:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        fns["liger"] = lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, IGNORE)[0]
    return fns


def graph_ms(step) -> float:
    """Median time of one replay of `step` captured in a CUDA graph."""
    graph, _ = capture_graph(step, warmup_calls=3)
    return triton.testing.do_bench(graph.replay, return_mode="median")


def peak_mib(step) -> float:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench(args) -> list[dict]:
    ceil = common.ceilings()
    fns = providers(args.no_compile)
    Vs = [256, 32000, 128256]
    rows_list = [8192] if args.quick else [4096, 8192, 16384]
    rows = []
    for V in Vs:
        for n_rows in rows_list:
            x, t = make_inputs(n_rows, V)
            nbytes = {"fwd": x.numel() * x.element_size(), "fwd+bwd": 2 * x.numel() * 2}
            for name, f in fns.items():
                if name == "compile" and n_rows != 8192:
                    continue  # one compiled shape per vocabulary keeps the run short

                def fwd(f=f, x=x, t=t):
                    return f(x, t)

                def step(f=f, x=x, t=t):
                    x.grad = None
                    f(x, t).backward()

                for mode, fn in (("fwd", fwd), ("fwd+bwd", step)):
                    try:
                        r = common.time_op(fn)
                    except Exception as e:  # one provider failing must not end the run
                        print(f"{name} V={V} rows={n_rows} {mode}: {type(e).__name__}: {e}")
                        continue
                    gbps = nbytes[mode] / r["ms"] / 1e6
                    row = {
                        "provider": name, "V": V, "rows": n_rows, "dtype": "bf16",
                        "mode": mode, "ms": r["ms"], "wall_us": r["wall_us"], "GB/s": gbps,
                        "frac": gbps / ceil["copy_gbps"],
                    }  # fmt: skip
                    if mode == "fwd+bwd":
                        try:
                            row["peak_MiB"] = peak_mib(step)
                            if name in ("ours", "ours-pure", "torch"):
                                row["graph_ms"] = graph_ms(step)
                        except Exception as e:
                            print(f"{name} V={V} rows={n_rows} graph/peak: {e}")
                    rows.append(row)
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
            x = t = None
            torch.cuda.empty_cache()
    return rows


def sweep(args) -> list[dict]:
    """Tile sizes and warps of the in-place forward (the cost of the model's loss path) and of
    the pure backward, at the large vocabularies; ROW_TILE at V = 256."""
    out = []
    n_rows = 8192

    def run(label, Vs=(32000, 128256), **cfg):
        saved = {k: getattr(ce_mod, k) for k in cfg}
        for k, v in cfg.items():
            setattr(ce_mod, k, v)
        try:
            for V in Vs:
                x, t = make_inputs(n_rows, V)

                def fwd(x=x, t=t):
                    return cross_entropy(
                        x, t, IGNORE, use_triton=True, check_labels=False, inplace_backward=True
                    )

                def pure_step(x=x, t=t):
                    x.grad = None
                    cross_entropy(x, t, IGNORE, use_triton=True, check_labels=False).backward()

                for mode, fn in (("fwd-inplace", fwd), ("pure fwd+bwd", pure_step)):
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    row = {"provider": label, "V": V, "mode": mode, "ms": ms}
                    out.append(row)
                    print(row)
        except Exception as e:
            print(f"sweep {label}: {type(e).__name__}: {e}")
        finally:
            for k, v in saved.items():
                setattr(ce_mod, k, v)

    for block in (4096, 8192, 16384, 32768):
        for warps in (8, 16, 32):
            run(
                f"FWD_MAX_BLOCK={block} BWD_MAX_BLOCK={min(block, 16384)} warps={warps}",
                FWD_MAX_BLOCK=block, BWD_MAX_BLOCK=min(block, 16384),
                FWD_NUM_WARPS=warps, BWD_NUM_WARPS=warps,
            )  # fmt: skip
    for tile in (1024, 2048, 4096, 8192):
        run(f"ROW_TILE={tile}", Vs=(256,), ROW_TILE=tile)
    return out


def main() -> None:
    common.run_main(
        "cross_entropy", bench, sweep,
        write_sweep=lambda out, rows: common.report(
            out, "cross_entropy_sweep", rows, x="V", y="ms", group=("mode",)
        ),
        x="V", y="GB/s", group=("rows", "mode"), title="cross-entropy, bf16, 10% ignored rows",
    )  # fmt: skip


if __name__ == "__main__":
    main()
