#!/usr/bin/env python
"""Train the triton-transformer language model: a thin command line over
`triton_transformer.trainer`.

    python train.py --use-triton                      # configs/enwik8.toml on a GPU
    python train.py --config configs/tiny.toml        # ~1 minute on a CPU, PyTorch ops
    python train.py --set train.lr=3e-4 --model.depth 4 --max-steps 1000
    python train.py --resume runs/RUN_DIR             # continue an interrupted run
    torchrun --nproc_per_node=2 train.py --use-triton # data parallel on 2 GPUs (DDP)
    python train.py download [--data-dir data]        # fetch enwik8
    python train.py plot RUN_DIR [RUN_DIR ...] -o loss.png

Under torchrun every process runs this script; rank 0 alone prints results (and the trainer
makes it the only one that logs and writes files).

Without a CUDA GPU, `--use-triton` runs the Triton kernels in Triton's CPU interpreter (very
slow, for checking only): TRITON_INTERPRET=1 must be set before triton is imported, so it is
decided here, before anything from the package is imported.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = ROOT / "configs" / "enwik8.toml"

EXIT_INTERRUPTED = 130  # the shell's convention for Ctrl-C


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in argv (the last one), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _wants_triton(argv: list[str]) -> bool:
    """Could this run use the Triton kernels? (Errs on the side of yes.)"""
    if any("use-triton" in a or "use_triton" in a for a in argv):
        return True
    if _flag_value(argv, "--resume"):
        return True  # the checkpoint's config decides; cheaper to assume than to load it
    config = _flag_value(argv, "--config") or DEFAULT_CONFIG
    try:
        import tomllib

        with open(config, "rb") as f:
            return bool(tomllib.load(f).get("model", {}).get("use_triton", False))
    except Exception:
        return False  # unreadable: load_config reports it properly later


def _setup_triton_interpreter(argv: list[str]) -> None:
    """Without a GPU, Triton kernels can only run in the interpreter (torch does not import
    triton, so checking for CUDA first is safe)."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    device = _flag_value(argv, "--device") or _flag_value(argv, "--train.device") or "auto"
    on_cpu = device == "cpu" or not torch.cuda.is_available()
    if on_cpu and _wants_triton(argv):
        os.environ["TRITON_INTERPRET"] = "1"


def _error(msg: str, code: int = 2) -> int:
    print(f"train.py: error: {msg}", file=sys.stderr)
    return code


def train_main(argv: list[str]) -> int:
    _setup_triton_interpreter(argv)
    from triton_transformer.config import (
        ConfigError,
        add_config_arguments,
        apply_overrides,
        config_from_dict,
        load_config,
    )

    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train the transformer (subcommands: download, plot; see --help of each).",
        epilog="examples:\n" + "\n".join(__doc__.splitlines()[3:10]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML config (default: {DEFAULT_CONFIG.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR|CHECKPOINT",
        default=None,
        help="continue from a checkpoint, with its config (plus any overrides)",
    )
    add_config_arguments(parser)
    args = parser.parse_args(argv)

    from triton_transformer.distributed import DistributedError, env_info
    from triton_transformer.trainer import NonFiniteLossError, find_checkpoint, load_checkpoint
    from triton_transformer.trainer import train as run_training

    try:
        job = env_info()  # torchrun's RANK / WORLD_SIZE (rank 0 of 1 without torchrun)
    except ValueError as e:
        return _error(str(e))

    try:
        if args.resume:
            ckpt_path = find_checkpoint(args.resume)
            config = config_from_dict(load_checkpoint(ckpt_path, mmap=True)["config"])
            config.log.run_dir = ""  # stay in the checkpoint's run directory unless told
            if args.config and job.is_main:
                print(
                    f"note: --resume uses the checkpoint's config; ignoring {args.config}",
                    file=sys.stderr,
                )
            config = apply_overrides(config, args.overrides).validate()
        else:
            config = load_config(args.config or DEFAULT_CONFIG, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        # the same on every rank: rank 0 says it once
        return _error(str(e)) if job.is_main else 2

    # from here on an error may concern one rank only: each says its own (with its rank)
    where = f" (rank {job.rank} of {job.world_size})" if job.enabled else ""
    try:
        result = run_training(config, resume=args.resume)
    except (ConfigError, FileNotFoundError) as e:
        return _error(f"{e}{where}")
    except NonFiniteLossError as e:
        # every rank sees the same all-reduced loss and gradient norm: rank 0 reports it
        return _error(str(e), code=1) if job.is_main else 1
    except DistributedError as e:
        return _error(str(e), code=1)

    if not job.is_main:
        return EXIT_INTERRUPTED if result.interrupted else 0
    if result.interrupted:
        launcher = f"torchrun --nproc_per_node={job.world_size}" if job.enabled else "python"
        print(
            f"stopped at step {result.step}. Resume with:\n"
            f"  {launcher} train.py --resume {result.run_dir}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    summary = [f"done: step {result.step}"]
    if result.world_size > 1:
        summary.append(f"{result.world_size} processes")
    if result.final_val_loss is not None:
        bpb = result.final_val_loss / math.log(2)
        summary.append(f"val loss {result.final_val_loss:.4f} ({bpb:.4f} bits/byte)")
    if result.tokens_per_s:
        summary.append(
            f"{result.tokens_per_s:,.0f} tokens/s" + (" (all ranks)" if job.enabled else "")
        )
    if result.peak_mem_mb:
        summary.append(f"peak memory {result.peak_mem_mb:,.0f} MiB")
    print(" | ".join(summary) + f"\ncheckpoint: {result.checkpoint}")
    return 0


def download_main(argv: list[str]) -> int:
    from triton_transformer.data import ENWIK8_URL, DownloadError, download_enwik8

    parser = argparse.ArgumentParser(prog="train.py download", description="Fetch enwik8.")
    parser.add_argument("--data-dir", default="data", help="where enwik8.zip goes (data)")
    parser.add_argument("--url", default=ENWIK8_URL, help=f"source ({ENWIK8_URL})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per read")
    args = parser.parse_args(argv)
    try:
        path = download_enwik8(args.data_dir, url=args.url, timeout=args.timeout)
    except DownloadError as e:
        return _error(str(e), code=1)
    print(f"enwik8: {path}")
    return 0


def plot_main(argv: list[str]) -> int:
    from triton_transformer.plotting import X_AXES, plot_runs

    parser = argparse.ArgumentParser(
        prog="train.py plot", description="Train/validation loss curves of runs into a PNG."
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("-o", "--output", default="loss.png", help="PNG to write (loss.png)")
    parser.add_argument("--x", choices=list(X_AXES), default="step", help="x axis (step)")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per run")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        path = plot_runs(args.run_dirs, args.output, labels=args.labels, x=args.x, title=args.title)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "download":
        return download_main(argv[1:])
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
