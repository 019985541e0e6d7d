#!/usr/bin/env python
"""Train the triton-transformer language model: a thin command line over
`triton_transformer.training.trainer`.

    python train.py --use-triton                      # configs/enwik8.toml on a GPU
    python train.py --config configs/tiny.toml        # ~1 minute on a CPU, PyTorch ops
    python train.py --set train.lr=3e-4 --model.depth 4 --max-steps 1000
    python train.py --resume runs/RUN_DIR             # continue an interrupted run
    python train.py sample runs/RUN_DIR --prompt "The " --seed 1
    python train.py eval runs/RUN_DIR --split test    # loss over the whole test split
    torchrun --nproc_per_node=2 train.py --use-triton # data parallel on 2 GPUs (DDP)
    python train.py download [--data-dir data]        # fetch enwik8
    python train.py plot RUN_DIR [RUN_DIR ...] -o loss.png

Without a CUDA GPU and without --config, training uses the CPU-sized preset configs/cpu.toml
(and says so); `--use-triton` then trains with PyTorch ops, because the Triton kernels could
only run in Triton's CPU interpreter (a correctness tool, about 1000x slower), unless
`--triton-interpret` insists. TRITON_INTERPRET=1 must be set before triton is imported, so
that is decided here, before anything from the package is imported.

User mistakes (bad config, data, checkpoint or run directory) print one or two lines on
stderr and exit non-zero; `--debug` (or TRITON_TRANSFORMER_DEBUG=1) shows the traceback.
Under torchrun every process runs this script; rank 0 alone prints results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = ROOT / "configs" / "enwik8.toml"
CPU_CONFIG = ROOT / "configs" / "cpu.toml"
DEBUG_ENV = "TRITON_TRANSFORMER_DEBUG"

EXIT_ERROR = 1  # the run failed (non-finite loss, a crashed rank)
EXIT_USAGE = 2  # bad input: command line, config, data, checkpoint or run directory
EXIT_INTERRUPTED = 130  # the shell's convention for Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped by a scheduler, checkpoint saved


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` in argv (the last one), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _wants_cpu(argv: list[str]) -> bool:
    """Will this command run on the CPU? (torch does not import triton: safe to ask here.)"""
    import torch

    device = _flag_value(argv, "--device") or _flag_value(argv, "--train.device") or "auto"
    return device == "cpu" or not torch.cuda.is_available()


def _setup_triton_interpreter(argv: list[str]) -> None:
    """--triton-interpret on a CPU: run the Triton kernels in Triton's interpreter."""
    if "--triton-interpret" in argv and "TRITON_INTERPRET" not in os.environ and _wants_cpu(argv):
        os.environ["TRITON_INTERPRET"] = "1"


def _error(msg: str, code: int = EXIT_USAGE) -> int:
    # one "train.py: error:" line per line of the message (a config with two problems says
    # both, each on its own line)
    for line in [text.strip() for text in msg.splitlines() if text.strip()] or [msg]:
        print(f"train.py: error: {line}", file=sys.stderr)
    return code


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    # one "warning: ..." line, without the source line Python prints by default. A banner
    # (a message framed by rules of "!", like the fallback corpus's) gets the prefix on its
    # first line of text: never a bare "warning: " line above the frame.
    lines = str(message).strip("\n").splitlines() or [""]
    first = next((i for i, text in enumerate(lines) if text.strip("!")), 0)
    lines[first] = f"warning: {lines[first]}"
    return "\n".join(lines) + "\n"


def _add_triton_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--triton-interpret",
        action="store_true",
        help="without a CUDA GPU, run the Triton kernels in Triton's CPU interpreter anyway "
        "(a correctness check, about 1000x slower than PyTorch ops)",
    )


def _triton_policy(use_triton: bool, on_cpu: bool, insist: bool, is_main: bool = True) -> bool:
    """Whether to run the Triton kernels: on a CPU only in the interpreter, and only when
    insisted on (--triton-interpret or TRITON_INTERPRET=1); otherwise say why not."""
    from triton_transformer.utils import interpreter_enabled

    if not (use_triton and on_cpu) or interpreter_enabled():
        return use_triton
    if is_main:
        _note(
            "note: --use-triton without a CUDA GPU: the Triton kernels could only run in "
            "Triton's CPU interpreter, a correctness tool about 1000x slower than PyTorch.\n"
            "      Using PyTorch ops instead (same model, same checkpoints); pass "
            "--triton-interpret to insist on the kernels."
        )
    return False


# --------------------------------------------------------------------------- train


