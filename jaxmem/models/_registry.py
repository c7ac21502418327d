"""Built-in model presets by name (GPT-2 and Llama shapes) and the one lookup every command uses."""

from __future__ import annotations

import dataclasses
import functools

from jaxmem._errors import JaxmemError
from jaxmem.models import gpt as _gpt
from jaxmem.models import llama as _llama
from jaxmem.models._interface import StagedModel, repeated_layers

__all__ = ["PRESETS", "describe_model", "get_config", "get_model", "model_from_description", "model_name"]

PRESETS: dict[str, object] = {**_gpt.PRESETS, **_llama.PRESETS}


def get_config(name, **overrides):
    """A preset's config by name (case-insensitive), or a config itself, with field overrides.

    >>> get_config("tiny", n_layers=4).n_layers
    4
    >>> get_config("llama-tiny").n_kv_heads
    2
    """
    if isinstance(name, (_gpt.GPTConfig, _llama.LlamaConfig)):
        base = name
    else:
        key = str(name).strip().lower()
        if key not in PRESETS:
            raise JaxmemError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        base = PRESETS[key]
    if not overrides:
        return base
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise JaxmemError(f"{type(base).__name__} has no field {unknown[0]!r}; fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(base, **overrides)


def model_name(spec) -> str:
    """How a model spec is named in reports: the preset name, the model's own name, or its config type."""
    if isinstance(spec, StagedModel):
        return spec.name
    if isinstance(spec, str) and ":" in spec:
        return spec.strip()
    if isinstance(spec, str):
        return spec.strip().lower()
    return type(spec).__name__.replace("Config", "").lower()


def get_model(spec, **overrides) -> StagedModel:
    """A :class:`StagedModel` from a preset name, a GPTConfig / LlamaConfig, a StagedModel, or
    ``"package.module:attr"`` naming a StagedModel or a function that returns one (the module is
    imported from the current directory or the installed packages; a function is called once).

    ``overrides`` change config fields of a preset or config (``n_layers``, ``dtype``, ...).

    >>> get_model("llama-tiny", n_layers=2).n_layers
    2
    """
    if isinstance(spec, str) and ":" in spec:
        spec = _imported(spec.strip())
    if isinstance(spec, StagedModel):
        if overrides:
            raise JaxmemError(
                f"model {spec.name!r} is a StagedModel; its config cannot be changed here ({', '.join(overrides)})"
            )
        return spec
    return _build(get_config(spec, **overrides), model_name(spec))


@functools.lru_cache(maxsize=16)
def _imported(text: str) -> StagedModel:
    """The model ``package.module:attr`` names (cached: every lookup of one name gives one object, so
    its traced facts are shared)."""
    from jaxmem._util import call_factory, import_named

    obj = import_named(text, "model", "mymodels:vit")
    if not isinstance(obj, StagedModel):  # a factory (a class is not one)
        obj = call_factory(obj, text, "model", "a StagedModel")
    if not isinstance(obj, StagedModel):
        raise JaxmemError(
            f"model {text!r} is {'the class ' + obj.__name__ if isinstance(obj, type) else 'a ' + type(obj).__name__}; "
            "it must be a StagedModel or a function returning one (e.g. built with jaxmem.models.from_nnx)"
        )
    return obj


@functools.lru_cache(maxsize=64)
def _build(config, name: str) -> StagedModel:
    # One StagedModel per (config, name): planners ask for the same model many times, and its facts
    # are cached per model object. A preset's layers are all alike, so a deep one is its one-layer
    # model repeated (repeated_layers): the planners score many depths, and building each whole
    # traced every layer's constructor (the gpt2-xl preset at 400 layers: 18 s).
    build = _llama.llama if isinstance(config, _llama.LlamaConfig) else _gpt.gpt
    if config.n_layers <= 2:
        return build(config, name)
    shallow = _build(dataclasses.replace(config, n_layers=1), name)
    analytic = None if shallow.analytic is None else config  # the GPT's closed form is its config
    return repeated_layers(shallow, lambda: build(config, name), config.n_layers, config=config, analytic=analytic)


_FAMILIES = {"gpt": _gpt.GPTConfig, "llama": _llama.LlamaConfig}


def describe_model(model: StagedModel) -> dict | None:
    """What rebuilds a built-in model: its family and config fields (JSON-able); None for a model of
    your own (export and sample it through the Python API, passing the model).

    >>> describe_model(get_model("llama-tiny"))["family"]
    'llama'
    """
    for family, kind in _FAMILIES.items():
        if isinstance(model.config, kind):
            return {"family": family, "name": model.name, "config": dataclasses.asdict(model.config)}
    return None


def model_from_description(description: dict) -> StagedModel:
    """The model :func:`describe_model` described."""
    try:
        kind = _FAMILIES[description["family"]]
        config = kind(**description["config"])
    except (KeyError, TypeError) as e:
        raise JaxmemError(f"not a jaxmem model description ({e}); families: {', '.join(_FAMILIES)}") from None
    return _build(config, description.get("name", description["family"]))
