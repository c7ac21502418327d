"""``jaxmem roam analyze``: plan a train step's operator order and memory layout, beside its baselines."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import positive_int, print_json

_EPILOG = """\
examples:
  jaxmem roam analyze                                   # tiny GPT train step (Adam), compiled for XLA's figure
  jaxmem roam analyze --model gpt2-xl --batch 4 --seq-len 1024 --json   # traced abstractly, never allocated
  jaxmem roam analyze --model llama-tiny
  jaxmem roam analyze --model experts --batch 1024      # a multi-branch (parallel experts) model
  jaxmem roam analyze --accumulate 4                    # gradient accumulation written as a loop: order matters
  jaxmem roam analyze --model gpt2-small --loss-chunks 16 --seq-len 1024   # chunked loss head
  jaxmem roam analyze --model mymodels:vit --batch 64   # a model of your own

Reported apart: the order gain (program order's peak minus the planned peak, both perfectly packed)
and the layout gain (the caching allocator's smallest device for the planned order minus the planned
arena). Baselines: program order with a PyTorch-like caching allocator (the eager framework:
allocated, reserved, and the smallest device it runs on, releasing its cache before it gives up),
XLA's memory_analysis() (when compiled: by default for tiny, llama-tiny and experts; --compile yes/no
to force). The planner is our reconstruction of ROAM plus list schedules: see docs/guides/roam.md."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "roam",
        help="execution-plan planner on jaxprs: operator order and memory layout",
        description="ROAM-style planning of a train step's operator order and tensor layout.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="roam_command", metavar="ACTION")
    a = actions.add_parser("analyze", help="plan one train step and print the baselines")
    a.add_argument(
        "--model",
        default="tiny",
        help="a model preset (tiny, gpt2-small, gpt2-medium, gpt2-xl, llama-tiny, llama-1b, llama-8b, "
        "llama-70b), experts, or your own as package.module:attr (a StagedModel or a function returning one; "
        "traced with its own batch when it declares one)",
    )
    a.add_argument("--batch", type=positive_int, help="batch size (default 4; 1024 for experts)")
    a.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's maximum)")
    a.add_argument(
        "--accumulate",
        type=positive_int,
        metavar="N",
        help="the step accumulates gradients over N microbatches of --batch, written as a Python loop",
    )
    a.add_argument(
        "--loss-chunks",
        type=positive_int,
        metavar="N",
        help="the step computes its loss head over N sequence chunks (chunked cross-entropy)",
    )
    a.add_argument(
        "--compile",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compile for XLA's figure (auto: tiny and experts only)",
    )
    a.add_argument("--json", action="store_true", help="print one JSON object")
    a.set_defaults(run=run)
    p.set_defaults(run=None)


def run(args) -> int:
    from jaxmem._errors import JaxmemError
    from jaxmem.roam import (
        accumulated_train_step,
        analyze_step,
        chunked_loss_train_step,
        experts_train_step,
        model_train_step,
    )

    if args.accumulate and args.loss_chunks:
        raise JaxmemError("--accumulate and --loss-chunks are separate examples: give one of them")
    if args.model == "experts":
        if args.accumulate or args.loss_chunks:
            raise JaxmemError("--accumulate and --loss-chunks apply to language models, not to --model experts")
        step = experts_train_step(batch=args.batch or 1024)
    elif args.accumulate:
        step = accumulated_train_step(args.model, microbatches=args.accumulate, batch=args.batch or 4, seq=args.seq_len)
    elif args.loss_chunks:
        try:
            step = chunked_loss_train_step(args.model, chunks=args.loss_chunks, batch=args.batch or 4, seq=args.seq_len)
        except ValueError as e:
            raise JaxmemError(f"{e}: pick --loss-chunks dividing --seq-len") from None
    else:
        step = model_train_step(args.model, batch=args.batch or 4, seq=args.seq_len)
    small = ("tiny", "llama-tiny", "experts")
    compile_xla = args.compile == "yes" or (args.compile == "auto" and args.model in small)
    record = analyze_step(step, compile_xla=compile_xla)
    if args.json:
        print_json(record)
        return 0
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.2f} MiB"  # noqa: E731
    print(f"{record['name']}: {record['ops']:,} ops, {record['tensors']:,} tensors")
    print(f"  program order + caching allocator: allocated {mib(record['program_order_caching_allocated_bytes'])}, "
          f"reserved {mib(record['program_order_caching_allocator_bytes'])}, "
          f"runs on {mib(record['program_order_caching_capacity_bytes'])}")  # fmt: skip
    print(f"  program order, perfect packing (peak live) {mib(record['program_order_peak_bytes'])}")
    print(f"  XLA memory_analysis()                      {mib(record['xla_bytes'])}")
    planned = mib(record["planned_peak_bytes"])
    print(f"  planned order: peak live                   {planned}  ({record['order_method']})")
    print(f"  planned order + caching allocator runs on  {mib(record['planned_caching_capacity_bytes'])}")
    print(f"  planned order: arena (improved layout)     {mib(record['planned_arena_bytes'])}")
    print(
        f"  order gain {record['order_gain']:.1%} ({mib(record['order_gain_bytes'])}); layout gain "
        f"{record['layout_gain']:.1%} ({mib(record['layout_gain_bytes'])}); planned in {record['planner_seconds']:.1f}s"
    )
    return 0
