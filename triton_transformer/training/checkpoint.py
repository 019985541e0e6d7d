"""Checkpoints on disk: writing them atomically with a checksum, reading them back safely.

A run directory holds config.toml, metrics.jsonl, samples.jsonl and checkpoint.pt. The
checkpoint is written atomically (temp file, fsync, rename) by `Checkpointer` and holds
everything needed to continue bit for bit: model, optimizer, scheduler, step and every RNG
stream (`rng.py`). The run directory itself (lock, naming, log truncation) is `run_dir.py`'s.

Every checkpoint carries the SHA-256 of the bytes torch.save wrote, in the zip archive's
comment (the archive's last bytes; torch and zipfile read it as an ordinary zip). torch
does not check the CRCs of tensor data, so without it a file damaged on disk or in a copy
would load and train on garbage. Keeping it inside the file keeps the write atomic (one
rename) and the checksum travels with every copy. Files without one (written before) load
unverified, with a warning.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from triton_transformer.training.config import Config, ModelConfig, config_from_dict
from triton_transformer.training.distributed import DistInfo, all_gather_object, barrier
from triton_transformer.transformer import Transformer
from triton_transformer.utils import exists

__all__ = [
    "CHECKPOINT_NAME",
    "CHECKPOINT_VERSION",
    "METRICS_NAME",
    "SAMPLES_NAME",
    "CheckpointError",
    "Checkpointer",
    "UnverifiedCheckpointWarning",
    "atomic_save",
    "check_model_matches",
    "find_checkpoint",
    "load_checkpoint",
    "load_model",
    "unwrap_model",
]

CHECKPOINT_NAME = "checkpoint.pt"
METRICS_NAME = "metrics.jsonl"
SAMPLES_NAME = "samples.jsonl"
CHECKPOINT_VERSION = 1
# model fields that change the parameters' shapes: a checkpoint only loads into the same ones
SHAPE_FIELDS = ("num_tokens", "dim", "depth", "heads", "dim_head", "max_seq_len", "ff_mult")
# the block options: a checkpoint records them (its config) and is rebuilt with them; a
# checkpoint from before they existed has the classic block, the defaults
OPTION_FIELDS = ("pos_emb", "norm", "ff_act", "qk_norm", "rope_base", "kv_heads")


# The zip "end of central directory" record: 22 bytes, the last two the comment's length
_EOCD_SIG = b"PK\x05\x06"
_EOCD_LEN = 22
_CHECKSUM_PREFIX = b"triton-transformer sha256="
_CHECKSUM_LEN = len(_CHECKSUM_PREFIX) + 64  # + the hex digest


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, truncated, foreign, or of another model."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before checkpoints carried a checksum: loaded unverified."""


_warned_unverified: set[Path] = set()


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip torch.compile (`_orig_mod`) and DDP (`module`) wrappers, for state dicts."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


# --------------------------------------------------------------------------- reading


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory holding checkpoint.pt."""
    path = Path(path)
    if path.is_dir():
        if not (path / CHECKPOINT_NAME).is_file() and (path / "config.toml").is_file():
            # a run that stopped before its first checkpoint: nothing to resume
            raise FileNotFoundError(
                f"no checkpoint at {path / CHECKPOINT_NAME}: that run stopped before its "
                f"first checkpoint; start it again without --resume (with --overwrite if "
                f"{path} holds its logs)"
            )
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path


def _hash_file(f, end: int) -> Any:
    """SHA-256 of bytes [0, end) of the open binary file f."""
    digest = hashlib.sha256()
    f.seek(0)
    left = end
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest


def _verify_checksum(path: Path) -> bool:
    """True if `path` carries a checksum and it matches; False if it carries none (older
    checkpoints); CheckpointError if it does not match."""
    size = path.stat().st_size
    tail_len = _EOCD_LEN + _CHECKSUM_LEN
    if size < tail_len:
        return False
    with path.open("rb") as f:
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        comment = tail[_EOCD_LEN:]
        comment_len = int.from_bytes(tail[_EOCD_LEN - 2 : _EOCD_LEN], "little")
        if not (
            tail[:4] == _EOCD_SIG
            and comment_len == _CHECKSUM_LEN
            and comment.startswith(_CHECKSUM_PREFIX)
        ):
            return False
        # the digest covers what torch.save wrote: the file without the comment, whose
        # length field was 0 then
        digest = _hash_file(f, size - _CHECKSUM_LEN - 2)
        digest.update(b"\0\0")
    if digest.hexdigest().encode() != comment[len(_CHECKSUM_PREFIX) :]:
        raise CheckpointError(
            f"{path} is damaged: its bytes do not match the SHA-256 checksum saved with it "
            "(a disk or copy error?), so it is not loaded. A run keeps only its latest "
            "checkpoint: restore this file from a copy, or start the run over (the same "
            "command with --overwrite, or another --run-dir)"
        )
    return True


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict:
    """Load a checkpoint dict (safe `weights_only` unpickling). mmap=True reads tensors
    lazily: cheap when only the config or step is needed."""
    path = find_checkpoint(path)
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (a crash while it was copied?); no checkpoint")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # torch.save writes a zip archive
        raise CheckpointError(
            f"{path} is not a checkpoint written by train.py (not a PyTorch archive); pass "
            "a run directory or its checkpoint.pt"
        )
    verified = _verify_checksum(path)  # before unpickling: never train on damaged bytes
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        # torch's first sentence ("PytorchStreamReader failed reading zip archive: ...")
        first = str(e).strip().split(". ")[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path} is not a readable checkpoint: truncated or damaged ({first}); resume "
            "from an earlier copy or start a new run"
        ) from e
    if not isinstance(ckpt, dict) or not {"model", "config", "step"} <= set(ckpt):
        raise CheckpointError(
            f"{path} is not a triton-transformer checkpoint (got a {type(ckpt).__name__} "
            "without model/config/step)"
        )
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint version {ckpt.get('version')!r}")
    if not verified and path.resolve() not in _warned_unverified:
        # once per file and process: train.py --resume reads it twice (config, then state),
        # and the warnings module forgets what it showed whenever a filter changes
        _warned_unverified.add(path.resolve())
        warnings.warn(
            f"{path} carries no checksum (written before checkpoints had one): loaded unverified",
            UnverifiedCheckpointWarning,
            stacklevel=2,
        )
    return ckpt


def check_model_matches(ckpt: dict, model: ModelConfig, source: str | Path) -> None:
    """Raise CheckpointError naming every model field whose value differs from the
    checkpoint's in a way that changes parameter shapes or the block (its options)."""
    saved = {
        **{f: getattr(ModelConfig, f) for f in OPTION_FIELDS},
        **ckpt["config"].get("model", {}),
    }
    diffs = [
        f"model.{name}={getattr(model, name)} (checkpoint: {saved[name]})"
        for name in (*SHAPE_FIELDS, *OPTION_FIELDS)
        if name in saved and saved[name] != getattr(model, name)
    ]
    if diffs:
        raise CheckpointError(
            f"{source} holds another model: {', '.join(diffs)}. A resumed run keeps "
            "its model: drop those overrides, or start a new run"
        )


