"""The training loop, checkpoints/resume, metrics, the train.py command line and plotting.

All on CPU with tiny models and a small repetitive local corpus, so they are fast and
deterministic; a resumed run must reproduce an uninterrupted one bit for bit.
"""

import importlib.util
import itertools
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import read_jsonl, tiny_config

import triton_transformer.training.data as data_mod  # its random_batch draws the batches
from triton_transformer.training.checkpoint import load_checkpoint, load_model
from triton_transformer.training.config import ConfigError
from triton_transformer.training.schedule import lr_multiplier
from triton_transformer.training.trainer import NonFiniteLossError, Trainer, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def _load_cli():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_cli()


# --------------------------------------------------------------------------- the loop


def test_tiny_model_learns(tmp_path, corpus_file, corpus):
    config = tiny_config(
        tmp_path / "run",
        corpus_file,
        train__max_steps=40,
        train__lr=1e-2,
        eval__eval_every=20,
        model__attn_dropout=0.0,
        model__ff_dropout=0.0,
        train__grad_accum_steps=1,
        train__batch_size=8,
        log__log_every=5,
    )
    result = train(config, corpus=corpus)
    first = result.losses[1]
    assert abs(first - math.log(256)) < 0.5  # starts near uniform over bytes
    assert sorted(result.val_losses) == [20, 40]
    assert result.final_val_loss < 0.5 * first, (first, result.val_losses)
    assert result.val_losses[40] < result.val_losses[20]
    assert not result.interrupted and result.step == 40
    assert result.tokens_per_s > 0

    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "tokens"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40]
    assert val[-1]["val_bpb"] == pytest.approx(val[-1]["val_loss"] / math.log(2))
    # the logged loss is the mean over the steps since the previous record
    assert records[0]["loss"] == pytest.approx(sum(result.losses[s] for s in range(1, 6)) / 5)
    assert (tmp_path / "run" / "config.toml").is_file()


def test_lr_schedule():
    lrs = [lr_multiplier(s, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))  # cosine decay after warmup
    assert lr_multiplier(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(0, 0, 10, 0.0) == 1.0


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, corpus_file, corpus):
    """An uninterrupted 12-step run with dropout, no validation and no sampling."""
    config = tiny_config(tmp_path_factory.mktemp("ref") / "run", corpus_file)
    result = train(config, corpus=corpus)
    assert len(result.losses) == 12
    return result.losses


def _split_config(run_dir, corpus_file, **kw):
    # validation and sampling on: they must not perturb the training RNG streams
    return tiny_config(run_dir, corpus_file, eval__eval_every=3, eval__generate_every=4, **kw)


def _check_metrics_once_per_step(run_dir):
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 13))


@pytest.mark.parametrize("how", ["callback", "sigint"])
def test_ctrl_c_saves_and_resume_matches(tmp_path, corpus_file, corpus, reference_losses, how):
    run_dir = tmp_path / "run"
    config = _split_config(run_dir, corpus_file)

    def stop_at_5(trainer, step, info):
        if step == 5:
            if how == "callback":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)  # the handler finishes the step, then stops

    previous = signal.getsignal(signal.SIGINT)
    first = train(config, corpus=corpus, callbacks=[stop_at_5])
    assert signal.getsignal(signal.SIGINT) is previous  # handler restored
    assert first.interrupted and first.step == 5
    assert first.checkpoint == run_dir / "checkpoint.pt"
    assert load_checkpoint(run_dir)["step"] == 5

    second = train(config, resume=run_dir, corpus=corpus)
    assert not second.interrupted and second.step == 12
    assert sorted(second.losses) == list(range(6, 13))
    combined = {**first.losses, **second.losses}
    assert combined == reference_losses  # bitwise equal, step for step
    _check_metrics_once_per_step(run_dir)


def test_interrupt_mid_step_rewinds(tmp_path, corpus_file, corpus, reference_losses, monkeypatch):
    """Ctrl-C between the micro-batches of step 4: saved as step 3, resumes exactly."""
    run_dir = tmp_path / "run"
    config = _split_config(run_dir, corpus_file)
    calls = []
    real_random_batch = data_mod.random_batch

    def flaky_random_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 * 2 + 2:  # second micro-batch of step 4
            raise KeyboardInterrupt
        return real_random_batch(*args, **kwargs)

    monkeypatch.setattr(data_mod, "random_batch", flaky_random_batch)
    first = train(config, corpus=corpus)
    assert first.interrupted and first.step == 3
    monkeypatch.setattr(data_mod, "random_batch", real_random_batch)
    second = train(config, resume=run_dir / "checkpoint.pt", corpus=corpus)
    assert {**first.losses, **second.losses} == reference_losses


