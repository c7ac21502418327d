"""Memory layout: an offset for every tensor in one arena, no two tensors with overlapping lifetimes
overlapping in address. Pure Python (no JAX): the pipeline executor's stash arenas use it too."""

from __future__ import annotations

import dataclasses
import random

__all__ = ["Layout", "assign_offsets", "greedy_by_size", "improve_layout", "check_layout"]

# An item is (first, last, key, size): alive from step ``first`` through step ``last`` (inclusive).
Item = tuple


def _overlap(a_first, a_last, b_first, b_last) -> bool:
    return a_first <= b_last and b_first <= a_last


def _place_in_order(items, small: bool | None = None) -> tuple[dict, int]:
    """First fit, items taken in the given order: each at the lowest offset not used by an already
    placed item whose lifetime overlaps. The overlap tests run in plain Python up to several hundred
    items (a pipeline rank's stash) and vectorised with NumPy beyond (operator graphs); both place
    alike (``small`` forces one, for tests)."""
    items = list(items)
    placed = (_PythonRanges if (len(items) <= _SMALL if small is None else small) else _NumpyRanges)(len(items))
    offset_of = {}
    top = 0
    for first, last, key, size in items:
        if size == 0:
            offset_of[key] = 0
            continue
        offset = 0
        for start, end in placed.busy(first, last):  # in address order
            if offset + size <= start:
                break
            offset = max(offset, end)
        placed.add(first, last, offset, offset + size)
        offset_of[key] = offset
        top = max(top, offset + size)
    return offset_of, top


_SMALL = 768  # the two overlap tests cost the same at ~1000 random lifetimes (measured)


class _PythonRanges:
    """Placed items' lifetimes and address ranges; ``busy`` gives the ranges of those alive with
    ``[first, last]``, sorted (ties in any order: first fit gives the same offset)."""

    def __init__(self, n: int):
        self.placed = []

    def add(self, first, last, start, end) -> None:
        self.placed.append((first, last, start, end))

    def busy(self, first, last) -> list:
        return sorted([(s, e) for f, q, s, e in self.placed if f <= last and first <= q])


class _NumpyRanges:
    def __init__(self, n: int):
        import numpy as np

        self.np, self.count = np, 0
        self.firsts, self.lasts, self.starts, self.ends = (np.empty(n, np.int64) for _ in range(4))

    def add(self, first, last, start, end) -> None:
        i = self.count
        self.firsts[i], self.lasts[i], self.starts[i], self.ends[i] = first, last, start, end
        self.count += 1

    def busy(self, first, last):
        n = self.count
        mask = (self.firsts[:n] <= last) & (first <= self.lasts[:n])
        if not mask.any():
            return ()
        s_busy, e_busy = self.starts[:n][mask], self.ends[:n][mask]
        order = self.np.argsort(s_busy, kind="stable")
        return zip(s_busy[order].tolist(), e_busy[order].tolist())


def _first_fit(items, order_key) -> tuple[dict, int]:
    return _place_in_order(sorted(items, key=order_key))


def greedy_by_size(items) -> tuple[dict, int]:
    """Largest tensor first, each at the lowest offset free for its lifetime (TFLite's arena planner)."""
    return _first_fit(items, lambda x: (-x[3], x[0], x[1]))


def assign_offsets(items) -> tuple[dict, int]:
    """The better of greedy-by-size and earliest-lifetime-first (regular streams pack better in time
    order)."""
    return min(greedy_by_size(items), _first_fit(items, lambda x: (x[0], -x[3], x[1])), key=lambda r: r[1])


def improve_layout(items, rounds: int = 64, seed: int = 0) -> tuple[dict, int]:
    """Improvement pass: several first-fit orders (by size, by size x lifetime, by start, by end), then
    random perturbations of the best order (swap two items, keep if the arena does not grow)."""
    items = list(items)
    candidates = [
        lambda x: (-x[3], x[0], x[1]),
        lambda x: (-(x[3] * (x[1] - x[0] + 1)), x[0]),
        lambda x: (x[0], -x[3]),
        lambda x: (-x[1], -x[3]),
        lambda x: (-(x[1] - x[0]), -x[3]),
    ]
    best_order, best = None, None
    for key in candidates:
        order = sorted(items, key=key)
        result = _place_in_order(order)
        if best is None or result[1] < best[1]:
            best, best_order = result, order
    rng = random.Random(seed)
    order = list(best_order)
    for _ in range(rounds if len(order) > 1 else 0):
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        order[i], order[j] = order[j], order[i]
        result = _place_in_order(order)
        if result[1] <= best[1]:
            best = result
        else:
            order[i], order[j] = order[j], order[i]
    return best


@dataclasses.dataclass(frozen=True)
class Layout:
    offsets: dict
    arena: int
    peak_live: int


def check_layout(items, offsets: dict) -> None:
    """Raise ValueError if two tensors alive at the same time overlap in the arena."""
    items = [i for i in items if i[3] > 0]
    for a in range(len(items)):
        fa, la, ka, sa = items[a]
        for b in range(a + 1, len(items)):
            fb, lb, kb, sb = items[b]
            if _overlap(fa, la, fb, lb):
                oa, ob = offsets[ka], offsets[kb]
                if oa < ob + sb and ob < oa + sa:
                    raise ValueError(f"tensors {ka} and {kb} are alive together and overlap in the arena")
