"""Train-step graphs to plan: any model's plain train step with an Adam update (abstractly traced, so the
big presets are never allocated), and a multi-branch model where operator order matters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmem._errors import JaxmemError, setting
from jaxmem.models import get_model, make_batch

__all__ = ["TrainStep", "accumulated_train_step", "chunked_loss_train_step", "experts_train_step", "model_train_step"]


@dataclasses.dataclass
class TrainStep:
    """A train step ready to trace: ``fn(*args)``, abstract args, and which args are donated."""

    name: str
    fn: object
    args: tuple
    donated: tuple[int, ...]  # flat indices of donated leaves
    make_args: object = dataclasses.field(default=None, repr=False)  # seed -> concrete args

    def jaxpr(self):
        return jax.make_jaxpr(self.fn)(*self.args)

    def concrete_args(self, seed: int = 0):
        """Real arrays for the args: initialised parameters and optimizer state, a random batch."""
        return self.make_args(seed)


def _adam_step(loss_of, params, batch_args, name: str, init_params, *, ids: int = 256) -> TrainStep:
    """``batch_args``: abstract arrays (or pytrees of them) passed to ``loss_of`` after the parameters;
    ``ids``: integer leaves of a concrete batch are drawn below it (token ids, class labels)."""
    tx = optax.adam(1e-3)
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(lambda p: loss_of(p, *batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def make_args(seed: int):
        real = init_params(seed)
        leaves, treedef = jax.tree.flatten(batch_args)
        keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
        batch = [
            jax.random.randint(k, a.shape, 0, ids, a.dtype)
            if jnp.issubdtype(a.dtype, jnp.integer)
            else jax.random.normal(k, a.shape, a.dtype)
            for k, a in zip(keys, leaves)
        ]
        return (real, tx.init(real), *jax.tree.unflatten(treedef, batch))

    donated = tuple(range(len(jax.tree.leaves(params)) + len(jax.tree.leaves(opt_state))))
    return TrainStep(name, step, (params, opt_state, *batch_args), donated, make_args)


def _language_model(model, seq, what: str | None = None):
    """The model (preset name, config, StagedModel or ``package.module:attr``), its sequence length
    (default: its maximum, or 64), checked, and its abstract parameters. ``what``: a step that only a
    language model's ``tokens``/``targets`` batch has (refused for a model with its own batch)."""
    model = get_model(model)
    if what is not None and model.batch_spec is not None:
        raise JaxmemError(
            f"{what} slices a language model's tokens and targets; {model.name} has a batch of its own "
            f"({', '.join(sorted(model.batch_spec(1, 1)))}): analyze its plain train step instead"
        )
    seq = seq or model.max_seq_len or 64
    model.check_batch(seq)
    return model, seq, model.abstract_params()


def _batch(model, batch: int, seq: int) -> dict:
    """The abstract batch of a step: the model's own (``batch_spec``), or tokens and targets."""
    if model.batch_spec is not None:
        return dict(model.batch_spec(batch, seq))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return make_batch(tokens, tokens)


def model_train_step(model="tiny", *, batch: int = 4, seq: int | None = None) -> TrainStep:
    """The plain (unpipelined) train step of a model (a preset name, config, StagedModel or
    ``package.module:attr``) with Adam, traced with abstract arrays: on tokens and targets, or on the
    model's own batch when it has one (``StagedModel.batch_spec``, e.g. a classifier's images and
    labels)."""
    model, seq, params = _language_model(model, seq)
    spec = _batch(model, batch, seq)
    shape = f"batch {batch}, seq {seq}" if model.batch_spec is None else f"batch {batch}"
    return _adam_step(
        model.plain_loss, params, (spec,), f"{model.name} train step ({shape})", model.init, ids=model.vocab_size or 1
    )


