"""The model interface: a user's own Flax model (from_nnx), the Llama, mixed precision, masked losses,
declared tags, and the facts the ledger and planners use (traced vs the GPT's closed form)."""

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem import JaxmemError
from jaxmem.cli import main
from jaxmem.memory import model_facts
from jaxmem.models import GPT_TAGS, from_nnx, get_model, make_batch, named_softmax, token_loss
from jaxmem.pipeline import Pipeline, make_mesh
from jaxmem.policy import PRESETS, PolicyError, StagePolicy, TagSet
from jaxmem.schedule import generate, list_generators
from jaxmem.verify import verification_model, verify


# ---------------------------------------------------------------- a user's own model
class TinyBlock(nnx.Module):
    def __init__(self, d, rngs, tag="hidden"):
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.tag = tag

    def __call__(self, x):
        # Tag the matmul's output, not tanh's: tanh's backward reads its own (untagged) output.
        return x + self.down(jnp.tanh(checkpoint_name(self.up(x), self.tag)))


class TinyLM(nnx.Module):
    """A model jaxmem has never seen: its own names, a nested layer list, no GPT layout."""

    def __init__(self, rngs, tag="hidden", layers=4):
        self.tok = nnx.Embed(32, 16, rngs=rngs)
        self.trunk = nnx.Dict(stack=nnx.List([TinyBlock(16, rngs, tag) for _ in range(layers)]), scale=nnx.Param(1.0))
        self.out = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens)
        for block in self.trunk["stack"]:
            x = block(x)
        return self.out(x * self.trunk["scale"])


def tiny_lm(tag="hidden", declared=("hidden",)):
    return from_nnx(
        lambda rngs: TinyLM(rngs, tag),
        layers="trunk.stack",
        embed=lambda m, batch: m.tok(batch["tokens"]),
        head_loss=lambda m, x, batch: token_loss(m.out(x * m.trunk["scale"]), batch),
        tags=declared,
        loss=lambda m, batch: jnp.mean(
            -jnp.take_along_axis(jax.nn.log_softmax(m(batch["tokens"])), batch["targets"][..., None], -1)
        ),
        name="tiny-lm",
        vocab_size=32,
    )


def test_a_users_nnx_model_trains_pipelined_with_gradients_equal_to_its_own_loss():
    model = tiny_lm()
    layers, shared = model.split(model.init(0))
    assert len(layers) == 4 and "trunk" in shared and "scale" in shared["trunk"]  # the shared scale stays shared
    result = verify(generate("zbv", 2, 4), model=model, policy={"base": "save-all", "hidden": "recompute"})
    assert result["ok"], result
    assert result["max_rel_diff"] < 1e-5


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_abstract_params_kept_from_the_build_equal_a_trace_of_init(name):
    # from_nnx keeps the shapes of the module it built abstractly instead of tracing init again.
    model = get_model(name, n_layers=3)
    kept, traced = model.abstract_params(), jax.eval_shape(lambda: model.init(0))
    assert jax.tree.structure(kept) == jax.tree.structure(traced)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(kept)] == [(a.shape, a.dtype) for a in jax.tree.leaves(traced)]


def test_an_emitted_tag_the_model_does_not_declare_is_an_error():
    model = tiny_lm(tag="secret", declared=("hidden",))
    pipe = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2))
    with pytest.raises(JaxmemError, match=r"emits checkpoint_name tags it does not declare: \['secret'\]"):
        pipe.residual_plans(4, 8)


def test_a_policy_naming_a_tag_the_model_does_not_declare_is_an_error():
    with pytest.raises(PolicyError, match=r"unknown activation tag 'attn_probs'; the model declares: hidden"):
        Pipeline(tiny_lm(), generate("1f1b", 2, 2), make_mesh(1, 2), policy={"attn_probs": "offload"})
    with pytest.raises(PolicyError, match=r"stage 1: unknown activation tag 'mlp_gate'.*mlp_pre"):
        Pipeline("tiny", generate("1f1b", 2, 2), make_mesh(1, 2), policy={"stage": {"1": {"mlp_gate": "save"}}})


def test_save_all_saves_every_declared_tag_of_any_model():
    # The old lowering saved GPT's tag list: a model's own tag was silently recomputed.
    model = tiny_lm()
    bound = PRESETS["save-all"].bind(model.tags)
    assert bound.save == {"hidden"} and not bound.recompute
    facts = model_facts(model)
    saved = facts.stage(first=False, last=False, layers=2, policy=bound, microbatch=1, seq=8)
    recomputed = facts.stage(
        first=False, last=False, layers=2, policy=PRESETS["recompute-all"].bind(model.tags), microbatch=1, seq=8
    )
    hidden = 2 * 8 * 32  # two layers' up-projections, one sequence of 8
    assert saved.stash_bytes() - recomputed.stash_bytes() == 4 * hidden
    assert saved.recompute_flops == 0 < recomputed.recompute_flops


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"layers": "blocks"}, r"the model has no 'blocks' \(the repeated layers\)"),
        ({"layers": "trunk.scale"}, r"'trunk.scale' is a Param, not a list of layer modules"),
    ],
)
def test_from_nnx_errors_name_what_is_wrong(kwargs, message):
    base = {
        "embed": lambda m, b: m.tok(b["tokens"]),
        "head_loss": lambda m, x, b: token_loss(m.out(x), b),
        "tags": (),
    }
    with pytest.raises(JaxmemError, match=message):
        from_nnx(lambda rngs: TinyLM(rngs), **{**base, **kwargs})