def load_model(
    path: str | Path, device: str | torch.device = "cpu", use_triton: bool | None = None
) -> tuple[Transformer, Config]:
    """Rebuild the trained Transformer from a checkpoint (eval mode) and its Config: its
    shape and block options (pos_emb, norm, ff_act, qk_norm, rope_base) as recorded.
    `tokenizer.run_tokenizer` gives the tokenizer it was trained with."""
    ckpt = load_checkpoint(path)
    try:
        config = config_from_dict(ckpt["config"])
    except ValueError as e:
        raise CheckpointError(f"{path}: its config is not valid: {e}") from e
    kwargs = config.model.transformer_kwargs()
    if not kwargs["num_tokens"]:  # "the tokenizer's": the number the run used
        from triton_transformer.training.tokenizer import run_tokenizer

        kwargs["num_tokens"] = (
            ckpt.get("num_tokens") or run_tokenizer(ckpt, find_checkpoint(path).parent).vocab_size
        )
    if exists(use_triton):
        kwargs["use_triton"] = use_triton
    model = Transformer(**kwargs)
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), config


# --------------------------------------------------------------------------- writing


def _append_checksum(f) -> None:
    """Store the SHA-256 of the archive torch.save just wrote to f as its zip comment."""
    size = f.seek(0, os.SEEK_END)
    f.seek(size - _EOCD_LEN)
    eocd = f.read(_EOCD_LEN)
    if eocd[:4] != _EOCD_SIG or eocd[-2:] != b"\0\0":
        # not the archive layout torch writes (a future format?): save it without one
        # rather than write a comment that would corrupt it
        return
    digest = _hash_file(f, size).hexdigest().encode()
    f.seek(size - 2)
    f.write(_CHECKSUM_LEN.to_bytes(2, "little") + _CHECKSUM_PREFIX + digest)


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file in the same directory with its checksum, fsync, then
    os.replace: a crash mid-write never leaves a truncated checkpoint behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w+b") as f:
            torch.save(obj, f)
            f.flush()
            _append_checksum(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class Checkpointer:
    """Writes one run's checkpoint.pt and remembers the step of the last one written."""

    def __init__(self, run_dir: Path, dist: DistInfo) -> None:
        self.path = run_dir / CHECKPOINT_NAME
        self.dist = dist
        self.last_step: int | None = None  # None: none written (or loaded) by this run yet

    def save(self, state: Callable[[], dict], rng: dict, step: int) -> Path:
        """Atomically write `state()` with `rng`, this rank's RNG states. With several ranks
        every rank must call it: rank 0 gathers all ranks' RNG states and writes the file;
        the others wait until it is on disk (nobody runs ahead of, or reads, a checkpoint
        that is still being written)."""
        states = all_gather_object(rng)
        if self.dist.is_main:
            full = state()  # built on rank 0 only: the others never write it
            full["rng"] = states[0]
            if self.dist.enabled:
                full["rng_ranks"] = states  # rank r resumes from states[r]
            atomic_save(full, self.path)
        barrier()
        self.last_step = step
        return self.path

    def kept_note(self) -> str:
        """What a run that stops now without saving leaves, for its error message."""
        if self.last_step is None:
            return "no checkpoint was written yet"
        return f"the last good checkpoint ({self.path}, step {self.last_step}) is kept"
