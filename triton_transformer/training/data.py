"""Byte-level corpora: enwik8, any local file, Hugging Face text datasets, or a built-in default.

A corpus is a flat uint8 array (memory-mapped from a raw file, never a Python list) cut into
train / valid / test splits. Training draws random windows (`random_batch`); evaluation scores
fixed windows of a split (`eval_window_starts`: all of them, or a budget spread evenly over
the split), so the loss and bits-per-byte do not depend on the batch size.

Sources (`load_corpus(source)`):
    "enwik8"             data/enwik8, data/enwik8.zip or data/enwik8.gz; downloaded when missing
    "stdlib"             the Python standard library's own source: every machine has it
    "hf:NAME[:CONFIG]"   the `text` column of a Hugging Face dataset (needs `datasets`)
    a file path          any local text or byte file

When enwik8 is absent and cannot be fetched, `load_corpus` falls back to "stdlib" with a loud
`FallbackCorpusWarning`, so training runs on a fresh machine with no network.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import importlib
import json
import logging
import os
import re
import socket
import sys
import sysconfig
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided, sliding_window_view
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
# SHA-256 of enwik8.zip as served at ENWIK8_URL (36,445,475 bytes), as recorded in the
# "download_checksums" of Hugging Face's enwik8 dataset (huggingface.co/datasets/LTCB/enwik8,
# dataset_infos.json). The zip's own CRC and the member's size accept a forged archive; this
# does not. It applies to the real enwik8 only (an `expected_size` of ENWIK8_SIZE).
ENWIK8_ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
ENWIK8_ZIP_SIZE = 36_445_475
# Fractions of the bytes in train / valid / test. On enwik8's 100M bytes this is exactly the
# standard 90M / 5M / 5M split; on a smaller file it is the same split, proportionally.
DEFAULT_SPLIT = (0.9, 0.05, 0.05)

_CHUNK = 1 << 20
# What reading a damaged archive raises (an OSError writing the cache, disk full, stays itself).
_CORRUPT_ARCHIVE = (
    gzip.BadGzipFile,
    zlib.error,
    EOFError,
    KeyError,
    zipfile.BadZipFile,
    ValueError,
)
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
# Our split name -> the names Hugging Face datasets use for it.
_HF_SPLITS = {
    "train": ("train",),
    "valid": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}


class DownloadError(RuntimeError):
    """enwik8 could not be downloaded (network failure, HTTP error, corrupt or truncated file)."""


class FallbackCorpusWarning(UserWarning):
    """Training falls back to the built-in stdlib corpus because enwik8 is unavailable."""


@dataclass
class Corpus:
    """A byte corpus: uint8 arrays (usually read-only memmaps) for each split.

    origins: where each memory-mapped split comes from, split -> (file, start, end) byte
    range: the corpus's identity for token caches (`tokenizer.py`), which a corpus held in
    memory (no origin) replaces by a hash of its content.
    """

    name: str
    train: np.ndarray = field(repr=False)
    valid: np.ndarray = field(repr=False)
    test: np.ndarray | None = field(repr=False)
    description: str
    origins: dict[str, tuple[str, int, int]] = field(default_factory=dict, repr=False)


# --------------------------------------------------------------------------------------------
# Loading


def load_corpus(
    source: str = "enwik8",
    data_dir: str | Path = "data",
    download: bool = True,
    fallback: bool = True,
    *,
    split: Sequence[float] = DEFAULT_SPLIT,
    enwik8_url: str = ENWIK8_URL,
    enwik8_size: int = ENWIK8_SIZE,
    timeout: float = 30.0,
    progress: bool = True,
) -> Corpus:
    """Load a byte corpus as memory-mapped uint8 splits.

    Args:
        source: "enwik8", "stdlib", "hf:NAME[:CONFIG]" or the path of a local file.
        data_dir: where enwik8 is looked for and downloaded, and where caches are written.
        download: for enwik8, fetch `enwik8_url` when no local copy exists.
        fallback: for enwik8, use the "stdlib" corpus (with a `FallbackCorpusWarning`) when it
            is absent and cannot be downloaded; if False, raise instead.
        split: fractions (train, valid, test) of the bytes, summing to 1; test may be 0 (then
            `Corpus.test` is None). Used for every source except Hugging Face datasets that
            have their own validation split.
        enwik8_size: the byte count that enwik8 must have (tests use small fakes).
    """
    data_dir = Path(data_dir)
    split = _check_split(split)
    if source == "enwik8":
        return _load_enwik8(
            data_dir, download, fallback, split, enwik8_url, enwik8_size, timeout, progress
        )
    if source == "stdlib":
        return _load_stdlib(data_dir, split)
    if source.startswith("hf:"):
        return _load_hf(source, data_dir, split)

    path = Path(source)
    if path.name in ("enwik8.zip", "enwik8.gz") and path.is_file():
        # `--data data/enwik8.zip`: the archive cannot be memory-mapped, decompress it as enwik8.
        return _load_enwik8(path.parent, False, False, split, enwik8_url, enwik8_size, 0, False)
    if path.is_dir():
        raise IsADirectoryError(
            f"corpus {source!r} is a directory; pass a file (--data path/to/file.txt), or "
            "'enwik8', 'stdlib' or 'hf:NAME[:CONFIG]'"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus file {source!r} not found; the source must be 'enwik8', 'stdlib', "
            "'hf:NAME[:CONFIG]' or the path of a local text/byte file"
        )
    if path.suffix in (".gz", ".zip", ".bz2", ".xz"):
        raise ValueError(f"corpus file {source!r} is compressed: decompress it first")
    return _make_corpus(path.name, _memmap(path), split, f"local file {path}")


def _load_enwik8(
    data_dir: Path,
    download: bool,
    fallback: bool,
    split: tuple[float, float, float],
    url: str,
    expected_size: int,
    timeout: float,
    progress: bool,
) -> Corpus:
    raw = _local_enwik8(data_dir, expected_size)
    if raw is None:
        if download:
            try:
                download_enwik8(data_dir, url, expected_size, timeout, progress)
            except DownloadError as e:
                if not fallback:
                    raise
                return _fallback(data_dir, split, str(e))
            raw = _local_enwik8(data_dir, expected_size)
        elif fallback:
            return _fallback(data_dir, split, f"no enwik8 in {data_dir}/ and download=False")
        else:
            raise FileNotFoundError(
                f"enwik8 not found in {data_dir}/ (looked for enwik8, enwik8.zip, enwik8.gz) and "
                "download is off; run `python train.py download`, place enwik8.zip in "
                f"{data_dir}/ or pass --data FILE"
            )
    return _make_corpus("enwik8", _memmap(raw), split, f"enwik8 from {raw}")


def _local_enwik8(data_dir: Path, expected_size: int) -> Path | None:
    """Path of the raw enwik8 in `data_dir`, decompressing enwik8.zip / enwik8.gz once if needed."""
    raw = data_dir / "enwik8"
    if raw.is_file():
        if raw.stat().st_size != expected_size:
            raise ValueError(
                f"{raw} holds {raw.stat().st_size:,} bytes but enwik8 has {expected_size:,}; "
                "delete it (it is re-made from enwik8.zip / enwik8.gz or re-downloaded)"
            )
        return raw
    for archive in (data_dir / "enwik8.zip", data_dir / "enwik8.gz"):
        if not archive.is_file():
            continue
        log.info("decompressing %s to %s", archive, raw)
        try:
            with _open_archive(archive) as src, atomic_write(raw) as dst:
                n = _copy(src, dst)
                if n != expected_size:
                    raise ValueError(f"it decompresses to {n:,} bytes, not {expected_size:,}")
        except _CORRUPT_ARCHIVE as e:
            raise ValueError(
                f"{archive} is not a valid enwik8 archive ({e}); delete it and download again"
            ) from e
        return raw
    return None


@contextlib.contextmanager
def _open_archive(archive: Path) -> Iterator:
    if archive.suffix == ".gz":
        with gzip.open(archive, "rb") as f:
            yield f
    else:
        with zipfile.ZipFile(archive) as zf, zf.open("enwik8") as f:
            yield f


def _fallback(data_dir: Path, split: tuple[float, float, float], reason: str) -> Corpus:
    corpus = _load_stdlib(data_dir, split)
    warnings.warn(
        f"\n{'!' * 78}\nENWIK8 IS NOT AVAILABLE ({reason}).\n"
        f"FALLING BACK TO THE BUILT-IN CORPUS: {corpus.description}.\n"
        "Losses and bits-per-byte are NOT comparable with enwik8 results. Fetch enwik8 with "
        f"`python train.py download`, or place enwik8.zip in {data_dir}/.\n{'!' * 78}",
        FallbackCorpusWarning,
        stacklevel=4,  # point at load_corpus's caller
    )
    corpus.description += f" [FALLBACK: enwik8 unavailable: {reason}]"
    return corpus


# --------------------------------------------------------------------------------------------
# Download


def download_enwik8(
    data_dir: str | Path = "data",
    url: str = ENWIK8_URL,
    expected_size: int = ENWIK8_SIZE,
    timeout: float = 30.0,
    progress: bool = True,
) -> Path:
    """Download the enwik8 zip archive to `data_dir/enwik8.zip` and return its path.

    The archive goes to a temporary file in `data_dir`, is checked (a readable zip whose
    `enwik8` member holds `expected_size` bytes with a correct CRC) and only then renamed into
    place, so an interrupted or corrupt download never leaves a file that looks valid.
    An already valid `enwik8.zip` is kept. Raises `DownloadError` with the reason on failure.
    """
    data_dir = Path(data_dir)
    dest = data_dir / "enwik8.zip"
    if dest.is_file():
        try:
            _check_enwik8_zip(dest, expected_size)
            return dest
        except ValueError as e:
            log.warning("%s is invalid (%s); downloading it again", dest, e)

    def error(reason: str) -> DownloadError:
        return DownloadError(
            f"could not download enwik8 from {url}: {reason}; "
            f"place enwik8.zip in {data_dir}/ or pass --data FILE"
        )

    try:
        verify = lambda tmp: _check_enwik8_zip(tmp, expected_size)
        with (
            atomic_write(dest, verify=verify) as f,
            urllib.request.urlopen(_request(url), timeout=timeout) as resp,
        ):
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="enwik8.zip",
                disable=not progress,
            ) as bar:
                n = _copy(resp, f, bar.update)
            if total is not None and n != total:
                raise ValueError(f"the connection closed after {n:,} of {total:,} bytes")
    except urllib.error.HTTPError as e:
        e.close()
        raise error(f"HTTP {e.code} {e.reason}") from e
    except urllib.error.URLError as e:
        raise error(str(e.reason)) from e
    except TimeoutError as e:
        raise error(f"no response within {timeout} s") from e
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise error(str(e) or type(e).__name__) from e
    log.info("downloaded %s", dest)
    return dest


def _request(url: str) -> urllib.request.Request:
    # Some servers refuse urllib's default "Python-urllib" User-Agent.
    return urllib.request.Request(url, headers={"User-Agent": "triton-transformer"})


def _check_enwik8_zip(path: Path, expected_size: int) -> None:
    """Raise ValueError unless `path` is a zip whose intact `enwik8` member has `expected_size`
    (and, for the real enwik8, unless the archive has the published SHA-256)."""
    if expected_size == ENWIK8_SIZE:
        _check_sha256(path, ENWIK8_ZIP_SHA256, ENWIK8_ZIP_SIZE)
    try:
        with zipfile.ZipFile(path) as zf:
            size = zf.getinfo("enwik8").file_size
            if size != expected_size:
                raise ValueError(
                    f"the archive's enwik8 member holds {size:,} bytes, expected {expected_size:,}"
                )
            if zf.testzip() is not None:  # reads every member and checks its CRC
                raise ValueError("the archive fails its CRC check")
    except KeyError as e:
        raise ValueError("the archive has no 'enwik8' member") from e
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as e:
        raise ValueError(f"not a valid zip archive, truncated or corrupt ({e})") from e


def _check_sha256(path: Path, expected: str, size: int) -> None:
    if path.stat().st_size != size:
        raise ValueError(
            f"the archive holds {path.stat().st_size:,} bytes, but the published enwik8.zip "
            f"has {size:,}"
        )
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"the archive's SHA-256 is {digest.hexdigest()}, not the published {expected}"
        )


# --------------------------------------------------------------------------------------------
# Built-in corpus: the Python standard library's source


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's `*.py` files, sorted by relative path, without tests/site-packages.

    Sorting by relative path (and skipping installed packages and test suites, which vary
    most between builds) keeps the corpus the same on machines with the same Python version.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _load_stdlib(data_dir: Path, split: tuple[float, float, float]) -> Corpus:
    v = sys.version_info
    cache = data_dir / f"stdlib-py{v.major}.{v.minor}.{v.micro}.bin"
    root = sysconfig.get_paths()["stdlib"]
    if not cache.is_file():
        files = stdlib_source_files(root)
        if not files:
            raise FileNotFoundError(f"no Python source files found under {root}")
        with atomic_write(cache) as dst:
            for path in files:
                with open(path, "rb") as src:
                    _copy(src, dst)
    description = (
        f"stdlib: the Python {v.major}.{v.minor} standard library's *.py source "
        f"({cache.stat().st_size:,} bytes from {root}, cached in {cache})"
    )
    return _make_corpus("stdlib", _memmap(cache), split, description)


# --------------------------------------------------------------------------------------------
# Hugging Face datasets


def _import_datasets():
    try:
        return importlib.import_module("datasets")
    except ImportError as e:
        raise ImportError(
            "Hugging Face sources ('hf:NAME[:CONFIG]') need the `datasets` package: "
            "pip install datasets  (or pip install 'triton-transformer[train]')"
        ) from e


def hf_texts_to_file(rows: Iterable, path: str | Path, column: str = "text") -> int:
    """Write the `column` strings of a dataset split to `path` as UTF-8, atomically.

    Each row becomes one line: a newline is added unless the text already ends with one
    (wikitext rows do, TinyStories rows do not). `rows` is a `datasets.Dataset` (read in
    batches) or any iterable of dicts. Returns the number of bytes written.
    """
    if column not in getattr(rows, "column_names", [column]):
        raise ValueError(f"the dataset has no {column!r} column (columns: {rows.column_names})")
    if hasattr(rows, "iter"):  # datasets.Dataset: batched reads are much faster than rows
        texts = (t for batch in rows.iter(batch_size=1024) for t in batch[column])
    else:
        texts = (_row_text(row, column) for row in rows)
    with atomic_write(Path(path)) as dst:
        n = 0
        for text in texts:
            data = text.encode("utf-8") if text.endswith("\n") else (text + "\n").encode("utf-8")
            dst.write(data)
            n += len(data)
    return n


def _row_text(row: dict, column: str) -> str:
    try:
        return row[column]
    except KeyError:
        raise ValueError(
            f"the dataset has no {column!r} column (columns: {', '.join(row)})"
        ) from None


def hf_hub_reachable(timeout: float = 2.0) -> str | None:
    """None if the Hugging Face hub (HF_ENDPOINT, default huggingface.co) answers a TCP
    connection within `timeout` seconds, else the reason. Without this, `load_dataset` on a
    machine without network retries for half a minute before failing."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urllib.parse.urlsplit(endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return None
    except OSError as e:
        return f"{parsed.hostname}:{port} unreachable: {e.strerror or e}"


