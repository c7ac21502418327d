"""Memory policies: per stage (and per microbatch) decide for each named activation whether it is saved
on device, recomputed in the backward, or offloaded to host; and whether a stage's stash, weights and
optimizer state live on host between uses.

A :class:`Policy` is a frozen, hashable value written without a model in mind: tags are names.
``from_spec`` turns a friendly spec (a preset name, a dict, a TOML table or file) into one.
``Policy.resolve(schedule, tags)`` checks it against a schedule (stage numbers, microbatch classes)
and a model's declared tags (:class:`TagSet`), and gives each (stage, microbatch) its
:class:`BoundStagePolicy`, which lowers to a ``jax.checkpoint`` policy over the whole stage function
(name-based: ``save_only_these_names`` / ``save_and_offload_only_these_names``) and to memory kinds in
the executor. ``save-all`` means every tag the model declares; a tag it does not declare is an error.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import types
from collections.abc import Callable, Mapping

from jaxmem._errors import JaxmemError

__all__ = [
    "BASES",
    "BoundStagePolicy",
    "Decision",
    "KEEP_GATHERED",
    "Policy",
    "PolicyError",
    "PRESETS",
    "ResolvedPolicy",
    "StagePolicy",
    "TagSet",
    "from_spec",
    "microbatch_classes",
    "resolve",
]


class PolicyError(JaxmemError):
    """A policy spec is malformed or does not fit the model/schedule; lists the valid names."""


class Decision(enum.StrEnum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class TagSet:
    """The ``checkpoint_name`` tags a model declares, and named groups of them.

    A policy is written against tag names and bound to a model's TagSet when it is resolved: ``save-all``
    saves every declared tag, ``selective`` every tag outside the ``quadratic`` group (the tensors
    that grow with the square of the sequence, e.g. attention probabilities), and a tag the model
    does not declare is an error.

    Attributes:
        names: every tag the model's stage functions emit, in forward order.
        groups: ``(group, tags)`` pairs; ``quadratic`` is the one the presets use.

    >>> tags = TagSet(("q", "k", "probs", "out"), groups=(("quadratic", ("probs",)),))
    >>> sorted(tags.group("quadratic"))
    ['probs']
    """

    names: tuple[str, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        groups = self.groups.items() if isinstance(self.groups, Mapping) else self.groups
        object.__setattr__(self, "groups", tuple((str(g), tuple(t)) for g, t in groups))
        if len(set(self.names)) != len(self.names):
            raise PolicyError(f"tags are declared twice: {sorted(t for t in self.names if self.names.count(t) > 1)}")
        for group, members in self.groups:
            unknown = [t for t in members if t not in self.names]
            if unknown:
                raise PolicyError(f"tag group {group!r} names undeclared tags {unknown}; declared: {self.describe()}")

    def group(self, name: str) -> frozenset[str]:
        """The tags of a group (empty when the model has no such group)."""
        return frozenset(dict(self.groups).get(name, ()))

    def check(self, tag: str, where: str = "policy") -> None:
        if tag not in self.names:
            raise PolicyError(f"{where}: unknown activation tag {tag!r}; the model declares: {self.describe()}")

    def describe(self) -> str:
        return ", ".join(self.names) if self.names else "(no tags)"


# How a base decides for every declared tag: the tags it saves and the tags it offloads.
BASES = ("save-all", "recompute-all", "selective", "offload-tags")


def _base_sets(base: str, tags: TagSet) -> tuple[frozenset, frozenset]:
    everything = frozenset(tags.names)
    if base == "save-all":
        return everything, frozenset()
    if base == "recompute-all":
        return frozenset(), frozenset()
    if base == "selective":  # Megatron's selective recompute: all but the quadratic tensors
        return everything - tags.group("quadratic"), frozenset()
    return frozenset(), everything  # offload-tags


def _decision(tag: str, value) -> Decision:
    try:
        return Decision(str(value).lower())
    except ValueError:
        raise PolicyError(f"tag {tag!r}: unknown decision {value!r}; use save, recompute or offload") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePolicy:
    """What one stage does with its activations, stash and state, written without a model in mind.

    Attributes:
        base: ``save-all`` (every declared tag kept on device), ``recompute-all`` (only the stage
            input kept; everything recomputed in the backward), ``selective`` (all but the model's
            ``quadratic`` tags) or ``offload-tags`` (every declared tag moved to host; ``offload-all`` is
            its older name).
        tags: per-tag overrides of the base, ``(tag, decision)`` pairs (a mapping is accepted).
        offload_stash: keep this stage's whole stash (everything saved between F and B) on host.
        offload_weights: keep the stage's weights on host between steps. In the step they come to
            the device an action ahead, into a slot that holds the stage the rank runs, beside the
            action before (a copy a GPU overlaps with it); two stages' weights are on the device
            while the next one arrives, so during the ticks this frees memory only where a rank
            runs three or more stages (interleaved with V >= 3).
        offload_optimizer_state: keep the stage's optimizer state on host between steps.
        keep_gathered: under FSDP, gather the stage's weights once per step and keep them (and their
            gradient, whole) until the step's end, instead of gathering for every action and
            reduce-scattering after every backward: less traffic, more memory.
        recompute_layers: recompute the stage's first ``k`` layers whole: each keeps only its input
            and repeats its forward in the backward, whatever ``base`` says for the rest of the
            stage -- full recompute by the layer, between a cell's selective and its recompute-all.

    Bound to a model's :class:`TagSet` (:meth:`bind`) it becomes a :class:`BoundStagePolicy`, the
    concrete sets of tags saved, offloaded and recomputed.

    >>> StagePolicy(base="selective", tags={"mlp_hidden": "offload"}).describe()
    'selective; offload mlp_hidden'
    """

    base: str = "save-all"
    tags: tuple[tuple[str, Decision], ...] = ()
    offload_stash: bool = False
    offload_weights: bool = False
    offload_optimizer_state: bool = False
    keep_gathered: bool = False
    recompute_layers: int = 0

    def __post_init__(self):
        if self.base == "offload-all":  # the older name
            object.__setattr__(self, "base", "offload-tags")
        if self.base not in BASES:
            raise PolicyError(f"unknown policy base {self.base!r}; bases: {', '.join(BASES)}")
        k = self.recompute_layers
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise PolicyError(f"recompute_layers is a count of layers >= 0, got {k!r}")
        items = self.tags.items() if isinstance(self.tags, Mapping) else self.tags
        decisions = {str(tag): _decision(str(tag), value) for tag, value in items}
        object.__setattr__(self, "tags", tuple(sorted(decisions.items())))

    def with_decisions(self, decisions: Mapping[str, str | Decision]) -> StagePolicy:
        merged = dict(self.tags)
        merged.update({tag: _decision(tag, value) for tag, value in decisions.items()})
        return dataclasses.replace(self, tags=tuple(merged.items()))

    def bind(self, tags: TagSet, where: str = "policy") -> BoundStagePolicy:
        """The concrete decisions for a model's tags; a tag it does not declare is an error."""
        save, offload = (set(x) for x in _base_sets(self.base, tags))
        for tag, decision in self.tags:
            tags.check(tag, where)
            save.discard(tag)
            offload.discard(tag)
            if decision is Decision.SAVE:
                save.add(tag)
            elif decision is Decision.OFFLOAD:
                offload.add(tag)
        return BoundStagePolicy(
            save=frozenset(save),
            offload=frozenset(offload),
            recompute=frozenset(tags.names) - save - offload,
            order=tags.names,
            offload_stash=self.offload_stash,
            offload_weights=self.offload_weights,
            offload_optimizer_state=self.offload_optimizer_state,
            keep_gathered=self.keep_gathered,
            recompute_layers=self.recompute_layers,
        )

    def describe(self) -> str:
        parts = [self.base]
        for kind in Decision:
            named = [tag for tag, d in self.tags if d is kind]
            if named:
                parts.append(f"{kind.value} {','.join(named)}")
        return "; ".join(parts) + _extras(self)


