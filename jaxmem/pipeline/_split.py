"""Cutting a model into pipeline stages: layer counts, parameter layout, and pure stage functions."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import tree_get
from jaxmem.models import EMBED_KEY, HEAD_KEY, layer_batch
from jaxmem.pipeline._vocab import join_vocab, split_vocab, with_vocab_placeholders

__all__ = [
    "ParamLayout",
    "PipelineParams",
    "balanced_layers",
    "cost_balanced_layers",
    "layer_flops",
    "model_layer_counts",
    "split_layers",
    "stack_stage_params",
    "stage_forward",
    "unstack_layers",
    "unstack_stage_params",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def balanced_layers(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Layers per stage as even as they go, the first stages taking one more where they do not divide.

    >>> balanced_layers(8, 3)
    (3, 3, 2)
    """
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (i < extra) for i in range(n_stages))


def split_layers(n_layers: int, n_stages: int, layer_counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage: balanced by default, or an explicit list.

    >>> split_layers(8, 4)
    (2, 2, 2, 2)
    >>> split_layers(8, 3, [3, 3, 2])
    (3, 3, 2)
    """
    if layer_counts is not None:
        counts = tuple(int(c) for c in layer_counts)
        if len(counts) != n_stages:
            raise JaxmemError(
                f"layers per stage {list(counts)} lists {len(counts)} stages, but the schedule has {n_stages}"
            )
        if any(c < 0 for c in counts) or sum(counts) != n_layers:
            raise JaxmemError(
                f"layers per stage {list(counts)} must be >= 0 and sum to the model's {n_layers} layers "
                f"(they sum to {sum(counts)})"
            )
        return counts
    if n_layers % n_stages:
        ok = ", ".join(str(d) for d in _divisors(n_layers))
        example = balanced_layers(n_layers, n_stages)
        raise JaxmemError(
            f"{n_layers} layers do not split evenly over {n_stages} stages; stage counts that divide "
            f"{n_layers}: {ok} (stages = pipeline ranks x virtual stages per rank), or give the layers of each "
            f"stage, e.g. {setting('layer_counts', tuple(example))}"
        )
    return (n_layers // n_stages,) * n_stages


def cost_balanced_layers(costs: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """Layers per stage, consecutive, that make the costliest stage as cheap as it goes (each stage
    at least one layer when there are enough); of the splits that do, the one by count
    (:func:`balanced_layers`) when it is among them.

    >>> cost_balanced_layers([1, 1, 1, 1, 4, 4], 2)
    (4, 2)
    >>> cost_balanced_layers([1, 1, 1, 1], 2)
    (2, 2)
    """
    n = len(costs)
    prefix = np.cumsum((0.0, *costs))
    least = 1 if n >= n_stages else 0
    # best[s][i]: the least costliest stage over splits of the first i layers into s stages.
    best = np.full((n_stages + 1, n + 1), np.inf)
    cut = np.zeros((n_stages + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for st in range(1, n_stages + 1):
        for i in range(least, n + 1):
            j = np.arange(i - least + 1)
            values = np.maximum(best[st - 1][j], prefix[i] - prefix[j])
            cut[st][i] = int(np.argmin(values))
            best[st][i] = values[cut[st][i]]
    by_count = balanced_layers(n, n_stages)
    starts = np.cumsum((0, *by_count))
    if max(prefix[b] - prefix[a] for a, b in zip(starts[:-1], starts[1:])) <= best[n_stages][n] * (1 + 1e-9):
        return by_count
    counts, i = [], n
    for st in range(n_stages, 0, -1):
        counts.append(int(i - cut[st][i]))
        i = cut[st][i]
    return tuple(reversed(counts))


def model_layer_counts(model, n_stages: int, layer_counts: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage of a :class:`~jaxmem.models.StagedModel`: ``layer_counts`` when given
    (checked), else balanced -- by count when its layers are alike (:func:`split_layers`), by each
    layer's FLOPs when they hold parameters of several families (a dense layer beside mixture-of-
    experts ones: :func:`layer_flops`, :func:`cost_balanced_layers`)."""
    if layer_counts is not None or model.layer_families is None:
        return split_layers(model.n_layers, n_stages, layer_counts)
    return cost_balanced_layers(layer_flops(model), n_stages)


_LAYER_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_flops(model, seq: int | None = None) -> list[float]:
    """Per layer, the FLOPs of its forward and backward on one sequence (``seq``: the model's longest
    up to 512 by default): a one-layer middle stage of its family, read from ``cost_analysis()`` of
    the lowered program (never compiled). What a split by cost balances. Cached per model."""
    from jaxmem.models import RNG_SPEC

    seq = seq or min(model.max_seq_len or 512, 512)
    cache = _LAYER_FLOPS.setdefault(model, {})
    if seq not in cache:
        layers, shared = model.split(model.abstract_params())
        if model.batch_spec is not None:
            batch = dict(model.batch_spec(1, seq))
        else:
            tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
            batch = {"tokens": tokens, "targets": tokens}
        if model.rng:
            batch["rng"] = RNG_SPEC
        x = jax.eval_shape(model.embed, shared, layer_batch(batch, EMBED_KEY))
        families = model.layer_families or (0,) * model.n_layers
        per_family = []
        for index in model.family_layers():
            kinds = () if model.layer_kinds is None else (model.layer_kinds[index],)
            fn = stage_forward(model, first=False, last=False, layers=1, kinds=kinds)
            stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype), layers[index])

            def forward_backward(stage, shared, x, batch, fn=fn):
                out, pullback = jax.vjp(lambda p, xx: fn(p, shared, xx, batch), stage, x)
                return pullback(out)

            cost = jax.jit(forward_backward).lower(stage, shared, x, batch).cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            per_family.append(float((cost or {}).get("flops", 0.0)))
        cache[seq] = [per_family[f] for f in families]
    return list(cache[seq])


