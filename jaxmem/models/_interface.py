"""The model interface every part of jaxmem works through: a model cut where a pipeline cuts it.

A :class:`StagedModel` is a value holding pure functions of parameter pytrees -- an embedding
prologue, one repeated layer, and a head that returns the loss as ``(loss_sum, weight)`` -- plus how
to split the model's own parameter tree into per-layer trees and the rest, and the ``checkpoint_name``
tags its functions emit. The executor, the memory policies, the ledger and the planners need nothing
else, so any model written this way trains pipelined: :func:`from_nnx` builds one from a Flax NNX
module without touching jaxmem, and jaxmem's own GPT and Llama are built exactly that way.

A batch is a dict of arrays whose leading axis is the batch: ``tokens`` and ``targets``
(``[batch, seq]`` int32) and, optionally, ``loss_mask`` (``[batch, seq]``, 1 where a target counts)
and ``positions`` (``[batch, seq]`` int32, for packed sequences). The executor splits every leaf into
microbatches along that axis.

The loss of a batch is ``sum(loss_sum) / sum(weight)`` over its microbatches (and data-parallel
replicas): a mean over the tokens that count, whatever the microbatching. ``weight`` must not depend
on the parameters (it is the number of counted tokens).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import tree_with as _with
from jaxmem._util import tree_without as _without
from jaxmem._util import unvarying, varying_axes, vma_check_off
from jaxmem.policy import TagSet

__all__ = [
    "ATTENTION",
    "AXIS_RULES",
    "ParamAxes",
    "StagedModel",
    "VocabParallel",
    "attention_platform",
    "evaluating",
    "batch_positions",
    "carry_state",
    "check_config",
    "dtype_name",
    "from_nnx",
    "fused_attention",
    "make_batch",
    "named_softmax",
    "token_loss",
    "tensor_mesh",
    "traced_for",
]

BATCH_KEYS = ("tokens", "targets", "loss_mask", "positions")


def dtype_name(value, where: str) -> str:
    """A floating dtype's canonical name (``bf16`` and ``bfloat16`` alike)."""
    aliases = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16"}
    text = aliases.get(str(value).strip().lower(), str(value).strip().lower())
    try:
        dtype = jnp.dtype(text)
    except TypeError:
        raise JaxmemError(f"{where}: unknown dtype {value!r}; use float32 or bfloat16") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise JaxmemError(f"{where}: {value!r} is not a floating dtype; use float32 or bfloat16")
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise JaxmemError(
            f"{where}: {dtype.name} needs JAX's 64-bit mode, which is off (JAX would compute in float32 "
            "and say so only in warnings); set JAX_ENABLE_X64=1 for the run, or use float32"
        )
    return dtype.name


# How a built-in model computes attention: ``materialized`` (the s x s probabilities are a tagged tensor
# a policy keeps or recomputes) or ``fused`` (:func:`fused_attention`: none kept for the backward).
ATTENTION = ("materialized", "fused")


def check_config(config, positive: Sequence[str]) -> None:
    """The checks every model configuration shares: ``positive`` fields are integers >= 1, ``dtype`` /
    ``param_dtype`` become canonical floating dtype names (on a frozen dataclass), and ``attention``
    (where the config has one) is one of :data:`ATTENTION`."""
    kind = type(config).__name__
    for field in positive:
        value = getattr(config, field)
        if not isinstance(value, int) or value < 1:
            raise JaxmemError(f"{kind}.{field} must be an integer >= 1, got {value!r}")
    for field in ("dtype", "param_dtype"):
        object.__setattr__(config, field, dtype_name(getattr(config, field), f"{kind}.{field}"))
    attention = getattr(config, "attention", ATTENTION[0])
    if attention not in ATTENTION:
        raise JaxmemError(f"{kind}.attention ({setting('attention')}) is materialized or fused, got {attention!r}")


# The platform a stage is being traced for (set by the executor and the ledger around their traces):
# fused attention picks its kernel by it. None: as jax.nn.dot_product_attention picks (XLA's ops).
_ATTENTION_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("jaxmem_attention_platform", default=None)


@contextlib.contextmanager
def attention_platform(platform: str | None):
    """Within the block, :func:`fused_attention` is traced for ``platform`` (``gpu``: cuDNN's flash
    attention; ``tpu``, ``cpu``: XLA's). jaxmem's executor and ledger trace the stages inside it for
    the devices they compile for, which need not be this process's (:mod:`jaxmem.targets`)."""
    token = _ATTENTION_PLATFORM.set(platform)
    try:
        yield
    finally:
        _ATTENTION_PLATFORM.reset(token)


_EVALUATING: contextvars.ContextVar = contextvars.ContextVar("jaxmem_evaluating", default=False)


@contextlib.contextmanager
def evaluating():
    """Within the block, the functions of a :func:`from_nnx` model are traced in evaluation mode
    (the module's ``eval()``: ``nnx.Dropout`` drops nothing, ``nnx.BatchNorm`` reads its running
    averages). jaxmem traces a held-out loss inside it; the train step outside it. A model that draws
    its random numbers its own way (not through modules with a ``deterministic`` switch) is
    unchanged: it gets a key as in training."""
    token = _EVALUATING.set(True)
    try:
        yield
    finally:
        _EVALUATING.reset(token)


def _in_mode(module):
    """``module`` switched to evaluation mode inside :func:`evaluating` (it is a fresh merge: the
    switch is not kept)."""
    if _EVALUATING.get():
        module.eval()
    return module


def traced_for(fn: Callable, platform: str | None) -> Callable:
    """``fn`` that runs inside :func:`attention_platform` ``(platform)`` whenever it is called (traced)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with attention_platform(platform):
            return fn(*args, **kwargs)

    return wrapped


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``q`` ``[batch, seq, heads, head_dim]`` over ``k``, ``v`` ``[batch, seq,
    kv_heads, head_dim]`` (grouped-query when ``kv_heads < heads``) as one op, a flash kernel where the
    target has one. Compiled for a GPU (traced inside :func:`attention_platform` ``("gpu")``, as
    jaxmem's executor and ledger trace for the devices they compile for) it is cuDNN's flash attention
    when the inputs are 16-bit (cuDNN takes no float32), with ``nvidia-cudnn-cu12`` (``pip install
    'jaxmem[cuda]'``). Compiled for a TPU it is the Pallas flash-attention kernel jax ships
    (``jax.experimental.pallas.ops.tpu.flash_attention``) where its blocks fit: both sequence lengths
    multiples of 128 and a head dimension up to 128 or a multiple of it (grouped keys and values
    repeated to the query heads first). Elsewhere, and on a ``context`` axis of a TPU, XLA's own ops
    (:func:`jax.nn.dot_product_attention`). On a ``context`` axis it attends this device's queries to
    every device's keys and values (:func:`~jaxmem.models.context_kv`) under
    :func:`~jaxmem.models.causal_mask` (cuDNN's kernel with the mask, on a GPU). Its s x s
    probabilities are never kept for the backward: the op is rematerialised as a whole
    (``jax.checkpoint`` saving nothing inside), so the backward reads only ``q``, ``k``, ``v``, as a
    flash kernel does, which recomputes the probabilities blockwise. The price: one more attention
    forward in the backward.

    >>> x = jnp.ones((1, 4, 2, 8))
    >>> fused_attention(x, x[:, :, :1], x[:, :, :1]).shape
    (1, 4, 2, 8)
    """
    from jaxmem.models._context import causal_mask, context_kv, context_size

    platform = _ATTENTION_PLATFORM.get()
    implementation = None
    if platform == "gpu" and jnp.dtype(q.dtype).itemsize == 2:
        _require_cudnn()
        implementation = "cudnn"
    if context_size() > 1:  # this device's queries against every device's keys (jaxmem.models._context)
        k, v = context_kv(k, v)
        # cuDNN takes the chunked sequence's mask as its own (a bias); XLA's ops build the scores.
        mask = causal_mask(q.shape[1], k.shape[1])[None, None]
        attend = functools.partial(jax.nn.dot_product_attention, mask=mask, implementation=implementation)
    elif platform == "tpu" and _tpu_flash_fits(q, k):
        implementation = "pallas"
        attend = _tpu_flash_attention
    else:
        attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)
    attend = jax.checkpoint(attend, policy=jax.checkpoint_policies.nothing_saveable)
    if implementation is not None:  # a kernel: run per tensor shard (see _per_tensor_shard)
        return _per_tensor_shard(attend, q, k, v)
    return attend(q, k, v)


