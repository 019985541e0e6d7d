"""What a run needs before its first step: the device, the precision, the Triton check, the
corpus, its tokenizer and tokens, and the model (wrapped for compile and DDP). Each is a
plain function of the config sections it reads (and, under torchrun, of the rank)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch import nn

from triton_transformer.autoregressive_wrapper import AutoregressiveWrapper
from triton_transformer.cuda_graph import capture_stream
from triton_transformer.training.config import (
    ConfigError,
    DataConfig,
    EvalConfig,
    ModelConfig,
    TrainConfig,
)
from triton_transformer.training.data import Corpus, FallbackCorpusWarning, load_corpus
from triton_transformer.training.distributed import (
    DistInfo,
    broadcast_object,
    env_info,
    main_process_first,
)
from triton_transformer.training.tokenizer import (
    BPETokenizer,
    Tokenizer,
    resolve_tokenizer,
    tokenize_corpus,
)
from triton_transformer.transformer import Transformer
from triton_transformer.utils import exists, interpreter_enabled

__all__ = [
    "autocast_context",
    "build_model",
    "check_corpus",
    "check_triton",
    "load_run_corpus",
    "prepare_tokens",
    "resolve_cuda_graph",
    "resolve_device",
    "resolve_num_tokens",
    "resolve_precision",
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


def check_triton(use_triton: bool, device: torch.device, is_main: bool) -> None:
    """model.use_triton on CPU needs the interpreter; warn that it is slow."""
    if not use_triton:
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


def load_run_corpus(d: DataConfig, dist: DistInfo) -> Corpus:
    """Rank 0 of each machine prepares the corpus (download, caches) before the others
    read it; only it reports a fallback."""
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


def token_cache_dir(d: DataConfig) -> Path:
    """Where tokenizers trained on a corpus and its token caches are kept: beside the data."""
    return Path(d.data_dir) / "tokens"


def prepare_tokens(
    d: DataConfig, corpus: Corpus, dist: DistInfo, *, saved: str | None = None
) -> tuple[Tokenizer, Corpus]:
    """The run's tokenizer and its corpus as token ids (train and valid splits).

    saved: the tokenizer.json text a resumed run's checkpoint holds (used instead of
    data.tokenizer). A "bpe" is trained by rank 0 first (the others then read its copy beside
    the data), and every rank uses rank 0's; each machine's rank 0 writes the token caches
    before the others read them. The byte tokenizer returns `corpus` unchanged.
    """
    progress = dist.local_rank == 0
    if saved is None and d.tokenizer == "bytes":
        return resolve_tokenizer("bytes", 0, corpus, token_cache_dir(d)), corpus
    with main_process_first(local=False):
        if saved is not None:
            tokenizer: Tokenizer = BPETokenizer.from_str(saved, "the checkpoint's tokenizer")
        else:
            tokenizer = resolve_tokenizer(
                d.tokenizer, d.vocab_size, corpus, token_cache_dir(d), progress=progress
            )
    if dist.enabled:  # a BPE trained on another machine may differ: rank 0's is the one
        text = broadcast_object(tokenizer.to_json())
        if text != tokenizer.to_json():
            tokenizer = BPETokenizer.from_str(text, "rank 0's tokenizer")
    with main_process_first():
        tokens = tokenize_corpus(corpus, tokenizer, token_cache_dir(d), progress=progress)
    return tokenizer, tokens


def resolve_num_tokens(m: ModelConfig, tokenizer: Tokenizer) -> int:
    """model.num_tokens, or the tokenizer's vocabulary when it is 0; ConfigError when it is
    smaller than the tokenizer's."""
    if m.num_tokens == 0:
        return tokenizer.vocab_size
    if m.num_tokens < tokenizer.vocab_size:
        raise ConfigError(
            f"model.num_tokens={m.num_tokens} is smaller than the {tokenizer.describe()}; "
            "set model.num_tokens=0 to follow the tokenizer (or a larger size)"
        )
    return m.num_tokens


def check_corpus(corpus: Corpus, t: TrainConfig, e: EvalConfig) -> None:
    """Every split the run reads holds at least one window."""
    need = {"train": t.seq_len + 2}
    if e.eval_every:
        need["valid"] = t.seq_len + 1
    if e.generate_every:
        need["valid"] = max(need.get("valid", 0), e.prime_len + 1)
    for split, n in need.items():
        have = len(getattr(corpus, split))
        if have < n:
            raise ConfigError(
                f"the {split} split of corpus '{corpus.name}' has {have} tokens, too few "
                f"for train.seq_len={t.seq_len} / eval.prime_len={e.prime_len}"
            )


def resolve_cuda_graph(t: TrainConfig, device: torch.device, distributed: bool) -> tuple[bool, str]:
    """Whether steps run as CUDA graph replays (train.cuda_graph), and a note saying why."""
    if t.cuda_graph.lower() in ("false", "0", "no", "off"):
        return False, "off (train.cuda_graph=false)"
    if device.type != "cuda":
        return False, f"off (CUDA graphs need a CUDA device, this run is on {device})"
    if distributed and t.compile:
        # Dynamo's DDPOptimizer splits the compiled graph at bucket boundaries and runs the
        # all-reduces from Python hooks between the pieces; capturing that whole is not a
        # combination PyTorch supports, so these steps stay eager
        return False, "off (DDP with torch.compile: steps run eagerly)"
    if distributed:
        # the NCCL all-reduces are captured with the rest of the step (DDP needs 11 eager
        # steps first, see the trainer); 2 x H200, torch 2.11: 97% scaling, and the runs
        # exit cleanly since the graph is released before the process group
        return True, "on, DDP all-reduces captured"
    return True, "on"


def build_model(
    m: ModelConfig, *, compile: bool, device: torch.device, dist: DistInfo, cuda_graph: bool
) -> tuple[Transformer, AutoregressiveWrapper, nn.Module]:
    """(the Transformer, its AutoregressiveWrapper, the module a training step calls: the
    wrapper, in DDP with several ranks). Draws the initial weights from torch's generator,
    so every rank builds the same ones (DDP also broadcasts rank 0's at wrap time)."""
    model = Transformer(**m.transformer_kwargs()).to(device)
    model.check_token_ids = False  # ids are < the tokenizer's vocab <= num_tokens: no sync
    wrapper = AutoregressiveWrapper(model)
    if compile:
        # compile the inner module in place, then wrap it in DDP: the order PyTorch documents
        # ("Where to apply torch.compile?"); DDP's hooks stay outside the graph and Dynamo
        # splits the graph at DDP's bucket boundaries (DDPOptimizer)
        wrapper.compile()
    if not dist.enabled:
        return model, wrapper, wrapper
    # a graph-captured DDP step needs DDP built on the capture stream
    stream = capture_stream(device) if cuda_graph else None
    with torch.cuda.stream(stream) if exists(stream) else contextlib.nullcontext():
        ddp = nn.parallel.DistributedDataParallel(
            wrapper, device_ids=[device] if device.type == "cuda" else None
        )
    if exists(stream):
        torch.cuda.current_stream(device).wait_stream(stream)
    return model, wrapper, ddp
