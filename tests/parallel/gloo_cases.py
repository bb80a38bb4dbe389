"""Running named cases in a real gloo group, one spawn per world size: the harness of the parallel tests.

Every rank runs every case of ``make_cases(world_size)`` in order and saves what each returned (or the
traceback of an assertion that failed in it) to ``rank<r>.pt``; the tests read those with :func:`case`. An
assertion is raised after a case's collectives, so a failing rank never leaves the others waiting.
"""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from distmis.parallel.mesh import TrialMesh
from distmis.spec.layout import TrialLayout

Cases = dict[str, Callable[[], dict[str, Any]]]


def run_case(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return {"ok": True, **fn()}
    except AssertionError:  # raised after the collectives of the case, so the other ranks do not hang
        return {"ok": False, "error": traceback.format_exc()}


def run_cases(rank: int, world_size: int, out: str, make_cases: Callable[[int], Cases]) -> None:
    """One rank: join the gloo group, run the cases, save their results."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file store, not a TCP store hosted by rank 0: no rank depends on rank 0's process to rendezvous or leave.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, fn in make_cases(world_size).items():
            start = time.perf_counter()
            results[name] = run_case(fn)
            results[name]["seconds"] = time.perf_counter() - start
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        # Every rank done before any tears gloo down: a rank that exits while a peer still talks to it
        # aborts ("terminate called without an active exception"), seen under load.
        dist.barrier()
        dist.destroy_process_group()


def spawn_cases(make_cases: Callable[[int], Cases], world_size: int, out: Path) -> list[dict[str, Any]]:
    """Every rank's results of ``make_cases`` (a module-level function: the spawned processes import it)."""
    import torch.multiprocessing as mp

    mp.spawn(run_cases, args=(world_size, str(out), make_cases), nprocs=world_size, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


def case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's result of case ``name``; fails with every failing rank's traceback."""
    results = [r[name] for r in ranks]
    failures = [f"rank {i}:\n{r['error']}" for i, r in enumerate(results) if not r["ok"]]
    assert not failures, "\n".join(failures)
    return results


def mesh_layout(*, dp: int = 1, sp: int = 1, pp: int = 1) -> TrialLayout:
    """A trial layout of ``dp x sp x pp`` workers (the meshes of these tests)."""
    return TrialLayout(dp=dp, sp=sp, pp=pp, distributed=True, cpu=1, gpu=0, lr=1e-3, lr_scaling="none")


def replicas_on(ranks: list[int]) -> TrialMesh | None:
    """A DP-only mesh over some of the world's ``ranks`` (a reference run beside the world's mesh); None on a rank
    outside them. Its SP group is a group of the rank alone, not None: a model parallelized over it runs on its own,
    where None would mean the default group (the whole world). Collective: every rank calls it."""
    import torch.distributed as dist

    group = dist.new_group(ranks)
    alone = {r: dist.new_group([r]) for r in ranks}
    me = dist.get_rank()
    if me not in ranks:
        return None
    return TrialMesh(mesh_layout(dp=len(ranks)), rank=me, dp_rank=ranks.index(me), dp_size=len(ranks),
                     dp_group=group, sp_group=alone[me], dp_ranks=tuple(ranks), sp_ranks=(me,), pp_ranks=(me,))
