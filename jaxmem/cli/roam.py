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

Baselines: program order with a PyTorch-like caching allocator (the eager framework), program order
with perfect packing (peak live bytes), XLA's memory_analysis() (when compiled: by default for tiny,
llama-tiny and experts; --compile yes/no to force). The planner is our reconstruction of ROAM: see the README."""


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
        help="a model preset (tiny, gpt2-small, gpt2-medium, gpt2-xl, llama-tiny, llama-1b, llama-8b) or experts",
    )
    a.add_argument("--batch", type=positive_int, help="batch size (default 4; 1024 for experts)")
    a.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's maximum)")
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
    from jaxmem.roam import analyze_step, experts_train_step, model_train_step

    if args.model == "experts":
        step = experts_train_step(batch=args.batch or 1024)
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
    print(f"  program order + caching allocator (eager)  {mib(record['program_order_caching_allocator_bytes'])}")
    print(f"  program order, perfect packing (peak live) {mib(record['program_order_peak_bytes'])}")
    print(f"  XLA memory_analysis()                      {mib(record['xla_bytes'])}")
    print(f"  planned order: peak live                   {mib(record['planned_peak_bytes'])}")
    print(f"  planned order: arena (greedy-by-size)      {mib(record['planned_arena_greedy_bytes'])}")
    print(f"  planned order: arena (improved)            {mib(record['planned_arena_bytes'])}")
    base = record["program_order_caching_allocator_bytes"]
    print(
        f"  arena vs eager: {1 - record['planned_arena_bytes'] / base:+.1%} less; planned in "
        f"{record['planner_seconds']:.1f}s ({record['tasks']} tasks, {record['cones']} sink cones)"
    )
    return 0
