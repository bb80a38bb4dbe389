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


def test_a_bf16_trial_is_scored_as_its_published_model_predicts(tmp_path):
    """A torch trial trained under ``training.precision: bf16`` (autocast over fp32 master weights) is published as
    an fp32 program: its recorded test scores are those of that program, the published model's own probabilities
    scored the same way, not those of a bf16 forward. The trainer that scores it only predicts: it times no training
    step to choose a memory format or a compilation (``training.performance: auto`` in the spec)."""
    import contextlib

    import pandas as pd

    from distmis.parallel.mesh import TrialMesh
    from distmis.predict.model import SegmentationModel
    from distmis.search.evaluate import BestModel, loaded_trainer
    from distmis.search.publish import publish_model
    from distmis.trial.trainers import build_trainer
    from distmis.spec.layout import resolve_trial

    data = make_classes_data(tmp_path)
    tree = data.spec_tree(name="unet3d", framework="torch", params={"base_filters": 4, "levels": 2})
    tree["training"]["precision"] = "bf16"
    spec = validate_spec(tree)
    prepared = SimpleNamespace(tfrecord_dir=data.tfrecord_dir, manifest=data.manifest, split=data.split)
    trial, layout = resolve_trial(spec, {})
    trained = build_trainer(trial, layout, data.tfrecord_dir, mesh=TrialMesh.local(layout))
    assert trained.precision.mixed  # the trial itself computed in bf16
    trained.save(tmp_path / "best")  # its best weights: the fp32 master weights
    weights = SimpleNamespace(as_directory=lambda: contextlib.nullcontext(tmp_path / "best"))
    best = BestModel("t_00000", {}, 0.5, weights)
    spacings = {case: (1.0, 1.0, 1.0) for case in data.split["test"]}

    assert (spec.training.performance.memory_format, spec.training.performance.compile) == ("auto", "auto")
    with loaded_trainer(best, spec, prepared) as trainer:
        assert not trainer.precision.mixed
        assert (trainer.memory_format.source, trainer.memory_format.memory_format) == ("set", "contiguous")
        assert (trainer.compile.source, trainer.compile.compiled) == ("set", False)
        recorded = evaluate_on_test(trainer, spec, prepared, "t_00000", spacings)
        published = publish_model([trainer], best, spec, prepared, tracking_uri="", trial_run_id=None,
                                  search_run_id="", evaluation=recorded, folder=tmp_path / "model", register=False)
    model = SegmentationModel.load(published.folder)
    predicted = evaluate_on_test(SimpleNamespace(predict_volume=model.probabilities), spec, prepared, "t_00000",
                                 spacings)
    assert recorded is not None and predicted is not None
    pd.testing.assert_frame_equal(recorded.cases, predicted.cases, check_exact=False, rtol=1e-6)


def test_a_mirrored_trial_is_scored_both_with_and_without_mirroring(tmp_path):
    """``training.inference.mirror`` non-empty: the test split is predicted as the model predicts (mirrored on those
    axes) and again without mirroring; both scores are recorded (``..._nomirror``), with each way's seconds a case."""
    data = make_classes_data(tmp_path)
    tree = data.spec_tree()
    tree["training"]["inference"] = {"mirror": [2, 0, 1]}
    spec = validate_spec(tree)
    prepared = SimpleNamespace(tfrecord_dir=data.tfrecord_dir, manifest=data.manifest, split=data.split)
    from distmis.data.tfrecord import iter_cases

    (case_id, _, label), = list(iter_cases(data.tfrecord_dir, "test"))
    soft = 0.1 + 0.6 * label.astype(np.float32)
    perfect = soft / soft.sum(axis=-1, keepdims=True)
    background = np.full(label.shape, 0.2, np.float32)
    background[..., 0] = 0.4
    asked: list[tuple[int, ...]] = []

    def predict_volume(image, *, mirror=()):
        asked.append(tuple(mirror))
        return perfect if mirror else background  # mirrored: the truth; unmirrored: background everywhere

    evaluation = evaluate_on_test(SimpleNamespace(predict_volume=predict_volume), spec, prepared, "t_00000",
                                  {case_id: (1.0, 1.0, 1.0)})
    assert evaluation is not None and asked == [(0, 1, 2), ()] and evaluation.mirror == (0, 1, 2)
    means = evaluation.means
    for key in CLASS_KEYS:
        assert means[f"test_dice_{key}"] == 1.0 and means[f"test_dice_{key}_nomirror"] == 0.0
    assert means["test_dice_mean"] == 1.0 and means["test_dice_mean_nomirror"] == 0.0
    assert means["test_seconds_per_case"] >= 0 and means["test_seconds_per_case_nomirror"] >= 0
    assert evaluation.regions == list(CLASS_KEYS)  # the unmirrored scores are not regions of their own
    summary = evaluation.summary()
    assert "mirrored on axes 0, 1, 2" in summary and "without mirroring" in summary
    assert "mean dice 1.0000" in summary and "mean dice 0.0000" in summary

    tree["training"]["inference"] = {}  # off: one prediction a case, as before, nothing more recorded
    asked.clear()
    plain = evaluate_on_test(SimpleNamespace(predict_volume=predict_volume), validate_spec(tree), prepared,
                             "t_00000", {case_id: (1.0, 1.0, 1.0)})
    assert plain is not None and asked == [()] and plain.unmirrored is None
    assert not any(k.endswith("_nomirror") or "seconds" in k for k in plain.means)