def _hf_offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _hf_load_dataset(datasets, source: str, name: str, config: str):
    """`datasets.load_dataset`, failing within seconds (not after minutes of retries) when
    the hub cannot be reached and the dataset is not in the local Hugging Face cache."""
    reason = "HF_HUB_OFFLINE is set" if _hf_offline() else hf_hub_reachable()
    if reason is None:
        return datasets.load_dataset(name, config or None)
    # offline: only the local cache can serve it
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        return datasets.load_dataset(name, config or None)
    except Exception as e:
        raise ConnectionError(
            f"{source}: cannot download it ({reason}) and it is not in the local Hugging Face "
            "cache; connect to the network once, or pass a local file with --data FILE"
        ) from e


def _load_hf(source: str, data_dir: Path, split: tuple[float, float, float]) -> Corpus:
    name, _, config = source[3:].partition(":")
    if not name:
        raise ValueError(f"bad source {source!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG'")
    stem = "hf_" + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{name}_{config}" if config else name)
    manifest = data_dir / f"{stem}.json"
    if not manifest.is_file():
        datasets = _import_datasets()
        dataset = _hf_load_dataset(datasets, source, name, config)
        sizes = {}
        for ours, theirs in _HF_SPLITS.items():
            found = next((s for s in theirs if s in dataset), None)
            if found is not None:
                sizes[ours] = hf_texts_to_file(dataset[found], data_dir / f"{stem}.{ours}.bin")
        if "train" not in sizes:
            raise ValueError(f"{source}: the dataset has no 'train' split ({list(dataset)})")
        # Written last, atomically: its presence means every split file is complete.
        with atomic_write(manifest) as f:
            f.write(json.dumps({"source": source, "bytes": sizes}).encode())

    sizes = json.loads(manifest.read_text())["bytes"]
    arrays = {s: _memmap(data_dir / f"{stem}.{s}.bin") for s in sizes}
    description = f"Hugging Face dataset {source[3:]} ('text' as UTF-8, cached in {data_dir})"
    if "valid" not in arrays:  # no validation split of its own: cut train like a file
        return _make_corpus(source, arrays["train"], split, description)
    train, valid, test = arrays["train"], arrays["valid"], arrays.get("test")
    origins = {s: (str(Path(a.filename).resolve()), 0, len(a)) for s, a in arrays.items()}
    description = _with_sizes(description, train, valid, test)
    return Corpus(source, train, valid, test, description, origins)


