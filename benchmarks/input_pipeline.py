"""Offline TFRecord binarization vs reading NIfTI every epoch (the paper's section III.B.1).

DistMIS converts the NIfTI volumes to TFRecords once, before training, because decoding and
preprocessing the NIfTI files every epoch was the pipeline's bottleneck. This measures that claim on
this machine: one pass over the training cases read from NIfTI (gzip decode + z-score + crop) against
one pass read from the TFRecords (without the in-memory cache), in one run, and reports the ratio.

    python benchmarks/input_pipeline.py --cases 16 --shape 128,128,96 --epochs 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=16)
    parser.add_argument("--shape", default="128,128,96")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="conversion processes")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))

    from distmis.data import (
        LabelMode, Layout, PreprocessConfig, convert_to_tfrecords, discover_cases, make_dataset, make_split,
        preprocess_case, read_case, synthesize_dataset,
    )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "msd"
        synthesize_dataset(root, Layout.MSD, cases=args.cases, shape=shape, seed=0, progress=False)
        cases = discover_cases(root, Layout.MSD)
        split = make_split([c.case_id for c in cases], train=0.7, val=0.15, test=0.15, seed=0)
        config = PreprocessConfig(layout=Layout.MSD, labels=LabelMode.WHOLE_TUMOUR)
        train = [c for c in cases if c.case_id in set(split["train"])]

        start = time.perf_counter()
        convert_to_tfrecords(cases, split, config, Path(tmp) / "tfr", workers=args.workers, progress=False)
        convert_s = time.perf_counter() - start

        nifti_epochs, tfr_epochs = [], []
        dataset = make_dataset(Path(tmp) / "tfr", "train", batch_size=1, cache=False)
        for _ in range(args.epochs):
            start = time.perf_counter()
            for case in train:
                preprocess_case(*read_case(case, Layout.MSD)[:2], config)
            nifti_epochs.append(time.perf_counter() - start)
            start = time.perf_counter()
            for _x, _y in dataset:
                pass
            tfr_epochs.append(time.perf_counter() - start)

    nifti, tfr = min(nifti_epochs), min(tfr_epochs)
    print(f"{len(train)} training cases of {shape}, best of {args.epochs} passes")
    print("| pipeline | seconds per epoch | cases/s |\n|---|---|---|")
    print(f"| NIfTI read + preprocess every epoch | {nifti:.3f} | {len(train) / nifti:.1f} |")
    print(f"| TFRecord (tf.data interleave, prefetch) | {tfr:.3f} | {len(train) / tfr:.1f} |")
    print(f"one-off conversion of all {args.cases} cases: {convert_s:.2f} s; "
          f"TFRecord epochs are {nifti / tfr:.1f}x faster; the conversion pays for itself after "
          f"{convert_s / max(nifti - tfr, 1e-9):.1f} epochs")


if __name__ == "__main__":
    main()
