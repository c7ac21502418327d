"""``jaxmem train``'s flags: one per :class:`~jaxmem.config.TrainConfig` field, parsed into one.

The library names its settings by field (``warmup_steps``); here they become flags
(``--warmup-steps``, :func:`jaxmem.cli._flags.flag`).
"""

from __future__ import annotations

from jaxmem._errors import JaxmemError
from jaxmem.cli._common import add_target_argument, mesh_settings
from jaxmem.cli._flags import flag
from jaxmem.config import TrainConfig, config_from, load_settings

__all__ = ["add_arguments", "from_args", "parse_train_args"]


def add_arguments(p) -> None:
    """Add a flag for every :class:`~jaxmem.config.TrainConfig` field to an ``argparse`` parser
    (``jaxmem train``'s options; the flag of a field is :func:`flag`'s)."""
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--model",
        help="model preset: tiny (default), gpt2-small, gpt2-medium, gpt2-xl, llama-tiny, llama-1b, llama-8b, "
        "llama-70b; or your own as package.module:attr, a StagedModel or a function returning one "
        "(e.g. from jaxmem.models.from_nnx), imported from the current directory or PYTHONPATH",
    )
    g.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from a local Hugging Face GPT-2 or Llama directory (config.json, model.safetensors, "
        "tokenizer.json; as jaxmem export --format hf or save_pretrained write them): the model and, unless "
        "--tokenizer is given, the tokenizer come from it",
    )
    g.add_argument("--dtype", help="compute dtype, e.g. bfloat16 (mixed precision; default: the model's, float32)")
    g.add_argument("--param-dtype", help="parameter / gradient / optimizer-state dtype (default float32)")
    g.add_argument(
        "--attention",
        choices=["materialized", "fused"],
        help="a built-in model's attention: materialized (default) or fused (jax.nn.dot_product_attention: no s x s "
        "probabilities kept for the backward)",
    )
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    g.add_argument("--batch-size", type=int, help="global batch in sequences (default 32)")
    g.add_argument(
        "--data",
        metavar="SOURCE",
        help="text (the embedded corpus, default), synthetic (random tokens), your files: paths, globs or "
        "directories of .txt/.md/.rst, JSON-lines (.jsonl; .json files are read as JSON lines too) and .parquet "
        "files, comma-separated, or a Hugging Face dataset: "
        "hf:NAME[:CONFIG]:SPLIT, read offline from the hub cache or a local dataset directory (jaxmem[hf])",
    )
    g.add_argument(
        "--data-field", help="the JSONL field / Parquet / Hugging Face dataset column with the text (default: text)"
    )
    g.add_argument(
        "--samples",
        metavar="MODULE:ATTR",
        help="for a model with a batch of its own (images and labels, ...): its training samples instead of "
        "--data, as package.module:attr naming a jaxmem.data.Samples or a function returning one",
    )
    g.add_argument(
        "--tokenizer",
        help="byte (default), bpe:N (train a byte-level BPE of N ids on --data; saved with the checkpoints), "
        "or a tokenizer.json file",
    )
    g.add_argument("--vocab-size", type=int, help="a preset model's vocabulary (default: the tokenizer's)")
    g.add_argument("--eval-fraction", type=float, help="hold out this fraction of the data for eval (default 0)")
    g.add_argument("--eval-every", type=int, help="eval loss every N steps and at the end (default 0: never)")
    g.add_argument("--eval-batches", type=int, help="batches per eval (default 4)")
    g = p.add_argument_group("pipeline")
    g.add_argument("--schedule", help="schedule name (default 1f1b; see `jaxmem schedule list`)")
    g.add_argument("--csv", dest="schedule_csv", metavar="FILE", help="run a schedule table from a CSV")
    g.add_argument(
        "--pipe",
        "--stages",
        dest="pipe",
        metavar="P",
        type=int,
        help="pipe ranks P (default 4; --stages is its older name)",
    )
    g.add_argument("--microbatches", type=int, help="microbatches per step M (default 8)")
    g.add_argument("--virtual", type=int, help="stages per rank for interleaved-1f1b")
    g.add_argument("--layers-per-stage", help="explicit layer split, e.g. 3,3,2 (default balanced)")
    g.add_argument("--data-parallel", type=int, help="data-parallel replicas D holding whole parameters (default 1)")
    g.add_argument(
        "--fsdp",
        type=int,
        help="data-parallel replicas F that shard every parameter and gather it per use (FSDP; default 1)",
    )
    g.add_argument(
        "--context",
        type=int,
        help="devices holding part of every sequence (context parallelism for long sequences: two of its "
        "2 x context chunks each, attention gathering the others' keys and values; the sequence length must be "
        "a multiple of 2 x context; not with --adaptive; default 1)",
    )
    g.add_argument(
        "--tensor",
        type=int,
        help="devices T that compute each microbatch together, cutting the dimensions the model's "
        "annotations name (tensor parallelism; default 1)",
    )
    g.add_argument(
        "--mesh",
        metavar="AXES",
        help="the mesh in one flag, e.g. data=2,fsdp=2,pipe=2,context=2,tensor=2 (sets --data-parallel, --fsdp, "
        "--pipe, --context and --tensor)",
    )
    g.add_argument(
        "--no-zero",
        dest="zero",
        action="store_false",
        default=None,
        help="keep the optimizer state whole on every replica (by default it and the step's gradients are "
        "sharded over the data-parallel replicas: ZeRO-1/2)",
    )
    g.add_argument(
        "--no-vocab-split",
        dest="vocab_split",
        action="store_false",
        default=None,
        help="keep the token embedding and the head whole on every pipe rank (by default their vocabulary "
        "rows are split over the ranks)",
    )
    g.add_argument(
        "--split-backward",
        action="store_true",
        default=None,
        help="on schedules that split the backward (zb-h1, zbv, chronos): W takes I's cotangents instead of "
        "running the stage's backward again -- faster, at the memory of those cotangents from I to W",
    )
    g.add_argument(
        "--hand-recomputed",
        action="store_true",
        default=None,
        help="with --split-backward: I also hands W the forward values it recomputed, so W recomputes no "
        "forward -- faster under a recompute policy, at the memory of those activations from I to W",
    )
    g.add_argument("--devices", type=int, help="virtual CPU devices when there is no accelerator (default D x F x P)")
    g.add_argument(
        "--policy",
        help="memory policy: a preset name or a TOML file (see `jaxmem memory`); a preset ending in "
        "+keep-gathered (e.g. selective+keep-gathered) keeps FSDP's gathered weights from F to B; or "
        "chronos-recomp, chronos-offload, chronos-both: generated for this schedule and mesh under --budget, "
        "as jaxmem plan generates them",
    )
    g.add_argument("--plan", choices=["auto"], help="let the planner pick the mesh, schedule, microbatches, policy")
    g.add_argument(
        "--budget", help="device memory per device for --plan auto, --adaptive or a chronos-* policy, e.g. 24GiB"
    )
    g.add_argument(
        "--margin",
        type=float,
        help="--plan auto: plan under the budget / (1 + MARGIN), e.g. 0.1 (default: 0 when every device of the "
        "plan is here, as each pick is compiled and checked; else the ledger's measured error, 0.05)",
    )
    g.add_argument(
        "--hardware",
        help="profile of --plan auto, --adaptive, a chronos-* --policy and the MFU in --run-dir metrics: h100, "
        "tpu-v5e, tpu-v5p, tpu-v6e, tpu-v4 or cpu (default: --target's, else this platform's; measured here on CPU)",
    )
    add_target_argument(
        g,
        "the run is compiled for; where its devices are not attached, the step is compiled "
        "for them and its memory shown, and nothing is trained",
    )
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", help="save here and resume from the latest complete checkpoint")
    g.add_argument("--checkpoint-every", type=int, help="save every N steps (default 10)")
    g.add_argument("--keep-checkpoints", type=int, help="keep the last K checkpoints (default 3)")
    g.add_argument(
        "--restore-step",
        type=int,
        help="resume from this checkpoint step (default: the newest that passes its checksums)",
    )
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
    g.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    g.add_argument("--lr-schedule", choices=["constant", "cosine"], help="after warmup (default constant)")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 0)")
    g.add_argument("--min-lr-ratio", type=float, help="cosine's final lr as a fraction of --lr (default 0.1)")
    g.add_argument("--weight-decay", type=float, help="AdamW decoupled weight decay on matrices (default 0: Adam)")
    g.add_argument("--grad-clip", type=float, help="clip the global gradient norm to this (default: no clipping)")
    g.add_argument("--run-dir", help="write metrics.jsonl, TensorBoard events and a loss plot here")
    g.add_argument("--log-every", type=int, help="a progress line / metrics record every N steps (default 10)")
    g.add_argument("--seed", type=int, help="initialisation and data-order seed (default 0)")
    g.add_argument("--config", help="TOML file with any of these settings; flags override it")


