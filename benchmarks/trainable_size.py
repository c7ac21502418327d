"""Trainable model size under a fixed per-device budget: the deepest GPT each method fits, and its
simulated per-layer throughput, side by side (ChronosPipe's claim: 2.4x the depth of 1F1B at
comparable throughput, 1.5x better than 1F1B + recompute).

    python benchmarks/trainable_size.py [--budget-gib 40] [--hardware h100] [--json] [-o plot.png]

Memory is the analytical ledger's prediction (validated below against memory_analysis() on depths
that compile on this CPU); time is the schedule simulator with FLOP costs, recompute and host
transfers on the hardware profile. Both are predictions, not measurements on the cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
# Timed as a first run: no compiled figures read back from an earlier one (jaxmem.memory._figures).
os.environ.setdefault("JAXMEM_CACHE_DIR", "off")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxmem.memory import get_hardware  # noqa: E402
from jaxmem.models import get_config  # noqa: E402
from jaxmem.pipeline import uses_split_backward  # noqa: E402
from jaxmem.schedule import generate  # noqa: E402
from jaxmem.search import evaluate  # noqa: E402

METHODS = [
    # (label, schedule, virtual, policy)
    ("1F1B", "1f1b", None, "save-all"),
    ("1F1B + full recompute", "1f1b", None, "recompute-all"),
    ("1F1B + selective", "1f1b", None, "selective"),
    # The same baselines with the Adam moments and master weights' optimizer state on host (Chronos-
    # Offload's state move, given to them too so that the comparison stays fair, issue 30).
    (
        "1F1B + full recompute + opt-state on host",
        "1f1b",
        None,
        {"base": "recompute-all", "offload_optimizer_state": True},
    ),
    ("1F1B + selective + opt-state on host", "1f1b", None, {"base": "selective", "offload_optimizer_state": True}),
    ("1F1B + Chronos-Recomp", "1f1b", None, "chronos-recomp"),
    ("interleaved-1F1B", "interleaved-1f1b", 2, "save-all"),
    ("ZB-H1", "zb-h1", None, "save-all"),
    ("V-Half", "v-half", None, "save-all"),
    ("V-Min", "v-min", None, "save-all"),
    ("Chronos-Pipe", "chronos", None, "save-all"),
    ("Chronos-Pipe + Recomp", "chronos", None, "chronos-recomp"),
    ("Chronos-Pipe + Offload", "chronos", None, "chronos-offload"),
    ("ChronosPipe (all)", "chronos", None, "chronos-both"),
]

# The 1F1B baselines ChronosPipe is compared with at one depth.
BASELINES = (
    "1F1B + full recompute",
    "1F1B + full recompute + opt-state on host",
    "1F1B + selective",
    "1F1B + selective + opt-state on host",
    "1F1B + Chronos-Recomp",
)


def _layer_counts(layers: int, stages: int) -> list[int]:
    """Layers per stage, the first ``layers % stages`` stages one more."""
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def score(base, layers, schedule_name, virtual, policy, args, hardware):
    """The method at ``layers``: on a schedule with I and W, the better of W running the whole
    pullback again and W taking I's cotangents (``split_backward``: half a backward, for their
    memory), as the planner chooses -- fitting first, then faster; with ``--hand-recomputed``, also
    the split with W given what I recomputed (``hand_recomputed``)."""
    config = dataclasses.replace(base, n_layers=layers)
    schedule = generate(schedule_name, args.pipe, args.microbatches, virtual)
    stages = schedule.num_stages  # 2P for the V-shaped schedules: a multiple of P may split unevenly
    counts = _layer_counts(layers, stages)
    splits = [(False, False), (True, False)] if uses_split_backward(schedule) else [(False, False)]
    if args.hand_recomputed and uses_split_backward(schedule):
        splits.append((True, True))
    scored = [
        evaluate(
            config,
            schedule,
            policy,
            budget=args.budget_gib * 2**30,
            batch=args.batch_size,
            seq=args.seq_len,
            data=1,
            tensor=args.tensor,
            hardware=hardware,
            layer_counts=counts,
            vocab_parallel=args.vocab_parallel,
            split_backward=split,
            hand_recomputed=hand,
        )
        for split, hand in splits
    ]
    return min(scored, key=lambda c: (not c.fits, -c.tokens_per_second))


def max_depth(base, method, args, hardware, floor=None):
    """Deepest multiple of P layers that fits (device bytes grow with depth: binary search); with
    ``floor``, also keeping per-layer throughput >= floor (it falls as more is recomputed)."""
    _, schedule_name, virtual, policy = method
    step = args.pipe

    def fits(k):
        cand = score(base, k * step, schedule_name, virtual, policy, args, hardware)
        return cand.fits and (floor is None or cand.tokens_per_second * k * step >= floor)

    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    layers = lo * step
    return layers, score(base, layers, schedule_name, virtual, policy, args, hardware)


def _deepest_above_floor(base, method, args, hardware, floor, layers, cand):
    """From the memory limit ``layers`` (scored ``cand``) down in steps of P: the deepest depth whose
    per-layer throughput is >= ``floor`` (not monotone in depth -- the head's cost is amortised over
    the layers -- so every depth is tried, not a bisection)."""
    _, schedule_name, virtual, policy = method
    step = args.pipe
    for k in range(layers, 0, -step):
        c = cand if k == layers else score(base, k, schedule_name, virtual, policy, args, hardware)
        if c is not None and c.fits and c.tokens_per_second * k >= floor:
            return k, c
    return 0, None


def _at_the_papers_depth(base, one_layers, args, hardware):
    """ChronosPipe (all moves) at the paper's depth, 2.4x 1F1B's (rounded up to a multiple of P),
    with no throughput floor: what fits it there, how fast, and what its host traffic costs. With the
    optimizer state on host, the update reads and writes each rank's Adam moments after the tick loop
    (nothing overlaps it, see jaxmem.memory.state_transfer_seconds)."""
    if not one_layers:
        return None
    layers = -(-int(2.4 * one_layers) // args.pipe) * args.pipe
    cand = score(base, layers, "chronos", None, "chronos-both", args, hardware)
    one = score(base, one_layers, "1f1b", None, "save-all", args, hardware)
    config, schedule, counts, e = _estimated(base, layers, "chronos", None, cand, args, hardware)
    row = {
        "layers": layers,
        "fits": cand.fits,
        "note": cand.note,
        "per_layer_throughput_vs_1f1b": cand.tokens_per_second * layers / (one.tokens_per_second * one_layers),
        "step_seconds": e.step_seconds,
        "state_transfer_seconds": e.state_transfer_seconds,
        "device_bytes": e.device_bytes,
        "update_overlap_bound": _update_overlap_bound(config, schedule, cand.policy, counts, e, hardware, args.tensor),
    }
    print(f"at the paper's depth ({layers} layers): {row}", file=sys.stderr)
    return row


def _estimated(base, layers, schedule_name, virtual, cand, args, hardware):
    """A scored candidate estimated again whole: ``(config, schedule, layer counts, estimate)``."""
    from jaxmem.memory import estimate

    config = dataclasses.replace(base, n_layers=layers)
    schedule = generate(schedule_name, args.pipe, args.microbatches, virtual)
    counts = _layer_counts(layers, schedule.num_stages)
    e = estimate(config, schedule, cand.policy, batch=args.batch_size, seq=args.seq_len, hardware=hardware,
                 layer_counts=counts, vocab_parallel=args.vocab_parallel, tensor=args.tensor,
                 split_backward=cand.split_backward, hand_recomputed=cand.hand_recomputed)  # fmt: skip
    return config, schedule, counts, e


def _step_parts(base, layers, schedule_name, virtual, cand, args, hardware) -> dict:
    """A scored candidate's simulated step: its seconds, the busiest rank's busy seconds and the
    bubble (idle share of the ranks' time)."""
    e = _estimated(base, layers, schedule_name, virtual, cand, args, hardware)[3]
    sim = e.simulation
    return {"step_seconds": e.step_seconds, "busy_seconds": max(sim.busy), "bubble": sim.bubble_fraction}


def _update_overlap_bound(config, schedule, policy, counts, e, hardware, tensor=1) -> dict:
    """What the update's host traffic would cost if it were streamed per stage and overlapped, as far
    as the simulated timeline allows (the executor does not do this: its update runs after the tick
    loop): each stage's optimizer state (and weights) on host read and written back on its rank's
    link, sequentially, starting when the stage's last action ends -- ``in_step``: by the step's
    end; ``deferred``: by the stage's first action of the next step (its weights are needed then).
    Each rank's link takes its stages in the order best for each reading. The exposed seconds are
    what no compute hides, the worst rank's. A bound for the best such an
    executor could do, not a prediction of one."""
    from jaxmem.memory import stage_update_seconds, state_transfer_seconds
    from jaxmem.models import get_model
    from jaxmem.policy import resolve

    resolved = resolve(policy, schedule, get_model(config).tags)
    seconds = stage_update_seconds(config, schedule, resolved, counts, hardware, tensor=tensor)  # read, written back
    sim = e.simulation
    makespan = sim.makespan

    def lateness(order, last, first):  # the link takes the rank's stages in ``order``, each once it is free
        free = late_in_step = late_deferred = 0.0
        for s in order:
            free = max(free, last[s]) + seconds[s]
            late_in_step = max(late_in_step, free - makespan)
            late_deferred = max(late_deferred, free - (makespan + first[s]))
        return late_in_step, late_deferred

    exposed = {"in_step": 0.0, "deferred": 0.0}
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        last = {s: max(t for a, t in sim.finish.items() if a.stage == s) for s in stages}
        first = {s: min(t for a, t in sim.start.items() if a.stage == s) for s in stages}
        # The best order for each reading (a rank holds a few stages: every order is tried).
        lates = [lateness(order, last, first) for order in itertools.permutations(stages)]
        exposed["in_step"] = max(exposed["in_step"], min(late[0] for late in lates))
        exposed["deferred"] = max(exposed["deferred"], min(late[1] for late in lates))
    return {
        # The traffic itself, from the package's name for the function: --update-hidden replaces only
        # the one estimate() reads (jaxmem.memory._cost's), so e.state_transfer_seconds is zero then.
        "after_the_loop_seconds": state_transfer_seconds(config, schedule, resolved, counts, hardware, tensor=tensor),
        "exposed_seconds_streamed_in_step": exposed["in_step"],
        "exposed_seconds_streamed_deferred": exposed["deferred"],
        "tick_loop_seconds": makespan,
    }


def _scale_working_set(scale: float) -> None:
    """Scale every backward working set the ledger reads (compiled per one and two layers; deeper
    stages extrapolate linearly from them, so the scale carries through once)."""
    from jaxmem.memory import ModelFacts

    compiled = ModelFacts._working

    def scaled(self, first, last, fams, *args, **kwargs):  # fams: the stage's layers' families
        value = compiled(self, first, last, fams, *args, **kwargs)
        return value if value is None or len(fams) > 2 else value * scale

    ModelFacts._working = scaled


def _hide_the_update() -> None:
    """Price the update's host traffic (weights and optimizer state on host, read and written back
    after the tick loop) at zero seconds: what an executor that hid every byte of it behind compute
    would reach -- a ceiling, not one jaxmem has or one the timeline allows (``update_overlap_bound``)."""
    from jaxmem.memory import _cost

    _cost.state_transfer_seconds = lambda *args, **kwargs: 0.0


def validate_on_cpu(args):
    """Ledger vs memory_analysis() on depths of a narrow GPT (the tiny preset's width) that compile here."""
    from jaxmem.cli.memory import ledger_report
    from jaxmem.config import TrainConfig

    rows = []
    for layers in (8, 16):
        model = dataclasses.replace(get_config("tiny"), n_layers=layers)
        for schedule, policy in (("1f1b", "save-all"), ("chronos", "save-all"), ("chronos", "selective")):
            config = TrainConfig(
                model=model,
                schedule=schedule,
                pipe=4,
                microbatches=8,
                batch_size=32,
                seq_len=64,
                policy=policy,
                steps=1,
            )
            report = ledger_report(config, "yes")
            rows.append(
                {
                    "layers": layers,
                    "schedule": schedule,
                    "policy": policy,
                    "predicted_device_bytes": report["ranks"][0]["predicted_device_bytes"],
                    "compiled_device_bytes": report["ranks"][0]["compiled_device_bytes"],
                    "error": report["max_prediction_error"],
                }
            )
            print(
                f"  validate: d=64 L={layers} {schedule} {policy}: predicted "
                f"{rows[-1]['predicted_device_bytes'] / 2**20:.2f} MiB, compiled "
                f"{rows[-1]['compiled_device_bytes'] / 2**20:.2f} MiB, error {rows[-1]['error']:+.1%}",
                file=sys.stderr,
            )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=40.0, help="per-device memory budget (GiB)")
    parser.add_argument("--hardware", default="h100", help="h100, tpu-v5p or cpu")
    parser.add_argument("--width", default="gpt2-xl", help="preset giving the width (d_model, heads, vocab)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="compute dtype (bfloat16: bf16 compute with f32 master weights and Adam state, scored at the "
        "profile's bf16 peak; float32: scored at the dtype's own peak, TF32 dense on the H100)",
    )
    parser.add_argument("--pipe", type=int, default=8)
    parser.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor-parallel ways inside each pipe rank (the paper's runs were PP8 x TP8 on Llama-2-70B-like "
        "layers: --width llama-70b --tensor 8); the devices are pipe x tensor, the budget per device",
    )
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--throughput-floor",
        type=float,
        default=0.95,
        help="ChronosPipe variants keep per-layer throughput >= this fraction of 1F1B's",
    )
    parser.add_argument("--no-validate", action="store_true", help="skip the CPU compile check of the ledger")
    parser.add_argument(
        "--no-vocab-split",
        dest="vocab_parallel",
        action="store_false",
        default=None,
        help="keep the embedding and head whole on every rank (by default every method splits the vocabulary "
        "over the pipe ranks, as jaxmem's pipeline does)",
    )
    parser.add_argument(
        "--working-scale",
        type=float,
        default=1.0,
        help="scale the ledger's backward working set (compiled on this CPU) by this factor: the headline's "
        "sensitivity to it (an accelerator's XLA fuses more, or holds other buffers)",
    )
    parser.add_argument(
        "--no-links",
        action="store_true",
        help="price no communication between devices (the profile without its NVLink and network rates; "
        "the host link stays): the headline's sensitivity to the collectives, which the profile prices "
        "unoverlapped with compute",
    )
    parser.add_argument(
        "--update-hidden",
        action="store_true",
        help="price the update's host traffic (optimizer state and weights on host, read and written back "
        "after the tick loop) at zero, for every method: a ceiling for an executor that hid all of it",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="score only these methods (repeatable; 1F1B, which sets the throughput floor, and ChronosPipe "
        "(all) are always scored)",
    )
    parser.add_argument(
        "--hand-recomputed",
        action="store_true",
        help="on schedules with I and W, also score the split with W given what I recomputed "
        "(hand_recomputed), which jaxmem plan does not try for the generated Chronos policies",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("-o", "--output", help="plot (.png)")
    args = parser.parse_args(argv)
    if args.working_scale != 1.0:
        _scale_working_set(args.working_scale)
    if args.update_hidden:
        _hide_the_update()
    methods = [m for m in METHODS if not args.only or m[0] in ("1F1B", "ChronosPipe (all)", *args.only)]
    unknown = set(args.only or ()) - {m[0] for m in METHODS}
    if unknown:
        parser.error(f"--only: unknown methods {sorted(unknown)}; methods: {[m[0] for m in METHODS]}")
    hardware = get_hardware(args.hardware)
    if args.dtype == "float32" and hardware.name == "h100":
        # The profile's peak is dense bf16; float32 matmuls run as TF32 at half of it (494.7 TFLOP/s dense).
        hardware = dataclasses.replace(hardware, peak_flops=hardware.peak_flops / 2, note=hardware.note + "; TF32")
    if args.no_links:
        hardware = dataclasses.replace(
            hardware, link_bandwidth=None, network_bandwidth=None, note=hardware.note + "; no links priced"
        )
    base = dataclasses.replace(get_config(args.width), dtype=args.dtype)
    start = time.perf_counter()
    results = []
    scored = {}  # per method: (the method, its candidate at the depth it reports)
    floor = None
    for method in methods:
        layers, cand = max_depth(base, method, args, hardware)
        memory_only = layers
        if method[0] == "1F1B":
            floor = args.throughput_floor * cand.tokens_per_second * layers
        if method[1] == "chronos" and floor is not None:
            # ChronosPipe's claim is depth at comparable throughput: the deepest fitting depth whose
            # per-layer throughput stays >= the floor (throughput is not monotone in depth: the head is
            # amortised as depth grows, recompute grows with it), scanning down from the memory limit
            # in strides of 4P, then back up in steps of P to the deepest that keeps the floor.
            layers, cand = _deepest_above_floor(base, method, args, hardware, floor, layers, cand)
        throughput = cand.tokens_per_second * layers if cand else 0.0
        scored[method[0]] = method, cand
        results.append(
            {
                "name": method[0],
                "schedule": method[1],
                "policy": method[3],
                "max_layers": layers,
                "max_layers_memory_only": memory_only,
                "per_layer_throughput": throughput,
                "tokens_per_second": cand.tokens_per_second if cand else 0.0,
                "device_bytes": cand.device_bytes if cand else None,
                "step_seconds": cand.step_seconds if cand else None,
                "split_backward": cand.split_backward if cand else False,
                "hand_recomputed": cand.hand_recomputed if cand else False,
                "note": cand.note if cand else "",
            }
        )
        print(
            f"{method[0]:26s} max layers {layers:4d} (memory only {memory_only:4d})  "
            f"per-layer throughput {throughput:14,.0f} layer-tokens/s"
            + (" split backward" if cand and cand.split_backward else "")
            + (", recomputed handed" if cand and cand.hand_recomputed else "")
            + (f"  ({cand.note})" if cand and cand.note else ""),
            file=sys.stderr,
        )
    by = {r["name"]: r for r in results}
    full, one = by["ChronosPipe (all)"], by["1F1B"]
    # Every method at the SAME depths (1F1B's deepest and full ChronosPipe's): per-layer throughput
    # depends on depth (the head is amortised), so methods are compared where they both run.
    same_depth = {}
    for depth in sorted({one["max_layers"], full["max_layers"]} - {0}):
        rows = {}
        for method in methods:
            cand = score(base, depth, method[1], method[2], method[3], args, hardware)
            rows[method[0]] = {"fits": cand.fits, "per_layer_throughput": cand.tokens_per_second * depth}
        same_depth[str(depth)] = rows
        print(f"at {depth} layers: " + ", ".join(
            f"{name} {'fits' if r['fits'] else 'OOM'} {r['per_layer_throughput']:,.0f}" for name, r in rows.items()
        ), file=sys.stderr)  # fmt: skip
    at_full = same_depth.get(str(full["max_layers"]), {})

    def over(name):  # full ChronosPipe's per-layer throughput over a baseline's, both at ChronosPipe's depth
        base_row = at_full.get(name)
        if not base_row or not base_row["fits"] or not base_row["per_layer_throughput"]:
            return None
        return at_full["ChronosPipe (all)"]["per_layer_throughput"] / base_row["per_layer_throughput"]

    # Where a baseline does not fit ChronosPipe's depth, the comparison at the baseline's own deepest:
    # ChronosPipe (all moves, no floor) there, over the baseline there.
    at_their_depths = {}
    for name in BASELINES:
        depth = by[name]["max_layers"] if name in by else 0
        if depth and not at_full.get(name, {}).get("fits", False):
            cand = score(base, depth, "chronos", None, "chronos-both", args, hardware)
            method, theirs = scored[name]
            at_their_depths[name] = {
                "layers": depth,
                "chronos_fits": cand.fits,
                "chronos_over_it": cand.tokens_per_second * depth / by[name]["per_layer_throughput"]
                if cand.fits
                else None,
                "chronos_step": _step_parts(base, depth, "chronos", None, cand, args, hardware),
                "its_step": _step_parts(base, depth, method[1], method[2], theirs, args, hardware),
            }
            print(f"at {name}'s depth ({depth} layers): {at_their_depths[name]}", file=sys.stderr)
    # 1F1B + full recompute at the depth full ChronosPipe reaches.
    recompute_there = (
        score(base, full["max_layers"], "1f1b", None, "recompute-all", args, hardware) if full["max_layers"] else None
    )
    target = _at_the_papers_depth(base, one["max_layers"], args, hardware)
    record = {
        "benchmark": "trainable_size",
        "budget_bytes": int(args.budget_gib * 2**30),
        "host_bandwidth_gbps": hardware.host_bandwidth / 1e9,
        "hardware": hardware.to_json(),
        "model_family": {
            "width_preset": args.width,
            "d_model": base.d_model,
            "n_heads": base.n_heads,
            "vocab_size": base.vocab_size,
            "dtype": base.dtype,
        },
        "pipe": args.pipe,
        "tensor": args.tensor,
        "microbatches": args.microbatches,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "methods": results,
        "throughput_floor": args.throughput_floor,
        "working_scale": args.working_scale,
        "update_hidden": args.update_hidden,
        "chronos_vs_1f1b_depth_ratio": full["max_layers"] / one["max_layers"] if one["max_layers"] else None,
        "chronos_vs_1f1b_throughput_ratio": (
            full["per_layer_throughput"] / one["per_layer_throughput"] if one["per_layer_throughput"] else None
        ),
        "recompute_1f1b_at_chronos_depth": None
        if recompute_there is None
        else {
            "layers": full["max_layers"],
            "fits": recompute_there.fits,
            "per_layer_throughput": recompute_there.tokens_per_second * full["max_layers"],
            "chronos_over_it": full["per_layer_throughput"] / (recompute_there.tokens_per_second * full["max_layers"]),
        },
        "same_depth": same_depth,
        "chronos_over_baselines_at_its_depth": {name: over(name) for name in BASELINES},
        "chronos_over_baselines_at_their_depths": at_their_depths,
        "depth_ratios_vs_1f1b": {
            r["name"]: (r["max_layers"] / one["max_layers"] if one["max_layers"] else None) for r in results
        },
        "at_the_papers_depth": target,
        "planner_seconds": time.perf_counter() - start,
        "notes": [
            "memory: analytical ledger (predicted); time: simulated on the hardware profile (predicted)",
            "depths are searched in steps of P (a V-shaped schedule's 2P stages may then split unevenly)",
            f"dtype {args.dtype}; peak {hardware.peak_flops / 1e12:.1f} TFLOP/s ({hardware.note})",
            *(["the update's host traffic priced at zero (--update-hidden): a ceiling"] if args.update_hidden else []),
        ],
    }
    if not args.no_validate:
        record["cpu_validation"] = validate_on_cpu(args)
    if args.output:
        _plot(record, args.output)
    if args.json:
        print(json.dumps(record, indent=2))
    elif record["recompute_1f1b_at_chronos_depth"] is None:
        print("ChronosPipe fits no depth above the throughput floor")
    else:
        print(
            f"ChronosPipe vs 1F1B: {record['chronos_vs_1f1b_depth_ratio']:.2f}x depth at "
            f"{record['chronos_vs_1f1b_throughput_ratio']:.1%} per-layer throughput; vs 1F1B + full recompute at "
            f"the same depth: {record['recompute_1f1b_at_chronos_depth']['chronos_over_it']:.2f}x throughput"
        )
    return record


def _plot(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m["name"] for m in record["methods"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.barh(names, [m["max_layers"] for m in record["methods"]], color="#4C72B0")
    a1.set_xlabel("max layers under the budget")
    a1.invert_yaxis()
    base = record["methods"][0]["per_layer_throughput"] or 1
    a2.barh(names, [m["per_layer_throughput"] / base for m in record["methods"]], color="#55A868")
    a2.axvline(0.95, color="black", linestyle=":", linewidth=1)
    a2.set_xlabel("per-layer throughput relative to 1F1B")
    a2.invert_yaxis()
    a2.set_yticklabels([])
    fig.suptitle(
        f"budget {record['budget_bytes'] / 2**30:.0f} GiB/device, {record['hardware']['name']}, "
        f"d_model {record['model_family']['d_model']}, P={record['pipe']}, M={record['microbatches']}",
        fontsize=9,
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