def train_main(argv: list[str]) -> int:
    started = time.perf_counter()
    from triton_transformer.training.config import (
        FitWarmup,
        add_config_arguments,
        apply_overrides,
        check_resume_changes,
        config_from_dict,
        config_to_toml,
        load_config,
    )

    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train the transformer (subcommands: sample, eval, download, plot; see "
        "--help of each). --debug shows tracebacks of errors.",
        epilog="examples:\n" + "\n".join(__doc__.splitlines()[3:14]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"TOML config (default: {DEFAULT_CONFIG.relative_to(ROOT)}; without a CUDA GPU "
        f"{CPU_CONFIG.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR|CHECKPOINT",
        default=None,
        help="continue from a checkpoint, with its config; overrides may change only how "
        "long, where and how it runs, evaluation and logging (train.max_steps, train.device, "
        "eval.*, log.*, ...), never the model, optimizer, schedule or data",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a run directory that holds one, deleting its files",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved TOML config and exit"
    )
    _add_triton_flags(parser)
    add_config_arguments(parser)
    args = parser.parse_args(argv)

    from triton_transformer.training.checkpoint import find_checkpoint, load_checkpoint
    from triton_transformer.training.distributed import env_info

    job = env_info()  # torchrun's RANK / WORLD_SIZE (rank 0 of 1 without torchrun)
    overrides = list(args.overrides)
    if args.triton_interpret:
        overrides.append(("model.use_triton", True))
    notes: list[str] = []  # what the overrides changed unasked (rank 0 prints them)
    if args.resume:
        ckpt_path = find_checkpoint(args.resume)
        ckpt = load_checkpoint(ckpt_path, mmap=True)
        saved = config_from_dict(ckpt["config"])
        # stay in the checkpoint's run directory unless told: where it is now, which is not
        # the one its config names if the run was copied or moved
        saved.log.run_dir = str(ckpt_path.parent)
        if args.config and job.is_main:
            _note(f"note: --resume uses the checkpoint's config; ignoring {args.config}")
        # a resumed run is already under way: --max-steps sets the step count only, never
        # the warmup its first steps used
        overrides = [(k, v.value if isinstance(v, FitWarmup) else v) for k, v in overrides]
        config = apply_overrides(saved, overrides)
        check_resume_changes(saved, config, args.resume)
        config = config.validate()
    else:
        path = args.config
        if path is None:
            path = DEFAULT_CONFIG
            if _wants_cpu(argv):
                path = CPU_CONFIG
                if job.is_main:
                    _note(
                        "!" * 78 + "\nNO CUDA GPU: training the CPU-sized preset "
                        f"{CPU_CONFIG.relative_to(ROOT)} (a 3M-parameter model, PyTorch ops, "
                        "a few minutes)\ninstead of the full "
                        f"{DEFAULT_CONFIG.relative_to(ROOT)} (26M parameters: days on a "
                        "CPU). To insist on it:\n  python train.py --config "
                        f"{DEFAULT_CONFIG.relative_to(ROOT)}\n" + "!" * 78
                    )
        config = load_config(path, overrides, notes)
    if job.is_main:
        for note in notes:
            _note(note)
    on_cpu = config.train.device == "cpu" or _wants_cpu(argv)
    config.model.use_triton = _triton_policy(
        config.model.use_triton, on_cpu, args.triton_interpret, job.is_main
    )
    if args.print_config:
        if job.is_main:
            print(config_to_toml(config), end="")
        return 0
    return _run_training(config, args, job, started)


def _run_training(config, args: argparse.Namespace, job, started: float) -> int:
    from triton_transformer.training.config import ConfigError
    from triton_transformer.training.distributed import DistributedError
    from triton_transformer.training.trainer import NonFiniteLossError
    from triton_transformer.training.trainer import train as run_training

    # from here on an error may concern one rank only: each says its own (with its rank)
    where = f" (rank {job.rank} of {job.world_size})" if job.enabled else ""
    try:
        result = run_training(config, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as e:
        return _error(f"{e}{where}")
    except NonFiniteLossError as e:
        # every rank sees the same all-reduced loss and gradient norm: rank 0 reports it
        return _error(str(e), code=EXIT_ERROR) if job.is_main else EXIT_ERROR
    except DistributedError as e:
        return _error(str(e), code=EXIT_ERROR)

    code = EXIT_TERMINATED if result.stop_signal == "SIGTERM" else EXIT_INTERRUPTED
    if not job.is_main:
        return code if result.interrupted else 0
    wall = _duration(time.perf_counter() - started)
    if result.interrupted:
        launcher = f"torchrun --nproc_per_node={job.world_size}" if job.enabled else "python"
        saved = (
            f"checkpoint: {result.checkpoint}"
            if result.checkpoint
            else "no new checkpoint (the last one is kept)"
        )
        _note(
            f"stopped at step {result.step} ({result.stop_signal}) after {wall}; {saved}. "
            f"Resume with:\n  {launcher} train.py --resume {result.run_dir}"
        )
        return code
    summary = [f"done: step {result.step}"]
    if result.world_size > 1:
        summary.append(f"{result.world_size} processes")
    whole = result.full_val_loss is not None
    final = result.full_val_loss if whole else result.final_val_loss
    if final is not None:
        which = "whole-split val loss" if whole else "val loss"
        bpb = result.full_val_bpb if whole else result.final_val_bpb
        bpb = final / math.log(2) if bpb is None else bpb
        summary.append(f"{which} {final:.4f} ({bpb:.4f} bits/byte)")
    if result.tokens_per_s:
        summary.append(
            f"{result.tokens_per_s:,.0f} tokens/s" + (" (all ranks)" if job.enabled else "")
        )
    if result.mfu is not None:
        summary.append(f"MFU {100 * result.mfu:.1f}%")
    if result.peak_mem_mb:
        summary.append(f"peak memory {result.peak_mem_mb:,.0f} MiB")
    summary.append(f"wall time {wall}")
    print(" | ".join(summary) + f"\ncheckpoint: {result.checkpoint}")
    return 0


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


# --------------------------------------------------------------------------- sample / eval


def _load_for_inference(run: str, device_flag: str, use_triton: bool, insist: bool):
    """(model in eval mode, its Config, its tokenizer, device, autocast factory) from a run
    or checkpoint."""
    from triton_transformer.training.checkpoint import (
        find_checkpoint,
        load_checkpoint,
        load_model,
    )
    from triton_transformer.training.config import config_from_dict
    from triton_transformer.training.setup import (
        autocast_context,
        resolve_device,
        resolve_precision,
    )
    from triton_transformer.training.tokenizer import run_tokenizer

    device = resolve_device(device_flag)
    ckpt = load_checkpoint(run, mmap=True)
    saved = config_from_dict(ckpt["config"])
    tokenizer = run_tokenizer(ckpt, find_checkpoint(run).parent)
    triton = _triton_policy(use_triton or saved.model.use_triton, device.type == "cpu", insist)
    model, config = load_model(run, device=device, use_triton=triton)
    dtype = resolve_precision("auto", device)
    return model, config, tokenizer, device, lambda: autocast_context(device, dtype)


def sample_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py sample",
        description="Generate text from a trained run (KV cache). The text goes to stdout, "
        "everything else to stderr.",
    )
    parser.add_argument("run", metavar="RUN_DIR|CHECKPOINT")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", type=Path, default=None, help="continue this file")
    parser.add_argument(
        "--length", type=int, default=256, help="tokens (bytes for a byte model) to generate (256)"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (1.0)")
    parser.add_argument(
        "--filter-thres", type=float, default=0.9, help="top-k: keep the top 1 - F (0.9)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: a fresh one, printed)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--use-triton", action="store_true", help="run the Triton kernels")
    _add_triton_flags(parser)
    args = parser.parse_args(argv)
    if args.length < 0:
        return _error("--length must be >= 0")

    from triton_transformer.training.evaluation import generate_text

    if args.prompt_file is not None:
        prompt = args.prompt_file.read_bytes()
    else:
        prompt = (args.prompt if args.prompt is not None else "\n").encode("utf-8")
    if not prompt:
        return _error("the prompt is empty: give at least one byte")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    model, _, tokenizer, device, autocast = _load_for_inference(
        args.run, args.device, args.use_triton, args.triton_interpret
    )
    unit = "bytes" if tokenizer.kind == "bytes" else "tokens"
    _note(
        f"sampling {args.length} {unit} from {args.run} ({device}, seed {seed}, "
        f"temperature {args.temperature}, filter_thres {args.filter_thres})"
    )
    text = generate_text(
        model,
        prompt,
        length=args.length,
        temperature=args.temperature,
        filter_thres=args.filter_thres,
        seed=seed,
        device=device,
        autocast=autocast,
        tokenizer=tokenizer,
    )
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py eval",
        description="Loss per token and bits per byte of a trained run over a split of its "
        "corpus, tokenized by the run's tokenizer (independent of --batch-size).",
    )
    parser.add_argument("run", metavar="RUN_DIR|CHECKPOINT")
    parser.add_argument("--split", choices=["valid", "test"], default="valid")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="windows per forward (the run's)"
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=0,
        help="score at most this many tokens (bytes for a byte model), spread over the split "
        "(0: all of it)",
    )
    parser.add_argument("--data", default=None, help="corpus (default: the run's data.source)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--use-triton", action="store_true", help="run the Triton kernels")
    _add_triton_flags(parser)
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        return _error("--batch-size must be >= 1")
    if args.max_bytes < 0:
        return _error("--max-bytes must be >= 0 (0: the whole split)")

    from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
    from triton_transformer.training.data import load_corpus
    from triton_transformer.training.evaluation import evaluate_loss
    from triton_transformer.training.setup import token_cache_dir
    from triton_transformer.training.tokenizer import split_tokens

    model, config, tokenizer, device, autocast = _load_for_inference(
        args.run, args.device, args.use_triton, args.triton_interpret
    )
    d = config.data
    corpus = load_corpus(
        args.data or d.source, data_dir=d.data_dir, download=d.download, fallback=d.fallback
    )
    if getattr(corpus, args.split) is None:
        return _error(f"corpus {corpus.name} has no {args.split} split")
    byte_model = tokenizer.kind == "bytes"
    # the run's tokenizer, its tokens cached beside the data (built once)
    data = split_tokens(
        corpus, args.split, tokenizer, token_cache_dir(d), progress=sys.stderr.isatty()
    )
    what = corpus.description if byte_model else f"{corpus.description}; {tokenizer.describe()}"
    _note(f"evaluating {args.run} on the {args.split} split of {what}")
    out = evaluate_loss(
        AutoregressiveWrapper(model),
        data,
        seq_len=config.train.seq_len,
        max_bytes=args.max_bytes,
        batch_size=args.batch_size or config.train.batch_size,
        device=device,
        autocast=autocast,
        progress=sys.stderr.isatty(),
        token_bytes=None if byte_model else tokenizer.token_bytes(),
    )
    if args.json:
        record = {
            "split": args.split,
            "loss": out["val_loss"],  # nats per token (per byte for a byte model)
            "bits_per_byte": out["val_bpb"],
            "tokens": out["tokens"],
            "bytes": out["bytes"],
            "tokenizer": tokenizer.kind,
        }
        print(json.dumps(record))
    elif byte_model:
        print(
            f"{args.split}: loss {out['val_loss']:.4f} nats/byte, {out['val_bpb']:.4f} "
            f"bits/byte over {out['tokens']:,} bytes"
        )
    else:
        print(
            f"{args.split}: loss {out['val_loss']:.4f} nats/token, {out['val_bpb']:.4f} "
            f"bits/byte over {out['tokens']:,} tokens ({out['bytes']:,} bytes)"
        )
    return 0


