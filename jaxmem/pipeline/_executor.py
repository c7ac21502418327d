"""The pipelined gradient: any model, any validated schedule, run as ONE ``jax.jit(shard_map(...))``
program.

Inside ``shard_map`` over a ``("data", "pipe")`` mesh, a ``lax.scan`` walks the schedule's ticks. Each
tick, every rank looks up its row of the tick table and runs its action -- idle, or F / B / I / W of
one stage class (role, layer count, memory-policy variant, local stage) -- as the one of a row of
two-way ``lax.cond``s whose predicate holds (the state passes the others untouched, so XLA updates the
stash and the gradient accumulators in place). A forward writes its ``jax.vjp`` residuals into its
slot of a stash arena (on host when the policy says so); a backward rebuilds the pullback from that
slot. Every tick each rank sends one message per ppermute offset (activations
forward, gradients backward); a message is whatever pytree the model's layers pass on, with shapes
and dtypes from ``jax.eval_shape`` of its embedding. The last stage adds up ``(loss_sum, weight)``;
gradients accumulate in the parameters' dtype, are summed over ``data`` (and the shared ones over
``pipe``) and divided by the total weight, so the result is the gradient of the mean loss over the
counted tokens of the whole batch, however it is microbatched or masked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import first_device, platform_of, step_compiler_options
from jaxmem.models import RNG_SPEC, StagedModel, context_calls, context_order, context_stand_in, get_model, traced_for
from jaxmem.pipeline._body import StepBody, varying_axes
from jaxmem.pipeline._compute_copy import compute_model_abstract, may_cut_master, narrow_vocab
from jaxmem.pipeline._iw import StageSplit, abstract_split
from jaxmem.pipeline._placement import (
    AXES,
    CONTEXT,
    MESH_AXES,
    TENSOR,
    LeafPlacement,
    Placement,
    is_placement,
    layout_axes,
    placement_of,
)
from jaxmem.pipeline._residuals import ResidualPlan, analyze_stage, emitted_tags
from jaxmem.pipeline._split import ParamLayout, PipelineParams, model_layer_counts, stage_forward
from jaxmem.pipeline._ticks import (
    StageClass,
    TickProgram,
    build_tick_program,
    cell_classes,
    stash_rows,
)
from jaxmem.policy import ResolvedPolicy, resolve
from jaxmem.schedule import Kind, Schedule, forward_only, validate
from jaxmem.targets import host_memory_kinds

__all__ = ["Pipeline", "batch_spec", "make_mesh", "varying_axes"]

HOST = "pinned_host"


def make_mesh(
    data: int = 1, pipe: int = 1, devices: Sequence | None = None, *, fsdp: int = 1, context: int = 1, tensor: int = 1
) -> Mesh:
    """A ``("data", "fsdp", "pipe", "context", "tensor")`` mesh over the first ``data * fsdp * pipe *
    context * tensor`` devices (``tensor`` innermost: neighbouring devices, the fastest links, then
    ``context``); an axis of size 1 among ``context`` and ``tensor`` is left out, so that layouts
    without one compile the programs they always did.

    ``data`` replicas hold whole parameters; ``fsdp`` replicas hold a shard of each and gather it per
    use (see :mod:`jaxmem.pipeline._placement`); both split the batch. ``context`` splits every
    sequence: each of its devices holds two of ``2 * context`` chunks of each sequence (chunk ``i``
    and ``2 * context - 1 - i``, so causal attention's work is even) and the keys and values of all
    of them for attention (:func:`jaxmem.models.context_kv`). ``tensor`` cuts the dimensions the
    model's annotations name, and its devices compute every microbatch together.

    Raises:
        JaxmemError: when there are not enough devices, with the arithmetic.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "pipe": pipe, CONTEXT: context, TENSOR: tensor}
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise JaxmemError(f"mesh axis sizes must be integers >= 1, got {bad}")
    need = math.prod(sizes.values())
    if need > len(devices):
        shape = " x ".join(f"{k}({v})" for k, v in sizes.items() if v > 1 or k in ("data", "pipe"))
        raise JaxmemError(
            f"{shape} = {need} devices, but only {len(devices)} are available "
            f"({devices[0].platform}); on CPU, start with more virtual devices: {setting('devices', need)}, or "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX is imported"
        )
    names = tuple(a for a in MESH_AXES if a in AXES or sizes[a] > 1)
    return Mesh(np.array(devices[:need]).reshape([sizes[a] for a in names]), names)


def _normalize_mesh(mesh: Mesh) -> Mesh:
    """A mesh of jaxmem's axes: ``("data", "fsdp", "pipe")`` and, optionally, ``"context"`` and
    ``"tensor"`` after them in that order; the earlier ``("data", "pipe")`` is taken as one with
    ``fsdp`` of 1."""
    names = tuple(mesh.axis_names)
    if names[:3] == AXES and names[3:] in ((), (CONTEXT,), (TENSOR,), (CONTEXT, TENSOR)):
        return mesh
    if names == ("data", "pipe"):
        shape = dict(zip(names, mesh.devices.shape))
        return Mesh(mesh.devices.reshape(shape["data"], 1, shape["pipe"]), AXES)
    raise JaxmemError(
        f"the mesh axes must be {AXES}, then optionally {CONTEXT!r} and {TENSOR!r} (see jaxmem.pipeline.make_mesh), "
        f"got {names}"
    )


