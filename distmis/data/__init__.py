"""Data layer of distmis: raw NIfTI data sets -> preprocessed TFRecords -> tf.data.

Read top-down, the modules are:

* :mod:`~distmis.data.description` - what a data set holds (channels, classes,
  nnU-Net regions), from its own ``dataset.json``; :func:`describe_dataset`.
* :mod:`~distmis.data.layouts` - the MSD, nnU-Net v2, BraTS and BraTS 2023 on-disk
  layouts; :func:`discover_cases`, :func:`check_cases` and :func:`read_case`.
* :mod:`~distmis.data.dataset_layouts` - the registry of those layouts: one entry each, binding its
  discovery, description and synthetic writer; :data:`DATASET_LAYOUTS`.
* :mod:`~distmis.data.scans` - the scans to segment (one case or a data set,
  labels optional); :func:`discover_scans`, :func:`read_scan` and :func:`read_scan_label`.
* :mod:`~distmis.data.preprocess` - z-score, crop / pad, resize, label ->
  target channels; :class:`PreprocessConfig` and :func:`preprocess_case`.
* :mod:`~distmis.data.split` - seeded train / val / test splits, or cross-validation folds and test.
* :mod:`~distmis.data.synthetic` - small synthetic data sets in any layout.
* :mod:`~distmis.data.tfrecord` - offline conversion to sharded TFRecords and
  the tf.data input pipeline.
* :mod:`~distmis.data.inspect` - a summary of a raw data set (classes, spacings,
  orientations, intensities) and its per-case table.

Importing this package does not import TensorFlow or pandas.
"""

from __future__ import annotations

from distmis.data import layout_entries  # noqa: F401 - fills the layout registry before anything reads it
from distmis.data.dataset_layouts import (
    DATASET_LAYOUTS, DatasetLayout, dataset_layout, describe_dataset, layout_description,
)
from distmis.data.description import DatasetDescription, Region
from distmis.data.errors import DataError
from distmis.data.inspect import (
    DatasetSummary,
    format_inspection,
    format_summary,
    inspect_dataset,
    summarize_dataset,
)
from distmis.data.layouts import (
    MODALITIES,
    CaseFiles,
    Layout,
    case_affine,
    case_file_stems,
    case_orientation,
    case_spacing,
    case_spatial_shape,
    check_cases,
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
    preprocess_image,
    preprocessed_shape,
    preprocessed_spacing,
    resize,
    zscore_nonzero,
)
from distmis.data.scans import ScanFiles, discover_scans, read_scan, read_scan_label
from distmis.data.split import development_cases, fold_parts, make_split, read_split, split_parts, write_split
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
    "DatasetDescription",
    "Region",
    "describe_dataset",
    "layout_description",
    "DATASET_LAYOUTS",
    "DatasetLayout",
    "dataset_layout",
    "Layout",
    "MODALITIES",
    "CaseFiles",
    "coerce_layout",
    "case_file_stems",
    "discover_cases",
    "read_case",
    "check_cases",
    "case_affine",
    "case_orientation",
    "ScanFiles",
    "discover_scans",
    "read_scan",
    "read_scan_label",
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
    "preprocess_image",
    "preprocessed_shape",
    "preprocessed_spacing",
    "make_split",
    "write_split",
    "read_split",
    "split_parts",
    "fold_parts",
    "development_cases",
    "synthesize_dataset",
    "convert_to_tfrecords",
    "read_manifest",
    "verify_checksums",
    "make_dataset",
    "iter_cases",
    "inspect_dataset",
    "format_inspection",
    "summarize_dataset",
    "format_summary",
    "DatasetSummary",
]
