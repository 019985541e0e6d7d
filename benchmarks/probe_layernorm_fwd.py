"""Probe: the LayerNorm forward's tiles and cache hints, at the widths where it sat a few
percent behind torch.compile's (#19: LayerNorm at or above compile at every width), and the
residual form's tiles at the model presets' shapes.

Sweep shapes (2**26 elements per bf16 tensor, as `bench_layernorm.py --widths sweep`, plus
GPT-2's 16384 x 768): both kernels stream their rows once (the forward's register path, the
backward's "row" kernel), at 90-95% of the copy ceiling. Inductor marks such loads
`evict_first`; ours gave none. Variants, as edited copies of `layernorm.py` in one run:
shipped; "evict": the forward's last read of x `evict_first`; "evict-all": also the
backward's x and dy. Each forward at the width class's table entry and the other tiles of
`FWD_PICKS` and, at widths of three power-of-two blocks, the three-block tiles of
`THIRDS_PICKS`, plain and stable, against torch.compile of the reference (training forward;
backward of a retained graph).

--model-shapes: the residual forward (fp32 h + bf16 branch -> fp32 sum, bf16 y), as the
model runs it, without and with the branch's dropout (p = 0.1), at enwik8's 8192 x 512,
GPT-2's 16384 x 768 and the large preset's 16384 x 1024, at each tile of the class.
Kernel time, L2 flushed.

    python3 benchmarks/probe_layernorm_fwd.py --out DIR [--model-shapes] [--widths N ...]
        [--no-hints]
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from bench_layernorm import _torch_fn

import triton_transformer.layernorm as ln

SRC = Path(ln.__file__)
_X_LOAD = "tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0"
# the last (the register path's only) read of x: evict_first; passes that re-read it keep
# the default
EVICT_FWD = (
    (
        f"        x = {_X_LOAD}).to(tl.float32)",
        "        if STORE_X:\n"
        f'            x = {_X_LOAD}, eviction_policy="evict_first").to(tl.float32)\n'
        "        else:\n"
        f"            x = {_X_LOAD}).to(tl.float32)",
    ),
)
EVICT_BWD = (
    (
        "    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)\n"
        "    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)",
        "    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0,"
        ' eviction_policy="evict_first")\n'
        "    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0,"
        ' eviction_policy="evict_first")',
    ),
)
WIDTHS = (768, 1024, 512, 384, 256, 128, 16384)
# extra forward tiles per width class: the H200 sweep's picks (`layernorm_tune` of this session)
FWD_PICKS = {
    512: [(2, 512, 2), (4, 512, 2), (2, 512, 1), (4, 512, 4)],
    1024: [(4, 1024, 4), (2, 1024, 2), (2, 1024, 4), (1, 1024, 1), (1, 1024, 2), (4, 1024, 8)],
    256: [(16, 256, 8), (8, 256, 2), (4, 256, 1)],
    128: [(16, 128, 4), (8, 128, 1), (16, 128, 2)],
    16384: [(1, 16384, 8), (1, 8192, 8)],
}
# tiles of a third of the row (`layernorm._layernorm_fwd_kernel`'s THIRDS: three blocks of
# registers), per width N = 3 · 2**k
THIRDS_PICKS = {
    768: [(1, 256, 1), (2, 256, 1), (2, 256, 2), (4, 256, 2), (4, 256, 4), (8, 256, 4),
          (8, 256, 8)],
    384: [(2, 128, 1), (4, 128, 1), (4, 128, 2), (8, 128, 2), (8, 128, 4)],
    12288: [(1, 4096, 4), (1, 4096, 8), (1, 4096, 16)],
}  # fmt: skip


def _row(mods: dict, n: int, m: int, stable: bool) -> dict:
    """Kernel ms at one shape: compile's forward and backward, each variant's forward at each
    tile and its backward at the table's entry."""
    eps = 1e-5
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (-1.0 + torch.randn(m, n, device="cuda", generator=g)).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    stats = torch.empty((3 if stable else 2, m), device="cuda")
    fn = common.compiled(_torch_fn("layernorm_stable" if stable else "layernorm"), dynamic=False)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    with torch.enable_grad():
        ref = fn(*leaves)
    row = {
        "N": n,
        "M": m,
        "stable": stable,
        "compile fwd": common.kernel_ms(functools.partial(fn, *leaves)),
        "compile bwd": common.kernel_ms(
            functools.partial(torch.autograd.grad, ref, leaves, dy, retain_graph=True)
        ),
    }
    cfgs = dict.fromkeys(
        [
            ln._layernorm_fwd_config(n, ln.MAX_BLOCK_N, stable)[:3],
            *FWD_PICKS.get(ln.width_class(n), []),
            *THIRDS_PICKS.get(n, []),
        ]
    )
    for name, mod in mods.items():
        for cfg in cfgs:
            row[f"fwd {name} {cfg}"] = common.kernel_ms(
                functools.partial(mod.launch_layernorm_fwd, x, w, b, y, stats, eps, stable, cfg=cfg)
            )
        row[f"bwd {name}"] = common.kernel_ms(
            functools.partial(mod.launch_layernorm_bwd, dy, x, w, stats, dx, dw, db, eps, stable)
        )
    return row


