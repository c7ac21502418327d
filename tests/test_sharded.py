"""Sharded static state: ZeRO (optimizer state and gradients over the replicas), FSDP (parameters over
the ``fsdp`` axis, gathered per stage), their gradients against plain ``jax.grad``, the bytes every
device holds, and the ledger's prediction of them."""

import jax
import numpy as np
import pytest

from jaxmem.config import TrainConfig
from jaxmem.memory import compare, predict
from jaxmem.pipeline import place_leaf
from jaxmem.schedule import generate
from jaxmem.train import Trainer
from jaxmem.verify import verify

LAYOUTS = [
    # (schedule, P, M, V, data, fsdp, model, policy)
    ("1f1b", 2, 2, None, 2, 1, "tiny", None),  # ZeRO over data
    ("1f1b", 2, 4, None, 2, 2, "llama-tiny", None),  # FSDP x data x pipe
    ("zbv", 2, 2, None, 1, 2, "tiny", "selective"),  # FSDP with split backwards and a policy
    ("interleaved-1f1b", 1, 2, 4, 1, 4, "llama-tiny", "recompute-all"),  # FSDP only: one rank, 4 stages
]


@pytest.mark.parametrize(
    "name,p,m,v,d,f,model,policy", LAYOUTS, ids=[f"{n}-P{p}-D{d}-F{f}-{mo}" for n, p, m, v, d, f, mo, _ in LAYOUTS]
)
def test_sharded_layouts_give_plain_gradients(name, p, m, v, d, f, model, policy):
    result = verify(generate(name, p, m, v), model=model, data_parallel=d, fsdp=f, policy=policy)
    assert result["ok"], result
    assert result["max_rel_diff"] < 1e-5


def test_zero_without_replicas_changes_nothing_and_placements_divide():
    p = place_leaf((4, 2, 64, 192), {"data": 1, "fsdp": 1, "pipe": 4}, kind="stage")
    assert p.params == p.state == (("pipe",), (), (), ())
    # A dimension no axis divides stays whole; the axis goes to another one, or nowhere.
    p = place_leaf((2, 1, 25, 6), {"data": 2, "fsdp": 3, "pipe": 2}, kind="stage")
    assert p.params == (("pipe",), (), (), ("fsdp",)) and p.state == (("pipe",), (), (), ("fsdp", "data"))
    assert p.scatters() == [("data", 3)] and p.sums() == ()
    p = place_leaf((2, 1, 25, 3), {"data": 2, "fsdp": 3, "pipe": 2}, kind="stage")
    assert p.state == p.params == (("pipe",), (), (), ("fsdp",))
    assert p.sums() == ("data",) and p.scatters() == []
    p = place_leaf((25,), {"data": 2, "fsdp": 1, "pipe": 5}, kind="shared")
    assert p.state == (("pipe",),) and p.scatters() == [("pipe", 0)] and p.sums() == ("data", "fsdp")


def _device_bytes(tree) -> int:
    """Bytes of the shards on the first device (what one device holds of a tree of arrays)."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


@pytest.fixture(scope="module")
def trainers():
    """The same tiny run on 8 devices, replicated (no ZeRO, data 4) and sharded (data 2 x fsdp 2)."""
    base = dict(model="llama-tiny", stages=2, microbatches=4, batch_size=16, seq_len=32, steps=3, data="synthetic")
    plain = Trainer(TrainConfig(**base, data_parallel=4, zero=False))
    sharded = Trainer(TrainConfig(**base, data_parallel=2, fsdp=2))
    return plain, sharded


def test_sharded_training_matches_replicated_and_holds_a_quarter(trainers):
    plain, sharded = trainers
    states = [t.init_state() for t in trainers]
    # Parameters: half on each device (fsdp 2); Adam's moments: a quarter of the stages' (fsdp 2 x
    # data 2) and an eighth of the shared ones' (x pipe 2).
    whole_params, whole_opt = _device_bytes(states[0].params), _device_bytes(states[0].opt_state)
    assert _device_bytes(states[1].params) == pytest.approx(whole_params / 2, rel=0.01)
    assert whole_opt / 8 < _device_bytes(states[1].opt_state) < whole_opt / 4
    losses = [[], []]
    for i, t in enumerate(trainers):
        state = states[i]
        for _ in range(3):
            state, metrics, _ = t.step(state)
            losses[i].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-6)
    assert losses[0][-1] < losses[0][0]


def test_the_ledger_predicts_sharded_layouts(trainers):
    _, sharded = trainers
    config = sharded.config
    predicted = predict(
        sharded.model,
        sharded.schedule,
        None,
        batch=config.batch_size,
        seq=config.seq_len,
        data_parallel=config.data_parallel,
        fsdp=config.fsdp,
    )
    report = compare(predicted, sharded.measure_memory())
    assert report["max_prediction_error"] <= 0.10, report
    row = report["ranks"][0]["categories"]
    for name in ("params", "grads", "optimizer_state"):  # static bytes exactly, but for Adam's step counts
        assert row[name]["predicted_device"] == pytest.approx(row[name]["program_device"], abs=16), (name, row[name])
    without_zero = predict(sharded.model, sharded.schedule, None, batch=16, seq=32, data_parallel=4, zero=False)
    ratio = without_zero.ranks[0].categories["optimizer_state"].device / row["optimizer_state"]["predicted_device"]
    assert 4 < ratio < 8  # stage moments over 4 replicas, shared ones over 4 replicas x 2 pipe ranks
