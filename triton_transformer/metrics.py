"""Metrics and logging of a run: console lines, metrics.jsonl / samples.jsonl, Weights & Biases.

Only the main process (rank 0) prints and writes; on other ranks every method is a no-op, so
callers need not check. wandb is imported only when `log.wandb` asks for it.
"""

from __future__ import annotations

import json
import netrc
import os
from dataclasses import asdict, dataclass
from html import escape
from pathlib import Path

from tqdm.auto import tqdm

from triton_transformer.checkpoint import METRICS_NAME, SAMPLES_NAME
from triton_transformer.config import Config, ConfigError
from triton_transformer.utils import exists

__all__ = ["LossWindow", "RunLogger", "WandbLogger"]


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger:
    """Thin wrapper over a wandb run; wandb is imported only when asked for."""

    def __init__(self, config: Config, run_dir: Path, run_id: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "log.wandb=true (--wandb) needs the wandb package: pip install wandb"
            ) from None
        if not _wandb_has_credentials() and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
            tqdm.write("wandb: no API key configured, logging offline (wandb sync later)")
        self.wandb = wandb
        self.run = wandb.init(
            project=config.log.wandb_project,
            name=run_dir.name,
            dir=str(run_dir),
            config=config.to_dict(),
            id=run_id,
            resume="allow",
        )

    @property
    def run_id(self) -> str | None:
        return getattr(self.run, "id", None)

    def log(self, record: dict, step: int) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        html = getattr(self.wandb, "Html", None)
        value = html(f"<pre>{escape(text)}</pre>") if exists(html) else text
        self.run.log({key: value}, step=step)

    def finish(self) -> None:
        self.run.finish()


@dataclass
class LossWindow:
    """The steps since the last metrics record: each record logs their mean loss and
    tokens/s. Checkpoints store it, so a resumed run logs what an uninterrupted one would."""

    loss: float = 0.0
    steps: int = 0
    time_s: float = 0.0

    def add(self, loss: float, time_s: float) -> None:
        self.loss += loss
        self.steps += 1
        self.time_s += time_s

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.steps, 1)

    def tokens_per_s(self, tokens_per_step: int) -> float:
        return tokens_per_step * self.steps / max(self.time_s, 1e-9)

    def reset(self) -> None:
        self.loss, self.steps, self.time_s = 0.0, 0, 0.0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.loss, self.steps = float(state["loss"]), int(state["steps"])
        self.time_s = float(state["time_s"])


class RunLogger:
    """Console, JSONL and (optionally) wandb output of one run; silent off the main rank."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.run_dir = run_dir
        self.is_main = is_main
        self.wandb: WandbLogger | None = None

    def start_wandb(self, config: Config, run_id: str | None) -> str | None:
        """Open the wandb run (resuming `run_id`); returns its id to store in checkpoints."""
        if self.is_main and config.log.wandb:
            self.wandb = WandbLogger(config, self.run_dir, run_id)
            return self.wandb.run_id
        return run_id

    def finish(self) -> None:
        if exists(self.wandb):
            self.wandb.finish()
            self.wandb = None

    def print(self, msg: str) -> None:
        """A console line that does not break the progress bar."""
        if self.is_main:
            tqdm.write(msg)

    def append_jsonl(self, name: str, record: dict) -> None:
        if self.is_main:
            with (self.run_dir / name).open("a") as f:
                f.write(json.dumps(record) + "\n")

    def log_record(self, record: dict) -> None:
        """One metrics.jsonl line (and wandb row)."""
        self.append_jsonl(METRICS_NAME, record)
        if exists(self.wandb):
            self.wandb.log(record, record["step"])

    def log_sample(self, sample: dict) -> None:
        self.print(
            f"--- sample at step {sample['step']} ---\n{sample['prime']}\n"
            f">>>\n{sample['sample']}\n---"
        )
        self.append_jsonl(SAMPLES_NAME, sample)
        if exists(self.wandb):
            self.wandb.log_text(
                "sample", f"{sample['prime']} >>> {sample['sample']}", sample["step"]
            )
