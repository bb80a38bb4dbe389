"""Cross-validation in a Ray Tune search: one Tune trial per (configuration, fold), grouped by configuration.

With ``dataset.split.folds: k`` a search trains each configuration (a point of its search space) once per chosen
fold (``search.folds``). Each (configuration, fold) is a trial of its own, whose config carries the searched values,
the fold it validates on (:data:`FOLD_KEY`, the spec path ``dataset.split.fold``: the trainers read their parts of
the data from it) and its configuration's id (:data:`CONFIGURATION_KEY`, not a spec path: only the driver reads it).

Why a trial per fold rather than the folds inside one trial: everything a trial already is keeps working
unchanged for a fold - experiment-, data- and hybrid-parallel trials, sequence- and pipeline-parallel ones, their
checkpoints, restarts (``parallelism.max_failures`` counts per fold) and ``--resume`` (a fold that had finished is not
trained again) - and the folds of one configuration run side by side when there are workers for them, as nnU-Net's
five folds are five jobs.

What the searchers and schedulers see:

- :class:`FoldSearcher` hands out a configuration's folds one after another and tells its inner searcher (Optuna,
  or :class:`Configurations` for grid and random search) the configuration's result once its last fold has ended:
  the mean over the folds of each fold's best value of ``search.metric``. Optuna thus learns from the folds' mean,
  the value the search ranks configurations by.
- :class:`FoldScheduler` gives ASHA one bracket per fold: a fold's trial is stopped or promoted against the same
  fold of the other configurations. The folds' mean is known only when a configuration's last fold ends, too late
  for a rung; and comparing fold 0 of one configuration with fold 2 of another would stop configurations for
  having drawn the harder validation cases.
- :class:`FoldSearchGenerator` is what Tune is given (with ``num_samples=-1``): the fold searcher alone says when the
  search is done, and a restored search hands out again a fold whose trial Tune's older saved state lost.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, Callable, Mapping, Sequence

from ray.tune.schedulers import FIFOScheduler, TrialScheduler
from ray.tune.search import ConcurrencyLimiter, SearchGenerator, Searcher

from distmis.search.tune_state import restored_trials
from distmis.spec.load import CONFIGURATION_KEY, FOLD_KEY, searched_config

__all__ = ["CONFIGURATION_KEY", "FOLD_KEY", "Configurations", "FoldScheduler", "FoldSearchGenerator", "FoldSearcher",
           "configuration_id", "fold_of", "searched_config"]


def configuration_id(index: int) -> str:
    """The id of the search's ``index``-th configuration: ``c000``, ``c001``, ..."""
    return f"c{index:03d}"


def fold_of(config: Mapping[str, Any]) -> int | None:
    """The fold a trial validates on (None: a search without folds)."""
    value = config.get(FOLD_KEY)
    return None if value is None else int(value)