def test_from_nnx_refuses_state_it_cannot_carry_and_takes_layers_of_other_parameters():
    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.tok = nnx.Embed(8, 4, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    kw = {"layers": "blocks", "embed": lambda m, b: m.tok(b["tokens"]), "head_loss": lambda m, x, b: x, "tags": ()}
    with pytest.raises(
        JaxmemError, match=r"keeps RNG streams \(.*drop.*rngs.*\).*For dropout, build nnx.Dropout without rngs"
    ):
        from_nnx(WithDropout, **kw)

    class Uneven(nnx.Module):
        def __init__(self, rngs):
            self.tok = nnx.Embed(8, 4, rngs=rngs)
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, use_bias=False, rngs=rngs)])

    uneven = from_nnx(Uneven, **kw)  # two parameter families, stacked apart by a pipeline
    assert uneven.layer_families == (0, 1) and uneven.layer_kinds == (0, 1)


# ---------------------------------------------------------------- the Llama, every schedule
SCHEDULES = [g.name for g in list_generators()]


@pytest.mark.parametrize("name", SCHEDULES)
def test_llama_gradients_equal_plain_grad_for_every_schedule(name):
    virtual = 2 if name == "interleaved-1f1b" else None
    schedule = generate(name, 2, 4, virtual)
    result = verify(schedule, model=verification_model(schedule.num_stages, "llama-tiny"), policy="selective")
    assert result["ok"], result
    assert result["dtype"] == "float32" and result["max_rel_diff"] < 1e-5


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-1f1b"])
def test_llama_bf16_with_float32_master_weights_passes_at_bf16_tolerances(name):
    virtual = 2 if name == "interleaved-1f1b" else None
    schedule = generate(name, 2, 4, virtual)
    model = verification_model(schedule.num_stages, "llama-tiny", dtype="bfloat16")
    result = verify(schedule, model=model, loss_mask=True)
    assert result["ok"], result
    assert result["dtype"] == "bfloat16" and "||diff||_2 <= 0.04" in result["tolerance"]
    assert 1e-4 < result["max_rel_diff"] < 0.04  # bf16 rounding shows, and stays inside


def test_bf16_verify_fails_when_a_gradient_is_wrong():
    schedule = generate("1f1b", 2, 8)
    model = verification_model(2, "llama-tiny", dtype="bfloat16")

    def drop_one_microbatch_of_a_layer(grads):  # one of 8 microbatches missing from one layer's weights
        layer = grads["layers"][1]
        layer["w_up"]["kernel"] = layer["w_up"]["kernel"] * (7 / 8)
        return grads

    result = verify(schedule, model=model, perturb=drop_one_microbatch_of_a_layer)
    assert not result["ok"] and result["first_mismatch"] == "['layers'][1]['w_up']['kernel']"
    assert verify(schedule, model=model)["ok"]


def test_masked_loss_and_layer_drop_equal_plain_grad():
    schedule = generate("1f1b", 2, 4)
    result = verify(schedule, model="llama-tiny", loss_mask=True, drop_layers={1, 2})
    assert result["ok"] and result["drop_layers"] == [1, 2] and result["loss_mask"], result

    def nudge_a_dropped_layer(grads):  # a dropped layer must get exactly zero gradient
        grads["layers"][1]["w_up"]["kernel"] = grads["layers"][1]["w_up"]["kernel"] + 1e-3
        return grads

    def lose_a_leaf(grads):  # a gradient tree of another structure is a failure, not skipped leaves
        del grads["layers"][2]["w_up"]
        return grads

    nudged = verify(schedule, model="llama-tiny", drop_layers={1, 2}, perturb=nudge_a_dropped_layer)
    assert not nudged["ok"] and nudged["first_mismatch"] == "['layers'][1]['w_up']['kernel']"
    lost = verify(schedule, model="llama-tiny", drop_layers={1, 2}, perturb=lose_a_leaf)
    assert not lost["ok"] and lost["first_mismatch"].startswith("tree structure")


def test_mixed_precision_keeps_float32_params_grads_and_optimizer_state():
    from jaxmem.config import TrainConfig
    from jaxmem.train import Trainer

    trainer = Trainer(
        TrainConfig(model="llama-tiny", dtype="bf16", pipe=2, microbatches=2, batch_size=4, seq_len=16, steps=4)
    )
    state = trainer.init_state()
    dtypes = {
        leaf.dtype.name for tree in (state.params, state.opt_state) for leaf in jax.tree.leaves(tree) if leaf.ndim
    }
    assert dtypes == {"float32"}
    tick, _ = trainer.pipeline.program(trainer.batch_spec())
    assert tick.stash_keys == (("bfloat16", "device"),)
    assert trainer.pipeline.compute_dtype(trainer.batch_spec()).name == "bfloat16"
    losses = []
    for _ in range(4):
        state, metrics, _ = trainer.step(state)
        loss = metrics["loss"]
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert {leaf.dtype.name for leaf in jax.tree.leaves(state.params)} == {"float32"}


