"""The bytes a running piece of torch code holds, operation by operation (:class:`LiveBytes`).

A ``TorchDispatchMode`` sees every operation below autograd, the backward's and the optimizer's included. Each
storage an operation's outputs bring into being is counted once, from its creation until it is freed (a weak
reference's callback), so the count is what the CPU allocator or CUDA's caching allocator holds in tensors at that
moment; views share their base's storage and cost nothing. Under ``FakeTensorMode`` the same happens without memory
or arithmetic: fake tensors have storages of the right size and lifetime, which is how a network's training step is
measured before it runs (:mod:`distmis.estimate.step_trace`).

What a kernel allocates inside itself and frees before it returns (oneDNN's reordered copies, convolution columns,
cuDNN's workspace) never reaches the dispatcher: ``workspace`` adds it, per operation, from the operation and its
arguments (:mod:`distmis.estimate.workspace`).

torch has a tracker of its own (``torch.distributed._tools.mem_tracker.MemTracker``), which sorts memory by module
and kind; it refuses a second iteration of the same modules and has no place for a kernel's workspace, and the
step's peak with the workspace of the operation running at it is what this one is for.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Workspace", "LiveBytes"]

#: ``(operation, its arguments, its outputs) -> bytes`` the operation's kernel holds besides its outputs.
Workspace = Callable[[Any, tuple, Any], int]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage made while it is active; :attr:`peak` is the most held at once, with the
    workspace of the operation running at that moment, and :attr:`moment` names it. Storages that exist before
    (the parameters, the batch) are not counted: give their tensors to :meth:`hold` so that views of them are
    not either."""

    def __init__(self, workspace: Workspace | None = None) -> None:
        super().__init__()
        self.workspace = workspace
        self.live = 0
        self.peak = 0
        self.peak_workspace = 0
        self.moment = ""
        self._storages: dict[int, weakref.ref | None] = {}  # storage -> its weak reference (None: held)

    @staticmethod
    def _key(storage: torch.UntypedStorage) -> int:
        return int(storage._cdata)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages that exist already: neither they nor views of them are counted."""
        for tensor in tensors:
            self._storages[self._key(tensor.untyped_storage())] = None

    def mark(self) -> int:
        """The bytes held now (to read at a point of the step, such as the forward's end)."""
        return self.live

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = self._key(storage)
        if key in self._storages:
            return
        size = int(storage.nbytes())
        self.live += size

        def freed(_: object, key: int = key, size: int = size) -> None:
            self.live -= size
            self._storages.pop(key, None)

        self._storages[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value)
        work = self.workspace(func, args, out) if self.workspace is not None else 0
        if self.live + work > self.peak:
            self.peak, self.peak_workspace, self.moment = self.live + work, work, str(func)
        return out
