"""Probe: does Python itself run slower on autograd's device (worker) thread?

`probe_worker_thread.py` found our layernorm's backward body 1.6x slower there than on the
calling thread. This times the same fixed pieces of host work on each thread, inside an
`autograd.Function` whose forward and backward do nothing else: a pure-Python loop, ten
`torch.empty`, ten reads of Triton's current device and stream, ten tiny `neg` ops, ten small
dicts. Then the same on a plain Python thread handed the work through a queue. It also
records the CPU each piece ran on (`sched_getcpu`). If the loop alone is slower on the
worker, the cost is the thread's CPU (placement, frequency, cold caches), not our code.

    python3 benchmarks/probe_worker_cpu.py [--out DIR]
"""

from __future__ import annotations

import ctypes
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

_LIBC = ctypes.CDLL("libc.so.6")
TIMES: dict[str, dict[str, list[float]]] = {}


def work(tag: str, y: torch.Tensor) -> None:
    """The timed pieces, µs each, recorded under `tag` with the CPU they ran on."""
    from triton.runtime import driver

    active, clock = driver.active, time.perf_counter
    t0 = clock()
    s = 0
    for i in range(300):
        s += i * i
    t1 = clock()
    for _ in range(10):
        torch.empty((64, 512), device="cuda")
    t2 = clock()
    for _ in range(10):
        active.get_current_stream(active.get_current_device())
    t3 = clock()
    for _ in range(10):
        y.neg()
    t4 = clock()
    for _ in range(10):
        tuple({"a": (1, 2), "b": [3]})
    t5 = clock()
    pieces = {
        "py loop 300": t1 - t0, "10 empty": t2 - t1, "10 device+stream": t3 - t2,
        "10 neg": t4 - t3, "10 dicts": t5 - t4,
    }  # fmt: skip
    row = TIMES.setdefault(tag, {})
    for name, seconds in pieces.items():
        row.setdefault(name, []).append(seconds * 1e6)
    row.setdefault("cpu", []).append(_LIBC.sched_getcpu())


def summary(tag: str) -> str:
    row = dict(TIMES[tag])
    cpus = row.pop("cpu")
    cells = "; ".join(f"{k} {statistics.median(v):.1f}" for k, v in row.items())
    return f"  {tag}: {cells} | most often on cpu {max(set(cpus), key=cpus.count)}"


def main() -> None:
    _, out = common.parse_out(__doc__)
    x = torch.randn(64, 512, device="cuda", requires_grad=True)
    y = torch.randn(64, 512, device="cuda")

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            work("forward (calling thread)", y)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            main_thread = threading.current_thread() is threading.main_thread()
            work("backward on the " + ("calling" if main_thread else "worker") + " thread", y)
            return g

    lines = [f"# {common.env_info()}", f"cpus {os.cpu_count()}", ""]
    for mode in ("worker", "calling", "worker", "calling"):
        with torch.autograd.set_multithreading_enabled(mode == "worker"):
            for _ in range(100):
                Timed.apply(x).sum().backward()
            TIMES.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(400):
                Timed.apply(x).sum().backward()
            torch.cuda.synchronize()
            total = (time.perf_counter() - start) / 400 * 1e6
        lines.append(
            f"== backward on the {mode} thread: fwd+bwd {total:.0f} µs; median µs per piece:"
        )
        lines.extend(summary(tag) for tag in TIMES)
    # the same work on a plain Python thread, woken through a queue for each call
    jobs, done = queue.Queue(), queue.Queue()

    def serve():
        while True:
            jobs.get()
            work("plain thread", y)
            done.put(None)

    threading.Thread(target=serve, daemon=True).start()
    TIMES.clear()
    for _ in range(400):
        jobs.put(None)
        done.get()
    lines.append(summary("plain thread"))
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "worker_cpu.txt").write_text(text)


if __name__ == "__main__":
    main()
