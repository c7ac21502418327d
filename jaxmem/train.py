"""Pipelined training: a config, a trainer that owns the jitted step, and ``train()`` for the CLI."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem.config import TrainConfig
from jaxmem.data import Batch, DataIterator
from jaxmem.models.gpt import GPT, GPTConfig
from jaxmem.pipeline import Pipeline, PipelineParams, make_mesh

__all__ = ["TrainConfig", "TrainState", "Trainer", "train"]


@dataclasses.dataclass
class TrainState:
    """Parameters, optimizer state, step and data position: everything a resumed run needs."""

    params: PipelineParams
    opt_state: object
    step: int
    data: DataIterator


def global_put(tree, shardings):
    """Host arrays (the same on every process) -> global arrays with ``shardings``; works in one
    process and in a multi-process job alike."""

    def put(value, sharding):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    if isinstance(shardings, NamedSharding):
        return put(tree, shardings)
    return jax.tree.map(put, tree, shardings)


def scalar(x) -> float:
    """A replicated scalar's value on this process (also for multi-process arrays)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return float(np.asarray(x.addressable_data(0)))
    return float(x)


def _to_device(tree):
    """Bring host-resident leaves (``pinned_host`` memory kind) to device memory; others unchanged."""

    def fetch(x):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or str(
            getattr(jax.typeof(x), "memory_space", "")
        )
        return jax.device_put(x, jax.memory.Space.Device) if "host" in str(kind).lower() else x

    return jax.tree.map(fetch, tree)


def init_model_params(config: GPTConfig, seed: int) -> dict:
    """Fresh parameters of the model as a plain dict (``nnx.to_pure_dict`` of its state)."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model))


class Trainer:
    """Builds the schedule, mesh, pipeline and optimizer, and runs jitted steps.

    Everything that can be checked without compiling is checked in the constructor (model preset,
    layer split, mesh size, batch divisibility), so bad input fails fast.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        devices: Sequence | None = None,
    ):
        self.config = config
        self.model_config = config.model_config()
        self.schedule = config.build_schedule()
        self.mesh = make_mesh(config.data_parallel, config.stages, devices)
        self.pipeline = Pipeline(
            self.model_config,
            self.schedule,
            self.mesh,
            layer_counts=config.layers_per_stage,
            policy=config.policy,
        )
        self.pipeline.check_batch(config.batch_size, config.seq_len)
        self.optimizer = optax.adam(config.lr)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self._step_fn = None

    def init_state(self, model_params: dict | None = None) -> TrainState:
        params = model_params if model_params is not None else init_model_params(self.model_config, self.config.seed)
        host = jax.tree.map(np.asarray, jax.device_get(self.pipeline.from_model_params(params)))
        placed = global_put(host, self.pipeline.shardings())
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_state_shardings())(_to_device(placed))
        data = DataIterator(
            source=self.config.data,
            batch_size=self.config.batch_size,
            seq_len=self.config.seq_len,
            seed=self.config.seed,
            vocab_size=self.model_config.vocab_size,
        )
        return TrainState(params=placed, opt_state=opt_state, step=0, data=data)

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

    def _build_step(self):
        return self.build_step(self.pipeline, self.config.batch_size, self.config.seq_len)

    def build_step(self, pipeline: Pipeline, batch: int, seq: int):
        """The jitted train step of ``pipeline`` (same parameter layout as this trainer's) for a batch
        shape; compiled on first call."""
        grad_fn = pipeline.grad_fn(batch, seq)
        optimizer = self.optimizer

        def step(params, opt_state, tokens, targets):
            loss, grads = grad_fn(params, tokens, targets)
            # Offloaded weights / optimizer state come to the device for the update and go back to
            # host through the output shardings.
            params, opt_state = _to_device(params), _to_device(opt_state)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        out_shardings = (pipeline.shardings(), self.opt_state_shardings(), NamedSharding(self.mesh, P()))
        return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)

    @property
    def step_fn(self):
        if self._step_fn is None:
            self._step_fn = self._build_step()
        return self._step_fn

    def put_batch(self, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """The global batch as arrays split over ``data`` (every process holds the same host batch)."""
        return global_put(batch.tokens, self.batch_sharding), global_put(batch.targets, self.batch_sharding)

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
        )(_to_device(state.params), _to_device(state.opt_state))
        config = self.config
        meta = {
            "step": state.step,
            "seed": config.seed,
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
        data = DataIterator(
            source=self.config.data,
            batch_size=self.config.batch_size,
            seq_len=self.config.seq_len,
            seed=meta["data"]["seed"],
            position=meta["data"]["position"],
            vocab_size=self.model_config.vocab_size,
        )
        return TrainState(params=params, opt_state=opt_state, step=int(meta["step"]), data=data)

    def lower(self, state: TrainState):
        """The lowered (not yet compiled) step, e.g. for ``.compile().memory_analysis()``."""
        tokens = jax.ShapeDtypeStruct(
            (self.config.batch_size, self.config.seq_len), jnp.int32, sharding=self.batch_sharding
        )
        return self.step_fn.lower(state.params, state.opt_state, tokens, tokens)

    def step(self, state: TrainState) -> tuple[TrainState, jax.Array, Batch]:
        batch, data = state.data.next()
        tokens, targets = self.put_batch(batch)
        params, opt_state, loss = self.step_fn(state.params, state.opt_state, tokens, targets)
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1, data=data), loss, batch


