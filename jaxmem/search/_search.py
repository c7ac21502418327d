"""The configuration search (``jaxmem plan``): the fastest (simulated) pipeline size x schedule x
microbatches x policy whose predicted per-rank device bytes fit a budget.

Every candidate is scored by :func:`jaxmem.memory.estimate`: the predicted memory ledger and the
schedule simulator with FLOP costs, recompute and host transfers on a hardware profile, from the
model's facts (traced, or the GPT's closed form). Nothing is compiled. When nothing fits, the result
says so and gives the smallest budget that would fit one of the candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from jaxmem._errors import JaxmemError, StepTooLarge, setting
from jaxmem._util import human_bytes

__all__ = [
    "check_budget_floor",
    "CHRONOS_MOVES",
    "Candidate",
    "SearchError",
    "SearchResult",
    "candidate_schedules",
    "chronos_moves",
    "evaluate",
    "progress_lines",
    "search",
    "tensor_sizes",
    "context_sizes",
    "CONTEXT_MIN_TOKENS",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "chronos")
# Where a pick cannot be compiled on the machine at hand, it is planned under the budget less this
# fraction: the ledger's measured band (benchmarks/ledger_fit.py: at worst 4.4% under the compiled
# step, over four decoder families it was not fitted on x every schedule and policy).
LEDGER_MARGIN = 0.05
POLICIES = ("save-all", "selective", "recompute-all", "chronos-recomp", "chronos-offload", "chronos-both")


class SearchError(JaxmemError):
    """No candidate fits the budget; says by how much and the smallest budget that would fit."""

    def __init__(self, message: str, smallest_budget: float | None):
        super().__init__(message)
        self.smallest_budget = smallest_budget


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One scored configuration."""

    schedule: str
    virtual: int | None
    pipe: int
    data: int
    microbatches: int
    policy_name: str
    fsdp: int = dataclasses.field(default=1, kw_only=True)
    tensor: int = dataclasses.field(default=1, kw_only=True)
    context: int = dataclasses.field(default=1, kw_only=True)
    split_backward: bool = dataclasses.field(default=False, kw_only=True)
    hand_recomputed: bool = dataclasses.field(default=False, kw_only=True)
    policy: object = dataclasses.field(repr=False, compare=False)
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    step_seconds: float = math.inf
    tokens_per_second: float = 0.0
    fits: bool = False
    note: str = ""

    def mesh(self) -> str:
        """Its layout as the planner prints it (``P=4 D=2 F=2 C=2 T=2``; F, C and T where above 1) and
        how its backward is split."""
        return (
            f"P={self.pipe} D={self.data}"
            + (f" F={self.fsdp}" if self.fsdp > 1 else "")
            + (f" C={self.context}" if self.context > 1 else "")
            + (f" T={self.tensor}" if self.tensor > 1 else "")
            + (" split backward" if self.split_backward else "")
            + (", recomputed handed to W" if self.hand_recomputed else "")
        )

    def describe(self) -> str:
        """Schedule, layout, microbatches and policy in one line: ``zb-h1 P=16 D=2 F=2 M=128 selective``."""
        virtual = f" V={self.virtual}" if self.virtual else ""
        return f"{self.schedule}{virtual} {self.mesh()} M={self.microbatches} {self.policy_name}"

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule,
            "virtual": self.virtual,
            "pipe": self.pipe,
            "data": self.data,
            "fsdp": self.fsdp,
            "tensor": self.tensor,
            "context": self.context,
            "microbatches": self.microbatches,
            "split_backward": self.split_backward,
            "hand_recomputed": self.hand_recomputed,
            "policy": self.policy_name,
            "device_bytes": int(self.device_bytes),
            "host_bytes": int(self.host_bytes),
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "fits": self.fits,
            "note": self.note,
        }


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The candidates scored, the best that fits (or None), and why."""

    best: Candidate | None
    candidates: tuple[Candidate, ...]
    budget_bytes: float
    hardware: dict
    model: str
    devices: int
    margin: float = 0.0
    confirmed: dict | None = None
    # Whose compiler the working sets were compiled by: a target's name, or "cpu" (the devices here).
    target: str = "cpu"

    @property
    def planned_bytes(self) -> float:
        """The bytes a candidate's prediction must fit: the budget less the margin."""
        return self.budget_bytes / (1 + self.margin)

    @property
    def ranked(self) -> list[Candidate]:
        return sorted(self.candidates, key=lambda c: (not c.fits, -c.tokens_per_second, c.device_bytes))

    @property
    def smallest_budget(self) -> float:
        return min(c.device_bytes for c in self.candidates)

    def explain(self, top: int = 5) -> list[str]:
        lines = []
        if self.best is None:
            lines.append(
                f"nothing fits {human_bytes(self.budget_bytes)} per device; the smallest footprint of any "
                f"candidate is {human_bytes(self.smallest_budget)} "
                f"(short by {human_bytes(self.smallest_budget - self.budget_bytes)})"
            )
            return lines
        b = self.best
        lines.append(
            f"best: {b.schedule}{f' V={b.virtual}' if b.virtual else ''} {b.mesh()} M={b.microbatches} "
            f"policy {b.policy_name}: {human_bytes(b.device_bytes)}/device, {b.tokens_per_second:,.0f} tokens/s"
        )
        if self.confirmed is not None:
            lines.append(f"  {self.confirmed['summary']}")
        elif self.margin:
            lines.append(
                f"  planned under {human_bytes(self.planned_bytes)}: the budget less a {self.margin:.0%} margin "
                f"for the ledger's error (not compiled here; {setting('margin')} sets it)"
            )
        for c in [c for c in self.ranked if c is not b][:top]:
            why = (
                f"{c.tokens_per_second / b.tokens_per_second:.1%} of the best's throughput"
                if c.fits
                else f"needs {human_bytes(c.device_bytes)} > budget"
            )
            lines.append(f"  runner-up: {c.describe()}: {why}")
        flat = [c for c in self.ranked if c.pipe == 1 and c.fsdp > 1]
        if flat and b.pipe > 1:  # the layout without a pipeline (FSDP over every device), for comparison
            c = flat[0]
            why = (
                f"{c.tokens_per_second:,.0f} tokens/s, {c.tokens_per_second / b.tokens_per_second:.1%} of the best's"
                if c.fits
                else f"needs {human_bytes(c.device_bytes)} > budget"
            )
            lines.append(
                f"  no pipeline (FSDP only): {c.schedule} {c.mesh()} M={c.microbatches} {c.policy_name}: {why}"
            )
        return lines

    def legend(self, top: int = 5) -> list[str]:
        """What the notation of :meth:`explain` means: the layout letters, and each policy it names."""
        from jaxmem.policy import KEEP_GATHERED, PRESET_HELP

        shown = [] if self.best is None else [self.best, *[c for c in self.ranked if c is not self.best][:top]]
        shown += [c for c in self.ranked if c.pipe == 1 and c.fsdp > 1][:1]
        context = any(c.context > 1 for c in shown)
        lines = [
            "legend: P pipeline ranks, V stages per rank, D data-parallel replicas, F FSDP shards, T tensor width,",
            "  C devices each sequence is split over, M microbatches a step (P x D x F x C x T devices); the policies "
            "named above:"
            if context
            else "  M microbatches a step (P x D x F x T devices); the policies named above:",
        ]
        for name in dict.fromkeys(c.policy_name for c in shown):
            base, kept = name.removesuffix(KEEP_GATHERED), name.endswith(KEEP_GATHERED)
            gathered = "; FSDP's gathered weights kept from F to B instead of gathered again" if kept else ""
            if base in PRESET_HELP:
                lines.append(f"  {name}: {PRESET_HELP[base]}{gathered}")
            elif name in CHRONOS_MOVES:
                moves = ", ".join(CHRONOS_MOVES[name])
                lines.append(
                    f"  {name}: generated for this layout under the budget, the fewest moves that fit ({moves})"
                )
            else:
                lines.append(f"  {name}: a policy of its own (the plan's --json `policy` field spells it out)")
        return lines

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "devices": self.devices,
            "budget_bytes": int(self.budget_bytes),
            "margin": self.margin,
            "target": self.target,
            "confirmed": self.confirmed,
            "hardware": self.hardware,
            "best": None if self.best is None else self.best.to_json(),
            "fits": self.best is not None,
            "smallest_budget_bytes": int(self.smallest_budget),
            "candidates": [c.to_json() for c in self.ranked],
            "explanation": self.explain(),
            "legend": self.legend(),
        }


