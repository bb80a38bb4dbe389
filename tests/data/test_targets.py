"""Target schemes: what the output channels of a label mode mean on a data set, and back to label values."""

from __future__ import annotations

import numpy as np
import pytest

from distmis.data.dataset_layouts import layout_description
from distmis.data.description import DatasetDescription, Region
from distmis.data.errors import DataError
from distmis.data.targets import (
    channel_masks, foreground, label_channels, metric_keys, probabilities_to_labels, target_scheme,
)

CT = DatasetDescription(layout="msd", channels=("CT",),
                        classes=(("background", 0), ("liver", 1), ("spleen", 2), ("left kidney", 5)))
REGIONS = DatasetDescription(
    layout="nnunet", channels=("T1", "T1ce", "T2", "FLAIR"),
    classes=(("background", 0), ("whole tumor", 1), ("tumor core", 2), ("enhancing tumor", 3)),
    regions=(Region("whole tumor", (1, 2, 3), 1), Region("tumor core", (2, 3), 2), Region("enhancing tumor", (3,), 3)))


def test_classes_are_one_hot_with_background_and_named_by_the_data_set():
    targets = target_scheme(CT, "classes")
    assert targets["activation"] == "softmax" and targets["mode"] == "classes"
    assert [c["name"] for c in targets["channels"]] == ["background", "liver", "spleen", "left kidney"]
    assert metric_keys(targets) == ["liver", "spleen", "left_kidney"]
    label = np.array([0, 1, 2, 5, 5, 0], np.int16).reshape(1, 2, 3)
    onehot = label_channels(label, targets)
    assert onehot.shape == (1, 2, 3, 4) and (onehot.sum(-1) == 1).all()
    np.testing.assert_array_equal(np.argmax(onehot, -1), [[[0, 1, 2], [3, 3, 0]]])
    # a prediction is the argmax, written back in the data set's values (5, not 3)
    np.testing.assert_array_equal(probabilities_to_labels(onehot.astype(np.float32), targets), label)


def test_softmax_masks_are_the_argmax_and_sigmoid_masks_the_threshold():
    softmax = {"mode": "classes", "activation": "softmax", "channels": [{}, {}, {}]}
    prob = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    np.testing.assert_array_equal(channel_masks(prob, softmax), [[False, True, False], [True, False, False]])
    sigmoid = {"mode": "regions", "activation": "sigmoid", "channels": [{}, {}, {}]}
    np.testing.assert_array_equal(channel_masks(prob, sigmoid), [[False, True, False], [True, False, False]])
    np.testing.assert_array_equal(channel_masks(prob, sigmoid, threshold=0.25), [[False, True, True], [True, False, True]])


def test_nnunet_regions_map_to_region_channels_under_their_own_names():
    targets = target_scheme(REGIONS, "regions")
    assert targets["activation"] == "sigmoid"
    assert metric_keys(targets) == ["whole_tumor", "tumor_core", "enhancing_tumor"]
    label = np.array([0, 1, 2, 3], np.int16).reshape(1, 1, 4)
    channels = label_channels(label, targets)
    np.testing.assert_array_equal(channels[0, 0], [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    # painted in regions_class_order: the inner region wins
    np.testing.assert_array_equal(probabilities_to_labels(channels.astype(np.float32), targets), label)
    assert foreground(targets) == targets["channels"]


def test_whole_tumour_is_every_label_and_brain_layouts_keep_wt_tc_et():
    whole = target_scheme(CT, "whole-tumour")
    assert [c["key"] for c in whole["channels"]] == ["WT"] and whole["channels"][0]["values"] == [1, 2, 5]
    brats = target_scheme(layout_description("brats"), "regions")
    assert metric_keys(brats) == ["WT", "TC", "ET"]
    assert [c["paint"] for c in brats["channels"]] == [2, 1, 4]


def test_a_label_mode_that_does_not_fit_the_labels_is_refused_naming_them():
    with pytest.raises(DataError, match=r"region-based.*'whole tumor'.*use labels: regions"):
        target_scheme(REGIONS, "classes")
    with pytest.raises(DataError, match=r"'liver': 1.*use labels: classes"):
        target_scheme(CT, "regions")


def test_a_label_value_outside_the_scheme_is_refused():
    with pytest.raises(ValueError, match=r"label values \[7\]"):
        label_channels(np.array([[[0, 7]]], np.int16), target_scheme(CT, "classes"))


def test_label_values_above_255_are_written_as_uint16():
    description = DatasetDescription(layout="msd", channels=("CT",), classes=(("background", 0), ("vessel", 300)))
    targets = target_scheme(description, "classes")
    labels = probabilities_to_labels(np.array([[[[0.1, 0.9], [0.8, 0.2]]]]), targets)
    assert labels.dtype == np.uint16 and labels.tolist() == [[[300, 0]]]
