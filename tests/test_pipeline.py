"""The shard_map executor: every schedule gives plain jax.grad gradients (GPT and Llama, float32 and
bfloat16, masked losses, layer drop); compile behaviour; input errors."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import JaxmemError
from jaxmem.config import TrainConfig
from jaxmem.models import get_model, make_batch
from jaxmem.pipeline import Pipeline, build_tick_program, make_mesh, tick_traffic
from jaxmem.schedule import generate, load_csv
from jaxmem.train import Trainer
from jaxmem.verify import ATOL, RTOL, plain_value_and_grad, verification_model, verify

CASES = [
    # (schedule, P, M, V, data-parallel)
    ("gpipe", 4, 4, None, 1),
    ("1f1b", 4, 8, None, 1),
    ("1f1b", 2, 3, None, 1),
    ("1f1b", 1, 2, None, 1),
    ("interleaved-1f1b", 4, 8, 2, 1),
    ("interleaved-1f1b", 2, 4, 2, 1),
    ("zb-h1", 4, 8, None, 1),
    ("zb-h1", 2, 4, None, 1),
    ("zbv", 4, 8, None, 1),
    ("zbv", 2, 4, None, 1),
    ("1f1b", 4, 4, None, 2),
    ("zbv", 4, 4, None, 2),
]


@pytest.mark.parametrize(
    "name,p,m,v,d", CASES, ids=[f"{n}-P{p}-M{m}" + (f"-V{v}" if v else "") + f"-D{d}" for n, p, m, v, d in CASES]
)
def test_gradients_equal_plain_grad(name, p, m, v, d):
    result = verify(generate(name, p, m, v), data_parallel=d)
    assert result["ok"], result
    assert result["max_abs_diff"] < 1e-5


def test_gradients_elementwise_against_plain_grad_tied_head_uneven_split():
    model = get_model("tiny", n_layers=8, max_seq_len=16, tied_head=True)
    schedule = generate("1f1b", 3, 6)
    pipe = Pipeline(model, schedule, make_mesh(1, 3), layer_counts=[3, 3, 2])
    params = model.init(3)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (6, 16), 0, 256, dtype=jnp.int32)
    batch = make_batch(tokens, jnp.roll(tokens, -1, axis=1))
    loss, grads = pipe.value_and_grad(pipe.place(pipe.from_model_params(params)), batch)
    loss_ref, grads_ref = plain_value_and_grad(model, params, batch)
    np.testing.assert_allclose(loss, loss_ref, rtol=RTOL, atol=ATOL)
    got = pipe.to_model_params(grads)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_the_split_cross_entropy_is_the_whole_vocabularys(scale):
    """Each rank's slice reduced to a log-sum-exp and a target logit, gathered once, gives the whole
    vocabulary's loss and gradient: with large logits (each slice shifted by its own maximum) and a
    last slice that is all padding (the masked columns' logits)."""
    from jaxmem.pipeline import _vocab

    ranks, rows, vocab = 4, 6, 17  # 4 x 6 = 24 columns: the 3rd slice ends in padding, the 4th is all padding
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, vocab)) * scale, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, size=(2, 3)))
    mask = jnp.asarray(rng.integers(0, 2, size=(2, 3)), jnp.float32)
    padded = jnp.concatenate([logits, jnp.full((2, 3, ranks * rows - vocab), _vocab._MASKED)], axis=-1)
    slices = [padded[..., r * rows : (r + 1) * rows] for r in range(ranks)]
    parts = []
    for r in range(ranks):  # each rank's part of the one gather
        _vocab.cross_entropy_parts(
            slices[r], targets, r * rows, mask, lambda x: parts.append(x) or jnp.stack([x] * ranks)
        )
    gathered = jnp.stack(parts)
    results = [_vocab.cross_entropy_parts(slices[r], targets, r * rows, mask, lambda _: gathered) for r in range(ranks)]

    whole_loss = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    whole_grad = jax.grad(
        lambda z: jnp.sum(mask * -jnp.take_along_axis(jax.nn.log_softmax(z), targets[..., None], -1)[..., 0])
    )(logits)
    grad = jnp.concatenate([d for _, d in results], axis=-1)
    for loss, _ in results:
        np.testing.assert_allclose(loss, whole_loss, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(grad[..., :vocab], whole_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(grad[..., vocab:]) == 0) and np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("csv", ["torch_zbv_p4_m8_compute.csv", "torch_interleaved1f1b_p4_m8_compute_comms.csv"])
def test_torch_csv_schedules_verify(csv):
    from pathlib import Path

    schedule = load_csv(Path(__file__).parent / "data" / csv)
    assert verify(schedule)["ok"]


def test_stash_slots_come_from_the_schedule_peak_not_m():
    from jaxmem.pipeline import StageClass

    for m in (4, 32):
        schedule = generate("1f1b", 4, m)
        cells = {(s, mb): StageClass(s == 0, s == 3, 1) for s in range(4) for mb in range(m)}
        tick = build_tick_program(schedule, cells)  # one element per stage-microbatch
        assert tick.arena_elems == (4,) and tick.rank_arena_elems == ((4, 3, 2, 1),)
        assert tick.act_slots == 1


@pytest.fixture(scope="module")
def small_trainer():
    config = TrainConfig(pipe=2, microbatches=2, batch_size=4, seq_len=16, steps=3)
    return Trainer(config)


def test_second_step_compiles_nothing(small_trainer, caplog):
    state = small_trainer.init_state()
    state, loss1, _ = small_trainer.step(state)
    loss1 = loss1["loss"]
    jax.block_until_ready(loss1)
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        state, loss2, _ = small_trainer.step(state)
        loss2 = loss2["loss"]
        jax.block_until_ready(loss2)
    compiles = [r for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == [], [r.getMessage() for r in compiles]
    assert state.step == 2


def test_a_trainer_compiles_its_step_once(small_trainer, caplog):
    """The executable compile_abstract() makes (what a planned run compiles to check its pick) is the
    one the steps run and the compiled-bytes metric reads: nothing compiles the step again (before,
    the first step compiled it a second time, which at scale costs minutes)."""
    compiled = small_trainer.compile_abstract()
    state = small_trainer.init_state()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for _ in range(2):
            state, metrics, _ = small_trainer.step(state)
            jax.block_until_ready(metrics["loss"])
        assert small_trainer.compiled(state) is compiled
    again = [r.getMessage() for r in caplog.records if "Compiling jit(step)" in r.getMessage()]
    assert again == [], again


@pytest.mark.parametrize("vocab_split", [True, False], ids=["vocab-split", "whole-vocab"])
def test_the_tick_loop_writes_residuals_in_place_and_copies_no_carried_buffer(vocab_split):
    """Each tick writes its forward's residuals into the stash arena in place, one residual at a time,
    and neither the arena nor a gradient accumulator is copied or scattered into on any tick. (Before,
    the actions were one n-way switch: every branch copied every accumulator, and the stash was written
    by a scatter of a zero-padded window that walked the whole window's indices on every tick.)"""
    config = TrainConfig(
        pipe=2, microbatches=4, batch_size=8, seq_len=16, steps=1, policy="save-all", vocab_split=vocab_split
    )
    trainer = Trainer(config)
    traffic = tick_traffic(trainer.compiled(trainer.init_state()))
    tick, plans = trainer.pipeline.program(trainer.batch_spec())
    assert traffic.ticks == tick.table.shape[1]
    assert tick.stash_keys == (("float32", "device"),)
    arena = f"f32[{tick.arena_elems[0]}]"
    moves = traffic.whole_buffer_moves()
    assert [i for i in moves if i.opcode == "copy"] == [], [i.shape for i in moves]
    assert [i for i in moves if arena in i.shape] == []
    # One in-place write per stashed residual of each class's forward, and no write of the arena otherwise.
    writes = [i for i in traffic.in_place() if arena in i.shape]
    assert len(writes) == sum(len(plan.stashed_leaves()) for plan in plans.values())
    assert traffic.writing(arena) == writes


def test_a_split_backward_runs_the_cotangents_once_and_hands_w_what_it_reads():
    """On a zero-bubble schedule I and W share the backward (jaxmem.pipeline._iw): under save-all
    their matrix products add up to the whole backward's -- W repeats none of I's chain of input
    gradients (before, W ran the whole pullback again) -- W's are the four weight products of a GPT
    layer, and what I hands W lives in its own arena from the I's tick to the W's. In the compiled
    step no carried buffer is copied (an arena written where it is read would be, in every I)."""
    config = TrainConfig(
        schedule="zbv", pipe=2, microbatches=4, batch_size=8, seq_len=16, policy="save-all", split_backward=True
    )
    trainer = Trainer(config)
    pipe = trainer.pipeline
    spec = trainer.batch_spec()
    tick, plans = pipe.program(spec)
    micro, message = pipe.microbatch_spec(spec), pipe.message_spec(spec)
    middle = next(c for c in tick.classes if not c.first and not c.last)
    split = pipe.backward_split(middle, plans[middle], micro, message)

    def dots(eqns):
        return sum(e.primitive.name == "dot_general" for e in eqns)

    whole = dots(split.split.closed.jaxpr.eqns)
    assert dots(split.split.i_eqns) + dots(split.split.w_eqns) == whole
    assert dots(split.split.w_eqns) == 4 * middle.layers  # qkv, out, up, down: one weight product each
    assert tick.class_transfer_elems[tick.classes.index(middle)] == split.transfer_elems()
    assert any(key[1] == "i-to-w" for key in tick.stash_keys)
    moves = tick_traffic(trainer.compiled(trainer.init_state())).whole_buffer_moves()
    assert [i for i in moves if i.opcode == "copy"] == [], [i.shape for i in moves]


def test_w_handed_what_i_recomputed_runs_only_the_weight_products():
    """Under recompute-all a split W re-runs the forward its weight products read; with
    hand_recomputed I hands it those values, and W's matrix products are the four weight products of
    a GPT layer alone, I's unchanged. The tick program lays out what the split hands over, and the
    ledger predicts the program's stash (transfers included) exactly."""
    from jaxmem.memory import predict
    from jaxmem.memory._ledger import _arena_bytes
    from jaxmem.pipeline import batch_spec

    splits, stashes = {}, {}
    for hand in (False, True):
        config = TrainConfig(
            schedule="zbv", pipe=2, microbatches=4, batch_size=8, seq_len=16, policy="recompute-all",
            split_backward=True, hand_recomputed=hand,
        )  # fmt: skip
        pipe = Trainer(config).pipeline
        spec = batch_spec(8, 16)
        tick, plans = pipe.program(spec)
        middle = next(c for c in tick.classes if not c.first and not c.last)
        splits[hand] = pipe.backward_split(middle, plans[middle], pipe.microbatch_spec(spec), pipe.message_spec(spec))
        assert tick.class_transfer_elems[tick.classes.index(middle)] == splits[hand].transfer_elems()
        ledger = predict(pipe.model, pipe.schedule, "recompute-all", batch=8, seq=16, split_backward=True,
                         hand_recomputed=hand)  # fmt: skip
        stashes[hand] = ledger.ranks[0].categories["stash"].device
        assert stashes[hand] == _arena_bytes(tick)[0]  # the tick program's arenas, transfers included

    def dots(eqns):
        return sum(e.primitive.name == "dot_general" for e in eqns)

    plain, hand = splits[False].split, splits[True].split
    assert dots(hand.w_eqns) == 4 * middle.layers < dots(plain.w_eqns)
    assert dots(hand.i_eqns) == dots(plain.i_eqns)
    assert sum(hand.transfer_elems().values()) > sum(plain.transfer_elems().values())
    assert stashes[True] > stashes[False]
    with pytest.raises(JaxmemError, match="split_backward"):
        TrainConfig(schedule="zbv", pipe=2, microbatches=4, hand_recomputed=True)


SPLIT_CASES = [  # (model, schedule, policy, data-parallel, fsdp, hand_recomputed)
    ("tiny", "zbv", "save-all", 1, 1, False),
    ("llama-tiny", "zb-h1", "recompute-all", 2, 1, False),
    ("llama-tiny", "chronos", "selective", 1, 2, False),
    ("tiny", "zbv", "recompute-all", 1, 1, True),
    ("llama-tiny", "chronos", "selective", 1, 2, True),
]


@pytest.mark.parametrize("model,name,policy,d,f,hand", SPLIT_CASES)
def test_a_split_backward_gives_plain_gradients(model, name, policy, d, f, hand):
    """I handing W its cotangents (split_backward), and what it recomputed (hand_recomputed), leaves
    the gradients jax.grad's, with data parallelism, FSDP and a split vocabulary (the first stage's
    I then has an input gradient)."""
    schedule = generate(name, 2, 4)
    result = verify(
        schedule,
        model=verification_model(schedule.num_stages, model),
        policy=policy,
        data_parallel=d,
        fsdp=f,
        split_backward=True,
        hand_recomputed=hand,
    )
    assert result["ok"] and result["max_rel_diff"] < 1e-5, result


def test_training_lowers_the_loss(small_trainer):
    state = small_trainer.init_state()
    losses = []
    for _ in range(12):
        state, metrics, _ = small_trainer.step(state)
        loss = metrics["loss"]
        losses.append(float(loss))
    assert np.mean(losses[-3:]) < losses[0] - 0.3


FORWARD_CASES = [
    # (model, schedule, P, V, mesh): the vocabulary split over pipe, a V-shape, tensor and fsdp
    ("tiny", "1f1b", 4, None, {}),
    ("llama-tiny", "zbv", 2, None, {"fsdp": 2}),
    ("tiny", "interleaved-1f1b", 2, 2, {"data_parallel": 2}),
    ("llama-tiny", "chronos", 2, None, {"tensor": 2}),
]


@pytest.mark.parametrize("model,name,p,v,mesh", FORWARD_CASES, ids=[f"{c[0]}-{c[1]}" for c in FORWARD_CASES])
def test_the_forward_only_program_gives_the_loss_and_stashes_nothing(model, name, p, v, mesh):
    """Evaluation runs the schedule's forwards alone: the plain model's loss, from a tick program with
    no stash arena, no gradient slot and no backward branch."""
    from jaxmem.schedule import Kind

    config = TrainConfig(
        model=model, schedule=name, pipe=p, virtual=v, microbatches=4, batch_size=16, seq_len=32, steps=1, **mesh
    )
    trainer = Trainer(config)
    pipeline, spec = trainer.pipeline, trainer.batch_spec()
    state = trainer.init_state()
    host_batch = trainer.data_iterator().batch_at(0)
    loss = jax.jit(pipeline.loss_fn(spec))(pipeline.compute_params(state.params), trainer.put_batch(host_batch))
    whole = pipeline.to_model_params(jax.device_get(state.params))
    expected = jax.jit(trainer.model.plain_loss)(whole, dict(host_batch.arrays()))
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    tick, _ = pipeline.program(spec, forward=True)
    assert tick.stash_keys == () and tick.arena_elems == () and tick.grad_slots == 0
    assert {kind for _, kind in tick.branches} == {Kind.F}
    train_tick, _ = pipeline.program(spec)
    assert tick.num_ticks < train_tick.num_ticks


def test_forward_only_schedules_are_tables_of_forwards():
    from jaxmem.schedule import Kind, forward_only, validate

    for name, v, ticks in (("1f1b", None, 8 + 4 - 1), ("interleaved-1f1b", 2, 2 * 8 + 4 - 1), ("zbv", None, None)):
        train = generate(name, 4, 8, v)
        forward = validate(forward_only(train))
        assert forward.forward_only and not train.forward_only
        assert forward.stage_to_rank == train.stage_to_rank
        assert sorted(map(str, forward.actions())) == sorted(str(a) for a in train.actions() if a.kind is Kind.F)
        if ticks is not None:
            assert forward.num_steps == ticks
    # A table of forwards gives no gradients: training on one is refused, saying what to use.
    pipeline = Pipeline(get_model("tiny"), forward_only(generate("1f1b", 2, 2)), make_mesh(pipe=2))
    with pytest.raises(JaxmemError, match="runs forwards only.*loss_fn"):
        pipeline.grad_fn(4, 16)


# ---------------------------------------------------------------- errors before compiling
def test_stages_that_do_not_divide_the_layers():
    with pytest.raises(JaxmemError, match=r"8 layers do not split evenly over 3 stages; .*1, 2, 4, 8"):
        Trainer(TrainConfig(pipe=3, microbatches=3, batch_size=6))
    # The example split sums to the model's layers, and the Python caller is told its own argument.
    with pytest.raises(JaxmemError, match=r"e.g. layer_counts=\(3, 3, 2\)"):
        Trainer(TrainConfig(pipe=3, microbatches=3, batch_size=6))
    with pytest.raises(JaxmemError, match=r"build the schedule with 2 ranks \(pipe=2\)"):
        Pipeline(get_model("tiny"), generate("1f1b", 4, 4), make_mesh(1, 2))


def test_devices_that_do_not_factor():
    with pytest.raises(JaxmemError, match=r"data\(2\) x pipe\(8\) = 16 devices, but only 8"):
        Trainer(TrainConfig(pipe=8, data_parallel=2, microbatches=8, batch_size=16))


def test_batch_not_divisible_by_microbatches():
    with pytest.raises(JaxmemError, match=r"batch_size=30 is not divisible by .* = 8; use a batch size in \[8, 16"):
        Trainer(TrainConfig(batch_size=30))


def test_schedule_stage_count_mismatch(tmp_path):
    from jaxmem.schedule import save_csv

    path = save_csv(generate("1f1b", 2, 8), tmp_path / "two.csv")
    with pytest.raises(JaxmemError, match="has 2 ranks but pipe=4; set pipe=2"):
        Trainer(TrainConfig(schedule=None, schedule_csv=str(path), pipe=4))


def test_unknown_model_preset():
    with pytest.raises(JaxmemError, match="unknown model preset 'gpt5'; valid presets: tiny, gpt2-small.*llama-tiny"):
        Trainer(TrainConfig(model="gpt5"))


def test_verify_computes_a_models_plain_reference_once_and_never_for_another(monkeypatch):
    """verify() keeps the plain reference of jaxmem's own models (a fifth of a tiny model's verify),
    keyed on what it computes: the same model under another schedule and policy reads it back; the
    same configuration with another layer function is another model."""
    import dataclasses

    import jaxmem.verify as verify_module

    calls = []
    real = verify_module.plain_value_and_grad
    monkeypatch.setattr(verify_module, "plain_value_and_grad", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(verify_module, "_REFERENCES", type(verify_module._REFERENCES)())
    model = verification_model(2)
    assert verify(generate("1f1b", 2, 2), model=model)["ok"]
    assert verify(generate("gpipe", 2, 2), model=model, policy="recompute-all")["ok"]
    assert len(calls) == 1
    halved = dataclasses.replace(model, layer=lambda p, x, b: model.layer(p, x, b) * 0.5, loss=None)
    assert verify(generate("1f1b", 2, 2), model=halved)["ok"]  # against its own reference
    assert len(calls) == 2


def test_verification_model_splits_evenly():
    assert verification_model(8).n_layers == 8
    assert verification_model(3).n_layers == 6
    assert verification_model(2, "llama-tiny").n_layers == 4


def test_a_batch_of_the_wrong_structure_is_refused():
    pipe = Pipeline("tiny", generate("1f1b", 2, 2), make_mesh(1, 2))
    fn = pipe.grad_fn(4, 16)
    tokens = jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(JaxmemError, match="built for batches .*tokens.*; got .*loss_mask"):
        fn(pipe.abstract_params(), make_batch(tokens, tokens, loss_mask=jnp.ones((4, 16))))
    with pytest.raises(JaxmemError, match="a batch is a dict of arrays that lead with the batch size"):
        pipe.check_batch((tokens, tokens))
    with pytest.raises(JaxmemError, match="every batch leaf must lead with the batch size 4"):
        pipe.check_batch({"tokens": tokens, "targets": tokens, "label": jnp.zeros((3,))})
