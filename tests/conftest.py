"""Test harness: 8 virtual CPU devices (set before JAX is imported), a compilation cache shared by the
session's processes, hypothesis profiles."""

import atexit
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

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
