"""An online profiler that adapts the memory policy as the program changes (after Chameleon, arXiv
2509.11076; our design in JAX terms -- the paper's exact algorithms were not available).

In JAX a changed operator sequence is a new trace and compile: new input shapes (sequence buckets),
or Python control flow (layer drop decided in Python). Per call the profiler computes a cheap
signature -- shapes and dtypes of the batch, the static arguments, and, in ``fingerprint`` mode, a
hash of the traced program -- and dispatches to the program cached for it. On a new signature it:

1. profiles from compile-time facts: the simulated step time (FLOPs, recompute, host transfers) of
   every policy on a ladder (save-all, selective, recompute-all, then offload), which compiles
   nothing, then the ledger's device bytes of the policies in the order step 2 prefers them until
   one fits. The ledger's working sets are derived (``jaxmem.memory.working_sets("derived")``): from
   one compiled for the same stage role and policy at another length or depth, scaled by the
   activation volume -- so only the model's first signature compiles stage backwards (at most two
   per stage role for each policy it prices), later lengths and dropped layers none;
2. picks the fastest policy predicted to fit the budget (with a safety margin learned from how
   compiled figures compared with predictions so far) and compiles it -- the compile the change
   needs anyway;
3. checks the compiled program's ``memory_analysis()`` against the budget before running it; if it
   does not fit, escalates once along the ladder (more recompute, then offload) to a policy whose
   corrected prediction fits -- at most one profiling compile beyond the needed one -- and if nothing
   fits, raises :class:`BudgetError` with the deficit in bytes;
4. refines from measured step times: per policy, the ratio of measured to simulated step time is
   tracked (with limited information, the simulator's figure; then the measured correction), so
   later signatures rank policies by what they really cost here. A policy never run borrows the mean
   correction of the others, so its rank stays the simulator's until it is measured;
5. explores and switches: once a signature's program has a few timed steps, and again whenever a
   probe has settled, it may compile another policy for that signature in a background thread while
   training goes on -- one measured faster elsewhere, if this signature's expected share of the rest
   of the run repays the compile twice; otherwise the fastest-predicted policy never measured, if
   the rest of the run is worth ``payback`` compiles. That is how the simulator's blind spots get
   measured (on CPU, full recompute is faster than it predicts; ``benchmarks/policy_times.py``).
   It is the signature's one profiling compile beyond the needed one. The probe runs a few steps
   (every policy computes the same gradients), the chosen program is timed again right after it,
   the faster is kept, and both measurements become corrections. One background compile runs at a
   time; a compiled probe over the budget is dropped without running.

Offload saves no device memory on CPU (XLA:CPU does not lower it), so on CPU the default ladder holds
only recompute policies and every budget check is a measured ``memory_analysis()`` figure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from jaxmem._errors import JaxmemError
from jaxmem.memory import compiled_bytes, estimate, get_hardware, host_bytes_counted_as_device, working_sets

__all__ = ["LADDER", "AdaptiveProfiler", "BudgetError", "SignatureRecord", "choose_policy", "escalate_policy"]

LADDER = ("save-all", "selective", "recompute-all", "offload-stash")
# XLA:CPU does not lower host offload, so on CPU only recompute really lowers device memory.
CPU_LADDER = ("save-all", "selective", "recompute-all")
PROBE_STEPS = 3  # a warm-up step, then timed steps: of a new program, and of an explored policy


LOWEST = 19  # the nice value of a background compile's threads


def _yield_to_steps() -> None:
    """Give the calling (background) thread the lowest scheduling priority: on Linux a thread is a
    task with its own nice value (threads it starts inherit it), so a probe's lowering takes the cores
    when the training steps leave them idle instead of slowing the steps down. Elsewhere, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
    except (AttributeError, OSError):  # not Linux, or not allowed: the compile shares the cores
        pass


def thread_cpu_ticks() -> dict[int, int]:
    """CPU time (clock ticks) each thread of this process has used so far, by native thread id, read
    from /proc; empty where there is no /proc (not Linux)."""
    ticks = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return ticks
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