def _extras(sp) -> str:
    extras = [
        name
        for name, on in (
            (f"first {sp.recompute_layers} layer(s) recomputed whole", sp.recompute_layers),
            ("stash->host", sp.offload_stash),
            ("weights->host", sp.offload_weights),
            ("opt-state->host", sp.offload_optimizer_state),
            ("weights gathered F->B", sp.keep_gathered),
        )
        if on
    ]
    return "" if not extras else " + " + ", ".join(extras)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundStagePolicy:
    """A :class:`StagePolicy` bound to a model's tags: what the executor lowers.

    Attributes:
        save: tags kept on device from forward to backward.
        offload: tags moved to host after the forward and brought back for the backward.
        recompute: the model's other tags, recomputed in the backward from the saved values (as is
            every untagged intermediate); the stage input is always kept.
        order: the model's tags in forward order (for display).
        offload_stash, offload_weights, offload_optimizer_state, keep_gathered, recompute_layers: as in
            :class:`StagePolicy`.
    """

    save: frozenset[str]
    offload: frozenset[str] = frozenset()
    recompute: frozenset[str] = frozenset()
    order: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    offload_stash: bool = False
    offload_weights: bool = False
    offload_optimizer_state: bool = False
    keep_gathered: bool = False
    recompute_layers: int = 0

    def decision(self, tag: str) -> Decision:
        if tag in self.save:
            return Decision.SAVE
        if tag in self.offload:
            return Decision.OFFLOAD
        if tag in self.recompute:
            return Decision.RECOMPUTE
        raise PolicyError(f"unknown activation tag {tag!r}; the model declares: {', '.join(self.order)}")

    def checkpoint_policy(self):
        """The ``jax.checkpoint`` policy this lowers to (imports JAX)."""
        import jax

        names = jax.checkpoint_policies
        if not self.offload:
            return names.save_only_these_names(*sorted(self.save))
        return names.save_and_offload_only_these_names(
            names_which_can_be_saved=sorted(self.save),
            names_which_can_be_offloaded=sorted(self.offload),
            offload_src="device",
            offload_dst="pinned_host",
        )

    def wrap(self, stage_fn: Callable) -> Callable:
        """``jax.checkpoint`` of the whole stage function with this policy (``recompute_layers`` is the
        stage function's to apply: :func:`jaxmem.pipeline.stage_forward`)."""
        import jax

        return jax.checkpoint(stage_fn, policy=self.checkpoint_policy())

    def whole_layer(self) -> BoundStagePolicy:
        """What one of the ``recompute_layers`` does: this policy as recompute-all (every tag
        recomputed), no layer recomputed apart."""
        tags = self.save | self.offload | self.recompute
        return dataclasses.replace(self, save=frozenset(), offload=frozenset(), recompute=tags, recompute_layers=0)

    def describe(self) -> str:
        if not self.recompute and not self.offload:
            core = "save-all"
        elif not self.save and not self.offload:
            core = "recompute-all"
        else:
            parts = []
            if self.recompute:
                parts.append("recompute " + ",".join(t for t in self.order if t in self.recompute))
            if self.offload:
                parts.append("offload " + ",".join(t for t in self.order if t in self.offload))
            core = "; ".join(parts)
        return core + _extras(self)


