"""The run directory's guard rails: never clobber a run, never share one between two runs.

`RunDirLock.acquire(run_dir, resuming=..., overwrite=...)`, called by the main process
before anything is written:
    - refuses a run directory that is a file;
    - refuses to start a new run in a directory that already holds files (offering --resume
      or --overwrite); with --overwrite `clear_previous_run` deletes the previous run's files
      once the new run is set up. A directory holding only config.toml counts as empty: a
      run that failed before its first step left it, with nothing to resume;
    - `discard_failed_start`: a new run that fails before its first step deletes what it
      wrote, so that the same command can simply be run again;
    - takes an exclusive lock (flock on <run_dir>/.lock, deleted at the end; the kernel
      drops the flock when the process dies, so a killed run never leaves a stale lock); a
      second run into the same directory is refused with the first one's process id;
    - deletes temp files that a killed run left behind (`.checkpoint.pt.tmp-*`).

`new_run_dir` names a fresh run directory; `truncate_logs` drops log lines a crashed run
wrote past its last checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from triton_transformer.training.checkpoint import CHECKPOINT_NAME, METRICS_NAME, SAMPLES_NAME
from triton_transformer.training.config import LogConfig

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no locking
    fcntl = None

__all__ = ["LOCK_NAME", "RunDirError", "RunDirLock", "new_run_dir", "truncate_logs"]

LOCK_NAME = ".lock"
# what a run writes: --overwrite deletes these (and nothing else)
RUN_FILES = (CHECKPOINT_NAME, METRICS_NAME, SAMPLES_NAME, "config.toml")
RUN_DIRS = ("wandb",)
_TEMP_GLOBS = (f".{CHECKPOINT_NAME}.tmp-*",)


class RunDirError(RuntimeError):
    """The run directory cannot be used (taken, not empty, in use, or not a directory)."""


def _holder(lock_path: Path) -> str:
    try:
        pid = lock_path.read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid else "another process"


class RunDirLock:
    """An exclusive lock on a run directory, held until `release` (or process exit)."""

    def __init__(self, run_dir: Path, fd: int | None) -> None:
        self.run_dir = run_dir
        self._fd = fd
        self.created = False  # this run made the directory: removed again if left empty
        self.resuming = False  # continuing the run whose checkpoint is in the directory
        self._previous_run = False  # --overwrite: the files to delete before writing

    @classmethod
    def acquire(cls, run_dir: Path, *, resuming: bool, overwrite: bool = False) -> RunDirLock:
        """Check and lock `run_dir` for a run (see the module docstring)."""
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"run directory {run_dir} is a file; pass another --run-dir")
        lock_path = run_dir / LOCK_NAME
        # a running run is reported first (before "not empty"), and nothing is created yet
        if lock_path.is_file():
            cls._try_lock(lock_path, create=False).release(delete=False)
        if not resuming and not overwrite:
            taken = (
                sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME)
                if (run_dir.is_dir())
                else []
            )
            if taken == ["config.toml"]:
                taken = []  # a run that failed before its first step: nothing to lose
            if taken:
                shown = ", ".join(taken[:4]) + (", ..." if len(taken) > 4 else "")
                raise RunDirError(
                    f"{run_dir} already holds files ({shown}); continue that run with "
                    f"--resume {run_dir}, start over with --overwrite, or pick another --run-dir"
                )
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create run directory {run_dir}: {e.strerror}") from e
        lock = cls._try_lock(lock_path, create=True)
        lock.created = created
        lock.resuming = resuming
        lock._previous_run = overwrite and not resuming
        for pattern in _TEMP_GLOBS:
            for stale in run_dir.glob(pattern):  # only the lock holder writes these
                stale.unlink(missing_ok=True)
        return lock

    def clear_previous_run(self) -> None:
        """With --overwrite, delete the previous run's files. Called once the new run is set
        up (corpus loaded, model built), so a run that fails before that deletes nothing."""
        if self._previous_run:
            self._delete_run_files()
            self._previous_run = False

    def discard_failed_start(self) -> None:
        """A new run failed before its first step: delete the files it wrote (config.toml,
        a wandb directory), so that rerunning the same command is not refused as a clobber
        and no run directory without a checkpoint is left behind (`release` then removes
        the directory if this run created it). A resumed run keeps everything, and so does
        --overwrite before it deleted the previous run: those files are not this run's."""
        if not (self.resuming or self._previous_run):
            self._delete_run_files()

    def _delete_run_files(self) -> None:
        for name in RUN_FILES:
            (self.run_dir / name).unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(self.run_dir / name, ignore_errors=True)

    @classmethod
    def _try_lock(cls, lock_path: Path, *, create: bool) -> RunDirLock:
        if fcntl is None:  # pragma: no cover
            return cls(lock_path.parent, None)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(lock_path, flags, 0o644)
        except FileNotFoundError:
            return cls(lock_path.parent, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"{lock_path.parent} is in use by another training run ({_holder(lock_path)}); "
                "wait for it to finish, stop it, or pick another --run-dir"
            ) from None
        if not _same_file(fd, lock_path):
            # the holder released and deleted the file between our open and flock: retry
            os.close(fd)
            return cls._try_lock(lock_path, create=create)
        if create:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        return cls(lock_path.parent, fd)

    def release(self, delete: bool = True) -> None:
        """Unlock, deleting the lock file (a run that waits on it re-checks the inode)."""
        if self._fd is not None:
            if delete:
                (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
            os.close(self._fd)  # closing drops the flock
            self._fd = None
            if self.created and not any(self.run_dir.iterdir()):
                self.run_dir.rmdir()  # a run that failed before writing anything


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    return os.fstat(fd).st_ino == st.st_ino


def new_run_dir(lg: LogConfig, *, use_triton: bool, compile: bool) -> Path:
    """out_dir/<run_name>-<torch|triton>[-compile]-<timestamp>, with a suffix if taken."""
    backend = "triton" if use_triton else "torch"
    if compile:
        backend += "-compile"
    base = f"{lg.run_name}-{backend}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, i = Path(lg.out_dir) / base, 1
    while path.exists():
        path, i = Path(lg.out_dir) / f"{base}-{i}", i + 1
    return path


def truncate_logs(run_dir: Path, step: int) -> None:
    """Drop log lines past `step`: a crashed run may have logged steps after its last
    checkpoint, which the resumed run will log again."""
    for name in (METRICS_NAME, SAMPLES_NAME):
        path = run_dir / name
        if not path.exists():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass  # a line cut short by a crash
        path.write_text("".join(f"{line}\n" for line in keep))
