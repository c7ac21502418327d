"""A stage's backward split into its input-gradient part (I) and its weight-gradient part (W), for
zero-bubble schedules, without running the backward twice.

A stage's pullback, traced into one jaxpr from its inputs (parameters, batch, stash, the output's
cotangent) to ``(d_params, d_shared, d_x)``, is partitioned by its equations:

- **I** is every equation ``d_x`` needs: the cotangents flowing back through the layers, and the
  forward recomputation a policy asks for.
- **W** is what the weight gradients need beyond that. A value I computed that depends on the
  cotangent (an activation's gradient at a matmul's output, say) is handed from I to W through the
  stash, a *transfer*; a value that depends on the stash and parameters only (a recomputed
  activation) is computed again by W, which is cheaper in memory than keeping it between I and W.
  With ``hand_recomputed`` those are handed over too -- every value I computed from the stash, the
  microbatch or the cotangent that W reads -- so W recomputes no forward: a forward's FLOPs less per
  W under a policy that recomputes, for the recomputed activations' bytes kept from I to W. Values
  of the parameters alone (a transpose, a cast) are still computed again.

With a ``tensor`` axis the transfer arenas are cut over it as the stash arenas are
(:meth:`StageSplit.transfer_arena`): a transfer I computes cut stays each device's share, the rest
are cut as one flat vector, which W gathers back.

Before this split I and W each ran the whole pullback, XLA dropping only the outputs each discards:
W then ran the cotangents' whole chain through the stage again (issue 28). Now the chain runs once,
in I, and W runs the weight-gradient products (and any forward recomputation its products read).

The jaxpr is evaluated equation by equation (as ``jax.core.eval_jaxpr`` does), so the split is
traced into the executor's program like any other code. Calls are inlined first -- the whole
backward of a ``jax.checkpoint``-ed stage is one ``remat`` equation, a ``jit``-ed function one
``pjit`` -- so that the partition sees their equations; other higher-order primitives (a ``scan``, a
``cond``) stay one equation each, run by I when ``d_x`` needs them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.extend.core import Literal, Var

from jaxmem.pipeline._cut import CutArena, cut_dims
from jaxmem.pipeline._residuals import StashedLeaf

__all__ = ["TRANSFER_SPACE", "IWSplit", "StageSplit", "abstract_split", "split_backward", "stage_split"]

# The arenas what an I hands its W lives in, one per dtype, apart from the stash arenas: an I reads
# its stash and writes its transfers, and XLA updates a buffer in place only where the branch that
# writes it does not also read it (measured: one arena, written where it was read, was copied whole
# in every I's cond).
TRANSFER_SPACE = "i-to-w"


@dataclasses.dataclass(frozen=True, eq=False)
class IWSplit:
    """A backward jaxpr's I and W parts (see the module docstring).

    Attributes:
        closed: the backward, ``(*inputs) -> (*outputs)``.
        i_outputs / w_outputs: indices of the outputs I and W give.
        i_eqns / w_eqns: the equations each runs, in program order.
        transfers: the values I hands W (its extra outputs, W's extra inputs), in order.
    """

    closed: object
    i_outputs: tuple[int, ...]
    w_outputs: tuple[int, ...]
    i_eqns: tuple
    w_eqns: tuple
    transfers: tuple

    @property
    def transfer_avals(self) -> tuple:
        return tuple(v.aval for v in self.transfers)

    def transfer_places(self) -> tuple[list[tuple[str, int]], dict[str, int]]:
        """Where the transfers lie in their arenas, one per dtype: per transfer ``(dtype, offset)``
        from its class's start there, in order; and the elements each dtype's take."""
        places, used = [], {}
        for aval in self.transfer_avals:
            name = np.dtype(aval.dtype).name
            places.append((name, used.get(name, 0)))
            used[name] = used.get(name, 0) + int(np.prod(aval.shape, dtype=np.int64))
        return places, used

    def transfer_elems(self) -> dict[str, int]:
        """Elements the transfers take per dtype (one stage-microbatch)."""
        return self.transfer_places()[1]

    def run_i(self, *inputs) -> tuple[list, list]:
        """I: ``(its outputs, the transfers)``."""
        env = self._bind(inputs)
        _run(self.i_eqns, env)
        outvars = self.closed.jaxpr.outvars
        return [_read(env, outvars[i]) for i in self.i_outputs], [_read(env, v) for v in self.transfers]

    def run_w(self, inputs, transfers) -> list:
        """W: its outputs, from the inputs and I's transfers."""
        env = self._bind(inputs)
        env.update(zip(self.transfers, transfers, strict=True))
        _run(self.w_eqns, env)
        outvars = self.closed.jaxpr.outvars
        return [_read(env, outvars[i]) for i in self.w_outputs]

    def _bind(self, inputs) -> dict:
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.constvars, self.closed.consts, strict=True))
        env.update(zip(jaxpr.invars, inputs, strict=True))
        return env


