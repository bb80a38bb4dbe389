from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distmis.data import DataError
from distmis.search.input_fit import check_dataset_path, check_tile_fits
from distmis.search.prepare import prepare_data
from distmis.spec import SpecError, validate_spec
from distmis.spec.schema import Spec
from tests.conftest import small_spec_tree
from tests.data.conftest import write_nifti


def test_prepare_generates_converts_and_reuses(tmp_path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    first = prepare_data(spec, tmp_path / "out", progress=False)
    assert first.generated and (first.tfrecord_dir / "manifest.json").is_file()
    assert first.manifest.image_shape == (16, 16, 16, 4) and first.manifest.volume == (16, 16, 16)
    assert sorted(first.split["train"] + first.split["val"] + first.split["test"]) == [f"BRATS_{i:03d}" for i in range(1, 7)]
    mtime = (first.tfrecord_dir / "manifest.json").stat().st_mtime_ns
    second = prepare_data(spec, tmp_path / "out", progress=False)
    assert not second.generated and second.tfrecord_dir == first.tfrecord_dir
    assert (second.tfrecord_dir / "manifest.json").stat().st_mtime_ns == mtime  # reused, not rewritten
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"]["seed"] = 1
    assert prepare_data(validate_spec(tree), tmp_path / "out", progress=False).tfrecord_dir != first.tfrecord_dir


def test_shape_checked_against_real_data(tmp_path):
    prepare_data(validate_spec(small_spec_tree(tmp_path / "data")), tmp_path / "out", progress=False)
    # The dataset now exists, so the spec alone no longer fixes the volume shape; the data does.
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["params"]["levels"] = 6  # 16 does not divide by 32
    with pytest.raises(SpecError, match="divide by 32"):
        prepare_data(validate_spec(tree), tmp_path / "out", progress=False)


def test_too_few_cases_for_the_split(tmp_path):
    from distmis.data import synthesize_dataset

    synthesize_dataset(tmp_path / "data", "msd", cases=1, shape=(16, 16, 16), progress=False)
    tree = small_spec_tree(tmp_path / "data")
    del tree["dataset"]["synthetic"]
    with pytest.raises(DataError, match="dataset.split.*too few cases"):
        prepare_data(validate_spec(tree), tmp_path / "out", progress=False)


# --------------------------------------------------------------------------- tile against the data's shapes
def msd_dataset(root: Path, shapes: dict[str, tuple[int, int, int]]) -> Path:
    """A real MSD folder (dataset.json, imagesTr/, labelsTr/) of NIfTI cases with the given spatial shapes."""
    rng = np.random.default_rng(0)
    training = []
    for case_id, shape in shapes.items():
        image = np.zeros((*shape, 4), np.float32)
        image[1:-1, 1:-1, 1:-1] = rng.uniform(1, 100, (shape[0] - 2, shape[1] - 2, shape[2] - 2, 4))
        label = np.zeros(shape, np.uint8)
        label[2:5, 2:5, 2:5] = 1
        write_nifti(root / "imagesTr" / f"{case_id}.nii.gz", image)
        write_nifti(root / "labelsTr" / f"{case_id}.nii.gz", label)
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({
        "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
        "training": training}))
    return root


def real_data_tree(root: Path, tile: list[int] | None, **dataset: object) -> dict:
    """The small spec over the real folder ``root`` (no synthetic section), with ``training.tile``."""
    tree = small_spec_tree(root)
    del tree["dataset"]["synthetic"]
    tree["dataset"].update(dataset)
    tree["training"]["tile"] = tile
    return tree


FOUR_CASES = {"BRATS_001": (16, 16, 16), "BRATS_002": (16, 16, 16), "BRATS_003": (16, 16, 12),
              "BRATS_004": (16, 16, 16)}
SHORT_CASES = {f"BRATS_00{i}": (16, 16, 12) for i in range(1, 5)}


