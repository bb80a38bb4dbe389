"""From a trained model to segmentations of new scans (``distmis predict``).

* :mod:`~distmis.predict.recipe` - what a model expects (``preprocessing.json``, one of its artifacts).
* :mod:`~distmis.predict.registry` - the model in MLflow: an MLflow python_function model from code
  (:mod:`distmis.pyfunc_model`, usable without distmis), saved, logged on its trial's run, registered.
* :mod:`~distmis.predict.model` - a model folder loaded (the python_function model, or a pytorch / tensorflow one
  saved before) with its recipe; the label map of a raw image.
* :mod:`~distmis.predict.resolve` - a registry URI, run URI or search folder -> the model's local folder.
* :mod:`~distmis.predict.segment` - a scan -> a label map on its own grid, written as NIfTI.
"""
