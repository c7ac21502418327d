"""The online profiler on a varying workload (sequence buckets + layer drop), three ways side by side:
adaptive (jaxmem.profiler), one static policy tuned for the largest shape, and full recompute.

    python benchmarks/profiler.py [--steps 240] [--layer-drop 0.05] [--budget-mib 36] [--json]

Every run compiles once per program signature it meets; the adaptive one at most once more per
signature: to escalate when a compiled program misses the budget, or to explore another policy in a
background thread (told the run's length, it explores only while the rest of the run pays for it).

The profiler's overhead is measured against a fourth run, ``plain_same_programs``: a plain loop
(no profiler) through the very programs the adaptive run ran, step by step (probes included), each
compiled in the foreground when first needed. Overhead = (adaptive run - plain run) / plain run, with
each run's foreground compile time taken out; what stays in is the profiler's prediction and
bookkeeping and the contention of its background compiles. Steady-state step time (every step but
each signature's first) and compile time are reported apart. A fixed policy's budget violations are
counted from memory_analysis() of every program it runs; the adaptive run has none by construction
(it never runs a program over the budget), so none is reported for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
# Timed as a first run: no compiled figures read back from an earlier one (jaxmem.memory._figures).
os.environ.setdefault("JAXMEM_CACHE_DIR", "off")
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
    programs = []  # [seq, dropped layers, policy, new signature?] of every step, for the plain replay
    for seq, drop in adaptive_workload(config):
        batch = dataclasses.replace(state.data, seq_len=seq).batch_at(state.data.position)
        arrays = trainer.put_batch(batch)
        before = len(profiler.records)
        t0 = time.perf_counter()
        state, loss = profiler.step(state, arrays, drop)
        new = len(profiler.records) > before  # predicted, compiled and run: not a steady step
        if not new:
            step_time += time.perf_counter() - t0
        programs.append([seq, sorted(drop), profiler.last_policy, new])  # JSON-ready
        state = _advance(state, config)
    jax.block_until_ready(loss)
    total = time.perf_counter() - start
    profiler.close()  # a background compile still running would slow the next run
    records = profiler.records
    foreground_compile = sum(profiler.compile_seconds) - sum(profiler.background_compile_seconds)
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
        "compile_seconds": foreground_compile,
        "background_compile_seconds": sum(profiler.background_compile_seconds),
        "run_seconds": total - foreground_compile,
        "steady_step_seconds": step_time,
        "programs": programs,
        "compiles": profiler.compile_count,
        "signatures": len(records),
        "budget_violations": sum(1 for r in records if r.compiled_bytes > budget),
        "overhead_seconds": profiler.overhead_seconds,
        "adapt_seconds_max": max(r.adapt_seconds for r in records),
        "extra_profiling_compiles_max": max(r.compiles for r in records) - 1,
        "explored": [{"signature": r.label, **r.explored} for r in records if r.explored],
        "time_correction": dict(profiler.correction),
        "loss_last": float(loss),
        "simulated_h100_seconds": simulated,
        "table": [r.to_json() for r in records],
    }


def _advance(state, config):
    data = dataclasses.replace(state.data, position=state.data.position + config.batch_size)
    return dataclasses.replace(state, data=data)


def plain_run(config: TrainConfig, programs) -> dict:
    """The same steps through the same programs (each step's policy as the adaptive run ran it, probes
    included) in a plain loop: no profiler, no prediction, no background compile. Each program is
    compiled when first needed, its compile timed apart from the steps; ``steady_step_seconds`` sums
    the steps the adaptive run counted as steady (all but each signature's first)."""
    from jaxmem.pipeline import Pipeline

    trainer = Trainer(config)
    state = trainer.init_state()
    base = trainer.pipeline
    compiled, compile_seconds = {}, 0.0
    start = time.perf_counter()
    step_time = 0.0
    for seq, drop, policy, new in programs:
        drop = frozenset(drop)
        batch = dataclasses.replace(state.data, seq_len=seq).batch_at(state.data.position)
        arrays = trainer.put_batch(batch)
        key = (seq, drop, policy)
        t0 = time.perf_counter()
        if key not in compiled:
            pipeline = Pipeline(
                base.model, base.schedule, base.mesh, layer_counts=base.layer_counts, policy=policy, drop_layers=drop
            )
            spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in arrays.items()}
            compiled[key] = trainer.build_step(pipeline, spec).lower(state.params, state.opt_state, spec).compile()
            compile_seconds += time.perf_counter() - t0
        first = time.perf_counter()
        params, opt_state, loss = compiled[key](state.params, state.opt_state, arrays)
        if isinstance(loss, dict):
            loss = loss["loss"]
        jax.block_until_ready(loss)
        if not new:  # the adaptive run's steady steps; a probe compiled here is timed apart
            step_time += time.perf_counter() - first
        state = _advance(dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), config)
    total = time.perf_counter() - start
    return {
        "seconds": total,
        "compile_seconds": compile_seconds,
        "run_seconds": total - compile_seconds,
        "steady_step_seconds": step_time,
        "compiles": len(compiled),
        "loss_last": float(loss),
    }


