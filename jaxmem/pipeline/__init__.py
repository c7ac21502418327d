"""The shard_map executor, the stage split of a model, and the residual analysis of a stage."""

from jaxmem.pipeline._executor import Pipeline as Pipeline
from jaxmem.pipeline._executor import PipelineParams as PipelineParams
from jaxmem.pipeline._executor import batch_spec as batch_spec
from jaxmem.pipeline._executor import make_mesh as make_mesh
from jaxmem.pipeline._placement import AXES as AXES
from jaxmem.pipeline._placement import MESH_AXES as MESH_AXES
from jaxmem.pipeline._placement import TENSOR as TENSOR
from jaxmem.pipeline._placement import LeafPlacement as LeafPlacement
from jaxmem.pipeline._placement import Placement as Placement
from jaxmem.pipeline._placement import layout_axes as layout_axes
from jaxmem.pipeline._placement import place_leaf as place_leaf
from jaxmem.pipeline._placement import placement_of as placement_of
from jaxmem.pipeline._residuals import ResidualPlan as ResidualPlan
from jaxmem.pipeline._residuals import analyze_stage as analyze_stage
from jaxmem.pipeline._residuals import emitted_tags as emitted_tags
from jaxmem.pipeline._split import ParamLayout as ParamLayout
from jaxmem.pipeline._split import split_layers as split_layers
from jaxmem.pipeline._split import stage_forward as stage_forward
from jaxmem.pipeline._split import vocab_size as vocab_size
from jaxmem.pipeline._ticks import StageClass as StageClass
from jaxmem.pipeline._ticks import TickProgram as TickProgram
from jaxmem.pipeline._ticks import build_tick_program as build_tick_program
from jaxmem.pipeline._ticks import cell_classes as cell_classes
from jaxmem.pipeline._vocab import join_vocab as join_vocab
from jaxmem.pipeline._vocab import split_vocab as split_vocab
from jaxmem.pipeline._vocab import vocab_rows as vocab_rows
