"""The planner: the fastest (simulated) schedule x microbatches x policy whose predicted per-rank device
bytes fit a budget.

Every candidate is scored by the same two models: the analytical memory ledger (``jaxmem.memory``)
and the schedule simulator with FLOP-derived costs, recompute and host transfers on a hardware
profile. Nothing is compiled. When nothing fits, the plan says so and gives the smallest budget that
would fit one of the candidates.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmem._errors import JaxmemError

__all__ = ["Candidate", "Plan", "PlanError", "plan", "evaluate"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "chronos")
POLICIES = ("save-all", "selective", "recompute-all", "chronos-recomp", "chronos-offload", "chronos-both")


class PlanError(JaxmemError):
    """No candidate fits the budget; says by how much and the smallest budget that would fit."""

    def __init__(self, message: str, smallest_budget: float | None):
        super().__init__(message)
        self.smallest_budget = smallest_budget


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One scored configuration."""

    schedule: str
    virtual: int | None
    pipe: int
    data: int
    microbatches: int
    policy_name: str
    policy: object = dataclasses.field(repr=False, compare=False)
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    step_seconds: float = math.inf
    tokens_per_second: float = 0.0
    fits: bool = False
    note: str = ""

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "virtual": self.virtual,
            "pipe": self.pipe,
            "data": self.data,
            "microbatches": self.microbatches,
            "policy": self.policy_name,
            "device_bytes": int(self.device_bytes),
            "host_bytes": int(self.host_bytes),
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "fits": self.fits,
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class Plan:
    best: Candidate | None
    candidates: tuple[Candidate, ...]
    budget_bytes: float
    hardware: dict
    model: str
    devices: int

    @property
    def ranked(self) -> list[Candidate]:
        return sorted(self.candidates, key=lambda c: (not c.fits, -c.tokens_per_second, c.device_bytes))

    @property
    def smallest_budget(self) -> float:
        return min(c.device_bytes for c in self.candidates)

    def explain(self, top: int = 5) -> list[str]:
        lines = []
        if self.best is None:
            lines.append(
                f"nothing fits {human_bytes(self.budget_bytes)} per device; the smallest footprint of any "
                f"candidate is {human_bytes(self.smallest_budget)} "
                f"(short by {human_bytes(self.smallest_budget - self.budget_bytes)})"
            )
            return lines
        b = self.best
        lines.append(
            f"best: {b.schedule}{f' V={b.virtual}' if b.virtual else ''} P={b.pipe} D={b.data} M={b.microbatches} "
            f"policy {b.policy_name}: {human_bytes(b.device_bytes)}/device, {b.tokens_per_second:,.0f} tokens/s"
        )
        for c in [c for c in self.ranked if c is not b][:top]:
            why = (
                f"{c.tokens_per_second / b.tokens_per_second:.1%} of the best's throughput"
                if c.fits
                else f"needs {human_bytes(c.device_bytes)} > budget"
            )
            lines.append(f"  runner-up: {c.schedule} P={c.pipe} M={c.microbatches} {c.policy_name}: {why}")
        return lines

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "devices": self.devices,
            "budget_bytes": int(self.budget_bytes),
            "hardware": self.hardware,
            "best": None if self.best is None else self.best.to_json(),
            "fits": self.best is not None,
            "smallest_budget_bytes": int(self.smallest_budget),
            "candidates": [c.to_json() for c in self.ranked],
            "explanation": self.explain(),
        }


CHRONOS_MOVES = {
    "chronos-recomp": ("selective", "recompute-all"),
    "chronos-offload": ("offload-stash", "optimizer-state", "weights"),
    "chronos-both": ("offload-stash", "selective", "recompute-all", "optimizer-state", "weights"),
}


