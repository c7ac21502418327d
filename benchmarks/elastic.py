"""Elastic recovery, measured: multi-process runs of the tiny model that lose a worker, side by side
with the failure-free run, and the planner's choice against every fixed strategy that can run here.

    python benchmarks/elastic.py [--steps 24] [--json]

Scenario A: 4 workers x 1 device, pipeline 4; worker 2 is killed. Scenario B: 4 workers x 1 device,
data 2 x pipeline 2; worker 3 is killed (shrink-data-parallel and re-partition both run). Figures per
run: recovery seconds (failure detected -> first step of the new job), lost steps (since the last
complete checkpoint), post-recovery throughput vs failure-free, the strategy and its predicted vs
measured step time, samples used exactly once, final loss vs the failure-free run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent.parent


def launch(run_dir: Path, nprocs: int, train_args: list, failure: str | None = None, strategy: str | None = None):
    cmd = [
        sys.executable,
        "-m",
        "jaxmem",
        "launch",
        "--nprocs",
        str(nprocs),
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
                "predicted_step_seconds": strategy["step_seconds"],
                "predicted_throughput": 1 / strategy["step_seconds"],
                "prediction_error": strategy["step_seconds"] / step_seconds - 1,
            }
        )
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = [
        "--microbatches",
        "4",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
        "--steps",
        str(args.steps),
        "--checkpoint-every",
        "4",
    ]
    scenarios = {
        "A (pipe 4)": (["--stages", "4", *base], "rank=2,step=11", []),
        "B (data 2 x pipe 2)": (
            ["--stages", "2", "--data-parallel", "2", *base],
            "rank=3,step=11",
            ["shrink-data-parallel", "re-partition"],
        ),
    }
    report = {"benchmark": "elastic", "steps": args.steps, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (train_args, failure, fixed) in scenarios.items():
            print(f"scenario {name}: failure-free run ...", file=sys.stderr)
            free_dir = Path(tmp) / f"{name[0]}-free"
            free = measure(launch(free_dir, 4, train_args), free_dir, args.steps)
            runs = {}
            for label, strategy in [("planner", None)] + [(f"fixed:{s}", s) for s in fixed]:
                print(f"scenario {name}: {label} with {failure} ...", file=sys.stderr)
                run_dir = Path(tmp) / f"{name[0]}-{label.replace(':', '-')}"
                result = launch(run_dir, 4, train_args, failure, strategy)
                record = measure(result, run_dir, args.steps)
                failed_step = max(
                    int((run_dir / f"heartbeat-0-{r}").read_text() or 0)
                    for r in range(4)
                    if (run_dir / f"heartbeat-0-{r}").exists()
                )
                record["steps_reached_before_failure"] = failed_step
                record["lost_steps"] = failed_step - (record["resumed_from"] or 0)
                record["post_recovery_throughput_vs_failure_free"] = (
                    record["measured_steps_per_second"] / free["measured_steps_per_second"]
                )
                record["final_loss_abs_diff_vs_failure_free"] = abs(record["final_loss"] - free["final_loss"])
                runs[label] = record
                print(
                    f"  {label}: {record['strategy']} recovered in {record['recovery_seconds']:.1f}s, lost "
                    f"{record['lost_steps']} steps, {record['post_recovery_throughput_vs_failure_free']:.2f}x "
                    f"failure-free throughput, predicted/measured step {record['predicted_step_seconds']:.3f}/"
                    f"{record['measured_step_seconds']:.3f}s",
                    file=sys.stderr,
                )
            report["scenarios"][name] = {"failure_free": free, "runs": runs}
    first = report["scenarios"]["A (pipe 4)"]
    planner = first["runs"]["planner"]
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
            "max_prediction_error": max(
                abs(r["prediction_error"]) for s in report["scenarios"].values() for r in s["runs"].values()
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
