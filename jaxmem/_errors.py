"""The base class of the errors jaxmem raises for bad input (the CLI prints them without a traceback),
and :func:`setting`, which names a setting in an error the way its caller wrote it."""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["JaxmemError", "StepTooLarge", "first_line", "out_of_memory_bytes", "setting", "settings_phrased_by"]


class JaxmemError(ValueError):
    """Bad input to jaxmem: the message says what is wrong and how to fix it."""


class StepTooLarge(JaxmemError):
    """A program the target's compiler refused to build for being beyond its chip's memory (a TPU's
    does); ``needed_bytes``: the temporaries it said the program needs."""

    def __init__(self, message: str, needed_bytes: float):
        super().__init__(message)
        self.needed_bytes = needed_bytes


def out_of_memory_bytes(error: BaseException) -> float | None:
    """The bytes of temporaries a TPU's compiler says a program needs when it refuses it for being
    beyond the chip's HBM ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required
    for HLO temporaries (23.11G) exceeds available HBM (15.75G)", binary units); None for any other
    error."""
    import re

    found = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", str(error))
    if "RESOURCE_EXHAUSTED" not in str(error) or found is None:
        return None
    return float(found.group(1)) * 1024 ** ("KMGT".index(found.group(2)) + 1)


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception from a library (at most 300 characters),
    for a one-line error that names the cause without its traceback."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]


# How an error names a setting: None is Python's phrasing (the argument or field name); the command
# line sets its flags' phrasing while a command runs (settings_phrased_by).
_PHRASING: contextvars.ContextVar = contextvars.ContextVar("jaxmem_setting_phrasing", default=None)
_UNSET = object()


def setting(name: str, value=_UNSET) -> str:
    """``name`` (a keyword argument or :class:`~jaxmem.config.TrainConfig` field), with ``value`` if
    given, as the caller wrote it: ``warmup_steps=5`` from Python, ``--warmup-steps 5`` from the
    command line. The library's errors name settings through this, so that each reads in its
    caller's words.

    >>> setting("warmup_steps", 5), setting("budget")
    ('warmup_steps=5', 'budget')
    """
    phrase = _PHRASING.get()
    if phrase is not None:
        return phrase(name) if value is _UNSET else phrase(name, value)
    return name if value is _UNSET else f"{name}={value!r}"


@contextlib.contextmanager
def settings_phrased_by(phrase):
    """Within the block, :func:`setting` names settings by ``phrase(name[, value])`` (the CLI's flags)."""
    token = _PHRASING.set(phrase)
    try:
        yield
    finally:
        _PHRASING.reset(token)
