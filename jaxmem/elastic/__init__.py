"""Elastic training (Odyssey): Orbax checkpoints, a launcher over jax.distributed, recovery planning."""

from jaxmem.elastic._checkpoint import Checkpointer as Checkpointer
from jaxmem.elastic._checkpoint import CheckpointError as CheckpointError
from jaxmem.elastic._checkpoint import array_checksums as array_checksums
