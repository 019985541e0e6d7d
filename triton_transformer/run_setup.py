"""What a run needs before its first step: the device, the precision, the Triton check, seeds
and the corpus. Each is a plain function of the config (and, under torchrun, of the rank)."""

from __future__ import annotations

import contextlib
import random
import warnings

import numpy as np
import torch

from triton_transformer.config import Config, ConfigError
from triton_transformer.data import Corpus, FallbackCorpusWarning, load_corpus
from triton_transformer.distributed import DistInfo, env_info, main_process_first
from triton_transformer.utils import exists, interpreter_enabled

__all__ = [
    "autocast_context",
    "check_corpus",
    "check_triton",
    "load_run_corpus",
    "resolve_device",
    "resolve_precision",
    "seed_everything",
]


def resolve_device(name: str) -> torch.device:
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


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    on_gpu = device.type == "cuda"
    if precision == "bf16" and not on_gpu:
        raise ConfigError(
            f"train.precision='bf16' needs a CUDA device, but training runs on {device}"
        )
    if precision == "bf16" or (precision == "auto" and on_gpu and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return None


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device`, or nothing for fp32."""
    if exists(dtype):
        return torch.autocast(device_type=device.type, dtype=dtype)
    return contextlib.nullcontext()


def check_triton(config: Config, device: torch.device, is_main: bool) -> None:
    """model.use_triton on CPU needs the interpreter; warn that it is slow."""
    if not config.model.use_triton:
        return
    if device.type == "cpu" and not interpreter_enabled():
        raise ConfigError(
            "model.use_triton=true on CPU needs Triton's CPU interpreter: set "
            "TRITON_INTERPRET=1 before importing triton_transformer (train.py does this "
            "when there is no GPU), or drop --use-triton to train with PyTorch ops"
        )
    if interpreter_enabled() and is_main:
        warnings.warn(
            "model.use_triton with TRITON_INTERPRET=1: the Triton kernels run in "
            "Triton's CPU interpreter, which is very slow; this is for checking, not "
            "training. Drop --use-triton to train with PyTorch ops.",
            stacklevel=4,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every CUDA device


def load_run_corpus(config: Config, dist: DistInfo) -> Corpus:
    """Rank 0 of each machine prepares the corpus (download, caches) before the others
    read it; only it reports a fallback."""
    d = config.data
    with main_process_first(), warnings.catch_warnings():
        if dist.local_rank != 0:
            warnings.simplefilter("ignore", FallbackCorpusWarning)
        return load_corpus(
            d.source,
            data_dir=d.data_dir,
            download=d.download,
            fallback=d.fallback,
            progress=dist.local_rank == 0,
        )


def check_corpus(config: Config, corpus: Corpus) -> None:
    """Every split the run reads holds at least one window."""
    t, e = config.train, config.eval
    need = {"train": t.seq_len + 2}
    if e.eval_every:
        need["valid"] = t.seq_len + 1
    if e.generate_every:
        need["valid"] = max(need.get("valid", 0), e.prime_len + 1)
    for split, n in need.items():
        have = len(getattr(corpus, split))
        if have < n:
            raise ConfigError(
                f"the {split} split of corpus '{corpus.name}' has {have} bytes, too few "
                f"for train.seq_len={t.seq_len} / eval.prime_len={e.prime_len}"
            )
