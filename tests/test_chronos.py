"""ChronosPipe: the chronos schedule, Chronos-Recomp/Offload, the planner and its CLI."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem.memory import get_hardware, predict
from jaxmem.models import get_model
from jaxmem.policy import Move, chronos_policy, from_spec, peak_order, reuse_distances
from jaxmem.schedule import Costs, generate, simulate, validate
from jaxmem.search import SearchError, evaluate, search
from jaxmem.verify import verify

UNIT = Costs(f=1, b=2, i=1, w=1, activation_bytes=1.0)


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("factor", [2, 4])
def test_chronos_halves_1f1b_memory_at_no_lower_throughput(p, factor):
    m = factor * p
    base = simulate(generate("1f1b", p, m), UNIT)
    chronos = simulate(generate("chronos", p, m), UNIT)
    assert max(chronos.peak_activation_bytes) <= max(base.peak_activation_bytes) / 2
    assert chronos.makespan <= base.makespan
    v_half = simulate(generate("v-half", p, m), UNIT)
    assert max(chronos.peak_activation_bytes) <= max(v_half.peak_activation_bytes)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 9])
def test_chronos_is_valid_and_fast_for_other_sizes(p):
    for m in (1, p, 3 * p):
        s = validate(generate("chronos", p, m))
        assert s.num_stages == 2 * p
        if m >= p:
            assert simulate(s, UNIT).makespan <= simulate(generate("1f1b", p, m), UNIT).makespan


@pytest.mark.parametrize(
    "policy", ["save-all", "selective", "recompute-all", "offload-stash", "offload-weights", "offload-tags"]
)
def test_chronos_verifies_under_every_policy(policy):
    assert verify(generate("chronos", 2, 2), policy=policy)["ok"]


def test_chronos_recomp_takes_the_longest_waits_and_only_what_it_needs():
    config = get_model("tiny")
    schedule = generate("1f1b", 4, 8)

    def device_bytes(policy):
        return predict(config, schedule, policy, batch=32, seq=64).max_device_bytes

    full, none = device_bytes(from_spec("selective")), device_bytes(from_spec("save-all"))
    budget = (full + none) / 2
    choice = chronos_policy(
        schedule, device_bytes, budget, UNIT, [Move("selective", 1.0)], stash_seconds_round_trip=lambda s, m: 1e9
    )
    assert choice.fits and choice.device_bytes <= budget
    k = choice.cells["selective"]
    assert 0 < k < 32
    chosen = {(s, m) for s, m, _ in choice.policy.cells}
    waits = reuse_distances(schedule, UNIT)
    assert chosen == {(s, m) for _, s, m in waits[:k]}  # longest waits first
    fewer = from_spec(choice.policy)
    del fewer
    one_less = chronos_policy(
        schedule,
        device_bytes,
        device_bytes(choice.policy) - 1,
        UNIT,
        [Move("selective", 1.0)],
        stash_seconds_round_trip=lambda s, m: 1e9,
    )
    assert one_less.cells["selective"] >= k


def test_chronos_offload_only_takes_cells_whose_wait_hides_the_round_trip():
    config = get_model("tiny")
    schedule = generate("1f1b", 4, 8)

    def device_bytes(policy):
        return predict(config, schedule, policy, batch=32, seq=64).max_device_bytes

    waits = reuse_distances(schedule, UNIT)
    threshold = sorted(w for w, _, _ in waits)[len(waits) // 2]
    choice = chronos_policy(
        schedule, device_bytes, 0.0, UNIT, [Move("offload-stash", 0.0)], stash_seconds_round_trip=lambda s, m: threshold
    )
    offloaded = {(s, m) for s, m, sp in choice.policy.cells if sp.offload_stash}
    assert offloaded and all(w >= threshold for w, s, m in waits if (s, m) in offloaded)
    assert not choice.fits  # a budget of 0 cannot be met; the generator says so


# ---------------------------------------------------------------- the planner
@pytest.fixture(scope="module")
def cpu():
    return get_hardware("cpu")


def test_plan_pick_fits_the_compiled_program(cpu):
    from jaxmem.config import TrainConfig
    from jaxmem.memory import compare
    from jaxmem.train import Trainer

    config = get_model("tiny")
    budget = 12 * 2**20
    result = search(
        config,
        devices=4,
        budget_bytes=budget,
        hardware=cpu,
        batch=32,
        seq=64,
        pipes=[4],
        schedules=("1f1b", "chronos"),
        policies=("save-all", "selective", "chronos-recomp"),
    )
    best = result.best
    assert best is not None and best.device_bytes <= budget
    trainer = Trainer(
        TrainConfig(schedule=best.schedule, pipe=best.pipe, microbatches=best.microbatches, policy=best.policy, steps=1)
    )
    report = compare(predict(config, trainer.schedule, best.policy, batch=32, seq=64), trainer.measure_memory())
    compiled = report["ranks"][0]["compiled_device_bytes"] - report["meta"]["host_space_counted_as_device_on_cpu"]
    assert compiled <= budget * 1.10, (compiled, budget)


def test_plan_agrees_with_brute_force(cpu):
    config = get_model("tiny")
    budget = 14 * 2**20
    schedules, policies = (
        ("gpipe", "1f1b", "zb-h1", "chronos"),
        ("save-all", "selective", "recompute-all", "chronos-recomp"),
    )
    result = search(
        config,
        devices=4,
        budget_bytes=budget,
        hardware=cpu,
        batch=32,
        seq=64,
        pipes=[4],
        schedules=schedules,
        policies=policies,
    )
    brute = []
    for name in schedules:
        for m in (4, 8, 16, 32):
            for policy in policies:
                brute.append(
                    evaluate(
                        config, generate(name, 4, m), policy, budget=budget, batch=32, seq=64, data=1, hardware=cpu
                    )
                )
    best = max((c for c in brute if c.fits), key=lambda c: c.tokens_per_second)
    assert (result.best.schedule, result.best.microbatches) == (best.schedule, best.microbatches)
    assert result.best.tokens_per_second == pytest.approx(best.tokens_per_second)


# Run at XLA's default level (the suite compiles at -O0, tests/conftest.py): predicts with the profile
# calibrated there, compiles and warms the three steps, says "ready", and times them on "go".
RANKING_SCRIPT = """
import json, sys, time
import jax, numpy as np
from jaxmem.config import TrainConfig
from jaxmem.memory import estimate, get_hardware
from jaxmem.models import get_model
from jaxmem.train import Trainer

