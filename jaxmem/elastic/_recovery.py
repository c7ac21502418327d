"""The recovery planner: after a failure, score every recovery strategy with one performance model and
pick the one that finishes the remaining work soonest (after Odyssey, arXiv 2508.21613; our
reconstruction: the paper's model and search were not available to us).

Strategies, for the devices that are left:
- ``restart-on-spares``: the same plan on spare processes that replace the failed ones;
- ``shrink-data-parallel``: drop the data-parallel replicas that lost a device, keep the pipeline;
- ``shrink-fsdp``: fewer devices share each replica's parameters (more static state per device);
- ``re-partition``: re-split the layers over fewer pipeline stages on the surviving processes;
- ``reroute``: a surviving neighbour runs the failed rank's stage as an extra virtual stage (no
  restart of the split: the schedule IR expresses it; our SPMD executor needs equal stages per
  rank, so this one is scored but cannot run here).

Every strategy keeps the logical batch: the global batch and its microbatch count, so every sample
is used exactly once and the loss curve continues. The score is
``recovery (restart + compile + restore) + lost work since the last checkpoint + remaining steps x
predicted step time``; the step time comes from the schedule simulator with FLOP costs on the
hardware profile, calibrated by the measured pre-failure step (the worker's own median step time).

On a CPU (its virtual devices sharing the cores), step time follows the shared-core lockstep model
of :mod:`jaxmem.memory` (the one ``--plan auto`` uses) with the constants of launched jobs
(``CPU_LOCKSTEP_PROCESSES``): a fixed cost per tick that exchanges between pipe ranks, more when the
devices span processes (gloo between them; a job of one process runs alone, without
``jax.distributed``), and processes beyond the cores slowing every step by ``(processes / cores) ** e``
(:func:`~jaxmem.memory.estimate` applies it for a profile with ``processes`` set). Those constants
are fitted on this 2-core machine by ``benchmarks/elastic_fit.py`` from failure-free launches of the
tiny model (1F1B, M=4 and 8, batch 32 x 64, 1 to 4 processes: the layouts recoveries start from and
land on) and checked on llama-tiny and on meshes the fit did not see; ``benchmarks/elastic.py``
checks them on runs with failures (figures in docs/guides/elastic.md). The calibration is one factor, measured /
modelled pre-failure step, applied to every candidate: the machine's speed drifts between runs, its
shape less. With a measured step the planner therefore starts from the nominal CPU profile and
compiles nothing (the calibrated profile would time a compiled step first, minutes on a loaded
machine, only for the factor to cancel it).
"""

from __future__ import annotations

import dataclasses

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import human_bytes
from jaxmem.config import GENERATED_POLICIES, MeshSpec
from jaxmem.memory import CPU_LOCKSTEP_PROCESSES, HARDWARE, estimate, get_hardware
from jaxmem.pipeline import balanced_layers, model_layer_counts
from jaxmem.schedule import Schedule, ScheduleError, generate, lockstep_ticks
from jaxmem.search import evaluate

STRATEGIES = ("restart-on-spares", "shrink-data-parallel", "shrink-fsdp", "re-partition", "reroute")  # module docstring

__all__ = ["STRATEGIES", "Recovery", "RecoveryError", "Strategy", "choose_recovery", "predicted_step_seconds"]


class RecoveryError(JaxmemError):
    """No strategy can run on what is left; names the smallest configuration that would."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    nprocs: int
    pipe: int
    data_parallel: int
    layers_per_stage: tuple[int, ...] | None
    runnable: bool
    step_seconds: float
    recovery_seconds: float
    lost_seconds: float
    score_seconds: float
    note: str = ""
    fsdp: int = 1
    tensor: int = 1
    device_bytes: float | None = None  # predicted per device (the run's policy); None: not predicted
    context: int = 1

    @property
    def throughput_steps_per_second(self) -> float:
        return 1.0 / self.step_seconds if self.step_seconds else 0.0

    @property
    def mesh(self) -> str:
        """The strategy's mesh as ``--mesh`` takes it."""
        return str(
            MeshSpec(data=self.data_parallel, fsdp=self.fsdp, pipe=self.pipe, context=self.context, tensor=self.tensor)
        )

    @property
    def layout(self) -> str:
        """``P=.. D=..`` (with ``F=``/``C=``/``T=`` when those axes are in use)."""
        text = f"P={self.pipe} D={self.data_parallel}"
        for name, size in (("F", self.fsdp), ("C", self.context), ("T", self.tensor)):
            text += f" {name}={size}" if size > 1 else ""
        return text

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "steps_per_second": self.throughput_steps_per_second}