def unstack_layers(stacked, layers: int) -> list:
    """The first ``layers`` entries of a tree whose leaves lead with a layer axis, one tree per layer.

    One split per leaf, not an index per layer: the gradient of ``a[i]`` pads each layer's gradient to
    the whole stack and adds them up (work growing with the square of the layers); a split's
    gradient is one concatenation.
    """
    leaves, treedef = jax.tree.flatten(stacked)
    pieces = []
    for a in leaves:
        sizes = [1] * layers + ([a.shape[0] - layers] if a.shape[0] > layers else [])
        pieces.append([p[0] for p in jax.lax.split(a, sizes)[:layers]])
    return [jax.tree.unflatten(treedef, [p[i] for p in pieces]) for i in range(layers)]


def stage_forward(
    model,
    *,
    first: bool,
    last: bool,
    layers: int,
    skip: tuple[int, ...] = (),
    vocab: bool = False,
    kinds: tuple[int, ...] = (),
    families: tuple[int, ...] = (),
    policy=None,
) -> Callable:
    """``fn(stage_params, shared, x, batch)`` of one stage of a :class:`~jaxmem.models.StagedModel`:
    the embedding if ``first`` (``x`` is then ignored), ``layers`` layers (except the local indices
    in ``skip``: layer drop), the head's ``(loss_sum, weight)`` if ``last``. ``stage_params`` leaves
    have a leading layer axis (at least ``layers``). A ``batch["rng"]`` (the stage's key) is folded
    per layer (:func:`jaxmem.models.layer_batch`). ``kinds``: the kind of each layer, for a model
    whose layers differ in static configuration (:attr:`~jaxmem.models.StagedModel.layer_kinds`;
    empty: every layer is ``model.layer``). ``families``: the parameter family of each layer, for a
    model whose layers hold different parameters (:attr:`~jaxmem.models.StagedModel.layer_families`);
    ``stage_params`` is then a tuple with one stacked tree per family of the model, and the stage's
    ``i``-th layer of family ``f`` reads that tree's next row.

    With ``vocab`` (the vocabulary split over the ranks, :class:`~jaxmem.models.VocabParallel`), the
    first stage starts from its looked-up rows ``x`` (``model.vocab.embed``) and the last ends with
    ``model.vocab.hidden``, before the head's projection: the pipeline does the lookup and the
    projection on every rank at once. ``shared`` is then the shared parameters without the tables
    (as :func:`~jaxmem.pipeline._vocab.split_vocab` leaves them).

    ``policy`` (a :class:`~jaxmem.policy.BoundStagePolicy`): the stage checkpointed as it says -- one
    ``jax.checkpoint`` of the whole stage, or with ``recompute_layers = k`` a ``jax.checkpoint``
    that saves nothing around each of the first ``k`` layers (each keeps only its input) and one
    with the policy's names around the rest of the stage. None: not checkpointed."""
    full = model.split(model.abstract_params())[1] if vocab else None

    def begin(shared, x, batch):
        if vocab:
            shared = with_vocab_placeholders(shared, model.vocab, full)
        if first and vocab:
            x = model.vocab.embed(shared, x, layer_batch(batch, EMBED_KEY))
        elif first:
            x = model.embed(shared, layer_batch(batch, EMBED_KEY))
        return shared, x

    def layer_fn(i):
        return model.layer_of_kind(kinds[i]) if kinds else model.layer

    def end(shared, per_layer, x, batch, start):
        for i in range(start, layers):
            if i not in skip:
                x = layer_fn(i)(per_layer[i - start], x, layer_batch(batch, i))
        if last and vocab:
            return model.vocab.hidden(shared, x, layer_batch(batch, HEAD_KEY))
        if last:
            return model.head_loss(shared, x, layer_batch(batch, HEAD_KEY))
        return x

    def per_layer_params(stage_params) -> list:
        if not families:
            return unstack_layers(stage_params, layers)
        rows = [iter(unstack_layers(tree, families.count(f))) for f, tree in enumerate(stage_params)]
        return [next(rows[f]) for f in families]

    def fn(stage_params, shared, x, batch):
        shared, x = begin(shared, x, batch)
        return end(shared, per_layer_params(stage_params), x, batch, 0)

    if policy is None:
        return fn
    k = min(policy.recompute_layers, layers)
    if not k:
        return policy.wrap(fn)
    whole = jax.checkpoint_policies.nothing_saveable
    rest = jax.checkpoint(
        lambda shared, per_layer, x, batch: end(shared, per_layer, x, batch, k), policy=policy.checkpoint_policy()
    )

    # The embedding (first stage) under the policy too, as a stage without recomputed layers has it.
    start = jax.checkpoint(begin, policy=policy.checkpoint_policy())

    def mixed(stage_params, shared, x, batch):
        shared, x = start(shared, x, batch)
        per_layer = per_layer_params(stage_params)
        for i in range(k):
            if i not in skip:
                x = jax.checkpoint(layer_fn(i), policy=whole)(per_layer[i], x, layer_batch(batch, i))
        return rest(shared, per_layer[k:], x, batch)

    return mixed


