"""A trial's training input on one rank: the data order shared out over the data-parallel replicas, and the
batches made by one background thread ahead of the training step.

Each epoch a seeded permutation orders the training cases identically on every rank; data-parallel replica ``r``
of ``n`` takes every ``n``-th case of it (:func:`shard_batches`), and every replica runs the same number of steps,
so gradient all-reduces never wait on a replica that has finished. One thread reads the replica's cases in the
epoch's order, crops and augments them and stacks the batches, at most ``PREFETCH_BATCHES`` ahead of the training
step (:func:`prefetched`).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

import numpy as np
import torch

__all__ = ["PREFETCH_BATCHES", "prefetched", "channels_first", "shard_batches"]

#: Training batches the reading thread may have ready ahead of the training step. Two keep the step fed
#: while the next batch is read, and bound the memory: a batch of tiles each, never whole training volumes.
PREFETCH_BATCHES = 2
#: How often (seconds) a reading thread blocked on a full queue checks whether its consumer has gone.
_PUT_POLL_S = 0.1

T = TypeVar("T")


def prefetched(items: Iterable[T], depth: int = PREFETCH_BATCHES, *, name: str = "distmis-prefetch") -> Iterator[T]:
    """``items``, computed by one background thread at most ``depth`` ahead of the consumer.

    One thread, so the items are made in order (seeded random draws in them happen as without it). An
    exception in the thread is raised in the consumer as itself, its traceback kept, in place of the item
    that failed. Closing the iterator early (``close()``, or garbage collection after the consumer raised)
    stops the thread before it makes another item, and waits for it.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    slots: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            while not stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    put((False, done))
                    return
                if not put((True, item)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, exc))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, entry = slots.get()
            if ok:
                yield entry  # type: ignore[misc]
            elif entry is done:
                return
            else:
                assert isinstance(entry, BaseException)
                raise entry
    finally:
        stop.set()
        thread.join()


def channels_first(volume: np.ndarray) -> torch.Tensor:
    """(h, w, d, C) numpy -> contiguous (C, h, w, d) float32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(volume, -1, 0), dtype=np.float32))


def shard_batches(order: list[int], *, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """The batches of case indices rank ``rank`` trains on, given one epoch's case ``order``.

    The rank's shard is ``order[rank::world_size]``, cut into batches of ``batch_size`` (the last
    one may be shorter). Every rank returns ``max(1, ceil(len(order) / (batch_size * world_size)))``
    batches: a rank whose shard yields fewer repeats its batches from the start. A rank whose shard
    is empty (fewer cases than ranks) borrows one case of the order.
    """
    if not order:
        raise ValueError("no training cases to shard")
    steps = max(1, math.ceil(len(order) / (batch_size * world_size)))
    shard = order[rank::world_size] or [order[rank % len(order)]]
    chunks = [shard[i : i + batch_size] for i in range(0, len(shard), batch_size)]
    return [chunks[k % len(chunks)] for k in range(steps)]
