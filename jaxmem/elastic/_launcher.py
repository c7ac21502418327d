"""The launcher: N worker processes in one ``jax.distributed`` job, watched; on a failure (a worker
exits, or its heartbeat stops) the rest are stopped, the recovery planner picks a new plan for what is
left, and the job restarts from the last complete checkpoint.

Workers are ``python -m jaxmem train ...`` processes. Here they meet on 127.0.0.1 (gloo collectives on
CPU); on a cluster the same train command, started by ``srun`` or ``mpirun``, joins through
``jax.distributed.initialize()``'s auto-detection instead of this launcher's environment variables
(:func:`jaxmem.cli._common.maybe_initialize_distributed`).

The launcher owns its workers: each runs in its own session (a terminal's Ctrl-C reaches the launcher
only) with a parent-death signal (SIGTERM when the launcher dies, however it dies, on Linux);
SIGTERM/SIGINT to the launcher is forwarded to every worker (they save a checkpoint at one step and
exit) before it exits 128 + signal. A worker that exits with a jaxmem error (exit code 2: bad
settings, data or checkpoint) stops the job with that error: it is not a hardware failure, and no
other plan would fix it. When a worker hangs (SIGSTOPped, or silent past the heartbeat) and its peers
then abort, the hung worker is blamed, not the peer that noticed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jaxmem._errors import JaxmemError, setting
from jaxmem._util import hold_lock, with_host_devices
from jaxmem.config import TrainConfig, with_overrides

__all__ = ["Failure", "LaunchInterrupted", "LaunchResult", "launch", "default_run_dir", "parse_failure", "run_defaults"]


@dataclasses.dataclass(frozen=True)
class Failure:
    rank: int
    step: int


def parse_failure(text: str) -> Failure:
    """``rank=R,step=K`` -> Failure."""
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        return Failure(int(fields["rank"]), int(fields["step"]))
    except (ValueError, KeyError):
        raise JaxmemError(f"{setting('failures')} takes rank=R,step=K (e.g. rank=1,step=5); got {text!r}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Attempt:
    nprocs: int
    args: list
    started: float
    first_step_at: float | None = None
    failed_rank: int | None = None
    failed_at: float | None = None
    overrides: dict = dataclasses.field(default_factory=dict)  # settings applied over ``args`` (a recovery's)
    exit_codes: list = dataclasses.field(default_factory=list)
    strategy: dict | None = None
    measured_step_seconds: float | None = None  # the pre-failure step that calibrated the planner


@dataclasses.dataclass
class LaunchResult:
    ok: bool
    attempts: list
    run_dir: str
    summary: dict | None

    def recovery_seconds(self) -> list[float | None]:
        """Per recovery, seconds from the failure's detection to the new attempt's first step (None
        when that attempt reached no step)."""
        return [
            None if now.first_step_at is None or before.failed_at is None else now.first_step_at - before.failed_at
            for before, now in zip(self.attempts, self.attempts[1:])
        ]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "run_dir": self.run_dir,
            "attempts": [dataclasses.asdict(a) for a in self.attempts],
            "recovery_seconds": self.recovery_seconds(),
            "summary": self.summary,
        }


def _recovered_overrides(choice) -> dict:
    """The settings a recovery's next attempt runs with: the strategy's whole mesh (replacing every
    mesh setting of the user's, and the device count) and its layer split."""
    split = list(choice.layers_per_stage) if choice.layers_per_stage else None
    return {"mesh": choice.mesh, "layers_per_stage": split}


def _hold_run_dir(run: Path):
    """An exclusive lock on a launch's run dir while the returned file is open; a second launch into
    a live run dir is refused here, before it opens any of the live workers' files."""

    def busy(holder):
        return JaxmemError(
            f"{run} is the run dir of a live jaxmem launch ({holder}); stop it first, or pass another "
            f"{setting('run_dir')}"
        )

    return hold_lock(run / ".jaxmem-launch.lock", busy)


def default_run_dir() -> str:
    """Where a launch keeps its logs, heartbeats and (by default) checkpoints when not told."""
    return f"runs/launch-{int(time.time())}"


def run_defaults(run) -> dict:
    """The run's folders, for the workers unless the user gives their own: the checkpoints and the
    sample log under the run dir (settings below the workers' arguments: parse them with these)."""
    run = Path(run).absolute()
    return {"checkpoint_dir": str(run / "checkpoints"), "sample_log": str(run / "samples.log")}


def read_heartbeat(path: Path) -> tuple[int | None, float | None]:
    """(step reached, the worker's median step seconds so far) from a heartbeat file."""
    try:
        fields = path.read_text().split()
        return int(fields[0]) if fields else None, float(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError):
        return None, None


def _read_step(path: Path) -> int | None:
    return read_heartbeat(path)[0]


def launch(
    train_args: list,
    *,
    config: TrainConfig,
    nprocs: int,
    devices_per_proc: int = 1,
    heartbeat_seconds: float = 60.0,
    failures: list[Failure] = (),
    spares: int = 0,
    run_dir: str | None = None,
    max_restarts: int = 3,
    strategy: str | None = None,
    log=print,
    timeout: float | None = None,
) -> LaunchResult:
    """Run ``jaxmem train <train_args>`` on ``nprocs`` processes; restart after failures.

    Args:
        train_args: the train command's arguments, passed to every worker as they are; the workers
            take the launcher's settings with them (a checkpoint folder and a sample log under
            ``run_dir`` unless given; after a recovery, its mesh and layer split over them), which
            the launcher writes to ``attempt-K.json`` in the run dir (:func:`jaxmem.config.config_from`).
        config: the configuration ``train_args`` give over :func:`run_defaults` of ``run_dir``
            (``jaxmem launch`` parses them so): the launcher plans each attempt's devices and a
            recovery from it, with the settings its workers take.
        nprocs: worker processes.
        devices_per_proc: devices each worker drives (virtual CPU devices here).
        heartbeat_seconds: a worker whose heartbeat is older than this (after its first step) is failed.
        failures: injected failures (first attempt only): worker ``rank`` SIGKILLs itself at ``step``.
        spares: idle processes that can replace failed ones.
        strategy: force a recovery strategy (by name) instead of the planner's choice.
        timeout: give up (and stop everything) after this many seconds.
    """
    _check_launch(nprocs, devices_per_proc, heartbeat_seconds, max_restarts, spares, strategy, failures)
    run = Path(run_dir or default_run_dir()).absolute()
    # The run's folders where the arguments name none, as each worker takes them (below its arguments).
    defaults = run_defaults(run)
    job = _Job(
        run=run,
        args=[str(a) for a in train_args] + ["--json", "--quiet"],  # the workers' arguments, as given
        defaults=defaults,
        base=with_overrides(config, {k: v for k, v in defaults.items() if getattr(config, k) is None}),
        devices_per_proc=devices_per_proc,
        heartbeat_seconds=heartbeat_seconds,
        timeout=timeout,
        log=log,
    )
    run.mkdir(parents=True, exist_ok=True)
    held = _hold_run_dir(run)  # before any log or heartbeat file is touched
    previous = _forward_signals()
    overrides: dict = {}
    try:
        for index in range(max_restarts + 1):
            attempt, failed_rank, progress = job.attempt(index, nprocs, overrides, failures if index == 0 else ())
            if failed_rank is None:
                return job.finished()
            choice = job.recover(
                attempt, failed_rank, progress, spares=spares, strategy=strategy, restarts=max_restarts - index
            )
            if choice is None:
                break
            if choice.name == "restart-on-spares":
                spares -= 1
            nprocs = choice.nprocs
            overrides = {**overrides, **_recovered_overrides(choice)}
        return LaunchResult(False, job.attempts, str(run), None)
    except LaunchInterrupted as e:
        log(f"launcher got {signal.Signals(e.signum).name}: stopping the workers (each saves its current step)")
        _stop(job.workers, grace=120)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        held.close()


def _check_launch(nprocs, devices_per_proc, heartbeat_seconds, max_restarts, spares, strategy, failures) -> None:
    """Refuse a launch's bad settings before any file or process is made."""
    from jaxmem.elastic._recovery import STRATEGIES

    if nprocs < 1 or devices_per_proc < 1:
        raise JaxmemError(
            f"{setting('nprocs', nprocs)} and {setting('devices_per_proc', devices_per_proc)} must be >= 1"
        )
    if not heartbeat_seconds > 0:
        raise JaxmemError(
            f"{setting('heartbeat_seconds')} must be > 0 (a worker silent that long is failed), got {heartbeat_seconds}"
        )
    if max_restarts < 0 or spares < 0:
        raise JaxmemError(f"{setting('max_restarts', max_restarts)} and {setting('spares', spares)} must be >= 0")
    runnable = [s for s in STRATEGIES if s != "reroute"]  # reroute is scored; the SPMD executor cannot run it
    if strategy is not None and strategy not in runnable:
        raise JaxmemError(
            f"{setting('strategy', strategy)} is not one this launcher can run; choose {', '.join(runnable)}"
        )
    for f in failures:
        if not (0 <= f.rank < nprocs and f.step >= 1):
            raise JaxmemError(
                f"{setting('failures')}: rank={f.rank},step={f.step}: the rank must be 0..{nprocs - 1} "
                f"({setting('nprocs', nprocs)}) and the step >= 1"
            )
    limit = max(1, (os.cpu_count() or 1) * 8)
    if nprocs > limit:
        raise JaxmemError(f"{setting('nprocs', nprocs)} is more than this machine can start ({limit} at most here)")


@dataclasses.dataclass
class _Job:
    """One launch's fixed settings and its attempts so far: :meth:`attempt` runs one to its end or
    first failure, :meth:`recover` plans the next from a failed one."""

    run: Path
    args: list
    defaults: dict
    base: TrainConfig  # the workers' configuration before any recovery's overrides
    devices_per_proc: int
    heartbeat_seconds: float
    timeout: float | None
    log: Callable
    attempts: list = dataclasses.field(default_factory=list)
    workers: list = dataclasses.field(default_factory=list)  # the current attempt's processes
    config: TrainConfig | None = None  # the current attempt's configuration, as its workers take it
    heartbeats: list = dataclasses.field(default_factory=list)
    deadline: float | None = None

    def __post_init__(self):
        self.deadline = None if self.timeout is None else time.time() + self.timeout

    def attempt(self, index: int, nprocs: int, overrides: dict, failures) -> tuple[Attempt, int | None, list]:
        """Start ``nprocs`` workers with ``overrides`` over their arguments and watch them: ``(the
        attempt, the failed rank or None when all finished, the steps' progress)``. A worker's
        jaxmem error (settings, data, checkpoint: not hardware) and the deadline raise."""
        config = self.config = with_overrides(self.base, overrides)
        needed = config.num_devices
        if needed > nprocs * self.devices_per_proc:
            raise JaxmemError(
                f"the plan needs data({config.data_parallel}) x fsdp({config.fsdp}) x pipe({config.pipe}) x "
                f"context({config.context}) x tensor({config.tensor}) = {needed} devices but {nprocs} process(es) x "
                f"{self.devices_per_proc} device(s) are running; set {setting('nprocs')} / "
                f"{setting('devices_per_proc')} to match"
            )
        port = _free_port()
        attempt = Attempt(nprocs, list(self.args), time.time(), overrides=dict(overrides))
        self.attempts.append(attempt)
        settings = self.run / f"attempt-{index}.json"
        settings.write_text(json.dumps({"defaults": self.defaults, "overrides": overrides}, indent=2) + "\n")
        self.log(f"attempt {index + 1}: {nprocs} process(es) x {self.devices_per_proc} device(s), mesh {config.mesh}")
        self.workers.clear()
        self.heartbeats = _start_workers(
            self.workers,
            self.args,
            self.run,
            index,
            settings=settings,
            port=port,
            nprocs=nprocs,
            devices_per_proc=self.devices_per_proc,
            heartbeat_seconds=self.heartbeat_seconds,
            failures=failures,
        )
        failed_rank, progress = _watch(self.workers, self.heartbeats, attempt, self.heartbeat_seconds, self.deadline)
        if failed_rank == _TIMED_OUT:
            _stop(self.workers)
            raise JaxmemError(f"launch timed out after {self.timeout:.0f}s (logs in {self.run})")
        if failed_rank is not None and self.workers[failed_rank].returncode == 2:
            _stop(self.workers)
            raise JaxmemError(
                f"worker {failed_rank} stopped on an error (not a failure to recover from): "
                f"{_last_error(self.run / f'worker-{index}-{failed_rank}.log')} (logs in {self.run})"
            )
        if failed_rank is None:
            attempt.exit_codes = [p.returncode for p in self.workers]
        return attempt, failed_rank, progress

    def finished(self) -> LaunchResult:
        """The result of a launch whose last attempt finished, said in one line."""
        summary = _summary(self.run / f"worker-{len(self.attempts) - 1}-0.log")
        loss = summary and summary.get("loss_last")
        result = LaunchResult(True, self.attempts, str(self.run), summary)
        recovered = "".join(
            f"; recovery {k}: {s:.1f} s from the failure to the first new step"
            for k, s in enumerate(result.recovery_seconds(), 1)
            if s is not None
        )
        self.log(
            f"finished: {summary and summary.get('steps')} steps, final loss "
            f"{'-' if loss is None else f'{loss:.4f}'}, {time.time() - self.attempts[0].started:.1f} s in "
            f"{len(self.attempts)} attempt(s){recovered}"
        )
        return result

    def recover(self, attempt: Attempt, failed_rank: int, progress: list, *, spares: int, strategy, restarts: int):
        """Stop a failed attempt's workers and choose the next layout: the recovery planner's
        choice (or ``strategy``'s), or None when no ``restarts`` are left."""
        from jaxmem.elastic._recovery import choose_recovery
        from jaxmem.memory import cpu_cores

        attempt.failed_rank, attempt.failed_at = failed_rank, time.time()
        _stop(self.workers)
        attempt.exit_codes = [p.returncode for p in self.workers]
        beats = [read_heartbeat(h) for h in self.heartbeats]
        steps_done = max((step or 0) for step, _ in beats)
        last_ckpt = _latest_checkpoint(Path(self.config.checkpoint_dir))
        first = attempt.first_step_at
        measured = attempt.measured_step_seconds = _pre_failure_step(beats, progress)
        failed = f"worker {failed_rank} failed at step ~{steps_done} (last checkpoint: step {last_ckpt})"
        if not restarts:
            self.log(
                f"{failed}; no restarts left ({setting('max_restarts', len(self.attempts) - 1)}): giving up. Rerun "
                f"the same command to resume from the last checkpoint (logs in {self.run})"
            )
            return None
        self.log(f"{failed}; planning recovery")
        recovery = choose_recovery(
            self.config,
            devices_per_proc=self.devices_per_proc,
            nprocs=attempt.nprocs,
            failed=[failed_rank],
            spares=spares,
            steps_done=steps_done,
            last_checkpoint=last_ckpt or 0,
            measured_step_seconds=measured,
            restart_seconds=(first - attempt.started) if first else 15.0,
            cores=cpu_cores(),
        )
        for line in recovery.explain():
            self.log(f"  {line}")
        choice = recovery.choice
        if strategy:
            forced = [c for c in recovery.candidates if c.name == strategy and c.runnable]
            if not forced:
                raise JaxmemError(
                    f"recovery strategy {strategy!r} cannot run here; runnable: "
                    f"{[c.name for c in recovery.candidates if c.runnable]}"
                )
            choice = forced[0]
        attempt.strategy = choice.to_json()
        return choice


_TIMED_OUT = -1  # what _watch returns for the failed rank when the launch's deadline passed


def _start_workers(
    procs: list,
    args,
    run: Path,
    attempt_index: int,
    *,
    settings: Path,
    port,
    nprocs,
    devices_per_proc,
    heartbeat_seconds,
    failures,
) -> list[Path]:
    """Start one attempt's ``nprocs`` workers (``jaxmem train <args>`` with the settings file
    ``settings``; appended to ``procs`` as they start, so a signal stops
    the ones already running) with their distributed-job environment; an injected failure in
    ``failures`` is handed to its rank. Returns the workers' heartbeat files."""
    from jaxmem._util import SETTINGS_ENV
    from jaxmem.elastic._worker import FAIL_AT_ENV, HEARTBEAT_ENV, LAUNCHER_ENV

    heartbeats = []
    for rank in range(nprocs):
        env = dict(os.environ)
        env.update(
            {
                "JAXMEM_COORDINATOR": f"127.0.0.1:{port}",
                "JAXMEM_NUM_PROCESSES": str(nprocs),
                "JAXMEM_PROCESS_ID": str(rank),
                HEARTBEAT_ENV: str(run / f"heartbeat-{attempt_index}-{rank}"),
                "JAXMEM_HEARTBEAT_SECONDS": str(max(5, int(heartbeat_seconds))),
                "XLA_FLAGS": with_host_devices(os.environ.get("XLA_FLAGS", ""), devices_per_proc),
                LAUNCHER_ENV: str(os.getpid()),
                SETTINGS_ENV: str(settings),
            }
        )
        env.pop(FAIL_AT_ENV, None)
        for f in failures:
            if f.rank == rank:
                env[FAIL_AT_ENV] = str(f.step)
        heartbeats.append(Path(env[HEARTBEAT_ENV]))
        # A rerun in the same run dir: an earlier launch's heartbeat file is not this worker's.
        heartbeats[-1].unlink(missing_ok=True)
        out = open(run / f"worker-{attempt_index}-{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "jaxmem", "train", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                # No preexec_fn: CPython then forks without running this process's at-fork
                # handlers (JAX's warns that a fork of its multithreaded runtime may deadlock;
                # nothing of it runs in the child, which execs at once). The worker asks to
                # die with the launcher itself (die_with_launcher).
                start_new_session=True,
            )
        )
    return heartbeats


