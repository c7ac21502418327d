"""Cutting a model into pipeline stages: layer counts, parameter layout, and pure stage functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmem._errors import JaxmemError
from jaxmem.models import EMBED_KEY, HEAD_KEY, layer_batch

__all__ = ["split_layers", "stack_stage_params", "stage_forward", "unstack_layers", "unstack_stage_params"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_layers(n_layers: int, n_stages: int, layer_counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage: balanced by default, or an explicit list.

    >>> split_layers(8, 4)
    (2, 2, 2, 2)
    >>> split_layers(8, 3, [3, 3, 2])
    (3, 3, 2)
    """
    if layer_counts is not None:
        counts = tuple(int(c) for c in layer_counts)
        if len(counts) != n_stages:
            raise JaxmemError(
                f"layers per stage {list(counts)} lists {len(counts)} stages, but the schedule has {n_stages}"
            )
        if any(c < 0 for c in counts) or sum(counts) != n_layers:
            raise JaxmemError(
                f"layers per stage {list(counts)} must be >= 0 and sum to the model's {n_layers} layers "
                f"(they sum to {sum(counts)})"
            )
        return counts
    if n_layers % n_stages:
        ok = ", ".join(str(d) for d in _divisors(n_layers))
        raise JaxmemError(
            f"{n_layers} layers do not split evenly over {n_stages} stages; stage counts that divide "
            f"{n_layers}: {ok} (stages = pipeline ranks x virtual stages per rank), or pass explicit "
            "layers per stage (--layers-per-stage 3,3,2)"
        )
    return (n_layers // n_stages,) * n_stages


def unstack_layers(stacked, layers: int) -> list:
    """The first ``layers`` entries of a tree whose leaves lead with a layer axis, one tree per layer.

    One split per leaf, not an index per layer: the gradient of ``a[i]`` pads each layer's gradient to
    the whole stack and adds them up (work growing with the square of the layers); a split's
    gradient is one concatenation.
    """
    leaves, treedef = jax.tree.flatten(stacked)
    pieces = []
    for a in leaves:
        sizes = [1] * layers + ([a.shape[0] - layers] if a.shape[0] > layers else [])
        pieces.append([p[0] for p in jax.lax.split(a, sizes)[:layers]])
    return [jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(layers)]


def stage_forward(model, *, first: bool, last: bool, layers: int, skip: tuple[int, ...] = ()) -> Callable:
    """``fn(stage_params, shared, x, batch)`` of one stage of a :class:`~jaxmem.models.StagedModel`:
    the embedding if ``first`` (``x`` is then ignored), ``layers`` layers (except the local indices
    in ``skip``: layer drop), the head's ``(loss_sum, weight)`` if ``last``. ``stage_params`` leaves
    have a leading layer axis (at least ``layers``). A ``batch["rng"]`` (the stage's key) is folded
    per layer (:func:`jaxmem.models.layer_batch`)."""

    def fn(stage_params, shared, x, batch):
        if first:
            x = model.embed(shared, layer_batch(batch, EMBED_KEY))
        per_layer = unstack_layers(stage_params, layers)
        for i in range(layers):
            if i in skip:
                continue
            x = model.layer(per_layer[i], x, layer_batch(batch, i))
        if last:
            return model.head_loss(shared, x, layer_batch(batch, HEAD_KEY))
        return x

    return fn


def _per_rank(stage_to_rank: Sequence[int]) -> list[list[int]]:
    ranks = max(stage_to_rank) + 1
    return [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(ranks)]


def stack_stage_params(
    blocks: Sequence[dict], layer_counts: Sequence[int], stage_to_rank: Sequence[int]
) -> tuple[dict, ...]:
    """Per-layer dicts -> one dict per local stage position ``v``, leaves ``[ranks, max layers, ...]``.

    Entry ``v`` holds, for every rank, the layers of the rank's ``v``-th stage, so sharding its first
    axis over ``pipe`` gives every rank exactly its own stages. Stages with fewer layers than the most
    loaded one are zero-padded (those rows are never read and get zero gradients).
    """
    per_rank = _per_rank(stage_to_rank)
    max_layers = max(max(layer_counts), 1)
    starts = [sum(layer_counts[:s]) for s in range(len(layer_counts))]
    template = blocks[0]

    def stage_stack(s):
        layers = [blocks[starts[s] + i] for i in range(layer_counts[s])]
        pad = max_layers - len(layers)
        parts = [jax.tree.map(lambda *xs: jnp.stack(xs), *layers)] if layers else []
        if pad:
            parts.append(jax.tree.map(lambda a: jnp.zeros((pad,) + a.shape, a.dtype), template))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if len(parts) > 1 else parts[0]

    virtual = len(per_rank[0])
    return tuple(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[stage_stack(stages[v]) for stages in per_rank])
        for v in range(virtual)
    )


def unstack_stage_params(
    stacked: Sequence[dict], layer_counts: Sequence[int], stage_to_rank: Sequence[int]
) -> list[dict]:
    """Inverse of :func:`stack_stage_params`: the per-layer dicts in model order."""
    per_rank = _per_rank(stage_to_rank)
    blocks = []
    for s, count in enumerate(layer_counts):
        rank = stage_to_rank[s]
        local = per_rank[rank].index(s)
        for i in range(count):
            blocks.append(jax.tree.map(lambda a, rank=rank, i=i: a[rank, i], stacked[local]))
    return blocks
