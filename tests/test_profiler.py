"""The online profiler: signatures, cached programs, escalation under a tight budget, infeasible budgets."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config import TrainConfig
from jaxmem.profiler import AdaptiveProfiler, BudgetError
from jaxmem.train import Trainer

MiB = 2**20


@pytest.fixture(scope="module")
def trainer():
    return Trainer(TrainConfig(pipe=2, microbatches=2, batch_size=4, seq_len=32))


def _batch(trainer, state, seq):
    batch = dataclasses.replace(state.data, seq_len=seq).batch_at(0)
    return trainer.put_batch(batch)


def _profiler(trainer, budget, **kw):
    return AdaptiveProfiler(trainer.pipeline, budget, build_step=trainer.build_step, **kw)


def _fastest(profiler, seq, drop=frozenset()):
    """The policy predicted fastest for a shape (what a budget every policy fits picks: on this CPU,
    where stashing costs more than recomputing, not save-all)."""
    return min(
        profiler.policies, key=lambda p: (round(profiler.predict(p, 4, seq, drop)[1], 9), profiler.policies.index(p))
    )


def test_new_shapes_and_layer_drop_are_new_signatures_and_programs_are_reused(trainer):
    state = trainer.init_state()
    profiler = _profiler(trainer, 64 * MiB)
    for seq, drop in [(16, ()), (32, ()), (16, ()), (16, (3,)), (32, ())]:
        state, loss = profiler.step(state, _batch(trainer, state, seq), frozenset(drop))
    assert len(profiler.records) == 3 and profiler.compile_count == 3
    seen = {r.label: r.seen for r in profiler.records}
    assert seen == {"batch 4 x seq 16": 2, "batch 4 x seq 32": 2, "batch 4 x seq 16, drop layers [3]": 1}
    # A budget every policy fits: each signature runs the policy predicted fastest for it.
    assert all(r.policy == _fastest(profiler, r.signature[0][1], frozenset(r.signature[2])) for r in profiler.records)
    assert profiler.overhead_seconds < 0.01 * sum(sum(r.step_seconds) for r in profiler.records)


def test_python_control_flow_is_caught_by_the_fingerprint(trainer):
    profiler = _profiler(trainer, 64 * MiB, fingerprint=True)
    tokens = jnp.zeros((4, 16), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens}
    mode = {"scale": 1}

    def program(t):  # stands for user code whose trace depends on Python state
        return t * 2 if mode["scale"] == 2 else t + 1

    first = profiler.signature(batch, fingerprint_fn=program)
    assert profiler.signature(batch, fingerprint_fn=program) == first
    mode["scale"] = 2
    assert profiler.signature(batch, fingerprint_fn=program) != first
    masked = profiler.signature({**batch, "loss_mask": jnp.ones((4, 16))}, fingerprint_fn=program)
    assert masked != profiler.signature(batch, fingerprint_fn=program)  # another batch structure: another program


def test_tight_budget_picks_recompute_and_fits(trainer):
    state = trainer.init_state()
    save_all = _profiler(trainer, 1e12).predict("save-all", 4, 32, frozenset())[0]
    recompute = _profiler(trainer, 1e12).predict("recompute-all", 4, 32, frozenset())[0]
    budget = (save_all + recompute) / 2
    profiler = _profiler(trainer, budget)
    profiler.step(state, _batch(trainer, state, 32))
    record = profiler.records[0]
    assert record.policy != "save-all" and record.compiled_bytes <= budget


def test_escalation_when_the_compiled_program_misses_the_budget(trainer, monkeypatch):
    """Save-all is predicted to fit, but its compiled program (made to miss by 2%, as a mispredicted
    one would) does not: the profiler escalates once, to a policy that does fit."""
    state = trainer.init_state()
    # Priced on the H100 profile, where save-all is the fastest (on this CPU recompute-all is, and
    # nothing lies beyond it to escalate to).
    probe = _profiler(trainer, 1e12, hardware="h100")
    budget = probe.predict("save-all", 4, 32, frozenset())[0] * 1.1
    profiler = _profiler(trainer, budget, margin=1.0, hardware="h100")
    real, calls = profiler._compiled_bytes, []

    def first_misses(*args):
        calls.append(1)
        return budget * 1.02 if len(calls) == 1 else real(*args)

    monkeypatch.setattr(profiler, "_compiled_bytes", first_misses)
    profiler.step(state, _batch(trainer, state, 32))
    record = profiler.records[0]
    assert record.escalated and record.compiles == 2 and len(calls) == 2
    assert record.policy != "save-all" and record.compiled_bytes <= budget


def test_infeasible_budget_is_a_clear_error_with_the_deficit(trainer):
    state = trainer.init_state()
    profiler = _profiler(trainer, 1 * MiB)
    with pytest.raises(BudgetError, match="MiB short") as info:
        profiler.step(state, _batch(trainer, state, 32))
    assert info.value.deficit > 0
    assert profiler.compile_count == 0  # found out before compiling


def test_exploring_times_an_untried_policy_in_the_background_and_keeps_the_faster(trainer):
    batch = _batch(trainer, trainer.init_state(), 16)

    def run(profiler, steps, wait_after=None):
        state, losses = trainer.init_state(), []  # the same initial state each time (steps donate it)
        for i in range(steps):
            state, loss = profiler.step(state, batch)
            losses.append(float(loss))
            if i + 1 == wait_after:
                profiler.close()  # wait for the background compile (a real run trains on meanwhile)
        return losses

    # Too short a run to pay for a compile: nothing is explored.
    reference = _profiler(trainer, 64 * MiB, horizon=8)
    expected = run(reference, 8)
    assert reference.compile_count == 1 and reference.records[0].explored is None

    profiler = _profiler(trainer, 64 * MiB)
    first = _fastest(profiler, 16)
    losses = run(profiler, 8, wait_after=3)  # 3 steps of the chosen program, 3 of the probe, 2 again
    record = profiler.records[0]
    explored = record.explored
    assert explored is not None and explored["instead_of"] == first
    assert explored["policy"] in set(profiler.policies) - {first}
    assert set(profiler.correction) == {first, explored["policy"]}  # both now measured here
    assert explored["step_seconds"] > 0 and explored["instead_of_step_seconds"] > 0  # both timed here
    assert record.policy == (explored["policy"] if explored["kept"] else first)
    assert profiler.compile_count == 2 and record.compiles == 2  # one profiling compile beyond the needed one
    assert record.seen == 8 and explored["reason"] == "never measured"
    # Every policy computes the same gradients: the probe steps train exactly as the chosen program.
    np.testing.assert_allclose(losses, expected, rtol=2e-5)
    # The decision came after the 8th step: the next step runs the program it kept.
    profiler.step(trainer.init_state(), batch)
    assert profiler.last_policy == record.policy

    # A later signature switches to a policy measured faster elsewhere (here: we say it was).
    state = trainer.init_state()
    batch = _batch(trainer, state, 32)
    state, _ = profiler.step(state, batch)
    second = profiler.records[1]
    faster = next(p for p in ("recompute-all", "selective", "save-all") if p != second.policy)
    profiler.correction[faster] = 1e-6
    for _ in range(2):
        state, _ = profiler.step(state, batch)
    probe = profiler.programs[profiler.signature(batch)].probe
    assert probe is not None and probe.policy == faster and probe.reason == "measured faster elsewhere"
    assert second.compiles == 2
    profiler.close()


def test_adaptive_train_cli(capsys, tmp_path):
    import json

    from jaxmem.cli import main

    report = tmp_path / "profile.json"
    argv = ["train", "--adaptive", "--budget", "64MiB", "--pipe", "2", "--microbatches", "2", "--batch-size", "4",
            "--seq-len-schedule", "16,32", "--profile-report", str(report), "--json", "--quiet",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
            "--sample-log", str(tmp_path / "samples.log")]  # fmt: skip
    code = main([*argv, "--steps", "4"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["signatures"] == 2 and summary["budget_violations"] == 0
    table = json.loads(report.read_text())["signatures"]
    assert {row["signature"] for row in table} == {"batch 4 x seq 16", "batch 4 x seq 32"}
    for row in table:
        assert {"policy", "predicted_device_bytes", "compiled_device_bytes", "step_seconds", "times_seen"} <= set(row)
    # An adaptive run checkpoints like any other: the rerun resumes at step 4, each sample used once.
    assert main([*argv, "--steps", "6"]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert (resumed["resumed_from"], resumed["steps"], resumed["steps_run"]) == (4, 6, 2)
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())[-1] == 6
    lines = [line.split() for line in (tmp_path / "samples.log").read_text().splitlines()]
    assert [int(x[0]) for x in lines] == list(range(1, 7))
    assert sorted(int(i) for x in lines for i in x[1:]) == list(range(4 * 6))


def test_the_profiler_keeps_and_prices_the_runs_sharded_layout():
    """A policy the profiler tries steps the run's own state: the same parameter layout (ZeRO off,
    vocabulary split, fsdp and tensor cuts) as the run's pipeline, and its prediction prices that
    layout, not a replicated one. Nothing here compiles."""
    from jaxmem.memory import estimate

    config = TrainConfig(
        model="llama-tiny", pipe=2, fsdp=2, tensor=2, microbatches=2, batch_size=8, seq_len=32, zero=False
    )
    sharded = Trainer(config)
    profiler = _profiler(sharded, 64 * MiB)
    base = sharded.pipeline
    tried = profiler._pipeline("recompute-all", frozenset({1}))
    assert tried.placement == base.placement and tried.vocab is not None and not tried.zero
    assert str(tried.policy.policy) == "recompute-all" and tried.drop_layers == {1}
    assert profiler.batch_sharding.spec == sharded.batch_sharding.spec
    predicted = profiler.predict("recompute-all", 8, 32, frozenset())[0]
    kw = dict(batch=8, seq=32, layer_counts=base.layer_counts, hardware=profiler.hardware)
    layout = estimate(base.model, base.schedule, "recompute-all", fsdp=2, tensor=2, zero=False, **kw)
    assert predicted == layout.device_bytes
    assert predicted < estimate(base.model, base.schedule, "recompute-all", zero=False, **kw).device_bytes


def test_the_policy_choice_is_a_pure_function_of_the_predictions():
    from jaxmem.profiler import BudgetError, choose_policy, escalate_policy

    mib = 2**20
    ladder = {  # policy -> (device bytes, expected seconds, simulated seconds), in ladder order
        "save-all": (10 * mib, 1.0, 1.0),
        "selective": (6 * mib, 1.2, 1.2),
        "recompute-all": (4 * mib, 1.5, 1.5),
        "offload-stash": (4 * mib, 1.5, 1.5),
    }
    assert choose_policy(ladder, 12 * mib) == "save-all"
    assert choose_policy(ladder, 9 * mib) == "selective"
    assert choose_policy(ladder, 6 * mib, margin=1.1) == "recompute-all"  # the learned margin counts
    # Equal times: the nearest signature's choice, else the earlier on the ladder.
    assert choose_policy(ladder, 5 * mib) == "recompute-all"
    assert choose_policy(ladder, 5 * mib, neighbour="offload-stash") == "offload-stash"
    with pytest.raises(BudgetError, match="smallest prediction is 4.0 MiB") as info:
        choose_policy(ladder, 3 * mib, what="batch 8 x seq 64")
    assert info.value.deficit == mib
    # selective compiled 25% over its prediction: only a policy whose prediction x 1.25 fits is next.
    assert escalate_policy(ladder, 5.5 * mib, "selective", 7.5 * mib) == "recompute-all"
    with pytest.raises(BudgetError, match="no stronger policy"):
        escalate_policy(ladder, 4.5 * mib, "selective", 7.5 * mib)


def test_the_prediction_path_compiles_only_for_the_first_signature(trainer, monkeypatch):
    """Compiles counted, not timed: a new signature's policies are priced with working sets derived
    from ones compiled already (same stage role and policy, another length or depth). The first
    signature compiles at most two working sets per stage role (its one- and two-layer stages, from
    which deeper ones are extrapolated) for each policy it prices (and it prices only those it
    prefers to the one that fits); every later signature -- new lengths, dropped layers -- compiles
    none. The exact ledger at such a length would compile."""
    import jax.stages

    compiles = []
    real = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        compiles.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    profiler = _profiler(trainer, 64 * MiB)
    per_policy = 2 * 2  # pipe=2: a first and a last stage, each of one and of two layers
    # Lengths no other test prices (the facts of a built-in model are shared by the process).
    scores, choice = profiler._scores(4, 24, frozenset())
    priced = [p for p, s in scores.items() if s[0] is not None]
    # (None at all when this process has compiled the model's working sets at another length already.)
    assert choice in priced and len(compiles) <= per_policy * len(priced), (len(compiles), priced)
    for seq, drop in ((40, frozenset()), (48, frozenset({1})), (24, frozenset({0}))):
        before = len(compiles)
        scores, choice = profiler._scores(4, seq, drop)
        assert choice is not None and len(compiles) == before, (seq, drop, len(compiles) - before)
    before = len(compiles)
    profiler.predict(choice, 4, 40, frozenset())  # the exact ledger compiles the working sets at 40
    assert len(compiles) > before


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread priorities are read from Linux's /proc")
def test_a_background_compile_runs_on_xlas_compile_threads_at_the_lowest_priority():
    """XLA compiles on threads of its own, not on the caller: a background thread's nice value never
    reached an exploring compile, which slowed the steps beside it by 6-15% (benchmarks/profiler.py,
    three repeats). The profiler learns those threads from a foreground compile and lowers them for
    the length of a background one."""
    import threading

    import jax

    from jaxmem.profiler._profiler import LOWEST, CompileThreads

    def deep(x):
        for i in range(40):
            x = jnp.tanh(x @ x.T + i) * 0.5 + jnp.sin(x)
        return x

    threads = CompileThreads()
    threads.watch(jax.jit(deep).lower(jnp.ones((64, 64))).compile)
    assert threads.known and threading.get_native_id() not in threads.known
    before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads.known}
    during = {}

    def compile_fn():
        during.update({t: os.getpriority(os.PRIO_PROCESS, t) for t in threads.known})
        return "compiled"

    assert threads.lowered(compile_fn) == "compiled"
    assert set(during.values()) == {LOWEST}, during
    if os.geteuid() == 0:  # raising a priority back needs CAP_SYS_NICE
        assert {t: os.getpriority(os.PRIO_PROCESS, t) for t in threads.known} == before
