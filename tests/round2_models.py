"""Models written as a user writes them in Flax NNX, outside the library, and handed to jaxmem through
its public API (``from_nnx``) -- the second round of users' models (dropout, scans, state, batches of
their own). Importable from the command line as ``round2_models:<name>`` (``tests`` on the path).

Used by ``tests/test_user_models.py`` and ``benchmarks/ledger_recompute_layers.py``; not part of the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem.models import from_nnx, token_loss

VOCAB = 256  # bytes: the embedded text corpus
D = 16
HEADS = 2


def _causal_probs(q, k):
    """Causal attention probabilities ``[b, h, q, k]`` of ``[b, s, h, e]`` queries and keys, named
    ``probs`` for the policies."""
    s = q.shape[1]
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    return checkpoint_name(jax.nn.softmax(scores, -1), "probs")


# ---------------------------------------------------------------- a GPT with dropout everywhere
class DropAttention(nnx.Module):
    def __init__(self, rngs):
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.attn_drop = nnx.Dropout(0.1)
        self.out_drop = nnx.Dropout(0.1)

    def __call__(self, x, rngs):
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * HEADS, D // HEADS), 3, axis=2)
        probs = self.attn_drop(_causal_probs(q, k), rngs=rngs)
        out = jnp.einsum("bhqk,bkhe->bqhe", probs, v).reshape(b, s, D)
        return self.out_drop(self.proj(out), rngs=rngs)


class DropBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = DropAttention(rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)
        self.mlp_drop = nnx.Dropout(0.1)

    def __call__(self, x, rngs):
        x = x + self.attn(self.ln1(x), rngs)
        h = checkpoint_name(jax.nn.gelu(self.up(self.ln2(x))), "hidden")
        return x + self.mlp_drop(self.down(h), rngs=rngs)


class DropGPT(nnx.Module):
    def __init__(self, rngs, layers=4):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Embed(64, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.blocks = nnx.List([DropBlock(rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def _drop_embed(m, batch):
    tokens = batch["tokens"]
    x = m.tok(tokens) + m.pos(jnp.arange(tokens.shape[1]))[None]
    return m.drop(x, rngs=batch["rng"])


def dropout_gpt_of(layers: int = 4):
    return from_nnx(
        lambda rngs: DropGPT(rngs, layers),
        layers="blocks",
        embed=_drop_embed,
        call_layer=lambda block, x, batch: block(x, batch["rng"]),
        head_loss=lambda m, x, batch: token_loss(m.head(m.ln(x)), batch),
        tags=("probs", "hidden"),
        name="user-gpt-dropout",
        vocab_size=VOCAB,
        max_seq_len=64,
        rng=True,
    )


dropout_gpt = dropout_gpt_of(4)


# ---------------------------------------------------------------- a minGRU: a lax.scan per layer, carry from zeros
class MinGRU(nnx.Module):
    """h_t = (1 - z_t) h_{t-1} + z_t h~_t over the sequence, by ``lax.scan`` from ``h_0 = 0`` (a constant,
    as a user writes it: ``jnp.zeros``, not ``zeros_like`` of an input)."""

    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, D, rngs=rngs)
        self.cand = nnx.Linear(D, D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        u = self.norm(x)
        z = jax.nn.sigmoid(self.gate(u))
        cand = checkpoint_name(self.cand(u), "hidden")

        def step(h, inputs):
            z_t, c_t = inputs
            h = (1 - z_t) * h + z_t * c_t
            return h, h

        h0 = jnp.zeros((x.shape[0], D), x.dtype)
        _, hs = jax.lax.scan(step, h0, (jnp.swapaxes(z, 0, 1), jnp.swapaxes(cand, 0, 1)))
        return x + self.out(jnp.swapaxes(hs, 0, 1))


class MinGRULM(nnx.Module):
    def __init__(self, rngs, layers=4):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([MinGRU(rngs) for _ in range(layers)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def mingru_of(layers: int = 4):
    return from_nnx(
        lambda rngs: MinGRULM(rngs, layers),
        layers="blocks",
        embed=lambda m, batch: m.tok(batch["tokens"]),
        head_loss=lambda m, x, batch: token_loss(m.head(x), batch),
        tags=("hidden",),
        name="user-mingru",
        vocab_size=VOCAB,
        max_seq_len=64,
    )


mingru = mingru_of(4)


# ---------------------------------------------------------------- an encoder that classifies: a batch of its own
LABELS = 10
FEATURES = 8


class EncoderBlock(nnx.Module):
    """Bidirectional self-attention (no mask) and an MLP."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.mix = nnx.Linear(D, D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
        probs = checkpoint_name(jax.nn.softmax(q @ jnp.swapaxes(k, 1, 2) / jnp.sqrt(D), -1), "probs")
        x = x + self.mix(probs @ v)
        return x + self.down(checkpoint_name(jax.nn.relu(self.up(x)), "hidden"))


