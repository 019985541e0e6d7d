"""Probe: the host-time floor of an eager op written in Python, against PyTorch's own ops.

#20 asks every op's eager forward + backward to cost at most PyTorch's own plus ~15 µs of
host time. Our ops are `autograd.Function`s (Python forward and backward) that launch Triton
kernels through `utils.launcher`; PyTorch's are C++ autograd nodes launching C++ kernels.
This probe times the pieces on this host, each alone, with the same loop as
`bench_overhead.py` (calls back to back, one synchronise, wall time / calls), at a tiny
shape so the GPU never limits:

- PyTorch's native one-kernel ops, forward + backward (`x.neg()`, `F.relu`), and the
  `out.float().sum().backward()` tail every `bench_overhead.py` row pays;
- one launch of a trivial Triton kernel: Triton's own `kernel[grid](...)`, our `launcher`,
  and the compiled kernel's `run` called directly with its arguments bound (the least any
  Python launch can cost);
- `torch.empty_like`;
- an `autograd.Function` with an empty body (forward returns a new tensor, backward returns
  its input), and with one launch of the trivial kernel in each of forward and backward:
  the floor of any Python op with one kernel each way, to set against `x.neg()`; with three
  allocations, and with three launches, each way; our layernorm and `F.layer_norm`: where
  the backward on autograd's device thread costs more than on the calling thread.

Both with the backward on autograd's device thread (the default) and on the calling thread.

    python3 benchmarks/probe_host_floor.py --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer.dropout import dropout
from triton_transformer.layernorm import layernorm
from triton_transformer.utils import launcher


@triton.jit
def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _launch_ours(x: torch.Tensor, y: torch.Tensor) -> None:
    launcher(_copy_kernel)[(1,)](x, y, x.numel(), BLOCK=1024)


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def _copied(x: torch.Tensor, launches: int) -> torch.Tensor:
    """A new tensor written by `launches` launches of the copy kernel."""
    y = torch.empty_like(x)
    for _ in range(launches):
        _launch_ours(x, y)
    return y


def _launching(launches: int) -> type[torch.autograd.Function]:
    """A Function that launches the copy kernel `launches` times each way."""

    class Launching(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return _copied(x, launches)

        @staticmethod
        def backward(ctx, dy):
            return _copied(dy, launches)

    return Launching


_OneKernel, _ThreeLaunches = _launching(1), _launching(3)


class _ThreeEmpties(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        torch.empty_like(x), torch.empty_like(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        torch.empty_like(dy), torch.empty_like(dy)
        return torch.empty_like(dy)


def _bound_run(x: torch.Tensor, y: torch.Tensor):
    """The compiled kernel's launcher with everything but the grid's arguments bound."""
    compiled = _copy_kernel[(1,)](x, y, x.numel(), BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    n = x.numel()

    def call():
        run(1, 1, 1, stream, function, metadata, None, None, None, x, y, n, 1024)

    return call


def main() -> None:
    _, out = common.parse_out(__doc__)
    calls = 600
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.empty_like(x)
    xd = x.detach()
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fwd_bwd(fwd):
        def body():
            fwd().float().sum().backward()

        return body

    rows = {}

    def timed(name, fn, n=calls):
        for _ in range(20):
            fn()
        rows[name] = common.wall_us(fn, n)
        print(f"{name}: {rows[name]:.1f} µs", flush=True)

    timed("torch.empty_like", lambda: torch.empty_like(xd))
    timed("launch: triton kernel[grid]", lambda: _copy_kernel[(1,)](xd, y, xd.numel(), BLOCK=1024))
    timed("launch: utils.launcher", lambda: _launch_ours(xd, y))
    timed("launch: compiled run, arguments bound", _bound_run(xd, y))
    timed("x.neg() forward, no grad", torch.no_grad()(lambda: xd.neg()))
    cases = {
        "float().sum().backward() tail alone": lambda: x.float(),
        "x.neg()": lambda: x.neg(),
        "F.relu(x)": lambda: F.relu(x),
        "Function, empty bodies": lambda: _Empty.apply(x),
        "Function, one launch each way": lambda: _OneKernel.apply(x),
        "Function, three allocations each way": lambda: _ThreeEmpties.apply(x),
        "Function, three launches each way": lambda: _ThreeLaunches.apply(x),
        "our layernorm": lambda: layernorm(x, w, use_triton=True),
        "F.layer_norm": lambda: F.layer_norm(x, (512,), w),
        "our dropout": lambda: dropout(x, 0.1, use_triton=True),
        "F.dropout": lambda: F.dropout(x, 0.1),
    }
    for thread in ("worker", "calling"):
        with torch.autograd.set_multithreading_enabled(thread == "worker"):
            for name, fwd in cases.items():
                timed(f"fwd+bwd ({thread} thread): {name}", fwd_bwd(fwd), calls // 3)
    (out / "host_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
