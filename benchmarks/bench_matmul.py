"""Matmul benchmark: every projection GEMM of the model, forward / dX / dW, ours vs cuBLAS.

Two modes.

`--presets [enwik8,gpt2,large]`: the projections of bench_step.py's presets, the table behind
`matmul_impl="auto"`. Per preset (tokens = one micro-batch: enwik8 d512 ff 2048 vocab 256,
16 x 512 tokens; gpt2 d768 ff 3072 vocab 50,304, 16 x 1024; large d1024 ff 4096 vocab 256,
8 x 2048) and projection (qkv d -> 3d, out d -> d, ff_in d -> ff with relu², ff_out ff -> d,
logits d -> vocab), the GEMMs fwd (Y = X W^T; relu² fused for ff_in; out and ff_out also
with the residual add), dX (dY W) and dW (dY^T X, written in fp32 from bf16 operands, as the
model's mixed-precision weight gradients are). Providers: auto (our op under
matmul_impl="auto"; the "picked" column says which path it took), tma (our TMA kernel,
forced), ptr (our pointer kernel, forced), cublas (torch.mm / torch.addmm; for relu² the
product alone), and for the epilogue rows the unfused ways: cublas+ew (ours: torch.mm, then
our elementwise relu² pass), torch ew (torch.mm, then relu and square, or the residual add,
eagerly) and compile (torch.compile of mm + relu²). "vs cuBLAS" is the kernel time of the
best cuBLAS-based way to compute the same output over auto's (> 1: auto is faster); "table"
the MATMUL_TABLE entry the row asks for (a Triton kernel, or cublas+ew for relu², > 2%
faster than what "auto" runs without an entry). The TMA kernel autotunes over a few tile
shapes here (`--tma-configs all`: all of them), so "tma" is a lower bound on our kernel's
speed. Writes <out>/matmul_presets.{md,json} (rows also to matmul_presets_rows.jsonl as they
come). Expected to take 1-2 minutes on an H200, compiles included (not timed yet).

Default mode: the enwik8 model's projections (d512) at --M tokens.
  fwd  Y  = X @ W^T      (M, N, K)   relu² fused for 512 -> 2048
  dX   dX = dY @ W       (M, K, N)
  dW   dW = dY^T @ X     (N, K, M)   K = tokens: split K when the output has few tiles
Providers: ours (the TMA kernel on Hopper: matmul_impl="triton"), ours(ptr) (our pointer
kernel), ours(auto) (the shipped policy; with --auto), torch (torch.mm = cuBLAS,
plain GEMM), torch+relu² (mm, relu, square in eager), old (the kernel before this change,
when --old gives its bmm.py), compile (torch.compile of the same PyTorch expression, with
--compile). Kernel times come from torch.profiler (L2 flushed), so host overhead does not
leak into them; wall_us is the host time per call.
Also: the fused residual forward (ours vs torch.addmm), the relu² backward's elementwise
d(pre) pass, a split-K sweep of the weight gradients, host wall time per `linear` call at a
small shape (ours vs --old vs F.linear), and the autotuned config per shape.
Writes <out>/matmul.{md,png,json}, <out>/matmul_extra.json, and <out>/matmul_table.json: per
problem, "tma" or "ptr" where that kernel beat cuBLAS (torch.addmm for residuals), and for
relu² "ptr" where the pointer kernel beat the TMA one: matmul_plan.MATMUL_TABLE's format.

Usage: python3 benchmarks/bench_matmul.py --out DIR --presets [enwik8,gpt2,large] [--rounds R]
           [--tma-configs few|all] [--iters N]
       python3 benchmarks/bench_matmul.py --out DIR [--quick] [--old OLD_BMM.py] [--compile]
           [--M 2048,8192] [--shapes 512->256,...] [--no-sweep] [--auto]
(--old: e.g. `git show 9342bf6:triton_transformer/bmm.py > old_bmm.py`.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import triton_transformer.bmm as bmm_module
import triton_transformer.matmul_kernels as kernels_module
import triton_transformer.matmul_plan as plan_module
from triton_transformer.utils import sm_count

SHAPES = [  # (K in, N out, relu²)
    (512, 1536, False),
    (512, 512, False),
    (512, 2048, True),
    (2048, 512, False),
    (512, 256, False),
]


def load_old(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_bmm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def layout_key(M: int, N: int, K: int, a: torch.Tensor, b: torch.Tensor) -> str:
    la, lb = plan_module._layout(a), plan_module._layout(b)
    ch = lambda lay: "nt"[lay[0]] if lay else "s"
    return f"{M}x{N}x{K}:{ch(la)}{ch(lb)}"


def timed(fn) -> dict | None:
    """{"ms": kernel time (profiler), "event_ms": do_bench median, "wall_us": host per call}."""
    try:
        fn()  # warm-up (autotuning, compilation)
        torch.cuda.synchronize()
        return common.time_op(fn)
    except Exception:
        traceback.print_exc()
        return None


# ------------------------------------------------------------------------------------------
# --presets: every projection of the enwik8, GPT-2 and large presets
# ------------------------------------------------------------------------------------------

# The models of bench_step.py's presets: width, feed-forward width, vocabulary, and the tokens
# of one micro-batch (batch x sequence).
PRESETS = {
    "enwik8": dict(dim=512, ff=2048, vocab=256, tokens=16 * 512),
    "gpt2": dict(dim=768, ff=3072, vocab=50304, tokens=16 * 1024),
    "large": dict(dim=1024, ff=4096, vocab=256, tokens=8 * 2048),
}
# Providers in the table's column order; "cublas" is torch.mm / torch.addmm.
PRESET_PROVIDERS = ("auto", "tma", "ptr", "cublas", "cublas+ew", "torch ew", "compile")
# A MATMUL_TABLE entry is suggested only where the alternative beats what "auto" runs without
# one by more than this: run-to-run noise must not flip entries.
MARGIN = 0.98
# `--tma-configs few`: the first config of these tile shapes (BLOCK_M, BLOCK_N, BLOCK_K) in
# `matmul_kernels._tma_configs()`: wide outputs, the middle, and narrow ones (few output tiles).
FEW_TMA_TILES = ((128, 256, 64), (128, 128, 64), (64, 128, 64))


def projections(p: dict) -> list[tuple[str, int, int, str]]:
    """(name, K in, N out, forward epilogue) of every projection of a preset's model: the
    epilogue is "relu2" (fused, the feed-forward's first projection), "res" (the residual add
    of the two output projections) or ""."""
    d, ff, vocab = p["dim"], p["ff"], p["vocab"]
    return [
        ("qkv", d, 3 * d, ""),
        ("out", d, d, "res"),
        ("ff_in", d, ff, "relu2"),
        ("ff_out", ff, d, "res"),
        ("logits", d, vocab, ""),
    ]


@contextlib.contextmanager
def matmul_path(impl: str, force: str | None) -> Iterator[None]:
    """The planner's `matmul_impl` and `_FORCE_PATH` set for the duration (restored after)."""
    saved = plan_module.matmul_impl, plan_module._FORCE_PATH
    plan_module.matmul_impl, plan_module._FORCE_PATH = impl, force
    try:
        yield
    finally:
        plan_module.matmul_impl, plan_module._FORCE_PATH = saved


