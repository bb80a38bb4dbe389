"""``distmis``: the command line.

Exit codes: :data:`distmis.cli.errors.EXIT_CODES` (0 success; 1 some trials failed, or the best model could not be
published; 2 bad input, nothing started; 130 / 143 interrupted by Ctrl-C / SIGTERM, runs KILLED), which
``distmis --help`` lists. Every command's ``--help`` ends with examples: :mod:`distmis.cli.helptext`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from distmis.cli.console import console
from distmis.cli.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, BadInput
from distmis.cli.helptext import add_help_text
from distmis.cli.planned import load_planned
from distmis.cli.signals import interrupts_kept
from distmis.data.layouts import Layout
from distmis.train.threads import tensorflow_env

EXIT_TRIALS_FAILED = EXIT_FAILED
LAYOUT_CHOICES = [layout.value for layout in Layout]  # the layouts distmis.data reads
NATIVE_FILTERED = frozenset({"run", "compare", "predict", "data", "validate", "plan", "init"})  # see distmis.cli.console


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.replace("x", ",").split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 64,64,64 or 64x64x64, got {text!r}") from None
    if len(values) != 3 or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected three positive integers, got {text!r}")
    return values  # type: ignore[return-value]


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (``what`` names it in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _synthetic_shape(text: str) -> tuple[int, int, int]:
    shape = _shape(text)
    if min(shape) < 8:
        raise argparse.ArgumentTypeError(f"a synthetic volume needs every dimension >= 8 (room for a brain and a "
                                         f"tumour), got {text!r}")
    return shape


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 1,2,4, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive worker counts like 1,2,4, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    allowed = ("experiment", "data", "auto")
    modes = [v.strip() for v in text.split(",") if v.strip()]
    wrong = [m for m in modes if m not in allowed]
    if not modes or wrong or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected modes among {','.join(allowed)}, each once, like "
                                         f"experiment,data,auto; got {text!r}")
    return modes


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distmis")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


# --------------------------------------------------------------------------- commands
def cmd_validate(args: argparse.Namespace) -> int:
    from distmis.search.input_fit import check_dataset_path
    from distmis.search.memory_fit import check_trials_fit, format_steps
    from distmis.search.search_space import num_trials
    from distmis.spec import parse_set_options

    spec = load_planned(args.spec, parse_set_options(args.set))
    data = Path(spec.dataset.path)
    fit = None
    if data.exists() or spec.dataset.synthetic is not None:
        check_dataset_path(spec)  # as `run` does before any work: dataset.json, every network input against the volumes
        fit = check_trials_fit(spec)  # with parallelism.memory_per_worker: every step predicted to fit
    if fit is not None:
        print(f"each trial's training step, traced ({fit.device} rules), against {fit.usable / 2**20:,.0f} MiB per "
              "worker (parallelism.memory_per_worker less the process's own):")
        print("\n".join(format_steps(fit)))
    print(f"{args.spec}: valid search spec {spec.name!r}, {num_trials(spec)} trial(s)")
    if not data.exists() and spec.dataset.synthetic is None:
        print(f"(dataset.path {str(data)!r} is not on this machine: checked without its data; `run` checks it there)")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from distmis.train.startup import loading_libraries

    with loading_libraries():  # Ray, Tune, MLflow, pandas: no collection while they load, frozen after
        from distmis.search.run import run_search
    from distmis.spec.load import default_output_dir
    from distmis.spec import parse_set_options

    spec = load_planned(args.spec, parse_set_options(args.set))
    output = Path(args.output) if args.output else default_output_dir(spec)
    outcome = run_search(spec, output, address=args.address, progress=not args.quiet, verbose=args.verbose,
                         resume=args.resume)
    if spec.parallelism.mode == "compare":
        return print_comparison(spec, outcome, output)
    return print_search(spec, outcome, output)


def cmd_compare(args: argparse.Namespace) -> int:
    from distmis.train.startup import loading_libraries

    with loading_libraries():
        from distmis.search.compare import run_compare
    from distmis.spec.load import default_output_dir
    from distmis.spec import parse_set_options

    overrides = parse_set_options(args.set)
    overrides["parallelism.mode"] = "compare"
    if args.workers:
        overrides["parallelism.workers"] = args.workers
    if args.repeats is not None:
        overrides["parallelism.repeats"] = args.repeats
    if args.modes:
        overrides["parallelism.modes"] = args.modes
    spec = load_planned(args.spec, overrides)
    output = Path(args.output) if args.output else default_output_dir(spec)
    outcome = run_compare(spec, output, address=args.address, progress=not args.quiet, verbose=args.verbose,
                          resume=args.resume)
    return print_comparison(spec, outcome, output)


def print_comparison(spec: Any, outcome: Any, output: Path) -> int:
    from distmis.tracking.results import format_comparison
    from distmis.tracking.uri import redact_uri

    repeats = spec.parallelism.repeats
    spread = f", {repeats} repeats (mean ± std over the repeats that finished)" if repeats > 1 else ""
    print(f"\nExperiment- vs data-parallel, search {spec.name!r}{spread}:")
    print(format_comparison(outcome.table, "table"))
    if outcome.failed_cells:
        print(f"\nFailed cells: {', '.join(outcome.failed_cells)}")
    uri = redact_uri(outcome.tracking_uri)
    print(f"\nMLflow: experiment {outcome.experiment!r}, comparison run {outcome.parent_run_id}")
    print(f"  tracking URI: {uri}")
    print(f"  distmis results {output}")
    return EXIT_TRIALS_FAILED if outcome.failed_cells else EXIT_OK


def print_search(spec: Any, outcome: Any, output: Path) -> int:
    from distmis.predict.registry import BEST_ALIAS
    from distmis.tracking.results import format_results
    from distmis.tracking.uri import redact_uri

    folds = spec.cv_folds
    rows = f"{len(outcome.results)} configuration(s) x {len(folds)} fold(s)" if folds else \
        f"{len(outcome.results)} trial(s)"
    print(f"\nSearch {spec.name!r}: {rows}, {outcome.failed} failed, {outcome.elapsed_seconds:.1f} s")
    print(format_results(outcome.results, "table"))
    best = outcome.best
    metric = spec.search.selected_metric
    if best is not None and folds:
        std = best.get(f"cv_{metric}_std", float("nan"))
        spread = f" ± {std:.4f}" if std == std else ""
        print(f"\nBest configuration: {best['configuration']}  cv_{metric} = {best[f'cv_{metric}']:.4f}{spread} "
              f"over folds {', '.join(map(str, folds))}")
    elif best is not None:
        print(f"\nBest trial: {best['trial']}  {metric} = {best[f'best_{metric}']:.4f} (epoch {best['best_epoch']})")
    if outcome.test is not None:
        print(f"Test split, {'the fold ensemble' if folds else 'best trial'}: {outcome.test.summary()}")
    if outcome.test_note:
        print(f"Note: {outcome.test_note}")
    uri = redact_uri(outcome.tracking_uri)
    model = outcome.model
    if model is not None and model.folder is not None:
        print(f"\nModel: {model.folder}" + (f", registered as {model.registry_uri}"
                                            + (f" (alias @{BEST_ALIAS})" if model.best else "") if model.version else ""))
        source = f"models:/{model.name}@{BEST_ALIAS} --tracking-uri {uri}" if model.best else str(model.folder)
        print(f"  distmis predict {source} SCANS --output SEGMENTATIONS")
    print(f"\nMLflow: experiment {outcome.experiment!r}, parent run {outcome.parent_run_id}")
    print(f"  tracking URI: {uri}")
    print(f"  distmis results {output}")
    if outcome.failed_trials:
        print(f"error: {outcome.failed} trial(s) did not finish: {', '.join(outcome.failed_trials)} (the same "
              "command with --resume runs them again)", file=sys.stderr)
    for problem in outcome.problems:  # the search's model could not be loaded, scored or published
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_TRIALS_FAILED if outcome.failed or outcome.problems else EXIT_OK


def _bytes(text: str) -> float:
    """``16GB``, ``6GiB``, ``512MB`` or a plain number of bytes."""
    from distmis.spec.schema import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rate(text: str) -> float:
    """A finite positive number, e.g. ``300e12``: a device's FLOP/s or bytes/s."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number like 300e12, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite positive number like 300e12, got {text!r}")
    return value


