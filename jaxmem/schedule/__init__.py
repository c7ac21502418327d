"""Pipeline schedules as data: actions, tables, generators, validation, simulation, CSV, drawing.

This package is pure Python (no JAX import), so schedule tools start fast.
"""

from jaxmem.schedule._action import Action as Action
from jaxmem.schedule._action import ActionParseError as ActionParseError
from jaxmem.schedule._action import Kind as Kind
from jaxmem.schedule._csv import load_csv as load_csv
from jaxmem.schedule._csv import save_csv as save_csv
from jaxmem.schedule._csv import schedule_from_csv_text as schedule_from_csv_text
from jaxmem.schedule._csv import schedule_to_csv_text as schedule_to_csv_text
from jaxmem.schedule._draw import draw as draw
from jaxmem.schedule._generators import MAX_ACTIONS as MAX_ACTIONS
from jaxmem.schedule._generators import GeneratorInfo as GeneratorInfo
from jaxmem.schedule._generators import align as align
from jaxmem.schedule._generators import chronos as chronos
from jaxmem.schedule._generators import forward_only as forward_only
from jaxmem.schedule._generators import generate as generate
from jaxmem.schedule._generators import get_generator as get_generator
from jaxmem.schedule._generators import gpipe as gpipe
from jaxmem.schedule._generators import greedy_schedule as greedy_schedule
from jaxmem.schedule._generators import interleaved_1f1b as interleaved_1f1b
from jaxmem.schedule._generators import list_generators as list_generators
from jaxmem.schedule._generators import one_f_one_b as one_f_one_b
from jaxmem.schedule._generators import register as register
from jaxmem.schedule._generators import v_half as v_half
from jaxmem.schedule._generators import v_min as v_min
from jaxmem.schedule._generators import v_shape_stage_to_rank as v_shape_stage_to_rank
from jaxmem.schedule._generators import zb_h1 as zb_h1
from jaxmem.schedule._generators import zbv as zbv
from jaxmem.schedule._simulate import Costs as Costs
from jaxmem.schedule._simulate import SimulationResult as SimulationResult
from jaxmem.schedule._simulate import simulate as simulate
from jaxmem.schedule._table import Schedule as Schedule
from jaxmem.schedule._table import ScheduleError as ScheduleError
from jaxmem.schedule._table import format_table as format_table
from jaxmem.schedule._validate import lockstep_ticks as lockstep_ticks
from jaxmem.schedule._validate import validate as validate