def _watch(procs, heartbeats, attempt, heartbeat_seconds: float, deadline) -> tuple[int | None, list]:
    """Follow one attempt until every worker exits 0 (returns None), one fails -- exits non-zero, or
    its heartbeat is older than ``heartbeat_seconds`` (returns the blamed rank) -- or ``deadline``
    passes (returns ``_TIMED_OUT``). Also returns worker 0's ``(time, step)`` heartbeats, and sets
    the attempt's first-step time."""
    last_beat = [None] * len(procs)
    progress: list[tuple[float, int]] = []
    while True:
        time.sleep(0.2)
        codes = [p.poll() for p in procs]
        for rank, path in enumerate(heartbeats):
            if path.exists():
                mtime = path.stat().st_mtime
                if attempt.first_step_at is None:
                    attempt.first_step_at = mtime
                last_beat[rank] = mtime
                if rank == 0:
                    step = _read_step(path)
                    if step is not None and (not progress or step > progress[-1][1]):
                        progress.append((mtime, step))
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        stale = [
            r
            for r, t in enumerate(last_beat)
            if t is not None and codes[r] is None and time.time() - t > heartbeat_seconds
        ]
        if bad or stale:
            return _blame(procs, codes, last_beat, bad, stale), progress
        if all(c == 0 for c in codes):
            return None, progress
        if deadline and time.time() > deadline:
            return _TIMED_OUT, progress