PRESETS: dict[str, StagePolicy] = {
    "save-all": StagePolicy(),
    "recompute-all": StagePolicy(base="recompute-all"),
    "selective": StagePolicy(base="selective"),
    "offload-stash": StagePolicy(offload_stash=True),
    "offload-weights": StagePolicy(offload_weights=True),
    "offload-optimizer-state": StagePolicy(offload_optimizer_state=True),
    "offload-tags": StagePolicy(base="offload-tags"),
}
KEEP_GATHERED = "+keep-gathered"  # a preset name with this suffix keeps FSDP's gathered weights F->B
PRESET_HELP = {
    "save-all": "keep every declared activation tag on device (no recompute)",
    "recompute-all": "keep only each stage's input; recompute the whole stage in the backward",
    "selective": "keep all but the model's quadratic tags (attention probabilities), recomputed (Megatron-style)",
    "offload-stash": "save-all, with each stage's stash kept on host between F and B",
    "offload-weights": "save-all, with stage weights on host between steps",
    "offload-optimizer-state": "save-all, with stage optimizer state on host between steps",
    "offload-tags": "offload every declared activation tag to host (checkpoint offload policy)",
}


def microbatch_classes(schedule) -> dict[str, frozenset[tuple[int, int]]]:
    """Microbatch classes a policy may name, as sets of (stage, microbatch).

    ``warmup``: the microbatches a stage runs forward before its first backward -- they wait longest
    for their backward in 1F1B-like schedules. ``steady``: the others. ``mb<i>``: microbatch i. Only
    non-empty classes are valid names.
    """
    return dict(_microbatch_classes(schedule))


