"""Pipelined training: the train state, the trainer (model, pipeline, optimizer, jitted step), the loop
with its hooks (checkpoints, sample log), checkpoints written from the shards, and adaptive training
under the online profiler."""

from jaxmem.config import TrainConfig as TrainConfig
from jaxmem.train._adaptive import adaptive_workload as adaptive_workload
from jaxmem.train._adaptive import train_adaptive as train_adaptive
from jaxmem.train._checkpoint import Checkpointer as Checkpointer
from jaxmem.train._checkpoint import CheckpointError as CheckpointError
from jaxmem.train._checkpoint import array_checksums as array_checksums
from jaxmem.train._checkpoint import committed_steps as committed_steps
from jaxmem.train._checkpoint import read_params as read_params
from jaxmem.train._export import Exported as Exported
from jaxmem.train._export import export_checkpoint as export_checkpoint
from jaxmem.train._export import flatten_params as flatten_params
from jaxmem.train._export import load_exported as load_exported
from jaxmem.train._export import load_hf as load_hf
from jaxmem.train._export import load_model as load_model
from jaxmem.train._export import save_hf as save_hf
from jaxmem.train._export import unflatten_params as unflatten_params
from jaxmem.train._hooks import CheckpointHook as CheckpointHook
from jaxmem.train._hooks import Hook as Hook
from jaxmem.train._hooks import SampleLogHook as SampleLogHook
from jaxmem.train._hooks import StepInfo as StepInfo
from jaxmem.train._hooks import default_hooks as default_hooks
from jaxmem.train._loop import TrainingError as TrainingError
from jaxmem.train._loop import apply_plan as apply_plan
from jaxmem.train._loop import planned_config as planned_config
from jaxmem.train._loop import train as train
from jaxmem.train._metrics import MetricsHook as MetricsHook
from jaxmem.train._metrics import model_flops_per_step as model_flops_per_step
from jaxmem.train._metrics import plot_metrics as plot_metrics
from jaxmem.train._metrics import read_metrics as read_metrics
from jaxmem.train._state import TrainState as TrainState
from jaxmem.train._state import global_put as global_put
from jaxmem.train._state import scalar as scalar
from jaxmem.train._state import to_device as to_device
from jaxmem.train._state_io import model_params as model_params
from jaxmem.train._trainer import Trainer as Trainer
from jaxmem.train._trainer import abstract_state as abstract_state
from jaxmem.train._trainer import learning_rate as learning_rate
from jaxmem.train._trainer import make_optimizer as make_optimizer
from jaxmem.train._trainer import step_key as step_key
