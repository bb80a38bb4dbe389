"""What a search gives back: :class:`SearchOutcome` for one search (``experiment`` and ``data`` modes),
:class:`ComparisonOutcome` for a comparison (``compare``: one search per mode and worker count)."""

from __future__ import annotations

from dataclasses import dataclass
import pandas as pd

from distmis.predict.registry import PublishedModel
from distmis.search.evaluate import TestEvaluation
from distmis.search.prepare import PreparedData

__all__ = ["SearchOutcome", "ComparisonOutcome", "Outcome"]


@dataclass(frozen=True)
class SearchOutcome:
    results: pd.DataFrame
    failed: int
    elapsed_seconds: float  # the whole search run, MLflow bookkeeping included
    search_seconds: float  # Tuner.fit alone: what the speedup table compares
    tracking_uri: str
    experiment: str
    parent_run_id: str
    data: PreparedData
    test: TestEvaluation | None = None  # the best trial on the test split
    test_note: str = ""  # why there is no test evaluation (or no model), if there is none
    model: PublishedModel | None = None  # where the best trial's model went
    problems: tuple[str, ...] = ()  # what the search's end could not do: load, score or publish a model (exit 1)
    failed_trials: tuple[str, ...] = ()  # the ids of the trials that did not finish
    search_error: str = ""  # why Ray Tune itself stopped the search, if it did: ``--resume`` continues it

    @property
    def best(self) -> dict[str, object] | None:
        ok = self.results[self.results["status"] == "FINISHED"] if not self.results.empty else self.results
        return None if ok.empty else ok.iloc[0].to_dict()


@dataclass(frozen=True)
class ComparisonOutcome:
    table: pd.DataFrame
    failed_cells: list[str]
    tracking_uri: str
    experiment: str
    parent_run_id: str

    @property
    def failed(self) -> int:
        return len(self.failed_cells)


#: What :func:`~distmis.search.run.run_search` returns, by the spec's ``parallelism.mode``.
Outcome = SearchOutcome | ComparisonOutcome
