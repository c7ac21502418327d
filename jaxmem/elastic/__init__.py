"""Elastic training (Odyssey): a launcher over jax.distributed that restarts a job after a failure, the
recovery planner that chooses how, and the worker's heartbeat and failure-drill hooks. Checkpoints
(Orbax, in the model's layout, restorable onto any mesh) live in :mod:`jaxmem.train` and are
re-exported here."""

from jaxmem.elastic._launcher import Failure as Failure
from jaxmem.elastic._launcher import LaunchInterrupted as LaunchInterrupted
from jaxmem.elastic._launcher import LaunchResult as LaunchResult
from jaxmem.elastic._launcher import default_run_dir as default_run_dir
from jaxmem.elastic._launcher import launch as launch
from jaxmem.elastic._launcher import parse_failure as parse_failure
from jaxmem.elastic._launcher import read_heartbeat as read_heartbeat
from jaxmem.elastic._launcher import run_defaults as run_defaults
from jaxmem.elastic._recovery import STRATEGIES as STRATEGIES
from jaxmem.elastic._recovery import Recovery as Recovery
from jaxmem.elastic._recovery import RecoveryError as RecoveryError
from jaxmem.elastic._recovery import Strategy as Strategy
from jaxmem.elastic._recovery import choose_recovery as choose_recovery
from jaxmem.elastic._recovery import predicted_step_seconds as predicted_step_seconds
from jaxmem.elastic._worker import FailureInjectionHook as FailureInjectionHook
from jaxmem.elastic._worker import HeartbeatHook as HeartbeatHook
from jaxmem.elastic._worker import die_with_launcher as die_with_launcher
from jaxmem.elastic._worker import worker_hooks as worker_hooks
from jaxmem.train import Checkpointer as Checkpointer
from jaxmem.train import CheckpointError as CheckpointError
from jaxmem.train import array_checksums as array_checksums
