"""The training loop: `train(config) -> TrainResult`, or `Trainer(config).fit()`.

One optimizer step = `grad_accum_steps` micro-batches of random windows of the training
split (AdamW, linear warmup then cosine decay, global grad-norm clipping, bf16 autocast on
GPU). Every `eval.eval_every` steps the loss and bits per byte over a fixed set of validation
windows are measured, every `eval.generate_every` steps a text sample is generated from a
validation prime. Metrics go to <run_dir>/metrics.jsonl (and Weights & Biases with
`log.wandb`).

Checkpoints (<run_dir>/checkpoint.pt, written atomically) hold everything needed to continue
bit for bit: model, optimizer, scheduler, step, and every RNG stream (torch CPU/CUDA, python,
numpy and the data sampler's generator). Validation and sampling run under forked RNG
states, so they never perturb training: a run resumed from a checkpoint reproduces the losses
of an uninterrupted one exactly (on CPU with PyTorch ops).

Multi-GPU: under `torchrun --nproc_per_node=N train.py ...` every process trains a replica
wrapped in PyTorch's `DistributedDataParallel` (process group from `distributed.py`: NCCL on
GPU, gloo on CPU). Each rank draws its own windows (data seed + rank), or its rows of one
global batch with `data.shard_global_batch`; gradients are averaged by DDP, synchronised only
on the last micro-batch of a step (`no_sync` on the others), so N ranks of batch b train like
one process of batch N*b. The logged loss and the validation loss (each rank scores a
disjoint share of the fixed validation batches) are reduced over the ranks; tokens/s count
the whole job. Rank 0 alone prints, logs, samples and writes checkpoints, which hold every
rank's RNG and data-sampler state so that all ranks resume exactly (`rng_ranks`).
"""

from __future__ import annotations

import contextlib
import json
import math
import netrc
import os
import random
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.config import Config, ConfigError, config_from_dict, config_to_toml
from triton_transformer.data import (
    Corpus,
    FallbackCorpusWarning,
    decode_tokens,
    eval_batches,
    load_corpus,
    random_batch,
)
from triton_transformer.distributed import (
    DistInfo,
    DistributedError,
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    destroy_distributed,
    env_info,
    get_rank,
    get_world_size,
    init_distributed,
    is_comm_error,
    is_main_process,
    main_process_first,
)
from triton_transformer.transformer import Transformer
from triton_transformer.utils import exists, interpreter_enabled

__all__ = [
    "CHECKPOINT_NAME",
    "METRICS_NAME",
    "NonFiniteLossError",
    "TrainResult",
    "Trainer",
    "find_checkpoint",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "load_checkpoint",
    "load_model",
    "lr_multiplier",
    "train",
    "unwrap_model",
]

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"
CHECKPOINT_VERSION = 1

# called after every optimizer step with (trainer, step, info dict of that step)
Callback = Callable[["Trainer", int, dict], None]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became inf/nan; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    """What a `fit` call did. `losses`/`val_losses` map step -> loss for steps run in it."""

    run_dir: Path
    checkpoint: Path | None
    step: int
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    interrupted: bool = False
    # mean over the steps of this call after its first, which pays for compilation and
    # autotuning (all of them if only one ran)
    tokens_per_s: float | None = None
    peak_mem_mb: float | None = None  # GPU only
    world_size: int = 1  # processes that trained (tokens_per_s counts all of them)

    @property
    def final_val_loss(self) -> float | None:
        return self.val_losses[max(self.val_losses)] if self.val_losses else None


# --------------------------------------------------------------------------- process helpers
# get_rank, get_world_size, is_main_process: from triton_transformer.distributed


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip torch.compile (`_orig_mod`) and DDP (`module`) wrappers, for state dicts."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


# --------------------------------------------------------------------------- checkpoints


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory holding checkpoint.pt."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict:
    """Load a checkpoint dict (safe `weights_only` unpickling). mmap=True reads tensors
    lazily: cheap when only the config or step is needed."""
    path = find_checkpoint(path)
    ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {ckpt.get('version')!r}")
    return ckpt


