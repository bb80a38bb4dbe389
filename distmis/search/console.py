"""What a search prints while it runs, for a person to read (Ray Tune's own reporter is off unless ``--verbose``).

A header when the trials start; then, per trial, one line each epoch and one when it ends, fails or is retried,
the trial named by its searched values; after each trial that ends, where the search stands (trials finished,
running and left, the best so far and the time left: :mod:`distmis.search.progress`)::

    search quickstart: 4 trials, experiment-parallel: 2 trials at a time, 1 CPU each
      store sqlite:///.../runs/quickstart/mlflow.db, experiment 'quickstart'
      lr=0.001 norm=batch    epoch  1/10  train_loss 0.8123  val_dice 0.1234  elapsed 0:12
      ...
      lr=0.001 norm=batch    finished: best val_dice 0.9012 at epoch 9, 2:03
      progress: 1/4 trials finished, 2 running, 1 to start; best val_dice 0.9012 (lr=0.001 norm=batch, epoch 9);
        about 2:10 left (21 trial-epochs of 11.8 s, 2 at once)

(the progress line is one line).

The results table that follows is the command's (:func:`distmis.cli.main.print_search`). Lines go to stdout, plain
text (no colours, nothing redrawn), so a log file reads as the console did.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ray import tune

from distmis.search.progress import ProgressFigures, SearchProgress, trial_label
from distmis.spec.schema import Spec
from distmis.tracking.mlflow_tracking import error_summary, trial_error_text

__all__ = ["SearchConsole", "clock", "progress_line", "trial_label"]


def clock(seconds: float) -> str:
    """``75.2`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_line(figures: ProgressFigures, metric: str) -> str:
    """Where the search stands, as one line (see the module's docstring)."""
    ended = f"{figures.ended}/{figures.total} trials finished"
    notes = ([f"{figures.failed} failed"] if figures.failed else []) + \
        ([f"{figures.stopped_early} stopped early"] if figures.stopped_early else [])
    if notes:
        ended += f" ({', '.join(notes)})"
    parts = [f"{ended}, {figures.running} running, {figures.left} to start"]
    if figures.best is not None:
        value, label, epoch = figures.best
        parts.append(f"best {metric} {value:.4f} ({label}, epoch {epoch})")
    else:
        parts.append(f"best {metric}: none yet")
    if figures.running or figures.left:
        if figures.seconds_left is None or figures.seconds_per_epoch is None:
            parts.append("time left unknown (no epoch timed yet)")
        else:
            each, count = figures.seconds_per_epoch, f"{figures.epochs_left:.0f}"
            epochs = f"{count} trial-epoch{'' if count == '1' else 's'}"
            parts.append(f"about {clock(figures.seconds_left)} left ({epochs} of "
                         f"{f'{each:.1f} s' if each < 60 else clock(each)}, {figures.at_once} at once)")
    return "progress: " + "; ".join(parts)


class SearchConsole(tune.Callback):
    """Prints a search's progress (see the module's docstring). It holds no stream or client (Tune may pickle its
    callbacks), only what it printed: the last epoch shown per trial, so a restarted trial's replayed epochs and a
    resumed search's finished ones are not printed twice. ``progress``: the search's
    :class:`~distmis.search.progress.SearchProgress`, which Tune's calls reach first: a trial's best epoch (over
    every epoch it trained, before a restart or a resume too) and the search's figures are read from it."""

    def __init__(self, spec: Spec, progress: SearchProgress) -> None:
        self.metric, self.mode = spec.search.selected_metric, spec.search.mode
        self.epochs = spec.training.epochs
        self.progress = progress
        self.shown: dict[str, int] = {}  # trial id -> last epoch printed
        self.attempts: dict[str, set[str]] = {}
        self.paused: set[str] = set()  # trials a scheduler paused (stage-halving, pbt): their next process resumes
        self.seen: dict[str, set[str]] = {}  # label -> the trials printed under it
        self.width = 0
        self.budget_line: Callable[[], str] | None = None  # search.budget: what is spent, after each progress line

    # ------------------------------------------------------------------ lines
    @staticmethod
    def print(line: str) -> None:
        print(line, file=sys.stdout, flush=True)

    def header(self, spec: Spec, *, trials: int, layout: str, store: str, experiment: str) -> None:
        self.print(f"search {spec.name}: {trials} trial(s), {layout}")
        self.print(f"  store {store}, experiment {experiment!r}")

    def _line(self, trial: Any, text: str) -> None:
        label = trial_label(trial.trial_id, getattr(trial, "config", {}) or {})
        self.seen.setdefault(label, set()).add(trial.trial_id)
        if len(self.seen[label]) > 1:  # the same values drawn twice (random search): the trial's number says which
            label = f"{trial.trial_id.rsplit('_', 1)[-1]} {label}"
        self.width = max(self.width, len(label))
        self.print(f"  {label:<{self.width}}  {text}")

    def _total_epochs(self, trial: Any) -> int:
        return int((getattr(trial, "config", {}) or {}).get("training.epochs", self.epochs))

    # ------------------------------------------------------------------ Tune's calls
    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.width = max([self.width, *(len(trial_label(t.trial_id, t.config or {})) for t in trials)])

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        attempt = result.get("attempt")
        if attempt:  # a data-parallel trial's workers restarted by Ray Train: a new attempt id
            seen = self.attempts.setdefault(trial.trial_id, set())
            if seen and str(attempt) not in seen:
                if trial.trial_id in self.paused:  # a new process after a pause: resumed, not retried
                    self.paused.discard(trial.trial_id)
                    self._line(trial, f"resumed after epoch {self.shown.get(trial.trial_id, 0)}, from its checkpoint")
                else:
                    self._line(trial, f"retried (attempt {len(seen) + 1}), from its last checkpoint")
            seen.add(str(attempt))
        epoch = int(result.get("epoch", result.get("training_iteration", 0)))
        if epoch <= self.shown.get(trial.trial_id, 0):
            return
        self.shown[trial.trial_id] = epoch
        keys = ["train_loss", "val_dice"] + ([self.metric] if self.metric not in ("train_loss", "val_dice") else [])
        figures = "  ".join(f"{key} {float(result[key]):.4f}" for key in keys
                            if isinstance(result.get(key), (int, float)))
        total = self._total_epochs(trial)
        workers = f"  on {int(result['workers'])} worker(s)" if result.get("workers") else ""  # mode auto
        self._line(trial, f"epoch {epoch:>{len(str(total))}}/{total}  {figures}  "
                          f"elapsed {clock(float(result.get('time_total_s', 0.0)))}{workers}")

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        """A trial its scheduler paused (Tune's ``PAUSED``: a stage-halving rung waiting for the other trials,
        population-based training's exploit) says so once; its next process resumes it."""
        for trial in trials:
            if trial.status == "PAUSED" and trial.trial_id not in self.paused:
                self.paused.add(trial.trial_id)
                self._line(trial, f"paused after epoch {self.shown.get(trial.trial_id, 0)}")

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._line(trial, f"failed, retried from its last checkpoint: {error_summary(trial_error_text(trial))}")

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        elapsed = clock(float((trial.last_result or {}).get("time_total_s", 0.0)))
        best = self.progress.best_of(trial.trial_id)
        text = f"best {self.metric} {best[0]:.4f} at epoch {best[1]}, " if best else ""
        done, epochs = self.progress.last_epoch(trial.trial_id), self._total_epochs(trial)
        ended = f"stopped early after epoch {done}/{epochs}" if 0 < done < epochs else "finished"
        self._line(trial, f"{ended}: {text}{elapsed}")
        self._progress()

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        done = max(self.shown.get(trial.trial_id, 0), self.progress.last_epoch(trial.trial_id))
        self._line(trial, f"FAILED after {done} epoch(s): {error_summary(trial_error_text(trial))}")
        self._progress()

    def _progress(self) -> None:
        self.print(f"  {progress_line(self.progress.figures(), self.metric)}")
        if self.budget_line is not None:
            self.print(f"  {self.budget_line()}")