TPU_FLASH_BLOCK = 128  # the Pallas TPU flash kernel's default block (and its lane width)


def _tpu_flash_fits(q: jax.Array, k: jax.Array) -> bool:
    """The Pallas TPU flash kernel takes these shapes with its default blocks of 128: both lengths whole
    blocks, and a head dimension of at most one block or whole blocks."""
    head_dim = q.shape[-1]
    lengths = (q.shape[1], k.shape[1])
    return all(n % TPU_FLASH_BLOCK == 0 for n in lengths) and (
        head_dim <= TPU_FLASH_BLOCK or not head_dim % TPU_FLASH_BLOCK
    )


def _tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention by jax's Pallas TPU flash kernel (heads-major inside, grouped keys and values
    repeated up to the query heads), run outside ``shard_map``'s check of varying axes
    (:func:`_outside_vma_check`): the kernel's outputs carry no such typing."""
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    def attend(q, k, v):
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
        heads_major = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
        out = flash_attention(*map(heads_major, (q, k, v)), causal=True, sm_scale=q.shape[-1] ** -0.5)
        return heads_major(out)

    return _outside_vma_check(attend)(q, k, v)


def _outside_vma_check(fn: Callable) -> Callable:
    """``fn`` (arrays to an array) traced with ``shard_map``'s varying-axes check off, its result (and in
    the backward, its inputs' cotangents) typed as varying where its first input (its inputs) vary.

    A Pallas kernel's ``pallas_call`` refuses to be traced under the check ("``manual_axis_type`` on
    ``jax.ShapeDtypeStruct`` must not be ``None``"), as jax's own TPU flash kernel is written, and
    jaxmem's step is a checked ``shard_map``. The kernel's math is per device whatever the typing, so
    it runs with the check off; its backward is its own ``jax.vjp`` recomputing the forward (the
    saving-nothing rematerialisation :func:`fused_attention` asks for anyway), so the casts back are
    never transposed."""

    def typed(x, want: frozenset):
        missing = want - varying_axes(x)
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    # The inputs' varying axes ride along as a static argument: the backward's residuals need not
    # carry them.
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def run(axes, *args):
        with vma_check_off():
            out = fn(*args)
        return typed(out, axes[0])

    def run_fwd(axes, *args):
        return run(axes, *args), args

    def run_bwd(axes, args, g):
        with vma_check_off():  # (the cotangent typed as the kernel's output is)
            grads = jax.vjp(fn, *args)[1](unvarying(g))
        return tuple(typed(d, want) for d, want in zip(grads, axes))

    run.defvjp(run_fwd, run_bwd)
    return lambda *args: run(tuple(varying_axes(a) for a in args), *args)


