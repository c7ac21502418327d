"""The GPT's closed-form figures: residuals and matmul FLOPs of a stage from the config and the policy,
without tracing -- the fast path of :mod:`jaxmem.memory._facts` for jaxmem's own GPT.

For a GPT block we write down, per named activation, its size, what it is computed from, and which
values the backward needs directly (weight gradients need the matmul inputs, layer norms their
inputs, softmax its output, GELU its input). Under a name-based ``jax.checkpoint`` policy a needed
value is kept if its tag is saved (or offloaded), and otherwise recomputed from the values it is
computed from, recursively, down to saved values or the stage input. That is how JAX's remat chooses
residuals; the residual sets derived here equal the traced ones for every preset and random policies
(a test checks it). FLOPs count the matmuls only; ``cost_analysis()`` of the traced stage also counts
elementwise work (5% more on the tiny model, a test bounds the gap).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem.policy import BoundStagePolicy

__all__ = ["forward_flops", "stage_counts", "stage_residual_bytes"]

# value -> (what it is computed from). "in" is the layer input.
_BLOCK_DEPS = {
    "attn_in": ("in",),
    "q": ("attn_in",),
    "k": ("attn_in",),
    "v": ("attn_in",),
    "attn_probs": ("q", "k"),
    "attn_ctx": ("attn_probs", "v"),
    "attn_out": ("attn_ctx",),
    "mid": ("in", "attn_out"),  # residual stream after attention (untagged)
    "mlp_in": ("mid",),
    "mlp_pre": ("mlp_in",),
    "mlp_hidden": ("mlp_pre",),
    "block_out": ("mid", "mlp_hidden"),
}
# Values the block's backward reads directly.
_BLOCK_NEEDS = ("in", "attn_in", "q", "k", "v", "attn_probs", "attn_ctx", "mid", "mlp_in", "mlp_pre", "mlp_hidden")


def _block_sizes(d: int, f: int, heads: int, seq: int) -> dict[str, int]:
    """Elements per sequence of every block value."""
    td = seq * d
    return {
        "in": td,
        "attn_in": td,
        "q": td,
        "k": td,
        "v": td,
        "attn_probs": heads * seq * seq,
        "attn_ctx": td,
        "attn_out": td,
        "mid": td,
        "mlp_in": td,
        "mlp_pre": seq * f,
        "mlp_hidden": seq * f,
        "block_out": td,
    }


@dataclasses.dataclass(frozen=True)
class ResidualCount:
    """Per sequence: elements a stage keeps from F to B (split by where they live), and the matmul
    FLOPs its backward spends recomputing what it did not keep."""

    device: int = 0
    host: int = 0
    stage_input: int = 0  # the stage input (always kept unless it is the token ids)
    recompute_flops: int = 0


def _resolve(kept: set, recomputed: set, needed, deps, is_kept) -> None:
    """Add to ``kept`` the values the backward reads, and to ``recomputed`` those it must recompute."""
    stack = list(needed)
    seen = set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if is_kept(value):
            kept.add(value)
        else:
            recomputed.add(value)
            stack.extend(deps(value))


def _op_flops(name: str, d: int, f: int, seq: int, vocab: int) -> int:
    """Matmul FLOPs per sequence of the op producing a value (elementwise ops are counted as free)."""
    return {
        "qkv": 6 * seq * d * d,
        "attn_probs": 2 * seq * seq * d,
        "attn_ctx": 2 * seq * seq * d,
        "attn_out": 2 * seq * d * d,
        "mlp_pre": 2 * seq * d * f,
        "block_out": 2 * seq * f * d,
        "logits": 2 * seq * d * vocab,
    }.get(name, 0)


def forward_flops(config, *, layers: int, last: bool, seq: int) -> int:
    """Matmul FLOPs per sequence of a stage's forward (backward: twice that, half input-, half weight-gradient)."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    block = 8 * seq * d * d + 4 * seq * seq * d + 4 * seq * d * f
    return layers * block + (2 * seq * d * v if last else 0)


