"""``jaxmem verify``: a schedule's gradients against plain ``jax.grad`` on a small copy of a model."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import (
    add_attention_argument,
    add_mesh_arguments,
    model_overrides,
    positive_int,
    print_json,
    resolve_mesh,
    setup_devices,
)

_EPILOG = """\
Run this before trusting a custom schedule, policy or model:
  jaxmem verify --schedule zbv --pipe 4 --microbatches 8
  jaxmem verify --csv my_schedule.csv --json
  jaxmem verify --schedule 1f1b --policy recompute-all
  jaxmem verify --model llama-tiny --schedule interleaved-1f1b --virtual 2
  jaxmem verify --model llama-tiny --dtype bfloat16 --loss-mask --drop-layers 1
  jaxmem verify --model llama-tiny --mesh data=2,fsdp=2,pipe=2 --microbatches 4

The model is a small copy of the preset (--model, default tiny) whose layers split evenly over the
schedule's stages. Tolerances follow the compute dtype: float32 element-wise |pipelined - plain| <=
1e-6 + 1e-5 |plain|; bfloat16 per array ||pipelined - plain|| <= 4e-2 ||plain|| (bf16 rounds each
microbatch's products apart from the whole batch's). Exit code 0 when it holds, 1 when it does not."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check that a schedule gives plain jax.grad gradients",
        description="Pipelined gradients vs plain jax.grad on a small copy of a model.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="model preset to copy small (default tiny; e.g. llama-tiny), or your own as package.module:attr "
        "(checked as it is: pick a schedule whose stages divide its layers)",
    )
    p.add_argument("--dtype", help="compute dtype (e.g. bfloat16; default the model's)")
    p.add_argument("--param-dtype", help="parameter dtype (default float32)")
    add_attention_argument(p)
    p.add_argument("--schedule", help="schedule name (see `jaxmem schedule list`)")
    p.add_argument("--csv", metavar="FILE", help="a schedule table instead of a name")
    p.add_argument("--pipe", "--stages", dest="pipe", metavar="P", type=positive_int, help="pipe ranks P (default 4)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="microbatches M (default 8)")
    p.add_argument("--virtual", type=positive_int, help="stages per rank for interleaved-1f1b")
    add_mesh_arguments(p)
    p.add_argument("--devices", type=positive_int, help="virtual CPU devices (default data x fsdp x pipe x tensor)")
    p.add_argument("--policy", help="memory policy preset or TOML file")
    p.add_argument("--drop-layers", help="layers to skip in both computations (layer drop), e.g. 1,3")
    p.add_argument("--loss-mask", action="store_true", help="mask a random 30%% of the targets out of the loss")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxmem import schedule as sch
    from jaxmem._util import parse_int_list

    resolve_mesh(args)
    if args.csv and args.schedule:
        raise sch.ScheduleError("give either --schedule NAME or --csv FILE, not both")
    if args.csv:
        schedule = sch.validate(sch.load_csv(args.csv))
    else:
        schedule = sch.generate(args.schedule or "1f1b", args.pipe, args.microbatches, args.virtual)
    drop = frozenset(parse_int_list(args.drop_layers, "drop_layers")) if args.drop_layers else frozenset()
    setup_devices(args.devices or args.data_parallel * args.fsdp * schedule.num_ranks * args.tensor)
    from jaxmem.verify import verification_model, verify

    model = verification_model(schedule.num_stages, args.model, **model_overrides(args))
    result = verify(
        schedule,
        model=model,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        tensor=args.tensor,
        zero=args.zero,
        vocab_parallel=None if args.vocab_split else False,
        policy=args.policy,
        drop_layers=drop,
        loss_mask=args.loss_mask,
    )
    if args.json:
        print_json(result)
    else:
        status = "OK" if result["ok"] else "MISMATCH"
        print(
            f"{status}: {result['model']} ({result['dtype']}), {result['schedule']} (P={result['ranks']}, "
            f"stages={result['stages']}, M={result['microbatches']}, data={result['data_parallel']}"
            f"{', fsdp=' + str(result['fsdp']) if result['fsdp'] > 1 else ''}"
            f"{', tensor=' + str(result['tensor']) if result['tensor'] > 1 else ''}): max |diff| "
            f"{result['max_abs_diff']:.2e}, max relative {result['max_rel_diff']:.2e}, loss "
            f"{result['loss']:.6f} vs {result['loss_plain']:.6f} [{result['tolerance']}]"
            + ("" if result["ok"] else f"; first mismatch at {result['first_mismatch']}")
        )
    return 0 if result["ok"] else 1
