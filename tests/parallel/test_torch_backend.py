"""What ``distmis/parallel/torch_backend.py`` relies on in Ray, pinned (issue 46, finding 17).

A GPU trial's workers must be checked (``check_process_gpus``) before Ray Train makes their NCCL process group,
which it does in its torch backend's ``on_start``, before the training function runs. Ray 2.60 has no public hook
there: ``TorchConfig`` (public) has no field for it, ``ray.train.UserCallback`` is called only after reports and
exceptions, and ``Backend`` (a DeveloperAPI) is what ``TorchConfig.backend_cls`` returns. So distmis subclasses
Ray's own torch backend, the private ``ray.train.torch.config._TorchBackend``. These tests fail, saying what
changed, as soon as a Ray inside the range pyproject.toml allows moves any of it (docs/gpu.md).
"""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import pytest
import ray
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
WHAT = "distmis/parallel/torch_backend.py subclasses Ray's private ray.train.torch.config._TorchBackend"
FIX = ("find where Ray Train now makes a torch worker group's process group, run the GPU check there (or through a "
       "public hook, if Ray has one now), then update this test and docs/gpu.md")


def ray_requirement() -> Requirement:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [requirement] = [Requirement(d) for d in dependencies if Requirement(d).name == "ray"]
    return requirement


def test_the_installed_ray_is_in_the_range_the_pins_below_are_checked_for():
    requirement = ray_requirement()
    assert str(requirement.specifier) == "<3,>=2.60", (
        f"pyproject.toml now allows ray{requirement.specifier}: check that every Ray it allows still has what "
        f"{WHAT} relies on (this module's tests), then update this range")
    assert requirement.specifier.contains(ray.__version__), (
        f"Ray {ray.__version__} is outside ray{requirement.specifier}, the range {WHAT} is checked for")


def test_rays_torch_config_uses_the_private_backend_distmis_subclasses():
    from ray.train.backend import Backend
    from ray.train.torch.config import TorchConfig

    try:
        from ray.train.torch.config import _TorchBackend
    except ImportError:
        pytest.fail(f"Ray {ray.__version__} has no ray.train.torch.config._TorchBackend, which {WHAT}: {FIX}")
    assert TorchConfig().backend_cls is _TorchBackend, (
        f"Ray {ray.__version__}'s TorchConfig.backend_cls is {TorchConfig().backend_cls!r}, no longer the "
        f"_TorchBackend {WHAT}: {FIX}")
    assert issubclass(_TorchBackend, Backend) and _TorchBackend.share_cuda_visible_devices, (
        f"Ray {ray.__version__}'s _TorchBackend changed ({WHAT}): {FIX}")


def test_rays_torch_backend_makes_the_process_group_in_on_start():
    """The GPU check runs before ``super().on_start``: it precedes NCCL only while that is where the group is made."""
    from ray.train.torch import config

    signature = inspect.signature(config._TorchBackend.on_start)
    assert list(signature.parameters) == ["self", "worker_group", "backend_config"], (
        f"Ray {ray.__version__}'s _TorchBackend.on_start{signature} takes other arguments than the "
        f"(worker_group, backend_config) {WHAT} passes on: {FIX}")
    assert "_setup_torch_process_group" in config._TorchBackend.on_start.__code__.co_names, (
        f"Ray {ray.__version__}'s _TorchBackend.on_start no longer makes the process group, so the GPU check "
        f"{WHAT} runs before it may come after NCCL starts: {FIX}")
    assert "init_process_group" in config._setup_torch_process_group.__code__.co_names, (
        f"Ray {ray.__version__}'s _setup_torch_process_group no longer calls torch.distributed.init_process_group "
        f"({WHAT}): {FIX}")


def test_distmis_backend_checks_the_gpus_then_hands_over_to_rays():
    from ray.train.torch.config import TorchConfig, _TorchBackend

    from distmis.parallel.torch_backend import GpuCheckedTorchConfig

    backend = GpuCheckedTorchConfig(backend="nccl").backend_cls
    assert issubclass(backend, _TorchBackend) and backend is not _TorchBackend
    assert set(vars(backend)) & {"on_shutdown", "on_training_start"} == set()  # Ray's own, inherited
    assert list(inspect.signature(backend.on_start).parameters) == ["self", "worker_group", "backend_config"]
    assert isinstance(GpuCheckedTorchConfig(), TorchConfig)  # every field of Ray's public config, as it is
