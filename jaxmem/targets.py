"""Compile targets: the accelerator a program is compiled for, from this machine, with no device present.

JAX compiles ahead of time for a machine it does not have: ``jax.experimental.topologies`` gives the
devices of a TPU slice (through ``libtpu``) or of NVIDIA GPUs (through the CUDA plugin and a
description of the GPU), and ``jax.jit(...).lower(...).compile()`` on a mesh of them runs that
target's own compiler -- its layouts, its fusion, its buffer assignment -- and answers
``memory_analysis()`` as the target would. jaxmem's byte figures for an accelerator come from there:
the ledger's working sets, ``jaxmem memory --compile yes``, the planner's checks of its picks.

A target is named as a hardware profile is (:data:`jaxmem.memory.HARDWARE`; the two are one name):
``h100``, ``tpu-v5e``, ``tpu-v5p``, ``tpu-v6e``, ``tpu-v4``, with a device count or a topology
(``h100:16`` is two hosts of eight, ``h100:2x8`` the same; ``tpu-v5p:4x4x4``, ``tpu-v5e:16``), or
``cpu``: the devices at hand. A count picks the smallest slice that holds it; a mesh of fewer
devices than the slice takes its first ones.

What a compile-only target cannot tell:

- A deviceless GPU compile does no autotuning: GEMMs get XLA's default tiles, and a kernel's
  temporaries may differ a little from an autotuned run.
- The H100's compile-only devices list no memory kinds (jax 0.10.2): an array placed in host memory
  between steps (weights, optimizer state) cannot be described there; jaxmem refuses such policies
  on that target (:func:`host_memory_kinds`) instead of compiling them as if on device. Host memory
  inside a program (an offloaded stash) compiles.
- Which bytes are "the program's": on TPU the compiler checks ``peak_memory_in_bytes`` against the
  chip's HBM (its out-of-memory error quotes that figure), and ``temp_size_in_bytes`` leaves out
  temporaries it keeps elsewhere; on GPU and CPU the arguments, temporaries and outputs less what
  outputs alias are the buffers the program allocates (:func:`jaxmem.memory.compiled_bytes`).
- A TPU program that holds host buffers (an offloaded stash) has no device-only peak in
  ``memory_analysis()``, and its peak less its host buffers can be under the device's bytes: a
  loop writing 64 MiB into a host arena and reading it back, with 20 MiB of device arguments and a
  few MiB of device temporaries, peaks at 84 MiB (arguments + host arena; its buffer assignment
  allocates 24.2 MiB in HBM), one with an 8 MiB arena at 48 (its device side). So jaxmem's compiled
  figure for such a TPU program is a lower bound; where the stash is small beside the rest (the tiny
  GPT) the buffer assignment shows the offloaded step allocating no less HBM than the kept one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import tempfile

from jaxmem._errors import JaxmemError
from jaxmem._util import first_device, platform_of

__all__ = [
    "TARGETS",
    "Target",
    "TargetKind",
    "h100_target_config",
    "host_memory_kinds",
    "layout_bytes",
    "parse_target",
    "platform_of",
    "tpu_chips_here",
]


@dataclasses.dataclass(frozen=True)
class TargetKind:
    """One kind of accelerator jaxmem compiles for.

    Attributes:
        name: the target's (and its hardware profile's) name.
        platform: JAX's platform name of its devices: ``tpu``, ``gpu`` or ``cpu``.
        extra: the jaxmem extra that installs its compiler (``pip install 'jaxmem[EXTRA]'``).
        tpu_version: the TPU generation as libtpu names it (``v5e``), for TPU targets.
        shapes: the slice shapes a device count is rounded up to, smallest first (TPU targets).
        per_host: devices per host (GPU targets: one host is one node of the fast link).
    """

    name: str
    platform: str
    extra: str | None = None
    tpu_version: str | None = None
    shapes: tuple[str, ...] = ()
    per_host: int = 8


_TPU_2D = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")  # v5e, v6e slices (a host is 2x2)
_TPU_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16", "16x16x16")

TARGETS: dict[str, TargetKind] = {
    "cpu": TargetKind(name="cpu", platform="cpu"),
    "h100": TargetKind(name="h100", platform="gpu", extra="cuda", per_host=8),
    "tpu-v5e": TargetKind(name="tpu-v5e", platform="tpu", extra="tpu", tpu_version="v5e", shapes=_TPU_2D),
    "tpu-v5p": TargetKind(name="tpu-v5p", platform="tpu", extra="tpu", tpu_version="v5p", shapes=_TPU_3D),
    "tpu-v6e": TargetKind(name="tpu-v6e", platform="tpu", extra="tpu", tpu_version="v6e", shapes=_TPU_2D),
    "tpu-v4": TargetKind(name="tpu-v4", platform="tpu", extra="tpu", tpu_version="v4", shapes=_TPU_3D),
}


# The H100 SXM5 80GB as XLA's GPU compiler reads a device (stream_executor's GpuDeviceInfoProto, text
# form). Each figure is a published fact of the part:
# - compute capability 9.0, 132 SMs, 128 FP32 cores per SM, 50 MB of L2, 228 KB of shared memory per SM
#   of which a block may opt in to 227 KB, 65,536 32-bit registers per SM, 2,048 threads per SM:
#   NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), tables 2-3 and "H100 SM Architecture";
# - 1,024 threads per block, warps of 32, 48 KB of shared memory per block without opt-in, grid limits
#   2^31-1 x 65,535 x 65,535: CUDA C++ Programming Guide, "Compute Capabilities" (9.0);
# - 3.35 TB/s of HBM3 bandwidth, 1.98 GHz boost clock, 80 GB of memory: the H100 SXM5 datasheet.
# The memory size is written as the 80 GiB of its five 16 GiB stacks; CUDA reports a little less
# usable. The cuDNN version is the installed one's (nvidia-cudnn-cu12), or the least jax 0.10.2
# takes (9.8): XLA picks its fused-attention lowering by it.
_H100_CONFIG = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3350000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85899345920
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: 9
    minor: 0
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {cudnn_major}
  minor: {cudnn_minor}
}}
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def h100_target_config() -> str:
    """The H100's ``GpuTargetConfig`` text (see the comment above :data:`_H100_CONFIG` for sources)."""
    major, minor = 9, 8
    try:
        from importlib.metadata import version

        parts = version("nvidia-cudnn-cu12").split(".")
        major, minor = int(parts[0]), int(parts[1])
    except Exception:  # noqa: BLE001 -- not installed, or an unusual version string: the least jax takes
        pass
    return _H100_CONFIG.format(cudnn_major=major, cudnn_minor=minor)