def batch_spec(batch: int, seq: int, *, loss_mask: bool = False, positions: bool = False) -> dict:
    """The abstract batch dict a pipeline is built for: ``tokens``/``targets`` int32 ``[batch, seq]``,
    optionally a float32 ``loss_mask`` and int32 ``positions`` of the same shape."""
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    spec = {"tokens": tokens, "targets": tokens}
    if loss_mask:
        spec["loss_mask"] = jax.ShapeDtypeStruct((batch, seq), jnp.float32)
    if positions:
        spec["positions"] = tokens
    return spec


def _raw_key(rng, model) -> jax.Array:
    """The step's key as raw key data; errors when the model needs one and none is given (or the
    other way round)."""
    if not model.rng:
        if rng is not None:
            raise JaxmemError(f"model {model.name!r} draws no random numbers (rng=False); do not pass rng")
        return jnp.zeros((2,), jnp.uint32)
    if rng is None:
        raise JaxmemError(
            f"model {model.name!r} uses dropout (rng=True): pass a key per step, e.g. "
            "rng=jax.random.fold_in(jax.random.key(seed), step)"
        )
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    if rng.shape != RNG_SPEC.shape or rng.dtype != RNG_SPEC.dtype:
        raise JaxmemError(f"rng must be a threefry key (uint32[2] or jax.random.key), got {rng.dtype}{list(rng.shape)}")
    return rng


def _spec_of(batch) -> dict:
    """Abstract batch (shapes and dtypes only) of a batch of arrays or of shaped values: a dict of
    arrays that lead with the batch size, any keys (``tokens``/``targets`` are the built-in language
    models' convention)."""
    if not isinstance(batch, dict) or not batch or not all(hasattr(v, "shape") for v in batch.values()):
        raise JaxmemError(
            "a batch is a dict of arrays that lead with the batch size, e.g. {'tokens', 'targets'} for the "
            "language models or {'images', 'labels'} for a classifier; "
            f"got {type(batch).__name__}"
            + ("" if not isinstance(batch, dict) else f" with { ({k: type(v).__name__ for k, v in batch.items()}) }")
        )
    return {k: jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(v.dtype)) for k, v in batch.items()}


def batch_size(spec: dict) -> int:
    """The batch size of a batch spec: the leading dimension of its leaves (``tokens`` first)."""
    first = spec["tokens"] if "tokens" in spec else spec[min(spec)]
    if not first.shape:
        raise JaxmemError(f"batch leaves must lead with the batch size; got a scalar {first}")
    return first.shape[0]


def uses_split_backward(schedule: Schedule) -> bool:
    """The schedule splits some backward into I and W."""
    return any(a.kind is Kind.I for a in schedule.actions())


def splits_backward(schedule: Schedule, split_backward: bool) -> bool:
    """A pipeline asked for ``split_backward`` hands I's cotangents to W (:mod:`jaxmem.pipeline._iw`)
    on a schedule with I and W actions (with a tensor axis, through arenas cut over it, as the stash is)."""
    return bool(split_backward) and uses_split_backward(schedule)


def _counted(spec: dict) -> int:
    """What the loss's mean is over, before a loss mask: the targets of a language model's batch
    (every position), else the examples."""
    return int(np.prod(spec["targets"].shape)) if "targets" in spec else batch_size(spec)


def _key(spec: dict) -> tuple:
    return tuple(sorted((k, v.shape, v.dtype.name) for k, v in spec.items()))


