"""Pipelined step vs plain jitted step of the same model and batch, and compile time vs microbatches.

    python benchmarks/overhead.py [--steps 20] [--json]

Measured in one process on virtual CPU devices: the pipelined 1F1B step (P=4, 4 devices) against
the plain ``jax.jit(value_and_grad + Adam)`` step on the SAME 4 devices (data parallel: the batch
split over them, parameters replicated, gradients all-reduced) -- the like-for-like ratio -- and, for
reference, on one device; and the compile time of the pipelined step at M=4 and M=32 (same global
batch). CPU timings say nothing about a GPU cluster's throughput; they show the executor's overhead
and that compile time does not grow with M.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.data import DataIterator  # noqa: E402
from jaxmem.models import get_model  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402


def time_steps(fn, state, batches, steps):
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state = fn(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return state, float(np.median(times))


def plain_step_seconds(config_name, batch, seq, steps, seed=0, devices=1):
    """The plain jitted train step, data parallel over ``devices`` (1: a single device)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = get_model(config_name)
    optimizer = optax.adam(3e-3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))  # auto sharding, as the pipeline's
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(model.init(seed), replicated)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(model.plain_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = DataIterator(batch_size=batch, seq_len=seq, seed=seed)
    batches = [jax.device_put(data.batch_at(i * batch).arrays(), split) for i in range(4)]
    opt_state = jax.device_put(optimizer.init(params), replicated)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batches[0]).compile()
    compile_seconds = time.perf_counter() - start

    def run(state, b):
        p, o, _ = compiled(state[0], state[1], b)
        return (p, o)

    (params, opt_state), _ = time_steps(run, (params, opt_state), batches, 2)  # warm up
    _, seconds = time_steps(run, (params, opt_state), batches, steps)
    return seconds, compile_seconds


def pipelined(microbatches, batch, seq, steps, schedule="1f1b", stages=4):
    trainer = Trainer(
        TrainConfig(
            schedule=schedule,
            stages=stages,
            microbatches=microbatches,
            batch_size=batch,
            seq_len=seq,
            steps=max(steps, 1),
        )
    )
    state = trainer.init_state()
    start = time.perf_counter()
    compiled = trainer.lower(state).compile()
    compile_seconds = time.perf_counter() - start
    if steps == 0:
        return None, compile_seconds
    batches = [state.data.batch_at(i * batch) for i in range(4)]

    def run(s, b):
        p, o, _ = compiled(s[0], s[1], trainer.put_batch(b))
        return (p, o)

    carried, _ = time_steps(run, (state.params, state.opt_state), batches, 2)
    _, seconds = time_steps(run, carried, batches, steps)
    return seconds, compile_seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (median reported)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    B, T = args.batch_size, args.seq_len

    plain_s, plain_compile = plain_step_seconds("tiny", B, T, args.steps)
    plain4_s, plain4_compile = plain_step_seconds("tiny", B, T, args.steps, devices=4)
    pipe_s, compile_m8 = pipelined(8, B, T, args.steps)
    _, compile_m4 = pipelined(4, B, T, 0)
    _, compile_m32 = pipelined(32, B, T, 0)
    record = {
        "benchmark": "overhead",
        "model": "tiny",
        "batch_size": B,
        "seq_len": T,
        "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "plain_step_seconds": plain_s,
        "plain_data_parallel_4_step_seconds": plain4_s,
        "pipelined_step_seconds": pipe_s,
        "pipelined_schedule": "1f1b P=4 M=8",
        "pipelined_over_plain_step_ratio": pipe_s / plain4_s,
        "pipelined_over_plain_step_ratio_note": "same 4 devices: plain step data parallel over them",
        "pipelined_over_plain_1_device_ratio": pipe_s / plain_s,
        "plain_compile_seconds": plain_compile,
        "plain_data_parallel_4_compile_seconds": plain4_compile,
        "compile_seconds_m4": compile_m4,
        "compile_seconds_m8": compile_m8,
        "compile_seconds_m32": compile_m32,
        "compile_ratio_m32_over_m4": compile_m32 / compile_m4,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(f"{'variant':38s} {'step s':>10s} {'compile s':>10s}")
        print(f"{'plain jit (1 device)':38s} {plain_s:10.4f} {plain_compile:10.2f}")
        print(f"{'plain jit, data parallel (4 devices)':38s} {plain4_s:10.4f} {plain4_compile:10.2f}")
        print(f"{'pipelined 1f1b P=4 M=8 (4 devices)':38s} {pipe_s:10.4f} {compile_m8:10.2f}")
        print(f"{'pipelined 1f1b P=4 M=4 (compile only)':38s} {'':>10s} {compile_m4:10.2f}")
        print(f"{'pipelined 1f1b P=4 M=32 (compile only)':38s} {'':>10s} {compile_m32:10.2f}")
        print(
            f"pipelined / plain step time, both on 4 devices: {record['pipelined_over_plain_step_ratio']:.2f}x; "
            f"compile M=32 / M=4: {record['compile_ratio_m32_over_m4']:.2f}x"
        )
    return record


if __name__ == "__main__":
    main()
