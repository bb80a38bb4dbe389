"""nnU-Net v2 itself against distmis with ``training.recipe: nnunet`` and against distmis's search: the same data,
the same split, the same wall-clock budget, the same scoring (issue 50).

Three runs, one after the other, on an otherwise idle machine:

1. **nnU-Net v2**, in its own virtual environment (``nnunetv2`` from PyPI): ``nnUNetv2_plan_and_preprocess``
   (3d_fullres), then ``nnUNetv2_train`` on fold 0 of a ``splits_final.json`` that holds distmis's train/val split,
   with one of nnU-Net's short trainers (``--trainer``, default ``nnUNetTrainer_5epochs``) on the CPU, then
   ``nnUNetv2_predict`` on the test cases (its defaults: mirroring on every axis, the final checkpoint). Its plan,
   preprocessing and training time is the **budget**.
2. **distmis, ``recipe: nnunet``**: one trial of MONAI's DynUNet planned as nnU-Net plans its U-Net (kernels and
   strides from the tile and the spacing), nnU-Net's patch as the tile and its batch, nnU-Net's epochs, on all the
   machine's CPUs; its steps per epoch (nnU-Net: 250) are what fits the budget, measured on a short probe run of the
   same spec. Then ``distmis predict`` on the test cases (the model's own mirroring).
3. **distmis's search**: the same spec with ``training.optimizer.lr`` searched (``--search-lrs``), the trials side by
   side on one CPU each, its steps per epoch fitted to the same budget by a probe of the search itself; its best
   configuration's model predicts the test cases.

Every model's label maps, in each test scan's own geometry, are scored here by one function: dice per class
(a class absent from both the label and the prediction scores 1). The distmis spec's other values (crop, spacing,
orientation) are what ``distmis init`` drafts for the data set.

    python3 -m venv .venv-nnunet && .venv-nnunet/bin/pip install torch==2.14.1 torchvision==0.29.1 nnunetv2==2.8.1
    .venv/bin/python benchmarks/vs_nnunet.py --nnunet .venv-nnunet --output runs/vs-nnunet
    .venv/bin/python benchmarks/vs_nnunet.py --nnunet .venv-nnunet --output runs/vs-spleen --data data/Task09_Spleen

Without ``--data`` a synthetic CT set is written (``distmis data synth --kind ct``: liver, spleen, kidney;
anisotropic spacings that differ between cases, two cases stored LPS). ``--data`` takes an MSD task folder or an
nnU-Net raw data set. The table goes to ``OUTPUT/vs_nnunet.md`` (and ``.json``); each step's console output to
``OUTPUT/logs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
DISTMIS = [sys.executable, "-m", "distmis"]
PROBE_STEPS = 25  # training steps of a probe run's one epoch


# --------------------------------------------------------------------------- the data and its split
def data_set(args: argparse.Namespace, out: Path) -> Path:
    """The data set's folder: ``--data``, or a synthetic CT set written into ``out``."""
    if args.data:
        return Path(args.data).resolve()
    folder = out / "data" / "synthetic-ct"
    if not folder.exists():
        run_logged([*DISTMIS, "data", "synth", str(folder), "--kind", "ct", "--layout", "nnunet", "--cases",
                    str(args.cases), "--shape", args.shape, "--seed", str(args.seed), "--lps-cases", "2", "--quiet"],
                   out / "logs" / "synth.log")
    return folder


def labels_of(folder: Path) -> dict[str, int]:
    """The data set's classes, ``{name: value}`` (MSD's ``{"0": "background", ...}`` or nnU-Net's own form)."""
    meta = json.loads((folder / "dataset.json").read_text())
    labels = meta["labels"]
    if all(str(key).isdigit() for key in labels):  # MSD
        return {str(name): int(value) for value, name in labels.items()}
    return {str(name): int(value) for name, value in labels.items()}


def channel_names(folder: Path) -> dict[str, str]:
    meta = json.loads((folder / "dataset.json").read_text())
    return {str(k): str(v) for k, v in (meta.get("channel_names") or meta["modality"]).items()}


