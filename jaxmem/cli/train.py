"""``jaxmem train``: pipelined training (the main job)."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import maybe_initialize_distributed, print_json, setup_devices

_EPILOG = """\
With no arguments: the tiny GPT on the embedded corpus (CPython's pydoc topics, byte-level), a
4-stage 1F1B pipeline on 4 virtual CPU devices, 300 steps, with a progress bar.

examples:
  jaxmem train
  jaxmem train --schedule zbv --pipe 4 --microbatches 8 --steps 100
  jaxmem train --schedule interleaved-1f1b --virtual 2 --data-parallel 2 --json
  jaxmem train --csv my_schedule.csv --pipe 4 --microbatches 8
  jaxmem train --policy recompute-all
  jaxmem train --model llama-tiny --dtype bfloat16          # bf16 compute, float32 master weights
  jaxmem train --config run.toml --steps 50      # flags override the file
  jaxmem train --data my_texts/ --tokenizer bpe:4096 --eval-fraction 0.05 --eval-every 100 \\
      --lr-schedule cosine --warmup-steps 100 --weight-decay 0.1 --grad-clip 1.0 \\
      --run-dir runs/a --checkpoint-dir runs/a/ckpt    # then: jaxmem export runs/a/ckpt -o out

A TOML config holds the same keys as the flags (schedule = "zb-h1", pipe = 4, ...). On a GPU/TPU
machine the same command uses the real devices; under `jaxmem launch` it joins the distributed job."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with a pipeline schedule (the main job)",
        description="Pipelined training in one jax.jit(shard_map(...)) program.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from jaxmem.cli._train_args import add_arguments

    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end (progress goes to stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxmem._util import die_with_launcher, launch_settings
    from jaxmem.cli._train_args import from_args

    die_with_launcher()  # a launched worker: stop with its launcher, however that dies
    config = from_args(args, **launch_settings())  # a launched worker: the run's folders and layout
    setup_devices(config.devices or config.num_devices)
    if config.plan == "auto" and not config.devices:
        import dataclasses

        config = dataclasses.replace(config, devices=config.num_devices)
    maybe_initialize_distributed()
    from jaxmem.elastic import worker_hooks
    from jaxmem.train import train

    summary = train(config, progress=not args.quiet, hooks=worker_hooks())
    if summary.get("interrupted"):
        import signal
        import sys

        if config.checkpoint_dir:
            where = f"checkpoint saved in {config.checkpoint_dir}; rerun the same command to resume"
        else:
            where = "nothing saved: pass --checkpoint-dir to keep the progress of an interrupted run"
        print(
            f"stopped by {summary['interrupted']} after step {summary['steps']} of {config.steps} ({where})",
            file=sys.stderr,
        )
        if args.json:
            print_json(summary)
        return 128 + int(getattr(signal, summary["interrupted"]))
    if args.json:
        print_json(summary)
    elif summary.get("trained") is False:
        from jaxmem._util import human_bytes

        print(
            f"compiled for {summary['target']}: {human_bytes(summary['compiled_device_bytes'])} per device; "
            "nothing trained (the target's devices are not here)"
        )
        return 0 if summary["fits_budget"] is not False else 1
    elif summary.get("adaptive"):
        print(
            f"done: {summary['steps']} steps, {_losses(summary)}, "
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
        rate = summary["tokens_per_second"]
        print(
            f"done: {summary['steps']} steps, {_losses(summary)}"
            + (f", {rate:,.0f} tokens/s (compile {summary['compile_seconds']:.1f}s)" if rate else "")
        )
    return 0


def _losses(summary: dict) -> str:
    if summary["loss_first"] is None:  # resumed at or past its last step
        return f"nothing to run (resumed at step {summary['first_step']})"
    return f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}"
