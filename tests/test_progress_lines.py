"""Progress in a log (stderr not a terminal): plain lines at a steady pace, not a tqdm bar."""
from __future__ import annotations

import io

from megafixed.progress_lines import ProgressLines, progress_mode


def test_lines_come_at_the_pace_asked_with_counts_percent_and_eta():
    now = [0.0]
    out = io.StringIO()
    p = ProgressLines(1000, desc="scoring", unit="requests", every_s=30, stream=out, clock=lambda: now[0])
    for _ in range(10):  # 100 requests per 10 s: a line at 30 s, 60 s, 90 s
        now[0] += 10
        p.update(100)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "scoring: 300/1,000 requests (30%), 0m30s, ETA 1m10s"
    assert lines[1].startswith("scoring: 600/1,000 requests (60%), 1m00s, ETA 0m40s")
    assert lines[-1] == "scoring: 1,000/1,000 requests (100%), 1m40s" and len(lines) == 4


def test_a_short_loop_stays_quiet_and_the_mode_follows_the_stream():
    out = io.StringIO()
    p = ProgressLines(5, desc="x", unit="items", stream=out, clock=lambda: 0.0)
    p.update(5)
    p.close()
    assert out.getvalue() == ""
    assert progress_mode(False, io.StringIO()) == "lines" and progress_mode(True, io.StringIO()) is False

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_mode(False, Tty()) == "bar"
