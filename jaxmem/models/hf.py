"""The built-in models in Hugging Face's terms: ``transformers``' ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` configurations, parameter names and layouts, both ways. NumPy only: a
checkpoint is renamed and transposed tensor by tensor, never held twice.

What differs between the two layouts:

- GPT-2's projections are ``Conv1D`` modules whose weight is ``[in, out]``, as a Flax kernel is, and
  its fused ``c_attn`` is ``[q | k | v]`` with heads contiguous inside each, as :class:`~jaxmem.models.GPT`
  splits its ``qkv``: nothing is transposed.
- Llama's projections are ``torch.nn.Linear`` with weight ``[out, in]``: every kernel is transposed.
  Its query and key weights are in the rotate-half order that :func:`~jaxmem.models.llama.rope` uses
  (the order ``transformers`` converts Meta's weights to), so no row is permuted.
- An untied head is ``lm_head.weight`` ``[vocab, d]``; a tied one is the token embedding and is not
  stored twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.models.gpt import GPTConfig
from jaxmem.models.llama import LlamaConfig

__all__ = ["HF_ARCHITECTURES", "config_from_hf", "from_hf", "hf_config", "hf_names", "to_hf"]

HF_ARCHITECTURES = {GPTConfig: "GPT2LMHeadModel", LlamaConfig: "LlamaForCausalLM"}

# Tensors a Hugging Face checkpoint may carry that are not parameters: GPT-2's causal-mask buffers and
# older Llamas' rotary frequencies (both recomputed by the model).
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def hf_config(config, *, eos_id: int | None = None) -> dict:
    """The ``config.json`` of ``transformers`` for a GPTConfig or LlamaConfig (the dtype is the
    parameters', which is what the exported tensors hold; ``eos_id``: the tokenizer's end of text,
    which is also its start, as in GPT-2)."""
    common = {"architectures": [HF_ARCHITECTURES[type(config)]], "vocab_size": config.vocab_size}
    common |= {"tie_word_embeddings": config.tied_head, "dtype": config.param_dtype}
    common |= {"bos_token_id": eos_id, "eos_token_id": eos_id}
    if isinstance(config, GPTConfig):
        return {
            **common,
            "model_type": "gpt2",
            "n_positions": config.max_seq_len,
            "n_ctx": config.max_seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.d_ff,
            "activation_function": "gelu_new",  # tanh-approximated, as jax.nn.gelu computes by default
            "layer_norm_epsilon": config.norm_eps,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
    return {
        **common,
        "model_type": "llama",
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        **_hf_rope(config),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }


def _hf_rope(config) -> dict:
    """RoPE settings as ``transformers`` writes them: ``rope_parameters`` (version 5) and, for a scaled
    RoPE, ``rope_scaling`` too (version 4)."""
    if config.rope_scaling is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta}}
    factor, low, high, original = config.rope_scaling
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high}
    scaling["original_max_position_embeddings"] = original
    return {"rope_parameters": {**scaling, "rope_theta": config.rope_theta}, "rope_scaling": scaling}


def _rope_scaling(rope: dict, where: str):
    """LlamaConfig.rope_scaling of a checkpoint's RoPE settings (None: plain RoPE)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        _refuse(where, f"RoPE scaling {rope_type!r} (the built-in Llama implements plain RoPE and Llama 3.1's llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise JaxmemError(f"{where}: llama3 RoPE scaling without {', '.join(missing)}")
    return tuple(rope[k] for k in keys)


def _need(hf: dict, key: str, where: str):
    if key not in hf:
        raise JaxmemError(f"{where}: no {key!r}; is this a transformers config.json?")
    return hf[key]


def _refuse(where: str, what: str) -> None:
    raise JaxmemError(
        f"{where}: {what}; the built-in model computes something else, so these weights would not give the "
        "model they were trained as"
    )


