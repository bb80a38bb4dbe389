"""distmis predict's per-case work, on real NIfTI files: geometry, label values, atomic writes, refusals.

The network is :class:`tests.predict.nets.BrightFlair` (tumour where the z-scored FLAIR is above 0, voxel by voxel),
so the segmentation a case must get is known exactly, whatever windows, crop, pad and resize lie in between.
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data.errors import DataError
from distmis.data.preprocess import zscore_nonzero
from distmis.data.scans import discover_scans
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import InferenceSettings, ModelRecipe
from distmis.predict.segment import predict_scans
from tests.predict.nets import BrightFlair

ROTATED = np.array([[0.0, -1.2, 0.0, 40.5], [0.9, 0.0, 0.3, -12.0], [0.0, 0.0, 2.5, 7.25], [0, 0, 0, 1]])


def bright_case(shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A head (value 1 in every channel) with a bright FLAIR tumour (5), its core bright in T1 and its centre in T2;
    the label in MSD values (1 edema, 2 core, 3 enhancing)."""
    rng = np.random.default_rng(seed)
    grid = np.indices(shape).astype(float)
    centre = np.array(shape) / 2 + rng.uniform(-1, 1, 3)
    radius = np.sqrt(((grid - centre[:, None, None, None]) ** 2 / (np.array(shape)[:, None, None, None] / 2.4) ** 2).sum(0))
    head = radius <= 1.0
    image = np.zeros(shape + (4,), dtype=np.float32)
    image[head] = 1.0
    tumour, core, enhancing = radius <= 0.45, radius <= 0.3, radius <= 0.15
    image[tumour, 0] = 5.0
    image[core, 1] = 5.0
    image[enhancing, 3] = 5.0
    label = np.zeros(shape, dtype=np.int16)
    label[tumour], label[core], label[enhancing] = 1, 2, 3
    return image, label


def write_msd_case(folder: Path, case_id: str, shape: tuple[int, int, int], affine: np.ndarray, seed: int) -> np.ndarray:
    image, label = bright_case(shape, seed)
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    nifti = nib.Nifti1Image(image, affine)
    nifti.header.set_qform(affine, code=1)
    nib.save(nifti, str(folder / "imagesTr" / f"{case_id}.nii.gz"))
    nib.save(nib.Nifti1Image(label, affine), str(folder / "labelsTr" / f"{case_id}.nii.gz"))
    return label


def midpoint_cuts(image: np.ndarray, label: np.ndarray) -> tuple[float, ...]:
    """Per channel, half-way between the z-scored value of the head and that of the tumour's bright part."""
    z = zscore_nonzero(image)
    bright = [label > 0, label >= 2, label >= 2, label == 3]
    head = (image[..., 0] > 0) & (label == 0)
    return tuple(float((z[..., c][head].mean() + z[..., c][bright[c]].mean()) / 2) for c in range(4))


def bright_model(labels: str = "whole-tumour", *, crop=None, resize=None, window=(8, 8, 8), logits=False,
                 layout: str = "msd", cuts: tuple[float, ...] = (0.0,) * 4) -> SegmentationModel:
    classes = 1 if labels == "whole-tumour" else 3
    recipe = ModelRecipe(framework="torch", model="unet3d", layout=layout, labels=labels, num_classes=classes,
                         window=window, output="logits" if logits else "probabilities", crop=crop, resize=resize,
                         inference=InferenceSettings(overlap=0.5, mode="gaussian", batch_size=2))
    return SegmentationModel(recipe, BrightFlair(classes, logits=logits, cuts=cuts).eval())


