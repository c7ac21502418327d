"""Check that a schedule (and a memory policy) gives the same loss and gradients as plain ``jax.grad`` of
the unpipelined model.

Tolerances depend on the model's compute dtype (the dtype of what its stages pass on):

- float32: per element, ``|pipelined - plain| <= 1e-6 + 1e-5 |plain|`` (composite code: several matmuls,
  softmax, norms, reductions in another order), and the same for the loss.
- bfloat16 / float16: per parameter array, ``||pipelined - plain||_2 <= 4e-2 ||plain||_2``, and the loss
  within ``2e-3`` relative. Elementwise checks mean nothing at 8 mantissa bits: a correct pipeline
  rounds each microbatch's products separately (and accumulates them in float32), the plain model
  rounds the whole batch's; on the tiny models that moves single arrays by up to 1.8% in norm. Dropping
  one microbatch of eight moves them by about 12%, which this rule catches (a test checks both).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.models import StagedModel, get_model, microbatch_key, synthetic_batch
from jaxmem.pipeline import Pipeline, batch_size, make_mesh
from jaxmem.schedule import Schedule, validate

__all__ = [
    "ATOL",
    "RTOL",
    "Tolerance",
    "carried_mean",
    "plain_value_and_grad",
    "tolerance_for",
    "verification_model",
    "verify",
]

# float32 tolerances for composite code (see the module docstring).
RTOL = 1e-5
ATOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close pipelined and plain results must be.

    Attributes:
        dtype: the compute dtype it is for.
        elementwise: per element ``|d| <= atol + rtol |plain|`` (else per array, in L2 norm:
            ``||d|| <= rtol ||plain||``).
        rtol, atol: as above.
        loss_rtol: relative tolerance of the loss.
    """

    dtype: str
    elementwise: bool
    rtol: float
    atol: float
    loss_rtol: float

    def describe(self) -> str:
        if self.elementwise:
            return f"{self.dtype}: per element |diff| <= {self.atol:g} + {self.rtol:g} |plain|"
        return f"{self.dtype}: per array ||diff||_2 <= {self.rtol:g} ||plain||_2, loss within {self.loss_rtol:g}"

    def leaf_ok(self, got: np.ndarray, want: np.ndarray) -> bool:
        got, want = got.astype(np.float64), want.astype(np.float64)
        if self.elementwise:
            return bool(np.all(np.abs(got - want) <= self.atol + self.rtol * np.abs(want)))
        return bool(np.linalg.norm(got - want) <= self.atol + self.rtol * np.linalg.norm(want))

    def loss_ok(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.loss_rtol * abs(want)


def tolerance_for(dtype) -> Tolerance:
    """The tolerance for a compute dtype (float32, or 16-bit floats)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return Tolerance(dtype.name, True, RTOL, ATOL, RTOL)
    return Tolerance(dtype.name, False, 4e-2, 0.0, 2e-3)


def verification_model(num_stages: int, base="tiny", **overrides) -> StagedModel:
    """A small copy of a preset whose layers split evenly over ``num_stages``: two layers per stage up
    to 3 stages (so multi-layer stages are exercised), one per stage beyond (to keep compiles short).
    A model of your own (a StagedModel, or ``package.module:attr``) is checked as it is."""
    if isinstance(base, StagedModel) or (isinstance(base, str) and ":" in base):
        return get_model(base, **overrides)
    layers = 2 * num_stages if num_stages <= 3 else num_stages
    return get_model(base, **{"n_layers": layers, "max_seq_len": 16, **overrides})


def reference_loss(
    model: StagedModel, drop_layers=frozenset(), *, rng=None, layer_counts=None, microbatches=1, data_parallel=1
):
    """``(params, batch) -> mean loss`` of the unpipelined model (its own ``loss`` when nothing is
    dropped; else its pieces composed without the dropped layers).

    A model that draws random numbers needs ``rng`` (the step's key) and the pipeline's shape
    (``layer_counts``, ``microbatches``, ``data_parallel``): each microbatch is then run on its own
    with the keys a pipeline stage draws, and the loss is the sum over microbatches divided by the
    counted tokens, as in the pipeline. So is a model that carries state (BatchNorm's statistics,
    :attr:`~jaxmem.models.StagedModel.carried`): each microbatch normalizes by its own statistics, as
    in the pipeline, and the gradient at a carried leaf is the sum of what every microbatch wrote
    (:func:`carried_mean` makes it the step's new state).
    """
    drop_layers = frozenset(drop_layers)
    if rng is None and not drop_layers and not model.carried:
        return model.plain_loss
    counts = list(layer_counts or [model.n_layers])
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [range(start, start + n) for start, n in zip(starts, counts)]

    if rng is None and not model.carried:

        def loss(params, batch):
            loss_sum, weight = model.stage_sums(params, batch, stages, drop_layers)
            return loss_sum / weight

        return loss

    def loss(params, batch):
        size = batch_size(batch)
        mb = size // (data_parallel * microbatches)
        total = weight = 0.0
        for d in range(data_parallel):
            for m in range(microbatches):
                rows = slice((d * microbatches + m) * mb, (d * microbatches + m + 1) * mb)
                micro = {k: v[rows] for k, v in batch.items()}
                if rng is not None:
                    micro["rng"] = microbatch_key(rng, d, m, microbatches)
                loss_sum, w = model.stage_sums(params, micro, stages, drop_layers)
                total, weight = total + loss_sum, weight + w
        return total / weight

    return loss


def carried_mean(model: StagedModel, grads, count: int):
    """``grads`` (the model's own tree) with every carried leaf divided by ``count``: from the sum of
    what ``count`` microbatches wrote (:func:`reference_loss`) to the pipeline's new state."""
    if not model.carried:
        return grads
    layers, shared = model.split(grads)
    layers = [
        jax.tree_util.tree_map_with_path(lambda at, g: g / count if model.is_carried(at) else g, layer)
        for layer in layers
    ]
    return model.join(layers, shared)


def plain_value_and_grad(model, params, batch, drop_layers=frozenset(), **kwargs):
    """Loss and gradients of the unpipelined model: ``jax.value_and_grad`` of its mean loss
    (``kwargs``: see :func:`reference_loss`)."""
    loss = reference_loss(get_model(model), frozenset(drop_layers), **kwargs)
    return jax.jit(jax.value_and_grad(loss))(params, batch)


# verify() is run for many schedules and policies of one model (a sweep, the test suite), and the plain
# reference -- a trace and a compile of its own, about a fifth of a tiny model's verify -- is the same
# for all of them: kept for jaxmem's own models, whose configuration and functions name all it computes.
_REFERENCES: collections.OrderedDict = collections.OrderedDict()
_REFERENCES_KEPT = 8


def _reference_key(model: StagedModel, *inputs) -> tuple | None:
    """What the plain reference of ``model`` on ``inputs`` depends on, hashable; None for a model
    that is not one of jaxmem's (its configuration need not say all its functions compute)."""
    from jaxmem.models import GPTConfig, LlamaConfig

    if not isinstance(model.config, (GPTConfig, LlamaConfig)):
        return None
    functions = (model.init, model.split, model.join, model.embed, model.layer, model.head_loss, model.loss)
    functions += tuple(model.kind_layers or ())
    # The same code with the same configuration computes the same: a function put in its place
    # (dataclasses.replace(model, layer=...)) is other code, a partial never matches.
    codes = tuple(getattr(f, "__code__", None) or id(f) for f in functions)
    key = (model.name, model.config, model.n_layers, model.rng, codes, *inputs)
    try:
        hash(key)
    except TypeError:  # a configuration holding a list
        return None
    return key


def _plain_reference(model, params, batch, drop_layers, key, **shape):
    """:func:`plain_value_and_grad`, read back when ``key`` (:func:`_reference_key`) was computed."""
    if key is None:
        return plain_value_and_grad(model, params, batch, drop_layers, **shape)
    if key not in _REFERENCES:
        _REFERENCES[key] = plain_value_and_grad(model, params, batch, drop_layers, **shape)
        while len(_REFERENCES) > _REFERENCES_KEPT:
            _REFERENCES.popitem(last=False)
    _REFERENCES.move_to_end(key)
    return _REFERENCES[key]


def verify(
    schedule: Schedule,
    *,
    model=None,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    context: int = 1,
    zero: bool = True,
    vocab_parallel: bool | None = None,
    policy=None,
    seed: int = 0,
    seq_len: int = 16,
    microbatch_size: int = 1,
    drop_layers=frozenset(),
    loss_mask: bool = False,
    perturb=None,
    split_backward: bool = False,
    hand_recomputed: bool = False,
) -> dict:
    """Run one pipelined gradient and compare it with ``jax.value_and_grad`` of the whole model on the
    same batch.

    Args:
        schedule: any valid schedule.
        model: a StagedModel (used as is), a preset name (a small copy, :func:`verification_model`),
            or None for the tiny GPT's copy.
        data_parallel: replicas holding whole parameters.
        fsdp: replicas holding a shard of each parameter (FSDP).
        tensor: devices cutting the dimensions the model's annotations name (tensor parallelism).
        context: devices holding part of every sequence (context parallelism); ``seq_len`` must be a
            multiple of ``2 * context``.
        zero: shard the optimizer state and the returned gradients over the replicas.
        vocab_parallel: split the vocabulary tables over the pipe ranks (default: where the model
            declares them and there are several ranks).
        policy: a memory policy spec.
        seq_len, microbatch_size: the batch is ``data x microbatches x microbatch_size`` sequences.
        drop_layers: global indices of layers skipped (layer drop) in both computations.
        loss_mask: give the batch a random loss mask (masked mean over counted tokens).
        perturb: ``grads -> grads`` applied to the pipelined gradients before comparing (to check that
            the check fails when a gradient is wrong).
        split_backward: W takes I's cotangents (:class:`~jaxmem.pipeline.Pipeline`'s ``split_backward``).
        hand_recomputed: and the forward values I recomputed (the pipeline's ``hand_recomputed``).

    Returns:
        ``ok`` (structures equal and every array within the dtype's tolerance), ``max_abs_diff``,
        ``max_rel_diff`` (largest relative error by the tolerance's measure), ``first_mismatch``,
        ``loss``, ``loss_plain``, ``tolerance`` and the sizes used.
    """
    validate(schedule)
    if model is None or isinstance(model, str):
        model = verification_model(schedule.num_stages, model or "tiny")
    model = get_model(model)
    mesh = make_mesh(data_parallel, schedule.num_ranks, fsdp=fsdp, context=context, tensor=tensor)  # refuses too few
    model.check_batch(seq_len)
    drop_layers = frozenset(drop_layers)
    pipe = Pipeline(
        model,
        schedule,
        mesh,
        policy=policy,
        drop_layers=drop_layers,
        zero=zero,
        vocab_parallel=vocab_parallel,
        split_backward=split_backward,
        hand_recomputed=hand_recomputed,
    )
    replicas = data_parallel * fsdp
    size = replicas * schedule.num_microbatches * microbatch_size
    params = model.init(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    if loss_mask and model.batch_spec is not None:
        raise JaxmemError(f"verify: loss_mask masks tokens; model {model.name} takes a batch of its own")
    batch = synthetic_batch(model, size, seq_len, keys[0])  # tokens, or the model's own batch
    if loss_mask:
        batch["loss_mask"] = (jax.random.uniform(keys[1], (size, seq_len)) < 0.7).astype(jnp.float32)
    tol = tolerance_for(pipe.compute_dtype(batch))

    rng = jax.random.PRNGKey(seed + 2) if model.rng else None
    shape = (
        {
            "rng": rng,
            "layer_counts": pipe.layer_counts,
            "microbatches": schedule.num_microbatches,
            "data_parallel": replicas,
        }
        if rng is not None or model.carried
        else {}
    )
    key = _reference_key(
        model,
        seed,
        size,
        seq_len,
        loss_mask,
        tuple(sorted(drop_layers)),
        rng is not None,  # drawn from the seed, as the parameters and the batch are
        tuple(sorted((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in shape.items() if k != "rng")),
    )
    loss_plain, grads_plain = _plain_reference(model, params, batch, drop_layers, key, **shape)
    grads_plain = carried_mean(model, grads_plain, replicas * schedule.num_microbatches)
    loss, grads = pipe.value_and_grad(pipe.place(pipe.from_model_params(params)), batch, rng)
    # On the host first: with the optimizer state offloaded the gradients come back in pinned host
    # memory, where eager indexing is not supported.
    grads = pipe.to_model_params(jax.device_get(grads))
    if perturb is not None:
        grads = perturb(grads)

    ok = tol.loss_ok(float(loss), float(loss_plain))
    max_abs = abs(float(loss) - float(loss_plain))
    max_rel = max_abs / max(abs(float(loss_plain)), 1e-30)
    worst = None if ok else "loss"
    got_tree, want_tree = jax.tree_util.tree_structure(grads), jax.tree_util.tree_structure(grads_plain)
    if got_tree != want_tree:
        ok, worst = False, f"tree structure: pipelined {got_tree} vs plain {want_tree}"
    else:
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_plain)):
            if got.shape != want.shape or got.dtype != want.dtype:
                ok = False
                worst = worst or f"{jax.tree_util.keystr(path)}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
                continue
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            diff = np.abs(got - want)
            leaf_abs = float(diff.max(initial=0.0))
            if tol.elementwise:
                leaf_rel = leaf_abs / max(float(np.abs(want).max(initial=0.0)), 1e-30)
            else:
                leaf_rel = float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)), 1e-30)
            if not tol.leaf_ok(got, want):
                ok = False
                worst = worst or jax.tree_util.keystr(path)
            max_abs, max_rel = max(max_abs, leaf_abs), max(max_rel, leaf_rel)
    return {
        "ok": ok,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "tolerance": tol.describe(),
        "rtol": tol.rtol,
        "atol": tol.atol,
        "first_mismatch": worst,
        "loss": float(loss),
        "loss_plain": float(loss_plain),
        "model": model.name,
        "dtype": tol.dtype,
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "data_parallel": data_parallel,
        "fsdp": fsdp,
        "tensor": tensor,
        "context": context,
        "zero": zero and replicas > 1,
        "layers": model.n_layers,
        "drop_layers": sorted(drop_layers),
        "loss_mask": loss_mask,
        "policy": None if policy is None else str(policy),
    }
