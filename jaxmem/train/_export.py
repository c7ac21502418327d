"""Leaving with a usable model: a checkpoint's weights exported in the model's own layout as
safetensors (plus ``config.json`` and the tokenizer), loaded back into the model, and sampled from."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile

import jax
import numpy as np

from jaxmem._errors import JaxmemError, setting
from jaxmem.data import EOS, BPETokenizer, ByteTokenizer, get_tokenizer
from jaxmem.models import describe_model, get_model, model_from_description, sample
from jaxmem.models.hf import config_from_hf, from_hf, hf_config, to_hf
from jaxmem.train._checkpoint import MARKER, read_params
from jaxmem.train._state_io import model_params

__all__ = [
    "Exported",
    "export_checkpoint",
    "flatten_names",
    "flatten_params",
    "load_exported",
    "load_hf",
    "load_model",
    "save_hf",
    "unflatten_params",
]

FORMAT = "jaxmem-export"
FORMATS = ("jaxmem", "hf")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = BPETokenizer.FILE
TOKENIZER_CONFIG = "tokenizer_config.json"


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
        raise JaxmemError(
            f"{directory} is not a jaxmem checkpoint directory (no {MARKER}); give a run's {setting('checkpoint_dir')}"
        )
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


def _write_weights(flat: dict, out_dir: str, metadata: dict) -> None:
    """``out_dir/model.safetensors`` (``out_dir`` a staging folder: :func:`_staged`), readable as any
    file the user writes."""
    path = os.path.join(out_dir, WEIGHTS)
    try:
        _import_safetensors().save_file(flat, path, metadata=metadata)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError for an OSError
        if isinstance(e, OSError):
            raise
        raise _WriteError(WEIGHTS, str(e)) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# Every file an export may write: an earlier export's are replaced (with force), never anything else.
EXPORT_FILES = (WEIGHTS, CONFIG, TOKENIZER, TOKENIZER_CONFIG)


class _WriteError(Exception):
    """A file of an export could not be written (``file``, ``reason``)."""

    def __init__(self, file: str, reason: str):
        super().__init__(file, reason)
        self.file, self.reason = file, reason


def check_export_dir(out_dir: str, *, force: bool = False, checkpoint_dir: str | None = None) -> None:
    """Refuse an export folder that is not for an export: the run's checkpoint folder or one inside it,
    a folder holding files that are not an earlier export (a data folder, say), or an earlier export
    without ``force``. Nothing is written here."""
    out = os.path.realpath(out_dir)
    if checkpoint_dir is not None:
        ckpt = os.path.realpath(checkpoint_dir)
        if out == ckpt or out.startswith(ckpt + os.sep):
            where = "the checkpoint folder" if out == ckpt else "inside the checkpoint folder"
            raise JaxmemError(
                f"{setting('out_dir', out_dir)} is {where} {checkpoint_dir}: an export never writes into a run's "
                "checkpoints. Give a folder beside it"
            )
    if not os.path.isdir(out):
        return
    present = sorted(os.listdir(out))
    others = [f for f in present if f not in EXPORT_FILES and not f.startswith(".jaxmem-export-")]
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise JaxmemError(
            f"{setting('out_dir', out_dir)} holds files that are not an export ({shown}); an export writes only into "
            f"an empty or new folder, or over an earlier export. Give another {setting('out_dir')}"
        )
    if any(f in (WEIGHTS, CONFIG) for f in present) and not force:
        raise JaxmemError(
            f"{out_dir} already holds an export ({WEIGHTS}); choose another {setting('out_dir')} or set "
            f"{setting('force')}"
        )


@contextlib.contextmanager
def _staged(out_dir: str):
    """A staging folder beside ``out_dir``; when the block ends, its files replace ``out_dir``'s (an
    earlier export's files it does not write are removed) -- all of them, or, when a file could not be
    written (a full disk, a file-size limit), none: the staging folder is removed and the error says
    which file and why, ``out_dir`` untouched."""
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".jaxmem-export-", dir=parent)
    try:
        yield staging
    except (OSError, _WriteError) as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, _WriteError):
            file, reason = e.file, e.reason
            if "No space left" in reason or "File too large" in reason:
                reason += " (free disk space or raise the file-size limit, ulimit -f)"
        else:
            file = os.path.basename(e.filename) if getattr(e, "filename", None) else "a file"
            reason = e.strerror or str(e)
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                reason += " (free disk space or raise the file-size limit, ulimit -f)"
        raise JaxmemError(f"the export could not write {file} ({reason}); nothing was written to {out_dir}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = os.listdir(staging)
    os.makedirs(out_dir, exist_ok=True)
    for name in EXPORT_FILES:  # an earlier export's files this one does not write
        if name not in written and os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    for name in written:
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    shutil.rmtree(staging, ignore_errors=True)


def export_checkpoint(
    checkpoint_dir: str, out_dir: str, *, step: int | None = None, model=None, force=False, format: str = "jaxmem"
):
    """Write the parameters of a checkpoint step (default: the latest) to ``out_dir``.

    ``format="jaxmem"`` files: ``model.safetensors`` (every parameter array in the model's own layout
    and dtype, named by its path, e.g. ``blocks.0.mlp_in.kernel``), ``config.json`` (the model's family
    and config, the step, the tokenizer) and ``tokenizer.json`` when the run used a BPE tokenizer.
    :func:`load_exported` reads them back; for an NNX module,
    ``nnx.update(module, nnx.State(params))`` puts them in.

    ``format="hf"`` (built-in GPT and Llama models): what ``transformers`` loads as
    ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` -- its ``config.json``, ``model.safetensors`` in its
    names and layouts (see :mod:`jaxmem.models.hf`), ``tokenizer.json`` and ``tokenizer_config.json``
    (a byte-level run gets a byte-level ``tokenizer.json`` whose ids are the bytes). :func:`load_hf`
    and ``jaxmem train --init-from`` read it back.

    Args:
        checkpoint_dir: a ``--checkpoint-dir`` of ``jaxmem train``.
        out_dir: created if missing; refused when it already holds an export (unless ``force``).
        step: which step (default: the latest).
        model: the :class:`~jaxmem.models.StagedModel` for a model of your own (built-in models are
            rebuilt from the checkpoint's metadata).
        format: ``jaxmem`` (default) or ``hf``.
    Returns:
        ``config.json``'s content.
    """
    if format not in FORMATS:
        raise JaxmemError(f"export format {format!r}: use one of {', '.join(FORMATS)}")
    restored, description, model, _, flat = _checkpoint_model(checkpoint_dir, step, model)
    if format == "hf" and description is None:
        raise JaxmemError(
            f"{setting('format', 'hf')} writes the built-in GPT and Llama in transformers' layout; {model.name} "
            f"is a model of your own (export it with {setting('format', 'jaxmem')})"
        )
    meta = restored.meta
    check_export_dir(out_dir, force=force, checkpoint_dir=checkpoint_dir)
    tokenizer = meta.get("tokenizer") or "byte"
    saved_tokenizer = os.path.join(checkpoint_dir, TOKENIZER)
    if tokenizer != "byte" and not os.path.exists(saved_tokenizer):
        raise JaxmemError(f"the run used tokenizer {tokenizer} but {saved_tokenizer} is missing")
    # Which state this is, without the exporting machine's paths: the step, and a digest of the
    # per-array checksums saved with it (equal digests: the same saved arrays).
    provenance = {"step": restored.step, "manifest_sha256": _manifest_digest(meta.get("manifest"))}
    param_count = int(sum(a.size for a in flat.values()))
    if format == "hf":
        run_tokenizer = ByteTokenizer() if tokenizer == "byte" else get_tokenizer(saved_tokenizer)
        extra = {"jaxmem": {"model": description, "checkpoint": provenance, "param_count": param_count}}
        return save_hf(model, flat, out_dir, tokenizer=run_tokenizer, extra=extra, force=True)
    config = {
        "format": FORMAT,
        "version": 1,
        "model": description,
        "step": restored.step,
        "tokenizer": "byte" if tokenizer == "byte" else TOKENIZER,
        "checkpoint": provenance,
        "param_count": param_count,
    }
    with _staged(out_dir) as staging:
        if tokenizer != "byte":
            shutil.copyfile(saved_tokenizer, os.path.join(staging, TOKENIZER))
        _write_weights(flat, staging, {"format": FORMAT, "step": str(restored.step)})
        with open(os.path.join(staging, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    return config


def save_hf(model, params, out_dir: str, *, tokenizer=None, extra: dict | None = None, force: bool = True) -> dict:
    """Write a built-in GPT or Llama with ``params`` (its own tree, or named arrays as
    :func:`flatten_params` gives them) as ``transformers`` saves a ``GPT2LMHeadModel`` /
    ``LlamaForCausalLM``: ``config.json`` (with ``extra`` keys added), ``model.safetensors`` and, for a
    ``tokenizer`` (a :class:`~jaxmem.data.Tokenizer`; a byte-level one is written as a byte-level
    ``tokenizer.json`` whose ids are the bytes), ``tokenizer.json`` and ``tokenizer_config.json``.
    Every file is written, or none (``out_dir`` untouched); a folder holding files that are not an
    export is refused, an earlier export replaced unless ``force`` is False.
    Returns ``config.json``'s content."""
    if describe_model(model) is None:
        raise JaxmemError(f"save_hf writes the built-in GPT and Llama; {model.name} is a model of your own")
    check_export_dir(out_dir, force=force)
    flat = flatten_params(params)  # named arrays name themselves the same way
    eos_id = None
    with _staged(out_dir) as staging:
        if tokenizer is not None:
            hf_tokenizer = tokenizer.as_bpe() if isinstance(tokenizer, ByteTokenizer) else tokenizer
            hf_tokenizer.save(staging)
            eos_id = hf_tokenizer.eos_id
            settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.max_seq_len}
            settings |= {"clean_up_tokenization_spaces": False, **({"eos_token": EOS} if eos_id is not None else {})}
            with open(os.path.join(staging, TOKENIZER_CONFIG), "w") as f:
                json.dump(settings, f, indent=2)
        config = {**hf_config(model.config, eos_id=eos_id), **(extra or {})}
        _write_weights(to_hf(flat, model.config), staging, {"format": "pt"})  # transformers checks for "pt"
        with open(os.path.join(staging, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    return config


class Exported:
    """An exported model: ``model`` (a StagedModel), ``params`` (its own layout) and ``tokenizer``
    (None when the directory has none)."""

    def __init__(self, model, params, tokenizer, config: dict):
        self.model, self.params, self.tokenizer, self.config = model, params, tokenizer, config

    def sample(self, prompt: str, **kwargs) -> str:
        """Continue a text prompt (keyword arguments as :func:`jaxmem.models.sample`)."""
        if self.tokenizer is None:
            raise JaxmemError("this model came without a tokenizer.json; call jaxmem.models.sample with token ids")
        ids = sample(self.model, self.params, self.tokenizer.encode(prompt), **kwargs)
        return self.tokenizer.decode(ids)


def _hf_tensors(directory: str):
    """``(names, read)`` of a ``transformers`` checkpoint directory's tensors: ``model.safetensors``,
    or the shards its ``model.safetensors.index.json`` maps; ``read(name)`` reads one tensor."""
    from safetensors import safe_open

    index = os.path.join(directory, WEIGHTS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        if not weight_map:
            raise JaxmemError(f"{index} has no weight_map")
    elif os.path.exists(os.path.join(directory, WEIGHTS)):
        weight_map = None
    else:
        found = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
        hint = f"; it has {', '.join(found[:3])}: save it with safe_serialization=True" if found else ""
        raise JaxmemError(f"{directory} has no {WEIGHTS} (or {WEIGHTS_INDEX}){hint}")
    files = {}

    def handle(file: str):
        if file not in files:
            path = os.path.join(directory, file)
            if os.path.basename(file) != file or not os.path.exists(path):
                raise JaxmemError(f"{directory}: weight file {file!r} (named by {WEIGHTS_INDEX}) is missing")
            files[file] = safe_open(path, framework="numpy")
        return files[file]

    if weight_map is None:
        names = list(handle(WEIGHTS).keys())
        return names, lambda name: handle(WEIGHTS).get_tensor(name)
    return list(weight_map), lambda name: handle(weight_map[name]).get_tensor(name)


def load_hf(directory: str, **overrides) -> Exported:
    """A local Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory (``config.json``,
    ``model.safetensors`` or its shards, and ``tokenizer.json`` when there is one) as the built-in GPT
    or Llama with those weights. Nothing is downloaded.

    ``overrides`` set the model's ``dtype``, ``param_dtype`` (default ``float32``: the weights are cast
    to it) and ``attention``; its shape comes from the directory. Refused, saying why, where the
    built-in model would not compute what the checkpoint's does (another activation, RoPE scaling,
    biases Llama does not have).

    >>> # exported = load_hf("gpt2-dir"); trainer.init_state(exported.params)
    """
    path = os.path.join(directory, CONFIG)
    hf = _read_config(directory, f"{directory} is not a Hugging Face model directory (no {CONFIG})")
    model = get_model(config_from_hf(hf, where=path, **{k: v for k, v in overrides.items() if v is not None}))
    params = hf_params(directory, model)
    tokenizer_file = os.path.join(directory, TOKENIZER)
    tokenizer = get_tokenizer(tokenizer_file) if os.path.exists(tokenizer_file) else None
    return Exported(model, params, tokenizer, hf)


def hf_params(directory: str, model):
    """The weights of a Hugging Face model directory as parameters of ``model`` (a built-in GPT or
    Llama of the directory's shape, e.g. built from its ``config.json``), in its parameter dtype; read
    one tensor at a time."""
    names, read = _hf_tensors(directory)
    return unflatten_params(from_hf(names, read, model.config, where=directory), model.abstract_params())


def _read_config(directory: str, missing: str) -> dict:
    """``directory/config.json`` as a dict (``missing``: the error when there is none)."""
    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise JaxmemError(missing) from None
    except json.JSONDecodeError as e:
        raise JaxmemError(f"{path} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise JaxmemError(f"{path} is not a JSON object")
    return config


def is_hf_directory(directory: str) -> bool:
    """Whether ``directory`` holds a ``transformers`` ``config.json`` (rather than a jaxmem export's)."""
    try:
        config = _read_config(directory, "")
    except (OSError, JaxmemError):
        return False
    return "model_type" in config and config.get("format") != FORMAT


def load_exported(directory: str, *, model=None) -> Exported:
    """The model, parameters and tokenizer of an :func:`export_checkpoint` directory.

    >>> # exported = load_exported("out"); nnx.update(module, nnx.State(exported.params))
    """

    path = os.path.join(directory, CONFIG)
    config = _read_config(directory, f"{directory} is not a jaxmem export (no {CONFIG}); make one with `jaxmem export`")
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
    """An export directory (either format), or a checkpoint directory (its latest or given step), as
    :class:`Exported` (``model``: for a model of your own)."""

    export = (is_hf_directory(path) and model is None) or os.path.exists(os.path.join(path, CONFIG))
    if export and step is not None:
        raise JaxmemError(
            f"{path} is an export (one step's weights), not a checkpoint folder: {setting('step', step)} chooses a "
            f"step of a checkpoint folder. Drop {setting('step')}, or give the run's checkpoint folder"
        )
    if is_hf_directory(path) and model is None:
        return load_hf(path)
    if os.path.exists(os.path.join(path, CONFIG)):
        return load_exported(path, model=model)
    restored, description, model, params, _ = _checkpoint_model(path, step, model)
    spec = restored.meta.get("tokenizer") or "byte"
    tokenizer = get_tokenizer("byte" if spec == "byte" else os.path.join(path, TOKENIZER))
    return Exported(model, params, tokenizer, {"step": restored.step, "model": description})
