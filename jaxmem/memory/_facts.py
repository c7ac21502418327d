"""What the ledger and the planners need to know about a model, from compile-time facts only.

For a stage (its role, its number of layers, a bound memory policy) and a sequence length:

- the residuals one microbatch stashes from forward to backward, per buffer ``(dtype, memory
  space)`` -- from the jaxpr of the stage's ``jax.vjp`` under the policy's ``jax.checkpoint``
  (:func:`jaxmem.pipeline.analyze_stage`, the executor's own analysis);
- the FLOPs of its forward and of its backward (which includes what the policy recomputes), from
  ``cost_analysis()`` of the lowered forward and pullback (lowered, never compiled or run);
- the stage's full activation volume (its save-all stash);
- the backward's working set: the temporaries ``memory_analysis()`` reports for the stage's pullback
  compiled alone, on the backend at hand (the one compile here, cached per stage role, policy and
  sequence length, and shared by built-in models that differ only in depth). With a ``tensor`` axis
  the same program is compiled on a mesh of that many local devices with the parameters cut as the
  model's annotations say, when the process has them (:meth:`ModelFacts.tensor_working`).

Tracing is abstract and done at one sequence per microbatch (the working set is compiled at
``WORKSET_MICROBATCH``): residuals, FLOPs and the working set grow linearly with the microbatch
(every stashed value carries the batch axis). A stage of more than two layers is extrapolated from
one and two layers (layers are identical, so each adds the same), which keeps a planner's search
over a 48-layer model as cheap as over a 2-layer one; a test checks the extrapolation against direct
traces. Layers of several parameter families (:attr:`~jaxmem.models.StagedModel.layer_families`:
dense and mixture-of-experts layers) are composed the same way, each further layer adding what a
second layer of its family adds to a first; a stage is then described by its layers' families.

jaxmem's GPT also has closed-form figures (``jaxmem/memory/_model.py``): its residuals are derived from
which values each op's backward reads, its FLOPs are its matmuls. That fast path is used when a
model carries it (``StagedModel.analytic``); tests check it against the traced figures.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import weakref

import numpy as np

from jaxmem._util import compiled_temp_bytes, step_compiler_options, tree_bytes
from jaxmem.memory._figures import cached_figure

__all__ = [
    "WORKSET_MICROBATCH",
    "ModelFacts",
    "StageFacts",
    "StaticBytes",
    "TensorFacts",
    "model_facts",
    "working_sets",
]

# How the facts get a backward's working set: "compiled" (the stage's pullback compiled alone, as the
# module says), "derived" (from a working set compiled already for the same stage role and policy,
# at another sequence length or depth, scaled by the stage's activation volume: no compile once one
# is known), or "none" (0: for step times, which do not read it).
_WORKING_SETS: contextvars.ContextVar = contextvars.ContextVar("jaxmem_working_sets", default="compiled")


@contextlib.contextmanager
def working_sets(mode: str):
    """Within the block, the facts' working sets are ``"compiled"`` (the default), ``"derived"`` or
    ``"none"`` (see ``_WORKING_SETS``). Derived facts are never kept (a figure compiled later
    stands for them at once, and none stands for a compiled one outside the block); a working set
    compiled because none was known yet is cached as always. The online profiler scores policies with
    derived working sets and confirms its pick with the program's own compile
    (:mod:`jaxmem.profiler`)."""
    if mode not in ("compiled", "derived", "none"):
        raise ValueError(f"working_sets mode must be 'compiled', 'derived' or 'none', got {mode!r}")
    token = _WORKING_SETS.set(mode)
    try:
        yield
    finally:
        _WORKING_SETS.reset(token)


# Sequences per microbatch at which a stage's backward is compiled to read its working set (then
# scaled per sequence): XLA lays out a microbatch of one differently (size-1 axes dropped), which
# reads about 6% low against larger microbatches; at two it is within 1-2% of four and eight.
WORKSET_MICROBATCH = 2

# A stage that recomputes layers apart (recompute_layers) has its working set compiled as it is composed
# up to this many layers (about 0.3 s a layer at llama-8b's width on this CPU), beyond by extrapolation.
MIXED_DIRECT_LAYERS = 8


def _working_options(platform: str) -> dict | None:
    """Compiler options for the working-set compiles on ``platform``: on XLA:CPU, its backend
    optimisation level 0, which lays the temporaries out as the default level does (all 36 stage
    backwards of a Llama and of a GPT) and compiles them in a little over half the time
    (``benchmarks/compile_flags.py``); on a GPU the options the step itself is compiled with
    (:func:`jaxmem._util.step_compiler_options`); nothing on a TPU."""
    return {"xla_backend_optimization_level": 0} if platform == "cpu" else step_compiler_options(platform)


@dataclasses.dataclass(frozen=True)
class StaticBytes:
    """Per-device bytes of the static state on a mesh, from the placement of every leaf
    (:mod:`jaxmem.pipeline._placement`).

    Attributes:
        stage_params: per local stage position, its parameters (and the step's gradient accumulators).
        shared_params: the embedding, head and other shared parameters.
        stage_state / shared_state: one parameter-sized optimizer array (an Adam moment), as placed:
            cut further over the replicas with ZeRO.
        gathered: what FSDP adds while a stage runs: its weights gathered whole beyond the local
            shard (and the shared ones'), once; the whole gradient before its reduce-scatter is as large.
        stage_copy / shared_copy: the parameters as the stages read them, placed as the parameters:
            cast to the compute dtype where the model casts them (:mod:`jaxmem.pipeline._compute_copy`).
            With the master weights cut, the step holds this copy beside the cut master weights.
        gathered_copy: ``gathered`` of the copy (what an action gathers when the master weights are cut).
        stage_gathered / stage_gathered_copy: the part of ``gathered`` / ``gathered_copy`` that is one
            stage's own weights (what a stage kept gathered for the step holds beyond its shard).
    """

    stage_params: tuple[float, ...]
    shared_params: float
    stage_state: tuple[float, ...]
    shared_state: float
    gathered: float
    stage_copy: tuple[float, ...] = ()
    shared_copy: float = 0.0
    gathered_copy: float = 0.0
    stage_gathered: float = 0.0
    stage_gathered_copy: float = 0.0


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """What a ``tensor`` axis cuts of one layer, for one sequence.

    Attributes:
        full: fraction of its activation volume (save-all residuals) that is cut.
        stash: fraction of its stash under the policy that is cut.
        flops: fraction of its matmul FLOPs that is cut (each tensor device does 1/tensor of them).
        reduced_bytes: bytes its forward sums over the tensor devices (all-reduces of the matmuls
            that contract over the cut; the backward sums as many, of the cut matmuls' inputs).
        transfers: fraction of what a split backward's I hands its W under the policy that is cut
            (each device keeps its share; W gathers the rest, :mod:`jaxmem.pipeline._iw`).
    """

    full: float = 0.0
    stash: float = 0.0
    flops: float = 0.0
    reduced_bytes: float = 0.0
    transfers: float = 0.0


@dataclasses.dataclass(frozen=True)
class StageFacts:
    """One stage-microbatch under one policy.

    Attributes:
        stash_elems: per buffer ``(dtype, space)``, elements stashed from F to B.
        full_bytes: bytes the stage would stash under save-all (its activation volume).
        forward_flops: FLOPs of the forward.
        backward_flops: FLOPs of the backward, recompute included.
        recompute_flops: FLOPs the backward spends recomputing what the policy did not keep.
        working_bytes: the backward's working set: the temporaries of the stage's pullback compiled
            alone (from a stash slot and the output's cotangent to the gradients), on the backend at
            hand -- what XLA keeps live beside the stash, recompute and any op the model
            rematerialises on its own (e.g. :func:`~jaxmem.models.fused_attention`) included.
    """

    stash_elems: dict
    full_bytes: float
    forward_flops: float
    backward_flops: float
    recompute_flops: float
    working_bytes: float = 0.0

    def stash_bytes(self, space: str | None = None) -> float:
        return sum(n * np.dtype(k[0]).itemsize for k, n in self.stash_elems.items() if space in (None, k[1]))

    def scaled(self, factor: float) -> StageFacts:
        return StageFacts(
            {k: int(round(v * factor)) for k, v in self.stash_elems.items()},
            self.full_bytes * factor,
            self.forward_flops * factor,
            self.backward_flops * factor,
            self.recompute_flops * factor,
            self.working_bytes * factor,
        )

    def combine(self, other: StageFacts, a: float, b: float) -> StageFacts:
        """``a * self + b * other`` (for extrapolating over layers)."""
        keys = set(self.stash_elems) | set(other.stash_elems)
        elems = {k: int(round(a * self.stash_elems.get(k, 0) + b * other.stash_elems.get(k, 0))) for k in keys}
        return StageFacts(
            {k: v for k, v in elems.items() if v},
            a * self.full_bytes + b * other.full_bytes,
            a * self.forward_flops + b * other.forward_flops,
            a * self.backward_flops + b * other.backward_flops,
            a * self.recompute_flops + b * other.recompute_flops,
            a * self.working_bytes + b * other.working_bytes,
        )


def _is_leaf_placement(x) -> bool:
    from jaxmem.pipeline import LeafPlacement

    return isinstance(x, LeafPlacement)


def _on_context(method):
    """A method of :class:`ModelFacts` that traces the model: on a context axis, under its stand-in
    (:func:`jaxmem.models._context.context_stand_in`), so that attention gathers the keys and values
    of every device's part of each sequence."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.context == 1:
            return method(self, *args, **kwargs)
        from jaxmem.models import context_stand_in

        with context_stand_in(self.context):
            return method(self, *args, **kwargs)

    return wrapped


class ModelFacts:
    """Facts about one :class:`~jaxmem.models.StagedModel`, cached; see the module docstring.

    Attributes:
        source: ``"analytic"`` (closed form) or ``"traced"``.
        target: the :class:`~jaxmem.targets.Target` whose compiler the working sets and the layouts
            come from (None: the devices at hand).
        platform: that target's platform (``cpu``, ``gpu``, ``tpu``).
    """

    def __init__(self, model, *, analytic: bool = True, target=None, context: int = 1):
        import jax

        from jaxmem._util import platform_of
        from jaxmem.models import GPTConfig
        from jaxmem.targets import parse_target

        self.model = model
        self.target = parse_target(target)
        if self.target is not None and not self.target.compile_only:
            self.target = None  # the cpu target is the devices at hand
        self.platform = self.target.platform if self.target is not None else platform_of(jax.devices())
        # The GPT's closed form counts its stash in whole elements; a TPU lays a host stash out in whole
        # tiles (jaxmem.pipeline.stash_granule), which only the traced plan pads as the executor does.
        # On a context axis (``context`` > 1) the facts are of one device's part of each sequence, with
        # the keys and values of all of it gathered for attention: traced under a stand-in of the axis
        # (jaxmem.models._context), at the local length the callers give; the closed form is of whole
        # sequences.
        self.context = context
        closed_form = analytic and self.platform != "tpu" and context == 1
        self.gpt = model.analytic if closed_form and isinstance(model.analytic, GPTConfig) else None
        self.source = "analytic" if self.gpt is not None else "traced"
        abstract = model.abstract_params()
        layers, shared = model.split(abstract)
        # Layers of several parameter families (dense and mixture-of-experts): one of each stands for
        # its family, a stage is described by its layers' families (a model of one: all 0).
        self.families = model.layer_families
        self._family_layer = [layers[i] for i in model.family_layers()]
        self._layer = self._family_layer[0]
        self._shared = shared
        self.layer_bytes = tree_bytes(layers[0])
        # Each layer's parameter bytes in units of layer 0's: what the time model scales its one-layer
        # figures by (transfers and gathers of a stage's weights).
        sizes = [tree_bytes(layer) for layer in self._family_layer]
        self._family_units = tuple(size / sizes[0] if sizes[0] else 1.0 for size in sizes)
        self._units = tuple(self._family_units[f] for f in (self.families or (0,) * model.n_layers))
        self.shared_bytes = tree_bytes(shared)
        self.param_itemsize = max(np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))
        self._cache: dict = {}
        # A built-in model's layers and shared parameters do not depend on its depth: models that
        # differ only in depth share their compiled working sets and traced I/W splits (a depth
        # search compiles and traces once).
        from jaxmem.models import LlamaConfig

        config = model.config
        builtin = isinstance(config, (GPTConfig, LlamaConfig))
        depthless = (
            (type(config), dataclasses.replace(config, n_layers=1), str(self.target), context) if builtin else None
        )
        self._stage_cache = self._cache if depthless is None else _DEPTHLESS.setdefault(depthless, {})

    # ------------------------------------------------------------------ the target
    def _devices(self, count: int = 1) -> list:
        """At least ``count`` devices of the facts' target (the local devices without one; fewer when
        the process has fewer)."""
        import jax

        if self.target is None:
            return jax.local_devices()
        return self.target.devices(count)

    def _compiled_for(self) -> str:
        """What a working set is compiled for, as the figure cache keys it (:mod:`._figures`): the
        target, or the platform and kind of the devices at hand (how many the program's text says)."""
        if self.target is not None:
            return f"target={self.target}"
        device = self._devices()[0]
        return f"{device.platform}:{device.device_kind}"

    def nbytes(self, shape, dtype) -> int:
        """Bytes of one array as the target lays it out: a TPU pads the two minor dimensions to its
        tiles (:meth:`~jaxmem.targets.Target.tiled_bytes`); elsewhere its elements' bytes."""
        if self.platform == "tpu" and self.target is not None:
            return self.target.tiled_bytes([(tuple(shape), np.dtype(dtype).name)])[0]
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

    def tree_nbytes(self, tree) -> int:
        """:meth:`nbytes` summed over a pytree of arrays or shaped values."""
        import jax

        leaves = jax.tree.leaves(tree)
        if self.platform == "tpu" and self.target is not None:
            return sum(self.target.tiled_bytes([(tuple(a.shape), np.dtype(a.dtype).name) for a in leaves]))
        return tree_bytes(tree)

    # ------------------------------------------------------------------ model-level
    def batch(self, microbatch: int, seq: int) -> dict:
        from jaxmem.models import RNG_SPEC
        from jaxmem.pipeline import batch_spec

        own = self.model.batch_spec
        spec = batch_spec(microbatch, seq) if own is None else dict(own(microbatch, seq))
        return {**spec, "rng": RNG_SPEC} if self.model.rng else spec

    @_on_context
    def message(self, microbatch: int, seq: int):
        """What one stage sends the next (abstract)."""
        import jax

        key = ("message", microbatch, seq)
        if key not in self._cache:
            self._cache[key] = jax.eval_shape(self.model.embed, self._shared, self.batch(microbatch, seq))
        return self._cache[key]

    def message_bytes(self, microbatch: int, seq: int) -> int:
        return self.tree_nbytes(self.message(microbatch, seq))

    def stage_families(self, layer_counts, drop_layers=frozenset()) -> list[tuple[int, ...] | None]:
        """Per stage, the parameter family of each layer it runs (``drop_layers``, global indices,
        skipped); None for every stage of a model of one family."""
        starts = np.cumsum((0, *layer_counts))
        if self.families is None:
            return [None] * len(layer_counts)
        return [
            tuple(self.families[i] for i in range(a, b) if i not in drop_layers)
            for a, b in zip(starts[:-1], starts[1:])
        ]

    def stage_units(self, layer_counts) -> list[float]:
        """Per stage, its layers' parameter bytes in units of layer 0's (its layer count when the
        layers are alike)."""
        starts = np.cumsum((0, *layer_counts))
        return [float(sum(self._units[a:b])) for a, b in zip(starts[:-1], starts[1:])]

    def units(self, layers: int, families: tuple[int, ...] | None = None) -> float:
        """``layers`` layers' parameter bytes in units of layer 0's, their ``families`` given for a
        model of several."""
        return float(layers) if families is None else float(sum(self._family_units[f] for f in families))

    def stage_rows(self, layer_counts):
        """The rows a pipeline stacks for its stages (``static_bytes``'s ``layers``): the most layers any
        stage holds, or per parameter family the most of that family any stage holds."""
        if self.families is None:
            return max(max(layer_counts), 1)
        per_stage = self.stage_families(layer_counts)
        return tuple(max(f_s.count(f) for f_s in per_stage) for f in range(len(self._family_layer)))

    def static_bytes(
        self,
        ranks: int,
        layers: int,
        virtual: int = 1,
        *,
        data: int = 1,
        fsdp: int = 1,
        tensor: int = 1,
        zero: bool = True,
        vocab: bool = False,
    ) -> StaticBytes:
        """Per-device static bytes of the pipeline layout: ``ranks`` pipe ranks holding ``virtual``
        stages of (at most) ``layers`` layers each, on a ``data x fsdp x ranks x tensor`` mesh
        (``vocab``: the vocabulary tables split over the ranks; they count with the shared
        parameters; ``tensor`` cuts the dimensions the model's annotations name). For layers of
        several parameter families, ``layers`` is a tuple: the rows stacked of each family
        (:meth:`stage_rows`); an int is then that many layers of layer 0's family (a one-layer unit)."""
        key = ("static", ranks, layers, virtual, data, fsdp, tensor, zero, vocab)
        if key not in self._cache:
            import jax

            from jaxmem.pipeline import PipelineParams, layout_axes, placement_of, split_vocab

            copy_layers, copy_shared = self._compute_copy(vocab, ranks)
            stage = _stacked(self._family_layer, layers, ranks)
            copy_stage = _stacked(copy_layers, layers, ranks)
            shared, tables = self._shared, {}
            if vocab:
                shared, tables = jax.eval_shape(lambda s: split_vocab(s, self.model.vocab, ranks), self._shared)
            abstract = PipelineParams(stages=(stage,), shared=shared, vocab=tables)
            sizes = {"data": data, "fsdp": fsdp, "pipe": ranks, "context": self.context, "tensor": tensor}
            axes = layout_axes(self.model, 1, vocab) if tensor > 1 else None
            if axes is not None and self.families is not None and isinstance(layers, int):
                axes = PipelineParams(stages=(axes.stages[0][0],), shared=axes.shared, vocab=axes.vocab)
            placement = placement_of(abstract, sizes, zero=zero, axes=axes)

            def per_device(tree, places, which, sizes=sizes):
                shards = [
                    (p.local_shape(which, sizes), np.dtype(a.dtype).name)
                    for a, p in zip(jax.tree.leaves(tree), jax.tree.leaves(places, is_leaf=_is_leaf_placement))
                ]
                if self.platform == "tpu" and self.target is not None:  # each shard padded to the TPU's tiles
                    return float(sum(self.target.tiled_bytes(shards)))
                return float(sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(d).itemsize for shape, d in shards))

            # What a running stage holds once gathered over fsdp (still cut over tensor), beyond its shard.
            unsharded = {**sizes, "fsdp": 1}

            def beyond(tree, places):
                return per_device(tree, places, "params", unsharded) - per_device(tree, places, "params")

            stage_gathered = beyond(stage, placement.stages[0])
            stage_gathered_copy = beyond(copy_stage, placement.stages[0])
            self._cache[key] = StaticBytes(
                stage_params=(per_device(stage, placement.stages[0], "params"),) * virtual,
                shared_params=per_device(shared, placement.shared, "params")
                + per_device(tables, placement.vocab, "params"),
                stage_state=(per_device(stage, placement.stages[0], "state"),) * virtual,
                shared_state=per_device(shared, placement.shared, "state")
                + per_device(tables, placement.vocab, "state"),
                gathered=stage_gathered + beyond(shared, placement.shared),
                stage_copy=(per_device(copy_stage, placement.stages[0], "params"),) * virtual,
                shared_copy=per_device(copy_shared.shared, placement.shared, "params")
                + per_device(copy_shared.vocab, placement.vocab, "params"),
                gathered_copy=stage_gathered_copy + beyond(copy_shared.shared, placement.shared),
                stage_gathered=stage_gathered,
                stage_gathered_copy=stage_gathered_copy,
            )
        return self._cache[key]

    def _compute_copy(self, vocab: bool, ranks: int):
        """One layer of each family and the shared parameters (a PipelineParams without stages, the
        tables split over ``ranks`` when ``vocab``) as the stages read them: cast where the model
        casts them."""
        import jax

        from jaxmem.pipeline import PipelineParams, compute_model_abstract, narrow_vocab, split_vocab

        seq = min(16, self.model.max_seq_len or 16)
        layers, shared = self.model.split(compute_model_abstract(self.model, self.message(1, seq), self.batch(1, seq)))
        tables = {}
        if vocab:
            shared, tables = jax.eval_shape(lambda s: split_vocab(s, self.model.vocab, ranks), shared)
        out = narrow_vocab(PipelineParams(stages=(), shared=shared, vocab=tables), self.model.vocab if vocab else None)
        return [layers[i] for i in self.model.family_layers()], out

    def whole(self, microbatch: int, seq: int) -> StageFacts:
        """The whole model as one stage under save-all (nothing recomputed): a plain step's facts."""
        from jaxmem.policy import PRESETS

        policy = PRESETS["save-all"].bind(self.model.tags)
        return self.stage(
            first=True,
            last=True,
            layers=self.model.n_layers,
            policy=policy,
            microbatch=microbatch,
            seq=seq,
            families=self.families,
        )

    # ------------------------------------------------------------------ stages
    def stage(
        self,
        *,
        first: bool,
        last: bool,
        layers: int,
        policy,
        microbatch: int,
        seq: int,
        vocab: bool = False,
        families: tuple[int, ...] | None = None,
    ) -> StageFacts:
        """Facts of one stage-microbatch (``policy``: a bound stage policy; ``vocab``: the vocabulary is
        split over the ranks, so the first stage starts from its looked-up rows and the last ends before
        the head's projection, see :meth:`vocab_flops`). ``families``: the parameter family of each
        of its ``layers`` (:meth:`stage_families`), for a model whose layers differ in them."""
        # A planner asks for the same stage hundreds of thousands of times (llama-8b: 686,000 calls).
        key = (
            "whole stage",
            first,
            last,
            layers,
            policy,
            microbatch,
            seq,
            vocab,
            families if families is None else tuple(families),
            _WORKING_SETS.get(),
        )
        if _WORKING_SETS.get() == "derived":  # not kept: a compiled working set may come to stand for it
            return self._stage(first, last, layers, policy, microbatch, seq, vocab, families)
        if key not in self._cache:
            self._cache[key] = self._stage(first, last, layers, policy, microbatch, seq, vocab, families)
        return self._cache[key]

    def _stage(self, first, last, layers, policy, microbatch, seq, vocab, families) -> StageFacts:
        parts = self._parts(first, last, layers, policy, vocab, families)
        rest, *ones = [self._per_sequence(f, la, fams, p, seq, v) for f, la, fams, p, v in parts]
        if not ones:
            return rest.scaled(microbatch)
        # Their stashes and FLOPs add up. The working set is the composed stage's own, compiled: how
        # XLA schedules the repeats beside the rest's backward is not a sum of the parts (taking the
        # larger part's was 6-24% under the compiled step on users' models, k = 1).
        facts = rest
        for one in ones:
            facts = facts.combine(one, 1, 1)
        policy = _stage_only(policy)
        working = self._mixed_working(
            first, last, self._fams(layers, families), policy, seq, bool(vocab) and (first or last)
        )
        if working is None:
            largest = max(one.working_bytes for one in ones)
            working = max(rest.working_bytes, largest) + sum(one.working_bytes for one in ones) - largest
        return dataclasses.replace(facts, working_bytes=working).scaled(microbatch)

    def _mixed_working(self, first, last, fams, policy, seq, vocab) -> float | None:
        """Per sequence, the working set of a stage whose first ``k = recompute_layers`` layers are
        recomputed whole and the other ``r`` run under the policy: the composed stage compiled as it
        is up to :data:`MIXED_DIRECT_LAYERS` layers; a deeper one at that many (``k`` and ``r`` cut
        alike), each further layer adding the mean of what one added over the compiled span (the
        temporaries of these pullbacks do not grow evenly with depth: llama-8b at 4096, one layer
        recomputed and 1, 2, 3, 5 others: 11.4, 12.9, 18.2, 23.3 GiB). None where a compile cannot be
        had (a tensor axis without its devices)."""
        k = min(policy.recompute_layers, len(fams))
        r = len(fams) - k

        def at(recomputed: int, others: int):
            sub = fams[:recomputed] + fams[k : k + others]
            bound = dataclasses.replace(policy, recompute_layers=recomputed)
            return self._working(first, last, sub, bound, seq, vocab)

        cap = MIXED_DIRECT_LAYERS
        if k + r <= cap:
            return at(k, r)
        k0 = min(k, cap // 2)
        r0 = min(r, cap - k0)
        k0 = min(k, cap - r0)
        base = at(k0, r0)
        if base is None:
            return None
        working = base
        if k > k0:  # k0 >= cap / 2 here
            fewer = at(1, r0)
            working += (k - k0) * max(base - fewer, 0.0) / (k0 - 1) if fewer is not None else 0.0
        if r > r0:  # r0 >= cap / 2 here
            fewer = at(k0, 1)
            working += (r - r0) * max(base - fewer, 0.0) / (r0 - 1) if fewer is not None else 0.0
        return working

    def _parts(self, first, last, layers, policy, vocab, families) -> list[tuple]:
        """A stage as the parts it is composed of, ``(first, last, families, policy, vocab)`` each:
        the stage under its policy and, with ``recompute_layers = k``, its first k layers recomputed
        whole (jaxmem.pipeline.stage_forward) -- each a one-layer middle stage under recompute-all (it
        keeps its input, repeats its forward) -- and the rest a stage of its own under the policy
        (the first stage's embedding a layerless first stage of its own, as the executor runs it)."""
        policy = _stage_only(policy)
        vocab = bool(vocab) and (first or last)
        fams = self._fams(layers, families)
        k = min(policy.recompute_layers, layers)
        if not k:
            return [(first, last, fams, policy, vocab)]
        own = dataclasses.replace(policy, recompute_layers=0)
        ones = [(False, False, (f,), policy.whole_layer(), False) for f in fams[:k]]
        if not first:
            return [(first, last, fams[k:], own, vocab)] + ones
        # The first stage's embedding runs under the policy apart, before the recomputed layers: the
        # rest then starts from a message it keeps, as a middle (or the last) stage does.
        rest = (False, last, fams[k:], own, vocab and last)
        return [rest, (True, False, (), own, vocab)] + ones

    def transfer_elems(
        self,
        *,
        first: bool,
        last: bool,
        layers: int,
        policy,
        microbatch: int,
        seq: int,
        vocab: bool = False,
        families: tuple[int, ...] | None = None,
        hand_recomputed: bool = False,
    ) -> dict[tuple[str, str], int]:
        """Per device arena, the elements one stage-microbatch's I hands its W when the schedule
        splits its backward (:mod:`jaxmem.pipeline._iw`), from the same split the executor traces;
        composed over layers as :meth:`stage` is (arguments as its; ``hand_recomputed`` as the
        pipeline's)."""
        parts = self._parts(first, last, layers, policy, vocab, families)
        hand = bool(hand_recomputed)
        mixed = _mixed([(self._transfers(f, la, fams, p, seq, v, hand), 1) for f, la, fams, p, v in parts])
        return {key: int(round(n * microbatch)) for key, n in mixed.items()}

    @_on_context
    def _transfers(self, first, last, fams, policy, seq, vocab=False, hand=False) -> dict:
        key = ("transfers", first, last, fams, policy, seq, vocab, hand)
        cache = self._stage_cache
        if key not in cache:
            if len(fams) <= 2:
                from jaxmem.pipeline import abstract_split

                plan, stage, x = self._traced_plan(first, last, fams, policy, seq, vocab)
                input_grad = not (first and not vocab)  # the first stage's input gradient goes nowhere
                shared, batch = self._stage_shared(vocab), self.batch(1, seq)
                split = abstract_split(plan, stage, shared, batch, x, input_grad=input_grad, hand_recomputed=hand)
                cache[key] = split.transfer_elems()
            else:  # each further layer adds what a second layer of its family adds to a first
                parts = [(self._transfers(first, last, fams[:1], policy, seq, vocab, hand), 1)]
                for f in fams[1:]:
                    parts.append((self._transfers(first, last, (f, f), policy, seq, vocab, hand), 1))
                    parts.append((self._transfers(first, last, (f,), policy, seq, vocab, hand), -1))
                cache[key] = _mixed(parts)
        return cache[key]

    def _fams(self, layers: int, families) -> tuple[int, ...]:
        """A stage's layers as the facts describe them: the family of each (all 0 when alike)."""
        if self.families is None:
            return (0,) * layers
        if families is None or len(families) != layers:
            from jaxmem._errors import JaxmemError

            raise JaxmemError(
                f"model {self.model.name}: its layers hold parameters of {len(self._family_layer)} families; "
                f"a stage's facts need the family of each of its {layers} layers (families=), got {families!r}"
            )
        return tuple(families)

    def _per_sequence(self, first, last, fams, policy, seq, vocab=False) -> StageFacts:
        key = ("stage", first, last, fams, policy, seq, vocab, _WORKING_SETS.get())
        if key in self._cache:
            return self._cache[key]
        if self.gpt is not None:
            facts = self._analytic(first, last, len(fams), policy, seq, vocab)
            facts = dataclasses.replace(facts, working_bytes=self._working(first, last, fams, policy, seq, vocab))
        elif len(fams) <= 2:
            facts = self._traced(first, last, fams, policy, seq, vocab)
        else:
            # Each further layer adds what a second layer of its family adds to a first (identical
            # layers: what the second added to the first).
            facts = self._per_sequence(first, last, fams[:1], policy, seq, vocab)
            for f in fams[1:]:
                one = self._per_sequence(first, last, (f,), policy, seq, vocab)
                two = self._per_sequence(first, last, (f, f), policy, seq, vocab)
                facts = facts.combine(two, 1, 1).combine(one, 1, -1)
            facts = dataclasses.replace(facts, working_bytes=self._working(first, last, fams, policy, seq, vocab))
        if _WORKING_SETS.get() != "derived":  # (as in stage(): derived facts are not kept)
            self._cache[key] = facts
        return facts

    def _stage_params(self, fams: tuple[int, ...], lead=()):
        """A stage's parameters, abstract, as a pipeline stacks them for a stage of layers of
        ``fams`` (at least one row of each family; ``lead``: dimensions before the layer axis)."""
        import jax

        def stacked(layer, rows):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct((*lead, max(rows, 1), *a.shape), a.dtype), layer)

        if self.families is None:
            return stacked(self._layer, len(fams))
        return tuple(stacked(layer, fams.count(f)) for f, layer in enumerate(self._family_layer))

    def _stage_fn(self, first, last, fams, policy, vocab, platform=None):
        """The stage function of a stage of layers of ``fams`` (each layer of a family run as that
        family's first layer's kind)."""
        from jaxmem.pipeline import stage_forward

        families, kinds = (), ()
        if self.families is not None:
            families = fams
            if self.model.layer_kinds is not None:
                firsts = self.model.family_layers()
                kinds = tuple(self.model.layer_kinds[firsts[f]] for f in fams)
        from jaxmem.models import traced_for

        fn = stage_forward(
            self.model,
            first=first,
            last=last,
            layers=len(fams),
            vocab=vocab,
            policy=policy,
            families=families,
            kinds=kinds,
        )
        return traced_for(fn, platform or self.platform)  # fused attention is the target's kernel

    def context_kv_bytes(self, first, last, layers, seq, families=None) -> float:
        """Per sequence, the bytes of keys and values one forward of the stage hands
        :func:`~jaxmem.models.context_kv` on one device of the facts' context axis (``seq``: the
        device's tokens of it): what each all-gather of a forward takes in, and its backward's
        reduce-scatter gives back. Traced once (nothing compiled); 0 without a context axis."""
        if self.context == 1:
            return 0.0
        fams = self._fams(layers, families)
        key = ("context_kv", first, last, fams, seq)
        if key not in self._cache:
            import jax

            from jaxmem.models import context_stand_in, gathered_bytes

            fn = self._stage_fn(first, last, fams, None, False)
            args = (self._stage_params(fams), self._stage_shared(False), self.message(1, seq), self.batch(1, seq))
            with context_stand_in(self.context):
                jax.eval_shape(fn, *args)
                self._cache[key] = float(gathered_bytes())
        return self._cache[key]

    # ------------------------------------------------------------------ the vocabulary split over the ranks
    def vocab_shape(self) -> tuple[int, int]:
        """``(vocab, d)`` of the model's token embedding (:class:`~jaxmem.models.VocabParallel`)."""
        node = self._shared
        for key in self.model.vocab.table:
            node = node[key]
        return int(node.shape[0]), int(node.shape[1])

    def vocab_flops(self, microbatch: int, seq: int) -> float:
        """FLOPs of the head's projection, forward and backward, for one microbatch: what the ranks share
        when the vocabulary is split over them (the lookup's are nil)."""
        vocab, d = self.vocab_shape()
        return 6.0 * microbatch * seq * d * vocab

    def vocab_transient(self, microbatch: int, seq: int, ranks: int) -> float:
        """Bytes a rank holds while it computes its slice of the head: the float32 logits, their
        exponentials and their gradient (``[microbatch, seq, vocab / ranks]`` each), the head's input
        and its gradient, and the slice of the projection in the compute dtype. A GPU's compiler
        fuses the exponentials and the gradient into the logits' one buffer (llama-3.1-8b's slice at
        8192 tokens compiled for an H100: the step's transient 2.5 GiB, with 2.0 GiB of logits; three
        of them put the ledger 27% over)."""
        from jaxmem.pipeline import vocab_rows

        vocab, d = self.vocab_shape()
        rows = vocab_rows(vocab, ranks)
        dtype = np.dtype(self.model.vocab.dtype).name
        logits = self.nbytes((microbatch, seq, rows), "float32") * (1 if self.platform == "gpu" else 3)
        return float(logits + 2 * self.nbytes((microbatch, seq, d), dtype) + self.nbytes((rows, d), dtype))

    def _analytic(self, first, last, layers, policy, seq, vocab=False) -> StageFacts:
        from jaxmem.memory._model import forward_flops, stage_counts
        from jaxmem.policy import PRESETS

        config = self.gpt
        dtype = np.dtype(config.dtype)
        count = stage_counts(config, layers=layers, first=first, last=last, seq=seq, policy=policy, vocab=vocab)
        save_all = PRESETS["save-all"].bind(self.model.tags)
        full = stage_counts(config, layers=layers, first=first, last=last, seq=seq, policy=save_all, vocab=vocab)
        elems = {(dtype.name, "device"): count.device, (dtype.name, "host"): count.host}
        forward = float(forward_flops(config, layers=layers, last=last and not vocab, seq=seq))
        return StageFacts(
            {k: v for k, v in elems.items() if v},
            float((full.device + full.host) * dtype.itemsize),
            forward,
            2 * forward + count.recompute_flops,
            float(count.recompute_flops),
        )

    def stage_shared_bytes(self, vocab: bool = False) -> float:
        """Bytes of the shared parameters a stage takes (without the vocabulary tables when they are
        split over the ranks)."""
        return float(tree_bytes(self._stage_shared(vocab)))

    def _stage_shared(self, vocab: bool):
        """The shared parameters a stage function takes: without the tables when they are split."""
        if not vocab:
            return self._shared
        import jax

        from jaxmem.pipeline import split_vocab

        key = ("rest",)
        if key not in self._cache:
            self._cache[key] = jax.eval_shape(lambda s: split_vocab(s, self.model.vocab, 1)[0], self._shared)
        return self._cache[key]

    @_on_context
    def _traced_plan(self, first, last, fams, policy, seq, vocab=False, platform=None):
        """The stage's residual plan, traced for the facts' platform (``platform``: another, e.g. an
        XLA:CPU trace of a GPU stage whose cuDNN kernel no cost analysis counts)."""
        from jaxmem.pipeline import analyze_stage

        key = ("plan", first, last, fams, policy, seq, vocab, platform)
        if key not in self._cache:
            fn = self._stage_fn(first, last, fams, policy, vocab, platform)
            stage = self._stage_params(fams)
            x = self.message(1, seq)
            shared = self._stage_shared(vocab)
            plan = analyze_stage(
                fn,
                stage,
                shared,
                x,
                self.batch(1, seq),
                stash_to_host=policy.offload_stash,
                host_tiles=self.platform == "tpu",
            )
            self._cache[key] = (plan, stage, x)
        return self._cache[key]

    def tensor_cut(self, policy, seq: int, tensor: int) -> TensorFacts:
        """What a ``tensor`` axis cuts of one layer under ``policy`` (a bound stage policy), from a
        one-layer middle stage's jaxpr (:mod:`jaxmem.memory._cut`); nothing without an axis or
        annotations. Layers recomputed apart (``recompute_layers``) are taken as the policy's own."""
        policy = dataclasses.replace(_stage_only(policy), recompute_layers=0)
        key = ("cut", policy, seq, tensor)
        if key not in self._cache:
            self._cache[key] = TensorFacts()
            if tensor > 1 and self.model.axes is not None:
                from jaxmem.policy import PRESETS

                full = self._cut(PRESETS["save-all"].bind(self.model.tags), seq, tensor)
                own = self._cut(policy, seq, tensor)
                self._cache[key] = TensorFacts(
                    full=full.cut_bytes / full.values_bytes if full.values_bytes else 0.0,
                    stash=own.cut_bytes / own.values_bytes if own.values_bytes else 0.0,
                    flops=full.cut_flops / full.dot_flops if full.dot_flops else 0.0,
                    reduced_bytes=full.reduced_bytes,
                    transfers=self._transfer_cut(policy, seq, tensor),
                )
        return self._cache[key]

    def _layer_dims(self, stage, tensor: int) -> list:
        """The cut dimension of each leaf of one layer's parameters (``stage``) over ``tensor``."""
        import jax

        stage = stage if self.families is None else stage[0]  # a layer of layer 0's family
        layer_axes = self.model.split(self.model.axes)[0][0]
        return [
            _tensor_dim(a.shape, ax, 1, tensor)
            for a, ax in zip(jax.tree.leaves(stage), jax.tree.leaves(layer_axes), strict=True)
        ]

    @_on_context
    def _cut(self, policy, seq: int, tensor: int):
        from jaxmem.pipeline import analyze_cut

        plan, stage, _ = self._traced_plan(False, False, (0,), policy, seq)
        dims = self._layer_dims(stage, tensor)
        dims += [None] * (len(plan.closed.jaxpr.invars) - len(dims))
        outs = plan.closed.jaxpr.outvars[len(plan.out_avals) :]
        stashed = [v for v, src in zip(outs, plan.sources) if src[0] == "stash"]
        return analyze_cut(plan.closed, dims, stashed)[1]

    @_on_context
    def _transfer_cut(self, policy, seq: int, tensor: int) -> float:
        """The cut fraction of a one-layer middle stage's I->W transfers (the split the executor
        traces; its stash taken whole, so a value computed from a cut residual alone counts whole)."""
        from jaxmem.pipeline import abstract_split

        plan, stage, x = self._traced_plan(False, False, (0,), policy, seq)
        split = abstract_split(plan, stage, self._stage_shared(False), self.batch(1, seq), x)
        dims = self._layer_dims(stage, tensor)
        dims += [None] * (len(split.split.closed.jaxpr.invars) - len(dims))
        arena = split.transfer_arena(dims, tensor)
        whole = sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in split.transfer_leaves())
        return arena.cut_bytes() / whole if whole else 0.0

    def _traced(self, first, last, fams, policy, seq, vocab=False) -> StageFacts:
        from jaxmem.policy import PRESETS

        plan = self._traced_plan(first, last, fams, policy, seq, vocab)[0]
        save_all = PRESETS["save-all"].bind(self.model.tags)
        full_plan = plan if policy == save_all else self._traced_plan(first, last, fams, save_all, seq, vocab)[0]
        forward, backward = self._flops(first, last, fams, policy, seq, vocab)
        full_backward = self._flops(first, last, fams, save_all, seq, vocab)[1]
        return StageFacts(
            {k: v for k, v in plan.stash_elems.items() if v},
            float(full_plan.stash_bytes()),
            forward,
            backward,
            max(backward - full_backward, 0.0),
            self._working(first, last, fams, policy, seq, vocab),
        )

    def split_working(
        self, *, first, last, layers, policy, microbatch, seq, vocab=False, families=None, hand_recomputed=False
    ) -> float | None:
        """Per device, the working set of one stage-microbatch's backward when the schedule splits it
        into I and W (:mod:`jaxmem.pipeline._iw`; ``hand_recomputed`` as the pipeline's): the larger
        of the two parts' temporaries, each compiled alone. None for a stage that recomputes layers
        apart (its parts are composed; the whole backward's working set stands for it)."""
        if policy.recompute_layers:
            return None
        fams = self._fams(layers, families)
        vocab = bool(vocab) and (first or last)
        # Where I recomputed nothing W reads, handing it over is the same split: compiled once.
        hand = hand_recomputed and self._transfers(first, last, fams, policy, seq, vocab, True) != self._transfers(
            first, last, fams, policy, seq, vocab
        )
        return self._working(first, last, fams, policy, seq, vocab, split="hand" if hand else True) * microbatch

    @_on_context
    def _working(self, first, last, fams, policy, seq, vocab=False, tensor=1, split=False) -> float | None:
        """Per sequence (and device): the temporaries of the stage's pullback compiled alone, at
        ``WORKSET_MICROBATCH`` sequences (a microbatch of one lays some buffers out apart); more
        than two layers are extrapolated from one and two, as the other facts are. With ``tensor``
        > 1, compiled on a ``tensor`` mesh of local devices (None when there are too few). With
        ``split``, the larger of its I and W parts' (:meth:`split_working`; ``"hand"``: I hands W
        what it recomputed too)."""
        # The pullback compiled alone takes its stash as arguments wherever the executor keeps it:
        # where the stash lives does not change its temporaries (equal on every preset, tiny GPT and
        # Llama), so the offloaded variants share the compile.
        policy = dataclasses.replace(_stage_only(policy), offload_stash=False)
        if len(fams) > 2 and not policy.recompute_layers:  # (a composed stage, _mixed_working: as it is)
            # Per family, a layer adds what a second adds to a first (inc), on a base (2 one - two):
            # identical layers give two + (n - 2) (two - one).
            one = {f: self._working(first, last, (f,), policy, seq, vocab, tensor, split) for f in set(fams)}
            two = {f: self._working(first, last, (f, f), policy, seq, vocab, tensor, split) for f in set(fams)}
            if any(v is None for v in one.values()):
                return None
            base = max(2 * one[f] - two[f] for f in one)
            return max(base + sum(two[f] - one[f] for f in fams), max(two.values()))
        key = ("working", first, last, fams, policy, seq, vocab, tensor, split)
        cache = self._stage_cache
        mode = _WORKING_SETS.get()
        if key not in cache and mode != "compiled":
            return 0.0 if mode == "none" else self._derived_working(key)
        if key not in cache:
            import jax

            from jaxmem.models import tensor_mesh
            from jaxmem.pipeline import analyze_stage

            mesh = None
            if tensor > 1 or self.target is not None:
                devices = self._devices(tensor)
                if len(devices) < tensor:
                    return None
                mesh = jax.sharding.Mesh(np.array(devices[:tensor]), ("tensor",))
            mb = WORKSET_MICROBATCH
            fn = self._stage_fn(first, last, fams, policy, vocab)
            # (an attention kernel splits over the tensor axis as in the step: _per_tensor_shard)
            with tensor_mesh(mesh if tensor > 1 else None):
                stage = self._stage_params(fams)
                x, batch, shared = self.message(mb, seq), self.batch(mb, seq), self._stage_shared(vocab)
                plan = analyze_stage(fn, stage, shared, x, batch, stash_to_host=policy.offload_stash)
                if mesh is not None:
                    stage, shared = self._tensor_placed(stage, shared, mesh, vocab)
                if split:
                    lowered = _lower_split(
                        plan,
                        stage,
                        shared,
                        x,
                        batch,
                        input_grad=not (first and not vocab),
                        hand_recomputed=split == "hand",
                        mesh=mesh,
                    )
                else:
                    lowered = [_lower_pullback(plan, stage, shared, x, batch, mesh=mesh)]
            options = _working_options(self.platform)
            where = self._compiled_for()
            temps = [
                cached_figure(part, options, where, functools.partial(_temporaries, part, options)) for part in lowered
            ]
            cache[key] = max(temps) / mb
        return cache[key]

    def _derived_working(self, key: tuple) -> float | None:
        """A working set (``key`` as :meth:`_working`'s) from the nearest one compiled already for the
        same stage role, policy, vocabulary, tensor and split -- at another sequence length, or for
        a stage of other layers (a dropped one) -- scaled by the two stages' activation volumes (their
        save-all stash: what a backward's temporaries are made of). Compiled when none is known."""
        _, first, last, fams, policy, seq, vocab, tensor, split = key
        cache = self._stage_cache
        known = [
            k
            for k in list(cache)
            if len(k) == 9 and k[0] == "working" and k[1:3] == (first, last) and k[4] == policy and k[6:] == key[6:]
        ]
        if not known:
            with working_sets("compiled"):
                return self._working(first, last, fams, policy, seq, vocab, tensor, split)
        # Nearest: the same layers first, then the nearest length (a longer one: scaling down holds
        # better than up -- the tiny GPT's stages within 1.5% from 128 to 64, 10-28% over from 32 up).
        ref = min(known, key=lambda k: (k[3] != fams, abs(math.log(k[5] / seq)), k[5] < seq, len(k[3])))
        volume, ref_volume = (
            self._activation_bytes(first, last, fams, seq, vocab),
            self._activation_bytes(first, last, ref[3], ref[5], vocab),
        )
        if cache[ref] is None or ref_volume <= 0:
            return None
        return cache[ref] * volume / ref_volume

    def _activation_bytes(self, first, last, fams, seq, vocab) -> float:
        """Per sequence, the stage's save-all stash: its activation volume (closed form for jaxmem's
        GPT, else traced), without its working set."""
        from jaxmem.policy import PRESETS

        save_all = PRESETS["save-all"].bind(self.model.tags)
        if self.gpt is not None:
            return self._analytic(first, last, len(fams), save_all, seq, vocab).full_bytes
        if not fams and not (first or last):
            return 0.0
        if len(fams) > 2:  # each further layer adds what a second of its family adds to a first
            volume = self._activation_bytes(first, last, fams[:1], seq, vocab)
            for f in fams[1:]:
                two = self._activation_bytes(first, last, (f, f), seq, vocab)
                volume += two - self._activation_bytes(first, last, (f,), seq, vocab)
            return volume
        return float(self._traced_plan(first, last, fams, save_all, seq, vocab)[0].stash_bytes())

    def tensor_working(
        self, *, first, last, layers, policy, microbatch, seq, vocab=False, tensor=1, families=None
    ) -> float | None:
        """Per device, the working set of :class:`StageFacts` for one stage-microbatch with the
        parameters cut over ``tensor`` devices as the model's annotations say: the pullback compiled
        on a mesh of local devices and left to XLA's partitioner, as the executor leaves it. None when
        the model annotates nothing or the process has fewer than ``tensor`` devices (the ledger then
        models the cut)."""
        if tensor <= 1 or self.model.axes is None or self._cpu_emulates_16_bits(seq) or policy.recompute_layers:
            return None  # (a stage that recomputes layers apart is composed of parts: modelled)
        fams = self._fams(layers, families)
        per = self._working(first, last, fams, policy, seq, bool(vocab) and (first or last), tensor)
        return None if per is None else per * microbatch

    def _cpu_emulates_16_bits(self, seq: int) -> bool:
        """XLA:CPU computes 16-bit floats by converting around each op, and under its partitioner
        those converted copies are laid out apart: a 16-bit model's tensor working set compiled on
        CPU says little of an accelerator's (llama-8b bf16, a stage of 4 layers at 2 x 4096: 23.6
        GiB on a 2-device mesh against 16.8 modelled, where f32 agrees within 1%), so it is
        modelled there. The platform is the facts' target's, not this process's."""
        import jax
        import jax.numpy as jnp

        if self.platform != "cpu":
            return False
        floats = [a for a in jax.tree.leaves(self.message(1, seq)) if jnp.issubdtype(a.dtype, jnp.floating)]
        return any(np.dtype(a.dtype).itemsize < 4 for a in floats)

    def _tensor_placed(self, stage, shared, mesh, vocab):
        """The stage's and shared parameters as shaped values sharded over ``mesh``'s tensor axis where
        the model's annotations cut them (whole where the cut would split a unit, as the placement)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxmem.pipeline import layout_axes

        tensor = mesh.shape["tensor"]

        def placed(a, ax, lead):
            spec = [None] * len(a.shape)
            d = _tensor_dim(a.shape, ax, lead, tensor)
            if d is not None:
                spec[d] = "tensor"
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec(*spec)))

        # A stage leaf leads with its layers; the shared leaves as the pipeline holds them (tables out).
        layer_axes = self.model.split(self.model.axes)[0]
        if self.families is None:
            stage = jax.tree.map(lambda a, ax: placed(a, ax, 1), stage, layer_axes[0])
        else:
            firsts = self.model.family_layers()
            stage = tuple(
                jax.tree.map(lambda a, ax: placed(a, ax, 1), tree, layer_axes[i]) for tree, i in zip(stage, firsts)
            )
        shared = jax.tree.map(lambda a, ax: placed(a, ax, 0), shared, layout_axes(self.model, 1, vocab).shared)
        return stage, shared

    @_on_context
    def _flops(self, first, last, fams, policy, seq, vocab=False) -> tuple[float, float]:
        """``cost_analysis()`` FLOPs of the lowered forward and pullback of a traced stage, once per
        stage and policy (every policy's facts read save-all's pullback too), shared between depths
        as the working sets are."""
        key = ("flops", first, last, fams, policy, seq, vocab)
        cache = self._stage_cache
        if key not in cache:
            import jax
            from jax.extend.core import jaxpr_as_fun

            # Counted on the XLA composition of each op: a custom kernel (cuDNN's attention on a GPU)
            # is opaque to cost_analysis() and does the same math.
            plan, stage, x = self._traced_plan(first, last, fams, policy, seq, vocab, platform="cpu")
            batch = self.batch(1, seq)
            shared = self._stage_shared(vocab)
            flat = jax.tree.leaves(stage) + jax.tree.leaves(shared) + jax.tree.leaves(x) + jax.tree.leaves(batch)
            forward = _cost_flops(jax.jit(jaxpr_as_fun(plan.closed)).lower(*flat))
            cache[key] = forward, _cost_flops(_lower_pullback(plan, stage, shared, x, batch))
        return cache[key]

    @_on_context
    def compiled_flops(self, *, first, last, layers, policy, seq, families=None) -> tuple[float, float]:
        """Per sequence, the FLOPs of one stage's forward and of its backward (its recompute included)
        as the facts' target's compiler counts them in the programs it builds for the target's
        devices (:func:`jaxmem._util.compiled_flops`; the devices at hand without a target): the
        figure the time model's :meth:`stage` FLOPs -- a closed form, or ``cost_analysis()`` of the
        lowered, unoptimised stage -- are checked against (``benchmarks/target_flops.py``). Compiles
        two programs; nothing is kept. Not for a policy that recomputes layers apart (its parts are
        priced one by one)."""
        import jax
        from jax.extend.core import jaxpr_as_fun

        from jaxmem._errors import JaxmemError
        from jaxmem._util import compiled_flops

        if policy.recompute_layers:
            raise JaxmemError("compiled_flops takes a policy without recompute_layers: price the parts apart")
        fams = self._fams(layers, families)
        plan, stage, x = self._traced_plan(first, last, fams, policy, seq)
        shared, batch = self._stage_shared(False), self.batch(1, seq)
        mesh = jax.sharding.Mesh(np.array(self._devices(1)[:1]), ("tensor",))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        flat = jax.tree.leaves((stage, shared, x, batch))
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole) for a in flat]
        forward = jax.jit(jaxpr_as_fun(plan.closed)).lower(*placed).compile()
        backward = _lower_pullback(plan, stage, shared, x, batch, mesh=mesh).compile()
        return compiled_flops(forward), compiled_flops(backward)


def _mixed(parts) -> dict:
    """``sum(weight * elems)`` of ``[(elems dict, weight), ...]``, zeros dropped."""
    out: dict = {}
    for elems, weight in parts:
        for k, n in elems.items():
            out[k] = out.get(k, 0) + weight * n
    return {k: n for k, n in out.items() if n}


def _stacked(family_layers, rows, ranks):
    """Stage leaves ``[ranks, rows, ...]``: of the first family's layer for an int ``rows``, else a
    tuple with ``rows[f]`` rows of each family's."""
    import jax

    def stack(layer, n):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((ranks, n, *a.shape), a.dtype), layer)

    if isinstance(rows, int):
        return stack(family_layers[0], rows)
    return tuple(stack(layer, n) for layer, n in zip(family_layers, rows))


