"""Which of a stage's values a ``tensor`` axis cuts: a small propagation over the stage's jaxpr.

XLA's partitioner runs each stage's math split the way the parameters' tensor cuts say (see
:mod:`jaxmem.pipeline._executor`): a matmul against a weight cut on an output dimension produces a
cut activation (a head, a slice of the MLP's hidden layer), a matmul that contracts the cut dimension
produces a whole one (after the all-reduce). The executor stashes a cut residual as each device's
share, without gathering it; the ledger and the cost model need to know how many of a stage's bytes
and FLOPs are cut without compiling for a mesh they may not have. This walks the jaxpr with one "cut
dimension" (or none) per value, following the partitioner's rules for the primitives a transformer
uses. An op it does not know keeps the cut only where its output keeps the cut dimension at the same
place and size; a value it cannot place is taken as whole (gathered for the stash).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, Var

from jaxmem.pipeline._placement import TENSOR
from jaxmem.pipeline._residuals import flat_pack, flat_unpack

__all__ = ["CutArena", "TensorCut", "analyze_cut", "as_rows", "cut_dims"]


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _inner(eqn):
    """The nested jaxpr of a call-like equation whose inputs are the equation's own (or None)."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        item = eqn.params.get(name)
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner
    return None


def _reshape(shape_in, shape_out, d):
    """The output dimension a reshape carries input dimension ``d`` to (or None): the one that starts
    at the same element stride (heads split from or merged into a feature dimension)."""
    outer = math.prod(shape_in[:d])
    running = 1
    for j, size in enumerate(shape_out):
        if running == outer:
            return j
        running *= size
        if running > outer:
            return None
    return None


def _dot(eqn, dims):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    nl, nr = len(_shape(lhs)), len(_shape(rhs))
    lfree = [i for i in range(nl) if i not in lc and i not in lb]
    rfree = [i for i in range(nr) if i not in rc and i not in rb]
    for dim, batch, free, offset in (
        (dims.get(lhs), lb, lfree, len(lb)),
        (dims.get(rhs), rb, rfree, len(lb) + len(lfree)),
    ):
        if dim is None:
            continue
        if dim in batch:
            return batch.index(dim)
        if dim in free:
            return offset + free.index(dim)
    return None  # contracted over the cut (summed whole by an all-reduce) or nothing cut


def _constrained(sharding, ndim: int):
    """The dimension a sharding constraint cuts over ``tensor`` (None: whole, or not over it)."""
    spec = tuple(getattr(sharding, "spec", sharding) or ())
    for d, entry in enumerate(spec[:ndim]):
        names = entry if isinstance(entry, tuple) else (entry,)
        if TENSOR in names:
            return d
    return None


def _out_dim(eqn, dims):
    """The cut dimension of the equation's (first) output."""
    name = eqn.primitive.name
    if name == "sharding_constraint":  # the value is placed as the constraint says
        return _constrained(eqn.params.get("sharding"), len(_shape(eqn.outvars[0])))
    ins = [v for v in eqn.invars if isinstance(v, Var)]
    cut_in = [(v, dims[v]) for v in ins if dims.get(v) is not None]
    if not cut_in:
        return None
    out_shape = _shape(eqn.outvars[0])
    v, d = cut_in[0]
    if name == "dot_general":
        return _dot(eqn, dims)
    if name == "broadcast_in_dim":
        return eqn.params["broadcast_dimensions"][d]
    if name == "transpose":
        return list(eqn.params["permutation"]).index(d)
    if name == "reshape":
        return _reshape(_shape(v), out_shape, d)
    if name == "squeeze":
        dropped = eqn.params["dimensions"]
        return None if d in dropped else d - sum(k < d for k in dropped)
    if "axes" in eqn.params and len(out_shape) < len(_shape(v)):  # reductions
        axes = tuple(eqn.params["axes"])
        return None if d in axes else d - sum(k < d for k in axes)
    if name == "split":
        return None if eqn.params["axis"] == d else d
    # Elementwise, slices, concatenation, selects, conversions: the dimension stays where it was if
    # the output keeps its rank and its size.
    for v, d in cut_in:
        shape = _shape(v)
        if len(shape) == len(out_shape) and shape[d] == out_shape[d]:
            return d
    return None


