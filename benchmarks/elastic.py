"""Elastic recovery, measured: multi-process runs of the tiny model that lose a worker, side by side
with the failure-free run, and the planner's choice against every fixed strategy that can run here.

    python benchmarks/elastic.py [--steps 48] [--scenarios A,B,C] [--json]

Tiny GPT, 1F1B, M=4, batch 32 x 64 tokens, a checkpoint every 8 steps, a worker SIGKILLed at step 19.
Scenario A: 2 workers x 2 devices, pipeline 4; worker 1 is killed. Scenario B: 2 workers x 2 devices,
data 2 x pipeline 2; worker 1 is killed (the planner's pick and shrink-data-parallel both run).
Scenario C: 4 workers x 1 device, pipeline 4; worker 2 is killed -- 4 processes on this 2-core
machine, where run-to-run step times vary by about 15%. Figures per run: recovery seconds (failure
detected -> first step of the new job), lost steps (since the last complete checkpoint),
post-recovery throughput vs failure-free, the strategy and its predicted vs measured step time
(medians of the workers' own step times: compile and checkpoint pauses excluded), samples used
exactly once, final loss vs the failure-free run. Each recovery runs ``--repeats`` times (step
times of one configuration vary by about 10% from run to run here); the prediction error is that of
the means, and each run's is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxmem.elastic import read_heartbeat  # the launcher's own heartbeat reader

ROOT = Path(__file__).parent.parent


def launch(
    run_dir: Path,
    nprocs: int,
    devices_per_proc: int,
    train_args: list,
    failure: str | None = None,
    strategy: str | None = None,
):
    cmd = [
        sys.executable,
        "-m",
        "jaxmem",
        "launch",
        "--nprocs",
        str(nprocs),
        "--devices-per-proc",
        str(devices_per_proc),
        "--run-dir",
        str(run_dir),
        "--heartbeat-seconds",
        "60",
        "--timeout",
        "1200",
        "--json",
    ]
    if failure:
        cmd += ["--inject-failure", failure]
    if strategy:
        cmd += ["--strategy", strategy]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd + ["--", *train_args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1500)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def measure(result: dict, run_dir: Path, total_steps: int) -> dict:
    attempts = result["attempts"]
    summary = result["summary"]
    step_seconds = summary["step_seconds_median"]
    record = {
        "attempts": len(attempts),
        "final_loss": summary["loss_last"],
        "losses": summary["losses"],
        "measured_step_seconds": step_seconds,
        "measured_steps_per_second": 1 / step_seconds,
    }
    lines = [line.split() for line in (run_dir / "samples.log").read_text().splitlines() if line.strip()]
    ids = [int(i) for x in lines for i in x[1:]]
    record["samples_exactly_once"] = sorted(ids) == list(range(len(ids))) and [int(x[0]) for x in lines] == list(
        range(1, total_steps + 1)
    )
    if len(attempts) > 1:
        failed, new = attempts[0], attempts[1]
        strategy = failed["strategy"]
        record.update(
            {
                "recovered": True,
                "strategy": strategy["name"],
                "recovery_seconds": (new["first_step_at"] or new["started"]) - failed["failed_at"],
                "resumed_from": summary["resumed_from"],
                "pre_failure_step_seconds": failed.get("measured_step_seconds"),
                "predicted_step_seconds": strategy["step_seconds"],
                "predicted_throughput": 1 / strategy["step_seconds"],
                "prediction_error": strategy["step_seconds"] / step_seconds - 1,
            }
        )
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--scenarios", default="A,B,C", help="which scenarios to run (comma-separated)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per recovery (step times here vary ~10%% run to run)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = [
        "--microbatches",
        "4",
        "--batch-size",
        "32",
        "--seq-len",
        "64",
        "--steps",
        str(args.steps),
        "--checkpoint-every",
        "8",
    ]
    scenarios = {
        "A (2 workers x 2 devices, pipe 4)": (2, 2, ["--pipe", "4", *base], "rank=1,step=19", []),
        "B (2 workers x 2 devices, data 2 x pipe 2)": (
            2,
            2,
            ["--pipe", "2", "--data-parallel", "2", *base],
            "rank=1,step=19",
            ["shrink-data-parallel"],
        ),
        "C (4 workers x 1 device, pipe 4)": (4, 1, ["--pipe", "4", *base], "rank=2,step=19", []),
    }
    wanted = {x.strip().upper() for x in args.scenarios.split(",")}
    scenarios = {k: v for k, v in scenarios.items() if k[0] in wanted}
    if not scenarios:
        parser.error(f"--scenarios {args.scenarios!r} names none of A, B, C")
    report = {"benchmark": "elastic", "steps": args.steps, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nprocs, per_proc, train_args, failure, fixed) in scenarios.items():
            print(f"scenario {name}: failure-free run ...", file=sys.stderr)
            free_dir = Path(tmp) / f"{name[0]}-free"
            free = measure(launch(free_dir, nprocs, per_proc, train_args), free_dir, args.steps)
            runs = {}
            for label, strategy in [("planner", None)] + [(f"fixed:{s}", s) for s in fixed]:
                repeats = []
                for rep in range(args.repeats):
                    print(
                        f"scenario {name}: {label} with {failure} (run {rep + 1}/{args.repeats}) ...", file=sys.stderr
                    )
                    run_dir = Path(tmp) / f"{name[0]}-{label.replace(':', '-')}-{rep}"
                    result = launch(run_dir, nprocs, per_proc, train_args, failure, strategy)
                    record = measure(result, run_dir, args.steps)
                    failed_step = max(read_heartbeat(run_dir / f"heartbeat-0-{r}")[0] or 0 for r in range(nprocs))
                    record["steps_reached_before_failure"] = failed_step
                    record["lost_steps"] = failed_step - (record["resumed_from"] or 0)
                    record["final_loss_abs_diff_vs_failure_free"] = abs(record["final_loss"] - free["final_loss"])
                    repeats.append(record)
                    print(
                        f"  {record['strategy']} recovered in {record['recovery_seconds']:.1f}s, lost "
                        f"{record['lost_steps']} steps, predicted/measured step {record['predicted_step_seconds']:.3f}/"
                        f"{record['measured_step_seconds']:.3f}s ({record['prediction_error']:+.1%})",
                        file=sys.stderr,
                    )
                predicted = sum(r["predicted_step_seconds"] for r in repeats) / len(repeats)
                measured = sum(r["measured_step_seconds"] for r in repeats) / len(repeats)
                runs[label] = {
                    "strategy": repeats[0]["strategy"],
                    "strategies": sorted({r["strategy"] for r in repeats}),
                    "recovered": all(r.get("recovered", False) for r in repeats),
                    "samples_exactly_once": all(r["samples_exactly_once"] for r in repeats),
                    "predicted_step_seconds": predicted,
                    "measured_step_seconds": measured,
                    "measured_steps_per_second": 1 / measured,
                    "predicted_throughput": 1 / predicted,
                    "prediction_error": predicted / measured - 1,
                    "prediction_errors_per_run": [r["prediction_error"] for r in repeats],
                    "measured_step_seconds_per_run": [r["measured_step_seconds"] for r in repeats],
                    "recovery_seconds": sum(r["recovery_seconds"] for r in repeats) / len(repeats),
                    "lost_steps": max(r["lost_steps"] for r in repeats),
                    "post_recovery_throughput_vs_failure_free": free["measured_step_seconds"] / measured,
                    "final_loss_abs_diff_vs_failure_free": max(
                        r["final_loss_abs_diff_vs_failure_free"] for r in repeats
                    ),
                    "runs": repeats,
                }
                print(
                    f"  {label}: mean predicted/measured step {predicted:.3f}/{measured:.3f}s "
                    f"({predicted / measured - 1:+.1%})",
                    file=sys.stderr,
                )
            report["scenarios"][name] = {"failure_free": free, "runs": runs}
    first = next(iter(report["scenarios"].values()))
    planner = first["runs"]["planner"]
    errors = {
        f"{name[0]} {label} (mean of {args.repeats})": r["prediction_error"]
        for name, s in report["scenarios"].items()
        for label, r in s["runs"].items()
    }
    report.update(
        {
            "recovered": all(r.get("recovered") for s in report["scenarios"].values() for r in s["runs"].values()),
            "recovery_seconds": planner["recovery_seconds"],
            "lost_steps": planner["lost_steps"],
            "samples_exactly_once": all(
                r["samples_exactly_once"] for s in report["scenarios"].values() for r in s["runs"].values()
            ),
            "strategy": planner["strategy"],
            "predicted_throughput": planner["predicted_throughput"],
            "measured_throughput": planner["measured_steps_per_second"],
            "failure_free_throughput": first["failure_free"]["measured_steps_per_second"],
            "prediction_errors": errors,
            "max_prediction_error": max(abs(e) for e in errors.values()),
            "max_prediction_error_single_run": max(
                abs(e)
                for s in report["scenarios"].values()
                for r in s["runs"].values()
                for e in r["prediction_errors_per_run"]
            ),
            "throughput_unit": "steps per second",
        }
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(json.dumps({k: v for k, v in report.items() if k != "scenarios"}, indent=2))
    return report


if __name__ == "__main__":
    main()
