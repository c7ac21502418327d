"""The CPU step-time model the planner uses on this machine: fit its constants, then check them on
configurations the fit did not see, and check that they rank configurations in the measured order.

    python benchmarks/plan_ranking.py [--steps 12] [--rounds 2] [--out benchmarks/results/plan_ranking.json]

When the virtual devices share fewer CPU cores, ``jaxmem.memory.estimate`` (and so ``jaxmem train
--plan auto``, ``jaxmem plan --hardware cpu`` and the elastic recovery planner) predicts a step as

    (step_flops + ticks x tick_flops) / rate + even + imbalance x excess

with ``ticks``, ``even`` and ``excess`` from ``jaxmem.memory.shared_core_terms`` (the lockstep
schedule and the actions' costs at the machine's calibrated ``rate``). An action's cost is its FLOPs
plus, for the residuals it stashes (F) or reads back (B), ``stash_flops_per_byte`` per byte (a write
to the stash and a read back; about 6 FLOPs a byte on the executor that writes residuals in place,
79 when the stash path still copied). This script measures the jitted training step of the tiny GPT
(batch 32 x 64; median of ``--steps`` steps after two warm-up steps, the best of ``--rounds``
interleaved rounds) on the FIT configurations (schedules, meshes, microbatch counts and policies),
fits the four constants (for each stash price on a log grid, non-negative least squares of the
relative error of the other three; the best price wins), and reports the prediction error and
Spearman rank correlation on the HOLDOUT configurations, with the fitted constants and with the ones
the package ships (``jaxmem.memory.CPU_LOCKSTEP``). ``--measured RECORD`` re-fits an earlier
record's measurements without measuring. Timings on this machine drift by up to a third between
runs.
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
# Timed as a first run: no compiled figures read back from an earlier one (jaxmem.memory._figures).
os.environ.setdefault("JAXMEM_CACHE_DIR", "off")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import _cost as cost  # noqa: E402
from jaxmem.memory import estimate, get_hardware, shared_core_terms  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402

# (schedule, pipe P, data D, microbatches M, virtual V, policy); 4 or 2 devices on this machine's cores.
FIT = [
    ("1f1b", 4, 1, 4, None, "save-all"),
    ("1f1b", 4, 1, 8, None, "save-all"),
    ("1f1b", 4, 1, 32, None, "save-all"),
    ("1f1b", 2, 2, 4, None, "save-all"),
    ("1f1b", 2, 2, 8, None, "save-all"),
    ("1f1b", 2, 1, 2, None, "save-all"),
    ("zbv", 2, 2, 16, None, "save-all"),
    ("1f1b", 2, 2, 4, None, "recompute-all"),
    ("gpipe", 4, 1, 1, None, "save-all"),
    ("gpipe", 4, 1, 1, None, "recompute-all"),
    ("1f1b", 2, 1, 2, None, "selective"),
]
HOLDOUT = [
    ("gpipe", 4, 1, 8, None, "save-all"),
    ("1f1b", 4, 1, 16, None, "save-all"),
    ("interleaved-1f1b", 2, 1, 8, 2, "save-all"),
    ("interleaved-1f1b", 4, 1, 32, 2, "save-all"),
    ("zbv", 2, 2, 4, None, "save-all"),
    ("1f1b", 2, 1, 8, None, "save-all"),
    ("gpipe", 2, 2, 8, None, "save-all"),
    ("1f1b", 4, 1, 8, None, "recompute-all"),
    ("1f1b", 2, 2, 8, None, "selective"),
    ("1f1b", 2, 1, 1, None, "save-all"),
]


def config_of(schedule, pipe, data, microbatches, virtual, policy="save-all", batch=32, seq=64) -> TrainConfig:
    return TrainConfig(
        schedule=schedule,
        pipe=pipe,
        data_parallel=data,
        microbatches=microbatches,
        virtual=virtual,
        policy=policy,
        batch_size=batch,
        seq_len=seq,
        steps=1,
    )


def name_of(schedule, pipe, data, microbatches, virtual, policy="save-all") -> str:
    return (
        f"{schedule} P={pipe} D={data} M={microbatches}"
        + (f" V={virtual}" if virtual else "")
        + ("" if policy == "save-all" else f" {policy}")
    )


def measured_step_seconds(config: TrainConfig, steps: int) -> float:
    """Median seconds of the jitted training step on one device-resident batch, after two warm-up
    steps (the first compiles)."""
    trainer = Trainer(config)
    state = trainer.init_state()
    batch, _ = state.data.next()
    batch = trainer.put_batch(batch)
    params, opt_state = state.params, state.opt_state
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        params, opt_state, metrics = trainer.step_fn(params, opt_state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def terms(
    config: TrainConfig, hardware, stash_flops_per_byte: float, vocab_parallel: bool = False
) -> tuple[int, float, float]:
    """The lockstep terms of a configuration on ``hardware`` (its FLOP costs, its cores), its stashed
    bytes priced at ``stash_flops_per_byte`` (the one constant that enters the action costs).

    ``vocab_parallel`` False: the recorded runs predate the vocabulary split over the pipe ranks (each
    rank held the whole embedding and head), so they are priced as they ran."""
    schedule = config.build_schedule()
    lockstep = dataclasses.replace(hardware.lockstep, stash_flops_per_byte=stash_flops_per_byte)
    costs = estimate(
        config.build_model(),
        schedule,
        config.policy or "save-all",
        batch=config.batch_size,
        seq=config.seq_len,
        data_parallel=config.data_parallel,
        layer_counts=config.layers_per_stage,
        hardware=dataclasses.replace(hardware, lockstep=lockstep),
        memory=False,
        vocab_parallel=vocab_parallel,
    ).costs
    return shared_core_terms(schedule, costs, config.data_parallel, hardware.cores)


def predict(t, rate: float, step_flops: float, tick_flops: float, imbalance: float) -> float:
    ticks, even, excess = t
    return (step_flops + ticks * tick_flops) / rate + even + imbalance * excess


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def row_terms(rows, hardware, stash_flops_per_byte: float) -> list:
    return [terms(config_of(*r["spec"]), hardware, stash_flops_per_byte) for r in rows]


def fit(rows, hardware) -> tuple[float, float, float, float]:
    """The four constants: for each stash price on a log grid, non-negative least squares of the
    relative residual of measured = step/rate + ticks x tick/rate + even + imbalance x excess; the
    price with the least squared relative error wins."""
    from scipy.optimize import nnls

    rate = hardware.flops_per_second
    measured = np.array([r["measured_seconds"] for r in rows])
    best = None
    for price in [0.0, *np.geomspace(1.0, 1e3, 31)]:
        t = row_terms(rows, hardware, price)
        a = np.array([[1.0 / rate, ticks / rate, excess] for ticks, _, excess in t]) / measured[:, None]
        b = (measured - np.array([even for _, even, _ in t])) / measured
        (step_flops, tick_flops, imbalance), residual = nnls(a, b)
        if best is None or residual < best[0]:
            best = (residual, (float(step_flops), float(tick_flops), float(imbalance), float(price)))
    return best[1]


def evaluate(rows, hardware, constants) -> dict:
    *lockstep, price = constants
    rate = hardware.flops_per_second
    predicted = [predict(t, rate, *lockstep) for t in row_terms(rows, hardware, price)]
    measured = [r["measured_seconds"] for r in rows]
    errors = [p / m - 1 for p, m in zip(predicted, measured)]
    return {
        "predicted_seconds": predicted,
        "worst_error": max(abs(e) for e in errors),
        "mean_abs_error": float(np.mean(np.abs(errors))),
        "spearman": spearman(predicted, measured),
    }


def measure_rounds(rows: dict, rounds: int, groups, name_of, measure) -> None:
    """Add ``rounds`` interleaved measurements of every spec in ``groups`` ((group, specs) pairs) to
    ``rows``, keyed by ``name_of(*spec)``: each row keeps every round's seconds and the fastest.
    ``measure(spec, name, round_)`` returns one measurement in seconds per step."""
    for round_ in range(rounds):
        for group, specs in groups:
            for spec in specs:
                name = name_of(*spec)
                seconds = measure(spec, name, round_)
                row = rows.setdefault(name, {"config": name, "group": group, "spec": list(spec)})
                row.setdefault("measured_per_round", []).append(seconds)
                row["measured_seconds"] = min(row["measured_per_round"])
                print(f"round {round_}: {name:40s} {seconds:.3f} s/step", file=sys.stderr, flush=True)


def record_to_update(parser: argparse.ArgumentParser, out: str | None) -> dict:
    """The record at ``out`` that ``--update`` replaces some rows of (the parser's error when none)."""
    if not out or not os.path.exists(out):
        parser.error("--update needs --out naming an existing record")
    with open(out) as f:
        return json.load(f)


def write_record(record: dict, out: str | None, as_json: bool) -> bool:
    """Write ``record`` to ``out`` (if given) and print it as JSON when asked; True if printed."""
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
    if as_json:
        print(json.dumps(record, indent=2))
    return as_json


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per configuration (median)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the best median is kept)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the record here")
    parser.add_argument(
        "--measured",
        metavar="RECORD",
        help="re-fit and re-evaluate the measurements of an earlier record (its rate and rows) instead of measuring",
    )
    args = parser.parse_args(argv)
    hardware = get_hardware("cpu")
    rows = {}
    if args.measured:
        with open(args.measured) as f:
            earlier = json.load(f)
        if any("spec" not in r for r in earlier["rows"]):
            parser.error(f"{args.measured} predates the stash-price fit (its rows have no 'spec'); measure again")
        hardware = dataclasses.replace(hardware, peak_flops=earlier["hardware"]["peak_flops"], efficiency=1.0)
        rows = {r["config"]: r for r in earlier["rows"]}
    measure_rounds(
        rows,
        0 if args.measured else args.rounds,
        (("fit", FIT), ("holdout", HOLDOUT)),
        name_of,
        lambda spec, name, round_: measured_step_seconds(config_of(*spec), args.steps),
    )
    fit_rows = [r for r in rows.values() if r["group"] == "fit"]
    hold_rows = [r for r in rows.values() if r["group"] == "holdout"]
    fitted = fit(fit_rows, hardware)
    names = ("step_flops", "tick_flops", "imbalance", "stash_flops_per_byte")
    shipped = tuple(getattr(cost.CPU_LOCKSTEP, name) for name in names)
    record = {
        "benchmark": "plan_ranking",
        "model": "tiny",
        "batch_size": 32,
        "seq_len": 64,
        "cpu_count": os.cpu_count(),
        "hardware": hardware.to_json(),
        "rows": list(rows.values()),
        "fitted": dict(zip(names, fitted)),
        "shipped": dict(zip(names, shipped)),
        "fit_with_fitted": evaluate(fit_rows, hardware, fitted),
        "holdout_with_fitted": evaluate(hold_rows, hardware, fitted),
        "holdout_with_shipped": evaluate(hold_rows, hardware, shipped),
        "all_with_shipped": evaluate(fit_rows + hold_rows, hardware, shipped),
    }
    if not write_record(record, args.out, args.json):
        step, tick, imbalance, price = fitted
        print(
            f"fitted: Lockstep(step_flops={step:.3g}, tick_flops={tick:.3g}, imbalance={imbalance:.2f}, "
            f"stash_flops_per_byte={price:.3g})"
        )
        shipped_rows = record["all_with_shipped"]["predicted_seconds"]
        for row, predicted in zip(fit_rows + hold_rows, shipped_rows):
            print(
                f"{row['group']:8s} {row['config']:40s} measured {row['measured_seconds']:.3f} s  "
                f"predicted (shipped) {predicted:.3f} s  ({predicted / row['measured_seconds'] - 1:+.0%})"
            )
        for key in ("fit_with_fitted", "holdout_with_fitted", "holdout_with_shipped"):
            r = record[key]
            print(
                f"{key:22s} worst error {r['worst_error']:.0%}, mean {r['mean_abs_error']:.0%}, "
                f"Spearman {r['spearman']:.2f}"
            )
    return record


if __name__ == "__main__":
    main()
