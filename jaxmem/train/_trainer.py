"""The trainer: builds the model, schedule, mesh, pipeline and optimizer from a config, and owns the
jitted train step and the state's layout (for checkpoints in the model's own layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._errors import JaxmemError, StepTooLarge, out_of_memory_bytes, setting
from jaxmem._util import step_compiler_options
from jaxmem.config import GENERATED_POLICIES, OptimizerSpec, TrainConfig
from jaxmem.data import (
    ORDER,
    Batch,
    DataIterator,
    SampleBatch,
    SampleIterator,
    Samples,
    load_corpus,
    load_samples,
)
from jaxmem.memory import measure
from jaxmem.models import RNG_SPEC, StagedModel, describe_model, evaluating
from jaxmem.pipeline import Pipeline, PipelineParams, batch_spec, make_mesh
from jaxmem.train._state import TrainState, global_put, to_device
from jaxmem.train._state_io import TrainStateReader, nest
from jaxmem.train._update import streamed_groups, streamed_update

__all__ = ["Trainer", "abstract_state", "learning_rate", "make_optimizer", "step_key"]


def step_key(seed: int, step: int) -> np.ndarray:
    """The key of optimizer step ``step`` of a run seeded ``seed``, for a model that draws random
    numbers (dropout, :attr:`~jaxmem.models.StagedModel.rng`): a raw ``uint32[2]`` threefry key, a
    function of the two alone, so a resumed run draws the masks the uninterrupted run would have
    (on the same stage split, microbatches and replicas: the pipeline folds those in)."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), step)), np.uint32)


def learning_rate(spec: OptimizerSpec | TrainConfig):
    """The learning-rate schedule (an optax schedule: step -> lr) of an :class:`OptimizerSpec` (a
    :class:`TrainConfig` gives its own, :attr:`TrainConfig.optimizer`)."""
    config = spec.optimizer if isinstance(spec, TrainConfig) else spec
    warmup = config.warmup_steps
    if config.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=config.lr,
            warmup_steps=warmup,
            decay_steps=config.steps,
            end_value=config.lr * config.min_lr_ratio,
        )
    if warmup:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, config.lr, warmup), optax.constant_schedule(config.lr)], [warmup]
        )
    return optax.constant_schedule(config.lr)


def _decay_mask(params):
    """True for matrices: in the pipeline layout a layer's leaves carry two leading axes (rank, layer),
    the split vocabulary's tables one (rank)."""
    if isinstance(params, PipelineParams):
        return PipelineParams(
            stages=jax.tree.map(lambda x: x.ndim >= 4, params.stages),
            shared=jax.tree.map(lambda x: x.ndim >= 2, params.shared),
            vocab=jax.tree.map(lambda x: x.ndim >= 3, params.vocab),
        )
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(spec: OptimizerSpec | TrainConfig):
    """The optimizer an :class:`OptimizerSpec` (or a :class:`TrainConfig`'s) asks for: Adam, or AdamW
    with ``weight_decay`` (on matrices only, not on biases, norms' scales or other vectors), under the
    learning-rate schedule, after clipping the gradients' global norm to ``grad_clip``."""
    config = spec.optimizer if isinstance(spec, TrainConfig) else spec
    opt = _elementwise(config)
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), opt) if config.grad_clip else opt


def _elementwise(config: OptimizerSpec):
    """:func:`make_optimizer`'s optimizer without its clip: elementwise per parameter, so it can be run
    on slices of the parameters (:func:`~jaxmem.train._update.streamed_update`)."""
    lr = learning_rate(config)
    if config.weight_decay:
        return optax.adamw(lr, weight_decay=config.weight_decay, mask=_decay_mask)
    return optax.adam(lr)


