"""Data: NIfTI readers (MSD, BraTS), preprocessing, seeded splits, synthetic data, TFRecords.

Nothing here imports TensorFlow at import time; :mod:`distmis.data.tfrecord` imports it inside
its functions.
"""

from __future__ import annotations

from distmis.data.errors import DataError
from distmis.data.inspect import format_inspection, inspect_dataset
from distmis.data.layouts import LABEL_VALUES, MODALITIES, CaseFiles, Layout, discover_cases, read_case
from distmis.data.preprocess import (
    LabelMode,
    PreprocessConfig,
    center_crop_or_pad,
    labels_to_target,
    preprocess_case,
    resize,
    zscore_nonzero,
)
from distmis.data.split import make_split, read_split, write_split
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import convert_to_tfrecords, iter_cases, make_dataset, read_manifest, verify_checksums

__all__ = [
    "LABEL_VALUES",
    "MODALITIES",
    "CaseFiles",
    "DataError",
    "LabelMode",
    "Layout",
    "PreprocessConfig",
    "center_crop_or_pad",
    "convert_to_tfrecords",
    "discover_cases",
    "format_inspection",
    "inspect_dataset",
    "iter_cases",
    "labels_to_target",
    "make_dataset",
    "make_split",
    "preprocess_case",
    "read_case",
    "read_manifest",
    "read_split",
    "resize",
    "synthesize_dataset",
    "verify_checksums",
    "write_split",
    "zscore_nonzero",
]
