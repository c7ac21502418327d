"""`jaxmem schedule ...` end to end (in-process), including its error paths."""

import json
import subprocess
import sys

import pytest

from jaxmem.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json_keys(capsys):
    code, out, _ = run(capsys, "schedule", "simulate", "1f1b", "--pipe", "4", "--microbatches", "8", "--json")
    assert code == 0
    record = json.loads(out)
    for key in (
        "schedule",
        "ranks",
        "stages",
        "microbatches",
        "makespan",
        "bubble_fraction",
        "peak_inflight",
        "valid",
    ):
        assert key in record
    assert record["makespan"] == 33 and record["peak_inflight"] == [4, 3, 2, 1] and record["valid"]


def test_show_list_and_table(capsys):
    assert run(capsys, "schedule", "list")[0] == 0
    code, out, _ = run(capsys, "schedule", "show", "zbv", "--pipe", "2", "--microbatches", "2")
    assert code == 0 and "rank 1" in out and "3F0" in out


def test_export_check_draw_simulate_csv(capsys, tmp_path):
    csv_path = tmp_path / "il.csv"
    assert run(capsys, "schedule", "export", "interleaved-1f1b", "--virtual", "2", "-o", str(csv_path))[0] == 0
    code, out, _ = run(capsys, "schedule", "check", str(csv_path))
    assert code == 0 and out.startswith("valid")
    code, out, _ = run(capsys, "schedule", "simulate", "--csv", str(csv_path), "--json")
    assert json.loads(out)["stages"] == 8
    png = tmp_path / "il.png"
    assert run(capsys, "schedule", "draw", "--csv", str(csv_path), "-o", str(png))[0] == 0
    assert png.stat().st_size > 1000


def test_check_reports_invalid_schedule(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0\n")
    code, _, err = run(capsys, "schedule", "check", str(bad))
    assert code == 1
    assert "rank 0, step 1" in err and "add 0B1" in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["schedule", "simulate", "2f2b"], "unknown schedule '2f2b'; valid names"),
        (["schedule", "show", "interleaved-1f1b", "--pipe", "4", "--microbatches", "6"], "use M in 4, 8"),
        (["schedule", "check", "/nonexistent/x.csv"], "does not exist"),
        (["schedule", "simulate"], "name a schedule"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_malformed_cell_via_console_script(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0,1X0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem", "schedule", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "row 2 (rank 1), column 2" in proc.stderr and "Traceback" not in proc.stderr
