"""Probe: the least host time an eager op written in Python can cost, against PyTorch's own.

#20 asks an eager forward + backward of every op to cost at most PyTorch's own plus ~15 µs
of host time. Our ops are `autograd.Function`s whose forward and backward launch Triton
kernels from Python; PyTorch's are C++ autograd nodes launching from C++. This probe strips
our layernorm down to what no Python op can skip and times each step, paired: every round
runs every case once, and a table cell is the median over rounds of the case's difference
to PyTorch's op in the same round (this host's speed moves more between rounds than the
differences measured). Cases, forward + backward with the `out.float().sum().backward()`
tail of `bench_overhead.py`, at a shape where the GPU never limits:

- PyTorch: `x.neg()` (one allocation and one kernel each way) and `F.layer_norm`;
- the least Python op: a Function with one allocation each way and no launch, then with one
  launch each way of a kernel that does nothing, (a) through Triton's C launcher called
  with addresses and nothing around it (the floor of any Python launch), (b) through
  `KernelLauncher.bind`'s bound launch (what our ops call);
- our layernorm's shape stripped bare: a Function with its allocations and saved tensors
  and no checks, plan key or gradient targets, with no launches, with its three launches
  through the C-launcher floor, and through the bound launches our layernorm holds;
- our layernorm.

The floor launches need Triton 3.6's C launcher (`_host_descriptors.plain_launch`); they
are read from the bound launches' closures (`utils.KernelLauncher.bind`,
`layernorm._bwd_launches`), and left out where those have another form.

    python3 benchmarks/probe_python_floor.py --out DIR [--rounds 41] [--calls 150]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from triton_transformer import layernorm as ln
from triton_transformer.utils import launcher

M, N = 64, 512
DTYPE = torch.bfloat16


def _closure(fn: Callable) -> dict:
    """The variables a closure holds, by name (an empty cell, a branch not taken, left out)."""
    cells = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        with contextlib.suppress(ValueError):
            cells[name] = cell.cell_contents
    return cells


def _floor_launch(bound: Callable) -> Callable | None:
    """A bound launch's kernel launched through Triton 3.6's C launcher with the tensors'
    addresses: no device or hook check, no driver query per pointer (None where the bound
    launch does not call that launcher with its tensors first)."""
    c = _closure(bound)
    if c.get("c_launch") is None or not c.get("n_lead"):
        return None
    c_launch, stream, device = c["c_launch"], torch._C._cuda_getCurrentRawStream, c["device"]
    grid = (c["g0"], c["g1"], c["g2"])
    between = (c["function"], c["coop"], c["pdl"], None, None, c["metadata"], None, None, None)
    scalars = (*c["fixed"], *c["tail"])

    def launch(*tensors: torch.Tensor) -> None:
        c_launch(*grid, stream(device), *between, *[t.data_ptr() for t in tensors], *scalars)

    return launch


@triton.jit
def _nothing(p0):
    pass


def _one_launch_function(launch: Callable | None) -> type[torch.autograd.Function]:
    """One allocation and `launch` of it each way (none where None): `x.neg()`'s shape."""

    class OneLaunch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.empty(size=(M, N), dtype=DTYPE, device=x.device)
            if launch is not None:
                launch(y)
            return y

        @staticmethod
        def backward(ctx, dy):
            dx = torch.empty(size=(M, N), dtype=DTYPE, device=dy.device)
            if launch is not None:
                launch(dx)
            return dx

    return OneLaunch


def _bare_layernorm(fwd: Callable | None, bwd: Callable | None) -> type[torch.autograd.Function]:
    """Our layernorm (no bias) without its glue: the allocations, the saved tensors, and
    `fwd` / `bwd` called as `_EagerPlan` calls its bound launches (none where None)."""

    class BareLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y = torch.empty(size=(M, N), dtype=DTYPE, device=x.device)
            stats = torch.empty(size=(2, M), dtype=torch.float32, device=x.device)
            if fwd is not None:
                fwd(x, w, w, y, stats, x, x, stats)
            ctx.save_for_backward(x, w, stats)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, stats = ctx.saved_tensors
            dx = torch.empty(size=(M, N), dtype=DTYPE, device=dy.device)
            dw = torch.empty_like(w)
            if bwd is not None:
                bwd(x, w, dy, dx, stats, dy, dx, stats, dw, dw)
            return dx, dw

    return BareLayerNorm


