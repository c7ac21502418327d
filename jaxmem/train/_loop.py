"""The training loop behind ``jaxmem train``: steps, progress, hooks, and the summary it returns."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmem.config import TrainConfig
from jaxmem.train._hooks import CheckpointHook, Hook, SampleLogHook, StepInfo
from jaxmem.train._state import scalar
from jaxmem.train._trainer import Trainer

__all__ = ["apply_plan", "default_hooks", "train"]


def apply_plan(config: TrainConfig, log: Callable[[str], None] = print) -> tuple[TrainConfig, dict]:
    """Replace the pipeline settings of a ``plan="auto"`` config with the configuration search's pick."""
    from jaxmem.memory import get_hardware
    from jaxmem.search import SearchError, search

    platform = jax.devices()[0].platform
    name = config.hardware if config.hardware != "auto" else {"gpu": "h100", "tpu": "tpu-v5p"}.get(platform, "cpu")
    devices = config.devices or config.data_parallel * config.stages
    result = search(
        config.build_model(),
        devices=devices,
        budget_bytes=config.budget,
        hardware=get_hardware(name),
        batch=config.batch_size,
        seq=config.seq_len,
    )
    for line in result.explain(top=3):
        log(line)
    if result.best is None:
        raise SearchError(
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


def default_hooks(config: TrainConfig, log: Callable[[str], None] = lambda line: None) -> list[Hook]:
    """The hooks a config asks for: checkpoints (``checkpoint_dir``), then the sample log."""
    hooks: list[Hook] = []
    if config.checkpoint_dir:
        hooks.append(
            CheckpointHook(config.checkpoint_dir, every=config.checkpoint_every, keep=config.keep_checkpoints, log=log)
        )
    if config.sample_log:
        hooks.append(SampleLogHook(config.sample_log))
    return hooks


def train(
    config: TrainConfig,
    *,
    progress: bool = True,
    hooks: Sequence[Hook] = (),
    on_step: Callable | None = None,
    trainer: Trainer | None = None,
) -> dict:
    """Run until ``config.steps`` steps; returns the summary the CLI prints with ``--json``.

    With ``checkpoint_dir`` the run resumes from the latest complete checkpoint there (on whatever
    mesh this config describes) and saves every ``checkpoint_every`` steps and at the end.

    Args:
        config: the run.
        progress: a progress bar on stderr.
        hooks: run after the config's own (checkpoints, sample log), in order.
        on_step: ``(state, loss)`` after every step (a shorthand for a hook).
        trainer: a trainer built for ``config`` (e.g. with your own optimizer); built when None.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    log = (lambda line: console.print(line, markup=False)) if progress else (lambda line: None)
    plan_record = None
    if config.plan == "auto":
        config, plan_record = apply_plan(config, log=log)
    if config.adaptive:
        from jaxmem.train._adaptive import train_adaptive

        return train_adaptive(config, progress=progress)
    trainer = trainer or Trainer(config)
    hooks = [*default_hooks(config, log), *hooks]
    state = trainer.init_state()
    first_step = state.step
    for hook in hooks:
        state = hook.on_start(trainer, state)
    resumed_from = state.step if state.step != first_step else None
    first_step = state.step
    tokens_per_step = config.batch_size * config.seq_len
    losses: list[float] = []
    if progress:
        console.print(
            f"[bold]jaxmem train[/bold]: {trainer.model.name} ({trainer.model.param_count():,} params), "
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
            seconds = time.perf_counter() - tick
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - start
                run_start = time.perf_counter()
            else:
                step_times.append(seconds)
            losses.append(loss_value)
            info = StepInfo(state.step, loss_value, batch, seconds, tuple(step_times))
            for hook in hooks:
                hook.on_step(trainer, state, info)
            if on_step:
                on_step(state, loss_value)
            elapsed = time.perf_counter() - run_start
            rate = tokens_per_step * (len(losses) - 1) / max(elapsed, 1e-9)
            bar.update(task, completed=state.step, info=f"loss {loss_value:.3f}  {rate:,.0f} tok/s")
    for hook in hooks:
        hook.on_end(trainer, state)
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
        "model": trainer.model.name,
        "dtype": trainer.pipeline.compute_dtype(trainer.batch_spec()).name,
        "param_dtype": trainer.pipeline.param_dtype().name,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "policy": None if config.policy is None else str(config.policy),
        "plan": plan_record and plan_record["best"],
    }
