"""Tokenizers: raw bytes (the default) or a byte-level BPE, and the tokens of a corpus cached
on disk.

`data.tokenizer` in the config picks one:
    "bytes"            every byte is a token (vocabulary 256): today's model, no cache, no file
    "bpe"              a byte-level BPE (GPT-2 style) trained with Hugging Face `tokenizers`
                       on the training split, `data.vocab_size` tokens; trained once per
                       corpus and size, kept beside the data (data_dir/tokens/)
    "path/tok.json"    a byte-level BPE saved by `tokenizers` (GPT-2's, Llama 3's, ...)

Every tokenizer maps any bytes to ids and back exactly (`decode(encode(b)) == b`), invalid
UTF-8 included: the text is decoded with `surrogateescape`, the valid runs go through the
BPE and every undecodable byte becomes its single-byte token (a byte-level BPE has all 256).
Decoding looks up each id's bytes, so it never loses a byte to UTF-8 repair either.

A corpus split is tokenized once (`cached_tokens`) into a file of uint16 (vocabulary <=
65536) or uint32 ids behind a 4 KiB header that records the corpus's identity (path, size,
mtime and byte range, or a content hash for arrays in memory), the tokenizer's fingerprint,
the dtype and the token count. The file is written to a temporary name and renamed, and is
memory-mapped afterwards (training reads windows from it, never the whole file). A cache
whose header does not match (another corpus state, another tokenizer) or whose size does not
match its count (truncated) is rebuilt, with a `TokenCacheWarning` saying why, never read.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from triton_transformer.training.data import Corpus, atomic_write, decode_tokens

__all__ = [
    "BYTE_VOCAB",
    "TOKENIZER_NAME",
    "BPETokenizer",
    "ByteTokenizer",
    "TokenCacheWarning",
    "Tokenizer",
    "bits_per_byte",
    "cached_tokens",
    "corpus_key",
    "import_tokenizers",
    "load_tokenizer",
    "read_cache_header",
    "resolve_tokenizer",
    "run_tokenizer",
    "split_tokens",
    "tokenize_corpus",
    "train_bpe",
    "write_text_atomic",
]

BYTE_VOCAB = 256
TOKENIZER_NAME = "tokenizer.json"  # the copy a run directory keeps
CACHE_MAGIC = b"TTTOKENS"
CACHE_FORMAT = 1
CACHE_HEADER = 4096  # bytes before the ids (page-aligned memmap offset)
_BLOCK = 4 << 20  # bytes of corpus read per block when tokenizing
_CHUNK = 1 << 16  # characters per piece handed to the BPE in one batch
_ESCAPED = re.compile("([\udc80-\udcff]+)")  # undecodable bytes under surrogateescape


class TokenCacheWarning(UserWarning):
    """A token cache was stale, truncated or another tokenizer's, and is being rebuilt."""


