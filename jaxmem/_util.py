"""Small helpers every layer may use (floor 0: imports nothing from jaxmem but the errors)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import tomllib

from jaxmem._errors import JaxmemError, setting

__all__ = [
    "LAUNCHER_ENV",
    "SETTINGS_ENV",
    "call_factory",
    "check_output_dir",
    "check_output_file",
    "compiled_bytes",
    "compiled_platform",
    "compiled_temp_bytes",
    "cpu_cores",
    "die_with_launcher",
    "unvarying",
    "first_device",
    "human_bytes",
    "import_named",
    "launch_settings",
    "load_toml",
    "parse_bytes",
    "parse_int_list",
    "platform_of",
    "tree_with",
    "tree_without",
    "varying_axes",
    "vma_check_off",
    "with_host_devices",
]


def import_named(text: str, what: str, example: str):
    """The object ``package.module:attr`` names (``attr`` may be dotted); ``what`` ("model",
    "samples") and ``example`` ("mymodels:vit") word the errors. The module is imported from the
    current directory (as ``python -m`` does) or the installed packages."""
    import importlib
    import sys

    module_name, _, attr = text.partition(":")
    if not module_name or not attr:
        raise JaxmemError(f"{what} {text!r}: name it as package.module:attr, e.g. {example}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise JaxmemError(
            f"{what} {text!r}: cannot import {module_name!r} ({e}); run from the directory that holds it, "
            "or put it on PYTHONPATH"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise JaxmemError(f"{what} {text!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def call_factory(obj, text: str, what: str, kind: str):
    """``obj()`` when ``obj`` is a function taking no required arguments (what ``package.module:attr``
    may name instead of the object itself); a function that needs arguments is refused, naming them.
    ``text``, ``what`` and ``kind`` word the error ("os.path:join", "model", "a StagedModel")."""
    import inspect

    if isinstance(obj, type) or not callable(obj):
        return obj
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without one: call it and see
        signature = None
    if signature is not None:
        required = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if required:
            raise JaxmemError(
                f"{what} {text!r} is the function {getattr(obj, '__name__', obj)!r}, which needs arguments "
                f"({', '.join(required)}); name {kind} or a function that builds one with no arguments"
            )
    return obj()


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written: its folder missing or a
    file, the path itself a folder, or the folder not writable."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise JaxmemError(f"{flag} {path} is a directory; give a file name inside it")
    if not os.path.isdir(parent):
        found = _nearest_existing(parent)
        if not os.path.isdir(found):
            raise JaxmemError(f"{flag} {path}: {found} is a file, not a folder; choose another path")
        raise JaxmemError(f"{flag} {path}: the folder {parent} does not exist; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK):
        raise JaxmemError(f"{flag} {path}: the folder {parent} is not writable; choose another path")


def check_output_dir(path: str, flag: str) -> None:
    """Refuse, before any work, an output folder that could not be created or written."""
    found = _nearest_existing(path)
    if not os.path.isdir(found):
        what = "is a file" if found == os.path.abspath(path) else f"is under {found}, which is a file"
        raise JaxmemError(f"{flag} {path} {what}; give a folder")
    if not os.access(found, os.W_OK):
        raise JaxmemError(f"{flag} {path}: {found} is not writable; choose another folder")


def load_toml(path: str) -> dict:
    """A TOML file as a dict; a missing or malformed file is a :class:`JaxmemError` naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise JaxmemError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise JaxmemError(f"config file {path!r} is a directory; give a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise JaxmemError(f"config file {path!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise JaxmemError(
            f"config file {path!r} is not valid TOML: not UTF-8 text (byte {e.start}); give a TOML file"
        ) from None
    except OSError as e:
        raise JaxmemError(f"cannot read config file {path!r}: {e.strerror or e}") from None


def human_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.00 MiB`` or, below a tenth of a MiB, ``1.00 KiB``.

    >>> human_bytes(3 * 2**30), human_bytes(12 * 2**20), human_bytes(1024)
    ('3.00 GiB', '12.00 MiB', '1.00 KiB')
    """
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 / 10 else f"{n / 2**10:.2f} KiB"


def parse_int_list(text: str, name: str) -> tuple[int, ...]:
    """'3,3,2' -> (3, 3, 2); a bad one is an error naming the setting ``name``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise JaxmemError(f"{setting(name)} takes comma-separated integers like 3,3,2; got {text!r}") from None


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, name: str = "budget") -> float:
    """'24GiB', '512 MiB', '8e9', '1.5GB' -> bytes; a bad one is an error naming the setting ``name``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise JaxmemError(f"{setting(name)} takes a size like 24GiB, 512MiB, 8e9 or 1.5GB; got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise JaxmemError(f"{setting(name)} must be > 0, got {text!r}")
    return value


ONE_THREAD_PER_DEVICE = "--xla_cpu_multi_thread_eigen=false"


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def with_host_devices(flags: str, count: int, cores: int | None = None) -> str:
    """``XLA_FLAGS`` text asking for ``count`` virtual host (CPU) devices, the other flags kept as given
    (a user's own XLA flags must reach the processes a launcher starts).

    When the devices are at least the ``cores`` (default: this machine's), each device also runs its
    kernels on its own thread (``--xla_cpu_multi_thread_eigen=false``) unless the flags say otherwise:
    by default XLA:CPU runs every device's matrix products on a pool of all the cores, so ``count``
    device threads and the pool's contend for the same cores. A small gain on the 2-core development
    machine with 4 devices: the plain data-parallel step the same, the pipelined steps' ratio to it a
    median 3% lower over ``benchmarks/overhead.py``'s grid (docs: "The time model, measured")."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    if count >= (cpu_cores() if cores is None else cores) and not any(
        f.startswith(ONE_THREAD_PER_DEVICE.split("=")[0]) for f in kept
    ):
        kept.append(ONE_THREAD_PER_DEVICE)
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def tree_get(tree, path):
    """The entry of a nested dict (or sequence) at ``path``."""
    for key in path:
        tree = tree[key]
    return tree


def tree_without(tree, path: tuple) -> dict:
    """A copy of a nested dict without the entry at ``path`` (a parent left empty goes too, as it
    does from the state of a module whose only child was that entry)."""
    out = dict(tree)
    if len(path) == 1:
        out.pop(path[0], None)
        return out
    inner = tree_without(tree[path[0]], path[1:])
    if inner:
        out[path[0]] = inner
    else:
        out.pop(path[0])
    return out


def tree_with(tree, path: tuple, value) -> dict:
    """A copy of a nested dict with ``value`` at ``path`` (missing parents created)."""
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else tree_with(tree.get(path[0], {}), path[1:], value)
    return out


def hold_lock(path, busy):
    """Hold an exclusive ``flock`` on the file ``path`` while the returned file is open (closing it,
    or this process dying, releases it), with this process's pid and host written in it. When
    another open file holds it: raise ``busy(holder)`` (the holder's pid and host as written).
    ``OSError`` when the file cannot be opened."""
    import fcntl
    import os
    import socket

    f = open(path, "a+")  # noqa: SIM115 -- held open by the caller
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read(200).strip() or "another process"
        f.close()
        raise busy(holder) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    return f


LAUNCHER_ENV = "JAXMEM_LAUNCHER_PID"
# A JSON file of settings a launched worker applies with its command line -- ``defaults`` below its
# arguments (the run's folders), ``overrides`` above them (a recovery's layout): jaxmem.config.from_args.
SETTINGS_ENV = "JAXMEM_LAUNCH_SETTINGS"


def launch_settings(environ=None) -> dict:
    """``{"defaults": ..., "overrides": ...}`` that ``jaxmem launch`` gave this worker ({} outside a launch)."""
    import json

    environ = os.environ if environ is None else environ
    path = environ.get(SETTINGS_ENV)
    if not path:
        return {}
    try:
        with open(path) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise JaxmemError(f"cannot read the launcher's settings file {path} ({SETTINGS_ENV}): {e}") from None
    if not isinstance(settings, dict) or set(settings) - {"defaults", "overrides"}:
        raise JaxmemError(f"the launcher's settings file {path} holds only 'defaults' and 'overrides'")
    return settings


def die_with_launcher(environ=None) -> None:
    """In a worker ``jaxmem launch`` started: get SIGTERM when the launcher dies (Linux prctl
    PR_SET_PDEATHSIG), and stop now if it already has (the worker's parent is no longer the launcher).
    Nothing outside a launch. Here, not in :mod:`jaxmem.elastic`, because a worker calls it before
    its CLI sets the device count, which must come before anything imports JAX."""
    environ = os.environ if environ is None else environ
    launcher = environ.get(LAUNCHER_ENV)
    if not launcher:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's own signal handlers stop its workers
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGTERM)


def tree_bytes(tree) -> int:
    """Bytes of a pytree's arrays (or shaped values: anything with ``shape`` and ``dtype``)."""
    import math

    import jax
    import numpy as np

    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def first_device(devices):
    """The first device of ``devices``: a list, a mesh's device array, a mesh, or a device."""
    if hasattr(devices, "devices") and not callable(devices.devices):  # a Mesh
        devices = devices.devices
    if hasattr(devices, "flat"):
        return next(iter(devices.flat))
    if isinstance(devices, (list, tuple)):
        return devices[0]
    return devices


def platform_of(devices) -> str:
    """``cpu``, ``gpu`` or ``tpu``: the platform of ``devices`` (see :func:`first_device`), as a
    program compiled for them sees it -- which need not be this process's default backend (a
    program compiled for a target's compile-only devices, :mod:`jaxmem.targets`)."""
    platform = str(first_device(devices).platform).lower()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def step_compiler_options(platform: str) -> dict | None:
    """XLA options jaxmem compiles its programs with on ``platform`` (``cpu``, ``gpu``, ``tpu``).

    On a GPU, copy insertion's region analysis: without it XLA's GPU compiler copies a stash arena
    that a ``lax.cond`` inside the tick loop updates in place whenever the step runs a stage's loss
    inside its forward (no vocabulary split), holding the arena twice (an H100 step of an 8-layer
    decoder family: 3.98 MB of temporaries without the option, 3.24 MB with it;
    ``tests/test_targets.py``). The
    working sets the ledger compiles for a GPU take the same options
    (:func:`jaxmem.memory._facts._working_options`). Nothing elsewhere."""
    return {"xla_gpu_copy_insertion_use_region_analysis": True} if platform == "gpu" else None


def compiled_platform(compiled) -> str:
    """The platform a compiled program was built for: its input shardings' devices (the default
    backend's for a program without inputs)."""
    import jax

    try:
        shardings = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda x: hasattr(x, "device_set"))
        for sharding in shardings:
            if hasattr(sharding, "device_set"):
                return platform_of(min(sharding.device_set, key=lambda d: d.id))
    except Exception:  # noqa: BLE001 -- an executable that does not say
        pass
    return platform_of(jax.devices())