# A stash arena's elements are indexed with int32 in the executor (jaxmem.pipeline._body).
MAX_ARENA_ELEMS = 2**31

CHRONOS_MOVES = {
    "chronos-recomp": ("selective", "recompute-layers", "recompute-all"),
    "chronos-offload": ("offload-stash", "offload-optimizer-state", "offload-weights"),
    "chronos-both": (
        "offload-stash",
        "selective",
        "recompute-layers",
        "recompute-all",
        "offload-optimizer-state",
        "offload-weights",
    ),
}


def chronos_moves(run, allowed, base=None) -> list:
    """The memory moves with their price in seconds per byte saved, each read from the one estimator:
    ``run(policy)`` (:func:`jaxmem.memory.estimate` of the configuration under a policy) with the
    move applied to every stage and microbatch, against save-all (``base``, when the caller has its
    estimate already) -- the step's extra seconds over the device bytes it frees; a move that frees
    none is left out (weights on host where a rank runs two stages: its prefetch slot and the
    weights arriving beside it hold both). ``offload-stash`` is priced 0: the generator offloads
    only cells whose wait hides the round trip, and the simulator charges whatever does not hide."""
    from jaxmem.policy import MOVE_SPECS, Move

    base = base if base is not None else run("save-all")
    moves = []
    for name in allowed:
        if name == "offload-stash":
            moves.append(Move(name, 0.0))
            continue
        moved = run(MOVE_SPECS.get(name, name))
        saved = base.device_bytes - moved.device_bytes
        if saved > 0:  # not offered where it frees nothing (weights on host with two stages a rank)
            moves.append(Move(name, max(moved.step_seconds - base.step_seconds, 0.0) / saved))
    return moves


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(
    model,
    schedule,
    policy_name,
    *,
    budget: float,
    batch: int,
    seq: int,
    data: int,
    hardware,
    layer_counts=None,
    fsdp: int = 1,
    tensor: int = 1,
    context: int = 1,
    zero: bool = True,
    vocab_parallel: bool | None = None,
    split_backward: bool = False,
    hand_recomputed: bool = False,
    target=None,
    runnable: bool = False,
) -> Candidate:
    """Score one (schedule, policy) with :func:`jaxmem.memory.estimate`; ``policy_name``: a
    ``chronos-*`` name, generated for the budget first (Chronos-Recomp/Offload), or any spec
    :func:`~jaxmem.policy.from_spec` takes. ``fsdp``, ``tensor``, ``context``, ``zero``,
    ``vocab_parallel``, ``split_backward``: how the state and the math are cut and the backward
    split (:class:`~jaxmem.pipeline.Pipeline`; the candidate's ``split_backward`` says whether the
    split takes effect, :func:`~jaxmem.pipeline.splits_backward`); ``hand_recomputed``: with the
    split, I hands W what it recomputed too (:class:`~jaxmem.pipeline.Pipeline`); ``target``: the
    :class:`~jaxmem.targets.Target` whose compiler the ledger reads (None: the devices at hand);
    ``runnable``: a candidate that fits only if jaxmem's executor can also run it today (a stash
    arena within its int32 indexing, ``MAX_ARENA_ELEMS``) -- what :func:`search` asks; otherwise
    such a candidate fits on its bytes and its note says what the executor lacks."""
    from jaxmem.memory import estimate, get_hardware, model_facts, predict
    from jaxmem.models import get_model
    from jaxmem.pipeline import model_layer_counts, splits_backward
    from jaxmem.policy import PRESETS, chronos_policy, from_spec, resolve, reuse_distances

    model = get_model(model)
    facts = model_facts(model, target=target, context=context)
    hardware = get_hardware(hardware)
    counts = model_layer_counts(model, schedule.num_stages, layer_counts)
    mb = batch // (data * fsdp * schedule.num_microbatches)
    split_backward = splits_backward(schedule, split_backward)
    hand_recomputed = split_backward and bool(hand_recomputed)

    layout = dict(
        batch=batch,
        seq=seq,
        data_parallel=data,
        fsdp=fsdp,
        tensor=tensor,
        context=context,
        zero=zero,
        vocab_parallel=vocab_parallel,
        layer_counts=counts,
        facts=facts,
        split_backward=split_backward,
        hand_recomputed=hand_recomputed,
    )

    # One evaluation estimates many policies, and the generator below reaches some of them many
    # times over (the same choice from several move sets, a ledger it read to fit and then
    # estimates): each policy's ledger and estimate are worked out once.
    @functools.cache
    def resolved(policy):
        return resolve(policy, schedule, model.tags)

    @functools.cache
    def ledger(policy):
        return predict(model, schedule, resolved(policy), **layout)

    @functools.cache
    def estimated(policy):
        timed = estimate(model, schedule, resolved(policy), hardware=hardware, memory=False, **layout)
        return dataclasses.replace(timed, ledger=ledger(policy))

    def run(policy):  # a policy given as a spec dict (a move's) is estimated as it is
        if isinstance(policy, dict):
            return estimate(model, schedule, policy, hardware=hardware, **layout)
        return estimated(policy)

    note = ""
    if isinstance(policy_name, str) and policy_name in CHRONOS_MOVES:
        last = schedule.num_stages - 1
        save_all = PRESETS["save-all"].bind(model.tags)
        base = run("save-all")
        families = facts.stage_families(counts)

        def round_trip(s, m):
            stash = facts.stage(
                first=s == 0,
                last=s == last,
                layers=counts[s],
                families=families[s],
                policy=save_all,
                microbatch=mb,
                seq=seq // context,
            ).stash_bytes("device")
            return 2 * stash / hardware.host_share

        def device_bytes(policy) -> float:
            return ledger(policy).max_device_bytes

        def live_stash(policy) -> list[float]:
            return [r.live_stash_bytes for r in ledger(policy).ranks]

        all_moves = chronos_moves(run, CHRONOS_MOVES[policy_name], base)
        distances = reuse_distances(schedule, base.costs)  # one simulation for every policy generated

        def generate(allowed, first=()):
            moves = [m if m.name not in first else dataclasses.replace(m, seconds_per_byte=-1.0) for m in all_moves]
            choice = chronos_policy(
                schedule,
                device_bytes,
                budget,
                base.costs,
                [m for m in moves if m.name in allowed],
                stash_seconds_round_trip=round_trip,
                name=policy_name,
                layers=counts,
                live_stash=live_stash,
                distances=distances,
            )
            return choice, run(choice.policy)

        # The greedy order of moves is priced per byte over the whole step, so all moves together can
        # end slower than a subset of them: the combined generator also tries its recompute-only and
        # offload-only subsets and keeps the fastest choice that fits (the smallest when none does).
        subsets = [CHRONOS_MOVES[policy_name]]
        if policy_name == "chronos-both":
            subsets += [CHRONOS_MOVES["chronos-recomp"], CHRONOS_MOVES["chronos-offload"]]
        # Layers recomputed one by one, spread over the cells, avoid the jump to whole cells, but once
        # most layers are recomputed whole cells free more: try the moves without them as well.
        subsets += [
            tuple(m for m in moves if m != "recompute-layers") for moves in subsets if "recompute-layers" in moves
        ]
        tried = [generate(allowed) for allowed in subsets]
        # A move applied last is not weighed against the ones applied before it: a late state move
        # (the optimizer state on host: one price per step, whatever the depth) can make most of the
        # earlier cell moves unneeded. So each state move is also tried first, with and without the
        # stash offload (priced free cell by cell, its transfers queue on one link when many cells
        # offload: 67 cells of gpt2-xl width at 464 layers waited 2.8 s a step).
        for state_move in ("offload-optimizer-state", "offload-weights"):
            if any(m.name == state_move for m in all_moves):  # allowed, and frees something
                moves = CHRONOS_MOVES[policy_name]
                tried.append(generate(moves, first=(state_move,)))
                tried.append(generate(tuple(m for m in moves if m != "offload-stash"), first=(state_move,)))

        def rank(t):  # fitting first, fastest; else smallest
            fits = t[1].device_bytes <= budget
            return (not fits, t[1].step_seconds if fits else t[1].device_bytes)

        choice, result = min(tried, key=rank)
        policy = choice.policy
        note = choice.describe()
    else:
        policy = from_spec(policy_name)
        result = run(policy)
    fits = result.device_bytes <= budget
    arena = result.ledger.meta.get("largest_arena_elems", 0) if result.ledger is not None else 0
    if arena >= MAX_ARENA_ELEMS:
        # The executor indexes a stash arena with int32: a larger one does not run, whatever it fits.
        fits = fits and not runnable
        note = (
            f"{note + '; ' if note else ''}its stash arena of {arena:,} elements is beyond the executor's int32 "
            f"indexing ({MAX_ARENA_ELEMS:,})"
        )
    return Candidate(
        schedule=schedule.name,
        virtual=schedule.num_stages // schedule.num_ranks if schedule.num_stages > schedule.num_ranks else None,
        pipe=schedule.num_ranks,
        data=data,
        fsdp=fsdp,
        tensor=tensor,
        context=context,
        split_backward=split_backward,
        hand_recomputed=hand_recomputed,
        microbatches=schedule.num_microbatches,
        policy_name=policy_name,
        policy=policy,
        device_bytes=result.device_bytes,
        host_bytes=result.host_bytes,
        step_seconds=result.step_seconds,
        tokens_per_second=result.tokens_per_second,
        fits=fits,
        note=note,
    )


