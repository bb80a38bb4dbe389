"""Which ``torch.distributed`` backend a trial's process groups use: NCCL on GPUs, gloo on CPUs.

One rule for every group a torch trial makes: the default group Ray Train initializes
(:class:`~distmis.parallel.torch_backend.GpuCheckedTorchConfig`, from
:func:`distmis.trial.trainables.data_parallel_trial`) and the data-, sequence- and pipeline-parallel subgroups of its
:class:`~distmis.parallel.mesh.TrialMesh`, which take the same backend (:meth:`TrialMesh.build` checks the default
group's against this). Pure: no torch, no Ray.
"""

from __future__ import annotations

from typing import Literal

from distmis.spec.layout import TrialLayout

__all__ = ["ProcessGroupBackend", "process_group_backend"]

ProcessGroupBackend = Literal["nccl", "gloo"]


def process_group_backend(layout: TrialLayout) -> ProcessGroupBackend:
    """``"nccl"`` for a trial whose workers have GPUs (``layout.gpu > 0``), ``"gloo"`` for a CPU trial.

    NCCL keeps one rank of a group per GPU: two ranks on one device fail its start ("Duplicate GPU detected"). A
    trial of several ranks whose workers each hold a fraction of a GPU (Ray packs them onto one device) is refused
    here (ValueError) rather than there: give each of its workers a whole GPU. Fractional GPUs are for trials of one
    process each (experiment-parallel, ``resources_per_trial.gpu: 0.5``), which share a device without a group.
    """
    if layout.gpu <= 0:
        return "gloo"
    if layout.world_size > 1 and layout.gpu < 1:
        raise ValueError(
            f"a torch trial of {layout.world_size} ranks on GPUs uses NCCL, which takes one GPU per rank, but each "
            f"worker asks for {layout.gpu:g} GPU (Ray puts such workers on one device, and NCCL refuses two ranks "
            "on one GPU): set parallelism.resources_per_worker.gpu to 1, or 0 to train on CPUs (gloo)")
    return "nccl"
