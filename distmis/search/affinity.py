"""A grid or random search whose next trial goes to the process that holds its graphs.

An experiment-mode TensorFlow trial restarts a trainer its Tune actor kept from an earlier trial when their graphs
are the same (:mod:`distmis.trial.kept_trainers`), and traces new ones otherwise: 3 to 5 s of a U-Net trial on one
CPU. Tune hands a reused actor the next trial it makes, whatever that trial's graphs: on a grid over two
normalizations, two actors that end their first trials within a second of each other take the next two in either
order, and when it is the wrong one both trace again.

:class:`GraphAffineConfigurations` makes the next trial for the actor that waits for it. Tune asks its searcher for a
trial when one ends and its actor is free (``max_concurrent_trials``), and gives the trial it makes to the actor
that was freed first; so the searcher hands out, of the configurations not yet given, the first whose graphs are
those of the earliest ended trial not yet followed. Configurations and their number are those of Tune's own variant
generator (:class:`~distmis.search.folds.Configurations`); only their order changes, and only where two graphs
alternate.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ray.tune.search import Searcher

from distmis.search.folds import Configurations

__all__ = ["GraphAffineConfigurations"]


class GraphAffineConfigurations(Configurations):
    """The configurations of a grid or random search (:class:`~distmis.search.folds.Configurations`), each next one
    the first not yet given whose ``graph`` is that of the earliest ended trial no trial has followed yet (the
    first not yet given when none has that graph, or when no trial has ended).

    ``graph``: a configuration's graph key (:func:`~distmis.search.search_space.configuration_graph`).
    A trial that failed is not followed: its actor is not reused, and its trainer was dropped.
    """

    def __init__(self, space: Mapping[str, Any], num_samples: int, seed: int,
                 graph: Callable[[dict[str, Any]], str], shuffle: bool = False) -> None:
        super().__init__(space, num_samples, seed, shuffle)
        self.graphs = [graph(dict(config)) for config in self.configs]
        self.waiting: list[int] = list(range(len(self.configs)))  # configurations not given yet, in Tune's order
        self.given: dict[str, int] = {}  # trial id -> its configuration's index
        self.freed: list[str] = []  # the graphs of ended trials not yet followed, the earliest first

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if not self.waiting:
            return Searcher.FINISHED
        index = self.waiting[0]
        if self.freed:
            graph = self.freed.pop(0)
            index = next((i for i in self.waiting if self.graphs[i] == graph), index)
        self.waiting.remove(index)
        self.given[trial_id] = index
        self.handed += 1
        return dict(self.configs[index])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        index = self.given.get(trial_id)
        if index is not None and not error:
            self.freed.append(self.graphs[index])
