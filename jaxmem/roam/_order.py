"""Operator order: a tree-based task division with exact search in small tasks (ROAM, arXiv 2310.19295,
reconstructed: the paper's exact division and search were not available to us).

1. Sink cones. Every op is labelled with the set of graph outputs it can reach. Ops that reach at
   most ``cone_outputs`` outputs and are connected to each other form a cone: in a training step, the
   weight gradient of one parameter together with its optimizer update (they reach only the new
   parameter and its moments). A cone whose net memory effect is a release runs as soon as its inputs
   exist, so gradients are consumed while the backward pass is still running instead of all piling
   up until the optimizer section.
2. Task division. The remaining ops, in program order, are cut recursively -- at the position with
   the fewest live bytes crossing it, within the middle half of the span -- until each task has at
   most ``task_ops`` ops: a binary tree of tasks whose leaves are small.
3. Leaf search. Inside a leaf, a dynamic program over the subsets of executed ops finds the order
   with the lowest peak, given what is live when the task starts and which tensors later tasks still
   need (exact for the leaf; state = set of executed ops, since live memory depends only on it).
4. Composition. Leaves run in tree order; after every op, ready releasing cones run.

5. List schedules (our addition, not in the paper). The division above keeps the base order's
   coarse shape, and a train step's peak sits where its forward meets its backward, so on a plain
   step it finds nothing program order had not. Where the order is free at a coarse grain --
   gradient accumulation written as a loop over microbatches, a loss head over chunks, branches --
   the gain is in moving whole forwards and backwards. Two more candidates do that: a memory-aware
   list schedule (run a ready op that frees at least what it allocates; else the ready op earliest
   in a base order) over a depth-first post-order from the outputs (one output's work finished
   before the next's starts), and the same list schedule over program order.

The candidate with the lowest peak is compared with program order and the better is returned, so the
planner is never worse than program order (``OrderPlan.method`` says which won).
"""

from __future__ import annotations

import dataclasses
import time

from jaxmem.roam._graph import Graph
from jaxmem.roam._liveness import check_order, peak

__all__ = ["OrderPlan", "plan_order"]


@dataclasses.dataclass(frozen=True)
class OrderPlan:
    order: tuple[int, ...]
    peak: int
    program_order_peak: int
    tasks: tuple[tuple[int, ...], ...]  # leaf tasks (op indices), in execution order
    cones: int
    seconds: float
    used_program_order: bool
    method: str = "program order"  # which candidate order won (see plan_order)
    candidate_peaks: dict = dataclasses.field(default_factory=dict)  # candidate -> its peak


def _reach_masks(graph: Graph) -> list[int]:
    """Per op, the bitset of graph outputs it reaches."""
    out_bit = {}
    for i, t in enumerate(graph.outputs):
        out_bit[t] = out_bit.get(t, 0) | (1 << i)
    tensor_reach = [0] * len(graph.sizes)
    op_reach = [0] * graph.num_ops
    for op in reversed(graph.ops):
        mask = 0
        for t in op.outputs:
            mask |= tensor_reach[t] | out_bit.get(t, 0)
        op_reach[op.index] = mask
        for t in op.inputs:
            tensor_reach[t] |= mask
    return op_reach


def _cones(graph: Graph, cone_outputs: int, max_cone_ops: int = 256) -> list[list[int]]:
    """Connected groups of ops that reach only a few of many outputs (see the module docstring)."""
    if len(graph.outputs) < 4 * cone_outputs:
        return []  # a graph with few outputs has no per-output tails worth separating
    reach = _reach_masks(graph)
    small = [r != 0 and bin(r).count("1") <= cone_outputs for r in reach]
    parent = list(range(graph.num_ops))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for op in graph.ops:
        if not small[op.index]:
            continue
        for pred in graph.predecessors(op):
            if small[pred]:
                parent[find(pred)] = find(op.index)
    groups: dict[int, list[int]] = {}
    for op in graph.ops:
        if small[op.index]:
            groups.setdefault(find(op.index), []).append(op.index)
    return [sorted(g) for g in groups.values() if len(g) <= max_cone_ops]


