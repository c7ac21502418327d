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
    time_unit: str = "one forward = 1",
) -> Path:
    """Draw the schedule as a Gantt chart (one row per rank, a colour per kind, microbatch numbers in
    the boxes, the stage number too when a rank holds several, a paler shade for a rank's second
    stage) with each rank's live activations plotted under its row, on one scale for all ranks (MiB
    when the costs carry activation bytes, else microbatches). The figure is about twice as wide as
    high whatever the schedule's length; a box too narrow for its label across shows it upright, and
    one too narrow for that too goes unlabelled. The format
    follows the suffix: ``.png``, ``.svg`` or ``.pdf`` (an SVG keeps its text as text).

    Args:
        schedule: a schedule (simulated with ``costs``) or an existing simulation result.
        path: output file.
        costs: costs for the simulation (unit F, B = 2 by default).
        title: figure title; defaults to the schedule's name and its bubble fraction.
        time_unit: what the time axis counts (the costs' unit).
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
    in_bytes = result.timeline_bytes is not None
    timelines = result.timeline_bytes if in_bytes else result.timeline
    scale = 2**20 if in_bytes else 1.0  # bytes shown in MiB
    unit = "MiB" if in_bytes else "microbatches"
    peaks = result.peak_activation_bytes if in_bytes else result.peak_inflight
    peak = max(max(peaks) / scale, 1e-9)
    # About 2:1 whatever the schedule's length: long schedules get narrower boxes, and a box whose
    # label would not fit either way shows no label (its neighbours' labels and the legend still tell it).
    height = min(2.0 + 1.25 * ranks, 11.0)
    width = min(max(2.0 * height, 8.0), 20.0)
    fig, axes = plt.subplots(
        2 * ranks,
        1,
        sharex=True,
        figsize=(width, height),
        gridspec_kw={"height_ratios": [1.0, 0.6] * ranks, "hspace": 0.1},
    )
    makespan = result.makespan or 1.0
    points_per_time = 72.0 * width * 0.85 / makespan
    fontsize = 7
    # A box's height in points: the rows share the figure's height (about 0.8 of it, less the gaps)
    # in their ratios, a box 0.8 of its row.
    box_height = 72.0 * height * 0.8 / (1.6 * ranks + 0.1 * (2 * ranks - 1)) * 0.8
    for rank in range(ranks):
        gantt, curve = axes[2 * rank], axes[2 * rank + 1]
        for action in sched.actions(rank):
            begin, end = result.start[action], result.finish[action]
            shade = 0.5 if multi and sched.stages_of(rank).index(action.stage) % 2 else 1.0
            gantt.barh(
                0,
                end - begin,
                left=begin,
                height=0.8,
                color=KIND_COLORS[action.kind],
                alpha=shade,
                edgecolor="black",
                linewidth=0.3,
            )
            label = f"{action.stage}:{action.microbatch}" if multi else str(action.microbatch)
            box = (end - begin) * points_per_time
            if box >= 0.62 * fontsize * len(label) + 2:
                gantt.text((begin + end) / 2, 0, label, ha="center", va="center", fontsize=fontsize, color="white")
            elif box >= fontsize + 2 and box_height >= 0.62 * fontsize * len(label) + 2:
                # Too narrow across, tall enough upright (chronos' half-length boxes, long schedules).
                gantt.text(
                    (begin + end) / 2, 0, label, ha="center", va="center", fontsize=fontsize, color="white", rotation=90
                )
        gantt.set_yticks([0])
        gantt.set_yticklabels([f"rank {rank}"])
        gantt.set_ylim(-0.5, 0.5)
        # One point per instant (a free and an allocation at the same time are no dip).
        points = dict((t, v / scale) for t, v in timelines[rank])
        times = list(points) + [result.makespan]
        values = list(points.values()) + [0]
        curve.step(times, values, where="post", color="black", linewidth=1.0)
        curve.fill_between(times, values, step="post", color="grey", alpha=0.3)
        curve.set_ylim(0, peak * 1.2)  # one scale for every rank
        curve.set_yticks([0, peak])
        curve.set_yticklabels(["0", f"{peak:.3g}"])
        curve.tick_params(axis="y", labelsize=7)
        curve.text(
            1.005,
            0.5,
            f"peak {peaks[rank] / scale:.3g}",
            transform=curve.transAxes,
            fontsize=7,
            va="center",
            ha="left",
        )
    fig.text(0.005, 0.3, f"live activations ({unit}, same scale on every rank)", rotation=90, fontsize=7, va="center")
    axes[-1].set_xlabel(f"time ({time_unit})")
    axes[-1].set_xlim(0, makespan)
    used = sorted({a.kind for a in sched.actions()}, key=lambda k: "FBIW".index(k.value))
    names = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input-grad", Kind.W: "weight-grad"}
    handles = [Patch(color=KIND_COLORS[k], label=f"{k.value} {names[k]}") for k in used]
    if multi:
        handles.append(Patch(facecolor="#4C72B0", alpha=0.5, label="pale: the rank's 2nd, 4th... stage"))
    handles.append(Patch(color="none", label="box label: stage:microbatch" if multi else "box label: microbatch"))
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8, frameon=False)
    peak_text = ", ".join(f"{p / scale:.3g}" for p in peaks)
    fig.suptitle(
        title
        or f"{sched.name}: P={ranks}, stages={sched.num_stages}, M={sched.num_microbatches}, "
        f"bubble {result.bubble_fraction:.1%}, peak live [{peak_text}] {unit}",
        fontsize=9,
        x=0.02,
        y=0.995,
        ha="left",
    )
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):
            fig.savefig(path, dpi=120, bbox_inches="tight")
    except OSError as e:
        raise ScheduleError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
