"""Time costs of a pipelined step: FLOPs per stage, recompute added to backwards, host transfers.

A hardware profile turns FLOPs into seconds (peak FLOP/s x an achieved fraction) and bytes into
transfer seconds (host link bandwidth). Figures of the cluster profiles are vendors' published peaks
(dense bf16) with an assumed 50% achieved fraction; the ``cpu`` profile is calibrated from a measured
step of the tiny model on this machine (``calibrate_cpu``). All simulated times are predictions.
"""

from __future__ import annotations

import dataclasses

from jaxmem._errors import JaxmemError
from jaxmem.memory._model import forward_flops, stage_counts, stage_residual_bytes
from jaxmem.schedule import Action, Costs, Kind, Schedule, SimulationResult, simulate

__all__ = [
    "HARDWARE",
    "Hardware",
    "calibrate_cpu",
    "get_hardware",
    "simulate_step",
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
        note: where the figures come from.
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    host_bandwidth: float
    efficiency: float = 0.5
    note: str = ""

    @property
    def flops_per_second(self) -> float:
        return self.peak_flops * self.efficiency

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        peak_flops=989e12,
        hbm_bytes=80e9,
        host_bandwidth=55e9,
        note="H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3, PCIe Gen5 x16 host link (~55 GB/s achieved); "
        "50% of peak assumed",
    ),
    "tpu-v5p": Hardware(
        name="tpu-v5p",
        peak_flops=459e12,
        hbm_bytes=95e9,
        host_bandwidth=50e9,
        note="TPU v5p chip: 459 TFLOP/s bf16, 95 GB HBM2e; host link assumed 50 GB/s; 50% of peak assumed",
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
    """A profile by name; ``cpu`` is calibrated on this machine (see :func:`calibrate_cpu`)."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    if key == "cpu":
        return calibrate_cpu()
    if key not in HARDWARE:
        raise JaxmemError(f"unknown hardware profile {name!r}; profiles: {', '.join(HARDWARE)}")
    return HARDWARE[key]


def step_costs(
    config, schedule: Schedule, resolved, layer_counts, *, microbatch: int, seq: int, hardware: Hardware
) -> Costs:
    """Costs for :func:`jaxmem.schedule.simulate`, in seconds on ``hardware``.

    F of stage s costs its forward FLOPs; B twice that (I and W once each); the policy's recompute
    FLOPs are added to B, and to both I and W (each re-runs what it needs from the saved values). The
    policy's host-resident stash bytes are offloaded after F and prefetched before the backward.
    """
    rate = hardware.flops_per_second
    forward_seconds = [
        forward_flops(config, layers=layer_counts[s], last=s == schedule.num_stages - 1, seq=seq) * microbatch / rate
        for s in range(schedule.num_stages)
    ]
    cache: dict = {}

    def cell(stage: int, mb: int):
        sp = resolved.stage_policy(stage, mb)
        key = (stage, sp)
        if key not in cache:
            count = stage_counts(
                config,
                layers=layer_counts[stage],
                first=stage == 0,
                last=stage == schedule.num_stages - 1,
                seq=seq,
                policy=sp,
            )
            device, host = stage_residual_bytes(
                config,
                layers=layer_counts[stage],
                first=stage == 0,
                last=stage == schedule.num_stages - 1,
                microbatch=microbatch,
                seq=seq,
                policy=sp,
            )
            cache[key] = (count.recompute_flops * microbatch / rate, device, host)
        return cache[key]

    def extra(action: Action) -> float:
        if action.kind is Kind.F:
            return 0.0
        return cell(action.stage, action.microbatch)[0]

    any_host = any(
        resolved.stage_policy(s, m).offload or resolved.stage_policy(s, m).offload_stash
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
    )
    return Costs(
        f=1.0,
        i=1.0,
        w=1.0,
        stage_weights=tuple(forward_seconds),
        extra=extra,
        activation_fn=lambda s, m: cell(s, m)[1] + cell(s, m)[2],
        offload_fn=(lambda s, m: cell(s, m)[2]) if any_host else None,
        host_bandwidth=hardware.host_bandwidth if any_host else None,
    )


def simulate_step(
    config, schedule: Schedule, policy, layer_counts, *, microbatch: int, seq: int, hardware: Hardware | str = "h100"
) -> SimulationResult:
    """Simulate one step of the schedule under a policy on a hardware profile."""
    from jaxmem.policy import from_spec

    resolved = from_spec(policy).resolve(schedule)
    costs = step_costs(
        config, schedule, resolved, layer_counts, microbatch=microbatch, seq=seq, hardware=get_hardware(hardware)
    )
    return simulate(schedule, costs)


def state_transfer_seconds(
    config, schedule: Schedule, resolved, layer_counts, hardware: Hardware, optimizer_moments: int = 2
) -> float:
    """Per step and rank, host-link time for offloaded weights (fetched, written back after the update)
    and optimizer state (read and written by the update). Charged in full, as if nothing overlapped
    it (an upper bound; the Chronos-Offload planner places these transfers)."""
    import numpy as np

    from jaxmem.memory._model import param_counts

    block_elems, _ = param_counts(config)
    itemsize = np.dtype(config.dtype).itemsize
    stage_bytes = max(max(layer_counts), 1) * block_elems * itemsize
    seconds = 0.0
    for stage in schedule.stages_of(0):
        if resolved.offload_weights(stage):
            seconds += 2 * stage_bytes / hardware.host_bandwidth
        if resolved.offload_optimizer_state(stage):
            seconds += 2 * optimizer_moments * stage_bytes / hardware.host_bandwidth
    return seconds


_CALIBRATED: dict[str, Hardware] = {}


def calibrate_cpu(steps: int = 5) -> Hardware:
    """Measure this machine: time the tiny GPT's jitted forward+backward on one CPU device and divide
    its matmul FLOPs by the median step time. Cached per process."""
    if "cpu" in _CALIBRATED:
        return _CALIBRATED["cpu"]
    import time

    import jax
    import numpy as np
    from flax import nnx

    from jaxmem.memory._model import forward_flops
    from jaxmem.models import GPT, get_config

    config = get_config("tiny")
    model = GPT(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model))
    batch, seq = 32, config.max_seq_len
    tokens = np.zeros((batch, seq), np.int32)
    fn = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(tokens, tokens)))
    jax.block_until_ready(fn(params))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(params))
        times.append(time.perf_counter() - start)
    flops = 3 * forward_flops(config, layers=config.n_layers, last=True, seq=seq) * batch
    rate = flops / float(np.median(times))
    hw = dataclasses.replace(
        HARDWARE["cpu"],
        peak_flops=rate,
        efficiency=1.0,
        note=f"measured here: tiny GPT fwd+bwd, {rate / 1e9:.2f} GFLOP/s achieved; host link nominal",
    )
    _CALIBRATED["cpu"] = hw
    return hw
