"""Test harness: 8 virtual CPU devices (set before JAX is imported), XLA:CPU's faster-compiling
backend level and fusion code generator, no persistent compilation cache (jaxmem's cache of compiled
figures one per run), hypothesis profiles, and the cores to itself for a test's timed section
(``cores.alone()``)."""

import atexit
import fcntl
import os
import tempfile


def _default_flag(flag: str) -> None:
    """Add ``--name=value`` to XLA_FLAGS unless the environment already sets ``--name``."""
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


# LLVM at -O0: XLA:CPU's backend compile of the suite's programs takes about half as long (the tiny
# GPT's train step: 12.7 s -> 5.7 s), while what the tests check -- results, gradients, the compiled
# memory_analysis() (equal at either level) -- does not depend on it. Programs run slower: the test
# that times programs against each other runs them in a subprocess at XLA's default level, as do the
# benchmarks.
_default_flag("--xla_backend_optimization_level=0")
# XLA:CPU's older fusion code generator: most of a compile here is the newer MLIR fusion emitters'
# (perf: FusionCompiler::Compile). Without them the suite runs in 16:30 instead of 27:01, and
# `python benchmarks/compile_flags.py` (record results/compile_flags.json) compiles the planner's 36
# Llama stage backwards in 5.4 s instead of 19.6 s at -O0 alone (33 s at XLA's defaults), a ZBV
# train step in 1.4 s instead of 2.4 s. Their temporaries are not the same to the byte: the step's
# 64 bytes more of 12.7 MB; of the stage backwards 12 equal, 32 within 0.1%, the largest 15% more.
# So the tests compare the ledger with programs compiled under the same flags, never with figures
# compiled elsewhere.
_default_flag("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# No persistent compilation cache: on XLA:CPU (jaxlib 0.10.2) an executable loaded back from it
# can deadlock when a lax.switch branch holds collectives (rendezvous.cc "Termination timeout ... all
# reduce" on one device, "collective permute" on the other, then abort). A script verifying one
# program twice, the second a cache hit, aborted in 8 of 24 runs; 126 verify() runs without the
# cache, none. The suite took the same time with it (12:57) as without (12:55).
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

# jaxmem's own cache of compiled working-set figures (jaxmem.memory._figures): one per run of the
# suite, shared by its workers and the processes its tests start -- never a user's ~/.cache or
# JAXMEM_CACHE_DIR, so every run compiles what it checks at least once.
if "JAXMEM_TEST_FIGURES" not in os.environ:
    import shutil

    os.environ["JAXMEM_TEST_FIGURES"] = tempfile.mkdtemp(prefix="jaxmem-figures-")
    atexit.register(shutil.rmtree, os.environ["JAXMEM_TEST_FIGURES"], True)
os.environ["JAXMEM_CACHE_DIR"] = os.environ["JAXMEM_TEST_FIGURES"]

# The suite runs in two xdist workers (pyproject.toml). Every test holds a lock shared; a test that
# times programs against each other holds it exclusively for its timed section only (``cores.alone()``),
# so the other workers' tests wait while it times, not while it compiles. A second lock is the gate:
# tests pass it to start, and a timed section closes it first, so it does not wait for ever while
# other workers' tests keep starting.
for _name in ("JAXMEM_TEST_LOCK", "JAXMEM_TEST_GATE"):
    if _name not in os.environ:
        _fd, _path = tempfile.mkstemp(prefix=f"{_name.lower()}-")
        os.close(_fd)
        atexit.register(os.unlink, _path)
        os.environ[_name] = _path

import contextlib  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


class _Cores:
    def __init__(self, lock, gate):
        self._lock, self._gate = lock, gate

    @contextlib.contextmanager
    def alone(self):
        """The machine's cores to this test: no other test starts, the running ones end first."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            fcntl.flock(self._gate, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def cores():
    with open(os.environ["JAXMEM_TEST_LOCK"]) as lock, open(os.environ["JAXMEM_TEST_GATE"]) as gate:
        fcntl.flock(gate, fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield _Cores(lock, gate)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
