"""Pipelined step vs plain jitted step of the same model and batch, over schedules, microbatch counts
and policies; compile time vs microbatches; and what one tick of the compiled step writes.

    python benchmarks/overhead.py [--steps 10] [--json]          # the grid, record in results/overhead.json
    python benchmarks/overhead.py --profile [--policy save-all]  # the tick loop of 1F1B P=4 M=8
    python benchmarks/overhead.py --split-backward --schedules zbv,chronos --json
        # each variant with and without split_backward, in the same rounds (results/overhead_split.json)
    python benchmarks/overhead.py --hand-recomputed --schedules zbv,chronos --policies selective,recompute-all --json
        # each variant split, with and without hand_recomputed, in the same rounds (results/overhead_hand.json)
    python benchmarks/overhead.py --split-backward --tensor 2 --schedules zbv,chronos --microbatches 8 --json
        # the same with a tensor axis: P=4 x T=2 on 8 devices (results/overhead_split_tensor.json)
    python benchmarks/overhead.py --d-model 256 --schedules 1f1b,zbv --microbatches 8 --json
        # a 4x wider tiny GPT: the executor's per-kernel cost against more arithmetic per kernel

Measured in one process on virtual CPU devices (P=4 on 4 devices): every pipelined step against the
plain ``jax.jit(value_and_grad + Adam)`` step on the SAME 4 devices (data parallel: the batch split
over them, parameters replicated, gradients all-reduced) -- the like-for-like ratio, taken within
each of ``--rounds`` rounds that time the plain step and then each policy of a (schedule, M) in turn,
its median over the rounds reported -- with the
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmem._util import with_host_devices  # noqa: E402  (imports no JAX)

# 8 virtual devices, as the CLI asks for them: on fewer cores, each runs its kernels on one thread.
os.environ.setdefault("XLA_FLAGS", with_host_devices("", 8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
# Timed as a first run: no compiled figures read back from an earlier one (jaxmem.memory._figures).
os.environ.setdefault("JAXMEM_CACHE_DIR", "off")

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


def plain_step(config_name, batch, seq, seed=0, devices=4, layers=None, **overrides):
    """The plain jitted train step, data parallel over ``devices`` (1: a single device), compiled:
    ``(compiled, run, state, a batch, compile seconds)`` with ``run(state, batch) -> state``;
    ``overrides``: config fields of the model (``d_model``)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    model = get_model(config_name, n_layers=layers or LAYERS, **overrides)
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


