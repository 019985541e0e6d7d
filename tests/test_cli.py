"""The train.py command line, driven as a user would: in a subprocess, on CPU, tiny models.

Exit codes, what goes to stdout and stderr (never a Python traceback for a user mistake),
files left untouched by a refused run, SIGTERM then --resume, `eval` and `sample`, and the
first run on a machine without a GPU. Nothing here touches the network: Hugging Face is
pointed at a closed port on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import read_jsonl

from triton_transformer.training.checkpoint import load_checkpoint
from triton_transformer.training.config import load_config
from triton_transformer.training.run_dir import RunDirLock

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300
HAS_CUDA = torch.cuda.is_available()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(**extra: str) -> dict:
    """The environment of a user's shell: no TRITON_INTERPRET (conftest sets it for this
    process), Hugging Face at a closed local port (never the real hub)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", OMP_NUM_THREADS="1")
    env.pop("TRITON_TRANSFORMER_DEBUG", None)
    env.update(extra)
    return env


def run_cli(*args: str, env: dict | None = None, timeout: float = TIMEOUT):
    cmd = [sys.executable, "train.py", *map(str, args)]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or cli_env()
    )


def assert_clean_error(proc, *needles: str, code: int = 2) -> None:
    """A user mistake: the given exit code, a short message on stderr naming the problem,
    no traceback, nothing on stdout."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("train.py: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under `path` (hidden ones too) -> sha256 of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def tiny_args(corpus_file: Path, run_dir: Path, steps: int = 3, *extra: str) -> list[str]:
    return [
        "--config",
        "configs/tiny.toml",
        "--data",
        corpus_file,
        "--run-dir",
        run_dir,
        "--max-steps",
        steps,
        "--set",
        "log.progress=false",
        "--model.dim",
        "32",
        "--model.depth",
        "1",
        "--model.heads",
        "2",
        "--model.dim_head",
        "16",
        "--model.max_seq_len",
        "32",
        "--train.seq_len",
        "32",
        "--train.batch_size",
        "4",
        "--train.warmup_steps",
        "1",
        "--eval.eval_every",
        "0",
        "--eval.generate_every",
        "0",
        "--eval.prime_len",
        "8",
        "--eval.generate_len",
        "8",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_file) -> Path:
    """A finished 3-step run (checkpoint, metrics) shared by the read-only tests."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    proc = run_cli(*tiny_args(corpus_file, run_dir, 3))
    assert proc.returncode == 0, proc.stderr
    return run_dir


# --------------------------------------------------------------------------- eval, sample


def test_eval_is_independent_of_batch_size(trained_run):
    out = {}
    for batch in (4, 16):
        proc = run_cli("eval", trained_run, "--batch-size", batch, "--json")
        assert proc.returncode == 0, proc.stderr
        out[batch] = json.loads(proc.stdout)  # stdout holds the JSON object only
    assert set(out[4]) == {"split", "loss", "bits_per_byte", "tokens", "bytes", "tokenizer"}
    assert out[4]["bytes"] == out[4]["tokens"] and out[4]["tokenizer"] == "bytes"
    assert out[4]["split"] == "valid" and out[4]["tokens"] == out[16]["tokens"] > 0
    # the same windows in other batches: equal up to float rounding
    assert out[4]["loss"] == pytest.approx(out[16]["loss"], rel=1e-6)
    assert out[4]["bits_per_byte"] == pytest.approx(out[4]["loss"] / 0.6931471805599453)

    proc = run_cli("eval", trained_run, "--split", "test", "--max-bytes", "64")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("test: loss ") and "over 64 bytes" in proc.stdout


def test_sample_is_reproducible_and_alone_on_stdout(trained_run):
    args = ["sample", trained_run, "--prompt", "3 the ", "--length", "40"]
    first = run_cli(*args, "--seed", "7")
    again = run_cli(*args, "--seed", "7")
    other = run_cli(*args, "--seed", "8")
    for proc in (first, again, other):
        assert proc.returncode == 0, proc.stderr
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout
    assert len(first.stdout.encode()) >= 40  # the text (U+FFFD may stand for a byte) only
    assert "seed 7" in first.stderr and "seed 7" not in first.stdout