class CompileThreads:
    """The threads XLA compiles on, and a way to lower their priority while a background compile runs.

    XLA compiles on a pool of its own, not on the thread that asks: a background thread's own nice
    value does not reach the compile (measured: a compile started from a nice-19 thread spent all its
    CPU time on three pool threads at nice 0, and an exploring compile slowed the steps beside it by
    6-15%). The pool's threads are learnt by watching a foreground compile -- the threads besides the
    caller that use CPU while it runs (no step runs then: the profiler's steps are synchronous) -- and
    are given the lowest priority for the length of a background compile, then their own back."""

    def __init__(self):
        self.known: set[int] = set()
        self._lock = threading.Lock()

    def watch(self, compile_fn):
        """Run a foreground ``compile_fn()`` and learn which threads it used."""
        before = thread_cpu_ticks()
        try:
            return compile_fn()
        finally:
            after = thread_cpu_ticks()
            me = threading.get_native_id()
            used = {t for t, n in after.items() if t != me and n > before.get(t, 0)}
            with self._lock:
                self.known |= used

    def lowered(self, compile_fn):
        """Run a background ``compile_fn()`` with the known compile threads at the lowest priority."""
        with self._lock:
            threads = set(self.known)
        kept = {}
        for tid in threads:
            try:
                kept[tid] = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
            except (AttributeError, OSError):  # gone, not Linux, or not allowed
                pass
        try:
            return compile_fn()
        finally:
            for tid, nice in kept.items():
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                except OSError:  # raising priority needs CAP_SYS_NICE: it stays low (idle cores still run it)
                    pass


class BudgetError(JaxmemError):
    """No policy fits the device-memory budget; carries the deficit in bytes."""

    def __init__(self, message: str, deficit: int):
        super().__init__(message)
        self.deficit = deficit


def choose_policy(predictions: dict, budget: float, *, margin: float = 1.0, neighbour=None, what: str = "") -> str:
    """The policy the profiler compiles first for a signature: of ``predictions`` (policy -> (device
    bytes, expected seconds, simulated seconds), in ladder order), the fastest expected whose bytes x
    ``margin`` (compiled / predicted, learned) fit ``budget``; among equals the ``neighbour``'s (the
    choice for the nearest known signature), then the earlier on the ladder. A pure function: no
    compile, no state.

    >>> choose_policy({"save-all": (9, 1.0, 1.0), "selective": (5, 1.1, 1.1)}, 6)
    'selective'
    """
    ladder = list(predictions)
    fitting = [p for p in ladder if predictions[p][0] * margin <= budget]
    if not fitting:
        smallest = min(b for b, *_ in predictions.values())
        raise BudgetError(
            f"no policy fits {budget / 2**20:,.1f} MiB per device for {what}: the smallest prediction is "
            f"{smallest / 2**20:,.1f} MiB ({(smallest - budget) / 2**20:,.1f} MiB short)",
            int(smallest - budget),
        )
    return min(fitting, key=lambda p: (round(predictions[p][1], 9), p != neighbour, ladder.index(p)))


def escalate_policy(predictions: dict, budget: float, choice: str, measured: float, *, what: str = "") -> str:
    """After ``choice`` compiled to ``measured`` bytes over ``budget``: the fastest policy further up
    the ladder whose prediction, scaled by that miss (measured / predicted), fits; else a BudgetError."""
    ladder = list(predictions)
    ratio = measured / predictions[choice][0]
    later = [p for p in ladder[ladder.index(choice) + 1 :] if predictions[p][0] * ratio <= budget]
    if not later:
        raise BudgetError(
            f"{choice} compiled to {measured / 2**20:,.1f} MiB for {what}, over the {budget / 2**20:,.1f} MiB "
            f"budget, and no stronger policy is predicted to fit (deficit {(measured - budget) / 2**20:,.1f} MiB)",
            int(measured - budget),
        )
    return min(later, key=lambda p: predictions[p][1])


@dataclasses.dataclass
class SignatureRecord:
    """What the profiler knows about one program signature."""

    signature: tuple
    label: str
    policy: str
    predicted_bytes: int
    compiled_bytes: int
    compiles: int
    adapt_seconds: float  # profiling + compiles for this signature
    escalated: bool = False
    seen: int = 0
    step_seconds: list = dataclasses.field(default_factory=list)
    predicted_step_seconds: float = 0.0
    simulated_step_seconds: float = 0.0
    flops: float | None = None
    explored: dict | None = None  # the policy tried beside the chosen one, its measured step time, kept?

    def to_json(self) -> dict:
        times = self.step_seconds[1:] or self.step_seconds
        return {
            "signature": self.label,
            "policy": self.policy,
            "predicted_device_bytes": self.predicted_bytes,
            "compiled_device_bytes": self.compiled_bytes,
            "compiles": self.compiles,
            "escalated": self.escalated,
            "adapt_seconds": self.adapt_seconds,
            "step_seconds": sum(times) / len(times) if times else None,
            "predicted_step_seconds": self.predicted_step_seconds,
            "times_seen": self.seen,
            "cost_analysis_flops": self.flops,
            "explored": self.explored,
        }


