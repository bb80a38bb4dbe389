"""The data layout registry (distmis.data.dataset_layouts): every layout has one entry, and every entry works
end to end: synthesised, discovered, described, read, scanned, and refused by name where it should be."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from distmis.data import Layout, describe_dataset, discover_cases, read_case
from distmis.data.dataset_layouts import (
    DATASET_LAYOUTS, DatasetLayout, SyntheticKind, SyntheticLayout, case_folder_layouts,
    dataset_layout, layout_description, register_dataset_layout,
)
from distmis.data.errors import DataError
from distmis.data.scans import discover_scans, read_scan
from distmis.data.synthetic import synthesize_dataset

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (12, 10, 8)


def test_every_layout_has_one_entry_that_names_it() -> None:
    assert list(DATASET_LAYOUTS) == list(Layout)
    for layout, entry in DATASET_LAYOUTS.items():
        assert entry.layout is layout and dataset_layout(layout.value) is entry
        assert entry.titled.split(" ", 1) == [entry.article, entry.title]
    assert case_folder_layouts() == (Layout.BRATS, Layout.BRATS2023)
    with pytest.raises(ValueError, match="unknown layout 'decathlon'; expected one of 'msd', 'nnunet'"):
        dataset_layout("decathlon")
    with pytest.raises(ValueError, match="layout 'msd' is registered already"):
        register_dataset_layout(DATASET_LAYOUTS[Layout.MSD])


@pytest.mark.parametrize("layout", list(Layout), ids=lambda layout: layout.value)
def test_each_entry_synthesises_discovers_describes_and_reads_its_layout(layout: Layout, tmp_path: Path) -> None:
    entry = dataset_layout(layout)
    root = tmp_path / layout.value
    ids = synthesize_dataset(root, layout, cases=3, shape=SHAPE, progress=False)
    assert ids == [entry.synthetic.brain_case_id(i) for i in range(3)]
    cases = discover_cases(root, layout)
    assert [c.case_id for c in cases] == ids and cases == entry.discover(root)
    description = describe_dataset(root, layout)
    assert description == entry.describe(root) and description.layout is layout
    if entry.own is not None:  # MSD's dataset.json names its data set and its training cases too
        own = layout_description(layout)
        assert own is entry.own and (description.channels, description.classes) == (own.channels, own.classes)
    else:
        with pytest.raises(ValueError, match="has no fixed channels and classes"):
            layout_description(layout)
    per_file = 1 if entry.images == "one_file" else description.num_channels
    assert all(len(case.images) == per_file for case in cases)
    if entry.case_folder is not None:
        naming = entry.case_folder
        assert all(case.images[0].name == f"{case.case_id}{naming.separator}{naming.modalities[0]}.nii.gz"
                   for case in cases)
    image, label, _ = read_case(cases[0], description)
    assert image.shape == SHAPE + (description.num_channels,)
    edema, enhancing, core = entry.synthetic.brain_labels
    values = set(np.unique(label))
    assert values <= {0, edema, enhancing, core} and values <= set(description.label_values)
    scans = discover_scans(root)  # the layout is found from the files alone
    assert [s.case_id for s in scans] == ids and {s.layout for s in scans} == {layout}
    assert read_scan(scans[0], description.channels)[0].shape == image.shape


def test_an_entry_refuses_a_synthetic_kind_it_does_not_hold(tmp_path: Path) -> None:
    assert SyntheticKind.CT not in dataset_layout("brats").synthetic.kinds
    with pytest.raises(ValueError, match="kind 'ct' cannot be written in layout 'brats'; kind 'ct' is written in "
                                         "layouts 'msd', 'nnunet'"):
        synthesize_dataset(tmp_path / "ct", "brats", cases=1, shape=SHAPE, kind="ct", progress=False)


def test_a_case_folder_entry_names_the_files_its_folders_must_hold(tmp_path: Path) -> None:
    root = tmp_path / "brats2023"
    synthesize_dataset(root, "brats2023", cases=1, shape=SHAPE, progress=False)
    case = next(root.iterdir())
    (case / f"{case.name}-t1c.nii.gz").unlink()
    with pytest.raises(DataError, match=r"missing file .*-t1c\.nii\.gz' \(a BraTS 2023 case folder needs"):
        discover_cases(root, "brats2023")


def test_a_new_entry_is_all_a_reader_needs(tmp_path: Path) -> None:
    """An entry made from an existing one's functions, under another title, is what the readers use: their
    messages name it (no reader holds its own table of layouts)."""
    msd = DATASET_LAYOUTS[Layout.MSD]
    renamed = DatasetLayout(Layout.MSD, "Decathlon", "a", msd.root_holds, msd.images, "volume file", msd.discover,
                            msd.describe, msd.own, None, SyntheticLayout(msd.synthetic.kinds, lambda i: f"dec_{i}",
                                                                         msd.synthetic.brain_labels,
                                                                         msd.synthetic.write_case,
                                                                         msd.synthetic.write_index))
    root = tmp_path / "msd"
    try:
        DATASET_LAYOUTS[Layout.MSD] = renamed
        assert synthesize_dataset(root, "msd", cases=2, shape=SHAPE, progress=False) == ["dec_0", "dec_1"]
        case = discover_cases(root, "msd")[0]
        with pytest.raises(DataError, match="a Decathlon case has exactly one image file, got 2"):
            read_case(type(case)(case.case_id, case.images * 2, case.label), "msd")
    finally:
        DATASET_LAYOUTS[Layout.MSD] = msd


def test_no_data_module_branches_on_a_layout_outside_the_registry() -> None:
    """Only the registry's entries say what differs between layouts; the readers ask them. What remains: telling
    an MSD dataset.json from an nnU-Net one, and loose MSD image files from nnU-Net channel files, from the files
    themselves (their two naming conventions)."""
    allowed = {("description.py", "get"), ("scans.py", "_folder_description"), ("scans.py", "_classify_folder"),
               ("scans.py", "_classify_file"), ("scans.py", "_classify_files")}

    def names_a_layout(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Layout"

    found = set()
    for path in sorted((ROOT / "distmis" / "data").glob("*.py")):
        if path.name in ("dataset_layouts.py", "layout_entries.py"):
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, ast.FunctionDef):
                for node in ast.walk(function):
                    sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
                    if any(names_a_layout(side) or (isinstance(side, ast.Tuple) and any(map(names_a_layout, side.elts)))
                           for side in sides):
                        found.add((path.name, function.name))
    assert found - allowed == set()
    assert found  # the check sees the detection it allows