def cmd_plan(args: argparse.Namespace) -> int:
    from distmis.parallel.planner import Machine, best_layouts, plan_layouts
    from distmis.spec import parse_set_options
    from distmis.spec.load import default_output_dir
    from distmis.tracking.figures import plan_figure

    spec = load_planned(args.spec, parse_set_options(args.set))
    if args.workers is not None:
        return _plan_makespan(args, spec)
    if spec.model.entry.perf_shape is None or not spec.model.entry.supports("sp"):
        return _plan_trial_steps(args, spec)
    try:
        machine = Machine(ranks=args.ranks, memory_per_rank=args.memory_per_rank, device_flops=args.device_flops,
                          bandwidth=args.bandwidth, reserved=args.reserved)
        precision = args.precision or spec.training.precision
        rows = plan_layouts(spec, machine, kernel=args.kernel, precision=precision)
        kernel = args.kernel or spec.model.params.attention_kernel
    except ValueError as exc:
        raise BadInput(f"{args.spec}: {exc}") from None
    best = best_layouts(rows)
    figure = None
    if rows:  # drawn before anything is printed or written: a figure it cannot show is refused here
        try:
            figure = plan_figure(rows, memory_per_rank=machine.usable, title=f"{spec.name}: predicted per rank")
        except ValueError as exc:
            raise BadInput(f"{args.spec}: {exc} (--memory-per-rank {args.memory_per_rank:g}, --reserved "
                           f"{args.reserved:g}, --device-flops {args.device_flops:g}, --bandwidth "
                           f"{args.bandwidth:g})") from None
    print(f"{spec.name}: {args.ranks} rank(s) of {args.memory_per_rank / 2**30:.1f} GiB "
          f"({machine.reserved / 2**30:.1f} GiB reserved), {args.device_flops:.3g} FLOP/s, "
          f"{args.bandwidth:.3g} B/s, {kernel} attention kernel, precision {precision}; batch "
          f"{spec.training.batch_size}")
    print("| patch | tokens | SP | DP | attention | peak GiB | activations MiB | fits | step s | sent MB | TFLOP | FOM "
          "| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.patch} | {row.tokens} | {row.sp} | {row.dp} | {row.attention} | {row.memory.peak / 2**30:.2f} "
              f"| {row.memory.activation_memory / 2**20:.1f} "
              f"| {'yes' if row.fits else 'no'} | {row.step_seconds:.3g} | {row.comm.total / 1e6:.1f} "
              f"| {row.flops.matmul / 1e12:.3g} | {row.fom:.3g} | {'best' if best.get(row.patch) is row else ''} |")
    output = Path(args.output) if args.output else default_output_dir(spec)
    output.mkdir(parents=True, exist_ok=True)
    if figure is not None:
        figure.savefig(output / "plan.png", dpi=120)
        print(f"\nplot: {output / 'plan.png'}")
    missing = [p for p in sorted({r.patch for r in rows}) if p not in best]
    if not best:
        need = min((r.memory.peak for r in rows), default=0.0)
        print(f"\nnothing fits: the smallest predicted peak is {need / 2**30:.2f} GiB per rank, "
              f"{machine.usable / 2**30:.2f} GiB usable (tile {list(spec.training.tile or [])}, patches "
              f"{sorted({r.patch for r in rows})}); use more ranks, a larger patch or the fused kernel")
        return EXIT_BAD_INPUT
    if missing:
        print(f"\npatch {', '.join(map(str, missing))}: no layout fits")
    return EXIT_OK


