"""The suite's file order under pytest-xdist: longest first, by the table docs/test_durations.md holds.

tests/conftest.py reads each file's seconds from that table (scripts/test_durations.py writes it from a JUnit
XML); these tests write such a table from a hand-made XML and check what the order is made of.
"""

import subprocess
import sys
from pathlib import Path

from tests.conftest import DURATIONS_TABLE, measured_seconds

REPO = Path(__file__).resolve().parent.parent

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_short" name="test_a" time="1.25"/>
<testcase classname="tests.test_long" name="test_b" time="30.5"/>
<testcase classname="tests.test_long" name="test_c" time="2.0"/>
<testcase classname="tests.test_middle" name="test_d" time="7.75"/>
</testsuite></testsuites>"""


def test_the_durations_script_writes_what_the_order_reads(tmp_path):
    (tmp_path / "suite.xml").write_text(JUNIT)
    table = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "test_durations.py"), str(tmp_path / "suite.xml"), "--note", "x"],
        check=True, capture_output=True, text=True,
    ).stdout
    (tmp_path / "durations.md").write_text(table)
    # Sums of the tests' times, written with one decimal: 30.5 + 2.0, 7.75 (written 7.8), 1.25 (written 1.2).
    assert measured_seconds(tmp_path / "durations.md") == {"test_long.py": 32.5, "test_middle.py": 7.8,
                                                           "test_short.py": 1.2}
    assert measured_seconds(tmp_path / "missing.md") == {}


def test_the_shipped_table_lists_the_longest_files():
    seconds = measured_seconds(DURATIONS_TABLE)
    # Every file it names exists (a renamed or removed file would otherwise keep a stale place), and it has
    # the files the order matters most for: the long ones.
    assert seconds and all((REPO / "tests" / name).is_file() for name in seconds), sorted(
        name for name in seconds if not (REPO / "tests" / name).is_file())
    assert max(seconds.values()) > 30
