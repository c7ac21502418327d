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
  * weights on host (fetched for every action that runs the stage, overlapped with the rank's
    action before it, and read and written back by the update);
- moves are applied cheapest per byte first; within a cell move, the longest-waiting cells go first,
  and a binary search finds how few are needed; a move is used fully before the next one starts.

``chronos-recomp`` uses the recompute moves, ``chronos-offload`` the offload moves, ``chronos-both``
all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxmem.policy._policy import PRESETS, Policy
from jaxmem.schedule import simulate

__all__ = ["MOVE_SPECS", "ChronosChoice", "Move", "chronos_policy", "reuse_distances"]

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
) -> ChronosChoice:
    """Apply memory moves, cheapest per byte first, until ``device_bytes(policy) <= budget``.

    Args:
        device_bytes: per-rank device footprint of a policy (the analytical ledger's maximum).
        costs: simulator costs of the step (for the reuse distances).
        moves: the moves allowed, with their cost per byte (see module doc).
        stash_seconds_round_trip: offload + prefetch time of a cell's stash on the host link.
        layers: each stage's layers (for ``recompute-layers``; without them that move is skipped).
    """
    order = reuse_distances(schedule, costs)
    moves = sorted(moves, key=lambda m: m.seconds_per_byte)
    names = [m.name for m in moves]
    if "recompute-layers" in names and "recompute-all" in names:  # the finer move first
        whole = moves.pop(names.index("recompute-all"))
        moves.insert([m.name for m in moves].index("recompute-layers") + 1, whole)
    cell_level: dict[tuple[int, int], str] = {}
    cell_layers: dict[tuple[int, int], int] = {}
    flags = {"offload-optimizer-state": False, "offload-weights": False}
    applied: dict[str, int] = {}

    def build(levels: dict, state: dict, recomputed=None) -> Policy:
        recomputed = cell_layers if recomputed is None else recomputed
        stage_base = dataclasses.replace(
            SAVE, offload_optimizer_state=state["offload-optimizer-state"], offload_weights=state["offload-weights"]
        )
        stages = tuple((s, stage_base) for s in range(schedule.num_stages)) if stage_base != SAVE else ()
        cells = tuple(
            sorted(
                (
                    s,
                    m,
                    dataclasses.replace(
                        CELL_POLICIES.get(levels.get((s, m)), SAVE),
                        offload_optimizer_state=state["offload-optimizer-state"],
                        offload_weights=state["offload-weights"],
                        recompute_layers=recomputed.get((s, m), 0) if levels.get((s, m)) != "recompute-all" else 0,
                    ),
                )
                for s, m in set(levels) | set(recomputed)
            )
        )
        return Policy(default=SAVE, stages=stages, cells=cells, name=name)

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
            # One layer of one cell per unit: every cell's next layer, longest waits first, then the next.
            cells = [(s, m) for _, s, m in order if cell_level.get((s, m)) != "recompute-all"]
            units = [(cell, j) for j in range(1, max(layers) + 1) for cell in cells if j <= layers[cell[0]]]

            def with_units(n: int, units=units, done=cell_layers) -> dict:
                recomputed = dict(done)
                for cell, j in units[:n]:
                    recomputed[cell] = max(recomputed.get(cell, 0), j)
                return recomputed

            def units_fit(n: int, with_units=with_units, levels=cell_level, state=flags) -> bool:
                return device_bytes(build(levels, state, with_units(n))) <= budget

            k = _smallest_prefix(len(units), units_fit)
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
