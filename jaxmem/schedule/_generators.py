"""Schedule generators: pure functions of integers that return validated, time-aligned tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxmem._errors import setting
from jaxmem.schedule._action import Action, Kind
from jaxmem.schedule._table import Schedule, ScheduleError
from jaxmem.schedule._validate import lockstep_ticks, validate

__all__ = [
    "GeneratorInfo",
    "align",
    "chronos",
    "forward_only",
    "v_half",
    "v_min",
    "generate",
    "get_generator",
    "gpipe",
    "greedy_schedule",
    "interleaved_1f1b",
    "list_generators",
    "one_f_one_b",
    "register",
    "v_shape_stage_to_rank",
    "zb_h1",
    "zbv",
]


def _check_sizes(name: str, pipe: int, microbatches: int, virtual: int = 1) -> None:
    for label, value in (("stages (P)", pipe), ("microbatches (M)", microbatches), ("virtual (V)", virtual)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScheduleError(f"{name}: {label} must be an integer, got {value!r}")
        if value < 1:
            raise ScheduleError(f"{name}: {label} must be >= 1, got {value}")


def align(schedule: Schedule) -> Schedule:
    """Place every action in the column of its lockstep tick, idle cells in between.

    The result runs identically (same per-rank order) and reads as a Gantt chart in text.
    """
    ticks = lockstep_ticks(schedule)
    rows = []
    for rank in range(schedule.num_ranks):
        actions = schedule.actions(rank)
        row: list[Action | None] = [None] * (1 + max((ticks[a] for a in actions), default=-1))
        for a in actions:
            row[ticks[a]] = a
        rows.append(row)
    return dataclasses.replace(schedule, ranks=rows)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule``'s stages, on the ranks that hold them, for every microbatch: what
    an evaluation runs (the loss of every microbatch, no gradients, nothing kept for a backward).

    Nothing waits for a backward, so the order is made anew, greedily: at each tick every rank runs
    the deepest of its stages whose input is ready (draining microbatches before it starts new
    ones), each stage taking the microbatches in order. A plain pipeline of P ranks takes M + P - 1
    ticks, an interleaved one V x M + P - 1, a V-shape (ZBV) V x M + 2 (P - 1).

    >>> forward_only(generate("1f1b", 2, 2)).rows_as_text()
    [['0F0', '0F1'], ['', '1F0', '1F1']]
    """
    validate(schedule)
    num_stages, M = schedule.num_stages, schedule.num_microbatches
    done: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> tick
    next_mb = [0] * num_stages
    orders: list[list[Action]] = [[] for _ in range(schedule.num_ranks)]
    tick = 0
    while any(m < M for m in next_mb):
        for rank, order in enumerate(orders):
            ready = [
                s
                for s in schedule.stages_of(rank)
                if next_mb[s] < M and (s == 0 or done.get((s - 1, next_mb[s]), tick) < tick)
            ]
            if ready:
                s = max(ready)
                order.append(Action(s, Kind.F, next_mb[s]))
                done[(s, next_mb[s])] = tick
                next_mb[s] += 1
        tick += 1
    return _finish(f"{schedule.name} (forward only)", orders, schedule.stage_to_rank)


def _finish(name: str, orders: Sequence[Sequence[Action]], stage_to_rank: Sequence[int]) -> Schedule:
    schedule = Schedule(orders, stage_to_rank=tuple(stage_to_rank), name=name)
    return align(validate(schedule))


