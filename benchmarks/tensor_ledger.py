"""The ledger on the sharded layouts (issue 27, item 7): predicted against compiled device bytes per
rank for GPT and Llama on P x D x F x T meshes of 8 virtual CPU devices, batch 16 x 64 tokens, M=8
(the tensor layouts table of docs/guides/tensor-axis.md). Each row is ``jaxmem memory --mesh ... --compile yes``.

    python benchmarks/tensor_ledger.py [--json]

Writes ``benchmarks/results/tensor_ledger.json``. The working set of a tensor layout is compiled on a
tensor mesh of this process's devices (``ModelFacts.tensor_working``), so run it with the 8 virtual
devices it sets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxmem.cli.memory import ledger_report  # noqa: E402
from jaxmem.config import TrainConfig, parse_mesh  # noqa: E402

ROWS = [
    # (model, mesh, policy, batch, schedule)
    ("llama-tiny", "pipe=2,tensor=2", "save-all", 16, "1f1b"),
    ("llama-tiny", "pipe=2,tensor=4", "save-all", 16, "1f1b"),
    ("llama-tiny", "pipe=2", "save-all", 16, "1f1b"),
    ("llama-tiny", "pipe=2,tensor=2", "selective", 16, "1f1b"),
    ("llama-tiny", "pipe=2,tensor=4", "recompute-all", 16, "1f1b"),
    ("llama-tiny", "data=2,pipe=2,tensor=2", "save-all", 16, "1f1b"),
    ("llama-tiny", "fsdp=2,pipe=2,tensor=2", "recompute-all", 16, "1f1b"),
    ("llama-tiny", "pipe=4,tensor=2", "save-all", 32, "zbv"),
    ("tiny", "pipe=2,tensor=2", "save-all", 16, "1f1b"),
    ("tiny", "pipe=2,tensor=4", "save-all", 16, "1f1b"),
    ("tiny", "pipe=2,tensor=2", "recompute-all", 16, "1f1b"),
    ("tiny", "pipe=2,tensor=4", "recompute-all", 16, "1f1b"),
    ("tiny", "pipe=2,tensor=4", "selective", 32, "1f1b"),
    ("tiny", "data=2,pipe=2,tensor=2", "save-all", 16, "1f1b"),
    ("tiny", "pipe=2", "recompute-all", 16, "1f1b"),
    ("tiny", "data=2,pipe=2", "save-all", 16, "1f1b"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args()
    rows = []
    for i, (model, mesh, policy, batch, schedule) in enumerate(ROWS):
        sizes = parse_mesh(mesh)
        config = TrainConfig(
            model=model,
            schedule=schedule,
            pipe=sizes.get("pipe", 1),
            data_parallel=sizes.get("data", 1),
            fsdp=sizes.get("fsdp", 1),
            tensor=sizes.get("tensor", 1),
            microbatches=8,
            batch_size=batch,
            seq_len=64,
            policy=policy,
            steps=1,
            data="synthetic",
        )
        ranks = ledger_report(config, "yes")["ranks"]
        worst = max(ranks, key=lambda r: abs(r["prediction_error"]))
        row = {
            "model": model,
            "mesh": mesh,
            "schedule": schedule,
            "policy": policy,
            "batch": batch,
            "compiled_mib": worst["compiled_device_bytes"] / 2**20,
            "predicted_mib": worst["predicted_device_bytes"] / 2**20,
            "error": worst["prediction_error"],
        }
        rows.append(row)
        print(
            f"[{i + 1}/{len(ROWS)}] {model:10s} {mesh:24s} {schedule:5s} {policy:14s} batch {batch:3d}: "
            f"compiled {row['compiled_mib']:.2f} MiB, error {row['error']:+.1%}",
            file=sys.stderr,
        )
    tensor_rows = [r for r in rows if "tensor" in r["mesh"]]
    record = {
        "benchmark": "tensor_ledger",
        "seq_len": 64,
        "microbatches": 8,
        "rows": rows,
        "worst_error": max((r["error"] for r in rows), key=abs),
        "tensor_layouts_within_10_percent": sum(abs(r["error"]) <= 0.10 for r in tensor_rows),
        "tensor_layouts": len(tensor_rows),
    }
    out = os.path.join(os.path.dirname(__file__), "results", "tensor_ledger.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        print(
            f"worst error {record['worst_error']:+.1%}; tensor layouts within 10%: "
            f"{record['tensor_layouts_within_10_percent']} of {record['tensor_layouts']}; wrote {out}"
        )


if __name__ == "__main__":
    main()
