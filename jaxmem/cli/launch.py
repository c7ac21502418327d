"""``jaxmem launch``: run ``jaxmem train`` on N processes in one jax.distributed job, restart after failures."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import check_output_dir, non_negative_int, positive_float, positive_int, print_json

_EPILOG = """\
examples:
  jaxmem launch --nprocs 4 -- --pipe 4 --microbatches 4 --batch-size 8 --steps 40 --checkpoint-every 5
  jaxmem launch --nprocs 4 --inject-failure rank=2,step=12 -- --pipe 4 --steps 40 --checkpoint-every 5
  jaxmem launch --nprocs 2 --devices-per-proc 2 --spares 1 -- --pipe 2 --data-parallel 2 --steps 30

Everything after `--` goes to `jaxmem train` as given; the launcher's own settings (a checkpoint
directory and a sample log under --run-dir unless given; after a recovery, its mesh and layer split)
are in --run-dir's attempt-K.json, which the workers read with those arguments. On a failure -- a
worker exits, or its heartbeat is older than --heartbeat-seconds -- the launcher stops the other
workers, asks the recovery planner for the best configuration for what is left (`jaxmem elastic
recovery` shows the same decision), and restarts from the last complete checkpoint.
--inject-failure makes worker R SIGKILL itself at step K (first attempt only), for tests and drills.
Workers meet on 127.0.0.1 here; on a SLURM or Open MPI cluster, start `jaxmem train` with `srun` /
`mpirun` instead: it joins via jax.distributed.initialize() auto-detection
(JAXMEM_DISTRIBUTED=0 runs a task alone)."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run train on N processes (jax.distributed), recover from failures",
        description="Multi-process launcher with failure detection and recovery.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nprocs", type=positive_int, required=True, help="worker processes")
    p.add_argument("--devices-per-proc", type=positive_int, default=1, help="devices per worker (default 1)")
    p.add_argument(
        "--heartbeat-seconds",
        type=positive_float,
        default=60.0,
        help="fail a worker whose last step is older than this (default 60)",
    )
    p.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="rank=R,step=K",
        help="SIGKILL worker R at step K (repeatable)",
    )
    p.add_argument("--spares", type=non_negative_int, default=0, help="idle processes that can replace failed ones")
    p.add_argument(
        "--strategy",
        help="force a recovery strategy instead of the planner's choice: restart-on-spares, shrink-data-parallel or "
        "re-partition",
    )
    p.add_argument("--max-restarts", type=non_negative_int, default=3)
    p.add_argument("--run-dir", help="logs, heartbeats, checkpoints (default runs/launch-<time>)")
    p.add_argument("--timeout", type=positive_float, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then jaxmem train arguments")
    p.set_defaults(run=run)


def run(args) -> int:
    import sys

    from jaxmem.cli._train_args import parse_train_args
    from jaxmem.elastic import LaunchInterrupted, default_run_dir, launch, parse_failure, run_defaults

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    run_dir = args.run_dir or default_run_dir()
    # As the workers will take them: the run's folders below their arguments. Checked before any file is made.
    config = parse_train_args(train_args, defaults=run_defaults(run_dir))
    if isinstance(config.model, str) and ":" not in config.model:
        from jaxmem.models import get_config

        get_config(config.model)  # a preset's name, checked before the devices the workers would need
    failures = [parse_failure(f) for f in args.inject_failure]
    if args.run_dir:
        check_output_dir(args.run_dir, "--run-dir")
    try:
        result = launch(
            train_args,
            config=config,
            nprocs=args.nprocs,
            devices_per_proc=args.devices_per_proc,
            heartbeat_seconds=args.heartbeat_seconds,
            failures=failures,
            spares=args.spares,
            run_dir=run_dir,
            max_restarts=args.max_restarts,
            strategy=args.strategy,
            log=lambda line: print(line, file=sys.stderr),
            timeout=args.timeout,
        )
    except LaunchInterrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    if args.json:
        print_json(result.to_json())
    if not result.ok:
        print(f"error: the job failed {len(result.attempts)} time(s) and was given up (logs in {result.run_dir})",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
