"""The memory ledger, the facts it is predicted from (traced for any model, closed-form for the GPT),
time costs on hardware profiles, and :func:`estimate`, the prediction every planner shares."""

from jaxmem._util import compiled_bytes as compiled_bytes
from jaxmem._util import compiled_flops as compiled_flops
from jaxmem.memory._cost import CPU_LOCKSTEP as CPU_LOCKSTEP
from jaxmem.memory._cost import CPU_LOCKSTEP_PROCESSES as CPU_LOCKSTEP_PROCESSES
from jaxmem.memory._cost import HARDWARE as HARDWARE
from jaxmem.memory._cost import Estimate as Estimate
from jaxmem.memory._cost import Hardware as Hardware
from jaxmem.memory._cost import Lockstep as Lockstep
from jaxmem.memory._cost import calibrate_cpu as calibrate_cpu
from jaxmem.memory._cost import cpu_cores as cpu_cores
from jaxmem.memory._cost import estimate as estimate
from jaxmem.memory._cost import get_hardware as get_hardware
from jaxmem.memory._cost import gradient_sync_seconds as gradient_sync_seconds
from jaxmem.memory._cost import shared_core_step_seconds as shared_core_step_seconds
from jaxmem.memory._cost import shared_core_terms as shared_core_terms
from jaxmem.memory._cost import stage_update_seconds as stage_update_seconds
from jaxmem.memory._cost import state_transfer_seconds as state_transfer_seconds
from jaxmem.memory._cost import step_costs as step_costs
from jaxmem.memory._facts import ModelFacts as ModelFacts
from jaxmem.memory._facts import StageFacts as StageFacts
from jaxmem.memory._facts import model_facts as model_facts
from jaxmem.memory._facts import working_sets as working_sets
from jaxmem.memory._ledger import CATEGORIES as CATEGORIES
from jaxmem.memory._ledger import Bytes as Bytes
from jaxmem.memory._ledger import Ledger as Ledger
from jaxmem.memory._ledger import RankLedger as RankLedger
from jaxmem.memory._ledger import compare as compare
from jaxmem.memory._ledger import host_bytes_counted_as_device as host_bytes_counted_as_device
from jaxmem.memory._ledger import measure as measure
from jaxmem.memory._ledger import predict as predict
from jaxmem.memory._model import stage_residual_bytes as stage_residual_bytes
