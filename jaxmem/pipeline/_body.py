"""What every rank runs inside the pipelined step's ``shard_map``: one ``lax.scan`` over its row of
the tick table, each tick running its action -- idle, or F / B / I / W of one stage class -- then
sending its message on.

Three parts, each built where its inputs are known:

- :class:`StepBody`, once per program (pipeline, batch structure, forward or not): the tick table,
  the placements, the stash layout -- nothing traced. Called inside ``shard_map`` it traces
- a :class:`_Run`: this rank's parameters, batch and key, the actions over them (:meth:`_Run.branch`:
  a forward writes its residuals into the stash arenas in place, a backward adds to the gradient
  accumulators in place), the tick (:meth:`_Run.tick`), the scan and the gradients' last sums;
- :class:`_VocabEnds`: with the vocabulary split over the ranks, the embedding lookup and the head's
  loss that every rank computes a slice of at the first and last stages' ticks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmem._errors import JaxmemError
from jaxmem._util import platform_of, unvarying, varying_axes, vma_check_off
from jaxmem.models import microbatch_key, stage_key
from jaxmem.pipeline import _vocab
from jaxmem.pipeline._cut import CutArena, as_rows
from jaxmem.pipeline._iw import TRANSFER_SPACE, StageSplit, stage_split
from jaxmem.pipeline._placement import AXES, CONTEXT, LeafPlacement, is_placement
from jaxmem.pipeline._residuals import ResidualPlan, analyze_stage, host_tile_elems, host_tile_shape
from jaxmem.pipeline._split import vocab_size as _vocab_size
from jaxmem.pipeline._ticks import COLUMNS, StageClass, stash_cut, stash_rows
from jaxmem.schedule import Kind

__all__ = ["StepBody", "to_device", "vary", "vary_like", "vary_tree", "varying_axes"]


# Buffers smaller than this are left for XLA to copy when a cond's other side hands them back
# (messages, loss totals): what a copy costs is nothing beside an action's work.
_TOUCHED_BYTES = 1 << 16


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the enclosing ``shard_map`` is manual over (``data``, ``fsdp``, ``pipe``, and
    ``context`` where the mesh has it)."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes) or AXES


def vary(x: jax.Array) -> jax.Array:
    """Mark ``x`` as varying over every mesh axis (no data movement), so cond branches agree and no
    autodiff transpose inserts a collective inside a branch."""
    missing = tuple(a for a in manual_axes() if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x: jax.Array, aval) -> jax.Array:
    """Mark ``x`` as varying over the mesh axes ``aval`` varies over."""
    axes = tuple(a for a in manual_axes() if a in varying_axes(aval) and a not in varying_axes(x))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def vary_tree(tree):
    return jax.tree.map(vary, tree)


# A value typed as one computed inside unchecked is (varying over no axis), so every value an
# action's stage math reads and makes is typed alike (JAX's own sums of cotangents assert it).
_bare = unvarying


def _bare_tree(tree):
    return jax.tree.map(_bare, tree)


def unchecked():
    """Trace without JAX's check of the mesh axes each value varies over (``check_vma``), inside the
    step's ``shard_map`` (:func:`jaxmem._util.vma_check_off`). A stage's actions run in it: every input
    they read is marked varying over every axis (:func:`vary`), so the types carry no information
    there, and a model's own code may then start a ``lax.scan`` carry from a constant (``jnp.zeros``),
    as it may outside a ``shard_map``, without the ``pcast`` to jaxmem's axes JAX would otherwise ask
    for. What an action hands back is typed again as it came in (:func:`_Run.branch`); nothing is
    differentiated across that edge (a stage's backward is its own traced pullback, run inside the
    action)."""
    return vma_check_off()


def to_device(tree):
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


def _gather(leaf, p: LeafPlacement, dropped: int = 0):
    """A leaf whole over ``fsdp`` (``dropped``: leading dimensions the local value lacks)."""
    dim = p.fsdp_dim
    return leaf if dim is None else jax.lax.all_gather(leaf, "fsdp", axis=dim - dropped, tiled=True)


def reduce_scatter(x, axis, dim: int, sum_then_slice: bool = False):
    """``x`` summed over ``axis`` and cut along ``dim`` to this device's part: ``psum_scatter``, or with
    ``sum_then_slice`` its equal as a ``psum`` and this device's slice. On XLA:CPU with gloo between
    processes (jax 0.10.2) a program that reduce-scatters stalls its collective-permutes, about 100 ms
    each: ten ``ppermute`` ticks and one reduce-scatter of 64 floats over two processes take 1.12 s a
    step, with the sum and slice 8 ms (issue 67); the pipelined step's tick loop is such a program
    (0.26 -> 1.64 s a step of the tiny GPT on pipe 2 over two processes). The sum moves twice the bytes
    of the scatter, so only CPU programs spanning processes take it (:attr:`Pipeline.sum_then_slice`)."""
    if not sum_then_slice:
        return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    whole = jax.lax.psum(x, axis)
    n = whole.shape[dim] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(axis) * n, n, axis=dim)


def _scatter(grad, p: LeafPlacement, dropped: int = 0, sum_then_slice: bool = False):
    """A whole gradient summed over ``fsdp`` and cut back to this device's shard."""
    dim = p.fsdp_dim
    return grad if dim is None else reduce_scatter(grad, "fsdp", dim - dropped, sum_then_slice)


def _finish(g, p: LeafPlacement, scale, whole: bool = False, sum_then_slice: bool = False):
    """Sum a gradient over the leaf's replicas, reduce-scattering where its state is cut (``whole``:
    accumulated whole over ``fsdp``, cut back to this device's shard first), times ``scale``."""
    if whole and p.fsdp_dim is not None:
        g = reduce_scatter(g, "fsdp", p.fsdp_dim, sum_then_slice)
    for axis, dim in p.scatters():
        g = reduce_scatter(g, axis, dim, sum_then_slice)
    if p.sums():
        g = jax.lax.psum(g, p.sums())
    return (g * scale).astype(g.dtype)


