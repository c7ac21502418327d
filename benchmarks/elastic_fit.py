"""The multi-process CPU step model the elastic recovery planner uses: fit its constants on
failure-free ``jaxmem launch`` runs, then check them on runs of a model shape and meshes the fit did
not see.

    python benchmarks/elastic_fit.py [--steps 24] [--rounds 1] [--out benchmarks/results/elastic_fit.json]

``jaxmem.elastic.choose_recovery`` predicts a launched job's step as the shared-core lockstep model of
``jaxmem.memory`` (the one ``--plan auto`` uses), here with ``jaxmem.memory.CPU_LOCKSTEP_PROCESSES``:

    ((step_flops + ticks x tick_flops + [processes > 1] (process_step_flops + ticks x process_tick_flops))
     / rate + even + imbalance x excess) x (processes / cores) ** oversubscription   (when processes > cores)

where ``imbalance`` is ``pooled_imbalance`` when each process has fewer devices than cores (XLA:CPU
then runs a device's kernels on a pool of all the cores, and a busy device takes the cores an idle
one leaves; with as many or more, each device runs on one thread and cannot)

with ``ticks`` (those that exchange between pipe ranks: none at pipe 1), ``even`` and ``excess`` from
``jaxmem.memory.shared_core_terms`` (the 1F1B lockstep schedule and save-all FLOP costs at this
machine's calibrated ``rate``). This script launches each configuration (``jaxmem launch --nprocs N
--devices-per-proc K -- --pipe P --data-parallel D --microbatches M``, batch 32 x 64, one checkpoint
at the end; one process runs alone, as a recovery onto the last survivor does) and takes the workers'
median step time (compile excluded), then fits the seven constants on what the planner uses. Recovery
keeps the model and the microbatch count, and the planner scales every candidate by measured /
predicted of the run that was going before the failure, so what it needs right are step-time RATIOS
within a group of one model and one microbatch count. For each oversubscription exponent on a grid,
bounded least squares of the log error with each group's mean taken out (the calibration), beside
the raw log error at weight ``ABSOLUTE_WEIGHT`` (0.3: kept small so the ratios come first, but the
uncalibrated view -- ``jaxmem elastic recovery`` without ``--step-seconds`` -- keeps its scale); the
exponent with the least error wins. The stash price stays 0 (every elastic candidate runs save-all,
so a per-byte price cannot be told apart from the FLOP rate).

Two errors are reported, on the FIT configurations (the tiny GPT) and on the HOLDOUT ones (llama-tiny,
a different model shape, and meshes the fit did not see): the absolute error at the rate measured at
startup, and the CALIBRATED error the planner makes -- each group's first run (fit runs first) plays
the measured pre-failure run. Step times on this machine drift by up to a third between runs, and by
~15% with more processes than cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from elastic import launch  # noqa: E402
from plan_ranking import measure_rounds, spearman, terms, write_record  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import CPU_LOCKSTEP_PROCESSES, Lockstep, get_hardware  # noqa: E402
from jaxmem.pipeline import balanced_layers  # noqa: E402

# (model, processes, devices per process, pipe P, data D, microbatches M); 1F1B, batch 32 x 64.
# The first of each model is its "pre-failure" configuration for the calibrated error.
FIT = [
    ("tiny", 2, 2, 4, 1, 4),
    ("tiny", 1, 2, 1, 2, 4),
    ("tiny", 1, 2, 2, 1, 4),
    ("tiny", 1, 4, 4, 1, 4),
    ("tiny", 3, 1, 3, 1, 4),
    ("tiny", 2, 1, 2, 1, 4),
    ("tiny", 2, 2, 2, 2, 4),
    ("tiny", 4, 1, 4, 1, 4),
    ("tiny", 2, 2, 4, 1, 8),
    ("tiny", 2, 1, 2, 1, 8),
    ("tiny", 4, 1, 4, 1, 8),
    ("tiny", 1, 2, 2, 1, 8),
]
HOLDOUT = [
    ("llama-tiny", 2, 2, 4, 1, 4),
    ("llama-tiny", 3, 1, 3, 1, 4),
    ("llama-tiny", 2, 1, 2, 1, 4),
    ("llama-tiny", 2, 2, 2, 2, 4),
    ("llama-tiny", 4, 1, 4, 1, 8),
    ("tiny", 4, 1, 2, 2, 4),
    ("tiny", 4, 2, 4, 2, 4),
    ("tiny", 3, 1, 3, 1, 8),
    ("llama-tiny", 1, 2, 1, 2, 4),
    ("llama-tiny", 1, 2, 2, 1, 4),
    ("tiny", 1, 3, 3, 1, 4),
    ("tiny", 1, 2, 1, 2, 8),
]
BATCH, SEQ = 32, 64
# Weight of the absolute (uncalibrated) log error beside the calibrated one: small, so the planner's
# ratios come first, but the uncalibrated view (`jaxmem elastic recovery` without --step-seconds) keeps
# its scale.
ABSOLUTE_WEIGHT = 0.3
NAMES = (
    "step_flops",
    "tick_flops",
    "imbalance",
    "oversubscription",
    "process_step_flops",
    "process_tick_flops",
    "pooled_imbalance",
)


def name_of(model, nprocs, per_proc, pipe, data, microbatches) -> str:
    return f"{model} {nprocs}x{per_proc} procs P={pipe} D={data} M={microbatches}"


def config_of(model, nprocs, per_proc, pipe, data, microbatches) -> TrainConfig:
    """The configuration, its layers split as the recovery planner splits them (3, 3, 2 on 3 stages)."""
    layers = TrainConfig(model=model).build_model().n_layers
    return TrainConfig(
        model=model,
        layers_per_stage=None if layers % pipe == 0 else balanced_layers(layers, pipe),
        pipe=pipe,
        data_parallel=data,
        microbatches=microbatches,
        batch_size=BATCH,
        seq_len=SEQ,
        steps=1,
    )


def measured_step_seconds(spec, steps: int, run_dir: Path) -> float:
    model, nprocs, per_proc, pipe, data, microbatches = spec
    counts = config_of(*spec).layers_per_stage
    train_args = [] if counts is None else ["--layers-per-stage", ",".join(map(str, counts))]
    train_args += [
        "--model",
        model,
        "--pipe",
        str(pipe),
        "--data-parallel",
        str(data),
        "--microbatches",
        str(microbatches),
        "--batch-size",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(steps),  # one checkpoint, at the end
    ]
    result = launch(run_dir, nprocs, per_proc, train_args)
    return float(result["summary"]["step_seconds_median"])


def spec_terms(spec, hardware) -> tuple:
    """The lockstep terms of a launch as the recovery planner prices it (the vocabulary split where the
    model declares one, as the launched runs split it)."""
    return terms(config_of(*spec), hardware, 0.0, vocab_parallel=None)


def pooled_row(row, hardware) -> bool:
    """Each process of the launch has fewer devices than cores: XLA:CPU runs its devices' kernels on
    a pool of all the cores (``jaxmem._util.with_host_devices``)."""
    return row["spec"][2] < hardware.cores


def group_of(row) -> tuple:
    """Runs the planner compares with one calibration: one model at one microbatch count (recovery
    keeps the batch and its microbatches)."""
    return row["spec"][0], row["spec"][5]


def oversubscribed(hardware, processes: int, exponent: float) -> float:
    """The profile's slowdown of ``processes`` on its cores, for a trial ``exponent``."""
    lockstep = dataclasses.replace(CPU_LOCKSTEP_PROCESSES, oversubscription=exponent)
    return dataclasses.replace(hardware, processes=processes, lockstep=lockstep).oversubscribed


