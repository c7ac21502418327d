"""The pipelined gradient: any validated schedule, run as ONE ``jax.jit(shard_map(...))`` program.

Inside ``shard_map`` over a ``("data", "pipe")`` mesh, a ``lax.scan`` walks the schedule's ticks. Each
tick, every rank looks up its row of the tick table and runs one branch of a ``lax.switch``: idle, or
F / B / I / W of one stage class (role, layer count, memory-policy variant, local stage). A forward
keeps its ``jax.vjp`` residuals in a stash slot (on host when the policy says so); a backward rebuilds
the pullback from that slot. Every tick each rank sends one message per ppermute offset (activations
forward, gradients backward). Gradients accumulate across microbatches; after the scan they are
averaged over ``data``, and the shared (embedding/head) gradients summed over ``pipe``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._errors import JaxmemError
from jaxmem.models.gpt import GPT, GPTConfig
from jaxmem.pipeline._residuals import ResidualPlan, analyze_stage
from jaxmem.pipeline._split import GPTPieces, split_layers, stack_stage_params, unstack_stage_params
from jaxmem.pipeline._ticks import COLUMNS, StageClass, TickProgram, build_tick_program, cell_classes
from jaxmem.policy import ResolvedPolicy, from_spec
from jaxmem.schedule import Kind, Schedule, validate

__all__ = ["Pipeline", "PipelineParams", "make_mesh", "varying_axes"]

AXES = ("data", "pipe")
HOST = "pinned_host"


def make_mesh(data: int, pipe: int, devices: Sequence | None = None) -> Mesh:
    """A ``("data", "pipe")`` mesh over the first ``data * pipe`` devices.

    Raises:
        JaxmemError: when there are not enough devices, with the arithmetic.
    """
    devices = list(jax.devices() if devices is None else devices)
    need = data * pipe
    if data < 1 or pipe < 1:
        raise JaxmemError(f"data ({data}) and pipe ({pipe}) must be >= 1")
    if need > len(devices):
        raise JaxmemError(
            f"data({data}) x pipe({pipe}) = {need} devices, but only {len(devices)} are available "
            f"({devices[0].platform}); on CPU, pass --devices {need} (virtual devices)"
        )
    return Mesh(np.array(devices[:need]).reshape(data, pipe), AXES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PipelineParams:
    """Model parameters laid out for the pipeline.

    Attributes:
        stages: one dict per local stage position ``v``; leaves ``[ranks, max layers, ...]`` sharded
            over ``pipe`` on the first axis (rank r's v-th stage).
        shared: embeddings, final norm and head; replicated (the first and last stages use them).
    """

    stages: tuple
    shared: dict


def varying_axes(x) -> frozenset:
    """The mesh axes along which ``x`` varies inside ``shard_map`` (jax 0.10 spells it ``mat.varying``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _vary(x: jax.Array) -> jax.Array:
    """Mark ``x`` as varying over every mesh axis (no data movement), so switch branches agree and no
    autodiff transpose inserts a collective inside a branch."""
    missing = tuple(a for a in AXES if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_tree(tree):
    return jax.tree.map(_vary, tree)


def _to_device(tree):
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    seq: int


class Pipeline:
    """A GPT cut into stages and run by a schedule on a mesh, under a memory policy.

    Args:
        config: the model.
        schedule: any valid schedule.
        mesh: axes ``("data", "pipe")``; ``pipe`` must equal the schedule's ranks.
        layer_counts: layers per stage (balanced when omitted).
        policy: a memory policy spec (see :func:`jaxmem.policy.from_spec`); ``save-all`` by default.
        drop_layers: global indices of layers skipped (layer drop: a different program per set).

    Use :meth:`value_and_grad` for loss and gradients, or :meth:`grad_fn` inside your own jitted
    step (see ``examples/train_flax.py``).
    """

    def __init__(
        self,
        config: GPTConfig,
        schedule: Schedule,
        mesh: Mesh,
        *,
        layer_counts: Sequence[int] | None = None,
        policy=None,
        drop_layers: frozenset[int] = frozenset(),
    ):
        validate(schedule)
        if tuple(mesh.axis_names) != AXES:
            raise JaxmemError(f"the mesh axes must be {AXES}, got {tuple(mesh.axis_names)}")
        if mesh.shape["pipe"] != schedule.num_ranks:
            raise JaxmemError(
                f"the schedule has {schedule.num_ranks} ranks but the mesh's pipe axis has "
                f"{mesh.shape['pipe']} devices; use --stages {mesh.shape['pipe']} or a matching mesh"
            )
        per_rank = {len(schedule.stages_of(r)) for r in range(schedule.num_ranks)}
        if len(per_rank) != 1:
            raise JaxmemError("every rank must own the same number of stages (one SPMD program)")
        self.config = config
        self.schedule = schedule
        self.mesh = mesh
        self.layer_counts = split_layers(config.n_layers, schedule.num_stages, layer_counts)
        self.pieces = GPTPieces.create(config)
        self.policy: ResolvedPolicy = from_spec(policy).resolve(schedule)
        self.virtual = per_rank.pop()
        self.drop_layers = frozenset(drop_layers)
        self.cell_classes = cell_classes(schedule, self.layer_counts, self.policy, self.drop_layers)
        # Weights on host per local position (the policy checked this is consistent across ranks).
        self.weights_on_host = tuple(self.policy.offload_weights(schedule.stages_of(0)[v]) for v in range(self.virtual))
        self.optimizer_state_on_host = tuple(
            self.policy.offload_optimizer_state(schedule.stages_of(0)[v]) for v in range(self.virtual)
        )
        self._programs: dict[_Shape, tuple[TickProgram, dict]] = {}
        self._grad_fns: dict[_Shape, object] = {}
        self._jitted: dict[_Shape, object] = {}

    # ------------------------------------------------------------------ parameters
    @property
    def data(self) -> int:
        return self.mesh.shape["data"]

    @property
    def pipe(self) -> int:
        return self.mesh.shape["pipe"]

    def _abstract_model_params(self) -> dict:
        from flax import nnx

        return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(self.config, rngs=nnx.Rngs(0)))))

    def abstract_params(self) -> PipelineParams:
        return jax.eval_shape(self.from_model_params, self._abstract_model_params())

    def shardings(self, on_host: Sequence[bool] | None = None) -> PipelineParams:
        """Target shardings: stage parameters split over ``pipe``, shared ones replicated.

        ``on_host[v]`` puts the v-th local stage on host (``pinned_host``); by default where the policy
        offloads weights. Pass :attr:`optimizer_state_on_host` for the optimizer state's layout.
        """
        on_host = self.weights_on_host if on_host is None else tuple(on_host)
        abstract = self.abstract_params()
        stages = tuple(
            jax.tree.map(
                lambda _, v=v: NamedSharding(self.mesh, P("pipe"), memory_kind=HOST if on_host[v] else None),
                tree,
            )
            for v, tree in enumerate(abstract.stages)
        )
        replicated = NamedSharding(self.mesh, P())
        return PipelineParams(stages=stages, shared=jax.tree.map(lambda _: replicated, abstract.shared))

    def from_model_params(self, params: dict) -> PipelineParams:
        """A model's parameter dict (``nnx.to_pure_dict(nnx.state(model))``) -> pipeline layout."""
        blocks, shared = GPTPieces.split_model_params(params)
        stages = stack_stage_params(blocks, self.layer_counts, self.schedule.stage_to_rank)
        return PipelineParams(stages=stages, shared=shared)

    def to_model_params(self, params: PipelineParams) -> dict:
        """Pipeline layout -> the model's parameter dict (e.g. to compare with ``jax.grad``)."""
        blocks = unstack_stage_params(params.stages, self.layer_counts, self.schedule.stage_to_rank)
        return GPTPieces.join_model_params(blocks, params.shared)

    def place(self, params: PipelineParams) -> PipelineParams:
        """Put parameters on the mesh with their target shardings."""
        return jax.device_put(params, self.shardings())

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: int, seq: int) -> int:
        """Microbatch size for a global batch; raises with values that would work otherwise."""
        M, D = self.schedule.num_microbatches, self.data
        if batch % (D * M):
            ok = [D * M * k for k in range(1, 5)]
            raise JaxmemError(
                f"batch size {batch} is not divisible by data-parallel ({D}) x microbatches ({M}) = "
                f"{D * M}; use a batch size in {ok}, ..."
            )
        if seq > self.config.max_seq_len:
            raise JaxmemError(f"sequence length {seq} exceeds the model's max_seq_len {self.config.max_seq_len}")
        return batch // (D * M)

    # ------------------------------------------------------------------ the program
    def stage_fn(self, c: StageClass):
        """The stage function of a class, wrapped in its policy's ``jax.checkpoint``."""
        fn = self.pieces.stage_forward(c.first, c.last, c.layers, c.skip)
        return self.policy.variants[c.variant].wrap(fn)

    def _stash_to_host(self, c: StageClass) -> bool:
        return self.policy.variants[c.variant].offload_stash

    def residual_plans(self, batch: int, seq: int) -> dict[StageClass, ResidualPlan]:
        """Per class, its residuals for one microbatch (traced abstractly, nothing compiled)."""
        mb = self.check_batch(batch, seq)
        abstract = self.abstract_params()
        dtype = jnp.dtype(self.config.dtype)
        x = jax.ShapeDtypeStruct((mb, seq, self.config.d_model), dtype)
        tok = jax.ShapeDtypeStruct((mb, seq), jnp.int32)
        plans = {}
        for c in dict.fromkeys(self.cell_classes.values()):
            stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), abstract.stages[c.local])
            plans[c] = analyze_stage(
                self.stage_fn(c), stage, abstract.shared, x, tok, tok, stash_to_host=self._stash_to_host(c)
            )
        return plans

    def program(self, batch: int, seq: int) -> tuple[TickProgram, dict[StageClass, ResidualPlan]]:
        """The tick program and per-class residual plans for a global batch shape (cached)."""
        shape = _Shape(batch, seq)
        if shape not in self._programs:
            plans = self.residual_plans(batch, seq)
            tick = build_tick_program(self.schedule, self.cell_classes, {c: p.stash_elems for c, p in plans.items()})
            self._programs[shape] = (tick, plans)
        return self._programs[shape]

    def grad_fn(self, batch: int, seq: int):
        """``fn(params, tokens, targets) -> (loss, grads)``, not jitted (use inside a jitted step)."""
        shape = _Shape(batch, seq)
        if shape not in self._grad_fns:
            self._grad_fns[shape] = self._build_grad_fn(shape)
        return self._grad_fns[shape]

    def value_and_grad(self, params: PipelineParams, tokens: jax.Array, targets: jax.Array):
        """Loss and gradients of the mean next-token loss, jitted (one compile per batch shape)."""
        shape = _Shape(*tokens.shape)
        if shape not in self._jitted:
            self._jitted[shape] = jax.jit(self.grad_fn(*tokens.shape))
        return self._jitted[shape](params, tokens, targets)

    def _build_grad_fn(self, shape: _Shape):
        tick, abstract_plans = self.program(shape.batch, shape.seq)
        M = self.schedule.num_microbatches
        mb = self.check_batch(shape.batch, shape.seq)
        d_model, dtype = self.config.d_model, jnp.dtype(self.config.dtype)
        classes, pipe_size = tick.classes, self.pipe
        col = {name: i for i, name in enumerate(COLUMNS)}
        keys, windows = tick.stash_keys, tick.window
        stash_cols = [tick.stash_column(ki) for ki in range(len(keys))]
        if tick.table.max(initial=0) >= 2**31 or max(tick.arena_elems, default=0) >= 2**31:
            raise JaxmemError(
                f"a stash arena of {max(tick.arena_elems):,} elements exceeds what int32 indexing reaches (2^31); "
                "use more pipeline stages or microbatches (smaller microbatches), or a recompute policy"
            )
        table = jnp.asarray(tick.table.astype(np.int32))
        weights_on_host = self.weights_on_host

        def body(stage_params, shared, tokens, targets, table_local):
            stage_params = tuple(_vary_tree(jax.tree.map(lambda a: a[0], tree)) for tree in stage_params)
            shared = _vary_tree(shared)
            tokens = _vary(tokens.reshape(M, mb, shape.seq))
            targets = _vary(targets.reshape(M, mb, shape.seq))
            x_like = _vary(jnp.zeros((mb, shape.seq, d_model), dtype))
            zero_loss = _vary(jnp.zeros((), jnp.float32))

            def device_params(v):
                return _to_device(stage_params[v]) if weights_on_host[v] else stage_params[v]

            # Trace the residual plans again here, with this program's (varying) types.
            plans = [
                analyze_stage(
                    self.stage_fn(c),
                    device_params(c.local),
                    shared,
                    x_like,
                    tokens[0],
                    targets[0],
                    stash_to_host=self._stash_to_host(c),
                )
                for c in classes
            ]

            def zeros_window(key, n):
                z = _vary(jnp.zeros((n,), jnp.dtype(key[0])))
                return jax.device_put(z, jax.memory.Space.Host) if key[1] == "host" else z

            def no_write():
                return (
                    tuple(zeros_window(k, w) for k, w in zip(keys, windows)),
                    tuple(_vary(jnp.zeros((), jnp.int32)) for _ in keys),
                )

            # The arenas enter the switch read-only (so no branch copies them). A forward returns its
            # packed residuals padded to the arena's window, with their true length; the write happens
            # outside the switch as a scatter that drops everything past that length, so a smaller
            # item never clobbers its neighbours and the arena needs no padding.
            def idle(arenas, offs, grads, shared_grads, loss_sum, x_in, g_in, tok, tgt):
                return (x_like, *no_write(), grads, shared_grads, loss_sum)

            def make_branch(class_index: int, kind: Kind):
                c, plan = classes[class_index], plans[class_index]

                def branch(arenas, offs, grads, shared_grads, loss_sum, x_in, g_in, tok, tgt):
                    params = device_params(c.local)
                    if kind is Kind.F:
                        out, packed = plan.forward(params, shared, x_in, tok, tgt)
                        windows_out, lengths = [], []
                        for key, w in zip(keys, windows):
                            vec = packed.get(key)
                            n = 0 if vec is None else vec.shape[0]
                            zeros = jnp.zeros((w - n,), jnp.dtype(key[0]))
                            if key[1] == "host":
                                zeros = jax.device_put(zeros, jax.memory.Space.Host)
                            windows_out.append(
                                _vary(zeros)
                                if vec is None
                                else (vec if n == w else jnp.concatenate([vec, _vary(zeros)]))
                            )
                            lengths.append(_vary(jnp.asarray(n, jnp.int32)))
                        loss = loss_sum + _vary(out) if c.last else loss_sum
                        message = x_like if c.last else _vary(out)
                        return (message, tuple(windows_out), tuple(lengths), grads, shared_grads, loss)
                    current = {
                        key: jax.lax.dynamic_slice_in_dim(arena, off, plan.stash_elems[key])
                        for key, arena, off in zip(keys, arenas, offs)
                        if key in plan.stash_elems
                    }
                    pullback = plan.pullback(params, shared, x_like, tok, tgt, current)
                    ct = _vary(jnp.full(plan.out_aval.shape, 1.0 / M, plan.out_aval.dtype)) if c.last else g_in
                    d_params, d_shared, d_x = pullback(ct)
                    message = x_like if c.first or kind is Kind.W else _vary(d_x)
                    if kind is not Kind.I:
                        grads = list(grads)
                        grads[c.local] = jax.tree.map(lambda acc, d: acc + _vary(d), grads[c.local], d_params)
                        grads = tuple(grads)
                        shared_grads = jax.tree.map(lambda acc, d: acc + _vary(d), shared_grads, d_shared)
                    return (message, *no_write(), grads, shared_grads, loss_sum)

                return branch

            branches = [idle] + [make_branch(ci, kind) for ci, kind in tick.branches]

            def tick_step(carry, row):
                act_buf, grad_buf, arenas, grads, shared_grads, loss_sum = carry
                m = row[col["microbatch"]]
                tok = jax.lax.dynamic_index_in_dim(tokens, m, 0, keepdims=False)
                tgt = jax.lax.dynamic_index_in_dim(targets, m, 0, keepdims=False)
                x_in = jax.lax.dynamic_index_in_dim(act_buf, row[col["act_in"]], 0, keepdims=False)
                g_in = jax.lax.dynamic_index_in_dim(grad_buf, row[col["grad_in"]], 0, keepdims=False)
                offs = tuple(row[c] for c in stash_cols)
                message, windows_out, lengths, grads, shared_grads, loss_sum = jax.lax.switch(
                    row[col["branch"]], branches, arenas, offs, grads, shared_grads, loss_sum, x_in, g_in, tok, tgt
                )
                new_arenas = []
                for arena, values, off, length in zip(arenas, windows_out, offs, lengths):
                    lanes = jnp.arange(values.shape[0], dtype=jnp.int32)
                    index = jnp.where(lanes < length, off + lanes, arena.shape[0])  # past the end: dropped
                    new_arenas.append(
                        arena.at[index].set(values, mode="drop", indices_are_sorted=True, unique_indices=True)
                    )
                arenas = tuple(new_arenas)
                act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, message, row[col["local_act"]], 0)
                grad_buf = jax.lax.dynamic_update_index_in_dim(grad_buf, message, row[col["local_grad"]], 0)
                for k, offset in enumerate(tick.offsets):
                    outgoing = jnp.where(row[col["send"]] == k, message, jnp.zeros_like(message))
                    perm = [(r, (r + offset) % pipe_size) for r in range(pipe_size)]
                    incoming = jax.lax.ppermute(outgoing, "pipe", perm)
                    act_col, grad_col = tick.recv_columns(k)
                    act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, incoming, row[act_col], 0)
                    grad_buf = jax.lax.dynamic_update_index_in_dim(grad_buf, incoming, row[grad_col], 0)
                return (act_buf, grad_buf, arenas, grads, shared_grads, loss_sum), None

            def arena_buffer(key, length):
                dtype_name, space = key
                buf = _vary(jnp.zeros((length,), jnp.dtype(dtype_name)))
                return jax.device_put(buf, jax.memory.Space.Host) if space == "host" else buf

            carry = (
                _vary(jnp.zeros((tick.act_slots + 1, mb, shape.seq, d_model), dtype)),
                _vary(jnp.zeros((tick.grad_slots + 1, mb, shape.seq, d_model), dtype)),
                tuple(arena_buffer(k, n) for k, n in zip(keys, tick.arena_elems)),
                tuple(jax.tree.map(lambda a: _vary(jnp.zeros(a.shape, a.dtype)), t) for t in stage_params),
                jax.tree.map(jnp.zeros_like, shared),
                zero_loss,
            )
            carry, _ = jax.lax.scan(tick_step, carry, table_local[0])
            _, _, _, grads, shared_grads, loss_sum = carry
            grads = tuple(jax.tree.map(lambda g: jax.lax.pmean(g, "data")[None], t) for t in grads)
            shared_grads = jax.tree.map(lambda g: jax.lax.pmean(jax.lax.psum(g, "pipe"), "data"), shared_grads)
            loss = jax.lax.pmean(jax.lax.psum(loss_sum, "pipe"), "data") / M
            return loss, grads, shared_grads

        sharded = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(P("pipe"), P(), P("data"), P("data"), P("pipe")),
            out_specs=(P(), P("pipe"), P()),
        )

        def grad_fn(params: PipelineParams, tokens: jax.Array, targets: jax.Array):
            loss, grads, shared_grads = sharded(params.stages, params.shared, tokens, targets, table)
            return loss, PipelineParams(stages=grads, shared=shared_grads)

        return grad_fn
