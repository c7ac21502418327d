"""What one tick of a compiled step writes: the tick loop's instructions, read from XLA's text.

The executor runs its ticks as one ``while`` loop. :func:`tick_traffic` finds that loop in a compiled
program (the ``while`` with the most bytes carried) and lists what its body computes, branches of its
conditionals included (fusions count as one instruction; their insides are not walked). It answers
the executor's own performance questions on any backend, without a profiler:

- which loop-carried buffers (message slots, stash arenas, gradient accumulators) the body *copies*
  or *scatters into* -- each such instruction moves the whole buffer on every tick it runs;
- how many bytes the body's instructions write, by opcode.

The bytes are of each instruction's output as XLA types it; an in-place update (a dynamic-update-
slice into a carried buffer) is typed as the whole buffer but writes only its update, so it is listed
apart (``in_place``) and not counted as written.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["Instruction", "TickTraffic", "tick_traffic"]

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_ITEMSIZE |= {"f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
# Instructions that only name, pass or regroup buffers (they write nothing).
_PASSING = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "conditional", "while"})


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def _bytes(shape: str) -> int:
    return sum(math.prod(dims) * _ITEMSIZE[dt] for dt, dims in _arrays(shape))


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str
    name: str
    opcode: str  # a fusion's is "fusion:<its root's opcode>"
    shape: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TickTraffic:
    """The tick loop of a compiled step.

    Attributes:
        ticks: the loop's trip count (None when XLA does not know it).
        carried: the loop-carried arrays, ``(dtype, dims)`` each.
        instructions: the body's instructions and its conditionals' branches' (not fusions' insides).
    """

    ticks: int | None
    carried: tuple[tuple[str, tuple[int, ...]], ...]
    instructions: tuple[Instruction, ...]

    def carried_bytes(self) -> int:
        return sum(math.prod(dims) * _ITEMSIZE[dt] for dt, dims in self.carried)

    def _is_carried(self, ins: Instruction) -> bool:
        arrays = _arrays(ins.shape)
        return len(arrays) == 1 and arrays[0] in self.carried and ins.bytes > 0

    def whole_buffer_moves(self) -> list[Instruction]:
        """Copies of, and scatters into, a buffer shaped as a loop-carried one: each moves (or
        walks) the whole buffer."""
        return [
            ins
            for ins in self.instructions
            if self._is_carried(ins) and (ins.opcode in ("copy", "scatter") or ins.opcode.startswith("fusion:scatter"))
        ]

    def in_place(self) -> list[Instruction]:
        """Dynamic-update-slices into a loop-carried buffer (they write only their update)."""
        return [ins for ins in self.instructions if ins.opcode.endswith("dynamic-update-slice")]

    def writing(self, shape: str) -> list[Instruction]:
        """The instructions whose output is typed ``shape`` (e.g. ``"f32[4096]"``) and that write it,
        in place or not (those that only name, pass or regroup it left out)."""
        return [ins for ins in self.instructions if shape in ins.shape and ins.opcode not in _PASSING]

    def written_by_opcode(self) -> dict[str, tuple[int, int]]:
        """``opcode -> (count, output bytes)`` of the instructions that write (in-place updates and
        instructions that only pass buffers left out)."""
        out: dict[str, list[int]] = {}
        for ins in self.instructions:
            if ins.opcode in _PASSING or ins.opcode.endswith("dynamic-update-slice"):
                continue
            entry = out.setdefault(ins.opcode, [0, 0])
            entry[0] += 1
            entry[1] += ins.bytes
        return {op: (n, b) for op, (n, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}

    def summary(self) -> str:
        lines = [
            f"tick loop: {self.ticks} ticks, {len(self.carried)} carried buffers "
            f"({self.carried_bytes() / 2**20:.2f} MiB), {len(self.instructions)} instructions"
        ]
        moves = self.whole_buffer_moves()
        lines.append(
            f"whole carried buffers copied or scattered into: {len(moves)} "
            f"({sum(i.bytes for i in moves) / 2**20:.2f} MiB)"
        )
        lines += [f"  {i.opcode} {i.shape} in {i.computation}" for i in moves]
        lines.append(f"in-place updates of carried buffers: {len(self.in_place())}")
        lines.append("written, by opcode (count, MiB):")
        lines += [f"  {op:34s} {n:5d} {b / 2**20:10.3f}" for op, (n, b) in self.written_by_opcode().items()]
        return "\n".join(lines)


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = m.group(1)
                comps[current] = []
        elif line.startswith("}"):
            current = None
        else:
            comps[current].append(line.strip())
    return comps


def _parse(line: str):
    m = _INSTRUCTION.match(line)
    return None if m is None else m.groups()  # name, shape, opcode, rest


def _root_opcode(lines: list[str]) -> str:
    for line in lines:
        if line.startswith("ROOT "):
            parsed = _parse(line)
            return parsed[2] if parsed else "?"
    return "?"


def tick_traffic(compiled) -> TickTraffic:
    """The tick loop of ``compiled`` (a ``jax.stages.Compiled`` or its ``as_text()``)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps = _computations(text)
    loops = []
    for lines in comps.values():
        for line in lines:
            parsed = _parse(line)
            if parsed and parsed[2] == "while":
                body = re.search(r"body=%([\w.\-]+)", parsed[3])
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', parsed[3])
                loops.append((_bytes(parsed[1]), parsed[1], body.group(1), int(trips.group(1)) if trips else None))
    if not loops:
        raise ValueError("no while loop in this program: is it a pipelined step?")
    _, carried_shape, body, ticks = max(loops, key=lambda loop: loop[0])
    instructions, todo, seen = [], [body], set()
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for line in comps[comp]:
            parsed = _parse(line)
            if parsed is None:
                continue
            name, shape, opcode, rest = parsed
            if opcode == "fusion":
                called = re.search(r"calls=%([\w.\-]+)", rest)
                opcode = f"fusion:{_root_opcode(comps.get(called.group(1), [])) if called else '?'}"
            elif opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                if branches:
                    todo += re.findall(r"%([\w.\-]+)", branches.group(1))
                for key in ("true_computation", "false_computation"):
                    m = re.search(key + r"=%([\w.\-]+)", rest)
                    if m:
                        todo.append(m.group(1))
            instructions.append(Instruction(comp, name, opcode, shape, _bytes(shape)))
    carried = tuple(dict.fromkeys(a for a in _arrays(carried_shape) if math.prod(a[1]) > 1))
    return TickTraffic(ticks, carried, tuple(instructions))
