"""Data-parallel training with 2 CPU processes (gloo), launched the way torchrun does it.

Each launch starts two copies of this file as workers (`python tests/test_distributed.py
worker SPEC`) with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1,
MASTER_PORT), so `train()` finds the job, joins the process group and wraps the model in DDP
by itself; one test runs the real `torchrun ... train.py` command line. Everything stays on
127.0.0.1. Workers report per rank in JSON: losses, parameter digests gathered from every
rank after every step, the files they opened for writing, their first batch.
"""

from __future__ import annotations

import builtins
import gc
import hashlib
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a worker script
    sys.path.insert(0, str(ROOT))

import helpers  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import triton_transformer.training.data as data_mod  # noqa: E402
from triton_transformer.training.checkpoint import load_checkpoint, load_model  # noqa: E402
from triton_transformer.training.config import Config, apply_overrides  # noqa: E402
from triton_transformer.training.data import eval_window_starts, load_corpus  # noqa: E402
from triton_transformer.training.distributed import all_gather_object  # noqa: E402
from triton_transformer.training.trainer import Trainer, train  # noqa: E402

DDP = torch.nn.parallel.DistributedDataParallel

LAUNCH_TIMEOUT_S = 120  # a launch that takes longer hangs: fail instead of waiting forever


def tiny_overrides(run_dir: Path, corpus_file: Path, **overrides) -> dict:
    """`helpers.tiny_overrides` as the 2-process tests run it: no dropout, batch 2, 4 steps."""
    ddp = {
        "model__attn_dropout": 0.0,
        "model__ff_dropout": 0.0,
        "train__batch_size": 2,
        "train__max_steps": 4,
        "train__warmup_steps": 2,
        "train__dist_timeout_s": 60.0,
        "eval__max_bytes": 5 * 2 * 32,
    }
    return helpers.tiny_overrides(run_dir, corpus_file, **{**ddp, **overrides})


def make_config(values: dict) -> Config:
    return apply_overrides(Config(), list(values.items())).validate()


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- the worker


