"""Publishing a search's model: the local copy does not depend on the tracking store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from distmis.models.unet3d_torch import UNet3D
from distmis.predict.model import SegmentationModel
from distmis.search.evaluate import BestModel, publish_model
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


def test_a_store_that_fails_costs_the_registration_not_the_model(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 2}}
    spec = validate_spec(tree)
    trainer = SimpleNamespace(spec=spec, model=UNet3D(in_channels=4, num_classes=1, base_filters=4, levels=2).eval())
    data = SimpleNamespace(manifest={"preprocess": {"layout": "msd", "labels": "whole-tumour", "crop": None,
                                                    "resize": None},
                                     "image_shape": [16, 16, 16, 4], "num_classes": 1})
    unreachable = tmp_path / "not-a-folder"
    unreachable.write_text("a file where the store's folder would be")
    published = publish_model([trainer], BestModel("t_00000", {}, 0.5, None), spec, data,
                              tracking_uri=f"sqlite:///{unreachable / 'mlflow.db'}", trial_run_id="0" * 32,
                              search_run_id="1" * 32, evaluation=None, folder=tmp_path / "out" / "model",
                              register=True)
    assert published.folder == tmp_path / "out" / "model" and published.model_uri is None and published.error
    assert SegmentationModel.load(published.folder).recipe.framework == "torch"  # usable all the same