class Pipeline:
    """A model cut into stages and run by a schedule on a mesh, under a memory policy.

    Args:
        model: a :class:`~jaxmem.models.StagedModel` (or a preset name / config, see
            :func:`jaxmem.models.get_model`).
        schedule: any valid schedule.
        mesh: axes ``("data", "fsdp", "pipe")`` (:func:`make_mesh`; a ``("data", "pipe")`` mesh is taken
            as one with ``fsdp=1``); ``pipe`` must equal the schedule's ranks.
        layer_counts: layers per stage (balanced when omitted).
        policy: a memory policy spec (see :func:`jaxmem.policy.from_spec`), resolved against the
            model's declared tags; ``save-all`` by default.
        drop_layers: global indices of layers skipped (layer drop: a different program per set).
        zero: shard the optimizer state and the step's gradients over the replicas (ZeRO-1/2; no
            effect on one replica). The parameters are sharded by the mesh's ``fsdp`` axis.
        vocab_parallel: split the vocabulary tables over the pipe ranks (see
            :mod:`jaxmem.pipeline._vocab`); by default when the model says where they are
            (``StagedModel.vocab``) and there are several ranks.
        master_cut: keep the master weights cut over the replicas like the optimizer state, and run
            the stages on a copy cast to the compute dtype (:mod:`jaxmem.pipeline._compute_copy`;
            :meth:`compute_params` makes it). By default with ``zero``, several ``data`` replicas,
            a model that casts some parameter to a narrower dtype where it uses it, and no weights or
            optimizer state offloaded by the policy; or with FSDP (each action then gathers the copy).
        split_backward: on schedules that split the backward (ZB-H1, ZBV, Chronos), I hands W the
            cotangents its weight products read instead of W running the stage's pullback again
            (:mod:`jaxmem.pipeline._iw`): faster, at the memory of those cotangents from I to W (the
            ledger prices them). Off by default; not with a ``tensor`` axis.
        hand_recomputed: with ``split_backward``, I also hands W the forward values it recomputed
            (under a policy that recomputes), so W recomputes no forward: a forward's FLOPs less per
            W, for those activations' bytes kept from I to W (the ledger prices them).

    Use :meth:`value_and_grad` for loss and gradients, or :meth:`grad_fn` inside your own jitted
    step (see ``examples/train_own_model.py``).
    """

    def __init__(
        self,
        model,
        schedule: Schedule,
        mesh: Mesh,
        *,
        layer_counts: Sequence[int] | None = None,
        policy=None,
        drop_layers: frozenset[int] = frozenset(),
        zero: bool = True,
        vocab_parallel: bool | None = None,
        master_cut: bool | None = None,
        split_backward: bool = False,
        hand_recomputed: bool = False,
    ):

        validate(schedule)
        mesh = _normalize_mesh(mesh)
        if mesh.shape["pipe"] != schedule.num_ranks:
            raise JaxmemError(
                f"the schedule has {schedule.num_ranks} ranks but the mesh's pipe axis has "
                f"{mesh.shape['pipe']} devices; build the schedule with {mesh.shape['pipe']} ranks "
                f"({setting('pipe', mesh.shape['pipe'])}) or a mesh whose pipe axis has {schedule.num_ranks}"
            )
        per_rank = {len(schedule.stages_of(r)) for r in range(schedule.num_ranks)}
        if len(per_rank) != 1:
            raise JaxmemError("every rank must own the same number of stages (one SPMD program)")
        self.model: StagedModel = get_model(model)
        self.schedule = schedule
        self.mesh = mesh
        self.layer_counts = model_layer_counts(self.model, schedule.num_stages, layer_counts)
        self.policy: ResolvedPolicy = resolve(policy, schedule, self.model.tags)
        self.virtual = per_rank.pop()
        self.drop_layers = frozenset(drop_layers)
        self.zero = bool(zero)
        if vocab_parallel and self.model.vocab is None:
            raise JaxmemError(
                f"model {self.model.name} does not say where its vocabulary tables are (StagedModel.vocab / "
                "from_nnx(..., vocab=VocabParallel(...))), so they cannot be split over the ranks"
            )
        use_vocab = self.model.vocab is not None and mesh.shape["pipe"] > 1 and vocab_parallel is not False
        self.vocab = self.model.vocab if use_vocab else None
        bad_drop = sorted(i for i in self.drop_layers if not 0 <= i < self.model.n_layers)
        if bad_drop:
            raise JaxmemError(f"dropped layers {bad_drop} are outside the model's layers 0..{self.model.n_layers - 1}")
        self.cell_classes = cell_classes(
            schedule,
            self.layer_counts,
            self.policy,
            self.drop_layers,
            self.model.layer_kinds,
            self.model.layer_families,
        )
        # Weights on host per local position (the policy checked this is consistent across ranks).
        self.weights_on_host = tuple(self.policy.offload_weights(schedule.stages_of(0)[v]) for v in range(self.virtual))
        # Under FSDP, local stages whose gathered weights stay from the step's first action to its end.
        self.kept_gathered = tuple(
            self.policy.keep_gathered(schedule.stages_of(0)[v]) and mesh.shape["fsdp"] > 1 for v in range(self.virtual)
        )
        self.optimizer_state_on_host = tuple(
            self.policy.offload_optimizer_state(schedule.stages_of(0)[v]) for v in range(self.virtual)
        )
        self.platform = platform_of(mesh)
        # XLA:CPU over gloo: reduce-scatters as an all-reduce and a slice (_body.reduce_scatter says why).
        self.sum_then_slice = self.platform == "cpu" and len({d.process_index for d in mesh.devices.flat}) > 1
        if (any(self.weights_on_host) or any(self.optimizer_state_on_host)) and not host_memory_kinds(mesh):
            kind = first_device(mesh).device_kind
            raise JaxmemError(
                f"policy {self.policy.policy.name!r} keeps weights or optimizer state on host between steps, but "
                f"these devices ({kind}) describe no host memory: "
                + (
                    "an H100 compiled for without one present (jax 0.10.2's compile-only GPU devices list no "
                    "memory kinds), so the program would be compiled with that state on the device. Compile this "
                    "policy on a machine with the GPUs, or for a TPU target; offload-stash compiles here"
                    if self.platform == "gpu"
                    else "choose a policy that keeps them on the device"
                )
            )
        if self.model.carried and self.context > 1:
            written = ", ".join(sorted(".".join(map(str, p)) for p in self.model.carried)[:4])
            raise JaxmemError(
                f"model {self.model.name} carries state its layers write ({written}: "
                "BatchNorm's statistics), computed over the tokens a device holds: with a context axis each "
                "device holds part of every sequence, so they would be statistics of the part. Train it without "
                "a context axis (context=1), or normalize without batch statistics (nnx.LayerNorm, nnx.RMSNorm)"
            )
        self._master_cut = master_cut
        self.split_backward = bool(split_backward)
        self.hand_recomputed = bool(hand_recomputed)
        if self.hand_recomputed and not self.split_backward:
            raise JaxmemError(
                f"{setting('hand_recomputed')} hands W what I recomputed when the backward is split: set "
                f"{setting('split_backward', True)} too"
            )
        if master_cut and not self._may_cut_master():
            raise JaxmemError(
                "master_cut needs ZeRO (zero=True) over more than one data replica, or FSDP, and no weights or "
                "optimizer state offloaded by the policy"
            )
        self._programs: dict[tuple, tuple[TickProgram, dict]] = {}
        self._grad_fns: dict[tuple, object] = {}
        self._jitted: dict[tuple, object] = {}
        self._tags_checked = False

    def with_policy(self, policy, drop_layers: frozenset[int] = frozenset()) -> Pipeline:
        """This pipeline under another policy (and set of dropped layers): the same model, schedule,
        mesh, layer split and parameter layout (ZeRO, vocabulary split), so the state of one steps
        the other."""
        return Pipeline(
            self.model,
            self.schedule,
            self.mesh,
            layer_counts=self.layer_counts,
            policy=policy,
            drop_layers=drop_layers,
            zero=self.zero,
            vocab_parallel=self.vocab is not None,
            master_cut=self.master_cut,
            split_backward=self.split_backward,
            hand_recomputed=self.hand_recomputed,
        )

    # ------------------------------------------------------------------ parameters
    @property
    def config(self):
        """The model's own configuration (e.g. a GPTConfig)."""
        return self.model.config

    @property
    def data(self) -> int:
        """Replicas holding whole parameters (the mesh's ``data`` axis)."""
        return self.mesh.shape["data"]

    @property
    def fsdp(self) -> int:
        """Replicas holding a shard of the parameters (the mesh's ``fsdp`` axis)."""
        return self.mesh.shape["fsdp"]

    @property
    def replicas(self) -> int:
        """Replicas the batch is split over: ``data x fsdp``."""
        return self.data * self.fsdp

    @property
    def pipe(self) -> int:
        return self.mesh.shape["pipe"]

    @property
    def tensor(self) -> int:
        """Devices computing each microbatch together, cutting the dimensions the model's
        annotations name (the mesh's ``tensor`` axis)."""
        return self.mesh.shape.get(TENSOR, 1)

    @property
    def context(self) -> int:
        """Devices each sequence is split over (the mesh's ``context`` axis; :mod:`jaxmem.models._context`)."""
        return self.mesh.shape.get(CONTEXT, 1)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the step's ``shard_map`` is manual over: ``data``, ``fsdp``, ``pipe`` and a
        ``context`` axis (a ``tensor`` axis is left to XLA's partitioner)."""
        return AXES + ((CONTEXT,) if self.context > 1 else ())

    def local_spec(self, batch) -> dict:
        """A batch's spec as one device of the ``context`` axis holds it: every leaf ``[batch, seq,
        ...]`` with ``seq / context`` of each sequence (two chunks of it,
        :func:`~jaxmem.models.context_order`); the spec itself without a context axis."""
        spec = _spec_of(batch)
        if self.context == 1:
            return spec
        seqs = {k: v.shape[1] if len(v.shape) > 1 else None for k, v in spec.items()}
        seq = seqs.get("tokens") or next((n for n in seqs.values() if n), None)
        odd = {k: tuple(spec[k].shape) for k, n in seqs.items() if n != seq}
        if seq is None or odd:
            raise JaxmemError(
                f"a context axis splits every batch leaf along its sequence (dimension 1), so every leaf must be "
                f"[batch, seq, ...] with one seq; got {odd or {k: tuple(v.shape) for k, v in spec.items()}}. Drop "
                "the context axis for a batch without one sequence length"
            )
        context_order(seq, self.context)  # raises when seq does not split into 2 x context chunks
        if "tokens" in spec:
            self.model.check_batch(seq)  # the whole sequence against the model's positions
        return {
            k: jax.ShapeDtypeStruct((v.shape[0], seq // self.context, *v.shape[2:]), v.dtype) for k, v in spec.items()
        }

    @property
    def sizes(self) -> dict[str, int]:
        return {a: self.mesh.shape.get(a, 1) for a in MESH_AXES}

    def abstract_params(self) -> PipelineParams:
        if not hasattr(self, "_abstract"):
            self._abstract = jax.eval_shape(self.from_model_params, self.model.abstract_params())
        return self._abstract

    def _may_cut_master(self) -> bool:
        offloads = any(self.weights_on_host) or any(self.optimizer_state_on_host)
        return may_cut_master(zero=self.zero, data=self.data, fsdp=self.fsdp, offloads=offloads)

    def kept_bytes(self, abstract: PipelineParams) -> float:
        """Per-device bytes a step holds beyond the shards for the stages its policy keeps gathered
        (``kept_gathered``): their leaves of ``abstract`` whole over ``fsdp``, less the shard."""
        whole = {**self.sizes, "fsdp": 1}
        total = 0.0
        for v, keep in enumerate(self.kept_gathered):
            if keep:
                places = jax.tree.leaves(self.placement.stages[v], is_leaf=is_placement)
                for a, p in zip(jax.tree.leaves(abstract.stages[v]), places, strict=True):
                    extra = p.device_elems("params", whole) - p.device_elems("params", self.sizes)
                    total += extra * jnp.dtype(a.dtype).itemsize
        return float(total)

    def placed_bytes(self, abstract: PipelineParams, which: str = "params") -> float:
        """Per-device bytes of a tree in this pipeline's layout (e.g. :meth:`compute_abstract`) placed
        as the parameters (``which="params"``) or the optimizer state (``"state"``)."""
        placement = self.placement
        total = 0.0
        for tree, places in zip(
            (abstract.stages, abstract.shared, abstract.vocab), (placement.stages, placement.shared, placement.vocab)
        ):
            pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(places, is_leaf=is_placement), strict=True)
            total += sum(p.device_elems(which, self.sizes) * jnp.dtype(a.dtype).itemsize for a, p in pairs)
        return float(total)

    @property
    def master_cut(self) -> bool:
        """The master weights are cut over the replicas and the stages read a narrower copy (see the
        ``master_cut`` argument)."""
        if self._master_cut is None:
            self._master_cut = self._may_cut_master() and _narrower(self.compute_abstract(), self.abstract_params())
        return self._master_cut

    def compute_abstract(self) -> PipelineParams:
        """The parameters the stages read, abstract: the master weights' leaves cast to the compute
        dtype wherever the model casts them on use (:mod:`jaxmem.pipeline._compute_copy`)."""
        if not hasattr(self, "_compute"):
            self._compute = narrow_vocab(jax.eval_shape(self.from_model_params, self._compute_model()), self.vocab)
        return self._compute

    def _compute_model(self):
        """:meth:`compute_abstract` in the model's own layout."""
        seq = min(16, self.model.max_seq_len or 16)
        micro = {**batch_spec(1, seq), **({"rng": RNG_SPEC} if self.model.rng else {})}
        shared = self.model.split(self.model.abstract_params())[1]
        with _naming_batch_keys(self.model, micro):
            return compute_model_abstract(self.model, jax.eval_shape(self.model.embed, shared, micro), micro)

    def stage_abstract(self) -> PipelineParams:
        """What the stages are traced with: :meth:`compute_abstract` with ``master_cut``, else the
        parameters themselves."""
        return self.compute_abstract() if self.master_cut else self.abstract_params()

    def master_shardings(self) -> PipelineParams:
        """Where a training state keeps the parameters: cut like the optimizer state with
        ``master_cut``, else :meth:`shardings`."""
        return self.state_shardings() if self.master_cut else self.shardings()

    def compute_params(self, master: PipelineParams) -> PipelineParams:
        """Inside a jitted step: the parameters the stages read from the master weights, cast where the
        model casts them and gathered to :meth:`shardings` (16-bit all-gathers); the master weights
        themselves without ``master_cut``."""
        if not self.master_cut:
            return master
        cast = jax.tree.map(lambda m, c: m.astype(c.dtype), master, self.compute_abstract())
        return jax.lax.with_sharding_constraint(cast, self.shardings())

    @property
    def placement(self) -> Placement:
        """How every leaf of the parameters, the optimizer state and the gradients is cut over the mesh."""
        if not hasattr(self, "_placement"):
            self._placement = placement_of(self.abstract_params(), self.sizes, zero=self.zero, axes=self.param_axes)
        return self._placement

    @property
    def param_axes(self) -> PipelineParams | None:
        """The model's :class:`~jaxmem.models.ParamAxes` in the pipeline layout (None: the model
        annotates none, or there is no ``tensor`` axis)."""
        return layout_axes(self.model, self.virtual, self.vocab is not None) if self.tensor > 1 else None

    def _named(self, which: str, on_host) -> PipelineParams:
        placement = self.placement

        def named(p: LeafPlacement, host: bool = False):
            return NamedSharding(self.mesh, p.spec(which), memory_kind=HOST if host else None)

        stages = tuple(
            jax.tree.map(lambda p, v=v: named(p, on_host[v]), tree, is_leaf=is_placement)
            for v, tree in enumerate(placement.stages)
        )
        return PipelineParams(
            stages=stages,
            shared=jax.tree.map(named, placement.shared, is_leaf=is_placement),
            vocab=jax.tree.map(named, placement.vocab, is_leaf=is_placement),
        )

    def shardings(self, on_host: Sequence[bool] | None = None) -> PipelineParams:
        """The parameters' shardings: stage leaves split over ``pipe`` (and cut by ``fsdp``), shared
        ones on every pipe rank (cut by ``fsdp``).

        ``on_host[v]`` puts the v-th local stage on host (``pinned_host``); by default where the policy
        offloads weights.
        """
        return self._named("params", self.weights_on_host if on_host is None else tuple(on_host))

    def state_shardings(self, on_host: Sequence[bool] | None = None) -> PipelineParams:
        """Shardings of the optimizer state (per parameter) and of the gradients the step returns: the
        parameters' cut further over the replicas with ``zero``. ``on_host``: by default where the policy
        offloads the optimizer state."""
        return self._named("state", self.optimizer_state_on_host if on_host is None else tuple(on_host))

    @property
    def param_layout(self) -> ParamLayout:
        """Where this pipeline keeps the model's parameters (what a checkpoint records and restores by)."""
        return ParamLayout(
            tuple(self.schedule.stage_to_rank),
            tuple(self.layer_counts),
            self.pipe if self.vocab is not None else 0,
            self.model.layer_families,
        )

    def carried_leaves(self) -> PipelineParams:
        """Per leaf of the parameters, whether it is carried state (BatchNorm's statistics,
        :attr:`~jaxmem.models.StagedModel.carried`): at such a leaf :meth:`value_and_grad`'s gradient is
        the state the step wrote, which the trainer puts in place of the old one."""
        abstract = self.abstract_params()
        return PipelineParams(
            stages=jax.tree_util.tree_map_with_path(lambda at, _: self.model.is_carried(at), abstract.stages),
            shared=jax.tree.map(lambda _: False, abstract.shared),
            vocab=jax.tree.map(lambda _: False, abstract.vocab),
        )

    def from_model_params(self, params) -> PipelineParams:
        """The model's own parameter tree (e.g. ``nnx.to_pure_dict(nnx.state(module, nnx.Param))``) ->
        pipeline layout."""
        return PipelineParams(*self.param_layout.split(self.model, params))

    def to_model_params(self, params: PipelineParams):
        """Pipeline layout -> the model's parameter tree (e.g. to compare with ``jax.grad``)."""
        return self.param_layout.join(self.model, params.stages, params.shared, params.vocab)

    def place(self, params: PipelineParams) -> PipelineParams:
        """Put parameters on the mesh with their target shardings."""
        return jax.device_put(params, self.shardings())

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch, seq: int | None = None) -> int:
        """Microbatch size for a batch (a batch dict or spec, or a batch size with ``seq``); raises with
        values that would work otherwise."""
        spec = _spec_of(batch) if seq is None else batch_spec(batch, seq)
        size = batch_size(spec)
        for key, leaf in spec.items():
            if not leaf.shape or leaf.shape[0] != size:
                raise JaxmemError(
                    f"batch[{key!r}] has shape {leaf.shape}; every batch leaf must lead with the batch size {size}"
                )
        M, D = self.schedule.num_microbatches, self.replicas
        if size % (D * M):
            ok = [D * M * k for k in range(1, 5)]
            what = f"data-parallel ({self.data}) x fsdp ({self.fsdp})" if self.fsdp > 1 else f"data-parallel ({D})"
            raise JaxmemError(
                f"batch size {size} is not divisible by {what} x microbatches ({M}) = "
                f"{D * M}; use a batch size in {ok}, ..."
            )
        if "tokens" in spec:  # a language model's: its sequence length is checked against the model's
            self.model.check_batch(spec["tokens"].shape[-1])
        return size // (D * M)

    # ------------------------------------------------------------------ the program
    def stage_fn(self, c: StageClass, *, checkpointed: bool = True):
        """The stage function of a class, ``fn(stage_params, shared, x, batch)`` with ``shared`` as the
        pipeline holds it (without the vocabulary tables when they are split), wrapped in its policy's
        ``jax.checkpoint``, traced for the mesh's platform (fused attention's kernel is the
        platform's, :func:`~jaxmem.models.attention_platform`)."""
        fn = stage_forward(
            self.model,
            first=c.first,
            last=c.last,
            layers=c.layers,
            skip=c.skip,
            vocab=self.vocab is not None,
            kinds=c.kinds,
            families=c.families,
            policy=self.policy.variants[c.variant] if checkpointed else None,
        )
        return traced_for(fn, self.platform)

    def _stash_to_host(self, c: StageClass) -> bool:
        return self.policy.variants[c.variant].offload_stash

    def microbatch_spec(self, batch) -> dict:
        """One microbatch of a batch (dict or spec), abstract."""
        spec = _spec_of(batch)
        mb = self.check_batch(spec)
        micro = {k: jax.ShapeDtypeStruct((mb, *v.shape[1:]), v.dtype) for k, v in spec.items()}
        if self.model.rng:
            micro["rng"] = RNG_SPEC
        return micro

    def compute_dtype(self, batch) -> np.dtype:
        """The narrowest floating dtype the stages pass on (the compute dtype: bfloat16 under mixed
        precision)."""
        return min((jnp.dtype(a.dtype) for a in jax.tree.leaves(self.message_spec(batch))), key=lambda d: d.itemsize)

    def param_dtype(self) -> np.dtype:
        """The narrowest dtype of the parameters (what gradients and optimizer state are kept in)."""
        return min(
            (jnp.dtype(a.dtype) for a in jax.tree.leaves(self.model.abstract_params())), key=lambda d: d.itemsize
        )

    def message_spec(self, batch):
        """What one stage sends the next for a batch: the model's embedding output, abstract."""
        micro = self.microbatch_spec(batch)
        with _naming_batch_keys(self.model, micro):
            params = self._compute_model() if self.master_cut else self.model.abstract_params()
            return jax.eval_shape(self.model.embed, self.model.split(params)[1], micro)

    def _check_tags(self, abstract: PipelineParams, message, micro) -> None:
        """Every tag the model's stage functions emit must be declared (a policy would silently
        recompute an undeclared one)."""
        if self._tags_checked:
            return
        declared = set(self.model.tags.names)
        for c in dict.fromkeys(self.cell_classes.values()):
            stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract.stages[c.local])
            emitted = emitted_tags(self.stage_fn(c, checkpointed=False), stage, abstract.shared, message, micro)
            undeclared = sorted(emitted - declared)
            if undeclared:
                raise JaxmemError(
                    f"model {self.model.name} emits checkpoint_name tags it does not declare: {undeclared}; "
                    f"declared: {self.model.tags.describe()}. Add them to the model's tags (a policy cannot "
                    "decide for a tag it does not know, and would recompute it silently)"
                )
        self._tags_checked = True

    def residual_plans(self, batch, seq: int | None = None) -> dict[StageClass, ResidualPlan]:
        """Per class, its residuals for one microbatch (traced abstractly, nothing compiled).

        ``batch``: a batch dict or spec, or a batch size with ``seq``."""
        spec = _spec_of(batch) if seq is None else batch_spec(batch, seq)
        micro = self.microbatch_spec(spec)
        abstract = self.stage_abstract()
        message = self.message_spec(spec)
        bad = [a for a in jax.tree.leaves(message) if not jnp.issubdtype(a.dtype, jnp.floating)]
        if bad:
            raise JaxmemError(
                f"model {self.model.name}: what the embedding passes on must be floating arrays (they carry "
                f"gradients between stages); got {[str(a.dtype) for a in bad]}"
            )
        with _naming_batch_keys(self.model, micro):
            return self._residual_plans(abstract, message, micro)

    def _residual_plans(self, abstract, message, micro) -> dict[StageClass, ResidualPlan]:
        self._check_tags(abstract, message, micro)
        plans = {}
        for c in dict.fromkeys(self.cell_classes.values()):
            stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract.stages[c.local])
            plan = analyze_stage(
                self.stage_fn(c),
                stage,
                abstract.shared,
                message,
                micro,
                stash_to_host=self._stash_to_host(c),
                host_tiles=self.platform == "tpu",
            )
            _check_output(self.model, c, plan, message, self.vocab is not None)
            plans[c] = plan
        return plans

    def program(
        self, batch, seq: int | None = None, *, forward: bool = False
    ) -> tuple[TickProgram, dict[StageClass, ResidualPlan]]:
        """The tick program and per-class residual plans for a batch (dict or spec, or a batch size
        with ``seq``), cached per batch structure; ``forward``: of the schedule's forwards alone
        (:func:`~jaxmem.schedule.forward_only`), which stash nothing. On a ``context`` axis, of one
        device's part of each sequence (:meth:`local_spec`)."""
        spec = _spec_of(batch) if seq is None else batch_spec(batch, seq)
        key = (_key(spec), forward)
        if key not in self._programs:
            with self._traced_on_context():  # of each device's part of the sequences (local_spec)
                self._programs[key] = self._program(self.local_spec(spec), forward)
        return self._programs[key]

    @contextlib.contextmanager
    def _traced_on_context(self):
        """Trace the stages outside the step's ``shard_map`` as on its ``context`` axis (the gathered
        keys and values of their real shapes), and refuse a model that never calls the context-aware
        functions there: its attention would see this device's part of each sequence alone."""
        if self.context == 1:
            yield
            return
        with context_stand_in(self.context):
            yield
            if not context_calls():
                raise JaxmemError(
                    f"model {self.model.name} is not context-aware: with a context axis each device holds part of "
                    "every sequence, and its attention must see the keys and values of all of them. Call "
                    "jaxmem.models.fused_attention(q, k, v) in its layers, or gather with "
                    "jaxmem.models.context_kv(k, v) and mask with jaxmem.models.causal_mask(q_len, k_len), and take "
                    "positions from "
                    "batch_positions(batch, seq) -- or drop the context axis"
                )

    def _program(self, spec, forward: bool) -> tuple[TickProgram, dict[StageClass, ResidualPlan]]:
        plans = self.residual_plans(spec)
        transfers = None
        if self.splits_backward and not forward:
            micro, message = self.microbatch_spec(spec), self.message_spec(spec)
            with _naming_batch_keys(self.model, micro):
                transfers = {
                    c: stash_rows(self.backward_split(c, p, micro, message).transfer_elems(), self.tensor)
                    for c, p in plans.items()
                }
        tick = build_tick_program(
            forward_only(self.schedule) if forward else self.schedule,
            self.cell_classes,
            {c: {} if forward else stash_rows(p.stash_elems, self.tensor) for c, p in plans.items()},
            head_grads=self.vocab is not None and not forward,
            transfer_elems=transfers,
        )
        return tick, plans

    @property
    def splits_backward(self) -> bool:
        """Its I and W actions share the backward's work (:mod:`jaxmem.pipeline._iw`): I runs the
        cotangents through the stage once and hands W, through arenas of their own, the values its
        weight gradients read (cut over a ``tensor`` axis as the stash is). With ``split_backward``, on
        schedules with split backwards; otherwise I and W each run the whole pullback, XLA dropping
        what each discards."""
        return splits_backward(self.schedule, self.split_backward)

    def backward_split(self, c: StageClass, plan: ResidualPlan, micro, message) -> StageSplit:
        """Class ``c``'s backward split into I and W (:mod:`jaxmem.pipeline._iw`), traced abstractly
        (``plan``: its residual plan; ``micro``, ``message``: a microbatch and a message, abstract)."""
        abstract = self.stage_abstract()
        stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract.stages[c.local])
        input_grad = not (c.first and self.vocab is None)
        return abstract_split(
            plan, stage, abstract.shared, micro, message, input_grad=input_grad, hand_recomputed=self.hand_recomputed
        )

    def grad_fn(self, batch, seq: int | None = None):
        """``fn(params, batch, rng=None) -> (loss, grads)`` for batches like ``batch`` (a batch dict or
        spec, or a batch size with ``seq`` for tokens and targets only); not jitted (use it inside a
        jitted step). ``params``: the master weights or their compute copy (:meth:`compute_params`);
        the gradients come in the master weights' dtypes. ``rng``: the step's key, required when the
        model draws random numbers (:attr:`~jaxmem.models.StagedModel.rng`), e.g.
        ``jax.random.fold_in(key, step)``."""
        return self._built(batch, seq, forward=False)

    def loss_fn(self, batch, seq: int | None = None):
        """``fn(params, batch, rng=None) -> loss`` (the mean loss over the batch's counted tokens, as
        :meth:`grad_fn`'s) from the schedule's forwards alone (:func:`~jaxmem.schedule.forward_only`):
        no backward, nothing stashed, no gradient accumulators -- what an evaluation runs. Arguments as
        :meth:`grad_fn`'s; not jitted."""
        return self._built(batch, seq, forward=True)

    def _built(self, batch, seq: int | None, *, forward: bool):
        """:meth:`grad_fn`'s or :meth:`loss_fn`'s function, built once per batch structure."""
        spec = _spec_of(batch) if seq is None else batch_spec(batch, seq)
        key = (_key(spec), forward)
        if key not in self._grad_fns:
            self._grad_fns[key] = self._build_grad_fn(spec, forward=forward)
        return self._grad_fns[key]

    def value_and_grad(self, params: PipelineParams, batch: dict, rng=None):
        """Loss and gradients of the mean loss over the batch's counted tokens, jitted (one compile
        per batch structure); ``rng`` as in :meth:`grad_fn`. At a leaf of carried state
        (:meth:`carried_leaves`: BatchNorm's statistics) the "gradient" is the state the step wrote,
        the mean over microbatches and replicas of what each forward wrote."""
        key = _key(_spec_of(batch))
        _check_tokens(self.model, batch)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self.grad_fn(batch), compiler_options=step_compiler_options(self.platform))
        return self._jitted[key](params, batch, rng)

    def _build_grad_fn(self, spec: dict, forward: bool = False):
        """The pipelined loss and gradients (``forward``: the loss alone, from the forwards alone): the
        tick loop's body (:class:`~jaxmem.pipeline._body.StepBody`) inside ``shard_map``."""
        if self.schedule.forward_only and not forward:
            raise JaxmemError(
                f"schedule {self.schedule.name!r} runs forwards only, so it gives a loss but no gradients: "
                "use Pipeline.loss_fn for the loss, or a schedule with backwards (e.g. generate('1f1b', P, M)) "
                "to train"
            )
        body = StepBody(self, spec, forward, _counted(spec))
        placement, abstract = self.placement, body.abstract
        context = self.context
        # Each sequence reordered so that a device's part of it is its two chunks (context_order).
        order = None if context == 1 else jnp.asarray(context_order(next(iter(spec.values())).shape[1], context))

        def specs(tree, which):
            return jax.tree.map(lambda p: p.spec(which, manual=True), tree, is_leaf=is_placement)

        # Manual over data, fsdp, pipe and a context axis; a tensor axis is left to XLA's partitioner, which runs
        # each stage's math split the way the parameters' tensor cuts say. Without one (tensor=1) the
        # mesh has only the three manual axes and the partitioner has nothing to do inside the body.
        sharded = jax.shard_map(
            body,
            mesh=self.mesh,
            axis_names=frozenset(self.manual_axes),
            in_specs=(
                specs(placement.stages, "params"),
                specs(placement.shared, "params"),
                specs(placement.vocab, "params"),
                P(("data", "fsdp")) if context == 1 else P(("data", "fsdp"), CONTEXT),
                P("pipe"),
                P(),
                P(),
            ),
            out_specs=P()
            if forward
            else (
                P(),
                specs(placement.stages, "state"),
                specs(placement.shared, "state"),
                specs(placement.vocab, "state"),
            ),
        )

        def grad_fn(params: PipelineParams, batch: dict, rng=None):
            rng = _raw_key(rng, self.model)
            given = _key(_spec_of(batch))
            if given != _key(spec):
                want = {k: shape for k, shape, _ in _key(spec)}
                raise JaxmemError(
                    f"this gradient function was built for batches {want}; got {dict(g[:2] for g in given)}: "
                    "build one per batch structure with grad_fn(batch)"
                )
            if self.master_cut:  # master weights given: the stages read them cast (a no-op on a compute copy)
                params = jax.tree.map(lambda a, c: a.astype(c.dtype), params, abstract)
            if order is not None:
                batch = jax.tree.map(lambda a: jnp.take(a, order, axis=1), batch)
            out = sharded(params.stages, params.shared, params.vocab, batch, body.table, body.vocab_ticks, rng)
            if forward:
                return out
            loss, grads, shared_grads, vocab_grads = out
            return loss, PipelineParams(stages=grads, shared=shared_grads, vocab=vocab_grads)

        return grad_fn


