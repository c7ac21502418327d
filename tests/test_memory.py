"""The memory ledger: predicted (model facts) vs the program (jaxpr residuals) vs the compiler
(memory_analysis), for the GPT and the Llama."""

import json
import os
import random

import pytest

from jaxmem.config import TrainConfig
from jaxmem.memory import compare, model_facts, predict, stage_residual_bytes
from jaxmem.models import GPT_TAGS, get_model
from jaxmem.pipeline import Pipeline, make_mesh
from jaxmem.policy import PRESETS, Policy, StagePolicy
from jaxmem.schedule import generate
from jaxmem.train import Trainer


def _random_policies(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        decisions = {t: rng.choice(["save", "recompute", "recompute", "offload"]) for t in GPT_TAGS.names}
        out.append(StagePolicy(base="recompute-all", tags=decisions, offload_stash=rng.random() < 0.2))
    return out


@pytest.mark.parametrize("policy", list(PRESETS.values()) + _random_policies(8), ids=lambda p: p.describe()[:40])
def test_closed_form_residuals_equal_the_executors_jaxpr(policy):
    model = get_model("tiny", n_layers=6, max_seq_len=32)
    pipe = Pipeline(model, generate("1f1b", 3, 3), make_mesh(1, 3), policy=Policy(default=policy))
    bound = policy.bind(model.tags)
    for c, plan in pipe.residual_plans(6, 32).items():
        by_space = plan.stash_bytes_by_buffer()
        measured = (by_space.get(("float32", "device"), 0), by_space.get(("float32", "host"), 0))
        predicted = stage_residual_bytes(
            model.config,
            layers=c.layers,
            first=c.first,
            last=c.last,
            microbatch=2,
            seq=32,
            policy=bound,
            vocab=pipe.vocab is not None,
        )
        assert measured == predicted, c


RECOMPUTE_PRESETS = ["save-all", "selective", "recompute-all"]
# Compiled here: every recompute preset on 1F1B for both models (the ordering test), and each other
# schedule under the policy where its prediction was worst (interleaved recompute-all) or the largest
# stash (gpipe save-all). `python benchmarks/memory.py` runs the full grid (every preset x schedule).
GRID = [
    *((model, "1f1b", policy) for model in ("tiny", "llama-tiny") for policy in RECOMPUTE_PRESETS),
    ("tiny", "interleaved-1f1b", "recompute-all"),
    ("llama-tiny", "interleaved-1f1b", "recompute-all"),
    ("llama-tiny", "gpipe", "save-all"),
]
VIRTUAL = {"1f1b": None, "gpipe": None, "interleaved-1f1b": 2}


@pytest.fixture(scope="module")
def reports():
    out = {}
    for model, schedule, policy in GRID:
        # One layer per stage (compile time grows with the layers a stage unrolls): 4 layers, 8 for
        # the interleaved schedule's 8 stages.
        layers = 4 * (VIRTUAL[schedule] or 1)
        config = TrainConfig(
            model=get_model(model, n_layers=layers),
            schedule=schedule,
            virtual=VIRTUAL[schedule],
            policy=policy,
            steps=1,
        )
        trainer = Trainer(config)
        predicted = predict(trainer.model, trainer.schedule, policy, batch=32, seq=64)
        out[(model, schedule, policy)] = compare(predicted, trainer.measure_memory())
    return out


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_recompute_lowers_compiled_device_bytes(reports, model):
    compiled = {p: reports[(model, "1f1b", p)]["ranks"][0]["compiled_device_bytes"] for p in RECOMPUTE_PRESETS}
    assert compiled["recompute-all"] < compiled["selective"] < compiled["save-all"]


@pytest.mark.parametrize("model,schedule,policy", GRID)
def test_prediction_within_ten_percent_on_every_rank(reports, model, schedule, policy):
    report = reports[(model, schedule, policy)]
    assert report["meta"]["model"] == model
    assert len(report["ranks"]) == 4
    for rank in report["ranks"]:
        assert abs(rank["prediction_error"]) <= 0.10, rank
        # The stash is read from the program and predicted exactly.
        stash = rank["categories"]["stash"]
        assert stash["predicted_device"] == stash["program_device"]


def test_ledger_moves_offloaded_bytes_to_host():
    schedule = generate("1f1b", 4, 8)
    base = predict("tiny", schedule, "save-all", batch=32, seq=64)
    stash = predict("tiny", schedule, "offload-stash", batch=32, seq=64)
    weights = predict("tiny", schedule, "offload-weights", batch=32, seq=64)
    for b, s, w in zip(base.ranks, stash.ranks, weights.ranks):
        assert s.categories["stash"].device == 0
        assert s.categories["stash"].host == b.categories["stash"].device
        assert s.device_bytes < b.device_bytes and s.host_bytes == b.host_bytes + b.categories["stash"].device
        moved = b.categories["params"].device - w.categories["params"].device
        assert moved > 0 and w.categories["params"].host == moved


def test_the_update_time_copy_of_offloaded_state_is_booked():
    """Offloaded weights / optimizer state are updated layer by layer, when the stash is dead
    (jaxmem.train._update): two layers' weights and moments on the device, the one being updated and
    the next arriving, where the whole update brought the rank's all. With a small stash
    (recompute-all) that copy is booked against the transient peak, unless the weights' slots in the
    ticks set it."""
    both = StagePolicy(base="recompute-all", offload_weights=True, offload_optimizer_state=True)
    one = model_facts(get_model("tiny")).static_bytes(2, 1, 1)
    layer = 2 * (one.stage_params[0] + 2 * one.stage_state[0])
    schedule = generate("1f1b", 2, 2)
    base = predict("tiny", schedule, "recompute-all", batch=2, seq=4)
    off = predict("tiny", schedule, both, batch=2, seq=4)
    for b, o in zip(base.ranks, off.ranks):
        host = o.categories["params"].host + o.categories["optimizer_state"].host
        stash = o.categories["stash"].device
        assert host > 0 and o.host_bytes >= host
        assert layer == host / 2  # four layers a stage
        # In the ticks: the prefetch slot, holding the rank's one stage. Here it sets the peak, where
        # the whole copy would have.
        ticks = b.categories["transient"].device + o.categories["params"].host
        assert layer - stash < ticks < host - stash
        assert o.categories["transient"].device == max(ticks, layer - stash) > b.categories["transient"].device


def test_live_stash_follows_the_schedule():
    ledger = predict("llama-tiny", generate("1f1b", 4, 8), "save-all", batch=32, seq=64)
    live = [r.live_stash_bytes for r in ledger.ranks]
    assert live == sorted(live, reverse=True) and live[0] > live[-1]


def test_memory_cli_json(capsys, tmp_path):
    from jaxmem.cli import main

    svg = tmp_path / "ledger.svg"
    code = main(
        [
            "memory",
            "--pipe",
            "2",
            "--microbatches",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--policy",
            "selective",
            "--budget",
            "1.5MiB",
            "--json",
            "-o",
            str(svg),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["policy"] == "selective" and report["schedule"] == "1f1b"
    assert report["budget_bytes"] == 1.5 * 2**20
    text = svg.read_text()
    for rank in report["ranks"]:
        for key in ("predicted_device_bytes", "predicted_host_bytes", "compiled_device_bytes", "categories"):
            assert key in rank
        assert set(rank["categories"]) == {"params", "grads", "optimizer_state", "stash", "transient"}
        assert rank["fits_budget"] == (rank["compiled_device_bytes"] <= 1.5 * 2**20)
        # The chart labels each bar with its total: predicted, and the compiled program's buffers.
        assert f"{rank['predicted_device_bytes'] / 2**20:,.2f}" in text
        program = sum(c["program_device"] for c in rank["categories"].values())
        assert f"{program / 2**20:,.2f}" in text
    for label in ("budget 1.50 MiB", "compiled total (memory_analysis)", "live stash", "predicted | compiled | host"):
        assert label in text


def test_mixed_precision_ledger_counts_bf16_stash_and_float32_state():
    schedule = generate("1f1b", 4, 8)
    f32 = predict("llama-tiny", schedule, "save-all", batch=32, seq=64)
    bf16 = predict(get_model("llama-tiny", dtype="bfloat16"), schedule, "save-all", batch=32, seq=64)
    for name in ("params", "grads", "optimizer_state"):
        assert bf16.ranks[0].categories[name] == f32.ranks[0].categories[name]
    assert bf16.ranks[0].categories["stash"].device == f32.ranks[0].categories["stash"].device / 2


def test_traced_and_closed_form_ledgers_agree_for_the_gpt():
    model = get_model("tiny")
    schedule = generate("interleaved-1f1b", 4, 8, 2)
    for policy in ("save-all", "selective", "recompute-all", "offload-stash"):
        closed = predict(model, schedule, policy, batch=32, seq=64)
        traced = predict(model, schedule, policy, batch=32, seq=64, facts=model_facts(model, analytic=False))
        assert closed.meta["facts"] == "analytic" and traced.meta["facts"] == "traced"
        for a, b in zip(closed.ranks, traced.ranks):
            assert a.categories == b.categories and a.live_stash_bytes == b.live_stash_bytes


def test_memory_cli_predicted_only_for_a_big_model(capsys):
    from jaxmem.cli import main

    code = main(
        [
            "memory",
            "--model",
            "gpt2-xl",
            "--pipe",
            "8",
            "--microbatches",
            "8",
            "--batch-size",
            "8",
            "--seq-len",
            "1024",
            "--compile",
            "no",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ranks"][0]["compiled_device_bytes"] is None
    assert report["ranks"][0]["predicted_device_bytes"] > 2**30


def test_memory_cli_for_a_traced_model_without_compiling(capsys):
    from jaxmem.cli import main

    argv = ["memory", "--model", "llama-1b", "--dtype", "bfloat16", "--pipe", "4", "--microbatches", "8"]
    code = main([*argv, "--batch-size", "8", "--seq-len", "2048", "--policy", "selective", "--compile", "no", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["model"] == "llama-1b" and report["meta"]["facts"] == "traced"
    assert report["ranks"][0]["predicted_device_bytes"] > 2**30


def test_compiled_working_sets_are_kept_on_disk_under_the_program_and_its_compiler(tmp_path, monkeypatch):
    """A working-set figure is read back instead of compiled again -- for the same program, options,
    target and compiler only; a file that cannot be read is compiled again; JAXMEM_CACHE_DIR=off keeps
    nothing. A second ledger of a model built again compiles nothing and gives the same figures."""
    import jax
    import jax.numpy as jnp
    from families import family

    import jaxmem.memory._facts as facts_module
    from jaxmem.memory._figures import cached_figure

    monkeypatch.setenv("JAXMEM_CACHE_DIR", str(tmp_path))
    x = jnp.ones((8, 8))
    lowered, other = (jax.jit(lambda a, f=f: f(a) @ a.T).lower(x) for f in (jnp.sin, jnp.cos))

    def never():
        raise AssertionError("compiled again")

    assert cached_figure(lowered, None, "cpu:a:1", lambda: 123.0) == 123.0
    assert cached_figure(lowered, None, "cpu:a:1", never) == 123.0
    assert cached_figure(lowered, {"xla_backend_optimization_level": 0}, "cpu:a:1", lambda: 7.0) == 7.0
    assert cached_figure(lowered, None, "target=tpu-v5e:2x2", lambda: 8.0) == 8.0
    assert cached_figure(other, None, "cpu:a:1", lambda: 9.0) == 9.0
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert cached_figure(lowered, None, "cpu:a:1", lambda: 10.0) == 10.0  # other compiler flags
    for entry in (tmp_path / "working-sets").iterdir():
        entry.write_text("{")  # cut short
    assert cached_figure(lowered, None, "cpu:a:1", lambda: 11.0) == 11.0
    assert cached_figure(lowered, None, "cpu:a:1", never) == 11.0
    monkeypatch.setenv("JAXMEM_CACHE_DIR", "off")
    assert cached_figure(lowered, None, "cpu:a:1", lambda: 12.0) == 12.0

    monkeypatch.setenv("JAXMEM_CACHE_DIR", str(tmp_path / "ledger"))
    compiles = []
    real = facts_module._temporaries
    monkeypatch.setattr(facts_module, "_temporaries", lambda *a: compiles.append(1) or real(*a))
    first, second = (predict(family("mqa"), generate("1f1b", 2, 4), "selective", batch=8, seq=32) for _ in range(2))
    assert len(compiles) > 0 and len(os.listdir(tmp_path / "ledger" / "working-sets")) == len(compiles)
    assert first.max_device_bytes == second.max_device_bytes
    n = len(compiles)
    predict(family("mqa"), generate("1f1b", 2, 4), "selective", batch=8, seq=32)
    assert len(compiles) == n  # a model built again: every working set read back