def stage_residual_elements(
    *,
    layers: int,
    first: bool,
    last: bool,
    d: int,
    f: int,
    heads: int,
    seq: int,
    vocab: int,
    policy: BoundStagePolicy,
    split_vocab: bool = False,
) -> ResidualCount:
    """Elements per sequence a stage stashes (device and host) under ``policy``; with ``split_vocab``
    (the vocabulary split over the ranks) the first stage keeps its looked-up rows as a middle stage
    keeps its input, and the last ends with the final norm (the projection runs outside it)."""
    sizes = _block_sizes(d, f, heads, seq)
    keep_tags = policy.save | policy.offload

    # Value names carry their layer: ("q", 3). The layer input of layer l > 0 is block_out of l - 1.
    def canonical(value):
        name, layer = value
        if name == "in" and layer > 0:
            return ("block_out", layer - 1)
        return value

    def deps(value):
        name, layer = value
        if name == "x_final":
            return [canonical(("in", layers))] if layers else [("stage_input", 0)]
        if name == "h":
            return [("x_final", 0)]
        if name == "logits":
            return [("h", 0)]
        if name == "in":
            return [("stage_input", 0)]
        if name == "stage_input":
            return []
        return [canonical((dep, layer)) for dep in _BLOCK_DEPS[name]]

    def is_kept(value):
        name, _ = value
        if name == "stage_input":
            # The first stage recomputes its input from token ids and the embedding (unless the
            # vocabulary is split: then its input is the looked-up rows, kept like any stage's).
            return not first or split_vocab
        if name in ("mid", "h", "x_final"):
            return False
        if name == "in":
            return False  # layer 0's input is the stage input (a dependency), never a separate value
        return name in keep_tags

    needed = [canonical((n, layer)) for layer in range(layers) for n in _BLOCK_NEEDS]
    if last:
        needed += [("x_final", 0)] if split_vocab else [("x_final", 0), ("h", 0), ("logits", 0)]
    kept: set = set()
    recomputed: set = set()
    _resolve(kept, recomputed, needed, deps, is_kept)
    ops = {("qkv", layer) if name in ("q", "k", "v") else (name, layer) for name, layer in recomputed}
    flops = sum(_op_flops(name, d, f, seq, vocab) for name, _ in ops)
    device = host = stage_input = 0
    for name, _ in kept:
        if name == "stage_input":
            stage_input += seq * d
            continue
        count = seq * vocab if name == "logits" else sizes[name]
        if name in policy.offload or policy.offload_stash:
            host += count
        else:
            device += count
    if policy.offload_stash:
        host += stage_input
    else:
        device += stage_input
    return ResidualCount(device=device, host=host, stage_input=stage_input, recompute_flops=flops)


def stage_counts(
    config, *, layers: int, first: bool, last: bool, seq: int, policy: BoundStagePolicy, vocab: bool = False
) -> ResidualCount:
    """:func:`stage_residual_elements` for a model config (``vocab``: split over the ranks)."""
    return stage_residual_elements(
        split_vocab=vocab,
        layers=layers,
        first=first,
        last=last,
        d=config.d_model,
        f=config.d_ff,
        heads=config.n_heads,
        seq=seq,
        vocab=config.vocab_size,
        policy=policy,
    )


def stage_residual_bytes(
    config,
    *,
    layers: int,
    first: bool,
    last: bool,
    microbatch: int,
    seq: int,
    policy: BoundStagePolicy,
    vocab: bool = False,
) -> tuple[int, int]:
    """(device, host) bytes one microbatch of a stage stashes (``vocab``: split over the ranks)."""
    itemsize = np.dtype(config.dtype).itemsize
    count = stage_counts(config, layers=layers, first=first, last=last, seq=seq, policy=policy, vocab=vocab)
    return count.device * microbatch * itemsize, count.host * microbatch * itemsize
