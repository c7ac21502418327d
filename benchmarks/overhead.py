"""Pipelined step vs plain jitted step of the same model and batch, over schedules, microbatch counts
and policies; compile time vs microbatches; and what one tick of the compiled step writes.

    python benchmarks/overhead.py [--steps 10] [--json]          # the grid, record in results/overhead.json
    python benchmarks/overhead.py --profile [--policy save-all]  # the tick loop of 1F1B P=4 M=8
    python benchmarks/overhead.py --split-backward --schedules zbv,chronos --json
        # each variant with and without split_backward, one after the other (results/overhead_split.json)

Measured in one process on virtual CPU devices (P=4 on 4 devices): every pipelined step against the
plain ``jax.jit(value_and_grad + Adam)`` step on the SAME 4 devices (data parallel: the batch split
over them, parameters replicated, gradients all-reduced) -- the like-for-like ratio -- with the
schedule's bubble ideal beside it (the simulator's makespan over a rank's busy time, unit costs);
and the compile time of the pipelined step at M=4 and M=32 (same global batch). CPU timings say
nothing about a GPU cluster's throughput; they show the executor's overhead and that compile time
does not grow with M. ``--profile`` prints :func:`jaxmem.pipeline.tick_traffic` of one compiled step:
the loop-carried buffers the tick loop copies or scatters into, and its writes by opcode.
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
from jaxmem.pipeline import tick_traffic  # noqa: E402
from jaxmem.schedule import generate, simulate  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402


def time_steps(fn, state, batches, steps):
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state = fn(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return state, float(np.median(times))


def plain_step(config_name, batch, seq, seed=0, devices=4, layers=None):
    """The plain jitted train step, data parallel over ``devices`` (1: a single device), compiled:
    ``(compiled, run, state, a batch, compile seconds)`` with ``run(state, batch) -> state``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = get_model(config_name, n_layers=layers or LAYERS)
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

    return compiled, run, (params, opt_state), batches, compile_seconds


def plain_step_seconds(config_name, batch, seq, steps, seed=0, devices=1):
    """The plain jitted train step's median seconds and its compile seconds."""
    _, run, state, batches, compile_seconds = plain_step(config_name, batch, seq, seed, devices)
    state, _ = time_steps(run, state, batches, 2)  # warm up
    _, seconds = time_steps(run, state, batches, steps)
    return seconds, compile_seconds


def pipelined_program(
    microbatches, batch, seq, schedule="1f1b", stages=4, policy="selective", model="tiny", split=False
):
    """The pipelined train step compiled: ``(compiled, run, state, a batch, compile seconds)`` with
    ``run(state, batch) -> state``, the state ``(params, opt_state)``."""
    trainer = Trainer(
        TrainConfig(
            model=model,
            policy=policy,
            schedule=schedule,
            pipe=stages,
            microbatches=microbatches,
            batch_size=batch,
            seq_len=seq,
            steps=1,
            split_backward=split,
        )
    )
    state = trainer.init_state()
    start = time.perf_counter()
    compiled = trainer.lower(state).compile()
    compile_seconds = time.perf_counter() - start

    def run(s, b):
        p, o, _ = compiled(s[0], s[1], b)
        return (p, o)

    batches = [trainer.put_batch(state.data.batch_at(i * batch)) for i in range(4)]
    return compiled, run, (state.params, state.opt_state), batches, compile_seconds


def pipelined(
    microbatches, batch, seq, steps, schedule="1f1b", stages=4, policy="selective", model="tiny", split=False
):
    compiled, run, state, batches, compile_seconds = pipelined_program(
        microbatches, batch, seq, schedule, stages, policy, model, split
    )
    if steps == 0:
        return None, compile_seconds
    if steps < 0:  # the compiled step itself
        return compiled, compile_seconds
    carried, _ = time_steps(run, state, batches, 2)
    _, seconds = time_steps(run, carried, batches, steps)
    return seconds, compile_seconds


# Eight layers: one per stage at P=4 with two stages per rank (interleaved, V-shape).
LAYERS = 8
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "chronos")
POLICIES = ("save-all", "selective", "recompute-all")


def bubble_ideal(schedule: str, pipe: int, microbatches: int) -> float:
    """The schedule's step time over its busy time on the busiest rank, unit costs (F=I=W=1)."""
    result = simulate(generate(schedule, pipe, microbatches))
    return result.makespan / max(result.busy)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (median reported)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all four)")
    parser.add_argument("--microbatches", default="8,32", help="comma-separated M values")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    parser.add_argument("--profile", action="store_true", help="print the tick loop of one compiled step and exit")
    parser.add_argument("--policy", default="save-all", help="the policy --profile compiles (1F1B, P=4, M=8)")
    parser.add_argument(
        "--split-backward",
        action="store_true",
        help="time every variant without and then with split_backward (W takes I's cotangents)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    B, T, model = args.batch_size, args.seq_len, get_model("tiny", n_layers=LAYERS)

    if args.profile:
        compiled, _ = pipelined(8, B, T, -1, policy=args.policy, model=model)
        traffic = tick_traffic(compiled)
        print(f"1F1B P=4 M=8 {args.policy}, tiny GPT ({LAYERS} layers), batch {B} x {T}:")
        print(traffic.summary())
        return traffic

    plain4_s, plain4_compile = plain_step_seconds("tiny", B, T, args.steps, devices=4)
    print(f"plain jit, data parallel over 4 devices: {plain4_s:.4f} s/step", file=sys.stderr, flush=True)
    rows = []
    for schedule in args.schedules.split(","):
        for m in [int(x) for x in args.microbatches.split(",")]:
            ideal = bubble_ideal(schedule, 4, m)
            for policy in args.policies.split(","):
                for split in (False, True) if args.split_backward else (False,):
                    seconds, compile_s = pipelined(
                        m, B, T, args.steps, schedule=schedule, policy=policy, model=model, split=split
                    )
                    ratio = seconds / plain4_s
                    rows.append(
                        {
                            "schedule": schedule,
                            "microbatches": m,
                            "policy": policy,
                            **({"split_backward": split} if args.split_backward else {}),
                            "step_seconds": seconds,
                            "compile_seconds": compile_s,
                            "over_plain": ratio,
                            "bubble_ideal": ideal,
                            "over_ideal": ratio / ideal,
                        }
                    )
                    print(
                        f"{schedule:17s} M={m:<3d} {policy:14s}{' split' if split else '      '} {seconds:7.4f} s  "
                        f"{ratio:5.2f}x plain  ideal {ideal:5.3f}  {ratio / ideal:5.2f}x ideal",
                        file=sys.stderr,
                        flush=True,
                    )
    _, compile_m4 = pipelined(4, B, T, 0, model=model)
    _, compile_m32 = pipelined(32, B, T, 0, model=model)
    record = {
        "benchmark": "overhead",
        "command": "python benchmarks/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": f"tiny, {LAYERS} layers",
        "batch_size": B,
        "seq_len": T,
        "pipe": 4,
        "platform": jax.devices()[0].platform,
        "cpu_count": os.cpu_count(),
        "plain_data_parallel_4_step_seconds": plain4_s,
        "plain_data_parallel_4_compile_seconds": plain4_compile,
        "grid": rows,
        "compile_seconds_m4": compile_m4,
        "compile_seconds_m32": compile_m32,
        "compile_ratio_m32_over_m4": compile_m32 / compile_m4,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(f"compile M=32 / M=4 (1F1B, selective): {record['compile_ratio_m32_over_m4']:.2f}x")
    return record


if __name__ == "__main__":
    main()
