"""Sharded static state: ZeRO (optimizer state and gradients over the replicas), FSDP (parameters over
the ``fsdp`` axis, gathered per stage), their gradients against plain ``jax.grad``, the bytes every
device holds, and the ledger's prediction of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

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
    # FSDP only: one rank, 4 stages, their weights on host (the prefetch slot holds this device's shard)
    ("interleaved-1f1b", 1, 2, 4, 1, 4, "llama-tiny", {"base": "recompute-all", "offload_weights": True}),
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
    base = dict(model="llama-tiny", pipe=2, microbatches=4, batch_size=16, seq_len=32, steps=3, data="synthetic")
    plain = Trainer(TrainConfig(**base, data_parallel=4, zero=False))
    sharded = Trainer(TrainConfig(**base, data_parallel=2, fsdp=2))
    return plain, sharded


def test_sharded_training_matches_replicated_and_holds_a_quarter(trainers):
    plain, sharded = trainers
    states = [t.init_state() for t in trainers]
    # Parameters: the stages' and the shared ones' halved on each device (fsdp 2), the vocabulary's
    # slices (1/P already) whole over fsdp; Adam's moments: a quarter of the stages' and the
    # vocabulary's (fsdp 2 x data 2) and an eighth of the shared ones' (x pipe 2).
    plain_state, sharded_state = states
    for field, ratio in (("stages", 2), ("shared", 2), ("vocab", 1)):
        whole = _device_bytes(getattr(plain_state.params, field))
        assert _device_bytes(getattr(sharded_state.params, field)) == pytest.approx(whole / ratio, rel=0.01), field
    whole_opt = _device_bytes(plain_state.opt_state)
    assert whole_opt / 8 < _device_bytes(sharded_state.opt_state) < whole_opt / 4
    losses = [[], []]
    for i, t in enumerate(trainers):
        state = states[i]
        for _ in range(3):
            state, metrics, _ = t.step(state)
            losses[i].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-6)
    assert losses[0][-1] < losses[0][0]


def _predicted(trainer):
    """The predicted ledger of a trainer's run (its model, schedule, policy and mesh)."""
    config = trainer.config
    return predict(
        trainer.model,
        trainer.schedule,
        config.policy,
        batch=config.batch_size,
        seq=config.seq_len,
        data_parallel=config.data_parallel,
        fsdp=config.fsdp,
    )


def test_the_ledger_predicts_sharded_layouts(trainers):
    _, sharded = trainers
    predicted = _predicted(sharded)
    report = compare(predicted, sharded.measure_memory())
    assert report["max_prediction_error"] <= 0.10, report
    row = report["ranks"][0]["categories"]
    for name in ("params", "grads", "optimizer_state"):  # static bytes exactly, but for Adam's step counts
        assert row[name]["predicted_device"] == pytest.approx(row[name]["program_device"], abs=16), (name, row[name])
    without_zero = predict(sharded.model, sharded.schedule, None, batch=16, seq=32, data_parallel=4, zero=False)
    ratio = without_zero.ranks[0].categories["optimizer_state"].device / row["optimizer_state"]["predicted_device"]
    assert 4 < ratio < 8  # stage moments over 4 replicas, shared ones over 4 replicas x 2 pipe ranks


