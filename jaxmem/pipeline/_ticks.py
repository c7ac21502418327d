"""Lower a schedule to the static tables the executor scans over (pure Python + NumPy, no JAX).

Every rank runs one action per tick (or idles); results move between ticks. For every tick and rank
the table says which branch to run, on which local stage and microbatch, which buffer slots to read
and write, and on which ppermute offset to send the output. Message slots are assigned by interval
colouring of the lifetimes the lockstep timing gives, so their number is the schedule's peak, not M.

Residuals live in one flat arena per (dtype, memory space). Every stashed (stage, microbatch) gets an
offset in its rank's arena, chosen per rank (largest items first, lowest offset whose range is free
for the item's lifetime), so stage-microbatches of different sizes -- a recomputed cell, the head's
larger residuals -- pack together. The arena every rank allocates is the largest any rank needs.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from jaxmem.layout import assign_offsets
from jaxmem.schedule import Kind, Schedule, ScheduleError, lockstep_ticks, validate

__all__ = ["StageClass", "TickProgram", "build_tick_program", "stash_cut", "stash_rows"]

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
    skip: tuple[int, ...] = ()  # layers of the stage skipped this step (layer drop)
    kinds: tuple[int, ...] = ()  # the kind of each of its layers (StagedModel.layer_kinds); () = one kind
    families: tuple[int, ...] = ()  # the parameter family of each (StagedModel.layer_families); () = one

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
    "send",  # ppermute offset index to send the output on; len(offsets) = none
    "local_act",  # activation slot to write the output into on this rank (V-shape turn), else trash
    "local_grad",  # gradient slot to write the output into on this rank, else trash
    "head_grad",  # with the vocabulary split: where the last stage's F leaves dL/dh for its backward
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
        table: ``[P, num_ticks, len(COLUMNS) + 2 * len(offsets) + 2 * len(stash_keys)]`` int64: the
            named columns; per ppermute offset, the activation slot and the gradient slot an incoming
            message is written to; per stash arena, the offset the action's residuals live at, then
            per arena the offset of what its I hands its W (:mod:`jaxmem.pipeline._iw`).
        act_slots / grad_slots: live slots of the message buffers (index ``act_slots`` is the trash).
        stash_keys: the arenas, one per ``(dtype, memory space)``.
        class_elems: per class, elements one stage-microbatch stashes in each arena.
        class_transfer_elems: per class, elements its I hands its W in each arena (empty without a
            split backward).
        arena_elems: per arena, the length every rank allocates (the largest rank's need).
        rank_arena_elems: per arena and rank, what that rank's own items need.
        stash_live: per class and rank, the peak number of stashed items.
        vocab_ticks: ``[num_ticks, 3]``: per tick, the microbatch whose tokens the first stage's F looks
            up, whose rows' gradient the first stage's B or I gives, and whose head the last stage's F
            reaches (-1: none) -- the ticks at which every rank works on a split vocabulary.
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
    stash_keys: tuple[tuple[str, str], ...]
    class_elems: tuple[dict, ...]
    arena_elems: tuple[int, ...]
    rank_arena_elems: tuple[tuple[int, ...], ...]
    stash_live: tuple[tuple[int, ...], ...]
    stash_intervals: tuple[tuple[tuple[int, int, int], ...], ...] = dataclasses.field(
        repr=False, compare=False, default=()
    )
    vocab_ticks: np.ndarray = dataclasses.field(repr=False, compare=False, default=None)
    class_transfer_elems: tuple[dict, ...] = ()

    def stash_column(self, key_index: int) -> int:
        return len(COLUMNS) + 2 * len(self.offsets) + key_index

    def transfer_column(self, key_index: int) -> int:
        return len(COLUMNS) + 2 * len(self.offsets) + len(self.stash_keys) + key_index

    def column(self, name: str) -> int:
        return COLUMNS.index(name)

    def recv_columns(self, offset_index: int) -> tuple[int, int]:
        base = len(COLUMNS) + 2 * offset_index
        return base, base + 1


def cell_classes(
    schedule: Schedule, layer_counts, policy, drop_layers=frozenset(), layer_kinds=None, layer_families=None
) -> dict[tuple[int, int], StageClass]:
    """The class of every (stage, microbatch): role, layers, policy variant, local position, the
    stage's layers dropped this step (``drop_layers`` holds global layer indices) and, for layers of
    several kinds (``layer_kinds``, one per global layer) or parameter families
    (``layer_families``), the kinds and families of its layers."""
    S = schedule.num_stages
    local = {s: schedule.stages_of(schedule.stage_to_rank[s]).index(s) for s in range(S)}
    starts = [sum(layer_counts[:s]) for s in range(S)]
    skip = {s: tuple(i for i in range(layer_counts[s]) if starts[s] + i in drop_layers) for s in range(S)}
    kinds = {
        s: () if layer_kinds is None else tuple(layer_kinds[starts[s] : starts[s] + layer_counts[s]]) for s in range(S)
    }
    families = {
        s: () if layer_families is None else tuple(layer_families[starts[s] : starts[s] + layer_counts[s]])
        for s in range(S)
    }
    made: dict[tuple[int, int], StageClass] = {}  # one object per (stage, variant): cells share it

    def of(s: int, variant: int) -> StageClass:
        if (s, variant) not in made:
            made[(s, variant)] = StageClass(
                first=s == 0,
                last=s == S - 1,
                layers=layer_counts[s],
                variant=variant,
                local=local[s],
                skip=skip[s],
                kinds=kinds[s],
                families=families[s],
            )
        return made[(s, variant)]

    return {(s, m): of(s, policy.variant_of[(s, m)]) for s in range(S) for m in range(schedule.num_microbatches)}


def stash_cut(key: tuple[str, str], tensor: int) -> int:
    """Over how many tensor devices a stash arena is cut: device arenas (the stash's, and those of
    what a split backward's I hands its W) over all of them (each keeps its share of every stashed
    vector, gathered back for the backward), host arenas not at all."""
    return 1 if key[1] == "host" else tensor


def stash_rows(stash_elems: dict[tuple[str, str], int], tensor: int = 1) -> dict[tuple[str, str], int]:
    """Per arena, the elements one stage-microbatch stashes on each device: a vector of ``n`` elements
    cut over ``c`` tensor devices takes ``ceil(n / c)`` on each (the last share zero-padded). The
    tick program lays the arenas out in these per-device units."""
    return {key: -(-n // stash_cut(key, tensor)) for key, n in stash_elems.items()}


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


def _assign_offsets(items: list[tuple[int, int, object, int]]) -> tuple[dict, int]:
    """Arena offsets for stash items ``(produced, consumed, key, size)`` with half-open lifetimes
    ``(produced, consumed]`` (written at the end of tick ``produced``, last read at ``consumed``).
    The result is shared between equal calls: read it, do not change it."""
    return _rank_layout(tuple(items))


@functools.lru_cache(maxsize=4096)  # a planner's searches lay out the same rank's items many times
def _rank_layout(items: tuple) -> tuple[dict, int]:
    offsets, length = assign_offsets([(p + 1, q, key, size) for p, q, key, size in items])
    return types.MappingProxyType(offsets), length


@dataclasses.dataclass(frozen=True)
class _Lifetimes:
    """What lowering a schedule needs that depends on the schedule alone (not on the stage
    classes): the lockstep ticks' message lifetimes and slots, and every stashed item's lifetime."""

    num_ticks: int
    offsets: tuple[int, ...]
    local_stage: tuple[int, ...]
    uneven: tuple[tuple[int, int], ...]  # (rank, stages) when ranks own different numbers of stages
    act_slot: types.MappingProxyType
    grad_slot: types.MappingProxyType
    act_slots: int
    grad_slots: int
    stash: tuple[tuple[int, int, int, tuple[int, int]], ...]  # (rank, produced, last use, (stage, mb))
    transfers: tuple[tuple[int, int, int, tuple], ...]  # (rank, I's tick, W's tick, ("I->W", stage, mb))
    cell_kinds: tuple[tuple[tuple[int, int], frozenset], ...]  # per (stage, mb), the kinds it runs
    vocab_ticks: np.ndarray


@functools.lru_cache(maxsize=256)
def _lifetimes(schedule: Schedule, head_grads: bool) -> _Lifetimes:
    validate(schedule)
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    per_rank = [schedule.stages_of(r) for r in range(num_ranks)]
    uneven = tuple((r, len(s)) for r, s in enumerate(per_rank)) if len({len(s) for s in per_rank}) != 1 else ()
    local_stage = [0] * num_stages
    for stages in per_rank:
        for v, s in enumerate(stages):
            local_stage[s] = v

    ticks = lockstep_ticks(schedule)
    num_ticks = 1 + max(ticks.values())
    rank_of = schedule.stage_to_rank
    present = set(ticks)
    tick_of = {(a.stage, a.kind, a.microbatch): t for a, t in ticks.items()}  # no Action built per lookup
    split = {(a.stage, a.microbatch) for a in present if a.kind is Kind.I}

    def last_use(stage: int, mb: int) -> int:
        return tick_of[(stage, Kind.W if (stage, mb) in split else Kind.B, mb)]

    hops = {(rank_of[s + 1] - rank_of[s]) % num_ranks for s in range(num_stages - 1)}
    offsets = sorted((hops | {(-h) % num_ranks for h in hops}) - {0})

    # Lifetimes per rank: activations (F(s-1) -> F(s)), gradients (I/B(s+1) -> last use of s), stash.
    act_items = {r: [] for r in range(num_ranks)}
    grad_items = {r: [] for r in range(num_ranks)}
    stash, transfers, cell_kinds = [], [], {}
    for a in present:
        s, m = a.stage, a.microbatch
        cell_kinds.setdefault((s, m), set()).add(a.kind)
        if a.kind is Kind.F:
            if s > 0:
                act_items[rank_of[s]].append((tick_of[(s - 1, Kind.F, m)], ticks[a], (s, m)))
            if not schedule.forward_only:  # nothing is kept for a backward that never runs
                stash.append((rank_of[s], ticks[a], last_use(s, m), (s, m)))
        elif a.kind in (Kind.B, Kind.I) and s > 0:
            grad_items[rank_of[s - 1]].append((ticks[a], last_use(s - 1, m), (s - 1, m)))
        if a.kind is Kind.I:
            transfers.append((rank_of[s], ticks[a], last_use(s, m), ("I->W", s, m)))
        if head_grads and a.kind is Kind.F and s == num_stages - 1 and not schedule.forward_only:
            grad_items[rank_of[s]].append((ticks[a], last_use(s, m), (s, m)))

    act_slot, grad_slot = {}, {}
    act_slots = grad_slots = 0
    for r in range(num_ranks):
        slots, n = _color_intervals(act_items[r])
        act_slot.update({(r, k): v for k, v in slots.items()})
        act_slots = max(act_slots, n)
        slots, n = _color_intervals(grad_items[r])
        grad_slot.update({(r, k): v for k, v in slots.items()})
        grad_slots = max(grad_slots, n)

    vocab_ticks = np.full((num_ticks, 3), -1, np.int64)
    for a, t in ticks.items():
        if a.stage == 0 and a.kind is Kind.F:
            vocab_ticks[t, 0] = a.microbatch
        if a.stage == 0 and a.kind in (Kind.B, Kind.I):
            vocab_ticks[t, 1] = a.microbatch
        if a.stage == num_stages - 1 and a.kind is Kind.F:
            vocab_ticks[t, 2] = a.microbatch
    vocab_ticks.setflags(write=False)  # shared by every program lowered from this schedule
    return _Lifetimes(
        num_ticks=num_ticks,
        offsets=tuple(offsets),
        local_stage=tuple(local_stage),
        uneven=uneven,
        act_slot=types.MappingProxyType(act_slot),
        grad_slot=types.MappingProxyType(grad_slot),
        act_slots=act_slots,
        grad_slots=grad_slots,
        stash=tuple(stash),
        transfers=tuple(transfers),
        cell_kinds=tuple((cell, frozenset(kinds)) for cell, kinds in cell_kinds.items()),
        vocab_ticks=vocab_ticks,
    )


def build_tick_program(
    schedule: Schedule,
    cell_classes: dict[tuple[int, int], StageClass],
    stash_elems: dict[StageClass, dict[tuple[str, str], int]] | None = None,
    *,
    with_table: bool = True,
    head_grads: bool = False,
    transfer_elems: dict[StageClass, dict[tuple[str, str], int]] | None = None,
) -> TickProgram:
    """Lower a validated schedule to tick tables.

    Args:
        schedule: the schedule.
        cell_classes: for every (stage, microbatch), its class.
        stash_elems: per class, elements one stage-microbatch stashes per arena ``(dtype, space)``.
            Without it every class stashes one element in a single ``("float32", "device")`` arena
            (enough for slot counting and tests).
        with_table: False leaves ``table`` empty (shape ``(0, 0, 0)``) and skips the per-tick
            rows: for callers that read only slot counts and arena sizes (the memory ledger), not
            for an executor.
        head_grads: the head's gradient ``dL/dh`` is produced at the last stage's F (the vocabulary
            split over the ranks) and waits in a gradient slot for its B.
        transfer_elems: per class, elements its I hands its W per arena (the split backward,
            :mod:`jaxmem.pipeline._iw`): each lives in the arenas from the I's tick to the W's.
    """
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    life = _lifetimes(schedule, head_grads)  # validates the schedule
    missing = [
        (st, m) for st in range(num_stages) for m in range(schedule.num_microbatches) if (st, m) not in cell_classes
    ]
    if missing:
        raise ScheduleError(f"no stage class for (stage, microbatch) {missing[:4]}")
    if life.uneven:
        raise ScheduleError(
            f"every rank must own the same number of stages for one SPMD program; got {dict(life.uneven)}"
        )

    index_of: dict[StageClass, int] = {}  # classes in order of first appearance
    cell_class: dict[tuple[int, int], int] = {}
    for key in sorted(cell_classes):
        cell_class[key] = index_of.setdefault(cell_classes[key], len(index_of))
    classes = list(index_of)

    stash_items = {(r, c): [] for r in range(num_ranks) for c in range(len(classes))}
    transfer_items = {(r, c): [] for r in range(num_ranks) for c in range(len(classes))}
    for r, p, q, cell in life.stash:
        stash_items[(r, cell_class[cell])].append((p, q, cell))
    for r, p, q, cell in life.transfers:
        transfer_items[(r, cell_class[cell[1:]])].append((p, q, cell))
    stash_live = [[_peak_live(stash_items[(r, c)]) for r in range(num_ranks)] for c in range(len(classes))]
    if stash_elems is None:
        stash_elems = {c: {("float32", "device"): 1} for c in classes}
    class_elems = tuple(dict(stash_elems[c]) for c in classes)
    class_transfers = tuple(dict((transfer_elems or {}).get(c, {})) for c in classes)
    stash_keys = tuple(sorted({k for elems in (*class_elems, *class_transfers) for k, n in elems.items() if n}))
    stash_offset: dict[tuple[int, int, int], int] = {}  # (key index, stage, mb) -> offset
    rank_arena = [[0] * num_ranks for _ in stash_keys]
    arena = []
    for ki, key in enumerate(stash_keys):
        need = 0
        for r in range(num_ranks):
            items = [
                (p, q, cell, class_elems[c].get(key, 0))
                for c in range(len(classes))
                for p, q, cell in stash_items[(r, c)]
            ] + [
                (p, q, cell, class_transfers[c].get(key, 0))
                for c in range(len(classes))
                for p, q, cell in transfer_items[(r, c)]
                if class_transfers[c].get(key, 0)
            ]
            offsets_r, length = _assign_offsets(items)
            stash_offset.update({(ki, *cell): o for cell, o in offsets_r.items()})
            rank_arena[ki][r] = length
            need = max(need, length)
        arena.append(need)

    # Every distinct (class, kind), in order of class, then kind.
    kinds = {(cell_class[cell], kind) for cell, cell_kinds in life.cell_kinds for kind in cell_kinds}
    branches: list[tuple[int, Kind]] = sorted(kinds, key=lambda k: (k[0], KINDS.index(k[1])))

    program = TickProgram(
        schedule=schedule,
        num_ticks=life.num_ticks,
        offsets=life.offsets,
        classes=tuple(classes),
        cell_class=cell_class,
        local_stage=life.local_stage,
        branches=tuple(branches),
        table=np.zeros((0, 0, 0), np.int64),
        act_slots=life.act_slots,
        grad_slots=life.grad_slots,
        stash_keys=stash_keys,
        class_elems=class_elems,
        class_transfer_elems=class_transfers,
        arena_elems=tuple(arena),
        rank_arena_elems=tuple(tuple(x) for x in rank_arena),
        stash_live=tuple(tuple(x) for x in stash_live),
        stash_intervals=tuple(
            tuple((p, q, c) for c in range(len(classes)) for p, q, _ in stash_items[(r, c)]) for r in range(num_ranks)
        ),
        vocab_ticks=life.vocab_ticks,
    )
    if not with_table:
        return program
    return dataclasses.replace(
        program, table=_tick_table(program, stash_offset, life.act_slot, life.grad_slot, head_grads)
    )


def _tick_table(
    program: TickProgram, stash_offset: dict, act_slot: dict, grad_slot: dict, head_grads: bool = False
) -> np.ndarray:
    """The per-(rank, tick) rows of a lowered schedule (see :data:`COLUMNS`), from its slot and arena
    assignments: ``stash_offset[(arena, stage, mb)]``, ``act_slot``/``grad_slot[(rank, (stage, mb))]``."""
    schedule, offsets, stash_keys = program.schedule, program.offsets, program.stash_keys
    num_ranks, num_stages, rank_of = schedule.num_ranks, schedule.num_stages, schedule.stage_to_rank
    act_trash, grad_trash = program.act_slots, program.grad_slots
    width = len(COLUMNS) + 2 * len(offsets) + 2 * len(stash_keys)
    table = np.zeros((num_ranks, program.num_ticks, width), np.int64)
    col = {name: i for i, name in enumerate(COLUMNS)}
    table[:, :, col["send"]] = len(offsets)
    table[:, :, col["local_act"]] = act_trash
    table[:, :, col["local_grad"]] = grad_trash
    table[:, :, col["head_grad"]] = grad_trash
    for k in range(len(offsets)):
        table[:, :, len(COLUMNS) + 2 * k] = act_trash
        table[:, :, len(COLUMNS) + 2 * k + 1] = grad_trash

    for a, t in lockstep_ticks(schedule).items():
        s, m, r = a.stage, a.microbatch, rank_of[a.stage]
        row = table[r, t]
        row[col["branch"]] = 1 + program.branches.index((program.cell_class[(s, m)], a.kind))
        row[col["local_stage"]] = program.local_stage[s]
        row[col["microbatch"]] = m
        for ki in range(len(stash_keys)):
            row[program.stash_column(ki)] = stash_offset[(ki, s, m)]
            if a.kind in (Kind.I, Kind.W):
                row[program.transfer_column(ki)] = stash_offset.get((ki, "I->W", s, m), 0)
        if a.kind is Kind.F and s > 0:
            row[col["act_in"]] = act_slot[(r, (s, m))]
        if a.kind in (Kind.B, Kind.I, Kind.W) and (s < num_stages - 1 or head_grads):
            row[col["grad_in"]] = grad_slot[(r, (s, m))]
        if head_grads and a.kind is Kind.F and s == num_stages - 1 and not schedule.forward_only:
            row[col["head_grad"]] = grad_slot[(r, (s, m))]
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
    return table
