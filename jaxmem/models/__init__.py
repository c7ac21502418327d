"""Models with ``checkpoint_name`` tags on their activations."""

from jaxmem.models.gpt import GPT as GPT
from jaxmem.models.gpt import PRESETS as PRESETS
from jaxmem.models.gpt import TAGS as TAGS
from jaxmem.models.gpt import Block as Block
from jaxmem.models.gpt import GPTConfig as GPTConfig
from jaxmem.models.gpt import cross_entropy as cross_entropy
from jaxmem.models.gpt import get_config as get_config