def _read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def _run(eqns, env) -> None:
    """Bind ``eqns`` in order over ``env`` (as ``jax.core.eval_jaxpr`` does, with each equation's
    context: its name stack and, e.g., its compute placement)."""
    for eqn in eqns:
        env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars]), strict=True))


def _bind(eqn, invals) -> list:
    """One equation bound on ``invals`` in its context; its outputs as a list."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


# Call-like primitives whose body is inlined before the partition (their parameter holding it).
_INLINED = {"remat2": "jaxpr", "checkpoint": "jaxpr", "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr"}
_INLINED |= {"core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def _eval_inlined(jaxpr, consts, args) -> list:
    """Evaluate ``jaxpr`` binding every equation but the calls of :data:`_INLINED`, whose bodies are
    evaluated in their place (recursively)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        body = eqn.params.get(_INLINED.get(eqn.primitive.name, ""))
        if body is not None:
            inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())
            outs = _eval_inlined(inner, inner_consts, invals)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [_read(env, v) for v in jaxpr.outvars]


def _needed(eqns, outvars, stop=lambda v: False) -> tuple[set[int], set]:
    """Equations (indices) the ``outvars`` need, walking back from them; a var for which ``stop``
    holds is taken as given (its producer not followed). Returns ``(equations, given vars reached)``."""
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    live = {v for v in outvars if isinstance(v, Var)}
    stack = list(live)
    needed: set[int] = set()
    given = set()
    while stack:
        v = stack.pop()
        if stop(v):
            given.add(v)
            continue
        i = producer.get(v)
        if i is None or i in needed:
            continue
        needed.add(i)
        for u in eqns[i].invars:
            if isinstance(u, Var) and u not in live:
                live.add(u)
                stack.append(u)
    return needed, given


def _depending_on(eqns, sources: set) -> set:
    """The vars that depend on any of ``sources`` (themselves included), in program order."""
    found = set(sources)
    for eqn in eqns:
        if any(isinstance(u, Var) and u in found for u in eqn.invars):
            found.update(eqn.outvars)
    return found


