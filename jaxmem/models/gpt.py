"""A decoder-only transformer (GPT-2 style) in Flax NNX, with ``checkpoint_name`` tags on the activations
a memory policy may keep, recompute or offload. The model holds no policy: policies wrap its stage
functions. :func:`gpt` makes it a :class:`~jaxmem.models.StagedModel` (with :func:`from_nnx`, as a user
would), carrying the closed-form figures the ledger's fast path uses."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem._errors import JaxmemError
from jaxmem.models._context import causal_mask, context_kv, context_positions
from jaxmem.models._interface import (
    StagedModel,
    VocabParallel,
    check_config,
    from_nnx,
    fused_attention,
    named_softmax,
    token_loss,
)
from jaxmem.policy import TagSet

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_FUSED_TAGS",
    "GPT_TAGS",
    "HEAD_TAGS",
    "PRESETS",
    "TAGS",
    "Block",
    "cross_entropy",
    "gpt",
]

# Named activations of one block, in the order the forward produces them.
TAGS = (
    "attn_in",  # layer-normed block input, fed to the q/k/v projection
    "q",
    "k",
    "v",
    "attn_probs",  # softmax(q k^T): heads x seq x seq per sequence, the largest per-token-quadratic tensor
    "attn_ctx",  # probs @ v, fed to the output projection
    "attn_out",  # attention output after its projection
    "mlp_in",  # layer-normed residual stream, fed to the MLP
    "mlp_pre",  # MLP pre-activation (input of the GELU)
    "mlp_hidden",  # MLP hidden activation (4x wider than the model)
    "block_out",  # the block's output (the residual stream)
)
HEAD_TAGS = ("logits",)  # the last stage's output projection, before the softmax
GPT_TAGS = TagSet(TAGS + HEAD_TAGS, groups=(("quadratic", ("attn_probs",)),))
# With fused attention no s x s tensor exists to keep: nothing per-token-quadratic is tagged.
GPT_FUSED_TAGS = TagSet(tuple(t for t in TAGS if t != "attn_probs") + HEAD_TAGS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT.

    Attributes:
        vocab_size: tokens in the vocabulary (256 for the byte-level default corpus).
        max_seq_len: longest sequence (size of the position embedding).
        d_model: width of the residual stream.
        n_heads: attention heads; must divide ``d_model``.
        n_layers: transformer blocks.
        d_ff: MLP hidden width; ``4 * d_model`` when 0.
        tied_head: reuse the token embedding as the output projection (as GPT-2 does).
        norm_eps: LayerNorm epsilon (Flax's default; GPT-2's released weights were trained with 1e-5).
        dtype: compute dtype of activations (``bfloat16`` for mixed precision).
        param_dtype: dtype of the parameters, their gradients and the optimizer state (the master
            weights; ``float32`` by default whatever the compute dtype).
        attention: ``materialized`` (the probabilities are a tagged tensor, ``attn_probs``) or ``fused``
            (:func:`~jaxmem.models.fused_attention`: no s x s tensor kept for the backward).
    """

    vocab_size: int = 256
    max_seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 8
    d_ff: int = 0
    tied_head: bool = False
    norm_eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "materialized"

    def __post_init__(self):
        check_config(self, ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_layers"))
        if self.d_model % self.n_heads:
            raise JaxmemError(f"GPTConfig: n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def param_count(self) -> int:
        d, f, v = self.d_model, self.d_ff, self.vocab_size
        block = 2 * 2 * d + d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d
        head = 0 if self.tied_head else d * v
        return v * d + self.max_seq_len * d + self.n_layers * block + 2 * d + head


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "gpt2-small": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=768, n_heads=12, n_layers=12, tied_head=True),
    "gpt2-medium": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=1024, n_heads=16, n_layers=24, tied_head=True),
    "gpt2-xl": GPTConfig(vocab_size=50257, max_seq_len=1024, d_model=1600, n_heads=25, n_layers=48, tied_head=True),
}


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d, f = config.d_model, config.d_ff
        kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype), "rngs": rngs}
        init = nnx.initializers.normal(0.02)
        proj_init = nnx.initializers.normal(0.02 / math.sqrt(2 * config.n_layers))
        self.n_heads, self.fused = config.n_heads, config.attention == "fused"
        self.ln1 = nnx.LayerNorm(d, epsilon=config.norm_eps, **kw)
        # A tensor axis cuts the MLP Megatron's way (columns of fc, rows of out). The fused qkv is
        # kept whole: its [q | k | v] column order would cut across heads, not between them.
        # Annotations only (eager_sharding=False): the module still builds outside a mesh.
        part, zeros = functools.partial(nnx.with_partitioning, eager_sharding=False), nnx.initializers.zeros_init()
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=init, **kw)
        self.proj = nnx.Linear(d, d, kernel_init=proj_init, **kw)
        self.ln2 = nnx.LayerNorm(d, epsilon=config.norm_eps, **kw)
        self.fc = nnx.Linear(d, f, kernel_init=part(init, (None, "mlp")), bias_init=part(zeros, ("mlp",)), **kw)
        self.out = nnx.Linear(f, d, kernel_init=part(proj_init, ("mlp", None)), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        heads = self.n_heads
        h = checkpoint_name(self.ln1(x), "attn_in")
        q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
        q = checkpoint_name(q.reshape(batch, seq, heads, d // heads), "q")
        k = checkpoint_name(k.reshape(batch, seq, heads, d // heads), "k")
        v = checkpoint_name(v.reshape(batch, seq, heads, d // heads), "v")
        if self.fused:
            attended = checkpoint_name(fused_attention(q, k, v).reshape(batch, seq, d), "attn_ctx")
        else:
            k, v = context_kv(k, v)  # every device's keys and values on a context axis (else as they are)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
            causal = causal_mask(seq, k.shape[1])
            scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
            # Softmax in float32; its backward reads the tagged probabilities (saved or recomputed by policy).
            probs = named_softmax(scores, "attn_probs")
            attended = checkpoint_name(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, d), "attn_ctx")
        x = x + checkpoint_name(self.proj(attended), "attn_out")
        h = checkpoint_name(self.ln2(x), "mlp_in")
        pre = checkpoint_name(self.fc(h), "mlp_pre")
        hidden = checkpoint_name(jax.nn.gelu(pre), "mlp_hidden")
        return checkpoint_name(x + self.out(hidden), "block_out")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over all positions."""
    loss_sum, weight = token_loss(logits, {"targets": targets})
    return loss_sum / weight


class GPT(nnx.Module):
    """Decoder-only transformer: token + position embedding, ``n_layers`` blocks, final norm, head.

    >>> model = GPT(GPTConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((3, 16), jnp.int32)
    >>> model(tokens).shape
    (3, 16, 256)
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype), "rngs": rngs}
        init = nnx.initializers.normal(0.02)
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, config.d_model, embedding_init=init, **kw)
        self.wpe = nnx.Embed(config.max_seq_len, config.d_model, embedding_init=nnx.initializers.normal(0.01), **kw)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.ln_f = nnx.LayerNorm(config.d_model, epsilon=config.norm_eps, **kw)
        if not config.tied_head:
            self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, kernel_init=init, **kw)

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        seq = tokens.shape[-1]
        if seq > self.config.max_seq_len:
            raise JaxmemError(f"sequence length {seq} exceeds the model's max_seq_len {self.config.max_seq_len}")
        return self.wte(tokens) + self.wpe(context_positions(seq) if positions is None else positions)

    def logits(self, x: jax.Array) -> jax.Array:
        h = self.ln_f(x)
        logits = self.wte.attend(h) if self.config.tied_head else self.head(h)
        return checkpoint_name(logits, "logits")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def loss(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return cross_entropy(self(tokens), targets)


def gpt(config: GPTConfig, name: str = "gpt") -> StagedModel:
    """The GPT as a :class:`~jaxmem.models.StagedModel`: built with :func:`from_nnx` like any user
    model, plus its closed-form figures (``analytic``) for the ledger's fast path.

    >>> from jaxmem.models import get_config
    >>> model = gpt(get_config("tiny"), "tiny")
    >>> model.n_layers, model.tags.group("quadratic")
    (8, frozenset({'attn_probs'}))
    """

    def embed(module, batch):
        return module.embed(batch["tokens"], batch.get("positions"))

    def head_loss(module, x, batch):
        return token_loss(module.logits(x), batch)

    def embed_rows(module, rows, batch):  # the prologue after the token lookup: add position embeddings
        positions = batch.get("positions")
        return rows + module.wpe(context_positions(rows.shape[1]) if positions is None else positions)

    vocab = VocabParallel(
        table="wte.embedding",
        head=None if config.tied_head else "head.kernel",
        embed=embed_rows,
        hidden=lambda module, x, batch: module.ln_f(x),
        dtype=config.dtype,
    )

    def loss(module, batch):
        x = module.embed(batch["tokens"], batch.get("positions"))
        for block in module.blocks:
            x = block(x)
        loss_sum, weight = token_loss(module.logits(x), batch)
        return loss_sum / weight

    return from_nnx(
        lambda rngs: GPT(config, rngs=rngs),
        layers="blocks",
        embed=embed,
        head_loss=head_loss,
        tags=GPT_FUSED_TAGS if config.attention == "fused" else GPT_TAGS,
        loss=loss,
        name=name,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        config=config,
        analytic=None if config.attention == "fused" else config,  # the closed form is of materialized attention
        logits=lambda module, batch: module(batch["tokens"]),
        vocab=vocab,
    )