def _per_rank(stage_to_rank: Sequence[int]) -> list[list[int]]:
    ranks = max(stage_to_rank) + 1
    return [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(ranks)]


def stack_stage_params(
    blocks: Sequence[dict], layer_counts: Sequence[int], stage_to_rank: Sequence[int], xp=jnp
) -> tuple[dict, ...]:
    """Per-layer dicts -> one dict per local stage position ``v``, leaves ``[ranks, max layers, ...]``.

    Entry ``v`` holds, for every rank, the layers of the rank's ``v``-th stage, so sharding its first
    axis over ``pipe`` gives every rank exactly its own stages. Stages with fewer layers than the most
    loaded one are zero-padded (those rows are never read and get zero gradients). ``xp``:
    ``jax.numpy``, or ``numpy`` to stack host arrays on the host.
    """
    per_rank = _per_rank(stage_to_rank)
    max_layers = max(max(layer_counts), 1)
    starts = [sum(layer_counts[:s]) for s in range(len(layer_counts))]
    template = blocks[0]

    def stage_stack(s):
        layers = [blocks[starts[s] + i] for i in range(layer_counts[s])]
        pad = max_layers - len(layers)
        parts = [jax.tree.map(lambda *xs: xp.stack(xs), *layers)] if layers else []
        if pad:
            parts.append(jax.tree.map(lambda a: xp.zeros((pad,) + a.shape, a.dtype), template))
        return jax.tree.map(lambda *xs: xp.concatenate(xs), *parts) if len(parts) > 1 else parts[0]

    virtual = len(per_rank[0])
    return tuple(
        jax.tree.map(lambda *xs: xp.stack(xs), *[stage_stack(stages[v]) for stages in per_rank]) for v in range(virtual)
    )