def split_backward(closed, i_outputs, w_outputs, handed_inputs) -> IWSplit:
    """Partition a backward's jaxpr (``closed``, a ClosedJaxpr) into I (the outputs at indices
    ``i_outputs``: the input gradient) and W (``w_outputs``: the weight gradients). A value I computes
    that W reads is handed over when it depends on an input at the indices ``handed_inputs`` (the
    output's cotangent; with ``hand_recomputed``, also the stash and the microbatch), and computed
    again by W otherwise."""
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    i_set, _ = _needed(eqns, [jaxpr.outvars[i] for i in i_outputs])
    handed = _depending_on(eqns, {jaxpr.invars[i] for i in handed_inputs})
    made_by_i = {v for i in i_set for v in eqns[i].outvars}
    w_set, given = _needed(eqns, [jaxpr.outvars[i] for i in w_outputs], stop=lambda v: v in made_by_i and v in handed)
    position = {v: (i, k) for i, eqn in enumerate(eqns) for k, v in enumerate(eqn.outvars)}
    transfers = tuple(sorted(given, key=lambda v: position[v]))
    return IWSplit(
        closed=closed,
        i_outputs=tuple(i_outputs),
        w_outputs=tuple(w_outputs),
        i_eqns=tuple(eqns[i] for i in sorted(i_set)),
        w_eqns=tuple(eqns[i] for i in sorted(w_set)),
        transfers=transfers,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class StageSplit:
    """A stage's backward, ``(params, shared, micro, stash, ct) -> (d_params, d_shared, d_x)``, split
    into I and W (:func:`stage_split`)."""

    split: IWSplit
    out_trees: tuple  # treedefs of d_params, d_shared, d_x

    def input_grad(self, args) -> tuple[object, list]:
        """I: ``(d_x, transfers)`` (``d_x`` None when nothing needs it)."""
        values, transfers = self.split.run_i(*jax.tree.leaves(args))
        return (jax.tree.unflatten(self.out_trees[2], values) if self.split.i_outputs else None), transfers

    def transfer_elems(self) -> dict[tuple[str, str], int]:
        """Per transfer arena ``(dtype, TRANSFER_SPACE)``, the elements I hands W."""
        return {(dtype, TRANSFER_SPACE): n for dtype, n in self.split.transfer_elems().items()}

    def transfer_leaves(self) -> list[StashedLeaf]:
        """The transfers as stashed values of the transfer arenas, in order."""
        places = self.split.transfer_places()[0]
        return [
            StashedLeaf(name, off, tuple(a.shape), "device", TRANSFER_SPACE)
            for a, (name, off) in zip(self.split.transfer_avals, places, strict=True)
        ]

    def transfer_arena(self, in_dims: list, tensor: int) -> CutArena:
        """Where the transfers sit in transfer arenas cut over ``tensor`` devices, as a stash is
        (:class:`~jaxmem.pipeline._cut.CutArena`): a transfer I computes cut stays each device's share,
        the others are cut as one flat vector and gathered back by W. ``in_dims``: the cut dimension
        of each of the backward's flat inputs (``(params, shared, micro, stash, ct)``)."""
        dims = cut_dims(self.split.closed, in_dims)
        leaves = self.transfer_leaves()
        found = {leaf: dims.get(v) for leaf, v in zip(leaves, self.split.transfers, strict=True)}
        return CutArena(found, tensor, {leaf.key for leaf in leaves})

    def hand_over(self, arenas: dict, base: dict, transfers, cut: CutArena | None = None, pin=None) -> dict:
        """I's transfers written in place into their arenas (``arenas``: per dtype name, a flat
        buffer, or ``[tensor, rows]`` cut as ``cut`` lays them out; ``base``: per dtype, where this
        stage-microbatch's region starts; ``pin``: how whole values are held, as the stash's)."""
        arenas = dict(arenas)
        leaves = self.transfer_leaves()
        if cut is not None:
            for key in dict.fromkeys(leaf.key for leaf in leaves):
                parts = [(leaf, value) for leaf, value in zip(leaves, transfers, strict=True) if leaf.key == key]
                packed = cut.pack(key, parts, pin)
                arenas[key[0]] = jax.lax.dynamic_update_slice_in_dim(arenas[key[0]], packed, base[key[0]], 1)
            return arenas
        for value, leaf in zip(transfers, leaves, strict=True):
            name = leaf.dtype
            arenas[name] = jax.lax.dynamic_update_slice_in_dim(
                arenas[name], jax.numpy.ravel(value), base[name] + leaf.offset, 0
            )
        return arenas

    def take_over(self, arenas: dict, base: dict, cut: CutArena | None = None, pin=None) -> list:
        """W's transfers read back out of their arenas (as :meth:`hand_over` wrote them)."""
        leaves = self.transfer_leaves()
        if cut is not None:
            unpack = cut.unpacker(pin)
            slots = {
                key: jax.lax.dynamic_slice_in_dim(arenas[key[0]], base[key[0]], cut.columns[key], 1)
                for key in dict.fromkeys(leaf.key for leaf in leaves)
            }
            return [unpack(leaf, slots[leaf.key]) for leaf in leaves]
        return [
            jax.lax.dynamic_slice_in_dim(arenas[leaf.dtype], base[leaf.dtype] + leaf.offset, leaf.size, 0).reshape(
                leaf.shape
            )
            for leaf in leaves
        ]

    def weight_grads(self, args, transfers) -> tuple[object, object]:
        """W: ``(d_params, d_shared)`` from the same arguments and I's transfers."""
        values = self.split.run_w(jax.tree.leaves(args), transfers)
        n = self.out_trees[0].num_leaves
        return jax.tree.unflatten(self.out_trees[0], values[:n]), jax.tree.unflatten(self.out_trees[1], values[n:])


def stage_split(
    backward, params, shared, micro, stash, ct, *, input_grad: bool = True, hand_recomputed: bool = False
) -> StageSplit:
    """Split ``backward(params, shared, micro, stash, ct) -> (d_params, d_shared, d_x)`` (a stage's
    pullback from its stash slot, :meth:`~jaxmem.pipeline.ResidualPlan.pullback`), traced at the
    given values or abstract values. ``input_grad=False``: nothing needs the stage's input gradient
    (the first stage with its embedding whole): I is empty and W is the whole backward.
    ``hand_recomputed``: I hands W the forward values it recomputed too (the module docstring)."""
    args = (params, shared, micro, stash, ct)
    nested, shapes = jax.make_jaxpr(backward, return_shape=True)(*args)
    closed = jax.make_jaxpr(lambda *flat: _eval_inlined(nested.jaxpr, nested.consts, flat))(*jax.tree.leaves(args))
    trees = tuple(jax.tree.structure(part) for part in shapes)
    n_params, n_shared, n_x = (t.num_leaves for t in trees)
    n_in = len(jax.tree.leaves(args))
    # The inputs are (params, shared, micro, stash, ct): the cotangent's last, the activations' after
    # the parameters.
    first_handed = len(jax.tree.leaves((params, shared))) if hand_recomputed else n_in - len(jax.tree.leaves(ct))
    split = split_backward(
        closed,
        i_outputs=range(n_params + n_shared, n_params + n_shared + n_x) if input_grad else (),
        w_outputs=range(n_params + n_shared),
        handed_inputs=range(first_handed, n_in),
    )
    return StageSplit(split, trees)


def abstract_split(
    plan, params, shared, micro, message, *, input_grad: bool = True, hand_recomputed: bool = False
) -> StageSplit:
    """A stage's backward split into I and W, traced abstractly (what the executor's split traces,
    so the same transfers): ``plan`` the stage's :class:`~jaxmem.pipeline.ResidualPlan`,
    ``params``/``shared``/``micro``/``message`` its parameters, shared parameters, microbatch and
    input as abstract values; ``input_grad`` and ``hand_recomputed`` as in :func:`stage_split`."""
    import jax.numpy as jnp

    current = {k: jax.ShapeDtypeStruct((n,), jnp.dtype(k[0])) for k, n in plan.stash_elems.items() if n}
    ct = jax.tree.unflatten(plan.out_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in plan.out_avals])

    def backward(params, shared, micro, current, ct):
        x_like = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), message)
        return plan.pullback(params, shared, x_like, micro, current)(ct)

    return stage_split(
        backward, params, shared, micro, current, ct, input_grad=input_grad, hand_recomputed=hand_recomputed
    )