# ---------------------------------------------------------------- the attention softmax
def test_saving_attention_probabilities_really_saves_their_recompute():
    # jax.nn.softmax's own custom JVP keeps its untagged output for the backward: a policy saving the
    # tag would still recompute q k^T and the softmax. named_softmax's backward reads the tagged value.
    for name in ("tiny", "llama-tiny"):
        model = get_model(name, n_layers=2)
        facts = model_facts(model, analytic=False)
        kw = {"first": False, "last": False, "layers": 1, "microbatch": 1, "seq": 32}
        save_all = facts.stage(policy=PRESETS["save-all"].bind(model.tags), **kw)
        selective = facts.stage(policy=PRESETS["selective"].bind(model.tags), **kw)
        assert save_all.recompute_flops == 0, name
        probs = 4 * 32 * 32 * 4  # heads x seq x seq, float32
        assert save_all.stash_bytes() - selective.stash_bytes() == probs
        assert selective.recompute_flops >= 2 * 32 * 32 * 64  # q k^T again


def test_named_softmax_gradient_equals_jax_softmax():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 7))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 7))
    got = jax.grad(lambda x: jnp.sum(named_softmax(x, "p") * w))(x)
    want = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * w))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- facts: traced vs closed form
def _random_policies(n, tags, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        decisions = {t: rng.choice(["save", "save", "recompute", "offload"]) for t in tags.names}
        out.append(StagePolicy(base="recompute-all", tags=decisions, offload_stash=rng.random() < 0.2))
    return out


@pytest.mark.parametrize(
    "policy", list(PRESETS.values()) + _random_policies(6, GPT_TAGS), ids=lambda p: p.describe()[:40]
)
def test_gpt_closed_form_equals_the_traced_residuals(policy):
    model = get_model("tiny", n_layers=4, max_seq_len=32)
    bound = policy.bind(model.tags)
    closed, traced = model_facts(model), model_facts(model, analytic=False)
    assert closed.source == "analytic" and traced.source == "traced"
    for first, last, layers in [(False, False, 1), (True, False, 2), (False, True, 2), (True, True, 3)]:
        kw = {"first": first, "last": last, "layers": layers, "policy": bound, "microbatch": 2, "seq": 32}
        a, t = closed.stage(**kw), traced.stage(**kw)
        assert a.stash_elems == t.stash_elems, kw
        assert a.full_bytes == t.full_bytes
        # The closed form counts matmuls; cost_analysis() adds the elementwise work (a few percent).
        assert 0.90 < a.forward_flops / t.forward_flops <= 1.0
        assert 0.88 < a.backward_flops / t.backward_flops <= 1.0


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_a_deep_preset_is_its_one_layer_model_repeated(name, monkeypatch):
    """Planners build a preset at many depths; each is the one-layer model's layer repeated, with
    the same abstract parameters, axes, initial values and loss as the model built whole, and no
    layer constructor run until the parameters are made."""
    from jaxmem.models import get_config, gpt, llama
    from jaxmem.models.gpt import Block
    from jaxmem.models.llama import LlamaBlock

    block = Block if name == "tiny" else LlamaBlock
    built = []
    original = block.__init__
    monkeypatch.setattr(block, "__init__", lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    layers = 7  # a depth no other test asks for: the models are cached by config
    deep = get_model(name, n_layers=layers)
    assert len(built) <= 1  # the one-layer model, unless it was cached already
    before = len(built)
    whole = (gpt if name == "tiny" else llama)(get_config(name, n_layers=layers), name)
    assert len(built) - before == layers  # the count sees a model built whole
    for a, b in ((deep.abstract_params(), whole.abstract_params()), (deep.axes, whole.axes)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert [repr(x) for x in jax.tree.leaves(a)] == [repr(x) for x in jax.tree.leaves(b)]
    assert (deep.n_layers, deep.config, deep.analytic is None) == (whole.n_layers, whole.config, whole.analytic is None)
    params = deep.init(0)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(whole.init(0)), strict=True):
        np.testing.assert_array_equal(x, y)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 97
    batch = make_batch(tokens, (tokens + 1) % 97)
    assert float(deep.loss(params, batch)) == float(whole.loss(params, batch))
    assert deep.logits(params, batch).shape == (2, 16, deep.vocab_size)


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_layers_beyond_two_extrapolate_exactly(name):
    model = get_model(name, n_layers=5, max_seq_len=32)
    facts = model_facts(model, analytic=False)
    for policy in ("save-all", "selective", "recompute-all", "offload-stash"):
        bound = PRESETS[policy].bind(model.tags)
        for first, last in [(False, False), (True, True)]:
            kw = {"first": first, "last": last, "policy": bound, "seq": 32}
            extrapolated = facts._per_sequence(fams=(0,) * 4, **kw)
            direct = facts._traced(fams=(0,) * 4, **kw)
            assert extrapolated.stash_elems == direct.stash_elems
            assert extrapolated.forward_flops == pytest.approx(direct.forward_flops, rel=1e-6)
            assert extrapolated.backward_flops == pytest.approx(direct.backward_flops, rel=1e-6)


# ---------------------------------------------------------------- dropout: a key per stage, microbatch, layer
class DropBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.5)  # no rngs: the key comes from jaxmem

    def __call__(self, x, key):
        return x + self.drop(self.down(jnp.tanh(checkpoint_name(self.up(x), "hidden"))), rngs=key)


class DropLM(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(32, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25)
        self.blocks = nnx.List([DropBlock(16, rngs) for _ in range(4)])
        self.out = nnx.Linear(16, 32, rngs=rngs)


def drop_lm():
    return from_nnx(
        DropLM,
        layers="blocks",
        embed=lambda m, batch: m.drop(m.tok(batch["tokens"]), rngs=batch["rng"]),
        call_layer=lambda block, x, batch: block(x, batch["rng"]),
        head_loss=lambda m, x, batch: token_loss(m.out(x), batch),
        tags=("hidden",),
        name="drop-lm",
        vocab_size=32,
        rng=True,
    )


@pytest.mark.parametrize("schedule,data,policy", [("zbv", 1, "recompute-all"), ("1f1b", 2, "save-all")])
def test_dropout_keys_per_stage_and_microbatch_give_the_reference_gradients(schedule, data, policy):
    # The reference runs each microbatch with the keys its stage draws; a recompute redraws the same
    # masks (recompute-all would differ from the reference otherwise).
    result = verify(generate(schedule, 2, 4), model=drop_lm(), data_parallel=data, policy=policy)
    assert result["ok"], result
    assert result["max_rel_diff"] < 1e-5


def test_dropout_masks_differ_by_key_and_a_missing_key_is_an_error():
    model = drop_lm()
    pipe = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2))
    params = pipe.place(pipe.from_model_params(model.init(0)))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 8), 0, 32)
    batch = make_batch(tokens, jnp.roll(tokens, -1, 1))
    with pytest.raises(JaxmemError, match=r"uses dropout \(rng=True\): pass a key per step"):
        pipe.value_and_grad(params, batch)
    a, _ = pipe.value_and_grad(params, batch, jax.random.PRNGKey(1))
    b, _ = pipe.value_and_grad(params, batch, jax.random.key(1))  # typed keys work too
    c, _ = pipe.value_and_grad(params, batch, jax.random.PRNGKey(2))
    assert float(a) == float(b) != float(c)
    # The same mask for one key whatever the schedule: a key per (microbatch, stage, layer).
    other = Pipeline(model, generate("gpipe", 2, 2), make_mesh(1, 2))
    d, _ = other.value_and_grad(other.place(other.from_model_params(model.init(0))), batch, jax.random.PRNGKey(1))
    assert abs(float(d) - float(a)) < 1e-6
    with pytest.raises(JaxmemError, match="draws no random numbers"):
        Pipeline(tiny_lm(), generate("1f1b", 2, 2), make_mesh(1, 2)).value_and_grad(
            params, batch, jax.random.PRNGKey(1)
        )


