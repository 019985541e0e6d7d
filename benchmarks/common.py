"""Shared pieces of the op benchmarks: ceilings, timing, providers and reports.

Every benchmark in this folder measures in one process, on one GPU:
- the ceilings it reports against (`ceilings()`: device-to-device copy bandwidth, counting bytes
  read plus bytes written, and the bf16 matmul rate of torch.mm on random data);
- each provider's GPU kernel time (`time_op`: kernel durations summed by torch.profiler, L2
  flushed before every call) and its host wall time per call (synchronised loop);
- one row per (provider, size), written by `report` as a markdown table and a PNG plot in the
  style of `triton.testing.perf_report` (the metric against size, one line per provider).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

PROVIDER_ORDER = ("ours", "torch", "compile", "liger", "sdpa", "sdpa-flash", "sdpa-cudnn", "naive")


def env_info() -> dict[str, str]:
    """Device, library versions and date, for the header of every report."""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
    }


def _copy_gbps(n: int = 1 << 30) -> float:
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()  # far larger than L2
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / ms / 1e6


def _bf16_tflops(m: int = 8192) -> float:
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.mm(a, b), return_mode="median")
    return 2 * m**3 / ms / 1e9


@functools.cache
def ceilings() -> dict[str, float]:
    """Measured ceilings: copy bandwidth (GB/s, read + write) and bf16 matmul (TFLOP/s)."""
    return {"copy_gbps": _copy_gbps(), "bf16_tflops": _bf16_tflops()}


@functools.cache
def _flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def _device_us(body: Callable[[], object], iters: int) -> float:
    """Summed CUDA kernel time (µs) of `iters` calls of body, each after an L2 flush."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = _flush_buffer()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            body()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)


@functools.cache
def _flush_us(iters: int) -> float:
    return _device_us(lambda: None, iters)


def kernel_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """GPU time of the kernels `fn` launches, per call, with a cold L2 before each call.

    torch.profiler sums device-side kernel durations, so host overhead and launch gaps are
    excluded. `do_bench`'s CUDA events are not: whenever an op's host time per call exceeds
    the L2 flush (about 75 µs on an H200), they time the host, which made small problems of
    ops with a custom-op dispatch (fwd+bwd especially) read 5-10x slower than their kernels.
    The flushes, timed alone, are subtracted.
    """
    fn()
    torch.cuda.synchronize()
    return (_device_us(fn, iters) - _flush_us(iters)) / iters / 1e3


def interleaved_kernel_ms(
    runs: Sequence[Callable[[], object]],
    rounds: int,
    first: Sequence[float] | None = None,
    iters: int = 10,
) -> list[tuple[float, float, float]]:
    """(median, min, max) kernel time per call (`kernel_ms`) of each of `runs` over `rounds`
    rounds in which they alternate (listed order, then reversed), so that every run meets the
    GPU in the same clock and power states. `first`: times already taken of each run, counted
    as the first round; `iters`: calls per time. Timed one after the other, providers drifted
    by up to 7% between rounds, more than some of the gaps measured
    (`probe_attention_layout.py`)."""
    samples = [[t] for t in first] if first is not None else [[] for _ in runs]
    for r in range(rounds - len(samples[0]) if samples else 0):
        order = range(len(runs) - 1, -1, -1) if r % 2 == 0 else range(len(runs))
        for i in order:
            samples[i].append(kernel_ms(runs[i], iters))
    out = []
    for ms in samples:
        ms = sorted(ms)
        out.append((ms[len(ms) // 2], ms[0], ms[-1]))
    return out


def time_op(fn: Callable[[], Any], wall_iters: int = 50) -> dict[str, float]:
    """{"ms": GPU kernel time per call (`kernel_ms`), "event_ms": `do_bench`'s median (CUDA
    events, L2 flushed; includes launch gaps when the host is slower than the GPU), "wall_us":
    host time per call in a synchronised loop (launch overhead shows when kernels are short)}.
    """
    event_ms = triton.testing.do_bench(fn, return_mode="median")
    return {"ms": kernel_ms(fn), "event_ms": event_ms, "wall_us": wall_us(fn, wall_iters)}


def wall_us(fn: Callable[[], Any], iters: int = 50) -> float:
    """Host wall time per call of `fn` in a loop synchronised at both ends (µs)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def parse_out(doc: str, add_args: Callable[[argparse.ArgumentParser], None] | None = None):
    """A probe's command line: --out DIR (made if missing) plus what `add_args` adds; returns
    (args, the output folder). `doc`: the probe's docstring, whose first line is the help."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def module_copy(source: Path, name: str, folder: Path, edits=()) -> Any:
    """`source` (one of the package's op modules, or a saved copy of one) with `edits`, pairs of
    (text, replacement) each found exactly once, imported as a module of its own: probes time
    variants of a kernel, or the shipped one against a change, in one process. Its
    torch.library ops are renamed into the namespace `probe_<name>`, so both register."""
    src = Path(source).read_text()
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"{name}: the text to replace occurs {src.count(old)} times")
        src = src.replace(old, new)
    path = Path(folder) / f"{name}.py"
    path.write_text(src.replace('"triton_transformer::', f'"probe_{name}::'))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def liger() -> Any | None:
    """The liger_kernel package if importable (an optional benchmark dependency), else None."""
    try:
        import liger_kernel
        import liger_kernel.ops  # the kernels live here
    except Exception:
        return None
    return liger_kernel


def compiled(fn: Callable, **kwargs: Any) -> Callable:
    """torch.compile with a fresh cache per function (benchmarks compare many shapes)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    return torch.compile(fn, **kwargs)


def run_main(
    op: str,
    bench: Callable[[Any], list[dict]],
    sweep: Callable[[Any], list[dict]],
    write_sweep: Callable[[str, list[dict]], Any] | None = None,
    **report_kwargs: Any,
) -> None:
    """The command line the op benchmarks share: --out, --quick, --no-compile, and --sweep
    (tune the op's launch settings instead of comparing providers).

    `bench(args)` / `sweep(args)` return rows; bench rows go to `report(out, op, ...)` with
    `report_kwargs`, sweep rows to `write_sweep(out, rows)` (default: `<op>_sweep.json`).
    """
    ap = argparse.ArgumentParser(description=f"{op} benchmark")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--sweep", action="store_true", help="tune launch settings instead")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = ap.parse_args()
    start = time.time()
    if args.sweep:
        rows = sweep(args)
        if write_sweep is not None:
            write_sweep(args.out, rows)
        else:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{op}_sweep.json").write_text(json.dumps(rows, indent=1))
    else:
        report(args.out, op, bench(args), **report_kwargs)
    print(f"done in {time.time() - start:.0f}s")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


def report(
    out_dir: str | Path,
    op: str,
    rows: Sequence[dict],
    *,
    x: str,
    y: str,
    group: Sequence[str] = ("dtype", "mode"),
    title: str | None = None,
) -> Path:
    """Write `<op>.md` (a table) and `<op>.png` (y against x per provider, a panel per group).

    rows: dicts holding at least "provider", `x`, `y`, "ms", "wall_us" and optionally
    "frac" (y over its ceiling) plus the `group` keys. Also writes `<op>.json` (raw rows).
    Returns the markdown path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    (out / f"{op}.json").write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))

    keys = [
        k for k in (*group, x, "provider", y, "frac", "ms", "wall_us") if any(k in r for r in rows)
    ]
    env = env_info()
    lines = [
        f"# {title or op}",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}. "
        f"ms = GPU kernel time per call (torch.profiler, L2 flushed before each call); "
        f"wall_us = host time per call; "
        f"frac = {y} over its measured ceiling.",
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
    ]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    md = out / f"{op}.md"
    md.write_text("\n".join(lines) + "\n")
    _plot(out / f"{op}.png", rows, x=x, y=y, group=group, title=title or op)
    return md