def _per_tensor_shard(attend: Callable, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``attend(q, k, v)`` run on each tensor shard's own heads, where the mesh it is traced on has a
    tensor axis left to XLA's partitioner (jaxmem's: data, fsdp, pipe, context are manual).

    cuDNN's attention partitions itself through a ``custom_partitioning`` rule, which in jax 0.10.2
    fails inside a partly manual program ("'GSPMDSharding' object has no attribute 'spec'"): compiled
    for an H100 with a tensor axis the step did not build. Attention is independent per head and the
    tensor axis splits whole heads (Megatron's split), so running the kernel in a ``shard_map`` over the
    tensor axis computes the same thing without asking the partitioner. (The Pallas kernel on a TPU has
    no partitioning rule at all: the same.) Grouped keys and values fewer than the tensor shards are
    repeated up to one per shard first (each shard's query heads share one group when the shards
    divide the groups)."""
    mesh, concrete = jax.sharding.get_abstract_mesh(), None
    if mesh.empty and _TENSOR_MESH.get() is not None:  # traced in a plain jit over a tensor mesh
        concrete = _TENSOR_MESH.get()
        mesh = concrete.abstract_mesh
    tensor = "tensor"
    if mesh.empty or tensor not in mesh.axis_names or tensor in mesh.manual_axes or mesh.shape[tensor] == 1:
        return attend(q, k, v)
    shards, heads, kv_heads = mesh.shape[tensor], q.shape[2], k.shape[2]
    if heads % shards or (kv_heads % shards and shards % kv_heads):
        raise JaxmemError(
            f"fused attention over a tensor axis of {shards} needs heads ({heads}) and key/value heads "
            f"({kv_heads}) that it divides or that divide it; choose another --tensor"
        )
    if kv_heads < shards:
        k, v = (jnp.repeat(x, shards // kv_heads, axis=2) for x in (k, v))
    spec = jax.sharding.PartitionSpec(None, None, tensor, None)
    return jax.shard_map(attend, mesh=concrete, in_specs=(spec, spec, spec), out_specs=spec, axis_names={tensor})(
        q, k, v
    )


_TENSOR_MESH: contextvars.ContextVar = contextvars.ContextVar("jaxmem_tensor_mesh", default=None)


@contextlib.contextmanager
def tensor_mesh(mesh):
    """Within the block, a kernel :func:`fused_attention` runs is split over ``mesh``'s ``tensor`` axis
    (as inside jaxmem's step) when traced in a plain ``jax.jit`` over that mesh: the ledger compiles a
    stage's working set so (:mod:`jaxmem.memory`). None: no mesh."""
    token = _TENSOR_MESH.set(mesh)
    try:
        yield
    finally:
        _TENSOR_MESH.reset(token)


def _require_cudnn() -> None:
    """cuDNN must be installed to trace its attention (jax reads its version while tracing)."""
    import importlib.util

    if importlib.util.find_spec("nvidia.cudnn") is None:
        raise JaxmemError(
            "fused attention on a GPU is cuDNN's flash attention, and cuDNN is not installed: "
            "pip install 'jaxmem[cuda]' (or nvidia-cudnn-cu12), or use --attention materialized"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def named_softmax(x: jax.Array, name: str, axis: int = -1) -> jax.Array:
    """``softmax(x)`` in float32, returned in ``x``'s dtype and tagged ``name``, whose backward reads the
    tagged output.

    ``checkpoint_name(jax.nn.softmax(x), name)`` does not do that: ``jax.nn.softmax``'s custom JVP keeps
    its own, untagged output as the residual of its backward, so a policy that saves ``name`` still
    recomputes ``x`` (the attention scores, a matmul) and the softmax in the backward. Here the
    backward is written against the tagged value: saving the tag saves the recompute, and not saving
    it recomputes exactly the softmax and what it is computed from.

    >>> named_softmax(jnp.zeros((2, 4)), "probs")[0]
    Array([0.25, 0.25, 0.25, 0.25], dtype=float32)
    """
    return _tagged_softmax(x, name, axis)


def _tagged_softmax(x, name, axis):
    return checkpoint_name(jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype), name)


def _named_softmax_fwd(x, name, axis):
    # Computed inline (not by calling named_softmax), so the tag is visible to jax.checkpoint's policy.
    y = _tagged_softmax(x, name, axis)
    return y, y


def _named_softmax_bwd(name, axis, y, g):
    y32, g32 = y.astype(jnp.float32), g.astype(jnp.float32)
    return ((y32 * (g32 - jnp.sum(y32 * g32, axis=axis, keepdims=True))).astype(y.dtype),)


named_softmax.defvjp(_named_softmax_fwd, _named_softmax_bwd)


def make_batch(tokens, targets, *, loss_mask=None, positions=None) -> dict:
    """A batch dict: ``tokens``, ``targets`` and, when given, ``loss_mask`` and ``positions``.

    >>> sorted(make_batch(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32)))
    ['targets', 'tokens']
    """
    batch = {"tokens": tokens, "targets": targets}
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    if positions is not None:
        batch["positions"] = positions
    return batch


def synthetic_batch(model, size: int, seq: int, key: jax.Array) -> dict:
    """A batch of ``size`` random samples of what ``model`` takes, where no data is needed (checking
    gradients, compiling a step): tokens and next-token targets for a language model; for a model
    with a batch of its own (:attr:`StagedModel.batch_spec`), each leaf of its spec filled at random --
    floating leaves standard normal, integer leaves uniform in ``[0, vocab_size)`` (``[0, 2)`` when
    the model names no vocabulary, so a class label is valid for any classifier), booleans true."""
    if model.batch_spec is None:
        tokens = jax.random.randint(key, (size, seq), 0, model.vocab_size or 256, dtype=jnp.int32)
        return make_batch(tokens, jnp.roll(tokens, -1, axis=1))
    spec = dict(model.batch_spec(size, seq))
    out = {}
    for name, k in zip(sorted(spec), jax.random.split(key, len(spec))):
        leaf = spec[name]
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            out[name] = jax.random.normal(k, leaf.shape, leaf.dtype)
        elif jnp.issubdtype(leaf.dtype, jnp.integer):
            out[name] = jax.random.randint(k, leaf.shape, 0, model.vocab_size or 2).astype(leaf.dtype)
        else:
            out[name] = jnp.ones(leaf.shape, leaf.dtype)
    return out


# Keys of a model that draws random numbers (``StagedModel.rng``): the step's key is folded with the
# microbatch's global number, then with the stage, then with the layer's position in the stage (the
# embedding and the head take two reserved positions). A layer's dropout mask therefore depends only on
# (step, microbatch, stage, layer): the same in the forward and in any recompute of it.
EMBED_KEY, HEAD_KEY = 2**30, 2**30 + 1
RNG_SPEC = jax.ShapeDtypeStruct((2,), jnp.uint32)  # a raw threefry key, as jax.random.PRNGKey gives


def microbatch_key(key: jax.Array, data_index, microbatch, microbatches: int) -> jax.Array:
    """The key of microbatch ``microbatch`` of data-parallel replica ``data_index``."""
    return jax.random.fold_in(key, data_index * microbatches + microbatch)


def stage_key(key: jax.Array, stage) -> jax.Array:
    """A microbatch key folded with the (global) stage index."""
    return jax.random.fold_in(key, stage)


def layer_batch(batch: Mapping, position: int) -> Mapping:
    """``batch`` with its ``rng`` (a stage's key) folded for the layer at ``position`` in the stage
    (:data:`EMBED_KEY` / :data:`HEAD_KEY` for the embedding and the head); unchanged without ``rng``."""
    if "rng" not in batch:
        return batch
    return {**batch, "rng": jax.random.fold_in(batch["rng"], position)}


def batch_positions(batch: Mapping, seq: int) -> jax.Array:
    """The batch's ``positions`` if it has them, else ``0 .. seq-1`` (broadcast over the batch): with a
    ``context`` axis, the positions of this device's ``seq`` tokens in the whole sequence
    (:func:`~jaxmem.models.context_positions`)."""
    from jaxmem.models._context import context_positions

    positions = batch.get("positions")
    return context_positions(seq)[None, :] if positions is None else positions


@jax.custom_vjp
def carry_state(y, old, written):
    """``y``, unchanged; and, in the gradient, ``written`` at ``old``: how a layer hands the step
    state its forward wrote (``old`` the state it read, ``written`` what it wrote in its place; both
    trees alike). The step sums a carried leaf's "gradient" over its microbatches and replicas and
    divides by their number, so it ends as the mean of what they wrote (:attr:`StagedModel.carried`).
    ``y`` and ``old`` take no other gradient through it; ``written`` none (it is state, not a
    function of the parameters to train). :func:`from_nnx` wraps every layer that holds
    ``nnx.BatchStat`` in it; a hand-written layer function may too, with its ``carried`` paths.

    >>> import jax.numpy as jnp
    >>> old, new = jnp.zeros(2), jnp.array([0.5, 1.5])
    >>> jax.grad(lambda o: carry_state(jnp.ones(3), o, new).sum())(old)
    Array([0.5, 1.5], dtype=float32)
    """
    return y


def _carry_fwd(y, old, written):
    as_old = jax.tree.map(lambda w, o: jnp.asarray(w, o.dtype), written, old)
    return y, (as_old, jax.tree.map(jnp.zeros_like, written))


def _carry_bwd(res, g):
    as_old, none = res
    return g, as_old, none


carry_state.defvjp(_carry_fwd, _carry_bwd)


def token_loss(logits: jax.Array, batch: Mapping) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy ``(loss_sum, weight)`` in float32, masked by ``loss_mask`` if present."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch.get("loss_mask")
    if mask is None:
        return -jnp.sum(picked), jnp.asarray(picked.size, jnp.float32)
    mask = jax.lax.stop_gradient(mask.astype(jnp.float32))
    return -jnp.sum(picked * mask), jnp.sum(mask)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabParallel:
    """Where a model's vocabulary tables are, so that a pipeline can split them over its ranks
    (each rank holds ``1/P`` of the token embedding's rows and of the head's columns).

    The pipeline then looks a microbatch's tokens up on every rank at once (each finds the rows it
    holds; a sum over the ranks assembles them), and computes the head's logits, softmax
    cross-entropy and their gradient on every rank for its slice of the vocabulary at once
    (maxima, sums of exponentials and target logits summed over the ranks). The first stage starts
    from the looked-up rows, the last ends before the head's projection.

    Attributes:
        table: path, in the shared parameters, of the token embedding ``[vocab, d]``.
        head: path of the head's projection ``[d, vocab]``; None when the head is the embedding
            (tied: ``logits = h @ table.T``).
        embed: ``(shared, rows, batch) -> x``: the prologue after its lookup (``rows`` =
            ``table[tokens]`` in ``dtype``; e.g. add position embeddings, scale).
        hidden: ``(shared, x, batch) -> h``: the head up to its projection (e.g. the final norm).
        dtype: the dtype the lookup and the projection compute in (logits are then taken in float32,
            as :func:`token_loss` takes them).
        softcap: logits soft-capping, ``softcap * tanh(logits / softcap)`` (Gemma 2); None for none.

    The loss is :func:`token_loss`'s: next-token cross-entropy, masked by ``loss_mask``. With
    :func:`from_nnx`, ``embed`` and ``hidden`` take the module (without its layers) in place of
    ``shared``, and the paths are dotted strings (``"embed_tokens.embedding"``).
    """

    table: tuple[str, ...]
    head: tuple[str, ...] | None
    embed: Callable
    hidden: Callable
    dtype: str = "float32"
    softcap: float | None = None

    def __post_init__(self):
        for field in ("table", "head"):
            value = getattr(self, field)
            if isinstance(value, str):
                object.__setattr__(self, field, tuple(p for p in value.split(".") if p))
        object.__setattr__(self, "dtype", dtype_name(self.dtype, "VocabParallel.dtype"))

    @property
    def tied(self) -> bool:
        return self.head is None

    def paths(self) -> dict[str, tuple[str, ...]]:
        """``{"table": path}`` and, untied, ``{"head": path}``."""
        return {"table": self.table} if self.tied else {"table": self.table, "head": self.head}


# Logical axis names (MaxText's and Flax's usual ones) -> the mesh axis jaxmem cuts them over. Only
# ``tensor`` is taken from a model: jaxmem places ``data``, ``fsdp`` and ``pipe`` itself.
AXIS_RULES: dict[str, str | None] = {
    "tensor": "tensor",
    "heads": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
}


@dataclasses.dataclass(frozen=True)
class ParamAxes:
    """The mesh axis (or None) of each dimension of one parameter, from the model's annotations.

    A leaf of :attr:`StagedModel.axes` (a class, not a tuple, so that a tree of them has the
    parameters' structure).

    Attributes:
        axes: one mesh axis name (or None) per dimension.
        unit: the ``tensor`` cut falls on multiples of this many elements (an attention head's
            width: a cut through a head would need the devices to trade halves of it). A dimension
            ``tensor`` times ``unit`` does not divide is kept whole on every device, as Megatron keeps
            the key/value heads whole when there are fewer of them than tensor ranks. From the
            annotation's ``tensor_unit`` metadata (``nnx.with_partitioning(init, names,
            tensor_unit=head_dim)``).

    >>> ParamAxes((None, "tensor")).dim("tensor")
    1
    """

    axes: tuple[str | None, ...] = ()
    unit: int = 1

    def dim(self, axis: str) -> int | None:
        """The dimension cut over ``axis`` (None: none)."""
        return next((d for d, a in enumerate(self.axes) if a == axis), None)


def _param_axes(state, rules: Mapping[str, str | None], name: str) -> dict:
    """A pure-dict tree of :class:`ParamAxes` from the ``nnx.Param`` variables' sharding annotations
    (``nnx.with_partitioning``: logical names mapped by ``rules``, names not in them left whole)."""
    from flax import nnx

    tree: dict = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or ()
        names = tuple(names)
        if names and len(names) != len(var.shape):
            raise JaxmemError(
                f"model {name!r}: parameter {'.'.join(map(str, path))} of shape {tuple(var.shape)} is annotated "
                f"with {len(names)} axis names {names}; give one per dimension"
            )
        axes = tuple(rules.get(n) if isinstance(n, str) else None for n in names)
        if sum(a == "tensor" for a in axes) > 1:
            raise JaxmemError(
                f"model {name!r}: parameter {'.'.join(map(str, path))} maps two dimensions to 'tensor' "
                f"({names}); cut one dimension per mesh axis"
            )
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        unit = meta.get("tensor_unit", 1)
        if not isinstance(unit, int) or isinstance(unit, bool) or unit < 1:
            raise JaxmemError(
                f"model {name!r}: parameter {'.'.join(map(str, path))} has tensor_unit={unit!r}; give a positive "
                "int (the width of the smallest piece a tensor cut may hand a device, e.g. a head's)"
            )
        node[path[-1]] = ParamAxes(axes, unit)
    return tree


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StagedModel:
    """A model as a pipeline sees it.

    Attributes:
        name: shown in reports.
        n_layers: repeated layers (the unit a pipeline stage holds a number of).
        init: ``seed -> params`` in the model's own layout (e.g. ``nnx.to_pure_dict`` of its state).
        split: ``params -> (layers, shared)``: one tree per layer and the rest. Layers may hold
            different parameters (dense and mixture-of-experts layers): each structure is a family
            (:attr:`layer_families`), run by its own kind (``layer_kinds``).
        join: the inverse of ``split``.
        embed: ``(shared, batch) -> x``: the first stage's prologue; ``x`` is any pytree of floating
            arrays (what one stage sends the next).
        layer: ``(layer_params, x, batch) -> x``.
        head_loss: ``(shared, x, batch) -> (loss_sum, weight)``: the last stage's epilogue and loss.
        tags: the ``checkpoint_name`` tags these functions emit (policies resolve against them; a
            tag emitted but not declared is an error), with a ``quadratic`` group for ``selective``.
        loss: ``(params, batch) -> mean loss`` of the whole, unpipelined model -- the reference
            ``jaxmem verify`` compares gradients with. Default: the three functions composed.
        vocab_size: token ids are below this (checked against the data).
        max_seq_len: longest sequence (``None``: no limit).
        config: the model's own configuration, for reports.
        analytic: closed-form memory and FLOP figures (jaxmem's GPT has them); ``None``: the ledger
            and planners trace the functions instead.
        rng: the functions draw random numbers (dropout). They then find a PRNG key in
            ``batch["rng"]``, a different one for every layer, embedding and head, microbatch and step
            (see :func:`layer_batch`), and every step must be given a key.
        logits: ``(params, batch) -> logits [batch, seq, vocab]`` of the whole model, for sampling
            (:func:`~jaxmem.models.generate`); None: the model cannot be sampled from.
        vocab: where the vocabulary tables are (:class:`VocabParallel`), so that a pipeline splits
            them over its ranks instead of keeping them whole on each; None: the embedding and head
            are kept whole (and sharded only by ``fsdp`` and ZeRO).
        axes: a tree like the parameters of :class:`ParamAxes`: the dimensions a mesh's ``tensor``
            axis cuts (:func:`from_nnx` reads them from ``nnx.with_partitioning``); None: none.
        layer_kinds: for each layer, which of ``kind_layers`` runs it: layers whose static
            configuration differs (a sliding window on some, a RoPE base, a flag set in ``__init__``)
            or whose parameters differ (dense and mixture-of-experts layers, also other
            :attr:`layer_families`); None: every layer is ``layer``.
        kind_layers: the layer function of each kind (``kind_layers[0]`` is ``layer``).
        batch_spec: ``(batch_size, seq_len) -> dict of jax.ShapeDtypeStruct``: the batch the model
            takes, abstract (what the ledger, the planner and ``jaxmem memory`` trace it with); None:
            int32 ``tokens`` and ``targets`` ``[batch, seq]``, the language models' convention. A
            model whose batch has no sequence (a classifier) may ignore ``seq_len``.
        carried: paths (key tuples) within a layer's parameter tree of state the layers' forward
            writes and the step carries to the next (BatchNorm's statistics; :func:`carry_state`):
            such a leaf is not trained. A step's gradient holds at it the state the step writes --
            the mean over its microbatches and replicas of what each forward wrote -- which the
            trainer puts in place of the old (:meth:`is_carried`).
    """

    name: str
    n_layers: int
    init: Callable[[int], object]
    split: Callable[[object], tuple[Sequence, object]]
    join: Callable[[Sequence, object], object]
    embed: Callable
    layer: Callable
    head_loss: Callable
    tags: TagSet = TagSet(())
    loss: Callable | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    config: object = None
    analytic: object = None
    rng: bool = False
    logits: Callable | None = None
    vocab: VocabParallel | None = None
    axes: object = None
    batch_spec: Callable[[int, int], dict] | None = None
    layer_kinds: tuple[int, ...] | None = None
    kind_layers: tuple[Callable, ...] | None = None
    carried: frozenset = frozenset()

    def is_carried(self, path) -> bool:
        """Whether a leaf at ``path`` (a key path into a layer's tree, or into a stage's stacked one)
        is carried state (:attr:`carried`), not a parameter."""
        return bool(self.carried) and tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)) in self.carried

    def layer_of_kind(self, kind: int) -> Callable:
        """The layer function of one kind (:attr:`layer_kinds`)."""
        return self.layer if self.kind_layers is None else self.kind_layers[kind]

    def layer_at(self, index: int) -> Callable:
        """The layer function of global layer ``index``."""
        return self.layer if self.layer_kinds is None else self.layer_of_kind(self.layer_kinds[index])

    @property
    def layer_families(self) -> tuple[int, ...] | None:
        """For each layer, which parameter structure it holds (numbered in order of first
        appearance: dense and mixture-of-experts layers are two families); None when every layer holds
        the same parameters. A pipeline stacks each family's layers apart (see
        :class:`~jaxmem.pipeline.ParamLayout`). Read from the abstract parameters, once."""
        if "_layer_families" not in self.__dict__:
            layers, _ = self.split(self.abstract_params())
            signatures: list = []
            families = []
            for layer in layers:
                leaves, treedef = jax.tree.flatten(layer)
                signature = (treedef, tuple((tuple(a.shape), str(a.dtype)) for a in leaves))
                if signature not in signatures:
                    signatures.append(signature)
                families.append(signatures.index(signature))
            object.__setattr__(self, "_layer_families", tuple(families) if len(signatures) > 1 else None)
        return self.__dict__["_layer_families"]

    def family_layers(self) -> list[int]:
        """The first layer of each parameter family (:attr:`layer_families`): ``[0]`` for a model of one."""
        families = self.layer_families
        return [0] if families is None else [families.index(f) for f in range(max(families) + 1)]

    def __post_init__(self):
        if not isinstance(self.n_layers, int) or self.n_layers < 1:
            raise JaxmemError(f"model {self.name!r}: n_layers must be an integer >= 1, got {self.n_layers!r}")
        if not isinstance(self.tags, TagSet):
            object.__setattr__(self, "tags", TagSet(tuple(self.tags)))
        if self.layer_kinds is not None:
            kinds = len(self.kind_layers or ())
            if len(self.layer_kinds) != self.n_layers or not all(0 <= k < kinds for k in self.layer_kinds):
                raise JaxmemError(
                    f"model {self.name!r}: layer_kinds must name one of the {kinds} kind_layers for each of its "
                    f"{self.n_layers} layers, got {self.layer_kinds!r}"
                )

    def __repr__(self) -> str:
        return f"StagedModel({self.name!r}, {self.n_layers} layers, tags: {self.tags.describe()})"

    def abstract_params(self):
        """The parameter tree's shapes and dtypes (nothing allocated; traced once per model)."""
        if "_abstract_params" not in self.__dict__:
            with _cheap_tracer_attribute_errors():
                object.__setattr__(self, "_abstract_params", jax.eval_shape(lambda: self.init(0)))
        return self.__dict__["_abstract_params"]

    def param_count(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.abstract_params()))

    def plain_loss(self, params, batch) -> jax.Array:
        """The mean loss of the whole model on a batch, without any pipeline (a model with ``rng``
        draws its keys from ``batch["rng"]`` as one stage holding every layer)."""
        if self.loss is not None and "rng" not in batch:
            return self.loss(params, batch)
        loss_sum, weight = self.stage_sums(params, batch, range(self.n_layers))
        return loss_sum / weight

    def stage_sums(self, params, batch, stages, skip=frozenset()):
        """``(loss_sum, weight)`` of the whole model run as consecutive stages (``stages``: the global
        layer indices of each, e.g. ``[range(0, 4), range(4, 8)]``; a flat range is one stage), each
        stage drawing its keys as a pipeline stage does (:func:`stage_key`, :func:`layer_batch`);
        layers in ``skip`` are dropped."""
        stages = [stages] if isinstance(stages, range) else list(stages)
        layers, shared = self.split(params)
        x = None
        for s, indices in enumerate(stages):
            stage_batch = batch if "rng" not in batch else {**batch, "rng": stage_key(batch["rng"], s)}
            if s == 0:
                x = self.embed(shared, layer_batch(stage_batch, EMBED_KEY))
            for local, index in enumerate(indices):
                if index not in skip:
                    x = self.layer_at(index)(layers[index], x, layer_batch(stage_batch, local))
            if s == len(stages) - 1:
                return self.head_loss(shared, x, layer_batch(stage_batch, HEAD_KEY))
        raise JaxmemError("stage_sums: no stages given")

    def check_batch(self, seq: int, what: str = "sequence length") -> None:
        """Raise when ``seq`` exceeds the model's ``max_seq_len``."""
        if self.max_seq_len is not None and seq > self.max_seq_len:
            raise JaxmemError(f"{what} {seq} exceeds {self.name}'s max_seq_len {self.max_seq_len}")