class Trainer:
    """Builds the model, schedule, mesh, pipeline and optimizer, and runs jitted steps.

    Everything that can be checked without compiling is checked in the constructor (model, layer
    split, mesh size, batch divisibility), so bad input fails fast.

    Args:
        config: the run.
        devices: the devices to build the mesh from (default: all).
        optimizer: an optax transformation (default :func:`make_optimizer` of the config: Adam or
            AdamW, warmup and cosine, clipping). Its state follows the parameters' layout and dtype
            (float32 master weights keep float32 moments). The default updates stages whose weights
            or optimizer state the policy keeps on host one layer at a time
            (:mod:`jaxmem.train._update`); one given here may not be elementwise, so its update brings
            them to the device whole, beyond the ledger's figure.
        corpus: the training data (default: what ``config.data`` / ``config.tokenizer`` name, with
            the ``eval_fraction`` held out); its tokenizer sets a preset model's vocabulary.
        samples: instead of a token corpus, the samples of a model with a batch of its own (a
            classifier's images and labels: :class:`~jaxmem.data.Samples`, each sample one row of the
            model's ``batch_spec``), the last ``eval_fraction`` of them held out; ``config.data``,
            ``tokenizer`` and ``seq_len`` are then not read. Default: what ``config.samples`` names.
    """

    def __init__(
        self, config: TrainConfig, *, devices: Sequence | None = None, optimizer=None, corpus=None, samples=None
    ):
        self.samples = self.eval_samples = None
        self._own_batch = None  # the keys of a model's own batch when no samples are given
        if samples is None and config.samples is not None:
            samples = load_samples(config.samples)
        if samples is not None:
            if corpus is not None or not isinstance(samples, Samples):
                raise JaxmemError(
                    "Trainer(samples=) takes a jaxmem.data.Samples (and no corpus beside it), got "
                    f"{type(samples).__name__}"
                )
            self.samples, self.eval_samples = samples.split(config.eval_fraction)
            self.corpus = self.eval_corpus = None
        else:
            self.corpus, self.eval_corpus = (corpus, None) if corpus is not None else _load_data(config)
        tokenizer = self.tokenizer
        preset = not isinstance(config.model, StagedModel) and config.init_from is None
        if tokenizer is not None and config.vocab_size is None and preset:
            # A preset's vocabulary follows the tokenizer (byte-level data keeps the preset's own).
            if tokenizer.vocab_size != 256:
                config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
        self.model = config.build_model()
        self.schedule = config.build_schedule()
        if config.policy in GENERATED_POLICIES:  # made for this layout now; the config keeps the result
            policy = config.build_policy(self.model, self.schedule)
            config = dataclasses.replace(config, policy=policy, budget=config.budget if config.run_dir else None)
        self.config = config
        mesh = config.mesh
        target = config.compile_target()
        if devices is None and target is not None and not _attached(target):
            devices = target.devices(config.num_devices)  # compile-only: the step compiles, it does not run
        self.mesh = make_mesh(mesh.data, mesh.pipe, devices, fsdp=mesh.fsdp, context=mesh.context, tensor=mesh.tensor)
        self.pipeline = Pipeline(
            self.model,
            self.schedule,
            self.mesh,
            layer_counts=config.layers_per_stage,
            policy=config.policy,
            zero=config.zero,
            vocab_parallel=config.vocab_parallel,
            split_backward=config.split_backward,
            hand_recomputed=config.hand_recomputed,
        )
        self.batch_sharding = NamedSharding(self.mesh, P(("data", "fsdp")))
        self._check_samples()
        self.pipeline.check_batch(self.batch_spec())
        self.optimizer = optimizer or make_optimizer(config.optimizer)
        # jaxmem's own optimizer is elementwise after its clip: offloaded state can be updated by the layer.
        self.streams_update = optimizer is None
        self.learning_rate = learning_rate(config.optimizer) if optimizer is None else None
        if not self._own_batch:
            self.data_iterator()  # checks the data against the model (vocabulary, sequence length)
        self._step_fn = None
        self._compiled = None
        self._eval_fn = None

    def _check_samples(self) -> None:
        """A model with a batch of its own trains on samples of that batch; token data gives only
        ``tokens`` and ``targets``."""
        own = self.model.batch_spec
        if own is None:
            return
        want = dict(own(self.config.batch_size, self.config.seq_len))
        if self.samples is None:
            # Its steps compile for its own batch (memory, plan); training needs its samples.
            self._own_batch = None if set(want) == {"tokens", "targets"} else sorted(want)
            return
        got = self.samples.spec(self.config.batch_size)
        shapes = {k: (tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in want.items()}
        given = {k: (tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in got.items()}
        if shapes != given:
            raise JaxmemError(
                f"samples {self.samples.name!r} batch to {given}, but model {self.model.name} takes {shapes} (its "
                "batch_spec at this batch size); give samples of those keys, shapes and dtypes"
            )

    @property
    def tokenizer(self):
        """The data's tokenizer (None for synthetic data and samples)."""
        return None if self.corpus is None else self.corpus.tokenizer

    @property
    def has_eval(self) -> bool:
        """The run holds data out for evaluation (``eval_fraction``)."""
        return (self.eval_samples if self.samples is not None else self.eval_corpus) is not None

    @property
    def data_name(self) -> str:
        """What the run trains on, for reports."""
        if self.samples is not None:
            return f"{self.samples.name} ({len(self.samples):,} samples)"
        return self.corpus.name if self.corpus is not None else "synthetic"

    def batch_spec(self, seq: int | None = None) -> dict:
        """The abstract global batch of a step's data (with its sharding over ``data``): the samples'
        (a model with a batch of its own), else tokens and targets -- or, for a model with a batch of
        its own and no samples given, its ``batch_spec`` (the step compiles; it cannot train)."""
        if self.samples is not None:
            spec = self.samples.spec(self.config.batch_size)
        elif self._own_batch:
            spec = dict(self.model.batch_spec(self.config.batch_size, seq or self.config.seq_len))
        else:
            spec = batch_spec(self.config.batch_size, seq or self.config.seq_len)
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in spec.items()}

    def step_spec(self, seq: int | None = None) -> dict:
        """What the train step takes beside the state: :meth:`batch_spec`, and for a model that draws
        random numbers the step's key ``rng`` (replicated; :func:`step_key`)."""
        spec = self.batch_spec(seq)
        if self.model.rng:
            spec["rng"] = jax.ShapeDtypeStruct(RNG_SPEC.shape, RNG_SPEC.dtype, sharding=NamedSharding(self.mesh, P()))
        return spec

    def data_iterator(
        self, seed: int | None = None, position: int = 0, *, split: str = "train"
    ) -> DataIterator | SampleIterator:
        """The batches of the training data (``split="eval"``: of the held-out data)."""
        if self._own_batch:
            raise JaxmemError(
                f"model {self.model.name} takes a batch of its own ({', '.join(self._own_batch)}), which token data "
                "cannot give; pass its samples: jaxmem train --samples package.module:attr (a function returning "
                "jaxmem.data.Samples), or Trainer(config, samples=jaxmem.data.Samples(...))"
            )
        if not self.has_eval and split == "eval":
            raise JaxmemError(f"this run holds out no eval data; set {setting('eval_fraction')}")
        if self.samples is not None:
            return SampleIterator(
                source=self.eval_samples if split == "eval" else self.samples,
                batch_size=self.config.batch_size,
                seed=self.config.seed if seed is None else seed,
                position=position,
            )
        source = self.eval_corpus if split == "eval" else self.corpus
        return DataIterator(
            source=source if source is not None else "synthetic",
            batch_size=self.config.batch_size,
            seq_len=self.config.seq_len,
            seed=self.config.seed if seed is None else seed,
            position=position,
            vocab_size=self.model.vocab_size or 256,
        )

    def initial_params(self):
        """The parameters a fresh run starts from, in the model's layout, on the host: the weights of
        ``config.init_from``, or None (drawn from the seed by :meth:`init_state`)."""
        if self.config.init_from is None:
            return None
        from jaxmem.train._export import hf_params

        return hf_params(self.config.init_from, self.model)

    def init_state(self, model_params=None) -> TrainState:
        """Fresh (or given, in the model's layout) parameters, optimizer state, step 0.

        Fresh parameters are drawn on the devices, each device computing only its own shards (no whole
        copy anywhere); given ones are host values, the same on every process."""
        pipeline = self.pipeline
        if model_params is None:
            seed = self.config.seed
            placed = jax.jit(
                lambda: pipeline.from_model_params(self.model.init(seed)), out_shardings=pipeline.master_shardings()
            )()
        else:
            host = jax.tree.map(np.asarray, jax.device_get(pipeline.from_model_params(model_params)))
            placed = global_put(host, pipeline.master_shardings())
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_state_shardings())(to_device(placed))
        return TrainState(params=placed, opt_state=opt_state, step=0, data=self.data_iterator())

    def opt_state_shardings(self):
        """Optimizer-state shardings: the pipeline's state shardings (the parameters', cut over the
        replicas with ZeRO), on host where the policy offloads it."""
        abstract_params = self.pipeline.abstract_params()
        abstract_state = jax.eval_shape(self.optimizer.init, abstract_params)
        return optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_state,
            self.pipeline.state_shardings(),
            transform_non_params=lambda _: NamedSharding(self.mesh, P()),
        )

    def build_step(self, pipeline: Pipeline, batch):
        """The jitted train step ``(params, opt_state, batch) -> (params, opt_state, metrics)`` of
        ``pipeline`` (same parameter layout as this trainer's) for batches like ``batch`` (a batch
        dict or spec); compiled on first call. ``metrics``: ``loss`` and the gradients' global norm
        ``grad_norm`` (before clipping). A model that draws random numbers (dropout) finds the step's
        key in ``batch["rng"]`` (:meth:`put_batch` with the step, :func:`step_key`)."""
        grad_fn = pipeline.grad_fn({k: v for k, v in batch.items() if k != "rng"})
        optimizer = self.optimizer
        offloaded = tuple(w or s for w, s in zip(pipeline.weights_on_host, pipeline.optimizer_state_on_host))
        roles = streamed_groups(pipeline.placement, offloaded) if self.streams_update and any(offloaded) else None
        inner, clip = _elementwise(self.config.optimizer), self.config.optimizer.grad_clip
        carried = pipeline.carried_leaves() if pipeline.model.carried else None

        def step(params, opt_state, batch):
            batch = dict(batch)
            rng = batch.pop("rng", None)
            loss, grads = grad_fn(pipeline.compute_params(params), batch, rng)
            written = None
            if carried is not None:  # state the layers wrote (BatchNorm's statistics): not trained
                written = grads
                grads = jax.tree.map(lambda g, c: jnp.zeros_like(g) if c else g, grads, carried)
            grad_norm = optax.tree.norm(grads)
            if roles is not None:  # offloaded stages updated layer by layer, their state streamed
                params, opt_state = streamed_update(inner, grads, opt_state, params, roles, clip=clip)
            else:
                # Offloaded weights / optimizer state come to the device for the update and go back to
                # host through the output shardings.
                params, opt_state = to_device(params), to_device(opt_state)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
            if written is not None:  # the carried state: what this step wrote, in place of the old
                params = jax.tree.map(lambda p, w, c: w.astype(p.dtype) if c else p, params, written, carried)
            return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

        out_shardings = (pipeline.master_shardings(), self.opt_state_shardings(), NamedSharding(self.mesh, P()))
        options = step_compiler_options(pipeline.platform)
        return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings, compiler_options=options)

    @property
    def step_fn(self):
        """The jitted train step (see :meth:`build_step`)."""
        if self._step_fn is None:
            self._step_fn = self.build_step(self.pipeline, self.step_spec())
        return self._step_fn

    def compiled(self, state: TrainState):
        """The compiled train step, e.g. for ``memory_analysis()``. A trainer compiles its step once:
        this executable is the one :meth:`step` runs and :meth:`compile_abstract` made, whichever came
        first (a planned run's check of its pick, the compiled-bytes metric and the steps share it)."""
        if self._compiled is None:
            self._compiled = self.lower(state).compile()
        return self._compiled

    def eval_loss(self, state: TrainState, batches: int | None = None) -> float:
        """Mean loss over the first ``batches`` batches of the held-out data (the same batches every
        time). It runs the schedule's forwards alone (:meth:`~jaxmem.pipeline.Pipeline.loss_fn`: no
        backward, nothing stashed), as its own compiled program. A Flax model is evaluated in its
        evaluation mode (:func:`~jaxmem.models.evaluating`: no dropout); one that draws random numbers
        its own way gets the same fixed key every time, so evaluations compare."""
        batches = batches or self.config.eval_batches
        data = self.data_iterator(split="eval")
        key = step_key(self.config.seed, 2**32 - 1) if self.model.rng else None  # a step no run reaches
        if self._eval_fn is None:
            pipeline = self.pipeline
            loss_fn = pipeline.loss_fn(self.batch_spec())

            def eval_loss(params, batch, key):
                with evaluating():
                    return loss_fn(pipeline.compute_params(params), batch, key)

            self._eval_fn = jax.jit(
                eval_loss,
                out_shardings=NamedSharding(self.mesh, P()),
                compiler_options=step_compiler_options(pipeline.platform),
            )
        params = to_device(state.params)
        losses = [
            float(
                np.asarray(
                    jax.device_get(self._eval_fn(params, self.put_batch(data.batch_at(i * data.batch_size)), key))
                )
            )
            for i in range(batches)
        ]
        return float(np.mean(losses))

    def put_batch(self, batch: Batch | SampleBatch, step: int | None = None) -> dict:
        """The global batch as arrays split over ``data`` (every process holds the same host batch);
        with ``step``, for a model that draws random numbers, the step's key beside it (``rng``,
        :func:`step_key`), as the train step takes it."""
        arrays = {k: global_put(v, self.batch_sharding) for k, v in batch.arrays().items()}
        if step is not None and self.model.rng:
            arrays["rng"] = global_put(step_key(self.config.seed, step), NamedSharding(self.mesh, P()))
        return arrays

    def lower(self, state: TrainState):
        """The lowered (not yet compiled) step, e.g. for ``.compile().memory_analysis()``."""
        return self.step_fn.lower(state.params, state.opt_state, self.step_spec())

    def abstract_state(self) -> tuple:
        """``(params, opt_state)`` of this trainer's state as shapes and shardings (nothing allocated)."""

        def spec(a, sharding):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        abstract = self.pipeline.abstract_params()
        params = jax.tree.map(spec, abstract, self.pipeline.master_shardings())
        opt_state = jax.tree.map(spec, jax.eval_shape(self.optimizer.init, abstract), self.opt_state_shardings())
        return params, opt_state

    def compile_abstract(self):
        """The compiled step for this trainer's state as shapes and shardings: nothing allocated (for
        ``memory_analysis()`` of a layout before choosing it, or of a target's devices that are not
        here, :mod:`jaxmem.targets`)."""
        if self._compiled is None:
            params, opt_state = self.abstract_state()
            lowered = self.step_fn.lower(params, opt_state, self.step_spec())
            try:
                self._compiled = lowered.compile()
            except Exception as e:  # noqa: BLE001 -- jax raises its runtime error type for it
                needed = out_of_memory_bytes(e)
                if needed is None:
                    raise
                # A TPU's compiler refuses a program beyond the chip's memory (XLA's words kept).
                reason = str(e).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0]
                device = self.mesh.devices.flat[0]
                policy = self.pipeline.policy.policy
                specs = [policy.default, *(sp for *_, sp in (*policy.stages, *policy.microbatch, *policy.cells))]
                specs += [sp for *_, sp in policy.stage_microbatch]
                # A step that already recomputes every stage is not told to recompute.
                kind = "an offload" if all(sp.base == "recompute-all" for sp in specs) else "a recompute or offload"
                raise StepTooLarge(
                    f"the step does not fit {getattr(device, 'device_kind', device.platform)}: its compiler says "
                    f"{reason!r}. Plan under the chip's memory (jaxmem plan --budget ... --target ...), or use "
                    f"{kind} policy, more pipeline stages or smaller microbatches, or a chip with more memory",
                    needed,
                ) from None
        return self._compiled

    @property
    def compile_only(self) -> bool:
        """The mesh's devices are a target's compile-only devices: the step can be compiled, not run."""
        device = self.mesh.devices.flat[0]
        return device not in jax.devices(device.platform) if device.platform in _local_platforms() else True

    def measure_memory(self, state: TrainState | None = None, compiled=None):
        """The compiled ledger of this trainer's step (:func:`jaxmem.memory.measure`); compiles the step
        unless given. Without a ``state`` the step is compiled for its abstract state (nothing is
        allocated: a target's devices need not be here)."""
        if state is None:
            compiled = compiled or self.compile_abstract()
            params, opt_state = self.abstract_state()
        else:
            compiled = compiled or self.compiled(state)
            params, opt_state = abstract_state(state)
        return measure(self.pipeline, compiled, batch=self.batch_spec(), params=params, opt_state=opt_state)

    def step(self, state: TrainState) -> tuple[TrainState, dict, Batch]:
        """One optimizer step on the next batch: ``(state, metrics, batch)``, metrics as in
        :meth:`build_step` (replicated scalars, not yet fetched)."""
        batch, data = state.data.next()
        # The one executable (see compiled()): calling the jitted step_fn would compile it again, as
        # jit's cache does not hold an executable compiled ahead of time (minutes at scale). Its
        # dispatch is as fast (tiny GPT on CPU: 17.9-21.2 ms a step either way).
        arrays = self.put_batch(batch, step=state.step)
        params, opt_state, metrics = self.compiled(state)(state.params, state.opt_state, arrays)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, data=data), metrics, batch

    # ------------------------------------------------------------------ checkpoints
    def export_state(self, state: TrainState) -> tuple[dict, dict]:
        """What a checkpoint step holds: the parameters and optimizer state as they are (the pipeline's
        layout and shardings, nothing gathered or copied; :mod:`jaxmem.train._state_io`) and the
        metadata, with the layout they were saved in."""
        exported = nest({"params": state.params, "opt_state": state.opt_state})
        config = self.config
        meta = {
            "step": state.step,
            "seed": config.seed,
            "model": self.model.name,
            "model_spec": describe_model(self.model),
            "tokenizer": None if self.tokenizer is None else self.tokenizer.name,
            "data": state.data.state(),
            "layout": self.pipeline.param_layout.to_json(),
            "plan": {
                "schedule": self.schedule.name,
                "pipe": config.pipe,
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

    def restore_target(self) -> TrainStateReader:
        """How to read a checkpoint step into this trainer's layout and shardings (any step: another
        mesh, another stage split, an older jaxmem's layout), for :meth:`Checkpointer.restore`."""
        return TrainStateReader(self)

    def import_state(self, state: dict, meta: dict) -> TrainState:
        """A restored state (``{"params", "opt_state"}``, read through :meth:`restore_target`) and its
        metadata as this trainer's :class:`TrainState`, after checking that the run may go on from it
        (:meth:`check_resumable`)."""
        data = self.check_resumable(meta)
        params, opt_state = state["params"], state["opt_state"]
        return TrainState(params=params, opt_state=opt_state, step=int(meta["step"]), data=data)

    def check_resumable(self, meta: dict):
        """Refuse a step's metadata this run may not go on from (another seed, sequence length, data or
        data order); else the data iterator positioned where that step stopped. Reads no array."""
        if meta.get("seed") is not None and meta["seed"] != self.config.seed:
            raise JaxmemError(
                f"the checkpoint at step {meta['step']} was trained with {setting('seed', meta['seed'])}, this run "
                f"has {setting('seed', self.config.seed)}: the data order would change mid-run. Resume with "
                f"{setting('seed', meta['seed'])}, or start a new {setting('checkpoint_dir')}"
            )
        saved_seq = meta.get("plan", {}).get("seq_len")
        if saved_seq is not None and saved_seq != self.config.seq_len and self.samples is None:
            raise JaxmemError(
                f"the checkpoint at step {meta['step']} was trained with {setting('seq_len', saved_seq)}, this "
                f"run has {setting('seq_len', self.config.seq_len)}: a sample number names a window of that many "
                f"tokens, so resuming would repeat some text and skip other. Resume with "
                f"{setting('seq_len', saved_seq)}, or start a new {setting('checkpoint_dir')} (export the weights "
                "first with jaxmem export)"
            )

        if meta["data"].get("order") != ORDER:
            raise JaxmemError(
                f"the checkpoint at step {meta['step']} was written by a jaxmem with another data order "
                f"({meta['data'].get('order') or 'numpy permutation'}, now {ORDER}); resuming would not see every "
                f"sample exactly once. Start a new {setting('checkpoint_dir')} (export the weights first with "
                "jaxmem export)"
            )
        saved = meta["data"].get("fingerprint")
        data = self.data_iterator(seed=meta["data"]["seed"], position=meta["data"]["position"])
        current = data.state().get("fingerprint")
        if saved != current:
            raise JaxmemError(
                f"the checkpoint was trained on other data ({saved or 'the embedded corpus'}) than this run's "
                f"({current or 'the embedded corpus'}): the files or the tokenizer changed. Resuming would break "
                f"exactly-once; give the same {setting('data')} and {setting('tokenizer')}, or start a new "
                f"{setting('checkpoint_dir')}"
            )
        return data


def _load_data(config: TrainConfig):
    """``(train, eval)`` corpora of a config (``(None, None)`` for synthetic data)."""
    if config.data == "synthetic":
        return None, None
    corpus = load_corpus(config.data, tokenizer=config.tokenizer, field=config.data_field, saved=config.checkpoint_dir)
    return corpus.split(config.eval_fraction)


def _attached(target) -> bool:
    """Whether this process runs on ``target``'s kind of device (its compile-only devices are then not
    needed: the attached ones are compiled for)."""
    from jaxmem._util import platform_of

    try:
        devices = jax.devices()
    except RuntimeError:
        return False
    return platform_of(devices) == target.platform


def _local_platforms() -> set[str]:
    """The platforms whose devices this process runs on."""
    return {d.platform for d in jax.devices()}


def abstract_state(state: TrainState) -> tuple:
    """``(params, opt_state)`` as shaped values with their shardings (for lowering without arrays)."""

    def spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

    return jax.tree.map(spec, state.params), jax.tree.map(spec, state.opt_state)