def prefetch_columns(table: np.ndarray, col: dict, host_stages) -> np.ndarray:
    """``[ranks, ticks, 2]``: per tick, the local stage (on host) whose weights the rank fetches,
    beside the tick's action, for its next action on such a stage: at the ticks of its actions on
    stages on host whose next such action runs another stage, else -1 (the slot keeps what it
    holds); and, constant, the stage the rank's first such action runs (fetched before the first
    tick)."""
    ranks, ticks = table.shape[:2]
    out = np.full((ranks, ticks, 2), -1, np.int64)
    for r in range(ranks):
        acting = (table[r, :, col["branch"]] != 0) & np.isin(table[r, :, col["local_stage"]], host_stages)
        times = [t for t in range(ticks) if acting[t]]
        stages = [int(table[r, t, col["local_stage"]]) for t in times]
        for t, prev, nxt in zip(times, stages, stages[1:]):
            if nxt != prev:  # fetched beside the action before, as the cost model has it
                out[r, t, 0] = nxt
        out[r, :, 1] = stages[0] if stages else -1
    return out


class StepBody:
    """The body of one pipelined program: ``body(stage_params, shared, vocab, batch, table, vocab_table,
    rng)`` inside ``shard_map``, giving ``loss`` (``forward``) or ``(loss, grads, shared_grads,
    vocab_grads)``. Holds what is fixed when the program is built; :attr:`table` and
    :attr:`vocab_ticks` are the tick tables to pass in. ``tokens_global``: what the mean loss of the
    whole batch divides by, before a loss mask (its targets, or its examples)."""

    def __init__(self, pipeline, spec: dict, forward: bool, tokens_global: int):
        tick, _ = pipeline.program(spec, forward=forward)
        self.pipeline, self.tick, self.forward = pipeline, tick, forward
        self.microbatches = pipeline.schedule.num_microbatches
        spec = pipeline.local_spec(spec)  # what one device holds: part of every sequence on a context axis
        self.microbatch = pipeline.check_batch(spec)
        self.col = {name: i for i, name in enumerate(COLUMNS)}
        self.keys = tick.stash_keys
        self.stash_cols = [tick.stash_column(ki) for ki in range(len(self.keys))]
        self.transfer_cols = [tick.transfer_column(ki) for ki in range(len(self.keys))]
        # Split backwards (I and W) share their work through the arenas (jaxmem.pipeline._iw):
        # whenever the tick program laid out what an I hands its W.
        self.split_backward = pipeline.splits_backward and not forward
        self.transfer_arenas = {key[0]: i for i, key in enumerate(self.keys) if key[1] == TRANSFER_SPACE}  # by dtype
        if tick.table.max(initial=0) >= 2**31 or max(tick.arena_elems, default=0) >= 2**31:
            raise JaxmemError(
                f"a stash arena of {max(tick.arena_elems):,} elements exceeds what int32 indexing reaches (2^31); "
                "use more pipeline stages or microbatches (smaller microbatches), or a recompute policy"
            )
        self.message_spec = pipeline.message_spec(spec)
        # The cotangent of every microbatch's loss_sum: 1 / (the global batch's target count, or its
        # example count), so that unweighted gradients come out exactly as the mean loss's; weighted
        # (masked) ones are rescaled at the end.
        self.tokens_global = tokens_global
        self.ct_scale = 1.0 / self.tokens_global
        self.stage_ids = jnp.asarray([pipeline.schedule.stages_of(r) for r in range(pipeline.pipe)], jnp.int32)
        # The stages read ``abstract`` (the compute copy with master_cut); the gradients accumulate in
        # the master weights' dtypes.
        placement = pipeline.placement
        self.abstract, self.master = pipeline.stage_abstract(), pipeline.abstract_params()
        # Weights on host come to the device one action ahead (prefetch_columns): two more columns.
        # (A stage kept gathered under FSDP fetches its weights once, before the ticks.)
        self.host_stages = tuple(
            v for v, (h, kept) in enumerate(zip(pipeline.weights_on_host, pipeline.kept_gathered)) if h and not kept
        )
        table = tick.table
        if self.prefetches():
            table = np.concatenate([table, prefetch_columns(table, self.col, self.host_stages)], axis=-1)
            self.col["prefetch"], self.col["prefetch_first"] = table.shape[-1] - 2, table.shape[-1] - 1
        self.table = jnp.asarray(table.astype(np.int32))
        self.stage_places = [jax.tree.leaves(t, is_leaf=is_placement) for t in placement.stages]
        self.shared_places = jax.tree.leaves(placement.shared, is_leaf=is_placement)
        self.vocab_places = jax.tree.leaves(placement.vocab, is_leaf=is_placement)
        self.shared_treedef = jax.tree.structure(self.abstract.shared)
        # With a tensor axis the device arenas are cut over it, ``[tensor, rows]``: a residual the
        # stage computes cut stays each device's share, the others are kept whole on every device
        # and their flat vector is cut in pieces, gathered back in the backward (CutArena). Whole
        # residuals are pinned replicated: a flat vector of a cut array has no cut of its own, and
        # resharding one inside a branch would put collective-permutes where only some ranks run.
        tensor = pipeline.tensor
        self.pin = (lambda v: jax.lax.with_sharding_constraint(v, P())) if tensor > 1 else None
        self.cuts = [stash_cut(key, tensor) for key in self.keys]
        self.cut_keys = [key for key, c in zip(self.keys, self.cuts) if c > 1]
        # XLA's CPU compiler aborts promoting a 16-bit all-reduce that the partitioner gave a copy at
        # its reduction's root (jax 0.10.2, a tensor axis): there, the pipe sums run in float32.
        self.platform = platform_of(pipeline.mesh)
        self.widen_sums = tensor > 1 and self.platform == "cpu"
        # Host arenas on an accelerator: a residual is laid out for its arena on the device (raveled;
        # on a TPU padded to whole tiles, ``[tiles, sublanes, 128]``) and copied to host in one
        # piece, and a backward copies its slot back to the device before unpacking it: every
        # access to host memory is a copy of a whole slot (XLA runs a slice of host memory as host
        # compute). The arena itself is a broadcast of a zero already on host, so that its zeros are
        # never made on the device (zeros moved to host are: the whole arena on the device for a
        # moment, the bytes the offload keeps off it). XLA:CPU keeps "host" buffers in the same
        # memory: it slices them in place.
        self.host_tiles = self.platform == "tpu"
        self.host_slots_to_device = self.platform != "cpu"
        # XLA's GPU compiler copies a buffer that one side of a two-way cond updates in place and the
        # other hands back unchanged: each tick's conds would copy the stash arenas (twice the arena
        # in memory, and a copy of it at every tick). When the other side updates the arena in place
        # too -- one element set to its own value, behind a predicate XLA cannot see is false -- it
        # keeps it in place, as XLA's CPU and TPU compilers do without it (:meth:`_Run.idle_for`).
        # (The gradient accumulators, which a backward adds to rather than updates in a slice, it
        # still copies there: a stage's gradients each tick that runs a backward.)
        self.idle_touches = self.platform == "gpu"
        self.vocab_split = pipeline.vocab
        self.vocab_ticks = jnp.asarray(tick.vocab_ticks.astype(np.int32))
        schedule = pipeline.schedule
        self.first_rank = schedule.stage_to_rank[0]
        self.last_rank = schedule.stage_to_rank[schedule.num_stages - 1]
        self.vocab_size = _vocab_size(pipeline.model) if self.vocab_split is not None else 0

    def prefetches(self) -> bool:
        """Whether the weights on host are fetched an action ahead, into one loop-carried slot: when
        some are, and every local stage on host has the same shapes (else each action fetches its
        own, inside its branch)."""
        if not self.host_stages:
            return False
        avals = {
            tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(self.abstract.stages[v])) for v in self.host_stages
        }
        structures = {jax.tree.structure(self.abstract.stages[v]) for v in self.host_stages}
        return len(avals) == 1 and len(structures) == 1

    def cut_arena(self, c: StageClass, plan: ResidualPlan) -> CutArena | None:
        """Where class ``c``'s residuals sit in the cut arenas (None: no tensor axis)."""
        if not self.cut_keys:
            return None
        return CutArena.of_stash(plan, self.param_dims(c.local), self.pipeline.tensor, self.cut_keys)

    def param_dims(self, local: int) -> list:
        """The dimension the tensor axis cuts of each leaf of local stage ``local``'s parameters (as a
        stage reads them, without the dimension the stages are stacked on), then of each shared leaf."""
        dims = [None if p.tensor_dim is None else p.tensor_dim - 1 for p in self.stage_places[local]]
        return dims + [p.tensor_dim for p in self.shared_places]

    def __call__(self, stage_params, shared, vocab, batch, table_local, vocab_table, rng):
        return _Run(self, stage_params, shared, vocab, batch, rng).scan(table_local, vocab_table)


