"""Exit codes and the errors the ``distmis`` command turns into them."""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # the shell's 128 + SIGINT, 128 + SIGTERM

#: What each exit status of ``distmis`` means: the one definition ``distmis --help`` prints and the README's
#: "Exit codes" table repeats (tests/cli/test_help.py holds the two to it).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success (also a --resume with nothing left to run)"),
    (EXIT_FAILED, "the work ran but did not all succeed: some trials failed, or the best model could not be "
                  "loaded, scored on the test split or published; a followed job that did not succeed; a server or "
                  "cluster that did not start, or is not up"),
    (EXIT_BAD_INPUT, "bad input (spec, data, arguments, model, an unreachable tracking store, an unfinished or "
                     "changed search folder, an output folder that cannot be written in or whose disk has no room "
                     "for the data): refused before any work, nothing written"),
    (EXIT_INTERRUPTED, "interrupted by Ctrl-C: the search's unfinished MLflow runs are marked KILLED; --resume "
                       "continues it"),
    (EXIT_TERMINATED, "stopped by SIGTERM (as distmis stop sends it): the same"),
)


class BadInput(ValueError):
    """An argument the user gave cannot be used (exit 2; nothing was started)."""