@dataclasses.dataclass(frozen=True)
class Target:
    """A target: its kind and how many devices (``count``; None: as many as the program's mesh needs)
    or which slice (``shape``: ``4x4x4`` on TPU, ``HOSTSxPER_HOST`` on GPU).

    >>> parse_target("h100:16")
    Target(kind='h100', count=16, shape='2x8')
    >>> parse_target("tpu-v5p:4x4x4").topology_name()
    'v5p:4x4x4'
    """

    kind: str
    count: int | None = None
    shape: str | None = None

    @property
    def spec(self) -> TargetKind:
        return TARGETS[self.kind]

    @property
    def name(self) -> str:
        """The hardware profile's name (``h100``, ``tpu-v5e``, ...)."""
        return self.kind

    @property
    def platform(self) -> str:
        return self.spec.platform

    @property
    def compile_only(self) -> bool:
        """Compiled for, not run on: every target but ``cpu``."""
        return self.kind != "cpu"

    def __str__(self) -> str:
        if self.shape is not None and self.spec.platform == "tpu":
            return f"{self.kind}:{self.shape}"
        return self.kind if self.count is None else f"{self.kind}:{self.count}"

    def with_devices(self, count: int) -> Target:
        """This target holding at least ``count`` devices (its own count and shape when they do)."""
        if self.count is not None and self.count >= count:
            return self
        if self.kind == "cpu":
            return dataclasses.replace(self, count=count)
        return parse_target(f"{self.kind}:{count}")

    def topology_name(self) -> str:
        """What ``jax.experimental.topologies`` calls this slice (``v5e:4x4``, or ``1xHOSTSxPER_HOST``
        on GPU)."""
        spec = self.spec
        if spec.platform == "tpu":
            return f"{spec.tpu_version}:{self.shape or spec.shapes[0]}"
        if spec.platform == "gpu":
            hosts, per_host = (int(x) for x in (self.shape or "1x1").split("x"))
            return f"1x{hosts}x{per_host}"
        raise JaxmemError("the cpu target has no topology: it is the devices at hand")

    def devices(self, count: int | None = None) -> list:
        """The target's devices (compile-only for an accelerator), at least ``count`` of them: a
        larger slice than this target's is built when needed. Refused in one line when the target's
        compiler is not installed."""
        target = self if count is None else self.with_devices(count)
        if target.kind == "cpu":
            import jax

            devices = jax.devices("cpu")
            need = count or target.count or 0
            if need > len(devices):
                raise JaxmemError(
                    f"the cpu target has {len(devices)} devices here, {need} needed; start with more virtual "
                    f"devices (XLA_FLAGS=--xla_force_host_platform_device_count={need}) or plan for fewer"
                )
            return devices
        return list(_compile_only_devices(target.kind, target.topology_name()))

    def tiled_bytes(self, arrays) -> list[int]:
        """Per array ``(shape, dtype name)``, its bytes as the target lays it out in memory: on TPU
        the layout its compiler gives such an argument (the two most minor dimensions padded to a
        tile such as 8 x 128, a scalar or a short vector to a whole one), read from a program that
        takes them; elsewhere its elements' bytes."""
        if self.platform != "tpu":
            return [math.prod(shape) * _itemsize(dtype) for shape, dtype in arrays]
        keys = [(tuple(int(n) for n in shape), str(dtype)) for shape, dtype in arrays]
        missing = sorted({k for k in keys if (self.kind, k) not in _TILED})
        if missing:
            _read_tiles(self, missing)
        return [_TILED[(self.kind, k)] for k in keys]


