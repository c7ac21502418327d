"""``jaxmem schedule``: list, show, simulate, check, draw and export pipeline schedules."""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem import schedule as sch
from jaxmem._util import parse_bytes
from jaxmem.cli._common import check_output_file, non_negative_float, positive_int

_EPILOG = """\
examples:
  jaxmem schedule list
  jaxmem schedule show 1f1b --pipe 4 --microbatches 8
  jaxmem schedule simulate zb-h1 --pipe 4 --microbatches 8 --json
  jaxmem schedule simulate --csv my_schedule.csv --cost-comm 0.1
  jaxmem schedule check my_schedule.csv
  jaxmem schedule draw interleaved-1f1b --pipe 4 --microbatches 8 --virtual 2 -o il.png
  jaxmem schedule export zbv --pipe 4 --microbatches 8 -o zbv.csv

--pipe P is the pipeline size (ranks); a rank holds V stages with --virtual V (interleaved) or
2 (zbv), so the table has P*V stages. Costs are for a stage holding a rank's share of the model;
with V stages per rank each costs 1/V of that (equal-model comparison)."""


def _add_source(p: argparse.ArgumentParser, csv_ok: bool = True) -> None:
    p.add_argument("name", nargs="?", help="schedule name (see `jaxmem schedule list`)")
    p.add_argument(
        "--pipe",
        "--stages",
        "-p",
        dest="pipe",
        metavar="P",
        type=positive_int,
        default=4,
        help="pipe ranks P (default 4)",
    )
    p.add_argument("--microbatches", "-m", type=positive_int, default=8, help="microbatches M (default 8)")
    p.add_argument("--virtual", "-v", type=positive_int, default=None, help="stages per rank V (interleaved-1f1b)")
    if csv_ok:
        p.add_argument("--csv", metavar="FILE", help="read the schedule from a CSV instead of a name")


def _add_costs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs (per action, for a stage holding 1/P of the model)")
    g.add_argument("--cost-f", type=non_negative_float, default=1.0, help="forward (default 1)")
    g.add_argument("--cost-b", type=non_negative_float, default=None, help="full backward (default I + W = 2)")
    g.add_argument("--cost-i", type=non_negative_float, default=1.0, help="input-gradient (default 1)")
    g.add_argument("--cost-w", type=non_negative_float, default=1.0, help="weight-gradient (default 1)")
    g.add_argument(
        "--cost-comm", type=non_negative_float, default=0.0, help="latency per hop between ranks (default 0)"
    )
    g.add_argument(
        "--activation-bytes",
        default=None,
        help="size of one stage activation, e.g. 3MiB or 3e6 (the live-activation curves are then in MiB)",
    )


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "schedule",
        help="pipeline schedules as data: list, show, simulate, check, draw, export",
        description="Pipeline schedules as data.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="schedule_command", metavar="ACTION")

    p = actions.add_parser("list", help="the registered schedule generators")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_list)

    p = actions.add_parser("show", help="print a schedule's table")
    _add_source(p)
    p.set_defaults(run=_show)

    p = actions.add_parser("simulate", help="makespan, bubble and peak live activations per rank")
    _add_source(p)
    _add_costs(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_simulate)

    p = actions.add_parser("check", help="validate a schedule CSV (exit 0 when valid)")
    p.add_argument("file", help="CSV file: one row per rank, one action per cell")
    p.set_defaults(run=_check)

    p = actions.add_parser("draw", help="Gantt chart with live activations (PNG, SVG or PDF)")
    _add_source(p)
    _add_costs(p)
    p.add_argument("-o", "--output", required=True, help="output file (.png, .svg, .pdf)")
    p.set_defaults(run=_draw)

    p = actions.add_parser("export", help="write a generated schedule as CSV")
    _add_source(p, csv_ok=False)
    p.add_argument("-o", "--output", required=True, help="output .csv file")
    p.set_defaults(run=_export)

    parser.set_defaults(run=None)