MEANS = ("seconds", "compile_seconds", "run_seconds", "steady_step_seconds")


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
    runs = {name: [] for name in ("adaptive", "plain_same_programs", "static_largest", "recompute_all")}
    for repeat in range(args.repeats):
        for name, policy in ways:
            print(f"running {name} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr)
            r = run(config, budget, policy)
            runs[name].append(r)
            print(
                f"  {name:19s} {r['seconds']:7.1f}s total, {r['compile_seconds']:6.1f}s compiling, "
                f"{r['steady_step_seconds']:6.1f}s in steady steps, {r['compiles']} compiles",
                file=sys.stderr,
            )
            if name == "adaptive":
                print(f"running plain_same_programs ({repeat + 1}/{args.repeats}) ...", file=sys.stderr)
                p = plain_run(config, r["programs"])
                runs["plain_same_programs"].append(p)
                print(
                    f"  {'plain_same_programs':19s} {p['seconds']:7.1f}s total, {p['compile_seconds']:6.1f}s "
                    f"compiling, {p['steady_step_seconds']:6.1f}s in steady steps, {p['compiles']} compiles",
                    file=sys.stderr,
                )

    # Means over the repeats (each run is kept under "runs").
    def mean(name, key):
        return sum(r[key] for r in runs[name]) / len(runs[name])

    results = {name: {key: sum(r[key] for r in rs) / len(rs) for key in MEANS} for name, rs in runs.items()}
    adaptive, plain = results["adaptive"], results["plain_same_programs"]
    pairs = list(zip(runs["adaptive"], runs["plain_same_programs"]))
    record = {
        "benchmark": "profiler",
        "budget_bytes": int(budget),
        "workload": {"buckets": list(config.seq_len_schedule), "layer_drop": args.layer_drop, "steps": args.steps},
        "repeats": args.repeats,
        "static_policy": static,
        "means": results,
        # The profiler's cost: the adaptive run against a plain loop through the same programs, compile
        # time taken out of both (foreground compiles; the background ones stay in, as contention).
        "overhead_fraction": (adaptive["run_seconds"] - plain["run_seconds"]) / plain["run_seconds"],
        "overhead_fraction_per_repeat": [(a["run_seconds"] - p["run_seconds"]) / p["run_seconds"] for a, p in pairs],
        "steady_overhead_fraction": (adaptive["steady_step_seconds"] - plain["steady_step_seconds"])
        / plain["steady_step_seconds"],
        "wrapper_seconds": mean("adaptive", "overhead_seconds"),
        "compile_seconds": {name: r["compile_seconds"] for name, r in results.items()},
        "steady_step_seconds": {name: r["steady_step_seconds"] for name, r in results.items()},
        "adapt_seconds_max": max(r["adapt_seconds_max"] for r in runs["adaptive"]),
        "extra_profiling_compiles_max": max(r["extra_profiling_compiles_max"] for r in runs["adaptive"]),
        # A fixed policy runs whatever it compiles to: its violations are measured (the adaptive run
        # refuses to run a program over the budget, so it has none by construction: not reported).
        "budget_violations_static": max(r["budget_violations"] for r in runs["static_largest"]),
        "budget_violations_recompute_all": max(r["budget_violations"] for r in runs["recompute_all"]),
        "speedup_vs_static_largest": results["static_largest"]["seconds"] / adaptive["seconds"],
        "speedup_vs_recompute_all": results["recompute_all"]["seconds"] / adaptive["seconds"],
        "steady_speedup_vs_static_largest": results["static_largest"]["steady_step_seconds"]
        / adaptive["steady_step_seconds"],
        "steady_speedup_vs_recompute_all": results["recompute_all"]["steady_step_seconds"]
        / adaptive["steady_step_seconds"],
        "simulated_h100_speedup_vs_static_largest": mean("static_largest", "simulated_h100_seconds")
        / mean("adaptive", "simulated_h100_seconds"),
        "simulated_h100_speedup_vs_recompute_all": mean("recompute_all", "simulated_h100_seconds")
        / mean("adaptive", "simulated_h100_seconds"),
        "runs": runs,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(
            f"profiler overhead vs a plain loop through the same programs (compiles excluded): "
            f"{record['overhead_fraction']:+.1%} (steady steps {record['steady_overhead_fraction']:+.1%}); "
            f"adaptive {adaptive['seconds']:.1f}s vs static ({static}) {results['static_largest']['seconds']:.1f}s "
            f"({record['speedup_vs_static_largest']:.2f}x) vs recompute-all {results['recompute_all']['seconds']:.1f}s "
            f"({record['speedup_vs_recompute_all']:.2f}x)"
        )
    return record


if __name__ == "__main__":
    main()
