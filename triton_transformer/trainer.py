"""The training loop: `train(config) -> TrainResult`, or `Trainer(config).fit()`.

One optimizer step = `grad_accum_steps` micro-batches of random windows of the training
split (AdamW, linear warmup then cosine decay, global grad-norm clipping, bf16 autocast on
GPU). Every `eval.eval_every` steps the loss and bits per byte over a fixed set of validation
windows are measured (at most eval.max_bytes, spread over the split; the whole split after
the last step), every `eval.generate_every` steps a text sample is generated from a
validation prime. Ctrl-C or SIGTERM stops after the current micro-batch with a checkpoint.
Metrics go to <run_dir>/metrics.jsonl (and Weights & Biases with `log.wandb`).

The parts live in their own modules; this one holds the loop that ties them together:
    train_step.py   one optimizer step (forward/backward, clipping, update), eager or graphed
    train_graph.py  CUDA-graph steps in the loop: when to capture, reading losses late
    train_interrupts.py  Ctrl-C and SIGTERM: stop cleanly with a checkpoint
    checkpoint.py   checkpoints, RNG streams and the run directory on disk
    run_dir.py      the run directory's lock, refusal to clobber, stale temp files
    metrics.py      console, metrics.jsonl, samples.jsonl and W&B output
    evaluation.py   validation loss and text samples
    run_setup.py    device, precision, seeds and corpus of a run

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
import copy
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.checkpoint import (
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    METRICS_NAME,
    SAMPLES_NAME,
    atomic_save,
    capture_rng_state,
    check_model_matches,
    find_checkpoint,
    load_checkpoint,
    load_model,
    new_run_dir,
    rank_rng_state,
    restore_rng_state,
    truncate_logs,
    unwrap_model,
)
from triton_transformer.config import (
    Config,
    check_resume_changes,
    config_from_dict,
    config_to_toml,
)
from triton_transformer.cuda_graph import capture_stream
from triton_transformer.data import Corpus, random_batch
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
)
from triton_transformer.evaluation import evaluate_loss, fork_rng, sample_from_split
from triton_transformer.metrics import LossWindow, RunLogger, flops_per_token, mfu, peak_bf16_flops
from triton_transformer.run_dir import RunDirError, RunDirLock
from triton_transformer.run_setup import (
    autocast_context,
    check_corpus,
    check_triton,
    load_run_corpus,
    resolve_device,
    resolve_precision,
    seed_everything,
)
from triton_transformer.train_graph import GraphedSteps
from triton_transformer.train_interrupts import Interrupts
from triton_transformer.train_step import (
    NonFiniteLossError,
    TrainStep,
    lr_multiplier,
    lr_to_device_tensors,
    make_optimizer,
    make_scheduler,
)
from triton_transformer.transformer import Transformer
from triton_transformer.utils import exists

__all__ = [
    "CHECKPOINT_NAME",
    "CHECKPOINT_VERSION",
    "METRICS_NAME",
    "SAMPLES_NAME",
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

# called after every optimizer step with (trainer, step, info dict of that step)
Callback = Callable[["Trainer", int, dict], None]


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
    full_val_loss: float | None = None  # over the whole validation split, after the last step
    stop_signal: str | None = None  # "SIGINT" or "SIGTERM" when interrupted
    mfu: float | None = None  # model FLOPs utilisation on a GPU of known peak, else None

    @property
    def final_val_loss(self) -> float | None:
        return self.val_losses[max(self.val_losses)] if self.val_losses else None


class Trainer(GraphedSteps, Interrupts):
    """Owns the model, optimizer, data streams and run directory of one training run.

    config: a validated `Config`.
    resume: a run directory or checkpoint file to continue from (None: a fresh run).
    corpus: an already loaded `Corpus` (None: `load_corpus` per config.data).
    callbacks: called after every optimizer step as callback(trainer, step, info); raising
        KeyboardInterrupt there behaves like Ctrl-C (tests use this).
    overwrite: a new run may replace the run in a non-empty run directory (otherwise that
        is refused: `RunDirError`).
    """

    def __init__(
        self,
        config: Config,
        *,
        resume: str | Path | None = None,
        corpus: Corpus | None = None,
        callbacks: Sequence[Callback] = (),
        overwrite: bool = False,
    ) -> None:
        # a copy: the run directory it resolves is recorded in it, not in the caller's
        self.config = copy.deepcopy(config).validate()
        self.overwrite = overwrite
        self._lock: RunDirLock | None = None
        self._stepped = False  # this trainer has run a training step (its files are a run)
        self.callbacks = list(callbacks)
        t = config.train
        self.device = resolve_device(t.device)
        # under torchrun: join the process group (NCCL/gloo); a no-op for a single process
        self._owns_process_group = init_distributed(self.device, t.dist_timeout_s)
        self.dist = DistInfo(get_rank(), env_info().local_rank, get_world_size())
        self.is_main = self.dist.is_main
        try:
            self._setup(resume, corpus)
        except BaseException as exc:
            self._discard_if_unstarted()
            self.close()
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise

    def _setup(self, resume: str | Path | None, corpus: Corpus | None) -> None:
        config = self.config
        m, t = config.model, config.train
        self.amp_dtype = resolve_precision(t.precision, self.device)
        check_triton(config, self.device, self.is_main)

        ckpt_path = find_checkpoint(resume) if exists(resume) else None
        ckpt = load_checkpoint(ckpt_path) if exists(ckpt_path) else None
        if exists(ckpt):
            check_model_matches(ckpt, config, ckpt_path)
            # an override the checkpoint's state would silently undo (train.lr, ...) is refused
            check_resume_changes(config_from_dict(ckpt["config"]), config, ckpt_path)
        self.run_dir = self._claim_run_dir(ckpt_path)
        # config.toml and the checkpoints record the directory the run actually uses
        config.log.run_dir = str(self.run_dir)

        seed_everything(t.seed)
        self.corpus = corpus if exists(corpus) else load_run_corpus(config, self.dist)
        check_corpus(config, self.corpus)

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
        self.cuda_graph, self.cuda_graph_note = self._resolve_cuda_graph()
        if self.dist.enabled:
            # a graph-captured DDP step needs DDP built on the capture stream
            stream = capture_stream(self.device) if self.cuda_graph else None
            with torch.cuda.stream(stream) if exists(stream) else contextlib.nullcontext():
                self.train_model = nn.parallel.DistributedDataParallel(
                    self.wrapper,
                    device_ids=[self.device] if self.device.type == "cuda" else None,
                )
            if exists(stream):
                torch.cuda.current_stream(self.device).wait_stream(stream)
        self.optimizer = make_optimizer(self.model, t, self.device, capturable=self.cuda_graph)
        self.scheduler = make_scheduler(self.optimizer, t)
        self.step_runner = TrainStep(
            self.train_model,
            self.model,
            self.optimizer,
            self.scheduler,
            grad_accum_steps=t.grad_accum_steps,
            grad_clip=t.grad_clip,
            autocast=self._autocast,
            device=self.device,
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
        self.window = LossWindow()  # the steps since the last metrics record
        if exists(ckpt):
            self._load_state(ckpt)  # restores the RNG streams last
        if self.cuda_graph:
            lr_to_device_tensors(self.optimizer, self.device)  # a loaded state brings floats
            # DDP rebuilds its gradient buckets after the first steps: capture after that
            warmup = max(t.cuda_graph_warmup, 11 if self.dist.enabled else 1)
            self.step_runner.enable_cuda_graph(warmup)
        # (loss, grad norm) device tensors of graph-replayed steps not yet read on the host
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._late_losses: dict[int, float] = {}  # the last read, for an interrupted fit

        self._step_rng: dict | None = None
        self._stop_signal: str | None = None  # SIGINT / SIGTERM that asked to stop
        self._stop_requested = False  # Ctrl-C (or SIGTERM) seen by this process
        self._stop_agreed = False  # ... and, with several ranks, known to all of them
        self.global_batch = t.batch_size * t.grad_accum_steps * self.dist.world_size
        self.tokens_per_step = self.global_batch * t.seq_len
        self.flops_per_token = flops_per_token(self.model, m.depth, m.heads, m.dim_head, t.seq_len)
        self.peak_flops = peak_bf16_flops(self.device)  # None: MFU not reported

        self.log = RunLogger(self.run_dir, self.is_main)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if exists(self._lock):
                self._lock.clear_previous_run()  # --overwrite: only now that setup succeeded
            truncate_logs(self.run_dir, self.step)
            self._wandb_id = self.log.start_wandb(config, self._wandb_id)
            # last: a resume that fails to set up leaves the config it ran with in place
            (self.run_dir / "config.toml").write_text(config_to_toml(config))

    def _discard_if_unstarted(self) -> None:
        """A new run that fails before its first step leaves no files behind (see
        `RunDirLock.discard_failed_start`), so the same command can be run again."""
        if exists(self._lock) and not self._stepped:
            self._lock.discard_failed_start()

    def close(self) -> None:
        """Unlock the run directory; leave the process group if this trainer created it
        (`train` calls this)."""
        if exists(getattr(self, "_lock", None)):
            self._lock.release()
            self._lock = None
        try:
            if exists(getattr(self, "step_runner", None)):
                self.step_runner.release_cuda_graph()
        finally:  # leave the group even when the device is in an error state
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

    def _claim_run_dir(self, ckpt_path: Path | None) -> Path:
        """Rank 0 names the run directory (a timestamp, or a suffix for a taken name), checks
        and locks it (`RunDirLock`); every rank gets the name, or rank 0's refusal."""
        run_dir, error = None, None
        if self.is_main:
            try:
                run_dir = self._resolve_run_dir(ckpt_path)
                resuming = exists(ckpt_path) and run_dir.resolve() == ckpt_path.parent.resolve()
                self._lock = RunDirLock.acquire(
                    run_dir, resuming=resuming, overwrite=self.overwrite
                )
            except RunDirError as e:
                error = str(e)
        run_dir, error = broadcast_object((str(run_dir), error))
        if exists(error):
            raise RunDirError(error)
        return Path(run_dir)

    def _resolve_run_dir(self, ckpt_path: Path | None) -> Path:
        if self.config.log.run_dir:
            return Path(self.config.log.run_dir)
        if exists(ckpt_path):
            return ckpt_path.parent
        return new_run_dir(self.config)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast_context(self.device, self.amp_dtype)

    def _print(self, msg: str) -> None:
        self.log.print(msg)

    # ------------------------------------------------------------------ state

    def rng_state(self) -> dict:
        return capture_rng_state(self.device, self.data_gen)

    def set_rng_state(self, state: dict) -> None:
        restore_rng_state(state, self.device, self.data_gen, distributed=self.dist.enabled)

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
            "log_window": self.window.state_dict(),
        }

    def _load_state(self, ckpt: dict) -> None:
        unwrap_model(self.model).load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.step = int(ckpt["step"])
        self.tokens_seen = int(ckpt["tokens_seen"])
        self.train_time_s = float(ckpt["train_time_s"])
        self._wandb_id = ckpt.get("wandb_id")
        if "log_window" in ckpt:  # absent in checkpoints from before it was stored
            self.window.load_state_dict(ckpt["log_window"])
        self.last_checkpoint_step = self.step
        self.set_rng_state(
            rank_rng_state(
                ckpt,
                self.dist,
                seed=self.config.train.seed,
                step=self.step,
                shared_data_stream=self.config.data.shard_global_batch,
            )
        )

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT_NAME

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        """Atomically write the full training state (rng: this rank's RNG states to store,
        default now). With several ranks every rank must call it: rank 0 gathers all ranks'
        RNG states and writes the file; the others wait until it is on disk.

        Steps whose loss was not read yet (CUDA graphs) are checked first: a checkpoint is
        written only after a finite check (NonFiniteLossError otherwise)."""
        late = self._read_pending()  # steps already counted in the window, losses not yet
        self.window.loss += sum(loss for loss, _ in late.values())
        states = all_gather_object(rng if exists(rng) else self.rng_state())
        if self.is_main:
            state = self.state_dict(states[0])
            if self.dist.enabled:
                state["rng_ranks"] = states  # rank r resumes from states[r]
            atomic_save(state, self.checkpoint_path)
        barrier()  # nobody runs ahead of (or reads) a checkpoint that is still being written
        self.last_checkpoint_step = self.step
        return self.checkpoint_path

    # ------------------------------------------------------------------ steps

    @property
    def _phase(self) -> str:
        return self.step_runner.phase

    def train_step(self, sync: bool = True) -> dict:
        """One optimizer step over grad_accum_steps micro-batches; returns its stats.

        `losses` maps step -> loss for every step whose loss is known now: this one for an
        eager step; with CUDA graphs, the steps since the last `sync=True` call (the others
        return an empty map and leave the GPU running ahead of the host)."""
        if self.step_runner.graphed:
            return self._graphed_train_step(sync)
        self._step_rng = self.rng_state()  # to rewind to if interrupted mid-step
        start = time.perf_counter()
        # a single process stops between micro-batches; ranks agree at the step's end
        loss, grad_norm = self.step_runner.forward_backward(
            self._next_batch, should_stop=lambda: self._stop_requested and not self.dist.enabled
        )
        stats = [loss, grad_norm]
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
            self.step_runner.discard()
            raise self._non_finite(self.step + 1, loss_val, norm_val)
        lr = self.optimizer.param_groups[0]["lr"]
        self.step_runner.update()
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        elapsed = time.perf_counter() - start
        self.train_time_s += elapsed
        return {
            "step": self.step,
            "loss": loss_val,
            "losses": {self.step: loss_val},
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

    def _fork_rng(self) -> contextlib.AbstractContextManager:
        return fork_rng(self.device)

    def evaluate(self, max_bytes: int | None = None) -> dict:
        """Mean loss (nats/byte) and bits per byte over the validation windows: at most
        `max_bytes` (default eval.max_bytes; 0: the whole split) spread over the split, the
        same set at any batch size and number of ranks (sharded and all-reduced)."""
        t, e = self.config.train, self.config.eval
        return evaluate_loss(
            self.wrapper,  # unwrapped: DDP would add collectives
            self.corpus.valid,
            seq_len=t.seq_len,
            max_bytes=e.max_bytes if max_bytes is None else max_bytes,
            batch_size=t.batch_size,
            device=self.device,
            autocast=self._autocast,
            dist=self.dist,
            progress=self.is_main and self.config.log.progress and max_bytes == 0,
        )

    def sample(self) -> dict:
        """Generate eval.generate_len bytes after a validation prime chosen by (seed, step)."""
        e = self.config.eval
        seed = (self.config.train.seed * 1_000_003 + self.step) % 2**63
        out = sample_from_split(
            self.wrapper,
            self.corpus.valid,
            seed=seed,
            prime_len=e.prime_len,
            length=e.generate_len,
            temperature=e.temperature,
            filter_thres=e.filter_thres,
            device=self.device,
            autocast=self._autocast,
        )
        return {"step": self.step, **out}

    # ------------------------------------------------------------------ loop

    def _mfu(self, tokens_per_s: float) -> float | None:
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.dist.world_size)

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
        if exists(self._mfu(tokens_per_s)):
            record["mfu"] = self._mfu(tokens_per_s)
        for key in ("val_loss", "val_bpb", "full_val_loss", "full_val_bpb"):
            if key in info:
                record[key] = info[key]
        if self.device.type == "cuda":
            record["peak_mem_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.log.log_record(record)

    def _print_header(self) -> None:
        t = self.config.train
        n_params = sum(p.numel() for p in self.model.parameters())
        precision = "bf16 autocast" if exists(self.amp_dtype) else "fp32"
        backend = "Triton kernels" if self.config.model.use_triton else "PyTorch ops"
        self._print(
            f"run {self.run_dir} | {n_params / 1e6:.2f}M params | {backend} | {self.device} "
            f"{precision}{' | compiled' if t.compile else ''} | corpus {self.corpus.name} | "
            f"{self.tokens_per_step} tokens/step | CUDA graph {self.cuda_graph_note}"
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

    def _print_first_step(self, info: dict) -> None:
        """A line as soon as the first step of this call is done: proof of life, and what
        the whole run will take at this pace."""
        left = self.config.train.max_steps - self.step
        eta = info["time_s"] * left  # an upper bound: the first step pays for warm-up
        # with CUDA graphs the loss of a step that is not logged is read later
        loss = f"loss {info['loss']:.4f}" if exists(info["loss"]) else "done"
        pace = f"{eta / 60:.0f} min" if eta >= 60 else f"{eta:.0f} s"
        rest = f" | {left} steps left: about {pace} at this pace" if left else ""
        self._print(
            f"step {info['step']}: {loss} | first step {info['time_s']:.2f} s (warm-up "
            f"included){rest}"
        )

    def fit(self) -> TrainResult:
        """Train until train.max_steps (or Ctrl-C); returns what happened."""
        t, e, lg = self.config.train, self.config.eval, self.config.log
        result = TrainResult(
            run_dir=self.run_dir, checkpoint=None, step=self.step, world_size=self.dist.world_size
        )
        if self.step >= t.max_steps:
            self._print(f"already at step {self.step} >= train.max_steps={t.max_steps}")
            self.log.finish()
            result.checkpoint = self.checkpoint_path if self.checkpoint_path.exists() else None
            return result

        self._print_header()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        previous_handlers = self._install_signal_handlers()
        pbar = tqdm(
            total=t.max_steps,
            initial=self.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (lg.progress and self.is_main),
        )
        call_time, call_steps, first_time = 0.0, 0, None
        self.train_model.train()
        try:
            while self.step < t.max_steps:
                if self._stop_agreed or (self._stop_requested and not self.dist.enabled):
                    raise KeyboardInterrupt
                info = self.train_step(sync=self._is_sync_step(self.step + 1))
                self._stepped = True
                step = self.step
                result.losses.update(info["losses"])
                # with CUDA graphs the losses arrive at sync steps, in time for the record
                self.window.add(sum(info["losses"].values()), info["time_s"])
                if first_time is None:
                    first_time = info["time_s"]  # warm-up: kept out of the mean
                else:
                    call_time += info["time_s"]
                    call_steps += 1
                tok_s = self.window.tokens_per_s(self.tokens_per_step)
                if exists(info["loss"]):  # with CUDA graphs, known at sync steps only
                    postfix = {"loss": f"{info['loss']:.3f}", "lr": f"{info['lr']:.2e}"}
                    postfix["tok_s"] = f"{tok_s:,.0f}"
                    if exists(self._mfu(tok_s)):
                        postfix["mfu"] = f"{100 * self._mfu(tok_s):.1f}%"
                    pbar.set_postfix(postfix, refresh=False)
                pbar.update(1)
                if call_steps == 0:  # the first step of this call
                    self._print_first_step(info)

                last = step == t.max_steps
                do_eval = e.eval_every > 0 and (step % e.eval_every == 0 or last)
                if do_eval:
                    info.update(self.evaluate())
                    result.val_losses[step] = info["val_loss"]
                    self._print(
                        f"step {step}: val loss {info['val_loss']:.4f}, "
                        f"{info['val_bpb']:.4f} bits/byte"
                    )
                if do_eval and last and e.full_at_end:
                    full = info if e.max_bytes == 0 else self.evaluate(max_bytes=0)
                    info.update(full_val_loss=full["val_loss"], full_val_bpb=full["val_bpb"])
                    result.full_val_loss = full["val_loss"]
                    self._print(
                        f"step {step}: whole validation split ({full['tokens']:,} bytes): "
                        f"loss {full['val_loss']:.4f}, {full['val_bpb']:.4f} bits/byte"
                    )
                if step % lg.log_every == 0 or do_eval or last:
                    self._log_record(info, self.window.mean_loss, tok_s)
                    self.window.reset()
                if e.generate_every > 0 and step % e.generate_every == 0 and self.is_main:
                    self.log.log_sample(self.sample())
                if (lg.checkpoint_every and step % lg.checkpoint_every == 0) or last:
                    self.save_checkpoint()
                for callback in self.callbacks:
                    callback(self, step, info)
            result.checkpoint = self.checkpoint_path
        except KeyboardInterrupt:
            result.interrupted = True
            result.stop_signal = self._stop_signal or "SIGINT"
            result.checkpoint = self._on_interrupt()
            result.losses.update(self._late_losses)  # read while saving (CUDA graphs)
        except Exception as exc:
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise
        finally:
            pbar.close()
            for sig, previous in previous_handlers.items():
                signal.signal(sig, previous)
            self.log.finish()

        result.step = self.step
        if call_steps:
            result.tokens_per_s = self.tokens_per_step * call_steps / max(call_time, 1e-9)
        elif exists(first_time):
            result.tokens_per_s = self.tokens_per_step / max(first_time, 1e-9)
        if self.device.type == "cuda":
            result.peak_mem_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        if exists(result.tokens_per_s):
            result.mfu = self._mfu(result.tokens_per_s)
        return result


def train(
    config: Config,
    *,
    resume: str | Path | None = None,
    corpus: Corpus | None = None,
    callbacks: Sequence[Callback] = (),
    overwrite: bool = False,
) -> TrainResult:
    """Train per `config` (continuing from `resume`, a run dir or checkpoint, if given).

    Under torchrun this joins the process group, trains data-parallel, and leaves the group
    again on success, error or Ctrl-C (when it created the group).
    """
    trainer = Trainer(
        config, resume=resume, corpus=corpus, callbacks=callbacks, overwrite=overwrite
    )
    try:
        result = trainer.fit()
        # rank 0 may still be sampling or saving: leave the group together, or gloo can
        # abort the process whose peer already tore its connections down
        barrier()
        return result
    except Exception:
        trainer._discard_if_unstarted()  # e.g. out of memory in the first step
        raise
    finally:
        trainer.close()
