"""``jaxmem train``: pipelined training of a GPT (the main job)."""

from __future__ import annotations

import argparse
import dataclasses

from jaxmem._errors import JaxmemError
from jaxmem.cli._common import (
    load_toml,
    maybe_initialize_distributed,
    parse_int_list,
    print_json,
    setup_devices,
)

_EPILOG = """\
With no arguments: the tiny GPT on the embedded corpus (CPython's pydoc topics, byte-level), a
4-stage 1F1B pipeline on 4 virtual CPU devices, 300 steps, with a progress bar.

examples:
  jaxmem train
  jaxmem train --schedule zbv --stages 4 --microbatches 8 --steps 100
  jaxmem train --schedule interleaved-1f1b --virtual 2 --data-parallel 2 --json
  jaxmem train --csv my_schedule.csv --stages 4 --microbatches 8
  jaxmem train --policy recompute-all
  jaxmem train --config run.toml --steps 50      # flags override the file

A TOML config holds the same keys as the flags (schedule = "zb-h1", stages = 4, ...). On a GPU/TPU
machine the same command uses the real devices; under `jaxmem launch` it joins the distributed job."""


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", help="model preset: tiny (default), gpt2-small, gpt2-medium, gpt2-xl")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    g.add_argument("--batch-size", type=int, help="global batch in sequences (default 32)")
    g.add_argument("--data", choices=["text", "synthetic"], help="embedded text corpus (default) or random tokens")
    g = p.add_argument_group("pipeline")
    g.add_argument("--schedule", help="schedule name (default 1f1b; see `jaxmem schedule list`)")
    g.add_argument("--csv", dest="schedule_csv", metavar="FILE", help="run a schedule table from a CSV")
    g.add_argument("--stages", type=int, help="pipeline ranks P (default 4)")
    g.add_argument("--microbatches", type=int, help="microbatches per step M (default 8)")
    g.add_argument("--virtual", type=int, help="stages per rank for interleaved-1f1b")
    g.add_argument("--layers-per-stage", help="explicit layer split, e.g. 3,3,2 (default balanced)")
    g.add_argument("--data-parallel", type=int, help="data-parallel replicas D (default 1)")
    g.add_argument("--devices", type=int, help="virtual CPU devices when there is no accelerator (default D x P)")
    g.add_argument("--policy", help="memory policy: a preset name or a TOML file (see `jaxmem memory`)")
    g.add_argument("--plan", choices=["auto"], help="let the planner pick stages, schedule, microbatches, policy")
    g.add_argument("--budget", help="device memory per device for --plan auto, e.g. 12MiB, 24GiB")
    g.add_argument("--hardware", help="planner hardware profile (default: measured here on CPU)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", help="save here and resume from the latest complete checkpoint")
    g.add_argument("--checkpoint-every", type=int, help="save every N steps (default 10)")
    g.add_argument("--keep-checkpoints", type=int, help="keep the last K checkpoints (default 3)")
    g.add_argument("--sample-log", help="log the sample numbers each step consumed (exactly-once checks)")
    g = p.add_argument_group("adaptive memory policy (online profiler)")
    g.add_argument(
        "--adaptive",
        action="store_true",
        default=None,
        help="pick a memory policy per program signature within --budget",
    )
    g.add_argument("--seq-len-schedule", help="sequence-length buckets, e.g. 32,64,128 (a new program each)")
    g.add_argument("--seq-len-order", choices=["cycle", "random"], help="cycle the buckets (default) or draw them")
    g.add_argument("--layer-drop", type=float, help="probability a step skips one random layer (default 0)")
    g.add_argument("--profile-report", metavar="FILE.json", help="write the per-signature table")
    g.add_argument(
        "--no-explore",
        dest="explore",
        action="store_false",
        default=None,
        help="never compile a policy just to measure it (by default the profiler times an untried "
        "policy beside a signature's program, in the background, when the rest of the run pays for it)",
    )
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, help="optimizer steps (default 300)")
    g.add_argument("--lr", type=float, help="Adam learning rate (default 3e-3)")
    g.add_argument("--seed", type=int, help="initialisation and data-order seed (default 0)")
    g.add_argument("--config", help="TOML file with any of these settings; flags override it")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT with a pipeline schedule (the main job)",
        description="Pipelined training in one jax.jit(shard_map(...)) program.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end (progress goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def config_from_args(args) -> object:
    """Merge defaults < TOML file < flags into a TrainConfig."""
    from jaxmem.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values: dict = {}
    if getattr(args, "config", None):
        for key, value in load_toml(args.config).items():
            name = key.replace("-", "_")
            if name == "csv":
                name = "schedule_csv"
            if name not in fields:
                raise JaxmemError(
                    f"{args.config}: unknown setting {key!r}; valid settings: {', '.join(sorted(fields))}"
                )
            values[name] = value
    for name in fields:
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = flag_value
    if isinstance(values.get("seq_len_schedule"), str):
        values["seq_len_schedule"] = parse_int_list(values["seq_len_schedule"], "--seq-len-schedule")
    if isinstance(values.get("budget"), str):
        from jaxmem.cli._common import parse_bytes

        values["budget"] = parse_bytes(values["budget"])
    if isinstance(values.get("layers_per_stage"), str):
        values["layers_per_stage"] = parse_int_list(values["layers_per_stage"], "--layers-per-stage")
    if values.get("schedule_csv") and "schedule" not in values:
        values["schedule"] = None
    return TrainConfig(**values)


def run(args) -> int:
    config = config_from_args(args)
    setup_devices(config.devices or config.data_parallel * config.stages)
    if config.plan == "auto" and not config.devices:
        import dataclasses

        config = dataclasses.replace(config, devices=config.data_parallel * config.stages)
    maybe_initialize_distributed()
    from jaxmem.train import train

    summary = train(config, progress=not args.quiet)
    if args.json:
        print_json(summary)
    elif summary.get("adaptive"):
        print(
            f"done: {summary['steps']} steps, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
            f"{summary['signatures']} programs, {summary['compiles']} compiles, "
            f"{summary['budget_violations']} budget violations"
        )
        for row in summary["profile"]["signatures"]:
            print(
                f"  {row['signature']:40s} {row['policy']:14s} predicted {row['predicted_device_bytes'] / 2**20:7.2f} "
                f"MiB compiled {row['compiled_device_bytes'] / 2**20:7.2f} MiB  seen {row['times_seen']:3d}  "
                f"step {row['step_seconds'] or 0:.3f}s"
            )
    else:
        print(
            f"done: {summary['steps']} steps, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}, "
            f"{summary['tokens_per_second']:,.0f} tokens/s (compile {summary['compile_seconds']:.1f}s)"
        )
    return 0
