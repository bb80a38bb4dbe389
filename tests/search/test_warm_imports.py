"""The driver imports the trials' framework (and MONAI's metrics, where the test split is scored) in a background
thread while Ray and the data start, so scoring the best model after them does not start with seconds of imports; the
driver itself keeps its priority."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two fresh interpreters importing TensorFlow and torch

PROGRAM = """
import json, os, sys
from distmis.search.warm_imports import warm_driver_imports
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree

tree = small_spec_tree("/nonexistent")
tree["model"]["framework"] = sys.argv[1]
tree["search"]["evaluate_top"] = int(sys.argv[2])
MODULES = ("tensorflow", "torch", "matplotlib.pyplot", "monai.metrics")
before = {name: name in sys.modules for name in MODULES}
thread = warm_driver_imports(validate_spec(tree))
thread.join(timeout=120)
print(json.dumps({"before": before, "alive": thread.is_alive(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "after": {name: name in sys.modules for name in MODULES},
                  "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}))
"""


def run(framework: str, evaluate_top: int) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, framework, str(evaluate_top)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_framework_is_imported_in_the_background_and_the_driver_keeps_its_priority() -> None:
    tensorflow = run("tensorflow", evaluate_top=1)
    assert set(tensorflow["before"].values()) == {False}
    assert not tensorflow["alive"]
    assert tensorflow["after"]["tensorflow"] and tensorflow["after"]["matplotlib.pyplot"]
    assert tensorflow["after"]["monai.metrics"]  # the test split's scores
    assert tensorflow["nice"] == 0  # the driver keeps its priority
    assert tensorflow["onednn"] == "1"  # TensorFlow imported as the trials import it
    torch = run("torch", evaluate_top=0)
    assert torch["after"]["torch"] and not torch["after"]["tensorflow"]
    assert not torch["after"]["monai.metrics"]  # no test split scored
