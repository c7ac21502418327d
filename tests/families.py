"""Decoder families the memory ledger was never fitted on, written as a user would write them (Flax
NNX, ``from_nnx``), each unlike the built-in GPT and Llama in what its backward keeps live:

- ``mqa``: multi-query attention (one KV head), GeGLU feed-forward, RMSNorm with ``(1 + w)``, the
  embedding tied to the head and scaled by ``sqrt(d)``, soft-capped logits (Gemma-style);
- ``wide``: an MLP-heavy block, feed-forward 8x the width with a squared-ReLU, no attention;
- ``moe``: attention followed by a top-2-of-4 mixture of experts, dispatched densely (every expert
  runs on every token and the router's weights mix them);
- ``dense-moe``: layers of two parameter structures, DeepSeek-style: the first quarter ``wide``'s
  blocks, the rest attention and a top-2-of-8 mixture of experts;
- ``parallel``: GPT-J-style blocks, attention and MLP side by side from one LayerNorm, rotary
  positions on half the head.

Used by ``tests/test_ledger_families.py`` and ``benchmarks/ledger_fit.py``; not part of the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models import from_nnx, token_loss
from jaxmem.policy import TagSet

VOCAB = 256
D = 32
HEADS = 4


def _causal_attention(q, k, v):
    """``q [b, s, h, e]``, ``k, v [b, s, g, e]`` with ``h`` a multiple of ``g``; the probabilities tagged."""
    b, s, h, e = q.shape
    g = k.shape[2]
    q = q.reshape(b, s, g, h // g, e)
    scores = jnp.einsum("bqgre,bkge->bgrqk", q, k) / jnp.sqrt(e).astype(q.dtype)
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = checkpoint_name(jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1), "probs")
    out = jnp.einsum("bgrqk,bkge->bqgre", probs, v)
    return out.reshape(b, s, h * e)


def _rotate(x, fraction=1.0):
    """Rotary positions on the first ``fraction`` of each head's dimensions."""
    s, e = x.shape[1], x.shape[-1]
    n = int(e * fraction) // 2 * 2
    rot, rest = x[..., :n], x[..., n:]
    freqs = 1.0 / (10000 ** (jnp.arange(0, n, 2) / n))
    angle = jnp.arange(s)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    a, b = rot[..., 0::2], rot[..., 1::2]
    turned = jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(rot.shape)
    return jnp.concatenate([turned, rest], -1)