@functools.lru_cache(maxsize=512)
def _microbatch_classes(schedule) -> Mapping[str, frozenset[tuple[int, int]]]:
    from jaxmem.schedule import Kind

    classes: dict[str, set] = {"warmup": set(), "steady": set()}
    for rank in range(schedule.num_ranks):
        seen_backward: set[int] = set()
        for a in schedule.actions(rank):
            if a.kind is Kind.F:
                key = "steady" if a.stage in seen_backward else "warmup"
                classes[key].add((a.stage, a.microbatch))
            else:
                seen_backward.add(a.stage)
    for m in range(schedule.num_microbatches):
        classes[f"mb{m}"] = {(s, m) for s in range(schedule.num_stages)}
    return types.MappingProxyType({name: frozenset(cells) for name, cells in classes.items() if cells})


@dataclasses.dataclass(frozen=True)
class Policy:
    """A memory policy: a default StagePolicy, overrides per stage and per microbatch class, and
    explicit per-(stage, microbatch) cells (what generated policies such as Chronos-Recomp use).

    Precedence, most specific first: cell, stage + microbatch class, stage, microbatch class, default.
    """

    default: StagePolicy = StagePolicy()
    stages: tuple[tuple[int, StagePolicy], ...] = ()
    microbatch: tuple[tuple[str, StagePolicy], ...] = ()
    stage_microbatch: tuple[tuple[int, str, StagePolicy], ...] = ()
    cells: tuple[tuple[int, int, StagePolicy], ...] = ()
    name: str = dataclasses.field(default="custom", compare=False)

    def __str__(self) -> str:
        return self.name

    def resolve(self, schedule, tags: TagSet) -> ResolvedPolicy:
        """Check the policy against a schedule and a model's tags, and give every (stage, microbatch)
        its :class:`BoundStagePolicy`."""
        S, M = schedule.num_stages, schedule.num_microbatches
        for stage, _ in self.stages:
            _check_stage(stage, S)
        classes = _microbatch_classes(schedule)
        for cls, _ in self.microbatch:
            _check_class(cls, classes, schedule)
        for stage, cls, _ in self.stage_microbatch:
            _check_stage(stage, S)
            _check_class(cls, classes, schedule)
        for stage, mb, _ in self.cells:
            _check_stage(stage, S)
            if not 0 <= mb < M:
                raise PolicyError(f"policy cell names microbatch {mb}; the schedule has microbatches 0..{M - 1}")
        bound: dict[StagePolicy, BoundStagePolicy] = {}

        def bind(sp: StagePolicy, where: str) -> BoundStagePolicy:
            if sp not in bound:
                bound[sp] = sp.bind(tags, where)
            return bound[sp]

        # Bind every spec once, so a bad tag is reported where it was written, used or not.
        bind(self.default, f"policy {self.name!r}")
        for stage, sp in self.stages:
            bind(sp, f"policy {self.name!r}, stage {stage}")
        for cls, sp in self.microbatch:
            bind(sp, f"policy {self.name!r}, microbatch {cls}")
        for stage, cls, sp in self.stage_microbatch:
            bind(sp, f"policy {self.name!r}, stage {stage} microbatch {cls}")
        for stage, mb, sp in self.cells:
            bind(sp, f"policy {self.name!r}, cell ({stage}, {mb})")
        by_stage = dict(self.stages)
        by_id: dict[int, BoundStagePolicy] = {}

        def bound_of(sp: StagePolicy) -> BoundStagePolicy:
            # By identity first: hashing a stage policy costs more than the rest of these loops, and
            # a planner resolves thousands of policies over hundreds of cells (each spec is held by
            # this policy, so its id stays its own).
            if id(sp) not in by_id:
                by_id[id(sp)] = bound[sp]
            return by_id[id(sp)]

        table: dict[tuple[int, int], BoundStagePolicy] = {}
        for s in range(S):
            for m in range(M):
                chosen = by_stage.get(s, self.default)
                if s not in by_stage:
                    for cls, sp in self.microbatch:
                        if (s, m) in classes[cls]:
                            chosen = sp
                for stage, cls, sp in self.stage_microbatch:
                    if stage == s and (s, m) in classes[cls]:
                        chosen = sp
                table[(s, m)] = bound_of(chosen)
        for s, m, sp in self.cells:
            table[(s, m)] = bound_of(sp)
        return ResolvedPolicy.build(self, schedule, table)