@pytest.mark.parametrize("shape,crop", [((23, 19, 17), (16, 24, 17)), ((20, 21, 9), (17, 13, 14))])
def test_a_cropped_and_padded_case_comes_back_on_its_own_grid_voxel_for_voxel(tmp_path: Path, shape, crop):
    truth = write_msd_case(tmp_path / "data", "odd_001", shape, ROTATED, seed=1)
    scans = discover_scans(tmp_path / "data" / "imagesTr" / "odd_001.nii.gz")
    results = predict_scans(bright_model(crop=crop), scans, tmp_path / "out", progress=False)

    written = nib.load(str(results[0].output))
    assert results[0].output == tmp_path / "out" / "odd_001_seg.nii.gz"
    assert written.shape == shape and np.allclose(written.affine, ROTATED)
    assert written.get_data_dtype() == np.uint8 and int(written.header["qform_code"]) == 1
    seg = np.asarray(written.dataobj)
    # tumour inside the crop box, nothing outside it
    box = tuple(slice((s - c) // 2, (s - c) // 2 + c) if s > c else slice(None) for s, c in zip(shape, crop))
    inside = np.zeros(shape, dtype=bool)
    inside[box] = True
    np.testing.assert_array_equal(seg, ((truth > 0) & inside).astype(np.uint8))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["odd_001_seg.nii.gz"]  # nothing else left


def test_a_resized_case_keeps_shape_affine_and_its_tumour(tmp_path: Path):
    shape = (41, 37, 29)
    truth = write_msd_case(tmp_path / "data", "odd_002", shape, ROTATED, seed=2)
    cuts = midpoint_cuts(bright_case(shape, seed=2)[0], truth)
    model = bright_model("regions", crop=(36, 40, 32), resize=(24, 24, 24), window=(16, 16, 16), logits=True,
                         cuts=cuts)
    results = predict_scans(model, discover_scans(tmp_path / "data" / "imagesTr"), tmp_path / "out", progress=False,
                            score=True)
    written = nib.load(str(results[0].output))
    assert written.shape == shape and np.allclose(written.affine, ROTATED)
    seg = np.asarray(written.dataobj)
    assert set(np.unique(seg)) <= {0, 1, 2, 3}  # the MSD values, regions recombined
    scores = results[0].scores
    assert scores is not None and set(scores) == {f"{m}_{r}" for m in ("dice", "hd95") for r in ("WT", "TC", "ET")}
    for region, values in (("WT", (1, 2, 3)), ("TC", (2, 3))):
        found, real = np.isin(seg, values), np.isin(truth, values)
        dice = 2 * (found & real).sum() / (found.sum() + real.sum())
        assert dice > 0.85 and scores[f"dice_{region}"] == pytest.approx(dice)


def test_brats_cases_get_brats_labels(tmp_path: Path):
    shape = (19, 17, 13)
    image, label = bright_case(shape, seed=3)
    brats = np.select([label == 3, label == 2, label == 1], [4, 1, 2], 0).astype(np.int16)
    folder = tmp_path / "BraTS2021_00007"
    folder.mkdir()
    for index, name in enumerate(("flair", "t1", "t1ce", "t2")):
        nib.save(nib.Nifti1Image(image[..., index], ROTATED), str(folder / f"BraTS2021_00007_{name}.nii.gz"))
    nib.save(nib.Nifti1Image(brats, ROTATED), str(folder / "BraTS2021_00007_seg.nii.gz"))
    results = predict_scans(bright_model("regions"), discover_scans(folder), tmp_path / "out", progress=False,
                            score=True)
    seg = np.asarray(nib.load(str(results[0].output)).dataobj)
    np.testing.assert_array_equal(seg, brats)  # 2 edema, 1 core, 4 enhancing: the BraTS values
    assert results[0].scores["dice_ET"] == 1.0


def test_outputs_are_checked_before_anything_is_written(tmp_path: Path):
    for index in range(2):
        write_msd_case(tmp_path / "data", f"case_{index}", (12, 12, 12), np.eye(4), seed=index)
    out = tmp_path / "out"
    out.mkdir()
    (out / "case_1_seg.nii.gz").write_text("someone's file")
    scans = discover_scans(tmp_path / "data" / "imagesTr")
    with pytest.raises(DataError, match="case_1_seg.nii.gz already exist.*--overwrite"):
        predict_scans(bright_model(), scans, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["case_1_seg.nii.gz"]  # not even case_0 was written
    predict_scans(bright_model(), scans, out, progress=False, overwrite=True)
    assert nib.load(str(out / "case_1_seg.nii.gz")).shape == (12, 12, 12)


def test_a_label_file_of_the_input_is_never_overwritten(tmp_path: Path):
    """Writing into a BraTS 2021 case folder would replace its own <case>_seg.nii.gz label: refused, --overwrite or not."""
    image, label = bright_case((12, 12, 12), seed=4)
    folder = tmp_path / "BraTS2021_00001"
    folder.mkdir()
    for index, name in enumerate(("flair", "t1", "t1ce", "t2")):
        nib.save(nib.Nifti1Image(image[..., index], np.eye(4)), str(folder / f"BraTS2021_00001_{name}.nii.gz"))
    nib.save(nib.Nifti1Image(label, np.eye(4)), str(folder / "BraTS2021_00001_seg.nii.gz"))
    with pytest.raises(DataError, match="would overwrite input file"):
        predict_scans(bright_model(), discover_scans(folder), folder, progress=False, overwrite=True)
    np.testing.assert_array_equal(np.asarray(nib.load(str(folder / "BraTS2021_00001_seg.nii.gz")).dataobj), label)
