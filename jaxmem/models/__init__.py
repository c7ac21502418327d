"""The model interface (:class:`StagedModel`, :func:`from_nnx`) and the built-in models: a GPT and a
Llama-style decoder in Flax NNX, with ``checkpoint_name`` tags on their activations."""

from jaxmem.models._interface import ATTENTION as ATTENTION
from jaxmem.models._interface import AXIS_RULES as AXIS_RULES
from jaxmem.models._interface import EMBED_KEY as EMBED_KEY
from jaxmem.models._interface import HEAD_KEY as HEAD_KEY
from jaxmem.models._interface import RNG_SPEC as RNG_SPEC
from jaxmem.models._interface import ParamAxes as ParamAxes
from jaxmem.models._interface import StagedModel as StagedModel
from jaxmem.models._interface import VocabParallel as VocabParallel
from jaxmem.models._interface import batch_positions as batch_positions
from jaxmem.models._interface import from_nnx as from_nnx
from jaxmem.models._interface import fused_attention as fused_attention
from jaxmem.models._interface import layer_batch as layer_batch
from jaxmem.models._interface import make_batch as make_batch
from jaxmem.models._interface import microbatch_key as microbatch_key
from jaxmem.models._interface import named_softmax as named_softmax
from jaxmem.models._interface import stage_key as stage_key
from jaxmem.models._interface import token_loss as token_loss
from jaxmem.models._registry import PRESETS as PRESETS
from jaxmem.models._registry import describe_model as describe_model
from jaxmem.models._registry import get_config as get_config
from jaxmem.models._registry import get_model as get_model
from jaxmem.models._registry import model_from_description as model_from_description
from jaxmem.models._registry import model_name as model_name
from jaxmem.models._sample import sample as sample
from jaxmem.models.gpt import GPT as GPT
from jaxmem.models.gpt import GPT_TAGS as GPT_TAGS
from jaxmem.models.gpt import Block as Block
from jaxmem.models.gpt import GPTConfig as GPTConfig
from jaxmem.models.gpt import cross_entropy as cross_entropy
from jaxmem.models.gpt import gpt as gpt
from jaxmem.models.llama import LLAMA_TAGS as LLAMA_TAGS
from jaxmem.models.llama import Llama as Llama
from jaxmem.models.llama import LlamaConfig as LlamaConfig
from jaxmem.models.llama import llama as llama
