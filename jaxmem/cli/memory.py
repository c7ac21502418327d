"""``jaxmem memory``: the per-rank memory ledger, predicted and compiled, side by side."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import print_json, setup_devices

_EPILOG = """\
examples:
  jaxmem memory                                          # tiny GPT, 1f1b P=4 M=8, save-all
  jaxmem memory --policy recompute-all --json
  jaxmem memory --schedule interleaved-1f1b --virtual 2 --policy selective -o ledger.png
  jaxmem memory --model llama-tiny --dtype bfloat16 --policy selective
  jaxmem memory --model gpt2-xl --stages 8 --microbatches 16 --batch-size 16 --seq-len 1024 --compile no

Policies: save-all, recompute-all, selective, offload-stash, offload-weights, offload-optimizer-state,
offload-tags, or a TOML file (see README). "predicted" comes from the model's facts -- its traced
residuals and cost_analysis() FLOPs (the GPT: its closed form) -- without compiling the step;
"compiled" from the jitted train step's memory_analysis() and the program's residuals and array
memory kinds. On CPU, host offload is not lowered: offloaded bytes are proved structurally and their
device saving is predicted."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="per-rank memory ledger: predicted vs compiled, by category",
        description="Bytes per rank on device and host: params, grads, optimizer state, stash, transient.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="model preset (default tiny; e.g. llama-tiny, gpt2-xl)")
    p.add_argument("--dtype", help="compute dtype (e.g. bfloat16; default the model's)")
    p.add_argument("--param-dtype", help="parameter dtype (default float32)")
    p.add_argument("--schedule", default="1f1b", help="schedule name (default 1f1b)")
    p.add_argument("--csv", metavar="FILE", help="a schedule table instead of a name")
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks P (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches M (default 8)")
    p.add_argument("--virtual", type=int, help="stages per rank for interleaved-1f1b")
    p.add_argument("--policy", default="save-all", help="policy preset or TOML file (default save-all)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument(
        "--compile",
        choices=["auto", "yes", "no"],
        default="auto",
        help="compile the step for the compiled column (auto: when it needs < 2 GiB in all)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("-o", "--output", help="bar chart of the ledger (.png/.svg)")
    p.set_defaults(run=run)


def _config(args):
    from jaxmem.config import TrainConfig

    return TrainConfig(
        model=args.model,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        schedule=None if args.csv else args.schedule,
        schedule_csv=args.csv,
        stages=args.stages,
        microbatches=args.microbatches,
        virtual=args.virtual,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        data_parallel=args.data_parallel,
        policy=args.policy,
        steps=1,
    )


def ledger_report(config, compile_mode: str = "auto") -> dict:
    """Predicted ledger, and the compiled one when asked (or small enough); the JSON of the command."""
    from jaxmem.memory import compare, predict

    model = config.build_model()
    schedule = config.build_schedule()
    predicted = predict(
        model,
        schedule,
        config.policy,
        batch=config.batch_size,
        seq=config.seq_len,
        data_parallel=config.data_parallel,
        layer_counts=config.layers_per_stage,
    )
    devices = config.data_parallel * config.stages
    small = predicted.max_device_bytes * devices < 2 * 2**30
    if compile_mode == "yes" or (compile_mode == "auto" and small):
        from jaxmem.train import Trainer

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
    return report


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
    for note in report["notes"]:
        console.print(f"note: {note}")


def draw_ledger(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxmem.memory import CATEGORIES

    ranks = [row["rank"] for row in report["ranks"]]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ranks) + 3), 4))
    bottom = [0.0] * len(ranks)
    for name in CATEGORIES:
        heights = [row["categories"][name]["predicted_device"] / 2**20 for row in report["ranks"]]
        ax.bar([r - 0.2 for r in ranks], heights, width=0.4, bottom=bottom, label=f"{name} (predicted)")
        bottom = [b + h for b, h in zip(bottom, heights)]
    host = [row["predicted_host_bytes"] / 2**20 for row in report["ranks"]]
    ax.bar([r + 0.2 for r in ranks], host, width=0.4, color="lightgrey", hatch="//", label="host (predicted)")
    compiled = [row["compiled_device_bytes"] for row in report["ranks"]]
    if all(c is not None for c in compiled):
        ax.scatter(
            ranks,
            [c / 2**20 for c in compiled],
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label="compiled device total",
        )
    ax.set_xticks(ranks)
    ax.set_xticklabels([f"rank {r}" for r in ranks])
    ax.set_ylabel("MiB")
    ax.set_title(f"{report['model']} {report['schedule']}, policy {report['policy']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def run(args) -> int:
    from jaxmem._errors import JaxmemError

    if args.output and not args.output.lower().endswith((".png", ".svg", ".pdf")):
        raise JaxmemError(f"cannot draw to {args.output!r}: use a .png, .svg or .pdf file name")
    config = _config(args)
    setup_devices(config.data_parallel * config.stages)
    report = ledger_report(config, args.compile)
    if args.output:
        draw_ledger(report, args.output)
    if args.json:
        print_json(report)
    else:
        print_table(report)
        if args.output:
            print(f"wrote {args.output}")
    return 0
