"""A launched worker's side of the launcher protocol, as training hooks: heartbeats (the step reached
and the worker's median step time, which calibrates the recovery planner) and injected failures (a
drill: the worker SIGKILLs itself at a step, like a lost host). ``jaxmem launch`` sets the
environment variables; :func:`worker_hooks` reads them."""

from __future__ import annotations

import os
import signal

import numpy as np

from jaxmem._util import LAUNCHER_ENV, die_with_launcher
from jaxmem.train import Hook

__all__ = ["LAUNCHER_ENV", "FailureInjectionHook", "HeartbeatHook", "die_with_launcher", "worker_hooks"]

HEARTBEAT_ENV = "JAXMEM_HEARTBEAT_FILE"
FAIL_AT_ENV = "JAXMEM_FAIL_AT_STEP"


class HeartbeatHook(Hook):
    """After every step, write ``<step> [<median step seconds>]`` to ``path``."""

    def __init__(self, path: str):
        self.path = path

    def on_step(self, trainer, state, info):
        median = f" {float(np.median(info.step_seconds)):.6f}" if info.step_seconds else ""
        with open(self.path, "w") as f:
            f.write(f"{state.step}{median}")


class FailureInjectionHook(Hook):
    """SIGKILL this process once it reaches ``step`` (a failure drill)."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_step(self, trainer, state, info):
        if state.step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def worker_hooks(environ=None) -> list[Hook]:
    """The hooks a worker started by ``jaxmem launch`` needs (none outside a launch)."""
    environ = os.environ if environ is None else environ
    hooks: list[Hook] = []
    if environ.get(HEARTBEAT_ENV):
        hooks.append(HeartbeatHook(environ[HEARTBEAT_ENV]))
    if environ.get(FAIL_AT_ENV):
        hooks.append(FailureInjectionHook(int(environ[FAIL_AT_ENV])))
    return hooks
