"""The configuration search behind ``jaxmem plan`` and ``jaxmem train --plan auto``: the fastest
pipeline size, schedule, microbatch count and memory policy predicted to fit a per-device budget."""

from jaxmem.search._search import CHRONOS_MOVES as CHRONOS_MOVES
from jaxmem.search._search import CONTEXT_MIN_TOKENS as CONTEXT_MIN_TOKENS
from jaxmem.search._search import LEDGER_MARGIN as LEDGER_MARGIN
from jaxmem.search._search import POLICIES as POLICIES
from jaxmem.search._search import SCHEDULES as SCHEDULES
from jaxmem.search._search import Candidate as Candidate
from jaxmem.search._search import SearchError as SearchError
from jaxmem.search._search import SearchResult as SearchResult
from jaxmem.search._search import candidate_schedules as candidate_schedules
from jaxmem.search._search import check_budget_floor as check_budget_floor
from jaxmem.search._search import chronos_moves as chronos_moves
from jaxmem.search._search import confirm as confirm
from jaxmem.search._search import context_sizes as context_sizes
from jaxmem.search._search import evaluate as evaluate
from jaxmem.search._search import progress_lines as progress_lines
from jaxmem.search._search import search as search
from jaxmem.search._search import tensor_sizes as tensor_sizes