def _narrower(tree, than) -> bool:
    """Some leaf of ``tree`` has a narrower dtype than its twin in ``than``."""
    pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(than), strict=True)
    return any(jnp.dtype(a.dtype).itemsize < jnp.dtype(b.dtype).itemsize for a, b in pairs)


@contextlib.contextmanager
def _naming_batch_keys(model, micro: dict):
    """A ``KeyError`` for a batch key the model reads and the batch lacks, raised from inside a trace
    of the model's functions, as an error that names the key and the keys the batch has."""
    try:
        yield
    except KeyError as e:
        key = e.args[0] if e.args else None
        if not isinstance(key, str) or key in micro:
            raise
        raise JaxmemError(
            f"model {model.name} reads batch[{key!r}], which the batch does not have; it has "
            f"{sorted(micro)}. Put {key!r} in every batch (an array leading with the batch size), or do "
            "not read it in embed / call_layer / head_loss"
        ) from e


def _check_tokens(model, batch) -> None:
    """Token ids at or past the model's vocabulary would look up nothing (a NaN loss, no error): refuse
    them where the batch is concrete (traced batches are the caller's to check)."""
    tokens = batch.get("tokens") if isinstance(batch, dict) else None
    vocab = getattr(model, "vocab_size", None)
    if vocab is None or tokens is None or isinstance(tokens, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return
    if not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
        return
    top, low = int(jnp.max(tokens)), int(jnp.min(tokens))
    if top >= vocab or low < 0:
        bad = top if top >= vocab else low
        raise JaxmemError(
            f"batch['tokens'] holds token id {bad}, outside model {model.name}'s vocabulary [0, {vocab}): "
            "the lookup would give NaN, not an error. Tokenize with the model's tokenizer, or build the "
            "model with a larger vocab_size"
        )


def _check_output(model, c: StageClass, plan: ResidualPlan, message, vocab: bool = False) -> None:
    """A stage's output must be what the next stage takes (or, last, a ``(loss_sum, weight)`` pair; with
    the vocabulary split, the head's input, shaped like a message)."""
    if vocab:
        leaves = jax.tree.leaves(message)
        if len(leaves) != 1 or leaves[0].ndim != 3:
            raise JaxmemError(
                f"model {model.name}: splitting the vocabulary over the ranks needs the stages to pass one "
                f"[batch, seq, d] array; they pass {[tuple(a.shape) for a in leaves]}. Build the pipeline with "
                "vocab_parallel=False"
            )
    if c.last and not vocab:
        avals = plan.out_avals
        if len(avals) != 2 or any(a.shape != () for a in avals):
            raise JaxmemError(
                f"model {model.name}: head_loss must return (loss_sum, weight), two scalars; got "
                f"{[tuple(a.shape) for a in avals]}"
            )
        return
    want = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in jax.tree.leaves(message)]
    got = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in plan.out_avals]
    if want != got:
        raise JaxmemError(
            f"model {model.name}: a layer must return what it takes (the embedding's output structure); "
            f"the embedding gives {want}, stage {c.label} returns {got}"
        )
