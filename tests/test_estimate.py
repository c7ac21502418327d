"""One estimator: the planner, the online profiler and the recovery planner price a configuration with
:func:`jaxmem.memory.estimate` and get the same figure for it (nothing compiles here)."""

import dataclasses

import pytest

from jaxmem.memory import CPU_LOCKSTEP_PROCESSES, HARDWARE, estimate, model_facts
from jaxmem.models import get_config, get_model
from jaxmem.schedule import generate

BATCH, SEQ = 32, 64


@pytest.mark.parametrize("data,fsdp", [(2, 1), (1, 2)])
def test_planner_profiler_and_recovery_price_one_configuration_alike(data, fsdp):
    from jaxmem.elastic import predicted_step_seconds
    from jaxmem.pipeline import Pipeline, make_mesh
    from jaxmem.profiler import AdaptiveProfiler
    from jaxmem.search import evaluate

    model = get_model("tiny")
    schedule = generate("1f1b", 4, 4)
    layout = dict(batch=BATCH, seq=SEQ, fsdp=fsdp, hardware="h100")
    planner = evaluate(model, schedule, "save-all", budget=float("inf"), data=data, **layout)
    pipeline = Pipeline(model, schedule, make_mesh(data, 4, fsdp=fsdp), policy="save-all")
    profiler = AdaptiveProfiler(pipeline, 2**30, build_step=None, hardware="h100", explore=False)
    device_bytes, _, simulated = profiler.predict("save-all", BATCH, SEQ, frozenset())
    direct = estimate(model, schedule, "save-all", data_parallel=data, **layout)
    assert planner.step_seconds == simulated == direct.step_seconds
    assert planner.device_bytes == device_bytes == direct.device_bytes
    if fsdp == 1:  # the recovery planner's own entry point (its strategies keep the job's fsdp)
        recovery = predicted_step_seconds(model, "1f1b", 4, data, 4, BATCH, SEQ, None, hardware="h100")
        assert recovery == direct.step_seconds


def test_processes_beyond_the_cores_slow_the_estimate_by_the_fitted_exponent():
    """The CPU step of a launched job: the recovery planner's figure is the estimator's on a profile
    that says how many processes share the cores -- the process terms added when the devices span
    more than one process (gloo between them; a job of one process runs alone), and processes beyond
    the cores slowing the step by the fitted exponent."""
    from jaxmem.elastic import predicted_step_seconds
    from jaxmem.memory import shared_core_terms

    model = get_model("tiny")
    schedule = generate("1f1b", 4, 4)
    c = CPU_LOCKSTEP_PROCESSES
    assert c.process_tick_flops > 0 and c.pooled_imbalance is not None
    cpu = dataclasses.replace(HARDWARE["cpu"], cores=2, lockstep=c)
    costs = estimate(model, schedule, batch=BATCH, seq=SEQ, hardware=cpu, memory=False).costs
    ticks, even, excess = shared_core_terms(schedule, costs, 1, 2)
    rate = cpu.flops_per_second
    for processes in (1, 2, 4):
        profile = dataclasses.replace(cpu, processes=processes)
        seconds = estimate(model, schedule, batch=BATCH, seq=SEQ, hardware=profile, memory=False).step_seconds
        slowdown = max(processes / 2, 1.0) ** c.oversubscription
        fixed = c.step_flops + ticks * c.tick_flops
        if processes > 1:  # gloo between the processes
            fixed += c.process_step_flops + ticks * c.process_tick_flops
        # 4 devices over 4 processes: one each, on a pool of both cores
        weight = c.pooled_imbalance if processes == 4 else c.imbalance
        assert seconds == pytest.approx((fixed / rate + even + weight * excess) * slowdown, rel=1e-12)
        recovery = predicted_step_seconds(
            model, "1f1b", 4, 1, 4, BATCH, SEQ, None, hardware=HARDWARE["cpu"], cores=2, nprocs=processes
        )
        assert recovery == pytest.approx(seconds, rel=1e-12)
    assert CPU_LOCKSTEP_PROCESSES.oversubscription > 0


@pytest.mark.parametrize("seconds", [0.25, 0.5, 0.75, 1.0])
def test_an_overlapped_offload_costs_only_its_excess(seconds):
    """One rank, F0 F1 B0 B1 (F 1 s, B 2 s), each activation offloaded after its F and fetched back
    before its B, ``seconds`` each way. B0's round trip (out after F0, back from F1's start) overlaps
    F1's 1 s: only 2 x seconds - 1 s of it, when positive, delays B0 and the step; B1's hides."""
    from jaxmem.schedule import Costs, simulate

    schedule = generate("gpipe", 1, 2)
    assert [str(a) for a in schedule.actions(0)] == ["0F0", "0F1", "0B0", "0B1"]
    costs = Costs(f=1, b=2, offload_fn=lambda stage, mb: seconds, host_bandwidth=1.0)
    result = simulate(schedule, costs)
    excess = max(2 * seconds - 1.0, 0.0)
    assert result.exposed_transfer == pytest.approx((excess,))
    assert result.makespan == pytest.approx(simulate(schedule, Costs(f=1, b=2)).makespan + excess)


