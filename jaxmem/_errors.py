"""The base class of the errors jaxmem raises for bad input (the CLI prints them without a traceback)."""

__all__ = ["JaxmemError"]


class JaxmemError(ValueError):
    """Bad input to jaxmem: the message says what is wrong and how to fix it."""