def test_sample_uses_the_kv_cache(trained_run, monkeypatch, capsys):
    """In-process, to see inside: one KVCache serves the whole generation."""
    import triton_transformer.autoregressive_wrapper as aw

    made = []

    # KVCache for eager decoding, StaticKVCache for the graphed decode (the default on a GPU)
    def spy_on(real):
        def spy(*args, **kwargs):
            made.append(1)
            return real(*args, **kwargs)

        return spy

    for name in ("KVCache", "StaticKVCache"):
        monkeypatch.setattr(aw, name, spy_on(getattr(aw, name)))
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["sample", str(trained_run), "--length", "5", "--seed", "1"]) == 0
    assert made == [1]
    assert len(capsys.readouterr().out) > 0


def test_print_config(tmp_path):
    proc = run_cli("--config", "configs/tiny.toml", "--train.lr", "0.01", "--print-config")
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "printed.toml"
    path.write_text(proc.stdout)
    expected = load_config(ROOT / "configs" / "tiny.toml", [("train.lr", 0.01)])
    assert load_config(path) == expected


# --------------------------------------------------------------------------- run directories


def test_existing_run_is_never_clobbered(trained_run, corpus_file, tmp_path):
    before = tree_digest(trained_run)
    proc = run_cli(*tiny_args(corpus_file, trained_run, 2))
    assert_clean_error(proc, "--resume", "--overwrite")
    assert tree_digest(trained_run) == before  # not a byte changed

    # --overwrite on a copy: a run that fails to start (bad --data) deletes nothing; a fresh
    # run of 2 steps replaces the old one
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, _ in before.items():
        (copy / name).write_bytes((trained_run / name).read_bytes())
    bad = tiny_args(tmp_path / "missing.txt", copy, 2)
    assert_clean_error(run_cli(*bad, "--overwrite"), "not found")
    assert tree_digest(copy) == before
    proc = run_cli(*tiny_args(corpus_file, copy, 2), "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(copy)["step"] == 2
    assert [json.loads(line)["step"] for line in (copy / "metrics.jsonl").open()] == [2]


def test_a_second_run_into_a_locked_directory_is_refused(corpus_file, tmp_path):
    run_dir = tmp_path / "run"
    lock = RunDirLock.acquire(run_dir, resuming=False)  # "the first run": this process
    try:
        proc = run_cli(*tiny_args(corpus_file, run_dir, 2))
        assert_clean_error(proc, "in use by another training run", f"process {os.getpid()}")
        proc = run_cli("--resume", run_dir)  # nothing to resume yet, but also refused
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # they wrote nothing
    finally:
        lock.release()
    assert not run_dir.exists()  # the holder created it, wrote nothing: removed on release


def test_run_dir_that_is_a_file(corpus_file, tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a directory")
    assert_clean_error(run_cli(*tiny_args(corpus_file, target, 2)), "is a file")
    assert target.read_text() == "not a directory"


def test_stale_temp_files_are_removed_on_resume(trained_run, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name, _ in tree_digest(trained_run).items():
        (run_dir / name).write_bytes((trained_run / name).read_bytes())
    stale = run_dir / ".checkpoint.pt.tmp-999999"  # what a kill -9 mid-save leaves
    stale.write_bytes(b"partial")
    proc = run_cli("--resume", run_dir, "--max-steps", "4")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists()
    assert load_checkpoint(run_dir)["step"] == 4
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of the run directory `src` at `dst` (its files, not its path)."""
    dst.mkdir(parents=True)
    for name in tree_digest(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_resume_applies_and_records_an_allowed_override(trained_run, tmp_path):
    """Issue #21: a resumed run's config.toml records what it runs with, its run directory
    included (never run_dir = ""), even for a copy of the run elsewhere."""
    run_dir = copy_run(trained_run, tmp_path / "copy")
    proc = run_cli("--resume", run_dir, "--max-steps", "5", "--log.log_every", "2")
    assert proc.returncode == 0, proc.stderr
    assert "done: step 5" in proc.stdout and "note:" not in proc.stderr
    recorded = load_config(run_dir / "config.toml")
    assert recorded.train.max_steps == 5 and recorded.log.log_every == 2
    assert recorded.train.warmup_steps == 1  # --max-steps on a resume sets the steps only
    assert recorded.log.run_dir == str(run_dir)  # where it ran, not "" nor the original
    assert load_checkpoint(run_dir)["config"] == recorded.to_dict()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()] == [3, 4, 5]


def test_resume_refuses_an_override_it_cannot_apply(trained_run, tmp_path):
    """Issue #21: `--resume RUN --set train.lr=1e6` kept the old schedule while config.toml
    claimed lr = 1000000.0. Now it is refused, naming the key and what a resume may change,
    and nothing in the run changes."""
    run_dir = copy_run(trained_run, tmp_path / "copy")
    before = tree_digest(run_dir)
    proc = run_cli("--resume", run_dir, "--set", "train.lr=1e6", "--max-steps", "5")
    assert_clean_error(
        proc, "train.lr=1000000.0 (checkpoint: ", "may change only", "train.max_steps"
    )
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
    assert tree_digest(run_dir) == before
    # the saved value itself is no change: accepted
    lr = load_config(run_dir / "config.toml").train.lr
    proc = run_cli("--resume", run_dir, "--set", f"train.lr={lr}", "--print-config")
    assert proc.returncode == 0, proc.stderr


def test_a_run_that_fails_during_setup_leaves_no_directory(corpus_file, tmp_path):
    """Issue #21: --wandb without wandb installed failed after config.toml was written; the
    directory then refused a new run, and --resume found no checkpoint. Now the failed run
    leaves nothing behind and the same command (without --wandb) just runs."""
    no_wandb = tmp_path / "no_wandb"
    no_wandb.mkdir()
    (no_wandb / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    env = cli_env(PYTHONPATH=str(no_wandb))
    run_dir = tmp_path / "run"
    proc = run_cli(*tiny_args(corpus_file, run_dir, 2), "--wandb", env=env)
    assert_clean_error(proc, "pip install wandb")
    assert not run_dir.exists()
    run_dir.mkdir()  # a directory the user made: kept, and left as it was (empty)
    assert_clean_error(run_cli(*tiny_args(corpus_file, run_dir, 2), "--wandb", env=env))
    assert list(run_dir.iterdir()) == []

    # what earlier versions left behind (only config.toml, no checkpoint): --resume says
    # so, and a new run may use the directory
    (run_dir / "config.toml").write_text("[train]\nmax_steps = 2\n")
    assert_clean_error(run_cli("--resume", run_dir), "stopped before its first checkpoint")
    proc = run_cli(*tiny_args(corpus_file, run_dir, 2))
    assert proc.returncode == 0, proc.stderr
    assert load_checkpoint(run_dir)["step"] == 2
    assert load_config(run_dir / "config.toml").train.max_steps == 2


# --------------------------------------------------------------------------- preemption


def _metric_lines(path: Path) -> list[dict]:
    """metrics.jsonl without the measured fields (time, speed, GPU memory), which no two
    runs share."""
    timing = {"tokens_per_s", "train_time_s", "mfu", "peak_mem_mb"}
    return [
        {k: v for k, v in json.loads(line).items() if k not in timing}
        for line in path.read_text().splitlines()
    ]


def test_sigterm_saves_and_resume_matches_uninterrupted(corpus_file, tmp_path):
    """SIGTERM (what a scheduler sends): checkpoint, a clean exit 143 and a resume command;
    `--resume` then logs what an uninterrupted run logs, line for line (the loss window
    of log.log_every=7 steps spans the interruption)."""
    steps = 400
    extra = ["--log.log_every", "7", "--train.grad_accum_steps", "2"]
    reference = tmp_path / "reference"
    proc = run_cli(*tiny_args(corpus_file, reference, steps, *extra))
    assert proc.returncode == 0, proc.stderr

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", *map(str, tiny_args(corpus_file, run_dir, steps, *extra))]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    # the first record (step 7) means the loop, and its signal handler, are running
    while not (metrics.exists() and metrics.read_text()) and p.poll() is None:
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    assert "SIGTERM" in err and f"--resume {run_dir}" in err
    stopped_at = load_checkpoint(run_dir)["step"]
    assert 7 <= stopped_at < steps

    proc = run_cli("--resume", run_dir)
    assert proc.returncode == 0, proc.stderr
    assert f"done: step {steps}" in proc.stdout and "wall time" in proc.stdout
    assert _metric_lines(metrics) == _metric_lines(reference / "metrics.jsonl")


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def bad_inputs(tmp_path, trained_run):
    """name -> (extra command-line arguments, words the message must contain)."""
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    gz = tmp_path / "corpus.txt.gz"
    gz.write_bytes(b"\x1f\x8b" + b"x" * 100)
    folder = tmp_path / "folder"
    folder.mkdir()
    tiny_enwik8 = tmp_path / "tiny_enwik8"
    tiny_enwik8.mkdir()
    (tiny_enwik8 / "enwik8").write_bytes(b"abc")
    bad_zip = tmp_path / "bad_zip"
    bad_zip.mkdir()
    (bad_zip / "enwik8.zip").write_bytes(b"PK\x03\x04 this is not a zip")
    bad_deflate = tmp_path / "bad_deflate"
    bad_deflate.mkdir()
    with zipfile.ZipFile(bad_deflate / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", os.urandom(2000) * 4)
    raw = bytearray((bad_deflate / "enwik8.zip").read_bytes())
    raw[60:400] = b"\xff" * 340  # inside the deflate stream: zlib.error or a CRC failure
    (bad_deflate / "enwik8.zip").write_bytes(bytes(raw))

    ckpt_bytes = (trained_run / "checkpoint.pt").read_bytes()
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "truncated.pt").write_bytes(ckpt_bytes[: len(ckpt_bytes) // 2])
    (ckpts / "empty.pt").write_bytes(b"")
    (ckpts / "garbage.pt").write_bytes(os.urandom(1000))
    torch.save({"weights": torch.zeros(2)}, ckpts / "foreign.pt")
    torch.save([1, 2, 3], ckpts / "list.pt")

    no_datasets = tmp_path / "no_datasets"
    no_datasets.mkdir()
    (no_datasets / "datasets.py").write_text("raise ImportError('No module named datasets')\n")
    offline = tmp_path / "offline_datasets"
    offline.mkdir()
    # a datasets stand-in that fails the test if asked to go online: offline must be
    # detected before load_dataset is called
    (offline / "datasets.py").write_text(
        "import os\n"
        "def load_dataset(name, config=None):\n"
        "    if os.environ.get('HF_HUB_OFFLINE') != '1':\n"
        "        raise SystemExit('load_dataset went online')\n"
        "    raise FileNotFoundError(f'Dataset {name} is not cached')\n"
    )

    def data_dir(d):
        return ["--data", "enwik8", "--data.data_dir", d, "--data.download", "false"]

    return {
        "empty file": (["--data", empty], ["is empty"], {}),
        "compressed file": (["--data", gz], ["compressed", "decompress"], {}),
        "directory": (["--data", folder], ["is a directory"], {}),
        "hf without a name": (["--data", "hf:"], ["hf:NAME"], {}),
        "hf without datasets": (
            ["--data", "hf:wikitext"],
            ["pip install datasets"],
            {"PYTHONPATH": str(no_datasets)},
        ),
        "hf offline": (
            ["--data", "hf:wikitext"],
            ["not in the local Hugging Face cache", "unreachable"],
            {"PYTHONPATH": str(offline)},
        ),
        "3-byte enwik8": (data_dir(tiny_enwik8), ["3 bytes", "delete it"], {}),
        "bad zip": (data_dir(bad_zip), ["not a valid enwik8 archive"], {}),
        "bad deflate stream": (data_dir(bad_deflate), ["not a valid enwik8 archive"], {}),
        "truncated checkpoint": (
            ["--resume", ckpts / "truncated.pt"],
            ["truncated or damaged"],
            {},
        ),
        "empty checkpoint": (["--resume", ckpts / "empty.pt"], ["is empty"], {}),
        "garbage checkpoint": (
            ["--resume", ckpts / "garbage.pt"],
            ["not a checkpoint written by train.py"],
            {},
        ),
        "foreign dict": (["--resume", ckpts / "foreign.pt"], ["not a triton-transformer"], {}),
        "a list": (["--resume", ckpts / "list.pt"], ["not a triton-transformer"], {}),
        "another model shape": (
            ["--resume", trained_run, "--model.dim", "64"],
            ["model.dim=64 (checkpoint: 32)", "drop those overrides"],
            {},
        ),
    }


CASES = [
    "empty file",
    "compressed file",
    "directory",
    "hf without a name",
    "hf without datasets",
    "hf offline",
    "3-byte enwik8",
    "bad zip",
    "bad deflate stream",
    "truncated checkpoint",
    "empty checkpoint",
    "garbage checkpoint",
    "foreign dict",
    "a list",
    "another model shape",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_without_traceback(case, bad_inputs, corpus_file, tmp_path):
    extra, needles, env = bad_inputs[case]
    if extra[0] == "--resume":
        args = [*extra, "--run-dir", tmp_path / "out"] if case != "another model shape" else extra
    else:
        args = tiny_args(corpus_file, tmp_path / "out", 2)
        args[args.index("--data") + 1] = extra[1]  # replace the corpus
        args += extra[2:]
    proc = run_cli(*args, env=cli_env(**env))
    assert_clean_error(proc, *needles)
    assert not (tmp_path / "out").exists()  # a run that cannot start leaves nothing behind
    if case == "directory":
        assert "not found" not in proc.stderr
    if case == "garbage checkpoint":
        # --debug (or TRITON_TRANSFORMER_DEBUG=1) shows the traceback of the same mistake
        debug = run_cli(*args, "--debug", env=cli_env(**env))
        assert debug.returncode != 0 and "Traceback" in debug.stderr
        debug = run_cli(*args, env=cli_env(TRITON_TRANSFORMER_DEBUG="1", **env))
        assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_damaged_checkpoint_is_refused_by_name(trained_run, tmp_path):
    """Issue #21: 4 KB of random bytes in the middle of a checkpoint loaded without complaint
    (torch does not check tensor data), and the resumed run trained on them. The checksum
    saved with every checkpoint refuses it, naming the file and how to start over."""
    run_dir = copy_run(trained_run, tmp_path / "copy")
    ckpt = run_dir / "checkpoint.pt"
    raw = bytearray(ckpt.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4096] = os.urandom(4096)
    ckpt.write_bytes(bytes(raw))
    before = tree_digest(run_dir)
    proc = run_cli("--resume", run_dir)
    assert_clean_error(proc, str(ckpt), "is damaged", "SHA-256", "--overwrite")
    assert tree_digest(run_dir) == before
    assert_clean_error(run_cli("eval", run_dir), str(ckpt), "is damaged")  # eval too
    assert_clean_error(run_cli("sample", ckpt), str(ckpt), "is damaged")  # and sample


def test_checkpoint_without_checksum_loads_with_a_warning(trained_run, tmp_path):
    """A checkpoint from before checksums (plain torch.save) still resumes, saying once that
    it was not verified; the checkpoints the resumed run writes carry one."""
    run_dir = copy_run(trained_run, tmp_path / "old")
    torch.save(load_checkpoint(trained_run), run_dir / "checkpoint.pt")
    proc = run_cli("--resume", run_dir, "--max-steps", "4")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "carries no checksum" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), proc.stderr
    assert str(run_dir / "checkpoint.pt") in warned[0]
    proc = run_cli("eval", run_dir, "--max-bytes", "64")
    assert proc.returncode == 0 and "checksum" not in proc.stderr, proc.stderr


def test_download_ctrl_c_is_quiet_and_leaves_nothing(tmp_path):
    """A server that sends the headers, then nothing: Ctrl-C during the download."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    data_dir = tmp_path / "data"
    cmd = [
        sys.executable,
        "train.py",
        "download",
        "--data-dir",
        str(data_dir),
        "--url",
        f"http://127.0.0.1:{port}/enwik8.zip",
    ]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        listener.settimeout(TIMEOUT)
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"PK" * 100)
        time.sleep(0.5)  # the client is now reading the body
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=TIMEOUT)
        conn.close()
    finally:
        listener.close()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert list(data_dir.iterdir()) == []  # the temporary file is gone


# --------------------------------------------------------------------------- first CPU run


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine-without-a-GPU path")
def test_first_run_on_cpu_picks_the_preset_and_pytorch_ops(corpus_file, tmp_path):
    # the README's main command resolves to the CPU preset with PyTorch ops
    proc = run_cli("--use-triton", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = tmp_path / "printed.toml"
    printed.write_text(proc.stdout)
    config = load_config(printed)
    preset = load_config(ROOT / "configs" / "cpu.toml")
    assert config.model == preset.model and not config.model.use_triton
    assert "NO CUDA GPU" in proc.stderr and "--config configs/enwik8.toml" in proc.stderr
    assert "interpreter" in proc.stderr and "--triton-interpret" in proc.stderr

    # and trains (2 steps on a small corpus here), logging its first step and a sample
    run_dir = tmp_path / "run"
    proc = run_cli(
        "--use-triton",
        "--data",
        corpus_file,
        "--run-dir",
        run_dir,
        "--max-steps",
        "2",
        "--set",
        "log.progress=false",
        "--eval.generate_every",
        "2",
        "--eval.generate_len",
        "16",
    )
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch ops" in proc.stdout and "sample at step 2" in proc.stdout
    assert "step 1: loss" in proc.stdout
    ckpt = load_checkpoint(run_dir)
    assert ckpt["config"]["model"]["use_triton"] is False
    assert ckpt["config"]["model"]["dim"] == preset.model.dim


def test_config_errors_are_one_line_each():
    """Issue #21: a range error printed "invalid config:" and the problem on a second line."""
    proc = run_cli("--config", "configs/tiny.toml", "--train.lr", "-1", "--print-config")
    assert_clean_error(proc, "train.py: error: invalid config: train.lr=-1.0 must be a positive")
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
    proc = run_cli(
        "--config", "configs/tiny.toml", "--train.lr", "-1", "--train.batch_size", "0",
        "--print-config",
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "train.py: error: invalid config: train.batch_size=0 must be >= 1",
        "train.py: error: invalid config: train.lr=-1.0 must be a positive number",
    ]


def test_max_steps_says_when_it_shortens_the_warmup():
    """Issue #21: --max-steps rescaled train.warmup_steps without saying so."""
    proc = run_cli("--config", "configs/tiny.toml", "--max-steps", "20", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "note: --max-steps 20 is shorter than the warmup: train.warmup_steps 50 -> 2 (the "
        "same 10% of the run); set --train.warmup_steps to choose another"
    ]
    assert "warmup_steps = 2" in proc.stdout
    for quiet in (["--max-steps", "2000"], ["--max-steps", "20", "--train.warmup_steps", "5"]):
        proc = run_cli("--config", "configs/tiny.toml", *quiet, "--print-config")
        assert proc.returncode == 0 and proc.stderr == "", (quiet, proc.stderr)


@pytest.mark.skipif(HAS_CUDA, reason="checks the machine-without-a-GPU path")
def test_fallback_corpus_banner_has_no_bare_warning_line(tmp_path):
    """Issue #21: the fallback corpus's banner began with a line holding only "warning: "."""
    proc = run_cli(
        "--data.data_dir", tmp_path / "no_enwik8", "--data.download", "false",
        "--max-steps", "1", "--run-dir", tmp_path / "run", "--set", "log.progress=false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "NO CUDA GPU" in proc.stderr
    assert not [line for line in lines if line.strip() in ("warning:", "")], proc.stderr
    assert any(line.startswith("warning: ENWIK8 IS NOT AVAILABLE") for line in lines)
    assert sum("train.warmup_steps 30 -> 0" in line for line in lines) == 1


def test_readme_cpu_install_gets_the_cpu_build_anywhere():
    """Issue #21: `pip install torch==2.13.0` is the CPU build only next to a local wheel."""
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    assert "torch==" not in install


def test_plot_of_a_run_without_records(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    out = tmp_path / "loss.png"
    proc = run_cli("plot", run_dir, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "no records yet" in proc.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- token-level runs


def _varied_text(path: Path) -> Path:
    """About 90 KB of varied, learnable text: enough pairs for a BPE of a few hundred tokens."""
    animals = ["fox", "dog", "cat", "owl", "eel", "yak", "emu", "gnu", "ant", "bee", "hen"]
    verbs = ["jumps over", "runs past", "sleeps near", "looks at", "waits for", "hides from"]
    lines = [
        f"{i} the {['quick', 'lazy', 'brown', 'small', 'grand'][i % 5]} {animals[i % 11]} "
        f"{verbs[i % 6]} the {animals[(i * 7) % 11]} ({i % 13} times, été {i % 3}).\n"
        for i in range(1500)
    ]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_token_level_run_then_sample_eval_and_resume(tmp_path):
    """configs/gpt2-small-cpu.toml through the command line: a 384-token BPE trained on the
    corpus, a few dozen steps whose loss falls, the run's tokenizer in its directory, then
    sample, eval (loss per token and bits per byte) and --resume on it."""
    corpus = _varied_text(tmp_path / "animals.txt")
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    args = [
        "--config", "configs/gpt2-small-cpu.toml", "--data", corpus, "--run-dir", run_dir,
        "--data.data_dir", data_dir, "--data.vocab_size", "384", "--max-steps", "40",
        "--eval.eval_every", "20", "--eval.generate_every", "40", "--log.log_every", "5",
        "--set", "log.progress=false",
    ]  # fmt: skip
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "bpe tokenizer (384 tokens)" in proc.stdout and "bits/byte" in proc.stdout
    assert "done: step 40" in proc.stdout
    losses = [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses  # from about ln(384) = 5.95
    assert (run_dir / "tokenizer.json").is_file()
    assert sorted(p.name.split(".")[-1] for p in (data_dir / "tokens").iterdir()) == [
        "json",
        "tokens",
        "tokens",
    ]

    proc = run_cli("sample", run_dir, "--prompt", "12 the quick", "--length", "24", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) > 24  # 24 tokens of several bytes each, after the prompt
    assert "24 tokens" in proc.stderr

    proc = run_cli("eval", run_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokenizer"] == "bpe" and out["bytes"] > 2 * out["tokens"] > 0
    assert out["bits_per_byte"] == pytest.approx(
        out["loss"] * out["tokens"] / math.log(2) / out["bytes"]
    )
    proc = run_cli("eval", run_dir, "--split", "test")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("test: loss ") and "nats/token" in proc.stdout
    assert "bits/byte" in proc.stdout

    proc = run_cli("--resume", run_dir, "--max-steps", "44", "--set", "log.progress=false")
    assert proc.returncode == 0, proc.stderr
    assert "done: step 44" in proc.stdout and "rebuilding" not in proc.stderr


def test_token_config_mistakes_are_one_line(tmp_path, corpus_file):
    # bpe without a size, on a byte preset
    proc = run_cli("--config", "configs/tiny.toml", "--data.tokenizer", "bpe", "--print-config")
    assert_clean_error(proc, "data.vocab_size=0 must be set")
    # a byte preset's explicit 256-token vocabulary under a larger BPE
    proc = run_cli(
        "--config", "configs/tiny.toml", "--data.tokenizer", "bpe", "--data.vocab_size", "300",
        "--print-config",
    )  # fmt: skip
    assert_clean_error(proc, "model.num_tokens=256 is smaller than data.vocab_size=300")
    # a tokenizer.json that does not exist
    proc = run_cli(
        *tiny_args(corpus_file, tmp_path / "run", 2),
        "--data.tokenizer", tmp_path / "missing.json", "--model.num_tokens", "0",
    )  # fmt: skip
    assert_clean_error(proc, "missing.json", "not found")
    assert not (tmp_path / "run").exists()
    # without the `tokenizers` package
    no_tok = tmp_path / "no_tokenizers"
    no_tok.mkdir()
    (no_tok / "tokenizers.py").write_text("raise ImportError('No module named tokenizers')\n")
    proc = run_cli(
        *tiny_args(corpus_file, tmp_path / "run", 2),
        "--data.tokenizer", "bpe", "--data.vocab_size", "300", "--model.num_tokens", "0",
        "--data.data_dir", tmp_path / "data",
        env=cli_env(PYTHONPATH=str(no_tok)),
    )  # fmt: skip
    assert_clean_error(proc, "pip install tokenizers")
