"""Every command's ``--help``: help text for every option, examples that parse as the command they are listed
under, and the exit codes in ``distmis --help`` and the README, from the one definition."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from distmis.cli.errors import EXIT_CODES
from distmis.cli.helptext import EXAMPLES, commands
from distmis.cli.main import build_parser, main

README = Path(__file__).resolve().parents[2] / "README.md"


def command_path(args: argparse.Namespace) -> str:
    """The command an argument namespace was parsed for: ``"data synth"``, ``"cluster up"``, ``"run"``."""
    names = [args.command] + [getattr(args, f"{args.command}_command", None) or ""]
    return " ".join(n for n in names if n)


def example_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("distmis ")]


def test_every_option_of_every_command_has_help_text():
    missing = [f"distmis {path} {'/'.join(action.option_strings) or action.dest}".replace("  ", " ")
               for path, parser, _ in commands(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction)
               and (action.help is None or not str(action.help).strip())]
    assert not missing, missing


def test_every_command_has_examples_and_every_example_parses_as_its_command(capsys):
    parser = build_parser()
    paths = []
    for path, command, _ in commands(parser):
        paths.append(path)
        examples = example_lines(command.format_help().split("examples:", 1)[-1])
        assert examples, f"distmis {path} --help shows no example"
        assert len(examples) <= 2, f"distmis {path} --help shows {len(examples)} examples"
        for line in examples:
            try:
                args = build_parser().parse_args(shlex.split(line)[1:])
            except SystemExit:
                pytest.fail(f"the example {line!r} of 'distmis {path} --help' does not parse: "
                            f"{capsys.readouterr().err.strip()}")
            parsed = command_path(args)  # a group's examples (distmis data) are of its subcommands
            assert not path or parsed == path or parsed.startswith(f"{path} "), \
                f"{line!r} is listed under 'distmis {path}' but runs 'distmis {parsed}'"
    assert sorted(paths) == sorted(EXAMPLES), "EXAMPLES is keyed by exactly the commands of the parser"


def test_distmis_help_lists_every_exit_code(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = capsys.readouterr().out
    listed = printed.split("exit codes:", 1)[1]
    for code, meaning in EXIT_CODES:
        found = re.search(rf"^  {code}\s+(.*?)(?=^  \d|\Z)", listed, re.MULTILINE | re.DOTALL)
        assert found and " ".join(found.group(1).split()) == meaning, (code, listed)
    assert {0, 1, 2, 130, 143} == {code for code, _ in EXIT_CODES}


def test_the_readme_lists_the_exit_codes_of_the_help():
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", README.read_text().split("### Exit codes", 1)[1], re.MULTILINE)
    assert [(int(code), meaning) for code, meaning in rows] == list(EXIT_CODES)
