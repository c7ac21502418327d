"""``jaxmem plan``: pick schedule, microbatches and memory policy under a per-device budget."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import (
    add_attention_argument,
    add_target_argument,
    model_overrides,
    parse_bytes,
    positive_float,
    positive_int,
    print_json,
)

_EPILOG = """\
examples:
  jaxmem plan --model gpt2-xl --devices 8 --budget 24GiB
  jaxmem plan --model gpt2-medium --devices 16 --budget 16GiB --hardware tpu-v5p --json
  jaxmem plan --model tiny --devices 4 --budget 12MiB --hardware cpu --batch-size 32 --seq-len 64
  jaxmem plan --model llama-8b --dtype bfloat16 --devices 16 --budget 40GiB --seq-len 4096
  jaxmem plan --model llama-8b --dtype bfloat16 --mesh data=2,pipe=4,tensor=2 --budget 40GiB --seq-len 4096
  jaxmem plan --model llama-8b --dtype bfloat16 --target h100:16 --budget 40GiB --seq-len 4096
  jaxmem train --plan auto --budget 12MiB          # plan, then train with the pick

Searches meshes of the devices (pipeline sizes, a tensor split of each pipe rank's devices into 1, 2,
4 or 8 for models that annotate one, and the rest split between whole-parameter data replicas and
FSDP shards; an FSDP-only layout without a pipeline is one candidate; --mesh fixes one), schedules (gpipe,
1f1b, interleaved-1f1b, zb-h1, zbv, chronos; the last three with and without --split-backward, which
makes W half a backward for the memory of the cotangents I hands it, and under recompute-all
also with --hand-recomputed, which spares W its forward for the memory of the activations I
recomputed), microbatch counts and policies
(save-all, selective, recompute-all, Chronos-Recomp, Chronos-Offload and both), scores each with the predicted memory
ledger and the schedule simulator on a hardware profile (h100, tpu-v5p, or cpu = measured on this
machine), and returns the fastest that fits. The optimizer state is sharded over the replicas (ZeRO)
and the vocabulary over the pipe ranks; communication is priced on the profile's links. MFU = the
model's FLOPs per token (forward and backward, recompute not counted) x tokens/s / (devices x peak).
A model's residuals and FLOPs are traced abstractly (the GPT presets use their closed form) and one
stage's backward is compiled alone for its working set -- by XLA:CPU, or with --target by the
target's own compiler, here, with no device present. With --target (or --hardware cpu and the
devices here) the fastest picks are then compiled whole in turn and the first whose memory_analysis()
fits is taken, saying which were passed over; elsewhere the plan keeps a margin for the ledger's
error free (--margin; default 0.05, its measured band). Exit code 1 when nothing fits, with the
smallest budget that would.

