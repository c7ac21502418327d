"""Schedules as data: generators, validation, simulation, CSV, drawing."""

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from jaxmem.schedule import (
    Action,
    ActionParseError,
    Costs,
    Kind,
    Schedule,
    ScheduleError,
    draw,
    generate,
    list_generators,
    load_csv,
    save_csv,
    schedule_from_csv_text,
    schedule_to_csv_text,
    simulate,
    validate,
)

DATA = Path(__file__).parent / "data"
UNIT = Costs(f=1, b=2, i=1, w=1)


# ---------------------------------------------------------------- actions
@pytest.mark.parametrize("text", ["2F0", "0B3", "1I4", "1W4", "12F105"])
def test_action_round_trip(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "-1F0", "2f0", "2F0x", "2F0 1B0"])
def test_action_rejects_malformed(text):
    with pytest.raises(ActionParseError, match="not an action"):
        Action.parse(text)


def test_action_names_torch_comm_cells():
    with pytest.raises(ActionParseError, match="communication"):
        Action.parse("2SEND_F0")


def test_schedule_is_hashable_and_frozen():
    a = generate("1f1b", 4, 8)
    b = generate("1F1B", 4, 8)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.ranks = ()


# ---------------------------------------------------------------- acceptance figures
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_unit_costs_p4_m8(name):
    r = simulate(generate(name, 4, 8), UNIT)
    assert r.makespan == 33
    assert Fraction(r.bubble_fraction).limit_denominator(1000) == Fraction(3, 11)


def test_peak_inflight_p4_m8():
    assert simulate(generate("1f1b", 4, 8), UNIT).peak_inflight == (4, 3, 2, 1)
    assert simulate(generate("gpipe", 4, 8), UNIT).peak_inflight == (8, 8, 8, 8)


GRID = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 4, 8, 12, 16)]


@pytest.mark.parametrize("p,m", GRID, ids=[f"P{p}-M{m}" for p, m in GRID])
def test_1f1b_and_gpipe_formulas(p, m):
    for name in ("1f1b", "gpipe"):
        r = simulate(generate(name, p, m), UNIT)
        assert r.makespan == pytest.approx((m + p - 1) * 3)
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(generate("1f1b", p, m), UNIT).peak_inflight == tuple(min(p - r, m) for r in range(p))
    assert simulate(generate("gpipe", p, m), UNIT).peak_inflight == (m,) * p


IL_GRID = [(p, m, v) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p) for v in (2, 3, 4)]


@pytest.mark.parametrize("p,m,v", IL_GRID, ids=[f"P{p}-M{m}-V{v}" for p, m, v in IL_GRID])
def test_interleaved_formula_and_smaller_bubble(p, m, v):
    il = simulate(generate("interleaved-1f1b", p, m, virtual=v), UNIT)
    # Megatron's virtual pipeline: bubble (P-1)/(V*M + P - 1), at equal model size per rank.
    assert il.makespan == pytest.approx((v * m + p - 1) * 3 / v)
    assert il.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert il.bubble_fraction < simulate(generate("1f1b", p, m), UNIT).bubble_fraction


ZB_GRID = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,m", ZB_GRID, ids=[f"P{p}-M{m}" for p, m in ZB_GRID])
def test_zero_bubble_beats_1f1b_at_no_more_memory(p, m):
    base = simulate(generate("1f1b", p, m), UNIT)
    h1 = simulate(generate("zb-h1", p, m), UNIT)
    assert h1.bubble_fraction < base.bubble_fraction
    assert all(a <= b for a, b in zip(h1.peak_inflight, base.peak_inflight))
    v = simulate(generate("zbv", p, m), Costs(f=1, i=1, w=1, activation_bytes=1.0))
    assert v.bubble_fraction < base.bubble_fraction
    # ZB-V chunks are half a stage: 2P chunk activations = 1F1B's P full ones on the worst rank.
    assert max(v.peak_activation_bytes) <= max(base.peak_inflight) + 1e-9


def test_interleaved_matches_torch_exactly():
    ours = generate("interleaved-1f1b", 4, 8, virtual=2).compact()
    torch_order = load_csv(DATA / "torch_interleaved1f1b_p4_m8_compute.csv").compact()
    assert ours == torch_order


# ---------------------------------------------------------------- property tests
@st.composite
def generated(draw_):
    name = draw_(st.sampled_from([g.name for g in list_generators()]))
    p = draw_(st.integers(1, 6))
    if name == "interleaved-1f1b":
        v = draw_(st.integers(1, 3))
        m = p * draw_(st.integers(1, 4))
        return generate(name, p, m, virtual=v)
    return generate(name, p, draw_(st.integers(1, 12)))


@given(generated())
def test_every_generated_schedule_validates(schedule):
    assert validate(schedule) is schedule
    result = simulate(schedule, UNIT)
    assert 0 <= result.bubble_fraction < 1
    assert len(schedule.actions()) == schedule.num_stages * schedule.num_microbatches * (
        3 if schedule.split_backward else 2
    )