class _State:
    """Incremental liveness while composing an order."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.keep = set(graph.outputs) | (set(graph.inputs) - graph.donated)
        self.remaining = [len(c) for c in graph.consumers]
        self.done = [False] * graph.num_ops
        self.available = [False] * len(graph.sizes)
        self.live = 0
        for t in graph.inputs:
            self.available[t] = True
            if graph.consumers[t] or t in self.keep:
                self.live += graph.sizes[t]
        self.order: list[int] = []
        self.peak = 0

    def ready(self, op_index: int) -> bool:
        return all(self.available[t] for t in self.graph.ops[op_index].inputs)

    def freed_by(self, op_index: int) -> int:
        freed = 0
        for t in set(self.graph.ops[op_index].inputs):
            if self.remaining[t] == 1 and t not in self.keep:
                freed += self.graph.sizes[t]
        return freed

    def run(self, op_index: int) -> None:
        graph = self.graph
        op = graph.ops[op_index]
        out_bytes = sum(graph.sizes[t] for t in op.outputs)
        self.peak = max(self.peak, self.live + out_bytes + op.transient)
        self.live += out_bytes
        for t in op.outputs:
            self.available[t] = True
            if not graph.consumers[t] and t not in self.keep:
                self.live -= graph.sizes[t]
        for t in set(op.inputs):
            self.remaining[t] -= 1
            if self.remaining[t] == 0 and t not in self.keep:
                self.live -= graph.sizes[t]
        self.done[op_index] = True
        self.order.append(op_index)


def _divide(ops: list[int], cut_bytes: list[int], task_ops: int) -> list[list[int]]:
    """Recursive bisection of a program-order span at its thinnest cut (within the middle half)."""
    if len(ops) <= task_ops:
        return [ops]
    lo, hi = len(ops) // 4, max(len(ops) * 3 // 4, len(ops) // 4 + 1)
    split = min(range(lo, hi), key=lambda i: (cut_bytes[i], abs(i - len(ops) // 2)))
    split = max(1, split)
    return _divide(ops[:split], cut_bytes[:split], task_ops) + _divide(ops[split:], cut_bytes[split:], task_ops)


def _leaf_order(state: _State, task: list[int], exact_limit: int) -> list[int]:
    """Best order of a task's ops given the state (exact DP over subsets when small enough)."""
    graph = state.graph
    ops = [o for o in task if not state.done[o]]
    if len(ops) <= 1:
        return ops
    index = {o: i for i, o in enumerate(ops)}
    need = []  # per op: mask of in-task predecessors
    for o in ops:
        mask = 0
        for p in graph.predecessors(graph.ops[o]):
            if p in index:
                mask |= 1 << index[p]
        need.append(mask)
    # Is the order forced (a chain)? Then there is nothing to search.
    ready_counts, done_mask, forced = [], 0, True
    for _ in ops:
        ready = [i for i in range(len(ops)) if not done_mask >> i & 1 and need[i] & ~done_mask == 0]
        ready_counts.append(len(ready))
        if len(ready) != 1:
            forced = False
            break
        done_mask |= 1 << ready[0]
    if forced or len(ops) > exact_limit:
        return _greedy_leaf(state, ops, need)
    # Tensors whose release depends on this task: freed when all their still-pending consumers ran.
    tensors = {}
    for o in ops:
        for t in set(graph.ops[o].inputs) | set(graph.ops[o].outputs):
            if t in tensors or t in state.keep:
                continue
            consumers = graph.consumers[t]
            pending = [c for c in consumers if not state.done[c]]
            if any(c not in index for c in pending):
                continue  # a later task still reads it
            mask = 0
            for c in pending:
                mask |= 1 << index[c]
            producer = graph.producer[t]
            made = 1 << index[producer] if producer in index else 0
            tensors[t] = (mask, made, graph.sizes[t])
    out_bytes = [sum(graph.sizes[t] for t in graph.ops[o].outputs) for o in ops]
    transient = [graph.ops[o].transient for o in ops]
    n = len(ops)
    base = state.live

    def live_after(mask: int) -> int:
        total = base + sum(out_bytes[i] for i in range(n) if mask >> i & 1)
        for consumers, made, size in tensors.values():
            produced = made == 0 or mask & made
            if produced and consumers & ~mask == 0:
                total -= size
        return total

    best = {0: (0, None)}
    live_cache = {0: base}
    for mask in sorted(range(1 << n), key=lambda m: bin(m).count("1")):
        if mask not in best:
            continue
        cur_peak, _ = best[mask]
        live = live_cache[mask]
        for i in range(n):
            if mask >> i & 1 or need[i] & ~mask:
                continue
            step_peak = max(cur_peak, live + out_bytes[i] + transient[i])
            nxt = mask | (1 << i)
            if nxt not in best or step_peak < best[nxt][0]:
                best[nxt] = (step_peak, (mask, i))
                if nxt not in live_cache:
                    live_cache[nxt] = live_after(nxt)
    order, mask = [], (1 << n) - 1
    while mask:
        _, (prev, i) = best[mask]
        order.append(ops[i])
        mask = prev
    return order[::-1]