def test_checkpoints_are_written_from_shards_and_restore_onto_other_meshes(trainers, tmp_path):
    """Saving holds nothing beyond the state's own shards (before: the whole model and both Adam
    moments on every device); the step restores onto the same layout on another mesh (each device
    reads its shard) and onto another stage split and vocabulary cut (re-laid out on the host), with
    equal values and, again, only shards on the devices."""
    from jaxmem.train import Checkpointer
    from jaxmem.train._checkpoint import _leaf_hasher

    _, sharded = trainers
    state = sharded.init_state()
    state, _, _ = sharded.step(state)
    held = _device_bytes((state.params, state.opt_state))
    exported, meta = sharded.export_state(state)
    assert _device_bytes(exported) <= held  # the very arrays: no gathered copy
    # The checksums are computed on the devices, a leaf at a time: at most one leaf's temporary.
    hashing = max(
        _leaf_hasher(x).lower(x).compile().memory_analysis().temp_size_in_bytes for x in jax.tree.leaves(exported)
    )
    assert hashing <= 0.25 * held, (hashing, held)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)
    ckpt.save(state.step, exported, meta)
    ckpt.close()
    reference = [np.asarray(x) for x in jax.tree.leaves(sharded.pipeline.to_model_params(state.params))]
    base = dict(sharded.config.__dict__)
    plans = [
        dict(data_parallel=1, fsdp=2, devices=4),  # the same layout, half the replicas
        dict(pipe=4, data_parallel=2, fsdp=1, microbatches=4),  # another stage split and vocabulary cut
    ]
    for plan in plans:
        trainer = Trainer(TrainConfig(**{**base, **plan}))
        restored = Checkpointer(tmp_path / "ckpt").restore(trainer.restore_target())
        resumed = trainer.import_state(restored.state, restored.meta)
        fresh = trainer.init_state()
        assert _device_bytes((resumed.params, resumed.opt_state)) == _device_bytes((fresh.params, fresh.opt_state))
        for a, b in zip(jax.tree.leaves(trainer.pipeline.to_model_params(resumed.params)), reference):
            np.testing.assert_array_equal(np.asarray(a), b)
        for got, want in zip(_moments(trainer, resumed.opt_state), _moments(sharded, state.opt_state), strict=True):
            np.testing.assert_array_equal(got, want)
        resumed, metrics, _ = trainer.step(resumed)
        assert np.isfinite(float(metrics["loss"]))


def _moments(trainer, opt_state) -> list:
    """Every array of the optimizer state's per-parameter trees, in the model's layout, on the host."""
    from jaxmem.pipeline import PipelineParams

    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, PipelineParams))
    trees = [trainer.pipeline.to_model_params(jax.device_get(n)) for n in nodes if isinstance(n, PipelineParams)]
    return [np.asarray(x) for tree in trees for x in jax.tree.leaves(tree)]


# ---------------------------------------------------------------- master weights cut (bf16 compute)
@pytest.fixture(scope="module")
def bf16_trainers():
    """llama-tiny in bfloat16 on P=2 x D=4: ZeRO (master weights cut, the default) and no ZeRO."""
    base = dict(model="llama-tiny", dtype="bfloat16", pipe=2, data_parallel=4, microbatches=2, batch_size=16)
    base.update(seq_len=32, steps=3, data="synthetic")
    fsdp = {**base, "data_parallel": 1, "fsdp": 4}
    return Trainer(TrainConfig(**base)), Trainer(TrainConfig(**base, zero=False)), Trainer(TrainConfig(**fsdp))