def _check_stage(stage: int, num_stages: int) -> None:
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise PolicyError(f"policy names stage {stage!r}; the schedule has stages 0..{num_stages - 1}")


def _check_class(cls: str, classes: Mapping, schedule) -> None:
    if cls not in classes:
        names = [n for n in classes if not n.startswith("mb")] + [f"mb0..mb{schedule.num_microbatches - 1}"]
        raise PolicyError(
            f"policy names microbatch class {cls!r}, which schedule {schedule.name!r} does not have; "
            f"valid classes: {', '.join(names)}"
        )


@dataclasses.dataclass(frozen=True)
class ResolvedPolicy:
    """A policy checked against one schedule.

    Attributes:
        policy: the source policy.
        variants: the distinct bound stage policies in use (each compiles to its own executor branches).
        variant_of: (stage, microbatch) -> index into ``variants``.
    """

    policy: Policy
    variants: tuple[BoundStagePolicy, ...]
    variant_of: Mapping[tuple[int, int], int] = dataclasses.field(hash=False)
    num_stages: int = 0
    num_microbatches: int = 0

    @classmethod
    def build(cls, policy: Policy, schedule, table: Mapping[tuple[int, int], BoundStagePolicy]) -> ResolvedPolicy:
        index_of: dict[BoundStagePolicy, int] = {}  # variants in order of first appearance
        by_id: dict[int, int] = {}  # the same object's index without hashing it again
        variant_of = {}
        for key in sorted(table):
            sp = table[key]
            if id(sp) not in by_id:
                by_id[id(sp)] = index_of.setdefault(sp, len(index_of))
            variant_of[key] = by_id[id(sp)]
        resolved = cls(policy, tuple(index_of), variant_of, schedule.num_stages, schedule.num_microbatches)
        resolved._check_state_offload(schedule)
        return resolved

    def stage_policy(self, stage: int, microbatch: int) -> BoundStagePolicy:
        return self.variants[self.variant_of[(stage, microbatch)]]

    def _stage_flag(self, stage: int, flag: str) -> bool:
        # Read once per stage and flag: the ledger asks for every stage of every prediction, and a
        # planner predicts thousands of policies over schedules of hundreds of microbatches.
        flags = self.__dict__.setdefault("_flags", {})  # not a field: equality and hashing ignore it
        if (stage, flag) not in flags:
            values = {getattr(self.stage_policy(stage, m), flag) for m in range(self.num_microbatches)}
            if len(values) > 1:
                raise PolicyError(
                    f"{flag} differs between microbatches of stage {stage}; weights and optimizer state are "
                    "per stage, so set it per stage"
                )
            flags[(stage, flag)] = values.pop()
        return flags[(stage, flag)]

    def offload_weights(self, stage: int) -> bool:
        return self._stage_flag(stage, "offload_weights")

    def offload_optimizer_state(self, stage: int) -> bool:
        return self._stage_flag(stage, "offload_optimizer_state")

    def keep_gathered(self, stage: int) -> bool:
        return self._stage_flag(stage, "keep_gathered")

    def _check_state_offload(self, schedule) -> None:
        # One SPMD program: the stages at the same local position on every rank share one array, so
        # their weights (and optimizer state) are on host together or not at all, and kept gathered so.
        for flag in ("offload_weights", "offload_optimizer_state", "keep_gathered"):
            by_local: dict[int, dict[int, bool]] = {}
            for rank in range(schedule.num_ranks):
                for v, stage in enumerate(schedule.stages_of(rank)):
                    by_local.setdefault(v, {})[stage] = self._stage_flag(stage, flag)
            for v, values in by_local.items():
                if len(set(values.values())) > 1:
                    on = sorted(s for s, x in values.items() if x)
                    raise PolicyError(
                        f"{flag} is set for stages {on} but not for the other stages at local position {v} "
                        f"({sorted(values)}); every rank's stage {v} shares one array in the SPMD program, "
                        f"so set {flag} for all of {sorted(values)} or none"
                    )

    def describe(self) -> dict:
        return {
            "name": self.policy.name,
            "variants": [sp.describe() for sp in self.variants],
            "stages": {
                s: sorted({self.variants[self.variant_of[(s, m)]].describe() for m in range(self.num_microbatches)})
                for s in range(self.num_stages)
            },
        }


