"""Data layer of distmis: raw NIfTI data sets -> preprocessed TFRecords -> tf.data.

Read top-down, the modules are:

* :mod:`~distmis.data.layouts` - the MSD and BraTS on-disk layouts;
  :func:`discover_cases` and :func:`read_case`.
* :mod:`~distmis.data.preprocess` - z-score, crop / pad, resize, label ->
  target channels; :class:`PreprocessConfig` and :func:`preprocess_case`.
* :mod:`~distmis.data.split` - seeded train / val / test splits.
* :mod:`~distmis.data.synthetic` - small synthetic data sets in either layout.
* :mod:`~distmis.data.tfrecord` - offline conversion to sharded TFRecords and
  the tf.data input pipeline.
* :mod:`~distmis.data.inspect` - a per-case summary table of a raw data set.

Importing this package does not import TensorFlow or pandas.
"""

from __future__ import annotations

from distmis.data.errors import DataError
from distmis.data.inspect import format_inspection, inspect_dataset
from distmis.data.layouts import (
    LABEL_VALUES,
    MODALITIES,
    CaseFiles,
    Layout,
    case_spacing,
    case_spatial_shape,
    coerce_layout,
    discover_cases,
    label_counts,
    read_case,
)
from distmis.data.preprocess import (
    LabelMode,
    PreprocessConfig,
    center_crop_or_pad,
    labels_to_target,
    preprocess_case,
    preprocessed_shape,
    preprocessed_spacing,
    resize,
    zscore_nonzero,
)
from distmis.data.split import make_split, read_split, write_split
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import (
    convert_to_tfrecords,
    iter_cases,
    make_dataset,
    read_manifest,
    verify_checksums,
)

__all__ = [
    "DataError",
    "Layout",
    "MODALITIES",
    "LABEL_VALUES",
    "CaseFiles",
    "coerce_layout",
    "discover_cases",
    "read_case",
    "case_spacing",
    "case_spatial_shape",
    "label_counts",
    "LabelMode",
    "PreprocessConfig",
    "zscore_nonzero",
    "center_crop_or_pad",
    "resize",
    "labels_to_target",
    "preprocess_case",
    "preprocessed_shape",
    "preprocessed_spacing",
    "make_split",
    "write_split",
    "read_split",
    "synthesize_dataset",
    "convert_to_tfrecords",
    "read_manifest",
    "verify_checksums",
    "make_dataset",
    "iter_cases",
    "inspect_dataset",
    "format_inspection",
]
