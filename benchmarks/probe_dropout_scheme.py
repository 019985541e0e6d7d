"""Probe of the one dropout mask scheme (`_jit_helpers.dropout_keep_tile`) in the kernels that
took it over: `dropout` and the residual LayerNorm / RMSNorm with branch dropout, bf16, p = 0.1,
kernel time (L2 flushed) against eager PyTorch and torch.compile of the same expression.

Run it once per source tree to compare versions in one call (`--tree` is put first on the
import path; each run appends its rows to OUT/dropout_scheme.json under its label):

    python3 benchmarks/probe_dropout_scheme.py --out DIR --label after
    python3 benchmarks/probe_dropout_scheme.py --out DIR --label before --tree .before

Bytes counted (each input read once, each output written once): dropout 2·n·e each way;
residual norm fwd 4·M·N·e (h, branch, h_new, y), fwd+bwd 4 + 4 more (dy, dh_new, dh, dbranch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    ap.add_argument("--label", default="after")
    ap.add_argument("--tree", type=Path, default=HERE.parent, help="source tree to import")
    ap.add_argument("--others", action="store_true", help="also eager and compile")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(args.tree.resolve()))

    import common
    import torch
    import torch.nn.functional as F

    from triton_transformer.dropout import dropout
    from triton_transformer.residual_layernorm import residual_layernorm
    from triton_transformer.rmsnorm import residual_rmsnorm

    p, dtype, dev = 0.1, torch.bfloat16, "cuda"
    copy_gbps = common.ceilings()["copy_gbps"]
    rows: list[dict] = []

    def record(op, shape, mode, provider, fn, nbytes) -> None:
        ms = common.kernel_ms(fn)
        row = {"label": args.label, "op": op, "shape": "x".join(map(str, shape)), "mode": mode,
               "provider": provider, "ms": ms, "GB/s": nbytes / ms / 1e6,
               "frac": nbytes / ms / 1e6 / copy_gbps}  # fmt: skip
        rows.append(row)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    # dropout, 2**26 elements
    n = 1 << 26
    x = torch.randn(n, device=dev).to(dtype).requires_grad_()
    dy = torch.randn(n, device=dev).to(dtype)
    e = x.element_size()
    providers = {"ours": lambda t: dropout(t, p, use_triton=True)}
    if args.others:
        providers["torch"] = lambda t: F.dropout(t, p)
        providers["compile"] = common.compiled(lambda t: F.dropout(t, p))
    for name, f in providers.items():
        record("dropout", (n,), "fwd", name, lambda f=f: f(x), 2 * n * e)
        y = f(x)
        record("dropout", (n,), "bwd", name,
               lambda y=y: torch.autograd.grad(y, x, dy, retain_graph=True), 2 * n * e)  # fmt: skip

    # residual add + dropout + norm, at the GPT-2 preset's rows and a wide one
    def eager_ln(h, br, w, b):
        h_new = h + F.dropout(br, p)
        return h_new, F.layer_norm(h_new, (h.shape[-1],), w, b)

    def eager_rms(h, br, w):
        h_new = h + F.dropout(br, p)
        return h_new, F.rms_norm(h_new, (h.shape[-1],), w)

    def residual_norms(M: int, N: int) -> None:
        h = torch.randn(M, N, device=dev, dtype=dtype).requires_grad_()
        br = torch.randn(M, N, device=dev, dtype=dtype).requires_grad_()
        # weights in the activations' dtype: F.layer_norm takes no fp32 weight with bf16 rows
        w = (torch.rand(N, device=dev) + 0.5).to(dtype).requires_grad_()
        b = torch.randn(N, device=dev, dtype=dtype).requires_grad_()
        grads = (torch.randn_like(h), torch.randn_like(h))
        ln_c, rms_c = common.compiled(eager_ln), common.compiled(eager_rms)
        ops = {
            "residual_layernorm": {
                "ours": lambda: residual_layernorm(h, br, w, b, dropout_p=p, use_triton=True),
                "torch": lambda: eager_ln(h, br, w, b),
                "compile": lambda: ln_c(h, br, w, b),
            },
            "residual_rmsnorm": {
                "ours": lambda: residual_rmsnorm(h, br, w, dropout_p=p, use_triton=True),
                "torch": lambda: eager_rms(h, br, w),
                "compile": lambda: rms_c(h, br, w),
            },
        }
        for op, fns in ops.items():
            for name, f in fns.items():
                if name == "ours" or args.others:
                    record(op, (M, N), "fwd", name, f, 4 * M * N * e)
                    fwd_bwd = lambda f=f: torch.autograd.backward(f(), grads)
                    record(op, (M, N), "fwd+bwd", name, fwd_bwd, 8 * M * N * e)

    for M, N in ((16384, 768), (8192, 4096)):
        residual_norms(M, N)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "dropout_scheme.json"
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
