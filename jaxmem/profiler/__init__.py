"""The online profiler (Chameleon): adapts memory policies as the program changes, under a budget."""

from jaxmem.profiler._profiler import LADDER as LADDER
from jaxmem.profiler._profiler import AdaptiveProfiler as AdaptiveProfiler
from jaxmem.profiler._profiler import BudgetError as BudgetError
from jaxmem.profiler._profiler import SignatureRecord as SignatureRecord
from jaxmem.profiler._profiler import choose_policy as choose_policy
from jaxmem.profiler._profiler import escalate_policy as escalate_policy
