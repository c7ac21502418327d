"""Cutting a GPT into pipeline stages: layer counts, parameter layout, and pure stage functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem._errors import JaxmemError
from jaxmem.models.gpt import GPT, GPTConfig, cross_entropy

__all__ = ["GPTPieces", "split_layers", "stack_stage_params", "unstack_stage_params"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
        raise JaxmemError(
            f"{n_layers} layers do not split evenly over {n_stages} stages; stage counts that divide "
            f"{n_layers}: {ok} (stages = pipeline ranks x virtual stages per rank), or pass explicit "
            "layers per stage (--layers-per-stage 3,3,2)"
        )
    return (n_layers // n_stages,) * n_stages


@dataclasses.dataclass(frozen=True)
class GPTPieces:
    """Pure functions of parameter dicts for the pieces of a GPT a pipeline stage runs.

    ``shared`` holds the embeddings, final norm and head (every rank keeps a copy: the first and last
    stages use them); ``block`` parameters are per layer. Each piece runs the model's own Flax module
    (``nnx.merge`` of its graph definition with the given parameters), so the math is the model's.
    """

    config: GPTConfig
    graphdefs: dict = dataclasses.field(repr=False, compare=False)

    @classmethod
    def create(cls, config: GPTConfig) -> GPTPieces:
        abstract = nnx.eval_shape(lambda: GPT(dataclasses.replace(config, n_layers=1), rngs=nnx.Rngs(0)))
        names = ["wte", "wpe", "ln_f"] + ([] if config.tied_head else ["head"])
        graphdefs = {name: nnx.split(getattr(abstract, name))[0] for name in names}
        graphdefs["block"] = nnx.split(abstract.blocks[0])[0]
        return cls(config, graphdefs)

    def _module(self, name: str, params: dict):
        return nnx.merge(self.graphdefs[name], params)

    def embed(self, shared: dict, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[-1]
        return self._module("wte", shared["wte"])(tokens) + self._module("wpe", shared["wpe"])(jnp.arange(seq))

    def block(self, block_params: dict, x: jax.Array) -> jax.Array:
        return self._module("block", block_params)(x)

    def logits(self, shared: dict, x: jax.Array) -> jax.Array:
        h = self._module("ln_f", shared["ln_f"])(x)
        if self.config.tied_head:
            logits = self._module("wte", shared["wte"]).attend(h)
        else:
            logits = self._module("head", shared["head"])(h)
        return checkpoint_name(logits, "logits")

    def head_loss(self, shared: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(self.logits(shared, x), targets)

    def stage_forward(self, first: bool, last: bool, layers: int, skip: tuple[int, ...] = ()) -> Callable:
        """``fn(stage_params, shared, x, tokens, targets)``: embedding if first, ``layers`` blocks
        (except the local indices in ``skip``: layer drop), head + loss if last. ``stage_params``
        leaves have a leading layer axis (at least ``layers``)."""
        block = self.block

        def fn(stage_params, shared, x, tokens, targets):
            if first:
                x = self.embed(shared, tokens)
            for i in range(layers):
                if i in skip:
                    continue
                x = block(jax.tree.map(lambda a, i=i: a[i], stage_params), x)
            if last:
                return self.head_loss(shared, x, targets)
            return x

        return fn

    @staticmethod
    def split_model_params(params: dict) -> tuple[list[dict], dict]:
        """Model parameter dict -> (per-layer block dicts, shared dict)."""
        blocks = [params["blocks"][i] for i in sorted(params["blocks"])]
        shared = {k: v for k, v in params.items() if k != "blocks"}
        return blocks, shared

    @staticmethod
    def join_model_params(blocks: Sequence[dict], shared: dict) -> dict:
        return {**shared, "blocks": dict(enumerate(blocks))}


def _per_rank(stage_to_rank: Sequence[int]) -> list[list[int]]:
    ranks = max(stage_to_rank) + 1
    return [[s for s, r in enumerate(stage_to_rank) if r == rank] for rank in range(ranks)]


def stack_stage_params(
    blocks: Sequence[dict], layer_counts: Sequence[int], stage_to_rank: Sequence[int]
) -> tuple[dict, ...]:
    """Per-layer dicts -> one dict per local stage position ``v``, leaves ``[ranks, max layers, ...]``.

    Entry ``v`` holds, for every rank, the layers of the rank's ``v``-th stage, so sharding its first
    axis over ``pipe`` gives every rank exactly its own stages. Stages with fewer layers than the most
    loaded one are zero-padded (those rows are never read and get zero gradients).
    """
    per_rank = _per_rank(stage_to_rank)
    max_layers = max(max(layer_counts), 1)
    starts = [sum(layer_counts[:s]) for s in range(len(layer_counts))]
    template = blocks[0]

    def stage_stack(s):
        layers = [blocks[starts[s] + i] for i in range(layer_counts[s])]
        pad = max_layers - len(layers)
        parts = [jax.tree.map(lambda *xs: jnp.stack(xs), *layers)] if layers else []
        if pad:
            parts.append(jax.tree.map(lambda a: jnp.zeros((pad,) + a.shape, a.dtype), template))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if len(parts) > 1 else parts[0]

    virtual = len(per_rank[0])
    return tuple(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[stage_stack(stages[v]) for stages in per_rank])
        for v in range(virtual)
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
