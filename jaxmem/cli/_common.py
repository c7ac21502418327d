"""Helpers shared by the CLI commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from jaxmem._util import load_toml as load_toml
from jaxmem._util import parse_bytes as parse_bytes
from jaxmem._util import parse_int_list as parse_int_list


def _number(kind, least: float, strict: bool, what: str):
    """An argparse ``type`` that reads a ``kind`` and refuses values below ``least`` (or equal to it,
    when ``strict``) and non-finite ones, with a message naming the rule."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, False, "an integer >= 1")
non_negative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")
non_negative_float = _number(float, 0.0, False, "a finite number >= 0")


def setup_devices(count: int | None) -> None:
    """Ask XLA for ``count`` virtual CPU devices, before JAX is imported.

    On a GPU/TPU machine the flag only affects the (unused) host platform, so the same command uses
    the real accelerators there. If JAX is already imported the flag cannot take effect; callers
    then check the device count and explain.
    """
    if count is None or "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def maybe_initialize_distributed() -> None:
    """Join a multi-process JAX job when launched as one (jaxmem launch, SLURM, Kubernetes, TPU pods)."""
    if os.environ.get("JAXMEM_COORDINATOR"):
        import jax

        jax.distributed.initialize(
            coordinator_address=os.environ["JAXMEM_COORDINATOR"],
            num_processes=int(os.environ["JAXMEM_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXMEM_PROCESS_ID"]),
            heartbeat_timeout_seconds=int(os.environ.get("JAXMEM_HEARTBEAT_SECONDS", "100")),
            initialization_timeout=120,
        )


def print_json(record) -> None:
    print(json.dumps(record, indent=2, default=str))
