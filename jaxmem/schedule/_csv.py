"""Schedules as CSV in torch.distributed.pipelining's format: one row per rank, one cell per action."""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from jaxmem.schedule._action import Action, ActionParseError
from jaxmem.schedule._table import Schedule, ScheduleError

__all__ = ["load_csv", "save_csv", "schedule_from_csv_text", "schedule_to_csv_text"]

# torch's compute+comms format adds these; the executor derives all communication itself.
_COMM_CELL = re.compile(r"\d*(UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD)\d*")


def schedule_to_csv_text(schedule: Schedule) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in schedule.rows_as_text():
        writer.writerow(row)
    return buffer.getvalue()


def save_csv(schedule: Schedule, path: str | os.PathLike) -> Path:
    """Write the table: one row per rank, ``""`` for an idle cell (torch's compute-only format)."""
    path = Path(path)
    try:
        path.write_text(schedule_to_csv_text(schedule))
    except OSError as e:
        raise ScheduleError(f"cannot write schedule CSV {path}: {e.strerror or e}") from None
    return path


def schedule_from_csv_text(text: str, name: str = "csv", stage_to_rank: tuple[int, ...] | None = None) -> Schedule:
    """Parse CSV text into a Schedule; communication cells of torch's compute+comms format are dropped."""
    rows: list[list[Action | None]] = []
    reader = csv.reader(io.StringIO(text))
    try:
        raw_rows = list(reader)
    except csv.Error as e:
        raise ScheduleError(f"{name}: not valid CSV: {e}") from None
    while raw_rows and raw_rows[-1] == []:
        raw_rows.pop()  # trailing blank lines
    if not raw_rows:
        raise ScheduleError(f"{name}: the CSV has no rows; write one row per rank, e.g. '0F0,0B0'")
    for rank, raw in enumerate(raw_rows):
        row: list[Action | None] = []
        for step, cell in enumerate(raw):
            text_cell = cell.strip()
            if not text_cell:
                row.append(None)
            elif _COMM_CELL.fullmatch(text_cell):
                continue
            else:
                try:
                    row.append(Action.parse(text_cell))
                except ActionParseError as e:
                    raise ScheduleError(f"{name}: row {rank + 1} (rank {rank}), column {step + 1}: {e}") from None
        rows.append(row)
    return Schedule(rows, stage_to_rank=stage_to_rank, name=name)


def load_csv(path: str | os.PathLike, stage_to_rank: tuple[int, ...] | None = None) -> Schedule:
    """Read a schedule CSV (jaxmem's or torch.distributed.pipelining's ``_dump_csv``, either format).

    The stage -> rank map is inferred from where each stage's actions are, unless given. The result is
    not validated here: call :func:`validate`.

    Raises:
        ScheduleError: the file cannot be read, or a cell is not an action (with its row and column).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ScheduleError(f"schedule CSV {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ScheduleError(f"schedule CSV {str(path)!r} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"schedule CSV {str(path)!r} is not text (expected UTF-8 CSV)") from None
    except OSError as e:
        raise ScheduleError(f"cannot read schedule CSV {str(path)!r}: {e.strerror or e}") from None
    return schedule_from_csv_text(text, name=path.stem, stage_to_rank=stage_to_rank)