_TILED: dict = {}  # (target kind, (shape, dtype)) -> bytes as the TPU lays the array out


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def _read_tiles(target: Target, keys) -> None:
    """Lay ``keys`` out as the TPU does: compile a program taking one array of each (a few hundred at
    a time) for one of the target's devices, and read each argument's tiling from its layout."""
    import jax
    import jax.numpy as jnp

    device = target.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    for start in range(0, len(keys), 256):
        chunk = keys[start : start + 256]
        args = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding) for shape, dtype in chunk]
        compiled = jax.jit(lambda *a: a).lower(*args).compile()
        formats = compiled.input_formats[0]
        for (shape, dtype), fmt in zip(chunk, formats):
            _TILED[(target.kind, (shape, dtype))] = layout_bytes(shape, dtype, fmt.layout)


def layout_bytes(shape, dtype: str, layout) -> int:
    """Bytes of an array of ``shape`` under a TPU layout: its dimensions in the layout's major-to-minor
    order, the most minor ones rounded up to the layout's first tile (a scalar is a vector of one)."""
    itemsize = _itemsize(dtype)
    dims = [shape[d] for d in layout.major_to_minor] if shape else [1]
    tiling = tuple(layout.tiling or ())
    if tiling:
        tile = tiling[0]
        for i, t in enumerate(tile, start=len(dims) - len(tile)):
            if i >= 0:
                dims[i] = -(-dims[i] // t) * t
    return math.prod(dims) * itemsize


def parse_target(text: str | Target | None) -> Target | None:
    """A target from its name (see the module docstring); None for None.

    >>> parse_target("tpu-v5e:16"), parse_target("cpu")
    (Target(kind='tpu-v5e', count=16, shape='4x4'), Target(kind='cpu', count=None, shape=None))
    """
    if text is None or isinstance(text, Target):
        return text
    name, _, size = str(text).strip().lower().partition(":")
    if name not in TARGETS:
        raise JaxmemError(
            f"unknown target {text!r}; targets: {', '.join(TARGETS)} (with :COUNT or :TOPOLOGY, e.g. h100:16, "
            "tpu-v5p:4x4x4)"
        )
    spec = TARGETS[name]
    if not size:
        return Target(name)
    if spec.platform == "cpu":
        if not size.isdigit() or int(size) < 1:
            raise JaxmemError(f"target {text!r}: cpu takes a device count, e.g. cpu:8")
        return Target(name, count=int(size))
    if size.isdigit():
        count = int(size)
        if count < 1:
            raise JaxmemError(f"target {text!r}: the device count must be >= 1")
        if spec.platform == "gpu":
            per_host = spec.per_host
            if count > per_host and count % per_host:
                raise JaxmemError(
                    f"target {text!r}: {count} GPUs do not fill hosts of {per_host}; give a multiple of {per_host} "
                    f"(or at most {per_host})"
                )
            hosts = max(1, count // per_host)
            return Target(name, count=count, shape=f"{hosts}x{min(count, per_host)}")
        return Target(name, count=count, shape=_tpu_shape(spec, count, text))
    if not re.fullmatch(r"[0-9]+(x[0-9]+)+", size):
        raise JaxmemError(f"target {text!r}: after ':' give a device count (16) or a topology (4x4x4)")
    dims = [int(x) for x in size.split("x")]
    if spec.platform == "gpu":
        if len(dims) != 2 or min(dims) < 1 or dims[1] > spec.per_host:
            raise JaxmemError(f"target {text!r}: a GPU topology is HOSTSxGPUS_PER_HOST, at most {spec.per_host} a host")
        return Target(name, count=dims[0] * dims[1], shape=size)
    wanted = len(spec.shapes[0].split("x"))
    if len(dims) != wanted:
        example = spec.shapes[min(2, len(spec.shapes) - 1)]
        raise JaxmemError(
            f"target {text!r}: a {name} slice has {wanted} dimensions, e.g. {name}:{example}; slices: "
            f"{', '.join(spec.shapes)}"
        )
    return Target(name, count=math.prod(dims), shape=size)


def _tpu_shape(spec: TargetKind, count: int, text) -> str:
    """The smallest standard slice of ``spec`` with at least ``count`` chips."""
    for shape in spec.shapes:
        if math.prod(int(x) for x in shape.split("x")) >= count:
            return shape
    raise JaxmemError(f"target {text!r}: more chips than the largest {spec.name} slice ({spec.shapes[-1]})")


def _require_extra(kind: str) -> None:
    """Refuse, in one line, a target whose compiler is not installed."""
    spec = TARGETS[kind]
    if spec.platform == "tpu":
        missing = [] if _has_module("libtpu") else ["libtpu"]
    else:
        missing = [
            package
            for module, package in (
                ("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
                ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12"),
            )
            if not _has_module(module)
        ]
    if missing:
        raise JaxmemError(
            f"target {kind} compiles with {spec.platform.upper()} XLA, which needs {' and '.join(missing)}: "
            f"pip install 'jaxmem[{spec.extra}]'"
        )


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """The C++ libraries' start-up lines (libtpu asking for the TPU VM's metadata this machine does not
    have) kept off the terminal: stderr goes to a file for the block, and is shown when the block fails."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            text = captured.read().decode(errors="replace").strip()
            if text:
                print(text[-4000:], file=sys.stderr)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def tpu_chips_here() -> bool:
    """Whether a TPU chip is among this machine's PCI devices (Google's vendor id, as JAX reads it)."""
    import glob

    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == "0x1ae0":
                    return True
        except OSError:
            continue
    return False


@functools.lru_cache(maxsize=16)
def _compile_only_devices(kind: str, topology: str) -> tuple:
    _require_extra(kind)
    from jax.experimental import topologies

    spec = TARGETS[kind]
    if spec.platform == "tpu" and not tpu_chips_here():
        # libtpu lets one process at a time load it (a lock file in /tmp), for the chips it would drive;
        # compiling for chips that are not here drives none, so processes compiling at once (a test
        # suite's workers, a planner beside a run) need not wait for each other.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with _quiet_stderr():
            if spec.platform == "tpu":
                described = topologies.get_topology_desc(topology, "tpu")
            else:
                described = topologies.get_topology_desc(
                    platform="cuda", target_config=h100_target_config(), topology=topology
                )
    except JaxmemError:
        raise
    except Exception as e:  # noqa: BLE001 -- the plugins raise RuntimeError / XlaRuntimeError / NotImplementedError
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise JaxmemError(
            f"could not describe the {kind} devices of {topology!r} ({type(e).__name__}: {first}); check that "
            f"'jaxmem[{spec.extra}]' is installed for this jax release"
        ) from None
    return tuple(described.devices)


def host_memory_kinds(devices) -> bool:
    """Whether ``devices`` can hold arrays in host memory (``pinned_host``) between programs. The
    H100's compile-only devices list no memories at all (jax 0.10.2), so an array placed there is
    compiled as if on device."""
    try:
        kinds = {m.kind for m in first_device(devices).addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memories raises
        return False
    return "pinned_host" in kinds