def _plan_makespan(args: argparse.Namespace, spec: Any) -> int:
    """``distmis plan SPEC --workers W``: the search's predicted makespan by mode, and auto's schedule
    (``distmis/search/makespan_plan.py``); ``--gantt`` draws the schedules."""
    from distmis.perf.makespan import Cluster
    from distmis.search.makespan_plan import Hardware, calibrate, check_calibration, format_makespan, plan_makespan
    from distmis.tracking.figures import gantt_figure

    checked = None
    try:
        cluster = Cluster(workers=args.workers, per_node=args.per_node, bandwidth=args.bandwidth,
                          inter_node_bandwidth=args.inter_node_bandwidth)
        if args.calibrate:
            calibration = calibrate(args.calibrate, device=args.device, threads=args.threads)
            hardware = calibration.hardware(args.step_overhead)
            checked = check_calibration(args.calibrate, calibration, device=args.device, threads=args.threads)
        else:
            hardware = Hardware(device_flops=args.device_flops, startup_seconds=args.startup_seconds,
                                step_overhead=args.step_overhead)
        plan = plan_makespan(spec, cluster, hardware, device=args.device, threads=args.threads)
    except ValueError as exc:
        raise BadInput(f"{args.spec}: {exc}") from None
    if args.calibrate:
        print(f"calibrated on {calibration.trials} trial(s) of {args.calibrate}: {hardware.device_flops:.3g} FLOP/s "
              f"a worker, {hardware.startup_seconds:.3g} s start-up a trial, {hardware.cold_start_seconds:.3g} s "
              "more for the first on a worker")
        if checked is not None:
            predicted, measured = checked
            print(f"  that search, predicted in its own mode on its {calibration.capacity} worker(s): "
                  f"{predicted:.1f} s; measured: {measured:.1f} s ({predicted / measured - 1:+.0%})")
    print(f"{spec.name}: {hardware.device_flops:.3g} FLOP/s a worker, {args.bandwidth:.3g} B/s inside a node, "
          f"{args.inter_node_bandwidth:.3g} B/s between nodes, {hardware.startup_seconds:.3g} s start-up a trial")
    print(format_makespan(plan))
    if args.gantt:
        gantt = Path(args.gantt)
        figure = gantt_figure([plan.fixed[0], min(plan.fixed[1:], key=lambda s: s.makespan, default=plan.fixed[0]),
                               plan.auto],
                              title=f"{spec.name} on {args.workers} worker(s), predicted")
        gantt.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(gantt, dpi=120)
        print(f"\nGantt chart: {gantt}")
    return EXIT_OK


