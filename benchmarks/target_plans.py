"""The planner's scale plans made with the accelerator's own compiler, and with XLA:CPU's beside them.

Before a target could be compiled for, every plan for a GPU or a TPU read XLA:CPU's working sets.

    python benchmarks/target_plans.py [--plans llama-8b@h100:16,llama-70b@h100:64,llama-8b@tpu-v5p:2x2x2]
        [--before] [--json] [--out benchmarks/results/target_plans.json] [--update]

Each plan is ``jaxmem plan --model M --dtype bfloat16 --seq-len 4096 --budget B --target T``
(:func:`jaxmem.cli.plan.make_plan`, as the command runs it): every working set is compiled for the
target here with no device present, the fastest picks are then compiled whole for the target's
devices in turn, and the first whose compiled bytes (``memory_analysis()``) fit the budget is the pick.
With ``--before`` the same search is also run as a plan without ``--target`` runs it (the target's
hardware profile, working sets compiled by XLA:CPU, a 5% margin kept free because nothing can be
compiled), and that pick too is compiled for the target, to say whether it would have fit.

Tokens/s and MFU are the time model's on the target's profile, not measured: no GPU or TPU is here.
Compiled working-set figures are read from jaxmem's cache when an earlier run compiled the same
program (``~/.cache/jaxmem``; ``JAXMEM_CACHE_DIR=off`` to time a first run): a first llama-70b plan
for 64 H100s compiles a few hundred of them and takes hours here. ``--update`` replaces, in the record
at ``--out``, only the plans run now.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

OVERRIDES = {"dtype": "bfloat16"}
SEQ = 4096
# name -> (model, target, budget): the plans of the docs' scale tables.
PLANS = {
    "llama-8b@h100:16": ("llama-8b", "h100:16", "40GiB"),
    "llama-70b@h100:64": ("llama-70b", "h100:64", "80GiB"),
    "llama-8b@tpu-v5p:2x2x2": ("llama-8b", "tpu-v5p:2x2x2", "40GiB"),
}


def _row(result, model: str, seq: int, batch: int, seconds: float) -> dict:
    from jaxmem.cli.plan import _mfu

    args = types.SimpleNamespace(model=model, **OVERRIDES, param_dtype=None, attention=None)
    out = {"candidates": len(result.candidates), "seconds": seconds, "margin": result.margin}
    out["best"] = None if result.best is None else result.best.to_json()
    if result.best is not None:
        out["compiled_bytes"] = (result.confirmed or {}).get("compiled_bytes")
        out["passed_over"] = (result.confirmed or {}).get("rejected", [])
        out["mfu"] = _mfu(result, batch, seq, args, result.devices)
        out["explain"] = result.explain()
    else:
        out["smallest_bytes"] = result.smallest_budget
    return out


def plan(name: str, before: bool) -> dict:
    """One plan for its target, and with ``before`` the XLA:CPU plan beside it (its pick compiled for the
    target too)."""
    from jaxmem._util import parse_bytes
    from jaxmem.cli.plan import _compiled_bytes, make_plan
    from jaxmem.models import get_model
    from jaxmem.search import SearchError
    from jaxmem.targets import parse_target

    model_name, target_name, budget_text = PLANS[name]
    target = parse_target(target_name)
    budget = parse_bytes(budget_text)
    row = {"plan": name, "model": model_name, "target": target_name, "budget": budget_text, "seq_len": SEQ}
    start = time.perf_counter()
    try:
        result, batch, seq = make_plan(model_name, None, budget, None, seq=SEQ, target=target_name, **OVERRIDES)
    except SearchError as e:
        row["on_target"] = {"best": None, "error": str(e), "seconds": time.perf_counter() - start}
        batch, devices = None, len(target.devices())
        _say("on the target's compiler", None, row["on_target"])
    else:
        devices = result.devices
        row["on_target"] = _row(result, model_name, seq, batch, time.perf_counter() - start)
        _say("on the target's compiler", result.best, row["on_target"])
    row["batch"] = batch
    if before:
        start = time.perf_counter()
        result, batch, seq = make_plan(
            model_name, devices, budget, target.name, seq=SEQ, batch=batch, target=None, **OVERRIDES
        )
        seconds = time.perf_counter() - start
        out = _row(result, model_name, seq, batch, seconds)
        if result.best is not None:  # would it have fit? compiled for the target's devices
            model = get_model(model_name, **OVERRIDES)
            print(f"compiling the XLA:CPU plan's pick for {target_name}...", file=sys.stderr, flush=True)
            try:
                out["compiled_on_target_bytes"] = int(_compiled_bytes(model, result.best, batch, seq, devices, target))
            except Exception as e:  # noqa: BLE001 -- a refusal by the target's compiler is the answer
                out["compiled_on_target_bytes"] = None
                out["compile_error"] = str(e).splitlines()[0][:300]
        row["xla_cpu_working_sets"] = out
        _say("with XLA:CPU's working sets", result.best, out)
    return row


def _say(label: str, best, r: dict) -> None:
    """One line on stderr: the pick (``best``, a Candidate or None) and its figures (``r``, its row)."""
    if best is None:
        line = f"nothing fits ({r.get('error') or r.get('smallest_bytes')})"
    else:
        compiled = r.get("compiled_bytes") or r.get("compiled_on_target_bytes")
        line = (
            f"{best.describe()}: {best.tokens_per_second:,.0f} tok/s, MFU {r['mfu']:.1%}, predicted "
            f"{best.device_bytes / 2**30:.2f} GiB"
            + (f", compiled for the target {compiled / 2**30:.2f} GiB" if compiled else "")
            + f" ({r['seconds'] / 60:.1f} min)"
        )
    print(f"  {label}: {line}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of: {', '.join(PLANS)}")
    parser.add_argument("--before", action="store_true", help="also the plan with XLA:CPU's working sets")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--update", action="store_true", help="replace only these plans' rows in the --out record")
    args = parser.parse_args()
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        parser.error(f"unknown plan(s) {unknown}: choose from {', '.join(PLANS)}")
    import jax

    rows = []
    for name in names:
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        rows.append(plan(name, args.before))
    record = {
        "benchmark": "target_plans",
        "jax": jax.__version__,
        "command": "python benchmarks/target_plans.py " + " ".join(sys.argv[1:]),
        "dtype": OVERRIDES["dtype"],
        "rows": rows,
    }
    from plan_ranking import record_to_update, write_record

    if args.update:
        old = record_to_update(parser, args.out)
        done = {r["plan"] for r in rows}
        record["rows"] = [r for r in old["rows"] if r["plan"] not in done] + rows
        record["rows"].sort(key=lambda r: list(PLANS).index(r["plan"]))
        record["commands"] = old.get("commands", [old["command"]]) + [record["command"]]
        record["note"] = "recorded as several runs (the commands), each replacing its plans' rows"
    write_record(record, args.out, args.json)


if __name__ == "__main__":
    main()
