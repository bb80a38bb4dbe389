"""A torch network's real training step on a CPU, measured by a trial's own :class:`~distmis.train.metering.StepMeter`
in a fresh process (``python -m tests.search.measured_step JSON``): a first step makes Adam's moments, then a second
is measured, the gradients and Adam's state it starts with counted as a trial's first epoch counts them. Prints
the bytes. With ``"stages": K > 1`` (the torch U-Net) the step is a GPipe pipeline of ``K`` gloo processes in one
micro-batch, each measuring its own rank; the largest is printed."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable


def _setup(config: dict) -> tuple[Any, Any, Any, Any]:
    import torch

    torch.set_num_threads(1)
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.torch_losses import make_loss

    entry = model_entry(config["network"])
    params = entry.params(**config["params"])
    network = NetworkInput(config["in"], config["out"], tuple(config["tile"]), activation=config["activation"])
    torch.manual_seed(0)
    model = build_network(entry, params, network)
    loss_fn = make_loss(config["loss"], from_logits=entry.output == "logits", activation=network.activation)
    return entry, network, model, loss_fn


def _measure(step: Callable[[], object], held: Callable[[], float]) -> float:
    import torch

    from distmis.train.metering import StepMeter

    step()
    meter = StepMeter(torch.device("cpu"), held=held)
    meter.start_epoch()
    meter.start_step()
    step()
    meter.end_step()
    return meter.peak_bytes


def _state_bytes(parameters: list, optimizer_state: list) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    return float(sum(t.untyped_storage().nbytes() for t in [*grads, *optimizer_state]))


def measured_step(config: dict) -> float:
    from distmis.estimate.step_trace import TrainingStep

    _, network, model, loss_fn = _setup(config)
    step = TrainingStep(model, network, loss_fn, batch=config["batch"], precision="fp32")
    return _measure(step, lambda: _state_bytes(list(model.parameters()), step.optimizer_state()))


def _stage_rank(rank: int, config: dict, port: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    from distmis.parallel.pipeline import pipeline_unet

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=config["stages"])
    _, network, model, loss_fn = _setup(config)
    tile = tuple(config["tile"])
    pipe = pipeline_unet(model, tile=tile, microbatches=1, batch_size=config["batch"], schedule="gpipe",
                         loss_fn=loss_fn)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    x = torch.rand(config["batch"], network.in_channels, *tile)
    y = (torch.rand(config["batch"], network.out_channels, *tile) > 0.5).float()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x, y)
        optimizer.step()

    state = lambda: [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]  # noqa: E731
    peak = _measure(step, lambda: _state_bytes(pipe.parameters(), state()))
    with open(os.path.join(folder, f"{rank}.json"), "w") as out:
        json.dump(peak, out)
    dist.destroy_process_group()


def measured_pipeline_step(config: dict) -> float:
    """The largest rank's measured step of the U-Net cut into ``config["stages"]`` stages."""
    import torch.multiprocessing as mp

    from distmis.service.net import LOOPBACK, free_port

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_stage_rank, args=(config, free_port(LOOPBACK), folder), nprocs=config["stages"])
        return max(json.load(open(os.path.join(folder, f"{r}.json"))) for r in range(config["stages"]))


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    print(measured_pipeline_step(settings) if settings.get("stages", 1) > 1 else measured_step(settings))