def tensor_sizes(model, devices: int) -> list[int]:
    """The tensor splits worth searching for ``devices`` devices per pipe rank: 1, and 2, 4 and 8
    where they divide them and the model annotates what a tensor axis cuts (one node's fast link
    holds 8 devices on the profiles)."""
    if model.axes is None:
        return [1]
    return [t for t in (1, 2, 4, 8) if devices % t == 0]


# A context axis is searched where each of its devices still holds at least this many tokens of a
# sequence: below it, the keys and values gathered every layer are a large share of the little work
# each device has (and short sequences fit without one).
CONTEXT_MIN_TOKENS = 2048


def context_sizes(model, devices: int, seq: int) -> list[int]:
    """The context splits worth searching for ``devices`` devices per pipe rank and tensor group: 1,
    and 2, 4, 8 and 16 where they divide them, split the sequence into ``2 x C`` equal chunks, leave
    each device at least :data:`CONTEXT_MIN_TOKENS` tokens, and the model's attention is
    context-aware (:func:`jaxmem.models.context_kv`)."""
    sizes = [c for c in (2, 4, 8, 16) if devices % c == 0 and seq % (2 * c) == 0 and seq // c >= CONTEXT_MIN_TOKENS]
    return [1, *sizes] if sizes and context_aware(model) else [1]


def context_aware(model) -> bool:
    """Whether the model's layers gather keys and values over a context axis (a stage of one layer
    traced on a stand-in of one; nothing compiled)."""
    from jaxmem.memory import model_facts

    try:
        return model_facts(model, context=2).context_kv_bytes(True, True, 1, 4) > 0
    except JaxmemError:
        return False


def candidate_schedules(
    model,
    devices: int,
    batch: int,
    schedules=SCHEDULES,
    pipes=None,
    microbatches=None,
    fsdp: bool = True,
    tensors=None,
    mesh: dict | None = None,
    seq: int | None = None,
    contexts=None,
):
    """``(schedule, data, fsdp, tensor, context)`` the search considers: pipe sizes dividing the
    devices, a tensor split of each pipe rank's devices (:func:`tensor_sizes`, or ``tensors``), a
    context split of what is left (:func:`context_sizes` for sequences of ``seq``, or ``contexts``;
    none without ``seq``), the replicas that
    leaves either all data-parallel (ZeRO) or, without a tensor split, all FSDP; stage counts dividing
    the layers, microbatch counts dividing the per-replica batch; and, with ``fsdp``, the FSDP-only
    layout with no pipeline -- one rank whose stages are the FSDP units (interleaved-1f1b with P=1, a
    layer or two a stage), gathered one at a time. ``mesh`` (``{"data", "fsdp", "pipe", "context",
    "tensor"}``): that layout only."""
    from jaxmem.schedule import ScheduleError, generate

    out = []
    if mesh is not None:
        pipe_sizes = [mesh["pipe"]]
    else:
        pipe_sizes = pipes or [p for p in _divisors(devices) if p > 1] or [1]
    for pipe in pipe_sizes:
        if devices % pipe:
            continue
        sizes = [mesh["tensor"]] if mesh is not None else tensors or tensor_sizes(model, devices // pipe)
        for tensor in sizes:
            if devices % (pipe * tensor):
                continue
            left = devices // (pipe * tensor)
            if mesh is not None:
                context_splits = [mesh.get("context", 1)]
            else:
                context_splits = contexts or (context_sizes(model, left, seq) if seq else [1])
            for context in context_splits:
                replicas = left // context
                if left % context or batch % replicas:
                    continue
                local = batch // replicas
                ms = microbatches or sorted({m for m in (pipe, 2 * pipe, 4 * pipe, 8 * pipe) if local % m == 0})
                if mesh is not None:
                    splits = [(mesh["data"], mesh["fsdp"])]
                else:
                    splits = [(replicas, 1)] + ([(1, replicas)] if fsdp and replicas > 1 and tensor == 1 else [])
                for name in schedules:
                    virtual = 2 if name in ("interleaved-1f1b",) else None
                    stages = pipe * (2 if name in ("interleaved-1f1b", "zbv", "chronos", "v-half", "v-min") else 1)
                    if model.n_layers % stages or (pipe == 1 and name != "gpipe"):
                        continue
                    for m in ms:
                        if local % m:
                            continue
                        try:
                            schedule = generate(name, pipe, m, virtual)
                        except ScheduleError:
                            continue
                        out += [(schedule, d, f, tensor, context) for d, f in splits]
    if fsdp and devices > 1 and not pipes and mesh is None and batch % devices == 0:
        local = batch // devices
        for per_stage in (1, 2):
            if model.n_layers % per_stage:
                continue
            for m in sorted({m for m in (1, 2, 4) if local % m == 0}):
                out.append((generate("interleaved-1f1b", 1, m, model.n_layers // per_stage), 1, devices, 1, 1))
    return out


def check_budget_floor(model, devices: int, budget_bytes: int) -> None:
    """Refuse, before any search or compile, a budget under the floor no plan goes under: the
    parameters, their gradients and Adam's two moments, spread perfectly over every device."""
    from jaxmem._util import tree_bytes

    param_bytes = tree_bytes(model.abstract_params())
    floor = 4 * param_bytes / devices
    if budget_bytes < floor:
        raise SearchError(
            f"nothing fits a budget of {human_bytes(budget_bytes)} per device on {devices} devices: the "
            f"parameters, gradients and optimizer state alone take {human_bytes(4 * param_bytes)}, at least "
            f"{human_bytes(floor)} per device however they are cut (give a larger {setting('budget')}, or more "
            "devices)",
            floor,
        )


def progress_lines(log, *, lines: int | None = 10):
    """A :func:`search` ``progress`` callback that says how far the search is through ``log``, a
    line at the start and then about ``lines`` times in all (a log that is not a terminal), or at
    every schedule with ``lines=None`` (a terminal's line rewritten in place)::

        planning: 1/96 schedules (gpipe, M=4)
        planning: 10/96 schedules (1f1b, M=8)
    """

    def report(i: int, n: int, schedule) -> None:
        # The first, then each tenth (by default) begun.
        if lines is None or i == 0 or (i + 1) * lines // n > i * lines // n:
            log(f"planning: {i + 1}/{n} schedules ({schedule.name}, M={schedule.num_microbatches})")

    return report


def search(
    model,
    *,
    devices: int,
    budget_bytes: float,
    hardware="h100",
    batch: int,
    seq: int,
    schedules=SCHEDULES,
    policies=POLICIES,
    pipes=None,
    microbatches=None,
    progress=None,
    fsdp: bool = True,
    tensors=None,
    contexts=None,
    mesh: dict | None = None,
    zero: bool = True,
    vocab_parallel: bool | None = None,
    margin: float = 0.0,
    split_backward: bool | None = None,
    hand_recomputed: bool | None = None,
    target=None,
) -> SearchResult:
    """Search pipeline sizes x tensor splits x data/fsdp splits x schedules x microbatches x
    policies, and the FSDP-only layout; the fastest simulated candidate that fits wins. ``fsdp=False``
    leaves the fsdp splits out; ``tensors``: the tensor splits to try (default
    :func:`tensor_sizes`); ``contexts``: the context splits to try (default :func:`context_sizes`:
    where each device keeps at least :data:`CONTEXT_MIN_TOKENS` tokens of a sequence); ``mesh``:
    one layout only (``{"data", "fsdp", "pipe", "context", "tensor"}``, its product the devices);
    ``zero`` and ``vocab_parallel`` as in :class:`~jaxmem.pipeline.Pipeline`;
    ``split_backward``: on schedules with I and W, whether I hands W its cotangents
    (faster, W does half a backward instead of a whole one; the cotangents take memory from I to W);
    None tries both (on a CPU profile with a tensor axis only without: measured slower there).
    ``hand_recomputed``: with the split, whether I also hands W what it recomputed
    (W recomputes no forward; those activations take memory from I to W); None tries both under
    recompute-all, where a split W re-runs a whole forward (each try compiles the split's working
    set again). Not under selective, whose W re-runs only elementwise values (0-7% of a step
    measured on CPU, within the spread), nor for the generated ``chronos-*`` policies (each generation is a
    search of its own). ``margin``: a candidate fits when its prediction fits
    ``budget_bytes / (1 + margin)`` (e.g. :data:`LEDGER_MARGIN` where the pick cannot be compiled and
    checked, see :func:`confirm`). ``target``: the :class:`~jaxmem.targets.Target` (or its name) whose
    compiler the ledger's working sets and layouts come from (None: the devices at hand); ``hardware``
    must be its profile."""
    from jaxmem.memory import get_hardware
    from jaxmem.models import get_model
    from jaxmem.pipeline import splits_backward
    from jaxmem.targets import parse_target

    model = get_model(model)
    target = parse_target(target)
    if target is not None and not target.compile_only:
        target = None
    hw = get_hardware(hardware)
    if target is not None and hw.name != target.name:
        raise JaxmemError(
            f"{setting('hardware', hw.name)} and {setting('target', str(target))} name two machines; a plan is for "
            f"one: drop {setting('hardware')} (the target's profile is {target.name})"
        )
    from jaxmem.policy import KEEP_GATHERED, PRESETS

    pairs = candidate_schedules(
        model,
        devices,
        batch,
        schedules,
        pipes,
        microbatches,
        fsdp=fsdp,
        tensors=tensors,
        mesh=mesh,
        seq=seq,
        contexts=contexts,
    )
    if not pairs:
        raise JaxmemError(
            f"no schedule fits {devices} devices, {model.n_layers} layers and batch {batch}: the pipeline "
            "size must divide the devices, the stages must divide the layers, the batch must divide into "
            "data x microbatches"
        )
    if not 0 <= margin < 1:
        raise JaxmemError(f"{setting('margin')} is a fraction of the budget in [0, 1), e.g. 0.1; got {margin}")
    planned = budget_bytes / (1 + margin)
    candidates = []
    for i, (schedule, data, fsdp_size, tensor, context) in enumerate(pairs):
        if progress:
            progress(i, len(pairs), schedule)
        seen = {}
        names = list(policies)
        if fsdp_size > 1:  # FSDP: each preset also with its stages' weights kept gathered F->B
            names += [f"{n}{KEEP_GATHERED}" for n in policies if n in PRESETS]
        splits = [split_backward] if split_backward is not None else [False, True]
        splits = [s for s in splits if not s or splits_backward(schedule, s)] or [False]
        if hw.cores and tensor > 1 and split_backward is None:
            # On shared CPU cores W's gathers of what I handed it cost more than the forward the split
            # saves (benchmarks/results/overhead_split_tensor.json), and the profile prices no
            # collective: the split is not tried there unless asked for.
            splits = [False]
        variants = [(n, s, h) for n in names for s in splits for h in _handoffs(n, s, hand_recomputed)]
        for name, split, hand in variants:
            cand = evaluate(
                model,
                schedule,
                name,
                budget=planned,
                batch=batch,
                seq=seq,
                data=data,
                fsdp=fsdp_size,
                tensor=tensor,
                context=context,
                zero=zero,
                vocab_parallel=vocab_parallel,
                hardware=hw,
                split_backward=split,
                hand_recomputed=hand,
                target=target,
                runnable=True,
            )
            if hw.cores and cand.host_bytes:  # on a CPU the host memory is the device's: offloads save none of it
                continue
            # A generated policy that changed nothing is the preset it started from: keep one of them.
            key = (round(cand.device_bytes), round(cand.step_seconds, 12), round(cand.host_bytes))
            if key in seen:
                continue
            seen[key] = cand
            candidates.append(cand)
    fitting = [c for c in candidates if c.fits]
    best = max(fitting, key=lambda c: (c.tokens_per_second, -c.device_bytes)) if fitting else None
    return SearchResult(
        best=best,
        candidates=tuple(candidates),
        budget_bytes=budget_bytes,
        hardware=hw.to_json(),
        model=model.name,
        devices=devices,
        margin=margin,
        target="cpu" if target is None else str(target.with_devices(devices)),
    )


def _handoffs(policy_name, split: bool, hand_recomputed: bool | None) -> list[bool]:
    """The ``hand_recomputed`` values :func:`search` tries for a policy and split (its docstring)."""
    from jaxmem.policy import KEEP_GATHERED

    if not split:
        return [False]
    if hand_recomputed is not None:
        return [hand_recomputed]
    recomputes_forward = isinstance(policy_name, str) and policy_name.removesuffix(KEEP_GATHERED) == "recompute-all"
    return [False, True] if recomputes_forward else [False]


def confirm(
    result: SearchResult, compiled_bytes: Callable[[Candidate], float], log=print, tries: int = 3
) -> SearchResult:
    """Check the fastest fitting candidates in order by compiling them (``compiled_bytes``: a
    candidate's per-device bytes from ``memory_analysis()`` of its compiled step), and keep the first
    whose compiled bytes fit the budget, saying which were passed over and why. At most ``tries``
    are compiled; when none of them fits, a :class:`SearchError` says so."""
    import jax

    fitting = [c for c in result.ranked if c.fits][:tries]
    if not fitting:
        return result
    rejected, over = [], {}
    for c in fitting:
        refused = failed = None
        try:
            compiled = float(compiled_bytes(c))
        except StepTooLarge as e:  # the target's compiler refused it: beyond the chip's memory
            refused, compiled = e, max(e.needed_bytes, result.budget_bytes + 1)
        except jax.errors.JaxRuntimeError as e:  # the compiler failed on it (its own limits): the next pick
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            # XLA's first line; where it wraps a Python traceback (a custom partitioner's), its last too
            reason = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            failed, compiled = reason[:300], math.inf
        if compiled <= result.budget_bytes:
            where = "here" if result.target == "cpu" else f"for {result.target}"
            what = f"compiled {where}: {human_bytes(compiled)}/device, within the budget"
            if rejected:
                what += (
                    f" (the {len(rejected)} faster pick{'s' if len(rejected) > 1 else ''} did not fit when compiled)"
                )
            # A pick passed over is shown with its compiled bytes, as not fitting.
            return dataclasses.replace(
                result,
                best=c,
                candidates=tuple(over.get(id(x), x) for x in result.candidates),
                confirmed={"compiled_bytes": int(compiled), "rejected": rejected, "summary": what},
            )
        if failed is not None:
            rejected.append({**c.to_json(), "compiled_bytes": None, "failed": failed})
            over[id(c)] = dataclasses.replace(c, fits=False, note=f"{c.note} (does not compile: {failed})".strip())
            outcome = f"its compile failed for {result.target} ({failed})"
        else:
            rejected.append({**c.to_json(), "compiled_bytes": int(compiled)})
            over[id(c)] = dataclasses.replace(c, device_bytes=compiled, fits=False, note=f"{c.note} (compiled)".strip())
            outcome = (
                f"compiles to {human_bytes(compiled)} > the budget {human_bytes(result.budget_bytes)}"
                if refused is None
                else f"does not compile for {result.target}, beyond its chip's memory ({refused})"
            )
        log(f"plan: {c.describe()} was predicted at {human_bytes(c.device_bytes)} but {outcome}; trying the next")
    sizes = [r["compiled_bytes"] for r in rejected if r["compiled_bytes"] is not None]
    smallest = f"smallest compiled: {human_bytes(min(sizes))}" if sizes else "none compiled"
    raise SearchError(
        f"none of the {len(fitting)} fastest plans predicted to fit {human_bytes(result.budget_bytes)} per device "
        f"fits it when compiled ({smallest}); give a larger {setting('budget')} or more devices",
        min(sizes) if sizes else None,
    )
