"""The memory ledger: per rank and category, bytes on device and on host -- predicted by the analytical
model, read from the program (jaxpr residuals, array memory kinds, ``memory_analysis()``), and their
difference.

Categories: ``params``, ``grads`` (the step's accumulators), ``optimizer_state``, ``stash`` (residuals
kept from F to B, device and host), ``transient`` (message buffers, batch, and the working set of
one tick). Every rank of one SPMD program allocates the same buffers, so ``device_bytes`` is what each
rank allocates; ``live_stash_bytes`` is what the rank's own schedule needs at its peak.

On CPU, XLA does not lower host offload: buffers a policy places on host are still counted in the
compiled ``temp`` size. Offload is therefore proved structurally (host memory space on the residuals
and buffers, ``pinned_host`` memory kind on kept arrays) and its device saving is *predicted*.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem.memory._model import BACKWARD_WORKSET, RECOMPUTE_WORKSET, param_counts, stage_residual_bytes
from jaxmem.policy import PRESETS, from_spec

__all__ = ["CATEGORIES", "Bytes", "Ledger", "RankLedger", "compare", "measure", "predict"]

CATEGORIES = ("params", "grads", "optimizer_state", "stash", "transient")


@dataclasses.dataclass(frozen=True)
class Bytes:
    device: float = 0.0
    host: float = 0.0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.device + other.device, self.host + other.host)

    def to_json(self) -> dict:
        return {"device": int(round(self.device)), "host": int(round(self.host))}


@dataclasses.dataclass(frozen=True)
class RankLedger:
    rank: int
    categories: dict  # name -> Bytes
    live_stash_bytes: float = 0.0

    @property
    def device_bytes(self) -> float:
        return sum(b.device for b in self.categories.values())

    @property
    def host_bytes(self) -> float:
        return sum(b.host for b in self.categories.values())


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Bytes per rank and category from one source: ``predicted`` (analytical) or ``compiled``."""

    source: str
    ranks: tuple[RankLedger, ...]
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def max_device_bytes(self) -> float:
        return max(r.device_bytes for r in self.ranks)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            **self.meta,
            "ranks": [
                {
                    "rank": r.rank,
                    "device_bytes": int(round(r.device_bytes)),
                    "host_bytes": int(round(r.host_bytes)),
                    "live_stash_bytes": int(round(r.live_stash_bytes)),
                    "categories": {k: v.to_json() for k, v in r.categories.items()},
                }
                for r in self.ranks
            ],
        }


def _setup(config, schedule, policy, batch, seq, data_parallel, layer_counts, drop_layers=frozenset()):
    from jaxmem.pipeline._split import split_layers
    from jaxmem.pipeline._ticks import cell_classes

    resolved = from_spec(policy).resolve(schedule)
    counts = split_layers(config.n_layers, schedule.num_stages, layer_counts)
    M = schedule.num_microbatches
    if batch % (data_parallel * M):
        from jaxmem._errors import JaxmemError

        raise JaxmemError(f"batch {batch} is not divisible by data-parallel ({data_parallel}) x microbatches ({M})")
    mb = batch // (data_parallel * M)
    return resolved, counts, mb, cell_classes(schedule, counts, resolved, drop_layers)