def _layernorm_floor_launches(fwd: Callable, bwd: Callable) -> tuple[Callable, Callable] | None:
    """(forward, backward): a layernorm plan's bound launches `fwd` and `bwd` through the
    C-launcher floor, the backward's work buffer allocated per call as the bound one does;
    None where unavailable."""
    b = _closure(bwd)
    fwd = _floor_launch(fwd)
    if fwd is None or b.get("rowsums_shape") is not None or "main" not in b:
        return None
    main, colsum = _floor_launch(b["main"]), _floor_launch(b["colsum"])
    if main is None or colsum is None:
        return None
    partial_shape = b["partial_shape"]

    def backward(x2, weight, dy2, dx2, stats, dhn2, dbr2, seed, dweight, dbias):
        partial = torch.empty(size=partial_shape, dtype=torch.float32, device=x2.device)
        main(x2, weight, dy2, dx2, partial, stats, dhn2, dbr2, seed)
        colsum(partial, dweight, dbias)

    return fwd, backward


def main() -> None:
    def add_args(ap):
        ap.add_argument("--rounds", type=int, default=41)
        ap.add_argument("--calls", type=int, default=150)

    args, out = common.parse_out(__doc__, add_args)
    x = torch.randn(M, N, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.randn(N, device="cuda", requires_grad=True)
    w_x = w.detach().to(DTYPE).requires_grad_()

    def ours():
        return ln.layernorm(x, w, use_triton=True)

    for _ in range(3):  # the plan and its bound launches
        ours().float().sum().backward()
    (plan,) = [p for p in ln._EAGER_PLANS.plans.values() if p.shape == x.shape]
    ((plan_bwd,),) = [tuple(plan.bwd.values())]
    nothing = launcher(_nothing).bind((1,), x.detach())
    floor_nothing = _floor_launch(nothing)
    floor_ln = _layernorm_floor_launches(plan.fwd, plan_bwd)

    cases = {
        "x.neg()": lambda: x.neg(),
        "F.layer_norm": lambda: F.layer_norm(x, (N,), w_x),
        "Function, one allocation each way": _one_launch_function(None).apply,
        "Function, + one launch each way, C-launcher floor": (
            floor_nothing and _one_launch_function(floor_nothing).apply
        ),
        "Function, + one launch each way, bound launch": _one_launch_function(nothing).apply,
        "bare layernorm, no launches": _bare_layernorm(None, None).apply,
        "bare layernorm, C-launcher floor launches": (
            floor_ln and _bare_layernorm(*floor_ln).apply
        ),
        "bare layernorm, bound launches": _bare_layernorm(plan.fwd, plan_bwd).apply,
        "our layernorm": ours,
    }
    inputs = {  # the Functions' arguments
        "Function, one allocation each way": (x,),
        "Function, + one launch each way, C-launcher floor": (x,),
        "Function, + one launch each way, bound launch": (x,),
        "bare layernorm, no launches": (x, w),
        "bare layernorm, C-launcher floor launches": (x, w),
        "bare layernorm, bound launches": (x, w),
    }
    bodies = {}
    for name, fwd in cases.items():
        if fwd is None:
            print(f"{name}: left out (no Triton 3.6 C launcher here)")
            continue
        call = (lambda f=fwd, a=inputs[name]: f(*a)) if name in inputs else fwd
        bodies[name] = lambda c=call: c().float().sum().backward()

    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for thread in ("calling", "worker"):
            with torch.autograd.set_multithreading_enabled(thread == "worker"):
                for name, body in bodies.items():
                    for _ in range(5):
                        body()
                    us = common.wall_us(body, args.calls)
                    times.setdefault(thread, {}).setdefault(name, []).append(us)

    lines = [
        f"# The floor of a Python op: µs per forward + backward ({args.rounds} rounds of "
        f"{args.calls} calls; {common.env_info()})",
    ]
    for thread, by_case in times.items():
        lines += [
            "",
            f"## Backward on the {thread} thread",
            "",
            "| case | median / min | − x.neg(), per round | − F.layer_norm, per round |",
            "|---|---|---|---|",
        ]
        for name, v in by_case.items():
            diffs = [
                statistics.median(a - b for a, b in zip(v, by_case[ref], strict=True))
                for ref in ("x.neg()", "F.layer_norm")
            ]
            lines.append(
                f"| {name} | {statistics.median(v):.1f} / {min(v):.1f} | {diffs[0]:+.1f} | "
                f"{diffs[1]:+.1f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "python_floor.md").write_text(text)
    (out / "python_floor.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
