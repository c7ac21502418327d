"""jaxmem: train language models that do not fit in accelerator memory, on JAX.

Schedules (``jaxmem.schedule``) are pure Python and import no JAX; the executor, policies, ledger,
planners and elastic layer import JAX when first used.
"""

__version__ = "0.1.0"

from jaxmem._errors import JaxmemError as JaxmemError
from jaxmem.schedule import Action as Action
from jaxmem.schedule import Costs as Costs
from jaxmem.schedule import Schedule as Schedule
from jaxmem.schedule import ScheduleError as ScheduleError
from jaxmem.schedule import generate as generate
from jaxmem.schedule import load_csv as load_csv
from jaxmem.schedule import save_csv as save_csv
from jaxmem.schedule import simulate as simulate
from jaxmem.schedule import validate as validate
