"""Did this release move a headline figure? Rerun each system's key figure at a small stated size and
compare it with its record; and say which records are older than a change to the code they measure.

    python benchmarks/check.py              # every check (35-45 minutes on the 2-core machine)
    python benchmarks/check.py --stale      # only the records' age against their code (seconds, no runs)
    python benchmarks/check.py --only elastic,profiler [--json]

A check runs one benchmark script with small arguments (its command is printed), reads one figure of
its JSON report, and reads the same figure from the record in ``benchmarks/results``. It HOLDS when
the new figure is within the stated tolerance of the record's and inside the mission's bar where
there is one; otherwise it MOVED, and the exit status is 1. The tolerances are those of each figure's
run-to-run spread on this machine (timing figures vary by 10-30% between runs on 2 shared cores; the
ledger, the simulator and ROAM are deterministic). A small run is not the record's full run: where
the record covers more (three repeats, more scenarios), the check reads the record's matching part.

Staleness (``--stale``, and beside every check): a record is STALE when a file its figure depends on
(:attr:`Check.depends`) was committed after the record itself -- rerun the benchmark, or say in the
docs that the figure is the earlier release's. Run this before a release note claims a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclasses.dataclass(frozen=True)
class Check:
    """One headline figure: how to rerun it small, where its record is, and how far it may move."""

    name: str
    system: str
    command: tuple[str, ...]  # benchmarks/<script>.py and its arguments (--json is added)
    record: str  # file under benchmarks/results
    figure: Callable[[dict], float]  # the figure, read from a fresh report or from the record alike
    tolerance: float  # |now - recorded| allowed
    depends: tuple[str, ...]  # paths (files or folders) whose change makes the record stale
    bar: tuple[str, float] | None = None  # the mission's bound: ("<=", x) or (">=", x)
    minutes: float = 5.0  # about how long the run takes here
    what: str = ""

    def holds(self, now: float, recorded: float) -> bool:
        within = abs(now - recorded) <= self.tolerance
        if self.bar is None:
            return within
        op, bound = self.bar
        return within and (now <= bound if op == "<=" else now >= bound)


def _elastic_error(report: dict, scenario: str = "B") -> float:
    """The largest |model error| of a scenario's recoveries (predicted vs measured step, mean of runs)."""
    runs = next(s for name, s in report["scenarios"].items() if name.startswith(scenario))["runs"]
    return max(abs(r["prediction_error"]) for r in runs.values())


def _overhead(report: dict) -> float:
    row = next(r for r in report["grid"] if (r["schedule"], r["microbatches"], r["policy"]) == ("1f1b", 8, "save-all"))
    return row["over_plain"]


ROAM_GRAPH = "tiny accumulated x4 (batch 4 each, seq 64)"
# Two repeats: one repeat's overhead spreads over 14 points on this machine (the record's three: +10.9%,
# -1.6%, -3.1%, the first with 26 s of exploring compiles in the background), wider than the bar.
PROFILER_RUN = ("profiler.py", "--repeats", "2")
PROFILER_CODE = ("jaxmem/profiler", "jaxmem/memory", "jaxmem/train", "benchmarks/profiler.py")

CHECKS = (
    Check(
        "ledger worst error (tiny)",
        "ledger",
        ("memory.py", "--models", "tiny"),
        "memory.json",
        lambda r: r["max_prediction_error_per_model"]["tiny"],
        tolerance=0.03,
        bar=("<=", 0.10),
        depends=("jaxmem/memory", "jaxmem/pipeline", "benchmarks/memory.py"),
        minutes=4,
        what="predicted vs compiled bytes of the tiny GPT over the preset policies, worst |error|",
    ),
    Check(
        "profiler overhead",
        "Chameleon",
        PROFILER_RUN,
        "profiler.json",
        lambda r: r["overhead_fraction"],
        tolerance=0.07,
        bar=("<=", 0.10),
        depends=PROFILER_CODE,
        minutes=10,
        what="the adaptive run's time over the plain loop through the same programs, minus 1 (mean of repeats)",
    ),
    Check(
        "profiler steady steps vs largest static policy",
        "Chameleon",
        PROFILER_RUN,
        "profiler.json",
        lambda r: r["steady_speedup_vs_static_largest"],
        tolerance=0.12,
        depends=PROFILER_CODE,
        minutes=0,  # the same run as the overhead's
        what="speedup of the adaptive run's steady steps over the largest fixed policy's",
    ),
    Check(
        "recovery model error (scenario B)",
        "Odyssey",
        ("elastic.py", "--scenarios", "B", "--repeats", "1"),
        "elastic.json",
        _elastic_error,
        tolerance=0.15,
        bar=("<=", 0.15),
        depends=("jaxmem/elastic", "jaxmem/memory/_cost.py", "jaxmem/cli", "benchmarks/elastic.py"),
        minutes=5,
        what="worst |predicted / measured step - 1| of scenario B's recoveries (planner and fixed)",
    ),
    Check(
        "ChronosPipe depth over 1F1B (simulated)",
        "ChronosPipe",
        ("trainable_size.py", "--no-validate"),
        "trainable_size.json",
        lambda r: r["chronos_vs_1f1b_depth_ratio"],
        tolerance=0.05,
        depends=("jaxmem/memory", "jaxmem/schedule", "jaxmem/search", "schedules", "benchmarks/trainable_size.py"),
        minutes=12,  # the planner over 14 methods (over 10 min with the cores shared)
        what="layers ChronosPipe fits at >= 95% of 1F1B's per-layer throughput over 1F1B's, gpt2-xl width on H100",
    ),
    Check(
        "ROAM reduction on an accumulation loop",
        "ROAM",
        ("roam.py", "--skip-big", "--random", "2", "--medium", ""),
        "roam.json",
        lambda r: r["eager_end_to_end_reduction"][ROAM_GRAPH],
        tolerance=0.02,
        depends=("jaxmem/roam", "benchmarks/roam.py"),
        minutes=2,
        what=f"planned arena over a caching allocator's, 1 - ratio, on '{ROAM_GRAPH}'",
    ),
    Check(
        "pipelined over plain step (1F1B, M=8)",
        "executor",
        ("overhead.py", "--schedules", "1f1b", "--microbatches", "8", "--policies", "save-all", "--rounds", "3"),
        "overhead.json",
        _overhead,
        tolerance=0.15,
        depends=("jaxmem/pipeline", "jaxmem/train", "benchmarks/overhead.py"),
        minutes=2,
        what="1F1B P=4 M=8 save-all step over plain data parallel on the same 4 devices",
    ),
)