def _record_writes(root: Path, written: list[str]) -> None:
    """Note every file under `root` that this process opens for writing or creates."""
    real_open, real_path_open, real_mkdir = builtins.open, pathlib.Path.open, pathlib.Path.mkdir

    def note(path, mode="r") -> None:
        if any(c in str(mode) for c in "wax+"):
            full = Path(os.path.abspath(os.fspath(path)))
            if full.is_relative_to(root):
                written.append(str(full))

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            note(file, mode)
        return real_open(file, mode, *args, **kwargs)

    def path_open(self, mode="r", *args, **kwargs):
        note(self, mode)
        return real_path_open(self, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        note(self, "w")
        return real_mkdir(self, *args, **kwargs)

    builtins.open, pathlib.Path.open, pathlib.Path.mkdir = open_, path_open, mkdir


def worker(spec_path: str) -> None:
    """One rank: train per the spec, then write what happened to out_dir/rank<r>.json."""
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    record: dict = {
        "rank": rank,
        "digests": {},  # step -> every rank's parameter digest
        "written": [],  # files this rank opened for writing (watched on ranks > 0)
        "batches": [],  # digests of the batches it drew
        "reduces": [],  # DDP gradient all-reduces so far, after each step
        "eval_forwards": 0,  # validation batches it scored
    }
    if rank > 0:
        _record_writes(Path(spec["watch_dir"]), record["written"])

    real_random_batch = data_mod.random_batch

    def recording_random_batch(*args, **kwargs):
        batch = real_random_batch(*args, **kwargs)
        record["batches"].append(hashlib.sha256(batch.numpy().tobytes()).hexdigest())
        return batch

    data_mod.random_batch = recording_random_batch

    # count DDP's gradient all-reduces (one per bucket per synchronised backward)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    reduces = [0]

    def counting_hook(state, bucket):
        reduces[0] += 1
        return allreduce_hook(state, bucket)

    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

    def init_with_hook(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, counting_hook)

    torch.nn.parallel.DistributedDataParallel.__init__ = init_with_hook

    def count_eval(module, args, output):
        record["eval_forwards"] += not module.training

    def callback(trainer, step, info):
        if step == 1:
            trainer.wrapper.register_forward_hook(count_eval)
        record["reduces"].append(reduces[0])
        record["digests"][step] = all_gather_object(param_digest(trainer.model))
        if step == spec.get("snapshot_at") and rank == 0:
            dest = Path(spec["snapshot_dir"])
            dest.mkdir(parents=True)
            shutil.copy(trainer.checkpoint_path, dest / "checkpoint.pt")
        if step == spec.get("sigint_at") and rank == spec.get("sigint_rank"):
            os.kill(os.getpid(), signal.SIGINT)  # like torchrun passing on a Ctrl-C
        if step == spec.get("sigterm_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM, passed to every rank
        if step == spec.get("fail_at") and rank == 1:
            if spec["how"] == "die":
                os._exit(3)  # no cleanup at all, like a segfault or the OOM killer
            time.sleep(LAUNCH_TIMEOUT_S)  # hang

    result = train(make_config(spec["config"]), resume=spec.get("resume"), callbacks=[callback])
    # train() left no DDP wrapper for the garbage collector: freeing one (and with it the
    # process group) during interpreter shutdown can abort the process
    record["ddp_alive"] = sum(isinstance(o, DDP) for o in gc.get_objects())
    record.update(
        losses=result.losses,
        val_losses=result.val_losses,
        step=result.step,
        interrupted=result.interrupted,
        stop_signal=result.stop_signal,
        world_size=result.world_size,
        tokens_per_s=result.tokens_per_s,
    )
    Path(spec["out_dir"], f"rank{rank}.json").write_text(json.dumps(record))


# --------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_env(world: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # only the loopback interface; gloo would otherwise pick the hostname's address
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class Launch:
    """`world` worker processes with torchrun's environment variables."""

    def __init__(self, tmp_path: Path, name: str, spec: dict, world: int = 2) -> None:
        self.dir = tmp_path / name
        self.dir.mkdir(parents=True)
        spec = {"out_dir": str(self.dir), "watch_dir": str(tmp_path), **spec}
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = _dist_env(world)
        env.update(MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
        env["LOCAL_WORLD_SIZE"] = str(world)
        self.procs = []
        for r in range(world):
            env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
            with (
                (self.dir / f"out{r}.txt").open("w") as out,
                (self.dir / f"err{r}.txt").open("w") as err,
            ):
                cmd = [sys.executable, __file__, "worker", str(spec_path)]
                self.procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env_r, stdout=out, stderr=err)
                )

    def wait(self, rank: int | None = None, timeout: float = LAUNCH_TIMEOUT_S) -> list[int]:
        """Exit codes (of one rank, or all); a hang is killed and fails the test."""
        procs = self.procs if rank is None else [self.procs[rank]]
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"ranks still running after {timeout} s:\n{self.logs()}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def stdout(self, rank: int) -> str:
        return (self.dir / f"out{rank}.txt").read_text()

    def stderr(self, rank: int) -> str:
        return (self.dir / f"err{rank}.txt").read_text()

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r} stdout:\n{self.stdout(r)}\n--- stderr:\n{self.stderr(r)[-3000:]}"
            for r in range(len(self.procs))
        )

    def results(self) -> list[dict]:
        codes = self.wait()
        assert codes == [0] * len(codes), self.logs()
        out = []
        for r in range(len(self.procs)):
            rec = json.loads((self.dir / f"rank{r}.json").read_text())
            assert rec["ddp_alive"] == 0, f"rank {r}: a DDP wrapper outlived train()"
            for key in ("losses", "val_losses", "digests"):
                rec[key] = {int(k): v for k, v in rec[key].items()}
            out.append(rec)
        return out


def _check_in_sync(records: list[dict], steps: list[int]) -> None:
    """After every step, every rank holds the same parameters (bit for bit)."""
    for rec in records:
        assert sorted(rec["digests"]) == steps
        for step, digests in rec["digests"].items():
            assert len(set(digests)) == 1, f"ranks diverged at step {step}"
    assert records[0]["digests"] == records[1]["digests"]