def test_master_weights_are_cut_over_data_and_train_exactly_as_whole_ones(bf16_trainers, tmp_path):
    from jaxmem.train import Checkpointer

    cut, whole, fsdp = bf16_trainers
    assert cut.pipeline.master_cut and fsdp.pipeline.master_cut and not whole.pipeline.master_cut
    states = [t.init_state() for t in bf16_trainers]
    # float32 master weights: the stage leaves a quarter on each device (data 4), the shared ones an
    # eighth (data 4 x pipe 2), where the whole run keeps them whole.
    assert {str(x.dtype) for x in jax.tree.leaves(states[0].params)} == {"float32"}
    ratio = _device_bytes(states[1].params.stages) / _device_bytes(states[0].params.stages)
    assert ratio == pytest.approx(4, rel=0.02)
    losses = [[], [], []]
    for i, t in enumerate(bf16_trainers):
        for _ in range(3):
            states[i], metrics, _ = t.step(states[i])
            losses[i].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-6)  # FSDP gathering the 16-bit copy per action
    # The compiled program holds the cut master weights and the 16-bit copy; the ledger says the same.
    for trainer, state in ((cut, states[0]), (fsdp, states[2])):
        predicted = _predicted(trainer).ranks[0]
        compiled = trainer.measure_memory(state)
        for name in ("params", "grads"):
            got = compiled.ranks[0].categories[name].device
            assert predicted.categories[name].device == pytest.approx(got, abs=16), (trainer.config.fsdp, name)
    compiled = cut.measure_memory(states[0])
    whole_params = whole.measure_memory(states[1]).ranks[0].categories["params"].device
    assert compiled.ranks[0].categories["params"].device < 0.8 * whole_params  # 1 + 2 of 4 bytes per weight
    # A checkpoint of cut master weights restores onto whole ones (and back), value for value.
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)
    ckpt.save(states[0].step, *cut.export_state(states[0]))
    ckpt.close()
    restored = Checkpointer(tmp_path / "ckpt").restore(whole.restore_target())
    resumed = whole.import_state(restored.state, restored.meta)
    for a, b in zip(
        jax.tree.leaves(whole.pipeline.to_model_params(resumed.params)),
        jax.tree.leaves(cut.pipeline.to_model_params(states[0].params)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _RoutedBlock(nnx.Module):
    """bfloat16 matmuls beside a gate the block computes in float32 from its float32 weight."""

    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 2 * d, dtype=jnp.bfloat16, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, dtype=jnp.bfloat16, rngs=rngs)
        self.gate = nnx.Param(jnp.full((d,), 0.1))

    def __call__(self, x):
        gate = jax.nn.sigmoid(x.astype(jnp.float32) @ self.gate[...])[..., None]
        return x + (gate * self.down(jnp.tanh(checkpoint_name(self.up(x), "hidden")))).astype(x.dtype)


class _RoutedLM(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(32, 16, dtype=jnp.bfloat16, rngs=rngs)
        self.blocks = nnx.List([_RoutedBlock(16, rngs) for _ in range(2)])
        self.out = nnx.Linear(16, 32, dtype=jnp.bfloat16, rngs=rngs)


def test_only_leaves_the_model_casts_are_cast_in_the_compute_copy():
    from jaxmem.models import from_nnx, token_loss
    from jaxmem.pipeline import Pipeline, make_mesh

    model = from_nnx(
        _RoutedLM,
        layers="blocks",
        embed=lambda m, b: m.tok(b["tokens"]),
        head_loss=lambda m, x, b: token_loss(m.out(x), b),
        tags=("hidden",),
        vocab_size=32,
    )
    pipeline = Pipeline(model, generate("1f1b", 2, 2), make_mesh(2, 2))
    assert pipeline.master_cut
    stage = pipeline.compute_abstract().stages[0]
    assert stage["gate"].dtype == jnp.float32  # used in float32: kept
    assert stage["up"]["kernel"].dtype == stage["down"]["bias"].dtype == jnp.bfloat16
    result = verify(generate("1f1b", 2, 2), model=model, data_parallel=2)
    assert result["ok"], result


def test_fsdp_keeping_gathered_weights_is_a_policy_the_ledger_prices():
    """``+keep-gathered``: a stage gathers its FSDP shard once per step and keeps it (and its gradient,
    whole) instead of gathering for every action. Same gradients and losses, the bytes the ledger says
    it adds, and on an accelerator profile the traffic it saves."""
    from jaxmem.memory import estimate
    from jaxmem.search import search

    result = verify(generate("zbv", 2, 4), model="llama-tiny", fsdp=2, policy="selective+keep-gathered")
    assert result["ok"] and result["max_rel_diff"] < 1e-5, result
    base = dict(model="llama-tiny", pipe=2, fsdp=4, microbatches=4, batch_size=16, seq_len=32, data="synthetic")
    trainers = [Trainer(TrainConfig(**base, policy=p)) for p in ("save-all", "save-all+keep-gathered")]
    assert trainers[1].pipeline.kept_gathered == (True,)
    losses, compiled = [], []
    for t in trainers:
        state = t.init_state()
        compiled.append(t.measure_memory(state))
        state, metrics, _ = t.step(state)
        losses.append(float(metrics["loss"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    predicted = _predicted(trainers[1])
    for name in ("params", "grads"):  # the whole stage and its gradient beside the shards
        got = compiled[1].ranks[0].categories[name].device
        assert predicted.ranks[0].categories[name].device == pytest.approx(got, abs=16), name
    # The program itself (memory_analysis): larger than gathering per action, and as the ledger says.
    assert compiled[1].max_device_bytes > compiled[0].max_device_bytes + trainers[1].pipeline.kept_bytes(
        trainers[1].pipeline.abstract_params()
    )
    assert predicted.max_device_bytes == pytest.approx(compiled[1].max_device_bytes, rel=0.10)
    # On an accelerator profile, FSDP over 8 gathers every action's stage: keeping it gathered trades
    # its bytes for most of that traffic, and the planner ranks the two.
    schedule = generate("gpipe", 1, 4)
    per_action, kept = (
        estimate("llama-tiny", schedule, p, batch=64, seq=64, fsdp=8, hardware="h100")
        for p in ("selective", "selective+keep-gathered")
    )
    assert kept.tokens_per_second > per_action.tokens_per_second and kept.device_bytes > per_action.device_bytes
    plan = search(
        "llama-tiny",
        devices=8,
        batch=64,
        seq=64,
        budget_bytes=2**40,  # any: the point is the ranking
        mesh={"data": 1, "fsdp": 8, "pipe": 1, "tensor": 1},
        schedules=("gpipe",),
        policies=("selective",),
        microbatches=[4],
    )
    assert plan.best.policy_name == "selective+keep-gathered" and plan.best.fsdp == 8


def test_checksums_are_the_same_however_the_array_is_cut():
    """Each device hashes its own shard at its place in the whole array (no collective); the host adds
    one copy of each shard. Every layout gives the whole array's hash, computed here on the host."""
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    from jaxmem.train import array_checksums
    from jaxmem.train._checkpoint import _hash, _leaf_hasher

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "pipe"))
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    layouts = [
        NamedSharding(mesh, P()),  # replicated: counted once, not 8 times
        NamedSharding(mesh, P("pipe", ("data", "fsdp"))),
        NamedSharding(mesh, P(("fsdp", "data"), "pipe")),  # axes in another order than the mesh's
        NamedSharding(mesh, P(None, ("data", "fsdp", "pipe")), memory_kind="pinned_host"),
        SingleDeviceSharding(jax.devices()[3]),
    ]
    tree = {str(i): jax.device_put(x, s) for i, s in enumerate(layouts)}
    tree["bf16"] = jax.device_put(x.astype(jnp.bfloat16), layouts[1])
    want = int(_hash(x, np))
    got = array_checksums(tree)
    assert {k: v["hash"] for k, v in got.items() if "bf16" not in k} == {f"['{i}']": want for i in range(5)}
    assert got["['bf16']"]["hash"] == int(_hash(np.asarray(tree["bf16"]), np)) != want
    # No collective in the program that hashes a sharded leaf (an all-reduce there aborted on rare runs).
    hlo = _leaf_hasher(tree["1"]).lower(tree["1"]).compile().as_text()
    assert not any(op in hlo for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all")), hlo
    # A value moved to another place changes the hash, whatever the cut.
    swapped = x.copy()
    swapped[[0, 7]] = swapped[[7, 0]]
    assert array_checksums({"a": jax.device_put(swapped, layouts[1])})["['a']"]["hash"] != want


def test_a_cpu_step_over_processes_sums_and_slices_where_it_reduce_scattered():
    """Issue 67: on XLA:CPU over gloo, a reduce-scatter stalls the tick loop's collective-permutes
    (1.64 s a step of the tiny GPT on pipe 2 over two processes, 0.26 s without ZeRO), so a CPU
    pipeline spanning processes sums and slices instead. The same gradients, no reduce-scatter in the
    compiled step; a one-process pipeline keeps the reduce-scatter."""
    from jaxmem.models import get_model, make_batch
    from jaxmem.pipeline import Pipeline, make_mesh

    model = get_model("tiny", n_layers=4)
    pipeline = Pipeline(model, generate("1f1b", 2, 2), make_mesh(2, 2, fsdp=2))
    assert not pipeline.sum_then_slice  # one process
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, model.vocab_size)
    batch = make_batch(tokens, jnp.roll(tokens, -1, axis=1))
    params = pipeline.place(pipeline.from_model_params(model.init(1)))

    def step(p):
        fn = p.grad_fn(batch)
        return jax.jit(fn).lower(params, batch).compile()

    scattered = step(pipeline)
    pipeline_sliced = Pipeline(model, generate("1f1b", 2, 2), make_mesh(2, 2, fsdp=2))
    pipeline_sliced.sum_then_slice = True  # what a mesh spanning processes on CPU sets
    sliced = step(pipeline_sliced)
    assert "reduce-scatter" in scattered.as_text() and "reduce-scatter" not in sliced.as_text()
    (loss_a, grads_a), (loss_b, grads_b) = scattered(params, batch), sliced(params, batch)
    assert float(loss_a) == float(loss_b)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