def on_path(impl: str, force: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """fn, run under `matmul_path(impl, force)` each call."""

    def run() -> object:
        with matmul_path(impl, force):
            return fn()

    return run


def picked(fn: Callable[[], object]) -> str:
    """Which path the planner (matmul_plan) chose for the (last) 2-D product `fn` ran: "cublas",
    "cublas+ew", "tma" (with its K split), "ptr", or "-" when it planned none (batched)."""
    seen = []
    real = plan_module._plan

    def spy(*args):
        plan = real(*args)
        seen.append(plan)
        return plan

    plan_module._plan = spy  # _mm2d_into looks the planner up at each call
    try:
        fn()
    finally:
        plan_module._plan = real
    if not seen:
        return "-"
    plan = seen[-1]
    return f"tma split {plan[1]}" if plan[0] == "tma" and plan[1] > 1 else plan[0]


def limit_tma_autotune(which: str) -> str:
    """Make the TMA kernel's autotuning affordable here: a short benchmark per config and,
    unless `which` is "all", the first config of each of `FEW_TMA_TILES`. Returns a note for
    the report."""
    import triton.testing

    tuned = kernels_module._mm_tma_tuned

    def quick_bench(kernel_call, quantiles):  # triton's default: 25 ms warm-up, 100 ms runs
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

    tuned._do_bench = quick_bench
    with contextlib.suppress(AttributeError):  # a cached_property in triton 3.x
        tuned.do_bench = quick_bench
    if which == "all":
        return f"TMA kernel autotuned over all {len(tuned.configs)} configs"
    keep, seen = [], set()
    for cfg in tuned.configs:
        tile = tuple(cfg.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        if tile in FEW_TMA_TILES and tile not in seen:
            seen.add(tile)
            keep.append(cfg)
    tuned.configs = keep
    tiles = ", ".join("x".join(map(str, t)) for t in sorted(seen, reverse=True))
    return f"TMA kernel autotuned over {len(keep)} configs (tiles {tiles}; --tma-configs all: all)"


def kernel_time(fn: Callable[[], object], iters: int) -> float | None:
    """`common.kernel_ms` (GPU kernel time per call, L2 flushed; its first call warms up:
    autotuning, compilation), or None when the provider fails."""
    try:
        return common.kernel_ms(fn, iters)
    except Exception:
        traceback.print_exc()
        return None


def preset_problems(M: int, K: int, N: int, epi: str, dev: str = "cuda") -> list[dict]:
    """The GEMMs of one projection (M tokens, K in, N out) with each provider's callable."""
    bf16 = torch.bfloat16
    x = torch.randn(M, K, device=dev, dtype=bf16)
    w = torch.randn(N, K, device=dev, dtype=bf16) * K**-0.5
    dy = torch.randn(M, N, device=dev, dtype=bf16)
    linear_op, bmm_op = bmm_module.linear_op, bmm_module.bmm_op
    plain_fwd = {"ours": lambda: linear_op(x, w, None, False), "cublas": lambda: torch.mm(x, w.t())}
    problems = []
    if epi == "relu2":

        def mm_relu2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = F.relu(torch.mm(x, w.t()))
            return y * y

        compiled = common.compiled(mm_relu2, dynamic=False)  # one code object: no dynamic
        problems.append({
            "mode": "fwd+relu²", "gemm": (M, N, K), "a": x, "b": w.t(), "epi": "+relu2",
            "ours": lambda: linear_op(x, w, None, True),
            "cublas": lambda: torch.mm(x, w.t()),  # the product alone: a reference
            "cublas+ew": on_path("auto", "cublas+ew", lambda: linear_op(x, w, None, True)),
            "torch ew": lambda: mm_relu2(x, w),
            "compile": lambda: compiled(x, w),
        })  # fmt: skip
    else:
        problems.append({"mode": "fwd", "gemm": (M, N, K), "a": x, "b": w.t(), "epi": "",
                         **plain_fwd})  # fmt: skip
    if epi == "res":
        h = torch.randn(M, N, device=dev, dtype=bf16)
        problems.append({
            "mode": "fwd+res", "gemm": (M, N, K), "a": x, "b": w.t(), "epi": "+res",
            "ours": lambda: linear_op(x, w, h, False),
            "cublas": lambda: torch.addmm(h, x, w.t()),
            "torch ew": lambda: torch.mm(x, w.t()) + h,
        })  # fmt: skip
    problems.append({"mode": "dX", "gemm": (M, K, N), "a": dy, "b": w, "epi": "",
                     "ours": lambda: bmm_op(dy, w), "cublas": lambda: torch.mm(dy, w)})  # fmt: skip
    f32 = torch.float32  # dW in fp32 from bf16 operands: mixed precision's weight gradients
    problems.append({"mode": "dW", "gemm": (N, K, M), "a": dy.t(), "b": x, "epi": "",
                     "ours": lambda: bmm_op(dy.t(), x, f32),
                     "cublas": lambda: torch.mm(dy.t(), x, f32)})  # fmt: skip
    return problems


def table_entry(row: dict) -> str:
    """The MATMUL_TABLE value this row asks for ("" for none: "auto"'s default is right)."""
    ms = row["ms"]
    kernels = {k: ms[k] for k in ("tma", "ptr") if ms.get(k)}
    if not kernels:
        return ""
    fastest = min(kernels, key=kernels.get)
    if row["epi"] == "+relu2":  # default: fused, the TMA kernel on Hopper
        ew, fused = ms.get("cublas+ew"), kernels[fastest]
        if ew and ew < MARGIN * fused:
            return "cublas+ew"
        tma = kernels.get("tma")
        return "ptr" if fastest == "ptr" and (not tma or kernels["ptr"] < MARGIN * tma) else ""
    cublas = ms.get("cublas")  # default: cuBLAS (addmm with the residual)
    return fastest if cublas and kernels[fastest] < MARGIN * cublas else ""


def run_presets(args: argparse.Namespace) -> None:
    """--presets: measure, write <out>/matmul_presets.{md,json}, print the table entries."""
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.presets.split(",") if n]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}: choose from {list(PRESETS)}")
    tune_note = limit_tma_autotune(args.tma_configs)
    ceil = common.ceilings()
    device = torch.cuda.get_device_name()
    print(f"ceilings: {ceil}; {tune_note}", flush=True)
    rows, table = [], {}
    for name in names:
        p = PRESETS[name]
        for proj, K, N, epi in projections(p):
            for prob in preset_problems(p["tokens"], K, N, epi):
                gm, gn, gk = prob["gemm"]
                flops = 2 * gm * gn * gk
                ours = prob["ours"]
                providers = {
                    "auto": on_path("auto", None, ours),
                    "tma": on_path("triton", "tma", ours),
                    "ptr": on_path("triton", "ptr", ours),
                    **{k: prob[k] for k in ("cublas", "cublas+ew", "torch ew", "compile")
                       if k in prob},
                }  # fmt: skip
                with torch.no_grad():
                    # a warm-up pass over every provider first: timed first, "auto" of each
                    # preset's first problem read 12% below the same cuBLAS kernel called
                    # directly (H200, 2026-11-28; a probe timed both at 140.7 / 140.8 µs)
                    for fn in providers.values():
                        kernel_time(fn, 1)
                    ms = {k: kernel_time(fn, args.iters) for k, fn in providers.items()}
                    ran = [k for k, v in ms.items() if v is not None]
                    if args.rounds > 1 and ran:
                        times = common.interleaved_kernel_ms(
                            [providers[k] for k in ran], args.rounds, [ms[k] for k in ran],
                            args.iters,
                        )  # fmt: skip
                        ms.update({k: t[0] for k, t in zip(ran, times, strict=True)})
                    choice = picked(providers["auto"])
                key = layout_key(gm, gn, gk, prob["a"], prob["b"]) + prob["epi"]
                # the best cuBLAS-based way to the same output: mm; addmm or mm + add; for
                # relu², cuBLAS's product then a separate elementwise pass (ours or torch's)
                refs = ["cublas"] if prob["epi"] != "+relu2" else []
                refs += ["cublas+ew", "torch ew", "compile"] if prob["epi"] else []
                ref = min((ms[k] for k in refs if ms.get(k)), default=None)
                row = {
                    "preset": name, "proj": proj, "mode": prob["mode"],
                    "gemm": f"{gm}x{gn}x{gk}", "key": key, "epi": prob["epi"], "picked": choice,
                    "ms": ms,
                    "TFLOP/s": {k: flops / v / 1e9 for k, v in ms.items() if v},
                    "vs cuBLAS": ref / ms["auto"] if ref and ms.get("auto") else None,
                }  # fmt: skip
                row["table"] = table_entry(row)
                if row["table"]:
                    table[key] = row["table"]
                rows.append(row)
                with open(out / "matmul_presets_rows.jsonl", "a") as f:  # survives a timeout
                    f.write(json.dumps(row) + "\n")
                tf = " ".join(f"{k} {v:.0f}" for k, v in row["TFLOP/s"].items())
                vs = row["vs cuBLAS"]
                print(f"{name} {proj} {prob['mode']} {row['gemm']}: {tf} TFLOP/s; auto -> "
                      f"{choice}" + (f", {vs:.2f}x of cuBLAS" if vs else "")
                      + (f"; table: {row['table']}" if row["table"] else "")
                      + f" [{time.time() - start:.0f}s]", flush=True)  # fmt: skip
    env = common.env_info()
    (out / "matmul_presets.json").write_text(json.dumps(
        {"env": env, "ceilings": ceil, "tma_autotune": tune_note, "rows": rows,
         "table": {device: table}}, indent=1))  # fmt: skip
    lines = [
        "# Matmuls of the presets' projections: auto against cuBLAS",
        "",
        f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; bf16, "
        f"measured bf16 peak {ceil['bf16_tflops']:.0f} TFLOP/s. TFLOP/s of GPU kernel time "
        "(torch.profiler, L2 flushed before each call; 2·M·N·K flops, the epilogue not "
        f"counted). {tune_note}. cublas: torch.mm (addmm for fwd+res; for fwd+relu² the "
        "product alone); cublas+ew: torch.mm then our relu² pass; torch ew: torch.mm then "
        "relu, square (or + residual); compile: torch.compile of mm + relu². vs cuBLAS: the "
        "best cuBLAS-based way to the same output over auto, in time (> 1: auto faster). "
        f"table: the MATMUL_TABLE entry the row asks for (> {1 / MARGIN - 1:.0%} faster).",
        "",
        "| preset | proj | mode | M x N x K | "
        + " | ".join(PRESET_PROVIDERS)
        + " | auto picked | vs cuBLAS | table |",
        "|" + "---|" * (len(PRESET_PROVIDERS) + 7),
    ]
    for r in rows:
        tf = [common._fmt(r["TFLOP/s"][k]) if k in r["TFLOP/s"] else "-" for k in PRESET_PROVIDERS]
        vs = f"{r['vs cuBLAS']:.2f}" if r["vs cuBLAS"] else "-"
        cells = [r["preset"], r["proj"], r["mode"], r["gemm"], *tf, r["picked"], vs]
        lines.append("| " + " | ".join([*cells, r["table"] and f"`{r['table']}`"]) + " |")
    lines += ["", f"MATMUL_TABLE entries for {device}:", "", "```", json.dumps(table, indent=1),
              "```"]  # fmt: skip
    (out / "matmul_presets.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"done in {time.time() - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="M = 8192 only")
    parser.add_argument("--old", default=None, help="path of the previous bmm.py")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (fwd)")
    parser.add_argument("--M", default="2048,8192", help="token counts, comma-separated")
    parser.add_argument("--shapes", default=None, help='e.g. "512->256,2048->512" (default all)')
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-K sweep")
    parser.add_argument("--auto", action="store_true", help='add ours under matmul_impl="auto"')
    parser.add_argument(
        "--presets", nargs="?", const=",".join(PRESETS), default=None,
        help=f"measure the presets' projections instead (default all: {','.join(PRESETS)})",
    )  # fmt: skip
    parser.add_argument("--tma-configs", choices=("few", "all"), default="few",
                        help="--presets: the TMA kernel's autotuning configs")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10, help="--presets: calls timed each")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--presets: kernel times, median of R interleaved rounds")  # fmt: skip
    args = parser.parse_args()
    if args.presets is not None:
        run_presets(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = load_old(args.old)
    dev = "cuda"
    bf16 = torch.bfloat16
    ceil = common.ceilings()
    peak = ceil["bf16_tflops"]
    print(f"ceilings: {ceil}", flush=True)
    plan_module.matmul_impl = "triton"  # "ours" is our kernel; "ours(auto)" the shipped policy
    rows, extra, table = [], {"split_sweep": [], "wall": [], "relu2_grad": []}, {}

    def add(provider, M, K, N, mode, shape, gemm, t, flops):
        if t is None:
            return None
        tf = flops / t["ms"] / 1e9
        row = {"provider": provider, "M": M, "shape": shape, "mode": mode, "gemm": gemm}
        row.update(dtype="bf16", ms=t["ms"], event_ms=t["event_ms"], wall_us=t["wall_us"])
        row["TFLOP/s"] = tf
        row["frac"] = tf / peak
        rows.append(row)
        with open(out / "rows.jsonl", "a") as f:  # partial results survive a timeout
            f.write(json.dumps(row) + "\n")
        return tf

    ms_list = [8192] if args.quick else [int(m) for m in args.M.split(",")]
    wanted = None if args.shapes is None else set(args.shapes.split(","))
    for M in ms_list:
        for K, N, relu in SHAPES:
            if wanted is not None and f"{K}->{N}" not in wanted:
                continue
            shape = f"{K}->{N}" + (" relu²" if relu else "")
            x = torch.randn(M, K, device=dev, dtype=bf16)
            w = torch.randn(N, K, device=dev, dtype=bf16) * K**-0.5
            dy = torch.randn(M, N, device=dev, dtype=bf16)
            problems = {  # mode: (a, b, (M, N, K) of the GEMM)
                "fwd": (x, w.t(), (M, N, K)),
                "dX": (dy, w, (M, K, N)),
                "dW": (dy.t(), x, (N, K, M)),
            }
            for mode, (a, b, (gm, gn, gk)) in problems.items():
                flops = 2 * gm * gn * gk
                gemm = f"{gm}x{gn}x{gk}"
                ep = relu and mode == "fwd"
                if mode == "fwd":
                    ours = lambda x=x, w=w, ep=ep: bmm_module.linear_op(x, w, None, ep)
                else:
                    ours = lambda a=a, b=b: bmm_module.bmm_op(a, b)
                with torch.no_grad():
                    t_ours = add("ours", M, K, N, mode, shape, gemm, timed(ours), flops)
                    plan_module._FORCE_PATH = "ptr"  # our pointer kernel, the other Triton path
                    t_ptr = add("ours(ptr)", M, K, N, mode, shape, gemm, timed(ours), flops)
                    plan_module._FORCE_PATH = None
                    if args.auto:
                        plan_module.matmul_impl = "auto"
                        add("ours(auto)", M, K, N, mode, shape, gemm, timed(ours), flops)
                        plan_module.matmul_impl = "triton"
                    t_torch = add("torch", M, K, N, mode, shape, gemm,
                                  timed(lambda a=a, b=b: torch.mm(a, b)), flops)  # fmt: skip
                    if ep:

                        def eager(x=x, w=w):
                            y = F.relu(F.linear(x, w))
                            return y * y

                        add("torch+relu²", M, K, N, mode, shape, gemm, timed(eager), flops)
                    t_old = None
                    if old is not None:
                        c = torch.empty(gm, gn, device=dev, dtype=bf16)
                        fn = lambda a=a, b=b, c=c, ep=ep: old._matmul(
                            a[None], b[None], c[None], relu_squared=ep
                        )
                        t_old = add("old", M, K, N, mode, shape, gemm, timed(fn), flops)
                    if args.compile and mode == "fwd":

                        def expr(x, w, ep=ep):
                            y = F.linear(x, w)
                            if ep:
                                y = F.relu(y)
                                y = y * y
                            return y

                        cf = common.compiled(expr)
                        add("compile", M, K, N, mode, shape, gemm,
                            timed(lambda x=x, w=w, cf=cf: cf(x, w)), flops)  # fmt: skip
                if t_ours and t_torch:
                    t_ptr = t_ptr or 0.0
                    key = layout_key(gm, gn, gk, a, b) + ("+relu2" if ep else "")
                    # TFLOP/s here. relu² stays fused: the faster of our two kernels (the
                    # default, TMA, needs no entry); plain products: cuBLAS unless one of our
                    # kernels beat it (MATMUL_TABLE lists only those exceptions).
                    best = "ptr" if t_ptr > t_ours else "tma"
                    if ep:
                        table[key] = "ptr" if best == "ptr" else None
                    else:
                        table[key] = best if max(t_ours, t_ptr) > t_torch else None
                    choice = table[key] or ("tma" if ep else "cublas")
                    print(f"{M=} {shape:14s} {mode}: tma {t_ours:5.0f} ptr {t_ptr:5.0f} "
                          f"old {t_old or 0:5.0f} torch{'(mm only)' if ep else ''} "
                          f"{t_torch:5.0f} TFLOP/s -> {choice}", flush=True)  # fmt: skip

                if mode == "dW" and not args.no_sweep:  # split-K sweep of the weight gradient
                    la, lb = plan_module._layout(a), plan_module._layout(b)
                    num_sms = sm_count(torch.device("cuda", torch.cuda.current_device()))
                    c = torch.empty(gm, gn, device=dev, dtype=bf16)
                    for split in (1, 2, 4, 8, 16):

                        def run_split(a=a, b=b, c=c, s=split, la=la, lb=lb, n=num_sms):
                            plan_module.launch_mm_tma(
                                a, b, c, None, None, False, la, lb, s, n, None
                            )

                        t = timed(run_split)
                        if t:
                            print(f"split {gemm} {split}: {flops / t['ms'] / 1e9:.0f} TFLOP/s")
                            extra["split_sweep"].append(
                                {"M": M, "gemm": gemm, "split": split, "ms": t["ms"],
                                 "TFLOP/s": flops / t["ms"] / 1e9,
                                 "heuristic": plan_module._split_k(gm, gn, gk, num_sms)}
                            )  # fmt: skip

            if relu:  # the relu² backward's elementwise pass: read dy and y, write d(pre)
                y = torch.rand(M, N, device=dev, dtype=bf16)
                t = timed(lambda dy=dy, y=y: bmm_module.relu2_grad_op(dy, y, True))
                if t:
                    extra["relu2_grad"].append(
                        {"M": M, "N": N, "ms": t["ms"], "GB/s": 3 * M * N * 2 / t["ms"] / 1e6,
                         "copy_gbps": ceil["copy_gbps"]}
                    )  # fmt: skip
            if not relu and N == 512:  # fused residual: h + x @ W^T
                h = torch.randn(M, N, device=dev, dtype=bf16)
                flops = 2 * M * N * K
                with torch.no_grad():
                    t1 = add("ours", M, K, N, "fwd+res", shape, f"{M}x{N}x{K}",
                             timed(lambda x=x, w=w, h=h: bmm_module.linear_op(x, w, h, False)),
                             flops)  # fmt: skip
                    addmm = lambda x=x, w=w, h=h: torch.addmm(h, x, w.t())
                    g = f"{M}x{N}x{K}"
                    t2 = add("torch", M, K, N, "fwd+res", shape, g, timed(addmm), flops)
                if t1 and t2:
                    key = layout_key(M, N, K, x, w.t()) + "+res"
                    table[key] = "tma" if t1 > t2 else None  # else addmm, the default
                    print(f"{M=} {shape:14s} fwd+res: ours {t1:6.1f} addmm {t2:6.1f} "
                          f"({t1 / t2:.2f}x)", flush=True)  # fmt: skip

    # Host wall time per call at a small shape (the kernels take a few µs).
    x = torch.randn(16, 512, device=dev, dtype=bf16)
    w = torch.randn(512, 512, device=dev, dtype=bf16)

    def kernel_only(x, w):  # ours without the op dispatch and checks: the launch alone
        y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        plan_module._mm2d_into(x, w.t(), y)
        return y

    cases = {
        "ours": lambda x, w: bmm_module.linear(x, w, use_triton=True),
        "ours:op": lambda x, w: bmm_module.linear_op(x, w, None, False),
        "ours:launch": kernel_only,
        "ours:cublas": lambda x, w: bmm_module.linear_op(x, w, None, False),
        "F.linear": F.linear,
    }
    if old is not None:
        cases["old"] = lambda x, w: old.linear(x, w, use_triton=True)
    for name, fn in cases.items():
        for mode in ("fwd", "fwd+bwd") if ":" not in name else ("fwd",):
            xx = x.clone().requires_grad_(mode != "fwd")
            ww = w.clone().requires_grad_(mode != "fwd")

            def call(fn=fn, xx=xx, ww=ww, mode=mode, name=name):
                plan_module.matmul_impl = "cublas" if name == "ours:cublas" else "auto"
                y = fn(xx, ww)
                if mode != "fwd":
                    y.backward(torch.ones_like(y))

            for _ in range(20):
                call()
            torch.cuda.synchronize()
            n = 300
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / n * 1e6
            extra["wall"].append({"impl": name, "mode": mode, "us_per_call": us})
            print(f"wall per linear call (16x512 @ 512x512, {mode}): {name} {us:.1f} us")

    extra["autotuned"] = {
        str(k): str(v) for k, v in getattr(kernels_module._mm_tma_tuned, "cache", {}).items()
    }
    name = torch.cuda.get_device_name()
    table = {k: v for k, v in sorted(table.items()) if v}
    (out / "matmul_table.json").write_text(json.dumps({name: table}, indent=1))
    (out / "matmul_extra.json").write_text(json.dumps(extra, indent=1))
    common.report(out, "matmul", rows, x="M", y="TFLOP/s", group=("shape", "mode"))
    print(json.dumps(extra["split_sweep"]))
    print(json.dumps(extra["relu2_grad"]))
    print("MATMUL_TABLE entries:", json.dumps(table))


if __name__ == "__main__":
    main()
