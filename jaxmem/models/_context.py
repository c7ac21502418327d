"""Attention over a sequence split across devices: the functions a model's layers call to be
context-aware (exact on a mesh with a ``context`` axis, plain causal attention without one).

A pipeline with a ``context`` axis of ``C`` devices gives each device two of the ``2C`` equal chunks
of every sequence -- chunk ``i`` and chunk ``2C - 1 - i`` on device ``i`` -- so that under a causal
mask every device has the same work (an early chunk sees few keys, its partner many). The token-wise
parts of a model (embeddings, norms, MLPs, the loss) need nothing: they see this device's tokens, and
their positions in ``batch["positions"]`` (the pipeline puts them there). Attention needs the keys
and values of every chunk: :func:`context_kv` all-gathers them over the axis (its backward sums each
device's share of their gradients back to their owner), and :func:`causal_mask` says which of them
each of this device's queries sees. :func:`~jaxmem.models.fused_attention` does both itself.

Keys and values are gathered whole, not passed round a ring: the gathered copy of one layer's keys
and values is a transient of ``2 * (C - 1) / C`` times the local keys and values, small beside the
local activations when keys and values are few (grouped-query attention), and one collective a layer
instead of ``C - 1`` steps that must each overlap a block of attention to hide their latency. Every
device computes its queries against all ``S`` keys with the mask, so attention's FLOPs are those of
the unmasked ``S x S / C`` block, twice the causal minimum (the kernel skips nothing); the load
balance keeps them equal across devices.

Outside a pipeline (the plain model, ``jaxmem verify``'s reference) no axis is bound and the
functions are the ordinary causal ones.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._errors import JaxmemError

__all__ = [
    "AXIS",
    "causal_mask",
    "context_calls",
    "context_kv",
    "context_order",
    "context_positions",
    "context_size",
    "context_stand_in",
    "gathered_bytes",
]

AXIS = "context"

# [devices, calls, gathered bytes]: set while a pipeline traces a stage outside its shard_map (the
# residual plans, the tags) or the ledger traces it, for a mesh with a context axis. The functions
# then stand in for the collectives with arrays of the shapes the real ones give, count that they were
# called (a model that never calls them is not context-aware) and the bytes context_kv gathers (what
# the time model prices).
_STAND_IN: contextvars.ContextVar = contextvars.ContextVar("jaxmem_context_stand_in", default=None)


@contextlib.contextmanager
def context_stand_in(devices: int):
    """Within the block, trace as on a context axis of ``devices`` outside any ``shard_map``: the
    gathers give arrays of their real shapes, and :func:`context_calls` counts the calls,
    :func:`gathered_bytes` the bytes of this device's keys and values handed to :func:`context_kv`."""
    token = _STAND_IN.set([devices, 0, 0])
    try:
        yield
    finally:
        _STAND_IN.reset(token)


def context_calls() -> int:
    """Calls to the context-aware functions inside the current :func:`context_stand_in` block."""
    state = _STAND_IN.get()
    return 0 if state is None else state[1]


def gathered_bytes() -> int:
    """Bytes of this device's arrays :func:`context_kv` gathered inside the current
    :func:`context_stand_in` block (each traced call once)."""
    state = _STAND_IN.get()
    return 0 if state is None else state[2]


def _bound() -> int:
    try:
        return int(jax.lax.axis_size(AXIS))
    except NameError:
        return 0


def context_size() -> int:
    """Devices of the ``context`` axis this code is traced over (1 without one)."""
    bound = _bound()
    if bound:
        return bound
    state = _STAND_IN.get()
    return 1 if state is None else state[0]


def _count() -> None:
    state = _STAND_IN.get()
    if state is not None:
        state[1] += 1


def context_order(seq: int, devices: int) -> np.ndarray:
    """The positions of a sequence of ``seq`` tokens in the order a ``context`` axis of ``devices``
    holds them: device ``i`` holds chunk ``i`` then chunk ``2 * devices - 1 - i`` of ``2 * devices``.

    >>> context_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if devices == 1:
        return np.arange(seq)
    if seq % (2 * devices):
        raise JaxmemError(
            f"a context axis of {devices} devices splits each sequence into {2 * devices} equal chunks (two a "
            f"device, for causal attention's balance); sequence length {seq} is not divisible by {2 * devices}: "
            f"use a length that is (e.g. {2 * devices * max(1, seq // (2 * devices))}), or a smaller context axis"
        )
    chunks = np.arange(seq).reshape(2 * devices, seq // (2 * devices))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


def _index():
    """This device's index on the axis (0 on a stand-in)."""
    return jax.lax.axis_index(AXIS) if _bound() else 0


def context_positions(local: int) -> jax.Array:
    """The positions in the whole sequence of this device's ``local`` tokens (int32 ``[local]``);
    ``arange(local)`` without a context axis."""
    devices = context_size()
    if devices == 1:
        return jnp.arange(local, dtype=jnp.int32)
    order = jnp.asarray(context_order(local * devices, devices), jnp.int32)
    return jax.lax.dynamic_slice_in_dim(order, _index() * local, local)


def context_kv(*arrays: jax.Array, axis: int = 1):
    """Every device's part of each array along the sequence ``axis`` (keys and values), in the
    devices' order: all-gathered over the ``context`` axis, whose backward hands each device the sum
    of the gradients of its part. The arrays as they are without a context axis. Returns a tuple (one
    array for one argument).

    Use with :func:`causal_mask`: query ``q`` of this device sees key ``k`` of the gathered ones
    where ``causal_mask(q_len, k_len)[q, k]``.
    """
    devices = context_size()
    _count()
    state = _STAND_IN.get()
    if state is not None:
        state[2] += sum(a.size * a.dtype.itemsize for a in arrays)
    if devices == 1:
        out = arrays
    elif _bound():
        out = tuple(jax.lax.all_gather(a, AXIS, axis=axis, tiled=True) for a in arrays)
    else:  # a stand-in of the gathered shape (see context_stand_in)
        out = tuple(jnp.concatenate([a] * devices, axis=axis) for a in arrays)
    return out[0] if len(arrays) == 1 else out


def causal_mask(q_len: int, k_len: int) -> jax.Array:
    """Which keys each query sees: bool ``[q_len, k_len]``, true where the key's position in the whole
    sequence is at or before the query's. Without a context axis (``q_len == k_len``) the lower
    triangle; with one, this device's queries (:func:`context_positions`) against the keys
    :func:`context_kv` gathered."""
    devices = context_size()
    _count()
    if k_len != q_len * devices:
        raise JaxmemError(
            f"causal_mask({q_len}, {k_len}): on a context axis of {devices} device(s) the keys are the "
            f"queries' {devices} devices' worth ({q_len * devices}); gather them with context_kv first"
        )
    if devices == 1:
        return jnp.tril(jnp.ones((q_len, k_len), dtype=bool))
    keys = jnp.asarray(context_order(k_len, devices), jnp.int32)
    return keys[None, :] <= context_positions(q_len)[:, None]
