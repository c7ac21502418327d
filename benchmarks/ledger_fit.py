"""The memory ledger against the compiled step, per model family -- families it was never fitted on.

    python benchmarks/ledger_fit.py [--json] [--out benchmarks/results/ledger_fit.json]
        [--families mqa,wide,moe,parallel,tiny,llama-tiny] [--schedules gpipe,1f1b,...] [--layouts pipe,...]

Nothing in the ledger is fitted any more: parameter, gradient and optimizer bytes come from the
placement of every leaf, the stash from the traced residual plans, and the backward's working set
from the temporaries of one stage's pullback compiled alone (``jaxmem.memory.StageFacts``). This
script compiles the whole train step of every configuration, reads its device bytes from
``memory_analysis()``, and reports the ledger's error per family: four decoder families written
outside the library (``tests/families.py``: multi-query attention with GeGLU and soft-capped tied
logits; a wide MLP-only block; a top-2-of-4 mixture of experts; GPT-J-style parallel blocks) and the
built-in GPT and Llama, over gpipe, 1f1b, interleaved-1f1b, zbv and chronos x save-all, selective and
recompute-all (8 layers, d_model 32 or 64, batch 32 x 64, P=4, M=8), and the built-ins on sharded
layouts (P x D, P x F, P x T). Offload policies are left out: on CPU their host bytes are counted as
device (the ledger says so). About 20 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import numpy as np  # noqa: E402

POLICIES = ("save-all", "selective", "recompute-all")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "chronos")
FAMILIES = ("mqa", "wide", "moe", "parallel", "tiny", "llama-tiny")
# (label, mesh axes) of the sharded layouts, 1f1b on the built-ins.
LAYOUTS = {
    "P2 D2": {"pipe": 2, "data_parallel": 2},
    "P2 F2": {"pipe": 2, "fsdp": 2},
    "P2 T2": {"pipe": 2, "tensor": 2},
    "P2 D2 T2": {"pipe": 2, "data_parallel": 2, "tensor": 2},
}


def build_model(name: str):
    from families import FAMILIES as OUTSIDE
    from families import family

    from jaxmem.models import get_model

    return family(name) if name in OUTSIDE else get_model(name, n_layers=8)


def row(model_name, model, schedule, policy, layout="P4", **axes) -> dict:
    from families import ledger_against_compiled

    start = time.perf_counter()
    predicted, compiled, error = ledger_against_compiled(model, schedule, policy, **axes)
    out = {
        "family": model_name,
        "layout": layout,
        "schedule": schedule,
        "policy": policy,
        "predicted_bytes": predicted,
        "compiled_bytes": compiled,
        "error": error,
    }
    print(
        f"  {model_name:10s} {layout:9s} {schedule:17s} {policy:13s} predicted {predicted / 2**20:6.2f} MiB, "
        f"compiled {compiled / 2**20:6.2f} MiB, {error:+.1%} ({time.perf_counter() - start:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def summary(rows) -> dict:
    per = {}
    for r in rows:
        per.setdefault(r["family"], []).append(r["error"])
    return {
        f: {"worst_over": max(e), "worst_under": min(e), "mean_abs": float(np.mean(np.abs(e))), "configs": len(e)}
        for f, e in per.items()
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the record here")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="sharded layouts of the built-ins ('' for none)")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    rows = []
    for name in families:
        model = build_model(name)
        for schedule in args.schedules.split(","):
            for policy in POLICIES:
                rows.append(row(name, model, schedule, policy))
    for label in [x for x in args.layouts.split(",") if x]:
        for name in [f for f in families if f in ("tiny", "llama-tiny")]:
            for policy in POLICIES:
                rows.append(row(name, build_model(name), "1f1b", policy, label, **LAYOUTS[label]))
    record = {
        "benchmark": "ledger_fit",
        "batch_size": 32,
        "seq_len": 64,
        "microbatches": 8,
        "rows": rows,
        "per_family": summary(rows),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        for name, s in record["per_family"].items():
            print(
                f"{name:10s} {s['configs']:3d} configurations: worst over {s['worst_over']:+.1%}, "
                f"worst under {s['worst_under']:+.1%}, mean |error| {s['mean_abs']:.1%}"
            )
    return record


if __name__ == "__main__":
    main()
