"""The execution-plan planner (ROAM): orders, peaks, layouts, baselines, and applying a plan."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.roam import (
    CachingAllocator,
    OutOfMemory,
    accumulated_train_step,
    analyze_graph,
    build_graph,
    caching_allocator_capacity,
    check_layout,
    check_order,
    chunked_loss_train_step,
    fuse_elementwise,
    greedy_by_size,
    improve_layout,
    lifetimes,
    model_train_step,
    peak,
    plan_order,
    random_dag,
    run_caching_allocator,
    run_segmented,
    simulate_caching_allocator,
    solve_ilp,
)


def independent_peak(graph, order):
    """Liveness by brute force: step through the order with explicit sets."""
    keep = set(graph.outputs) | (set(graph.inputs) - graph.donated)
    remaining = {t: set(graph.consumers[t]) for t in range(len(graph.sizes))}
    live = {t for t in graph.inputs if graph.consumers[t] or t in keep}
    best = 0
    for o in order:
        op = graph.ops[o]
        live |= set(op.outputs)
        best = max(best, sum(graph.sizes[t] for t in live) + op.transient)
        for t in op.inputs:
            remaining[t].discard(o)
        live = {t for t in live if remaining[t] or t in keep}
    return best


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 14), st.integers(0, 10_000))
def test_planned_orders_are_valid_and_their_peaks_are_true(num_ops, seed):
    graph = random_dag(num_ops, seed)
    plan = plan_order(graph)
    check_order(graph, plan.order)
    assert plan.peak == independent_peak(graph, plan.order) == peak(graph, plan.order).peak
    assert plan.peak <= plan.program_order_peak == independent_peak(graph, range(num_ops))
    items = [(f, l, t, graph.sizes[t]) for t, (f, l) in lifetimes(graph, plan.order).items()]
    for offsets, arena in (greedy_by_size(items), improve_layout(items, rounds=8)):
        check_layout(items, offsets)
        assert arena >= plan.peak
        assert arena == max(offsets[t] + s for _, _, t, s in items)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 120))
def test_first_fit_places_alike_in_python_and_numpy(seed, n):
    # Small item lists (a rank's stash) take the plain-Python first fit, large ones the NumPy one.
    import random

    from jaxmem.layout import _place_in_order

    rng = random.Random(seed)
    items = []
    for i in range(n):
        first = rng.randrange(n)
        items.append((first, first + rng.randrange(n // 3 + 1), i, rng.choice([0, 1, 64, 128, rng.randrange(1, 999)])))
    for order in (lambda x: (-x[3], x[0], x[1]), lambda x: (x[0], -x[3], x[1]), lambda x: rng.random()):
        ordered = sorted(items, key=order)
        assert _place_in_order(ordered, small=True) == _place_in_order(ordered, small=False)


def test_check_layout_catches_overlap():
    items = [(0, 2, "a", 10), (1, 3, "b", 10)]
    with pytest.raises(ValueError, match="overlap"):
        check_layout(items, {"a": 0, "b": 5})
    check_layout(items, {"a": 0, "b": 10})


def test_check_order_catches_a_broken_dependency():
    graph = random_dag(5, 1)
    with pytest.raises(ValueError):
        check_order(graph, list(reversed(range(5))))


def test_planner_matches_the_ilp_on_small_random_dags():
    gaps, planner, ilp = [], 0.0, 0.0
    kw = {"name": "r", "layout_rounds": 64, "task_ops": 16, "exact_limit": 16}
    for seed in range(4):
        graph = random_dag(7, seed, size_range=(1 << 20, 64 << 20))
        record = analyze_graph(graph, ilp=True, ilp_time_limit=60, **kw)
        gaps.append(record["planned_arena_bytes"] / record["ilp_peak_bytes"] - 1)
        # The planner takes milliseconds here: its best of three runs, so scheduling noise does not decide.
        planner += min([record["planner_seconds"]] + [analyze_graph(graph, **kw)["planner_seconds"] for _ in range(2)])
        ilp += record["ilp_seconds"]
        assert record["planned_peak_bytes"] <= record["program_order_peak_bytes"]
    assert sum(gaps) / len(gaps) <= 0.03
    # On 7-op DAGs the ILP takes ~55x the planner's time on an idle machine (the README's 1/640 is on 9-op DAGs,
    # where the ILP grows much slower); 20x keeps the claim -- an order of magnitude faster -- without failing
    # when the other test worker's compiles share the two cores (CI once measured 45x).
    assert ilp / planner >= 20


def test_ilp_solution_is_a_valid_plan():
    graph = random_dag(6, 3)
    result = solve_ilp(graph, time_limit=30)
    check_order(graph, result.order)
    items = [(f, l, t, graph.sizes[t]) for t, (f, l) in lifetimes(graph, result.order).items()]
    check_layout(items, result.offsets)
    assert result.arena >= peak(graph, result.order).peak


def test_caching_allocator_rounds_and_reuses():
    alloc = CachingAllocator()
    alloc.malloc("a", 100)  # small pool: one 2 MiB segment
    assert alloc.reserved == 2 << 20
    alloc.malloc("b", 5 << 20)  # large request under 10 MiB: a 20 MiB segment
    assert alloc.reserved == (2 << 20) + (20 << 20)
    alloc.free("b")
    alloc.malloc("c", 4 << 20)  # reuses the cached segment
    assert alloc.reserved == (2 << 20) + (20 << 20)


@pytest.fixture(scope="module")
def tiny_step():
    step = model_train_step("tiny", batch=2, seq=32)
    graph = fuse_elementwise(build_graph(step.jaxpr(), donated=step.donated))
    return step, graph


def test_train_step_planning_is_never_worse_and_beats_the_eager_allocator(tiny_step):
    _, graph = tiny_step
    record = analyze_graph(graph, name="tiny")
    assert record["planned_peak_bytes"] <= record["program_order_peak_bytes"]
    assert record["planned_arena_bytes"] <= record["program_order_caching_allocator_bytes"]
    assert simulate_caching_allocator(graph, range(graph.num_ops)) == record["program_order_caching_allocator_bytes"]


@pytest.fixture(scope="module")
def accumulated_step():
    step = accumulated_train_step("tiny", microbatches=3, batch=2, seq=32)
    return step, fuse_elementwise(build_graph(step.jaxpr(), donated=step.donated))


def test_order_matters_where_the_train_step_leaves_it_free(accumulated_step):
    """Gradient accumulation written as a loop: program order runs every microbatch's forward first;
    the planner finishes one microbatch's backward before the next forward. A chunked loss head:
    one chunk's big-vocabulary logits at a time."""
    import dataclasses

    from jaxmem.models import get_config

    _, graph = accumulated_step
    plan = plan_order(graph)
    assert plan.method.startswith("list schedule") and not plan.used_program_order
    assert plan.peak <= 0.85 * plan.program_order_peak, (plan.peak, plan.program_order_peak)
    wide = dataclasses.replace(get_config("tiny"), vocab_size=8192, n_layers=2)
    chunked = chunked_loss_train_step(wide, chunks=8, batch=2, seq=64)
    plan = plan_order(fuse_elementwise(build_graph(chunked.jaxpr(), donated=chunked.donated)))
    assert plan.peak <= 0.95 * plan.program_order_peak, (plan.peak, plan.program_order_peak)