model = get_model("tiny", n_layers=4)  # half the tiny GPT's depth: half the compile, the same order
configs = [
    TrainConfig(schedule="1f1b", pipe=2, data_parallel=2, microbatches=4, policy="recompute-all", model=model),
    TrainConfig(schedule="1f1b", pipe=2, microbatches=1, policy="save-all", model=model),
    TrainConfig(schedule="zbv", pipe=2, data_parallel=2, microbatches=16, policy="save-all", model=model),
]
cpu = get_hardware("cpu")
predicted = [
    estimate(c.build_model(), c.build_schedule(), c.policy, batch=c.batch_size, seq=c.seq_len,
             data_parallel=c.data_parallel, hardware=cpu, memory=False).step_seconds
    for c in configs
]
steps = []
for c in configs:
    trainer = Trainer(c)
    state = trainer.init_state()
    batch = trainer.put_batch(state.data.next()[0])
    params, opt_state, metrics = trainer.step_fn(state.params, state.opt_state, batch)
    jax.block_until_ready(metrics["loss"])
    steps.append([trainer.step_fn, params, opt_state, batch])
print("ready", flush=True)
sys.stdin.readline()
measured = [[] for _ in configs]
for _ in range(5):  # interleaved rounds: drift hits every configuration alike
    for i, entry in enumerate(steps):
        fn, params, opt_state, batch = entry
        for _ in range(2):
            start = time.perf_counter()
            params, opt_state, metrics = fn(params, opt_state, batch)
            jax.block_until_ready(metrics["loss"])
            measured[i].append(time.perf_counter() - start)
        entry[1:3] = params, opt_state