def import_tokenizers() -> Any:
    """The Hugging Face `tokenizers` package, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("tokenizers")
    except ImportError as e:
        raise ImportError(
            "data.tokenizer='bpe' (or a tokenizer.json) needs the `tokenizers` package: "
            "pip install tokenizers  (or pip install 'triton-transformer[bpe]')"
        ) from e


def _as_bytes(data: bytes | bytearray | memoryview | np.ndarray | Sequence[int]) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"bytes must lie in [0, 255], got [{arr.min()}, {arr.max()}]")
        arr = arr.astype(np.uint8)
    return arr.tobytes()


def _as_ids(ids: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class Tokenizer:
    """bytes <-> token ids, exact both ways. Subclasses set `kind`, `vocab_size` and
    `fingerprint` (a hex digest that changes whenever the mapping does)."""

    kind: str
    vocab_size: int
    fingerprint: str

    def encode(self, data: bytes | np.ndarray | Sequence[int]) -> np.ndarray:
        """Bytes -> ids, (n,) int64."""
        raise NotImplementedError

    def decode(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> bytes:
        """Ids -> the exact bytes they stand for (ValueError for an id outside the vocab)."""
        raise NotImplementedError

    def text(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> str:
        """Ids -> text to show: UTF-8 with bad bytes, control characters and ids outside the
        vocabulary (a model's vocabulary may be padded past the tokenizer's) as U+FFFD."""
        arr = _as_ids(ids)
        bad = (arr < 0) | (arr >= self.vocab_size)
        if not bad.any():
            return decode_tokens(self.decode(arr))
        parts, start = [], 0
        for i in np.flatnonzero(bad).tolist():
            parts += [self.decode(arr[start:i]), "\ufffd".encode()]
            start = i + 1
        parts.append(self.decode(arr[start:]))
        return decode_tokens(b"".join(parts))

    def token_bytes(self) -> np.ndarray:
        """The byte length of every id, (vocab_size,) int64 (for bits per byte)."""
        raise NotImplementedError

    def to_json(self) -> str | None:
        """The tokenizer.json text to save with a run (None: nothing to save)."""
        return None

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id: uint16 up to 65536 ids."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def describe(self) -> str:
        return f"{self.kind} tokenizer ({self.vocab_size:,} tokens)"


class ByteTokenizer(Tokenizer):
    """Every byte is its own token: vocabulary 256 (the project's original model)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    fingerprint = "bytes"

    def encode(self, data: bytes | np.ndarray | Sequence[int]) -> np.ndarray:
        return np.frombuffer(_as_bytes(data), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> bytes:
        arr = _as_ids(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte tokens must lie in [0, 255], got [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes()

    def token_bytes(self) -> np.ndarray:
        return np.ones(BYTE_VOCAB, dtype=np.int64)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_CHAR = _bytes_to_unicode()
_CHAR_BYTE = {c: b for b, c in _BYTE_CHAR.items()}
_PROBE = "Hello, wörld! 日本語 \t\n  x = 1  # 🙂\r\n\n\n"  # what a round trip must survive


class BPETokenizer(Tokenizer):
    """A byte-level BPE of the Hugging Face `tokenizers` library.

    Refuses (ValueError) a tokenizer.json that is not byte-level (a token whose characters
    are not GPT-2's byte alphabet, a missing single-byte token) or that does not give back
    the bytes it was given (a normalizer, a prefix space).
    """

    kind = "bpe"

    def __init__(self, tok: Any, source: str = "tokenizer") -> None:
        self._tok = tok
        self.source = source
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        text = tok.to_str()
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        table: list[bytes] = []
        for i in range(self.vocab_size):
            if i in added:
                table.append(added[i].encode("utf-8"))
                continue
            piece = tok.id_to_token(i)
            if piece is None or any(c not in _CHAR_BYTE for c in piece):
                raise ValueError(
                    f"{source}: token {i} ({piece!r}) is not made of byte-level characters: "
                    "only byte-level BPE tokenizers (GPT-2 style) are supported"
                )
            table.append(bytes(_CHAR_BYTE[c] for c in piece))
        self._table = table
        byte_ids = [tok.token_to_id(_BYTE_CHAR[b]) for b in range(256)]
        if any(i is None for i in byte_ids):
            missing = sum(i is None for i in byte_ids)
            raise ValueError(
                f"{source}: {missing} of the 256 single-byte tokens are missing, so some "
                "bytes could not be encoded: only byte-level BPE tokenizers are supported"
            )
        self._byte_ids = np.array(byte_ids, dtype=np.int64)
        self._lengths = np.array([len(b) for b in table], dtype=np.int64)
        probe = _PROBE.encode("utf-8") + b"\xff\xc3"
        if self.decode(self.encode(probe)) != probe:
            raise ValueError(
                f"{source}: the tokenizer does not give back the bytes it encodes (a "
                "normalizer or an added prefix space?); use one without them"
            )

    @classmethod
    def from_str(cls, text: str, source: str = "tokenizer") -> BPETokenizer:
        """From tokenizer.json text."""
        tk = import_tokenizers()
        try:
            tok = tk.Tokenizer.from_str(text)
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise ValueError(f"{source} is not a valid tokenizer.json ({first})") from None
        return cls(tok, source)

    def encode(self, data: bytes | np.ndarray | Sequence[int]) -> np.ndarray:
        return self._encode_text(_as_bytes(data).decode("utf-8", "surrogateescape"))

    def _encode_text(self, text: str) -> np.ndarray:
        """Ids of a surrogate-escaped text: valid runs through the BPE (in pieces cut after
        newlines, encoded in parallel), escaped bytes as their single-byte tokens."""
        parts = _ESCAPED.split(text)  # valid, escaped, valid, escaped, ..., valid
        pieces: list[str] = []
        where: list[int] = []  # index in `out` of each piece's ids
        out: list[np.ndarray] = []
        for k, part in enumerate(parts):
            if not part:
                continue
            if k % 2:  # escaped bytes U+DC80..U+DCFF
                raw = np.frombuffer(part.encode("utf-16-le", "surrogatepass"), np.uint16)
                out.append(self._byte_ids[raw.astype(np.int64) - 0xDC00])
                continue
            for piece in _pieces(part):
                where.append(len(out))
                out.append(np.empty(0, np.int64))
                pieces.append(piece)
        if pieces:
            encodings = self._tok.encode_batch_fast(pieces, add_special_tokens=False)
            for i, enc in zip(where, encodings, strict=True):
                out[i] = np.asarray(enc.ids, dtype=np.int64)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def decode(self, ids: torch.Tensor | np.ndarray | Sequence[int]) -> bytes:
        arr = _as_ids(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}), got [{arr.min()}, {arr.max()}]"
            )
        table = self._table
        return b"".join([table[i] for i in arr.tolist()])

    def token_bytes(self) -> np.ndarray:
        return self._lengths.copy()

    def to_json(self) -> str:
        return self._tok.to_str()


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about _CHUNK characters, each cut after a newline when one is near."""
    pos = 0
    while pos < len(text):
        end = text.find("\n", pos + _CHUNK)
        end = len(text) if end < 0 or end > pos + 4 * _CHUNK else end + 1
        yield text[pos:end]
        pos = end


def _blocks(data: np.ndarray, size: int = _BLOCK) -> Iterator[bytes]:
    """`data` (uint8) in blocks of about `size` bytes, each ending after a newline when the
    block holds one (a UTF-8 character cut at a block end still round-trips: its bytes are
    escaped and become byte tokens)."""
    pos, n = 0, len(data)
    while pos < n:
        block = bytes(data[pos : pos + size])
        if pos + len(block) < n:
            cut = block.rfind(b"\n")
            if cut >= 0:
                block = block[: cut + 1]
        yield block
        pos += len(block)


def train_bpe(data: np.ndarray, vocab_size: int, *, progress: bool = True) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes included) trained on `data`
    (uint8). Undecodable bytes are left out of the training text; they still encode, as
    single-byte tokens."""
    if vocab_size < BYTE_VOCAB:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 256, got {vocab_size}")
    tk = import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=progress and sys.stderr.isatty(),  # else it prints empty lines
    )

    def texts() -> Iterator[str]:
        for block in _blocks(data):
            text = block.decode("utf-8", "surrogateescape")
            for k, part in enumerate(_ESCAPED.split(text)):
                if not k % 2:
                    yield from _pieces(part)

    tok.train_from_iterator(texts(), trainer=trainer)
    return BPETokenizer(tok, f"BPE trained on {len(data):,} bytes")


def load_tokenizer(path: str | Path) -> BPETokenizer:
    """A byte-level BPE from a tokenizer.json file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(path)!r} not found; data.tokenizer must be 'bytes', 'bpe' "
            "or the path of a tokenizer.json"
        )
    return BPETokenizer.from_str(path.read_text(encoding="utf-8"), str(path))


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    """Total loss in nats over a text of `n_bytes` UTF-8 bytes -> bits per byte (comparable
    across tokenizers: the same text costs the same bytes whatever its tokens)."""
    return total_nats / math.log(2) / max(n_bytes, 1)


# --------------------------------------------------------------------------- token cache


def read_cache_header(path: Path) -> dict | None:
    """The JSON header of a token cache file, or None if it is not one."""
    try:
        with path.open("rb") as f:
            head = f.read(CACHE_HEADER)
    except OSError:
        return None
    if len(head) < CACHE_HEADER or not head.startswith(CACHE_MAGIC):
        return None
    length = int.from_bytes(head[8:12], "little")
    try:
        header = json.loads(head[12 : 12 + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return header if isinstance(header, dict) else None


def _stale_reason(path: Path, corpus_key: str, tokenizer: Tokenizer) -> str | None:
    """Why the cache at `path` cannot be read for (corpus_key, tokenizer); None if it can."""
    header = read_cache_header(path)
    if header is None or header.get("format") != CACHE_FORMAT:
        return "it is not a token cache of this format"
    if header.get("tokenizer") != tokenizer.fingerprint:
        return (
            f"it belongs to another tokenizer ({header.get('tokenizer')}, this run's is "
            f"{tokenizer.fingerprint})"
        )
    if header.get("corpus") != corpus_key:
        return "it is stale: the corpus changed since it was written"
    try:
        itemsize = np.dtype(header["dtype"]).itemsize
        count = int(header["count"])
    except (KeyError, TypeError, ValueError):
        return "its header is damaged"
    size = path.stat().st_size
    if size != CACHE_HEADER + count * itemsize:
        return (
            f"it is truncated ({size:,} bytes, its header says {CACHE_HEADER + count * itemsize:,})"
        )
    return None


def cached_tokens(
    tokenizer: Tokenizer,
    data: np.ndarray,
    path: Path,
    *,
    corpus_key: str,
    progress: bool = True,
    desc: str = "tokenizing",
) -> np.ndarray:
    """The ids of `data` (uint8 bytes) as a read-only memmap of `tokenizer.dtype`, from the
    cache file `path`: built (atomically, with a progress bar) when it is missing, rebuilt
    with a `TokenCacheWarning` when it is stale, truncated or another tokenizer's."""
    path = Path(path)
    if path.is_file():
        reason = _stale_reason(path, corpus_key, tokenizer)
        if reason is None:
            return _open_cache(path)
        warnings.warn(
            f"token cache {path}: {reason}; rebuilding it", TokenCacheWarning, stacklevel=2
        )
    _build_cache(tokenizer, data, path, corpus_key, progress, desc)
    return _open_cache(path)


def _open_cache(path: Path) -> np.ndarray:
    header = read_cache_header(path)
    assert header is not None
    count = int(header["count"])
    if count == 0:
        return np.zeros(0, dtype=header["dtype"])
    return np.memmap(path, dtype=header["dtype"], mode="r", offset=CACHE_HEADER, shape=(count,))


def _header_bytes(header: dict) -> bytes:
    body = json.dumps(header, sort_keys=True).encode()
    if 12 + len(body) > CACHE_HEADER:
        raise ValueError("token cache header too long")  # a corpus key of ~4 KB: never
    head = CACHE_MAGIC + len(body).to_bytes(4, "little") + body
    return head + b" " * (CACHE_HEADER - len(head))


def _build_cache(
    tokenizer: Tokenizer, data: np.ndarray, path: Path, corpus_key: str, progress: bool, desc: str
) -> None:
    dtype = tokenizer.dtype
    header = {
        "format": CACHE_FORMAT,
        "corpus": corpus_key,
        "tokenizer": tokenizer.fingerprint,
        "tokenizer_kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "count": 0,
        "bytes": len(data),
    }
    with atomic_write(path, mode="w+b") as f:
        f.write(_header_bytes(header))
        count = 0
        with tqdm(
            total=len(data), unit="B", unit_scale=True, desc=desc, disable=not progress
        ) as bar:
            for block in _blocks(data):
                ids = tokenizer.encode(block)
                f.write(ids.astype(dtype).tobytes())
                count += len(ids)
                bar.update(len(block))
        header["count"] = count
        f.seek(0)
        f.write(_header_bytes(header))


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temp file and a rename."""
    with atomic_write(Path(path)) as f:
        f.write(text.encode("utf-8"))


# --------------------------------------------------------------------------- corpora


def corpus_key(corpus: Corpus, split: str) -> str:
    """The identity of one split of `corpus`: its file's path, size and mtime and its byte
    range, or (a corpus held in memory) a hash of its bytes."""
    origin = corpus.origins.get(split)
    if origin is not None:
        path, start, end = origin
        st = os.stat(path)
        return f"file:{path}|size={st.st_size}|mtime_ns={st.st_mtime_ns}|bytes={start}:{end}"
    data = np.ascontiguousarray(getattr(corpus, split))
    digest = hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()
    return f"content:blake2b={digest}|bytes={len(data)}"


def _cache_stem(corpus: Corpus) -> str:
    """The start of a corpus's cache file names: its name and a hash of where it lives."""
    origin = corpus.origins.get("train")
    where = origin[0] if origin is not None else "memory"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", corpus.name)[-60:] or "corpus"
    return f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


def resolve_tokenizer(
    spec: str, vocab_size: int, corpus: Corpus, cache_dir: Path, *, progress: bool = True
) -> Tokenizer:
    """The tokenizer that `data.tokenizer = spec` names for `corpus`. A "bpe" is trained on
    the training split once and kept in `cache_dir` (keyed by the split and the size)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec != "bpe":
        return load_tokenizer(spec)
    key = f"{corpus_key(corpus, 'train')}|bpe|vocab_size={vocab_size}|v1"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"{_cache_stem(corpus)}.bpe{vocab_size}.{digest}.tokenizer.json"
    if path.is_file():
        try:
            return load_tokenizer(path)
        except (ValueError, OSError, UnicodeDecodeError) as e:
            warnings.warn(f"{path} is unusable ({e}); training it again", stacklevel=2)
    tokenizer = train_bpe(corpus.train, vocab_size, progress=progress)
    if tokenizer.vocab_size < vocab_size:
        warnings.warn(
            f"the training split of {corpus.name} has pairs for only "
            f"{tokenizer.vocab_size - BYTE_VOCAB:,} merges: the BPE has {tokenizer.vocab_size:,} "
            f"tokens, not data.vocab_size={vocab_size:,}",
            stacklevel=2,
        )
    write_text_atomic(path, tokenizer.to_json())
    tokenizer.source = str(path)
    return tokenizer


def split_tokens(
    corpus: Corpus, split: str, tokenizer: Tokenizer, cache_dir: Path, *, progress: bool = True
) -> np.ndarray:
    """The ids of one split: the bytes themselves for the byte tokenizer, else a memmap of
    the split's token cache in `cache_dir` (built once, see `cached_tokens`)."""
    data = getattr(corpus, split)
    if data is None:
        raise ValueError(f"corpus {corpus.name} has no {split} split")
    if tokenizer.kind == "bytes":
        return data
    path = Path(cache_dir) / f"{_cache_stem(corpus)}.{split}.{tokenizer.fingerprint}.tokens"
    return cached_tokens(
        tokenizer,
        data,
        path,
        corpus_key=corpus_key(corpus, split),
        progress=progress,
        desc=f"tokenizing {split}",
    )


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: Tokenizer,
    cache_dir: Path,
    *,
    splits: Sequence[str] = ("train", "valid"),
    progress: bool = True,
) -> Corpus:
    """`corpus` with its `splits` as token ids (the others None; the test split is read by
    `train.py eval --split test` only). The byte tokenizer returns `corpus` itself."""
    if tokenizer.kind == "bytes":
        return corpus
    arrays = {
        s: split_tokens(corpus, s, tokenizer, cache_dir, progress=progress) if s in splits else None
        for s in ("train", "valid", "test")
    }
    sizes = " / ".join(f"{len(a):,}" for a in arrays.values() if a is not None)
    names = " / ".join(s for s, a in arrays.items() if a is not None)
    description = f"{corpus.description}; {tokenizer.describe()}: {names}: {sizes} tokens"
    empty = np.zeros(0, dtype=tokenizer.dtype)
    train = arrays["train"] if arrays["train"] is not None else empty
    valid = arrays["valid"] if arrays["valid"] is not None else empty
    return Corpus(corpus.name, train, valid, arrays["test"], description, corpus.origins)


def run_tokenizer(ckpt: dict, run_dir: Path) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the copy it holds, else the run
    directory's tokenizer.json, else (a byte-level run) the byte tokenizer."""
    text = ckpt.get("tokenizer")
    if isinstance(text, str) and text:
        return BPETokenizer.from_str(text, f"the tokenizer of {run_dir}")
    spec = ckpt.get("config", {}).get("data", {}).get("tokenizer", "bytes")
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(run_dir) / TOKENIZER_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"the run in {run_dir} was trained with data.tokenizer={spec!r} but neither its "
            f"checkpoint nor {path} holds that tokenizer"
        )
    return load_tokenizer(path)