def apply_plan(config: TrainConfig, log: Callable[[str], None] = print) -> tuple[TrainConfig, dict]:
    """Replace the pipeline settings of a ``plan="auto"`` config with the planner's pick."""
    from jaxmem.memory import get_hardware
    from jaxmem.policy._planner import PlanError, plan

    platform = jax.devices()[0].platform
    name = config.hardware if config.hardware != "auto" else {"gpu": "h100", "tpu": "tpu-v5p"}.get(platform, "cpu")
    devices = config.devices or config.data_parallel * config.stages
    result = plan(
        config.model_config(),
        devices=devices,
        budget_bytes=config.budget,
        hardware=get_hardware(name),
        batch=config.batch_size,
        seq=config.seq_len,
        model_name=config.model,
    )
    for line in result.explain(top=3):
        log(line)
    if result.best is None:
        raise PlanError(
            f"nothing fits a budget of {config.budget / 2**20:,.1f} MiB per device on {devices} devices; the "
            f"smallest plan needs {result.smallest_budget / 2**20:,.1f} MiB (pass --budget "
            f"{result.smallest_budget / 2**20:,.1f}MiB or more, or more devices)",
            result.smallest_budget,
        )
    best = result.best
    planned = dataclasses.replace(
        config,
        plan=None,
        schedule=best.schedule,
        schedule_csv=None,
        stages=best.pipe,
        data_parallel=best.data,
        microbatches=best.microbatches,
        virtual=best.virtual if best.schedule == "interleaved-1f1b" else None,
        policy=best.policy,
        devices=devices,
    )
    return planned, result.to_json()


def _rollback_sample_log(path: str, step: int) -> None:
    """Keep only the log lines of steps <= ``step`` (what the restored checkpoint contains)."""
    import os

    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and int(line.split()[0]) <= step]
    with open(path, "w") as f:
        f.writelines(lines)


def _after_step(config: TrainConfig, state: TrainState, batch: Batch, step_times: list | None = None) -> None:
    """Per-step side channels: sample log, heartbeat for the launcher (the step reached and the median
    step seconds so far, which calibrates the recovery planner), injected failure."""
    import os
    import signal

    if config.sample_log and jax.process_index() == 0:
        with open(config.sample_log, "a") as f:
            f.write(f"{state.step} {' '.join(str(i) for i in batch.sample_ids)}\n")
    heartbeat = os.environ.get("JAXMEM_HEARTBEAT_FILE")
    if heartbeat:
        median = f" {float(np.median(step_times)):.6f}" if step_times else ""
        with open(heartbeat, "w") as f:
            f.write(f"{state.step}{median}")
    fail_at = os.environ.get("JAXMEM_FAIL_AT_STEP")
    if fail_at and state.step >= int(fail_at):
        os.kill(os.getpid(), signal.SIGKILL)  # a drill: die the hard way, like a lost host


