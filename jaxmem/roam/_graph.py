"""A dataflow graph of a jaxpr: ops (equations) and tensors (variables) with their sizes.

Calls to nested jaxprs that only package code -- ``jit``/``pjit``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``, ``checkpoint`` (remat), ``name`` -- are inlined, so their insides can be
reordered. Control flow (``scan``, ``while``, ``cond``) stays one op whose transient memory is the
inner jaxpr's own peak in program order.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxmem.roam._liveness import peak

__all__ = ["ELEMENTWISE", "Graph", "Op", "build_graph", "fuse_elementwise"]

_INLINE = {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "checkpoint",
    "remat",
    "remat2",
}


@dataclasses.dataclass
class Op:
    """One operation: consumes and produces tensors (ids), holds ``transient`` extra bytes while it runs."""

    index: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    transient: int = 0
    eqn: object = dataclasses.field(default=None, repr=False)
    # For execution: the equation's input/output variables in this graph's tensor ids (None = literal).
    literal_inputs: tuple = ()
    parts: list = dataclasses.field(default_factory=list, repr=False)  # fused ops: the original ops


@dataclasses.dataclass
class Graph:
    """Ops in program order, tensor sizes in bytes, graph inputs (and which are donated) and outputs."""

    ops: list[Op]
    sizes: list[int]
    inputs: list[int]
    donated: set[int]
    outputs: list[int]
    producer: list[int | None] = dataclasses.field(default_factory=list)
    consumers: list[list[int]] = dataclasses.field(default_factory=list)
    avals: list = dataclasses.field(default_factory=list, repr=False)
    const_values: dict = dataclasses.field(default_factory=dict, repr=False)

    def finalize(self) -> Graph:
        self.producer = [None] * len(self.sizes)
        self.consumers = [[] for _ in self.sizes]
        for op in self.ops:
            for t in op.outputs:
                self.producer[t] = op.index
            for t in dict.fromkeys(op.inputs):
                self.consumers[t].append(op.index)
        return self

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def predecessors(self, op: Op) -> set[int]:
        return {self.producer[t] for t in op.inputs if self.producer[t] is not None}


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = 4
    return int(math.prod(shape)) * itemsize


def _inner_jaxpr(eqn):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        value = eqn.params.get(key)
        if value is not None:
            return value
    return None


def _program_order_peak(jaxpr) -> int:
    """Peak bytes of a (closed) jaxpr's intermediates in program order (for ops left whole)."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    graph = build_graph(inner, donated=(), inputs_are_free=True)
    return peak(graph, list(range(graph.num_ops))).peak


def build_graph(jaxpr, donated=(), inputs_are_free: bool = False) -> Graph:
    """Graph of a jaxpr (or ClosedJaxpr). ``donated``: indices of inputs the caller hands over (they may
    be freed after their last use; other inputs stay alive throughout). With ``inputs_are_free``
    the inputs cost nothing (used for the inner peak of control-flow bodies)."""
    closed = jaxpr
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    consts = list(getattr(closed, "consts", []) or [])
    sizes: list[int] = []
    avals: list = []
    ops: list[Op] = []
    const_values: dict[int, object] = {}

    def new_tensor(aval) -> int:
        sizes.append(_nbytes(aval))
        avals.append(aval)
        return len(sizes) - 1

    env: dict = {}
    inputs = []
    for v in jaxpr.invars:
        env[v] = new_tensor(v.aval)
        inputs.append(env[v])
    for v, value in zip(jaxpr.constvars, consts):
        env[v] = new_tensor(v.aval)
        const_values[env[v]] = value
        inputs.append(env[v])
    if inputs_are_free:
        for t in inputs:
            sizes[t] = 0

    from jax.extend.core import Literal

    def emit(eqns, env):
        for eqn in eqns:
            inner = _inner_jaxpr(eqn) if eqn.primitive.name in _INLINE else None
            if inner is not None:
                inner_jaxpr = getattr(inner, "jaxpr", inner)
                inner_consts = list(getattr(inner, "consts", []) or [])
                sub = {}
                for iv, ov in zip(inner_jaxpr.invars, eqn.invars):
                    if isinstance(ov, Literal):
                        t = new_tensor(iv.aval)
                        const_values[t] = ov.val
                        inputs.append(t)
                        sizes[t] = 0
                        sub[iv] = t
                    else:
                        sub[iv] = env[ov]
                for cv, value in zip(inner_jaxpr.constvars, inner_consts):
                    t = new_tensor(cv.aval)
                    const_values[t] = value
                    inputs.append(t)
                    sub[cv] = t
                emit(inner_jaxpr.eqns, sub)
                for ov, iv in zip(eqn.outvars, inner_jaxpr.outvars):
                    if isinstance(iv, Literal):
                        t = new_tensor(ov.aval)
                        const_values[t] = iv.val
                        inputs.append(t)
                        env[ov] = t
                    else:
                        env[ov] = sub[iv]
                continue
            ins = tuple(None if isinstance(v, Literal) else env[v] for v in eqn.invars)
            outs = []
            for v in eqn.outvars:
                t = new_tensor(v.aval)
                env[v] = t
                outs.append(t)
            transient = 0
            if eqn.primitive.name in ("scan", "while", "cond"):
                bodies = []
                for key in ("jaxpr", "body_jaxpr", "cond_jaxpr", "branches"):
                    value = eqn.params.get(key)
                    if value is None:
                        continue
                    bodies.extend(value if isinstance(value, (tuple, list)) else [value])
                transient = max((_program_order_peak(b) for b in bodies), default=0)
            ops.append(
                Op(
                    len(ops),
                    eqn.primitive.name,
                    tuple(t for t in ins if t is not None),
                    tuple(outs),
                    transient,
                    eqn,
                    ins,
                )
            )

    emit(jaxpr.eqns, env)
    outputs = []
    for v in jaxpr.outvars:
        if isinstance(v, Literal):
            t = new_tensor(v.aval)
            const_values[t] = v.val
            inputs.append(t)
            outputs.append(t)
        else:
            outputs.append(env[v])
    donated_ids = {inputs[i] for i in donated if i < len(jaxpr.invars)}
    return Graph(ops, sizes, inputs, donated_ids, outputs, avals=avals, const_values=const_values).finalize()


