"""Checks that a schedule is complete, placed consistently, and runs without deadlock."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

from jaxmem.schedule._action import Action, Kind
from jaxmem.schedule._table import Schedule, ScheduleError, dependencies, position_index

__all__ = ["validate", "lockstep_ticks"]


def validate(schedule: Schedule) -> Schedule:
    """Check a schedule; return it unchanged when it is valid.

    Checks, in order: every stage lives on one rank (the one ``stage_to_rank`` names); every stage
    runs F once per microbatch and then either one B or one I followed by one W (or, in a
    forward-only table, no backward at all: :func:`~jaxmem.schedule.forward_only`); every action's inputs
    are produced by an earlier action (across stages: F(s-1) before F(s), the input-gradient of s+1
    before the backward of s); and the per-rank orders together do not deadlock.

    Raises:
        ScheduleError: naming the rank, the step, the broken rule, and a fix; its message includes the
            table with the offending cell bracketed.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate() takes a Schedule, got {type(schedule).__name__}")
    schedule._memo("_valid", lambda: _check(schedule))  # checked once: a Schedule is immutable
    return schedule


def _check(schedule: Schedule) -> bool:
    _check_placement(schedule)
    _check_completeness(schedule)
    lockstep_ticks(schedule)
    return True


def _check_placement(schedule: Schedule) -> None:
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    for stage, rank in enumerate(schedule.stage_to_rank):
        if not 0 <= rank < num_ranks:
            raise ScheduleError(
                f"stage {stage} is mapped to rank {rank}, but the schedule has ranks 0..{num_ranks - 1}",
                schedule=schedule,
                fix="give every stage a rank that has a row in the table",
            )
    seen_stages = set()
    for rank, row in enumerate(schedule.ranks):
        for step, action in enumerate(row):
            if action is None:
                continue
            if action.stage >= num_stages:
                raise ScheduleError(
                    f"{action} runs stage {action.stage}, but the stage -> rank map only has stages "
                    f"0..{num_stages - 1}",
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"add stage {action.stage} to the stage -> rank map, or fix the stage number",
                )
            owner = schedule.stage_to_rank[action.stage]
            if owner != rank:
                raise ScheduleError(
                    f"{action} runs stage {action.stage} on rank {rank}, but stage {action.stage} lives "
                    f"on rank {owner}; every stage lives on one rank (its weights are there)",
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"move {action} to rank {owner}'s row",
                )
            seen_stages.add(action.stage)
    for stage in range(num_stages):
        if stage not in seen_stages:
            raise ScheduleError(
                f"stage {stage} has no actions at all",
                schedule=schedule,
                rank=schedule.stage_to_rank[stage],
                fix=f"add the F and B actions of stage {stage} to rank {schedule.stage_to_rank[stage]}",
            )


