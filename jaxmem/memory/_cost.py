"""Time costs of a pipelined step -- FLOPs per stage, recompute added to backwards, host transfers -- and
:func:`estimate`, the one prediction of memory and step time every planner uses.

A hardware profile turns FLOPs into seconds (peak FLOP/s x an achieved fraction) and bytes into
transfer seconds (host link bandwidth). Figures of the cluster profiles are vendors' published peaks
(dense bf16) with an assumed 50% achieved fraction; the ``cpu`` profile is calibrated from a measured
step of the tiny model on this machine (``calibrate_cpu``). All simulated times are predictions.

On a CPU (a profile with ``cores``: its virtual devices share them), the step is not the simulated
makespan: the executor runs ticks in lockstep (one action per rank per tick, results exchanged
between ticks) and the ranks take turns on the cores. A tick costs
its busy ranks' work spread over the cores, plus a part (``imbalance``) of the excess of its longest
action over that even share (an idle device's core only partly helps a busy one), plus a fixed cost
(the rank's dispatch of its action and the activation/gradient exchange) of ``tick_flops``
FLOP-equivalents; a step adds ``step_flops`` (the update, dispatch and host round trip)
(:func:`shared_core_step_seconds`); each byte an F stashes for its B costs ``stash_flops_per_byte``
more, half in each (a residual is written to the stash and read back; refitted at about 6 FLOPs a
byte once the executor wrote residuals in place -- 79 before, when the stash path copied). The constants
(:class:`Lockstep`) depend on how the devices are spread over processes, so there are two sets, both
fitted on the 2-core development machine: ``CPU_LOCKSTEP`` for one process with virtual devices
(``jaxmem train``), fitted by ``benchmarks/plan_ranking.py`` on eleven configurations (schedules,
meshes, microbatch counts, policies) and checked on ten it did not see;
``CPU_LOCKSTEP_PROCESSES`` for jobs of ``jaxmem launch``, whose devices may span processes that
exchange over gloo: its ``process_step_flops`` and ``process_tick_flops`` are added when they do (a
job of one process runs alone, with no gloo), fitted by ``benchmarks/elastic_fit.py`` on failure-free
launches of the tiny model (1F1B, M=4 and 8, pipe 4, 3, 2 and 1, data 1 and 2, on 1 to 4 processes)
for what the recovery planner uses -- step-time ratios between configurations of one model and
microbatch count, calibrated by one measured run -- and checked on launches of llama-tiny and of
meshes it did not see (figures in that record and docs/concepts/time-model.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem._util import cpu_cores
from jaxmem.schedule import Action, Costs, Kind, Schedule, SimulationResult, simulate


@dataclasses.dataclass(frozen=True)
class Lockstep:
    """Constants of the shared-core CPU step model (module docstring), as FLOP-equivalents at the
    profile's rate and a share."""

    step_flops: float  # fixed cost of one step
    tick_flops: float  # fixed cost of one lockstep tick
    imbalance: float  # weight of a tick's longest-action excess over the even split of its work
    # cost of one residual byte kept from F to B (packed, written and read back; and on XLA:CPU the
    # unfused forward that materialises it), half charged to the F that stashes it, half to the B
    stash_flops_per_byte: float = 0.0
    # slowdown exponent of processes beyond the cores: a step takes (processes / cores) ** this longer
    # (time-slicing; collectives between processes waiting for a core)
    oversubscription: float = 0.0
    # fixed costs added when the devices span more than one process (gloo exchanges between processes,
    # each process's own dispatch): per step and per tick; 0 for the one-process constants
    process_step_flops: float = 0.0
    process_tick_flops: float = 0.0
    # weight of the excess when the devices are spread over processes with fewer devices than cores:
    # XLA:CPU then runs each device's kernels on a pool of all the cores, so a busy device takes the
    # cores an idle one leaves (with at least as many, each device runs on one thread and cannot);
    # None: ``imbalance``
    pooled_imbalance: float | None = None

    def excess_weight(self, pooled: bool) -> float:
        """The weight of a tick's excess (``pooled``: devices on a pool of the cores, see above)."""
        return self.pooled_imbalance if pooled and self.pooled_imbalance is not None else self.imbalance

    def fixed_flops(self, ticks: int, processes: int | None = None) -> float:
        """The step's fixed costs, FLOP-equivalents: per step and per tick, and the process terms when
        the devices span more than one process."""
        fixed = self.step_flops + ticks * self.tick_flops
        if processes and processes > 1:
            fixed += self.process_step_flops + ticks * self.process_tick_flops
        return fixed


# Fitted by benchmarks/plan_ranking.py (benchmarks/results/plan_ranking.json) on the executor that
# writes residuals in place: a stashed byte costs about 6 FLOPs here (79 before, when every tick
# scattered a zero-padded window and copied the gradient accumulators).
CPU_LOCKSTEP = Lockstep(step_flops=0.0, tick_flops=4.1e7, imbalance=0.72, stash_flops_per_byte=6.3)
# Fitted by benchmarks/elastic_fit.py (benchmarks/results/elastic_fit.json) on launches of 1 to 4
# processes: a tick costs 0.06 GFLOP-equivalents, 0.32 more when the devices span processes (gloo);
# a device on one thread gets no help from idle ones (1.15), one on a pool of the cores all of it (0).
CPU_LOCKSTEP_PROCESSES = Lockstep(
    step_flops=0.0,
    tick_flops=6.22e7,
    imbalance=1.15,
    oversubscription=0.45,
    process_tick_flops=3.23e8,
    pooled_imbalance=0.0,
)

