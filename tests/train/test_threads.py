from __future__ import annotations

import subprocess
import sys

import pytest

from distmis.train.threads import threads_for


def test_threads_for():
    assert threads_for(1) == 1 and threads_for(2.7) == 2 and threads_for(0.5) == 1
    with pytest.raises(ValueError):
        threads_for(0)


def test_pin_threads_sets_every_pool():
    # A fresh interpreter: TensorFlow takes thread settings only before its runtime starts.
    code = (
        "import gc, os\n"
        "from distmis.train.threads import pin_threads\n"
        "n = pin_threads(1.5)\n"
        "import tensorflow as tf, torch\n"
        "print(n, tf.config.threading.get_intra_op_parallelism_threads(), torch.get_num_threads(),"
        " os.environ['OMP_NUM_THREADS'])\n"
        "print(gc.isenabled(), gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    pools, collector = out.stdout.splitlines()
    assert pools.split() == ["1", "1", "1", "1"]
    # the frameworks' objects were frozen once imported (distmis.train.startup.loading_libraries): collection on
    enabled, frozen = collector.split()
    assert enabled == "True" and int(frozen) > 100_000


def test_a_trial_process_imports_tensorflow_without_keras_extras():
    # Keras imports scikit-learn and pyplot for features a trial never uses; kept out while it is imported, both
    # still import afterwards, and the model builds as usual.
    code = (
        "import sys\n"
        "from distmis.train.threads import pin_threads\n"
        "pin_threads(1, torch=False)\n"
        "print('sklearn' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n"
        "import keras\n"
        "print(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])(__import__('numpy').ones((1, 3))).shape)\n"
        "import sklearn, matplotlib.pyplot\n"
        "print(sklearn.__name__, matplotlib.pyplot.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["False False", "(1, 2)", "sklearn matplotlib.pyplot"]
