"""Test harness: 8 virtual CPU devices (set before JAX is imported), a compilation cache shared by the
session's processes, hypothesis profiles, and the cores to itself for a test marked ``alone``."""

import atexit
import fcntl
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compile time dominates this suite: many tests (and the workers and CLI runs they start as
# subprocesses, which inherit these variables) compile the same tiny programs. A persistent cache,
# fresh for each session, compiles each once. memory_analysis() of a cached executable equals the
# freshly compiled one's (the ledger tests read it).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxmem-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# The suite runs in two xdist workers (pyproject.toml). A test that times programs against each other
# is marked `alone`: it takes this lock exclusively, every other test takes it shared, so the other
# worker's tests wait while it runs (module fixtures, set up before the lock, may still overlap).
if "JAXMEM_TEST_LOCK" not in os.environ:
    _fd, _lock = tempfile.mkstemp(prefix="jaxmem-test-lock-")
    os.close(_fd)
    atexit.register(os.unlink, _lock)
    os.environ["JAXMEM_TEST_LOCK"] = _lock

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(autouse=True)
def _cores(request):
    with open(os.environ["JAXMEM_TEST_LOCK"]) as lock:
        alone = request.node.get_closest_marker("alone") is not None
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