@dataclasses.dataclass(frozen=True)
class Recovery:
    """The strategies scored for one failure and the one chosen (the fastest to finish that can run)."""

    choice: Strategy | None
    candidates: tuple[Strategy, ...]
    devices_left: int
    remaining_steps: int

    def explain(self) -> list[str]:
        lines = []
        for s in sorted(self.candidates, key=lambda s: (not s.runnable, s.score_seconds)):
            mark = "->" if s is self.choice else "  "
            memory = "" if s.device_bytes is None else f", {human_bytes(s.device_bytes)}/device"
            lines.append(
                f"{mark} {s.name:22s} {s.layout} procs={s.nprocs}: finish in "
                f"{s.score_seconds:8.1f}s (recover {s.recovery_seconds:.1f}s, lost {s.lost_seconds:.1f}s, "
                f"{s.step_seconds:.3g}s/step{memory}){_mark(s)} {s.note}"
            )
        return lines

    def to_json(self) -> dict:
        return {
            "choice": None if self.choice is None else self.choice.to_json(),
            "candidates": [s.to_json() for s in self.candidates],
            "devices_left": self.devices_left,
            "remaining_steps": self.remaining_steps,
            "explanation": self.explain(),
        }


def _mark(s: Strategy) -> str:
    if s.runnable:
        return ""
    return "  [does not fit]" if "over the budget" in s.note else "  [model only]"


def _modelled_seconds(model, schedule, data_parallel, batch, seq, layer_counts, hardware, cores, nprocs, **layout):
    """A configuration's step before calibration: save-all costs on ``hardware`` with its devices
    sharing ``cores`` CPU cores (None: each device its own) over ``nprocs`` processes; ``layout``: the
    ``fsdp``, ``tensor``, ``zero`` and ``vocab_parallel`` of :func:`jaxmem.memory.estimate`."""

    return estimate(
        model,
        schedule,
        "save-all",
        batch=batch,
        seq=seq,
        data_parallel=data_parallel,
        layer_counts=None if layer_counts is None else list(layer_counts),
        hardware=dataclasses.replace(hardware, cores=cores, lockstep=CPU_LOCKSTEP_PROCESSES, processes=nprocs),
        memory=False,
        **layout,
    ).step_seconds


def predicted_step_seconds(
    model,
    schedule_name: str,
    stages: int,
    data_parallel: int,
    microbatches: int,
    batch: int,
    seq: int,
    layer_counts,
    *,
    hardware,
    cores: int | None = None,
    stage_to_rank=None,
    nprocs: int | None = None,
) -> float:
    """Modelled step seconds of a configuration before calibration (FLOP costs on ``hardware``); with
    ``cores`` set, the shared-core lockstep model of the module docstring."""

    schedule = generate(schedule_name, stages, microbatches)
    if stage_to_rank is not None:
        schedule = Schedule(schedule.ranks, stage_to_rank=stage_to_rank, name=schedule.name)
    return _modelled_seconds(
        model, schedule, data_parallel, batch, seq, layer_counts, get_hardware(hardware), cores, nprocs
    )


def _reroute_schedule(schedule_name: str, stages: int, microbatches: int, failed_rank: int):
    """The failed rank's stage moved onto its neighbour (an extra virtual stage), as a schedule."""

    base = generate(schedule_name, stages, microbatches)
    neighbour = failed_rank - 1 if failed_rank > 0 else 1
    ticks = lockstep_ticks(base)
    rows = []
    for r in range(stages):
        if r == failed_rank:
            continue
        actions = list(base.actions(r))
        if r == neighbour:
            actions = sorted(actions + list(base.actions(failed_rank)), key=lambda a: (ticks[a], a.stage))
        rows.append(actions)
    survivors = [r for r in range(stages) if r != failed_rank]
    stage_to_rank = tuple(
        survivors.index(neighbour if base.stage_to_rank[s] == failed_rank else base.stage_to_rank[s])
        for s in range(base.num_stages)
    )
    return Schedule(rows, stage_to_rank=stage_to_rank, name=f"{schedule_name}-reroute")


