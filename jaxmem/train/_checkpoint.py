"""Checkpoints: Orbax CheckpointManager with async saves, keep-last-K, the whole train state in one
atomic step, and a per-array checksum manifest saved inside that same step.

A step holds whatever tree it is given; a trainer gives its state as it holds it, sharded, and reads
it back onto any mesh through a :class:`StateReader` (:mod:`jaxmem.train._state_io`): nothing is
gathered onto one device to save or restore. Checksums are computed where each array lives, shard by
shard (:func:`array_checksums`). Orbax writes a step into a temporary directory and renames it when
complete, so a save killed mid-way is never listed; temporary leftovers are removed when the manager
opens the directory.

Guarantees a resumed run relies on:
- one writer: process 0 holds an exclusive ``flock`` on ``.jaxmem.lock`` in the directory for the
  run's life (the kernel releases it when the process dies, however it dies); a second run on the
  same directory is refused, naming the holder's pid and host;
- verified restores: every step carries a checksum manifest (a step without one is refused), and
  each restored array is checked against it; a step saved by a different model or optimizer (names or
  shapes differ) is refused as such, before anything is read;
- failed saves stop the run at once: a background save that fails (disk full, permission, file-size
  limit) is reported at the next step, naming the cause and the last committed step, which is left
  intact (Orbax writes into a temporary directory and deletes old steps only after a save commits);
  before each save, free space below twice the step's size is warned about;
- fallback: with no step asked for, a latest step that fails verification is announced and the next
  older one is tried; the failing steps are then moved aside as ``<step>.damaged`` (kept, never
  deleted, and out of Orbax's keep-last-K garbage collection, which counts only good steps). Asking
  for an older step moves the newer ones aside as ``<step>.superseded`` (the run redoes them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import sys
import typing
import zlib
from pathlib import Path

import jax
import numpy as np

from jaxmem._errors import JaxmemError, first_line, setting
from jaxmem._util import hold_lock

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "SameArrays",
    "StateReader",
    "array_checksums",
    "committed_steps",
    "read_params",
]

MARKER = "jaxmem_checkpoints.json"
LOCK = ".jaxmem.lock"


class CheckpointError(JaxmemError):
    """A checkpoint directory or step cannot be used; says why and what to do."""


class CheckpointMismatch(CheckpointError):
    """A readable step that belongs to another model or optimizer (not damage: no fallback)."""


def _lock(directory: Path):
    """Hold an exclusive lock on ``directory`` while the returned file is open (closing it, or this
    process dying, releases it); refuse when another open file holds it."""

    def busy(holder):
        return CheckpointError(
            f"{directory} is in use by another jaxmem run ({holder}); two writers would corrupt it. Stop that "
            f"run, wait for it to finish, or pass another {setting('checkpoint_dir')}"
        )

    try:
        return hold_lock(directory / LOCK, busy)
    except OSError as e:
        raise CheckpointError(
            f"cannot write in the checkpoint folder {directory} ({e.strerror or e}); pass a writable "
            f"{setting('checkpoint_dir')} (its steps there are untouched)"
        ) from None


def _host_value(x) -> np.ndarray:
    """The full value of a (possibly multi-process) array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# The checksum of an array: a mixed hash of every element's bits and its position in the whole
# array, summed modulo 2**32. A sum does not care how the array is cut, so each device hashes its own
# shard, with no collective between devices, and the host adds the shards' sums (one copy of each
# replicated shard; across a job's processes, one small gather of every leaf's partial sum). Nothing
# is gathered, and the value read back onto another mesh checks against the value saved from this
# one. (Saves before the sharded checkpoints carry a CRC32 of the whole array's bytes instead,
# "crc32", still verified on restore.)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35