class Encoder(nnx.Module):
    def __init__(self, rngs, layers=4):
        self.inp = nnx.Linear(FEATURES, D, rngs=rngs)
        self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(layers)])
        self.cls = nnx.Linear(D, LABELS, rngs=rngs)


def _classify(m, x, batch):
    logp = jax.nn.log_softmax(m.cls(x.mean(axis=1)).astype(jnp.float32), -1)
    picked = jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1)[:, 0]
    return -jnp.sum(picked), jnp.asarray(picked.size, jnp.float32)


def encoder_of(layers: int = 4):
    return from_nnx(
        lambda rngs: Encoder(rngs, layers),
        layers="blocks",
        embed=lambda m, batch: m.inp(batch["features"]),
        head_loss=_classify,
        tags=("probs", "hidden"),
        name="user-encoder",
        max_seq_len=64,
        batch_spec=lambda batch, seq: {
            "features": jax.ShapeDtypeStruct((batch, seq, FEATURES), jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch,), jnp.int32),
        },
    )


encoder = encoder_of(4)


# ---------------------------------------------------------------- a decoder whose MLP widens with depth
class WideningBlock(nnx.Module):
    """Causal attention and an MLP ``width`` wide (a SwiGLU): each pair of layers twice the last's."""

    def __init__(self, rngs, width: int):
        self.ln1 = nnx.RMSNorm(D, rngs=rngs)
        self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.ln2 = nnx.RMSNorm(D, rngs=rngs)
        self.gate = nnx.Linear(D, width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(width, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, s, 3 * HEADS, D // HEADS), 3, axis=2)
        probs = _causal_probs(q, k)
        x = x + self.proj(jnp.einsum("bhqk,bkhe->bqhe", probs, v).reshape(b, s, D))
        u = self.ln2(x)
        h = checkpoint_name(jax.nn.silu(self.gate(u)) * self.up(u), "hidden")
        return x + self.down(h)


class WideningLM(nnx.Module):
    def __init__(self, rngs, layers=4):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([WideningBlock(rngs, 2 * D * 2 ** (i // 2)) for i in range(layers)])
        self.ln = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)


def widening_of(layers: int = 4):
    return from_nnx(
        lambda rngs: WideningLM(rngs, layers),
        layers="blocks",
        embed=lambda m, batch: m.tok(batch["tokens"]),
        head_loss=lambda m, x, batch: token_loss(m.head(m.ln(x)), batch),
        tags=("probs", "hidden"),
        name="user-widening",
        vocab_size=VOCAB,
        max_seq_len=64,
    )


widening = widening_of(4)

USER_FAMILIES = {"dropout-gpt": dropout_gpt_of, "mingru": mingru_of, "encoder": encoder_of, "widening": widening_of}


# ---------------------------------------------------------------- state that is not a parameter
class BufferBlock(nnx.Module):
    """A constant buffer (an ``nnx.Variable``), a plain array attribute and a BatchNorm."""

    def __init__(self, rngs, running: bool):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.table = nnx.Variable(jnp.linspace(0.5, 1.5, D))
        self.scale = jnp.full((D,), 0.9)
        self.norm = nnx.BatchNorm(D, use_running_average=running, rngs=rngs)

    def __call__(self, x):
        return x + self.norm(jnp.tanh(checkpoint_name(self.lin(x), "hidden")) * self.table[...] * self.scale)


class BufferLM(nnx.Module):
    def __init__(self, rngs, running: bool):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([BufferBlock(rngs, running) for _ in range(4)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def buffers(running: bool = True):
    """With ``running`` (BatchNorm's statistics fixed) they are read, never written; without,
    BatchNorm writes them in every forward, and the step carries them to the next."""
    return from_nnx(
        lambda rngs: BufferLM(rngs, running),
        layers="blocks",
        embed=lambda m, batch: m.tok(batch["tokens"]),
        head_loss=lambda m, x, batch: token_loss(m.head(x), batch),
        tags=("hidden",),
        name="user-buffers",
        vocab_size=VOCAB,
        max_seq_len=64,
    )


batchnorm = buffers(running=False)  # for the command line: round2_models:batchnorm


class CountingBlock(nnx.Module):
    """A layer that counts its calls in a plain ``nnx.Variable``: state no step can carry."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros(()))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return x + jnp.tanh(self.lin(x))


class CountingLM(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([CountingBlock(rngs) for _ in range(4)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


class NormedHeadLM(nnx.Module):
    """BatchNorm outside the repeated layers, before the head."""

    def __init__(self, rngs):
        self.tok = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(4)])
        self.norm = nnx.BatchNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)


def lm_of(factory, name: str, head=lambda m, x: m.head(x)):
    return from_nnx(
        factory,
        layers="blocks",
        embed=lambda m, batch: m.tok(batch["tokens"]),
        head_loss=lambda m, x, batch: token_loss(head(m, x), batch),
        tags=(),
        name=name,
        vocab_size=VOCAB,
        max_seq_len=64,
    )
