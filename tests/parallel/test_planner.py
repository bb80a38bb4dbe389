"""The layout planner and `distmis plan` on the shipped vit-seg spec (search_spaces/vit_sp.yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distmis.cli.main import main
from distmis.parallel.planner import Machine, best_layouts, plan_layouts
from distmis.spec import load_spec

SPEC = Path(__file__).parents[2] / "search_spaces" / "vit_sp.yaml"


def test_patch_4_on_96_cubed_needs_four_ranks_under_6_gb():
    """The case the SP benchmark measured: SP=1 fails under a 6 GB cap, SP=4 trains."""
    rows = plan_layouts(load_spec(SPEC), Machine(ranks=4, memory_per_rank=6e9))
    assert {r.patch for r in rows} == {16, 8, 4}  # the spec's patch and its searched ones
    patch4 = [r for r in rows if r.patch == 4]
    assert {(r.sp, r.fits) for r in patch4} == {(1, False), (2, False), (4, True)}
    best = best_layouts(rows)
    assert (best[4].sp, best[4].dp, best[4].attention) == (4, 1, "ulysses")  # fewer bytes than allgather-kv
    assert best[16].sp == 1 and best[16].dp == 4  # small sequences: data parallelism
    assert all(r.tokens == (96 // r.patch) ** 3 for r in rows)


def test_more_memory_moves_the_choice_and_too_little_fits_nothing():
    spec = load_spec(SPEC)
    roomy = best_layouts(plan_layouts(spec, Machine(ranks=4, memory_per_rank=64e9)))
    assert roomy[4].sp == 1  # everything fits: data parallelism is the fastest
    tight = best_layouts(plan_layouts(spec, Machine(ranks=4, memory_per_rank=1e9)))
    assert 4 not in tight and 8 in tight
    with pytest.raises(ValueError, match="reserved"):
        Machine(ranks=4, memory_per_rank=1e8)


def test_plan_command_prints_the_table_draws_the_plot_and_exits_2_when_nothing_fits(tmp_path, capsys):
    assert main(["plan", str(SPEC), "--ranks", "4", "--memory-per-rank", "6GB", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    best_rows = [line for line in out.splitlines() if line.endswith("| best |")]
    assert any(line.startswith("| 4 | 13824 | 4 | 1 | ulysses |") for line in best_rows)
    assert (tmp_path / "plan.png").stat().st_size > 0
    code = main(["plan", str(SPEC), "--ranks", "1", "--memory-per-rank", "1GB", "--output", str(tmp_path),
                 "--set", "model.params.patch=4", "--set", "search.space={}"])
    assert code == 2 and "nothing fits" in capsys.readouterr().out
    # a U-Net, which the performance model does not describe, gets its traced training steps instead
    assert main(["plan", str(Path(__file__).parents[2] / "search_spaces" / "quickstart.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| trial | network | tile |" in out and "| patch | tokens |" not in out


def test_an_axial_model_is_planned_with_dsp_too():
    """On the axial model, DSP joins the strategies; it computes what Ulysses does and sends far less."""
    from distmis.spec import apply_config

    spec = apply_config(load_spec(SPEC), {"model.params.attention": "axial"})
    rows = plan_layouts(spec, Machine(ranks=4, memory_per_rank=6e9))
    by_layout = {(r.patch, r.sp, r.attention): r for r in rows}
    assert (4, 4, "dsp") in by_layout and (4, 2, "dsp") in by_layout and (4, 1, "dsp") not in by_layout
    dsp, ulysses = by_layout[(4, 4, "dsp")], by_layout[(4, 4, "ulysses")]
    assert dsp.flops.matmul == ulysses.flops.matmul
    assert dsp.comm.attention * 8 <= ulysses.comm.attention and dsp.step_seconds < ulysses.step_seconds
    # axial attention's scores are s (gh + gw + gd), not s^2: patch 4 on 96^3 fits one rank
    assert by_layout[(4, 1, "allgather-kv")].fits
    assert not any(r.attention == "dsp" for r in plan_layouts(load_spec(SPEC), Machine(4, 6e9)))
