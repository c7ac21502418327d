"""Plan a graph and report it beside its baselines, with the two gains kept apart:

- order gain: program order's peak minus the planned order's peak, both perfectly packed (what the
  operator order alone saves);
- layout gain: the caching allocator's need (the smallest device it runs the planned order on, its
  cache released when it must) minus the planned arena (what the tensor layout alone saves);

plus program order on the caching allocator (the eager framework end to end), XLA's own
``memory_analysis()`` where it compiles, and the ILP where it is asked for."""

from __future__ import annotations

import time

from jaxmem._util import compiled_bytes
from jaxmem.layout import check_layout, greedy_by_size, improve_layout
from jaxmem.roam._caching import caching_allocator_capacity, run_caching_allocator
from jaxmem.roam._graph import Graph, build_graph, fuse_elementwise
from jaxmem.roam._liveness import lifetimes
from jaxmem.roam._order import plan_order

__all__ = ["analyze_graph", "analyze_step"]


def analyze_graph(
    graph: Graph,
    *,
    name: str,
    ilp: bool = False,
    ilp_time_limit: float = 60.0,
    layout_rounds: int | None = None,
    task_ops: int = 10,
    exact_limit: int = 10,
) -> dict:
    """Every baseline and the planned execution for one graph (a JSON-ready dict)."""
    program = list(range(graph.num_ops))
    start = time.perf_counter()
    plan = plan_order(graph, task_ops=task_ops, exact_limit=exact_limit)
    items = [(f, l, t, graph.sizes[t]) for t, (f, l) in lifetimes(graph, list(plan.order)).items()]
    greedy_offsets, greedy_arena = greedy_by_size(items)
    rounds = layout_rounds if layout_rounds is not None else (64 if len(items) <= 2000 else 0)
    offsets, arena = improve_layout(items, rounds=rounds)
    if greedy_arena < arena:
        offsets, arena = greedy_offsets, greedy_arena
    planner_seconds = time.perf_counter() - start
    if len(items) <= 3000:
        check_layout(items, offsets)
    eager = run_caching_allocator(graph, program)
    eager_planned = run_caching_allocator(graph, list(plan.order))
    eager_capacity = caching_allocator_capacity(graph, program)
    planned_capacity = caching_allocator_capacity(graph, list(plan.order))
    record = {
        "name": name,
        "ops": graph.num_ops,
        "tensors": len(graph.sizes),
        "program_order_peak_bytes": plan.program_order_peak,
        "program_order_caching_allocator_bytes": eager.reserved_peak,
        "program_order_caching_allocated_bytes": eager.allocated_peak,
        "program_order_caching_capacity_bytes": eager_capacity,
        "planned_caching_allocated_bytes": eager_planned.allocated_peak,
        "planned_caching_reserved_bytes": eager_planned.reserved_peak,
        "planned_caching_capacity_bytes": planned_capacity,
        "order_method": plan.method,
        "order_gain_bytes": plan.program_order_peak - plan.peak,
        "order_gain": 1 - plan.peak / plan.program_order_peak if plan.program_order_peak else 0.0,
        "layout_gain_bytes": planned_capacity - arena,
        "layout_gain": 1 - arena / planned_capacity if planned_capacity else 0.0,
        "planned_peak_bytes": plan.peak,
        "planned_arena_greedy_bytes": greedy_arena,
        "planned_arena_bytes": arena,
        "arena_bytes": arena,
        "fragmentation_bytes": arena - plan.peak,
        "planner_seconds": planner_seconds,
        "order_seconds": plan.seconds,
        "tasks": len(plan.tasks),
        "cones": plan.cones,
        "used_program_order": plan.used_program_order,
        "ilp_peak_bytes": None,
        "ilp_seconds": None,
        "xla_bytes": None,
    }
    if ilp:
        from jaxmem.roam._ilp import solve_ilp

        result = solve_ilp(graph, time_limit=ilp_time_limit)
        record["ilp_peak_bytes"] = result.arena
        record["ilp_seconds"] = result.seconds
        record["ilp_optimal"] = result.optimal
        record["ilp_lower_bound_bytes"] = result.bound
    return record


def analyze_step(step, *, compile_xla: bool = False, fuse: bool = True, **kwargs) -> dict:
    """Trace a :class:`TrainStep`, plan it, and (optionally) compile it for XLA's figure.

    With ``fuse`` (default) the graph is taken at fused-kernel granularity: chains of elementwise ops
    are one op whose intermediates are never materialised, as an eager framework's kernels and XLA's
    fusions behave; without it, every jaxpr equation materialises its result."""
    start = time.perf_counter()
    closed = step.jaxpr()
    graph = build_graph(closed, donated=step.donated)
    if fuse:
        graph = fuse_elementwise(graph)
    trace_seconds = time.perf_counter() - start
    record = analyze_graph(graph, name=step.name, **kwargs)
    record["trace_seconds"] = trace_seconds
    if compile_xla:
        start = time.perf_counter()
        import jax

        compiled = jax.jit(step.fn, donate_argnums=(0, 1)).lower(*step.args).compile()
        record["xla_bytes"] = compiled_bytes(compiled)
        record["xla_compile_seconds"] = time.perf_counter() - start
    return record


def reduction(record: dict, baseline: str = "program_order_caching_allocator_bytes") -> float:
    return 1 - record["planned_arena_bytes"] / record[baseline]
