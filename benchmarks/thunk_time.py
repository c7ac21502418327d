"""Where a step's CPU time goes. Each step is timed untraced (wall time and the process's CPU time),
then traced with ``jax.profiler``; the trace's thunk events are summed by self time (an event's
duration less its children's), by what ran and by where in the program it ran.

    python benchmarks/thunk_time.py [--variants plain,1f1b:save-all:8,zbv:save-all:32:split]
                                    [--layers 8] [--steps 10] [--top N] [--json]

Every variant is the tiny GPT, batch 64 x 64, P=4 on 4 virtual CPU devices, as in
``benchmarks/overhead.py``; ``plain`` is the plain jitted step data parallel over the same 4 devices.
Per variant:

- ``cpu_ms``: the process's CPU time per step, every thread;
- ``thunks_per_device``: thunk events per step and device, by where the instruction sits: outside
  the tick loop, in the loop outside any conditional (the table's reads, the message slots, the
  sends), or inside a conditional's branch (the actions, the vocabulary's ends);
- ``thread_time_share``: shares of the device threads' traced self time in kernels (fusions,
  products), dispatch (the thunk executor's own time), collectives (their self time, waiting for
  the peers included, and the rendezvous waits) and control (conditionals' and loops' own time).
  These are wall-clock durations: a thread that shares a core is timed while it waits for it.
- with ``--top N``, ``top_kernels_ms``: the N instruction kinds with the most kernel self time per
  step, summed over the devices, each with its place.

A variant ending in ``:nocomm`` (``zbv:save-all:32:split:nocomm``) is traced with its tick loop's
collectives replaced by local stand-ins (:func:`without_collectives`): wrong values, the same work,
no barrier. Beside the same variant with them, it says what the lockstep's collectives cost.

First, a probe of whether the device threads spin while they wait at a collective (they would then
burn CPU time for the lockstep's imbalance): one rank of four works, three wait (:func:`wait_probe`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmem._util import cpu_cores, with_host_devices  # noqa: E402  (imports no JAX)

# 8 virtual devices, as the CLI asks for them: on fewer cores, each runs its kernels on one thread.
os.environ.setdefault("XLA_FLAGS", with_host_devices("", 8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from overhead import LAYERS, pipelined_program, plain_step, time_steps  # noqa: E402

from jaxmem.models import get_model  # noqa: E402

COLLECTIVES = {"collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all"}
CONTROL = {"conditional", "while", "call"}
# Events of the runtime's own, not the program's: the caller waiting for the step, buffer handling.
RUNTIME = ("ThunkExecutor::Execute (wait", "ThreadpoolListener", "end: ", "Handle ", "CommonPjRt", "Allocate")
WAITS = ("Wait", "Rendezvous", "InvokeRendezvous")


def opcodes(hlo_text: str) -> tuple[dict[str, str], dict[str, str]]:
    """From a compiled module's text: instruction name -> opcode, and instruction name -> where it
    runs (``branch``: in a conditional's branch, at any depth; ``loop``: in a while loop's body,
    outside any branch; ``outside``)."""
    op_of, computation_of, callers = {}, {}, {}
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+.*? ([\w\-]+)\(", line)
        if not m or current is None:
            continue
        op_of[m.group(1)] = m.group(2)
        computation_of[m.group(1)] = current
        for relation, names in re.findall(
            r"(body|condition|true_computation|false_computation|branch_computations|calls|to_apply)="
            r"(\{[^}]*\}|%?[\w.\-]+)",
            line,
        ):
            kind = "loop" if relation in ("body", "condition") else "branch" if "computation" in relation else "in"
            for callee in names.strip("{}").split(","):
                callers[callee.strip().lstrip("%")] = (current, kind)

    def where(computation, seen=()):
        kinds = []
        while computation in callers and computation not in seen:
            seen = (*seen, computation)
            computation, kind = callers[computation]
            kinds.append(kind)
        return "branch" if "branch" in kinds else "loop" if "loop" in kinds else "outside"

    return op_of, {name: where(c) for name, c in computation_of.items()}


def category(name: str, op_of: dict[str, str]) -> str | None:
    """What an event is: kernels, dispatch, collectives, control, or None (the runtime's own)."""
    if name.startswith(RUNTIME):
        return None
    if name == "ThunkExecutor::Execute":
        return "dispatch"
    if name.startswith(WAITS):
        return "collectives"
    op = op_of.get(name)
    if op is None:
        return None
    if op in COLLECTIVES:
        return "collectives"
    return "control" if op in CONTROL else "kernels"


def instruction_kind(name: str) -> str:
    """An instruction's name without its number: the fusions XLA names alike (``ynn_fusion.12``)
    counted together."""
    return re.sub(r"\.\d+$", "", name)


def self_times(
    lines, op_of: dict[str, str], where_of: dict[str, str], by_instruction: bool = False
) -> tuple[collections.Counter, collections.Counter]:
    """Over the threads' event lines (each a list of ``(name, start_ns, duration_ns)``): self time
    (ns, wall-clock on the thread) and event counts by ``(category, where)`` -- with
    ``by_instruction``, by ``(category, where, instruction kind)`` (:func:`instruction_kind`). An
    event's self time is its duration less that of the events nested in it. ``where`` is the
    instruction's place in the program (:func:`opcodes`); an event that names no instruction (the
    executor's own, a wait) takes the place of the first instruction it runs, or of the instruction it
    runs in."""
    times, counts = collections.Counter(), collections.Counter()
    for events in lines:
        stack = []  # [end, record]; record = [category, self ns, where, parent record]
        records = []
        for name, start, duration in sorted(events, key=lambda e: (e[1], -e[2])):
            cat = category(name, op_of)
            if cat is None:
                continue
            while stack and stack[-1][0] <= start:
                stack.pop()
            where = where_of.get(name)
            if where:
                for _, parent in stack:  # the executor's runs and waits that name no instruction
                    parent[2] = parent[2] or where
            record = [cat, duration, where, stack[-1][1] if stack else None, name]
            if stack:
                stack[-1][1][1] -= duration
            stack.append([start + duration, record])
            records.append(record)
        for record in records:
            cat, ns, where, parent, name = record
            while where is None and parent is not None:  # ran no instruction: the place it ran in
                where, parent = parent[2], parent[3]
            key = (cat, where or "outside") + ((instruction_kind(name),) if by_instruction else ())
            times[key] += ns
            counts[key] += 1
    return times, counts


def _by_place(counter) -> collections.Counter:
    """``(category, where, ...)`` keys summed to ``(category, where)``."""
    out = collections.Counter()
    for key, v in counter.items():
        out[key[:2]] += v
    return out


def traced(run, state, batch, steps: int, hlo_text: str, by_instruction: bool = False):
    """Self time (ns) and event counts per step by ``(category, where)`` (with ``by_instruction``,
    ``(category, where, instruction kind)``), over ``steps`` traced steps."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        for _ in range(steps):
            state = run(state, batch)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    # The devices' programs run on the CPU client's Eigen threads.
    lines = [
        [(e.name, e.start_ns, e.duration_ns) for e in line.events]
        for plane in data.planes
        for line in plane.lines
        if "XLAEigen" in line.name or "XLAPjRtCpuClient" in line.name
    ]
    times, counts = self_times(lines, *opcodes(hlo_text), by_instruction=by_instruction)
    return {k: v / steps for k, v in times.items()}, {k: v / steps for k, v in counts.items()}


def timed(run, state, batch, steps: int):
    """``(wall seconds, process CPU seconds)`` per step, the mean of ``steps`` steps after 3 untimed."""
    state, _ = time_steps(run, state, [batch], 3)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state = run(state, batch)
    jax.block_until_ready(state)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps, state


def wait_probe(steps: int = 5) -> dict:
    """Do the device threads spin while they wait at a collective? One rank of four runs a chain of
    small (single-threaded) products each tick while the other three wait at the tick's
    ``ppermute``; the process's CPU time over the wall time says how many cores that takes, beside
    the same chain on one device alone."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("pipe",), devices=jax.devices()[:4])

    def work(a):
        return jax.lax.fori_loop(0, 400, lambda _, a: jnp.tanh(a[:, :64] @ a[:64, :]) * 0.5, a)

    def ticks(x):
        rank = jax.lax.axis_index("pipe")

        def tick(c, _):
            c = jax.lax.cond(rank == 0, work, lambda c: c, c)
            return jax.lax.ppermute(c, "pipe", [(r, (r + 1) % 4) for r in range(4)]), None

        return jax.lax.scan(tick, x, None, length=20)[0]

    def cores(fn, x):
        jax.block_until_ready(fn(x))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            jax.block_until_ready(fn(x))
        return (time.process_time() - cpu) / (time.perf_counter() - wall)

    pipelined = jax.jit(jax.shard_map(ticks, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe")))
    alone = jax.jit(lambda c: jax.lax.scan(lambda c, _: (work(c), None), c, None, length=20)[0])
    x = jax.device_put(jnp.full((4 * 64, 64), 0.01), jax.NamedSharding(mesh, P("pipe")))
    return {"one_works_three_wait_cores": cores(pipelined, x), "alone_cores": cores(alone, jnp.full((64, 64), 0.01))}


@contextlib.contextmanager
def without_collectives():
    """While a pipelined step is traced, its tick loop's collectives are local stand-ins of their shapes.

    A message "received" is the rank's own; a sum or a gather over the ranks is the rank's own value.
    The values are wrong; every action's work is the same, and so are the loop, its conditionals and
    the gradients' sums after it. On XLA:CPU every collective is a rendezvous of all the device threads,
    so this times the step without the lockstep's barriers (for timing only: ``nocomm`` variants)."""
    from jaxmem.pipeline import _body

    ends = _body._VocabEnds
    saved = jax.lax.ppermute, ends.total, ends.gather
    jax.lax.ppermute = lambda x, axis_name, perm: x
    ends.total = lambda self, x: _body.vary(x)
    ends.gather = lambda self, x: _body.vary(jnp.broadcast_to(x, (self.run.body.pipeline.pipe, *x.shape)))
    try:
        yield
    finally:
        jax.lax.ppermute, ends.total, ends.gather = saved


def parse_variant(text: str):
    """``schedule:policy:M[:split][:nocomm]`` -> ``(schedule, policy, M, split, nocomm)``; ``plain`` -> None."""
    if text == "plain":
        return None
    parts = text.split(":")
    tags = parts[3:]
    if len(parts) < 3 or not parts[2].isdigit() or tags not in ([], ["split"], ["nocomm"], ["split", "nocomm"]):
        raise SystemExit(
            f"variant {text!r}: expected schedule:policy:M, then :split and/or :nocomm, e.g. zbv:save-all:32 or "
            "zbv:save-all:32:split:nocomm"
        )
    return parts[0], parts[1], int(parts[2]), "split" in tags, "nocomm" in tags


DEFAULT = "plain,1f1b:save-all:8,1f1b:save-all:32,zbv:save-all:8:split,zbv:save-all:32:split,zbv:save-all:32"
WHERE = ("outside", "loop", "branch")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT, help=f"comma-separated; default {DEFAULT}")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"layers of the tiny GPT (default {LAYERS})")
    parser.add_argument("--d-model", type=int, default=64, help="width of the tiny GPT (default 64, the preset's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (and 3 traced)")
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="also list each variant's N instruction kinds (a name less its number) with the most kernel self time, "
        "by place (e.g. --top 15; compare two variants' lists to see where one spends more)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.layers < 4 or args.top < 0 or args.d_model < 4 or args.d_model % 4:
        parser.error(
            "--steps must be at least 1, --layers at least 4 (one per stage at P=4), --top at least 0, --d-model a "
            "positive multiple of the tiny GPT's 4 heads"
        )
    variants = [parse_variant(v) for v in args.variants.split(",")]  # a bad one fails before any work
    probe = wait_probe()
    print(
        f"one rank of four works, three wait at a ppermute: {probe['one_works_three_wait_cores']:.2f} cores "
        f"(the same work alone: {probe['alone_cores']:.2f})",
        file=sys.stderr,
        flush=True,
    )
    cores, rows, plain_cpu = cpu_cores(), [], None
    for variant in variants:
        if variant is None:
            compiled, run, state, batches, _ = plain_step("tiny", 64, 64, layers=args.layers, d_model=args.d_model)
            label, batch = "plain, data parallel 4", batches[0]
        else:
            schedule, policy, m, split, nocomm = variant
            model = get_model("tiny", n_layers=args.layers, d_model=args.d_model)
            with without_collectives() if nocomm else contextlib.nullcontext():
                compiled, run, state, batches, _ = pipelined_program(m, 64, 64, schedule, 4, policy, model, split)
            batch = batches[0]
            label = f"{schedule} M={m} {policy}" + (" split" if split else "") + (" nocomm" if nocomm else "")
        wall, cpu, state = timed(run, state, batch, args.steps)
        times, counts = traced(run, state, batch, 3, compiled.as_text(), by_instruction=bool(args.top))
        kinds = collections.Counter()  # kernel self time by (where, instruction kind), with --top
        if args.top:
            for (cat, where, kind), ns in times.items():
                if cat == "kernels":
                    kinds[(where, kind)] += ns
            times, counts = _by_place(times), _by_place(counts)
        plain_cpu = cpu if variant is None else plain_cpu
        thread_ms = sum(times.values()) / 1e6

        r = {
            "variant": label,
            "wall_ms": wall * 1e3,
            "cpu_ms": cpu * 1e3,
            "cpu_over_wall": cpu / wall,
            "cpu_over_plain_cpu": cpu / plain_cpu if plain_cpu else None,
            "thunks_per_device": {w: sum(v for (_, ww), v in counts.items() if ww == w) / 4 for w in WHERE},
            "thread_time_share": {
                c: sum(v for (cc, _), v in times.items() if cc == c) / 1e6 / max(thread_ms, 1e-9)
                for c in ("kernels", "dispatch", "collectives", "control")
            },
        }
        if args.top:  # summed over the devices, per step
            r["top_kernels_ms"] = [
                {"where": w, "instruction": k, "ms": v / 1e6} for (w, k), v in kinds.most_common(args.top)
            ]
        rows.append(r)
        print(
            f"{label:30s} wall {r['wall_ms']:6.1f} ms  cpu {r['cpu_ms']:6.1f} ms ({r['cpu_over_wall']:.2f} cores"
            + (f", {r['cpu_over_plain_cpu']:.2f}x plain's" if plain_cpu and variant else "")
            + ")  thunks/device "
            + "/".join(f"{r['thunks_per_device'][w]:.0f}" for w in WHERE)
            + "  thread time "
            + " ".join(f"{c} {v:.0%}" for c, v in r["thread_time_share"].items()),
            file=sys.stderr,
            flush=True,
        )
        for row in r.get("top_kernels_ms", ()):
            print(f"    {row['ms']:8.2f} ms  {row['where']:8s} {row['instruction']}", file=sys.stderr)
    record = {
        "benchmark": "thunk_time",
        "command": "python benchmarks/thunk_time.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": f"tiny, {args.layers} layers, d_model {args.d_model}",
        "batch_size": 64,
        "seq_len": 64,
        "pipe": 4,
        "cores": cores,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "notes": [
            "cpu_ms: the process's CPU time per step (time.process_time), all threads",
            "thunks_per_device: the trace's thunk events per step and device, outside / in the tick loop / "
            "in a conditional's branch",
            "thread_time_share: shares of the device threads' traced wall-clock self time (a thread sharing "
            "a core is counted while it waits for it)",
        ],
        "wait_probe": probe,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
