"""Liveness and peak memory of an operation order.

In an order, op i runs at step i. A tensor lives from the step of its producer (graph inputs: from
before the first step) through the step of its last consumer; graph outputs and inputs the caller
keeps (not donated) live to the end; a tensor nobody reads lives only during its producer's step.
While an op runs, its inputs and outputs are live together, plus the op's own transient bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations: _graph imports this module
    from jaxmem.roam._graph import Graph

__all__ = ["Liveness", "check_order", "lifetimes", "peak"]


@dataclasses.dataclass(frozen=True)
class Liveness:
    peak: int
    peak_step: int
    live_bytes: tuple[int, ...]  # per step
    intervals: dict  # tensor -> (first step, last step), -1 = before the first op


def check_order(graph: Graph, order) -> None:
    """Raise ValueError unless ``order`` is a permutation of the ops respecting every dependency."""
    if sorted(order) != list(range(graph.num_ops)):
        raise ValueError("an order must list every op exactly once")
    position = {op: i for i, op in enumerate(order)}
    for op in graph.ops:
        for pred in graph.predecessors(op):
            if position[pred] >= position[op.index]:
                raise ValueError(f"op {op.index} ({op.name}) runs before its input producer {pred}")


def lifetimes(graph: Graph, order) -> dict[int, tuple[int, int]]:
    """Tensor -> (first step, last step) under ``order`` (only tensors that take bytes)."""
    n = len(order)
    position = {op: i for i, op in enumerate(order)}
    end = n - 1
    keep = set(graph.outputs) | (set(graph.inputs) - graph.donated)
    out = {}
    for t, size in enumerate(graph.sizes):
        if size == 0:
            continue
        producer = graph.producer[t]
        first = -1 if producer is None else position[producer]
        uses = [position[c] for c in graph.consumers[t]]
        last = max(uses, default=first)
        if t in keep:
            last = end
        if producer is None and not uses and t not in keep:
            continue  # an unused donated input: freed before anything runs
        out[t] = (first, max(last, first if first >= 0 else 0))
    return out


def peak(graph: Graph, order) -> Liveness:
    """Peak live bytes of ``order`` (the perfect-packing lower bound of any layout)."""
    n = len(order)
    delta = [0] * (n + 1)
    intervals = lifetimes(graph, order)
    for t, (first, last) in intervals.items():
        delta[max(first, 0)] += graph.sizes[t]
        delta[last + 1] -= graph.sizes[t]
    live, best, best_step, per_step = 0, 0, 0, []
    for step in range(n):
        live += delta[step]
        total = live + graph.ops[order[step]].transient
        per_step.append(total)
        if total > best:
            best, best_step = total, step
    if n == 0:
        best = sum(graph.sizes[t] for t in intervals)
    return Liveness(best, best_step, tuple(per_step), intervals)
