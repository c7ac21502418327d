"""A pipeline schedule as a value: per rank, the ordered list of actions, plus the stage -> rank map."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxmem._errors import JaxmemError
from jaxmem.schedule._action import Action, ActionParseError, Kind

__all__ = ["Schedule", "ScheduleError", "format_table"]


Cell = Action | None


def _to_cell(value) -> Cell:
    if value is None or isinstance(value, Action):
        return value
    if isinstance(value, str):
        return None if value.strip() == "" else Action.parse(value)
    raise ActionParseError(f"a schedule cell must be an Action, its text or empty, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ordered actions it runs (``None`` = an idle cell), and where stages live.

    A rank may own several stages (interleaved and V-shape schedules). Idle cells carry no meaning for
    execution order -- each rank runs its actions in list order, waiting for their inputs -- but they
    are kept so that a table aligned in time reads well and round-trips through CSV exactly.

    Args:
        ranks: one sequence per rank of actions, action text (``"2F0"``) or ``None``/``""`` for idle.
        stage_to_rank: for each stage, the rank that owns it. Inferred from the actions when omitted.
        name: a label for display; not part of equality.

    >>> s = Schedule([["0F0", "0B0"]], name="one")
    >>> s.num_ranks, s.num_stages, s.num_microbatches
    (1, 1, 1)
    """

    ranks: tuple[tuple[Cell, ...], ...]
    stage_to_rank: tuple[int, ...] | None = None
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        if isinstance(self.ranks, str) or not isinstance(self.ranks, Iterable):
            raise TypeError("Schedule(ranks=...) takes one sequence of actions per rank")
        ranks = tuple(tuple(_to_cell(c) for c in row) for row in self.ranks)
        if not ranks:
            raise ScheduleError("a schedule needs at least one rank")
        object.__setattr__(self, "ranks", ranks)
        if self.stage_to_rank is None:
            inferred: dict[int, int] = {}
            for rank, row in enumerate(ranks):
                for action in row:
                    if action is not None:
                        inferred.setdefault(action.stage, rank)
            num_stages = max(inferred, default=-1) + 1
            # A stage with no action at all is reported by validate(); give it a rank so the map is total.
            stage_to_rank = tuple(inferred.get(s, 0) for s in range(num_stages))
        else:
            stage_to_rank = tuple(int(r) for r in self.stage_to_rank)
        object.__setattr__(self, "stage_to_rank", stage_to_rank)

    # ------------------------------------------------------------------ shape
    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    # A Schedule is immutable: what planners ask of the same table thousands of times (its actions,
    # microbatch count, hash) is computed once and kept on the instance (not a field: equality and
    # repr are unchanged).
    def _memo(self, name: str, compute):
        value = self.__dict__.get(name)
        if value is None:
            value = compute()
            object.__setattr__(self, name, value)
        return value

    def __hash__(self) -> int:
        return self._memo("_hash", lambda: hash((self.ranks, self.stage_to_rank)))

    def __getstate__(self) -> dict:
        # Without the memos: a string's hash differs between processes, so a kept hash would not travel.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    @property
    def num_microbatches(self) -> int:
        return self._memo("_num_microbatches", lambda: 1 + max((a.microbatch for a in self.actions()), default=-1))

    @property
    def num_steps(self) -> int:
        """Columns of the table (the longest rank's list, idle cells included)."""
        return max((len(row) for row in self.ranks), default=0)

    @property
    def virtual(self) -> int:
        """Stages per rank (1 for plain pipelines, V for interleaved/V-shape); rounded down."""
        return max(1, self.num_stages // self.num_ranks)

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into I (input-gradient) and W (weight-gradient) actions."""
        return any(a.kind in (Kind.I, Kind.W) for a in self.actions())

    @property
    def forward_only(self) -> bool:
        """Whether the table runs forwards only (an evaluation: the loss, no gradients, nothing
        stashed); see :func:`~jaxmem.schedule.forward_only`."""
        return self._memo("_forward_only", lambda: all(a.kind is Kind.F for a in self.actions()))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages owned by ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def actions(self, rank: int | None = None) -> tuple[Action, ...]:
        """The non-idle actions of one rank (in order), or of all ranks when ``rank`` is None."""
        per_rank = self._memo("_actions", lambda: tuple(tuple(a for a in row if a is not None) for row in self.ranks))
        if rank is None:
            return self._memo("_all_actions", lambda: tuple(a for row in per_rank for a in row))
        return per_rank[rank]

    def compact(self) -> Schedule:
        """The same schedule with idle cells removed."""
        return dataclasses.replace(self, ranks=tuple(self.actions(r) for r in range(self.num_ranks)))

    def rows_as_text(self) -> list[list[str]]:
        """The table as text cells (``""`` for idle), as written to CSV."""
        return [["" if c is None else str(c) for c in row] for row in self.ranks]

    def __str__(self) -> str:
        return format_table(self)


def format_table(schedule: Schedule, mark: tuple[int, int] | None = None, max_steps: int | None = None) -> str:
    """Render the table: one row per rank, one column per step; ``mark=(rank, step)`` brackets a cell."""
    rows = schedule.rows_as_text()
    steps = schedule.num_steps
    shown = steps if max_steps is None else min(steps, max_steps)
    if mark is not None and max_steps is not None and mark[1] >= shown:
        shown = min(steps, mark[1] + 1)
    width = max([len(c) for row in rows for c in row] + [len(str(max(shown - 1, 0))), 1]) + 2
    label = len(f"rank {schedule.num_ranks - 1}")
    lines = [" " * label + " |" + "".join(f"{i:>{width}}" for i in range(shown))]
    for rank, row in enumerate(rows):
        cells = []
        for step in range(shown):
            text = row[step] if step < len(row) else ""
            text = text or "."
            if mark == (rank, step):
                text = f"[{text}]"
            cells.append(f"{text:>{width}}")
        lines.append(f"{'rank ' + str(rank):<{label}} |" + "".join(cells))
    if shown < steps:
        lines.append(f"... ({steps - shown} more steps)")
    return "\n".join(lines)


class ScheduleError(JaxmemError):
    """A schedule is malformed or cannot run; says where (rank, step), why, and how to fix it.

    Attributes:
        rank: the rank of the offending cell, when there is one.
        step: its column in the table, when there is one.
        reason: one line saying what is wrong.
        fix: what would fix it.
    """

    def __init__(
        self,
        reason: str,
        *,
        schedule: Schedule | None = None,
        rank: int | None = None,
        step: int | None = None,
        fix: str | None = None,
    ):
        self.reason = reason
        self.rank = rank
        self.step = step
        self.fix = fix
        where = ""
        if rank is not None:
            where = f"rank {rank}" + (f", step {step}" if step is not None else "") + ": "
        parts = [where + reason]
        if fix:
            parts.append(f"fix: {fix}")
        if schedule is not None:
            mark = (rank, step) if rank is not None and step is not None else None
            parts.append(format_table(schedule, mark=mark, max_steps=40))
        super().__init__("\n".join(parts))


def position_index(schedule: Schedule) -> dict[Action, list[tuple[int, int]]]:
    """Where each action occurs: action -> [(rank, step), ...] (more than one entry is a duplicate)."""
    where: dict[Action, list[tuple[int, int]]] = {}
    for rank, row in enumerate(schedule.ranks):
        for step, action in enumerate(row):
            if action is not None:
                where.setdefault(action, []).append((rank, step))
    return where


def dependencies(action: Action, schedule: Schedule, present: Sequence[Action] | set) -> list[Action]:
    """The actions that must finish before ``action`` can start.

    ``present`` is the set of actions of the schedule; it tells whether stage s+1 uses B or I for the
    gradient that stage s waits for.
    """
    s, m = action.stage, action.microbatch
    last = schedule.num_stages - 1
    if action.kind is Kind.F:
        return [Action(s - 1, Kind.F, m)] if s > 0 else []
    if action.kind is Kind.W:
        return [Action(s, Kind.I, m)]
    deps = [Action(s, Kind.F, m)]
    if s < last:
        nxt_i = Action(s + 1, Kind.I, m)
        deps.append(nxt_i if nxt_i in present else Action(s + 1, Kind.B, m))
    return deps
