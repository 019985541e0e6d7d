"""Probe: the in-place cross-entropy forward (the model's loss: loss and gradient in one kernel,
the gradient written over the logits) on rows longer than one register block.

That kernel reads each row twice (log-sum-exp, then the gradient) and writes it once, looping
over blocks. This sweeps the block (`INPLACE_LOOP_BLOCK`) and the warps
(`INPLACE_LOOP_WARPS`) at the fused loss's chunk (4,096 rows of GPT-2's 50,304 classes) and
the unfused loss's shapes; the picks per GPU model are `cross_entropy._INPLACE_LOOP_TUNED`.
Kernel time, L2 flushed; GB/s count one read and one write of the logits, against the copy
ceiling of the same run.

--baseline FILE: also time a saved copy of `cross_entropy.py` (e.g. the previous commit's,
`git show HEAD~1:triton_transformer/cross_entropy.py > FILE`) at its shipped settings and
this sweep's best settings, in the same run.

    python3 benchmarks/probe_ce_inplace.py --out DIR [--baseline FILE]
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

import triton_transformer.cross_entropy as ce

SHAPES = ((4096, 50304), (16384, 50304), (8192, 32000), (8192, 128256))  # rows, vocabulary
BLOCKS = (2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)
BASELINE = ((4096, 8), (8192, 8))  # the copy's settings: the one-block loop's, this one's
SETTINGS = ("FWD_MAX_BLOCK", "INPLACE_LOOP_BLOCK", "INPLACE_LOOP_WARPS", "LOOP_NUM_WARPS")


def _set(mod, block: int, warps: int) -> None:
    mod.FWD_MAX_BLOCK, mod.INPLACE_LOOP_BLOCK = 16384, block
    if hasattr(mod, "INPLACE_LOOP_WARPS"):
        mod.INPLACE_LOOP_WARPS = warps
    else:  # before the in-place forward had warps of its own
        mod.LOOP_NUM_WARPS = warps


def _time(mod, version: str, cfg: tuple, logits, labels, ref, scratch) -> dict:
    """Check one (block, warps) setting of `mod` on fresh logits, then time it on `scratch`
    (overwritten call after call: the timing does not depend on the values)."""
    _set(mod, *cfg)
    n, v = logits.shape
    y2 = labels.view(1, n)
    try:
        loss = mod.cross_entropy_inplace_op(logits.clone().view(1, n, v), y2, None)[0]
        ok = abs(loss.item() - ref) < 1e-3 * abs(ref)
        ms = common.kernel_ms(lambda: mod.cross_entropy_inplace_op(scratch, y2, None))
        err = None
    except Exception as e:  # a setting that fails to compile or launch is reported
        ok, ms, err = False, None, f"{type(e).__name__}: {str(e)[:120]}"
    row = dict(version=version, rows=n, vocab=v, block=cfg[0], warps=cfg[1], ok=ok)
    row.update(us=None, gbps=None, error=err)
    if ms:
        row.update(us=ms * 1e3, gbps=2 * n * v * 2 / (ms * 1e-3) / 1e9)
    return row


def _table(rows: list[dict], copy_gbps: float, n: int, v: int) -> list[str]:
    """The shape's fastest settings, then the baseline's rows, each against the baseline's
    first setting (without a baseline, this module's at that setting)."""
    mine = [r for r in rows if (r["rows"], r["vocab"]) == (n, v)]
    good = sorted((r for r in mine if r["ok"] and r["us"]), key=lambda r: r["us"])
    ref = [r for r in good if (r["block"], r["warps"]) == BASELINE[0]]
    ref = next((r for r in ref if r["version"] == "baseline"), ref[0] if ref else good[-1])
    lines = [f"## {n} x {v}", ""]
    lines += ["| version | block | warps | µs | GB/s | of copy | speed vs baseline |"]
    lines += ["|---|---|---|---|---|---|---|"]
    base = [r for r in good if r["version"] == "baseline"]
    for r in [*[r for r in good if r["version"] != "baseline"][:6], *base]:
        lines.append(
            f"| {r['version']} | {r['block']} | {r['warps']} | {r['us']:.1f} | "
            f"{r['gbps']:.0f} | {r['gbps'] / copy_gbps:.2f} | {ref['us'] / r['us']:.2f}x |"
        )
    bad = [(r["version"], r["block"], r["warps"], r["error"]) for r in mine if not r["ok"]]
    return [*lines, "", f"failed or wrong: {bad}", ""]


def main() -> None:
    args, out = common.parse_out(
        __doc__,
        lambda ap: ap.add_argument("--baseline", help="a saved copy of cross_entropy.py"),
    )
    env = common.env_info()
    copy_gbps = common.ceilings()["copy_gbps"]
    mods = [("this", ce, list(itertools.product(BLOCKS, WARPS)))]
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            base = common.module_copy(args.baseline, "ce_baseline", Path(tmp))
            mods.append(("baseline", base, list(BASELINE)))
        rows = []
        for n, v in SHAPES:
            logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 2 - 1
            labels = torch.randint(v, (n,), device="cuda")
            ref = torch.nn.functional.cross_entropy(logits.float(), labels).item()
            scratch = logits.clone().view(1, n, v)
            for version, mod, configs in mods:
                saved = {k: getattr(mod, k) for k in SETTINGS if hasattr(mod, k)}
                for cfg in configs:
                    rows.append(_time(mod, version, cfg, logits, labels, ref, scratch))
                    print(rows[-1], flush=True)
                for k, val in saved.items():
                    setattr(mod, k, val)
            del logits, scratch
    (out / "ce_inplace_probe.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [f"# In-place cross-entropy forward: block and warps ({env})", ""]
    lines += [f"copy ceiling {copy_gbps:.0f} GB/s; GB/s: one read + one write of the logits", ""]
    for n, v in SHAPES:
        lines += _table(rows, copy_gbps, n, v)
    (out / "ce_inplace_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