def test_the_ledger_traces_a_dropout_model():
    from jaxmem.memory import estimate

    e = estimate(drop_lm(), generate("1f1b", 2, 4), "save-all", batch=8, seq=8)
    assert e.device_bytes > 0 and e.step_seconds > 0


def test_a_batch_key_the_model_reads_but_the_batch_lacks_is_named():
    from jaxmem import JaxmemError
    from jaxmem.pipeline import Pipeline, make_mesh

    model = from_nnx(
        lambda rngs: TinyLM(rngs, "hidden"),
        layers="trunk.stack",
        embed=lambda m, batch: m.tok(batch["tokens"]) * batch["mask"][..., None],
        head_loss=lambda m, x, batch: token_loss(m.out(x * m.trunk["scale"]), batch),
        tags=("hidden",),
        name="masked-lm",
        vocab_size=32,
    )
    pipe = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2))
    with pytest.raises(
        JaxmemError, match=r"reads batch\['mask'\], which the batch does not have; it has \['targets', 'tokens'\]"
    ):
        pipe.residual_plans(4, 8)


def test_token_ids_outside_the_vocabulary_are_refused_through_the_python_api():
    from jaxmem import JaxmemError
    from jaxmem.pipeline import Pipeline, make_mesh

    model = tiny_lm()
    pipe = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2))
    params = pipe.place(pipe.from_model_params(model.init(0)))
    tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, 32)
    bad = make_batch(tokens.at[1, 3].set(32), tokens)
    with pytest.raises(JaxmemError, match=r"token id 32, outside model tiny-lm's vocabulary \[0, 32\)"):
        pipe.value_and_grad(params, bad)


def test_selective_on_a_model_without_a_quadratic_group_says_it_saves_everything(capsys):
    from jaxmem.config import TrainConfig
    from jaxmem.train import train

    config = TrainConfig(
        model=tiny_lm(),
        data="synthetic",
        pipe=2,
        microbatches=2,
        batch_size=4,
        seq_len=8,
        steps=1,
        policy="selective",
    )
    train(config, progress=True)
    err = " ".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "declares no 'quadratic' tag group, so selective recompute keeps every tag" in err


