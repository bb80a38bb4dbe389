"""The driver imports the trials' framework in a background thread while Ray and the data start, so
scoring the best model after them does not start with seconds of imports; the driver itself keeps its priority."""

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
before = {name: name in sys.modules for name in ("tensorflow", "torch", "matplotlib.pyplot")}
thread = warm_driver_imports(validate_spec(tree))
thread.join(timeout=120)
print(json.dumps({"before": before, "alive": thread.is_alive(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "after": {name: name in sys.modules for name in ("tensorflow", "torch", "matplotlib.pyplot")},
                  "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}))
"""


def run(framework: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROGRAM, framework], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_framework_is_imported_in_the_background_and_the_driver_keeps_its_priority() -> None:
    tensorflow = run("tensorflow")
    assert tensorflow["before"] == {"tensorflow": False, "torch": False, "matplotlib.pyplot": False}
    assert not tensorflow["alive"]
    assert tensorflow["after"]["tensorflow"] and tensorflow["after"]["matplotlib.pyplot"]
    assert tensorflow["nice"] == 0  # the driver keeps its priority
    assert tensorflow["onednn"] == "1"  # TensorFlow imported as the trials import it
    torch = run("torch")
    assert torch["after"]["torch"] and not torch["after"]["tensorflow"]