@functools.lru_cache(maxsize=4096)  # the ledger asks for every part of every stage it prices
def _stage_only(policy):
    """A bound stage policy without the settings that do not change a stage's residuals, FLOPs or
    temporaries -- where its weights and optimizer state live, whether FSDP keeps its weights
    gathered (all priced by the ledger from the policy itself) -- so that policies differing only
    there share their facts (and their compiles)."""
    return dataclasses.replace(policy, offload_weights=False, offload_optimizer_state=False, keep_gathered=False)


def _tensor_dim(shape, ax, lead: int, tensor: int) -> int | None:
    """The dimension of a leaf of ``shape`` that ``tensor`` devices cut, by its ParamAxes ``ax``
    (``lead``: dimensions the leaf has before the model's own); None where the annotation names none,
    or where the cut would split a unit (kept whole, as the placement keeps it)."""
    d = ax.dim("tensor")
    return None if d is None or shape[d + lead] % (tensor * ax.unit) else d + lead


def _lower_pullback(plan, stage, shared, x, batch, *, mesh=None):
    """The stage's pullback, lowered abstractly: from its parameters, the batch, a stash slot and the
    output's cotangent to the gradients (what the executor's backward branch runs); ``mesh``: the
    inputs not placed already are replicated over it."""
    import jax
    import jax.numpy as jnp

    def placed(a):
        if mesh is None or getattr(a, "sharding", None) is not None:
            return a
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)

    packed = {k: placed(jax.ShapeDtypeStruct((n,), jnp.dtype(k[0]))) for k, n in plan.stash_elems.items()}
    cts = [placed(jax.ShapeDtypeStruct(a.shape, a.dtype)) for a in plan.out_avals]
    ct = jax.tree_util.tree_unflatten(plan.out_tree, cts)

    def backward_fn(stage, shared, batch, packed, ct):
        return plan.pullback(stage, shared, x, batch, packed)(ct)

    return jax.jit(backward_fn).lower(stage, jax.tree.map(placed, shared), jax.tree.map(placed, batch), packed, ct)


