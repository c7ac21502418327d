"""Recompute / offload policies per stage and per microbatch (pure Python; lowers to JAX on use)."""

from jaxmem.policy._policy import ALL_TAGS as ALL_TAGS
from jaxmem.policy._policy import PRESET_HELP as PRESET_HELP
from jaxmem.policy._policy import PRESETS as PRESETS
from jaxmem.policy._policy import Decision as Decision
from jaxmem.policy._policy import Policy as Policy
from jaxmem.policy._policy import PolicyError as PolicyError
from jaxmem.policy._policy import ResolvedPolicy as ResolvedPolicy
from jaxmem.policy._policy import StagePolicy as StagePolicy
from jaxmem.policy._policy import from_spec as from_spec
from jaxmem.policy._policy import microbatch_classes as microbatch_classes