def _check_completeness(schedule: Schedule) -> None:
    where = position_index(schedule)
    for action, places in where.items():
        if len(places) > 1:
            rank, step = places[1]
            first_rank, first_step = places[0]
            raise ScheduleError(
                f"{action} appears twice (first at rank {first_rank}, step {first_step}); each stage runs "
                "each kind once per microbatch",
                schedule=schedule,
                rank=rank,
                step=step,
                fix=f"remove one of the two {action}",
            )

    def at(action: Action) -> tuple[int, int]:
        return where[action][0]

    num_mb = schedule.num_microbatches
    for stage in range(schedule.num_stages):
        for mb in range(num_mb):
            f, b, i, w = (Action(stage, k, mb) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
            has = {k: a in where for k, a in zip("FBIW", (f, b, i, w))}
            if has["B"] and (has["I"] or has["W"]):
                other = i if has["I"] else w
                raise ScheduleError(
                    f"stage {stage} microbatch {mb} has both a full backward {b} and a split one ({other})",
                    schedule=schedule,
                    rank=at(other)[0],
                    step=at(other)[1],
                    fix=f"use either {b}, or {i} followed by {w}",
                )
            backward = b if has["B"] else i if has["I"] else w if has["W"] else None
            if not has["F"]:
                rank, step = at(backward) if backward else (schedule.stage_to_rank[stage], None)
                raise ScheduleError(
                    f"stage {stage} never runs the forward {f} of microbatch {mb}"
                    + (f", but runs {backward}" if backward else ""),
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"add {f} to rank {schedule.stage_to_rank[stage]}"
                    + (f" before {backward}" if backward else ""),
                )
            if backward is None and not schedule.forward_only:
                rank, step = at(f)
                raise ScheduleError(
                    f"{f} has no backward: stage {stage} never runs {b} (or {i} and {w}) for microbatch {mb}",
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"add {b} on rank {rank} after {f}",
                )
            if has["I"] and not has["W"]:
                rank, step = at(i)
                raise ScheduleError(
                    f"{i} computes the input-gradient but the weight-gradient {w} never runs",
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"add {w} on rank {rank} after {i}",
                )
            if has["W"] and not has["I"]:
                rank, step = at(w)
                raise ScheduleError(
                    f"{w} computes the weight-gradient but the input-gradient {i} never runs",
                    schedule=schedule,
                    rank=rank,
                    step=step,
                    fix=f"add {i} on rank {rank} before {w}, or replace {w} by the full backward {b}",
                )


def lockstep_ticks(schedule: Schedule) -> Mapping[Action, int]:
    """Run the per-rank orders in lockstep: each tick, every rank runs its next action if all of that
    action's inputs were produced in an earlier tick. Returns the tick of every action (read-only;
    cached per schedule, since planners ask for the same schedules many times).

    This is the timing the executor uses (one action per rank per tick, results exchanged between
    ticks) and the deadlock check of :func:`validate`.

    Raises:
        ScheduleError: when no rank can make progress, with the chain of waits that blocks it.
    """
    return _lockstep_ticks(schedule)


@functools.lru_cache(maxsize=512)
def _lockstep_ticks(schedule: Schedule) -> Mapping[Action, int]:
    return types.MappingProxyType(_run_lockstep(schedule))


def _run_lockstep(schedule: Schedule) -> dict[Action, int]:
    compact = [schedule.actions(r) for r in range(schedule.num_ranks)]
    present = set(schedule.actions())
    deps = {a: dependencies(a, schedule, present) for a in present}
    heads = [0] * schedule.num_ranks
    done: dict[Action, int] = {}
    remaining = len(present)
    tick = 0
    while remaining:
        progressed = []
        for rank, row in enumerate(compact):
            if heads[rank] < len(row):
                action = row[heads[rank]]
                if all(done.get(d, tick) < tick for d in deps[action]):
                    progressed.append((rank, action))
        if not progressed:
            _raise_deadlock(schedule, compact, heads, done, deps)
        for rank, action in progressed:
            done[action] = tick
            heads[rank] += 1
        remaining -= len(progressed)
        tick += 1
    return done


def _raise_deadlock(schedule, compact, heads, done, deps) -> None:
    where = position_index(schedule)
    present = set(where)

    def blocker(rank: int) -> tuple[Action, Action]:
        action = compact[rank][heads[rank]]
        missing = next(d for d in deps[action] if d not in done)
        return action, missing

    # A missing dependency that is not in the schedule at all was caught by the completeness check, so
    # every missing dependency sits somewhere in a rank's row: follow the waits until they close a loop.
    start = next(r for r in range(len(compact)) if heads[r] < len(compact[r]))
    chain, seen, rank = [], set(), start
    while rank not in seen:
        seen.add(rank)
        action, missing = blocker(rank)
        chain.append((rank, action, missing))
        assert missing in present, "completeness check missed a dependency"
        rank = where[missing][0][0]
    first = next(i for i, (r, _, _) in enumerate(chain) if r == rank)
    loop = chain[first:]
    rank0, action0, missing0 = loop[0]
    step0 = where[action0][0][1]
    owner_rank, owner_step = where[missing0][0]
    if owner_rank == rank0:
        reason = f"{action0} needs {missing0}, which rank {rank0} only runs later, at step {owner_step}"
        fix = f"move {missing0} before {action0} on rank {rank0}"
    else:
        hops = []
        for r, a, m in loop:
            mr, ms = where[m][0]
            hops.append(f"{a} (rank {r}, step {where[a][0][1]}) waits for {m} (rank {mr}, step {ms})")
        reason = "deadlock: " + "; ".join(hops) + "; no rank can move"
        r1, a1, m1 = loop[-1]
        head = compact[where[m1][0][0]][heads[where[m1][0][0]]]
        fix = (
            f"on rank {where[m1][0][0]}, run {m1} before {head}"
            if head != m1
            else f"reorder rank {rank0} so that {action0} comes after the actions it waits for"
        )
    raise ScheduleError(reason, schedule=schedule, rank=rank0, step=step0, fix=fix)
