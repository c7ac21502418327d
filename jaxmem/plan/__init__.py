"""The execution-plan planner on jaxprs (ROAM): operator order and tensor memory layout.

Pure-Python parts (graph, liveness, order, layout, caching allocator, ILP) import no JAX at module
level; tracing train steps and running plans do.
"""

from jaxmem.plan._analyze import analyze_graph as analyze_graph
from jaxmem.plan._analyze import analyze_step as analyze_step
from jaxmem.plan._caching import simulate_caching_allocator as simulate_caching_allocator
from jaxmem.plan._graph import Graph as Graph
from jaxmem.plan._graph import Op as Op
from jaxmem.plan._graph import build_graph as build_graph
from jaxmem.plan._ilp import solve_ilp as solve_ilp
from jaxmem.plan._layout import assign_offsets as assign_offsets
from jaxmem.plan._layout import check_layout as check_layout
from jaxmem.plan._layout import greedy_by_size as greedy_by_size
from jaxmem.plan._layout import improve_layout as improve_layout
from jaxmem.plan._liveness import check_order as check_order
from jaxmem.plan._liveness import lifetimes as lifetimes
from jaxmem.plan._liveness import peak as peak
from jaxmem.plan._order import OrderPlan as OrderPlan
from jaxmem.plan._order import plan_order as plan_order
from jaxmem.plan._random import random_dag as random_dag
