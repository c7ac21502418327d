"""Master weights cut over the replicas, and the 16-bit copy the stages read.

Under mixed precision a model keeps float32 parameters (the master weights the optimizer updates)
and casts them to its compute dtype where it uses them. With ZeRO the optimizer state is already
cut over the replicas; this module lets the master weights be cut the same way (Megatron's
distributed optimizer, MaxText's and torchtitan's sharded float32 parameters): at the start of a
step each device casts its shard to the compute dtype and the replicas all-gather the 16-bit
values, half the bytes of a float32 gather. Under FSDP the copy is cut like the parameters and
each action gathers 16-bit values. Per parameter and device, with D replicas and Adam:
``4/D`` (master) + ``2`` (the copy) + ``4`` (float32 gradient accumulators) + ``8/D`` (moments),
where whole master weights take ``4 + 4 + 8/D``: the same at D = 2, 1 byte less at D = 4, 1.5 at 8.

Which leaves may be cast is read from the model, not assumed: a leaf is cast to a dtype only when
every use of it in the model's functions (through reshapes, slices, gathers and nested calls) is a
conversion to that one narrower dtype. The stages then compute exactly what they computed from the
float32 leaf, and the leaves a model keeps in float32 (norm scales, an MoE router computed in
float32) stay float32. The backward's gradients of a cast leaf are the same values too: the
conversion's transpose only widened them; the executor accumulates them in the master's dtype.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp

__all__ = ["compute_model_abstract", "may_cut_master", "narrow_vocab"]

# Primitives that move or select values without computing on them: a cast commutes with them
# (their first operand is the data; others are indices).
_MOVES = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "transpose",
        "broadcast_in_dim",
        "gather",
        "rev",
        "split",
        "copy",
        "copy_p",
    }
)

_CASTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def may_cut_master(*, zero: bool, data: int, fsdp: int, offloads: bool) -> bool:
    """Whether a layout may cut its master weights (and then does, when the model casts some leaf):
    ZeRO on with several ``data`` replicas, or FSDP (its parameters are cut already: the copy is cut
    the same way, and each action gathers it in 16 bits), and nothing offloaded to host by the policy
    (those layouts keep whole weights where the policy puts them)."""
    return ((zero and data > 1) or fsdp > 1) and not offloads


def _inner_jaxprs(eqn):
    """Sub-jaxprs of a call-like equation whose inputs are the equation's, in order."""
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            yield inner


def _targets(jaxpr, var) -> set | None:
    """The dtypes ``var`` is converted to on every path of its uses; None when some use computes on
    it (or returns it) unconverted."""
    if any(v is var for v in jaxpr.outvars):
        return None
    found: set = set()
    for eqn in jaxpr.eqns:
        for pos, v in enumerate(eqn.invars):
            if v is not var:
                continue
            name = eqn.primitive.name
            if name == "convert_element_type":
                found.add(jnp.dtype(eqn.params["new_dtype"]))
                continue
            if name in _MOVES and pos == 0:
                inner = [_targets(jaxpr, out) for out in eqn.outvars]
            else:
                inner = [_targets(sub, sub.invars[pos]) for sub in _inner_jaxprs(eqn)]
            if not inner or any(t is None for t in inner):
                return None
            for t in inner:
                found |= t
    return found


def _narrowed(jaxpr, a, var):
    """``a`` narrowed to the one dtype the jaxpr casts ``var`` to, when that is narrower."""
    targets = _targets(jaxpr, var)
    if not targets or len(targets) != 1 or not jnp.issubdtype(a.dtype, jnp.floating):
        return a
    (dtype,) = targets
    return jax.ShapeDtypeStruct(a.shape, dtype) if dtype.itemsize < jnp.dtype(a.dtype).itemsize else a


def compute_model_abstract(model, message, micro):
    """The model's abstract parameters with every leaf that may be cast narrowed to its compute dtype
    (the others as they are). ``message``/``micro``: abstract embedding output and microbatch, to
    trace the model's functions with. Cached per model."""
    from jaxmem.pipeline._split import stage_forward

    per_model = _CASTS.setdefault(model, {})
    if "abstract" in per_model:
        return per_model["abstract"]
    layers, shared = model.split(model.abstract_params())
    narrowed_layers = {}  # per family: its first layer, traced as a one-layer model
    for index in model.family_layers():
        layer = layers[index]
        stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype), layer)
        kinds = () if model.layer_kinds is None else (model.layer_kinds[index],)
        fn = stage_forward(model, first=True, last=True, layers=1, kinds=kinds)
        closed = jax.make_jaxpr(fn)(stage, shared, message, micro)
        leaves = jax.tree.leaves(layer) + jax.tree.leaves(shared)
        found = [_narrowed(closed.jaxpr, a, v) for a, v in zip(leaves, closed.jaxpr.invars[: len(leaves)], strict=True)]
        n_layer = len(jax.tree.leaves(layer))
        narrowed_layers[index] = jax.tree.unflatten(jax.tree.structure(layer), found[:n_layer])
        if index == 0:
            narrowed_shared = jax.tree.unflatten(jax.tree.structure(shared), found[n_layer:])
    families = model.layer_families or (0,) * model.n_layers
    firsts = model.family_layers()
    out = model.join([narrowed_layers[firsts[f]] for f in families], narrowed_shared)
    per_model["abstract"] = out
    return out


def narrow_vocab(abstract, vocab):
    """With the vocabulary split (``vocab``: the model's VocabParallel), the pipeline layout's tables
    take the split's compute dtype when narrower: the executor's lookup and head cast them to it."""
    if vocab is None:
        return abstract
    dtype = jnp.dtype(vocab.dtype)

    def narrow(a):
        return a if dtype.itemsize >= jnp.dtype(a.dtype).itemsize else jax.ShapeDtypeStruct(a.shape, dtype)

    return type(abstract)(stages=abstract.stages, shared=abstract.shared, vocab=jax.tree.map(narrow, abstract.vocab))
