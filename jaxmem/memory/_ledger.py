"""The memory ledger: per rank and category, bytes on device and on host -- predicted by the analytical
model, read from the program (jaxpr residuals, array memory kinds, ``memory_analysis()``), and their
difference.

Categories: ``params``, ``grads`` (the step's accumulators), ``optimizer_state``, ``stash`` (residuals
kept from F to B, device and host), ``transient`` (message buffers, batch, and the working set of
one tick). Every rank of one SPMD program allocates the same buffers, so ``device_bytes`` is what each
rank allocates; ``live_stash_bytes`` is what the rank's own schedule needs at its peak. Predictions
come from the model's facts (traced residual plans and ``cost_analysis()``, or the GPT's closed form),
so the ledger works for any :class:`~jaxmem.models.StagedModel`; the backward's working set is read from
one stage's pullback compiled alone (:class:`~jaxmem.memory.StageFacts`), on the backend at hand.

On CPU, XLA does not lower host offload: buffers a policy places on host are still counted in the
compiled ``temp`` size. Offload is therefore proved structurally (host memory space on the residuals
and buffers, ``pinned_host`` memory kind on kept arrays) and its device saving is *predicted*.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxmem._util import compiled_bytes
from jaxmem.policy import resolve

__all__ = [
    "CATEGORIES",
    "Bytes",
    "Ledger",
    "RankLedger",
    "compare",
    "compiled_bytes",
    "host_bytes_counted_as_device",
    "measure",
    "predict",
]

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


def predict(
    model,
    schedule,
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
    optimizer_moments: int = 2,
    drop_layers=frozenset(),
    facts=None,
    split_backward: bool = False,
    hand_recomputed: bool = False,
    target=None,
) -> Ledger:
    """The predicted ledger: traced or closed-form facts (:mod:`jaxmem.memory._facts`); the one compile
    is of a stage's backward, for its working set.

    Args:
        model: a StagedModel, preset name or config.
        schedule: any valid schedule.
        policy: a policy spec (save-all when None), or a ResolvedPolicy for this schedule.
        batch, seq: global batch (sequences) and sequence length.
        data_parallel: data-parallel replicas holding whole parameters.
        fsdp: data-parallel replicas holding a shard of each parameter (FSDP).
        tensor: devices cutting the dimensions the model's annotations name. The parameters, their
            gradients and optimizer state are counted as cut; the stash arenas take 1/tensor of
            their bytes (the executor keeps a cut residual's shares and a share of the rest); the
            backward's working set is compiled on a tensor mesh of local devices
            (:meth:`~jaxmem.memory.ModelFacts.tensor_working`), or where there are too few its cut
            part (:meth:`~jaxmem.memory.ModelFacts.tensor_cut`) shrinks by 1/tensor; a backward
            gathers its item's whole part.
        context: devices holding part of every sequence (:mod:`jaxmem.models._context`): the
            activations, messages and stash are of ``seq / context`` tokens a sequence, the stage
            traced and its backward compiled with the keys and values of the whole sequence gathered
            (a stand-in of the axis, :class:`~jaxmem.memory.ModelFacts` with ``context``); the
            parameters are whole on each of its devices, the optimizer state cut over them with ZeRO.
        zero: the optimizer state is sharded over the replicas (ZeRO).
        vocab_parallel: the vocabulary tables are split over the pipe ranks (default: as the
            :class:`~jaxmem.pipeline.Pipeline` does, when the model says where they are and P > 1).
        layer_counts: layers per stage (balanced when None).
        optimizer_moments: optimizer state per parameter, in parameter-sized arrays (Adam: 2).
        drop_layers: global indices of layers skipped this step (layer drop).
        facts: the model's facts (default: :func:`model_facts`, cached).
        split_backward: W takes I's cotangents (``Pipeline(split_backward=True)``): they are kept from
            I to W, and the backward's working set is the larger of I's and W's.
        hand_recomputed: with the split, I also hands W the forward values it recomputed
            (``Pipeline(hand_recomputed=True)``): they are kept from I to W as well.
        target: the :class:`~jaxmem.targets.Target` (or its name, e.g. ``"tpu-v5e"``) whose compiler
            the working sets and layouts come from, when ``facts`` are not given (None: the devices
            at hand).
    """
    from jaxmem._errors import JaxmemError
    from jaxmem.memory._facts import model_facts
    from jaxmem.models import get_model
    from jaxmem.pipeline import cell_classes, model_layer_counts, splits_backward, stash_rows

    model = get_model(model)
    facts = facts or model_facts(model, target=target, context=context)
    if facts.context != context:
        raise JaxmemError(f"the facts given are of a context axis of {facts.context}, not {context}")
    resolved = resolve(policy, schedule, model.tags)
    whole_seq = seq
    if context > 1:
        from jaxmem.models import context_order

        context_order(seq, context)  # refuses a length that does not split into 2 x context chunks
        seq //= context  # what each device holds of a sequence
    counts = model_layer_counts(model, schedule.num_stages, layer_counts)
    M = schedule.num_microbatches
    replicas = data_parallel * fsdp
    if batch % (replicas * M):
        raise JaxmemError(f"batch {batch} is not divisible by replicas ({replicas}) x microbatches ({M})")
    mb = batch // (replicas * M)
    cells = cell_classes(schedule, counts, resolved, drop_layers, model.layer_kinds, model.layer_families)
    virtual = schedule.num_stages // schedule.num_ranks
    weights_host = [resolved.offload_weights(schedule.stages_of(0)[v]) for v in range(virtual)]
    opt_host = [resolved.offload_optimizer_state(schedule.stages_of(0)[v]) for v in range(virtual)]
    vocab = uses_vocab_split(model, schedule.num_ranks, vocab_parallel)
    static_kwargs = dict(data=data_parallel, fsdp=fsdp, tensor=tensor, zero=zero, vocab=vocab)
    static = facts.static_bytes(schedule.num_ranks, facts.stage_rows(counts), virtual, **static_kwargs)

    def split(per_stage, shared, on_host) -> Bytes:
        host = sum(b for b, h in zip(per_stage, on_host) if h)
        return Bytes(sum(per_stage) - host + shared, host)

    params = split(static.stage_params, static.shared_params, weights_host)
    cut = master_cut(static, zero=zero, data=data_parallel, fsdp=fsdp, offloads=policy_offloads(resolved, schedule))
    if cut:
        # The master weights cut like one optimizer array, and the copy the stages read.
        params = Bytes(sum(static.stage_state) + static.shared_state + sum(static.stage_copy) + static.shared_copy, 0)
    grads = Bytes(sum(static.stage_params) + static.shared_params, 0)  # the step's accumulators
    # FSDP stages whose policy keeps them gathered hold their whole weights and gradient all step.
    kept = sum(resolved.keep_gathered(s) for s in schedule.stages_of(0)) if fsdp > 1 else 0
    params += Bytes(kept * (static.stage_gathered_copy if cut else static.stage_gathered), 0)
    grads += Bytes(kept * static.stage_gathered, 0)
    k = optimizer_moments
    optimizer = split([k * b for b in static.stage_state], k * static.shared_state, opt_host)

    # Stash: per class, one microbatch's residuals per buffer; buffers and slots as the executor's.
    # Split backwards (zero-bubble schedules) also keep what each I hands its W (cut over tensor, as the stash).
    splits = splits_backward(schedule, split_backward)
    hand = splits and bool(hand_recomputed)
    class_sizes, class_transfers, working, item, host_item = {}, {}, 0.0, 0.0, 0.0
    for c in dict.fromkeys(cells.values()):
        variant = resolved.variants[c.variant]
        families = tuple(f for i, f in enumerate(c.families) if i not in c.skip) if c.families else None
        shape = dict(
            first=c.first,
            last=c.last,
            layers=c.layers - len(c.skip),
            policy=variant,
            seq=seq,
            vocab=vocab,
            families=families,
        )
        stage = facts.stage(**shape, microbatch=mb)
        class_sizes[c] = stash_rows(stage.stash_elems, tensor)
        transfer_elems = facts.transfer_elems(**shape, microbatch=mb, hand_recomputed=hand) if splits else {}
        class_transfers[c] = stash_rows(transfer_elems, tensor)
        # The backward's working set, read from the program: the temporaries of the stage's
        # pullback compiled alone (the largest over the classes). With a tensor axis it is compiled
        # on a tensor mesh where this process has the devices; elsewhere the cut part of the
        # activations (recomputed cut) is modelled as taking 1/tensor of its bytes on each device.
        # A backward gathers its item's whole part.
        part = facts.tensor_cut(variant, seq, tensor)
        own = facts.tensor_working(**shape, microbatch=mb, tensor=tensor)
        if splits:  # I and W each compiled alone: the larger (with a tensor axis, its cut part modelled)
            own = facts.split_working(**shape, microbatch=mb, hand_recomputed=hand)
            if own is not None:
                own *= 1 - part.full * (1 - 1 / tensor)
        if own is None:  # whole-stage compile, its cut part modelled
            own = stage.working_bytes * (1 - part.full * (1 - 1 / tensor))
        working = max(working, own)
        item = max(item, stage.stash_bytes("device") * (1 - part.stash))
        host_item = max(host_item, stage.stash_bytes("host"))
    # The layout's cache key, compact: the distinct classes with their sizes, and each cell's class index.
    classes = tuple(class_sizes)
    index = {c: i for i, c in enumerate(classes)}
    assignment = tuple(index[cells[key]] for key in sorted(cells))
    sizes = tuple(tuple(sorted(class_sizes[c].items())) for c in classes)
    transfers = tuple(tuple(sorted(class_transfers[c].items())) for c in classes)
    stash_dev, stash_host, live, act_slots, grad_slots, largest_arena = _stash_layout(
        schedule, classes, sizes, assignment, vocab, transfers
    )
    messages = (act_slots + 1 + grad_slots + 1) * facts.message_bytes(mb, seq)
    inputs = facts.tree_nbytes({k: v for k, v in facts.batch(batch // replicas, seq).items() if k != "rng"})
    # What the transient is made of, for the ledger's readers (meta["transient_terms"]).
    terms = {"messages": messages, "inputs": inputs, "backward_working_set": working}
    if facts.platform == "cpu":
        # Beside it, the step's gradient accumulators leave the executor's cond updated while the old
        # ones are still live (XLA:CPU), and every rank's slice of the head's logits and their
        # gradient are held in the same tick as its stage action.
        terms["accumulators_updated"] = grads.device
        working += grads.device
        if vocab:
            terms["vocabulary_slice"] = facts.vocab_transient(mb, seq, schedule.num_ranks)
            working += terms["vocabulary_slice"]
    else:
        # An accelerator's compiler adds a backward's gradients into the accumulators in place: beside
        # the working set it holds that backward's gradients of one stage, in the master weights'
        # dtype, until they are added. The vocabulary slice's logits come after the stage's action
        # in the tick (jaxmem.pipeline._vocab), when its temporaries are dead: the larger of the two.
        terms["stage_gradients"] = max(static.stage_params)
        working += terms["stage_gradients"]
        if vocab:
            terms["vocabulary_slice"] = facts.vocab_transient(mb, seq, schedule.num_ranks)
            working = max(working, terms["vocabulary_slice"])
    if context > 1:
        # The attention mask of a device's queries against the gathered keys: one [seq, seq x context]
        # array whatever the microbatch (the working sets are compiled per sequence, which splits it
        # between the sequences of their microbatch); on a GPU cuDNN takes it as a bias in 16 bits
        # (llama-3.1-8b at 131072 tokens over 8 devices on an H100: 4 GiB, the step's largest buffer).
        terms["context_mask"] = seq * seq * context * (2 if facts.platform == "gpu" else 1)
        working += terms["context_mask"]
    transient = messages + inputs + working
    # With the stash cut over tensor, a backward gathers its item's whole part (its slot holds a share).
    terms["stash_gathered_over_tensor"] = item * (1 - 1 / tensor)
    transient += terms["stash_gathered_over_tensor"]
    # On an accelerator a backward copies its host slot to the device whole before it unpacks it
    # (jaxmem.pipeline._body, StepBody): one item beside the working set, which was compiled with the
    # stash handed to it on the device. (XLA:CPU reads host buffers in place.)
    if facts.platform != "cpu":
        terms["host_slot_on_device"] = host_item
        transient += host_item
    # FSDP: a running stage holds its gathered weights and their whole gradient before the
    # reduce-scatter (and the embedding's / head's when it is the first or last).
    weights, whole_grads = (static.gathered_copy if cut else static.gathered), static.gathered
    if kept == virtual:  # no action gathers its stage; the embedding's and head's leaves still are
        weights -= static.stage_gathered_copy if cut else static.stage_gathered
        whole_grads -= static.stage_gathered
    transient += weights + whole_grads
    terms["fsdp_gathered"] = weights + whole_grads
    # Weights on host: the prefetch slot holding the stage a rank runs and, where it runs two or more
    # on host, the next one's weights arriving beside that action (jaxmem.pipeline._body.prefetch_columns;
    # where its stages on host differ in shape, each action fetches its own, and this is a bound).
    fetched = [b for b, h in zip(static.stage_params, weights_host) if h]
    terms["weights_fetched"] = min(len(fetched), 2) * max(fetched, default=0.0)
    transient += terms["weights_fetched"]
    # The update streams a stage with weights or optimizer state on host layer by layer, after the
    # backward, when the stash arenas are dead (jaxmem.train._update): the device holds two layers'
    # weights and optimizer state, the one being updated and the next one arriving (the update's
    # elementwise math reads the gradient in place and can write over the fetched copy). That is the
    # transient peak when it is larger than the stash and the backward's working set together.
    if any(w or o for w, o in zip(weights_host, opt_host)):
        layer = _layer_static(facts, schedule.num_ranks, facts.stage_rows(counts), static_kwargs)
        update_copy = 2 * max(p + k * s for p, s in layer)
        terms["streamed_update"] = update_copy - stash_dev
        transient = max(transient, update_copy - stash_dev)
    ranks = _rank_ledgers(schedule.num_ranks, params, grads, optimizer, Bytes(stash_dev, stash_host), transient, live)
    meta = _meta(model, schedule, resolved, batch, whole_seq, data_parallel, mb, facts.source)
    meta.update(
        {
            "target": "cpu" if facts.target is None else facts.target.kind,
            "transient_terms": {k: int(round(v)) for k, v in terms.items() if v},
            # Elements of the largest stash arena (per device); the executor indexes them with int32.
            "largest_arena_elems": int(largest_arena),
            "fsdp": fsdp,
            "tensor": tensor,
            "context": context,
            "zero": zero and replicas > 1,
            "vocab_parallel": vocab,
            "layers_per_stage": list(counts),
            "split_backward": splits,
            "hand_recomputed": hand,
        }
    )
    return Ledger("predicted", ranks, meta)


def _layer_static(facts, ranks: int, rows, static_kwargs) -> list[tuple[float, float]]:
    """Per device, one layer's parameters and one optimizer array of it: per parameter family where the
    layers have several (``rows`` a tuple, as :meth:`~jaxmem.memory.ModelFacts.stage_rows` gives)."""
    units = [1] if isinstance(rows, int) else [tuple(int(i == f) for i in range(len(rows))) for f in range(len(rows))]
    out = []
    for unit in units:
        one = facts.static_bytes(ranks, unit, 1, **static_kwargs)
        out.append((one.stage_params[0], one.stage_state[0]))
    return out


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


def policy_offloads(resolved, schedule) -> bool:
    """The policy puts some stage's weights or optimizer state on host."""
    stages = schedule.stages_of(0)
    return any(resolved.offload_weights(s) or resolved.offload_optimizer_state(s) for s in stages)


def master_cut(static, *, zero: bool, data: int, fsdp: int, offloads: bool) -> bool:
    """Whether a layout's master weights are cut over the replicas (as the Pipeline's ``master_cut``
    decides by default): allowed there, and the model casts some parameter to a narrower dtype."""
    from jaxmem.pipeline import may_cut_master

    narrower = sum(static.stage_copy) + static.shared_copy < sum(static.stage_params) + static.shared_params
    return may_cut_master(zero=zero, data=data, fsdp=fsdp, offloads=offloads) and narrower


def uses_vocab_split(model, ranks: int, vocab_parallel: bool | None = None) -> bool:
    """Whether a pipeline of ``ranks`` splits the model's vocabulary over them (the Pipeline's default)."""
    return model.vocab is not None and ranks > 1 and vocab_parallel is not False


@functools.lru_cache(maxsize=4096)
def _stash_layout(
    schedule, classes: tuple, sizes: tuple, assignment: tuple, head_grads: bool = False, transfers: tuple = ()
) -> tuple:
    """What the ledger reads from the lowered schedule: (device, host) stash arena bytes, each rank's
    own stash bytes, and the message slots.

    ``classes[i]`` stashes ``sizes[i]`` (arena, elements) pairs, and its I hands its W
    ``transfers[i]`` pairs; ``assignment`` gives every (stage, microbatch), in sorted order, its class
    index. Cached by value: a planner prices the same (schedule, policy) several times, and the
    lowering is most of a prediction's cost.
    """
    from jaxmem.pipeline import build_tick_program

    keys = [(s, m) for s in range(schedule.num_stages) for m in range(schedule.num_microbatches)]
    cells = {key: classes[i] for key, i in zip(keys, assignment, strict=True)}
    tick = build_tick_program(
        schedule,
        cells,
        dict(zip(classes, map(dict, sizes))),
        with_table=False,
        head_grads=head_grads,
        transfer_elems=dict(zip(classes, map(dict, transfers))) if transfers else None,
    )
    stash_dev, stash_host, live = _arena_bytes(tick)
    return stash_dev, stash_host, tuple(live), tick.act_slots, tick.grad_slots, max(tick.arena_elems, default=0)


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


def _meta(model, schedule, resolved, batch, seq, data_parallel, mb, facts_source=None) -> dict:
    meta = {
        "model": model.name,
        "schedule": schedule.name,
        "ranks_count": schedule.num_ranks,
        "stages": schedule.num_stages,
        "microbatches": schedule.num_microbatches,
        "policy": resolved.policy.name,
        "batch_size": batch,
        "seq_len": seq,
        "microbatch_size": mb,
        "data_parallel": data_parallel,
        "model_layers": model.n_layers,
    }
    if facts_source:
        meta["facts"] = facts_source
    return meta


def _array_bytes(tree, formats=None) -> Bytes:
    """Per-device bytes of arrays (or abstract arrays with shardings), split by memory kind;
    ``formats``: the compiled program's formats of the same leaves (``compiled.input_formats``), whose
    layouts say how a TPU pads each (elsewhere they pad nothing)."""
    import jax

    from jaxmem.targets import layout_bytes

    total = Bytes()
    layouts = [None] * len(jax.tree.leaves(tree))
    if formats is not None:
        layouts = [getattr(f, "layout", None) for f in jax.tree.leaves(formats, is_leaf=lambda x: hasattr(x, "layout"))]
    for leaf, layout in zip(jax.tree.leaves(tree), layouts, strict=True):
        sharding = leaf.sharding
        shard_shape = sharding.shard_shape(leaf.shape)
        dtype = np.dtype(leaf.dtype)
        if layout is not None and getattr(layout, "tiling", None):
            size = layout_bytes(shard_shape, dtype.name, layout)
        else:
            size = int(np.prod(shard_shape)) * dtype.itemsize
        on_host = "host" in str(getattr(sharding, "memory_kind", None) or "")
        total = total + (Bytes(0, size) if on_host else Bytes(size, 0))
    return total


def host_bytes_counted_as_device(tick, params=None, opt_state=None, *, platform: str | None = None) -> float:
    """What XLA:CPU counts as device bytes though the policy places it on host: host-space stash arenas
    (in its temporaries) and host-kind kept arrays (in its arguments). 0 on other platforms
    (``platform``: the program's; default this process's)."""
    import jax

    from jaxmem._util import platform_of

    if (platform or platform_of(jax.devices())) != "cpu":
        return 0.0
    _, stash_host, _ = _arena_bytes(tick)
    kept = sum(_array_bytes(tree).host for tree in (params, opt_state) if tree is not None)
    return stash_host + kept


def measure(pipeline, compiled, *, batch, params, opt_state) -> Ledger:
    """The ledger read from the program: stash from the jaxpr residuals and the tick program, params and
    optimizer state from the kept arrays' shardings and memory kinds (arrays, or abstract arrays with
    shardings), totals from ``memory_analysis()`` of the compiled train step; ``transient`` is what the
    compiled total leaves for the rest.

    Args:
        pipeline: the :class:`~jaxmem.pipeline.Pipeline` the step runs.
        compiled: the compiled train step.
        batch: the batch (dict or spec) it was compiled for.
        params, opt_state: the state it was compiled for.
    """
    from jaxmem._util import platform_of

    schedule = pipeline.schedule
    analysis = compiled.memory_analysis()
    tick, _ = pipeline.program(batch)
    platform = platform_of(pipeline.mesh)
    # The step's arguments are (params, opt_state, batch): a TPU pads each as its layout says.
    formats = _step_formats(compiled) if platform == "tpu" else (None, None)
    param_bytes = _array_bytes(params, formats[0])
    optimizer = _array_bytes(opt_state, formats[1])
    grads = Bytes(param_bytes.device + param_bytes.host, 0)
    if pipeline.master_cut:
        # The kept arrays are the cut master weights; beside them the step holds the compute copy,
        # and its gradient accumulators are whole, in the master's dtype.
        param_bytes = Bytes(param_bytes.device + pipeline.placed_bytes(pipeline.compute_abstract()), param_bytes.host)
        grads = Bytes(pipeline.placed_bytes(pipeline.abstract_params()), 0)
    # Stages kept gathered hold their whole weights (as the stages read them) and gradient all step.
    param_bytes += Bytes(pipeline.kept_bytes(pipeline.stage_abstract()), 0)
    grads += Bytes(pipeline.kept_bytes(pipeline.abstract_params()), 0)
    stash_dev, stash_host, live = _arena_bytes(tick)
    total_device = compiled_bytes(compiled)
    host_reported = (
        analysis.host_argument_size_in_bytes
        + analysis.host_temp_size_in_bytes
        + analysis.host_output_size_in_bytes
        - analysis.host_alias_size_in_bytes
    )
    cpu_host_counted = host_bytes_counted_as_device(tick, params, opt_state, platform=platform)
    accounted = param_bytes.device + optimizer.device + grads.device + stash_dev + cpu_host_counted
    transient = total_device - accounted
    ranks = _rank_ledgers(
        schedule.num_ranks, param_bytes, grads, optimizer, Bytes(stash_dev, stash_host), transient, live
    )
    from jaxmem.pipeline import batch_size

    size = batch_size(batch)
    # The sequence: the tokens', or (a batch of the model's own) a leaf's second dimension where one has it.
    seq = (
        batch["tokens"].shape[1]
        if "tokens" in batch
        else next((v.shape[1] for v in batch.values() if len(v.shape) > 1), 1)
    )
    mb = pipeline.check_batch(batch)
    meta = _meta(pipeline.model, schedule, pipeline.policy, size, seq, pipeline.data, mb)
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


def _step_formats(compiled) -> tuple:
    """The compiled train step's formats of its parameters and optimizer state (None, None when the
    program does not say)."""
    try:
        args = compiled.input_formats[0]
        return args[0], args[1]
    except Exception:  # noqa: BLE001 -- an executable without layouts
        return None, None


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
