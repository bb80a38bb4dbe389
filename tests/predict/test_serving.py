"""A registered model served by ``mlflow models serve``, as docs/model.md shows it: the labels ``/invocations``
returns for a scan are those ``distmis predict`` writes for it, voxel for voxel.

The network is :class:`tests.predict.nets.BrightFlair` (logged and registered as a search does, without a search),
so the label map is known to hold every region.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from distmis.cli.main import main
from distmis.predict.registry import BEST_ALIAS, log_model, register_model
from distmis.service.net import LOOPBACK, free_port
from distmis.tracking.mlflow_tracking import default_tracking_uri
from tests.predict.test_segment import ROTATED, bright_model, write_msd_case

DOC = Path(__file__).resolve().parents[2] / "docs" / "model.md"
#: The serving command of docs/model.md: the venv's bin first on PATH (MLflow runs ``uvicorn`` by name).
DOCUMENTED = re.compile(r'PATH="\$PWD/\.venv/bin:\$PATH" mlflow models serve -m models:/(\S+)@best '
                        r"--env-manager local -h 127\.0\.0\.1 -p (\d+)")


def registered_model(tmp_path: Path) -> tuple[str, str]:
    """A regions model (three output channels, MSD label values 1-3) logged on a finished run and registered as
    ``tiny``: ``(tracking URI, model URI)``."""
    uri = default_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    experiment = client.create_experiment("serving", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment, run_name="trial").info.run_id
    client.set_terminated(run_id, "FINISHED")
    model = bright_model("regions", window=(8, 8, 8))
    logged = log_model([model.network], model.recipe, uri, run_id)
    assert register_model(uri, logged, "tiny", run_id=run_id, tags={}, score=("test_dice_mean", 0.5, "max"))[1]
    return uri, f"models:/tiny@{BEST_ALIAS}"


def path_with_only_this_bin_first(scripts: str) -> str:
    """``PATH`` as the documented command makes it: this environment's scripts folder, then the rest of ``PATH``
    without it (so that the server finds ``uvicorn`` because of that prefix, not by chance)."""
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p) != Path(scripts)]
    return os.pathsep.join([scripts, *rest])


def wait_until_serving(process: subprocess.Popen, url: str, log: Path, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlflow models serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow models serve did not answer /ping within {limit_s} s:\n{log.read_text()[-3000:]}")


def test_the_docs_show_the_serving_command_with_the_environment_s_bin_on_path():
    text = DOC.read_text()
    assert DOCUMENTED.search(text), "docs/model.md must show the serving command"
    assert "export MLFLOW_TRACKING_URI=sqlite:///runs/quickstart/mlflow.db" in text
    assert '"inputs"' in text and "/invocations" in text and '"predictions"' in text


@pytest.mark.slow  # a model logged and registered, distmis predict, and an MLflow scoring server: tens of seconds
def test_a_served_model_answers_as_distmis_predict_does(tmp_path: Path):
    tracking_uri, model_uri = registered_model(tmp_path)
    write_msd_case(tmp_path / "data", "case_001", (23, 19, 17), ROTATED, seed=1)
    scan_file = tmp_path / "data" / "imagesTr" / "case_001.nii.gz"
    assert main(["predict", model_uri, str(scan_file), "--output", str(tmp_path / "segs"),
                 "--tracking-uri", tracking_uri, "--quiet"]) == 0
    written = np.asarray(nib.load(str(tmp_path / "segs" / "case_001_seg.nii.gz")).dataobj)
    assert set(np.unique(written)) == {0, 1, 2, 3}  # every region found: not a comparison of empty maps

    scripts, port = sysconfig.get_path("scripts"), free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "PATH": path_with_only_this_bin_first(scripts)}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([str(Path(scripts) / "mlflow"), "models", "serve", "-m", model_uri,
                                   "--env-manager", "local", "-h", LOOPBACK, "-p", str(port)],
                                  cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        url = f"http://{LOOPBACK}:{port}"
        wait_until_serving(server, url, log)
        scan = nib.load(str(scan_file))  # the request of docs/model.md
        body = {"inputs": np.asarray(scan.dataobj, dtype=np.float32).tolist(),
                "params": {"spacing": [float(z) for z in scan.header.get_zooms()[:3]],
                           "orientation": "".join(nib.aff2axcodes(scan.affine))}}
        request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            served = np.asarray(json.load(answer)["predictions"], dtype=np.uint8)
        assert served.shape == written.shape == scan.shape[:3]
        np.testing.assert_array_equal(served, written)
    finally:
        stop_group(server)


def stop_group(server: subprocess.Popen) -> None:
    """Stop the server and the uvicorn it started: their own process group, SIGTERM, then SIGKILL after 30 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:  # the whole group has ended
            break
        try:
            server.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            continue
