"""The test split scored per foreground class of a ``classes`` data set, named by the data set
(``test_dice_<key>``, ``test_hd95_<key>``), from the argmax of the prediction's softmax."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from distmis.search.evaluate import evaluate_on_test
from distmis.spec import validate_spec
from tests.train.classes_data import CLASS_KEYS, make_classes_data


def test_the_test_split_is_scored_per_class(tmp_path):
    from distmis.data.tfrecord import iter_cases

    data = make_classes_data(tmp_path)
    spec = validate_spec(data.spec_tree())
    (case_id, _, label), = list(iter_cases(data.tfrecord_dir, "test"))
    prepared = SimpleNamespace(tfrecord_dir=data.tfrecord_dir, manifest=data.manifest, split=data.split)
    spacing = {case_id: (1.5, 1.0, 2.0)}

    def scores(prob: np.ndarray) -> dict[str, float]:
        trainer = SimpleNamespace(predict_volume=lambda image: prob)
        evaluation = evaluate_on_test(trainer, spec, prepared, "t_00000", spacing)
        assert evaluation is not None and evaluation.regions == list(CLASS_KEYS)
        return evaluation.means

    # The truth itself, as soft probabilities whose argmax it is: every class found where it is
    soft = 0.1 + 0.6 * label.astype(np.float32)
    perfect = scores(soft / soft.sum(axis=-1, keepdims=True))
    assert perfect == {**{f"test_dice_{k}": 1.0 for k in CLASS_KEYS}, **{f"test_hd95_{k}": 0.0 for k in CLASS_KEYS},
                       "test_dice_mean": 1.0, "test_hd95_mean": 0.0}
    # Background everywhere (its probability only 0.4, yet the argmax): every class present in the truth missed
    background = np.full(label.shape, 0.2, np.float32)
    background[..., 0] = 0.4
    missed = scores(background)
    diagonal = math.sqrt((16 * 1.5) ** 2 + 16 ** 2 + (16 * 2.0) ** 2)
    for key, present in zip(CLASS_KEYS, label[..., 1:].reshape(-1, 3).any(axis=0)):
        assert present  # the synthetic case holds every organ
        assert missed[f"test_dice_{key}"] == 0.0 and missed[f"test_hd95_{key}"] == pytest.approx(diagonal)
