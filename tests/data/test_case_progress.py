"""Progress through the cases (distmis.data.case_progress): a bar on a terminal, a few plain lines elsewhere, never
a carriage return in a log."""

from __future__ import annotations

import io

from distmis.data.case_progress import PLAIN_INTERVAL_S, CaseProgress, case_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_it_prints_the_start_the_end_and_at_most_a_tenth_every_interval():
    stream, now = io.StringIO(), [0.0]
    with CaseProgress(40, "tfrecords", stream=stream, clock=lambda: now[0]) as progress:
        for case in range(40):
            now[0] = (case + 1) * PLAIN_INTERVAL_S / 4  # 4 cases per interval: a tenth of them
            progress.update()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "tfrecords: 40 cases" and lines[-1] == "tfrecords: 40/40 cases in 1:40"
    assert lines[1:-1] == [f"tfrecords: {n}/40 cases, {n * 10 // 4 // 60}:{n * 10 // 4 % 60:02d}"
                           for n in range(4, 40, 4)]


def test_a_short_loop_off_a_terminal_prints_two_lines_and_a_stopped_one_no_end():
    stream = io.StringIO()
    with CaseProgress(12, "synthesize", stream=stream, clock=lambda: 0.0) as progress:
        for _ in range(12):
            progress.update()
    assert stream.getvalue() == "synthesize: 12 cases\nsynthesize: 12/12 cases in 0:00\n"
    stream = io.StringIO()
    with CaseProgress(3, "predict", stream=stream, clock=lambda: 0.0) as progress:
        progress.update()  # an error stops the loop: it says what happened itself
    assert stream.getvalue() == "predict: 3 cases\n"


def test_a_terminal_gets_a_bar_and_nothing_is_shown_when_disabled(capsys):
    terminal = Terminal()
    with CaseProgress(3, "inspect", stream=terminal) as progress:
        for _ in range(3):
            progress.update()
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert list(case_progress(range(3), "check", enabled=False)) == [0, 1, 2]
    assert list(case_progress(iter(range(2)), "check")) == [0, 1]  # no len(): counted first
    captured = capsys.readouterr()
    assert captured.err == "check: 2 cases\ncheck: 2/2 cases in 0:00\n" and captured.out == ""
