"""Schedule generators: pure functions of integers that return validated, time-aligned tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxmem.schedule._action import Action, Kind
from jaxmem.schedule._table import Schedule, ScheduleError
from jaxmem.schedule._validate import lockstep_ticks, validate

__all__ = [
    "GeneratorInfo",
    "align",
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


def _finish(name: str, orders: Sequence[Sequence[Action]], stage_to_rank: Sequence[int]) -> Schedule:
    schedule = Schedule(orders, stage_to_rank=tuple(stage_to_rank), name=name)
    return align(validate(schedule))


def gpipe(pipe: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards. Holds all M activations per rank.

    >>> s = gpipe(2, 2)
    >>> [str(a) for a in s.actions(0)]
    ['0F0', '0F1', '0B0', '0B1']
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

    >>> [str(a) for a in one_f_one_b(2, 3).actions(0)]
    ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
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
) -> Schedule:
    """A list scheduler in lockstep ticks with unit-time actions, under a per-rank activation limit.

    Each tick every rank picks, among the actions whose inputs are ready, the one with the smallest
    ``priority(action, rank)``; a forward is only eligible while the rank holds fewer than
    ``inflight_limit[rank]`` stage-microbatch activations (counted from F until the backward that
    frees them: W when the backward is split, B otherwise). This is the automatic-scheduling idea of
    the zero-bubble paper (arXiv 2401.10241, section 3) reduced to a heuristic; our reconstruction.
    """
    num_stages = len(stage_to_rank)
    last = num_stages - 1
    bwd = Kind.I if split_backward else Kind.B
    free_kind = Kind.W if split_backward else Kind.B
    stages_of = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(pipe)]
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
                if m < microbatches and inflight[r] < inflight_limit[r]:
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


def generate(name: str, pipe: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """Build a registered schedule by name.

    >>> generate("1F1B", 4, 8).num_stages
    4
    >>> generate("interleaved-1f1b", 4, 8, virtual=2).num_stages
    8
    """
    info = get_generator(name)
    if info.takes_virtual:
        return info.fn(pipe, microbatches, virtual if virtual is not None else info.default_virtual)
    if virtual not in (None, info.default_virtual):
        raise ScheduleError(
            f"schedule {info.name!r} does not take --virtual (it uses {info.default_virtual} "
            f"stage(s) per rank); drop --virtual {virtual} or use interleaved-1f1b"
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