@pytest.mark.parametrize("fetch", [0.5, 1.5, 2.5])
def test_a_weights_fetch_overlaps_the_action_before_it(fetch):
    """One rank, F0 F1 B0 B1 (F 1 s, B 2 s), ``fetch`` seconds of weights from host before each
    action: the first waits for its whole fetch, each later one only for what the action before it
    (1, 1 and 2 s) does not cover."""
    from jaxmem.schedule import Costs, simulate

    schedule = generate("gpipe", 1, 2)
    result = simulate(schedule, Costs(f=1, b=2, fetch_fn=lambda action: fetch, host_bandwidth=1.0))
    exposed = fetch + 2 * max(fetch - 1, 0.0) + max(fetch - 2, 0.0)
    assert result.exposed_transfer == pytest.approx((exposed,))
    assert result.makespan == pytest.approx(6.0 + exposed)
    assert result.transfer_busy == pytest.approx((4 * fetch,))


def test_host_state_is_priced_as_the_executor_moves_it():
    """Optimizer state on host: the update reads and writes back each device's moments, after the
    tick loop (added in full to the step); weights on host: fetched for an action whose stage is not
    the one the rank's action before ran (in the simulation, overlapped with that action), and read
    and written back by the update. A host link shared by
    two devices halves each one's share."""
    model = get_model("tiny")
    schedule = generate("1f1b", 2, 4)
    layout = dict(batch=BATCH, seq=SEQ)
    h100 = HARDWARE["h100"]
    save = estimate(model, schedule, "save-all", hardware=h100, **layout)
    state = estimate(model, schedule, "offload-optimizer-state", hardware=h100, **layout)
    layer = model_facts(model).layer_bytes  # one layer's parameters (float32, as its two moments)
    stage = model.n_layers // 2 * layer
    assert state.state_transfer_seconds == pytest.approx(2 * 2 * stage / h100.host_bandwidth)
    assert state.simulation.makespan == pytest.approx(save.simulation.makespan)
    assert state.step_seconds == pytest.approx(save.step_seconds + state.state_transfer_seconds)
    shared = estimate(
        model, schedule, "offload-optimizer-state", hardware=dataclasses.replace(h100, host_link_devices=2), **layout
    )
    assert shared.state_transfer_seconds == pytest.approx(2 * state.state_transfer_seconds)

    weights = estimate(model, schedule, "offload-weights", hardware=h100, **layout)
    for rank in range(2):  # one stage a rank: fetched once, before its first action
        assert weights.simulation.transfer_busy[rank] == pytest.approx(stage / h100.host_bandwidth)
    assert weights.state_transfer_seconds == pytest.approx(2 * stage / h100.host_bandwidth)
    assert weights.simulation.makespan >= save.simulation.makespan + stage / h100.host_bandwidth  # the first fetch
    # Two stages a rank: fetched whenever the rank's next action runs the other one.
    interleaved = generate("interleaved-1f1b", 2, 4, 2)
    weights = estimate(model, interleaved, "offload-weights", hardware=h100, **layout)
    for rank in range(2):
        stages = [a.stage for a in interleaved.actions(rank)]
        fetches = 1 + sum(a != b for a, b in zip(stages, stages[1:]))
        assert 2 < fetches < len(stages)
        assert weights.simulation.transfer_busy[rank] == pytest.approx(fetches * stage / 2 / h100.host_bandwidth)


def test_the_chronos_moves_are_priced_by_the_estimator():
    """A move's seconds per byte is the estimator's: the step with the move everywhere against
    save-all, over the device bytes it frees (offload-stash: 0, only where its round trip hides)."""
    from jaxmem.search import chronos_moves

    model = get_model("tiny")
    schedule = generate("chronos", 4, 8)

    def run(policy):
        return estimate(model, schedule, policy, batch=BATCH, seq=SEQ, hardware="h100")

    names = ("offload-stash", "selective", "recompute-all", "offload-optimizer-state", "offload-weights")
    moves = {m.name: m.seconds_per_byte for m in chronos_moves(run, names)}
    assert moves["offload-stash"] == 0.0
    base = run("save-all")
    for name in names[1:-1]:
        moved = run(name)
        assert moved.device_bytes < base.device_bytes
        assert moves[name] == pytest.approx(
            (moved.step_seconds - base.step_seconds) / (base.device_bytes - moved.device_bytes)
        )
    # Weights on host free nothing where a rank runs two stages: the stage it runs and the next one,
    # arriving beside it, are both on the device. The move is not offered there.
    assert run("offload-weights").device_bytes >= base.device_bytes and "offload-weights" not in moves


