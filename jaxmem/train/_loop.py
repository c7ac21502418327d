"""The training loop behind ``jaxmem train``: steps, progress, hooks, and the summary it returns."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import compiled_bytes, human_bytes
from jaxmem.config import TrainConfig
from jaxmem.memory import get_hardware
from jaxmem.policy import from_spec
from jaxmem.search import LEDGER_MARGIN, SearchError, check_budget_floor, confirm, progress_lines, search
from jaxmem.train._adaptive import train_adaptive
from jaxmem.train._console import StopRequests, console_log
from jaxmem.train._hooks import Hook, StepInfo, check_outputs, default_hooks
from jaxmem.train._metrics import MetricsHook, model_flops_per_step
from jaxmem.train._state import scalar
from jaxmem.train._trainer import Trainer

__all__ = ["TrainingError", "apply_plan", "planned_config", "train"]


def apply_plan(config: TrainConfig, log: Callable[[str], None] = print) -> tuple[TrainConfig, dict]:
    """Replace the pipeline settings of a ``plan="auto"`` config with the configuration search's pick."""
    config, record, _ = _plan(config, log)
    return config, record


def _plan(config: TrainConfig, log) -> tuple[TrainConfig, dict, Trainer | None]:
    """:func:`apply_plan`, and the trainer that compiled the pick to check it (None when nothing was
    compiled here): the run takes it, and with it the compiled step, instead of compiling it again."""

    name = config.hardware_profile()
    devices = config.devices or config.num_devices
    model = config.build_model()
    check_budget_floor(model, devices, config.budget)  # before the search and the CPU's calibration
    # The run compiles here, so each pick is compiled and checked before it is taken (no margin
    # needed); a plan for more devices than this machine has keeps the ledger's measured margin. A
    # target's picks are compiled for its devices, here, with none present.
    target = config.compile_target()
    here = devices <= jax.device_count() or target is not None
    margin = config.margin if config.margin is not None else (0.0 if here else LEDGER_MARGIN)
    result = search(
        model,
        devices=devices,
        budget_bytes=config.budget,
        hardware=get_hardware(name),
        batch=config.batch_size,
        seq=config.seq_len,
        zero=config.zero,
        vocab_parallel=config.vocab_parallel,
        margin=margin,
        progress=progress_lines(log),
        target=target,
    )
    if result.best is None:  # said once, as the error (the search's own explanation says the same)
        need = f"{math.ceil(result.smallest_budget / 2**20 * 10) / 10:.1f}MiB"  # rounded up: it must fit
        raise SearchError(
            f"nothing fits a budget of {human_bytes(config.budget)} per device on {devices} devices; the "
            f"smallest plan needs {need} (give {setting('budget', need)} or more, or more devices)",
            result.smallest_budget,
        )
    trainers = {}  # the last candidate compiled: the pick, when it fits

    def compiled(candidate):
        trainers.clear()  # a pick passed over lets go of its trainer and executable
        trainers[id(candidate)] = Trainer(planned_config(config, candidate, devices))
        return compiled_bytes(trainers[id(candidate)].compile_abstract())

    if here:
        where = "" if target is None else f" for {target.with_devices(devices)} (no device present)"
        log(f"plan: compiling the pick{where} to check it fits ...")
        result = confirm(result, compiled, log=log)
    for line in result.explain(top=3):
        log(line)
    return planned_config(config, result.best, devices), result.to_json(), trainers.get(id(result.best))


