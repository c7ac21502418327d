"""``jaxmem memory``: the per-rank memory ledger, predicted and compiled, side by side."""

from __future__ import annotations

import argparse
import dataclasses

from jaxmem._util import parse_bytes
from jaxmem.cli._common import (
    add_attention_argument,
    add_mesh_arguments,
    add_target_argument,
    check_output_file,
    positive_int,
    print_json,
    resolve_mesh,
    setup_devices,
)

_EPILOG = """\
examples:
  jaxmem memory                                          # tiny GPT, 1f1b P=4 M=8, save-all
  jaxmem memory --policy recompute-all --json
  jaxmem memory --schedule interleaved-1f1b --virtual 2 --policy selective -o ledger.png
  jaxmem memory --model llama-tiny --dtype bfloat16 --policy selective
  jaxmem memory --model gpt2-xl --pipe 8 --microbatches 16 --batch-size 16 --seq-len 1024 --compile no
  jaxmem memory --model gpt2-small --dtype bfloat16 --seq-len 512 --batch-size 16 --target tpu-v5e
  jaxmem memory --policy offload-stash --dtype bfloat16 --target h100      # compiled for 4 H100s, here

Policies: save-all, recompute-all, selective, offload-stash, offload-weights, offload-optimizer-state,
offload-tags, or a TOML file (docs/guides/ledger.md). "predicted" comes from the model's facts -- its traced
residuals and cost_analysis() FLOPs (the GPT: its closed form) -- without compiling the step;
"compiled" from the jitted train step's memory_analysis() and the program's residuals and array
memory kinds. On CPU, host offload is not lowered: offloaded bytes are proved structurally and their
device saving is predicted. With --target, both columns are the target's compiler's: the stage
backwards the prediction reads and the whole step are compiled for its devices on this machine, with
none present (a TPU's figure is its compiler's peak, the one it checks against HBM)."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="per-rank memory ledger: predicted vs compiled, by category",
        description="Bytes per rank on device and host: params, grads, optimizer state, stash, transient.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="model preset (default tiny; e.g. llama-tiny, gpt2-xl), or your own as package.module:attr",
    )
    p.add_argument("--dtype", help="compute dtype (e.g. bfloat16; default the model's)")
    p.add_argument("--param-dtype", help="parameter dtype (default float32)")
    add_attention_argument(p)
    p.add_argument("--schedule", default="1f1b", help="schedule name (default 1f1b)")
    p.add_argument("--csv", metavar="FILE", help="a schedule table instead of a name")
    p.add_argument("--pipe", "--stages", dest="pipe", metavar="P", type=positive_int, help="pipe ranks P (default 4)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="microbatches M (default 8)")
    p.add_argument("--virtual", type=positive_int, help="stages per rank for interleaved-1f1b")
    p.add_argument(
        "--policy",
        default="save-all",
        help="policy preset or TOML file (default save-all); or chronos-recomp, chronos-offload, chronos-both: "
        "generated for this layout under --budget, as jaxmem plan generates them",
    )
    p.add_argument(
        "--hardware",
        default="auto",
        help="the profile a chronos-* policy is priced on: h100, tpu-v5e, tpu-v5p, tpu-v6e, tpu-v4, cpu (measured "
        "here), or auto (--target's, else this platform's; default)",
    )
    add_target_argument(p, "the step is compiled for")
    p.add_argument("--batch-size", type=positive_int, default=32, help="global batch (default 32)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="sequence length (default 64)")
    add_mesh_arguments(p)
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="on schedules that split the backward (zb-h1, zbv, chronos): W takes I's cotangents, held from I to W",
    )
    p.add_argument(
        "--hand-recomputed",
        action="store_true",
        help="with --split-backward: I also hands W the forward values it recomputed, held from I to W",
    )
    p.add_argument(
        "--compile",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compile the step for the compiled column (auto: for a --target always, here when it needs < 2 GiB "
        "in all)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--budget",
        help="device memory per device to check against, e.g. 12MiB (drawn as a line with -o; the table "
        "and JSON say whether each rank fits)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="bar chart: per rank, predicted and compiled bytes by category side by side, host bytes, "
        "live stash and budget (.png/.svg/.pdf)",
    )
    p.set_defaults(run=run)


def _config(args, budget=None):
    from jaxmem.config import GENERATED_POLICIES, TrainConfig

    return TrainConfig(
        budget=budget if args.policy in GENERATED_POLICIES else None,
        hardware=args.hardware,
        target=args.target,
        model=args.model,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        attention=args.attention,
        schedule=None if args.csv else args.schedule,
        schedule_csv=args.csv,
        pipe=args.pipe,
        microbatches=args.microbatches,
        virtual=args.virtual,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        tensor=args.tensor,
        context=args.context,
        zero=args.zero,
        vocab_split=args.vocab_split,
        policy=args.policy,
        split_backward=args.split_backward,
        hand_recomputed=args.hand_recomputed,
        steps=1,
    )


def ledger_report(config, compile_mode: str = "auto") -> dict:
    """Predicted ledger, and the compiled one when asked (or small enough); the JSON of the command."""
    from jaxmem.memory import compare, predict

    model = config.build_model()
    schedule = config.build_schedule()
    policy = config.build_policy(model, schedule)
    config = dataclasses.replace(config, policy=policy, budget=None)
    target = config.compile_target()
    predicted = predict(
        model,
        schedule,
        policy,
        batch=config.batch_size,
        seq=config.seq_len,
        data_parallel=config.data_parallel,
        fsdp=config.fsdp,
        tensor=config.tensor,
        context=config.context,
        zero=config.zero,
        vocab_parallel=config.vocab_parallel,
        layer_counts=config.layers_per_stage,
        split_backward=config.split_backward,
        hand_recomputed=config.hand_recomputed,
        target=target,
    )
    devices = config.num_devices
    small = predicted.max_device_bytes * devices < 2 * 2**30
    if compile_mode == "yes" or (compile_mode == "auto" and (small or target is not None)):
        import sys

        from jaxmem.train import Trainer

        if target is not None:
            print(f"compiling the step for {target.with_devices(devices)} (no device present)...", file=sys.stderr)
        report = compare(predicted, Trainer(config).measure_memory())
    else:
        report = {
            "policy": predicted.meta["policy"],
            "schedule": predicted.meta["schedule"],
            "meta": predicted.meta,
            "ranks": [
                {
                    "rank": r.rank,
                    "predicted_device_bytes": int(round(r.device_bytes)),
                    "predicted_host_bytes": int(round(r.host_bytes)),
                    "compiled_device_bytes": None,
                    "live_stash_bytes": int(round(r.live_stash_bytes)),
                    "categories": {
                        k: {
                            "predicted_device": int(round(v.device)),
                            "predicted_host": int(round(v.host)),
                            "program_device": None,
                            "program_host": None,
                        }
                        for k, v in r.categories.items()
                    },
                }
                for r in predicted.ranks
            ],
            "max_prediction_error": None,
            "notes": ["not compiled (--compile no, or too large for this machine): predicted figures only"],
        }
    report["model"] = model.name
    report["target"] = "cpu" if target is None else str(target.with_devices(devices))
    return report


def _device_total(row: dict) -> float:
    """A rank's device bytes: the compiled total when compiled, else the predicted one."""
    compiled = row["compiled_device_bytes"]
    return row["predicted_device_bytes"] if compiled is None else compiled


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.2f}"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from jaxmem.memory import CATEGORIES

    console = Console()
    meta = report["meta"]
    console.print(
        f"[bold]{report['model']}[/bold], {report['schedule']} (P={meta['ranks_count']}, stages={meta['stages']}, "
        f"M={meta['microbatches']}, microbatch {meta['microbatch_size']} x {meta['seq_len']}), policy "
        f"[bold]{report['policy']}[/bold]"
        + (f", compiled for [bold]{report['target']}[/bold]" if report.get("target", "cpu") != "cpu" else "")
    )
    first = report["ranks"][0]["categories"]
    table = Table(title="every rank allocates (MiB)")
    for column in ("category", "device predicted", "device compiled", "host predicted", "host program"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name in CATEGORIES:
        c = first[name]
        table.add_row(
            name.replace("_", " "),
            _mib(c["predicted_device"]),
            _mib(c["program_device"]),
            _mib(c["predicted_host"]),
            _mib(c["program_host"]),
        )
    console.print(table)
    table = Table(title="per rank (MiB)")
    for column in ("rank", "device predicted", "device compiled", "error", "host predicted", "live stash"):
        table.add_column(column, justify="right")
    for row in report["ranks"]:
        err = row.get("prediction_error")
        table.add_row(
            str(row["rank"]),
            _mib(row["predicted_device_bytes"]),
            _mib(row["compiled_device_bytes"]),
            "-" if err is None else f"{err:+.1%}",
            _mib(row["predicted_host_bytes"]),
            _mib(row["live_stash_bytes"]),
        )
    console.print(table)
    budget = report.get("budget_bytes")
    if budget:
        over = [row["rank"] for row in report["ranks"] if not row["fits_budget"]]
        source = "compiled" if report["ranks"][0]["compiled_device_bytes"] is not None else "predicted"
        console.print(
            f"budget {_mib(budget)} MiB per device: "
            + (f"ranks {over} exceed it ({source} bytes)" if over else f"every rank fits ({source} bytes)")
        )
    for note in report["notes"]:
        console.print(f"note: {note}")


def draw_ledger(report: dict, path: str, budget: float | None = None) -> None:
    """Per rank, side by side: the predicted device bytes and the compiled program's, stacked by
    category in the same colours (the compiled bar hatched, with ``memory_analysis()``'s total as a
    black line), the predicted host bytes, and the rank's own live stash as a gold tick inside the
    stash; numbers on every bar, and the budget as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from jaxmem.memory import CATEGORIES

    rows = report["ranks"]
    ranks = [row["rank"] for row in rows]
    compiled_known = all(row["compiled_device_bytes"] is not None for row in rows)
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors))
    width = 0.27
    offsets = (
        {"predicted": -width, "compiled": 0.0, "host": width} if compiled_known else {"predicted": -0.15, "host": 0.15}
    )
    fig, ax = plt.subplots(figsize=(max(7.0, 2.2 * len(ranks) + 3.5), 4.5))
    top = 0.0

    def label_bar(x, height, text):
        ax.text(x, height, text, ha="center", va="bottom", fontsize=7)

    for i, row in enumerate(rows):
        stacks = [("predicted", "predicted_device", None)] + (
            [("compiled", "program_device", "//")] if compiled_known else []
        )
        for bar, key, hatch in stacks:
            x = i + offsets[bar]
            bottom = 0.0
            for name in CATEGORIES:
                height = row["categories"][name][key] / 2**20
                ax.bar(x, height, width=width, bottom=bottom, color=colors[name], hatch=hatch, edgecolor="white")
                if name == "stash" and bar == "predicted" and row.get("live_stash_bytes") is not None:
                    live = bottom + row["live_stash_bytes"] / 2**20
                    ax.plot([x - width / 2, x + width / 2], [live, live], color="gold", linewidth=3)
                bottom += height
            label_bar(x, bottom, f"{bottom:,.2f}")
            top = max(top, bottom)
        if compiled_known:
            total = row["compiled_device_bytes"] / 2**20
            x = i + offsets["compiled"]
            ax.plot([x - width / 2, x + width / 2], [total, total], color="black", linewidth=2)
            if abs(total - bottom) > 0.02 * max(total, 1e-9):
                ax.text(x + width / 2, total, f" {total:,.2f}", fontsize=7, va="center", ha="left")
            top = max(top, total)
        host = row["predicted_host_bytes"] / 2**20
        ax.bar(i + offsets["host"], host, width=width, color="lightgrey", hatch="..", edgecolor="grey")
        label_bar(i + offsets["host"], host, f"{host:,.2f}")
        top = max(top, host)
    if budget:
        ax.axhline(budget / 2**20, color="red", linestyle="--", linewidth=1)
        ax.text(
            len(ranks) - 0.5,
            budget / 2**20,
            f"budget {budget / 2**20:,.2f} MiB",
            color="red",
            fontsize=7,
            ha="right",
            va="bottom",
        )
        top = max(top, budget / 2**20)
    ax.set_ylim(0, top * 1.12 or 1.0)
    ax.set_xticks(range(len(ranks)))
    bars = " | ".join(offsets)
    ax.set_xticklabels([f"rank {r}\n{bars}" for r in ranks], fontsize=8)
    ax.set_ylabel("MiB per device")
    ax.set_title(
        f"{report['model']} {report['schedule']}, policy {report['policy']}: device memory predicted"
        + (" vs compiled" if compiled_known else " (not compiled)"),
        fontsize=9,
    )
    handles = [Patch(color=colors[name], label=name.replace("_", " ")) for name in CATEGORIES]
    if compiled_known:
        handles += [
            Patch(facecolor="white", edgecolor="grey", hatch="//", label="compiled (program's buffers)"),
            Line2D([], [], color="black", linewidth=2, label="compiled total (memory_analysis)"),
        ]
    handles += [
        Patch(facecolor="lightgrey", edgecolor="grey", hatch="..", label="host (predicted)"),
        Line2D([], [], color="gold", linewidth=3, label="rank's own live stash (peak need)"),
    ]
    if budget:
        handles.append(Line2D([], [], color="red", linestyle="--", label="budget"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # an SVG keeps its text as text
            fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)


def run(args) -> int:
    from jaxmem._errors import JaxmemError

    if args.output and not args.output.lower().endswith((".png", ".svg", ".pdf")):
        raise JaxmemError(f"cannot draw to {args.output!r}: use a .png, .svg or .pdf file name")
    if args.output:
        check_output_file(args.output, "-o")
    budget = parse_bytes(args.budget) if args.budget else None
    resolve_mesh(args)
    config = _config(args, budget)
    setup_devices(config.num_devices)
    report = ledger_report(config, args.compile)
    if budget:
        report["budget_bytes"] = budget
        for row in report["ranks"]:
            row["fits_budget"] = _device_total(row) <= budget
    if args.output:
        draw_ledger(report, args.output, budget)
    if args.json:
        print_json(report)
    else:
        print_table(report)
        if args.output:
            print(f"wrote {args.output}")
    return 0
