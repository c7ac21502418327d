"""``jaxmem export`` and ``jaxmem sample``: leave a run with a usable model."""

from __future__ import annotations

import argparse

from jaxmem.cli._common import (
    check_output_dir,
    non_negative_float,
    non_negative_int,
    positive_int,
    print_json,
    seed_int,
    setup_devices,
)

_EXPORT_EPILOG = """\
--format jaxmem (default) writes OUT/model.safetensors (every parameter in the model's own layout and
dtype, named by its path, e.g. blocks.0.qkv.kernel), OUT/config.json (model family and config, step,
tokenizer) and, for a BPE run, OUT/tokenizer.json. Load it back in Python:

  from jaxmem.train import load_exported
  exported = load_exported("OUT")        # .model, .params, .tokenizer
  nnx.update(module, nnx.State(exported.params))   # into a Flax NNX module of the same model

--format hf (the built-in GPT and Llama) writes what Hugging Face transformers loads as
GPT2LMHeadModel / LlamaForCausalLM: its config.json, model.safetensors in its names and layouts,
tokenizer.json and tokenizer_config.json (a byte-level run gets a byte-level tokenizer whose ids are
the bytes):

  AutoModelForCausalLM.from_pretrained("OUT"); AutoTokenizer.from_pretrained("OUT")
  jaxmem train --init-from OUT ...       # fine-tune it again (or any such local directory)

examples:
  jaxmem export runs/ckpt -o exported
  jaxmem export runs/ckpt --step 200 -o exported-200
  jaxmem export runs/ckpt --format hf -o hf-model"""

_SAMPLE_EPILOG = """\
PATH is an export directory (jaxmem export) or a checkpoint directory (its latest step, or --step).
Generation runs one forward per new token over the model's window (no KV cache): fine for checking
what a small model learned, not a serving engine.

examples:
  jaxmem sample runs/ckpt --prompt "The for statement" --tokens 200
  jaxmem sample exported --prompt "def " --temperature 0.7 --top-k 40 --seed 3"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as safetensors + config.json (+ tokenizer)",
        description="Export the parameters of a `jaxmem train` checkpoint: in jaxmem's own layout (to load "
        "back with jaxmem or into your Flax module) or, with --format hf, in Hugging Face transformers' layout "
        "(to load with from_pretrained). Every file is written, or none.",
        epilog=_EXPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a --checkpoint-dir of jaxmem train")
    p.add_argument(
        "-o",
        "--out",
        required=True,
        help="output directory: new, empty, or an earlier export (with --force); never the checkpoint's own",
    )
    p.add_argument("--step", type=non_negative_int, help="which step (default: the latest)")
    p.add_argument(
        "--format",
        choices=["jaxmem", "hf"],
        default="jaxmem",
        help="jaxmem (default): the model's own parameter names and layout, for jaxmem.train.load_exported, "
        "jaxmem sample and nnx.update into your module; hf: Hugging Face transformers' GPT-2 / Llama names and "
        "layout, for from_pretrained and jaxmem train --init-from (the built-in GPT and Llama)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an earlier export in OUT")
    p.add_argument("--json", action="store_true", help="print config.json")
    p.set_defaults(run=run_export)

    s = sub.add_parser(
        "sample",
        help="sample text from a checkpoint or an export",
        description="Sample a continuation of a prompt from a trained model.",
        epilog=_SAMPLE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("path", help="an export directory or a checkpoint directory")
    s.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    s.add_argument(
        "--tokens", type=positive_int, default=100, help="new tokens to sample (default 100, at most 100000)"
    )
    s.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 = greedy (default 0.8)")
    s.add_argument("--top-k", type=positive_int, help="sample among the K most likely tokens")
    s.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    s.add_argument("--step", type=non_negative_int, help="checkpoint step (default: the latest)")
    s.set_defaults(run=run_sample)


def run_export(args) -> int:
    check_output_dir(args.out, "-o")
    setup_devices(1)
    from jaxmem.train import export_checkpoint

    config = export_checkpoint(args.checkpoint, args.out, step=args.step, force=args.force, format=args.format)
    if args.json:
        print_json(config)
    elif args.format == "hf":
        ours = config["jaxmem"]
        print(
            f"exported step {ours['checkpoint']['step']} of {ours['model']['name']} ({ours['param_count']:,} params) "
            f"as {config['architectures'][0]} to {args.out}/ (config.json, model.safetensors, tokenizer.json)"
        )
    else:
        model = config["model"]
        print(
            f"exported step {config['step']} of {model['name']} ({config['param_count']:,} params, "
            f"{config['tokenizer']} tokenizer) to {args.out}/model.safetensors and config.json"
        )
    return 0


# Sampling recomputes the context window per token: beyond this many it is hours on a CPU.
MAX_SAMPLE_TOKENS = 100_000


def run_sample(args) -> int:
    from jaxmem._errors import JaxmemError

    if args.tokens < 1:
        raise JaxmemError(f"--tokens must be >= 1, got {args.tokens}")
    if args.tokens > MAX_SAMPLE_TOKENS:
        raise JaxmemError(
            f"--tokens {args.tokens:,} is more than {MAX_SAMPLE_TOKENS:,}: each new token runs the model over "
            "its whole context window (no key/value cache), so that would take hours; ask for fewer"
        )
    setup_devices(1)
    from jaxmem.train import load_model

    loaded = load_model(args.path, step=args.step)
    text = loaded.sample(
        args.prompt, max_new_tokens=args.tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed
    )
    print(args.prompt + text)
    return 0
