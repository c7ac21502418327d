"""How the command line names a setting: the flag of a library field or argument, for the library's
errors while a command runs (``jaxmem.cli.main`` hands :func:`flag` to
:func:`jaxmem._errors.settings_phrased_by`, so that ``warmup_steps=5`` reads ``--warmup-steps 5``)."""

from __future__ import annotations

__all__ = ["flag"]

# Settings whose flag is not the field's name with dashes.
_FLAGS = {
    "schedule_csv": "--csv",
    "zero": "--no-zero",
    "vocab_split": "--no-vocab-split",
    "explore": "--no-explore",
    "layer_counts": "--layers-per-stage",
    "failures": "--inject-failure",
    "out_dir": "-o",
}


def flag(name: str, *value) -> str:
    """A setting as the command line writes it: ``flag("warmup_steps", 5)`` is ``--warmup-steps 5``,
    a sequence joined by commas (``--layers-per-stage 3,3,2``).

    >>> flag("schedule_csv"), flag("layers_per_stage", (3, 3, 2)), flag("plan", "auto")
    ('--csv', '--layers-per-stage 3,3,2', '--plan auto')
    """
    text = _FLAGS.get(name, "--" + name.replace("_", "-"))
    if not value:
        return text
    shown = value[0]
    if isinstance(shown, (tuple, list)):
        shown = ",".join(map(str, shown))
    return f"{text} {shown}"
