"""The trainer's interrupt handling: Ctrl-C and SIGTERM stop cleanly, with a checkpoint.

A mixin of `Trainer` (trainer.py), kept apart so the loop reads in a sitting. The first signal
asks the loop to stop (after the current micro-batch; after the current step, agreed by all
ranks, under DDP); the loop then raises KeyboardInterrupt and `_on_interrupt` saves what can
be saved consistently. A second signal stops at once.

Uses these attributes of the Trainer: dist, step, step_runner, last_checkpoint_step,
save_checkpoint, _print, _phase, _step_rng, _stop_requested, _stop_signal, _stop_agreed.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any


class Interrupts:
    """Signal handling for `Trainer` (a mixin: see the module docstring)."""

    def _install_signal_handlers(self) -> dict:
        """First Ctrl-C or SIGTERM (what schedulers send before killing a job): stop after
        the current micro-batch, save and stop. A second one: stop now.

        With several ranks (torchrun passes SIGINT and SIGTERM on to every worker) the ranks
        agree on the step to stop after through the per-step all-reduce, then save together;
        a second signal stops at once without saving (the ranks may be anywhere, a collective
        could hang), keeping the last checkpoint. Returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self._stop_signal = signal.Signals(signum).name
            when = "after this step" if self.dist.enabled else "after this micro-batch"
            name = "Ctrl-C" if signum == signal.SIGINT else self._stop_signal
            self._print(
                f"\n{name}: stopping {when} and saving a checkpoint "
                f"(send it again to stop sooner{', without saving' if self.dist.enabled else ''})"
            )

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
        return previous

    def _on_interrupt(self) -> Path | None:
        """Save a consistent checkpoint after a KeyboardInterrupt, if the state allows."""
        if self.dist.enabled and not self._stop_agreed:
            self._print(
                f"interrupted at an arbitrary point of step {self.step + 1} with "
                f"{self.dist.world_size} ranks: not saving; the last checkpoint (step "
                f"{self.last_checkpoint_step}) is kept"
            )
            return None
        if self._phase == "update":
            self._print(
                f"interrupted during the parameter update of step {self.step + 1}: "
                f"not saving; the last checkpoint (step {self.last_checkpoint_step}) "
                "is kept"
            )
            return None
        rng = None
        if self._phase == "forward":
            # half-way through a step: drop its gradients and rewind its RNG draws
            self.step_runner.discard()
            rng = self._step_rng
        path = self.save_checkpoint(rng)
        self._print(f"interrupted at step {self.step}: checkpoint saved to {path}")
        return path
