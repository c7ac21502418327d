"""The shard_map executor and the stage split of a Flax GPT."""

from jaxmem.pipeline._executor import Pipeline as Pipeline
from jaxmem.pipeline._executor import PipelineParams as PipelineParams
from jaxmem.pipeline._executor import make_mesh as make_mesh
from jaxmem.pipeline._split import GPTPieces as GPTPieces
from jaxmem.pipeline._split import split_layers as split_layers
from jaxmem.pipeline._ticks import StageClass as StageClass
from jaxmem.pipeline._ticks import TickProgram as TickProgram
from jaxmem.pipeline._ticks import build_tick_program as build_tick_program
