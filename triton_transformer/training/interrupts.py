"""Ctrl-C and SIGTERM: ask the training loop to stop cleanly, with a checkpoint.

The first signal only sets a flag: a single process stops after the current micro-batch;
under DDP the ranks agree through the per-step all-reduce (`step.LossCheck`) and all stop
after the same step. A second signal stops at once (KeyboardInterrupt from the handler, at
whatever line the host is on). Which checkpoint can then be saved is the trainer's decision
(`Trainer._save_interrupted`), by the phase of the step it interrupted (step.py's docstring).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

__all__ = ["Interrupts"]


class Interrupts:
    """The stop flag of one process and the signal handlers that set it.

    distributed: several ranks train together (the stop is then agreed on, never taken alone).
    say: prints a console line (the run's logger: silent off rank 0).
    """

    def __init__(self, *, distributed: bool, say: Callable[[str], None]) -> None:
        self.distributed = distributed
        self.say = say
        self.requested = False  # Ctrl-C (or SIGTERM) seen by this process
        self.agreed = False  # ... and, with several ranks, known to all of them
        self.signal_name: str | None = None  # "SIGINT" / "SIGTERM" that asked to stop
        self._previous: dict[int, object] = {}

    @property
    def stop_now(self) -> bool:
        """Stop before the next step: every rank knows, or a single process was asked."""
        return self.agreed or self.stop_between_micro_batches

    @property
    def stop_between_micro_batches(self) -> bool:
        """A single process stops after the current micro-batch; ranks only between steps
        (they must all run the same collectives)."""
        return self.requested and not self.distributed

    def install(self) -> None:
        """First Ctrl-C or SIGTERM (what schedulers send before killing a job): stop after
        the current micro-batch, save and stop. A second one: stop now.

        With several ranks (torchrun passes SIGINT and SIGTERM on to every worker) a second
        signal stops at once without saving (the ranks may be anywhere, a collective could
        hang), keeping the last checkpoint. Only the main thread may install handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        when = "after this step" if self.distributed else "after this micro-batch"
        name = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
        self.say(
            f"\n{name}: stopping {when} and saving a checkpoint "
            f"(send it again to stop sooner{', without saving' if self.distributed else ''})"
        )
