"""Gantt chart of a simulated schedule with each rank's live-activation curve under its row."""

from __future__ import annotations

import os
from pathlib import Path

from jaxmem.schedule._action import Kind
from jaxmem.schedule._simulate import Costs, SimulationResult, simulate
from jaxmem.schedule._table import Schedule, ScheduleError

__all__ = ["draw"]

KIND_COLORS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.I: "#DD8452", Kind.W: "#8172B3"}
_FORMATS = {".png", ".svg", ".pdf"}


def draw(
    schedule: Schedule | SimulationResult,
    path: str | os.PathLike,
    costs: Costs | None = None,
    title: str | None = None,
) -> Path:
    """Draw the schedule as a Gantt chart (one row per rank, a colour per kind, microbatch numbers in
    the boxes, the stage number too when a rank holds several) with each rank's live activations
    plotted under its row. The format follows the suffix: ``.png``, ``.svg`` or ``.pdf``.

    Args:
        schedule: a schedule (simulated with ``costs``) or an existing simulation result.
        path: output file.
        costs: costs for the simulation (unit F, B = 2 by default).
        title: figure title; defaults to the schedule's name and its bubble fraction.
    """
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ScheduleError(f"cannot draw to {str(path)!r}: use a .png, .svg or .pdf file name")
    result = schedule if isinstance(schedule, SimulationResult) else simulate(schedule, costs or Costs())
    sched = result.schedule

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sched.num_ranks
    multi = sched.num_stages > ranks
    fig_height = 1.0 + 1.3 * ranks
    most_actions = max(len(sched.actions(r)) for r in range(ranks))
    fig, axes = plt.subplots(
        2 * ranks,
        1,
        sharex=True,
        figsize=(min(80.0, max(8.0, 0.5 * most_actions + 2)), fig_height),
        gridspec_kw={"height_ratios": [1.0, 0.6] * ranks, "hspace": 0.08},
    )
    peak = max(result.peak_inflight + (1,))
    for rank in range(ranks):
        gantt, curve = axes[2 * rank], axes[2 * rank + 1]
        for action in sched.actions(rank):
            begin, end = result.start[action], result.finish[action]
            shade = 0.55 if multi and sched.stages_of(rank).index(action.stage) % 2 else 1.0
            gantt.barh(
                0,
                end - begin,
                left=begin,
                height=0.8,
                color=KIND_COLORS[action.kind],
                alpha=shade,
                edgecolor="black",
                linewidth=0.4,
            )
            label = f"{action.stage}:{action.microbatch}" if multi else str(action.microbatch)
            if end - begin > 0:
                gantt.text((begin + end) / 2, 0, label, ha="center", va="center", fontsize=7, color="white")
        gantt.set_yticks([0])
        gantt.set_yticklabels([f"rank {rank}"])
        gantt.set_ylim(-0.5, 0.5)
        times = [t for t, _ in result.timeline[rank]] + [result.makespan]
        counts = [c for _, c in result.timeline[rank]] + [0]
        curve.step(times, counts, where="post", color="black", linewidth=1.0)
        curve.fill_between(times, counts, step="post", color="grey", alpha=0.3)
        curve.set_ylim(0, peak * 1.15)
        curve.set_yticks([0, result.peak_inflight[rank]])
        curve.tick_params(axis="y", labelsize=7)
        curve.set_ylabel("live", fontsize=7)
    axes[-1].set_xlabel("time")
    axes[-1].set_xlim(0, result.makespan)
    used = sorted({a.kind for a in sched.actions()}, key=lambda k: "FBIW".index(k.value))
    names = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input-grad", Kind.W: "weight-grad"}
    fig.legend(
        handles=[Patch(color=KIND_COLORS[k], label=f"{k.value} {names[k]}") for k in used],
        loc="upper right",
        ncol=len(used),
        fontsize=8,
    )
    fig.suptitle(
        title
        or f"{sched.name}: P={ranks}, stages={sched.num_stages}, M={sched.num_microbatches}, "
        f"bubble {result.bubble_fraction:.1%}, peak live {list(result.peak_inflight)}",
        fontsize=9,
        x=0.02,
        ha="left",
    )
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as e:
        raise ScheduleError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
