"""Sampling text from a model: one full forward per new token over a fixed window (no KV cache), so
one compile serves any prompt; meant for checking what a small trained model learned."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem._errors import JaxmemError

__all__ = ["sample"]


def sample(
    model,
    params,
    prompt: Sequence[int],
    *,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    window: int | None = None,
) -> list[int]:
    """Continue ``prompt`` (token ids) by ``max_new_tokens`` ids drawn from ``model``.

    Each new id is drawn from the softmax of the last position's logits divided by ``temperature``
    (0: the most likely id), keeping the ``top_k`` most likely when given. The model sees the last
    ``window`` ids (default its ``max_seq_len``).

    Args:
        model: a :class:`~jaxmem.models.StagedModel` with ``logits``.
        params: its parameters (the model's own layout, e.g. from ``jaxmem.train.load_exported``).
        prompt: at least one id.
    """
    if model.logits is None:
        raise JaxmemError(
            f"model {model.name!r} has no logits function to sample from; build it with from_nnx(..., logits=...)"
        )
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise JaxmemError("the prompt is empty; give at least one token (e.g. a newline)")
    vocab = model.vocab_size
    if vocab is not None and max(prompt) >= vocab:
        raise JaxmemError(f"prompt id {max(prompt)} is outside the model's vocabulary of {vocab}")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise JaxmemError(f"temperature must be >= 0 and top_k >= 1; got {temperature}, {top_k}")
    window = window or model.max_seq_len or len(prompt) + max_new_tokens
    window = min(window, len(prompt) + max_new_tokens)
    step = _step_fn(model, window, float(temperature), top_k)
    ids = list(prompt)
    key = jax.random.key(seed)
    for i in range(max_new_tokens):
        context = ids[-window:]
        buffer = np.zeros((1, window), np.int32)
        buffer[0, : len(context)] = context
        token = step(params, jnp.asarray(buffer), len(context) - 1, jax.random.fold_in(key, i))
        ids.append(int(token))
    return ids[len(prompt) :]


@functools.lru_cache(maxsize=8)
def _step_fn(model, window: int, temperature: float, top_k: int | None):
    def step(params, tokens, last, key):
        logits = model.logits(params, {"tokens": tokens, "targets": tokens})[0, last].astype(jnp.float32)
        if temperature == 0:
            return jnp.argmax(logits)
        if top_k is not None and top_k < logits.shape[-1]:
            cut = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < cut, -jnp.inf, logits)
        return jax.random.categorical(key, logits / temperature)

    return jax.jit(step)