def test_w_without_the_split_runs_a_whole_backward_and_the_planner_weighs_the_split():
    """Without ``split_backward`` the executor's W runs the stage's whole pullback again (XLA drops
    only what the input gradient alone needs), so the time model charges it a whole backward; with
    it, I and W share one backward, and the ledger holds the cotangents I hands W. The planner tries
    both and takes the split only where its memory fits."""
    from jaxmem.cli.plan import train_command
    from jaxmem.config import TrainConfig
    from jaxmem.policy import PRESETS
    from jaxmem.schedule import Action, Kind
    from jaxmem.search import search
    from jaxmem.train import planned_config

    model = get_model("tiny")
    schedule = generate("zbv", 4, 8)
    one = generate("1f1b", 8, 8)  # the same 8 stages of one layer, with whole backwards
    run = dict(batch=BATCH, seq=SEQ, hardware="h100")
    plain, split = (estimate(model, schedule, "save-all", split_backward=s, **run) for s in (False, True))
    # The actions' own costs are compared with the vocabulary whole: a split one's work is charged to
    # the actions of its ticks, which differ between the two schedules.
    whole_vocab = dict(run, vocab_parallel=False)
    costs = [estimate(model, schedule, "save-all", split_backward=s, **whole_vocab).costs for s in (False, True)]
    whole = estimate(model, one, "save-all", **whole_vocab).costs
    for stage in range(schedule.num_stages):
        i, w, b = Action(stage, Kind.I, 0), Action(stage, Kind.W, 0), Action(stage, Kind.B, 0)
        backward = whole.duration(b, one)
        assert costs[0].duration(w, schedule) == pytest.approx(backward, rel=1e-12)
        assert costs[1].duration(i, schedule) + costs[1].duration(w, schedule) == pytest.approx(backward, rel=1e-12)
    assert split.step_seconds < plain.step_seconds and split.device_bytes > plain.device_bytes
    # Under a tensor axis the split holds too, its transfers cut over it as the stash is. A W without
    # it runs the pullback's sums and stash gather again; a split W gathers instead the whole part of
    # what its I handed it.
    cut = [estimate(model, schedule, "save-all", split_backward=s, tensor=2, **run) for s in (False, True)]
    assert cut[1].device_bytes > cut[0].device_bytes
    facts, policy = model_facts(model), PRESETS["save-all"].bind(model.tags)
    part = facts.tensor_cut(policy, SEQ, 2).transfers
    assert 0 < part < 1
    layers = model.n_layers // schedule.num_stages
    handed = facts.transfer_elems(first=False, last=False, layers=layers, policy=policy, microbatch=BATCH // 8, seq=SEQ)
    gather = HARDWARE["h100"].collective_seconds("all_gather", 4 * sum(handed.values()) * (1 - part), 2)
    i, w = Action(3, Kind.I, 0), Action(3, Kind.W, 0)
    both = cut[1].costs.duration(i, schedule) + cut[1].costs.duration(w, schedule)
    assert cut[0].costs.duration(w, schedule) == pytest.approx(both - gather, rel=1e-9)
    assert gather > 0 and cut[0].costs.duration(i, schedule) == cut[1].costs.duration(i, schedule)

    kw = dict(devices=4, batch=BATCH, seq=SEQ, schedules=("zbv",), policies=("save-all",), pipes=[4], fsdp=False)
    kw.update(microbatches=[8], hardware="h100")
    roomy = search(model, budget_bytes=2 * split.device_bytes, **kw).best
    assert roomy.split_backward and roomy.step_seconds == pytest.approx(split.step_seconds)
    tight = search(model, budget_bytes=(plain.device_bytes + split.device_bytes) / 2, **kw).best
    assert not tight.split_backward and tight.step_seconds == pytest.approx(plain.step_seconds)
    config = planned_config(TrainConfig(model="tiny", batch_size=BATCH, seq_len=SEQ), roomy, 4)
    assert config.split_backward
    args = type("Args", (), {"model": "tiny", "budget": "1GiB", "hardware": "h100"})()
    assert "--split-backward" in train_command(roomy, args, BATCH, SEQ)


def test_w_given_what_i_recomputed_recomputes_nothing_and_the_planner_weighs_it():
    """With ``hand_recomputed`` I hands W the forward values it recomputed: W is charged no
    recompute (a split W otherwise re-runs what its products read), and the ledger holds those
    values from I to W. The planner tries it under recompute-all and takes it only where it fits."""
    from jaxmem.cli.plan import train_command
    from jaxmem.config import TrainConfig
    from jaxmem.schedule import Action, Kind
    from jaxmem.search import search
    from jaxmem.train import planned_config

    model = get_model("tiny")
    schedule = generate("zbv", 4, 8)
    run = dict(batch=BATCH, seq=SEQ, hardware="h100", split_backward=True)
    split, hand = (estimate(model, schedule, "recompute-all", hand_recomputed=h, **run) for h in (False, True))
    saved = [estimate(model, schedule, "save-all", hand_recomputed=h, **run) for h in (False, True)]
    for stage in range(schedule.num_stages):
        i, w = Action(stage, Kind.I, 0), Action(stage, Kind.W, 0)
        assert hand.costs.duration(i, schedule) == split.costs.duration(i, schedule)
        # W no longer runs the recompute I runs: what I costs beyond I under save-all.
        recompute = split.costs.duration(i, schedule) - saved[0].costs.duration(i, schedule)
        assert recompute > 0
        assert split.costs.duration(w, schedule) - hand.costs.duration(w, schedule) == pytest.approx(recompute)
    assert hand.step_seconds < split.step_seconds and hand.device_bytes > split.device_bytes
    # Under save-all I recomputes only what is cheap (reshapes, casts of saved values): no time
    # changes, and the memory by under 2% (the planner does not try it there).
    assert saved[0].step_seconds == saved[1].step_seconds
    assert saved[1].device_bytes == pytest.approx(saved[0].device_bytes, rel=0.02)

    kw = dict(devices=4, batch=BATCH, seq=SEQ, schedules=("zbv",), pipes=[4], fsdp=False)
    kw.update(microbatches=[8], hardware="h100", split_backward=True)
    roomy = search(model, budget_bytes=2 * hand.device_bytes, policies=("recompute-all",), **kw)
    assert {c.hand_recomputed for c in roomy.candidates} == {False, True}
    assert roomy.best.hand_recomputed and roomy.best.step_seconds == pytest.approx(hand.step_seconds)
    tight = search(model, budget_bytes=(split.device_bytes + hand.device_bytes) / 2, policies=("recompute-all",), **kw)
    assert not tight.best.hand_recomputed
    # Nor is it tried where W re-runs no forward (selective: elementwise values; save-all: none).
    others = search(model, budget_bytes=1e12, policies=("save-all", "selective"), **kw).candidates
    assert others and not any(c.hand_recomputed for c in others)
    config = planned_config(TrainConfig(model="tiny", batch_size=BATCH, seq_len=SEQ), roomy.best, 4)
    assert config.split_backward and config.hand_recomputed
    args = type("Args", (), {"model": "tiny", "budget": "1GiB", "hardware": "h100"})()
    assert "--split-backward --hand-recomputed" in train_command(roomy.best, args, BATCH, SEQ)


@pytest.mark.parametrize("name", ["1f1b", "chronos", "zbv"])
def test_the_split_vocabularys_head_costs_each_rank_its_slices_at_their_ticks(name, monkeypatch):
    """With the vocabulary split over the ranks, every rank computes its slice of a microbatch's head in
    the tick at which the last stage's F reaches it (jaxmem.pipeline._vocab). Charged to the actions
    of those ticks, the head lengthens the step by a rank's M slices. It was spread over every F
    before, which lengthened each link of a V-shape's chains: 2.6x that here for Chronos, 1.4x for
    1F1B (gpt2-small width, 8 layers, P=4, M=8, 1024 tokens a microbatch; links left out, so only
    the head's FLOPs differ)."""
    model = get_model(dataclasses.replace(get_config("gpt2-small"), n_layers=8, dtype="bfloat16"))
    unlinked = dataclasses.replace(HARDWARE["h100"], link_bandwidth=None, network_bandwidth=None)
    facts = model_facts(model)
    slice_seconds = facts.vocab_flops(1, 1024) / unlinked.flops_per_second / 4
    schedule = generate(name, 4, 8)
    run = dict(batch=8, seq=1024, hardware=unlinked)
    with_head = estimate(model, schedule, "save-all", **run).simulation.makespan
    monkeypatch.setattr(facts, "vocab_flops", lambda *args: 0.0)
    without = estimate(model, schedule, "save-all", **run).simulation.makespan
    assert with_head - without == pytest.approx(8 * slice_seconds, rel=1e-6)
