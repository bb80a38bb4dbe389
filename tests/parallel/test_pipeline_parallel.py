"""Pipeline parallelism of the U-Net against one device, for real: gloo groups of 2 and 4 ranks on this machine.

One spawn per world size runs every configuration in a loop; each rank checks its own stage against the
single-device reference it computes itself (same seeds), and writes what it found to a file the tests read.

Group normalization makes the pipelined U-Net the same function as on one device whatever the micro-batches:
it normalizes each sample on its own, and the schedule averages the micro-batches' gradients, as the mean loss
over the batch does. fp32 sums taken in another order (per micro-batch, then over them) leave differences of
a few 1e-8, so the tolerance is 1e-5. Batch normalization normalizes each micro-batch by its own statistics: it
is exact with one micro-batch, and another function with more.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from distmis.models.unet3d_torch import UNet3D
from distmis.train.torch_losses import make_loss
from tests.parallel.gloo_cases import Cases, case, mesh_layout, replicas_on, spawn_cases

pytestmark = pytest.mark.slow  # real gloo process groups of 2 and 4 ranks

TILE = (16, 16, 16)
BATCH = 4
TOL = dict(atol=1e-5, rtol=1e-5)
LR = 0.5


def make_model(norm: str = "group") -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=2, num_classes=2, base_filters=4, levels=3, norm=norm, norm_groups=2)


def make_batch(seed: int = 1, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, *TILE, generator=g)
    return x, (torch.rand(batch, 2, *TILE, generator=g) > 0.7).float()


LOSS = make_loss("dice-bce")


def reference_step(model: UNet3D, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One device: the batch's loss, its gradients in ``model`` and one SGD step."""
    model.train()
    loss = LOSS(model(x), y)
    loss.backward()
    return loss.detach()


def sgd_step(parameters: list[torch.nn.Parameter]) -> None:
    torch.optim.SGD(parameters, lr=LR).step()


def check_stage_against(pipe, reference: UNet3D) -> float:
    """Every gradient of this rank's stage equals the reference's parameter of the same name; the largest error."""
    names = {id(p): n for n, p in pipe.model.named_parameters()}
    expected = dict(reference.named_parameters())
    assert pipe.parameters(), "a stage without parameters"
    error = 0.0
    for p in pipe.parameters():
        torch.testing.assert_close(p.grad, expected[names[id(p)]].grad, **TOL)
        error = max(error, (p.grad - expected[names[id(p)]].grad).abs().max().item())
    return error