def train(config: TrainConfig, *, progress: bool = True, on_step: Callable | None = None) -> dict:
    """Run until ``config.steps`` steps; returns the summary the CLI prints with ``--json``.

    With ``checkpoint_dir`` the run resumes from the latest complete checkpoint there (on whatever
    mesh this config describes) and saves every ``checkpoint_every`` steps and at the end.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    plan_record = None
    if config.plan == "auto":
        config, plan_record = apply_plan(
            config, log=(lambda line: Console(stderr=True).print(line)) if progress else (lambda line: None)
        )
    if config.adaptive:
        return train_adaptive(config, progress=progress)
    trainer = Trainer(config)
    state = trainer.init_state()
    console = Console(stderr=True)
    checkpointer = None
    resumed_from = None
    if config.checkpoint_dir:
        from jaxmem.elastic import Checkpointer

        checkpointer = Checkpointer(config.checkpoint_dir, every=config.checkpoint_every, keep=config.keep_checkpoints)
        if checkpointer.latest_step() is not None:
            restored = checkpointer.restore(trainer.restore_target())
            state = trainer.import_state(restored.state, restored.meta)
            resumed_from = restored.step
            if progress:
                console.print(f"resumed from checkpoint step {restored.step} ({config.checkpoint_dir})")
    if config.sample_log and jax.process_index() == 0:
        _rollback_sample_log(config.sample_log, state.step)
    tokens_per_step = config.batch_size * config.seq_len
    losses: list[float] = []
    first_step = state.step
    if progress:
        console.print(
            f"[bold]jaxmem train[/bold]: {config.model if isinstance(config.model, str) else 'custom'} "
            f"({trainer.model_config.param_count():,} params), "
            f"{trainer.schedule.name} P={config.stages} M={config.microbatches} "
            f"stages={trainer.schedule.num_stages} data={config.data_parallel} on "
            f"{config.data_parallel * config.stages} {jax.devices()[0].platform} devices; compiling..."
        )
    columns = [
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    compile_seconds = run_start = None
    step_times: list[float] = []
    start = time.perf_counter()
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("train", total=config.steps, completed=state.step, info="compiling")
        while state.step < config.steps:
            tick = time.perf_counter()
            state, loss, batch = trainer.step(state)
            loss_value = scalar(loss)
            if compile_seconds is not None:
                step_times.append(time.perf_counter() - tick)
            losses.append(loss_value)
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - start
                run_start = time.perf_counter()
            _after_step(config, state, batch, step_times)
            if checkpointer is not None and checkpointer.should_save(state.step):
                exported, meta = trainer.export_state(state)
                checkpointer.save(state.step, exported, meta)
            if on_step:
                on_step(state, loss_value)
            elapsed = time.perf_counter() - run_start
            rate = tokens_per_step * (len(losses) - 1) / max(elapsed, 1e-9)
            bar.update(task, completed=state.step, info=f"loss {loss_value:.3f}  {rate:,.0f} tok/s")
    if checkpointer is not None:
        checkpointer.wait()  # a save of this very step may still be in flight
        if checkpointer.latest_step() != state.step:
            exported, meta = trainer.export_state(state)
            checkpointer.save(state.step, exported, meta, force=True)
        checkpointer.close()
    run_seconds = time.perf_counter() - (run_start or start)
    steady_steps = max(len(losses) - 1, 0)
    return {
        "steps": state.step,
        "steps_run": len(losses),
        "resumed_from": resumed_from,
        "first_step": first_step,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "loss_last10_mean": float(np.mean(losses[-10:])) if losses else None,
        "tokens_per_second": tokens_per_step * steady_steps / run_seconds if steady_steps else None,
        "step_seconds_median": float(np.median(step_times)) if step_times else None,
        "compile_seconds": compile_seconds,
        "run_seconds": run_seconds,
        "schedule": trainer.schedule.name,
        "stages": config.stages,
        "pipeline_stages": trainer.schedule.num_stages,
        "microbatches": config.microbatches,
        "data_parallel": config.data_parallel,
        "devices": config.data_parallel * config.stages,
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "model": config.model if isinstance(config.model, str) else "custom",
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "policy": None if config.policy is None else str(config.policy),
        "plan": plan_record and plan_record["best"],
    }


def adaptive_workload(config: TrainConfig):
    """The varying workload of an adaptive run: per step, (sequence length, dropped layers)."""
    import random

    rng = random.Random(config.seed)
    buckets = config.seq_len_schedule or (config.seq_len,)
    n_layers = config.model_config().n_layers
    for step in range(config.steps):
        seq = buckets[step % len(buckets)] if config.seq_len_order == "cycle" else rng.choice(buckets)
        drop = (
            frozenset({rng.randrange(n_layers)})
            if config.layer_drop and rng.random() < config.layer_drop
            else frozenset()
        )
        yield seq, drop


def _explored_text(explored: dict) -> str:
    if "why" in explored:
        return f"{explored['policy']} dropped ({explored['why']})"
    verdict = "kept" if explored["kept"] else "not kept"
    return (
        f"{explored['policy']} {explored['step_seconds']:.3f}s/step vs {explored['instead_of']} "
        f"{explored['instead_of_step_seconds']:.3f}s/step -> {explored['policy']} {verdict}"
    )


def train_adaptive(config: TrainConfig, *, progress: bool = True) -> dict:
    """Training under the online profiler: the program changes with the workload, the policy follows."""
    from rich.console import Console

    from jaxmem.profiler import AdaptiveProfiler

    trainer = Trainer(config)
    state = trainer.init_state()
    hardware = None if config.hardware == "auto" else config.hardware
    profiler = AdaptiveProfiler(trainer, config.budget, hardware=hardware, explore=config.explore, horizon=config.steps)
    console = Console(stderr=True)
    losses, tokens, start = [], 0, time.perf_counter()
    known, explored = 0, set()
    for i, (seq, drop) in enumerate(adaptive_workload(config)):
        data = dataclasses.replace(state.data, seq_len=seq)
        batch = data.batch_at(state.data.position)
        tok, tgt = trainer.put_batch(batch)
        state, loss = profiler.step(state, tok, tgt, drop)
        state = dataclasses.replace(
            state, data=dataclasses.replace(state.data, position=state.data.position + config.batch_size)
        )
        losses.append(float(loss))
        tokens += config.batch_size * seq
        if progress and len(profiler.records) > known:
            record = profiler.records[-1]
            console.print(
                f"step {i + 1}: new program ({record.label}) -> policy {record.policy}, "
                f"{record.compiled_bytes / 2**20:.2f} MiB compiled (budget {config.budget / 2**20:.2f} MiB), "
                f"{record.compiles} compile(s), {record.adapt_seconds:.1f}s"
            )
            known = len(profiler.records)
        elif progress and (i + 1) % 10 == 0:
            console.print(f"step {i + 1}/{config.steps}: loss {losses[-1]:.3f}")
        for record in profiler.records if progress else ():
            if record.explored is not None and record.label not in explored:
                console.print(f"step {i + 1}: explored ({record.label}): {_explored_text(record.explored)}")
                explored.add(record.label)
    seconds = time.perf_counter() - start
    profiler.close()
    report = profiler.report()
    if config.profile_report:
        profiler.write_report(config.profile_report)
    violations = sum(1 for r in profiler.records if r.compiled_bytes > config.budget)
    return {
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "tokens_per_second": tokens / seconds,
        "seconds": seconds,
        "schedule": trainer.schedule.name,
        "stages": config.stages,
        "microbatches": config.microbatches,
        "devices": config.data_parallel * config.stages,
        "model": config.model if isinstance(config.model, str) else "custom",
        "adaptive": True,
        "budget_bytes": int(config.budget),
        "budget_violations": violations,
        "signatures": len(profiler.records),
        "compiles": profiler.compile_count,
        "profile": report,
    }
