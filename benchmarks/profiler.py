"""The online profiler on a varying workload (sequence buckets + layer drop), three ways side by side:
adaptive (jaxmem.profiler), one static policy tuned for the largest shape, and full recompute.

    python benchmarks/profiler.py [--steps 240] [--layer-drop 0.05] [--budget-mib 36] [--json]

Every run compiles once per program signature it meets; the adaptive one at most once more per
signature: to escalate when a compiled program misses the budget, or to explore another policy in a
background thread (told the run's length, it explores only while the rest of the run pays for it).
Budget violations are counted from memory_analysis() of every compiled program that runs. The
profiler's overhead is the time spent in its wrapper (signature, lookup, bookkeeping; not the
compiles) over the step time, in the same run.
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

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.models import get_config  # noqa: E402
from jaxmem.profiler import AdaptiveProfiler  # noqa: E402
from jaxmem.train import Trainer, adaptive_workload  # noqa: E402


def run(config: TrainConfig, budget: float, policy: str | None):
    """One pass over the workload; ``policy`` None = adaptive, else that policy for every signature."""
    trainer = Trainer(config)
    state = trainer.init_state()
    profiler = AdaptiveProfiler(
        trainer.pipeline,
        budget,
        build_step=trainer.build_step,
        batch_sharding=trainer.batch_sharding,
        policies=None if policy is None else (policy,),
        margin=0.0 if policy is not None else 1.02,
        explore=policy is None,
        horizon=config.steps,
    )
    if policy is not None:
        profiler.budget = float("inf")  # a fixed policy runs whatever it compiles to; violations counted below
    start = time.perf_counter()
    step_time = 0.0
    for seq, drop in adaptive_workload(config):
        batch = dataclasses.replace(state.data, seq_len=seq).batch_at(state.data.position)
        arrays = trainer.put_batch(batch)
        before = len(profiler.records)
        t0 = time.perf_counter()
        state, loss = profiler.step(state, arrays, drop)
        if len(profiler.records) == before:
            step_time += time.perf_counter() - t0
        state = dataclasses.replace(
            state, data=dataclasses.replace(state.data, position=state.data.position + config.batch_size)
        )
    jax.block_until_ready(loss)
    total = time.perf_counter() - start
    profiler.close()  # a background compile still running would slow the next run
    records = profiler.records
    # The same workload on a cluster profile, simulated (compiles excluded): every step at the
    # simulated time of the policy chosen from that profile's predictions (adaptive), or of the
    # fixed policy. CPU measurements do not carry over, so the adaptive choice here is predict-only.
    h100 = AdaptiveProfiler(trainer.pipeline, budget, build_step=trainer.build_step, hardware="h100")
    simulated = 0.0
    for r in records:
        (batch, seq), drop = r.signature[0], frozenset(r.signature[2])
        options = {p: h100.predict(p, batch, seq, drop) for p in ((policy,) if policy else h100.policies)}
        fitting = [o for o in options.values() if o[0] * h100.margin <= budget] or list(options.values())
        simulated += r.seen * min(o[2] for o in fitting)
    return {
        "seconds": total,
        "steady_step_seconds": step_time,
        "compiles": profiler.compile_count,
        "signatures": len(records),
        "budget_violations": sum(1 for r in records if r.compiled_bytes > budget),
        "overhead_seconds": profiler.overhead_seconds,
        "adapt_seconds_max": max(r.adapt_seconds for r in records),
        "adapt_steps_max": 1,  # the first step of a new signature already runs its adapted program
        "extra_profiling_compiles_max": max(r.compiles for r in records) - 1,
        "explored": [{"signature": r.label, **r.explored} for r in records if r.explored],
        "time_correction": dict(profiler.correction),
        "loss_last": float(loss),
        "simulated_h100_seconds": simulated,
        "table": [r.to_json() for r in records],
    }


MEANS = ("seconds", "steady_step_seconds", "overhead_seconds", "simulated_h100_seconds")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--budget-mib", type=float, default=36.0)
    parser.add_argument("--buckets", default="32,64,128")
    parser.add_argument("--layer-drop", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=1, help="run the three ways this many times (interleaved)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    budget = args.budget_mib * 2**20
    buckets = tuple(int(b) for b in args.buckets.split(","))
    config = TrainConfig(
        model=dataclasses.replace(get_config("tiny"), max_seq_len=max(buckets)),
        seq_len=max(buckets),
        steps=args.steps,
        seq_len_schedule=buckets,
        layer_drop=args.layer_drop,
        budget=budget,
        adaptive=True,
    )
    # The static policy: the cheapest on the ladder that fits the largest shape.
    probe_trainer = Trainer(config)
    probe = AdaptiveProfiler(probe_trainer.pipeline, budget, build_step=probe_trainer.build_step)
    largest = max(config.seq_len_schedule)
    static = next(p for p in probe.policies if probe.predict(p, config.batch_size, largest, frozenset())[0] <= budget)
    ways = (("adaptive", None), ("static_largest", static), ("recompute_all", "recompute-all"))
    runs = {name: [] for name, _ in ways}
    for repeat in range(args.repeats):
        for name, policy in ways:
            print(f"running {name} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr)
            r = run(config, budget, policy)
            runs[name].append(r)
            print(
                f"  {name:15s} {r['seconds']:7.1f}s total, {r['steady_step_seconds']:6.1f}s in cached steps, "
                f"{r['compiles']} compiles, {r['budget_violations']} violations",
                file=sys.stderr,
            )
    # Means over the repeats (each run is kept under "runs").
    results = {
        name: {key: sum(r[key] for r in rs) / len(rs) for key in MEANS}
        | {"budget_violations": max(r["budget_violations"] for r in rs)}
        for name, rs in runs.items()
    }
    adaptive = results["adaptive"]
    adaptive["adapt_steps_max"] = runs["adaptive"][0]["adapt_steps_max"]
    adaptive["adapt_seconds_max"] = max(r["adapt_seconds_max"] for r in runs["adaptive"])
    adaptive["extra_profiling_compiles_max"] = max(r["extra_profiling_compiles_max"] for r in runs["adaptive"])
    record = {
        "benchmark": "profiler",
        "budget_bytes": int(budget),
        "workload": {"buckets": list(config.seq_len_schedule), "layer_drop": args.layer_drop, "steps": args.steps},
        "repeats": args.repeats,
        "static_policy": static,
        "budget_violations": sum(r["budget_violations"] for r in (adaptive,)),
        "budget_violations_static": results["static_largest"]["budget_violations"],
        "overhead_fraction": adaptive["overhead_seconds"] / adaptive["steady_step_seconds"],
        "adapt_steps_max": adaptive["adapt_steps_max"],
        "adapt_seconds_max": adaptive["adapt_seconds_max"],
        "extra_profiling_compiles_max": adaptive["extra_profiling_compiles_max"],
        "adaptive_seconds": adaptive["seconds"],
        "static_largest_seconds": results["static_largest"]["seconds"],
        "recompute_all_seconds": results["recompute_all"]["seconds"],
        "adaptive_steady_seconds": adaptive["steady_step_seconds"],
        "static_largest_steady_seconds": results["static_largest"]["steady_step_seconds"],
        "recompute_all_steady_seconds": results["recompute_all"]["steady_step_seconds"],
        "speedup_vs_static_largest": results["static_largest"]["seconds"] / adaptive["seconds"],
        "speedup_vs_recompute_all": results["recompute_all"]["seconds"] / adaptive["seconds"],
        "simulated_h100_speedup_vs_static_largest": results["static_largest"]["simulated_h100_seconds"]
        / adaptive["simulated_h100_seconds"],
        "simulated_h100_speedup_vs_recompute_all": results["recompute_all"]["simulated_h100_seconds"]
        / adaptive["simulated_h100_seconds"],
        "speedup_vs_static_largest_per_repeat": [
            s["seconds"] / a["seconds"] for a, s in zip(runs["adaptive"], runs["static_largest"])
        ],
        "speedup_vs_recompute_all_per_repeat": [
            c["seconds"] / a["seconds"] for a, c in zip(runs["adaptive"], runs["recompute_all"])
        ],
        "runs": runs,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(
            f"adaptive {record['adaptive_seconds']:.1f}s vs static ({static}) {record['static_largest_seconds']:.1f}s "
            f"({record['speedup_vs_static_largest']:.2f}x) vs recompute-all {record['recompute_all_seconds']:.1f}s "
            f"({record['speedup_vs_recompute_all']:.2f}x); overhead {record['overhead_fraction']:.3%}; "
            f"violations {record['budget_violations']}"
        )
    return record


if __name__ == "__main__":
    main()
