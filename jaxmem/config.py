"""Run configuration, free of JAX imports so the CLI can set up devices before JAX starts."""

from __future__ import annotations

import dataclasses
import math

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import load_toml, parse_bytes, parse_int_list
from jaxmem.schedule import Schedule, generate, load_csv, validate
from jaxmem.search import CHRONOS_MOVES

__all__ = [
    "GENERATED_POLICIES",
    "MESH_FIELDS",
    "MeshSpec",
    "OptimizerSpec",
    "TrainConfig",
    "config_from",
    "load_settings",
    "parse_mesh",
    "with_overrides",
]

_s = setting  # the errors below name settings in their caller's words: a field, or a flag

# Policy names made for a run's layout under a budget (Chronos-Recomp / -Offload / both; see
# jaxmem.search.evaluate), accepted by --policy beside the presets.
GENERATED_POLICIES = tuple(CHRONOS_MOVES)

# Integer settings and their least value; the optional ones may also be None.
_INTEGER_FIELDS = {
    "pipe": 1,
    "microbatches": 1,
    "data_parallel": 1,
    "fsdp": 1,
    "context": 1,
    "tensor": 1,
    "steps": 1,
    "seq_len": 1,
    "batch_size": 1,
    "warmup_steps": 0,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 1,
    "checkpoint_every": 1,
    "keep_checkpoints": 1,
    "restore_step": 0,
    "devices": 1,
    "vocab_size": 1,
    "seed": 0,
}
_OPTIONAL_FIELDS = ("devices", "vocab_size", "restore_step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """A run's device mesh by axis: ``data`` replicas holding whole parameters, ``fsdp`` replicas
    holding a shard of each, ``pipe`` ranks, ``context`` devices holding part of every sequence
    (shown only when more than 1), ``tensor`` devices cutting each microbatch's matmuls.
    Its text is what ``--mesh`` and :func:`parse_mesh` take.

    >>> mesh = MeshSpec(data=2, pipe=4); str(mesh), mesh.devices
    ('data=2,fsdp=1,pipe=4,tensor=1', 8)
    """

    data: int = 1
    fsdp: int = 1
    pipe: int = 4
    tensor: int = 1
    context: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.pipe * self.context * self.tensor

    @property
    def replicas(self) -> int:
        """Replicas the batch is split over: data x fsdp."""
        return self.data * self.fsdp

    def __str__(self) -> str:
        context = f",context={self.context}" if self.context > 1 else ""
        return f"data={self.data},fsdp={self.fsdp},pipe={self.pipe}{context},tensor={self.tensor}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Adam (AdamW with ``weight_decay``) under a learning-rate schedule: linear warmup from 0 over
    ``warmup_steps``, then ``constant`` or ``cosine`` decay to ``min_lr_ratio * lr`` at ``steps``;
    gradients clipped to a global norm of ``grad_clip`` (None: not clipped). What
    :func:`jaxmem.train.make_optimizer` builds; :attr:`TrainConfig.optimizer` gives a run's."""

    lr: float = 3e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float | None = None
    steps: int = 300

    def __post_init__(self):
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise JaxmemError(f"{_s('lr')} must be a finite number > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise JaxmemError(f"{_s('lr_schedule')} is constant or cosine, got {self.lr_schedule!r}")
        if self.warmup_steps >= self.steps and self.lr_schedule == "cosine":
            raise JaxmemError(
                f"{_s('warmup_steps', self.warmup_steps)} leaves no steps of the cosine decay "
                f"({_s('steps', self.steps)}); use fewer warmup steps"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise JaxmemError(f"{_s('min_lr_ratio')} is a fraction in [0, 1], got {self.min_lr_ratio}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise JaxmemError(f"{_s('weight_decay')} must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise JaxmemError(f"{_s('grad_clip')} must be > 0 (the largest global gradient norm), got {self.grad_clip}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs; every field has a CLI flag of the same name.

    Attributes:
        model: a model preset (``tiny``, ``gpt2-small``, ``gpt2-medium``, ``gpt2-xl``, ``llama-tiny``,
            ``llama-1b``, ``llama-8b``, ``llama-70b``), a GPTConfig / LlamaConfig, any
            :class:`~jaxmem.models.StagedModel` (e.g. from :func:`~jaxmem.models.from_nnx`), or
            ``"package.module:attr"`` naming one or a function returning one.
        init_from: a local Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory (as
            ``jaxmem export --format hf`` writes and ``transformers`` saves): the model is built from
            its ``config.json`` and starts from its weights; its ``tokenizer.json`` tokenizes the data
            unless ``tokenizer`` names another. Used when a run starts; a resumed run continues from
            its checkpoint.
        dtype: compute dtype of a preset or config model (``bfloat16`` for mixed precision); None
            keeps the model's.
        param_dtype: dtype of its parameters, gradients and optimizer state (``float32`` master
            weights by default); None keeps the model's.
        attention: a preset or config model's attention, ``materialized`` or ``fused`` (see
            :func:`~jaxmem.models.fused_attention`); None keeps the model's.
        schedule: schedule name, or None when ``schedule_csv`` is given.
        schedule_csv: a schedule table to run instead of a generated one.
        pipe: pipe ranks P (devices along the pipeline; ``--stages`` and ``stages`` in a TOML file
            are older names for it).
        microbatches: microbatches M per step.
        virtual: stages per rank for interleaved-1f1b.
        data_parallel: data-parallel replicas D holding whole parameters.
        fsdp: data-parallel replicas F holding a shard of every parameter (FSDP), gathered per use;
            devices used = D x F x P x T, and the batch is split over D x F replicas.
        tensor: devices T computing each microbatch together, cutting the dimensions the model's
            ``nnx.with_partitioning`` annotations name (tensor parallelism, left to XLA's partitioner).
        context: devices C holding part of every sequence (context parallelism, for long
            sequences): each holds two of its 2C chunks and gathers the others' keys and values for
            attention (:mod:`jaxmem.models._context`); devices used = D x F x P x C x T. The model's
            attention must be context-aware (the built-in ones are), and the sequence length a
            multiple of 2C. ``plan="auto"`` searches it for long sequences; not with ``adaptive``.
        zero: shard the optimizer state and the step's gradients over the replicas (ZeRO-1/2; the
            default; no effect with one replica).
        vocab_split: split the token embedding and the head over the pipe ranks by vocabulary rows
            (the default, for models that declare their tables; no effect with one rank).
        split_backward: on schedules that split the backward (zb-h1, zbv, chronos), W takes I's
            cotangents instead of running the stage's pullback again: faster, at the memory of those
            cotangents from I to W (:class:`~jaxmem.pipeline.Pipeline`'s ``split_backward``).
        hand_recomputed: with ``split_backward``, I also hands W the forward values it recomputed,
            so W recomputes no forward: faster under a policy that recomputes, at the memory of
            those activations from I to W (:class:`~jaxmem.pipeline.Pipeline`'s ``hand_recomputed``).
        devices: virtual CPU devices to create when there is no accelerator (default D x F x P x T).
        steps: optimizer steps.
        seq_len: tokens per sequence.
        batch_size: global batch (sequences per step); divisible by D x M.
        lr: peak learning rate.
        lr_schedule: ``constant`` or ``cosine`` (decay to ``min_lr_ratio * lr`` at the last step), both
            after ``warmup_steps`` of linear warmup from 0.
        warmup_steps: linear warmup steps.
        min_lr_ratio: the cosine schedule's final learning rate, as a fraction of ``lr``.
        weight_decay: decoupled weight decay (AdamW) on matrices; 0 is plain Adam.
        grad_clip: clip the gradients' global norm to this (None: no clipping).
        seed: parameter initialisation and data order.
        data: ``text`` (the embedded corpus), ``synthetic`` (random tokens), or files: comma-separated
            paths, globs or directories of text (``.txt``, ``.md``, ``.rst``; a glob reads any file as
            text), JSON-lines (``.jsonl``, and ``.json`` files, read as JSON lines too) and Parquet
            files, or ``hf:NAME[:CONFIG]:SPLIT``, a Hugging Face dataset read
            offline from the hub cache or a local directory (:func:`jaxmem.data.hf_documents`).
        data_field: the JSONL field / Parquet / dataset column holding the text.
        samples: for a model with a batch of its own (a classifier's images and labels), its training
            samples instead of token data: ``package.module:attr`` naming a
            :class:`~jaxmem.data.Samples` or a function returning one (``data``, ``tokenizer`` and
            ``seq_len`` are then not read; ``eval_fraction`` holds out the last samples).
        tokenizer: ``byte`` (default), ``bpe:N`` (a byte-level BPE of N ids trained on the data and
            saved in the checkpoint directory), or the path of a ``tokenizer.json``.
        vocab_size: the vocabulary of a preset model (default: 256 for byte-level data, the
            tokenizer's size otherwise).
        eval_fraction: hold out this fraction of the data (the end of the token stream) for eval.
        eval_every: evaluate the held-out loss every N steps (and at the end); 0 = never.
        eval_batches: batches per evaluation.
        run_dir: write metrics here: ``metrics.jsonl``, TensorBoard event files (when the
            ``tensorboard`` package is installed) and a loss / throughput plot at the end.
        log_every: a plain progress line every N steps when stderr is not a terminal (and a metrics
            record every N steps).
        layers_per_stage: explicit layers per stage (balanced when None).
        policy: memory policy spec (see ``jaxmem.policy``), resolved to a :class:`~jaxmem.policy.Policy`
            when the config is built (a bad name or file fails before any data loads); or one of
            :data:`GENERATED_POLICIES` (``chronos-recomp``, ...), generated for this config's schedule
            and mesh under ``budget`` by :meth:`build_policy` (what ``jaxmem plan`` prints); None =
            save-all.
        plan: ``"auto"`` lets the planner choose pipe ranks, data-parallel, schedule, microbatches and
            policy for ``devices`` under ``budget``.
        budget: device bytes per device for ``plan="auto"``, ``adaptive`` and a generated policy.
        margin: for ``plan="auto"``, plan under ``budget / (1 + margin)``. None: 0 where the plan's
            devices are all here (each pick is compiled and checked, the next taken when it does not
            fit), else :data:`~jaxmem.search.LEDGER_MARGIN`, the ledger's measured error.
        hardware: hardware profile for the planner, the profiler and a generated policy (``auto``:
            the target's when ``target`` is set; else measured here on CPU, h100 on GPU, tpu-v5p on TPU).
        target: the accelerator the run is compiled for (:mod:`jaxmem.targets`): ``h100``, ``tpu-v5e``,
            ``tpu-v5p``, ``tpu-v6e``, ``tpu-v4`` with a device count or topology (``h100:16``,
            ``tpu-v5p:4x4x4``), or ``cpu`` (the devices at hand; the default). The ledger's working
            sets and layouts, a generated policy and ``plan="auto"``'s checks are then the target's
            compiler's, and its hardware profile is the target's. Where the target's devices are not
            attached, the step is compiled for them and not run.
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
        restore_step: resume from this step instead of the newest that verifies (which is the default:
            a newest step that fails its checksums is announced, moved aside, and the next one tried).
        sample_log: append, per step, the sample numbers it consumed (rolled back on resume), to check
            that every sample is used exactly once.
    """

    model: object = "tiny"
    init_from: str | None = None
    dtype: str | None = None
    param_dtype: str | None = None
    attention: str | None = None
    schedule: str | None = "1f1b"
    schedule_csv: str | None = None
    pipe: int = 4
    microbatches: int = 8
    virtual: int | None = None
    data_parallel: int = 1
    fsdp: int = 1
    tensor: int = 1
    context: int = 1
    zero: bool = True
    vocab_split: bool = True
    split_backward: bool = False
    hand_recomputed: bool = False
    devices: int | None = None
    steps: int = OptimizerSpec.steps  # the optimizer's fields default as its spec does
    seq_len: int = 64
    batch_size: int = 32
    lr: float = OptimizerSpec.lr
    lr_schedule: str = OptimizerSpec.lr_schedule
    warmup_steps: int = OptimizerSpec.warmup_steps
    min_lr_ratio: float = OptimizerSpec.min_lr_ratio
    weight_decay: float = OptimizerSpec.weight_decay
    grad_clip: float | None = OptimizerSpec.grad_clip
    seed: int = 0
    data: str = "text"
    data_field: str = "text"
    samples: str | None = None
    tokenizer: str = "byte"
    vocab_size: int | None = None
    eval_fraction: float = 0.0
    eval_every: int = 0
    eval_batches: int = 4
    run_dir: str | None = None
    log_every: int = 10
    layers_per_stage: tuple[int, ...] | None = None
    policy: object = None
    plan: str | None = None
    budget: float | None = None
    margin: float | None = None
    hardware: str = "auto"
    target: str | None = None
    adaptive: bool = False
    seq_len_schedule: tuple[int, ...] | None = None
    seq_len_order: str = "cycle"
    layer_drop: float = 0.0
    profile_report: str | None = None
    explore: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    restore_step: int | None = None
    sample_log: str | None = None

    def __post_init__(self):
        # Settings that may come as text (a TOML file, the command line): parsed here, once.
        for field, parse in (
            ("budget", parse_bytes),
            ("layers_per_stage", parse_int_list),
            ("seq_len_schedule", parse_int_list),
        ):
            if isinstance(getattr(self, field), str):
                object.__setattr__(self, field, parse(getattr(self, field), field))
        for field, minimum in _INTEGER_FIELDS.items():
            value = getattr(self, field)
            if value is None and field in _OPTIONAL_FIELDS:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise JaxmemError(f"{_s(field)} must be an integer >= {minimum}, got {value!r}")
        if self.seed >= 2**63:
            raise JaxmemError(
                f"{_s('seed')} must be below 2**63 (jax.random.key takes a 64-bit integer), got {self.seed}"
            )
        self.optimizer  # noqa: B018 -- its own checks
        if not 0.0 <= self.eval_fraction < 1.0:
            raise JaxmemError(f"{_s('eval_fraction')} is a fraction in [0, 1), got {self.eval_fraction}")
        if self.eval_every and not self.eval_fraction:
            raise JaxmemError(f"{_s('eval_every')} needs held-out data: set {_s('eval_fraction', 0.05)}")
        if self.seq_len_schedule is not None and not self.adaptive:
            raise JaxmemError(
                f"{_s('seq_len_schedule')} varies the program under the profiler: set {_s('adaptive')} "
                f"and {_s('budget')}"
            )
        if self.restore_step is not None and not self.checkpoint_dir:
            raise JaxmemError(
                f"{_s('restore_step')} picks a step of {_s('checkpoint_dir')}; set {_s('checkpoint_dir')}"
            )
        if self.adaptive and self.run_dir:
            raise JaxmemError(
                f"{_s('adaptive')} runs write no {_s('run_dir')} metrics (their record is {_s('profile_report')}, per "
                f"program); drop {_s('run_dir')} or {_s('adaptive')}"
            )
        generated = self.policy in GENERATED_POLICIES
        if self.budget and not (self.plan or self.adaptive or self.run_dir or generated or self.target):
            raise JaxmemError(
                f"{_s('budget')} is used by {_s('plan', 'auto')}, {_s('adaptive')} and a generated {_s('policy')} "
                f"(chronos-recomp, chronos-offload, chronos-both), and shown beside the compiled bytes in "
                f"{_s('run_dir')} metrics and a {_s('target')}'s compiled step; set one of them, or drop {_s('budget')}"
            )
        if generated and not self.budget:
            raise JaxmemError(
                f"{_s('policy', self.policy)} is generated for the run's schedule and mesh under a memory budget: "
                f"set {_s('budget')} (device memory per device, e.g. {_s('budget', '40GiB')})"
            )
        if generated and self.adaptive:
            raise JaxmemError(
                f"{_s('adaptive')} picks the policy itself; drop {_s('policy', self.policy)} (or {_s('adaptive')})"
            )
        if self.hand_recomputed and not self.split_backward:
            raise JaxmemError(
                f"{_s('hand_recomputed')} hands W what I recomputed when the backward is split: set "
                f"{_s('split_backward')} too"
            )
        if self.init_from is not None:
            self._check_init_from()
        if self.data == "synthetic" and self.tokenizer != "byte":
            raise JaxmemError(f"{_s('tokenizer')} applies to text data; synthetic data draws token ids directly")
        if self.plan not in (None, "auto"):
            raise JaxmemError(f"{_s('plan')} takes 'auto', got {self.plan!r}")
        if self.adaptive and not self.budget:
            raise JaxmemError(
                f"{_s('adaptive')} needs {_s('budget')} (device memory per device, e.g. {_s('budget', '14MiB')})"
            )
        if self.adaptive and self.plan:
            raise JaxmemError(f"use either {_s('plan', 'auto')} or {_s('adaptive')}, not both")
        if not 0.0 <= self.layer_drop < 1.0:
            raise JaxmemError(f"{_s('layer_drop')} is a probability in [0, 1), got {self.layer_drop}")
        if self.seq_len_order not in ("cycle", "random"):
            raise JaxmemError(f"{_s('seq_len_order')} is cycle or random, got {self.seq_len_order!r}")
        if self.seq_len_schedule is not None:
            buckets = tuple(int(x) for x in self.seq_len_schedule)
            if not buckets or min(buckets) < 1:
                raise JaxmemError(f"{_s('seq_len_schedule')} needs lengths >= 1, got {list(buckets)}")
            object.__setattr__(self, "seq_len_schedule", buckets)
            if max(buckets) > self.seq_len:
                object.__setattr__(self, "seq_len", max(buckets))
        if self.plan == "auto" and not self.budget:
            raise JaxmemError(
                f"{_s('plan', 'auto')} needs {_s('budget')} (device memory per device, e.g. "
                f"{_s('budget', '12MiB')} or {_s('budget', '24GiB')})"
            )
        if self.margin is not None and (self.plan != "auto" or not 0 <= self.margin < 1):
            raise JaxmemError(
                f"{_s('margin', self.margin)} is a fraction of the budget in [0, 1) that {_s('plan', 'auto')} keeps "
                f"free, e.g. {_s('margin', 0.1)}; use it with {_s('plan', 'auto')}"
            )
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(int(x) for x in self.layers_per_stage))
            if 0 in self.layers_per_stage:
                raise JaxmemError(
                    f"{_s('layers_per_stage', self.layers_per_stage)} leaves a stage without layers (its rank would "
                    "only pass messages on); give every stage at least one layer, or use fewer stages"
                )
        if self.hardware != "auto":
            from jaxmem.memory import HARDWARE

            if str(self.hardware).strip().lower() not in HARDWARE:
                raise JaxmemError(f"unknown {_s('hardware', self.hardware)}; profiles: {', '.join(HARDWARE)} (or auto)")
        if self.target is not None:
            from jaxmem.targets import parse_target

            target = parse_target(self.target)  # a bad name fails here, before any work
            object.__setattr__(self, "target", str(target))
            hardware = str(self.hardware).strip().lower()
            if hardware not in ("auto", target.name):
                raise JaxmemError(
                    f"{_s('hardware', self.hardware)} and {_s('target', self.target)} name two machines: the target's "
                    f"hardware profile is {target.name}. Drop {_s('hardware')}"
                )
        if self.data_field != "text" and self.data in ("synthetic", "text"):
            raise JaxmemError(
                f"{_s('data_field', self.data_field)} names a column of JSONL, Parquet or Hugging Face data; "
                f"{_s('data', self.data)} has no columns. Drop {_s('data_field')}"
            )
        # Resolved here, once, before any data loads: a bad policy or schedule fails at once.
        if self.policy is not None and not generated:
            from jaxmem.policy import from_spec

            object.__setattr__(self, "policy", from_spec(self.policy))
        if self.plan != "auto":
            # The cheap checks first: a batch that does not divide is refused before a table is built.
            replicas, M = self.replicas, self.microbatches
            if not self.schedule_csv and self.batch_size % (replicas * M):
                what = (
                    f"{_s('data_parallel')} ({self.data_parallel}) x {_s('fsdp')} ({self.fsdp})"
                    if self.fsdp > 1
                    else f"{_s('data_parallel')} ({replicas})"
                )
                ok = [replicas * M * k for k in range(1, 4)]
                raise JaxmemError(
                    f"{_s('batch_size', self.batch_size)} is not divisible by {what} x {_s('microbatches', M)} = "
                    f"{replicas * M:,}; use a batch size in {ok}, ... (or fewer microbatches)"
                )
            schedule = self.build_schedule()  # checked here; built again where used (generating one is cheap)
            if schedule.forward_only:
                raise JaxmemError(
                    f"schedule {schedule.name!r} runs forwards only (no B, nor I and W): a training step needs a "
                    "backward for every forward. Add them, e.g. after each NFm the same stage's NBm"
                )
            check_split_backward(schedule, self.split_backward)

    def _check_init_from(self) -> None:
        import os

        path = os.path.join(self.init_from, "config.json")
        if not os.path.isfile(path):
            raise JaxmemError(
                f"{_s('init_from', self.init_from)}: no config.json there; give a Hugging Face model directory "
                "(what jaxmem export --format hf writes, or save_pretrained saves)"
            )
        if self.model != "tiny":
            raise JaxmemError(f"{_s('init_from')} builds the model from {path}; drop {_s('model', self.model)}")
        if self.vocab_size is not None:
            raise JaxmemError(f"{_s('init_from')} takes the vocabulary from {path}; drop {_s('vocab_size')}")
        if self.plan or self.adaptive:
            raise JaxmemError(
                f"{_s('init_from')} starts a plain run; it does not combine with {_s('plan', 'auto')} or "
                f"{_s('adaptive')} yet"
            )
        tokenizer_file = os.path.join(self.init_from, "tokenizer.json")
        if self.tokenizer == "byte" and self.data != "synthetic" and os.path.isfile(tokenizer_file):
            # The model's own tokenizer, unless another was named: byte ids would mean other tokens.
            object.__setattr__(self, "tokenizer", tokenizer_file)
        kind = self._init_from_config().get("model_type")
        if kind not in ("gpt2", "llama"):  # checked in full when the model is built
            raise JaxmemError(
                f"{_s('init_from')}: {path} describes model_type {kind!r}; jaxmem starts from Hugging Face gpt2 "
                "(GPT2LMHeadModel) and llama (LlamaForCausalLM) directories"
            )

    def compile_target(self):
        """The :class:`~jaxmem.targets.Target` the run is compiled for when it is not the devices at hand
        (None for the default and for ``cpu``)."""
        from jaxmem.targets import parse_target

        target = parse_target(self.target)
        return target if target is not None and target.compile_only else None

    @property
    def vocab_parallel(self) -> bool | None:
        """``Pipeline(vocab_parallel=...)`` for ``vocab_split``: None (split where the model declares its
        tables and there are several pipe ranks) or False."""
        return None if self.vocab_split else False

    @property
    def mesh(self) -> MeshSpec:
        """The run's mesh (``data_parallel``, ``fsdp``, ``pipe``, ``tensor``)."""
        return MeshSpec(
            data=self.data_parallel, fsdp=self.fsdp, pipe=self.pipe, tensor=self.tensor, context=self.context
        )

    @property
    def optimizer(self) -> OptimizerSpec:
        """The run's optimizer and learning-rate schedule."""
        return OptimizerSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OptimizerSpec)})

    @property
    def replicas(self) -> int:
        """Replicas the batch is split over: data-parallel x fsdp."""
        return self.mesh.replicas

    @property
    def num_devices(self) -> int:
        """Devices the run's mesh takes: data-parallel x fsdp x pipe x context x tensor."""
        return self.mesh.devices

    @property
    def model_name(self) -> str:
        from jaxmem.models import model_name

        return model_name(self.model)

    def build_model(self):
        """The :class:`~jaxmem.models.StagedModel` this config trains (imports JAX)."""
        from jaxmem.models import get_model

        overrides = {
            k: v
            for k, v in (
                ("dtype", self.dtype),
                ("param_dtype", self.param_dtype),
                ("attention", self.attention),
                ("vocab_size", self.vocab_size),
            )
            if v is not None
        }
        if self.init_from is not None:
            from jaxmem.models.hf import config_from_hf

            overrides.pop("vocab_size", None)
            config = config_from_hf(self._init_from_config(), where=_s("init_from", self.init_from), **overrides)
            model = get_model(config)
        else:
            model = get_model(self.model, **overrides)
        if model.max_seq_len is not None and self.seq_len > model.max_seq_len:
            raise JaxmemError(f"{_s('seq_len', self.seq_len)} exceeds {model.name}'s max_seq_len {model.max_seq_len}")
        return model

    def _init_from_config(self) -> dict:
        """``init_from``'s ``config.json`` (a JSON object, or a clear error)."""
        import json
        import os

        path = os.path.join(self.init_from, "config.json")
        try:
            with open(path) as f:
                config = json.load(f)
        except ValueError as e:
            raise JaxmemError(f"{_s('init_from')}: {path} is not JSON ({e})") from None
        if not isinstance(config, dict):
            raise JaxmemError(f"{_s('init_from')}: {path} is not a JSON object")
        return config

    def build_policy(self, model=None, schedule=None, *, budget: float | None = None):
        """The run's :class:`~jaxmem.policy.Policy` (None: save-all). A generated one
        (:data:`GENERATED_POLICIES`) is made here for this config's model, schedule and mesh under
        ``budget`` (default ``self.budget``) on its hardware profile, as ``jaxmem plan`` makes it:
        the same name and budget give the planner's pick. Refused when even it does not fit."""
        if self.policy not in GENERATED_POLICIES:
            return self.policy
        from jaxmem._util import human_bytes
        from jaxmem.search import evaluate

        budget = budget or self.budget
        model = model or self.build_model()
        candidate = evaluate(
            model,
            schedule or self.build_schedule(),
            self.policy,
            budget=budget,
            batch=self.batch_size,
            seq=self.seq_len,
            data=self.data_parallel,
            fsdp=self.fsdp,
            tensor=self.tensor,
            context=self.context,
            zero=self.zero,
            vocab_parallel=self.vocab_parallel,
            layer_counts=self.layers_per_stage,
            hardware=self.hardware_profile(),
            split_backward=self.split_backward,
            hand_recomputed=self.hand_recomputed,
            target=self.target,
        )
        if not candidate.fits:
            raise JaxmemError(
                f"{_s('policy', self.policy)} cannot fit {model.name} in {_s('budget', human_bytes(budget))} on this "
                f"mesh and schedule: its smallest policy needs {human_bytes(candidate.device_bytes)} per device. "
                f"Give a larger {_s('budget')}, more devices, or let {_s('plan', 'auto')} choose the layout"
            )
        return candidate.policy

    def hardware_profile(self) -> str:
        """The hardware profile's name: ``hardware``, or for ``auto`` the target's, else the one of this
        platform (the CPU's is calibrated here; imports JAX)."""
        if self.hardware != "auto":
            return self.hardware
        if self.target is not None:
            return self.target.partition(":")[0]
        import jax

        return {"gpu": "h100", "tpu": "tpu-v5p"}.get(jax.devices()[0].platform, "cpu")

    def build_schedule(self) -> Schedule:
        """The run's schedule (already checked when the config was built)."""
        if self.schedule_csv:
            table = validate(load_csv(self.schedule_csv))
            if table.num_ranks != self.pipe:
                raise JaxmemError(
                    f"{self.schedule_csv} has {table.num_ranks} ranks but {_s('pipe', self.pipe)}; "
                    f"set {_s('pipe', table.num_ranks)}"
                )
            if table.num_microbatches != self.microbatches:
                raise JaxmemError(
                    f"{self.schedule_csv} has {table.num_microbatches} microbatches but "
                    f"{_s('microbatches', self.microbatches)}; set {_s('microbatches', table.num_microbatches)}"
                )
            return table
        return generate(self.schedule or "1f1b", self.pipe, self.microbatches, self.virtual)


# The mesh's axis names and the settings they are.
MESH_FIELDS = {"data": "data_parallel", "fsdp": "fsdp", "pipe": "pipe", "context": "context", "tensor": "tensor"}


def parse_mesh(text: str) -> dict[str, int]:
    """``data=2,fsdp=2,pipe=2`` -> ``{"data": 2, "fsdp": 2, "pipe": 2, "context": 1, "tensor": 1}``
    (axes left out are 1).

    >>> parse_mesh("pipe=4,data=2")
    {'data': 2, 'fsdp': 1, 'pipe': 4, 'context': 1, 'tensor': 1}
    """
    sizes = dict.fromkeys(MESH_FIELDS, 1)
    seen = set()
    for part in str(text).split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in MESH_FIELDS or not value.strip().isdigit() or int(value) < 1:
            raise JaxmemError(
                f"{setting('mesh')} takes axis=size pairs over {', '.join(MESH_FIELDS)} with sizes >= 1, e.g. "
                f"data=2,fsdp=2,pipe=2,tensor=2; got {text!r}"
            )
        if name in seen:
            raise JaxmemError(f"{setting('mesh')} names {name} twice: {text!r}")
        seen.add(name)
        sizes[name] = int(value)
    return sizes


def config_from(settings, *, defaults=None, overrides=None) -> TrainConfig:
    """A :class:`TrainConfig` from ``settings`` by name (its fields, as :func:`load_settings` reads
    them from a file), with ``defaults`` below them and ``overrides`` above. ``defaults`` and
    ``overrides`` may hold a ``mesh`` (see :func:`with_overrides`): a launched worker's run folders
    and a recovery's layout.

    >>> config_from({"steps": 5}, defaults={"steps": 9, "seed": 3}, overrides={"mesh": "pipe=2"}).pipe
    2
    """
    values = _overridden({}, defaults, "default")
    return TrainConfig(**_overridden(_overridden(values, settings, "setting"), overrides, "override"))


# Keys a settings file may use for a field under another name: the flag's (csv) and older ones.
_OLDER_NAMES = {"csv": "schedule_csv", "stages": "pipe"}


def load_settings(path) -> dict:
    """The settings of a TOML file by :class:`TrainConfig` field name (``pipe = 4``,
    ``lr-schedule = "cosine"``; ``csv`` names ``schedule_csv``, and ``stages``, the older name,
    ``pipe``; ``mesh = "pipe=2,data=2"`` stays as it is). An unknown key is an error that lists the
    valid ones."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in load_toml(path).items():
        name = _OLDER_NAMES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in fields and name != "mesh":
            raise JaxmemError(f"{path}: unknown setting {key!r}; valid settings: {', '.join(sorted(fields))}")
        values[name] = value
    return values


def with_overrides(config: TrainConfig, overrides) -> TrainConfig:
    """``config`` with settings replaced by name (as :class:`TrainConfig`'s fields), checked as a new
    configuration. A ``mesh`` entry (``"data=1,pipe=2,tensor=2"``, a :class:`MeshSpec` or a dict of
    axis sizes) sets the
    four mesh sizes at once, the axes it leaves out to 1, and drops ``devices`` (the mesh decides
    them): how ``jaxmem launch`` hands a recovery's next layout to its workers.

    >>> with_overrides(TrainConfig(pipe=4, data_parallel=2), {"mesh": "pipe=2", "steps": 9}).pipe
    2
    """
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**_overridden(values, overrides, "override"))


def check_split_backward(schedule: Schedule, split_backward: bool) -> None:
    """Refuse ``split_backward`` on a schedule without I and W actions, where it would change nothing
    (``jaxmem train`` and ``jaxmem verify`` alike)."""
    if split_backward and not schedule.split_backward:
        raise JaxmemError(
            f"{_s('split_backward')} hands what a backward's I computes to its W, and {schedule.name} has no "
            f"I or W actions (whole backwards only): it would change nothing. Drop {_s('split_backward')}, "
            "or use a schedule that splits its backwards (zb-h1, zbv, chronos)"
        )


def _overridden(values: dict, overrides, what: str) -> dict:
    """``values`` (TrainConfig fields by name) updated by ``overrides``, a ``mesh`` entry spread over
    the mesh sizes (see :func:`with_overrides`)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    new = dict(overrides or {})
    unknown = sorted(set(new) - fields - {"mesh"})
    if unknown:
        raise JaxmemError(f"unknown settings {unknown} to {what}; valid: mesh, {', '.join(sorted(fields))}")
    mesh = new.pop("mesh", None)
    if mesh is not None:
        if isinstance(mesh, MeshSpec):
            mesh = str(mesh)
        sizes = parse_mesh(mesh) if isinstance(mesh, str) else {**dict.fromkeys(MESH_FIELDS, 1), **mesh}
        if set(sizes) - set(MESH_FIELDS):
            raise JaxmemError(f"a mesh to {what} names axes of {', '.join(MESH_FIELDS)}; got {mesh!r}")
        new.update({MESH_FIELDS[axis]: int(size) for axis, size in sizes.items()}, devices=None)
    if isinstance(new.get("layers_per_stage"), list):
        new["layers_per_stage"] = tuple(new["layers_per_stage"])
    return {**values, **new}