def the_split(folder: Path, layout: str, fractions: tuple[float, float, float], seed: int) -> dict[str, Any]:
    """The split distmis makes of this data set for ``dataset.split: {train, val, test, seed}``: the same call."""
    from distmis.data.layouts import discover_cases
    from distmis.data.split import make_split

    cases = discover_cases(folder, layout)
    train, val, test = fractions
    split = make_split([case.case_id for case in cases], train=train, val=val, test=test, seed=seed)
    split["files"] = {case.case_id: case for case in cases}
    return split


def channel_files(case: Any, folder: Path, channels: int) -> None:
    """The case's images as nnU-Net channel files in ``folder`` (``<case>_0000.nii.gz``, ...): links to 3-D
    files, a 4-D MSD image written channel by channel."""
    folder.mkdir(parents=True, exist_ok=True)
    if len(case.images) == channels:
        for index, image in enumerate(case.images):
            link(image, folder / f"{case.case_id}_{index:04d}.nii.gz")
        return
    image = nib.load(str(case.images[0]))
    data = np.asanyarray(image.dataobj)
    for index in range(channels):
        nib.save(nib.Nifti1Image(data[..., index], image.affine, image.header),
                 str(folder / f"{case.case_id}_{index:04d}.nii.gz"))


def link(source: Path, target: Path) -> None:
    if not target.exists():
        target.symlink_to(Path(source).resolve())


# --------------------------------------------------------------------------- running and timing
def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``command`` with its output in ``log``; its wall seconds. A failure ends the benchmark, naming the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("w") as stream:
        done = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, **(env or {})})
    seconds = time.monotonic() - start
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}); {log}:\n{tail}")
    return seconds


# --------------------------------------------------------------------------- nnU-Net v2
def run_nnunet(args: argparse.Namespace, data: Path, layout: str, split: dict[str, Any], out: Path
               ) -> dict[str, Any]:
    """nnU-Net v2 planned, preprocessed, trained on fold 0 (= distmis's train/val split) and applied to the test
    cases: its times, its plan and the folder of its test predictions."""
    bin_dir = Path(args.nnunet).resolve() / "bin"
    home = out / "nnunet"
    name = f"Dataset{args.dataset_id:03d}_{json.loads((data / 'dataset.json').read_text()).get('name', 'Data')}"
    name = name.replace(" ", "")
    raw = home / "raw" / name
    env = {"nnUNet_raw": str(home / "raw"), "nnUNet_preprocessed": str(home / "preprocessed"),
           "nnUNet_results": str(home / "results")}
    channels = channel_names(data)
    files = split["files"]
    development = [*split["train"], *split["val"]]
    if not raw.exists():
        for case_id in development:
            channel_files(files[case_id], raw / "imagesTr", len(channels))
            (raw / "labelsTr").mkdir(parents=True, exist_ok=True)
            link(files[case_id].label, raw / "labelsTr" / f"{case_id}.nii.gz")
        (raw / "dataset.json").write_text(json.dumps({
            "channel_names": channels, "labels": labels_of(data), "numTraining": len(development),
            "file_ending": ".nii.gz", "name": name}, indent=2))
    test_images = out / "test_images"
    for case_id in split["test"]:
        channel_files(files[case_id], test_images, len(channels))

    logs = out / "logs"
    times = {"plan_preprocess_s": run_logged(
        [str(bin_dir / "nnUNetv2_plan_and_preprocess"), "-d", str(args.dataset_id), "-c", "3d_fullres", "-np", "2"],
        logs / "nnunet_plan.log", env)}
    splits = home / "preprocessed" / name / "splits_final.json"
    splits.write_text(json.dumps([{"train": list(split["train"]), "val": list(split["val"])}], indent=2))
    times["train_s"] = run_logged(
        [str(bin_dir / "nnUNetv2_train"), str(args.dataset_id), "3d_fullres", "0", "-tr", args.trainer,
         "-device", "cpu"], logs / "nnunet_train.log", env)
    predictions = out / "predictions" / "nnunet"
    times["predict_s"] = run_logged(
        [str(bin_dir / "nnUNetv2_predict"), "-i", str(test_images), "-o", str(predictions), "-d",
         str(args.dataset_id), "-c", "3d_fullres", "-f", "0", "-tr", args.trainer, "-device", "cpu"],
        logs / "nnunet_predict.log", env)
    plans = json.loads((home / "preprocessed" / name / "nnUNetPlans.json").read_text())
    plan = plans["configurations"]["3d_fullres"]
    trainer = json.loads((home / "results" / name / f"{args.trainer}__nnUNetPlans__3d_fullres" / "fold_0"
                          / "debug.json").read_text())
    summary = (home / "results" / name / f"{args.trainer}__nnUNetPlans__3d_fullres" / "fold_0" / "validation"
               / "summary.json")
    val_dice = json.loads(summary.read_text())["foreground_mean"]["Dice"] if summary.exists() else math.nan
    result = {"times": times, "patch": [int(v) for v in plan["patch_size"]], "batch": int(plan["batch_size"]),
              "spacing": [float(v) for v in plan["spacing"]], "epochs": int(trainer["num_epochs"]),
              "steps_per_epoch": int(trainer["num_iterations_per_epoch"]), "val_dice": float(val_dice),
              "predictions": str(predictions), "test_images": str(test_images), "trainer": args.trainer}
    (home / "result.json").write_text(json.dumps(result, indent=2))
    return result


