"""Per-device static bytes (parameters, gradients, optimizer state) of a small Llama with a 32k
vocabulary, compiled on virtual CPU devices (deterministic), before and after the sharded state:

- "whole": ``--no-zero --no-vocab-split``, how every layout was held before (the embedding and the
  head whole on every pipe rank, Adam's moments whole on every replica);
- "sharded": the defaults (ZeRO over the replicas, the vocabulary split over the pipe ranks);
- "fsdp": the defaults with the replicas as FSDP shards (parameters cut too, gathered per use);
- "tensor": "sharded" on a tensor axis of 2 as well (P=2 x D=2 x T=2, 8 devices): the layers' heads
  and MLP units cut (Megatron's split, from the model's annotations); the vocabulary tables, which
  are most of this model, are not cut over tensor.

    python benchmarks/sharded_state.py [--json] [--out benchmarks/results/sharded_state.json]

Figures are the compiled step's (``Trainer.measure_memory()``, rank 0's categories from
``memory_analysis()`` and the arguments' shardings) beside the ledger's prediction.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from plan_ranking import write_record  # noqa: E402

from jaxmem.cli.memory import ledger_report  # noqa: E402
from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.models import LlamaConfig  # noqa: E402

MODEL = LlamaConfig(vocab_size=32000, d_model=64, n_heads=4, n_kv_heads=2, n_layers=4, max_seq_len=64)
SHAPE = dict(pipe=2, microbatches=4, batch_size=16, seq_len=64, steps=1, data="synthetic")
LAYOUTS = {
    "whole": dict(data_parallel=2, zero=False, vocab_split=False),
    "sharded": dict(data_parallel=2),
    "fsdp": dict(data_parallel=1, fsdp=2),
    "tensor": dict(data_parallel=2, tensor=2),
}
STATIC = ("params", "grads", "optimizer_state")


def row(name: str) -> dict:
    config = TrainConfig(model=MODEL, **SHAPE, **LAYOUTS[name])
    report = ledger_report(config, "yes")
    categories = report["ranks"][0]["categories"]
    compiled = {k: categories[k]["program_device"] for k in STATIC}
    predicted = {k: categories[k]["predicted_device"] for k in STATIC}
    return {
        "layout": name,
        "settings": LAYOUTS[name],
        "compiled_static_bytes": sum(compiled.values()),
        "predicted_static_bytes": sum(predicted.values()),
        "compiled": compiled,
        "predicted": predicted,
        "compiled_device_bytes": report["ranks"][0]["compiled_device_bytes"],
        "predicted_device_bytes": report["ranks"][0]["predicted_device_bytes"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the record here")
    args = parser.parse_args(argv)
    rows = [row(name) for name in LAYOUTS]
    record = {
        "model": "llama (d_model 64, 4 layers, vocab 32000), f32, P=2, 4 virtual CPU devices (8 with T=2)",
        "shape": SHAPE,
        "rows": rows,
        "static_ratio_sharded_vs_whole": rows[1]["compiled_static_bytes"] / rows[0]["compiled_static_bytes"],
        "static_ratio_fsdp_vs_whole": rows[2]["compiled_static_bytes"] / rows[0]["compiled_static_bytes"],
        "static_ratio_tensor_vs_sharded": rows[3]["compiled_static_bytes"] / rows[1]["compiled_static_bytes"],
    }
    if not write_record(record, args.out, args.json):
        for r in rows:
            print(
                f"{r['layout']:8s} static {r['compiled_static_bytes'] / 2**20:7.2f} MiB compiled, "
                f"{r['predicted_static_bytes'] / 2**20:7.2f} MiB predicted; whole device "
                f"{r['compiled_device_bytes'] / 2**20:7.2f} MiB compiled"
            )


if __name__ == "__main__":
    main()
