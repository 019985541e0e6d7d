"""Helpers shared by the RMSNorm, RoPE, SwiGLU and modern-block tests."""

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

LOW_PRECISION = [torch.float16, torch.bfloat16]
# Row-wise relative tolerance against float64 per input dtype.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def assert_close(actual, expected, tol, name=""):
    """Row-wise (last dim) relative error <= tol against a float64 result; NaN/inf fail."""
    assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
    a = actual.double()
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    if a.numel() == 0:
        return
    n = a.shape[-1]
    err = (a - expected.double()).reshape(-1, n).norm(dim=-1)
    bound = tol * expected.double().reshape(-1, n).norm(dim=-1) + 1e-3 * tol * math.sqrt(n)
    bad = (err > bound).nonzero().flatten().tolist()
    assert not bad, f"{name}: rows {bad[:5]}: |diff| {err[bad[:5]]} > {bound[bad[:5]]}"


def grads(fn, leaves, cotangents):
    """(outputs, grads of leaves) of fn(*leaves) for the given output cotangents."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    gs = torch.autograd.grad(
        out, leaves, [c.to(o.dtype) for o, c in zip(out, cotangents, strict=True)]
    )
    return out, gs


def run_trace_check() -> subprocess.CompletedProcess:
    """tests/_modern_trace_check.py in a subprocess with TRITON_INTERPRET=0."""
    script = Path(__file__).with_name("_modern_trace_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