# --------------------------------------------------------------------------- Flax NNX
@contextlib.contextmanager
def _cheap_tracer_attribute_errors():
    """Trace a module's construction in time linear in its size.

    Flax's ``Variable.set_value`` (every RNG draw while a module is built) compares
    ``getattr(value, "sharding", None)`` of the new value. Under tracing the value is a tracer, whose
    ``sharding`` raises an AttributeError that ``getattr`` swallows -- but JAX first builds the error
    message, walking every equation traced so far to find the value's origin. That makes tracing a
    model's construction quadratic in its size (a 48-layer GPT took 16 s, 1.9 s without it). While a
    construction is traced, the origin part of such messages is left out. JAX's private hook is
    patched only if it exists; otherwise this does nothing.
    """
    try:
        from jax._src.interpreters import partial_eval as pe

        tracer = pe.DynamicJaxprTracer
        original = tracer.__dict__["_origin_msg"]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    tracer._origin_msg = lambda self: ""
    try:
        yield
    finally:
        tracer._origin_msg = original


def _get_path(tree, path: tuple[str, ...], what: str):
    node = tree
    for i, key in enumerate(path):
        try:
            node = node[key] if isinstance(node, Mapping) else getattr(node, key)
        except (KeyError, AttributeError):
            raise JaxmemError(
                f"from_nnx: the model has no {'.'.join(path[: i + 1])!r} ({what}); pass layers='attribute.path' "
                "naming the list of repeated layers, e.g. layers='blocks' or layers='model.layers'"
            ) from None
    return node


