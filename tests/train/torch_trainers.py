"""Building the one torch trainer in tests: alone, as one data-parallel replica of several (without a process
group: only its data share), or on a real gloo group's mesh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from distmis.parallel.mesh import TrialMesh
from distmis.spec.layout import resolve_layout
from distmis.spec.schema import Spec
from distmis.train.torch_trainer import TorchTrainer


def local_trainer(spec: Spec, tfrecord_dir: str | Path, *, device: str = "cpu") -> TorchTrainer:
    """The trainer of ``spec``'s trial in this process alone (a local mesh, the spec's own layout)."""
    layout = resolve_layout(spec)
    return TorchTrainer(spec, tfrecord_dir, layout=layout, mesh=TrialMesh.local(layout), device=device)


def replica_trainer(spec: Spec, tfrecord_dir: str | Path, *, rank: int, world_size: int) -> TorchTrainer:
    """Replica ``rank`` of ``world_size`` data-parallel replicas, without a process group: it reads and trains
    its own share of the data (no gradient is all-reduced)."""
    layout = resolve_layout(spec)
    mesh = dataclasses.replace(TrialMesh.local(layout), rank=rank, dp_rank=rank, dp_size=world_size)
    return TorchTrainer(spec, tfrecord_dir, layout=layout, mesh=mesh)


def gloo_trainer(spec: Spec, tfrecord_dir: str | Path) -> TorchTrainer:
    """The trainer on this process's mesh of the initialized default group (every rank calls it)."""
    layout = resolve_layout(spec)
    return TorchTrainer(spec, tfrecord_dir, layout=layout, mesh=TrialMesh.build(layout))