def test_a_mirrored_trial_is_scored_as_its_published_model_predicts(tmp_path):
    """A torch trial with ``training.inference.mirror: [0, 1, 2]``: its trainer's mirrored probabilities are the
    published model's (which mirrors by default), its unmirrored ones the model's with ``mirror=[]``, and the
    recorded scores of both are those of the published model."""
    import contextlib

    import pandas as pd

    from distmis.data.tfrecord import iter_cases
    from distmis.parallel.mesh import TrialMesh
    from distmis.predict.model import SegmentationModel
    from distmis.search.evaluate import BestModel, loaded_trainer
    from distmis.search.publish import publish_model
    from distmis.spec.layout import resolve_trial
    from distmis.trial.trainers import build_trainer

    data = make_classes_data(tmp_path)
    tree = data.spec_tree(name="unet3d", framework="torch", params={"base_filters": 4, "levels": 2})
    tree["training"]["inference"] = {"mirror": [0, 1, 2]}
    spec = validate_spec(tree)
    prepared = SimpleNamespace(tfrecord_dir=data.tfrecord_dir, manifest=data.manifest, split=data.split)
    trial, layout = resolve_trial(spec, {})
    build_trainer(trial, layout, data.tfrecord_dir, mesh=TrialMesh.local(layout)).save(tmp_path / "best")
    weights = SimpleNamespace(as_directory=lambda: contextlib.nullcontext(tmp_path / "best"))
    best = BestModel("t_00000", {}, 0.5, weights)
    spacings = {case: (1.0, 1.0, 1.0) for case in data.split["test"]}
    _, image, _ = next(iter(iter_cases(data.tfrecord_dir, "test")))

    with loaded_trainer(best, spec, prepared) as trainer:
        recorded = evaluate_on_test(trainer, spec, prepared, "t_00000", spacings)
        published = publish_model([trainer], best, spec, prepared, tracking_uri="", trial_run_id=None,
                                  search_run_id="", evaluation=recorded, folder=tmp_path / "model", register=False)
        mirrored, plain = trainer.predict_volume(image, mirror=(0, 1, 2)), trainer.predict_volume(image)
    model = SegmentationModel.load(published.folder)
    assert model.mirror == (0, 1, 2)
    np.testing.assert_allclose(model.probabilities(image), mirrored, atol=1e-5)
    np.testing.assert_allclose(model.probabilities(image, mirror=[]), plain, atol=1e-5)
    assert np.abs(mirrored - plain).max() > 1e-4  # random weights: not symmetric
    predicted = evaluate_on_test(SimpleNamespace(predict_volume=model.probabilities), spec, prepared, "t_00000",
                                 spacings)
    assert recorded is not None and predicted is not None and recorded.unmirrored is not None
    pd.testing.assert_frame_equal(recorded.cases, predicted.cases, check_exact=False, rtol=1e-6)
    pd.testing.assert_frame_equal(recorded.unmirrored.cases, predicted.unmirrored.cases, check_exact=False, rtol=1e-6)