def _dict_paths(tree) -> list[tuple]:
    """Each leaf's path in a nested dict, as a tuple of its keys."""
    return [tuple(k.key for k in at) for at, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _partition(tree, paths: frozenset) -> tuple[dict, dict]:
    """A nested dict cut in two: the leaves not at ``paths``, and those at them (each a nested dict)."""

    def cut(node, prefix):
        rest, chosen = {}, {}
        for key, value in node.items():
            at = (*prefix, key)
            if isinstance(value, Mapping):
                r, c = cut(value, at)
                if r:
                    rest[key] = r
                if c:
                    chosen[key] = c
            elif at in paths:
                chosen[key] = value
            else:
                rest[key] = value
        return rest, chosen

    return cut(tree, ())


def _state_paths(state) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)]


def _held_arrays(module) -> list[str]:
    """Paths of plain array attributes of ``module`` and its submodules that ``nnx.eval_shape`` left
    as tracers (they are not state there): the module must be built for real to read them."""
    from flax import nnx

    found = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            for name, value in vars(node).items():
                if isinstance(value, jax.core.Tracer):
                    found.append(".".join(map(str, (*path, name))))
    return found


def _check_same_constants(layers: str, first, other) -> None:
    """Layers of one kind share one function, so one set of constants: refuse layers whose differ."""
    import numpy as np

    (i, a), (j, b) = first, other
    if i == j:
        return
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        if np.shape(x) != np.shape(y) or not np.array_equal(np.asarray(x), np.asarray(y)):
            raise JaxmemError(
                f"from_nnx: layers {layers}[{i}] and {layers}[{j}] hold different values in "
                f"{jax.tree_util.keystr(path)}, which is not an nnx.Param: jaxmem holds such state as a constant "
                "of the layer's code, one per kind of layer. Make it an nnx.Param (trained), or compute it in "
                "__call__ from a static setting of the layer"
            )


