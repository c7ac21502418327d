"""The execution-plan planner on jaxprs (ROAM): operator order and tensor memory layout.

Pure-Python parts (graph, liveness, order, layout, caching allocator, ILP) import no JAX at module
level; tracing train steps and running plans do (importing this package imports JAX).
"""

from jaxmem.layout import assign_offsets as assign_offsets
from jaxmem.layout import check_layout as check_layout
from jaxmem.layout import greedy_by_size as greedy_by_size
from jaxmem.layout import improve_layout as improve_layout
from jaxmem.roam._analyze import analyze_graph as analyze_graph
from jaxmem.roam._analyze import analyze_step as analyze_step
from jaxmem.roam._apply import run_segmented as run_segmented
from jaxmem.roam._caching import CachingAllocator as CachingAllocator
from jaxmem.roam._caching import CachingRun as CachingRun
from jaxmem.roam._caching import OutOfMemory as OutOfMemory
from jaxmem.roam._caching import caching_allocator_capacity as caching_allocator_capacity
from jaxmem.roam._caching import run_caching_allocator as run_caching_allocator
from jaxmem.roam._caching import simulate_caching_allocator as simulate_caching_allocator
from jaxmem.roam._graph import Graph as Graph
from jaxmem.roam._graph import Op as Op
from jaxmem.roam._graph import build_graph as build_graph
from jaxmem.roam._graph import fuse_elementwise as fuse_elementwise
from jaxmem.roam._ilp import solve_ilp as solve_ilp
from jaxmem.roam._liveness import check_order as check_order
from jaxmem.roam._liveness import lifetimes as lifetimes
from jaxmem.roam._liveness import peak as peak
from jaxmem.roam._order import OrderPlan as OrderPlan
from jaxmem.roam._order import plan_order as plan_order
from jaxmem.roam._random import random_dag as random_dag
from jaxmem.roam._suite import TrainStep as TrainStep
from jaxmem.roam._suite import accumulated_train_step as accumulated_train_step
from jaxmem.roam._suite import chunked_loss_train_step as chunked_loss_train_step
from jaxmem.roam._suite import experts_train_step as experts_train_step
from jaxmem.roam._suite import model_train_step as model_train_step
