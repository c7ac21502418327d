"""Run configuration, free of JAX imports so the CLI can set up devices before JAX starts."""

from __future__ import annotations

import dataclasses

from jaxmem._errors import JaxmemError
from jaxmem.schedule import Schedule, generate, load_csv, validate

__all__ = ["TrainConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs; every field has a CLI flag of the same name.

    Attributes:
        model: model preset (``tiny``, ``gpt2-small``, ``gpt2-medium``, ``gpt2-xl``) or a GPTConfig.
        schedule: schedule name, or None when ``schedule_csv`` is given.
        schedule_csv: a schedule table to run instead of a generated one.
        stages: pipeline ranks P.
        microbatches: microbatches M per step.
        virtual: stages per rank for interleaved-1f1b.
        data_parallel: data-parallel replicas D (devices used = D x P).
        devices: virtual CPU devices to create when there is no accelerator (default D x P).
        steps: optimizer steps.
        seq_len: tokens per sequence.
        batch_size: global batch (sequences per step); divisible by D x M.
        lr: Adam learning rate.
        seed: parameter initialisation and data order.
        data: ``text`` (embedded corpus) or ``synthetic``.
        layers_per_stage: explicit layers per stage (balanced when None).
        policy: memory policy spec (see ``jaxmem.policy``); None = save-all.
        plan: ``"auto"`` lets the planner choose stages, data-parallel, schedule, microbatches and
            policy for ``devices`` under ``budget``.
        budget: device bytes per device for ``plan="auto"``.
        hardware: hardware profile for the planner (``auto``: measured here on CPU, h100 on GPU,
            tpu-v5p on TPU).
        adaptive: run under the online profiler (``jaxmem.profiler``), which picks a memory policy per
            program signature within ``budget``.
        seq_len_schedule: sequence-length buckets for an adaptive run (each at most ``seq_len``).
        seq_len_order: ``cycle`` through the buckets or draw them at ``random``.
        layer_drop: probability that a step skips one randomly chosen layer (decided in Python, so a
            different program).
        profile_report: JSON file for the profiler's per-signature table.
        explore: let the profiler measure policies it has not run (a background compile beside a
            signature's program, while the rest of the run can pay for it); see ``AdaptiveProfiler``.
        checkpoint_dir: save the train state here and resume from its latest complete step.
        checkpoint_every: save every N steps (and at the end).
        keep_checkpoints: keep the last K steps.
        sample_log: append, per step, the sample numbers it consumed (rolled back on resume), to check
            that every sample is used exactly once.
    """

    model: object = "tiny"
    schedule: str | None = "1f1b"
    schedule_csv: str | None = None
    stages: int = 4
    microbatches: int = 8
    virtual: int | None = None
    data_parallel: int = 1
    devices: int | None = None
    steps: int = 300
    seq_len: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    data: str = "text"
    layers_per_stage: tuple[int, ...] | None = None
    policy: object = None
    plan: str | None = None
    budget: float | None = None
    hardware: str = "auto"
    adaptive: bool = False
    seq_len_schedule: tuple[int, ...] | None = None
    seq_len_order: str = "cycle"
    layer_drop: float = 0.0
    profile_report: str | None = None
    explore: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    sample_log: str | None = None

    def __post_init__(self):
        for field in ("stages", "microbatches", "data_parallel", "steps", "seq_len", "batch_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise JaxmemError(f"{field.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.lr <= 0:
            raise JaxmemError(f"lr must be > 0, got {self.lr}")
        if self.plan not in (None, "auto"):
            raise JaxmemError(f"--plan takes 'auto', got {self.plan!r}")
        if self.adaptive and not self.budget:
            raise JaxmemError("--adaptive needs --budget (device memory per device, e.g. 14MiB)")
        if self.adaptive and self.plan:
            raise JaxmemError("use either --plan auto or --adaptive, not both")
        if not 0.0 <= self.layer_drop < 1.0:
            raise JaxmemError(f"--layer-drop is a probability in [0, 1), got {self.layer_drop}")
        if self.seq_len_order not in ("cycle", "random"):
            raise JaxmemError(f"--seq-len-order is cycle or random, got {self.seq_len_order!r}")
        if self.seq_len_schedule is not None:
            buckets = tuple(int(x) for x in self.seq_len_schedule)
            if not buckets or min(buckets) < 1:
                raise JaxmemError(f"--seq-len-schedule needs lengths >= 1, got {list(buckets)}")
            object.__setattr__(self, "seq_len_schedule", buckets)
            if max(buckets) > self.seq_len:
                object.__setattr__(self, "seq_len", max(buckets))
        if self.plan == "auto" and not self.budget:
            raise JaxmemError("--plan auto needs --budget (device memory per device, e.g. 12MiB or 24GiB)")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(int(x) for x in self.layers_per_stage))

    def model_config(self):
        """The model's GPTConfig (imports JAX)."""
        from jaxmem.models.gpt import get_config

        config = get_config(self.model)
        if self.seq_len > config.max_seq_len:
            name = f"{self.model}'s" if isinstance(self.model, str) else "the model's"
            raise JaxmemError(f"--seq-len {self.seq_len} exceeds {name} max_seq_len {config.max_seq_len}")
        return config

    def build_schedule(self) -> Schedule:
        if self.schedule_csv:
            s = validate(load_csv(self.schedule_csv))
            if s.num_ranks != self.stages:
                raise JaxmemError(
                    f"{self.schedule_csv} has {s.num_ranks} ranks but --stages is {self.stages}; "
                    f"pass --stages {s.num_ranks}"
                )
            if s.num_microbatches != self.microbatches:
                raise JaxmemError(
                    f"{self.schedule_csv} has {s.num_microbatches} microbatches but --microbatches is "
                    f"{self.microbatches}; pass --microbatches {s.num_microbatches}"
                )
            return s
        return generate(self.schedule or "1f1b", self.stages, self.microbatches, self.virtual)