def load_model(
    path: str | Path, device: str | torch.device = "cpu", use_triton: bool | None = None
) -> tuple[Transformer, Config]:
    """Rebuild the trained Transformer from a checkpoint (eval mode) and its Config."""
    ckpt = load_checkpoint(path)
    config = config_from_dict(ckpt["config"])
    kwargs = asdict(config.model)
    if exists(use_triton):
        kwargs["use_triton"] = use_triton
    model = Transformer(**kwargs)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), config


def _atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file in the same directory, fsync, then os.replace: a crash
    mid-write never leaves a truncated checkpoint behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR factor for optimizer step `step` (0-based): linear warmup to 1 over warmup_steps,
    then cosine decay to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- wandb


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class _WandbLogger:
    """Thin wrapper over a wandb run; wandb is imported only when asked for."""

    def __init__(self, config: Config, run_dir: Path, run_id: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "log.wandb=true (--wandb) needs the wandb package: pip install wandb"
            ) from None
        if not _wandb_has_credentials() and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
            tqdm.write("wandb: no API key configured, logging offline (wandb sync later)")
        self.wandb = wandb
        self.run = wandb.init(
            project=config.log.wandb_project,
            name=run_dir.name,
            dir=str(run_dir),
            config=config.to_dict(),
            id=run_id,
            resume="allow",
        )

    @property
    def run_id(self) -> str | None:
        return getattr(self.run, "id", None)

    def log(self, record: dict, step: int) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        html = getattr(self.wandb, "Html", None)
        value = html(f"<pre>{escape(text)}</pre>") if exists(html) else text
        self.run.log({key: value}, step=step)

    def finish(self) -> None:
        self.run.finish()


# --------------------------------------------------------------------------- trainer