def _compiled_only(config: TrainConfig, trainer: Trainer, log, plan_record) -> dict:
    """A run for a target whose devices are not here: its step compiled for them (nothing allocated,
    nothing trained) and its memory read from the target's compiler, against the budget if given."""
    target = config.compile_target().with_devices(config.num_devices)
    log(f"compiling the step for {target} (no device present; nothing is trained here) ...")
    start = time.perf_counter()
    compiled = trainer.compile_abstract()
    seconds = time.perf_counter() - start
    device_bytes = compiled_bytes(compiled)
    fits = None if not config.budget else device_bytes <= config.budget
    log(
        f"compiled for {target} in {seconds:.1f}s: {human_bytes(device_bytes)} per device"
        + ("" if fits is None else f", {'within' if fits else 'over'} the budget of {human_bytes(config.budget)}")
    )
    log(f"to train it, run the same command where the {target.name} devices are attached")
    return {
        "trained": False,
        "target": str(target),
        "compiled_device_bytes": device_bytes,
        "budget_bytes": config.budget,
        "fits_budget": fits,
        "compile_seconds": seconds,
        "steps": 0,
        "schedule": trainer.schedule.name,
        "pipe": config.pipe,
        "microbatches": config.microbatches,
        "data_parallel": config.data_parallel,
        "fsdp": config.fsdp,
        "tensor": config.tensor,
        "devices": config.num_devices,
        "model": trainer.model.name,
        "policy": None if config.policy is None else str(config.policy),
        "plan": plan_record and plan_record["best"],
        "interrupted": None,
    }


def planned_config(config: TrainConfig, best, devices: int) -> TrainConfig:
    """``config`` with the pipeline settings of a search's candidate (a
    :class:`~jaxmem.search.Candidate`) on ``devices``."""
    return dataclasses.replace(
        config,
        plan=None,
        schedule=best.schedule,
        schedule_csv=None,
        pipe=best.pipe,
        data_parallel=best.data,
        fsdp=best.fsdp,
        tensor=best.tensor,
        context=best.context,
        microbatches=best.microbatches,
        virtual=best.virtual if best.schedule == "interleaved-1f1b" else None,
        policy=best.policy,
        split_backward=best.split_backward,
        hand_recomputed=best.hand_recomputed,
        devices=devices,
        budget=config.budget if config.run_dir else None,  # past planning, only metrics show it
        margin=None,
    )


def _metrics_hook(config: TrainConfig, trainer: Trainer, log) -> MetricsHook:

    name = config.hardware_profile()
    hardware = get_hardware(name)
    # CPU: the calibrated rate is the whole machine's (virtual devices share its cores).
    peak = hardware.peak_flops * (1 if name == "cpu" else config.num_devices)
    hook = MetricsHook(
        config.run_dir,
        flops_per_step=model_flops_per_step(trainer.model, config.batch_size, config.seq_len),
        peak_flops=peak,
        tokens_per_step=None if trainer.samples is not None else config.batch_size * config.seq_len,
        budget_bytes=config.budget,
        flush_every=config.log_every,
    )
    log(f"metrics -> {config.run_dir} (MFU against {hardware.name}: {peak / 1e12:,.3f} TFLOP/s)")
    return hook


def _selective_without_quadratic(config: TrainConfig, model) -> bool:
    """Whether the policy asks for selective recompute somewhere of a model with nothing it would
    recompute (no ``quadratic`` tag group)."""

    policy = from_spec(config.policy)
    parts = [policy.default, *(p for *_, p in (*policy.stages, *policy.microbatch, *policy.stage_microbatch))]
    return any(p.base == "selective" for p in parts) and not model.tags.group("quadratic")


class TrainingError(JaxmemError):
    """Training cannot go on (a non-finite loss); checkpoints of earlier steps are intact."""


