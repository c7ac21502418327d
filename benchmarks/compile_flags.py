"""What the test suite's XLA:CPU flags change: compile time and compiled temporaries, against XLA's
defaults (see ``tests/conftest.py``).

    python benchmarks/compile_flags.py [--model llama-tiny] [--json]

Each flag set runs in a fresh process (XLA reads ``XLA_FLAGS`` once), which compiles:

- the planner's stage backwards (:meth:`jaxmem.memory.ModelFacts.stage` working sets): a middle,
  first and last stage of one and two layers under save-all, selective and recompute-all, whole and
  split into I and W -- each part's ``memory_analysis().temp_size_in_bytes`` and the total compile
  time;
- one train step (ZBV, selective, P=4 on 4 virtual devices): its compile time and temporaries.

The flag sets: XLA's defaults; ``--xla_backend_optimization_level=0``; and that with
``--xla_cpu_use_fusion_emitters=false`` (the suite's) -- each with the stage backwards compiled under
the flags alone -- and XLA's defaults with the planner's own compile option on the stage backwards
(``jaxmem.memory._facts._working_options``: level 0 on CPU), as ``jaxmem plan`` compiles them. The
record lists, per stage backward, the temporaries under each, and a summary of how many equal the
defaults'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> (XLA_FLAGS, whether the working-set compiles keep the planner's own compile option)
FLAG_SETS = {
    "default": ("", False),
    "O0": ("--xla_backend_optimization_level=0", False),
    "O0, no fusion emitters": ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false", False),
    "default, the planner's option": ("", True),
}


def measure(model_name: str, planner_option: bool = True) -> dict:
    """In this process, under its XLA_FLAGS: the stage backwards' temporaries and compile times;
    ``planner_option=False`` compiles the stage backwards without the planner's compile option
    (``jaxmem.memory._facts._working_options``), under the flags alone."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jax._src.compiler as compiler

    import jaxmem.memory._facts as facts_module
    from jaxmem.config import TrainConfig
    from jaxmem.memory import model_facts
    from jaxmem.models import get_model
    from jaxmem.policy import PRESETS
    from jaxmem.train import Trainer

    spent = [0.0]
    backend_compile = compiler.backend_compile_and_load

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return backend_compile(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    compiler.backend_compile_and_load = timed
    if not planner_option:
        facts_module._working_options = lambda: None
    model = get_model(model_name, n_layers=4)
    facts = model_facts(model)
    temps = {}
    for name in ("save-all", "selective", "recompute-all"):
        policy = PRESETS[name].bind(model.tags)
        for first, last in ((False, False), (True, False), (False, True)):
            for fams in ((0,), (0, 0)):
                for split in (False, True):
                    key = f"{name} first={first} last={last} layers={len(fams)} split={split}"
                    temps[key] = facts._working(first, last, fams, policy, 64, split=split)
    stages_seconds = spent[0]
    trainer = Trainer(TrainConfig(model=model_name, schedule="zbv", policy="selective", pipe=4, steps=1))
    state = trainer.init_state()
    lowered = trainer.lower(state)
    spent[0] = 0.0
    step_temp = lowered.compile().memory_analysis().temp_size_in_bytes
    return {
        "stage_backwards": temps,
        "stage_compile_seconds": stages_seconds,
        "step_compile_seconds": spent[0],
        "step_temp_bytes": step_temp,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="model preset (default llama-tiny)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--planner-option", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, bool(args.planner_option))))
        return 0
    runs = {}
    for name, (flags, option) in FLAG_SETS.items():
        print(f"compiling under {name!r} ...", file=sys.stderr)
        env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8".strip()}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "1", "--model", args.model, "--planner-option", str(int(option))],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = runs["default"]["stage_backwards"]
    summary = {}
    for name, run in runs.items():
        ratios = [run["stage_backwards"][k] / base[k] for k in base if base[k]]
        summary[name] = {
            "stage_compile_seconds": round(run["stage_compile_seconds"], 2),
            "step_compile_seconds": round(run["step_compile_seconds"], 2),
            "step_temp_bytes": run["step_temp_bytes"],
            "stage_backwards": len(base),
            "equal_to_default": sum(run["stage_backwards"][k] == base[k] for k in base),
            "within_0.1%": sum(abs(r - 1) <= 1e-3 for r in ratios)
            + sum(not base[k] and not run["stage_backwards"][k] for k in base),
            "largest_ratio": round(max(ratios), 4),
            "smallest_ratio": round(min(ratios), 4),
        }
    record = {"model": args.model, "summary": summary, "runs": runs}
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        for name, row in summary.items():
            print(f"{name:>24}: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
