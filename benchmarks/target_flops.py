"""The time model's FLOPs against the accelerator compiler's own count, on a TPU v5e and an H100.

    python benchmarks/target_flops.py [--json] [--out benchmarks/results/target_flops.json]
        [--targets tpu-v5e,h100] [--models tiny,llama-tiny,gpt2-small,llama-8b]
        [--policies save-all,selective,recompute-all]

The time model prices a stage's forward and backward by the FLOPs of its facts
(``ModelFacts.stage``): a closed form for jaxmem's GPT (matmuls only), ``cost_analysis()`` of the
lowered, unoptimised stage for any other model. Here each stage is also compiled for the target's
devices with no device present (``ModelFacts.compiled_flops``), and the FLOPs the target's compiler
counts in its optimised programs are read: the TPU's ``cost_analysis()``; for the H100, whose
compile-only executable answers none, XLA's HLO cost analysis of the optimised module. The error is
``model / compiled - 1``, per sequence, for three stage roles: the first (embedding and one layer), a
middle one (two layers) and the last (one layer, the head and the loss). bf16, each model's own
sequence (64; gpt2-small 512; llama-8b 4096 at its real width, one layer a stage).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

TARGETS = ("tpu-v5e", "h100")
MODELS = ("tiny", "llama-tiny", "gpt2-small", "llama-8b")
POLICIES = ("save-all", "selective", "recompute-all")
SEQ = {"gpt2-small": 512, "llama-8b": 4096}  # the rest at 64
ROLES = {"first": (True, False, 1), "middle": (False, False, 2), "last": (False, True, 1)}


def rows_for(target: str, name: str, policies) -> list[dict]:
    from jaxmem.memory import model_facts
    from jaxmem.models import get_model
    from jaxmem.policy import PRESETS

    model = get_model(name, dtype="bfloat16")
    facts = model_facts(model, target=target)
    seq = SEQ.get(name, 64)
    out = []
    for policy_name in policies:
        policy = PRESETS[policy_name].bind(model.tags)
        for role, (first, last, layers) in ROLES.items():
            if name == "llama-8b" and role == "middle":
                layers = 1  # its width: one layer is 0.2 GFLOP a token
            start = time.perf_counter()
            modelled = facts.stage(first=first, last=last, layers=layers, policy=policy, microbatch=1, seq=seq)
            forward, backward = facts.compiled_flops(first=first, last=last, layers=layers, policy=policy, seq=seq)
            row = {
                "target": target,
                "model": name,
                "policy": policy_name,
                "stage": role,
                "layers": layers,
                "seq_len": seq,
                "model_forward_flops": modelled.forward_flops,
                "compiled_forward_flops": forward,
                "forward_error": modelled.forward_flops / forward - 1,
                "model_backward_flops": modelled.backward_flops,
                "compiled_backward_flops": backward,
                "backward_error": modelled.backward_flops / backward - 1,
                "seconds": time.perf_counter() - start,
            }
            out.append(row)
            print(
                f"  {target:8s} {name:11s} {policy_name:14s} {role:6s} forward {row['forward_error']:+6.1%} "
                f"backward {row['backward_error']:+6.1%} ({row['seconds']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return out


def summary(rows) -> dict:
    per_target = {}
    for r in rows:
        s = per_target.setdefault(r["target"], {"rows": 0, "within_10pct": 0, "worst": 0.0})
        for key in ("forward_error", "backward_error"):
            s["rows"] += 1
            s["within_10pct"] += int(abs(r[key]) <= 0.10)
            s["worst"] = max(s["worst"], r[key], key=abs)
    return per_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", action="store_true", help="print the record")
    parser.add_argument("--out", help="write the record here")
    args = parser.parse_args()
    rows = []
    for target in args.targets.split(","):
        for name in args.models.split(","):
            rows += rows_for(target, name, args.policies.split(","))
    import jax

    record = {
        "benchmark": "target_flops",
        "jax": jax.__version__,
        "command": "python benchmarks/target_flops.py " + " ".join(sys.argv[1:]),
        "rows": rows,
        "summary": summary(rows),
    }
    from plan_ranking import write_record

    if not write_record(record, args.out, args.json):
        for target, s in record["summary"].items():
            print(f"{target}: {s['within_10pct']}/{s['rows']} within 10%, worst {s['worst']:+.1%}")


if __name__ == "__main__":
    main()
