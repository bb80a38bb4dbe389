"""``training.precision: auto`` (:mod:`distmis.train.auto_precision`): bf16 on devices that compute bfloat16
natively, fp32 elsewhere, resolved where the trial's trainer is built; the driver plans it as fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_layout
from distmis.train.auto_precision import auto_precision, cpu_computes_bf16, cpu_flags
from distmis.trial.trainers import build_trainer, resolve_precision
from tests.conftest import small_spec_tree


@pytest.mark.parametrize("device, capability, flags, expected", [
    ("cpu", None, {"avx512f", "avx512_bf16"}, "bf16"),  # Cooper Lake, Zen 4 on
    ("cpu", None, {"avx512f", "amx_bf16", "amx_tile"}, "bf16"),  # Sapphire Rapids on
    ("cpu", None, {"avx2", "avx512f"}, "fp32"),  # bfloat16 would be emulated
    ("cuda", (8, 0), set(), "bf16"),  # A100
    ("cuda", (9, 0), set(), "bf16"),  # H100, H200
    ("cuda", (7, 0), {"avx512_bf16"}, "fp32"),  # V100: no bfloat16 tensor cores, whatever the host's CPU
])
def test_auto_is_bf16_where_the_device_computes_it_natively(device, capability, flags, expected):
    assert auto_precision(device, cuda_capability=capability, flags=frozenset(flags)) == expected


def test_the_cpu_flags_are_read_from_cpuinfo(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx512f", "avx512_bf16"}
    assert cpu_computes_bf16(cpu_flags(cpuinfo)) and not cpu_computes_bf16(frozenset({"avx2"}))
    assert cpu_flags(tmp_path / "missing") == frozenset()  # not Linux: no flags, fp32
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        auto_precision("tpu")


def test_the_trial_trains_in_the_resolved_precision_and_the_driver_plans_fp32(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"
    tree["training"]["precision"] = "auto"
    tree["training"]["performance"] = {"memory_format": "contiguous", "compile": "off"}
    spec = validate_spec(tree)
    assert spec.training.precision == "auto" and spec.training.planned_precision == "fp32"
    resolved = resolve_precision(spec, "cpu")
    assert resolved.training.precision == auto_precision("cpu")  # this machine's CPU decides
    assert resolve_precision(resolved, "cpu") is resolved  # a concrete precision stays as it is
    data = prepare_data(spec, tmp_path / "out", progress=False)
    trainer = build_trainer(spec, resolve_layout(spec), data.tfrecord_dir)
    assert trainer.precision.name == auto_precision("cpu")
    metrics = trainer.run_epoch(1)
    assert metrics.compute_bits == (16.0 if auto_precision("cpu") == "bf16" else 32.0)
    fp32 = json.loads(json.dumps(tree))
    fp32["training"]["precision"] = "fp32"
    assert validate_spec(fp32).training.planned_precision == "fp32"
