"""The trial mesh: one rank matrix of shape (dp, sp, pp), its groups along each axis, and the process groups of a
real gloo world of 4 processes made from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distmis.parallel.mesh import TrialMesh
from tests.parallel.gloo_cases import Cases, case, mesh_layout, spawn_cases


def groups(layout_args: dict[str, int]) -> dict[str, list[tuple[int, ...]]]:
    layout = mesh_layout(**layout_args)
    return {axis: TrialMesh.axis_groups(layout, axis) for axis in ("dp", "sp", "pp")}


def test_rank_matrix_dp2_sp2():
    layout = mesh_layout(dp=2, sp=2)
    assert TrialMesh.rank_matrix(layout).tolist() == [[[0], [1]], [[2], [3]]]
    assert groups({"dp": 2, "sp": 2}) == {"dp": [(0, 2), (1, 3)], "sp": [(0, 1), (2, 3)],
                                          "pp": [(0,), (1,), (2,), (3,)]}


def test_rank_matrix_dp2_pp2():
    assert TrialMesh.rank_matrix(mesh_layout(dp=2, pp=2)).tolist() == [[[0, 1]], [[2, 3]]]
    assert groups({"dp": 2, "pp": 2}) == {"dp": [(0, 2), (1, 3)], "sp": [(0,), (1,), (2,), (3,)],
                                          "pp": [(0, 1), (2, 3)]}


def test_rank_matrix_sp4():
    assert TrialMesh.rank_matrix(mesh_layout(sp=4)).tolist() == [[[0], [1], [2], [3]]]
    assert groups({"sp": 4}) == {"dp": [(0,), (1,), (2,), (3,)], "sp": [(0, 1, 2, 3)], "pp": [(0,), (1,), (2,), (3,)]}


def test_consecutive_ranks_share_an_sp_group_as_before():
    """SP groups of consecutive ranks, DP groups across them, for a larger world too."""
    assert groups({"dp": 2, "sp": 4})["sp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups({"dp": 2, "sp": 4})["dp"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups({"dp": 3, "pp": 2})["dp"] == [(0, 2, 4), (1, 3, 5)]


def test_a_local_mesh_is_one_process_whatever_the_layout():
    layout = mesh_layout(dp=2, sp=2)
    local = TrialMesh.local(layout)
    assert local.layout is layout and local.is_local and local.world_size == 1
    assert (local.dp_size, local.sp_size, local.pp_size) == (1, 1, 1)
    assert (local.dp_group, local.sp_group, local.pp_group) == (None, None, None)
    with pytest.raises(ValueError, match="axis must be one of"):
        TrialMesh.axis_groups(layout, "tp")
    with pytest.raises(ValueError, match="sp_rank must lie in \\[0, 2\\), got 2"):
        TrialMesh(layout, sp_rank=2, sp_size=2)


def test_build_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        TrialMesh.build(mesh_layout())


# --------------------------------------------------------------------------- a real gloo world of 4
LAYOUTS = {"dp2xsp2": {"dp": 2, "sp": 2}, "dp2xpp2": {"dp": 2, "pp": 2}, "sp4": {"sp": 4}, "dp4": {"dp": 4}}


def mesh_case(layout_args: dict[str, int]) -> dict[str, Any]:
    """This rank's mesh, and the sum of the ranks over each of its groups (all-reduced for real)."""
    import torch
    import torch.distributed as dist

    mesh = TrialMesh.build(mesh_layout(**layout_args))
    sums = {}
    for axis in ("dp", "sp", "pp"):
        group, size = getattr(mesh, f"{axis}_group"), getattr(mesh, f"{axis}_size")
        assert (group is None) == (size == 1)
        value = torch.tensor([float(mesh.rank)])
        if group is not None:
            dist.all_reduce(value, group=group)
        sums[axis] = value.item()
    return {"rank": mesh.rank, "sums": sums,
            **{f"{axis}_{field}": getattr(mesh, f"{axis}_{field}") for axis in ("dp", "sp", "pp")
               for field in ("rank", "size", "ranks")}}


def wrong_world_case() -> dict[str, Any]:
    try:
        TrialMesh.build(mesh_layout(dp=2))
    except RuntimeError as error:
        return {"error": str(error)}
    raise AssertionError("a layout of 2 ranks was built over a world of 4")


def make_cases(world_size: int) -> Cases:
    cases = {name: (lambda args=args: mesh_case(args)) for name, args in LAYOUTS.items()}
    cases["wrong world"] = wrong_world_case
    return cases


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return spawn_cases(make_cases, 4, Path(tmp_path_factory.mktemp("mesh")))


@pytest.mark.slow  # a real gloo group of 4 processes
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_groups_are_the_rank_matrix_s(ranks, name):
    layout = mesh_layout(**LAYOUTS[name])
    for r, result in enumerate(case(ranks, name)):
        assert result["rank"] == r
        for axis in ("dp", "sp", "pp"):
            members = next(g for g in TrialMesh.axis_groups(layout, axis) if r in g)
            assert result[f"{axis}_ranks"] == members and result[f"{axis}_size"] == len(members)
            assert result[f"{axis}_rank"] == members.index(r)
            assert result["sums"][axis] == sum(members)  # the group really holds those ranks


@pytest.mark.slow  # a real gloo group of 4 processes
def test_a_world_that_is_not_the_layouts_is_refused(ranks):
    for result in case(ranks, "wrong world"):
        assert "layout has 2 rank(s)" in result["error"] and "holds 4" in result["error"]
