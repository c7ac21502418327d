"""Lower a schedule to the static tables the executor scans over (pure Python + NumPy, no JAX).

Every rank runs one action per tick (or idles); results move between ticks. For every tick and rank
the table says which branch to run, on which local stage and microbatch, which buffer slots to read
and write, and on which ppermute offset to send the output. Buffer slots are assigned by interval
colouring of the lifetimes the lockstep timing gives, so their number is the schedule's peak, not M.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem.schedule import Action, Kind, Schedule, lockstep_ticks, validate
from jaxmem.schedule._table import ScheduleError

__all__ = ["StageClass", "TickProgram", "build_tick_program"]

KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)


@dataclasses.dataclass(frozen=True)
class StageClass:
    """Stage-microbatches that share one compiled branch: same role (embedding/head), layer count,
    memory-policy variant and local position on their rank."""

    first: bool
    last: bool
    layers: int
    variant: int = 0  # index of the memory policy the stage-microbatch runs under
    local: int = 0  # position of the stage among its rank's stages (selects the weights)

    @property
    def label(self) -> str:
        role = "only" if self.first and self.last else "first" if self.first else "last" if self.last else "mid"
        return f"{role}x{self.layers}@{self.local}" + (f"/p{self.variant}" if self.variant else "")


# Column names of the per-(rank, tick) table.
COLUMNS = (
    "branch",  # 0 = idle, else 1 + index into TickProgram.branches
    "local_stage",  # index of the stage among the rank's stages
    "microbatch",
    "act_in",  # activation slot an F reads (non-first stages)
    "grad_in",  # gradient slot a B/I/W reads (non-last stages)
    "stash",  # stash slot an F writes and its B/I/W read (slot within its class's buffer)
    "send",  # ppermute offset index to send the output on; len(offsets) = none
    "local_act",  # activation slot to write the output into on this rank (V-shape turn), else trash
    "local_grad",  # gradient slot to write the output into on this rank, else trash
)


@dataclasses.dataclass(frozen=True)
class TickProgram:
    """The lowered schedule.

    Attributes:
        schedule: the source schedule.
        num_ticks: length of the scan.
        offsets: the rank offsets ``(dst - src) mod P`` of all messages, one ppermute each per tick.
        classes: the distinct stage classes.
        cell_class: class index of every (stage, microbatch).
        local_stage: index of every stage among its rank's stages.
        branches: ``(class index, kind)`` for every non-idle branch.
        table: ``[P, num_ticks, len(COLUMNS) + 2 * len(offsets)]`` int32; the last columns are, per
            offset, the activation slot and the gradient slot an incoming message is written to.
        act_slots / grad_slots: live slots of the message buffers (index ``act_slots`` is the trash).
        stash_groups: classes that share one stash buffer (each group: a tuple of class indices).
        stash_slots: per group, slots of its stash buffer.
        stash_live: per class and rank, the peak number of stashed items (what the rank really needs).
    """

    schedule: Schedule
    num_ticks: int
    offsets: tuple[int, ...]
    classes: tuple[StageClass, ...]
    cell_class: dict
    local_stage: tuple[int, ...]
    branches: tuple[tuple[int, Kind], ...]
    table: np.ndarray = dataclasses.field(repr=False, compare=False)
    act_slots: int
    grad_slots: int
    stash_groups: tuple[tuple[int, ...], ...]
    stash_slots: tuple[int, ...]
    stash_live: tuple[tuple[int, ...], ...]
    stash_intervals: tuple[tuple[tuple[int, int, int], ...], ...] = dataclasses.field(
        repr=False, compare=False, default=()
    )

    def live_stash_peak(self, rank: int, class_bytes) -> float:
        """Peak over the step of the stash bytes ``rank`` really holds, with ``class_bytes[c]`` bytes
        per item of class ``c`` (an SPMD program allocates more: every rank gets the largest need)."""
        events = sorted(
            [(p, 1, c) for p, _, c in self.stash_intervals[rank]]
            + [(q, -1, c) for _, q, c in self.stash_intervals[rank]],
            key=lambda e: (e[0], e[1]),
        )
        live = peak = 0.0
        for _, sign, c in events:
            live += sign * class_bytes[c]
            peak = max(peak, live)
        return peak

    def group_of(self, class_index: int) -> int:
        return next(g for g, members in enumerate(self.stash_groups) if class_index in members)

    def column(self, name: str) -> int:
        return COLUMNS.index(name)

    def recv_columns(self, offset_index: int) -> tuple[int, int]:
        base = len(COLUMNS) + 2 * offset_index
        return base, base + 1


def cell_classes(schedule: Schedule, layer_counts, policy) -> dict[tuple[int, int], StageClass]:
    """The class of every (stage, microbatch): role, layers, policy variant, local position."""
    S = schedule.num_stages
    local = {s: schedule.stages_of(schedule.stage_to_rank[s]).index(s) for s in range(S)}
    return {
        (s, m): StageClass(
            first=s == 0, last=s == S - 1, layers=layer_counts[s], variant=policy.variant_of[(s, m)], local=local[s]
        )
        for s in range(S)
        for m in range(schedule.num_microbatches)
    }


def _color_intervals(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Assign slots to half-open lifetimes ``(produced, consumed]`` so that overlapping ones differ.

    An item written at the end of tick ``produced`` and read at the start of tick ``consumed`` frees
    its slot for an item written at the end of tick ``consumed``. Greedy by start is optimal for
    interval graphs.
    """
    slot_of, free_at = {}, []  # free_at[slot] = tick from which it can be written again
    for produced, consumed, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for slot, free in enumerate(free_at):
            if free <= produced:
                free_at[slot] = consumed
                slot_of[key] = slot
                break
        else:
            slot_of[key] = len(free_at)
            free_at.append(consumed)
    return slot_of, len(free_at)


