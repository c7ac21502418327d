"""Random DAGs for testing and benchmarking the planner against the exact ILP."""

from __future__ import annotations

import random

from jaxmem.roam._graph import Graph, Op

__all__ = ["random_dag"]


def random_dag(
    num_ops: int,
    seed: int = 0,
    num_inputs: int = 2,
    max_inputs: int = 3,
    size_range: tuple[int, int] = (1_000, 100_000),
) -> Graph:
    """A random DAG in a random topological (program) order: each op reads 1..max_inputs earlier
    tensors (recent ones more likely) and writes one tensor of a log-uniform random size. Inputs are
    donated; the last op's output is the graph output. Fan-out and parallel branches make the order
    matter."""
    rng = random.Random(seed)
    lo, hi = size_range

    def size() -> int:
        return int(round(lo * (hi / lo) ** rng.random()))

    sizes = [size() for _ in range(num_inputs)]
    inputs = list(range(num_inputs))
    ops = []
    for i in range(num_ops):
        available = len(sizes)
        k = rng.randint(1, min(max_inputs, available))
        weights = [1.0 + j for j in range(available)]  # later tensors more likely
        picks = set()
        while len(picks) < k:
            picks.add(rng.choices(range(available), weights)[0])
        sizes.append(size())
        ops.append(Op(i, f"op{i}", tuple(sorted(picks)), (len(sizes) - 1,)))
    # Everything should feed the result: tensors nobody reads become inputs of the last op.
    read = {t for op in ops for t in op.inputs}
    dangling = [t for t in range(len(sizes) - 1) if t not in read and t not in inputs]
    if dangling:
        last = ops[-1]
        ops[-1] = Op(last.index, last.name, tuple(sorted(set(last.inputs) | set(dangling))), last.outputs)
    return Graph(ops, sizes, inputs, set(inputs), [len(sizes) - 1]).finalize()