@pytest.mark.parametrize(
    "model,schedule,policy", [("llama-tiny", "zbv", "recompute-all"), ("tiny", "chronos", "save-all")]
)
def test_fused_attention_keeps_no_probabilities_and_its_gradients_are_plain(model, schedule, policy):
    """--attention fused: jax.nn.dot_product_attention rematerialised whole, so nothing s x s is
    stashed (no attn_probs tag; the stash is what the materialized model keeps less the
    probabilities), the pipelined gradients equal jax.grad, and the ledger counts the op's own
    working set, which the backward rebuilds (within 10% of memory_analysis())."""
    from jaxmem.config import TrainConfig
    from jaxmem.memory import compare, predict
    from jaxmem.train import Trainer

    s = generate(schedule, 2, 4)
    fused = verification_model(s.num_stages, model, attention="fused")
    assert "attn_probs" not in fused.tags.names and not fused.tags.group("quadratic")
    assert verify(s, model=fused, policy=policy)["ok"]
    plain = get_model(model, attention="materialized", n_layers=4)
    save_all = {m: PRESETS["save-all"].bind(m.tags) for m in (plain, get_model(model, attention="fused", n_layers=4))}
    shape = dict(first=False, last=False, layers=2, microbatch=4, seq=64)
    kept = {m.config.attention: model_facts(m).stage(policy=p, **shape) for m, p in save_all.items()}
    config = get_model(model).config
    probs = 4 * config.n_heads * 64 * 64 * 2 * np.dtype("float32").itemsize  # 4 x 64 tokens, 2 layers
    assert kept["materialized"].stash_bytes() - kept["fused"].stash_bytes() == probs
    # The backward rebuilds the probabilities inside the fused op: its working set holds them still.
    assert kept["fused"].working_bytes >= probs / 2
    trainer = Trainer(TrainConfig(model=model, attention="fused", pipe=2, microbatches=4, policy=policy, steps=1))
    predicted = predict(trainer.model, trainer.schedule, policy, batch=32, seq=64)
    report = compare(predicted, trainer.measure_memory())
    assert all(abs(r["prediction_error"]) <= 0.10 for r in report["ranks"]), report["ranks"]


# ---------------------------------------------------------------- messages of any kind
class _CountingBlock(nnx.Module):
    """Passes a layer counter beside the hidden state; the counter scales the residual branch."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        h, count = x
        return h + jnp.tanh(checkpoint_name(self.lin(h), "hidden")) * (1.0 + 0.1 * count[0]), count + 1.0


class _CountingLM(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(32, 16, rngs=rngs)
        self.blocks = nnx.List([_CountingBlock(rngs) for _ in range(4)])
        self.out = nnx.Linear(16, 32, rngs=rngs)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_message_leaf_that_depends_on_nothing_pipelines(name):
    """The embedding starts a counter from a constant: that leaf of the message varies over no mesh
    axis where the others vary over all; its backward used to fail on the cotangent's type."""
    model = from_nnx(
        _CountingLM,
        layers="blocks",
        embed=lambda m, b: (m.tok(b["tokens"]), jnp.zeros((2,))),
        head_loss=lambda m, x, b: token_loss(m.out(x[0]), b),
        tags=("hidden",),
        vocab_size=32,
    )
    result = verify(generate(name, 2, 4), model=model, policy="selective")
    assert result["ok"] and result["max_rel_diff"] < 1e-5, result


# ---------------------------------------------------------------- any batch
class _PatchBlock(nnx.Module):
    def __init__(self, rngs, d=16):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.down(checkpoint_name(nnx.gelu(self.up(x)), "mlp"))


class _TinyViT(nnx.Module):
    """8 x 8 RGB images in 2 x 2 patches (16 tokens), four blocks, a mean-pooled 5-class head."""

    def __init__(self, rngs):
        self.patch = nnx.Linear(2 * 2 * 3, 16, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (16, 16)))
        self.blocks = nnx.List([_PatchBlock(rngs) for _ in range(4)])
        self.head = nnx.Linear(16, 5, rngs=rngs)


def _vit_embed(m, batch):
    images = batch["images"]  # [b, 8, 8, 3] -> [b, 16, 12] patches
    b = images.shape[0]
    patches = images.reshape(b, 4, 2, 4, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, 16, 12)
    return m.patch(patches) + m.pos[...]


def _vit_head_loss(m, x, batch):
    logits = m.head(x.mean(axis=1))
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1)[:, 0]
    return jnp.sum(nll), jnp.asarray(nll.shape[0], jnp.float32)


def _vit_batch_spec(size, seq):  # no sequence: a classifier's images and labels
    return {
        "images": jax.ShapeDtypeStruct((size, 8, 8, 3), jnp.float32),
        "labels": jax.ShapeDtypeStruct((size,), jnp.int32),
    }


def _vit():
    """The tiny ViT that says what its batch is (``batch_spec``: images and labels)."""
    return from_nnx(
        _TinyViT,
        layers="blocks",
        embed=_vit_embed,
        head_loss=_vit_head_loss,
        tags=("mlp",),
        batch_spec=_vit_batch_spec,
    )


