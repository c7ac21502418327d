"""The memory ledger and the analytical memory model."""

from jaxmem.memory._cost import HARDWARE as HARDWARE
from jaxmem.memory._cost import Hardware as Hardware
from jaxmem.memory._cost import get_hardware as get_hardware
from jaxmem.memory._cost import simulate_step as simulate_step
from jaxmem.memory._cost import step_costs as step_costs
from jaxmem.memory._ledger import CATEGORIES as CATEGORIES
from jaxmem.memory._ledger import Bytes as Bytes
from jaxmem.memory._ledger import Ledger as Ledger
from jaxmem.memory._ledger import RankLedger as RankLedger
from jaxmem.memory._ledger import compare as compare
from jaxmem.memory._ledger import measure as measure
from jaxmem.memory._ledger import predict as predict
from jaxmem.memory._model import stage_residual_bytes as stage_residual_bytes
