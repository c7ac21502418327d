"""Helpers shared by the CLI commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from jaxmem._errors import JaxmemError, first_line
from jaxmem._util import check_output_dir as check_output_dir
from jaxmem._util import check_output_file as check_output_file
from jaxmem._util import load_toml as load_toml
from jaxmem._util import parse_bytes as parse_bytes
from jaxmem._util import parse_int_list as parse_int_list
from jaxmem._util import with_host_devices


def _number(kind, least: float, strict: bool, what: str):
    """An argparse ``type`` that reads a ``kind`` and refuses values below ``least`` (or equal to it,
    when ``strict``) and non-finite ones, with a message naming the rule."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, False, "an integer >= 1")
non_negative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")


def seed_int(text: str) -> int:
    """An argparse ``type`` for a seed: an integer 0 <= seed < 2**63 (what ``jax.random.key`` takes)."""
    value = non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63 (jax.random.key takes a 64-bit integer), got {text}")
    return value


non_negative_float = _number(float, 0.0, False, "a finite number >= 0")


def add_attention_argument(p) -> None:
    """``--attention``: how a built-in model computes attention."""
    p.add_argument(
        "--attention",
        choices=["materialized", "fused"],
        help="a built-in model's attention: materialized (default; the s x s probabilities are a tensor a policy "
        "keeps or recomputes) or fused (jax.nn.dot_product_attention; none kept for the backward)",
    )


def add_target_argument(p, what: str) -> None:
    """``--target``: the accelerator a command compiles for (:mod:`jaxmem.targets`)."""
    p.add_argument(
        "--target",
        metavar="TARGET",
        help=f"the accelerator {what}: h100, tpu-v5e, tpu-v5p, tpu-v6e or tpu-v4, with :COUNT or :TOPOLOGY "
        "(h100:16, tpu-v5p:4x4x4), compiled for here with no device present (pip install 'jaxmem[cuda]' or "
        "'jaxmem[tpu]'); or cpu, the devices at hand (default). Its hardware profile is --hardware's",
    )


def model_overrides(args) -> dict:
    """The model config fields the model flags set (``--dtype``, ``--param-dtype``, ``--attention``)."""
    fields = {"dtype": "dtype", "param_dtype": "param_dtype", "attention": "attention"}
    return {k: getattr(args, v) for k, v in fields.items() if getattr(args, v, None)}


def add_mesh_arguments(p) -> None:
    """``--data-parallel``, ``--fsdp``, ``--tensor``, ``--mesh``, ``--no-zero`` and ``--no-vocab-split`` (with
    ``--pipe``, which the command adds itself): the mesh of a command that builds one step, as
    ``jaxmem train`` takes it."""
    p.add_argument(
        "--data-parallel", type=positive_int, help="data-parallel replicas holding whole parameters (default 1)"
    )
    p.add_argument(
        "--fsdp", type=positive_int, help="data-parallel replicas sharding every parameter (FSDP; default 1)"
    )
    p.add_argument(
        "--context",
        type=positive_int,
        help="devices holding part of every sequence (context parallelism for long sequences: two of its "
        "2 x context chunks each, attention gathering the others' keys and values; the sequence length must be "
        "a multiple of 2 x context; default 1)",
    )
    p.add_argument(
        "--tensor",
        type=positive_int,
        help="devices computing each microbatch together, cutting the dimensions the model's annotations "
        "name (tensor parallelism; default 1)",
    )
    p.add_argument(
        "--mesh",
        metavar="AXES",
        help="e.g. data=2,fsdp=2,pipe=2,context=2,tensor=2 (sets --data-parallel, --fsdp, --pipe, --context, --tensor)",
    )
    p.add_argument(
        "--no-zero",
        dest="zero",
        action="store_false",
        help="keep the optimizer state whole on every replica (default: sharded over them, ZeRO)",
    )
    p.add_argument(
        "--no-vocab-split",
        dest="vocab_split",
        action="store_false",
        help="keep the token embedding and the head whole on every pipe rank (default: split by vocabulary rows)",
    )


def mesh_settings(mesh: str, args) -> dict[str, int]:
    """A ``--mesh`` text as the settings it sets (``data_parallel``, ``fsdp``, ``pipe``, ``tensor``),
    refusing one that ``args`` also sets by its own flag."""
    from jaxmem.cli._flags import flag
    from jaxmem.config import MESH_FIELDS, parse_mesh

    sizes = {}
    for name, size in parse_mesh(mesh).items():
        field = MESH_FIELDS[name]
        if getattr(args, field, None) is not None:
            raise JaxmemError(f"--mesh sets {name}; drop {flag(field)} (or --mesh)")
        sizes[field] = size
    return sizes


def resolve_mesh(args, pipe: int = 4) -> None:
    """Fold ``--mesh`` into ``args.data_parallel``, ``args.fsdp``, ``args.pipe`` and ``args.tensor`` (refusing a flag
    that says the same twice) and fill the defaults (``pipe`` ranks)."""
    if getattr(args, "mesh", None):
        for field, size in mesh_settings(args.mesh, args).items():
            setattr(args, field, size)
    args.data_parallel = args.data_parallel or 1
    args.fsdp = args.fsdp or 1
    args.tensor = args.tensor or 1
    args.context = args.context or 1
    args.pipe = args.pipe or pipe