def test_the_ledger_and_planner_take_a_models_own_batch():
    """A model that says what its batch is (``batch_spec``) is traced with it: the ledger predicts a
    ViT's step (its stash exactly the executor's arenas) and the planner plans it."""
    from jaxmem.memory import predict
    from jaxmem.search import search

    model = _vit()
    schedule = generate("1f1b", 2, 4)
    ledger = predict(model, schedule, "save-all", batch=8, seq=1)
    tick, _ = Pipeline(model, schedule, make_mesh(pipe=2)).program(_vit_batch_spec(8, 1))
    arenas = sum(n * np.dtype(k[0]).itemsize for k, n in zip(tick.stash_keys, tick.arena_elems))
    assert ledger.ranks[0].categories["stash"].device == arenas > 0
    plan = search(model, devices=2, batch=8, seq=1, budget_bytes=2**30, schedules=("1f1b",), microbatches=[4])
    assert plan.best is not None and plan.best.fits
    # ROAM plans its plain train step on the same batch (traced abstractly, nothing compiled).
    from jaxmem.roam import accumulated_train_step, analyze_step, model_train_step

    step = model_train_step(model, batch=8)
    images = [v for v in step.jaxpr().jaxpr.invars if v.aval.shape == (8, 8, 8, 3)]
    assert len(images) == 1 and step.name.endswith("train step (batch 8)")
    record = analyze_step(step, compile_xla=False)
    assert 0 < record["planned_peak_bytes"] <= record["program_order_peak_bytes"]
    with pytest.raises(JaxmemError, match="has a batch of its own .images, labels."):
        accumulated_train_step(model, microbatches=2, batch=4)


@pytest.mark.parametrize("name,policy", [("1f1b", "selective"), ("zbv", "recompute-all")])
def test_a_classifier_with_its_own_batch_pipelines_and_trains(name, policy):
    """A batch is any dict of arrays leading with the batch size: a ViT's {'images', 'labels'} gives
    plain jax.grad's loss and gradients, and a few Adam steps lower its loss."""
    import optax

    model = from_nnx(_TinyViT, layers="blocks", embed=_vit_embed, head_loss=_vit_head_loss, tags=("mlp",))
    pipe = Pipeline(model, generate(name, 2, 4), make_mesh(pipe=2), policy=policy)
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    batch = {
        "images": jax.random.normal(keys[0], (8, 8, 8, 3)),
        "labels": jax.random.randint(keys[1], (8,), 0, 5),
    }
    params = model.init(0)
    want_loss, want = jax.value_and_grad(model.plain_loss)(params, batch)
    placed = pipe.place(pipe.from_model_params(params))
    loss, grads = pipe.value_and_grad(placed, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    got = pipe.to_model_params(jax.device_get(grads))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # Training on it: the pipelined gradient in an Adam loop lowers the loss on this batch.
    optimizer = optax.adam(1e-2)
    state = optimizer.init(placed)
    losses = []
    for _ in range(8):
        loss, grads = pipe.value_and_grad(placed, batch)
        updates, state = optimizer.update(grads, state, placed)
        placed = optax.apply_updates(placed, updates)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    # The forward-only program (evaluation) takes the same batch.
    assert float(jax.jit(pipe.loss_fn(batch))(placed, batch)) < losses[0]


def _vit_samples(n: int, seed: int = 0):
    """``n`` 8 x 8 images whose label is a fixed linear function of their channel means."""
    from jaxmem.data import Samples

    rng = np.random.default_rng(seed)
    images = rng.normal(size=(n, 8, 8, 3)).astype(np.float32)
    labels = (images.mean(axis=(1, 2)) @ np.random.default_rng(1).normal(size=(3, 5))).argmax(-1).astype(np.int32)
    return Samples({"images": images, "labels": labels}, name="toy-images")


_VIT_MODULE = """
from test_models import _vit, _vit_samples

vit = _vit


def train():
    return _vit_samples(80)
"""


def test_the_trainer_trains_a_model_on_samples_of_its_own_batch(tmp_path, monkeypatch, capsys):
    """The Trainer and train() take a classifier's samples (jaxmem.data.Samples): batches of its own
    keys, shuffled and resumable as token data is, a held-out part evaluated, samples/s reported; a
    resumed run goes on where it stopped, other samples are refused, and token data is refused with
    a pointer to Samples."""
    from jaxmem.config import TrainConfig
    from jaxmem.train import Trainer, train

    model = _vit()
    samples = _vit_samples(80)
    config = TrainConfig(
        model=model,
        pipe=2,
        microbatches=4,
        batch_size=8,
        steps=16,
        lr=1e-2,
        warmup_steps=0,
        eval_fraction=0.2,
        eval_every=8,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=8,
    )
    trainer = Trainer(config, samples=samples)
    assert len(trainer.samples) == 64 and len(trainer.eval_samples) == 16
    batch, _ = trainer.data_iterator().next()
    assert batch.arrays()["images"].shape == (8, 8, 8, 3) and batch.arrays()["labels"].dtype == np.int32
    summary = train(config, trainer=trainer, progress=False)
    assert summary["steps"] == 16 and summary["data"] == "toy-images (64 samples)"
    assert summary["tokens_per_second"] is None and summary["samples_per_second"] > 0
    assert np.mean(summary["losses"][-4:]) < 0.8 * np.mean(summary["losses"][:4]), summary["losses"]
    assert [step for step, _ in summary["eval_losses"]] == [8, 16]
    # Resumed from the command line: the model and its samples named as package.module:attr.
    (tmp_path / "vit_run.py").write_text(_VIT_MODULE)
    monkeypatch.chdir(tmp_path)
    flags = ["--pipe", "2", "--microbatches", "4", "--batch-size", "8", "--lr", "1e-2", "--warmup-steps", "0"]
    flags += ["--eval-fraction", "0.2", "--eval-every", "8", "--checkpoint-dir", config.checkpoint_dir]
    assert (
        main(["train", "--model", "vit_run:vit", "--samples", "vit_run:train", *flags, "--steps", "18", "--json"]) == 0
    )
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["resumed_from"] == 16 and resumed["steps"] == 18
    assert main(["train", "--model", "vit_run:vit", "--samples", "vit_run:nothing", *flags, "--steps", "18"]) == 2
    assert "samples 'vit_run:nothing': 'vit_run' has no attribute 'nothing'" in capsys.readouterr().err
    longer = dataclasses.replace(config, steps=18)
    with pytest.raises(JaxmemError, match="trained on other data"):
        train(longer, trainer=Trainer(longer, samples=_vit_samples(80, seed=3)), progress=False)
    # Without samples its step compiles (memory, plan); its data is asked for when a run needs it.
    with pytest.raises(JaxmemError, match=r"takes a batch of its own \(images, labels\).*samples=jaxmem.data.Samples"):
        Trainer(dataclasses.replace(config, checkpoint_dir=None)).data_iterator()
    wrong = _vit_samples(16)
    wrong = type(wrong)({"images": np.zeros((16, 4, 4, 3), np.float32), "labels": np.zeros(16, np.int32)})
    with pytest.raises(JaxmemError, match="takes .*images.*8, 8, 8, 3"):
        Trainer(dataclasses.replace(config, checkpoint_dir=None), samples=wrong)


# ---------------------------------------------------------------- layers that differ
class _WindowBlock(nnx.Module):
    """Causal attention, over the last ``window`` positions when one is set (a static setting)."""

    def __init__(self, rngs, window):
        self.window = window
        self.norm = nnx.RMSNorm(16, rngs=rngs)
        self.qkv = nnx.Linear(16, 48, rngs=rngs)
        self.proj = nnx.Linear(16, 16, rngs=rngs)
        self.mlp = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
        i = jnp.arange(x.shape[1])
        allowed = i[:, None] >= i[None, :]
        if self.window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < self.window)
        scores = jnp.where(allowed, q @ k.swapaxes(-1, -2) / 4.0, -1e9)
        probs = checkpoint_name(jax.nn.softmax(scores, axis=-1), "probs")
        x = x + self.proj(probs @ v)
        return x + jnp.tanh(checkpoint_name(self.mlp(x), "hidden"))