# --------------------------------------------------------------------------- download / plot


def download_main(argv: list[str]) -> int:
    from triton_transformer.training.data import ENWIK8_URL, DownloadError, download_enwik8

    parser = argparse.ArgumentParser(prog="train.py download", description="Fetch enwik8.")
    parser.add_argument("--data-dir", default="data", help="where enwik8.zip goes (data)")
    parser.add_argument("--url", default=ENWIK8_URL, help=f"source ({ENWIK8_URL})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per read")
    args = parser.parse_args(argv)
    try:
        path = download_enwik8(args.data_dir, url=args.url, timeout=args.timeout)
    except DownloadError as e:
        return _error(str(e), code=EXIT_ERROR)
    print(f"enwik8: {path}")
    return 0


def plot_main(argv: list[str]) -> int:
    from triton_transformer.training.plotting import X_AXES, plot_runs, read_metrics

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
        for run_dir in args.run_dirs:
            if not read_metrics(run_dir):
                _note(f"{run_dir}: no records yet (its first log line comes at log.log_every)")
        path = plot_runs(args.run_dirs, args.output, labels=args.labels, x=args.x, title=args.title)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------- main

COMMANDS = {
    "train": train_main,
    "sample": sample_main,
    "eval": eval_main,
    "download": download_main,
    "plot": plot_main,
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (config, data, checkpoint, run directory, a missing
    optional package), reported in a line; anything else is a bug and keeps its traceback."""
    from triton_transformer.training.checkpoint import CheckpointError
    from triton_transformer.training.config import ConfigError
    from triton_transformer.training.data import DownloadError
    from triton_transformer.training.run_dir import RunDirError

    return (ConfigError, CheckpointError, RunDirError, DownloadError, ValueError, OSError,
            ImportError)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    command = train_main
    if argv and argv[0] in COMMANDS:
        command = COMMANDS[argv.pop(0)]
    _setup_triton_interpreter(argv)
    if not debug:
        warnings.formatwarning = _format_warning
    try:
        return command(argv)
    except KeyboardInterrupt:
        # Ctrl-C outside training (download, eval, sample, loading): nothing to save
        _note("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug or not isinstance(e, _user_error_types()):
            raise
        msg = str(e).strip() or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        return _error(msg, code=EXIT_USAGE)


if __name__ == "__main__":
    # a SIGTERM before training installs its handler (or after it) stops quietly too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(EXIT_TERMINATED))
    sys.exit(main())
