"""A torch network's real training step on a CPU, measured by a trial's own :class:`~distmis.train.metering.StepMeter`
in a fresh process (``python -m tests.search.measured_step JSON``): a first step makes Adam's moments, then a second
is measured, the gradients and Adam's state it starts with counted as a trial's first epoch counts them. Prints
the bytes."""

from __future__ import annotations

import json
import sys


def measured_step(config: dict) -> float:
    import torch

    torch.set_num_threads(1)
    from distmis.estimate.step_trace import TrainingStep
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.metering import StepMeter
    from distmis.train.torch_losses import make_loss

    entry = model_entry(config["network"])
    params = entry.params(**config["params"])
    network = NetworkInput(config["in"], config["out"], tuple(config["tile"]), activation=config["activation"])
    torch.manual_seed(0)
    model = build_network(entry, params, network)
    loss_fn = make_loss(config["loss"], from_logits=entry.output == "logits", activation=network.activation)
    step = TrainingStep(model, network, loss_fn, batch=config["batch"], precision="fp32")
    step()

    def held() -> float:
        state = sum(t.untyped_storage().nbytes() for t in step.optimizer_state())
        return state + sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)

    meter = StepMeter(torch.device("cpu"), held=held)
    meter.start_epoch()
    meter.start_step()
    step()
    meter.end_step()
    return meter.peak_bytes


if __name__ == "__main__":
    print(measured_step(json.loads(sys.argv[1])))
