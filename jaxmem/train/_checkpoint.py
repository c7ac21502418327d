"""Checkpoints: Orbax CheckpointManager with async saves, keep-last-K, the whole train state in one
atomic step, and a per-array checksum manifest saved inside that same step.

The state is stored in the *model's* layout (per-layer parameter dicts, Adam moments alike), not the
pipeline's stacked layout, so a checkpoint restores onto any mesh and stage split: restore reads
the arrays with target shardings (replicated over the new mesh) and the new pipeline re-lays them
out. Orbax writes a step into a temporary directory and renames it when complete, so a save killed
mid-way is never listed; temporary leftovers are removed when the manager opens the directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from pathlib import Path

import jax
import numpy as np

from jaxmem._errors import JaxmemError

__all__ = ["CheckpointError", "Checkpointer", "array_checksums", "read_params"]

MARKER = "jaxmem_checkpoints.json"


class CheckpointError(JaxmemError):
    """A checkpoint directory or step cannot be used; says why and what to do."""


def _host_value(x) -> np.ndarray:
    """The full value of a (possibly multi-process) array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def array_checksums(tree) -> dict[str, dict]:
    """Per array (by its path): shape, dtype and a CRC32 of its bytes."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        value = _host_value(leaf)
        out[jax.tree_util.keystr(path)] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "crc32": zlib.crc32(np.ascontiguousarray(value).tobytes()),
        }
    return out


@dataclasses.dataclass
class Restored:
    step: int
    state: dict  # {"params": model-layout dict, "opt_state": ...}
    meta: dict  # step, seed, data position, plan


class Checkpointer:
    """Save and restore jaxmem train states in ``directory``.

    Args:
        directory: where steps are kept (created if missing; must be empty or a jaxmem checkpoint
            directory).
        every: save every N steps.
        keep: keep the last K steps.
        async_save: write in the background (the next save waits for the previous one).
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 10, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.every = every
        self.keep = keep
        self._check_directory()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

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
            self.directory.mkdir(parents=True, exist_ok=True)
            if not marker.exists():
                marker.write_text(json.dumps({"format": "jaxmem", "version": 1}))

    # ------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: dict, meta: dict, force: bool = False) -> bool:
        """Save ``state`` (model layout) with ``meta`` at ``step`` (when due, or ``force``)."""
        import orbax.checkpoint as ocp

        if not force and not self.should_save(step):
            return False
        manifest = array_checksums(state)
        payload = {**meta, "step": step, "manifest": manifest}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(payload)),
            force=True,
        )
        return True

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ------------------------------------------------------------------ restore
    def steps(self) -> list[int]:
        """Committed steps only, read from disk: Orbax renames a step's temporary directory to its
        number when the save is complete, so an in-flight or killed save is never listed (the
        manager's own list includes saves still in flight)."""
        if not self.directory.exists():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, target: dict, step: int | None = None) -> Restored:
        """Restore the latest (or given) step into arrays shaped and sharded like ``target`` (abstract
        arrays with shardings), then check every array against the manifest."""
        import orbax.checkpoint as ocp

        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on damaged data
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be read (damaged or incomplete files): "
                f"{type(e).__name__}: {first}; restore an earlier step "
                f"({[s for s in self.steps() if s != step] or 'none available'})"
            ) from None
        state, meta = restored["state"], restored["meta"]
        manifest = meta.get("manifest", {})
        actual = array_checksums(state)
        for name, want in manifest.items():
            got = actual.get(name)
            if got is None or got["crc32"] != want["crc32"] or got["shape"] != want["shape"]:
                raise CheckpointError(
                    f"checkpoint step {step}: array {name} does not match the checksum saved with it "
                    f"(file damaged or changed after saving); restore an earlier step "
                    f"({[s for s in self.steps() if s != step] or 'none available'})"
                )
        return Restored(step, state, meta)

    def restore_params(self, step: int | None = None) -> Restored:
        """The parameters of a step on one device (see :func:`read_params`)."""
        return read_params(self.directory, step)


def read_params(directory, step: int | None = None) -> Restored:
    """The parameters (model layout) and metadata of the latest (or given) step of a checkpoint
    directory on one device, whatever mesh and optimizer saved them (the target comes from the step's
    own metadata); each array is checked against the manifest. ``state`` is ``{"params": ...}``.

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
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reader = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
    )
    try:
        metadata = reader.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
        restored = reader.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
    except Exception as e:  # noqa: BLE001 -- Orbax/TensorStore raise bare Exception on damaged data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(
            f"checkpoint step {step} in {directory} cannot be read: {type(e).__name__}: {first}"
        ) from None
    finally:
        reader.close()
    params, meta = restored["state"]["params"], restored["meta"]
    # Orbax's metadata tree spells integer dict keys as strings: compare names without quotes.
    manifest = {name.replace("'", ""): value for name, value in meta.get("manifest", {}).items()}
    for name, got in array_checksums({"params": params}).items():
        want = manifest.get(name.replace("'", ""))
        if want is None or got["crc32"] != want["crc32"] or got["shape"] != want["shape"]:
            raise CheckpointError(
                f"checkpoint step {step}: array {name} does not match the checksum saved with it "
                "(file damaged or changed after saving)"
            )
    return Restored(step, {"params": params}, meta)