Notation: P pipe ranks, V stages per rank (interleaved), D data-parallel replicas holding whole
parameters, F FSDP replicas holding a shard of each, T tensor-parallel devices, M microbatches;
the policy is a preset (save-all, selective, recompute-all, offload-*) or chronos-recomp /
chronos-offload / chronos-both, generated for the layout under the budget."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose schedule, microbatches and memory policy under a budget",
        description="The planner: fastest simulated plan whose predicted per-device bytes fit the budget.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="model preset (default tiny; e.g. gpt2-xl, llama-8b), or your own as package.module:attr",
    )
    p.add_argument("--dtype", help="compute dtype (e.g. bfloat16; default the model's)")
    p.add_argument("--param-dtype", help="parameter dtype (default float32)")
    add_attention_argument(p)
    p.add_argument("--devices", type=positive_int, help="devices available (data x fsdp x pipe x tensor)")
    p.add_argument(
        "--mesh",
        metavar="AXES",
        help="plan this mesh only, e.g. data=2,pipe=4,context=2,tensor=2 (its product is the devices); "
        "schedules, microbatches and policies are still searched",
    )
    p.add_argument("--budget", required=True, help="device memory per device, e.g. 24GiB, 512MiB, 8e9")
    p.add_argument(
        "--hardware",
        help="hardware profile: h100 (default without --target), tpu-v5e, tpu-v5p, tpu-v6e, tpu-v4, or cpu "
        "(measured here); --target's by default",
    )
    add_target_argument(p, "the plan is for (its devices: --devices, or the target's count)")
    p.add_argument("--host-bandwidth", type=positive_float, help="host link GB/s per device (overrides the profile)")
    p.add_argument("--batch-size", type=positive_int, help="global batch (default: 32 for tiny, 4 x devices otherwise)")
    p.add_argument("--seq-len", type=positive_int, help="sequence length (default: the model's maximum)")
    p.add_argument("--pipe", type=positive_int, action="append", help="only these pipeline sizes (repeatable)")
    p.add_argument(
        "--margin",
        type=float,
        help="plan under the budget / (1 + MARGIN), e.g. 0.1 (default: 0 with --hardware cpu and the devices here, "
        "where each pick is compiled and checked; else the ledger's measured error, 0.05)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def make_plan(
    model,
    devices: int,
    budget: float,
    hardware: str,
    host_bandwidth: float | None = None,
    batch: int | None = None,
    seq: int | None = None,
    pipes=None,
    progress: bool = True,
    mesh: dict | None = None,
    margin: float | None = None,
    target=None,
    **overrides,
):
    """Run the configuration search for a model (a preset name, config or StagedModel); ``mesh``
    (``{"data", "fsdp", "pipe", "tensor"}``): that layout only. On the CPU profile with the devices
    here, the fastest picks are compiled in turn and the first that fits is taken; elsewhere the plan
    keeps ``margin`` free (default :data:`~jaxmem.search.LEDGER_MARGIN`)."""
    import dataclasses
    import sys

    import jax

    from jaxmem._errors import JaxmemError
    from jaxmem.memory import get_hardware
    from jaxmem.models import get_model
    from jaxmem.search import LEDGER_MARGIN, confirm, progress_lines, search
    from jaxmem.targets import parse_target

    if mesh is not None:
        product = mesh["data"] * mesh["fsdp"] * mesh["pipe"] * mesh["context"] * mesh["tensor"]
        if devices is not None and devices != product:
            raise JaxmemError(
                f"--mesh takes {product} devices but --devices is {devices}: drop --devices (the mesh says it)"
            )
        if pipes:
            raise JaxmemError("--mesh sets the pipeline size; drop --pipe (or --mesh)")
        devices = product
    if devices is None and target is not None and parse_target(target).count:
        devices = parse_target(target).count
    if devices is None:
        raise JaxmemError(
            "say how many devices to plan for: --devices N, a mesh with --mesh data=2,pipe=4, or a target's count "
            "(--target h100:16)"
        )
    if devices < 1:
        raise JaxmemError(f"--devices must be >= 1, got {devices}")
    target = parse_target(target)
    if target is not None and not target.compile_only:
        target = None
    if target is not None:
        if hardware is not None and get_hardware(hardware).name != target.name:
            raise JaxmemError(
                f"--hardware {hardware} and --target {target} name two machines: the target's profile is "
                f"{target.name}. Drop --hardware"
            )
        hardware = target.name
    hardware = hardware or "h100"
    model = get_model(model, **{k: v for k, v in overrides.items() if v is not None})
    hw = get_hardware(hardware)
    if host_bandwidth:
        hw = dataclasses.replace(hw, host_bandwidth=host_bandwidth * 1e9, note=hw.note + "; host link set by flag")
    batch = batch or (32 if model.name in ("tiny", "llama-tiny") else 4 * devices)
    seq = seq or model.max_seq_len or 1024
    if batch < 1 or seq < 1:
        raise JaxmemError(f"--batch-size and --seq-len must be >= 1, got {batch} and {seq}")
    model.check_batch(seq, "--seq-len")
    # On a terminal one line rewritten in place; elsewhere (a log file, a pipe) a plain line a tenth.
    terminal = progress and sys.stderr.isatty()
    report = None
    if terminal:
        report = progress_lines(lambda line: print(f"\r{line}", end="", file=sys.stderr, flush=True), lines=None)
    elif progress:
        report = progress_lines(lambda line: print(line, file=sys.stderr, flush=True))

    here = hw.name == "cpu" and devices <= jax.device_count()
    checked = here or target is not None  # each pick compiled in turn, and the first that fits taken
    result = search(
        model,
        devices=devices,
        budget_bytes=budget,
        hardware=hw,
        batch=batch,
        seq=seq,
        pipes=pipes,
        mesh=mesh,
        progress=report,
        margin=(0.0 if checked else LEDGER_MARGIN) if margin is None else margin,
        target=target,
    )
    if terminal:
        print(file=sys.stderr)
    if checked:
        where = "here" if target is None else f"for {target.with_devices(devices)}, with no device present"

        def compiled(c):
            if progress:
                print(f"compiling the pick {c.describe()} {where}...", file=sys.stderr, flush=True)
            return _compiled_bytes(model, c, batch, seq, devices, target)

        result = confirm(result, compiled, log=lambda m: print(m, file=sys.stderr))
    return result, batch, seq