def pipeline_case(schedule: str, microbatches: int, norm: str = "group") -> dict[str, Any]:
    """The whole world as one pipeline: loss, gradients, the weights after a step and after gathering them."""
    from distmis.parallel.pipeline import pipeline_unet

    base = make_model(norm)
    x, y = make_batch()
    reference = copy.deepcopy(base)
    expected_loss = reference_step(reference, x, y)
    pipe = pipeline_unet(copy.deepcopy(base), tile=TILE, microbatches=microbatches, schedule=schedule, loss_fn=LOSS,
                         batch_size=BATCH)
    pipe.model.train()
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
    torch.testing.assert_close(loss, expected_loss, **TOL)  # on every stage, not only the last
    error = check_stage_against(pipe, reference)
    sgd_step(pipe.parameters())
    sgd_step(list(reference.parameters()))
    pipe.gather_weights()  # every rank now holds every stage's weights and running statistics
    for (name, actual), expected in zip(pipe.model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return {"error": error, "bounds": pipe.bounds, "stage": pipe.stage_index}


def short_batch_case(schedule: str, microbatches: int, samples: int = BATCH - 1) -> dict[str, Any]:
    """A batch of ``samples`` (fewer than the configured ``BATCH``) through the pipeline :func:`batch_plan` gives it:
    its loss and gradients are the short batch's own on one device."""
    import torch.distributed as dist

    from distmis.parallel.pipeline import batch_plan, pipeline_unet

    base = make_model()
    x, y = make_batch(seed=3, batch=samples)
    reference = copy.deepcopy(base)
    expected_loss = reference_step(reference, x, y)
    plan = batch_plan(samples, batch_size=BATCH, microbatches=microbatches, schedule=schedule,  # type: ignore[arg-type]
                      stages=dist.get_world_size())
    pipe = pipeline_unet(copy.deepcopy(base), tile=TILE, microbatches=plan.microbatches, schedule=plan.schedule,
                         loss_fn=LOSS, batch_size=samples)
    assert pipe.plan == plan
    pipe.model.train()
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
    torch.testing.assert_close(loss, expected_loss, **TOL)
    return {"error": check_stage_against(pipe, reference), "plan": (plan.microbatches, plan.schedule)}


def batch_norm_micro_batches_case() -> dict[str, Any]:
    """Batch norm with two micro-batches: each normalized by its own statistics, so the gradients are others:
    the largest difference of this stage's gradients, relative to the largest gradient."""
    from distmis.parallel.pipeline import pipeline_unet

    base = make_model("batch")
    x, y = make_batch()
    reference = copy.deepcopy(base)
    reference_step(reference, x, y)
    pipe = pipeline_unet(copy.deepcopy(base), tile=TILE, microbatches=2, loss_fn=LOSS, batch_size=BATCH)
    pipe.model.train()
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
    names = {id(p): n for n, p in pipe.model.named_parameters()}
    expected = dict(reference.named_parameters())
    pairs = [(p.grad, expected[names[id(p)]].grad) for p in pipe.parameters()]
    largest = max(e.abs().max().item() for _, e in pairs)
    return {"difference": max((a - e).abs().max().item() for a, e in pairs) / largest}


def dp_pp_case() -> dict[str, Any]:
    """4 ranks: DP=2 x PP=2 against DP=2 x PP=1, both for real, after one SGD step."""
    import torch.distributed as dist

    from distmis.parallel.collectives import all_reduce_gradients
    from distmis.parallel.mesh import TrialMesh
    from distmis.parallel.pipeline import pipeline_unet

    base = make_model()
    x, y = make_batch(batch=2 * BATCH)
    # DP=2 x PP=1 on ranks 0 and 2 (every rank takes part in making the groups): each replica its half.
    plain = replicas_on([0, 2])
    replica = copy.deepcopy(base)
    if plain is not None:
        shard = slice(plain.dp_rank * BATCH, (plain.dp_rank + 1) * BATCH)
        reference_step(replica, x[shard], y[shard])
        all_reduce_gradients(replica.parameters(), plain.dp_group, "mean")
        sgd_step(list(replica.parameters()))
    for tensor in replica.state_dict().values():  # everyone gets rank 0's result
        dist.broadcast(tensor, src=0)
    # DP=2 x PP=2: pipelines (0, 1) and (2, 3), DP groups (0, 2) and (1, 3)
    groups = TrialMesh.build(mesh_layout(dp=2, pp=2))
    assert groups.pp_ranks in [(0, 1), (2, 3)] and groups.dp_size == 2
    shard = slice(groups.dp_rank * BATCH, (groups.dp_rank + 1) * BATCH)
    pipe = pipeline_unet(copy.deepcopy(base), tile=TILE, microbatches=2, loss_fn=LOSS, batch_size=BATCH,
                         group=groups.pp_group)
    assert pipe.group_ranks == groups.pp_ranks
    pipe.model.train()
    pipe.train_step(x[shard] if pipe.is_first else None, y[shard] if pipe.is_last else None)
    all_reduce_gradients(pipe.parameters(), groups.dp_group, "mean")
    sgd_step(pipe.parameters())
    pipe.gather_weights()
    for (name, actual), expected in zip(pipe.model.state_dict().items(), replica.state_dict().values()):
        torch.testing.assert_close(actual, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return {}


def dp_pp_short_case() -> dict[str, Any]:
    """4 ranks, DP=2 x PP=2, the replicas' batches of different sizes (``BATCH`` and ``BATCH - 1``: the second
    replica's short batch, each through its own pipeline shape): the stages' gradients averaged over the replicas
    with equal weights are DP=2 x PP=1's, as DDP averages them."""
    from distmis.parallel.collectives import all_reduce_gradients
    from distmis.parallel.mesh import TrialMesh
    from distmis.parallel.pipeline import batch_plan, pipeline_unet

    base = make_model()
    x, y = make_batch(seed=5, batch=2 * BATCH - 1)
    shards = [slice(0, BATCH), slice(BATCH, 2 * BATCH - 1)]
    reference = copy.deepcopy(base)  # every rank computes both replicas' gradients on one device and averages them
    grads = []
    for shard in shards:
        reference.zero_grad(set_to_none=True)
        reference_step(reference, x[shard], y[shard])
        grads.append([p.grad.clone() for p in reference.parameters()])
    for p, *replicas in zip(reference.parameters(), *grads):
        p.grad = sum(replicas) / len(replicas)
    groups = TrialMesh.build(mesh_layout(dp=2, pp=2))
    assert groups.dp_size == 2
    shard = shards[groups.dp_rank]
    samples = shard.stop - shard.start
    plan = batch_plan(samples, batch_size=BATCH, microbatches=2, schedule="gpipe", stages=2)
    pipe = pipeline_unet(copy.deepcopy(base), tile=TILE, microbatches=plan.microbatches, schedule=plan.schedule,
                         loss_fn=LOSS, batch_size=samples, group=groups.pp_group)
    pipe.model.train()
    pipe.train_step(x[shard] if pipe.is_first else None, y[shard] if pipe.is_last else None)
    all_reduce_gradients(pipe.parameters(), groups.dp_group, "mean")
    return {"error": check_stage_against(pipe, reference), "plan": (plan.microbatches, plan.schedule)}


def errors_case() -> dict[str, Any]:
    """Configurations the pipeline refuses, before any stage is made."""
    import torch.distributed as dist

    from distmis.parallel.pipeline import pipeline_unet

    world = dist.get_world_size()
    with pytest.raises(ValueError, match=f"1f1b schedule needs at least as many micro-batches as stages, got 1 for {world}"):
        pipeline_unet(make_model(), tile=TILE, microbatches=1, schedule="1f1b", loss_fn=LOSS, batch_size=BATCH)
    two_levels = UNet3D(in_channels=2, num_classes=2, base_filters=4, levels=2, norm="group", norm_groups=2)
    if world > 3:
        with pytest.raises(ValueError, match=f"U-Net of 2 levels has 3 cells: it cannot be cut into {world} stages"):
            pipeline_unet(two_levels, tile=TILE, microbatches=2, loss_fn=LOSS, batch_size=BATCH)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_unet(make_model(), tile=TILE, microbatches=2, schedule="interleaved", loss_fn=LOSS,  # type: ignore[arg-type]
                      batch_size=BATCH)
    with pytest.raises(ValueError, match="batch of 3 samples must divide into 2 micro-batches"):
        pipeline_unet(make_model(), tile=TILE, microbatches=2, loss_fn=LOSS, batch_size=3)
    return {}


def make_cases(world_size: int) -> Cases:
    """Every configuration this world size runs, by name."""
    cases: dict[str, Callable[[], dict[str, Any]]] = {}
    for microbatches in (1, 2, 4):
        cases[f"gpipe/{microbatches}"] = lambda m=microbatches: pipeline_case("gpipe", m)
    cases[f"1f1b/{world_size}"] = lambda: pipeline_case("1f1b", world_size)
    cases["short/gpipe"] = lambda: short_batch_case("gpipe", 2)
    cases["short/1f1b"] = lambda: short_batch_case("1f1b", world_size)
    cases["batch-norm/1"] = lambda: pipeline_case("gpipe", 1, norm="batch")
    cases["batch-norm/2"] = batch_norm_micro_batches_case
    cases["errors"] = errors_case
    if world_size == 4:
        cases["dp2xpp2"] = dp_pp_case
        cases["dp2xpp2/short"] = dp_pp_short_case
    return cases


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    """Every configuration run once in a real gloo group of 2 ranks and once in one of 4."""
    return {n: spawn_cases(make_cases, n, tmp_path_factory.mktemp(f"pp{n}")) for n in (2, 4)}


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}stages")
def ranks(request, spawned) -> list[dict[str, Any]]:
    return spawned[request.param]


@pytest.mark.parametrize("name", ["gpipe/1", "gpipe/2", "gpipe/4"])
def test_gpipe_equals_one_device(ranks, name):
    results = case(ranks, name)
    assert [r["stage"] for r in results] == list(range(len(ranks)))  # one stage per rank, in rank order
    assert len(results[0]["bounds"]) == len(ranks)


def test_1f1b_equals_one_device(ranks):
    case(ranks, f"1f1b/{len(ranks)}")


def test_a_short_batch_through_its_own_schedule_equals_one_device(ranks):
    # a batch of 3 where 4 are configured: micro-batches of 1 (the largest divisor of 3 no larger than 4 / M)
    assert {r["plan"] for r in case(ranks, "short/gpipe")} == {(3, "gpipe")}
    # 1F1B with one micro-batch per stage configured: 3 micro-batches of 1, fewer than 4 stages: GPipe
    expected = (3, "1f1b") if len(ranks) == 2 else (3, "gpipe")
    assert {r["plan"] for r in case(ranks, "short/1f1b")} == {expected}


def test_batch_norm_is_exact_with_one_micro_batch(ranks):
    case(ranks, "batch-norm/1")


def test_batch_norm_over_micro_batches_is_another_function(ranks):
    differences = [r["difference"] for r in case(ranks, "batch-norm/2")]
    assert max(differences) > 0.1, differences  # not rounding: a tenth of the largest gradient


def test_bad_configurations_are_refused(ranks):
    case(ranks, "errors")


def test_data_times_pipeline_parallel_equals_data_parallel(spawned):
    case(spawned[4], "dp2xpp2")  # 4 ranks: DP=2 x PP=2 against DP=2 x PP=1


def test_replicas_of_different_batch_sizes_average_as_data_parallel(spawned):
    plans = [r["plan"] for r in case(spawned[4], "dp2xpp2/short")]
    assert plans == [(2, "gpipe"), (2, "gpipe"), (3, "gpipe"), (3, "gpipe")]  # replica 1's batch of 3: 3 of 1