# --------------------------------------------------------------------------------------------
# Batches


def random_batch(
    data: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """`batch_size` random windows of `seq_len + 1` bytes: (batch_size, seq_len + 1) int64.

    Row b holds the inputs `[:, :-1]` and the next-byte labels `[:, 1:]`. Window starts are
    drawn with `torch.randint(generator=generator)`, so the generator's state alone fixes
    which batches come next (the trainer checkpoints it to resume the data stream).
    """
    _check_windows(data, batch_size, seq_len)
    starts = torch.randint(
        0, len(data) - seq_len, (batch_size,), generator=generator, device=generator.device
    )
    # One strided view of every window; indexing it copies just the chosen rows.
    windows = sliding_window_view(data, seq_len + 1)
    return torch.from_numpy(windows[starts.cpu().numpy()].astype(np.int64))


class TrainBatches:
    """The training micro-batches of one rank, drawn from `generator` (the data stream whose
    state checkpoints store): each rank draws its own random windows, or with `shared` (data.
    shard_global_batch) its rows of one global batch that every rank draws alike, so N ranks
    of batch b see exactly the batches of one process of batch N * b."""

    def __init__(
        self,
        data: np.ndarray,
        batch_size: int,
        seq_len: int,
        generator: torch.Generator,
        *,
        rank: int = 0,
        world_size: int = 1,
        shared: bool = False,
    ) -> None:
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = generator
        self.rank, self.world_size = rank, world_size
        self.shared = shared and world_size > 1

    def __call__(self) -> torch.Tensor:
        """The next micro-batch, (batch_size, seq_len + 1) int64 on the CPU."""
        b = self.batch_size
        if not self.shared:
            return random_batch(self.data, b, self.seq_len, self.generator)
        batch = random_batch(self.data, b * self.world_size, self.seq_len, self.generator)
        return batch[self.rank * b : (self.rank + 1) * b]


def eval_batches(
    data: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[torch.Tensor]:
    """Deterministic pass over `data`: batches of windows (rows, seq_len + 1) int64, in order.

    Window i is `data[i * seq_len : i * seq_len + seq_len + 1]`: the windows share one byte at
    each boundary, so every label (byte 1 .. n_windows * seq_len) is predicted exactly once.
    The last batch may have fewer rows; the final `(len(data) - 1) % seq_len` bytes, which do
    not fill a window, are not scored. For the exact mean loss, weight each batch's mean loss
    by its label count `rows * seq_len`. `max_batches` stops after that many batches.
    """
    _check_windows(data, batch_size, seq_len)  # here, not lazily at the first batch
    n_windows = (len(data) - 1) // seq_len
    step = data.strides[0]
    windows = as_strided(
        data, shape=(n_windows, seq_len + 1), strides=(seq_len * step, step), writeable=False
    )
    n_batches = num_eval_batches(data, batch_size, seq_len, max_batches)
    return (
        torch.from_numpy(windows[b * batch_size : (b + 1) * batch_size].astype(np.int64))
        for b in range(n_batches)
    )


def eval_window_starts(n_bytes: int, seq_len: int, max_bytes: int = 0) -> np.ndarray:
    """Start offsets of the validation windows of a split of `n_bytes` bytes.

    The split is cut into consecutive windows of seq_len + 1 bytes that share one byte at each
    boundary (as in `eval_batches`), n = (n_bytes - 1) // seq_len of them. max_bytes = 0
    keeps them all (every label scored once); otherwise k = max(1, max_bytes // seq_len) of
    them (at most n), window floor(i * n / k) for i < k: spread evenly over the whole split,
    and a function of (n_bytes, seq_len, max_bytes) alone, so any batch size or number of
    processes scores the same set.
    """
    if seq_len < 1 or n_bytes < seq_len + 1:
        raise ValueError(
            f"seq_len={seq_len} needs windows of {seq_len + 1} bytes, but the split holds only "
            f"{n_bytes:,} bytes; use a smaller seq_len or a larger corpus"
        )
    n = (n_bytes - 1) // seq_len
    k = n if max_bytes <= 0 else max(1, min(n, max_bytes // seq_len))
    return (np.arange(k, dtype=np.int64) * n // k) * seq_len


def windows_at(data: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """The windows data[s : s + seq_len + 1] for s in starts: (len(starts), seq_len + 1) int64."""
    windows = sliding_window_view(data, seq_len + 1)
    return torch.from_numpy(windows[np.asarray(starts)].astype(np.int64))


def num_eval_batches(
    data: np.ndarray | int, batch_size: int, seq_len: int, max_batches: int | None = None
) -> int:
    """Number of batches `eval_batches` yields for `data` (an array or its length in bytes)."""
    n = int(data) if isinstance(data, (int, np.integer)) else len(data)
    batches = -(-((n - 1) // seq_len) // batch_size)
    return batches if max_batches is None else max(0, min(batches, max_batches))


def _check_windows(data: np.ndarray, batch_size: int, seq_len: int) -> None:
    if data.ndim != 1:
        raise ValueError(f"data must be a 1-D byte array, got shape {data.shape}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(data) < seq_len + 1:
        raise ValueError(
            f"seq_len={seq_len} needs windows of {seq_len + 1} bytes, but the split holds only "
            f"{len(data):,} bytes; use a smaller seq_len or a larger corpus"
        )


# --------------------------------------------------------------------------------------------
# Text <-> bytes

# Keep newline and tab; drop carriage returns (a bare one would overwrite the printed line);
# show other C0/C1 control characters and DEL as the replacement character.
_CONTROL_CHARS = {c: "\ufffd" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}
_CONTROL_CHARS[13] = None


def decode_tokens(tokens: torch.Tensor | np.ndarray | Sequence[int] | bytes) -> str:
    """Byte tokens (n,) in [0, 255] -> str: UTF-8, with bad bytes and control chars as U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.frombuffer(tokens, np.uint8) if isinstance(tokens, bytes) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"decode_tokens takes a 1-D sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"byte tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError(f"byte tokens must lie in [0, 255], got [{arr.min()}, {arr.max()}]")
    text = arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    return text.translate(_CONTROL_CHARS)


def encode_text(text: str) -> torch.Tensor:
    """str -> its UTF-8 bytes as an int64 tensor of shape (n_bytes,)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return torch.from_numpy(data.astype(np.int64))


# --------------------------------------------------------------------------------------------
# Helpers


def _check_split(split: Sequence[float]) -> tuple[float, float, float]:
    if len(split) != 3 or any(f < 0 for f in split) or abs(sum(split) - 1) > 1e-6:
        raise ValueError(
            f"split must be 3 fractions (train, valid, test) >= 0 summing to 1, got {split}"
        )
    if split[0] == 0 or split[1] == 0:
        raise ValueError(f"split needs non-zero train and valid fractions, got {split}")
    return tuple(float(f) for f in split)


def _make_corpus(
    name: str, data: np.ndarray, split: tuple[float, float, float], description: str
) -> Corpus:
    """Cut `data` into contiguous train / valid / test slices (views: no copy)."""
    n = len(data)
    a = round(n * split[0])
    b = n if split[2] == 0 else a + round(n * split[1])
    train, valid, test = data[:a], data[a:b], (data[b:] if split[2] else None)
    if len(train) == 0 or len(valid) == 0 or (test is not None and len(test) == 0):
        raise ValueError(f"{description}: {n:,} bytes are too few to split by {split}")
    origins = {}
    if isinstance(data, np.memmap) and data.filename:
        path = str(Path(data.filename).resolve())
        origins = {"train": (path, 0, a), "valid": (path, a, b)}
        if test is not None:
            origins["test"] = (path, b, n)
    description = _with_sizes(description, train, valid, test)
    return Corpus(name, train, valid, test, description, origins)


def _with_sizes(description: str, *splits: np.ndarray | None) -> str:
    sizes = " / ".join(f"{len(x):,}" for x in splits if x is not None)
    names = "train / valid / test" if splits[-1] is not None else "train / valid"
    return f"{description}; {names}: {sizes} bytes"


def _memmap(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        raise ValueError(f"corpus file {path} is empty")
    return np.memmap(path, dtype=np.uint8, mode="r")


def _copy(src, dst, callback: Callable[[int], object] | None = None) -> int:
    """Stream `src` into `dst` in chunks; returns the byte count."""
    n = 0
    while chunk := src.read(_CHUNK):
        dst.write(chunk)
        n += len(chunk)
        if callback is not None:
            callback(len(chunk))
    return n


@contextlib.contextmanager
def atomic_write(
    path: Path, verify: Callable[[Path], object] | None = None, mode: str = "wb"
) -> Iterator:
    """Yield a binary file (`mode` "wb", or "w+b" to read back) that becomes `path` only if
    the block (and `verify(tmp)`) succeed.

    The temporary file sits in the same directory and is fsynced before `os.replace` renames
    it, atomically; on any error, KeyboardInterrupt included, it is deleted and `path` is left
    untouched. Every file the data pipeline writes (downloads, caches, tokenizers) goes
    through here.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    tmp = Path(tmp)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if verify is not None:
            verify(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = [
    "DEFAULT_SPLIT",
    "ENWIK8_SIZE",
    "ENWIK8_URL",
    "ENWIK8_ZIP_SHA256",
    "Corpus",
    "DownloadError",
    "FallbackCorpusWarning",
    "TrainBatches",
    "decode_tokens",
    "download_enwik8",
    "encode_text",
    "eval_batches",
    "eval_window_starts",
    "hf_hub_reachable",
    "hf_texts_to_file",
    "load_corpus",
    "num_eval_batches",
    "random_batch",
    "stdlib_source_files",
    "windows_at",
]