def test_oversized_tile_refused_before_anything_is_written(tmp_path):
    from distmis.search.run import run_search

    data = msd_dataset(tmp_path / "data", SHORT_CASES)
    spec = validate_spec(real_data_tree(data, [16, 16, 16]))  # the spec alone cannot tell: the data decides
    with pytest.raises(SpecError) as info:
        check_dataset_path(spec)
    assert info.value.source == f"tiny (with the data at {data})"
    (path, message), = info.value.problems
    assert path == "training.tile"
    assert message.startswith("[16, 16, 16] is larger than the preprocessed volume [16, 16, 12] of case file "
                              f"'{data / 'imagesTr' / 'BRATS_001.nii.gz'}' (stored shape [16, 16, 12], "
                              "no dataset.crop or dataset.resize); a tile must be at most the volume in every "
                              "dimension (here <= [16, 16, 12])")
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    for out in (new, existing):
        with pytest.raises(SpecError, match=r"training\.tile: \[16, 16, 16\] is larger"):
            run_search(spec, out, progress=False)  # refused before Ray starts or any data is converted
    assert not new.exists() and list(existing.iterdir()) == []
    assert not list(tmp_path.rglob("*.tfrecord*")) and not list(tmp_path.rglob("manifest.json"))


def test_the_case_too_small_is_named(tmp_path):
    data = msd_dataset(tmp_path / "data", FOUR_CASES)
    with pytest.raises(SpecError) as info:
        check_dataset_path(validate_spec(real_data_tree(data, [16, 16, 16])))
    (path, message), = info.value.problems
    assert path == "training.tile" and "larger than the preprocessed volume [16, 16, 12]" in message
    assert str(data / "imagesTr" / "BRATS_003.nii.gz") in message  # the one case that is too small


def test_fitting_tile_passes_and_converts(tmp_path):
    data = msd_dataset(tmp_path / "data", SHORT_CASES)
    spec = validate_spec(real_data_tree(data, [16, 8, 12]))
    check_dataset_path(spec)  # fits exactly in one dimension: allowed
    prepared = prepare_data(spec, tmp_path / "out", progress=False)
    assert prepared.manifest.image_shape == (16, 16, 12, 4)


def test_crop_and_resize_are_applied_as_the_preprocessing_does(tmp_path):
    data = msd_dataset(tmp_path / "data", FOUR_CASES)
    # The crop pads BRATS_003's 12 slices to 16, so a 16-slice tile fits; resize then shrinks every case.
    check_dataset_path(validate_spec(real_data_tree(data, [16, 16, 16], crop=[16, 16, 16])))
    spec = Spec.model_validate(real_data_tree(data, [16, 16, 16], crop=[16, 16, 16], resize=[8, 8, 8]))
    with pytest.raises(SpecError) as info:  # (the spec's own checks refuse this too; the data check agrees)
        check_tile_fits(spec)
    assert "larger than the preprocessed volume [8, 8, 8]" in str(info.value)
    assert "stored shape [16, 16, 16] -> dataset.crop [16, 16, 16] -> dataset.resize [8, 8, 8]" in str(info.value)


def test_every_searched_tile_is_checked(tmp_path):
    data = msd_dataset(tmp_path / "data", FOUR_CASES)
    tree = real_data_tree(data, [8, 8, 8])
    tree["search"]["space"] = {"training.tile": {"grid": [[8, 8, 8], [16, 16, 16], [8, 16, 4]]}}
    with pytest.raises(SpecError) as info:
        check_dataset_path(validate_spec(tree))
    (path, message), = info.value.problems  # [8, 8, 8] and [8, 16, 4] fit
    assert path == "search.space.training.tile"
    assert message.startswith("value [16, 16, 16] makes training.tile [16, 16, 16], which is larger than the "
                              "preprocessed volume [16, 16, 12]")


def test_synthetic_dataset_not_generated_yet_uses_its_shape(tmp_path):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["tile"] = [16, 16, 32]
    spec = Spec.model_validate(tree)  # past the spec's own checks, which refuse it already
    with pytest.raises(SpecError, match=r"\[16, 16, 32\] is larger than the preprocessed volume \[16, 16, 16\] "
                                        r"of the synthetic cases dataset.synthetic will generate"):
        check_tile_fits(spec)
    assert not (tmp_path / "data").exists()  # nothing generated
    tree["training"]["tile"] = [16, 16, 16]
    check_tile_fits(Spec.model_validate(tree))