def _positions(schedule):
    return [(r, s) for r in range(schedule.num_ranks) for s, a in enumerate(schedule.ranks[r]) if a]


def _with_rows(schedule, rows):
    return Schedule(rows, stage_to_rank=schedule.stage_to_rank, name=schedule.name)


def _assert_names_rank_and_step(err: ScheduleError):
    assert err.rank is not None and err.step is not None
    assert f"rank {err.rank}, step {err.step}" in str(err)
    assert "[" in str(err)  # the table with the cell marked


@given(generated(), st.data())
def test_dropping_an_action_is_rejected(schedule, data):
    r, s = data.draw(st.sampled_from(_positions(schedule)))
    rows = [list(row) for row in schedule.ranks]
    rows[r][s] = None
    # Dropping the only backward (P=1, M=1) leaves a forward-only schedule, which is valid by design
    # (jaxmem.schedule.forward_only: evaluation).
    assume(any(a is not None and a.kind is not Kind.F for row in rows for a in row))
    with pytest.raises(ScheduleError) as info:
        validate(_with_rows(schedule, rows))
    _assert_names_rank_and_step(info.value)


@given(generated(), st.data())
def test_duplicating_an_action_is_rejected(schedule, data):
    r, s = data.draw(st.sampled_from(_positions(schedule)))
    rows = [list(row) for row in schedule.ranks]
    rows[r].insert(data.draw(st.integers(0, len(rows[r]))), schedule.ranks[r][s])
    with pytest.raises(ScheduleError, match="twice") as info:
        validate(_with_rows(schedule, rows))
    _assert_names_rank_and_step(info.value)


@given(generated(), st.data())
def test_swapping_a_forward_with_its_backward_is_rejected(schedule, data):
    r, s = data.draw(st.sampled_from([(r, s) for r, s in _positions(schedule) if schedule.ranks[r][s].kind is Kind.F]))
    f = schedule.ranks[r][s]
    backward_kind = Kind.I if schedule.split_backward else Kind.B
    b = Action(f.stage, backward_kind, f.microbatch)
    rows = [list(row) for row in schedule.ranks]
    sb = rows[r].index(b)
    rows[r][s], rows[r][sb] = rows[r][sb], rows[r][s]
    with pytest.raises(ScheduleError) as info:
        validate(_with_rows(schedule, rows))
    _assert_names_rank_and_step(info.value)


@given(generated(), st.data())
def test_a_stage_on_two_ranks_is_rejected(schedule, data):
    if schedule.num_ranks < 2:
        return
    r, s = data.draw(st.sampled_from(_positions(schedule)))
    other = data.draw(st.sampled_from([x for x in range(schedule.num_ranks) if x != r]))
    rows = [list(row) for row in schedule.ranks]
    action = rows[r][s]
    rows[r][s] = None
    rows[other].append(action)
    with pytest.raises(ScheduleError, match="lives on rank") as info:
        validate(_with_rows(schedule, rows))
    _assert_names_rank_and_step(info.value)
    assert info.value.rank == other


def test_deadlock_message_names_the_waits():
    bad = Schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]])
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(bad)
    message = str(info.value)
    assert "0B0 (rank 0, step 1) waits for 1B0" in message
    assert "1F1 (rank 1, step 0) waits for 0F1" in message
    assert "fix: on rank 0, run 0F1 before 0B0" in message


def test_missing_backward_says_what_to_add():
    with pytest.raises(ScheduleError, match="add 0B1 on rank 0 after 0F1"):
        validate(Schedule([["0F0", "0F1", "0B0"]]))


# ---------------------------------------------------------------- CSV
@given(generated())
def test_csv_round_trips_exactly(schedule):
    text = schedule_to_csv_text(schedule)
    again = schedule_from_csv_text(text)
    assert again == schedule
    assert schedule_to_csv_text(again) == text


def test_csv_file_round_trip(tmp_path):
    s = generate("zbv", 4, 8)
    path = save_csv(s, tmp_path / "zbv.csv")
    assert load_csv(path) == s


@pytest.mark.parametrize("path", sorted(DATA.glob("torch_*.csv")), ids=lambda p: p.stem)
def test_torch_csvs_load_validate_simulate(path):
    s = validate(load_csv(path))
    r = simulate(s, UNIT)
    assert r.makespan > 0 and s.num_microbatches in (4, 8)


def test_torch_compute_comms_format_gives_the_compute_order():
    a = load_csv(DATA / "torch_zbv_p4_m8_compute.csv").compact()
    b = load_csv(DATA / "torch_zbv_p4_m8_compute_comms.csv").compact()
    assert a == b


def test_malformed_csv_cell_names_row_and_column():
    with pytest.raises(ScheduleError, match=r"row 2 \(rank 1\), column 3"):
        schedule_from_csv_text("0F0,0B0\n,1F0,1Q0\n")


def test_unreadable_csv(tmp_path):
    with pytest.raises(ScheduleError, match="does not exist"):
        load_csv(tmp_path / "missing.csv")
    with pytest.raises(ScheduleError, match="is a directory"):
        load_csv(tmp_path)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ScheduleError, match="not text"):
        load_csv(binary)


