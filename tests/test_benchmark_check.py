"""benchmarks/check.py, the regression check of the headline figures: every check reads its figure
from its record (a renamed key or a dropped record fails here, not at release time), the verdict
follows the tolerance and the bar, and the staleness of a record follows git."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import check  # noqa: E402


@pytest.mark.parametrize("c", check.CHECKS, ids=[c.name for c in check.CHECKS])
def test_every_check_reads_its_figure_from_its_record(c):
    import json

    record = json.loads((check.RESULTS / c.record).read_text())
    value = c.figure(record)
    assert isinstance(value, float) and value == value  # a number, not NaN
    assert (check.ROOT / "benchmarks" / c.command[0]).exists()
    assert all((check.ROOT / d).exists() for d in c.depends), c.depends
    assert c.holds(value, value) == (c.bar is None or (value <= c.bar[1] if c.bar[0] == "<=" else value >= c.bar[1]))


def test_the_verdict_follows_tolerance_and_bar():
    c = next(c for c in check.CHECKS if c.bar == ("<=", 0.15))
    assert c.holds(0.10, 0.05) and not c.holds(0.10 + c.tolerance + 0.06, 0.10)
    assert not c.holds(0.16, 0.10)  # within the tolerance, over the bar


def test_staleness_reads_the_commits_after_the_record(capsys):
    assert check.main(["--stale", "--only", "rOAM"]) == 0
    line = capsys.readouterr().out
    assert "ROAM reduction" in line and "record 20" in line
    with pytest.raises(SystemExit):
        check.main(["--only", "nonsense"])