def fit(rows, hardware) -> tuple[float, ...]:
    """The six constants (:data:`NAMES`), fitted on what the planner uses: ratios of step times within
    a group (:func:`group_of`). For each oversubscription exponent on a grid, bounded least squares of
    the log error after each group's mean log error is taken out (the calibration), beside the raw log
    error at ``ABSOLUTE_WEIGHT``; the exponent with the least squared error wins."""
    from scipy.optimize import least_squares

    rate = hardware.flops_per_second
    t = np.array([spec_terms(r["spec"], hardware) for r in rows])
    ticks, even, excess = t[:, 0], t[:, 1], t[:, 2]
    spanned = np.array([r["spec"][1] > 1 for r in rows], dtype=float)  # the job spans processes
    pooled = np.array([pooled_row(r, hardware) for r in rows])
    groups = [group_of(r) for r in rows]
    members = [np.array([g == h for h in groups]) for g in sorted(set(groups))]
    best = None
    for exponent in np.linspace(0.0, 1.0, 21):
        slowdown = [oversubscribed(hardware, r["spec"][1], exponent) for r in rows]
        log_measured = np.log([r["measured_seconds"] for r in rows]) - np.log(slowdown)

        def residuals(x, log_measured=log_measured):
            step_seconds, tick_seconds, imbalance, process_step, process_tick, pooled_imbalance = x
            fixed = step_seconds + ticks * tick_seconds + spanned * (process_step + ticks * process_tick)
            weight = np.where(pooled, pooled_imbalance, imbalance)
            error = np.log(fixed + even + weight * excess) - log_measured
            calibrated = error.copy()
            for m in members:
                calibrated[m] -= error[m].mean()
            return np.concatenate([calibrated, ABSOLUTE_WEIGHT * error])

        result = least_squares(residuals, x0=[0.01, 0.002, 0.5, 0.05, 0.005, 0.5], bounds=(0.0, np.inf))
        if best is None or result.cost < best[0]:
            step_seconds, tick_seconds, imbalance, process_step, process_tick, pooled_imbalance = result.x
            constants = (step_seconds * rate, tick_seconds * rate, imbalance, exponent)
            best = (
                result.cost,
                tuple(float(c) for c in (*constants, process_step * rate, process_tick * rate, pooled_imbalance)),
            )
    return best[1]


