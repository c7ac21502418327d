"""Bring your own Flax model: a Llama-style decoder written here, pipelined by jaxmem.

The model below is plain Flax NNX -- RMSNorm, rotary embeddings, SwiGLU, grouped-query attention,
an untied head -- and knows nothing of jaxmem except ``checkpoint_name`` tags on the activations a
memory policy may keep, recompute or offload. Four steps make it pipelined:

1. ``from_nnx`` says where the repeated layers are and how the prologue and the head are called;
2. a schedule (ChronosPipe here) and a per-stage memory policy naming the model's own tags;
3. the pipelined gradients are checked against ``jax.grad`` of the plain model;
4. 50 optax steps, each one ``jax.jit(shard_map(...))`` program.

    python examples/train_own_model.py          # 4 virtual CPU devices, about a minute
"""

import math
import os

# Virtual CPU devices must be requested before JAX starts (ignored on GPU/TPU machines).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

import jaxmem  # noqa: E402
from jaxmem.data import DataIterator  # noqa: E402
from jaxmem.models import from_nnx, make_batch, named_softmax, token_loss  # noqa: E402
from jaxmem.pipeline import Pipeline, make_mesh  # noqa: E402
from jaxmem.policy import TagSet  # noqa: E402

VOCAB, D, HEADS, KV_HEADS, FF, LAYERS = 256, 64, 4, 2, 176, 8


# ------------------------------------------------------------------ the user's model (no jaxmem in it)
def rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    angles = positions[..., None].astype(jnp.float32) * theta ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    def __init__(self, rngs):
        hd = D // HEADS
        self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.q = nnx.Linear(D, HEADS * hd, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(D, 2 * KV_HEADS * hd, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.gate_up = nnx.Linear(D, 2 * FF, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(FF, D, use_bias=False, rngs=rngs)

    def __call__(self, x, positions):
        b, s, _ = x.shape
        hd, group = D // HEADS, HEADS // KV_HEADS
        h = self.norm1(x)
        # Tag the outputs of matmuls (and of named_softmax): the policy then decides for each.
        q = checkpoint_name(rope(self.q(h).reshape(b, s, HEADS, hd), positions), "q")
        k, v = jnp.split(self.kv(h).reshape(b, s, 2 * KV_HEADS, hd), 2, axis=2)
        k, v = checkpoint_name(rope(k, positions), "k"), checkpoint_name(v, "v")
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, s, KV_HEADS, group, hd), k) / math.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
        # named_softmax: a softmax whose saved output really spares its recompute (jax.nn.softmax's
        # backward reads an untagged copy, so tagging its result would not).
        probs = named_softmax(scores, "attn_probs")
        x = x + self.o(jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, D))
        gate, up = jnp.split(checkpoint_name(self.gate_up(self.norm2(x)), "mlp_gate_up"), 2, axis=-1)
        return x + self.down(checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden"))


class MyLlama(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)  # untied

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])[None]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ 1. tell jaxmem how it is cut
def positions_of(batch):
    return jnp.arange(batch["tokens"].shape[1])[None]


model = from_nnx(
    MyLlama,  # a factory rngs -> module (or an already built module)
    layers="layers",  # the repeated blocks; stages get consecutive runs of them
    embed=lambda m, batch: m.embed(batch["tokens"]),  # called on the model without its layers
    call_layer=lambda block, x, batch: block(x, positions_of(batch)),
    head_loss=lambda m, x, batch: token_loss(m.head(m.norm(x)), batch),  # (loss_sum, weight), f32
    # Every tag the blocks emit; "quadratic" is what the `selective` policy recomputes.
    tags=TagSet(("q", "k", "v", "attn_probs", "mlp_gate_up", "mlp_hidden"), groups=(("quadratic", ("attn_probs",)),)),
    name="my-llama",
    vocab_size=VOCAB,
)

# ------------------------------------------------------------------ 2. schedule and per-stage policy
schedule = jaxmem.generate("chronos", 4, 8)  # 4 ranks x 2 chunks in a V, 8 microbatches
print(schedule)
policy = {
    "base": "save-all",
    # The earliest stages hold the most microbatches in flight: there, recompute the quadratic
    # attention probabilities and the wide MLP activations; later stages keep everything.
    "stage": {"0": {"base": "selective", "mlp_hidden": "recompute"}, "1": "selective"},
}
pipeline = Pipeline(model, schedule, make_mesh(data=1, pipe=4), policy=policy)
for stage, kinds in pipeline.policy.describe()["stages"].items():
    print(f"stage {stage}: {'; '.join(kinds)}")

# ------------------------------------------------------------------ 3. verify against jax.grad
module = MyLlama(nnx.Rngs(0))
model_params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
params = pipeline.place(pipeline.from_model_params(model_params))

data = DataIterator(batch_size=16, seq_len=64, seed=0)
first, _ = data.next()
batch = make_batch(jnp.asarray(first.tokens), jnp.asarray(first.targets))

loss, grads = pipeline.value_and_grad(params, batch)
graphdef = nnx.graphdef(module)


def plain_loss(p):
    logits = nnx.merge(graphdef, p)(batch["tokens"])
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))


ref_loss, ref_grads = jax.value_and_grad(plain_loss)(model_params)
ours = pipeline.to_model_params(grads)
worst = max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref_grads), strict=True)
)
print(f"pipelined loss {float(loss):.6f}  plain {float(ref_loss):.6f}  worst gradient rel. diff {worst:.1e}")
assert jax.tree.structure(ours) == jax.tree.structure(ref_grads)
assert abs(float(loss) - float(ref_loss)) < 1e-5 and worst < 1e-4, "pipelined gradients differ from jax.grad"

# ------------------------------------------------------------------ 4. train
optimizer = optax.adamw(3e-3, weight_decay=0.01)
opt_state = optimizer.init(params)
grad_fn = pipeline.grad_fn(batch)  # built for batches shaped like this one


@jax.jit
def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)  # one shard_map program runs the whole schedule
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


losses = []
for step in range(50):
    b, data = data.next()
    params, opt_state, loss = train_step(params, opt_state, make_batch(jnp.asarray(b.tokens), jnp.asarray(b.targets)))
    losses.append(float(loss))
    if step % 10 == 0 or step == 49:
        print(f"step {step:3d}  loss {losses[-1]:.3f}")
assert np.mean(losses[-5:]) < losses[0] - 1.0, "the loss did not go down"

# Back into the user's module, e.g. to save it or to sample from it.
nnx.update(module, nnx.State(pipeline.to_model_params(params)))
print("trained parameters are back in MyLlama")
