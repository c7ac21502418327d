"""The optimizer update with offloaded state streamed layer by layer.

A stage whose optimizer state (or weights) the policy keeps on host is updated one layer at a time:
a loop over the stage's layer axis fetches the layer's master weights and optimizer state to the
device, runs the update on that slice, and writes the result back to host, so the device holds one
layer's state during the update instead of the whole rank's. XLA sees the fetch and the write-back
as ``device_put``\\ s to a memory space around a dynamic slice of the host buffer, the pattern of
activations offloaded from a scanned loop; it may overlap one layer's transfers with the next one's
update. (Only the lowering is checked here, on CPU: no GPU compile has seen this loop.) Everything
else -- the device-resident stages, the shared leaves, the optimizer's counters -- is updated at
once, as before.

Streaming slices the optimizer's per-parameter state, so it holds only for an update that is
elementwise given the gradients: jaxmem's own optimizers (:func:`~jaxmem.train.make_optimizer`:
Adam or AdamW under a schedule) after the global-norm clip, which runs first over the whole gradient
(the gradients are on the device). A user's own optax transformation may not be elementwise; the
trainer brings its state to the device whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.pipeline import PipelineParams, is_placement
from jaxmem.train._state import on_host, to_device

__all__ = ["streamed_groups", "streamed_update"]

DEVICE = -1  # role of a leaf updated at once, on the device
NOT_A_PARAM = -2  # role of an optimizer-state leaf that is not shaped like a parameter (a step counter)


def _space(x):
    return jax.memory.Space.Host if on_host(x) else jax.memory.Space.Device


def streamed_groups(placement, streamed) -> PipelineParams:
    """Each leaf's role, shaped like the parameters: the index of the layer group it is streamed in
    (one group per family of a local stage position ``v`` with ``streamed[v]``), or ``DEVICE``.

    A leaf whose layer axis the mesh cuts (ZeRO may put ``data`` on it where no other dimension
    divides) is left to the device update: slicing it by the layer would move it between devices."""
    groups = 0
    stages = []
    for v, tree in enumerate(placement.stages):
        families = tree if isinstance(tree, tuple) else (tree,)
        roles = []
        for family in families:
            gid = groups if streamed[v] else DEVICE
            groups += bool(streamed[v])
            roles.append(
                jax.tree.map(
                    lambda p, g=gid: DEVICE if p.params[1] or p.state[1] else g,
                    family,
                    is_leaf=is_placement,
                )
            )
        stages.append(tuple(roles) if isinstance(tree, tuple) else roles[0])
    return PipelineParams(
        stages=tuple(stages),
        shared=jax.tree.map(lambda _: DEVICE, placement.shared, is_leaf=is_placement),
        vocab=jax.tree.map(lambda _: DEVICE, placement.vocab, is_leaf=is_placement),
    )


def _empty(x):
    """A stand-in for a leaf another part updates: no elements, the leaf's rank (masks read it)."""
    return jnp.zeros((0, *x.shape[1:]), x.dtype) if x.ndim else x


def streamed_update(inner, grads, opt_state, params, roles: PipelineParams, *, clip: float | None = None):
    """``(params, opt_state)`` after one step of ``inner`` (elementwise per parameter), preceded by
    clipping the gradients' global norm to ``clip`` (None: none; ``opt_state`` is then ``inner``'s, else
    ``(clip's, inner's)`` as :func:`optax.chain` keeps it). Leaves with a group in ``roles`` are
    updated layer by layer (see the module); the others at once, on the device. Every leaf comes back
    in the memory space it came in."""
    if clip:
        clip_state, state = opt_state
        grads, clip_state = optax.clip_by_global_norm(clip).update(grads, clip_state)
    else:
        state = opt_state
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves = p_def.flatten_up_to(grads)
    p_roles = p_def.flatten_up_to(roles)
    s_leaves, s_def = jax.tree.flatten(state)
    s_roles = jax.tree.leaves(
        optax.tree_map_params(inner, lambda _, r: r, state, roles, transform_non_params=lambda _: NOT_A_PARAM)
    )

    def update(gid, take, p_now, s_now):
        """``inner`` on the leaves of part ``gid`` (through ``take``), stand-ins for the rest: the part's
        new parameters and state, flat."""

        def part(leaves, leaf_roles):
            return [take(x) if r == gid else _empty(x) for x, r in zip(leaves, leaf_roles)]

        p = p_def.unflatten(part(p_now, p_roles))
        g = p_def.unflatten(part(g_leaves, p_roles))
        # The counters as the step found them: every part takes the same step.
        s = s_def.unflatten([x if r == NOT_A_PARAM else y for x, y, r in zip(s_leaves, part(s_now, s_roles), s_roles)])
        updates, s = inner.update(g, s, p)
        return jax.tree.leaves(optax.apply_updates(p, updates)), jax.tree.leaves(s)

    new_p, new_s = update(DEVICE, to_device, p_leaves, s_leaves)
    new_p = [x if r == DEVICE else old for x, old, r in zip(new_p, p_leaves, p_roles)]
    new_s = [x if r in (DEVICE, NOT_A_PARAM) else old for x, old, r in zip(new_s, s_leaves, s_roles)]
    for gid in sorted({r for r in p_roles if r >= 0}):
        new_p, new_s = _stream_group(update, gid, new_p, new_s, p_roles, s_roles)
    params = p_def.unflatten(new_p)
    state = s_def.unflatten(new_s)
    return params, ((clip_state, state) if clip else state)


def _stream_group(update, gid, p_leaves, s_leaves, p_roles, s_roles):
    """Group ``gid``'s parameters and state updated one layer (axis 1) at a time, in a loop whose
    carry is the group's leaves (in their own memory spaces)."""
    p_at = [i for i, r in enumerate(p_roles) if r == gid]
    s_at = [i for i, r in enumerate(s_roles) if r == gid]

    def replaced(leaves, at, values):
        leaves = list(leaves)
        for i, x in zip(at, values):
            leaves[i] = x
        return leaves

    def body(layer, carry):
        p_group, s_group = carry

        def take(x):
            return jax.device_put(jax.lax.dynamic_slice_in_dim(x, layer, 1, axis=1), jax.memory.Space.Device)

        new_p, new_s = update(gid, take, replaced(p_leaves, p_at, p_group), replaced(s_leaves, s_at, s_group))

        def write(old, new):
            return jax.lax.dynamic_update_slice_in_dim(old, jax.device_put(new, _space(old)), layer, axis=1)

        return [write(o, new_p[i]) for i, o in zip(p_at, p_group)], [write(o, new_s[i]) for i, o in zip(s_at, s_group)]

    layers = p_leaves[p_at[0]].shape[1]
    p_group, s_group = jax.lax.fori_loop(0, layers, body, ([p_leaves[i] for i in p_at], [s_leaves[i] for i in s_at]))
    return replaced(p_leaves, p_at, p_group), replaced(s_leaves, s_at, s_group)
