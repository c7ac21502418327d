"""Memory policies: per stage (and per microbatch) decide for each named activation whether it is saved
on device, recomputed in the backward, or offloaded to host; and whether a stage's stash, weights and
optimizer state live on host between uses.

A :class:`Policy` is a frozen, hashable value. ``from_spec`` turns a friendly spec (a preset name, a
dict, a TOML table or file) into one. ``Policy.resolve(schedule)`` checks it against a schedule
(stage numbers, microbatch classes) and gives each (stage, microbatch) its :class:`StagePolicy`; a
StagePolicy lowers to a ``jax.checkpoint`` policy over the whole stage function (name-based:
``save_only_these_names`` / ``save_and_offload_only_these_names``) and to memory kinds in the executor.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable, Mapping

from jaxmem._errors import JaxmemError

__all__ = [
    "ALL_TAGS",
    "Decision",
    "Policy",
    "PolicyError",
    "PRESETS",
    "ResolvedPolicy",
    "StagePolicy",
    "from_spec",
    "microbatch_classes",
]

# Tags of the GPT's blocks and head (jaxmem.models.gpt.TAGS plus the head's logits). Kept here as
# strings so that policies import no JAX.
BLOCK_TAGS = (
    "attn_in",
    "q",
    "k",
    "v",
    "attn_probs",
    "attn_ctx",
    "attn_out",
    "mlp_in",
    "mlp_pre",
    "mlp_hidden",
    "block_out",
)
HEAD_TAGS = ("logits",)
ALL_TAGS = BLOCK_TAGS + HEAD_TAGS


class PolicyError(JaxmemError):
    """A policy spec is malformed or does not fit the model/schedule; lists the valid names."""


class Decision(enum.StrEnum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePolicy:
    """What one stage does with its activations, stash and state.

    Attributes:
        save: tags kept on device from forward to backward.
        offload: tags moved to host after the forward and brought back for the backward.
            Every other tag (and every untagged intermediate) is recomputed in the backward from the
            saved values; the stage input is always kept.
        offload_stash: keep this stage's whole stash (everything saved between F and B) on host.
        offload_weights: keep the stage's weights on host between steps, fetched when used.
        offload_optimizer_state: keep the stage's optimizer state on host between steps.
    """

    save: frozenset[str] = frozenset(ALL_TAGS)
    offload: frozenset[str] = frozenset()
    offload_stash: bool = False
    offload_weights: bool = False
    offload_optimizer_state: bool = False

    def __post_init__(self):
        object.__setattr__(self, "save", frozenset(self.save))
        object.__setattr__(self, "offload", frozenset(self.offload))
        for tag in self.save | self.offload:
            _check_tag(tag)
        both = self.save & self.offload
        if both:
            raise PolicyError(f"tags {sorted(both)} are both saved and offloaded; pick one decision per tag")

    def decision(self, tag: str) -> Decision:
        _check_tag(tag)
        if tag in self.save:
            return Decision.SAVE
        if tag in self.offload:
            return Decision.OFFLOAD
        return Decision.RECOMPUTE

    @property
    def recompute(self) -> frozenset[str]:
        return frozenset(ALL_TAGS) - self.save - self.offload

    def with_decisions(self, decisions: Mapping[str, str | Decision]) -> StagePolicy:
        save, offload = set(self.save), set(self.offload)
        for tag, decision in decisions.items():
            _check_tag(tag)
            try:
                d = Decision(str(decision).lower())
            except ValueError:
                raise PolicyError(
                    f"tag {tag!r}: unknown decision {decision!r}; use save, recompute or offload"
                ) from None
            save.discard(tag)
            offload.discard(tag)
            if d is Decision.SAVE:
                save.add(tag)
            elif d is Decision.OFFLOAD:
                offload.add(tag)
        return dataclasses.replace(self, save=frozenset(save), offload=frozenset(offload))

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
        """``jax.checkpoint`` of the whole stage function with this policy."""
        import jax

        return jax.checkpoint(stage_fn, policy=self.checkpoint_policy())

    def describe(self) -> str:
        if self.save == frozenset(ALL_TAGS) and not self.offload:
            core = "save-all"
        elif not self.save and not self.offload:
            core = "recompute-all"
        else:
            parts = []
            if self.recompute:
                parts.append("recompute " + ",".join(t for t in ALL_TAGS if t in self.recompute))
            if self.offload:
                parts.append("offload " + ",".join(t for t in ALL_TAGS if t in self.offload))
            core = "; ".join(parts)
        extras = [
            name
            for name, on in (
                ("stash->host", self.offload_stash),
                ("weights->host", self.offload_weights),
                ("opt-state->host", self.offload_optimizer_state),
            )
            if on
        ]
        return core + ("" if not extras else " + " + ", ".join(extras))


def _check_tag(tag: str) -> None:
    if tag not in ALL_TAGS:
        raise PolicyError(f"unknown activation tag {tag!r}; valid tags: {', '.join(ALL_TAGS)}")


SAVE_ALL = StagePolicy()
RECOMPUTE_ALL = StagePolicy(save=frozenset())
# Megatron's selective recompute keeps everything but the attention core's quadratic tensors.
SELECTIVE = StagePolicy(save=frozenset(ALL_TAGS) - {"attn_probs"})

PRESETS: dict[str, StagePolicy] = {
    "save-all": SAVE_ALL,
    "recompute-all": RECOMPUTE_ALL,
    "selective": SELECTIVE,
    "offload-stash": dataclasses.replace(SAVE_ALL, offload_stash=True),
    "offload-weights": dataclasses.replace(SAVE_ALL, offload_weights=True),
    "offload-tags": StagePolicy(save=frozenset(), offload=frozenset(ALL_TAGS)),
}
PRESET_HELP = {
    "save-all": "keep every named activation on device (no recompute)",
    "recompute-all": "keep only each stage's input; recompute the whole stage in the backward",
    "selective": "keep all but the attention probabilities, which are recomputed (Megatron-style)",
    "offload-stash": "save-all, with each stage's stash kept on host between F and B",
    "offload-weights": "save-all, with stage weights on host between steps",
    "offload-tags": "offload every named activation to host (checkpoint offload policy)",
}


def microbatch_classes(schedule) -> dict[str, frozenset[tuple[int, int]]]:
    """Microbatch classes a policy may name, as sets of (stage, microbatch).

    ``warmup``: the microbatches a stage runs forward before its first backward -- they wait longest
    for their backward in 1F1B-like schedules. ``steady``: the others. ``mb<i>``: microbatch i. Only
    non-empty classes are valid names.
    """
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
    return {name: frozenset(cells) for name, cells in classes.items() if cells}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A memory policy: a default StagePolicy, overrides per stage and per microbatch class, and
    explicit per-(stage, microbatch) cells (what generated policies such as Chronos-Recomp use).

    Precedence, most specific first: cell, stage + microbatch class, stage, microbatch class, default.
    """

    default: StagePolicy = SAVE_ALL
    stages: tuple[tuple[int, StagePolicy], ...] = ()
    microbatch: tuple[tuple[str, StagePolicy], ...] = ()
    stage_microbatch: tuple[tuple[int, str, StagePolicy], ...] = ()
    cells: tuple[tuple[int, int, StagePolicy], ...] = ()
    name: str = dataclasses.field(default="custom", compare=False)

    def __str__(self) -> str:
        return self.name

    def resolve(self, schedule) -> ResolvedPolicy:
        """Check the policy against a schedule and give every (stage, microbatch) its StagePolicy."""
        S, M = schedule.num_stages, schedule.num_microbatches
        for stage, _ in self.stages:
            _check_stage(stage, S)
        classes = microbatch_classes(schedule)
        for cls, _ in self.microbatch:
            _check_class(cls, classes, schedule)
        for stage, cls, _ in self.stage_microbatch:
            _check_stage(stage, S)
            _check_class(cls, classes, schedule)
        for stage, mb, _ in self.cells:
            _check_stage(stage, S)
            if not 0 <= mb < M:
                raise PolicyError(f"policy cell names microbatch {mb}; the schedule has microbatches 0..{M - 1}")
        by_stage = dict(self.stages)
        table: dict[tuple[int, int], StagePolicy] = {}
        for s in range(S):
            for m in range(M):
                chosen = by_stage.get(s, self.default)
                for cls, sp in self.microbatch:
                    if (s, m) in classes[cls] and s not in by_stage:
                        chosen = sp
                for stage, cls, sp in self.stage_microbatch:
                    if stage == s and (s, m) in classes[cls]:
                        chosen = sp
                table[(s, m)] = chosen
        for s, m, sp in self.cells:
            table[(s, m)] = sp
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
        variants: the distinct StagePolicies in use (each compiles to its own executor branches).
        variant_of: (stage, microbatch) -> index into ``variants``.
    """

    policy: Policy
    variants: tuple[StagePolicy, ...]
    variant_of: Mapping[tuple[int, int], int] = dataclasses.field(hash=False)
    num_stages: int = 0
    num_microbatches: int = 0

    @classmethod
    def build(cls, policy: Policy, schedule, table: Mapping[tuple[int, int], StagePolicy]) -> ResolvedPolicy:
        variants: list[StagePolicy] = []
        variant_of = {}
        for key in sorted(table):
            sp = table[key]
            if sp not in variants:
                variants.append(sp)
            variant_of[key] = variants.index(sp)
        resolved = cls(policy, tuple(variants), variant_of, schedule.num_stages, schedule.num_microbatches)
        resolved._check_state_offload(schedule)
        return resolved

    def stage_policy(self, stage: int, microbatch: int) -> StagePolicy:
        return self.variants[self.variant_of[(stage, microbatch)]]

    def _stage_flag(self, stage: int, flag: str) -> bool:
        values = {getattr(self.stage_policy(stage, m), flag) for m in range(self.num_microbatches)}
        if len(values) > 1:
            raise PolicyError(
                f"{flag} differs between microbatches of stage {stage}; weights and optimizer state are "
                "per stage, so set it per stage"
            )
        return values.pop()

    def offload_weights(self, stage: int) -> bool:
        return self._stage_flag(stage, "offload_weights")

    def offload_optimizer_state(self, stage: int) -> bool:
        return self._stage_flag(stage, "offload_optimizer_state")

    def _check_state_offload(self, schedule) -> None:
        # One SPMD program: the stages at the same local position on every rank share one array, so
        # their weights (and optimizer state) are on host together or not at all.
        for flag in ("offload_weights", "offload_optimizer_state"):
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
def _stage_policy_from(value, where: str) -> StagePolicy:
    if isinstance(value, StagePolicy):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in PRESETS:
            raise PolicyError(f"{where}: unknown policy preset {value!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[key]
    if isinstance(value, Mapping):
        known = {"base", "tags", "offload_stash", "offload_weights", "offload_optimizer_state"}
        unknown = set(value) - known - set(ALL_TAGS)
        if unknown:
            raise PolicyError(
                f"{where}: unknown keys {sorted(unknown)}; use base, tags, offload_stash, offload_weights, "
                f"offload_optimizer_state, or tag names ({', '.join(ALL_TAGS)})"
            )
        sp = _stage_policy_from(value.get("base", "save-all"), where)
        decisions = dict(value.get("tags", {}))
        decisions.update({k: v for k, v in value.items() if k in ALL_TAGS})
        sp = sp.with_decisions(decisions)
        flags = {
            k: bool(value[k]) for k in ("offload_stash", "offload_weights", "offload_optimizer_state") if k in value
        }
        return dataclasses.replace(sp, **flags)
    raise PolicyError(f"{where}: a stage policy is a preset name or a table, got {type(value).__name__}")


def from_spec(spec) -> Policy:
    """Normalise a policy spec.

    Accepts a :class:`Policy`; a preset name (``save-all``, ``recompute-all``, ``selective``,
    ``offload-stash``, ``offload-weights``, ``offload-tags``); a path to a ``.toml`` file; or a dict /
    TOML table::

        base = "selective"                 # the default for every stage (a preset)
        attn_probs = "offload"             # per-tag decisions for every stage
        [stage.0]                          # overrides for stage 0
        base = "recompute-all"
        [microbatch.warmup]                # overrides for a microbatch class (warmup, steady, mb3, ...)
        mlp_hidden = "offload"
        [stage.1.microbatch.warmup]        # stage 1's warmup microbatches only
        base = "recompute-all"

    >>> from_spec("recompute-all").default.save
    frozenset()
    >>> from_spec({"base": "save-all", "stage": {"0": "recompute-all"}}).stages[0][0]
    0
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
            from jaxmem.cli._common import load_toml

            policy = from_spec(load_toml(text))
            return dataclasses.replace(policy, name=os.path.basename(text))
        return Policy(default=_stage_policy_from(text, "policy"), name=text.lower())
    if isinstance(spec, Mapping):
        known = {
            "base",
            "tags",
            "offload_stash",
            "offload_weights",
            "offload_optimizer_state",
            "stage",
            "microbatch",
            "name",
        } | set(ALL_TAGS)
        unknown = set(spec) - known
        if unknown:
            raise PolicyError(f"policy: unknown keys {sorted(unknown)}; valid keys: {', '.join(sorted(known))}")
        top = {k: v for k, v in spec.items() if k not in ("stage", "microbatch", "name")}
        default = _stage_policy_from(top, "policy")
        stages, stage_mb, micro = [], [], []
        for key, value in dict(spec.get("stage", {})).items():
            try:
                stage = int(key)
            except ValueError:
                raise PolicyError(f"policy: [stage.{key}] is not a stage number") from None
            value = dict(value) if isinstance(value, Mapping) else value
            per_mb = value.pop("microbatch", {}) if isinstance(value, dict) else {}
            if not isinstance(value, dict) or value:
                stages.append((stage, _stage_policy_from(value, f"stage {stage}")))
            for cls, sub in per_mb.items():
                stage_mb.append((stage, cls, _stage_policy_from(sub, f"stage {stage}, microbatch {cls}")))
        for cls, value in dict(spec.get("microbatch", {})).items():
            micro.append((cls, _stage_policy_from(value, f"microbatch {cls}")))
        return Policy(
            default=default,
            stages=tuple(sorted(stages, key=lambda x: x[0])),
            microbatch=tuple(micro),
            stage_microbatch=tuple(stage_mb),
            name=str(spec.get("name", "custom")),
        )
    raise PolicyError(f"a policy spec is a preset name, a .toml file, a dict or a Policy; got {type(spec).__name__}")