def _model_shapes() -> list[dict]:
    """Residual forward µs per tile at the presets' shapes."""
    rows = []
    for m, n in ((8192, 512), (16384, 768), (16384, 1024)):
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(m, n, device="cuda", generator=g)
        br = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        b = (0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        x, y = torch.empty_like(h), torch.empty_like(br)
        stats = torch.empty((2, m), device="cuda")
        shipped = ln._layernorm_fwd_config(n, ln.MAX_BLOCK_N)[:3]
        picks = [*FWD_PICKS.get(ln.width_class(n), []), *THIRDS_PICKS.get(n, [])]
        seed = torch.tensor(1234, device="cuda")
        for p, cfg in itertools.product((0.0, 0.1), dict.fromkeys([shipped, *picks])):
            launch = functools.partial(
                ln.launch_layernorm_fwd, x, w, b, y, stats, 1e-5, False, h2=h, br2=br, p=p,
                seed=seed, cfg=cfg,
            )  # fmt: skip
            rows.append({"M": m, "N": n, "p": p, "cfg": cfg, "shipped": cfg == shipped,
                         "us": common.kernel_ms(launch) * 1e3})  # fmt: skip
            print(f"residual fwd {m}x{n} p={p} {cfg}{' (shipped)' if cfg == shipped else ''}: "
                  f"{rows[-1]['us']:.1f} us", flush=True)  # fmt: skip
    return rows


def main() -> None:
    def add_args(ap):
        ap.add_argument("--model-shapes", action="store_true")
        ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
        ap.add_argument("--no-hints", action="store_true", help="the shipped kernels only")

    args, out = common.parse_out(__doc__, add_args)
    if args.model_shapes:
        (out / "layernorm_fwd_model.json").write_text(json.dumps(_model_shapes(), indent=1))
        return
    tmp = Path(tempfile.mkdtemp())
    mods = {"shipped": ln}
    if not args.no_hints:
        mods["evict"] = common.module_copy(SRC, "ln_evict", tmp, EVICT_FWD)
        mods["evict-all"] = common.module_copy(SRC, "ln_evict_all", tmp, EVICT_FWD + EVICT_BWD)
    rows = []
    for n in args.widths:
        m_sweep = max(1, round((1 << 26) / n))
        for m in sorted({m_sweep, 16384} if n == 768 else {m_sweep}):
            for stable in (False, True):
                row = _row(mods, n, m, stable)
                best = min((v, k) for k, v in row.items() if k.startswith("fwd "))
                times = " ".join(
                    f"{k}={v * 1e3:.1f}" for k, v in row.items() if k.startswith(("fwd", "bwd"))
                )
                print(
                    f"{m}x{n} stable={stable}: compile fwd {row['compile fwd'] * 1e3:.1f} bwd "
                    f"{row['compile bwd'] * 1e3:.1f} | best fwd {best[1]} {best[0] * 1e3:.1f} | "
                    f"{times}",
                    flush=True,
                )
                rows.append(row)
    (out / "layernorm_fwd.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