def unstack_stage_params(
    stacked: Sequence[dict], layer_counts: Sequence[int], stage_to_rank: Sequence[int]
) -> list[dict]:
    """Inverse of :func:`stack_stage_params`: the per-layer dicts in model order."""
    per_rank = _per_rank(stage_to_rank)
    blocks = []
    for s, count in enumerate(layer_counts):
        rank = stage_to_rank[s]
        local = per_rank[rank].index(s)
        for i in range(count):
            blocks.append(jax.tree.map(lambda a, rank=rank, i=i: a[rank, i], stacked[local]))
    return blocks


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where a pipeline keeps a model's parameters: which rank runs each stage, how many layers each
    stage holds, and over how many ranks the vocabulary tables are split (0: whole, with the other
    shared parameters). Two pipelines with equal layouts hold arrays of equal shapes (only their cut
    over the mesh's other axes may differ), so a checkpoint saved by one restores onto the other
    shard for shard; other layouts re-lay each array out (:meth:`relayout_stage_leaf`).

    ``families``: for a model whose layers hold different parameters, the family of each layer
    (:attr:`~jaxmem.models.StagedModel.layer_families`). Each family is stacked apart: a stage
    position's entry is then a tuple with one stacked tree per family, ``[ranks, the most layers of
    that family any stage holds, ...]`` -- a rank holding fewer keeps zero rows, as for stages of
    fewer layers.

    ``split`` and ``join`` go between the model's own tree and ``(stages, shared, vocab)``, on device
    (``xp=jax.numpy``) or on the host (``xp=numpy``).
    """

    stage_to_rank: tuple[int, ...]
    layer_counts: tuple[int, ...]
    vocab_ranks: int = 0
    families: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        out = {
            "stage_to_rank": list(self.stage_to_rank),
            "layer_counts": list(self.layer_counts),
            "vocab_ranks": self.vocab_ranks,
        }
        return out if self.families is None else {**out, "families": list(self.families)}

    @classmethod
    def from_json(cls, value: dict) -> ParamLayout:
        families = value.get("families")
        return cls(
            tuple(value["stage_to_rank"]),
            tuple(value["layer_counts"]),
            int(value.get("vocab_ranks", 0)),
            None if families is None else tuple(families),
        )

    def family(self, f: int) -> ParamLayout:
        """The layout of family ``f``'s layers alone (:attr:`families`: the parameter family of each
        layer, :attr:`~jaxmem.models.StagedModel.layer_families`): each stage holds its layers of
        that family, stacked apart from the others'."""
        starts = np.cumsum((0, *self.layer_counts))
        counts = tuple(self.families[a:b].count(f) for a, b in zip(starts[:-1], starts[1:]))
        return ParamLayout(self.stage_to_rank, counts)

    def _stack(self, layers: Sequence, xp) -> tuple:
        if self.families is None:
            return stack_stage_params(layers, self.layer_counts, self.stage_to_rank, xp=xp)
        per_family = [
            self.family(f)._stack([a for a, g in zip(layers, self.families) if g == f], xp)
            for f in range(max(self.families) + 1)
        ]
        return tuple(tuple(stacks) for stacks in zip(*per_family))  # [v][family]

    def _unstack(self, stages: Sequence) -> list:
        if self.families is None:
            return unstack_stage_params(stages, self.layer_counts, self.stage_to_rank)
        rows = [iter(self.family(f)._unstack([entry[f] for entry in stages])) for f in range(max(self.families) + 1)]
        return [next(rows[f]) for f in self.families]

    def split(self, model, params, xp=jnp) -> tuple[tuple, dict, dict]:
        """The model's parameter tree -> ``(stages, shared, vocab)`` in this layout."""
        layers, shared = model.split(params)
        if len(layers) != model.n_layers:
            raise JaxmemError(f"the parameters hold {len(layers)} layers; model {model.name} has {model.n_layers}")
        stages = self._stack(layers, xp)
        vocab = {}
        if self.vocab_ranks:
            shared, vocab = split_vocab(shared, model.vocab, self.vocab_ranks, xp=xp)
        return stages, shared, vocab

    def join(self, model, stages, shared, vocab):
        """The inverse of :meth:`split` (indexing and reshapes only: device or host arrays alike)."""
        layers = self._unstack(stages)
        if self.vocab_ranks:
            shared = join_vocab(shared, vocab, model.vocab, vocab_size(model))
        return model.join(layers, shared)

    def relayout_stage_leaf(self, leaves: Sequence, other: ParamLayout, xp=np, family: int | None = None) -> list:
        """One stage leaf as :meth:`split` lays it out here (``leaves[v]``, ``[ranks, max layers, ...]``)
        -> the same leaf in ``other``'s layout (one array per local stage position). ``family``: the
        leaf's parameter family, for layers of several (:attr:`families`)."""
        if self.families != other.families:
            raise JaxmemError(
                "the two layouts hold layers of other parameter families (another model); a checkpoint restores "
                "only onto the model it was saved from"
            )
        if self.families is not None:
            return self.family(family).relayout_stage_leaf(leaves, other.family(family), xp)
        layers = unstack_stage_params([{"x": a} for a in leaves], self.layer_counts, self.stage_to_rank)
        stacked = stack_stage_params(layers, other.layer_counts, other.stage_to_rank, xp=xp)
        return [entry["x"] for entry in stacked]


def vocab_size(model) -> int:
    """Rows of the model's token embedding (its :class:`~jaxmem.models.VocabParallel` table)."""
    return int(tree_get(model.split(model.abstract_params())[1], model.vocab.table).shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PipelineParams:
    """Model parameters laid out for the pipeline.

    Attributes:
        stages: one dict per local stage position ``v``; leaves ``[ranks, max layers, ...]`` sharded
            over ``pipe`` on the first axis (rank r's v-th stage). For layers of several parameter
            families, a tuple of such dicts per position, one per family (:class:`ParamLayout`).
        shared: the model's parameters outside its layers (embeddings, final norm, head), used by the
            first and last stages.
        vocab: with the vocabulary split over the ranks (:class:`~jaxmem.models.VocabParallel`), the
            token embedding (``table``) and the untied head (``head``, transposed) as ``[ranks, vocab /
            ranks, d]``, sharded over ``pipe`` (and then absent from ``shared``); else empty.

    How each leaf is cut over the mesh (and its optimizer state, and the step's gradients) is its
    :class:`~jaxmem.pipeline.Placement`.
    """

    stages: tuple
    shared: dict
    vocab: dict = dataclasses.field(default_factory=dict)
