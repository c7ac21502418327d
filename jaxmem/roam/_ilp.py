"""An exact joint order + layout ILP for small graphs (the MODeL/OLLA-style baseline), with SciPy's
HiGHS MILP solver.

Variables: ``x[i, t]`` (op i runs at step t), integer step ``T_i``, every tensor's first and last live
step, its offset, and the arena size ``A``. For every pair of tensors, one of four binaries holds:
k ends before l starts, l ends before k starts, k sits below l, l sits below k (big-M constraints).
Minimise ``A``. Solved exactly for about a dozen ops; beyond that, with a time limit, it returns its
best solution so far (if any) and the solver's lower bound, so a heuristic can be measured against both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import numpy as np

from jaxmem.roam._graph import Graph

__all__ = ["IlpResult", "solve_ilp"]


@dataclasses.dataclass(frozen=True)
class IlpResult:
    arena: int | None  # None when no solution was found in time
    order: tuple[int, ...] | None
    offsets: dict | None
    seconds: float
    optimal: bool
    bound: float | None = None  # the solver's proven lower bound on the arena (time-limited runs)


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS writes progress lines to file descriptor 1 even with ``disp`` off, into a caller's JSON."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve_ilp(graph: Graph, time_limit: float = 60.0) -> IlpResult:
    from scipy.optimize import Bounds, LinearConstraint, milp

    start = time.perf_counter()
    n = graph.num_ops
    keep = set(graph.outputs) | (set(graph.inputs) - graph.donated)
    tensors = [
        t
        for t, s in enumerate(graph.sizes)
        if s > 0 and (graph.consumers[t] or t in keep or graph.producer[t] is not None)
    ]
    m = len(tensors)
    # Bytes in units of a power of two (sizes rounded up: a layout in units is a valid one in bytes),
    # so the big-M rows stay within the solver's numerical range; exact for graphs under ~100 KB.
    unit = 1 << max(0, int(np.log2(max(sum(graph.sizes[t] for t in tensors), 1) / 1e5)))
    size = {t: -(-graph.sizes[t] // unit) for t in tensors}
    total = sum(size.values())
    # Variable layout.
    nx = n * n
    iT = nx
    iS = iT + n
    iE = iS + m
    iO = iE + m
    iA = iO + m
    pairs = [(a, b) for a in range(m) for b in range(a + 1, m)]
    iP = iA + 1
    nv = iP + 4 * len(pairs)
    lb, ub = np.zeros(nv), np.full(nv, np.inf)
    integrality = np.zeros(nv)
    integrality[:nx] = 1
    ub[:nx] = 1
    integrality[iT : iT + n] = 1
    ub[iT : iT + n] = n - 1
    lb[iS : iE + m] = -1
    ub[iS : iE + m] = n - 1
    ub[iO : iO + m] = total
    integrality[iP:] = 1
    ub[iP:] = 1
    entries_r, entries_c, entries_v, lo, hi = [], [], [], [], []

    def row(coeffs: dict, low: float, high: float):  # a sparse row: the pair constraints dominate
        r = len(lo)
        for k, v in coeffs.items():
            entries_r.append(r)
            entries_c.append(k)
            entries_v.append(v)
        lo.append(low)
        hi.append(high)

    for i in range(n):  # each op once, each step one op
        row({i * n + t: 1 for t in range(n)}, 1, 1)
    for t in range(n):
        row({i * n + t: 1 for i in range(n)}, 1, 1)
    for i in range(n):  # T_i = sum_t t x[i, t]
        coeffs = {i * n + t: t for t in range(n)}
        coeffs[iT + i] = -1
        row(coeffs, 0, 0)
    for op in graph.ops:  # dependencies
        for pred in graph.predecessors(op):
            row({iT + op.index: 1, iT + pred: -1}, 1, np.inf)
    for k, t in enumerate(tensors):
        producer = graph.producer[t]
        if producer is None:
            row({iS + k: 1}, -1, -1)
        else:
            row({iS + k: 1, iT + producer: -1}, 0, 0)
        row({iE + k: 1, iS + k: -1}, 0, np.inf)
        for c in graph.consumers[t]:
            row({iE + k: 1, iT + c: -1}, 0, np.inf)
        if t in keep:
            row({iE + k: 1}, n - 1, n - 1)
        row({iA: 1, iO + k: -1}, size[t], np.inf)
    big_t, big_o = n + 2, total
    for p, (a, b) in enumerate(pairs):
        u_ab, u_ba, v_ab, v_ba = (iP + 4 * p + j for j in range(4))
        row({u_ab: 1, u_ba: 1, v_ab: 1, v_ba: 1}, 1, np.inf)
        # E_a + 1 <= S_b + M (1 - u_ab)
        row({iE + a: 1, iS + b: -1, u_ab: big_t}, -np.inf, big_t - 1)
        row({iE + b: 1, iS + a: -1, u_ba: big_t}, -np.inf, big_t - 1)
        ta, tb = tensors[a], tensors[b]
        row({iO + a: 1, iO + b: -1, v_ab: big_o}, -np.inf, big_o - size[ta])
        row({iO + b: 1, iO + a: -1, v_ba: big_o}, -np.inf, big_o - size[tb])
    c = np.zeros(nv)
    c[iA] = 1
    from scipy.sparse import csr_array

    matrix = csr_array((entries_v, (entries_r, entries_c)), shape=(len(lo), nv))
    with _quiet_stdout():
        result = milp(
            c,
            constraints=LinearConstraint(matrix, lo, hi),
            integrality=integrality,
            bounds=Bounds(lb, ub),
            options={"time_limit": time_limit, "disp": False},
        )
    seconds = time.perf_counter() - start
    bound = getattr(result, "mip_dual_bound", None)
    # In bytes; less the rounding of every size, so it bounds the unrounded problem too.
    bound = None if bound is None or not np.isfinite(bound) else max(0.0, (float(bound) - m) * unit)
    if result.x is None:
        return IlpResult(None, None, None, seconds, False, bound)
    x = result.x
    order = tuple(int(i) for i in np.argsort([x[iT + i] for i in range(n)]))
    offsets = {t: int(round(x[iO + k])) * unit for k, t in enumerate(tensors)}
    arena = max((offsets[t] + graph.sizes[t] for t in tensors), default=0)
    return IlpResult(arena, order, offsets, seconds, result.status == 0, bound)
