"""Leaving with a usable model: a checkpoint's weights exported in the model's own layout as
safetensors (plus ``config.json`` and the tokenizer), loaded back into the model, and sampled from."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import numpy as np

from jaxmem._errors import JaxmemError
from jaxmem.data import BPETokenizer, get_tokenizer
from jaxmem.models import describe_model, generate, model_from_description
from jaxmem.train._checkpoint import MARKER, read_params
from jaxmem.train._state_io import model_params

__all__ = [
    "Exported",
    "export_checkpoint",
    "flatten_names",
    "flatten_params",
    "load_exported",
    "load_model",
    "unflatten_params",
]

FORMAT = "jaxmem-export"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER = BPETokenizer.FILE


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten_params(params) -> dict[str, np.ndarray]:
    """``{"blocks.0.attn.qkv.kernel": array, ...}``: one entry per array, named by its dict path, each
    C-contiguous (a transposed view would be written by its buffer, not its values)."""
    return {
        _path_name(path): np.ascontiguousarray(jax.device_get(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def unflatten_params(flat: dict[str, np.ndarray], like) -> object:
    """The tree ``like`` (e.g. ``model.abstract_params()``) filled from ``flat``; names, shapes and dtypes
    must match exactly."""
    names = flatten_names(like)
    missing = [n for n in names if n not in flat]
    extra = sorted(set(flat) - set(names))
    if missing or extra:
        raise JaxmemError(
            f"the weights do not fit the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
        )
    leaves = []
    for name, spec in zip(names, jax.tree.leaves(like)):
        value = flat[name]
        if tuple(value.shape) != tuple(spec.shape) or np.dtype(value.dtype) != np.dtype(spec.dtype):
            raise JaxmemError(
                f"weight {name}: {value.dtype}{list(value.shape)} in the file, {np.dtype(spec.dtype)}"
                f"{list(spec.shape)} in the model"
            )
        leaves.append(value)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def flatten_names(tree) -> list[str]:
    """The names :func:`flatten_params` gives the arrays of ``tree``, in leaf order."""
    return [_path_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _import_safetensors():
    try:
        import safetensors.numpy
    except ImportError:
        raise JaxmemError("export needs the safetensors package: pip install 'jaxmem[data]'") from None
    return safetensors.numpy


def _read_checkpoint(directory: str, step: int | None):
    """The parameters of a step of an existing jaxmem checkpoint directory, read-only."""
    if not os.path.isdir(directory):
        raise JaxmemError(f"{directory}: no such checkpoint directory")
    if not os.path.exists(os.path.join(directory, MARKER)):
        raise JaxmemError(f"{directory} is not a jaxmem checkpoint directory (no {MARKER}); pass a --checkpoint-dir")
    return read_params(directory, step)


def _checkpoint_model(directory: str, step: int | None, model=None):
    """``(restored, description, model, params, flat)`` of a checkpoint step: the model rebuilt from the
    step's metadata (or the one given), its parameters in its own tree and as named arrays."""

    restored = _read_checkpoint(directory, step)
    description = restored.meta.get("model_spec") or (describe_model(model) if model is not None else None)
    if model is None:
        if description is None:
            raise JaxmemError(
                f"checkpoint step {restored.step} does not say how to rebuild its model (a model of your own, or "
                "saved before jaxmem 0.1 recorded it); use the Python API with model=your_model "
                "(jaxmem.train.export_checkpoint or load_model)"
            )
        model = model_from_description(description)
    # The checkpoint's own tree spells integer keys as strings: re-key through the names.
    flat = flatten_params(model_params(restored.state["params"], restored.meta, model))
    return restored, description, model, unflatten_params(flat, model.abstract_params()), flat


