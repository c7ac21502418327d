"""Hooks: what a training loop does beside the steps -- checkpoints, the sample log, and (from the
elastic layer) heartbeats and injected failures. A hook is an object with any of ``on_start``,
``on_step`` and ``on_end``; the loop calls them in order."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np

from jaxmem._errors import setting
from jaxmem.config import TrainConfig
from jaxmem.data import Batch, BPETokenizer
from jaxmem.train._checkpoint import Checkpointer, CheckpointError
from jaxmem.train._state import TrainState

__all__ = [
    "DIVERGENCE_FACTOR",
    "DIVERGENCE_WINDOW",
    "CheckpointHook",
    "Hook",
    "SampleLogHook",
    "StepInfo",
    "check_outputs",
    "default_hooks",
]

# The divergence guard of CheckpointHook: a loss over FACTOR x the median of the last WINDOW losses.
DIVERGENCE_FACTOR = 10.0
DIVERGENCE_WINDOW = 20


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook learns about the step just run.

    Attributes:
        step: the step count after it (``state.step``).
        loss: its loss.
        batch: the batch it consumed (with the sample number of every row).
        seconds: its wall time (the first step of a run includes the compile).
        step_seconds: wall times of this run's steps so far, the compiling first step excluded.
        metrics: the step's other scalars: ``grad_norm``, ``lr``, and ``eval_loss`` on eval steps.
    """

    step: int
    loss: float
    batch: Batch
    seconds: float
    step_seconds: tuple[float, ...] = ()
    metrics: dict = dataclasses.field(default_factory=dict)


class Hook:
    """Callbacks around a training loop; override what you need.

    ``before_start`` runs before the state is built (a check that should fail fast: no array
    exists yet); ``on_start`` may return a different state (a restored one); ``on_step`` runs after every step;
    ``on_end`` after the last; ``on_error`` instead of ``on_end`` when the run stops on an error
    (e.g. a non-finite loss): finish what is in flight, but save nothing of the failed state.
    """

    def before_start(self, trainer) -> None:
        return None

    def on_start(self, trainer, state: TrainState) -> TrainState:
        return state

    def on_step(self, trainer, state: TrainState, info: StepInfo) -> None:
        return None

    def on_end(self, trainer, state: TrainState) -> None:
        return None

    def on_error(self, trainer, state: TrainState) -> None:
        return None


class CheckpointHook(Hook):
    """Resume from the newest checkpoint in ``directory`` that verifies (or ``restore_step``); save
    every ``every`` steps and at the end. The state is saved in the model's layout, so any mesh
    restores it.

    A divergence guard keeps a diverged state out of the checkpoints: a step whose loss is more than
    ``divergence`` times the median of the last :data:`DIVERGENCE_WINDOW` losses (once that many are
    seen) is not saved, when due or at the end, and the log says so; the saves resume once the loss
    is back under it. Training itself goes on (a spike may pass); a resume starts from the last
    saved, undiverged step. ``divergence=None`` turns the guard off.

    Attributes:
        resumed_from: the step restored at start, or None.
        skipped: the steps not saved because their loss had diverged.
    """

    def __init__(
        self,
        directory: str,
        *,
        every: int = 10,
        keep: int = 3,
        restore_step: int | None = None,
        log: Callable[[str], None] | None = None,
        divergence: float | None = DIVERGENCE_FACTOR,
    ):
        self.log = log or (lambda line: None)
        self.checkpointer = Checkpointer(directory, every=every, keep=keep, log=self.log)
        self.restore_step = restore_step
        self.resumed_from: int | None = None
        self.divergence = divergence
        self.skipped: list[int] = []
        self._losses: collections.deque = collections.deque(maxlen=DIVERGENCE_WINDOW)
        self._diverged = False  # the last step's loss

    def _check_divergence(self, step: int, loss: float) -> None:
        recent = self._losses
        if self.divergence is not None and len(recent) == recent.maxlen:
            median = float(np.median(recent))
            diverged = median > 0 and loss > self.divergence * median
            if diverged and not self._diverged:
                self.log(
                    f"step {step}: loss {loss:.4g} is over {self.divergence:g}x the median {median:.4g} of the last "
                    f"{len(recent)} steps: its state is not checkpointed until the loss comes back (the last saved "
                    f"step, {self.checkpointer.latest_step()}, stays the one to resume from)"
                )
            elif self._diverged and not diverged:
                self.log(f"step {step}: loss {loss:.4g} is back under {self.divergence:g}x the median; saving again")
            self._diverged = diverged
        if not self._diverged:
            recent.append(loss)  # a spike does not raise the median it is judged by

    def before_start(self, trainer):
        """Refuse a checkpoint this run cannot resume (another model, optimizer, seed, sequence length
        or data) from its metadata alone, before the state is initialised and the step compiled."""
        meta = self.checkpointer.check(trainer.restore_target(), self.restore_step)
        self.resuming = meta is not None
        if meta is not None:
            trainer.check_resumable(meta)

    def on_start(self, trainer, state):
        checkpointer = self.checkpointer
        tokenizer = getattr(trainer, "tokenizer", None)
        if tokenizer is not None and jax.process_index() == 0:
            # A trained tokenizer lives beside the checkpoints: a resumed run and `jaxmem export` load it.
            if not os.path.exists(os.path.join(checkpointer.directory, BPETokenizer.FILE)):
                tokenizer.save(str(checkpointer.directory))
        if checkpointer.latest_step() is None and self.restore_step is None:
            return state  # a fresh run; an asked-for step in an empty directory is refused by restore
        restored = checkpointer.restore(trainer.restore_target(), self.restore_step, log=self.log)
        self.resumed_from = restored.step
        self.log(f"resumed from checkpoint step {restored.step} ({checkpointer.directory})")
        moved = _dropout_layout_change(trainer, restored.meta)
        if moved:
            self.log(
                f"note: model {trainer.model.name} draws random numbers (dropout) per step, replica, microbatch, "
                f"stage and layer, and this run's layout differs from the checkpoint's ({moved}): from here it "
                "draws other masks than the saved run would have -- a sound run, not the same run"
            )
        return trainer.import_state(restored.state, restored.meta)

    def on_step(self, trainer, state, info):
        try:
            self.checkpointer.poll()  # a background save that failed stops the run now, not a save later
            self._check_divergence(state.step, info.loss)
            if self.checkpointer.should_save(state.step):
                if self._diverged:
                    self.skipped.append(state.step)
                    return
                exported, meta = trainer.export_state(state)
                self.checkpointer.save(state.step, exported, meta)
        except CheckpointError:
            self.on_error(trainer, state)
            raise

    def on_end(self, trainer, state):
        checkpointer = self.checkpointer
        checkpointer.wait()  # a save of this very step may still be in flight
        if self._diverged:
            self.skipped.append(state.step)
            self.log(
                f"the run ends with its loss diverged: step {state.step} is not saved; resume from step "
                f"{checkpointer.latest_step()} (lower {setting('lr')} or set {setting('grad_clip')})"
            )
        elif checkpointer.latest_step() != state.step:
            exported, meta = trainer.export_state(state)
            checkpointer.save(state.step, exported, meta, force=True)
        checkpointer.close()

    def on_error(self, trainer, state):
        try:
            self.checkpointer.close()  # saves of earlier, good steps complete; the directory is released
        except CheckpointError:
            pass  # a failed save: the error being raised already says so


