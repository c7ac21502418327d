"""Compare memory policies in Python: presets and a hand-written per-stage policy, their ledgers side by
side (predicted and compiled), and a gradient check of each.

    python examples/policy_experiment.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

from jaxmem.config import TrainConfig  # noqa: E402
from jaxmem.memory import compare, predict  # noqa: E402
from jaxmem.policy import Policy, StagePolicy, from_spec  # noqa: E402
from jaxmem.schedule import generate  # noqa: E402
from jaxmem.train import Trainer  # noqa: E402
from jaxmem.verify import verify  # noqa: E402

# 1F1B keeps P - r microbatches on rank r: rank 0 holds the most, so recompute there and keep the rest.
hand_written = from_spec(
    {
        "name": "recompute-rank0",
        "base": "save-all",
        "stage": {"0": {"base": "recompute-all"}, "1": {"base": "selective"}},
    }
)
# The same idea as a Policy value, built directly.
offload_first = Policy(
    default=StagePolicy(),
    stages=((0, StagePolicy(offload_stash=True)),),
    name="offload-stage0-stash",
)
policies = ["save-all", "selective", "recompute-all", hand_written, offload_first]

print(f"{'policy':22s} {'rank':>4s} {'predicted MiB':>14s} {'compiled MiB':>13s} {'host MiB':>9s} {'grads ok':>9s}")
for policy in policies:
    config = TrainConfig(schedule="1f1b", pipe=4, microbatches=8, policy=policy)
    trainer = Trainer(config)
    predicted = predict(trainer.pipeline.model, trainer.schedule, policy, batch=32, seq=64)
    report = compare(predicted, trainer.measure_memory())
    ok = verify(generate("1f1b", 4, 8), policy=policy)["ok"]
    for row in report["ranks"]:
        print(
            f"{str(policy):22s} {row['rank']:4d} {row['predicted_device_bytes'] / 2**20:14.2f} "
            f"{row['compiled_device_bytes'] / 2**20:13.2f} {row['predicted_host_bytes'] / 2**20:9.2f} {str(ok):>9s}"
        )
print("note: the compiled column is one SPMD program (the same on every rank); on CPU offloaded bytes stay in it,")
print("      their device saving is the predicted column's.")
