"""Chronos-Recomp and Chronos-Offload: policies chosen from the schedule's timeline, under a budget.

ChronosPipe (arXiv 2503.03182) treats device memory as a cache and uses temporal locality: the
activations that wait longest between their forward and their backward are the cheapest to give up
-- recompute them (Chronos-Recomp) or move them to host and fetch them back just in time
(Chronos-Offload); state idle for most of the step (optimizer state, weights) can live on host.
The paper's exact rules were not available to us; this is our reconstruction, one budget solver:

- reuse distance of (stage, microbatch) = how long its activation waits, end of F to start of its
  backward, in the schedule simulated with the step's costs;
- memory "moves", each with a time cost per byte saved, read from the one estimator
  (:func:`jaxmem.search.chronos_moves`: the step with the move applied everywhere against
  save-all, over the bytes it frees):
  * offload the stash of a cell whose wait covers the round trip on the host link (priced 0: it
    hides behind compute; the simulator charges whatever does not),
  * selective recompute of a cell (recompute the attention probabilities only),
  * full recompute of one layer of a cell (``recompute_layers``: the layer keeps only its input),
    one layer at a time over the cells -- every cell its first layer, longest waits first, then
    every cell its second, and so on -- so that the step slows by a layer's forward per unit, not by
    a whole stage's at once (spread over the cells: taking one cell's layers before the next's
    needed ten times the layers to fit 352 layers of gpt2-xl width on the H100 profile),
  * full recompute of a cell (keep only the stage input; after the per-layer move, which it
    refines by the layers' inputs),
  * optimizer state on host (read and written back by the update, after the tick loop: nothing
    overlaps it),
  * weights on host (fetched into the rank's prefetch slot for an action whose stage is not the
    one the slot holds, overlapped with the rank's action before it, and read and written back by
    the update; the slot and the weights arriving beside it hold two stages, so where a rank runs
    two stages the move frees nothing and is not offered);
- moves are applied cheapest per byte first; within a cell move, the longest-waiting cells go first,
  and a binary search finds how few are needed; a move is used fully before the next one starts.

``chronos-recomp`` uses the recompute moves, ``chronos-offload`` the offload moves, ``chronos-both``
all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import numpy as np

from jaxmem.policy._policy import PRESETS, Policy, StagePolicy
from jaxmem.schedule import simulate

__all__ = ["MOVE_SPECS", "ChronosChoice", "Move", "chronos_policy", "peak_order", "reuse_distances"]

SAVE = PRESETS["save-all"]
CELL_POLICIES = {
    "offload-stash": dataclasses.replace(SAVE, offload_stash=True),
    "selective": PRESETS["selective"],
    "recompute-all": PRESETS["recompute-all"],
}
RECOMP_MOVES = ("selective", "recompute-layers", "recompute-all")
# The policy each move applies everywhere, to price it (jaxmem.search.chronos_moves).
MOVE_SPECS = {"recompute-layers": {"recompute_layers": 1 << 30}}
OFFLOAD_MOVES = ("offload-stash", "offload-optimizer-state", "offload-weights")


def reuse_distances(schedule, costs) -> list[tuple[float, int, int]]:
    """``(wait, stage, microbatch)`` for every cell, longest wait first."""
    result = simulate(schedule, costs)
    cells = [
        (result.reuse_distance(s, m), s, m)
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
    ]
    return sorted(cells, key=lambda c: (-c[0], c[1], c[2]))


def peak_order(
    schedule, cells: list[tuple[int, int]], layers, done: dict, live: Callable[[dict], list[float]]
) -> list[list[tuple[tuple[int, int], int]]]:
    """The recompute-layers units ``((stage, microbatch), j)`` -- layer j of the cell recomputed whole
    -- in groups, one per (stage, j), in the order that lowers the highest rank's stash first.

    A group gives layer j to every cell of one stage that has not recomputed it (longest wait first,
    the order of ``cells``), so that a stage's cells stay of one class, which share their stash
    slots: cells of one stage at several depths of recompute share them less well, and the stash
    is then not monotone in the units taken. A rank's groups come in turn over its stages, layer 1
    of each, then layer 2. The ranks take turns by water filling: the next group goes to the rank
    whose stash, estimated, is the highest. ``live(recomputed)`` gives each rank's stash bytes
    with ``recomputed`` layers per cell (the ledger's per-rank stash); a group is estimated to free
    on its rank what one layer of every cell freed there, per cell. ``done``: layers already
    recomputed per cell."""
    ranks = schedule.num_ranks
    queues: list[list[list]] = [[] for _ in range(ranks)]
    for j in range(1, max(layers, default=0) + 1):
        for stage in sorted({c[0] for c in cells}):
            group = [(c, j) for c in cells if c[0] == stage and done.get(c, 0) < j <= layers[stage]]
            if group:
                queues[schedule.stage_to_rank[stage]].append(group)
    nxt = {c: done.get(c, 0) + 1 for c in cells if done.get(c, 0) < layers[c[0]]}
    before = np.asarray(live(dict(done)), dtype=float)
    after = np.asarray(live({**done, **nxt}), dtype=float)
    counts = np.bincount([schedule.stage_to_rank[c[0]] for c in nxt], minlength=ranks).astype(float)
    per_cell = np.where(counts > 0, (before - after) / np.maximum(counts, 1), 0.0)
    estimate = before.copy()
    heads = [0] * ranks
    order = []
    while True:
        open_ranks = [r for r in range(ranks) if heads[r] < len(queues[r])]
        if not open_ranks:
            return order
        r = max(open_ranks, key=lambda r: (estimate[r], -r))
        group = queues[r][heads[r]]
        order.append(group)
        heads[r] += 1
        estimate[r] -= per_cell[r] * len(group)


def _fewest_units(groups: list[list], done: dict, fits: Callable[[dict], bool]):
    """``(k, units, with_units)``: the fewest of the ``groups``' units, in order, with which
    ``fits(recomputed layers per cell)`` (k None: not even all of them); ``with_units(n)``, the
    layers per cell after the first n. Whole groups are searched first (the stash falls with
    them), then the units inside the group that first fits (cells of one stage at two depths of
    recompute share their stash slots less well: it need not fall with each)."""
    units = [unit for group in groups for unit in group]

    def with_units(n: int) -> dict:
        recomputed = dict(done)
        for cell, j in units[:n]:
            recomputed[cell] = max(recomputed.get(cell, 0), j)
        return recomputed

    ends = [0, *itertools.accumulate(len(g) for g in groups)]
    i = _smallest_prefix(len(ends) - 1, lambda i: fits(with_units(ends[i])))
    k = None if i is None else ends[i]
    if i:
        lo = ends[i - 1]
        inner = _smallest_prefix(k - lo, lambda n: fits(with_units(lo + n)))
        k = k if inner is None else lo + inner
    return k, units, with_units


@dataclasses.dataclass(frozen=True)
class Move:
    """One kind of memory reduction with its cost in seconds per byte saved."""

    name: str
    seconds_per_byte: float


@dataclasses.dataclass(frozen=True)
class ChronosChoice:
    """A generated policy and what the generator decided."""

    policy: Policy
    cells: dict  # move name -> number of cells it was applied to
    optimizer_state_on_host: bool
    weights_on_host: bool
    device_bytes: float
    fits: bool

    def describe(self) -> str:
        parts = [
            f"{n} layers recomputed whole" if name == "recompute-layers" else f"{name} on {n} cells"
            for name, n in self.cells.items()
            if n and name not in ("offload-optimizer-state", "offload-weights")
        ]
        if self.optimizer_state_on_host:
            parts.append("optimizer state on host")
        if self.weights_on_host:
            parts.append("weights on host")
        return ", ".join(parts) or "nothing needed"


def _smallest_prefix(count: int, fits: Callable[[int], bool]) -> int | None:
    """Smallest k in [0, count] with fits(k) (fits assumed monotone); None when even ``count`` fails."""
    if fits(0):
        return 0
    if count == 0 or not fits(count):
        return None
    lo, hi = 0, count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def chronos_policy(
    schedule,
    device_bytes: Callable[[Policy], float],
    budget: float,
    costs,
    moves: list[Move],
    *,
    stash_seconds_round_trip: Callable[[int, int], float],
    name: str = "chronos",
    layers=None,
    live_stash: Callable[[Policy], list[float]] | None = None,
    distances: list[tuple[float, int, int]] | None = None,
) -> ChronosChoice:
    """Apply memory moves, cheapest per byte first, until ``device_bytes(policy) <= budget``.

    Args:
        device_bytes: per-rank device footprint of a policy (the analytical ledger's maximum).
        costs: simulator costs of the step (for the reuse distances).
        moves: the moves allowed, with their cost per byte (see module doc).
        stash_seconds_round_trip: offload + prefetch time of a cell's stash on the host link.
        layers: each stage's layers (for ``recompute-layers``; without them that move is skipped).
        live_stash: each rank's own stash bytes under a policy (the ledger's); with it,
            ``recompute-layers`` aims at the ranks holding the most (:func:`peak_order`).
        distances: :func:`reuse_distances` of ``schedule`` under ``costs``, when the caller has
            them already (a planner generating several policies for one step simulates it once).
    """
    order = reuse_distances(schedule, costs) if distances is None else distances
    moves = sorted(moves, key=lambda m: m.seconds_per_byte)
    names = [m.name for m in moves]
    if "recompute-layers" in names and "recompute-all" in names:  # the finer move first
        whole = moves.pop(names.index("recompute-all"))
        moves.insert([m.name for m in moves].index("recompute-layers") + 1, whole)
    cell_level: dict[tuple[int, int], str] = {}
    cell_layers: dict[tuple[int, int], int] = {}
    flags = {"offload-optimizer-state": False, "offload-weights": False}
    applied: dict[str, int] = {}

    @functools.cache  # one per distinct (level, state, layers): the searches build thousands of policies
    def cell_policy(level, optimizer_on_host: bool, weights_on_host: bool, k: int) -> StagePolicy:
        return dataclasses.replace(
            CELL_POLICIES.get(level, SAVE),
            offload_optimizer_state=optimizer_on_host,
            offload_weights=weights_on_host,
            recompute_layers=k,
        )

    def build(levels: dict, state: dict, recomputed=None) -> Policy:
        recomputed = cell_layers if recomputed is None else recomputed
        on_host = state["offload-optimizer-state"], state["offload-weights"]
        stage_base = cell_policy(None, *on_host, 0)
        stages = tuple((s, stage_base) for s in range(schedule.num_stages)) if stage_base != SAVE else ()
        cells = []
        for s, m in sorted(set(levels) | set(recomputed)):
            level = levels.get((s, m))
            k = recomputed.get((s, m), 0) if level != "recompute-all" else 0
            cells.append((s, m, cell_policy(level, *on_host, k)))
        return Policy(default=SAVE, stages=stages, cells=tuple(cells), name=name)

    def choice(fits: bool) -> ChronosChoice:
        policy = build(cell_level, flags)
        state = flags["offload-optimizer-state"], flags["offload-weights"]
        return ChronosChoice(policy, applied, *state, device_bytes(policy), fits)

    if device_bytes(build(cell_level, flags)) <= budget:
        return choice(True)
    for move in moves:
        if move.name in flags:
            flags = dict(flags, **{move.name: True})
            applied[move.name] = 1
            if device_bytes(build(cell_level, flags)) <= budget:
                return choice(True)
            continue
        if move.name == "recompute-layers":
            if layers is None:
                continue
            # One layer of one cell per unit, in groups: every cell's next layer, longest waits
            # first; with the ranks' stash also a stage's next layer on the rank holding the most
            # (peak_order), and the order that fits with fewer layers is kept.
            cells = [(s, m) for _, s, m in order if cell_level.get((s, m)) != "recompute-all"]

            def with_layers(recomputed: dict, levels=cell_level, state=flags) -> Policy:
                return build(levels, state, recomputed)

            orders = [[[(cell, j) for cell in cells if j <= layers[cell[0]]] for j in range(1, max(layers) + 1)]]
            if live_stash is not None:
                live = lambda recomputed: live_stash(with_layers(recomputed))  # noqa: E731
                orders.append(peak_order(schedule, cells, layers, cell_layers, live))
            fits = lambda recomputed: device_bytes(with_layers(recomputed)) <= budget  # noqa: E731
            found = [_fewest_units(groups, cell_layers, fits) for groups in orders]
            k, units, with_units = min(found, key=lambda f: (f[0] is None, f[0] or 0))
            cell_layers = with_units(len(units) if k is None else k)
            applied[move.name] = len(units) if k is None else k
            if k is not None:
                return choice(True)
            continue
        if move.name == "offload-stash":
            targets = [(s, m) for w, s, m in order if (s, m) not in cell_level and w >= stash_seconds_round_trip(s, m)]
        else:
            targets = [
                (s, m)
                for _, s, m in order
                if cell_level.get((s, m)) in (None, "selective") and cell_level.get((s, m)) != move.name
            ]

        def with_k(k: int, targets=targets, move=move, base_levels=cell_level) -> dict:
            levels = dict(base_levels)
            for cell in targets[:k]:
                levels[cell] = move.name
            return levels

        def fits(k: int, with_k=with_k, state=flags) -> bool:
            return device_bytes(build(with_k(k), state)) <= budget

        k = _smallest_prefix(len(targets), fits)
        if k is not None:
            cell_level = with_k(k)
            applied[move.name] = k
            return choice(True)
        cell_level = with_k(len(targets))
        applied[move.name] = len(targets)
    return choice(False)
