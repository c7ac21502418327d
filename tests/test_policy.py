"""Memory policies: specs, validation, lowering, gradients under every preset, and structural offload."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxmem.config import TrainConfig
from jaxmem.models import GPT_TAGS, get_config, get_model
from jaxmem.pipeline import Pipeline, make_mesh
from jaxmem.policy import PRESETS, Policy, PolicyError, StagePolicy, from_spec, microbatch_classes
from jaxmem.schedule import generate
from jaxmem.train import Trainer
from jaxmem.verify import verify

SCHEDULES = [("gpipe", 2, 2, None), ("1f1b", 2, 4, None), ("interleaved-1f1b", 2, 2, 2)]
GRID = [(s, p) for s in SCHEDULES for p in PRESETS]


@pytest.mark.parametrize("sched,preset", GRID, ids=[f"{s[0]}-{p}" for s, p in GRID])
def test_every_preset_gives_plain_grad_gradients(sched, preset):
    name, p, m, v = sched
    result = verify(generate(name, p, m, v), policy=preset)
    assert result["ok"], result


def test_per_stage_and_per_microbatch_policy_gradients():
    spec = {
        "base": "selective",
        "stage": {"0": {"base": "recompute-all"}, "2": {"microbatch": {"warmup": {"mlp_hidden": "offload"}}}},
        "microbatch": {"mb3": "recompute-all"},
    }
    schedule = generate("1f1b", 4, 4)
    resolved = from_spec(spec).resolve(schedule, GPT_TAGS)
    assert len(resolved.variants) >= 3
    recompute_all = PRESETS["recompute-all"].bind(GPT_TAGS)
    assert resolved.stage_policy(0, 1) == recompute_all
    assert resolved.stage_policy(2, 0).offload == {"mlp_hidden"}
    assert resolved.stage_policy(1, 3) == recompute_all
    assert verify(schedule, policy=spec)["ok"]


# ---------------------------------------------------------------- specs and errors
def test_policies_are_hashable_values():
    assert from_spec("selective") == from_spec("SELECTIVE")
    assert hash(from_spec({"base": "save-all", "stage": {"1": "recompute-all"}})) == hash(
        from_spec({"base": "save-all", "stage": {"1": "recompute-all"}})
    )
    assert StagePolicy().bind(GPT_TAGS).decision("attn_probs") == "save"
    assert PRESETS["selective"].bind(GPT_TAGS).decision("attn_probs") == "recompute"
    assert PRESETS["selective"].bind(GPT_TAGS).recompute == {"attn_probs"}


def test_toml_policy_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('base = "save-all"\nattn_probs = "offload"\n[stage.1]\nbase = "recompute-all"\n')
    policy = from_spec(str(path))
    assert policy.default.bind(GPT_TAGS).offload == {"attn_probs"} and policy.stages[0][0] == 1


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"attn_prob": "save"}, "policy 'custom': unknown activation tag 'attn_prob'; the model declares: attn_in"),
        ({"tags": {"attn_prob": "save"}}, "unknown activation tag 'attn_prob'; the model declares: attn_in"),
        ("save-some", "unknown policy preset 'save-some'; presets: save-all"),
        ({"tags": {"q": "keep"}}, "unknown decision 'keep'; use save, recompute or offload"),
        ({"stages": {"0": "save-all"}}, r"unknown key 'stages' = .*valid keys: base, .*stage, microbatch"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(PolicyError, match=message):
        from_spec(spec).resolve(generate("1f1b", 2, 2), GPT_TAGS)


def test_unknown_stage_and_microbatch_class():
    schedule = generate("1f1b", 2, 4)
    with pytest.raises(PolicyError, match=r"names stage 5; the schedule has stages 0..1"):
        from_spec({"stage": {"5": "recompute-all"}}).resolve(schedule, GPT_TAGS)
    with pytest.raises(PolicyError, match=r"microbatch class 'cooldown'.*valid classes: warmup, steady, mb0..mb3"):
        from_spec({"microbatch": {"cooldown": "recompute-all"}}).resolve(schedule, GPT_TAGS)
    gpipe = generate("gpipe", 2, 4)
    assert "steady" not in microbatch_classes(gpipe)
    with pytest.raises(PolicyError, match="valid classes: warmup, mb0"):
        from_spec({"microbatch": {"steady": "recompute-all"}}).resolve(gpipe, GPT_TAGS)


def test_weight_offload_must_agree_across_ranks():
    schedule = generate("zbv", 2, 4)  # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    with pytest.raises(PolicyError, match=r"offload_weights is set for stages \[0\] .* local position 0"):
        from_spec({"stage": {"0": "offload-weights"}}).resolve(schedule, GPT_TAGS)
    from_spec({"stage": {"0": "offload-weights", "1": "offload-weights"}}).resolve(schedule, GPT_TAGS)


def test_checkpoint_policy_lowering_saves_exactly_the_named_values():
    sp = StagePolicy(base="recompute-all", tags={"mlp_hidden": "save"})
    assert sp.bind(GPT_TAGS).checkpoint_policy() is not None
    config = get_model("tiny", n_layers=3, max_seq_len=16).config
    pipe = Pipeline(get_model(config), generate("1f1b", 3, 3), make_mesh(1, 3), policy=sp)
    plans = pipe.residual_plans(6, 16)
    mid = next(p for c, p in plans.items() if not c.first and not c.last)
    shapes = [leaf.shape for leaf in mid.stashed_leaves()]
    # The stage input and one mlp_hidden per layer: nothing else is kept.
    assert shapes.count((2, 16, config.d_ff)) == 1 and len(shapes) == 2


# ---------------------------------------------------------------- structural offload
def _host_leaf_names(plan):
    """For every host-typed residual of a plan, the checkpoint_name tag its value came from."""
    jaxpr = plan.closed.jaxpr
    producer = {}
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            producer[out] = eqn
    names = []
    for var in jaxpr.outvars[len(plan.out_avals) :]:
        if "host" not in str(getattr(var.aval, "memory_space", "")).lower():
            continue
        eqn = producer[var]
        while eqn.primitive.name != "name":
            eqn = producer[eqn.invars[0]]
        names.append(eqn.params["name"])
    return names


def test_offloaded_tag_is_on_host_and_nothing_else():
    model = get_model("tiny", n_layers=4, max_seq_len=16)
    spec = {"base": "save-all", "mlp_hidden": "offload"}
    pipe = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2), policy=spec)
    for c, plan in pipe.residual_plans(4, 16).items():
        names = _host_leaf_names(plan)
        assert names == ["mlp_hidden"] * c.layers, (c, names)
        host = [leaf for leaf in plan.stashed_leaves() if leaf.space == "host"]
        assert len(host) == c.layers and all(leaf.memory_space == "host" for leaf in host)


def _scan_carry_spaces(pipe, batch, seq):
    """Memory spaces of the executor's scan carry: (message buffers, stash buffers, grads)."""

    from jaxmem.pipeline import batch_spec

    params = pipe.abstract_params()
    spec = batch_spec(batch, seq)
    jaxpr = jax.make_jaxpr(pipe.grad_fn(spec))(params, spec)

    def find_scan(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "scan":
                return eqn
            for value in eqn.params.values():
                inner = value if hasattr(value, "eqns") else getattr(value, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    found = find_scan(inner)
                    if found is not None:
                        return found
        return None

    scan = find_scan(jaxpr.jaxpr)
    num_consts = scan.params["num_consts"]
    carry = scan.invars[num_consts : num_consts + scan.params["num_carry"]]
    return ["host" if "host" in str(getattr(v.aval, "memory_space", "")).lower() else "device" for v in carry]


def test_offload_stash_puts_exactly_the_stash_buffers_on_host():
    model = get_model("tiny", n_layers=2, max_seq_len=16)
    save_all = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2))
    offload = Pipeline(model, generate("1f1b", 2, 2), make_mesh(1, 2), policy="offload-stash")
    tick, _ = offload.program(4, 16)
    n_stash = len(tick.stash_keys)
    assert n_stash >= 1 and all(space == "host" for _, space in tick.stash_keys)
    spaces = _scan_carry_spaces(offload, 4, 16)
    # carry = act buffer, grad buffer, stash arenas..., grads..., shared grads..., loss sum, weight
    assert spaces[:2] == ["device", "device"]
    assert spaces[2 : 2 + n_stash] == ["host"] * n_stash
    assert set(spaces[2 + n_stash :]) == {"device"}
    assert "host" not in _scan_carry_spaces(save_all, 4, 16)