def no_accelerator_here() -> bool:
    """Whether this machine shows no accelerator: no TPU chip among its PCI devices (Google's vendor
    id, as JAX's own check reads it), no NVIDIA or AMD device file. Read without importing JAX."""
    from jaxmem.targets import tpu_chips_here

    if tpu_chips_here():
        return False
    return not any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def prefer_cpu_when_alone() -> None:
    """On a machine with no accelerator, JAX starts on the CPU only (``JAX_PLATFORMS=cpu``, unless the
    environment sets it): with a target's compiler installed (``jaxmem[tpu]``), JAX would otherwise try
    to start a TPU runtime first, which prints several lines of start-up errors and takes seconds
    before falling back to the CPU. Compiling for a target needs no runtime (:mod:`jaxmem.targets`)."""
    if "JAX_PLATFORMS" not in os.environ and "jax" not in sys.modules and no_accelerator_here():
        os.environ["JAX_PLATFORMS"] = "cpu"


# XLA's CPU client starts 4,096 virtual devices in 11 s here; with 100,000 it crashed the process.
MAX_VIRTUAL_DEVICES = 4096


def setup_devices(count: int | None) -> None:
    """Ask XLA for ``count`` virtual CPU devices, before JAX is imported.

    On a GPU/TPU machine the flag only affects the (unused) host platform, so the same command uses
    the real accelerators there. If JAX is already imported the flag cannot take effect; callers
    then check the device count and explain. On a machine without an accelerator, more than
    :data:`MAX_VIRTUAL_DEVICES` are refused (compile for a target's devices instead: ``--target``).
    """
    if count is not None and count > MAX_VIRTUAL_DEVICES and no_accelerator_here():
        raise JaxmemError(
            f"{count:,} devices asked for, and this machine has no accelerator: at most {MAX_VIRTUAL_DEVICES:,} "
            "virtual CPU devices can be made here. Use fewer (a smaller mesh), or plan and compile for the "
            "accelerator's devices with --target (e.g. --target tpu-v5p:8x8x8)"
        )
    if count is None or "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # a count the user set stays
        os.environ["XLA_FLAGS"] = with_host_devices(flags, count)


# The variables by which a cluster launcher tells each process it started who it is (JAX's own
# cluster detection, jax._src.clusters, reads the same ones to find the coordinator and the ranks).
_CLUSTERS = {
    "SLURM": ("SLURM_NTASKS", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")),
    "Open MPI": ("OMPI_COMM_WORLD_SIZE", ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_RANK")),
}


def cluster_job() -> tuple[str, int] | None:
    """The cluster launcher that started this process as one of several (its name and the number
    of processes), or None. ``JAXMEM_DISTRIBUTED=0`` opts out (run as one process anyway)."""
    if os.environ.get("JAXMEM_DISTRIBUTED") == "0":
        return None
    for name, (count, others) in _CLUSTERS.items():
        if count in os.environ and all(v in os.environ for v in others):
            try:
                processes = int(os.environ[count])
            except ValueError:
                continue
            if processes > 1:
                return name, processes
    return None


def maybe_initialize_distributed() -> None:
    """Join a multi-process JAX job when launched as one: by ``jaxmem launch`` (its own variables),
    or by a cluster launcher JAX detects (``srun`` under SLURM, ``mpirun`` of Open MPI), with JAX's
    auto-detection of the coordinator, the process count and this process's rank."""
    import jax

    if os.environ.get("JAXMEM_COORDINATOR"):
        if os.environ.get("JAXMEM_NUM_PROCESSES") == "1":
            # A job of one process (a recovery onto the last survivor) runs alone: joined, XLA:CPU ran
            # its own devices' collectives through gloo, 7x slower a step on pipe 2.
            return
        # The coordination service (process 0) listens on the job's own address only (loopback for
        # `jaxmem launch`), not on every interface: it is an unauthenticated gRPC service.
        jax.distributed.initialize(
            coordinator_address=os.environ["JAXMEM_COORDINATOR"],
            coordinator_bind_address=os.environ["JAXMEM_COORDINATOR"],
            num_processes=int(os.environ["JAXMEM_NUM_PROCESSES"]),
            process_id=int(os.environ["JAXMEM_PROCESS_ID"]),
            heartbeat_timeout_seconds=int(os.environ.get("JAXMEM_HEARTBEAT_SECONDS", "100")),
            initialization_timeout=120,
        )
        return
    job = cluster_job()
    if job is None:
        return
    name, processes = job
    print(f"jaxmem: joining a {name} job of {processes} processes (set JAXMEM_DISTRIBUTED=0 to run alone)",
          file=sys.stderr)  # fmt: skip
    try:
        jax.distributed.initialize(initialization_timeout=int(os.environ.get("JAXMEM_INIT_TIMEOUT", "300")))
    except Exception as e:  # noqa: BLE001 -- JAX raises bare RuntimeError/XlaRuntimeError here
        raise JaxmemError(
            f"could not join the {name} job of {processes} processes: {first_line(e)}. Check that every task "
            "runs jaxmem and can reach the first node, or set JAXMEM_DISTRIBUTED=0 to run as one process"
        ) from None


def print_json(record) -> None:
    print(json.dumps(record, indent=2, default=str))
