"""An online profiler that adapts the memory policy as the program changes (after Chameleon, arXiv
2509.11076; our design in JAX terms -- the paper's exact algorithms were not available).

In JAX a changed operator sequence is a new trace and compile: new input shapes (sequence buckets),
or Python control flow (layer drop decided in Python). Per call the profiler computes a cheap
signature -- shapes and dtypes of the batch, the static arguments, and, in ``fingerprint`` mode, a
hash of the traced program -- and dispatches to the program cached for it. On a new signature it:

1. profiles from compile-time facts, without compiling: the analytical ledger's device bytes and the
   simulated step time (FLOPs, recompute, host transfers) of every policy on a ladder (save-all,
   selective, recompute-all, then offload), starting from the nearest known signature's choice;
2. picks the fastest policy predicted to fit the budget (with a safety margin learned from how
   compiled figures compared with predictions so far) and compiles it -- the compile the change
   needs anyway;
3. checks the compiled program's ``memory_analysis()`` against the budget before running it; if it
   does not fit, escalates once along the ladder (more recompute, then offload) to a policy whose
   corrected prediction fits -- at most one profiling compile beyond the needed one -- and if nothing
   fits, raises :class:`BudgetError` with the deficit in bytes;
4. refines from measured step times: per policy, the ratio of measured to simulated step time is
   tracked (with limited information, the simulator's figure; then the measured correction), so
   later signatures rank the policies it has run by what they really cost here. A policy never run
   borrows the mean correction of the others, so its rank against them stays the simulator's: where
   the simulator is wrong about a policy it never chooses (on CPU, full recompute is faster than it
   predicts; ``benchmarks/policy_times.py``), the profiler does not find out.

Offload saves no device memory on CPU (XLA:CPU does not lower it), so on CPU the default ladder holds
only recompute policies and every budget check is a measured ``memory_analysis()`` figure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable

import jax

from jaxmem._errors import JaxmemError

__all__ = ["AdaptiveProfiler", "BudgetError", "SignatureRecord", "LADDER"]

LADDER = ("save-all", "selective", "recompute-all", "offload-stash")
# XLA:CPU does not lower host offload, so on CPU only recompute really lowers device memory.
CPU_LADDER = ("save-all", "selective", "recompute-all")


class BudgetError(JaxmemError):
    """No policy fits the device-memory budget; carries the deficit in bytes."""

    def __init__(self, message: str, deficit: int):
        super().__init__(message)
        self.deficit = deficit


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
        }


@dataclasses.dataclass
class _Program:
    policy: str
    step: Callable
    record: SignatureRecord


class AdaptiveProfiler:
    """Wraps the pipelined train step of a :class:`jaxmem.train.Trainer` and keeps every program it
    runs within ``budget_bytes`` of device memory per device.

    ``step(state, tokens, targets, drop_layers=frozenset())`` runs one step; the signature is the
    batch shape, the dropped layers, and (``fingerprint=True``) a hash of the traced program.

    Args:
        trainer: owns the mesh, optimizer and parameter layout (its schedule and stages are kept).
        budget_bytes: device bytes per device every compiled program must fit.
        policies: the escalation ladder, cheapest first.
        fingerprint: also hash the traced program (for Python control flow the arguments do not show).
        hardware: profile for the cost model (default: this machine's CPU, measured).
        margin: initial safety factor on predictions (compiled / predicted), then learned.
    """

    def __init__(
        self,
        trainer,
        budget_bytes: float,
        *,
        policies=None,
        fingerprint: bool = False,
        hardware=None,
        margin: float = 1.02,
    ):
        from jaxmem.memory import get_hardware

        self.trainer = trainer
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
        self.overhead_seconds = 0.0
        self.calls = 0

    # ----------------------------------------------------------------- signature
    def signature(self, tokens, drop_layers=frozenset(), fingerprint_fn=None) -> tuple:
        sig = (tuple(tokens.shape), str(tokens.dtype), tuple(sorted(drop_layers)))
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
        if len(sig) > 3:
            text += f", program {sig[3]}"
        return text

    # ----------------------------------------------------------------- profiling
    def _pipeline(self, policy: str, drop_layers):
        from jaxmem.pipeline import Pipeline

        base = self.trainer.pipeline
        return Pipeline(
            base.config,
            base.schedule,
            base.mesh,
            layer_counts=base.layer_counts,
            policy=policy,
            drop_layers=drop_layers,
        )

    def predict(self, policy: str, batch: int, seq: int, drop_layers) -> tuple[float, float, float]:
        """(predicted device bytes, expected step seconds, simulated step seconds) of a policy, without
        compiling; expected = simulated x the measured correction for that policy (when known)."""
        from jaxmem.memory import predict
        from jaxmem.memory._cost import state_transfer_seconds, step_costs
        from jaxmem.policy import from_spec
        from jaxmem.schedule import simulate

        base = self.trainer.pipeline
        schedule = base.schedule
        ledger = predict(
            base.config,
            schedule,
            policy,
            batch=batch,
            seq=seq,
            data_parallel=self.trainer.config.data_parallel,
            layer_counts=base.layer_counts,
            drop_layers=drop_layers,
        )
        resolved = from_spec(policy).resolve(schedule)
        mb = batch // (self.trainer.config.data_parallel * schedule.num_microbatches)
        costs = step_costs(
            base.config, schedule, resolved, base.layer_counts, microbatch=mb, seq=seq, hardware=self.hardware
        )
        seconds = simulate(schedule, costs).makespan + state_transfer_seconds(
            base.config, schedule, resolved, base.layer_counts, self.hardware
        )
        return ledger.max_device_bytes, seconds * self._factor(policy), seconds

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

    def _compiled_bytes(self, compiled, pipeline, batch, seq) -> int:
        """memory_analysis() total, minus bytes placed on host that XLA:CPU counts as device."""
        analysis = compiled.memory_analysis()
        total = (
            analysis.argument_size_in_bytes
            + analysis.temp_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        if jax.devices()[0].platform == "cpu":
            import numpy as np

            tick, _ = pipeline.program(batch, seq)
            for key, length in zip(tick.stash_keys, tick.arena_elems):
                if key[1] == "host":
                    total -= length * np.dtype(key[0]).itemsize
        return int(total)

    def _compile(self, pipeline, batch: int, seq: int, state):
        step = self.trainer.build_step(pipeline, batch, seq)

        def abstract(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

        tokens = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32, sharding=self.trainer.batch_sharding)
        compiled = step.lower(abstract(state.params), abstract(state.opt_state), tokens, tokens).compile()
        self.compile_count += 1
        return compiled

    def _adapt(self, sig: tuple, batch: int, seq: int, drop_layers, state) -> _Program:
        start = time.perf_counter()
        predictions = {p: self.predict(p, batch, seq, drop_layers) for p in self.policies}
        neighbour = self._neighbour_policy(sig)
        # Fastest predicted-to-fit policy; among equals, the neighbour's (a near-identical signature).
        fitting = [p for p in self.policies if predictions[p][0] * self.margin <= self.budget]
        if not fitting:
            smallest = min(predictions.values())[0]
            raise BudgetError(
                f"no policy fits {self.budget / 2**20:,.1f} MiB per device for {self.label(sig)}: the smallest "
                f"prediction is {smallest / 2**20:,.1f} MiB ({(smallest - self.budget) / 2**20:,.1f} MiB short)",
                int(smallest - self.budget),
            )
        choice = min(fitting, key=lambda p: (round(predictions[p][1], 9), p != neighbour, self.policies.index(p)))
        pipeline = self._pipeline(choice, drop_layers)
        compiled = self._compile(pipeline, batch, seq, state)
        measured = self._compiled_bytes(compiled, pipeline, batch, seq)
        compiles, escalated = 1, False
        self.margin = max(1.0, self.margin * 0.5 + 0.5 * measured / predictions[choice][0])
        if measured > self.budget:
            # Escalate once: the cheapest policy further up the ladder whose corrected prediction fits.
            ratio = measured / predictions[choice][0]
            later = [
                p for p in self.policies[self.policies.index(choice) + 1 :] if predictions[p][0] * ratio <= self.budget
            ]
            if not later:
                raise BudgetError(
                    f"{choice} compiled to {measured / 2**20:,.1f} MiB for {self.label(sig)}, over the "
                    f"{self.budget / 2**20:,.1f} MiB budget, and no stronger policy is predicted to fit "
                    f"(deficit {(measured - self.budget) / 2**20:,.1f} MiB)",
                    int(measured - self.budget),
                )
            choice = min(later, key=lambda p: predictions[p][1])
            pipeline = self._pipeline(choice, drop_layers)
            compiled = self._compile(pipeline, batch, seq, state)
            measured = self._compiled_bytes(compiled, pipeline, batch, seq)
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
        return _Program(choice, compiled, record)

    # ----------------------------------------------------------------- running
    def step(self, state, tokens, targets, drop_layers=frozenset(), fingerprint_fn=None):
        """One step through the program for this call's signature (compiled and checked on first sight)."""
        begin = time.perf_counter()
        sig = self.signature(tokens, drop_layers, fingerprint_fn)
        program = self.programs.get(sig)
        self.overhead_seconds += time.perf_counter() - begin
        if program is None:
            program = self._adapt(sig, tokens.shape[0], tokens.shape[1], frozenset(drop_layers), state)
            self.programs[sig] = program
        self.calls += 1
        start = time.perf_counter()
        params, opt_state, loss = program.step(state.params, state.opt_state, tokens, targets)
        jax.block_until_ready(loss)
        elapsed = time.perf_counter() - start
        record = program.record
        record.seen += 1
        record.step_seconds.append(elapsed)
        self._refine(record)
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), loss

    def _refine(self, record: SignatureRecord) -> None:
        """Track measured / simulated step time per policy (the first, warm-up step is skipped)."""
        times = record.step_seconds[1:]
        if times and record.simulated_step_seconds > 0:
            ratio = times[-1] / record.simulated_step_seconds
            factor = self.correction.get(record.policy)
            self.correction[record.policy] = ratio if factor is None else 0.8 * factor + 0.2 * ratio

    # ----------------------------------------------------------------- reporting
    def report(self) -> dict:
        return {
            "budget_bytes": int(self.budget),
            "signatures": [r.to_json() for r in self.records],
            "compiles": self.compile_count,
            "calls": self.calls,
            "profiler_overhead_seconds": self.overhead_seconds,
            "margin": self.margin,
            "time_correction": dict(self.correction),
            "hardware": self.hardware.to_json(),
        }

    def write_report(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.report(), f, indent=2)