def nnunet_result(args: argparse.Namespace, data: Path, layout: str, split: dict[str, Any], out: Path
                  ) -> dict[str, Any]:
    """nnU-Net's run (:func:`run_nnunet`), or with ``--reuse-nnunet`` the one this output folder holds."""
    kept = out / "nnunet" / "result.json"
    if args.reuse_nnunet:
        if not kept.exists():
            sys.exit(f"--reuse-nnunet: {kept} does not exist; run without it first")
        result = json.loads(kept.read_text())
        if result["trainer"] != args.trainer:
            sys.exit(f"--reuse-nnunet: {kept} is of trainer {result['trainer']}, not {args.trainer}")
        return result
    return run_nnunet(args, data, layout, split, out)


# --------------------------------------------------------------------------- distmis
def drafted(data: Path, out: Path) -> dict[str, Any]:
    """What ``distmis init`` drafts for the data set (its dataset section: crop, spacing, orientation, labels)."""
    draft = out / "init.yaml"
    if not draft.exists():
        run_logged([*DISTMIS, "init", str(data), "--output", str(draft), "--workers", "1", "--cpus-per-worker",
                    str(os.cpu_count() or 1)], out / "logs" / "init.yaml.log")
    return yaml.safe_load(draft.read_text())


def distmis_tree(draft: dict[str, Any], name: str, nnunet: dict[str, Any], args: argparse.Namespace) -> dict:
    """distmis's spec under nnU-Net's recipe: DynUNet planned as nnU-Net plans, nnU-Net's patch (its axes are the
    reverse of NIfTI's) and batch, nnU-Net's epochs, one trial on every CPU."""
    dataset = {**draft["dataset"], "labels": "classes"}
    train, val, test = args.split
    dataset["split"] = {"train": train, "val": val, "test": test, "seed": args.seed}
    tile = list(reversed(nnunet["patch"]))
    # every case is cut (or padded) to at least the tile: the crop the draft chose, grown where the tile is larger
    if dataset.get("crop"):
        dataset["crop"] = [max(int(c), t) for c, t in zip(dataset["crop"], tile)]
    return {
        "name": name, "dataset": dataset,
        "model": {"name": "dynunet", "framework": "torch", "params": {}},
        "training": {"recipe": "nnunet", "epochs": nnunet["epochs"], "batch_size": nnunet["batch"], "tile": tile,
                     "seed": 0},
        "search": {"algorithm": "grid", "space": {}},
        "parallelism": {"mode": "experiment", "resources_per_trial": {"cpu": os.cpu_count() or 1, "gpu": 0}},
    }