print(json.dumps({"predicted": predicted, "measured": [float(np.median(m)) for m in measured]}), flush=True)
"""


def test_the_cpu_profile_ranks_three_configurations_in_measured_order(cores, tmp_path):
    """#16: ``--plan auto`` on this machine orders configurations as they run. The three differ in
    what the CPU step model must price: recompute, a bubble on shared cores (M=1), and the fixed cost
    of many lockstep ticks (ZBV at M=16: 3 actions per stage-microbatch). Measured as a user's
    programs run (XLA's default level), with the cores to itself while it times (about 0.065, 0.087
    and 0.127 s/step; predicted 0.055, 0.070 and 0.132)."""
    import os

    from jaxmem._util import with_host_devices

    env = {**os.environ, "XLA_FLAGS": with_host_devices("", 8), "JAX_ENABLE_COMPILATION_CACHE": "false"}
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:  # a file, not a pipe: the child never blocks on a full one
        proc = subprocess.Popen([sys.executable, "-c", RANKING_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)  # fmt: skip
        try:
            assert proc.stdout.readline() == "ready\n", log.read_text()[-3000:]
            with cores.alone():
                out, _ = proc.communicate("go\n", timeout=300)
        finally:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]
    result = json.loads(out)
    predicted, measured = result["predicted"], result["measured"]
    assert sorted(range(3), key=predicted.__getitem__) == [0, 1, 2], predicted
    assert sorted(range(3), key=measured.__getitem__) == [0, 1, 2], (measured, predicted)


def test_chronos_both_is_never_slower_than_its_recompute_only_subset():
    """All moves together were once slower than the recompute moves alone (gpt2-xl width, 400 layers,
    40 GiB: the greedy order of moves is priced on one typical stage); the combined generator now
    also tries its subsets."""
    import dataclasses

    from jaxmem.models import get_config

    layers, hardware = 400, get_hardware("h100")
    config = dataclasses.replace(get_config("gpt2-xl"), dtype="bfloat16", n_layers=layers)
    schedule = generate("chronos", 8, 32)
    counts = [layers // 16 + (1 if s < layers % 16 else 0) for s in range(16)]
    kw = dict(budget=40 * 2**30, batch=32, seq=1024, data=1, hardware=hardware, layer_counts=counts)
    both = evaluate(config, schedule, "chronos-both", **kw)
    recomp = evaluate(config, schedule, "chronos-recomp", **kw)
    assert both.fits and recomp.fits
    assert both.step_seconds <= recomp.step_seconds * (1 + 1e-9), (both.note, recomp.note)
    # Its stash arena (2.2G elements a rank) is beyond the executor's int32 indexing today: the planner
    # (runnable=True, as search() asks) does not pick it, and the note says why either way. (The
    # generated policy itself, evaluated again: generating it anew would cost this test a third more.)
    runnable = evaluate(config, schedule, both.policy, runnable=True, **kw)
    assert not runnable.fits and "beyond the executor's int32 indexing" in runnable.note
    assert "beyond the executor's int32 indexing" in both.note


def test_chronos_recomp_recomputes_by_the_layer_without_a_cliff():
    """gpt2-xl width, 40 GiB, H100 profile (predicted): once selective recompute on every cell no
    longer fits, the generator recomputes layers one at a time (not whole cells: the old generator
    fell from 1.075x to 0.767x of 1F1B's per-layer throughput between 400 and 408 layers), so eight
    layers more cost a few percent, not a third."""
    import dataclasses

    from jaxmem.models import get_config

    hardware = get_hardware("h100")
    base = dataclasses.replace(get_config("gpt2-xl"), dtype="bfloat16")
    schedule = generate("chronos", 8, 32)
    rates, notes = [], []
    for layers in (344, 352, 360, 368):
        counts = [layers // 16 + (1 if s < layers % 16 else 0) for s in range(16)]
        kw = dict(budget=40 * 2**30, batch=32, seq=1024, data=1, hardware=hardware, layer_counts=counts)
        c = evaluate(dataclasses.replace(base, n_layers=layers), schedule, "chronos-recomp", **kw)
        assert c.fits, c.note
        rates.append(c.tokens_per_second * layers)
        notes.append(c.note)
    assert "layers recomputed whole" in notes[-1], notes
    drops = [1 - b / a for a, b in zip(rates, rates[1:])]
    assert max(drops) < 0.1, (drops, notes)
    # Aimed at the ranks holding the most stash (peak_order): at 352 layers the spread order took a
    # layer of 477 cells, 160 of them on the three ranks below the peak, where they freed nothing.
    recomputed = int(re.search(r"(\d+) layers recomputed whole", notes[1]).group(1))
    assert recomputed < 400, notes[1]


def test_the_recomputed_layers_go_first_to_the_rank_holding_the_most_stash():
    """peak_order: groups of one stage's cells at one depth, handed to the rank whose stash, as the
    ledger's per-rank figures estimate it, is the highest (water filling)."""
    schedule = generate("1f1b", 4, 4)  # rank r runs stage r
    cells = [(s, m) for m in reversed(range(4)) for s in range(4)]  # "longest wait first"
    base = [30.0, 10.0, 20.0, 40.0]

    def live(recomputed):  # a layer recomputed frees 2 bytes of its rank's stash
        return [base[r] - 2 * sum(k for (s, _), k in recomputed.items() if s == r) for r in range(4)]

    groups = peak_order(schedule, cells, [3, 3, 3, 3], {}, live)
    assert [len(g) for g in groups] == [4] * 12
    for g in groups:  # one stage, one depth, in the cells' order
        assert len({(c[0], j) for c, j in g}) == 1 and [c for c, _ in g] == [c for c in cells if c[0] == g[0][0][0]]
    ranks = [g[0][0][0] for g in groups]
    # Each group frees 8: rank 3 40 -> 32 -> 24, rank 0 30 -> 22, rank 3 -> 16 (its three layers
    # given), rank 0 -> 14, rank 2 20 -> 12, rank 0 -> 6, rank 2 -> 4, rank 1 10 -> 2, ...
    assert ranks == [3, 3, 0, 3, 0, 2, 0, 2, 1, 2, 1, 1], ranks
    assert [j for g in groups if g[0][0][0] == 3 for _, j in g[:1]] == [1, 2, 3]


def test_infeasible_budget_names_the_smallest_that_fits(capsys):
    from jaxmem.cli import main

    code = main(["plan", "--model", "tiny", "--devices", "4", "--budget", "1MiB", "--pipe", "4", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 1 and record["fits"] is False
    assert record["smallest_budget_bytes"] > 2**20
    assert "nothing fits 1.00 MiB per device" in record["explanation"][0]
    # Without --json, to a log rather than a terminal: plain progress lines, the first and the last.
    assert main(["plan", "--model", "tiny", "--devices", "4", "--budget", "1MiB", "--pipe", "4"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("planning: ")]
    n = int(lines[0].split("/")[1].split()[0])
    assert lines[0].startswith("planning: 1/") and lines[-1].startswith(f"planning: {n}/{n} ") and len(lines) <= 11


def test_search_progress_says_the_first_schedule_and_each_tenth():
    from jaxmem.search import progress_lines

    said = []
    report = progress_lines(said.append)
    schedule = generate("1f1b", 2, 4)
    for i in range(96):
        report(i, 96, schedule)
    assert [int(line.split()[1].split("/")[0]) for line in said] == [1, 10, 20, 29, 39, 48, 58, 68, 77, 87, 96]
    assert said[0] == "planning: 1/96 schedules (1f1b, M=4)"
    every = []  # a terminal's line, rewritten at every schedule
    report = progress_lines(every.append, lines=None)
    for i in range(96):
        report(i, 96, schedule)
    assert len(every) == 96 and every[-1] == "planning: 96/96 schedules (1f1b, M=4)"


def test_train_plan_auto_infeasible_is_a_clear_error(capsys, monkeypatch):
    import jaxmem.train._loop as loop
    from jaxmem.cli import main

    # The search the command runs, kept: its exact smallest budget, against the one the error rounds.
    results = []
    monkeypatch.setattr(loop, "search", lambda *a, **k: results.append(search(*a, **k)) or results[-1])
    # Above the floor of the state alone (refused before the search, see test_bad_input), below any plan.
    code = main(["train", "--plan", "auto", "--budget", "2MiB", "--batch-size", "256", "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "smallest plan needs" in err and "--budget" in err
    assert (out + err).count("nothing fits") == 1  # said once, not also by the search's explanation
    # The budget it suggests is enough: rounded up, not to the nearest.
    suggested = float(re.search(r"give --budget ([0-9.]+)MiB", err).group(1)) * 2**20
    assert "planning: 1/" in err  # the search says how far it is while it runs
    [result] = results
    assert result.best is None and 2**21 < result.smallest_budget <= suggested


def test_the_planners_train_command_makes_its_pick_and_memory_takes_it(capsys):
    """Every policy name the planner prints is a --policy: a generated one (chronos-*) is made again
    for the printed layout, budget and profile, the very policy the planner priced."""
    import shlex

    from jaxmem.cli import main
    from jaxmem.cli._train_args import parse_train_args

    assert main(["plan", "--model", "tiny", "--devices", "4", "--budget", "2.5MiB", "--pipe", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)  # the object alone on stdout; how far the search is, on stderr
    assert "planning: 1/" in err
    best = record["best"]
    assert best["policy"].startswith("chronos-")
    words = shlex.split(record["train_command"])
    config = parse_train_args(words[2:])
    model, schedule = config.build_model(), config.build_schedule()
    policy = config.build_policy(model, schedule)
    assert str(policy) == best["policy"] and policy.cells  # a table per (stage, microbatch), not a preset
    assert predict(model, schedule, policy, batch=32, seq=64).max_device_bytes == best["device_bytes"]
    assert main(["memory", *words[2:], "--compile", "no", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert max(r["predicted_device_bytes"] for r in report["ranks"]) == round(best["device_bytes"])
    assert report["ranks"][0]["fits_budget"]


def test_plan_works_for_a_traced_model(capsys):
    from jaxmem.cli import main

    # One mesh (schedules, microbatches, policies and the backward split still searched): the traced
    # facts are what this test is about, not the breadth of the search.
    argv = ["plan", "--model", "llama-1b", "--dtype", "bfloat16", "--mesh", "data=2,pipe=4", "--budget", "40GiB"]
    code = main([*argv, "--seq-len", "256", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["model"] == "llama-1b" and record["fits"]
    assert record["best"]["device_bytes"] <= 40 * 2**30
    assert {c["split_backward"] for c in record["candidates"] if c["schedule"] == "zbv"} == {False, True}


def test_trainable_size_benchmark_runs_small():
    script = Path(__file__).parent.parent / "benchmarks" / "trainable_size.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--width",
            "tiny",
            "--pipe",
            "2",
            "--microbatches",
            "4",
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--budget-gib",
            "0.009",  # 1F1B fits 6 layers: each depth tried builds its model, deeper ones cost more
            "--no-validate",
            # At this width the split vocabulary's four sums per microbatch (priced on the H100's links)
            # cost more than the tiny stages' compute, and ChronosPipe's extra hops fall under the floor.
            "--no-vocab-split",
            *("--only", "1F1B + full recompute", "--only", "V-Half", "--only", "V-Min"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert {m["name"] for m in record["methods"]} == {
        "1F1B",
        "1F1B + full recompute",
        "ChronosPipe (all)",
        "V-Half",
        "V-Min",
    }
    by = {m["name"]: m for m in record["methods"]}
    one, full = by["1F1B"]["max_layers"], by["ChronosPipe (all)"]["max_layers"]
    assert record["chronos_vs_1f1b_depth_ratio"] == full / one > 1 and one % 2 == full % 2 == 0  # steps of P=2
    # Compared at the same depths: at ChronosPipe's, 1F1B does not fit and full recompute is slower.
    at_full = record["same_depth"][str(full)]
    assert not at_full["1F1B"]["fits"] and at_full["ChronosPipe (all)"]["fits"]
    assert record["chronos_over_baselines_at_its_depth"]["1F1B + full recompute"] > 1


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_the_cost_model_prices_recompute_at_the_forward_it_repeats(model):
    """What every depth and throughput figure of the planners rests on: a backward costs twice its
    forward, and recompute-all adds the forward it re-runs (less the embedding lookup, which is
    not recomputed), selective a part of it. A simulator that priced recompute at a quarter of its
    FLOPs would still rank policies the same way, and fail here."""
    from jaxmem.memory import HARDWARE
    from jaxmem.memory._cost import step_costs
    from jaxmem.models import get_model
    from jaxmem.policy import from_spec
    from jaxmem.schedule import Kind

    staged, schedule = get_model(model), generate("1f1b", 2, 4)
    seconds = {}
    for policy in ("save-all", "selective", "recompute-all"):
        costs = step_costs(
            staged, schedule, from_spec(policy).resolve(schedule, staged.tags), [4, 4],
            microbatch=4, seq=64, hardware=HARDWARE["cpu"],
        )  # fmt: skip
        for stage in (0, 1):
            f, b = (next(a for a in schedule.actions(stage) if a.kind is k) for k in (Kind.F, Kind.B))
            seconds[policy, stage] = costs.duration(f, schedule), costs.duration(b, schedule)
    for stage in (0, 1):
        forward, plain = seconds["save-all", stage]
        assert 1.9 * forward <= plain <= 2.1 * forward
        recompute = seconds["recompute-all", stage][1] - plain
        assert 0.85 * forward <= recompute <= forward
        assert 0 < seconds["selective", stage][1] - plain < recompute


def test_chronos_trains(capsys):
    from jaxmem.cli import main

    code = main(
        [
            "train",
            "--schedule",
            "chronos",
            "--pipe",
            "2",
            "--microbatches",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--steps",
            "3",
            "--policy",  # generated for this layout (save-all needs 6.1 MiB, the smallest 4.9 MiB)
            "chronos-recomp",
            "--budget",
            "5.5MiB",
            "--hardware",
            "h100",
            "--json",
            "--quiet",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["schedule"] == "chronos" and summary["pipeline_stages"] == 4
    assert summary["policy"] == "chronos-recomp"
    assert summary["loss_last"] < summary["loss_first"]


def test_an_under_predicting_ledger_makes_the_planner_fall_back_to_a_pick_that_fits(monkeypatch):
    """train --plan auto compiles its pick before taking it: with the ledger forced to under-predict
    the fastest candidate that does not fit (half its bytes), that pick compiles over the budget, and
    the planner says so and takes the next, whose compiled step fits -- instead of a plan that runs
    out of memory."""
    import dataclasses as dc

    from jaxmem.config import TrainConfig
    from jaxmem.train import _loop

    budget = 6 * 2**20
    honest = _loop.search
    forced = {}

    def under_predicting(*args, **kwargs):
        result = honest(*args, **kwargs)
        over = [c for c in result.ranked if not c.fits and c.tokens_per_second > result.best.tokens_per_second]
        bad = dc.replace(over[0], device_bytes=over[0].device_bytes / 2, fits=True)
        forced.update(bad=bad, honest=result.best)
        candidates = tuple(bad if c is over[0] else c for c in result.candidates)
        return dc.replace(result, best=bad, candidates=candidates)

    monkeypatch.setattr(_loop, "search", under_predicting)
    lines = []
    config = TrainConfig(plan="auto", budget=budget, devices=4, batch_size=32, seq_len=64, hardware="h100")
    planned, record, trainer = _loop._plan(config, log=lines.append)
    assert record["margin"] == 0.0  # every device is here: compiled and checked instead
    # The run takes the trainer that compiled its pick, and with it the compiled step.
    assert trainer.config == planned and trainer._compiled is not None
    confirmed = record["confirmed"]
    (rejected,) = confirmed["rejected"]
    assert rejected["device_bytes"] == int(forced["bad"].device_bytes) and rejected["compiled_bytes"] > budget
    assert confirmed["compiled_bytes"] <= budget
    assert record["best"] == forced["honest"].to_json()
    assert any("compiles to" in line and "trying the next" in line for line in lines)
    assert (planned.schedule, planned.microbatches) == (forced["honest"].schedule, forced["honest"].microbatches)


def test_the_margin_keeps_a_fraction_of_the_budget_free_where_nothing_is_compiled():
    from jaxmem.search import LEDGER_MARGIN, confirm, search

    kw = dict(devices=4, budget_bytes=11 * 2**20, hardware="h100", batch=32, seq=64, pipes=[4])
    plain = search("tiny", margin=0.0, **kw)
    kept = search("tiny", margin=LEDGER_MARGIN, **kw)
    assert all(c.device_bytes <= 11 * 2**20 / (1 + LEDGER_MARGIN) for c in kept.candidates if c.fits)
    assert sum(c.fits for c in kept.candidates) < sum(c.fits for c in plain.candidates)
    assert any("5% margin" in line for line in kept.explain())
    # The legend explains the notation, and every policy the explanation names.
    legend = kept.legend()
    assert all(f"{letter} " in legend[0] + legend[1] for letter in ("P", "V", "D", "F", "T", "M"))
    named = {line.split(": ")[1].split()[-1] for line in kept.explain() if "runner-up" in line}
    named.add(kept.best.policy_name)
    assert named <= {line.strip().split(":")[0] for line in legend[2:]}, (named, legend)
    assert kept.to_json()["legend"] == legend
    # confirm: none of the fastest compiles under the budget -> a clear error, not a pick.
    with pytest.raises(SearchError, match="fits it when compiled"):
        confirm(plain, lambda c: 13 * 2**20, log=lambda line: None)
    # A pick its target's compiler refuses to build (beyond the chip's memory, a TPU's error) is passed
    # over as not fitting, with the bytes the compiler said it needs, and the next one is compiled.
    from jaxmem import StepTooLarge

    first = next(c for c in plain.ranked if c.fits)

    def refusing(c):
        if c is first:
            raise StepTooLarge("the step does not fit TPU v5 lite", 20 * 2**30)
        return 5 * 2**20

    lines = []
    confirmed = confirm(plain, refusing, log=lines.append)
    assert confirmed.best is not first and confirmed.confirmed["rejected"][0]["compiled_bytes"] == 20 * 2**30
    assert "does not compile for" in lines[0] and "trying the next" in lines[0]