@dataclasses.dataclass
class _Probe:
    """A policy compiled beside a signature's program, to measure what it really costs here."""

    policy: str
    future: Future  # -> (compiled step, compiled device bytes, predicted device bytes)
    simulated_step_seconds: float
    reason: str  # "never measured" or "measured faster elsewhere"
    times: list = dataclasses.field(default_factory=list)  # the probe's steps (first: warm-up)
    rematch: list = dataclasses.field(default_factory=list)  # the chosen program's, right after


@dataclasses.dataclass
class _Program:
    policy: str
    step: Callable
    record: SignatureRecord
    predictions: dict  # policy -> (device bytes, expected seconds, simulated seconds) at first sight
    probe: _Probe | None = None
    checked: int = -1  # the profiler's settled-probe count when exploring was last considered


class AdaptiveProfiler:
    """Wraps a pipelined train step and keeps every program it runs within ``budget_bytes`` of device
    memory per device.

    ``step(state, batch, drop_layers=frozenset())`` runs one step (``state`` has ``params``,
    ``opt_state`` and ``step``); the signature is the batch's shapes, the dropped layers, and
    (``fingerprint=True``) a hash of the traced program.

    Args:
        pipeline: the base pipeline (its model, schedule, mesh and stage split are kept; the policy
            is what the profiler chooses).
        budget_bytes: device bytes per device every compiled program must fit.
        build_step: ``(pipeline, batch_spec) -> jitted step`` taking ``(params, opt_state, batch)``
            and returning ``(params, opt_state, loss)``, or a dict of metrics with ``"loss"`` in place of
            the loss (e.g. :meth:`jaxmem.train.Trainer.build_step`).
        batch_sharding: how a batch is laid out over the mesh (default: split over ``data``).
        policies: the escalation ladder, cheapest first.
        fingerprint: also hash the traced program (for Python control flow the arguments do not show).
        hardware: profile for the cost model (default: this machine's CPU, measured).
        margin: initial safety factor on predictions (compiled / predicted), then learned.
        explore: try another policy beside a signature's program (step 5 above): compiled in a
            background thread, run for a few steps (same gradients), the faster of the two kept.
        horizon: steps the run is expected to take (``None``: unknown, assumed long enough to repay
            any compile); decides whether exploring or switching pays.
        payback: how many compile times the rest of the run must be worth before one is spent on
            measuring a policy never run.
    """

    def __init__(
        self,
        pipeline,
        budget_bytes: float,
        *,
        build_step: Callable,
        batch_sharding=None,
        policies=None,
        fingerprint: bool = False,
        hardware=None,
        margin: float = 1.02,
        explore: bool = True,
        horizon: int | None = None,
        payback: float = 10.0,
    ):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.base = pipeline
        self.build_step = build_step
        self.batch_sharding = batch_sharding or NamedSharding(pipeline.mesh, P(("data", "fsdp")))
        self.budget = float(budget_bytes)
        if policies is None:
            policies = CPU_LADDER if jax.devices()[0].platform == "cpu" else LADDER
        self.policies = tuple(policies)
        self.correction: dict[str, float] = {}  # policy -> measured / simulated step time
        self.fingerprint = fingerprint
        self.hardware = get_hardware(hardware or "cpu")
        self.margin = margin  # compiled / predicted, learned
        self.programs: dict[tuple, _Program] = {}
        self.records: list[SignatureRecord] = []
        self.compile_count = 0
        self.prediction_count = 0  # policies priced by the ledger (each may compile a working set once)
        self.compile_seconds: list[float] = []  # every compile, foreground and background
        self.background_compile_seconds: list[float] = []  # the exploring ones (off the step's path)
        self.last_policy: str | None = None  # the policy of the program the last step ran
        self.overhead_seconds = 0.0
        self.calls = 0
        self.explore, self.horizon, self.payback = explore, horizon, payback
        self._pool: ThreadPoolExecutor | None = None
        self._compile_threads = CompileThreads()
        self._inflight: Future | None = None
        self._settled = 0  # probes settled so far (each may change what is worth exploring)

    # ----------------------------------------------------------------- signature
    def signature(self, batch, drop_layers=frozenset(), fingerprint_fn=None) -> tuple:
        tokens = batch["tokens"]
        sig = (tuple(tokens.shape), str(tokens.dtype), tuple(sorted(drop_layers)))
        extra = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in batch.items() if k != "tokens"))
        if extra != (("targets", tuple(tokens.shape), str(tokens.dtype)),):
            sig += (extra,)
        if self.fingerprint and fingerprint_fn is not None:
            # A fresh function each time: tracing caches by function identity, which would hide
            # exactly the Python-side changes this is meant to see.
            text = str(jax.make_jaxpr(lambda t: fingerprint_fn(t))(tokens))
            sig += (hashlib.sha1(text.encode()).hexdigest()[:12],)
        return sig

    @staticmethod
    def label(sig: tuple) -> str:
        shape, _, drop = sig[:3]
        text = f"batch {shape[0]} x seq {shape[1]}"
        if drop:
            text += f", drop layers {list(drop)}"
        for extra in sig[3:]:
            text += f", program {extra}" if isinstance(extra, str) else f", batch {[k for k, *_ in extra]}"
        return text

    # ----------------------------------------------------------------- profiling
    def _pipeline(self, policy: str, drop_layers):
        return self.base.with_policy(policy, drop_layers)

    def predict(self, policy: str, batch: int, seq: int, drop_layers) -> tuple[float, float, float]:
        """(predicted device bytes, expected step seconds, simulated step seconds) of a policy;
        expected = simulated x the measured correction for that policy (when known). The working set
        is the ledger's (compiled, once per stage role, policy and length); the profiler itself scores
        with derived ones (:meth:`_scores`)."""
        result = self._estimate(policy, batch, seq, drop_layers, memory=True)
        seconds = result.step_seconds
        return result.device_bytes, seconds * self._factor(policy), seconds

    def _estimate(self, policy: str, batch: int, seq: int, drop_layers, *, memory: bool):
        base = self.base
        return estimate(
            base.model,
            base.schedule,
            policy,
            batch=batch,
            seq=seq,
            data_parallel=base.data,
            fsdp=base.fsdp,
            tensor=base.tensor,
            context=base.context,
            zero=base.zero,
            vocab_parallel=base.vocab is not None,
            layer_counts=base.layer_counts,
            drop_layers=drop_layers,
            hardware=self.hardware,
            split_backward=base.split_backward,
            hand_recomputed=base.hand_recomputed,
            memory=memory,
        )

    def _seconds(self, policy: str, batch: int, seq: int, drop_layers) -> tuple[float, float]:
        """(expected, simulated) step seconds of a policy: the time model reads no working set, so
        none is compiled or derived for it."""
        with working_sets("none"):
            seconds = self._estimate(policy, batch, seq, drop_layers, memory=False).step_seconds
        return seconds * self._factor(policy), seconds

    def _device_bytes(self, policy: str, batch: int, seq: int, drop_layers) -> float:
        """The ledger's device bytes of a policy with derived working sets: from one compiled for the
        same stage role and policy at another length or depth, scaled by the activation volume (no
        compile once one is known; the program's own compile confirms the pick)."""
        self.prediction_count += 1
        with working_sets("derived"):
            return self._estimate(policy, batch, seq, drop_layers, memory=True).device_bytes

    def _scores(self, batch: int, seq: int, drop_layers, neighbour=None) -> tuple[dict, str | None]:
        """Every policy's (device bytes, expected seconds, simulated seconds), the bytes priced lazily:
        in the order :func:`choose_policy` prefers them (fastest expected first), until one fits the
        budget (x the learned margin) -- the policies it would pass over are priced, the slower
        ones left None (priced when escalating or exploring needs them). Returns the scores and the
        first that fits (None: none does; all priced)."""
        times = {p: self._seconds(p, batch, seq, drop_layers) for p in self.policies}
        scores = {p: (None, *times[p]) for p in self.policies}
        order = sorted(self.policies, key=lambda p: (round(times[p][0], 9), p != neighbour, self.policies.index(p)))
        for p in order:
            scores[p] = (self._device_bytes(p, batch, seq, drop_layers), *times[p])
            if scores[p][0] * self.margin <= self.budget:
                return scores, p
        return scores, None

    def _priced(self, scores: dict, batch: int, seq: int, drop_layers) -> dict:
        """``scores`` with every policy's bytes priced."""
        return {
            p: s if s[0] is not None else (self._device_bytes(p, batch, seq, drop_layers), *s[1:])
            for p, s in scores.items()
        }

    def _factor(self, policy: str) -> float:
        known = list(self.correction.values())
        return self.correction.get(policy, sum(known) / len(known) if known else 1.0)

    def _neighbour_policy(self, sig: tuple) -> str | None:
        """The choice made for the closest known signature (same batch and drop, nearest length)."""
        best = None
        for known, program in self.programs.items():
            if known[0][0] == sig[0][0] and known[2] == sig[2]:
                distance = abs(known[0][1] - sig[0][1])
                if best is None or distance < best[0]:
                    best = (distance, program.policy)
        return best[1] if best else None

    @staticmethod
    def _compiled_bytes(compiled, pipeline, batch) -> int:
        """memory_analysis() total, minus bytes placed on host that XLA:CPU counts as device."""

        tick, _ = pipeline.program({k: v for k, v in batch.items() if k != "rng"})
        return int(compiled_bytes(compiled) - host_bytes_counted_as_device(tick))

    @staticmethod
    def _abstract(state) -> tuple:
        def spec(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        return jax.tree.map(spec, state.params), jax.tree.map(spec, state.opt_state)

    def _batch_spec(self, batch) -> dict:
        """The step's arguments beside the state as shapes: the batch split over ``data``, a dropout
        model's step key (``rng``) replicated."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        replicated = NamedSharding(self.base.mesh, P())
        return {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated if k == "rng" else self.batch_sharding)
            for k, v in batch.items()
        }

    def _compile(self, pipeline, batch, abstract_state: tuple, *, background: bool = False):
        start = time.perf_counter()
        spec = self._batch_spec(batch)
        step = self.build_step(pipeline, spec)
        lowered = step.lower(*abstract_state, spec)
        # A background compile runs with XLA's compile threads at the lowest priority, so the steps
        # beside it keep the cores; a foreground one teaches which threads those are.
        compiled = (self._compile_threads.lowered if background else self._compile_threads.watch)(lowered.compile)
        self.compile_count += 1
        self.compile_seconds.append(time.perf_counter() - start)
        if background:
            self.background_compile_seconds.append(self.compile_seconds[-1])
        return compiled

    def _adapt(self, sig: tuple, batch, drop_layers, state) -> _Program:
        start = time.perf_counter()
        size, seq = batch["tokens"].shape
        neighbour = self._neighbour_policy(sig)
        predictions, choice = self._scores(size, seq, drop_layers, neighbour)
        if choice is None:  # raises BudgetError, naming the smallest prediction
            choose_policy(predictions, self.budget, margin=self.margin, what=self.label(sig))
        abstract_state = self._abstract(state)
        pipeline = self._pipeline(choice, drop_layers)
        compiled = self._compile(pipeline, batch, abstract_state)
        measured = self._compiled_bytes(compiled, pipeline, batch)
        compiles, escalated = 1, False
        self.margin = max(1.0, self.margin * 0.5 + 0.5 * measured / predictions[choice][0])
        if measured > self.budget:
            predictions = self._priced(predictions, size, seq, drop_layers)
            choice = escalate_policy(predictions, self.budget, choice, measured, what=self.label(sig))
            pipeline = self._pipeline(choice, drop_layers)
            compiled = self._compile(pipeline, batch, abstract_state)
            measured = self._compiled_bytes(compiled, pipeline, batch)
            compiles, escalated = 2, True
            if measured > self.budget:
                raise BudgetError(
                    f"even {choice} compiles to {measured / 2**20:,.1f} MiB for {self.label(sig)} "
                    f"(budget {self.budget / 2**20:,.1f} MiB, deficit {(measured - self.budget) / 2**20:,.1f} MiB)",
                    int(measured - self.budget),
                )
        flops = None
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops = float(cost.get("flops")) if cost and cost.get("flops") is not None else None
        except Exception:  # noqa: BLE001 -- cost analysis is optional and backend-dependent
            flops = None
        record = SignatureRecord(
            sig,
            self.label(sig),
            choice,
            int(predictions[choice][0]),
            measured,
            compiles,
            time.perf_counter() - start,
            escalated,
            predicted_step_seconds=predictions[choice][1],
            simulated_step_seconds=predictions[choice][2],
            flops=flops,
        )
        self.records.append(record)
        return _Program(choice, compiled, record, predictions)

    # ----------------------------------------------------------------- running
    def step(self, state, batch, drop_layers=frozenset(), fingerprint_fn=None):
        """One step through the program for this call's signature (compiled and checked on first sight);
        ``batch`` is a batch dict (``tokens``, ``targets``, ...) of global arrays."""
        begin = time.perf_counter()
        sig = self.signature(batch, drop_layers, fingerprint_fn)
        program = self.programs.get(sig)
        if program is None:
            self.overhead_seconds += time.perf_counter() - begin
            program = self._adapt(sig, batch, frozenset(drop_layers), state)
            self.programs[sig] = program
            begin = time.perf_counter()
        self.calls += 1
        quiet = self._inflight is None or self._inflight.done()  # no compile competing for the cores
        probe = program.probe
        if probe is not None and not (probe.future.done() and self._probe_runnable(program)):
            probe = None  # still compiling, or dropped
        probing = probe is not None and len(probe.times) < PROBE_STEPS
        run = probe.future.result()[0] if probing else program.step
        self.last_policy = probe.policy if probing else program.policy
        start = time.perf_counter()
        params, opt_state, loss = run(state.params, state.opt_state, batch)
        if isinstance(loss, dict):  # a step that returns metrics beside the loss
            loss = loss["loss"]
        jax.block_until_ready(loss)
        end = time.perf_counter()
        elapsed = end - start
        state = dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1)
        record = program.record
        record.seen += 1
        if probing:
            probe.times.append(elapsed)
        else:
            record.step_seconds.append(elapsed)
            if probe is not None:  # the probe has run: time the chosen program again, as quietly
                probe.rematch.append(elapsed)
                if len(probe.rematch) >= PROBE_STEPS - 1:
                    self._settle(program)
            elif quiet:
                self._refine(record)
            self._maybe_explore(program, batch, sig[2], state)
        self.overhead_seconds += (start - begin) + (time.perf_counter() - end)
        return state, loss

    def _refine(self, record: SignatureRecord) -> None:
        """Track measured / simulated step time per policy (the first, warm-up step is skipped)."""
        times = record.step_seconds[1:]
        if times and record.simulated_step_seconds > 0:
            ratio = times[-1] / record.simulated_step_seconds
            factor = self.correction.get(record.policy)
            self.correction[record.policy] = ratio if factor is None else 0.8 * factor + 0.2 * ratio

    # ----------------------------------------------------------------- exploring
    def _maybe_explore(self, program: _Program, batch, drop_layers, state) -> None:
        """Perhaps start compiling, in the background, another policy for this signature: one measured
        faster elsewhere (to switch to), or else the fastest-predicted one never measured (to learn
        its real cost). Looked at again whenever a probe has settled, until the signature has had its
        one profiling compile."""
        record = program.record
        if not self.explore or record.compiles > 1 or program.checked == self._settled:
            return  # a signature that escalated has had its one profiling compile
        if len(record.step_seconds) < PROBE_STEPS or (self._inflight is not None and not self._inflight.done()):
            return  # the chosen program's own time first; one background compile at a time
        probes = [p.probe for p in self.programs.values() if p.probe is not None]
        if any(probe.times for probe in probes):
            return  # a probe is being timed: no compile may compete with it
        program.checked = self._settled
        waiting = {probe.policy for probe in probes}
        fitting = [
            p
            for p in self.policies
            if p != program.policy
            and p not in waiting  # compiled for another signature, to run when it recurs
            # Not priced yet (slower than the pick): priced beside the probe's compile, off the step's path.
            and (program.predictions[p][0] is None or program.predictions[p][0] * self.margin <= self.budget)
        ]
        current = statistics.median(record.step_seconds[1:][-2 * PROBE_STEPS :])
        compile_seconds = statistics.mean(self.compile_seconds)
        remaining = None if self.horizon is None else self.horizon - self.calls
        # Switch: a measured policy expected faster here, if this signature's share of the rest of
        # the run pays for the compile twice over.
        expected = {p: program.predictions[p][2] * self.correction[p] for p in fitting if p in self.correction}
        share = None if remaining is None else remaining * record.seen / self.calls
        gains = {
            p: current - t
            for p, t in expected.items()
            if t < 0.95 * current and (share is None or (current - t) * share >= 2 * compile_seconds)
        }
        if gains:
            policy, reason = max(gains, key=gains.get), "measured faster elsewhere"
        else:
            # Learn: an unmeasured policy, if the rest of the run is worth `payback` compiles.
            unmeasured = [p for p in fitting if p not in self.correction]
            if not unmeasured or (remaining is not None and remaining * current < self.payback * compile_seconds):
                return
            policy = min(
                unmeasured, key=lambda p: (program.predictions[p][2] * self._factor(p), self.policies.index(p))
            )
            reason = "never measured"
        pipeline = self._pipeline(policy, frozenset(drop_layers))
        abstract_state = self._abstract(state)
        spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}

        predicted_bytes, _, simulated = program.predictions[policy]
        size, seq = batch["tokens"].shape

        def build():
            _yield_to_steps()
            predicted = predicted_bytes
            if predicted is None:
                predicted = self._device_bytes(policy, size, seq, frozenset(drop_layers))
                program.predictions[policy] = (predicted, *program.predictions[policy][1:])
                if predicted * self.margin > self.budget:
                    return None, None, predicted  # predicted over the budget: not compiled
            compiled = self._compile(pipeline, spec, abstract_state, background=True)
            return compiled, self._compiled_bytes(compiled, pipeline, spec), predicted

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxmem-profiler")
        record.compiles += 1  # the one profiling compile beyond the needed one
        self._inflight = self._pool.submit(build)
        program.probe = _Probe(policy, self._inflight, simulated, reason)

    def _probe_runnable(self, program: _Program) -> bool:
        """A compiled probe runs only if it fits the budget; one that failed or does not fit is dropped."""
        probe = program.probe
        error = probe.future.exception()
        compiled = None if error is not None else probe.future.result()
        if compiled is not None and compiled[0] is not None and compiled[1] <= self.budget:
            return True
        if error is not None:
            why = f"compile failed: {error}"
        elif compiled[0] is None:
            why = "predicted over the budget; not compiled"
        else:
            why = "compiled over the budget; never run"
        program.record.explored = {"policy": probe.policy, "reason": probe.reason, "kept": False, "why": why}
        program.probe = None
        return False

    def _settle(self, program: _Program) -> None:
        """Compare the probe with the chosen program (both timed without a compile running, warm-up
        steps skipped); keep the faster and learn the probed policy's real cost."""
        probe, record = program.probe, program.record
        probed, current = statistics.median(probe.times[1:]), statistics.median(probe.rematch)
        if probe.simulated_step_seconds > 0:
            self.correction[probe.policy] = probed / probe.simulated_step_seconds
        if record.simulated_step_seconds > 0:
            self.correction[program.policy] = current / record.simulated_step_seconds
        keep = probed < current
        record.explored = {
            "policy": probe.policy,
            "reason": probe.reason,
            "step_seconds": probed,
            "instead_of": program.policy,
            "instead_of_step_seconds": current,
            "kept": keep,
        }
        if keep:
            compiled, compiled_bytes, predicted_bytes = probe.future.result()
            program.policy, program.step = probe.policy, compiled
            record.policy, record.compiled_bytes = probe.policy, compiled_bytes
            record.predicted_bytes = int(predicted_bytes)
            record.simulated_step_seconds = probe.simulated_step_seconds
            record.predicted_step_seconds = program.predictions[probe.policy][1]
            record.step_seconds = list(probe.times)
        program.probe = None
        self._settled += 1

    def close(self) -> None:
        """Wait for a background compile still running, and release its thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ----------------------------------------------------------------- reporting
    def report(self) -> dict:
        return {
            "budget_bytes": int(self.budget),
            "signatures": [r.to_json() for r in self.records],
            "compiles": self.compile_count,
            "calls": self.calls,
            "compile_seconds": list(self.compile_seconds),
            "background_compile_seconds": list(self.background_compile_seconds),
            "profiler_overhead_seconds": self.overhead_seconds,
            "margin": self.margin,
            "time_correction": dict(self.correction),
            "hardware": self.hardware.to_json(),
        }

    def write_report(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.report(), f, indent=2)
