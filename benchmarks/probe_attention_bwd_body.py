"""Probe: where the single-pass attention backward's time goes, by variants of its body.

Each variant is `triton_transformer/attention.py` with one edit, loaded as a module of its own
(its torch.library ops renamed), and timed as the packed op launches its backward (delta
kernel, main kernel, dQ cast; causal, d 64, bf16, dropout 0) at the step presets' attention
shapes, against cuDNN's backward in the same run. Kernel time, L2 flushed.

- shipped: the kernel as it is;
- no_dq: without dQ (its product and its TMA reduction): what dK and dV alone cost;
- dq_store: dQ's tile stored by TMA instead of added (wrong results): the reduction's cost
  over a plain store;
- dq_first: dQ's product and reduction issued before the dV and dK products, so the bulk
  reduction overlaps them (correct results; checked against the shipped kernel);
- dp_first: dO Vᵀ issued before Q Kᵀ, so that the exponentials may overlap its product.

    python3 benchmarks/probe_attention_bwd_body.py --out DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common
from probe_attention_bwd_tiles import cudnn_attention

SOURCE = Path(__file__).resolve().parents[1] / "triton_transformer" / "attention.py"
SHAPES = {"enwik8": (16, 512, 8), "gpt2": (16, 1024, 12), "large": (8, 2048, 16)}  # b, n, h
D = 64

_DQ_BLOCK = """        if ATOMIC_DQ:
            dq = _mm(tl.trans(dsT), k, None, IEEE)  # (BLOCK_M, BLOCK_D)
            if DQ_TMA:  # rows >= n_q and columns >= HEAD_DIM fall outside: clipped
                dq_acc.atomic_add([start_m, 0], dq)
            else:
                dq_ptrs = dq_acc + rows_m[:, None] * HEAD_DIM + offs_d[None, :]
                tl.atomic_add(dq_ptrs, dq, mask=mask, sem="relaxed")
"""
_DV_DK = """        dv = _mm(pdT.to(do.dtype), do, dv, IEEE)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = _mm(dsT, q, dk, IEEE)
"""
_DS_ONLY = """        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
"""
_DV_DK_AFTER = """        dv = _mm(pdT.to(do.dtype), do, dv, IEEE)
        dk = _mm(dsT, q, dk, IEEE)
"""
_QK = """        qkT = _mm(k, tl.trans(q), None, IEEE) * qk_scale  # (BLOCK_N, BLOCK_M)
"""
_DP = """        dpT = _mm(v, tl.trans(do), None, IEEE)  # (dO Vᵀ)ᵀ
"""
VARIANTS = {
    "shipped": [],
    "no_dq": [(_DQ_BLOCK, "")],
    "dq_store": [("dq_acc.atomic_add([start_m, 0], dq)", "dq_acc.store([start_m, 0], dq)")],
    "dq_first": [(_DV_DK + _DQ_BLOCK, _DS_ONLY + _DQ_BLOCK + _DV_DK_AFTER)],
    "dp_first": [(_DP, ""), (_QK, _DP + _QK)],
}


def backward(mod, b: int, n: int, h: int):
    """A closure launching `mod`'s backward on packed qkv (as the model calls it), and the
    (dq, dk, dv) it writes."""
    qkv = torch.randn(b, n, 3, h, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = D**-0.5
    out, lse = mod.launch_attention_fwd(q, k, v, None, None, True, scale, 0.0, True)
    dout = torch.randn_like(out)
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = (t.transpose(1, 2) for t in dqkv.unbind(2))

    def run():
        mod.launch_attention_bwd(
            dout, q, k, v, out, lse, None, None, True, scale, 0.0, dq, dk, dv, grads_base=dqkv
        )

    return run, dqkv


def main() -> None:
    _, out_dir = common.parse_out(__doc__)
    env = common.env_info()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mods = {
            name: common.module_copy(SOURCE, f"attention_{name}", Path(tmp), edits)
            for name, edits in VARIANTS.items()
        }
        for preset, (b, n, h) in SHAPES.items():
            row = dict(preset=preset, b=b, n=n, h=h)
            torch.manual_seed(0)
            ref_run, ref_grads = backward(mods["shipped"], b, n, h)
            ref_run()
            for name, mod in mods.items():
                torch.manual_seed(0)  # the same inputs as the shipped kernel's
                run, grads = backward(mod, b, n, h)
                run()
                err = ((grads.float() - ref_grads.float()).norm() / ref_grads.float().norm()).item()
                row[name] = common.kernel_ms(run) * 1e3
                row[f"{name}_rel_err"] = err
            row["cudnn"] = common.kernel_ms(cudnn_attention(b, n, h, 0.0)[1]) * 1e3
            rows.append(row)
            print(row, flush=True)
    names = list(VARIANTS)
    lines = [f"# Attention backward body variants ({env})", ""]
    lines += ["µs per backward (delta, main kernel, dQ cast), causal d64 bf16; in brackets the"]
    lines += ["relative error of d(qkv) against the shipped kernel's", ""]
    lines += ["| preset | " + " | ".join(names) + " | cuDNN |", "|---|" + "---|" * (len(names) + 1)]
    for r in rows:
        cells = [f"{r[k]:.1f} ({r[k + '_rel_err']:.0e})" for k in names]
        lines.append(f"| {r['preset']} | " + " | ".join(cells) + f" | {r['cudnn']:.1f} |")
    (out_dir / "attention_bwd_body.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    (out_dir / "attention_bwd_body.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
