"""distmis init's draft: a complete spec from a data set and a worker's memory, on three data sets that differ in
channels, classes, spacing and shape (a 4-channel MRI set, an anisotropic CT set with an LPS case, an nnU-Net set
with region-based labels)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from distmis.data.fingerprint import compute_fingerprint
from distmis.data.synthetic import synthesize_dataset
from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.draft_spec import InitRequest, draft_spec
from distmis.search.draft_yaml import checked_spec, render_spec
from distmis.spec import SpecError

REGIONS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]}


def write_datasets(root: Path) -> dict[str, Path]:
    """The three data sets, small enough to train in seconds."""
    sets = {"mri": root / "mri", "ct": root / "ct", "regions": root / "regions"}
    synthesize_dataset(sets["mri"], "msd", cases=6, shape=(32, 32, 32), progress=False)
    synthesize_dataset(sets["ct"], "msd", cases=6, shape=(40, 40, 16), kind="ct", lps_cases=1, progress=False)
    synthesize_dataset(sets["regions"], "nnunet", cases=6, shape=(32, 32, 24), progress=False)
    index = sets["regions"] / "dataset.json"
    meta = json.loads(index.read_text())
    index.write_text(json.dumps({**meta, "labels": REGIONS, "regions_class_order": [1, 2, 3]}))
    return sets


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return write_datasets(tmp_path_factory.mktemp("init-data"))


@pytest.fixture(scope="module")
def drafts(datasets, tmp_path_factory):
    """Each data set drafted once, for two workers of 2 GB, the fingerprints kept in a folder of the test's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DISTMIS_OUTPUT", str(tmp_path_factory.mktemp("runs")))
        return {key: draft_spec(InitRequest(str(path), memory_per_worker=2e9, workers=2, epochs=3))
                for key, path in datasets.items()}


def test_the_data_decides_labels_spacing_orientation_and_channels(drafts, datasets):
    mri, ct, regions = drafts["mri"].spec, drafts["ct"].spec, drafts["regions"].spec
    assert (mri.dataset.layout, mri.dataset.labels, mri.dataset.spacing, mri.dataset.orientation) == \
        ("msd", "regions", None, None)  # a brain-tumour set: WT, TC, ET; one spacing and orientation
    # the CT's cases differ in spacing (anisotropic) and one is stored LPS
    assert (ct.dataset.labels, ct.dataset.spacing, ct.dataset.orientation) == ("classes", "auto", "RAS")
    # resampled, the CT's cases differ in shape: one shape for all, each side the largest case's (the conversion
    # stores one shape); it has no zero border to crop
    assert ct.dataset.crop is not None and not ct.dataset.crop_to_nonzero
    assert tuple(ct.dataset.crop) == drafts["ct"].plan.volume
    # the brain sets' heads sit in a zero border: each case is cropped to its non-zero region (nnU-Net's crop), and
    # those regions are centred in one shape that holds the largest of them
    for key, layout in (("mri", "msd"), ("regions", "nnunet")):
        cases = compute_fingerprint(datasets[key], layout).cases
        assert drafts[key].spec.dataset.crop_to_nonzero and any(c.cropped_shape != c.shape for c in cases)
        largest = tuple(max(axis) for axis in zip(*(c.cropped_shape for c in cases)))
        assert tuple(drafts[key].spec.dataset.crop) == largest == drafts[key].plan.volume
    assert (regions.dataset.layout, regions.dataset.labels) == ("nnunet", "regions")
    channels = {key: {step.memory.trace.flops > 0 for step in draft.fit.steps} for key, draft in drafts.items()}
    assert channels == {"mri": {True}, "ct": {True}, "regions": {True}}
    for draft in drafts.values():
        assert {s.network for s in draft.fit.steps} == {"unet3d", "segresnet"}
        assert draft.spec.search.space["model.name"].choice == ["unet3d", "segresnet"]
        # the U-Net's depth follows the volume: its deepest map keeps at least 4 voxels a side
        levels = draft.spec.model.params.levels
        assert min(draft.plan.volume) // 2 ** (levels - 1) >= 4 and levels >= 2


def test_every_trial_is_predicted_to_fit_and_the_next_larger_tile_does_not(drafts):
    for key, draft in drafts.items():
        plan = draft.plan
        assert all(step.memory.peak <= draft.fit.usable for step in draft.fit.steps), key
        assert draft.fit.usable == pytest.approx(2e9 - PROCESS_RESERVE, rel=0.1)
        assert draft.spec.training.batch_size == plan.batch >= 2
        assert all(t <= v for t, v in zip(plan.tile, plan.volume))
        if plan.next_larger is not None:
            assert plan.next_larger.peak > plan.usable
        searched = draft.spec.search.space.get("training.tile")
        if draft.smaller_tile is not None:  # a smaller tile is searched beside the planned one
            assert searched.choice == [list(plan.tile), list(draft.smaller_tile)]
            assert math.prod(draft.smaller_tile) * 2 <= math.prod(plan.tile)
            assert draft.spec.training.tile_sampling == 0.33


def test_the_written_yaml_reads_back_as_the_same_spec_with_its_reasons_and_predictions(drafts):
    draft = drafts["ct"]
    text = render_spec(draft, "ct.yaml", "distmis init data/ct")
    assert text.startswith("# distmis init data/ct\n")
    assert checked_spec(text).model_dump() == draft.spec.model_dump()
    lines = text.splitlines()
    tile_line = next(line for line in lines if line.strip().startswith("tile:"))
    assert "# planned: the largest that fits every network" in tile_line
    assert any(line.strip().startswith("spacing: auto  # the cases' spacings differ") for line in lines)
    table = [line for line in lines if line.startswith("# | ")]
    assert len(table) == 1 + len(draft.fit.steps)  # the header and one row per trial's step
    assert yaml.safe_load(text)["parallelism"]["memory_per_worker"] == "2GB"


def test_a_budget_too_small_for_any_tile_is_refused_naming_it_and_what_the_smallest_needs(datasets, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("DISTMIS_OUTPUT", str(tmp_path))
    request = InitRequest(str(datasets["mri"]), memory_per_worker=PROCESS_RESERVE + 1000, workers=1,
                          networks=("unet3d",))
    with pytest.raises(SpecError, match=r"parallelism.memory_per_worker: 'auto': no training step fits: the "
                                        r"smallest, tile \[\d+, \d+, \d+\] at batch 1, is predicted to need \d+ MiB, "
                                        r"and a worker has 0 MiB"):
        draft_spec(request)


def test_what_init_cannot_decide_is_named(datasets, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMIS_OUTPUT", str(tmp_path))
    with pytest.raises(ValueError, match="--memory-per-worker: GPU workers need their GPU's memory"):
        draft_spec(InitRequest(str(datasets["mri"]), gpus_per_worker=1, workers=4))
    with pytest.raises(ValueError, match="--networks: segresnet is built in torch, not tensorflow"):
        draft_spec(InitRequest(str(datasets["mri"]), framework="tensorflow", memory_per_worker=2e9))
    with pytest.raises(ValueError, match="no model 'unet2d'"):
        draft_spec(InitRequest(str(datasets["mri"]), networks=("unet2d",), memory_per_worker=2e9))
    assert not any(tmp_path.iterdir())  # refused before the data set is read