def chronos_moves(config, schedule, counts, *, microbatch: int, seq: int, hardware, allowed) -> list:
    """The memory moves with their cost in seconds per byte saved, for a typical (middle) stage."""
    from jaxmem.memory._model import stage_counts, stage_residual_bytes
    from jaxmem.policy._chronos import Move
    from jaxmem.policy._policy import PRESETS

    stage = min(1, schedule.num_stages - 1)
    layers = counts[stage]
    save = stage_residual_bytes(
        config, layers=layers, first=stage == 0, last=False, microbatch=microbatch, seq=seq, policy=PRESETS["save-all"]
    )[0]
    moves = []
    for name in allowed:
        if name == "offload-stash":
            seconds_per_byte = 0.0  # only cells whose wait hides the round trip
        elif name in ("selective", "recompute-all"):
            sp = PRESETS[name]
            kept = stage_residual_bytes(
                config, layers=layers, first=stage == 0, last=False, microbatch=microbatch, seq=seq, policy=sp
            )[0]
            counts = stage_counts(config, layers=layers, first=stage == 0, last=False, seq=seq, policy=sp)
            flops = counts.recompute_flops * microbatch
            saved = max(save - kept, 1)
            seconds_per_byte = flops / hardware.flops_per_second / saved
        else:
            # Read and written back once per step: two link crossings per byte kept on host.
            seconds_per_byte = 2.0 / hardware.host_bandwidth
        moves.append(Move(name, seconds_per_byte))
    return moves


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(
    config, schedule, policy_name: str, *, budget: float, batch: int, seq: int, data: int, hardware, layer_counts=None
) -> Candidate:
    """Score one (schedule, policy) on the memory ledger and the simulator."""
    from jaxmem.memory import predict
    from jaxmem.memory._cost import state_transfer_seconds, step_costs
    from jaxmem.memory._model import stage_residual_bytes
    from jaxmem.pipeline._split import split_layers
    from jaxmem.policy._chronos import chronos_policy
    from jaxmem.policy._policy import PRESETS, from_spec
    from jaxmem.schedule import simulate

    counts = split_layers(config.n_layers, schedule.num_stages, layer_counts)
    mb = batch // (data * schedule.num_microbatches)

    def device_bytes(policy) -> float:
        return predict(
            config, schedule, policy, batch=batch, seq=seq, data_parallel=data, layer_counts=counts
        ).max_device_bytes

    base_costs = step_costs(
        config, schedule, from_spec("save-all").resolve(schedule), counts, microbatch=mb, seq=seq, hardware=hardware
    )
    note = ""
    if policy_name in CHRONOS_MOVES:
        moves = chronos_moves(
            config, schedule, counts, microbatch=mb, seq=seq, hardware=hardware, allowed=CHRONOS_MOVES[policy_name]
        )
        last = schedule.num_stages - 1

        def round_trip(s, m):
            stash = stage_residual_bytes(
                config,
                layers=counts[s],
                first=s == 0,
                last=s == last,
                microbatch=mb,
                seq=seq,
                policy=PRESETS["save-all"],
            )[0]
            return 2 * stash / hardware.host_bandwidth

        choice = chronos_policy(
            schedule, device_bytes, budget, base_costs, moves, stash_seconds_round_trip=round_trip, name=policy_name
        )
        policy = choice.policy
        note = choice.describe()
    else:
        policy = from_spec(policy_name)
    resolved = from_spec(policy).resolve(schedule)
    ledger = predict(config, schedule, policy, batch=batch, seq=seq, data_parallel=data, layer_counts=counts)
    costs = step_costs(config, schedule, resolved, counts, microbatch=mb, seq=seq, hardware=hardware)
    sim = simulate(schedule, costs)
    step = sim.makespan + state_transfer_seconds(config, schedule, resolved, counts, hardware)
    return Candidate(
        schedule=schedule.name,
        virtual=schedule.num_stages // schedule.num_ranks if schedule.num_stages > schedule.num_ranks else None,
        pipe=schedule.num_ranks,
        data=data,
        microbatches=schedule.num_microbatches,
        policy_name=policy_name,
        policy=policy,
        device_bytes=ledger.max_device_bytes,
        host_bytes=max(r.host_bytes for r in ledger.ranks),
        step_seconds=step,
        tokens_per_second=batch * seq / step,
        fits=ledger.max_device_bytes <= budget,
        note=note,
    )


def candidate_schedules(config, devices: int, batch: int, schedules=SCHEDULES, pipes=None, microbatches=None):
    """(schedule, data) pairs the planner considers: pipe sizes dividing the devices, stage counts
    dividing the layers, microbatch counts dividing the per-replica batch."""
    from jaxmem.schedule import ScheduleError, generate

    out = []
    for pipe in pipes or [p for p in _divisors(devices) if p > 1] or [1]:
        data = devices // pipe
        if batch % data:
            continue
        local = batch // data
        ms = microbatches or sorted({m for m in (pipe, 2 * pipe, 4 * pipe, 8 * pipe) if local % m == 0})
        for name in schedules:
            virtual = 2 if name in ("interleaved-1f1b",) else None
            stages = pipe * (2 if name in ("interleaved-1f1b", "zbv", "chronos", "v-half", "v-min") else 1)
            if config.n_layers % stages:
                continue
            for m in ms:
                if local % m:
                    continue
                try:
                    out.append((generate(name, pipe, m, virtual), data))
                except ScheduleError:
                    continue
    return out


def plan(
    config,
    *,
    devices: int,
    budget_bytes: float,
    hardware="h100",
    batch: int,
    seq: int,
    schedules=SCHEDULES,
    policies=POLICIES,
    pipes=None,
    microbatches=None,
    model_name: str = "",
    progress=None,
) -> Plan:
    """Search schedules x microbatches x policies; the fastest simulated candidate that fits wins."""
    from jaxmem.memory import get_hardware

    hw = get_hardware(hardware)
    pairs = candidate_schedules(config, devices, batch, schedules, pipes, microbatches)
    if not pairs:
        raise JaxmemError(
            f"no schedule fits {devices} devices, {config.n_layers} layers and batch {batch}: the pipeline "
            "size must divide the devices, the stages must divide the layers, the batch must divide into "
            "data x microbatches"
        )
    candidates = []
    for i, (schedule, data) in enumerate(pairs):
        if progress:
            progress(i, len(pairs), schedule)
        seen = {}
        for name in policies:
            cand = evaluate(config, schedule, name, budget=budget_bytes, batch=batch, seq=seq, data=data, hardware=hw)
            # A generated policy that changed nothing is the preset it started from: keep one of them.
            key = (round(cand.device_bytes), round(cand.step_seconds, 12), round(cand.host_bytes))
            if key in seen:
                continue
            seen[key] = cand
            candidates.append(cand)
    fitting = [c for c in candidates if c.fits]
    best = max(fitting, key=lambda c: (c.tokens_per_second, -c.device_bytes)) if fitting else None
    return Plan(
        best=best,
        candidates=tuple(candidates),
        budget_bytes=budget_bytes,
        hardware=hw.to_json(),
        model=model_name,
        devices=devices,
    )
