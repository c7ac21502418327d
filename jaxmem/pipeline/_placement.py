"""Where the static state lives: parameters, the step's gradients and the optimizer state, per leaf
and mesh axis.

The mesh has three manual axes, ``("data", "fsdp", "pipe")``:

- ``pipe`` splits the layers (a stage's leaves lead with the rank axis, sharded over ``pipe``);
- ``data`` and ``fsdp`` both split the batch (the step's replicas are ``data x fsdp``, numbered
  data-major);
- ``fsdp`` also shards the parameters: every leaf is cut along one of its dimensions and each stage
  gathers its own leaves when it runs (and the embedding and head the ones they use), its gradients
  reduce-scattered back at once (FSDP, ZeRO-3);
- with ``zero`` (the default) the optimizer state and the gradients the step returns are further
  cut over every axis along which the parameters are replicated -- ``data`` for stage leaves,
  ``data`` and ``pipe`` for the shared ones (ZeRO-1/2: the step reduce-scatters its gradients
  instead of all-reducing them, the update runs on shards, the new parameters are all-gathered).

A leaf's placement is a tuple with one entry per dimension: the mesh axes (major to minor) that cut
it. Axes are placed greedily: on a dimension that already holds an axis of the same leaf when its
remaining size divides, else on the largest dimension whose remaining size divides; an axis that
divides no dimension leaves the leaf whole along it (a norm's scale of width 25 on 2 devices).
Every figure the ledger gives for the static state comes from these placements.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["AXES", "LeafPlacement", "Placement", "place_leaf", "placement_of"]

AXES = ("data", "fsdp", "pipe")


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """One leaf: its global shape and, per dimension, the mesh axes cutting it.

    Attributes:
        shape: the global shape (a stage leaf leads with the rank axis).
        params: axes of the parameters.
        state: axes of the optimizer state and of the step's returned gradients (``params``' axes
            plus ZeRO's).
        reduce: axes its gradient is summed over (the replicas of the leaf's computation).
    """

    shape: tuple[int, ...]
    params: tuple[tuple[str, ...], ...]
    state: tuple[tuple[str, ...], ...]
    reduce: tuple[str, ...]

    def spec(self, which: str = "params"):
        from jax.sharding import PartitionSpec

        axes = self.params if which == "params" else self.state
        return PartitionSpec(*[(a[0] if len(a) == 1 else a) if a else None for a in axes])

    @property
    def fsdp_dim(self) -> int | None:
        """The dimension ``fsdp`` cuts the parameters along (None: whole on every fsdp device)."""
        return next((d for d, axes in enumerate(self.params) if "fsdp" in axes), None)

    def scatters(self) -> list[tuple[str, int]]:
        """``(axis, dim)`` the step's gradient is reduce-scattered over at the end of the step, in order
        (major first within a dimension): the state's axes beyond the parameters' that it is summed over."""
        out = []
        for d, (p, s) in enumerate(zip(self.params, self.state)):
            out += [(a, d) for a in s[len(p) :] if a in self.reduce]
        return out

    def sums(self) -> tuple[str, ...]:
        """Axes the step's gradient is all-reduced over at the end (summed, left whole)."""
        scattered = {a for a, _ in self.scatters()}
        return tuple(a for a in self.reduce if a not in scattered and not (a == "fsdp" and self.fsdp_dim is not None))

    def local_shape(self, which: str, sizes: dict[str, int]) -> tuple[int, ...]:
        axes = self.params if which == "params" else self.state
        return tuple(n // math.prod(sizes[a] for a in cut) for n, cut in zip(self.shape, axes))

    def device_elems(self, which: str, sizes: dict[str, int]) -> int:
        return math.prod(self.local_shape(which, sizes))


def _place(shape, placed: list[list[str]], axis: str, size: int, dims, sizes: dict[str, int]) -> bool:
    """Put ``axis`` (``size`` devices) on one of ``dims``; False when it divides none."""
    if size <= 1:
        return False

    def remaining(d):
        return shape[d] // math.prod(sizes[a] for a in placed[d])

    fits = [d for d in dims if remaining(d) % size == 0 and remaining(d) >= size]
    if not fits:
        return False
    used = [d for d in fits if placed[d]]
    d = (used or sorted(fits, key=lambda d: (-remaining(d), -d)))[0]
    placed[d].append(axis)
    return True


def place_leaf(
    shape: tuple[int, ...], sizes: dict[str, int], *, kind: str, zero: bool = True, fsdp_dims=None
) -> LeafPlacement:
    """The placement of one leaf of the pipeline layout.

    Args:
        shape: global shape.
        sizes: mesh axis sizes (``data``, ``fsdp``, ``pipe``).
        kind: ``"stage"`` (leads with the rank axis and a layer axis), ``"shared"`` (on every pipe
            rank) or ``"vocab"`` (a vocabulary table split over the ranks: leads with the rank axis;
            whole over ``fsdp``, the ranks computing with it together at the tick level).
        zero: shard the optimizer state and the returned gradients over the replicas.
        fsdp_dims: dimensions ``fsdp`` may cut (default: a stage leaf's per-layer dimensions, any
            dimension of a shared leaf).

    >>> p = place_leaf((4, 2, 64, 192), {"data": 2, "fsdp": 2, "pipe": 4}, kind="stage")
    >>> p.params, p.state
    ((('pipe',), (), (), ('fsdp',)), (('pipe',), (), (), ('fsdp', 'data')))
    >>> place_leaf((25,), {"data": 2, "fsdp": 1, "pipe": 4}, kind="shared").state
    ((),)
    """
    ndim = len(shape)
    placed: list[list[str]] = [[] for _ in range(ndim)]
    if kind == "stage":
        placed[0].append("pipe")
        per_layer = range(2, ndim)
        reduce = ("data", "fsdp")
    elif kind == "vocab":
        placed[0].append("pipe")
        per_layer = ()
        reduce = ("data", "fsdp")
    else:
        per_layer = range(ndim)
        reduce = ("data", "fsdp", "pipe")
    dims = per_layer if fsdp_dims is None else fsdp_dims
    _place(shape, placed, "fsdp", sizes.get("fsdp", 1), dims, sizes)
    params = tuple(tuple(p) for p in placed)
    if zero:
        # Every axis the leaf is replicated over (its gradient is summed over it), fsdp first.
        for axis in reduce:
            if not any(axis in p for p in placed):
                _place(shape, placed, axis, sizes.get(axis, 1), range(0 if kind == "shared" else 1, ndim), sizes)
    return LeafPlacement(tuple(shape), params, tuple(tuple(p) for p in placed), reduce)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Placements of every leaf of a pipeline's parameters (trees of :class:`LeafPlacement` shaped like
    :class:`~jaxmem.pipeline.PipelineParams`' fields)."""

    stages: tuple
    shared: object
    sizes: dict
    vocab: object = dataclasses.field(default_factory=dict)

    def leaves(self) -> list[LeafPlacement]:
        import jax

        return jax.tree.leaves((self.stages, self.shared, self.vocab), is_leaf=_is_placement)

    def device_bytes(self, abstract, which: str) -> float:
        """Per-device bytes of a tree shaped like the parameters (``abstract``, a PipelineParams of
        shaped values) placed as ``which`` (``params`` or ``state``)."""
        import jax

        total = 0
        leaves = jax.tree.leaves((abstract.stages, abstract.shared, abstract.vocab))
        for leaf, p in zip(leaves, self.leaves(), strict=True):
            total += p.device_elems(which, self.sizes) * np.dtype(leaf.dtype).itemsize
        return float(total)


def _is_placement(x) -> bool:
    return isinstance(x, LeafPlacement)


def placement_of(abstract, sizes: dict[str, int], *, zero: bool = True) -> Placement:
    """Placements of a PipelineParams of shaped values on a mesh of ``sizes``."""
    import jax

    stages = tuple(
        jax.tree.map(lambda a: place_leaf(tuple(a.shape), sizes, kind="stage", zero=zero), tree)
        for tree in abstract.stages
    )
    shared = jax.tree.map(lambda a: place_leaf(tuple(a.shape), sizes, kind="shared", zero=zero), abstract.shared)
    vocab = jax.tree.map(lambda a: place_leaf(tuple(a.shape), sizes, kind="vocab", zero=zero), abstract.vocab)
    return Placement(stages, shared, dict(sizes), vocab)