def test_offload_weights_keeps_stage_weights_on_host():
    trainer = Trainer(TrainConfig(pipe=2, microbatches=2, batch_size=4, seq_len=16, policy="offload-weights"))
    state = trainer.init_state()
    kinds = {leaf.sharding.memory_kind for tree in state.params.stages for leaf in jax.tree.leaves(tree)}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params.shared)} == {"device"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {"device"}
    state, metrics, _ = trainer.step(state)
    loss = metrics["loss"]
    state, metrics, _ = trainer.step(state)
    loss = metrics["loss"]
    assert np.isfinite(float(loss))
    kinds = {leaf.sharding.memory_kind for tree in state.params.stages for leaf in jax.tree.leaves(tree)}
    assert kinds == {"pinned_host"}


def _fetches_in_the_tick(pipe, batch, seq):
    """The host-to-device fetches in the tick loop's body, as ``(inside an action, beside one)``: in
    a cond whose branch runs matrix products (a stage's F or B), or in one that runs none."""
    from jaxmem.pipeline import batch_spec

    spec = batch_spec(batch, seq)
    jaxpr = jax.make_jaxpr(pipe.grad_fn(spec))(pipe.abstract_params(), spec)

    def walk(j, found):
        for eqn in j.eqns:
            found.append(eqn)
            for value in eqn.params.values():
                for inner in value if isinstance(value, tuple) else (value,):
                    inner = inner if hasattr(inner, "eqns") else getattr(inner, "jaxpr", None)
                    if inner is not None and hasattr(inner, "eqns"):
                        walk(inner, found)
        return found

    def is_fetch(eqn):
        return eqn.primitive.name == "device_put" and "device" in str(eqn.params.get("devices", "")).lower()

    scan = next(e for e in walk(jaxpr.jaxpr, []) if e.primitive.name == "scan")
    inside = beside = 0
    for eqn in scan.params["jaxpr"].jaxpr.eqns:
        if eqn.primitive.name != "cond":
            continue
        for branch in eqn.params["branches"]:
            inner = walk(branch.jaxpr, [])
            fetches = sum(map(is_fetch, inner))
            if any(e.primitive.name == "dot_general" for e in inner):
                inside += fetches
            else:
                beside += fetches
    return inside, beside


def test_weights_on_host_are_fetched_an_action_ahead_beside_the_action_before():
    """Issue 30: a stage's weights on host come to the device in the tick before the action that
    uses them, outside that action's branch (so a GPU can overlap the copy with the action before),
    and only when the rank's next action on host runs another stage."""
    model = get_model("tiny", n_layers=4, max_seq_len=16)
    interleaved = Pipeline(model, generate("interleaved-1f1b", 2, 2, 2), make_mesh(1, 2), policy="offload-weights")
    inside, beside = _fetches_in_the_tick(interleaved, 4, 16)
    assert inside == 0 and beside > 0, (inside, beside)
    from jaxmem.pipeline._body import prefetch_columns
    from jaxmem.pipeline._ticks import COLUMNS

    tick, _ = interleaved.program(4, 16)

    col = {name: i for i, name in enumerate(COLUMNS)}
    columns = prefetch_columns(tick.table, col, (0, 1))
    for r in range(2):  # a fetch wherever the rank's next action runs the other stage
        acting = [t for t in range(tick.num_ticks) if tick.table[r, t, col["branch"]]]
        stages = [int(tick.table[r, t, col["local_stage"]]) for t in acting]
        changes = [(t, b) for t, a, b in zip(acting, stages, stages[1:]) if a != b]
        fetched = [(t, int(v)) for t, v in enumerate(columns[r, :, 0]) if v >= 0]
        assert fetched == changes and columns[r, 0, 1] == stages[0]
    # One stage a rank: fetched once, before the first tick.
    one = Pipeline(model, generate("1f1b", 2, 4), make_mesh(1, 2), policy="offload-weights")
    tick, _ = one.program(8, 16)
    assert (prefetch_columns(tick.table, col, (0,))[..., 0] == -1).all()
    # (Their gradients: test_every_preset_gives_plain_grad_gradients, offload-weights.)


def _gpu_placements(policy):
    """The train step of ``policy`` lowered for a GPU (StableHLO; no GPU needed): the memory kinds of
    its in-program placements and of its arguments, counted; and the update's fetches to the device."""
    import re

    trainer = Trainer(TrainConfig(pipe=2, microbatches=2, batch_size=4, seq_len=16, policy=policy))
    state = trainer.init_state()
    traced = trainer.step_fn.trace(state.params, state.opt_state, trainer.batch_spec())
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    placements = re.findall(r'_xla_buffer_placement = "(\w+)"', text)
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    arguments = re.findall(r'mhlo.memory_kind = "(\w+)"', main.split("->")[0])
    # The update: host arguments brought to the device whole, and one layer's slices brought in.
    on_host = set(re.findall(r'(%arg\d+): tensor<[^>]*> \{mhlo.memory_kind = "pinned_host"', main))
    fetched = re.findall(r'annotate_device_placement\((%arg\d+)\)[^\n]*_xla_buffer_placement = "device"', text)
    layers = jax.tree.leaves(state.params.stages)[0].shape[1]
    one_layer = re.findall(r'_xla_buffer_placement = "device"}} : \(tensor<2x1x', text)
    fetches = {
        "whole": len(on_host.intersection(fetched)),
        "one_layer": len(one_layer),
        "layers": layers,
    }
    return trainer, state, [placements.count("pinned_host"), arguments.count("pinned_host")], fetches


def test_offload_survives_lowering_where_a_gpu_would_run_it():
    """Host placement is checked in the program XLA gets, not only in jaxpr types. On CPU, JAX lowers an
    in-program ``device_put`` to a memory space as nothing (jax/_src/dispatch.py), so the program is
    lowered for a GPU instead: every offload policy's host transfers and host-resident arguments are
    there, and nothing else is on host."""
    counts, fetches = {}, {}
    for name, policy in [
        ("save-all", "save-all"),
        ("offload-stash", "offload-stash"),
        ("offload-tags", {"base": "save-all", "mlp_hidden": "offload"}),
        ("offload-weights", "offload-weights"),
        ("offload-optimizer-state", "offload-optimizer-state"),
    ]:
        trainer, state, counts[name], fetches[name] = _gpu_placements(policy)
        if name == "offload-stash":  # ... and the CPU's own lowering drops them (so the CPU saves nothing)
            assert "pinned_host" not in trainer.lower(state).as_text()
    stage_leaves = len(jax.tree.leaves(state.params.stages))
    assert counts["save-all"] == [0, 0]
    # Stash: transfers only (each buffer written to host and read back), no host argument.
    assert counts["offload-stash"][0] > counts["offload-tags"][0] > 0
    assert counts["offload-stash"][1] == counts["offload-tags"][1] == 0
    # Weights / optimizer state live on host between steps: host arguments, copied in for the update.
    assert counts["offload-weights"][1] == stage_leaves
    assert counts["offload-optimizer-state"][1] == 2 * stage_leaves  # Adam's mu and nu
    assert counts["offload-weights"][0] > 0 and counts["offload-optimizer-state"][0] > 0
    # The update streams them by the layer (jaxmem.train._update): no host argument comes to the device
    # whole (before: every one, 2 x 12 for the moments), but one layer of each, in a loop over the layers.
    streamed = fetches["offload-optimizer-state"]
    assert streamed["layers"] > 1 and streamed["whole"] == 0 and streamed["one_layer"] >= 2 * stage_leaves


def test_offload_optimizer_state_trains_with_moments_on_host():
    """Weights and moments on host, updated layer by layer (jaxmem.train._update), step the same
    parameters as the whole update on the device, with AdamW's mask and the global-norm clip."""
    from jaxmem.train import make_optimizer

    config = dict(pipe=2, microbatches=2, batch_size=4, seq_len=16, weight_decay=0.1, grad_clip=0.05)
    policy = {"base": "save-all", "offload_weights": True, "offload_optimizer_state": True}
    trainer = Trainer(TrainConfig(**config, policy=policy))
    state = trainer.init_state()
    # A user's optimizer is not streamed: the reference runs the whole update.
    reference = Trainer(TrainConfig(**config), optimizer=make_optimizer(TrainConfig(**config)))
    ref_state = reference.init_state()
    assert trainer.streams_update and not reference.streams_update
    for _ in range(3):
        state, metrics, _ = trainer.step(state)
        ref_state, ref_metrics, _ = reference.step(ref_state)
        assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-6)
        assert float(metrics["grad_norm"]) > 0.05  # the clip acts
    for ours, theirs in zip(
        jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((ref_state.params, ref_state.opt_state))
    ):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-7)
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim]
    kinds = [leaf.sharding.memory_kind for leaf in moments]
    stage_leaves = len(jax.tree.leaves(state.params.stages))
    assert kinds.count("pinned_host") == 2 * stage_leaves and "device" in kinds  # shared moments stay
    params = [leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)]
    assert params.count("pinned_host") == stage_leaves and "device" in params
    assert ":S(5)}" in trainer.compiled(state).as_text()  # host memory space in the compiled layouts