def predict(
    config,
    schedule,
    policy=None,
    *,
    batch: int,
    seq: int,
    data_parallel: int = 1,
    layer_counts=None,
    optimizer_moments: int = 2,
    drop_layers=frozenset(),
) -> Ledger:
    """The analytical ledger: no tracing, no compiling.

    Args:
        config: the model (GPTConfig).
        schedule: any valid schedule.
        policy: a policy spec (save-all when None).
        batch, seq: global batch (sequences) and sequence length.
        data_parallel: data-parallel replicas.
        layer_counts: layers per stage (balanced when None).
        optimizer_moments: optimizer state per parameter, in parameter-sized arrays (Adam: 2).
        drop_layers: global indices of layers skipped this step (layer drop).
    """
    from jaxmem.pipeline._ticks import build_tick_program

    resolved, counts, mb, cells = _setup(config, schedule, policy, batch, seq, data_parallel, layer_counts, drop_layers)
    itemsize = np.dtype(config.dtype).itemsize
    block_elems, shared_elems = param_counts(config)
    virtual = schedule.num_stages // schedule.num_ranks
    max_layers = max(max(counts), 1)
    stage_bytes = max_layers * block_elems * itemsize  # per local stage, padded to the most loaded stage
    shared_bytes = shared_elems * itemsize
    weights_host = [resolved.offload_weights(schedule.stages_of(0)[v]) for v in range(virtual)]
    opt_host = [resolved.offload_optimizer_state(schedule.stages_of(0)[v]) for v in range(virtual)]

    params = Bytes(shared_bytes, 0) + Bytes(
        sum(stage_bytes for v in range(virtual) if not weights_host[v]),
        sum(stage_bytes for v in range(virtual) if weights_host[v]),
    )
    grads = Bytes(shared_bytes + virtual * stage_bytes, 0)
    k = optimizer_moments
    optimizer = Bytes(k * shared_bytes, 0) + Bytes(
        sum(k * stage_bytes for v in range(virtual) if not opt_host[v]),
        sum(k * stage_bytes for v in range(virtual) if opt_host[v]),
    )

    # Stash: per class, one microbatch's residuals on device / host; buffers and slots as the executor.
    class_sizes, full_volume, recomputed = {}, 0.0, 0.0
    for c in dict.fromkeys(cells.values()):
        sp = resolved.variants[c.variant]
        dev, host = stage_residual_bytes(
            config, layers=c.layers - len(c.skip), first=c.first, last=c.last, microbatch=mb, seq=seq, policy=sp
        )
        dtype = np.dtype(config.dtype).name
        class_sizes[c] = {k: v // itemsize for k, v in (((dtype, "device"), dev), ((dtype, "host"), host)) if v}
        full, _ = stage_residual_bytes(
            config,
            layers=c.layers - len(c.skip),
            first=c.first,
            last=c.last,
            microbatch=mb,
            seq=seq,
            policy=PRESETS["save-all"],
        )
        full_volume = max(full_volume, full)
        recomputed = max(recomputed, full - dev - host)
    tick = build_tick_program(schedule, cells, class_sizes)
    stash_dev, stash_host, live = _arena_bytes(tick)
    slot_out = sum(w * np.dtype(k[0]).itemsize for k, w in zip(tick.stash_keys, tick.window))
    message = mb * seq * config.d_model * itemsize
    messages = (tick.act_slots + 1 + tick.grad_slots + 1) * message
    inputs = 2 * (batch // data_parallel) * seq * 4
    transient = messages + inputs + slot_out + BACKWARD_WORKSET * full_volume + RECOMPUTE_WORKSET * recomputed
    ranks = _rank_ledgers(schedule.num_ranks, params, grads, optimizer, Bytes(stash_dev, stash_host), transient, live)
    return Ledger("predicted", ranks, _meta(config, schedule, resolved, batch, seq, data_parallel, mb))


def _rank_ledgers(num_ranks, params, grads, optimizer, stash, transient, live) -> tuple[RankLedger, ...]:
    """Every rank allocates the same buffers (one SPMD program); only its live stash differs."""
    categories = {
        "params": params,
        "grads": grads,
        "optimizer_state": optimizer,
        "stash": stash,
        "transient": Bytes(transient, 0),
    }
    return tuple(RankLedger(rank=r, categories=dict(categories), live_stash_bytes=live[r]) for r in range(num_ranks))


def _arena_bytes(tick) -> tuple[float, float, list[float]]:
    """(device, host) bytes of the stash arenas every rank allocates, and each rank's own need."""
    device = host = 0.0
    live = [0.0] * len(tick.rank_arena_elems[0]) if tick.rank_arena_elems else []
    for key, length, per_rank in zip(tick.stash_keys, tick.arena_elems, tick.rank_arena_elems):
        itemsize = np.dtype(key[0]).itemsize
        if key[1] == "host":
            host += length * itemsize
        else:
            device += length * itemsize
        for r, n in enumerate(per_rank):
            live[r] += n * itemsize
    return device, host, live


def _meta(config, schedule, resolved, batch, seq, data_parallel, mb) -> dict:
    return {
        "schedule": schedule.name,
        "ranks_count": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "policy": resolved.policy.name,
        "batch_size": batch,
        "seq_len": seq,
        "microbatch_size": mb,
        "data_parallel": data_parallel,
        "model_layers": config.n_layers,
        "d_model": config.d_model,
    }


def _array_bytes(tree) -> Bytes:
    """Per-device bytes of arrays (or abstract arrays with shardings), split by memory kind."""
    import jax

    total = Bytes()
    for leaf in jax.tree.leaves(tree):
        sharding = leaf.sharding
        shard_shape = sharding.shard_shape(leaf.shape)
        size = int(np.prod(shard_shape)) * np.dtype(leaf.dtype).itemsize
        on_host = "host" in str(getattr(sharding, "memory_kind", None) or "")
        total = total + (Bytes(0, size) if on_host else Bytes(size, 0))
    return total


def measure(trainer, state=None, compiled=None) -> Ledger:
    """The ledger read from the program: stash from the jaxpr residuals and the tick program, params and
    optimizer state from the kept arrays' shardings and memory kinds, totals from ``memory_analysis()``
    of the compiled train step; ``transient`` is what the compiled total leaves for the rest."""
    import jax

    pipeline = trainer.pipeline
    config, schedule = trainer.model_config, trainer.schedule
    batch, seq = trainer.config.batch_size, trainer.config.seq_len
    state = state or trainer.init_state()
    compiled = compiled or trainer.lower(state).compile()
    analysis = compiled.memory_analysis()
    tick, plans = pipeline.program(batch, seq)
    params = _array_bytes(state.params)
    optimizer = _array_bytes(state.opt_state)
    grads = Bytes(sum(b for b in (params.device, params.host)), 0)
    stash_dev, stash_host, live = _arena_bytes(tick)
    total_device = (
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    host_reported = (
        analysis.host_argument_size_in_bytes
        + analysis.host_temp_size_in_bytes
        + analysis.host_output_size_in_bytes
        - analysis.host_alias_size_in_bytes
    )
    platform = jax.devices()[0].platform
    # XLA:CPU keeps host-space buffers among the device temp and host-kind arrays among the arguments.
    cpu_host_counted = (stash_host + params.host + optimizer.host) if platform == "cpu" else 0.0
    accounted = params.device + optimizer.device + grads.device + stash_dev + cpu_host_counted
    transient = total_device - accounted
    ranks = _rank_ledgers(schedule.num_ranks, params, grads, optimizer, Bytes(stash_dev, stash_host), transient, live)
    mb = batch // (trainer.config.data_parallel * schedule.num_microbatches)
    meta = _meta(config, schedule, pipeline.policy, batch, seq, trainer.config.data_parallel, mb)
    meta.update(
        {
            "platform": platform,
            "memory_analysis": {
                "argument_bytes": analysis.argument_size_in_bytes,
                "output_bytes": analysis.output_size_in_bytes,
                "alias_bytes": analysis.alias_size_in_bytes,
                "temp_bytes": analysis.temp_size_in_bytes,
                "host_bytes": host_reported,
            },
            "compiled_device_bytes": total_device,
            "host_space_counted_as_device_on_cpu": cpu_host_counted,
        }
    )
    return Ledger("compiled", ranks, meta)


def compare(predicted: Ledger, compiled: Ledger) -> dict:
    """Side by side per rank: predicted vs program bytes, by category, and the relative error of the
    device total (predicted device + host-space bytes XLA:CPU counts as device, vs compiled)."""
    cpu_extra = compiled.meta.get("host_space_counted_as_device_on_cpu", 0.0)
    compiled_total = compiled.meta["compiled_device_bytes"]
    rows = []
    for p, c in zip(predicted.ranks, compiled.ranks):
        categories = {}
        for name in CATEGORIES:
            pb, cb = p.categories[name], c.categories[name]
            categories[name] = {
                "predicted_device": int(round(pb.device)),
                "predicted_host": int(round(pb.host)),
                "program_device": int(round(cb.device)),
                "program_host": int(round(cb.host)),
            }
        comparable = p.device_bytes + cpu_extra
        rows.append(
            {
                "rank": p.rank,
                "predicted_device_bytes": int(round(p.device_bytes)),
                "predicted_host_bytes": int(round(p.host_bytes)),
                "compiled_device_bytes": int(compiled_total),
                "compiled_host_bytes": int(round(c.host_bytes)),
                "prediction_error": (comparable - compiled_total) / compiled_total,
                "live_stash_bytes": int(round(p.live_stash_bytes)),
                "categories": categories,
            }
        )
    return {
        "policy": predicted.meta["policy"],
        "schedule": predicted.meta["schedule"],
        "meta": {k: v for k, v in compiled.meta.items() if k not in ("policy", "schedule")},
        "ranks": rows,
        "max_prediction_error": max(abs(r["prediction_error"]) for r in rows),
        "notes": [
            "predicted = analytical model (no compile); compiled = memory_analysis() of the jitted train step",
            "every rank of one SPMD program allocates the same buffers; live_stash_bytes is the rank's own peak need",
        ]
        + (
            [
                f"on {compiled.meta['platform']}, {int(cpu_extra)} bytes the policy places on host are counted as "
                "device by XLA:CPU (host offload is not lowered on CPU); the predicted device figure excludes "
                "them, the error adds them back"
            ]
            if cpu_extra
            else []
        ),
    }