# Primitives an eager framework runs as one fused kernel with their neighbours, and XLA fuses: their
# intermediate results need never be materialised.
ELEMENTWISE = {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "neg",
    "max",
    "min",
    "exp",
    "exp2",
    "log",
    "log1p",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "integer_pow",
    "pow",
    "square",
    "abs",
    "sign",
    "select_n",
    "convert_element_type",
    "erf",
    "erf_inv",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "stop_gradient",
    "copy",
    "copy_p",
    "name",
    "cos",
    "sin",
    "floor",
    "ceil",
    "round",
    "clamp",
    "is_finite",
    "nextafter",
    "iota",
}


def fuse_elementwise(graph: Graph) -> Graph:
    """Merge every elementwise op whose result has exactly one reader into that reader, so chains such
    as a GELU or an Adam update become one op and their intermediates take no memory (as in a fused
    kernel). Fused ops keep their parts, in order, for execution."""
    alive = {op.index: op for op in graph.ops}
    parts = {op.index: [op] for op in graph.ops}
    inputs = {op.index: list(op.inputs) for op in graph.ops}
    outputs = {op.index: list(op.outputs) for op in graph.ops}
    consumers = {t: list(c) for t, c in enumerate(graph.consumers)}
    owner = {t: graph.producer[t] for t in range(len(graph.sizes))}
    keep = set(graph.outputs)
    for op in graph.ops:  # program order: producers merge forward into their single reader
        if op.name not in ELEMENTWISE or len(op.outputs) != 1:
            continue
        t = op.outputs[0]
        readers = set(consumers[t])
        if len(readers) != 1 or t in keep:
            continue
        reader = readers.pop()
        group = owner[t]
        if reader == group:
            continue
        # Merge the producer's group into the reader's group.
        parts[reader] = parts[group] + parts[reader]
        merged_outputs = [x for x in outputs[group] if x != t] + outputs[reader]
        merged_inputs = [x for x in inputs[group] + inputs[reader] if x != t]
        for x in outputs[group]:
            owner[x] = reader
        inputs[reader], outputs[reader] = list(dict.fromkeys(merged_inputs)), merged_outputs
        for x in set(inputs[group]):
            consumers[x] = [reader if c == group else c for c in consumers[x]]
            consumers[x] = list(dict.fromkeys(consumers[x]))
        consumers[t] = []
        del alive[group], parts[group], inputs[group], outputs[group]
    new_ops, index_of = [], {}
    for old in sorted(alive):
        op = alive[old]
        fused = Op(
            len(new_ops),
            op.name if len(parts[old]) == 1 else f"fused({len(parts[old])})",
            tuple(inputs[old]),
            tuple(outputs[old]),
            sum(p.transient for p in parts[old]),
            op.eqn,
            op.literal_inputs,
        )
        fused.parts = parts[old]
        index_of[old] = fused.index
        new_ops.append(fused)
    sizes = list(graph.sizes)
    internal = {t for old in alive for p in parts[old] for t in p.outputs} - {t for old in alive for t in outputs[old]}
    for t in internal:
        sizes[t] = 0
    fused_graph = Graph(
        new_ops,
        sizes,
        list(graph.inputs),
        set(graph.donated),
        list(graph.outputs),
        avals=graph.avals,
        const_values=graph.const_values,
    )
    return fused_graph.finalize()