def _walk(jaxpr, dims: dict, visit=None) -> None:
    for eqn in jaxpr.eqns:
        inner = _inner(eqn)
        if inner is not None:
            inner_dims = {iv: dims.get(ov) for iv, ov in zip(inner.invars, eqn.invars) if isinstance(ov, Var)}
            _walk(inner, inner_dims, visit)
            for outer, out in zip(eqn.outvars, inner.outvars):
                dims[outer] = None if isinstance(out, Literal) else inner_dims.get(out)
            continue
        if visit is not None:
            visit(eqn, dims)
        d = _out_dim(eqn, dims)
        for out in eqn.outvars:
            dims[out] = d if d is not None and len(_shape(out)) > d else None


def _bytes(v) -> float:
    return float(math.prod(_shape(v)) * np.dtype(v.aval.dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class TensorCut:
    """What a ``tensor`` axis does to one traced stage (per microbatch of the trace).

    Attributes:
        cut_bytes: bytes of the asked-for values (e.g. the stashed residuals) that are cut.
        values_bytes: bytes of those values in all.
        cut_flops / dot_flops: matmul FLOPs with a cut operand (each device does ``1/tensor`` of
            them), and all matmul FLOPs of the forward.
        reduced_bytes: bytes of matmul outputs that contract over the cut (summed over the tensor
            devices by an all-reduce: Megatron's row-parallel layers).
    """

    cut_bytes: float
    values_bytes: float
    cut_flops: float
    dot_flops: float
    reduced_bytes: float


def cut_dims(closed, in_dims: list) -> dict:
    """Per value of a closed jaxpr, the dimension the ``tensor`` axis cuts (None: whole), given the
    cut dimension of each input (``in_dims``, one per invar)."""
    return analyze_cut(closed, in_dims, [])[0]


def analyze_cut(closed, in_dims: list, values) -> tuple[dict, TensorCut]:
    """The cut dimension of every value of ``closed`` and the :class:`TensorCut` summary, with
    ``values`` (vars of ``closed``) the ones whose cut bytes are counted."""
    jaxpr = closed.jaxpr
    dims = {v: d for v, d in zip(jaxpr.invars, in_dims)}
    totals = {"cut": 0.0, "dot": 0.0, "reduced": 0.0}

    def visit(eqn, dims):
        if eqn.primitive.name != "dot_general":
            return
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        out = eqn.outvars[0]
        contracted = math.prod(_shape(lhs)[i] for i in lc)
        flops = 2.0 * math.prod(_shape(out)) * contracted
        totals["dot"] += flops
        ld, rd = dims.get(lhs), dims.get(rhs)
        if ld is not None or rd is not None:
            totals["cut"] += flops
            if (ld is not None and ld in lc) or (rd is not None and rd in rc):
                totals["reduced"] += _bytes(out)

    _walk(jaxpr, dims, visit)
    values = [v for v in dict.fromkeys(values) if isinstance(v, Var)]
    return dims, TensorCut(
        cut_bytes=sum(_bytes(v) for v in values if dims.get(v) is not None),
        values_bytes=sum(_bytes(v) for v in values),
        cut_flops=totals["cut"],
        dot_flops=totals["dot"],
        reduced_bytes=totals["reduced"],
    )


def as_rows(vec, tensor: int):
    """A flat vector as ``[tensor, ceil(n / tensor)]`` rows (the last zero-padded), row ``t`` on
    tensor device ``t``."""
    from jax.sharding import PartitionSpec as P

    rows = -(-vec.shape[0] // tensor)
    if rows * tensor != vec.shape[0]:
        vec = jnp.concatenate([vec, jnp.zeros((rows * tensor - vec.shape[0],), vec.dtype)])
    return jax.lax.with_sharding_constraint(vec.reshape(tensor, rows), P(TENSOR, None))


class CutArena:
    """Where one stage class's stashed residuals (:meth:`of_stash`), or the values its I hands its W
    (:meth:`~jaxmem.pipeline._iw.StageSplit.transfer_arena`), sit in arenas cut over ``tensor``
    devices (``[tensor, rows]``, row ``t`` on tensor device ``t``).

    A residual the stage computes cut (:func:`cut_dims`) is kept as each device's own share, moved
    nowhere: its cut dimension is split in ``tensor`` blocks and block ``t`` is row ``t``'s columns. The
    rest are whole on every device; they are flattened one after the other and that vector is cut
    in ``tensor`` equal pieces (each device keeps one; the backward gathers them). The whole part comes
    first, then each cut residual's columns. A buffer of ``n`` elements takes ``ceil(n / tensor)``
    columns, the same as cutting its flat vector, so the tick program's layout does not change.
    Buffers on host are not cut (the executor's :func:`~jaxmem.pipeline.stash_cut`).
    """

    def __init__(self, leaves: dict, tensor: int, cut_keys):
        """``leaves``: every value kept, in order, with the dimension it is computed cut on (None:
        whole); a cut dimension the tensor devices do not divide is taken as whole."""
        self.tensor = tensor
        self.cut_keys = frozenset(cut_keys)
        self.whole: dict = {}  # leaf -> offset in its buffer's whole part
        self.whole_elems: dict = {}  # buffer -> elements of its whole part
        self.cut: dict = {}  # leaf -> (first column, cut dimension)
        self.columns: dict = {}  # buffer -> columns one microbatch's values take
        leaves = {leaf: d if d is not None and leaf.shape[d] % tensor == 0 else None for leaf, d in leaves.items()}
        for key in self.cut_keys:
            mine = [(leaf, d) for leaf, d in leaves.items() if leaf.key == key]
            offset = 0
            for leaf, d in mine:
                if d is None:
                    self.whole[leaf] = offset
                    offset += leaf.size
            self.whole_elems[key] = offset
            column = -(-offset // tensor)
            for leaf, d in mine:
                if d is not None:
                    self.cut[leaf] = (column, d)
                    column += leaf.size // tensor
            self.columns[key] = column

    @classmethod
    def of_stash(cls, plan, in_dims: list, tensor: int, cut_keys) -> CutArena:
        """A stage class's stashed residuals (``plan``: its residual plan; ``in_dims``: the cut
        dimension of each of the stage's inputs, as :func:`cut_dims` takes them)."""
        dims = cut_dims(plan.closed, in_dims)
        outs = plan.closed.jaxpr.outvars[len(plan.out_avals) :]
        leaves = {}
        for v, src in zip(outs, plan.sources):
            if src[0] == "stash" and src[1] not in leaves:
                leaves[src[1]] = dims.get(v) if isinstance(v, Var) else None
        return cls(leaves, tensor, cut_keys)

    def cut_bytes(self) -> int:
        """Bytes of the residuals kept as shares (not gathered) for one microbatch, whole."""
        return sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in self.cut)

    def _rows(self, vec):
        from jax.sharding import PartitionSpec as P

        return jax.lax.with_sharding_constraint(vec, P(TENSOR, None))

    def _along(self, value, d: int):
        from jax.sharding import PartitionSpec as P

        return jax.lax.with_sharding_constraint(value, P(*[TENSOR if i == d else None for i in range(value.ndim)]))

    def pack(self, key, parts, pin=None):
        """A forward's residuals of one buffer ``[(leaf, value), ...]``: ``[tensor, columns]`` for a
        cut buffer, the flat vector otherwise."""

        if key not in self.cut_keys:
            return flat_pack(parts, pin)
        t = self.tensor
        pieces = []
        whole = [(leaf, value) for leaf, value in parts if leaf not in self.cut]
        if whole:
            pieces.append(as_rows(flat_pack(whole, pin), t))
        for leaf, value in parts:
            if leaf in self.cut:
                d = self.cut[leaf][1]
                shape = value.shape
                value = self._along(value, d).reshape(*shape[:d], t, shape[d] // t, *shape[d + 1 :])
                pieces.append(self._rows(jnp.moveaxis(value, d, 0).reshape(t, -1)))
        return self._rows(jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0])

    def unpacker(self, pin=None):
        """``unpack(leaf, slot)`` for :meth:`~jaxmem.pipeline.ResidualPlan.pullback`: a residual read
        back from its buffer's slot (``[tensor, columns]`` for a cut buffer), its whole part gathered
        once per buffer."""

        gathered = {}
        t = self.tensor

        def unpack(leaf, slot):
            key = leaf.key
            if key not in self.cut_keys:
                return flat_unpack(leaf, slot, pin)
            if leaf in self.cut:
                column, d = self.cut[leaf]
                block = jax.lax.slice_in_dim(self._rows(slot), column, column + leaf.size // t, axis=1)
                inner = list(leaf.shape)
                inner[d] //= t
                value = jnp.moveaxis(block.reshape(t, *inner), 0, d).reshape(leaf.shape)
                return self._along(value, d)
            if key not in gathered:
                from jax.sharding import PartitionSpec as P

                rows = -(-self.whole_elems[key] // t)
                part = jax.lax.slice_in_dim(slot, 0, rows, axis=1)
                gathered[key] = jax.lax.with_sharding_constraint(part, P()).reshape(-1)[: self.whole_elems[key]]
            offset = self.whole[leaf]
            value = jax.lax.slice_in_dim(gathered[key], offset, offset + leaf.size).reshape(leaf.shape)
            return value if pin is None else pin(value)

        return unpack