def test_a_reordered_plan_runs_segmented_with_the_same_outputs_and_less_memory(accumulated_step):
    step, graph = accumulated_step
    args = step.concrete_args(seed=3)
    plan = plan_order(graph)
    assert list(plan.order) != list(range(graph.num_ops))  # a reordered plan, not program order
    run = run_segmented(graph, plan.order, jax.tree.leaves(args), segments=8)
    reference = jax.tree.leaves(jax.jit(step.fn)(*args))
    # The outputs are parameters after one Adam step (lr 1e-3). Each segment compiles with its own fusions
    # and rounding; Adam's first update is g / |g|, so rounding in near-zero gradients moves an updated
    # parameter by a fraction of the learning rate: atol 5% of it.
    for got, want in zip(run.outputs, reference):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=5e-5)
    assert run.segments == 8
    assert 0.8 <= run.measured_peak_bytes / run.predicted_peak_bytes <= 1.25
    program = run_segmented(graph, range(graph.num_ops), jax.tree.leaves(args), segments=8)
    assert run.measured_peak_bytes < 0.9 * program.measured_peak_bytes, (run.measured_peak_bytes, program)


def test_the_caching_allocator_releases_its_cache_before_it_is_out_of_memory():
    mib = 1 << 20
    alloc = CachingAllocator(capacity=44 * mib)
    alloc.malloc("a", 12 * mib)  # >= 10 MiB: a segment of its own size (rounded to 2 MiB)
    alloc.malloc("b", 12 * mib)
    alloc.free("a")
    alloc.free("b")  # 24 MiB cached, nothing in use
    alloc.malloc("c", 30 * mib)  # does not fit in any cached block; 24 + 30 > 44: release, then fits
    assert alloc.releases == 1 and alloc.reserved == 30 * mib and alloc.allocated == 30 * mib
    assert alloc.peak_allocated == 30 * mib and alloc.peak_reserved == 30 * mib
    with pytest.raises(OutOfMemory):
        alloc.malloc("d", 16 * mib)  # 30 in use + 16 > 44, nothing cached to release


