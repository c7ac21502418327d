"""Measured step time of each recompute policy at each sequence length, on this machine: which policy
is really fastest here (the question the online profiler's cost model must answer).

    python benchmarks/policy_times.py [--buckets 32,64,128] [--steps 8] [--d-model 64] [--json]

Tiny GPT (max_seq_len raised to the largest bucket; ``--d-model`` widens it), 1F1B P=4 M=8, batch 32,
synthetic tokens. Per (policy, length): one compile, one warm-up step, then the median of ``--steps``
timed steps; the simulated step time on the calibrated CPU profile is printed beside it. Beside them,
without the pipeline: plain ``jax.grad`` of the same model's loss on one device, as is (``plain save``)
and under ``jax.checkpoint`` (``plain recompute``, one more forward) -- what recompute costs this CPU
at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import estimate, get_hardware  # noqa: E402
from jaxmem.models import get_config, get_model, make_batch  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402

POLICIES = ("save-all", "selective", "recompute-all")


def plain_grad_seconds(model, seq: int, steps: int) -> dict[str, float]:
    """Median gradient time of the unpipelined model, without and with full recompute."""
    import jax.numpy as jnp

    staged = get_model(model)
    params = staged.init(0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (32, seq)), jnp.int32)

    def loss(params, tokens):
        return staged.plain_loss(params, make_batch(tokens, jnp.roll(tokens, -1, axis=1)))

    out = {}
    for name, fn in (("plain save", loss), ("plain recompute", jax.checkpoint(loss))):
        grad = jax.jit(jax.grad(fn))
        jax.block_until_ready(grad(params, tokens))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(grad(params, tokens))
            times.append(time.perf_counter() - start)
        out[name] = float(np.median(times))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="32,64,128", help="sequence lengths (comma-separated)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per policy and length")
    parser.add_argument("--d-model", type=int, default=64, help="model width (tiny: 64; n_heads = d_model // 16)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    buckets = [int(b) for b in args.buckets.split(",")]
    model = dataclasses.replace(
        get_config("tiny"), max_seq_len=max(buckets), d_model=args.d_model, n_heads=args.d_model // 16, d_ff=0
    )
    hardware = get_hardware("cpu")
    rows = []
    for seq in buckets:
        for policy in POLICIES:
            config = TrainConfig(model=model, seq_len=seq, batch_size=32, policy=policy, data="synthetic")
            trainer = Trainer(config)
            state = trainer.init_state()
            start = time.perf_counter()
            state, metrics, _ = trainer.step(state)
            loss = metrics["loss"]
            jax.block_until_ready(loss)
            first = time.perf_counter() - start
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                state, metrics, _ = trainer.step(state)
                loss = metrics["loss"]
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - start)
            simulated = estimate(
                trainer.model, trainer.schedule, policy, batch=32, seq=seq, hardware=hardware
            ).simulation.makespan
            row = {
                "seq_len": seq,
                "policy": policy,
                "compile_and_first_step_seconds": first,
                "step_seconds_median": float(np.median(times)),
                "step_seconds_min": float(np.min(times)),
                "simulated_step_seconds": simulated,
            }
            rows.append(row)
            print(
                f"seq {seq:4d}  {policy:14s} step {row['step_seconds_median']:.3f}s (min {row['step_seconds_min']:.3f})"
                f"  simulated {simulated:.3f}s  compile+first {first:.1f}s",
                file=sys.stderr,
            )
    for seq in buckets:
        for name, seconds in plain_grad_seconds(model, seq, args.steps).items():
            rows.append({"seq_len": seq, "policy": name, "step_seconds_median": seconds, "pipelined": False})
            print(f"seq {seq:4d}  {name:14s} step {seconds:.3f}s (jax.grad, one device, no pipeline)", file=sys.stderr)
    fastest = {
        seq: min(
            (r for r in rows if r["seq_len"] == seq and r.get("pipelined", True)),
            key=lambda r: r["step_seconds_median"],
        )["policy"]
        for seq in buckets
    }
    record = {
        "benchmark": "policy_times",
        "platform": jax.devices()[0].platform,
        "d_model": args.d_model,
        "rows": rows,
        "fastest": fastest,
    }
    print(json.dumps(record, indent=2) if args.json else json.dumps(fastest))
    return record


if __name__ == "__main__":
    main()