def from_args(args, *, defaults=None, overrides=None) -> TrainConfig:
    """A TrainConfig from parsed flags (:func:`add_arguments`) over the ``--config`` TOML file, with
    ``defaults`` below both and ``overrides`` above (:func:`jaxmem.config.config_from`): a launched
    worker's run folders and recovered layout."""
    values = load_settings(args.config) if getattr(args, "config", None) else {}
    for name in _FIELDS:
        flag_value = getattr(args, name, None)
        if flag_value is not None:
            values[name] = flag_value
    mesh = values.pop("mesh", None) or getattr(args, "mesh", None)
    if mesh:
        values.update(mesh_settings(mesh, args))
    if values.get("schedule_csv") and values.get("schedule") is not None:
        raise JaxmemError("--csv runs the schedule in its table; drop --schedule (or --csv)")
    if values.get("plan") == "auto":
        chosen = [n for n in _PLANNED if values.get(n) is not None]
        if chosen:
            flags = ", ".join(flag(n) for n in chosen)
            raise JaxmemError(f"--plan auto chooses {flags} itself; drop {flags} (or --plan auto)")
    if values.get("schedule_csv"):
        values["schedule"] = None
    return config_from(values, defaults=defaults, overrides=overrides)


_FIELDS = tuple(TrainConfig.__dataclass_fields__)

# What --plan auto chooses (jaxmem.train's plan step); setting one of them as well is refused.
_PLANNED = (
    "schedule",
    "schedule_csv",
    "pipe",
    "data_parallel",
    "fsdp",
    "context",
    "tensor",
    "microbatches",
    "virtual",
    "policy",
)


def parse_train_args(argv, *, defaults=None, overrides=None) -> TrainConfig:
    """A TrainConfig from ``jaxmem train``'s command-line arguments (e.g. a launched job's), with
    ``defaults`` below them and ``overrides`` above (:func:`from_args`)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, not jaxmem train's whole usage
            raise JaxmemError(f"the jaxmem train arguments: {message} (see jaxmem train --help)")

    parser = Parser(add_help=False)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    return from_args(parser.parse_args([str(a) for a in argv]), defaults=defaults, overrides=overrides)
