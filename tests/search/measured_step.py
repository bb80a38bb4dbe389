"""A torch network's real training step, measured as a trial's ``StepMeter`` measures it on a CPU, in a fresh
process (``python -m tests.search.measured_step JSON``): Adam's moments made by a first step, the C heap trimmed,
the resident set's high-water mark reset, a second step, then the high-water mark less the resident set before it,
plus the gradients and Adam's state the step starts with. Prints the bytes."""

from __future__ import annotations

import ctypes
import json
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured_step(config: dict) -> float:
    import torch

    torch.set_num_threads(1)
    from distmis.estimate.step_trace import TrainingStep
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.torch_losses import make_loss

    entry = model_entry(config["network"])
    params = entry.params(**config["params"])
    network = NetworkInput(config["in"], config["out"], tuple(config["tile"]), activation=config["activation"])
    torch.manual_seed(0)
    model = build_network(entry, params, network)
    loss_fn = make_loss(config["loss"], from_logits=entry.output == "logits", activation=network.activation)
    step = TrainingStep(model, network, loss_fn, batch=config["batch"], precision="fp32")
    step()
    ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
    held = sum(t.untyped_storage().nbytes() for t in step.optimizer_state())
    held += sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    step()
    return float(_status("VmHWM") - before + held)


if __name__ == "__main__":
    print(measured_step(json.loads(sys.argv[1])))
