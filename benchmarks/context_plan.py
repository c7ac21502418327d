"""Long sequences on 16 H100s: the planner's best plan for Llama 3.1 8B (bf16, fused attention) at
32768 and 131072 tokens, with and without a context axis, each pick compiled for the H100s.

    python benchmarks/context_plan.py [--json] [--out benchmarks/results/context_plan.json]
        [--seqs 32768,131072] [--batch 16] [--budget 80GiB] [--update]

``--update`` replaces, in the record at ``--out``, only the rows of the sequence lengths run now and
adds this run's command to the record's ``commands`` (one search per length takes 15-45 minutes here).

For each sequence length the search (``jaxmem.search.search``, as ``jaxmem plan --target h100:16``
runs it) scores every layout of 16 devices -- pipeline ranks, data, FSDP, tensor and, where each
device keeps at least 2048 tokens of a sequence, a context axis of 2-16 -- every schedule,
microbatch count and memory policy, with working sets compiled by the H100's compiler for the
device's part of a sequence; the fastest candidates that fit are then compiled whole for the 16
H100s, as the planner's own check does, and the first whose compiled bytes fit is the pick. The plan
without a context axis is the best of the same search's candidates with C = 1, confirmed the same
way. Tokens/s and MFU are the time
model's (the H100 profile: 989 TFLOP/s dense bf16 at 50%, NVLink and the NIC at 80%), not measured:
no GPU is here. The compiled bytes are the H100 compiler's (``memory_analysis()``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Timed as a first run: no compiled figures read back from an earlier one (jaxmem.memory._figures).
os.environ.setdefault("JAXMEM_CACHE_DIR", "off")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

MODEL = "llama-3.1-8b"
OVERRIDES = {"dtype": "bfloat16", "attention": "fused"}


def plans(seq: int, batch: int, budget: float, devices: int) -> list[dict]:
    """One search with the context axis searched; the plan without it is the best of the same
    candidates with C = 1 (the search scores those alike either way). Each confirmed by compiling."""
    import dataclasses

    from jaxmem.cli.plan import _compiled_bytes, _mfu
    from jaxmem.models import get_model
    from jaxmem.search import SearchError, confirm, search

    model = get_model(MODEL, **OVERRIDES)
    target = f"h100:{devices}"
    start = time.perf_counter()
    searched = search(model, devices=devices, budget_bytes=budget, hardware="h100", batch=batch, seq=seq, target=target)
    search_seconds = time.perf_counter() - start
    without = [c for c in searched.candidates if c.context == 1]
    fitting = [c for c in without if c.fits]
    best = max(fitting, key=lambda c: (c.tokens_per_second, -c.device_bytes)) if fitting else None
    variants = {"searched": searched, "off": dataclasses.replace(searched, candidates=tuple(without), best=best)}
    args = types.SimpleNamespace(model=MODEL, **OVERRIDES, param_dtype=None)
    rows = []
    for name, result in variants.items():
        start = time.perf_counter()
        log = []
        try:
            result = confirm(result, lambda c: _compiled_bytes(model, c, batch, seq, devices, target), log=log.append)
        except SearchError as e:
            log.append(str(e))
            result = dataclasses.replace(result, best=None)
        out = {"seq_len": seq, "batch": batch, "context": name, "candidates": len(result.candidates)}
        out["seconds"] = {"search": search_seconds, "confirm": time.perf_counter() - start}
        out["confirm_log"] = log
        out["best"] = None if result.best is None else result.best.to_json()
        if result.best is not None:
            out["compiled_bytes"] = (result.confirmed or {}).get("compiled_bytes")
            out["mfu"] = _mfu(result, batch, seq, args, devices)
            out["explain"] = result.explain()
        else:
            out["smallest_bytes"] = result.smallest_budget
        rows.append(out)
    return rows


def main() -> None:
    from jaxmem._util import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="32768,131072")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", default="80GiB")
    parser.add_argument("--devices", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--update", action="store_true", help="replace only these lengths' rows in the --out record")
    args = parser.parse_args()
    import jax

    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        print(f"planning seq {seq} ...", file=sys.stderr, flush=True)
        for r in plans(seq, args.batch, parse_bytes(args.budget), args.devices):
            rows.append(r)
            if r["best"]:
                b = r["best"]
                print(
                    f"  context {r['context']}: {b['schedule']} P={b['pipe']} D={b['data']} F={b['fsdp']} "
                    f"C={b['context']} T={b['tensor']} M={b['microbatches']} {b['policy']}: "
                    f"{b['tokens_per_second']:,.0f} tok/s, MFU {r['mfu']:.1%}, predicted "
                    f"{b['device_bytes'] / 2**30:.1f} GiB, compiled {(r['compiled_bytes'] or 0) / 2**30:.1f} GiB",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(f"  context {r['context']}: nothing fits", file=sys.stderr, flush=True)
    record = {
        "benchmark": "context_plan",
        "jax": jax.__version__,
        "command": "python benchmarks/context_plan.py " + " ".join(sys.argv[1:]),
        "model": MODEL,
        **OVERRIDES,
        "budget": args.budget,
        "devices": args.devices,
        "rows": rows,
    }
    from plan_ranking import record_to_update, write_record

    if args.update:
        old = record_to_update(parser, args.out)
        seqs = {r["seq_len"] for r in rows}
        record["rows"] = sorted(
            [r for r in old["rows"] if r["seq_len"] not in seqs] + rows,
            key=lambda r: (r["seq_len"], r["context"] != "searched"),
        )

        def lengths(command: str) -> set:  # the lengths a command ran (its --seqs, or the default)
            words = command.split()
            given = words[words.index("--seqs") + 1] if "--seqs" in words else "32768,131072"
            return {int(n) for n in given.split(",")}

        kept = [c for c in old.get("commands", [old["command"]]) if lengths(c) - seqs]
        record["commands"] = kept + [record["command"]]
        record["note"] = "recorded as several runs (the commands), each replacing its sequence lengths' rows"
    write_record(record, args.out, args.json)


if __name__ == "__main__":
    main()
