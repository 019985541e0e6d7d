"""The training loop: `train(config) -> TrainResult`, or `Trainer(config).fit()`.

One optimizer step = `grad_accum_steps` micro-batches of random windows of the training
split (AdamW, linear warmup then cosine decay, global grad-norm clipping, bf16 autocast on
GPU). Every `eval.eval_every` steps the loss and bits per byte over a fixed set of validation
windows are measured (at most eval.max_bytes, spread over the split; the whole split after
the last step), every `eval.generate_every` steps a text sample is generated from a
validation prime. Ctrl-C or SIGTERM stops after the current micro-batch with a checkpoint.
Metrics go to <run_dir>/metrics.jsonl (and Weights & Biases with `log.wandb`).

The `Trainer` composes parts that each own their state and get only the config sections
they read (see ARCHITECTURE.md):
    setup.py       device, precision, corpus, model (compile, DDP), CUDA-graph decision
    step.py        OptimizerStep: one step, eager or one CUDA graph replay -> StepOutcome;
                   LossCheck: reading losses late, the finite check, the stop all-reduce
    interrupts.py  Interrupts: Ctrl-C / SIGTERM set a flag the loop and LossCheck read
    schedule.py    Schedule: which steps evaluate, log, sample, checkpoint; the LR schedule
    checkpoint.py  Checkpointer: atomic checkpoints with a checksum; rng.py: RNG streams
    run_dir.py     RunDirLock: the run directory's lock and refusal to clobber
    metrics.py     RunLogger, LossWindow, Throughput: console, JSONL, W&B, tokens/s, MFU
    evaluation.py  Evaluator: validation loss and text samples

Resume is exact: checkpoints hold model, optimizer, scheduler, step, the metrics window and
every RNG stream (of every rank); validation and sampling run under forked RNG states, so a
resumed run reproduces the losses of an uninterrupted one bit for bit (CPU, PyTorch ops).

Multi-GPU: under `torchrun --nproc_per_node=N train.py ...` every process trains a replica
in PyTorch's `DistributedDataParallel` (NCCL on GPU, gloo on CPU). Each rank draws its own
windows (data seed + rank), or its rows of one global batch with `data.shard_global_batch`;
gradients are averaged by DDP on the last micro-batch of a step (`no_sync` on the others).
The logged and validation losses are reduced over the ranks; tokens/s count the whole job.
Rank 0 alone prints, logs, samples and writes checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from triton_transformer.training.checkpoint import (
    CHECKPOINT_VERSION,
    Checkpointer,
    check_model_matches,
    find_checkpoint,
    load_checkpoint,
    unwrap_model,
)
from triton_transformer.training.config import Config, check_resume_changes, config_from_dict
from triton_transformer.training.config import config_to_toml as _config_to_toml
from triton_transformer.training.data import Corpus, TrainBatches
from triton_transformer.training.distributed import (
    DistInfo,
    DistributedError,
    barrier,
    broadcast_object,
    destroy_distributed,
    env_info,
    get_rank,
    get_world_size,
    init_distributed,
    is_comm_error,
)
from triton_transformer.training.evaluation import Evaluator
from triton_transformer.training.interrupts import Interrupts
from triton_transformer.training.metrics import (
    LossWindow,
    RunLogger,
    Throughput,
    flops_per_token,
    peak_bf16_flops,
)
from triton_transformer.training.rng import RngStreams, rank_rng_state, seed_everything
from triton_transformer.training.run_dir import RunDirError, RunDirLock, new_run_dir, truncate_logs
from triton_transformer.training.schedule import Schedule, make_scheduler
from triton_transformer.training.setup import (
    autocast_context,
    build_model,
    check_corpus,
    check_triton,
    load_run_corpus,
    prepare_tokens,
    resolve_cuda_graph,
    resolve_device,
    resolve_num_tokens,
    resolve_precision,
)
from triton_transformer.training.step import (
    LossCheck,
    NonFiniteLossError,
    OptimizerStep,
    StepOutcome,
    make_optimizer,
)
from triton_transformer.training.tokenizer import TOKENIZER_NAME, write_text_atomic
from triton_transformer.utils import exists

__all__ = ["NonFiniteLossError", "TrainResult", "Trainer", "train"]

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
    full_val_bpb: float | None = None  # its bits per byte
    val_bpbs: dict[int, float] = field(default_factory=dict)  # step -> bits per byte
    stop_signal: str | None = None  # "SIGINT" or "SIGTERM" when interrupted
    mfu: float | None = None  # model FLOPs utilisation on a GPU of known peak, else None

    @property
    def final_val_loss(self) -> float | None:
        return self.val_losses[max(self.val_losses)] if self.val_losses else None

    @property
    def final_val_bpb(self) -> float | None:
        return self.val_bpbs[max(self.val_bpbs)] if self.val_bpbs else None


class Trainer:
    """Owns the model, the parts that train it and the run directory of one training run.

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
        self.callbacks = list(callbacks)
        self._lock: RunDirLock | None = None
        self._stepped = False  # this trainer has run a training step (its files are a run)
        self.device = resolve_device(config.train.device)
        # under torchrun: join the process group (NCCL/gloo); a no-op for a single process
        self._owns_process_group = init_distributed(self.device, config.train.dist_timeout_s)
        self.dist = DistInfo(get_rank(), env_info().local_rank, get_world_size())
        try:
            self._setup(resume, corpus, overwrite)
        except BaseException as exc:
            self._discard_if_unstarted()
            self.close()
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise

    def _setup(self, resume: str | Path | None, corpus: Corpus | None, overwrite: bool) -> None:
        """Build the parts. The order of the RNG draws (seed, model init, per-rank reseed,
        data stream, then a checkpoint's streams restored last) is what makes resume exact."""
        config = self.config
        m, t, lg = config.model, config.train, config.log
        self.amp_dtype = resolve_precision(t.precision, self.device)
        self._autocast = partial(autocast_context, self.device, self.amp_dtype)
        check_triton(m.use_triton, self.device, self.dist.is_main)

        ckpt_path = find_checkpoint(resume) if exists(resume) else None
        ckpt = load_checkpoint(ckpt_path) if exists(ckpt_path) else None
        if exists(ckpt):
            if m.num_tokens == 0:  # "the tokenizer's": the one the run was trained with
                m.num_tokens = ckpt["config"].get("model", {}).get("num_tokens", 0)
            check_model_matches(ckpt, m, ckpt_path)
            # an override the checkpoint's state would silently undo (train.lr, ...) is refused
            check_resume_changes(config_from_dict(ckpt["config"]), config, ckpt_path)
        self.run_dir = self._claim_run_dir(ckpt_path, overwrite)
        lg.run_dir = str(self.run_dir)  # config.toml and checkpoints record the one in use

        seed_everything(t.seed)
        self.corpus = corpus if exists(corpus) else load_run_corpus(config.data, self.dist)
        # the tokenizer (a resumed run's own), then the corpus as its ids (cached beside the
        # data), then the model's vocabulary: the tokenizer's unless the config sets one (a
        # config keeps its 0, "the tokenizer's"; checkpoints record the number too)
        saved_tokenizer = ckpt.get("tokenizer") if exists(ckpt) else None
        self.tokenizer, self.corpus = prepare_tokens(
            config.data, self.corpus, self.dist, saved=saved_tokenizer
        )
        self.num_tokens = resolve_num_tokens(m, self.tokenizer)
        check_corpus(self.corpus, t, config.eval)
        cuda_graph, self.cuda_graph_note = resolve_cuda_graph(t, self.device, self.dist.enabled)
        self.model, self.wrapper, self.train_model = build_model(
            dataclasses.replace(m, num_tokens=self.num_tokens),
            compile=t.compile,
            device=self.device,
            dist=self.dist,
            cuda_graph=cuda_graph,
        )
        optimizer = make_optimizer(
            self.model, t, self.device, capturable=cuda_graph, use_triton=m.use_triton
        )
        if self.dist.rank > 0:
            # from here on each rank needs its own dropout masks (rank 0 keeps the stream a
            # single process would have)
            torch.manual_seed(t.seed + 1_000_003 * self.dist.rank)
        # The data sampler's own stream: its state is the "position" in the data. Each rank
        # draws its own windows, unless they all share one global batch (shard_global_batch).
        shared = config.data.shard_global_batch
        data_gen = torch.Generator().manual_seed(t.seed + 1 + (0 if shared else self.dist.rank))
        self.rng = RngStreams(self.device, data_gen, self.dist.enabled)

        self.log = RunLogger(self.run_dir, self.dist.is_main)
        self.interrupts = Interrupts(distributed=self.dist.enabled, say=self.log.print)
        self.checkpoints = Checkpointer(self.run_dir, self.dist)
        self.checks = LossCheck(self.dist, self.interrupts, self.checkpoints.kept_note)
        batches = TrainBatches(
            self.corpus.train,
            t.batch_size,
            t.seq_len,
            data_gen,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            shared=shared,
        )
        self.step_runner = OptimizerStep(
            self.train_model,
            self.model,
            optimizer,
            make_scheduler(optimizer, t),
            t,
            next_batch=batches,
            should_stop=lambda: self.interrupts.stop_between_micro_batches,
            checks=self.checks,
            rng=self.rng,
            autocast=self._autocast,
            device=self.device,
            cast_dtype=self.amp_dtype if m.use_triton else None,
        )
        self.evaluator = Evaluator(
            self.wrapper,  # unwrapped: DDP would add collectives
            self.corpus.valid,
            config.eval,
            seq_len=t.seq_len,
            batch_size=t.batch_size,
            seed=t.seed,
            device=self.device,
            autocast=self._autocast,
            dist=self.dist,
            progress=self.dist.is_main and lg.progress,
            tokenizer=self.tokenizer,
        )
        self.schedule = Schedule.of(t, config.eval, lg)
        tokens_per_step = t.batch_size * t.grad_accum_steps * self.dist.world_size * t.seq_len
        self.speed = Throughput(
            tokens_per_step,
            flops_per_token(self.model, m.depth, m.heads, m.dim_head, t.seq_len),
            peak_bf16_flops(self.device),
            self.dist.world_size,
        )

        self.step = 0
        self.tokens_seen = 0
        self.train_time_s = 0.0  # time inside training steps only (no eval / sampling)
        self.window = LossWindow()  # the steps since the last metrics record
        self._wandb_id: str | None = None
        if exists(ckpt):
            self._load_state(ckpt)  # restores the RNG streams last
        if cuda_graph:
            # DDP rebuilds its gradient buckets after the first steps: capture after that
            warmup = max(t.cuda_graph_warmup, 11 if self.dist.enabled else 1)
            self.step_runner.enable_cuda_graph(warmup)

        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if exists(self._lock):
                self._lock.clear_previous_run()  # --overwrite: only now that setup succeeded
            truncate_logs(self.run_dir, self.step)
            self._wandb_id = self.log.start_wandb(config, self._wandb_id)
            tokenizer_json = self.tokenizer.to_json()
            if exists(tokenizer_json):  # what sample, eval and --resume read (bytes: none)
                write_text_atomic(self.run_dir / TOKENIZER_NAME, tokenizer_json)
            # last: a resume that fails to set up leaves the config it ran with in place
            (self.run_dir / "config.toml").write_text(_config_to_toml(config))

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        """Train until train.max_steps (or Ctrl-C); returns what happened."""
        schedule = self.schedule
        result = TrainResult(self.run_dir, None, self.step, world_size=self.dist.world_size)
        if schedule.last(self.step):
            self._print(f"already at step {self.step} >= train.max_steps={schedule.max_steps}")
            self.log.finish()
            result.checkpoint = self.checkpoint_path if self.checkpoint_path.exists() else None
            return result

        self._print_header()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        pbar = tqdm(
            total=schedule.max_steps,
            initial=self.step,
            desc="train",
            dynamic_ncols=True,
            disable=not (self.config.log.progress and self.dist.is_main),
        )
        step_times: list[float] = []  # this call's; the first pays for warm-up
        self.train_model.train()
        self.interrupts.install()
        try:
            while not schedule.last(self.step):
                if self.interrupts.stop_now:
                    raise KeyboardInterrupt
                out = self.train_step()
                step, info = out.step, out.info()
                result.losses.update(out.losses)
                step_times.append(out.time_s)
                tokens_per_s = self.window.tokens_per_s(self.speed.tokens_per_step)
                self._show_progress(pbar, out, tokens_per_s)
                if len(step_times) == 1:
                    self._print_first_step(out)

                if schedule.evaluates(step):
                    info.update(self._validate(step, result))
                if schedule.logs(step):
                    self._log_record(info, self.window.mean_loss, tokens_per_s)
                    self.window.reset()
                if schedule.samples(step) and self.dist.is_main:
                    self.log.log_sample(self.sample())
                if schedule.checkpoints(step):
                    self.save_checkpoint()
                for callback in self.callbacks:
                    callback(self, step, info)
            result.checkpoint = self.checkpoint_path
        except KeyboardInterrupt:
            result.interrupted = True
            result.stop_signal = self.interrupts.signal_name or "SIGINT"
            result.checkpoint = self._save_interrupted()
            result.losses.update(self.checks.last_read)  # read while saving (CUDA graphs)
        except Exception as exc:
            if self.dist.enabled and is_comm_error(exc):
                raise self._comm_error(exc) from exc
            raise
        finally:
            pbar.close()
            self.interrupts.restore()
            self.log.finish()

        result.step = self.step
        timed = step_times[1:] or step_times  # the first step alone if only one ran
        if timed:
            result.tokens_per_s = self.speed.tokens_per_s(len(timed), sum(timed))
            result.mfu = self.speed.mfu(result.tokens_per_s)
        if self.device.type == "cuda":
            result.peak_mem_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        return result

    def train_step(self, sync: bool | None = None) -> StepOutcome:
        """The loop's next optimizer step, applied and counted (`_count_step`). `sync`: read
        its loss on the host now (default: at the steps `Schedule.reads_loss` names, or when
        asked to stop); only CUDA-graph steps can leave it on the device, eager steps always
        read it."""
        n = self.step + 1
        if sync is None:
            sync = self.schedule.reads_loss(n) or self.interrupts.stop_now
        return self.step_runner.run(n, sync=sync, count=self._count_step)

    def _count_step(self, out: StepOutcome) -> None:
        """Count the step `out` just applied. `OptimizerStep.run` calls this while its phase
        is still "update", so an interrupt in here saves nothing, never a half-counted step
        (the step/phase protocol: step.py's docstring)."""
        self._stepped = True
        self.step = out.step
        self.tokens_seen += self.speed.tokens_per_step
        self.train_time_s += out.time_s
        # with CUDA graphs the losses arrive at sync steps, in time for the record
        self.window.add(sum(out.losses.values()), out.time_s)

    def _validate(self, step: int, result: TrainResult) -> dict:
        """The periodic validation of `step` (and after the last one the whole split)."""
        val = self.evaluate()
        result.val_losses[step] = val["val_loss"]
        result.val_bpbs[step] = val["val_bpb"]
        self._print(f"step {step}: val loss {val['val_loss']:.4f}, {val['val_bpb']:.4f} bits/byte")
        if self.schedule.evaluates_whole_split(step):
            full = self.evaluator.whole_split(val)
            val.update(full_val_loss=full["val_loss"], full_val_bpb=full["val_bpb"])
            result.full_val_loss, result.full_val_bpb = full["val_loss"], full["val_bpb"]
            size = f"{full['tokens']:,} bytes"
            if self.tokenizer.kind != "bytes":
                size = f"{full['tokens']:,} tokens, {full['bytes']:,} bytes"
            self._print(
                f"step {step}: whole validation split ({size}): "
                f"loss {full['val_loss']:.4f}, {full['val_bpb']:.4f} bits/byte"
            )
        return val

    def evaluate(self, max_bytes: int | None = None) -> dict:
        """Validation loss and bits per byte (`Evaluator.loss`; 0: the whole split)."""
        return self.evaluator.loss(max_bytes)

    def sample(self) -> dict:
        """A text sample after a validation prime chosen by (seed, step)."""
        return self.evaluator.sample(self.step)

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoints.path

    def state_dict(self) -> dict:
        """Everything a checkpoint holds but the RNG streams (`Checkpointer.save` adds
        those of every rank)."""
        state = {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_time_s": self.train_time_s,
            "model": unwrap_model(self.model).state_dict(),
            "optimizer": self.step_runner.optimizer.state_dict(),
            "scheduler": self.step_runner.scheduler.state_dict(),
            "config": self.config.to_dict(),
            "wandb_id": self._wandb_id,
            "log_window": self.window.state_dict(),
            "num_tokens": self.num_tokens,  # the model's vocabulary (config: 0 follows it)
        }
        tokenizer_json = self.tokenizer.to_json()
        if exists(tokenizer_json):  # the checkpoint alone rebuilds the run's tokenizer
            state["tokenizer"] = tokenizer_json
        return state

    def _load_state(self, ckpt: dict) -> None:
        unwrap_model(self.model).load_state_dict(ckpt["model"])
        self.step_runner.optimizer.load_state_dict(ckpt["optimizer"])
        self.step_runner.scheduler.load_state_dict(ckpt["scheduler"])
        self.step = int(ckpt["step"])
        self.tokens_seen = int(ckpt["tokens_seen"])
        self.train_time_s = float(ckpt["train_time_s"])
        self._wandb_id = ckpt.get("wandb_id")
        if "log_window" in ckpt:  # absent in checkpoints from before it was stored
            self.window.load_state_dict(ckpt["log_window"])
        self.checkpoints.last_step = self.step
        t = self.config.train
        shared = self.config.data.shard_global_batch
        self.rng.restore(
            rank_rng_state(ckpt, self.dist, seed=t.seed, step=self.step, shared_data_stream=shared)
        )

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        """Atomically write the full training state (rng: this rank's RNG states to store,
        default now). With several ranks every rank must call it (`Checkpointer.save`).

        Steps whose loss was not read yet (CUDA graphs) are checked first: a checkpoint is
        written only after a finite check (NonFiniteLossError otherwise)."""
        late = self.checks.read()  # steps already counted in the window, losses not yet
        self.window.loss += sum(loss for loss, _ in late.values())
        rng = rng if exists(rng) else self.rng.capture()
        return self.checkpoints.save(self.state_dict, rng, self.step)

    def _save_interrupted(self) -> Path | None:
        """Save a consistent checkpoint after a KeyboardInterrupt, if the state allows."""
        kept = f"the last checkpoint (step {self.checkpoints.last_step}) is kept"
        if self.dist.enabled and not self.interrupts.agreed:
            self._print(
                f"interrupted at an arbitrary point of step {self.step + 1} with "
                f"{self.dist.world_size} ranks: not saving; {kept}"
            )
            return None
        # the step/phase protocol of step.py's docstring
        if self.step_runner.phase == "update":
            self._print(
                f"interrupted while step {self.step_runner.running} was being applied: "
                f"not saving; {kept}"
            )
            return None
        rng = None
        if self.step_runner.phase == "forward":
            # half-way through a step that changed nothing yet: drop its gradients and loss,
            # and save the previous step with its RNG draws (data position too) rewound
            self.step_runner.discard()
            rng = self.step_runner.rng_at_start
        path = self.save_checkpoint(rng)
        self._print(f"interrupted at step {self.step}: checkpoint saved to {path}")
        return path

    # ------------------------------------------------------------------ run directory

    def _claim_run_dir(self, ckpt_path: Path | None, overwrite: bool) -> Path:
        """Rank 0 names the run directory (a timestamp, or a suffix for a taken name), checks
        and locks it (`RunDirLock`); every rank gets the name, or rank 0's refusal."""
        run_dir, error = None, None
        if self.dist.is_main:
            try:
                run_dir = self._resolve_run_dir(ckpt_path)
                resuming = exists(ckpt_path) and run_dir.resolve() == ckpt_path.parent.resolve()
                self._lock = RunDirLock.acquire(run_dir, resuming=resuming, overwrite=overwrite)
            except RunDirError as e:
                error = str(e)
        run_dir, error = broadcast_object((str(run_dir), error))
        if exists(error):
            raise RunDirError(error)
        return Path(run_dir)

    def _resolve_run_dir(self, ckpt_path: Path | None) -> Path:
        c = self.config
        if c.log.run_dir:
            return Path(c.log.run_dir)
        if exists(ckpt_path):
            return ckpt_path.parent
        return new_run_dir(c.log, use_triton=c.model.use_triton, compile=c.train.compile)

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
                self._drop_ddp()
                destroy_distributed()

    def _drop_ddp(self) -> None:
        """Free the DDP wrapper now. Its reducer holds the process group, so the group's C++
        side (gloo's worker threads) would otherwise be torn down whenever the garbage
        collector reached the wrapper's reference cycles, possibly during interpreter
        shutdown, where gloo aborts the process ("terminate called without an active
        exception")."""
        if isinstance(
            getattr(self, "train_model", None), torch.nn.parallel.DistributedDataParallel
        ):
            self.train_model = self.wrapper
            if exists(getattr(self, "step_runner", None)):
                self.step_runner.train_model = self.wrapper
            gc.collect()

    def _comm_error(self, exc: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {get_rank()} of {get_world_size()}: a collective operation failed "
            f"({type(exc).__name__}: {str(exc).strip()[:500]}). Another rank probably crashed "
            "(see its log) or stalled for longer than "
            f"train.dist_timeout_s={self.config.train.dist_timeout_s:g}; stopping this rank too."
        )

    # ------------------------------------------------------------------ output

    def _print(self, msg: str) -> None:
        self.log.print(msg)

    def _show_progress(self, pbar: tqdm, out: StepOutcome, tokens_per_s: float) -> None:
        if exists(out.loss):  # with CUDA graphs, known at sync steps only
            postfix = {"loss": f"{out.loss:.3f}", "lr": f"{out.lr:.2e}"}
            postfix["tok_s"] = f"{tokens_per_s:,.0f}"
            if exists(self.speed.mfu(tokens_per_s)):
                postfix["mfu"] = f"{100 * self.speed.mfu(tokens_per_s):.1f}%"
            pbar.set_postfix(postfix, refresh=False)
        pbar.update(1)

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
        if exists(self.speed.mfu(tokens_per_s)):
            record["mfu"] = self.speed.mfu(tokens_per_s)
        for key in ("val_loss", "val_bpb", "full_val_loss", "full_val_bpb"):
            if key in info:
                record[key] = info[key]
        if self.device.type == "cuda":
            record["peak_mem_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        self.log.log_record(record)

    def _print_header(self) -> None:
        t, dist = self.config.train, self.dist
        n_params = sum(p.numel() for p in self.model.parameters())
        precision = "bf16 autocast" if exists(self.amp_dtype) else "fp32"
        backend = "Triton kernels" if self.config.model.use_triton else "PyTorch ops"
        self._print(
            f"run {self.run_dir} | {n_params / 1e6:.2f}M params | {backend} | {self.device} "
            f"{precision}{' | compiled' if t.compile else ''} | corpus {self.corpus.name}"
            + (f" ({self.tokenizer.describe()})" if self.tokenizer.kind != "bytes" else "")
            + " | "
            f"{self.speed.tokens_per_step} tokens/step | CUDA graph {self.cuda_graph_note}"
            + (f" | resuming at step {self.step}" if self.step else "")
        )
        if dist.enabled:
            global_batch = t.batch_size * t.grad_accum_steps * dist.world_size
            self._print(
                f"DDP: {dist.world_size} processes ({torch.distributed.get_backend()}) | "
                f"global batch {t.batch_size} x {t.grad_accum_steps} accumulation x "
                f"{dist.world_size} ranks = {global_batch} sequences | tokens/s count all ranks"
                + (" | shared global batch" if self.config.data.shard_global_batch else "")
            )

    def _print_first_step(self, out: StepOutcome) -> None:
        """A line as soon as the first step of this call is done: proof of life, and what
        the whole run will take at this pace."""
        left = self.schedule.max_steps - self.step
        eta = out.time_s * left  # an upper bound: the first step pays for warm-up
        # with CUDA graphs the loss of a step that is not logged is read later
        loss = f"loss {out.loss:.4f}" if exists(out.loss) else "done"
        pace = f"{eta / 60:.0f} min" if eta >= 60 else f"{eta:.0f} s"
        rest = f" | {left} steps left: about {pace} at this pace" if left else ""
        self._print(
            f"step {out.step}: {loss} | first step {out.time_s:.2f} s (warm-up included){rest}"
        )


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
