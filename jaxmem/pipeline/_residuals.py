"""Stage forward with its ``jax.vjp`` residuals laid out for a stash buffer, and the backward rebuilt
from a stash slot.

We trace ``jax.vjp`` of the stage once into a jaxpr whose outputs are the stage output followed by
the pullback's residual leaves. That jaxpr fixes the residual order (the pullback's treedef comes
from the same trace), so a forward branch that evaluates it and a backward branch that unflattens
its saved leaves agree, whatever order another trace would give. Each residual is then sorted by
where it comes from:

- a parameter (the stage weights, the shared embedding/head) -> taken from the parameters at
  backward time, never stashed;
- a leaf of the microbatch (tokens, targets, a loss mask, positions) -> taken from the batch at
  backward time;
- computed from parameters and constants only (a transposed weight, a causal mask) -> recomputed in
  the backward branch from the same jaxpr (XLA drops everything else);
- anything that depends on the microbatch -> packed into the stash, one flat vector per dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var, jaxpr_as_fun

__all__ = ["ResidualPlan", "analyze_stage", "emitted_tags", "flat_pack", "flat_unpack", "host_tile_elems"]


def host_tile_elems(dtype) -> int:
    """Elements of one TPU memory tile of ``dtype`` (8 x 128 32-bit words, 16-bit values packed two to a
    word): the unit a TPU host stash is laid out in. The TPU's asynchronous copies into host memory take
    whole tiles only (a flat host buffer updated at any other offset fails to compile, "Lane slice
    updating is not supported in async dynamic update slice"; a slice of a partial tile aborts the
    compiler), so every residual a TPU keeps on host starts on a tile and fills whole tiles."""
    return 1024 * max(1, 4 // np.dtype(dtype).itemsize)


def host_tile_shape(dtype) -> tuple[int, int]:
    """``(sublanes, lanes)`` of one :func:`host_tile_elems` tile of ``dtype``."""
    return host_tile_elems(dtype) // 128, 128


@dataclasses.dataclass(frozen=True)
class StashedLeaf:
    """Where one stashed residual sits: buffer ``(dtype, space)``, element offset, shape.

    ``memory_space`` is how the jaxpr types the residual ("host" for tags a checkpoint policy
    offloads); ``space`` is the buffer it is kept in between F and B (also "host" when the whole
    stash is offloaded).
    """

    dtype: str
    offset: int
    shape: tuple[int, ...]
    memory_space: str
    space: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def key(self) -> tuple[str, str]:
        return (self.dtype, self.space)


@dataclasses.dataclass(frozen=True)
class ResidualPlan:
    """How one stage class's residuals are produced, stored and restored.

    Attributes:
        closed: jaxpr of ``(params..., shared..., x..., batch...) -> (out..., *residuals)``.
        treedef: treedef of the pullback whose leaves are the residuals.
        out_tree: treedef of the stage output (the message, or ``(loss_sum, weight)``).
        out_avals: the stage output's leaves, abstract.
        sources: per residual, ``("param", i)``, ``("shared", j)``, ``("batch", k)``,
            ``("derived",)``, ``("literal", value)`` or ``("stash", StashedLeaf)``.
        stash_elems: per buffer ``(dtype, space)``, elements one microbatch stashes.
        used_shared: per shared leaf, whether the stage reads it at all (the middle stages read none
            of the embedding and head: they neither gather them nor add to their gradients).
        host_tiles: host residuals start on a TPU tile and fill whole tiles (:func:`host_tile_elems`).
        out_inputs: per output leaf, whether it depends on any input (parameters, shared, ``x`` or the
            batch); one that does not (a constant the stage starts, say a counter) carries no
            gradient back.
    """

    closed: ClosedJaxpr
    treedef: object
    out_tree: object
    out_avals: tuple
    n_params: int
    n_shared: int
    sources: tuple
    stash_elems: dict
    used_shared: tuple = ()
    host_tiles: bool = False
    out_inputs: tuple = ()

    def stash_bytes_by_buffer(self) -> dict[tuple[str, str], int]:
        return {key: n * np.dtype(key[0]).itemsize for key, n in self.stash_elems.items()}

    def stash_bytes(self, space: str | None = None) -> int:
        """Bytes one microbatch stashes (on ``space`` only, when given)."""
        return sum(b for key, b in self.stash_bytes_by_buffer().items() if space in (None, key[1]))

    def stashed_leaves(self) -> list[StashedLeaf]:
        return list(dict.fromkeys(src[1] for src in self.sources if src[0] == "stash"))

    def forward(
        self,
        params,
        shared,
        x,
        batch,
        pin: Callable | None = None,
        pack: Callable | None = None,
        host_put: Callable | None = None,
    ):
        """Run the stage: returns ``(out, packed)``, packed = {(dtype, space): flat vector}. ``pin``:
        applied to each stashed residual before it is flattened (the executor's sharding constraint).
        ``pack``: ``pack(key, [(leaf, value), ...]) -> packed value`` in place of the flat vector
        (the executor's layout of an arena cut over ``tensor``). ``host_put(leaf, value)``: a residual
        kept on host as its host arena holds it (default: moved to host as it is)."""
        flat = jax.tree.leaves(params) + jax.tree.leaves(shared) + jax.tree.leaves(x) + jax.tree.leaves(batch)
        outs = jaxpr_as_fun(self.closed)(*flat)
        n_out = len(self.out_avals)
        out, residuals = jax.tree_util.tree_unflatten(self.out_tree, outs[:n_out]), outs[n_out:]
        pieces: dict[tuple[str, str], list] = {key: [] for key in self.stash_elems}
        seen = set()
        for value, src in zip(residuals, self.sources):
            if src[0] == "stash" and src[1] not in seen:
                leaf = src[1]
                seen.add(leaf)
                if host_put is not None and leaf.space == "host":
                    value = host_put(leaf, value)
                elif leaf.space == "host" and leaf.memory_space != "host":
                    value = jax.device_put(value, jax.memory.Space.Host)
                pieces[leaf.key].append((leaf, value))
        pack = pack or (lambda key, parts: flat_pack(parts, pin))
        return out, {key: pack(key, parts) for key, parts in pieces.items()}

    def pullback(
        self, params, shared, x_like, batch, packed, pin: Callable | None = None, unpack: Callable | None = None
    ) -> Callable:
        """Rebuild the stage's pullback from parameters, the batch and a stash slot (``pin``: applied to
        each residual as it is read back, as in :meth:`forward`; ``unpack(leaf, packed[key])``: the
        residual, in place of slicing the flat vector). A host buffer's slot may come on host or
        already brought to the device; each residual is handed over in the memory space the
        pullback's types say."""
        param_leaves = jax.tree.leaves(params)
        shared_leaves = jax.tree.leaves(shared)
        batch_leaves = jax.tree.leaves(batch)
        derived = None
        if any(src[0] == "derived" for src in self.sources):
            # Only the parameter-derived outputs are used; XLA removes the rest of this forward.
            zeros = [jnp.zeros_like(a) for a in jax.tree.leaves(x_like)]
            outs = jaxpr_as_fun(self.closed)(*param_leaves, *shared_leaves, *zeros, *batch_leaves)
            derived = outs[len(self.out_avals) :]
        residuals = []
        for i, src in enumerate(self.sources):
            kind = src[0]
            if kind == "param":
                residuals.append(param_leaves[src[1]])
            elif kind == "shared":
                residuals.append(shared_leaves[src[1]])
            elif kind == "batch":
                residuals.append(batch_leaves[src[1]])
            elif kind == "literal":
                residuals.append(src[1])
            elif kind == "derived":
                residuals.append(derived[i])
            else:
                leaf = src[1]
                value = (unpack or (lambda leaf, vec: flat_unpack(leaf, vec, pin)))(leaf, packed[leaf.key])
                if leaf.space == "host":
                    space = jax.memory.Space.Host if leaf.memory_space == "host" else jax.memory.Space.Device
                    value = jax.device_put(value, space)
                residuals.append(value)
        return jax.tree_util.tree_unflatten(self.treedef, residuals)


def flat_pack(parts, pin: Callable | None = None):
    """One buffer's stashed residuals ``[(leaf, value), ...]`` as one flat vector, in leaf order
    (``pin``: applied to each value first)."""
    flat = [jnp.ravel(value if pin is None else pin(value)) for _, value in parts]
    return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def flat_unpack(leaf: StashedLeaf, vec, pin: Callable | None = None):
    """A residual read back from its buffer's flat vector (``pin``: applied to it)."""
    value = jax.lax.slice_in_dim(vec, leaf.offset, leaf.offset + leaf.size).reshape(leaf.shape)
    return value if pin is None else pin(value)


def _memory_space(aval) -> str:
    space = getattr(aval, "memory_space", None)
    return "host" if space is not None and "host" in str(space).lower() else "device"


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def emitted_tags(fn: Callable, *args) -> set[str]:
    """The ``checkpoint_name`` tags ``fn(*args)`` emits (nested jaxprs included), traced abstractly."""
    found: set[str] = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                found.add(eqn.params["name"])
            for inner in _sub_jaxprs(eqn):
                walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def analyze_stage(
    stage_fn: Callable, params, shared, x, batch, *, stash_to_host: bool = False, host_tiles: bool = False
) -> ResidualPlan:
    """Trace ``jax.vjp`` of ``stage_fn(params, shared, x, batch)`` w.r.t. params, shared and x.

    With ``stash_to_host`` every stashed residual is kept in host buffers between F and B; with
    ``host_tiles`` (a TPU) each residual kept on host starts on a tile and fills whole tiles
    (:func:`host_tile_elems`).
    """
    box = {}

    def fwd(params, shared, x, batch):
        out, pullback = jax.vjp(lambda p, s, xx: stage_fn(p, s, xx, batch), params, shared, x)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        box["treedef"], box["out_tree"] = treedef, out_tree
        return out_leaves, leaves

    closed = jax.make_jaxpr(fwd)(params, shared, x, batch)
    jaxpr = closed.jaxpr
    n_params = len(jax.tree.leaves(params))
    n_shared = len(jax.tree.leaves(shared))
    n_x = len(jax.tree.leaves(x))
    invars = list(jaxpr.invars)
    x_vars = invars[n_params + n_shared : n_params + n_shared + n_x]
    batch_vars = invars[n_params + n_shared + n_x :]
    n_out = box["out_tree"].num_leaves

    # Which values depend on the microbatch (x and the batch)? Nested jaxprs count as one op.
    per_microbatch = set(x_vars) | set(batch_vars)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in per_microbatch for v in eqn.invars):
            per_microbatch.update(eqn.outvars)

    position = {v: i for i, v in enumerate(invars)}
    batch_position = {v: k for k, v in enumerate(batch_vars)}
    sources, stash_elems, stashed = [], {}, {}
    for v in jaxpr.outvars[n_out:]:
        if isinstance(v, Literal):
            sources.append(("literal", v.val))
            continue
        if v in stashed:  # the same value saved twice (e.g. a block output and the next block input)
            sources.append(("stash", stashed[v]))
            continue
        i = position.get(v)
        if i is not None and i < n_params:
            sources.append(("param", i))
        elif i is not None and i < n_params + n_shared:
            sources.append(("shared", i - n_params))
        elif v in batch_position:
            sources.append(("batch", batch_position[v]))
        elif v in per_microbatch:
            aval = v.aval
            dtype = np.dtype(aval.dtype).name
            memory_space = _memory_space(aval)
            space = "host" if stash_to_host or memory_space == "host" else "device"
            offset = stash_elems.get((dtype, space), 0)
            leaf = StashedLeaf(dtype, offset, tuple(aval.shape), memory_space, space)
            end = offset + leaf.size
            if host_tiles and space == "host":
                end = offset + _round_up(leaf.size, host_tile_elems(dtype))
            stash_elems[(dtype, space)] = end
            stashed[v] = leaf
            sources.append(("stash", leaf))
        else:
            sources.append(("derived",))
    depends = set(invars)  # values computed from an input (what is left is computed from constants)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in depends for v in eqn.invars):
            depends.update(eqn.outvars)
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)} | {
        v for v in jaxpr.outvars if isinstance(v, Var)
    }
    shared_vars = invars[n_params : n_params + n_shared]
    return ResidualPlan(
        used_shared=tuple(v in used for v in shared_vars),
        closed=closed,
        treedef=box["treedef"],
        out_tree=box["out_tree"],
        out_avals=tuple(v.aval for v in jaxpr.outvars[:n_out]),
        n_params=n_params,
        n_shared=n_shared,
        sources=tuple(sources),
        stash_elems=stash_elems,
        host_tiles=host_tiles,
        out_inputs=tuple(isinstance(v, Var) and v in depends for v in jaxpr.outvars[:n_out]),
    )


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit
