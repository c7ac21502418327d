"""The vocabulary split over the pipeline ranks: the token embedding's rows and the head's columns cut
into ``P`` slices, one per rank, instead of whole on every rank.

Our design after the principle of vocabulary parallelism in pipelines (Yeung et al., "Balancing
Pipeline Parallelism with Vocabulary Parallelism", 2024: partition the vocabulary layers evenly over
the pipeline devices and compute them with every device at once); the exact passes are our own. In
the executor's tick loop:

- when the first stage runs a microbatch's forward, every rank looks the microbatch's tokens up in
  its slice (zeros for tokens it does not hold) and a sum over ``pipe`` assembles the rows, which the
  first stage starts from;
- when the first stage has the rows' gradient (its B or I), a sum over ``pipe`` hands it to every
  rank, which adds it into its slice's gradient;
- when the last stage's forward has the head's input ``h``, a sum over ``pipe`` hands it to every
  rank, which takes the logits of its slice; the softmax cross-entropy is assembled from each
  slice's maximum, sum of exponentials and target logit (a max and two sums over ``pipe``), and
  its gradient is taken at once: each rank adds its slice's projection gradient, and the sum of the
  slices' input gradients -- ``dL/dh`` -- waits in the last stage's gradient buffer for its backward.

Per device the tables take ``1/P`` of their bytes (their gradients and optimizer state too), and the
head's logits are never stashed: each tick holds one ``[microbatch, seq, vocab / P]`` slice of them.
The vocabulary is padded to a multiple of ``P`` (padded rows are zero and never looked up; padded
columns are masked out of the softmax).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxmem._util import tree_get as _get
from jaxmem._util import tree_with as _with
from jaxmem._util import tree_without as _without

__all__ = ["join_vocab", "split_vocab", "vocab_rows", "with_vocab_placeholders"]

_MASKED = -1e30  # a padded column's logit: exp(-1e30 - max) is 0, and no inf - inf arises


def vocab_rows(vocab_size: int, ranks: int) -> int:
    """Rows of the vocabulary each rank holds (the vocabulary padded to a multiple of ``ranks``)."""
    return math.ceil(vocab_size / ranks)


def split_vocab(shared: Mapping, spec, ranks: int, xp=jnp) -> tuple[dict, dict]:
    """``(shared without the tables, {"table": [P, V/P, d], "head": [P, V/P, d]})``: the head's
    ``[d, V]`` projection is kept transposed, as rows of the vocabulary like the table's. ``xp``:
    ``jax.numpy``, or ``numpy`` to split host arrays on the host."""
    rest, vocab = dict(shared), {}
    for name, path in spec.paths().items():
        value = _get(shared, path)
        rows = value if name == "table" else value.T
        per_rank = vocab_rows(rows.shape[0], ranks)
        pad = per_rank * ranks - rows.shape[0]
        if pad:
            rows = xp.concatenate([rows, xp.zeros((pad, rows.shape[1]), rows.dtype)])
        vocab[name] = rows.reshape(ranks, per_rank, rows.shape[1])
        rest = _without(rest, path)
    return rest, vocab


def join_vocab(rest: Mapping, vocab: Mapping, spec, vocab_size: int) -> dict:
    """The inverse of :func:`split_vocab`."""
    shared = dict(rest)
    for name, path in spec.paths().items():
        rows = vocab[name].reshape(-1, vocab[name].shape[-1])[:vocab_size]
        shared = _with(shared, path, rows if name == "table" else rows.T)
    return shared


def with_vocab_placeholders(rest: Mapping, spec, full: Mapping) -> dict:
    """``rest`` with zeros where the tables were (shapes from ``full``, the whole shared tree): what a
    model's own functions take; the stage functions of a split vocabulary never read them, so XLA
    drops them."""
    shared = dict(rest)
    for path in spec.paths().values():
        like = _get(full, path)
        shared = _with(shared, path, jnp.zeros(like.shape, like.dtype))
    return shared


def lookup(table, tokens, offset, dtype):
    """This rank's part of ``table[tokens]``: its rows where it holds the token, zeros elsewhere."""
    local = tokens - offset
    held = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table.astype(dtype), jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return jnp.where(held[..., None], rows, jnp.zeros((), rows.dtype))


def head_slice(head, h, offset, vocab_size: int, dtype, softcap):
    """This rank's slice of the logits, float32, padded columns masked."""
    logits = jnp.einsum("...d,vd->...v", h.astype(dtype), head.astype(dtype)).astype(jnp.float32)
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    ids = offset + jnp.arange(head.shape[0])
    return jnp.where(ids < vocab_size, logits, _MASKED)


def cross_entropy_parts(logits, targets, offset, mask, gather):
    """Per-token softmax cross-entropy of logits cut over ``pipe``, and its gradient w.r.t. this rank's
    logits for the cotangent ``mask`` of each token's loss: ``(loss [.., seq], dlogits)``.

    ``gather``: ``x -> [ranks, *x.shape]``, every rank's ``x``. Each rank reduces its own slice to a
    log-sum-exp (shifted by its own maximum, so it is stable) and its target's logit (0 where another
    rank holds the target), and ONE gather of the two gives every rank the whole vocabulary's: the
    global log-sum-exp of the ranks' log-sum-exps, and the target logit summed. (A maximum, a sum of
    exponentials and a sum of the targets over the ranks took three collectives in a row, each a
    barrier of every rank in the tick that reaches the head.)"""
    local = targets - offset
    held = (local >= 0) & (local < logits.shape[-1])
    index = jnp.clip(local, 0, logits.shape[-1] - 1)
    picked = jnp.where(held, jnp.take_along_axis(logits, index[..., None], axis=-1)[..., 0], 0.0)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    exps = jnp.exp(logits - top[..., None])
    parts = gather(jnp.stack([top + jnp.log(jnp.sum(exps, axis=-1)), picked]))
    lse = jax.nn.logsumexp(parts[:, 0], axis=0)
    loss = lse - jnp.sum(parts[:, 1], axis=0)
    onehot = jax.nn.one_hot(index, logits.shape[-1], dtype=logits.dtype) * held[..., None]
    dlogits = mask[..., None] * (exps * jnp.exp(top - lse)[..., None] - onehot)
    return loss, dlogits