def gpipe(pipe: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards. Holds all M activations per rank.

    >>> s = gpipe(2, 2)
    >>> " ".join(str(a) for a in s.actions(0))
    '0F0 0F1 0B0 0B1'
    """
    _check_sizes("gpipe", pipe, microbatches)
    orders = [
        [Action(r, Kind.F, m) for m in range(microbatches)] + [Action(r, Kind.B, m) for m in range(microbatches)]
        for r in range(pipe)
    ]
    return _finish("gpipe", orders, range(pipe))


def one_f_one_b(pipe: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): P - r - 1 warm-up forwards on rank r, then one forward and one backward
    alternately. Rank r holds at most P - r activations.

    >>> " ".join(str(a) for a in one_f_one_b(2, 3).actions(0))
    '0F0 0F1 0B0 0F2 0B1 0B2'
    """
    _check_sizes("1f1b", pipe, microbatches)
    orders = []
    for r in range(pipe):
        warmup = min(pipe - r - 1, microbatches)
        order = [Action(r, Kind.F, m) for m in range(warmup)]
        for m in range(warmup, microbatches):
            order += [Action(r, Kind.F, m), Action(r, Kind.B, m - warmup)]
        order += [Action(r, Kind.B, m) for m in range(microbatches - warmup, microbatches)]
        orders.append(order)
    return _finish("1f1b", orders, range(pipe))


def interleaved_1f1b(pipe: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B: each rank holds V model chunks (stage ``v*P + r`` on rank r),
    microbatches go through the chunks in groups of P. Smaller bubble than 1F1B (by about 1/V), more
    activations in flight. Needs M divisible by P.
    """
    _check_sizes("interleaved-1f1b", pipe, microbatches, virtual)
    if virtual == 1:
        return dataclasses.replace(one_f_one_b(pipe, microbatches), name="interleaved-1f1b")
    if microbatches % pipe:
        ok = ", ".join(str(pipe * k) for k in range(1, 5))
        raise ScheduleError(
            f"interleaved-1f1b needs microbatches divisible by the stages: M={microbatches} is not a "
            f"multiple of P={pipe}; use M in {ok}, ..."
        )
    total = microbatches * virtual
    stage_to_rank = [s % pipe for s in range(pipe * virtual)]
    orders = []
    for r in range(pipe):

        def chunk_action(k: int, kind: Kind, r=r) -> Action:
            group = (k // pipe) % virtual
            chunk = group if kind is Kind.F else virtual - 1 - group
            mb = (k // (pipe * virtual)) * pipe + k % pipe
            return Action(chunk * pipe + r, kind, mb)

        warmup = min((pipe - r - 1) * 2 + (virtual - 1) * pipe, total)
        order = [chunk_action(k, Kind.F) for k in range(warmup)]
        for k in range(warmup, total):
            order += [chunk_action(k, Kind.F), chunk_action(k - warmup, Kind.B)]
        order += [chunk_action(k, Kind.B) for k in range(total - warmup, total)]
        orders.append(order)
    return _finish("interleaved-1f1b", orders, stage_to_rank)


def v_shape_stage_to_rank(pipe: int, virtual: int = 2) -> tuple[int, ...]:
    """Stage -> rank for a V (zig-zag) placement: down the ranks, back up, down again, ...

    With V=2 rank r owns stages r and 2P-1-r, so rank 0 holds both the first and the last stage.
    """
    placement = []
    for chunk in range(virtual):
        ranks = range(pipe) if chunk % 2 == 0 else range(pipe - 1, -1, -1)
        placement.extend(ranks)
    return tuple(placement)


# Priorities used by the greedy list scheduler. Lower sorts first.
Priority = Callable[[Action, int], tuple]


def greedy_schedule(
    name: str,
    pipe: int,
    microbatches: int,
    stage_to_rank: Sequence[int],
    inflight_limit: Sequence[int],
    priority: Priority,
    split_backward: bool = True,
    reserve: bool = False,
) -> Schedule:
    """A list scheduler in lockstep ticks with unit-time actions, under a per-rank activation limit.

    Each tick every rank picks, among the actions whose inputs are ready, the one with the smallest
    ``priority(action, rank)``; a forward is only eligible while the rank holds fewer than
    ``inflight_limit[rank]`` stage-microbatch activations (counted from F until the backward that
    frees them: W when the backward is split, B otherwise). This is the automatic-scheduling idea of
    the zero-bubble paper (arXiv 2401.10241, section 3) reduced to a heuristic; our reconstruction.

    With ``reserve``, a microbatch's first forward on a rank also reserves room for its later stages
    on that rank (V-shape), so a rank never fills up with first chunks whose second chunks cannot run.
    """
    num_stages = len(stage_to_rank)
    last = num_stages - 1
    bwd = Kind.I if split_backward else Kind.B
    free_kind = Kind.W if split_backward else Kind.B
    stages_of = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(pipe)]
    later_here = {
        s: sum(1 for t in range(s, num_stages) if stage_to_rank[t] == stage_to_rank[s]) for s in range(num_stages)
    }
    reserved = [0] * pipe
    done: dict[Action, int] = {}
    orders: list[list[Action]] = [[] for _ in range(pipe)]
    inflight = [0] * pipe
    next_f = {s: 0 for s in range(num_stages)}
    pending_w: list[list[Action]] = [[] for _ in range(pipe)]
    bwd_ready: list[set] = [set() for _ in range(pipe)]
    total = num_stages * microbatches * (3 if split_backward else 2)
    tick, count, idle_ticks = 0, 0, 0

    def ready(dep: Action) -> bool:
        return done.get(dep, tick) < tick

    while count < total:
        chosen = []
        for r in range(pipe):
            candidates = []
            for s in stages_of[r]:
                m = next_f[s]
                if reserve:
                    opens = s == stages_of[r][0]
                    room = inflight[r] + reserved[r] + (later_here[s] if opens else 0) <= inflight_limit[r]
                else:
                    room = inflight[r] < inflight_limit[r]
                if m < microbatches and room:
                    a = Action(s, Kind.F, m)
                    if s == 0 or ready(Action(s - 1, Kind.F, m)):
                        candidates.append(a)
            for a in bwd_ready[r]:
                nxt = Action(a.stage + 1, bwd, a.microbatch)
                if ready(Action(a.stage, Kind.F, a.microbatch)) and (a.stage == last or ready(nxt)):
                    candidates.append(a)
            for a in pending_w[r]:
                if ready(Action(a.stage, Kind.I, a.microbatch)):
                    candidates.append(a)
            if candidates:
                chosen.append((r, min(candidates, key=lambda a, r=r: priority(a, r))))
        if not chosen:
            idle_ticks += 1
            if idle_ticks > 2 * num_stages + 2:
                raise ScheduleError(
                    f"{name}: no schedule found with in-flight limits {list(inflight_limit)} for "
                    f"P={pipe}, M={microbatches}; raise the limits"
                )
        else:
            idle_ticks = 0
        for r, a in chosen:
            done[a] = tick
            orders[r].append(a)
            count += 1
            if a.kind is Kind.F:
                inflight[r] += 1
                next_f[a.stage] += 1
                if reserve:
                    reserved[r] += later_here[a.stage] - 1 if a.stage == stages_of[r][0] else -1
                bwd_ready[r].add(Action(a.stage, bwd, a.microbatch))
            elif a.kind is bwd:
                bwd_ready[r].discard(a)
                if split_backward:
                    pending_w[r].append(Action(a.stage, Kind.W, a.microbatch))
            if a.kind is free_kind:
                inflight[r] -= 1
                if split_backward:
                    pending_w[r].remove(a)
        tick += 1
    return _finish(name, orders, stage_to_rank)


def zb_h1(pipe: int, microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (arXiv 2401.10241): the backward split into I and W; I runs as early as
    possible and W fills what would be bubbles, under 1F1B's activation limit (P - r on rank r).
    """
    _check_sizes("zb-h1", pipe, microbatches)

    def priority(a: Action, rank: int) -> tuple:
        return ({Kind.I: 0, Kind.F: 1, Kind.W: 2}[a.kind], a.microbatch)

    limits = [pipe - r for r in range(pipe)]
    return greedy_schedule("zb-h1", pipe, microbatches, range(pipe), limits, priority)


def zbv(pipe: int, microbatches: int) -> Schedule:
    """Zero-bubble V (ZB-V, arXiv 2401.10241 section 6): two chunks per rank in a V placement (rank r
    owns stages r and 2P-1-r), split backward, and the same activation memory as 1F1B: 2P half-size
    chunk activations per rank. Backward input-gradients first, later chunks before earlier ones.
    """
    _check_sizes("zbv", pipe, microbatches)
    stage_to_rank = v_shape_stage_to_rank(pipe, 2)

    def priority(a: Action, rank: int) -> tuple:
        kind_rank = {Kind.I: 0, Kind.F: 1, Kind.W: 2}[a.kind]
        # Later stages first among F (finish microbatches), earlier among I (hand gradients on).
        order = -a.stage if a.kind is Kind.F else a.stage
        return (kind_rank, a.microbatch, order)

    limits = [2 * pipe] * pipe
    return greedy_schedule("zbv", pipe, microbatches, stage_to_rank, limits, priority)


def _v_limited(name: str, pipe: int, microbatches: int, limit_units: int) -> Schedule:
    _check_sizes(name, pipe, microbatches)

    def priority(a: Action, rank: int) -> tuple:
        return ({Kind.I: 0, Kind.F: 1, Kind.W: 2}[a.kind], a.microbatch, -a.stage if a.kind is Kind.F else a.stage)

    limits = [max(2 * limit_units, 2)] * pipe  # half-size chunks
    return greedy_schedule(name, pipe, microbatches, v_shape_stage_to_rank(pipe, 2), limits, priority, reserve=True)


def v_half(pipe: int, microbatches: int) -> Schedule:
    """V-Half baseline: a V-shape zero-bubble schedule under V-Half's activation limit of (P+2)//2
    stage-activations per rank ("Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).
    Built by our greedy list scheduler at that limit, not by the paper's building blocks."""
    return _v_limited("v-half", pipe, microbatches, (pipe + 2) // 2)


def v_min(pipe: int, microbatches: int) -> Schedule:
    """V-Min baseline: as :func:`v_half` under V-Min's limit of (P+4)//3 stage-activations per rank."""
    return _v_limited("v-min", pipe, microbatches, (pipe + 4) // 3)


def chronos(pipe: int, microbatches: int) -> Schedule:
    """Chronos-Pipe (our design after ChronosPipe, arXiv 2503.03182): a V-shape schedule that keeps every
    microbatch's activations alive only as long as its own dependency chain needs.

    Ranks own stages r and 2P-1-r (two half-size chunks). Every microbatch runs as one unbroken chain
    -- down the ranks (chunk 0 forward), back up (chunk 1 forward), down again (chunk 1 input-gradient)
    and up (chunk 0 input-gradient) -- one chunk-time per hop, and a new microbatch enters every 6
    chunk-times, the work one microbatch brings to each rank (F, I, W of two chunks). Rank r then
    runs microbatch m's four chain actions at 6m + {r, 2P-1-r, 2P+g+r, 4P-1+g-r}: all different
    modulo 6 when 2P+g is not a multiple of 6 (g = 0, or 2 when P is a multiple of 3), so chains tile
    without collisions and the steady state has no bubble. Weight-gradients go in the first free slot
    after their input-gradient, which frees the activation as early as possible.

    With F = I = W, a rank holds about (2P + 1) / 3 half-size chunk activations -- at most half of
    1F1B's P on the worst rank for P >= 4, matching V-Min's memory (arXiv 2405.15362) -- and its
    makespan beats 1F1B's (warm-up of about 2P chunk-times instead of 1F1B's 3(P-1) stage-times).
    The exact published ordering was not available; this construction is ours.
    """
    _check_sizes("chronos", pipe, microbatches)
    gap = 0 if (2 * pipe) % 6 else 2
    placed: list[dict[int, Action]] = [{} for _ in range(pipe)]

    def put(rank: int, slot: int, action: Action) -> int:
        while slot in placed[rank]:
            slot += 1
        placed[rank][slot] = action
        return slot

    last = 2 * pipe - 1
    for m in range(microbatches):
        base = 6 * m
        for r in range(pipe):
            put(r, base + r, Action(r, Kind.F, m))
            put(r, base + 2 * pipe - 1 - r, Action(last - r, Kind.F, m))
            put(r, base + 2 * pipe + gap + r, Action(last - r, Kind.I, m))
            put(r, base + 4 * pipe - 1 + gap - r, Action(r, Kind.I, m))
    for r in range(pipe):
        for slot, action in sorted((t, a) for t, a in placed[r].items() if a.kind is Kind.I):
            put(r, slot + 1, Action(action.stage, Kind.W, action.microbatch))
    orders = [[a for _, a in sorted(placed[r].items())] for r in range(pipe)]
    return _finish("chronos", orders, v_shape_stage_to_rank(pipe, 2))


@dataclasses.dataclass(frozen=True)
class GeneratorInfo:
    """A registered schedule generator.

    Attributes:
        name: the registry key (lower case).
        fn: ``fn(pipe, microbatches[, virtual])`` -> Schedule.
        description: one line for ``jaxmem schedule list``.
        takes_virtual: whether ``--virtual V`` is meaningful.
        default_virtual: the virtual stages per rank it uses when not told.
    """

    name: str
    fn: Callable[..., Schedule]
    description: str
    takes_virtual: bool = False
    default_virtual: int = 1


_REGISTRY: dict[str, GeneratorInfo] = {}


def register(info: GeneratorInfo) -> GeneratorInfo:
    """Add a generator to the registry (names are case-insensitive)."""
    _REGISTRY[info.name.lower()] = info
    return info


def list_generators() -> list[GeneratorInfo]:
    """All registered generators, in registration order."""
    return list(_REGISTRY.values())


def get_generator(name: str) -> GeneratorInfo:
    """Look up a generator by name, case-insensitively (``_`` and ``-`` are the same).

    Raises:
        ScheduleError: an unknown name, listing the valid ones.
    """
    key = str(name).strip().lower().replace("_", "-")
    if key in _REGISTRY:
        return _REGISTRY[key]
    valid = ", ".join(_REGISTRY)
    raise ScheduleError(f"unknown schedule {name!r}; valid names: {valid}")


# Tables beyond this many actions take minutes to build and validate, and cannot be read.
MAX_ACTIONS = 2_000_000


def generate(name: str, pipe: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """Build a registered schedule by name (refused, before any work, when its table would hold more
    than :data:`MAX_ACTIONS` actions).

    >>> generate("1F1B", 4, 8).num_stages
    4
    >>> generate("interleaved-1f1b", 4, 8, virtual=2).num_stages
    8
    """
    info = get_generator(name)
    for what, value in (("pipe", pipe), ("microbatches", microbatches), ("virtual", virtual)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ScheduleError(f"{setting(what)} must be an integer >= 1, got {value!r}")
    actions = 3 * pipe * (virtual or info.default_virtual or 1) * microbatches
    if actions > MAX_ACTIONS:
        raise ScheduleError(
            f"{setting('pipe', pipe)} x {setting('microbatches', microbatches)} makes a schedule of about "
            f"{actions:,} actions, more than {MAX_ACTIONS:,} (it would take minutes to build and check); use fewer "
            "stages or microbatches"
        )
    if info.takes_virtual:
        return info.fn(pipe, microbatches, virtual if virtual is not None else info.default_virtual)
    if virtual not in (None, info.default_virtual):
        raise ScheduleError(
            f"schedule {info.name!r} does not take {setting('virtual')} (it uses {info.default_virtual} "
            f"stage(s) per rank); drop {setting('virtual', virtual)} or use interleaved-1f1b"
        )
    return info.fn(pipe, microbatches)


register(GeneratorInfo("gpipe", gpipe, "all forwards, then all backwards (M activations per rank)"))
register(GeneratorInfo("1f1b", one_f_one_b, "one forward, one backward (P - r activations on rank r)"))
register(
    GeneratorInfo(
        "interleaved-1f1b",
        interleaved_1f1b,
        "Megatron's virtual pipeline: V chunks per rank, smaller bubble (M % P == 0)",
        takes_virtual=True,
        default_virtual=2,
    )
)
register(GeneratorInfo("zb-h1", zb_h1, "zero-bubble H1: split backward (I/W), 1F1B's memory"))
register(GeneratorInfo("zbv", zbv, "zero-bubble V: V-shape 2 chunks per rank, split backward", default_virtual=2))
register(
    GeneratorInfo(
        "chronos",
        chronos,
        "ChronosPipe (our design): V-shape chains, ~(2P+1)/3 half-chunks live, beats 1F1B",
        default_virtual=2,
    )
)
register(GeneratorInfo("v-half", v_half, "baseline: V-shape under V-Half's memory (P+2)//2", default_virtual=2))
register(GeneratorInfo("v-min", v_min, "baseline: V-shape under V-Min's memory (P+4)//3", default_virtual=2))