def _plan_trial_steps(args: argparse.Namespace, spec: Any) -> int:
    """``distmis plan`` for a network the performance model does not describe: every distinct training step the
    search can take, traced (``distmis/search/trial_steps.py``), against ``--memory-per-rank`` less ``--reserved``."""
    from distmis.search.memory_fit import StepsFit, format_steps
    from distmis.search.trial_steps import trial_steps

    usable = args.memory_per_rank - args.reserved
    if usable <= 0:
        raise BadInput(f"--reserved ({args.reserved:g} bytes) must be less than --memory-per-rank "
                       f"({args.memory_per_rank:g} bytes)")
    from distmis.search.data_shape import data_shape
    from distmis.spec.load import with_volume

    try:  # the data set's own channels, activation and volume, where it can be read
        data = data_shape(spec)
        spec, channels, activation = with_volume(spec, data.volume, "the data set"), data.channels, data.activation
        source = f"{data.channels[0]} channel(s) in and {data.channels[1]} out, from the data set"
    except ValueError:  # DataError too: not there yet, and the spec's guess is used
        channels, activation, source = None, None, "channels as far as the spec tells (the data set is not read)"
    try:
        steps = trial_steps(spec, device=args.device, threads=args.threads, precision=args.precision,
                            channels=channels, activation=activation)
    except ValueError as exc:
        raise BadInput(f"{args.spec}: {exc}") from None
    print(f"{spec.name}: a rank's training step per trial, traced ({args.device} rules, {source}), against "
          f"{args.memory_per_rank / 2**30:.1f} GiB per rank less {args.reserved / 2**30:.1f} GiB reserved")
    print("\n".join(format_steps(StepsFit(steps, usable, args.device))))
    fitting = [s.memory.peak <= usable for s in steps if s.memory is not None]
    if fitting and not any(fitting):
        need = min(s.memory.peak for s in steps if s.memory is not None)
        print(f"\nnothing fits: the smallest predicted peak is {need / 2**30:.2f} GiB per rank, and a rank has "
              f"{usable / 2**30:.2f} GiB (--memory-per-rank less --reserved): a smaller tile or batch, bf16, or "
              "more memory")
        return EXIT_BAD_INPUT
    if not all(fitting):
        print(f"\n{fitting.count(False)} of {len(fitting)} steps do not fit")
    return EXIT_OK