def compiled_temp_bytes(compiled) -> int:
    """The temporaries of a compiled program beyond its arguments and outputs, as its target's compiler
    counts them: on TPU its peak less the arguments and outputs it holds (its ``temp_size_in_bytes``
    can be 0 for a program of small temporaries kept apart, or above the peak for one of many);
    elsewhere ``temp_size_in_bytes``."""
    analysis = compiled.memory_analysis()
    peak = _tpu_device_peak(compiled, analysis)
    if peak is not None:
        held = analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        return int(max(0, peak - held))
    return int(analysis.temp_size_in_bytes)


def _tpu_device_peak(compiled, analysis) -> int | None:
    """A TPU program's peak in device memory: ``peak_memory_in_bytes`` counts its host buffers too
    (a program holding 2 MiB of arguments and a 1 MiB host buffer peaks at 3 MiB), so they are taken
    out. None off TPU."""
    peak = getattr(analysis, "peak_memory_in_bytes", 0)
    if not peak or compiled_platform(compiled) != "tpu":
        return None
    host = (
        analysis.host_argument_size_in_bytes
        + analysis.host_temp_size_in_bytes
        + analysis.host_output_size_in_bytes
        - analysis.host_alias_size_in_bytes
    )
    return int(max(0, peak - host))


def compiled_flops(compiled) -> float:
    """FLOPs of a compiled program as its compiler counts them in the optimised program: its own
    ``cost_analysis()`` where it gives one (CPU, TPU); where it gives none (a GPU compiled for with no
    GPU present) XLA's HLO cost analysis of the optimised modules, run by this process's CPU client
    (``jax._src.lib.xla_client``: no public API does it). A custom kernel (cuDNN's attention) counts
    no FLOPs there."""
    import jax

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if cost and "flops" in cost:
        return float(cost["flops"])
    from jax._src.lib import xla_client

    client = jax.devices("cpu")[0].client
    modules = compiled.runtime_executable().hlo_modules()
    return float(sum(xla_client._xla.hlo_module_cost_analysis(client, m).get("flops", 0.0) for m in modules))


