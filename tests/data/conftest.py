"""Shared fixtures for the distmis.data tests: tiny synthetic data sets on disk."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data import synthesize_dataset

SHAPE = (16, 16, 16)


def write_nifti(path: Path, array: np.ndarray, affine: np.ndarray | None = None) -> Path:
    """Write ``array`` as a NIfTI file with the given (default identity) affine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.eye(4) if affine is None else affine), str(path))
    return path


def corrupt_gzip(path: Path) -> None:
    """Truncate a .nii.gz file in the middle of its compressed data."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="session")
def msd_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only 4-case synthetic MSD data set (do not modify it in tests)."""
    root = tmp_path_factory.mktemp("msd") / "Task01_BrainTumour"
    synthesize_dataset(root, "msd", cases=4, shape=SHAPE, seed=1, progress=False)
    return root


@pytest.fixture(scope="session")
def brats_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only 5-case synthetic BraTS data set (do not modify it in tests)."""
    root = tmp_path_factory.mktemp("brats") / "BraTS2021"
    synthesize_dataset(root, "brats", cases=5, shape=SHAPE, seed=2, progress=False)
    return root


@pytest.fixture(scope="session")
def brats2023_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only 3-case synthetic BraTS 2023 data set (do not modify it in tests)."""
    root = tmp_path_factory.mktemp("brats2023") / "BraTS2023-GLI"
    synthesize_dataset(root, "brats2023", cases=3, shape=SHAPE, seed=3, progress=False)
    return root
