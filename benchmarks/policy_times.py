"""Measured step time of each recompute policy at each sequence length, on this machine: which policy
is really fastest here (the question the online profiler's cost model must answer).

    python benchmarks/policy_times.py [--buckets 32,64,128] [--steps 8] [--d-model 64] [--json]

Tiny GPT (max_seq_len raised to the largest bucket; ``--d-model`` widens it), 1F1B P=4 M=8, batch 32,
synthetic tokens. Per (policy, length): one compile, one warm-up step, then the median of ``--steps``
timed steps; the simulated step time on the calibrated CPU profile is printed beside it. Beside them,
without the pipeline: plain ``jax.grad`` of the same model's loss on one device, as is (``plain save``)
and with every layer under ``jax.checkpoint`` (``plain recompute``: each layer's forward once more,
checked by counting the dots of the compiled programs) -- what recompute costs this CPU at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmem._util import with_host_devices  # noqa: E402  (imports no JAX)

# 8 virtual devices, as the CLI asks for them: on fewer cores, each runs its kernels on one thread.
os.environ.setdefault("XLA_FLAGS", with_host_devices("", 8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import estimate, get_hardware  # noqa: E402
from jaxmem.models import get_config, get_model, make_batch  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402

POLICIES = ("save-all", "selective", "recompute-all")


def plain_grad_seconds(model, seq: int, steps: int) -> dict[str, dict]:
    """Median gradient time of the unpipelined model, without and with recompute of every layer.

    Both run the same layer loop (the model's ``stage_sums`` as one stage); the recompute variant
    wraps each layer in ``jax.checkpoint``, so its backward recomputes each layer's forward. (Wrapping
    the whole loss in one ``jax.checkpoint`` would not: its forward is recomputed right where it was
    just computed, and XLA compiles it to the plain program.) The dots in each compiled program are
    counted to prove it: recompute adds the layers' forward dots once more.
    """
    import jax.numpy as jnp

    staged = dataclasses.replace(get_model(model), loss=None)  # the layer loop, not a fused reference loss
    params = staged.init(0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (32, seq)), jnp.int32)
    batch = make_batch(tokens, jnp.roll(tokens, -1, axis=1))
    variants = {
        "plain save": staged,
        "plain recompute": dataclasses.replace(staged, layer=jax.checkpoint(staged.layer)),
    }
    out = {}
    for name, variant in variants.items():
        grad = jax.jit(jax.grad(variant.plain_loss))
        dots = grad.lower(params, batch).compile().as_text().count(" dot(")
        jax.block_until_ready(grad(params, batch))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(grad(params, batch))
            times.append(time.perf_counter() - start)
        out[name] = {"seconds": float(np.median(times)), "dots": dots}
    if out["plain recompute"]["dots"] <= out["plain save"]["dots"]:
        raise SystemExit(f"the recompute control does not recompute: {out}")
    # The old control, for the record: one checkpoint around the whole loss (not timed).
    whole = jax.jit(jax.grad(jax.checkpoint(staged.plain_loss)))
    out["plain save"]["dots_whole_loss_checkpoint"] = whole.lower(params, batch).compile().as_text().count(" dot(")
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
        for name, got in plain_grad_seconds(model, seq, args.steps).items():
            rows.append(
                {
                    "seq_len": seq,
                    "policy": name,
                    "step_seconds_median": got["seconds"],
                    "compiled_dots": got["dots"],
                    **(
                        {"compiled_dots_whole_loss_checkpoint": got["dots_whole_loss_checkpoint"]}
                        if "dots_whole_loss_checkpoint" in got
                        else {}
                    ),
                    "pipelined": False,
                }
            )
            print(
                f"seq {seq:4d}  {name:14s} step {got['seconds']:.3f}s (jax.grad, one device, no pipeline; "
                f"{got['dots']} dots compiled)",
                file=sys.stderr,
            )
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