def config_from_hf(hf: dict, *, where: str = "config.json", **overrides):
    """The GPTConfig or LlamaConfig of a ``transformers`` ``config.json`` (a ``gpt2`` or ``llama``
    model), with ``overrides`` (e.g. ``dtype``, ``param_dtype``, ``attention``). Refused, saying
    which setting, where the built-in model cannot compute what the checkpoint's model computes.

    >>> config_from_hf(hf_config(GPTConfig(n_layers=2))) == GPTConfig(n_layers=2)
    True
    """
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse(where, f"activation_function {act!r} (the built-in GPT's GELU is the tanh approximation)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            _refuse(where, "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are set")
        if hf.get("scale_attn_weights", True) is False:
            _refuse(where, "scale_attn_weights is false")
        d = _need(hf, "n_embd", where)
        fields = {
            "vocab_size": _need(hf, "vocab_size", where),
            "max_seq_len": _need(hf, "n_positions", where),
            "d_model": d,
            "n_heads": _need(hf, "n_head", where),
            "n_layers": _need(hf, "n_layer", where),
            "d_ff": hf.get("n_inner") or 4 * d,
            "tied_head": hf.get("tie_word_embeddings", True),
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        }
        kind_cls = GPTConfig
    elif kind == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            _refuse(where, f"hidden_act {hf['hidden_act']!r} (the built-in Llama's MLP is SwiGLU)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            _refuse(where, "attention_bias / mlp_bias are set (the built-in Llama's projections have no bias)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        d, heads = _need(hf, "hidden_size", where), _need(hf, "num_attention_heads", where)
        if hf.get("head_dim") not in (None, d // heads):
            _refuse(where, f"head_dim {hf['head_dim']} is not hidden_size / num_attention_heads ({d // heads})")
        fields = {
            "vocab_size": _need(hf, "vocab_size", where),
            "max_seq_len": _need(hf, "max_position_embeddings", where),
            "d_model": d,
            "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads,
            "n_layers": _need(hf, "num_hidden_layers", where),
            "d_ff": _need(hf, "intermediate_size", where),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "rope_scaling": _rope_scaling(rope, where),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tied_head": hf.get("tie_word_embeddings", False),
        }
        kind_cls = LlamaConfig
    else:
        raise JaxmemError(
            f"{where}: model_type {kind!r}; jaxmem loads Hugging Face gpt2 (GPT2LMHeadModel) and llama "
            "(LlamaForCausalLM) models into its built-in GPT and Llama"
        )
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(kind_cls)})
    if unknown:
        raise JaxmemError(f"{kind_cls.__name__} has no field {unknown[0]!r}")
    shape_fields = set(fields) & set(overrides)
    if shape_fields:
        raise JaxmemError(
            f"{where} sets {', '.join(sorted(shape_fields))}: the weights have that shape; drop the override"
        )
    return kind_cls(**fields, **overrides)


def hf_names(config) -> list[tuple[str, str, bool]]:
    """``(hf_name, jaxmem_name, transposed)`` of every parameter of the model ``config`` builds, in
    ``transformers``' names with their ``LMHeadModel`` / ``ForCausalLM`` prefixes."""
    if isinstance(config, GPTConfig):
        names = [("transformer.wte.weight", "wte.embedding", False), ("transformer.wpe.weight", "wpe.embedding", False)]
        per_layer = {
            "ln_1.weight": "ln1.scale",
            "ln_1.bias": "ln1.bias",
            "attn.c_attn.weight": "qkv.kernel",
            "attn.c_attn.bias": "qkv.bias",
            "attn.c_proj.weight": "proj.kernel",
            "attn.c_proj.bias": "proj.bias",
            "ln_2.weight": "ln2.scale",
            "ln_2.bias": "ln2.bias",
            "mlp.c_fc.weight": "fc.kernel",
            "mlp.c_fc.bias": "fc.bias",
            "mlp.c_proj.weight": "out.kernel",
            "mlp.c_proj.bias": "out.bias",
        }
        for i in range(config.n_layers):
            names += [(f"transformer.h.{i}.{hf}", f"blocks.{i}.{ours}", False) for hf, ours in per_layer.items()]
        names += [("transformer.ln_f.weight", "ln_f.scale", False), ("transformer.ln_f.bias", "ln_f.bias", False)]
        head = "head.kernel"
    elif isinstance(config, LlamaConfig):
        names = [("model.embed_tokens.weight", "embed_tokens.embedding", False)]
        per_layer = {
            "input_layernorm.weight": ("attn_norm.scale", False),
            "self_attn.q_proj.weight": ("wq.kernel", True),
            "self_attn.k_proj.weight": ("wk.kernel", True),
            "self_attn.v_proj.weight": ("wv.kernel", True),
            "self_attn.o_proj.weight": ("wo.kernel", True),
            "post_attention_layernorm.weight": ("mlp_norm.scale", False),
            "mlp.gate_proj.weight": ("w_gate.kernel", True),
            "mlp.up_proj.weight": ("w_up.kernel", True),
            "mlp.down_proj.weight": ("w_down.kernel", True),
        }
        for i in range(config.n_layers):
            names += [(f"model.layers.{i}.{hf}", f"layers.{i}.{ours}", t) for hf, (ours, t) in per_layer.items()]
        names.append(("model.norm.weight", "norm.scale", False))
        head = "lm_head.kernel"
    else:
        raise JaxmemError(f"no Hugging Face layout for {type(config).__name__}; built-in GPT and Llama only")
    if not config.tied_head:
        names.append(("lm_head.weight", head, True))
    return names


def to_hf(flat: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """jaxmem's named parameters (``flatten_params``) in ``transformers``' names and layouts."""
    return {hf: np.ascontiguousarray(flat[ours].T if t else flat[ours]) for hf, ours, t in hf_names(config)}


def from_hf(names: Iterable[str], read: Callable[[str], np.ndarray], config, *, where: str = "the checkpoint"):
    """jaxmem's named parameters (as ``flatten_params`` names them), in ``config.param_dtype``, from a
    ``transformers`` checkpoint whose tensors are ``names``, each read by ``read(name)`` (one at a
    time: a sharded checkpoint is never held twice). Names with or without the ``transformer.`` /
    ``model.`` prefix (a ``GPT2Model`` / ``LlamaModel`` saves them without) are both accepted; buffers
    are skipped, and so is a tied head's stored copy (``transformers`` ties it to the embedding too)."""
    available = set(names)
    dtype = np.dtype(config.param_dtype) if config.param_dtype != "bfloat16" else _bfloat16()
    wanted = hf_names(config)
    flat, used, missing = {}, set(), []
    for hf, ours, transposed in wanted:
        name = hf if hf in available else hf.partition(".")[2] if hf.partition(".")[2] in available else None
        if name is None:
            missing.append(hf)
            continue
        used.add(name)
        value = np.asarray(read(name))
        flat[ours] = np.ascontiguousarray((value.T if transposed else value).astype(dtype, copy=False))
    if missing:
        raise JaxmemError(
            f"{where} lacks {len(missing)} of the model's {len(wanted)} tensors, e.g. {', '.join(missing[:3])}; "
            "is it the model its config.json describes?"
        )
    extra = sorted(n for n in available - used if not n.endswith(_BUFFERS) and n != "lm_head.weight")
    if extra:
        raise JaxmemError(
            f"{where} holds {len(extra)} tensors the built-in model has no place for, e.g. {', '.join(extra[:3])}; "
            "loading it would drop them"
        )
    return flat


def _bfloat16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)