class _Constants:
    """Around a call of a :func:`from_nnx` module: refuse the call if it wrote state jaxmem holds as a
    constant (anything but ``nnx.Param``): its writes would be lost, not carried to the next step."""

    def __init__(self, module, what: str, carried: bool = False):
        from flax import nnx

        self.module, self.what = module, what
        self.held = nnx.Not(nnx.Any(nnx.Param, nnx.BatchStat)) if carried else nnx.Not(nnx.Param)
        self.before = jax.tree_util.tree_leaves_with_path(nnx.state(module, self.held))

    def __enter__(self):
        return self.module

    def __exit__(self, kind, *_):
        from flax import errors as flax_errors
        from flax import nnx

        if not self.before or kind is not None and not issubclass(kind, flax_errors.TraceContextError):
            return False
        if kind is not None:  # flax refuses the write itself: a constant lives outside this trace
            stats = jax.tree_util.tree_leaves_with_path(nnx.state(self.module, nnx.BatchStat))
            written = [jax.tree_util.keystr(p) for p, _ in stats or self.before]
        else:
            after = jax.tree.leaves(nnx.state(self.module, self.held))
            written = [jax.tree_util.keystr(p) for (p, a), b in zip(self.before, after) if a is not b]
        if written:
            in_layer = self.what == "a layer"
            stats = bool(jax.tree.leaves(nnx.state(self.module, nnx.BatchStat)))
            if in_layer:
                hint = (
                    " jaxmem carries nnx.BatchStat state that the repeated layers write (the step keeps the mean "
                    "of what its microbatches wrote, as for BatchNorm's statistics): declare it nnx.BatchStat if "
                    "that is the update you want, nnx.Param if it is to be trained, or compute it without writing"
                )
            elif stats:
                hint = (
                    " BatchNorm's statistics are carried only inside the repeated layers (from_nnx's layers=): "
                    "move the norm into a layer, use a norm without them (nnx.LayerNorm, nnx.RMSNorm, "
                    "nnx.GroupNorm), or BatchNorm(use_running_average=True) to keep them fixed"
                )
            else:
                hint = (
                    " State outside the repeated layers is carried by no step: make it an nnx.Param if it is to "
                    "be trained, or compute it without writing"
                )
            raise JaxmemError(
                f"model state ({', '.join(written[:4])}) is written by {self.what}: jaxmem holds it as a constant "
                f"of the model's code, so the write would be lost.{hint}"
            )
        return False