def test_unreadable_shapes_are_left_to_the_later_checks(tmp_path):
    data = msd_dataset(tmp_path / "data", FOUR_CASES)
    (data / "imagesTr" / "BRATS_001.nii.gz").write_bytes(b"not a nifti file")
    spec = validate_spec(real_data_tree(data, [32, 32, 32]))
    check_tile_fits(spec)  # the first header is unreadable: no shapes, no verdict (conversion reports the file)
    (data / "dataset.json").unlink()
    check_tile_fits(spec)  # no cases to read: discovery reports it when the data is prepared


# --------------------------------------------------------------------------- a data set's own description
@pytest.fixture(scope="module")
def ct_nnunet(tmp_path_factory) -> Path:
    from distmis.data.synthetic import synthesize_dataset

    root = tmp_path_factory.mktemp("ct") / "data"
    synthesize_dataset(root, "nnunet", cases=4, shape=(24, 24, 16), seed=2, kind="ct", lps_cases=1, progress=False)
    return root


def ct_tree(root: Path, **dataset: object) -> dict:
    tree = small_spec_tree(root)
    tree["dataset"] = {"path": str(root), "layout": "nnunet", "labels": "classes", "crop": [24, 24, 24],
                       "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}, **dataset}
    return tree


def test_a_dataset_json_missing_a_key_is_refused_before_anything_naming_the_key(ct_nnunet: Path, tmp_path: Path):
    broken = tmp_path / "broken"
    broken.mkdir()
    meta = json.loads((ct_nnunet / "dataset.json").read_text())
    del meta["file_ending"]
    (broken / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"dataset.json.*'file_ending'"):
        check_dataset_path(validate_spec(ct_tree(broken)))


def test_a_label_mode_or_channel_the_data_set_does_not_have_is_refused_before_anything(ct_nnunet: Path):
    with pytest.raises(DataError, match=r"'regions'.*'liver': 1.*use labels: classes"):
        check_dataset_path(validate_spec(ct_tree(ct_nnunet, labels="regions")))
    with pytest.raises(SpecError, match=r"no channel 'T1'.*\['CT'\]"):
        check_dataset_path(validate_spec(ct_tree(ct_nnunet, normalization={"T1": "zscore"})))
    check_dataset_path(validate_spec(ct_tree(ct_nnunet, normalization={"ct": "zscore"})))  # names match any case


def test_the_tile_is_checked_against_the_resampled_and_reoriented_volumes(ct_nnunet: Path):
    from distmis.search.input_fit import preprocessed_volumes

    tree = ct_tree(ct_nnunet, orientation="RAS", spacing=[2.0, 2.0, 2.0])
    tree["dataset"].pop("crop")
    shapes = [v.shape for v in preprocessed_volumes(validate_spec(tree))]
    # 24 x 24 x 16 voxels at 0.7-1.0 mm in-plane and 1.5-3.0 mm between slices: about half as many at 2 mm in-plane
    assert len(shapes) == 4 and all(8 <= s[0] <= 12 and 8 <= s[1] <= 12 for s in shapes), shapes
    tree["training"]["tile"] = [16, 16, 16]
    with pytest.raises(SpecError, match=r"larger than the preprocessed volume.*dataset.spacing \[2.0, 2.0, 2.0\] mm"):
        check_dataset_path(validate_spec(tree))


def test_one_class_can_be_the_search_metric_if_the_data_set_has_it(ct_nnunet: Path):
    tree = ct_tree(ct_nnunet)
    tree["search"]["metric"] = "val_dice_spleen"
    spec = validate_spec(tree)
    assert spec.search.mode == "max"
    check_dataset_path(spec)
    tree["search"]["metric"] = "val_dice_pancreas"
    with pytest.raises(SpecError, match=r"search.metric.*'val_dice_pancreas'.*val_dice_liver, val_dice_spleen, "
                                        r"val_dice_kidney"):
        check_dataset_path(validate_spec(tree))
    tree["search"]["metric"] = "val_iou"
    with pytest.raises(SpecError, match=r"search.metric.*'val_dice_<key>'"):
        validate_spec(tree)
