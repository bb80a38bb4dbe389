"""distmis against the plain script a user would write instead, on the same grid, in one run.

The plain script (`--plain`, below) is a Ray Tune + Keras search as the Ray and Keras tutorials write it: the
NIfTI cases read into memory by the driver, handed to the trials with `tune.with_parameters`, one `model.fit`
epoch at a time with the validation dice reported to Tune. It trains what distmis trains (the same cases,
split, preprocessing, U-Net builder, soft dice loss, Adam, seed, batch size and grid: it borrows distmis's
reader, `preprocess_case`, `build_unet3d` and `make_loss` so that only the machinery differs) and leaves out
everything distmis adds around it: TFRecords, MLflow, checkpoints, resuming, the test-set evaluation and the
model registry.

Both run with the same TensorFlow settings (oneDNN kernels on, one thread per trial: what distmis sets). The
benchmark runs each as a user would, as its own process (`python benchmarks/plain_tune.py --plain ...`
and `distmis run ...`, distmis from an empty output folder, so its TFRecord conversion counts), timed from
the outside, experiment-parallel on the same local Ray, and prints the wall times and the best validation
dice of each. distmis runs twice in the same output folder: the first search pays the TFRecord conversion, the
repeated one reuses it (as every later search of a lab's data set does):

    python benchmarks/plain_tune.py --set dataset.synthetic.cases=8 --set training.epochs=3 --output runs/plain-tune
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SPEC = Path(__file__).with_name("speedup.yaml")
EXPERIMENT = {"parallelism.mode": "experiment", "parallelism.workers": 1}


# --------------------------------------------------------------------------- the plain script
def load_cases(spec: Any) -> dict[str, tuple[Any, Any]]:
    """``{"train": (images, labels), "val": (...)}`` as numpy arrays, channels last."""
    import numpy as np

    from distmis.data.layouts import Layout, discover_cases, read_case
    from distmis.data.preprocess import preprocess_case
    from distmis.data.split import make_split
    from distmis.search.data_config import preprocess_config

    cases = {c.case_id: c for c in discover_cases(spec.dataset.path, Layout(spec.dataset.layout))}
    s = spec.dataset.split
    split = make_split(sorted(cases), train=s.train, val=s.val, test=s.test, seed=s.seed)
    config = preprocess_config(spec)
    arrays = {}
    for name in ("train", "val"):
        pairs = [preprocess_case(*read_case(cases[cid], spec.dataset.layout)[:2], config) for cid in split[name]]
        arrays[name] = (np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]).astype(np.float32))
    return arrays


def plain_trial(config: dict[str, Any], data: dict[str, tuple[Any, Any]], spec: Any) -> None:
    import keras
    import numpy as np
    import tensorflow as tf
    from ray import tune

    tf.config.threading.set_intra_op_parallelism_threads(1)  # the trial's one CPU
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from distmis.models.unet3d_tf import build_unet3d
    from distmis.train.losses import make_loss

    keras.utils.set_random_seed(spec.training.seed)
    (x, y), (val_x, val_y) = data["train"], data["val"]
    params = {**spec.model.params.model_dump(), "norm": config["norm"]}
    model = build_unet3d(in_channels=x.shape[-1], num_classes=y.shape[-1], **params)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=config["lr"]),
                  loss=make_loss(spec.training.loss.name, smooth=spec.training.loss.smooth))
    for epoch in range(spec.training.epochs):
        history = model.fit(x, y, batch_size=spec.training.batch_size, epochs=1, shuffle=True, verbose=0)
        prob = model.predict(val_x, batch_size=1, verbose=0)
        hard, truth = prob >= 0.5, val_y > 0.5
        inter = np.logical_and(hard, truth).sum(axis=(1, 2, 3))
        total = hard.sum(axis=(1, 2, 3)) + truth.sum(axis=(1, 2, 3))
        dice = np.where(total > 0, 2 * inter / np.maximum(total, 1), 1.0).mean()
        tune.report({"train_loss": history.history["loss"][-1], "val_dice": float(dice), "epoch": epoch + 1})


def run_plain(spec: Any, storage: Path) -> float:
    import ray
    from ray import tune

    ray.init(address="local")  # a new local Ray, as distmis run starts one
    data = load_cases(spec)
    space = spec.search.space
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(plain_trial, data=data, spec=spec), {"cpu": 1}),
        param_space={"lr": tune.grid_search(space["training.optimizer.lr"].values),
                     "norm": tune.grid_search(space["model.params.norm"].values)},
        tune_config=tune.TuneConfig(metric="val_dice", mode="max"),
        run_config=tune.RunConfig(name="plain", storage_path=str(storage.resolve()), verbose=0),
    )
    results = tuner.fit()
    best = results.get_dataframe(filter_metric="val_dice", filter_mode="max")["val_dice"].max()
    ray.shutdown()
    return float(best)


# --------------------------------------------------------------------------- the benchmark
def distmis_best_dice(spec: Any, output: Path) -> float:
    """The best validation dice of the search's trials, read from its MLflow store."""
    from mlflow.tracking import MlflowClient

    from distmis.tracking.results import find_search_run, trial_runs

    client = MlflowClient(f"sqlite:///{output.resolve() / 'mlflow.db'}")
    parent = find_search_run(client, spec.experiment_name)
    return max(run.data.metrics.get("best_val_dice", float("nan")) for run in trial_runs(client, parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override")
    parser.add_argument("--output", default="runs/plain-tune")
    parser.add_argument("--plain", action="store_true", help="run the plain script only, print its best dice")
    args = parser.parse_args()

    from distmis.search.prepare import ensure_dataset
    from distmis.spec import load_spec
    from distmis.spec.load import parse_set_options

    overrides = {**parse_set_options(args.set), **EXPERIMENT}
    spec = load_spec(SPEC, overrides)
    output = Path(args.output)
    if args.plain:
        print(json.dumps({"best_val_dice": run_plain(spec, output / "plain")}))
        return

    ensure_dataset(spec, progress=False)  # the synthetic cases exist before either clock starts
    from distmis.train.threads import tensorflow_env

    os.environ.update(tensorflow_env())  # both run TensorFlow's oneDNN kernels (the plain one through Ray's workers)
    sets = [f"--set={item}" for item in args.set] + [f"--set={k}={v}" for k, v in EXPERIMENT.items()]
    rows = []
    # distmis twice in the same output folder: the first search converts the cases to TFRecords, the repeated one
    # finds them there (as every later search of a lab's data set does)
    for tool in ("plain", "distmis", "distmis, repeated"):
        folder = output / tool.split(",")[0]
        if tool != "distmis, repeated":
            if folder.exists():
                shutil.rmtree(folder)  # only this benchmark's own folders
            folder.mkdir(parents=True)
        if tool == "plain":
            command = [sys.executable, __file__, "--plain", "--output", str(output), *sets]
        else:
            command = [str(Path(sys.executable).with_name("distmis")), "run", str(SPEC), "--output", str(folder),
                       "--quiet", *sets]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{tool} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        if tool == "plain":
            dice = json.loads(done.stdout.strip().splitlines()[-1])["best_val_dice"]
        else:
            dice = distmis_best_dice(spec, folder)
        rows.append({"tool": tool, "wall_s": round(wall, 1), "best_val_dice": round(dice, 4),
                     "vs_plain": round(wall / rows[0]["wall_s"], 3) if rows else 1.0})
    print("| tool | wall_s | best_val_dice | wall / plain |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['tool']} | {row['wall_s']} | {row['best_val_dice']} | {row['vs_plain']} |")

if __name__ == "__main__":
    main()
