"""Compiled figures kept on disk: a working set the ledger compiled once is read back, in this process
and in the next, instead of compiled again.

The ledger's figures for a stage come from compiling its backward alone (:meth:`ModelFacts._working`);
a plan compiles dozens to hundreds of them, and for an accelerator's compiler (``--target``) most of
its time is spent there. The same programs come back: ``jaxmem plan`` and then ``jaxmem train --plan
auto`` of the same model search the same candidates, and a second plan under another budget prices
the same stages. The figure is a function of the program and of the compiler that built it, so it is
kept under a key that holds both: the lowered program's text (shapes, dtypes, shardings, memory
kinds, custom calls), the compile options, what it was compiled for (platform, device kind, target),
the compiler's packages (jax, jaxlib, libtpu, the CUDA plugin) and the flags they read from the
environment. Nothing but the figure is kept -- never an executable (see ``tests/conftest.py`` for why
jaxmem does not use JAX's own compilation cache here).

Where: ``$JAXMEM_CACHE_DIR`` (``off`` or empty: no cache), else ``$XDG_CACHE_HOME/jaxmem`` or
``~/.cache/jaxmem``; one small JSON file per figure under ``working-sets/``, written whole or not at
all (safe between processes). Delete the directory to forget them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable

__all__ = ["cache_dir", "cached_figure", "compiler_identity"]

_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_ACCELERATOR_TYPE")
_PACKAGES = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def cache_dir() -> str | None:
    """Where compiled figures are kept (None: nowhere, ``JAXMEM_CACHE_DIR=off``)."""
    where = os.environ.get("JAXMEM_CACHE_DIR")
    if where is not None:
        return None if where.strip().lower() in ("", "off", "none", "0") else where
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxmem")


@functools.cache
def _versions() -> str:
    from importlib import metadata

    found = []
    for name in _PACKAGES:
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ",".join(found)


def compiler_identity() -> str:
    """The compiler's packages and the flags they read from the environment: part of every key."""
    return _versions() + ";" + ";".join(f"{name}={os.environ.get(name, '')}" for name in _ENV)


def _key(program: str, options, where: str) -> str:
    digest = hashlib.sha256()
    for part in (program, repr(sorted((options or {}).items())), where, compiler_identity()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def cached_figure(lowered, options, where: str, compute: Callable[[], float]) -> float:
    """``compute()`` -- a figure of compiling ``lowered`` with ``options`` for ``where`` (the platform,
    device kind and target) -- read from the cache when it was computed before, else computed and
    kept. A cache that cannot be read or written is passed over (the figure is computed)."""
    root = cache_dir()
    if root is None:
        return compute()
    folder = os.path.join(root, "working-sets")
    path = os.path.join(folder, _key(lowered.as_text(), options, where) + ".json")
    try:
        with open(path) as f:
            return float(json.load(f)["figure"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    figure = float(compute())
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"figure": figure, "where": where}, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return figure
