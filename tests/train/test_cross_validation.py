"""Cross-validation in the trainers: a trial of fold i (``dataset.split.fold``) trains on the other folds and
validates on fold i, in the torch and the TensorFlow trainer, and a kept TensorFlow trainer restarted for another
fold reads that fold's cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from distmis.data.manifest import DataManifest
from distmis.data.split import make_split
from distmis.data.tfrecord import iter_cases
from distmis.search.prepare import _conversion_key, prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_layout
from distmis.spec.load import apply_config
from distmis.train.epoch import TrialParts, trial_parts
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """8 synthetic cases of 16^3: 2 test cases and 3 folds of 2."""
    tmp = tmp_path_factory.mktemp("folds")
    tree = small_spec_tree(tmp / "data")
    tree["dataset"]["synthetic"]["cases"] = 8
    tree["dataset"]["split"] = {"test": 0.25, "seed": 0, "folds": 3}
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False)


def trial_of(spec, fold: int):
    """The spec of fold ``fold``'s trial: its trial config's ``dataset.split.fold``, applied as the search does."""
    trial = apply_config(spec, {"dataset.split.fold": fold})
    assert trial.dataset.split.fold == fold and spec.dataset.split.fold is None
    return trial


def stored_images(data) -> dict[str, np.ndarray]:
    return {c: image for c, image, _ in iter_cases(data.tfrecord_dir, ["fold0", "fold1", "fold2"])}


def case_ids_of(batches, stored: dict[str, np.ndarray]) -> list[str]:
    ids = []
    for x, _ in batches:
        for image in np.asarray(x):
            (case_id,) = [c for c, s in stored.items() if np.array_equal(s, image)]
            ids.append(case_id)
    return ids


def test_prepare_data_writes_the_folds(prepared):
    spec, data = prepared
    folds = data.split["folds"]
    assert [len(f) for f in folds] == [2, 2, 2] and len(data.split["test"]) == 2
    assert list(data.manifest.splits) == ["fold0", "fold1", "fold2", "test"]
    assert data.manifest.split["folds"] == folds
    ids = sorted(c for f in folds for c in f) + data.split["test"]
    assert len(set(ids)) == 8
    assert data.split == make_split(ids, test=0.25, seed=0, folds=3)


def test_a_fold_split_and_a_plain_one_never_share_a_folder(prepared):
    from distmis.data.layouts import Layout, discover_cases
    from distmis.data.preprocess import PreprocessConfig

    spec, data = prepared
    cases = discover_cases(spec.dataset.path, Layout("msd"))
    config = PreprocessConfig(layout="msd", labels="whole-tumour")
    ids = [c.case_id for c in cases]
    folded = make_split(ids, test=0.25, seed=0, folds=3)
    plain = make_split(ids, train=0.5, val=0.25, test=0.25, seed=0)
    assert _conversion_key(cases, config, folded) != _conversion_key(cases, config, plain)
    assert _conversion_key(cases, config, folded) != _conversion_key(cases, config, make_split(ids, test=0.25, seed=0,
                                                                                          folds=2))
    assert _conversion_key(cases, config, folded) == _conversion_key(cases, config, dict(folded))


def test_trial_parts_of_each_fold_and_the_mismatches(prepared):
    spec, data = prepared
    manifest, where = data.manifest, data.tfrecord_dir
    assert trial_parts(manifest, 1, where) == TrialParts(("fold0", "fold2"), ("fold1",), 4)
    assert trial_parts(manifest, 0, where).val == ("fold0",)
    with pytest.raises(ValueError, match=f"{where}: the split has 3 cross-validation folds, but no fold"):
        trial_parts(manifest, None, where)
    with pytest.raises(ValueError, match=r"fold 3 is not one of the split's 3 folds \(0 to 2\)"):
        trial_parts(manifest, 3, where)
    plain = DataManifest(preprocess={}, image_shape=(4, 4, 4, 1), label_shape=(4, 4, 4, 1),
                         split={"train": ["a"], "val": ["b"], "test": []},
                         splits={"train": {"num_cases": 1}, "val": {"num_cases": 1}, "test": {"num_cases": 0}})
    assert trial_parts(plain, None) == TrialParts(("train",), ("val",), 1)
    with pytest.raises(ValueError, match="dataset.split.fold is 1, but the split has no folds"):
        trial_parts(plain, 1)
    with pytest.raises(ValueError, match=r"the manifest has no part 'fold1' \(it has \['fold0', 'test'\]\)"):
        trial_parts(replace(manifest, splits={k: manifest.splits[k] for k in ("fold0", "test")}), 0, where)


def test_a_torch_trial_trains_on_the_other_folds_and_validates_on_its_own(prepared):
    spec, data = prepared
    folds = data.split["folds"]
    trainer = local_trainer(trial_of(spec, 1), data.tfrecord_dir)
    assert trainer.val_cases.case_ids == folds[1]
    assert trainer.train_cases.case_ids == folds[0] + folds[2]
    assert np.isfinite(trainer.run_epoch(1).val_dice)
    other = local_trainer(trial_of(spec, 2), data.tfrecord_dir)
    assert other.val_cases.case_ids == folds[2] and other.train_cases.case_ids == folds[0] + folds[1]
    with pytest.raises(ValueError, match="cross-validation folds, but no fold to validate on"):
        local_trainer(spec, data.tfrecord_dir)  # a fold folder, and no fold


def test_a_tensorflow_trial_and_its_restart_read_their_folds(prepared):
    from distmis.train.tf_unet import UNetTrainer, graph_key

    spec, data = prepared
    folds = data.split["folds"]
    stored = stored_images(data)
    one, two = trial_of(spec, 1), trial_of(spec, 2)
    trainer = UNetTrainer(one, data.tfrecord_dir, layout=resolve_layout(one))
    assert trainer.val_cases.case_ids == folds[1]
    assert sorted(case_ids_of(trainer.train_data, stored)) == sorted(folds[0] + folds[2])
    assert trainer.steps_per_epoch == 2  # 4 training cases in batches of 2
    assert np.isfinite(trainer.run_epoch(1).val_dice)
    # the worker group keeps a trainer per graph_key: another fold has the same graphs, and its restart reads its fold
    assert graph_key(one) == graph_key(two)
    trainer.restart(two, resolve_layout(two))
    assert trainer.val_cases.case_ids == folds[2]
    assert sorted(case_ids_of(trainer.train_data, stored)) == sorted(folds[0] + folds[1])
    assert np.isfinite(trainer.run_epoch(1).val_dice)
    with pytest.raises(ValueError, match="no fold to validate on"):
        UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec))
