"""Host cost of one op call on the eager path: µs per call at shapes whose GPU time is tiny.

Each op is called `--calls` times back to back without synchronising (the GPU work is far
shorter than the host's), then the device is synchronised: wall time / calls is what the host
pays per call (Python wrapper, validation, autograd, dispatcher, Triton's launcher). Forward
alone (inputs that require grad), forward under no_grad (inference), and forward+backward.
Run it against two checkouts to compare before/after, and with --torch for PyTorch eager:

    python3 benchmarks/bench_overhead.py --out DIR --label after
    PYTHONPATH=/path/to/old/checkout python3 benchmarks/bench_overhead.py --out DIR --label before
    python3 benchmarks/bench_overhead.py --out DIR --label torch --torch
    python3 benchmarks/bench_overhead.py --out DIR --label liger --liger

(the package is imported from PYTHONPATH first, so the second line measures the old code).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import common  # benchmarks/ is the script's directory, first on sys.path
import torch
import torch.nn.functional as F


def loss_of(out: torch.Tensor | tuple) -> torch.Tensor:
    """The scalar a forward + backward row backpropagates from: out.float().sum(), summed
    over the tensors of a tuple (rope's (q, k))."""
    if isinstance(out, tuple):
        return sum(o.float().sum() for o in out)
    return out.float().sum()


def cases(ops, use_triton: bool = True) -> dict:
    """The op calls timed: ours (use_triton) or the PyTorch reference of each (eager)."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    branch = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(512, device=dev, requires_grad=True)
    w_x = w.detach().to(dt).requires_grad_()
    wl = torch.randn(512, 512, device=dev, dtype=dt, requires_grad=True)
    w_in = torch.randn(2048, 512, device=dev, dtype=dt, requires_grad=True)
    w_out = torch.randn(512, 2048, device=dev, dtype=dt, requires_grad=True)
    s = torch.randn(2, 8, 32, 32, device=dev, dtype=dt, requires_grad=True)
    q = torch.randn(2, 8, 32, 64, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(2, 8, 32, 64, device=dev, dtype=dt, requires_grad=True)
    # 512 queries: where a Hopper GPU's eager backward takes the Gluon kernel (host-made TMA
    # descriptors) instead of the Triton one
    q512 = torch.randn(1, 2, 512, 64, device=dev, dtype=dt, requires_grad=True)
    qkv = torch.randn(2, 32, 3 * 8 * 64, device=dev, dtype=dt, requires_grad=True)
    logits = torch.randn(64, 256, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, 256, (64,), device=dev)
    # the model's embedding: fp32 tables, 2 x 32 token ids of 256, learned positions
    ids = torch.randint(0, 256, (2, 32), device=dev)
    w_emb = torch.randn(256, 512, device=dev, requires_grad=True)
    pos_emb = torch.randn(512, 512, device=dev, requires_grad=True)
    w_head = torch.randn(256, 512, device=dev, dtype=dt, requires_grad=True)
    return {
        # PyTorch's own: F.layer_norm with a weight in x's dtype (the PyTorch branch of ours,
        # which the 29th-39th sessions timed, casts x to the fp32 weight's dtype and back)
        "layernorm": (
            (lambda: ops.layernorm(x, w, use_triton=True))
            if use_triton
            else (lambda: F.layer_norm(x, (512,), w_x))
        ),
        # PyTorch's own: F.rms_norm, with a weight in x's dtype, which its fused kernel needs
        # (the PyTorch branch of ours composes it of several ops; the 29th-38th sessions timed
        # that one)
        "rmsnorm": (
            (lambda: ops.rmsnorm(x, w, use_triton=True))
            if use_triton
            else (lambda: F.rms_norm(x, (512,), w_x, 1e-5))
        ),
        # (h_new, y) of x + branch; y alone timed (PyTorch: the add, then F.rms_norm)
        "residual_rmsnorm": (
            (lambda: ops.residual_rmsnorm(x, branch, w, use_triton=True)[1])
            if use_triton
            else (lambda: F.rms_norm(x + branch, (512,), w_x, 1e-5))
        ),
        # (h_new, y) of x + branch; y alone timed (PyTorch: the add, then F.layer_norm)
        "residual_layernorm": (
            (lambda: ops.residual_layernorm(x, branch, w, use_triton=True)[1])
            if use_triton
            else (lambda: F.layer_norm(x + branch, (512,), w_x))
        ),
        "softmax causal": lambda: ops.softmax(s, causal=True, use_triton=use_triton),
        "linear": lambda: ops.linear(x, wl, use_triton=use_triton),
        "linear relu²": lambda: ops.linear(x, wl, activation="relu_squared", use_triton=use_triton),
        # a Llama feed-forward's fused input projection, (2·1024, 512) (PyTorch: F.linear, then
        # silu of one half times the other)
        "linear swiglu": (
            (lambda: ops.linear(x, w_in, activation="swiglu", use_triton=True))
            if use_triton
            else (lambda: _swiglu_torch(F.linear(x, w_in)))
        ),
        # the relu² feed-forward (PyTorch: its two linears, F.relu and the square between)
        "relu2_mlp": lambda: ops.relu2_mlp(x, w_in, w_out, use_triton=use_triton),
        "bmm": lambda: ops.bmm(s, q, use_triton=use_triton),
        # PyTorch's own: F.cross_entropy (the PyTorch branch of ours checks the labels first)
        "cross_entropy": (
            (lambda: ops.cross_entropy(logits, labels, use_triton=True))
            if use_triton
            else (lambda: F.cross_entropy(logits, labels))
        ),
        "dropout": lambda: ops.dropout(x, 0.1, use_triton=use_triton),
        # (PyTorch: F.embedding and the positions' add; ours checks its ids by default)
        "embedding": (
            (lambda: ops.embedding(ids, w_emb, pos_emb, use_triton=True))
            if use_triton
            else (lambda: F.embedding(ids, w_emb) + pos_emb[:32])
        ),
        # the output projection and the loss (PyTorch: F.linear, then F.cross_entropy of the
        # logits in fp32; ours checks its labels by default)
        "linear_cross_entropy": (
            (lambda: ops.linear_cross_entropy(x, w_head, labels, use_triton=True))
            if use_triton
            else (lambda: F.cross_entropy(F.linear(x, w_head).float(), labels))
        ),
        "attention causal": lambda: ops.attention(q, q, q, causal=True, use_triton=use_triton),
        # the model's: q, k, v read from one (b, n, 3·h·d) projection, d(qkv) written whole
        "attention_packed causal": lambda: ops.attention_packed(
            qkv, 8, causal=True, use_triton=use_triton
        ),
        "attention causal 512": lambda: ops.attention(
            q512, q512, q512, causal=True, use_triton=use_triton
        ),
        # q and k of (2, 8, 32, 64), both rotated (PyTorch: our reference, composed in fp32)
        "rope": lambda: ops.rope(q, k, use_triton=use_triton),
    }


def _swiglu_torch(pre: torch.Tensor) -> torch.Tensor:
    gate, up = pre.chunk(2, dim=-1)
    return F.silu(gate) * up


def ops_of(package: str) -> type:
    """The public op functions `cases` calls, from `package`'s modules (the project's, or
    another checkout's imported under another name: `probe_host_ab.py`)."""
    mods = {m: importlib.import_module(f"{package}.{m}") for m in (
        "attention", "bmm", "cross_entropy", "dropout", "embedding", "layernorm",
        "linear_cross_entropy", "mlp", "residual_layernorm", "rmsnorm", "rope", "softmax",
    )}  # fmt: skip

    class ops:
        layernorm, softmax = mods["layernorm"].layernorm, mods["softmax"].softmax
        rmsnorm = mods["rmsnorm"].rmsnorm
        residual_rmsnorm = mods["rmsnorm"].residual_rmsnorm
        residual_layernorm = mods["residual_layernorm"].residual_layernorm
        linear, bmm = mods["bmm"].linear, mods["bmm"].bmm
        cross_entropy, dropout = mods["cross_entropy"].cross_entropy, mods["dropout"].dropout
        attention = mods["attention"].attention
        attention_packed = mods["attention"].attention_packed
        relu2_mlp = mods["mlp"].relu2_mlp
        rope = mods["rope"].rope
        embedding = mods["embedding"].embedding
        linear_cross_entropy = mods["linear_cross_entropy"].linear_cross_entropy

    return ops


def liger_cases() -> dict:
    """The same calls through Liger-Kernel's functions, for the ops it has (layernorm with a
    bias, as Liger's takes one; rmsnorm and its fused residual add, out of place; softmax
    without a causal mask; cross-entropy; relu² after torch's matmul)."""
    from liger_kernel.transformers import functional as lf

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(512, device=dev, dtype=dt, requires_grad=True)
    b = torch.zeros(512, device=dev, dtype=dt, requires_grad=True)
    branch = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    wl = torch.randn(512, 512, device=dev, dtype=dt, requires_grad=True)
    s = torch.randn(2, 8, 32, 32, device=dev, dtype=dt, requires_grad=True)
    logits = torch.randn(64, 256, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, 256, (64,), device=dev)
    return {
        "layernorm": lambda: lf.liger_layer_norm(x, w, b, 1e-5),
        "rmsnorm": lambda: lf.liger_rms_norm(x, w, 1e-6, in_place=False),
        # (y, h_new) of branch + x, y alone timed as ours
        "residual_rmsnorm": lambda: lf.liger_fused_add_rms_norm(branch, x, w, 1e-6, in_place=False)[
            0
        ],
        "softmax causal": lambda: lf.liger_softmax(s),  # Liger's has no causal mask
        "linear relu²": lambda: lf.liger_relu_squared(x @ wl.t()),
        "cross_entropy": lambda: lf.liger_cross_entropy(logits, labels),
    }


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    return common.wall_us(fn, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--label", default="after")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument(
        "--torch", action="store_true", help="time the PyTorch references (use_triton=False)"
    )
    ap.add_argument("--liger", action="store_true", help="time Liger-Kernel's ops (if installed)")
    ap.add_argument(
        "--no-gluon",
        action="store_true",
        help="eager attention backwards take the Triton kernel (the Gluon ones turned off)",
    )
    ap.add_argument("--ops", nargs="*", default=None, help="only these ops (names as printed)")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="OP",
        help="print a cProfile of OP's forward+backward (calling thread)",
    )
    args = ap.parse_args()

    ops = ops_of("triton_transformer")

    if args.no_gluon:
        import triton_transformer.attention_hopper as attention_hopper
        import triton_transformer.attention_hopper_bwd_ws as attention_hopper_bwd_ws

        attention_hopper.ENABLED = attention_hopper_bwd_ws.ENABLED = False
    rows = []
    timed = liger_cases() if args.liger else cases(ops, use_triton=not args.torch)
    for name, fwd in timed.items():
        if args.ops is not None and name not in args.ops:
            continue

        def fwd_bwd(fwd=fwd):
            loss_of(fwd()).backward()

        def fwd_no_grad(fwd=fwd):
            with torch.no_grad():
                return fwd()

        try:
            row = {"op": name, "fwd_us": per_call_us(fwd, args.calls)}
            row["fwd_no_grad_us"] = per_call_us(fwd_no_grad, args.calls)  # inference
            row["fwd+bwd_us"] = per_call_us(fwd_bwd, args.calls // 3)
            # the same with autograd's backward on the calling thread (the trainer's setting):
            # the difference is what handing the backward to autograd's device thread costs
            with torch.autograd.set_multithreading_enabled(False):
                row["fwd+bwd_calling_thread_us"] = per_call_us(fwd_bwd, args.calls // 3)
            if name == args.profile:  # on the calling thread, where cProfile sees it
                with torch.autograd.set_multithreading_enabled(False):
                    common.host_profile(fwd_bwd, args.calls // 3, 30, f"{name} fwd+bwd")
        except Exception as e:  # an op the old checkout lacks must not stop the rest
            row = {"op": name, "error": repr(e)[:200]}
        rows.append(row)
        print(args.label, json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"overhead_{args.label}.json").write_text(
        json.dumps(
            {"package": importlib.import_module(ops.layernorm.__module__).__file__, "rows": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