def accumulated_train_step(model="tiny", *, microbatches: int = 4, batch: int = 4, seq: int | None = None) -> TrainStep:
    """Gradient accumulation as a user writes it without a scan: the mean of ``microbatches`` losses,
    one per slice of the batch, in a Python loop, differentiated as one function. Program order runs
    every microbatch's forward before any backward, so all their activations are alive at once; an
    order that finishes one microbatch's backward before the next forward needs one's."""
    model, seq, params = _language_model(model, seq, setting("accumulate"))
    tokens = jax.ShapeDtypeStruct((batch * microbatches, seq), jnp.int32)

    def loss_of(p, tokens, targets):
        parts = [
            model.plain_loss(p, make_batch(tokens[i * batch : (i + 1) * batch], targets[i * batch : (i + 1) * batch]))
            for i in range(microbatches)
        ]
        return sum(parts) / microbatches

    name = f"{model.name} accumulated x{microbatches} (batch {batch} each, seq {seq})"
    return _adam_step(loss_of, params, (tokens, tokens), name, model.init)


def chunked_loss_train_step(model="tiny", *, chunks: int = 8, batch: int = 4, seq: int | None = None) -> TrainStep:
    """The loss head over sequence chunks (the vocabulary-sized logits of one chunk at a time, as
    chunked cross-entropy does), written as a sum over chunks. Program order computes every chunk's
    logits before any chunk's backward; an order that finishes one chunk's head backward before the
    next chunk's logits keeps one chunk's logits alive instead of all."""
    model, seq, params = _language_model(model, seq, setting("loss_chunks"))
    if seq % chunks:
        raise ValueError(f"seq {seq} is not divisible by chunks {chunks}")
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    width = seq // chunks

    def loss_of(p, tokens, targets):
        layers, shared = model.split(p)
        full = make_batch(tokens, targets)
        x = model.embed(shared, full)
        for layer_params in layers:
            x = model.layer(layer_params, x, full)
        total = weight = 0.0
        for c in range(chunks):
            part = slice(c * width, (c + 1) * width)
            chunk = make_batch(tokens[:, part], targets[:, part])
            loss_sum, w = model.head_loss(shared, jax.tree.map(lambda a, part=part: a[:, part], x), chunk)
            total, weight = total + loss_sum, weight + w
        return total / weight

    name = f"{model.name} chunked loss x{chunks} (batch {batch}, seq {seq})"
    return _adam_step(loss_of, params, (tokens, tokens), name, model.init)


class Experts(nnx.Module):
    """Parallel experts written the natural way: every expert's expansion, then every contraction --
    so program order keeps all the wide hidden activations alive at once."""

    def __init__(self, d: int, hidden: int, experts: int, *, rngs: nnx.Rngs):
        self.up = nnx.List([nnx.Linear(d, hidden, rngs=rngs) for _ in range(experts)])
        self.down = nnx.List([nnx.Linear(hidden, d, rngs=rngs) for _ in range(experts)])

    def __call__(self, x):
        hidden = [jax.nn.gelu(up(x)) for up in self.up]
        return x + sum(down(h) for down, h in zip(self.down, hidden))


class ExpertsNet(nnx.Module):
    def __init__(self, d: int = 64, hidden: int = 1024, experts: int = 8, blocks: int = 2, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Experts(d, hidden, experts, rngs=rngs) for _ in range(blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def experts_train_step(
    *, batch: int = 64, d: int = 64, hidden: int = 1024, experts: int = 8, blocks: int = 2
) -> TrainStep:
    """A multi-branch (parallel experts) regression model's train step with Adam."""
    abstract = nnx.eval_shape(lambda: ExpertsNet(d, hidden, experts, blocks, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.graphdef(abstract), nnx.to_pure_dict(nnx.state(abstract))
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32)

    def loss_of(p, x, y):
        return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

    def init_params(seed):
        return nnx.to_pure_dict(nnx.state(ExpertsNet(d, hidden, experts, blocks, rngs=nnx.Rngs(seed))))

    return _adam_step(
        loss_of, params, (x, x), f"parallel experts x{experts} (batch {batch}, hidden {hidden})", init_params
    )
