"""A torch trial process's device set-up on real TFRecords: ``training.cudnn_benchmark`` applied by the trainer,
the first report of a trial naming the device its model trains on (the run's ``distmis.device`` tag), and every
report carrying the process's system samples (``tracking.system_metrics``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.parallel.devices import process_node
from distmis.train.loop import epoch_reports
from distmis.trial.record import DEVICE_KEY, NODES_KEY, SYSTEM_KEY, samples_from_json
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trial_devices")
    tree = small_spec_tree(tmp / "data", model={"name": "unet3d", "framework": "torch",
                                                "params": {"base_filters": 4, "levels": 3}})
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False)


def with_training(spec, **training):
    tree = spec.model_dump(mode="json")
    tree["training"].update(training)
    return validate_spec(tree)


def test_cudnn_benchmark_is_off_by_default_and_searchable(tmp_path):
    tree = small_spec_tree(tmp_path / "data")
    assert validate_spec(tree).training.cudnn_benchmark is False
    tree["search"]["space"] = {"training.cudnn_benchmark": {"grid": [False, True]}}
    assert validate_spec(tree).search.space["training.cudnn_benchmark"].values == [False, True]


def test_the_torch_trainer_sets_cudnn_benchmark_from_its_trials_spec(prepared):
    spec, data = prepared
    before = torch.backends.cudnn.benchmark
    try:
        local_trainer(with_training(spec, cudnn_benchmark=True), data.tfrecord_dir)
        assert torch.backends.cudnn.benchmark is True
        local_trainer(spec, data.tfrecord_dir)  # the next trial of the process: its own setting, off
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


def test_a_trials_first_report_names_the_device_its_model_trains_on(prepared):
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    reports = [metrics for metrics, _folder in epoch_reports(trainer, spec)]
    assert [r["epoch"] for r in reports] == [1, 2]
    assert reports[0][DEVICE_KEY] == "cpu"
    assert reports[0][NODES_KEY] == process_node()  # this process's node (outside Ray its host: test below)
    assert DEVICE_KEY not in reports[1] and NODES_KEY not in reports[1]  # once, with the start-up figures


def test_every_report_carries_the_ranks_system_samples_unless_the_spec_turns_them_off(prepared):
    spec, data = prepared
    one_epoch = with_training(spec, epochs=1)
    [report] = [metrics for metrics, _folder in epoch_reports(local_trainer(one_epoch, data.tfrecord_dir), one_epoch,
                                                               rank=0)]
    samples = samples_from_json(report[SYSTEM_KEY])
    assert samples and {"rank0_cpu_utilization_percentage", "rank0_memory_usage_megabytes",
                        "cpu_utilization_percentage"} <= set(samples[-1].values)
    assert "distmis-system-metrics" not in {thread.name for thread in threading.enumerate()}  # stopped at the end

    tree = one_epoch.model_dump(mode="json")
    tree["tracking"]["system_metrics"] = False
    quiet = validate_spec(tree)
    [report] = [metrics for metrics, _folder in epoch_reports(local_trainer(quiet, data.tfrecord_dir), quiet)]
    assert SYSTEM_KEY not in report


def test_a_process_outside_ray_names_its_host_as_its_node():
    """In a process Ray started, the node is Ray's node id (tests/search/test_multinode.py reads them from the runs);
    anywhere else, the host's name."""
    code = "from distmis.parallel.devices import process_node; print(process_node())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == socket.gethostname()
