"""Mixed precision in the torch trainer and the Keras U-Net (issue 37), on real TFRecords of a tiny synthetic data set:
autocast really on in the forward (an activation's dtype, read by a forward hook), fp32 master weights, gradients
and Adam state, the loss and probabilities in fp32, fp16's loss scaler and its state through a checkpoint, where
each precision is refused and why; the Keras policy on the layers, never on the next model built."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import apply_config, validate_spec
from distmis.train.precision import TorchPrecision, check_precision_device, cpu_float16_supported
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer

UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}
VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"patch": 4, "layers": 1, "embed_dim": 16, "heads": 2, "decoder_features": 8}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    spec = validate_spec(small_spec_tree(tmp / "data", model=UNET))
    return spec, prepare_data(spec, tmp / "out", progress=False).tfrecord_dir


def trial(prepared, model: dict, precision: str):
    spec, _ = prepared
    tree = spec.model_dump(mode="json")
    tree["model"] = model
    tree["training"]["tile"] = [16, 16, 16] if model["name"] == "vit-seg" else None
    return apply_config(validate_spec(tree), {"training.precision": precision})


def activation_dtypes(module: torch.nn.Module, kinds: tuple[type, ...]) -> tuple[list[torch.dtype], object]:
    """The output dtypes of every ``kinds`` submodule's forwards, as they happen; and the hooks' handles."""
    seen: list[torch.dtype] = []
    handles = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
               for m in module.modules() if isinstance(m, kinds)]
    return seen, handles


@pytest.mark.parametrize("model, layers", [(UNET, (torch.nn.Conv3d,)), (VIT, (torch.nn.Linear, torch.nn.Conv3d))])
def test_bf16_trains_under_autocast_on_fp32_master_weights(prepared, model, layers):
    trainer = local_trainer(trial(prepared, model, "bf16"), prepared[1])
    seen, handles = activation_dtypes(trainer.model, layers)
    loss = trainer.train_epoch(1)
    for handle in handles:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}  # every convolution (and projection) computed in bf16
    assert np.isfinite(loss)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in trainer.model.parameters() if p.grad is not None} == {torch.float32}
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    assert trainer.precision.scaler is None
    # validation and prediction run the same autocast; the probabilities are fp32
    seen, handles = activation_dtypes(trainer.model, layers)
    _case, image, _label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    for handle in handles:
        handle.remove()
    assert set(seen) == {torch.bfloat16} and prob.dtype == np.float32 and np.all((prob >= 0) & (prob <= 1))
    scores = trainer.validate()
    assert np.isfinite(scores.loss) and 0 <= scores.dice <= 1


def test_fp32_runs_no_autocast(prepared):
    trainer = local_trainer(trial(prepared, UNET, "fp32"), prepared[1])
    seen, handles = activation_dtypes(trainer.model, (torch.nn.Conv3d,))
    trainer.train_epoch(1)
    for handle in handles:
        handle.remove()
    assert set(seen) == {torch.float32} and not trainer.precision.mixed


def test_the_loss_is_computed_in_fp32_from_a_16_bit_output():
    precision = TorchPrecision("bf16", "cpu")
    seen = []

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((output.dtype, target.dtype, torch.is_autocast_enabled("cpu")))
        return (output - target).square().mean()

    with precision.autocast():
        output = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        value = precision.fp32_loss(loss)(output, torch.zeros(2, 4))
    assert output.dtype == torch.bfloat16 and value.dtype == torch.float32
    assert seen == [(torch.float32, torch.float32, False)]
    assert TorchPrecision("fp32", "cpu").fp32_loss(loss) is loss


def test_fp16_where_the_cpu_has_float16_else_refused_with_the_reason(prepared):
    """This CPU's float16 instructions decide: fp16 trains with a loss scaler whose state a checkpoint keeps, or the
    trainer is refused saying why and what to use."""
    spec = trial(prepared, UNET, "fp16")
    if not cpu_float16_supported():
        with pytest.raises(ValueError, match="float16 instructions .* Use 'bf16'"):
            local_trainer(spec, prepared[1])
        return
    trainer = local_trainer(spec, prepared[1])
    seen, handles = activation_dtypes(trainer.model, (torch.nn.Conv3d,))
    assert np.isfinite(trainer.train_epoch(1))
    for handle in handles:
        handle.remove()
    assert set(seen) == {torch.float16} and {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert isinstance(trainer.precision.scaler, torch.amp.GradScaler)
    assert trainer.precision.scaler.get_scale() == 2.0**16  # no overflow on this data


def test_fp16_scaler_state_round_trips_through_a_checkpoint(prepared, tmp_path):
    """save_state keeps the scaler (scale and growth tracker); a new trainer's load_state restores it and goes on
    exactly as the first does (same loss, same weights)."""
    spec = trial(prepared, UNET, "fp16" if cpu_float16_supported() else "bf16")
    if spec.training.precision != "fp16":  # the scaler cannot be built here: the refusal is tested above
        with pytest.raises(ValueError, match="float16"):
            TorchPrecision("fp16", "cpu")
        return
    first = local_trainer(spec, prepared[1])
    first.train_epoch(1)
    first.precision.scaler.update(new_scale=1024.0)  # a scale the checkpoint must carry
    first.save_state(tmp_path)
    assert "scaler" in torch.load(tmp_path / "trainer.pt", weights_only=True)
    second = local_trainer(spec, prepared[1])
    assert second.precision.scaler.get_scale() == 2.0**16
    second.load_state(tmp_path, epoch=1)
    assert second.precision.state_dict() == first.precision.state_dict()
    assert second.precision.scaler.get_scale() == 1024.0
    assert second.train_epoch(2) == first.train_epoch(2)
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_overflow_skips_the_step_and_backs_the_scale_off():
    """fp16's scaler in :meth:`TorchPrecision.step` (alone: no group to agree with); on a CPU without float16 the
    scaler is refused where it would be built."""
    if not cpu_float16_supported():
        with pytest.raises(ValueError, match="float16"):
            TorchPrecision("fp16", "cpu")
        return
    precision = TorchPrecision("fp16", "cpu")
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    with precision.autocast():
        out = layer(torch.ones(1, 3))
    precision.backward(out.float().sum() * float("inf"))
    assert precision.step(optimizer) is False
    assert precision.scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    optimizer.zero_grad()
    with precision.autocast():
        out = layer(torch.ones(1, 3))
    precision.backward(out.float().sum())
    assert precision.step(optimizer) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


def test_where_a_precision_cannot_train_it_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="AVX512-FP16 or AMX-FP16.*Use 'bf16'"):
        check_precision_device("fp16", "cpu", cpu_float16=False)
    check_precision_device("fp16", "cpu", cpu_float16=True)
    check_precision_device("bf16", "cpu")
    with pytest.raises(ValueError, match="bfloat16 arithmetic.*'fp16'"):
        check_precision_device("bf16", "cuda", cuda_bfloat16=False)
    check_precision_device("fp16", "cuda")
    with pytest.raises(ValueError, match="must be one of"):
        check_precision_device("fp8", "cpu")


# --------------------------------------------------------------------------- Keras
def test_the_keras_policy_is_each_layers_and_never_leaks_to_the_next_model():
    import keras

    from distmis.models.unet3d_tf import build_unet3d

    global_policy = keras.config.dtype_policy().name
    for policy, compute in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
        model = build_unet3d(in_channels=2, num_classes=1, base_filters=4, levels=3, dtype_policy=policy)
        body = [layer for layer in model.layers if layer.name not in ("image", "head")]
        assert {layer.dtype_policy.name for layer in body} == {policy}
        assert {layer.compute_dtype for layer in body} == {compute}
        assert {w.dtype for w in model.weights} == {"float32"}  # the master weights
        head = model.get_layer("head")
        assert head.compute_dtype == "float32" and model.output.dtype == "float32"
        if policy == "mixed_bfloat16":  # TensorFlow's CPU kernels run bfloat16 (float16 max pooling: GPUs only)
            out = model(np.zeros((1, 8, 8, 8, 2), np.float32))
            assert keras.ops.convert_to_numpy(out).dtype == np.float32
        assert keras.config.dtype_policy().name == global_policy == "float32"
        plain = build_unet3d(in_channels=2, num_classes=1, base_filters=4, levels=3)
        assert {layer.compute_dtype for layer in plain.layers} == {"float32"}
        assert plain.count_params() == model.count_params()
    with pytest.raises(ValueError, match="dtype_policy"):
        build_unet3d(dtype_policy="float16")


def test_keras_fp16_is_refused_without_a_gpu(prepared):
    """TensorFlow's CPU max pooling has no float16 kernel: the trainer says so (as the spec's checks do)."""
    import tensorflow as tf

    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    assert not tf.config.list_physical_devices("GPU")
    spec, data = prepared
    tree = spec.model_dump(mode="json")
    tree["model"] = {"name": "unet3d", "framework": "tensorflow", "params": {"base_filters": 4, "levels": 3}}
    tree["parallelism"] = {"resources_per_trial": {"cpu": 1, "gpu": 1}}  # the spec's check lets it through
    tf_spec = apply_config(validate_spec(tree), {"training.precision": "fp16"})
    with pytest.raises(ValueError, match="needs a GPU.*MaxPool3D.*'bf16'"):
        UNetTrainer(tf_spec, data, layout=resolve_layout(tf_spec))


@pytest.mark.slow  # a traced TensorFlow trainer, 2 epochs
def test_a_keras_bf16_trainer_trains_in_bf16_and_restarts_only_for_bf16(prepared):
    import keras

    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    spec, data = prepared
    tree = spec.model_dump(mode="json")
    tree["model"] = {"name": "unet3d", "framework": "tensorflow", "params": {"base_filters": 4, "levels": 3}}
    bf16 = apply_config(validate_spec(tree), {"training.precision": "bf16"})
    trainer = UNetTrainer(bf16, data, layout=resolve_layout(bf16))
    assert trainer.model.get_layer("down1_conv1").compute_dtype == "bfloat16"
    assert not isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    metrics = [trainer.run_epoch(epoch) for epoch in (1, 2)]
    assert all(np.isfinite(m.train_loss) and np.isfinite(m.val_loss) for m in metrics)
    assert {w.dtype for w in trainer.model.trainable_weights} == {"float32"}
    other_seed = apply_config(bf16, {"training.seed": 5})
    trainer.restart(other_seed, resolve_layout(other_seed))  # same graphs: kept
    with pytest.raises(ValueError, match="same model and training graphs"):
        fp32 = apply_config(bf16, {"training.precision": "fp32"})
        trainer.restart(fp32, resolve_layout(fp32))
    assert keras.config.dtype_policy().name == "float32"
