"""GPU benchmark of the row ops (LayerNorm, softmax) against PyTorch eager and torch.compile.

For every (op, dtype, N, mode) it reports, side by side:
  kernel_us  GPU time inside the op's kernels per call (torch.profiler, L2 flushed before each
             call): what the kernels cost, free of host overhead
  event_us   median time between CUDA events around one call (triton.testing.do_bench): kernels
             plus any idle gaps while the GPU waits for the host
  wall_us    host wall-clock per call in a tight loop (synchronised at the end): what a training
             step pays once Python, autograd and launch overheads are counted
  GB/s       the bytes the op must move (each input read once, each output written once)
             / kernel_us
  %copy    that bandwidth as a fraction of the measured device-to-device copy bandwidth

Usage: python benchmarks/bench_ops.py [--ops layernorm softmax] [--dtypes fp16 bf16]
                                      [--M 4096] [--Ns 512 1024 ...] [--no-compile] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from triton_transformer.layernorm import layernorm
from triton_transformer.softmax import softmax

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def kernel_us(fn: Callable[[], object], iters: int = 20) -> float:
    """GPU time of the kernels `fn` launches, per call, with a cold L2 before each call.

    The profiler sums device-side kernel durations, so host overhead and launch gaps are
    excluded; the L2 flush (a 256 MB fill) is timed alone and subtracted.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def device_us(body: Callable[[], object]) -> float:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                flush_buf.zero_()
                body()
            torch.cuda.synchronize()
        events = prof.key_averages()
        return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)

    return (device_us(fn) - device_us(lambda: None)) / iters


def wall_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Host wall-clock per call: a tight loop, synchronised once at the end."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def make_case(op: str, M: int, N: int, dtype: torch.dtype):
    """Inputs, the three providers' forward functions and the minimal byte counts of one case.

    Minimal bytes (e = element size): forward reads x and writes y (2·M·N·e); backward reads
    x (or y) and dy and writes dx (3·M·N·e). Per-row statistics and the weights are O(M + N).
    """
    x = (-2.3 + 0.5 * torch.randn(M, N, device="cuda")).to(dtype).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    if op == "layernorm":
        w = (1 + 0.1 * torch.randn(N, device="cuda")).to(dtype).requires_grad_()
        b = (0.1 * torch.randn(N, device="cuda")).to(dtype).requires_grad_()
        ours = lambda: layernorm(x, w, b, use_triton=True)
        ref = lambda: F.layer_norm(x, (N,), w, b)
        params = [x, w, b]
    else:
        ours = lambda: softmax(x, use_triton=True)
        ref = lambda: torch.softmax(x, dim=-1)
        params = [x]
    e = x.element_size()
    return x, dy, params, ours, ref, {"fwd": 2 * M * N * e, "fwd+bwd": 5 * M * N * e}


def bench_case(op, M, N, dtype, compile_: bool, copy_gbs: float) -> list[dict]:
    _, dy, params, ours, ref, n_bytes = make_case(op, M, N, dtype)
    providers = {"triton": ours, "torch": ref}
    if compile_:
        providers["compile"] = torch.compile(ref)
    # correctness guard: a benchmark of a wrong kernel is worthless
    torch.testing.assert_close(ours().float(), ref().float(), atol=2e-2, rtol=2e-2)
    rows = []
    for name, fwd in providers.items():
        for mode in ("fwd", "fwd+bwd"):
            run = (lambda f=fwd: f()) if mode == "fwd" else (lambda f=fwd: f().backward(dy))
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                ms = triton.testing.do_bench(
                    run, warmup=25, rep=100, grad_to_none=params, return_mode="median"
                )
                host = wall_us(run)
                kern = kernel_us(run)
            gbs = n_bytes[mode] / (kern * 1e-6) / 1e9
            rows.append(
                dict(
                    op=op,
                    dtype=str(dtype).replace("torch.", ""),
                    M=M,
                    N=N,
                    mode=mode,
                    provider=name,
                    kernel_us=round(kern, 2),
                    event_us=round(ms * 1e3, 2),
                    wall_us=round(host, 2),
                    gbs=round(gbs, 1),
                    pct_copy=round(100 * gbs / copy_gbs, 1),
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=["layernorm", "softmax"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    parser.add_argument("--M", type=int, default=4096)
    parser.add_argument("--Ns", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops.py needs a CUDA GPU")

    # one compiled graph per (op, shape, dtype): raise dynamo's recompile limit accordingly
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1024)

    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbs = copy_bandwidth_gbs()
    device = torch.cuda.get_device_name()
    stamp = dt.datetime.now().isoformat(timespec="seconds")
    print(f"# {device}, torch {torch.__version__}, triton {triton.__version__}, {stamp}")
    print(f"# measured device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")

    rows = []
    for op in args.ops:
        for dname in args.dtypes:
            for N in args.Ns:
                rows += bench_case(op, args.M, N, DTYPES[dname], not args.no_compile, copy_gbs)
                torch._dynamo.reset()
                # rewritten after every case, so a run cut short still leaves its numbers
                write_csv(rows, args.out / "bench_ops.csv")
                write_markdown(rows, args.out / "bench_ops.md", device, copy_gbs, stamp)
    plot(rows, args.out / "bench_ops.png", device)
    print((args.out / "bench_ops.md").read_text())


def write_csv(rows, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_markdown(rows, path: Path, device: str, copy_gbs: float, stamp: str) -> None:
    """A line per (op, dtype, mode, N); providers side by side: GB/s (%copy), kernel, wall µs."""
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    head = ["op", "dtype", "mode", "N"]
    head += [f"{p} GB/s (%copy) · kernel µs · wall µs" for p in providers]
    lines = [
        f"{device}, {stamp}; copy bandwidth {copy_gbs:.0f} GB/s; M = {rows[0]['M']} rows",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    keyed: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        keyed.setdefault((r["op"], r["dtype"], r["mode"], r["N"]), {})[r["provider"]] = r
    for (op, dtype, mode, N), by_p in keyed.items():
        cells = [op, dtype, mode, str(N)]
        for p in providers:
            r = by_p.get(p)
            cells.append(
                f"{r['gbs']:.0f} ({r['pct_copy']:.0f}%) · {r['kernel_us']:.1f} · {r['wall_us']:.1f}"
                if r
                else "-"
            )
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows, path: Path, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    panels = sorted({(r["op"], r["dtype"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (op, dtype, mode) in zip(axes[0], panels, strict=True):
        for provider in dict.fromkeys(r["provider"] for r in rows):
            sel = [
                r
                for r in rows
                if (r["op"], r["dtype"], r["mode"], r["provider"]) == (op, dtype, mode, provider)
            ]
            ax.plot([r["N"] for r in sel], [r["gbs"] for r in sel], marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} {dtype} {mode}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    fig.suptitle(device, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
