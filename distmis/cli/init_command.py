"""``distmis init DATASET``: a complete, commented search spec for a data set and a worker's memory
(:mod:`distmis.search.draft_spec` drafts it; this module reads the options and writes the file)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_init_command", "cmd_init"]


def cmd_init(args: argparse.Namespace) -> int:
    from distmis.cli.errors import BadInput
    from distmis.data.errors import DataError
    from distmis.search.draft_spec import InitRequest, draft_spec
    from distmis.search.draft_yaml import checked_spec, render_spec
    from distmis.spec import SpecError

    out = Path(args.output) if args.output else None
    if out is not None and out.exists() and not args.force:
        raise BadInput(f"-o {out}: the file exists; --force replaces it")
    try:
        request = InitRequest(
            dataset=args.dataset, layout=args.layout, memory_per_worker=args.memory_per_worker,
            workers=args.workers, gpus_per_worker=args.gpus_per_worker, cpus_per_worker=args.cpus_per_worker,
            networks=tuple(args.networks), framework=args.framework, epochs=args.epochs, name=args.name,
            device_flops=args.device_flops)
        draft = draft_spec(request)
    except (SpecError, DataError):
        raise
    except ValueError as exc:  # an option the data or the machine cannot take
        raise BadInput(str(exc)) from None
    command = "distmis " + " ".join(shlex.quote(a) for a in getattr(args, "argv", ["init", args.dataset]))
    text = render_spec(draft, str(out) if out else "spec.yaml", command)
    checked_spec(text)  # as `distmis run` will read it
    notes = sys.stderr if out is None else sys.stdout
    print(draft.plan.describe(), file=notes)
    if out is None:
        sys.stdout.write(text)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:  # written whole or not at all
        partial.write_text(text)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    trials = draft.spec.search.num_samples
    print(f"wrote {out}: {draft.spec.name}, {trials} trials of {', '.join(request.networks)} on tile "
          f"{list(draft.plan.tile)} at batch {draft.plan.batch}; run it with: distmis run {out}")
    return 0


def add_init_command(sub: Any, *, size: Callable[[str], float], rate: Callable[[str], float],
                     positive: Callable[[str], int], layouts: list[str]) -> None:
    """Add ``init`` to the parser (the argument types are the CLI's own)."""
    from distmis.models.registry import model_names
    from distmis.search.draft_spec import DEFAULT_NETWORKS

    def networks(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in model_names()]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"unknown network(s) {', '.join(unknown) or repr(text)}; registered: "
                                             f"{', '.join(model_names())}")
        return names

    p = sub.add_parser("init", help="draft a complete search spec for a data set: its tile, batch and networks "
                                    "planned to fit a worker's memory, every trial's step predicted")
    p.add_argument("dataset", help="the data set's folder (MSD or nnU-Net dataset.json, or BraTS case folders)")
    p.add_argument("-o", "--output", help="the spec file to write (default: print it)")
    p.add_argument("--force", action="store_true", help="replace the -o file if it exists")
    p.add_argument("--memory-per-worker", type=size, metavar="SIZE",
                   help="a worker's memory, e.g. 24GB for a GPU of 24 GB (default for CPU workers: this machine's "
                        "memory over --workers; required with --gpus-per-worker)")
    p.add_argument("--workers", type=positive, help="workers the search runs on, one trial each (default: this "
                                                    "machine's CPUs for CPU workers, 1 for GPU workers)")
    p.add_argument("--gpus-per-worker", type=int, choices=[0, 1], default=0, help="1: each worker is a GPU (default 0)")
    p.add_argument("--cpus-per-worker", type=positive, help="CPUs per worker (default: this machine's CPUs over "
                                                            "--workers; 4 with a GPU)")
    p.add_argument("--networks", type=networks, default=list(DEFAULT_NETWORKS), metavar="NAME,NAME",
                   help=f"the networks the search picks from (default {','.join(DEFAULT_NETWORKS)})")
    p.add_argument("--framework", choices=["torch", "tensorflow"], default="torch",
                   help="what every network is built in (default torch; tensorflow: the Keras U-Net only)")
    p.add_argument("--epochs", type=positive, default=50, help="epochs per trial (default 50)")
    p.add_argument("--name", help="the search's name (default: the data set's)")
    p.add_argument("--layout", choices=layouts, help="the data set's layout (default: detected from its files)")
    p.add_argument("--device-flops", type=rate, help="a worker's FLOP/s, for the predicted times (default for CPU "
                                                     "workers: this machine's matmul rate, measured)")
    p.set_defaults(func=cmd_init)
