"""Check that a schedule (and a memory policy) gives the same loss and gradients as plain ``jax.grad``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmem._errors import JaxmemError
from jaxmem.models.gpt import GPT, GPTConfig, get_config
from jaxmem.pipeline import Pipeline, make_mesh
from jaxmem.schedule import Schedule, validate

__all__ = ["ATOL", "RTOL", "plain_value_and_grad", "verification_model", "verify"]

# f32 tolerances for composite code (several matmuls, softmax, layer norms, reductions in another
# order): per element, |pipelined - plain| <= ATOL + RTOL * |plain|.
RTOL = 1e-5
ATOL = 1e-6


def verification_model(num_stages: int, base: str | GPTConfig = "tiny") -> GPTConfig:
    """A small model whose layers split evenly over ``num_stages``: two layers per stage up to 3
    stages (so multi-layer stages are exercised), one per stage beyond (to keep compiles short)."""
    config = get_config(base)
    layers = 2 * num_stages if num_stages <= 3 else num_stages
    return dataclasses.replace(config, n_layers=layers, max_seq_len=16)


def plain_value_and_grad(config: GPTConfig, params: dict, tokens, targets):
    """Loss and gradients of the unpipelined model: ``jax.value_and_grad`` of ``GPT.loss``."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))

    def loss_fn(p):
        return nnx.merge(graphdef, p).loss(tokens, targets)

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def verify(
    schedule: Schedule,
    *,
    config: GPTConfig | None = None,
    data_parallel: int = 1,
    policy=None,
    seed: int = 0,
    seq_len: int = 16,
    microbatch_size: int = 1,
) -> dict:
    """Run one pipelined gradient of a small GPT and compare with ``jax.value_and_grad`` of the whole
    model on the same batch.

    Returns:
        ``ok`` (every element within ``ATOL + RTOL * |plain|``), ``max_abs_diff``, ``max_rel_diff``
        (largest ``|diff| / max|plain|`` over parameter arrays), ``loss``, ``loss_plain``,
        ``schedule`` and the sizes used.
    """
    validate(schedule)
    config = config or verification_model(schedule.num_stages)
    if seq_len > config.max_seq_len:
        raise JaxmemError(f"seq_len {seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    devices = data_parallel * schedule.num_ranks
    if devices > jax.device_count():
        raise JaxmemError(
            f"verifying needs data({data_parallel}) x pipe({schedule.num_ranks}) = {devices} devices, "
            f"{jax.device_count()} available; on CPU pass --devices {devices}"
        )
    pipe = Pipeline(config, schedule, make_mesh(data_parallel, schedule.num_ranks), policy=policy)
    batch = data_parallel * schedule.num_microbatches * microbatch_size
    params = nnx.to_pure_dict(nnx.state(GPT(config, rngs=nnx.Rngs(seed))))
    key = jax.random.PRNGKey(seed + 1)
    tokens = jax.random.randint(key, (batch, seq_len), 0, config.vocab_size, dtype=jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)

    loss_plain, grads_plain = plain_value_and_grad(config, params, tokens, targets)
    loss, grads = pipe.value_and_grad(pipe.place(pipe.from_model_params(params)), tokens, targets)
    grads = pipe.to_model_params(grads)

    ok = bool(np.allclose(float(loss), float(loss_plain), rtol=RTOL, atol=ATOL))
    max_abs = abs(float(loss) - float(loss_plain))
    max_rel = max_abs / max(abs(float(loss_plain)), 1e-30)
    worst = None
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_plain)):
        got, want = np.asarray(got), np.asarray(want)
        diff = np.abs(got - want)
        leaf_abs = float(diff.max(initial=0.0))
        leaf_rel = leaf_abs / max(float(np.abs(want).max(initial=0.0)), 1e-30)
        if not np.all(diff <= ATOL + RTOL * np.abs(want)):
            ok = False
            worst = worst or jax.tree_util.keystr(path)
        max_abs, max_rel = max(max_abs, leaf_abs), max(max_rel, leaf_rel)
    return {
        "ok": ok,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "rtol": RTOL,
        "atol": ATOL,
        "first_mismatch": worst,
        "loss": float(loss),
        "loss_plain": float(loss_plain),
        "schedule": schedule.name,
        "ranks": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "data_parallel": data_parallel,
        "layers": config.n_layers,
        "policy": None if policy is None else str(policy),
    }