def _greedy_leaf(state: _State, ops: list[int], need: list[int]) -> list[int]:
    """Ready op that grows memory least (releases first), ties in program order."""
    graph = state.graph
    done_mask, order = 0, []
    for _ in ops:
        ready = [i for i in range(len(ops)) if not done_mask >> i & 1 and need[i] & ~done_mask == 0]
        best = min(
            ready,
            key=lambda i: (sum(graph.sizes[t] for t in graph.ops[ops[i]].outputs) - state.freed_by(ops[i]), ops[i]),
        )
        order.append(ops[best])
        done_mask |= 1 << best
    return order


def _dfs_order(graph: Graph) -> list[int]:
    """Post-order depth-first from the graph outputs, operands in order: everything one output needs
    is finished before the next output's own work starts (XLA's DFS scheduler works alike). Ops no
    output needs follow in program order."""
    seen = [False] * graph.num_ops
    order: list[int] = []
    for t in graph.outputs:
        root = graph.producer[t]
        if root is None or seen[root]:
            continue
        stack = [(root, iter(graph.ops[root].inputs))]
        seen[root] = True
        while stack:
            op, inputs = stack[-1]
            for u in inputs:
                p = graph.producer[u]
                if p is not None and not seen[p]:
                    seen[p] = True
                    stack.append((p, iter(graph.ops[p].inputs)))
                    break
            else:
                stack.pop()
                order.append(op)
    order += [o for o in range(graph.num_ops) if not seen[o]]
    return order


def _list_schedule(graph: Graph, base: list[int]) -> list[int]:
    """Memory-aware list scheduling: among the ready ops, run one that frees at least what it
    allocates (earliest in ``base`` first); else the ready op earliest in ``base``. Releasing work --
    a weight gradient whose activation dies, an optimizer update whose gradient dies -- so runs as
    soon as it can, and the base order decides the rest (from the DFS order: one microbatch's or one
    branch's forward and backward before the next one's forward)."""
    import heapq

    rank = [0] * graph.num_ops
    for i, o in enumerate(base):
        rank[o] = i
    state = _State(graph)
    waiting = [len(graph.predecessors(op)) for op in graph.ops]
    successors: list[set[int]] = [set() for _ in graph.ops]
    for op in graph.ops:
        for p in graph.predecessors(op):
            successors[p].add(op.index)
    ready = [(rank[o], o) for o in range(graph.num_ops) if waiting[o] == 0]  # a heap; done entries linger
    heapq.heapify(ready)
    releasing: set[int] = set()  # ready ops that free at least what they allocate
    out_bytes = [sum(graph.sizes[t] for t in op.outputs) for op in graph.ops]
    done = [False] * graph.num_ops
    while len(state.order) < graph.num_ops:
        # A ready op frees more as the other readers of its inputs run (never less): check them all.
        for _, o in ready:
            if not done[o] and o not in releasing and out_bytes[o] <= state.freed_by(o):
                releasing.add(o)
        if releasing:
            o = min(releasing, key=lambda x: rank[x])
            releasing.discard(o)
        else:
            while done[ready[0][1]]:
                heapq.heappop(ready)
            o = heapq.heappop(ready)[1]
        done[o] = True
        state.run(o)
        for s in successors[o]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (rank[s], s))
    return state.order