class _SavedWhole(Searcher):
    """A searcher whose whole state (an inner searcher's included) is what Tune saves and restores with its own."""

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as handle:
            pickle.dump(self.__dict__.copy(), handle)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as handle:
            self.__dict__.update(self.upgrade(pickle.load(handle)))

    def upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as this class saves it now: a subclass fills in the fields an older version did not save."""
        return state


class Configurations(_SavedWhole):
    """The configurations of a grid or random search, one per :meth:`suggest`, in the order Tune's own variant
    generator makes them (``num_samples`` passes over the grid, random values drawn from a generator seeded with
    ``seed``), or with ``shuffle`` in a random order drawn from ``seed``, then ``FINISHED``. What
    :class:`FoldSearcher` wraps when there is no Optuna, and what hands out a search's trials under a scheduler
    that stops them (:func:`~distmis.search.search_space.shuffles_configurations`)."""

    def __init__(self, space: Mapping[str, Any], num_samples: int, seed: int, shuffle: bool = False) -> None:
        from ray.tune.search.variant_generator import generate_variants

        import numpy as np

        super().__init__()
        self.configs: list[dict[str, Any]] = []
        rng = np.random.default_rng(seed)
        for _ in range(num_samples):
            for _, resolved in generate_variants(dict(space), random_state=rng):
                self.configs.append({key: resolved[key] for key in space})
        if shuffle:  # a generator of its own: the values drawn above are the unshuffled search's
            order = np.random.default_rng([seed, 1]).permutation(len(self.configs))
            self.configs = [self.configs[index] for index in order]
        self.handed = 0

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self.handed >= len(self.configs):
            return Searcher.FINISHED
        self.handed += 1
        return dict(self.configs[self.handed - 1])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        pass  # the configurations are fixed in advance


class FoldSearcher(_SavedWhole):
    """Each configuration of ``inner`` as one trial per fold of ``folds``; ``inner`` hears of a configuration once,
    when its last fold has ended: the mean over its folds of each fold's best ``metric`` (an error when a fold
    failed). Its state, the inner searcher's included, is saved with Tune's, so a resumed search goes on handing out
    the folds it had not yet."""

    def __init__(self, inner: Searcher, folds: Sequence[int], metric: str, mode: str,
                 limit: int | None = None) -> None:
        """``limit``: how many configurations the search tries (after a restore the inner searcher may not know
        every configuration that began: :meth:`reconcile`)."""
        super().__init__(metric=metric, mode=mode)
        if not folds:
            raise ValueError("a fold searcher needs at least one fold")
        self.inner = inner
        self.limit = limit
        self.folds = tuple(int(f) for f in folds)
        self.configurations = 0  # how many the inner searcher has given
        self.pending: list[dict[str, Any]] = []  # the current configuration's fold trials not handed out yet
        self.trials: dict[str, tuple[str, int]] = {}  # trial id -> (configuration, fold)
        self.given: dict[str, dict[str, Any]] = {}  # trial id -> the config it was given
        self.from_inner: set[str] = set()  # the configurations the inner searcher gave (and so hears of)
        self.best: dict[str, float] = {}  # trial id -> its best metric so far
        self.ended: dict[str, dict[int, float | None]] = {}  # configuration -> fold -> its best (None: failed)
        self.exhausted = False

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        self._metric = self._metric or metric
        self._mode = self._mode or mode
        if config:
            self.inner.set_search_properties(metric, mode, config, **spec)
        return True

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if not self.pending:
            if self.limit is not None and self.configurations >= self.limit:
                self.exhausted = True
            if self.exhausted:
                return Searcher.FINISHED
            configuration = configuration_id(self.configurations)
            suggestion = self.inner.suggest(configuration)
            if suggestion is None:
                return None  # the inner searcher waits (a concurrency limit)
            if suggestion == Searcher.FINISHED:
                self.exhausted = True
                return Searcher.FINISHED
            self.configurations += 1
            self.ended[configuration] = {}
            self.from_inner.add(configuration)
            self.pending = [{**suggestion, FOLD_KEY: fold, CONFIGURATION_KEY: configuration} for fold in self.folds]
        config = self.pending.pop(0)
        self.trials[trial_id] = (config[CONFIGURATION_KEY], config[FOLD_KEY])
        self.given[trial_id] = dict(config)
        return config

    def upgrade(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state saved before ``limit``, ``given`` and ``from_inner`` were: this searcher's limit, no configs
        known to hand out again, and every configuration it had begun given by the inner searcher."""
        state.setdefault("limit", self.__dict__.get("limit"))
        state.setdefault("given", {})
        state.setdefault("from_inner", set(state.get("ended", {})))
        return state

    def restore_from_dir(self, checkpoint_dir: str) -> None:
        """Restore the saved state, then agree with the trials Tune restored (:meth:`reconcile`)."""
        super().restore_from_dir(checkpoint_dir)
        restored = restored_trials(checkpoint_dir)
        if restored is not None:
            self.reconcile(restored)

    def reconcile(self, restored: Mapping[str, Mapping[str, Any]]) -> None:
        """Agree with ``restored`` (trial id -> config: the trials of the experiment state Tune resumed from).

        Tune saves its experiment state and this searcher's in separate files; a driver killed between the two
        leaves one older than the other. A trial Tune has that this state never handed out is adopted (its fold is
        not handed out again: that would train it twice); a trial this state handed out that Tune lost has its
        config handed out again. A configuration known only from Tune's trials is not reported to the inner
        searcher, which never gave it."""
        for trial_id in [t for t in self.trials if t not in restored]:  # handed out, lost by Tune
            self.trials.pop(trial_id)
            self.best.pop(trial_id, None)
            config = self.given.pop(trial_id, None)
            if config is not None:
                self.pending.insert(0, config)
        for trial_id, config in restored.items():
            if trial_id in self.trials or CONFIGURATION_KEY not in config or FOLD_KEY not in config:
                continue
            configuration, fold = str(config[CONFIGURATION_KEY]), int(config[FOLD_KEY])
            self.trials[trial_id] = (configuration, fold)
            self.given[trial_id] = dict(config)
            if configuration not in self.ended:  # begun after this state was saved: its other folds are pending
                self.ended[configuration] = {}
                self.configurations = max(self.configurations, int(configuration.lstrip("c")) + 1)
                self.pending = [{**config, FOLD_KEY: f} for f in self.folds] + self.pending
            self.pending = [c for c in self.pending
                            if (str(c[CONFIGURATION_KEY]), int(c[FOLD_KEY])) != (configuration, fold)]

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        value = result.get(self.metric)
        if value is None or not math.isfinite(float(value)):
            return
        best = self.best.get(trial_id)
        if best is None or (value > best if self.mode == "max" else value < best):
            self.best[trial_id] = float(value)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id not in self.trials:
            return
        if result and not error:
            self.on_trial_result(trial_id, result)
        configuration, fold = self.trials[trial_id]
        ended = self.ended.setdefault(configuration, {})
        ended[fold] = None if error else self.best.get(trial_id)
        if len(ended) < len(self.folds):
            return
        if configuration not in self.from_inner:
            return  # adopted after a restore: the inner searcher never gave it (reconcile)
        values = [value for value in ended.values() if value is not None]
        if len(values) < len(self.folds):  # a fold failed: the configuration has no cross-validated value
            self.inner.on_trial_complete(configuration, None, error=True)
        else:
            self.inner.on_trial_complete(configuration, {self.metric: sum(values) / len(values)})


