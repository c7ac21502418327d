"""What a run does at the terminal: its console, and the signals (SIGTERM, SIGINT) that stop it
after a whole step. Shared by the plain and the adaptive training loops."""

from __future__ import annotations

import jax

from jaxmem._errors import setting
from jaxmem.config import TrainConfig


class StopRequests:
    """SIGTERM / SIGINT (preemption, Ctrl-C) ask the loop to stop after the current step, save and exit.

    In one process, handlers set a flag (a second signal gets the default behaviour back, so a
    stuck save can still be interrupted). In a multi-process job, JAX's preemption service owns
    SIGTERM: every process asks :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
    each step, and all of them stop at the same step.
    """

    def __init__(self):
        self.reason: str | None = None
        self._previous: dict = {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        signals = [signal.SIGINT] if jax.process_count() > 1 else [signal.SIGTERM, signal.SIGINT]
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        import signal

        self.reason = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one is not deferred

    def __exit__(self, *exc):
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.reason = self.reason or "SIGTERM"
                    return True
            except RuntimeError:  # no preemption service in this job
                pass
        return self.reason is not None

    def announce(self, step: int, config: TrainConfig, log) -> None:
        """Say that a signal stopped the run at ``step`` and whether it is saved (after the loop)."""
        if self.reason:
            saved = (
                "saving a checkpoint"
                if config.checkpoint_dir
                else f"no {setting('checkpoint_dir')}, so nothing is saved"
            )
            log(f"{self.reason}: stopping after step {step}/{config.steps}, {saved}")


def console_log(progress: bool):
    """The run's stderr console and a ``log(line)`` printing plain lines to it (silent without
    ``progress``)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not progress:
        return console, lambda line: None
    return console, lambda line: console.print(line, markup=False, highlight=False)
