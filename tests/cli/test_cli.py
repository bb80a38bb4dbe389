"""The ``distmis`` command line, run in-process on a local Ray."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distmis.cli.main import build_parser, main
from tests.conftest import query, small_spec_tree
from tests.search.test_prepare import SHORT_CASES, msd_dataset, real_data_tree


def write_spec(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(
    "argv",
    [[], ["run"], ["validate"], ["results"], ["predict"], ["data"], ["data", "synth"], ["data", "tfrecord"],
     ["data", "inspect"]],
)
def test_help_on_every_command(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    assert "usage: distmis" in capsys.readouterr().out


def test_bad_spec_exits_2_and_writes_nothing(tmp_path, capsys):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["optimizer"]["lr"] = -1
    spec = write_spec(tmp_path / "bad.yaml", tree)
    code = main(["run", str(spec), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.yaml" in err and "training.optimizer.lr" in err and "-1" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_bad_set_exits_2(tmp_path, capsys):
    spec = write_spec(tmp_path / "s.yaml", small_spec_tree(tmp_path / "data"))
    assert main(["validate", str(spec), "--set", "training.epochs=-3"]) == 2
    assert "training.epochs" in capsys.readouterr().err
    assert main(["validate", str(spec), "--set", "training.epochs=3"]) == 0


#: What the console of a search must not show (issue: TensorFlow's absl and oneDNN notices, MLflow's INFO lines and
#: download bars); and Ray Tune's boxed tables (box-drawing characters).
NOISE = re.compile(r"absl|oneDNN|port\.cc|INFO mlflow|Downloading artifacts")
BOX = re.compile("[\u2500-\u257f]")


@pytest.mark.slow  # one search of 2 trials x 2 epochs on 16^3 volumes, its own local Ray: about a minute
def test_a_search_from_the_command_line_prints_what_a_person_reads(tmp_path: Path, capsys):
    """``distmis run`` as a person runs it, stdout piped: a header, one line per trial epoch, the results table
    and the test figures, nothing else; the store in a folder other than the working directory gets the artifacts
    beside it; ``distmis results OUTPUT`` reads the search back from its output folder."""
    work, store, out = tmp_path / "work", tmp_path / "store", tmp_path / "out"
    work.mkdir()
    tree = small_spec_tree(tmp_path / "data", name="cli-run")
    tree["tracking"] = {"uri": f"sqlite:///{store / 'mlflow.db'}"}
    tree["training"]["tile"] = "auto"  # planned: the whole 16^3 volume fits a worker of 8 GB
    tree["parallelism"]["memory_per_worker"] = "8GB"
    spec = write_spec(tmp_path / "s.yaml", tree)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    store.mkdir()
    done = subprocess.run([sys.executable, "-m", "distmis", "run", str(spec), "--output", str(out)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr

    lines = done.stdout.splitlines()
    assert lines[0].startswith("planned training.tile: tile [16, 16, 16], batch 2 ("), lines[0]
    assert lines[1].startswith("search cli-run: 2 trial(s), experiment-parallel")
    assert not [line for line in lines if NOISE.search(line) or BOX.search(line) or "\x1b" in line]
    assert not [line for line in done.stderr.splitlines() if NOISE.search(line) or "Successfully registered" in line]
    epochs = [re.match(r"\s+(lr=\S+)\s+epoch (\d+)/2  train_loss \d\.\d{4}  val_dice \d\.\d{4}  elapsed \d+:\d\d$", line)
              for line in lines]
    assert sorted((m[1], int(m[2])) for m in epochs if m) == [("lr=0.001", 1), ("lr=0.001", 2),
                                                              ("lr=0.005", 1), ("lr=0.005", 2)]
    assert sum("finished: best val_dice" in line for line in lines) == 2
    # issue 46: after each trial's end, where the search stands, with the time left while trials remain; and no
    # carriage return anywhere (the data's progress is plain lines off a terminal)
    progress = [line.strip() for line in lines if line.strip().startswith("progress: ")]
    assert len(progress) == 2, lines
    assert re.fullmatch(r"progress: 1/2 trials finished, [01] running, [01] to start; best val_dice \d\.\d{4} "
                        r"\(lr=0\.00[15], epoch [12]\); about \d+:\d\d left \(\d+ trial-epochs? of (\d+\.\d s|\d+:\d\d), 2 at once\)",
                        progress[0]), progress
    assert re.fullmatch(r"progress: 2/2 trials finished, 0 running, 0 to start; best val_dice \d\.\d{4} "
                        r"\(lr=0\.00[15], epoch [12]\)", progress[1]), progress
    assert "\r" not in done.stdout and "\r" not in done.stderr
    assert re.search(r"^synthesize brain \(msd\): 6/6 cases in \d+:\d\d$", done.stderr, re.M), done.stderr
    assert re.search(r"^tfrecords: 6/6 cases in \d+:\d\d$", done.stderr, re.M), done.stderr
    printed = done.stdout
    assert "Search 'cli-run': 2 trial(s), 0 failed" in printed and "best_val_dice" in printed
    assert "Best trial:" in printed and "Test split, best trial:" in printed and "dice WT" in printed
    assert f"distmis results {out}" in printed

    # artifacts beside the store, none in the working directory
    assert list(work.iterdir()) == []
    beside = (store / "mlartifacts").as_uri()
    db = store / "mlflow.db"
    locations = [row[0] for sql in ("SELECT artifact_location FROM experiments WHERE name = 'cli-run'",
                                    "SELECT artifact_uri FROM runs", "SELECT artifact_location FROM logged_models")
                 for row in query(db, sql)]
    assert len(locations) >= 5 and all(loc.startswith(beside) for loc in locations), locations
    parent = query(db, "SELECT artifact_uri FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                       "WHERE t.key = 'distmis.role' AND t.value = 'search'")[0][0]
    assert (Path(parent.removeprefix("file://")) / "results.csv").is_file()
    # the same figures on the search's run, stepped by the trials ended
    figures = query(db, "SELECT m.key, m.step, m.value FROM metrics m JOIN tags t ON m.run_uuid = t.run_uuid "
                        "WHERE t.key = 'distmis.role' AND t.value = 'search' AND m.key LIKE 'search_%'")
    assert sorted((step, value) for key, step, value in figures if key == "search_trials_finished") == [(1, 1), (2, 2)]
    assert [(step, value) for key, step, value in figures if key == "search_eta_seconds" and step == 2] == [(2, 0.0)]
    assert {key for key, _, _ in figures} >= {"search_trials_running", "search_trials_left", "search_best_val_dice",
                                              "search_epoch_seconds"}

    assert main(["results", str(out), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"FINISHED"}
    assert {r["lr"] for r in rows} == {"0.001", "0.005"}
    assert main(["results", "--tracking-uri", f"sqlite:///{db}", "--experiment", "nope"]) == 2
    assert "cli-run" in capsys.readouterr().err  # lists the experiments that do exist
    assert main(["results", str(tmp_path)]) == 2
    assert "search_state.json" in capsys.readouterr().err


def test_data_inspect_of_an_nnunet_data_set(tmp_path, capsys):
    """``distmis data inspect`` on an nnU-Net v2 data set, its layout detected from dataset.json's channel_names:
    channels, classes with voxel counts, spacings, orientations and intensities above the per-case table."""
    import numpy as np

    from tests.data.test_description import write_nnunet_dataset

    label = np.zeros((6, 5, 4), np.uint8)
    label[1:3, 1:3, 1:3] = 1
    label[4:6, 3:5, 2:4] = 2
    ct = np.arange(120, dtype=np.int16).reshape(6, 5, 4) - 1000
    root = write_nnunet_dataset(tmp_path / "Dataset009_Abdomen", {
        "abd_0": ([ct], label), "abd_1": ([ct], label)},
        {"channel_names": {"0": "CT"}, "labels": {"background": 0, "liver": 1, "spleen": 2}, "file_ending": ".nii.gz"},
        affines={"abd_1": np.diag([-0.5, -0.5, 3.0, 1.0])})
    assert main(["data", "inspect", str(root), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "layout: nnunet (detected" in captured.err and captured.err.count("\n") == 1  # nothing else on stderr
    out = captured.out
    assert out.startswith("Dataset009_Abdomen: 2 cases, layout nnunet (nnU-Net v2)\nchannels: 0 CT\n")
    assert re.search(r"^  1 liver +16 voxels \(6\.67%\) in 2/2 cases$", out, re.M), out
    assert re.search(r"^  2 spleen +16 voxels", out, re.M) and re.search(r"^  0 background +208 voxels", out, re.M)
    assert "spacing (mm): min 0.5 x 0.5 x 1, median 0.75 x 0.75 x 2, max 1 x 1 x 3" in out
    assert "orientations: LPS x1, RAS x1" in out
    voxels, inside = np.concatenate([ct.ravel()] * 2), np.concatenate([ct[label > 0]] * 2)
    figures = [voxels.min(), *np.percentile(voxels, [0.5, 99.5]), voxels.max()]
    row = "  0 CT " + " ".join(f"{v:>11.4g}" for v in figures)
    low, high = np.percentile(inside, [0.5, 99.5])
    assert f"{row}   {low:.4g} .. {high:.4g}\n" in out, out
    assert re.search(r"^ *abd_1 +\(6, 5, 4\) +\(0.5, 0.5, 3.0\) +LPS ", out, re.M)  # the per-case table


def test_data_commands(tmp_path, capsys):
    data = tmp_path / "brats"
    assert main(["data", "synth", str(data), "--layout", "brats", "--cases", "4", "--shape", "16x16x16", "--quiet"]) == 0
    assert main(["data", "inspect", str(data), "--layout", "brats"]) == 0
    assert "4" in capsys.readouterr().out
    out = tmp_path / "tfr"
    code = main(["data", "tfrecord", str(data), str(out), "--layout", "brats", "--labels", "regions",
                 "--split", "0.5", "0.25", "0.25", "--quiet"])
    assert code == 0 and (out / "manifest.json").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["label_shape"][-1] == 3
    # A second conversion into the same folder is refused rather than mixed in.
    assert main(["data", "tfrecord", str(data), str(out), "--layout", "brats", "--quiet"]) == 2
    assert main(["data", "inspect", str(tmp_path / "nothing")]) == 2
    # without --layout, the layout is read off the file names
    data2023 = tmp_path / "brats2023"
    assert main(["data", "synth", str(data2023), "--layout", "brats2023", "--cases", "3", "--shape", "12x12x12",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(data2023)]) == 0
    captured = capsys.readouterr()
    assert "layout: brats2023 (detected" in captured.err and "BraTS-GLI-00002-000" in captured.out
    assert re.search(r"^  3 enhancing tumour +[\d,]+ voxels", captured.out, re.M)  # BraTS 2023's ET, 3, allowed
    # --overwrite replaces only what distmis wrote: a manifest beside an unrelated file is not enough.
    (out / "results.xlsx").write_text("a user's file")
    capsys.readouterr()
    assert main(["data", "tfrecord", str(data), str(out), "--layout", "brats", "--overwrite", "--quiet"]) == 2
    assert "results.xlsx" in capsys.readouterr().err and (out / "results.xlsx").read_text() == "a user's file"


def test_data_tfrecord_of_a_ct_data_set_in_classes_at_the_median_spacing(tmp_path, capsys):
    data, out = tmp_path / "ct", tmp_path / "tfr"
    assert main(["data", "synth", str(data), "--kind", "ct", "--layout", "nnunet", "--cases", "4", "--shape",
                 "20,20,12", "--lps-cases", "1", "--quiet"]) == 0
    assert main(["data", "tfrecord", str(data), str(out), "--labels", "classes", "--orientation", "RAS", "--spacing",
                 "auto", "--crop", "24,24,24", "--split", "0.5", "0.25", "0.25", "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["image_shape"] == [24, 24, 24, 1] and manifest["label_shape"] == [24, 24, 24, 4]
    assert [c["key"] for c in manifest["targets"]["channels"]] == ["background", "liver", "spleen", "kidney"]
    made = manifest["preprocess"]
    assert made["orientation"] == "RAS" and made["normalization"][0]["scheme"] == "ct" and len(made["spacing"]) == 3
    assert main(["data", "tfrecord", str(data), str(tmp_path / "bad"), "--labels", "regions", "--quiet"]) == 2
    assert "use labels: classes" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["data", "tfrecord", str(data), str(tmp_path / "bad"), "--spacing", "1,0,1", "--quiet"])
    assert exit_.value.code == 2 and "--spacing" in capsys.readouterr().err


@pytest.mark.parametrize("argv, culprit", [
    (["data", "synth", "OUT", "--cases", "0"], "--cases"),
    (["data", "synth", "OUT", "--shape", "4,4,4"], "--shape"),
    (["data", "tfrecord", "DATA", "OUT", "--shards", "0"], "--shards"),
    (["data", "tfrecord", "DATA", "OUT", "--workers", "-1"], "--workers"),
    (["compare", "SPEC", "--workers", "0,2"], "--workers"),
    (["compare", "SPEC", "--repeats", "0"], "--repeats"),
])
def test_bad_argument_values_exit_2_naming_the_argument(tmp_path, capsys, argv, culprit):
    argv = [str(tmp_path / a) if a in ("OUT", "DATA", "SPEC") else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert culprit in err and "Traceback" not in err
    assert not (tmp_path / "OUT").exists()


def test_parser_shape_argument():
    args = build_parser().parse_args(["data", "synth", "x", "--shape", "8,16,24"])
    assert args.shape == (8, 16, 24)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["data", "synth", "x", "--shape", "8,16"])


def test_cli_run_with_an_oversized_tile_exits_2_and_writes_nothing(tmp_path, capsys):
    data = msd_dataset(tmp_path / "data", SHORT_CASES)
    spec = write_spec(tmp_path / "spec.yaml", real_data_tree(data, [16, 16, 16]))
    out = tmp_path / "out"
    assert main(["run", str(spec), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "training.tile: [16, 16, 16] is larger than the preprocessed volume [16, 16, 12]" in err
    assert str(data / "imagesTr" / "BRATS_001.nii.gz") in err
    assert not out.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    from importlib.metadata import version

    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"distmis {version('distmis')}"


def test_the_tracking_store_falls_back_to_mlflow_tracking_uri(tmp_path, monkeypatch):
    from distmis.search.output import tracking_location
    from distmis.spec import validate_spec

    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_location(spec, tmp_path / "out") == (f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}",
                                                          (tmp_path / "out" / "mlartifacts").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking_location(spec, tmp_path / "out") == ("http://127.0.0.1:5999", None)
    explicit = spec.model_copy(update={"tracking": spec.tracking.model_copy(update={"uri": "sqlite:////x/m.db"})})
    assert tracking_location(explicit, tmp_path / "out")[0] == "sqlite:////x/m.db"  # the spec's wins
