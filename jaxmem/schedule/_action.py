"""Pipeline actions in torch.distributed.pipelining's compact notation: ``{stage}{kind}{microbatch}``."""

from __future__ import annotations

import dataclasses
import enum
import re

from jaxmem._errors import JaxmemError

__all__ = ["Action", "ActionParseError", "Kind"]


class Kind(enum.StrEnum):
    """What an action computes for one (stage, microbatch).

    ``F`` runs the stage forward; ``B`` runs its full backward; ``I`` computes only the gradient with
    respect to the stage input (what the previous stage waits for) and ``W`` the gradient with respect
    to the stage weights (which nobody waits for, so zero-bubble schedules move it into bubbles).
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 -- the letter is the notation.
    W = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"(\d+)([FBIW])(\d+)")
# torch's full notation also has communication and FSDP actions; we accept only the compute-only format.
_TORCH_COMM_RE = re.compile(r"\d*(UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD)\d*")


class ActionParseError(JaxmemError):
    """A cell of a schedule table is not a valid ``{stage}{kind}{microbatch}`` action."""


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: run ``kind`` for ``stage`` on ``microbatch``.

    >>> a = Action.parse("2F0")
    >>> a.stage, a.kind, a.microbatch
    (2, <Kind.F: 'F'>, 0)
    >>> str(Action(1, Kind.W, 4))
    '1W4'
    """

    stage: int
    kind: Kind
    microbatch: int

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise ActionParseError(f"unknown action kind {self.kind!r}: use one of F, B, I, W") from None
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ActionParseError(f"action {field} must be an integer >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"``-style text; the exact inverse of ``str(action)``.

        Raises:
            ActionParseError: the text is not one compute action, with what was expected.
        """
        if not isinstance(text, str):
            raise ActionParseError(f"an action must be text like '2F0', got {type(text).__name__}")
        cleaned = text.strip()
        match = _ACTION_RE.fullmatch(cleaned)
        if match is None:
            if _TORCH_COMM_RE.fullmatch(cleaned):
                raise ActionParseError(
                    f"{text!r} is a communication/sharding action from torch's full schedule format; "
                    "jaxmem reads the compute-only format (F, B, I, W). Export the schedule before "
                    "communication is added (torch: the compute-only `pipeline_order`)."
                )
            raise ActionParseError(
                f"{text!r} is not an action: write {{stage}}{{kind}}{{microbatch}} with kind one of "
                "F (forward), B (full backward), I (input-gradient), W (weight-gradient), e.g. '2F0' or '0B3'"
            )
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))
