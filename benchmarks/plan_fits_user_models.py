"""Does the default-profile planner's pick fit when compiled? On models written as users write them.

    python benchmarks/plan_fits_user_models.py [--json] [--out benchmarks/results/plan_fits_user_models.json]
        [--families dropout-gpt,mingru,encoder,widening,mqa,dense-moe] [--fractions 1,0.7,0.5,0.35]

``jaxmem plan`` without ``--hardware`` plans for the default profile (h100): nothing can be compiled
for it here without ``--target``, so the plan keeps the ledger's margin (``LEDGER_MARGIN``, 5%) of the
budget free and takes the fastest candidate whose predicted bytes fit the rest. This benchmark takes
each family at 8 layers, batch 32 x 64, on 4 devices; finds its unconstrained pick's predicted bytes
``B`` (a budget of 1 GiB); plans again at budgets of ``fraction x B`` (tighter budgets force
recomputation, Chronos-Recomp and layouts that hold less); and compiles each pick's whole step on
this machine's XLA:CPU (``memory_analysis()``, the figure ``jaxmem memory --compile yes`` gives) to
see whether it fits the budget it was planned for. A budget nothing fits is recorded as such (the
planner says so, exit code 1). About 10 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from ledger_recompute_layers import build, write_record  # noqa: E402  (the same families, built the same way)

FAMILIES = ("dropout-gpt", "mingru", "encoder", "widening", "mqa", "dense-moe")
DEVICES, BATCH, SEQ = 4, 32, 64


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--fractions", default="1,0.7,0.5,0.35", help="budgets as fractions of the loose pick's bytes")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.add_argument("--out", help="write the record to this file")
    args = parser.parse_args(argv)
    from jaxmem.cli.plan import _compiled_bytes
    from jaxmem.search import LEDGER_MARGIN, POLICIES, SearchError, search

    ON_DEVICE = tuple(p for p in POLICIES if "offload" not in p and "both" not in p)

    import jaxmem

    fractions = [float(f) for f in args.fractions.split(",")]
    rows, start = [], time.time()

    def plan(model, budget, policies):
        try:
            return search(model, devices=DEVICES, budget_bytes=budget, hardware="h100", batch=BATCH, seq=SEQ,
                          policies=policies, margin=LEDGER_MARGIN).best  # fmt: skip
        except SearchError:
            return None

    def described(model, c, budget):
        compiled = _compiled_bytes(model, c, BATCH, SEQ, DEVICES)
        return {
            "pick": f"{c.schedule} P={c.pipe} V={c.virtual or 1} D={c.data} F={c.fsdp} M={c.microbatches} "
            + c.policy_name
            + (" split" if c.split_backward else ""),
            "predicted_mib": round(c.device_bytes / 2**20, 3),
            "host_mib": round(c.host_bytes / 2**20, 3),
            "compiled_mib": round(compiled / 2**20, 3),
            "error": round(c.device_bytes / compiled - 1, 4),
            # Offload saves no memory on XLA:CPU (its "host" is the device) and the H100 target lists
            # no host memory: such a pick's fit is predicted, not compiled.
            "fits": compiled <= budget if not c.host_bytes else None,
        }

    for name in args.families.split(","):
        model = build(name)
        reference = plan(model, 2.0**30, POLICIES).device_bytes
        for fraction in fractions:
            budget = int(fraction * reference)
            row = {"family": name, "fraction": fraction, "budget_mib": round(budget / 2**20, 3), "pick": None}
            c = plan(model, budget, POLICIES)
            if c is not None:
                row.update(described(model, c, budget))
            if c is not None and c.host_bytes:
                # The planner's pick offloads: its fit is predicted. The pick without offload beside it.
                c = plan(model, budget, ON_DEVICE)
                row["without_offload"] = None if c is None else described(model, c, budget)
            rows.append(row)
            shown = row["pick"] or "nothing fits"
            more = row.get("without_offload")
            if "without_offload" in row:
                more = "; without offload: " + ("nothing fits" if more is None else f"fits={more['fits']}")
            else:
                more = ""
            print(f"{name:12s} {budget / 2**20:7.3f} MiB  {shown:55s} fits={row.get('fits')}{more}  "
                  f"({time.time() - start:.0f} s)", file=sys.stderr)  # fmt: skip
    # Every pick whose fit the compiler can show: the planner's own, or beside an offloading one the
    # pick without offload.
    compiled = [r for r in rows if r.get("fits") is not None]
    compiled += [r["without_offload"] for r in rows if r.get("without_offload")]
    record = {
        "benchmark": "plan_fits_user_models",
        "command": "python benchmarks/plan_fits_user_models.py --out benchmarks/results/plan_fits_user_models.json",
        "jaxmem": jaxmem.__version__,
        "setup": f"8 layers, batch {BATCH} x {SEQ}, {DEVICES} devices, default profile (h100), margin "
        f"{LEDGER_MARGIN:.0%}; picks compiled by XLA:CPU, 8 virtual devices",
        "rows": rows,
        "picks_compiled": len(compiled),
        "picks_that_fit": sum(r["fits"] for r in compiled),
        "offload_picks_predicted": sum(r.get("fits") is None and r["pick"] is not None for r in rows),
        "misses": [f"{r['family']} {r['budget_mib']} MiB" for r in rows if r.get("fits") is False]
        + [
            f"{r['family']} {r['budget_mib']} MiB without offload"
            for r in rows
            if (r.get("without_offload") or {}).get("fits") is False
        ],
        "worst_error": min((r["error"] for r in compiled), default=None),
        "seconds": round(time.time() - start, 1),
    }
    write_record(record, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
