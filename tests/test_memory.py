"""The memory ledger: analytical model vs the program (jaxpr residuals) vs the compiler (memory_analysis)."""

import json
import random

import pytest

from jaxmem.config import TrainConfig
from jaxmem.memory import compare, measure, predict, stage_residual_bytes
from jaxmem.models import get_config
from jaxmem.pipeline import Pipeline, make_mesh
from jaxmem.policy import ALL_TAGS, PRESETS, Policy, StagePolicy
from jaxmem.schedule import generate
from jaxmem.train import Trainer


def _random_policies(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        save = frozenset(t for t in ALL_TAGS if rng.random() < 0.5)
        offload = frozenset(t for t in ALL_TAGS if t not in save and rng.random() < 0.3)
        out.append(StagePolicy(save=save, offload=offload, offload_stash=rng.random() < 0.2))
    return out


@pytest.mark.parametrize("policy", list(PRESETS.values()) + _random_policies(8), ids=lambda p: p.describe()[:40])
def test_analytical_residuals_equal_the_jaxpr(policy):
    config = get_config("tiny", n_layers=6, max_seq_len=32)
    pipe = Pipeline(config, generate("1f1b", 3, 3), make_mesh(1, 3), policy=Policy(default=policy))
    for c, plan in pipe.residual_plans(6, 32).items():
        by_space = plan.stash_bytes_by_buffer()
        measured = (by_space.get(("float32", "device"), 0), by_space.get(("float32", "host"), 0))
        predicted = stage_residual_bytes(
            config, layers=c.layers, first=c.first, last=c.last, microbatch=2, seq=32, policy=policy
        )
        assert measured == predicted, c


RECOMPUTE_PRESETS = ["save-all", "selective", "recompute-all"]
SCHEDULES = [("1f1b", None), ("gpipe", None), ("interleaved-1f1b", 2)]


@pytest.fixture(scope="module")
def reports():
    out = {}
    for schedule, virtual in SCHEDULES:
        for policy in RECOMPUTE_PRESETS:
            config = TrainConfig(schedule=schedule, virtual=virtual, policy=policy, steps=1)
            trainer = Trainer(config)
            predicted = predict(trainer.model_config, trainer.schedule, policy, batch=32, seq=64)
            out[(schedule, policy)] = compare(predicted, measure(trainer))
    return out


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_recompute_lowers_compiled_device_bytes(reports, schedule):
    compiled = {p: reports[(schedule, p)]["ranks"][0]["compiled_device_bytes"] for p in RECOMPUTE_PRESETS}
    assert compiled["recompute-all"] < compiled["selective"] < compiled["save-all"]


@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
@pytest.mark.parametrize("policy", RECOMPUTE_PRESETS)
def test_prediction_within_ten_percent_on_every_rank(reports, schedule, policy):
    report = reports[(schedule, policy)]
    assert len(report["ranks"]) == 4
    for rank in report["ranks"]:
        assert abs(rank["prediction_error"]) <= 0.10, rank
        # The stash is read from the program and predicted exactly.
        stash = rank["categories"]["stash"]
        assert stash["predicted_device"] == stash["program_device"]


def test_ledger_moves_offloaded_bytes_to_host():
    config = get_config("tiny")
    schedule = generate("1f1b", 4, 8)
    base = predict(config, schedule, "save-all", batch=32, seq=64)
    stash = predict(config, schedule, "offload-stash", batch=32, seq=64)
    weights = predict(config, schedule, "offload-weights", batch=32, seq=64)
    for b, s, w in zip(base.ranks, stash.ranks, weights.ranks):
        assert s.categories["stash"].device == 0
        assert s.categories["stash"].host == b.categories["stash"].device
        assert s.device_bytes < b.device_bytes and s.host_bytes == b.host_bytes + b.categories["stash"].device
        moved = b.categories["params"].device - w.categories["params"].device
        assert moved > 0 and w.categories["params"].host == moved


def test_live_stash_follows_the_schedule():
    config = get_config("tiny")
    ledger = predict(config, generate("1f1b", 4, 8), "save-all", batch=32, seq=64)
    live = [r.live_stash_bytes for r in ledger.ranks]
    assert live == sorted(live, reverse=True) and live[0] > live[-1]


def test_memory_cli_json(capsys, tmp_path):
    from jaxmem.cli import main

    png = tmp_path / "ledger.png"
    code = main(
        [
            "memory",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--policy",
            "selective",
            "--json",
            "-o",
            str(png),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and png.stat().st_size > 1000
    assert report["policy"] == "selective" and report["schedule"] == "1f1b"
    for rank in report["ranks"]:
        for key in ("predicted_device_bytes", "predicted_host_bytes", "compiled_device_bytes", "categories"):
            assert key in rank
        assert set(rank["categories"]) == {"params", "grads", "optimizer_state", "stash", "transient"}


def test_memory_cli_predicted_only_for_a_big_model(capsys):
    from jaxmem.cli import main

    code = main(
        [
            "memory",
            "--model",
            "gpt2-xl",
            "--stages",
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
