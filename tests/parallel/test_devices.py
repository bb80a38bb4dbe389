"""A process's GPUs: the refusal of a GPU its framework cannot see (pure, then with this machine's real torch and
TensorFlow, both CPU builds), the process-group backend of a trial (NCCL on GPUs, gloo on CPUs), and the set-up
of a process (TensorFlow's memory growth, torch's cudnn.benchmark, the device a model reports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distmis.parallel.backend import process_group_backend
from distmis.parallel.devices import (
    FrameworkGpus, GpuUnavailableError, check_process_gpus, gpu_refusal, model_device, require_gpus,
    set_cudnn_benchmark, tensorflow_gpus, tensorflow_memory_growth, torch_gpus,
)
from distmis.spec.layout import TrialLayout

REPO = Path(__file__).resolve().parents[2]

CPU_TORCH = FrameworkGpus("torch", "2.13.0+cpu", (), None, "torch.cuda.is_available() False, torch.version.cuda None")


def layout(*, dp: int = 1, sp: int = 1, pp: int = 1, gpu: float = 0.0) -> TrialLayout:
    return TrialLayout(dp=dp, sp=sp, pp=pp, distributed=dp * sp * pp > 1, cpu=1, gpu=gpu, lr=1e-3,
                       lr_scaling="none")


# --------------------------------------------------------------------------- the refusal, pure
def test_a_process_given_no_gpu_or_whose_framework_sees_one_is_not_refused():
    assert gpu_refusal([], None, CPU_TORCH) is None  # a CPU trial: nothing to check
    seen = FrameworkGpus("torch", "2.13.0", ("NVIDIA H100 80GB HBM3",), "13.0", "torch.cuda.is_available() True")
    assert gpu_refusal(["0"], "0", seen) is None
    require_gpus(["0"], "0", seen)  # does not raise


def test_the_refusal_says_what_ray_gave_what_the_framework_saw_and_what_to_do():
    reason = gpu_refusal(["0", "3"], "0,3", CPU_TORCH)
    assert reason is not None
    assert reason.startswith("Ray gave this process GPUs 0, 3 (CUDA_VISIBLE_DEVICES='0,3') but torch 2.13.0+cpu "
                             "sees no CUDA device (torch.cuda.is_available() False, torch.version.cuda None: "
                             "a build without CUDA).")
    assert "does not train a GPU trial on the CPU" in reason
    assert "install torch's CUDA build (gpu-torch extra: docs/install.md, GPU nodes)" in reason
    assert reason.endswith("or drop gpu from parallelism.resources_per_trial / resources_per_worker.")
    # the whole reason fits the run's error tag (500 characters, the exception's name before it)
    assert len(f"distmis.parallel.devices.GpuUnavailableError: {reason}") <= 500
    with pytest.raises(GpuUnavailableError, match="CUDA_VISIBLE_DEVICES=unset"):
        require_gpus([1], None, CPU_TORCH)


def test_a_cuda_build_that_sees_no_device_points_at_the_node():
    seen = FrameworkGpus("tensorflow", "2.21.0", (), "12.9", "tf.config.list_physical_devices('GPU') []")
    reason = gpu_refusal(["0"], "0", seen)
    assert reason is not None and "built with CUDA 12.9: check the node's driver and devices (nvidia-smi)" in reason
    assert "install TensorFlow's CUDA build (gpu-tf extra" in reason


# --------------------------------------------------------------------------- the refusal, real frameworks
def test_this_machines_torch_refuses_a_gpu_from_ray():
    import torch

    assert not torch.cuda.is_available(), "this test needs a torch that sees no CUDA device"
    seen = torch_gpus()
    assert seen.framework == "torch" and seen.devices == () and seen.cuda_build == torch.version.cuda
    with pytest.raises(GpuUnavailableError) as refused:
        require_gpus(["0"], "0", seen)
    assert f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() False" in str(refused.value)


def test_this_machines_tensorflow_refuses_a_gpu_from_ray():
    import tensorflow as tf

    seen = tensorflow_gpus()
    assert seen.framework == "tensorflow" and seen.devices == ()
    assert seen.cuda_build is None and not tf.test.is_built_with_cuda()
    with pytest.raises(GpuUnavailableError) as refused:
        require_gpus(["0"], "0", seen)
    message = str(refused.value)
    assert f"TensorFlow {tf.__version__} sees no CUDA device (tf.config.list_physical_devices('GPU') []" in message
    assert "tf.test.is_built_with_cuda() False: a build without CUDA" in message
    assert "gpu-tf extra" in message


def test_outside_ray_a_process_has_no_gpu_to_check():
    """``pin_threads`` runs the check in every process; one that Ray did not start (a test, a benchmark, the
    driver) was given no GPU, and nothing imports Ray for it."""
    code = ("import sys; from distmis.parallel.devices import check_process_gpus; "
            "print(check_process_gpus(torch=True, tensorflow=True), 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False"]
    assert check_process_gpus(torch=True) == []  # and in this process, whatever it imported


# --------------------------------------------------------------------------- NCCL on GPUs, gloo on CPUs
def test_gpu_trials_use_nccl_and_cpu_trials_gloo():
    assert process_group_backend(layout()) == "gloo"
    assert process_group_backend(layout(dp=2)) == "gloo"
    assert process_group_backend(layout(gpu=1)) == "nccl"
    assert process_group_backend(layout(dp=2, gpu=1)) == "nccl"
    assert process_group_backend(layout(sp=2, gpu=1)) == "nccl"
    assert process_group_backend(layout(dp=2, pp=2, gpu=2)) == "nccl"
    assert process_group_backend(layout(gpu=0.5)) == "nccl"  # one process: no group shares its device


def test_ranks_sharing_a_gpu_are_refused_before_nccl_refuses_them():
    with pytest.raises(ValueError, match="each worker asks for 0.5 GPU .* set parallelism.resources_per_worker.gpu "
                                         "to 1, or 0 to train on CPUs"):
        process_group_backend(layout(dp=2, gpu=0.5))
    with pytest.raises(ValueError, match="a torch trial of 2 ranks on GPUs uses NCCL"):
        process_group_backend(layout(pp=2, gpu=0.25))


def test_a_mesh_refuses_a_default_group_of_the_other_backend(tmp_path: Path):
    """A GPU trial's mesh over a gloo default group (a CPU one's over NCCL) raises rather than making groups of the
    wrong backend; a CPU layout's mesh over gloo is made."""
    code = f"""
import torch.distributed as dist
from distmis.parallel.mesh import TrialMesh
from distmis.spec.layout import TrialLayout
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
def layout(gpu): return TrialLayout(dp=1, sp=1, pp=1, distributed=True, cpu=1, gpu=gpu, lr=1e-3, lr_scaling="none")
print("cpu", TrialMesh.build(layout(0.0)).describe())
try:
    TrialMesh.build(layout(1.0))
except RuntimeError as exc:
    print("gpu", exc)
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "cpu rank 0: dp 0/1, sp 0/1, pp 0/1"
    assert lines[1] == ("gpu the trial's layout (1 worker(s): dp=1 x sp=1, 1 CPU + 1 GPU each) calls for nccl "
                        "process groups, but the default group is gloo")


def test_ray_trains_gpu_torch_trials_with_the_checked_nccl_backend():
    from ray.train.torch.config import TorchConfig

    from distmis.parallel.torch_backend import GpuCheckedTorchConfig

    config = GpuCheckedTorchConfig(backend=process_group_backend(layout(dp=2, gpu=1)))
    assert isinstance(config, TorchConfig) and config.backend == "nccl"
    assert config.backend_cls.__name__ == "_GpuCheckedTorchBackend"
    assert issubclass(config.backend_cls, TorchConfig().backend_cls)  # Ray's own set-up after the check


# --------------------------------------------------------------------------- a process's set-up
def test_memory_growth_is_harmless_without_gpus():
    assert tensorflow_memory_growth() == []
    assert tensorflow_memory_growth() == []  # again, in a process whose TensorFlow may be initialized now


def test_cudnn_benchmark_follows_the_setting():
    import torch

    before = torch.backends.cudnn.benchmark
    try:
        set_cudnn_benchmark(True)
        assert torch.backends.cudnn.benchmark is True
        set_cudnn_benchmark(False)
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = before


def test_a_model_reports_the_device_its_weights_are_on():
    import keras
    import torch

    assert model_device(torch.nn.Linear(2, 2)) == "cpu"
    assert model_device(torch.nn.Linear(2, 2).to("meta")) == "meta"
    assert model_device(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])) == "CPU:0"
    assert model_device(torch.nn.ReLU()) == "unknown"  # no weights
    assert model_device(None) == "unknown"
