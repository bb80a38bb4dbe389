"""Pin a worker's thread pools to the CPUs Ray gave it.

Two trials that each spawn one thread per machine core fight over the same cores, and every
speedup figure measured that way is wrong. Call :func:`pin_threads` first thing in a trial or
worker, before TensorFlow or torch run an op.
"""

from __future__ import annotations

import importlib.abc
import logging
import math
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: the environment variables that size the OpenMP, MKL, OpenBLAS and TensorFlow intra-op thread pools
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")
ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"


def tensorflow_env() -> dict[str, str]:
    """What a process must have in its environment before it imports TensorFlow; the user's own values win.

    - quiet C++ logs, and Keras on TensorFlow;
    - oneDNN's kernels on: TensorFlow turns them on by itself only on CPUs with AVX-512 VNNI, BF16 or AMX.
      Without them, its 3D convolutions on an AVX2 CPU ran a U-Net step 7 times slower (8.7 s against
      1.2 s: benchmarks/history.md). ``TF_ENABLE_ONEDNN_OPTS=0`` turns them off.
    """
    return {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "tensorflow"),
            ONEDNN_ENV: os.environ.get(ONEDNN_ENV, "1")}


def threads_for(cpus: float) -> int:
    """Whole threads for a (possibly fractional) CPU allocation: at least one."""
    if cpus <= 0:
        raise ValueError(f"cpus must be > 0, got {cpus}")
    return max(1, math.floor(cpus))


def pin_threads(cpus: float, *, tensorflow: bool = True, torch: bool = True) -> int:
    """Set OMP/MKL/TF/torch thread counts to ``cpus``; returns the count used.

    TensorFlow only accepts thread settings before its runtime starts; if it already has, a
    warning says so rather than silently running oversubscribed.

    The process's devices are set up here too, as every trial process calls this first: TensorFlow's memory growth
    on each GPU it sees (:func:`~distmis.parallel.devices.tensorflow_memory_growth`, before its runtime starts), and
    the refusal of a process that Ray gave a GPU which ``tensorflow`` or ``torch`` (those it pins) cannot see
    (:func:`~distmis.parallel.devices.check_process_gpus`: GpuUnavailableError, before any training).
    """
    from distmis.parallel.devices import check_process_gpus, tensorflow_memory_growth
    from distmis.train.startup import loading_libraries

    n = threads_for(cpus)
    for var in THREAD_ENV_VARS:
        os.environ[var] = str(n)
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    if tensorflow:
        for var, value in tensorflow_env().items():
            os.environ.setdefault(var, value)
        with loading_libraries():
            tf = import_tensorflow()
        try:
            tf.config.threading.set_intra_op_parallelism_threads(n)
            tf.config.threading.set_inter_op_parallelism_threads(1 if n <= 2 else 2)
        except RuntimeError as exc:  # runtime already initialised in this process
            current = tf.config.threading.get_intra_op_parallelism_threads()
            if current != n:
                logger.warning("TensorFlow threads already fixed at %s, wanted %s: %s", current, n, exc)
        tensorflow_memory_growth()
    if torch:
        try:
            with loading_libraries():
                import torch as _torch
        except ImportError:  # torch is optional for TensorFlow-only work
            torch = False
        else:
            _torch.set_num_threads(n)
            try:
                _torch.set_num_interop_threads(1)
            except RuntimeError:  # may only be set once per process
                pass
    check_process_gpus(tensorflow=tensorflow, torch=torch)
    return n


# What Keras imports for features a trial never uses: scikit-learn (its scikit-learn estimator wrappers) and
# matplotlib's pyplot (its image-gallery plots), when installed (MLflow requires both).
_KERAS_EXTRAS = ("sklearn", "matplotlib.pyplot")


class _WithoutKerasExtras(importlib.abc.MetaPathFinder):
    """While TensorFlow and Keras are imported: the imports of :data:`_KERAS_EXTRAS` fail, as if not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if any(name == extra or name.startswith(extra + ".") for extra in _KERAS_EXTRAS):
            raise ImportError(f"{name} is not imported with Keras in a trial process")
        return None


def import_tensorflow() -> Any:
    """``import tensorflow`` (and Keras) for a trial process, without the modules Keras imports only for its
    scikit-learn wrappers and plotting (:data:`_KERAS_EXTRAS`): 0.3 to 0.8 s of each new trial process's 3 s
    start-up on a 2-core machine. Keras catches their ImportError and leaves those features off; once it is
    imported, both import as usual again (a process that had them already keeps them)."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        return tf
    finder = _WithoutKerasExtras()
    sys.meta_path.insert(0, finder)
    try:
        import tensorflow as tf
        import keras  # noqa: F401 - imported here, while the extras are kept out
    finally:
        sys.meta_path.remove(finder)
    return tf
