"""Fit the memory ledger's two modelled constants and check them on configurations the fit did not see.

    python benchmarks/ledger_fit.py [--json] [--out benchmarks/results/ledger_fit.json]

Every category of the predicted ledger is derived (parameter, gradient and optimizer bytes; stash
arenas from traced residual plans; message buffers and the batch) except one part of ``transient``:
the backward's working set, modelled as

    BACKWARD_WORKSET x (a stage microbatch's full activation volume)
      + RECOMPUTE_WORKSET x (the part of that volume the policy recomputes)

(``jaxmem.memory._ledger``). This script compiles the train step of the FIT configurations (the
tiny GPT, 4 stages on 4 devices, three schedules x three recompute policies), reads its device bytes
from ``memory_analysis()``, and fits the two constants by non-negative least squares of the bytes the
derived categories leave unexplained. It then reports the prediction error, with the fitted and with
the shipped constants, on HOLDOUT configurations that share neither the model shape nor the mesh with
the fit: llama-tiny (another architecture), a GPT of twice the width, and a 2 x 2 (pipe x data) mesh.
Offload policies are left out: on CPU their host bytes are counted as device (the ledger says so).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import _ledger, predict  # noqa: E402
from jaxmem.models import get_config  # noqa: E402

POLICIES = ("save-all", "selective", "recompute-all")
# (label, model, schedule, virtual, pipe, data)
FIT = [("tiny", "tiny", s, v, 4, 1) for s, v in (("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2))]
HOLDOUT = [
    ("llama-tiny", "llama-tiny", "1f1b", None, 4, 1),
    ("tiny d128", dataclasses.replace(get_config("tiny"), d_model=128, n_heads=4), "1f1b", None, 4, 1),
    ("tiny P2 D2", "tiny", "1f1b", None, 2, 2),
]


def config_of(model, schedule, virtual, pipe, data, policy) -> TrainConfig:
    return TrainConfig(
        model=model,
        schedule=schedule,
        virtual=virtual,
        stages=pipe,
        data_parallel=data,
        microbatches=8,
        batch_size=32,
        seq_len=64,
        policy=policy,
        steps=1,
    )


@contextlib.contextmanager
def worksets(backward: float, recompute: float):
    saved = _ledger.BACKWARD_WORKSET, _ledger.RECOMPUTE_WORKSET
    _ledger.BACKWARD_WORKSET, _ledger.RECOMPUTE_WORKSET = backward, recompute
    try:
        yield
    finally:
        _ledger.BACKWARD_WORKSET, _ledger.RECOMPUTE_WORKSET = saved


def predicted_bytes(config: TrainConfig, backward: float, recompute: float) -> float:
    with worksets(backward, recompute):
        ledger = predict(
            config.build_model(),
            config.build_schedule(),
            config.policy,
            batch=config.batch_size,
            seq=config.seq_len,
            data_parallel=config.data_parallel,
        )
    return ledger.max_device_bytes


def measure(rows_spec) -> list[dict]:
    from jaxmem.train import Trainer

    rows = []
    for label, model, schedule, virtual, pipe, data in rows_spec:
        for policy in POLICIES:
            config = config_of(model, schedule, virtual, pipe, data, policy)
            start = time.perf_counter()
            trainer = Trainer(config)
            compiled = trainer.measure_memory()
            name = f"{label} {schedule}{f' V={virtual}' if virtual else ''} P={pipe} D={data} {policy}"
            rows.append(
                {
                    "config": name,
                    "compiled_device_bytes": max(r.device_bytes for r in compiled.ranks),
                    # The ledger's terms: derived bytes (both constants 0) and each constant's unit.
                    "derived_bytes": predicted_bytes(config, 0.0, 0.0),
                    "backward_unit": predicted_bytes(config, 1.0, 0.0) - predicted_bytes(config, 0.0, 0.0),
                    "recompute_unit": predicted_bytes(config, 0.0, 1.0) - predicted_bytes(config, 0.0, 0.0),
                }
            )
            print(
                f"  {name:50s} compiled {rows[-1]['compiled_device_bytes'] / 2**20:7.2f} MiB "
                f"({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def fit(rows) -> tuple[float, float]:
    from scipy.optimize import nnls

    a = np.array([[r["backward_unit"], r["recompute_unit"]] for r in rows])
    b = np.array([r["compiled_device_bytes"] - r["derived_bytes"] for r in rows])
    (backward, recompute), _ = nnls(a, b)
    return float(backward), float(recompute)


def errors(rows, backward: float, recompute: float) -> dict:
    out = {}
    for r in rows:
        predicted = r["derived_bytes"] + backward * r["backward_unit"] + recompute * r["recompute_unit"]
        out[r["config"]] = predicted / r["compiled_device_bytes"] - 1
    values = np.abs(list(out.values()))
    return {"per_config": out, "worst": float(values.max()), "mean": float(values.mean())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the record here")
    args = parser.parse_args(argv)
    print("fit configurations:", file=sys.stderr)
    fit_rows = measure(FIT)
    print("holdout configurations:", file=sys.stderr)
    hold_rows = measure(HOLDOUT)
    fitted = fit(fit_rows)
    shipped = (_ledger.BACKWARD_WORKSET, _ledger.RECOMPUTE_WORKSET)
    record = {
        "benchmark": "ledger_fit",
        "batch_size": 32,
        "seq_len": 64,
        "microbatches": 8,
        "fit_rows": fit_rows,
        "holdout_rows": hold_rows,
        "fitted": {"BACKWARD_WORKSET": fitted[0], "RECOMPUTE_WORKSET": fitted[1]},
        "shipped": {"BACKWARD_WORKSET": shipped[0], "RECOMPUTE_WORKSET": shipped[1]},
        "fit_with_fitted": errors(fit_rows, *fitted),
        "holdout_with_fitted": errors(hold_rows, *fitted),
        "holdout_with_shipped": errors(hold_rows, *shipped),
        "without_workset_holdout": errors(hold_rows, 0.0, 0.0),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(f"fitted: BACKWARD_WORKSET={fitted[0]:.2f}, RECOMPUTE_WORKSET={fitted[1]:.2f} (shipped {shipped})")
        for key in ("fit_with_fitted", "holdout_with_fitted", "holdout_with_shipped", "without_workset_holdout"):
            r = record[key]
            print(f"{key:24s} worst {r['worst']:.1%}, mean {r['mean']:.1%}")
        for name, e in record["holdout_with_shipped"]["per_config"].items():
            print(f"  holdout {name:50s} shipped constants {e:+.1%}")
    return record


if __name__ == "__main__":
    main()