def choose_recovery(
    config,
    *,
    devices_per_proc: int,
    nprocs: int,
    failed: list[int],
    spares: int = 0,
    steps_done: int,
    last_checkpoint: int,
    measured_step_seconds: float | None = None,
    restart_seconds: float = 15.0,
    hardware=None,
    cores: int | None = None,
    budget: float | None = None,
) -> Recovery:
    """Score the strategies for the processes left after ``failed`` (process ranks) died.

    Args:
        config: the TrainConfig of the failed run (its plan, batch and horizon).
        devices_per_proc: devices each process drives.
        nprocs: processes of the failed run.
        failed: ranks of the processes that died.
        spares: idle processes available to replace failed ones.
        steps_done: the last step reached before the failure.
        last_checkpoint: the last complete checkpoint's step (work after it is lost).
        measured_step_seconds: the pre-failure step time (calibrates the model).
        restart_seconds: process start + compile + restore (measured by the launcher when it can).
        cores: CPU cores the devices share (None: as many as devices).
        budget: device memory in bytes (default: the config's ``budget``); a layout other than the
            job's own that the ledger predicts above it is scored but not chosen.
    """

    if hardware is None and cores and measured_step_seconds:
        # The measured step sets the scale (below): the nominal rate serves, and nothing compiles.
        hardware = dataclasses.replace(HARDWARE["cpu"], cores=cores, note="nominal, scaled by the measured step")
    hardware = get_hardware(hardware or ("cpu" if cores else "h100"))
    model = config.build_model()
    P, D, M = config.pipe, config.data_parallel, config.microbatches
    F, T = config.fsdp, config.tensor
    # A context axis is kept as it is, beside tensor: each sequence's split (and every device's share
    # of it) is the job's, and the other axes shrink around it.
    C = config.context
    B, seq = config.batch_size, config.seq_len
    schedule_name = config.schedule or "1f1b"
    layers = model.n_layers
    survivors = nprocs - len(failed)
    devices_left = survivors * devices_per_proc
    remaining = config.steps - last_checkpoint
    lost_steps = steps_done - last_checkpoint

    def schedule_for(stages: int):
        """The run's schedule on ``stages`` pipe ranks (its virtual stages per rank kept)."""
        return generate(schedule_name, stages, M, config.virtual)

    # Layers per stage: over every stage of the schedule (P x V for interleaved and V-shapes).
    def split(stages: int) -> tuple[int, ...]:
        """Layers per stage as the pipeline splits them by default (by count, not needing to divide; by
        FLOPs for layers of several parameter families)."""
        return model_layer_counts(model, stages) if model.layer_families else balanced_layers(layers, stages)

    original_counts = tuple(config.layers_per_stage or split(schedule_for(P).num_stages))
    layout = {
        "zero": config.zero,
        "vocab_parallel": config.vocab_parallel,
        "split_backward": config.split_backward,
        "hand_recomputed": config.hand_recomputed,
    }
    budget = budget or config.budget

    def modelled(stages, data, counts, procs, schedule=None, fsdp=F):
        schedule = schedule or schedule_for(stages)
        return _modelled_seconds(
            model, schedule, data, B, seq, counts, hardware, cores, procs, fsdp=fsdp, tensor=T, context=C, **layout
        )

    modelled_original = modelled(P, D, original_counts, nprocs)
    scale = measured_step_seconds / modelled_original if measured_step_seconds else 1.0
    old_step = measured_step_seconds or modelled_original
    candidates = []

    def device_bytes(stages, data, fsdp, counts):
        """Predicted per-device bytes of the run's policy on this layout (the ledger; no compile). A
        generated policy (chronos-*) is made again for the layout, as the relaunched run makes it."""
        shape = dict(
            batch=B, seq=seq, fsdp=fsdp, tensor=T, context=C, layer_counts=list(counts), hardware=hardware, **layout
        )
        schedule = schedule_for(stages)
        if config.policy in GENERATED_POLICIES:
            return evaluate(model, schedule, config.policy, budget=config.budget, data=data, **shape).device_bytes
        return estimate(model, schedule, config.policy, data_parallel=data, **shape).device_bytes

    def add(name, stages, data, counts, runnable=True, note="", schedule=None, fsdp=F, nprocs_new=None):
        devices = stages * data * fsdp * C * T
        available = devices_left if nprocs_new is None else nprocs_new * devices_per_proc
        if stages < 1 or data < 1 or B % (data * fsdp * M) or (schedule is None and devices > available):
            return
        if nprocs_new is None:
            nprocs_new = survivors if schedule is not None else -(-devices // devices_per_proc)
        try:
            step = modelled(stages, data, counts, nprocs_new, schedule, fsdp) * scale
            held = None if schedule is not None else device_bytes(stages, data, fsdp, counts)
        except (ScheduleError, JaxmemError):
            return
        # The job's own layout ran: a budget judges only the layouts it did not.
        if held is not None and budget and held > budget and (stages, data, fsdp) != (P, D, F):
            runnable = False
            note += f" (over the budget: {human_bytes(held)} > {human_bytes(budget)} per device)"
        recovery = 0.0 if name == "reroute" else restart_seconds
        lost = lost_steps * old_step if name != "reroute" else 0.0
        score = recovery + (remaining if name != "reroute" else config.steps - steps_done) * step
        candidates.append(
            Strategy(
                name,
                nprocs_new,
                stages,
                data,
                tuple(counts) if counts else None,
                runnable,
                step,
                recovery,
                lost,
                score + lost,
                note.strip(),
                fsdp=fsdp,
                tensor=T,
                device_bytes=held,
                context=C,
            )
        )

    if spares >= len(failed):
        add("restart-on-spares", P, D, original_counts, note=f"{len(failed)} spare(s) take over", nprocs_new=nprocs)
    # Devices per process are the unit that fails; plans use whole processes. Device i of the mesh
    # (data, fsdp, pipe, context, tensor; tensor innermost) belongs to replica i // (F P C T), numbered
    # data-major: a lost device takes its whole fsdp group (the group's parameter shards) with it.
    lost_devices = {r * devices_per_proc + k for r in failed for k in range(devices_per_proc)}
    group = P * C * T * F
    lost_groups = {d // group for d in lost_devices if d < group * D}
    if D > 1:
        d_new = D - max(len(lost_groups), 1)
        add("shrink-data-parallel", P, d_new, original_counts, note=f"data {D} -> {d_new}")
    for f_new in range(F - 1, 0, -1):
        if D * f_new * P * C * T <= devices_left and not B % (D * f_new * M):
            add("shrink-fsdp", P, D, original_counts, fsdp=f_new, note=f"fsdp {F} -> {f_new}")
            break
    for p_new in range(P - 1, 0, -1):
        for d_new in range(D, 0, -1):
            stages_new = schedule_for(p_new).num_stages
            if p_new * d_new * F * C * T <= devices_left and layers >= stages_new:
                counts = split(stages_new)
                add("re-partition", p_new, d_new, counts, note=f"pipe {P} -> {p_new}, layers {list(counts)}")
                break
        if any(c.name == "re-partition" for c in candidates):
            break
    one_stage_per_rank = schedule_for(P).num_stages == P
    if (
        D == 1
        and F == 1
        and C == 1
        and T == 1
        and len(failed) == 1
        and P > 1
        and devices_per_proc == 1
        and one_stage_per_rank
    ):
        rerouted = _reroute_schedule(schedule_name, P, M, failed[0] % P)
        add(
            "reroute",
            P - 1,
            1,
            original_counts,
            runnable=False,
            schedule=rerouted,
            note="neighbour runs the failed stage as a second virtual stage",
        )
    runnable = [c for c in candidates if c.runnable]
    choice = min(runnable, key=lambda c: c.score_seconds) if runnable else None
    if choice is None:
        over = [c for c in candidates if "over the budget" in c.note]
        if over:
            least = min(over, key=lambda c: c.device_bytes)
            raise RecoveryError(
                f"{survivors} surviving process(es) x {devices_per_proc} device(s) cannot hold this job: every "
                f"layout left is predicted over the budget of {human_bytes(budget)} per device, the smallest "
                f"{least.layout} at {human_bytes(least.device_bytes)}; add processes (or spares)"
                + (
                    ""
                    if str(config.policy) == "recompute-all"
                    else f", or pick a policy that holds less ({setting('policy', 'recompute-all')})"
                )
            )
        raise RecoveryError(
            f"{survivors} surviving process(es) x {devices_per_proc} device(s) cannot run this job: it needs at "
            f"least {M} microbatches' worth of batch and {C * T * F} device(s) per pipeline stage (context x tensor "
            f"x fsdp); the smallest runnable configuration is P=1, D=1 on {C * T * F} device(s) with batch "
            f"divisible by {M * F}"
        )
    return Recovery(choice, tuple(candidates), devices_left, remaining)