class _AlternatingLM(nnx.Module):
    """Gemma-style: sliding-window and global attention alternate, set per layer in ``__init__``."""

    def __init__(self, rngs):
        self.tok = nnx.Embed(32, 16, rngs=rngs)
        self.blocks = nnx.List([_WindowBlock(rngs, 3 if i % 2 == 0 else None) for i in range(4)])
        self.out = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _alternating():
    def whole_loss(module, batch):
        loss_sum, weight = token_loss(module(batch["tokens"]), batch)
        return loss_sum / weight

    return from_nnx(
        _AlternatingLM,
        layers="blocks",
        embed=lambda m, b: m.tok(b["tokens"]),
        head_loss=lambda m, x, b: token_loss(m.out(x), b),
        loss=whole_loss,  # the module's own forward: every layer with its own window
        tags=TagSet(("probs", "hidden"), groups=(("quadratic", ("probs",)),)),
        vocab_size=32,
    )


@pytest.mark.parametrize("name", ["1f1b", "zbv", "chronos"])
def test_layers_that_differ_in_a_static_setting_pipeline_as_written(name):
    """Alternating sliding-window and global layers (parameters alike, the window set in __init__)
    pipeline without a rewrite: gradients equal jax.grad of the module's own forward, each stage
    running its layers' kinds."""
    model = _alternating()
    assert model.layer_kinds == (0, 1, 0, 1)
    for policy in ("selective", "recompute-all"):
        result = verify(generate(name, 2, 4), model=model, policy=policy)
        assert result["ok"] and result["max_rel_diff"] < 1e-5, (policy, result)
    # The windows matter: every layer run as layer 0's kind gives another loss.
    params, batch = model.init(0), make_batch(*(2 * [jnp.arange(16).reshape(2, 8) % 32]))
    same = dataclasses.replace(model, layer_kinds=None, kind_layers=None, loss=None)
    assert abs(float(model.plain_loss(params, batch)) - float(same.plain_loss(params, batch))) > 1e-4
    with pytest.raises(JaxmemError, match="layer_kinds must name one of the 2 kind_layers for each of its 4"):
        dataclasses.replace(model, layer_kinds=(0, 2, 0, 1))


