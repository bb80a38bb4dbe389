"""TF_CONFIG for Ray Train workers (the backend itself runs in tests/search/test_layout_in_workers.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distmis.parallel.tensorflow_cluster import tf_config


def test_every_worker_gets_the_whole_cluster_and_its_own_index():
    addresses = ["10.0.0.1:4000", "10.0.0.2:4001", "10.0.0.2:4002"]
    for index in range(3):
        assert tf_config(addresses, index) == {"cluster": {"worker": addresses},
                                               "task": {"type": "worker", "index": index}}
    with pytest.raises(ValueError, match="index 3 is outside the cluster of 3"):
        tf_config(addresses, 3)


def test_the_backend_module_imports_no_framework():
    """What the Tune trial and the Ray Train controller unpickle: TensorFlow stays out of those processes."""
    code = ("import sys, distmis.parallel.tensorflow_cluster as m; m.TensorflowClusterConfig().backend_cls; "
            "print(sorted(n for n in ('tensorflow', 'torch', 'keras') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