def test_the_caching_allocator_reports_allocated_reserved_and_the_device_it_needs(tiny_step):
    _, graph = tiny_step
    order = range(graph.num_ops)
    run = run_caching_allocator(graph, order)
    need = caching_allocator_capacity(graph, order)
    assert peak(graph, list(order)).peak <= run.allocated_peak <= need <= run.reserved_peak
    run_caching_allocator(graph, order, capacity=need)  # runs
    with pytest.raises(OutOfMemory):
        run_caching_allocator(graph, order, capacity=need - (2 << 20))


def test_the_planner_against_a_time_limited_ilp_past_the_exact_search():
    """30 ops: beyond the leaf search's exact limit; the ILP gets 10 s and gives its best and a bound."""
    graph = random_dag(30, 0, size_range=(1 << 20, 64 << 20))
    kw = {"name": "r30", "layout_rounds": 64, "task_ops": 16, "exact_limit": 16}
    record = analyze_graph(graph, ilp=True, ilp_time_limit=10, **kw)
    assert record["ilp_lower_bound_bytes"] is not None
    assert record["ilp_lower_bound_bytes"] <= record["planned_peak_bytes"] <= record["program_order_peak_bytes"]
    if record["ilp_peak_bytes"] is not None:  # the planner, in milliseconds, is no worse than 10 s of ILP here
        assert record["planned_arena_bytes"] <= record["ilp_peak_bytes"]
    # Timed in this process beside the ILP (both slow down alike when the cores are shared): the
    # planner takes at most a tenth of the ILP's time.
    assert record["planner_seconds"] * 10 <= record["ilp_seconds"]


def test_roam_analyze_cli_json(capsys):
    from jaxmem.cli import main

    code = main(["roam", "analyze", "--model", "tiny", "--batch", "2", "--seq-len", "32", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("program_order_peak_bytes", "planned_peak_bytes", "arena_bytes", "xla_bytes", "planner_seconds", "ops"):
        assert key in record
    assert record["xla_bytes"] > 0 and record["planned_peak_bytes"] <= record["program_order_peak_bytes"]


def test_big_models_are_traced_abstractly():
    step = model_train_step("gpt2-small", batch=1, seq=128)
    graph = build_graph(step.jaxpr(), donated=step.donated)
    assert graph.num_ops > 1000 and max(graph.sizes) > 100 * 2**20  # planned without allocating