def compiled_bytes(compiled) -> int:
    """Device bytes of a compiled program, as its target's compiler counts them (the ledger's, the
    profiler's and ROAM's one figure): on TPU ``memory_analysis()``'s ``peak_memory_in_bytes`` less
    its host buffers, the figure the TPU compiler checks against HBM (its out-of-memory error quotes
    it; its ``temp_size_in_bytes`` leaves out temporaries it keeps elsewhere, so arguments +
    temporaries + outputs can be below or above it); elsewhere the arguments + temporaries +
    outputs, less what outputs alias from arguments (on GPU, its peak less its host buffers)."""
    analysis = compiled.memory_analysis()
    peak = _tpu_device_peak(compiled, analysis)
    if peak is not None:
        return peak
    return int(
        analysis.argument_size_in_bytes
        + analysis.temp_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


# ------------------------------------------------------------------ shard_map's varying-axes typing
def varying_axes(x) -> frozenset:
    """The mesh axes along which ``x`` (an array or its abstract value) varies inside ``shard_map``
    (jax 0.10 spells it ``manual_axis_type.varying``)."""
    import jax

    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


@contextlib.contextmanager
def vma_check_off():
    """Trace without JAX's check of the mesh axes each value varies over (``check_vma``) inside a
    ``shard_map``, and without the pullback's check of each cotangent's type against its primal's
    (the types inside are not kept consistent, so neither is that check). jax 0.10.2 offers no public
    switch for either. Used by jaxmem's step for a stage's actions (``jaxmem.pipeline``) and by
    :func:`jaxmem.models.fused_attention` around a Pallas kernel written without the typing."""
    from jax._src import config as jax_config

    switch = getattr(jax_config, "_check_vma", None)
    with contextlib.ExitStack() as stack:
        if switch is not None:
            stack.enter_context(switch(False))
            stack.enter_context(jax_config.disable_bwd_checks(True))
        yield


def unvarying(x):
    """``x`` typed as a value computed inside :func:`vma_check_off` is (varying over no axis): two casts
    to its own dtype (weak, then as it was), no operation in the program."""
    import jax
    from jax._src.lax import lax as lax_internal

    weak = jax.typeof(x).weak_type
    x = lax_internal._convert_element_type(x, x.dtype, weak_type=not weak)
    return lax_internal._convert_element_type(x, x.dtype, weak_type=weak)
