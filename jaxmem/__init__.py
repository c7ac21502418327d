"""jaxmem: train language models that do not fit in accelerator memory, on JAX.

Schedules (``jaxmem.schedule``) are pure Python and import no JAX; the executor, policies, ledger,
planners and elastic layer import JAX when first used. The names a user reaches for are here too,
imported on first use: ``jaxmem.TrainConfig``, ``Trainer``, ``Checkpointer``, ``Pipeline``,
``make_mesh``, ``get_model``, ``from_nnx``, ``Policy``, ``from_spec``, ``estimate``, ``plan`` (the
planner, :func:`jaxmem.search.search`), ``AdaptiveProfiler``, ``choose_recovery``, and ``load_hf`` /
``save_hf`` (Hugging Face GPT-2 and Llama weights in and out); the training loop is
:func:`jaxmem.train.train`.
"""

__version__ = "0.1.0"

from jaxmem._errors import JaxmemError as JaxmemError
from jaxmem._errors import StepTooLarge as StepTooLarge
from jaxmem.schedule import Action as Action
from jaxmem.schedule import Costs as Costs
from jaxmem.schedule import Schedule as Schedule
from jaxmem.schedule import ScheduleError as ScheduleError
from jaxmem.schedule import generate as generate
from jaxmem.schedule import load_csv as load_csv
from jaxmem.schedule import save_csv as save_csv
from jaxmem.schedule import simulate as simulate
from jaxmem.schedule import validate as validate

# The verbs a user needs, imported on first use (``import jaxmem`` itself stays free of JAX).
_LAZY = {
    "TrainConfig": "jaxmem.config",
    "Trainer": "jaxmem.train",
    "Checkpointer": "jaxmem.train",
    "Pipeline": "jaxmem.pipeline",
    "make_mesh": "jaxmem.pipeline",
    "get_model": "jaxmem.models",
    "from_nnx": "jaxmem.models",
    "Policy": "jaxmem.policy",
    "from_spec": "jaxmem.policy",
    "estimate": "jaxmem.memory",
    "plan": "jaxmem.search",  # jaxmem.search.search: the planner behind `jaxmem plan`
    "AdaptiveProfiler": "jaxmem.profiler",
    "choose_recovery": "jaxmem.elastic",
    "load_hf": "jaxmem.train",
    "save_hf": "jaxmem.train",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), "search" if name == "plan" else name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_LAZY])