def _manifest_digest(manifest) -> str | None:
    """SHA-256 of a step's checksum manifest (None for a step saved without one)."""
    if not manifest:
        return None
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, step: int | None = None, model=None, force=False):
    """Write the parameters of a checkpoint step (default: the latest) to ``out_dir``.

    Files: ``model.safetensors`` (every parameter array in the model's own layout and dtype, named by
    its path, e.g. ``blocks.0.mlp_in.kernel``), ``config.json`` (the model's family and config, the
    step, the tokenizer) and ``tokenizer.json`` when the run used a BPE tokenizer.
    :func:`load_exported` reads them back; for an NNX module,
    ``nnx.update(module, nnx.State(params))`` puts them in.

    Args:
        checkpoint_dir: a ``--checkpoint-dir`` of ``jaxmem train``.
        out_dir: created if missing; refused when it already holds an export (unless ``force``).
        step: which step (default: the latest).
        model: the :class:`~jaxmem.models.StagedModel` for a model of your own (built-in models are
            rebuilt from the checkpoint's metadata).
    Returns:
        ``config.json``'s content.
    """
    restored, description, model, _, flat = _checkpoint_model(checkpoint_dir, step, model)
    meta = restored.meta
    if os.path.exists(os.path.join(out_dir, WEIGHTS)) and not force:
        raise JaxmemError(f"{out_dir} already holds an export ({WEIGHTS}); choose another -o or pass --force")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = meta.get("tokenizer") or "byte"
    saved_tokenizer = os.path.join(checkpoint_dir, TOKENIZER)
    if tokenizer != "byte":
        if not os.path.exists(saved_tokenizer):
            raise JaxmemError(f"the run used tokenizer {tokenizer} but {saved_tokenizer} is missing")
        shutil.copyfile(saved_tokenizer, os.path.join(out_dir, TOKENIZER))
    config = {
        "format": FORMAT,
        "version": 1,
        "model": description,
        "step": restored.step,
        "tokenizer": "byte" if tokenizer == "byte" else TOKENIZER,
        # Which state this is, without the exporting machine's paths: the step, and a digest of the
        # per-array checksums saved with it (equal digests: the same saved arrays).
        "checkpoint": {"step": restored.step, "manifest_sha256": _manifest_digest(meta.get("manifest"))},
        "param_count": int(sum(a.size for a in flat.values())),
    }
    tmp = os.path.join(out_dir, WEIGHTS + ".tmp")
    _import_safetensors().save_file(flat, tmp, metadata={"format": FORMAT, "step": str(restored.step)})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # readable as any file the user writes
    os.replace(tmp, os.path.join(out_dir, WEIGHTS))
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return config


class Exported:
    """An exported model: ``model`` (a StagedModel), ``params`` (its own layout) and ``tokenizer``."""

    def __init__(self, model, params, tokenizer, config: dict):
        self.model, self.params, self.tokenizer, self.config = model, params, tokenizer, config

    def generate(self, prompt: str, **kwargs) -> str:
        """Continue a text prompt (keyword arguments as :func:`jaxmem.models.generate`)."""

        ids = generate(self.model, self.params, self.tokenizer.encode(prompt), **kwargs)
        return self.tokenizer.decode(ids)


def load_exported(directory: str, *, model=None) -> Exported:
    """The model, parameters and tokenizer of an :func:`export_checkpoint` directory.

    >>> # exported = load_exported("out"); nnx.update(module, nnx.State(exported.params))
    """

    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise JaxmemError(f"{directory} is not a jaxmem export (no {CONFIG}); make one with `jaxmem export`") from None
    if config.get("format") != FORMAT:
        raise JaxmemError(f"{path} is not a jaxmem export config (format {config.get('format')!r})")
    if model is None:
        if not config.get("model"):
            raise JaxmemError(f"{path} describes a model of your own; pass model= to load_exported")
        model = model_from_description(config["model"])
    flat = _import_safetensors().load_file(os.path.join(directory, WEIGHTS))
    params = unflatten_params(flat, model.abstract_params())
    spec = config.get("tokenizer", "byte")
    if spec != "byte" and (not isinstance(spec, str) or os.path.basename(spec) != spec or spec in ("", ".", "..")):
        raise JaxmemError(
            f"{path}: tokenizer {spec!r} is not a file name inside the export; an export names its own "
            f"tokenizer file (e.g. {TOKENIZER!r}) or 'byte'"
        )
    tokenizer = get_tokenizer("byte" if spec == "byte" else os.path.join(directory, spec))
    return Exported(model, params, tokenizer, config)


def load_model(path: str, *, step: int | None = None, model=None) -> Exported:
    """An export directory, or a checkpoint directory (its latest or given step), as :class:`Exported`
    (``model``: for a model of your own)."""

    if os.path.exists(os.path.join(path, CONFIG)):
        return load_exported(path, model=model)
    restored, description, model, params, _ = _checkpoint_model(path, step, model)
    spec = restored.meta.get("tokenizer") or "byte"
    tokenizer = get_tokenizer("byte" if spec == "byte" else os.path.join(path, TOKENIZER))
    return Exported(model, params, tokenizer, {"step": restored.step, "model": description})
