"""jaxmem's built-in GPT and Llama against Hugging Face ``transformers`` on the same weights.

    pip install torch==2.13.0 transformers      # optional; not needed by jaxmem or its CI
    python benchmarks/hf_parity.py [--json]

Each model is written with :func:`jaxmem.train.save_hf` (what ``jaxmem export --format hf`` writes),
loaded by ``transformers.AutoModelForCausalLM.from_pretrained`` in float32, and both compute the
logits of one batch (2 sequences of 64 random tokens). The parameters are the model's initial ones
moved off their structured values (every array plus Gaussian noise of 0.02, so norm scales are not
1 and biases not 0: a misread layout changes the logits). Reported per model: the largest absolute
difference of the logits, the largest logit, and whether :func:`jaxmem.train.load_hf` reads the
directory back bit-exactly. One CPU device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # its 8 virtual devices; no accelerator plugin tried
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxmem.models import get_model  # noqa: E402
from jaxmem.train import load_hf, save_hf  # noqa: E402

MODELS = {
    "gpt2-small (124M, GPT2LMHeadModel)": ("gpt2-small", {"norm_eps": 1e-5}),
    "gpt tiny, untied head": ("tiny", {}),
    "llama 4 layers d=512 GQA 8/2 (LlamaForCausalLM)": (
        "llama-tiny",
        dict(vocab_size=32000, max_seq_len=256, d_model=512, n_heads=8, n_kv_heads=2, n_layers=4, rope_theta=5e5),
    ),
    "llama tiny, tied head": ("llama-tiny", {"tied_head": True}),
    "llama 2 layers d=256, Llama 3.1 RoPE scaling (8, 1, 4, 32)": (
        "llama-tiny",
        dict(max_seq_len=64, d_model=256, n_heads=4, n_kv_heads=4, n_layers=2, rope_scaling=(8.0, 1.0, 4.0, 32)),
    ),
}
BATCH, SEQ, NOISE = 2, 64, 0.02


def measure(preset: str, overrides: dict, directory: str) -> dict:
    import torch
    import transformers

    model = get_model(preset, **overrides)
    params = model.init(0)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + NOISE * jax.random.normal(next(keys), p.shape, p.dtype), params)
    save_hf(model, params, directory)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (BATCH, SEQ)).astype(np.int32)
    ours = np.asarray(model.logits(params, {"tokens": tokens, "targets": tokens}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    back = load_hf(directory)
    exact = all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back.params)))
    return {
        "class": type(hf).__name__,
        "params": int(sum(p.size for p in jax.tree.leaves(params))),
        "max_abs_diff": float(np.abs(theirs - ours).max()),
        "max_abs_logit": float(np.abs(ours).max()),
        "load_hf_bit_exact": exact,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    args = parser.parse_args()
    try:
        import torch
        import transformers
    except ImportError:
        print("needs torch and transformers: pip install torch==2.13.0 transformers", file=sys.stderr)
        return 2
    record = {
        "setup": f"batch {BATCH} x {SEQ} random tokens, float32, one CPU device, parameters = init + N(0, {NOISE})",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "jax": jax.__version__},
        "models": {},
    }
    for name, (preset, overrides) in MODELS.items():
        with tempfile.TemporaryDirectory() as directory:
            row = measure(preset, overrides, directory)
        record["models"][name] = row
        print(
            f"{name}: {row['class']} max |logit diff| {row['max_abs_diff']:.2e} (max |logit| "
            f"{row['max_abs_logit']:.2f}), load_hf bit-exact: {row['load_hf_bit_exact']}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