def searched(tree: dict[str, Any], lrs: list[float]) -> dict[str, Any]:
    """The search: ``training.optimizer.lr`` over ``lrs`` (nnU-Net's SGD, momentum and decay kept), the trials side
    by side on one CPU each."""
    tree = json.loads(json.dumps(tree))
    tree["name"] = tree["name"].replace("-recipe", "-search")
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": lrs}}
    tree["parallelism"]["resources_per_trial"] = {"cpu": 1, "gpu": 0}
    return tree


def run_distmis(tree: dict[str, Any], out: Path, log: Path) -> tuple[float, Path]:
    """``distmis run`` of ``tree`` into ``out``: its wall seconds and ``out``."""
    shutil.rmtree(out, ignore_errors=True)  # a folder this benchmark wrote
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = out.with_suffix(".yaml")
    spec.write_text(yaml.safe_dump(tree, sort_keys=False))
    return run_logged([*DISTMIS, "run", str(spec), "--output", str(out), "--quiet"], log), out


def search_trials(out: Path) -> tuple[Any, list[Any]]:
    """The MLflow client of a finished search's store and its trials' runs."""
    from mlflow.tracking import MlflowClient

    from distmis.search.state import SearchState
    from distmis.tracking.results import trial_runs

    state = SearchState.load(out)
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    return client, trial_runs(client, client.get_run(state.run_id))


def trial_epochs(out: Path) -> list[dict[str, float]]:
    """Each trial's epoch and validation seconds, summed over its epochs, from the search's MLflow store."""
    client, runs = search_trials(out)
    return [{key: sum(m.value for m in client.get_metric_history(run.info.run_id, metric))
             for key, metric in (("epoch_s", "epoch_seconds"), ("validation_s", "validation_seconds"))}
            for run in runs]


