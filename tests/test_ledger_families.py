"""The ledger on decoder families it was never fitted on (``tests/families.py``): within 10% of the
compiled step's ``memory_analysis()`` and never under it by more than 5%. One configuration per
family, each on another schedule and policy; ``benchmarks/ledger_fit.py`` covers every schedule and
policy for every family."""

import pytest
from families import family, ledger_against_compiled

from jaxmem.memory import model_facts
from jaxmem.policy import PRESETS

CASES = [
    ("mqa", "zbv", "recompute-all", {}),
    ("wide", "gpipe", "selective", {}),
    ("moe", "interleaved-1f1b", "save-all", {}),
    ("parallel", "chronos", "recompute-all", {}),
    # Layers of two parameter families; at P=2 the first stage holds two dense and two MoE layers.
    ("dense-moe", "1f1b", "selective", {"pipe": 2}),
    # W takes I's cotangents: they wait in their arenas from I to W; the working set is I's or W's.
    ("mqa-split", "chronos", "recompute-all", {"split_backward": True}),
]


@pytest.mark.parametrize("name,schedule,policy,axes", CASES, ids=[c[0] for c in CASES])
def test_the_ledger_holds_for_a_family_it_was_not_fitted_on(name, schedule, policy, axes):
    _, _, error = ledger_against_compiled(family(name.removesuffix("-split")), schedule, policy, **axes)
    assert -0.05 <= error <= 0.10, (name, schedule, policy, error)


def test_a_stage_of_layers_of_two_families_is_composed_layer_by_layer():
    """A stage mixing dense and MoE layers is priced from one and two layers of each family: its
    stash and FLOPs equal the direct trace of the whole stage (what the ledger extrapolates from)."""
    facts = model_facts(family("dense-moe"))
    policy = PRESETS["selective"].bind(family("dense-moe").tags)
    fams = (0, 1, 1, 0)
    composed = facts.stage(first=True, last=False, layers=4, families=fams, policy=policy, microbatch=1, seq=32)
    direct = facts._traced(True, False, fams, policy, 32)
    assert composed.stash_elems == direct.stash_elems
    for name in ("forward_flops", "backward_flops", "full_bytes"):
        assert getattr(composed, name) == pytest.approx(getattr(direct, name), rel=1e-6), name


def test_the_working_set_is_read_from_the_compiled_pullback_and_grows_with_what_it_rebuilds():
    """The backward's working set comes from the program: a stage that recomputes everything holds
    more while it runs its backward than one that kept its activations, per sequence the same at
    any microbatch, and a stage of more layers holds more."""
    facts = model_facts(family("mqa"))
    tags = family("mqa").tags
    shape = dict(first=False, last=False, seq=64)
    saved = facts.stage(policy=PRESETS["save-all"].bind(tags), layers=2, microbatch=4, **shape)
    redone = facts.stage(policy=PRESETS["recompute-all"].bind(tags), layers=2, microbatch=4, **shape)
    assert redone.working_bytes > saved.working_bytes > 0
    assert facts.stage(policy=PRESETS["save-all"].bind(tags), layers=2, microbatch=8, **shape).working_bytes == (
        2 * saved.working_bytes
    )
    deeper = facts.stage(policy=PRESETS["save-all"].bind(tags), layers=4, microbatch=4, **shape)
    assert deeper.working_bytes > saved.working_bytes