def test_the_gpt_declares_every_tag_it_emits_and_selective_recomputes_its_quadratic_group():
    from jaxmem.models.gpt import HEAD_TAGS, TAGS

    assert GPT_TAGS.names == TAGS + HEAD_TAGS and GPT_TAGS.group("quadratic") == {"attn_probs"}
    pipe = Pipeline("tiny", generate("1f1b", 2, 2), make_mesh(1, 2), policy=Policy())
    pipe.residual_plans(4, 16)  # checks the emitted tags against the declared ones


def test_a_table_without_a_base_builds_on_the_one_around_it():
    """A nested table overrides what it says and keeps the rest of the enclosing policy (before, it
    started again from save-all: the README's own [microbatch.warmup] example lost selective)."""
    spec = {
        "base": "selective",
        "attn_probs": "offload",
        "stage": {"1": {"mlp_hidden": "offload", "microbatch": {"warmup": {"mlp_hidden": "save"}}}},
        "microbatch": {"warmup": {"mlp_hidden": "offload"}},
    }
    policy = from_spec(spec)
    top = StagePolicy(base="selective", tags={"attn_probs": "offload"})
    assert policy.default == top
    assert dict(policy.stages)[1] == top.with_decisions({"mlp_hidden": "offload"})
    assert dict(policy.microbatch)["warmup"] == top.with_decisions({"mlp_hidden": "offload"})
    ((stage, cls, nested),) = policy.stage_microbatch
    assert (stage, cls, nested) == (1, "warmup", top.with_decisions({"mlp_hidden": "save"}))
    # Its own base starts again from that preset.
    again = from_spec({"base": "selective", "stage": {"0": {"base": "recompute-all"}}})
    assert dict(again.stages)[0] == StagePolicy(base="recompute-all")


