"""The trainer: builds the model, schedule, mesh, pipeline and optimizer from a config, and owns the
jitted train step and the state's layout (for checkpoints in the model's own layout)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.config import TrainConfig
from jaxmem.data import Batch, DataIterator
from jaxmem.pipeline import Pipeline, PipelineParams, make_mesh
from jaxmem.train._state import TrainState, global_put, to_device

__all__ = ["Trainer", "abstract_state"]


class Trainer:
    """Builds the model, schedule, mesh, pipeline and optimizer, and runs jitted steps.

    Everything that can be checked without compiling is checked in the constructor (model, layer
    split, mesh size, batch divisibility), so bad input fails fast.

    Args:
        config: the run.
        devices: the devices to build the mesh from (default: all).
        optimizer: an optax transformation (default ``optax.adam(config.lr)``). Its state follows the
            parameters' layout and dtype (float32 master weights keep float32 moments).
    """

    def __init__(self, config: TrainConfig, *, devices: Sequence | None = None, optimizer=None):
        self.config = config
        self.model = config.build_model()
        self.schedule = config.build_schedule()
        self.mesh = make_mesh(config.data_parallel, config.stages, devices)
        self.pipeline = Pipeline(
            self.model,
            self.schedule,
            self.mesh,
            layer_counts=config.layers_per_stage,
            policy=config.policy,
        )
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.pipeline.check_batch(self.batch_spec())
        self.optimizer = optimizer or optax.adam(config.lr)
        self._step_fn = None

    def batch_spec(self, seq: int | None = None) -> dict:
        """The abstract global batch of a step (with its sharding over ``data``)."""
        from jaxmem.pipeline import batch_spec

        spec = batch_spec(self.config.batch_size, seq or self.config.seq_len)
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in spec.items()}

    def data_iterator(self, seed: int | None = None, position: int = 0) -> DataIterator:
        return DataIterator(
            source=self.config.data,
            batch_size=self.config.batch_size,
            seq_len=self.config.seq_len,
            seed=self.config.seed if seed is None else seed,
            position=position,
            vocab_size=self.model.vocab_size or 256,
        )

    def init_state(self, model_params=None) -> TrainState:
        """Fresh (or given, in the model's layout) parameters, optimizer state, step 0."""
        params = model_params if model_params is not None else self.model.init(self.config.seed)
        host = jax.tree.map(np.asarray, jax.device_get(self.pipeline.from_model_params(params)))
        placed = global_put(host, self.pipeline.shardings())
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_state_shardings())(to_device(placed))
        return TrainState(params=placed, opt_state=opt_state, step=0, data=self.data_iterator())

    def opt_state_shardings(self):
        """Optimizer-state shardings: like the parameters', on host where the policy offloads it."""
        abstract_params = self.pipeline.abstract_params()
        abstract_state = jax.eval_shape(self.optimizer.init, abstract_params)
        return optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_state,
            self.pipeline.shardings(self.pipeline.optimizer_state_on_host),
            transform_non_params=lambda _: NamedSharding(self.mesh, P()),
        )

    def build_step(self, pipeline: Pipeline, batch):
        """The jitted train step ``(params, opt_state, batch) -> (params, opt_state, loss)`` of
        ``pipeline`` (same parameter layout as this trainer's) for batches like ``batch`` (a batch
        dict or spec); compiled on first call."""
        grad_fn = pipeline.grad_fn(batch)
        optimizer = self.optimizer

        def step(params, opt_state, batch):
            loss, grads = grad_fn(params, batch)
            # Offloaded weights / optimizer state come to the device for the update and go back to
            # host through the output shardings.
            params, opt_state = to_device(params), to_device(opt_state)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        out_shardings = (pipeline.shardings(), self.opt_state_shardings(), NamedSharding(self.mesh, P()))
        return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)

    @property
    def step_fn(self):
        if self._step_fn is None:
            self._step_fn = self.build_step(self.pipeline, self.batch_spec())
        return self._step_fn

    def put_batch(self, batch: Batch) -> dict:
        """The global batch as arrays split over ``data`` (every process holds the same host batch)."""
        return {k: global_put(v, self.batch_sharding) for k, v in batch.arrays().items()}

    def lower(self, state: TrainState):
        """The lowered (not yet compiled) step, e.g. for ``.compile().memory_analysis()``."""
        return self.step_fn.lower(state.params, state.opt_state, self.batch_spec())

    def measure_memory(self, state: TrainState | None = None, compiled=None):
        """The compiled ledger of this trainer's step (:func:`jaxmem.memory.measure`); compiles the step
        unless given, builds a state unless given."""
        from jaxmem.memory import measure

        state = state or self.init_state()
        compiled = compiled or self.lower(state).compile()
        params, opt_state = abstract_state(state)
        return measure(self.pipeline, compiled, batch=self.batch_spec(), params=params, opt_state=opt_state)

    def step(self, state: TrainState) -> tuple[TrainState, jax.Array, Batch]:
        batch, data = state.data.next()
        params, opt_state, loss = self.step_fn(state.params, state.opt_state, self.put_batch(batch))
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, data=data), loss, batch

    # ------------------------------------------------------------------ checkpoints
    def _replicated(self):
        return NamedSharding(self.mesh, P())

    def _to_model_layout(self, tree):
        """Every PipelineParams in ``tree`` (the parameters, Adam's moments) in the model's layout."""
        return jax.tree.map(
            lambda x: self.pipeline.to_model_params(x) if isinstance(x, PipelineParams) else x,
            tree,
            is_leaf=lambda x: isinstance(x, PipelineParams),
        )

    def export_state(self, state: TrainState) -> tuple[dict, dict]:
        """The state in the model's layout (replicated: any mesh can restore it) and its metadata."""
        to_model = self._to_model_layout
        exported = jax.jit(
            lambda p, o: {"params": to_model(p), "opt_state": to_model(o)}, out_shardings=self._replicated()
        )(to_device(state.params), to_device(state.opt_state))
        config = self.config
        meta = {
            "step": state.step,
            "seed": config.seed,
            "model": self.model.name,
            "data": state.data.state(),
            "plan": {
                "schedule": self.schedule.name,
                "stages": config.stages,
                "data_parallel": config.data_parallel,
                "microbatches": self.schedule.num_microbatches,
                "virtual": config.virtual,
                "layers_per_stage": list(self.pipeline.layer_counts),
                "policy": str(self.pipeline.policy.policy),
                "batch_size": config.batch_size,
                "seq_len": config.seq_len,
            },
        }
        return exported, meta

    def restore_target(self) -> dict:
        """Abstract model-layout state with this trainer's (replicated) shardings, for restoring."""
        abstract_params = self.pipeline.abstract_params()
        to_model = self._to_model_layout
        abstract = jax.eval_shape(
            lambda p: {"params": to_model(p), "opt_state": to_model(self.optimizer.init(p))}, abstract_params
        )
        replicated = self._replicated()
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract)

    def import_state(self, state: dict, meta: dict) -> TrainState:
        """A restored model-layout state laid out for this trainer's pipeline."""
        pipeline = self.pipeline
        target_opt = jax.eval_shape(self.optimizer.init, pipeline.abstract_params())

        def relayout(params, opt_state):
            opt = jax.tree.map(
                lambda target, value: (
                    pipeline.from_model_params(value) if isinstance(target, PipelineParams) else value
                ),
                target_opt,
                opt_state,
                is_leaf=lambda x: isinstance(x, PipelineParams),
            )
            return pipeline.from_model_params(params), opt

        params, opt_state = jax.jit(relayout, out_shardings=(pipeline.shardings(), self.opt_state_shardings()))(
            state["params"], state["opt_state"]
        )
        data = self.data_iterator(seed=meta["data"]["seed"], position=meta["data"]["position"])
        return TrainState(params=params, opt_state=opt_state, step=int(meta["step"]), data=data)


def abstract_state(state: TrainState) -> tuple:
    """``(params, opt_state)`` as shaped values with their shardings (for lowering without arrays)."""

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

    return jax.tree.map(spec, state.params), jax.tree.map(spec, state.opt_state)
