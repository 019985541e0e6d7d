"""Builders shared by the training, CLI and distributed tests (imported as `helpers`: pytest
puts tests/ on sys.path, and so does running a test file as a worker script)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton_transformer._gluon import HAVE_GLUON
from triton_transformer.training.config import Config, apply_overrides


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(on) inside the block (warn_only: other ops of the
    test may have no deterministic kernel), restored after it."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def run_without_interpreter(*args: str) -> subprocess.CompletedProcess:
    """`python *args` in a subprocess with TRITON_INTERPRET=0 (the kernels are JITFunctions,
    which torch.library traces and Triton compiles for a named GPU) and the repository on
    the path."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )


# Python source that makes Triton compile for sm_90 without a GPU: a stand-in driver whose
# target is Hopper (front end and NVIDIA back end to PTX). Prepended to compile-check scripts.
SM90_DRIVER = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver

class Sm90(CudaDriver):
    def __init__(self):
        self.utils = None
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_current_device(self):
        return 0
    def get_current_stream(self, device=None):
        return 0

triton.runtime.driver.set_active(Sm90())
"""


def check_compiles(script: str, expected_ok: int) -> None:
    """Run a compile-check script (`SM90_DRIVER` + code printing "ok" per kernel compiled)
    without the interpreter: it must exit cleanly having printed `expected_ok` oks."""
    proc = run_without_interpreter("-c", script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == expected_ok, proc.stdout


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# tests of the Gluon kernels (`attention_hopper`, `matmul_hopper`): Gluon present; on_hopper:
# a GPU test that also needs a Hopper GPU (their only target)
needs_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")


def on_hopper(test):
    """A GPU test that needs Gluon and a Hopper GPU."""
    test = pytest.mark.skipif(not _is_hopper(), reason="Hopper only")(needs_gluon(test))
    return pytest.mark.gpu(test)


def check_launches_bound_per_shape(
    plans: dict, run, x: torch.Tensor, relaid: torch.Tensor, relaid_plans: int
) -> None:
    """The bound-launch protocol of an op whose eager call binds one forward and one backward
    plan (`utils.LaunchPlans`; `plans` is its `.plans`): `run(x)` calls the op forward and
    backward on x and returns the outputs and gradients. The first call of a shape binds both;
    a later call with new tensors of the same layout takes them and gives, bit for bit, what
    launches looked up afresh give; another dtype binds its own two; `relaid`, x's values in
    another layout or alignment, gives the same results within rounding, leaving
    `relaid_plans` in all (some backwards read only dense tensors the op made, and keep
    theirs)."""
    from triton_transformer.utils import clear_launch_plans  # after TRITON_INTERPRET is set

    run(x)
    assert len(plans) == 2
    other = x * 1.5 - 0.25  # new tensors, new values
    bound = run(other)
    assert len(plans) == 2
    clear_launch_plans()
    for got, want in zip(bound, run(other), strict=True):
        assert torch.equal(got, want)
    run(other.half())
    assert len(plans) == 4
    for got, want in zip(run(relaid.copy_(other)), bound, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(plans) == relaid_plans


def check_grads_fold_alike(forward, params: list[torch.Tensor], dys: list[torch.Tensor]) -> None:
    """Backwards of forward(*leaves) for each upstream gradient in dys, with the parameters as
    fresh leaves, outside and inside `bmm.accumulate_grads_in_place` (each backward's
    parameter gradients added into `.grad` in place): the same `.grad` sums."""
    from triton_transformer.bmm import accumulate_grads_in_place

    grads = {}
    for in_place in (False, True):
        leaves = [p.detach().requires_grad_() for p in params]
        with accumulate_grads_in_place() if in_place else contextlib.nullcontext():
            for dy in dys:
                forward(*leaves).backward(dy)
        grads[in_place] = [leaf.grad for leaf in leaves]
    for got, want in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def record_calls(monkeypatch, module, name: str, record=lambda *args, **kwargs: args[0].shape):
    """Replace `module.name` for the test with a wrapper that appends `record(*args,
    **kwargs)` (by default the first argument's shape) to the returned list, then calls the
    real function: which launches a test's code made, and with what. A launch function that
    returns its launch bound for the next call of a shape (`utils.KernelLauncher.bind`, taken
    from an op's `LaunchPlans`) has each call of that recorded too."""
    calls = []
    real = getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        result = real(*args, **kwargs)
        if not callable(result):
            return result

        def again(*args, **kwargs):
            calls.append(record(*args, **kwargs))
            return result(*args, **kwargs)

        return again

    monkeypatch.setattr(module, name, recorded)
    return calls


def compile_trace_check(*groups: str) -> tuple[bool, int, str]:
    """tests/_compile_trace_check.py over `groups` (see its docstring): (every case passed,
    the number of cases run, the output to show on failure)."""
    script = Path(__file__).with_name("_compile_trace_check.py")
    return trace_check_result(run_without_interpreter(str(script), *groups))


def trace_check_result(proc: subprocess.CompletedProcess) -> tuple[bool, int, str]:
    """(exit status 0, the "OK"/"FAIL" lines printed, the output) of a trace-check run."""
    cases = [ln for ln in proc.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
    return proc.returncode == 0, len(cases), proc.stdout + proc.stderr[-3000:]


class _KernelAnalysisFailures(logging.Handler):
    """Collects torch's warnings that its analysis of which arguments a user-defined Triton
    kernel writes failed (it reads the kernel's Triton IR)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "assuming every input is mutated" in message:
            self.failures.append(message.splitlines()[-1][:300])


@contextlib.contextmanager
def kernel_analysis_failures() -> Iterator[list[str]]:
    """The messages of torch's failed kernel-mutation analyses inside the block. Where the
    analysis fails, torch assumes every argument of the kernel is written, and inductor then
    copies each view the kernel reads: no error, a slower compiled step (the enwik8 step:
    20% on an H200, when the attention kernels called `.to` on a size argument that torch
    2.11 passes there as a Python int)."""
    from torch._higher_order_ops import triton_kernel_wrap

    handler = _KernelAnalysisFailures()
    logger = triton_kernel_wrap.log  # the logger it warns on ("torch._dynamo" in torch 2.13)
    logger.addHandler(handler)
    try:
        yield handler.failures
    finally:
        logger.removeHandler(handler)


class CountAdds(TorchDispatchMode):
    """Counts the adds (`aten.add` / `aten.add_`) whose output is shaped `shape` inside the
    context: autograd's accumulation of a weight's gradient into `.grad` is one."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_):
            self.adds += tuple(out.shape) == self.shape
        return out


# Norm-wise relative error allowed against float64 (fp32 uses ieee products, not tf32).
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere fails every comparison."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def pretend_gpu(monkeypatch, major: int, num_sms: int, name: str) -> None:
    """The matmul planner (`matmul_plan._plan`) reads the device's compute capability, SM count
    and name from torch.cuda.get_device_properties: plan for another GPU (or without one)."""
    # a real GPU's lazy CUDA initialisation first: run inside the pretence (a test that is the
    # first of its pytest worker to touch CUDA), its capability check read these properties
    # and failed
    if torch.cuda.is_available():
        torch.cuda.init()
    props = types.SimpleNamespace(major=major, minor=0, multi_processor_count=num_sms, name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


# A model and run small enough for CPU: trains 12 steps in about a second.
TINY = {
    "model.dim": 32,
    "model.depth": 1,
    "model.heads": 2,
    "model.dim_head": 16,
    "model.max_seq_len": 32,
    "model.attn_dropout": 0.1,
    "model.ff_dropout": 0.1,
    "train.seq_len": 32,
    "train.batch_size": 4,
    "train.grad_accum_steps": 2,
    "train.max_steps": 12,
    "train.lr": 3e-3,
    "train.warmup_steps": 3,
    "train.device": "cpu",
    "eval.eval_every": 0,
    "eval.max_bytes": 256,
    "eval.generate_every": 0,
    "eval.prime_len": 8,
    "eval.generate_len": 8,
    "log.log_every": 1,
    "log.checkpoint_every": 0,
    "log.progress": False,
}


def tiny_overrides(run_dir: Path, corpus_file: Path, **overrides) -> dict:
    """`TINY` on `corpus_file` into `run_dir`, with `section__key=value` overrides."""
    values = {**TINY, "data.source": str(corpus_file), "log.run_dir": str(run_dir)}
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return values


def tiny_config(run_dir: Path, corpus_file: Path, **overrides) -> Config:
    """A validated `Config` of `tiny_overrides`."""
    values = tiny_overrides(run_dir, corpus_file, **overrides)
    return apply_overrides(Config(), list(values.items())).validate()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def philox_keep_mask(seed: int, n_rows: int, n_cols: int, p: float) -> torch.Tensor:
    """The package's one dropout mask scheme (`_jit_helpers.dropout_keep_tile`), computed
    independently in NumPy: element (row, col) of an (n_rows, n_cols) matrix is kept when
    16-bit half col % 8 of Philox4x32-7 (key = seed, counter = row · ⌈n_cols / 8⌉ + col // 8,
    as Triton's `randint4x`) is >= round(p · 2**16). Returns an (n_rows, n_cols) bool tensor."""
    import numpy as np

    m32 = np.uint64(0xFFFFFFFF)
    groups = -(-n_cols // 8)
    counter = (np.arange(n_rows, dtype=np.uint64)[:, None] * np.uint64(groups)
               + np.arange(groups, dtype=np.uint64)[None, :])  # fmt: skip
    c0, c1 = counter & m32, counter >> np.uint64(32)
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed) & m32, (np.uint64(seed) >> np.uint64(32)) & m32
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(7):
        prod_a, prod_b = round_a * c0, round_b * c2  # 32 x 32 bits: exact in uint64
        c0, c2 = (prod_b >> np.uint64(32)) ^ c1 ^ k0, (prod_a >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = prod_b & m32, prod_a & m32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    words = np.stack([c0, c1, c2, c3], axis=-1)  # (rows, groups, 4)
    halves = np.stack([words & np.uint64(0xFFFF), words >> np.uint64(16)], axis=-1)
    uniforms = halves.reshape(n_rows, groups * 8)[:, :n_cols].astype(np.int64)
    return torch.from_numpy(uniforms >= round(p * 2**16))