def cmd_results(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from distmis.tracking.mlflow_tracking import ROLE_TAG
    from distmis.tracking.results import (
        ResultsNotFound, comparison_frame, find_search_run, format_comparison, format_results, results_frame,
    )

    uri, experiment, run_id = _results_source(args)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise BadInput(f"--tracking-uri {uri}: no such sqlite file")
    client = MlflowClient(tracking_uri=uri)
    try:
        parent = find_search_run(client, experiment, run_id) if experiment else client.get_run(str(run_id))
    except ResultsNotFound as exc:
        raise BadInput(str(exc)) from None
    is_comparison = parent.data.tags.get(ROLE_TAG) == "compare"
    frame = comparison_frame(client, parent) if is_comparison else results_frame(client, parent)
    if args.format == "table":
        kind = "comparison" if is_comparison else "search"
        print(f"{kind} run {parent.info.run_id} ({parent.info.run_name}, {parent.info.status})")
    print(format_comparison(frame, args.format) if is_comparison else format_results(frame, args.format))
    return EXIT_OK


def _results_source(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """The tracking URI, experiment and run of ``distmis results``: from a search's output folder (its
    ``search_state.json`` names its run and store), or from ``--tracking-uri`` and ``--experiment``."""
    from distmis.search.state import SearchState
    from distmis.tracking.mlflow_tracking import default_tracking_uri
    from distmis.tracking.uri import is_redacted

    if args.output is None:
        if not args.tracking_uri or not args.experiment:
            raise BadInput("distmis results needs a search's output folder (distmis results runs/quickstart), or "
                           "--tracking-uri and --experiment")
        return args.tracking_uri, args.experiment, args.run_id
    folder = Path(args.output)
    state = SearchState.load(folder) if folder.is_dir() else None
    if state is None:
        raise BadInput(f"{str(folder)!r} is not a search's output folder (it holds no search_state.json); give a "
                       "folder a `distmis run` wrote, or --tracking-uri and --experiment")
    uri = args.tracking_uri or state.tracking_store or default_tracking_uri(folder)
    if is_redacted(uri) and not args.tracking_uri:
        raise BadInput(f"the search in {str(folder)!r} logs to {uri}, whose password is not kept: give "
                       "--tracking-uri (or set MLFLOW_TRACKING_URI)")
    return uri, args.experiment, args.run_id or state.run_id


def _fold_list(text: str) -> tuple[int, ...]:
    """``--folds``: a comma list of distinct fold numbers (integers >= 0), e.g. ``0,2``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fold numbers like 0,2 (integers >= 0), got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected fold numbers like 0,2 (integers >= 0), got {text!r}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"a fold is named more than once in {text!r}")
    return values


def _mirror_axes(text: str) -> tuple[int, ...]:
    """``--mirror``'s value: a comma list of distinct spatial axes 0, 1, 2, e.g. ``0,1``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected axes like 0,1 (of 0, 1, 2), got {text!r}") from None
    if any(v not in (0, 1, 2) for v in values):
        raise argparse.ArgumentTypeError(f"expected axes like 0,1 (of 0, 1, 2), got {text!r}")
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"an axis is named more than once in {text!r}")
    return tuple(sorted(values))


def cmd_predict(args: argparse.Namespace) -> int:
    from distmis.data.scans import discover_scans
    from distmis.predict.model import SegmentationModel
    from distmis.predict.recipe import RecipeError
    from distmis.predict.resolve import ModelNotFound, model_folder
    from distmis.predict.segment import check_output_folder, check_outputs, check_scans, predict_scans

    # Bad input is refused before a file is written: the output folder, the scans found, the files to write; then,
    # with the model loaded (it says which channels and label values a scan holds), every scan's headers and voxel
    # data (read once, not kept).
    check_output_folder(args.output)
    scans = discover_scans(args.input, args.layout)
    check_outputs(scans, args.output, overwrite=args.overwrite)
    start = time.perf_counter()
    try:
        with model_folder(args.model, args.tracking_uri) as folder:
            model = SegmentationModel.load(folder)
    except (ModelNotFound, RecipeError) as exc:
        raise BadInput(str(exc)) from None
    try:  # before a scan is read
        folds = model.check_folds(args.folds)
    except ValueError as exc:
        raise BadInput(f"--folds: {exc}") from None
    try:
        mirror = model.check_mirror(args.mirror)
    except ValueError as exc:
        raise BadInput(f"--mirror: {exc}") from None
    check_scans(scans, labels=args.labels, progress=not args.quiet, recipe=model.recipe)
    results = predict_scans(model, scans, args.output, score=args.labels, progress=not args.quiet,
                            overwrite=args.overwrite, checked=True, folds=folds, mirror=mirror)
    seconds = time.perf_counter() - start
    scored = [r for r in results if r.scores is not None]
    if scored:
        import pandas as pd

        frame = pd.DataFrame([{"case": r.case_id, **r.scores, "seconds": round(r.seconds, 2)} for r in scored])
        print(frame.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
        dice = [c for c in frame.columns if c.startswith("dice_")]
        print("mean: " + ", ".join(f"{c} {frame[c].mean():.4f}" for c in dice))
    if args.labels and len(scored) < len(results):
        print(f"{len(results) - len(scored)} case(s) have no label file: not scored")
    ensemble = f", folds {', '.join(map(str, folds or model.folds))}" if model.folds else ""
    axes = model.mirror if mirror is None else mirror
    mirrored = f", mirrored on axes {', '.join(map(str, axes))}" if axes else ""
    print(f"segmented {len(results)} case(s) in {seconds:.1f} s ({model.recipe.model}, {model.recipe.framework}"
          f"{ensemble}{mirrored}, on {model.device}) -> {args.output}")
    return EXIT_OK


def cmd_data_synth(args: argparse.Namespace) -> int:
    from distmis.data.synthetic import synthesize_dataset

    if args.lps_cases > args.cases:
        raise BadInput(f"data synth: --lps-cases {args.lps_cases} is more than --cases {args.cases}")
    try:
        ids = synthesize_dataset(args.out, args.layout, cases=args.cases, shape=args.shape, seed=args.seed,
                                 progress=not args.quiet, kind=args.kind, lps_cases=args.lps_cases)
    except ValueError as exc:  # the generator's own argument checks (e.g. --kind ct with --layout brats): bad input
        raise BadInput(f"data synth: {exc}") from None
    lps = f", the last {args.lps_cases} in LPS orientation" if args.lps_cases else ""
    print(f"wrote {len(ids)} synthetic {args.kind} cases in the {args.layout} layout to {args.out}{lps}")
    return EXIT_OK


def cmd_data_tfrecord(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from distmis.data.layouts import check_cases, discover_cases
    from distmis.data.split import make_split
    from distmis.search.data_config import dataset_description, preprocess_config, with_statistics
    from distmis.spec.schema import DatasetSpec

    layout = _layout_of(args)
    try:
        dataset = DatasetSpec(path=str(args.dataset), layout=layout, labels=args.labels, crop=args.crop,
                              resize=args.resize, orientation=args.orientation, spacing=args.spacing,
                              normalization=args.normalization)
    except ValidationError as exc:
        raise BadInput(f"data tfrecord: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None
    description = dataset_description(dataset)
    cases = discover_cases(args.dataset, layout)
    check_cases(cases, description)
    train, val, test = args.split
    try:
        split = make_split([c.case_id for c in cases], train=train, val=val, test=test, seed=args.seed)
    except ValueError as exc:
        raise BadInput(f"--split {train} {val} {test}: {exc}") from None
    config = preprocess_config(dataset, description, cases, split)
    config = with_statistics(config, cases, split, description, progress=not args.quiet)
    from distmis.data.tfrecord import convert_to_tfrecords

    manifest = convert_to_tfrecords(cases, split, config, args.out, shards_per_split=args.shards,
                                    workers=args.workers, progress=not args.quiet, overwrite=args.overwrite,
                                    description=description)
    counts = ", ".join(f"{name}: {manifest.splits[name]['num_cases']}" for name in ("train", "val", "test"))
    print(f"wrote TFRecords to {args.out} ({counts}; image shape {manifest.image_shape})")
    return EXIT_OK


def _spacing(text: str) -> str | tuple[float, float, float]:
    """``auto`` or ``X,Y,Z``: three positive numbers (mm)."""
    if text.strip() == "auto":
        return "auto"
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected 'auto' or three positive numbers X,Y,Z (mm), got {text!r}")
    return values  # type: ignore[return-value]


def _layout_of(args: argparse.Namespace) -> str:
    """``--layout``, or the layout the data set's file names show."""
    if args.layout:
        return args.layout
    from distmis.data.scans import detect_layout

    layout = detect_layout(args.dataset).value
    print(f"layout: {layout} (detected; --layout sets it)", file=sys.stderr)
    return layout


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from distmis.data.inspect import format_summary, summarize_dataset

    if args.json:  # the fingerprint, for a program or a plan to read
        from distmis.data.fingerprint import compute_fingerprint

        print(compute_fingerprint(args.dataset, _layout_of(args), progress=not args.quiet).to_json())
        return EXIT_OK
    summary = summarize_dataset(args.dataset, _layout_of(args), progress=not args.quiet)
    print(format_summary(summary))
    if len(summary.cases):
        print()
        print(summary.cases.drop(columns=["label_counts"]).to_string(index=False))
    return EXIT_OK


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distmis",
        description="Hyperparameter search for 3D medical image segmentation on Ray, tracked in MLflow.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, and the libraries' own output (Ray Tune, TensorFlow, MLflow)")
    parser.add_argument("--version", action="version", version=f"distmis {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("spec", help="search spec YAML (see docs/spec.md)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec field by dotted path, value parsed as YAML (repeatable)")

    p = sub.add_parser("validate", help="check a search spec without running anything")
    spec_args(p)
    p.set_defaults(func=cmd_validate)

    def search_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--output", help="output folder (default: runs/<spec name>, or $DISTMIS_OUTPUT/<name>)")
        p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                       help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)")
        p.add_argument("--quiet", action="store_true", help="no progress output (the results table only)")
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="Ray Tune's reporter, the trial processes' output and the libraries' logs as well")
        p.add_argument("--resume", action="store_true",
                       help="continue the interrupted search in --output (same spec): finished trials are kept, "
                            "unfinished ones go on from their last epoch")

    p = sub.add_parser("run", help="run a search spec in its parallelism mode (experiment, data or compare)")
    spec_args(p)
    search_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="run a search experiment- and data-parallel (and auto, with --modes) per worker "
                                       "count: the speedup table")
    spec_args(p)
    p.add_argument("--workers", type=_counts, help="worker counts, e.g. 1,2,4 (default: the spec's parallelism.workers; 1 is always included)")
    p.add_argument("--repeats", type=_positive_int, help="run every (mode, workers) cell this many times, interleaved, "
                   "for the mean and std of each time and speedup (default: the spec's parallelism.repeats, 1)")
    p.add_argument("--modes", type=_modes, help="the modes each worker count runs in, e.g. experiment,data,auto "
                   "(default: the spec's parallelism.modes, experiment,data)")
    search_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("plan", help="predict memory, step time and bytes of a vit-seg spec's layouts (SP x DP x "
                                     "attention, per patch size) from the performance model; for any other "
                                     "network, each trial's training step, traced, and whether it fits a rank")
    spec_args(p)
    p.add_argument("--ranks", type=_positive_int, default=4, help="devices (workers) per trial (default 4)")
    p.add_argument("--memory-per-rank", type=_bytes, default=16e9, help="e.g. 16GB, 6GiB (default 16GB)")
    p.add_argument("--device-flops", type=_rate, default=300e12, help="FLOP/s per rank (default 300e12)")
    p.add_argument("--bandwidth", type=_rate, default=100e9, help="bytes/s per rank (default 100e9)")
    p.add_argument("--reserved", type=_bytes, default=512 * 2**20,
                   help="memory per rank the process holds itself (default 512MiB)")
    p.add_argument("--kernel", choices=["math", "fused"], default=None,
                   help="attention kernel: math holds the score matrices, fused does not (default: the spec's "
                        "model.params.attention_kernel)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="training precision whose bytes are counted: fp32, or mixed bf16 / fp16 (16-bit "
                        "activations and weight copies, fp32 weights, gradients and Adam state; default: the "
                        "spec's training.precision)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="whose rules a traced step follows (not vit-seg): a GPU's, or a CPU's (its convolutions' "
                        "workspace and the C heap's retention) (default cuda)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch threads a CPU rank runs (not vit-seg; --device cpu; default 1)")
    p.add_argument("--output", help="folder for plan.png (default: runs/<spec name>)")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="predict the whole search on this many workers instead: its makespan experiment-parallel, "
                        "data-parallel at each degree and auto, and auto's schedule (--device-flops: the rate a "
                        "worker reaches on the search's steps)")
    p.add_argument("--per-node", type=_positive_int, default=None,
                   help="--workers: workers per node (default: all on one node)")
    p.add_argument("--inter-node-bandwidth", type=_rate, default=12.5e9,
                   help="--workers: bytes/s a worker sends to another node (default 12.5e9); --bandwidth inside one")
    p.add_argument("--startup-seconds", type=float, default=10.0,
                   help="--workers: a trial's start-up, s (default 10)")
    p.add_argument("--step-overhead", type=float, default=0.0,
                   help="--workers: a training step's fixed cost, s (default 0)")
    p.add_argument("--gantt", help="--workers: draw the experiment, best data-parallel and auto schedules to this PNG")
    p.add_argument("--calibrate", metavar="OUTPUT",
                   help="--workers: take a worker's rate and a trial's start-up from the search in this output "
                        "folder (its measured epochs), in place of --device-flops and --startup-seconds, and "
                        "predict that search itself beside what it measured")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("results", help="print a search's results table (or a comparison's speedup table) from MLflow")
    p.add_argument("output", nargs="?", help="a search's output folder, e.g. runs/quickstart (it knows its store and "
                                             "run); or give --tracking-uri and --experiment")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="MLflow tracking URI, e.g. sqlite:///runs/quickstart/mlflow.db (default: the output folder's "
                        "store, else $MLFLOW_TRACKING_URI)")
    p.add_argument("--experiment", help="MLflow experiment name (the spec's name by default): its newest search")
    p.add_argument("--run-id", help="a specific search (parent) run; default: the output folder's, else the newest")
    p.add_argument("--format", choices=["table", "csv", "json", "markdown"], default="table",
                   help="table (default): aligned columns for a person, after a line naming the run; csv, json (one "
                        "object a row) or markdown: every column, the rows alone")
    p.set_defaults(func=cmd_results)

    p = sub.add_parser("predict", help="segment scans with a search's model: one <case>_seg.nii.gz per case")
    p.add_argument("model", help="models:/NAME/VERSION, models:/NAME@best, runs:/RUN_ID, an MLflow model folder, "
                                 "or a search's output folder (its best model)")
    p.add_argument("input", help="one case (an MSD image file, 3-D for one channel or 4-D; an nnU-Net channel file "
                                 "<case>_0000.nii.gz, which brings its other channels; a BraTS or BraTS 2023 case "
                                 "folder) or a data set folder (MSD or nnU-Net root, an imagesTs-like folder, BraTS "
                                 "root)")
    p.add_argument("--output", required=True, help="folder for the segmentations")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                   help="MLflow tracking store of a models:/ or runs:/ MODEL (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, help="the input's layout (default: detected from its files)")
    p.add_argument("--labels", action="store_true",
                   help="score each case that has a label file: dice and HD95 (mm) per class or region")
    p.add_argument("--overwrite", action="store_true", help="replace segmentations already in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--folds", type=_fold_list, metavar="0,2",
                   help="a fold ensemble only: the folds whose probabilities are averaged (default all of the "
                        "model's folds)")
    mirroring = p.add_mutually_exclusive_group()
    mirroring.add_argument("--mirror", type=_mirror_axes, nargs="?", const=(0, 1, 2), default=None, metavar="AXES",
                           help="test-time mirroring: each sliding window also predicted flipped on every subset of "
                                "these axes (0, 1, 2 of the preprocessed volume; alone: all three, nnU-Net's) and "
                                "the probabilities averaged, 2^k times the work (default the model's own "
                                "training.inference.mirror)")
    mirroring.add_argument("--no-mirror", dest="mirror", action="store_const", const=(),
                           help="no test-time mirroring, whatever the model's default")
    p.set_defaults(func=cmd_predict)

    from distmis.cli.init_command import add_init_command

    add_init_command(sub, size=_bytes, rate=_rate, positive=_positive_int, layouts=LAYOUT_CHOICES)

    from distmis.cli.service import add_service_commands

    add_service_commands(sub, spec_args)

    data = sub.add_parser("data", help="dataset tools: synth, tfrecord, inspect")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")

    p = dsub.add_parser("synth", help="write a synthetic NIfTI dataset (brain tumour MRI or CT-like organs) in the "
                                      "MSD, nnU-Net, BraTS or BraTS 2023 layout")
    p.add_argument("out", help="folder to create")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default="msd",
                   help="on-disk layout (default msd); --kind ct is written as msd or nnunet only")
    p.add_argument("--kind", choices=["brain", "ct"], default="brain",
                   help="brain: four MRI channels, 1 mm, a tumour with three labels (default); ct: one CT channel in "
                        "HU, liver/spleen/kidney classes 1-3, anisotropic spacings that differ between cases")
    p.add_argument("--cases", type=_positive_int, default=10, help="how many cases to write (default 10)")
    p.add_argument("--shape", type=_synthetic_shape, default=(64, 64, 64), help="H,W,D, each >= 8 (default 64,64,64)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the cases: the same seed writes the same data (default 0)")
    p.add_argument("--lps-cases", type=_non_negative_int, default=0, metavar="K",
                   help="write the last K cases in LPS orientation instead of RAS, same world anatomy (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_data_synth)

    p = dsub.add_parser("tfrecord", help="convert a NIfTI dataset to sharded TFRecords with a manifest")
    p.add_argument("dataset", help="dataset folder")
    p.add_argument("out", help="TFRecord folder to create")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, help="the data set's layout (default: detected from its files)")
    p.add_argument("--labels", choices=["whole-tumour", "regions", "classes"], default="whole-tumour",
                   help="classes: the data set's labels one-hot with background; regions: BraTS WT/TC/ET or "
                        "nnU-Net's region-based labels")
    p.add_argument("--normalization", choices=["zscore", "ct"],
                   help="every channel's scheme (default: by channel name, CT -> ct, else zscore)")
    p.add_argument("--orientation", choices=["RAS"], help="reorient every case first")
    p.add_argument("--spacing", type=_spacing, help="resample to X,Y,Z mm, or 'auto' (the median of the non-test "
                                                    "cases)")
    p.add_argument("--crop", type=_shape, help="centre crop H,W,D (zero-padded where smaller)")
    p.add_argument("--resize", type=_shape, help="resize to H,W,D after cropping")
    p.add_argument("--split", type=float, nargs=3, default=(0.7, 0.15, 0.15), metavar=("TRAIN", "VAL", "TEST"),
                   help="the fractions of the cases in the train, validation and test splits, summing to 1 "
                        "(default 0.7 0.15 0.15)")
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--shards", type=_positive_int, help="shards per split (default: about 8 cases a shard)")
    p.add_argument("--workers", type=_positive_int,
                   help="conversion processes (default: min(CPUs, 4); 1, in-process, for data under 16 MiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_data_tfrecord)

    p = dsub.add_parser("inspect", help="channels, classes with voxel counts, shapes, spacings, orientations and "
                                        "intensity ranges of a dataset, then one row per case")
    p.add_argument("dataset", help="dataset folder (MSD or nnU-Net v2 root with dataset.json, or a BraTS folder)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, help="the data set's layout (default: detected from its files)")
    p.add_argument("--json", action="store_true",
                   help="print the data set's fingerprint as JSON instead: per case its shape, spacing, orientation, "
                        "shape cropped to its non-zero region, label voxels and objects; per channel the foreground "
                        "intensities; the median spacing and shape, the anisotropy, each class's share and objects")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_data_inspect)
    add_help_text(parser)  # every command's examples, the exit codes, the descriptions
    return parser


def run() -> NoReturn:
    """The ``distmis`` console script (and ``python -m distmis``): :func:`main`, then exit with its code.

    An interrupted command (130, 143) ends at once, its own clean-up done: Python would otherwise report the
    interrupt as its own death by SIGINT (exit status -2) whenever a library's C code had seen the
    KeyboardInterrupt pass through it before distmis caught it (as imports run through such code).

    Every object left is frozen first (``gc.freeze``): the interpreter's last collections then skip them. With
    TensorFlow, Ray and MLflow loaded (some 700,000 objects) those took 6 to 14 s of a 2-core machine after the
    command had printed its last line; exit handlers still run."""
    code = main()
    gc.freeze()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``distmis`` command; its exit code (see the module's docstring). Ctrl-C at any moment is exit 130 with
    one line, not a traceback, even while the libraries a command needs are still being imported, and even when it
    lands in a finalizer (:func:`~distmis.cli.signals.interrupts_kept`)."""
    try:
        with interrupts_kept():
            return _main(argv)
    except KeyboardInterrupt as exc:  # before the command's own handling (imports), or a second Ctrl-C in it
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return int(getattr(exc, "exit_code", 130))


def _main(argv: Sequence[str] | None) -> int:
    for var, value in tensorflow_env().items():  # before anything imports TensorFlow
        os.environ.setdefault(var, value)
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as given (distmis init writes it)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # before the libraries are imported: they read its settings then. TensorFlow's native notices are filtered for
    # the commands that import it, which start no process that outlives them (a server's would lose its stderr).
    with console(verbose=args.verbose, native=args.command in NATIVE_FILTERED):
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    from distmis.train.startup import loading_libraries

    with loading_libraries():  # Ray's and MLflow's modules among them: no collection while they load, frozen after
        from distmis.data.errors import DataError
        from distmis.service.cluster import ClusterError
        from distmis.service.jobs import SubmitError
        from distmis.spec import SpecError
        from distmis.service.server import ServerError

        from distmis.search.state import NothingToResume, SearchStateError
        from distmis.tracking.store import StoreUnreachable

    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except NothingToResume as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_OK
    except (SpecError, DataError, BadInput, SubmitError, SearchStateError, StoreUnreachable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ClusterError, ServerError) as exc:  # a server did not start, or no cluster to stop
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ModuleNotFoundError as exc:
        if exc.name not in ("tensorflow", "keras"):
            raise
        print(f"error: {exc.name} is not installed; distmis needs TensorFlow to convert data sets to TFRecords and to "
              "train the Keras U-Net: pip install 'distmis[cpu]' (CPU builds), 'distmis[gpu-torch]' or 'distmis[gpu-tf]' (CUDA builds; docs/install.md)",
              file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a search (SearchInterrupted): runs are KILLED
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return int(getattr(exc, "exit_code", 130))


if __name__ == "__main__":
    run()
