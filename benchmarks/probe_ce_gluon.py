"""Probe: the in-place cross-entropy forward of long rows (the model's loss: loss and gradient
in one kernel, the gradient written over the logits), `cross_entropy_hopper`'s Gluon kernel
against `cross_entropy`'s Triton kernel and Liger-Kernel's, at the fused loss's chunk (4,096
rows of GPT-2's 50,304 classes) and the unfused loss's shapes.

The Gluon kernel copies each row into shared memory once (one read, one write of the logits);
the Triton kernel reads each row twice. Kernel time, L2 flushed; GB/s count one read and one
write of the logits, against the copy ceiling of the same run. The Gluon kernel is swept over
warps per program (`NUM_WARPS`) and box heights (`BOX_ROWS`).

    python3 benchmarks/probe_ce_gluon.py --out DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

import triton_transformer.cross_entropy_hopper as ceh
from triton_transformer.cross_entropy import cross_entropy_inplace_op

SHAPES = ((4096, 50304), (16384, 50304), (8192, 32000), (4096, 100352))  # rows, vocabulary
WARPS = (2, 4, 8)
BOXES = ((16,), (32,), (64,))


def _variants(n_cols: int) -> list[tuple[str, dict]]:
    """(name, module settings) of each version timed at this vocabulary."""
    out = [("triton", {"ENABLED": False})]
    picks = {}  # box height picked -> the candidates that pick it
    for boxes in BOXES:
        saved, ceh.BOX_ROWS = ceh.BOX_ROWS, boxes
        fits = ceh.row_boxes(n_cols, 2)
        if fits:
            picks.setdefault(fits[0], boxes)
        ceh.BOX_ROWS = saved
    for warps in WARPS:
        for box, boxes in picks.items():
            out.append((f"gluon {warps} warps, box {box}", {"NUM_WARPS": warps, "BOX_ROWS": boxes}))
    return out


def _time(name, settings, logits, labels, ref, scratch) -> dict:
    saved = {k: getattr(ceh, k) for k in settings}
    for k, v in settings.items():
        setattr(ceh, k, v)
    n, v = logits.shape
    y2 = labels.view(1, n)
    row = dict(version=name, rows=n, vocab=v, us=None, gbps=None, error=None, ok=False)
    try:
        x = logits.clone().view(1, n, v)
        loss = cross_entropy_inplace_op(x, y2, None)[0]
        row["ok"] = abs(loss.item() - ref[0]) < 1e-4 * abs(ref[0])
        row["grad_err"] = ((x[0].float() - ref[1]).norm() / ref[1].norm()).item()
        row["ok"] = row["ok"] and row["grad_err"] < 1e-2
        ms = common.kernel_ms(lambda: cross_entropy_inplace_op(scratch, y2, None))
        row.update(us=ms * 1e3, gbps=2 * n * v * 2 / (ms * 1e-3) / 1e9)
    except Exception as e:  # a setting that fails to compile or launch is reported
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        for k, val in saved.items():
            setattr(ceh, k, val)
    return row


def _liger(logits, labels, ref, scratch) -> dict | None:
    lk = common.liger()
    if lk is None:
        return None
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    n, v = logits.shape
    row = dict(version="liger", rows=n, vocab=v, us=None, gbps=None, error=None, ok=False)

    def call(x):  # its forward writes the gradient over the logits when they require grad
        return LigerCrossEntropyFunction.apply(x, labels, None, -100)[0]

    try:
        x = logits.clone().requires_grad_()
        row["ok"] = abs(call(x).item() - ref[0]) < 1e-3 * abs(ref[0])
        s = scratch[0].requires_grad_()
        ms = common.kernel_ms(lambda: call(s))
        row.update(us=ms * 1e3, gbps=2 * n * v * 2 / (ms * 1e-3) / 1e9)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return row


def main() -> None:
    _, out = common.parse_out(__doc__)
    env = common.env_info()
    copy_gbps = common.ceilings()["copy_gbps"]
    rows = []
    for n, v in SHAPES:
        logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 2 - 1
        labels = torch.randint(v, (n,), device="cuda")
        x = logits.float().requires_grad_()
        loss = torch.nn.functional.cross_entropy(x, labels)
        loss.backward()
        ref = (loss.item(), x.grad)
        scratch = logits.clone().view(1, n, v)
        for name, settings in _variants(v):
            rows.append(_time(name, settings, logits, labels, ref, scratch))
            print(rows[-1], flush=True)
        liger = _liger(logits, labels, ref, scratch.detach().clone())
        if liger:
            rows.append(liger)
            print(liger, flush=True)
        del logits, scratch, x, ref
    (out / "ce_gluon_probe.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# In-place cross-entropy forward: Gluon, Triton, Liger ({env})", ""]
    lines += [f"copy ceiling {copy_gbps:.0f} GB/s; GB/s: one read + one write of the logits", ""]
    for n, v in SHAPES:
        mine = [r for r in rows if (r["rows"], r["vocab"]) == (n, v)]
        base = next((r for r in mine if r["version"] == "triton" and r["us"]), None)
        lines += [f"## {n} x {v}", "", "| version | ok | µs | GB/s | of copy | vs triton |"]
        lines += ["|---|---|---|---|---|---|"]
        for r in mine:
            if not r["us"]:
                lines.append(f"| {r['version']} | {r['ok']} | - | - | - | {r['error']} |")
                continue
            ratio = f"{base['us'] / r['us']:.2f}x" if base else "-"
            lines.append(
                f"| {r['version']} | {r['ok']} | {r['us']:.1f} | {r['gbps']:.0f} | "
                f"{r['gbps'] / copy_gbps:.2f} | {ratio} |"
            )
        lines.append("")
    (out / "ce_gluon_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
