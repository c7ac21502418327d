"""Event-driven simulation of a schedule: makespan, bubble, and each rank's live activations over time."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from jaxmem._errors import JaxmemError
from jaxmem.schedule._action import Action, Kind
from jaxmem.schedule._table import Schedule, dependencies
from jaxmem.schedule._validate import lockstep_ticks, validate

__all__ = ["Costs", "SimulationResult", "simulate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-action costs for :func:`simulate`.

    Costs are for a stage that holds a rank's share of the model (1/P of it). When a rank holds V
    stages (interleaved, V-shape), each stage is 1/V of that share, so by default its actions cost
    ``1/V`` of these figures and its activations weigh ``1/V`` -- schedules of different V compare
    at equal model size, as the zero-bubble and interleaving papers compare them. ``stage_weights``
    overrides that split (e.g. from measured per-stage times).

    Attributes:
        f: forward time.
        b: full-backward time; defaults to ``i + w``.
        i: input-gradient time (split backward).
        w: weight-gradient time (split backward).
        comm: latency of one hop that moves an activation or gradient to another rank.
        activation_bytes: bytes one stage-microbatch activation holds (for a stage of weight 1); when
            given, the memory timeline is also reported in bytes.
        stage_weights: relative size of every stage (multiplies times and activation bytes).
        extra: optional ``extra(action) -> seconds`` added to an action (e.g. recompute in a backward).
        activation_fn: optional ``activation_fn(stage, microbatch) -> bytes`` on device from the start
            of F to the end of the freeing backward; overrides ``activation_bytes``.
        offload_fn: optional ``offload_fn(stage, microbatch) -> bytes`` of that activation moved to
            host after its F and brought back before its backward.
        fetch_fn: optional ``fetch_fn(action) -> bytes`` brought from host to device before the action
            (a stage's weights kept on host, fetched for each action that runs the stage).
        host_bandwidth: bytes per time unit of each rank's host link (needed with ``offload_fn`` or
            ``fetch_fn``).

    Transfers run on one copy channel per rank, in request order: the offload starts when F ends;
    the prefetch of a backward's stash and the fetch of an action's weights start when the rank
    starts the action before it (so they overlap that action), after what the channel already
    carries; a rank's first action's fetch is requested when the step starts. An action waits for
    its transfers: only the part of a transfer that no compute overlaps delays it, and the
    simulation charges that part (``exposed_transfer``).
    """

    f: float = 1.0
    b: float | None = None
    i: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    activation_bytes: float | None = None
    stage_weights: tuple[float, ...] | None = None
    extra: Callable[[Action], float] | None = dataclasses.field(default=None, compare=False)
    activation_fn: Callable[[int, int], float] | None = dataclasses.field(default=None, compare=False)
    offload_fn: Callable[[int, int], float] | None = dataclasses.field(default=None, compare=False)
    fetch_fn: Callable[[Action], float] | None = dataclasses.field(default=None, compare=False)
    host_bandwidth: float | None = None

    def __post_init__(self):
        def finite(value) -> bool:
            return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0

        for field in ("f", "i", "w", "comm"):
            value = getattr(self, field)
            if not finite(value):
                raise JaxmemError(f"Costs.{field} must be a finite number >= 0, got {value!r}")
        if self.b is not None and not finite(self.b):
            raise JaxmemError(f"Costs.b must be a finite number >= 0 (or None for i + w), got {self.b!r}")
        if self.activation_bytes is not None and not finite(self.activation_bytes):
            raise JaxmemError(f"Costs.activation_bytes must be a finite number >= 0, got {self.activation_bytes!r}")
        if self.stage_weights is not None:
            object.__setattr__(self, "stage_weights", tuple(float(x) for x in self.stage_weights))
        transfers = self.offload_fn is not None or self.fetch_fn is not None
        if transfers and not (self.host_bandwidth and self.host_bandwidth > 0):
            raise JaxmemError("Costs.offload_fn and Costs.fetch_fn need host_bandwidth > 0 (bytes per time unit)")

    @property
    def tracks_bytes(self) -> bool:
        return self.activation_bytes is not None or self.activation_fn is not None

    def activation_size(self, stage: int, microbatch: int, schedule: Schedule) -> float:
        if self.activation_fn is not None:
            return float(self.activation_fn(stage, microbatch))
        if self.activation_bytes is None:
            return 0.0
        return self.activation_bytes * self.weight(stage, schedule)

    @property
    def full_backward(self) -> float:
        return self.i + self.w if self.b is None else self.b

    def weight(self, stage: int, schedule: Schedule) -> float:
        if self.stage_weights is not None:
            if len(self.stage_weights) != schedule.num_stages:
                raise JaxmemError(
                    f"Costs.stage_weights has {len(self.stage_weights)} entries but the schedule has "
                    f"{schedule.num_stages} stages"
                )
            return self.stage_weights[stage]
        return schedule.num_ranks / schedule.num_stages

    def duration(self, action: Action, schedule: Schedule) -> float:
        kind = action.kind  # (no dict built per call: a planner's simulations ask millions of times)
        base = (
            self.f if kind is Kind.F else self.i if kind is Kind.I else self.w if kind is Kind.W else self.full_backward
        )
        seconds = base * self.weight(action.stage, schedule)
        if self.extra is not None:
            seconds += self.extra(action)
        return seconds


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` returns.

    Attributes:
        schedule: the simulated schedule.
        makespan: time from the first action's start to the last action's end.
        bubble_fraction: idle share of the ranks' time, ``1 - busy / (ranks * makespan)``.
        busy: per rank, the time spent in actions.
        start, finish: per action, its start and end time.
        timeline: per rank, the change points ``(time, live activations)`` of its stage-microbatch
            activations (alive from the start of F to the end of B, or of W when split).
        peak_inflight: per rank, the most activations it holds at once.
        timeline_bytes / peak_activation_bytes: the same in bytes, when costs carry activation bytes
            (offloaded bytes leave the device between the end of their offload and the start of their
            prefetch).
        exposed_transfer: per rank, the time actions waited for their prefetch or fetch.
        transfer_busy: per rank, the time its host link was busy.
    """

    schedule: Schedule
    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]
    start: dict[Action, float]
    finish: dict[Action, float]
    timeline: tuple[tuple[tuple[float, int], ...], ...]
    peak_inflight: tuple[int, ...]
    timeline_bytes: tuple[tuple[tuple[float, float], ...], ...] | None = None
    peak_activation_bytes: tuple[float, ...] | None = None
    exposed_transfer: tuple[float, ...] = ()
    transfer_busy: tuple[float, ...] = ()

    def reuse_distance(self, stage: int, microbatch: int) -> float:
        """How long the activation of (stage, microbatch) waits between the end of its F and the
        start of the backward that consumes it (B, or I when split)."""
        f = Action(stage, Kind.F, microbatch)
        b = Action(stage, Kind.B, microbatch)
        if b not in self.start:
            b = Action(stage, Kind.I, microbatch)
        return self.start[b] - self.finish[f]

    def to_json(self) -> dict:
        s = self.schedule
        record = {
            "schedule": s.name,
            "ranks": s.num_ranks,
            "stages": s.num_stages,
            "microbatches": s.num_microbatches,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "peak_inflight": list(self.peak_inflight),
            "busy": list(self.busy),
            "valid": True,
        }
        if self.peak_activation_bytes is not None:
            record["peak_activation_bytes"] = list(self.peak_activation_bytes)
        return record


def _freeing_kind(schedule: Schedule, action: Action, present: set) -> Kind:
    return Kind.W if Action(action.stage, Kind.W, action.microbatch) in present else Kind.B


@dataclasses.dataclass(frozen=True)
class _Walk:
    """What :func:`simulate` needs of a schedule alone, computed once per schedule, by position in
    lockstep order (a topological order that respects every rank's own order): the simulation
    indexes lists by position instead of hashing actions millions of times over a planner's search."""

    actions: tuple[Action, ...]
    ranks: tuple[int, ...]
    deps: tuple[tuple[tuple[int, bool], ...], ...]  # per action: (position, on another rank) of each input
    following: tuple[int, ...]  # the position of its rank's next action, -1 for none
    forwards: tuple[tuple[tuple[int, int], ...], ...]  # per rank, in its order: (F, the action freeing it)


@functools.lru_cache(maxsize=512)
def _walk(schedule: Schedule) -> _Walk:
    ticks = lockstep_ticks(schedule)
    present = set(ticks)
    rank_of = schedule.stage_to_rank
    orders = [schedule.actions(r) for r in range(schedule.num_ranks)]
    actions = tuple(sorted(present, key=lambda a: (ticks[a], rank_of[a.stage])))
    at = {a: i for i, a in enumerate(actions)}
    following = {a: (row[i + 1] if i + 1 < len(row) else None) for row in orders for i, a in enumerate(row)}
    deps = tuple(
        tuple((at[d], rank_of[d.stage] != rank_of[a.stage]) for d in dependencies(a, schedule, present))
        for a in actions
    )
    frees = {a: Action(a.stage, _freeing_kind(schedule, a, present), a.microbatch) for a in present if a.kind is Kind.F}
    return _Walk(
        actions=actions,
        ranks=tuple(rank_of[a.stage] for a in actions),
        deps=deps,
        following=tuple(-1 if following[a] is None else at[following[a]] for a in actions),
        forwards=tuple(tuple((at[a], at[frees[a]]) for a in row if a.kind is Kind.F) for row in orders),
    )


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimulationResult:
    """Run the schedule against per-action costs, each rank in its table order.

    An action starts when its rank is free and its inputs are there (a hop to another rank adds
    ``costs.comm``). The schedule is validated first.

    >>> from jaxmem.schedule import generate
    >>> r = simulate(generate("1f1b", 4, 8), Costs(f=1, b=2))
    >>> r.makespan, round(r.bubble_fraction, 4), r.peak_inflight
    (33.0, 0.2727, (4, 3, 2, 1))
    """
    costs = costs or Costs()
    validate(schedule)
    walk = _walk(schedule)
    actions = walk.actions
    num_ranks = schedule.num_ranks
    rank_free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    channel_free = [0.0] * num_ranks
    exposed = [0.0] * num_ranks
    transfer_busy = [0.0] * num_ranks
    start = [0.0] * len(actions)  # by position in the walk
    finish = [0.0] * len(actions)
    offload_end: dict[tuple[int, int], float] = {}
    prefetch: dict[tuple[int, int], tuple[float, float]] = {}
    fetched: dict[int, float] = {}  # when an action's fetch from host ends
    durations: dict = {}  # per (kind, stage) when costs has no per-action extra

    def duration_of(action: Action) -> float:
        if costs.extra is not None:
            return costs.duration(action, schedule)
        key = (action.kind, action.stage)
        if key not in durations:
            durations[key] = costs.duration(action, schedule)
        return durations[key]

    def transfer_seconds(stage: int, mb: int) -> float:
        if costs.offload_fn is None:
            return 0.0
        return float(costs.offload_fn(stage, mb)) / costs.host_bandwidth

    def fetch(i: int, rank: int, requested: float) -> None:
        seconds = float(costs.fetch_fn(actions[i])) / costs.host_bandwidth if costs.fetch_fn is not None else 0.0
        if seconds > 0:
            begin = max(requested, channel_free[rank])
            fetched[i] = channel_free[rank] = begin + seconds
            transfer_busy[rank] += seconds

    seen_ranks: set[int] = set()
    comm = costs.comm
    for i, (action, rank, deps, nxt) in enumerate(zip(actions, walk.ranks, walk.deps, walk.following)):
        if rank not in seen_ranks:  # the rank's first action: its fetch is requested at the start
            seen_ranks.add(rank)
            fetch(i, rank, 0.0)
        ready = rank_free[rank]
        for d, hops in deps:
            ready = max(ready, finish[d] + comm if hops else finish[d])
        key = (action.stage, action.microbatch)
        arrived = fetched.get(i, 0.0)
        if action.kind in (Kind.B, Kind.I) and key in prefetch:
            arrived = max(arrived, prefetch[key][1])
        if arrived > ready:
            exposed[rank] += arrived - ready
            ready = arrived
        duration = duration_of(action)
        start[i] = ready
        finish[i] = ready + duration
        rank_free[rank] = ready + duration
        busy[rank] += duration
        # The prefetch for the next action is requested when this one starts (it overlaps this
        # action), before this action's own offload, which is requested when it ends.
        if nxt >= 0:
            following = actions[nxt]
            nkey = (following.stage, following.microbatch)
            if following.kind in (Kind.B, Kind.I) and nkey in offload_end:
                seconds = transfer_seconds(*nkey)
                begin = max(ready, channel_free[rank], offload_end[nkey])
                prefetch[nkey] = (begin, begin + seconds)
                channel_free[rank] = begin + seconds
                transfer_busy[rank] += seconds
            fetch(nxt, rank, ready)
        if action.kind is Kind.F:
            seconds = transfer_seconds(*key)
            if seconds > 0:
                begin = max(finish[i], channel_free[rank])
                offload_end[key] = begin + seconds
                channel_free[rank] = begin + seconds
                transfer_busy[rank] += seconds
    origin = 0.0  # the step starts at 0 (a first action may wait for its weights from host)
    makespan = max(finish, default=0.0) - origin
    total = schedule.num_ranks * makespan
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0

    timelines, peaks, timelines_bytes, peaks_bytes = [], [], [], []
    for rank in range(schedule.num_ranks):
        events: list[tuple[float, int, float]] = []  # (time, +1/-1, bytes)
        for i, freed_by in walk.forwards[rank]:
            action = actions[i]
            key = (action.stage, action.microbatch)
            size = costs.activation_size(action.stage, action.microbatch, schedule)
            events.append((start[i], +1, size))
            events.append((finish[freed_by], -1, -size))
            if key in prefetch:
                moved = min(float(costs.offload_fn(*key)), size)
                events.append((offload_end[key], 0, -moved))
                events.append((prefetch[key][0], 0, moved))
        events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same instant
        live, live_bytes, peak, peak_bytes = 0, 0.0, 0, 0.0
        points, points_bytes = [(0.0, 0)], [(0.0, 0.0)]
        for time, delta, size in events:
            live += delta
            live_bytes += size
            peak = max(peak, live)
            peak_bytes = max(peak_bytes, live_bytes)
            points.append((time - origin, live))
            points_bytes.append((time - origin, live_bytes))
        timelines.append(tuple(points))
        peaks.append(peak)
        timelines_bytes.append(tuple(points_bytes))
        peaks_bytes.append(peak_bytes)
    has_bytes = costs.tracks_bytes
    return SimulationResult(
        schedule=schedule,
        makespan=makespan,
        bubble_fraction=bubble,
        busy=tuple(busy),
        start=dict(zip(actions, start)),
        finish=dict(zip(actions, finish)),
        timeline=tuple(timelines),
        peak_inflight=tuple(peaks),
        timeline_bytes=tuple(timelines_bytes) if has_bytes else None,
        peak_activation_bytes=tuple(peaks_bytes) if has_bytes else None,
        exposed_transfer=tuple(exposed),
        transfer_busy=tuple(transfer_busy),
    )
