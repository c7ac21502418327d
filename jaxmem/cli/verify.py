"""``jaxmem verify``: a schedule's gradients against plain ``jax.grad`` on a small model."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import print_json, setup_devices

_EPILOG = """\
Run this before trusting a custom schedule:
  jaxmem verify --schedule zbv --stages 4 --microbatches 8
  jaxmem verify --csv my_schedule.csv --json
  jaxmem verify --schedule 1f1b --policy recompute-all

The model is a small GPT whose layers split evenly over the schedule's stages; the check is
element-wise |pipelined - plain| <= 1e-6 + 1e-5 |plain| on the loss and every parameter gradient.
Exit code 0 when it holds, 1 when it does not."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that a schedule gives plain jax.grad gradients",
        description="Pipelined gradients vs plain jax.grad on a small GPT.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--schedule", help="schedule name (see `jaxmem schedule list`)")
    p.add_argument("--csv", metavar="FILE", help="a schedule table instead of a name")
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks P (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches M (default 8)")
    p.add_argument("--virtual", type=int, help="stages per rank for interleaved-1f1b")
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--devices", type=int, help="virtual CPU devices (default data x pipe)")
    p.add_argument("--policy", help="memory policy preset or TOML file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxmem import schedule as sch

    if args.csv and args.schedule:
        raise sch.ScheduleError("give either --schedule NAME or --csv FILE, not both")
    if args.csv:
        schedule = sch.validate(sch.load_csv(args.csv))
    else:
        schedule = sch.generate(args.schedule or "1f1b", args.stages, args.microbatches, args.virtual)
    setup_devices(args.devices or args.data_parallel * schedule.num_ranks)
    from jaxmem.verify import verify

    result = verify(schedule, data_parallel=args.data_parallel, policy=args.policy)
    if args.json:
        print_json(result)
    else:
        status = "OK" if result["ok"] else "MISMATCH"
        print(
            f"{status}: {result['schedule']} (P={result['ranks']}, stages={result['stages']}, "
            f"M={result['microbatches']}, data={result['data_parallel']}): max |diff| "
            f"{result['max_abs_diff']:.2e}, max relative {result['max_rel_diff']:.2e}, loss "
            f"{result['loss']:.6f} vs {result['loss_plain']:.6f}"
            + ("" if result["ok"] else f"; first mismatch at {result['first_mismatch']}")
        )
    return 0 if result["ok"] else 1