def _check_plan(plan_record: dict | None, step_times: list[float], log) -> dict | None:
    """Measured against predicted step time of a ``plan="auto"`` pick, once there are a few steps."""
    if not plan_record or not plan_record.get("best") or len(step_times) < 3:
        return None
    predicted = plan_record["best"]["step_seconds"]
    measured = float(np.median(step_times))
    ratio = measured / predicted if predicted else math.inf
    check = {"predicted_step_seconds": predicted, "measured_step_seconds": measured, "ratio": ratio}
    if not 0.5 <= ratio <= 2.0:
        log(
            f"warning: the plan predicted {predicted:.3f} s/step but steps take {measured:.3f} s "
            f"({ratio:.1f}x); its ranking may be wrong on this machine (see `jaxmem plan --hardware`)"
        )
    else:
        log(f"plan check: predicted {predicted:.3f} s/step, measured {measured:.3f} s/step ({ratio:.2f}x)")
    return check


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
    mesh this config describes) and saves every ``checkpoint_every`` steps and at the end. With
    ``run_dir`` it writes metrics there (see :class:`MetricsHook`). With held-out data
    (``eval_fraction``) it evaluates every ``eval_every`` steps and at the end. A non-finite loss
    stops the run with a :class:`TrainingError` naming the step, and saves nothing of it.

    Args:
        config: the run.
        progress: a progress bar on stderr (plain lines every ``log_every`` steps when stderr is not
            a terminal).
        hooks: run after the config's own (checkpoints, sample log, metrics), in order.
        on_step: ``(state, loss)`` after every step (a shorthand for a hook).
        trainer: a trainer built for ``config`` (e.g. with your own optimizer); built when None.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    check_outputs(config)  # before any work: a run's output is never lost at its end
    console, log = console_log(progress)
    plan_record = None
    planned = None
    if config.plan == "auto":
        config, plan_record, planned = _plan(config, log)
    if config.adaptive:
        return train_adaptive(config, progress=progress, hooks=hooks)
    trainer = trainer or planned or Trainer(config)
    config = trainer.config  # with the data's vocabulary
    if trainer.compile_only:
        return _compiled_only(config, trainer, log, plan_record)
    if _selective_without_quadratic(config, trainer.model):
        log(
            f"note: model {trainer.model.name} declares no 'quadratic' tag group, so selective recompute keeps "
            "every tag (as save-all does); name the tensors to recompute in its TagSet's groups, e.g. "
            "groups={'quadratic': ('attn_probs',)}"
        )
    hooks = [*default_hooks(config, log), *hooks]
    metrics_hook = None
    if config.run_dir:
        metrics_hook = _metrics_hook(config, trainer, log)
        hooks.append(metrics_hook)
    for hook in hooks:
        getattr(hook, "before_start", lambda trainer: None)(trainer)
    # A run that resumes does not read --init-from's weights only to replace them.
    resuming = any(getattr(hook, "resuming", False) for hook in hooks)
    state = trainer.init_state(None if resuming else trainer.initial_params())
    first_step = state.step
    for hook in hooks:
        state = hook.on_start(trainer, state)
    for warning in metrics_hook.warnings if metrics_hook else ():
        log(f"note: {warning}")
    resumed_from = state.step if state.step != first_step else None
    first_step = state.step
    if state.step >= config.steps:
        log(
            f"the run is already past its last step: it resumed at step {state.step} (from "
            f"{config.checkpoint_dir}) and {setting('steps', config.steps)}; nothing to run. Give a larger "
            f"{setting('steps')} to train further"
        )
    # Samples of a model with a batch of its own are counted as samples, token windows as tokens.
    per_step, unit = (
        (config.batch_size, "samples")
        if trainer.samples is not None
        else (
            config.batch_size * config.seq_len,
            "tok",
        )
    )
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    if progress and state.step < config.steps:
        data = trainer.data_name if trainer.corpus is not None or trainer.samples is not None else "synthetic tokens"
        tokenizer = f", {trainer.tokenizer.name} tokens" if trainer.tokenizer is not None else ""
        console.print(
            f"[bold]jaxmem train[/bold]: {trainer.model.name} ({trainer.model.param_count():,} params) on "
            f"{data}{tokenizer}, {trainer.schedule.name} P={config.pipe} M={config.microbatches} "
            f"stages={trainer.schedule.num_stages} data={config.data_parallel}"
            f"{f' fsdp={config.fsdp}' if config.fsdp > 1 else ''}"
            f"{f' context={config.context}' if config.context > 1 else ''}"
            f"{f' tensor={config.tensor}' if config.tensor > 1 else ''} on "
            f"{config.num_devices} {jax.devices()[0].platform} devices; compiling...",
            highlight=False,
        )
    interactive = progress and console.is_terminal
    columns = [
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    compile_seconds = run_start = None
    plan_check = None
    step_times: list[float] = []
    start = time.perf_counter()
    stop = StopRequests()
    with stop, Progress(*columns, console=console, disable=not interactive, transient=False) as bar:
        task = bar.add_task("train", total=config.steps, completed=state.step, info="compiling")
        while state.step < config.steps:
            tick = time.perf_counter()
            lr = trainer.learning_rate(state.step) if trainer.learning_rate else None
            new_state, metrics, batch = trainer.step(state)
            values = {k: scalar(v) for k, v in metrics.items()}
            loss_value = values.pop("loss")
            seconds = time.perf_counter() - tick
            if not math.isfinite(loss_value):
                for hook in hooks:
                    hook.on_error(trainer, state)
                raise TrainingError(
                    f"the loss is {loss_value} at step {new_state.step} (gradient norm {values.get('grad_norm')}); "
                    f"stopped without saving it. Lower {setting('lr')} (now {config.lr:g}), set "
                    f"{setting('grad_clip', 1.0)} or {setting('warmup_steps')}, and resume from the last checkpoint"
                )
            state = new_state
            if compile_seconds is None:
                compile_seconds = time.perf_counter() - start
                run_start = time.perf_counter()
            else:
                step_times.append(seconds)
            if lr is not None:
                values["lr"] = float(lr)
            if trainer.has_eval and (
                state.step == config.steps or (config.eval_every and state.step % config.eval_every == 0)
            ):
                values["eval_loss"] = trainer.eval_loss(state)
                evals.append((state.step, values["eval_loss"]))
            losses.append(loss_value)
            info = StepInfo(state.step, loss_value, batch, seconds, tuple(step_times), values)
            for hook in hooks:
                hook.on_step(trainer, state, info)
            if on_step:
                on_step(state, loss_value)
            if plan_check is None and len(step_times) == 3:
                plan_check = _check_plan(plan_record, step_times, log)
            # The training steps' own rate, as --run-dir metrics give it (evaluation and saves excluded).
            rate = per_step * len(step_times) / max(sum(step_times), 1e-9)
            text = f"loss {loss_value:.3f}  {rate:,.0f} {unit}/s"
            if "eval_loss" in values:
                text += f"  eval {values['eval_loss']:.3f}"
            bar.update(task, completed=state.step, info=text)
            if progress and not interactive and (state.step % config.log_every == 0 or state.step == config.steps):
                median = f"{np.median(step_times):.3f} s/step" if step_times else "compiling"
                log(f"step {state.step}/{config.steps}  {text}  {median}")
            if stop.requested(state.step):
                break
        stop.announce(state.step, config, log)
        for hook in hooks:  # inside the handlers: a preemption during the final save waits for it
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
        "eval_losses": evals,
        "tokens_per_second": per_step * steady_steps / run_seconds if steady_steps and unit == "tok" else None,
        "samples_per_second": config.batch_size * steady_steps / run_seconds if steady_steps else None,
        "step_seconds_median": float(np.median(step_times)) if step_times else None,
        "compile_seconds": compile_seconds,
        "run_seconds": run_seconds,
        "schedule": trainer.schedule.name,
        "pipe": config.pipe,
        "pipeline_stages": trainer.schedule.num_stages,
        "microbatches": config.microbatches,
        "data_parallel": config.data_parallel,
        "fsdp": config.fsdp,
        "tensor": config.tensor,
        "zero": config.zero and config.replicas > 1,
        "vocab_split": trainer.pipeline.vocab is not None,
        "devices": config.num_devices,
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "model": trainer.model.name,
        "data": trainer.data_name,
        "tokenizer": trainer.tokenizer.name if trainer.tokenizer is not None else None,
        "vocab_size": trainer.model.vocab_size,
        "dtype": trainer.pipeline.compute_dtype(trainer.batch_spec()).name,
        "param_dtype": trainer.pipeline.param_dtype().name,
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
        "policy": None if config.policy is None else str(config.policy),
        "plan": plan_record and plan_record["best"],
        "plan_check": plan_check,
        "run_dir": config.run_dir,
        "interrupted": stop.reason,
    }
