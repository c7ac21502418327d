"""``jaxmem elastic recovery``: the recovery planner's decision for a failure, without running anything."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import non_negative_float, non_negative_int, positive_float, positive_int, print_json

_EPILOG = """\
examples:
  jaxmem elastic recovery --devices 8 --failed 3 -- --pipe 4 --data-parallel 2 --microbatches 4 --batch-size 16
  jaxmem elastic recovery --devices 4 --failed 1 --json -- --pipe 4 --microbatches 4 --batch-size 8 --steps 100
  jaxmem elastic recovery --devices 8 --failed 0 -- --model llama-1b --pipe 8 --microbatches 8 --batch-size 16
  jaxmem elastic recovery --devices 16 --devices-per-proc 8 --failed 9 --spares 1 --budget 40GiB -- \
      --model llama-8b --dtype bfloat16 --mesh data=2,pipe=4,tensor=2 --microbatches 16 --batch-size 32 \
      --seq-len 4096 --policy selective --steps 1000

The arguments after `--` describe the running job (as for `jaxmem train`). Strategies: restart on
spares, shrink data-parallel, shrink fsdp, re-partition over fewer pipeline stages (each keeps the
job's tensor axis), reroute (scored, not runnable by the SPMD executor). The score is the time to
finish the remaining steps, recovery included; with --budget, a new layout predicted over it is
scored but not chosen."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "elastic",
        help="recovery planning for elastic training",
        description="Odyssey-style recovery planning.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="elastic_command", metavar="ACTION")
    a = actions.add_parser("recovery", help="score the recovery strategies for a failure")
    a.add_argument("--devices", type=positive_int, required=True, help="devices of the job before the failure")
    a.add_argument(
        "--failed", type=non_negative_int, action="append", required=True, help="failed device rank (repeatable)"
    )
    a.add_argument("--devices-per-proc", type=positive_int, default=1, help="devices per process (the unit that fails)")
    a.add_argument("--spares", type=non_negative_int, default=0, help="spare processes")
    a.add_argument("--steps-done", type=non_negative_int, default=0, help="steps reached before the failure")
    a.add_argument("--last-checkpoint", type=non_negative_int, default=0, help="step of the last complete checkpoint")
    a.add_argument("--step-seconds", type=positive_float, help="measured step time before the failure")
    a.add_argument("--restart-seconds", type=non_negative_float, default=15.0, help="restart + compile + restore time")
    a.add_argument(
        "--hardware",
        default="h100",
        help="hardware profile for the model (default h100; cpu: this machine, its cores shared by the "
        "devices as `jaxmem launch` runs them)",
    )
    a.add_argument(
        "--budget",
        help="device memory, e.g. 80GiB: a new layout the ledger predicts above it is scored but not chosen "
        "(default: the job's own --budget, else none)",
    )
    a.add_argument("--json", action="store_true")
    a.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the job's jaxmem train arguments")
    a.set_defaults(run=run)
    p.set_defaults(run=None)


def run(args) -> int:
    from jaxmem._errors import JaxmemError
    from jaxmem._util import parse_bytes
    from jaxmem.cli._train_args import parse_train_args
    from jaxmem.elastic import choose_recovery
    from jaxmem.memory import cpu_cores

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    config = parse_train_args(train_args)
    if config.num_devices != args.devices:
        raise JaxmemError(
            f"--devices {args.devices} does not match the job's data({config.data_parallel}) x fsdp({config.fsdp}) x "
            f"pipe({config.pipe}) x tensor({config.tensor}) = {config.num_devices}"
        )
    if args.devices % args.devices_per_proc:
        raise JaxmemError(f"--devices {args.devices} is not a multiple of --devices-per-proc {args.devices_per_proc}")
    nprocs = args.devices // args.devices_per_proc
    bad = [f for f in args.failed if not 0 <= f < args.devices]
    if bad:
        raise JaxmemError(f"--failed {bad}: device ranks are 0..{args.devices - 1}")
    failed = sorted({f // args.devices_per_proc for f in args.failed})
    if args.steps_done and args.last_checkpoint > args.steps_done:
        raise JaxmemError(
            f"--last-checkpoint {args.last_checkpoint} is after --steps-done {args.steps_done}: a job saves only steps "
            "it reached. Give the step of the last checkpoint at or before the failure"
        )
    for flag, step in (("--steps-done", args.steps_done), ("--last-checkpoint", args.last_checkpoint)):
        if step > config.steps:
            raise JaxmemError(
                f"{flag} {step} is past the job's last step (--steps {config.steps}); give the job's --steps after --"
            )
    budget = None if args.budget is None else parse_bytes(args.budget)
    recovery = choose_recovery(
        config,
        devices_per_proc=args.devices_per_proc,
        nprocs=nprocs,
        failed=failed,
        spares=args.spares,
        steps_done=args.steps_done or args.last_checkpoint,
        last_checkpoint=args.last_checkpoint,
        measured_step_seconds=args.step_seconds,
        restart_seconds=args.restart_seconds,
        hardware=args.hardware,
        cores=cpu_cores() if str(args.hardware).strip().lower() == "cpu" else None,
        budget=budget,
    )
    if args.json:
        print_json(recovery.to_json())
    else:
        for line in recovery.explain():
            print(line)
    return 0