# ---------------------------------------------------------------- layers recomputed apart
@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "chronos"])
def test_layers_recomputed_apart_give_plain_grad_gradients(schedule):
    """The first layer of every stage recomputed whole, the rest selective; on 1F1B the warmup
    microbatches recompute two (a mixed policy: two variants of one stage)."""
    spec = {"base": "selective", "recompute_layers": 1, "microbatch": {"warmup": {"recompute_layers": 2}}}
    model = dataclasses.replace(get_config("tiny"), n_layers=8, max_seq_len=16)
    result = verify(generate(schedule, 2, 4), model=get_model(model), policy=spec)
    assert result["ok"], result


def test_layers_recomputed_apart_keep_only_their_inputs_and_the_ledger_holds():
    """k layers recomputed whole stash their inputs in place of their residuals and repeat their
    forwards (the facts compose one recomputed layer k times and the rest of the stage); the ledger
    is within 10% of the compiled step."""
    from jaxmem.cli.memory import ledger_report
    from jaxmem.memory import model_facts

    model = get_model(dataclasses.replace(get_config("tiny"), n_layers=8))
    facts = model_facts(model)
    shape = dict(first=False, last=False, layers=4, microbatch=2, seq=64)
    selective = facts.stage(policy=PRESETS["selective"].bind(model.tags), **shape)
    one = facts.stage(policy=PRESETS["recompute-all"].bind(model.tags), **{**shape, "layers": 1})
    for k in (1, 4):
        mixed = facts.stage(policy=StagePolicy(base="selective", recompute_layers=k).bind(model.tags), **shape)
        rest = facts.stage(policy=PRESETS["selective"].bind(model.tags), **{**shape, "layers": 4 - k})
        assert mixed.stash_bytes() == rest.stash_bytes() + k * one.stash_bytes()
        assert mixed.stash_bytes() < selective.stash_bytes()
        assert mixed.recompute_flops == pytest.approx(rest.recompute_flops + k * one.recompute_flops)
        assert mixed.recompute_flops > selective.recompute_flops
    config = TrainConfig(
        model=model, pipe=2, microbatches=4, batch_size=16, seq_len=64, steps=1,
        policy={"base": "selective", "recompute_layers": 2},
    )  # fmt: skip
    report = ledger_report(config, "yes")
    assert report["max_prediction_error"] < 0.10, report["ranks"][0]


def test_recompute_layers_in_a_spec():
    sp = from_spec({"base": "selective", "stage": {"1": {"recompute_layers": 3}}}).stages[0][1]
    assert sp.recompute_layers == 3 and sp.base == "selective"  # builds on the table around it
    assert sp.describe() == "selective + first 3 layer(s) recomputed whole"
    assert sp.bind(GPT_TAGS).recompute_layers == 3
    with pytest.raises(PolicyError, match="recompute_layers is a count of layers, got 'two'"):
        from_spec({"recompute_layers": "two"})
    with pytest.raises(PolicyError, match="recompute_layers is a count of layers >= 0, got -1"):
        StagePolicy(recompute_layers=-1)
