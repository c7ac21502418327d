"""A Llama-style decoder in Flax NNX: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention and an untied head, with ``checkpoint_name`` tags on the activations a policy may keep,
recompute or offload. :func:`llama` makes it a :class:`~jaxmem.models.StagedModel` with
:func:`~jaxmem.models.from_nnx` -- exactly what a user does with their own model; it has no closed-form
fast path, so the ledger and the planners trace its functions.

The architecture follows the published Llama papers (pre-norm blocks, RoPE on q and k, SwiGLU with a
hidden width of about 8/3 of the model, grouped-query attention); the code is our own.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem._errors import JaxmemError
from jaxmem.models._context import causal_mask, context_kv
from jaxmem.models._interface import (
    StagedModel,
    VocabParallel,
    batch_positions,
    check_config,
    from_nnx,
    fused_attention,
    named_softmax,
    token_loss,
)
from jaxmem.policy import TagSet

__all__ = [
    "LLAMA_FUSED_TAGS",
    "LLAMA_TAGS",
    "PRESETS",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "llama",
    "rope",
    "rope_frequencies",
]

LLAMA_TAGS = TagSet(
    (
        "attn_in",  # RMS-normed block input, fed to the q/k/v projections
        "q",  # queries after RoPE
        "k",  # keys after RoPE (n_kv_heads: grouped-query attention)
        "v",
        "attn_probs",  # softmax(q k^T): the per-token-quadratic tensor
        "attn_ctx",  # probs @ v, fed to the output projection
        "attn_out",
        "mlp_in",  # RMS-normed residual stream, fed to the MLP
        "mlp_gate",  # x W_gate (input of the SiLU)
        "mlp_up",  # x W_up
        "mlp_hidden",  # silu(gate) * up, fed to W_down
        "block_out",
        "logits",  # the head's output
    ),
    groups=(("quadratic", ("attn_probs",)),),
)
# With fused attention no s x s tensor exists to keep: nothing per-token-quadratic is tagged.
LLAMA_FUSED_TAGS = TagSet(tuple(t for t in LLAMA_TAGS.names if t != "attn_probs"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a Llama-style model.

    Attributes:
        vocab_size: tokens in the vocabulary.
        max_seq_len: longest sequence trained on.
        d_model: width of the residual stream.
        n_heads: query heads; must divide ``d_model``.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        n_layers: decoder blocks.
        d_ff: SwiGLU hidden width; 0 = 8/3 of ``d_model`` rounded up to a multiple of 16.
        rope_theta: RoPE base frequency.
        rope_scaling: Llama 3.1's RoPE scaling as ``(factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings)``, e.g. ``(8.0, 1.0, 4.0, 8192)``; None is plain RoPE.
        norm_eps: RMSNorm epsilon.
        tied_head: reuse the token embedding as the output projection.
        dtype: compute dtype (``bfloat16`` for mixed precision).
        param_dtype: dtype of the parameters, gradients and optimizer state (master weights).
        attention: ``materialized`` (the probabilities are a tagged tensor, ``attn_probs``) or ``fused``
            (:func:`~jaxmem.models.fused_attention`: no s x s tensor kept for the backward).
    """

    vocab_size: int = 256
    max_seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 8
    d_ff: int = 0
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5
    tied_head: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "materialized"

    def __post_init__(self):
        check_config(self, ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_kv_heads", "n_layers"))
        if self.d_model % self.n_heads:
            raise JaxmemError(f"LlamaConfig: n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.n_heads % self.n_kv_heads:
            raise JaxmemError(f"LlamaConfig: n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise JaxmemError(f"LlamaConfig: the head width ({self.d_model // self.n_heads}) must be even for RoPE")
        if self.d_ff == 0:
            object.__setattr__(self, "d_ff", 16 * math.ceil(8 * self.d_model / 3 / 16))
        if self.rope_scaling is not None:  # a tuple, also when read back from JSON as a list
            try:
                factor, low, high, original = self.rope_scaling
                scaling = (float(factor), float(low), float(high), int(original))
            except (TypeError, ValueError):
                scaling = None
            if scaling is None or not (scaling[0] >= 1 and 0 < scaling[1] < scaling[2] and scaling[3] >= 1):
                raise JaxmemError(
                    "LlamaConfig.rope_scaling is (factor >= 1, low_freq_factor, high_freq_factor > low_freq_factor, "
                    f"original_max_position_embeddings), e.g. (8.0, 1.0, 4.0, 8192); got {self.rope_scaling!r}"
                )
            object.__setattr__(self, "rope_scaling", scaling)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(),
    # Llama 3.2 1B's shape (published config; tied embeddings as released).
    "llama-1b": LlamaConfig(
        vocab_size=128256,
        max_seq_len=8192,
        d_model=2048,
        n_heads=32,
        n_kv_heads=8,
        n_layers=16,
        d_ff=8192,
        rope_theta=500000.0,
        tied_head=True,
    ),
    # Llama 3 8B's shape (published config).
    "llama-8b": LlamaConfig(
        vocab_size=128256,
        max_seq_len=8192,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        n_layers=32,
        d_ff=14336,
        rope_theta=500000.0,
    ),
    # Llama 3 70B's shape (published config).
    "llama-70b": LlamaConfig(
        vocab_size=128256,
        max_seq_len=8192,
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        n_layers=80,
        d_ff=28672,
        rope_theta=500000.0,
    ),
}
# Llama 3.1 8B (published config): Llama 3 8B's shape, its RoPE scaled for 131,072 positions.
PRESETS["llama-3.1-8b"] = dataclasses.replace(
    PRESETS["llama-8b"], max_seq_len=131072, rope_scaling=(8.0, 1.0, 4.0, 8192)
)


def rope_frequencies(half: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """The ``half`` rotation frequencies ``theta^(-i/half)``; with Llama 3.1's ``scaling``
    ``(factor, low, high, original_len)``, those whose wavelength exceeds ``original_len / low`` are
    divided by ``factor``, those under ``original_len / high`` are kept, and those between are
    interpolated linearly in ``original_len / wavelength`` (the published formula, our code).

    >>> [float(f"{f:.4g}") for f in rope_frequencies(4, 10000.0)]
    [1.0, 0.1, 0.01, 0.001]
    """
    freqs = theta ** (-np.arange(half, dtype=np.float64) / half)
    if scaling is None:
        return freqs.astype(np.float32)
    factor, low, high, original = scaling
    wavelength = 2 * np.pi / freqs
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return ((1 - smooth) * freqs / factor + smooth * freqs).astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple | None = None) -> jax.Array:
    """Rotary position embedding of ``x`` ``[batch, seq, heads, head_dim]`` at ``positions``
    ``[batch or 1, seq]`` (rotate-half convention), computed in float32; ``scaling`` as
    :func:`rope_frequencies`."""
    half = x.shape[-1] // 2
    freqs = jnp.asarray(rope_frequencies(half, theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [b, s, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class LlamaBlock(nnx.Module):
    """Pre-norm decoder block: ``x + attn(rmsnorm(x))``, then ``x + swiglu(rmsnorm(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, f, hd = config.d_model, config.d_ff, config.head_dim
        kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype), "rngs": rngs}
        init = nnx.initializers.normal(0.02)
        self.n_heads, self.n_kv_heads, self.rope_theta = config.n_heads, config.n_kv_heads, config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.fused = config.attention == "fused"
        self.attn_norm = nnx.RMSNorm(d, epsilon=config.norm_eps, **kw)
        # Megatron's split for a tensor axis: whole heads and the MLP's hidden units. Annotations
        # only (eager_sharding=False): the module still builds outside a mesh, e.g. from an export.
        part = functools.partial(nnx.with_partitioning, eager_sharding=False)
        cols, rows = part(init, (None, "heads"), tensor_unit=hd), part(init, ("heads", None), tensor_unit=hd)
        kv_cols = part(init, (None, "kv_heads"), tensor_unit=hd)
        self.wq = nnx.Linear(d, config.n_heads * hd, use_bias=False, kernel_init=cols, **kw)
        self.wk = nnx.Linear(d, config.n_kv_heads * hd, use_bias=False, kernel_init=kv_cols, **kw)
        self.wv = nnx.Linear(d, config.n_kv_heads * hd, use_bias=False, kernel_init=kv_cols, **kw)
        self.wo = nnx.Linear(config.n_heads * hd, d, use_bias=False, kernel_init=rows, **kw)
        self.mlp_norm = nnx.RMSNorm(d, epsilon=config.norm_eps, **kw)
        mlp_cols, mlp_rows = part(init, (None, "mlp")), part(init, ("mlp", None))
        self.w_gate = nnx.Linear(d, f, use_bias=False, kernel_init=mlp_cols, **kw)
        self.w_up = nnx.Linear(d, f, use_bias=False, kernel_init=mlp_cols, **kw)
        self.w_down = nnx.Linear(f, d, use_bias=False, kernel_init=mlp_rows, **kw)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        heads, kv_heads = self.n_heads, self.n_kv_heads
        hd, group = d // heads, heads // kv_heads
        h = checkpoint_name(self.attn_norm(x), "attn_in")
        theta, scaling = self.rope_theta, self.rope_scaling
        q = checkpoint_name(rope(self.wq(h).reshape(batch, seq, heads, hd), positions, theta, scaling), "q")
        k = checkpoint_name(rope(self.wk(h).reshape(batch, seq, kv_heads, hd), positions, theta, scaling), "k")
        v = checkpoint_name(self.wv(h).reshape(batch, seq, kv_heads, hd), "v")
        if self.fused:
            context = fused_attention(q, k, v).reshape(batch, seq, d)
        else:
            # Grouped-query attention without repeating k and v: queries grouped per kv head.
            grouped = q.reshape(batch, seq, kv_heads, group, hd)
            k, v = context_kv(k, v)  # every device's keys and values on a context axis (else as they are)
            scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k) / math.sqrt(hd)
            causal = causal_mask(seq, k.shape[1])
            scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
            # Softmax in float32; its backward reads the tagged probabilities (saved or recomputed by policy).
            probs = named_softmax(scores, "attn_probs")
            context = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(batch, seq, d)
        x = x + checkpoint_name(self.wo(checkpoint_name(context, "attn_ctx")), "attn_out")
        h = checkpoint_name(self.mlp_norm(x), "mlp_in")
        gate = checkpoint_name(self.w_gate(h), "mlp_gate")
        up = checkpoint_name(self.w_up(h), "mlp_up")
        hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
        return checkpoint_name(x + self.w_down(hidden), "block_out")


class Llama(nnx.Module):
    """Token embedding, ``n_layers`` decoder blocks, final RMSNorm, head.

    >>> model = Llama(LlamaConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((3, 16), jnp.int32)).shape
    (3, 16, 256)
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        kw = {"dtype": jnp.dtype(config.dtype), "param_dtype": jnp.dtype(config.param_dtype), "rngs": rngs}
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.d_model, embedding_init=nnx.initializers.normal(0.02), **kw
        )
        self.layers = nnx.List([LlamaBlock(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, **kw)
        if not config.tied_head:
            self.lm_head = nnx.Linear(
                config.d_model, config.vocab_size, use_bias=False, kernel_init=nnx.initializers.normal(0.02), **kw
            )

    def embed(self, tokens: jax.Array) -> jax.Array:
        if tokens.shape[-1] > self.config.max_seq_len:
            raise JaxmemError(
                f"sequence length {tokens.shape[-1]} exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        return self.embed_tokens(tokens)

    def logits(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        logits = self.embed_tokens.attend(h) if self.config.tied_head else self.lm_head(h)
        return checkpoint_name(logits, "logits")

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        positions = batch_positions({"positions": positions}, tokens.shape[-1])
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.logits(x)


def llama(config: LlamaConfig, name: str = "llama") -> StagedModel:
    """The Llama as a :class:`~jaxmem.models.StagedModel`, built with :func:`from_nnx`.

    >>> model = llama(LlamaConfig(n_layers=4), "llama-tiny")
    >>> model.n_layers, len(model.tags.names)
    (4, 13)
    """

    def layer(block, x, batch):
        return block(x, batch_positions(batch, x.shape[1]))

    def loss(module, batch):
        loss_sum, weight = token_loss(module(batch["tokens"], batch.get("positions")), batch)
        return loss_sum / weight

    return from_nnx(
        lambda rngs: Llama(config, rngs=rngs),
        layers="layers",
        embed=lambda module, batch: module.embed(batch["tokens"]),
        head_loss=lambda module, x, batch: token_loss(module.logits(x), batch),
        call_layer=layer,
        tags=LLAMA_FUSED_TAGS if config.attention == "fused" else LLAMA_TAGS,
        loss=loss,
        name=name,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        config=config,
        logits=lambda module, batch: module(batch["tokens"], batch.get("positions")),
        vocab=VocabParallel(
            table="embed_tokens.embedding",
            head=None if config.tied_head else "lm_head.kernel",
            embed=lambda module, rows, batch: rows,
            hidden=lambda module, x, batch: module.norm(x),
            dtype=config.dtype,
        ),
    )