class _Run:
    """One trace of the body on a rank: its parameters, batch and key, and the actions over them."""

    def __init__(self, body: StepBody, stage_params, shared, vocab, batch, rng):
        pipeline = body.pipeline
        self.body, self.rng = body, rng
        self.stage_params = tuple(vary_tree(jax.tree.map(lambda a: a[0], tree)) for tree in stage_params)
        self.shared = vary_tree(shared)
        self.vocab = jax.tree.map(lambda a: vary(a[0]), vocab)
        self.shared_leaves = jax.tree.leaves(self.shared)
        M, mb = body.microbatches, body.microbatch
        self.batch = jax.tree.map(lambda a: vary(a.reshape(M, mb, *a.shape[1:])), batch)
        self.x_like = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), body.message_spec)
        self.zero = vary(jnp.zeros((), jnp.float32))
        # A stage whose policy keeps its weights gathered gathers them once, here, before the ticks.
        self.kept = [self.gathered_params(v) if keep else None for v, keep in enumerate(pipeline.kept_gathered)]
        self.slot = None  # with a prefetch: the tick's weights from host, set by each tick
        first_mb = self.with_key(jax.tree.map(lambda a: a[0], self.batch), 0, 0)
        # Trace the residual plans again here, with this program's (varying) types.
        abstract = body.abstract
        whole_stages = [
            self.whole_like(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), t))
            for t in abstract.stages
        ]
        with unchecked():  # the stage's own math, as the actions run it (see unchecked)
            self.bare_x_like = _bare_tree(self.x_like)
            self.plans = self._plans(whole_stages, first_mb)
        self.splits: dict[StageClass, tuple] = {}  # per class, its backward split into I and W, and its cut
        self._updated: dict[int, tuple] = {}  # per branch, which state leaves it updates (idle_for)
        self.branches = [self.branch(ci, kind) for ci, kind in body.tick.branches]  # branch 0 is idle
        branches = body.tick.branches
        # Writers of the arenas before their readers: forwards (the stash), then I (what it hands W).
        rank = {Kind.F: 0, Kind.I: 1}
        self.forwards_first = sorted(range(1, len(self.branches) + 1), key=lambda b: rank.get(branches[b - 1][1], 2))
        self.pipe_index = jax.lax.axis_index("pipe")
        self.ends = None if body.vocab_split is None else _VocabEnds(self)

    def _plans(self, whole_stages, first_mb) -> list[ResidualPlan]:
        """Each stage class's residual plan, traced again with this program's types."""
        body, pipeline = self.body, self.body.pipeline
        return [
            analyze_stage(
                pipeline.stage_fn(c),
                whole_stages[c.local],
                self.whole_like(body.abstract.shared),
                self.bare_x_like,
                _bare_tree(first_mb),
                stash_to_host=pipeline._stash_to_host(c),
                host_tiles=body.host_tiles,
            )
            for c in body.tick.classes
        ]

    # ------------------------------------------------------------------ what a stage reads
    def gathered_params(self, v, fetched=None):
        """Local stage ``v``'s parameters on the device, whole (gathered over ``fsdp``); ``fetched``:
        its weights on host already brought to the device (the prefetch slot)."""
        pipeline = self.body.pipeline
        params = self.stage_params[v]
        if pipeline.weights_on_host[v]:
            params = to_device(params) if fetched is None else fetched
        leaves, treedef = jax.tree.flatten(params)
        return treedef.unflatten([_gather(a, p, 1) for a, p in zip(leaves, self.body.stage_places[v])])

    def device_params(self, v):
        if self.body.pipeline.kept_gathered[v]:
            return self.kept[v]
        return self.gathered_params(v, self.slot if self.body.pipeline.weights_on_host[v] else None)

    def fetch(self, slot, stage):
        """``slot`` holding the weights of local ``stage`` (on host) brought to the device; unchanged
        where ``stage`` is -1. One two-way cond per stage on host: its other side keeps the slot in
        place."""
        for v in self.body.host_stages:
            slot = jax.lax.cond(
                stage == v,
                lambda s, v=v: jax.tree.map(lambda a, b: vary_like(a, b), to_device(self.stage_params[v]), s),
                lambda s: s,
                slot,
            )
        return slot

    def whole_like(self, tree):
        """Zeros of the whole (unsharded) shapes: for tracing, and for the shared leaves a stage does
        not read (never materialised: nothing uses them)."""
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), tree)

    def shared_for(self, plan: ResidualPlan):
        """The shared leaves a stage reads, gathered; zeros (unused) for the others."""
        body = self.body
        leaves = [
            _gather(a, p) if used else vary(jnp.zeros(full.shape, full.dtype))
            for a, p, used, full in zip(
                self.shared_leaves, body.shared_places, plan.used_shared, jax.tree.leaves(body.abstract.shared)
            )
        ]
        return body.shared_treedef.unflatten(leaves)

    def with_key(self, micro, microbatch, local_stage):
        """The microbatch with its stage's key (models that draw random numbers)."""
        body = self.body
        if not body.pipeline.model.rng:
            return micro
        replica = jax.lax.axis_index("data") * body.pipeline.fsdp + jax.lax.axis_index("fsdp")
        if body.pipeline.context > 1:  # each device of a context axis draws for its own tokens
            replica = replica * body.pipeline.context + jax.lax.axis_index(CONTEXT)
        key = microbatch_key(self.rng, replica, microbatch, body.microbatches)
        stage = body.stage_ids[jax.lax.axis_index("pipe"), local_stage]
        return {**micro, "rng": stage_key(key, stage)}

    # ------------------------------------------------------------------ what an action writes
    def stash(self, arena, packed, off):
        """A forward's residuals written in place at their offset, over nothing else: each residual by
        itself (``[(leaf, value), ...]``), or a cut arena's packed rows. None: the forward stashes
        nothing in this arena. A TPU's host arena is ``[tiles, sublanes, 128]``: its residuals arrive
        tiled (:meth:`host_put`) and are written a whole tile at a time."""
        if packed is None:
            return arena
        if isinstance(packed, list):  # no concatenated copy: every residual goes straight in
            pin = self.body.pin
            for leaf, value in packed:
                if arena.ndim == 3:  # TPU host tiles
                    row = (off + leaf.offset) // host_tile_elems(leaf.dtype)
                    arena = jax.lax.dynamic_update_slice_in_dim(arena, value, row, 0)
                    continue
                value = jnp.ravel(value if pin is None else pin(value))
                arena = jax.lax.dynamic_update_slice_in_dim(arena, value, off + leaf.offset, 0)
            return arena
        return jax.lax.dynamic_update_slice_in_dim(arena, packed, off, arena.ndim - 1)

    def host_put(self, leaf, value):
        """A residual bound for a host arena on an accelerator, laid out as its arena holds it on the
        device (raveled; on a TPU padded to whole tiles) and copied to host in one piece."""
        body = self.body
        if leaf.memory_space == "host":  # the policy's own offload left it on host: lay it out on the device
            value = jax.device_put(value, jax.memory.Space.Device)
        value = jnp.ravel(value if body.pin is None else body.pin(value))
        if body.host_tiles:
            tile = host_tile_elems(leaf.dtype)
            padded = -(-value.size // tile) * tile
            value = jnp.pad(value, (0, padded - value.size)).reshape(padded // tile, *host_tile_shape(leaf.dtype))
        return jax.device_put(value, jax.memory.Space.Host)

    def read_slot(self, key, arena, off, n):
        """A backward's slot of ``n`` elements at ``off`` of a stash arena: on an accelerator a host
        slot is copied to the device in one piece (a TPU's whole tiles), flat."""
        if key[1] != "host" or not self.body.host_slots_to_device:
            return jax.lax.dynamic_slice_in_dim(arena, off, n, axis=arena.ndim - 1)
        if arena.ndim == 3:
            tile = host_tile_elems(key[0])
            slot = jax.lax.dynamic_slice_in_dim(arena, off // tile, -(-n // tile), axis=0)
            return jax.device_put(slot, jax.memory.Space.Device).reshape(-1)[:n]
        return jax.device_put(jax.lax.dynamic_slice_in_dim(arena, off, n, axis=0), jax.memory.Space.Device)

    def accumulate(self, grads, shared_grads, local: int, plan: ResidualPlan, d_params, d_shared):
        """Add a backward's gradients to the accumulators (cut to this device's fsdp shard)."""
        body = self.body
        grads = list(grads)
        leaves, treedef = jax.tree.flatten(d_params)
        acc = jax.tree.leaves(grads[local])
        sliced = body.pipeline.sum_then_slice
        cut = (lambda d, p: d) if body.pipeline.kept_gathered[local] else (lambda d, p: _scatter(d, p, 1, sliced))
        grads[local] = treedef.unflatten(
            [a + vary(cut(d.astype(a.dtype), p)) for a, d, p in zip(acc, leaves, body.stage_places[local])]
        )
        shared_acc = jax.tree.leaves(shared_grads)
        shared_grads = body.shared_treedef.unflatten(
            [
                a + vary(_scatter(d.astype(a.dtype), p, sum_then_slice=sliced)) if used else a
                for a, d, p, used in zip(shared_acc, jax.tree.leaves(d_shared), body.shared_places, plan.used_shared)
            ]
        )
        return tuple(grads), shared_grads

    # ------------------------------------------------------------------ the actions
    def branch(self, class_index: int, kind: Kind):
        """Action ``kind`` of a stage class as ``(state, offs, x_in, g_in, micro) -> state``, the state
        being ``(message, arenas, grads, shared_grads, totals)``. A forward writes its residuals into the
        arenas and a backward adds to the gradient accumulators, both in place: every branch runs in a
        two-way ``lax.cond`` whose other side hands the state back untouched (see :meth:`tick`)."""
        c, plan = self.body.tick.classes[class_index], self.plans[class_index]
        arena = self.body.cut_arena(c, plan)
        if kind is Kind.F:
            action = functools.partial(self._forward, c, plan, arena)
        else:
            rows = stash_rows(plan.stash_elems, self.body.pipeline.tensor)
            action = functools.partial(self._backward, c, plan, arena, rows, kind)

        def run(state, *args):
            with unchecked():
                new = action(state, *args)
            return jax.tree.map(vary_like, new, state)  # typed as the state came in

        return run

    def _forward(self, c: StageClass, plan: ResidualPlan, arena, state, offs, x_in, g_in, micro):
        body = self.body
        offs, _ = offs
        message, arenas, grads, shared_grads, totals = state
        params = self.device_params(c.local)
        shared_in = self.shared_for(plan)
        pin = body.pin
        pack = (lambda key, parts: parts) if arena is None else functools.partial(arena.pack, pin=pin)
        host_put = self.host_put if body.host_slots_to_device else None
        params, shared_in, x_in, micro = _bare_tree((params, shared_in, x_in, micro))  # see unchecked
        out, packed = plan.forward(params, shared_in, x_in, micro, pin=pin, pack=pack, host_put=host_put)
        arenas = tuple(self.stash(buf, packed.get(key), off) for key, buf, off in zip(body.keys, arenas, offs))
        if c.last and body.vocab_split is None:
            loss_sum, weight = out
            totals = (totals[0] + vary(loss_sum), totals[1] + vary(weight))
        else:  # a split vocabulary's head takes the last stage's output after the ticks' branches
            message = vary_tree(out)
        return (message, arenas, grads, shared_grads, totals)

    def _backward(self, c: StageClass, plan: ResidualPlan, arena, rows, kind: Kind, state, offs, x_in, g_in, micro):
        body = self.body
        offs, transfer_offs = offs
        message, arenas, grads, shared_grads, totals = state
        params = self.device_params(c.local)
        shared_in = self.shared_for(plan)
        pin = body.pin
        current = {
            key: jax.lax.dynamic_slice_in_dim(buf, off, rows[key], axis=buf.ndim - 1)
            if cut > 1
            else self.read_slot(key, buf, off, n)
            for key, buf, off, cut in zip(body.keys, arenas, offs, body.cuts)
            if (n := plan.stash_elems.get(key))
        }
        unpack = None if arena is None else arena.unpacker(pin)
        params, shared_in, micro, current = _bare_tree((params, shared_in, micro, current))  # see unchecked
        pullback = plan.pullback(params, shared_in, self.bare_x_like, micro, current, pin=pin, unpack=unpack)
        if c.last and body.vocab_split is None:
            # Typed like the outputs (a constant weight varies over no mesh axis).
            loss_aval, weight_aval = plan.out_avals
            ct = (
                vary_like(jnp.full(loss_aval.shape, body.ct_scale, loss_aval.dtype), loss_aval),
                vary_like(jnp.zeros(weight_aval.shape, weight_aval.dtype), weight_aval),
            )
        else:
            # A leaf the stage sends on that depends on nothing varying (a constant, say a counter it
            # starts) has no gradient to carry back: its cotangent is a zero typed like it (the one
            # sent back varies like every message).
            leaves, treedef = jax.tree.flatten(g_in)
            ct = treedef.unflatten(
                [
                    g if moved else vary_like(jnp.zeros(a.shape, a.dtype), a)
                    for g, a, moved in zip(leaves, plan.out_avals, plan.out_inputs, strict=True)
                ]
            )
        ct = jax.tree.map(_bare, ct)  # typed as the pullback's own trace typed its output (see unchecked)
        # The first stage's input gradient goes to a split vocabulary's table (after the conds).
        no_input_grad = (c.first and body.vocab_split is None) or kind is Kind.W
        if kind is Kind.B or not body.split_backward:
            d_params, d_shared, d_x = pullback(ct)
        else:  # I runs the cotangents' chain once and hands W what its weight gradients read
            args = (params, shared_in, micro, current, ct)
            split, cut = self.stage_split(c, plan, arena, args)
            by_dtype = {name: arenas[i] for name, i in body.transfer_arenas.items()}
            base = {name: transfer_offs[i] for name, i in body.transfer_arenas.items()}
            if kind is Kind.I:
                d_x, transfers = split.input_grad(args)
                written = split.hand_over(by_dtype, base, transfers, cut, pin)
                arenas = list(arenas)
                for name, i in body.transfer_arenas.items():
                    arenas[i] = written[name]
                arenas = tuple(arenas)
            else:
                d_params, d_shared = split.weight_grads(args, split.take_over(by_dtype, base, cut, pin))
        if not no_input_grad:
            message = vary_tree(d_x)
        if kind is not Kind.I:
            grads, shared_grads = self.accumulate(grads, shared_grads, c.local, plan, d_params, d_shared)
        return (message, arenas, grads, shared_grads, totals)

    def stage_split(
        self, c: StageClass, plan: ResidualPlan, arena: CutArena | None, args
    ) -> tuple[StageSplit, CutArena | None]:
        """Class ``c``'s backward split into I and W (traced once, by whichever runs first), and where
        its transfers sit in arenas cut over a tensor axis (None: no tensor axis). ``arena``: where
        its stash sits (:meth:`StepBody.cut_arena`)."""
        if c not in self.splits:
            body = self.body
            unpack = None if arena is None else arena.unpacker(body.pin)

            def backward(params, shared_in, micro, current, ct):
                return plan.pullback(params, shared_in, self.bare_x_like, micro, current, pin=body.pin, unpack=unpack)(
                    ct
                )

            input_grad = not (c.first and body.vocab_split is None)
            split = stage_split(backward, *args, input_grad=input_grad, hand_recomputed=body.pipeline.hand_recomputed)
            cut = None
            if body.cut_keys:
                _, _, micro, current, ct = args
                dims = body.param_dims(c.local) + [None] * len(jax.tree.leaves(micro))
                dims += [0 if key in body.cut_keys else None for key in sorted(current)]
                dims += [None] * len(jax.tree.leaves(ct))
                cut = split.transfer_arena(dims, body.pipeline.tensor)
            laid_out = body.tick.class_transfer_elems[body.tick.classes.index(c)]
            need = split.transfer_elems() if cut is None else cut.columns
            if any(n > laid_out.get(key, 0) for key, n in need.items()):
                raise JaxmemError(
                    f"internal: stage class {c.label}'s I hands its W {need} elements, but the tick program laid "
                    f"out {laid_out}; please report this with the model and schedule"
                )
            self.splits[c] = split, cut
        return self.splits[c]

    def idle_for(self, b: int, state, offs, x_in, g_in, micro):
        """The other side of branch ``b``'s cond: the state handed back unchanged -- on a GPU with every
        buffer the branch updates in place touched in place too (see :class:`StepBody`)."""
        if not self.body.idle_touches:
            return lambda s, *_: s
        if b not in self._updated:
            closed = jax.make_jaxpr(self.branches[b - 1])(state, offs, x_in, g_in, micro)
            n = len(jax.tree.leaves(state))
            ins, outs = closed.jaxpr.invars[:n], closed.jaxpr.outvars
            # The arenas (the state's second entry): the buffers the branch writes a slice of.
            first = len(jax.tree.leaves(state[0]))
            arenas = range(first, first + len(jax.tree.leaves(state[1])))
            self._updated[b] = tuple(o is not i and k in arenas for k, (o, i) in enumerate(zip(outs, ins, strict=True)))
        updated = self._updated[b]
        never = vary(jax.lax.optimization_barrier(jnp.zeros((), bool)))

        def touch(leaf):
            if leaf.ndim == 0 or leaf.size * leaf.dtype.itemsize < _TOUCHED_BYTES:
                return leaf  # copying it is cheap
            corner = (0,) * leaf.ndim
            first = jax.lax.dynamic_slice(leaf, corner, (1,) * leaf.ndim)
            bumped = first + jnp.ones((), leaf.dtype) if leaf.dtype != jnp.bool_ else ~first
            return jax.lax.dynamic_update_slice(leaf, jnp.where(never, bumped, first), corner)

        def idle(s, *_):
            leaves, treedef = jax.tree.flatten(s)
            return treedef.unflatten([touch(a) if u else a for a, u in zip(leaves, updated, strict=True)])

        return idle

    # ------------------------------------------------------------------ the ticks
    def read(self, buffers, slot):
        return jax.tree.map(lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False), buffers)

    def write(self, buffers, value, slot):
        return jax.tree.map(lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v, slot, 0), buffers, value)

    def tick(self, carry, rows):
        """One tick: this rank's action, the split vocabulary's ends, then the messages sent on."""
        body, col, ends = self.body, self.body.col, self.ends
        row, vocab_row = rows
        act_buf, grad_buf, arenas, grads, shared_grads, vocab_grads, totals, slot = carry
        self.slot = slot
        micro = self.with_key(
            self.read(self.batch, row[col["microbatch"]]), row[col["microbatch"]], row[col["local_stage"]]
        )
        x_in = self.read(act_buf, row[col["act_in"]])
        if ends is not None:
            x_in = ends.embed_rows(x_in, vocab_row[0])
        g_in = self.read(grad_buf, row[col["grad_in"]])
        offs = (tuple(row[c] for c in body.stash_cols), tuple(row[c] for c in body.transfer_cols))
        # One two-way cond per branch, not one n-way switch: XLA keeps a buffer in place across a cond
        # whose other side returns it unchanged, where an n-way switch copies every buffer it passes
        # through (the arenas and accumulators, on every tick). The forwards come first: a backward
        # that read an arena before a later forward's cond wrote it would make XLA copy the arena for
        # that write (measured: a copy per tick without this order). Exactly one cond runs its branch;
        # on an idle tick none does and the message stays zeros.
        state = (self.x_like, arenas, grads, shared_grads, totals)
        for b in self.forwards_first:
            idle = self.idle_for(b, state, offs, x_in, g_in, micro)
            state = jax.lax.cond(row[col["branch"]] == b, self.branches[b - 1], idle, state, offs, x_in, g_in, micro)
        message, arenas, grads, shared_grads, totals = state
        if slot is not None and len(body.host_stages) > 1:  # the next stage's weights, beside this action
            slot = self.fetch(slot, row[col["prefetch"]])
        if ends is not None and body.forward:
            totals = ends.head_loss(totals, message, vocab_row[2])
        elif ends is not None:
            vocab_grads = ends.embed_grads(vocab_grads, message, vocab_row[1])
            vocab_grads, grad_buf, totals = ends.head(vocab_grads, grad_buf, totals, message, row, vocab_row[2])
        act_buf = self.write(act_buf, message, row[col["local_act"]])
        grad_buf = self.write(grad_buf, message, row[col["local_grad"]])
        pipe_size = body.pipeline.pipe
        for k, offset in enumerate(body.tick.offsets):
            sending = row[col["send"]] == k
            outgoing = jax.tree.map(lambda m, s=sending: jnp.where(s, m, jnp.zeros_like(m)), message)
            perm = [(r, (r + offset) % pipe_size) for r in range(pipe_size)]
            incoming = jax.tree.map(lambda m, p=perm: jax.lax.ppermute(m, "pipe", p), outgoing)
            act_col, grad_col = body.tick.recv_columns(k)
            act_buf = self.write(act_buf, incoming, row[act_col])
            grad_buf = self.write(grad_buf, incoming, row[grad_col])
        return (act_buf, grad_buf, arenas, grads, shared_grads, vocab_grads, totals, slot), None

    def first_slot(self, table):
        """The prefetch slot before the first tick: the weights of the rank's first action on a stage
        on host (None: no prefetch)."""
        body = self.body
        if "prefetch" not in body.col:
            return None
        # This device's shard of the weights (cut over fsdp, as the slot holds them before the gather).
        like = self.stage_params[body.host_stages[0]]
        empty = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), like)
        return self.fetch(empty, table[0, body.col["prefetch_first"]])

    def scan(self, table_local, vocab_table):
        """The ticks over this rank's rows of the table (``table_local``: ``[1, ticks, columns]``), from
        empty buffers and zero gradients; the loss (``forward``), or the loss and the gradients summed
        over their replicas."""
        body, tick, pipeline = self.body, self.body.tick, self.body.pipeline

        def arena_buffer(key, length, c):
            dtype_name, space = key
            if c > 1:
                return vary(as_rows(jnp.zeros((c * length,), jnp.dtype(dtype_name)), c))
            if space == "host" and body.host_slots_to_device:  # zeros made on host (see StepBody)
                shape = (length,)
                if body.host_tiles:
                    shape = (-(-length // host_tile_elems(dtype_name)), *host_tile_shape(dtype_name))
                # (behind a barrier, so that XLA does not fold it into a constant arena it then copies)
                zero = jax.lax.optimization_barrier(jnp.zeros((), jnp.dtype(dtype_name)))
                return vary(jnp.broadcast_to(jax.device_put(zero, jax.memory.Space.Host), shape))
            buf = vary(jnp.zeros((length,), jnp.dtype(dtype_name)))
            return jax.device_put(buf, jax.memory.Space.Host) if space == "host" else buf

        def accumulators(local, like):
            """Zero gradients of the local values' shapes, in the master weights' dtypes."""
            return jax.tree.map(lambda a, m: vary(jnp.zeros(a.shape, m.dtype)), local, like)

        def message_buffer(slots):
            return jax.tree.map(lambda a: vary(jnp.zeros((slots + 1, *a.shape), a.dtype)), body.message_spec)

        kept_gathered = pipeline.kept_gathered
        if body.forward:  # no gradients to accumulate
            grads = shared_grads = vocab_grads = None
        else:
            grads = tuple(
                accumulators(k if keep else t, m)
                for t, k, keep, m in zip(self.stage_params, self.kept, kept_gathered, body.master.stages)
            )
            shared_grads = accumulators(self.shared, body.master.shared)
            vocab_grads = accumulators(self.vocab, body.master.vocab)
        carry = (
            message_buffer(tick.act_slots),
            message_buffer(tick.grad_slots),
            tuple(arena_buffer(k, n, c) for k, n, c in zip(body.keys, tick.arena_elems, body.cuts)),
            grads,
            shared_grads,
            vocab_grads,
            (self.zero, self.zero),
            self.first_slot(table_local[0]),
        )
        carry, _ = jax.lax.scan(self.tick, carry, (table_local[0], vocab_table))
        _, _, _, grads, shared_grads, vocab_grads, (loss_sum, weight), _ = carry
        loss_sum = jax.lax.psum(loss_sum, manual_axes())
        weight = jax.lax.psum(weight, manual_axes())
        if body.forward:
            return loss_sum / weight
        scale = body.tokens_global / weight  # exactly 1 without a loss mask
        finish = functools.partial(_finish, scale=scale, sum_then_slice=pipeline.sum_then_slice)
        # Carried state (BatchNorm's statistics, models.carry_state): the sum of what every
        # microbatch of every replica wrote, made their mean.
        model = pipeline.model
        carried = 1.0 / (pipeline.replicas * pipeline.schedule.num_microbatches)
        grads = tuple(
            jax.tree.unflatten(
                jax.tree.structure(t),
                [
                    finish(g[None], p, whole=keep, scale=carried if model.is_carried(at) else scale)
                    for (at, g), p in zip(jax.tree_util.tree_leaves_with_path(t), places)
                ],
            )
            for t, places, keep in zip(grads, body.stage_places, kept_gathered)
        )
        shared_grads = body.shared_treedef.unflatten(
            [finish(g, p) for g, p in zip(jax.tree.leaves(shared_grads), body.shared_places)]
        )
        vocab_grads = jax.tree.unflatten(
            jax.tree.structure(vocab_grads),
            [finish(g[None], p) for g, p in zip(jax.tree.leaves(vocab_grads), body.vocab_places)],
        )
        return loss_sum / weight, grads, shared_grads, vocab_grads


class _VocabEnds:
    """The two ends of a vocabulary split over the pipe ranks, at every tick on every rank: the first
    stage's input rows (every rank looks up the tokens in its slice of the table) and the last stage's
    loss (every rank projects onto its slice of the vocabulary), with their gradients."""

    def __init__(self, run: _Run):
        body = run.body
        self.run, self.vocab, self.batch = run, run.vocab, run.batch
        self.split, self.pipe_index = body.vocab_split, run.pipe_index
        self.first_rank, self.last_rank = body.first_rank, body.last_rank
        self.head_name = "table" if self.split.tied else "head"
        (self.like,) = jax.tree.leaves(run.x_like)

    def total(self, x):
        """``x`` summed over the pipe ranks, varying again."""
        if self.run.body.widen_sums and jnp.dtype(x.dtype).itemsize < 4:
            return self.total(x.astype(jnp.float32)).astype(x.dtype)
        return vary(jax.lax.psum(x, "pipe"))

    def gather(self, x):
        """Every rank's ``x``, stacked over the pipe ranks (``[ranks, *x.shape]``), varying again."""
        return vary(jax.lax.all_gather(x, "pipe"))

    def from_rank(self, rank: int, message):
        """``message`` as ``rank`` has it, on every rank."""
        mine = self.pipe_index == rank
        return jax.tree.map(lambda m: self.total(jnp.where(mine, m, jnp.zeros_like(m))), message)

    def lookup(self, table, mb_index):
        tokens = self.run.read(self.batch, jnp.maximum(mb_index, 0))["tokens"]
        return _vocab.lookup(table, tokens, self.pipe_index * table.shape[0], self.split.dtype)

    def embed_rows(self, x_in, mb_index):
        """At a first-stage F, the rows of its tokens (looked up by every rank) as its input."""
        like = self.like

        def rows(_):
            return self.total(self.lookup(self.vocab["table"], mb_index)).astype(like.dtype)

        looked = jax.lax.cond(mb_index >= 0, rows, lambda _: like, None)
        use = (self.pipe_index == self.first_rank) & (mb_index >= 0)
        return jax.tree.map(lambda x: jnp.where(use, looked, x), x_in)

    def embed_grads(self, vocab_grads, message, mb_index):
        """At a first-stage B or I, its rows' gradient into every rank's slice of the table."""

        def add(acc):
            (d_rows,) = jax.tree.leaves(self.from_rank(self.first_rank, message))
            _, pull = jax.vjp(lambda t: self.lookup(t, mb_index), self.vocab["table"])
            return vary(acc + pull(d_rows.astype(self.split.dtype))[0].astype(acc.dtype))

        table_grads = jax.lax.cond(mb_index >= 0, add, lambda acc: acc, vocab_grads["table"])
        return {**vocab_grads, "table": table_grads}

    def head_slice(self, message, mb_index):
        """At a last-stage F: the last stage's output as every rank has it, its microbatch, where this
        rank's slice of the vocabulary starts, the loss mask, and the slice's projection ``w, h ->
        logits``."""
        (h,) = jax.tree.leaves(self.from_rank(self.last_rank, message))
        micro = self.run.read(self.batch, jnp.maximum(mb_index, 0))
        offset = self.pipe_index * self.vocab[self.head_name].shape[0]
        mask = micro.get("loss_mask")
        mask = jnp.ones(micro["targets"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
        vocab_size, split = self.run.body.vocab_size, self.split

        def project(w, h):
            return _vocab.head_slice(w, h, offset, vocab_size, split.dtype, split.softcap)

        return h, micro, offset, mask, project

    def counted(self, totals, sums, mb_index):
        """The loss sums added to the totals on the last stage's rank, for a real microbatch."""
        counts = (self.pipe_index == self.last_rank) & (mb_index >= 0)
        return (totals[0] + jnp.where(counts, sums[0], 0.0), totals[1] + jnp.where(counts, sums[1], 0.0))

    def head(self, vocab_grads, grad_buf, totals, message, row, mb_index):
        """At a last-stage F, every rank's slice of the logits, the loss, and its gradient: the slice's
        projection gradient, and dL/dh for the last stage's backward."""
        like, zero, ct_scale = self.like, self.run.zero, self.run.body.ct_scale

        def run(acc):
            h, micro, offset, mask, project = self.head_slice(message, mb_index)
            logits, pull = jax.vjp(project, self.vocab[self.head_name], h)
            loss, dlogits = _vocab.cross_entropy_parts(logits, micro["targets"], offset, mask, self.gather)
            d_w, d_h = pull(dlogits * ct_scale)
            d_h = self.total(d_h).astype(like.dtype)
            sums = (vary(jnp.sum(loss * mask)), vary(jnp.sum(mask)))
            return vary(acc + d_w.astype(acc.dtype)), d_h, sums

        def skip(acc):
            return acc, like, (zero, zero)

        acc, d_h, sums = jax.lax.cond(mb_index >= 0, run, skip, vocab_grads[self.head_name])
        d_h = jax.tree.unflatten(jax.tree.structure(self.run.x_like), [d_h])
        grad_buf = self.run.write(grad_buf, d_h, row[self.run.body.col["head_grad"]])
        return {**vocab_grads, self.head_name: acc}, grad_buf, self.counted(totals, sums, mb_index)

    def head_loss(self, totals, message, mb_index):
        """At a last-stage F of a forward-only program: the loss from every rank's slice of the logits
        (no gradient)."""
        zero = self.run.zero

        def run(_):
            h, micro, offset, mask, project = self.head_slice(message, mb_index)
            loss, _ = _vocab.cross_entropy_parts(
                project(self.vocab[self.head_name], h), micro["targets"], offset, mask, self.gather
            )
            return vary(jnp.sum(loss * mask)), vary(jnp.sum(mask))

        sums = jax.lax.cond(mb_index >= 0, run, lambda _: (zero, zero), None)
        return self.counted(totals, sums, mb_index)