def _schedule_from_args(args) -> sch.Schedule:
    csv_path = getattr(args, "csv", None)
    if csv_path and args.name:
        raise sch.ScheduleError("give either a schedule name or --csv FILE, not both")
    if csv_path:
        return sch.validate(sch.load_csv(csv_path))
    if not args.name:
        names = ", ".join(g.name for g in sch.list_generators())
        raise sch.ScheduleError(f"name a schedule ({names}) or pass --csv FILE")
    actions = 3 * args.pipe * (args.virtual or 2) * args.microbatches
    if actions > sch.MAX_ACTIONS:
        raise sch.ScheduleError(
            f"--pipe {args.pipe} x --microbatches {args.microbatches} makes about {actions:,} actions, more "
            f"than this command lays out ({sch.MAX_ACTIONS:,}); use fewer stages or microbatches"
        )
    return sch.generate(args.name, args.pipe, args.microbatches, args.virtual)


def _costs_from_args(args) -> sch.Costs:
    if args.cost_f == 0 and args.cost_i == 0 and args.cost_w == 0 and not args.cost_b:
        raise sch.ScheduleError(
            "--cost-f, --cost-i and --cost-w are all 0: every action would take no time (a makespan of 0); "
            "give the forward or the backward a cost"
        )
    return sch.Costs(
        f=args.cost_f,
        b=args.cost_b,
        i=args.cost_i,
        w=args.cost_w,
        comm=args.cost_comm,
        activation_bytes=None
        if args.activation_bytes is None
        else parse_bytes(args.activation_bytes, "activation_bytes"),
    )


def _list(args) -> int:
    infos = sch.list_generators()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": i.name,
                        "description": i.description,
                        "virtual": i.default_virtual,
                        "takes_virtual": i.takes_virtual,
                    }
                    for i in infos
                ],
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pipeline schedules")
    table.add_column("name")
    table.add_column("stages per rank")
    table.add_column("description")
    for i in infos:
        table.add_row(i.name, "--virtual V" if i.takes_virtual else str(i.default_virtual), i.description)
    Console().print(table)
    return 0


def _show(args) -> int:
    s = _schedule_from_args(args)
    print(
        f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages (stage -> rank {list(s.stage_to_rank)}), "
        f"{s.num_microbatches} microbatches, {s.num_steps} steps"
    )
    print(sch.format_table(s))
    return 0


def _simulate(args) -> int:
    s = _schedule_from_args(args)
    result = sch.simulate(s, _costs_from_args(args))
    record = result.to_json()
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{s.name}[/bold]: P={s.num_ranks} ranks, {s.num_stages} stages, M={s.num_microbatches}: "
        f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.2%}"
    )
    table = Table()
    table.add_column("rank", justify="right")
    table.add_column("stages")
    table.add_column("busy", justify="right")
    table.add_column("peak live activations", justify="right")
    if result.peak_activation_bytes is not None:
        table.add_column("peak activation bytes", justify="right")
    for rank in range(s.num_ranks):
        row = [
            str(rank),
            ",".join(map(str, s.stages_of(rank))),
            f"{result.busy[rank]:g}",
            str(result.peak_inflight[rank]),
        ]
        if result.peak_activation_bytes is not None:
            row.append(f"{result.peak_activation_bytes[rank]:,.0f}")
        table.add_row(*row)
    console.print(table)
    return 0


def _check(args) -> int:
    s = sch.load_csv(args.file)
    try:
        sch.validate(s)
    except sch.ScheduleError as e:
        print(f"invalid schedule {args.file}:\n{e}", file=sys.stderr)
        return 1
    print(
        f"valid: {args.file}: {s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} microbatches"
        f"{', split backward (I/W)' if s.split_backward else ''}"
        f"{'; forwards only: a table for evaluation, which jaxmem train refuses' if s.forward_only else ''}"
    )
    return 0


def _draw(args) -> int:
    check_output_file(args.output, "-o")
    s = _schedule_from_args(args)
    path = sch.draw(s, args.output, _costs_from_args(args))
    print(f"wrote {path}")
    return 0


def _export(args) -> int:
    check_output_file(args.output, "-o")
    s = _schedule_from_args(args)
    path = sch.save_csv(s, args.output)
    print(f"wrote {path} ({s.num_ranks} ranks x {s.num_steps} steps)")
    return 0