def _compiled_bytes(model, c, batch: int, seq: int, devices: int, target=None) -> float:
    """Per-device bytes of a candidate's compiled step (nothing allocated), on the devices here or for a
    target's (compile-only) devices."""
    from jaxmem._util import compiled_bytes
    from jaxmem.config import TrainConfig
    from jaxmem.train import Trainer, planned_config

    config = TrainConfig(
        model=model,
        batch_size=batch,
        seq_len=seq,
        steps=1,
        target=None if target is None else str(target),
        data="synthetic",  # compiled only: no data is read (a long sequence may outgrow the default corpus)
    )
    config = planned_config(config, c, devices)
    return compiled_bytes(Trainer(config).compile_abstract())


def run(args) -> int:
    from jaxmem.config import parse_mesh

    budget = parse_bytes(args.budget)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    result, batch, seq = make_plan(
        args.model,
        args.devices,
        budget,
        args.hardware,
        args.host_bandwidth,
        args.batch_size,
        args.seq_len,
        args.pipe,
        progress=True,  # on stderr: --json's object is stdout's alone
        mesh=mesh,
        margin=args.margin,
        target=args.target,
        **model_overrides(args),
    )
    record = result.to_json()
    mfu = _mfu(result, batch, seq, args, result.devices)
    command = train_command(
        result.best, args, batch, seq, result.planned_bytes if result.margin else None, result.hardware["name"]
    )
    record.update({"batch_size": batch, "seq_len": seq, "mfu": mfu, "train_command": command})
    if args.json:
        print_json(record)
    else:
        lines = result.explain()
        if mfu is not None:
            lines[0] += f", MFU {mfu:.1%}"
        for line in lines:
            print(line)
        if result.best is not None and result.best.note:
            print(f"  policy detail: {result.best.note}")
        for line in result.legend():
            print(line)
        checked = " (the pick's bytes also compiled, above)" if result.confirmed else ""
        compiler = "XLA:CPU" if result.target == "cpu" else f"{result.target}'s compiler"
        print(f"hardware: {result.hardware['name']} ({result.hardware['note']}); all figures predicted{checked}; "
              f"working sets compiled by {compiler}; {len(result.candidates):,} candidates scored")  # fmt: skip
        if command:
            print(f"to train it: {command}")
    return 0 if result.best is not None else 1


def train_command(
    best, args, batch: int, seq: int, planned: float | None = None, hardware: str | None = None
) -> str | None:
    """The ``jaxmem train`` command line that runs the pick (None when nothing fits; ``planned``:
    the budget less the margin, which a generated policy was made for)."""
    if best is None:
        return None
    import math
    import shlex

    from jaxmem.config import GENERATED_POLICIES

    sizes = {"data": best.data, "fsdp": best.fsdp, "pipe": best.pipe, "context": best.context, "tensor": best.tensor}
    mesh = ",".join(f"{axis}={n}" for axis, n in sizes.items() if n > 1 or axis == "pipe")
    words = ["jaxmem", "train", "--model", args.model]
    for field, value in model_overrides(args).items():
        words += ["--" + field.replace("_", "-"), value]
    words += ["--mesh", mesh, "--schedule", best.schedule]
    if best.virtual and best.schedule == "interleaved-1f1b":
        words += ["--virtual", str(best.virtual)]
    words += ["--microbatches", str(best.microbatches), "--batch-size", str(batch), "--seq-len", str(seq)]
    words += ["--policy", best.policy_name]
    if best.split_backward:
        words += ["--split-backward"]
    if best.hand_recomputed:
        words += ["--hand-recomputed"]
    if best.policy_name in GENERATED_POLICIES:
        # Generated for this layout under the budget on the profile: the same inputs make the same policy.
        budget = args.budget if planned is None else f"{math.floor(planned)}"
        words += ["--budget", budget]
        if getattr(args, "target", None) is None:
            words += ["--hardware", hardware or args.hardware]
    if getattr(args, "target", None) is not None:
        words += ["--target", args.target]
    command = shlex.join(words)
    from jaxmem.models import get_model

    own = get_model(args.model, **model_overrides(args)).batch_spec
    if own is not None and set(own(batch, seq)) != {"tokens", "targets"}:
        # A batch of its own: token data cannot feed it; the user names the function giving its samples.
        command += " --samples package.module:attr  # your function returning jaxmem.data.Samples"
    return command


def _mfu(result, batch: int, seq: int, args, devices: int) -> float | None:
    """Model FLOPs utilisation of the pick: the model's FLOPs per token (no recompute) x its predicted
    tokens/s over the devices' peak."""
    if result.best is None:
        return None
    from jaxmem.memory import get_hardware, model_facts
    from jaxmem.models import get_model

    whole = model_facts(get_model(args.model, **model_overrides(args))).whole(batch, seq)
    per_token = (whole.forward_flops + whole.backward_flops - whole.recompute_flops) / (batch * seq)
    return per_token * result.best.tokens_per_second / (devices * get_hardware(result.hardware["name"]).peak_flops)