# --------------------------------------------------------------------------- specs
FLAGS = ("offload_stash", "offload_weights", "offload_optimizer_state", "keep_gathered")
STAGE_KEYS = ("base", "tags", "recompute_layers", *FLAGS)


def _preset(name: str, where: str) -> StagePolicy:
    """A preset by name; ``<preset>+keep-gathered`` is that preset with ``keep_gathered`` set."""
    key = str(name).strip().lower()
    if key.endswith(KEEP_GATHERED):
        return dataclasses.replace(_preset(key.removesuffix(KEEP_GATHERED), where), keep_gathered=True)
    if key not in PRESETS:
        raise PolicyError(
            f"{where}: unknown policy preset {name!r}; presets: {', '.join(PRESETS)} (each may end in "
            f"{KEEP_GATHERED!r}: FSDP keeps a stage's gathered weights from its first F to the step's end)"
        )
    return PRESETS[key]


def _tag_decisions(table: Mapping, where: str, reserved=()) -> dict:
    """The keys of a spec table that are not spec keys: per-tag decisions (checked against the
    model's tags when the policy is resolved)."""
    decisions = {}
    for key, value in table.items():
        if key in STAGE_KEYS or key in reserved:
            continue
        if not isinstance(value, str):
            valid = ", ".join((*STAGE_KEYS, *reserved))
            raise PolicyError(
                f"{where}: unknown key {key!r} = {value!r}; valid keys: {valid}, or a tag name set to save, "
                "recompute or offload"
            )
        decisions[key] = value
    return decisions


def _stage_policy_from(value, where: str, enclosing: StagePolicy | None = None) -> StagePolicy:
    """A stage policy from a preset name or a table. A table without its own ``base`` builds on the
    enclosing table's policy (its base, tag decisions and flags; save-all at the top level); one with a
    ``base`` starts again from that preset."""
    if isinstance(value, StagePolicy):
        return value
    if isinstance(value, str):
        return _preset(value, where)
    if isinstance(value, Mapping):
        if "base" in value or enclosing is None:
            sp = _preset(value.get("base", "save-all"), where)
        else:
            sp = enclosing
        decisions = dict(value.get("tags", {}))
        decisions.update(_tag_decisions(value, where))
        sp = sp.with_decisions(decisions)
        if "recompute_layers" in value:
            k = value["recompute_layers"]
            if not isinstance(k, int) or isinstance(k, bool):
                raise PolicyError(f"{where}: recompute_layers is a count of layers, got {k!r}")
            sp = dataclasses.replace(sp, recompute_layers=k)
        return dataclasses.replace(sp, **{k: bool(value[k]) for k in FLAGS if k in value})
    raise PolicyError(f"{where}: a stage policy is a preset name or a table, got {type(value).__name__}")


