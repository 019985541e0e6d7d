"""Probe: where a graphed training step leaves the GPU idle. Profiles a few steps of a preset
(`bench_step.py`'s models and step) into a chrome trace, orders the kernels, memsets and
copies of the GPU, and sums the gaps between them: wall time against busy time, a histogram of
the gaps, the pairs of neighbours that hold the most idle time, and one step's kernels in
order (duration, gap after) for reading.

    python3 benchmarks/probe_step_gaps.py --out DIR [--preset gpt2] [--cases ...]

Cases: ours with the fused loss, ours unfused, ours under torch.compile (whole step graphed
as ours), and the SDPA GPT under torch.compile(mode="reduce-overhead"). Writes
DIR/gaps_<preset>.md and DIR/seq_<preset>_<case>.txt.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_step

from triton_transformer.cuda_graph import GraphedStep, capturable_train_step

CASES = {  # name: (provider, mode, fused loss)
    "fused": ("triton", "graph", True),
    "unfused": ("triton", "graph", False),
    "compiled": ("triton", "compile-graph", True),
    "sdpa-gpt": ("sdpa-gpt", "compile-ro", None),
}
GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")


def gpu_events(step, n: int) -> list[dict]:
    """The GPU's events of n profiled steps, by start time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    events = [e for e in events if e.get("cat") in GPU_EVENTS and "dur" in e]
    return sorted(events, key=lambda e: e["ts"])


def gaps_of(events: list[dict]) -> tuple[float, float, list[tuple[float, str, str]]]:
    """(span, busy, gaps) in µs: busy is the union of the events' intervals; each gap is
    (length, the event that ended last before it, the event after it)."""
    busy, gaps, end, last = 0.0, [], events[0]["ts"], None
    for e in events:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, last["name"][:60] if last else "", e["name"][:60]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return end - events[0]["ts"], busy, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="gpt2", choices=list(bench_step.PRESETS))
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p, n = bench_step.PRESETS[args.preset], args.steps
    lines = [f"# Idle time between kernels, {args.preset} preset, dropout 0 (µs per step)", ""]
    for name in args.cases:
        provider, mode, fused = CASES[name]
        torch.manual_seed(0)
        model = bench_step.build(provider, mode, p, 0.0, fused)
        batch = torch.randint(0, p["vocab"], (p["batch"], p["seq"] + 1), device="cuda")
        step = capturable_train_step(model, batch, lr=3e-4)
        if mode in ("graph", "compile-graph"):
            step = GraphedStep(step, warmup_steps=3)
        for _ in range(6):  # compile, capture, autotune
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 20 * 1e3
        events = gpu_events(step, n)
        span, busy, gaps = gaps_of(events)
        idle = sum(g for g, _, _ in gaps)
        lines += [
            f"## {name}: wall {wall:.3f} ms per step (no profiler); profiled span "
            f"{span / n / 1e3:.3f}, busy {busy / n / 1e3:.3f}, idle {idle / n / 1e3:.3f} in "
            f"{len(gaps) / n:.0f} gaps",
            "",
        ]
        hist = collections.Counter(min(int(g), 20) for g, _, _ in gaps)
        lines += ["gaps by length (µs, floor; 20 = 20 or more): " + ", ".join(
            f"{k}: {v / n:.0f}" for k, v in sorted(hist.items())), ""]  # fmt: skip
        pairs = collections.defaultdict(lambda: [0.0, 0])
        for g, before, after in gaps:
            pairs[before, after][0] += g
            pairs[before, after][1] += 1
        lines += ["| idle µs | gaps | after | before |", "|---|---|---|---|"]
        for (before, after), (g, c) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:25]:
            lines.append(f"| {g / n:.1f} | {c / n:.1f} | `{before}` | `{after}` |")
        lines.append("")
        # one step's events in order (the middle one of the n): duration and the gap after
        per = len(events) // n
        one = events[(n // 2) * per : (n // 2 + 1) * per]
        with open(out / f"seq_{args.preset}_{name}.txt", "w") as f:
            for e, nxt in zip(one, [*one[1:], None], strict=True):
                gap = nxt["ts"] - e["ts"] - e["dur"] if nxt else 0.0
                f.write(f"{e['dur']:9.1f} {gap:7.1f}  {e['name'][:110]}\n")
        del model, step
        torch.cuda.empty_cache()
    (out / f"gaps_{args.preset}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
