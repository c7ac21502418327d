"""Embed jaxmem in your own Flax training script: model, schedule, pipeline, optax step.

python examples/train_flax.py            # 4 virtual CPU devices, 40 steps of the tiny GPT
"""

import os

# Virtual CPU devices must be requested before JAX starts (ignored on GPU/TPU machines).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxmem  # noqa: E402
from jaxmem.data import DataIterator  # noqa: E402
from jaxmem.models import GPT, get_config, gpt, make_batch  # noqa: E402
from jaxmem.pipeline import Pipeline, make_mesh  # noqa: E402

config = get_config("tiny")  # 8 layers, d_model 64, byte-level vocabulary
model = GPT(config, rngs=nnx.Rngs(0))

schedule = jaxmem.generate("zb-h1", 4, 8)  # any schedule: a name, or jaxmem.load_csv("my.csv")
print(schedule)  # the table, one row per rank

# gpt(config) is the built-in GPT as a jaxmem StagedModel (for your own model: jaxmem.models.from_nnx,
# see examples/train_own_model.py).
pipeline = Pipeline(gpt(config), schedule, make_mesh(data=1, pipe=4), policy="selective")
params = pipeline.place(pipeline.from_model_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
optimizer = optax.adam(3e-3)
opt_state = optimizer.init(params)
grad_fn = pipeline.grad_fn(32, seq=64)  # batches of 32 x 64 tokens (tokens and targets)


@jax.jit
def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)  # one shard_map program runs the whole schedule
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


data = DataIterator(batch_size=32, seq_len=64, seed=0)
for step in range(40):
    batch, data = data.next()
    params, opt_state, loss = train_step(params, opt_state, make_batch(batch.tokens, batch.targets))
    if step % 10 == 0 or step == 39:
        print(f"step {step:3d}  loss {float(loss):.3f}")

# Back to the model's own parameter layout, e.g. to save or to run the unpipelined model.
nnx.update(model, nnx.State(pipeline.to_model_params(params)))