def _git_time(*paths: str) -> int | None:
    """Unix time of the newest commit touching ``paths`` (None: never committed)."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return int(out) if out else None


def staleness(check: Check) -> dict:
    """When the record and the code it measures were last committed; stale if the code is newer."""
    recorded = _git_time(f"benchmarks/results/{check.record}")
    code = _git_time(*check.depends)
    newer = []
    if recorded is not None:
        out = subprocess.run(
            ["git", "log", f"--since={recorded + 1}", "--format=%h %s", "--", *check.depends],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        newer = [line[:100] for line in out.splitlines()]
    return {
        "record_committed": None if recorded is None else time.strftime("%Y-%m-%d", time.gmtime(recorded)),
        "code_committed": None if code is None else time.strftime("%Y-%m-%d", time.gmtime(code)),
        "stale": recorded is None or bool(newer),
        "commits_since_record": len(newer),
        "newest_commits_since_record": newer[:3],
    }


def run(check: Check, timeout: float) -> dict:
    """Run the check's benchmark; its JSON report (stdout) parsed."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / check.command[0]), *check.command[1:], "--json"]
    print(f"[{check.system}] {' '.join(cmd[1:])}  (about {check.minutes:g} min)", file=sys.stderr, flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{check.command[0]} failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}")
    start = proc.stdout.find("{")
    if start < 0:
        raise RuntimeError(f"{check.command[0]} printed no JSON report")
    return json.loads(proc.stdout[start:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = sorted({c.system.lower() for c in CHECKS})
    parser.add_argument("--only", help=f"comma-separated systems to check: {', '.join(names)}")
    parser.add_argument("--stale", action="store_true", help="only say which records are older than their code")
    parser.add_argument("--list", action="store_true", help="list the checks and their commands, run nothing")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark may take (default 1800)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    args = parser.parse_args(argv)
    checks = list(CHECKS)
    if args.only:
        wanted = {x.strip().lower() for x in args.only.split(",") if x.strip()}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"--only names {sorted(unknown)}: the systems are {', '.join(names)}")
        checks = [c for c in checks if c.system.lower() in wanted]
    if args.list:
        for c in checks:
            print(f"{c.system:12s} {c.name:48s} benchmarks/{' '.join(c.command)}  vs results/{c.record}")
        return 0
    rows, reports, moved = [], {}, False
    for c in checks:
        row = {"check": c.name, "system": c.system, "record": c.record, "what": c.what, **staleness(c)}
        recorded = json.loads((RESULTS / c.record).read_text())
        row["recorded"] = c.figure(recorded)
        row["tolerance"] = c.tolerance
        row["bar"] = None if c.bar is None else " ".join(map(str, c.bar))
        if not args.stale:
            key = c.command
            if key not in reports:
                try:
                    reports[key] = run(c, args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    reports[key] = e
            report = reports[key]
            if isinstance(report, Exception):
                row.update(now=None, status="FAILED", error=str(report)[-500:])
                moved = True
            else:
                row["now"] = c.figure(report)
                row["status"] = "holds" if c.holds(row["now"], row["recorded"]) else "MOVED"
                moved |= row["status"] == "MOVED"
            row["command"] = "python benchmarks/" + " ".join(c.command)
        rows.append(row)
        _print_row(row, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"benchmark": "check", "checks": rows}, indent=2))
    return 1 if moved else 0


def _print_row(row: dict, file) -> None:
    age = f"record {row['record_committed']}" + (
        f", STALE: {row['commits_since_record']} commit(s) to its code since" if row["stale"] else ", current"
    )
    if "status" not in row:
        print(f"{row['check']:48s} {age}", file=file, flush=True)
        return
    now = "--" if row["now"] is None else f"{row['now']:.3f}"
    bar = f", bar {row['bar']}" if row["bar"] else ""
    print(
        f"{row['status']:6s} {row['check']:48s} now {now}  record {row['recorded']:.3f} "
        f"(+-{row['tolerance']:g}{bar}); {age}",
        file=file,
        flush=True,
    )
    if row.get("error"):
        print(f"       {row['error']}", file=file)


if __name__ == "__main__":
    sys.exit(main())
