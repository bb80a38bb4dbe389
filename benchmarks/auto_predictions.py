"""The makespan model's prediction of every cell of finished comparisons (``distmis compare --modes
experiment,data,auto``), with this checkout's model, calibrated as ``distmis compare`` calibrates: on the first
finished 1-worker experiment-parallel cell. Beside each, the cell's mean measured time.

    .venv/bin/python benchmarks/auto_predictions.py runs/auto_tail runs/auto_grid runs/auto_asha
"""
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from distmis.search.compare import cell_spec
from distmis.search.data_shape import trial_device
from distmis.search.makespan_plan import calibrate_run, predicted_makespan
from distmis.search.state import SearchState
from distmis.spec import validate_spec


def finished(state: SearchState, mode: str, workers: int) -> list[dict]:
    return [c for c in state.cells if (c["mode"], int(c["workers"])) == (mode, workers) and c["status"] == "FINISHED"]


for name in sys.argv[1:]:
    folder = Path(name)
    state = SearchState.load(folder)
    spec = validate_spec(state.spec)
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    base = finished(state, "experiment", 1)[0]
    earlier = cell_spec(spec, "experiment", 1)
    device, threads = trial_device(earlier)
    cal = calibrate_run(client, base["run_id"], earlier, "experiment x1", device=device, threads=threads)
    print(name, f"rate {cal.device_flops:.3g} FLOP/s, startup {cal.startup_seconds:.2f} s, "
                f"cold {cal.cold_start_seconds:.2f} s")
    for mode in ("experiment", "data", "auto"):
        for n in sorted({int(c["workers"]) for c in state.cells}):
            times = [c["elapsed_s"] for c in finished(state, mode, n)]
            if not times:
                continue
            mean = sum(times) / len(times)
            p = predicted_makespan(cell_spec(spec, mode, n), mode, n, cal.hardware(), device=device, threads=threads)
            print(f"  {mode} x{n}: measured {mean:.1f} s, predicted {p:.1f} s ({p / mean - 1:+.0%})")