def fitted_steps(tree: dict[str, Any], budget: float, out: Path, label: str) -> tuple[int, dict[str, float]]:
    """The steps per epoch that make ``distmis run`` of ``tree`` (its epochs, its trials all at once) last
    ``budget`` seconds, from a probe run of one epoch of :data:`PROBE_STEPS` steps: the time a step takes, the
    validation's time per epoch, and what the run spends outside its epochs (Ray's start, the data's conversion,
    the test split, the model's publication)."""
    probe = json.loads(json.dumps(tree))
    probe["training"].update(epochs=1, steps_per_epoch=PROBE_STEPS)
    wall, folder = run_distmis(probe, out / f"probe-{label}", out / "logs" / f"probe-{label}.log")
    trials = trial_epochs(folder)
    slowest = max(trials, key=lambda t: t["epoch_s"])
    step_s = (slowest["epoch_s"] - slowest["validation_s"]) / PROBE_STEPS
    at_once = max(1, (os.cpu_count() or 1) // int(tree["parallelism"]["resources_per_trial"]["cpu"]))
    rounds = math.ceil(len(trials) / at_once)  # the trials' turns, each as long as the probe's slowest
    outside = wall - rounds * slowest["epoch_s"]
    epochs = int(tree["training"]["epochs"]) * rounds
    steps = math.floor((budget - outside - epochs * slowest["validation_s"]) / (epochs * step_s))
    if steps < 1:
        sys.exit(f"{label}: the budget of {budget:.0f} s leaves no step per epoch (a step {step_s:.2f} s, "
                 f"validation {slowest['validation_s']:.1f} s an epoch, {outside:.0f} s outside the epochs)")
    return steps, {"probe_step_s": step_s, "probe_validation_s": slowest["validation_s"], "probe_outside_s": outside}


def best_val(out: Path) -> float:
    """The search's best trial's selected validation value (``best_<metric>``: the moving average under the recipe)."""
    _, runs = search_trials(out)
    values = [value for run in runs for key, value in run.data.metrics.items()
              if key.startswith("best_") and key != "best_epoch"]
    return max(values) if values else math.nan


def the_runs_split(out: Path) -> dict[str, list[str]]:
    """The split the search ran on (its run's ``split.json``)."""
    from mlflow.tracking import MlflowClient

    from distmis.search.state import SearchState

    state = SearchState.load(out)
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    path = client.download_artifacts(state.run_id, "split.json", str(out))
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- scoring
def dice_per_class(truth: np.ndarray, prediction: np.ndarray, labels: dict[str, int]) -> dict[str, float]:
    """Dice of each foreground class; 1 where the class is in neither."""
    scores = {}
    for name, value in labels.items():
        if value == 0:
            continue
        t, p = truth == value, prediction == value
        total = int(t.sum() + p.sum())
        scores[name] = 1.0 if total == 0 else 2.0 * float(np.logical_and(t, p).sum()) / total
    return scores


def score(predictions: Path, suffix: str, split: dict[str, Any], labels: dict[str, int]) -> dict[str, Any]:
    """The test cases' dice per class (mean over the cases) and the mean over the classes, from label maps written
    in each scan's own geometry (``<case><suffix>`` in ``predictions``)."""
    per_case = {}
    for case_id in split["test"]:
        truth_image = nib.load(str(split["files"][case_id].label))
        predicted = nib.load(str(predictions / f"{case_id}{suffix}"))
        if predicted.shape[:3] != truth_image.shape[:3] or not np.allclose(predicted.affine, truth_image.affine,
                                                                           atol=1e-3):
            sys.exit(f"{predictions / (case_id + suffix)}: not in the scan's geometry ({predicted.shape}, "
                     f"{truth_image.shape})")
        truth = np.rint(np.asanyarray(truth_image.dataobj)).astype(np.int64)
        per_case[case_id] = dice_per_class(truth, np.rint(np.asanyarray(predicted.dataobj)).astype(np.int64),
                                           labels)
    classes = {name: float(np.mean([case[name] for case in per_case.values()])) for name in next(
        iter(per_case.values()))}
    return {"classes": classes, "mean": float(np.mean(list(classes.values()))), "cases": per_case}


# --------------------------------------------------------------------------- the table
def table(rows: list[dict[str, Any]], classes: list[str]) -> str:
    head = ["method", "epochs x steps", "wall s (budget: nnU-Net's plan + train)", "predict s", "best val dice",
            *[f"test dice {name}" for name in classes], "test dice mean"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["method"], row["schedule"], f"{row['wall_s']:.0f}", f"{row['predict_s']:.0f}",
                 f"{row['val_dice']:.4f}", *[f"{row['test']['classes'][name]:.4f}" for name in classes],
                 f"{row['test']['mean']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnunet", required=True, help="nnU-Net v2's virtual environment (its bin/ holds "
                                                        "nnUNetv2_train)")
    parser.add_argument("--output", default="runs/vs-nnunet", help="a new folder for everything it writes")
    parser.add_argument("--data", help="an MSD task folder or an nnU-Net raw data set (default: synthetic CT)")
    parser.add_argument("--cases", type=int, default=24, help="synthetic cases (default 24)")
    parser.add_argument("--shape", default="40,40,28", help="synthetic volumes' shape (default 40,40,28)")
    parser.add_argument("--split", default="0.6,0.15,0.25", help="train,val,test fractions (default 0.6,0.15,0.25)")
    parser.add_argument("--seed", type=int, default=0, help="the split's seed (and the synthetic data's)")
    parser.add_argument("--trainer", default="nnUNetTrainer_5epochs", help="nnU-Net's trainer")
    parser.add_argument("--dataset-id", type=int, default=501, help="nnU-Net's data set id (default 501)")
    parser.add_argument("--search-lrs", default="0.01,0.003", help="the search's learning rates")
    parser.add_argument("--runs", default="recipe,search", help="distmis's runs (default recipe,search)")
    parser.add_argument("--reuse-nnunet", action="store_true",
                        help="take nnU-Net's run from OUTPUT/nnunet (an earlier run of this script) instead of "
                             "running it again")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    args.split = tuple(float(v) for v in args.split.split(","))
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(args.nnunet) / "bin" / "nnUNetv2_train").exists():
        sys.exit(f"--nnunet {args.nnunet!r}: no bin/nnUNetv2_train there; make one with: python3 -m venv "
                 f"{args.nnunet} && {args.nnunet}/bin/pip install torch==2.14.1 torchvision==0.29.1 nnunetv2")

    from distmis.data.scans import detect_layout

    data = data_set(args, out)
    layout = detect_layout(data).value
    split = the_split(data, layout, args.split, args.seed)
    labels = labels_of(data)
    classes = [name for name, value in labels.items() if value != 0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    nnunet = nnunet_result(args, data, layout, split, out)
    budget = nnunet["times"]["plan_preprocess_s"] + nnunet["times"]["train_s"]
    rows = [{"method": f"nnU-Net v2 ({args.trainer}, 3d_fullres, patch {'x'.join(map(str, nnunet['patch']))}, "
                       f"batch {nnunet['batch']})",
             "schedule": f"{nnunet['epochs']} x {nnunet['steps_per_epoch']}", "wall_s": budget,
             "predict_s": nnunet["times"]["predict_s"], "val_dice": nnunet["val_dice"],
             "test": score(Path(nnunet["predictions"]), ".nii.gz", split, labels), "times": nnunet["times"]}]

    draft = drafted(data, out)
    recipe = distmis_tree(draft, "vs-nnunet-recipe", nnunet, args)
    lrs = [float(v) for v in args.search_lrs.split(",")]
    runs = {"recipe": recipe, "search": searched(recipe, lrs)}
    for label in args.runs.split(","):
        if label not in runs:
            sys.exit(f"--runs {args.runs!r}: {label!r} is not one of {', '.join(runs)}")
    for label, tree in ((label, runs[label]) for label in args.runs.split(",")):
        steps, probe = fitted_steps(tree, budget, out, label)
        tree["training"]["steps_per_epoch"] = steps
        wall, folder = run_distmis(tree, out / f"distmis-{label}", out / "logs" / f"distmis-{label}.log")
        run_split = the_runs_split(folder)
        if [sorted(run_split[part]) for part in ("train", "val", "test")] != [
                sorted(split[part]) for part in ("train", "val", "test")]:
            sys.exit(f"distmis-{label}: its split differs from the one nnU-Net was given")
        predictions = out / "predictions" / f"distmis-{label}"
        shutil.rmtree(predictions, ignore_errors=True)
        predict_s = run_logged([*DISTMIS, "predict", str(folder), str(nnunet["test_images"]), "--output",
                                str(predictions), "--layout", "nnunet", "--quiet"],
                               out / "logs" / f"predict-{label}.log")
        name = ("distmis, recipe: nnunet (DynUNet, tile and batch as nnU-Net's)" if label == "recipe" else
                f"distmis search, lr in {lrs} ({len(lrs)} trials side by side, 1 CPU each)")
        rows.append({"method": name, "schedule": f"{tree['training']['epochs']} x {steps}", "wall_s": wall,
                     "predict_s": predict_s, "val_dice": best_val(folder),
                     "test": score(predictions, "_seg.nii.gz", split, labels), "probe": probe})

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    header = (f"{started}, commit {commit.stdout.strip()}, {platform.node()} ({os.cpu_count()} CPUs), data "
              f"{data.name}: {len(split['train'])} train, {len(split['val'])} val, {len(split['test'])} test cases; "
              f"budget {budget:.0f} s")
    text = f"{header}\n\n{table(rows, classes)}\n"
    (out / "vs_nnunet.md").write_text(text)
    (out / "vs_nnunet.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2, default=str))
    print(text)


if __name__ == "__main__":
    main()