def _peak_live(intervals: list[tuple[int, int, object]]) -> int:
    events = sorted([(p, 1) for p, _, _ in intervals] + [(c, -1) for _, c, _ in intervals], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _stash_cost(groups, items, sizes, num_ranks) -> tuple[int, list[int]]:
    """Bytes the stash buffers of a grouping take on every rank, and each group's slot count."""
    total, slots = 0, []
    for group in groups:
        n = max(_peak_live([x for c in group for x in items[(r, c)]]) for r in range(num_ranks))
        dtypes = {dt for c in group for dt in sizes[c]}
        width = sum(max(sizes[c].get(dt, 0) for c in group) for dt in dtypes)
        total += n * width
        slots.append(n)
    return total, slots


def _choose_stash_groups(items, sizes, num_classes, num_ranks) -> tuple[tuple[int, ...], ...]:
    """Partition the classes into stash buffers of least total bytes (every rank allocates every buffer).

    One buffer sized for the largest class wastes memory when classes differ in size (the last
    stage's residuals include the logits); one buffer per class wastes memory when a rank's items of
    different classes never coexist. We try every split of the classes, sorted by size, into
    contiguous runs (2^(n-1) candidates) and keep the cheapest.
    """
    if sizes is None or num_classes <= 1:
        return (tuple(range(num_classes)),)
    order = sorted(range(num_classes), key=lambda c: sum(sizes[c].values()))
    best = None
    for mask in range(1 << (num_classes - 1)):
        groups, current = [], [order[0]]
        for i, c in enumerate(order[1:]):
            if mask >> i & 1:
                groups.append(tuple(current))
                current = []
            current.append(c)
        groups.append(tuple(current))
        cost, _ = _stash_cost(groups, items, sizes, num_ranks)
        if best is None or cost < best[0]:
            best = (cost, tuple(tuple(sorted(g)) for g in groups))
    return best[1]


def build_tick_program(
    schedule: Schedule,
    cell_classes: dict[tuple[int, int], StageClass],
    stash_sizes: dict[StageClass, dict[str, int]] | None = None,
) -> TickProgram:
    """Lower a validated schedule to tick tables.

    Args:
        schedule: the schedule.
        cell_classes: for every (stage, microbatch), its class.
        stash_sizes: per class, stashed residual bytes per dtype for one microbatch; used to group the
            stash buffers. Without it every class shares one buffer.
    """
    validate(schedule)
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    missing = [
        (st, m) for st in range(num_stages) for m in range(schedule.num_microbatches) if (st, m) not in cell_classes
    ]
    if missing:
        raise ScheduleError(f"no stage class for (stage, microbatch) {missing[:4]}")
    per_rank = [schedule.stages_of(r) for r in range(num_ranks)]
    if len({len(s) for s in per_rank}) != 1:
        counts = {r: len(s) for r, s in enumerate(per_rank)}
        raise ScheduleError(f"every rank must own the same number of stages for one SPMD program; got {counts}")
    local_stage = [0] * num_stages
    for stages in per_rank:
        for v, s in enumerate(stages):
            local_stage[s] = v

    classes: list[StageClass] = []
    cell_class: dict[tuple[int, int], int] = {}
    for key in sorted(cell_classes):
        c = cell_classes[key]
        if c not in classes:
            classes.append(c)
        cell_class[key] = classes.index(c)

    ticks = lockstep_ticks(schedule)
    num_ticks = 1 + max(ticks.values())
    rank_of = schedule.stage_to_rank
    present = set(ticks)
    split = {(a.stage, a.microbatch) for a in present if a.kind is Kind.I}

    def last_use(stage: int, mb: int) -> Action:
        return Action(stage, Kind.W if (stage, mb) in split else Kind.B, mb)

    hops = {(rank_of[s + 1] - rank_of[s]) % num_ranks for s in range(num_stages - 1)}
    offsets = sorted((hops | {(-h) % num_ranks for h in hops}) - {0})

    # Lifetimes per rank: activations (F(s-1) -> F(s)), gradients (I/B(s+1) -> last use of s), stash.
    act_items = {r: [] for r in range(num_ranks)}
    grad_items = {r: [] for r in range(num_ranks)}
    stash_items = {(r, c): [] for r in range(num_ranks) for c in range(len(classes))}
    for a in present:
        s, m = a.stage, a.microbatch
        if a.kind is Kind.F:
            if s > 0:
                act_items[rank_of[s]].append((ticks[Action(s - 1, Kind.F, m)], ticks[a], (s, m)))
            stash_items[(rank_of[s], cell_class[(s, m)])].append((ticks[a], ticks[last_use(s, m)], (s, m)))
        elif a.kind in (Kind.B, Kind.I) and s > 0:
            grad_items[rank_of[s - 1]].append((ticks[a], ticks[last_use(s - 1, m)], (s - 1, m)))

    act_slot, grad_slot, stash_slot = {}, {}, {}
    act_slots = grad_slots = 0
    for r in range(num_ranks):
        slots, n = _color_intervals(act_items[r])
        act_slot.update({(r, k): v for k, v in slots.items()})
        act_slots = max(act_slots, n)
        slots, n = _color_intervals(grad_items[r])
        grad_slot.update({(r, k): v for k, v in slots.items()})
        grad_slots = max(grad_slots, n)
    stash_live = [[_peak_live(stash_items[(r, c)]) for r in range(num_ranks)] for c in range(len(classes))]
    sizes = None if stash_sizes is None else [stash_sizes[c] for c in classes]
    stash_groups = _choose_stash_groups(stash_items, sizes, len(classes), num_ranks)
    stash_slots = []
    for group in stash_groups:
        count = 0
        for r in range(num_ranks):
            slots, n = _color_intervals([x for c in group for x in stash_items[(r, c)]])
            stash_slot.update(slots)
            count = max(count, n)
        stash_slots.append(count)
    act_trash, grad_trash = act_slots, grad_slots

    branches: list[tuple[int, Kind]] = []
    for a in sorted(present, key=lambda a: (cell_class[(a.stage, a.microbatch)], KINDS.index(a.kind))):
        key = (cell_class[(a.stage, a.microbatch)], a.kind)
        if key not in branches:
            branches.append(key)

    width = len(COLUMNS) + 2 * len(offsets)
    table = np.zeros((num_ranks, num_ticks, width), np.int32)
    col = {name: i for i, name in enumerate(COLUMNS)}
    table[:, :, col["send"]] = len(offsets)
    table[:, :, col["local_act"]] = act_trash
    table[:, :, col["local_grad"]] = grad_trash
    for k in range(len(offsets)):
        table[:, :, len(COLUMNS) + 2 * k] = act_trash
        table[:, :, len(COLUMNS) + 2 * k + 1] = grad_trash

    for a, t in ticks.items():
        s, m, r = a.stage, a.microbatch, rank_of[a.stage]
        row = table[r, t]
        row[col["branch"]] = 1 + branches.index((cell_class[(s, m)], a.kind))
        row[col["local_stage"]] = local_stage[s]
        row[col["microbatch"]] = m
        row[col["stash"]] = stash_slot[(s, m)]
        if a.kind is Kind.F and s > 0:
            row[col["act_in"]] = act_slot[(r, (s, m))]
        if a.kind in (Kind.B, Kind.I, Kind.W) and s < num_stages - 1:
            row[col["grad_in"]] = grad_slot[(r, (s, m))]
        # Where the output goes: F -> stage s+1's activation buffer; B/I -> stage s-1's gradient buffer.
        if a.kind is Kind.F and s < num_stages - 1:
            dst, buffer, key = rank_of[s + 1], "act", (s + 1, m)
        elif a.kind in (Kind.B, Kind.I) and s > 0:
            dst, buffer, key = rank_of[s - 1], "grad", (s - 1, m)
        else:
            continue
        slot = act_slot[(dst, key)] if buffer == "act" else grad_slot[(dst, key)]
        if dst == r:
            row[col["local_" + buffer]] = slot
        else:
            k = offsets.index((dst - r) % num_ranks)
            row[col["send"]] = k
            table[dst, t, len(COLUMNS) + 2 * k + (0 if buffer == "act" else 1)] = slot

    return TickProgram(
        schedule=schedule,
        num_ticks=num_ticks,
        offsets=tuple(offsets),
        classes=tuple(classes),
        cell_class=cell_class,
        local_stage=tuple(local_stage),
        branches=tuple(branches),
        table=table,
        act_slots=act_slots,
        grad_slots=grad_slots,
        stash_groups=stash_groups,
        stash_slots=tuple(stash_slots),
        stash_live=tuple(tuple(x) for x in stash_live),
        stash_intervals=tuple(
            tuple((p, q, c) for c in range(len(classes)) for p, q, _ in stash_items[(r, c)]) for r in range(num_ranks)
        ),
    )