def from_nnx(
    model,
    *,
    layers: str,
    embed: Callable,
    head_loss: Callable,
    tags: TagSet | Sequence[str],
    call_layer: Callable | None = None,
    loss: Callable | None = None,
    name: str = "custom",
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    config: object = None,
    analytic: object = None,
    rng: bool = False,
    logits: Callable | None = None,
    vocab: VocabParallel | None = None,
    axis_rules: Mapping[str, str | None] | None = None,
    batch_spec: Callable[[int, int], dict] | None = None,
) -> StagedModel:
    """A :class:`StagedModel` from a Flax NNX module, using the module's own code for the math.

    Args:
        model: the module, or a factory ``rngs -> module`` (then ``init(seed)`` builds a fresh one
            with ``nnx.Rngs(seed)``; with a module, ``init`` returns its current parameters).
        layers: attribute path of the repeated layers (an ``nnx.List`` of modules; they may differ in
            static settings and in their parameters, see :attr:`StagedModel.layer_kinds` and
            :attr:`StagedModel.layer_families`), e.g. ``"blocks"`` or ``"model.layers"``.
        embed: ``(module, batch) -> x``: the prologue, called on the model without its layers.
        head_loss: ``(module, x, batch) -> (loss_sum, weight)``, also on the model without its layers
            (:func:`token_loss` computes both from logits).
        tags: the ``checkpoint_name`` tags the model emits, or a :class:`TagSet` with groups
            (``quadratic``: what ``selective`` recomputes).
        call_layer: ``(layer, x, batch) -> x``; default ``layer(x)``.
        loss: ``(module, batch) -> mean loss`` of the whole model, the gradient reference for
            ``verify`` (default: the pieces composed).
        name, vocab_size, max_seq_len, config, analytic: as in :class:`StagedModel`.
        rng: the model uses dropout (or other randomness). Build its ``nnx.Dropout`` modules without
            ``rngs`` and pass the key jaxmem provides, e.g. ``block(x, rngs=batch["rng"])`` in
            ``call_layer``: every layer, microbatch and step gets its own key (:func:`layer_batch`),
            and the pipelined step must be given one per step (``value_and_grad(params, batch, rng)``;
            the trainer and ``jaxmem train`` pass :func:`~jaxmem.train.step_key` of the seed and step,
            so a resumed run draws the masks the uninterrupted one would have). A held-out loss is
            traced in the module's evaluation mode (:func:`evaluating`: ``nnx.Dropout`` drops
            nothing). The masks depend on the step, replica, microbatch, stage and layer: the same
            key on another stage split or microbatch count draws other masks.
        logits: ``(module, batch) -> logits`` of the whole model, to sample from it
            (``jaxmem sample``, :func:`~jaxmem.models.generate`); optional.
        vocab: where the vocabulary tables are, for a pipeline to split them over its ranks
            (:class:`VocabParallel`, its ``embed`` and ``hidden`` taking the module without its layers);
            optional: without it they are kept whole.
        axis_rules: logical axis name -> mesh axis, for the parameters' ``nnx.with_partitioning``
            annotations (default :data:`AXIS_RULES`: ``heads``, ``kv_heads``, ``mlp`` and ``tensor``
            itself go to the ``tensor`` axis). Only ``tensor`` is taken from the model; names that map
            elsewhere or nowhere leave the dimension to jaxmem's own placement. The module is built
            without eager sharding (``nnx.use_eager_sharding(False)``), so no mesh context is needed.
        batch_spec: ``(batch_size, seq_len) -> dict of jax.ShapeDtypeStruct``, the batch the model
            takes when it is not the language models' int32 ``tokens``/``targets`` (e.g. a
            classifier's images and labels): the ledger and planner trace the model with it.

    Only ``nnx.Param`` variables are trained. ``nnx.BatchStat`` state of the layers (BatchNorm's
    running statistics) is carried from step to step beside the parameters (at its own path in their
    tree; :attr:`StagedModel.carried`, :func:`carry_state`): each step writes the mean over its
    microbatches and replicas of what their forwards wrote. Other state (a buffer ``nnx.Variable``, a
    plain array attribute, statistics outside the layers) is held as a constant of the model's code,
    taken from the module built with seed 0 (a factory with such state is built once for real); a
    forward that writes it is refused where it writes, and RNG streams kept in the module are refused
    with the variables named (pass ``rng=True`` instead).

    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.embed = nnx.Embed(16, 8, rngs=rngs)
    ...         self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])
    ...         self.head = nnx.Linear(8, 16, rngs=rngs)
    >>> staged = from_nnx(
    ...     Net,
    ...     layers="blocks",
    ...     embed=lambda m, batch: m.embed(batch["tokens"]),
    ...     head_loss=lambda m, x, batch: token_loss(m.head(x), batch),
    ...     tags=(),
    ... )
    >>> staged.n_layers, len(staged.split(staged.init(0))[0])
    (4, 4)
    """
    from flax import nnx

    factory = None if isinstance(model, nnx.Module) else model
    if factory is not None and not callable(factory):
        raise JaxmemError(f"from_nnx takes an nnx.Module or a factory rngs -> module, got {type(model).__name__}")
    if factory is not None:
        try:
            with _cheap_tracer_attribute_errors(), nnx.use_eager_sharding(False):
                abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
        except (ValueError, jax.errors.UnexpectedTracerError):
            # A plain array attribute (``self.scale = jnp.full(...)``) is the module's static metadata:
            # traced, it leaks, and the next abstract build of the same class fails comparing it with
            # the last. Such a module is built for real below anyway; one that fails for another
            # reason fails there again, with its own error.
            abstract = None
        if (
            abstract is None
            or isinstance(abstract, nnx.Module)
            and (_held_arrays(abstract) or _state_paths(nnx.state(abstract, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))))
        ):
            # State other than parameters is held as constants, which need their values: the module
            # is built once for real (seed 0) -- only for a model that has such state.
            with nnx.use_eager_sharding(False):
                abstract = factory(nnx.Rngs(0))
    else:
        abstract = model
    if not isinstance(abstract, nnx.Module):
        raise JaxmemError(f"from_nnx: the factory returned {type(abstract).__name__}, not an nnx.Module")
    path = tuple(p for p in str(layers).split(".") if p)
    node = _get_path(abstract, path, "the repeated layers")
    if isinstance(node, nnx.Module) and not isinstance(node, nnx.List) or not isinstance(node, (Sequence, nnx.List)):
        raise JaxmemError(
            f"from_nnx: {layers!r} is a {type(node).__name__}, not a list of layer modules; name the nnx.List "
            "that holds the repeated layers"
        )
    layer_modules = list(node)
    if not layer_modules or not all(isinstance(m, nnx.Module) for m in layer_modules):
        raise JaxmemError(f"from_nnx: {layers!r} holds no layer modules")

    def trained_or_carried(at, value) -> bool:
        """Parameters, and the layers' BatchNorm statistics (carried from step to step)."""
        return isinstance(value, nnx.Param) or isinstance(value, nnx.BatchStat) and tuple(at[: len(path)]) == path

    graphdef, params, rest = nnx.split(abstract, trained_or_carried, ...)
    streams = _state_paths(nnx.state(abstract, nnx.RngState))
    if streams:
        raise JaxmemError(
            f"from_nnx: the model keeps RNG streams ({', '.join(streams[:4])}{', ...' if len(streams) > 4 else ''}); "
            "jaxmem draws a key per layer, microbatch and step itself. For dropout, build nnx.Dropout "
            "without rngs, pass the key jaxmem provides (e.g. call_layer=lambda block, x, batch: block(x, "
            'rngs=batch["rng"])) and say from_nnx(..., rng=True)'
        )
    # Any other state (buffers, plain arrays, frozen batch statistics) is held as a constant: read by
    # the functions, never trained, and refused where the model writes it (see _Constants).
    # Layers may differ in their static configuration (a window, a RoPE base, a flag set in
    # __init__) and in their parameters (dense and mixture-of-experts layers): each distinct graphdef
    # is a kind, run by its own layer function (layers of other parameters are also other families,
    # StagedModel.layer_families, which a pipeline stacks apart).
    layer_graphdefs: list = []
    layer_consts: list = []  # per kind, its layers' constants (the same in every layer of the kind)
    layer_kinds = []
    layer_carried: list = []  # per kind, the paths of its BatchNorm statistics (carried state)
    for i, module in enumerate(layer_modules):
        graphdef_i, _, stats_i, consts_i = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
        if graphdef_i not in layer_graphdefs:
            layer_graphdefs.append(graphdef_i)
            layer_consts.append((i, consts_i))
            layer_carried.append(frozenset(_dict_paths(nnx.to_pure_dict(stats_i))))
        kind = layer_graphdefs.index(graphdef_i)
        _check_same_constants(layers, layer_consts[kind], (i, consts_i))
        layer_kinds.append(kind)

    # The model without its layers: embed and head_loss run on it (the arrays are shared, not copied).
    shell = nnx.merge(graphdef, params, rest)
    parent = _get_path(shell, path[:-1], "the layers' parent") if len(path) > 1 else shell
    setattr(parent, path[-1], nnx.List([]))
    shell_graphdef, shell_params, shell_consts = nnx.split(shell, nnx.Param, ...)
    shared_structure = jax.tree_util.tree_structure(nnx.to_pure_dict(shell_params))

    def split(params):
        node = params
        for key in path[:-1]:
            node = node[key]
        stacked = node[path[-1]]
        layer_list = [stacked[i] for i in sorted(stacked)] if isinstance(stacked, Mapping) else list(stacked)
        shared = _without(params, path)
        if jax.tree_util.tree_structure(shared) != shared_structure:
            raise JaxmemError(
                f"model {name!r}: the parameters do not have the model's structure (without {layers!r}: expected "
                f"{shared_structure}, got {jax.tree_util.tree_structure(shared)})"
            )
        return layer_list, shared

    def join(layer_list, shared):
        return _with(shared, path, dict(enumerate(layer_list)))

    def shell_module(shared):
        return _in_mode(nnx.merge(shell_graphdef, shared, shell_consts))

    def embed_fn(shared, batch):
        with _Constants(shell := shell_module(shared), "the embedding"):
            return embed(shell, batch)

    def kind_layer(layer_graphdef, consts, carried):
        def layer_fn(layer_params, x, batch):
            if not carried:
                module = _in_mode(nnx.merge(layer_graphdef, layer_params, consts))
                with _Constants(module, "a layer"):
                    return call_layer(module, x, batch) if call_layer is not None else module(x)
            # BatchNorm's statistics: read as the step found them, written by the forward and handed
            # to the step through carry_state (its gradient channel; see StagedModel.carried).
            trained, old = _partition(layer_params, carried)
            module = _in_mode(nnx.merge(layer_graphdef, trained, old, consts))
            with _Constants(module, "a layer", carried=True):
                y = call_layer(module, x, batch) if call_layer is not None else module(x)
            return carry_state(y, old, nnx.to_pure_dict(nnx.state(module, nnx.BatchStat)))

        return layer_fn

    kind_fns = tuple(
        kind_layer(g, c, k) for g, (_, c), k in zip(layer_graphdefs, layer_consts, layer_carried, strict=True)
    )
    carried = frozenset().union(*layer_carried)

    def head_fn(shared, x, batch):
        with _Constants(shell := shell_module(shared), "the head"):
            return head_loss(shell, x, batch)

    if factory is not None:

        def init(seed: int):
            with nnx.use_eager_sharding(False):
                return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(seed)), trained_or_carried))

    else:
        current = nnx.to_pure_dict(nnx.state(model, trained_or_carried))

        def init(seed: int):
            return current

    loss_fn = None
    if loss is not None:

        def loss_fn(params, batch):
            return loss(_in_mode(nnx.merge(graphdef, params, rest)), batch)

    logits_fn = None
    if logits is not None:

        def logits_fn(params, batch):  # sampling: always in evaluation mode
            module = nnx.merge(graphdef, params, rest)
            module.eval()
            return logits(module, batch)

    vocab_split = None
    if vocab is not None:
        if not isinstance(vocab, VocabParallel):
            raise JaxmemError(f"from_nnx: vocab takes a VocabParallel, got {type(vocab).__name__}")
        shared_shapes = nnx.to_pure_dict(shell_params)
        for what, where in vocab.paths().items():
            try:
                node = shared_shapes
                for key in where:
                    node = node[key]
                ndim = len(node.shape)
            except (KeyError, TypeError, AttributeError):
                raise JaxmemError(
                    f"from_nnx: vocab {what} {'.'.join(where)!r} is not a parameter of the model outside its layers"
                ) from None
            if ndim != 2:
                raise JaxmemError(f"from_nnx: vocab {what} {'.'.join(where)!r} is not a matrix (it has {ndim} dims)")
        module_embed, module_hidden = vocab.embed, vocab.hidden
        vocab_split = dataclasses.replace(
            vocab,
            embed=lambda shared, rows, batch: module_embed(shell_module(shared), rows, batch),
            hidden=lambda shared, x, batch: module_hidden(shell_module(shared), x, batch),
        )

    staged = StagedModel(
        vocab=vocab_split,
        name=name,
        n_layers=len(layer_modules),
        init=init,
        split=split,
        join=join,
        embed=embed_fn,
        layer=kind_fns[0],
        head_loss=head_fn,
        tags=tags if isinstance(tags, TagSet) else TagSet(tuple(tags)),
        loss=loss_fn,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        config=config,
        analytic=analytic,
        rng=bool(rng),
        logits=logits_fn,
        axes=_param_axes(params, AXIS_RULES if axis_rules is None else axis_rules, name),
        batch_spec=batch_spec,
        layer_kinds=tuple(layer_kinds) if len(kind_fns) > 1 else None,
        kind_layers=kind_fns if len(kind_fns) > 1 else None,
        carried=carried,
    )
    if factory is not None:  # the abstract module built above is what init(0) would give: keep its shapes
        abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(params))
        object.__setattr__(staged, "_abstract_params", abstract_params)
    return staged


