"""``search.scheduler: pbt``: population-based training (Jaderberg et al., 2017), Ray Tune's scheduler over
distmis's own checkpoints, in the driver.

Every ``search.pbt.interval`` epochs Tune's ``PopulationBasedTraining`` looks at the trial that reported: one in
the bottom quantile of the population is paused and goes on from the newest checkpoint of one in the top quantile
(its weights, optimizer state and training history: *exploit*), with the searched values ``search.pbt.mutations``
perturbed (*explore*), each kept within its domain (:func:`explore_within`). The trial's process reads the new
values when it restarts (:mod:`distmis.trial.trainables`: the optimizer's hyperparameters are the configuration's,
not the checkpoint's, :meth:`~distmis.train.torch_trainer.TorchTrainer.load_state`).

Each exploit is told to the search's listener (:func:`listen`, by the search run's id: Tune pickles the scheduler
into its experiment folder and ``Tuner.restore`` brings it back), which records it on the receiving trial's MLflow
run (:mod:`distmis.tracking.mlflow_tracking`).
"""

from __future__ import annotations

from typing import Any, Callable

from ray.tune.schedulers import PopulationBasedTraining

from distmis.spec.schema import Domain, Spec
from distmis.spec.searchers import pbt_mutations
from distmis.tracking.lineage import Exploit

__all__ = ["DistmisPBT", "listen", "unlisten", "mutations", "explore_within", "pbt_scheduler"]


_LISTENERS: dict[str, Callable[[Exploit], None]] = {}


def listen(key: str, listener: Callable[[Exploit], None]) -> None:
    """Tell ``listener`` of each exploit of the search run ``key``'s scheduler, in this process."""
    _LISTENERS[key] = listener


def unlisten(key: str) -> None:
    _LISTENERS.pop(key, None)


def mutations(spec: Spec) -> dict[str, Domain]:
    """The searched paths explore changes (``search.pbt.mutations``, or every searched one PBT may change), each
    with its domain."""
    return {path: spec.search.space[path] for path in pbt_mutations(spec.search)}


def explore_within(domains: dict[str, Domain]) -> Callable[[dict], dict]:
    """Tune's ``custom_explore_fn``: a perturbed value outside its domain's range (a factor may push it past an
    end) is put back at that end; a list's values are its own."""

    def clamp(config: dict) -> dict:
        for path, domain in domains.items():
            if path in config and domain.kind in ("uniform", "loguniform"):
                low, high = getattr(domain, domain.kind)
                config[path] = min(max(float(config[path]), low), high)
        return config

    return clamp


def _tune_mutation(domain: Domain) -> Any:
    """What Tune's explore resamples from: a list's values (explore moves to a neighbour), or the range."""
    from ray import tune

    if domain.kind in ("grid", "choice"):
        return list(domain.values)
    if domain.kind == "loguniform":
        return tune.loguniform(*domain.loguniform)
    if domain.kind == "uniform":
        return tune.uniform(*domain.uniform)
    raise ValueError(f"population-based training cannot perturb a {domain.kind!r} domain")


class DistmisPBT(PopulationBasedTraining):
    """Tune's PBT over the epochs the trials report, which tells each exploit to the listener of ``key``."""

    def __init__(self, key: str, epochs: int, **settings: Any):
        super().__init__(**settings)
        self.key, self.epochs, self.reported = key, epochs, 0

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        """Tune's, but for a trial's last epoch: it ends there rather than go on from another's checkpoint with
        nothing left to train."""
        self.reported = int(result.get("epoch", 0))  # the epoch an exploit in this call happens after
        if self.reported >= self.epochs:
            return self.CONTINUE
        return super().on_trial_result(tune_controller, trial, result)

    def _exploit(self, tune_controller: Any, trial: Any, trial_to_clone: Any) -> None:
        epoch = self.reported
        donor_epoch = int((self._trial_state[trial_to_clone].last_result or {}).get("epoch", 0))
        super()._exploit(tune_controller, trial, trial_to_clone)
        listener = _LISTENERS.get(self.key)
        if listener is not None:
            values = {path: trial.config[path] for path in self._hyperparam_mutations if path in trial.config}
            listener(Exploit(trial.trial_id, trial_to_clone.trial_id, epoch, donor_epoch, values))


def pbt_scheduler(spec: Spec, key: str) -> DistmisPBT:
    """The scheduler ``search.pbt`` describes, for the search run ``key``."""
    pbt, domains = spec.search.pbt, mutations(spec)
    return DistmisPBT(
        key, spec.training.epochs,
        time_attr="epoch",  # what a trial reports; a restarted trial's Tune iteration count may differ
        perturbation_interval=pbt.interval,
        hyperparam_mutations={path: _tune_mutation(domain) for path, domain in domains.items()},
        quantile_fraction=pbt.quantile,
        resample_probability=pbt.resample_probability,
        perturbation_factors=tuple(pbt.factors),
        custom_explore_fn=explore_within(domains),
        log_config=False,  # distmis records each exploit on the trial's run
    )
