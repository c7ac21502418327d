"""Apply a plan: run the planned order as separately compiled segments, passing only live tensors.

The planned order is cut into ``segments`` consecutive pieces. Each piece is one jitted function of
the tensors it reads that earlier pieces (or the caller) produced, returning the tensors later pieces
or the caller still need; between pieces, the driver keeps exactly the tensors still live and drops
the rest. Memory is measured per piece as ``memory_analysis()`` of its compiled function plus the
bytes of the live tensors it does not take as arguments.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxmem.roam._graph import Graph
from jaxmem.roam._liveness import peak

__all__ = ["SegmentedRun", "run_segmented"]


@dataclasses.dataclass(frozen=True)
class SegmentedRun:
    outputs: list
    segments: int
    measured_peak_bytes: int  # max over segments: compiled footprint + live tensors held outside it
    predicted_peak_bytes: int  # the planned order's peak (perfect packing)
    per_segment: tuple[dict, ...]


def _run_ops(graph: Graph, ops, env: dict) -> None:
    for o in ops:
        for op in graph.ops[o].parts or [graph.ops[o]]:
            _run_op(op, env)


def _run_op(op, env: dict) -> None:
    eqn = op.eqn
    invals = [env[t] if t is not None else v.val for t, v in zip(op.literal_inputs, eqn.invars)]
    outvals = eqn.primitive.bind(*invals, **eqn.params)
    if not eqn.primitive.multiple_results:
        outvals = [outvals]
    for t, value in zip(op.outputs, outvals):
        env[t] = value


def run_segmented(graph: Graph, order, inputs, segments: int = 8) -> SegmentedRun:
    """Run ``order`` on concrete ``inputs`` (flat, in the graph's input order, consts excluded)."""
    order = list(order)
    n = len(order)
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    pieces = [order[bounds[i] : bounds[i + 1]] for i in range(segments) if bounds[i] < bounds[i + 1]]
    piece_of = {op: k for k, piece in enumerate(pieces) for op in piece}
    outputs = set(graph.outputs)
    last_piece = {}
    for t in range(len(graph.sizes)):
        uses = [piece_of[c] for c in graph.consumers[t]]
        last_piece[t] = len(pieces) if t in outputs else max(uses, default=-1)

    env: dict[int, object] = dict(zip(graph.inputs, inputs))  # the caller's arguments come first
    for t, value in graph.const_values.items():
        env.setdefault(t, value)
    records = []
    measured = 0
    for k, piece in enumerate(pieces):
        inside = set(piece)
        reads = sorted(
            {
                t
                for o in piece
                for t in graph.ops[o].inputs
                if graph.producer[t] is None or graph.producer[t] not in inside
            }
        )
        writes = sorted({t for o in piece for t in graph.ops[o].outputs if last_piece[t] > k})

        def segment(*values, piece=piece, reads=reads, writes=writes):
            local = dict(zip(reads, values))
            _run_ops(graph, piece, local)
            return [local[t] for t in writes]

        args = [env[t] for t in reads]
        compiled = jax.jit(segment).lower(*args).compile()
        analysis = compiled.memory_analysis()
        results = compiled(*args)
        held = sum(graph.sizes[t] for t in env if t not in reads)
        footprint = (
            analysis.argument_size_in_bytes
            + analysis.temp_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        measured = max(measured, footprint + held)
        records.append(
            {
                "ops": len(piece),
                "reads": len(reads),
                "writes": len(writes),
                "compiled_bytes": footprint,
                "held_bytes": held,
            }
        )
        for t, value in zip(writes, results):
            env[t] = value
        for t in list(env):  # drop what no later piece reads
            if last_piece.get(t, len(pieces)) <= k and t not in outputs and t not in graph.const_values:
                del env[t]
    predicted = peak(graph, order).peak
    return SegmentedRun([env[t] for t in graph.outputs], len(pieces), measured, predicted, tuple(records))