def _lower_split(plan, stage, shared, x, batch, input_grad: bool, hand_recomputed: bool = False, *, mesh=None) -> list:
    """The stage's backward split into I and W (:mod:`jaxmem.pipeline._iw`), each lowered alone as
    the executor runs it: I from the stash slot and the output's cotangent to the input gradient,
    writing its transfers into their arena in place; W from the same, reading the transfers back
    out of the arena, to the weight gradients. ``mesh``: the inputs not placed already are
    replicated over it (a target's devices)."""
    import jax
    import jax.numpy as jnp

    from jaxmem.pipeline import abstract_split

    def placed(a):
        if mesh is None or getattr(a, "sharding", None) is not None:
            return a
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)

    split = abstract_split(plan, stage, shared, batch, x, input_grad=input_grad, hand_recomputed=hand_recomputed)
    packed = {k: placed(jax.ShapeDtypeStruct((n,), jnp.dtype(k[0]))) for k, n in plan.stash_elems.items() if n}
    ct = jax.tree_util.tree_unflatten(
        plan.out_tree, [placed(jax.ShapeDtypeStruct(a.shape, a.dtype)) for a in plan.out_avals]
    )
    args = jax.tree.map(placed, (stage, shared, batch, packed, ct))
    sizes = split.split.transfer_elems()
    arenas = {name: placed(jax.ShapeDtypeStruct((n,), np.dtype(name))) for name, n in sizes.items()}
    base = dict.fromkeys(sizes, 0)

    def i_part(args, arenas):
        d_x, transfers = split.input_grad(args)
        return d_x, split.hand_over(arenas, base, transfers)

    def w_part(args, arenas):
        return split.weight_grads(args, split.take_over(arenas, base))

    return [jax.jit(i_part, donate_argnums=1).lower(args, arenas), jax.jit(w_part).lower(args, arenas)]