def test_layers_of_other_parameters_are_stacked_by_family():
    """Dense and mixture-of-experts layers (DeepSeek-style, ``tests/families.py``'s dense-moe): each
    parameter family is stacked apart, a stage position holding one stack per family with the most
    layers of that family any stage holds; the layout goes to the model's tree and back, and to
    another stage split, exactly (no compile)."""
    from families import family

    from jaxmem.pipeline import ParamLayout

    model = family("dense-moe", layers=4)
    assert model.layer_families == (0, 1, 1, 1) and model.family_layers() == [0, 1]
    pipe = Pipeline(model, generate("1f1b", 2, 4), make_mesh(1, 2))
    stages = pipe.abstract_params().stages
    assert len(stages) == 1 and len(stages[0]) == 2  # one position, two families
    dense, moe = stages[0]
    assert dense["up"]["kernel"].shape[:2] == (2, 1)  # rank 0 holds the dense layer, rank 1 none
    assert moe["w_in"].shape[:3] == (2, 2, 8)  # rank 1 holds two expert layers (rank 0 one)
    params = jax.tree.map(np.asarray, model.init(0))
    layout = pipe.param_layout
    assert layout.families == (0, 1, 1, 1) and ParamLayout.from_json(layout.to_json()) == layout
    back = layout.join(model, *layout.split(model, params, xp=np))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    other = ParamLayout((0, 1, 1, 0), (1, 1, 1, 1), 0, layout.families)  # ZBV's split
    here, there = layout.split(model, params, xp=np)[0], other.split(model, params, xp=np)[0]
    for f in range(2):
        for leaf in range(len(jax.tree.leaves(here[0][f]))):
            moved = layout.relayout_stage_leaf([jax.tree.leaves(e[f])[leaf] for e in here], other, family=f)
            for v, entry in enumerate(there):
                np.testing.assert_array_equal(moved[v], jax.tree.leaves(entry[f])[leaf])
    with pytest.raises(JaxmemError, match="other parameter families"):
        ParamLayout((0, 1), (2, 2)).relayout_stage_leaf([here[0][0]["up"]["kernel"]], layout)


def test_layers_of_other_parameters_are_split_by_their_flops():
    """By default the stages of a model of several families balance the layers' FLOPs, not their
    count: the dense-then-MoE model's MoE layers cost about 4.5 dense ones, so at P=2 the first stage
    takes its two dense layers and three MoE ones; the ledger prices the same split."""
    from families import family

    from jaxmem.memory import predict
    from jaxmem.pipeline import cost_balanced_layers, layer_flops

    model = family("dense-moe")  # 2 dense, 6 MoE
    flops = layer_flops(model)
    assert flops[2] > 4 * flops[0] and len(set(flops)) == 2
    schedule = generate("1f1b", 2, 4)
    pipe = Pipeline(model, schedule, make_mesh(1, 2))
    assert pipe.layer_counts == (5, 3)
    assert max(sum(flops[:5]), sum(flops[5:])) < max(sum(flops[:4]), sum(flops[4:]))
    ledger = predict(model, schedule, None, batch=8, seq=16)
    assert ledger.meta["layers_per_stage"] == [5, 3]
    assert Pipeline(model, schedule, make_mesh(1, 2), layer_counts=(4, 4)).layer_counts == (4, 4)
    assert cost_balanced_layers([1.0] * 8, 2) == (4, 4)  # alike: by count


@pytest.mark.parametrize("name", ["1f1b", "zbv", "chronos"])
def test_layers_of_other_parameters_pipeline_as_written(name):
    """A dense layer then mixture-of-experts layers of other parameters pipeline without a rewrite:
    gradients equal jax.grad under two policies (1F1B's first stage holds one layer of each)."""
    from families import family

    model = family("dense-moe", layers=4)
    for policy in ("selective", "recompute-all"):
        result = verify(generate(name, 2, 4), model=model, policy=policy)
        assert result["ok"] and result["max_rel_diff"] < 1e-5, (policy, result)


def test_a_model_of_two_families_trains_and_restores_onto_another_split(tmp_path):
    """The dense-then-MoE model trains (data 2 x pipe 2), and its checkpoint restores onto ZBV's
    split (each family re-laid out apart) with equal parameters, and trains on."""
    from families import family

    from jaxmem.config import TrainConfig
    from jaxmem.train import Checkpointer, Trainer

    model = family("dense-moe", layers=4)
    base = dict(model=model, pipe=2, microbatches=4, batch_size=8, seq_len=16, data="synthetic", devices=4)
    trainer = Trainer(TrainConfig(**base, data_parallel=2))
    state = trainer.init_state()
    losses = []
    for _ in range(3):
        state, metrics, _ = trainer.step(state)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    ckpt = Checkpointer(tmp_path / "ckpt", every=1)
    ckpt.save(state.step, *trainer.export_state(state))
    ckpt.close()
    reference = jax.tree.leaves(trainer.pipeline.to_model_params(state.params))
    other = Trainer(TrainConfig(**base, schedule="zbv"))
    assert other.pipeline.param_layout.layer_counts != trainer.pipeline.param_layout.layer_counts
    restored = Checkpointer(tmp_path / "ckpt").restore(other.restore_target())
    resumed = other.import_state(restored.state, restored.meta)
    for a, b in zip(jax.tree.leaves(other.pipeline.to_model_params(resumed.params)), reference, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed, metrics, _ = other.step(resumed)
    assert np.isfinite(float(metrics["loss"]))
