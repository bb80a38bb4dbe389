"""The driver's imports warmed while Ray and the data start (:func:`warm_driver_imports`)."""

from __future__ import annotations

import logging
import os
import threading

from distmis.spec.schema import Spec
from distmis.train.startup import loading_libraries
from distmis.train.threads import tensorflow_env

logger = logging.getLogger(__name__)

__all__ = ["warm_driver_imports"]


def warm_driver_imports(spec: Spec) -> threading.Thread:
    """Import, in a background thread, what the driver needs once the trials end: the trials' framework (to load
    and score the best model), MONAI's metrics where the test split is scored (``search.evaluate_top`` > 0: its
    dice and Hausdorff distance; seconds of import, most of them MONAI's own) and matplotlib (the figures).
    Started before Ray and the data, whose start-up mostly waits on other processes, the imports (seconds for
    TensorFlow) are done by the time the trials end instead of adding to the search's wall time after them.

    Not at a lowered priority: the thread holds the GIL while it imports, and one the scheduler starves would
    starve the driver's Tune loop with it (the trials then wait for their results to be taken).

    The imports run in :func:`~distmis.train.startup.loading_libraries`: the cyclic garbage collector waits while
    they load, and their objects are frozen once loaded, so that the driver's later full collections, as it loads
    and scores the best model, and the interpreter's at exit, skip them."""

    def imports() -> None:
        try:
            with loading_libraries():
                if spec.model.framework == "tensorflow":
                    import keras  # noqa: F401
                    import tensorflow  # noqa: F401
                else:
                    import torch  # noqa: F401
                if spec.search.evaluate_top > 0:
                    import monai.metrics  # noqa: F401
                import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 - the same import after the trials will say what is wrong
            logger.debug("warming the driver's imports failed", exc_info=True)

    for key, value in tensorflow_env().items():  # as the trials import it (quiet, oneDNN's kernels)
        os.environ.setdefault(key, value)
    thread = threading.Thread(target=imports, name="distmis-warm-imports", daemon=True)
    thread.start()
    return thread
