"""Mixed precision in the performance model (issue 37): the seed's mixed-precision memory terms, the bytes sent, what
autograd really saves under ``torch.autocast``, and ``distmis plan --precision``."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from distmis.models.vit_seg import ViTSeg
from distmis.perf.model import (
    SequenceLayout,
    ViTShape,
    activation_bytes,
    communication_bytes,
    parameter_bytes,
    vit_memory,
    vit_parameters,
)

SHAPES = [  # (tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features)
    ((32, 32, 32), 8, 2, 48, 4, 4.0, 16),
    ((32, 16, 16), 4, 1, 32, 2, 2.0, 8),
    ((16, 16, 16), 2, 3, 24, 3, 4.0, 4),
]
SHAPE = ViTShape((96, 96, 96), 8, 2, 96, 4, 4.0, 16, 4, 1)


def test_the_seeds_bytes_per_value_and_per_parameter():
    """Activations in 2 bytes; 6 bytes a weight (fp32 master and its 16-bit copy), 4 a gradient, Adam's fp32
    moments."""
    assert [activation_bytes(p) for p in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    mixed = parameter_bytes("bf16")
    assert mixed["weights"] + mixed["copy"] == 6 and mixed["gradient"] == 4 and mixed["optimizer"] == 8
    assert parameter_bytes("fp32")["copy"] == 0 and parameter_bytes("fp16") == mixed
    with pytest.raises(ValueError, match="'fp32', 'bf16' or 'fp16'"):
        activation_bytes("fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision"):
        vit_memory(SHAPE, precision="half")  # type: ignore[arg-type]


def test_bf16_activations_are_half_of_fp32s_but_what_stays_fp32():
    """The fused kernel: every saved activation, the input included, in 2 bytes; what autocast leaves fp32 (the
    loss's copy of the logits, the kernel's log-sum-exps) in 4. Parameters, gradients and Adam's moments: fp32
    alike; the 16-bit weight copies on top (the seed's 2 bytes a parameter)."""
    psi = vit_parameters(SHAPE)
    voxels = math.prod(SHAPE.tile)
    logits = SHAPE.num_classes * voxels
    lse = SHAPE.layers * SHAPE.heads * SHAPE.tokens
    for layout in (SequenceLayout(), SequenceLayout(sp=4, attention="ulysses")):
        fp32 = vit_memory(SHAPE, layout, kernel="fused")
        for precision in ("bf16", "fp16"):
            mixed = vit_memory(SHAPE, layout, kernel="fused", precision=precision)
            fixed = 4.0 * (logits + lse / layout.sp)
            # the step's own: under mixed precision the rank's input voxels' 16-bit copy besides
            local_input = 2.0 * SHAPE.in_channels * voxels / layout.sp
            assert mixed.saved - local_input - fixed == pytest.approx((fp32.saved - fixed) / 2)
            assert mixed.activation_memory < 0.6 * fp32.activation_memory
            if layout.sp == 1:  # the input counted both ways: the batch itself, its 16-bit copy
                assert mixed.activation_memory - fixed == pytest.approx((fp32.activation_memory - fixed) / 2)
            assert mixed.parameters == fp32.parameters == 4 * psi and mixed.optimizer == fp32.optimizer == 8 * psi
            assert fp32.parameter_copies == 0 and 0 < mixed.parameter_copies <= 2 * psi
    # the batch: not the step's in fp32 (it is saved as it is), its 16-bit copy is under bf16
    fp32, bf16 = vit_memory(SHAPE, kernel="fused"), vit_memory(SHAPE, kernel="fused", precision="bf16")
    assert fp32.batch == bf16.batch == 4 * 4 * 96**3
    assert fp32.activation_memory == fp32.saved + fp32.batch and bf16.activation_memory == bf16.saved


def test_the_math_kernel_keeps_its_probabilities_in_fp32():
    """torch's math attention casts 16-bit Q, K, V up and computes its probabilities in fp32: they do not halve."""
    fp32, bf16 = vit_memory(SHAPE, kernel="math"), vit_memory(SHAPE, kernel="math", precision="bf16")
    assert bf16.scores == fp32.scores == SHAPE.layers * SHAPE.heads * SHAPE.tokens**2 * 4
    assert bf16.activation_memory > 0.6 * fp32.activation_memory


def test_bf16_halves_the_activations_sent_not_the_gradients():
    shape = ViTShape((32, 32, 32), 4, 2, 48, 4)
    for attention in ("allgather-kv", "ulysses"):
        layout = SequenceLayout(sp=4, attention=attention)
        fp32 = communication_bytes(shape, layout, dp=2, cost="gloo")
        bf16 = communication_bytes(shape, layout, dp=2, cost="gloo", precision="bf16")
        assert bf16.attention == pytest.approx(fp32.attention / 2)
        assert bf16.decoder_gather == pytest.approx(fp32.decoder_gather / 2)
        assert bf16.sp_gradients == fp32.sp_gradients and bf16.dp_gradients == fp32.dp_gradients
    axial = ViTShape((32, 32, 32), 4, 2, 48, 4, attention="axial")
    dsp = SequenceLayout(sp=4, attention="dsp")
    assert (communication_bytes(axial, dsp, precision="fp16").attention
            == pytest.approx(communication_bytes(axial, dsp).attention / 2))


def parameter_copy(tensor: torch.Tensor, parameters: set[int]) -> bool:
    """Whether a saved tensor is (a view of) autocast's cast of a parameter."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0",
                                                       "PermuteBackward0", "UnsafeViewBackward0"):
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    return id(getattr(node.next_functions[0][0], "variable", None)) in parameters


@pytest.mark.parametrize("attention", ["full", "axial"])
@pytest.mark.parametrize("kernel", ["math", "fused"])
@pytest.mark.parametrize("config", SHAPES)
def test_the_bf16_saved_activations_are_what_autograd_saves_under_autocast(config, kernel, attention):
    """At the forward's end under ``torch.autocast(cpu, bfloat16)`` with the loss in fp32: every tensor autograd
    saved, less the parameters and their bf16 copies (counted apart, at most the seed's 2 bytes a parameter), the
    batch and the target; the input's bf16 copy is the step's."""
    tile, patch, layers, embed_dim, heads, mlp_ratio, features = config
    torch.manual_seed(0)
    model = ViTSeg(4, 3, tile, patch=patch, layers=layers, embed_dim=embed_dim, heads=heads, mlp_ratio=mlp_ratio,
                   decoder_features=features, attention=attention)
    shape = ViTShape(tile, patch, layers, embed_dim, heads, mlp_ratio, features, 4, 3, attention)
    x, y = torch.randn(1, 4, *tile), torch.rand(1, 3, *tile)
    parameters = {id(p) for p in model.parameters()}
    given = {t.untyped_storage().data_ptr() for t in [x, y, *model.parameters()]}
    saved: dict[int, int] = {}
    copies: dict[int, int] = {}
    dtypes: set[torch.dtype] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in given:
            (copies if parameter_copy(tensor, parameters) else saved)[storage.data_ptr()] = storage.nbytes()
            dtypes.add(tensor.dtype)
        return tensor

    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)
    assert logits.dtype == torch.bfloat16 and torch.bfloat16 in dtypes
    predicted = vit_memory(shape, kernel=kernel, precision="bf16")
    assert predicted.saved == pytest.approx(sum(saved.values()), rel=0.03)
    assert 0 < sum(copies.values()) <= 2 * vit_parameters(shape)


def test_plan_counts_the_precisions_bytes(tmp_path, capsys):
    """``distmis plan --precision`` (default: the spec's ``training.precision``): the activations column is the
    model's activation memory of the precision asked for, halved (fused kernel) under bf16."""
    from pathlib import Path

    from distmis.cli.main import main
    from distmis.parallel.planner import Machine, plan_layouts
    from distmis.spec import apply_config, load_spec

    spec_path = Path(__file__).parents[2] / "search_spaces" / "vit_sp.yaml"
    spec = apply_config(load_spec(spec_path), {"model.params.attention_kernel": "fused"})
    machine = Machine(ranks=4, memory_per_rank=6e9)
    fp32 = {(r.patch, r.sp, r.attention): r for r in plan_layouts(spec, machine)}
    bf16 = {(r.patch, r.sp, r.attention): r for r in plan_layouts(spec, machine, precision="bf16")}
    as_spec = {(r.patch, r.sp, r.attention): r
               for r in plan_layouts(apply_config(spec, {"training.precision": "bf16"}), machine)}
    assert fp32.keys() == bf16.keys() == as_spec.keys()
    for key, row in bf16.items():
        assert row.memory.activation_memory < 0.6 * fp32[key].memory.activation_memory
        assert row.memory.activation_memory == as_spec[key].memory.activation_memory
        assert row.comm.total < fp32[key].comm.total or key[1] == 1
    outputs = {}
    for precision in ("fp32", "bf16"):
        assert main(["plan", str(spec_path), "--ranks", "4", "--memory-per-rank", "6GB", "--kernel", "fused",
                     "--precision", precision, "--output", str(tmp_path)]) == 0
        outputs[precision] = capsys.readouterr().out
    assert "precision bf16" in outputs["bf16"] and "activations MiB" in outputs["bf16"]
    for precision, rows in (("fp32", fp32), ("bf16", bf16)):
        for (patch, sp, attention), row in rows.items():
            cells = f"| {patch} | {row.tokens} | {sp} | {row.dp} | {attention} | {row.memory.peak / 2**30:.2f} | " \
                    f"{row.memory.activation_memory / 2**20:.1f} |"
            assert any(line.startswith(cells) for line in outputs[precision].splitlines()), cells


def test_degree_auto_and_the_trials_predictions_count_the_precision(tmp_path):
    """A budget between bf16's and fp32's peaks: bf16 fits one degree lower; a bf16 trial's MLflow predictions are
    bf16's."""
    from distmis.perf.sizing import PROCESS_RESERVE, auto_degree

    shape = ViTShape((96, 96, 96), 4, 2, 96, 4, 4.0, 16, 4, 1)
    peak32 = vit_memory(shape, kernel="fused").peak
    peak16 = vit_memory(shape, kernel="fused", precision="bf16").peak
    assert peak16 < peak32
    budget = PROCESS_RESERVE + (peak16 + peak32) / 2
    kwargs = dict(heads=4, model_attention="full", attention="ulysses", decoder="gather", split="ordered", batch=1,
                  kernel="fused", memory_per_worker=budget, max_degree=4)
    assert auto_degree(shape, precision="bf16", **kwargs).degree == 1  # type: ignore[arg-type]
    chosen = auto_degree(shape, **kwargs)  # type: ignore[arg-type]
    assert chosen.degree is not None and chosen.degree > 1

    from distmis.spec import resolve_layout, validate_spec
    from distmis.tracking.predicted import predict_trial
    from tests.conftest import small_spec_tree

    tree = small_spec_tree(tmp_path / "data", model={"name": "vit-seg", "framework": "torch", "params": {
        "patch": 8, "layers": 1, "embed_dim": 32, "heads": 2, "decoder_features": 8, "attention_kernel": "fused"}})
    tree["training"]["tile"] = [16, 16, 16]
    spec32 = validate_spec(tree)
    tree["training"]["precision"] = "bf16"
    spec16 = validate_spec(tree)
    p32, p16 = predict_trial(spec32, resolve_layout(spec32)), predict_trial(spec16, resolve_layout(spec16))
    assert p16["predicted_flops_per_step"] == p32["predicted_flops_per_step"]
    shape16 = ViTShape((16, 16, 16), 8, 1, 32, 2, 4.0, 8, 4, 1)
    expected = vit_memory(shape16, batch=2, kernel="fused", precision="bf16")  # training.batch_size
    assert p16["predicted_step_memory_mb"] == pytest.approx(expected.step / 2**20)
    assert p16["predicted_step_memory_mb"] != pytest.approx(p32["predicted_step_memory_mb"])