def test_crash_resumes_from_periodic_checkpoint(tmp_path, corpus_file, corpus, reference_losses):
    run_dir = tmp_path / "run"
    config = _split_config(run_dir, corpus_file, log__checkpoint_every=5)

    def crash_at_7(trainer, step, info):
        if step == 7:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config, corpus=corpus, callbacks=[crash_at_7])
    assert load_checkpoint(run_dir)["step"] == 5
    assert not list(run_dir.glob(".*tmp*"))  # no temp files left behind
    resumed = train(config, resume=run_dir, corpus=corpus)
    assert sorted(resumed.losses) == list(range(6, 13))
    assert all(resumed.losses[s] == reference_losses[s] for s in range(6, 13))
    _check_metrics_once_per_step(run_dir)  # steps 6, 7 logged by the crashed run are dropped


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus_file, corpus):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, corpus_file, log__checkpoint_every=4)

    def poison_at_5(trainer, step, info):
        if step == 5:
            with torch.no_grad():
                trainer.model.to_logits.weight[0, 0] = float("nan")

    with pytest.raises(NonFiniteLossError, match=r"non-finite loss .* at step 6.*step 4"):
        train(config, corpus=corpus, callbacks=[poison_at_5])
    ckpt = load_checkpoint(run_dir)
    assert ckpt["step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_checkpoint_reloads_same_logits(tmp_path, corpus_file, corpus):
    config = tiny_config(tmp_path / "run", corpus_file, train__max_steps=3)
    trainer = Trainer(config, corpus=corpus)
    result = trainer.fit()
    model, loaded_config = load_model(result.checkpoint, device="cpu")
    assert loaded_config == config
    x = torch.randint(0, 256, (2, 32))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), trainer.model(x))
    ckpt = load_checkpoint(result.checkpoint)
    assert {"model", "optimizer", "scheduler", "rng", "config", "step"} <= set(ckpt)
    assert {"torch", "python", "numpy", "data"} <= set(ckpt["rng"])


def test_runtime_config_errors(tmp_path, corpus_file, corpus, monkeypatch):
    # a corpus split too small for the window
    with pytest.raises(ConfigError, match="valid split"):
        train(
            tiny_config(
                tmp_path / "a",
                corpus_file,
                model__max_seq_len=4096,
                train__seq_len=4096,
                eval__eval_every=5,
            ),
            corpus=corpus,
        )
    # use_triton on CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        Trainer(tiny_config(tmp_path / "b", corpus_file, model__use_triton=True), corpus=corpus)


def test_wandb_logging_offline(tmp_path, corpus_file, corpus, monkeypatch):
    logged = []
    fake = types.ModuleType("wandb")

    def init(**kwargs):
        logged.append(("init", kwargs))
        return types.SimpleNamespace(
            id="abc123",
            log=lambda data, step: logged.append(("log", step, data)),
            finish=lambda: logged.append(("finish",)),
        )

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "placeholder")  # so monkeypatch restores it afterwards
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    config = tiny_config(
        tmp_path / "run",
        corpus_file,
        train__max_steps=2,
        train__warmup_steps=1,
        eval__generate_every=2,
        log__wandb=True,
    )
    train(config, corpus=corpus)
    assert os.environ["WANDB_MODE"] == "offline"
    assert logged[0][0] == "init" and logged[0][1]["config"]["train"]["max_steps"] == 2
    assert [(e[1], sorted(e[2])[0]) for e in logged if e[0] == "log"] == [
        (1, "grad_norm"),
        (2, "grad_norm"),
        (2, "sample"),
    ]
    assert logged[-1] == ("finish",)
    assert load_checkpoint(tmp_path / "run")["wandb_id"] == "abc123"

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match="pip install wandb"):
        Trainer(tiny_config(tmp_path / "run2", corpus_file, log__wandb=True), corpus=corpus)


# --------------------------------------------------------------------------- command line


