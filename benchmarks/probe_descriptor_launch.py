"""Probe: which bound launches of eager attention take `_host_descriptors`' direct path (the
C launcher called with each address's descriptor encoded once), and their results against
the PyTorch reference on the calls after the binding one.

Prints, per eager plan of `attention` and `attention_packed`, each bound launch and whether
it encodes its host-made TMA descriptors itself (`encodes_descriptors`: True only for
kernels that take descriptors, on a Triton whose launcher has the form the module knows),
then the worst relative error of out, dq, dk, dv (d(qkv) packed) over three calls per shape.

    python3 benchmarks/probe_descriptor_launch.py
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton_transformer.attention as attention_module
from triton_transformer.attention import attention, attention_packed


def bound_launches(obj, seen: set, depth: int = 0) -> Iterator:
    """The bound launches reachable from `obj` (plans, their dicts, closures)."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if callable(obj) and hasattr(obj, "encodes_descriptors"):
        yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from bound_launches(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from bound_launches(v, seen, depth + 1)
    elif hasattr(obj, "__slots__") and not callable(obj):
        for s in obj.__slots__:
            yield from bound_launches(getattr(obj, s, None), seen, depth + 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for c in obj.__closure__:
            with contextlib.suppress(ValueError):  # an empty cell
                yield from bound_launches(c.cell_contents, seen, depth + 1)


def worst_error(fn, inputs: list[torch.Tensor], dout: torch.Tensor) -> float:
    """Worst relative error of fn's output and input gradients, Triton against reference."""
    results = []
    for use_triton in (True, False):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves, use_triton=use_triton)
        out.backward(dout)
        results.append([out.float()] + [t.grad.float() for t in leaves])
    return max(
        ((a - b).norm() / b.norm()).item() for a, b in zip(*results, strict=True)
    )  # fmt: skip


def main() -> None:
    dt, dev = torch.bfloat16, "cuda"
    for shape in ((2, 8, 32, 64), (1, 2, 512, 64)):
        q = torch.randn(*shape, device=dev, dtype=dt, requires_grad=True)
        for _ in range(3):
            attention(q, q, q, causal=True, use_triton=True).float().sum().backward()
    qkv = torch.randn(2, 512, 3 * 8 * 64, device=dev, dtype=dt, requires_grad=True)
    for _ in range(3):
        attention_packed(qkv, 8, causal=True, use_triton=True).float().sum().backward()
    for plans in (attention_module._EAGER_PLANS, attention_module._PACKED_PLANS):
        for key, plan in plans.plans.items():
            found = [(f.__qualname__, f.encodes_descriptors) for f in bound_launches(plan, set())]
            print(key[:1], found)

    torch.manual_seed(0)

    def causal(q, k, v, use_triton):
        return attention(q, k, v, causal=True, use_triton=use_triton)

    for shape in ((2, 8, 32, 64), (1, 2, 512, 64), (2, 4, 1024, 128), (1, 4, 333, 64)):
        worst = 0.0
        for _ in range(3):  # the calls after the first take the bound launches
            qkv3 = [torch.randn(*shape, device=dev, dtype=dt) + 0.3 for _ in range(3)]
            worst = max(worst, worst_error(causal, qkv3, torch.randn(*shape, device=dev, dtype=dt)))
        verdict = "OK" if worst < 2e-2 else "FAIL"
        print("direct path vs reference", shape, "worst rel err", f"{worst:.2e}", verdict)

    def packed(qkv, use_triton):
        return attention_packed(qkv, 8, causal=True, use_triton=use_triton)

    worst = 0.0
    for _ in range(3):
        qkv = torch.randn(2, 512, 3 * 8 * 64, device=dev, dtype=dt) + 0.3
        worst = max(
            worst, worst_error(packed, [qkv], torch.randn(2, 512, 512, device=dev, dtype=dt))
        )
    verdict = "OK" if worst < 2e-2 else "FAIL"
    print("packed direct path vs reference worst rel err", f"{worst:.2e}", verdict)


if __name__ == "__main__":
    main()