# ---------------------------------------------------------------- generator input errors
def test_unknown_name_lists_valid_ones():
    with pytest.raises(ScheduleError, match="valid names: gpipe, 1f1b, interleaved-1f1b"):
        generate("1f2b", 4, 8)


def test_incompatible_microbatches_say_which_work():
    with pytest.raises(ScheduleError, match="use M in 4, 8, 12"):
        generate("interleaved-1f1b", 4, 6, virtual=2)


@pytest.mark.parametrize("p,m", [(0, 8), (4, 0), (-1, 4)])
def test_sizes_below_one(p, m):
    with pytest.raises(ScheduleError, match="must be an integer >= 1"):
        generate("1f1b", p, m)


def test_virtual_on_a_fixed_schedule():
    with pytest.raises(ScheduleError, match="does not take virtual"):
        generate("1f1b", 4, 8, virtual=3)


# ---------------------------------------------------------------- simulation details
def test_comm_latency_and_bytes():
    s = generate("1f1b", 4, 8)
    slow = simulate(s, Costs(f=1, b=2, comm=0.5, activation_bytes=1000))
    assert slow.makespan > 33
    assert slow.peak_activation_bytes == (4000, 3000, 2000, 1000)


def test_reuse_distance_is_longest_on_the_first_rank():
    r = simulate(generate("1f1b", 4, 8), UNIT)
    assert r.reuse_distance(0, 0) > r.reuse_distance(3, 0) == 0


# ---------------------------------------------------------------- drawing
@pytest.mark.parametrize("microbatches", [4, 32])
def test_draw_is_about_two_to_one_with_a_legend_and_one_scale(tmp_path, microbatches):
    """Short or long, the chart is about twice as wide as high; the SVG keeps its text, so the
    legend (kinds, the pale shade of a rank's second stage, the box label) and the shared scale can
    be read back."""
    import matplotlib.image

    png = draw(generate("zbv", 4, microbatches), tmp_path / "s.png")
    height, width = matplotlib.image.imread(png).shape[:2]
    assert 1.6 < width / height < 2.5
    svg = draw(generate("zbv", 4, microbatches), tmp_path / "s.svg").read_text()
    for text in ("F forward", "I input-grad", "W weight-grad", "pale: the rank", "box label: stage:microbatch"):
        assert text in svg
    assert "same scale on every rank" in svg and "time (one forward = 1)" in svg
    plain = draw(generate("1f1b", 2, 4), tmp_path / "p.svg").read_text()
    assert "box label: microbatch" in plain and "pale" not in plain and "B backward" in plain


def test_draw_labels_every_box_of_a_chronos_schedule(tmp_path):
    """ChronosPipe's half-length boxes are too narrow for a label across: they carry it upright."""
    import re

    schedule = generate("chronos", 4, 8)
    svg = draw(schedule, tmp_path / "c.svg").read_text()
    labels = re.findall(r">(\d+:\d+)</text>", svg)
    expected = [f"{a.stage}:{a.microbatch}" for r in range(4) for a in schedule.actions(r)]
    assert sorted(labels) == sorted(expected)


def test_draw_in_bytes_when_the_costs_carry_them(tmp_path):
    svg = draw(generate("1f1b", 4, 8), tmp_path / "b.svg", Costs(activation_bytes=3 * 2**20)).read_text()
    assert "live activations (MiB" in svg and "peak live [12, 9, 6, 3] MiB" in svg


def test_draw_rejects_unknown_format(tmp_path):
    with pytest.raises(ScheduleError, match=".png, .svg or .pdf"):
        draw(generate("1f1b", 2, 2), tmp_path / "s.jpg")


# ---------------------------------------------------------------- the shipped example tables
SHIPPED = sorted((Path(__file__).parent.parent / "schedules").glob("*.csv"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_tables_match_their_generators(path):
    parts = path.stem.split("_")
    name, p, m = parts[0], int(parts[1][1:]), int(parts[2][1:])
    v = int(parts[3][1:]) if len(parts) > 3 else None
    assert validate(load_csv(path)) == generate(name, p, m, virtual=v)


def test_a_schedule_keeps_what_it_computed_but_pickles_without_it():
    import pickle
    import subprocess
    import sys

    schedule = generate("1f1b", 2, 4)
    validate(schedule)
    assert schedule.num_microbatches == 4 and hash(schedule) == hash(generate("1f1b", 2, 4))
    copy = pickle.loads(pickle.dumps(schedule))
    assert copy == schedule and not [k for k in vars(copy) if k.startswith("_")]
    # A hash kept from another process (string hashes are salted per process) would not match here.
    code = "import pickle, sys; from jaxmem.schedule import generate; s = generate('1f1b', 2, 4); hash(s); "
    code += "sys.stdout.buffer.write(pickle.dumps(s))"
    other = pickle.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout)
    assert hash(other) == hash(schedule) and other in {schedule}
