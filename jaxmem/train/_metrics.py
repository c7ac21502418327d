"""Run metrics: per-step loss, learning rate, gradient norm, tokens/s, step time, MFU and compiled memory,
written under a run directory as ``metrics.jsonl``, ``metrics.csv`` and TensorBoard event files, with a
loss / throughput plot at the end."""

from __future__ import annotations

import csv
import json
import math
import os
import time

import jax

from jaxmem._errors import JaxmemError, setting
from jaxmem.memory import compiled_bytes, model_facts
from jaxmem.train._hooks import Hook, StepInfo

__all__ = ["MetricsHook", "model_flops_per_step", "plot_metrics", "read_metrics"]

FIELDS = (
    "step",
    "loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "step_seconds",
    "tokens_per_second",
    "mfu",
    "compiled_device_bytes",
    "budget_bytes",
    "time",
)


def model_flops_per_step(model, batch_size: int, seq_len: int) -> float:
    """FLOPs of one step's forward and backward with nothing recomputed (the numerator of MFU, as in
    PaLM: recompute is overhead, not useful work), from ``cost_analysis()`` of the traced model (or the
    GPT's closed form)."""

    whole = model_facts(model).whole(batch_size, seq_len)
    return float(whole.forward_flops + whole.backward_flops - whole.recompute_flops)


def _tensorboard_writer(directory: str):
    """TensorBoard's own event-file writer (no TensorFlow needed), or None when not installed."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        return None

    writer = EventFileWriter(directory)

    def write(step: int, scalars: dict, wall_time: float):
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        )
        writer.add_event(event_pb2.Event(step=step, wall_time=wall_time, summary=summary))

    write.flush = writer.flush
    write.close = writer.close
    return write


class MetricsHook(Hook):
    """Write a record per step to ``run_dir`` (process 0 only).

    Files: ``metrics.jsonl`` (one JSON object per step), ``metrics.csv`` (same columns), TensorBoard
    events (``events.out.tfevents.*``, when the ``tensorboard`` package is installed: ``tensorboard
    --logdir RUN_DIR``), and ``metrics.png`` at the end. A resumed run appends, first dropping records
    of steps after the checkpoint it resumed from.

    MFU is the model's FLOPs per step (no recompute) over step time x devices x the hardware
    profile's peak. On CPU the peak is this machine's measured ``jax.grad`` rate for the whole
    machine (its virtual devices share the cores), so there MFU reads as a fraction of a plain step's
    FLOP rate.

    Args:
        run_dir: where to write.
        flops_per_step: model FLOPs of one step (see :func:`model_flops_per_step`).
        peak_flops: peak FLOP/s of the devices together (None: no MFU).
        tokens_per_step: batch x sequence length (None: the batch holds no tokens, no rate).
        budget_bytes: device budget to show beside the compiled bytes (None: not shown).
        flush_every: flush the files every N steps.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        tokens_per_step: int | None,
        budget_bytes: float | None = None,
        flush_every: int = 10,
    ):
        self.run_dir = run_dir
        self.flops_per_step = flops_per_step
        self.peak_flops = peak_flops
        self.tokens_per_step = tokens_per_step
        self.budget_bytes = budget_bytes
        self.flush_every = flush_every
        self.compiled_bytes: int | None = None
        self._files = None
        self.warnings: list[str] = []

    @property
    def writes(self) -> bool:
        return jax.process_index() == 0

    def on_start(self, trainer, state):
        if not self.writes:
            return state
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise JaxmemError(
                f"cannot write the run directory {self.run_dir}: {e.strerror or e}; pass a writable "
                f"{setting('run_dir')}"
            ) from None
        jsonl = os.path.join(self.run_dir, "metrics.jsonl")
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= state.step] if os.path.exists(jsonl) else []
        with open(jsonl, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        with open(os.path.join(self.run_dir, "metrics.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows({k: r.get(k) for k in FIELDS} for r in kept)
        tb = _tensorboard_writer(self.run_dir)
        if tb is None:
            self.warnings.append("TensorBoard events need the tensorboard package (pip install 'jaxmem[metrics]')")
        self._files = (open(jsonl, "a"), open(os.path.join(self.run_dir, "metrics.csv"), "a", newline=""), tb)
        self._csv = csv.DictWriter(self._files[1], FIELDS)
        return state

    def record(self, info: StepInfo) -> dict:
        """The record of one step."""
        seconds = info.seconds if info.step_seconds else None  # the first step of a run compiles
        record = {
            "step": info.step,
            "loss": info.loss,
            **{k: v for k, v in info.metrics.items() if k != "loss"},
            "step_seconds": seconds,
            "tokens_per_second": self.tokens_per_step / seconds if seconds and self.tokens_per_step else None,
            "mfu": (
                self.flops_per_step / (seconds * self.peak_flops)
                if seconds and self.flops_per_step and self.peak_flops
                else None
            ),
            "compiled_device_bytes": self.compiled_bytes,
            "budget_bytes": self.budget_bytes,
            "time": time.time(),
        }
        return {k: v for k, v in record.items() if v is not None}

    def on_step(self, trainer, state, info):
        if not self.writes:
            return
        if self.compiled_bytes is None and trainer is not None:
            self.compiled_bytes = compiled_bytes(trainer.compiled(state))
        record = self.record(info)
        jsonl, csv_file, tb = self._files
        jsonl.write(json.dumps(record) + "\n")
        self._csv.writerow({k: record.get(k) for k in FIELDS})
        if tb is not None:
            scalars = {
                f"train/{k}" if k not in ("eval_loss",) else "eval/loss": v
                for k, v in record.items()
                if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)
            }
            tb(info.step, scalars, record["time"])
        if info.step % self.flush_every == 0:
            self.flush()

    def flush(self):
        if self._files:
            for f in self._files:
                if f is not None:
                    f.flush()

    def on_end(self, trainer, state):
        self.close()
        if self.writes:
            plot_metrics(self.run_dir)

    def on_error(self, trainer, state):
        self.close()

    def close(self):
        if self._files:
            for f in self._files:
                if f is not None:
                    f.close()
            self._files = None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(run_dir: str, path: str | None = None) -> str | None:
    """``metrics.png``: loss (train and eval) and throughput against step. Returns the file (None when
    there is nothing to plot)."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rate) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], label="train", lw=1)
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if evals:
        ax_loss.plot(*zip(*evals), "o-", label="eval", ms=3)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend()
    rated = [(r["step"], r["tokens_per_second"]) for r in records if "tokens_per_second" in r]
    if rated:
        ax_rate.plot(*zip(*rated), lw=1)
    ax_rate.set(xlabel="step", ylabel="tokens / s", title="throughput (compiling first step left out)")
    ax_rate.set_ylim(bottom=0)
    fig.tight_layout()
    path = path or os.path.join(run_dir, "metrics.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