class _RMSNorm(nnx.Module):
    def __init__(self, d):
        self.w = nnx.Param(jnp.zeros((d,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + self.w)


# ---------------------------------------------------------------- mqa: Gemma-style
class _MQABlock(nnx.Module):
    def __init__(self, rngs):
        e = D // HEADS
        self.norm1, self.norm2 = _RMSNorm(D), _RMSNorm(D)
        self.q = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(D, 2 * e, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(3 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        e = D // HEADS
        h = self.norm1(x)
        q = _rotate(self.q(h).reshape(b, s, HEADS, e))
        k, v = jnp.split(self.kv(h).reshape(b, s, 1, 2 * e), 2, -1)
        x = x + self.o(_causal_attention(q, _rotate(k), v))
        h = self.norm2(x)
        g = checkpoint_name(self.gate(h), "mlp")
        return x + self.down(jax.nn.gelu(g) * self.up(h))


class _MQA(nnx.Module):
    def __init__(self, rngs, layers):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([_MQABlock(rngs) for _ in range(layers)])
        self.norm = _RMSNorm(D)


def _mqa_head(m, x, batch):
    logits = m.norm(x) @ m.embed.embedding[...].T
    return token_loss(30.0 * jnp.tanh(logits / 30.0), batch)


# ---------------------------------------------------------------- wide: MLP-heavy, no attention
class _WideBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 8 * D, rngs=rngs)
        self.down = nnx.Linear(8 * D, D, rngs=rngs)

    def __call__(self, x):
        u = checkpoint_name(self.up(self.norm(x)), "mlp")
        return x + self.down(jnp.square(jax.nn.relu(u)))


class _Wide(nnx.Module):
    def __init__(self, rngs, layers):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([_WideBlock(rngs) for _ in range(layers)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


# ---------------------------------------------------------------- moe: top-2 of 4 experts, dense dispatch
EXPERTS = 4


class _MoEBlock(nnx.Module):
    def __init__(self, rngs, experts=EXPERTS):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.o = nnx.Linear(D, D, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.router = nnx.Linear(D, experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (experts, D, 2 * D)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, 2 * D, D)))

    def __call__(self, x):
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, -1)
        shape = (b, s, HEADS, D // HEADS)
        x = x + self.o(_causal_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape)))
        h = self.norm2(x)
        scores = jax.nn.softmax(self.router(h), -1)
        top, _ = jax.lax.top_k(scores, 2)
        weights = jnp.where(scores >= top[..., -1:], scores, 0.0)
        weights = weights / jnp.sum(weights, -1, keepdims=True)
        inner = checkpoint_name(jax.nn.silu(jnp.einsum("bsd,edf->bsef", h, self.w_in[...])), "mlp")
        out = jnp.einsum("bsef,efd->bsed", inner, self.w_out[...])
        return x + jnp.einsum("bsed,bse->bsd", out, weights)


class _MoE(nnx.Module):
    def __init__(self, rngs, layers):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([_MoEBlock(rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)


# ---------------------------------------------------------------- parallel: GPT-J-style
class _ParallelBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = jnp.split(self.qkv(h), 3, -1)
        shape = (b, s, HEADS, D // HEADS)
        q, k = _rotate(q.reshape(shape), 0.5), _rotate(k.reshape(shape), 0.5)
        attn = self.o(_causal_attention(q, k, v.reshape(shape)))
        mlp = self.down(jax.nn.gelu(checkpoint_name(self.up(h), "mlp")))
        return x + attn + mlp


class _Parallel(nnx.Module):
    def __init__(self, rngs, layers):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([_ParallelBlock(rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def _scaled_embed(m, batch):
    return m.embed(batch["tokens"]) * jnp.sqrt(float(D))


def _embed(m, batch):
    return m.embed(batch["tokens"])


# ---------------------------------------------------------------- dense-moe: DeepSeek-style first dense layers
class _DenseFirst(nnx.Module):
    """The first quarter of the layers dense (``_WideBlock``), the rest attention and a top-2-of-8
    mixture of experts: two parameter families."""

    def __init__(self, rngs, layers, dense=None):
        dense = max(1, layers // 4) if dense is None else dense
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([_WideBlock(rngs) if i < dense else _MoEBlock(rngs, 8) for i in range(layers)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)


_BUILDERS = {
    "mqa": (_MQA, _scaled_embed, _mqa_head, ("probs", "mlp")),
    "wide": (_Wide, _embed, lambda m, x, batch: token_loss(m.head(x), batch), ("mlp",)),
    "moe": (_MoE, _embed, lambda m, x, batch: token_loss(m.head(m.norm(x)), batch), ("probs", "mlp")),
    "dense-moe": (_DenseFirst, _embed, lambda m, x, batch: token_loss(m.head(m.norm(x)), batch), ("probs", "mlp")),
    "parallel": (_Parallel, _embed, lambda m, x, batch: token_loss(m.head(m.norm(x)), batch), ("probs", "mlp")),
}
FAMILIES = tuple(_BUILDERS)


def family(name: str, layers: int = 8):
    """The ``from_nnx`` model of one family (``FAMILIES``)."""
    module, embed, head_loss, tags = _BUILDERS[name]
    groups = {"quadratic": ("probs",)} if "probs" in tags else {}
    return from_nnx(
        lambda rngs: module(rngs, layers),
        layers="blocks",
        embed=embed,
        head_loss=head_loss,
        tags=TagSet(tags, groups) if groups else tags,
        name=f"family-{name}",
        vocab_size=VOCAB,
    )


def ledger_against_compiled(model, schedule: str, policy: str, **axes) -> tuple[float, float, float]:
    """``(predicted, compiled, error)`` device bytes of one train step (batch 32 x 64, M=8; ``axes``:
    ``pipe`` (default 4), ``data_parallel``, ``fsdp``, ``tensor``), from ``jaxmem memory
    --compile yes``'s report; the error is the rank's with the largest ``predicted / compiled - 1`` in
    size."""
    from jaxmem.cli.memory import ledger_report
    from jaxmem.config import TrainConfig

    axes = {"pipe": 4, **axes}
    config = TrainConfig(
        model=model,
        schedule=schedule,
        virtual=2 if schedule == "interleaved-1f1b" else None,
        microbatches=8,
        batch_size=32,
        seq_len=64,
        policy=policy,
        steps=1,
        **axes,
    )
    ranks = ledger_report(config, "yes")["ranks"]
    error = max((r["prediction_error"] for r in ranks), key=abs)
    return max(r["predicted_device_bytes"] for r in ranks), ranks[0]["compiled_device_bytes"], error