class Trainer:
    """Owns the model, optimizer, data streams and run directory of one training run.

    config: a validated `Config`.
    resume: a run directory or checkpoint file to continue from (None: a fresh run).
    corpus: an already loaded `Corpus` (None: `load_corpus` per config.data).
    callbacks: called after every optimizer step as callback(trainer, step, info); raising
        KeyboardInterrupt there behaves like Ctrl-C (tests use this).
    """

    def __init__(
        self,
        config: Config,
        *,
        resume: str | Path | None = None,
        corpus: Corpus | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.config = config.validate()
        self.callbacks = list(callbacks)
        t = config.train
        self.device = self._resolve_device(t.device)
        # under torchrun: join the process group (NCCL/gloo); a no-op for a single process
        self._owns_process_group = init_distributed(self.device, t.dist_timeout_s)
        self.dist = DistInfo(get_rank(), env_info().local_rank, get_world_size())
        self.is_main = self.dist.is_main
        try:
            self._setup(resume, corpus)
        except BaseException as exc:
            self.close()
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise

    def _setup(self, resume: str | Path | None, corpus: Corpus | None) -> None:
        config = self.config
        m, t = config.model, config.train
        self.amp_dtype = self._resolve_precision(t.precision)
        self._check_triton()

        ckpt_path = find_checkpoint(resume) if exists(resume) else None
        ckpt = load_checkpoint(ckpt_path) if exists(ckpt_path) else None
        # rank 0 names the run (a timestamp, or a suffix for a taken name): all ranks agree
        self.run_dir = Path(broadcast_object(str(self._resolve_run_dir(ckpt_path))))

        self._seed_everything(t.seed)
        self.corpus = corpus if exists(corpus) else self._load_corpus()
        self._check_corpus()

        # identical initial weights on every rank (DDP also broadcasts rank 0's at wrap time)
        self.model = Transformer(**asdict(m)).to(self.device)
        self.model.check_token_ids = False  # bytes are always < num_tokens; avoid a GPU sync
        self.wrapper = AutoregressiveWrapper(self.model)
        if t.compile:
            # compile the inner module in place, then wrap it in DDP: the order PyTorch
            # documents ("Where to apply torch.compile?"); DDP's hooks stay outside the graph
            # and Dynamo splits the graph at DDP's bucket boundaries (DDPOptimizer)
            self.wrapper.compile()
        self.train_model: nn.Module = self.wrapper
        if self.dist.enabled:
            self.train_model = nn.parallel.DistributedDataParallel(
                self.wrapper,
                device_ids=[self.device] if self.device.type == "cuda" else None,
            )
        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_multiplier(s, t.warmup_steps, t.max_steps, t.min_lr_ratio),
        )
        if self.dist.rank > 0:
            # from here on each rank needs its own dropout masks (rank 0 keeps the stream a
            # single process would have)
            torch.manual_seed(t.seed + 1_000_003 * self.dist.rank)
        # The data sampler's own stream: its state is the "position" in the data. Each rank
        # draws its own windows, unless they all share one global batch (shard_global_batch).
        data_seed = t.seed + 1 + (0 if config.data.shard_global_batch else self.dist.rank)
        self.data_gen = torch.Generator().manual_seed(data_seed)

        self.step = 0
        self.tokens_seen = 0
        self.train_time_s = 0.0  # time inside training steps only (no eval / sampling)
        self.last_checkpoint_step: int | None = None
        self._wandb_id: str | None = None
        if exists(ckpt):
            self._load_state(ckpt)  # restores the RNG streams last

        self._phase = "idle"  # "forward" before the update, "update" while params change
        self._step_rng: dict | None = None
        self._stop_requested = False  # Ctrl-C seen by this process
        self._stop_agreed = False  # ... and, with several ranks, known to all of them
        self.global_batch = t.batch_size * t.grad_accum_steps * self.dist.world_size
        self.tokens_per_step = self.global_batch * t.seq_len

        self.wandb: _WandbLogger | None = None
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(config_to_toml(config))
            self._truncate_logs()
            if config.log.wandb:
                self.wandb = _WandbLogger(config, self.run_dir, self._wandb_id)
                self._wandb_id = self.wandb.run_id

    def close(self) -> None:
        """Leave the process group if this trainer created it (`train` calls this)."""
        if getattr(self, "_owns_process_group", False):
            self._owns_process_group = False
            destroy_distributed()

    def _comm_error(self, exc: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {get_rank()} of {get_world_size()}: a collective operation failed "
            f"({type(exc).__name__}: {str(exc).strip()[:500]}). Another rank probably crashed "
            "(see its log) or stalled for longer than "
            f"train.dist_timeout_s={self.config.train.dist_timeout_s:g}; stopping this rank too."
        )

    # ------------------------------------------------------------------ setup helpers

    @staticmethod
    def _resolve_device(name: str) -> torch.device:
        """The training device; under torchrun each process drives cuda:LOCAL_RANK."""
        info = env_info()
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"train.device='{name}' but no CUDA device is available")
        if not info.enabled or name == "cpu":
            return torch.device(name)
        if name != "cuda":
            raise ConfigError(
                f"train.device='{name}' with {info.world_size} torchrun processes: each one "
                "uses cuda:LOCAL_RANK; set train.device to 'cuda' or 'auto' (pick the GPUs "
                "with CUDA_VISIBLE_DEVICES)"
            )
        if info.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={info.local_rank} but only {torch.cuda.device_count()} GPU(s) are "
                "visible: start at most that many processes per machine (--nproc_per_node)"
            )
        return torch.device("cuda", info.local_rank)

    def _load_corpus(self) -> Corpus:
        """Rank 0 of each machine prepares the corpus (download, caches) before the others
        read it; only it reports a fallback."""
        d = self.config.data
        with main_process_first(), warnings.catch_warnings():
            if self.dist.local_rank != 0:
                warnings.simplefilter("ignore", FallbackCorpusWarning)
            return load_corpus(
                d.source,
                data_dir=d.data_dir,
                download=d.download,
                fallback=d.fallback,
                progress=self.dist.local_rank == 0,
            )

    def _resolve_precision(self, precision: str) -> torch.dtype | None:
        """The autocast dtype, or None for plain fp32."""
        on_gpu = self.device.type == "cuda"
        if precision == "bf16" and not on_gpu:
            raise ConfigError(
                f"train.precision='bf16' needs a CUDA device, but training runs on {self.device}"
            )
        if precision == "bf16" or (
            precision == "auto" and on_gpu and torch.cuda.is_bf16_supported()
        ):
            return torch.bfloat16
        return None

    def _check_triton(self) -> None:
        if not self.config.model.use_triton:
            return
        if self.device.type == "cpu" and not interpreter_enabled():
            raise ConfigError(
                "model.use_triton=true on CPU needs Triton's CPU interpreter: set "
                "TRITON_INTERPRET=1 before importing triton_transformer (train.py does this "
                "when there is no GPU), or drop --use-triton to train with PyTorch ops"
            )
        if interpreter_enabled() and self.is_main:
            warnings.warn(
                "model.use_triton with TRITON_INTERPRET=1: the Triton kernels run in "
                "Triton's CPU interpreter, which is very slow; this is for checking, not "
                "training. Drop --use-triton to train with PyTorch ops.",
                stacklevel=3,
            )

    def _resolve_run_dir(self, ckpt_path: Path | None) -> Path:
        lg = self.config.log
        if lg.run_dir:
            return Path(lg.run_dir)
        if exists(ckpt_path):
            return ckpt_path.parent
        backend = "triton" if self.config.model.use_triton else "torch"
        if self.config.train.compile:
            backend += "-compile"
        base = f"{lg.run_name}-{backend}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, i = Path(lg.out_dir) / base, 1
        while path.exists():
            path, i = Path(lg.out_dir) / f"{base}-{i}", i + 1
        return path

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # CPU and every CUDA device

    def _check_corpus(self) -> None:
        t, e = self.config.train, self.config.eval
        need = {"train": t.seq_len + 2}
        if e.eval_every:
            need["valid"] = t.seq_len + 1
        if e.generate_every:
            need["valid"] = max(need.get("valid", 0), e.prime_len + 1)
        for split, n in need.items():
            have = len(getattr(self.corpus, split))
            if have < n:
                raise ConfigError(
                    f"the {split} split of corpus '{self.corpus.name}' has {have} bytes, too few "
                    f"for train.seq_len={t.seq_len} / eval.prime_len={e.prime_len}"
                )

    def _make_optimizer(self) -> torch.optim.Optimizer:
        t = self.config.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        # decay matrices and embeddings, not norm weights (nanoGPT's split)
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if exists(self.amp_dtype):
            return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)
        return contextlib.nullcontext()

    def _fork_rng(self) -> contextlib.AbstractContextManager:
        """Everything inside sees (and leaves) the training RNG streams untouched."""
        devices = [self.device] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    # ------------------------------------------------------------------ state

    def rng_state(self) -> dict:
        np_state = np.random.get_state()
        state = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": {
                "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "cached_gaussian": float(np_state[4]),
            },
            "data": self.data_gen.get_state(),
        }
        if self.device.type == "cuda":
            # this process's GPU only: touching the others would create a CUDA context on
            # every GPU in every rank
            state["cuda_device"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        npst = state["numpy"]
        np.random.set_state(
            (
                "MT19937",
                npst["keys"].numpy().astype(np.uint32),
                npst["pos"],
                npst["has_gauss"],
                npst["cached_gaussian"],
            )
        )
        self.data_gen.set_state(state["data"])
        if "cuda_device" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_device"], self.device)
        elif "cuda" in state and torch.cuda.is_available() and not self.dist.enabled:
            # checkpoints of the first version: every visible GPU's state
            cuda = state["cuda"]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                warnings.warn(
                    "checkpoint's CUDA RNG states do not match this machine's GPUs", stacklevel=2
                )

    def state_dict(self, rng: dict | None = None) -> dict:
        return {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng if exists(rng) else self.rng_state(),
            "config": self.config.to_dict(),
            "wandb_id": self._wandb_id,
        }

    def _load_state(self, ckpt: dict) -> None:
        unwrap_model(self.model).load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.step = int(ckpt["step"])
        self.tokens_seen = int(ckpt["tokens_seen"])
        self.train_time_s = float(ckpt["train_time_s"])
        self._wandb_id = ckpt.get("wandb_id")
        self.last_checkpoint_step = self.step
        self.set_rng_state(self._rank_rng_state(ckpt))

    def _rank_rng_state(self, ckpt: dict) -> dict:
        """This rank's RNG states from a checkpoint. Every rank gets its own back when the
        world size is unchanged; otherwise (a checkpoint of another world size) rank 0 gets
        the saved rank 0 states and every new rank fresh streams seeded from (seed, rank,
        step), so no two ranks draw the same windows: a correct but not bitwise continuation.
        """
        saved = ckpt.get("rng_ranks") or [ckpt["rng"]]
        rank, world = self.dist.rank, self.dist.world_size
        if len(saved) == world:
            return saved[rank]
        if self.is_main:
            warnings.warn(
                f"the checkpoint was written by {len(saved)} process(es), resuming with "
                f"{world}: the random streams of the other ranks restart from fresh seeds, so "
                "the data order differs from an uninterrupted run",
                stacklevel=3,
            )
        if rank < len(saved):
            state = dict(saved[rank])
        else:
            seed = self.config.train.seed + 1_000_003 * rank + 7919 * self.step
            state = dict(saved[0], torch=torch.Generator().manual_seed(seed).get_state())
            state["data"] = torch.Generator().manual_seed(seed + 1).get_state()
            state.pop("cuda_device", None)
        if self.config.data.shard_global_batch:
            state["data"] = saved[0]["data"]  # one shared global stream: keep its position
        return state

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_NAME

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        """Atomically write the full training state (rng: this rank's RNG states to store,
        default now). With several ranks every rank must call it: rank 0 gathers all ranks'
        RNG states and writes the file; the others wait until it is on disk."""
        states = all_gather_object(rng if exists(rng) else self.rng_state())
        if self.is_main:
            state = self.state_dict(states[0])
            if self.dist.enabled:
                state["rng_ranks"] = states  # rank r resumes from states[r]
            _atomic_save(state, self.checkpoint_path)
        barrier()  # nobody runs ahead of (or reads) a checkpoint that is still being written
        self.last_checkpoint_step = self.step
        return self.checkpoint_path

    def _truncate_logs(self) -> None:
        """Drop log lines past the step we (re)start from: a crashed run may have logged
        steps after its last checkpoint, which the resumed run will log again."""
        for name in (METRICS_NAME, SAMPLES_NAME):
            path = self.run_dir / name
            if not path.exists():
                continue
            keep = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= self.step:
                        keep.append(line)
                except json.JSONDecodeError:
                    pass  # a line cut short by a crash
            path.write_text("".join(f"{line}\n" for line in keep))

    # ------------------------------------------------------------------ output

    def _print(self, msg: str) -> None:
        if self.is_main:
            tqdm.write(msg)

    def _append_jsonl(self, name: str, record: dict) -> None:
        if self.is_main:
            with (self.run_dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ steps

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps micro-batches; returns its stats."""
        t = self.config.train
        self._phase = "forward"
        self._step_rng = self.rng_state()  # to rewind to if interrupted mid-step
        start = time.perf_counter()
        total = torch.zeros((), device=self.device)
        for i in range(t.grad_accum_steps):
            batch = self._next_batch().to(self.device, non_blocking=True)
            # DDP all-reduces the gradients in the backward of the last micro-batch only
            last = i == t.grad_accum_steps - 1
            with self._no_sync(not last):
                with self._autocast():
                    loss = self.train_model(batch)
                (loss / t.grad_accum_steps).backward()
            total += loss.detach().float()
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        # the gradients are the mean over all ranks here, so the norm is the same everywhere
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        stats = [total / t.grad_accum_steps, grad_norm.float()]
        if self.dist.enabled:
            # one small all-reduce per step: the mean loss over the ranks, and whether any
            # of them saw Ctrl-C, so that every rank logs the same loss, takes the same
            # non-finite decision and stops after the same step
            flag = torch.full((), float(self._stop_requested), device=self.device)
            shared = all_reduce_sum(torch.stack([stats[0], flag]))
            stats = [shared[0] / self.dist.world_size, stats[1], shared[1]]
        loss_val, norm_val, *stop = torch.stack(stats).tolist()
        self._stop_agreed = bool(stop[0]) if stop else self._stop_requested
        if not (math.isfinite(loss_val) and math.isfinite(norm_val)):
            self.optimizer.zero_grad(set_to_none=True)
            self._phase = "idle"
            where = (
                f"the last good checkpoint ({self.checkpoint_path}, step "
                f"{self.last_checkpoint_step}) is kept"
                if exists(self.last_checkpoint_step)
                else "no checkpoint was written yet"
            )
            raise NonFiniteLossError(
                f"non-finite loss ({loss_val}) or gradient norm ({norm_val}) at step "
                f"{self.step + 1}; stopping the run, {where}. Try a lower train.lr, more "
                "train.warmup_steps or train.grad_clip."
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self._phase = "update"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        self._phase = "idle"
        elapsed = time.perf_counter() - start
        self.train_time_s += elapsed
        return {
            "step": self.step,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": norm_val,
            "time_s": elapsed,
        }

    def _next_batch(self) -> torch.Tensor:
        """This rank's micro-batch (batch_size, seq_len + 1): its own random windows, or with
        data.shard_global_batch its rows of one global batch that every rank draws alike (so
        N ranks of batch b see exactly the batches of one process of batch N * b)."""
        t = self.config.train
        if not (self.config.data.shard_global_batch and self.dist.enabled):
            return random_batch(self.corpus.train, t.batch_size, t.seq_len, self.data_gen)
        rows = t.batch_size * self.dist.world_size
        batch = random_batch(self.corpus.train, rows, t.seq_len, self.data_gen)
        return batch[self.dist.rank * t.batch_size : (self.dist.rank + 1) * t.batch_size]

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync (gradients accumulate locally, no all-reduce) when `skip`."""
        if skip and isinstance(self.train_model, nn.parallel.DistributedDataParallel):
            return self.train_model.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss (nats/byte) and bits per byte over the fixed validation windows.

        With several ranks, rank r scores batches r, r + N, r + 2N, ... and the summed losses
        and label counts are all-reduced: the same value as one process (up to the order of
        the float64 additions). The unwrapped model runs here: DDP would add collectives.
        """
        t, e = self.config.train, self.config.eval
        model = self.wrapper
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss * n, n
        try:
            with self._fork_rng():
                batches = eval_batches(
                    self.corpus.valid, t.batch_size, t.seq_len, max_batches=e.eval_batches
                )
                for i, batch in enumerate(batches):
                    if i % self.dist.world_size != self.dist.rank:
                        continue
                    batch = batch.to(self.device, non_blocking=True)
                    with self._autocast():
                        loss = model(batch)
                    n = batch.shape[0] * (batch.shape[1] - 1)
                    sums[0] += loss.double() * n
                    sums[1] += n
        finally:
            model.train(was_training)
        total, count = all_reduce_sum(sums).tolist()
        val_loss = total / max(count, 1.0)
        return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2)}

    @torch.no_grad()
    def sample(self) -> dict:
        """Generate eval.generate_len bytes after a validation prime chosen by (seed, step)."""
        e = self.config.eval
        seed = (self.config.train.seed * 1_000_003 + self.step) % 2**63
        pick = torch.Generator().manual_seed(seed)
        start = int(torch.randint(0, len(self.corpus.valid) - e.prime_len, (1,), generator=pick))
        prime = torch.from_numpy(np.array(self.corpus.valid[start : start + e.prime_len]))
        prime = prime.long().to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with self._fork_rng(), self._autocast():
            out = self.wrapper.generate(
                prime[None], e.generate_len, e.temperature, e.filter_thres, generator=gen
            )
        return {
            "step": self.step,
            "prime": decode_tokens(prime.cpu()),
            "sample": decode_tokens(out[0].cpu()),
        }

    # ------------------------------------------------------------------ loop

    def _install_sigint(self) -> Any:
        """First Ctrl-C: finish the current step, save and stop. Second: stop now.

        With several ranks (torchrun passes its SIGINT on to every worker) the ranks agree on
        the step to stop after through the per-step all-reduce, then save together; a second
        Ctrl-C stops at once without saving (the ranks may be anywhere, a collective could
        hang), keeping the last checkpoint."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self._print(
                "\nCtrl-C: stopping after this step and saving a checkpoint "
                "(press Ctrl-C again to stop sooner"
                + (", without saving)" if self.dist.enabled else ")")
            )

        previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, handler)
        return previous

    def _on_interrupt(self) -> Path | None:
        """Save a consistent checkpoint after a KeyboardInterrupt, if the state allows."""
        if self.dist.enabled and not self._stop_agreed:
            self._print(
                f"interrupted at an arbitrary point of step {self.step + 1} with "
                f"{self.dist.world_size} ranks: not saving; the last checkpoint (step "
                f"{self.last_checkpoint_step}) is kept"
            )
            return None
        if self._phase == "update":
            self._print(
                f"interrupted during the parameter update of step {self.step + 1}: "
                f"not saving; the last checkpoint (step {self.last_checkpoint_step}) "
                "is kept"
            )
            return None
        rng = None
        if self._phase == "forward":
            # half-way through a step: drop its gradients and rewind its RNG draws
            self.optimizer.zero_grad(set_to_none=True)
            rng = self._step_rng
            self._phase = "idle"
        path = self.save_checkpoint(rng)
        self._print(f"interrupted at step {self.step}: checkpoint saved to {path}")
        return path

    def _log_record(self, info: dict, mean_loss: float, tokens_per_s: float) -> None:
        """One metrics.jsonl line (and wandb row) for the step in `info`."""
        record = {
            "step": info["step"],
            "loss": mean_loss,  # mean over the steps since the previous record
            "lr": info["lr"],
            "grad_norm": info["grad_norm"],
            "tokens_per_s": tokens_per_s,
            "tokens": self.tokens_seen,
            "train_time_s": self.train_time_s,
        }
        if "val_loss" in info:
            record.update(val_loss=info["val_loss"], val_bpb=info["val_bpb"])
        if self.device.type == "cuda":
            record["peak_mem_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self._append_jsonl(METRICS_NAME, record)
        if exists(self.wandb):
            self.wandb.log(record, info["step"])

    def _log_sample(self, sample: dict) -> None:
        self._print(
            f"--- sample at step {sample['step']} ---\n{sample['prime']}\n"
            f">>>\n{sample['sample']}\n---"
        )
        self._append_jsonl(SAMPLES_NAME, sample)
        if exists(self.wandb):
            self.wandb.log_text(
                "sample", f"{sample['prime']} >>> {sample['sample']}", sample["step"]
            )

    def fit(self) -> TrainResult:
        """Train until train.max_steps (or Ctrl-C); returns what happened."""
        t, e, lg = self.config.train, self.config.eval, self.config.log
        result = TrainResult(
            run_dir=self.run_dir, checkpoint=None, step=self.step, world_size=self.dist.world_size
        )
        if self.step >= t.max_steps:
            self._print(f"already at step {self.step} >= train.max_steps={t.max_steps}")
            if exists(self.wandb):
                self.wandb.finish()
                self.wandb = None
            result.checkpoint = self.checkpoint_path if self.checkpoint_path.exists() else None
            return result

        n_params = sum(p.numel() for p in self.model.parameters())
        precision = "bf16 autocast" if exists(self.amp_dtype) else "fp32"
        backend = "Triton kernels" if self.config.model.use_triton else "PyTorch ops"
        self._print(
            f"run {self.run_dir} | {n_params / 1e6:.2f}M params | {backend} | {self.device} "
            f"{precision}{' | compiled' if t.compile else ''} | corpus {self.corpus.name} | "
            f"{self.tokens_per_step} tokens/step"
            + (f" | resuming at step {self.step}" if self.step else "")
        )
        if self.dist.enabled:
            backend = torch.distributed.get_backend()
            self._print(
                f"DDP: {self.dist.world_size} processes ({backend}) | global batch "
                f"{t.batch_size} x {t.grad_accum_steps} accumulation x {self.dist.world_size} "
                f"ranks = {self.global_batch} sequences | tokens/s count all ranks"
                + (" | shared global batch" if self.config.data.shard_global_batch else "")
            )
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        previous_handler = self._install_sigint()
        pbar = tqdm(
            total=t.max_steps,
            initial=self.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (lg.progress and self.is_main),
        )
        window_loss, window_steps, window_time = 0.0, 0, 0.0
        call_time, call_steps, first_time = 0.0, 0, None
        self.train_model.train()
        try:
            while self.step < t.max_steps:
                if self._stop_agreed or (self._stop_requested and not self.dist.enabled):
                    raise KeyboardInterrupt
                info = self.train_step()
                step = self.step
                result.losses[step] = info["loss"]
                window_loss += info["loss"]
                window_steps += 1
                window_time += info["time_s"]
                if first_time is None:
                    first_time = info["time_s"]  # warm-up: kept out of the mean
                else:
                    call_time += info["time_s"]
                    call_steps += 1
                tok_s = self.tokens_per_step * window_steps / max(window_time, 1e-9)
                pbar.set_postfix(
                    loss=f"{info['loss']:.3f}",
                    lr=f"{info['lr']:.2e}",
                    tok_s=f"{tok_s:,.0f}",
                    refresh=False,
                )
                pbar.update(1)

                last = step == t.max_steps
                do_eval = e.eval_every > 0 and (step % e.eval_every == 0 or last)
                if do_eval:
                    info.update(self.evaluate())
                    result.val_losses[step] = info["val_loss"]
                    self._print(
                        f"step {step}: val loss {info['val_loss']:.4f}, "
                        f"{info['val_bpb']:.4f} bits/byte"
                    )
                if step % lg.log_every == 0 or do_eval or last:
                    self._log_record(info, window_loss / window_steps, tok_s)
                    window_loss, window_steps, window_time = 0.0, 0, 0.0
                if e.generate_every > 0 and step % e.generate_every == 0 and self.is_main:
                    self._log_sample(self.sample())
                if (lg.checkpoint_every and step % lg.checkpoint_every == 0) or last:
                    self.save_checkpoint()
                for callback in self.callbacks:
                    callback(self, step, info)
            result.checkpoint = self.checkpoint_path
        except KeyboardInterrupt:
            result.interrupted = True
            result.checkpoint = self._on_interrupt()
        except Exception as exc:
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise
        finally:
            pbar.close()
            if exists(previous_handler):
                signal.signal(signal.SIGINT, previous_handler)
            if exists(self.wandb):
                self.wandb.finish()
                self.wandb = None

        result.step = self.step
        if call_steps:
            result.tokens_per_s = self.tokens_per_step * call_steps / max(call_time, 1e-9)
        elif exists(first_time):
            result.tokens_per_s = self.tokens_per_step / max(first_time, 1e-9)
        if self.device.type == "cuda":
            result.peak_mem_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        return result


def train(
    config: Config,
    *,
    resume: str | Path | None = None,
    corpus: Corpus | None = None,
    callbacks: Sequence[Callback] = (),
) -> TrainResult:
    """Train per `config` (continuing from `resume`, a run dir or checkpoint, if given).

    Under torchrun this joins the process group, trains data-parallel, and leaves the group
    again on success, error or Ctrl-C (when it created the group).
    """
    trainer = Trainer(config, resume=resume, corpus=corpus, callbacks=callbacks)
    try:
        return trainer.fit()
    finally:
        trainer.close()