class FoldSearchGenerator(SearchGenerator):
    """Tune's :class:`SearchGenerator` around a :class:`FoldSearcher` (through a ``ConcurrencyLimiter`` when at most
    ``max_concurrent`` trials run at once), for a ``Tuner`` with ``num_samples=-1``: the search ends when the fold
    searcher says it is done (``Searcher.FINISHED``), not at a count of trials.

    Tune's experiment state and the searchers' are separate files, so a killed driver may leave the searchers' a
    moment newer, with a trial Tune's state lost (:meth:`FoldSearcher.reconcile` hands its fold out again). Tune's own
    generator state, saved with the searchers', then already counts that trial (with ``num_samples`` the number of
    trials, Tune would make no more) and may already say "finished"; its concurrency limiter may still count the lost
    trial as running, and wait for its end for ever. Restored, this generator is finished only when the fold
    searcher has nothing to hand out again, and its limiter forgets the trials the fold searcher no longer has."""

    def __init__(self, searcher: FoldSearcher, max_concurrent: int | None = None) -> None:
        super().__init__(ConcurrencyLimiter(searcher, max_concurrent=max_concurrent) if max_concurrent else searcher)
        self.folds = searcher

    def set_state(self, state: dict) -> None:
        """The state Tune saved; called last as Tune restores the search, after the fold searcher has reconciled."""
        super().set_state(state)
        if self.folds.pending:  # a fold whose trial Tune lost is handed out again
            self._finished = False
        if isinstance(self.searcher, ConcurrencyLimiter):  # a lost trial never ends: it holds no place
            self.searcher.live_trials &= set(self.folds.trials)


class FoldScheduler(FIFOScheduler):
    """One scheduler per fold (``make()`` each: ASHA), each seeing only its fold's trials: a trial is stopped or
    promoted against the same fold of the other configurations (see the module docstring)."""

    def __init__(self, folds: Sequence[int], make: Callable[[], TrialScheduler]) -> None:
        super().__init__()
        self.by_fold: dict[int, TrialScheduler] = {int(fold): make() for fold in folds}

    def _of(self, trial: Any) -> TrialScheduler:
        fold = fold_of(trial.config)
        if fold not in self.by_fold:
            raise ValueError(f"trial {trial.trial_id} has fold {fold!r}; this search trains folds {list(self.by_fold)}")
        return self.by_fold[fold]

    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return all(scheduler.set_search_properties(metric, mode, **spec) for scheduler in self.by_fold.values())

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_add(tune_controller, trial)

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        return self._of(trial).on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        self._of(trial).on_trial_complete(tune_controller, trial, result)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._of(trial).on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        return "\n".join(f"fold {fold}: {scheduler.debug_string()}" for fold, scheduler in self.by_fold.items())
