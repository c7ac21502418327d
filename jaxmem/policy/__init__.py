"""Recompute / offload policies per stage and per microbatch, written against a model's declared tags
(pure Python; lowers to JAX on use), and the Chronos-Recomp/Offload policy generator."""

from jaxmem.policy._chronos import MOVE_SPECS as MOVE_SPECS
from jaxmem.policy._chronos import ChronosChoice as ChronosChoice
from jaxmem.policy._chronos import Move as Move
from jaxmem.policy._chronos import chronos_policy as chronos_policy
from jaxmem.policy._chronos import peak_order as peak_order
from jaxmem.policy._chronos import reuse_distances as reuse_distances
from jaxmem.policy._policy import BASES as BASES
from jaxmem.policy._policy import KEEP_GATHERED as KEEP_GATHERED
from jaxmem.policy._policy import PRESET_HELP as PRESET_HELP
from jaxmem.policy._policy import PRESETS as PRESETS
from jaxmem.policy._policy import BoundStagePolicy as BoundStagePolicy
from jaxmem.policy._policy import Decision as Decision
from jaxmem.policy._policy import Policy as Policy
from jaxmem.policy._policy import PolicyError as PolicyError
from jaxmem.policy._policy import ResolvedPolicy as ResolvedPolicy
from jaxmem.policy._policy import StagePolicy as StagePolicy
from jaxmem.policy._policy import TagSet as TagSet
from jaxmem.policy._policy import from_spec as from_spec
from jaxmem.policy._policy import microbatch_classes as microbatch_classes
from jaxmem.policy._policy import resolve as resolve