def plan_order(
    graph: Graph, *, task_ops: int = 10, exact_limit: int = 10, cone_outputs: int = 3, list_schedules: bool = True
) -> OrderPlan:
    """Plan an operator order (see the module docstring); never worse than program order."""
    start = time.perf_counter()
    program = list(range(graph.num_ops))
    program_peak = peak(graph, program)
    cones = _cones(graph, cone_outputs)
    in_cone = {}
    for c, members in enumerate(cones):
        for o in members:
            in_cone[o] = c
    # A cone runs eagerly only if, once its inputs exist, running it releases memory.
    main = [o for o in program if o not in in_cone]
    cut = list(program_peak.live_bytes)
    tasks = _divide(main, [cut[o] for o in main], task_ops)

    state = _State(graph)
    cone_done = [False] * len(cones)
    cone_inputs = []
    for members in cones:
        inside = set(members)
        ext = {
            t
            for o in members
            for t in graph.ops[o].inputs
            if graph.producer[t] is None or graph.producer[t] not in inside
        }
        cone_inputs.append(ext)

    def run_ready_cones():
        progressed = True
        while progressed:
            progressed = False
            for c, members in enumerate(cones):
                if cone_done[c] or not all(state.available[t] for t in cone_inputs[c]):
                    continue
                trial = _State.__new__(_State)
                trial.__dict__ = {k: (list(v) if isinstance(v, list) else v) for k, v in state.__dict__.items()}
                for o in members:
                    trial.run(o)
                if trial.live <= state.live:
                    for o in members:
                        state.run(o)
                    cone_done[c] = True
                    progressed = True

    run_ready_cones()
    leaves = []
    for task in tasks:
        order = _leaf_order(state, task, exact_limit)
        leaves.append(tuple(order))
        for o in order:
            state.run(o)
            run_ready_cones()
    for c, members in enumerate(cones):  # cones that never released memory run last, in program order
        if not cone_done[c]:
            for o in members:
                if not state.done[o]:
                    state.run(o)
    # Candidates: the task division's order, and list schedules from the DFS and program orders;
    # the lowest peak wins, and program order when none beats it.
    candidates = {"task division": state.order}
    if list_schedules:
        candidates["list schedule (DFS)"] = _list_schedule(graph, _dfs_order(graph))
        candidates["list schedule (program order)"] = _list_schedule(graph, program)
    peaks = {}
    for name, candidate in candidates.items():
        check_order(graph, candidate)
        peaks[name] = peak(graph, candidate).peak
    method = min(peaks, key=lambda name: peaks[name])
    use_program = peaks[method] >= program_peak.peak
    order = tuple(program if use_program else candidates[method])
    return OrderPlan(
        order=order,
        peak=min(peaks[method], program_peak.peak),
        program_order_peak=program_peak.peak,
        tasks=tuple(leaves),
        cones=len(cones),
        seconds=time.perf_counter() - start,
        used_program_order=use_program,
        method="program order" if use_program else method,
        candidate_peaks=peaks,
    )
