"""``distmis plan`` refuses machine figures its plot cannot show, naming the option (issue 32, item 7).

Every figure of the machine (--ranks, --memory-per-rank, --device-flops, --bandwidth, --reserved) must be a finite
positive number, refused by the parser; one that is finite but so extreme that a prediction overflows, or lies
beyond what a log-scale plot draws, is refused before anything is written. The real command on the shipped
vit-seg spec, in-process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distmis.cli.main import main

SPEC = Path(__file__).parents[2] / "search_spaces" / "vit_sp.yaml"


def plan(tmp_path: Path, *args: str) -> int:
    return main(["plan", str(SPEC), "--output", str(tmp_path / "out"), *args])


@pytest.mark.parametrize("option,value", [
    ("--device-flops", "nan"), ("--device-flops", "inf"), ("--device-flops", "-3e12"), ("--device-flops", "0"),
    ("--bandwidth", "inf"), ("--bandwidth", "0"), ("--bandwidth", "many"),
    ("--memory-per-rank", "inf"), ("--memory-per-rank", "-1GB"), ("--reserved", "nan"),
    ("--ranks", "0"), ("--ranks", "-2"), ("--ranks", "1.5"),
])
def test_a_figure_that_is_not_finite_and_positive_is_refused_by_the_parser(tmp_path: Path, capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        plan(tmp_path, f"{option}={value}")
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and option in err and value in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,option", [
    (["--device-flops", "1e-300"], "--device-flops"),  # the case: every step time is infinite
    (["--device-flops", "1e-250"], "--device-flops"),  # finite step times of 1e262 s: beyond the plot
    (["--bandwidth", "1e-305"], "--bandwidth"),
    (["--memory-per-rank", "1e300"], "--memory-per-rank"),  # the plot's memory line overflows matplotlib
    (["--device-flops", "1e308", "--bandwidth", "1e308"], "--device-flops"),
    (["--device-flops", "1e-90"], "--device-flops"),  # within range, but the predicted step time is 1e102 s
    (["--bandwidth", "1e-95"], "--bandwidth"),
    (["--ranks", str(2**31)], "--ranks"),  # more than a billion devices
])
def test_a_figure_whose_predictions_overflow_exits_2_naming_it(tmp_path: Path, capsys, args, option):
    code = plan(tmp_path, *args)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    value = args[1] if option == "--ranks" else f"{float(args[1]):g}"
    assert "Traceback" not in captured.err and option in captured.err and value in captured.err, captured.err
    assert not (tmp_path / "out").exists()


def test_the_largest_rank_count_is_planned_quickly(tmp_path: Path, capsys):
    """Degrees are the divisors of --ranks, found without counting up to it."""
    import time

    from distmis.parallel.planner import MAX_RANKS

    start = time.perf_counter()
    code = plan(tmp_path, "--ranks", str(MAX_RANKS), "--memory-per-rank", "6GB")
    assert time.perf_counter() - start < 60
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "plan.png").is_file()


def test_ordinary_figures_still_plan(tmp_path: Path, capsys):
    assert plan(tmp_path, "--device-flops", "1e12", "--bandwidth", "1e9", "--memory-per-rank", "6GiB") == 0
    assert (tmp_path / "out" / "plan.png").stat().st_size > 0
