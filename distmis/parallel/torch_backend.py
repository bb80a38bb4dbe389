"""Ray Train's torch backend, with the GPU check before the process group.

A data-parallel torch trial on GPUs initializes its default process group with NCCL
(:func:`distmis.parallel.backend.process_group_backend`) in Ray Train's backend set-up, before the training
function runs. On a worker whose torch sees no CUDA device, NCCL's start fails there with an error that does not
say why. :class:`GpuCheckedTorchConfig` first runs :func:`distmis.parallel.devices.check_process_gpus` on every
worker, so the trial fails with :class:`~distmis.parallel.devices.GpuUnavailableError` (what Ray gave, what torch
saw, what to do) instead. Its set-up is otherwise Ray's own ``TorchConfig``'s.

Ray (2.60) has no public hook between a worker group's start and its process group, so this subclasses Ray's
private ``_TorchBackend`` (what the public ``TorchConfig.backend_cls`` returns).
``tests/parallel/test_torch_backend.py`` pins what that relies on, for the Ray versions pyproject.toml allows
(docs/gpu.md).

Imports torch (through ``ray.train.torch``): for the trial processes of torch searches only.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.train.torch.config import TorchConfig

try:
    from ray.train.torch.config import _TorchBackend  # Ray 2.60's; the backend class is not exported
except ImportError as exc:  # pragma: no cover - a Ray that moved it: say so, not just the missing name
    raise ImportError(f"Ray {ray.__version__} has no ray.train.torch.config._TorchBackend, which distmis's GPU check "
                      "for Ray Train's torch workers subclasses (distmis/parallel/torch_backend.py; docs/gpu.md): "
                      "install the Ray that constraints.txt pins") from exc

from distmis.parallel.devices import check_process_gpus

__all__ = ["GpuCheckedTorchConfig"]


class _GpuCheckedTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:  # type: ignore[no-untyped-def]
        if backend_config.backend == "nccl":  # a GPU trial: every worker's torch must see its GPU
            worker_group.execute(check_process_gpus, torch=True)
        super().on_start(worker_group, backend_config)


@dataclass
class GpuCheckedTorchConfig(TorchConfig):
    """Ray Train's ``TorchConfig``, whose workers are refused (:class:`GpuUnavailableError`) before an NCCL
    process group when their torch sees no CUDA device."""

    @property
    def backend_cls(self) -> type[_TorchBackend]:
        return _GpuCheckedTorchBackend