def _pre_failure_step(beats, progress) -> float | None:
    """The pre-failure step: the workers' own median step times (compile excluded; checkpoint saves
    and stragglers do not move a median); from worker 0's heartbeat times when no worker reported one."""
    reported = sorted(m for _, m in beats if m)
    if not reported:
        steady = [(t, k) for t, k in progress if k >= 2]  # step 1 includes the compile
        reported = sorted((t1 - t0) / (k1 - k0) for (t0, k0), (t1, k1) in zip(steady, steady[1:]) if k1 > k0)
    return reported[len(reported) // 2] if reported else None


def _latest_checkpoint(directory: Path) -> int | None:
    from jaxmem.train import committed_steps

    steps = committed_steps(directory)
    return steps[-1] if steps else None


class LaunchInterrupted(BaseException):
    """The launcher was sent SIGTERM/SIGINT; its workers were stopped (and saved). Like
    KeyboardInterrupt, not an Exception: raised by the signal handler wherever the launcher's main
    thread is, it must not be taken for the error a ``try`` there expects (a JaxmemError is a
    ValueError, and reading a heartbeat file catches ValueError: an interrupt that landed there was
    lost, and the launcher ran on)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}; the workers saved and stopped")
        self.signum = signum


def _forward_signals() -> dict:
    """Turn SIGTERM/SIGINT into LaunchInterrupted (main thread only); returns the previous handlers."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise LaunchInterrupted(signum)

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}


def _stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, a debugger) rather than running or sleeping."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _blame(procs, codes, last_beat, bad, stale) -> int:
    """The worker that failed first: a stopped one, else one killed by a signal, else the one whose
    heartbeat is oldest among the silent, else the first that exited with an error."""
    stopped = [r for r, p in enumerate(procs) if codes[r] is None and _stopped(p.pid)]
    killed = [r for r in bad if codes[r] < 0]
    for group in (stopped, killed):
        if group:
            return group[0]
    if stale:
        return min(stale, key=lambda r: last_beat[r])
    return bad[0]


def _last_error(log_path: Path) -> str:
    """The last ``error: ...`` line of a worker's log."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def _stop(procs, grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped worker handles SIGTERM once continued
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
    end = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _summary(log_path: Path) -> dict | None:
    """The JSON summary the train command printed at the end of its log."""
    text = log_path.read_text() if log_path.exists() else ""
    start = text.rfind("\n{")
    start = 0 if text.startswith("{") and start < 0 else start + 1
    try:
        return json.loads(text[start:])
    except ValueError:
        return None
