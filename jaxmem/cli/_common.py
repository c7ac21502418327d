"""Helpers shared by the CLI commands."""

from __future__ import annotations

import json
import os
import sys
import tomllib

from jaxmem._errors import JaxmemError


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


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise JaxmemError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise JaxmemError(f"config file {path!r} is not valid TOML: {e}") from None
    except OSError as e:
        raise JaxmemError(f"cannot read config file {path!r}: {e.strerror or e}") from None


def print_json(record) -> None:
    print(json.dumps(record, indent=2, default=str))


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise JaxmemError(f"{flag} takes comma-separated integers like 3,3,2; got {text!r}") from None


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, flag: str = "--budget") -> float:
    """'24GiB', '512 MiB', '8e9', '1.5GB' -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise JaxmemError(f"{flag} takes a size like 24GiB, 512MiB, 8e9 or 1.5GB; got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise JaxmemError(f"{flag} must be > 0, got {text!r}")
    return value
