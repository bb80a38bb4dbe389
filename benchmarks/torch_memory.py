"""Peak resident memory of a torch trial against the number of training cases (issue 13's memory point).

Each case count runs in a fresh process: a synthetic MSD dataset of that many cases is made and converted
to TFRecords, then the torch U-Net trainer of that spec is built and trains one epoch on tiles; the process's
peak resident set size (``getrusage``'s ``ru_maxrss``) is read at the end. A trainer that streams its cases
keeps the peak flat as cases are added; one that holds the whole training split in memory does not.

    python benchmarks/torch_memory.py --cases 12,48 --shape 96,96,96 --output runs/torch-memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def spec_tree(data: Path, cases: int, shape: list[int]) -> dict:
    return {
        "name": f"torch-memory-{cases}",
        "dataset": {"path": str(data), "layout": "msd", "synthetic": {"cases": cases, "shape": shape, "seed": 0},
                    "split": {"train": 0.75, "val": 0.125, "test": 0.125, "seed": 0}},
        "model": {"name": "unet3d", "framework": "torch", "params": {"base_filters": 8, "levels": 4}},
        "training": {"epochs": 1, "batch_size": 2, "tile": [32, 32, 32]},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [1.0e-3]}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
    }


def child(cases: int, shape: list[int], tfrecord_dir: str) -> dict:
    """One measurement, in this (fresh) process, which imports neither TensorFlow nor the converter."""
    from distmis.spec import validate_spec
    from distmis.train.threads import pin_threads

    pin_threads(1, tensorflow=False)
    spec = validate_spec(spec_tree(Path(tfrecord_dir), cases, shape))
    from distmis.parallel.mesh import TrialMesh
    from distmis.spec.layout import resolve_layout
    from distmis.train.torch_trainer import TorchTrainer

    layout = resolve_layout(spec)
    trainer = TorchTrainer(spec, tfrecord_dir, layout=layout, mesh=TrialMesh.local(layout))
    trainer.run_epoch(1)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"cases": cases, "train_cases": len(trainer.train_cases), "shape": "x".join(map(str, shape)),
            "peak_rss_mib": round(peak_mib, 1), "tensorflow_imported": "tensorflow" in sys.modules}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="12,48")
    parser.add_argument("--shape", default="96,96,96")
    parser.add_argument("--output", default="runs/torch-memory")
    parser.add_argument("--child", nargs=2, metavar=("CASES", "TFRECORDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = [int(v) for v in args.shape.split(",")]
    output = Path(args.output)
    if args.child is not None:
        print(json.dumps(child(int(args.child[0]), shape, args.child[1])))
        return
    from distmis.search.prepare import prepare_data
    from distmis.spec import validate_spec

    rows = []
    for cases in (int(n) for n in args.cases.split(",")):
        spec = validate_spec(spec_tree(output / f"data-{cases}", cases, shape))
        data = prepare_data(spec, output / f"out-{cases}", progress=False)  # here, not in the measured process
        done = subprocess.run([sys.executable, __file__, "--child", str(cases), str(data.tfrecord_dir),
                               "--shape", args.shape], check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]["peak_rss_mib"]
    print("| cases | training cases | volume | peak RSS MiB | against the first | TensorFlow imported |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['cases']} | {row['train_cases']} | {row['shape']} | {row['peak_rss_mib']} | "
              f"{row['peak_rss_mib'] / base:.2f} | {row['tensorflow_imported']} |")


if __name__ == "__main__":
    main()