def lockstep_of(constants) -> Lockstep:
    """The :class:`~jaxmem.memory.Lockstep` of constants in :data:`NAMES` order."""
    return Lockstep(**dict(zip(NAMES, constants)))


def evaluate(rows, hardware, constants, references=()) -> dict:
    """Errors of ``constants`` (:data:`NAMES` order) on ``rows``: absolute (at the record's rate) and
    calibrated as the planner calibrates -- by the measured step of the group's first run in
    ``references`` + ``rows``."""
    lockstep = lockstep_of(constants)
    rate = hardware.flops_per_second

    def predicted_seconds(r):
        ticks, even, excess = spec_terms(r["spec"], hardware)
        processes = r["spec"][1]
        weight = lockstep.excess_weight(pooled_row(r, hardware))
        seconds = lockstep.fixed_flops(ticks, processes) / rate + even + weight * excess
        return seconds * dataclasses.replace(hardware, processes=processes, lockstep=lockstep).oversubscribed

    predicted = [predicted_seconds(r) for r in rows]
    measured = [r["measured_seconds"] for r in rows]
    errors = [p / m - 1 for p, m in zip(predicted, measured)]
    reference = {}
    for r in [*references, *rows]:
        reference.setdefault(group_of(r), r)
    scale = {g: r["measured_seconds"] / predicted_seconds(r) for g, r in reference.items()}
    calibrated = [
        None if reference[group_of(r)] is r else p * scale[group_of(r)] / m - 1
        for r, p, m in zip(rows, predicted, measured)
    ]
    others = [abs(e) for e in calibrated if e is not None]
    return {
        "predicted_seconds": predicted,
        "errors": errors,
        "worst_error": max(abs(e) for e in errors),
        "mean_abs_error": float(np.mean(np.abs(errors))),
        "calibrated_errors": calibrated,
        "worst_calibrated_error": max(others),
        "mean_abs_calibrated_error": float(np.mean(others)),
        "spearman": spearman(predicted, measured),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="steps per launch (the workers' median is kept)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="launches per configuration (the fastest is kept); 0 with --measured"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the record here")
    parser.add_argument(
        "--measured",
        metavar="RECORD",
        help="start from the measurements of an earlier record (its rate and rows): --rounds more launches per "
        "configuration are added to them (0: only re-fit)",
    )
    args = parser.parse_args(argv)
    if args.steps < 4 or args.rounds < (0 if args.measured else 1):
        parser.error("--steps must be at least 4 and --rounds at least 1 (0 only with --measured)")
    hardware = dataclasses.replace(get_hardware("cpu"), lockstep=CPU_LOCKSTEP_PROCESSES)
    rows = {}
    if args.measured:
        with open(args.measured) as f:
            earlier = json.load(f)
        hardware = dataclasses.replace(
            hardware, peak_flops=earlier["hardware"]["peak_flops"], cores=earlier["hardware"]["cores"]
        )
        rows = {r["config"]: r for r in earlier["rows"]}
    with tempfile.TemporaryDirectory() as tmp:
        measure_rounds(
            rows,
            args.rounds,
            (("fit", FIT), ("holdout", HOLDOUT)),
            name_of,
            lambda spec, name, round_: measured_step_seconds(
                spec, args.steps, Path(tmp) / f"{name.replace(' ', '_')}-{round_}"
            ),
        )
    fit_rows = [r for r in rows.values() if r["group"] == "fit"]
    hold_rows = [r for r in rows.values() if r["group"] == "holdout"]
    fitted = fit(fit_rows, hardware)
    shipped = tuple(getattr(CPU_LOCKSTEP_PROCESSES, name) for name in NAMES)
    record = {
        "benchmark": "elastic_fit",
        "batch_size": BATCH,
        "seq_len": SEQ,
        "schedule": "1f1b",
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "hardware": hardware.to_json(),
        "rows": list(rows.values()),
        "fitted": dict(zip(NAMES, fitted)),
        "shipped": dict(zip(NAMES, shipped)),
        "fit_with_fitted": evaluate(fit_rows, hardware, fitted),
        "holdout_with_fitted": evaluate(hold_rows, hardware, fitted, fit_rows),
        "fit_with_shipped": evaluate(fit_rows, hardware, shipped),
        "holdout_with_shipped": evaluate(hold_rows, hardware, shipped, fit_rows),
    }
    if not write_record(record, args.out, args.json):
        print("fitted: Lockstep(" + ", ".join(f"{n}={v:.3g}" for n, v in zip(NAMES, fitted)) + ")")
        for group, group_rows in (("fit", fit_rows), ("holdout", hold_rows)):
            r = record[f"{group}_with_shipped"]
            for row, p, e in zip(group_rows, r["predicted_seconds"], r["calibrated_errors"]):
                calibrated = "reference" if e is None else f"calibrated {e:+.0%}"
                print(
                    f"{group:8s} {row['config']:40s} measured {row['measured_seconds']:.3f} s  predicted (shipped) "
                    f"{p:.3f} s  ({p / row['measured_seconds'] - 1:+.0%}; {calibrated})"
                )
        for key in ("fit_with_fitted", "holdout_with_fitted", "fit_with_shipped", "holdout_with_shipped"):
            r = record[key]
            print(
                f"{key:22s} worst error {r['worst_error']:.0%} (calibrated {r['worst_calibrated_error']:.0%}), "
                f"mean {r['mean_abs_error']:.0%} (calibrated {r['mean_abs_calibrated_error']:.0%}), "
                f"Spearman {r['spearman']:.2f}"
            )
    return record


if __name__ == "__main__":
    main()