# --------------------------------------------------------------------------- tests


def test_two_ranks_match_one_process_with_the_union_batch(tmp_path, corpus_file):
    """shard_global_batch: 2 ranks x batch 2 == 1 process x batch 4, step for step; the
    validation loss is the single-process value; rank 1 prints and writes nothing."""
    run_dir = tmp_path / "ddp"
    values = tiny_overrides(
        run_dir,
        corpus_file,
        data__shard_global_batch=True,
        eval__eval_every=2,  # 10 validation windows: 5 per rank, in batches of 2
        eval__generate_every=4,
    )
    launch = Launch(tmp_path, "launch", {"config": values})

    # meanwhile, the same training in this process on the union of the two ranks' batches
    single = train(
        make_config(
            {
                **values,
                "log.run_dir": str(tmp_path / "single"),
                "train.batch_size": 4,
                "eval.eval_every": 0,
                "eval.generate_every": 0,
            }
        )
    )
    records = launch.results()

    r0, r1 = records
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["batches"] == r1["batches"]  # both drew the same global batches
    assert r0["losses"] == r1["losses"]  # the logged loss is the all-reduced one
    assert sorted(r0["losses"]) == [1, 2, 3, 4]
    for step, loss in single.losses.items():
        assert r0["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    # the gradients too: DDP's mean over ranks == the gradient of the union batch
    norms = [r["grad_norm"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    single_norms = [r["grad_norm"] for r in read_jsonl(single.run_dir / "metrics.jsonl")]
    assert norms == pytest.approx(single_norms, rel=1e-5)
    _check_in_sync(records, [1, 2, 3, 4])
    # 2 micro-batches per step, but one gradient all-reduce (the tiny model is one bucket):
    # no_sync on the first
    assert r0["reduces"] == r1["reduces"] == [1, 2, 3, 4]
    final = load_checkpoint(run_dir)
    assert "rng_ranks" in final and len(final["rng_ranks"]) == 2
    reference = load_model(single.checkpoint)[0].state_dict()
    for name, value in final["model"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)

    # validation: all-reduced over the ranks' shares == one process scoring every window
    assert sorted(r0["val_losses"]) == [2, 4] and r0["val_losses"] == r1["val_losses"]
    valid_bytes = len(load_corpus(str(corpus_file)).valid)

    def batches(max_bytes: int, rank: int) -> int:
        mine = len(eval_window_starts(valid_bytes, 32, max_bytes)[rank::2])
        return -(-mine // 2)  # batch_size 2

    # two periodic evaluations of the 10 windows, then the whole split after step 4; each
    # rank scores its disjoint share
    for r, rec in enumerate(records):
        assert rec["eval_forwards"] == 2 * batches(320, r) + batches(0, r)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # resuming a 2-rank checkpoint in 1 process warns
        one = Trainer(
            make_config({**values, "log.run_dir": str(tmp_path / "eval")}), resume=run_dir
        )
    assert one.step == 4
    # the same windows in other batches: equal up to float rounding
    assert one.evaluate()["val_loss"] == pytest.approx(r0["val_losses"][4], rel=1e-6)
    final = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert one.evaluate(max_bytes=0)["val_loss"] == pytest.approx(final["full_val_loss"], rel=1e-6)

    # rank 0 alone logs, samples, checkpoints and prints
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(run_dir / "samples.jsonl")] == [4]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoint.pt",
        "config.toml",
        "metrics.jsonl",
        "samples.jsonl",
    ]
    assert r1["written"] == [] and launch.stdout(1) == ""
    out0 = launch.stdout(0)
    assert "DDP: 2 processes (gloo) | global batch 2 x 2 accumulation x 2 ranks = 8" in out0
    assert "sample at step 4" in out0 and "val loss" in out0
    assert r0["tokens_per_s"] > 0


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU ranks through Triton's interpreter, which a CUDA host's processes run without; "
    "test_two_gpus_nccl_triton_bf16 runs this path (2 micro-batches per step) on GPUs",
)
def test_two_ranks_triton_path_accumulating_in_place(tmp_path, corpus_file):
    """The Triton path (Triton's interpreter on CPU) under DDP with 2 micro-batches per step:
    the second micro-batch's weight gradients are added inside their products
    (`bmm.accumulate_grads_in_place`) and handed to autograd, whose AccumulateGrad nodes
    DDP's all-reduce hooks on. The ranks stay in sync, and losses and gradient norms equal
    one process's on the union batch."""
    values = tiny_overrides(
        tmp_path / "ddp", corpus_file, data__shard_global_batch=True, train__max_steps=3,
        model__use_triton=True, model__attn_dropout=0.0, model__ff_dropout=0.0,
    )  # fmt: skip
    launch = Launch(tmp_path, "launch", {"config": values})
    single = train(
        make_config({**values, "log.run_dir": str(tmp_path / "single"), "train.batch_size": 4})
    )
    records = launch.results()
    for step, loss in single.losses.items():
        assert records[0]["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    norms = [r["grad_norm"] for r in read_jsonl(tmp_path / "ddp" / "metrics.jsonl")]
    single_norms = [r["grad_norm"] for r in read_jsonl(single.run_dir / "metrics.jsonl")]
    assert norms == pytest.approx(single_norms, rel=1e-5)
    _check_in_sync(records, [1, 2, 3])


def test_ctrl_c_on_one_rank_and_exact_resume_with_torchrun(tmp_path, corpus_file):
    """Own data streams per rank, dropout on: a SIGINT to rank 1 alone stops both ranks after
    the same step with a checkpoint; `torchrun ... train.py --resume` from the step-2
    checkpoint continues bit for bit."""
    run_dir = tmp_path / "ddp"
    snapshot = tmp_path / "snapshot"
    values = tiny_overrides(
        run_dir,
        corpus_file,
        model__attn_dropout=0.1,
        model__ff_dropout=0.1,
        train__max_steps=6,
        log__checkpoint_every=2,
    )
    spec = {
        "config": values,
        "snapshot_at": 2,
        "snapshot_dir": str(snapshot),
        "sigint_at": 3,
        "sigint_rank": 1,
    }
    r0, r1 = Launch(tmp_path, "launch", spec).results()
    # the flag travels with step 4's all-reduce: both ranks stop after step 4 and save it
    assert r0["interrupted"] and r1["interrupted"]
    assert r0["step"] == r1["step"] == 4
    assert load_checkpoint(run_dir)["step"] == 4
    assert r0["batches"][0] != r1["batches"][0]  # rank-dependent data streams
    assert r0["losses"] == r1["losses"]
    _check_in_sync([r0, r1], [1, 2, 3, 4])

    # resume from the step-2 checkpoint with the real command line, through torchrun
    ckpt = load_checkpoint(snapshot)
    assert ckpt["step"] == 2 and len(ckpt["rng_ranks"]) == 2
    assert torch.equal(ckpt["rng"]["data"], ckpt["rng_ranks"][0]["data"])
    assert not torch.equal(ckpt["rng_ranks"][0]["data"], ckpt["rng_ranks"][1]["data"])
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "train.py",
        "--resume",
        str(snapshot),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_dist_env(2), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert proc.stdout.count("done: step 6") == 1  # printed by rank 0 only
    assert "DDP: 2 processes (gloo)" in proc.stdout
    resumed = {r["step"]: r["loss"] for r in read_jsonl(snapshot / "metrics.jsonl")}
    assert sorted(resumed) == [3, 4, 5, 6]  # the snapshot dir held only the checkpoint
    assert resumed[3] == r0["losses"][3] and resumed[4] == r0["losses"][4]
    assert load_checkpoint(snapshot)["step"] == 6


def test_sigterm_on_every_rank_saves_and_stops_cleanly(tmp_path, corpus_file):
    """SIGTERM (a scheduler preempting the job; torchrun passes it to every worker): all ranks
    agree through the next step's all-reduce, save one checkpoint and exit cleanly."""
    run_dir = tmp_path / "ddp"
    values = tiny_overrides(run_dir, corpus_file, train__max_steps=6)
    r0, r1 = Launch(tmp_path, "launch", {"config": values, "sigterm_at": 2}).results()
    assert r0["interrupted"] and r1["interrupted"]
    assert r0["stop_signal"] == r1["stop_signal"] == "SIGTERM"
    assert r0["step"] == r1["step"] == 3  # the flag travels with step 3's all-reduce
    ckpt = load_checkpoint(run_dir)
    assert ckpt["step"] == 3 and len(ckpt["rng_ranks"]) == 2
    _check_in_sync([r0, r1], [1, 2, 3])


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_failed_rank_stops_the_other(tmp_path, corpus_file, how):
    """Rank 1 dies (exit without cleanup) or hangs after step 2: rank 0 fails at its next
    collective with a message saying so, instead of waiting forever."""
    values = tiny_overrides(
        tmp_path / "ddp", corpus_file, train__max_steps=6, train__dist_timeout_s=10.0
    )
    launch = Launch(tmp_path, "launch", {"config": values, "fail_at": 2, "how": how})
    try:
        code = launch.wait(rank=0, timeout=60)[0]
    finally:
        launch.kill()
    assert code != 0, launch.logs()
    err = launch.stderr(0)
    assert "DistributedError" in err and "Another rank probably crashed" in err, err[-3000:]
    assert "train.dist_timeout_s=10" in err
    if how == "die":
        assert launch.procs[1].returncode == 3
    else:  # the process-group timeout fired
        assert "timed out" in err.lower()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_triton_bf16(tmp_path, corpus_file, monkeypatch):
    """The GPU path: NCCL, cuda:LOCAL_RANK, Triton kernels under bf16 autocast."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared hosts
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run_dir = tmp_path / "ddp"
    values = tiny_overrides(
        run_dir,
        corpus_file,
        model__use_triton=True,
        train__device="cuda",
        train__precision="bf16",
        data__shard_global_batch=True,
        eval__eval_every=4,
        eval__generate_every=4,
        log__checkpoint_every=2,
    )
    launch = Launch(tmp_path, "launch", {"config": values})
    single = train(
        make_config({**values, "log.run_dir": str(tmp_path / "single"), "train.batch_size": 4})
    )
    r0, r1 = launch.results()
    assert "DDP: 2 processes (nccl)" in launch.stdout(0) and launch.stdout(1) == ""
    _check_in_sync([r0, r1], [1, 2, 3, 4])
    assert r0["losses"] == r1["losses"] and all(math.isfinite(v) for v in r0["losses"].values())
    for step, loss in single.losses.items():
        assert r0["losses"][step] == pytest.approx(loss, rel=2e-2), step
    assert len(load_checkpoint(run_dir)["rng_ranks"]) == 2
    one = Trainer(make_config({**values, "log.run_dir": str(tmp_path / "eval")}), resume=run_dir)
    assert one.evaluate()["val_loss"] == pytest.approx(r0["val_losses"][4], rel=1e-6)


def test_torchrun_environment_and_config_checks(monkeypatch):
    from triton_transformer.training.config import ConfigError
    from triton_transformer.training.distributed import DistInfo, env_info

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert env_info() == DistInfo(rank=2, local_rank=0, world_size=4)
    assert env_info().enabled and not env_info().is_main
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4, WORLD_SIZE=4"):
        env_info()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        env_info()
    with pytest.raises(ConfigError, match=r"train\.dist_timeout_s"):
        make_config({"train.dist_timeout_s": 0.0})


def test_single_process_is_untouched(tmp_path, corpus_file, monkeypatch):
    """Without torchrun's variables nothing distributed happens (no process group)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = make_config(tiny_overrides(tmp_path / "run", corpus_file, train__max_steps=2))
    result = train(config)
    assert result.world_size == 1 and not torch.distributed.is_initialized()
    assert "rng_ranks" not in load_checkpoint(result.checkpoint)
    assert all(math.isfinite(v) for v in result.losses.values())


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash (SIGABRT, SIGSEGV) prints where, to err<r>.txt
    worker(sys.argv[2])