def pipelined_program(
    microbatches,
    batch,
    seq,
    schedule="1f1b",
    stages=4,
    policy="selective",
    model="tiny",
    split=False,
    hand=False,
    tensor=1,
):
    """The pipelined train step compiled: ``(compiled, run, state, batches, compile seconds)`` with
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
            hand_recomputed=hand,
            tensor=tensor,
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
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (their median)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds per schedule and M: each times the plain step and then every policy once; a variant's "
        "ratio to the plain step is the median over the rounds of the ratio within each (default 5)",
    )
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
        help="time every variant without and with split_backward (W takes I's cotangents), in the same rounds",
    )
    parser.add_argument(
        "--hand-recomputed",
        action="store_true",
        help="time every variant with split_backward, without and with hand_recomputed (W takes what I "
        "recomputed too), in the same rounds",
    )
    parser.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor devices per pipe rank (the plain step then runs data parallel over all 4 x T devices)",
    )
    parser.add_argument(
        "--d-model",
        type=int,
        default=64,
        help="width of the tiny GPT (default 64, the tiny preset's): wider layers carry more arithmetic per "
        "kernel, so the executor's per-kernel cost weighs less",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be at least 1, got {args.steps} and {args.rounds}")
    if args.d_model < 4 or args.d_model % 4:
        parser.error(f"--d-model must be a positive multiple of the tiny GPT's 4 heads, got {args.d_model}")
    width = {"d_model": args.d_model}
    B, T, model = args.batch_size, args.seq_len, get_model("tiny", n_layers=LAYERS, **width)

    if args.profile:
        compiled, *_ = pipelined_program(8, B, T, policy=args.policy, model=model)
        traffic = tick_traffic(compiled)
        print(f"1F1B P=4 M=8 {args.policy}, tiny GPT ({LAYERS} layers), batch {B} x {T}:")
        print(traffic.summary())
        return traffic

    # The plain step stays compiled and is timed again in every round, beside the variants: the
    # machine's speed drifts by up to a third between runs here, and a ratio of timings made minutes
    # apart carries that drift.
    plain = plain_step("tiny", B, T, devices=4 * args.tensor, **width)
    _, plain_run, plain_state, plain_batches, plain4_compile = plain
    plain_state, _ = time_steps(plain_run, plain_state, plain_batches, 2)  # warm up
    plain_rounds = []
    rows = []
    if args.hand_recomputed:
        variants = [(True, False), (True, True)]
    else:
        variants = [(False, False), (True, False)] if args.split_backward else [(False, False)]
    for schedule in args.schedules.split(","):
        for m in [int(x) for x in args.microbatches.split(",")]:
            ideal = bubble_ideal(schedule, 4, m)
            group = []
            for policy in args.policies.split(","):
                for split, hand in variants:
                    _, run, state, batches, compile_s = pipelined_program(
                        m,
                        B,
                        T,
                        schedule=schedule,
                        policy=policy,
                        model=model,
                        split=split,
                        hand=hand,
                        tensor=args.tensor,
                    )
                    state, _ = time_steps(run, state, batches, 2)  # warm up
                    group.append({"policy": policy, "split": split, "hand": hand, "run": run, "state": state,
                                  "batches": batches, "compile": compile_s, "seconds": [], "ratios": []})  # fmt: skip
            for _ in range(args.rounds):  # the plain step and every variant in turn, each round
                plain_state, plain_s = time_steps(plain_run, plain_state, plain_batches, args.steps)
                plain_rounds.append(plain_s)
                for v in group:
                    v["state"], seconds = time_steps(v["run"], v["state"], v["batches"], args.steps)
                    v["seconds"].append(seconds)
                    v["ratios"].append(seconds / plain_s)
            for v in group:
                seconds, ratio = float(np.median(v["seconds"])), float(np.median(v["ratios"]))
                rows.append(
                    {
                        "schedule": schedule,
                        "microbatches": m,
                        "policy": v["policy"],
                        **({"split_backward": v["split"]} if args.split_backward or args.hand_recomputed else {}),
                        **({"hand_recomputed": v["hand"]} if args.hand_recomputed else {}),
                        "step_seconds": seconds,
                        "compile_seconds": v["compile"],
                        "over_plain": ratio,
                        "over_plain_range": [min(v["ratios"]), max(v["ratios"])],
                        "bubble_ideal": ideal,
                        "over_ideal": ratio / ideal,
                    }
                )
                print(
                    f"{schedule:17s} M={m:<3d} {v['policy']:14s}{' split' if v['split'] else '      '}"
                    f"{' hand' if v['hand'] else '     '} "
                    f"{seconds:7.4f} s  {ratio:5.2f}x plain (rounds {min(v['ratios']):.2f}-{max(v['ratios']):.2f})  "
                    f"ideal {ideal:5.3f}  {ratio / ideal:5.2f}x ideal",
                    file=sys.stderr,
                    flush=True,
                )
    plain4_s = float(np.median(plain_rounds))
    print(
        f"plain jit, data parallel over {4 * args.tensor} devices: {plain4_s:.4f} s/step (median of its rounds)",
        file=sys.stderr,
    )
    compile_m4 = pipelined_program(4, B, T, model=model)[-1]
    compile_m32 = pipelined_program(32, B, T, model=model)[-1]
    record = {
        "benchmark": "overhead",
        "command": "python benchmarks/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": f"tiny, {LAYERS} layers, d_model {args.d_model}",
        "batch_size": B,
        "seq_len": T,
        "pipe": 4,
        "tensor": args.tensor,
        "plain_devices": 4 * args.tensor,  # the plain_data_parallel_4 figures' devices
        "platform": jax.devices()[0].platform,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
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
