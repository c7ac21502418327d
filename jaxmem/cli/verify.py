"""``jaxmem verify``: a schedule's gradients against plain ``jax.grad`` on a small copy of a model."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import (
    add_attention_argument,
    add_mesh_arguments,
    add_target_argument,
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
  jaxmem verify --model gpt2-small --schedule zbv --pipe 4 --microbatches 16 --batch-size 32 --seq-len 1024 \
      --policy chronos-recomp --budget 6GiB --hardware h100 --split-backward   # a jaxmem plan pick, word for word

The model is a small copy of the preset (--model, default tiny) whose layers split evenly over the
schedule's stages. A pick of jaxmem plan verifies by the words of its train command: a chronos-*
policy is generated for the full model, mesh, batch and sequence under --budget on the --hardware
(or --target) profile, as jaxmem train generates it, and that policy checked on the small copy
(--batch-size and --seq-len shape only the generation). Tolerances follow the compute dtype:
float32 element-wise |pipelined - plain| <= 1e-6 + 1e-5 |plain|; bfloat16 per array
||pipelined - plain|| <= 4e-2 ||plain|| (bf16 rounds each microbatch's products apart from the
whole batch's). Exit code 0 when it holds, 1 when it does not."""


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
    p.add_argument(
        "--policy",
        help="memory policy preset or TOML file; or chronos-recomp, chronos-offload, chronos-both, generated under "
        "--budget for the full model and layout (as jaxmem train does) and checked on the small copy",
    )
    p.add_argument("--budget", help="device memory per device a chronos-* policy is generated for, e.g. 40GiB")
    p.add_argument("--hardware", help="hardware profile a chronos-* policy is priced on (as jaxmem train's)")
    add_target_argument(p, "a chronos-* policy is generated for")
    p.add_argument("--batch-size", type=positive_int, help="global batch a chronos-* policy is generated for")
    p.add_argument("--seq-len", type=positive_int, help="sequence length a chronos-* policy is generated for")
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="on schedules with I and W (zb-h1, zbv, chronos): W takes I's cotangents, as jaxmem train's",
    )
    p.add_argument(
        "--hand-recomputed", action="store_true", help="with --split-backward: I also hands W what it recomputed"
    )
    p.add_argument("--drop-layers", help="layers to skip in both computations (layer drop), e.g. 1,3")
    p.add_argument("--loss-mask", action="store_true", help="mask a random 30%% of the targets out of the loss")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxmem import schedule as sch
    from jaxmem._errors import JaxmemError
    from jaxmem._util import parse_int_list
    from jaxmem.config import GENERATED_POLICIES, check_split_backward

    resolve_mesh(args)
    generated = args.policy in GENERATED_POLICIES
    shaping = (args.budget, args.hardware, args.target, args.batch_size, args.seq_len)
    if not generated and any(v is not None for v in shaping):
        raise JaxmemError(
            "--budget, --hardware, --target, --batch-size and --seq-len say what a chronos-* --policy is generated "
            "for; drop them, or give one (chronos-recomp, chronos-offload, chronos-both)"
        )
    if args.hand_recomputed and not args.split_backward:
        raise JaxmemError(
            "--hand-recomputed hands W what I recomputed when the backward is split: set --split-backward too"
        )
    if args.csv and args.schedule:
        raise sch.ScheduleError("give either --schedule NAME or --csv FILE, not both")
    if args.csv:
        schedule = sch.validate(sch.load_csv(args.csv))
    else:
        schedule = sch.generate(args.schedule or "1f1b", args.pipe, args.microbatches, args.virtual)
    check_split_backward(schedule, args.split_backward)
    drop = frozenset(parse_int_list(args.drop_layers, "drop_layers")) if args.drop_layers else frozenset()
    setup_devices(args.devices or args.data_parallel * args.fsdp * schedule.num_ranks * args.context * args.tensor)
    from jaxmem.verify import verification_model, verify

    model = verification_model(schedule.num_stages, args.model, **model_overrides(args))
    policy = _policy(args, schedule)
    result = verify(
        schedule,
        model=model,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        tensor=args.tensor,
        context=args.context,
        zero=args.zero,
        vocab_parallel=None if args.vocab_split else False,
        policy=policy,
        drop_layers=drop,
        loss_mask=args.loss_mask,
        split_backward=args.split_backward,
        hand_recomputed=args.hand_recomputed,
    )
    if args.json:
        print_json(result)
    else:
        status = "OK" if result["ok"] else "MISMATCH"
        print(
            f"{status}: {result['model']} ({result['dtype']}), {result['schedule']} (P={result['ranks']}, "
            f"stages={result['stages']}, M={result['microbatches']}, data={result['data_parallel']}"
            f"{', fsdp=' + str(result['fsdp']) if result['fsdp'] > 1 else ''}"
            f"{', context=' + str(result['context']) if result['context'] > 1 else ''}"
            f"{', tensor=' + str(result['tensor']) if result['tensor'] > 1 else ''}): max |diff| "
            f"{result['max_abs_diff']:.2e}, max relative {result['max_rel_diff']:.2e}, loss "
            f"{result['loss']:.6f} vs {result['loss_plain']:.6f} [{result['tolerance']}]"
            + ("" if result["ok"] else f"; first mismatch at {result['first_mismatch']}")
        )
    return 0 if result["ok"] else 1


def _policy(args, schedule):
    """The policy to verify: as given, or a chronos-* one generated for the full model and layout as
    ``jaxmem train`` generates it (a per-stage policy the small copy runs as it is)."""
    from jaxmem.config import GENERATED_POLICIES, TrainConfig

    if args.policy not in GENERATED_POLICIES:
        return args.policy
    config = TrainConfig(
        model=args.model,
        **model_overrides(args),
        schedule=args.schedule or "1f1b",
        schedule_csv=args.csv,
        pipe=schedule.num_ranks,
        microbatches=schedule.num_microbatches,
        virtual=args.virtual,
        data_parallel=args.data_parallel,
        fsdp=args.fsdp,
        tensor=args.tensor,
        zero=args.zero,
        vocab_split=args.vocab_split,
        batch_size=args.batch_size or 32,
        seq_len=args.seq_len or 64,
        policy=args.policy,
        budget=args.budget,
        hardware=args.hardware or "auto",
        target=args.target,
        split_backward=args.split_backward,
        hand_recomputed=args.hand_recomputed,
        data="synthetic",
        steps=1,
    )
    return config.build_policy()