def _temporaries(lowered, options) -> float:
    """A pullback's temporaries as its target's compiler counts them (:func:`compiled_temp_bytes`). A
    TPU's compiler refuses a program beyond the chip's HBM (llama-8b's stage backward at 2 x 4096 on
    a v5e) and says in its error how many bytes of temporaries it needed, the figure taken then."""
    from jaxmem._errors import out_of_memory_bytes

    try:
        return float(compiled_temp_bytes(lowered.compile(options)))
    except Exception as e:  # noqa: BLE001 -- jax raises its runtime error type for it
        needed = out_of_memory_bytes(e)
        if needed is None:
            raise
        return needed


def _cost_flops(lowered) -> float:
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DEPTHLESS: dict = {}  # depthless built-in config -> compiled working sets, I/W splits (ModelFacts.__init__)


def model_facts(model, *, analytic: bool = True, target=None, context: int = 1) -> ModelFacts:
    """The (cached) facts of a model; ``analytic=False`` forces tracing even where a closed form exists;
    ``target`` (a :class:`~jaxmem.targets.Target` or its name): whose compiler and layouts the facts
    read (None: the devices at hand); ``context``: of one device's part of each sequence on a context
    axis of so many devices (the callers give the local length)."""
    from jaxmem.targets import parse_target

    target = parse_target(target)
    key = (analytic, None if target is None or not target.compile_only else target.kind, context)
    per_model = _FACTS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = ModelFacts(model, analytic=analytic, target=target, context=context)
    return per_model[key]