def _plot(path: Path, rows: list[dict], *, x: str, y: str, group: Sequence[str], title: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({tuple(r.get(g, "") for g in group) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if tuple(r.get(g, "") for g in group) == panel]
        providers = sorted(
            {r["provider"] for r in sel},
            key=lambda p: PROVIDER_ORDER.index(p) if p in PROVIDER_ORDER else 99,
        )
        for prov in providers:
            pts = sorted((r[x], r[y]) for r in sel if r["provider"] == prov and y in r)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(" ".join(str(p) for p in panel))
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{title} ({env_info()['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_profile(fn: Callable[[], object], calls: int, top: int, title: str) -> None:
    """Print a cProfile of `calls` calls of fn (after one warm-up call), the functions with
    the most own and the most cumulative time: where an eager call's host time goes."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"=== {title}: {stats.total_tt / calls * 1e3:.2f} ms of profiled host time per call")
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)


def gpu_time_per_step(step, n: int = 5) -> tuple[float, list[dict]]:
    """GPU kernel time per step (ms) from torch.profiler, and the kernels behind it: name,
    µs per step and launches per step, longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels = [
        {"kernel": e.key, "us/step": e.self_device_time_total / n, "calls/step": e.count / n}
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0
    ]
    kernels.sort(key=lambda k: -k["us/step"])
    return sum(k["us/step"] for k in kernels) / 1e3, kernels


def kernel_tables(rows: list[dict], top: int) -> str:
    """Where each case's GPU time goes: its `top` longest kernels, µs and launches per step."""
    lines = ["# GPU time per step by kernel (torch.profiler, summed over launches)", ""]
    for r in rows:
        if "kernels" not in r:
            continue
        what = " ".join(str(r[k]) for k in ("provider", "mode") if k in r)
        if "dropout" in r:
            what += f", dropout {r['dropout']}"
        if r.get("fused loss", "-") != "-":
            what += f", fused loss {r['fused loss']}"
        if "optimizer" in r:
            what += f", optimizer {r['optimizer']}"
        lines += [
            f"## {what}: "
            f"{r['gpu ms/step']:.2f} ms, {sum(k['calls/step'] for k in r['kernels']):.0f} "
            "launches",
            "",
            "| kernel | µs/step | calls/step | share |",
            "|---|---|---|---|",
        ]
        total = r["gpu ms/step"] * 1e3
        for k in r["kernels"][:top]:
            name = k["kernel"].replace("|", "/")[:90]
            lines.append(f"| `{name}` | {k['us/step']:.0f} | {k['calls/step']:.0f} | "
                         f"{k['us/step'] / total:.1%} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)