class SampleLogHook(Hook):
    """Append, per step, the sample numbers it consumed to ``path`` (process 0 only); on start, drop
    the lines of steps after the state's (a resumed run redoes them), so every sample shows once."""

    def __init__(self, path: str):
        self.path = path

    def on_start(self, trainer, state):
        if jax.process_index() == 0 and os.path.exists(self.path):
            with open(self.path) as f:
                lines = [line for line in f if line.strip() and int(line.split()[0]) <= state.step]
            with open(self.path, "w") as f:
                f.writelines(lines)
        return state

    def on_step(self, trainer, state, info):
        if jax.process_index() == 0:
            with open(self.path, "a") as f:
                f.write(f"{state.step} {' '.join(str(i) for i in info.batch.sample_ids)}\n")


def check_outputs(config: TrainConfig) -> None:
    """Refuse, before any work, an output of the run that could not be written: ``sample_log`` and
    ``profile_report`` (files), ``run_dir`` and ``checkpoint_dir`` (folders) -- a folder where a file
    goes, a missing or read-only parent."""
    from jaxmem._util import check_output_dir, check_output_file

    for field in ("sample_log", "profile_report"):
        if getattr(config, field):
            check_output_file(getattr(config, field), setting(field))
    for field in ("run_dir", "checkpoint_dir"):
        if getattr(config, field):
            check_output_dir(getattr(config, field), setting(field))


def default_hooks(config: TrainConfig, log: Callable[[str], None] = lambda line: None) -> list[Hook]:
    """The hooks a config asks for: checkpoints (``checkpoint_dir``), the sample log, metrics
    (``run_dir``)."""
    hooks: list[Hook] = []
    if config.checkpoint_dir:
        hooks.append(
            CheckpointHook(
                config.checkpoint_dir,
                every=config.checkpoint_every,
                keep=config.keep_checkpoints,
                restore_step=config.restore_step,
                log=log,
            )
        )
    if config.sample_log:
        hooks.append(SampleLogHook(config.sample_log))
    return hooks


def _dropout_layout_change(trainer, meta: dict) -> str:
    """What differs between the saved run's layout and ``trainer``'s among what a dropout model's keys
    fold in (:meth:`~jaxmem.pipeline.Pipeline.grad_fn`: replica, microbatch, stage, layer); empty for
    a model that draws no random numbers, or the same layout."""
    if not trainer.model.rng:
        return ""
    saved = meta.get("plan", {})
    config = trainer.config
    now = {
        "data_parallel": config.data_parallel,
        "microbatches": trainer.schedule.num_microbatches,
        "layers_per_stage": list(trainer.pipeline.layer_counts),
    }
    return ", ".join(f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v)
