"""Hugging Face weights in and out: the built-in GPT and Llama written in ``transformers``' names and
layouts (``jaxmem export --format hf``), read back bit-exactly, and started from (``--init-from``).

The layouts are checked against the architectures themselves, not only by a round trip (which a
consistent mistake would pass): a NumPy forward written from ``transformers``' GPT-2 and Llama
definitions reads the exported tensors by their Hugging Face names and must give jaxmem's logits.
Where ``transformers`` and ``torch`` are installed, the real classes load the directory too."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from jaxmem import JaxmemError
from jaxmem.models import get_model
from jaxmem.models.hf import config_from_hf, hf_config
from jaxmem.train import TrainConfig, Trainer, load_hf, load_model, save_hf, train

SHAPES = {
    "gpt": ("tiny", dict(n_layers=2, d_model=32, n_heads=4, max_seq_len=16)),
    "gpt-tied": ("tiny", dict(n_layers=2, d_model=32, n_heads=4, max_seq_len=16, tied_head=True, norm_eps=1e-5)),
    "llama": ("llama-tiny", dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16)),
    "llama-tied": ("llama-tiny", dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=1, max_seq_len=16, tied_head=True)),
    # Llama 3.1's scaled RoPE; a small original length, so that all three bands of frequencies occur.
    "llama-rope-scaled": (
        "llama-tiny",
        dict(n_layers=1, d_model=64, n_heads=2, n_kv_heads=2, max_seq_len=16, rope_scaling=(8.0, 1.0, 4.0, 64)),
    ),
}


def _perturbed(model, seed=0):
    """Initial parameters moved off their structured values (norm scales of 1, zero biases), so a
    scale read as a bias, or a matrix read untransposed, changes the logits."""
    params = model.init(seed)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda p: p + 0.1 * jax.random.normal(next(keys), p.shape, p.dtype), params)


# ------------------------------------------------------------------ the architectures, from their definitions
def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _attend(q, k, v):
    """Causal softmax attention of q [b, s, h, d] over k, v [b, s, h, d]."""
    seq, hd = q.shape[1], q.shape[-1]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(q.shape[0], seq, -1)


def _gpt2_reference(t, hf, tokens):
    """GPT2LMHeadModel's forward: Conv1D weights are [in, out]; c_attn is [q | k | v]; GELU is the
    tanh approximation ("gelu_new"); a tied head is the token embedding."""
    eps, heads = hf["layer_norm_epsilon"], hf["n_head"]
    b, s = tokens.shape
    x = t["transformer.wte.weight"][tokens] + t["transformer.wpe.weight"][np.arange(s)]
    for i in range(hf["n_layer"]):
        p = lambda name, i=i: t[f"transformer.h.{i}.{name}"]  # noqa: E731
        a = _layer_norm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
        q, k, v = np.split(a @ p("attn.c_attn.weight") + p("attn.c_attn.bias"), 3, axis=-1)
        q, k, v = (y.reshape(b, s, heads, -1) for y in (q, k, v))
        x = x + _attend(q, k, v) @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        m = _layer_norm(x, p("ln_2.weight"), p("ln_2.bias"), eps) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")
        gelu = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m**3)))
        x = x + gelu @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = _layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
    return x @ t.get("lm_head.weight", t["transformer.wte.weight"]).T


def _llama_reference(t, hf, tokens):
    """LlamaForCausalLM's forward: Linear weights are [out, in]; RoPE rotates halves with
    inv_freq = theta^(-2i/head_dim); key/value head j // (heads / kv_heads) serves query head j."""
    eps, heads, kv = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    b, s = tokens.shape
    hd = hf["hidden_size"] // heads
    inv_freq = hf["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    scaling = hf["rope_parameters"]
    if scaling["rope_type"] == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth band between
        wavelength, original = 2 * np.pi / inv_freq, scaling["original_max_position_embeddings"]
        low, high = original / scaling["low_freq_factor"], original / scaling["high_freq_factor"]
        smooth = (original / wavelength - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        mixed = (1 - smooth) * inv_freq / scaling["factor"] + smooth * inv_freq
        inv_freq = np.where(
            wavelength < high, inv_freq, np.where(wavelength > low, inv_freq / scaling["factor"], mixed)
        )
        assert (
            (wavelength < high).any()
            and (wavelength > low).any()
            and ((wavelength >= high) & (wavelength <= low)).any()
        )
    angles = np.arange(s)[:, None] * inv_freq
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[None, :, None, :] for f in (np.cos, np.sin))

    def rotate(y):
        return y * cos + np.concatenate([-y[..., hd // 2 :], y[..., : hd // 2]], -1) * sin

    def rms(y, w):
        return y / np.sqrt((y**2).mean(-1, keepdims=True) + eps) * w

    x = t["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = lambda name, i=i: t[f"model.layers.{i}.{name}"]  # noqa: E731
        a = rms(x, p("input_layernorm.weight"))
        q = rotate((a @ p("self_attn.q_proj.weight").T).reshape(b, s, heads, hd))
        k = rotate((a @ p("self_attn.k_proj.weight").T).reshape(b, s, kv, hd))
        v = (a @ p("self_attn.v_proj.weight").T).reshape(b, s, kv, hd)
        k, v = (np.repeat(y, heads // kv, axis=2) for y in (k, v))
        x = x + _attend(q, k, v) @ p("self_attn.o_proj.weight").T
        m = rms(x, p("post_attention_layernorm.weight"))
        gate, up = m @ p("mlp.gate_proj.weight").T, m @ p("mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p("mlp.down_proj.weight").T
    x = rms(x, t["model.norm.weight"])
    return x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


def _written(shape, tmp_path):
    """A shape's model with perturbed parameters, written as transformers saves it; a batch of tokens
    and jaxmem's logits of it."""
    preset, overrides = SHAPES[shape]
    model = get_model(preset, **overrides)
    params = _perturbed(model)
    directory = str(tmp_path / shape)
    save_hf(model, params, directory)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (2, 16)).astype(np.int32)
    return model, params, directory, tokens, np.asarray(model.logits(params, {"tokens": tokens, "targets": tokens}))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_hf_layout_computes_what_transformers_computes_and_reads_back_bit_exact(shape, tmp_path):
    model, params, directory, tokens, ours = _written(shape, tmp_path)

    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    stored = safetensors.numpy.load_file(f"{directory}/model.safetensors")
    tensors = {k: v.astype(np.float64) for k, v in stored.items()}
    assert ("lm_head.weight" in tensors) == (not model.config.tied_head)  # a tied head is stored once
    reference = (_gpt2_reference if hf["model_type"] == "gpt2" else _llama_reference)(tensors, hf, tokens)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.abs(ours).max() > 1  # the logits are not all near zero: the comparison has teeth

    loaded = load_hf(directory)
    assert loaded.model.config == model.config
    for (name, a), b in zip(jax.tree_util.tree_leaves_with_path(loaded.params), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(name))


def test_transformers_loads_the_export_and_gives_the_same_logits(tmp_path):
    """Runs where the optional ``transformers`` and ``torch`` are installed (not in CI)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for shape in SHAPES:
        _, _, directory, tokens, ours = _written(shape, tmp_path)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        np.testing.assert_allclose(logits, ours, atol=1e-4, rtol=0, err_msg=shape)


# ------------------------------------------------------------------ a run: in from HF, out to HF
def test_a_run_starts_from_hf_weights_and_exports_them_back(tmp_path, capsys):
    from jaxmem.cli import main

    preset, overrides = SHAPES["llama"]
    model = get_model(preset, **overrides)
    params = _perturbed(model, seed=3)
    start = str(tmp_path / "start")
    save_hf(model, params, start)
    shape = dict(pipe=2, microbatches=2, batch_size=4, seq_len=16, data="text", hardware="h100")

    # The model, its vocabulary and its weights come from the directory.
    trainer = Trainer(TrainConfig(init_from=start, steps=2, **shape))
    assert trainer.model.config == model.config
    state = trainer.init_state(trainer.initial_params())
    for a, b in zip(jax.tree.leaves(trainer.pipeline.to_model_params(state.params)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Two steps from them, checkpointed; the first step's loss is the loaded model's loss.
    ckpt = str(tmp_path / "ckpt")
    expected = float(model.loss(params, trainer.data_iterator().batch_at(0).arrays()))
    summary = train(TrainConfig(init_from=start, steps=2, checkpoint_dir=ckpt, **shape), progress=False)
    assert summary["losses"][0] == pytest.approx(expected, rel=1e-5)

    # Out again as transformers' layout: bit-exact with the trained state, with a byte-level tokenizer.
    assert main(["export", ckpt, "--format", "hf", "-o", str(tmp_path / "out")]) == 0
    assert "as LlamaForCausalLM" in capsys.readouterr().out
    out = load_hf(str(tmp_path / "out"))
    trained = load_model(ckpt)
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(trained.params)):
        np.testing.assert_array_equal(a, b)
    assert out.tokenizer.encode("hé").tolist() == list("hé".encode())
    with open(tmp_path / "out" / "tokenizer_config.json") as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # `jaxmem sample` reads it as any export.
    assert main(["sample", str(tmp_path / "out"), "--prompt", "a", "--tokens", "3"]) == 0


# ------------------------------------------------------------------ what is refused, and why
def _edited(directory, **changes):
    with open(os.path.join(directory, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 8.0}}, "RoPE scaling 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "mistral"}, "model_type 'mistral'"),
        ({"num_hidden_layers": 3}, "lacks 9 of the model's 30 tensors"),
        ({"head_dim": 16}, "head_dim 16"),
    ],
)
def test_a_checkpoint_the_built_in_model_cannot_compute_is_refused(tmp_path, changes, message):
    preset, overrides = SHAPES["llama"]
    model = get_model(preset, **overrides)
    directory = str(tmp_path / "m")
    save_hf(model, model.init(0), directory)
    _edited(directory, **changes)
    with pytest.raises(JaxmemError, match=message):
        load_hf(directory)


def test_extra_tensors_and_other_settings_are_refused(tmp_path):
    preset, overrides = SHAPES["gpt"]
    model = get_model(preset, **overrides)
    directory = str(tmp_path / "m")
    save_hf(model, model.init(0), directory)
    flat = safetensors.numpy.load_file(f"{directory}/model.safetensors")
    safetensors.numpy.save_file(
        {**flat, "transformer.h.0.attn.bias": np.ones((1, 1, 16, 16), np.float32), "score.weight": np.ones(2)},
        f"{directory}/model.safetensors",
    )
    with pytest.raises(JaxmemError, match="no place for, e.g. score.weight"):  # the mask buffer is fine
        load_hf(directory)
    _edited(directory, activation_function="relu")
    with pytest.raises(JaxmemError, match="activation_function 'relu'"):
        load_hf(directory)
    with pytest.raises(JaxmemError, match="drop model='llama-tiny'"):
        TrainConfig(init_from=directory, model="llama-tiny")
    with pytest.raises(JaxmemError, match="no config.json there"):
        TrainConfig(init_from=str(tmp_path))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(JaxmemError, match="model_type 'mistral'; jaxmem starts from"):  # before any data loads
        TrainConfig(init_from=str(tmp_path / "other"))
    with pytest.raises(JaxmemError, match="sets d_model"):
        config_from_hf(hf_config(model.config), d_model=64)
    _edited(directory, activation_function="gelu_new")
    os.remove(f"{directory}/model.safetensors")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(JaxmemError, match="safe_serialization=True"):
        load_hf(directory)


def test_a_sharded_checkpoint_loads_as_one_file_does(tmp_path):
    preset, overrides = SHAPES["gpt-tied"]
    model = get_model(preset, **overrides)
    whole, shards = str(tmp_path / "whole"), tmp_path / "shards"
    save_hf(model, _perturbed(model), whole)
    tensors = safetensors.numpy.load_file(f"{whole}/model.safetensors")
    names = sorted(tensors)
    shards.mkdir()
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        safetensors.numpy.save_file({n: tensors[n] for n in part}, str(shards / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (shards / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    a, b = load_hf(whole), load_hf(str(shards))
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    os.remove(shards / "model-00002-of-00002.safetensors")
    with pytest.raises(
        JaxmemError, match="model-00002-of-00002.safetensors' .named by model.safetensors.index.json. is missing"
    ):
        load_hf(str(shards))


def test_bfloat16_weights_load_as_float32_master_weights_or_as_they_are(tmp_path):
    """Released checkpoints are bfloat16: by default they become float32 master weights (exactly, a
    widening); ``param_dtype="bfloat16"`` keeps them as stored."""
    import ml_dtypes

    model, params, directory, _, _ = _written("llama", tmp_path)
    stored = safetensors.numpy.load_file(f"{directory}/model.safetensors")
    half = {k: v.astype(ml_dtypes.bfloat16) for k, v in stored.items()}
    safetensors.numpy.save_file(half, f"{directory}/model.safetensors", metadata={"format": "pt"})
    wide, narrow = load_hf(directory), load_hf(directory, param_dtype="bfloat16")
    assert wide.model.config.param_dtype == "float32" and narrow.model.config.param_dtype == "bfloat16"
    for a, b, p in zip(jax.tree.leaves(wide.params), jax.tree.leaves(narrow.params), jax.tree.leaves(params)):
        assert a.dtype == np.float32 and b.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a, np.asarray(p).astype(ml_dtypes.bfloat16).astype(np.float32))
        np.testing.assert_array_equal(b.astype(np.float32), a)
