"""Use a distmis model where distmis cannot be imported: a script the tests run in a subprocess.

``python without_distmis.py MODEL_URI TRACKING_URI OUT CASE ...`` (a ``CASE`` is an MSD 4-D NIfTI file, or a
BraTS-like or nnU-Net list of the channel files joined by ``,``, in channel order) refuses every import of
``distmis`` (a finder first on ``sys.meta_path`` raises ImportError, ahead of the editable install's), loads the model
with ``mlflow.pyfunc.load_model``, reads each case with nibabel, stacks its channels as distmis does, predicts it with
``params={"spacing": ..., "orientation": ...}`` (the header's zooms and ``nibabel.aff2axcodes``) and saves the label map as ``OUT/<case>.npy``. It prints one JSON line: the model's
requirements (``mlflow.pyfunc.get_model_dependencies``) and the distmis modules that were imported (none).
"""

from __future__ import annotations

import importlib.abc
import sys


class RefuseDistmis(importlib.abc.MetaPathFinder):
    """An import system without distmis: ``distmis`` and ``distmis.*`` raise ImportError."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, D102
        if name == "distmis" or name.startswith("distmis."):
            raise ImportError(f"No module named {name!r} (refused: this process has no distmis)")
        return None


def main(argv: list[str]) -> None:
    import json
    import os
    from pathlib import Path

    import mlflow
    import mlflow.pyfunc
    import nibabel as nib
    import numpy as np

    try:
        import distmis  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("distmis was importable")
    model_uri, tracking_uri, out = argv[0], argv[1], Path(argv[2])
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    model = mlflow.pyfunc.load_model(model_uri)
    out.mkdir(parents=True, exist_ok=True)
    for case in argv[3:]:
        files = case.split(",")
        first = nib.load(files[0])
        if len(files) == 1:  # MSD: one 4-D file, channels in order (a one-channel 3-D file: one channel)
            image = np.asarray(first.dataobj, dtype=np.float32)
            image = image[..., None] if image.ndim == 3 else image
        else:  # BraTS-like or nnU-Net: one 3-D file per channel, stacked on a last axis
            image = np.stack([np.asarray(nib.load(f).dataobj, dtype=np.float32) for f in files], axis=-1)
        spacing = [float(z) for z in first.header.get_zooms()[:3]]
        orientation = "".join(nib.aff2axcodes(first.affine))
        labels = model.predict(image, params={"spacing": spacing, "orientation": orientation})
        name = Path(files[0]).name.removesuffix(".nii.gz")
        np.save(out / f"{name}.npy", np.asarray(labels))
    requirements = Path(mlflow.pyfunc.get_model_dependencies(model_uri)).read_text()
    print(json.dumps({"requirements": requirements.splitlines(), "cwd": os.getcwd(),
                      "distmis_modules": sorted(m for m in sys.modules if m.split(".")[0] == "distmis")}))


if __name__ == "__main__":
    sys.meta_path.insert(0, RefuseDistmis())  # before anything else is imported
    main(sys.argv[1:])
