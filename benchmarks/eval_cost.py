"""What an evaluation batch costs against a train step of the same batch (issue 28, item 5).

    python benchmarks/eval_cost.py [--steps 10] [--json]

Tiny GPT, batch 64 x 64 tokens, P=4 on 4 virtual CPU devices (the setup of ``benchmarks/overhead.py``).
For each schedule and M: the median seconds of the train step (``Trainer.step``: the pipelined loss
and gradient and the update), of an evaluation batch as ``Trainer.eval_loss`` runs it (the schedule's
forwards alone, ``Pipeline.loss_fn``), and of the loss from the pipelined loss-and-gradient program,
which is what evaluation ran before the forward-only schedule. Writes ``benchmarks/results/eval_cost.json``.
CPU timings: the 4 virtual devices share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402

CASES = [("1f1b", None), ("interleaved-1f1b", 2), ("zbv", None), ("chronos", None)]


def median_seconds(fn, steps: int) -> float:
    fn()  # compiled and warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def one_row(schedule: str, virtual: int | None, M: int, steps: int) -> dict:
    config = TrainConfig(
        model="tiny",
        schedule=schedule,
        virtual=virtual,
        pipe=4,
        microbatches=M,
        batch_size=64,
        seq_len=64,
        steps=1,
        data="synthetic",
        policy="save-all",
    )
    trainer = Trainer(config)
    state = trainer.init_state()
    batch = trainer.put_batch(trainer.data_iterator().batch_at(0))
    pipeline = trainer.pipeline
    params = jax.tree.map(lambda a: a.copy(), pipeline.compute_params(state.params))
    held = [state.params, state.opt_state]

    def train_step():  # the step donates its state: each call takes the last one's
        held[0], held[1], metrics = trainer.step_fn(held[0], held[1], batch)
        return metrics

    forward = jax.jit(pipeline.loss_fn(trainer.batch_spec()))
    grad = pipeline.grad_fn(trainer.batch_spec())
    with_grad = jax.jit(lambda p, b: grad(p, b)[0])
    train = median_seconds(train_step, steps)
    eval_s = median_seconds(lambda: forward(params, batch), steps)
    old_s = median_seconds(lambda: with_grad(params, batch), steps)
    return {
        "schedule": schedule,
        "devices": config.num_devices,
        "microbatches": M,
        "train_step_s": train,
        "eval_batch_s": eval_s,
        "loss_and_grad_s": old_s,
        "eval_over_train": eval_s / train,
        "loss_and_grad_over_train": old_s / train,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed repetitions of each program (median)")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args()
    rows = []
    for schedule, virtual in CASES:
        for M in (8, 32):
            row = one_row(schedule, virtual, M, args.steps)
            rows.append(row)
            print(
                f"{schedule:17s} M={M:2d}: train {row['train_step_s']:.3f} s, eval {row['eval_batch_s']:.3f} s "
                f"({row['eval_over_train']:.2f}x), loss+grad {row['loss_and_grad_s']:.3f} s "
                f"({row['loss_and_grad_over_train']:.2f}x)",
                file=sys.stderr,
            )
    record = {"benchmark": "eval_cost", "model": "tiny", "batch": 64, "seq_len": 64, "rows": rows}
    out = os.path.join(os.path.dirname(__file__), "results", "eval_cost.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        worst = max(r["eval_over_train"] for r in rows)
        print(f"worst eval / train: {worst:.2f}x; wrote {out}")


if __name__ == "__main__":
    main()