__all__ = [
    "CPU_LOCKSTEP",
    "CPU_LOCKSTEP_PROCESSES",
    "HARDWARE",
    "Estimate",
    "Hardware",
    "Lockstep",
    "calibrate_cpu",
    "cpu_cores",
    "estimate",
    "get_hardware",
    "gradient_sync_seconds",
    "shared_core_step_seconds",
    "shared_core_terms",
    "stage_update_seconds",
    "state_transfer_seconds",
    "step_costs",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator.

    Attributes:
        name: profile name.
        peak_flops: peak dense FLOP/s of one device.
        hbm_bytes: device memory.
        host_bandwidth: bytes/s of one device's host link, per direction.
        efficiency: achieved fraction of ``peak_flops`` on transformer matmuls.
        cores: CPU cores all devices share (the ``cpu`` profile: this machine's); None when every
            device computes on its own (accelerators). With cores set, step time follows the
            shared-core lockstep model (module docstring).
        lockstep: that model's constants (one process with virtual devices unless replaced).
        processes: processes the devices are spread over (None: one); more processes than ``cores``
            slow each step by ``(processes / cores) ** lockstep.oversubscription``.
        link_bandwidth: bytes/s one device sends (and receives) to devices of its own node (NVLink,
            ICI), achieved; None: communication is not priced apart (the CPU profile's lockstep
            constants include the exchanges of its virtual devices).
        network_bandwidth: bytes/s one device sends to devices of other nodes, achieved.
        devices_per_node: devices sharing the fast link.
        host_link_devices: devices whose host transfers share one host link (e.g. two GPUs behind one
            PCIe switch). Each transfer is priced at :attr:`host_share`, what a device gets when all
            of them transfer at once: a bound, since the model does not track when the others idle.
        note: where the figures come from.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    host_bandwidth: float
    efficiency: float = 0.5
    cores: int | None = None
    lockstep: Lockstep = CPU_LOCKSTEP
    processes: int | None = None
    link_bandwidth: float | None = None
    network_bandwidth: float | None = None
    devices_per_node: int = 8
    host_link_devices: int = 1
    note: str = ""

    @property
    def flops_per_second(self) -> float:
        return self.peak_flops * self.efficiency

    @property
    def host_share(self) -> float:
        """Bytes/s of host transfer one device gets, its link shared by ``host_link_devices``."""
        return self.host_bandwidth / max(1, self.host_link_devices)

    @property
    def oversubscribed(self) -> float:
        """The slowdown of ``processes`` time-slicing ``cores`` cores (1 when they fit)."""
        n, cores = self.processes, self.cores
        return (n / cores) ** self.lockstep.oversubscription if cores and n and n > cores else 1.0

    def group_bandwidth(self, size: int, stride: int) -> float | None:
        """Bytes/s per device of a collective over ``size`` devices ``stride`` apart in device order
        (the mesh's devices are ordered data, fsdp, pipe, tensor: tensor neighbours are adjacent, pipe
        neighbours ``tensor`` apart): the node's
        link when the group fits in one node, else the network. None: not priced."""
        if self.link_bandwidth is None or size <= 1:
            return None
        if size * stride <= self.devices_per_node or self.network_bandwidth is None:
            return self.link_bandwidth
        return self.network_bandwidth

    def collective_seconds(self, kind: str, nbytes: float, size: int, stride: int = 1) -> float:
        """Seconds of a ring collective over ``size`` devices on an array of ``nbytes`` (whole):
        ``all_gather``/``reduce_scatter`` move ``(n-1)/n`` of it per device, ``all_reduce`` twice that,
        ``send`` all of it once."""
        bandwidth = self.group_bandwidth(size, stride)
        if bandwidth is None or nbytes <= 0:
            return 0.0
        share = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}.get(kind)
        if kind == "send":
            return nbytes / bandwidth
        if share is None:
            raise JaxmemError(f"unknown collective {kind!r}")
        return share * (size - 1) / size * nbytes / bandwidth

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        peak_flops=989e12,
        hbm_bytes=80e9,
        host_bandwidth=55e9,
        link_bandwidth=360e9,
        network_bandwidth=40e9,
        devices_per_node=8,
        note="H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3, PCIe Gen5 x16 host link (~55 GB/s achieved); "
        "NVLink 4 450 GB/s per direction and one 400 Gb/s NIC per GPU, both taken at 80%, 8 GPUs a node; "
        "50% of peak assumed",
    ),
    "tpu-v4": Hardware(
        name="tpu-v4",
        peak_flops=275e12,
        hbm_bytes=32 * 2**30,
        host_bandwidth=25e9,
        link_bandwidth=90e9,
        devices_per_node=4096,
        note="TPU v4 chip: 275 TFLOP/s bf16, 32 GiB HBM2 (Google Cloud's v4 page); ICI 2,400 Gb/s a chip over six "
        "links, a ring over one torus axis taken at two links' 100 GB/s x 0.9, a 4,096-chip pod on ICI; host link "
        "assumed 25 GB/s; 50% of peak assumed",
    ),
    "tpu-v5e": Hardware(
        name="tpu-v5e",
        peak_flops=197e12,
        hbm_bytes=16 * 2**30,
        host_bandwidth=25e9,
        link_bandwidth=90e9,
        devices_per_node=256,
        note="TPU v5e chip: 197 TFLOP/s bf16, 16 GiB HBM2 (Google Cloud's v5e page); ICI 1,600 Gb/s a chip over "
        "four links, a ring over one torus axis taken at two links' 100 GB/s x 0.9, a 256-chip pod on ICI; host "
        "link assumed 25 GB/s (PCIe Gen4 x16); 50% of peak assumed",
    ),
    "tpu-v5p": Hardware(
        name="tpu-v5p",
        peak_flops=459e12,
        hbm_bytes=95e9,
        host_bandwidth=50e9,
        link_bandwidth=180e9,
        devices_per_node=8960,
        note="TPU v5p chip: 459 TFLOP/s bf16, 95 GB HBM2e; host link assumed 50 GB/s; ICI taken at 180 GB/s "
        "per chip for a ring over one torus axis, a whole pod on ICI; 50% of peak assumed",
    ),
    "tpu-v6e": Hardware(
        name="tpu-v6e",
        peak_flops=918e12,
        hbm_bytes=32 * 2**30,
        host_bandwidth=25e9,
        link_bandwidth=200e9,
        devices_per_node=256,
        note="TPU v6e (Trillium) chip: 918 TFLOP/s bf16, 32 GiB HBM (Google Cloud's v6e page); ICI 3,584 Gb/s a "
        "chip over four links, a ring over one axis taken at two links' 224 GB/s x 0.9, a 256-chip pod on ICI; "
        "host link assumed 25 GB/s; 50% of peak assumed",
    ),
    # Calibrated on the 2-core development machine by benchmarks (calibrate_cpu); a starting value.
    "cpu": Hardware(
        name="cpu",
        peak_flops=4e9,
        hbm_bytes=24 * 2**30,
        host_bandwidth=5e9,
        efficiency=1.0,
        note="this machine: FLOP/s measured from a tiny-model step; host link nominal",
    ),
}