def resolve(spec, schedule, tags: TagSet) -> ResolvedPolicy:
    """A policy spec (anything :func:`from_spec` takes) checked against ``schedule`` and a model's
    ``tags``; a :class:`ResolvedPolicy` passes through (checked to be for a schedule of that shape),
    so a caller that resolved once hands the result down instead of resolving again."""
    if isinstance(spec, ResolvedPolicy):
        if (spec.num_stages, spec.num_microbatches) != (schedule.num_stages, schedule.num_microbatches):
            raise PolicyError(
                f"policy {spec.policy.name} was resolved for {spec.num_stages} stages x {spec.num_microbatches} "
                f"microbatches, not this schedule's {schedule.num_stages} x {schedule.num_microbatches}"
            )
        return spec
    return from_spec(spec).resolve(schedule, tags)


def from_spec(spec) -> Policy:
    """Normalise a policy spec.

    Accepts a :class:`Policy`; a :class:`StagePolicy` (every stage); a preset name (``save-all``,
    ``recompute-all``, ``selective``, ``offload-stash``, ``offload-weights``,
    ``offload-optimizer-state``, ``offload-tags``); a path to a ``.toml`` file; or a dict / TOML table::

        base = "selective"                 # the default for every stage (a preset)
        attn_probs = "offload"             # per-tag decisions for every stage (the model's tag names)
        [stage.0]                          # overrides for stage 0
        base = "recompute-all"
        [microbatch.warmup]                # overrides for a microbatch class (warmup, steady, mb3, ...)
        mlp_hidden = "offload"
        [stage.1.microbatch.warmup]        # stage 1's warmup microbatches only
        base = "recompute-all"
        [stage.2]
        recompute_layers = 3               # its first 3 layers recomputed whole (each keeps its input)

    A table without its own ``base`` builds on the table around it: ``[stage.1]`` with only
    ``mlp_hidden = "offload"`` is the top-level policy (here selective, attention probabilities
    offloaded) with that one decision added; ``base = ...`` starts again from that preset. Tag names
    are checked against the model's declared tags when the policy is resolved.

    >>> from_spec("recompute-all").default.base
    'recompute-all'
    >>> stage, policy = from_spec({"base": "save-all", "stage": {"0": "recompute-all"}}).stages[0]
    >>> stage, policy.base
    (0, 'recompute-all')
    """
    if isinstance(spec, Policy):
        return spec
    if spec is None:
        return Policy(name="save-all")
    if isinstance(spec, StagePolicy):
        return Policy(default=spec, name=spec.describe())
    if isinstance(spec, (str, os.PathLike)):
        text = str(spec).strip()
        if text.lower().endswith(".toml"):
            from jaxmem._util import load_toml

            policy = from_spec(load_toml(text))
            return dataclasses.replace(policy, name=os.path.basename(text))
        return Policy(default=_stage_policy_from(text, "policy"), name=text.lower())
    if isinstance(spec, Mapping):
        sections = ("stage", "microbatch", "name")
        _tag_decisions(spec, "policy", reserved=sections)
        top = {k: v for k, v in spec.items() if k not in sections}
        default = _stage_policy_from(top, "policy")
        stages, stage_mb, micro = [], [], []
        for key, value in dict(spec.get("stage", {})).items():
            try:
                stage = int(key)
            except ValueError:
                raise PolicyError(f"policy: [stage.{key}] is not a stage number") from None
            value = dict(value) if isinstance(value, Mapping) else value
            per_mb = value.pop("microbatch", {}) if isinstance(value, dict) else {}
            own = default
            if not isinstance(value, dict) or value:
                own = _stage_policy_from(value, f"stage {stage}", default)
                stages.append((stage, own))
            for cls, sub in per_mb.items():
                stage_mb.append((stage, cls, _stage_policy_from(sub, f"stage {stage}, microbatch {cls}", own)))
        for cls, value in dict(spec.get("microbatch", {})).items():
            micro.append((cls, _stage_policy_from(value, f"microbatch {cls}", default)))
        return Policy(
            default=default,
            stages=tuple(sorted(stages, key=lambda x: x[0])),
            microbatch=tuple(micro),
            stage_microbatch=tuple(stage_mb),
            name=str(spec.get("name", "custom")),
        )
    raise PolicyError(f"a policy spec is a preset name, a .toml file, a dict or a Policy; got {type(spec).__name__}")