def _bits(x, xp):
    """The elements' bits as uint32 (narrower types widened; 8-byte types fold their two halves)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(xp.uint32)
    unsigned = {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint32}[dtype.itemsize]
    if xp is np:
        bits = x.view(np.dtype(unsigned)) if dtype.itemsize != 8 else x.view(np.uint32).reshape(*x.shape, 2)
    else:
        bits = jax.lax.bitcast_convert_type(x, unsigned)
    if dtype.itemsize == 8:
        return bits[..., 0] ^ (bits[..., 1] * xp.uint32(_GOLDEN))
    return bits.astype(xp.uint32)


def _position(shape, xp, start, whole):
    """Every element's flat (row-major) index in the whole array (shape ``whole``), modulo 2**32, for
    a block of ``shape`` that starts at index ``start`` of it."""
    index, stride = xp.zeros(shape, xp.uint32), 1
    for axis in reversed(range(len(shape))):
        if xp is np:
            along = np.arange(shape[axis], dtype=np.uint32).reshape([-1 if a == axis else 1 for a in range(len(shape))])
        else:
            along = jax.lax.broadcasted_iota(xp.uint32, shape, axis)
        along = along + xp.asarray(start[axis]).astype(xp.uint32)
        index = index + along * xp.uint32(stride % 2**32)
        stride *= whole[axis]
    return index


def _hash(x, xp, start=None, whole=None):
    """The sum of ``x``'s mixed element hashes, ``x`` being the block of an array of shape ``whole``
    (default: ``x`` is the whole array) that starts at ``start``."""
    start = (0,) * x.ndim if start is None else start
    h = _bits(x, xp) ^ (_position(x.shape, xp, start, x.shape if whole is None else whole) * xp.uint32(_GOLDEN))
    h = h * xp.uint32(_MIX1)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(_MIX2)
    h = h ^ (h >> xp.uint32(16))
    return xp.sum(h, dtype=xp.uint32)


def _to_device_memory(x):
    """Offloaded state comes to device memory for hashing, a shard on each of its devices."""
    if "host" in str(getattr(jax.typeof(x), "memory_space", "")).lower():
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _named_spec(x):
    """``x``'s partition spec, one entry per axis, if it is laid out by a NamedSharding (what
    shard_map takes; JAX refuses one that does not cut its axes evenly); else None."""
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


@functools.cache
def _sharded_hasher(sharding: jax.sharding.NamedSharding, spec: tuple):
    """A jitted program from an array laid out as ``sharding`` to its per-device block hashes, one
    uint32 per device of the mesh: each device hashes its own block, and no collective runs (an
    all-reduce over a leaf's devices used to add them; XLA:CPU aborted in it on rare runs). One leaf
    per program: XLA materialises a block's mixed bits before summing them, so a program over every
    leaf would hold all of those at once."""
    mesh = sharding.mesh
    P = jax.sharding.PartitionSpec

    def hashes(x):
        whole = x.shape

        def block_hash(block):
            start = []
            for d, entry in enumerate(spec):
                axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
                start.append(jax.lax.axis_index(axes) * block.shape[d] if axes else 0)
            return _hash(block, jax.numpy, start, whole).reshape((1,) * len(mesh.axis_names))

        mapped = jax.shard_map(block_hash, mesh=mesh, in_specs=P(*spec), out_specs=P(*mesh.axis_names), check_vma=False)
        return mapped(_to_device_memory(x))

    return jax.jit(hashes)


@functools.partial(jax.jit, static_argnums=2)
def _block_hash(block, start, whole):
    """One shard's hash, on its device, given where it starts in the whole array (any layout)."""
    return _hash(_to_device_memory(block), jax.numpy, start, whole)


def _leaf_hasher(x: jax.Array):
    """The program :func:`array_checksums` hashes a device array with, for inspecting it
    (``_leaf_hasher(x).lower(x)``), or None when the array is hashed one shard at a time."""
    spec = _named_spec(x)
    return None if spec is None else _sharded_hasher(x.sharding, spec)


def _partial_hash(x: jax.Array) -> int:
    """The sum of the hashes of this process's shards of ``x`` that are first copies (replica 0)."""
    first = {shard.device: shard for shard in x.addressable_shards if shard.replica_id == 0}
    hasher = _leaf_hasher(x)
    if hasher is not None:
        values = [int(np.asarray(s.data).reshape(())) for s in hasher(x).addressable_shards if s.device in first]
    else:  # a layout other than a NamedSharding (one device, ...): each shard through its device's program
        values = [
            int(_block_hash(s.data, tuple(np.uint32(i.start or 0) for i in s.index), x.shape)) for s in first.values()
        ]
    return sum(values) % 2**32


def array_checksums(tree) -> dict[str, dict]:
    """Per array (by its path): shape, dtype and a 32-bit hash of its elements and their positions,
    computed where the array lives (device arrays shard by shard on their devices, host arrays on the
    host); the same value whatever the array's sharding. In a job of several processes every process
    calls it (the processes' partial sums are gathered)."""
    named = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
    on_device = [i for i, (_, leaf) in enumerate(named) if isinstance(leaf, jax.Array)]
    partial = np.array([_partial_hash(named[i][1]) for i in on_device], dtype=np.uint32)
    spread = np.array([not named[i][1].is_fully_addressable for i in on_device], dtype=bool)
    if spread.any():  # arrays across processes: every process adds its shards' sum
        from jax.experimental import multihost_utils

        gathered = np.asarray(multihost_utils.process_allgather(partial)).reshape(-1, len(on_device))
        partial = np.where(spread, gathered.sum(axis=0, dtype=np.uint64) % 2**32, partial)
    hashes = dict(zip(on_device, (int(h) for h in partial), strict=True))
    out = {}
    for i, (name, leaf) in enumerate(named):
        if i in hashes:
            value = hashes[i]
        else:
            with np.errstate(over="ignore"):  # the mixing wraps modulo 2**32 by design
                value = int(_hash(np.asarray(leaf), np))
        out[name] = {"shape": list(leaf.shape), "dtype": str(np.dtype(leaf.dtype)), "hash": value}
    return out


def _legacy_crc32(value) -> int:
    """The CRC32 of an array's bytes, as steps saved before the sharded checkpoints recorded it."""
    return zlib.crc32(np.ascontiguousarray(_host_value(value)).tobytes())


@typing.runtime_checkable
class StateReader(typing.Protocol):
    """How a run reads a step whose arrays are not simply its own state's (another stage split, an
    older layout): ``expected(meta)`` gives the arrays as saved (abstract; their names and shapes are
    checked against the step's manifest before anything is read) and ``read(meta, fetch)`` builds the
    state, reading with ``fetch(tree, partial=False)`` (:meth:`Checkpointer._fetch`)."""

    def expected(self, meta: dict): ...

    def read(self, meta: dict, fetch): ...


class SameArrays:
    """The step holds exactly ``target``'s arrays (abstract, with the shardings to read them onto)."""

    def __init__(self, target):
        self.target = target

    def expected(self, meta: dict):
        return self.target

    def read(self, meta: dict, fetch):
        return fetch(self.target)


@dataclasses.dataclass
class Restored:
    step: int
    state: dict  # {"params": model-layout dict, "opt_state": ...}
    meta: dict  # step, seed, data position, plan


def _sync(name: str) -> None:
    """A barrier across the job's processes (nothing in a one-process job)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _manifest(step: int, meta: dict) -> dict:
    """A step's checksum manifest; a step without one cannot be verified and is refused."""
    manifest = meta.get("manifest")
    if not manifest:
        raise CheckpointError(f"step {step} has no checksum manifest, so it cannot be verified")
    return manifest


def _verify_checksums(step: int, manifest: dict, tree, key=lambda name: name) -> None:
    """Check every array of ``tree`` against ``manifest`` (names compared through ``key``)."""
    saved = {key(name): entry for name, entry in manifest.items()}
    legacy = any("crc32" in entry for entry in saved.values())
    got_all = (
        {
            jax.tree_util.keystr(p): {"shape": list(x.shape), "crc32": _legacy_crc32(x)}
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
        }
        if legacy
        else array_checksums(tree)
    )
    field = "crc32" if legacy else "hash"
    for name, got in got_all.items():
        want = saved.get(key(name))
        if want is None or got[field] != want.get(field) or got["shape"] != want["shape"]:
            raise CheckpointError(
                f"array {name} of step {step} does not match the checksum saved with it (a data file damaged or "
                "changed after saving)"
            )


def _write_failure(e: Exception) -> str:
    """The operating system's reason for a failed write (TensorStore names it by errno), else the
    error's first line."""
    code = getattr(e, "errno", None)
    if code is None:
        found = re.search(r"os_error_code='?(\d+)", str(e))
        code = int(found.group(1)) if found else None
    return f"{os.strerror(code)} (errno {code})" if code else first_line(e)


class _QuietOrbax(logging.Filter):
    """Drops Orbax's log records at ``level`` or above whose message holds one of ``texts`` (only
    those: Orbax's other records still show)."""

    def __init__(self, texts: tuple[str, ...], level: int):
        super().__init__()
        self.texts, self.level = texts, level

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno >= self.level
            and f"{os.sep}orbax{os.sep}" in record.pathname
            and any(text in str(record.msg) for text in self.texts)
        )


