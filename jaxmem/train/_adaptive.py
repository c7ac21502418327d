"""Training under the online profiler (``jaxmem train --adaptive``): the program changes with the
workload (sequence-length buckets, layer drop), and the memory policy follows it."""

from __future__ import annotations

import dataclasses
import time

from jaxmem.config import TrainConfig
from jaxmem.profiler import AdaptiveProfiler
from jaxmem.train._console import StopRequests, console_log
from jaxmem.train._hooks import StepInfo, check_outputs, default_hooks
from jaxmem.train._trainer import Trainer

__all__ = ["adaptive_workload", "train_adaptive"]


def adaptive_workload(config: TrainConfig):
    """The varying workload of an adaptive run: per step, (sequence length, dropped layers)."""
    import random

    rng = random.Random(config.seed)
    buckets = config.seq_len_schedule or (config.seq_len,)
    n_layers = config.build_model().n_layers
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


def train_adaptive(config: TrainConfig, *, progress: bool = True, hooks=()) -> dict:
    """Training under the online profiler: the program changes with the workload, the policy follows.

    Checkpoints, the sample log and SIGTERM/SIGINT behave as in :func:`jaxmem.train.train`: the
    config's hooks (plus ``hooks``) resume the state, data position and step, and the workload
    (sequence length, dropped layers) of a resumed run continues where the saved one stopped.
    """

    check_outputs(config)  # before any work: the report is never lost at the run's end
    console, log = console_log(progress)
    trainer = Trainer(config)
    hooks = [*default_hooks(config, log), *hooks]
    for hook in hooks:
        getattr(hook, "before_start", lambda trainer: None)(trainer)
    state = trainer.init_state()
    for hook in hooks:
        state = hook.on_start(trainer, state)
    first_step = state.step
    hardware = None if config.hardware == "auto" else config.hardware
    profiler = AdaptiveProfiler(
        trainer.pipeline,
        config.budget,
        build_step=trainer.build_step,
        batch_sharding=trainer.batch_sharding,
        hardware=hardware,
        explore=config.explore,
        horizon=config.steps,
    )
    losses, tokens, start = [], 0, time.perf_counter()
    known, explored = 0, set()
    stop = StopRequests()
    with stop:
        for i, (seq, drop) in enumerate(adaptive_workload(config)):
            if i < first_step:
                continue  # the saved run did these steps
            tick = time.perf_counter()
            data = dataclasses.replace(state.data, seq_len=seq)
            batch = data.batch_at(state.data.position)
            state, loss = profiler.step(state, trainer.put_batch(batch, step=state.step), drop)
            state = dataclasses.replace(
                state, data=dataclasses.replace(state.data, position=state.data.position + config.batch_size)
            )
            losses.append(float(loss))
            tokens += config.batch_size * seq
            info = StepInfo(state.step, losses[-1], batch, time.perf_counter() - tick, (), {})
            for hook in hooks:
                hook.on_step(trainer, state, info)
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
            if stop.requested(state.step):
                break
        stop.announce(state.step, config, log)
        for hook in hooks:
            hook.on_end(trainer, state)
    seconds = time.perf_counter() - start
    profiler.close()
    report = profiler.report()
    if config.profile_report:
        profiler.write_report(config.profile_report)
    violations = sum(1 for r in profiler.records if r.compiled_bytes > config.budget)
    return {
        "steps": state.step,
        "steps_run": len(losses),
        "resumed_from": first_step or None,
        "interrupted": stop.reason,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "tokens_per_second": tokens / seconds,
        "seconds": seconds,
        "schedule": trainer.schedule.name,
        "pipe": config.pipe,
        "microbatches": config.microbatches,
        "devices": config.num_devices,
        "model": trainer.model.name,
        "adaptive": True,
        "budget_bytes": int(config.budget),
        "budget_violations": violations,
        "signatures": len(profiler.records),
        "compiles": profiler.compile_count,
        "profile": report,
    }
