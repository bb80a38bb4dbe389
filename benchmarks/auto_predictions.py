"""The makespan model's prediction of every cell of finished comparisons (``distmis compare --modes
experiment,data,auto``), with this checkout's model, calibrated as ``distmis compare`` calibrates them
(:func:`distmis.search.compare.cell_predictions`). Beside each, the cell's mean measured time.

    .venv/bin/python benchmarks/auto_predictions.py runs/auto_tail runs/auto_grid runs/auto_asha
"""
import statistics
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from distmis.search.compare import cell_predictions
from distmis.search.state import SearchState
from distmis.spec import validate_spec

for name in sys.argv[1:]:
    folder = Path(name)
    state = SearchState.load(folder)
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    predictions = cell_predictions(validate_spec(state.spec), state.cells, client)
    print(name)
    for (mode, workers), predicted in predictions.items():
        times = [c["elapsed_s"] for c in state.cells
                 if (c["mode"], int(c["workers"])) == (mode, workers) and c["status"] == "FINISHED"]
        if times:
            measured = statistics.mean(times)
            print(f"  {mode} x{workers}: measured {measured:.1f} s, predicted {predicted:.1f} s "
                  f"({predicted / measured - 1:+.0%})")
