"""Mutually exclusive classes (``dataset.labels: classes``) in every trainer: a softmax output, the dice-ce loss, and
each foreground class's validation dice reported as ``val_dice_<key>``, ``val_dice`` their mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmis.spec import validate_spec
from tests.train.classes_data import CLASS_KEYS, ClassesData, make_classes_data

VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 1, "embed_dim": 16, "heads": 2, "patch": 4, "decoder_features": 8}}


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> ClassesData:
    return make_classes_data(tmp_path_factory.mktemp("classes"))


def check_reported(metrics: dict) -> None:
    """Every foreground class's dice, named by the data set, after val_dice; val_dice their mean."""
    keys = [f"val_dice_{key}" for key in CLASS_KEYS]
    names = list(metrics)
    assert names[names.index("val_dice") + 1 : names.index("val_dice") + 4] == keys
    assert "val_dice_background" not in metrics
    assert all(0.0 <= metrics[key] <= 1.0 for key in keys)
    assert metrics["val_dice"] == pytest.approx(np.mean([metrics[key] for key in keys]), abs=1e-12)
    assert np.isfinite(metrics["train_loss"]) and np.isfinite(metrics["val_loss"])


def check_probabilities(trainer) -> None:
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape == (16, 16, 16, 4) and prob.min() >= 0
    np.testing.assert_allclose(prob.sum(axis=-1), 1.0, atol=1e-5)  # a softmax over background and the classes


def test_the_data_is_one_hot_with_its_background(classes):
    from distmis.data.cases import SplitCases

    assert classes.manifest.num_classes == 4
    _, _, label = SplitCases(classes.tfrecord_dir, "val", manifest=classes.manifest)[0]
    assert label.shape == (16, 16, 16, 4) and (label.sum(axis=-1) == 1).all()


def test_the_torch_unet_trains_a_softmax_and_reports_every_class(classes):
    from tests.train.torch_trainers import local_trainer

    tree = classes.spec_tree(name="unet3d", framework="torch", params={"base_filters": 4, "levels": 3})
    trainer = local_trainer(validate_spec(tree), classes.tfrecord_dir)
    assert trainer.model.activation == "softmax" and trainer.metric_keys == list(CLASS_KEYS)
    check_reported(trainer.run_epoch(1).as_dict())
    check_probabilities(trainer)


def test_the_tensorflow_unet_trains_a_softmax_and_reports_every_class(classes):
    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    tree = classes.spec_tree(name="unet3d", framework="tensorflow", params={"base_filters": 4, "levels": 3})
    spec = validate_spec(tree)
    trainer = UNetTrainer(spec, classes.tfrecord_dir, layout=resolve_layout(spec))
    assert trainer.model.get_layer("head").get_config()["activation"] == "softmax"
    check_reported(trainer.run_epoch(1).as_dict())
    check_probabilities(trainer)


def test_vit_seg_trains_on_logits_and_reports_every_class(classes):
    from tests.train.torch_trainers import local_trainer

    tree = classes.spec_tree(**VIT)
    tree["training"]["tile"] = [8, 8, 8]
    trainer = local_trainer(validate_spec(tree), classes.tfrecord_dir)
    x, y = trainer._batch([0, 1])
    from monai.losses import DiceCELoss

    logits = trainer.model(x)
    expected = DiceCELoss(softmax=True, include_background=False, smooth_nr=1.0, smooth_dr=1.0)(logits, y)
    torch.testing.assert_close(trainer.train_loss_fn(logits, y), expected)  # MONAI's, on the logits
    check_reported(trainer.run_epoch(1).as_dict())
    check_probabilities(trainer)


def test_tiles_centred_on_foreground_find_a_class_not_the_background(classes):
    from tests.train.torch_trainers import local_trainer

    tree = classes.spec_tree(name="unet3d", framework="torch", params={"base_filters": 4, "levels": 3})
    tree["training"].update({"tile": [4, 4, 4], "tile_sampling": 1.0})  # uniform 4^3 tiles: 1 in 5 holds an organ
    trainer = local_trainer(validate_spec(tree), classes.tfrecord_dir)
    crops = [trainer._training_sample(index, epoch=0)[1] for _ in range(10) for index in range(3)]
    assert all(crop.shape == (4, 4, 4, 4) and crop[1:].any() for crop in crops)  # every tile holds an organ


#: MONAI's networks at a 16^3 input (SwinUNETR needs 32: the architecture search trains it), each small; their
#: logits go through the one trainer's softmax and dice-ce from logits, as any registered network's.
MONAI_NETWORKS = {
    "segresnet": {"init_filters": 8, "blocks_down": [1, 1, 1], "blocks_up": [1, 1]},
    "unetr": {"feature_size": 8, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4, "norm_name": "batch"},  # no 1-voxel map
    "dynunet": {"filters": [4, 8, 16]},  # kernels and strides planned from the 16^3 input
    "basicunet": {"features": [4, 4, 8, 8, 16, 4], "norm": ["group", {"num_groups": 2}]},
}


@pytest.mark.parametrize("name", list(MONAI_NETWORKS))
def test_a_monai_network_trains_a_softmax_and_reports_every_class(classes, name: str):
    from tests.train.torch_trainers import local_trainer

    tree = classes.spec_tree(name=name, framework="torch", params=MONAI_NETWORKS[name])
    trainer = local_trainer(validate_spec(tree), classes.tfrecord_dir)
    assert trainer.entry.output == "logits" and trainer.activation == "softmax"
    assert trainer.metric_keys == list(CLASS_KEYS)
    check_reported(trainer.run_epoch(1).as_dict())
    check_probabilities(trainer)
