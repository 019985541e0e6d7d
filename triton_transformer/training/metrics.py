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

import torch
from torch import nn
from tqdm.auto import tqdm

from triton_transformer.training.checkpoint import METRICS_NAME, SAMPLES_NAME
from triton_transformer.training.config import Config, ConfigError
from triton_transformer.utils import exists

__all__ = [
    "PEAK_BF16_FLOPS",
    "LossWindow",
    "RunLogger",
    "Throughput",
    "WandbLogger",
    "flops_per_token",
    "mfu",
    "peak_bf16_flops",
]

# Dense (no sparsity) bf16 tensor-core peak of known GPUs, FLOP/s, from NVIDIA's data sheets;
# the first name found in torch.cuda.get_device_name() wins, so "H100 PCIe" precedes "H100".
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}


def flops_per_token(model: nn.Module, depth: int, heads: int, dim_head: int, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward): 6 per non-embedding parameter plus
    the attention scores and values, 12 * depth * heads * dim_head * seq_len (PaLM, app. B).
    The embedding tables are lookups, not matmuls; the logits projection counts."""
    params = sum(p.numel() for p in model.parameters())
    for name in ("token_emb", "pos_emb"):
        emb = getattr(model, name, None)
        if isinstance(emb, nn.Module):
            params -= sum(p.numel() for p in emb.parameters())
    return 6 * params + 12 * depth * heads * dim_head * seq_len


def peak_bf16_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device` if it is a GPU of `PEAK_BF16_FLOPS`, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(
    flops_per_token: int, tokens_per_s: float, peak: float | None, devices: int = 1
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of `devices` GPUs."""
    if peak is None or peak <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * devices)


@dataclass(frozen=True)
class Throughput:
    """What turns a step time into tokens/s and MFU for one run (all ranks together)."""

    tokens_per_step: int  # global: batch_size * grad_accum_steps * seq_len * world_size
    flops_per_token: int
    peak_flops: float | None  # per device; None: MFU not reported
    devices: int = 1

    def tokens_per_s(self, steps: int, seconds: float) -> float:
        return self.tokens_per_step * steps / max(seconds, 1e-9)

    def mfu(self, tokens_per_s: float) -> float | None:
        return mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.devices)


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
