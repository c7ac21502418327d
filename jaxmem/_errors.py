"""The base class of the errors jaxmem raises for bad input (the CLI prints them without a traceback)."""

__all__ = ["JaxmemError", "first_line"]


class JaxmemError(ValueError):
    """Bad input to jaxmem: the message says what is wrong and how to fix it."""


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception from a library (at most 300 characters),
    for a one-line error that names the cause without its traceback."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:300]
