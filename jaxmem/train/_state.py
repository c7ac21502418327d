"""The train state and moving host values onto a (possibly multi-process) mesh."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxmem.data import DataIterator
from jaxmem.pipeline import PipelineParams

__all__ = ["TrainState", "global_put", "on_host", "scalar", "to_device"]


@dataclasses.dataclass
class TrainState:
    """Parameters, optimizer state, step and data position: everything a resumed run needs."""

    params: PipelineParams
    opt_state: object
    step: int
    data: DataIterator


def global_put(tree, shardings):
    """Host arrays (the same on every process) -> global arrays with ``shardings``; works in one
    process and in a multi-process job alike."""

    def put(value, sharding):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    if isinstance(shardings, NamedSharding):
        return put(tree, shardings)
    return jax.tree.map(put, tree, shardings)


def scalar(x) -> float:
    """A replicated scalar's value on this process (also for multi-process arrays)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return float(np.asarray(x.addressable_data(0)))
    return float(x)


def on_host(x) -> bool:
    """Whether an array (or, inside a jitted function, a traced value) lives in host memory."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or getattr(jax.typeof(x), "memory_space", "")
    return "host" in str(kind).lower()


def to_device(tree):
    """Bring host-resident leaves (``pinned_host`` memory kind) to device memory; others unchanged."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x, tree)
