"""16 trials at once on a 2-CPU Ray, every epoch reported through the driver-side MLflow callback: nothing lost.

The trials train nothing (a report-only trainable, no TensorFlow): each reports three epochs of metrics that are
a known function of its learning rate and epoch. They wait for one another before reporting, so all 16 really
run at once and their reports reach the callback interleaved. The sqlite store is then read directly and must
hold exactly 16 FINISHED trial runs with one point per epoch metric per epoch, each the value that was reported.

Light on purpose: every trial's Ray worker imports this module (the trainable is pickled by reference), so the
module imports nothing heavy at the top.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TRIALS = 16  # 64 until issue 46, 32 until issue 47: the same interleaving at fewer process start-ups (each about 2 s
# of CPU)
EPOCHS = 3
CPU_PER_TRIAL = 0.12  # 16 x 0.12 = 1.92 of the test cluster's 2 CPUs
LRS = [(i + 1) / 1024 for i in range(TRIALS)]  # exact binary fractions: the recorded values compare with ==
EPOCH_METRICS = ("train_loss", "val_loss", "val_dice", "epoch_seconds")
BARRIER_S = 420.0  # how long a trial waits for the others to start before it reports anyway (and the test fails)


def expected_metrics(lr: float, epoch: int) -> dict[str, float]:
    """What the trial with this learning rate reports for this epoch (exact in binary floating point)."""
    return {"train_loss": lr * epoch, "val_loss": 0.5 + lr * epoch, "val_dice": epoch / 8 + lr,
            "epoch_seconds": epoch / 4}


def marks_dir(spec) -> Path:
    return Path(spec.dataset.path).parent / "trial_marks"


def report_only_trial(config: dict, *, spec, tfrecord_dir: str) -> None:
    """A trial that trains nothing: it marks its start, waits until every trial of the search has started (so
    all of them run at once), then reports EPOCHS epochs and marks its end."""
    from ray import tune

    marks = marks_dir(spec)
    trial_id = tune.get_context().get_trial_id()
    lr = float(config["training.optimizer.lr"])
    (marks / f"{trial_id}.start").write_text(json.dumps({"lr": lr, "time": time.time()}))
    deadline = time.monotonic() + BARRIER_S
    while len(list(marks.glob("*.start"))) < TRIALS and time.monotonic() < deadline:
        time.sleep(0.5)
    started = len(list(marks.glob("*.start")))
    for epoch in range(1, EPOCHS + 1):
        tune.report({"epoch": epoch, **expected_metrics(lr, epoch)})
        time.sleep(0.2)
    (marks / f"{trial_id}.end").write_text(json.dumps({"started_when_reporting": started, "time": time.time()}))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda e: (e[0], -e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_16_concurrent_trials_record_every_epoch_metric(ray_local, tmp_path: Path):
    from distmis.search.run import run_search
    from distmis.spec import validate_spec
    from tests.conftest import small_spec_tree

    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = EPOCHS
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": LRS}}
    tree["parallelism"] = {"resources_per_trial": {"cpu": CPU_PER_TRIAL}}
    spec = validate_spec(tree)
    marks = marks_dir(spec)
    marks.mkdir(parents=True)

    started = time.monotonic()
    outcome = run_search(spec, tmp_path / "out", progress=False, trainable=report_only_trial)
    print(f"\n{TRIALS} trials: search {outcome.search_seconds:.0f} s, run_search {time.monotonic() - started:.0f} s")
    assert outcome.failed == 0, list(outcome.results.get("error", []))  # whole, not pandas' cut

    # They really ran at once: every trial saw all 16 started before it reported, and the intervals overlap.
    ends = {p.stem: json.loads(p.read_text()) for p in marks.glob("*.end")}
    starts = {p.stem: json.loads(p.read_text()) for p in marks.glob("*.start")}
    assert len(starts) == len(ends) == TRIALS
    assert {e["started_when_reporting"] for e in ends.values()} == {TRIALS}
    assert max_overlap([(starts[t]["time"], ends[t]["time"]) for t in starts]) == TRIALS

    # The store, read directly: 16 trial runs of this search, all FINISHED, every epoch metric once per epoch.
    with sqlite3.connect(tmp_path / "out" / "mlflow.db") as db:
        runs = dict(db.execute(
            "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE t.key = 'mlflow.parentRunId' AND t.value = ?", (outcome.parent_run_id,)).fetchall())
        lr_of = {run: float(value) for run, value in db.execute(
            f"SELECT run_uuid, value FROM params WHERE key = 'training.optimizer.lr' "
            f"AND run_uuid IN ({','.join('?' * len(runs))})", list(runs)).fetchall()}
        points = db.execute(
            f"SELECT run_uuid, key, step, value FROM metrics WHERE key IN ({','.join('?' * len(EPOCH_METRICS))}) "
            f"AND run_uuid IN ({','.join('?' * len(runs))})", [*EPOCH_METRICS, *runs]).fetchall()

    assert len(runs) == TRIALS
    assert set(runs.values()) == {"FINISHED"}
    assert sorted(lr_of.values()) == LRS  # one run per grid point
    assert len(points) == TRIALS * len(EPOCH_METRICS) * EPOCHS
    recorded: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for run, key, step, value in points:
        recorded.setdefault((run, key), []).append((step, value))
    for run, lr in lr_of.items():
        for key in EPOCH_METRICS:
            assert sorted(recorded[(run, key)]) == [(epoch, expected_metrics(lr, epoch)[key])
                                                    for epoch in range(1, EPOCHS + 1)], (lr, key)