# Orbax logs a failed background save as several ERROR tracebacks from its threads; the Checkpointer
# reports that failure itself, in one line.
_QUIET = _QuietOrbax(
    ("raised an exception", "Handler Commit operations", "Save Finalize thread", "may not be finalized"), logging.ERROR
)
# Orbax warns that a read-only manager's directory is read only -- which ``read_params`` asked for.
_QUIET_READ_ONLY = _QuietOrbax(("Given directory is read only",), logging.WARNING)


class _QuietAftermath(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in str(record.msg)  # a Future's or a Task's


def _closed_loop(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)


def _quiet_aftermath() -> None:
    """After a failed write, TensorStore's other writes of that save still complete and fail alike:
    their callbacks find Orbax's event loop closed (each an unraisable exception's traceback, dozens
    of them) or their futures are dropped unread (asyncio logs each). The Checkpointer reports the
    failure once, in one line, so those (and only those) are dropped while one is open."""
    if getattr(sys.unraisablehook, "jaxmem_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _closed_loop(unraisable):
            previous(unraisable)

    hook.jaxmem_quiet = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_QUIET_AFTERMATH)


_QUIET_AFTERMATH = _QuietAftermath()


def _check_same_arrays(step: int, manifest: dict, target: dict) -> None:
    """Refuse a step whose arrays (names, shapes, dtypes) are not the ones ``target`` expects: saved by
    other settings -- said as such, before any array is read (a step read into other dtypes would
    fail its checksums as if it were damaged)."""
    leaves = jax.tree_util.tree_leaves_with_path(target)
    want = {jax.tree_util.keystr(p): list(leaf.shape) for p, leaf in leaves}
    saved = {name: entry["shape"] for name, entry in manifest.items()}
    if want == saved:
        dtypes = {jax.tree_util.keystr(p): str(np.dtype(leaf.dtype)) for p, leaf in leaves}
        differ = [
            f"{name}: saved {entry['dtype']}, this run {dtypes[name]}"
            for name, entry in manifest.items()
            if entry.get("dtype") and entry["dtype"] != dtypes[name]
        ]
        if differ:
            raise CheckpointMismatch(
                f"checkpoint step {step} was saved with other dtypes ({len(differ)} array(s) differ, e.g. "
                f"{differ[0]}): it was trained with another {setting('param_dtype')} or {setting('dtype')}. Resume "
                f"with the settings that trained it, or pass a new {setting('checkpoint_dir')} (jaxmem export "
                f"--format hf, then {setting('init_from')}, carries its weights over)"
            )
        return
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    both = sorted(set(want) & set(saved))
    shapes = [f"{n}: saved {saved[n]}, this run {want[n]}" for n in both if want[n] != saved[n]]
    detail = "; ".join(
        part
        for part in (
            f"{len(shapes)} shape(s) differ, e.g. {shapes[0]}" if shapes else "",
            f"{len(missing)} array(s) this run needs are not saved, e.g. {missing[0]}" if missing else "",
            f"{len(extra)} saved array(s) this run has no place for, e.g. {extra[0]}" if extra else "",
        )
        if part
    )
    raise CheckpointMismatch(
        f"checkpoint step {step} was saved by a different model or optimizer ({detail}). Resume with the "
        f"settings that trained it, or pass a new {setting('checkpoint_dir')}"
    )


def committed_steps(directory) -> list[int]:
    """The committed steps of a checkpoint directory, read from disk without opening it (no lock):
    Orbax renames a step's temporary directory to its number when the save is complete, so an
    in-flight or killed save is never listed, nor a step set aside as damaged or superseded."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


class Checkpointer:
    """Save and restore jaxmem train states in ``directory``.

    Args:
        directory: where steps are kept (created if missing; must be empty or a jaxmem checkpoint
            directory).
        every: save every N steps.
        keep: keep the last K steps.
        async_save: write in the background (the next save waits for the previous one).
        log: where warnings go (low free space before a save).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int = 10,
        keep: int = 3,
        async_save: bool = True,
        log=None,
    ):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.every = every
        self.keep = keep
        self.log = log or (lambda line: None)
        self._pending: int | None = None  # the step whose save may still be in flight
        self._check_directory()
        self._lock = _lock(self.directory) if jax.process_index() == 0 else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        # One handler for the state, whatever a call reads or writes (a manager keeps the first it sees).
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )
        logging.getLogger("absl").addFilter(_QUIET)  # idempotent: a filter is added once
        _quiet_aftermath()

    def _check_directory(self) -> None:
        marker = self.directory / MARKER
        if self.directory.exists():
            if not self.directory.is_dir():
                raise CheckpointError(f"checkpoint path {self.directory} is a file, not a directory")
            entries = [p for p in self.directory.iterdir() if p.name != MARKER]
            if entries and not marker.exists():
                raise CheckpointError(
                    f"{self.directory} is not a jaxmem checkpoint directory (it holds {len(entries)} other "
                    f"entries and no {MARKER}); pass an empty or new directory -- nothing was written"
                )
        if jax.process_index() == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                if not marker.exists():
                    marker.write_text(json.dumps({"format": "jaxmem", "version": 1}))
            except OSError as e:
                raise CheckpointError(
                    f"cannot write the checkpoint directory {self.directory}: {e.strerror or e}; "
                    f"pass a writable {setting('checkpoint_dir')}"
                ) from None

    # ------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: dict, meta: dict, force: bool = False) -> bool:
        """Save ``state`` (model layout) with ``meta`` at ``step`` (when due, or ``force``).

        Raises:
            CheckpointError: this save, or the previous one still in flight, failed.
        """
        import orbax.checkpoint as ocp

        if not force and not self.should_save(step):
            return False
        manifest = array_checksums(state)
        self._check_free_space(sum(leaf.nbytes for leaf in jax.tree.leaves(state)))
        payload = {**meta, "step": step, "manifest": manifest}
        self.wait()  # the previous save: a failure there is named as its own
        with self._reporting_failures(step):
            self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(payload)),
                force=True,
            )
        self._pending = step
        return True

    def poll(self) -> None:
        """Raise at once if a background save has failed (cheap; call it every step)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for a save in flight; raise :class:`CheckpointError` if it failed."""
        with self._reporting_failures(self._pending):
            self.manager.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Wait for a save in flight and release the directory (raises if that save failed; the
        directory is released either way)."""
        try:
            self.wait()
        finally:
            self.manager.close()
            if self._lock is not None:
                self._lock.close()  # releases the lock
                self._lock = None

    @contextlib.contextmanager
    def _reporting_failures(self, step: int | None):
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on write errors
            if isinstance(e, CheckpointError):
                raise
            self._pending = None
            committed = self.latest_step()
            kept = (
                f"the last committed step, {committed}, is intact and a rerun resumes from it"
                if committed is not None
                else "no step was committed yet"
            )
            what = "a checkpoint save" if step is None else f"saving checkpoint step {step}"
            raise CheckpointError(
                f"{what} to {self.directory} failed: {_write_failure(e)}. Training "
                f"stopped; {kept}. Free disk space, raise the file-size limit (ulimit -f) or fix the "
                "directory's permissions, then rerun"
            ) from None

    def _check_free_space(self, nbytes: int) -> None:
        if jax.process_index() != 0:
            return
        free = shutil.disk_usage(self.directory).free
        if free < 2 * nbytes:
            self.log(
                f"warning: {free / 2**20:.1f} MiB free on {self.directory}, and a checkpoint step takes about "
                f"{nbytes / 2**20:.1f} MiB (keeping {self.keep} steps); the save may fail. Free disk space or "
                f"pass another {setting('checkpoint_dir')}"
            )

    def __del__(self):  # a Checkpointer dropped without close() still releases its lock
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()

    # ------------------------------------------------------------------ restore
    def steps(self) -> list[int]:
        """Committed steps only (:func:`committed_steps`; the manager's own list includes saves still
        in flight)."""
        return committed_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, target, step: int | None = None, log=None) -> Restored:
        """Restore a step into arrays shaped and sharded like ``target`` (abstract arrays with
        shardings; or a :class:`StateReader`, e.g. ``Trainer.restore_target()``) and check every array
        against the step's manifest.

        With ``step`` None: the latest step that verifies; each newer one that fails is announced
        through ``log`` and moved aside as ``<step>.damaged`` (module docstring). With ``step``: that
        step or an error.
        """
        log = log or (lambda line: None)
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no checkpoint step {step} in {self.directory}; steps: {steps}")
            restored = self._restore_verified(target, step)
            newer = [s for s in steps if s > step]
            if newer:  # the run redoes them; keep the old ones, out of the way of the new saves
                self._set_aside(newer, log, "superseded")
            return restored
        failed, reasons = [], []
        for candidate in reversed(steps):
            try:
                restored = self._restore_verified(target, candidate)
            except CheckpointMismatch:
                raise
            except CheckpointError as e:
                failed.append(candidate)
                reasons.append(str(e))
                detail = getattr(e, "detail", "")
                log(
                    f"checkpoint step {candidate} is damaged: {e}; trying the step before it"
                    + (f" (read error: {detail})" if detail else "")
                )
                continue
            if failed:
                self._set_aside(failed, log)
                log(f"resuming from checkpoint step {candidate}, the newest that verifies")
            return restored
        raise CheckpointError(
            f"no checkpoint step in {self.directory} verifies ({'; '.join(reasons)}). Nothing was changed; start "
            f"a new {setting('checkpoint_dir')} or restore the directory from a copy"
        )

    def check(self, target, step: int | None = None) -> dict | None:
        """Read only the metadata of the step :meth:`restore` would try first (``step``, or the newest
        whose metadata reads) and refuse it if its arrays are not the ones ``target`` expects: a
        checkpoint of another model is named before any state is built. Returns that step's metadata
        (None: no step to resume). Damage is left for :meth:`restore` to find and fall back from."""
        steps = self.steps()
        candidates = [step] if step is not None and step in steps else [] if step is not None else steps[::-1]
        for candidate in candidates:
            try:
                meta, manifest = self._read_meta(candidate)
            except CheckpointError:
                continue
            reader = target if isinstance(target, StateReader) else SameArrays(target)
            _check_same_arrays(candidate, manifest, reader.expected(meta))
            return meta
        return None

    def _read_meta(self, step: int) -> tuple[dict, dict]:
        import orbax.checkpoint as ocp

        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on damaged data
            raise CheckpointError(f"step {step}: its metadata cannot be read ({first_line(e)})") from None
        return meta, _manifest(step, meta)

    def _restore_verified(self, target, step: int) -> Restored:
        meta, manifest = self._read_meta(step)
        reader = target if isinstance(target, StateReader) else SameArrays(target)
        _check_same_arrays(step, manifest, reader.expected(meta))
        state = reader.read(meta, lambda tree, partial=False: self._fetch(step, manifest, tree, partial))
        return Restored(step, state, meta)

    def _fetch(self, step: int, manifest: dict, tree, partial: bool):
        """Read the arrays of ``tree`` (all of the step's, or with ``partial`` a subtree of them) and check
        each against the manifest. A leaf with a sharding is read onto it (each device reads its own
        shard), one without onto the host as numpy."""
        import orbax.checkpoint as ocp

        try:
            restore_args = jax.tree.map(
                lambda x: (
                    ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
                    if getattr(x, "sharding", None) is not None
                    else ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
                ),
                tree,
            )
            args = ocp.args.PyTreeRestore(tree, restore_args=restore_args, partial_restore=partial)
            state = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on damaged data
            error = CheckpointError(self._damage(step))
            error.detail = first_line(e)[:160]
            raise error from None
        _verify_checksums(step, manifest, state)
        return state

    def _damage(self, step: int) -> str:
        """Which file of a step that cannot be read is at fault, as far as the folder shows: a missing
        index (an OCDBT manifest), else its data files under ``state/ocdbt.process_*/d``."""
        state = self.directory / str(step) / "state"
        manifests = [state / "manifest.ocdbt", *sorted(state.glob("ocdbt.process_*/manifest.ocdbt"))]
        missing = [str(m.relative_to(self.directory)) for m in manifests if not m.exists()]
        if not state.is_dir():
            return f"its folder {state} is missing"
        if missing:
            return f"its file {missing[0]} is missing"
        data = sorted(str(d.relative_to(self.directory)) for d in state.glob("ocdbt.process_*/d"))
        where = data[0] if len(data) == 1 else f"{step}/state"
        return f"its array data under {where} is truncated or damaged"

    def _set_aside(self, steps: list[int], log, why: str = "damaged") -> None:
        """Move steps out of Orbax's sight as ``<step>.<why>`` (kept for inspection, never deleted)."""
        _sync("jaxmem-checkpoint-read")  # every process has read them before they move
        if jax.process_index() == 0:
            for step in steps:
                source, dest = self.directory / str(step), self.directory / f"{step}.{why}"
                n = 1
                while dest.exists():
                    dest, n = self.directory / f"{step}.{why}.{n}", n + 1
                source.rename(dest)
                log(f"moved {why} checkpoint step {step} aside to {dest}")
        _sync("jaxmem-checkpoint-set-aside")  # ... and every process sees them moved
        self.manager.reload()


def read_params(directory, step: int | None = None) -> Restored:
    """The saved parameters and metadata of the latest (or given) step of a checkpoint directory, read
    onto the host (numpy; no device holds them), whatever mesh and optimizer saved them; each array is
    checked against the manifest. ``state`` is ``{"params": ...}`` as saved: the model's layout for
    steps saved before jaxmem wrote checkpoints from shards, else the pipeline's layout described by
    ``meta["layout"]`` (:func:`jaxmem.train.model_params` turns either into the model's tree).

    Read-only: it neither creates nor cleans anything, so it is safe beside a run still saving there.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())
    step = (steps[-1] if steps else None) if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    if step not in steps:
        raise CheckpointError(f"no checkpoint step {step} in {directory}; steps: {steps}")
    logging.getLogger("absl").addFilter(_QUIET_READ_ONLY)  # idempotent
    reader = ocp.CheckpointManager(
        directory,
        # save_interval_steps=0: a read-only manager saves nothing (Orbax warns when it has to set it).
        options=ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )
    try:
        metadata = reader.item_metadata(step)["state"]
        target = {"params": jax.tree.map(lambda m: np.zeros((0,), m.dtype), metadata["params"])}
        restore_args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), target)
        restored = reader.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True),
                meta=ocp.args.JsonRestore(),
            ),
        )
    except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on damaged data
        raise CheckpointError(f"checkpoint step {step} in {directory} cannot be read: {first_line(e)}") from None
    finally:
        reader.close()
    params, meta = restored["state"]["params"], restored["meta"]
    # Orbax's metadata tree spells integer dict keys as strings: compare names without quotes.
    _verify_checksums(step, _manifest(step, meta), {"params": params}, key=lambda name: name.replace("'", ""))
    return Restored(step, {"params": params}, meta)
