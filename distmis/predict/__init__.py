"""From a trained model to segmentations of new scans (``distmis predict``).

* :mod:`~distmis.predict.recipe` - what a model expects (``preprocessing.json``, logged beside it).
* :mod:`~distmis.predict.registry` - the model in MLflow: saved, logged on its trial's run, registered.
* :mod:`~distmis.predict.model` - a logged model loaded with its recipe; probabilities of a preprocessed volume.
* :mod:`~distmis.predict.resolve` - a registry URI, run URI or search folder -> the model's local folder.
* :mod:`~distmis.predict.segment` - a scan -> a label map on its own grid, written as NIfTI.
"""
