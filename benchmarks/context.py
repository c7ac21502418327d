"""A context axis on 8 CPU devices: the same training run at context 1 and 4 (losses step by step), and
the compiled step's per-device bytes as the context axis grows.

    python benchmarks/context.py [--json] [--out benchmarks/results/context.json] [--seq 4096] [--steps 5]

Part 1 trains the tiny GPT (its position table widened to ``--seq``) at ``--seq`` tokens a sequence,
f32, 1F1B over P=2 ranks with M=2 microbatches of one sequence, on synthetic tokens, once with no
context axis (2 devices) and once with a context axis of 4 (8 devices), from the same seed: every
step's loss is compared (relative difference). Part 2 compiles that step (nothing run) at context 1,
2 and 4 and reads the compiled ledger of the first rank (``Trainer.measure_memory()``: the stash
from the tick program, the total from ``memory_analysis()``): the stash and the transient per device,
whose per-token parts fall as 1/C; the keys and values every device gathers for attention do not.
The policy is ``selective`` (the s x s probabilities recomputed), so that the step at context 1 fits
this machine. XLA:CPU's figures: no accelerator compiler is involved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def config(seq: int, context: int, steps: int):
    from jaxmem.config import TrainConfig
    from jaxmem.models import get_model

    return TrainConfig(
        model=get_model("tiny", max_seq_len=seq),
        pipe=2,
        microbatches=2,
        batch_size=2,
        seq_len=seq,
        context=context,
        policy="selective",
        data="synthetic",
        steps=steps,
        seed=0,
    )


def losses(seq: int, context: int, steps: int) -> tuple[list[float], float]:
    from jaxmem.train import Trainer

    trainer = Trainer(config(seq, context, steps))
    state = trainer.init_state()
    out = []
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics, _ = trainer.step(state)
        out.append(float(metrics["loss"]))
    return out, time.perf_counter() - start


def compiled(seq: int, context: int) -> dict:
    from jaxmem.train import Trainer

    ledger = Trainer(config(seq, context, 1)).measure_memory()
    first = ledger.ranks[0]
    return {
        "context": context,
        "device_bytes": first.device_bytes,
        **{f"{k}_bytes": first.categories[k].device for k in ("stash", "transient", "params")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    import jax

    runs = {}
    for context in (1, 4):
        print(f"training at context {context} ...", file=sys.stderr, flush=True)
        runs[context] = losses(args.seq, context, args.steps)
    rel = [abs(a - b) / abs(a) for a, b in zip(runs[1][0], runs[4][0])]
    rows = []
    for context in (1, 2, 4):
        print(f"compiling at context {context} ...", file=sys.stderr, flush=True)
        rows.append(compiled(args.seq, context))
    base = rows[0]
    for r in rows:
        r["stash_ratio"] = r["stash_bytes"] / base["stash_bytes"]
        r["transient_ratio"] = r["transient_bytes"] / base["transient_bytes"]
    record = {
        "benchmark": "context",
        "jax": jax.__version__,
        "command": "python benchmarks/context.py " + " ".join(sys.argv[1:]),
        "seq_len": args.seq,
        "losses": {f"context_{c}": v[0] for c, v in runs.items()},
        "seconds": {f"context_{c}": v[1] for c, v in runs.items()},
        "worst_relative_loss_difference": max(rel),
        "compiled": rows,
    }
    from plan_ranking import write_record

    if not write_record(record, args.out, args.json):
        print(f"losses at context 1: {[round(x, 6) for x in runs[1][0]]}")
        print(f"losses at context 4: {[round(x, 6) for x in runs[4][0]]}")
        print(f"worst relative difference: {max(rel):.2e}")
        for r in rows:
            print(
                f"context {r['context']}: stash {r['stash_bytes'] / 2**20:8.2f} MiB ({r['stash_ratio']:.3f}x), "
                f"transient {r['transient_bytes'] / 2**20:8.2f} MiB ({r['transient_ratio']:.3f}x), "
                f"device {r['device_bytes'] / 2**20:8.2f} MiB"
            )


if __name__ == "__main__":
    main()
