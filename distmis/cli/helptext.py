"""What ends each command's ``--help``: one or two examples, and for ``distmis --help`` the exit codes.

:data:`EXAMPLES` holds every command's examples, keyed by its path (``"data synth"``; ``""`` is ``distmis``
itself), each an example command line and what it does. :func:`add_help_text` gives every parser of the tree its
examples as an epilog (printed line for line) and, for a subcommand, its one-line ``help`` as the description
``distmis COMMAND --help`` starts with. tests/cli/test_help.py checks that every command has examples, every
option has help text, and every example parses as the command it is listed under.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from typing import Iterator

from distmis.cli.errors import EXIT_CODES

__all__ = ["EXAMPLES", "add_help_text", "commands", "exit_codes_text"]

#: Every command's examples: ``(command line, what it does)``, one or two each.
EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "": (("distmis validate search_spaces/quickstart.yaml", "check a spec: a bad field is named, exit 2"),
         ("distmis run search_spaces/quickstart.yaml", "run its search on a local Ray; results in runs/quickstart")),
    "validate": (("distmis validate search_spaces/quickstart.yaml", "check a spec, start nothing"),
                 ("distmis validate search_spaces/ct_spleen.yaml --set dataset.path=data/Task09_Spleen",
                  "check it with a field overridden, as run would take it")),
    "run": (("distmis run search_spaces/quickstart.yaml --set training.epochs=3", "a search, 3 epochs a trial"),
            ("distmis run search_spaces/quickstart.yaml --output runs/quickstart --resume",
             "continue a search that was interrupted")),
    "compare": (("distmis compare search_spaces/quickstart.yaml --workers 1,2 --repeats 3",
                 "experiment- against data-parallel on 1 and 2 workers, every cell 3 times"),),
    "plan": (("distmis plan search_spaces/vit_axial.yaml --ranks 4 --memory-per-rank 6GB",
              "predicted layouts of 4 ranks of 6 GB each; writes plan.png"),
             ("distmis plan benchmarks/speedup.yaml --workers 8 --per-node 4 --device-flops 30e12 --gantt plan.png",
              "the search's makespan on 8 workers of two nodes: experiment, data-parallel and auto")),
    "init": (("distmis init data/quickstart-msd -o runs/quickstart-init.yaml",
              "a spec for the data set, for this machine's CPUs and memory"),
             ("distmis init data/Task09_Spleen --gpus-per-worker 1 --memory-per-worker 24GB --workers 8 "
              "--networks unet3d,dynunet -o spleen.yaml", "for 8 GPUs of 24 GB, the U-Net against nnU-Net's")),
    "results": (("distmis results runs/quickstart", "the results table of the search in runs/quickstart"),
                ("distmis results runs/quickstart --format csv", "the same as CSV")),
    "predict": (("distmis predict runs/quickstart data/heldout/imagesTr --output runs/heldout-seg --labels",
                 "segment a folder of scans with a search's best model; score those with labels"),
                ("distmis predict models:/quickstart@best data/heldout/imagesTr/BRATS_001.nii.gz --output segs "
                 "--tracking-uri sqlite:///runs/quickstart/mlflow.db", "one scan, with the registered model")),
    "cluster": (("distmis cluster up", "a Ray head on 127.0.0.1 with token authentication"),
                ("distmis cluster down", "stop it")),
    "cluster up": (("distmis cluster up", "dashboard and Jobs API on 127.0.0.1:8265"),
                   ("distmis cluster up --num-cpus 8 --dashboard-port 8266", "offer 8 CPUs, dashboard on 8266")),
    "cluster status": (("distmis cluster status", "exit 0 when the cluster is up, with its nodes and resources"),),
    "cluster down": (("distmis cluster down", "stop the cluster 'distmis cluster up' started"),),
    "submit": (("distmis submit search_spaces/quickstart.yaml --follow", "run a spec as a job, print its log"),
               ("distmis submit search_spaces/quickstart.yaml --address http://127.0.0.1:8265 --output "
                "runs/quickstart --resume", "continue a stopped job's search")),
    "jobs": (("distmis jobs", "the jobs of the cluster 'distmis cluster up' started"),
             ("distmis jobs --address http://127.0.0.1:8265", "another cluster's")),
    "status": (("distmis status distmis-quickstart-20261127-080000", "a job's status"),),
    "logs": (("distmis logs distmis-quickstart-20261127-080000 --follow", "a job's log, until it ends"),),
    "stop": (("distmis stop distmis-quickstart-20261127-080000", "stop a job: its search's runs end KILLED"),),
    "ui": (("distmis ui runs/quickstart", "the MLflow UI of that search's store on http://127.0.0.1:5000"),
           ("distmis ui --tracking-uri sqlite:///runs/quickstart/mlflow.db --port 5050", "any store, another port")),
    "data": (("distmis data synth data/heldout --cases 3 --seed 7", "three synthetic brain MRI cases"),
             ("distmis data inspect data/Task09_Spleen", "what a data set holds")),
    "data synth": (("distmis data synth data/heldout --cases 3 --seed 7", "three brain MRI cases, MSD layout"),
                   ("distmis data synth data/ct --kind ct --layout nnunet --cases 10 --lps-cases 2",
                    "ten CT-like cases in the nnU-Net layout, the last two stored LPS")),
    "data tfrecord": (("distmis data tfrecord data/Task09_Spleen data/spleen-tfr --labels classes --orientation RAS "
                       "--spacing auto --crop 96,96,96", "convert MSD Task09, resampled to its median spacing"),
                      ("distmis data tfrecord data/quickstart-msd data/quickstart-tfr --split 0.8 0.1 0.1 --seed 1",
                       "another split")),
    "data inspect": (("distmis data inspect data/Task09_Spleen", "channels, classes, shapes, spacings, a row a case"),
                     ("distmis data inspect data/Task09_Spleen --json", "its fingerprint, as JSON")),
}


def commands(parser: argparse.ArgumentParser, path: str = "",
             summary: str = "") -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """``parser`` and every parser under it, depth first: ``(path, parser, its one-line help)``; ``path`` and
    ``summary``: ``parser``'s own."""
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}".strip(), helps.get(name, ""))


def _width() -> int:
    """argparse's own text width."""
    return max(shutil.get_terminal_size().columns - 2, 40)


def _examples_text(examples: tuple[tuple[str, str], ...]) -> str:
    lines = ["examples:"]
    for command, what in examples:
        lines += [f"  # {what}", f"  {command}"]
    return "\n".join(lines)


def exit_codes_text() -> str:
    """The exit codes of :data:`distmis.cli.errors.EXIT_CODES`, one per paragraph."""
    lines = ["exit codes:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(meaning, _width(), initial_indent=f"  {code:<5}", subsequent_indent=" " * 7,
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def add_help_text(parser: argparse.ArgumentParser) -> None:
    """Give every parser under ``parser`` its :data:`EXAMPLES` as an epilog (and ``distmis`` itself the exit codes
    after them), and every subcommand its help as a description."""
    for path, command, summary in commands(parser):
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        if summary and command.description is None:
            command.description = textwrap.fill(summary[0].upper() + summary[1:] + ".", _width())
        parts = [_examples_text(EXAMPLES[path])] if path in EXAMPLES else []
        if not path:
            parts.append(exit_codes_text())
        if parts:
            command.epilog = "\n\n".join(parts)