def repeated_layers(shallow: StagedModel, full: Callable[[], StagedModel], n_layers: int, **fields) -> StagedModel:
    """A model of ``n_layers`` identical layers from ``shallow``, the same model built with fewer:
    its abstract parameters and axes repeat the shallow model's first layer, and what needs the
    whole module -- ``init``, ``loss``, ``logits`` -- builds it with ``full()`` when first called.

    Building a Flax module traces every layer's constructor: the gpt2-xl preset at 400 layers took
    18 s to build, the same at one layer a few tenths, so a planner that scores many depths builds
    each by repetition. ``fields``: other :class:`StagedModel` fields of the deep model (``config``,
    ``analytic``). ``shallow`` must be of one kind and one family (every layer alike).

    >>> from jaxmem.models import gpt, get_config
    >>> one, four = gpt(get_config("tiny", n_layers=1)), gpt(get_config("tiny", n_layers=4))
    >>> deep = repeated_layers(one, lambda: four, 4)
    >>> deep.n_layers, jax.tree.structure(deep.abstract_params()) == jax.tree.structure(four.abstract_params())
    (4, True)
    """
    if shallow.layer_kinds is not None or shallow.layer_families is not None:
        raise JaxmemError(f"model {shallow.name!r}: repeated_layers needs layers all alike (one kind and one family)")
    full = functools.cache(full)

    def repeat(tree):  # a tree shaped like the shallow model's parameters, its first layer n_layers times
        layers, shared = shallow.split(tree)
        return shallow.join([layers[0]] * n_layers, shared)

    axes = None if shallow.axes is None else repeat(shallow.axes)
    deep = dataclasses.replace(
        shallow,
        n_layers=n_layers,
        init=lambda seed: full().init(seed),
        loss=None if shallow.loss is None else lambda params, batch: full().loss(params, batch),
        logits=None if shallow.logits is None else lambda params, batch: full().logits(params, batch),
        axes=axes,
        **fields,
    )
    object.__setattr__(deep, "_abstract_params", repeat(shallow.abstract_params()))
    return deep
