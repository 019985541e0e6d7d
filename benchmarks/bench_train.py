"""`train.py`'s training throughput, mode by mode, in one process: tokens/s, peak memory, GPU busy.

Each mode trains the same config (default configs/enwik8.toml, on whatever corpus it resolves
to) for `--steps` optimizer steps through the real `Trainer`, with CUDA graphs where they apply
(train.cuda_graph = auto). Then the trainer runs `--profile-steps` more steps under
torch.profiler: GPU busy = GPU kernel time per step / wall time per step (steady state, from
metrics.jsonl). Finally the loss curves of all modes go into one PNG: they must overlap.

Modes: torch (PyTorch ops), triton (--use-triton), compile (--compile), triton-compile
(--use-triton --compile), triton-naive (--use-triton with model.attn_impl = "naive"),
torch-eager and triton-eager (train.cuda_graph = false: no whole-step graph).
Usage: python3 benchmarks/bench_train.py --out DIR [--steps 300] [--config TOML]
       [--set SECTION.FIELD=VALUE ...]   (overrides for every mode, e.g. a shorter batch)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

from triton_transformer.training.config import apply_overrides, load_config  # noqa: E402
from triton_transformer.training.trainer import Trainer  # noqa: E402

MODES = {
    "torch": {},
    "triton": {"model.use_triton": True},
    "compile": {"train.compile": True},
    "triton-compile": {"model.use_triton": True, "train.compile": True},
    # the score-matrix composition (bmm -> softmax -> dropout -> bmm) instead of the fused
    # attention kernel: issue #8's end-to-end comparison
    "triton-naive": {"model.use_triton": True, "model.attn_impl": "naive"},
    # eager steps (no whole-step graph): PyTorch ops, and Triton ops with their block graphs
    "torch-eager": {"train.cuda_graph": "false"},
    "triton-eager": {"model.use_triton": True, "train.cuda_graph": "false"},
}


def run_mode(name: str, args: argparse.Namespace, runs: Path) -> dict:
    overrides = {
        **MODES[name],
        "train.max_steps": args.steps,
        "train.warmup_steps": min(100, args.steps // 3),
        "eval.generate_every": 0,
        "eval.full_at_end": False,
        "log.checkpoint_every": 0,
        "log.progress": False,
        "log.run_dir": str(runs / name),
        **dict(args.set),
    }
    config = apply_overrides(load_config(args.config), list(overrides.items())).validate()
    torch.manual_seed(0)
    trainer = Trainer(config, overwrite=True)
    start = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - start
    records = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > args.steps // 5] or records
    a, b = steady[0], steady[-1]
    ms_step = 1e3 * (b["train_time_s"] - a["train_time_s"]) / max(b["step"] - a["step"], 1)
    tok_s = (b["tokens"] - a["tokens"]) / max(b["train_time_s"] - a["train_time_s"], 1e-9)
    gpu_ms, kernels = common.gpu_time_per_step(
        lambda: trainer.train_step(sync=True), args.profile_steps
    )
    trainer.close()
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {
        "mode": name,
        "tokens/s": tok_s,
        "ms/step": ms_step,
        "gpu ms/step": gpu_ms,
        "gpu busy": min(1.0, gpu_ms / ms_step),
        "peak MiB": result.peak_mem_mb,
        "cuda graph": trainer.cuda_graph_note,
        "last loss": b["loss"],
        "last val loss": val[-1] if val else float("nan"),
        "wall s": wall,
        "kernels": kernels,
    }


def _override(text: str) -> tuple[str, str]:
    """A --set argument, SECTION.FIELD=VALUE, as (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or "." not in key:
        raise argparse.ArgumentTypeError(f"expected SECTION.FIELD=VALUE, got {text!r}")
    return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--config", default=str(ROOT / "configs" / "enwik8.toml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    type=_override, help="config override for every mode (repeatable)")  # fmt: skip
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs"
    rows = []
    for name in args.modes:
        try:
            rows.append(run_mode(name, args, runs))
        except Exception as e:  # one failing mode must not hide the others
            rows.append({"mode": name, "error": repr(e)[:300]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
        torch._dynamo.reset()
    (out / "train.json").write_text(json.dumps(rows, indent=1))
    keys = ["mode", "tokens/s", "ms/step", "gpu ms/step", "gpu busy", "peak MiB", "cuda graph",
            "last loss", "last val loss"]  # fmt: skip
    fastest_torch = max(
        (r["tokens/s"] for r in rows if r["mode"] in ("torch", "compile") and "tokens/s" in r),
        default=float("nan"),
    )
    lines = [
        f"# train.py, {args.steps} steps per mode ({Path(args.config).name})",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
        "ratio = tokens/s over the fastest PyTorch-ops mode (torch or compile).",
        "",
        "| " + " | ".join([*keys, "ratio"]) + " |",
        "|" + "---|" * (len(keys) + 1),
    ]
    for r in rows:
        cells = [
            f"{r[k]:,.3f}" if isinstance(r.get(k), float) and r[k] < 100 else
            f"{r[k]:,.0f}" if isinstance(r.get(k), float) else str(r.get(k, r.get("error", "")))
            for k in keys
        ]  # fmt: skip
        ratio = r.get("tokens/s", float("nan")) / fastest_torch
        lines.append("| " + " | ".join([*cells, f"{ratio:.2f}"]) + " |")
    md = "\n".join(lines) + "\n"
    (out / "train.md").write_text(md)
    (out / "train_kernels.md").write_text(common.kernel_tables(rows, 25))
    print(md)
    from triton_transformer.training.plotting import plot_runs

    done = [runs / r["mode"] for r in rows if "error" not in r]
    if done:
        plot_runs(done, out / "loss_curves.png")


if __name__ == "__main__":
    main()