def test_cli_tiny_end_to_end(tmp_path, corpus_file):
    """The README's command on the tiny config, in a fresh process."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.toml",
        "--max-steps",
        "5",
        "--data",
        str(corpus_file),
        "--run-dir",
        str(run_dir),
        "--set",
        "log.progress=false",
        "--eval.eval_every",
        "5",
        "--eval.generate_every",
        "5",
        "--eval.generate_len",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "done: step 5" in proc.stdout and "bits/byte" in proc.stdout
    assert "sample at step 5" in proc.stdout
    assert load_checkpoint(run_dir)["step"] == 5
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [5]

    # resume it in-process for 3 more steps: the checkpoint's config plus the new step count
    assert cli.main(["--resume", str(run_dir), "--max-steps", "8"]) == 0
    assert load_checkpoint(run_dir)["step"] == 8
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [5, 8]

    # plot this run against itself under another label
    png = tmp_path / "loss.png"
    assert (
        cli.main(
            [
                "plot",
                str(run_dir),
                str(run_dir),
                "-o",
                str(png),
                "--x",
                "time",
                "--labels",
                "a",
                "b",
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_config_errors(tmp_path, capsys):
    rc = cli.main(["--config", str(TINY), "--set", "train.seq_len=1024"])
    assert rc == 2
    assert "train.seq_len=1024 exceeds model.max_seq_len=128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--config", str(TINY), "--model.dimm", "3"])
    assert "--model.dimm" in capsys.readouterr().err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[model]\ndimm = 3\n")
    assert cli.main(["--config", str(unknown)]) == 2
    assert "unknown config key 'model.dimm'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--config", str(TINY), "--set", "train.lr"])
    assert "bad override 'train.lr'" in capsys.readouterr().err
    assert cli.main(["--config", str(TINY), "--train.batch_size", "x"]) == 2
    assert "train.batch_size: expected int, got 'x'" in capsys.readouterr().err
    assert cli.main(["--resume", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_cli_use_triton_on_cpu_warns(tmp_path, corpus_file):
    """`--use-triton --triton-interpret` without a GPU: train.py turns on the interpreter
    itself, and warns."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter path")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.toml",
        "--use-triton",
        "--triton-interpret",
        "--max-steps",
        "1",
        "--data",
        str(corpus_file),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "log.progress=false",
        "--model.dim",
        "16",
        "--model.depth",
        "1",
        "--model.heads",
        "1",
        "--model.max_seq_len",
        "8",
        "--train.seq_len",
        "8",
        "--train.batch_size",
        "1",
        "--eval.eval_every",
        "0",
        "--eval.generate_every",
        "0",
        "--eval.prime_len",
        "4",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "interpreter" in proc.stderr and "slow" in proc.stderr
    # one "warning: ..." line, without the source line Python would print under it
    assert "warning: model.use_triton" in proc.stderr and "warnings.warn(" not in proc.stderr
    assert "Triton kernels" in proc.stdout
    ckpt = load_checkpoint(tmp_path / "run")
    assert ckpt["step"] == 1 and ckpt["config"]["model"]["use_triton"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("use_triton", [False, True])
def test_gpu_bf16_autocast_training(tmp_path, corpus_file, corpus, use_triton):
    """The default GPU setup: bf16 autocast, with PyTorch ops and with the Triton kernels."""
    config = tiny_config(
        tmp_path / "run",
        corpus_file,
        train__device="cuda",
        train__precision="bf16",
        train__max_steps=4,
        train__warmup_steps=1,
        model__use_triton=use_triton,
        eval__eval_every=4,
        eval__generate_every=4,
    )
    result = train(config, corpus=corpus)
    assert result.step == 4 and all(math.isfinite(v) for v in result.losses.values())
    assert math.isfinite(result.final_val_loss)
    assert result.peak_mem_mb > 0
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("peak_mem_mb" in r for r in records)


# --------------------------------------------------------------------------- issue 10


def test_validation_set_ignores_batch_size_and_world_size(tmp_path, corpus_file, corpus):
    """The validation windows are a function of the data and eval.max_bytes: any batch size,
    and any split of them over ranks, gives the same loss (up to float rounding)."""
    from triton_transformer.training.distributed import DistInfo
    from triton_transformer.training.evaluation import evaluate_loss

    trainer = Trainer(
        tiny_config(tmp_path / "run", corpus_file, eval__max_bytes=640), corpus=corpus
    )
    trainer.fit()
    kwargs = dict(seq_len=32, max_bytes=640, device=trainer.device, autocast=trainer._autocast)
    one = evaluate_loss(trainer.wrapper, corpus.valid, batch_size=16, **kwargs)
    assert one["tokens"] == 640
    for batch in (1, 4, 7):
        other = evaluate_loss(trainer.wrapper, corpus.valid, batch_size=batch, **kwargs)
        assert other["tokens"] == 640
        assert other["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)
    # two ranks' shares (what the all-reduce sums), without a process group
    shares = [
        evaluate_loss(trainer.wrapper, corpus.valid, batch_size=4, dist=DistInfo(r, r, 2), **kwargs)
        for r in range(2)
    ]
    total = sum(s["val_loss"] * s["tokens"] for s in shares) / sum(s["tokens"] for s in shares)
    assert sum(s["tokens"] for s in shares) == 640
    assert total == pytest.approx(one["val_loss"], rel=1e-6)
    # the whole split on request
    full = trainer.evaluate(max_bytes=0)
    assert full["tokens"] == (len(corpus.valid) - 1) // 32 * 32


def test_full_split_at_the_end(tmp_path, corpus_file, corpus):
    config = tiny_config(
        tmp_path / "run", corpus_file, train__max_steps=4, eval__eval_every=2, eval__max_bytes=64
    )
    result = train(config, corpus=corpus)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert "full_val_loss" in records[-1] and "full_val_loss" not in records[1]
    assert result.full_val_loss == records[-1]["full_val_loss"]
    assert result.val_losses[4] == records[-1]["val_loss"]  # the periodic subset, as before
    assert result.full_val_loss != result.val_losses[4]  # 64 bytes vs the whole split


def test_ctrl_c_takes_effect_after_the_current_micro_batch(
    tmp_path, corpus_file, corpus, reference_losses, monkeypatch
):
    """A SIGINT during micro-batch 1 of step 4 (of 2): micro-batch 2 is never drawn, the
    checkpoint is step 3 with step 4's RNG draws rewound, and the resumed run is exact."""
    run_dir = tmp_path / "run"
    config = _split_config(run_dir, corpus_file)
    calls = []
    real_random_batch = data_mod.random_batch

    def random_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 * 2 + 1:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets the flag
        return real_random_batch(*args, **kwargs)

    monkeypatch.setattr(data_mod, "random_batch", random_batch)
    first = train(config, corpus=corpus)
    assert first.interrupted and first.step == 3
    assert len(calls) == 3 * 2 + 1  # stopped before the second micro-batch
    monkeypatch.setattr(data_mod, "random_batch", real_random_batch)
    second = train(config, resume=run_dir, corpus=corpus)
    assert {**first.losses, **second.losses} == reference_losses


def test_log_window_is_checkpointed(tmp_path, corpus_file, corpus):
    """log_every=4, stopped at step 6: the resumed run's record at step 8 is the mean over
    steps 5..8, as in the uninterrupted run, so metrics.jsonl matches line for line."""

    def lines(run_dir):
        timing = ("tokens_per_s", "train_time_s")
        return [
            {k: v for k, v in r.items() if k not in timing}
            for r in read_jsonl(run_dir / "metrics.jsonl")
        ]

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    train(tiny_config(ref_dir, corpus_file, log__log_every=4), corpus=corpus)

    def stop_at_6(trainer, step, info):
        if step == 6:
            raise KeyboardInterrupt

    config = tiny_config(run_dir, corpus_file, log__log_every=4)
    assert train(config, corpus=corpus, callbacks=[stop_at_6]).interrupted
    assert load_checkpoint(run_dir)["log_window"]["steps"] == 2
    train(config, resume=run_dir, corpus=corpus)
    assert lines(run_dir) == lines(ref_dir)
    assert [r["step"] for r in lines(run_dir)] == [4, 8, 12]


def test_mfu_from_known_peaks(monkeypatch):
    from triton_transformer.training import metrics
    from triton_transformer.transformer import Transformer

    model = Transformer(num_tokens=256, dim=64, depth=2, heads=2, dim_head=32, max_seq_len=128)
    n = sum(p.numel() for p in model.parameters()) - (256 + 128) * 64  # without embeddings
    fpt = metrics.flops_per_token(model, depth=2, heads=2, dim_head=32, seq_len=128)
    assert fpt == 6 * n + 12 * 2 * 2 * 32 * 128
    assert metrics.peak_bf16_flops(torch.device("cpu")) is None
    assert metrics.mfu(fpt, 1e6, None) is None  # unknown device: no MFU
    assert metrics.mfu(1e9, 1e5, 1e15, devices=2) == pytest.approx(0.05)
    names = {"NVIDIA H200": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA A100-SXM4-80GB": 312e12}
    for name, peak in [*names.items(), ("Tesla V100-SXM2-16GB", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert metrics.peak_bf16_flops(torch.device("cuda", 0)) == peak


def test_run_dir_refusals_in_process(tmp_path, corpus_file, corpus):
    from triton_transformer.training.run_dir import RunDirError

    run_dir = tmp_path / "run"
    train(tiny_config(run_dir, corpus_file, train__max_steps=3), corpus=corpus)
    with pytest.raises(RunDirError, match="--overwrite"):
        Trainer(tiny_config(run_dir, corpus_file, train__max_steps=3), corpus=corpus)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    # resuming into a different, non-empty directory is a new run there: refused too
    with pytest.raises(RunDirError, match="already holds files"):
        Trainer(tiny_config(other, corpus_file), resume=run_dir, corpus=corpus)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
