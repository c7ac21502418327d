"""Stage forward with its ``jax.vjp`` residuals laid out for a stash buffer, and the backward rebuilt
from a stash slot.

We trace ``jax.vjp`` of the stage once into a jaxpr whose outputs are the stage output followed by
the pullback's residual leaves. That jaxpr fixes the residual order (the pullback's treedef comes
from the same trace), so a forward branch that evaluates it and a backward branch that unflattens
its saved leaves agree, whatever order another trace would give. Each residual is then sorted by
where it comes from:

- a parameter (the stage weights, the shared embedding/head) -> taken from the parameters at
  backward time, never stashed;
- tokens / targets -> taken from the batch at backward time;
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

__all__ = ["ResidualPlan", "analyze_stage"]


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
        closed: jaxpr of ``(params..., shared..., x, tokens, targets) -> (out, *residuals)``.
        treedef: treedef of the pullback whose leaves are the residuals.
        sources: per residual, ``("param", i)``, ``("shared", j)``, ``("tokens",)``, ``("targets",)``,
            ``("derived",)``, ``("literal", value)`` or ``("stash", StashedLeaf)``.
        stash_elems: per buffer ``(dtype, space)``, elements one microbatch stashes.
    """

    closed: ClosedJaxpr
    treedef: object
    n_params: int
    n_shared: int
    sources: tuple
    stash_elems: dict
    out_aval: object

    def stash_bytes_by_buffer(self) -> dict[tuple[str, str], int]:
        return {key: n * np.dtype(key[0]).itemsize for key, n in self.stash_elems.items()}

    def stash_bytes(self, space: str | None = None) -> int:
        """Bytes one microbatch stashes (on ``space`` only, when given)."""
        return sum(b for key, b in self.stash_bytes_by_buffer().items() if space in (None, key[1]))

    def stashed_leaves(self) -> list[StashedLeaf]:
        return list(dict.fromkeys(src[1] for src in self.sources if src[0] == "stash"))

    def forward(self, params, shared, x, tokens, targets):
        """Run the stage: returns ``(out, packed)``, packed = {(dtype, space): flat vector}."""
        flat = jax.tree.leaves(params) + jax.tree.leaves(shared) + [x, tokens, targets]
        outs = jaxpr_as_fun(self.closed)(*flat)
        out, residuals = outs[0], outs[1:]
        pieces: dict[tuple[str, str], list] = {key: [] for key in self.stash_elems}
        seen = set()
        for value, src in zip(residuals, self.sources):
            if src[0] == "stash" and src[1] not in seen:
                leaf = src[1]
                seen.add(leaf)
                if leaf.space == "host" and leaf.memory_space != "host":
                    value = jax.device_put(value, jax.memory.Space.Host)
                pieces[leaf.key].append(jnp.ravel(value))
        packed = {key: jnp.concatenate(parts) if len(parts) > 1 else parts[0] for key, parts in pieces.items()}
        return out, packed

    def pullback(self, params, shared, x_like, tokens, targets, packed) -> Callable:
        """Rebuild the stage's pullback from parameters, the batch and a stash slot."""
        param_leaves = jax.tree.leaves(params)
        shared_leaves = jax.tree.leaves(shared)
        derived = None
        if any(src[0] == "derived" for src in self.sources):
            # Only the parameter-derived outputs are used; XLA removes the rest of this forward.
            zeros = jnp.zeros_like(x_like)
            derived = jaxpr_as_fun(self.closed)(*param_leaves, *shared_leaves, zeros, tokens, targets)[1:]
        residuals = []
        for i, src in enumerate(self.sources):
            kind = src[0]
            if kind == "param":
                residuals.append(param_leaves[src[1]])
            elif kind == "shared":
                residuals.append(shared_leaves[src[1]])
            elif kind == "tokens":
                residuals.append(tokens)
            elif kind == "targets":
                residuals.append(targets)
            elif kind == "literal":
                residuals.append(src[1])
            elif kind == "derived":
                residuals.append(derived[i])
            else:
                leaf = src[1]
                value = jax.lax.slice_in_dim(packed[leaf.key], leaf.offset, leaf.offset + leaf.size)
                value = value.reshape(leaf.shape)
                if leaf.space == "host" and leaf.memory_space != "host":
                    value = jax.device_put(value, jax.memory.Space.Device)
                residuals.append(value)
        return jax.tree_util.tree_unflatten(self.treedef, residuals)


def _memory_space(aval) -> str:
    space = getattr(aval, "memory_space", None)
    return "host" if space is not None and "host" in str(space).lower() else "device"


def analyze_stage(
    stage_fn: Callable, params, shared, x, tokens, targets, *, stash_to_host: bool = False
) -> ResidualPlan:
    """Trace ``jax.vjp`` of ``stage_fn(params, shared, x, tokens, targets)`` w.r.t. params, shared, x.

    With ``stash_to_host`` every stashed residual is kept in host buffers between F and B.
    """
    box = {}

    def fwd(params, shared, x, tokens, targets):
        out, pullback = jax.vjp(lambda p, s, xx: stage_fn(p, s, xx, tokens, targets), params, shared, x)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        box["treedef"] = treedef
        return out, leaves

    flat_args = (params, shared, x, tokens, targets)
    closed = jax.make_jaxpr(fwd)(*flat_args)
    jaxpr = closed.jaxpr
    n_params = len(jax.tree.leaves(params))
    n_shared = len(jax.tree.leaves(shared))
    invars = list(jaxpr.invars)
    x_var, tok_var, tgt_var = invars[n_params + n_shared :]

    # Which values depend on the microbatch (x, tokens, targets)? Nested jaxprs count as one op.
    per_microbatch = {x_var, tok_var, tgt_var}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in per_microbatch for v in eqn.invars):
            per_microbatch.update(eqn.outvars)

    position = {v: i for i, v in enumerate(invars)}
    sources, stash_elems, stashed = [], {}, {}
    for v in jaxpr.outvars[1:]:
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
        elif v is tok_var:
            sources.append(("tokens",))
        elif v is tgt_var:
            sources.append(("targets",))
        elif v in per_microbatch:
            aval = v.aval
            dtype = np.dtype(aval.dtype).name
            memory_space = _memory_space(aval)
            space = "host" if stash_to_host or memory_space == "host" else "device"
            offset = stash_elems.get((dtype, space), 0)
            leaf = StashedLeaf(dtype, offset, tuple(aval.shape), memory_space, space)
            stash_elems[(dtype, space)] = offset + leaf.size
            stashed[v] = leaf
            sources.append(("stash", leaf))
        else:
            sources.append(("derived",))
    return ResidualPlan(
        closed=closed,
        treedef=box["treedef"],
        n_params=n_params,
        n_shared=n_shared,
        sources=tuple(sources),
        stash_elems=stash_elems,
        out_aval=jaxpr.outvars[0].aval,
    )
