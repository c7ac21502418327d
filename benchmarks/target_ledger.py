"""The memory ledger against the accelerator's own compiler: predicted vs compiled on a TPU v5e and an H100.

    python benchmarks/target_ledger.py [--json] [--out benchmarks/results/target_ledger.json]
        [--targets tpu-v5e:4,h100:4] [--models tiny,llama-tiny,gpt2-small,mqa,wide,moe,parallel]
        [--policies save-all,selective,recompute-all,offload-stash,offload-weights,offload-optimizer-state]

Every figure is compiled on this CPU-only machine for the target's devices (``jax.experimental.
topologies``; ``pip install 'jaxmem[tpu,cuda]'``): the ledger's prediction reads the target's
compiler for its working sets and layouts (``predict(..., target=...)``), and the whole train step is
compiled for the target (``Trainer(TrainConfig(target=...)).measure_memory()``) -- nothing runs, no
device is present. The compiled bytes are each compiler's own figure (a TPU's peak less its host
buffers; a GPU's arguments + temporaries + outputs less aliases; ``jaxmem.memory.compiled_bytes``).

The configurations: the built-in tiny GPT and Llama and the four decoder families of
``tests/families.py`` (8 layers, d_model 32-64) at batch 16 x 64, and gpt2-small at batch 16 x 512,
all bf16 compute over float32 master weights, 1F1B P=4 M=8; and on request (``--models llama-8b/4``,
``llama-8b/2``) stages at llama-8b's real size, one layer a stage at seq 4096 (P=4 M=8, P=2 M=4); a
name ending ``+fused`` (``llama-8b/2+fused``) is that model with fused attention (cuDNN's kernel on the
H100, the Pallas flash kernel on a TPU: ``jaxmem.models.fused_attention``). An
H100 compiled for here has no host memory kinds: the policies that keep weights or optimizer state
on host between steps are refused there (the row says so), and a step beyond a TPU's HBM is refused
by its compiler (the row quotes it, through ``jaxmem.StepTooLarge``). The error is ``predicted /
compiled - 1`` of the device bytes; the host columns compare the ledger's host bytes with
``memory_analysis()``'s host fields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(__file__))

TARGETS = ("tpu-v5e:4", "h100:4")
MODELS = ("tiny", "llama-tiny", "gpt2-small", "mqa", "wide", "moe", "parallel")
POLICIES = ("save-all", "selective", "recompute-all", "offload-stash", "offload-weights", "offload-optimizer-state")
SHAPES = {"gpt2-small": (16, 512), "llama-8b/4": (8, 4096), "llama-8b/2": (4, 4096)}  # (batch, seq); else 16 x 64
BF16 = ("tiny", "llama-tiny", "gpt2-small")  # presets given bf16 compute here (the others are made with it)
PIPE = {"llama-8b/2": 2}  # pipeline ranks; else 4 (and 8 microbatches)
# llama-8b/L: llama-8b's own width, vocabulary and sequence (d_model 4096, 128k tokens, seq 4096), L of its
# 32 layers: one a stage, a sequence a microbatch. On four ranks its save-all stash arena (3.3 billion
# elements on the first) is beyond the executor's int32 indexing; on two (two microbatches in flight,
# four a step) it is 1.6 billion.


def build_model(name: str):
    """A family of ``tests/families.py`` as a model, a built-in preset's name (its dtype set by the
    config), or ``PRESET/LAYERS``: that preset with so many layers (``+fused``: fused attention)."""
    from families import FAMILIES as OUTSIDE
    from families import family

    from jaxmem.models import get_model

    name, fused = name.removesuffix("+fused"), name.endswith("+fused")
    if "/" in name:
        preset, layers = name.split("/")
        return get_model(preset, n_layers=int(layers), dtype="bfloat16", **({"attention": "fused"} if fused else {}))
    if fused:  # (bf16 compute, as the config gives the presets below)
        return get_model(name, attention="fused", **({"dtype": "bfloat16"} if name in BF16 else {}))
    return family(name) if name in OUTSIDE else name


def row(target: str, name: str, policy: str) -> dict:
    from jaxmem import JaxmemError
    from jaxmem.config import TrainConfig
    from jaxmem.memory import compare, predict
    from jaxmem.train import Trainer

    base = name.removesuffix("+fused")
    batch, seq = SHAPES.get(base, (16, 64))
    out = {"target": target, "model": name, "policy": policy, "batch_size": batch, "seq_len": seq}
    start = time.perf_counter()
    try:
        config = TrainConfig(
            model=build_model(name),
            dtype="bfloat16" if name in BF16 else None,
            pipe=PIPE.get(base, 4),
            microbatches=2 * PIPE.get(base, 4),
            batch_size=batch,
            seq_len=seq,
            policy=policy,
            data="synthetic",
            target=target,
            steps=1,
        )
        trainer = Trainer(config)
        compiled = trainer.measure_memory()
    except JaxmemError as e:  # a policy the target cannot hold, a step the executor cannot index, or
        # one beyond the chip's memory (jaxmem.StepTooLarge, quoting the target's compiler)
        out["refused"] = str(e)[:400]
        print(f"  {target:10s} {name:11s} {policy:24s} refused: {str(e)[:120]}", file=sys.stderr, flush=True)
        return out
    predicted = predict(trainer.model, trainer.schedule, config.policy, batch=batch, seq=seq, target=target)
    report = compare(predicted, compiled)
    first = report["ranks"][0]
    analysis = report["meta"]["memory_analysis"]
    out.update(
        predicted_bytes=first["predicted_device_bytes"],
        compiled_bytes=first["compiled_device_bytes"],
        error=first["prediction_error"],
        predicted_host_bytes=first["predicted_host_bytes"],
        compiled_host_bytes=analysis["host_bytes"],
        transient_terms=predicted.meta.get("transient_terms", {}),
        categories={
            k: {"predicted": v["predicted_device"], "program": v["program_device"]}
            for k, v in first["categories"].items()
        },  # fmt: skip
        seconds=time.perf_counter() - start,
    )
    print(
        f"  {target:10s} {name:11s} {policy:24s} predicted {out['predicted_bytes'] / 2**20:8.2f} MiB, compiled "
        f"{out['compiled_bytes'] / 2**20:8.2f} MiB, {out['error']:+6.1%}; host "
        f"{out['predicted_host_bytes'] / 2**20:.2f}/{out['compiled_host_bytes'] / 2**20:.2f} MiB "
        f"({out['seconds']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def _row_key(r: dict) -> tuple:
    return r["target"], r["model"], r["policy"]


def summary(rows) -> dict:
    measured = [r for r in rows if "error" in r]
    per_target = {}
    for r in measured:
        s = per_target.setdefault(r["target"], {"rows": 0, "within_band": 0, "worst_over": 0.0, "worst_under": 0.0})
        s["rows"] += 1
        s["within_band"] += int(-0.05 <= r["error"] <= 0.10)
        s["worst_over"] = max(s["worst_over"], r["error"])
        s["worst_under"] = min(s["worst_under"], r["error"])
    host = [r for r in measured if r["compiled_host_bytes"]]
    return {
        "per_target": per_target,
        "refused": [f"{r['target']} {r['model']} {r['policy']}" for r in rows if "refused" in r],
        "host_within_10pct": sum(abs(r["predicted_host_bytes"] / r["compiled_host_bytes"] - 1) <= 0.1 for r in host),
        "host_rows": len(host),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    parser.add_argument(
        "--update",
        metavar="RECORD",
        help="rerun only the rows asked for and put them in place of the same rows of RECORD, keeping the "
        "rest; the record lists every command that wrote a row of it (write it back with --out RECORD)",
    )
    args = parser.parse_args()
    rows = []
    for target in args.targets.split(","):
        for name in args.models.split(","):
            for policy in args.policies.split(","):
                rows.append(row(target, name, policy))
    import jax

    command = "python benchmarks/target_ledger.py " + " ".join(sys.argv[1:])
    commands = [command]
    if args.update:
        with open(args.update) as f:
            old = json.load(f)
        fresh = {_row_key(r): r for r in rows}
        if any(_row_key(r) not in fresh for r in old["rows"]):  # rows not rerun keep the commands that wrote them
            commands = old.get("commands", [old["command"]]) + commands
        rows = [fresh.pop(_row_key(r), r) for r in old["rows"]] + list(fresh.values())
    record = {
        "benchmark": "target_ledger",
        "jax": jax.__version__,
        "command": command,
        "commands": commands,
        "rows": rows,
        "summary": summary(rows),
    }
    from plan_ranking import write_record

    if not write_record(record, args.out, args.json):
        for target, s in record["summary"]["per_target"].items():
            print(
                f"{target}: {s['within_band']}/{s['rows']} within -5%..+10%, worst {s['worst_under']:+.1%} / "
                f"{s['worst_over']:+.1%}"
            )


if __name__ == "__main__":
    main()