def get_hardware(name: str | Hardware) -> Hardware:
    """A profile by name, or by a target's (``h100:16``: the h100 profile); ``cpu`` is calibrated on
    this machine (see :func:`calibrate_cpu`)."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower().partition(":")[0]
    if key == "cpu":
        return calibrate_cpu()
    if key not in HARDWARE:
        raise JaxmemError(f"unknown hardware profile {name!r}; profiles: {', '.join(HARDWARE)}")
    return HARDWARE[key]


@functools.lru_cache(maxsize=512)
def _vocab_ticks(schedule: Schedule) -> dict:
    """Per action that runs in a lockstep tick where every rank works on the split vocabulary (the
    executor's, :mod:`jaxmem.pipeline._vocab`), how many of that work's sums and heads its tick holds:
    ``(sums, heads)``. A sum over the pipe ranks where the first stage's F looks a microbatch up and
    where its B or I has the rows' gradient; a head (the rank's slice of its projection, forward and
    backward, and two sums) where the last stage's F reaches it. Cached per schedule: a planner
    prices many policies on one."""
    from jaxmem.schedule import lockstep_ticks

    last = schedule.num_stages - 1
    ticks = lockstep_ticks(schedule)
    at_tick: dict[int, tuple[int, int]] = {}
    for action, tick in ticks.items():
        sums, heads = at_tick.get(tick, (0, 0))
        if action.stage == 0 and action.kind in (Kind.F, Kind.B, Kind.I):
            sums += 1
        if action.stage == last and action.kind is Kind.F:
            heads += 1
        at_tick[tick] = (sums, heads)
    return {action: at_tick[tick] for action, tick in ticks.items() if at_tick[tick] != (0, 0)}


def step_costs(
    model,
    schedule: Schedule,
    resolved,
    layer_counts,
    *,
    microbatch: int,
    seq: int,
    hardware,
    facts=None,
    vocab: bool = False,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    context: int = 1,
    master_cut: bool = False,
    families=None,
    split_backward: bool = False,
    hand_recomputed: bool = False,
) -> Costs:
    """Costs for :func:`jaxmem.schedule.simulate`, in seconds on ``hardware``.

    ``layer_counts``: the layers each stage runs; ``families``: per stage, the parameter family of
    each (:meth:`~jaxmem.memory.ModelFacts.stage_families`), for a model whose layers differ in them.
    A stage's weights move in proportion to its layers' bytes (units of layer 0's).

    F of stage s costs its forward FLOPs; B its backward FLOPs (the forward's twice, plus what the
    policy recomputes). I and W, as the executor runs them:

    - with ``split_backward`` (:attr:`~jaxmem.pipeline.Pipeline.splits_backward`: I hands W the
      cotangents its weight gradients read), half the plain backward each, plus the recompute (each
      re-runs what it needs from the saved values); with ``hand_recomputed`` as well, I hands W the
      values it recomputed, and W recomputes nothing;
    - without it, I is the same half and W runs the whole pullback again, XLA dropping only what
      the stage's input gradient alone needs (the first layer's input products, 1/layers of I's
      work): priced as a whole B.

    The policy's host-resident stash bytes are offloaded after F and prefetched before the backward.

    With ``vocab`` (the vocabulary split over the ranks) the head's projection, forward and backward,
    runs on every rank at once, a ``1/P`` slice each, in the lockstep tick at which the last stage's
    F reaches it: each rank's slice is charged to the action the rank runs in that tick (a rank idle
    then does its slice in its idle time). The executor stops every rank for it at that tick; the
    simulator does not model that synchronisation. (Until this release the slices were spread over
    each rank's F actions, which lengthened every link of a V-shaped schedule's chains: the head
    lengthened a Chronos step by 2.6x a rank's M slices, ``tests/test_estimate.py``.)

    Communication, on profiles with links (:meth:`Hardware.collective_seconds`), as the executor
    does it -- before or after the compute that needs it, not overlapped with it: each hop of an
    activation or gradient to the next rank (the simulator's ``comm``); with ``fsdp``, a stage's
    gather of its weights (and of the shared ones the first and last stages read) before each of
    its actions -- the 16-bit compute copy with ``master_cut`` -- and the reduce-scatter of their
    gradient (in the master weights' dtype) after B and W, except for a stage kept gathered
    (:func:`kept_gather_seconds`); with ``vocab``, the four
    sums over the pipe ranks per microbatch, each in its tick like the head's FLOPs: the rows in
    the first stage's F's, their gradient in its B's (or I's), the head's input and its gradient in
    the last stage's F's.

    With ``tensor`` (:meth:`~jaxmem.memory.ModelFacts.tensor_cut`): the cut part of a stage's matmul
    FLOPs runs on ``1/tensor`` of them; every forward (and every recomputed forward) sums the outputs
    of the matmuls that contract the cut over the tensor devices, every backward as many of the cut
    matmuls' input gradients; a backward gathers the whole part of its stashed item back from the
    tensor devices' shares (a cut residual stays each device's share; the executor's CutArena), and
    a split W the whole part of what its I handed it, kept cut the same way.

    With ``context`` (``facts`` of that context axis, ``seq`` the tokens of a sequence each of its
    devices holds): a stage's FLOPs are its device's queries against every key; every forward
    all-gathers the keys and values its layers hand :func:`~jaxmem.models.context_kv` over the
    context devices, every backward gathers them again (no policy keeps the gathered copy) and
    reduce-scatters their gradients back (:meth:`~jaxmem.memory.ModelFacts.context_kv_bytes`). The
    other axes' devices lie ``context * tensor`` further apart.
    """
    from jaxmem.memory._facts import model_facts
    from jaxmem.models import get_model
    from jaxmem.policy import PRESETS

    model = get_model(model)
    facts = facts or model_facts(model)
    hardware = get_hardware(hardware)
    rate = hardware.flops_per_second
    last = schedule.num_stages - 1
    save_all = PRESETS["save-all"].bind(model.tags)

    def stage_shape(stage: int, policy) -> dict:
        return dict(
            first=stage == 0,
            last=stage == last,
            layers=layer_counts[stage],
            families=families[stage] if families else None,
            policy=policy,
            microbatch=microbatch,
            seq=seq,
            vocab=vocab,
        )

    def stage_facts(stage: int, policy):
        return facts.stage(**stage_shape(stage, policy))

    ranks, virtual = schedule.num_ranks, schedule.num_stages // schedule.num_ranks
    inner = context * tensor  # pipe neighbours are this far apart in the device order
    message = facts.message_bytes(microbatch, seq)
    vocab_ticks = _vocab_ticks(schedule) if vocab else {}
    one_sum = hardware.collective_seconds("all_reduce", message, ranks, inner) if vocab else 0.0
    head = facts.vocab_flops(microbatch, seq) / rate / ranks + 2 * one_sum if vocab else 0.0
    shared_bytes = facts.stage_shared_bytes(vocab)
    # What a stage's weights take on a device once gathered over fsdp (its tensor cut stays).
    layer_bytes = facts.layer_bytes
    units = [facts.units(n, families[s] if families else None) for s, n in enumerate(layer_counts)]
    if tensor > 1:
        cut = facts.static_bytes(ranks, 1, tensor=tensor).stage_params[0]
        layer_bytes *= cut / facts.static_bytes(ranks, 1).stage_params[0]

    copy_ratio = 1.0
    if master_cut:
        static = facts.static_bytes(ranks, 1, virtual, fsdp=fsdp, tensor=tensor, vocab=vocab)
        copy_ratio = (static.stage_copy[0] + static.shared_copy) / (static.stage_params[0] + static.shared_params)

    def fsdp_seconds(stage: int, kind: str) -> float:
        if fsdp <= 1:
            return 0.0
        # A stage kept gathered (its policy's keep_gathered) gathers its own weights once per step
        # (kept_gather_seconds), not per action.
        own = 0.0 if resolved.keep_gathered(stage) else units[stage] * layer_bytes
        whole = own + (shared_bytes if stage in (0, last) else 0.0)
        seconds = hardware.collective_seconds("all_gather", whole * copy_ratio, fsdp, ranks * inner)
        if kind in ("B", "W"):
            seconds += hardware.collective_seconds("reduce_scatter", whole, fsdp, ranks * inner)
        return seconds

    gathers = {(s, k): fsdp_seconds(s, k) for s in range(schedule.num_stages) for k in "FBIW"}

    def tensor_terms(stage: int, policy) -> tuple[float, float, float]:
        """(share of the stage's FLOPs on one tensor device, seconds of one forward's sums, seconds
        of a backward's gather of its stashed item's whole part)."""
        if tensor <= 1:
            return 1.0, 0.0, 0.0
        part = facts.tensor_cut(policy, seq, tensor)
        sums = layer_counts[stage] * microbatch * part.reduced_bytes
        whole = stage_facts(stage, policy).stash_bytes("device") * (1 - part.stash)
        return (
            1 - part.flops * (1 - 1 / tensor),
            hardware.collective_seconds("all_reduce", sums, tensor),
            hardware.collective_seconds("all_gather", whole, tensor),
        )

    def context_seconds(stage: int) -> float:
        """Seconds of one all-gather of the stage's keys and values over the context devices (a
        reduce-scatter of their gradients takes as long)."""
        if context <= 1:
            return 0.0
        shape = stage_shape(stage, None)
        local = facts.context_kv_bytes(shape["first"], shape["last"], shape["layers"], seq, shape["families"])
        return hardware.collective_seconds("all_gather", context * local * microbatch, context, tensor)

    gather_kv = [context_seconds(s) for s in range(schedule.num_stages)]
    plain = [stage_facts(s, save_all) for s in range(schedule.num_stages)]
    share = [tensor_terms(s, save_all)[0] for s in range(schedule.num_stages)]
    forward_seconds = [f.forward_flops * k / rate for f, k in zip(plain, share)]
    # The simulator charges B twice the stage weight (I and W once each); what the plain backward
    # costs beyond that (measured facts: elementwise work) is added like the recompute.
    excess = [(f.backward_flops - 2 * f.forward_flops - f.recompute_flops) * k / rate for f, k in zip(plain, share)]
    cache: dict = {}

    def handed_gather(stage: int, policy) -> float:
        """Seconds of a split W's gather of the whole part of what its I handed it (a tensor axis)."""
        if tensor <= 1 or not split_backward:
            return 0.0
        elems = facts.transfer_elems(**stage_shape(stage, policy), hand_recomputed=hand_recomputed)
        handed = sum(n * np.dtype(key[0]).itemsize for key, n in elems.items())
        return hardware.collective_seconds(
            "all_gather", handed * (1 - facts.tensor_cut(policy, seq, tensor).transfers), tensor
        )

    def cell(stage: int, mb: int):
        """(recompute seconds, stash device / host bytes, forward comm, backward comm, a split W's
        comm) of one cell."""
        variant = resolved.variant_of[(stage, mb)]
        key = (stage, variant)  # the variant's index, not its policy: hashing that costs more than the rest
        if key not in cache:
            sp = resolved.variants[variant]
            f = stage_facts(stage, sp)
            k, sums, gather = tensor_terms(stage, sp)
            redo = f.recompute_flops / f.forward_flops if f.forward_flops else 0.0
            back = (1 + redo) * sums + gather + 2 * gather_kv[stage]  # the keys and values again, their gradients back
            cache[key] = (
                f.recompute_flops * k / rate,
                f.stash_bytes("device"),
                f.stash_bytes("host"),
                sums + gather_kv[stage],
                back,
                handed_gather(stage, sp),
            )
        return cache[key]

    # On shared CPU cores, stashing costs time beyond FLOPs (the Lockstep constants; none on accelerators).
    per_byte = hardware.lockstep.stash_flops_per_byte / rate if hardware.cores else 0.0

    def extra(action: Action) -> float:
        recompute, device, host, forward_comm, backward_comm, handed_comm = cell(action.stage, action.microbatch)
        traffic = per_byte * (device + host) / 2
        comm = gathers[(action.stage, action.kind.value)]
        if action in vocab_ticks:
            sums, heads = vocab_ticks[action]
            comm += sums * one_sum + heads * head
        if action.kind is Kind.F:
            return traffic + comm + forward_comm
        if action.kind is Kind.B:
            return recompute + excess[action.stage] + traffic + comm + backward_comm
        # I computes the input gradients (the sums); W the weight gradients (no sums).
        if action.kind is Kind.I:
            return recompute + (excess[action.stage] + traffic) / 2 + comm + backward_comm
        if split_backward:
            return (0.0 if hand_recomputed else recompute) + (excess[action.stage] + traffic) / 2 + comm + handed_comm
        # The whole pullback again: the cotangents' chain (I's products, a forward's FLOPs, and with a
        # tensor axis its sums and its stash's gather) beside the weight products the simulator charges W.
        return forward_seconds[action.stage] + recompute + excess[action.stage] + traffic / 2 + comm + backward_comm

    any_host = any(
        resolved.stage_policy(s, m).offload or resolved.stage_policy(s, m).offload_stash
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
    )
    # Weights kept on host come to the device for a rank's action on their stage when its action
    # before on a stage on host ran another stage (the executor's prefetch slot holds one stage),
    # fetched while the rank runs the action before it.
    on_host = [resolved.offload_weights(s) for s in range(schedule.num_stages)]
    fetch_fn = None
    if any(on_host):
        shard = facts.static_bytes(ranks, 1, fsdp=fsdp, tensor=tensor).stage_params[0]  # one layer, per device
        fetch = [units[s] * shard if on_host[s] else 0.0 for s in range(schedule.num_stages)]
        fetched = set()
        for rank in range(ranks):
            held = None
            for action in schedule.actions(rank):
                if on_host[action.stage] and action.stage != held:
                    fetched.add(action)
                    held = action.stage
        fetch_fn = lambda a: fetch[a.stage] if a in fetched else 0.0  # noqa: E731
    return Costs(
        f=1.0,
        i=1.0,
        w=1.0,
        comm=hardware.collective_seconds("send", message, ranks, inner) if ranks > 1 else 0.0,
        stage_weights=tuple(forward_seconds),
        extra=extra,
        activation_fn=lambda s, m: cell(s, m)[1] + cell(s, m)[2],
        offload_fn=(lambda s, m: cell(s, m)[2]) if any_host else None,
        fetch_fn=fetch_fn,
        host_bandwidth=hardware.host_share if any_host or fetch_fn else None,
    )


def stage_update_seconds(
    model,
    schedule: Schedule,
    resolved,
    layer_counts,
    hardware,
    optimizer_moments: int = 2,
    facts=None,
    *,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    zero: bool = True,
) -> tuple[float, ...]:
    """Per stage, seconds of the update's host traffic on its rank's link: its weights on host read
    and the new values written back, its optimizer state on host (the moments) read and written
    back; each device's share of them (cut over fsdp, tensor and, for the state, ZeRO), at its
    share of the host link. Arguments as :func:`state_transfer_seconds`."""
    from jaxmem.memory._facts import model_facts
    from jaxmem.models import get_model

    facts = facts or model_facts(get_model(model))
    hardware = get_hardware(hardware)
    one = facts.static_bytes(schedule.num_ranks, 1, data=data_parallel, fsdp=fsdp, tensor=tensor, zero=zero)
    weights, state = one.stage_params[0], optimizer_moments * one.stage_state[0]  # one layer, per device
    units = facts.stage_units(layer_counts)

    def stage_bytes(stage: int) -> float:
        total = 2 * units[stage] * weights if resolved.offload_weights(stage) else 0.0
        return total + (2 * units[stage] * state if resolved.offload_optimizer_state(stage) else 0.0)

    return tuple(stage_bytes(s) / hardware.host_share for s in range(schedule.num_stages))


def state_transfer_seconds(
    model,
    schedule: Schedule,
    resolved,
    layer_counts,
    hardware,
    optimizer_moments: int = 2,
    facts=None,
    *,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    zero: bool = True,
) -> float:
    """Seconds of the update's host traffic, the slowest rank's (its stages'
    :func:`stage_update_seconds` in turn): the executor's update runs after the tick loop, so
    nothing overlaps it. The weights' fetches for the actions are not here: the simulator overlaps
    them with the action before (:func:`step_costs`)."""
    seconds = stage_update_seconds(
        model,
        schedule,
        resolved,
        layer_counts,
        hardware,
        optimizer_moments,
        facts,
        data_parallel=data_parallel,
        fsdp=fsdp,
        tensor=tensor,
        zero=zero,
    )
    return max(sum(seconds[s] for s in schedule.stages_of(r)) for r in range(schedule.num_ranks))


def gradient_sync_seconds(
    facts,
    schedule: Schedule,
    layer_counts,
    hardware,
    *,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    context: int = 1,
    vocab: bool = False,
    master_cut: bool = False,
) -> float:
    """Seconds of the step's gradient reduction after the pipeline and the parameters' return after the
    update, on profiles with links: per stage leaf, a reduce-scatter over the replicas that hold it
    whole and an all-gather of the new values (an all-reduce's traffic; ZeRO or not); the shared
    leaves over every device, the vocabulary slices over the replicas. With ``master_cut`` the
    all-gather moves the compute copy (16-bit where the model casts) instead of the master weights.
    Not overlapped with the backward: the executor reduces after its last tick. A ``context`` axis's
    devices hold the same parameters: they join every group (``facts`` of that axis cut the state
    over it with ZeRO)."""
    hardware = get_hardware(hardware)
    ranks, virtual = schedule.num_ranks, schedule.num_stages // schedule.num_ranks
    static = facts.static_bytes(
        ranks,
        facts.stage_rows(layer_counts),
        virtual,
        data=data_parallel,
        fsdp=fsdp,
        tensor=tensor,
        zero=True,
        vocab=vocab,
    )

    def sync(nbytes, copy_ratio, group, stride):
        if not master_cut:
            return hardware.collective_seconds("all_reduce", nbytes, group, stride)
        return hardware.collective_seconds("reduce_scatter", nbytes, group, stride) + hardware.collective_seconds(
            "all_gather", nbytes * copy_ratio, group, stride
        )

    stage_ratio = sum(static.stage_copy) / sum(static.stage_params) if sum(static.stage_params) else 1.0
    shared_ratio = static.shared_copy / static.shared_params if static.shared_params else 1.0
    if context == 1:
        stride = fsdp * ranks * tensor  # the data axis's devices are fsdp x pipe x tensor apart
        seconds = sync(sum(static.stage_params), stage_ratio, data_parallel, stride)
        shared = facts.stage_shared_bytes(vocab) / fsdp
        seconds += sync(shared, shared_ratio, data_parallel * ranks, fsdp * tensor)
        tables = static.shared_params - shared
        seconds += sync(tables, shared_ratio, data_parallel * fsdp, ranks * tensor)
        return seconds
    # With a context axis each group also spans its devices (tensor apart; the data axis's are fsdp x
    # pipe x context x tensor apart, fsdp's pipe x context x tensor, pipe's context x tensor): a group
    # is priced at the stride its widest axis spans.
    inner = context * tensor
    data, fsdp_axis, pipe, ctx = (
        (data_parallel, fsdp * ranks * inner),
        (fsdp, ranks * inner),
        (ranks, inner),
        (context, tensor),
    )
    seconds = sync(sum(static.stage_params), stage_ratio, *_group(data, ctx))
    shared = facts.stage_shared_bytes(vocab) / fsdp
    seconds += sync(shared, shared_ratio, *_group(data, pipe, ctx))
    tables = static.shared_params - shared
    seconds += sync(tables, shared_ratio, *_group(data, fsdp_axis, ctx))
    return seconds


def _group(*axes: tuple[int, int]) -> tuple[int, int]:
    """``(devices, stride)`` of a collective over mesh axes given as ``(size, stride)``: the devices of
    all of them, at the stride that spans what the widest of them spans."""
    size = math.prod(n for n, _ in axes)
    span = max((n * stride for n, stride in axes if n > 1), default=1)
    return size, max(1, span // size)


def kept_gather_seconds(
    facts, schedule: Schedule, resolved, layer_counts, hardware, *, fsdp, tensor, master_cut, context: int = 1
):
    """Seconds per step of the stages an FSDP policy keeps gathered (``keep_gathered``): each rank
    gathers those stages' weights once (the 16-bit copy with ``master_cut``) and reduce-scatters their
    whole gradient once, the slowest rank's sum. Not overlapped with compute."""
    if fsdp <= 1:
        return 0.0
    hardware = get_hardware(hardware)
    ranks = schedule.num_ranks
    static = facts.static_bytes(ranks, 1, fsdp=1, tensor=tensor)
    layer = static.stage_params[0]  # one layer, whole over fsdp, cut over tensor
    copy = static.stage_copy[0] if master_cut else layer
    units = facts.stage_units(layer_counts)

    def rank_seconds(rank):
        seconds = 0.0
        for stage in schedule.stages_of(rank):
            if resolved.keep_gathered(stage):
                n = units[stage]
                seconds += hardware.collective_seconds("all_gather", n * copy, fsdp, ranks * context * tensor)
                seconds += hardware.collective_seconds("reduce_scatter", n * layer, fsdp, ranks * context * tensor)
        return seconds

    return max(rank_seconds(r) for r in range(ranks))


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Everything predicted about one configuration, without compiling.

    Attributes:
        ledger: the predicted memory ledger (None when estimated with ``memory=False``).
        costs: the per-action costs the simulation used (seconds on the hardware profile).
        simulation: the schedule simulated with those costs.
        step_seconds: the simulated makespan (on shared CPU cores: the lockstep model's step) plus
            offloaded-state transfers and the gradient synchronisation.
        state_transfer_seconds: the update's host traffic for offloaded weights and optimizer state
            (not overlapped; the weights' fetches before each action are in the simulation).
        sync_seconds: the gradient synchronisation (:func:`gradient_sync_seconds`).
        tokens_per_second: ``batch * seq / step_seconds``.
    """

    ledger: object
    costs: Costs
    simulation: SimulationResult
    step_seconds: float
    state_transfer_seconds: float
    tokens_per_second: float
    sync_seconds: float = 0.0

    @property
    def device_bytes(self) -> float:
        return self.ledger.max_device_bytes

    @property
    def host_bytes(self) -> float:
        return max(r.host_bytes for r in self.ledger.ranks)


def estimate(
    model,
    schedule: Schedule,
    policy=None,
    *,
    batch: int,
    seq: int,
    data_parallel: int = 1,
    fsdp: int = 1,
    tensor: int = 1,
    context: int = 1,
    zero: bool = True,
    vocab_parallel: bool | None = None,
    layer_counts=None,
    drop_layers=frozenset(),
    hardware="h100",
    facts=None,
    memory: bool = True,
    split_backward: bool = False,
    hand_recomputed: bool = False,
) -> Estimate:
    """Memory and step time of (model, schedule, policy, shape) on a hardware profile: the one
    prediction the planner, the profiler, the recovery planner and the benchmarks share.

    ``memory=False`` skips the ledger (time only): for schedules one SPMD program cannot run, such as
    a rerouted pipeline where one rank holds an extra stage. ``split_backward``: the pipeline's; where
    it takes effect (a schedule with I and W: :func:`splits_backward`) the ledger
    holds the I->W cotangents and W costs half a backward, otherwise W runs the whole pullback again
    (:func:`step_costs`). ``hand_recomputed`` (with the split): I hands W the forward values it
    recomputed too; the ledger holds them from I to W, and W recomputes nothing. ``context``: devices
    holding part of every sequence (:func:`predict` and :func:`step_costs` say how each prices it);
    ``seq`` is the whole sequence.

    >>> from jaxmem.schedule import generate
    >>> e = estimate("tiny", generate("1f1b", 4, 8), "selective", batch=32, seq=64)
    >>> e.device_bytes > 0 and e.step_seconds > 0
    True
    """
    from jaxmem.memory._facts import model_facts
    from jaxmem.memory._ledger import master_cut, policy_offloads, predict, uses_vocab_split
    from jaxmem.models import get_model
    from jaxmem.pipeline import model_layer_counts, splits_backward
    from jaxmem.policy import resolve

    model = get_model(model)
    facts = facts or model_facts(model, context=context)
    hardware = get_hardware(hardware)
    local_seq = seq
    if context > 1:
        from jaxmem.models import context_order

        context_order(seq, context)  # refuses a length that does not split into 2 x context chunks
        local_seq = seq // context
    counts = model_layer_counts(model, schedule.num_stages, layer_counts)
    resolved = resolve(policy, schedule, model.tags)  # once; the ledger and the costs share it
    ledger = None
    if memory:
        ledger = predict(
            model,
            schedule,
            resolved,
            batch=batch,
            seq=seq,
            data_parallel=data_parallel,
            fsdp=fsdp,
            tensor=tensor,
            context=context,
            zero=zero,
            vocab_parallel=vocab_parallel,
            layer_counts=counts,
            drop_layers=drop_layers,
            split_backward=split_backward,
            hand_recomputed=hand_recomputed,
            facts=facts,
        )
    vocab = uses_vocab_split(model, schedule.num_ranks, vocab_parallel)
    sizes = {"data": data_parallel, "fsdp": fsdp, "tensor": tensor, "zero": zero, "vocab": vocab}
    cut = master_cut(
        facts.static_bytes(
            schedule.num_ranks, facts.stage_rows(counts), schedule.num_stages // schedule.num_ranks, **sizes
        ),
        zero=zero,
        data=data_parallel,
        fsdp=fsdp,
        offloads=policy_offloads(resolved, schedule),
    )
    replicas = data_parallel * fsdp
    mb = batch // (replicas * schedule.num_microbatches)
    active = _active_counts(counts, drop_layers)
    costs = step_costs(
        model,
        schedule,
        resolved,
        active,
        microbatch=mb,
        seq=local_seq,
        hardware=hardware,
        facts=facts,
        vocab=vocab,
        data_parallel=data_parallel,
        fsdp=fsdp,
        tensor=tensor,
        context=context,
        master_cut=cut,
        families=facts.stage_families(counts, drop_layers) if facts.families is not None else None,
        split_backward=splits_backward(schedule, split_backward),
        hand_recomputed=hand_recomputed,
    )
    simulation = simulate(schedule, costs)
    transfers = state_transfer_seconds(
        model,
        schedule,
        resolved,
        counts,
        hardware,
        facts=facts,
        data_parallel=data_parallel,
        fsdp=fsdp,
        tensor=tensor,
        zero=zero,
    )
    compute = simulation.makespan
    if hardware.cores:  # the CPU runs the lockstep executor, its devices sharing the cores
        compute = hardware.oversubscribed * shared_core_step_seconds(
            schedule,
            costs,
            replicas * tensor * context,
            hardware.cores,
            hardware.flops_per_second,
            hardware.lockstep,
            processes=hardware.processes,
            pooled=bool(hardware.processes)
            and schedule.num_ranks * replicas * tensor * context < hardware.cores * hardware.processes,
        )
    sync = gradient_sync_seconds(
        facts,
        schedule,
        counts,
        hardware,
        data_parallel=data_parallel,
        fsdp=fsdp,
        tensor=tensor,
        context=context,
        vocab=vocab,
        master_cut=cut,
    )
    sync += kept_gather_seconds(
        facts, schedule, resolved, counts, hardware, fsdp=fsdp, tensor=tensor, master_cut=cut, context=context
    )
    step = compute + transfers + sync
    return Estimate(ledger, costs, simulation, step, transfers, batch * seq / step, sync)


def shared_core_terms(schedule: Schedule, costs: Costs, data_parallel: int, cores: int) -> tuple[int, float, float]:
    """The lockstep model's three terms for ``schedule.num_ranks * data_parallel`` devices on
    ``cores`` cores: ``(ticks, even, excess)`` -- the number of ticks that end in an exchange between
    pipe ranks, the sum over ticks of their busy ranks' work spread over the cores, and the sum of each
    tick's longest-action excess over that even share (seconds, from ``costs``). With one pipe rank no
    tick exchanges anything: each device runs its actions back to back, with no barrier between them
    (the tiny GPT on one process: data 2 x pipe 1 steps in 0.117 s, pipe 2 in 0.208 s; a fixed cost
    per tick at pipe 1 put the first 25% over)."""
    from jaxmem.schedule import lockstep_ticks

    per_tick: dict[int, list[float]] = {}
    for action, tick in lockstep_ticks(schedule).items():
        per_tick.setdefault(tick, []).append(costs.duration(action, schedule))
    even = excess = 0.0
    for works in per_tick.values():
        share = sum(works) * data_parallel / cores
        even += share
        excess += max(max(works) - share, 0.0)
    return (len(per_tick) if schedule.num_ranks > 1 else 0), even, excess


def shared_core_step_seconds(
    schedule: Schedule,
    costs: Costs,
    data_parallel: int,
    cores: int,
    rate: float,
    constants: Lockstep = CPU_LOCKSTEP,
    processes: int | None = None,
    pooled: bool = False,
) -> float:
    """Seconds of one step when ``schedule.num_ranks * data_parallel`` devices share ``cores`` CPU
    cores: the lockstep sum of the module docstring (``rate``: FLOP/s, to price the fixed costs), with
    the constants' process terms when the devices span ``processes`` > 1 (``pooled``: each process
    has fewer devices than cores, :attr:`Lockstep.pooled_imbalance`)."""
    ticks, even, excess = shared_core_terms(schedule, costs, data_parallel, cores)
    return constants.fixed_flops(ticks, processes) / rate + even + constants.excess_weight(pooled) * excess


def _active_counts(counts, drop_layers) -> list[int]:
    """Layers each stage runs when ``drop_layers`` (global indices) are skipped."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [c - sum(1 for i in range(starts[s], starts[s] + c) if i in drop_layers) for s, c in enumerate(counts)]


_CALIBRATED: dict[str, Hardware] = {}


def calibrate_cpu(steps: int = 5) -> Hardware:
    """Measure this machine: time the tiny GPT's jitted forward+backward on one CPU device and divide
    its FLOPs (``cost_analysis()`` of the traced stage, as for any model) by the median step time.
    Cached per process."""
    if "cpu" in _CALIBRATED:
        return _CALIBRATED["cpu"]
    import time

    import jax
    import numpy as np

    from jaxmem.memory._facts import model_facts
    from jaxmem.models import get_model, make_batch

    model = get_model("tiny")
    params = model.init(0)
    size, seq = 32, model.max_seq_len
    tokens = np.zeros((size, seq), np.int32)
    batch = make_batch(tokens, tokens)
    fn = jax.jit(jax.value_and_grad(model.plain_loss))
    jax.block_until_ready(fn(params, batch))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, batch))
        times.append(time.perf_counter() - start)
    whole = model_facts(model, analytic=False).whole(size, seq)
    rate = (whole.forward_flops + whole.backward_flops) / float(np.median(times))
    hw = dataclasses.replace(
        HARDWARE["cpu"],
        peak_flops=rate,
        efficiency=1.0,
        cores=cpu_cores(),
        note=f"measured here: tiny GPT fwd+bwd, {rate / 1e9:.2f} GFLOP/s achieved on {cpu_cores()} core(s); "
        "host link nominal",
    )
    _CALIBRATED["cpu"] = hw
    return hw
